/*
 * kernels/common.cuh - what every codec kernel shares: elements of any
 * kvp_dtype in and out, warp reductions, status reporting, and the
 * contract of a codec's device functions.
 *
 * Contract (each kernels/<codec>.cuh): one CTA of KVP__KERN_THREADS
 * threads runs one job (one block of one head, one side):
 *
 *   __device__ void <codec>_encode(const kvp__kparams &p, const kvp_codec_dev_job &j,
 *                                  uint32_t job, unsigned long long *status);
 *     rows [j.t0, j.t0 + j.m) from j.src into j.pages, and every byte the
 *     host encode writes for a block of j.n = j.t0 + j.m rows; reports
 *     non-finite input (KVP_DEV_BAD_NONFINITE) and out-of-format values
 *     (KVP_DEV_BAD_RANGE) through report().
 *   __device__ void <codec>_decode(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t out);
 *     rows [j.t0, j.t0 + j.m) of the block into j.dst (out dtype, rows
 *     j.stride_bytes apart), bit for bit as the host decode.
 *
 * Encode runs with KVP__KERN_THREADS threads and may use __syncthreads
 * (every thread of the CTA calls it) and static shared memory. Decode runs
 * with blockDim.x threads (kDecodeThreads), a multiple of 32, without
 * barriers.
 */
#ifndef KVP_KERNELS_COMMON_CUH
#define KVP_KERNELS_COMMON_CUH

#include "kernels.h"
#include "numeric.cuh"

namespace kvpk {

constexpr uint32_t kThreads = KVP__KERN_THREADS; /* encode CTAs */
constexpr uint32_t kWarps = KVP__KERN_THREADS / 32;
/* Decode CTAs are smaller: decode is row-parallel (no barrier), and a
 * 16-token block is little work, so more blocks in flight per SM hide the
 * latency of loading each job. Decode functions use blockDim.x. */
constexpr uint32_t kDecodeThreads = 128;

/* dtype codes (kvp_dtype) */
constexpr uint32_t kF32 = KVP_DTYPE_F32, kBF16 = KVP_DTYPE_BF16, kF16 = KVP_DTYPE_F16;

KVP_D uint32_t dtype_bytes(uint32_t dt) { return dt == kF32 ? 4u : 2u; }

/* Element i of a row of dt, as f32 (exact: every dtype widens exactly). */
KVP_D float load_elem(const void *row, uint32_t dt, uint32_t i) {
  if (dt == kF32) return ((const float *)row)[i];
  uint32_t h = ((const uint16_t *)row)[i];
  return dt == kBF16 ? bf16_to_f32(h) : f16_to_f32(h);
}

/* Element i of a row of dt = x rounded as the host's row stores round. */
KVP_D void store_elem(void *row, uint32_t dt, uint32_t i, float x) {
  if (dt == kF32) ((float *)row)[i] = x;
  else ((uint16_t *)row)[i] = (uint16_t)(dt == kBF16 ? bf16_from_f32(x) : f16_from_f32(x));
}

/* Channels [c0, c0 + 8) of a row of out dtype: one 16-byte store (2-byte
 * dtypes) or two (f32) where vec (row and c0 16-byte aligned), else
 * element by element; rounded as store_elem rounds. */
KVP_D void store_octet(void *row, uint32_t out, uint32_t c0, const float (&y)[8], bool vec) {
  if (vec && out != kF32) {
    bool b = out == kBF16;
    *(uint4 *)((char *)row + 2 * (size_t)c0) = make_uint4(half2_from_f32(b, y[0], y[1]), half2_from_f32(b, y[2], y[3]),
                                                          half2_from_f32(b, y[4], y[5]), half2_from_f32(b, y[6], y[7]));
  } else if (vec) {
    float4 *d4 = (float4 *)((char *)row + 4 * (size_t)c0);
    d4[0] = make_float4(y[0], y[1], y[2], y[3]), d4[1] = make_float4(y[4], y[5], y[6], y[7]);
  } else {
    for (uint32_t i = 0; i < 8; i++) store_elem(row, out, c0 + i, y[i]);
  }
}

KVP_D void report(unsigned long long *status, uint32_t kind, uint32_t job, uint32_t elem) {
  atomicMin(status, (unsigned long long)kind << 60 | (unsigned long long)job << 32 | elem);
}

/* x must be finite; else report (kind NONFINITE) element row * D + i. */
KVP_D void check_finite(float x, unsigned long long *status, uint32_t job, uint32_t row, uint32_t D, uint32_t i) {
  if (!finite(x)) report(status, KVP_DEV_BAD_NONFINITE, job, row * D + i);
}

KVP_D float warp_max(float v) {
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}
KVP_D uint32_t warp_max_u32(uint32_t v) {
  for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}
KVP_D uint32_t warp_min_u32(uint32_t v) {
  for (int o = 16; o; o >>= 1) v = min(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
}
KVP_D uint32_t warp_sum_u32(uint32_t v) {
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
}

/* Little-endian stores and loads of page fields (device pages are
 * little-endian like every CUDA device). */
KVP_D void st_u16(void *p, size_t off, uint32_t v) { ((uint8_t *)p)[off] = (uint8_t)v, ((uint8_t *)p)[off + 1] = (uint8_t)(v >> 8); }
KVP_D uint32_t ld_u16(const void *p, size_t off) {
  return (uint32_t)((const uint8_t *)p)[off] | (uint32_t)((const uint8_t *)p)[off + 1] << 8;
}
KVP_D void st_f32(void *p, size_t off, float v) {
  uint32_t u = bits(v);
  for (int b = 0; b < 4; b++) ((uint8_t *)p)[off + b] = (uint8_t)(u >> 8 * b);
}
KVP_D float ld_f32(const void *p, size_t off) {
  const uint8_t *q = (const uint8_t *)p + off;
  return f32((uint32_t)q[0] | (uint32_t)q[1] << 8 | (uint32_t)q[2] << 16 | (uint32_t)q[3] << 24);
}

} // namespace kvpk

#endif /* KVP_KERNELS_COMMON_CUH */
