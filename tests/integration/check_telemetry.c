/*
 * tests/integration/check_telemetry.c - the telemetry contract through the
 * public header: the exporters' JSON keys and Prometheus names and labels
 * (a golden list: adding a key is fine, renaming or removing one fails),
 * the derived savings figures, the per-sequence top-N (order, ties, bounds,
 * lock-free beside a writer that rebuilds the table), device-level bytes of
 * a host region, host metadata bytes.
 */
#define KVP_EXPERIMENTAL_API /* raw pages: a writer that moves one sequence entry fast */
#include <check.h>
#include <jansson.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "itest.h"
#include "kvpool.h"
#include "kvpool_codec.h"

enum { L = 2, H = 2, D = 64 };

static uint16_t KV[64 * H * D]; /* bf16 1.0 .. : finite */

static kvp_pool *mkpool(const char *codecs, uint32_t flags) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.region_bytes = 16ull << 20;
  c.codecs = codecs;
  c.flags = flags;
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  for (size_t i = 0; i < sizeof KV / sizeof *KV; i++) KV[i] = (uint16_t)(0x3f80 + (i % 97));
  return p;
}

static void add_tokens(kvp_pool *p, uint64_t seq, uint32_t n, const kvp_seq_config *sc) {
  kvp_seq_desc d = {.struct_size = sizeof d};
  if (kvp_seq_info(p, seq, &d) == KVP_ENOENT) ck_ok(kvp_seq_add(p, seq, sc));
  ck_ok(kvp_step_begin(p, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    kvp_kv kv = {KV, KV, NULL};
    ck_ok(kvp_append(p, seq, l, &kv));
  }
  ck_ok(kvp_step_end(p, seq));
}

static char *write_fmt(kvp_pool *p, kvp_stats_format f) {
  size_t len = 0;
  ck_status(kvp_stats_write(p, f, NULL, 0, &len), KVP_ENOSPC);
  char *buf = malloc(len + 1);
  ck_assert_ptr_nonnull(buf);
  ck_ok(kvp_stats_write(p, f, buf, len + 1, &len));
  return buf;
}

static json_t *stats_json(kvp_pool *p) {
  char *buf = write_fmt(p, KVP_STATS_JSON);
  json_error_t err;
  json_t *j = json_loads(buf, 0, &err);
  ck_assert_msg(j != NULL, "JSON does not parse: %s at %d", err.text, err.position);
  free(buf);
  return j;
}

/* Follow a path of '/'-separated segments: a key, "[]" (first element of
 * an array) or "*" (first member of an object). */
static json_t *at_path(json_t *j, const char *path) {
  char seg[64];
  while (j && *path) {
    size_t n = strcspn(path, "/");
    ck_assert_uint_lt(n, sizeof seg);
    memcpy(seg, path, n);
    seg[n] = 0;
    path += n + (path[n] == '/');
    if (!strcmp(seg, "[]")) j = json_is_array(j) ? json_array_get(j, 0) : NULL;
    else if (!strcmp(seg, "*")) j = json_is_object(j) ? json_object_iter_value(json_object_iter(j)) : NULL;
    else j = json_is_object(j) ? json_object_get(j, seg) : NULL;
  }
  return j;
}

/* The golden list: every key docs/telemetry.md promises. */
static const char *const json_golden[] = {
    "version", "savings.ratio", "savings.bytes",
#define GAUGE_KEYS(k) k "/current", k "/peak", k "/total"
    GAUGE_KEYS("bytes.requested"), GAUGE_KEYS("bytes.allocated"), GAUGE_KEYS("bytes.committed"),
    GAUGE_KEYS("pages.live"), GAUGE_KEYS("slabs.live"), GAUGE_KEYS("extents.live"),
    GAUGE_KEYS("host.metadata_bytes"), GAUGE_KEYS("tokens.retained"), GAUGE_KEYS("bytes.bf16_equivalent"),
    GAUGE_KEYS("sequences.live"), GAUGE_KEYS("bytes.codec_state"), GAUGE_KEYS("bytes.retired"),
#undef GAUGE_KEYS
    "bytes.reserved", "bytes.budget", "device.used_bytes", "device.total_bytes", "ops.allocs", "ops.frees",
    "ops.grows", "ops.grow_moves", "ops.budget_refusals", "ops.nospc_refusals", "tokens.evicted",
#define SLICE_KEYS(s) s "/requested_bytes", s "/allocated_bytes", s "/pages"
    SLICE_KEYS("page_types/raw"), SLICE_KEYS("page_types/codes"), SLICE_KEYS("page_types/scales"),
    SLICE_KEYS("page_types/centroids"), SLICE_KEYS("page_types/assign"), SLICE_KEYS("page_types/outliers"),
    SLICE_KEYS("page_types/meta"), SLICE_KEYS("kv/k"), SLICE_KEYS("kv/v"), SLICE_KEYS("layers/[]"),
    SLICE_KEYS("heads/[]"), SLICE_KEYS("codecs/*"), "codecs/*/name", SLICE_KEYS("sequences/*"),
#undef SLICE_KEYS
};

START_TEST(json_keys_are_stable) {
  kvp_pool *p = mkpool("k=int8", 0);
  add_tokens(p, 3, 20, NULL);
  json_t *j = stats_json(p);
  for (size_t i = 0; i < sizeof json_golden / sizeof *json_golden; i++) {
    json_t *v = at_path(j, json_golden[i]);
    ck_assert_msg(v != NULL, "JSON key %s is missing", json_golden[i]);
    const char *last = strrchr(json_golden[i], '/');
    if (last && !strcmp(last, "/name")) ck_assert(json_is_string(v));
    else ck_assert_msg(json_is_number(v), "JSON key %s is not a number", json_golden[i]);
  }
  ck_assert_uint_eq(json_array_size(json_object_get(j, "layers")), L);
  ck_assert_uint_eq(json_array_size(json_object_get(j, "heads")), H);
  ck_assert_ptr_nonnull(at_path(j, "sequences/3"));
  uint32_t id = 0;
  ck_ok(kvp_codec_find("int8", &id));
  char path[32];
  snprintf(path, sizeof path, "codecs/%u/name", id);
  ck_assert_str_eq(json_string_value(at_path(j, path)), "int8");
  json_decref(j);
  kvp_pool_destroy(p);
}
END_TEST

/* Metric names of the exposition, and label names per metric. */
static const char *const prom_golden[] = {
#define GAUGE_NAMES(n) n, n "_peak", n "_increase_total"
    GAUGE_NAMES("kvpool_bytes_requested"), GAUGE_NAMES("kvpool_bytes_allocated"),
    GAUGE_NAMES("kvpool_bytes_committed"), GAUGE_NAMES("kvpool_pages_live"), GAUGE_NAMES("kvpool_slabs_live"),
    GAUGE_NAMES("kvpool_extents_live"), GAUGE_NAMES("kvpool_host_metadata_bytes"),
    GAUGE_NAMES("kvpool_tokens_retained"), GAUGE_NAMES("kvpool_bytes_bf16_equivalent"),
    GAUGE_NAMES("kvpool_sequences_live"), GAUGE_NAMES("kvpool_bytes_codec_state"), GAUGE_NAMES("kvpool_bytes_retired"),
#undef GAUGE_NAMES
    "kvpool_ops_allocs_total", "kvpool_ops_frees_total", "kvpool_ops_grows_total", "kvpool_ops_grow_moves_total",
    "kvpool_ops_budget_refusals_total", "kvpool_ops_nospc_refusals_total", "kvpool_tokens_evicted_total",
    "kvpool_bytes_reserved", "kvpool_bytes_budget", "kvpool_device_used_bytes", "kvpool_device_total_bytes",
    "kvpool_savings_ratio", "kvpool_savings_bytes", "kvpool_requested_bytes", "kvpool_allocated_bytes",
    "kvpool_pages",
};

/* Does the exposition have a sample of name whose label set includes every
 * label of want ("dim=\"codec\",codec" style: names, optionally =value)? */
static bool prom_has(const char *text, const char *name, const char *const *labels, size_t nlabels) {
  size_t n = strlen(name);
  for (const char *line = text; line && *line; line = strchr(line, '\n'), line = line ? line + 1 : NULL) {
    if (*line == '#' || strncmp(line, name, n) || (line[n] != ' ' && line[n] != '{')) continue;
    const char *end = strchr(line, '\n');
    size_t len = end ? (size_t)(end - line) : strlen(line);
    bool all = true;
    for (size_t i = 0; i < nlabels && all; i++) {
      char want[96];
      snprintf(want, sizeof want, "%s", labels[i]);
      const char *hit = line + n;
      all = false;
      while ((hit = strstr(hit, want)) && hit < line + len) {
        char before = hit[-1], after = hit[strlen(want)];
        if ((before == '{' || before == ',') && (after == '=' || after == '"' || after == ',' || after == '}')) {
          all = true;
          break;
        }
        hit++;
      }
    }
    if (all) return true;
  }
  return false;
}

START_TEST(prometheus_names_are_stable) {
  kvp_pool *p = mkpool("k=int8", 0);
  add_tokens(p, 3, 20, NULL);
  char *text = write_fmt(p, KVP_STATS_PROMETHEUS);
  for (size_t i = 0; i < sizeof prom_golden / sizeof *prom_golden; i++) {
    ck_assert_msg(prom_has(text, prom_golden[i], NULL, 0), "metric %s is missing", prom_golden[i]);
    char type[128];
    snprintf(type, sizeof type, "# TYPE %s ", prom_golden[i]);
    ck_assert_msg(strstr(text, type) != NULL, "metric %s has no TYPE line", prom_golden[i]);
  }
  static const char *const dims[] = {"dim=\"page_type\"", "dim=\"kv\"", "dim=\"layer\"", "dim=\"head\"",
                                     "dim=\"codec\"", "dim=\"seq\""};
  static const char *const bd[] = {"kvpool_requested_bytes", "kvpool_allocated_bytes", "kvpool_pages"};
  for (size_t m = 0; m < 3; m++)
    for (size_t d = 0; d < 6; d++) {
      const char *labels[3] = {dims[d], "slice", "codec"};
      ck_assert_msg(prom_has(text, bd[m], labels, d == 4 ? 3 : 2), "%s{%s,slice} is missing", bd[m], dims[d]);
    }
  const char *raw[] = {"dim=\"page_type\"", "slice=\"raw\""}, *seq[] = {"dim=\"seq\"", "slice=\"3\""},
             *int8[] = {"dim=\"codec\"", "codec=\"int8\""};
  ck_assert(prom_has(text, "kvpool_allocated_bytes", raw, 2));
  ck_assert(prom_has(text, "kvpool_pages", seq, 2));
  ck_assert(prom_has(text, "kvpool_requested_bytes", int8, 2));
  free(text);
  text = write_fmt(p, KVP_STATS_TEXT);
  ck_assert_ptr_nonnull(strstr(text, "savings.ratio"));
  ck_assert_ptr_nonnull(strstr(text, "bytes.bf16_equivalent"));
  free(text);
  kvp_pool_destroy(p);
}
END_TEST

/* savings.ratio = bf16-equivalent / allocated, savings.bytes the difference,
 * computed here from the snapshot and from the geometry. */
START_TEST(savings_figures) {
  kvp_pool *p = mkpool("kv=int8", 0);
  json_t *j = stats_json(p);
  ck_assert_double_eq(json_number_value(json_object_get(j, "savings.ratio")), 0.0); /* nothing allocated */
  json_decref(j);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP; /* blocks encoded at once: no RAW tail */
  add_tokens(p, 1, 32, &sc);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bf16_equivalent_bytes.current, 32ull * L * H * D * 2 * 2);
  j = stats_json(p);
  double want = (double)s.bf16_equivalent_bytes.current / (double)s.bytes_allocated.current;
  ck_assert_double_eq_tol(json_number_value(json_object_get(j, "savings.ratio")), want, 1e-6);
  ck_assert_double_gt(want, 1.5); /* int8 at D = 64: 128 / 66 bytes per token-head before rounding */
  ck_assert_int_eq(json_integer_value(json_object_get(j, "savings.bytes")),
                   (json_int_t)s.bf16_equivalent_bytes.current - (json_int_t)s.bytes_allocated.current);
  json_decref(j);
  char *text = write_fmt(p, KVP_STATS_PROMETHEUS);
  const char *at = strstr(text, "\nkvpool_savings_ratio ");
  ck_assert_ptr_nonnull(at);
  ck_assert_double_eq_tol(strtod(at + strlen("\nkvpool_savings_ratio "), NULL), want, 1e-6);
  free(text);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(top_sequences_order_and_bounds) {
  kvp_pool *p = mkpool(NULL, 0);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  static const uint32_t toks[] = {5, 40, 17, 40, 1, 33}; /* ids 10..15; 11 and 13 tie */
  for (uint32_t i = 0; i < 6; i++) add_tokens(p, 10 + i, toks[i], &sc);
  ck_ok(kvp_seq_add(p, 99, NULL)); /* no pages: never listed */
  kvp_seq_usage top[8];
  uint32_t n = 77;
  ck_ok(kvp_stats_top_sequences(p, 0, NULL, &n));
  ck_assert_uint_eq(n, 0);
  ck_status(kvp_stats_top_sequences(p, 3, NULL, &n), KVP_EINVAL);
  ck_status(kvp_stats_top_sequences(p, 3, top, NULL), KVP_EINVAL);
  ck_ok(kvp_stats_top_sequences(p, 3, top, &n));
  ck_assert_uint_eq(n, 3);
  ck_assert_uint_eq(top[0].seq, 11); /* 40 tokens, lower id of the tie */
  ck_assert_uint_eq(top[1].seq, 13);
  ck_assert_uint_eq(top[2].seq, 15);
  for (uint32_t i = 0; i < n; i++) {
    kvp_usage u;
    ck_ok(kvp_stats_breakdown(p, KVP_DIM_SEQ, top[i].seq, &u));
    ck_assert_mem_eq(&u, &top[i].usage, sizeof u);
  }
  ck_ok(kvp_stats_top_sequences(p, 8, top, &n));
  ck_assert_uint_eq(n, 6);
  static const uint64_t order[] = {11, 13, 15, 12, 10, 14};
  uint64_t sum = 0;
  for (uint32_t i = 0; i < n; i++) {
    ck_assert_uint_eq(top[i].seq, order[i]);
    sum += top[i].usage.allocated_bytes;
  }
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(sum, s.bytes_allocated.current); /* all sequences listed: they sum to the ledger */
  ck_ok(kvp_seq_free(p, 11));
  ck_ok(kvp_reclaim(p));
  ck_ok(kvp_stats_top_sequences(p, 1, top, &n));
  ck_assert_uint_eq(n, 1);
  ck_assert_uint_eq(top[0].seq, 13);
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

typedef struct reader_arg {
  kvp_pool *pool;
  atomic_int stop;
  atomic_ullong rounds;
  atomic_int bad; /* 0 = every snapshot was well-formed */
} reader_arg;

/* Sequence id (round x 1000 + s) holds pages of 1 + s % 7 tokens of one
 * head and side: 128 bytes a token, a class of its own. An entry mixing
 * two moments of the writer (say requested after a page came, pages before
 * it) breaks these equalities. */
static bool entry_consistent(uint64_t id, const kvp_usage *u) {
  uint64_t page = 128 * (1 + id % 1000 % 7);
  return u->requested_bytes == u->npages * page && u->allocated_bytes == u->requested_bytes;
}

static void *top_reader(void *vp) {
  reader_arg *a = vp;
  kvp_seq_usage top[16];
  char *buf = malloc(1 << 20);
  if (!buf) a->bad = 6;
  while (buf && !atomic_load(&a->stop)) {
    uint32_t n = 0;
    if (kvp_stats_top_sequences(a->pool, 16, top, &n) || n > 16) a->bad = 1;
    for (uint32_t i = 0; i < n; i++) {
      if (!top[i].usage.npages || top[i].usage.requested_bytes > top[i].usage.allocated_bytes) a->bad = 2;
      if (i && top[i].usage.allocated_bytes > top[i - 1].usage.allocated_bytes) a->bad = 3;
      if (!entry_consistent(top[i].seq, &top[i].usage)) a->bad = 7;
    }
    size_t len;
    int rc = kvp_stats_write(a->pool, KVP_STATS_JSON, buf, 1 << 20, &len);
    if (rc && rc != KVP_ENOSPC) a->bad = 4;
    kvp_usage u;
    uint64_t id = (a->rounds % 200) + 1 + (a->rounds / 200 % 2) * 1000;
    rc = kvp_stats_breakdown(a->pool, KVP_DIM_SEQ, id, &u);
    if (rc && rc != KVP_ENOENT) a->bad = 5;
    if (!rc && !entry_consistent(id, &u)) a->bad = 8;
    a->rounds++;
  }
  free(buf);
  return NULL;
}

/* Readers walk the per-sequence table lock-free while the writer grows it
 * (rebuilds) and empties it, again and again. */
START_TEST(top_sequences_beside_a_writer) {
  kvp_pool *p = mkpool(NULL, 0);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  static reader_arg a;
  a.pool = p;
  atomic_store(&a.stop, 0);
  pthread_t th[2];
  for (int i = 0; i < 2; i++) ck_assert_int_eq(pthread_create(&th[i], NULL, top_reader, &a), 0);
  for (int round = 0; round < 2; round++) {
    for (uint64_t s = 1; s <= 200; s++) add_tokens(p, s + (uint64_t)round * 1000, 1 + (uint32_t)(s % 7), &sc);
    for (uint64_t s = 1; s <= 200; s++) ck_ok(kvp_seq_free(p, s + (uint64_t)round * 1000));
  }
  atomic_store(&a.stop, 1);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  ck_assert_msg(a.bad == 0, "a reader saw a malformed snapshot (%d)", a.bad);
  ck_assert_uint_gt(a.rounds, 0);
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

typedef struct slot_arg {
  kvp_pool *pool;
  atomic_int stop;
  atomic_ullong reads, torn;
} slot_arg;

/* Sequence 7's one page comes and goes: every copy of its entry must hold
 * (0, 0, 0) or (300, 304, 1), never a mix. */
static void *slot_reader(void *vp) {
  slot_arg *a = vp;
  kvp_seq_usage top[4];
  while (!atomic_load(&a->stop)) {
    for (int i = 0; i < 64; i++) { /* mostly the one entry: the reader's three loads against the writer's stores */
      kvp_usage u;
      int rc = kvp_stats_breakdown(a->pool, KVP_DIM_SEQ, 7, &u);
      if (!rc && !(u.requested_bytes == 300 && u.allocated_bytes == 304 && u.npages == 1)) a->torn++;
    }
    uint32_t n = 0;
    kvp_stats_top_sequences(a->pool, 4, top, &n);
    for (uint32_t i = 0; i < n; i++)
      if (!(top[i].usage.requested_bytes == 300 && top[i].usage.allocated_bytes == 304 && top[i].usage.npages == 1))
        a->torn++;
    a->reads += 65;
  }
  return NULL;
}

START_TEST(sequence_entry_is_never_torn) {
  kvp_pool *p = mkpool(NULL, 0);
  static slot_arg a;
  a.pool = p;
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, slot_reader, &a), 0);
  kvp_page_tag t = {7, 0, 0, KVP_PAGE_RAW, 0, 0};
  for (int i = 0; i < 400000 && !a.torn; i++) {
    kvp_page_id id;
    if (kvp_page_alloc(p, 300, &t, &id) || kvp_page_free(p, id)) ck_abort_msg("%s", kvp_last_error());
  }
  atomic_store(&a.stop, 1);
  pthread_join(th, NULL);
  printf("sequence entry: %llu reads beside the writer, %llu torn\n", (unsigned long long)a.reads,
         (unsigned long long)a.torn);
  ck_assert_uint_eq(a.torn, 0);
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

/* A host region's device-level bytes are its resident bytes: all of it when
 * prefaulted, growing with the payload written otherwise. */
START_TEST(host_device_bytes_and_metadata) {
  kvp_pool *p = mkpool(NULL, KVP_POOL_PREFAULT);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.device_total_bytes, 16ull << 20);
  ck_assert_uint_eq(s.device_used_bytes, 16ull << 20);
  kvp_pool_destroy(p);
  p = mkpool(NULL, 0);
  ck_ok(kvp_stats_get(p, &s));
  uint64_t used0 = s.device_used_bytes, meta0 = s.metadata_bytes.current;
  ck_assert_uint_gt(meta0, 0);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  for (uint64_t q = 1; q <= 40; q++) add_tokens(p, q, 64, &sc); /* 40 x 64 tokens x 1 KiB: 2.5 MiB of payload */
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_ge(s.device_used_bytes, used0 + s.bytes_allocated.current / 2);
  ck_assert_uint_le(s.device_used_bytes, s.device_total_bytes);
  ck_assert_uint_gt(s.metadata_bytes.current, meta0); /* blocks, sequences: counted */
  kvp_pool_destroy(p);
}
END_TEST

int main(void) {
  Suite *s = suite_create("telemetry");
  TCase *t = tcase_create("exporters");
  tcase_add_test(t, json_keys_are_stable);
  tcase_add_test(t, prometheus_names_are_stable);
  tcase_add_test(t, savings_figures);
  suite_add_tcase(s, t);
  t = tcase_create("sequences");
  tcase_add_test(t, top_sequences_order_and_bounds);
  tcase_add_test(t, top_sequences_beside_a_writer);
  tcase_add_test(t, sequence_entry_is_never_torn);
  tcase_set_timeout(t, 60);
  suite_add_tcase(s, t);
  t = tcase_create("device");
  tcase_add_test(t, host_device_bytes_and_metadata);
  suite_add_tcase(s, t);
  return it_run(s);
}
