/*
 * tests/gpu/check_gpu_store.c - the store tier from a CUDA region, through a
 * real redis-server (tools/redis_srv.h: a free loopback port, a temporary
 * directory), against a host pool of the same configuration fed the same
 * K/V:
 *
 *   offload and restore of a sequence from the CUDA pool (its pages staged
 *   through pinned host buffers on the store's stream): the sequence leaves
 *   the pool and comes back with the host pool's reads bit for bit, in every
 *   out dtype; appends after the restore match too; the ledger is back to
 *   its figures and the staging counts in host.pinned_bytes;
 *   more groups than one staging half holds (the offload's two halves take
 *   turns);
 *   a restore that fails on a corrupt blob in the middle (copies of the
 *   blobs before it already enqueued) adds nothing, names the key, leaves
 *   kvp_check clean; with the blob mended the restore goes through;
 *   a prefix published by the host pool is fetched by the CUDA pool: the
 *   same reads as the host pool's own;
 *   the server killed in the middle of a CUDA pool's offload: KVP_EIO, the
 *   pool's ledger and its pages' bytes as before; then the sequence goes
 *   out and back whole.
 *
 * Public headers only (hiredis to damage a blob). NOFORK; skips with a
 * message without a GPU, a redis-server or hiredis.
 */
#include "gpu_test.h"

#include "../../tools/redis_srv.h"

#include <pthread.h>

#ifdef KVP_HAVE_HIREDIS
#include <hiredis.h>
#endif

enum { L = 3, H = 4, D = 128, BT = 16, MAXTOK = 512 };

#include "gpu_pair.h"

static const char *const specs[] = {
    "kv=bf16",
    "kv=nvfp4",
    "k=fp8,v=int8",
    "k=kivi:bits=4:group=16,v=kivi:bits=2:group=16",
};
#define NSPECS (sizeof specs / sizeof specs[0])

static redis_srv R;
static int have_server;

typedef struct pair {
  gpu_pair g;
  kvp_store *hst, *dst; /* the host pool's store handle, the device pool's (its own key prefix) */
} pair;

static void pair_open(pair *p, const char *spec) {
  gpu_pair_open(&p->g, spec, BT, 128ull << 20, 11);
  char url[160];
  snprintf(url, sizeof url, "%s?prefix=h:", R.url);
  ck_ok(kvp_store_open(url, &p->hst));
  snprintf(url, sizeof url, "%s?prefix=d:", R.url);
  ck_ok(kvp_store_open(url, &p->dst));
  ck_ok(kvp_store_set_stream(p->dst, p->g.stream));
}

static void pair_close(pair *p) {
  kvp_store_close(p->hst);
  kvp_store_close(p->dst);
  gpu_pair_close(&p->g);
}

static void same_ledger(pair *p) { gpu_pair_same_ledger(&p->g); }
static void step(pair *p, uint64_t seq, uint32_t n) { gpu_pair_step(&p->g, seq, n); }
/* Every head of every layer reads the same bytes from the host pool's hseq
 * and the device pool's dseq, in every out dtype. */
static void same_reads(pair *p, uint64_t hseq, uint64_t dseq) { gpu_pair_same_reads(&p->g, hseq, dseq, 4096, 1); }

/* A sequence of more chunks than one staging half takes (64 blobs), with
 * OPEN tails (decode tokens). */
static void fill(pair *p, uint64_t seq, const kvp_seq_config *sc) {
  ck_ok(kvp_seq_add(p->g.host, seq, sc));
  ck_ok(kvp_seq_add(p->g.dev, seq, sc));
  step(p, seq, 500);
  step(p, seq, 500);
  step(p, seq, 77);
  for (int t = 0; t < 5; t++) step(p, seq, 1);
  same_ledger(p);
}

static void offload_both(pair *p, uint64_t seq) {
  ck_ok(kvp_seq_offload(p->g.host, seq, p->hst));
  ck_ok(kvp_seq_offload(p->g.dev, seq, p->dst));
  kvp_seq_desc d = {.struct_size = sizeof d};
  ck_assert_int_eq(kvp_seq_info(p->g.dev, seq, &d), KVP_ENOENT);
  ck_ok(kvp_reclaim(p->g.host));
  ck_ok(kvp_reclaim(p->g.dev));
  same_ledger(p);
}

START_TEST(offload_restore_matches_host) {
  if (gpu_spec_off(specs[_i]) || !have_server) return;
  pair p;
  pair_open(&p, specs[_i]);
  kvp_stats s0 = gpu_stats_of(p.g.dev);
  fill(&p, 1, NULL);
  same_reads(&p, 1, 1);
  ck_ok(kvp_reclaim(p.g.dev)); /* blocks retired by the appends' reseals go first */
  kvp_stats full = gpu_stats_of(p.g.dev);
  offload_both(&p, 1);
  kvp_stats out = gpu_stats_of(p.g.dev);
  ck_assert_uint_eq(out.bytes_allocated.current, s0.bytes_allocated.current);
  ck_assert_uint_gt(out.host_pinned_bytes, s0.host_pinned_bytes); /* the staging halves */
  ck_assert_uint_eq(out.store_offload_bytes, gpu_stats_of(p.g.host).store_offload_bytes); /* the same blobs */
  ck_ok(kvp_seq_restore(p.g.host, 1, p.hst));
  ck_ok(kvp_seq_restore(p.g.dev, 1, p.dst));
  same_ledger(&p);
  kvp_stats back = gpu_stats_of(p.g.dev);
  ck_assert_uint_eq(back.tokens_retained.current, full.tokens_retained.current);
  ck_assert_uint_eq(back.bytes_allocated.current, full.bytes_allocated.current);
  ck_assert_uint_eq(back.pages.current, full.pages.current);
  ck_assert_uint_eq(back.host_pinned_bytes, out.host_pinned_bytes); /* reused, not grown */
  same_reads(&p, 1, 1);
  for (int t = 0; t < 20; t++) step(&p, 1, 1); /* the OPEN tails came back whole */
  step(&p, 1, 40);
  same_ledger(&p);
  same_reads(&p, 1, 1);
  /* a second round trip on the same staging */
  offload_both(&p, 1);
  ck_ok(kvp_seq_restore(p.g.dev, 1, p.dst));
  ck_ok(kvp_seq_restore(p.g.host, 1, p.hst));
  same_reads(&p, 1, 1);
  pair_close(&p);
  printf("%-50s CUDA pool offload/restore through redis == host pool\n", specs[_i]);
}
END_TEST

#ifdef KVP_HAVE_HIREDIS
/* The keys of the device pool's parts of seq, largest last. */
static redisContext *connect_srv(void) {
  redisContext *c = redisConnect("127.0.0.1", R.port);
  ck_assert_msg(c && !c->err, "connect to redis-server");
  return c;
}
#endif

START_TEST(failed_restore_adds_nothing) {
#ifndef KVP_HAVE_HIREDIS
  printf("failed_restore_adds_nothing: skipped: built without hiredis\n");
  return;
#else
  if (gpu_spec_off(specs[_i]) || !have_server) return;
  pair p;
  pair_open(&p, specs[_i]);
  fill(&p, 2, NULL);
  offload_both(&p, 2);
  kvp_stats before = gpu_stats_of(p.g.dev);
  /* the last part of the offload (chunks before it are staged and copied first) */
  redisContext *c = connect_srv();
  redisReply *keys = redisCommand(c, "KEYS d:seq:2:*");
  ck_assert(keys && keys->type == REDIS_REPLY_ARRAY && keys->elements > 2);
  char victim[200] = "";
  uint32_t best = 0;
  for (size_t i = 0; i < keys->elements; i++) {
    const char *k = keys->element[i]->str, *g = strrchr(k, ':');
    uint32_t idx = (uint32_t)strtoul(g + 1, NULL, 10);
    if (idx >= best) best = idx, snprintf(victim, sizeof victim, "%s", k);
  }
  freeReplyObject(keys);
  redisReply *orig = redisCommand(c, "GET %s", victim);
  ck_assert(orig && orig->type == REDIS_REPLY_STRING && orig->len > 200);
  unsigned char *bytes = malloc(orig->len);
  memcpy(bytes, orig->str, orig->len);
  size_t len = orig->len;
  freeReplyObject(orig);
  bytes[len - 7] ^= 0x5a; /* a page byte: the checksum catches it */
  freeReplyObject(redisCommand(c, "SET %s %b", victim, bytes, len));
  ck_assert_int_eq(kvp_seq_restore(p.g.dev, 2, p.dst), KVP_EFORMAT);
  ck_assert_msg(strstr(kvp_last_error(), victim), "message names %s: %s", victim, kvp_last_error());
  ck_ok(kvp_check(p.g.dev));
  kvp_seq_desc d = {.struct_size = sizeof d};
  ck_assert_int_eq(kvp_seq_info(p.g.dev, 2, &d), KVP_ENOENT);
  ck_ok(kvp_reclaim(p.g.dev));
  kvp_stats after = gpu_stats_of(p.g.dev);
  ck_assert_uint_eq(after.bytes_allocated.current, before.bytes_allocated.current);
  ck_assert_uint_eq(after.pages.current, before.pages.current);
  ck_assert_uint_eq(after.host_pinned_bytes, before.host_pinned_bytes);
  /* mended, the same offload restores, equal to the host pool's */
  bytes[len - 7] ^= 0x5a;
  freeReplyObject(redisCommand(c, "SET %s %b", victim, bytes, len));
  free(bytes);
  redisFree(c);
  ck_ok(kvp_seq_restore(p.g.dev, 2, p.dst));
  ck_ok(kvp_seq_restore(p.g.host, 2, p.hst));
  same_ledger(&p);
  same_reads(&p, 2, 2);
  pair_close(&p);
#endif
}
END_TEST

START_TEST(prefix_across_host_and_device) {
  if (gpu_spec_off(specs[_i]) || !have_server) return;
  pair p;
  pair_open(&p, specs[_i]);
  enum { NT = 1077 };
  uint32_t *tok = malloc((NT + 1) * sizeof *tok);
  for (uint32_t i = 0; i <= NT; i++) tok[i] = i * 2654435761u + (uint32_t)_i;
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.tokens = tok;
  sc.n_tokens = NT + 1;
  fill(&p, 3, &sc); /* 1077 + 5 tokens: the prompt's 67 chunks registered in both pools */
  uint32_t got = 0;
  /* both pools publish under one prefix: the host pool's blobs serve the device pool and back */
  kvp_store *shared;
  char url[160];
  snprintf(url, sizeof url, "%s?prefix=s:", R.url);
  ck_ok(kvp_store_open(url, &shared));
  ck_ok(kvp_store_set_stream(shared, p.g.stream));
  ck_ok(kvp_prefix_publish(p.g.host, 3, shared, &got));
  ck_assert_uint_eq(got, NT / BT * BT);
  ck_ok(kvp_seq_add(p.g.dev, 4, &sc)); /* the device pool's own chunks: attached locally */
  kvp_seq_config nc = sc;
  uint32_t *tok2 = malloc((NT + 1) * sizeof *tok2);
  memcpy(tok2, tok, (NT + 1) * sizeof *tok2);
  nc.tokens = tok2;
  ck_ok(kvp_seq_free(p.g.dev, 3)); /* gone from the device pool: the fetch must read the store */
  ck_ok(kvp_seq_free(p.g.dev, 4));
  ck_ok(kvp_reclaim(p.g.dev));
  ck_ok(kvp_seq_add(p.g.dev, 5, &nc));
  ck_ok(kvp_prefix_fetch(p.g.dev, 5, shared, &got));
  ck_assert_uint_eq(got, (NT - 1) / BT * BT);
  ck_ok(kvp_check(p.g.dev));
  ck_ok(kvp_seq_add(p.g.host, 5, &nc)); /* attaches from the host pool's own table */
  same_reads(&p, 5, 5);
  kvp_store_close(shared);
  free(tok);
  free(tok2);
  pair_close(&p);
}
END_TEST

#ifdef KVP_HAVE_HIREDIS
typedef struct killer {
  unsigned delay_us;
} killer;

static void *kill_later(void *arg) {
  usleep(((killer *)arg)->delay_us);
  kill(R.pid, SIGKILL);
  return NULL;
}

/* Layers 0 and BL - 1, every head, bf16, copied to the host (h: [2][BH][BTOK * BD] x K, V). */
enum { BL = 8, BH = 8, BD = 128, BTOK = 2048 };
static void snap_dev(kvp_pool *p, cudaStream_t s, uint16_t *h) {
  void *dk, *dv;
  uint32_t *pos = malloc(BTOK * 4);
  size_t bytes = (size_t)BTOK * BD * 2;
  ck_cuda(cudaMalloc(&dk, bytes));
  ck_cuda(cudaMalloc(&dv, bytes));
  for (uint32_t i = 0; i < 2; i++)
    for (uint32_t hd = 0; hd < BH; hd++) {
      kvp_read_req q = {sizeof q, hd, KVP_DTYPE_BF16, dk, dv, pos, BTOK, 0, s};
      ck_ok(kvp_read(p, 1, i ? BL - 1 : 0, &q));
      ck_assert_uint_eq(q.n_tokens, BTOK);
      uint16_t *at = h + ((size_t)(i * BH + hd) * 2) * BTOK * BD;
      ck_cuda(cudaMemcpyAsync(at, dk, bytes, cudaMemcpyDeviceToHost, s));
      ck_cuda(cudaMemcpyAsync(at + (size_t)BTOK * BD, dv, bytes, cudaMemcpyDeviceToHost, s));
    }
  ck_cuda(cudaStreamSynchronize(s));
  cudaFree(dk);
  cudaFree(dv);
  free(pos);
}
#endif

/* The server killed while a CUDA pool's offload is in flight (blobs sent
 * from one staging half while the other's copies run): KVP_EIO, the pool
 * as before (ledger, the pages' bytes); then the sequence still goes out
 * and comes back whole. */
START_TEST(server_killed_mid_offload) {
#ifndef KVP_HAVE_HIREDIS
  printf("server_killed_mid_offload: skipped: built without hiredis\n");
#else
  if (!have_server) return;
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = BL;
  c.n_kv_heads = BH;
  c.head_dim = BD;
  c.memory = KVP_MEM_CUDA;
  c.region_bytes = 256ull << 20;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  cudaStream_t s;
  ck_cuda(cudaStreamCreate(&s));
  size_t n = (size_t)BTOK * BH * BD;
  uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
  uint64_t seed = 3;
  for (size_t i = 0; i < n; i++) k[i] = gpu_bf16_of(gpu_normal(&seed)), v[i] = gpu_bf16_of(gpu_normal(&seed));
  void *dk, *dv;
  ck_cuda(cudaMalloc(&dk, n * 2));
  ck_cuda(cudaMalloc(&dv, n * 2));
  ck_cuda(cudaMemcpy(dk, k, n * 2, cudaMemcpyHostToDevice));
  ck_cuda(cudaMemcpy(dv, v, n * 2, cudaMemcpyHostToDevice));
#define FILL()                                                                                                       \
  do {                                                                                                               \
    ck_ok(kvp_seq_add(p, 1, NULL));                                                                                  \
    ck_ok(kvp_step_begin(p, 1, BTOK, 0));                                                                            \
    for (uint32_t l = 0; l < BL; l++) ck_ok(kvp_append(p, 1, l, &(kvp_kv){dk, dv, s}));                              \
    ck_ok(kvp_step_end(p, 1));                                                                                       \
  } while (0)
  FILL();
  size_t snap_elems = (size_t)2 * BH * 2 * BTOK * BD;
  uint16_t *s1 = malloc(snap_elems * 2), *s2 = malloc(snap_elems * 2);
  snap_dev(p, s, s1);
  ck_ok(kvp_reclaim(p));
  kvp_stats before = gpu_stats_of(p);
  int failed_midway = 0;
  for (unsigned delay = 200; delay <= 8192000 && !failed_midway; delay *= 2) {
    char url[160];
    snprintf(url, sizeof url, "%s?timeout_ms=2000", R.url);
    kvp_store *st;
    ck_ok(kvp_store_open(url, &st));
    ck_ok(kvp_store_set_stream(st, s));
    killer kl = {delay};
    pthread_t t;
    pthread_create(&t, NULL, kill_later, &kl);
    int rc = kvp_seq_offload(p, 1, st);
    pthread_join(t, NULL);
    waitpid(R.pid, NULL, 0);
    R.pid = 0;
    uint64_t sent = 0, recv = 0;
    kvp_store_traffic(st, &sent, &recv);
    if (rc) {
      ck_assert_int_eq(rc, KVP_EIO);
      ck_assert_msg(strstr(kvp_last_error(), "stays in the pool"), "%s", kvp_last_error());
      ck_ok(kvp_check(p));
      kvp_stats now = gpu_stats_of(p);
      ck_assert_uint_eq(now.bytes_allocated.current, before.bytes_allocated.current);
      ck_assert_uint_eq(now.pages.current, before.pages.current);
      failed_midway = sent > 0; /* staged and sent, then died */
    } else { /* finished before the kill (the copy died with the server): computed again */
      FILL();
    }
    kvp_store_close(st);
    ck_assert_int_eq(redis_srv_launch(&R), 0);
  }
  ck_assert_msg(failed_midway, "no kill landed in the middle of the offload");
  snap_dev(p, s, s2);
  ck_assert_int_eq(memcmp(s1, s2, snap_elems * 2), 0);
  kvp_store *st;
  ck_ok(kvp_store_open(R.url, &st));
  ck_ok(kvp_store_set_stream(st, s));
  ck_ok(kvp_seq_offload(p, 1, st));
  ck_ok(kvp_seq_restore(p, 1, st));
  ck_ok(kvp_check(p));
  ck_assert_uint_eq(gpu_stats_of(p).bytes_allocated.current, before.bytes_allocated.current);
  memset(s2, 0, snap_elems * 2);
  snap_dev(p, s, s2);
  ck_assert_int_eq(memcmp(s1, s2, snap_elems * 2), 0);
  kvp_store_close(st);
  kvp_pool_destroy(p);
  cudaStreamDestroy(s);
  cudaFree(dk);
  cudaFree(dv);
  free(k), free(v), free(s1), free(s2);
#undef FILL
#endif
}
END_TEST

int main(void) {
  if (!gpu_present("check_gpu_store")) return 0;
#ifdef KVP_HAVE_HIREDIS
  if (redis_srv_start(&R) == 0) have_server = 1;
  else printf("check_gpu_store: skipped: %s\n", R.why);
#else
  printf("check_gpu_store: skipped: built without hiredis\n");
#endif
  if (!have_server) return 0;
  Suite *s = suite_create("gpu_store");
  TCase *tc = tcase_create("store");
  tcase_set_timeout(tc, 600);
  tcase_add_loop_test(tc, offload_restore_matches_host, 0, NSPECS);
  tcase_add_loop_test(tc, failed_restore_adds_nothing, 0, NSPECS);
  tcase_add_loop_test(tc, prefix_across_host_and_device, 0, NSPECS);
  tcase_add_test(tc, server_killed_mid_offload);
  suite_add_tcase(s, tc);
  int rc = gpu_run(s, CK_NORMAL);
  redis_srv_stop(&R);
  return rc;
}
