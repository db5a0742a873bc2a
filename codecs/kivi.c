/*
 * codecs/kivi.c - the KIVI codec: asymmetric 2- or 4-bit integers with an
 * fp16 scale and an fp16 minimum per group. Keys are quantized per channel
 * over groups of G tokens, values per token over groups of G channels (the
 * instance knows which from geom.kv).
 *
 * Params (spec "kivi", "kivi:bits=4:group=64"):
 *   bits=2|4            code width b (default 2)
 *   group=16|32|64|128  G (default 32); G must divide head_dim D (for V the
 *                       channel groups tile D; K keeps the rule so one spec
 *                       serves both sides)
 *   residual=R          accepted and ignored: KIVI's full-precision window
 *                       of recent tokens is the pool's OPEN block, which
 *                       holds its tokens RAW until it is sealed (stream
 *                       mode), so the codec never sees the residual; in
 *                       step mode blocks are encoded as appended, and R
 *                       has no meaning either.
 *
 * group_tokens: G for K (block_tokens must be a multiple of G), 1 for V.
 *
 * Pages of a block of cap tokens (b bits, G, D; Q = 2^b - 1):
 *
 *   CODES   cap x D*b/8 bytes, token-major for K and V alike:
 *           row t = D codes (channel i = element i) packed LSB-first in
 *           little-endian 32-bit words (kvp__lsb32_pack): element i at bits
 *           [b*i, b*i + b) of the row's bit stream. b=2, word 0 of a row:
 *             bit 31                                        1 0
 *             [ c15 | c14 | ...                      | c1 | c0 ]
 *           D*b/8 is a whole number of words (D is a multiple of G >= 16).
 *   SCALES  records of 4 bytes: fp16 scale (bytes 0-1), fp16 min (bytes
 *           2-3), each little-endian.
 *           K: ceil(cap/G) groups x D channels; record of (group j,
 *              channel i) at byte 4*(j*D + i); group j = tokens [jG, jG+G).
 *           V: cap tokens x D/G channel groups; record of (token t, group
 *              g) at byte 4*(t*(D/G) + g); group g = channels [gG, gG+G).
 *
 *   layout: CODES  = cap * D*b/8
 *           SCALES = K: ceil(cap/G) * 4D     V: cap * 4D/G
 *   Per token-head (cap a multiple of G): D*b/8 + 4D/G; b2 G32 at D=128:
 *   32 + 16 = 48 B (5.33x against bf16).
 *
 * Quantizer of a group with values x (f32; the scale check in double):
 *   m = min x rounded DOWN to fp16, s = (max x - m) / Q rounded UP to fp16
 *   (then raised by fp16 ulps while m + Q s < max x, computed exactly),
 *   q = round_even((x - m) / s) clamped to [0, Q]  (q = 0 when s = 0),
 *   decode x^ = q * s + m.
 * Rounding m down and s up keeps every x in [m, m + Q s], so no code
 * clamps and |x - x^| <= s/2 (up to f32 rounding). A constant group that
 * fp16 represents exactly has s = 0 and decodes exactly; all zeros decode
 * to zeros. Scale underflow: a nonzero range never rounds up to 0 (the
 * least fp16 is 2^-24), so tiny groups get s = 2^-24 and stay within s/2.
 * Values beyond the fp16 range (|x| > 65504) cannot be described by an
 * fp16 min: encode returns KVP_ECODEC naming the token and channel.
 *
 * Short last group (K, step mode): when n is not a multiple of G, the last
 * group holds tokens [G floor(n/G), n) and its scale and min are over those
 * rows only. Rows n..cap-1 and the records of groups past the last are
 * written as zeros.
 */
#include "builtin.h"
#include "numeric.h"

/* A binding of kivi. */
typedef struct kivi_inst {
  uint32_t head_dim;        /* D, elements per token */
  kvp_dtype in_dtype;       /* dtype of appended rows */
  uint32_t kv;              /* 0: K (per channel over G tokens), 1: V (per token over G channels) */
  uint32_t bits;            /* b, 2 or 4 */
  uint32_t group;           /* G, tokens (K) or channels (V) per group */
  uint32_t residual_tokens; /* residual=R as given; unused (see the banner) */
  uint32_t row_bytes;       /* D*b/8, bytes of a token's codes */
} kivi_inst;

#define KIVI_F16_MAX 65504.0f

enum { KEY_BITS, KEY_GROUP, KEY_RESIDUAL };
static const char *const kivi_keys[] = {"bits", "group", "residual"};

static int kivi_param(kivi_inst *k, const kvp__param *p, char *err, size_t errcap, size_t *err_at) {
  uint32_t v;
  int ok = kvp__param_u32(p, &v);
  switch (p->key) {
  case KEY_BITS:
    if (!ok || (v != 2 && v != 4))
      return kvp__param_fail(err, errcap, err_at, p->at, "kivi: bits=%.*s: must be 2 or 4", (int)p->val_len, p->val);
    k->bits = v;
    break;
  case KEY_GROUP:
    if (!ok || (v != 16 && v != 32 && v != 64 && v != 128))
      return kvp__param_fail(err, errcap, err_at, p->at, "kivi: group=%.*s: must be 16, 32, 64 or 128", (int)p->val_len,
                             p->val);
    k->group = v;
    break;
  default:
    if (!ok || v > 65536)
      return kvp__param_fail(err, errcap, err_at, p->at, "kivi: residual=%.*s: want tokens in 0..65536",
                             (int)p->val_len, p->val);
    k->residual_tokens = v;
  }
  return KVP_OK;
}

static int kivi_create(const char *params, const kvp_codec_geom *geom, void **inst, char *err, size_t errcap,
                       size_t *err_at) {
  int rc = kvp__codec_geom_ok("kivi", geom, err, errcap);
  if (rc) return rc;
  kivi_inst k = {.head_dim = geom->head_dim, .in_dtype = geom->in_dtype, .kv = geom->kv, .bits = 2, .group = 32};
  size_t pos = 0, group_at = 0;
  unsigned seen = 0;
  kvp__param p;
  while ((rc = kvp__param_next("kivi", params, &pos, kivi_keys, 3, &seen, &p, err, errcap, err_at)) == 1) {
    if ((rc = kivi_param(&k, &p, err, errcap, err_at))) return rc;
    if (p.key == KEY_GROUP) group_at = p.at;
  }
  if (rc) return rc;
  if (k.head_dim % k.group)
    return kvp__param_fail(err, errcap, err_at, group_at, "kivi: group=%u does not divide head_dim %u", k.group,
                           k.head_dim);
  k.row_bytes = k.head_dim * k.bits / 8;
  kivi_inst *out = malloc(sizeof *out);
  if (!out) return kvp__param_fail(err, errcap, NULL, 0, "kivi: out of memory");
  *out = k;
  *inst = out;
  return KVP_OK;
}

static void kivi_destroy(void *inst) { free(inst); }

static uint32_t kivi_group_tokens(const void *inst) {
  const kivi_inst *k = inst;
  return k->kv == 0 ? k->group : 1;
}

/* Bytes of the SCALES page of a block of cap tokens. */
static uint64_t kivi_scales_bytes(const kivi_inst *k, uint32_t cap_tokens) {
  if (k->kv == 0) return (uint64_t)(cap_tokens + k->group - 1) / k->group * 4u * k->head_dim;
  return (uint64_t)cap_tokens * 4u * (k->head_dim / k->group);
}

static void kivi_layout(const void *inst, uint32_t cap_tokens, kvp_codec_layout *out) {
  const kivi_inst *k = inst;
  memset(out, 0, sizeof *out);
  out->npages = 2;
  out->types[0] = KVP_PAGE_CODES;
  out->bytes[0] = (uint64_t)cap_tokens * k->row_bytes;
  out->types[1] = KVP_PAGE_SCALES;
  out->bytes[1] = kivi_scales_bytes(k, cap_tokens);
}

/* ---- the group quantizer --------------------------------------------------- */

/* fp16 code of x (|x| <= 65504) rounded toward -inf / +inf. */
static uint16_t f16_round_down(float x) {
  uint16_t h = kvp__f16_from_f32(x);
  if (kvp__f16_to_f32(h) > x) h = (h & 0x8000u) ? (uint16_t)(h + 1) : h ? (uint16_t)(h - 1) : 0x8001u;
  return h;
}
static uint16_t f16_round_up(float x) {
  uint16_t h = kvp__f16_from_f32(x);
  if (kvp__f16_to_f32(h) < x) h = (h & 0x8000u) ? (h == 0x8000u ? 1u : (uint16_t)(h - 1)) : (uint16_t)(h + 1);
  return h;
}

/* One group's parameters: the fp16 record and its values. */
typedef struct kivi_q {
  uint16_t s_code, m_code; /* fp16 codes of the scale and the min */
  float s, m;              /* their values */
} kivi_q;

/* The parameters of a group with minimum lo and maximum hi (in range).
 * The scale is fixed up in double, where m + Q s is exact (both on the
 * fp16 grid): the f32 quotient range/Q may have rounded below the need. */
static kivi_q kivi_params(float lo, float hi, uint32_t bits) {
  kivi_q g;
  double q = (double)((1u << bits) - 1);
  g.m_code = f16_round_down(lo);
  g.m = kvp__f16_to_f32(g.m_code);
  double range = (double)hi - (double)g.m; /* >= 0: m <= lo <= hi */
  g.s_code = range > 0.0 ? f16_round_up((float)(range / q)) : 0;
  while ((double)g.m + q * (double)kvp__f16_to_f32(g.s_code) < (double)hi) g.s_code++;
  g.s = kvp__f16_to_f32(g.s_code);
  return g;
}

static uint8_t kivi_code(float x, const kivi_q *g, uint32_t bits) {
  if (g->s == 0.0f) return 0;
  float v = kvp__round_even((x - g->m) / g->s), top = (float)((1u << bits) - 1);
  return (uint8_t)(v < 0.0f ? 0.0f : v > top ? top : v);
}

static void kivi_put(uint8_t *rec, const kivi_q *g) {
  kvp__st_le16(rec, g->s_code);
  kvp__st_le16(rec + 2, g->m_code);
}

static kivi_q kivi_get(const uint8_t *rec) {
  kivi_q g = {.s_code = kvp__ld_le16(rec), .m_code = kvp__ld_le16(rec + 2)};
  g.s = kvp__f16_to_f32(g.s_code);
  g.m = kvp__f16_to_f32(g.m_code);
  return g;
}

static int kivi_range_err(uint32_t t, uint32_t i, float x) {
  return kvp__err(KVP_ECODEC, "kivi: token %u channel %u: %g is beyond the fp16 range of the scale and min", t, i,
                  (double)x);
}

/* ---- K: per channel over groups of G tokens -------------------------------- */

static const void *row_at(const void *src, size_t stride, uint32_t t) {
  return (const unsigned char *)src + (size_t)t * stride;
}

/* Encode the K group of rows [r0, r1): min/max per channel, the records,
 * then the codes of each row. */
static int kivi_k_group(const kivi_inst *k, const void *src, size_t stride, uint32_t r0, uint32_t r1, uint8_t *codes,
                        uint8_t *rec) {
  uint32_t d = k->head_dim;
  float x[KVP_MAX_HEAD_DIM], lo[KVP_MAX_HEAD_DIM], hi[KVP_MAX_HEAD_DIM];
  uint8_t q[KVP_MAX_HEAD_DIM];
  for (uint32_t t = r0; t < r1; t++) {
    kvp__row_to_f32(x, row_at(src, stride, t), k->in_dtype, d);
    for (uint32_t i = 0; i < d; i++) {
      if (!(fabsf(x[i]) <= KIVI_F16_MAX)) return kivi_range_err(t, i, x[i]);
      lo[i] = t == r0 ? x[i] : fminf(lo[i], x[i]);
      hi[i] = t == r0 ? x[i] : fmaxf(hi[i], x[i]);
    }
  }
  for (uint32_t i = 0; i < d; i++) {
    kivi_q g = kivi_params(lo[i], hi[i], k->bits);
    kivi_put(rec + (size_t)i * 4, &g);
  }
  for (uint32_t t = r0; t < r1; t++) {
    kvp__row_to_f32(x, row_at(src, stride, t), k->in_dtype, d);
    for (uint32_t i = 0; i < d; i++) {
      kivi_q g = kivi_get(rec + (size_t)i * 4);
      q[i] = kivi_code(x[i], &g, k->bits);
    }
    kvp__lsb32_pack(codes + (size_t)t * k->row_bytes, q, d, k->bits);
  }
  return KVP_OK;
}

static int kivi_k_encode(const kivi_inst *k, const void *src, size_t stride, uint32_t n, uint8_t *codes,
                         uint8_t *scales) {
  uint32_t g = k->group;
  for (uint32_t r0 = 0; r0 < n; r0 += g) {
    uint32_t r1 = n - r0 < g ? n : r0 + g;
    int rc = kivi_k_group(k, src, stride, r0, r1, codes, scales + (size_t)(r0 / g) * 4 * k->head_dim);
    if (rc) return rc;
  }
  return KVP_OK;
}

/* ---- V: per token over groups of G channels -------------------------------- */

static int kivi_v_encode(const kivi_inst *k, const void *src, size_t stride, uint32_t n, uint8_t *codes,
                         uint8_t *scales) {
  uint32_t d = k->head_dim, gs = k->group, ng = d / gs;
  float x[KVP_MAX_HEAD_DIM];
  uint8_t q[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < n; t++) {
    kvp__row_to_f32(x, row_at(src, stride, t), k->in_dtype, d);
    for (uint32_t j = 0; j < ng; j++) {
      const float *xg = x + (size_t)j * gs;
      float lo = xg[0], hi = xg[0];
      for (uint32_t i = 0; i < gs; i++) {
        if (!(fabsf(xg[i]) <= KIVI_F16_MAX)) return kivi_range_err(t, j * gs + i, xg[i]);
        lo = fminf(lo, xg[i]);
        hi = fmaxf(hi, xg[i]);
      }
      kivi_q g = kivi_params(lo, hi, k->bits);
      kivi_put(scales + ((size_t)t * ng + j) * 4, &g);
      for (uint32_t i = 0; i < gs; i++) q[j * gs + i] = kivi_code(xg[i], &g, k->bits);
    }
    kvp__lsb32_pack(codes + (size_t)t * k->row_bytes, q, d, k->bits);
  }
  return KVP_OK;
}

/* ---- vtable entries ---------------------------------------------------------- */

static int kivi_encode(const void *inst, const void *src, size_t src_stride, uint32_t n, uint32_t cap_tokens,
                       void *const *pages) {
  const kivi_inst *k = inst;
  int rc = kvp__codec_rows_ok("kivi", n, cap_tokens, 0, n);
  if (rc) return rc;
  uint8_t *codes = pages[0], *scales = pages[1];
  uint64_t scales_bytes = kivi_scales_bytes(k, cap_tokens);
  memset(codes + (size_t)n * k->row_bytes, 0, (size_t)(cap_tokens - n) * k->row_bytes);
  memset(scales, 0, scales_bytes); /* records past the last group stay zero */
  if (k->kv == 0) return kivi_k_encode(k, src, src_stride, n, codes, scales);
  return kivi_v_encode(k, src, src_stride, n, codes, scales);
}

static int kivi_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap_tokens, uint32_t t0,
                       uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const kivi_inst *k = inst;
  int rc = kvp__codec_rows_ok("kivi", n, cap_tokens, t0, m);
  if (rc) return rc;
  uint32_t d = k->head_dim, gs = k->group;
  const uint8_t *codes = pages[0], *scales = pages[1];
  float x[KVP_MAX_HEAD_DIM];
  uint8_t q[KVP_MAX_HEAD_DIM];
  for (uint32_t r = 0; r < m; r++) {
    uint32_t t = t0 + r;
    kvp__lsb32_unpack(q, codes + (size_t)t * k->row_bytes, d, k->bits);
    const uint8_t *rec = k->kv == 0 ? scales + (size_t)(t / gs) * 4 * d : scales + (size_t)t * 4 * (d / gs);
    for (uint32_t i = 0; i < d; i++) {
      kivi_q g = kivi_get(rec + (size_t)(k->kv == 0 ? i : i / gs) * 4);
      x[i] = (float)q[i] * g.s + g.m;
    }
    kvp__row_from_f32((unsigned char *)dst + (size_t)r * dst_stride, out, x, d);
  }
  return KVP_OK;
}

const kvp_codec_vtable kvp__codec_kivi = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "kivi",
    .create = kivi_create,
    .destroy = kivi_destroy,
    .group_tokens = kivi_group_tokens,
    .layout = kivi_layout,
    .encode = kivi_encode,
    .decode = kivi_decode,
};
