/*
 * python/bench/kvpool-callbench.c - the C side of the binding's per-call
 * overhead benchmark (python/bench/bench_calls.py runs it in the same run
 * and subtracts): decode steps of one token (kvp_step_begin, kvp_append per
 * layer, kvp_step_end) and kvp_read of one head, timed exactly as the
 * Python side times them (a clock pair around the layer loop of each step;
 * a clock pair around each batch of reads), on the same geometry and data.
 *
 *   kvpool-callbench LAYERS KV_HEADS HEAD_DIM STEPS REPS READ_TOKENS READ_ITERS [CODECS]
 *
 * Prints one JSON object: {"append_ns": [per rep], "step_ns": [...],
 * "read_ns": [...]} (nanoseconds per call, one entry per repetition).
 * Input: fp16 K and V, x(i) = ((i * 2654435761) mod 2001 - 1000) / 1000,
 * i the element index within a step (the Python side makes the same).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpool.h"

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e9 + ts.tv_nsec;
}

static uint16_t f2h(float f) { /* fp32 -> fp16, round to nearest even; |f| <= 1 here */
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000, exp = (u >> 23) & 0xff, man = u & 0x7fffff;
  if (exp < 103) return (uint16_t)sign;
  if (exp < 113) { /* subnormal */
    man |= 0x800000;
    uint32_t shift = 126 - exp, h = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1))) h++;
    return (uint16_t)(sign | h);
  }
  uint32_t h = ((exp - 112) << 10) | (man >> 13), rem = man & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
  return (uint16_t)(sign | h);
}

static void die(int rc, const char *what) {
  if (rc) {
    fprintf(stderr, "kvpool-callbench: %s: %s (%s)\n", what, kvp_err_name(rc), kvp_last_error());
    exit(1);
  }
}

static void print_list(const char *key, const double *x, int n, int last) {
  printf("\"%s\": [", key);
  for (int i = 0; i < n; i++) printf("%s%.1f", i ? ", " : "", x[i]);
  printf("]%s", last ? "" : ", ");
}

int main(int argc, char **argv) {
  if (argc < 8) {
    fprintf(stderr, "usage: kvpool-callbench LAYERS KV_HEADS HEAD_DIM STEPS REPS READ_TOKENS READ_ITERS [CODECS]\n");
    return 2;
  }
  uint32_t L = (uint32_t)atoi(argv[1]), H = (uint32_t)atoi(argv[2]), D = (uint32_t)atoi(argv[3]);
  int steps = atoi(argv[4]), reps = atoi(argv[5]), read_tokens = atoi(argv[6]), read_iters = atoi(argv[7]);
  const char *codecs = argc > 8 && argv[8][0] ? argv[8] : NULL;
  if (reps < 1 || reps > 64 || steps < 1 || read_tokens < 1 || read_iters < 1) return 2;

  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.k_dtype = c.v_dtype = KVP_DTYPE_F16;
  c.region_bytes = 1ull << 30;
  c.codecs = codecs;
  kvp_pool *p;
  die(kvp_pool_create(&c, &p), "kvp_pool_create");

  size_t n = (size_t)H * D;
  uint16_t *x = malloc(n * 2);
  for (size_t i = 0; i < n; i++) x[i] = f2h((float)((int)((i * 2654435761ull) % 2001) - 1000) / 1000.0f);
  kvp_kv kv = {x, x, NULL};

  double append_ns[64], step_ns[64], read_ns[64];
  for (int r = 0; r < reps; r++) {
    uint64_t seq = 100 + (uint64_t)r;
    die(kvp_seq_add(p, seq, NULL), "kvp_seq_add");
    double t_app = 0, t0 = now_ns();
    for (int s = 0; s < steps; s++) {
      die(kvp_step_begin(p, seq, 1, 0), "kvp_step_begin");
      double a = now_ns();
      for (uint32_t l = 0; l < L; l++) die(kvp_append(p, seq, l, &kv), "kvp_append");
      t_app += now_ns() - a;
      die(kvp_step_end(p, seq), "kvp_step_end");
    }
    step_ns[r] = (now_ns() - t0) / steps;
    append_ns[r] = t_app / ((double)steps * L);
    die(kvp_seq_free(p, seq), "kvp_seq_free");
  }

  /* reads: one sequence of read_tokens, one head, into fixed buffers */
  die(kvp_seq_add(p, 1, NULL), "kvp_seq_add");
  for (int s = 0; s < read_tokens; s++) {
    die(kvp_step_begin(p, 1, 1, 0), "kvp_step_begin");
    for (uint32_t l = 0; l < L; l++) die(kvp_append(p, 1, l, &kv), "kvp_append");
    die(kvp_step_end(p, 1), "kvp_step_end");
  }
  uint16_t *ko = malloc((size_t)read_tokens * D * 2), *vo = malloc((size_t)read_tokens * D * 2);
  uint32_t *po = malloc((size_t)read_tokens * 4);
  for (int r = 0; r < reps; r++) {
    double t0 = now_ns();
    for (int i = 0; i < read_iters; i++) {
      kvp_read_req q = {sizeof q, (uint32_t)i % H, KVP_DTYPE_F16, ko, vo, po, (uint32_t)read_tokens, 0, NULL};
      die(kvp_read(p, 1, 0, &q), "kvp_read");
    }
    read_ns[r] = (now_ns() - t0) / read_iters;
  }
  printf("{");
  print_list("append_ns", append_ns, reps, 0);
  print_list("step_ns", step_ns, reps, 0);
  print_list("read_ns", read_ns, reps, 1);
  printf("}\n");
  free(ko);
  free(vo);
  free(po);
  free(x);
  kvp_pool_destroy(p);
  return 0;
}
