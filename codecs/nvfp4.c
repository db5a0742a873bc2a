/*
 * codecs/nvfp4.c - the NVFP4 codec (LongLive-2.0 KV cache): E2M1 element
 * codes, one E4M3 scale per 16 consecutive elements along D, and one fp32
 * scale per (block, head); optional K-smoothing with the per-token mean
 * stored.
 *
 * Params (spec "nvfp4", "nvfp4:rule=4/6:ksmooth=store"):
 *   rule=6    (default) each 16-block's scale maps its amax to 6
 *   rule=4/6  Four Over Six (LongLive-2.0 appendix F, eq. 12-13): per
 *             16-block, the candidates mapping the amax to 6 and to 4;
 *             keep the one with the lower squared error
 *   ksmooth=none|store  (default none) store: subtract each token's mean
 *             over D before quantizing (LongLive-2.0 eq. 6), keep it as
 *             bf16, add it back on decode. Any side may use it; it is
 *             meant for K.
 * head_dim must be a multiple of 16.
 *
 * Pages of a block of cap tokens, head dim D:
 *
 *   CODES   cap x D/2 bytes: row t at byte t*D/2, E2M1 codes (bit 3 the
 *           sign), first element in the LOW nibble (kvp__nib_pack):
 *             byte t*D/2 + j = c[2j] | c[2j+1] << 4
 *   SCALES  cap x D/16 bytes: byte t*D/16 + k = E4M3 code of the scale of
 *           elements [16k, 16k+16) of token t; then, with ksmooth=store,
 *           cap x 2 bytes: byte cap*D/16 + 2t = the bf16 mean of token t,
 *           little-endian
 *   META    4 bytes: the block-head scale g, IEEE fp32 little-endian
 *
 *   layout: CODES = cap*D/2, SCALES = cap*D/16 (+ 2*cap), META = 4
 *   Per token-head D/2 + D/16 (+2): 72 B at D = 128 (74 with the mean),
 *   plus 4 B per block-head (3.56x against bf16).
 *
 * Encode (f32; x = the token minus its bf16 mean with ksmooth=store):
 *   g = A / (6 * 448), A = max |x| over the n rows of the block (two-level
 *       NVFP4: the largest 16-block scale is 448 in E4M3), at least FLT_MIN
 *       when A > 0; g = 0 when A = 0 (then every code and scale is 0)
 *   per 16-block, u = x / g, a = max |u| over the block:
 *     target T (6, or 4 for rule 4/6's second candidate), scale
 *     s = E4M3(a / T) round to nearest even, saturating at 448; but if
 *       that E4M3 value is below 2^-6 (subnormal or 0) and
 *       a > 0, s = the least E4M3 value >= a/T (k * 2^-9, k = 1..8), so a
 *       block far below the block-head amax never saturates its codes
 *     code_i = E2M1(u_i / s), round to nearest even, saturating at 6
 *     rule 4/6: both candidates are decoded exactly as decode will, and
 *     the one with the lower sum of (x_i - x^_i)^2 (double) is kept; a
 *     tie keeps 6. g is the same for both rules, so the 6-candidate is
 *     bit for bit rule 6's encoding and a block's error under 4/6 never
 *     exceeds rule 6's (with ksmooth=store the comparison is on x minus
 *     the mean, before the mean is added back; the final f32 add may move
 *     the error by an ulp). The price: a block whose amax a passes 2/3 of
 *     the block-head amax A needs a scale above 448 to map a to 4, so its
 *     4-candidate saturates at 448 and maps a to 6a/A, between 4 and 6
 *     (for a = A it is the 6-candidate and 4/6 changes nothing). Four
 *     Over Six's reference code instead lowers g to A/(6*256) under 4/6,
 *     which frees those blocks but re-rounds every 6-candidate scale, so
 *     a block could then lose against rule 6; we keep rule 6's g.
 *   A block with a = 0 has scale code 0 and codes 0.
 * Decode: x^_i = (E2M1value(code_i) * s) * g (+ mean), in f32; the first
 *   product is exact.
 *
 * Invariants: with s from E4M3 round-to-nearest (relative error <= 2^-4),
 *   |u_i / s| <= T (1 + 2^-4), so x^_i is the grid point of
 *   {0, .5, 1, 1.5, 2, 3, 4, 6} * s*g nearest to x_i, or +-6 s*g for the
 *   few |x_i| in (6 s g, 6.375 s g]. Scaling the input by 2^k scales g and
 *   the mean by 2^k and leaves every code and block scale: the output
 *   scales by exactly 2^k (while g and the mean stay normal). Scale
 *   underflow: a tiny A gives g = FLT_MIN (u then stays below 2688, the
 *   codes keep their meaning); a block scale that E4M3 cannot hold above
 *   2^-6 takes the rounded-up subnormal rule above. An all-zero block-head
 *   decodes to zeros. Rows n..cap-1 are written as zeros.
 *   Range: |x| near FLT_MAX may decode to +-inf (6*448*g rounds up).
 */
#include "builtin.h"
#include "kernels.h"

#include <float.h>

#define NVFP4_BLOCK 16u                                /* elements per E4M3 scale */
#define NVFP4_GMAX (KVP__E2M1_MAX * KVP__FP8_E4M3_MAX) /* 2688: largest code * largest scale */
#define NVFP4_E4M3_MIN_NORMAL 0.015625f                /* 2^-6 */

/* A binding of nvfp4. */
typedef struct nvfp4_inst {
  uint32_t head_dim;  /* D, elements per token, a multiple of 16 */
  kvp_dtype in_dtype; /* dtype of appended rows */
  int rule46;         /* 1: rule 4/6; 0: rule 6 */
  int ksmooth;        /* 1: per token mean subtracted and stored */
} nvfp4_inst;

enum { KEY_RULE, KEY_KSMOOTH };
static const char *const nvfp4_keys[] = {"rule", "ksmooth"};

static int nvfp4_param(nvfp4_inst *f, const kvp__param *p, char *err, size_t errcap, size_t *err_at) {
  if (p->key == KEY_RULE) {
    if (!kvp__param_is(p, "6") && !kvp__param_is(p, "4/6"))
      return kvp__param_fail(err, errcap, err_at, p->at, "nvfp4: rule=%.*s: must be 6 or 4/6", (int)p->val_len, p->val);
    f->rule46 = kvp__param_is(p, "4/6");
  } else {
    if (!kvp__param_is(p, "none") && !kvp__param_is(p, "store"))
      return kvp__param_fail(err, errcap, err_at, p->at, "nvfp4: ksmooth=%.*s: must be none or store", (int)p->val_len,
                             p->val);
    f->ksmooth = kvp__param_is(p, "store");
  }
  return KVP_OK;
}

static int nvfp4_create(const char *params, const kvp_codec_geom *geom, void **inst, char *err, size_t errcap,
                        size_t *err_at) {
  int rc = kvp__codec_geom_ok("nvfp4", geom, err, errcap);
  if (rc) return rc;
  if (geom->head_dim % NVFP4_BLOCK)
    return kvp__param_fail(err, errcap, NULL, 0, "nvfp4: head_dim %u is not a multiple of 16", geom->head_dim);
  nvfp4_inst f = {.head_dim = geom->head_dim, .in_dtype = geom->in_dtype};
  size_t pos = 0;
  unsigned seen = 0;
  kvp__param p;
  while ((rc = kvp__param_next("nvfp4", params, &pos, nvfp4_keys, 2, &seen, &p, err, errcap, err_at)) == 1)
    if ((rc = nvfp4_param(&f, &p, err, errcap, err_at))) return rc;
  if (rc) return rc;
  nvfp4_inst *out = malloc(sizeof *out);
  if (!out) return kvp__param_fail(err, errcap, NULL, 0, "nvfp4: out of memory");
  *out = f;
  *inst = out;
  return KVP_OK;
}

static void nvfp4_destroy(void *inst) { free(inst); }

static uint32_t nvfp4_group_tokens(const void *inst) {
  (void)inst;
  return 1;
}

static void nvfp4_layout(const void *inst, uint32_t cap_tokens, kvp_codec_layout *out) {
  const nvfp4_inst *f = inst;
  memset(out, 0, sizeof *out);
  out->npages = 3;
  out->types[0] = KVP_PAGE_CODES;
  out->bytes[0] = (uint64_t)cap_tokens * (f->head_dim / 2);
  out->types[1] = KVP_PAGE_SCALES;
  out->bytes[1] = (uint64_t)cap_tokens * (f->head_dim / NVFP4_BLOCK + (f->ksmooth ? 2u : 0u));
  out->types[2] = KVP_PAGE_META;
  out->bytes[2] = 4;
}

/* ---- row kernels ------------------------------------------------------------
 * Both ISAs (codecs/kernels.h), the banner's f32 operations in its order.
 *
 * Encode, per row: x (minus the mean), u = x / g; the block amax a from
 * the magnitude bits of u (a NaN counts 0, as fmaxf skipped it; on numbers
 * the bits order as the values); the scale codes of all blocks at once,
 * branch-free: c = E4M3(a / T), kept when c >= 0x08 (its value >= 2^-6),
 * else ceil(a / T * 512) clamped to 1..8, ceil as trunc + (w > trunc);
 * then per block the codes E2M1(u / s). Rule 4/6 compares the two
 * candidates' squared errors: the terms vectorized, their sum in order.
 *
 * Decode, per row: a 256-entry table gives the E2M1 values of both
 * nibbles of a code byte; then (e * s) * g per block, + mean, the row out. */

#define NVFP4_MAX_BLOCKS (KVP_MAX_HEAD_DIM / NVFP4_BLOCK + 8) /* + a chunk of 8 lanes of padding */

/* E2M1 values of the two codes of a byte, low nibble first. */
#define E2M1_MAG(m)                                                                                                    \
  ((m) == 0 ? 0.0f : (m) == 1 ? 0.5f : (m) == 2 ? 1.0f : (m) == 3 ? 1.5f : (m) == 4 ? 2.0f : (m) == 5 ? 3.0f         \
   : (m) == 6 ? 4.0f : 6.0f)
#define E2M1_VAL(c) (((c) & 8) ? -E2M1_MAG((c) & 7) : E2M1_MAG((c) & 7))
#define PAIR(b) {E2M1_VAL((b) & 15), E2M1_VAL((b) >> 4)}
#define PAIR4(b) PAIR(b), PAIR((b) + 1), PAIR((b) + 2), PAIR((b) + 3)
#define PAIR16(b) PAIR4(b), PAIR4((b) + 4), PAIR4((b) + 8), PAIR4((b) + 12)
#define PAIR64(b) PAIR16(b), PAIR16((b) + 16), PAIR16((b) + 32), PAIR16((b) + 48)
static const float e2m1_pair[256][2] = {PAIR64(0), PAIR64(64), PAIR64(128), PAIR64(192)};

KVP__INLINE void sub_n(float *restrict x, float mean, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] -= mean;
}

KVP__INLINE void add_n(float *restrict x, float mean, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] += mean;
}

KVP__INLINE void div_n(float *restrict u, const float *restrict x, float g, size_t n) {
  for (size_t i = 0; i < n; i++) u[i] = x[i] / g;
}

/* Magnitude bits of the largest |u_i| of a block, NaNs as 0. */
KVP__INLINE uint32_t blk_amax_bits(const float *u) {
  uint32_t m = 0;
  for (size_t i = 0; i < NVFP4_BLOCK; i++) {
    uint32_t b = kvp__f32_bits(u[i]) & 0x7FFFFFFFu;
    b &= kvp__mask(b <= 0x7F800000u);
    m = b > m ? b : m;
  }
  return m;
}

/* Scale codes for n blocks of amax bits ab (n a multiple of 8, padding
 * lanes included) and target T. */
KVP__INLINE void scale_codes_n(uint32_t *restrict sc, const uint32_t *restrict ab, float target, size_t n) {
  for (size_t k = 0; k < n; k++) {
    float t = kvp__f32_of(ab[k]) / target;
    uint32_t c = kvp__fp8_e4m3_from_f32_bf(t);
    uint32_t w = kvp__f32_bits(t * 512.0f), wc = w < 0x41800000u ? w : 0x41800000u; /* min(w, 16) */
    int32_t ti = (int32_t)kvp__f32_of(wc);
    uint32_t up = (uint32_t)ti + (uint32_t)(kvp__f32_of(wc) > (float)ti); /* ceil */
    up = up > 1u ? up : 1u;
    up = up < 8u ? up : 8u;
    sc[k] = kvp__sel(kvp__mask(c >= 0x08u), c, up);
  }
}

/* s[i] = v[k] for the 16 elements of each of nsc blocks. */
KVP__INLINE void blk_broadcast(float *restrict s, const float *restrict v, uint32_t nsc) {
  for (uint32_t k = 0; k < nsc; k++)
    for (size_t j = 0; j < NVFP4_BLOCK; j++) s[k * NVFP4_BLOCK + j] = v[k];
}

KVP__INLINE void quant_n(uint32_t *restrict q, const float *restrict u, const float *restrict s, size_t n) {
  for (size_t i = 0; i < n; i++) q[i] = kvp__e2m1_from_f32_bf(u[i] / s[i]);
}

/* Squared error terms, in double, of the elements decoded from the
 * 6-candidate (codes q6, scales s6) and the 4-candidate, against x. */
KVP__INLINE void err_n(double *restrict t6, double *restrict t4, const float *restrict x, const uint32_t *restrict q6,
                       const float *restrict s6, const uint32_t *restrict q4, const float *restrict s4, float g,
                       size_t n) {
  for (size_t i = 0; i < n; i++) {
    double e6 = (double)x[i] - (double)(kvp__e2m1_to_f32_bf((uint8_t)q6[i]) * s6[i] * g);
    double e4 = (double)x[i] - (double)(kvp__e2m1_to_f32_bf((uint8_t)q4[i]) * s4[i] * g);
    t6[i] = e6 * e6;
    t4[i] = e4 * e4;
  }
}

/* Rule 4/6 on a block's terms: 1 when the 4-candidate's squared error is
 * the lower, each error its 16 terms summed in index order (the two sums
 * run as two chains). */
KVP__INLINE int blk_prefer4(const double *t6, const double *t4) {
  double e6 = 0.0, e4 = 0.0;
  for (size_t i = 0; i < NVFP4_BLOCK; i++) {
    e6 += t6[i];
    e4 += t4[i];
  }
  return e4 < e6;
}

/* q = q4 where m (all ones or 0 per element), else kept. */
KVP__INLINE void pick_n(uint32_t *restrict q, const uint32_t *restrict q4, const uint32_t *restrict m, size_t n) {
  for (size_t i = 0; i < n; i++) q[i] = (q4[i] & m[i]) | (q[i] & ~m[i]);
}

KVP__INLINE void nib_pack_n(uint8_t *restrict o, const uint32_t *restrict q, size_t nbytes) {
  for (size_t j = 0; j < nbytes; j++) o[j] = (uint8_t)(q[2 * j] | q[2 * j + 1] << 4);
}

KVP__INLINE void dec_n(float *restrict x, const float *restrict e, const float *restrict s, float g, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = e[i] * s[i] * g;
}

/* bf16 out in the same pass; with the mean added when add_mean. num:
 * no value of the row can be NaN (see nvfp4_dec_rows), so bf16 needs no
 * NaN select. */
KVP__INLINE void dec_bf16_n(uint16_t *restrict o, const float *restrict e, const float *restrict s, float g,
                            float mean, int add_mean, int num, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float v = e[i] * s[i] * g;
    if (add_mean) v += mean;
    o[i] = num ? kvp__bf16_from_f32_num(v) : kvp__bf16_from_f32_bf(v);
  }
}

/* The values of n E4M3 scale codes (n a multiple of 8), as bytes or words. */
KVP__INLINE void scales_n(float *restrict v, const uint8_t *restrict c, size_t n) {
  for (size_t k = 0; k < n; k++) v[k] = kvp__fp8_e4m3_to_f32_bf(c[k]);
}
KVP__INLINE void scales32_n(float *restrict v, const uint32_t *restrict c, size_t n) {
  for (size_t k = 0; k < n; k++) v[k] = kvp__fp8_e4m3_to_f32_bf((uint8_t)c[k]);
}

/* ---- the ksmooth mean -------------------------------------------------------- *
 * mean = (float)(sum / D), the sum of the row in double in index order. When
 * every partial sum is exact, any order gives that sum: the values are
 * multiples of 2^(emin - p + 1) (p significand bits of the in dtype, emin
 * the least exponent of a nonzero value) and partial sums stay below
 * 2^(emax + 1 + log2 D); exact when that spans at most 53 bits. One pass
 * sums in lanes and gathers the exponent range; the lanes fold as a tree
 * (any order), and where the range is too wide the loop runs in order. */

KVP__INLINE void sum_range_n(double *restrict acc, uint32_t *restrict lo, uint32_t *restrict hi,
                             const float *restrict x, size_t n) {
  for (size_t j = 0; j < n; j++) {
    uint32_t b = kvp__f32_bits(x[j]), e = b >> 23 & 0xFFu, z = kvp__mask((b & 0x7FFFFFFFu) == 0);
    uint32_t el = e | (z & 0xFFu), eh = e & ~z; /* zeros count for neither */
    lo[j] = el < lo[j] ? el : lo[j];
    hi[j] = eh > hi[j] ? eh : hi[j];
    acc[j] += (double)x[j];
  }
}

KVP__INLINE void fold_sum_n(double *restrict a, const double *restrict b, size_t n) {
  for (size_t j = 0; j < n; j++) a[j] += b[j];
}

KVP__INLINE double row_sum(const float *x, uint32_t d, unsigned sig_bits) {
  uint32_t lo[KVP__CHUNK], hi[KVP__CHUNK], elo = 0xFFu, ehi = 0;
  double acc[KVP__CHUNK];
  for (size_t j = 0; j < KVP__CHUNK; j++) lo[j] = 0xFFu, hi[j] = 0, acc[j] = 0.0;
#define SR(i, c) sum_range_n(acc, lo, hi, x + (i), (c))
  KVP__FOR_CHUNKS(d, SR);
#undef SR
  for (size_t j = 0; j < KVP__CHUNK; j++) {
    elo = lo[j] < elo ? lo[j] : elo;
    ehi = hi[j] > ehi ? hi[j] : ehi;
  }
  unsigned log2d = 0;
  while ((1u << log2d) < d) log2d++;
  double sum = 0.0;
  if (elo == 0 || ehi == 0xFFu || (ehi > elo && ehi - elo + log2d + sig_bits > 53)) {
    for (uint32_t i = 0; i < d; i++) sum += (double)x[i]; /* subnormal, inf or NaN, or a wide range */
    return sum;
  }
  fold_sum_n(acc, acc + 16, 16);
  fold_sum_n(acc, acc + 8, 8);
  fold_sum_n(acc, acc + 4, 4);
  fold_sum_n(acc, acc + 2, 2);
  return sum + acc[0] + acc[1];
}

/* Significand bits of an in dtype's values. */
static unsigned dtype_sig_bits(kvp_dtype dt) { return dt == KVP_DTYPE_BF16 ? 8 : dt == KVP_DTYPE_F16 ? 11 : 24; }

/* Row t of src in f32 into x, minus its mean when smoothing: the mean is
 * computed and stored when store is set, else read back from the page. */
KVP__INLINE void nvfp4_row(const nvfp4_inst *f, const unsigned char *src, size_t stride, uint32_t t, uint8_t *means,
                           int store, float *x) {
  uint32_t d = f->head_dim;
  kvp__load_row(x, src + (size_t)t * stride, f->in_dtype, d);
  if (!f->ksmooth) return;
  if (store) {
    double sum = row_sum(x, d, dtype_sig_bits(f->in_dtype));
    kvp__st_le16(means + (size_t)t * 2, kvp__bf16_from_f32((float)(sum / d)));
  }
  float mean = kvp__bf16_to_f32_bf(kvp__ld_le16(means + (size_t)t * 2));
#define SUB(i, c) sub_n(x + (i), mean, (c))
  KVP__FOR_CHUNKS(d, SUB);
#undef SUB
}

/* Pass 1: means (stored) and the amax A of the rows. */
KVP__KERNEL(nvfp4_amax_rows, (const nvfp4_inst *f, const unsigned char *src, size_t stride, uint32_t n, uint8_t *means,
                              float *amax),
            (f, src, stride, n, means, amax)) {
  float x[KVP_MAX_HEAD_DIM], a = 0.0f;
  for (uint32_t t = 0; t < n; t++) {
    nvfp4_row(f, src, stride, t, means, 1, x);
    float r = kvp__absmax(x, f->head_dim);
    a = r > a ? r : a;
  }
  *amax = a;
  return KVP_OK;
}

/* Pass 2: the codes and block scales of every row, for g > 0. Per row:
 * u, the block amaxes and both candidates' scale codes, then whole-row
 * passes with each element's block scale beside it. */
KVP__KERNEL(nvfp4_enc_rows, (const nvfp4_inst *f, const unsigned char *src, size_t stride, uint32_t n, float g,
                             uint8_t *codes, uint8_t *scales, uint8_t *means),
            (f, src, stride, n, g, codes, scales, means)) {
  uint32_t d = f->head_dim, nsc = d / NVFP4_BLOCK;
  float x[KVP_MAX_HEAD_DIM], u[KVP_MAX_HEAD_DIM], s6[KVP_MAX_HEAD_DIM], s4[KVP_MAX_HEAD_DIM];
  double t6[KVP_MAX_HEAD_DIM], t4[KVP_MAX_HEAD_DIM];
  uint32_t q[KVP_MAX_HEAD_DIM], q4[KVP_MAX_HEAD_DIM], m4[KVP_MAX_HEAD_DIM]; /* codes in 32 bits: see kvp__narrow8_n */
  uint32_t ab[NVFP4_MAX_BLOCKS] = {0}, sc6[NVFP4_MAX_BLOCKS], sc4[NVFP4_MAX_BLOCKS];
  float v6[NVFP4_MAX_BLOCKS], v4[NVFP4_MAX_BLOCKS];
  for (uint32_t t = 0; t < n; t++) {
    nvfp4_row(f, src, stride, t, means, 0, x);
#define DIV(i, c) div_n(u + (i), x + (i), g, (c))
    KVP__FOR_CHUNKS(d, DIV);
#undef DIV
    for (uint32_t k = 0; k < nsc; k++) ab[k] = blk_amax_bits(u + k * NVFP4_BLOCK);
    for (uint32_t k = 0; k < nsc; k += 8) scale_codes_n(sc6 + k, ab + k, 6.0f, 8);
    for (uint32_t k = 0; k < nsc; k += 8) scales32_n(v6 + k, sc6 + k, 8);
    blk_broadcast(s6, v6, nsc);
#define QUANT(i, c) quant_n(q + (i), u + (i), s6 + (i), (c))
    KVP__FOR_CHUNKS(d, QUANT);
#undef QUANT
    if (f->rule46) { /* no branch on a block's outcome: it is data */
      for (uint32_t k = 0; k < nsc; k += 8) scale_codes_n(sc4 + k, ab + k, 4.0f, 8);
      for (uint32_t k = 0; k < nsc; k += 8) scales32_n(v4 + k, sc4 + k, 8);
      blk_broadcast(s4, v4, nsc);
#define QUANT(i, c) quant_n(q4 + (i), u + (i), s4 + (i), (c))
      KVP__FOR_CHUNKS(d, QUANT);
#undef QUANT
#define ERR(i, c) err_n(t6 + (i), t4 + (i), x + (i), q + (i), s6 + (i), q4 + (i), s4 + (i), g, (c))
      KVP__FOR_CHUNKS(d, ERR);
#undef ERR
      for (uint32_t k = 0; k < nsc; k++) {
        int use4 = ab[k] != 0 && sc4[k] != sc6[k] && blk_prefer4(t6 + k * NVFP4_BLOCK, t4 + k * NVFP4_BLOCK);
        for (size_t j = 0; j < NVFP4_BLOCK; j++) m4[k * NVFP4_BLOCK + j] = kvp__mask(use4);
        sc6[k] = kvp__sel(kvp__mask(use4), sc4[k], sc6[k]);
      }
#define PICK(i, c) pick_n(q + (i), q4 + (i), m4 + (i), (c))
      KVP__FOR_CHUNKS(d, PICK);
#undef PICK
    }
    for (uint32_t k = 0; k < nsc; k++)
      if (ab[k] == 0) { /* a block of zeros: codes and scale 0 */
        memset(q + k * NVFP4_BLOCK, 0, NVFP4_BLOCK * sizeof *q);
        sc6[k] = 0;
      }
    for (uint32_t k = 0; k < nsc; k++) scales[(size_t)t * nsc + k] = (uint8_t)sc6[k];
#define PACK(i, c) nib_pack_n(codes + (size_t)t * (d / 2) + (i) / 2, q + (i), (c) / 2)
    KVP__FOR_CHUNKS(d, PACK);
#undef PACK
  }
  return KVP_OK;
}

KVP__KERNEL(nvfp4_dec_rows, (const nvfp4_inst *f, const uint8_t *codes, const uint8_t *scales, const uint8_t *means,
                             float g, uint32_t t0, uint32_t m, unsigned char *dst, size_t stride, kvp_dtype out),
            (f, codes, scales, means, g, t0, m, dst, stride, out)) {
  uint32_t d = f->head_dim, nsc = d / NVFP4_BLOCK;
  float x[KVP_MAX_HEAD_DIM], e[KVP_MAX_HEAD_DIM], s[KVP_MAX_HEAD_DIM], v[NVFP4_MAX_BLOCKS];
  uint8_t sc[NVFP4_MAX_BLOCKS] = {0}; /* the row's scale codes, padded to whole chunks of 8 */
  for (uint32_t r = 0; r < m; r++) {
    uint32_t t = t0 + r;
    const uint8_t *c = codes + (size_t)t * (d / 2);
    for (uint32_t j = 0; j < d / 2; j++) memcpy(e + 2 * j, e2m1_pair[c[j]], sizeof e2m1_pair[0]);
    memcpy(sc, scales + (size_t)t * nsc, nsc);
    for (uint32_t k = 0; k < nsc; k += 8) scales_n(v + k, sc + k, 8);
    blk_broadcast(s, v, nsc);
    float mean = f->ksmooth ? kvp__bf16_to_f32_bf(kvp__ld_le16(means + (size_t)t * 2)) : 0.0f;
    if (out == KVP_DTYPE_BF16) { /* one pass */
      uint16_t *o = (uint16_t *)(dst + (size_t)r * stride);
      /* (e s) g + mean is a number (inf at worst) when no scale is NaN
       * and g and the mean are finite */
      uint8_t nan_sc = 0;
      for (uint32_t k = 0; k < nsc; k++) nan_sc |= (uint8_t)((sc[k] & 0x7Fu) == 0x7Fu);
      int num = !nan_sc && kvp__finite(g) && kvp__finite(mean);
#define DEC(i, k, a, n) dec_bf16_n(o + (i), e + (i), s + (i), g, mean, (a), (n), (k))
#define DEC11(i, k) DEC(i, k, 1, 1)
#define DEC10(i, k) DEC(i, k, 1, 0)
#define DEC01(i, k) DEC(i, k, 0, 1)
#define DEC00(i, k) DEC(i, k, 0, 0)
      if (f->ksmooth && num) KVP__FOR_CHUNKS(d, DEC11);
      else if (f->ksmooth) KVP__FOR_CHUNKS(d, DEC10);
      else if (num) KVP__FOR_CHUNKS(d, DEC01);
      else KVP__FOR_CHUNKS(d, DEC00);
#undef DEC
#undef DEC11
#undef DEC10
#undef DEC01
#undef DEC00
      continue;
    }
#define DEC(i, k) dec_n(x + (i), e + (i), s + (i), g, (k))
    KVP__FOR_CHUNKS(d, DEC);
#undef DEC
    if (f->ksmooth) {
#define ADD(i, k) add_n(x + (i), mean, (k))
      KVP__FOR_CHUNKS(d, ADD);
#undef ADD
    }
    kvp__store_row(dst + (size_t)r * stride, out, x, d);
  }
  return KVP_OK;
}

/* ---- vtable entries ---------------------------------------------------------- */

static int nvfp4_encode(const void *inst, const void *src, size_t src_stride, uint32_t n, uint32_t cap_tokens,
                        void *const *pages) {
  const nvfp4_inst *f = inst;
  int rc = kvp__codec_rows_ok("nvfp4", n, cap_tokens, 0, n);
  if (rc) return rc;
  uint32_t d = f->head_dim, nsc = d / NVFP4_BLOCK;
  uint8_t *codes = pages[0], *scales = pages[1], *means = scales + (size_t)cap_tokens * nsc;
  float amax;
  memset(codes, 0, (size_t)cap_tokens * (d / 2));
  memset(scales, 0, (size_t)cap_tokens * (nsc + (f->ksmooth ? 2u : 0u)));
  nvfp4_amax_rows(f, src, src_stride, n, means, &amax);
  float g = amax == 0.0f ? 0.0f : amax / NVFP4_GMAX;
  if (g != 0.0f && !(g > FLT_MIN)) g = FLT_MIN;
  kvp__st_lef32(pages[2], g);
  if (g == 0.0f) return KVP_OK;
  return nvfp4_enc_rows(f, src, src_stride, n, g, codes, scales, means);
}

static int nvfp4_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap_tokens, uint32_t t0,
                        uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const nvfp4_inst *f = inst;
  int rc = kvp__codec_rows_ok("nvfp4", n, cap_tokens, t0, m);
  if (rc) return rc;
  uint32_t nsc = f->head_dim / NVFP4_BLOCK;
  const uint8_t *scales = pages[1];
  return nvfp4_dec_rows(f, pages[0], scales, scales + (size_t)cap_tokens * nsc, kvp__ld_lef32(pages[2]), t0, m, dst,
                        dst_stride, out);
}

#ifdef KVP_HAVE_CUDA
void kvp__nvfp4_kparams(const void *inst, kvp__kparams *k) {
  const nvfp4_inst *f = inst;
  memset(k, 0, sizeof *k);
  k->codec = KVP__K_NVFP4;
  k->head_dim = f->head_dim;
  k->in_dtype = f->in_dtype;
  k->nvfp4_rule46 = (uint32_t)f->rule46;
  k->nvfp4_ksmooth = (uint32_t)f->ksmooth;
}
#endif
/* nvfp4_encode_dev, nvfp4_decode_dev: kernels/nvfp4.cuh through KVP__DEV_OPS (codecs/builtin.h). */
KVP__DEV_OPS(nvfp4)

const kvp_codec_vtable kvp__codec_nvfp4 = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "nvfp4",
    .create = nvfp4_create,
    .destroy = nvfp4_destroy,
    .group_tokens = nvfp4_group_tokens,
    .layout = nvfp4_layout,
    .encode = nvfp4_encode,
    .decode = nvfp4_decode,
    KVP__DEV_VT(nvfp4)
};
