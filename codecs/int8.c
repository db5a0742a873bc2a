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
#include "numeric.h"

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

/* The clip of a token: the percentile of |x| (see the banner), or the
 * absmax when pct = 100 or the percentile is 0. */
static float int8_clip(const int8_inst *q, const float *x) {
  uint32_t d = q->head_dim;
  float amax = 0.0f;
  for (uint32_t i = 0; i < d; i++) amax = fmaxf(amax, fabsf(x[i]));
  if (q->pct >= 100.0f || amax == 0.0f) return amax;
  float a[KVP_MAX_HEAD_DIM];
  for (uint32_t i = 0; i < d; i++) a[i] = fabsf(x[i]);
  qsort(a, d, sizeof *a, cmp_float);
  float c = a[q->clip_j];
  if (q->clip_frac > 0.0f) c += (a[q->clip_j + 1] - c) * q->clip_frac;
  return c > 0.0f ? c : amax;
}

/* Quantize one token into D codes; returns its bf16 scale code. */
static uint16_t int8_token(const int8_inst *q, const float *x, int8_t *codes) {
  uint32_t d = q->head_dim;
  float c = int8_clip(q, x);
  if (c == 0.0f) {
    memset(codes, 0, d);
    return 0;
  }
  uint16_t sb = bf16_round_up(c / 127.0f);
  float s = kvp__bf16_to_f32(sb);
  for (uint32_t i = 0; i < d; i++) {
    float v = kvp__round_even(x[i] / s);
    codes[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : (int)v);
  }
  return sb;
}

static int int8_encode(const void *inst, const void *src, size_t src_stride, uint32_t n, uint32_t cap_tokens,
                       void *const *pages) {
  const int8_inst *q = inst;
  int rc = kvp__codec_rows_ok("int8", n, cap_tokens, 0, n);
  if (rc) return rc;
  uint32_t d = q->head_dim;
  uint8_t *codes = pages[0], *scales = pages[1];
  float x[KVP_MAX_HEAD_DIM];
  int8_t c[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < n; t++) {
    kvp__row_to_f32(x, (const unsigned char *)src + (size_t)t * src_stride, q->in_dtype, d);
    kvp__st_le16(scales + (size_t)t * 2, int8_token(q, x, c));
    memcpy(codes + (size_t)t * d, c, d);
  }
  memset(codes + (size_t)n * d, 0, (size_t)(cap_tokens - n) * d);
  memset(scales + (size_t)n * 2, 0, (size_t)(cap_tokens - n) * 2);
  return KVP_OK;
}

static int int8_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap_tokens, uint32_t t0,
                       uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const int8_inst *q = inst;
  int rc = kvp__codec_rows_ok("int8", n, cap_tokens, t0, m);
  if (rc) return rc;
  uint32_t d = q->head_dim;
  const uint8_t *codes = pages[0], *scales = pages[1];
  float x[KVP_MAX_HEAD_DIM];
  for (uint32_t r = 0; r < m; r++) {
    uint32_t t = t0 + r;
    float s = kvp__bf16_to_f32(kvp__ld_le16(scales + (size_t)t * 2));
    const int8_t *c = (const int8_t *)(codes + (size_t)t * d);
    for (uint32_t i = 0; i < d; i++) x[i] = (float)c[i] * s;
    kvp__row_from_f32((unsigned char *)dst + (size_t)r * dst_stride, out, x, d);
  }
  return KVP_OK;
}

const kvp_codec_vtable kvp__codec_int8 = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "int8",
    .create = int8_create,
    .destroy = int8_destroy,
    .group_tokens = int8_group_tokens,
    .layout = int8_layout,
    .encode = int8_encode,
    .decode = int8_decode,
};
