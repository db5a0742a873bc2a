/*
 * kernels/kvquant.cu - the batch kernels behind KVQuant's encode_dev and
 * decode_dev (kernels/kvquant.cuh computes one job), and their launchers.
 *
 * Launch: as kernels/codec.cu's: one CTA per job (encode KVP__KERN_THREADS
 * threads, decode kDecodeThreads), the jobs in the kernel's parameters (a
 * __grid_constant__ batch of 8 or KVP__KERN_JOBS_PER_LAUNCH, split into
 * launches in order on the stream) or in a device table the caller staged
 * (one launch). Decode jobs that kvquant_lean_ok takes run the lean
 * kernels (one per bits and side), the others the general ones; from the
 * parameters the two kinds go to separate launches, from a device table
 * the lean kernel runs only when every job is lean. KVQuant keeps its own
 * kernels: its parameters carry device pointers to the binding's tables
 * and do not fit kvp__kparams.
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

/* The lean decode (kvquant_decode_lean): B and the side fixed per kernel,
 * the jobs those of kvquant_lean_ok. V fits 40 registers (12 CTAs an SM);
 * K holds its 16 channel-table values too: 64 registers (8 CTAs), as
 * ptxas spills it at 48. */
template <uint32_t KV> constexpr int lean_min_blocks() { return KV ? 12 : 8; }
template <uint32_t N, uint32_t B, uint32_t KV>
__global__ void __launch_bounds__(kDecodeThreads, lean_min_blocks<KV>()) lean_kernel(const __grid_constant__ Batch<N> b) {
  kvquant_decode_lean<B, KV>(b.p, b.jobs[blockIdx.x], b.out);
}
template <uint32_t B, uint32_t KV>
__global__ void __launch_bounds__(kDecodeThreads, lean_min_blocks<KV>())
    lean_kernel_dev(const __grid_constant__ kvp__kvq_kparams p, const kvp_codec_dev_job *__restrict__ jobs, uint32_t out) {
  __shared__ kvp_codec_dev_job j;
  load_job(j, jobs, blockIdx.x);
  kvquant_decode_lean<B, KV>(p, j, out);
}

/* Launches of the lean kernel of p's bits and side: n CTAs, from a batch
 * (b) or a device table (jobs_dev). */
template <uint32_t N> void lean_launch(const Batch<N> &b, uint32_t n, cudaStream_t s) {
  kvquant_lean_dispatch(b.p, [&](auto B, auto KV) {
    lean_kernel<N, decltype(B)::value, decltype(KV)::value><<<n, kDecodeThreads, 0, s>>>(b);
  });
}
void lean_launch_dev(const kvp__kvq_kparams &p, const kvp_codec_dev_job *jobs_dev, uint32_t n, uint32_t out,
                     cudaStream_t s) {
  kvquant_lean_dispatch(p, [&](auto B, auto KV) {
    lean_kernel_dev<decltype(B)::value, decltype(KV)::value><<<n, kDecodeThreads, 0, s>>>(p, jobs_dev, out);
  });
}

/* The n jobs of b (n <= N) in one launch: the lean kernel, or the
 * general one (by tiles or a warp a row). */
template <bool Lean, uint32_t N> cudaError_t dec_launch(const Batch<N> &b, uint32_t n, cudaStream_t s) {
  if (Lean) lean_launch<N>(b, n, s);
  else if (kvquant_tile_ok(b.p)) dec_kernel<N, true><<<n, kDecodeThreads, 0, s>>>(b);
  else dec_kernel<N, false><<<n, kDecodeThreads, 0, s>>>(b);
  return cudaGetLastError();
}

/* A batch of up to KVP__KERN_JOBS_PER_LAUNCH decode jobs filled in place;
 * flushed as it is, or through a batch of 8 when it holds 8 or fewer (a
 * smaller parameter block to send). */
constexpr uint32_t kDecMax = KVP__KERN_JOBS_PER_LAUNCH;
static_assert(sizeof(Batch<kDecMax>) <= 32000, "a batch must fit the 32 KiB parameter space");
template <bool Lean> cudaError_t dec_flush(Batch<kDecMax> &b, uint32_t &n, cudaStream_t s) {
  cudaError_t e = cudaSuccess;
  if (n > 8) e = dec_launch<Lean, kDecMax>(b, n, s);
  else if (n) {
    Batch<8> small;
    small.p = b.p, small.status = nullptr, small.out = b.out, small.job0 = 0;
    memcpy(small.jobs, b.jobs, n * sizeof *b.jobs);
    e = dec_launch<Lean, 8>(small, n, s);
  }
  n = 0;
  return e;
}

/* Decode: the jobs that kvquant_lean_ok takes to the lean kernels, the
 * others to the general ones, each copied once into its kind's batch (the
 * jobs write disjoint rows: their order is free). From a device table,
 * one launch: the lean kernel when every job is lean, else the general
 * one for all. */
int decode(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev, uint32_t njobs,
           uint32_t out, cudaStream_t s) {
  if (!njobs) return 0;
  const bool lean_binding = kvquant_lean_binding_ok(*p, out);
  if (jobs_dev) {
    bool lean = lean_binding;
    for (uint32_t i = 0; lean && i < njobs; i++) lean = kvquant_lean_job_ok(*p, jobs[i]);
    if (lean) lean_launch_dev(*p, jobs_dev, njobs, out, s);
    else if (kvquant_tile_ok(*p)) dec_kernel_dev<true><<<njobs, kDecodeThreads, 0, s>>>(*p, jobs_dev, out);
    else dec_kernel_dev<false><<<njobs, kDecodeThreads, 0, s>>>(*p, jobs_dev, out);
    return (int)cudaGetLastError();
  }
  Batch<kDecMax> lean, gen;
  lean.p = gen.p = *p, lean.status = gen.status = nullptr, lean.out = gen.out = out, lean.job0 = gen.job0 = 0;
  uint32_t nl = 0, ng = 0;
  for (uint32_t i = 0; i < njobs; i++) {
    cudaError_t e = cudaSuccess;
    if (lean_binding && kvquant_lean_job_ok(*p, jobs[i])) {
      lean.jobs[nl++] = jobs[i];
      if (nl == kDecMax) e = dec_flush<true>(lean, nl, s);
    } else {
      gen.jobs[ng++] = jobs[i];
      if (ng == kDecMax) e = dec_flush<false>(gen, ng, s);
    }
    if (e != cudaSuccess) return (int)e;
  }
  cudaError_t e = dec_flush<true>(lean, nl, s);
  if (e == cudaSuccess) e = dec_flush<false>(gen, ng, s);
  return (int)e;
}

/* Encode: from the kernel's parameters, launches of at most
 * KVP__KERN_JOBS_PER_LAUNCH (8 when fewer), or from a device table (one
 * launch). */
template <uint32_t N>
cudaError_t enc_batch(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs, uint32_t at, uint32_t n,
                      uint64_t *status, cudaStream_t s) {
  static_assert(sizeof(Batch<N>) <= 32000, "a batch must fit the 32 KiB parameter space");
  Batch<N> b;
  b.p = *p;
  b.status = (unsigned long long *)status;
  b.out = 0;
  b.job0 = at;
  memcpy(b.jobs, jobs + at, n * sizeof *jobs);
  enc_kernel<N><<<n, kThreads, 0, s>>>(b);
  return cudaGetLastError();
}

int encode(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev, uint32_t njobs,
           uint64_t *status, cudaStream_t s) {
  if (!njobs) return 0;
  if (jobs_dev) {
    enc_kernel_dev<<<njobs, kThreads, 0, s>>>(*p, jobs_dev, (unsigned long long *)status);
    return (int)cudaGetLastError();
  }
  for (uint32_t at = 0; at < njobs; at += KVP__KERN_JOBS_PER_LAUNCH) {
    uint32_t n = njobs - at < KVP__KERN_JOBS_PER_LAUNCH ? njobs - at : KVP__KERN_JOBS_PER_LAUNCH;
    cudaError_t e = n <= 8 ? enc_batch<8>(p, jobs, at, n, status, s)
                           : enc_batch<KVP__KERN_JOBS_PER_LAUNCH>(p, jobs, at, n, status, s);
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}

} // namespace kvq_
} // namespace kvpk

extern "C" int kvp__kern_kvq_encode(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs,
                                    const kvp_codec_dev_job *jobs_dev, uint32_t njobs, uint64_t *status, void *stream) {
  return kvpk::kvq_::encode(p, jobs, jobs_dev, njobs, status, (cudaStream_t)stream);
}

extern "C" int kvp__kern_kvq_decode(const kvp__kvq_kparams *p, const kvp_codec_dev_job *jobs,
                                    const kvp_codec_dev_job *jobs_dev, uint32_t njobs, uint32_t out, void *stream) {
  return kvpk::kvq_::decode(p, jobs, jobs_dev, njobs, out, (cudaStream_t)stream);
}
