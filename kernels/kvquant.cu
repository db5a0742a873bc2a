/*
 * kernels/kvquant.cu - the batch kernels behind KVQuant's encode_dev and
 * decode_dev (kernels/kvquant.cuh computes one job), and their launchers.
 *
 * Launch: as kernels/codec.cu's: one CTA per job (encode KVP__KERN_THREADS
 * threads, decode kDecodeThreads), the jobs in the kernel's parameters (a
 * __grid_constant__ batch of 8 or KVP__KERN_JOBS_PER_LAUNCH, split into
 * launches in order on the stream) or in a device table the caller staged
 * (one launch). KVQuant keeps its own kernels: its parameters carry device
 * pointers to the binding's tables and do not fit kvp__kparams.
 *
 * Measured on the H100: see kernels/kvquant.cuh.
 */
#include <cuda_runtime.h>
#include <string.h>

#include "common.cuh"
#include "kvquant.cuh"

namespace kvpk {
namespace kvq_ {

static_assert(kTileThreads == kDecodeThreads, "decode CTAs run kvquant_decode_tile");

template <uint32_t N> struct Batch {
  kvp__kvq_kparams p;             /* the binding */
  unsigned long long *status;     /* encode: the status word */
  uint32_t out;                   /* decode: out dtype */
  uint32_t job0;                  /* index of jobs[0] in the caller's batch */
  kvp_codec_dev_job jobs[N];
};

template <uint32_t N> __global__ void __launch_bounds__(kThreads) enc_kernel(const __grid_constant__ Batch<N> b) {
  kvquant_encode(b.p, b.jobs[blockIdx.x], b.job0 + blockIdx.x, b.status);
}

/* Decode: Tile picks kvquant_decode_tile (the launcher checks
 * kvquant_tile_ok), else a warp a row; apart, so that neither's registers
 * and shared memory limit the other's occupancy. */
constexpr int kTileMinBlocks = 12; /* 42 registers: 12 CTAs an SM, not 9 */
template <bool Tile> KVP_D void decode_one(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  if (Tile) kvquant_decode_tile(p, j, out);
  else kvquant_decode(p, j, out);
}

template <uint32_t N, bool Tile>
__global__ void __launch_bounds__(kDecodeThreads, Tile ? kTileMinBlocks : 1) dec_kernel(const __grid_constant__ Batch<N> b) {
  decode_one<Tile>(b.p, b.jobs[blockIdx.x], b.out);
}

/* The CTA's job from a device table into shared memory (one 64-bit word a
 * thread), then a barrier. */
__device__ __forceinline__ void load_job(kvp_codec_dev_job &j, const kvp_codec_dev_job *jobs, uint32_t i) {
  if (threadIdx.x < sizeof j / 8) ((uint64_t *)&j)[threadIdx.x] = ((const uint64_t *)&jobs[i])[threadIdx.x];
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
    enc_kernel_dev(const __grid_constant__ kvp__kvq_kparams p, const kvp_codec_dev_job *__restrict__ jobs,
                   unsigned long long *status) {
  __shared__ kvp_codec_dev_job j;
  load_job(j, jobs, blockIdx.x);
  kvquant_encode(p, j, blockIdx.x, status);
}

template <bool Tile>
__global__ void __launch_bounds__(kDecodeThreads, Tile ? kTileMinBlocks : 1)
    dec_kernel_dev(const __grid_constant__ kvp__kvq_kparams p, const kvp_codec_dev_job *__restrict__ jobs,
                   uint32_t out) {
  __shared__ kvp_codec_dev_job j;
  load_job(j, jobs, blockIdx.x);
  decode_one<Tile>(p, j, out);
}

template <bool Enc, uint32_t N>
cudaError_t launch_params(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs, uint32_t at, uint32_t n,
                          uint64_t *status, uint32_t out, cudaStream_t s) {
  static_assert(sizeof(Batch<N>) <= 32000, "a batch must fit the 32 KiB parameter space");
  Batch<N> b;
  b.p = *p;
  b.status = (unsigned long long *)status;
  b.out = out;
  b.job0 = at;
  memcpy(b.jobs, jobs + at, n * sizeof *jobs);
  if (Enc) enc_kernel<N><<<n, kThreads, 0, s>>>(b);
  else if (kvquant_tile_ok(*p)) dec_kernel<N, true><<<n, kDecodeThreads, 0, s>>>(b);
  else dec_kernel<N, false><<<n, kDecodeThreads, 0, s>>>(b);
  return cudaGetLastError();
}

template <bool Enc>
int launch(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev, uint32_t njobs,
           uint64_t *status, uint32_t out, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (!njobs) return 0;
  if (jobs_dev) {
    if (Enc) enc_kernel_dev<<<njobs, kThreads, 0, s>>>(*p, jobs_dev, (unsigned long long *)status);
    else if (kvquant_tile_ok(*p)) dec_kernel_dev<true><<<njobs, kDecodeThreads, 0, s>>>(*p, jobs_dev, out);
    else dec_kernel_dev<false><<<njobs, kDecodeThreads, 0, s>>>(*p, jobs_dev, out);
    return (int)cudaGetLastError();
  }
  for (uint32_t at = 0; at < njobs; at += KVP__KERN_JOBS_PER_LAUNCH) {
    uint32_t n = njobs - at < KVP__KERN_JOBS_PER_LAUNCH ? njobs - at : KVP__KERN_JOBS_PER_LAUNCH;
    cudaError_t e = n <= 8 ? launch_params<Enc, 8>(p, jobs, at, n, status, out, s)
                           : launch_params<Enc, KVP__KERN_JOBS_PER_LAUNCH>(p, jobs, at, n, status, out, s);
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}

} // namespace kvq_
} // namespace kvpk

extern "C" int kvp__kern_kvq_encode(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs,
                                    const kvp_codec_dev_job *jobs_dev, uint32_t njobs, uint64_t *status, void *stream) {
  return kvpk::kvq_::launch<true>(p, jobs, jobs_dev, njobs, status, 0, stream);
}

extern "C" int kvp__kern_kvq_decode(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs,
                                    const kvp_codec_dev_job *jobs_dev, uint32_t njobs, uint32_t out, void *stream) {
  return kvpk::kvq_::launch<false>(p, jobs, jobs_dev, njobs, nullptr, out, stream);
}
