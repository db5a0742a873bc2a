/*
 * codecs/fp8.c - the fp8 codec: every element an FP8 E4M3 code ("fn": max
 * 448, no infinities; codecs/numeric.h), scaled either per token-head by a
 * dynamic fp32 scale, or by one static per-tensor scale.
 *
 * Params (spec "fp8", "fp8:scale=dynamic", "fp8:scale=0.05"):
 *   scale=dynamic  (default) s_t = absmax_t / 448 per token-head, stored
 *   scale=<float>  static s (finite, > 0) for every token; nothing stored
 *
 * Pages of a block of cap tokens, head dim D (token t = row t of the block):
 *
 *   CODES   cap x D bytes          | t0: c0 c1 .. c(D-1) | t1: ... |
 *           byte t*D + i = E4M3 code of element i of token t
 *   SCALES  cap x 4 bytes          | s_0 | s_1 | ... | s_(cap-1) |
 *           (dynamic only)         s_t: IEEE fp32, little-endian
 *
 *   layout: dynamic  CODES = cap*D, SCALES = 4*cap  (D + 4 per token-head)
 *           static   CODES = cap*D                  (D per token-head)
 *   At D = 128: 132 B (dynamic) or 128 B (static) per token-head.
 *
 * Encode (all f32): y_i = x_i / s, code_i = E4M3(y_i), round to nearest
 * even, saturating at +-448. Decode: x^_i = E4M3value(code_i) * s.
 *
 * Invariants:
 *   dynamic: |y_i| <= 448 (s from absmax), so |x_i - x^_i| <= ulp(y_i)/2 * s
 *            up to f32 rounding, where ulp(y) is the E4M3 step at |y|
 *            (2^(e-3) for |y| in [2^e, 2^(e+1)), e >= -6; 2^-9 below 2^-6).
 *            Scaling a token by 2^k scales s by 2^k and leaves the codes:
 *            the output scales by exactly 2^k (while s stays normal).
 *   static:  values beyond 448 s saturate to +-448 s.
 *   A token of zeros (dynamic) has s = 0 and codes 0: it decodes to zeros.
 *   Scale underflow: when absmax / 448 is below FLT_MIN (2^-126), s is
 *   FLT_MIN; the codes then stay below 448 and lose relative precision,
 *   never becoming inf or NaN.
 *   Rows n..cap-1 of a block are written as zeros (codes and scales).
 */
#include "builtin.h"
#include "kernels.h"

#include <float.h>

/* A binding of fp8. */
typedef struct fp8_inst {
  uint32_t head_dim;  /* D, elements per token */
  kvp_dtype in_dtype; /* dtype of appended rows */
  int dynamic;        /* 1: per token-head scale in SCALES; 0: static */
  float static_scale; /* static: the divisor of every value */
} fp8_inst;

static const char *const fp8_keys[] = {"scale"};

static int fp8_parse(fp8_inst *f, const char *params, char *err, size_t errcap, size_t *err_at) {
  size_t pos = 0;
  unsigned seen = 0;
  kvp__param p;
  int r;
  while ((r = kvp__param_next("fp8", params, &pos, fp8_keys, 1, &seen, &p, err, errcap, err_at)) == 1) {
    if (kvp__param_is(&p, "dynamic")) continue;
    if (!kvp__param_f32(&p, &f->static_scale) || !(f->static_scale > 0.0f))
      return kvp__param_fail(err, errcap, err_at, p.at, "fp8: scale=%.*s: want 'dynamic' or a finite float > 0",
                             (int)p.val_len, p.val);
    f->dynamic = 0;
  }
  return r;
}

static int fp8_create(const char *params, const kvp_codec_geom *geom, void **inst, char *err, size_t errcap,
                      size_t *err_at) {
  int rc = kvp__codec_geom_ok("fp8", geom, err, errcap);
  if (rc) return rc;
  fp8_inst f = {.head_dim = geom->head_dim, .in_dtype = geom->in_dtype, .dynamic = 1, .static_scale = 1.0f};
  if ((rc = fp8_parse(&f, params, err, errcap, err_at))) return rc;
  fp8_inst *out = malloc(sizeof *out);
  if (!out) return kvp__param_fail(err, errcap, NULL, 0, "fp8: out of memory");
  *out = f;
  *inst = out;
  return KVP_OK;
}

static void fp8_destroy(void *inst) { free(inst); }

static uint32_t fp8_group_tokens(const void *inst) {
  (void)inst;
  return 1;
}

static void fp8_layout(const void *inst, uint32_t cap_tokens, kvp_codec_layout *out) {
  const fp8_inst *f = inst;
  memset(out, 0, sizeof *out);
  out->npages = f->dynamic ? 2 : 1;
  out->types[0] = KVP_PAGE_CODES;
  out->bytes[0] = (uint64_t)cap_tokens * f->head_dim;
  if (f->dynamic) {
    out->types[1] = KVP_PAGE_SCALES;
    out->bytes[1] = (uint64_t)cap_tokens * 4;
  }
}

/* ---- row kernels --------------------------------------------------------
 * One pass each way over a token, KVP__FOR_CHUNKS (codecs/kernels.h):
 * encode divides and rounds with the branch-free E4M3 form, decode widens,
 * scales and (bf16 out) rounds in the same pass; the same f32 operations,
 * in the same order, as the definitions in the banner. */

KVP__INLINE void enc_n(uint32_t *restrict q, const float *restrict x, float s, size_t n) {
  for (size_t i = 0; i < n; i++) q[i] = kvp__fp8_e4m3_from_f32_bf(x[i] / s);
}

/* The E4M3 code of a y that is not NaN and is zero or at least 2^-6 in
 * magnitude: the normal-range formula alone, zero by mask. */
KVP__INLINE uint32_t fp8_enc_plain(float y) {
  uint32_t u = kvp__f32_bits(y), a = u & 0x7FFFFFFFu;
  uint32_t nrm = ((a + 0x7FFFFu + (a >> 20 & 1u)) >> 20) - (120u << 3);
  nrm = nrm < 0x7Eu ? nrm : 0x7Eu;
  return (nrm & kvp__mask(a != 0)) | (u >> 24 & 0x80u);
}

KVP__INLINE void enc_plain_n(uint32_t *restrict q, const float *restrict x, float s, size_t n) {
  for (size_t i = 0; i < n; i++) q[i] = fp8_enc_plain(x[i] / s);
}

/* Lanes of the largest magnitude bits (NaN above every number) and of the
 * least nonzero magnitude bits less one (a zero wraps to the top). */
KVP__INLINE void mag_range_n(uint32_t *restrict lo, uint32_t *restrict hi, const float *restrict x, size_t n) {
  for (size_t j = 0; j < n; j++) {
    uint32_t a = kvp__f32_bits(x[j]) & 0x7FFFFFFFu, a1 = a - 1u;
    hi[j] = a > hi[j] ? a : hi[j];
    lo[j] = a1 < lo[j] ? a1 : lo[j];
  }
}

/* A row's magnitude range: *amax_bits, and the least nonzero magnitude
 * less one (UINT32_MAX when all are zero). */
KVP__INLINE uint32_t row_mag_range(const float *x, uint32_t d, uint32_t *amax_bits) {
  uint32_t lo[KVP__CHUNK], hi[KVP__CHUNK], l = UINT32_MAX, h = 0;
  for (size_t j = 0; j < KVP__CHUNK; j++) lo[j] = UINT32_MAX, hi[j] = 0;
#define MR(i, c) mag_range_n(lo, hi, x + (i), (c))
  KVP__FOR_CHUNKS(d, MR);
#undef MR
  for (size_t j = 0; j < KVP__CHUNK; j++) {
    l = lo[j] < l ? lo[j] : l;
    h = hi[j] > h ? hi[j] : h;
  }
  *amax_bits = h;
  return l;
}

KVP__INLINE void dec_n(float *restrict x, const uint8_t *restrict q, float s, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = kvp__fp8_e4m3_to_f32_bf(q[i]) * s;
}

KVP__INLINE void dec_bf16_n(uint16_t *restrict o, const uint8_t *restrict q, float s, size_t n) {
  for (size_t i = 0; i < n; i++) o[i] = kvp__bf16_from_f32_bf(kvp__fp8_e4m3_to_f32_bf(q[i]) * s);
}

/* The E4M3 value of a code that is zero or normal (not subnormal, not
 * NaN): the exponent rebiased, zero by mask. */
KVP__INLINE float fp8_plain(uint8_t c) {
  uint32_t em = c & 0x7Fu, mag = ((em << 20) + (120u << 23)) & kvp__mask(em != 0);
  return kvp__f32_of(mag | (uint32_t)(c & 0x80u) << 24);
}

/* dec_bf16_n for a row of zero or normal codes and a finite s: the
 * products are numbers (inf at worst), so no NaN select either. */
KVP__INLINE void dec_plain_bf16_n(uint16_t *restrict o, const uint8_t *restrict q, float s, size_t n) {
  for (size_t i = 0; i < n; i++) o[i] = kvp__bf16_from_f32_num(fp8_plain(q[i]) * s);
}

/* OR of "subnormal or NaN" over n codes. */
KVP__INLINE uint8_t odd_codes_n(const uint8_t *restrict q, size_t n) {
  uint8_t odd = 0;
  for (size_t i = 0; i < n; i++) {
    uint8_t em = q[i] & 0x7Fu;
    odd |= (uint8_t)((uint8_t)(em - 1u) < 7u) | (uint8_t)(em == 0x7Fu);
  }
  return odd;
}

/* The dynamic scale of a token of absmax amax: amax / 448, at least
 * FLT_MIN, 0 for a token of zeros. */
KVP__INLINE float fp8_token_scale(float amax) {
  if (amax == 0.0f) return 0.0f;
  float s = amax / KVP__FP8_E4M3_MAX;
  return s > FLT_MIN ? s : FLT_MIN;
}

KVP__KERNEL(fp8_enc_rows, (const fp8_inst *f, const unsigned char *src, size_t stride, uint32_t n, uint8_t *codes,
                           uint8_t *scales),
            (f, src, stride, n, codes, scales)) {
  uint32_t d = f->head_dim, w[KVP_MAX_HEAD_DIM];
  float x[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < n; t++) {
    kvp__load_row(x, src + (size_t)t * stride, f->in_dtype, d);
    uint32_t amax_bits, min1 = row_mag_range(x, d, &amax_bits);
    int has_nan = amax_bits > 0x7F800000u;
    /* with no NaN the magnitude bits order as the values: the fmaxf absmax */
    float s = !f->dynamic ? f->static_scale : fp8_token_scale(has_nan ? kvp__absmax(x, d) : kvp__f32_of(amax_bits));
    if (scales) kvp__st_lef32(scales + (size_t)t * 4, s);
    uint8_t *q = codes + (size_t)t * d;
    if (s == 0.0f) {
      memset(q, 0, d);
      continue;
    }
    /* the common row: no NaN, and every nonzero |x / s| >= 2^-6, which the
     * least one tells (x / s is monotone in |x|) */
    if (!has_nan && (min1 == UINT32_MAX || kvp__f32_of(min1 + 1u) / s >= 0x1p-6f)) {
#define ENC(i, c) enc_plain_n(w + (i), x + (i), s, (c))
      KVP__FOR_CHUNKS(d, ENC);
#undef ENC
    } else {
#define ENC(i, c) enc_n(w + (i), x + (i), s, (c))
      KVP__FOR_CHUNKS(d, ENC);
#undef ENC
    }
#define NAR(i, c) kvp__narrow8_n(q + (i), w + (i), (c))
    KVP__FOR_CHUNKS(d, NAR);
#undef NAR
  }
  return KVP_OK;
}

KVP__KERNEL(fp8_dec_rows, (const fp8_inst *f, const uint8_t *codes, const uint8_t *scales, uint32_t t0, uint32_t m,
                           unsigned char *dst, size_t stride, kvp_dtype out),
            (f, codes, scales, t0, m, dst, stride, out)) {
  uint32_t d = f->head_dim;
  float x[KVP_MAX_HEAD_DIM];
  for (uint32_t r = 0; r < m; r++) {
    uint32_t t = t0 + r;
    float s = scales ? kvp__ld_lef32(scales + (size_t)t * 4) : f->static_scale;
    const uint8_t *q = codes + (size_t)t * d;
    if (out == KVP_DTYPE_BF16) {
      uint16_t *o = (uint16_t *)(dst + (size_t)r * stride);
      uint8_t odd = 0;
#define ODD(i, c) odd |= odd_codes_n(q + (i), (c))
      KVP__FOR_CHUNKS(d, ODD);
#undef ODD
      if (!odd && kvp__finite(s)) { /* the common row */
#define DEC(i, c) dec_plain_bf16_n(o + (i), q + (i), s, (c))
        KVP__FOR_CHUNKS(d, DEC);
#undef DEC
        continue;
      }
#define DEC(i, c) dec_bf16_n(o + (i), q + (i), s, (c))
      KVP__FOR_CHUNKS(d, DEC);
#undef DEC
      continue;
    }
#define DEC(i, c) dec_n(x + (i), q + (i), s, (c))
    KVP__FOR_CHUNKS(d, DEC);
#undef DEC
    kvp__store_row(dst + (size_t)r * stride, out, x, d);
  }
  return KVP_OK;
}

static int fp8_encode(const void *inst, const void *src, size_t src_stride, uint32_t n, uint32_t cap_tokens,
                      void *const *pages) {
  const fp8_inst *f = inst;
  int rc = kvp__codec_rows_ok("fp8", n, cap_tokens, 0, n);
  if (rc) return rc;
  uint32_t d = f->head_dim;
  uint8_t *codes = pages[0], *scales = f->dynamic ? pages[1] : NULL;
  fp8_enc_rows(f, src, src_stride, n, codes, scales);
  memset(codes + (size_t)n * d, 0, (size_t)(cap_tokens - n) * d);
  if (scales) memset(scales + (size_t)n * 4, 0, (size_t)(cap_tokens - n) * 4);
  return KVP_OK;
}

static int fp8_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap_tokens, uint32_t t0,
                      uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const fp8_inst *f = inst;
  int rc = kvp__codec_rows_ok("fp8", n, cap_tokens, t0, m);
  if (rc) return rc;
  return fp8_dec_rows(f, pages[0], f->dynamic ? pages[1] : NULL, t0, m, dst, dst_stride, out);
}

#ifdef KVP_HAVE_CUDA
void kvp__fp8_kparams(const void *inst, kvp__kparams *k) {
  const fp8_inst *f = inst;
  memset(k, 0, sizeof *k);
  k->codec = KVP__K_FP8;
  k->head_dim = f->head_dim;
  k->in_dtype = f->in_dtype;
  k->fp8_dynamic = (uint32_t)f->dynamic;
  k->fp8_static_scale = f->static_scale;
}
#endif
/* fp8_encode_dev, fp8_decode_dev: kernels/fp8.cuh through KVP__DEV_OPS (codecs/builtin.h); a
 * built-in fills kvp__NAME_kparams and names itself in kvp__codec_kparams (codecs/device_cuda.c). */
KVP__DEV_OPS(fp8)

const kvp_codec_vtable kvp__codec_fp8 = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "fp8",
    .create = fp8_create,
    .destroy = fp8_destroy,
    .group_tokens = fp8_group_tokens,
    .layout = fp8_layout,
    .encode = fp8_encode,
    .decode = fp8_decode,
    KVP__DEV_VT(fp8)
};
