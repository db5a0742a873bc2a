/*
 * codecs/numeric.c - small float formats and packed integer codes; the
 * formats, NaN rules and bit layouts are documented in codecs/numeric.h.
 *
 * Rounding. Every encoder works on the f32 bits with integers, so results
 * do not depend on the FPU rounding mode or on flush-to-zero. For a finite
 * |x| = sig 2^(e-23), sig the 24-bit significand (implicit bit set), and a
 * target with m mantissa bits and bias B (emin = 1 - B):
 *
 *   normal    (e >= emin):  code = (e + B - 1) << m  +  sig >> (23 - m)
 *   subnormal (e <  emin):  code = sig >> (23 - m + emin - e)
 *
 * then the dropped bits decide: above half -> code + 1; exactly half ->
 * code + 1 if code is odd (ties to even). A carry out of the mantissa walks
 * into the exponent field, which is the correctly rounded next binade (and
 * from the top subnormal into the smallest normal). Saturation or overflow
 * to infinity is applied to the resulting code, so a tie at the top is
 * decided by the same rule as every other tie.
 *
 *   |x| f32 bits:  s eeeeeeee [1]mmmmmmmmmmmmmmmmmmmmmmm
 *                              |<- kept m ->|<- dropped ->|
 *                                           ^ half = top dropped bit
 */
#include "numeric.h"
#include "kernels.h"

#include "../util/util.h"

#include <math.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <emmintrin.h>
#endif

static inline uint32_t f32_bits(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

static inline float f32_from_bits(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

/* The magnitude code (exponent field << m | mantissa) of |x|, given as f32
 * bits a (finite), in a format with m mantissa bits and bias `bias`, rounded
 * to nearest even, exponent unbounded above (the caller saturates). */
static inline uint32_t round_small(uint32_t a, unsigned m, int bias) {
  if (a < 0x00800000u) return 0; /* zero or f32 subnormal: < 2^-126, far below half our quanta */
  int e = (int)(a >> 23) - 127;  /* unbiased exponent */
  int emin = 1 - bias;           /* exponent of the smallest normal */
  uint32_t sig = (a & 0x007FFFFFu) | 0x00800000u;
  uint32_t code;
  unsigned drop; /* bits of sig below the target's quantum */
  if (e >= emin) {
    drop = 23 - m;
    code = ((uint32_t)(e + bias - 1) << m) + (sig >> drop);
  } else {
    drop = 23 - m + (unsigned)(emin - e);
    if (drop > 25) drop = 25; /* sig < 2^24 = half of 2^25: rounds to 0 either way */
    code = sig >> drop;
  }
  uint32_t rem = sig & ((1u << drop) - 1), half = 1u << (drop - 1);
  if (rem > half || (rem == half && (code & 1u))) code++;
  return code;
}

/* f32 bits of m 2^k for 0 < m < 2^23, integers only (exact). */
static inline uint32_t f32_bits_scaled(uint32_t m, int k) {
  int p = 31 - __builtin_clz(m); /* m = 2^p 1.f */
  return (uint32_t)(p + k + 127) << 23 | ((m << (23 - p)) & 0x007FFFFFu);
}

/* ---- FP8 E4M3 ----------------------------------------------------------- */

static inline uint8_t fp8_enc(float x) {
  uint32_t u = f32_bits(x), a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return KVP__FP8_E4M3_NAN;
  uint32_t code = a == 0x7F800000u ? 0x7Eu : round_small(a, 3, 7);
  if (code > 0x7Eu) code = 0x7Eu; /* saturate: 0x7F is NaN, beyond is out of range */
  return (uint8_t)((u >> 24 & 0x80u) | code);
}

static inline float fp8_dec(uint8_t c) {
  uint32_t s = (uint32_t)(c & 0x80u) << 24, e = c >> 3 & 0xFu, m = c & 7u;
  if (e == 0xFu && m == 7u) return f32_from_bits(s | 0x7FC00000u);
  if (e) return f32_from_bits(s | (e + 127 - 7) << 23 | m << 20);
  return f32_from_bits(m ? s | f32_bits_scaled(m, -9) : s); /* m 2^-9 */
}

uint8_t kvp__fp8_e4m3_from_f32(float x) { return fp8_enc(x); }
float kvp__fp8_e4m3_to_f32(uint8_t code) { return fp8_dec(code); }

/* ---- BF16 --------------------------------------------------------------- */

/* Branch-free so row loops vectorize: the rounding add carries into the
 * exponent on overflow (0x7F7F.. -> 0x7F80 = inf); NaN takes the quiet bit. */
static inline uint16_t bf16_enc(float x) {
  uint32_t u = f32_bits(x);
  uint32_t rne = (u + 0x7FFFu + (u >> 16 & 1u)) >> 16;
  uint32_t qnan = u >> 16 | 0x0040u;
  return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? qnan : rne);
}

static inline float bf16_dec(uint16_t c) { return f32_from_bits((uint32_t)c << 16); }

uint16_t kvp__bf16_from_f32(float x) { return bf16_enc(x); }
float kvp__bf16_to_f32(uint16_t code) { return bf16_dec(code); }

/* ---- FP16 --------------------------------------------------------------- */

static inline uint16_t f16_enc(float x) {
  uint32_t u = f32_bits(x), a = u & 0x7FFFFFFFu, s = u >> 16 & 0x8000u;
  if (a > 0x7F800000u) return (uint16_t)(s | 0x7E00u | (a >> 13 & 0x03FFu));
  uint32_t code = a == 0x7F800000u ? 0x7C00u : round_small(a, 10, 15);
  if (code > 0x7C00u) code = 0x7C00u; /* overflow: infinity */
  return (uint16_t)(s | code);
}

static inline float f16_dec(uint16_t c) {
  uint32_t s = (uint32_t)(c & 0x8000u) << 16, e = c >> 10 & 0x1Fu, m = c & 0x03FFu;
  if (e == 0x1Fu) return f32_from_bits(s | 0x7F800000u | m << 13);
  if (e) return f32_from_bits(s | (e + 127 - 15) << 23 | m << 13);
  return f32_from_bits(m ? s | f32_bits_scaled(m, -24) : s); /* m 2^-24 */
}

uint16_t kvp__f16_from_f32(float x) { return f16_enc(x); }
float kvp__f16_to_f32(uint16_t code) { return f16_dec(code); }

/* ---- FP4 E2M1 ----------------------------------------------------------- */

uint8_t kvp__e2m1_from_f32(float x) {
  uint32_t u = f32_bits(x), a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7u; /* NaN: +6, as CUDA */
  uint32_t code = a == 0x7F800000u ? 0x7u : round_small(a, 1, 1);
  if (code > 0x7u) code = 0x7u; /* saturate at 6 */
  return (uint8_t)((u >> 28 & 0x8u) | code);
}

static const float e2m1_values[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float kvp__e2m1_to_f32(uint8_t code) { return e2m1_values[code & 0xFu]; }

/* ---- sin and cos ----------------------------------------------------------- */

/* pi/2 = P1 + P2 + P3 + P4 (P1..P3: 21 significant bits each) */
#define SC_P1 0x1.921fbp+0
#define SC_P2 0x1.5110bp-22
#define SC_P3 0x1.18469p-44
#define SC_P4 0x1.13198a2e03707p-65
#define SC_2_PI 0x1.45f306dc9c883p-1 /* 2/pi */
/* fdlibm k_sin.c and k_cos.c */
#define SC_S1 -0x1.5555555555549p-3
#define SC_S2 0x1.111111110f8a6p-7
#define SC_S3 -0x1.a01a019c161d5p-13
#define SC_S4 0x1.71de357b1fe7dp-19
#define SC_S5 -0x1.ae5e68a2b9cebp-26
#define SC_S6 0x1.5d93a5acfd57cp-33
#define SC_C1 0x1.555555555554cp-5
#define SC_C2 -0x1.6c16c16c15177p-10
#define SC_C3 0x1.a01a019cb1590p-16
#define SC_C4 -0x1.27e4f809c52adp-22
#define SC_C5 0x1.1ee9ebdb4b1c4p-29
#define SC_C6 -0x1.8fae9be8838d4p-37

void kvp__sincos(double x, double *s, double *c) {
  double k = floor(x * SC_2_PI + 0.5);
  double r = x - k * SC_P1; /* exact (Sterbenz) */
  r = r - k * SC_P2;
  r = r - k * SC_P3;
  r = r - k * SC_P4;
  double z = r * r;
  double ps = r + r * z * (SC_S1 + z * (SC_S2 + z * (SC_S3 + z * (SC_S4 + z * (SC_S5 + z * SC_S6)))));
  double pc = 1.0 - 0.5 * z + z * z * (SC_C1 + z * (SC_C2 + z * (SC_C3 + z * (SC_C4 + z * (SC_C5 + z * SC_C6)))));
  unsigned q = (unsigned)((uint64_t)k & 3u);
  *s = q == 0 ? ps : q == 1 ? pc : q == 2 ? -ps : -pc;
  *c = q == 0 ? pc : q == 1 ? -ps : q == 2 ? -pc : ps;
}

/* ---- rows ---------------------------------------------------------------
 * The branch-free forms of numeric.h over KVP__FOR_CHUNKS: each helper
 * NAME_n is inlined with constant counts (loops gcc -O2 vectorizes) and
 * once for the tail. About a cycle per element or less at -O2 (SSE2); the
 * FP16 and FP8 encoders are the dearest. */

#define KVP__ROW_FN(name, dst_t, src_t, conv)                                                                         \
  KVP__INLINE void name##_n(dst_t *restrict dst, const src_t *restrict src, size_t n) {                              \
    for (size_t i = 0; i < n; i++) dst[i] = conv(src[i]);                                                              \
  }                                                                                                                    \
  void name(dst_t *restrict dst, const src_t *restrict src, size_t n) { KVP__FOR_CHUNKS(n, name##_at); }

#define kvp__bf16_to_f32_row_at(i, c) kvp__bf16_to_f32_row_n(dst + (i), src + (i), (c))
#define kvp__bf16_from_f32_row_at(i, c) kvp__bf16_from_f32_row_n(dst + (i), src + (i), (c))
#define kvp__f16_to_f32_row_at(i, c) kvp__f16_to_f32_row_n(dst + (i), src + (i), (c))
#define kvp__f16_from_f32_row_at(i, c) kvp__f16_from_f32_row_n(dst + (i), src + (i), (c))
#define kvp__fp8_e4m3_to_f32_row_at(i, c) kvp__fp8_e4m3_to_f32_row_n(dst + (i), src + (i), (c))
#define kvp__fp8_e4m3_from_f32_row_at(i, c) kvp__fp8_e4m3_from_f32_row_n(dst + (i), src + (i), (c))

KVP__ROW_FN(kvp__bf16_to_f32_row, float, uint16_t, kvp__bf16_to_f32_bf)
KVP__ROW_FN(kvp__bf16_from_f32_row, uint16_t, float, kvp__bf16_from_f32_bf)
KVP__ROW_FN(kvp__f16_to_f32_row, float, uint16_t, kvp__f16_to_f32_bf)
KVP__ROW_FN(kvp__f16_from_f32_row, uint16_t, float, kvp__f16_from_f32_bf)
KVP__ROW_FN(kvp__fp8_e4m3_to_f32_row, float, uint8_t, kvp__fp8_e4m3_to_f32_bf)
KVP__ROW_FN(kvp__fp8_e4m3_from_f32_row, uint8_t, float, kvp__fp8_e4m3_from_f32_bf)

size_t kvp__dtype_bytes(kvp_dtype dt) {
  kvp__assert(dt == KVP_DTYPE_F32 || dt == KVP_DTYPE_BF16 || dt == KVP_DTYPE_F16);
  return dt == KVP_DTYPE_F32 ? 4 : 2;
}

void kvp__row_to_f32(float *dst, const void *src, kvp_dtype dt, size_t n) {
  switch (dt) {
  case KVP_DTYPE_F32: memcpy(dst, src, n * sizeof *dst); break;
  case KVP_DTYPE_BF16: kvp__bf16_to_f32_row(dst, src, n); break;
  case KVP_DTYPE_F16: kvp__f16_to_f32_row(dst, src, n); break;
  default: kvp__assert(!"bad dtype");
  }
}

void kvp__row_from_f32(void *dst, kvp_dtype dt, const float *src, size_t n) {
  switch (dt) {
  case KVP_DTYPE_F32: memcpy(dst, src, n * sizeof *src); break;
  case KVP_DTYPE_BF16: kvp__bf16_from_f32_row(dst, src, n); break;
  case KVP_DTYPE_F16: kvp__f16_from_f32_row(dst, src, n); break;
  default: kvp__assert(!"bad dtype");
  }
}

/* The NaN test on bits: exponent all ones and mantissa non-zero. */
/* The first NaN at or after i0 in a chunk known to hold one, or n. */
static size_t find_nan_scalar(const unsigned char *p, kvp_dtype dt, size_t i0, size_t n) {
  size_t w = kvp__dtype_bytes(dt);
  for (size_t i = i0; i < n; i++) {
    if (w == 4) {
      uint32_t u;
      memcpy(&u, p + i * 4, 4);
      if ((u & 0x7FFFFFFFu) > 0x7F800000u) return i;
    } else {
      uint16_t h;
      memcpy(&h, p + i * 2, 2);
      if ((h & 0x7FFFu) > (dt == KVP_DTYPE_BF16 ? 0x7F80u : 0x7C00u)) return i;
    }
  }
  return n;
}

/* Max of the magnitude bits of CHUNK elements: a fixed trip count and no
 * branch, so the vectorizer takes it even at -O2. */
enum { NAN_CHUNK = 256 };
/* Lane-wise maxima over NAN_CHUNK elements, reduced at the end: the inner
 * loops are one vector wide with a fixed trip count, so -O2's vectorizer
 * turns them into packed and/max (the magnitudes are masked non-negative,
 * so signed lanes hold them: SSE2's pmaxsw for 16-bit lanes). A single
 * running maximum was a serial dependency chain: about one instruction per
 * element. */
enum { NAN_LANES16 = 16, NAN_LANES32 = 8 };
KVP__INLINE uint32_t chunk_max32(const unsigned char *p) {
  int32_t m[NAN_LANES32] = {0};
  for (size_t i = 0; i < NAN_CHUNK; i += NAN_LANES32)
    for (size_t j = 0; j < NAN_LANES32; j++) {
      int32_t u;
      memcpy(&u, p + (i + j) * 4, 4);
      u &= 0x7FFFFFFF;
      m[j] = u > m[j] ? u : m[j];
    }
  int32_t mx = 0;
  for (size_t j = 0; j < NAN_LANES32; j++) mx = m[j] > mx ? m[j] : mx;
  return (uint32_t)mx;
}
KVP__INLINE uint16_t chunk_max16(const unsigned char *p) {
  int16_t m[NAN_LANES16] = {0};
  for (size_t i = 0; i < NAN_CHUNK; i += NAN_LANES16)
    for (size_t j = 0; j < NAN_LANES16; j++) {
      int16_t h;
      memcpy(&h, p + (i + j) * 2, 2);
      h &= 0x7FFF;
      m[j] = h > m[j] ? h : m[j];
    }
  int16_t mx = 0;
  for (size_t j = 0; j < NAN_LANES16; j++) mx = m[j] > mx ? m[j] : mx;
  return (uint16_t)mx;
}

/* Whole chunks are screened with a branch-free max of the magnitude bits;
 * a chunk whose max is above the infinity pattern, and the tail, are
 * scanned element by element. */
size_t kvp__row_find_nan(const void *src, kvp_dtype dt, size_t n) {
  const unsigned char *p = src;
  size_t w = kvp__dtype_bytes(dt), i0 = 0;
  uint32_t inf = dt == KVP_DTYPE_F32 ? 0x7F800000u : dt == KVP_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
  for (; i0 + NAN_CHUNK <= n; i0 += NAN_CHUNK) {
    uint32_t mx = w == 4 ? chunk_max32(p + i0 * 4) : chunk_max16(p + i0 * 2);
    if (mx > inf) return find_nan_scalar(p, dt, i0, i0 + NAN_CHUNK);
  }
  return find_nan_scalar(p, dt, i0, n);
}

/* ---- packed codes ------------------------------------------------------- *
 * One bit accumulator each way: pack shifts a code in and flushes whole
 * bytes, unpack pulls a byte when fewer than `bits` bits are left. Cost per
 * code: a shift, an or, a mask; the accumulator never holds 12+ bits. */

static inline void check_bits(unsigned bits) { kvp__assert(bits >= 2 && bits <= 4); }

size_t kvp__lsb32_bytes(size_t n, unsigned bits) { return 4 * ((n * bits + 31) / 32); }

void kvp__lsb32_pack(uint8_t *dst, const uint8_t *codes, size_t n, unsigned bits) {
  check_bits(bits);
  uint32_t mask = (1u << bits) - 1, acc = 0; /* acc: pending stream bits, oldest in bit 0 */
  unsigned nacc = 0;                         /* bits pending in acc (< 8 between codes) */
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    acc |= (uint32_t)(codes[i] & mask) << nacc;
    for (nacc += bits; nacc >= 8; nacc -= 8, acc >>= 8) dst[o++] = (uint8_t)acc;
  }
  if (nacc) dst[o++] = (uint8_t)acc;
  memset(dst + o, 0, kvp__lsb32_bytes(n, bits) - o);
}

void kvp__lsb32_unpack(uint8_t *codes, const uint8_t *src, size_t n, unsigned bits) {
  check_bits(bits);
  uint32_t mask = (1u << bits) - 1, acc = 0;
  unsigned nacc = 0;
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    if (nacc < bits) {
      acc |= (uint32_t)src[o++] << nacc;
      nacc += 8;
    }
    codes[i] = (uint8_t)(acc & mask);
    acc >>= bits;
    nacc -= bits;
  }
}

size_t kvp__msb8_bytes(size_t n, unsigned bits) { return (n * bits + 7) / 8; }

void kvp__msb8_pack(uint8_t *dst, const uint8_t *codes, size_t n, unsigned bits) {
  check_bits(bits);
  uint32_t mask = (1u << bits) - 1, acc = 0; /* acc: pending stream bits, newest in bit 0 */
  unsigned nacc = 0;
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    acc = acc << bits | (codes[i] & mask);
    nacc += bits;
    if (nacc >= 8) {
      nacc -= 8;
      dst[o++] = (uint8_t)(acc >> nacc);
      acc &= (1u << nacc) - 1;
    }
  }
  if (nacc) dst[o] = (uint8_t)(acc << (8 - nacc));
}

void kvp__msb8_unpack(uint8_t *codes, const uint8_t *src, size_t n, unsigned bits) {
  check_bits(bits);
  uint32_t mask = (1u << bits) - 1, acc = 0;
  unsigned nacc = 0;
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    if (nacc < bits) {
      acc = acc << 8 | src[o++];
      nacc += 8;
    }
    nacc -= bits;
    codes[i] = (uint8_t)(acc >> nacc & mask);
    acc &= (1u << nacc) - 1;
  }
}

size_t kvp__nib_bytes(size_t n) { return (n + 1) / 2; }

void kvp__nib_pack(uint8_t *dst, const uint8_t *codes, size_t n) {
  for (size_t j = 0; j < n / 2; j++) dst[j] = (uint8_t)((codes[2 * j] & 0xFu) | (codes[2 * j + 1] & 0xFu) << 4);
  if (n & 1) dst[n / 2] = codes[n - 1] & 0xFu;
}

void kvp__nib_unpack(uint8_t *codes, const uint8_t *src, size_t n) {
  for (size_t j = 0; j < n / 2; j++) {
    codes[2 * j] = src[j] & 0xFu;
    codes[2 * j + 1] = src[j] >> 4;
  }
  if (n & 1) codes[n - 1] = src[n / 2] & 0xFu;
}

/* ---- non-finite screen ----------------------------------------------------
 * Like kvp__row_find_nan, for NaN and +-Inf: magnitude bits >= the infinity
 * pattern. Whole chunks take the branch-free max. */
/* *at = elements before the first of the nchunks whole chunks whose max
 * reaches inf (nchunks * NAN_CHUNK when none does). An ISA kernel: an
 * append screens every value it is handed, and AVX2 halves the count of
 * and/max instructions. */
KVP__KERNEL(nonfinite_chunks, (const unsigned char *p, size_t w, size_t nchunks, uint32_t inf, size_t *at),
            (p, w, nchunks, inf, at)) {
  size_t c = 0;
  if (w == 4)
    while (c < nchunks && chunk_max32(p + c * NAN_CHUNK * 4) < inf) c++;
  else
    while (c < nchunks && chunk_max16(p + c * NAN_CHUNK * 2) < inf) c++;
  *at = c * NAN_CHUNK;
  return 0;
}

size_t kvp__row_find_nonfinite(const void *src, kvp_dtype dt, size_t n) {
  const unsigned char *p = src;
  size_t w = kvp__dtype_bytes(dt), i0 = 0;
  uint32_t inf = dt == KVP_DTYPE_F32 ? 0x7F800000u : dt == KVP_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
  (void)nonfinite_chunks(p, w, n / NAN_CHUNK, inf, &i0);
  for (size_t i = i0; i < n; i++) {
    uint32_t mag;
    if (w == 4) {
      memcpy(&mag, p + i * 4, 4);
      mag &= 0x7FFFFFFFu;
    } else {
      uint16_t h;
      memcpy(&h, p + i * 2, 2);
      mag = h & 0x7FFFu;
    }
    if (mag >= inf) return i;
  }
  return n;
}

/* ---- the screen on the copy ----------------------------------------------
 * kvp__rows_scatter_finite copies an append's rows to their heads' pages
 * and screens them in the same pass: each 32-byte vector is loaded once,
 * stored, and its exponent fields compared with all ones (NaN or +-Inf has
 * every exponent bit set, no finite value has), the compares OR-ed into one
 * mask. Per 32 bytes: load, store, and, compare, or; the vectors are GCC
 * vector types, two SSE2 registers each on the base ISA, one under AVX2. A
 * row's bytes past its last whole vector (head_dim not a multiple of 16
 * 16-bit or 8 32-bit elements) go one element at a time.
 *
 * kvp__rows_scatter_finite_nt stores the vectors non-temporally (MOVNTDQ:
 * around the caches, no read of the destination's lines before they are
 * written) when every destination row is 32-byte aligned, then fences
 * (SFENCE), so a later release store (the publication) is ordered after
 * them. For copies far larger than the caches into lines nobody holds (a
 * VAR scale into fresh pages): half the memory traffic of a plain store,
 * whose write-allocate reads each line first. */
#if defined(__x86_64__) && defined(__GNUC__)
/* 32 bytes at d (16-byte aligned) from x, as two MOVNTDQ (SSE2: both ISA
 * copies of the kernel can use them). */
KVP__INLINE void store_nt32(unsigned char *d, const void *x) {
  __m128i a, b;
  memcpy(&a, x, 16);
  memcpy(&b, (const unsigned char *)x + 16, 16);
  _mm_stream_si128((__m128i *)(void *)d, a);
  _mm_stream_si128((__m128i *)(void *)(d + 16), b);
}
#else
KVP__INLINE void store_nt32(unsigned char *d, const void *x) { memcpy(d, x, 32); }
#endif
typedef uint16_t scatter_v16 __attribute__((vector_size(32)));
typedef uint32_t scatter_v32 __attribute__((vector_size(32)));

/* 32 bytes from x to d: a plain store, or around the caches. */
KVP__INLINE void scatter_store32(unsigned char *d, const void *x, int nt) {
  if (nt) store_nt32(d, x);
  else memcpy(d, x, 32);
}

/* The nv whole vectors of one row, four a turn (the loop's own instructions
 * over four copies), then the rest; *acc ORs every lane's exponent test.
 * Inlined with nt a constant, so the turn is 4 loads, 4 stores and 3
 * operations a vector. One definition per element width (V: the lanes'
 * type); the mask comes by address: a 32-byte vector argument has no
 * stable ABI without AVX. */
#define SCATTER_ROW(name, V)                                                                                      \
  KVP__INLINE void name(unsigned char *d, const unsigned char *s, size_t nv, const V *ep, V *acc, int nt) {       \
    const V e = *ep;                                                                                              \
    V a = *acc;                                                                                                   \
    size_t i = 0;                                                                                                 \
    for (; i + 4 <= nv; i += 4) {                                                                                 \
      V x0, x1, x2, x3;                                                                                           \
      memcpy(&x0, s + 32 * i, 32);                                                                                \
      memcpy(&x1, s + 32 * i + 32, 32);                                                                           \
      memcpy(&x2, s + 32 * i + 64, 32);                                                                           \
      memcpy(&x3, s + 32 * i + 96, 32);                                                                           \
      scatter_store32(d + 32 * i, &x0, nt);                                                                       \
      scatter_store32(d + 32 * i + 32, &x1, nt);                                                                  \
      scatter_store32(d + 32 * i + 64, &x2, nt);                                                                  \
      scatter_store32(d + 32 * i + 96, &x3, nt);                                                                  \
      a |= (V)((x0 & e) == e) | (V)((x1 & e) == e) | (V)((x2 & e) == e) | (V)((x3 & e) == e);                     \
    }                                                                                                             \
    for (; i < nv; i++) {                                                                                         \
      V x;                                                                                                        \
      memcpy(&x, s + 32 * i, 32);                                                                                 \
      scatter_store32(d + 32 * i, &x, nt);                                                                        \
      a |= (V)((x & e) == e);                                                                                     \
    }                                                                                                             \
    *acc = a;                                                                                                     \
  }
SCATTER_ROW(scatter_row16, scatter_v16)
SCATTER_ROW(scatter_row32, scatter_v32)
#undef SCATTER_ROW

/* Every row's whole vectors, the element width and the store kind chosen
 * once per call (outside the loops over tokens and heads); then the bytes
 * of each row past its last whole vector, one element at a time. */
KVP__KERNEL(scatter_screen, (void *const *dst, const unsigned char *src, size_t src_stride, size_t w, uint32_t ex,
                             size_t n, size_t nh, size_t row_bytes, int nt, int *bad),
            (dst, src, src_stride, w, ex, n, nh, row_bytes, nt, bad)) {
  size_t nv = row_bytes / 32;
  scatter_v16 acc16 = {0}, e16 = {0};
  scatter_v32 acc32 = {0}, e32 = {0};
  e16 += (uint16_t)ex, e32 += ex;
#define SCATTER_ROWS(row, acc, e, NT)                                                                          \
  for (size_t t = 0; t < n; t++)                                                                               \
    for (size_t h = 0; h < nh; h++)                                                                            \
      row((unsigned char *)dst[h] + t * row_bytes, src + t * src_stride + h * row_bytes, nv, &e, &acc, NT)
  if (w == 2 && nt) SCATTER_ROWS(scatter_row16, acc16, e16, 1);
  else if (w == 2) SCATTER_ROWS(scatter_row16, acc16, e16, 0);
  else if (nt) SCATTER_ROWS(scatter_row32, acc32, e32, 1);
  else SCATTER_ROWS(scatter_row32, acc32, e32, 0);
#undef SCATTER_ROWS
  uint32_t tail_bad = 0;
  for (size_t t = 0; nv * 32 < row_bytes && t < n; t++)
    for (size_t h = 0; h < nh; h++) {
      unsigned char *d = (unsigned char *)dst[h] + t * row_bytes;
      const unsigned char *s = src + t * src_stride + h * row_bytes;
      for (size_t b = nv * 32; b < row_bytes; b += w) {
        uint32_t u;
        if (w == 2) {
          uint16_t x;
          memcpy(&x, s + b, 2);
          memcpy(d + b, &x, 2);
          u = x;
        } else {
          memcpy(&u, s + b, 4);
          memcpy(d + b, &u, 4);
        }
        tail_bad |= (u & ex) == ex;
      }
    }
  uint32_t any = tail_bad;
  for (int j = 0; j < 16; j++) any |= acc16[j];
  for (int j = 0; j < 8; j++) any |= acc32[j];
  *bad = any != 0;
  return 0;
}

bool kvp__rows_scatter_finite(void *const *dst, const void *src, size_t src_stride, kvp_dtype dt, size_t n, size_t nh,
                              size_t e) {
  size_t w = kvp__dtype_bytes(dt);
  uint32_t ex = dt == KVP_DTYPE_F32 ? 0x7F800000u : dt == KVP_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
  int bad = 0;
  (void)scatter_screen(dst, src, src_stride, w, ex, n, nh, e * w, 0, &bad);
  return !bad;
}

bool kvp__rows_scatter_finite_nt(void *const *dst, const void *src, size_t src_stride, kvp_dtype dt, size_t n,
                                 size_t nh, size_t e) {
  size_t w = kvp__dtype_bytes(dt), row_bytes = e * w;
  uint32_t ex = dt == KVP_DTYPE_F32 ? 0x7F800000u : dt == KVP_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
  int nt = row_bytes % 32 == 0, bad = 0; /* every row of every head 32-byte aligned, or plain stores */
  for (size_t h = 0; nt && h < nh; h++) nt = ((uintptr_t)dst[h] & 31) == 0;
  (void)scatter_screen(dst, src, src_stride, w, ex, n, nh, row_bytes, nt, &bad);
  if (nt) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_sfence();
#else
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
#endif
  }
  return !bad;
}

void kvp__row_sanitize(void *dst, const void *src, kvp_dtype dt, size_t n) {
  unsigned char *d = dst;
  const unsigned char *s = src;
  if (dt == KVP_DTYPE_F32) {
    for (size_t i = 0; i < n; i++) {
      uint32_t u;
      memcpy(&u, s + i * 4, 4);
      if ((u & 0x7FFFFFFFu) > 0x7F800000u) u = 0;                           /* NaN -> 0 */
      else if ((u & 0x7FFFFFFFu) == 0x7F800000u) u = (u & 0x80000000u) | 0x7F7FFFFFu; /* Inf -> max */
      memcpy(d + i * 4, &u, 4);
    }
    return;
  }
  uint16_t inf = dt == KVP_DTYPE_BF16 ? 0x7F80u : 0x7C00u, max = dt == KVP_DTYPE_BF16 ? 0x7F7Fu : 0x7BFFu;
  for (size_t i = 0; i < n; i++) {
    uint16_t h;
    memcpy(&h, s + i * 2, 2);
    if ((h & 0x7FFFu) > inf) h = 0;
    else if ((h & 0x7FFFu) == inf) h = (uint16_t)((h & 0x8000u) | max);
    memcpy(d + i * 2, &h, 2);
  }
}
