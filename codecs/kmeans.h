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
 *           and kernels/qvg.cuh draws the same rows in parallel; rows a
 *           new seed cannot come nearer to (the triangle inequality, the
 *           f32 rounding bounded) are not summed
 *   lloyd   assign every row to its nearest centroid, move each centroid
 *           to the mean of its rows (an empty cluster keeps its centroid),
 *           repeat at most iters times; stop early when an assignment
 *           changes no label (the centroids are then a fixed point)
 *   assign  nearest by the expanded distance ||c||^2 - 2 x.c (the constant
 *           ||x||^2 dropped), f32, ties to the lowest index; a row is
 *           scored only against the centroids that bounds kept between
 *           calls leave as possible winners (Elkan's first lemma, the f32
 *           rounding bounded), so the labels are a full assignment's
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
  uint32_t nblk;   /* blocks of 16 rows, ceil(n / 16) */
  float *xt;       /* nblk x d x 16: the rows by block, transposed (k-means++ distances, codecs/kmeans.c) */
  uint32_t *perm;  /* nblk x 16: the row at each block position (n: padding) */
  uint32_t *blk;   /* nblk: the blocks a seed's distances are summed over */
  float *acc;      /* nblk x 16: squared distances to the newest seed, by position */
  float *xb;       /* KM_TILE x d: -2 x of the rows a tile scores */
  /* the candidates of kvp__km_assign (codecs/kmeans.c), valid for rows bx */
  const float *bx;   /* the rows label and ub hold for, NULL: none */
  float *cold;       /* k x d: the centroids when ub was last moved */
  double *mv;        /* k: upper bound on each centroid's move since then */
  double *cnd;       /* k: lower bound on ||c_j||^2 */
  double *ub;        /* n: upper bound on ||x_t - c_label[t]|| */
  double *xn2, *xn;  /* n: upper bounds on ||x_t||^2 and ||x_t|| */
  int xok;           /* every ||x_t||^2 < 2^100 (the bounds' range) */
  int neg2c;         /* ct holds -2 c (xok, and every ||c_j||^2 < 2^100), else c */
  double m2, m;      /* upper bounds on max ||c_j||^2 and max ||c_j|| */
  double eps;        /* 4 (d + 2) 2^-24: the scores' relative error bound */
  uint32_t *act;     /* n: the rows grouped by label */
  uint32_t *full;    /* n: the rows scored against every centroid */
  uint32_t *start;   /* k + 1: rows of label j are act[start[j], start[j + 1]) */
  uint32_t *pos;     /* k: fill positions of the grouping */
  uint32_t *idx;     /* k: one label's candidate centroids, ascending */
  float *ccs;        /* k x kp: the centroids scored as rows */
  float *ct2, *cn2;  /* d x kp, kp: the candidates' columns */
  float *wtp;        /* nblk x 16: by position, k-means++ skips the row for a seed this far (squared) from its label */
  uint8_t *labp;     /* nblk x 16: label by position */
  float *wp;         /* nblk x 16: w by position (-inf in the padding) */
  float *ccl;        /* k: lower bounds on the squared distances of the newest seed to the others */
  int prune;         /* 1 (the default): score only candidates, skip rows seeds cannot move */
  int inplace;       /* 1 (the default): -2 c columns where allowed (neg2c); 0: always the -2 x copy */
  uint64_t nseed;    /* blocks of 16 rows k-means++ summed so far (tests) */
  uint64_t nscored;  /* scores computed so far, padding columns included (tests) */
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
 * changed (every row counts as changed when fresh is set). With fresh 0, x
 * must be the rows (same pointer, same values) of the previous call since
 * kvp__km_seed: bounds kept from it let rows whose label cannot change go
 * unscored, with the labels of a full assignment, bit for bit. */
uint32_t kvp__km_assign(kvp__km *km, const float *x, int fresh);

/* Lloyd's iterations from the current centroids: an assignment, then up
 * to iters (update, assignment) rounds, stopping after a round that
 * changes no label. Returns the updates done (0..iters). The labels are
 * those of the final centroids. */
uint32_t kvp__km_lloyd(kvp__km *km, const float *x, uint32_t iters);

/* Sum over rows of ||x - cent[label]||^2, in double. */
double kvp__km_inertia(const kvp__km *km, const float *x);

#endif /* KVP_CODECS_KMEANS_H */
