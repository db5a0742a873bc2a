/*
 * tools/bench_util.h - the small helpers kvpool-bench's files share
 * (kvpool-bench.c, bench_calib.c, bench_store.c): a monotonic clock, the
 * median of a sample, a fatal error that names the call, and the
 * generators of bf16 inputs. Static inline: each file takes what it uses.
 * Include after pagemix.h (pagemix_rand).
 */
#ifndef KVP_TOOLS_BENCH_UTIL_H
#define KVP_TOOLS_BENCH_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpool.h"

static inline double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static inline int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The median of v[0 .. n) (sorts v). */
static inline double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* Exit with the failed call's name, status and kvp_last_error(). */
static inline void die(const char *what, int rc) {
  fprintf(stderr, "kvpool-bench: %s: %s (%s)\n", what, kvp_strerror(rc), kvp_last_error());
  exit(1);
}

/* One step of n tokens in each of layers layers of seq, the same K/V rows
 * [n][heads][head_dim] appended to every layer. */
static inline void bench_step(kvp_pool *p, uint64_t seq, uint32_t n, uint32_t layers, const uint16_t *k,
                              const uint16_t *v) {
  int rc = kvp_step_begin(p, seq, n, 0);
  if (rc) die("kvp_step_begin", rc);
  kvp_kv kv = {k, v, NULL};
  for (uint32_t l = 0; l < layers; l++)
    if ((rc = kvp_append(p, seq, l, &kv))) die("kvp_append", rc);
  if ((rc = kvp_step_end(p, seq))) die("kvp_step_end", rc);
}

/* n finite bf16 values of uniform bits (1.0 .. 2.0). */
static inline void fill_bf16(uint16_t *x, size_t n, uint64_t seed) {
  for (size_t i = 0; i < n; i++) x[i] = (uint16_t)(0x3c00 + (pagemix_rand(&seed) & 0x1ff)); /* finite values */
}

/* A bf16 of f (round to nearest even; the inputs here are finite). */
static inline uint16_t bench_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

/* An approximately normal draw: the sum of four uniforms, centred and
 * scaled to unit variance. */
static inline float bench_gauss(uint64_t *s) {
  double u = 0;
  for (int i = 0; i < 4; i++) u += (double)(pagemix_rand(s) >> 11) * 0x1p-53;
  return (float)((u - 2.0) * 1.7320508075688772);
}

#endif
