/*
 * alloc/region_cuda.c - the CUDA region backend: one cudaMalloc at create,
 * like an engine's pre-reserved KV tensor. Host code never dereferences it;
 * payload moves with cudaMemcpyAsync on the caller's stream. Freed pages are
 * reused only after the device drained (quiesce). cudaError_t
 * never leaves this file: it becomes KVP_EDEVICE with CUDA's message.
 */
#include "alloc.h"

#include <cuda_runtime_api.h>

static int cuda_fail(cudaError_t e, const char *what, int device) {
  return kvp__err(KVP_EDEVICE, "%s on CUDA device %d: %s (%s)", what, device, cudaGetErrorString(e),
                  cudaGetErrorName(e));
}

static int cuda_reserve(kvp__region *r) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) return cuda_fail(e, "cudaGetDeviceCount", r->device);
  if (r->device < 0 || r->device >= n)
    return kvp__err(KVP_EINVAL, "config.device = %d, but %d CUDA device(s) are visible", r->device, n);
  int prev = 0;
  cudaGetDevice(&prev);
  if ((e = cudaSetDevice(r->device)) != cudaSuccess) return cuda_fail(e, "cudaSetDevice", r->device);
  void *p = NULL;
  e = KVP__FAULT() ? cudaErrorMemoryAllocation : cudaMalloc(&p, r->bytes);
  cudaSetDevice(prev);
  if (e != cudaSuccess) {
    cudaGetLastError(); /* clear the sticky-free error state */
    return cuda_fail(e, "cudaMalloc of config.region_bytes", r->device);
  }
  r->base = p;
  return KVP_OK;
}

static void cuda_release(kvp__region *r) {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(r->device);
  cudaFree(r->base);
  cudaSetDevice(prev);
}

static int cuda_copy(kvp__region *r, uint64_t dst_off, uint64_t src_off, uint64_t bytes, void *stream) {
  cudaError_t e = cudaMemcpyAsync(r->base + dst_off, r->base + src_off, bytes, cudaMemcpyDeviceToDevice,
                                  (cudaStream_t)stream);
  return e == cudaSuccess ? KVP_OK : cuda_fail(e, "cudaMemcpyAsync (page move)", r->device);
}

static int cuda_write2d(kvp__region *r, uint64_t dst_off, uint64_t dst_pitch, const void *src, uint64_t src_pitch,
                        uint64_t width, uint64_t height, void *stream) {
  cudaError_t e = cudaMemcpy2DAsync(r->base + dst_off, dst_pitch, src, src_pitch, width, height, cudaMemcpyDefault,
                                    (cudaStream_t)stream);
  return e == cudaSuccess ? KVP_OK : cuda_fail(e, "cudaMemcpy2DAsync (append)", r->device);
}

static int cuda_read2d(kvp__region *r, void *dst, uint64_t dst_pitch, uint64_t src_off, uint64_t src_pitch,
                       uint64_t width, uint64_t height, void *stream) {
  cudaError_t e = cudaMemcpy2DAsync(dst, dst_pitch, r->base + src_off, src_pitch, width, height, cudaMemcpyDefault,
                                    (cudaStream_t)stream);
  return e == cudaSuccess ? KVP_OK : cuda_fail(e, "cudaMemcpy2DAsync (read)", r->device);
}

/* Conservative: every stream of the device drains before freed pages are
 * reused (a stream-ordered reuse with per-stream events would wait less). */
static int cuda_quiesce(kvp__region *r) {
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(r->device);
  cudaError_t e = cudaDeviceSynchronize();
  cudaSetDevice(prev);
  return e == cudaSuccess ? KVP_OK : cuda_fail(e, "cudaDeviceSynchronize (page reuse)", r->device);
}

static int cuda_usage(kvp__region *r, uint64_t span_bytes, uint64_t *used_bytes, uint64_t *total_bytes) {
  (void)span_bytes; /* the whole device is asked */
  int prev = 0;
  cudaGetDevice(&prev);
  cudaSetDevice(r->device);
  size_t fr = 0, tot = 0;
  cudaError_t e = cudaMemGetInfo(&fr, &tot);
  cudaSetDevice(prev);
  if (e != cudaSuccess) return cuda_fail(e, "cudaMemGetInfo", r->device);
  *used_bytes = tot - fr;
  *total_bytes = tot;
  return KVP_OK;
}

const kvp__region_ops kvp__region_cuda_ops = {"cuda",       cuda_reserve, cuda_release, cuda_copy,
                                              cuda_write2d, cuda_read2d,  cuda_quiesce, cuda_usage};
