/*
 * pages/device_cuda.c - the pool's device path on a CUDA region: the jobs
 * of an append run by the codecs' device ops, the status words read back
 * once per append, device reads, and the paged gather (kvp_gather).
 *
 * Host code plans and accounts; the device computes. pages/stream.c plans
 * an append, reserves and carves its pages exactly as on a host region,
 * and hands each block write here as a kvp_codec_dev_job. Per layer:
 *
 *   cudaMemsetAsync(status words = KVP_DEV_STATUS_OK)
 *   encode_dev(RAW tail K) encode_dev(RAW tail V)   rows into OPEN blocks
 *   encode_dev(codec K)    encode_dev(codec V)      sealed blocks, reseals
 *   cudaMemcpyAsync(status words -> pinned host); cudaStreamSynchronize
 *
 * all on the caller's stream; the one wait tells a bad input before the
 * append is published (pages/stream.c frees the pages then). No device
 * memory is allocated per call: the jobs ride in kernel parameters
 * (kernels/codec.cu) and the status words are the pool's (4 x 8 bytes,
 * cudaMalloc'd at create). The gather's block table goes into the
 * caller's workspace.
 *
 * Freed pages are reused only after the device drained (the CUDA region's
 * quiesce, alloc/region_cuda.c), so a read or gather enqueued before an
 * eviction still finds its bytes.
 */
#include "../codecs/builtin.h"
#include "../codecs/numeric.h"
#include "pages.h"

#include <cuda_runtime_api.h>
#include <string.h>

struct kvp__dev {
  uint64_t *status;      /* device: 4 status words, one per group of an append */
  uint64_t *host_status; /* pinned host: their copy */
};

static int cuda_fail(cudaError_t e, const char *what) {
  return kvp__err(KVP_EDEVICE, "%s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/* Run the calls of a scope on the pool's device; restore the caller's. */
static int dev_enter(const kvp_pool *pool, int *prev) {
  cudaGetDevice(prev);
  if (*prev == pool->cfg.device) return KVP_OK;
  cudaError_t e = cudaSetDevice(pool->cfg.device);
  return e == cudaSuccess ? KVP_OK : cuda_fail(e, "cudaSetDevice");
}
static void dev_leave(const kvp_pool *pool, int prev) {
  if (prev != pool->cfg.device) cudaSetDevice(prev);
}

int kvp__dev_init(kvp_pool *pool) {
  int prev, rc = dev_enter(pool, &prev);
  if (rc) return rc;
  struct kvp__dev *d = kvp__meta_calloc(&pool->meta, sizeof *d);
  if (!d) {
    dev_leave(pool, prev);
    return kvp__err(KVP_ENOMEM, "device control block");
  }
  cudaError_t e = cudaMalloc((void **)&d->status, 4 * sizeof(uint64_t));
  if (e == cudaSuccess) e = cudaMallocHost((void **)&d->host_status, 4 * sizeof(uint64_t));
  dev_leave(pool, prev);
  if (e != cudaSuccess) {
    cudaFree(d->status);
    kvp__meta_free(&pool->meta, d, sizeof *d);
    cudaGetLastError();
    return cuda_fail(e, "the pool's device status words");
  }
  pool->dev = d;
  return KVP_OK;
}

void kvp__dev_fini(kvp_pool *pool) {
  struct kvp__dev *d = pool->dev;
  if (!d) return;
  int prev;
  dev_enter(pool, &prev);
  cudaFree(d->status);
  cudaFreeHost(d->host_status);
  dev_leave(pool, prev);
  kvp__meta_free(&pool->meta, d, sizeof *d);
  pool->dev = NULL;
}

/* ---- append batches ------------------------------------------------------ */

void kvp__dev_batch_init(kvp__dev_batch *db, uint32_t max_jobs_per_group, kvp__meta *meta) {
  memset(db, 0, sizeof *db);
  db->cap = max_jobs_per_group ? max_jobs_per_group : 1;
  db->meta = meta;
}

static int group_of(const kvp_pool *pool, const kvp__binding *bd, int kv) {
  return bd == &pool->tail[kv] ? kv : 2 + kv;
}

int kvp__dev_batch_add(kvp_pool *pool, kvp__dev_batch *db, const kvp__binding *bd, int kv, const kvp_codec_dev_job *j) {
  kvp__dev_group *g = &db->g[group_of(pool, bd, kv)];
  if (!g->jobs) {
    if (!(g->jobs = kvp__meta_alloc(db->meta, db->cap * sizeof *g->jobs)))
      return kvp__err(KVP_ENOMEM, "device jobs of an append (%u blocks)", db->cap);
    g->cap = db->cap;
    g->bd = bd;
    g->kv = kv;
  }
  kvp__assert(g->n < g->cap && g->bd == bd);
  g->jobs[g->n++] = *j;
  return KVP_OK;
}

void kvp__dev_batch_fini(kvp_pool *pool, kvp__dev_batch *db) {
  (void)pool;
  for (int i = 0; i < 4; i++) kvp__meta_free(db->meta, db->g[i].jobs, db->g[i].cap * sizeof *db->g[i].jobs);
  memset(db, 0, sizeof *db);
}

/* The message of a status word of group g. */
static int bad_input(kvp_pool *pool, const kvp__dev_group *g, uint64_t st, uint32_t layer, uint32_t pos) {
  uint32_t kind = (uint32_t)(st >> 60), job = (uint32_t)(st >> 32 & 0x0FFFFFFFu), elem = (uint32_t)st;
  uint32_t D = pool->cfg.head_dim;
  if (job >= g->n) return kvp__err(KVP_EDEVICE, "device status word 0x%016llx names no job", (unsigned long long)st);
  const kvp_codec_dev_job *j = &g->jobs[job];
  uint32_t at = j->pos0 + elem / D;
  char tok[64] = "";
  if (at >= pos) snprintf(tok, sizeof tok, "token %u (of the step), ", at - pos);
  if (kind == KVP_DEV_BAD_NONFINITE)
    return kvp__err(KVP_EINVAL, "%c of layer %u has NaN or Inf at head %u, %schannel %u (position %u; device input: "
                                "a CUDA pool refuses non-finite K/V)", "KV"[g->kv], layer, j->head, tok, elem % D, at);
  return kvp__err(KVP_ECODEC, "codec %s cannot represent %c of layer %u at head %u, %schannel %u (position %u): the "
                              "value is beyond its format's range", g->bd->vt->name, "KV"[g->kv], layer, j->head, tok,
                  elem % D, at);
}

int kvp__dev_batch_run(kvp_pool *pool, kvp__dev_batch *db, uint32_t layer, uint32_t pos, void *stream) {
  struct kvp__dev *d = pool->dev;
  int prev, rc = dev_enter(pool, &prev);
  if (rc) return rc;
  cudaStream_t s = (cudaStream_t)stream;
  cudaError_t e = cudaMemsetAsync(d->status, 0xFF, 4 * sizeof(uint64_t), s);
  if (e != cudaSuccess) rc = cuda_fail(e, "cudaMemsetAsync (append status)");
  for (int i = 0; !rc && i < 4; i++) {
    kvp__dev_group *g = &db->g[i];
    if (g->n) rc = g->bd->vt->encode_dev(g->bd->inst, g->jobs, g->n, d->status + i, stream);
  }
  if (!rc && (e = cudaMemcpyAsync(d->host_status, d->status, 4 * sizeof(uint64_t), cudaMemcpyDeviceToHost, s)))
    rc = cuda_fail(e, "cudaMemcpyAsync (append status)");
  /* wait even after a failed launch: the pages may be freed next */
  if ((e = cudaStreamSynchronize(s)) != cudaSuccess && !rc) rc = cuda_fail(e, "the append's kernels");
  dev_leave(pool, prev);
  for (int i = 0; !rc && i < 4; i++)
    if (d->host_status[i] != KVP_DEV_STATUS_OK) rc = bad_input(pool, &db->g[i], d->host_status[i], layer, pos);
  return rc;
}

/* ---- reads ------------------------------------------------------------------ */

static int decode_group(kvp_pool *pool, kvp__dev_group *g, kvp_dtype out, void *stream) {
  int rc = g->n ? g->bd->vt->decode_dev(g->bd->inst, g->jobs, g->n, out, stream) : KVP_OK;
  if (rc && rc != KVP_EDEVICE)
    rc = kvp__err(rc, "codec %s failed to decode %u blocks on the device (status %d)", g->bd->vt->name, g->n, rc);
  g->n = 0;
  (void)pool;
  return rc;
}

int kvp__dev_read_add(kvp_pool *pool, kvp__dev_batch *db, const kvp__binding *bd, int kv, const kvp_codec_dev_job *j,
                      kvp_dtype out, void *stream) {
  kvp__dev_group *g = &db->g[group_of(pool, bd, kv)];
  if (g->jobs && g->n == g->cap) {
    int rc = decode_group(pool, g, out, stream);
    if (rc) return rc;
  }
  return kvp__dev_batch_add(pool, db, bd, kv, j);
}

int kvp__dev_read_flush(kvp_pool *pool, kvp__dev_batch *db, kvp_dtype out, void *stream) {
  int prev, rc = dev_enter(pool, &prev);
  for (int i = 0; !rc && i < 4; i++) rc = decode_group(pool, &db->g[i], out, stream);
  dev_leave(pool, prev);
  return rc;
}

/* ---- the paged gather ------------------------------------------------------ */

uint64_t kvp__dev_gather_bytes(uint64_t njobs) { return njobs * sizeof(kvp_codec_dev_job); }

int kvp__dev_gather_begin(kvp_pool *pool, kvp__dev_gather *g, const kvp_gather_req *req, uint64_t max_jobs) {
  uint32_t L = pool->cfg.n_layers;
  memset(g, 0, sizeof *g);
  g->req = req;
  g->cap = max_jobs ? max_jobs : 1;
  g->jobs = kvp__meta_alloc(NULL, g->cap * sizeof *g->jobs);
  g->tags = kvp__meta_alloc(NULL, g->cap * sizeof *g->tags);
  g->seg_of_layer = kvp__meta_alloc(NULL, L * sizeof *g->seg_of_layer);
  g->seg_layer = kvp__meta_alloc(NULL, L * sizeof *g->seg_layer);
  if (!g->jobs || !g->tags || !g->seg_of_layer || !g->seg_layer) {
    if (!g->jobs) g->jobs = (kvp_codec_dev_job *)g; /* so that end frees the rest */
    kvp__dev_gather_end(pool, g);
    return kvp__err(KVP_ENOMEM, "gather table of %llu blocks", (unsigned long long)max_jobs);
  }
  for (uint32_t l = 0; l < L; l++) g->seg_of_layer[l] = UINT32_MAX;
  return KVP_OK;
}

void kvp__dev_gather_end(kvp_pool *pool, kvp__dev_gather *g) {
  uint32_t L = pool->cfg.n_layers;
  if (g->jobs != (kvp_codec_dev_job *)g) kvp__meta_free(NULL, g->jobs, g->cap * sizeof *g->jobs);
  kvp__meta_free(NULL, g->tags, g->cap * sizeof *g->tags);
  kvp__meta_free(NULL, g->seg_of_layer, L * sizeof *g->seg_of_layer);
  kvp__meta_free(NULL, g->seg_layer, L * sizeof *g->seg_layer);
  memset(g, 0, sizeof *g);
}

uint32_t kvp__dev_gather_segment(kvp__dev_gather *g, uint32_t layer) {
  if (g->seg_of_layer[layer] == UINT32_MAX) {
    g->seg_layer[g->nseg] = layer;
    g->seg_of_layer[layer] = g->nseg++;
  }
  return g->seg_of_layer[layer];
}

void kvp__dev_gather_add(kvp__dev_gather *g, uint32_t seg, uint32_t group, const kvp_codec_dev_job *j) {
  if (g->n == g->cap) return; /* bounded by the counting pass; cannot happen */
  g->jobs[g->n] = *j;
  g->tags[g->n++] = seg * 4 + group;
}

int kvp__dev_gather_zero(kvp_pool *pool, kvp__dev_gather *g, uint32_t row0, uint32_t n) {
  size_t row = (size_t)pool->cfg.n_kv_heads * pool->cfg.head_dim * 2;
  cudaStream_t s = (cudaStream_t)g->req->stream;
  int prev, rc = dev_enter(pool, &prev);
  if (rc) return rc;
  cudaError_t e = cudaMemsetAsync((char *)g->req->k_out + row0 * row, 0, n * row, s);
  if (e == cudaSuccess) e = cudaMemsetAsync((char *)g->req->v_out + row0 * row, 0, n * row, s);
  dev_leave(pool, prev);
  return e == cudaSuccess ? KVP_OK : cuda_fail(e, "cudaMemsetAsync (gather padding)");
}

/* Launch one segment: its four groups at table[0..end[3]). */
static int gather_segment(kvp_pool *pool, kvp__dev_gather *g, uint32_t seg, const kvp_codec_dev_job *host,
                          const kvp_codec_dev_job *dev, const uint32_t end[4]) {
  uint32_t layer = g->seg_layer[seg];
  const kvp__binding *bd[4] = {&pool->bind[2 * layer], &pool->tail[0], &pool->bind[2 * layer + 1], &pool->tail[1]};
  kvp__kparams p[4];
  bool builtin = true;
  for (int i = 0; i < 4; i++) builtin &= kvp__codec_kparams(bd[i]->vt, bd[i]->inst, &p[i]) == KVP_OK;
  void *stream = g->req->stream;
  if (builtin) {
    int e = kvp__kern_gather(p, end, dev, stream);
    if (e) return kvp__err(KVP_EDEVICE, "gather kernel of layer %u: %s", layer, kvp__kern_errstr(e));
    ((kvp_gather_req *)g->req)->n_launches++;
    return KVP_OK;
  }
  /* a third-party device codec: its own decode_dev, group by group */
  for (int i = 0, at = 0; i < 4; at = end[i++]) {
    if (end[i] == (uint32_t)at) continue;
    int rc = bd[i]->vt->decode_dev(bd[i]->inst, host + at, end[i] - at, KVP_DTYPE_BF16, stream);
    if (rc) return rc == KVP_EDEVICE ? rc : kvp__err(rc, "codec %s failed to decode for the gather", bd[i]->vt->name);
    ((kvp_gather_req *)g->req)->n_launches += (end[i] - at + KVP__KERN_JOBS_PER_LAUNCH - 1) / KVP__KERN_JOBS_PER_LAUNCH;
  }
  return KVP_OK;
}

int kvp__dev_gather_run(kvp_pool *pool, kvp__dev_gather *g) {
  if (!g->n) return KVP_OK;
  uint32_t nb = g->nseg * 4;
  uint64_t *start = kvp__meta_calloc(NULL, (nb + 1) * sizeof *start);
  kvp_codec_dev_job *table = kvp__meta_alloc(NULL, g->n * sizeof *table);
  int rc = start && table ? KVP_OK : kvp__err(KVP_ENOMEM, "gather table of %llu blocks", (unsigned long long)g->n);
  if (!rc) { /* counting sort by (segment, group), stable */
    for (uint64_t i = 0; i < g->n; i++) start[g->tags[i] + 1]++;
    for (uint32_t b = 0; b < nb; b++) start[b + 1] += start[b];
    uint64_t *at = kvp__meta_alloc(NULL, nb * sizeof *at);
    if (!at) rc = kvp__err(KVP_ENOMEM, "gather scratch");
    else {
      memcpy(at, start, nb * sizeof *at);
      for (uint64_t i = 0; i < g->n; i++) table[at[g->tags[i]]++] = g->jobs[i];
      kvp__meta_free(NULL, at, nb * sizeof *at);
    }
  }
  int prev = 0;
  if (!rc) rc = dev_enter(pool, &prev);
  if (!rc) {
    cudaError_t e = cudaMemcpyAsync(g->req->workspace, table, g->n * sizeof *table, cudaMemcpyHostToDevice,
                                    (cudaStream_t)g->req->stream);
    if (e != cudaSuccess) rc = cuda_fail(e, "cudaMemcpyAsync (gather block table)");
    for (uint32_t seg = 0; !rc && seg < g->nseg; seg++) {
      uint64_t s0 = start[seg * 4];
      uint32_t end[4];
      for (int i = 0; i < 4; i++) end[i] = (uint32_t)(start[seg * 4 + i + 1] - s0);
      rc = gather_segment(pool, g, seg, table + s0, (const kvp_codec_dev_job *)g->req->workspace + s0, end);
    }
    /* the table was copied from pageable memory: staged before the call returned */
    dev_leave(pool, prev);
  }
  kvp__meta_free(NULL, start, (nb + 1) * sizeof *start);
  kvp__meta_free(NULL, table, g->n * sizeof *table);
  return rc;
}
