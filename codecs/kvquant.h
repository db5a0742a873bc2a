/*
 * codecs/kvquant.h - what the KVQuant codec (codecs/kvquant.c) and its
 * calibration (codecs/kvquant_calib.c) share: the calibration of one
 * (layer, K|V) binding, the synthetic K/V generator, the fitter and the
 * calibration file reader. Nothing of the pool.
 *
 * Calibration of one side of one layer, per head h and channel c:
 *   off[h][c], rng[h][c]   K: the normalization n = (x - off) / rng
 *                          (off, rng = middle and half-width of the
 *                          percentile thresholds [q(f/2), q(1 - f/2)] of the
 *                          channel's samples, f = the outlier fraction);
 *                          V: the same figures rank a token's values for
 *                          the outliers (|x - off| / rng, largest first)
 *   lut[0 .. 2^b)          the layer's non-uniform codebook of the side, in
 *                          the normalized domain [-1, 1], non-decreasing
 */
#ifndef KVP_CODECS_KVQUANT_H
#define KVP_CODECS_KVQUANT_H

#include <stddef.h>
#include <stdint.h>

#define KVP__KVQ_MAX_BITS 4u
#define KVP__KVQ_LUT_MAX (1u << KVP__KVQ_MAX_BITS)

/* One (layer, K|V) binding's calibration. */
typedef struct kvp__kvq_side {
  uint32_t n_heads;              /* H */
  uint32_t head_dim;             /* D */
  uint32_t bits;                 /* b: 2, 3 or 4 */
  float *off;                    /* [H * D] per-channel offset (malloc) */
  float *rng;                    /* [H * D] per-channel half range, > 0 (malloc) */
  float lut[KVP__KVQ_LUT_MAX];   /* [2^b] codebook, non-decreasing, in [-1, 1] */
} kvp__kvq_side;

void kvp__kvq_side_free(kvp__kvq_side *s);

/* Synthetic K or V of (seed, layer, head, kv) at positions pos0 .. pos0+n-1:
 * rows of D floats, dst_stride floats apart: bias + scale z, z about
 * N(0, 1). K has a per-channel bias and one channel in 32 (a phase per
 * head) ten times larger; both sides have heavy tails (one value in 128,
 * about, scaled by 2..5). Counter-based: any position can be regenerated
 * alone. */
/* Indices of the k largest of score[0..D) (ties: the lower channel) into
 * top, ascending by channel: the outliers of a token, for the encoder and
 * the fitter alike. */
void kvp__kvq_top(const float *score, uint32_t D, uint32_t k, uint16_t *top);

void kvp__kvq_synth(uint64_t seed, uint32_t layer, uint32_t head, uint32_t kv, uint32_t pos0, uint32_t n,
                    uint32_t head_dim, float *dst, size_t dst_stride);

/* The fitter of one side of one layer (codecs/kvquant_fit.c). */
typedef struct kvp__kvq_fit {
  uint32_t n_heads, head_dim, bits; /* H, D, b */
  uint32_t kv;                      /* 0 = K (per channel), 1 = V (per token) */
  double fraction;                  /* outlier fraction f */
  float *off, *rng;                 /* [H * D], filled by fit_head */
  float *inv;                       /* [H * D]: 1 / rng */
  uint8_t *done;                    /* [H]: head fitted */
  double *hist;                     /* [KVP__KVQ_BINS + 1][2]: weighted sum and weight per bin of [-1, 1]; the
                                       last one a spare the vector path sends outliers to, never read */
} kvp__kvq_fit;

#define KVP__KVQ_BINS 8192u

/* k = ceil(f * D) outliers per token (f in [0, 0.5)). */
uint32_t kvp__kvq_outliers_k(double fraction, uint32_t head_dim);

int kvp__kvq_fit_init(kvp__kvq_fit *f, uint32_t n_heads, uint32_t head_dim, uint32_t bits, uint32_t kv, double fraction);
void kvp__kvq_fit_free(kvp__kvq_fit *f);
/* Back to no head fitted (what fit_init leaves). */
void kvp__kvq_fit_reset(kvp__kvq_fit *f);
/* Fit head h from n samples (rows of D floats, x_stride floats apart) with
 * optional weights w (same shape and stride, >= 0; NULL = 1): the
 * per-channel figures, and the normalized dense values into the layer's
 * histogram. KVP_EINVAL (message set) for n = 0, a head fitted twice, a
 * non-finite sample or weight; KVP_ENOMEM. On failure f is unchanged. */
int kvp__kvq_fit_head(kvp__kvq_fit *f, uint32_t h, const float *x, const float *w, size_t x_stride, uint32_t n);

/* kvp__kvq_fit_head in stages, for samples made in row chunks (the
 * synthetic fitter takes each chunk while it is in cache):
 *   begin   head h of f will get n rows: the checks of fit_head, the scratch
 *   sample  (when every > 0) the sample: rows 0, every, 2 every, ... of
 *           the n, as rows s_stride floats apart from s: the screen's
 *           thresholds
 *   rows    the next nrows of the n, in order: checked, screened
 *           (KVP_EINVAL names the token)
 *   end     all n rows again, together: the thresholds, then the histogram
 * f changes only at end, which cannot fail. A failed begin or rows leaves
 * nothing to free; abort drops a head begun.
 *
 * The thresholds are the m-th smallest and largest of each channel's n
 * values, m = floor(f/2 (n - 1)) + 1. With few rows (or every = 0), heaps
 * of m over every row find them. Otherwise a sample of every-th rows gives
 * each channel a threshold expected past about 2 m values (the j-th
 * extreme of the sample), the rows keep the values past it, and the answer
 * is selected among those; a channel where that cannot be trusted (fewer
 * than m past the threshold, more than cap, or an answer of zero, whose
 * sign only the heaps' order fixes) runs the heaps over its column. */
#define KVP__KVQ_SAMPLE_EVERY 16u
/* The sample's thresholds come from sorted lists 8 channels a vector (AVX2)
 * where the head dim is a multiple of 8 and hm is at most this; from the
 * heaps elsewhere. Either gives the same thresholds. */
#define KVP__KVQ_SAMPLE_LISTS_MAX 64u
typedef struct kvp__kvq_head {
  kvp__kvq_fit *f;           /* the side */
  uint32_t h, n, seen;       /* head; rows in all; rows taken so far */
  int trusted;               /* set by the caller: every sample is finite (the synthetic generator's), no check */
  uint32_t m;                /* extremes that set a threshold: floor(f/2 (n - 1)) + 1 */
  uint32_t every;            /* sample every-th row; 0: the heaps over every row */
  uint32_t hm, hlen;         /* heap size (m, or j for the sample); values in each heap */
  float *lo, *hi;            /* [D][hm]: max-heap of the hm smallest, min-heap of the hm largest */
  float *lo_root, *hi_root;  /* [D]: lo[c][0], hi[c][0]; after the sample, the screen's thresholds */
  uint32_t cap;              /* candidates the list can hold, both sides (16 spare entries past it) */
  uint32_t ncand;            /* candidates taken (cap + 1: more than cap) */
  float *cand_v;             /* [cap + 16]: values below lo_root or above hi_root, in row order */
  int32_t *cand_c;           /* [cap + 16]: their keys: channel c below lo_root, D + c above hi_root */
  float *sorted;             /* [cap]: the candidates by key */
  uint32_t *cnt;             /* [2 D + 1]: the counting sort's */
  float *replay;             /* [2 m]: one channel's heaps, for a replay */
  float *score, *nrm;        /* [D], [2][D]: a row's outlier scores; two rows' clipped normalized values */
  void *mem;                 /* the scratch's one allocation */
  int32_t *bin;              /* [2][D]: their bins, as byte offsets into hist */
  uint16_t *top;             /* [D]: the row's outlier channels */
} kvp__kvq_head;
int kvp__kvq_head_begin(kvp__kvq_fit *f, uint32_t h, uint32_t n, kvp__kvq_head *hs);
void kvp__kvq_head_sample(kvp__kvq_head *hs, const float *s, size_t s_stride);
int kvp__kvq_head_rows(kvp__kvq_head *hs, const float *x, const float *w, size_t x_stride, uint32_t nrows);
void kvp__kvq_head_end(kvp__kvq_head *hs, const float *x, const float *w, size_t x_stride);
void kvp__kvq_head_abort(kvp__kvq_head *hs);
/* Tests: the sampling stride of heads begun from now on (0: the heaps over
 * every row; default KVP__KVQ_SAMPLE_EVERY). */
void kvp__kvq_fit_set_sampling(uint32_t every);
/* Tests: channels whose thresholds the heaps over every row gave after a
 * sample could not (see above), since the start. */
uint64_t kvp__kvq_fit_replays(void);

/* The codebook: weighted Lloyd (k-means) in one dimension over the
 * histogram, 2^b centroids seeded at the weighted quantiles (i + 1/2) / 2^b;
 * an empty histogram gives the uniform codebook. Every head must be fitted.
 * KVP_EINVAL, KVP_ENOMEM. */
int kvp__kvq_fit_lut(const kvp__kvq_fit *f, float *lut);

/* The uniform codebook of 2^b entries: -1 + 2 i / (2^b - 1). */
void kvp__kvq_uniform_lut(uint32_t bits, float *lut);

/* Fit one binding from the synthetic generator: calib_tokens samples per
 * head at positions 0.. of seed. Fills *out (owned). KVP_ENOMEM. */
int kvp__kvq_fit_synthetic(uint64_t seed, uint32_t layer, uint32_t kv, uint32_t n_heads, uint32_t head_dim,
                           uint32_t bits, double fraction, uint32_t calib_tokens, kvp__kvq_side *out);

/* The checks create makes of a kvquant binding's parameters for geom
 * (every key and value, rope_dims, the outlier count), without the
 * calibration it then fits or loads (tests/fuzz/fuzz_codec_spec.c: a fit
 * costs milliseconds per binding). Status and message as create's. */
struct kvp_codec_geom;
int kvp__kvq_params_check(const char *params, const struct kvp_codec_geom *geom, char *err, size_t errcap,
                          size_t *err_at);

/* Load (layer, kv) from a calibration file for a pool of n_layers x
 * n_heads x head_dim at b bits. KVP_EFORMAT with a message naming the file
 * and the field (magic, version, n_layers, n_kv_heads, head_dim, bits,
 * size, crc32, a layer's off/rng/lut), KVP_ENOENT-like open failures as
 * KVP_EFORMAT too (the file is part of the configuration), KVP_ENOMEM. The
 * message is written into err (errcap bytes). */
int kvp__kvq_load(const char *path, uint32_t layer, uint32_t kv, uint32_t n_layers, uint32_t n_heads,
                  uint32_t head_dim, uint32_t bits, kvp__kvq_side *out, char *err, size_t errcap);

/* Decode rows [t0, t0 + m) of a kvquant block (inst: a kvquant instance)
 * into f32 rows dst_stride floats apart; with_outliers 0 gives the dense
 * part alone, rope 0 skips the rotation of pre-RoPE keys. */
struct kvp_codec_block;
int kvp__kvq_decode_f32(const void *inst, const struct kvp_codec_block *blk, const void *const *pages, uint32_t cap,
                        uint32_t t0, uint32_t m, float *dst, size_t dst_stride, int with_outliers, int rope);

/* ---- the device twin --------------------------------------------------------
 * A binding's tables go to the device once (codecs/kvquant_cuda.c; a pool
 * does it at create, counted in device.control_bytes; a codec used alone,
 * at its first device op). Their image, in order:
 *   inv_freq [R / 2] f64 (prerope only), lut [16] f32, mid [16] f32,
 *   off [H D] f32, rng [H D] f32, inv [H D] f32 */
struct kvp__kvq_dev;
/* Bytes of the image, written into buf when it is not NULL (8-byte aligned). */
size_t kvp__kvq_dev_image(const void *inst, void *buf);
/* The instance's device copy (NULL until made), for kvquant_cuda.c: read
 * and set with atomics (set once, under its lock). */
struct kvp__kvq_dev **kvp__kvq_dev_slot(const void *inst);
uint32_t kvp__kvq_head_dim(const void *inst);
/* Decode transforms rows by position (pre-RoPE keys). */
int kvp__kvq_prerope(const void *inst);
#include "../kernels/kernels.h" /* plain C: the kernels' parameter struct */
/* The kernels' parameters, the tables (the image) at dev_tables. */
void kvp__kvq_kparams_fill(const void *inst, const void *dev_tables, kvp__kvq_kparams *k);
#ifdef KVP_HAVE_CUDA
/* Copy the tables to the current device once: KVP_OK, KVP_ENOTSUP
 * (head_dim over KVP__KVQ_DEV_MAX_DIM), KVP_EDEVICE, KVP_ENOMEM; messages set. */
int kvp__kvq_dev_prepare(const void *inst);
uint64_t kvp__kvq_dev_bytes(const void *inst); /* device bytes the copy holds (0: none) */
void kvp__kvq_dev_release(struct kvp__kvq_dev *d);
int kvp__kvq_encode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                        uint32_t njobs, uint64_t *status, void *stream);
int kvp__kvq_decode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                        uint32_t njobs, kvp_dtype out, void *stream);
#endif

/* CRC-32 (IEEE 802.3, reflected, the zlib one) of n bytes, continuing crc. */
uint32_t kvp__crc32(uint32_t crc, const void *p, size_t n);

#endif /* KVP_CODECS_KVQUANT_H */
