/*
 * tools/bench_calib.c - kvpool-bench's two kvquant calibration figures
 * (kvquant_calib_s, kvquant_calib_synthetic_s; tools/kvpool-bench.c's
 * banner defines them), apart from the rest of the bench. Public headers
 * only.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pagemix.h"
#include "bench_calib.h"
#include "bench_util.h"
#include "kvpool_codec.h"

/* One layer's calibration samples as an engine hands them over, f32
 * [side][head][T][D]: per channel a bias and a scale (K: one channel in 32
 * ten times wider, its outlier channels), z about N(0, 1) (four 16-bit
 * uniforms), one value in 128 of a heavier tail (z times 2 .. 5): the
 * shape of the library's synthetic generator, from the bench's own. */
static float *calib_samples(uint32_t H, uint32_t D, uint32_t T) {
  float *x = malloc((size_t)2 * H * T * D * sizeof *x), *bias = malloc(D * sizeof *bias), *scale = malloc(D * sizeof *scale);
  if (!x || !bias || !scale) die("malloc", KVP_ENOMEM);
  uint64_t s = 0x5EEDull;
  for (uint32_t kv = 0; kv < 2; kv++)
    for (uint32_t h = 0; h < H; h++) {
      for (uint32_t c = 0; c < D; c++) {
        uint64_t r = pagemix_rand(&s);
        float u = (float)(r >> 40) * 0x1p-24f, g = bench_gauss(&s);
        bias[c] = kv ? 0.1f * g : 0.5f * g;
        scale[c] = kv ? 0.5f + u : (c % 32 == h % 32 ? 10.0f : 1.0f) * (0.6f + 0.8f * u);
      }
      float *o = x + ((size_t)kv * H + h) * T * D;
      for (size_t i = 0; i < (size_t)T * D; i++) {
        uint64_t r = pagemix_rand(&s);
        float z = ((float)(r & 0xFFFF) + (float)(r >> 16 & 0xFFFF) + (float)(r >> 32 & 0xFFFF) + (float)(r >> 48)) *
                      (1.0f / 65536.0f) - 2.0f;
        z *= 1.7320508f;
        if ((r ^ r >> 29) % 128 == 0) z *= 2.0f + 3.0f * (float)(r >> 40 & 0xFFFF) * (1.0f / 65536.0f);
        o[i] = bias[i % D] + scale[i % D] * z;
      }
    }
  free(bias), free(scale);
  return x;
}

/* Workers of the calibration figure: each takes the next (layer, side)
 * pair and adds its heads (kvp_kvquant_calib_add may run for different
 * pairs at once), every layer from the one layer of samples. */
typedef struct calib_job {
  kvp_kvquant_calib *c;
  const float *x;           /* [side][head][T][D] */
  uint32_t L, H, D, T;
  _Atomic uint32_t next;    /* next 2 layer + side */
} calib_job;

static void *calib_worker(void *arg) {
  calib_job *j = arg;
  for (uint32_t i; (i = atomic_fetch_add(&j->next, 1)) < 2 * j->L;)
    for (uint32_t h = 0; h < j->H; h++) {
      const float *x = j->x + ((size_t)(i % 2) * j->H + h) * j->T * j->D;
      int rc = kvp_kvquant_calib_add(j->c, i / 2, h, i % 2, x, NULL, j->D, j->T);
      if (rc) die("kvp_kvquant_calib_add", rc);
    }
  return NULL;
}

/* memcpy of bytes through a 64 MiB buffer: seconds */
static double memcpy_s(uint64_t total) {
  size_t buf = 64u << 20;
  char *a = malloc(buf), *b = malloc(buf);
  if (!a || !b) die("malloc", KVP_ENOMEM);
  memset(a, 1, buf), memset(b, 2, buf);
  double t1 = now_ns();
  for (uint64_t done = 0; done < total; done += buf) {
    memcpy(b, a, buf);
    __asm__ volatile("" : : "r"(b) : "memory");
  }
  free(a), free(b);
  return (now_ns() - t1) / 1e9;
}

/* kvquant calibration, two figures, L x H heads of D channels, K and V,
 * 16 x 2048 tokens each; one round each (the fit is long); --quick: 2
 * layers. Baseline: memcpy of the samples' f32 bytes through a 64 MiB
 * buffer.
 *   kvquant_calib_s: the calibration alone, as an engine runs it: create,
 *     kvp_kvquant_calib_add of every (layer, head, side) from samples in
 *     memory, on one thread per online CPU (as many as synthetic's
 *     default), then write (the codebooks are fitted there). The samples,
 *     one layer's K and V (1 GiB at H = 32), are made before the clock
 *     starts, and every layer is fitted from them: the fit reads them from
 *     DRAM (far past the caches), as it would an engine's.
 *   kvquant_calib_synthetic_s: kvp_kvquant_calib_synthetic and write,
 *     what a pool with calib=synthetic spends at create: the built-in
 *     generator (2^33 samples made, about a third of the figure) counts. */
void bench_kvquant_calib(int quick, int json_only) {
  const uint32_t L = quick ? 2 : 32, H = 32, D = 128, S = 16, T = 2048;
  char path[] = "/tmp/kvpool-bench-kvqXXXXXX";
  int fd = mkstemp(path);
  if (fd < 0) die("mkstemp", KVP_EINVAL);
  close(fd);
  uint64_t total = (uint64_t)L * H * 2 * S * T * D * sizeof(float);
  kvp_kvquant_calib *c;
  /* the calibration alone */
  long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
  uint32_t nt = ncpu < 1 ? 1 : ncpu > 2 * (long)L ? 2 * L : (uint32_t)ncpu;
  if (nt > 64) nt = 64;
  float *x = calib_samples(H, D, S * T);
  calib_job j = {.x = x, .L = L, .H = H, .D = D, .T = S * T};
  atomic_init(&j.next, 0);
  pthread_t tid[64];
  double t0 = now_ns();
  int rc = kvp_kvquant_calib_create(L, H, D, 3, 0.01, &c);
  if (rc) die("kvp_kvquant_calib_create", rc);
  j.c = c;
  for (uint32_t t = 1; t < nt; t++)
    if (pthread_create(&tid[t], NULL, calib_worker, &j)) die("pthread_create", KVP_ENOMEM);
  calib_worker(&j);
  for (uint32_t t = 1; t < nt; t++) pthread_join(tid[t], NULL);
  if ((rc = kvp_kvquant_calib_write(c, path))) die("kvp_kvquant_calib_write", rc);
  double fit_s = (now_ns() - t0) / 1e9;
  kvp_kvquant_calib_destroy(c);
  free(x);
  double mc_s = memcpy_s(total);
  /* the synthetic fit, generator included */
  t0 = now_ns();
  if ((rc = kvp_kvquant_calib_create(L, H, D, 3, 0.01, &c))) die("kvp_kvquant_calib_create", rc);
  if ((rc = kvp_kvquant_calib_synthetic(c, 0, S, T))) die("kvp_kvquant_calib_synthetic", rc);
  if ((rc = kvp_kvquant_calib_write(c, path))) die("kvp_kvquant_calib_write", rc);
  double syn_s = (now_ns() - t0) / 1e9;
  kvp_kvquant_calib_destroy(c);
  unlink(path);
  double mc2_s = memcpy_s(total);
  if (!json_only) {
    printf("kvquant calibration L=%u H=%u D=%u, %u x %u tokens from memory, %u threads: %.1f s (memcpy of the %.1f GB "
           "of samples: %.2f s, %.0fx)\n", L, H, D, S, T, nt, fit_s, (double)total / 1e9, mc_s, fit_s / mc_s);
    printf("kvquant calibration, synthetic (generator included): %.1f s (memcpy %.2f s, %.0fx)\n", syn_s, mc2_s,
           syn_s / mc2_s);
  }
  printf("{\"figure\":\"kvquant_calib_s\",\"layers\":%u,\"heads\":%u,\"head_dim\":%u,\"tokens\":%u,\"threads\":%u,"
         "\"seconds\":%.3f,\"baseline\":\"memcpy\",\"baseline_s\":%.3f,\"ratio\":%.1f}\n", L, H, D, S * T, nt, fit_s,
         mc_s, fit_s / mc_s);
  printf("{\"figure\":\"kvquant_calib_synthetic_s\",\"layers\":%u,\"heads\":%u,\"head_dim\":%u,\"tokens\":%u,"
         "\"seconds\":%.3f,\"baseline\":\"memcpy\",\"baseline_s\":%.3f,\"ratio\":%.1f}\n", L, H, D, S * T, syn_s,
         mc2_s, syn_s / mc2_s);
}
