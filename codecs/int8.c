/*
 * codecs/int8.c - the int8 codec: symmetric int8 per token-head with a
 * bf16 scale, the scale from the absmax or from a percentile of |x| (seed
 * 004's percentile V scales: one outlier does not squash the rest).
 *
 * Params (spec "int8", "int8:pct=99.5"):
 *   pct=<float>  in (0, 100]; default 100 (the absmax). The clip c_t of a
 *                token is the pct-th percentile of its D magnitudes |x_i|,
 *                linear interpolation between order statistics (numpy's
 *                default): sort a_0 <= .. <= a_(D-1), p = pct/100 * (D-1),
 *                j = floor(p), c = a_j + (a_(j+1) - a_j) * (p - j).
 *                A clip of 0 in a token that is not all zeros (most of it
 *                zeros) falls back to the absmax.
 *
 * Pages of a block of cap tokens, head dim D:
 *
 *   CODES   cap x D bytes          | t0: q0 q1 .. q(D-1) | t1: ... |
 *           byte t*D + i = q_i of token t, int8 two's complement, -127..127
 *   SCALES  cap x 2 bytes          | s_0 | s_1 | ... | s_(cap-1) |
 *           s_t: bf16, little-endian (byte 2t = low byte)
 *
 *   layout: CODES = cap*D, SCALES = 2*cap   (D + 2 per token-head;
 *           130 B at D = 128, 1.97x against bf16)
 *
 * Encode (f32): s = bf16 of c/127 rounded UP (toward +inf), so that
 * |x_i| <= c implies |x_i / s| <= 127; q_i = round_even(x_i / s) clamped to
 * [-127, 127]. Decode: x^_i = q_i * s (f32). -128 is never written.
 *
 * Invariants:
 *   |x_i| <= c  =>  |x_i - x^_i| <= s/2 (up to f32 rounding);
 *   |x_i| >  c  =>  x^_i = +-127 s (clipped outliers saturate);
 *   c/127 <= s <= (c/127)(1 + 2^-7) while c/127 is a normal bf16.
 *   Scaling a token by 2^k scales c and s by 2^k and leaves q: the output
 *   scales by exactly 2^k (while s stays normal).
 *   A token of zeros has s = 0 and q = 0 and decodes to zeros.
 *   Scale underflow: rounding up never gives 0 for c > 0; a subnormal s
 *   (c < 127 * 2^-126) keeps |x/s| <= 127 but is coarser than 2^-7.
 *   Rows n..cap-1 of a block are written as zeros.
 */
#include "builtin.h"
#include "kernels.h"

/* A binding of int8. */
typedef struct int8_inst {
  uint32_t head_dim;  /* D, elements per token */
  kvp_dtype in_dtype; /* dtype of appended rows */
  float pct;          /* clip percentile of |x| per token, (0, 100] */
  uint32_t clip_j;    /* floor(p), p = pct/100 (D-1): the lower order statistic */
  float clip_frac;    /* p - floor(p), in [0, 1) */
} int8_inst;

static const char *const int8_keys[] = {"pct"};

static int int8_parse(int8_inst *q, const char *params, char *err, size_t errcap, size_t *err_at) {
  size_t pos = 0;
  unsigned seen = 0;
  kvp__param p;
  int r;
  while ((r = kvp__param_next("int8", params, &pos, int8_keys, 1, &seen, &p, err, errcap, err_at)) == 1) {
    if (!kvp__param_f32(&p, &q->pct) || !(q->pct > 0.0f && q->pct <= 100.0f))
      return kvp__param_fail(err, errcap, err_at, p.at, "int8: pct=%.*s: want a percentile in (0, 100]", (int)p.val_len,
                             p.val);
  }
  return r;
}

static int int8_create(const char *params, const kvp_codec_geom *geom, void **inst, char *err, size_t errcap,
                       size_t *err_at) {
  int rc = kvp__codec_geom_ok("int8", geom, err, errcap);
  if (rc) return rc;
  int8_inst q = {.head_dim = geom->head_dim, .in_dtype = geom->in_dtype, .pct = 100.0f};
  if ((rc = int8_parse(&q, params, err, errcap, err_at))) return rc;
  double p = (double)q.pct / 100.0 * (double)(q.head_dim - 1);
  q.clip_j = (uint32_t)floor(p);
  q.clip_frac = (float)(p - floor(p));
  if (q.clip_j >= q.head_dim - 1) q.clip_j = q.head_dim - 1, q.clip_frac = 0.0f;
  int8_inst *out = malloc(sizeof *out);
  if (!out) return kvp__param_fail(err, errcap, NULL, 0, "int8: out of memory");
  *out = q;
  *inst = out;
  return KVP_OK;
}

static void int8_destroy(void *inst) { free(inst); }

static uint32_t int8_group_tokens(const void *inst) {
  (void)inst;
  return 1;
}

static void int8_layout(const void *inst, uint32_t cap_tokens, kvp_codec_layout *out) {
  const int8_inst *q = inst;
  memset(out, 0, sizeof *out);
  out->npages = 2;
  out->types[0] = KVP_PAGE_CODES;
  out->bytes[0] = (uint64_t)cap_tokens * q->head_dim;
  out->types[1] = KVP_PAGE_SCALES;
  out->bytes[1] = (uint64_t)cap_tokens * 2;
}

/* bf16 code of v >= 0 (finite), rounded toward +inf. */
static uint16_t bf16_round_up(float v) {
  uint16_t h = kvp__bf16_from_f32(v);
  if (kvp__bf16_to_f32(h) < v) h++; /* positive codes grow with their value */
  return h;
}

static int cmp_float(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}

/* The pct-th percentile of |x| (see the banner), or amax (> 0) when it is
 * 0. Only order statistics are read, so any sort gives the same bits. */
static float int8_percentile(const int8_inst *q, const float *x, float amax) {
  uint32_t d = q->head_dim;
  float a[KVP_MAX_HEAD_DIM];
  for (uint32_t i = 0; i < d; i++) a[i] = fabsf(x[i]);
  qsort(a, d, sizeof *a, cmp_float);
  float c = a[q->clip_j];
  if (q->clip_frac > 0.0f) c += (a[q->clip_j + 1] - c) * q->clip_frac;
  return c > 0.0f ? c : amax;
}

/* ---- row kernels --------------------------------------------------------
 * KVP__FOR_CHUNKS (codecs/kernels.h). Encode: y = x / s, then
 * round_even(y) clamped to +-127 as rne(min(|y|, 127)) with y's sign: rne
 * is monotone and fixes 127, so clamping first is the same. Decode: q * s,
 * and (bf16 out) rounded in the same pass. */

KVP__INLINE void enc_n(uint32_t *restrict q, const float *restrict x, float s, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t y = kvp__f32_bits(x[i] / s), a = y & 0x7FFFFFFFu, neg = (uint32_t)((int32_t)y >> 31);
    uint32_t r = kvp__rne_u32(kvp__f32_of(kvp__sel(kvp__mask(a < 0x42FE0000u), a, 0x42FE0000u))); /* min(|y|, 127) */
    q[i] = (r ^ neg) - neg; /* two's complement; the low byte is the code */
  }
}

KVP__INLINE void dec_n(float *restrict x, const int8_t *restrict q, float s, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = (float)q[i] * s;
}

/* num: s is finite, so q * s is never NaN and bf16 needs no NaN select. */
KVP__INLINE void dec_bf16_n(uint16_t *restrict o, const int8_t *restrict q, float s, int num, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float v = (float)q[i] * s;
    o[i] = num ? kvp__bf16_from_f32_num(v) : kvp__bf16_from_f32_bf(v);
  }
}

/* Quantize one token into D codes; returns its bf16 scale code. */
KVP__INLINE uint16_t int8_token(const int8_inst *q, const float *x, uint8_t *codes) {
  uint32_t d = q->head_dim;
  float c = kvp__absmax(x, d);
  if (q->pct < 100.0f && c > 0.0f) c = int8_percentile(q, x, c);
  if (c == 0.0f) {
    memset(codes, 0, d);
    return 0;
  }
  uint16_t sb = bf16_round_up(c / 127.0f);
  float s = kvp__bf16_to_f32(sb);
  uint32_t w[KVP_MAX_HEAD_DIM]; /* codes in 32 bits: see kvp__narrow8_n */
#define ENC(i, k) enc_n(w + (i), x + (i), s, (k))
  KVP__FOR_CHUNKS(d, ENC);
#undef ENC
#define NAR(i, k) kvp__narrow8_n(codes + (i), w + (i), (k))
  KVP__FOR_CHUNKS(d, NAR);
#undef NAR
  return sb;
}

KVP__KERNEL(int8_enc_rows, (const int8_inst *q, const unsigned char *src, size_t stride, uint32_t n, uint8_t *codes,
                            uint8_t *scales),
            (q, src, stride, n, codes, scales)) {
  uint32_t d = q->head_dim;
  float x[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < n; t++) {
    kvp__load_row(x, src + (size_t)t * stride, q->in_dtype, d);
    kvp__st_le16(scales + (size_t)t * 2, int8_token(q, x, codes + (size_t)t * d));
  }
  return KVP_OK;
}

KVP__KERNEL(int8_dec_rows, (const int8_inst *q, const uint8_t *codes, const uint8_t *scales, uint32_t t0, uint32_t m,
                            unsigned char *dst, size_t stride, kvp_dtype out),
            (q, codes, scales, t0, m, dst, stride, out)) {
  uint32_t d = q->head_dim;
  float x[KVP_MAX_HEAD_DIM];
  for (uint32_t r = 0; r < m; r++) {
    uint32_t t = t0 + r;
    float s = kvp__bf16_to_f32_bf(kvp__ld_le16(scales + (size_t)t * 2));
    const int8_t *c = (const int8_t *)codes + (size_t)t * d;
    if (out == KVP_DTYPE_BF16) {
      uint16_t *o = (uint16_t *)(dst + (size_t)r * stride);
      if (kvp__finite(s)) {
#define DEC(i, k) dec_bf16_n(o + (i), c + (i), s, 1, (k))
        KVP__FOR_CHUNKS(d, DEC);
#undef DEC
      } else {
#define DEC(i, k) dec_bf16_n(o + (i), c + (i), s, 0, (k))
        KVP__FOR_CHUNKS(d, DEC);
#undef DEC
      }
      continue;
    }
#define DEC(i, k) dec_n(x + (i), c + (i), s, (k))
    KVP__FOR_CHUNKS(d, DEC);
#undef DEC
    kvp__store_row(dst + (size_t)r * stride, out, x, d);
  }
  return KVP_OK;
}

static int int8_encode(const void *inst, const void *src, size_t src_stride, uint32_t n, uint32_t cap_tokens,
                       void *const *pages) {
  const int8_inst *q = inst;
  int rc = kvp__codec_rows_ok("int8", n, cap_tokens, 0, n);
  if (rc) return rc;
  uint32_t d = q->head_dim;
  uint8_t *codes = pages[0], *scales = pages[1];
  int8_enc_rows(q, src, src_stride, n, codes, scales);
  memset(codes + (size_t)n * d, 0, (size_t)(cap_tokens - n) * d);
  memset(scales + (size_t)n * 2, 0, (size_t)(cap_tokens - n) * 2);
  return KVP_OK;
}

static int int8_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap_tokens, uint32_t t0,
                       uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const int8_inst *q = inst;
  int rc = kvp__codec_rows_ok("int8", n, cap_tokens, t0, m);
  if (rc) return rc;
  return int8_dec_rows(q, pages[0], pages[1], t0, m, dst, dst_stride, out);
}

#ifdef KVP_HAVE_CUDA
void kvp__int8_kparams(const void *inst, kvp__kparams *k) {
  const int8_inst *q = inst;
  memset(k, 0, sizeof *k);
  k->codec = KVP__K_INT8;
  k->head_dim = q->head_dim;
  k->in_dtype = q->in_dtype;
  k->int8_clip = q->pct < 100.0f;
  k->int8_clip_j = q->clip_j;
  k->int8_clip_frac = q->clip_frac;
}
#endif
KVP__DEV_OPS(int8)

const kvp_codec_vtable kvp__codec_int8 = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "int8",
    .create = int8_create,
    .destroy = int8_destroy,
    .group_tokens = int8_group_tokens,
    .layout = int8_layout,
    .encode = int8_encode,
    .decode = int8_decode,
    KVP__DEV_VT(int8)
};
