/*
 * tests/unit/check_codecs_ref.c - the built-in codecs (fp8, int8, kivi,
 * nvfp4) against a reference: their first, scalar implementations, kept
 * here. The library's codecs run vectorizable row kernels; this suite holds
 * them to the same page bytes and the same decoded bits.
 *
 * The reference is written per element on the scalar conversions of
 * codecs/numeric.c (kvp__fp8_e4m3_from_f32, kvp__bf16_from_f32, ...: each
 * checked against its own reference and tie rules by check_numeric), with
 * its own row conversions and bit packing. Its running min and max
 * (fminf/fmaxf) are written out as the first implementation computed them
 * on x86-64: a value replaces the min only when strictly smaller, so of
 * zeros of both signs the first one seen stays; that decides kivi's fp16
 * min of a group whose least value is a zero.
 *
 * What is compared, for both kernel ISAs (codecs/kernels.h: base, and AVX2
 * where the CPU has it) and every codec case, in dtype, head dim (odd ones
 * for fp8 and int8), K and V, n < cap and n = cap:
 *   - every page byte after encode (pages prefilled with garbage), and the
 *     status and message of a failing encode (kivi's fp16 range);
 *   - decode of the full block and of random sub-ranges, to f32, bf16 and
 *     f16, bit for bit, with strided rows whose padding must stay intact;
 *   - decode of pages of random bytes (NaN and infinite scales, NaN codes,
 *     subnormals): equal bits, except that two NaNs compare equal (which
 *     NaN a product of two NaNs gives is the compiler's operand order).
 * Inputs: gaussian rows, magnitudes over 2^-30..2^20, f32/f16/bf16
 * subnormals, exact ties of each quantizer's grid, signed zeros, values at
 * the formats' maxima, (fp8 static) values whose quotient overflows, and
 * (kivi) values beyond the fp16 range, which fail with the same message.
 */
#include "../../codecs/builtin.h"
#include "../../codecs/kernels.h"
#include "../../codecs/numeric.h"
#include "../../util/util.h"
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ck_hot(expr, ...)                                                                                              \
  do {                                                                                                                 \
    if (!(expr)) ck_assert_msg(0, __VA_ARGS__);                                                                        \
  } while (0)

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

/* ==== the reference ==================================================== */

enum { FP8, INT8, KIVI, NVFP4 };

/* A codec case and the instance fields the reference needs. */
typedef struct rcase {
  const kvp_codec_vtable *vt;
  const char *params;
  int kind;
  int dynamic;          /* fp8 */
  float static_scale;   /* fp8 static */
  float pct;            /* int8 */
  unsigned bits, group; /* kivi */
  int rule46, ksmooth;  /* nvfp4 */
} rcase;

static const rcase cases[] = {
    {&kvp__codec_fp8, "", FP8, 1, 0, 0, 0, 0, 0, 0},
    {&kvp__codec_fp8, "scale=0.03125", FP8, 0, 0.03125f, 0, 0, 0, 0, 0},
    {&kvp__codec_fp8, "scale=1e-30", FP8, 0, 1e-30f, 0, 0, 0, 0, 0},
    {&kvp__codec_fp8, "scale=3e+20", FP8, 0, 3e20f, 0, 0, 0, 0, 0},
    {&kvp__codec_int8, "", INT8, 0, 0, 100.0f, 0, 0, 0, 0},
    {&kvp__codec_int8, "pct=99.5", INT8, 0, 0, 99.5f, 0, 0, 0, 0},
    {&kvp__codec_int8, "pct=50", INT8, 0, 0, 50.0f, 0, 0, 0, 0},
    {&kvp__codec_kivi, "", KIVI, 0, 0, 0, 2, 32, 0, 0},
    {&kvp__codec_kivi, "bits=2:group=16", KIVI, 0, 0, 0, 2, 16, 0, 0},
    {&kvp__codec_kivi, "bits=4:group=64", KIVI, 0, 0, 0, 4, 64, 0, 0},
    {&kvp__codec_kivi, "bits=4:group=16", KIVI, 0, 0, 0, 4, 16, 0, 0},
    {&kvp__codec_kivi, "bits=2:group=128", KIVI, 0, 0, 0, 2, 128, 0, 0},
    {&kvp__codec_nvfp4, "", NVFP4, 0, 0, 0, 0, 0, 0, 0},
    {&kvp__codec_nvfp4, "rule=4/6", NVFP4, 0, 0, 0, 0, 0, 1, 0},
    {&kvp__codec_nvfp4, "ksmooth=store", NVFP4, 0, 0, 0, 0, 0, 0, 1},
    {&kvp__codec_nvfp4, "rule=4/6:ksmooth=store", NVFP4, 0, 0, 0, 0, 0, 1, 1},
};
#define NCASES ((int)KVP__ARRAY_LEN(cases))

/* An instance of the reference: the case, its geometry, derived fields. */
typedef struct rinst {
  const rcase *c;
  uint32_t d, kv;
  kvp_dtype in;
  uint32_t clip_j; /* int8 */
  float clip_frac; /* int8 */
} rinst;

static rinst rinst_make(const rcase *c, uint32_t d, uint32_t kv, kvp_dtype in) {
  rinst r = {c, d, kv, in, 0, 0.0f};
  if (c->kind == INT8) {
    double p = (double)c->pct / 100.0 * (double)(d - 1);
    r.clip_j = (uint32_t)floor(p);
    r.clip_frac = (float)(p - floor(p));
    if (r.clip_j >= d - 1) r.clip_j = d - 1, r.clip_frac = 0.0f;
  }
  return r;
}

/* The running min and max of the first implementation, acc = fminf(acc,
 * x) and fmaxf(acc, x) as built on x86-64 (gcc passes x first, glibc's
 * MINSS/MAXSS returns the second argument between equals): x replaces acc
 * only when strictly smaller (larger); a NaN x never does. */
static float ref_fminf(float acc, float x) { return x < acc ? x : acc; }
static float ref_fmaxf(float acc, float x) { return x > acc ? x : acc; }

static float ref_round_even(float x) {
  float a = fabsf(x), f = floorf(a), d = a - f;
  if (d > 0.5f || (d == 0.5f && fmodf(f, 2.0f) != 0.0f)) f += 1.0f;
  return copysignf(f, x);
}

static void ref_row_to_f32(float *dst, const void *src, kvp_dtype dt, size_t n) {
  const uint8_t *p = src;
  for (size_t i = 0; i < n; i++) {
    uint16_t h;
    if (dt == KVP_DTYPE_F32) {
      memcpy(&dst[i], p + 4 * i, 4);
      continue;
    }
    memcpy(&h, p + 2 * i, 2);
    dst[i] = dt == KVP_DTYPE_BF16 ? kvp__bf16_to_f32(h) : kvp__f16_to_f32(h);
  }
}

static void ref_row_from_f32(void *dst, kvp_dtype dt, const float *src, size_t n) {
  uint8_t *p = dst;
  for (size_t i = 0; i < n; i++) {
    if (dt == KVP_DTYPE_F32) {
      memcpy(p + 4 * i, &src[i], 4);
      continue;
    }
    uint16_t h = dt == KVP_DTYPE_BF16 ? kvp__bf16_from_f32(src[i]) : kvp__f16_from_f32(src[i]);
    memcpy(p + 2 * i, &h, 2);
  }
}

/* Stream bit k = bit k % 8 of byte k / 8; code i at bits [b i, b i + b). */
static void ref_lsb_pack(uint8_t *dst, size_t nbytes, const uint8_t *codes, size_t n, unsigned bits) {
  memset(dst, 0, nbytes);
  for (size_t i = 0; i < n; i++)
    for (unsigned b = 0; b < bits; b++)
      if (codes[i] >> b & 1u) dst[(i * bits + b) / 8] |= (uint8_t)(1u << (i * bits + b) % 8);
}

static void ref_lsb_unpack(uint8_t *codes, const uint8_t *src, size_t n, unsigned bits) {
  for (size_t i = 0; i < n; i++) {
    codes[i] = 0;
    for (unsigned b = 0; b < bits; b++) codes[i] |= (uint8_t)((src[(i * bits + b) / 8] >> (i * bits + b) % 8 & 1u) << b);
  }
}

static void ref_st16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)v, p[1] = (uint8_t)(v >> 8); }
static uint16_t ref_ld16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static void ref_st32f(uint8_t *p, float x) {
  uint32_t u = bits_of(x);
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(u >> 8 * i);
}
static float ref_ld32f(const uint8_t *p) {
  return float_of((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

/* ---- fp8 ---- */

static int ref_fp8_encode(const rinst *r, const void *src, size_t stride, uint32_t n, uint32_t cap, uint8_t **pg) {
  uint32_t d = r->d;
  uint8_t *codes = pg[0], *scales = r->c->dynamic ? pg[1] : NULL;
  float x[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < n; t++) {
    ref_row_to_f32(x, (const uint8_t *)src + (size_t)t * stride, r->in, d);
    float s = r->c->static_scale;
    if (r->c->dynamic) {
      float amax = 0.0f;
      for (uint32_t i = 0; i < d; i++) amax = ref_fmaxf(amax, fabsf(x[i]));
      s = amax == 0.0f ? 0.0f : ref_fmaxf(amax / KVP__FP8_E4M3_MAX, FLT_MIN);
    }
    if (scales) ref_st32f(scales + (size_t)t * 4, s);
    for (uint32_t i = 0; i < d; i++) codes[(size_t)t * d + i] = s == 0.0f ? 0 : kvp__fp8_e4m3_from_f32(x[i] / s);
  }
  memset(codes + (size_t)n * d, 0, (size_t)(cap - n) * d);
  if (scales) memset(scales + (size_t)n * 4, 0, (size_t)(cap - n) * 4);
  return KVP_OK;
}

static void ref_fp8_decode(const rinst *r, uint8_t *const *pg, uint32_t t0, uint32_t m, void *dst, size_t stride,
                           kvp_dtype out) {
  uint32_t d = r->d;
  float x[KVP_MAX_HEAD_DIM];
  for (uint32_t k = 0; k < m; k++) {
    uint32_t t = t0 + k;
    float s = r->c->dynamic ? ref_ld32f(pg[1] + (size_t)t * 4) : r->c->static_scale;
    for (uint32_t i = 0; i < d; i++) x[i] = kvp__fp8_e4m3_to_f32(pg[0][(size_t)t * d + i]) * s;
    ref_row_from_f32((uint8_t *)dst + (size_t)k * stride, out, x, d);
  }
}

/* ---- int8 ---- */

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

static float ref_int8_clip(const rinst *r, const float *x) {
  uint32_t d = r->d;
  float amax = 0.0f, a[KVP_MAX_HEAD_DIM];
  for (uint32_t i = 0; i < d; i++) amax = ref_fmaxf(amax, fabsf(x[i]));
  if (r->c->pct >= 100.0f || amax == 0.0f) return amax;
  for (uint32_t i = 0; i < d; i++) a[i] = fabsf(x[i]);
  qsort(a, d, sizeof *a, cmp_float);
  float c = a[r->clip_j];
  if (r->clip_frac > 0.0f) c += (a[r->clip_j + 1] - c) * r->clip_frac;
  return c > 0.0f ? c : amax;
}

static int ref_int8_encode(const rinst *r, const void *src, size_t stride, uint32_t n, uint32_t cap, uint8_t **pg) {
  uint32_t d = r->d;
  float x[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < n; t++) {
    ref_row_to_f32(x, (const uint8_t *)src + (size_t)t * stride, r->in, d);
    float c = ref_int8_clip(r, x);
    uint16_t sb = 0;
    int8_t *q = (int8_t *)pg[0] + (size_t)t * d;
    if (c == 0.0f) {
      memset(q, 0, d);
    } else {
      float v = c / 127.0f;
      sb = kvp__bf16_from_f32(v);
      if (kvp__bf16_to_f32(sb) < v) sb++;
      float s = kvp__bf16_to_f32(sb);
      for (uint32_t i = 0; i < d; i++) {
        float y = ref_round_even(x[i] / s);
        q[i] = (int8_t)(y > 127.0f ? 127 : y < -127.0f ? -127 : (int)y);
      }
    }
    ref_st16(pg[1] + (size_t)t * 2, sb);
  }
  memset(pg[0] + (size_t)n * d, 0, (size_t)(cap - n) * d);
  memset(pg[1] + (size_t)n * 2, 0, (size_t)(cap - n) * 2);
  return KVP_OK;
}

static void ref_int8_decode(const rinst *r, uint8_t *const *pg, uint32_t t0, uint32_t m, void *dst, size_t stride,
                            kvp_dtype out) {
  uint32_t d = r->d;
  float x[KVP_MAX_HEAD_DIM];
  for (uint32_t k = 0; k < m; k++) {
    uint32_t t = t0 + k;
    float s = kvp__bf16_to_f32(ref_ld16(pg[1] + (size_t)t * 2));
    for (uint32_t i = 0; i < d; i++) x[i] = (float)(int8_t)pg[0][(size_t)t * d + i] * s;
    ref_row_from_f32((uint8_t *)dst + (size_t)k * stride, out, x, d);
  }
}

/* ---- kivi ---- */

typedef struct ref_kq {
  uint16_t s_code, m_code;
  float s, m;
} ref_kq;

static uint16_t ref_f16_down(float x) {
  uint16_t h = kvp__f16_from_f32(x);
  if (kvp__f16_to_f32(h) > x) h = (h & 0x8000u) ? (uint16_t)(h + 1) : h ? (uint16_t)(h - 1) : 0x8001u;
  return h;
}
static uint16_t ref_f16_up(float x) {
  uint16_t h = kvp__f16_from_f32(x);
  if (kvp__f16_to_f32(h) < x) h = (h & 0x8000u) ? (h == 0x8000u ? 1u : (uint16_t)(h - 1)) : (uint16_t)(h + 1);
  return h;
}

static ref_kq ref_kivi_params(float lo, float hi, unsigned bits) {
  ref_kq g;
  double q = (double)((1u << bits) - 1);
  g.m_code = ref_f16_down(lo);
  g.m = kvp__f16_to_f32(g.m_code);
  double range = (double)hi - (double)g.m;
  g.s_code = range > 0.0 ? ref_f16_up((float)(range / q)) : 0;
  while ((double)g.m + q * (double)kvp__f16_to_f32(g.s_code) < (double)hi) g.s_code++;
  g.s = kvp__f16_to_f32(g.s_code);
  return g;
}

static uint8_t ref_kivi_code(float x, const ref_kq *g, unsigned bits) {
  if (g->s == 0.0f) return 0;
  float v = ref_round_even((x - g->m) / g->s), top = (float)((1u << bits) - 1);
  return (uint8_t)(v < 0.0f ? 0.0f : v > top ? top : v);
}

static ref_kq ref_kivi_get(const uint8_t *rec) {
  ref_kq g = {ref_ld16(rec), ref_ld16(rec + 2), 0, 0};
  g.s = kvp__f16_to_f32(g.s_code);
  g.m = kvp__f16_to_f32(g.m_code);
  return g;
}

static void ref_kivi_put(uint8_t *rec, const ref_kq *g) {
  ref_st16(rec, g->s_code);
  ref_st16(rec + 2, g->m_code);
}

static int ref_kivi_range(uint32_t t, uint32_t i, float x) {
  return kvp__err(KVP_ECODEC, "kivi: token %u channel %u: %g is beyond the fp16 range of the scale and min", t, i,
                  (double)x);
}

static int ref_kivi_encode(const rinst *r, const void *src, size_t stride, uint32_t n, uint32_t cap, uint8_t **pg) {
  uint32_t d = r->d, gs = r->c->group, bits = r->c->bits, rb = d * bits / 8;
  uint8_t *codes = pg[0], *scales = pg[1], q[KVP_MAX_HEAD_DIM];
  float x[KVP_MAX_HEAD_DIM], lo[KVP_MAX_HEAD_DIM], hi[KVP_MAX_HEAD_DIM];
  size_t sbytes = r->kv == 0 ? (size_t)(cap + gs - 1) / gs * 4 * d : (size_t)cap * 4 * (d / gs);
  memset(codes + (size_t)n * rb, 0, (size_t)(cap - n) * rb);
  memset(scales, 0, sbytes);
  const uint8_t *s8 = src;
  if (r->kv == 0) {
    for (uint32_t r0 = 0; r0 < n; r0 += gs) {
      uint32_t r1 = n - r0 < gs ? n : r0 + gs;
      uint8_t *rec = scales + (size_t)(r0 / gs) * 4 * d;
      for (uint32_t t = r0; t < r1; t++) {
        ref_row_to_f32(x, s8 + (size_t)t * stride, r->in, d);
        for (uint32_t i = 0; i < d; i++) {
          if (!(fabsf(x[i]) <= 65504.0f)) return ref_kivi_range(t, i, x[i]);
          lo[i] = t == r0 ? x[i] : ref_fminf(lo[i], x[i]);
          hi[i] = t == r0 ? x[i] : ref_fmaxf(hi[i], x[i]);
        }
      }
      for (uint32_t i = 0; i < d; i++) {
        ref_kq g = ref_kivi_params(lo[i], hi[i], bits);
        ref_kivi_put(rec + (size_t)i * 4, &g);
      }
      for (uint32_t t = r0; t < r1; t++) {
        ref_row_to_f32(x, s8 + (size_t)t * stride, r->in, d);
        for (uint32_t i = 0; i < d; i++) {
          ref_kq g = ref_kivi_get(rec + (size_t)i * 4);
          q[i] = ref_kivi_code(x[i], &g, bits);
        }
        ref_lsb_pack(codes + (size_t)t * rb, rb, q, d, bits);
      }
    }
    return KVP_OK;
  }
  uint32_t ng = d / gs;
  for (uint32_t t = 0; t < n; t++) {
    ref_row_to_f32(x, s8 + (size_t)t * stride, r->in, d);
    for (uint32_t j = 0; j < ng; j++) {
      const float *xg = x + (size_t)j * gs;
      float l = xg[0], h = xg[0];
      for (uint32_t i = 0; i < gs; i++) {
        if (!(fabsf(xg[i]) <= 65504.0f)) return ref_kivi_range(t, j * gs + i, xg[i]);
        l = ref_fminf(l, xg[i]);
        h = ref_fmaxf(h, xg[i]);
      }
      ref_kq g = ref_kivi_params(l, h, bits);
      ref_kivi_put(scales + ((size_t)t * ng + j) * 4, &g);
      for (uint32_t i = 0; i < gs; i++) q[j * gs + i] = ref_kivi_code(xg[i], &g, bits);
    }
    ref_lsb_pack(codes + (size_t)t * rb, rb, q, d, bits);
  }
  return KVP_OK;
}

static void ref_kivi_decode(const rinst *r, uint8_t *const *pg, uint32_t t0, uint32_t m, void *dst, size_t stride,
                            kvp_dtype out) {
  uint32_t d = r->d, gs = r->c->group, bits = r->c->bits, rb = d * bits / 8;
  float x[KVP_MAX_HEAD_DIM];
  uint8_t q[KVP_MAX_HEAD_DIM];
  for (uint32_t k = 0; k < m; k++) {
    uint32_t t = t0 + k;
    ref_lsb_unpack(q, pg[0] + (size_t)t * rb, d, bits);
    const uint8_t *rec = r->kv == 0 ? pg[1] + (size_t)(t / gs) * 4 * d : pg[1] + (size_t)t * 4 * (d / gs);
    for (uint32_t i = 0; i < d; i++) {
      ref_kq g = ref_kivi_get(rec + (size_t)(r->kv == 0 ? i : i / gs) * 4);
      x[i] = (float)q[i] * g.s + g.m;
    }
    ref_row_from_f32((uint8_t *)dst + (size_t)k * stride, out, x, d);
  }
}

/* ---- nvfp4 ---- */

static uint8_t ref_nvfp4_scale(float a, float target) {
  float t = a / target;
  uint8_t c = kvp__fp8_e4m3_from_f32(t);
  if (kvp__fp8_e4m3_to_f32(c) >= 0.015625f) return c;
  float k = ceilf(t * 512.0f);
  return (uint8_t)(k < 1.0f ? 1 : k > 8.0f ? 8 : k);
}

static double ref_nvfp4_quant(const float *u, const float *x, float g, uint8_t sc, uint8_t *q) {
  float s = kvp__fp8_e4m3_to_f32(sc);
  double err = 0.0;
  for (uint32_t i = 0; i < 16; i++) {
    q[i] = kvp__e2m1_from_f32(u[i] / s);
    double e = (double)x[i] - (double)(kvp__e2m1_to_f32(q[i]) * s * g);
    err += e * e;
  }
  return err;
}

static uint8_t ref_nvfp4_block(const rinst *r, const float *x, float g, uint8_t *q) {
  float u[16], a = 0.0f;
  for (uint32_t i = 0; i < 16; i++) {
    u[i] = x[i] / g;
    a = ref_fmaxf(a, fabsf(u[i]));
  }
  if (a == 0.0f) {
    memset(q, 0, 16);
    return 0;
  }
  uint8_t sc6 = ref_nvfp4_scale(a, 6.0f), q4[16];
  double e6 = ref_nvfp4_quant(u, x, g, sc6, q);
  if (!r->c->rule46) return sc6;
  uint8_t sc4 = ref_nvfp4_scale(a, 4.0f);
  if (sc4 == sc6) return sc6;
  double e4 = ref_nvfp4_quant(u, x, g, sc4, q4);
  if (!(e4 < e6)) return sc6;
  memcpy(q, q4, 16);
  return sc4;
}

static void ref_nvfp4_row(const rinst *r, const void *src, size_t stride, uint32_t t, uint8_t *means, int store,
                          float *x) {
  uint32_t d = r->d;
  ref_row_to_f32(x, (const uint8_t *)src + (size_t)t * stride, r->in, d);
  if (!r->c->ksmooth) return;
  if (store) {
    double sum = 0.0;
    for (uint32_t i = 0; i < d; i++) sum += (double)x[i];
    ref_st16(means + (size_t)t * 2, kvp__bf16_from_f32((float)(sum / d)));
  }
  float mean = kvp__bf16_to_f32(ref_ld16(means + (size_t)t * 2));
  for (uint32_t i = 0; i < d; i++) x[i] -= mean;
}

static int ref_nvfp4_encode(const rinst *r, const void *src, size_t stride, uint32_t n, uint32_t cap, uint8_t **pg) {
  uint32_t d = r->d, nsc = d / 16;
  uint8_t *codes = pg[0], *scales = pg[1], *means = scales + (size_t)cap * nsc, q[KVP_MAX_HEAD_DIM];
  float x[KVP_MAX_HEAD_DIM], amax = 0.0f;
  memset(codes, 0, (size_t)cap * (d / 2));
  memset(scales, 0, (size_t)cap * (nsc + (r->c->ksmooth ? 2u : 0u)));
  for (uint32_t t = 0; t < n; t++) {
    ref_nvfp4_row(r, src, stride, t, means, 1, x);
    for (uint32_t i = 0; i < d; i++) amax = ref_fmaxf(amax, fabsf(x[i]));
  }
  float g = amax == 0.0f ? 0.0f : ref_fmaxf(amax / 2688.0f, FLT_MIN);
  ref_st32f(pg[2], g);
  if (g == 0.0f) return KVP_OK;
  for (uint32_t t = 0; t < n; t++) {
    ref_nvfp4_row(r, src, stride, t, means, 0, x);
    for (uint32_t k = 0; k < nsc; k++) scales[(size_t)t * nsc + k] = ref_nvfp4_block(r, x + k * 16, g, q + k * 16);
    for (uint32_t j = 0; j < d / 2; j++) codes[(size_t)t * (d / 2) + j] = (uint8_t)(q[2 * j] | q[2 * j + 1] << 4);
  }
  return KVP_OK;
}

static void ref_nvfp4_decode(const rinst *r, uint8_t *const *pg, uint32_t cap, uint32_t t0, uint32_t m, void *dst,
                             size_t stride, kvp_dtype out) {
  uint32_t d = r->d, nsc = d / 16;
  const uint8_t *scales = pg[1], *means = scales + (size_t)cap * nsc;
  float g = ref_ld32f(pg[2]), x[KVP_MAX_HEAD_DIM];
  for (uint32_t k = 0; k < m; k++) {
    uint32_t t = t0 + k;
    const uint8_t *c = pg[0] + (size_t)t * (d / 2);
    float mean = r->c->ksmooth ? kvp__bf16_to_f32(ref_ld16(means + (size_t)t * 2)) : 0.0f;
    for (uint32_t b = 0; b < nsc; b++) {
      float s = kvp__fp8_e4m3_to_f32(scales[(size_t)t * nsc + b]);
      for (uint32_t i = b * 16; i < b * 16 + 16; i++) x[i] = kvp__e2m1_to_f32(c[i / 2] >> 4 * (i % 2)) * s * g;
    }
    if (r->c->ksmooth)
      for (uint32_t i = 0; i < d; i++) x[i] += mean;
    ref_row_from_f32((uint8_t *)dst + (size_t)k * stride, out, x, d);
  }
}

static int ref_encode(const rinst *r, const void *src, size_t stride, uint32_t n, uint32_t cap, uint8_t **pg) {
  switch (r->c->kind) {
  case FP8: return ref_fp8_encode(r, src, stride, n, cap, pg);
  case INT8: return ref_int8_encode(r, src, stride, n, cap, pg);
  case KIVI: return ref_kivi_encode(r, src, stride, n, cap, pg);
  default: return ref_nvfp4_encode(r, src, stride, n, cap, pg);
  }
}

static void ref_decode(const rinst *r, uint8_t *const *pg, uint32_t cap, uint32_t t0, uint32_t m, void *dst,
                       size_t stride, kvp_dtype out) {
  switch (r->c->kind) {
  case FP8: ref_fp8_decode(r, pg, t0, m, dst, stride, out); break;
  case INT8: ref_int8_decode(r, pg, t0, m, dst, stride, out); break;
  case KIVI: ref_kivi_decode(r, pg, t0, m, dst, stride, out); break;
  default: ref_nvfp4_decode(r, pg, cap, t0, m, dst, stride, out);
  }
}

/* ==== inputs ============================================================ */

static double t_unit(uint64_t *s) { return (double)(t_rand(s) >> 11) * 0x1p-53; }

static float t_gauss(uint64_t *s) {
  double u = t_unit(s), v = t_unit(s);
  return (float)(sqrt(-2.0 * log(u + 0x1p-60)) * cos(6.283185307179586 * v));
}

enum { P_GAUSS, P_WIDE, P_TINY, P_TIES, P_EDGES, P_ZEROS, P_OFFSET, P_BIG, NPAT };

/* The exact ties of each quantizer's grid, for a row whose scale the
 * pattern pins: fp8 dynamic (amax 448: s = 1) E4M3 midpoints; int8 (amax
 * 127: s = 1) k + 1/2; kivi (range [0, Q] in every group: s = 1, m = 0)
 * k + 1/2; nvfp4 (amax 2688: g = 1; a 16-block holding 6: s = 1) E2M1
 * midpoints. Other codecs see them as plain values. */
static float tie_value(const rcase *c, uint64_t *s, uint32_t t, uint32_t i) {
  static const float e2m1_mid[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  float sg = t_rand(s) & 1 ? -1.0f : 1.0f, half = (float)(t_rand(s) % 8) + 0.5f;
  uint32_t q = (1u << c->bits) - 1;
  switch (c->kind) {
  case FP8:
    if (i == 0) return 448.0f;
    if (t_rand(s) % 4 == 0) return sg * ldexpf(half, -9);            /* subnormal midpoints */
    return sg * ldexpf(8.0f + half, (int)(t_rand(s) % 14) - 9);      /* binades 2^-6 .. 2^7 */
  case INT8: return i == 0 ? 127.0f : sg * ((float)(t_rand(s) % 127) + 0.5f);
  case KIVI:
    if (t % 16 == 0 || i % 7 == 0) return 0.0f;
    if (t % 16 == 1 || i % 7 == 1) return (float)q;
    return (float)(t_rand(s) % q) + 0.5f;
  default:
    if (i == 0) return 2688.0f;
    if (i % 16 == 1) return sg * 6.0f;
    return sg * e2m1_mid[t_rand(s) % 7];
  }
}

/* An f32 value that is an edge of some format: maxima, subnormals, the
 * smallest normals, signed zeros. In range for kivi when kivi is set. */
static float edge_value(uint64_t *s, int kivi) {
  static const float e[] = {0.0f,          -0.0f,          448.0f,        -448.0f,      464.0f,        65504.0f,
                            -65504.0f,     65519.0f,       0x1p-24f,      -0x1p-24f,    0x1p-14f,      0x1.ff8p-15f,
                            0x1p-9f,       0x1p-6f,        0x1.cp-7f,     0x1p-126f,    -0x1p-149f,    0x1.fffffep-127f,
                            0x1p-133f,     6.0f,           -6.0f,         5.0f,         2688.0f,       0x1.fep+127f,
                            -FLT_MAX,      3.4e38f,        1e-40f,        0x1p-10f,     0x1.8p-9f,     0x1p-1f};
  for (;;) {
    float v = e[t_rand(s) % KVP__ARRAY_LEN(e)];
    if (!kivi || fabsf(v) <= 65504.0f) return v;
  }
}

/* n x d values of pattern pat for case c. */
static void gen(const rcase *c, float *x, uint32_t n, uint32_t d, int pat, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 7;
  int kivi = c->kind == KIVI;
  for (uint32_t t = 0; t < n; t++) {
    float off = 4.0f + 16.0f * (float)t_unit(&s);
    for (uint32_t i = 0; i < d; i++) {
      float v = t_gauss(&s), *o = &x[(size_t)t * d + i];
      switch (pat) {
      case P_WIDE: v = ldexpf(v, (int)(t_rand(&s) % 51) - 30); break;
      case P_TINY: v = float_of((uint32_t)(t_rand(&s) & 0x807FFFFFu)); break; /* f32 subnormals */
      case P_TIES: v = tie_value(c, &s, t, i); break;
      case P_EDGES: v = t_rand(&s) % 3 ? edge_value(&s, kivi) : v; break;
      case P_ZEROS: v = t_rand(&s) % 8 ? (t_rand(&s) & 1 ? -0.0f : 0.0f) : ldexpf(v, -20); break;
      case P_OFFSET: v += off; break;
      case P_BIG: v = t_rand(&s) % 97 == 0 ? v * 1e5f : v; break; /* kivi: beyond fp16, an error */
      default: break;
      }
      *o = v;
    }
  }
}

/* ==== the comparison ===================================================== */

static const kvp_dtype dtypes[] = {KVP_DTYPE_F32, KVP_DTYPE_BF16, KVP_DTYPE_F16};

/* Head dims tried per codec kind (kivi: those its group divides). */
static const uint32_t fp8_dims[] = {1, 3, 16, 17, 64, 100, 128, 129, 256};
static const uint32_t kivi_dims[] = {16, 32, 64, 128, 256};
static const uint32_t nvfp4_dims[] = {16, 48, 128, 256};

typedef struct pages {
  kvp_codec_layout lay;
  uint8_t *pg[KVP_CODEC_MAX_PAGES];
} pages;

static void pages_new(pages *p, const rcase *c, void *inst, uint32_t cap, uint64_t *rng) {
  c->vt->layout(inst, cap, &p->lay);
  for (uint32_t k = 0; k < p->lay.npages; k++) {
    p->pg[k] = malloc(p->lay.bytes[k]);
    ck_assert_ptr_nonnull(p->pg[k]);
    for (uint64_t j = 0; j < p->lay.bytes[k]; j++) p->pg[k][j] = (uint8_t)t_rand(rng);
  }
}

static void pages_free(pages *p) {
  for (uint32_t k = 0; k < p->lay.npages; k++) free(p->pg[k]);
}

/* Equal bits, or (nan_eq) both NaN, for element i of rows a and b of dt. */
static int same_elem(const uint8_t *a, const uint8_t *b, kvp_dtype dt, size_t i, int nan_eq) {
  size_t w = kvp__dtype_bytes(dt);
  if (!memcmp(a + i * w, b + i * w, w)) return 1;
  if (!nan_eq) return 0;
  if (dt == KVP_DTYPE_F32) {
    float x, y;
    memcpy(&x, a + i * 4, 4), memcpy(&y, b + i * 4, 4);
    return isnan(x) && isnan(y);
  }
  uint16_t h, k, inf = dt == KVP_DTYPE_BF16 ? 0x7F80u : 0x7C00u;
  memcpy(&h, a + i * 2, 2), memcpy(&k, b + i * 2, 2);
  return (h & 0x7FFFu) > inf && (k & 0x7FFFu) > inf;
}

/* Decode rows [t0, t0 + m) with the codec and the reference to every out
 * dtype (rows 8 bytes apart beyond their width; the gap must stay). */
static void check_decode(const rcase *c, void *inst, const rinst *r, const pages *p, uint32_t n, uint32_t cap,
                         uint32_t t0, uint32_t m, int nan_eq, const char *what) {
  uint32_t d = r->d;
  for (int di = 0; di < 3; di++) {
    kvp_dtype out = dtypes[di];
    size_t es = kvp__dtype_bytes(out), stride = d * es + 8, bytes = stride * (m ? m : 1);
    uint8_t *got = malloc(bytes), *want = malloc(bytes);
    memset(got, 0xCD, bytes), memset(want, 0xCD, bytes);
    ck_ok(c->vt->decode(inst, (const void *const *)p->pg, n, cap, t0, m, got, stride, out));
    ref_decode(r, (uint8_t *const *)p->pg, cap, t0, m, want, stride, out);
    for (uint32_t k = 0; k < m; k++)
      for (uint32_t i = 0; i < d; i++)
        ck_hot(same_elem(got + k * stride, want + k * stride, out, i, nan_eq),
               "%s:%s D=%u kv=%u in=%d out=%d %s: row %u elem %u differs", c->vt->name, c->params, d, r->kv, r->in,
               out, what, t0 + k, i);
    for (size_t j = 0; j < bytes; j++)
      if (j % stride >= d * es) ck_hot(got[j] == 0xCD, "%s:%s %s: padding byte %zu written", c->vt->name, c->params, what, j);
    free(got), free(want);
  }
}

/* One (case, D, kv, in dtype, pattern, n, cap): encode with both, compare
 * the pages (or the failure), then decode full and partial ranges. */
static void check_one(const rcase *c, uint32_t d, uint32_t kv, kvp_dtype in, int pat, uint32_t n, uint32_t cap,
                      uint64_t seed) {
  kvp_codec_geom geom = {.head_dim = d, .in_dtype = in, .layer = 0, .kv = kv};
  char err[256] = "";
  size_t at = 0;
  void *inst = NULL;
  ck_assert_msg(c->vt->create(c->params, &geom, &inst, err, sizeof err, &at) == KVP_OK, "%s", err);
  rinst r = rinst_make(c, d, kv, in);
  uint64_t rng = seed ^ 0x5851F42D4C957F2DULL;
  float *x = malloc((size_t)cap * d * sizeof *x);
  gen(c, x, cap, d, pat, seed);
  float fmax_in = in == KVP_DTYPE_F16 ? 65504.0f : in == KVP_DTYPE_BF16 ? 0x1.fep127f : FLT_MAX;
  for (size_t j = 0; j < (size_t)cap * d; j++)
    if (fabsf(x[j]) > fmax_in) x[j] = copysignf(fmax_in, x[j]); /* finite in the in dtype */
  size_t es = kvp__dtype_bytes(in), stride = d * es + 4 * (seed % 3); /* rows sometimes apart */
  uint8_t *src = calloc(cap, stride);
  for (uint32_t t = 0; t < cap; t++) kvp__row_from_f32(src + t * stride, in, x + (size_t)t * d, d);
  pages got, want;
  pages_new(&got, c, inst, cap, &rng);
  pages_new(&want, c, inst, cap, &rng);
  int rc_want = ref_encode(&r, src, stride, n, cap, want.pg);
  char msg_want[256];
  snprintf(msg_want, sizeof msg_want, "%s", rc_want ? kvp_last_error() : "");
  int rc_got = c->vt->encode(inst, src, stride, n, cap, (void *const *)got.pg);
  ck_assert_msg(rc_got == rc_want, "%s:%s D=%u kv=%u in=%d pat=%d n=%u: encode %d, reference %d", c->vt->name,
                c->params, d, kv, in, pat, n, rc_got, rc_want);
  if (rc_want) {
    ck_assert_str_eq(kvp_last_error(), msg_want);
  } else {
    for (uint32_t k = 0; k < got.lay.npages; k++)
      for (uint64_t j = 0; j < got.lay.bytes[k]; j++)
        ck_hot(got.pg[k][j] == want.pg[k][j], "%s:%s D=%u kv=%u in=%d pat=%d n=%u: page %u byte %llu: %02x, reference %02x",
               c->vt->name, c->params, d, kv, in, pat, n, k, (unsigned long long)j, got.pg[k][j], want.pg[k][j]);
    check_decode(c, inst, &r, &got, n, cap, 0, n, 0, "full");
    uint32_t t0 = (uint32_t)(t_rand(&rng) % (n + 1)), m = (uint32_t)(t_rand(&rng) % (n - t0 + 1));
    check_decode(c, inst, &r, &got, n, cap, t0, m, 0, "part");
  }
  pages_free(&got), pages_free(&want);
  free(src), free(x);
  c->vt->destroy(inst);
}

static void case_dims(const rcase *c, const uint32_t **dims, size_t *ndims) {
  if (c->kind == KIVI) *dims = kivi_dims, *ndims = KVP__ARRAY_LEN(kivi_dims);
  else if (c->kind == NVFP4) *dims = nvfp4_dims, *ndims = KVP__ARRAY_LEN(nvfp4_dims);
  else *dims = fp8_dims, *ndims = KVP__ARRAY_LEN(fp8_dims);
}

/* Loop index i -> the case, after running the kernels of ISA i / NCASES;
 * 0 when this CPU lacks that ISA (the test then has nothing to run). */
static const rcase *isa_case(int i) {
  int isa = i / NCASES;
  if (kvp__codec_isa_set(isa) != isa) {
    fprintf(stderr, "codecs_ref: skip ISA %d: not on this CPU\n", isa);
    return NULL;
  }
  return &cases[i % NCASES];
}

/* Every case: dims x kv x in dtype x pattern, n = cap and n < cap. */
START_TEST(encode_decode_match) {
  const rcase *c = isa_case(_i);
  if (!c) return;
  const uint32_t *dims;
  size_t ndims;
  case_dims(c, &dims, &ndims);
  uint64_t seed = 1 + (uint64_t)(_i % NCASES) * 1000;
  for (size_t di = 0; di < ndims; di++) {
    if (c->kind == KIVI && dims[di] % c->group) continue;
    for (uint32_t kv = 0; kv < 2; kv++)
      for (int in = 0; in < 3; in++)
        for (int pat = 0; pat < NPAT; pat++) {
          uint32_t cap = 64, n = (uint32_t)(seed % 3 == 0 ? cap : 1 + seed % cap);
          check_one(c, dims[di], kv, dtypes[in], pat, n, cap, seed++);
        }
  }
}
END_TEST

/* A K group of kivi whose least value is a zero of both signs: the min's
 * sign, hence the fp16 min code, follows the order of the rows. */
START_TEST(kivi_signed_zero_min) {
  const rcase *c = isa_case(_i * NCASES + 7);
  if (!c) return;
  for (int order = 0; order < 4; order++) {
    kvp_codec_geom geom = {.head_dim = 32, .in_dtype = KVP_DTYPE_F32, .layer = 0, .kv = 0};
    void *inst;
    ck_ok(c->vt->create(c->params, &geom, &inst, NULL, 0, NULL));
    rinst r = rinst_make(c, 32, 0, KVP_DTYPE_F32);
    float x[32 * 32];
    for (int i = 0; i < 32 * 32; i++) x[i] = (float)(i % 5);
    for (int t = 0; t < 32; t++) x[t * 32 + 3] = ((t + order) & 1) ? -0.0f : 0.0f; /* channel 3: zeros */
    for (int t = 0; t < 32; t++) x[t * 32 + 4] = t == order ? -0.0f : t == 31 - order ? 0.0f : 1.0f;
    uint64_t rng = 3;
    pages got, want;
    pages_new(&got, c, inst, 32, &rng);
    pages_new(&want, c, inst, 32, &rng);
    ck_ok(c->vt->encode(inst, x, 32 * 4, 32, 32, (void *const *)got.pg));
    ck_ok(ref_encode(&r, x, 32 * 4, 32, 32, want.pg));
    for (uint32_t k = 0; k < got.lay.npages; k++) ck_assert_mem_eq(got.pg[k], want.pg[k], got.lay.bytes[k]);
    pages_free(&got), pages_free(&want);
    c->vt->destroy(inst);
  }
}
END_TEST

/* nvfp4's ksmooth mean sums a row in double in index order. A row where
 * order matters: 2^60 + 1 rounds to 2^60 in order, and -2^60 (32 elements
 * later, in the same lane of a 32-lane sum) cancels it: in order the sum
 * is 0, by lanes 1. The library may sum by lanes only where every partial
 * sum is exact; here it must not, and the stored mean must be 0. */
START_TEST(nvfp4_mean_order) {
  const rcase *c = isa_case(_i * NCASES + 14);
  if (!c) return;
  enum { D = 64 };
  float x[2 * D] = {0};
  x[0] = 0x1p60f, x[1] = 1.0f, x[32] = -0x1p60f;                 /* row 0: order matters */
  for (int i = 0; i < D; i++) x[D + i] = ldexpf(1.0f + (float)i, (i % 24) - 12); /* row 1: exact either way */
  kvp_codec_geom geom = {.head_dim = D, .in_dtype = KVP_DTYPE_F32, .layer = 0, .kv = 0};
  void *inst;
  ck_ok(c->vt->create(c->params, &geom, &inst, NULL, 0, NULL));
  rinst r = rinst_make(c, D, 0, KVP_DTYPE_F32);
  uint64_t rng = 5;
  pages got, want;
  pages_new(&got, c, inst, 2, &rng);
  pages_new(&want, c, inst, 2, &rng);
  ck_ok(c->vt->encode(inst, x, D * 4, 2, 2, (void *const *)got.pg));
  ck_ok(ref_encode(&r, x, D * 4, 2, 2, want.pg));
  const uint8_t *mean0 = want.pg[1] + 2 * (D / 16);
  ck_assert_uint_eq(ref_ld16(mean0), 0); /* the reference's in-order sum */
  for (uint32_t k = 0; k < got.lay.npages; k++) ck_assert_mem_eq(got.pg[k], want.pg[k], got.lay.bytes[k]);
  pages_free(&got), pages_free(&want);
  c->vt->destroy(inst);
}
END_TEST

/* Pages of random bytes decode alike (two NaNs compare equal). */
START_TEST(garbage_pages_decode_alike) {
  const rcase *c = isa_case(_i);
  if (!c) return;
  const uint32_t *dims;
  size_t ndims;
  case_dims(c, &dims, &ndims);
  uint64_t rng = 77 + (uint64_t)(_i % NCASES);
  for (size_t di = 0; di < ndims; di++) {
    if (c->kind == KIVI && dims[di] % c->group) continue;
    for (uint32_t kv = 0; kv < 2; kv++) {
      kvp_codec_geom geom = {.head_dim = dims[di], .in_dtype = KVP_DTYPE_BF16, .layer = 0, .kv = kv};
      void *inst;
      ck_ok(c->vt->create(c->params, &geom, &inst, NULL, 0, NULL));
      rinst r = rinst_make(c, dims[di], kv, KVP_DTYPE_BF16);
      for (int trial = 0; trial < 4; trial++) {
        uint32_t cap = 64, n = trial ? (uint32_t)(1 + t_rand(&rng) % cap) : cap;
        pages p;
        pages_new(&p, c, inst, cap, &rng);
        if (trial == 3 && c->kind == NVFP4) memcpy(p.pg[2], (const uint8_t[]){0, 0, 0x80, 0x3F}, 4); /* g = 1 */
        check_decode(c, inst, &r, &p, n, cap, 0, n, 1, "garbage");
        pages_free(&p);
      }
      c->vt->destroy(inst);
    }
  }
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("codecs_ref");
  TCase *tc = tcase_create("match");
  tcase_set_timeout(tc, 300);
  tcase_add_loop_test(tc, encode_decode_match, 0, 2 * NCASES);
  tcase_add_loop_test(tc, kivi_signed_zero_min, 0, 2);
  tcase_add_loop_test(tc, nvfp4_mean_order, 0, 2);
  tcase_add_loop_test(tc, garbage_pages_decode_alike, 0, 2 * NCASES);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return t_run(suite()); }
