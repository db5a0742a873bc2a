/*
 * kvpool-prof-append - decode appends in a loop, for a profiler.
 *
 *   kvpool-prof-append [steps [seqs [layers [region_mib]]]]   (1000 8 32 2048)
 *
 * A pool of `layers` layers, 8 KV heads, head_dim 128, bf16, raw, 16-token
 * blocks, prefaulted; `seqs` sequences prefilled with 512 tokens, then
 * `steps` decode steps of one token per sequence (each token takes 128 KiB
 * of a 32-layer pool: the region must hold seqs x (512 + steps) of them).
 * Prints ns per (seq, layer) append and the time spent in step_begin and
 * step_end (wall clock), then the whole loop per (seq, layer) in wall clock
 * and in this thread's CPU time (on a shared host the CPU time leaves out
 * the time other processes held the core).
 * Instructions per append, as the issue notes give them:
 *   valgrind --tool=callgrind build/kvpool-prof-append 2000 1 4 128
 *   callgrind_annotate --inclusive=yes callgrind.out.* | grep kvp_append
 * (1 sequence x 4 layers: everything in cache, so the count is the
 * software's, not the memory's). kvpool-bench --seqs gives the figures
 * against their baselines.
 */
#include "kvpool.h"

#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { H = 8, D = 128, PREFILL = 512, SRC = 64 };

static double clock_ns(clockid_t id) {
  struct timespec t;
  clock_gettime(id, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}
static double now_ns(void) { return clock_ns(CLOCK_MONOTONIC); }

static void die(const char *what, int rc) {
  fprintf(stderr, "kvpool-prof-append: %s: %s\n", what, rc ? kvp_last_error() : "bad argument");
  exit(1);
}

int main(int argc, char **argv) {
  long steps = argc > 1 ? atol(argv[1]) : 1000, nseq = argc > 2 ? atol(argv[2]) : 8;
  long layers = argc > 3 ? atol(argv[3]) : 32, mib = argc > 4 ? atol(argv[4]) : 2048;
  if (steps < 1 || nseq < 1 || layers < 1 || layers > 1024 || mib < 1) die("arguments", 0);
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = (uint32_t)layers;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.region_bytes = (uint64_t)mib << 20;
  c.block_tokens = 16;
  c.flags = KVP_POOL_PREFAULT;
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create", rc);
  size_t tok = (size_t)H * D;
  uint16_t *k = malloc(PREFILL * tok * 2), *v = malloc(PREFILL * tok * 2);
  if (!k || !v) die("malloc", 0);
  for (size_t i = 0; i < PREFILL * tok; i++) k[i] = (uint16_t)(0x3c00 + (i & 0x1ff)), v[i] = (uint16_t)(0x3c00 + (i * 7 & 0x1ff));
  for (long s = 0; s < nseq; s++) {
    if ((rc = kvp_seq_add(p, (uint64_t)s, NULL)) || (rc = kvp_step_begin(p, (uint64_t)s, PREFILL, 0))) die("prefill", rc);
    for (long l = 0; l < layers; l++)
      if ((rc = kvp_append(p, (uint64_t)s, (uint32_t)l, &(kvp_kv){k, v, NULL}))) die("prefill append", rc);
    if ((rc = kvp_step_end(p, (uint64_t)s))) die("prefill", rc);
  }
  double begin = 0, append = 0, end = 0, cpu0 = clock_ns(CLOCK_THREAD_CPUTIME_ID);
  for (long st = 0; st < steps; st++)
    for (long s = 0; s < nseq; s++) {
      kvp_kv kv = {k + (size_t)(st % SRC) * tok, v + (size_t)(st % SRC) * tok, NULL};
      double t0 = now_ns();
      if ((rc = kvp_step_begin(p, (uint64_t)s, 1, 0))) die("kvp_step_begin", rc);
      double t1 = now_ns();
      for (long l = 0; l < layers; l++)
        if ((rc = kvp_append(p, (uint64_t)s, (uint32_t)l, &kv))) die("kvp_append", rc);
      double t2 = now_ns();
      if ((rc = kvp_step_end(p, (uint64_t)s))) die("kvp_step_end", rc);
      begin += t1 - t0, append += t2 - t1, end += now_ns() - t2;
    }
  double n = (double)steps * (double)nseq * (double)layers;
  double loop_cpu = clock_ns(CLOCK_THREAD_CPUTIME_ID) - cpu0;
  printf("append %.1f ns per (seq, layer); step_begin %.1f, step_end %.1f ns per (seq, layer); the loop (all three) "
         "%.1f ns wall, %.1f ns of CPU per (seq, layer)\n",
         append / n, begin / n, end / n, (append + begin + end) / n, loop_cpu / n);
  free(k);
  free(v);
  kvp_pool_destroy(p);
  return 0;
}
