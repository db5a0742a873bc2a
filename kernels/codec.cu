/*
 * kernels/codec.cu - the batch kernels behind every built-in codec's
 * encode_dev and decode_dev, and their launchers.
 *
 * Launch: one CTA of KVP__KERN_THREADS threads per job (one block of one
 * head and side); the jobs ride in the kernel's parameters (a
 * __grid_constant__ batch of up to KVP__KERN_JOBS_PER_LAUNCH, about 26 KiB,
 * within CUDA 12.1's 32 KiB), so a call needs no device memory and no copy:
 * a decode-step append of H heads is one launch per side. Larger batches
 * are split into launches of that many jobs, in order on the stream.
 * The codec is picked by a uniform switch on p.codec (one kernel for all
 * built-ins, so a gather can mix codecs of K and V in one launch).
 *
 * Measured figures: see the README's GPU section (make bench-gpu).
 */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include "common.cuh"
#include "fp8.cuh"
#include "int8.cuh"
#include "kivi.cuh"
#include "nvfp4.cuh"
#include "raw.cuh"

namespace kvpk {

struct Batch {
  kvp__kparams p;                 /* the codec binding */
  unsigned long long *status;     /* encode: the status word */
  uint32_t out;                   /* decode: out dtype */
  uint32_t job0;                  /* index of jobs[0] in the caller's batch */
  kvp_codec_dev_job jobs[KVP__KERN_JOBS_PER_LAUNCH];
};

__device__ void encode_one(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t job,
                           unsigned long long *status) {
  switch (p.codec) {
  case KVP__K_RAW: raw_encode(p, j, job, status); break;
  case KVP__K_FP8: fp8_encode(p, j, job, status); break;
  case KVP__K_INT8: int8_encode(p, j, job, status); break;
  case KVP__K_KIVI: kivi_encode(p, j, job, status); break;
  case KVP__K_NVFP4: nvfp4_encode(p, j, job, status); break;
  default: break;
  }
}

__device__ void decode_one(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  switch (p.codec) {
  case KVP__K_RAW: raw_decode(p, j, out); break;
  case KVP__K_FP8: fp8_decode(p, j, out); break;
  case KVP__K_INT8: int8_decode(p, j, out); break;
  case KVP__K_KIVI: kivi_decode(p, j, out); break;
  case KVP__K_NVFP4: nvfp4_decode(p, j, out); break;
  default: break;
  }
}

__global__ void __launch_bounds__(kThreads) encode_kernel(const __grid_constant__ Batch b) {
  encode_one(b.p, b.jobs[blockIdx.x], b.job0 + blockIdx.x, b.status);
}

__global__ void __launch_bounds__(kThreads) decode_kernel(const __grid_constant__ Batch b) {
  decode_one(b.p, b.jobs[blockIdx.x], b.out);
}

/* The gather: jobs in device memory in four groups (codec K, RAW tail K,
 * codec V, RAW tail V: job i is in the first group g with i < end[g]),
 * bf16 out. */
struct GatherParams {
  kvp__kparams p[4];
  uint32_t end[4];
};

__global__ void __launch_bounds__(kThreads)
    gather_kernel(const __grid_constant__ GatherParams g, const kvp_codec_dev_job *__restrict__ jobs) {
  uint32_t i = blockIdx.x;
  __shared__ kvp_codec_dev_job j;
  if (threadIdx.x < sizeof j / 8) ((uint64_t *)&j)[threadIdx.x] = ((const uint64_t *)&jobs[i])[threadIdx.x];
  __syncthreads();
  uint32_t grp = i < g.end[0] ? 0 : i < g.end[1] ? 1 : i < g.end[2] ? 2 : 3;
  decode_one(g.p[grp], j, kBF16);
}

template <bool Enc>
int launch(const kvp__kparams *p, const kvp_codec_dev_job *jobs, uint32_t njobs, uint64_t *status, uint32_t out,
           void *stream) {
  static_assert(sizeof(Batch) <= 32000, "batch must fit the 32 KiB parameter space");
  for (uint32_t at = 0; at < njobs; at += KVP__KERN_JOBS_PER_LAUNCH) {
    uint32_t n = njobs - at < KVP__KERN_JOBS_PER_LAUNCH ? njobs - at : KVP__KERN_JOBS_PER_LAUNCH;
    Batch b;
    b.p = *p;
    b.status = (unsigned long long *)status;
    b.out = out;
    b.job0 = at;
    memcpy(b.jobs, jobs + at, n * sizeof *jobs);
    if (Enc) encode_kernel<<<n, kThreads, 0, (cudaStream_t)stream>>>(b);
    else decode_kernel<<<n, kThreads, 0, (cudaStream_t)stream>>>(b);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}

} // namespace kvpk

static_assert(sizeof(kvp_codec_dev_job) % 8 == 0 && sizeof(kvp_codec_dev_job) / 8 <= KVP__KERN_THREADS,
              "the gather loads a job as 64-bit words");

extern "C" int kvp__kern_encode(const kvp__kparams *p, const kvp_codec_dev_job *jobs, uint32_t njobs,
                                uint64_t *status, void *stream) {
  return kvpk::launch<true>(p, jobs, njobs, status, 0, stream);
}

extern "C" int kvp__kern_decode(const kvp__kparams *p, const kvp_codec_dev_job *jobs, uint32_t njobs, uint32_t out,
                                void *stream) {
  return kvpk::launch<false>(p, jobs, njobs, nullptr, out, stream);
}

extern "C" int kvp__kern_gather(const kvp__kparams p[4], const uint32_t end[4], const kvp_codec_dev_job *jobs_dev,
                                void *stream) {
  if (!end[3]) return 0;
  kvpk::GatherParams g;
  for (int i = 0; i < 4; i++) g.p[i] = p[i], g.end[i] = end[i];
  kvpk::gather_kernel<<<end[3], kvpk::kThreads, 0, (cudaStream_t)stream>>>(g, jobs_dev);
  return (int)cudaGetLastError();
}

extern "C" const char *kvp__kern_errstr(int err) {
  static __thread char buf[256];
  snprintf(buf, sizeof buf, "%s: %s", cudaGetErrorName((cudaError_t)err), cudaGetErrorString((cudaError_t)err));
  return buf;
}
