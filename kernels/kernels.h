/*
 * kernels/kernels.h - what the host side (codecs/, pages/) calls in
 * kernels/: the built-in codecs' device encode and decode over a batch of
 * blocks, and the paged gather. C linkage; no CUDA type crosses it
 * (streams are void *, errors are ints with a message from kvp__kern_errstr).
 *
 * kernels/ knows nothing of pages: it takes device pointers, layouts
 * (kvp__kparams: a codec's parameters, flattened) and job tables
 * (kvp_codec_dev_job, include/kvpool_codec.h).
 *
 *   kernels/numeric.cuh  device numeric core: FP8 E4M3, BF16, FP16, E2M1,
 *                        bit for bit as codecs/numeric.h
 *   kernels/common.cuh   rows of any dtype in and out, status reporting
 *   kernels/<codec>.cuh  one codec's encode and decode of one block
 *   kernels/codec.cu     the batch kernels and their launchers
 *                        and the paged gather (many blocks, K and V, one launch)
 *   kernels/kvquant.cu   KVQuant's batch kernels (its own parameters)
 *   kernels/qvg.cu       QVG's batch kernels (k-means, scratch per job)
 *
 * Built only with CUDA (make CUDA=1 or nvcc found); without it the codecs
 * have no device ops and a CUDA pool cannot be created anyway.
 */
#ifndef KVP_KERNELS_H
#define KVP_KERNELS_H

#include <stdint.h>

#include "kvpool_codec.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The built-in codecs the kernels implement. */
typedef enum kvp__kcodec {
  KVP__K_RAW = 0,
  KVP__K_FP8 = 1,
  KVP__K_INT8 = 2,
  KVP__K_KIVI = 3,
  KVP__K_NVFP4 = 4,
} kvp__kcodec;

/* A binding's parameters as the kernels need them (filled by the codec's
 * file in codecs/ from its instance; unused fields 0). */
typedef struct kvp__kparams {
  uint32_t codec;      /* kvp__kcodec */
  uint32_t head_dim;   /* D, elements per token */
  uint32_t in_dtype;   /* kvp_dtype of the rows encode reads */
  uint32_t store_dtype; /* raw: the stored dtype */
  /* fp8 */
  uint32_t fp8_dynamic;    /* 1: per-token scale in SCALES; 0: static_scale */
  float fp8_static_scale;  /* static: the divisor */
  /* int8 */
  uint32_t int8_clip;      /* 1: percentile clip (pct < 100); 0: absmax */
  uint32_t int8_clip_j;    /* lower order statistic of the clip */
  float int8_clip_frac;    /* interpolation weight of the upper one */
  /* kivi */
  uint32_t kivi_kv;        /* 0: K (per channel over G tokens); 1: V (per token over G channels) */
  uint32_t kivi_bits;      /* 2 or 4 */
  uint32_t kivi_group;     /* G */
  /* nvfp4 */
  uint32_t nvfp4_rule46;   /* 1: rule 4/6 */
  uint32_t nvfp4_ksmooth;  /* 1: per-token mean stored */
} kvp__kparams;

/* Enqueue the encode of njobs blocks on stream (see encode_dev in
 * kvpool_codec.h); status: device word, see KVP_DEV_STATUS_OK. Returns 0
 * or a cudaError_t value (kvp__kern_errstr names it). */
int kvp__kern_encode(const kvp__kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                     uint32_t njobs, uint64_t *status, void *stream);
/* Enqueue the decode of njobs blocks into out dtype. With jobs_dev (a
 * device copy of jobs) one launch reads the jobs there; without, they ride
 * in kernel parameters, KVP__KERN_JOBS_PER_LAUNCH per launch at most. */
int kvp__kern_decode(const kvp__kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                     uint32_t njobs, uint32_t out, void *stream);

/* Paged gather. One record per (block, head): the K and V pages of the
 * block as 64-byte units from the region's base (pages are 64-byte aligned;
 * a region of at most 256 GiB), where its rows go, and the bindings (tag:
 * p[tag] decodes K, p[tag + 2] decodes V). 52 bytes, against 160 for two
 * kvp_codec_dev_job: the table crosses PCIe once per call.
 *   out row r of head h = out + r * row_bytes + h * head_dim * 2 (bf16) */
#define KVP__GJOB_NO_PAGE 0xFFFFFFFFu
typedef struct kvp__gjob {
  uint32_t page[2][4];  /* [K, V][page]: offset / 64, or KVP__GJOB_NO_PAGE */
  uint32_t row;         /* output row of the block's row t0 */
  uint32_t pos0;        /* position of the block's row 0 */
  uint16_t head;        /* KV head */
  uint16_t tag;         /* binding of K (segment * 4 + 0 or 1); V's is tag + 2 */
  uint16_t t0;          /* first row read */
  uint16_t m1;          /* rows read - 1 */
  uint16_t n1;          /* rows the block holds - 1 */
  uint16_t cap1;        /* the block's capacity - 1 */
} kvp__gjob;
#define KVP__KERN_GATHER_PARAMS 512u
/* Decode njobs records of recs_dev (DEVICE memory) with p[0..np) into bf16
 * k_out / v_out. One launch. */
int kvp__kern_gather(const kvp__kparams *p, uint32_t np, const void *region_base, const kvp__gjob *recs_dev,
                     uint32_t njobs, void *k_out, void *v_out, uint64_t row_bytes, uint32_t head_dim, void *stream);

/* Decode attention over pages (kernels/attend.cu). A split: records
 * [rec0, rec0 + nrec) of one (sequence, KV head) bh = b * Hkv + h, run by
 * one CTA; slot: its partial records' index, or KVP__ASPLIT_ONLY when it is
 * bh's only split (it writes the output). bh_split0[bh] .. bh_split0[bh + 1]
 * are bh's splits, in the split table's order. */
#define KVP__ASPLIT_ONLY 0xFFFFFFFFu
typedef struct kvp__asplit {
  uint32_t rec0, nrec, bh, slot;
} kvp__asplit;
#define KVP__KERN_ATTEND_MAX_GROUP 8u /* query heads per KV head */
typedef struct kvp__attend_args {
  kvp__kparams p[4];          /* K codec, K tail, V codec, V tail (gjob tag 0/1 picks) */
  const void *region_base;
  const void *recs;           /* device: kvp__kern_attend_rec_bytes(kind) each */
  const kvp__asplit *splits;  /* device, n_splits */
  const uint32_t *bh_split0;  /* device, batch * n_kv_heads + 1 */
  const void *q;              /* device bf16 [batch][n_q_heads][head_dim] */
  void *out;                  /* device [batch][n_q_heads][head_dim], out_dtype (bf16 or f32) */
  float *part;                /* device, [slots][G][2 + head_dim] */
  float scale;                /* softmax scale */
  uint32_t out_dtype, n_q_heads, n_kv_heads, head_dim, batch, n_splits;
  int reduce;                 /* some bh has several splits */
} kvp__attend_args;
/* head_dim 32, 64, 128 or 256; n_q_heads / n_kv_heads <= 8. Two launches
 * at most (the splits, then the merge when reduce). */
int kvp__kern_attend(const kvp__attend_args *a, void *stream);
/* Load the attention kernels on the current device (lazy module loading
 * would load them at the first launch, possibly on a held stream). */
int kvp__kern_attend_preload(void);
/* The attention kernels differ by the layer's bindings (raw bf16; fp8,
 * int8 or nvfp4 on both sides; raw; any): the one p[4] selects, and how
 * many of each kind's thread blocks fit on one SM of the current device at
 * head_dim (occ[KVP__KERN_ATTEND_KINDS], 0 where head_dim is not one the
 * kernels take). */
#define KVP__KERN_ATTEND_KINDS 9u
uint32_t kvp__kern_attend_kind(const kvp__kparams p[4]);
/* The records of a call's table, by kernel kind: the raw bf16 and the
 * fp8/int8/nvfp4/kivi kernels read compact ones (the fields they use: the
 * table crosses the bus on every call), the others kvp__gjob. */
typedef struct kvp__arec_raw {
  uint32_t page[2];     /* K's and V's row page: offset / 64 */
  uint16_t t0, m1;      /* first row read, rows read - 1 */
  uint32_t pad;
} kvp__arec_raw;
typedef struct kvp__arec_q {
  uint32_t page[2][3];  /* K's and V's first three pages (kvp__gjob's) */
  uint16_t t0, m1, cap1, tag;
} kvp__arec_q;
/* Bytes of kind's records (pages/attend_table.c writes them). */
uint32_t kvp__kern_attend_rec_bytes(uint32_t kind);
int kvp__kern_attend_occupancy(uint32_t head_dim, uint32_t *occ);
/* Whether kind's kernel at head_dim reads its records in coalesced batches
 * (RecStream), so the table may stay in pinned host memory, read over the
 * bus while the kernel runs, instead of being copied before it. */
int kvp__kern_attend_zero_copy(uint32_t kind, uint32_t head_dim);

/* KVQuant (kernels/kvquant.cuh, kernels/kvquant.cu). Its parameters do not
 * fit kvp__kparams (the gather passes 512 of those in a launch's 32 KiB), so
 * it has its own, its own batch kernels, and no in-kernel reader for the
 * gather or attention (the gather calls its decode_dev). The tables are the
 * binding's, in device memory (codecs/kvquant_cuda.c copies them once). */
#define KVP__KVQ_DEV_MAX_DIM 256u /* head_dim the device kernels take: a token in one warp */
typedef struct kvp__kvq_kparams {
  const float *lut;       /* device: [2^b] codebook */
  const float *mid;       /* device: [2^b - 1] midpoints of the codebook */
  const float *off;       /* device: [H][D] per-channel offsets */
  const float *rng;       /* device: [H][D] per-channel half ranges */
  const float *inv;       /* device: [H][D] 1 / rng */
  const double *inv_freq; /* device: [R / 2] theta^(-2i/R) (prerope), else NULL */
  uint32_t head_dim;      /* D, 1..KVP__KVQ_DEV_MAX_DIM */
  uint32_t n_heads;       /* H of the tables */
  uint32_t in_dtype;      /* kvp_dtype of appended rows (and of RAW sink rows) */
  uint32_t kv;            /* 0: K (per channel), 1: V (per token, SCALES page) */
  uint32_t bits;          /* b: 2, 3 or 4 */
  uint32_t k;             /* outliers a token (topk) */
  uint32_t thresh;        /* 1: outlier_mode=threshold */
  uint32_t kmax;          /* most outliers a token (0: no OUTLIERS page) */
  uint32_t cw;            /* bytes of an outlier's channel (1 or 2) */
  uint32_t row_bytes;     /* CODES bytes a token, a multiple of 4 */
  uint32_t sink;          /* positions kept RAW at the stream's start */
  uint32_t prerope;       /* 1: decode rotates keys (RoPE) */
  uint32_t rope_dims;     /* R: leading channels rotated */
} kvp__kvq_kparams;
/* Enqueue rows [t0, t0 + m) of each job into its pages (the host's
 * encode_rows: other rows' bytes untouched) / the decode of rows
 * [t0, t0 + m) into out dtype, as kvp__kern_encode / kvp__kern_decode. */
int kvp__kern_kvq_encode(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                         uint32_t njobs, uint64_t *status, void *stream);
int kvp__kern_kvq_decode(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                         uint32_t njobs, uint32_t out, void *stream);

/* QVG (kernels/qvg.cuh, kernels/qvg.cu): k-means per block, so each job
 * needs scratch (kvp__qvg_ws_bytes at its capacity) from a device
 * workspace the caller owns; jobs run in waves that fit it, in order on the
 * stream. An encode job's dst is the stream's device state (codecs/qvg.c's
 * layout, state_bytes) or NULL: a cold start that keeps none. */
#define KVP__QVG_DEV_MAX_DIM 256u /* head_dim the device kernels take */
typedef struct kvp__qvg_kparams {
  uint32_t head_dim; /* D, a multiple of group, <= KVP__QVG_DEV_MAX_DIM */
  uint32_t in_dtype; /* kvp_dtype of appended rows */
  uint32_t stages;   /* S, 0..8 */
  uint32_t group;    /* g, elements per FP8 scale */
  uint32_t bits;     /* b, 2 or 4 */
  uint32_t k;        /* K, centroids per stage asked for */
  uint32_t iters;    /* most Lloyd updates per stage */
} kvp__qvg_kparams;
/* Scratch bytes of one job of capacity cap (qvg.cuh's carve): the f32
 * centroids twice (row- and channel-major), their norms, a word per row,
 * two per centroid, and the f32 residual (D x cap rounded up to 4). */
static inline uint64_t kvp__qvg_ws_bytes(const kvp__qvg_kparams *p, uint32_t cap) {
  uint64_t kc = p->k < cap ? p->k : cap, kc4 = (kc + 3) & ~(uint64_t)3, cap4 = ((uint64_t)cap + 3) & ~(uint64_t)3;
#define KVP__A16(x) (((x) + 15) & ~(uint64_t)15)
  return KVP__A16(kc * p->head_dim * 4) + KVP__A16(kc4 * p->head_dim * 4) + KVP__A16(kc4 * 4) +
         KVP__A16((uint64_t)cap * 4) + KVP__A16(kc * 8) + KVP__A16(cap4 * p->head_dim * 4);
#undef KVP__A16
}
/* Enqueue the encode of njobs blocks (every job t0 = 0) / the decode of
 * rows [t0, t0 + m) of each, as kvp__kern_encode / kvp__kern_decode; ws:
 * ws_bytes of device scratch, at least kvp__qvg_ws_bytes of the largest
 * job (rounded up to 256) for one job; index: each job's index in the
 * status words (NULL: its place in jobs). Jobs that share a state must not
 * be in one call (they would run at once). */
int kvp__kern_qvg_encode(const kvp__qvg_kparams *p, const kvp_codec_dev_job *jobs, const uint32_t *index,
                         uint32_t njobs, void *ws, uint64_t ws_bytes, uint64_t *status, void *stream);
int kvp__kern_qvg_decode(const kvp__qvg_kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                         uint32_t njobs, uint32_t out, void *stream);

/* "cudaErrorInvalidValue: invalid argument" for a value the calls above
 * returned. */
const char *kvp__kern_errstr(int err);

/* Jobs per launch: the batch rides in the kernel's parameters (CUDA 12.1+
 * allows 32 KiB of them), so no device memory is needed per call. */
#define KVP__KERN_JOBS_PER_LAUNCH 320u
/* Threads of the CTA that runs one job. */
#define KVP__KERN_THREADS 256u

#ifdef __cplusplus
}
#endif
#endif /* KVP_KERNELS_H */
