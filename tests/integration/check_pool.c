/*
 * tests/integration/check_pool.c - the pool through the public header only:
 * configuration and its errors, the raw page API under a budget, stats and
 * the three emitters (JSON parsed back with jansson), concurrent lock-free
 * stats readers beside a writer.
 */
#define KVP_EXPERIMENTAL_API
#include <check.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvpool.h"
#include "itest.h"


static kvp_pool *mkpool(uint64_t region, uint64_t budget) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 4;
  c.n_kv_heads = 2;
  c.region_bytes = region;
  c.budget_bytes = budget;
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  ck_assert_ptr_nonnull(p);
  return p;
}

START_TEST(status_names_and_version) {
  ck_assert_str_eq(kvp_err_name(KVP_EBUDGET), "KVP_EBUDGET");
  ck_assert_str_eq(kvp_strerror(KVP_OK), "success");
  ck_assert_str_eq(kvp_err_name(-999), "KVP_E?");
  ck_assert_int_eq(KVP_ENOTSUP, -12); /* values are pinned */
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d", KVP_VERSION_MAJOR, KVP_VERSION_MINOR, KVP_VERSION_PATCH);
  ck_assert_str_eq(kvp_version(), want);
}
END_TEST

/* This program links jemalloc (the Makefile's JEMALLOC_LIBS, as kvpool.pc's
 * Libs), so host metadata comes from its arena; sanitizer builds and
 * KVPOOL_META_MALLOC=libc take libc malloc. The answer never changes. */
START_TEST(metadata_allocator_follows_the_program) {
  const char *env = getenv("KVPOOL_META_MALLOC");
#ifdef KVP_META_LIBC
  const char *want = "libc";
#else
  const char *want = env && strcmp(env, "libc") == 0 ? "libc" : "jemalloc";
#endif
  ck_assert_str_eq(kvp_metadata_allocator(), want);
  kvp_pool *p = mkpool(8 << 20, 0);
  kvp_stats st = {.struct_size = sizeof st};
  ck_ok(kvp_stats_get(p, &st));
  ck_assert_uint_gt(st.metadata_bytes.current, 0);
  kvp_pool_destroy(p);
  ck_assert_str_eq(kvp_metadata_allocator(), want);
}
END_TEST

/* Each bad config fails with its status and a message naming the field. */
START_TEST(config_errors_name_the_field) {
  kvp_pool *p = (kvp_pool *)0x1;
  ck_status(kvp_pool_create(NULL, &p), KVP_EINVAL);
  ck_assert_ptr_null(p);
  kvp_config c;
  kvp_config_init(&c);
  ck_status(kvp_pool_create(&c, NULL), KVP_EINVAL);
#define BAD(stmt, status, field)                                     \
  do {                                                               \
    kvp_config_init(&c);                                             \
    stmt;                                                            \
    ck_status(kvp_pool_create(&c, &p), status);                      \
    ck_assert_msg(strstr(kvp_last_error(), field) != NULL, "%s", kvp_last_error()); \
  } while (0)
  BAD(c.struct_size = 0, KVP_EINVAL, "struct_size");
  BAD(c.struct_size = sizeof c + 8, KVP_EINVAL, "struct_size");
  BAD(c.n_layers = 0, KVP_EINVAL, "n_layers");
  BAD(c.n_kv_heads = KVP_MAX_KV_HEADS + 1, KVP_EINVAL, "n_kv_heads");
  BAD(c.head_dim = 0, KVP_EINVAL, "head_dim");
  BAD(c.k_dtype = (kvp_dtype)7, KVP_EINVAL, "k_dtype");
  BAD(c.v_dtype = (kvp_dtype)-1, KVP_EINVAL, "v_dtype");
  BAD(c.memory = (kvp_mem)3, KVP_EINVAL, "memory");
  BAD(c.region_bytes = 1 << 20, KVP_EINVAL, "region_bytes");
  BAD(c.block_tokens = 1u << 20, KVP_EINVAL, "block_tokens");
  BAD(c.codecs = "k=zstd", KVP_EINVAL, "unknown codec \"zstd\" at column 3");
  BAD(c.policy = "lru:size=9", KVP_EINVAL, "unknown policy \"lru\"");
  BAD(c.policy = "window:sink=4:recnt=8", KVP_EINVAL, "unknown field \"recnt=8\"");
#undef BAD
  kvp_pool_destroy(NULL); /* fine */
}
END_TEST

START_TEST(ledger_moves_region_stays) {
  kvp_pool *p = mkpool(32 << 20, 8 << 20);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.version, KVP_STATS_VERSION);
  ck_assert_uint_eq(s.bytes_reserved, 32 << 20);
  ck_assert_uint_eq(s.budget_bytes, 8 << 20);
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  kvp_page_id ids[64];
  uint64_t req = 0;
  for (int i = 0; i < 64; i++) {
    kvp_page_tag t = {(uint64_t)(i % 3), (uint32_t)i % 4, (uint32_t)i % 2, (kvp_page_type)(i % 3), (uint32_t)i & 1, 0};
    uint64_t bytes = 1000 + 977 * (uint64_t)i;
    ck_ok(kvp_page_alloc(p, bytes, &t, &ids[i]));
    req += bytes;
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_requested.current, req);
  ck_assert_uint_ge(s.bytes_allocated.current, req);
  ck_assert_uint_le(s.bytes_allocated.current, s.bytes_committed.current);
  ck_assert_uint_eq(s.pages.current, 64);
  uint64_t sum = 0;
  for (int i = 0; i < KVP_PAGE_TYPE_COUNT; i++) sum += s.page_types[i].allocated_bytes;
  ck_assert_uint_eq(sum, s.bytes_allocated.current);
  ck_assert_uint_eq(s.kv[0].requested_bytes + s.kv[1].requested_bytes, req);
  kvp_usage u, tot = {0};
  for (uint64_t seq = 0; seq < 3; seq++) {
    ck_ok(kvp_stats_breakdown(p, KVP_DIM_SEQ, seq, &u));
    tot.requested_bytes += u.requested_bytes;
  }
  ck_assert_uint_eq(tot.requested_bytes, req);
  ck_status(kvp_stats_breakdown(p, KVP_DIM_SEQ, 99, &u), KVP_ENOENT);
  ck_status(kvp_stats_breakdown(p, KVP_DIM_LAYER, 4, &u), KVP_ENOENT);
  ck_ok(kvp_stats_breakdown(p, KVP_DIM_LAYER, 3, &u));
  for (int i = 0; i < 64; i++) {
    ck_ok(kvp_page_free(p, ids[i]));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  ck_assert_uint_eq(s.allocs, 64);
  ck_assert_uint_eq(s.frees, 64);
  ck_assert_uint_eq(s.device_total_bytes, 32 << 20); /* host region: resident bytes of it */
  ck_assert_uint_le(s.device_used_bytes, 32 << 20);
  ck_assert_uint_gt(s.metadata_bytes.current, 0);
  kvp_pool_destroy(p);
}
END_TEST

static json_t *stats_json(kvp_pool *p) {
  size_t len = 0;
  ck_status(kvp_stats_write(p, KVP_STATS_JSON, NULL, 0, &len), KVP_ENOSPC);
  char *buf = malloc(len + 1);
  ck_ok(kvp_stats_write(p, KVP_STATS_JSON, buf, len + 1, &len));
  ck_assert_uint_eq(strlen(buf), len);
  json_error_t err;
  json_t *j = json_loads(buf, 0, &err);
  ck_assert_msg(j != NULL, "JSON does not parse: %s at %d: %.200s", err.text, err.position, buf);
  free(buf);
  return j;
}

START_TEST(emitters_agree_with_stats) {
  kvp_pool *p = mkpool(16 << 20, 0);
  kvp_page_id a, b;
  kvp_page_tag t = {42, 3, 1, KVP_PAGE_SCALES, 1, 5};
  ck_ok(kvp_page_alloc(p, 300, &t, &a));
  t.type = KVP_PAGE_CODES;
  ck_ok(kvp_page_alloc(p, 5000, &t, &b));
  json_t *j = stats_json(p);
  ck_assert_int_eq(json_integer_value(json_object_get(j, "version")), KVP_STATS_VERSION);
  json_t *alloc = json_object_get(j, "bytes.allocated");
  ck_assert_int_eq(json_integer_value(json_object_get(alloc, "current")), 304 + 5056); /* their classes */
  ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(j, "bytes.requested"), "current")), 5300);
  ck_assert_int_eq(json_integer_value(json_object_get(j, "bytes.reserved")), 16 << 20);
  json_t *sc = json_object_get(json_object_get(j, "page_types"), "scales");
  ck_assert_int_eq(json_integer_value(json_object_get(sc, "allocated_bytes")), 304);
  json_t *l3 = json_array_get(json_object_get(j, "layers"), 3);
  ck_assert_int_eq(json_integer_value(json_object_get(l3, "pages")), 2);
  json_t *seq = json_object_get(json_object_get(j, "sequences"), "42");
  ck_assert_int_eq(json_integer_value(json_object_get(seq, "requested_bytes")), 5300);
  json_t *codec = json_object_get(json_object_get(j, "codecs"), "5");
  ck_assert_int_eq(json_integer_value(json_object_get(codec, "pages")), 2);
  ck_assert_int_eq(json_integer_value(json_object_get(json_object_get(json_object_get(j, "kv"), "v"), "pages")), 2);
  json_decref(j);

  char buf[1 << 16];
  size_t len;
  ck_ok(kvp_stats_write(p, KVP_STATS_PROMETHEUS, buf, sizeof buf, &len));
  ck_assert(strstr(buf, "# TYPE kvpool_bytes_allocated gauge\nkvpool_bytes_allocated 5360\n") != NULL);
  ck_assert(strstr(buf, "kvpool_ops_allocs_total 2\n") != NULL);
  ck_assert(strstr(buf, "kvpool_allocated_bytes{dim=\"page_type\",slice=\"scales\"} 304\n") != NULL);
  ck_assert(strstr(buf, "kvpool_requested_bytes{dim=\"seq\",slice=\"42\"} 5300\n") != NULL);
  ck_ok(kvp_stats_write(p, KVP_STATS_TEXT, buf, sizeof buf, &len));
  ck_assert(strstr(buf, "bytes.allocated") != NULL && strstr(buf, "scales") != NULL);
  ck_status(kvp_stats_write(p, KVP_STATS_TEXT, buf, 10, &len), KVP_ENOSPC);
  ck_assert_uint_eq(strlen(buf), 9); /* truncated, terminated */
  ck_status(kvp_stats_write(p, (kvp_stats_format)9, buf, sizeof buf, &len), KVP_EINVAL);
  kvp_stats s = {.struct_size = 8};
  ck_status(kvp_stats_get(p, &s), KVP_EINVAL);
  ck_ok(kvp_page_free(p, a));
  ck_ok(kvp_page_free(p, b));
  kvp_pool_destroy(p);
}
END_TEST

typedef struct reader_arg {
  kvp_pool *pool;
  atomic_int *stop;
  uint64_t budget, snapshots;
  int bad;
} reader_arg;

static void *reader(void *arg) {
  reader_arg *r = arg;
  while (!atomic_load(r->stop)) {
    kvp_stats s = {.struct_size = sizeof s};
    if (kvp_stats_get(r->pool, &s) != KVP_OK) r->bad++;
    /* a snapshot never mixes states: the ledger's order holds in each */
    if (s.bytes_requested.current > s.bytes_allocated.current ||
        s.bytes_allocated.current > s.bytes_committed.current || s.bytes_allocated.current > r->budget)
      r->bad++;
    r->snapshots++;
  }
  return NULL;
}

START_TEST(stats_lock_free_beside_writer) {
  uint64_t budget = 24 << 20;
  kvp_pool *p = mkpool(64 << 20, budget);
  atomic_int stop = 0;
  reader_arg ra[2] = {{p, &stop, budget, 0, 0}, {p, &stop, budget, 0, 0}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, reader, &ra[i]);
  kvp_page_id ids[256] = {0};
  uint64_t x = 88172645463325252ull;
  for (int op = 0; op < 20000; op++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    int i = (int)(x % 256);
    if (ids[i]) {
      ck_ok(kvp_page_free(p, ids[i]));
      ids[i] = 0;
    } else {
      kvp_page_tag t = {x >> 60, 0, 0, KVP_PAGE_RAW, 0, 0};
      int rc = kvp_page_alloc(p, 64 + (x >> 20) % 300000, &t, &ids[i]);
      ck_assert(rc == KVP_OK || rc == KVP_EBUDGET);
      if (rc) ids[i] = 0;
    }
  }
  atomic_store(&stop, 1);
  for (int i = 0; i < 2; i++) {
    pthread_join(th[i], NULL);
    ck_assert_int_eq(ra[i].bad, 0);
    ck_assert_uint_gt(ra[i].snapshots, 0);
  }
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p); /* frees the pages still live */
}
END_TEST

/* The paged gather is a CUDA-region call: a host pool refuses it by name,
 * bad requests are named, and nothing is written. (tests/gpu covers it on
 * a device.) */
START_TEST(gather_needs_a_cuda_region) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 2, c.n_kv_heads = 2, c.head_dim = 64, c.region_bytes = 8u << 20;
  kvp_pool *p;
  ck_assert_int_eq(kvp_pool_create(&c, &p), KVP_OK);
  kvp_gather_req g;
  kvp_gather_req_init(&g);
  ck_assert_uint_eq(g.struct_size, sizeof g);
  ck_assert_int_eq(kvp_gather(NULL, &g), KVP_EINVAL);
  ck_assert_int_eq(kvp_gather(p, NULL), KVP_EINVAL);
  g.struct_size = 8;
  ck_assert_int_eq(kvp_gather(p, &g), KVP_EINVAL);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "struct_size"));
  kvp_gather_req_init(&g);
  int rc = kvp_gather(p, &g);
  ck_assert(rc == KVP_ENOTSUP);
  ck_assert_msg(strstr(kvp_last_error(), "gather") != NULL, "%s", kvp_last_error());
  ck_assert_uint_eq(g.n_rows, 0);
  ck_assert_int_eq(kvp_check(p), KVP_OK);
  kvp_pool_destroy(p);
}
END_TEST

/* A process that used kvpool forks; the child makes, fills and destroys
 * pools of its own (urcu's workers rebuilt there: without that, the
 * child's first kvp_pool_destroy waits forever on callbacks no thread
 * runs). Each side uses RCU before and after the fork. */
static int fill_and_free(void) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 2;
  c.n_kv_heads = 2;
  c.region_bytes = 8 << 20;
  kvp_pool *p = NULL;
  if (kvp_pool_create(&c, &p)) return 1;
  size_t n = (size_t)16 * c.n_kv_heads * c.head_dim;
  uint16_t *k = calloc(n, 2);
  int bad = !k;
  for (uint64_t seq = 1; !bad && seq <= 4; seq++) {
    bad |= kvp_seq_add(p, seq, NULL) || kvp_step_begin(p, seq, 16, 0);
    for (uint32_t l = 0; !bad && l < c.n_layers; l++) bad |= kvp_append(p, seq, l, &(kvp_kv){k, k, NULL}) != 0;
    bad |= kvp_step_end(p, seq) || kvp_seq_free(p, seq) || kvp_check(p);
  }
  free(k);
  kvp_pool_destroy(p);
  return bad;
}

START_TEST(pools_work_in_a_forked_child) {
  ck_assert_int_eq(fill_and_free(), 0);
  kvp_pool *held = mkpool(8 << 20, 0); /* alive across the fork */
  pid_t pid = fork();
  ck_assert_int_ge(pid, 0);
  if (pid == 0) _exit(fill_and_free() || fill_and_free());
  int status = 0, waited = 0; /* a child that hangs is killed after 60 s, and the test fails */
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (++waited == 6000) kill(pid, SIGKILL);
    usleep(10000);
  }
  ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the forked child's pools failed (status %#x)", status);
  ck_assert_int_eq(fill_and_free(), 0);
  ck_ok(kvp_check(held));
  kvp_pool_destroy(held);
}
END_TEST

int main(void) {
  Suite *s = suite_create("pool");
  TCase *tc = tcase_create("api");
  tcase_add_test(tc, status_names_and_version);
  tcase_add_test(tc, metadata_allocator_follows_the_program);
  tcase_add_test(tc, config_errors_name_the_field);
  tcase_add_test(tc, ledger_moves_region_stays);
  tcase_add_test(tc, emitters_agree_with_stats);
  tcase_add_test(tc, gather_needs_a_cuda_region);
  tcase_add_test(tc, pools_work_in_a_forked_child);
  suite_add_tcase(s, tc);
  tc = tcase_create("concurrency");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, stats_lock_free_beside_writer);
  suite_add_tcase(s, tc);
  return it_run(s);
}
