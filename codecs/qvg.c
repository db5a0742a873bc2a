/*
 * codecs/qvg.c - the QVG codec (Quant VideoGen): semantic-aware smoothing
 * by k-means over the tokens of a block, progressive residual stages, and
 * a final symmetric INT2/INT4 quantizer with one FP8 E4M3 scale per group.
 * The paper's "segment of N tokens" of one head is one block: in step mode
 * a video chunk is one step, and the pool's default block size (block_tokens
 * = 0: qvg_block_tokens) makes one block per (chunk, head), encoded at once,
 * with cap = N; in stream mode blocks of 2048 tokens (qvg at D = 128).
 *
 * Params (spec "qvg", "qvg:stages=1:group=64:bits=2:k=256:iters=8"):
 *   stages=S  0..8 k-means stages (default 1; 0 = no smoothing: plain
 *             symmetric INT-b per group, the baseline the paper beats)
 *   group=g   8, 16, 32, 64, 128 or 256 elements per FP8 scale (default
 *             64); g must divide head_dim D
 *   bits=b    2 or 4 (default 2)
 *   k=K       1..256 centroids per stage asked for (default 256)
 *   iters=I   0..100, the most Lloyd updates per stage (default 8)
 * "qvg-pro" is the same codec with the QVG-Pro defaults: stages=4,
 * group=16 (bits=2, k=256, iters=8); any of them can be overridden.
 *
 * Centroids per stage: Kc = min(K, cap). A block's layout must be exact
 * before it is encoded, from cap alone, so the paper's "K centroids per
 * segment" becomes Kc; a segment of fewer than K tokens stores one
 * centroid per token slot at most. Of those, Ka = min(Kc, n) are fitted
 * (k-means needs a row per centroid); slots Ka..Kc-1 are zeros.
 *
 * Pages of a block of cap tokens (D, b, g, S; Q = 2^(b-1) - 1):
 *
 *   CODES      cap x D*b/8 bytes: row t at byte t*D*b/8, the D codes of
 *              token t's final residual, each q + Q (0..2Q; q in -Q..Q),
 *              packed most-significant-first (kvp__msb8_pack):
 *                b=2: byte = c0<<6 | c1<<4 | c2<<2 | c3   b=4: c0<<4 | c1
 *   SCALES     cap x D/g bytes: byte t*D/g + j = E4M3 code of the scale of
 *              elements [jg, jg+g) of token t's final residual
 *   CENTROIDS  S x Kc x D x 2 bytes: element i of centroid c of stage s at
 *              byte 2((s Kc + c) D + i), bf16 little-endian
 *   ASSIGN     S x cap bytes: byte s*cap + t = the centroid of token t at
 *              stage s (< Ka)
 *
 *   layout: CODES = cap*D*b/8, SCALES = cap*D/g, CENTROIDS = S*Kc*D*2,
 *           ASSIGN = S*cap (S = 0: CODES and SCALES only)
 *   Per token-head D*b/8 + D/g + S + 2 S Kc D / cap. At D = 128, cap =
 *   38,400 (K = 256): qvg 36.71 B (6.97x against bf16), qvg-pro 50.83 B
 *   (5.04x); 35 B and 44 B (7.31x, 5.82x) as cap grows.
 *
 * Encode (rows in f32: r_0 = x):
 *   for stage s: k-means on r_s (codecs/kmeans.c) from a warm or a cold
 *     start, at most I updates, stopping when no label changes; centroids
 *     rounded to bf16 (as stored), every row reassigned to its nearest
 *     rounded centroid a_s(t), r_(s+1) = r_s - C_s[a_s(t)] in f32
 *   per group of the final residual r = r_S: A = max |r_i|,
 *     scale code = E4M3(A / Q) (round to nearest even, saturating at 448),
 *     s = its value, q_i = round_even(r_i / s) clamped to [-Q, Q]
 * Decode: y_i = (q_i * s) + C_(S-1)[a] + ... + C_0[a], in f32 (the first
 *   product is exact), one rounding to the out dtype at the end.
 *
 * Cold start: k-means++ (D^2 sampling) with a fixed seed per stage, so the
 *   same rows give the same pages, byte for byte. Warm start (stateful
 *   encode): stage s starts from stage s's centroids of the stream's
 *   previous block, min(Kw, Ka) of them (Kw held), k-means++ adds the rest.
 * Empty clusters keep their centroid (warm ones too).
 * FP8 underflow rule: a group with A/Q <= 2^-10 (half the least E4M3
 *   subnormal 2^-9; the tie rounds to even, 0) has scale code 0; its codes
 *   are written as q = 0 and it decodes to exactly 0 plus the centroids.
 *   Subnormal scales (A/Q in (2^-10, 2^-6)) are kept, coarser, and
 *   |r_i/s| clamps at Q.
 * Saturation: A/Q above 448 gives the scale 448; its codes clamp at +-Q.
 * Range: values within the bf16 range (f32 input beyond it rounds a
 *   centroid to +-inf, and the row decodes to +-inf).
 * Cost: per stage at most (I + 2) n Ka D multiply-adds (assignments), plus
 *   n Ka D for k-means++ on a cold start; codecs/kmeans.c skips, exactly,
 *   the rows and centroids that cannot change a label, so structured rows
 *   cost a fraction of it: a cold qvg encode of a 4096-token segment-head
 *   (D = 128, K = 256, one core) takes about 12 ms on clustered rows and
 *   50 ms on noise (build/kvpool-bench --qvg, figure qvg_encode_mbs).
 *
 * Invariants: x - y = r - (q * s) up to the f32 rounding of the stage
 *   adds (smoothing is lossless bookkeeping: every loss is the final
 *   quantizer's), and |r_i - q_i s| <= s/2 unless r_i clamps. Tokens that
 *   bf16 holds exactly and that are all equal reconstruct exactly (their
 *   centroid is their value, the residual 0); zeros decode to zeros.
 *   Scaling the input by 2^k scales centroids and scales by 2^k and keeps
 *   codes and assignments: the output scales by exactly 2^k (while every
 *   scale stays a normal E4M3, A/Q in [2^-6, 448]). Rows n..cap-1 of
 *   CODES, SCALES and ASSIGN are zeros.
 *
 * Per-stream state (the warm start), state_bytes = 8 + S*K*D*2 (0 if S = 0):
 *   bytes 0-3  Kw, centroids per stage held, u32 little-endian (0: none,
 *              the state as the pool zeroes it: cold start)
 *   bytes 4-7  zero
 *   byte 8 + 2((s K + c) D + i): element i of centroid c < Kw of stage s,
 *              bf16 little-endian: the last block's CENTROIDS, copied
 *   About 64 KiB per stream for qvg and 256 KiB for qvg-pro at D = 128.
 */
#include "builtin.h"
#include "kernels.h"
#include "kmeans.h"
#include "numeric.h"
#if KVP__HAVE_AVX2
#include <immintrin.h>
#endif

#define QVG_MAX_STAGES 8u
#define QVG_MAX_ITERS 100u
#define QVG_STATE_HDR 8u       /* bytes before the state's centroids */
#define QVG_SEED 0x51564730ULL /* k-means++ seed of stage 0 ("QVG0") */

enum { PG_CODES, PG_SCALES, PG_CENT, PG_ASSIGN };

/* A binding of qvg or qvg-pro. */
typedef struct qvg_inst {
  const char *name;   /* "qvg" or "qvg-pro", for messages */
  uint32_t head_dim;  /* D, elements per token, a multiple of group */
  kvp_dtype in_dtype; /* dtype of appended rows */
  uint32_t stages;    /* S, k-means stages, 0..8 */
  uint32_t group;     /* g, elements per FP8 scale */
  uint32_t bits;      /* b, 2 or 4 */
  uint32_t k;         /* K, centroids per stage asked, 1..256 */
  uint32_t iters;     /* most Lloyd updates per stage */
  struct kvp__qvg_dev *dev; /* device scratch of the codec used alone (codecs/qvg_cuda.c), or NULL */
} qvg_inst;

static const qvg_inst qvg_defaults = {.name = "qvg", .stages = 1, .group = 64, .bits = 2, .k = 256, .iters = 8};
static const qvg_inst pro_defaults = {.name = "qvg-pro", .stages = 4, .group = 16, .bits = 2, .k = 256, .iters = 8};

static uint32_t qvg_qmax(const qvg_inst *q) { return (1u << (q->bits - 1)) - 1; }
static uint32_t qvg_kc(const qvg_inst *q, uint32_t cap) { return q->k < cap ? q->k : cap; }

/* ---- params ----------------------------------------------------------------- */

enum { KEY_STAGES, KEY_GROUP, KEY_BITS, KEY_K, KEY_ITERS, NKEYS };
static const char *const qvg_keys[NKEYS] = {"stages", "group", "bits", "k", "iters"};

static int qvg_param(qvg_inst *q, const kvp__param *p, char *err, size_t errcap, size_t *err_at) {
  static const struct {
    uint32_t lo, hi; /* accepted range */
    const char *want;
  } rule[NKEYS] = {{0, QVG_MAX_STAGES, "0..8"},
                   {8, 256, "8, 16, 32, 64, 128 or 256"},
                   {2, 4, "2 or 4"},
                   {1, KVP__KM_MAX_K, "1..256"},
                   {0, QVG_MAX_ITERS, "0..100"}};
  uint32_t v = 0;
  int ok = kvp__param_u32(p, &v) && v >= rule[p->key].lo && v <= rule[p->key].hi;
  if (p->key == KEY_GROUP) ok = ok && (v & (v - 1)) == 0;
  if (p->key == KEY_BITS) ok = ok && v != 3;
  if (!ok) /* (val is never NULL here; the guard quiets gcc's -Wformat-overflow) */
    return kvp__param_fail(err, errcap, err_at, p->at, "%s: %s=%.*s: must be %s", q->name, qvg_keys[p->key],
                           (int)p->val_len, p->val ? p->val : "", rule[p->key].want);
  uint32_t *field[NKEYS] = {&q->stages, &q->group, &q->bits, &q->k, &q->iters};
  *field[p->key] = v;
  return KVP_OK;
}

static int qvg_make(const qvg_inst *defaults, const char *params, const kvp_codec_geom *geom, void **inst, char *err,
                    size_t errcap, size_t *err_at) {
  int rc = kvp__codec_geom_ok(defaults->name, geom, err, errcap);
  if (rc) return rc;
  qvg_inst q = *defaults;
  q.head_dim = geom->head_dim;
  q.in_dtype = geom->in_dtype;
  size_t pos = 0, group_at = 0;
  unsigned seen = 0;
  kvp__param p;
  while ((rc = kvp__param_next(q.name, params, &pos, qvg_keys, NKEYS, &seen, &p, err, errcap, err_at)) == 1) {
    if ((rc = qvg_param(&q, &p, err, errcap, err_at))) return rc;
    if (p.key == KEY_GROUP) group_at = p.at;
  }
  if (rc) return rc;
  if (q.head_dim % q.group)
    return kvp__param_fail(err, errcap, err_at, group_at, "%s: group=%u does not divide head_dim %u", q.name, q.group,
                           q.head_dim);
  qvg_inst *out = malloc(sizeof *out);
  if (!out) return kvp__param_fail(err, errcap, NULL, 0, "%s: out of memory", q.name);
  *out = q;
  out->dev = NULL;
  *inst = out;
  return KVP_OK;
}

static int qvg_create(const char *params, const kvp_codec_geom *geom, void **inst, char *err, size_t errcap,
                      size_t *err_at) {
  return qvg_make(&qvg_defaults, params, geom, inst, err, errcap, err_at);
}

static int qvg_pro_create(const char *params, const kvp_codec_geom *geom, void **inst, char *err, size_t errcap,
                          size_t *err_at) {
  return qvg_make(&pro_defaults, params, geom, inst, err, errcap, err_at);
}

static void qvg_destroy(void *inst) {
#ifdef KVP_HAVE_CUDA
  kvp__qvg_dev_release(((qvg_inst *)inst)->dev);
#endif
  free(inst);
}

static uint32_t qvg_group_tokens(const void *inst) {
  (void)inst;
  return 1; /* a block is the segment: any n <= cap is one k-means problem */
}

static void qvg_layout(const void *inst, uint32_t cap_tokens, kvp_codec_layout *out) {
  const qvg_inst *q = inst;
  uint64_t cap = cap_tokens, d = q->head_dim;
  memset(out, 0, sizeof *out);
  out->npages = q->stages ? 4 : 2;
  out->types[PG_CODES] = KVP_PAGE_CODES;
  out->bytes[PG_CODES] = cap * d * q->bits / 8;
  out->types[PG_SCALES] = KVP_PAGE_SCALES;
  out->bytes[PG_SCALES] = cap * (d / q->group);
  if (!q->stages) return;
  out->types[PG_CENT] = KVP_PAGE_CENTROIDS;
  out->bytes[PG_CENT] = (uint64_t)q->stages * qvg_kc(q, cap_tokens) * d * 2;
  out->types[PG_ASSIGN] = KVP_PAGE_ASSIGN;
  out->bytes[PG_ASSIGN] = (uint64_t)q->stages * cap;
}

/* Block sizes (block_tokens): in step mode a block is the whole step (the
 * paper's segment: a video chunk). In stream mode, the smallest power of
 * two cap >= 256 whose centroids cost at most the per-token bytes,
 * 2 S Kc D / cap <= D*b/8 + D/g + S, so a block holds at most twice its
 * asymptotic bytes (D = 128: qvg 2048, qvg-pro 8192; k=16: 256). Without
 * stages no side data is paid per block: no preference. */
#define QVG_MIN_STREAM_BLOCK 256u
#define QVG_MAX_BLOCK 65536u
static uint32_t qvg_block_tokens(const void *inst, kvp_seq_mode mode) {
  const qvg_inst *q = inst;
  if (!q->stages) return 0;
  if (mode == KVP_SEQ_STEP) return KVP_CODEC_WHOLE_STEP;
  uint64_t d = q->head_dim, per_token = d * q->bits / 8 + d / q->group + q->stages;
  uint32_t cap = QVG_MIN_STREAM_BLOCK;
  while (cap < QVG_MAX_BLOCK && 2ull * q->stages * qvg_kc(q, cap) * d > per_token * cap) cap *= 2;
  return cap;
}

static size_t qvg_state_bytes(const void *inst) {
  const qvg_inst *q = inst;
  return q->stages ? QVG_STATE_HDR + (size_t)q->stages * q->k * q->head_dim * 2 : 0;
}

/* ---- the final residual quantizer --------------------------------------------- */

/* round_even(v) for |v| < 2^22 by the f32 addition of 1.5 * 2^23 (whose
 * rounding is to nearest even), and a value of magnitude >= 2^22 (or an
 * infinity, or a NaN) for the others, which the clamp after it maps as it
 * maps round_even's: kvp__round_even's results through a cheaper path. */
static inline float qvg_rne(float v) {
  const float magic = 12582912.0f; /* 1.5 * 2^23 */
  return (v + magic) - magic;
}

/* kvp__msb8_pack of a row's D codes (D % 8 == 0) for b = 2 and 4, a byte
 * at a time instead of a bit stream: the same bytes. */
static void qvg_pack(uint8_t *restrict dst, const uint8_t *restrict c, uint32_t d, uint32_t bits) {
  if (bits == 2)
    for (uint32_t o = 0; o < d / 4; o++)
      dst[o] = (uint8_t)(c[4 * o] << 6 | c[4 * o + 1] << 4 | c[4 * o + 2] << 2 | c[4 * o + 3]);
  else
    for (uint32_t o = 0; o < d / 2; o++) dst[o] = (uint8_t)(c[2 * o] << 4 | c[2 * o + 1]);
}

#if KVP__HAVE_AVX2
/* qvg_quant_row's codes and scales with AVX2, eight elements a step (g %
 * 8 == 0): the maximum of |r_i| (order does not change a maximum; maxps
 * keeps the running value against a NaN, as the scalar test does), then
 * per element the same division, rounding add, clamps (maxps / minps are
 * the scalar comparisons, NaN included) and conversion: the same codes. */
__attribute__((target("avx2"))) static void qvg_quant_avx2(const qvg_inst *q, const float *r, uint8_t *c,
                                                          uint8_t *scales) {
  float qm = (float)qvg_qmax(q);
  const __m256 sign = _mm256_set1_ps(-0.0f), magic = _mm256_set1_ps(12582912.0f);
  const __m256 lo = _mm256_set1_ps(-qm), hi = _mm256_set1_ps(qm);
  for (uint32_t g0 = 0, j = 0; g0 < q->head_dim; g0 += q->group, j++) {
    __m256 m = _mm256_setzero_ps();
    for (uint32_t i = g0; i < g0 + q->group; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(r + i)), m);
    m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
    m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
    uint8_t sc = kvp__fp8_e4m3_from_f32(_mm256_cvtss_f32(m) / qm);
    __m256 sv = _mm256_set1_ps(kvp__fp8_e4m3_to_f32(sc));
    scales[j] = sc;
    for (uint32_t i = g0; i < g0 + q->group; i += 8) {
      __m256 v = _mm256_setzero_ps();
      if (sc) v = _mm256_sub_ps(_mm256_add_ps(_mm256_div_ps(_mm256_loadu_ps(r + i), sv), magic), magic);
      v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
      __m256i k = _mm256_cvttps_epi32(_mm256_add_ps(v, hi));
      __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(k), _mm256_extracti128_si256(k, 1));
      _mm_storel_epi64((__m128i *)(c + i), _mm_packus_epi16(w, w));
    }
  }
}
#endif

/* Quantize one row r (D elements) into its packed codes and its scales.
 * The maximum and the clamp are written as comparisons (a NaN loses each,
 * as in fmaxf / fminf: a NaN element leaves the maximum, a NaN quotient
 * maps to -Q), so no libm call remains per element. */
static void qvg_quant_row(const qvg_inst *q, const float *r, uint8_t *codes, uint8_t *scales) {
  uint8_t c[KVP_MAX_HEAD_DIM];
  float qm = (float)qvg_qmax(q);
#if KVP__HAVE_AVX2
  if (kvp__codec_isa() >= KVP__ISA_AVX2) {
    qvg_quant_avx2(q, r, c, scales);
    qvg_pack(codes, c, q->head_dim, q->bits);
    return;
  }
#endif
  for (uint32_t g0 = 0, j = 0; g0 < q->head_dim; g0 += q->group, j++) {
    float amax = 0.0f;
    for (uint32_t i = g0; i < g0 + q->group; i++) {
      float a = fabsf(r[i]);
      amax = a > amax ? a : amax;
    }
    uint8_t sc = kvp__fp8_e4m3_from_f32(amax / qm); /* 0 when A/Q <= 2^-10: the group is zeros */
    float s = kvp__fp8_e4m3_to_f32(sc);
    scales[j] = sc;
    for (uint32_t i = g0; i < g0 + q->group; i++) {
      float v = sc ? qvg_rne(r[i] / s) : 0.0f;
      v = v > -qm ? v : -qm; /* also maps a NaN quotient to -Q */
      v = v < qm ? v : qm;
      c[i] = (uint8_t)(v + qm);
    }
  }
  qvg_pack(codes, c, q->head_dim, q->bits);
}

/* ---- smoothing stages ------------------------------------------------------------ */

/* The rows' centroids of stage s are final in km->cent: round them to bf16
 * into the CENTROIDS page (and km), reassign every row to the rounded
 * centroids into the ASSIGN page, subtract. */
static void qvg_stage_out(const qvg_inst *q, kvp__km *km, float *r, uint32_t s, uint32_t cap, void *const *pages) {
  uint32_t d = q->head_dim;
  uint8_t *cent = (uint8_t *)pages[PG_CENT] + (size_t)s * qvg_kc(q, cap) * d * 2;
  uint8_t *asg = (uint8_t *)pages[PG_ASSIGN] + (size_t)s * cap;
  for (size_t e = 0; e < (size_t)km->k * d; e++) {
    uint16_t b = kvp__bf16_from_f32(km->cent[e]);
    kvp__st_le16(cent + 2 * e, b);
    km->cent[e] = kvp__bf16_to_f32(b);
  }
  kvp__km_assign(km, r, 0);
  for (uint32_t t = 0; t < km->n; t++) {
    const float *restrict c = km->cent + (size_t)km->label[t] * d;
    float *restrict x = r + (size_t)t * d;
    asg[t] = km->label[t];
    for (uint32_t i = 0; i < d; i += 8) /* d % 8 == 0 (kmeans.h): chunks of 8 vectorize */
      for (uint32_t e = 0; e < 8; e++) x[i + e] -= c[i + e];
  }
}

/* The first nwarm centroids of stage s from the state. */
static void qvg_warm(const qvg_inst *q, const uint8_t *state, uint32_t s, uint32_t nwarm, kvp__km *km) {
  const uint8_t *src = state + QVG_STATE_HDR + (size_t)s * q->k * q->head_dim * 2;
  for (size_t e = 0; e < (size_t)nwarm * q->head_dim; e++) km->cent[e] = kvp__bf16_to_f32(kvp__ld_le16(src + 2 * e));
}

/* The state after a block: its Ka fitted centroids of every stage. */
static void qvg_keep(const qvg_inst *q, uint8_t *state, uint32_t ka, uint32_t cap, void *const *pages) {
  size_t row = (size_t)q->head_dim * 2;
  kvp__st_le32(state, ka);
  kvp__st_le32(state + 4, 0);
  for (uint32_t s = 0; s < q->stages; s++)
    memcpy(state + QVG_STATE_HDR + s * q->k * row, (const uint8_t *)pages[PG_CENT] + s * qvg_kc(q, cap) * row,
           ka * row);
}

/* Every stage on the rows r (n x D, replaced by the final residual). */
static int qvg_smooth(const qvg_inst *q, uint8_t *state, float *r, uint32_t n, uint32_t cap, void *const *pages) {
  uint32_t ka = qvg_kc(q, cap) < n ? qvg_kc(q, cap) : n, kw = state ? kvp__ld_le32(state) : 0;
  uint32_t nwarm = kw < ka ? kw : ka;
  kvp__km km;
  if (kvp__km_init(&km, n, q->head_dim, ka))
    return kvp__err(KVP_ECODEC, "%s: out of memory for the k-means of %u tokens x %u centroids", q->name, n, ka);
  for (uint32_t s = 0; s < q->stages; s++) {
    if (nwarm) qvg_warm(q, state, s, nwarm, &km);
    kvp__km_seed(&km, r, nwarm, QVG_SEED + s);
    kvp__km_lloyd(&km, r, q->iters);
    qvg_stage_out(q, &km, r, s, cap, pages);
  }
  kvp__km_free(&km);
  if (state) qvg_keep(q, state, ka, cap, pages);
  return KVP_OK;
}

/* ---- encode and decode -------------------------------------------------------------- */

static int qvg_encode_core(const qvg_inst *q, uint8_t *state, const void *src, size_t src_stride, uint32_t n,
                           uint32_t cap, void *const *pages) {
  int rc = kvp__codec_rows_ok(q->name, n, cap, 0, n);
  if (rc) return rc;
  kvp_codec_layout lay;
  qvg_layout(q, cap, &lay);
  for (uint32_t p = 0; p < lay.npages; p++) memset(pages[p], 0, lay.bytes[p]);
  if (n == 0) return KVP_OK;
  uint32_t d = q->head_dim, ng = d / q->group, rb = d * q->bits / 8;
  float *r = malloc((size_t)n * d * sizeof *r);
  if (!r) return kvp__err(KVP_ECODEC, "%s: out of memory for %u tokens x %u", q->name, n, d);
  for (uint32_t t = 0; t < n; t++)
    kvp__row_to_f32(r + (size_t)t * d, (const unsigned char *)src + (size_t)t * src_stride, q->in_dtype, d);
  if (q->stages) rc = qvg_smooth(q, state, r, n, cap, pages);
  for (uint32_t t = 0; !rc && t < n; t++)
    qvg_quant_row(q, r + (size_t)t * d, (uint8_t *)pages[PG_CODES] + (size_t)t * rb,
                  (uint8_t *)pages[PG_SCALES] + (size_t)t * ng);
  free(r);
  return rc;
}

static int qvg_encode(const void *inst, const void *src, size_t src_stride, uint32_t n, uint32_t cap_tokens,
                      void *const *pages) {
  return qvg_encode_core(inst, NULL, src, src_stride, n, cap_tokens, pages);
}

static int qvg_encode_stateful(const void *inst, void *state, const void *src, size_t src_stride, uint32_t n,
                               uint32_t cap_tokens, void *const *pages) {
  return qvg_encode_core(inst, state, src, src_stride, n, cap_tokens, pages);
}

/* A bf16 little-endian element widened to f32 (exact). */
static inline float qvg_ld_bf16(const uint8_t *p) {
  uint32_t u = (uint32_t)(p[0] | p[1] << 8) << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Row t into y (f32): codes times scales, then the centroids from the
 * last stage back to the first. KVP_ECODEC for an assignment >= Kc. */
static int qvg_row(const qvg_inst *q, const void *const *pages, uint32_t cap, uint32_t t, float *y) {
  uint32_t d = q->head_dim, ng = d / q->group, kc = qvg_kc(q, cap);
  int qm = (int)qvg_qmax(q);
  uint8_t c[KVP_MAX_HEAD_DIM];
  const uint8_t *scales = (const uint8_t *)pages[PG_SCALES] + (size_t)t * ng;
  kvp__msb8_unpack(c, (const uint8_t *)pages[PG_CODES] + (size_t)t * (d * q->bits / 8), d, q->bits);
  for (uint32_t j = 0; j < ng; j++) {
    float s = kvp__fp8_e4m3_to_f32(scales[j]);
    for (uint32_t i = j * q->group; i < (j + 1) * q->group; i++) y[i] = (float)((int)c[i] - qm) * s;
  }
  for (uint32_t s = q->stages; s-- > 0;) {
    uint32_t a = ((const uint8_t *)pages[PG_ASSIGN])[(size_t)s * cap + t];
    if (a >= kc) return kvp__err(KVP_ECODEC, "%s: token %u stage %u: centroid %u of %u", q->name, t, s, a, kc);
    const uint8_t *cent = (const uint8_t *)pages[PG_CENT] + ((size_t)s * kc + a) * d * 2;
    for (uint32_t i = 0; i < d; i++) y[i] += qvg_ld_bf16(cent + 2 * i);
  }
  return KVP_OK;
}

static int qvg_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap_tokens, uint32_t t0,
                      uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const qvg_inst *q = inst;
  int rc = kvp__codec_rows_ok(q->name, n, cap_tokens, t0, m);
  float y[KVP_MAX_HEAD_DIM];
  for (uint32_t r = 0; !rc && r < m; r++) {
    rc = qvg_row(q, pages, cap_tokens, t0 + r, y);
    if (!rc) kvp__row_from_f32((unsigned char *)dst + (size_t)r * dst_stride, out, y, q->head_dim);
  }
  return rc;
}

/* ---- device twins (codecs/qvg_cuda.c, kernels/qvg.cuh) ---------------------------- */

#ifdef KVP_HAVE_CUDA
void kvp__qvg_kparams_of(const void *inst, kvp__qvg_kparams *k) {
  const qvg_inst *q = inst;
  *k = (kvp__qvg_kparams){.head_dim = q->head_dim, .in_dtype = (uint32_t)q->in_dtype, .stages = q->stages,
                          .group = q->group, .bits = q->bits, .k = q->k, .iters = q->iters};
}
const char *kvp__qvg_name(const void *inst) { return ((const qvg_inst *)inst)->name; }
size_t kvp__qvg_state_bytes(const void *inst) { return qvg_state_bytes(inst); }
struct kvp__qvg_dev **kvp__qvg_dev_slot(const void *inst) { return &((qvg_inst *)inst)->dev; }
#define QVG_DEV_VT .encode_dev = kvp__qvg_encode_dev, .decode_dev = kvp__qvg_decode_dev,
#else
#define QVG_DEV_VT
#endif

const kvp_codec_vtable kvp__codec_qvg = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "qvg",
    .create = qvg_create,
    .destroy = qvg_destroy,
    .group_tokens = qvg_group_tokens,
    .layout = qvg_layout,
    .encode = qvg_encode,
    .decode = qvg_decode,
    .state_bytes = qvg_state_bytes,
    .encode_stateful = qvg_encode_stateful,
    .block_tokens = qvg_block_tokens,
    QVG_DEV_VT
};

const kvp_codec_vtable kvp__codec_qvg_pro = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "qvg-pro",
    .create = qvg_pro_create,
    .destroy = qvg_destroy,
    .group_tokens = qvg_group_tokens,
    .layout = qvg_layout,
    .encode = qvg_encode,
    .decode = qvg_decode,
    .state_bytes = qvg_state_bytes,
    .encode_stateful = qvg_encode_stateful,
    .block_tokens = qvg_block_tokens,
    QVG_DEV_VT
};
