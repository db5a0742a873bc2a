/*
 * codecs/numeric.h - the bit-exact numeric core of the codecs: small float
 * formats (FP8 E4M3, BF16, FP16, FP4 E2M1) to and from f32, row conversions,
 * and packing of 2/3/4-bit integer codes in the three bit orders the codecs
 * use. It knows nothing of the pool; codecs/ builds on it.
 *
 * Every encoder rounds to nearest, ties to even, computed with integer
 * operations on the f32 bits: results never depend on the FPU rounding mode.
 * Decoders are exact (every code is a float value).
 *
 * ---- formats (s = sign, e = exponent field, m = mantissa field) ---------
 *
 *   FP8 E4M3 "fn" (OCP; CUDA __nv_fp8_e4m3)      bit 7 6..3 2..0
 *                                                    s  eeee mmm
 *     bias 7. e > 0: (-1)^s 2^(e-7) (1 + m/8);  e = 0: (-1)^s 2^-6 m/8
 *     max finite 0x7E = 448, smallest subnormal 0x01 = 2^-9.
 *     No infinities: S.1111.111 (0x7F, 0xFF) are NaN.
 *     Encode saturates (CUDA __NV_SATFINITE): |x| > 448 and +-inf give
 *     +-448 (464, the tie between 448 and "480", rounds to even = 448).
 *     Every NaN encodes as 0x7F, sign dropped (as CUDA's float conversion).
 *
 *   BF16 (the top half of an f32)                bit 15 14..7    6..0
 *                                                    s  eeeeeeee mmmmmmm
 *     Overflow rounds to +-inf. NaN stays NaN with its sign and the top 7
 *     payload bits, quiet bit (0x0040) set (as x86 VCVTNEPS2BF16).
 *
 *   FP16 (IEEE binary16)                         bit 15 14..10 9..0
 *                                                    s  eeeee  mmmmmmmmmm
 *     bias 15, max finite 65504, smallest subnormal 2^-24. Overflow rounds
 *     to +-inf (65520 ties to inf). NaN stays NaN with its sign and the top
 *     9 payload bits, quiet bit (0x0200) set (as x86 F16C VCVTPS2PH).
 *
 *   FP4 E2M1 (OCP MX; NVFP4 elements)            bit 3 2..1 0
 *                                                    s ee   m
 *     bias 1. codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
 *     Encode saturates: |x| > 6 and +-inf give +-6 (7 rounds to "8", so 6;
 *     5 is a tie and goes to 4, the even code). NaN encodes as 0x7 (+6),
 *     as CUDA's __nv_cvt_float_to_fp4. The sign is kept on zero: -0 and
 *     negative values that round to zero give 0x8 (-0).
 *
 *   Decoders widen bits exactly: a signalling BF16/FP16 NaN stays
 *   signalling in f32 (its re-encoding is then quiet); FP8 NaN decodes to
 *   the quiet f32 NaN with the code's sign.
 *
 * ---- packed integer codes (b = bits per code, 2, 3 or 4) --------------
 *
 *   LSB32 (KIVI, KVQuant): little-endian 32-bit words, element i at bits
 *   [b*i, b*i + b) of the little-endian bit stream (stream bit k is bit k%8
 *   of byte k/8, equally bit k%32 of LE word k/32), code LSB first. 3-bit
 *   codes straddle words: element 10 is bits 30-31 of word 0 (its two low
 *   bits) and bit 0 of word 1 (its high bit). The packed size is whole
 *   words; padding bits are zero.
 *     b=2, word 0:  bit 31 ...                              ... 1 0
 *                   [ c15 | c14 | ...                 | c1 | c0 ]
 *     b=3, bytes:   byte0 = c2[1:0] c1 c0   byte1 = c5[0] c4 c3 c2[2]
 *
 *   MSB8 (QVG): bytes, first element in the top bits (big-endian bit stream:
 *   stream bit k is bit 7 - k%8 of byte k/8, code MSB first). Packed size
 *   ceil(n b / 8) bytes, padding bits (the low bits of the last byte) zero.
 *     b=2: byte = c0<<6 | c1<<4 | c2<<2 | c3      b=4: byte = c0<<4 | c1
 *
 *   NIB (NVFP4): 4-bit codes, first element in the LOW nibble:
 *     byte j = c[2j] | c[2j+1] << 4;  ceil(n/2) bytes, odd tail's high
 *     nibble zero. (Same bits as LSB32 b=4, without the word padding.)
 *
 *   Pack reads codes as one byte each and keeps their low b bits; unpack
 *   writes one byte per code, each < 2^b. Pack writes every byte of the
 *   packed size; unpack reads no byte beyond it.
 */
#ifndef KVP_CODECS_NUMERIC_H
#define KVP_CODECS_NUMERIC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kvpool.h"

#ifdef __cplusplus
extern "C" {
#define KVP__RESTRICT __restrict
#else
#define KVP__RESTRICT restrict
#endif

/* ---- scalars ------------------------------------------------------------ */

#define KVP__FP8_E4M3_MAX 448.0f /* largest finite E4M3 */
#define KVP__FP8_E4M3_NAN 0x7Fu  /* the NaN code our encoder writes */
#define KVP__E2M1_MAX 6.0f       /* largest E2M1 magnitude */

uint8_t kvp__fp8_e4m3_from_f32(float x);
float kvp__fp8_e4m3_to_f32(uint8_t code);
uint16_t kvp__bf16_from_f32(float x);
float kvp__bf16_to_f32(uint16_t code);
uint16_t kvp__f16_from_f32(float x);
float kvp__f16_to_f32(uint16_t code);
uint8_t kvp__e2m1_from_f32(float x);    /* a code 0..15 */
float kvp__e2m1_to_f32(uint8_t code);   /* uses the low 4 bits of code */

/* sin and cos of x, 0 <= x < 2^32 pi/2 (KVQuant's RoPE angles), from
 * correctly rounded double operations only, in a fixed order, so the device
 * twin (kernels/numeric.cuh) gives the same bits: k = floor(x 2/pi + 1/2),
 * r = x - k pi/2 by Cody-Waite in four parts (the first three of 21 bits:
 * k times each is exact for k < 2^32), then fdlibm's kernel polynomials on
 * |r| <= pi/4 and the quadrant k mod 4. Within 2 ulp of libm (check_numeric). */
void kvp__sincos(double x, double *s, double *c);

/* ---- branch-free forms ----------------------------------------------------
 * The conversions above again, written without branches or tables so that
 * a loop over them vectorizes: every choice is a mask select, and no float
 * operation sits on a path the compiler could turn into a branch (under
 * -ftrapping-math it will not speculate one back). Each returns what its
 * scalar form returns, for every input (check_numeric sweeps them against
 * the scalars; KVP_NUMERIC_EXHAUSTIVE=1 runs all 2^32 f32 patterns).
 *
 * Rounding without the rounding mode, for a w in [0, 2^31): t = trunc(w)
 * (CVTTPS2DQ truncates whatever MXCSR says), w - t is exact, and it
 * decides ties to even. The subnormal codes of a format are RNE(|x| 2^k)
 * for the k that makes its least subnormal 1; the product is exact. The
 * normal codes come from the f32 bits, as numeric.c's banner derives:
 * (bits + half - 1 + lsb) >> drop, less the exponent rebias, a carry out of
 * the mantissa walking into the exponent.
 *
 * Loops: gcc -O2 vectorizes only loops it needs no scalar epilogue for, so
 * row kernels run KVP__CHUNK elements at a time through a helper inlined
 * with a constant count (KVP__FOR_CHUNKS), then the tail through the same
 * helper. 32 lets a byte loop fill a 256-bit vector under AVX2
 * (codecs/kernels.h); a half chunk (16, an NVFP4 block) runs vectorized too. */

#define KVP__CHUNK 32 /* elements per fixed-count inner loop */

/* Inlined even into a kernel compiled for another ISA (codecs/kernels.h). */
#define KVP__INLINE static inline __attribute__((always_inline))

/* Run F(i, c) over [0, n) as: c = KVP__CHUNK while a chunk fits, one half
 * chunk if it fits, then c = the rest (< 16). F is a function-like macro
 * calling a KVP__INLINE helper with c as its trip count. */
#define KVP__FOR_CHUNKS(n, F)                                                                                        \
  do {                                                                                                               \
    size_t i_ = 0, n_ = (n);                                                                                         \
    for (; i_ + KVP__CHUNK <= n_; i_ += KVP__CHUNK) F(i_, KVP__CHUNK);                                               \
    if (i_ + KVP__CHUNK / 2 <= n_) F(i_, KVP__CHUNK / 2), i_ += KVP__CHUNK / 2;                                      \
    if (i_ < n_) F(i_, n_ - i_);                                                                                     \
  } while (0)

static inline uint32_t kvp__f32_bits(float x) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return u;
}

static inline float kvp__f32_of(uint32_t u) {
  float x;
  __builtin_memcpy(&x, &u, sizeof x);
  return x;
}

/* All ones where cond, else 0; and a select by such a mask. */
static inline uint32_t kvp__mask(int cond) { return (uint32_t)0 - (uint32_t)(cond != 0); }
/* a < b for a, b < 2^31 (magnitude bits, small codes): a signed compare,
 * one instruction even in SSE2, which has no unsigned one. */
static inline int kvp__lt(uint32_t a, uint32_t b) { return (int32_t)a < (int32_t)b; }
static inline uint32_t kvp__sel(uint32_t mask, uint32_t a, uint32_t b) { return (a & mask) | (b & ~mask); }

/* w rounded to the nearest integer, ties to even; 0 <= w < 2^31. The
 * fraction f = w - t is exact (t <= w < t + 1); up when f > 1/2, or f = 1/2
 * and t odd: on the bits of f >= 0, bits(f) + (t & 1) > bits(1/2). */
static inline uint32_t kvp__rne_u32(float w) {
  uint32_t t = (uint32_t)(int32_t)w;
  uint32_t f = kvp__f32_bits(w - (float)(int32_t)t);
  return t + (uint32_t)kvp__lt(0x3F000000u, f + (t & 1u)); /* f < bits(1) */
}

/* Smallest normal magnitudes of the formats, as f32 bits. */
#define KVP__FP8_MIN_NORMAL_BITS 0x3C800000u /* 2^-6 */
#define KVP__F16_MIN_NORMAL_BITS 0x38800000u /* 2^-14 */
#define KVP__E2M1_MIN_NORMAL_BITS 0x3F800000u /* 1 */

static inline uint8_t kvp__fp8_e4m3_from_f32_bf(float x) {
  uint32_t u = kvp__f32_bits(x), a = u & 0x7FFFFFFFu;
  uint32_t nrm = ((a + 0x7FFFFu + (a >> 20 & 1u)) >> 20) - (120u << 3); /* valid from 2^-6 up */
  nrm = nrm < 0x7Eu ? nrm : 0x7Eu;                                      /* saturate; inf too */
  uint32_t as = a < KVP__FP8_MIN_NORMAL_BITS ? a : KVP__FP8_MIN_NORMAL_BITS;
  uint32_t sub = kvp__rne_u32(kvp__f32_of(as) * 0x1p9f); /* |x| 2^9 < 8: codes 0..8 */
  uint32_t code = kvp__sel(kvp__mask(kvp__lt(a, KVP__FP8_MIN_NORMAL_BITS)), sub, nrm) | (u >> 24 & 0x80u);
  return (uint8_t)kvp__sel(kvp__mask(kvp__lt(0x7F800000u, a)), KVP__FP8_E4M3_NAN, code);
}

static inline float kvp__fp8_e4m3_to_f32_bf(uint8_t c) {
  uint32_t s = (uint32_t)(c & 0x80u) << 24, em = c & 0x7Fu;
  uint32_t nrm = (em << 20) + (120u << 23);
  uint32_t sub = kvp__f32_bits(kvp__f32_of(em << 20 | 121u << 23) - 0x1p-6f); /* 2^-6 (1 + m/8) - 2^-6 */
  uint32_t r = kvp__sel(kvp__mask(em < 8u), sub, nrm);
  return kvp__f32_of(kvp__sel(kvp__mask(em == 0x7Fu), 0x7FC00000u, r) | s);
}

static inline uint16_t kvp__bf16_from_f32_bf(float x) {
  uint32_t u = kvp__f32_bits(x);
  uint32_t rne = (u + 0x7FFFu + (u >> 16 & 1u)) >> 16, qnan = u >> 16 | 0x0040u;
  return (uint16_t)kvp__sel(kvp__mask(kvp__lt(0x7F800000u, u & 0x7FFFFFFFu)), qnan, rne);
}

static inline float kvp__bf16_to_f32_bf(uint16_t c) { return kvp__f32_of((uint32_t)c << 16); }

/* kvp__bf16_from_f32 for an x that is not NaN (infinities included): the
 * rounding add alone, for rows whose values cannot be NaN. */
static inline uint16_t kvp__bf16_from_f32_num(float x) {
  uint32_t u = kvp__f32_bits(x);
  return (uint16_t)((u + 0x7FFFu + (u >> 16 & 1u)) >> 16);
}

/* x is finite (not inf, not NaN). */
static inline int kvp__finite(float x) { return kvp__lt(kvp__f32_bits(x) & 0x7FFFFFFFu, 0x7F800000u); }

static inline uint16_t kvp__f16_from_f32_bf(float x) {
  uint32_t u = kvp__f32_bits(x), a = u & 0x7FFFFFFFu, s = u >> 16 & 0x8000u;
  uint32_t nrm = ((a + 0xFFFu + (a >> 13 & 1u)) >> 13) - (112u << 10); /* valid from 2^-14 up */
  nrm = nrm < 0x7C00u ? nrm : 0x7C00u;                                  /* overflow: infinity */
  uint32_t as = a < KVP__F16_MIN_NORMAL_BITS ? a : KVP__F16_MIN_NORMAL_BITS;
  uint32_t sub = kvp__rne_u32(kvp__f32_of(as) * 0x1p24f); /* |x| 2^24 < 1024: codes 0..0x400 */
  uint32_t code = kvp__sel(kvp__mask(kvp__lt(a, KVP__F16_MIN_NORMAL_BITS)), sub, nrm);
  uint32_t qnan = 0x7E00u | (a >> 13 & 0x03FFu);
  return (uint16_t)(s | kvp__sel(kvp__mask(kvp__lt(0x7F800000u, a)), qnan, code));
}

static inline float kvp__f16_to_f32_bf(uint16_t c) {
  uint32_t s = (uint32_t)(c & 0x8000u) << 16, em = c & 0x7FFFu;
  uint32_t nrm = (em << 13) + (112u << 23) + (kvp__mask(kvp__lt(0x7BFFu, em)) & (112u << 23)); /* inf, NaN: e = 255 */
  uint32_t sub = kvp__f32_bits(kvp__f32_of(em << 13 | 113u << 23) - 0x1p-14f);        /* m 2^-24 */
  return kvp__f32_of(kvp__sel(kvp__mask(kvp__lt(em, 0x0400u)), sub, nrm) | s);
}

static inline uint8_t kvp__e2m1_from_f32_bf(float x) {
  uint32_t u = kvp__f32_bits(x), a = u & 0x7FFFFFFFu;
  uint32_t nrm = ((a + 0x1FFFFFu + (a >> 22 & 1u)) >> 22) - (126u << 1); /* valid from 1 up */
  nrm = nrm < 7u ? nrm : 7u;
  uint32_t sub = (uint32_t)kvp__lt(0x3E800000u, a) + (uint32_t)kvp__lt(0x3F3FFFFFu, a); /* 0.25 -> 0, 0.75 -> 2 (even) */
  uint32_t code = kvp__sel(kvp__mask(kvp__lt(a, KVP__E2M1_MIN_NORMAL_BITS)), sub, nrm) | (u >> 28 & 0x8u);
  return (uint8_t)kvp__sel(kvp__mask(kvp__lt(0x7F800000u, a)), 0x7u, code);
}

static inline float kvp__e2m1_to_f32_bf(uint8_t c) {
  uint32_t em = c & 0x7u, s = (uint32_t)(c & 0x8u) << 28;
  uint32_t nrm = (em << 22) + (126u << 23);
  uint32_t sub = kvp__f32_bits(kvp__f32_of(((em | 2u) << 22) + (126u << 23)) - 1.0f); /* 0 or 0.5 */
  return kvp__f32_of(kvp__sel(kvp__mask(kvp__lt(em, 2u)), sub, nrm) | s);
}

/* ---- inline rows, for kernels (n elements; no overlap) --------------------- */

KVP__INLINE void kvp__bf16_load_n(float *KVP__RESTRICT x, const uint16_t *KVP__RESTRICT h, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = kvp__bf16_to_f32_bf(h[i]);
}
KVP__INLINE void kvp__f16_load_n(float *KVP__RESTRICT x, const uint16_t *KVP__RESTRICT h, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = kvp__f16_to_f32_bf(h[i]);
}
KVP__INLINE void kvp__bf16_store_n(uint16_t *KVP__RESTRICT h, const float *KVP__RESTRICT x, size_t n) {
  for (size_t i = 0; i < n; i++) h[i] = kvp__bf16_from_f32_bf(x[i]);
}
KVP__INLINE void kvp__f16_store_n(uint16_t *KVP__RESTRICT h, const float *KVP__RESTRICT x, size_t n) {
  for (size_t i = 0; i < n; i++) h[i] = kvp__f16_from_f32_bf(x[i]);
}

/* q = the low bytes of w: code kernels keep 32-bit codes in their hot
 * loops (one vector register per lane group) and narrow in a pass. */
KVP__INLINE void kvp__narrow8_n(uint8_t *KVP__RESTRICT q, const uint32_t *KVP__RESTRICT w, size_t n) {
  for (size_t i = 0; i < n; i++) q[i] = (uint8_t)w[i];
}

/* x = the n elements of src (dt) in f32. */
KVP__INLINE void kvp__load_row(float *KVP__RESTRICT x, const void *KVP__RESTRICT src, kvp_dtype dt, size_t n) {
  const uint16_t *h = (const uint16_t *)src;
  if (dt == KVP_DTYPE_BF16) {
#define KVP__LD(i, c) kvp__bf16_load_n(x + (i), h + (i), (c))
    KVP__FOR_CHUNKS(n, KVP__LD);
#undef KVP__LD
  } else if (dt == KVP_DTYPE_F16) {
#define KVP__LD(i, c) kvp__f16_load_n(x + (i), h + (i), (c))
    KVP__FOR_CHUNKS(n, KVP__LD);
#undef KVP__LD
  } else {
    __builtin_memcpy(x, src, n * sizeof *x);
  }
}

/* dst (n elements of dt) = x rounded as the scalar encoders round. */
KVP__INLINE void kvp__store_row(void *KVP__RESTRICT dst, kvp_dtype dt, const float *KVP__RESTRICT x, size_t n) {
  uint16_t *h = (uint16_t *)dst;
  if (dt == KVP_DTYPE_BF16) {
#define KVP__ST(i, c) kvp__bf16_store_n(h + (i), x + (i), (c))
    KVP__FOR_CHUNKS(n, KVP__ST);
#undef KVP__ST
  } else if (dt == KVP_DTYPE_F16) {
#define KVP__ST(i, c) kvp__f16_store_n(h + (i), x + (i), (c))
    KVP__FOR_CHUNKS(n, KVP__ST);
#undef KVP__ST
  } else {
    __builtin_memcpy(dst, x, n * sizeof *x);
  }
}

/* Lanes m[j] = max over elements j mod c of |x|: a NaN never wins the
 * compare, as fmaxf(acc, |x|) skips it. */
KVP__INLINE void kvp__absmax_n(float *KVP__RESTRICT m, const float *KVP__RESTRICT x, size_t n) {
  for (size_t j = 0; j < n; j++) {
    float a = __builtin_fabsf(x[j]);
    m[j] = a > m[j] ? a : m[j];
  }
}
KVP__INLINE void kvp__max_fold_n(float *KVP__RESTRICT m, const float *KVP__RESTRICT hi, size_t n) {
  for (size_t j = 0; j < n; j++) m[j] = hi[j] > m[j] ? hi[j] : m[j];
}

/* max |x_i| over n elements, 0 for n = 0, NaNs skipped: the value of
 * acc = fmaxf(acc, fabsf(x_i)) from acc = 0, in any order, for max is
 * exact and every |x| is +0 or above. */
KVP__INLINE float kvp__absmax(const float *x, size_t n) {
  float m[KVP__CHUNK] = {0};
#define KVP__AM(i, c) kvp__absmax_n(m, x + (i), (c))
  KVP__FOR_CHUNKS(n, KVP__AM);
#undef KVP__AM
  kvp__max_fold_n(m, m + 16, 16);
  kvp__max_fold_n(m, m + 8, 8);
  kvp__max_fold_n(m, m + 4, 4);
  kvp__max_fold_n(m, m + 2, 2);
  return m[1] > m[0] ? m[1] : m[0];
}

/* ---- rows (n elements; dst and src must not overlap) -------------------- */

/* Bytes of one element of dt: 4 for F32, 2 for BF16 and F16. */
size_t kvp__dtype_bytes(kvp_dtype dt);
/* dst[i] = value of element i of src, an array of n elements of dt. */
void kvp__row_to_f32(float *dst, const void *src, kvp_dtype dt, size_t n);
/* Element i of dst (n elements of dt) = src[i] rounded as above. */
void kvp__row_from_f32(void *dst, kvp_dtype dt, const float *src, size_t n);
/* Index of the first NaN among the n elements of src (dt), or n if none. */
size_t kvp__row_find_nan(const void *src, kvp_dtype dt, size_t n);
/* Index of the first NaN or +-Inf in n elements, or n. */
size_t kvp__row_find_nonfinite(const void *src, kvp_dtype dt, size_t n);
/* Copy the rows of an [n][nh][e] tensor of dt, row (t, h) (e elements at
 * src + t * src_stride bytes + h * e elements), to dst[h] + t * e elements,
 * screening them in the same pass: true when every value copied is finite
 * (no exponent field all ones). Every row is copied either way. */
bool kvp__rows_scatter_finite(void *const *dst, const void *src, size_t src_stride, kvp_dtype dt, size_t n, size_t nh,
                              size_t e);
/* The same with non-temporal stores (around the caches) where every dst[h]
 * is 32-byte aligned and a row is a whole number of 32-byte vectors (plain
 * stores otherwise), fenced before it returns: for copies much larger than
 * the caches into lines no core holds. */
bool kvp__rows_scatter_finite_nt(void *const *dst, const void *src, size_t src_stride, kvp_dtype dt, size_t n,
                                 size_t nh, size_t e);
/* Copy n elements, NaN -> +0 and +-Inf -> +-largest finite of the dtype. */
void kvp__row_sanitize(void *dst, const void *src, kvp_dtype dt, size_t n);

void kvp__bf16_to_f32_row(float *KVP__RESTRICT dst, const uint16_t *KVP__RESTRICT src, size_t n);
void kvp__bf16_from_f32_row(uint16_t *KVP__RESTRICT dst, const float *KVP__RESTRICT src, size_t n);
void kvp__f16_to_f32_row(float *KVP__RESTRICT dst, const uint16_t *KVP__RESTRICT src, size_t n);
void kvp__f16_from_f32_row(uint16_t *KVP__RESTRICT dst, const float *KVP__RESTRICT src, size_t n);
void kvp__fp8_e4m3_to_f32_row(float *KVP__RESTRICT dst, const uint8_t *KVP__RESTRICT src, size_t n);
void kvp__fp8_e4m3_from_f32_row(uint8_t *KVP__RESTRICT dst, const float *KVP__RESTRICT src, size_t n);

/* ---- packed codes (bits = 2, 3 or 4; see the layouts above) ------------- */

size_t kvp__lsb32_bytes(size_t n, unsigned bits); /* 4 * ceil(n bits / 32) */
void kvp__lsb32_pack(uint8_t *dst, const uint8_t *codes, size_t n, unsigned bits);
void kvp__lsb32_unpack(uint8_t *codes, const uint8_t *src, size_t n, unsigned bits);

size_t kvp__msb8_bytes(size_t n, unsigned bits); /* ceil(n bits / 8) */
void kvp__msb8_pack(uint8_t *dst, const uint8_t *codes, size_t n, unsigned bits);
void kvp__msb8_unpack(uint8_t *codes, const uint8_t *src, size_t n, unsigned bits);

size_t kvp__nib_bytes(size_t n); /* ceil(n / 2) */
void kvp__nib_pack(uint8_t *dst, const uint8_t *codes, size_t n);
void kvp__nib_unpack(uint8_t *codes, const uint8_t *src, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* KVP_CODECS_NUMERIC_H */
