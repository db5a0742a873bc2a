/*
 * codecs/kvquant_cuda.c - KVQuant's device ops, host side: the binding's
 * tables (codebook, midpoints, per-channel offsets, ranges and their
 * inverses, RoPE frequencies; kvp__kvq_dev_image) copied to the device once,
 * the jobs checked, the kernels (kernels/kvquant.cu) launched with a message
 * on failure. Built only with CUDA.
 *
 * The copy is made by kvp__kvq_dev_prepare, which a CUDA pool calls at
 * create (on the pool's device; counted in device.control_bytes), or at a
 * device op's first call when the codec is used alone. Invariant: the slot
 * is NULL or a complete copy; it is set once, under dev_lock, with a release
 * store, and read with an acquire load (decode may run on reader threads).
 * Freed with the instance.
 */
#include "builtin.h"
#include "kvquant.h"

#include <cuda_runtime_api.h>
#include <pthread.h>

struct kvp__kvq_dev {
  void *tables;  /* device: the image */
  size_t bytes;  /* its size */
};

static pthread_mutex_t dev_lock = PTHREAD_MUTEX_INITIALIZER; /* makers of copies */

static struct kvp__kvq_dev *dev_get(const void *inst) {
  return __atomic_load_n(kvp__kvq_dev_slot(inst), __ATOMIC_ACQUIRE);
}

int kvp__kvq_dev_prepare(const void *inst) {
  if (dev_get(inst)) return KVP_OK;
  uint32_t D = kvp__kvq_head_dim(inst);
  if (D > KVP__KVQ_DEV_MAX_DIM)
    return kvp__err(KVP_ENOTSUP, "kvquant: head_dim %u on the device: its kernels hold a token in one warp, at most %u "
                    "channels (a host region takes any head_dim)", D, KVP__KVQ_DEV_MAX_DIM);
  pthread_mutex_lock(&dev_lock);
  int rc = KVP_OK;
  if (!dev_get(inst)) {
    size_t bytes = kvp__kvq_dev_image(inst, NULL);
    void *img = malloc(bytes), *dp = NULL;
    struct kvp__kvq_dev *d = malloc(sizeof *d);
    cudaError_t e = cudaSuccess;
    if (!img || !d) {
      rc = kvp__err(KVP_ENOMEM, "kvquant: host staging of its %zu bytes of device tables", bytes);
    } else {
      kvp__kvq_dev_image(inst, img);
      e = cudaMalloc(&dp, bytes);
      if (e == cudaSuccess) e = cudaMemcpy(dp, img, bytes, cudaMemcpyHostToDevice);
      if (e != cudaSuccess) {
        if (dp) cudaFree(dp);
        cudaGetLastError();
        rc = kvp__err(KVP_EDEVICE, "kvquant: copying its %zu bytes of calibration tables to the device: %s (%s)", bytes,
                      cudaGetErrorString(e), cudaGetErrorName(e));
      }
    }
    if (!rc) {
      d->tables = dp;
      d->bytes = bytes;
      __atomic_store_n(kvp__kvq_dev_slot(inst), d, __ATOMIC_RELEASE);
      d = NULL;
    }
    free(img);
    free(d);
  }
  pthread_mutex_unlock(&dev_lock);
  return rc;
}

uint64_t kvp__kvq_dev_bytes(const void *inst) {
  const struct kvp__kvq_dev *d = dev_get(inst);
  return d ? d->bytes : 0;
}

void kvp__kvq_dev_release(struct kvp__kvq_dev *d) {
  if (!d) return;
  cudaFree(d->tables);
  free(d);
}

/* A job the kernels can run: 1 <= cap <= 65536, rows in the block, a head
 * the tables have. */
static int job_ok(uint32_t H, const kvp_codec_dev_job *j, uint32_t i, bool enc) {
  const char *what = enc ? "encode" : "decode";
  if (j->cap_tokens < 1 || j->cap_tokens > 65536 || j->n > j->cap_tokens || (uint64_t)j->t0 + j->m > j->n ||
      (enc && j->t0 + j->m != j->n))
    return kvp__err(KVP_EINVAL, "kvquant device %s: job %u: rows [%u, %u) of a block of %u tokens holding %u", what, i,
                    j->t0, (unsigned)((uint64_t)j->t0 + j->m), j->cap_tokens, j->n);
  if (j->head >= H)
    return kvp__err(KVP_EINVAL, "kvquant device %s: job %u: head %u >= the calibration's %u heads", what, i, j->head, H);
  if (j->m && (!j->pages[0] || (enc ? !j->src : !j->dst)))
    return kvp__err(KVP_EINVAL, "kvquant device %s: job %u: a NULL page or %s", what, i, enc ? "src" : "dst");
  return KVP_OK;
}

/* The tables on the device and the kernels' parameters; jobs checked. */
static int prepare(const void *inst, const kvp_codec_dev_job *jobs, uint32_t njobs, bool enc, kvp__kvq_kparams *k) {
  int rc = kvp__kvq_dev_prepare(inst);
  if (rc) return rc;
  kvp__kvq_kparams_fill(inst, dev_get(inst)->tables, k);
  for (uint32_t i = 0; !rc && i < njobs; i++) rc = job_ok(k->n_heads, &jobs[i], i, enc);
  return rc;
}

int kvp__kvq_encode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                        uint32_t njobs, uint64_t *status, void *stream) {
  kvp__kvq_kparams k;
  int rc = prepare(inst, jobs, njobs, true, &k);
  if (rc) return rc;
  int e = kvp__kern_kvq_encode(&k, jobs, jobs_dev, njobs, status, stream);
  return e ? kvp__err(KVP_EDEVICE, "kvquant device encode of %u blocks: %s", njobs, kvp__kern_errstr(e)) : KVP_OK;
}

int kvp__kvq_decode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                        uint32_t njobs, kvp_dtype out, void *stream) {
  kvp__kvq_kparams k;
  if (out != KVP_DTYPE_F32 && out != KVP_DTYPE_BF16 && out != KVP_DTYPE_F16)
    return kvp__err(KVP_EINVAL, "kvquant device decode: out dtype %d is not a kvp_dtype", (int)out);
  int rc = prepare(inst, jobs, njobs, false, &k);
  if (rc) return rc;
  int e = kvp__kern_kvq_decode(&k, jobs, jobs_dev, njobs, (uint32_t)out, stream);
  return e ? kvp__err(KVP_EDEVICE, "kvquant device decode of %u blocks: %s", njobs, kvp__kern_errstr(e)) : KVP_OK;
}
