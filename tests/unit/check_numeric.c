/*
 * tests/unit/check_numeric.c - the numeric core of the codecs: every code of
 * every small float format decodes to its value and re-encodes to itself,
 * every tie between adjacent codes goes to the even one, the named edges
 * (saturation, overflow, subnormals, NaN, signed zero) give the documented
 * code, and a reference encoder built a different way (double arithmetic, a
 * binary search in the table of all values, an explicit ties-to-even rule)
 * agrees with the library on 10 million random floats per format. Then row
 * conversions, and the three layouts of packed 2/3/4-bit codes, pinned by
 * hand-written bytes. The branch-free forms (and the vectorized rows built
 * on them) agree with the scalar conversions on every code and on a sweep
 * of f32 patterns covering every tie position. kvp__sincos (RoPE angles,
 * the device's twin computes the same bits) stays within 2 ulp of libm.
 *
 * KVP_NUMERIC_EXHAUSTIVE=1 in the environment makes the reference test run
 * over all 2^32 f32 bit patterns instead of the random sample (minutes).
 */
#include "../../codecs/kernels.h"
#include "../../codecs/numeric.h"
#include "../../util/util.h"
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

static float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

/* ---- the formats, described by their fields ------------------------------ */

typedef struct fmt {
  const char *name;
  unsigned ebits, mbits; /* exponent and mantissa field widths, bits */
  int bias;              /* exponent bias */
  bool sat;              /* out of range saturates to maxcode (else: infinity) */
  bool ieee;             /* all-ones exponent is inf/NaN (BF16, FP16) */
  uint32_t maxcode;      /* largest finite magnitude code */
  uint32_t signbit;      /* the sign bit of a code */
  uint32_t (*enc)(float);
  float (*dec)(uint32_t);
} fmt;

static uint32_t enc_fp8(float x) { return kvp__fp8_e4m3_from_f32(x); }
static float dec_fp8(uint32_t c) { return kvp__fp8_e4m3_to_f32((uint8_t)c); }
static uint32_t enc_bf16(float x) { return kvp__bf16_from_f32(x); }
static float dec_bf16(uint32_t c) { return kvp__bf16_to_f32((uint16_t)c); }
static uint32_t enc_f16(float x) { return kvp__f16_from_f32(x); }
static float dec_f16(uint32_t c) { return kvp__f16_to_f32((uint16_t)c); }
static uint32_t enc_e2m1(float x) { return kvp__e2m1_from_f32(x); }
static float dec_e2m1(uint32_t c) { return kvp__e2m1_to_f32((uint8_t)c); }

enum { F_FP8, F_BF16, F_F16, F_E2M1, NFMT };
static const fmt fmts[NFMT] = {
    [F_FP8] = {"fp8_e4m3", 4, 3, 7, true, false, 0x7E, 0x80, enc_fp8, dec_fp8},
    [F_BF16] = {"bf16", 8, 7, 127, false, true, 0x7F7F, 0x8000, enc_bf16, dec_bf16},
    [F_F16] = {"f16", 5, 10, 15, false, true, 0x7BFF, 0x8000, enc_f16, dec_f16},
    [F_E2M1] = {"e2m1", 2, 1, 1, true, false, 0x7, 0x8, enc_e2m1, dec_e2m1},
};

/* Value of magnitude code c by the textbook formula, exponent unbounded
 * (so maxcode + 1 is the next value above the largest: 480, 2^16, 2^128, 8). */
static double ref_value(const fmt *f, uint32_t c) {
  uint32_t e = c >> f->mbits, m = c & ((1u << f->mbits) - 1);
  if (e == 0) return ldexp((double)m, 1 - f->bias - (int)f->mbits);
  return ldexp((double)((1u << f->mbits) + m), (int)e - f->bias - (int)f->mbits);
}

static bool ref_is_nan_code(const fmt *f, uint32_t c) {
  uint32_t mag = c & ~f->signbit, emax = (1u << f->ebits) - 1;
  if (f->ieee) return (mag >> f->mbits) == emax && (mag & ((1u << f->mbits) - 1));
  return f == &fmts[F_FP8] && mag == 0x7F;
}

/* The NaN code each encoder documents: FP8 0x7F, E2M1 0x7 (+6); BF16 and
 * FP16 keep the sign and the top payload bits and set the quiet bit. */
static uint32_t ref_nan(const fmt *f, uint32_t u) {
  if (!f->ieee) return f == &fmts[F_FP8] ? 0x7F : 0x7;
  uint32_t s = u >> 31 ? f->signbit : 0, emax = (1u << f->ebits) - 1;
  return s | emax << f->mbits | 1u << (f->mbits - 1) | (u & 0x7FFFFF) >> (23 - f->mbits);
}

/* vals[c] = ref_value(c) for c = 0 .. maxcode + 1, increasing. */
static double *ref_table(const fmt *f) {
  double *v = malloc((f->maxcode + 2) * sizeof *v);
  ck_assert_ptr_nonnull(v);
  for (uint32_t c = 0; c <= f->maxcode + 1; c++) v[c] = ref_value(f, c);
  return v;
}

/* The reference encoder. |x| lies in [vals[lo], vals[hi]) with hi = lo + 1;
 * adjacent values differ by at most 2x, so both distances are exact in
 * double (Sterbenz; for lo = 0 the distance is |x| itself), and the nearer
 * code wins, the even one on a tie. Past the table: the top code. */
static uint32_t ref_encode(const fmt *f, const double *vals, float x) {
  uint32_t u = bits_of(x), s = u >> 31 ? f->signbit : 0, top = f->maxcode + 1, pick;
  if (isnan(x)) return ref_nan(f, u);
  double d = fabs((double)x);
  if (d >= vals[top]) {
    pick = top;
  } else {
    uint32_t lo = 0, hi = top;
    while (hi - lo > 1) {
      uint32_t mid = lo + (hi - lo) / 2;
      if (vals[mid] <= d) lo = mid;
      else hi = mid;
    }
    double dl = d - vals[lo], dh = vals[hi] - d;
    pick = dl < dh ? lo : dh < dl ? hi : (lo % 2 == 0 ? lo : hi);
  }
  if (pick == top && f->sat) pick = f->maxcode; /* else top is the infinity code */
  return s | pick;
}

/* ---- every code ------------------------------------------------------------ */

START_TEST(every_code_decodes) {
  const fmt *f = &fmts[_i];
  uint32_t ncodes = f->signbit << 1, emax = (1u << f->ebits) - 1;
  for (uint32_t c = 0; c < ncodes; c++) {
    float got = f->dec(c);
    uint32_t mag = c & ~f->signbit;
    ck_assert_msg(!signbit(got) == !(c & f->signbit), "%s code 0x%x: sign of %a", f->name, c, (double)got);
    if (ref_is_nan_code(f, c)) {
      ck_assert_msg(isnan(got), "%s code 0x%x: %a, not NaN", f->name, c, (double)got);
      continue;
    }
    double want = f->ieee && mag >> f->mbits == emax ? INFINITY : ref_value(f, mag);
    ck_assert_msg(fabs((double)got) == want, "%s code 0x%x: %a, want %a", f->name, c, (double)got, want);
  }
}
END_TEST

START_TEST(every_code_reencodes) {
  const fmt *f = &fmts[_i];
  uint32_t ncodes = f->signbit << 1, nnan = 0;
  for (uint32_t c = 0; c < ncodes; c++) {
    uint32_t back = f->enc(f->dec(c)), want = c;
    if (ref_is_nan_code(f, c)) {
      nnan++; /* quiet NaNs keep their bits; a signalling one comes back quiet */
      want = f->ieee ? c | 1u << (f->mbits - 1) : 0x7F;
    }
    ck_assert_msg(back == want, "%s code 0x%x -> %a -> 0x%x, want 0x%x", f->name, c, (double)f->dec(c), back,
                  want);
  }
  static const uint32_t want_nnan[NFMT] = {2, 254, 2046, 0};
  ck_assert_uint_eq(nnan, want_nnan[_i]);
}
END_TEST

static void check_enc(const fmt *f, float x, uint32_t want) {
  uint32_t got = f->enc(x);
  ck_assert_msg(got == want, "%s(%a) = 0x%x, want 0x%x", f->name, (double)x, got, want);
}

/* Between every pair of adjacent magnitudes: the exact midpoint goes to the
 * even code, one f32 ulp either side to the nearer code; the pair above the
 * largest finite value saturates or overflows to infinity. */
START_TEST(every_midpoint_ties_to_even) {
  const fmt *f = &fmts[_i];
  double *vals = ref_table(f);
  uint32_t top = f->maxcode + 1, over = f->sat ? f->maxcode : top;
  for (uint32_t c = 0; c < top; c++) {
    double mid = (vals[c] + vals[c + 1]) / 2;
    float x = (float)mid;
    ck_assert_msg((double)x == mid, "%s: midpoint %a not an f32", f->name, mid);
    uint32_t even = c % 2 == 0 ? c : c + 1, up = c + 1 == top ? over : c + 1;
    if (even == top) even = over;
    float below = nextafterf(x, 0), above = nextafterf(x, INFINITY);
    for (int neg = 0; neg < 2; neg++) {
      uint32_t s = neg ? f->signbit : 0;
      float sg = neg ? -1.0f : 1.0f;
      check_enc(f, sg * x, s | even);
      check_enc(f, sg * below, s | c);
      check_enc(f, sg * above, s | up);
    }
  }
  free(vals);
}
END_TEST

/* ---- named edges ----------------------------------------------------------- */

typedef struct edge {
  float in;      /* input value */
  uint32_t want; /* expected code */
} edge;

static void check_edges(const fmt *f, const edge *e, size_t n) {
  for (size_t i = 0; i < n; i++)
    ck_assert_msg(f->enc(e[i].in) == e[i].want, "%s(%a = %.9g) = 0x%x, want 0x%x (row %zu)", f->name,
                  (double)e[i].in, (double)e[i].in, f->enc(e[i].in), e[i].want, i);
}

START_TEST(fp8_edges) {
  const edge e[] = {
      {0.0f, 0x00}, {-0.0f, 0x80}, {1.0f, 0x38}, {-1.0f, 0xB8}, {448.0f, 0x7E}, {-448.0f, 0xFE},
      {449.0f, 0x7E}, {464.0f, 0x7E}, /* tie 448 | 480: even, also saturation */
      {nextafterf(464.0f, 0), 0x7E}, {nextafterf(464.0f, INFINITY), 0x7E}, {480.0f, 0x7E},
      {1e9f, 0x7E}, {-1e9f, 0xFE}, {FLT_MAX, 0x7E}, {INFINITY, 0x7E}, {-INFINITY, 0xFE},
      {432.0f, 0x7E}, /* tie 416 (0x7D) | 448 (0x7E) */ {400.0f, 0x7C}, /* tie 384 | 416 */
      {424.0f, 0x7D}, {440.0f, 0x7E},
      {1.0625f, 0x38}, {1.1875f, 0x3A}, {15.5f, 0x58}, {-15.5f, 0xD8}, /* ties in binades */
      {0x1p-6f, 0x08}, {0x1.cp-7f, 0x07}, /* smallest normal, largest subnormal 7 2^-9 */
      {0x1.ep-7f, 0x08}, /* tie 7 2^-9 | 8 2^-9 across the subnormal/normal boundary */
      {nextafterf(0x1.ep-7f, 0), 0x07}, {0x1p-9f, 0x01}, {-0x1p-9f, 0x81},
      {0x1p-10f, 0x00}, {-0x1p-10f, 0x80}, /* half the smallest subnormal: tie to 0 */
      {nextafterf(0x1p-10f, 1), 0x01}, {0x1.8p-9f, 0x02}, {0x1.4p-8f, 0x02}, /* 1.5, 2.5 2^-9 */
      {1e-30f, 0x00}, {FLT_TRUE_MIN, 0x00}, {-FLT_TRUE_MIN, 0x80},
      {NAN, 0x7F}, {-NAN, 0x7F}, {float_of(0x7F800001), 0x7F}, {float_of(0xFFFFFFFF), 0x7F},
  };
  check_edges(&fmts[F_FP8], e, KVP__ARRAY_LEN(e));
  ck_assert(kvp__fp8_e4m3_to_f32(0x7E) == KVP__FP8_E4M3_MAX);
  ck_assert(isnan(kvp__fp8_e4m3_to_f32(0xFF)) && signbit(kvp__fp8_e4m3_to_f32(0xFF)));
  ck_assert(kvp__fp8_e4m3_to_f32(0x01) == 0x1p-9f && kvp__fp8_e4m3_to_f32(0x80) == 0.0f);
}
END_TEST

START_TEST(bf16_edges) {
  const edge e[] = {
      {0.0f, 0x0000}, {-0.0f, 0x8000}, {1.0f, 0x3F80}, {1.0f + 0x1p-8f, 0x3F80}, /* tie: even */
      {1.0f + 0x3p-8f, 0x3F82}, {-(1.0f + 0x3p-8f), 0xBF82}, {float_of(0x3F808001), 0x3F81},
      {FLT_MAX, 0x7F80}, {float_of(0x7F7F8000), 0x7F80}, /* tie max | inf: inf */
      {float_of(0x7F7F7FFF), 0x7F7F}, {INFINITY, 0x7F80}, {-INFINITY, 0xFF80},
      {float_of(0x00008000), 0x0000}, {float_of(0x00018000), 0x0002}, /* subnormal ties */
      {float_of(0x00008001), 0x0001}, {FLT_TRUE_MIN, 0x0000}, {-FLT_TRUE_MIN, 0x8000},
      {float_of(0x007FFFFF), 0x0080}, /* largest f32 subnormal rounds up to FLT_MIN */
      {float_of(0x7FC00000), 0x7FC0}, {float_of(0x7F800001), 0x7FC0}, {float_of(0xFF812345), 0xFFC1},
      {float_of(0x7FFFFFFF), 0x7FFF},
  };
  check_edges(&fmts[F_BF16], e, KVP__ARRAY_LEN(e));
}
END_TEST

START_TEST(f16_edges) {
  const edge e[] = {
      {0.0f, 0x0000}, {-0.0f, 0x8000}, {1.0f, 0x3C00}, {1.0f + 0x1p-11f, 0x3C00}, {1.0f + 0x3p-11f, 0x3C02},
      {65504.0f, 0x7BFF}, {65519.0f, 0x7BFF}, {65520.0f, 0x7C00}, /* tie max | 2^16: inf */
      {-65520.0f, 0xFC00}, {65536.0f, 0x7C00}, {1e9f, 0x7C00}, {FLT_MAX, 0x7C00},
      {INFINITY, 0x7C00}, {-INFINITY, 0xFC00},
      {0x1p-14f, 0x0400}, {0x1.ffcp-15f, 0x0400}, /* tie 1023 2^-24 | 2^-14 */
      {0x1.ff8p-15f, 0x03FF}, {0x1.ff4p-15f, 0x03FE}, /* 1023, tie 1022 | 1023 */
      {0x1p-24f, 0x0001}, {0x1p-25f, 0x0000}, {-0x1p-25f, 0x8000}, /* half of 2^-24: tie to 0 */
      {nextafterf(0x1p-25f, 1), 0x0001}, {0x1.8p-24f, 0x0002}, {0x1.4p-23f, 0x0002},
      {FLT_TRUE_MIN, 0x0000}, {1e-30f, 0x0000},
      {float_of(0x7FC00000), 0x7E00}, {float_of(0x7F800001), 0x7E00}, {float_of(0xFFC02000), 0xFE01},
  };
  check_edges(&fmts[F_F16], e, KVP__ARRAY_LEN(e));
}
END_TEST

START_TEST(e2m1_edges) {
  const edge e[] = {
      {0.0f, 0x0}, {-0.0f, 0x8}, {0.5f, 0x1}, {6.0f, 0x7}, {-6.0f, 0xF},
      {0.25f, 0x0}, {-0.25f, 0x8}, {0.75f, 0x2}, {1.25f, 0x2}, {1.75f, 0x4}, /* ties: even */
      {2.5f, 0x4}, {3.5f, 0x6}, {5.0f, 0x6}, {-5.0f, 0xE},
      {nextafterf(0.25f, 1), 0x1}, {nextafterf(5.0f, 9), 0x7}, {nextafterf(5.0f, 0), 0x6},
      {0.2f, 0x0}, {-0.1f, 0x8}, {7.0f, 0x7}, {100.0f, 0x7}, {-100.0f, 0xF}, /* saturate */
      {INFINITY, 0x7}, {-INFINITY, 0xF}, {FLT_MAX, 0x7}, {NAN, 0x7}, {-NAN, 0x7},
  };
  check_edges(&fmts[F_E2M1], e, KVP__ARRAY_LEN(e));
  static const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (unsigned c = 0; c < 16; c++) {
    ck_assert(kvp__e2m1_to_f32((uint8_t)c) == want[c] && !signbit(kvp__e2m1_to_f32((uint8_t)c)) == (c < 8));
    ck_assert(kvp__e2m1_to_f32((uint8_t)(c | 0xF0)) == want[c]); /* only the low nibble counts */
  }
}
END_TEST

/* ---- against the reference --------------------------------------------------- */

/* A random f32: uniform bits (every exponent equally likely, NaN and inf
 * included), or for odd draws a value near the format's range. */
static float random_float(const fmt *f, uint64_t *rng) {
  uint64_t r = t_rand(rng);
  if (r & 1) return float_of((uint32_t)(r >> 32));
  int lo = 1 - f->bias - (int)f->mbits - 3, hi = (1 << f->ebits) - f->bias + 1;
  int e = lo + (int)((r >> 8) % (uint64_t)(hi - lo + 1));
  if (e < -126) e = -126;
  if (e > 127) e = 127;
  uint32_t mant = (uint32_t)(r >> 40) & 0x7FFFFF;
  if (r & 2) mant &= ~0u << (23 - f->mbits - 1); /* exact code or exact midpoint */
  return float_of((uint32_t)(r >> 2 & 1) << 31 | (uint32_t)(e + 127) << 23 | mant);
}

START_TEST(random_vs_reference) {
  const fmt *f = &fmts[_i];
  double *vals = ref_table(f);
  const char *ex = getenv("KVP_NUMERIC_EXHAUSTIVE");
  bool all = ex && *ex == '1';
  uint64_t n = all ? 1ull << 32 : 10000000, rng = 0x9E3779B97F4A7C15ull + (uint64_t)_i, nbad = 0;
  for (uint64_t i = 0; i < n; i++) {
    float x = all ? float_of((uint32_t)i) : random_float(f, &rng);
    uint32_t got = f->enc(x), want = ref_encode(f, vals, x);
    if (got != want && nbad++ < 8)
      fprintf(stderr, "%s(%a) = 0x%x, reference 0x%x\n", f->name, (double)x, got, want);
  }
  if (all) fprintf(stderr, "%s: all 2^32 f32 inputs checked, %llu mismatches\n", f->name, (unsigned long long)nbad);
  ck_assert_msg(nbad == 0, "%s: %llu of %llu inputs differ from the reference", f->name, (unsigned long long)nbad,
                (unsigned long long)n);
  free(vals);
}
END_TEST

/* The reference itself must be able to fail: it disagrees with truncation. */
START_TEST(reference_is_not_truncation) {
  const fmt *f = &fmts[F_FP8];
  double *vals = ref_table(f);
  ck_assert_uint_eq(ref_encode(f, vals, 1.1875f), 0x3A);
  ck_assert_uint_eq(ref_encode(f, vals, 1.0625f), 0x38);
  ck_assert_uint_eq(ref_encode(f, vals, 1.07f), 0x39);
  ck_assert_uint_eq(ref_encode(f, vals, 500.0f), 0x7E);
  ck_assert_uint_eq(ref_encode(f, vals, -0.0f), 0x80);
  ck_assert_uint_eq(ref_encode(f, vals, 0x1p-10f), 0x00);
  free(vals);
}
END_TEST

/* ---- rows -------------------------------------------------------------------- */

START_TEST(rows_match_scalars) {
  enum { N = 203 };
  uint64_t rng = 42 + (uint64_t)_i;
  float src[N] = {0}, back[N];
  uint16_t h[N];
  uint8_t q[N];
  for (size_t n = 0; n <= N; n += 29) {
    for (size_t i = 0; i < n; i++) src[i] = random_float(&fmts[_i % NFMT], &rng);
    kvp__bf16_from_f32_row(h, src, n);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(h[i], kvp__bf16_from_f32(src[i]));
    kvp__bf16_to_f32_row(back, h, n);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(bits_of(back[i]), bits_of(kvp__bf16_to_f32(h[i])));
    kvp__f16_from_f32_row(h, src, n);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(h[i], kvp__f16_from_f32(src[i]));
    kvp__f16_to_f32_row(back, h, n);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(bits_of(back[i]), bits_of(kvp__f16_to_f32(h[i])));
    kvp__fp8_e4m3_from_f32_row(q, src, n);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(q[i], kvp__fp8_e4m3_from_f32(src[i]));
    kvp__fp8_e4m3_to_f32_row(back, q, n);
    for (size_t i = 0; i < n; i++) ck_assert_uint_eq(bits_of(back[i]), bits_of(kvp__fp8_e4m3_to_f32(q[i])));
  }
}
END_TEST

START_TEST(rows_by_dtype) {
  const float src[5] = {1.0f, -2.5f, 0x1p-20f, 65519.0f, 1.0f + 0x1p-8f};
  float f32[5], back[5];
  uint16_t h[5];
  kvp__row_from_f32(f32, KVP_DTYPE_F32, src, 5);
  ck_assert_mem_eq(f32, src, sizeof src);
  kvp__row_from_f32(h, KVP_DTYPE_BF16, src, 5);
  ck_assert_uint_eq(h[0], 0x3F80);
  ck_assert_uint_eq(h[1], 0xC020);
  ck_assert_uint_eq(h[4], 0x3F80);
  kvp__row_to_f32(back, h, KVP_DTYPE_BF16, 5);
  ck_assert(back[1] == -2.5f && back[4] == 1.0f);
  kvp__row_from_f32(h, KVP_DTYPE_F16, src, 5);
  ck_assert_uint_eq(h[1], 0xC100);
  ck_assert_uint_eq(h[2], 0x0010); /* 2^-20 = 16 2^-24, subnormal */
  ck_assert_uint_eq(h[3], 0x7BFF);
  kvp__row_to_f32(back, h, KVP_DTYPE_F16, 5);
  ck_assert(back[2] == 0x1p-20f && back[3] == 65504.0f && back[4] == 1.0f + 0x1p-8f); /* exact in f16 */
  kvp__row_to_f32(back, src, KVP_DTYPE_F32, 5);
  ck_assert_mem_eq(back, src, sizeof src);
  ck_assert_uint_eq(kvp__dtype_bytes(KVP_DTYPE_F32), 4);
  ck_assert_uint_eq(kvp__dtype_bytes(KVP_DTYPE_BF16), 2);
  ck_assert_uint_eq(kvp__dtype_bytes(KVP_DTYPE_F16), 2);
}
END_TEST

START_TEST(find_nan_per_dtype) {
  float f[7] = {1, 2, INFINITY, -INFINITY, 0, 3, 4};
  uint16_t b[7] = {0x3F80, 0x7F80, 0xFF80, 0x7F7F, 0, 0, 0}, h[7] = {0x3C00, 0x7C00, 0xFC00, 0x7BFF, 0, 0, 0};
  ck_assert_uint_eq(kvp__row_find_nan(f, KVP_DTYPE_F32, 7), 7);
  ck_assert_uint_eq(kvp__row_find_nan(b, KVP_DTYPE_BF16, 7), 7);
  ck_assert_uint_eq(kvp__row_find_nan(h, KVP_DTYPE_F16, 7), 7);
  f[5] = -NAN;
  b[4] = 0xFF81; /* signalling, negative */
  h[6] = 0x7C01;
  ck_assert_uint_eq(kvp__row_find_nan(f, KVP_DTYPE_F32, 7), 5);
  ck_assert_uint_eq(kvp__row_find_nan(f, KVP_DTYPE_F32, 5), 5); /* not within the first 5 */
  ck_assert_uint_eq(kvp__row_find_nan(b, KVP_DTYPE_BF16, 7), 4);
  ck_assert_uint_eq(kvp__row_find_nan(h, KVP_DTYPE_F16, 7), 6);
  h[3] = 0x7E00; /* the f16 quiet NaN */
  ck_assert_uint_eq(kvp__row_find_nan(h, KVP_DTYPE_F16, 7), 3);
  ck_assert_uint_eq(kvp__row_find_nan(h, KVP_DTYPE_BF16, 7), 7); /* 0x7E00, 0x7C01 are finite in bf16 */
}
END_TEST

/* The append's screen, on every ISA: the first NaN or +-Inf of each dtype,
 * planted before, on and after the 256-element chunk boundaries and in the
 * tail, against a scalar scan; finite extremes (max, -max, -0) pass. */
START_TEST(find_nonfinite_every_isa) {
  enum { N = 256 * 5 + 37 };
  static uint32_t f[N];
  static uint16_t b[N], h[N];
  const size_t at[] = {0, 1, 255, 256, 257, 511, 700, 1023, 1024, 1279, 1280, 1290, N - 1};
  int was = kvp__codec_isa();
  for (int isa = KVP__ISA_BASE; isa <= KVP__ISA_AVX2; isa++) {
    if (kvp__codec_isa_set(isa) != isa) continue; /* no AVX2 on this CPU */
    for (size_t i = 0; i < N; i++) { /* finite, the largest magnitudes included */
      f[i] = i % 3 ? 0x7F7FFFFFu : 0x80000000u | (uint32_t)i;
      b[i] = i % 3 ? 0xFF7F : (uint16_t)i;
      h[i] = i % 3 ? 0x7BFF : (uint16_t)(0x8000 | i);
    }
    ck_assert_uint_eq(kvp__row_find_nonfinite(f, KVP_DTYPE_F32, N), N);
    ck_assert_uint_eq(kvp__row_find_nonfinite(b, KVP_DTYPE_BF16, N), N);
    ck_assert_uint_eq(kvp__row_find_nonfinite(h, KVP_DTYPE_F16, N), N);
    for (size_t k = sizeof at / sizeof *at; k-- > 0;) { /* latest first: each plant is then the first */
      size_t i = at[k];
      f[i] = k % 2 ? 0xFF800000u : 0x7FC00001u;
      b[i] = k % 2 ? 0x7F80 : 0xFFC1;
      h[i] = k % 2 ? 0xFC00 : 0x7E00;
      ck_assert_uint_eq(kvp__row_find_nonfinite(f, KVP_DTYPE_F32, N), i);
      ck_assert_uint_eq(kvp__row_find_nonfinite(b, KVP_DTYPE_BF16, N), i);
      ck_assert_uint_eq(kvp__row_find_nonfinite(h, KVP_DTYPE_F16, N), i);
      ck_assert_uint_eq(kvp__row_find_nonfinite(b, KVP_DTYPE_BF16, i), i); /* not within the first i */
    }
  }
  kvp__codec_isa_set(was);
}
END_TEST

/* The decode append's copy with its screen, on every ISA and dtype: rows of
 * e elements (whole 32-byte vector pairs, an odd vector, a scalar tail, a
 * row shorter than a vector), n tokens of nh heads scattered to their
 * destinations, every row copied bit for bit whatever the verdict, and the
 * verdict false exactly when a NaN or +-Inf was in the rows: one planted in
 * turn at the first and the last element of every row (the last row of the
 * last head included) and inside each of its whole 32-byte vectors, with
 * the largest finite values around it. Bytes
 * past each destination row stay as they were. The same for the variant
 * with non-temporal stores (kvp__rows_scatter_finite_nt: rows of whole
 * 32-byte vectors into aligned destinations, plain stores otherwise). */
START_TEST(scatter_finite_every_isa) {
  enum { MAXE = 128, MAXN = 3, MAXH = 5, PAD = 32 }; /* PAD: every dst[h] 32-byte aligned (the _nt variant's stores) */
  static const size_t es[] = {128, 80, 48, 24, 13, 7, 1};
  static const kvp_dtype dts[] = {KVP_DTYPE_F32, KVP_DTYPE_BF16, KVP_DTYPE_F16};
  static unsigned char src[MAXN * (MAXH + 1) * MAXE * 4];
  static _Alignas(64) unsigned char dst[MAXH][MAXN * MAXE * 4 + PAD];
  int was = kvp__codec_isa();
  for (int nt = 0; nt < 2; nt++)
  for (int isa = KVP__ISA_BASE; isa <= KVP__ISA_AVX2; isa++) {
    if (kvp__codec_isa_set(isa) != isa) continue; /* no AVX2 on this CPU */
    for (size_t di = 0; di < 3; di++)
      for (size_t ei = 0; ei < sizeof es / sizeof *es; ei++)
        for (size_t n = 1; n <= MAXN; n++)
          for (size_t nh = 1; nh <= MAXH; nh += 2) {
            kvp_dtype dt = dts[di];
            size_t e = es[ei], w = kvp__dtype_bytes(dt), row = e * w, hs = nh + 1;
            size_t stride = hs * row; /* a token's rows: nh copied, one more head not (the batch's neighbour) */
            uint32_t big = dt == KVP_DTYPE_F32 ? 0x7F7FFFFFu : dt == KVP_DTYPE_BF16 ? 0x7F7Fu : 0x7BFFu;
            uint32_t bad[3] = {dt == KVP_DTYPE_F32 ? 0x7FC00001u : dt == KVP_DTYPE_BF16 ? 0x7FC1u : 0x7E01u,
                               dt == KVP_DTYPE_F32 ? 0x7F800000u : dt == KVP_DTYPE_BF16 ? 0x7F80u : 0x7C00u,
                               dt == KVP_DTYPE_F32 ? 0xFF800000u : dt == KVP_DTYPE_BF16 ? 0xFF80u : 0xFC00u};
            uint32_t sign = w == 4 ? 0x80000000u : 0x8000u, low = w == 4 ? 0x3FFFFFFFu : 0x3FFFu;
            for (size_t i = 0; i < n * hs * e; i++) { /* finite: the largest magnitudes, -0, small values */
              uint32_t u = i % 5 == 0 ? big : i % 5 == 1 ? big | sign : i % 5 == 2 ? sign : (uint32_t)(i * 7919u) & low;
              memcpy(src + i * w, &u, w);
            }
            void *d[MAXH];
            for (size_t h = 0; h < nh; h++) d[h] = dst[h];
            /* plant: -1 none, else (row, spot) of the nh x n rows; spots: the first element, the last, and one
             * inside each whole 32-byte vector (the kernel ORs several vectors' tests a turn: each must count) */
            size_t spots = 2 + row / 32;
            for (long plant = -1; plant < (long)(n * nh * spots); plant++) {
              size_t t = 0, h = 0, at = 0;
              uint32_t keep = 0;
              if (plant >= 0) {
                size_t r = (size_t)plant / spots, spot = (size_t)plant % spots;
                t = r / nh, h = r % nh;
                at = t * stride + h * row + (spot == 0 ? 0 : spot == 1 ? row - w : (spot - 2) * 32 + 16);
                memcpy(&keep, src + at, w);
                memcpy(src + at, &bad[(size_t)plant % 3], w);
              }
              memset(dst, 0xA5, sizeof dst);
              bool fin = nt ? kvp__rows_scatter_finite_nt(d, src, stride, dt, n, nh, e)
                            : kvp__rows_scatter_finite(d, src, stride, dt, n, nh, e);
              ck_assert_msg(fin == (plant < 0), "isa %d dtype %d e %zu n %zu nh %zu plant %ld: finite %d", isa,
                            (int)dt, e, n, nh, plant, (int)fin);
              for (size_t tt = 0; tt < n; tt++)
                for (size_t hh = 0; hh < nh; hh++)
                  ck_assert_msg(memcmp(dst[hh] + tt * row, src + tt * stride + hh * row, row) == 0,
                                "isa %d dtype %d e %zu: row (%zu, %zu) not copied", isa, (int)dt, e, tt, hh);
              for (size_t hh = 0; hh < nh; hh++)
                for (size_t b = n * row; b < n * row + PAD; b++) ck_assert_uint_eq(dst[hh][b], 0xA5);
              if (plant >= 0) memcpy(src + at, &keep, w);
            }
          }
  }
  kvp__codec_isa_set(was);
}
END_TEST

/* ---- packed codes ------------------------------------------------------------ */

enum { L_LSB32, L_MSB8, L_NIB };
typedef struct layout {
  int kind;      /* L_* */
  unsigned bits; /* bits per code */
} layout;
static const layout layouts[] = {{L_LSB32, 2}, {L_LSB32, 3}, {L_LSB32, 4}, {L_MSB8, 2},
                                 {L_MSB8, 3},  {L_MSB8, 4},  {L_NIB, 4}};

static size_t packed_bytes(layout l, size_t n) {
  return l.kind == L_LSB32 ? kvp__lsb32_bytes(n, l.bits) : l.kind == L_MSB8 ? kvp__msb8_bytes(n, l.bits)
                                                                            : kvp__nib_bytes(n);
}

static void pack(layout l, uint8_t *dst, const uint8_t *codes, size_t n) {
  if (l.kind == L_LSB32) kvp__lsb32_pack(dst, codes, n, l.bits);
  else if (l.kind == L_MSB8) kvp__msb8_pack(dst, codes, n, l.bits);
  else kvp__nib_pack(dst, codes, n);
}

static void unpack(layout l, uint8_t *codes, const uint8_t *src, size_t n) {
  if (l.kind == L_LSB32) kvp__lsb32_unpack(codes, src, n, l.bits);
  else if (l.kind == L_MSB8) kvp__msb8_unpack(codes, src, n, l.bits);
  else kvp__nib_unpack(codes, src, n);
}

/* Lengths 1..200: round trip, exact size, padding zero, nothing written past
 * the packed size, nothing read past it (the source is malloc'd to size for
 * ASan), high bits of codes ignored. */
START_TEST(pack_round_trip) {
  layout l = layouts[_i];
  uint64_t rng = 7 + (uint64_t)_i;
  uint8_t codes[200], raw[200], out[200], buf[128];
  for (size_t n = 1; n <= 200; n++) {
    size_t nb = packed_bytes(l, n);
    ck_assert_uint_eq(nb, l.kind == L_LSB32 ? (n * l.bits + 31) / 32 * 4 : (n * l.bits + 7) / 8);
    for (size_t i = 0; i < n; i++) {
      raw[i] = (uint8_t)t_rand(&rng);
      codes[i] = raw[i] & ((1u << l.bits) - 1);
    }
    memset(buf, 0xA5, sizeof buf);
    pack(l, buf, raw, n);
    for (size_t j = nb; j < sizeof buf; j++) ck_assert_msg(buf[j] == 0xA5, "n %zu: byte %zu written", n, j);
    size_t used = n * l.bits; /* stream bits holding codes */
    for (size_t k = used; k < nb * 8; k++) {
      unsigned bit = l.kind == L_MSB8 ? buf[k / 8] >> (7 - k % 8) & 1 : buf[k / 8] >> (k % 8) & 1;
      ck_assert_msg(bit == 0, "n %zu: padding bit %zu set", n, k);
    }
    uint8_t *exact = malloc(nb);
    ck_assert_ptr_nonnull(exact);
    memcpy(exact, buf, nb);
    memset(out, 0xEE, sizeof out);
    unpack(l, out, exact, n);
    free(exact);
    ck_assert_mem_eq(out, codes, n);
    ck_assert_uint_eq(out[n < 200 ? n : 199], n < 200 ? 0xEE : codes[199]);
  }
}
END_TEST

static void check_packed(layout l, const uint8_t *codes, size_t n, const uint8_t *want, size_t nwant) {
  uint8_t buf[64], back[64];
  ck_assert_uint_eq(packed_bytes(l, n), nwant);
  pack(l, buf, codes, n);
  for (size_t j = 0; j < nwant; j++)
    ck_assert_msg(buf[j] == want[j], "layout %d b%u: byte %zu = 0x%02x, want 0x%02x", l.kind, l.bits, j, buf[j],
                  want[j]);
  unpack(l, back, want, n);
  ck_assert_mem_eq(back, codes, n);
}

START_TEST(pack_bit_order_pinned) {
  /* LSB32 b2: c0 = 3 in bits 0-1, c15 = 2 in bits 30-31, c16 = 1 opens word 1 */
  const uint8_t l2[17] = {3, [15] = 2, [16] = 1};
  check_packed((layout){L_LSB32, 2}, l2, 17, (const uint8_t[]){0x03, 0, 0, 0x80, 0x01, 0, 0, 0}, 8);
  /* LSB32 b3: 5 3 6 -> bits 101 | 011 | 110 from bit 0 up: byte0 = 10.011.101,
   * byte1 bit 0 = c2's top bit; c10 = 7 straddles: bits 30-31 of word 0, bit 0 of word 1 */
  const uint8_t l3[11] = {5, 3, 6, [10] = 7};
  const uint8_t w3[8] = {0x9D, 0x01, 0x00, 0xC0, 0x01, 0, 0, 0};
  check_packed((layout){L_LSB32, 3}, l3, 11, w3, 8);
  uint32_t w0 = (uint32_t)w3[0] | (uint32_t)w3[1] << 8 | (uint32_t)w3[2] << 16 | (uint32_t)w3[3] << 24;
  ck_assert_uint_eq(w0, 0xC000019Du); /* as a little-endian word: c10's low bits at 30-31 */
  ck_assert_uint_eq(w0 >> 30 | (w3[4] & 1u) << 2, 7);
  const uint8_t l4[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  check_packed((layout){L_LSB32, 4}, l4, 9, (const uint8_t[]){0x21, 0x43, 0x65, 0x87, 0x09, 0, 0, 0}, 8);
  /* MSB8: first element in the top bits */
  check_packed((layout){L_MSB8, 2}, (const uint8_t[]){1, 2, 3, 0, 3}, 5, (const uint8_t[]){0x6C, 0xC0}, 2);
  check_packed((layout){L_MSB8, 3}, (const uint8_t[]){5, 3, 6, 1}, 4, (const uint8_t[]){0xAF, 0x10}, 2);
  check_packed((layout){L_MSB8, 4}, (const uint8_t[]){1, 2, 3}, 3, (const uint8_t[]){0x12, 0x30}, 2);
  /* NIB: first element in the low nibble */
  check_packed((layout){L_NIB, 4}, (const uint8_t[]){1, 2, 3, 4, 5}, 5, (const uint8_t[]){0x21, 0x43, 0x05}, 3);
  /* NVFP4 pairs: E2M1 codes of (1.0, -6.0) -> 0xF2 */
  const uint8_t e[2] = {kvp__e2m1_from_f32(1.0f), kvp__e2m1_from_f32(-6.0f)};
  check_packed((layout){L_NIB, 4}, e, 2, (const uint8_t[]){0xF2}, 1);
}
END_TEST

/* ---- branch-free forms --------------------------------------------------------- */

/* The branch-free form of format fi (numeric.h) and, where there is one,
 * its row function over n values. */
static uint32_t bf_enc(int fi, float x) {
  switch (fi) {
  case F_FP8: return kvp__fp8_e4m3_from_f32_bf(x);
  case F_BF16: return kvp__bf16_from_f32_bf(x);
  case F_F16: return kvp__f16_from_f32_bf(x);
  default: return kvp__e2m1_from_f32_bf(x);
  }
}

static float bf_dec(int fi, uint32_t c) {
  switch (fi) {
  case F_FP8: return kvp__fp8_e4m3_to_f32_bf((uint8_t)c);
  case F_BF16: return kvp__bf16_to_f32_bf((uint16_t)c);
  case F_F16: return kvp__f16_to_f32_bf((uint16_t)c);
  default: return kvp__e2m1_to_f32_bf((uint8_t)c);
  }
}

/* Row encode of n values into codes (as u32); 0 when fi has no row form. */
static int row_enc(int fi, uint32_t *codes, const float *x, size_t n) {
  static uint16_t h[4096];
  static uint8_t q[4096];
  switch (fi) {
  case F_FP8: kvp__fp8_e4m3_from_f32_row(q, x, n); break;
  case F_BF16: kvp__bf16_from_f32_row(h, x, n); break;
  case F_F16: kvp__f16_from_f32_row(h, x, n); break;
  default: return 0;
  }
  for (size_t i = 0; i < n; i++) codes[i] = fi == F_FP8 ? q[i] : h[i];
  return 1;
}

/* Every code decodes alike; encoders agree on every f32 whose top 16 bits
 * are anything and whose low 16 are one of the patterns below (zero, ones,
 * each tie position of every format's normal and subnormal codes, random),
 * or with KVP_NUMERIC_EXHAUSTIVE=1 on all 2^32 patterns. The row functions
 * run the same forms vectorized and are held to the same. */
START_TEST(branch_free_forms_match) {
  const fmt *f = &fmts[_i];
  uint32_t ncodes = 1u << (1 + f->ebits + f->mbits);
  static float vals[65536], back[65536];
  static uint16_t h[65536];
  static uint8_t q[65536];
  for (uint32_t c = 0; c < ncodes; c++) {
    vals[c] = f->dec(c);
    ck_assert_msg(bits_of(bf_dec(_i, c)) == bits_of(vals[c]), "%s: code 0x%x decodes to %a, scalar %a", f->name, c,
                  (double)bf_dec(_i, c), (double)vals[c]);
  }
  if (_i == F_FP8) {
    for (uint32_t c = 0; c < ncodes; c++) q[c] = (uint8_t)c;
    kvp__fp8_e4m3_to_f32_row(back, q, ncodes);
  } else if (_i != F_E2M1) {
    for (uint32_t c = 0; c < ncodes; c++) h[c] = (uint16_t)c;
    (_i == F_BF16 ? kvp__bf16_to_f32_row : kvp__f16_to_f32_row)(back, h, ncodes);
  }
  if (_i != F_E2M1)
    for (uint32_t c = 0; c < ncodes; c++)
      if (bits_of(back[c]) != bits_of(vals[c])) ck_assert_msg(0, "%s: row decode of 0x%x", f->name, c);
  static const uint16_t lows[] = {0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x0FFF, 0x1000, 0x1001,
                                  0x2000, 0x3000, 0x4000, 0xC000, 0x7FFE, 0x0800, 0x0400, 0x0200, 0x0100,
                                  0x0080, 0x0040, 0x0020, 0x0010, 0x1234, 0xEDCB};
  const char *ex = getenv("KVP_NUMERIC_EXHAUSTIVE");
  bool all = ex && *ex == '1';
  uint64_t total = all ? 1ull << 32 : 65536ull * KVP__ARRAY_LEN(lows), nbad = 0;
  static float x[4096];
  static uint32_t rc[4096];
  for (uint64_t i0 = 0; i0 < total; i0 += 4096) {
    for (size_t j = 0; j < 4096; j++) {
      uint64_t i = i0 + j;
      x[j] = float_of(all ? (uint32_t)i : (uint32_t)(i % 65536) << 16 | lows[i / 65536]);
    }
    int rows = row_enc(_i, rc, x, 4096);
    for (size_t j = 0; j < 4096; j++) {
      uint32_t want = f->enc(x[j]), got = bf_enc(_i, x[j]);
      if ((got != want || (rows && rc[j] != want)) && nbad++ < 8)
        fprintf(stderr, "%s(%a): scalar 0x%x, branch-free 0x%x, row 0x%x\n", f->name, (double)x[j], want, got,
                rows ? rc[j] : want);
    }
  }
  ck_assert_msg(nbad == 0, "%s: %llu of %llu inputs differ", f->name, (unsigned long long)nbad,
                (unsigned long long)total);
}
END_TEST

/* Rounding without the rounding mode: ties go to even, either side of 1/2. */
START_TEST(rne_u32_ties) {
  ck_assert_uint_eq(kvp__rne_u32(0.5f), 0);
  ck_assert_uint_eq(kvp__rne_u32(1.5f), 2);
  ck_assert_uint_eq(kvp__rne_u32(2.5f), 2);
  ck_assert_uint_eq(kvp__rne_u32(0x1.000002p-1f), 1);
  ck_assert_uint_eq(kvp__rne_u32(0x1.fffffep-2f), 0);
  ck_assert_uint_eq(kvp__rne_u32(1023.5f), 1024);
  ck_assert_uint_eq(kvp__rne_u32(1022.5f), 1022);
  ck_assert_uint_eq(kvp__rne_u32(0x1p-149f), 0);
  ck_assert_uint_eq(kvp__rne_u32(8388607.5f), 8388608);
}
END_TEST

/* kvp__sincos against libm: within 2 ulp of sin and cos (and so within
 * 3e-16 absolute), over small angles, every quadrant, RoPE angles p theta^-f
 * for positions up to 2^32 - 1, and exact at the fixed points. */
static double ulp_of(double x) { return nextafter(fabs(x), INFINITY) - fabs(x); }

START_TEST(sincos_vs_libm) {
  uint64_t st = 0x243F6A8885A308D3ull;
  double worst = 0;
  for (int i = 0; i < 400000; i++) {
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    double u = (double)(st >> 11) / 9007199254740992.0, x;
    if (i % 4 == 0) x = u * 8.0;                                               /* the first quadrants */
    else if (i % 4 == 1) x = ldexp(u, -30 + (int)(st % 30));                    /* tiny */
    else if (i % 4 == 2) x = floor(u * 4294967295.0) * pow(500000.0, -u);      /* RoPE angles */
    else x = floor(u * 4294967295.0);                                          /* whole positions, frequency 1 */
    double s, c;
    kvp__sincos(x, &s, &c);
    double es = fabs(s - sin(x)), ec = fabs(c - cos(x));
    /* the reduction keeps the absolute error at the ulp of pi/2's tail: use the larger of 2 ulp and 3e-16 */
    double bs = fmax(2 * ulp_of(sin(x)), 3e-16), bc = fmax(2 * ulp_of(cos(x)), 3e-16);
    ck_assert_msg(es <= bs && ec <= bc, "x = %a: sin %a vs %a, cos %a vs %a", x, s, sin(x), c, cos(x));
    worst = fmax(worst, fmax(es, ec));
  }
  double s, c;
  kvp__sincos(0.0, &s, &c);
  ck_assert(s == 0.0 && c == 1.0);
  printf("kvp__sincos: worst absolute error against libm %.3g over 400000 angles\n", worst);
}
END_TEST

/* XXH64 against the reference implementation's values ("", "a", "abc",
 * seed 0), and the paired form equal to two calls at every length through
 * the stripes and the 8-, 4- and 1-byte tails. */
START_TEST(xxh64_known_and_paired) {
  ck_assert_uint_eq(kvp__xxh64("", 0, 0), 0xEF46DB3751D8E999ull);
  ck_assert_uint_eq(kvp__xxh64("a", 1, 0), 0xD24EC4F1A98C6E5Bull);
  ck_assert_uint_eq(kvp__xxh64("abc", 3, 0), 0x44BC2CF5AD770999ull);
  unsigned char buf[300];
  for (int i = 0; i < 300; i++) buf[i] = (unsigned char)(i * 131 + 7);
  for (size_t n = 0; n <= 300; n++) {
    uint64_t seeds[3][2] = {{0, 1}, {0x6b76706f6f6c2d61ull, 0x6b76706f6f6c2d62ull}, {~0ull, 12345}};
    for (int k = 0; k < 3; k++) {
      uint64_t two[2];
      kvp__xxh64_2(buf, n, seeds[k][0], seeds[k][1], two);
      ck_assert_uint_eq(two[0], kvp__xxh64(buf, n, seeds[k][0]));
      ck_assert_uint_eq(two[1], kvp__xxh64(buf, n, seeds[k][1]));
    }
  }
}
END_TEST

/* kvp__hash128 (the content keys): every bit of a 128-byte chunk (32
 * tokens) and of the seeds flips about half of the 128 output bits, and
 * never fewer than a quarter; swapped blocks, a zero-padded tail, a zero
 * more token and another seed each give another key; at every length the
 * paths through full blocks and the tail agree with themselves (two calls). */
static int popc128(const uint64_t a[2], const uint64_t b[2]) {
  return __builtin_popcountll(a[0] ^ b[0]) + __builtin_popcountll(a[1] ^ b[1]);
}

START_TEST(hash128_mixes) {
  unsigned char buf[200];
  for (int i = 0; i < 200; i++) buf[i] = (unsigned char)(i * 37 + 11);
  uint64_t base[2], h[2];
  kvp__hash128(buf, 128, 1, 2, base);
  double sum = 0;
  int worst = 128, n = 0;
  for (int bit = 0; bit < 128 * 8; bit++, n++) {
    buf[bit / 8] ^= (unsigned char)(1u << (bit % 8));
    kvp__hash128(buf, 128, 1, 2, h);
    buf[bit / 8] ^= (unsigned char)(1u << (bit % 8));
    int d = popc128(base, h);
    sum += d;
    worst = d < worst ? d : worst;
  }
  for (int bit = 0; bit < 128; bit++, n++) {
    uint64_t sa = 1 ^ (bit < 64 ? 1ull << bit : 0), sb = 2 ^ (bit >= 64 ? 1ull << (bit - 64) : 0);
    kvp__hash128(buf, 128, sa, sb, h);
    int d = popc128(base, h);
    sum += d;
    worst = d < worst ? d : worst;
  }
  ck_assert_msg(sum / n > 60 && sum / n < 68, "mean flipped bits %.2f of 128", sum / n);
  ck_assert_msg(worst >= 32, "a one-bit change flipped only %d output bits", worst);
  unsigned char sw[128];
  memcpy(sw, buf + 32, 32);
  memcpy(sw + 32, buf, 32);
  memcpy(sw + 64, buf + 64, 64);
  kvp__hash128(sw, 128, 1, 2, h);
  ck_assert(popc128(base, h) > 32); /* blocks are keyed by position */
  unsigned char z[40] = {0};
  uint64_t a[2], b[2];
  kvp__hash128(z, 36, 1, 2, a);
  kvp__hash128(z, 40, 1, 2, b);
  ck_assert(popc128(a, b) > 32); /* a zero token more is another chunk */
  kvp__hash128(z, 0, 1, 2, a);
  kvp__hash128(z, 4, 1, 2, b);
  ck_assert(popc128(a, b) > 32);
  for (size_t len = 0; len <= 200; len++) {
    kvp__hash128(buf, len, 7, 9, a);
    kvp__hash128(buf, len, 7, 9, b);
    ck_assert(a[0] == b[0] && a[1] == b[1]);
  }
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("numeric");
  TCase *th = tcase_create("hash");
  tcase_add_test(th, xxh64_known_and_paired);
  tcase_add_test(th, hash128_mixes);
  suite_add_tcase(s, th);
  TCase *tc = tcase_create("codes");
  tcase_add_loop_test(tc, every_code_decodes, 0, NFMT);
  tcase_add_loop_test(tc, every_code_reencodes, 0, NFMT);
  tcase_add_loop_test(tc, every_midpoint_ties_to_even, 0, NFMT);
  suite_add_tcase(s, tc);
  tc = tcase_create("edges");
  tcase_add_test(tc, fp8_edges);
  tcase_add_test(tc, bf16_edges);
  tcase_add_test(tc, f16_edges);
  tcase_add_test(tc, e2m1_edges);
  suite_add_tcase(s, tc);
  tc = tcase_create("reference");
  tcase_set_timeout(tc, getenv("KVP_NUMERIC_EXHAUSTIVE") ? 7200 : 300);
  tcase_add_test(tc, reference_is_not_truncation);
  tcase_add_loop_test(tc, random_vs_reference, 0, NFMT);
  suite_add_tcase(s, tc);
  tc = tcase_create("rows");
  tcase_set_timeout(tc, 120); /* every ISA's scatter over a sweep of shapes: seconds, more on a loaded host */
  tcase_add_loop_test(tc, rows_match_scalars, 0, NFMT);
  tcase_add_test(tc, rows_by_dtype);
  tcase_add_test(tc, find_nan_per_dtype);
  tcase_add_test(tc, find_nonfinite_every_isa);
  tcase_add_test(tc, scatter_finite_every_isa);
  suite_add_tcase(s, tc);
  tc = tcase_create("branch-free");
  tcase_set_timeout(tc, getenv("KVP_NUMERIC_EXHAUSTIVE") ? 7200 : 300);
  tcase_add_loop_test(tc, branch_free_forms_match, 0, NFMT);
  tcase_add_test(tc, rne_u32_ties);
  suite_add_tcase(s, tc);
  tc = tcase_create("pack");
  tcase_add_loop_test(tc, pack_round_trip, 0, (int)KVP__ARRAY_LEN(layouts));
  tcase_add_test(tc, pack_bit_order_pinned);
  suite_add_tcase(s, tc);
  tc = tcase_create("sincos");
  tcase_add_test(tc, sincos_vs_libm);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return t_run(suite()); }
