/*
 * codecs/qvg_cuda.c - QVG's device ops, host side: the jobs checked,
 * ordered and launched (kernels/qvg.cu), with their scratch and their
 * streams' warm-start states. Built only with CUDA.
 *
 * k-means needs scratch per block (kvp__qvg_ws_bytes: f32 centroids, a
 * word per row), and each stream's state (the last block's centroids,
 * codecs/qvg.c's layout) is read and rewritten by its next block. Two
 * callers:
 *
 *   the pool (kvp__qvg_encode_pool): states stay in host memory, where the
 *     host codec keeps them (forks copy them, the store tier writes them,
 *     kvp_check counts them: bytes.codec_state), and cross to the pool's
 *     device workspace around each encode; the workspace, sized at create
 *     for one append of the layer's largest blocks, is device.control_bytes;
 *   the codec alone (encode_dev): a job's dst is its state in DEVICE
 *     memory (or NULL: a cold start, nothing kept), and the scratch is the
 *     instance's, made at the first call and grown when a call needs more
 *     (never on a pool's path); freed with the instance.
 *
 * Jobs that share a state (blocks of one stream in one append) run in
 * order: job i goes in launch "level" = how many earlier jobs share its
 * state, levels one after another on the stream, so each block starts from
 * the centroids of the one before it, as on the host.
 *
 *   ws (pool path)   [ state 0 | state 1 | ... ] [ scratch of a wave of jobs ]
 *                     256-byte aligned slots       kvp__qvg_ws_bytes(cap) each
 */
#include "builtin.h"

#include <cuda_runtime_api.h>
#include <pthread.h>

struct kvp__qvg_dev {
  void *ws;       /* device scratch */
  uint64_t bytes; /* its size */
};

static pthread_mutex_t dev_lock = PTHREAD_MUTEX_INITIALIZER; /* growers of an instance's scratch */

bool kvp__codec_is_qvg(const kvp_codec_vtable *vt) { return vt == &kvp__codec_qvg || vt == &kvp__codec_qvg_pro; }

void kvp__qvg_dev_release(struct kvp__qvg_dev *d) {
  if (!d) return;
  cudaFree(d->ws);
  free(d);
}

static uint64_t up256(uint64_t x) { return (x + 255) & ~(uint64_t)255; }

uint64_t kvp__qvg_pool_ws_bytes(const void *inst, uint32_t njobs, uint32_t nstates, uint32_t cap) {
  kvp__qvg_kparams k;
  kvp__qvg_kparams_of(inst, &k);
  return nstates * up256(kvp__qvg_state_bytes(inst)) + (uint64_t)njobs * up256(kvp__qvg_ws_bytes(&k, cap));
}

/* A job the kernels take: a whole block (t0 = 0, m = n <= cap <= 65536),
 * its pages, its rows. */
static int job_ok(const char *name, const kvp__qvg_kparams *k, const kvp_codec_dev_job *j, uint32_t i, bool enc) {
  const char *what = enc ? "encode" : "decode";
  if (k->head_dim > KVP__QVG_DEV_MAX_DIM)
    return kvp__err(KVP_ENOTSUP, "%s device %s: head_dim %u: the kernels take at most %u (a host region takes any)",
                    name, what, k->head_dim, KVP__QVG_DEV_MAX_DIM);
  if (j->cap_tokens < 1 || j->cap_tokens > 65536 || j->n > j->cap_tokens || (uint64_t)j->t0 + j->m > j->n ||
      (enc && (j->t0 != 0 || j->m != j->n)))
    return kvp__err(KVP_EINVAL, "%s device %s: job %u: rows [%u, %u) of a block of %u tokens holding %u (an encode "
                    "writes a whole block)", name, what, i, j->t0, (unsigned)((uint64_t)j->t0 + j->m), j->cap_tokens,
                    j->n);
  for (uint32_t p = 0; p < (k->stages ? 4u : 2u); p++)
    if (!j->pages[p]) return kvp__err(KVP_EINVAL, "%s device %s: job %u: page %u is NULL", name, what, i, p);
  if (j->m && (enc ? !j->src : !j->dst))
    return kvp__err(KVP_EINVAL, "%s device %s: job %u: a NULL %s", name, what, i, enc ? "src" : "dst");
  return KVP_OK;
}

/* The kernels' parameters; every job checked; the largest capacity. */
static int encode_jobs_ok(const void *inst, const kvp_codec_dev_job *jobs, uint32_t njobs, kvp__qvg_kparams *k,
                          uint32_t *maxcap) {
  kvp__qvg_kparams_of(inst, k);
  *maxcap = 1;
  for (uint32_t i = 0; i < njobs; i++) {
    int rc = job_ok(kvp__qvg_name(inst), k, &jobs[i], i, true);
    if (rc) return rc;
    *maxcap = jobs[i].cap_tokens > *maxcap ? jobs[i].cap_tokens : *maxcap;
  }
  return KVP_OK;
}

static int launch_fail(const char *name, const char *what, uint32_t njobs, int e) {
  return kvp__err(KVP_EDEVICE, "%s device %s of %u blocks: %s", name, what, njobs, kvp__kern_errstr(e));
}

/* Launch jobs level by level: level[i] = earlier jobs with the same key
 * (a state); keys NULL never wait. tmp and idx: njobs entries of scratch. */
static int run_levels(const char *name, const kvp__qvg_kparams *k, const kvp_codec_dev_job *jobs,
                      const void *const *key, uint32_t njobs, kvp_codec_dev_job *tmp, uint32_t *idx, uint32_t *level,
                      void *ws, uint64_t ws_bytes, uint64_t *status, void *stream) {
  uint32_t top = 0;
  for (uint32_t i = 0; i < njobs; i++) {
    level[i] = 0;
    for (uint32_t j = 0; key[i] && j < i; j++) level[i] += key[j] == key[i];
    top = level[i] > top ? level[i] : top;
  }
  for (uint32_t lv = 0; lv <= top && njobs; lv++) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < njobs; i++)
      if (level[i] == lv) tmp[n] = jobs[i], idx[n++] = i;
    int e = kvp__kern_qvg_encode(k, tmp, idx, n, ws, ws_bytes, status, stream);
    if (e) return launch_fail(name, "encode", njobs, e);
  }
  return KVP_OK;
}

/* Host scratch of a call: copies of the jobs, their indices, levels, keys. */
typedef struct call_scratch {
  kvp_codec_dev_job *tmp;
  uint32_t *idx, *level;
  const void **key;
} call_scratch;
static int scratch_get(const char *name, call_scratch *c, uint32_t njobs) {
  size_t n = njobs ? njobs : 1;
  c->tmp = malloc(n * sizeof *c->tmp);
  c->idx = malloc(n * sizeof *c->idx);
  c->level = malloc(n * sizeof *c->level);
  c->key = malloc(n * sizeof *c->key);
  if (c->tmp && c->idx && c->level && c->key) return KVP_OK;
  free(c->tmp), free(c->idx), free(c->level), free(c->key);
  return kvp__err(KVP_ENOMEM, "%s device encode: host scratch for %u jobs", name, njobs);
}
static void scratch_put(call_scratch *c) { free(c->tmp), free(c->idx), free(c->level), free(c->key); }

int kvp__qvg_encode_pool(const void *inst, const kvp_codec_dev_job *jobs, void *const *hstates, uint32_t njobs,
                         void *ws, uint64_t ws_bytes, uint64_t *status, void *stream) {
  const char *name = kvp__qvg_name(inst);
  kvp__qvg_kparams k;
  uint32_t maxcap;
  int rc = encode_jobs_ok(inst, jobs, njobs, &k, &maxcap);
  if (rc || !njobs) return rc;
  call_scratch c;
  if ((rc = scratch_get(name, &c, njobs))) return rc;
  /* distinct states, each a slot of ws */
  uint64_t sb = up256(kvp__qvg_state_bytes(inst));
  const void **slot_of = c.key; /* key[i]: job i's host state (its identity) */
  uint32_t nslots = 0;
  for (uint32_t i = 0; i < njobs; i++) {
    slot_of[i] = hstates && k.stages ? hstates[i] : NULL;
    bool seen = false;
    for (uint32_t j = 0; slot_of[i] && j < i && !seen; j++) seen = slot_of[j] == slot_of[i];
    nslots += slot_of[i] && !seen;
  }
  uint64_t need = nslots * sb + up256(kvp__qvg_ws_bytes(&k, maxcap));
  if (need > ws_bytes) {
    scratch_put(&c);
    return kvp__err(KVP_ENOTSUP, "%s device encode: %u blocks of up to %u tokens with %u stream states need %llu bytes "
                    "of the pool's workspace, which holds %llu", name, njobs, maxcap, nslots,
                    (unsigned long long)need, (unsigned long long)ws_bytes);
  }
  /* the state slots: slot s at ws + s * sb, in order of first use */
  cudaStream_t s = (cudaStream_t)stream;
  cudaError_t e = cudaSuccess;
  uint8_t *base = ws;
  for (uint32_t i = 0, used = 0; i < njobs; i++) {
    c.tmp[i] = jobs[i];
    c.tmp[i].dst = NULL;
    if (!slot_of[i]) continue;
    uint32_t at = used;
    for (uint32_t j = 0; j < i; j++)
      if (slot_of[j] == slot_of[i]) {
        at = (uint32_t)(((uint8_t *)c.tmp[j].dst - base) / sb);
        break;
      }
    c.tmp[i].dst = base + at * sb;
    if (at == used) {
      used++;
      if (e == cudaSuccess)
        e = cudaMemcpyAsync(c.tmp[i].dst, slot_of[i], kvp__qvg_state_bytes(inst), cudaMemcpyHostToDevice, s);
    }
  }
  if (e != cudaSuccess) rc = kvp__err(KVP_EDEVICE, "%s device encode: copying stream states to the device: %s", name,
                                      cudaGetErrorString(e));
  /* run_levels reads its jobs from a copy: tmp is reused for each level */
  kvp_codec_dev_job *jl = rc ? NULL : malloc(njobs * sizeof *jl);
  if (!rc && !jl) rc = kvp__err(KVP_ENOMEM, "%s device encode: host scratch for %u jobs", name, njobs);
  if (!rc) {
    memcpy(jl, c.tmp, njobs * sizeof *jl);
    rc = run_levels(name, &k, jl, slot_of, njobs, c.tmp, c.idx, c.level, base + nslots * sb,
                    ws_bytes - nslots * sb, status, stream);
  }
  for (uint32_t i = 0; !rc && i < njobs; i++) { /* each state back, once, after its last block */
    bool later = false;
    for (uint32_t j = i + 1; slot_of[i] && j < njobs && !later; j++) later = slot_of[j] == slot_of[i];
    if (slot_of[i] && !later &&
        (e = cudaMemcpyAsync((void *)slot_of[i], jl[i].dst, kvp__qvg_state_bytes(inst), cudaMemcpyDeviceToHost, s)))
      rc = kvp__err(KVP_EDEVICE, "%s device encode: copying stream states back: %s", name, cudaGetErrorString(e));
  }
  free(jl);
  scratch_put(&c);
  return rc;
}

/* The instance's own scratch, at least bytes (the codec used alone). */
static int own_ws(const void *inst, const char *name, uint64_t bytes, struct kvp__qvg_dev **out) {
  struct kvp__qvg_dev **slot = kvp__qvg_dev_slot(inst);
  pthread_mutex_lock(&dev_lock);
  int rc = KVP_OK;
  if (!*slot || (*slot)->bytes < bytes) {
    struct kvp__qvg_dev *d = malloc(sizeof *d);
    void *ws = NULL;
    cudaError_t e = d ? cudaMalloc(&ws, bytes) : cudaSuccess;
    if (!d || e != cudaSuccess) {
      free(d);
      cudaGetLastError();
      rc = kvp__err(d ? KVP_EDEVICE : KVP_ENOMEM, "%s device encode: %llu bytes of k-means scratch: %s", name,
                    (unsigned long long)bytes, d ? cudaGetErrorString(e) : "out of host memory");
    } else {
      d->ws = ws, d->bytes = bytes;
      if (*slot) { /* the old scratch may still be in use on some stream */
        cudaDeviceSynchronize();
        kvp__qvg_dev_release(*slot);
      }
      *slot = d;
    }
  }
  *out = *slot;
  pthread_mutex_unlock(&dev_lock);
  return rc;
}

int kvp__qvg_encode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                        uint32_t njobs, uint64_t *status, void *stream) {
  (void)jobs_dev; /* the kernels take their jobs in parameters: levels reorder them */
  const char *name = kvp__qvg_name(inst);
  kvp__qvg_kparams k;
  uint32_t maxcap;
  int rc = encode_jobs_ok(inst, jobs, njobs, &k, &maxcap);
  if (rc || !njobs) return rc;
  struct kvp__qvg_dev *d;
  uint32_t wave = njobs < 64 ? njobs : 64;
  if ((rc = own_ws(inst, name, wave * up256(kvp__qvg_ws_bytes(&k, maxcap)), &d))) return rc;
  call_scratch c;
  if ((rc = scratch_get(name, &c, njobs))) return rc;
  for (uint32_t i = 0; i < njobs; i++) c.key[i] = k.stages ? jobs[i].dst : NULL;
  rc = run_levels(name, &k, jobs, c.key, njobs, c.tmp, c.idx, c.level, d->ws, d->bytes, status, stream);
  scratch_put(&c);
  return rc;
}

int kvp__qvg_decode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                        uint32_t njobs, kvp_dtype out, void *stream) {
  const char *name = kvp__qvg_name(inst);
  if (out != KVP_DTYPE_F32 && out != KVP_DTYPE_BF16 && out != KVP_DTYPE_F16)
    return kvp__err(KVP_EINVAL, "%s device decode: out dtype %d is not a kvp_dtype", name, (int)out);
  kvp__qvg_kparams k;
  kvp__qvg_kparams_of(inst, &k);
  int rc = KVP_OK;
  for (uint32_t i = 0; !rc && i < njobs; i++) rc = job_ok(name, &k, &jobs[i], i, false);
  if (rc) return rc;
  int e = kvp__kern_qvg_decode(&k, jobs, jobs_dev, njobs, (uint32_t)out, stream);
  return e ? launch_fail(name, "decode", njobs, e) : KVP_OK;
}
