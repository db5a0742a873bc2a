/*
 * kernels/qvg.cu - the batch kernels behind QVG's encode_dev and
 * decode_dev (kernels/qvg.cuh computes one job), and their launchers.
 *
 * Launch: encode, one CTA of kQvgThreads per job, the jobs in the
 * kernel's parameters (a __grid_constant__ batch), split into waves on the
 * stream: a wave holds as many jobs as the caller's workspace has scratch
 * for (kvp__qvg_ws_bytes of the largest job each), so every job of a wave
 * has its own scratch and a later wave reuses it in stream order; dynamic
 * shared memory qvg_smem_bytes(D) (80 KiB at D = 128). Decode, a grid of
 * (job, part): a job's rows split over parts of kQvgDecThreads threads,
 * kDecItems octets a thread; from a device job table when the caller
 * staged one (one launch).
 *
 * Cost of an encode (D = 128, Ka = 256, I Lloyd rounds per stage): the
 * labels are (I + 2) Ka D multiply-adds per row a stage, from shared
 * memory (the arithmetic bound: ~1 ms per 4096-row label pass on one SM);
 * the k-means++ seeding is Ka passes over the residual (L2 traffic, the
 * loads kept in flight by unrolling). Measured (KVP_BENCH_ONLY=qvg
 * build/kvpool-bench-gpu, 32 heads x 4096 tokens, bf16, H200): qvg 36 ms,
 * qvg-pro 128 ms; tools/bench_torch.py times the same k-means in PyTorch
 * at 57 ms and 231 ms. Decode reaches 0.3 of the device copy, bound by
 * instructions (ncu: 62% SM, 7% DRAM throughput).
 */
#include <cuda_runtime.h>
#include <string.h>

#include "common.cuh"
#include "qvg.cuh"

namespace kvpk {
namespace qvg_ {

constexpr uint32_t kJobsPerLaunch = 128;
constexpr uint32_t kQvgDecThreads = 256;
constexpr int kQvgDecMinBlocks = 6; /* 42 registers: 6 CTAs an SM, not 4 */

struct EncBatch {
  kvp__qvg_kparams p;
  unsigned long long *status;
  uint8_t *ws;        /* wave's scratch: job i at ws + i * ws_stride */
  uint64_t ws_stride; /* bytes of scratch per job */
  uint32_t index[kJobsPerLaunch]; /* each job's index in the caller's batch (status words name it) */
  kvp_codec_dev_job jobs[kJobsPerLaunch];
};

struct DecBatch {
  kvp__qvg_kparams p;
  uint32_t out;
  kvp_codec_dev_job jobs[kJobsPerLaunch];
};

__global__ void __launch_bounds__(kQvgThreads) enc_kernel(const __grid_constant__ EncBatch b) {
  extern __shared__ float4 qvg_smem[];
  qvg_encode(b.p, b.jobs[blockIdx.x], b.ws + blockIdx.x * b.ws_stride, (float *)qvg_smem, b.index[blockIdx.x],
             b.status);
}

/* Decode: blockIdx.x the job, blockIdx.y the part of its rows. */
__global__ void __launch_bounds__(kQvgDecThreads, kQvgDecMinBlocks) dec_kernel(const __grid_constant__ DecBatch b) {
  qvg_decode(b.p, b.jobs[blockIdx.x], b.out, blockIdx.y, gridDim.y);
}

__global__ void __launch_bounds__(kQvgDecThreads, kQvgDecMinBlocks)
    dec_kernel_dev(const __grid_constant__ kvp__qvg_kparams p, const kvp_codec_dev_job *__restrict__ jobs,
                   uint32_t out) {
  __shared__ kvp_codec_dev_job j;
  if (threadIdx.x < sizeof j / 8) ((uint64_t *)&j)[threadIdx.x] = ((const uint64_t *)&jobs[blockIdx.x])[threadIdx.x];
  __syncthreads();
  qvg_decode(p, j, out, blockIdx.y, gridDim.y);
}

/* Parts per decode job: one (row, octet) item per thread, rows up to the
 * batch's longest. */
static uint32_t dec_parts(const kvp__qvg_kparams *p, const kvp_codec_dev_job *jobs, uint32_t njobs) {
  uint64_t m = 0;
  for (uint32_t i = 0; i < njobs; i++) m = jobs[i].m > m ? jobs[i].m : m;
  uint64_t per = (uint64_t)kQvgDecThreads * kDecItems, parts = (m * (p->head_dim / 8) + per - 1) / per;
  return parts < 1 ? 1u : parts > 65535 ? 65535u : (uint32_t)parts;
}

static_assert(sizeof(EncBatch) <= 32000, "a batch must fit the 32 KiB parameter space");
static_assert(sizeof(DecBatch) <= 32000, "a batch must fit the 32 KiB parameter space");

} // namespace qvg_
} // namespace kvpk

using namespace kvpk;
using namespace kvpk::qvg_;

extern "C" int kvp__kern_qvg_encode(const kvp__qvg_kparams *p, const kvp_codec_dev_job *jobs, const uint32_t *index,
                                    uint32_t njobs, void *ws, uint64_t ws_bytes, uint64_t *status, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  uint32_t maxcap = 0;
  for (uint32_t i = 0; i < njobs; i++) maxcap = jobs[i].cap_tokens > maxcap ? jobs[i].cap_tokens : maxcap;
  uint64_t stride = (kvp__qvg_ws_bytes(p, maxcap) + 255) & ~(uint64_t)255;
  uint64_t fit = stride ? ws_bytes / stride : kJobsPerLaunch;
  if (njobs && fit == 0) return (int)cudaErrorInvalidValue; /* the caller sizes ws for one job at least */
  uint32_t wave = fit < kJobsPerLaunch ? (uint32_t)fit : kJobsPerLaunch;
  uint32_t smem = qvg_smem_bytes(p->head_dim);
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(enc_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
  }
  EncBatch b;
  for (uint32_t at = 0; at < njobs; at += wave) {
    uint32_t n = njobs - at < wave ? njobs - at : wave;
    b.p = *p;
    b.status = (unsigned long long *)status;
    b.ws = (uint8_t *)ws;
    b.ws_stride = stride;
    for (uint32_t i = 0; i < n; i++) b.index[i] = index ? index[at + i] : at + i;
    memcpy(b.jobs, jobs + at, n * sizeof *jobs);
    enc_kernel<<<n, kQvgThreads, smem, s>>>(b);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}

extern "C" int kvp__kern_qvg_decode(const kvp__qvg_kparams *p, const kvp_codec_dev_job *jobs,
                                    const kvp_codec_dev_job *jobs_dev, uint32_t njobs, uint32_t out, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (!njobs) return 0;
  dim3 grid(njobs, dec_parts(p, jobs, njobs));
  if (jobs_dev) {
    dec_kernel_dev<<<grid, kQvgDecThreads, 0, s>>>(*p, jobs_dev, out);
    return (int)cudaGetLastError();
  }
  DecBatch b;
  for (uint32_t at = 0; at < njobs; at += kJobsPerLaunch) {
    uint32_t n = njobs - at < kJobsPerLaunch ? njobs - at : kJobsPerLaunch;
    b.p = *p;
    b.out = out;
    memcpy(b.jobs, jobs + at, n * sizeof *jobs);
    dec_kernel<<<dim3(n, dec_parts(p, jobs + at, n)), kQvgDecThreads, 0, s>>>(b);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}
