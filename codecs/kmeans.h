/*
 * codecs/kmeans.h - Lloyd's k-means over the rows of one block, the
 * clustering behind QVG's semantic-aware smoothing (codecs/qvg.c). It knows
 * nothing of pages or of the pool: rows of f32 in, centroids and one label
 * per row out.
 *
 *   seed    centroids [0, nwarm) are given (a warm start); the others are
 *           chosen by k-means++ with a fixed seed (D^2 sampling driven by
 *           a local xorshift64*), so equal inputs give equal centroids;
 *           the draw weighs rows by integers (each squared distance
 *           scaled by the power of two that puts the largest in
 *           [2^31, 2^32), truncated), so its sums are exact in any order
 *           and kernels/qvg.cuh draws the same rows in parallel
 *   lloyd   assign every row to its nearest centroid, move each centroid
 *           to the mean of its rows (an empty cluster keeps its centroid),
 *           repeat at most iters times; stop early when an assignment
 *           changes no label (the centroids are then a fixed point)
 *   assign  nearest by the expanded distance ||c||^2 - 2 x.c (the constant
 *           ||x||^2 dropped), f32, ties to the lowest index
 *
 * Deterministic: a fixed order of every f32/f64 operation, no rand(), no
 * threads; the device twin (kernels/qvg.cuh) keeps each operation and its
 * order, so it gives the same bits. Scaling every row by 2^k (no underflow or overflow) scales the
 * centroids by 2^k and leaves the labels and the k-means++ picks as they
 * are: each distance scales by 4^k exactly.
 */
#ifndef KVP_CODECS_KMEANS_H
#define KVP_CODECS_KMEANS_H

#include <stddef.h>
#include <stdint.h>

#define KVP__KM_MAX_K 256u /* labels are bytes */
#define KVP__KM_LANES 16u  /* centroid columns scored together; kp is a multiple */

/* One clustering problem: n rows of d elements, k centroids. */
typedef struct kvp__km {
  uint32_t n;      /* rows */
  uint32_t d;      /* elements per row, a multiple of 8 */
  uint32_t k;      /* centroids, 1..min(n, KVP__KM_MAX_K) */
  uint32_t kp;     /* k rounded up to KVP__KM_LANES */
  float *cent;     /* k x d: the centroids, row-major */
  float *ct;       /* d x kp: the centroids transposed (padding columns 0) */
  float *cn;       /* kp: ||c||^2 of each centroid, +inf in the padding */
  double *sum;     /* k x d: sums of the members (update) */
  uint32_t *count; /* k: members of each centroid (update) */
  float *w;        /* n: squared distance to the nearest seed (k-means++) */
  uint8_t *label;  /* n: the centroid of each row */
  float *xt;       /* d x n: the rows transposed (k-means++ distances) */
  float *acc;      /* n: squared distances to the newest seed */
  float *xb;       /* KM_TILE x d: -2 x of the rows a tile scores */
} kvp__km;

/* Allocate the work space. Returns 0, or -1 when out of memory (then
 * nothing is held). Requires 1 <= k <= min(n, 256) and d % 8 == 0. */
int kvp__km_init(kvp__km *km, uint32_t n, uint32_t d, uint32_t k);
void kvp__km_free(kvp__km *km);

/* Choose centroids [nwarm, k) by k-means++ over the rows x (n x d), the
 * first nwarm centroids already set in km->cent. With nwarm = 0 the first
 * centroid is a row picked by the generator. When every row coincides
 * with a centroid chosen so far, the rest copy centroid 0. */
void kvp__km_seed(kvp__km *km, const float *x, uint32_t nwarm, uint64_t seed);

/* Label every row with its nearest centroid; returns how many labels
 * changed (every row counts as changed when fresh is set). */
uint32_t kvp__km_assign(kvp__km *km, const float *x, int fresh);

/* Lloyd's iterations from the current centroids: an assignment, then up
 * to iters (update, assignment) rounds, stopping after a round that
 * changes no label. Returns the updates done (0..iters). The labels are
 * those of the final centroids. */
uint32_t kvp__km_lloyd(kvp__km *km, const float *x, uint32_t iters);

/* Sum over rows of ||x - cent[label]||^2, in double. */
double kvp__km_inertia(const kvp__km *km, const float *x);

#endif /* KVP_CODECS_KMEANS_H */
