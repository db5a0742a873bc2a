/*
 * kernels/codec.cu - the batch kernels behind every built-in codec's
 * encode_dev and decode_dev, and their launchers.
 *
 * Launch: one CTA of KVP__KERN_THREADS threads per job (one block of one
 * head and side). The jobs come either from a device table the caller
 * staged (one launch for any batch), or in the kernel's parameters (a
 * __grid_constant__ batch of 8, 64 or up to KVP__KERN_JOBS_PER_LAUNCH jobs,
 * about 26 KiB, within CUDA 12.1's 32 KiB), so a call needs no device
 * memory: a decode-step append of H heads is one small launch per side.
 * Larger parameter batches are split into launches, in order on the stream.
 * The codec is picked by a uniform switch on p.codec (one kernel for all
 * built-ins, so a gather can mix codecs of K and V in one launch).
 *
 * Measured on the H100 (make bench-gpu): per codec in each kernels/<codec>.cuh;
 * the gather of a 32K-token llama-3-8b layer (16-token blocks, H = 8) runs
 * at 0.72-0.82x of a device copy of the decoded bytes, its table copy
 * included.
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

/* Jobs in kernel parameters: a __grid_constant__ batch of up to N jobs
 * (N = 8, 64 or KVP__KERN_JOBS_PER_LAUNCH: the parameter copy grows with
 * N, so a decode step's few jobs launch a small one). */
template <uint32_t N> struct Batch {
  kvp__kparams p;                 /* the codec binding */
  unsigned long long *status;     /* encode: the status word */
  uint32_t out;                   /* decode: out dtype */
  uint32_t job0;                  /* index of jobs[0] in the caller's batch */
  kvp_codec_dev_job jobs[N];
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

template <uint32_t N>
__global__ void __launch_bounds__(kThreads) encode_kernel(const __grid_constant__ Batch<N> b) {
  encode_one(b.p, b.jobs[blockIdx.x], b.job0 + blockIdx.x, b.status);
}

template <uint32_t N>
__global__ void __launch_bounds__(kDecodeThreads, 12) decode_kernel(const __grid_constant__ Batch<N> b) {
  decode_one(b.p, b.jobs[blockIdx.x], b.out);
}

/* Jobs in device memory: one launch for any batch. The CTA copies its job
 * to shared memory first (one 64-bit word per thread). */
__device__ __forceinline__ void load_job(kvp_codec_dev_job &j, const kvp_codec_dev_job *jobs, uint32_t i) {
  if (threadIdx.x < sizeof j / 8) ((uint64_t *)&j)[threadIdx.x] = ((const uint64_t *)&jobs[i])[threadIdx.x];
  __syncthreads();
}

__global__ void __launch_bounds__(kThreads)
    encode_kernel_dev(const __grid_constant__ kvp__kparams p, const kvp_codec_dev_job *__restrict__ jobs,
                      unsigned long long *status) {
  __shared__ kvp_codec_dev_job j;
  load_job(j, jobs, blockIdx.x);
  encode_one(p, j, blockIdx.x, status);
}

__global__ void __launch_bounds__(kDecodeThreads, 12)
    decode_kernel_dev(const __grid_constant__ kvp__kparams p, const kvp_codec_dev_job *__restrict__ jobs,
                      uint32_t out) {
  __shared__ kvp_codec_dev_job j;
  load_job(j, jobs, blockIdx.x);
  decode_one(p, j, out);
}

/* The gather: one CTA per record, its K then its V decoded into bf16. */
template <uint32_t P> struct GatherParams {
  kvp__kparams p[P];
};

struct GatherOut {
  const char *base;     /* region base */
  char *k, *v;          /* outputs */
  uint64_t row_bytes;   /* bytes of an output row (all heads) */
  uint32_t head_bytes;  /* bytes of one head in a row */
};

template <uint32_t P>
__global__ void __launch_bounds__(kDecodeThreads, 12)
    gather_kernel(const __grid_constant__ GatherParams<P> g, const __grid_constant__ GatherOut o,
                  const kvp__gjob *__restrict__ recs) {
  __shared__ kvp_codec_dev_job j[2];
  __shared__ uint32_t tag;
  if (threadIdx.x < 2) {
    kvp__gjob r = recs[blockIdx.x];
    int kv = threadIdx.x;
    kvp_codec_dev_job &x = j[kv];
    for (int i = 0; i < 4; i++)
      x.pages[i] = r.page[kv][i] == KVP__GJOB_NO_PAGE ? nullptr : (void *)(o.base + (uint64_t)r.page[kv][i] * 64);
    x.src = nullptr;
    x.dst = (kv ? o.v : o.k) + (uint64_t)r.row * o.row_bytes + (uint64_t)r.head * o.head_bytes;
    x.stride_bytes = o.row_bytes;
    x.n = r.n1 + 1u, x.cap_tokens = r.cap1 + 1u, x.t0 = r.t0, x.m = r.m1 + 1u;
    x.head = r.head, x.pos0 = r.pos0;
    if (kv == 0) tag = r.tag;
  }
  __syncthreads();
  decode_one(g.p[tag], j[0], kBF16);
  decode_one(g.p[tag + 2], j[1], kBF16);
}

template <uint32_t P>
cudaError_t gather_launch(const kvp__kparams *p, uint32_t np, const GatherOut &o, const kvp__gjob *recs,
                          uint32_t njobs, cudaStream_t s) {
  static_assert(sizeof(GatherParams<P>) <= 32000, "gather parameters must fit the 32 KiB parameter space");
  GatherParams<P> g;
  memcpy(g.p, p, np * sizeof *p);
  gather_kernel<P><<<njobs, kDecodeThreads, 0, s>>>(g, o, recs);
  return cudaGetLastError();
}

template <bool Enc, uint32_t N>
cudaError_t launch_params(const kvp__kparams *p, const kvp_codec_dev_job *jobs, uint32_t at, uint32_t n,
                          uint64_t *status, uint32_t out, cudaStream_t stream) {
  static_assert(sizeof(Batch<N>) <= 32000, "a batch must fit the 32 KiB parameter space");
  Batch<N> b;
  b.p = *p;
  b.status = (unsigned long long *)status;
  b.out = out;
  b.job0 = at;
  memcpy(b.jobs, jobs + at, n * sizeof *jobs);
  if (Enc) encode_kernel<N><<<n, kThreads, 0, stream>>>(b);
  else decode_kernel<N><<<n, kDecodeThreads, 0, stream>>>(b);
  return cudaGetLastError();
}

template <bool Enc>
int launch(const kvp__kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev, uint32_t njobs,
           uint64_t *status, uint32_t out, void *stream) {
  cudaStream_t s = (cudaStream_t)stream;
  if (!njobs) return 0;
  if (jobs_dev) {
    if (Enc) encode_kernel_dev<<<njobs, kThreads, 0, s>>>(*p, jobs_dev, (unsigned long long *)status);
    else decode_kernel_dev<<<njobs, kDecodeThreads, 0, s>>>(*p, jobs_dev, out);
    return (int)cudaGetLastError();
  }
  for (uint32_t at = 0; at < njobs; at += KVP__KERN_JOBS_PER_LAUNCH) {
    uint32_t n = njobs - at < KVP__KERN_JOBS_PER_LAUNCH ? njobs - at : KVP__KERN_JOBS_PER_LAUNCH;
    cudaError_t e = n <= 8    ? launch_params<Enc, 8>(p, jobs, at, n, status, out, s)
                    : n <= 64 ? launch_params<Enc, 64>(p, jobs, at, n, status, out, s)
                              : launch_params<Enc, KVP__KERN_JOBS_PER_LAUNCH>(p, jobs, at, n, status, out, s);
    if (e != cudaSuccess) return (int)e;
  }
  return 0;
}

} // namespace kvpk

static_assert(sizeof(kvp_codec_dev_job) % 8 == 0 && sizeof(kvp_codec_dev_job) / 8 <= KVP__KERN_THREADS,
              "the gather loads a job as 64-bit words");

extern "C" int kvp__kern_encode(const kvp__kparams *p, const kvp_codec_dev_job *jobs,
                                const kvp_codec_dev_job *jobs_dev, uint32_t njobs, uint64_t *status, void *stream) {
  return kvpk::launch<true>(p, jobs, jobs_dev, njobs, status, 0, stream);
}

extern "C" int kvp__kern_decode(const kvp__kparams *p, const kvp_codec_dev_job *jobs,
                                const kvp_codec_dev_job *jobs_dev, uint32_t njobs, uint32_t out, void *stream) {
  return kvpk::launch<false>(p, jobs, jobs_dev, njobs, nullptr, out, stream);
}

extern "C" int kvp__kern_gather(const kvp__kparams *p, uint32_t np, const void *region_base,
                                const kvp__gjob *recs_dev, uint32_t njobs, void *k_out, void *v_out,
                                uint64_t row_bytes, uint32_t head_dim, void *stream) {
  if (!njobs) return 0;
  if (np > KVP__KERN_GATHER_PARAMS) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  kvpk::GatherOut o = {(const char *)region_base, (char *)k_out, (char *)v_out, row_bytes, head_dim * 2u};
  return (int)(np <= 4 ? kvpk::gather_launch<4>(p, np, o, recs_dev, njobs, s)
                       : kvpk::gather_launch<KVP__KERN_GATHER_PARAMS>(p, np, o, recs_dev, njobs, s));
}

extern "C" const char *kvp__kern_errstr(int err) {
  static __thread char buf[256];
  snprintf(buf, sizeof buf, "%s: %s", cudaGetErrorName((cudaError_t)err), cudaGetErrorString((cudaError_t)err));
  return buf;
}
