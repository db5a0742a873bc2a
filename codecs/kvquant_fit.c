/*
 * codecs/kvquant_fit.c - KVQuant's fitter of one side of one layer
 * (kvp__kvq_fit): per-channel thresholds, the histogram of the normalized
 * dense values, and the codebook (Lloyd in one dimension over it).
 *
 * One head h, n samples (rows of D floats):
 *   per channel, over the n samples, sorted: lo = s[i], hi = s[n - 1 - i],
 *   i = floor(f/2 (n - 1)) (f = outlier fraction; found in one pass with
 *   heaps of the i + 1 extremes); off = (hi + lo)/2, rng = (hi - lo)/2, or
 *   2^-24 when that is not positive.
 *   dense values of every sample token, as the encoder picks them: the
 *   k = ceil(f D) values of largest |x - off| / rng are outliers and left
 *   out; K: n = (x - off) / rng; V: n = (x - m) / r with m, r the middle and
 *   half-width of the token's dense values. n clipped to [-1, 1] goes into
 *   a histogram of KVP__KVQ_BINS bins (weight w, weighted sum w n).
 *   codebook: Lloyd in one dimension over the histogram (each bin a point at
 *   its weighted mean), 2^b centroids seeded at the weighted quantiles
 *   (i + 1/2) / 2^b, at most 100 rounds, until no bin changes centroid; an
 *   empty centroid keeps its place; sorted at the end.
 */
#include "builtin.h"
#include "kvquant.h"

uint32_t kvp__kvq_outliers_k(double fraction, uint32_t head_dim) {
  double k = ceil(fraction * head_dim - 1e-9);
  return k <= 0 ? 0 : (uint32_t)k;
}

void kvp__kvq_uniform_lut(uint32_t bits, float *lut) {
  uint32_t n = 1u << bits;
  for (uint32_t i = 0; i < n; i++) lut[i] = -1.0f + 2.0f * (float)i / (float)(n - 1);
}

void kvp__kvq_side_free(kvp__kvq_side *s) {
  free(s->off);
  free(s->rng);
  s->off = s->rng = NULL;
}

int kvp__kvq_fit_init(kvp__kvq_fit *f, uint32_t n_heads, uint32_t head_dim, uint32_t bits, uint32_t kv,
                      double fraction) {
  memset(f, 0, sizeof *f);
  f->n_heads = n_heads;
  f->head_dim = head_dim;
  f->bits = bits;
  f->kv = kv;
  f->fraction = fraction;
  size_t hd = (size_t)n_heads * head_dim;
  f->off = malloc(hd * sizeof *f->off);
  f->rng = malloc(hd * sizeof *f->rng);
  f->inv = malloc(hd * sizeof *f->inv);
  f->done = calloc(n_heads, 1);
  f->hw = calloc(KVP__KVQ_BINS, sizeof *f->hw);
  f->hwx = calloc(KVP__KVQ_BINS, sizeof *f->hwx);
  if (!f->off || !f->rng || !f->inv || !f->done || !f->hw || !f->hwx) {
    kvp__kvq_fit_free(f);
    return kvp__err(KVP_ENOMEM, "kvquant: calibration of %u heads x %u channels", n_heads, head_dim);
  }
  return KVP_OK;
}

void kvp__kvq_fit_free(kvp__kvq_fit *f) {
  free(f->off);
  free(f->rng);
  free(f->inv);
  free(f->done);
  free(f->hw);
  free(f->hwx);
  memset(f, 0, sizeof *f);
}

/* Per channel, the m smallest and the m largest samples seen, as heaps:
 * lo[c] a max-heap (root: the m-th smallest so far), hi[c] a min-heap
 * (root: the m-th largest). One pass over row-major samples; a value that
 * cannot enter costs one compare. */
typedef struct ext_heaps {
  uint32_t m, D;  /* heap size (>= 1), channels */
  uint32_t *len;  /* [D]: entries in each channel's heaps (both alike) */
  float *lo, *hi; /* [D][m] */
} ext_heaps;

static void heap_push(float *h, uint32_t len, float v, int max) { /* sift up */
  uint32_t i = len;
  while (i > 0) {
    uint32_t p = (i - 1) / 2;
    if (max ? !(v > h[p]) : !(v < h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = v;
}

static void heap_replace_root(float *h, uint32_t len, float v, int max) { /* sift down */
  uint32_t i = 0;
  for (;;) {
    uint32_t l = 2 * i + 1, r = l + 1, b = i;
    float bv = v;
    if (l < len && (max ? h[l] > bv : h[l] < bv)) b = l, bv = h[l];
    if (r < len && (max ? h[r] > bv : h[r] < bv)) b = r;
    if (b == i) break;
    h[i] = h[b];
    i = b;
  }
  h[i] = v;
}

static void heaps_add(ext_heaps *e, const float *row) {
  for (uint32_t c = 0; c < e->D; c++) {
    float v = row[c], *lo = e->lo + (size_t)c * e->m, *hi = e->hi + (size_t)c * e->m;
    uint32_t len = e->len[c];
    if (len < e->m) {
      heap_push(lo, len, v, 1);
      heap_push(hi, len, v, 0);
      e->len[c] = len + 1;
      continue;
    }
    if (v < lo[0]) heap_replace_root(lo, len, v, 1);
    if (v > hi[0]) heap_replace_root(hi, len, v, 0);
  }
}

static void hist_add(kvp__kvq_fit *f, float n, float w) {
  if (n < -1.0f) n = -1.0f;
  if (n > 1.0f) n = 1.0f;
  uint32_t b = (uint32_t)((n + 1.0f) * 0.5f * KVP__KVQ_BINS);
  if (b >= KVP__KVQ_BINS) b = KVP__KVQ_BINS - 1;
  f->hw[b] += w;
  f->hwx[b] += (double)w * n;
}

/* The normalized dense values of one token into the histogram. */
static void fit_token(kvp__kvq_fit *f, uint32_t h, const float *x, const float *w, uint32_t k, float *score,
                      uint16_t *top) {
  uint32_t D = f->head_dim;
  const float *off = f->off + (size_t)h * D, *inv = f->inv + (size_t)h * D;
  for (uint32_t c = 0; c < D; c++) score[c] = fabsf(x[c] - off[c]) * inv[c];
  if (k) kvp__kvq_top(score, D, k, top); /* as the encoder picks */
  uint32_t j = 0;
  float lo = INFINITY, hi = -INFINITY;
  for (uint32_t c = 0; c < D; c++) { /* mark outliers with a negative score */
    if (j < k && top[j] == c) {
      score[c] = -1.0f;
      j++;
    } else if (f->kv) {
      lo = x[c] < lo ? x[c] : lo;
      hi = x[c] > hi ? x[c] : hi;
    }
  }
  float m = (hi + lo) * 0.5f, r = (hi - lo) * 0.5f, ir = r > 0 ? 1.0f / r : 0.0f;
  for (uint32_t c = 0; c < D; c++) {
    if (score[c] < 0) continue;
    float n = f->kv ? (x[c] - m) * ir : (x[c] - off[c]) * inv[c];
    hist_add(f, n, w ? w[c] : 1.0f);
  }
}

int kvp__kvq_fit_head(kvp__kvq_fit *f, uint32_t h, const float *x, const float *w, size_t x_stride, uint32_t n) {
  uint32_t D = f->head_dim;
  if (h >= f->n_heads) return kvp__err(KVP_EINVAL, "kvquant calibration: head %u >= %u", h, f->n_heads);
  if (f->done[h]) return kvp__err(KVP_EINVAL, "kvquant calibration: head %u fitted twice", h);
  if (n == 0) return kvp__err(KVP_EINVAL, "kvquant calibration: head %u has no samples", h);
  for (uint32_t t = 0; t < n; t++)
    for (uint32_t c = 0; c < D; c++) {
      float a = x[(size_t)t * x_stride + c], b = w ? w[(size_t)t * x_stride + c] : 1.0f;
      if (!isfinite(a)) return kvp__err(KVP_EINVAL, "kvquant calibration: sample token %u channel %u of head %u is not finite", t, c, h);
      if (!isfinite(b) || b < 0)
        return kvp__err(KVP_EINVAL, "kvquant calibration: weight of token %u channel %u of head %u is not a finite "
                                    "non-negative number", t, c, h);
    }
  float score[KVP_MAX_HEAD_DIM];
  uint16_t top[KVP_MAX_HEAD_DIM];
  double f2 = f->fraction / 2;
  size_t ilo = (size_t)floor(f2 * (n - 1)); /* s[ilo] and s[n - 1 - ilo]: roots of the ilo + 1 extremes */
  ext_heaps e = {.m = (uint32_t)ilo + 1, .D = D};
  e.len = calloc(D, sizeof *e.len);
  e.lo = malloc((size_t)D * e.m * sizeof *e.lo);
  e.hi = malloc((size_t)D * e.m * sizeof *e.hi);
  if (!e.len || !e.lo || !e.hi) {
    free(e.len), free(e.lo), free(e.hi);
    return kvp__err(KVP_ENOMEM, "kvquant calibration: %u samples", n);
  }
  for (uint32_t t = 0; t < n; t++) heaps_add(&e, x + (size_t)t * x_stride);
  for (uint32_t c = 0; c < D; c++) {
    float lo = e.lo[(size_t)c * e.m], hi = e.hi[(size_t)c * e.m];
    float off = (hi + lo) * 0.5f, rng = (hi - lo) * 0.5f;
    f->off[(size_t)h * D + c] = off;
    f->rng[(size_t)h * D + c] = rng > 0 && isfinite(rng) ? rng : 0x1p-24f;
    f->inv[(size_t)h * D + c] = 1.0f / f->rng[(size_t)h * D + c];
  }
  free(e.len), free(e.lo), free(e.hi);
  uint32_t k = kvp__kvq_outliers_k(f->fraction, D);
  for (uint32_t t = 0; t < n; t++)
    fit_token(f, h, x + (size_t)t * x_stride, w ? w + (size_t)t * x_stride : NULL, k, score, top);
  f->done[h] = 1;
  return KVP_OK;
}

int kvp__kvq_fit_lut(const kvp__kvq_fit *f, float *lut) {
  for (uint32_t h = 0; h < f->n_heads; h++)
    if (!f->done[h]) return kvp__err(KVP_EINVAL, "kvquant calibration: head %u has no samples", h);
  uint32_t K = 1u << f->bits, B = KVP__KVQ_BINS;
  double total = 0, c[KVP__KVQ_LUT_MAX];
  for (uint32_t b = 0; b < B; b++) total += f->hw[b];
  if (!(total > 0)) {
    kvp__kvq_uniform_lut(f->bits, lut);
    return KVP_OK;
  }
  /* seeds: weighted quantiles */
  double acc = 0;
  uint32_t i = 0;
  for (uint32_t b = 0; b < B && i < K; b++) {
    acc += f->hw[b];
    while (i < K && acc >= (i + 0.5) / K * total) c[i++] = f->hw[b] > 0 ? f->hwx[b] / f->hw[b] : -1.0 + (b + 0.5) * 2.0 / B;
  }
  while (i < K) c[i] = c[i - 1], i++;
  uint8_t *label = calloc(B, 1);
  if (!label) return kvp__err(KVP_ENOMEM, "kvquant calibration: k-means labels");
  for (int round = 0; round < 100; round++) {
    int changed = 0;
    double sw[KVP__KVQ_LUT_MAX] = {0}, swx[KVP__KVQ_LUT_MAX] = {0};
    for (uint32_t b = 0; b < B; b++) {
      if (f->hw[b] <= 0) continue;
      double x = f->hwx[b] / f->hw[b], bd = INFINITY;
      uint8_t bl = 0;
      for (uint32_t j = 0; j < K; j++)
        if (fabs(x - c[j]) < bd) bd = fabs(x - c[j]), bl = (uint8_t)j;
      changed += round == 0 || bl != label[b];
      label[b] = bl;
      sw[bl] += f->hw[b];
      swx[bl] += f->hwx[b];
    }
    for (uint32_t j = 0; j < K; j++)
      if (sw[j] > 0) c[j] = swx[j] / sw[j];
    if (!changed) break;
  }
  free(label);
  for (uint32_t a = 1; a < K; a++) /* sort */
    for (uint32_t j = a; j > 0 && c[j - 1] > c[j]; j--) {
      double t = c[j];
      c[j] = c[j - 1];
      c[j - 1] = t;
    }
  for (uint32_t j = 0; j < K; j++) lut[j] = (float)fmin(1.0, fmax(-1.0, c[j]));
  return KVP_OK;
}
