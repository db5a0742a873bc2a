/*
 * codecs/kvquant.c - the KVQuant codec: non-uniform codebooks (nuqX) from
 * offline calibration, keys per channel (optionally before RoPE, applied at
 * decode), values per token, the k largest values of each token as sparse
 * fp16 outliers, and the first tokens of a stream kept RAW (attention sink).
 *
 * Params (spec "kvquant", "kvquant:bits=3:calib=synthetic:seed=7"):
 *   bits=2|3|4           code width b (default 3)
 *   calib=synthetic|PATH the calibration: fitted at create from the built-in
 *                        generator (default), or read from a calibration
 *                        file (codecs/kvquant_calib.c; PATH holds no ':',
 *                        ',' or ';'). A bad file fails pool creation with
 *                        KVP_EFORMAT naming the file and field.
 *   seed=N               synthetic: the generator's seed (default 0)
 *   calib_tokens=N       synthetic: sample tokens per head, 16..65536 (256)
 *   outliers=F           fraction of each token's values kept as sparse
 *                        outliers, [0, 0.5): k = ceil(F D) (default 0.01);
 *                        also the percentile the calibration excludes
 *   outlier_mode=topk|threshold
 *                        topk: the k largest of every token (default);
 *                        threshold: the values outside the calibrated
 *                        range (score > 1 below), at most D/2 a token, so
 *                        k varies with the data
 *   sink=N               the first N positions of a stream stay RAW (1)
 *   lut=nuq|uniform      the calibrated codebook, or the uniform one on
 *                        [-1, 1] (the ablation without NUQ) (nuq)
 *   prerope=0|1          K only: keys arrive before RoPE; decode rotates
 *                        them at each token's position (0)
 *   theta=F              RoPE base (10000)
 *   rope_dims=N          leading channels rotated, even, <= D (D)
 *
 * Normalization (off, rng from calibration per (head, channel); m, r per
 * token; codebook L[0 .. 2^b) non-decreasing):
 *   K: n_c = (x_c - off_c) inv_c            decode: L[q_c] rng_c + off_c
 *   V: the outliers (by |x_c - off_c| inv_c) aside, m and r are the middle
 *      and half-width of the token's other values, stored as fp16 m', r';
 *      n_c = (x_c - m') (1 / r') (0 when r' = 0); decode: L[q_c] r' + m'
 *   (inv_c = 1 / rng_c in f32, computed once at create)
 *   q_c = the number of midpoints (L[j] + L[j+1]) / 2 (f32) strictly below
 *   n_c: the nearest entry, ties to the lower index.
 * Outliers: per token the channels of largest score, |n_c| (K) or
 *   |x_c - off_c| inv_c (V): the k largest (topk) or those above 1
 *   (threshold; the D/2 largest when more), ties to the lower channel,
 *   listed by ascending channel. Their dense code is kept (the nearest
 *   entry to n_c); the outlier value is the residual e_c =
 *   fp16(x_c - dense_c), and decode
 *   adds it back: x^_c = dense_c + e_c. So the dense-and-sparse split is
 *   exact: the full decode is the dense decode plus the sparse values at
 *   their channels (f32 addition). A residual beyond fp16's range
 *   (|e| > 65504), or a V token whose m or r is, fails with KVP_ECODEC.
 * RoPE (prerope=1, K): after the outliers, channels i and i + R/2 (i <
 *   R/2, R = rope_dims) of the token at position p turn by p * theta^(-2i/R)
 *   (the rotate-half convention of LLaMA/GPT-NeoX), angles and sines in
 *   double (theta^(-2i/R) by pow once at create, sin and cos by
 *   kvp__sincos, so the device decode gives the same bits), the rotation in
 *   f32: y_i = x_i cos - x_{i+R/2} sin, y_{i+R/2} = x_{i+R/2} cos + x_i sin.
 * Sinks: rows whose position (pos0 + t) is below sink are copied RAW in
 *   the appended dtype and decode exactly (then RoPE'd, if configured);
 *   their CODES, OUTLIERS and SCALES rows are zero.
 *
 * Pages of a block of cap tokens at position pos0 (layout_at), in order:
 *
 *   CODES     cap x R bytes, R = 4 ceil(D b / 32): row t = D codes packed
 *             LSB-first in little-endian 32-bit words (kvp__lsb32_pack):
 *             channel c at bits [b c, b c + b) of the row's bit stream. With
 *             b = 3 codes straddle bytes and words: channel 2 takes bits 6-7
 *             of byte 0 and bit 0 of byte 1; channel 10 bits 30-31 of word
 *             0 and bit 0 of word 1. Padding bits are 0.
 *   OUTLIERS  topk (k > 0): cap x k (w + 2) bytes, CSR with implied row
 *             starts (row t at byte t k (w + 2)): k channels (w = 1 byte
 *             each when D <= 256, else 2, little-endian, ascending), then
 *             k fp16 residuals (little-endian) in the same order.
 *             threshold: CSR with row starts: cap + 1 u32 (little-endian;
 *             start[t] = entries of rows before t), then entries of w + 2
 *             bytes (channel, fp16 residual) from byte 4 (cap + 1).
 *             layout_at sizes it for D/2 entries a row (a bound, used only
 *             where the layer is not row-wise); an OPEN or row-wise block
 *             holds 4 (cap + 1) + start[n] (w + 2) bytes.
 *   SCALES    (V only) cap x 4 bytes: token t's fp16 m' (bytes 4t, 4t+1)
 *             and fp16 r' (4t+2, 4t+3), little-endian.
 *   RAW       (pos0 < sink) min(sink - pos0, cap) rows of D in the appended
 *             dtype: the sink rows t < sink - pos0.
 *
 *   Per token-head (away from the sink): R + k (w + 2) (+ 4 for V); at
 *   D = 128, b = 3, 1% outliers (k = 2): K 48 + 6 = 54 B (4.74x against
 *   bf16), V 58 B.
 *
 * Row by row (open_layout, encode_rows): the pool builds every block of a
 * layer whose K and V are both kvquant token by token; an OPEN block has
 * CODES, SCALES and RAW at full capacity and OUTLIERS for the n rows it
 * holds (n k (w + 2) bytes), so that page grows as tokens arrive. Sealed,
 * the block is exactly layout_at's (topk), or holds its entries (threshold).
 *
 * State: none per stream. Static data: the calibration of the binding's
 * layer and side and the inverse ranges, 3 H D floats, and R/2 RoPE
 * frequencies (counted as bytes.codec_static). On a CUDA region a copy of
 * them lives on the device (kvp__kvq_dev_image, codecs/kvquant_cuda.c;
 * counted as device.control_bytes), and the device ops
 * (kernels/kvquant.cuh) are encode_rows' and decode_at's twins.
 */
#include "builtin.h"
#include "kvquant.h"
#include "numeric.h"

typedef struct kvq_inst {
  uint32_t head_dim;        /* D */
  uint32_t n_heads;         /* H */
  uint32_t kv;              /* 0 = K, 1 = V */
  kvp_dtype in_dtype;       /* appended dtype (sink rows) */
  uint32_t bits;            /* b */
  uint32_t k;               /* outliers per token (topk) */
  bool thresh;              /* outlier_mode=threshold: k varies per token */
  uint32_t kmax;            /* most outliers of a token: k, or D / 2 (threshold) */
  uint32_t cw;              /* bytes of an outlier's channel: 1 or 2 */
  uint32_t row_bytes;       /* CODES bytes per token */
  uint32_t sink;            /* RAW positions at the stream's start */
  bool prerope;             /* K arrives before RoPE */
  uint32_t rope_dims;       /* R */
  double theta;             /* RoPE base */
  kvp__kvq_side cal;        /* calibration of this layer and side */
  float *inv;               /* [H * D]: 1 / cal.rng (malloc) */
  float lut[KVP__KVQ_LUT_MAX]; /* codebook in use */
  float mid[KVP__KVQ_LUT_MAX]; /* 2^b - 1 midpoints */
  double *inv_freq;         /* [R / 2] theta^(-2i/R), prerope only (malloc), else NULL */
  struct kvp__kvq_dev *dev; /* the device copy of the tables (codecs/kvquant_cuda.c), or NULL */
} kvq_inst;

enum { KEY_BITS, KEY_CALIB, KEY_SEED, KEY_CALIB_TOKENS, KEY_OUTLIERS, KEY_SINK, KEY_LUT, KEY_PREROPE, KEY_THETA,
       KEY_ROPE_DIMS, KEY_OUTLIER_MODE, NKEYS };
static const char *const kvq_keys[NKEYS] = {"bits", "calib", "seed", "calib_tokens", "outliers", "sink", "lut",
                                            "prerope", "theta", "rope_dims", "outlier_mode"};

/* ---- create ---------------------------------------------------------------- */

typedef struct kvq_params {
  char calib[256];       /* "synthetic" or a path */
  uint32_t seed, calib_tokens;
  float fraction;
  bool uniform;
  size_t rope_at;        /* offset of rope_dims= for messages */
} kvq_params;

static int kvq_param(kvq_inst *q, kvq_params *pp, const kvp__param *p, char *err, size_t errcap, size_t *err_at) {
  uint32_t v;
  float f;
#define BAD(...) kvp__param_fail(err, errcap, err_at, p->at, __VA_ARGS__)
  switch (p->key) {
  case KEY_BITS:
    if (!kvp__param_u32(p, &v) || v < 2 || v > 4) return BAD("kvquant: bits=%.*s: want 2, 3 or 4", (int)p->val_len, p->val);
    q->bits = v;
    break;
  case KEY_CALIB:
    if (p->val_len == 0 || p->val_len >= sizeof pp->calib)
      return BAD("kvquant: calib: want synthetic or a path of 1..%zu bytes", sizeof pp->calib - 1);
    memcpy(pp->calib, p->val, p->val_len);
    pp->calib[p->val_len] = 0;
    break;
  case KEY_SEED:
    if (!kvp__param_u32(p, &pp->seed)) return BAD("kvquant: seed=%.*s: want an unsigned integer", (int)p->val_len, p->val);
    break;
  case KEY_CALIB_TOKENS:
    if (!kvp__param_u32(p, &v) || v < 16 || v > 65536)
      return BAD("kvquant: calib_tokens=%.*s: want 16..65536", (int)p->val_len, p->val);
    pp->calib_tokens = v;
    break;
  case KEY_OUTLIERS:
    if (!kvp__param_f32(p, &f) || !(f >= 0 && f < 0.5f))
      return BAD("kvquant: outliers=%.*s: want a fraction in [0, 0.5)", (int)p->val_len, p->val);
    pp->fraction = f;
    break;
  case KEY_SINK:
    if (!kvp__param_u32(p, &v) || v > 65536) return BAD("kvquant: sink=%.*s: want 0..65536", (int)p->val_len, p->val);
    q->sink = v;
    break;
  case KEY_LUT:
    if (kvp__param_is(p, "nuq")) pp->uniform = false;
    else if (kvp__param_is(p, "uniform")) pp->uniform = true;
    else return BAD("kvquant: lut=%.*s: want nuq or uniform", (int)p->val_len, p->val);
    break;
  case KEY_PREROPE:
    if (!kvp__param_u32(p, &v) || v > 1) return BAD("kvquant: prerope=%.*s: want 0 or 1", (int)p->val_len, p->val);
    q->prerope = v;
    break;
  case KEY_THETA:
    if (!kvp__param_f32(p, &f) || !(f > 1.0f)) return BAD("kvquant: theta=%.*s: want a number > 1", (int)p->val_len, p->val);
    q->theta = f;
    break;
  case KEY_OUTLIER_MODE:
    if (kvp__param_is(p, "topk")) q->thresh = false;
    else if (kvp__param_is(p, "threshold")) q->thresh = true;
    else return BAD("kvquant: outlier_mode=%.*s: want topk or threshold", (int)p->val_len, p->val);
    break;
  case KEY_ROPE_DIMS:
    if (!kvp__param_u32(p, &v) || v < 2 || v % 2) return BAD("kvquant: rope_dims=%.*s: want an even number >= 2",
                                                              (int)p->val_len, p->val);
    q->rope_dims = v;
    pp->rope_at = p->at;
    break;
  }
#undef BAD
  return KVP_OK;
}

static void kvq_set_lut(kvq_inst *q, const float *lut) {
  uint32_t n = 1u << q->bits;
  memcpy(q->lut, lut, n * sizeof *lut);
  for (uint32_t j = 0; j + 1 < n; j++) q->mid[j] = (q->lut[j] + q->lut[j + 1]) * 0.5f;
}

/* The geometry and parameters of an instance, checked, into q and pp:
 * everything kvq_create does before the calibration. */
static int kvq_parse(const char *params, const kvp_codec_geom *geom, kvq_inst *q, kvq_params *pp, char *err,
                     size_t errcap, size_t *err_at) {
  int rc = kvp__codec_geom_ok("kvquant", geom, err, errcap);
  if (rc) return rc;
  *q = (kvq_inst){.head_dim = geom->head_dim, .n_heads = geom->n_kv_heads, .kv = geom->kv, .in_dtype = geom->in_dtype,
                  .bits = 3, .sink = 1, .theta = 10000.0, .rope_dims = geom->head_dim};
  *pp = (kvq_params){.calib = "synthetic", .calib_tokens = 256, .fraction = 0.01f};
  if (q->n_heads < 1 || q->n_heads > KVP_MAX_KV_HEADS || geom->n_layers < 1 || geom->layer >= geom->n_layers)
    return kvp__param_fail(err, errcap, NULL, 0, "kvquant: needs the pool's n_layers and n_kv_heads in the geometry "
                           "(layer %u of %u, %u heads)", geom->layer, geom->n_layers, geom->n_kv_heads);
  size_t pos = 0;
  unsigned seen = 0;
  kvp__param p;
  while ((rc = kvp__param_next("kvquant", params, &pos, kvq_keys, NKEYS, &seen, &p, err, errcap, err_at)) == 1)
    if ((rc = kvq_param(q, pp, &p, err, errcap, err_at))) return rc;
  if (rc) return rc;
  if (q->rope_dims > q->head_dim)
    return kvp__param_fail(err, errcap, err_at, pp->rope_at, "kvquant: rope_dims=%u > head_dim %u", q->rope_dims,
                           q->head_dim);
  q->k = kvp__kvq_outliers_k(pp->fraction, q->head_dim);
  if (q->k >= q->head_dim)
    return kvp__param_fail(err, errcap, err_at, 0, "kvquant: outliers=%g leaves no dense value of %u",
                           (double)pp->fraction, q->head_dim);
  q->kmax = q->thresh ? q->head_dim / 2 : q->k;
  q->cw = q->head_dim <= 256 ? 1 : 2;
  q->row_bytes = (uint32_t)kvp__lsb32_bytes(q->head_dim, q->bits);
  q->prerope = q->prerope && q->kv == 0; /* values are never rotated */
  return KVP_OK;
}

int kvp__kvq_params_check(const char *params, const kvp_codec_geom *geom, char *err, size_t errcap, size_t *err_at) {
  kvq_inst q;
  kvq_params pp;
  return kvq_parse(params, geom, &q, &pp, err, errcap, err_at);
}

static int kvq_create(const char *params, const kvp_codec_geom *geom, void **inst, char *err, size_t errcap,
                      size_t *err_at) {
  kvq_inst q;
  kvq_params pp;
  int rc = kvq_parse(params, geom, &q, &pp, err, errcap, err_at);
  if (rc) return rc;
  if (strcmp(pp.calib, "synthetic") == 0)
    rc = kvp__kvq_fit_synthetic(pp.seed, geom->layer, q.kv, q.n_heads, q.head_dim, q.bits, pp.fraction, pp.calib_tokens,
                                &q.cal);
  else
    rc = kvp__kvq_load(pp.calib, geom->layer, q.kv, geom->n_layers, q.n_heads, q.head_dim, q.bits, &q.cal, err, errcap);
  if (rc == KVP_ENOMEM) return kvp__param_fail(err, errcap, NULL, 0, "kvquant: out of memory"), KVP_ENOMEM;
  if (rc) return rc; /* KVP_EFORMAT, message in err */
  float uni[KVP__KVQ_LUT_MAX];
  kvp__kvq_uniform_lut(q.bits, uni);
  kvq_set_lut(&q, pp.uniform ? uni : q.cal.lut);
  size_t hd = (size_t)q.n_heads * q.head_dim;
  q.inv = malloc(hd * sizeof *q.inv);
  for (size_t i = 0; q.inv && i < hd; i++) q.inv[i] = 1.0f / q.cal.rng[i];
  if (q.prerope && (q.inv_freq = malloc(q.rope_dims / 2 * sizeof *q.inv_freq)))
    for (uint32_t i = 0; i < q.rope_dims / 2; i++) q.inv_freq[i] = pow(q.theta, -2.0 * i / (double)q.rope_dims);
  kvq_inst *out = q.inv && (!q.prerope || q.inv_freq) ? malloc(sizeof *out) : NULL;
  if (!out) {
    free(q.inv);
    free(q.inv_freq);
    kvp__kvq_side_free(&q.cal);
    kvp__param_fail(err, errcap, NULL, 0, "kvquant: out of memory");
    return KVP_ENOMEM;
  }
  *out = q;
  *inst = out;
  return KVP_OK;
}

static void kvq_destroy(void *inst) {
  kvq_inst *q = inst;
  if (!q) return;
#ifdef KVP_HAVE_CUDA
  kvp__kvq_dev_release(q->dev);
#endif
  kvp__kvq_side_free(&q->cal);
  free(q->inv);
  free(q->inv_freq);
  free(q);
}

static uint32_t kvq_group_tokens(const void *inst) { return 1; }

static size_t kvq_static_bytes(const void *inst) {
  const kvq_inst *q = inst;
  return sizeof *q + 3 * (size_t)q->n_heads * q->head_dim * sizeof(float) +
         (q->prerope ? q->rope_dims / 2 * sizeof(double) : 0);
}

/* ---- layout ------------------------------------------------------------------ */

static uint64_t kvq_out_bytes(const kvq_inst *q, uint32_t cap, uint32_t rows, uint64_t entries);

static uint32_t sink_rows(const kvq_inst *q, uint32_t pos0, uint32_t cap) {
  if (pos0 >= q->sink) return 0;
  return q->sink - pos0 < cap ? q->sink - pos0 : cap;
}

/* Page indices of a block: CODES 0, then OUTLIERS, SCALES, RAW when present. */
typedef struct kvq_pages {
  int out, scales, raw; /* index or -1 */
} kvq_pages;

static kvq_pages kvq_index(const kvq_inst *q, uint32_t pos0, uint32_t cap) {
  kvq_pages ix = {-1, -1, -1};
  int n = 1;
  if (q->kmax) ix.out = n++;
  if (q->kv) ix.scales = n++;
  if (sink_rows(q, pos0, cap)) ix.raw = n++;
  return ix;
}

static void kvq_layout_at(const void *inst, uint32_t pos0, uint32_t cap, kvp_codec_layout *out) {
  const kvq_inst *q = inst;
  memset(out, 0, sizeof *out);
  out->types[0] = KVP_PAGE_CODES;
  out->bytes[0] = (uint64_t)cap * q->row_bytes;
  unsigned n = 1;
  if (q->kmax) { /* threshold: room for kmax a row (a layer whose other side is not kvquant sizes blocks so) */
    out->types[n] = KVP_PAGE_OUTLIERS;
    out->bytes[n++] = kvq_out_bytes(q, cap, cap, (uint64_t)cap * q->kmax);
  }
  if (q->kv) {
    out->types[n] = KVP_PAGE_SCALES;
    out->bytes[n++] = (uint64_t)cap * 4;
  }
  uint32_t ns = sink_rows(q, pos0, cap);
  if (ns) {
    out->types[n] = KVP_PAGE_RAW;
    out->bytes[n++] = (uint64_t)ns * q->head_dim * kvp__dtype_bytes(q->in_dtype);
  }
  out->npages = n;
}

/* A block away from the sink. */
static void kvq_layout(const void *inst, uint32_t cap, kvp_codec_layout *out) {
  const kvq_inst *q = inst;
  kvq_layout_at(inst, q->sink, cap, out);
}

/* ---- one token ------------------------------------------------------------------ */

/* Indices of the k largest of score[0..D) (ties: lower channel), ascending
 * by channel: the encoder's outlier pick, which the fitter repeats. */
void kvp__kvq_top(const float *score, uint32_t D, uint32_t k, uint16_t *top) {
  float best[KVP_MAX_HEAD_DIM];
  uint32_t nb = 0;
  for (uint32_t c = 0; c < D; c++) {
    float s = score[c];
    if (nb == k && !(s > best[k - 1])) continue;
    uint32_t j = nb < k ? nb++ : k - 1;
    while (j > 0 && s > best[j - 1]) {
      best[j] = best[j - 1];
      top[j] = top[j - 1];
      j--;
    }
    best[j] = s;
    top[j] = (uint16_t)c;
  }
  for (uint32_t i = 1; i < k; i++)
    for (uint32_t j = i; j > 0 && top[j - 1] > top[j]; j--) {
      uint16_t t = top[j];
      top[j] = top[j - 1];
      top[j - 1] = t;
    }
}

/* The outliers of one token from its scores: the k largest (topk), or the
 * channels scoring above 1, at most kmax of them, the largest (threshold).
 * Ascending channels into top; returns how many. */
static uint32_t kvq_pick(const kvq_inst *q, const float *score, uint16_t *top) {
  uint32_t D = q->head_dim, cnt = 0;
  if (!q->thresh) {
    if (q->k) kvp__kvq_top(score, D, q->k, top);
    return q->k;
  }
  for (uint32_t c = 0; c < D; c++) cnt += score[c] > 1.0f;
  if (cnt > q->kmax) {
    kvp__kvq_top(score, D, q->kmax, top);
    return q->kmax;
  }
  for (uint32_t c = 0, j = 0; c < D; c++)
    if (score[c] > 1.0f) top[j++] = (uint16_t)c;
  return cnt;
}

/* Scores that rank a token's values for the outliers; n (K only) gets the
 * normalized values. */
static void kvq_scores(const kvq_inst *q, uint32_t h, const float *x, float *n, float *score) {
  uint32_t D = q->head_dim;
  const float *off = q->cal.off + (size_t)h * D, *inv = q->inv + (size_t)h * D;
  if (q->kv == 0)
    for (uint32_t c = 0; c < D; c++) {
      n[c] = (x[c] - off[c]) * inv[c];
      score[c] = fabsf(n[c]);
    }
  else
    for (uint32_t c = 0; c < D; c++) score[c] = fabsf(x[c] - off[c]) * inv[c];
}

/* One token's outliers: channels and fp16 residuals, ascending channels. */
typedef struct kvq_outl {
  uint32_t n;                   /* how many */
  uint16_t ch[KVP_MAX_HEAD_DIM];  /* channels */
  uint16_t val[KVP_MAX_HEAD_DIM]; /* fp16 residuals */
} kvq_outl;

/* Encode one token x (f32) of head h: its CODES row, SCALES record (V) and
 * outliers. KVP_ECODEC with a message naming the position. */
static int kvq_encode_token(const kvq_inst *q, uint32_t h, const float *x, uint8_t *codes_row, uint8_t *scale_rec,
                            kvq_outl *o, uint32_t pos) {
  uint32_t D = q->head_dim;
  const float *off = q->cal.off + (size_t)h * D, *rng = q->cal.rng + (size_t)h * D;
  float n[KVP_MAX_HEAD_DIM], score[KVP_MAX_HEAD_DIM], M = 0, R = 0;
  uint16_t top[KVP_MAX_HEAD_DIM];
  uint8_t code[KVP_MAX_HEAD_DIM];
  kvq_scores(q, h, x, n, score);
  uint32_t k = kvq_pick(q, score, top);
  if (q->kv) {
    float lo = INFINITY, hi = -INFINITY;
    for (uint32_t c = 0, j = 0; c < D; c++) {
      if (j < k && top[j] == c) {
        j++;
        continue;
      }
      lo = x[c] < lo ? x[c] : lo;
      hi = x[c] > hi ? x[c] : hi;
    }
    float m = (hi + lo) * 0.5f, r = (hi - lo) * 0.5f;
    if (!(fabsf(m) <= 65504.0f) || !(r <= 65504.0f))
      return kvp__err(KVP_ECODEC, "kvquant: V token at position %u spans [%g, %g], beyond fp16 scales", pos, (double)lo,
                      (double)hi);
    uint16_t mh = kvp__f16_from_f32(m), rh = kvp__f16_from_f32(r);
    M = kvp__f16_to_f32(mh);
    R = kvp__f16_to_f32(rh);
    kvp__st_le16(scale_rec, mh);
    kvp__st_le16(scale_rec + 2, rh);
    float ir = R > 0 ? 1.0f / R : 0.0f;
    for (uint32_t c = 0; c < D; c++) n[c] = (x[c] - M) * ir;
  }
  /* the nearest entry: the number of midpoints below n, by binary search over the sorted midpoints */
  for (uint32_t c = 0; c < D; c++) {
    uint32_t i = 0;
    for (uint32_t s = 1u << (q->bits - 1); s; s >>= 1) i += q->mid[i + s - 1] < n[c] ? s : 0;
    code[c] = (uint8_t)i;
  }
  kvp__lsb32_pack(codes_row, code, D, q->bits);
  o->n = k;
  for (uint32_t j = 0; j < k; j++) {
    uint32_t c = top[j];
    float dense = q->kv == 0 ? q->lut[code[c]] * rng[c] + off[c] : q->lut[code[c]] * R + M;
    float e = x[c] - dense;
    if (!(fabsf(e) <= 65504.0f))
      return kvp__err(KVP_ECODEC, "kvquant: %c outlier at position %u channel %u (residual %g) is beyond fp16",
                      "KV"[q->kv], pos, c, (double)e);
    o->ch[j] = (uint16_t)c;
    o->val[j] = kvp__f16_from_f32(e);
  }
  return KVP_OK;
}

/* Dense decode of one token into y (f32). */
static void kvq_decode_dense(const kvq_inst *q, uint32_t h, const uint8_t *codes_row, const uint8_t *scale_rec,
                             float *y) {
  uint32_t D = q->head_dim;
  uint8_t code[KVP_MAX_HEAD_DIM];
  kvp__lsb32_unpack(code, codes_row, D, q->bits);
  if (q->kv == 0) {
    const float *off = q->cal.off + (size_t)h * D, *rng = q->cal.rng + (size_t)h * D;
    for (uint32_t c = 0; c < D; c++) y[c] = q->lut[code[c]] * rng[c] + off[c];
  } else {
    float M = kvp__f16_to_f32(kvp__ld_le16(scale_rec)), R = kvp__f16_to_f32(kvp__ld_le16(scale_rec + 2));
    for (uint32_t c = 0; c < D; c++) y[c] = q->lut[code[c]] * R + M;
  }
}

/* ---- the OUTLIERS page ---------------------------------------------------------------
 * topk:      row t at t k (w + 2): k channels (w bytes), then k fp16.
 * threshold: a header of cap + 1 u32 row starts (entries before row t;
 *            start[n] = entries of the n rows held), then entries of
 *            w + 2 bytes (channel, then fp16) from byte 4 (cap + 1). */

static uint64_t kvq_out_bytes(const kvq_inst *q, uint32_t cap, uint32_t rows, uint64_t entries) {
  if (q->thresh) return 4ull * (cap + 1) + entries * (q->cw + 2);
  return (uint64_t)(rows ? rows : 1) * q->k * (q->cw + 2);
}

static uint32_t kvq_start(const uint8_t *outl, uint32_t t) { return kvp__ld_le32(outl + 4 * (size_t)t); }

static void kvq_out_put(const kvq_inst *q, uint8_t *outl, uint32_t cap, uint32_t t, const kvq_outl *o) {
  uint32_t w = q->cw;
  if (!q->thresh) {
    uint8_t *row = outl + (size_t)t * q->k * (w + 2);
    for (uint32_t j = 0; j < o->n; j++) {
      if (w == 1) row[j] = (uint8_t)o->ch[j];
      else kvp__st_le16(row + 2 * j, o->ch[j]);
      kvp__st_le16(row + (size_t)q->k * w + 2 * j, o->val[j]);
    }
    return;
  }
  uint32_t s0 = kvq_start(outl, t);
  uint8_t *e = outl + 4 * ((size_t)cap + 1) + (size_t)s0 * (w + 2);
  for (uint32_t j = 0; j < o->n; j++, e += w + 2) {
    if (w == 1) e[0] = (uint8_t)o->ch[j];
    else kvp__st_le16(e, o->ch[j]);
    kvp__st_le16(e + w, o->val[j]);
  }
  kvp__st_le32(outl + 4 * ((size_t)t + 1), s0 + o->n);
}

static void kvq_out_add(const kvq_inst *q, const uint8_t *outl, uint32_t cap, uint32_t t, float *y) {
  uint32_t w = q->cw, D = q->head_dim;
  if (!q->thresh) {
    const uint8_t *row = outl + (size_t)t * q->k * (w + 2);
    for (uint32_t j = 0; j < q->k; j++) {
      uint32_t c = w == 1 ? row[j] : kvp__ld_le16(row + 2 * j);
      if (c < D) y[c] += kvp__f16_to_f32(kvp__ld_le16(row + (size_t)q->k * w + 2 * j));
    }
    return;
  }
  uint32_t s0 = kvq_start(outl, t), s1 = kvq_start(outl, t + 1);
  const uint8_t *e = outl + 4 * ((size_t)cap + 1) + (size_t)s0 * (w + 2);
  for (uint32_t j = s0; j < s1 && j - s0 < D; j++, e += w + 2) {
    uint32_t c = w == 1 ? e[0] : kvp__ld_le16(e);
    if (c < D) y[c] += kvp__f16_to_f32(kvp__ld_le16(e + w));
  }
}

/* RoPE of one key row at position pos (see the banner). */
static void kvq_rope(const kvq_inst *q, float *y, uint32_t pos) {
  uint32_t half = q->rope_dims / 2;
  for (uint32_t i = 0; i < half; i++) {
    double ang = (double)pos * q->inv_freq[i], sd, cd;
    kvp__sincos(ang, &sd, &cd);
    float cs = (float)cd, sn = (float)sd;
    float a = y[i], b = y[i + half];
    y[i] = a * cs - b * sn;
    y[i + half] = b * cs + a * sn;
  }
}

/* ---- block encode / decode ------------------------------------------------------- */

/* Rows [n_have, n_have + n_new) from src; the bytes of other rows are not
 * touched. Sink rows: RAW, their other records zero, no outliers. */
static int kvq_encode_rows(const void *inst, const kvp_codec_block *blk, void *state, void *const *pages,
                           uint32_t n_have, const void *src, size_t src_stride, uint32_t n_new, uint32_t cap) {
  const kvq_inst *q = inst;
  int rc = kvp__codec_rows_ok("kvquant", n_have + n_new, cap, n_have, n_new);
  if (rc) return rc;
  if (blk->head >= q->n_heads)
    return kvp__err(KVP_EINVAL, "kvquant: head %u >= the calibration's %u heads", blk->head, q->n_heads);
  kvq_pages ix = kvq_index(q, blk->pos0, cap);
  uint32_t D = q->head_dim, ns = sink_rows(q, blk->pos0, cap);
  size_t esz = kvp__dtype_bytes(q->in_dtype);
  uint8_t *codes = pages[0], *outl = ix.out >= 0 ? pages[ix.out] : NULL, *sc = ix.scales >= 0 ? pages[ix.scales] : NULL;
  if (outl && q->thresh && n_have == 0) kvp__st_le32(outl, 0);
  float x[KVP_MAX_HEAD_DIM];
  kvq_outl o;
  for (uint32_t t = n_have; t < n_have + n_new; t++) {
    const unsigned char *row = (const unsigned char *)src + (size_t)(t - n_have) * src_stride;
    uint8_t *crow = codes + (size_t)t * q->row_bytes, *srec = sc ? sc + (size_t)t * 4 : NULL;
    if (t < ns) {
      memcpy((uint8_t *)pages[ix.raw] + (size_t)t * D * esz, row, D * esz);
      memset(crow, 0, q->row_bytes);
      if (srec) memset(srec, 0, 4);
      o.n = q->thresh ? 0 : q->k;
      memset(o.ch, 0, sizeof o.ch[0] * o.n);
      memset(o.val, 0, sizeof o.val[0] * o.n);
    } else {
      kvp__row_to_f32(x, row, q->in_dtype, D);
      if ((rc = kvq_encode_token(q, blk->head, x, crow, srec, &o, blk->pos0 + t))) return rc;
    }
    if (outl) kvq_out_put(q, outl, cap, t, &o);
  }
  return KVP_OK;
}

static int kvq_encode_at(const void *inst, const kvp_codec_block *blk, void *state, const void *src, size_t src_stride,
                         uint32_t n, uint32_t cap, void *const *pages) {
  const kvq_inst *q = inst;
  int rc = kvp__codec_rows_ok("kvquant", n, cap, 0, n);
  if (rc) return rc;
  kvq_pages ix = kvq_index(q, blk->pos0, cap);
  kvp_codec_layout lay;
  kvq_layout_at(inst, blk->pos0, cap, &lay);
  memset(pages[0], 0, (size_t)cap * q->row_bytes); /* rows past n: zero */
  if (ix.out >= 0) memset(pages[ix.out], 0, lay.bytes[ix.out]);
  if (ix.scales >= 0) memset(pages[ix.scales], 0, (size_t)cap * 4);
  return kvq_encode_rows(inst, blk, state, pages, 0, src, src_stride, n, cap);
}

/* The OPEN block's pages: CODES, SCALES and RAW at full capacity, OUTLIERS
 * for the rows held (it grows with the block; in threshold mode with the
 * outliers the rows have). */
static int kvq_open_layout(const void *inst, const kvp_codec_block *blk, const void *const *pages, uint32_t n_have,
                           const void *src, size_t src_stride, uint32_t n_new, uint32_t cap, kvp_codec_layout *out) {
  const kvq_inst *q = inst;
  if (cap < 1 || cap > 65536 || (uint64_t)n_have + n_new > cap || (n_new && !src))
    return kvp__err(KVP_EINVAL, "kvquant: %u + %u rows in a block of %u", n_have, n_new, cap);
  if (n_have && !pages && q->thresh) /* a dry pool: fixed k sizes by count, threshold outliers cannot */
    return kvp__err(KVP_ENOTSUP, "kvquant: threshold outliers size the OUTLIERS page from the rows held; without "
                    "them (a dry pool, or rows on the device) only a fixed outlier count (outlier_mode=topk) can be "
                    "sized");
  if (blk->head >= q->n_heads)
    return kvp__err(KVP_EINVAL, "kvquant: head %u >= the calibration's %u heads", blk->head, q->n_heads);
  kvq_layout_at(inst, blk->pos0, cap, out);
  kvq_pages ix = kvq_index(q, blk->pos0, cap);
  if (ix.out < 0) return KVP_OK;
  uint64_t entries = 0;
  if (q->thresh) {
    if (n_have) entries = kvq_start(pages[ix.out], n_have);
    uint32_t ns = sink_rows(q, blk->pos0, cap);
    float x[KVP_MAX_HEAD_DIM], n[KVP_MAX_HEAD_DIM], score[KVP_MAX_HEAD_DIM];
    uint16_t top[KVP_MAX_HEAD_DIM];
    for (uint32_t t = n_have; t < n_have + n_new; t++) {
      if (t < ns) continue;
      kvp__row_to_f32(x, (const unsigned char *)src + (size_t)(t - n_have) * src_stride, q->in_dtype, q->head_dim);
      kvq_scores(q, blk->head, x, n, score);
      entries += kvq_pick(q, score, top);
    }
  }
  out->bytes[ix.out] = kvq_out_bytes(q, cap, n_have + n_new, entries);
  return KVP_OK;
}

int kvp__kvq_decode_f32(const void *inst, const kvp_codec_block *blk, const void *const *pages, uint32_t cap,
                        uint32_t t0, uint32_t m, float *dst, size_t dst_stride, int with_outliers, int rope) {
  const kvq_inst *q = inst;
  if (blk->head >= q->n_heads)
    return kvp__err(KVP_EINVAL, "kvquant: head %u >= the calibration's %u heads", blk->head, q->n_heads);
  kvq_pages ix = kvq_index(q, blk->pos0, cap);
  uint32_t D = q->head_dim, ns = sink_rows(q, blk->pos0, cap);
  size_t esz = kvp__dtype_bytes(q->in_dtype);
  const uint8_t *codes = pages[0], *outl = ix.out >= 0 ? pages[ix.out] : NULL;
  const uint8_t *sc = ix.scales >= 0 ? pages[ix.scales] : NULL;
  for (uint32_t i = 0; i < m; i++) {
    uint32_t t = t0 + i;
    float *y = dst + (size_t)i * dst_stride;
    if (t < ns) kvp__row_to_f32(y, (const uint8_t *)pages[ix.raw] + (size_t)t * D * esz, q->in_dtype, D);
    else {
      kvq_decode_dense(q, blk->head, codes + (size_t)t * q->row_bytes, sc ? sc + (size_t)t * 4 : NULL, y);
      if (with_outliers && outl) kvq_out_add(q, outl, cap, t, y);
    }
    if (rope && q->prerope) kvq_rope(q, y, blk->pos0 + t);
  }
  return KVP_OK;
}

static int kvq_decode_at(const void *inst, const kvp_codec_block *blk, const void *const *pages, uint32_t n,
                         uint32_t cap, uint32_t t0, uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const kvq_inst *q = inst;
  int rc = kvp__codec_rows_ok("kvquant", n, cap, t0, m);
  if (rc) return rc;
  float y[KVP_MAX_HEAD_DIM];
  for (uint32_t i = 0; i < m; i++) {
    if ((rc = kvp__kvq_decode_f32(inst, blk, pages, cap, t0 + i, 1, y, q->head_dim, 1, 1))) return rc;
    kvp__row_from_f32((unsigned char *)dst + (size_t)i * dst_stride, out, y, q->head_dim);
  }
  return KVP_OK;
}

static int kvq_decode_raw_at(const void *inst, const kvp_codec_block *blk, uint32_t t0, const void *src,
                             size_t src_stride, uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const kvq_inst *q = inst;
  float y[KVP_MAX_HEAD_DIM];
  for (uint32_t i = 0; i < m; i++) {
    kvp__row_to_f32(y, (const unsigned char *)src + (size_t)i * src_stride, q->in_dtype, q->head_dim);
    if (q->prerope) kvq_rope(q, y, blk->pos0 + t0 + i);
    kvp__row_from_f32((unsigned char *)dst + (size_t)i * dst_stride, out, y, q->head_dim);
  }
  return KVP_OK;
}

/* ---- the device twin's tables ---------------------------------------------------- */

size_t kvp__kvq_dev_image(const void *inst, void *buf) {
  const kvq_inst *q = inst;
  size_t nf = q->prerope ? q->rope_dims / 2 : 0, hd = (size_t)q->n_heads * q->head_dim;
  size_t bytes = nf * sizeof(double) + 2 * KVP__KVQ_LUT_MAX * sizeof(float) + 3 * hd * sizeof(float);
  if (!buf) return bytes;
  uint8_t *p = buf;
  memset(p, 0, bytes);
  if (nf) memcpy(p, q->inv_freq, nf * sizeof(double));
  p += nf * sizeof(double);
  memcpy(p, q->lut, (size_t)(1u << q->bits) * sizeof(float));
  p += KVP__KVQ_LUT_MAX * sizeof(float);
  memcpy(p, q->mid, (size_t)((1u << q->bits) - 1) * sizeof(float));
  p += KVP__KVQ_LUT_MAX * sizeof(float);
  memcpy(p, q->cal.off, hd * sizeof(float));
  memcpy(p + hd * sizeof(float), q->cal.rng, hd * sizeof(float));
  memcpy(p + 2 * hd * sizeof(float), q->inv, hd * sizeof(float));
  return bytes;
}

struct kvp__kvq_dev **kvp__kvq_dev_slot(const void *inst) { return &((kvq_inst *)inst)->dev; }
uint32_t kvp__kvq_head_dim(const void *inst) { return ((const kvq_inst *)inst)->head_dim; }
int kvp__kvq_prerope(const void *inst) { return ((const kvq_inst *)inst)->prerope; }

void kvp__kvq_kparams_fill(const void *inst, const void *dev_tables, kvp__kvq_kparams *k) {
  const kvq_inst *q = inst;
  size_t nf = q->prerope ? q->rope_dims / 2 : 0, hd = (size_t)q->n_heads * q->head_dim;
  const uint8_t *p = dev_tables; /* device address: arithmetic only */
  memset(k, 0, sizeof *k);
  k->inv_freq = nf ? (const double *)p : NULL;
  k->lut = (const float *)(p + nf * sizeof(double));
  k->mid = k->lut + KVP__KVQ_LUT_MAX;
  k->off = k->mid + KVP__KVQ_LUT_MAX;
  k->rng = k->off + hd;
  k->inv = k->rng + hd;
  k->head_dim = q->head_dim;
  k->n_heads = q->n_heads;
  k->in_dtype = (uint32_t)q->in_dtype;
  k->kv = q->kv;
  k->bits = q->bits;
  k->k = q->k;
  k->thresh = q->thresh;
  k->kmax = q->kmax;
  k->cw = q->cw;
  k->row_bytes = q->row_bytes;
  k->sink = q->sink;
  k->prerope = q->prerope;
  k->rope_dims = q->rope_dims;
}

const kvp_codec_vtable kvp__codec_kvquant = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "kvquant",
    .create = kvq_create,
    .destroy = kvq_destroy,
    .group_tokens = kvq_group_tokens,
    .layout = kvq_layout,
    .encode = NULL, /* needs the head (calibration) and the position (sinks): encode_at */
    .decode = NULL,
    .layout_at = kvq_layout_at,
    .encode_at = kvq_encode_at,
    .decode_at = kvq_decode_at,
    .static_bytes = kvq_static_bytes,
    .decode_raw_at = kvq_decode_raw_at,
    .open_layout = kvq_open_layout,
    .encode_rows = kvq_encode_rows,
#ifdef KVP_HAVE_CUDA
    .encode_dev = kvp__kvq_encode_dev,
    .decode_dev = kvp__kvq_decode_dev,
#endif
};
