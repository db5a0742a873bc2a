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
 *   (min and max are running compares in index order: a value replaces
 *   only when strictly below/above, so of zeros of both signs the group's
 *   first one is its min, and its sign is the fp16 min's)
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
#include "kernels.h"

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

/* ---- the group quantizer, branch-free ----------------------------------------
 * Kernels for both ISAs (codecs/kernels.h); the banner's operations in its
 * order, every choice a mask select. Parameters run over arrays of groups:
 * K's D channels of a token group, or V's channel groups of a batch of
 * tokens. */

/* Code values of a byte of packed codes, LSB first (b = 2: four, b = 4: two). */
#define X4(M, b) M(b), M((b) + 1), M((b) + 2), M((b) + 3)
#define X16(M, b) X4(M, b), X4(M, (b) + 4), X4(M, (b) + 8), X4(M, (b) + 12)
#define X64(M, b) X16(M, b), X16(M, (b) + 16), X16(M, (b) + 32), X16(M, (b) + 48)
#define X256(M) X64(M, 0), X64(M, 64), X64(M, 128), X64(M, 192)
#define Q2(b) {(float)((b) & 3), (float)((b) >> 2 & 3), (float)((b) >> 4 & 3), (float)((b) >> 6 & 3)}
#define Q4(b) {(float)((b) & 15), (float)((b) >> 4 & 15)}
static const float kivi_q2[256][4] = {X256(Q2)};
static const float kivi_q4[256][2] = {X256(Q4)};

/* fp16 codes of x (|x| <= 65504) rounded toward -inf (down) or +inf. */
KVP__INLINE uint32_t f16_round_down(float x) {
  uint32_t h = kvp__f16_from_f32_bf(x);
  uint32_t dn = kvp__sel(kvp__mask(h & 0x8000u), h + 1u, kvp__sel(kvp__mask(h != 0), h - 1u, 0x8001u));
  return kvp__sel(kvp__mask(kvp__f16_to_f32_bf((uint16_t)h) > x), dn, h);
}
KVP__INLINE uint32_t f16_round_up(float x) {
  uint32_t h = kvp__f16_from_f32_bf(x);
  uint32_t up = kvp__sel(kvp__mask(h & 0x8000u), kvp__sel(kvp__mask(h == 0x8000u), 1u, h - 1u), h + 1u);
  return kvp__sel(kvp__mask(kvp__f16_to_f32_bf((uint16_t)h) < x), up, h);
}

/* m + Q s < hi, in double, where it is exact (both on the fp16 grid). */
KVP__INLINE uint32_t short_of(float m, double q, uint32_t s_code, float hi) {
  return (uint32_t)((double)m + q * (double)kvp__f16_to_f32_bf((uint16_t)s_code) < (double)hi);
}

/* The parameters of groups with minima lo and maxima hi (in range): the
 * min m rounded down to fp16; the scale (hi - m) / Q rounded up to fp16,
 * then raised by fp16 ulps while m + Q s < hi (the f32 quotient may have
 * rounded below the need): two raises here, any further by the caller,
 * which gets the lanes still short of hi in *more. */
KVP__INLINE void params_n(uint32_t *restrict sc, uint32_t *restrict mc, const float *restrict lo,
                          const float *restrict hi, double q, size_t n, uint32_t *more) {
  uint32_t any = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t m_code = f16_round_down(lo[i]);
    float m = kvp__f16_to_f32_bf((uint16_t)m_code);
    double range = (double)hi[i] - (double)m; /* >= 0: m <= lo <= hi */
    uint32_t s_code = f16_round_up((float)(range / q)) & kvp__mask(range > 0.0);
    s_code += short_of(m, q, s_code, hi[i]);
    s_code += short_of(m, q, s_code, hi[i]);
    any |= short_of(m, q, s_code, hi[i]);
    sc[i] = s_code;
    mc[i] = m_code;
  }
  *more |= any;
}

/* params_n over n groups, and the rare further raises. */
KVP__INLINE void params(uint32_t *sc, uint32_t *mc, const float *lo, const float *hi, uint32_t bits, size_t n) {
  double q = (double)((1u << bits) - 1);
  uint32_t more = 0;
#define PAR(i, c) params_n(sc + (i), mc + (i), lo + (i), hi + (i), q, (c), &more)
  KVP__FOR_CHUNKS(n, PAR);
#undef PAR
  if (more)
    for (size_t i = 0; i < n; i++)
      while (short_of(kvp__f16_to_f32_bf((uint16_t)mc[i]), q, sc[i], hi[i])) sc[i]++;
}

/* Records of n groups: fp16 scale, fp16 min, little-endian. */
KVP__INLINE void put_n(uint8_t *restrict rec, const uint32_t *restrict sc, const uint32_t *restrict mc, size_t n) {
  for (size_t i = 0; i < n; i++) {
    rec[4 * i] = (uint8_t)sc[i];
    rec[4 * i + 1] = (uint8_t)(sc[i] >> 8);
    rec[4 * i + 2] = (uint8_t)mc[i];
    rec[4 * i + 3] = (uint8_t)(mc[i] >> 8);
  }
}

/* The values of n records: scales s and minima m. */
KVP__INLINE void get_n(float *restrict s, float *restrict m, const uint8_t *restrict rec, size_t n) {
  for (size_t i = 0; i < n; i++) {
    s[i] = kvp__f16_to_f32_bf((uint16_t)(rec[4 * i] | rec[4 * i + 1] << 8));
    m[i] = kvp__f16_to_f32_bf((uint16_t)(rec[4 * i + 2] | rec[4 * i + 3] << 8));
  }
}

/* Codes of x: round_even((x - m) / s) clamped to [0, top], 0 where s = 0.
 * x >= m, so (x - m) / s is +0 or above, or -0 (x = -0, m = +0) and NaN
 * or inf where s = 0: a sign means 0, the magnitude is clamped to top
 * before rounding (rne is monotone and fixes top). */
KVP__INLINE void code_n(uint32_t *restrict q, const float *restrict x, const float *restrict m,
                        const float *restrict s, uint32_t top_bits, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t v = kvp__f32_bits((x[i] - m[i]) / s[i]), a = v & 0x7FFFFFFFu;
    uint32_t r = kvp__rne_u32(kvp__f32_of(kvp__sel(kvp__mask(a < top_bits), a, top_bits)));
    q[i] = r & ~(uint32_t)((int32_t)v >> 31) & kvp__mask(s[i] != 0.0f);
  }
}

/* Packing from codes narrowed to bytes: four (two) code bytes read as a
 * word w, code k sits at bit 8k of w, and w >> 6k (w >> 4k) brings it to
 * bits 2k (4k) of the low byte; the stray bits above are masked off. */
/* code_n for a group of one scale s and min m. */
KVP__INLINE void code1_n(uint32_t *restrict q, const float *restrict x, float m, float s, uint32_t top_bits, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t v = kvp__f32_bits((x[i] - m) / s), a = v & 0x7FFFFFFFu;
    uint32_t r = kvp__rne_u32(kvp__f32_of(kvp__sel(kvp__mask(a < top_bits), a, top_bits)));
    q[i] = r & ~(uint32_t)((int32_t)v >> 31) & kvp__mask(s != 0.0f);
  }
}

KVP__INLINE void pack2_n(uint8_t *restrict o, const uint8_t *restrict q, size_t nbytes) {
  for (size_t j = 0; j < nbytes; j++) {
    const uint8_t *b = q + 4 * j;
    uint32_t w = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
    o[j] = (uint8_t)(w | w >> 6 | w >> 12 | w >> 18);
  }
}
KVP__INLINE void pack4_n(uint8_t *restrict o, const uint8_t *restrict q, size_t nbytes) {
  for (size_t j = 0; j < nbytes; j++) {
    const uint8_t *b = q + 2 * j;
    uint32_t w = (uint32_t)b[0] | (uint32_t)b[1] << 8;
    o[j] = (uint8_t)(w | w >> 4);
  }
}

/* A row's 32-bit codes packed LSB first (kvp__lsb32_pack's layout: D b / 8
 * bytes are whole words). */
KVP__INLINE void pack_row(uint8_t *o, const uint32_t *q, uint32_t d, uint32_t bits) {
  uint8_t q8[KVP_MAX_HEAD_DIM];
#define NAR(i, c) kvp__narrow8_n(q8 + (i), q + (i), (c))
  KVP__FOR_CHUNKS(d, NAR);
#undef NAR
  if (bits == 2) {
#define PK(i, c) pack2_n(o + (i) / 4, q8 + (i), (c) / 4)
    KVP__FOR_CHUNKS(d, PK);
#undef PK
  } else {
#define PK(i, c) pack4_n(o + (i) / 2, q8 + (i), (c) / 2)
    KVP__FOR_CHUNKS(d, PK);
#undef PK
  }
}

/* Lanes: lo/hi = the running min/max of the rows so far (a value replaces
 * only when strictly below/above: ties keep the first, as the banner says). */
KVP__INLINE void minmax_n(float *restrict lo, float *restrict hi, const float *restrict x, size_t n) {
  for (size_t i = 0; i < n; i++) {
    lo[i] = x[i] < lo[i] ? x[i] : lo[i];
    hi[i] = x[i] > hi[i] ? x[i] : hi[i];
  }
}

KVP__INLINE void madd_n(float *restrict x, const float *restrict e, const float *restrict s, const float *restrict m,
                        size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = e[i] * s[i] + m[i];
}

KVP__INLINE void madd1_n(float *restrict x, const float *restrict e, float s, float m, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = e[i] * s + m;
}

/* Fold lanes [w, 2w) of lo/hi into [0, w). */
KVP__INLINE void fold_n(float *restrict lo, float *restrict hi, const float *restrict lo2, const float *restrict hi2,
                        size_t w) {
  for (size_t j = 0; j < w; j++) {
    lo[j] = lo2[j] < lo[j] ? lo2[j] : lo[j];
    hi[j] = hi2[j] > hi[j] ? hi2[j] : hi[j];
  }
}

/* Magnitude bits of the largest |x_i| (NaN above every number). */
KVP__INLINE void magmax_n(uint32_t *restrict m, const float *restrict x, size_t n) {
  for (size_t i = 0; i < n; i++) {
    uint32_t a = kvp__f32_bits(x[i]) & 0x7FFFFFFFu;
    m[i] = a > m[i] ? a : m[i];
  }
}

static int kivi_range_err(uint32_t t, uint32_t i, float x) {
  return kvp__err(KVP_ECODEC, "kivi: token %u channel %u: %g is beyond the fp16 range of the scale and min", t, i,
                  (double)x);
}

/* Some lane of the magnitude maxima m (n of them) is beyond 65504, or NaN. */
KVP__INLINE int over_range(const uint32_t *m, size_t n) {
  uint32_t mx = 0;
  for (size_t j = 0; j < n; j++) mx = m[j] > mx ? m[j] : mx;
  return mx > 0x477FE000u; /* 65504 */
}

/* KVP_OK, or the error naming the first element of the row beyond the fp16
 * range (or NaN). */
KVP__INLINE int range_check(const float *x, uint32_t d, uint32_t t) {
  uint32_t m[KVP__CHUNK] = {0};
#define MM(i, c) magmax_n(m, x + (i), (c))
  KVP__FOR_CHUNKS(d, MM);
#undef MM
  if (!over_range(m, KVP__CHUNK)) return KVP_OK;
  for (uint32_t i = 0; i < d; i++)
    if (!(fabsf(x[i]) <= KIVI_F16_MAX)) return kivi_range_err(t, i, x[i]);
  return KVP_OK;
}

static const void *row_at(const void *src, size_t stride, uint32_t t) {
  return (const unsigned char *)src + (size_t)t * stride;
}

/* ---- K: per channel over groups of G tokens -------------------------------- */

/* Each group of rows [r0, r1): min/max per channel, the records, then the
 * codes of each row. */
KVP__KERNEL(kivi_k_rows, (const kivi_inst *k, const void *src, size_t stride, uint32_t n, uint8_t *codes,
                          uint8_t *scales),
            (k, src, stride, n, codes, scales)) {
  uint32_t d = k->head_dim, top = kvp__f32_bits((float)((1u << k->bits) - 1));
  float x[KVP_MAX_HEAD_DIM], lo[KVP_MAX_HEAD_DIM], hi[KVP_MAX_HEAD_DIM], s[KVP_MAX_HEAD_DIM], m[KVP_MAX_HEAD_DIM];
  uint32_t sc[KVP_MAX_HEAD_DIM], mc[KVP_MAX_HEAD_DIM], mag[KVP_MAX_HEAD_DIM];
  uint32_t q[KVP_MAX_HEAD_DIM]; /* codes in 32 bits: see kvp__narrow8_n */
  for (uint32_t r0 = 0; r0 < n; r0 += k->group) {
    uint32_t r1 = n - r0 < k->group ? n : r0 + k->group;
    uint8_t *rec = scales + (size_t)(r0 / k->group) * 4 * d;
    memset(mag, 0, d * sizeof *mag);
    for (uint32_t t = r0; t < r1; t++) {
      kvp__load_row(x, row_at(src, stride, t), k->in_dtype, d);
#define MAG(i, c) magmax_n(mag + (i), x + (i), (c))
      KVP__FOR_CHUNKS(d, MAG);
#undef MAG
      if (t == r0) {
        memcpy(lo, x, d * sizeof *x);
        memcpy(hi, x, d * sizeof *x);
        continue;
      }
#define MM(i, c) minmax_n(lo + (i), hi + (i), x + (i), (c))
      KVP__FOR_CHUNKS(d, MM);
#undef MM
    }
    if (over_range(mag, d)) /* name the first offender, in row order; nothing of this group is written */
      for (uint32_t t = r0; t < r1; t++) {
        kvp__load_row(x, row_at(src, stride, t), k->in_dtype, d);
        int rc = range_check(x, d, t);
        if (rc) return rc;
      }
    params(sc, mc, lo, hi, k->bits, d);
#define PUT(i, c) put_n(rec + 4 * (i), sc + (i), mc + (i), (c))
    KVP__FOR_CHUNKS(d, PUT);
#undef PUT
#define GET(i, c) get_n(s + (i), m + (i), rec + 4 * (i), (c))
    KVP__FOR_CHUNKS(d, GET);
#undef GET
    for (uint32_t t = r0; t < r1; t++) {
      kvp__load_row(x, row_at(src, stride, t), k->in_dtype, d);
#define CODE(i, c) code_n(q + (i), x + (i), m + (i), s + (i), top, (c))
      KVP__FOR_CHUNKS(d, CODE);
#undef CODE
      pack_row(codes + (size_t)t * k->row_bytes, q, d, k->bits);
    }
  }
  return KVP_OK;
}

/* ---- V: per token over groups of G channels -------------------------------- */

enum { V_BATCH = 8 }; /* tokens whose group parameters run together */

/* The min and max of the G >= 16 values of a group, as the in-order
 * strict compares give them: the lanes fold to the values, and a min of
 * zero takes the sign of the group's first zero (the one those compares
 * keep). */
KVP__INLINE void group_minmax(const float *xg, uint32_t gs, float *lo_out, float *hi_out) {
  float lo[16], hi[16];
  memcpy(lo, xg, sizeof lo);
  memcpy(hi, xg, sizeof hi);
  for (uint32_t c = 16; c < gs; c += 16) minmax_n(lo, hi, xg + c, 16);
  fold_n(lo, hi, lo + 8, hi + 8, 8);
  fold_n(lo, hi, lo + 4, hi + 4, 4);
  fold_n(lo, hi, lo + 2, hi + 2, 2);
  fold_n(lo, hi, lo + 1, hi + 1, 1);
  float l = lo[0];
  if (l == 0.0f)
    for (uint32_t i = 0; i < gs; i++)
      if (xg[i] == 0.0f) {
        l = xg[i];
        break;
      }
  *lo_out = l;
  *hi_out = hi[0];
}

/* Encode rows [t0, t0 + nb): their groups' parameters in one call. */
KVP__INLINE void v_batch(const kivi_inst *k, const void *src, size_t stride, uint32_t t0, uint32_t nb, uint8_t *codes,
                         uint8_t *scales, const float *lo, const float *hi) {
  uint32_t d = k->head_dim, gs = k->group, ng = d / gs, top = kvp__f32_bits((float)((1u << k->bits) - 1));
  uint32_t sc[V_BATCH * KVP_MAX_HEAD_DIM / 16], mc[V_BATCH * KVP_MAX_HEAD_DIM / 16];
  float x[KVP_MAX_HEAD_DIM], sv[KVP_MAX_HEAD_DIM / 16], mv[KVP_MAX_HEAD_DIM / 16];
  uint32_t q[KVP_MAX_HEAD_DIM]; /* codes in 32 bits: see kvp__narrow8_n */
  params(sc, mc, lo, hi, k->bits, (size_t)nb * ng);
  uint8_t *rec = scales + (size_t)t0 * 4 * ng;
#define PUT(i, c) put_n(rec + 4 * (i), sc + (i), mc + (i), (c))
  KVP__FOR_CHUNKS((size_t)nb * ng, PUT);
#undef PUT
  for (uint32_t r = 0; r < nb; r++) {
    uint32_t t = t0 + r;
    kvp__load_row(x, row_at(src, stride, t), k->in_dtype, d);
    get_n(sv, mv, rec + (size_t)r * 4 * ng, ng);
    for (uint32_t j = 0; j < ng; j++) {
      uint32_t *qg = q + j * gs;
      const float *xg = x + j * gs;
#define CODE(i, c) code1_n(qg + (i), xg + (i), mv[j], sv[j], top, (c))
      KVP__FOR_CHUNKS(gs, CODE);
#undef CODE
    }
    pack_row(codes + (size_t)t * k->row_bytes, q, d, k->bits);
  }
}

KVP__KERNEL(kivi_v_rows, (const kivi_inst *k, const void *src, size_t stride, uint32_t n, uint8_t *codes,
                          uint8_t *scales),
            (k, src, stride, n, codes, scales)) {
  uint32_t d = k->head_dim, gs = k->group, ng = d / gs;
  float x[KVP_MAX_HEAD_DIM], lo[V_BATCH * KVP_MAX_HEAD_DIM / 16], hi[V_BATCH * KVP_MAX_HEAD_DIM / 16];
  for (uint32_t t0 = 0; t0 < n; t0 += V_BATCH) {
    uint32_t nb = n - t0 < V_BATCH ? n - t0 : V_BATCH;
    for (uint32_t r = 0; r < nb; r++) {
      kvp__load_row(x, row_at(src, stride, t0 + r), k->in_dtype, d);
      int rc = range_check(x, d, t0 + r);
      if (rc) { /* the rows before it are encoded, as in order they would be */
        v_batch(k, src, stride, t0, r, codes, scales, lo, hi);
        return rc;
      }
      for (uint32_t j = 0; j < ng; j++) group_minmax(x + j * gs, gs, &lo[r * ng + j], &hi[r * ng + j]);
    }
    v_batch(k, src, stride, t0, nb, codes, scales, lo, hi);
  }
  return KVP_OK;
}

/* ---- decode ----------------------------------------------------------------- */

/* The n records at rec have finite scales and minima (fp16 exponent < 31):
 * then q s + m is a number for every code, and bf16 needs no NaN select. */
KVP__INLINE int recs_finite(const uint8_t *rec, size_t n) {
  uint32_t odd = 0;
  for (size_t i = 0; i < n; i++) {
    uint32_t sc = (uint32_t)(rec[4 * i] | rec[4 * i + 1] << 8), mc = (uint32_t)(rec[4 * i + 2] | rec[4 * i + 3] << 8);
    odd |= (uint32_t)((sc & 0x7C00u) == 0x7C00u) | (uint32_t)((mc & 0x7C00u) == 0x7C00u);
  }
  return !odd;
}

KVP__INLINE void madd_bf16_n(uint16_t *restrict o, const float *restrict e, const float *restrict s,
                             const float *restrict m, int num, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float v = e[i] * s[i] + m[i];
    o[i] = num ? kvp__bf16_from_f32_num(v) : kvp__bf16_from_f32_bf(v);
  }
}

KVP__INLINE void madd1_bf16_n(uint16_t *restrict o, const float *restrict e, float s, float m, int num, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float v = e[i] * s + m;
    o[i] = num ? kvp__bf16_from_f32_num(v) : kvp__bf16_from_f32_bf(v);
  }
}

KVP__KERNEL(kivi_dec_rows, (const kivi_inst *k, const uint8_t *codes, const uint8_t *scales, uint32_t t0, uint32_t m,
                            unsigned char *dst, size_t stride, kvp_dtype out),
            (k, codes, scales, t0, m, dst, stride, out)) {
  uint32_t d = k->head_dim, gs = k->group, ng = d / gs, group = UINT32_MAX;
  int num = 0; /* the records in use are finite */
  float x[KVP_MAX_HEAD_DIM], e[KVP_MAX_HEAD_DIM], s[KVP_MAX_HEAD_DIM], mn[KVP_MAX_HEAD_DIM],
      sv[KVP_MAX_HEAD_DIM / 16], mv[KVP_MAX_HEAD_DIM / 16];
  for (uint32_t r = 0; r < m; r++) {
    uint32_t t = t0 + r;
    const uint8_t *c = codes + (size_t)t * k->row_bytes;
    uint16_t *o = out == KVP_DTYPE_BF16 ? (uint16_t *)(dst + (size_t)r * stride) : NULL;
    if (k->bits == 2)
      for (uint32_t j = 0; j < d / 4; j++) memcpy(e + 4 * j, kivi_q2[c[j]], sizeof kivi_q2[0]);
    else
      for (uint32_t j = 0; j < d / 2; j++) memcpy(e + 2 * j, kivi_q4[c[j]], sizeof kivi_q4[0]);
    if (k->kv == 0) {
      if (t / gs != group) { /* K: the group's records, once per group */
        const uint8_t *rec = scales + (size_t)(t / gs) * 4 * d;
        group = t / gs;
#define GET(i, c) get_n(s + (i), mn + (i), rec + 4 * (i), (c))
        KVP__FOR_CHUNKS(d, GET);
#undef GET
        num = recs_finite(rec, d);
      }
      if (o && num) {
#define MADD(i, c) madd_bf16_n(o + (i), e + (i), s + (i), mn + (i), 1, (c))
        KVP__FOR_CHUNKS(d, MADD);
#undef MADD
        continue;
      }
#define MADD(i, c) madd_n(x + (i), e + (i), s + (i), mn + (i), (c))
      KVP__FOR_CHUNKS(d, MADD);
#undef MADD
    } else { /* V: one record per channel group */
      const uint8_t *rec = scales + (size_t)t * 4 * ng;
      get_n(sv, mv, rec, ng);
      if (o && recs_finite(rec, ng)) {
        for (uint32_t j = 0; j < ng; j++) {
          uint16_t *og = o + j * gs;
          const float *eg = e + j * gs;
#define MADD(i, c) madd1_bf16_n(og + (i), eg + (i), sv[j], mv[j], 1, (c))
          KVP__FOR_CHUNKS(gs, MADD);
#undef MADD
        }
        continue;
      }
      for (uint32_t j = 0; j < ng; j++) {
        float *xg = x + j * gs;
        const float *eg = e + j * gs;
#define MADD(i, c) madd1_n(xg + (i), eg + (i), sv[j], mv[j], (c))
        KVP__FOR_CHUNKS(gs, MADD);
#undef MADD
      }
    }
    kvp__store_row(dst + (size_t)r * stride, out, x, d);
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
  if (k->kv == 0) return kivi_k_rows(k, src, src_stride, n, codes, scales);
  return kivi_v_rows(k, src, src_stride, n, codes, scales);
}

static int kivi_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap_tokens, uint32_t t0,
                       uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const kivi_inst *k = inst;
  int rc = kvp__codec_rows_ok("kivi", n, cap_tokens, t0, m);
  if (rc) return rc;
  return kivi_dec_rows(k, pages[0], pages[1], t0, m, dst, dst_stride, out);
}

#ifdef KVP_HAVE_CUDA
void kvp__kivi_kparams(const void *inst, kvp__kparams *k) {
  const kivi_inst *q = inst;
  memset(k, 0, sizeof *k);
  k->codec = KVP__K_KIVI;
  k->head_dim = q->head_dim;
  k->in_dtype = q->in_dtype;
  k->kivi_kv = q->kv;
  k->kivi_bits = q->bits;
  k->kivi_group = q->group;
}
#endif
/* kivi_encode_dev, kivi_decode_dev: kernels/kivi.cuh through KVP__DEV_OPS (codecs/builtin.h). */
KVP__DEV_OPS(kivi)

const kvp_codec_vtable kvp__codec_kivi = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "kivi",
    .create = kivi_create,
    .destroy = kivi_destroy,
    .group_tokens = kivi_group_tokens,
    .layout = kivi_layout,
    .encode = kivi_encode,
    .decode = kivi_decode,
    KVP__DEV_VT(kivi)
};
