/*
 * codecs/kvquant_fit.c - KVQuant's fitter of one side of one layer
 * (kvp__kvq_fit): per-channel thresholds, the histogram of the normalized
 * dense values, and the codebook (Lloyd in one dimension over it).
 *
 * What it computes, one head h of n samples (rows of D floats) at a time:
 *   1. thresholds: per channel, over the n samples, sorted: lo = s[i],
 *      hi = s[n - 1 - i], i = floor(f/2 (n - 1)) (f = outlier fraction),
 *      as the roots of heaps of the m = i + 1 extremes fed the rows in
 *      order leave them; off = (hi + lo)/2, rng = (hi - lo)/2, or 2^-24
 *      when that is not positive, inv = 1 / rng.
 *   2. histogram: the dense values of every row, as the encoder picks them:
 *      the k = ceil(f D) values of largest |x - off| / rng are outliers and
 *      left out; K: n = (x - off) / rng; V: n = (x - mid) / half with mid,
 *      half the middle and half-width of the row's dense values. n clipped
 *      to [-1, 1] into bin b = floor((n + 1) / 2 BINS) (at most BINS - 1):
 *        hist[b][1] += w,  hist[b][0] += w n   (double; w = 1 without weights)
 *      in row order, channels ascending: the sums round in that order.
 *   codebook: 2^b centroids seeded at the weighted quantiles (i + 1/2) /
 *   2^b of the histogram, each bin a point at its weighted mean; at most 100
 *   Lloyd rounds, until no bin changes centroid (nearest: the lowest index
 *   among equal distances); an empty centroid keeps its place; sorted at
 *   the end.
 *
 * How, fast, with the same bits:
 *   - thresholds by a sample (kvp__kvq_head in kvquant.h): every 16th row,
 *     in a scattered order, gives each channel screen thresholds about 2 m
 *     values in; the rows keep only the values past them (one compare per
 *     8 values), and the m-th extreme is selected among those (a radix
 *     select on the floats' bits). Equal nonzero floats have equal bits,
 *     so any exact selection gives the heaps' answer; where the sample
 *     cannot vouch for it (too few or too many candidates, an answer of
 *     zero, whose sign the heaps' order fixes) the heaps run over the
 *     channel's column as before.
 *   - the sample's screen thresholds by sorted lists, 8 channels a vector
 *     (sample_lists_avx2: a min/max ladder, no branch but "does any lane
 *     go in"), where the heaps cost a mispredicted branch a level: the
 *     hm-th extreme either way.
 *   - the histogram by a row kernel that keeps the scores in registers and
 *     stores per value only its bin and clipped value, then adds them in
 *     the base code's order (the adds are the cost: about one random store
 *     each). Each lane keeps its two largest scores, so a row's first two
 *     outliers come from one pass (the encoder's k = ceil(0.01 x 128) = 2).
 *   - the codebook's distances 4 bins at a time, over the bins that hold
 *     weight (listed once, not scanned each round).
 * Invariant: the ISA changes how many lanes run, never a result: every
 * float and double comes from the base code's operations, in its order
 * where order rounds (the histogram adds, the Lloyd sums); where the
 * kernels only compare (the screens, a row's largest scores, its dense
 * minimum and maximum) they find what the base code finds. A row whose
 * normalized values hold a NaN (V: a degenerate dense range) goes through
 * the base code, whose NaN handling is its own.
 *
 * Scratch of one head in flight (kvp__kvq_head, one allocation):
 *
 *   lo[D][hm] hi[D][hm]  heaps of the hm smallest and largest (hm = m, or
 *                        the sample's j)
 *   lo_root[D] hi_root[D]  their roots; after the sample, the thresholds
 *   score[D] nrm[2][D]   a row's outlier scores; two rows' clipped normalized values
 *   cand_v[cap + 16]     candidates below lo_root or above hi_root (row order)
 *   sorted[cap]          the candidates by key
 *   replay[2 m]          one channel's heaps, for a replay
 *   cand_c[cap + 16]     the candidates' keys (i32): c below lo_root, D + c
 *                        above (lo_root <= hi_root: one side or none)
 *   cnt[2 D + 1]         the counting sort's (u32)
 *   bin[2][D]            two rows' bins, byte offsets into the histogram (i32)
 *   top[D]               a row's outlier channels (u16)
 */
#include "builtin.h"
#include "kernels.h"
#include "kvquant.h"

#include <pthread.h>
#include <stdatomic.h>

#if KVP__HAVE_AVX2
#include <immintrin.h>
#endif

/* ---- the fitter's state ------------------------------------------------------- */

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
  f->hist = calloc(2 * (KVP__KVQ_BINS + 1), sizeof *f->hist);
  if (!f->off || !f->rng || !f->inv || !f->done || !f->hist) {
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
  free(f->hist);
  memset(f, 0, sizeof *f);
}

void kvp__kvq_fit_reset(kvp__kvq_fit *f) {
  memset(f->done, 0, f->n_heads);
  memset(f->hist, 0, 2 * (KVP__KVQ_BINS + 1) * sizeof *f->hist);
}

/* ---- pass 1: the extremes ------------------------------------------------------ */

static _Atomic uint32_t sample_every = KVP__KVQ_SAMPLE_EVERY; /* tests: kvp__kvq_fit_set_sampling */
static _Atomic uint64_t n_replays;                             /* channels replayed, since the start */

void kvp__kvq_fit_set_sampling(uint32_t every) { atomic_store_explicit(&sample_every, every, memory_order_relaxed); }
uint64_t kvp__kvq_fit_replays(void) { return atomic_load_explicit(&n_replays, memory_order_relaxed); }

/* The root replaced by v, sifted down: the child that beats its sibling
 * (the left one on a tie) moves up while it beats v. The child is chosen by
 * arithmetic, not a branch (the compare is a coin flip): one branch per
 * level, taken once, at the end. */
static inline void heap_replace_root(float *h, uint32_t len, float v, int max) {
  const float none = max ? -INFINITY : INFINITY; /* a missing right child: never beats (samples are finite) */
  uint32_t i = 0;
  for (;;) {
    uint32_t l = 2 * i + 1;
    if (l >= len) break;
    float hl = h[l], hr = l + 1 < len ? h[l + 1] : none;
    uint32_t c = l + (uint32_t)(max ? hr > hl : hr < hl);
    float hc = h[c];
    if (!(max ? hc > v : hc < v)) break;
    h[i] = hc;
    i = c;
  }
  h[i] = v;
}

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

/* One row into the heaps (of hm each, hlen in them so far). */
static void heaps_row(kvp__kvq_head *hs, const float *row) {
  uint32_t len = hs->hlen, hm = hs->hm;
  for (uint32_t c = 0; c < hs->f->head_dim; c++) {
    float *lo = hs->lo + (size_t)c * hm, *hi = hs->hi + (size_t)c * hm, v = row[c];
    if (len < hm) {
      heap_push(lo, len, v, 1);
      heap_push(hi, len, v, 0);
    } else {
      if (v < lo[0]) heap_replace_root(lo, hm, v, 1);
      if (v > hi[0]) heap_replace_root(hi, hm, v, 0);
    }
    hs->lo_root[c] = lo[0];
    hs->hi_root[c] = hi[0];
  }
  hs->hlen += len < hm;
}

/* Value v of channel c into full heaps: what heaps_row does to it. */
static inline void heaps_take(kvp__kvq_head *hs, uint32_t c, float v) {
  float *lo = hs->lo + (size_t)c * hs->hm, *hi = hs->hi + (size_t)c * hs->hm;
  if (v < lo[0]) heap_replace_root(lo, hs->hm, v, 1), hs->lo_root[c] = lo[0];
  if (v > hi[0]) heap_replace_root(hi, hs->hm, v, 0), hs->hi_root[c] = hi[0];
}

/* The first bad sample or weight of the row of token seen, in the order
 * the message names: channel by channel, the sample first. */
static int row_check(const kvp__kvq_head *hs, const float *x, const float *w) {
  uint32_t tok = hs->seen;
  for (uint32_t c = 0; c < hs->f->head_dim; c++) {
    float a = x[c], b = w ? w[c] : 1.0f;
    if (!isfinite(a))
      return kvp__err(KVP_EINVAL, "kvquant calibration: sample token %u channel %u of head %u is not finite", tok, c,
                      hs->h);
    if (!isfinite(b) || b < 0)
      return kvp__err(KVP_EINVAL, "kvquant calibration: weight of token %u channel %u of head %u is not a finite "
                                  "non-negative number", tok, c, hs->h);
  }
  return KVP_OK;
}

/* The screen of one row (every > 0): the values below lo_root or above
 * hi_root, channels ascending, onto the candidates with their keys; past
 * cap, only the count. */
static void screen_row(kvp__kvq_head *hs, const float *xr) {
  const uint32_t D = hs->f->head_dim;
  uint32_t k = hs->ncand;
  for (uint32_t c = 0; c < D; c++) {
    int hi = xr[c] > hs->hi_root[c];
    if (hi || xr[c] < hs->lo_root[c]) {
      if (k < hs->cap) hs->cand_v[k] = xr[c], hs->cand_c[k] = (int32_t)(c + (hi ? D : 0));
      k += k <= hs->cap;
    }
  }
  hs->ncand = k;
}

static int rows_base(kvp__kvq_head *hs, const float *x, const float *w, size_t stride, uint32_t nrows) {
  for (uint32_t t = 0; t < nrows; t++, hs->seen++) {
    const float *xr = x + t * stride, *wr = w ? w + t * stride : NULL;
    int rc = hs->trusted ? KVP_OK : row_check(hs, xr, wr);
    if (rc) return rc;
    if (hs->every) screen_row(hs, xr);
    else if (hs->hlen < hs->hm) heaps_row(hs, xr);
    else
      for (uint32_t c = 0; c < hs->f->head_dim; c++) heaps_take(hs, c, xr[c]);
  }
  return KVP_OK;
}

/* The sample's rows are visited hop apart (mod ns): hop about 0.618 ns and
 * prime to it, so every stretch of the rows comes early and the heaps see
 * few replacements when the rows drift (sequences one after another). */
static uint32_t sample_hop(uint32_t ns) {
  uint32_t hop = (uint32_t)(ns * 0.6180339887) | 1u;
  for (;; hop += 2) {
    uint32_t a = ns, b = hop;
    while (b) {
      uint32_t t = a % b;
      a = b;
      b = t;
    }
    if (a == 1) return hop;
  }
}

#if KVP__HAVE_AVX2
/* For each 8-bit mask, the lanes it sets, first: a compress by permute. */
static int32_t compress_idx[256][8];
static pthread_once_t compress_once = PTHREAD_ONCE_INIT;

static void compress_init(void) {
  for (int m = 0; m < 256; m++)
    for (int l = 0, k = 0; l < 8; l++) {
      if (m >> l & 1) compress_idx[m][k++] = l;
      if (l == 7)
        while (k < 8) compress_idx[m][k++] = 0;
    }
}

/* screen_row 8 channels at a time from channel c0 (a multiple of 8): the
 * passing lanes, packed, are stored whole (8 values, 8 keys) at the
 * count, which then grows by their number; the spare entries past cap
 * take the tail of a store. Branch-free: a store costs less than the
 * mispredicted branch that would skip it; both sides in one list: half
 * the stores of a list per side. */
__attribute__((target("avx2"))) static void screen_avx2(kvp__kvq_head *hs, const float *xr, uint32_t c0) {
  const uint32_t D = hs->f->head_dim, Dv = D & ~7u, cap = hs->cap;
  const float *lo = hs->lo_root, *hi = hs->hi_root;
  float *cv = hs->cand_v;
  int32_t *cc = hs->cand_c;
  uint32_t k = hs->ncand;
  __m256i ci = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)c0));
  const __m256i step = _mm256_set1_epi32(8), vD = _mm256_set1_epi32((int)D);
  for (uint32_t c = c0; c < Dv; c += 8, ci = _mm256_add_epi32(ci, step)) {
    __m256 v = _mm256_loadu_ps(xr + c);
    __m256 g0 = _mm256_cmp_ps(v, _mm256_loadu_ps(lo + c), _CMP_LT_OQ);
    __m256 g1 = _mm256_cmp_ps(v, _mm256_loadu_ps(hi + c), _CMP_GT_OQ);
    unsigned mk = (unsigned)_mm256_movemask_ps(_mm256_or_ps(g0, g1));
    __m256i key = _mm256_add_epi32(ci, _mm256_and_si256(_mm256_castps_si256(g1), vD));
    __m256i p = _mm256_loadu_si256((const __m256i *)compress_idx[mk]);
    uint32_t a = k < cap ? k : cap; /* past cap: the spare, over and over */
    _mm256_storeu_ps(cv + a, _mm256_permutevar8x32_ps(v, p));
    _mm256_storeu_si256((__m256i *)(cc + a), _mm256_permutevar8x32_epi32(key, p));
    k += (uint32_t)__builtin_popcount(mk);
  }
  for (uint32_t c = Dv; c < D; c++) {
    int up = xr[c] > hi[c];
    if (up || xr[c] < lo[c]) {
      if (k < cap) cv[k] = xr[c], cc[k] = (int32_t)(c + (up ? D : 0));
      k++;
    }
  }
  hs->ncand = k < cap ? k : cap + 1; /* saturate: cap + 1 says overflow */
}

/* screen_avx2 16 channels at a time, packed by AVX-512's compress (half
 * the stores), then the rest by screen_avx2. */
__attribute__((target("avx2,avx512f,avx512dq,avx512vl"))) static void screen_avx512(kvp__kvq_head *hs, const float *xr) {
  const uint32_t D = hs->f->head_dim, D16 = D & ~15u, cap = hs->cap;
  const float *lo = hs->lo_root, *hi = hs->hi_root;
  float *cv = hs->cand_v;
  int32_t *cc = hs->cand_c;
  uint32_t k = hs->ncand;
  __m512i ci = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16), vD = _mm512_set1_epi32((int)D);
  for (uint32_t c = 0; c < D16; c += 16, ci = _mm512_add_epi32(ci, step)) {
    __m512 v = _mm512_loadu_ps(xr + c);
    __mmask16 m0 = _mm512_cmp_ps_mask(v, _mm512_loadu_ps(lo + c), _CMP_LT_OQ);
    __mmask16 m1 = _mm512_cmp_ps_mask(v, _mm512_loadu_ps(hi + c), _CMP_GT_OQ);
    __mmask16 mk = (__mmask16)(m0 | m1);
    uint32_t a = k < cap ? k : cap;
    _mm512_storeu_ps(cv + a, _mm512_maskz_compress_ps(mk, v));
    _mm512_storeu_si512(cc + a, _mm512_maskz_compress_epi32(mk, _mm512_mask_add_epi32(ci, m1, ci, vD)));
    k += (uint32_t)__builtin_popcount(mk);
  }
  hs->ncand = k < cap ? k : cap + 1;
  screen_avx2(hs, xr, D16);
}

/* rows_base with the check and the screen 8 channels at a time. */
__attribute__((target("avx2"))) static int rows_avx2(kvp__kvq_head *hs, const float *x, const float *w, size_t stride,
                                                     uint32_t nrows) {
  const uint32_t D = hs->f->head_dim, Dv = D & ~7u;
  const int avx512 = kvp__codec_isa() >= KVP__ISA_AVX512;
  const __m256 inf = _mm256_set1_ps(INFINITY), zero = _mm256_setzero_ps();
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (uint32_t t = 0; t < nrows; t++, hs->seen++) {
    const float *xr = x + t * stride, *wr = w ? w + t * stride : NULL;
    if (!hs->trusted) {
      __m256 ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
      for (uint32_t c = 0; c < Dv; c += 8) {
        ok = _mm256_and_ps(ok, _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(xr + c), absm), inf, _CMP_LT_OQ));
        if (wr) {
          __m256 b = _mm256_loadu_ps(wr + c);
          ok = _mm256_and_ps(ok, _mm256_and_ps(_mm256_cmp_ps(b, zero, _CMP_GE_OQ), _mm256_cmp_ps(b, inf, _CMP_LT_OQ)));
        }
      }
      int bad = _mm256_movemask_ps(ok) != 0xFF;
      for (uint32_t c = Dv; c < D; c++) bad |= !isfinite(xr[c]) || (wr && !(isfinite(wr[c]) && wr[c] >= 0));
      if (bad) return row_check(hs, xr, wr);
    }
    if (hs->every) {
      if (avx512) screen_avx512(hs, xr);
      else screen_avx2(hs, xr, 0);
      continue;
    }
    if (hs->hlen < hs->hm) {
      heaps_row(hs, xr);
      continue;
    }
    for (uint32_t c = 0; c < Dv; c += 8) {
      __m256 v = _mm256_loadu_ps(xr + c);
      __m256 pass = _mm256_or_ps(_mm256_cmp_ps(v, _mm256_loadu_ps(hs->lo_root + c), _CMP_LT_OQ),
                                 _mm256_cmp_ps(v, _mm256_loadu_ps(hs->hi_root + c), _CMP_GT_OQ));
      for (unsigned bits = (unsigned)_mm256_movemask_ps(pass); bits; bits &= bits - 1) {
        uint32_t ch = c + (uint32_t)__builtin_ctz(bits);
        heaps_take(hs, ch, xr[ch]);
      }
    }
    for (uint32_t c = Dv; c < D; c++) heaps_take(hs, c, xr[c]);
  }
  return KVP_OK;
}

/* The sample's thresholds by sorted lists instead of heaps (D a multiple
 * of 8, hm <= KVP__KVQ_SAMPLE_LISTS_MAX): each group of 8 channels keeps,
 * one lane a channel, the hm smallest values so far ascending (lo) and the
 * hm largest descending (hi), laid out [D / 8][hm][8] in hs->lo, hs->hi.
 * A row's 8 values go in by a branch-free ladder, every entry at once:
 *   L'[i] = max(L[i - 1], min(L[i], v)),  L'[0] = min(L[0], v)
 * (hi: min and max swapped), skipped when no lane beats the last entry.
 * The last entry is then the hm-th extreme, the value the heaps' root
 * holds whatever the order (a zero's sign aside, which no screen sees). */
#define SAMPLE_AHEAD 8u /* sample rows prefetched ahead */
__attribute__((target("avx2"))) static void sample_lists_avx2(kvp__kvq_head *hs, const float *s, size_t s_stride,
                                                           uint32_t ns) {
  const uint32_t D = hs->f->head_dim, hm = hs->hm, hop = sample_hop(ns);
  for (size_t i = 0; i < (size_t)D * hm; i++) hs->lo[i] = INFINITY, hs->hi[i] = -INFINITY;
  /* the rows come in hop order, which no hardware prefetcher follows: a
   * row from memory (an add's samples, every 16th row) is asked for
   * SAMPLE_AHEAD rows before its turn */
  uint32_t qa = (uint32_t)((uint64_t)SAMPLE_AHEAD * hop % ns);
  for (uint32_t i = 0, q = 0; i < ns; i++, q = (uint32_t)(((uint64_t)q + hop) % ns)) {
    const float *xr = s + (size_t)q * s_stride, *xa = s + (size_t)qa * s_stride;
    for (uint32_t c = 0; c < D; c += 16) __builtin_prefetch(xa + c);
    qa = (uint32_t)(((uint64_t)qa + hop) % ns);
    for (uint32_t g = 0; g < D / 8; g++) {
      __m256 v = _mm256_loadu_ps(xr + 8 * g);
      float *lo = hs->lo + (size_t)g * hm * 8, *hi = hs->hi + (size_t)g * hm * 8;
      if (_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_loadu_ps(lo + 8 * (hm - 1)), _CMP_LT_OQ))) {
        for (uint32_t j = hm - 1; j > 0; j--)
          _mm256_storeu_ps(lo + 8 * j, _mm256_max_ps(_mm256_loadu_ps(lo + 8 * (j - 1)),
                                                     _mm256_min_ps(_mm256_loadu_ps(lo + 8 * j), v)));
        _mm256_storeu_ps(lo, _mm256_min_ps(_mm256_loadu_ps(lo), v));
      }
      if (_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_loadu_ps(hi + 8 * (hm - 1)), _CMP_GT_OQ))) {
        for (uint32_t j = hm - 1; j > 0; j--)
          _mm256_storeu_ps(hi + 8 * j, _mm256_min_ps(_mm256_loadu_ps(hi + 8 * (j - 1)),
                                                     _mm256_max_ps(_mm256_loadu_ps(hi + 8 * j), v)));
        _mm256_storeu_ps(hi, _mm256_max_ps(_mm256_loadu_ps(hi), v));
      }
    }
  }
  for (uint32_t c = 0; c < D; c++) {
    size_t last = ((size_t)(c / 8) * hm + hm - 1) * 8 + c % 8;
    hs->lo_root[c] = hs->lo[last];
    hs->hi_root[c] = hs->hi[last];
  }
  hs->hlen = hm;
}

/* The sample's heaps: heaps_row with the screen 8 channels at a time. */
__attribute__((target("avx2"))) static void sample_avx2(kvp__kvq_head *hs, const float *s, size_t s_stride,
                                                       uint32_t ns) {
  const uint32_t D = hs->f->head_dim, Dv = D & ~7u, hop = sample_hop(ns);
  for (uint32_t i = 0, q = 0; i < ns; i++, q = (uint32_t)(((uint64_t)q + hop) % ns)) {
    const float *xr = s + (size_t)q * s_stride;
    if (hs->hlen < hs->hm) {
      heaps_row(hs, xr);
      continue;
    }
    for (uint32_t c = 0; c < Dv; c += 8) {
      __m256 v = _mm256_loadu_ps(xr + c);
      __m256 pass = _mm256_or_ps(_mm256_cmp_ps(v, _mm256_loadu_ps(hs->lo_root + c), _CMP_LT_OQ),
                                 _mm256_cmp_ps(v, _mm256_loadu_ps(hs->hi_root + c), _CMP_GT_OQ));
      for (unsigned bits = (unsigned)_mm256_movemask_ps(pass); bits; bits &= bits - 1) {
        uint32_t ch = c + (uint32_t)__builtin_ctz(bits);
        heaps_take(hs, ch, xr[ch]);
      }
    }
    for (uint32_t c = Dv; c < D; c++) heaps_take(hs, c, xr[c]);
  }
}
#endif

int kvp__kvq_head_begin(kvp__kvq_fit *f, uint32_t h, uint32_t n, kvp__kvq_head *hs) {
  memset(hs, 0, sizeof *hs);
  if (h >= f->n_heads) return kvp__err(KVP_EINVAL, "kvquant calibration: head %u >= %u", h, f->n_heads);
  if (f->done[h]) return kvp__err(KVP_EINVAL, "kvquant calibration: head %u fitted twice", h);
  if (n == 0) return kvp__err(KVP_EINVAL, "kvquant calibration: head %u has no samples", h);
  size_t D = f->head_dim;
  size_t ilo = (size_t)floor(f->fraction / 2 * (n - 1)); /* s[ilo] and s[n - 1 - ilo]: roots of the ilo + 1 extremes */
  size_t m = ilo + 1, every = atomic_load_explicit(&sample_every, memory_order_relaxed);
  size_t ns = every ? (n + every - 1) / every : 0;               /* sample rows */
  size_t j = every ? (2 * (m + 1) + every - 1) / every + 8 : 0; /* thresholds' expected rank: about 2 m + 8 every */
  if (!every || n < 64 * every || 8 * j > ns) every = j = 0;   /* little to screen out: the heaps over every row */
  size_t hm = every ? j : m, cap = every ? 2 * D * (2 * j * every + 64) : 0; /* about twice the candidates expected */
  /* f32, i32, u32, u16: each aligned; the sizes cannot overflow (m <= n / 4 + 1 < 2^30, D <= 2^12) */
  size_t spare = every ? 16 : 0, nf = 2 * D * hm + 5 * D + (cap + spare) + cap + (every ? 2 * m : 0);
  size_t bytes = nf * 4 + (cap + spare) * 4 + (2 * D + 1) * 4 + 2 * D * 4 + D * 2;
  void *mem = malloc(bytes);
  if (!mem) return kvp__err(KVP_ENOMEM, "kvquant calibration: %u samples", n);
  *hs = (kvp__kvq_head){.f = f, .h = h, .n = n, .m = (uint32_t)m, .every = (uint32_t)every, .hm = (uint32_t)hm,
                        .cap = (uint32_t)cap};
  hs->mem = mem;
  hs->lo = mem;
  hs->hi = hs->lo + D * hm;
  hs->lo_root = hs->hi + D * hm;
  hs->hi_root = hs->lo_root + D;
  hs->score = hs->hi_root + D;
  hs->nrm = hs->score + D;
  hs->cand_v = hs->nrm + 2 * D;
  hs->sorted = hs->cand_v + cap + spare;
  hs->replay = hs->sorted + cap;
  hs->cand_c = (int32_t *)(hs->replay + (every ? 2 * m : 0));
  hs->cnt = (uint32_t *)(hs->cand_c + cap + spare);
  hs->bin = (int32_t *)(hs->cnt + 2 * D + 1);
  hs->top = (uint16_t *)(hs->bin + 2 * D);
#if KVP__HAVE_AVX2
  pthread_once(&compress_once, compress_init);
#endif
  return KVP_OK;
}

void kvp__kvq_head_abort(kvp__kvq_head *hs) {
  free(hs->mem);
  memset(hs, 0, sizeof *hs);
}

void kvp__kvq_head_sample(kvp__kvq_head *hs, const float *s, size_t s_stride) {
  if (!hs->every) return;
  uint32_t ns = (hs->n + hs->every - 1) / hs->every;
#if KVP__HAVE_AVX2
  if (kvp__codec_isa() >= KVP__ISA_AVX2) {
    if (hs->f->head_dim % 8 == 0 && hs->hm <= KVP__KVQ_SAMPLE_LISTS_MAX) sample_lists_avx2(hs, s, s_stride, ns);
    else sample_avx2(hs, s, s_stride, ns);
    return;
  }
#endif
  uint32_t hop = sample_hop(ns);
  for (uint32_t i = 0, q = 0; i < ns; i++, q = (uint32_t)(((uint64_t)q + hop) % ns))
    heaps_row(hs, s + (size_t)q * s_stride);
}

int kvp__kvq_head_rows(kvp__kvq_head *hs, const float *x, const float *w, size_t x_stride, uint32_t nrows) {
  kvp__assert(nrows <= hs->n - hs->seen);
  int rc;
#if KVP__HAVE_AVX2
  if (kvp__codec_isa() >= KVP__ISA_AVX2) rc = rows_avx2(hs, x, w, x_stride, nrows);
  else
#endif
    rc = rows_base(hs, x, w, x_stride, nrows);
  if (rc) kvp__kvq_head_abort(hs);
  return rc;
}

/* A float's key in an order of unsigned integers that is the float order,
 * with -0 just below +0; and back. */
static inline uint32_t fkey(float v) {
  uint32_t u;
  memcpy(&u, &v, sizeof u);
  return u ^ ((uint32_t)((int32_t)u >> 31) | 0x80000000u);
}

static inline float fkey_float(uint32_t k) {
  uint32_t u = k ^ (k >> 31 ? 0x80000000u : 0xFFFFFFFFu);
  float v;
  memcpy(&v, &u, sizeof v);
  return v;
}

/* The k-th smallest (0-based) of a[0..n), in the key order (a zero's sign
 * aside, the float order): a radix select, 8 bits of key a round, each
 * round over the keys that share the bits found (kept in keys[n]). No
 * compare decides a branch but the counting's. */
static float select_kth(const float *a, uint32_t n, uint32_t k, uint32_t *keys) {
  uint32_t cnt[256], prefix = 0;
  memset(cnt, 0, sizeof cnt);
  for (uint32_t i = 0; i < n; i++) {
    keys[i] = fkey(a[i]);
    cnt[keys[i] >> 24]++;
  }
  for (int shift = 24;; shift -= 8) {
    uint32_t b = 0;
    while (k >= cnt[b]) k -= cnt[b++];
    prefix |= b << shift;
    if (shift == 0) return fkey_float(prefix);
    uint32_t keep = 0, hi_mask = ~0u << shift;
    memset(cnt, 0, sizeof cnt);
    for (uint32_t i = 0; i < n; i++) { /* the keys in the digit found: compacted, counted by the next digit */
      uint32_t u = keys[i];
      keys[keep] = u;
      int in = (u & hi_mask) == prefix;
      cnt[(u >> (shift - 8)) & 255] += (uint32_t)in;
      keep += (uint32_t)in;
    }
    n = keep;
  }
}

/* Channel c's extremes by the heaps over every row, in order: what they
 * give is what they gave, to the bit (a zero's sign included). */
static void replay(kvp__kvq_head *hs, const float *x, size_t stride, uint32_t c, float *lo_out, float *hi_out) {
  uint32_t m = hs->m;
  float *lo = hs->replay, *hi = lo + m;
  atomic_fetch_add_explicit(&n_replays, 1, memory_order_relaxed);
  for (uint32_t t = 0; t < hs->n; t++) {
    float v = x[t * stride + c];
    if (t < m) {
      heap_push(lo, t, v, 1);
      heap_push(hi, t, v, 0);
      continue;
    }
    if (v < lo[0]) heap_replace_root(lo, m, v, 1);
    if (v > hi[0]) heap_replace_root(hi, m, v, 0);
  }
  *lo_out = lo[0];
  *hi_out = hi[0];
}

/* Every channel's m-th smallest sample into lo_out[D] and m-th largest
 * into hi_out[D]; NAN where the candidates cannot tell (the caller
 * replays). With the sample, the candidates hold every value past the
 * thresholds: when at least m of a channel's are past one, its m-th
 * extreme of every value is among them, and is the m-th extreme of them.
 * A nonzero float equal to it has its bits, so any exact selection gives
 * the heaps' answer; a zero (whose sign only the heaps' order fixes), a
 * threshold the sample misplaced, or candidates past cap give NAN. */
static void select_sides(kvp__kvq_head *hs, float *lo_out, float *hi_out) {
  uint32_t D = hs->f->head_dim, m = hs->m, k = hs->ncand, *cnt = hs->cnt;
  for (uint32_t c = 0; c < D; c++) lo_out[c] = hi_out[c] = NAN;
  if (k > hs->cap) return;
  memset(cnt, 0, (2 * D + 1) * sizeof *cnt); /* by key (side, channel), in order: a counting sort */
  for (uint32_t i = 0; i < k; i++) cnt[hs->cand_c[i] + 1]++;
  for (uint32_t q = 0; q < 2 * D; q++) cnt[q + 1] += cnt[q];
  for (uint32_t i = 0; i < k; i++) hs->sorted[cnt[hs->cand_c[i]]++] = hs->cand_v[i];
  for (uint32_t q = 0, at = 0; q < 2 * D; at = cnt[q++]) { /* cnt[q]: the end of key q's run now */
    uint32_t nc = cnt[q] - at, side = q >= D;
    if (nc < m) continue;
    float v = select_kth(hs->sorted + at, nc, side ? nc - m : m - 1, (uint32_t *)hs->cand_c);
    if (v != 0) (side ? hi_out : lo_out)[q - (side ? D : 0)] = v;
  }
}

/* ---- pass 2: the histogram --------------------------------------------------------- */

/* A bin's pair: the weighted sum first, so that one cvtss2sd makes the
 * pair [n, 1] to add from a float n and the constant [., 1]. */
#define HIST_WN 0 /* sum of w n */
#define HIST_W 1  /* sum of w */

static void hist_add(kvp__kvq_fit *f, float n, float w) {
  if (n < -1.0f) n = -1.0f;
  if (n > 1.0f) n = 1.0f;
  uint32_t b = (uint32_t)((n + 1.0f) * 0.5f * KVP__KVQ_BINS);
  if (b >= KVP__KVQ_BINS) b = KVP__KVQ_BINS - 1;
  f->hist[2 * b + HIST_W] += w;
  f->hist[2 * b + HIST_WN] += (double)w * n;
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

#if KVP__HAVE_AVX2
/* Stores cost more than compares and loads on the machines measured
 * (about one random store per 2-3 cycles): the row kernel keeps a row's
 * scores in registers or recomputes them, and stores per value only its
 * bin and clipped value, then the histogram's add. */
#define VEC_TOPK_MAX 8u /* above: kvp__kvq_top over the stored scores */

__attribute__((target("avx2"))) static inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

__attribute__((target("avx2"))) static inline float hmin8(__m256 v) {
  __m128 m = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_min_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_min_ss(m, _mm_movehdup_ps(m)));
}

/* Each lane's largest score so far (vmx) and the first channel that had
 * it (vat): one step over the 8 scores s of channels ci. */
#define ARGMAX_STEP(vmx, vat, s, ci)                                                                                 \
  do {                                                                                                               \
    __m256 gt_ = _mm256_cmp_ps(s, vmx, _CMP_GT_OQ);                                                                  \
    vmx = _mm256_blendv_ps(vmx, s, gt_);                                                                             \
    vat = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vat), _mm256_castsi256_ps(ci), gt_));             \
  } while (0)

/* ARGMAX_STEP keeping each lane's two largest (m1 at a1, then m2 at a2,
 * the lower channel first among equal scores): the lane's channels come
 * in ascending order, so a score displaces an entry only when strictly
 * larger. */
#define ARGMAX2_STEP(m1, a1, m2, a2, s, ci) /* a1, a2, ci: __m256 holding the channels' bits */                      \
  do {                                                                                                               \
    __m256 g1_ = _mm256_cmp_ps(s, m1, _CMP_GT_OQ), g2_ = _mm256_cmp_ps(s, m2, _CMP_GT_OQ);                           \
    m2 = _mm256_blendv_ps(_mm256_blendv_ps(m2, s, g2_), m1, g1_);                                                    \
    a2 = _mm256_blendv_ps(_mm256_blendv_ps(a2, ci, g2_), a1, g1_);                                                   \
    m1 = _mm256_blendv_ps(m1, s, g1_);                                                                               \
    a1 = _mm256_blendv_ps(a1, ci, g1_);                                                                              \
  } while (0)

/* The largest of the lanes and the first channel with it (lanes a and b:
 * two accumulators over alternate vectors), then the scalar tail's
 * channels [Dv, D) with scores st[0 .. D - Dv). */
__attribute__((target("avx2"))) static uint32_t argmax_finish(__m256 va, __m256i ata, __m256 vb, __m256i atb,
                                                              const float *st, uint32_t Dv, uint32_t D) {
  __m256 gt = _mm256_cmp_ps(vb, va, _CMP_GT_OQ), eq = _mm256_cmp_ps(vb, va, _CMP_EQ_OQ);
  __m256 vmx = _mm256_blendv_ps(va, vb, gt);
  __m256i vat = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(ata), _mm256_castsi256_ps(atb), gt));
  vat = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(vat), _mm256_castsi256_ps(_mm256_min_epi32(ata, atb)),
                                             eq));
  float mx = hmax8(vmx);
  __m256i at = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(_mm256_set1_epi32(INT32_MAX)),
                                                    _mm256_castsi256_ps(vat),
                                                    _mm256_cmp_ps(vmx, _mm256_set1_ps(mx), _CMP_EQ_OQ)));
  __m128i a = _mm_min_epi32(_mm256_castsi256_si128(at), _mm256_extracti128_si256(at, 1));
  a = _mm_min_epi32(a, _mm_shuffle_epi32(a, _MM_SHUFFLE(1, 0, 3, 2)));
  a = _mm_min_epi32(a, _mm_shuffle_epi32(a, _MM_SHUFFLE(2, 3, 0, 1)));
  uint32_t best = Dv ? (uint32_t)_mm_cvtsi128_si32(a) : D;
  for (uint32_t c = Dv; c < D; c++)
    if (best == D || st[c - Dv] > mx) mx = st[c - Dv], best = c;
  return best;
}

/* All ones in the lanes of channels ci that are among top[0 .. k) */
__attribute__((target("avx2"))) static inline __m256 picked8(__m256i ci, const uint16_t *top, uint32_t k) {
  __m256i hit = _mm256_setzero_si256();
  for (uint32_t j = 0; j < k; j++) hit = _mm256_or_si256(hit, _mm256_cmpeq_epi32(ci, _mm256_set1_epi32(top[j])));
  return _mm256_castsi256_ps(hit);
}

static inline int picked1(uint32_t c, const uint16_t *top, uint32_t k) {
  for (uint32_t j = 0; j < k; j++)
    if (top[j] == c) return 1;
  return 0;
}

/* The outliers of a row, as kvp__kvq_top picks them (the k largest scores
 * |x - off| inv, ties to the lower channel): k times the first channel of
 * the largest score not yet picked, the scores recomputed each time (the
 * same operations, so the same values); top ascending. top[0 .. j0):
 * the first picks, which the caller found. */
__attribute__((target("avx2"))) static void top_avx2(const float *xr, const float *off, const float *inv, uint32_t D,
                                                     uint32_t k, uint32_t j0, uint16_t *top) {
  const uint32_t Dv = D & ~7u;
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), none = _mm256_set1_ps(-1.0f);
  const __m256i step = _mm256_set1_epi32(8);
  float st[8];
  for (uint32_t j = j0; j < k; j++) {
    __m256 va = none, vb = none;
    __m256i ata = _mm256_setzero_si256(), atb = ata, ci = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    uint32_t c = 0;
    for (; c + 16 <= Dv; c += 16) {
      __m256 sa = _mm256_mul_ps(_mm256_and_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(off + c)), absm),
                                _mm256_loadu_ps(inv + c));
      sa = _mm256_blendv_ps(sa, none, picked8(ci, top, j));
      ARGMAX_STEP(va, ata, sa, ci);
      ci = _mm256_add_epi32(ci, step);
      __m256 sb = _mm256_mul_ps(
          _mm256_and_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + c + 8), _mm256_loadu_ps(off + c + 8)), absm),
          _mm256_loadu_ps(inv + c + 8));
      sb = _mm256_blendv_ps(sb, none, picked8(ci, top, j));
      ARGMAX_STEP(vb, atb, sb, ci);
      ci = _mm256_add_epi32(ci, step);
    }
    if (c < Dv) {
      __m256 sa = _mm256_mul_ps(_mm256_and_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(off + c)), absm),
                                _mm256_loadu_ps(inv + c));
      sa = _mm256_blendv_ps(sa, none, picked8(ci, top, j));
      ARGMAX_STEP(va, ata, sa, ci);
    }
    for (c = Dv; c < D; c++) st[c - Dv] = picked1(c, top, j) ? -1.0f : fabsf(xr[c] - off[c]) * inv[c];
    top[j] = (uint16_t)argmax_finish(va, ata, vb, atb, st, Dv, D);
  }
  for (uint32_t i = 1; i < k; i++)
    for (uint32_t j = i; j > 0 && top[j - 1] > top[j]; j--) {
      uint16_t t = top[j];
      top[j] = top[j - 1];
      top[j - 1] = t;
    }
}

/* n clipped to [-1, 1] into nrm, its bin as a byte offset into hist into
 * boff: the base code's operations, 8 lanes at a time. */
__attribute__((target("avx2"))) static inline void bin_avx2(__m256 n, float *nrm, int32_t *boff) {
  const __m256 one = _mm256_set1_ps(1.0f);
  n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-1.0f)), one);
  /* (n + 1) 0.5 BINS: both factors powers of two, so one exact product */
  __m256i b = _mm256_cvttps_epi32(_mm256_mul_ps(_mm256_add_ps(n, one), _mm256_set1_ps(0.5f * KVP__KVQ_BINS)));
  b = _mm256_min_epi32(b, _mm256_set1_epi32(KVP__KVQ_BINS - 1));
  _mm256_storeu_ps(nrm, n);
  _mm256_storeu_si256((__m256i *)boff, _mm256_slli_epi32(b, 4)); /* 16 bytes a bin */
}

static inline void bin_one(float n, float *nrm, int32_t *boff) { /* bin_avx2 of one value: hist_add's steps */
  if (n < -1.0f) n = -1.0f;
  if (n > 1.0f) n = 1.0f;
  uint32_t b = (uint32_t)((n + 1.0f) * 0.5f * KVP__KVQ_BINS);
  if (b >= KVP__KVQ_BINS) b = KVP__KVQ_BINS - 1;
  *nrm = n;
  *boff = (int32_t)b << 4;
}

/* One row, 8 channels at a time, up to its adds: each value's clipped n
 * into nrm[D] and bin into boff[D], an outlier's the spare bin. 0, or 1
 * when the row must go through fit_token (V: a NaN among its values, from
 * a degenerate dense range). */
__attribute__((target("avx2"))) static int row_avx2(kvp__kvq_head *hs, const float *xr, uint32_t k, float *nrm,
                                                    int32_t *boff) {
  const kvp__kvq_fit *f = hs->f;
  const uint32_t D = f->head_dim, Dv = D & ~7u, kv = f->kv, keep = k > VEC_TOPK_MAX;
  const float *off = f->off + (size_t)hs->h * D, *inv = f->inv + (size_t)hs->h * D;
  float *score = hs->score, st[8];
  uint16_t *top = hs->top;
  const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), none = _mm256_set1_ps(-1.0f);
  const __m256i step = _mm256_set1_epi32(8);
  __m256 va = none, vb = none, va2 = none, vb2 = none;
  __m256i ata = _mm256_setzero_si256(), atb = ata, ata2 = ata, atb2 = ata;
  __m256i ci = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  if (k >= 2 && !keep) { /* each lane's two largest: the first two picks from one pass */
    __m256 fa = _mm256_setzero_ps(), fa2 = fa, fb = fa, fb2 = fa;
    for (uint32_t c = 0; c < Dv; c += 8, ci = _mm256_add_epi32(ci, step)) {
      __m256 d = _mm256_sub_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(off + c)), iv = _mm256_loadu_ps(inv + c);
      __m256 s = _mm256_mul_ps(_mm256_and_ps(d, absm), iv), cf = _mm256_castsi256_ps(ci);
      if (c & 8) ARGMAX2_STEP(vb, fb, vb2, fb2, s, cf);
      else ARGMAX2_STEP(va, fa, va2, fa2, s, cf);
      if (!kv) bin_avx2(_mm256_mul_ps(d, iv), nrm + c, boff + c);
    }
    ata = _mm256_castps_si256(fa), ata2 = _mm256_castps_si256(fa2);
    atb = _mm256_castps_si256(fb), atb2 = _mm256_castps_si256(fb2);
  } else
    for (uint32_t c = 0; c < Dv; c += 8, ci = _mm256_add_epi32(ci, step)) {
      __m256 d = _mm256_sub_ps(_mm256_loadu_ps(xr + c), _mm256_loadu_ps(off + c)), iv = _mm256_loadu_ps(inv + c);
      __m256 s = _mm256_mul_ps(_mm256_and_ps(d, absm), iv);
      if (keep) _mm256_storeu_ps(score + c, s);
      if (c & 8) ARGMAX_STEP(vb, atb, s, ci); /* two accumulators: half the dependent chain */
      else ARGMAX_STEP(va, ata, s, ci);
      if (!kv) bin_avx2(_mm256_mul_ps(d, iv), nrm + c, boff + c); /* K: n = d inv */
    }
  for (uint32_t c = Dv; c < D; c++) {
    float d = xr[c] - off[c];
    st[c - Dv] = score[c] = fabsf(d) * inv[c];
    if (!kv) bin_one(d * inv[c], nrm + c, boff + c);
  }
  /* inv is finite (head_end's test) and > 0 (1 / a finite rng): no score
   * and no K value is NaN, whatever |x - off| (up to inf) */
  if (keep) {
    kvp__kvq_top(score, D, k, top);
  } else if (k == 1) {
    top[0] = (uint16_t)argmax_finish(va, ata, vb, atb, st, Dv, D);
  } else if (k) {
    uint32_t c1 = argmax_finish(va, ata, vb, atb, st, Dv, D);
    /* the second: the best of the lanes, each without c1 (the lane that
     * had c1 first offers its second), and of the tail without c1 */
    __m256i v1 = _mm256_set1_epi32((int)c1);
    __m256 ha = _mm256_castsi256_ps(_mm256_cmpeq_epi32(ata, v1)), hb = _mm256_castsi256_ps(_mm256_cmpeq_epi32(atb, v1));
    va = _mm256_blendv_ps(va, va2, ha);
    ata = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(ata), _mm256_castsi256_ps(ata2), ha));
    vb = _mm256_blendv_ps(vb, vb2, hb);
    atb = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(atb), _mm256_castsi256_ps(atb2), hb));
    if (c1 >= Dv) st[c1 - Dv] = -1.0f;
    uint32_t c2 = argmax_finish(va, ata, vb, atb, st, Dv, D);
    top[0] = (uint16_t)(c1 < c2 ? c1 : c2);
    top[1] = (uint16_t)(c1 < c2 ? c2 : c1);
    if (k > 2) top_avx2(xr, off, inv, D, k, 2, top);
  }
  if (kv) { /* the dense values' middle and half-width, then n and its bin */
    const __m256 inf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
    __m256 vlo = inf, vhi = ninf, nan = _mm256_setzero_ps();
    ci = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (uint32_t c = 0; c < Dv; c += 8, ci = _mm256_add_epi32(ci, step)) {
      __m256 out = picked8(ci, top, k), xv = _mm256_loadu_ps(xr + c);
      vlo = _mm256_min_ps(vlo, _mm256_blendv_ps(xv, inf, out));
      vhi = _mm256_max_ps(vhi, _mm256_blendv_ps(xv, ninf, out));
    }
    float lo = hmin8(vlo), hi = hmax8(vhi);
    for (uint32_t c = Dv; c < D; c++)
      if (!picked1(c, top, k)) {
        lo = xr[c] < lo ? xr[c] : lo;
        hi = xr[c] > hi ? xr[c] : hi;
      }
    float m = (hi + lo) * 0.5f, r = (hi - lo) * 0.5f, ir = r > 0 ? 1.0f / r : 0.0f;
    __m256 vm = _mm256_set1_ps(m), vir = _mm256_set1_ps(ir);
    for (uint32_t c = 0; c < Dv; c += 8) {
      __m256 n = _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(xr + c), vm), vir);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(n, n, _CMP_UNORD_Q));
      bin_avx2(n, nrm + c, boff + c);
    }
    int bad = _mm256_movemask_ps(nan) != 0;
    for (uint32_t c = Dv; c < D; c++) {
      float n = (xr[c] - m) * ir;
      bad |= isnan(n);
      bin_one(n, nrm + c, boff + c);
    }
    if (bad) return 1;
  }
  for (uint32_t j = 0; j < k; j++) boff[top[j]] = (int32_t)KVP__KVQ_BINS << 4; /* the spare */
  return 0;
}

/* A row's adds, fit_token's in its order (channels ascending): [w n, w]
 * onto each value's bin pair, from row_avx2's nrm and boff. */
__attribute__((target("avx2"))) static void row_adds(kvp__kvq_fit *f, const float *nrm, const int32_t *boff,
                                                     const float *wr) {
  char *hist = (char *)f->hist;
  size_t c = 0, nD = f->head_dim;
  if (!wr) {
    const __m128d w1 = _mm_set_pd(1.0, 0.0); /* [., 1]: cvtss2sd sets the low lane, keeps the 1 */
#define ADD1(i)                                                                                                      \
  _mm_storeu_pd((double *)(hist + boff[i]),                                                                          \
                _mm_add_pd(_mm_loadu_pd((double *)(hist + boff[i])), _mm_cvtss_sd(w1, _mm_load_ss(nrm + (i)))))
    for (; c + 4 <= nD; c += 4) ADD1(c), ADD1(c + 1), ADD1(c + 2), ADD1(c + 3);
    for (; c < nD; c++) ADD1(c);
#undef ADD1
  } else {
    for (; c < nD; c++) {
      double *p = (double *)(hist + boff[c]);
      p[HIST_W] += wr[c];
      p[HIST_WN] += (double)wr[c] * nrm[c];
    }
  }
}
#endif

void kvp__kvq_head_end(kvp__kvq_head *hs, const float *x, const float *w, size_t x_stride) {
  kvp__kvq_fit *f = hs->f;
  uint32_t D = f->head_dim, h = hs->h;
  kvp__assert(hs->seen == hs->n);
  int finite = 1;
  float *lo_v = hs->score, *hi_v = hs->nrm; /* scratch until the histogram */
  if (hs->every) {
    select_sides(hs, lo_v, hi_v);
  } else
    for (uint32_t c = 0; c < D; c++) lo_v[c] = hs->lo[(size_t)c * hs->hm], hi_v[c] = hs->hi[(size_t)c * hs->hm];
  for (uint32_t c = 0; c < D; c++) {
    float lo = lo_v[c], hi = hi_v[c];
    if (isnan(lo) || isnan(hi)) replay(hs, x, x_stride, c, &lo, &hi);
    float off = (hi + lo) * 0.5f, rng = (hi - lo) * 0.5f;
    f->off[(size_t)h * D + c] = off;
    f->rng[(size_t)h * D + c] = rng > 0 && isfinite(rng) ? rng : 0x1p-24f;
    f->inv[(size_t)h * D + c] = 1.0f / f->rng[(size_t)h * D + c];
    finite &= isfinite(f->inv[(size_t)h * D + c]);
  }
  uint32_t k = kvp__kvq_outliers_k(f->fraction, D);
#if KVP__HAVE_AVX2
  int vec = finite && kvp__codec_isa() >= KVP__ISA_AVX2; /* an infinite inv: NaN scores, the base code's */
#else
  int vec = 0;
  (void)finite;
#endif
  /* The vector rows a step apart: row t is prepared (its bins, its
   * outliers: reductions whose latency the adds would wait for), then row
   * t - 1's adds run, then row t's fit_token if it needs one; the adds keep
   * their order. Buffers alternate between two halves of nrm and bin. */
  const float *pend_wr = NULL;
  int pend = -1; /* the half holding a row prepared and not added, or -1 */
  for (uint32_t t = 0; t < hs->n; t++) {
    const float *xr = x + (size_t)t * x_stride, *wr = w ? w + (size_t)t * x_stride : NULL;
#if KVP__HAVE_AVX2
    if (vec) {
      if (t + 4 < hs->n) /* the row 4 ahead, a line at a time: the rows come from memory, not cache */
        for (uint32_t c = 0; c < D; c += 16) __builtin_prefetch(xr + 4 * x_stride + c);
      int b = (int)(t & 1), bad = row_avx2(hs, xr, k, hs->nrm + b * D, hs->bin + b * D);
      if (pend >= 0) row_adds(f, hs->nrm + pend * D, hs->bin + pend * D, pend_wr);
      pend = bad ? -1 : b, pend_wr = wr;
      if (!bad) continue;
    }
#endif
    fit_token(f, h, xr, wr, k, hs->score, hs->top);
  }
#if KVP__HAVE_AVX2
  if (pend >= 0) row_adds(f, hs->nrm + pend * D, hs->bin + pend * D, pend_wr);
#endif
  (void)vec, (void)pend, (void)pend_wr;
  f->done[h] = 1;
  kvp__kvq_head_abort(hs);
}

int kvp__kvq_fit_head(kvp__kvq_fit *f, uint32_t h, const float *x, const float *w, size_t x_stride, uint32_t n) {
  kvp__kvq_head hs;
  int rc = kvp__kvq_head_begin(f, h, n, &hs);
  if (!rc && hs.every) kvp__kvq_head_sample(&hs, x, hs.every * x_stride);
  if (!rc) rc = kvp__kvq_head_rows(&hs, x, w, x_stride, n);
  if (!rc) kvp__kvq_head_end(&hs, x, w, x_stride);
  return rc;
}

/* ---- the codebook ------------------------------------------------------------------- */

/* label[i] = the nearest centroid of point xs[i] (the lowest index among
 * equal distances), for i < np. */
static void assign_base(const double *xs, uint32_t np, const double *c, uint32_t K, uint8_t *label) {
  for (uint32_t i = 0; i < np; i++) {
    double bd = INFINITY;
    uint8_t bl = 0;
    for (uint32_t j = 0; j < K; j++)
      if (fabs(xs[i] - c[j]) < bd) bd = fabs(xs[i] - c[j]), bl = (uint8_t)j;
    label[i] = bl;
  }
}

#if KVP__HAVE_AVX2
__attribute__((target("avx2"))) static void assign_avx2(const double *xs, uint32_t np, const double *c, uint32_t K,
                                                        uint8_t *label) {
  const __m256d absm = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7FFFFFFFFFFFFFFFll));
  uint32_t i = 0;
  for (; i + 4 <= np; i += 4) {
    __m256d x = _mm256_loadu_pd(xs + i), bd = _mm256_set1_pd(INFINITY), bl = _mm256_setzero_pd();
    for (uint32_t j = 0; j < K; j++) {
      __m256d d = _mm256_and_pd(_mm256_sub_pd(x, _mm256_set1_pd(c[j])), absm);
      __m256d lt = _mm256_cmp_pd(d, bd, _CMP_LT_OQ);
      bd = _mm256_blendv_pd(bd, d, lt);
      bl = _mm256_blendv_pd(bl, _mm256_set1_pd((double)j), lt);
    }
    int32_t l[4];
    _mm_storeu_si128((__m128i *)l, _mm256_cvttpd_epi32(bl));
    for (int q = 0; q < 4; q++) label[i + q] = (uint8_t)l[q];
  }
  assign_base(xs + i, np - i, c, K, label + i);
}
#endif

int kvp__kvq_fit_lut(const kvp__kvq_fit *f, float *lut) {
  for (uint32_t h = 0; h < f->n_heads; h++)
    if (!f->done[h]) return kvp__err(KVP_EINVAL, "kvquant calibration: head %u has no samples", h);
  uint32_t K = 1u << f->bits, B = KVP__KVQ_BINS;
  const double *hist = f->hist;
  double total = 0, c[KVP__KVQ_LUT_MAX];
  for (uint32_t b = 0; b < B; b++) total += hist[2 * b + HIST_W];
  if (!(total > 0)) {
    kvp__kvq_uniform_lut(f->bits, lut);
    return KVP_OK;
  }
  /* seeds: weighted quantiles */
  double acc = 0;
  uint32_t i = 0;
  for (uint32_t b = 0; b < B && i < K; b++) {
    double w = hist[2 * b + HIST_W], wn = hist[2 * b + HIST_WN];
    acc += w;
    while (i < K && acc >= (i + 0.5) / K * total) c[i++] = w > 0 ? wn / w : -1.0 + (b + 0.5) * 2.0 / B;
  }
  while (i < K) c[i] = c[i - 1], i++;
  /* the bins that hold weight, in order: point (weighted mean), weight, weighted sum */
  double *pts = malloc((size_t)B * (3 * sizeof(double) + 2));
  if (!pts) return kvp__err(KVP_ENOMEM, "kvquant calibration: k-means points");
  double *pw = pts + B, *pwx = pw + B;
  uint8_t *label = (uint8_t *)(pwx + B), *prev = label + B;
  uint32_t np = 0;
  for (uint32_t b = 0; b < B; b++)
    if (hist[2 * b + HIST_W] > 0)
      pw[np] = hist[2 * b + HIST_W], pwx[np] = hist[2 * b + HIST_WN], pts[np] = pwx[np] / pw[np], np++;
  for (int round = 0; round < 100; round++) {
#if KVP__HAVE_AVX2
    if (kvp__codec_isa() >= KVP__ISA_AVX2) assign_avx2(pts, np, c, K, label);
    else
#endif
      assign_base(pts, np, c, K, label);
    int changed = 0;
    double sw[KVP__KVQ_LUT_MAX] = {0}, swx[KVP__KVQ_LUT_MAX] = {0};
    for (uint32_t p = 0; p < np; p++) {
      changed |= round == 0 || label[p] != prev[p];
      sw[label[p]] += pw[p];
      swx[label[p]] += pwx[p];
    }
    memcpy(prev, label, np);
    for (uint32_t j = 0; j < K; j++)
      if (sw[j] > 0) c[j] = swx[j] / sw[j];
    if (!changed) break;
  }
  free(pts);
  for (uint32_t a = 1; a < K; a++) /* sort */
    for (uint32_t j = a; j > 0 && c[j - 1] > c[j]; j--) {
      double t = c[j];
      c[j] = c[j - 1];
      c[j - 1] = t;
    }
  for (uint32_t j = 0; j < K; j++) lut[j] = (float)fmin(1.0, fmax(-1.0, c[j]));
  return KVP_OK;
}
