/*
 * codecs/kmeans.c - Lloyd's k-means over the rows of a block, seeded by
 * k-means++ or warm-started (codecs/kmeans.h says what each call does).
 *
 * Cost per full assignment: n k d multiply-adds, the price of the codec.
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
 * While every row and centroid is in the bounds' range (below), ct holds
 * -2 c instead and the kernels broadcast each x[r][i] from the row where
 * it lies: -2 x and -2 c are exact, so x (-2 c) and (-2 x) c are the same
 * real product and round alike. Otherwise a tile first copies -2 x of its
 * rows into km->xb (exact), so the SIMD kernels broadcast each factor
 * straight from memory. Padding columns
 * score +inf and are never chosen. With AVX2 (codecs/kernels.h's choice)
 * km_score_avx2 keeps four rows x sixteen columns of scores in registers
 * over every i; with AVX-512, km_score_avx512 sixteen (then four) rows x
 * sixteen columns: the same multiply and add per term, in the same order,
 * so the same bits. The label is the scan's (km_best); km_best_avx2 finds
 * the same one from the minimum and its first position.
 *
 * Pruning, exact: an assignment scores each row only against the
 * centroids that can still win it (bounds kept between calls, the f32
 * rounding of a score bounded: "candidates" below), and k-means++ sums a
 * seed's distances only over blocks of 16 rows that it can move (the rows
 * live by block, grouped by nearest seed: "k-means++ distances" below).
 * What is skipped could not change a label, a weight or a centroid, so
 * the results are those of the full computation, bit for bit, in every
 * ISA (tests/unit/check_qvg.c: isa_same_pages, km_candidates_same_labels,
 * and pinned_bytes, which holds the pages to the hashes they had before
 * any of this). Structured rows (a segment-head of a video, 64 patterns)
 * score about a tenth of the full assignments; noise scores all of them.
 *
 * Invariants: after kvp__km_assign, label[t] = the lowest j minimizing
 * score[t][j] over j < k, and ub[t] >= ||x_t - c_label[t]||; after an
 * update, cent[j] = mean of the rows labelled j (double sums in row order,
 * one rounding to f32) or, with no such row, the centroid as it was. An
 * equal set of rows, seed and warm centroids gives equal centroids and
 * labels, bit for bit.
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
  km->nblk = (n + 15) / 16;
  km->xt = malloc((size_t)km->nblk * 16 * d * sizeof *km->xt);
  km->perm = malloc((size_t)km->nblk * 16 * sizeof *km->perm);
  km->blk = malloc((size_t)km->nblk * sizeof *km->blk);
  km->acc = malloc((size_t)km->nblk * 16 * sizeof *km->acc);
  km->xb = malloc((size_t)KM_TILE * d * sizeof *km->xb);
  km->cold = malloc((size_t)k * d * sizeof *km->cold);
  km->mv = malloc(k * sizeof *km->mv);
  km->cnd = malloc(k * sizeof *km->cnd);
  km->ub = malloc((size_t)n * sizeof *km->ub);
  km->xn2 = malloc((size_t)n * sizeof *km->xn2);
  km->xn = malloc((size_t)n * sizeof *km->xn);
  km->act = malloc((size_t)n * sizeof *km->act);
  km->full = malloc((size_t)n * sizeof *km->full);
  km->start = malloc((k + 1) * sizeof *km->start);
  km->pos = malloc(k * sizeof *km->pos);
  km->idx = malloc(k * sizeof *km->idx);
  km->ccs = malloc((size_t)k * km->kp * sizeof *km->ccs);
  km->ct2 = malloc((size_t)d * km->kp * sizeof *km->ct2);
  km->cn2 = malloc(km->kp * sizeof *km->cn2);
  km->wtp = malloc((size_t)km->nblk * 16 * sizeof *km->wtp);
  km->labp = malloc((size_t)km->nblk * 16);
  km->wp = malloc((size_t)km->nblk * 16 * sizeof *km->wp);
  km->ccl = malloc(k * sizeof *km->ccl);
  km->prune = 1;
  km->inplace = 1;
  km->eps = 4.0 * (d + 2) * 0x1p-24;
  if (km->cent && km->ct && km->cn && km->sum && km->count && km->w && km->label && km->xt && km->acc && km->xb &&
      km->cold && km->mv && km->cnd && km->ub && km->xn2 && km->xn && km->act && km->full && km->start && km->pos &&
      km->idx && km->ccs && km->ct2 && km->cn2 && km->wtp && km->labp && km->wp && km->ccl && km->perm && km->blk)
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
  free(km->cold);
  free(km->mv);
  free(km->cnd);
  free(km->ub);
  free(km->xn2);
  free(km->xn);
  free(km->act);
  free(km->full);
  free(km->start);
  free(km->pos);
  free(km->idx);
  free(km->ccs);
  free(km->ct2);
  free(km->cn2);
  free(km->wtp);
  free(km->labp);
  free(km->wp);
  free(km->ccl);
  free(km->perm);
  free(km->blk);
  memset(km, 0, sizeof *km);
}

/* ---- candidates: assignments that score only the centroids that can win ---- */

/* Every row keeps a reference centroid a (its label, or after k-means++
 * its nearest seed) and ub[t] >= ||x_t - c_a||, in real arithmetic on the
 * f32 values. A computed score differs from s_j = ||c_j||^2 - 2 x.c_j =
 * ||x - c_j||^2 - ||x||^2 by at most
 *
 *   E(t) = 4 (d + 2) 2^-24 (M^2 + ||x_t|| M) + 2^-120,   M >= max ||c_j||
 *
 * (the f32 sums of d + 1 terms, cn's own sum included, a factor 2 to
 * spare, and every underflow). By the triangle inequality, a centroid j
 * with ||c_a - c_j|| = c > U + sqrt(U^2 + 2E), U and E the largest ub and
 * E of the rows of a, has ||x - c_j||^2 - ||x - c_a||^2 >= c (c - 2U) > 2E
 * for each of them: its computed score exceeds a's, so it is not the
 * scan's choice and is not scored (Elkan's first lemma, with the f32
 * rounding bounded). The rows of a are scored against the rest, in
 * ascending index, with the same kernels and the same per-score order:
 * the labels are a full assignment's, bit for bit. The centroid distances
 * c come from scoring the centroids themselves as rows (error E(M)).
 * Bounds are computed in double with a relative slack KM_REL for its
 * roundings, and used only while every row and centroid is below 2^50 in
 * norm (no f32 sum can overflow); else every score is computed. */
#define KM_REL 1e-12

/* Sum of (a_i - b_i)^2 (b NULL: of a_i^2) in double; relative error under
 * (d + 2) 2^-53 < KM_REL / 2 in any order, so four chains. */
static double km_sq(const float *a, const float *b, uint32_t d) {
  double s[4] = {0, 0, 0, 0};
  for (uint32_t i = 0; i < d; i += 4)
    for (uint32_t l = 0; l < 4; l++) {
      double e = (double)a[i + l] - (b ? (double)b[i + l] : 0.0);
      s[l] += e * e;
    }
  return (s[0] + s[1]) + (s[2] + s[3]);
}

/* xn2 and xn (upper bounds on ||x_t||^2 and ||x_t||) of every row, and
 * whether all are in the bounds' range. */
#if KVP__HAVE_AVX2
/* km_sq of nr rows of d elements (b NULL: of a's rows alone) with AVX-512,
 * in double (any order, so an FMA per term). */
__attribute__((target("avx2,avx512f"))) static void km_sq_rows_avx512(const float *a, const float *b, uint32_t nr,
                                                                      uint32_t d, double *out) {
  for (uint32_t t = 0; t < nr; t++) {
    const float *ar = a + (size_t)t * d, *br = b ? b + (size_t)t * d : NULL;
    __m512d s = _mm512_setzero_pd();
    for (uint32_t i = 0; i < d; i += 8) {
      __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(ar + i));
      if (br) v = _mm512_sub_pd(v, _mm512_cvtps_pd(_mm256_loadu_ps(br + i)));
      s = _mm512_fmadd_pd(v, v, s);
    }
    out[t] = _mm512_reduce_add_pd(s);
  }
}
#endif

/* out[t] = km_sq of row t of a (and b) for nr rows, by the ISA in force. */
static void km_sq_rows(const float *a, const float *b, uint32_t nr, uint32_t d, double *out) {
#if KVP__HAVE_AVX2
  if (kvp__codec_isa() >= KVP__ISA_AVX512) {
    km_sq_rows_avx512(a, b, nr, d, out);
    return;
  }
#endif
  for (uint32_t t = 0; t < nr; t++) out[t] = km_sq(a + (size_t)t * d, b ? b + (size_t)t * d : NULL, d);
}

static void km_norms(kvp__km *km, const float *x) {
  int ok = 1;
  km_sq_rows(x, NULL, km->n, km->d, km->xn2);
  for (uint32_t t = 0; t < km->n; t++) {
    double n2 = km->xn2[t] * (1.0 + KM_REL);
    km->xn2[t] = n2;
    km->xn[t] = sqrt(n2) * (1.0 + KM_REL);
    ok = ok && n2 < 0x1p100;
  }
  km->xok = ok;
}

/* The error bound E of the scores of a row of norm at most xn. */
static inline double km_err(const kvp__km *km, double xn) { return km->eps * (km->m2 + xn * km->m) + 0x1p-120; }

/* ub of row t from its computed score sa against its new label. */
static inline void km_ub(kvp__km *km, uint32_t t, float sa) {
  km->ub[t] = sqrt(fmax(km->xn2[t] + (double)sa + km_err(km, km->xn[t]), 0.0)) * (1.0 + KM_REL);
}

/* Each centroid's move since the bounds were set into mv. Returns 0 (score
 * everything) when a value is out of the bounds' range. */
static int km_moves(kvp__km *km) {
  if (!(km->m2 < 0x1p100) || !km->xok) return 0;
  km_sq_rows(km->cent, km->cold, km->k, km->d, km->mv);
  for (uint32_t j = 0; j < km->k; j++) km->mv[j] = sqrt(km->mv[j]) * (1.0 + KM_REL);
  return 1;
}

/* ---- assignment ------------------------------------------------------------ */

/* Columns of centroids a kernel scores against. */
typedef struct km_cols {
  const float *ct; /* d x kp: column j holds a centroid (padding 0) */
  const float *cn; /* kp: its ||c||^2 as km_prepare sums it, +inf in the padding */
  size_t kp;       /* columns, a multiple of KVP__KM_LANES */
} km_cols;

/* cn from cent; cnd, m2 and m for the bounds. */
static void km_prepare(kvp__km *km) {
  uint32_t d = km->d, kp = km->kp;
  double m2 = 0.0;
  km_sq_rows(km->cent, NULL, km->k, d, km->cnd);
  for (uint32_t j = 0; j < kp; j++) km->cn[j] = INFINITY;
  for (uint32_t j = 0; j < km->k; j++) {
    const float *c = km->cent + (size_t)j * d;
    float nrm = 0.0f;
    for (uint32_t i = 0; i < d; i++) nrm += c[i] * c[i];
    km->cn[j] = nrm;
    km->cnd[j] *= 1.0 - KM_REL; /* a lower bound on ||c_j||^2 */
    m2 = km->cnd[j] > m2 || isnan(km->cnd[j]) ? km->cnd[j] : m2; /* a NaN sticks */
  }
  km->m2 = m2 * (1.0 + 3 * KM_REL);
  km->m = sqrt(km->m2) * (1.0 + KM_REL);
}

/* ct from cent, after km_prepare and km_norms: -2 c when every row and
 * centroid is in the bounds' range (|x_i|, |c_i| < 2^50: -2 x and -2 c
 * exact and finite, so x (-2 c) and (-2 x) c are one real product, one
 * rounding, the same bits), and the tiles then score the rows where they
 * lie; else c, and a tile first copies -2 x into km->xb (the banner). */
static void km_fill_ct(kvp__km *km) {
  uint32_t d = km->d, kp = km->kp;
  km->neg2c = km->inplace && km->m2 < 0x1p100 && km->xok;
  const float f = km->neg2c ? -2.0f : 1.0f;
  for (uint32_t j = 0; j < km->k; j++) {
    const float *c = km->cent + (size_t)j * d;
    for (uint32_t i = 0; i < d; i++) km->ct[(size_t)i * kp + j] = f * c[i];
  }
}

/* score (rows x kp) of a tile: xb holds -2 x of its rows (rows x d,
 * exact: a product by a power of two), see the banner. */
static void km_score(const km_cols *cc, size_t d, const float *const *xp, uint32_t rows, float *restrict score) {
  size_t kp = cc->kp;
  for (size_t r = 0; r < rows; r++) memcpy(score + r * kp, cc->cn, kp * sizeof *score);
  for (size_t i = 0; i < d; i++) {
    const float *restrict c = cc->ct + i * kp;
    for (size_t r = 0; r < rows; r++) {
      float a = xp[r][i];
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
__attribute__((target("avx2"))) static void km_score_avx2(const km_cols *cc, size_t d, const float *const *xp,
                                                         uint32_t rows, float *restrict score) {
  size_t kp = cc->kp;
  for (size_t r0 = 0; r0 < rows; r0 += 4) {
    size_t nr = rows - r0 < 4 ? rows - r0 : 4;
    const float *xr[4];
    for (size_t r = 0; r < 4; r++) xr[r] = xp[r0 + (r < nr ? r : 0)];
    for (size_t j = 0; j < kp; j += 16) {
      __m256 n0 = _mm256_loadu_ps(cc->cn + j), n1 = _mm256_loadu_ps(cc->cn + j + 8);
      __m256 a00 = n0, a01 = n1, a10 = n0, a11 = n1, a20 = n0, a21 = n1, a30 = n0, a31 = n1;
      const float *c = cc->ct + j;
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
__attribute__((target("avx2"))) static uint32_t km_best_avx2(const float *s, uint32_t k, size_t kp) {
  __m256 m = _mm256_loadu_ps(s), nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
  for (size_t j = 8; j < kp; j += 8) {
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

/* km_score with AVX-512: R rows x sixteen columns (R accumulators) over
 * every i, one vector of ct and R broadcasts of xb per step: R = 16 while
 * sixteen rows remain, then R = 4 (four chains still cover the add
 * latency), so the small tiles of the candidates' path waste little. The
 * same operations in the same order per score as km_score (no FMA:
 * -std=c11 contracts none), so the same bits. */
#define KM_SCORE512(R)                                                                                               \
  for (size_t j = 0; j < kp; j += 16) {                                                                              \
    __m512 a[R];                                                                                                     \
    _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) a[r] = _mm512_loadu_ps(cc->cn + j);                         \
    const float *c = cc->ct + j;                                                                                     \
    for (size_t i = 0; i < d; i++, c += kp) {                                                                        \
      __m512 cv = _mm512_loadu_ps(c);                                                                                \
      _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) a[r] =                                                    \
          _mm512_add_ps(a[r], _mm512_mul_ps(_mm512_set1_ps(xr[r][i]), cv));                                          \
    }                                                                                                                \
    for (size_t r = 0; r < nr; r++) _mm512_storeu_ps(score + (r0 + r) * kp + j, a[r]);                              \
  }
__attribute__((target("avx2,avx512f"))) static void km_score_avx512(const km_cols *cc, size_t d,
                                                                    const float *const *xp, uint32_t rows,
                                                                    float *restrict score) {
  size_t kp = cc->kp, r0 = 0;
  const float *xr[16];
  for (; r0 + 16 <= rows; r0 += 16) {
    size_t nr = 16;
    for (size_t r = 0; r < 16; r++) xr[r] = xp[r0 + r];
    KM_SCORE512(16)
  }
  for (; r0 < rows; r0 += 4) {
    size_t nr = rows - r0 < 4 ? rows - r0 : 4;
    for (size_t r = 0; r < 4; r++) xr[r] = xp[r0 + (r < nr ? r : 0)];
    KM_SCORE512(4)
  }
}
#undef KM_SCORE512
#endif

/* Scores (nr x cc->kp) of nr <= KM_TILE rows (src + rows[r] * d, or row r
 * of src when rows is NULL) by the ISA in force. */
#if KVP__HAVE_AVX2
/* km_score_rows' copy of -2 x (exact) with AVX2, eight elements a step */
__attribute__((target("avx2"))) static void km_neg2_avx2(float *restrict xb, const float *src, const uint32_t *rows,
                                                        uint32_t nr, uint32_t d) {
  const __m256 m2 = _mm256_set1_ps(-2.0f);
  for (uint32_t r = 0; r < nr; r++) {
    const float *xr = src + (size_t)(rows ? rows[r] : r) * d;
    float *o = xb + (size_t)r * d;
    for (uint32_t i = 0; i < d; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(m2, _mm256_loadu_ps(xr + i)));
  }
}
#endif

static void km_score_rows(kvp__km *km, const km_cols *cc, const float *src, const uint32_t *rows, uint32_t nr,
                          float *restrict score) {
  uint32_t d = km->d; /* a multiple of 8 */
  float *restrict xb = km->xb;
  const float *xp[KM_TILE]; /* the factors of each row: the row itself (ct holds -2 c), or its -2 x in xb */
#if KVP__HAVE_AVX2
  int isa = kvp__codec_isa();
#endif
  if (km->neg2c) {
    for (uint32_t r = 0; r < nr; r++) xp[r] = src + (size_t)(rows ? rows[r] : r) * d;
  } else {
    for (uint32_t r = 0; r < nr; r++) xp[r] = xb + (size_t)r * d;
#if KVP__HAVE_AVX2
    if (isa >= KVP__ISA_AVX2) km_neg2_avx2(xb, src, rows, nr, d);
    else
#endif
      for (uint32_t r = 0; r < nr; r++) {
        const float *restrict xr = src + (size_t)(rows ? rows[r] : r) * d;
        float *restrict o = xb + (size_t)r * d;
        for (uint32_t i = 0; i < d; i++) o[i] = -2.0f * xr[i];
      }
  }
#if KVP__HAVE_AVX2
  if (isa >= KVP__ISA_AVX512) km_score_avx512(cc, d, xp, nr, score);
  else if (isa >= KVP__ISA_AVX2) km_score_avx2(cc, d, xp, nr, score);
  else
#endif
    km_score(cc, d, xp, nr, score);
  km->nscored += (uint64_t)nr * cc->kp;
}

/* Label rows[0..nr) against the columns of cc, column m being centroid
 * idx[m] (idx ascending; NULL: column m is centroid m) of nc real ones;
 * sets their ub. Returns how many labels changed (all when fresh). */
static uint32_t km_label_rows(kvp__km *km, const km_cols *cc, const uint32_t *idx, uint32_t nc, const float *x,
                              const uint32_t *rows, uint32_t nr, int fresh) {
  float score[KM_TILE * KVP__KM_MAX_K];
  uint32_t changed = 0;
  for (uint32_t r0 = 0; r0 < nr; r0 += KM_TILE) {
    uint32_t m = nr - r0 < KM_TILE ? nr - r0 : KM_TILE;
    km_score_rows(km, cc, x, rows + r0, m, score);
    for (uint32_t r = 0; r < m; r++) {
      const float *s = score + (size_t)r * cc->kp;
      uint32_t b, t = rows[r0 + r];
#if KVP__HAVE_AVX2
      if (kvp__codec_isa() >= KVP__ISA_AVX2) b = km_best_avx2(s, nc, cc->kp);
      else
#endif
        b = km_best(s, nc);
      uint32_t best = idx ? idx[b] : b;
      if (fresh || km->label[t] != best) changed++;
      km->label[t] = (uint8_t)best;
      km_ub(km, t, s[b]);
    }
  }
  return changed;
}

/* The centroids as rows against all of them: ccs[a kp + j] = the computed
 * score of c_a against c_j. */
static void km_center_scores(kvp__km *km, const km_cols *all) {
  for (uint32_t a0 = 0; a0 < km->k; a0 += KM_TILE) {
    uint32_t m = km->k - a0 < KM_TILE ? km->k - a0 : KM_TILE;
    km_score_rows(km, all, km->cent + (size_t)a0 * km->d, NULL, m, km->ccs + (size_t)a0 * km->kp);
  }
}

/* ct2, cn2: columns idx[0..nc) of ct and cn, zero and +inf up to cp. Up
 * to KM_FEW_COLS columns (a structured block's usual two to nine) come
 * from the centroids' rows, read in order, rather than by gathers. */
#define KM_FEW_COLS 8u
#if KVP__HAVE_AVX2
__attribute__((target("avx2,avx512f"))) static void km_gather_cols_avx512(kvp__km *km, uint32_t nc, size_t cp) {
  size_t d = km->d, kp = km->kp;
  for (size_t m0 = 0; m0 < cp; m0 += 16) {
    uint32_t left = nc > m0 ? nc - (uint32_t)m0 : 0;
    __mmask16 in = (__mmask16)(left >= 16 ? 0xFFFFu : (1u << left) - 1u);
    __m512i ix = _mm512_maskz_loadu_epi32(in, km->idx + m0);
    for (size_t i = 0; i < d; i++)
      _mm512_storeu_ps(km->ct2 + i * cp + m0, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in, ix, km->ct + i * kp, 4));
  }
}
#endif

static void km_gather_cols(kvp__km *km, uint32_t nc, size_t cp) {
  size_t d = km->d, kp = km->kp;
  for (size_t m = 0; m < cp; m++) km->cn2[m] = m < nc ? km->cn[km->idx[m]] : INFINITY;
  if (nc <= KM_FEW_COLS) { /* a few columns: zeros, then each centroid's row into its column (km_fill_ct's values) */
    const float f = km->neg2c ? -2.0f : 1.0f;
    memset(km->ct2, 0, d * cp * sizeof *km->ct2);
    for (size_t m = 0; m < nc; m++) {
      const float *c = km->cent + (size_t)km->idx[m] * d;
      for (size_t i = 0; i < d; i++) km->ct2[i * cp + m] = f * c[i];
    }
    return;
  }
#if KVP__HAVE_AVX2
  if (kvp__codec_isa() >= KVP__ISA_AVX512) {
    km_gather_cols_avx512(km, nc, cp);
    return;
  }
#endif
  for (size_t i = 0; i < d; i++) {
    const float *src = km->ct + i * kp;
    float *dst = km->ct2 + i * cp;
    for (size_t m = 0; m < nc; m++) dst[m] = src[km->idx[m]];
    for (size_t m = nc; m < cp; m++) dst[m] = 0.0f;
  }
}

#if KVP__HAVE_AVX2
/* km_cluster's candidates with AVX-512: the j < k with j == a or !(sa[j] >
 * tf) (a NaN score included), ascending, into idx; returns how many, or
 * stops at some count above k / 2 (the caller then scores against all). */
__attribute__((target("avx2,avx512f"))) static uint32_t km_cands_avx512(const float *sa, uint32_t k, uint32_t a,
                                                                      float tf, uint32_t *idx) {
  const __m512 t = _mm512_set1_ps(tf);
  const __m512i av = _mm512_set1_epi32((int)a), step = _mm512_set1_epi32(16);
  __m512i j = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  uint32_t nc = 0;
  for (uint32_t j0 = 0; j0 < k; j0 += 16, j = _mm512_add_epi32(j, step)) {
    __mmask16 in = (__mmask16)(k - j0 >= 16 ? 0xFFFFu : (1u << (k - j0)) - 1u);
    __m512 v = _mm512_maskz_loadu_ps(in, sa + j0);
    __mmask16 keep = _mm512_mask_cmp_ps_mask(in, v, t, _CMP_NGT_UQ) | _mm512_mask_cmpeq_epi32_mask(in, j, av);
    _mm512_mask_compressstoreu_epi32(idx + nc, keep, j);
    nc += (uint32_t)__builtin_popcount(keep);
    if (2 * nc > k) break;
  }
  return nc;
}
#endif

/* The rows rows[0..nr) of reference centroid a against the centroids that
 * can win (see above). Returns 0, scoring nothing, when those are more
 * than half of k: the caller scores the rows against all. */
static int km_cluster(kvp__km *km, uint32_t a, const float *x, const uint32_t *rows, uint32_t nr, int fresh,
                      uint32_t *changed) {
  uint32_t k = km->k, nc = 0;
  size_t kp = km->kp;
  double u = 0.0, xm = 0.0;
  for (uint32_t r = 0; r < nr; r++) {
    double ur = km->ub[rows[r]];
    if (!(ur < INFINITY)) return 0; /* (NaN too) */
    u = ur > u ? ur : u;
    xm = km->xn[rows[r]] > xm ? km->xn[rows[r]] : xm;
  }
  double e = km_err(km, xm), ec = km_err(km, km->m); /* ec: the scores of ccs (rows of norm <= M) */
  double thr = (u + sqrt(u * u + 2.0 * e)) * (1.0 + 4 * KM_REL), thr2 = thr * thr * (1.0 + 2 * KM_REL);
  /* ||c_a - c_j||^2 >= ccs[a][j] + cnd[a] - ec, so j cannot win when
   * ccs[a][j] > thr2 - cnd[a] + ec: that bound, rounded up to f32 */
  double tau = thr2 - km->cnd[a] + ec;
  tau += 0x1p-50 * (thr2 + km->cnd[a] + ec) + 0x1p-140;
  float tf = (float)(tau + fabs(tau) * 0x1p-22);
  const float *sa = km->ccs + (size_t)a * kp;
#if KVP__HAVE_AVX2
  if (kvp__codec_isa() >= KVP__ISA_AVX512) nc = km_cands_avx512(sa, k, a, tf, km->idx);
  else
#endif
    for (uint32_t j = 0; j < k; j++)
      if (j == a || !(sa[j] > tf)) km->idx[nc++] = j;
  if (2 * nc > k) return 0;
  if (nc == 1) { /* only a can win: the labels stay, ub (moved) still holds */
    if (fresh) *changed += nr;
    return 1;
  }
  size_t cp = (nc + KVP__KM_LANES - 1) / KVP__KM_LANES * KVP__KM_LANES;
  km_gather_cols(km, nc, cp);
  km_cols cc = {km->ct2, km->cn2, cp};
  *changed += km_label_rows(km, &cc, km->idx, nc, x, rows, nr, fresh);
  return 1;
}

uint32_t kvp__km_assign(kvp__km *km, const float *x, int fresh) {
  uint32_t changed = 0, nfull = 0, k = km->k, n = km->n;
  km_prepare(km);
  km_cols all = {km->ct, km->cn, km->kp};
  int prune = km->bx == x && km->prune && km_moves(km);
  if (km->bx != x) km_norms(km, x), km->bx = x;
  km_fill_ct(km);
  if (prune) {
    memset(km->start, 0, (k + 1) * sizeof *km->start); /* rows by reference centroid */
    for (uint32_t t = 0; t < n; t++) {
      km->ub[t] = (km->ub[t] + km->mv[km->label[t]]) * (1.0 + KM_REL);
      km->start[km->label[t] + 1]++;
    }
    for (uint32_t j = 0; j < k; j++) km->start[j + 1] += km->start[j], km->pos[j] = km->start[j];
    for (uint32_t t = 0; t < n; t++) km->act[km->pos[km->label[t]]++] = t;
    km_center_scores(km, &all);
    for (uint32_t a = 0; a < k; a++) {
      uint32_t *rows = km->act + km->start[a], nr = km->start[a + 1] - km->start[a];
      if (nr && !km_cluster(km, a, x, rows, nr, fresh, &changed))
        for (uint32_t r = 0; r < nr; r++) km->full[nfull++] = rows[r];
    }
  } else {
    for (uint32_t t = 0; t < n; t++) km->full[nfull++] = t;
  }
  changed += km_label_rows(km, &all, NULL, k, x, km->full, nfull, fresh);
  memcpy(km->cold, km->cent, (size_t)k * km->d * sizeof *km->cold);
  return changed;
}

/* ---- update and Lloyd's loop ---------------------------------------------------- */

#if KVP__HAVE_AVX2
/* The sums of km_update with AVX-512: eight elements a step, each sum
 * still taking its rows in order t = 0..n-1, so the same doubles. */
__attribute__((target("avx2,avx512f"))) static void km_sums_avx512(kvp__km *km, const float *x) {
  uint32_t d = km->d;
  for (uint32_t t = 0; t < km->n; t++) {
    double *s = km->sum + (size_t)km->label[t] * d;
    const float *xr = x + (size_t)t * d;
    for (uint32_t i = 0; i < d; i += 8)
      _mm512_storeu_pd(s + i, _mm512_add_pd(_mm512_loadu_pd(s + i), _mm512_cvtps_pd(_mm256_loadu_ps(xr + i))));
  }
}
#endif

/* Each centroid to the mean of its rows; an empty cluster keeps its own. */
static void km_update(kvp__km *km, const float *x) {
  uint32_t d = km->d;
  memset(km->sum, 0, (size_t)km->k * d * sizeof *km->sum);
  memset(km->count, 0, km->k * sizeof *km->count);
  for (uint32_t t = 0; t < km->n; t++) km->count[km->label[t]]++;
#if KVP__HAVE_AVX2
  if (kvp__codec_isa() >= KVP__ISA_AVX512) km_sums_avx512(km, x);
  else
#endif
    for (uint32_t t = 0; t < km->n; t++) {
      double *s = km->sum + (size_t)km->label[t] * d;
      const float *xr = x + (size_t)t * d;
      for (uint32_t i = 0; i < d; i += 8)
        for (uint32_t e = 0; e < 8; e++) s[i + e] += (double)xr[i + e];
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

/* ---- k-means++ distances: rows in blocks of 16, blocks a seed cannot reach skipped ---- */

/* The rows live in km->xt block by block: position p = 16 b + l holds row
 * perm[p] (n past the last row: padding), element i at xt[(b d + i) 16 + l],
 * so a block's d x 16 values are contiguous and a distance sums i = 0..d-1
 * in order in its lane. km_seed_layout orders the positions by label, so
 * the rows of one seed's neighbourhood share blocks. */
#define KM_BLK 16u

/* The threshold of a row for skipping a seed: with g = (d + 3) 2^-24 and
 * wb = (w + 2^-120)(1 + 2g) >= ||x - c_label||^2 (w is the f32 sum of d
 * squares, all >= 0, see km_seed_bounds), a seed c with ||c - c_label||^2
 * >= 4 wb (1 + 5g) is at least sqrt(wb (1 + 4g)) from x (the triangle
 * inequality), so its computed distance, at least ||x - c||^2 (1 - 2g) -
 * 2^-120, is >= w: min(w, it) keeps w and the label. Rounded up to f32
 * (a NaN w gives NaN: never skipped). */
static inline float km_seed_thr(const kvp__km *km, float w) {
  double g = (km->d + 3) * 0x1p-24, wb = ((double)w + 0x1p-120) * (1.0 + 2.0 * g);
  return (float)(4.0 * wb * (1.0 + 5.0 * g) * (1.0 + 0x1p-22));
}


#if KVP__HAVE_AVX2
/* km_seed_layout's transposed copy with AVX-512: per block and channel,
 * one gather of its 16 rows' element (padding rows, perm = n: zero).
 * Needs n d < 2^31 (32-bit element offsets). */
__attribute__((target("avx2,avx512f"))) static void km_layout_avx512(kvp__km *km, const float *x, uint32_t np) {
  uint32_t n = km->n, d = km->d;
  const __m512i nv = _mm512_set1_epi32((int)n), dv = _mm512_set1_epi32((int)d);
  for (uint32_t b = 0; b < np / KM_BLK; b++) {
    __m512i pr = _mm512_loadu_si512(km->perm + (size_t)b * KM_BLK);
    __mmask16 in = _mm512_cmplt_epu32_mask(pr, nv);
    __m512i off = _mm512_mullo_epi32(_mm512_maskz_mov_epi32(in, pr), dv);
    float *dst = km->xt + (size_t)b * d * KM_BLK;
    for (uint32_t i = 0; i < d; i++)
      _mm512_storeu_ps(dst + (size_t)i * KM_BLK, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), in, off, x + i, 4));
  }
}
#endif

static void km_seed_layout(kvp__km *km, const float *x, int by_label) {
  uint32_t n = km->n, d = km->d, np = km->nblk * KM_BLK;
  if (by_label) { /* counting sort by label; stable, so ties keep row order */
    uint32_t cnt[KVP__KM_MAX_K + 1] = {0};
    for (uint32_t t = 0; t < n; t++) cnt[km->label[t] + 1]++;
    for (uint32_t j = 0; j < KVP__KM_MAX_K; j++) cnt[j + 1] += cnt[j];
    for (uint32_t t = 0; t < n; t++) km->perm[cnt[km->label[t]]++] = t;
  } else {
    for (uint32_t t = 0; t < n; t++) km->perm[t] = t;
  }
  for (uint32_t p = n; p < np; p++) km->perm[p] = n;
  for (uint32_t p = 0; p < np; p++) { /* padding: label 0, threshold -inf: always skippable */
    km->labp[p] = km->perm[p] < n ? km->label[km->perm[p]] : 0;
    km->wtp[p] = km->perm[p] < n && by_label ? km_seed_thr(km, km->w[km->perm[p]]) : -INFINITY;
    km->wp[p] = km->perm[p] < n && by_label ? km->w[km->perm[p]] : -INFINITY;
  }
#if KVP__HAVE_AVX2
  if (kvp__codec_isa() >= KVP__ISA_AVX512 && (uint64_t)n * d < (1ull << 31)) {
    km_layout_avx512(km, x, np);
    return;
  }
#endif
  for (uint32_t p = 0; p < np; p++) {
    float *dst = km->xt + (size_t)(p / KM_BLK) * d * KM_BLK + p % KM_BLK;
    const float *src = x + (size_t)km->perm[p] * d;
    for (uint32_t i = 0; i < d; i++) dst[(size_t)i * KM_BLK] = km->perm[p] < n ? src[i] : 0.0f;
  }
}

/* acc[16 b + l] = ||row - c||^2 of block b = blk[q], q < nb; plain C whose
 * fixed 16-lane loop gcc vectorizes, every sum i = 0..d-1 in order. */
static void km_dist_blocks(const kvp__km *km, const float *c, const uint32_t *blk, uint32_t nb) {
  size_t d = km->d;
  for (uint32_t q = 0; q < nb; q++) {
    const float *restrict xb = km->xt + (size_t)blk[q] * d * KM_BLK;
    float s[KM_BLK] = {0};
    for (size_t i = 0; i < d; i++, xb += KM_BLK)
      for (size_t l = 0; l < KM_BLK; l++) {
        float e = xb[l] - c[i];
        s[l] += e * e;
      }
    memcpy(km->acc + (size_t)blk[q] * KM_BLK, s, sizeof s);
  }
}

#if KVP__HAVE_AVX2
/* km_dist_blocks with AVX2, two blocks at a time (four accumulators): the
 * same operations per sum in the same order, so the same bits. */
__attribute__((target("avx2"))) static void km_dist_blocks_avx2(const kvp__km *km, const float *c, const uint32_t *blk,
                                                               uint32_t nb) {
  size_t d = km->d;
  uint32_t q = 0;
  for (; q + 2 <= nb; q += 2) {
    const float *x0 = km->xt + (size_t)blk[q] * d * KM_BLK, *x1 = km->xt + (size_t)blk[q + 1] * d * KM_BLK;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i < d; i++, x0 += KM_BLK, x1 += KM_BLK) {
      __m256 ci = _mm256_broadcast_ss(c + i);
      __m256 e0 = _mm256_sub_ps(_mm256_loadu_ps(x0), ci), e1 = _mm256_sub_ps(_mm256_loadu_ps(x0 + 8), ci);
      __m256 e2 = _mm256_sub_ps(_mm256_loadu_ps(x1), ci), e3 = _mm256_sub_ps(_mm256_loadu_ps(x1 + 8), ci);
      s0 = _mm256_add_ps(s0, _mm256_mul_ps(e0, e0)), s1 = _mm256_add_ps(s1, _mm256_mul_ps(e1, e1));
      s2 = _mm256_add_ps(s2, _mm256_mul_ps(e2, e2)), s3 = _mm256_add_ps(s3, _mm256_mul_ps(e3, e3));
    }
    float *a0 = km->acc + (size_t)blk[q] * KM_BLK, *a1 = km->acc + (size_t)blk[q + 1] * KM_BLK;
    _mm256_storeu_ps(a0, s0), _mm256_storeu_ps(a0 + 8, s1), _mm256_storeu_ps(a1, s2), _mm256_storeu_ps(a1 + 8, s3);
  }
  km_dist_blocks(km, c, blk + q, nb - q);
}

/* km_dist_blocks with AVX-512, four blocks at a time. */
__attribute__((target("avx2,avx512f"))) static void km_dist_blocks_avx512(const kvp__km *km, const float *c,
                                                                          const uint32_t *blk, uint32_t nb) {
  size_t d = km->d;
  uint32_t q = 0;
  for (; q + 4 <= nb; q += 4) {
    const float *x0 = km->xt + (size_t)blk[q] * d * KM_BLK, *x1 = km->xt + (size_t)blk[q + 1] * d * KM_BLK;
    const float *x2 = km->xt + (size_t)blk[q + 2] * d * KM_BLK, *x3 = km->xt + (size_t)blk[q + 3] * d * KM_BLK;
    __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (size_t i = 0; i < d; i++) {
      __m512 ci = _mm512_set1_ps(c[i]);
      size_t o = i * KM_BLK;
      __m512 e0 = _mm512_sub_ps(_mm512_loadu_ps(x0 + o), ci), e1 = _mm512_sub_ps(_mm512_loadu_ps(x1 + o), ci);
      __m512 e2 = _mm512_sub_ps(_mm512_loadu_ps(x2 + o), ci), e3 = _mm512_sub_ps(_mm512_loadu_ps(x3 + o), ci);
      s0 = _mm512_add_ps(s0, _mm512_mul_ps(e0, e0)), s1 = _mm512_add_ps(s1, _mm512_mul_ps(e1, e1));
      s2 = _mm512_add_ps(s2, _mm512_mul_ps(e2, e2)), s3 = _mm512_add_ps(s3, _mm512_mul_ps(e3, e3));
    }
    _mm512_storeu_ps(km->acc + (size_t)blk[q] * KM_BLK, s0), _mm512_storeu_ps(km->acc + (size_t)blk[q + 1] * KM_BLK, s1);
    _mm512_storeu_ps(km->acc + (size_t)blk[q + 2] * KM_BLK, s2), _mm512_storeu_ps(km->acc + (size_t)blk[q + 3] * KM_BLK, s3);
  }
  km_dist_blocks(km, c, blk + q, nb - q);
}
#endif

/* ccl[a] <= ||c_j - c_a||^2 for every seed a < j: f32 sums of squares
 * (relative error under 2 (d + 4) 2^-24 in any order), rounded down. */
#if KVP__HAVE_AVX2
/* The f32 sums of km_seed_ccl with AVX-512, sixteen terms a step (d % 8 ==
 * 0: the last step may take eight). */
__attribute__((target("avx2,avx512f"))) static void km_seed_ccl_avx512(kvp__km *km, uint32_t j, float *sum) {
  uint32_t d = km->d;
  const float *c = km->cent + (size_t)j * d;
  for (uint32_t a = 0; a < j; a++) {
    const float *ca = km->cent + (size_t)a * d;
    __m512 acc = _mm512_setzero_ps();
    for (uint32_t i = 0; i < d; i += 16) {
      __mmask16 m = d - i >= 16 ? 0xFFFF : 0xFF;
      __m512 e = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, c + i), _mm512_maskz_loadu_ps(m, ca + i));
      acc = _mm512_add_ps(acc, _mm512_mul_ps(e, e));
    }
    sum[a] = _mm512_reduce_add_ps(acc);
  }
}

/* The same with AVX2, eight terms a step. */
__attribute__((target("avx2"))) static void km_seed_ccl_avx2(kvp__km *km, uint32_t j, float *sum) {
  uint32_t d = km->d;
  const float *c = km->cent + (size_t)j * d;
  for (uint32_t a = 0; a < j; a++) {
    const float *ca = km->cent + (size_t)a * d;
    __m256 acc = _mm256_setzero_ps();
    for (uint32_t i = 0; i < d; i += 8) {
      __m256 e = _mm256_sub_ps(_mm256_loadu_ps(c + i), _mm256_loadu_ps(ca + i));
      acc = _mm256_add_ps(acc, _mm256_mul_ps(e, e));
    }
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    sum[a] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  }
}
#endif

static void km_seed_ccl(kvp__km *km, uint32_t j) {
  uint32_t d = km->d;
  const float *c = km->cent + (size_t)j * d;
  double lo = 1.0 - 2.0 * (d + 4) * 0x1p-24;
#if KVP__HAVE_AVX2
  int isa = kvp__codec_isa();
  if (isa >= KVP__ISA_AVX2) {
    if (isa >= KVP__ISA_AVX512) km_seed_ccl_avx512(km, j, km->ccl);
    else km_seed_ccl_avx2(km, j, km->ccl);
    for (uint32_t a = 0; a < j; a++) km->ccl[a] = (float)(((double)km->ccl[a] * lo - 0x1p-120) * (1.0 - 0x1p-22));
    return;
  }
#endif
  for (uint32_t a = 0; a < j; a++) {
    const float *ca = km->cent + (size_t)a * d;
    float s[8] = {0};
    for (uint32_t i = 0; i < d; i += 8)
      for (uint32_t l = 0; l < 8; l++) {
        float e = c[i + l] - ca[i + l];
        s[l] += e * e;
      }
    double sum = ((double)s[0] + s[1] + s[2] + s[3]) + ((double)s[4] + s[5] + s[6] + s[7]);
    km->ccl[a] = (float)((sum * lo - 0x1p-120) * (1.0 - 0x1p-22));
  }
}

#if KVP__HAVE_AVX2
/* The blocks with a row the newest seed can move (km_near), sixteen rows'
 * tests a step. Returns how many, listed in km->blk. */
__attribute__((target("avx2,avx512f"))) static uint32_t km_scan_avx512(kvp__km *km) {
  uint32_t nb = 0;
  for (uint32_t b = 0; b < km->nblk; b++) {
    __m512i lab = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(km->labp + (size_t)b * KM_BLK)));
    __m512 cl = _mm512_i32gather_ps(lab, km->ccl, 4);
    if (_mm512_cmp_ps_mask(cl, _mm512_loadu_ps(km->wtp + (size_t)b * KM_BLK), _CMP_GT_OQ) != 0xFFFF) km->blk[nb++] = b;
  }
  return nb;
}
#endif

#if KVP__HAVE_AVX2
/* km_near's update of the summed blocks with AVX-512: acc < w compared
 * sixteen positions at a time against wp (w by position; -inf in the
 * padding, so never taken), the rows it holds for updated one by one. */
__attribute__((target("avx2,avx512f"))) static void km_near_update_avx512(kvp__km *km, uint32_t j, uint32_t nb) {
  for (uint32_t q = 0; q < nb; q++) {
    size_t p0 = (size_t)km->blk[q] * KM_BLK;
    __m512 a = _mm512_loadu_ps(km->acc + p0);
    unsigned m = _mm512_cmp_ps_mask(a, _mm512_loadu_ps(km->wp + p0), _CMP_LT_OQ);
    for (; m; m &= m - 1) {
      size_t p = p0 + (size_t)__builtin_ctz(m);
      uint32_t t = km->perm[p];
      float v = km->acc[p];
      km->w[t] = km->wp[p] = v, km->label[t] = km->labp[p] = (uint8_t)j, km->wtp[p] = km_seed_thr(km, v);
    }
  }
}
#endif

/* w[t] = min(w[t], ||x_t - cent[j]||^2) for every row (w[t] = it when
 * init), label[t] = the seed it came from. With pruning, only blocks with
 * a row the seed can move (see km_seed_thr) are summed; the others would
 * keep every w and label. */
static void km_near(kvp__km *km, uint32_t j, int init) {
  uint32_t n = km->n, nb = 0;
  const float *c = km->cent + (size_t)j * km->d;
  int prune = !init && km->prune;
  if (prune) km_seed_ccl(km, j);
  if (!prune) {
    for (uint32_t b = 0; b < km->nblk; b++) km->blk[nb++] = b;
  } else {
#if KVP__HAVE_AVX2
    if (kvp__codec_isa() >= KVP__ISA_AVX512) nb = km_scan_avx512(km);
    else
#endif
      for (uint32_t b = 0; b < km->nblk; b++) {
        int act = 0;
        for (uint32_t p = b * KM_BLK; p < (b + 1) * KM_BLK && !act; p++) act = !(km->ccl[km->labp[p]] > km->wtp[p]);
        if (act) km->blk[nb++] = b;
      }
  }
#if KVP__HAVE_AVX2
  int isa = kvp__codec_isa();
  if (isa >= KVP__ISA_AVX512) km_dist_blocks_avx512(km, c, km->blk, nb);
  else if (isa >= KVP__ISA_AVX2) km_dist_blocks_avx2(km, c, km->blk, nb);
  else
#endif
    km_dist_blocks(km, c, km->blk, nb);
  km->nseed += nb;
#if KVP__HAVE_AVX2
  if (!init && isa >= KVP__ISA_AVX512) {
    km_near_update_avx512(km, j, nb);
    return;
  }
#endif
  for (uint32_t q = 0; q < nb; q++)
    for (uint32_t p = km->blk[q] * KM_BLK; p < (km->blk[q] + 1) * KM_BLK; p++) {
      uint32_t t = km->perm[p];
      float a = km->acc[p];
      if (t < n && (init || a < km->w[t]))
        km->w[t] = km->wp[p] = a, km->label[t] = km->labp[p] = (uint8_t)j, km->wtp[p] = km_seed_thr(km, a);
    }
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
#if KVP__HAVE_AVX2
/* km_draw with AVX-512 (DQ for the conversion to integers): the same
 * weights, summed exactly in any order, and the same row: blocks of eight
 * whose sum keeps the prefix at or under r are passed whole. */
__attribute__((target("avx2,avx512f,avx512dq"))) static uint32_t km_draw_avx512(const kvp__km *km, uint64_t *s) {
  uint32_t n = km->n, n16 = n / 16 * 16, n8 = n / 8 * 8, t;
  const float *w = km->w;
  __m512 mx = _mm512_setzero_ps();
  for (t = 0; t < n16; t += 16) mx = _mm512_max_ps(_mm512_loadu_ps(w + t), mx); /* a NaN w keeps mx, as the scan */
  float wmax = _mm512_reduce_max_ps(mx);
  for (; t < n; t++) wmax = w[t] > wmax ? w[t] : wmax;
  if (!(wmax > 0.0f)) return n;
  if (!isfinite(wmax)) wmax = FLT_MAX;
  int e;
  frexp((double)wmax, &e);
  double scale = ldexp(1.0, 32 - e);
  __m512d wm = _mm512_set1_pd((double)wmax), sc = _mm512_set1_pd(scale);
#define KM_WQ8(t) _mm512_cvttpd_epu64(_mm512_mul_pd(_mm512_min_pd(_mm512_cvtps_pd(_mm256_loadu_ps(w + (t))), wm), sc))
  __m512i tot = _mm512_setzero_si512();
  for (t = 0; t < n8; t += 8) tot = _mm512_add_epi64(tot, KM_WQ8(t));
  uint64_t total = (uint64_t)_mm512_reduce_add_epi64(tot);
  for (t = n8; t < n; t++) total += km_wq_at(w[t], wmax, scale);
  uint64_t u = km_rand(s) >> 11;
  uint64_t r = (uint64_t)(((unsigned __int128)u * total) >> 53); /* < total */
  uint64_t cum = 0;
  for (t = 0; t < n8; t += 8) {
    uint64_t b = (uint64_t)_mm512_reduce_add_epi64(KM_WQ8(t));
    if (cum + b > r) break;
    cum += b;
  }
#undef KM_WQ8
  for (; t < n; t++) {
    cum += km_wq_at(w[t], wmax, scale);
    if (cum > r) return t;
  }
  return n - 1; /* not reached: r < total */
}
#endif

static uint32_t km_draw(const kvp__km *km, uint64_t *s) {
#if KVP__HAVE_AVX2
  if (kvp__codec_isa() >= KVP__ISA_AVX512) return km_draw_avx512(km, s);
#endif
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

/* After k-means++, every row's nearest seed is its reference centroid
 * (label) and w bounds the distance: w is the f32 sum of d squared
 * differences, all terms >= 0, so ||x - c||^2 <= (w + 2^-120) (1 + 2 (d + 3)
 * 2^-24) (the roundings of a difference, a square and the sum, twice over,
 * and every underflow). */
static void km_seed_bounds(kvp__km *km, const float *x) {
  double f = 1.0 + 2.0 * (km->d + 3) * 0x1p-24;
  km_norms(km, x);
  for (uint32_t t = 0; t < km->n; t++) km->ub[t] = sqrt(((double)km->w[t] + 0x1p-120) * f) * (1.0 + KM_REL);
  memcpy(km->cold, km->cent, (size_t)km->k * km->d * sizeof *km->cold);
  km->bx = x;
}

void kvp__km_seed(kvp__km *km, const float *x, uint32_t nwarm, uint64_t seed) {
  uint32_t d = km->d, have = nwarm;
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  km->bx = NULL; /* new centroids: the bounds are gone */
  if (have >= km->k) return;
  if (have == 0) {
    memcpy(km->cent, x + (size_t)(km_rand(&s) % km->n) * d, d * sizeof *x);
    have = 1;
  }
  km_seed_layout(km, x, 0);
  for (uint32_t j = 0; j < have; j++) km_near(km, j, j == 0);
  for (; have < km->k; have++) {
    uint32_t t = km_draw(km, &s);
    if (t == km->n) break;
    memcpy(km->cent + (size_t)have * d, x + (size_t)t * d, d * sizeof *x);
    if (km->prune && have == 64) km_seed_layout(km, x, 1); /* neighbourhoods into blocks */
    km_near(km, have, 0);
  }
  for (; have < km->k; have++) memcpy(km->cent + (size_t)have * d, km->cent, d * sizeof *x);
  km_seed_bounds(km, x);
}
