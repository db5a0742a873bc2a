/*
 * pages/xfer_cuda.c - the store tier's staging on a CUDA region: page
 * bytes move between the region and store blobs through pinned host
 * buffers, copied asynchronously on the store's stream (kvp_store_set_stream).
 *
 * Two halves, each one pinned buffer (cudaHostAlloc'd once, grown while
 * idle, freed at pool destroy) and one event recorded after the copies
 * that touch it:
 *
 *   offload  half A: device pages --copy--> the staging area after each
 *                    blob (region order)                       (stream)
 *            half B: pages moved into their blobs, sealed, --SET--> the store
 *                    (host, meanwhile)
 *   restore  blob j: reply --memcpy--> pinned half j%2 (region order)
 *                    --copy--> fresh pages
 *            blob j+1 is read and checked while blob j's copy runs
 *   Pages adjacent in the region (consecutive slab slots) go as one copy,
 *   their size classes' padding carried along (pages/blob.c).
 *
 * Invariants: a half is written by the host only after its event passed
 * (kvp__xfer_buf waits for it); pinned_bytes = sum of the halves'
 * capacities; every staged copy targets or reads a half whose event is
 * recorded after it, so draining both events (kvp__xfer_drain) means no
 * copy of the store tier touches the region or the halves any more.
 * Copies of one blob go as one cudaMemcpyBatchAsync (CUDA 13 and later, on
 * a non-default stream), else one cudaMemcpyAsync each.
 */
#include "blob.h"

#include <cuda_runtime_api.h>

#define XFER_HALF_BYTES (32ull << 20) /* the least a half is sized to */

struct kvp__xfer {
  unsigned char *buf[2]; /* pinned host, or NULL */
  uint64_t cap[2];       /* bytes of each */
  cudaEvent_t done[2];   /* recorded after the copies of each half */
  bool has_event[2];     /* done[i] was created */
};

static int xfer_fail(cudaError_t e, const char *what, const kvp_pool *pool) {
  cudaGetLastError(); /* clear a sticky-free error */
  return kvp__err(KVP_EDEVICE, "store transfer: %s on CUDA device %d: %s (%s)", what, pool->cfg.device,
                  cudaGetErrorString(e), cudaGetErrorName(e));
}

static int enter(const kvp_pool *pool, int *prev) {
  cudaGetDevice(prev);
  if (*prev == pool->cfg.device) return KVP_OK;
  cudaError_t e = cudaSetDevice(pool->cfg.device);
  return e == cudaSuccess ? KVP_OK : xfer_fail(e, "cudaSetDevice", pool);
}
static void leave(const kvp_pool *pool, int prev) {
  if (prev != pool->cfg.device) cudaSetDevice(prev);
}

static int xfer_get(kvp_pool *pool, struct kvp__xfer **out) {
  if (!pool->xfer) {
    struct kvp__xfer *x = kvp__meta_calloc(&pool->meta, sizeof *x);
    if (!x) return kvp__err(KVP_ENOMEM, "store transfer: staging control block");
    __atomic_store_n(&pool->xfer, x, __ATOMIC_RELEASE);
  }
  *out = pool->xfer;
  return KVP_OK;
}

int kvp__xfer_wait(kvp_pool *pool, uint32_t half) {
  struct kvp__xfer *x = pool->xfer;
  if (!x || !x->has_event[half]) return KVP_OK;
  cudaError_t e = cudaEventSynchronize(x->done[half]);
  return e == cudaSuccess ? KVP_OK : xfer_fail(e, "cudaEventSynchronize (staged copies)", pool);
}

int kvp__xfer_drain(kvp_pool *pool) {
  int rc = kvp__xfer_wait(pool, 0), rc1 = kvp__xfer_wait(pool, 1);
  return rc ? rc : rc1;
}

int kvp__xfer_buf(kvp_pool *pool, uint32_t half, uint64_t bytes, unsigned char **buf, uint64_t *cap) {
  struct kvp__xfer *x = NULL;
  int rc = xfer_get(pool, &x), prev = 0;
  if (rc || (rc = kvp__xfer_wait(pool, half))) return rc;
  if (x->buf[half] && x->cap[half] >= bytes) {
    *buf = x->buf[half];
    *cap = x->cap[half];
    return KVP_OK;
  }
  if ((rc = enter(pool, &prev))) return rc;
  uint64_t want = XFER_HALF_BYTES;
  while (want < bytes) want *= 2;
  void *p = NULL;
  cudaError_t e = cudaSuccess;
  if (!x->has_event[half] && (e = cudaEventCreateWithFlags(&x->done[half], cudaEventDisableTiming)) == cudaSuccess)
    x->has_event[half] = true;
  if (e == cudaSuccess) e = KVP__FAULT() ? cudaErrorMemoryAllocation : cudaHostAlloc(&p, want, cudaHostAllocDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();
    leave(pool, prev);
    return kvp__err(KVP_EDEVICE, "store transfer: cudaHostAlloc of a %llu-byte pinned staging buffer on CUDA device "
                    "%d: %s", (unsigned long long)want, pool->cfg.device, cudaGetErrorString(e));
  }
  if (x->buf[half]) cudaFreeHost(x->buf[half]); /* idle: its event passed */
  x->buf[half] = p;
  __atomic_store_n(&x->cap[half], want, __ATOMIC_RELAXED); /* stats read it without the lock */
  leave(pool, prev);
  *buf = p;
  *cap = want;
  return KVP_OK;
}

int kvp__xfer_settle(kvp_pool *pool, void *stream) {
  int prev, rc = enter(pool, &prev);
  if (rc) return rc;
  cudaError_t e = cudaStreamSynchronize((cudaStream_t)stream);
  leave(pool, prev);
  return e == cudaSuccess ? KVP_OK : xfer_fail(e, "cudaStreamSynchronize (staged copies)", pool);
}

int kvp__xfer_record(kvp_pool *pool, uint32_t half, void *stream) {
  struct kvp__xfer *x = pool->xfer;
  kvp__assert(x && x->has_event[half]);
  cudaError_t e = cudaEventRecord(x->done[half], (cudaStream_t)stream);
  if (e == cudaSuccess) return KVP_OK;
  int rc = xfer_fail(e, "cudaEventRecord (staged copies)", pool);
  (void)kvp__xfer_settle(pool, stream); /* no event covers the copies: wait for the stream */
  return rc;
}

int kvp__xfer_copy(kvp_pool *pool, uint32_t n, void **dst, const void **src, const size_t *bytes, void *stream) {
  if (!n) return KVP_OK;
  int prev, rc = enter(pool, &prev);
  if (rc) return rc;
  bool batched = false;
#if CUDART_VERSION >= 13000
  if (stream && n > 1) { /* the legacy default stream takes no batches */
    struct cudaMemcpyAttributes a;
    memset(&a, 0, sizeof a);
    a.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    size_t idx = 0;
    cudaError_t e = cudaMemcpyBatchAsync((void *const *)dst, (const void *const *)src, bytes, n, &a, &idx, 1,
                                         (cudaStream_t)stream);
    if (!(batched = e == cudaSuccess)) cudaGetLastError(); /* a driver without batches: one copy at a time */
  }
#endif
  for (uint32_t i = 0; !batched && i < n; i++) {
    cudaError_t e = cudaMemcpyAsync(dst[i], src[i], bytes[i], cudaMemcpyDefault, (cudaStream_t)stream);
    if (e != cudaSuccess) {
      rc = xfer_fail(e, "cudaMemcpyAsync (staged page copy)", pool);
      if (i) (void)cudaStreamSynchronize((cudaStream_t)stream); /* the copies before it land before pages go */
      break;
    }
  }
  leave(pool, prev);
  return rc;
}

uint64_t kvp__xfer_pinned_bytes(const kvp_pool *pool) {
  struct kvp__xfer *x = __atomic_load_n(&pool->xfer, __ATOMIC_ACQUIRE);
  return x ? __atomic_load_n(&x->cap[0], __ATOMIC_RELAXED) + __atomic_load_n(&x->cap[1], __ATOMIC_RELAXED) : 0;
}

void kvp__xfer_fini(kvp_pool *pool) {
  struct kvp__xfer *x = pool->xfer;
  if (!x) return;
  int prev;
  enter(pool, &prev);
  (void)kvp__xfer_drain(pool);
  for (int i = 0; i < 2; i++) {
    if (x->buf[i]) cudaFreeHost(x->buf[i]);
    if (x->has_event[i]) cudaEventDestroy(x->done[i]);
  }
  leave(pool, prev);
  kvp__meta_free(&pool->meta, x, sizeof *x);
  pool->xfer = NULL;
}
