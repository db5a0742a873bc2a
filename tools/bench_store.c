/*
 * tools/bench_store.c - kvpool-bench's store-tier figures (tools/kvpool-bench.c's
 * banner defines them): a 32K-token sequence of llama-3-8b geometry offloaded
 * to and restored from a private local Redis per codec (seconds and wire
 * bytes), and a prefix fetch that hits against one that misses. Public
 * headers only.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pagemix.h" /* first: it opts in to the experimental page API */
#include "bench_store.h"
#include "bench_util.h"
#include "redis_srv.h"

enum { ST_L = 32, ST_H = 8, ST_D = 128, ST_TOK = 32768, ST_BT = 32, ST_CHUNK = 2048 };

typedef struct store_fig {
  double offload_s, restore_s;   /* medians */
  uint64_t wire_bytes;           /* blob bytes of one offload */
  uint64_t pool_bytes;           /* allocated bytes of the sequence */
} store_fig;

static kvp_pool *store_pool(const char *codecs) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = ST_L;
  c.n_kv_heads = ST_H;
  c.head_dim = ST_D;
  c.block_tokens = ST_BT;
  c.codecs = codecs;
  c.region_bytes = (uint64_t)ST_TOK * ST_L * ST_H * ST_D * 4 + (1ull << 30);
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create (store bench)", rc);
  return p;
}

/* One 32K-token sequence (prefill in chunks), with its prompt's ids when tokens. */
static void store_fill(kvp_pool *p, uint64_t seq, const uint32_t *tokens, const uint16_t *k, const uint16_t *v) {
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.tokens = tokens;
  sc.n_tokens = tokens ? ST_TOK + 1 : 0;
  int rc = kvp_seq_add(p, seq, &sc);
  if (rc) die("kvp_seq_add", rc);
  for (uint32_t t = 0; t < ST_TOK; t += ST_CHUNK) bench_step(p, seq, ST_CHUNK, ST_L, k, v);
}

static store_fig bench_store_codec(kvp_store *st, const char *codecs, int rounds, const uint16_t *k,
                                   const uint16_t *v) {
  kvp_pool *p = store_pool(codecs);
  store_fill(p, 1, NULL, k, v);
  kvp_stats s0 = {.struct_size = sizeof s0}, s1 = {.struct_size = sizeof s1};
  kvp_stats_get(p, &s0);
  double off[16], res[16];
  store_fig f = {0};
  f.pool_bytes = s0.bytes_allocated.current;
  for (int r = 0; r < rounds; r++) {
    kvp_stats_get(p, &s0);
    double t0 = now_ns();
    int rc = kvp_seq_offload(p, 1, st);
    if (rc) die("kvp_seq_offload", rc);
    double t1 = now_ns();
    if ((rc = kvp_seq_restore(p, 1, st))) die("kvp_seq_restore", rc);
    double t2 = now_ns();
    kvp_stats_get(p, &s1);
    off[r] = (t1 - t0) * 1e-9;
    res[r] = (t2 - t1) * 1e-9;
    f.wire_bytes = s1.store_offload_bytes - s0.store_offload_bytes;
  }
  if (kvp_check(p)) die("kvp_check (store bench)", kvp_check(p));
  f.offload_s = median(off, rounds);
  f.restore_s = median(res, rounds);
  kvp_pool_destroy(p);
  return f;
}

/* Host cost of finding and attaching a 32K-token shared prefix. */
static void bench_prefix_hit(int rounds, const uint16_t *k, const uint16_t *v, double *hit_us, double *miss_us) {
  kvp_pool *p = store_pool("kv=nvfp4");
  uint32_t *tok = malloc((ST_TOK + 1) * sizeof *tok);
  for (uint32_t i = 0; i <= ST_TOK; i++) tok[i] = i * 2654435761u;
  store_fill(p, 1, tok, k, v);
  double hit[16], miss[16];
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.tokens = tok;
  sc.n_tokens = ST_TOK + 1;
  kvp_seq_desc d = {.struct_size = sizeof d};
  int rc = kvp_seq_add(p, 2, &sc);
  if (rc || kvp_seq_info(p, 2, &d) || d.n_positions != ST_TOK) die("prefix hit: not attached", rc ? rc : KVP_ECORRUPT);
  kvp_seq_free(p, 2);
  tok[0] ^= 1; /* a prompt that shares nothing: its keys and one probe */
  for (int r = 0; r < rounds; r++) {
    double m0 = now_ns();
    if ((rc = kvp_seq_add(p, 3, &sc))) die("kvp_seq_add (prefix miss)", rc);
    double m1 = now_ns();
    kvp_seq_free(p, 3);
    miss[r] = (m1 - m0) * 1e-3;
  }
  tok[0] ^= 1;
  /* timed again cleanly: the attach alone */
  for (int r = 0; r < rounds; r++) {
    double t0 = now_ns();
    rc = kvp_seq_add(p, 2, &sc);
    double t1 = now_ns();
    if (rc) die("kvp_seq_add (prefix hit)", rc);
    kvp_seq_free(p, 2);
    hit[r] = (t1 - t0) * 1e-3;
  }
  *hit_us = median(hit, rounds);
  *miss_us = median(miss, rounds);
  free(tok);
  kvp_pool_destroy(p);
}

/* The prefix hit path alone (no store needed): kvp_seq_add of a 32K-token
 * prompt whose prefix the pool holds, against a prompt that shares nothing. */
void print_prefix(int quick, int json_only) {
  size_t n = (size_t)ST_CHUNK * ST_H * ST_D;
  uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
  fill_bf16(k, n, 1);
  fill_bf16(v, n, 2);
  double hit_us, miss_us;
  bench_prefix_hit(quick ? 3 : 9, k, v, &hit_us, &miss_us);
  if (!json_only)
    printf("prefix hit: kvp_seq_add attaching a %u-token shared prefix (L=%u, H=%u, %u-token blocks) %.1f us (target "
           "< 50); a miss (keys + one probe) %.1f us\n", ST_TOK, ST_L, ST_H, ST_BT, hit_us, miss_us);
  printf("{\"figure\":\"prefix_attach_us\",\"tokens\":%u,\"kvpool\":%.1f,\"miss_us\":%.1f,\"target_us\":50}\n", ST_TOK,
         hit_us, miss_us);
  free(k);
  free(v);
}

int print_store(int quick, int json_only) {
  redis_srv r;
  if (redis_srv_start(&r)) {
    printf("store: skipped: %s\n", r.why);
    print_prefix(quick, json_only);
    return 0;
  }
  kvp_store *st;
  int rc = kvp_store_open(r.url, &st);
  if (rc) {
    printf("store: skipped: %s\n", kvp_last_error());
    redis_srv_stop(&r);
    print_prefix(quick, json_only);
    return 0;
  }
  int rounds = quick ? 1 : 3;
  size_t n = (size_t)ST_CHUNK * ST_H * ST_D;
  uint16_t *k = malloc(n * 2), *v = malloc(n * 2);
  fill_bf16(k, n, 1);
  fill_bf16(v, n, 2);
  store_fig b = bench_store_codec(st, NULL, rounds, k, v);
  store_fig q = bench_store_codec(st, "kv=nvfp4", rounds, k, v);
  double chunks = (double)ST_TOK * ST_L * ST_H * ST_D * 2 * 2; /* raw bf16 K and V of the same tokens */
  double ratio_bytes = chunks / (double)q.wire_bytes, ratio_restore = b.restore_s / q.restore_s;
  if (!json_only) {
    printf("\nstore tier: one %u-token llama-3-8b sequence (L=%u, H=%u, D=%u, %u-token blocks) through a local "
           "redis-server, median of %d\n", ST_TOK, ST_L, ST_H, ST_D, ST_BT, rounds);
    printf("%-10s %12s %12s %12s %12s %14s %14s\n", "pages", "wire MiB", "offload MB/s", "restore MB/s",
           "offload tok/s", "restore tok/s", "vs bf16 chunks");
    const store_fig *fs[2] = {&b, &q};
    const char *nm[2] = {"bf16", "nvfp4"};
    for (int i = 0; i < 2; i++)
      printf("%-10s %12.1f %12.0f %12.0f %12.0f %14.0f %13.2fx\n", nm[i], fs[i]->wire_bytes / 1048576.0,
             fs[i]->wire_bytes / fs[i]->offload_s / 1e6, fs[i]->wire_bytes / fs[i]->restore_s / 1e6,
             ST_TOK / fs[i]->offload_s, ST_TOK / fs[i]->restore_s, chunks / fs[i]->wire_bytes);
    printf("nvfp4 vs bf16: %.2fx fewer bytes than raw bf16 chunks (target >= 3.4), restore %.2fx faster in tokens/s "
           "(target >= 2.5)\n", ratio_bytes, ratio_restore);
  }
  const store_fig *fs[2] = {&b, &q};
  const char *nm[2] = {"bf16", "nvfp4"};
  for (int i = 0; i < 2; i++)
    printf("{\"figure\":\"store_offload_restore\",\"pages\":\"%s\",\"tokens\":%u,\"wire_bytes\":%llu,"
           "\"offload_mbs\":%.1f,\"restore_mbs\":%.1f,\"offload_tokens_s\":%.0f,\"restore_tokens_s\":%.0f,"
           "\"baseline\":\"raw bf16 chunks\",\"baseline_bytes\":%.0f,\"ratio\":%.3f}\n", nm[i], ST_TOK,
           (unsigned long long)fs[i]->wire_bytes, fs[i]->wire_bytes / fs[i]->offload_s / 1e6,
           fs[i]->wire_bytes / fs[i]->restore_s / 1e6, ST_TOK / fs[i]->offload_s, ST_TOK / fs[i]->restore_s, chunks,
           chunks / fs[i]->wire_bytes);
  printf("{\"figure\":\"store_nvfp4_vs_bf16\",\"bytes_ratio\":%.3f,\"restore_tokens_ratio\":%.3f}\n", ratio_bytes,
         ratio_restore);
  free(k);
  free(v);
  kvp_store_close(st);
  redis_srv_stop(&r);
  print_prefix(quick, json_only);
  return 0;
}

/* read_only (--read): the two kvp_read rows alone. */
