/*
 * tests/unit/check_kvquant_calib.c - the kvquant calibration fitter's fast
 * paths (codecs/kvquant_fit.c, codecs/kvquant_calib.c) against the plain
 * algorithm they replace.
 *
 *   - golden files: the crc32 every calibration file ends with, for
 *     kvp_kvquant_calib_add (weighted and not; smooth, nasty, quantized and
 *     periodic samples) and kvp_kvquant_calib_synthetic, pinned from the
 *     fitter before the fast paths (per-channel heaps over every row,
 *     scalar code, one row at a time): every path must write those bytes;
 *   - more golden files for vector paths added later (a row's first two
 *     outliers picked in one pass, the sample's sorted lists): head dims a
 *     multiple of 8 or not, ties, constant channels, one row; pinned from
 *     the base code (ISA 0, which those paths leave alone);
 *   - the synthetic generator's floats the same on every ISA, bit for bit
 *     (head dims of 16-channel vectors, 8-channel ones and a scalar tail);
 *   - the same bytes on every ISA (base, AVX2, AVX-512), with the sampled
 *     thresholds and with the heaps over every row, and for every worker
 *     count of synthetic;
 *   - the sampled thresholds' fallbacks (a sample that misplaces them, an
 *     answer of zero) are taken, and give the heaps' bits;
 *   - synthetic is all or nothing: a head added before is refused, naming
 *     it, with nothing fitted; set_threads checks its argument;
 *   - adds of different (layer, side) pairs on two threads at once write
 *     the bytes one thread writes.
 * (Allocation and thread-start failures: tests/unit/check_fault.c.)
 */
#include "../../codecs/kernels.h"
#include "../../codecs/kvquant.h"
#include "kvpool_codec.h"
#include "testutil.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- samples for kvp_kvquant_calib_add ------------------------------------------ */
static float tunit(uint64_t *st) { return (float)(t_rand(st) >> 40) * (1.0f / 16777216.0f); }

/* Value of row t, channel c. Pattern 0: smooth, a scale per channel; 1:
 * zeros of both signs, ties at +-0.5, +-1e38, a channel of subnormals; 2:
 * steps of 0.25 (ties), and every 4th channel zeros of both signs but for
 * a few values (both thresholds zeros, the sign theirs); 3: every 16th row
 * far above the rest (a sample of every 16th row sees only those); 4:
 * every 3rd channel constant (scores of 0 that tie), the others smooth; 5:
 * every 3rd row of 0, a, 2a (a = 2^-130: V's dense half-width a, whose
 * reciprocal overflows, so (a - mid) / half is NaN: the vector path hands
 * the row to the base code), the others smooth. */
static float tval(uint64_t *st, int pattern, uint32_t t, uint32_t c) {
  float g = (tunit(st) + tunit(st) + tunit(st) + tunit(st) - 2.0f) * 1.7f;
  uint32_t r = (uint32_t)(t_rand(st) % 64);
  switch (pattern) {
  case 0: return g * (float)(1 + c % 5);
  case 1:
    if (r == 0) return 0.0f;
    if (r == 1) return -0.0f;
    if (r == 2) return t_rand(st) & 1 ? 1e38f : -1e38f;
    if (r < 12) return 0.5f;
    if (r < 16) return -0.5f;
    if (c == 3) return 1e-39f * g;
    return g;
  case 2:
    if (c % 4 == 0) return t_rand(st) % 512 < 2 ? g : r % 2 ? 0.0f : -0.0f;
    return (float)(int)(g * 2) * 0.25f;
  case 4: return c % 3 == 0 ? 1.5f : g;
  case 5: return t % 3 == 0 ? (float)(r % 3) * 0x1p-130f : g;
  default: return t % 16 == 0 ? 100.0f + g : g;
  }
}

typedef struct add_case {
  uint32_t L, H, D, bits;
  double frac;
  uint32_t T;     /* samples per (layer, head, side) */
  int pattern;
  uint64_t seed;
  uint32_t crc;   /* of the file, from the plain fitter */
} add_case;

/* Every (layer, head, side) of c from case a, rows stride floats apart;
 * odd heads weighted (weights in {0, 0.75, 1.5, 2.25}). */
static int add_all(kvp_kvquant_calib *c, const add_case *a) {
  size_t stride = a->D + 3;
  float *x = malloc(a->T * stride * sizeof *x), *w = malloc(a->T * stride * sizeof *w);
  uint64_t st = a->seed;
  int rc = x && w ? KVP_OK : KVP_ENOMEM;
  for (uint32_t l = 0; !rc && l < a->L; l++)
    for (uint32_t kv = 0; !rc && kv < 2; kv++)
      for (uint32_t h = 0; !rc && h < a->H; h++) {
        for (uint32_t t = 0; t < a->T; t++)
          for (uint32_t ch = 0; ch < stride; ch++) {
            x[t * stride + ch] = tval(&st, a->pattern, t, ch);
            w[t * stride + ch] = (float)(t_rand(&st) % 4) * 0.75f;
          }
        rc = kvp_kvquant_calib_add(c, l, h, kv, x, h % 2 ? w : NULL, stride, a->T);
      }
  free(x);
  free(w);
  return rc;
}

/* The crc32 a file ends with (after checking its size and the crc). */
static uint32_t file_crc(const char *path, uint64_t want_bytes) {
  FILE *f = fopen(path, "rb");
  ck_assert_ptr_nonnull(f);
  uint8_t *b = malloc(want_bytes + 1);
  size_t n = fread(b, 1, want_bytes + 1, f);
  fclose(f);
  ck_assert_uint_eq(n, want_bytes);
  uint32_t crc = (uint32_t)b[n - 4] | (uint32_t)b[n - 3] << 8 | (uint32_t)b[n - 2] << 16 | (uint32_t)b[n - 1] << 24;
  ck_assert_uint_eq(kvp__crc32(0, b, n - 4), crc);
  free(b);
  return crc;
}

static uint64_t file_bytes(uint32_t L, uint32_t H, uint32_t D, uint32_t bits) {
  return 40 + (uint64_t)L * 2 * (2ull * H * D + (1u << bits)) * 4 + 4;
}

/* A file name of our own, for one test. */
static void tmp_name(char *path, size_t cap) {
  snprintf(path, cap, "/tmp/kvq_calibXXXXXX");
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
}

/* The ISAs this CPU runs: levels 0 .. n_isas() - 1. */
static int n_isas(void) {
  int n = 1;
  while (n <= KVP__ISA_AVX512 && kvp__codec_isa_set(n) == n) n++;
  return n;
}

/* The sampling strides: the default, a denser one (the synthetic fit keeps
 * its sample rows in place then), and the heaps over every row. */
static const uint32_t SAMPLING[] = {KVP__KVQ_SAMPLE_EVERY, 4, 0};

/* Pinned from the plain fitter (the commit before the fast paths). */
static const add_case ADD[] = {
    {1, 2, 20, 3, 0.02, 2000, 0, 11, 0xfc6ec67au},  /* sampled thresholds, a channel tail */
    {1, 2, 20, 3, 0.02, 2000, 1, 12, 0xfafaf3d8u},  /* zeros, ties, 1e38, subnormal ranges */
    {1, 2, 20, 2, 0.02, 2000, 2, 13, 0xa514fa4du},  /* zero thresholds: the replay */
    {1, 2, 20, 3, 0.02, 2000, 3, 14, 0x214a83ceu},  /* a misleading sample: the replay */
    {2, 3, 9, 2, 0.10, 300, 1, 15, 0xf66462e4u},    /* few rows: the heaps */
    {1, 2, 64, 4, 0.01, 1500, 0, 16, 0x8e7955a2u},  /* no tail */
    {1, 1, 1, 3, 0.00, 1200, 0, 17, 0x1b7021b0u},   /* one channel, no outlier */
};
#define NADD (sizeof ADD / sizeof *ADD)

/* Pinned from the base code (ISA 0) when the vector paths for two or more
 * outliers a row and the sample's sorted lists came; the commit before
 * them wrote the same bytes on every ISA. k: outliers a row. */
static const add_case ADD_VEC[] = {
    {1, 2, 32, 3, 0.05, 2000, 0, 21, 0xf697d8b7u},  /* k = 2, sampled */
    {1, 2, 32, 3, 0.05, 2000, 1, 22, 0x57f0eeffu},  /* k = 2, ties, zeros, 1e38 */
    {1, 2, 64, 2, 0.03, 2000, 2, 23, 0x7ec34190u},  /* k = 2, quantized: ties (4 channels a lane), replays */
    {1, 2, 128, 3, 0.01, 3000, 2, 30, 0x6fd55735u}, /* k = 2, quantized, the benchmark's head dim */
    {1, 2, 32, 3, 0.05, 2000, 4, 24, 0x4a6b04ebu},  /* k = 2, constant channels: scores that tie at 0 */
    {1, 2, 24, 3, 0.10, 8000, 1, 25, 0xb05282deu},  /* k = 3, an odd number of vectors, lists of 59 */
    {1, 2, 8, 3, 0.25, 2000, 4, 26, 0xc689c19bu},   /* k = 2 in one vector */
    {1, 2, 20, 3, 0.10, 2000, 1, 27, 0x540b0f3au},  /* k = 2, a tail of 4 channels (the heaps' sample) */
    {1, 3, 64, 4, 0.04, 3000, 3, 28, 0xb50b38e0u},  /* k = 3, a misleading sample: replays */
    {1, 1, 16, 3, 0.10, 1, 4, 29, 0x433e488du},     /* k = 2, one row */
    {1, 2, 16, 3, 0.10, 600, 5, 31, 0xe64138f2u},   /* k = 2, V rows the vector path hands back */
};
#define NADD_VEC (sizeof ADD_VEC / sizeof *ADD_VEC)

static void add_golden(const add_case *a, int i) {
  char path[64];
  tmp_name(path, sizeof path);
  int was = kvp__codec_isa(), nisa = n_isas();
  for (int isa = 0; isa < nisa; isa++)
    for (size_t s = 0; s < sizeof SAMPLING / sizeof *SAMPLING; s++) {
      ck_assert_int_eq(kvp__codec_isa_set(isa), isa);
      kvp__kvq_fit_set_sampling(SAMPLING[s]);
      kvp_kvquant_calib *c;
      ck_ok(kvp_kvquant_calib_create(a->L, a->H, a->D, a->bits, a->frac, &c));
      ck_ok(add_all(c, a));
      ck_ok(kvp_kvquant_calib_write(c, path));
      kvp_kvquant_calib_destroy(c);
      uint32_t crc = file_crc(path, file_bytes(a->L, a->H, a->D, a->bits));
      ck_assert_msg(crc == a->crc, "case %d, ISA %d, sampling %u: crc %08x, pinned %08x", i, isa, SAMPLING[s], crc,
                    a->crc);
    }
  kvp__kvq_fit_set_sampling(KVP__KVQ_SAMPLE_EVERY);
  kvp__codec_isa_set(was);
  unlink(path);
}

START_TEST(add_matches_golden) { add_golden(&ADD[_i], _i); }
END_TEST

START_TEST(add_vec_matches_golden) { add_golden(&ADD_VEC[_i], _i); }
END_TEST

typedef struct synth_case {
  uint32_t L, H, D, bits;
  double frac;
  uint32_t seqs, tokens;
  uint64_t seed;
  uint32_t crc;
} synth_case;

static const synth_case SYN[] = {
    {2, 3, 44, 3, 0.02, 2, 640, 5, 0xa221cc05u},   /* sampled thresholds, a channel tail, drift across seeds */
    {1, 2, 128, 3, 0.01, 4, 512, 0, 0x03d83247u},  /* the benchmark's shape, smaller */
    {1, 1, 7, 2, 0.00, 1, 200, 3, 0xafaabd87u},    /* few rows: the heaps; no outlier */
};
#define NSYN (sizeof SYN / sizeof *SYN)

START_TEST(synthetic_matches_golden) {
  const synth_case *a = &SYN[_i];
  char path[64];
  tmp_name(path, sizeof path);
  const uint32_t threads[] = {1, 2, 3, 0};
  int was = kvp__codec_isa(), nisa = n_isas();
  for (int isa = 0; isa < nisa; isa++)
    for (size_t s = 0; s < sizeof SAMPLING / sizeof *SAMPLING; s++)
      for (size_t t = 0; t < sizeof threads / sizeof *threads; t++) {
        if (t > 0 && (isa != nisa - 1 || s > 0)) continue; /* worker counts on the default path */
        ck_assert_int_eq(kvp__codec_isa_set(isa), isa);
        kvp__kvq_fit_set_sampling(SAMPLING[s]);
        kvp_kvquant_calib *c;
        ck_ok(kvp_kvquant_calib_create(a->L, a->H, a->D, a->bits, a->frac, &c));
        ck_ok(kvp_kvquant_calib_set_threads(c, threads[t]));
        ck_ok(kvp_kvquant_calib_synthetic(c, a->seed, a->seqs, a->tokens));
        ck_ok(kvp_kvquant_calib_write(c, path));
        kvp_kvquant_calib_destroy(c);
        uint32_t crc = file_crc(path, file_bytes(a->L, a->H, a->D, a->bits));
        ck_assert_msg(crc == a->crc, "case %d, ISA %d, sampling %u, %u threads: crc %08x, pinned %08x", _i, isa,
                      SAMPLING[s], threads[t], crc, a->crc);
      }
  kvp__kvq_fit_set_sampling(KVP__KVQ_SAMPLE_EVERY);
  kvp__codec_isa_set(was);
  unlink(path);
}
END_TEST

/* The sampled thresholds' fallbacks run where the pinned cases say they
 * must: a quantized or periodic sample replays channels, a smooth one
 * none. */
START_TEST(fallbacks_taken) {
  const int want[] = {0, -1, 1, 1}; /* cases 0..3: none, any, some, some */
  for (int i = 0; i < 4; i++) {
    uint64_t before = kvp__kvq_fit_replays();
    kvp_kvquant_calib *c;
    ck_ok(kvp_kvquant_calib_create(ADD[i].L, ADD[i].H, ADD[i].D, ADD[i].bits, ADD[i].frac, &c));
    ck_ok(add_all(c, &ADD[i]));
    kvp_kvquant_calib_destroy(c);
    uint64_t n = kvp__kvq_fit_replays() - before;
    if (want[i] == 0) ck_assert_msg(n == 0, "case %d: %llu replays", i, (unsigned long long)n);
    if (want[i] == 1) ck_assert_msg(n > 0, "case %d: no replay", i);
  }
}
END_TEST

/* The sample's thresholds (the screens) from the sorted lists of the
 * vector ISAs equal the heaps' of the base code, a zero's sign aside.
 * They decide no byte of a file (a screen too tight or too loose only
 * sends channels to the replay), so the golden files cannot see them. */
START_TEST(sample_lists_match_heaps) {
  static const struct {
    uint32_t D, n;
    double frac;
    int pattern;
  } C[] = {{128, 4096, 0.01, 0}, {32, 2000, 0.05, 1}, {64, 3000, 0.04, 3}, {24, 8000, 0.10, 2}, {16, 2000, 0.05, 4}};
  int was = kvp__codec_isa(), top = n_isas() - 1;
  if (top < KVP__ISA_AVX2) return; /* no vector ISA here: nothing to compare */
  for (size_t i = 0; i < sizeof C / sizeof *C; i++) {
    uint32_t D = C[i].D, n = C[i].n;
    float *x = malloc((size_t)n * D * sizeof *x), lo[2][128], hi[2][128];
    ck_assert_ptr_nonnull(x);
    uint64_t st = 40 + i;
    for (uint32_t t = 0; t < n; t++)
      for (uint32_t c = 0; c < D; c++) x[(size_t)t * D + c] = tval(&st, C[i].pattern, t, c);
    kvp__kvq_fit f;
    ck_ok(kvp__kvq_fit_init(&f, 1, D, 3, 0, C[i].frac));
    for (int v = 0; v < 2; v++) {
      ck_assert_int_eq(kvp__codec_isa_set(v ? top : 0), v ? top : 0);
      kvp__kvq_head hs;
      ck_ok(kvp__kvq_head_begin(&f, 0, n, &hs));
      ck_assert_msg(hs.every && hs.hm <= KVP__KVQ_SAMPLE_LISTS_MAX && D % 8 == 0, "case %zu: lists not taken", i);
      kvp__kvq_head_sample(&hs, x, (size_t)hs.every * D);
      memcpy(lo[v], hs.lo_root, D * sizeof(float));
      memcpy(hi[v], hs.hi_root, D * sizeof(float));
      kvp__kvq_head_abort(&hs);
    }
    for (uint32_t c = 0; c < D; c++)
      ck_assert_msg(lo[0][c] == lo[1][c] && hi[0][c] == hi[1][c], "case %zu channel %u: heaps [%g, %g], lists [%g, %g]",
                    i, c, (double)lo[0][c], (double)hi[0][c], (double)lo[1][c], (double)hi[1][c]);
    kvp__kvq_fit_free(&f);
    free(x);
  }
  kvp__codec_isa_set(was);
}
END_TEST

/* kvp__kvq_synth on every ISA equals the base code bit for bit: 4096
 * rows of D channels hold thousands of the heavy tail's values (1 in 128). */
START_TEST(synth_same_on_every_isa) {
  static const uint32_t DIMS[] = {128, 136, 44, 20, 7};
  const uint32_t n = 4096;
  int was = kvp__codec_isa(), nisa = n_isas();
  float *ref = malloc((size_t)n * 136 * sizeof *ref), *got = malloc((size_t)n * 136 * sizeof *got);
  ck_assert(ref && got);
  for (size_t d = 0; d < sizeof DIMS / sizeof *DIMS; d++)
    for (uint32_t kv = 0; kv < 2; kv++) {
      uint32_t D = DIMS[d];
      ck_assert_int_eq(kvp__codec_isa_set(0), 0);
      kvp__kvq_synth(9 + d, 3, 5, kv, 1000, n, D, ref, D);
      for (int isa = 1; isa < nisa; isa++) {
        ck_assert_int_eq(kvp__codec_isa_set(isa), isa);
        kvp__kvq_synth(9 + d, 3, 5, kv, 1000, n, D, got, D);
        for (size_t i = 0; i < (size_t)n * D; i++)
          ck_assert_msg(memcmp(&ref[i], &got[i], sizeof(float)) == 0,
                        "D %u kv %u ISA %d: row %zu channel %zu: %a, base %a", D, kv, isa, i / D, i % D,
                        (double)got[i], (double)ref[i]);
      }
    }
  kvp__codec_isa_set(was);
  free(ref);
  free(got);
}
END_TEST

START_TEST(synthetic_all_or_nothing) {
  kvp_kvquant_calib *c;
  ck_ok(kvp_kvquant_calib_create(3, 2, 16, 3, 0.01, &c));
  float x[8 * 16];
  for (int i = 0; i < 8 * 16; i++) x[i] = (float)(i % 13) - 6.0f;
  ck_ok(kvp_kvquant_calib_add(c, 2, 1, 1, x, NULL, 16, 8));
  ck_status(kvp_kvquant_calib_synthetic(c, 1, 1, 64), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "layer 2 V head 1"), "%s", kvp_last_error());
  /* nothing fitted: every other head still takes samples, the one added is refused */
  ck_ok(kvp_kvquant_calib_add(c, 0, 0, 0, x, NULL, 16, 8));
  ck_status(kvp_kvquant_calib_add(c, 2, 1, 1, x, NULL, 16, 8), KVP_EINVAL);
  kvp_kvquant_calib_destroy(c);
  ck_ok(kvp_kvquant_calib_create(1, 1, 16, 3, 0.01, &c));
  ck_status(kvp_kvquant_calib_set_threads(c, KVP_KVQUANT_CALIB_MAX_THREADS + 1), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "n_threads"), "%s", kvp_last_error());
  ck_status(kvp_kvquant_calib_set_threads(NULL, 1), KVP_EINVAL);
  ck_ok(kvp_kvquant_calib_set_threads(c, KVP_KVQUANT_CALIB_MAX_THREADS));
  ck_ok(kvp_kvquant_calib_synthetic(c, 1, 1, 64)); /* more workers than sides: one per side */
  ck_status(kvp_kvquant_calib_synthetic(c, 1, 1, 64), KVP_EINVAL); /* twice */
  kvp_kvquant_calib_destroy(c);
}
END_TEST

/* Adds of different (layer, side) pairs on two threads at once (the
 * header allows it) write the file one thread writes. */
typedef struct pair_adds {
  kvp_kvquant_calib *c;
  uint32_t first;  /* the pairs 2 l + kv this thread adds: first, first + 2, ... */
  int rc;
} pair_adds;

enum { PL = 4, PH = 2, PD = 32, PT = 1500 };

static int add_pair(kvp_kvquant_calib *c, uint32_t i) {
  float *x = malloc((size_t)PT * PD * sizeof *x);
  int rc = x ? KVP_OK : KVP_ENOMEM;
  for (uint32_t h = 0; !rc && h < PH; h++) {
    uint64_t st = 100 + i * PH + h;
    for (uint32_t t = 0; t < PT * PD; t++) x[t] = tval(&st, 0, t / PD, t % PD);
    rc = kvp_kvquant_calib_add(c, i / 2, h, i % 2, x, NULL, PD, PT);
  }
  free(x);
  return rc;
}

static void *pair_thread(void *arg) {
  pair_adds *p = arg;
  for (uint32_t i = p->first; !p->rc && i < 2 * PL; i += 2) p->rc = add_pair(p->c, i);
  return NULL;
}

START_TEST(add_pairs_concurrently) {
  char path[64];
  tmp_name(path, sizeof path);
  uint32_t crc[2];
  for (int par = 0; par < 2; par++) {
    kvp_kvquant_calib *c;
    ck_ok(kvp_kvquant_calib_create(PL, PH, PD, 3, 0.03, &c));
    if (par) {
      pair_adds a = {c, 0, 0}, b = {c, 1, 0};
      pthread_t t;
      ck_assert_int_eq(pthread_create(&t, NULL, pair_thread, &b), 0);
      pair_thread(&a);
      pthread_join(t, NULL);
      ck_ok(a.rc);
      ck_ok(b.rc);
    } else
      for (uint32_t i = 0; i < 2 * PL; i++) ck_ok(add_pair(c, i));
    ck_ok(kvp_kvquant_calib_write(c, path));
    kvp_kvquant_calib_destroy(c);
    crc[par] = file_crc(path, file_bytes(PL, PH, PD, 3));
  }
  ck_assert_msg(crc[0] == crc[1], "two threads wrote crc %08x, one %08x", crc[1], crc[0]);
  unlink(path);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("kvquant_calib");
  TCase *tc = tcase_create("golden");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, add_matches_golden, 0, (int)NADD);
  tcase_add_loop_test(tc, add_vec_matches_golden, 0, (int)NADD_VEC);
  tcase_add_loop_test(tc, synthetic_matches_golden, 0, (int)NSYN);
  tcase_add_test(tc, fallbacks_taken);
  tcase_add_test(tc, sample_lists_match_heaps);
  tcase_add_test(tc, synth_same_on_every_isa);
  suite_add_tcase(s, tc);
  tc = tcase_create("api");
  tcase_add_test(tc, synthetic_all_or_nothing);
  tcase_add_test(tc, add_pairs_concurrently);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return t_run(suite()); }
