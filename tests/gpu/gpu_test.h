/*
 * tests/gpu/gpu_test.h - what the GPU suites share: status and CUDA
 * assertions, bf16 bits, a seeded normal generator, the KVP_GPU_SPEC filter,
 * and main's skip-without-a-device and NOFORK run (a forked child cannot
 * use the parent's CUDA context).
 */
#ifndef KVP_TESTS_GPU_TEST_H
#define KVP_TESTS_GPU_TEST_H

#include <check.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"

#define ck_ok(expr)                                                                                  \
  do {                                                                                               \
    int rc_ = (expr);                                                                                \
    ck_assert_msg(rc_ == KVP_OK, "%s: %s (%s)", #expr, kvp_err_name(rc_), kvp_last_error());          \
  } while (0)
#define ck_cuda(expr)                                                                                \
  do {                                                                                               \
    cudaError_t e_ = (expr);                                                                         \
    ck_assert_msg(e_ == cudaSuccess, "%s: %s", #expr, cudaGetErrorString(e_));                        \
  } while (0)

/* bf16 bits of a finite x, rounded to nearest even; and back. */
static inline uint16_t gpu_bf16_of(float x) {
  uint32_t u;
  memcpy(&u, &x, 4);
  return (uint16_t)((u + 0x7FFFu + (u >> 16 & 1u)) >> 16);
}
static inline float gpu_f32_of_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float x;
  memcpy(&x, &u, 4);
  return x;
}

/* A standard normal draw (Box-Muller over a 64-bit LCG in *seed). */
static inline float gpu_normal(uint64_t *seed) {
  *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
  double u1 = ((*seed >> 11) + 1.0) / 9007199254740993.0;
  *seed = *seed * 6364136223846793005ull + 1442695040888963407ull;
  double u2 = (*seed >> 11) / 9007199254740992.0;
  return (float)(sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2));
}

/* KVP_GPU_SPEC=text narrows a sweep to the specs that contain it. */
static inline int gpu_spec_off(const char *spec) {
  const char *only = getenv("KVP_GPU_SPEC");
  return only && !strstr(spec, only);
}

/* 0 (with a message naming prog) when no CUDA device is visible. */
static inline int gpu_present(const char *prog) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    printf("%s: skipped: no CUDA device visible\n", prog);
    return 0;
  }
  return 1;
}

/* Run s without forking; main's exit status. */
static inline int gpu_run(Suite *s, enum print_output mode) {
  SRunner *sr = srunner_create(s);
  srunner_set_fork_status(sr, CK_NOFORK);
  srunner_run_all(sr, mode);
  int nf = srunner_ntests_failed(sr);
  srunner_free(sr);
  return nf ? 1 : 0;
}

#endif /* KVP_TESTS_GPU_TEST_H */
