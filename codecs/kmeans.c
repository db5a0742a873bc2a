/*
 * codecs/kmeans.c - Lloyd's k-means over the rows of a block, seeded by
 * k-means++ or warm-started (codecs/kmeans.h says what each call does).
 *
 * Cost per assignment: n k d multiply-adds, the whole price of the codec.
 * Rows are scored KM_TILE at a time against the transposed centroids:
 *
 *   score[r][j] = ||c_j||^2 + sum_i (-2 x[r][i]) ct[i][j]
 *
 *   ct (d x kp)      i = 0  [ c0[0] c1[0] ... c(k-1)[0] | 0 .. 0 ]
 *                    i = 1  [ c0[1] c1[1] ...           | 0 .. 0 ]
 *                                                         padding to kp
 *
 * so each row of ct is loaded once per tile and the inner loop (fixed
 * KVP__KM_LANES columns, restrict pointers) vectorizes at -O2 without
 * reassociating a sum: every score is accumulated in the order i = 0..d-1.
 * A tile first copies -2 x of its rows into km->xb (exact), so the SIMD
 * kernels broadcast each factor straight from memory. Padding columns
 * score +inf and are never chosen. With AVX2 (codecs/kernels.h's choice)
 * km_score_avx2 keeps four rows x sixteen columns of scores in registers
 * over every i, and km_near_avx2 32 rows' distances; with AVX-512,
 * km_score_avx512 sixteen rows x sixteen columns and km_near_avx512 64
 * rows: the same multiply and add per term, in the same order, so the
 * same bits (tests/unit/check_qvg.c isa_same_pages; pinned_bytes holds
 * the pages to the hashes they had before any of these kernels). The
 * label is the scan's (km_best); km_best_avx2 finds the same one from the
 * minimum and its first position.
 *
 * Invariants: after kvp__km_assign, label[t] = the lowest j minimizing
 * score[t][j] over j < k; after an update, cent[j] = mean of the rows
 * labelled j (double sums, one rounding to f32) or, with no such row, the
 * centroid as it was. An equal set of rows, seed and warm centroids gives
 * equal centroids and labels, bit for bit.
 */
#include "kmeans.h"

#include "kernels.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if KVP__HAVE_AVX2
#include <immintrin.h>
#endif

#define KM_TILE 16u /* rows scored together */

int kvp__km_init(kvp__km *km, uint32_t n, uint32_t d, uint32_t k) {
  memset(km, 0, sizeof *km);
  if (k < 1 || k > KVP__KM_MAX_K || k > n || d % 8) return -1;
  km->n = n;
  km->d = d;
  km->k = k;
  km->kp = (k + KVP__KM_LANES - 1) / KVP__KM_LANES * KVP__KM_LANES;
  km->cent = malloc((size_t)k * d * sizeof *km->cent);
  km->ct = calloc((size_t)d * km->kp, sizeof *km->ct);
  km->cn = malloc(km->kp * sizeof *km->cn);
  km->sum = malloc((size_t)k * d * sizeof *km->sum);
  km->count = malloc(k * sizeof *km->count);
  km->w = malloc((size_t)n * sizeof *km->w);
  km->label = calloc(n, 1);
  km->xt = malloc((size_t)n * d * sizeof *km->xt);
  km->acc = malloc((size_t)n * sizeof *km->acc);
  km->xb = malloc((size_t)KM_TILE * d * sizeof *km->xb);
  if (km->cent && km->ct && km->cn && km->sum && km->count && km->w && km->label && km->xt && km->acc && km->xb)
    return 0;
  kvp__km_free(km);
  return -1;
}

void kvp__km_free(kvp__km *km) {
  free(km->cent);
  free(km->ct);
  free(km->cn);
  free(km->sum);
  free(km->count);
  free(km->w);
  free(km->label);
  free(km->xt);
  free(km->acc);
  free(km->xb);
  memset(km, 0, sizeof *km);
}

/* ---- assignment ------------------------------------------------------------ */

/* ct and cn from cent. */
static void km_prepare(kvp__km *km) {
  uint32_t d = km->d, kp = km->kp;
  for (uint32_t j = 0; j < kp; j++) km->cn[j] = INFINITY;
  for (uint32_t j = 0; j < km->k; j++) {
    const float *c = km->cent + (size_t)j * d;
    float nrm = 0.0f;
    for (uint32_t i = 0; i < d; i++) {
      km->ct[(size_t)i * kp + j] = c[i];
      nrm += c[i] * c[i];
    }
    km->cn[j] = nrm;
  }
}

/* score (rows x kp) of a tile: xb holds -2 x of its rows (rows x d,
 * exact: a product by a power of two), see the banner. */
static void km_score(const kvp__km *km, const float *restrict xb, uint32_t rows, float *restrict score) {
  size_t d = km->d, kp = km->kp;
  for (size_t r = 0; r < rows; r++) memcpy(score + r * kp, km->cn, kp * sizeof *score);
  for (size_t i = 0; i < d; i++) {
    const float *restrict c = km->ct + i * kp;
    for (size_t r = 0; r < rows; r++) {
      float a = xb[r * d + i];
      float *restrict s = score + r * kp;
      for (size_t j = 0; j < kp; j += KVP__KM_LANES) /* size_t: no wrap, so the lanes vectorize */
        for (size_t l = 0; l < KVP__KM_LANES; l++) s[j + l] += a * c[j + l];
    }
  }
}

/* The lowest j < k minimizing s[j] (a scan with <, so a NaN s[0] keeps
 * 0 and a later NaN is never chosen). */
static uint32_t km_best(const float *s, uint32_t k) {
  uint32_t best = 0;
  float sb = s[0];
  for (uint32_t j = 1; j < k; j++)
    if (s[j] < sb) best = j, sb = s[j];
  return best;
}

#if KVP__HAVE_AVX2
/* km_score with AVX2 and the scores in registers: four rows x sixteen
 * columns (eight accumulators) over every i, so a step loads two vectors
 * of ct and broadcasts four elements of xb for 64 multiply-adds. The same
 * operations as km_score, in the same order per score (a multiply, then
 * an add: no FMA), so the same bits. */
__attribute__((target("avx2"))) static void km_score_avx2(const kvp__km *km, const float *restrict xb, uint32_t rows,
                                                         float *restrict score) {
  size_t d = km->d, kp = km->kp;
  for (size_t r0 = 0; r0 < rows; r0 += 4) {
    size_t nr = rows - r0 < 4 ? rows - r0 : 4;
    const float *xr[4];
    for (size_t r = 0; r < 4; r++) xr[r] = xb + (r0 + (r < nr ? r : 0)) * d;
    for (size_t j = 0; j < kp; j += 16) {
      __m256 n0 = _mm256_loadu_ps(km->cn + j), n1 = _mm256_loadu_ps(km->cn + j + 8);
      __m256 a00 = n0, a01 = n1, a10 = n0, a11 = n1, a20 = n0, a21 = n1, a30 = n0, a31 = n1;
      const float *c = km->ct + j;
      for (size_t i = 0; i < d; i++, c += kp) {
        __m256 c0 = _mm256_loadu_ps(c), c1 = _mm256_loadu_ps(c + 8);
        __m256 b0 = _mm256_broadcast_ss(xr[0] + i), b1 = _mm256_broadcast_ss(xr[1] + i);
        __m256 b2 = _mm256_broadcast_ss(xr[2] + i), b3 = _mm256_broadcast_ss(xr[3] + i);
        a00 = _mm256_add_ps(a00, _mm256_mul_ps(b0, c0)), a01 = _mm256_add_ps(a01, _mm256_mul_ps(b0, c1));
        a10 = _mm256_add_ps(a10, _mm256_mul_ps(b1, c0)), a11 = _mm256_add_ps(a11, _mm256_mul_ps(b1, c1));
        a20 = _mm256_add_ps(a20, _mm256_mul_ps(b2, c0)), a21 = _mm256_add_ps(a21, _mm256_mul_ps(b2, c1));
        a30 = _mm256_add_ps(a30, _mm256_mul_ps(b3, c0)), a31 = _mm256_add_ps(a31, _mm256_mul_ps(b3, c1));
      }
      float *o = score + r0 * kp + j;
      _mm256_storeu_ps(o, a00), _mm256_storeu_ps(o + 8, a01);
      if (nr > 1) _mm256_storeu_ps(o + kp, a10), _mm256_storeu_ps(o + kp + 8, a11);
      if (nr > 2) _mm256_storeu_ps(o + 2 * kp, a20), _mm256_storeu_ps(o + 2 * kp + 8, a21);
      if (nr > 3) _mm256_storeu_ps(o + 3 * kp, a30), _mm256_storeu_ps(o + 3 * kp + 8, a31);
    }
  }
}

/* km_best over the padded row (kp scores, +inf past k): the minimum, then
 * the first j holding a value equal to it, which is the scan's choice when
 * no score is NaN; with a NaN, the scan itself. */
__attribute__((target("avx2"))) static uint32_t km_best_avx2(const float *s, uint32_t k, uint32_t kp) {
  __m256 m = _mm256_loadu_ps(s), nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
  for (uint32_t j = 8; j < kp; j += 8) {
    __m256 v = _mm256_loadu_ps(s + j);
    m = _mm256_min_ps(m, v), nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(nan)) return km_best(s, k);
  m = _mm256_min_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
  m = _mm256_min_ps(m, _mm256_shuffle_ps(m, m, 0xB1)); /* the minimum in every lane */
  for (uint32_t j = 0;; j += 8) {
    int eq = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(s + j), m, _CMP_EQ_OQ));
    if (eq) return j + (uint32_t)__builtin_ctz((unsigned)eq); /* < k: a real score is <= the +inf padding */
  }
}

/* km_score with AVX-512: sixteen rows x sixteen columns (sixteen
 * accumulators) over every i, one vector of ct and sixteen broadcasts of
 * xb for 256 multiply-adds; the same operations in the same order per
 * score as km_score (no FMA: -std=c11 contracts none), so the same bits. */
__attribute__((target("avx2,avx512f"))) static void km_score_avx512(const kvp__km *km, const float *restrict xb,
                                                                    uint32_t rows, float *restrict score) {
  size_t d = km->d, kp = km->kp;
  for (size_t r0 = 0; r0 < rows; r0 += 16) {
    size_t nr = rows - r0 < 16 ? rows - r0 : 16;
    const float *xr[16];
    for (size_t r = 0; r < 16; r++) xr[r] = xb + (r0 + (r < nr ? r : 0)) * d;
    for (size_t j = 0; j < kp; j += 16) {
      __m512 a[16];
#pragma GCC unroll 16
      for (int r = 0; r < 16; r++) a[r] = _mm512_loadu_ps(km->cn + j);
      const float *c = km->ct + j;
      for (size_t i = 0; i < d; i++, c += kp) {
        __m512 cv = _mm512_loadu_ps(c);
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) a[r] = _mm512_add_ps(a[r], _mm512_mul_ps(_mm512_set1_ps(xr[r][i]), cv));
      }
      for (size_t r = 0; r < nr; r++) _mm512_storeu_ps(score + (r0 + r) * kp + j, a[r]);
    }
  }
}
#endif

/* Score a tile of rows (the row indices rows[0..nr)) and label them:
 * returns how many labels changed (all when fresh). */
static uint32_t km_assign_tile(kvp__km *km, const float *x, const uint32_t *rows, uint32_t nr, int fresh,
                               float *restrict xb, float *restrict score) {
  uint32_t changed = 0, d = km->d, kp = km->kp;
  int isa = kvp__codec_isa();
  for (uint32_t r = 0; r < nr; r++) {
    const float *xr = x + (size_t)rows[r] * d;
    for (uint32_t i = 0; i < d; i++) xb[(size_t)r * d + i] = -2.0f * xr[i];
  }
#if KVP__HAVE_AVX2
  if (isa >= KVP__ISA_AVX512) km_score_avx512(km, xb, nr, score);
  else if (isa >= KVP__ISA_AVX2) km_score_avx2(km, xb, nr, score);
  else
#endif
    km_score(km, xb, nr, score);
  for (uint32_t r = 0; r < nr; r++) {
    const float *s = score + (size_t)r * kp;
    uint32_t best;
#if KVP__HAVE_AVX2
    if (isa >= KVP__ISA_AVX2) best = km_best_avx2(s, km->k, kp);
    else
#endif
      best = km_best(s, km->k);
    if (fresh || km->label[rows[r]] != best) changed++;
    km->label[rows[r]] = (uint8_t)best;
  }
  return changed;
}

uint32_t kvp__km_assign(kvp__km *km, const float *x, int fresh) {
  float score[KM_TILE * KVP__KM_MAX_K];
  uint32_t rows[KM_TILE], changed = 0;
  km_prepare(km);
  for (uint32_t t0 = 0; t0 < km->n; t0 += KM_TILE) {
    uint32_t nr = km->n - t0 < KM_TILE ? km->n - t0 : KM_TILE;
    for (uint32_t r = 0; r < nr; r++) rows[r] = t0 + r;
    changed += km_assign_tile(km, x, rows, nr, fresh, km->xb, score);
  }
  return changed;
}

/* ---- update and Lloyd's loop ---------------------------------------------------- */

/* Each centroid to the mean of its rows; an empty cluster keeps its own. */
static void km_update(kvp__km *km, const float *x) {
  uint32_t d = km->d;
  memset(km->sum, 0, (size_t)km->k * d * sizeof *km->sum);
  memset(km->count, 0, km->k * sizeof *km->count);
  for (uint32_t t = 0; t < km->n; t++) {
    uint32_t l = km->label[t];
    double *s = km->sum + (size_t)l * d;
    const float *xr = x + (size_t)t * d;
    km->count[l]++;
    for (uint32_t i = 0; i < d; i++) s[i] += (double)xr[i];
  }
  for (uint32_t j = 0; j < km->k; j++) {
    if (!km->count[j]) continue;
    for (uint32_t i = 0; i < d; i++)
      km->cent[(size_t)j * d + i] = (float)(km->sum[(size_t)j * d + i] / (double)km->count[j]);
  }
}

uint32_t kvp__km_lloyd(kvp__km *km, const float *x, uint32_t iters) {
  kvp__km_assign(km, x, 1);
  uint32_t done = 0;
  while (done < iters) {
    km_update(km, x);
    done++;
    if (kvp__km_assign(km, x, 0) == 0) break;
  }
  return done;
}

double kvp__km_inertia(const kvp__km *km, const float *x) {
  double sum = 0.0;
  for (uint32_t t = 0; t < km->n; t++) {
    const float *xr = x + (size_t)t * km->d, *c = km->cent + (size_t)km->label[t] * km->d;
    for (uint32_t i = 0; i < km->d; i++) {
      double e = (double)xr[i] - (double)c[i];
      sum += e * e;
    }
  }
  return sum;
}

/* ---- k-means++ seeding ---------------------------------------------------------- */

/* xorshift64*: the generator of the seeding, local and fixed. */
static uint64_t km_rand(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1DULL;
}

#if KVP__HAVE_AVX2
/* acc[t] for rows [0, n / 32 * 32) with AVX2, 32 rows' sums in registers
 * over every i (km_near keeps them in acc[] between channels): the same
 * operations per sum in the same order, so the same bits. Returns how many
 * rows it did; km_near does the rest. */
__attribute__((target("avx2"))) static size_t km_near_avx2(kvp__km *km, uint32_t j) {
  size_t n = km->n, d = km->d, n32 = n / 32 * 32;
  const float *c = km->cent + j * d;
  float *restrict acc = km->acc;
  for (size_t t = 0; t < n32; t += 32) {
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    const float *xi = km->xt + t;
    for (size_t i = 0; i < d; i++, xi += n) {
      __m256 ci = _mm256_set1_ps(c[i]);
      __m256 e0 = _mm256_sub_ps(_mm256_loadu_ps(xi), ci), e1 = _mm256_sub_ps(_mm256_loadu_ps(xi + 8), ci);
      __m256 e2 = _mm256_sub_ps(_mm256_loadu_ps(xi + 16), ci), e3 = _mm256_sub_ps(_mm256_loadu_ps(xi + 24), ci);
      s0 = _mm256_add_ps(s0, _mm256_mul_ps(e0, e0)), s1 = _mm256_add_ps(s1, _mm256_mul_ps(e1, e1));
      s2 = _mm256_add_ps(s2, _mm256_mul_ps(e2, e2)), s3 = _mm256_add_ps(s3, _mm256_mul_ps(e3, e3));
    }
    _mm256_storeu_ps(acc + t, s0), _mm256_storeu_ps(acc + t + 8, s1);
    _mm256_storeu_ps(acc + t + 16, s2), _mm256_storeu_ps(acc + t + 24, s3);
  }
  return n32;
}

/* km_near_avx2 with AVX-512: 64 rows' sums in registers, the same
 * operations per sum in the same order. */
__attribute__((target("avx2,avx512f"))) static size_t km_near_avx512(kvp__km *km, uint32_t j) {
  size_t n = km->n, d = km->d, n64 = n / 64 * 64;
  const float *c = km->cent + j * d;
  float *restrict acc = km->acc;
  for (size_t t = 0; t < n64; t += 64) {
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    const float *xi = km->xt + t;
    for (size_t i = 0; i < d; i++, xi += n) {
      __m512 ci = _mm512_set1_ps(c[i]);
      __m512 e0 = _mm512_sub_ps(_mm512_loadu_ps(xi), ci), e1 = _mm512_sub_ps(_mm512_loadu_ps(xi + 16), ci);
      __m512 e2 = _mm512_sub_ps(_mm512_loadu_ps(xi + 32), ci), e3 = _mm512_sub_ps(_mm512_loadu_ps(xi + 48), ci);
      s0 = _mm512_add_ps(s0, _mm512_mul_ps(e0, e0)), s1 = _mm512_add_ps(s1, _mm512_mul_ps(e1, e1));
      s2 = _mm512_add_ps(s2, _mm512_mul_ps(e2, e2)), s3 = _mm512_add_ps(s3, _mm512_mul_ps(e3, e3));
    }
    _mm512_storeu_ps(acc + t, s0), _mm512_storeu_ps(acc + t + 16, s1);
    _mm512_storeu_ps(acc + t + 32, s2), _mm512_storeu_ps(acc + t + 48, s3);
  }
  return n64;
}
#endif


/* w[t] = min(w[t], ||x_t - cent[j]||^2) for every row (w[t] = it when
 * init). Over the transposed rows xt, so the loop over rows vectorizes
 * (KVP__KM_LANES at a time) and each distance sums i = 0..d-1 in order. */
static void km_near(kvp__km *km, uint32_t j, int init) {
  size_t n = km->n, d = km->d, t0 = 0; /* rows [0, t0) done with AVX2 */
#if KVP__HAVE_AVX2
  int isa = kvp__codec_isa();
  if (isa >= KVP__ISA_AVX512) t0 = km_near_avx512(km, j);
  else if (isa >= KVP__ISA_AVX2) t0 = km_near_avx2(km, j);
#endif
  size_t n16 = t0 + (n - t0) / KVP__KM_LANES * KVP__KM_LANES;
  const float *c = km->cent + j * d;
  float *restrict acc = km->acc;
  memset(acc + t0, 0, (n - t0) * sizeof *acc);
  for (size_t i = 0; i < d; i++) {
    const float *restrict xi = km->xt + i * n;
    float ci = c[i];
    for (size_t t = t0; t < n16; t += KVP__KM_LANES)
      for (size_t l = 0; l < KVP__KM_LANES; l++) {
        float e = xi[t + l] - ci;
        acc[t + l] += e * e;
      }
    for (size_t t = n16; t < n; t++) acc[t] += (xi[t] - ci) * (xi[t] - ci);
  }
  for (size_t t = 0; t < n; t++)
    if (init || acc[t] < km->w[t]) km->w[t] = acc[t];
}

/* The draw's integer weights: w[t] (>= 0) scaled by a power of two so the
 * largest is in [2^31, 2^32), then truncated: wq[t] = floor(w[t] 2^(32-e)),
 * wmax = m 2^e, m in [0.5, 1). Exact operations in double, so any order of
 * summing gives the same total, and a device twin that sums in parallel
 * draws the same row. A row under 2^-32 of the largest weight weighs 0.
 * Computed as w times scale = 2^(32-e): a float >= 0 times a power of two
 * in [2^-96, 2^180] is exact in double, so it equals ldexp(w, 32 - e). */
static inline uint64_t km_wq_at(float w, float wmax, double scale) {
  return (uint64_t)((double)(w < wmax ? w : wmax) * scale); /* a NaN weighs wmax, as fminf */
}

/* The row drawn with probability wq[t] / sum wq: the first t whose
 * inclusive prefix sum of wq passes r = floor(u total), u = the
 * generator's top 53 bits / 2^53; km->n when every weight is 0. */
static uint32_t km_draw(const kvp__km *km, uint64_t *s) {
  float wmax = 0.0f;
  for (uint32_t t = 0; t < km->n; t++) wmax = km->w[t] > wmax ? km->w[t] : wmax;
  if (!(wmax > 0.0f)) return km->n;
  if (!isfinite(wmax)) wmax = FLT_MAX; /* (a distance overflowed: such rows weigh the most) */
  int e;
  frexp((double)wmax, &e);
  double scale = ldexp(1.0, 32 - e);
  uint64_t total = 0;
  for (uint32_t t = 0; t < km->n; t++) total += km_wq_at(km->w[t], wmax, scale);
  uint64_t u = km_rand(s) >> 11;
  uint64_t r = (uint64_t)(((unsigned __int128)u * total) >> 53); /* < total */
  uint64_t cum = 0;
  for (uint32_t t = 0; t < km->n; t++) {
    cum += km_wq_at(km->w[t], wmax, scale);
    if (cum > r) return t;
  }
  return km->n - 1; /* not reached: r < total */
}

void kvp__km_seed(kvp__km *km, const float *x, uint32_t nwarm, uint64_t seed) {
  uint32_t d = km->d, have = nwarm;
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  if (have >= km->k) return;
  if (have == 0) {
    memcpy(km->cent, x + (size_t)(km_rand(&s) % km->n) * d, d * sizeof *x);
    have = 1;
  }
  for (size_t t = 0; t < km->n; t++)
    for (size_t i = 0; i < d; i++) km->xt[i * km->n + t] = x[t * d + i];
  for (uint32_t j = 0; j < have; j++) km_near(km, j, j == 0);
  for (; have < km->k; have++) {
    uint32_t t = km_draw(km, &s);
    if (t == km->n) break;
    memcpy(km->cent + (size_t)have * d, x + (size_t)t * d, d * sizeof *x);
    km_near(km, have, 0);
  }
  for (; have < km->k; have++) memcpy(km->cent + (size_t)have * d, km->cent, d * sizeof *x);
}
