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
 * append is published (pages/stream.c frees the pages then). With
 * KVP_POOL_DEVICE_ASYNC an append whose codecs fail on non-finite input
 * only (raw, fp8, int8, nvfp4) skips the status and the wait: its kernels
 * report into 4 other words nobody reads, and the job stage is rewritten
 * only once the event after its last copy passed. No device
 * memory is allocated per call: the jobs ride in kernel parameters
 * (kernels/codec.cu) and the status words are the pool's (4 x 8 bytes,
 * cudaMalloc'd at create), as are the bindings' device tables (kvquant's
 * calibration, copied once at create). The gather's block table goes into
 * the caller's workspace.
 *
 * Freed pages are reused only after the device drained (the CUDA region's
 * quiesce, alloc/region_cuda.c), so a read or gather enqueued before an
 * eviction still finds its bytes.
 */
#include "../codecs/builtin.h"
#include "../codecs/numeric.h"
#include "pages.h"

#include <cuda_runtime_api.h>
#include <pthread.h>
#include <string.h>

/* Appends of more than this many jobs in a group stage them in the pool's
 * device table (one copy, one launch); fewer ride in kernel parameters. */
#define STAGE_MIN_JOBS 64u
#define STAGE_JOBS 8192u /* jobs the staging table holds (640 KiB) */

/* Pinned stages for gather and attention tables, GSTAGES taken in turn, so
 * that a call builds its table while the kernels of the calls before still
 * read theirs in place (kvp__dev_attend_run): a call waits only for the
 * kernels of the call GSTAGES before it, so the host runs that many
 * layers' calls ahead of the device instead of draining its queue at each
 * (the serving engine's own launches go on queueing meanwhile). A kept
 * attention table read in place takes none: it waits only for its own
 * layer's kernels of the call before (pages/attend_kept.c). */
#define GSTAGES 4
typedef struct gstage_slot {
  pthread_mutex_t lock;           /* held by the gather that builds in the stage */
  kvp__gjob *buf;                 /* pinned host: cap gather records */
  uint64_t cap;                   /* records it holds (grows by doubling, up to GSTAGE_MAX_BYTES) */
  void *old[24];                  /* outgrown stages, freed at pool destroy (cudaFreeHost may
                                     synchronize the device: never on a call's path) */
  uint32_t n_old;
  cudaEvent_t done;               /* recorded after the last copy from the stage (after the kernels
                                     where they read it in place: kvp__dev_attend_run) */
} gstage_slot;

struct kvp__dev {
  gstage_slot gs[GSTAGES];        /* the pinned stages */
  uint32_t gnext;                 /* the stage a call tries first, modulo GSTAGES (atomic) */
  uint64_t pinned_bytes;          /* pinned host bytes held (atomic: stats read it beside a growing call) */
  uint64_t *status;              /* device: 8 status words: one per group of an append, then 4 that
                                    asynchronous appends write and nobody reads (KVP_POOL_DEVICE_ASYNC) */
  uint64_t *host_status;         /* pinned host: their copy */
  kvp_codec_dev_job *stage_dev;  /* device: staged job tables of an append */
  kvp_codec_dev_job *stage_host; /* pinned host: what is copied there */
  cudaEvent_t stage_done;        /* recorded after the last copy from stage_host */
  uint32_t sms;                  /* streaming multiprocessors of the device */
  uint32_t attend_occ[KVP__KERN_ATTEND_KINDS]; /* attention thread blocks per SM, per kernel kind */
  void *qvg_ws;                  /* device: qvg's k-means scratch and staged stream states, or NULL */
  uint64_t qvg_ws_bytes;         /* its size: one append of the largest qvg layer (dev_prepare_bindings) */
};

static int gstage_init(struct kvp__dev *d);
static void gstage_fini(struct kvp__dev *d);

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

/* qvg's workspace, shared by its bindings (appends run one at a time and
 * wait for their stream): for one side of one append of the layer whose
 * blocks need the most, a block per head and a state per head. */
static int qvg_ws_init(kvp_pool *pool) {
  uint64_t need = 0;
  uint32_t H = pool->cfg.n_kv_heads;
  for (uint32_t i = 0; i < 2 * pool->cfg.n_layers; i++) {
    const kvp__binding *b = &pool->bind[i];
    if (!kvp__codec_is_qvg(b->vt)) continue;
    uint32_t cap = kvp__layer_bt(pool, i / 2, KVP_SEQ_STREAM), cs = kvp__layer_bt(pool, i / 2, KVP_SEQ_STEP);
    uint64_t w = kvp__qvg_pool_ws_bytes(b->inst, H, H, cs > cap ? cs : cap);
    need = w > need ? w : need;
  }
  if (!need) return KVP_OK;
  cudaError_t e = cudaMalloc(&pool->dev->qvg_ws, need);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return kvp__err(KVP_EDEVICE, "config.codecs: qvg's k-means workspace of %llu bytes on CUDA device %d: %s",
                    (unsigned long long)need, pool->cfg.device, cudaGetErrorString(e));
  }
  pool->dev->qvg_ws_bytes = need;
  return KVP_OK;
}

/* The bindings' device-side static data (kvquant's calibration tables),
 * made once on the pool's device; counted in device.control_bytes. */
static int dev_prepare_bindings(kvp_pool *pool) {
  static const char *const async_ok[] = {"raw", "fp8", "int8", "nvfp4"}; /* batch_async's codecs */
  int prev, rc = dev_enter(pool, &prev);
  for (uint32_t i = 0; !rc && i < 2 * pool->cfg.n_layers; i++) {
    kvp__binding *b = &pool->bind[i];
    for (size_t k = 0; k < sizeof async_ok / sizeof async_ok[0]; k++) b->dev_async |= !strcmp(b->vt->name, async_ok[k]);
    if (!(rc = kvp__codec_dev_prepare(b->vt, b->inst))) continue;
    char why[256];
    snprintf(why, sizeof why, "%s", kvp_last_error()); /* kvp__err rewrites the message it reads */
    rc = kvp__err(rc, "config.codecs: %s for layer %u %c on CUDA device %d: %s", b->vt->name, i / 2, "KV"[i % 2],
                  pool->cfg.device, why);
  }
  if (!rc) rc = qvg_ws_init(pool);
  dev_leave(pool, prev);
  return rc;
}

int kvp__dev_init(kvp_pool *pool) {
  int prev, rc = dev_enter(pool, &prev);
  if (rc) return rc;
  struct kvp__dev *d = kvp__meta_calloc(&pool->meta, sizeof *d);
  if (!d) {
    dev_leave(pool, prev);
    return kvp__err(KVP_ENOMEM, "device control block");
  }
  const char *what = "the pool's device status words and job stage";
  cudaError_t e = cudaMalloc((void **)&d->status, 8 * sizeof(uint64_t));
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&d->stage_done, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaMallocHost((void **)&d->host_status, 4 * sizeof(uint64_t));
  if (e == cudaSuccess) e = cudaMalloc((void **)&d->stage_dev, STAGE_JOBS * sizeof(kvp_codec_dev_job));
  if (e == cudaSuccess) e = cudaMallocHost((void **)&d->stage_host, STAGE_JOBS * sizeof(kvp_codec_dev_job));
  int sms = 0;
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, pool->cfg.device);
  if (e == cudaSuccess && (e = (cudaError_t)kvp__kern_attend_preload()) != cudaSuccess)
    what = "loading kvpool's kernels on the device (built for another GPU? see CUDA_ARCH)";
  d->sms = sms > 0 ? (uint32_t)sms : 1;
  if (e == cudaSuccess) e = (cudaError_t)kvp__kern_attend_occupancy(pool->cfg.head_dim, d->attend_occ);
  __atomic_add_fetch(&d->pinned_bytes, 4 * sizeof(uint64_t) + STAGE_JOBS * sizeof(kvp_codec_dev_job), __ATOMIC_RELAXED);
  int grc = e == cudaSuccess ? gstage_init(d) : KVP_OK;
  dev_leave(pool, prev);
  if (e != cudaSuccess || grc) {
    gstage_fini(d);
    if (d->stage_done) cudaEventDestroy(d->stage_done);
    cudaFree(d->status);
    cudaFreeHost(d->host_status);
    cudaFree(d->stage_dev);
    cudaFreeHost(d->stage_host);
    kvp__meta_free(&pool->meta, d, sizeof *d);
    cudaGetLastError();
    return grc ? grc : cuda_fail(e, what);
  }
  pool->dev = d;
  return dev_prepare_bindings(pool);
}

void kvp__dev_fini(kvp_pool *pool) {
  struct kvp__dev *d = pool->dev;
  if (!d) return;
  int prev;
  dev_enter(pool, &prev);
  if (d->stage_done) cudaEventDestroy(d->stage_done);
  cudaFree(d->status);
  cudaFreeHost(d->host_status);
  cudaFree(d->stage_dev);
  cudaFreeHost(d->stage_host);
  cudaFree(d->qvg_ws);
  gstage_fini(d);
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

int kvp__dev_batch_add_state(kvp_pool *pool, kvp__dev_batch *db, const kvp__binding *bd, int kv,
                             const kvp_codec_dev_job *j, void *hstate) {
  kvp__dev_group *g = &db->g[group_of(pool, bd, kv)];
  if (!g->jobs) {
    if (!(g->jobs = kvp__meta_alloc(db->meta, db->cap * sizeof *g->jobs)))
      return kvp__err(KVP_ENOMEM, "device jobs of an append (%u blocks)", db->cap);
    if (kvp__codec_is_qvg(bd->vt) && !(g->hstates = kvp__meta_calloc(db->meta, db->cap * sizeof *g->hstates))) {
      kvp__meta_free(db->meta, g->jobs, db->cap * sizeof *g->jobs);
      g->jobs = NULL;
      return kvp__err(KVP_ENOMEM, "device jobs of an append (%u blocks)", db->cap);
    }
    g->cap = db->cap;
    g->bd = bd;
    g->kv = kv;
  }
  kvp__assert(g->n < g->cap && g->bd == bd);
  if (g->hstates) g->hstates[g->n] = hstate;
  g->jobs[g->n++] = *j;
  return KVP_OK;
}

int kvp__dev_batch_add(kvp_pool *pool, kvp__dev_batch *db, const kvp__binding *bd, int kv, const kvp_codec_dev_job *j) {
  return kvp__dev_batch_add_state(pool, db, bd, kv, j, NULL);
}

void kvp__dev_batch_fini(kvp_pool *pool, kvp__dev_batch *db) {
  (void)pool;
  for (int i = 0; i < 4; i++) {
    kvp__meta_free(db->meta, db->g[i].jobs, db->g[i].cap * sizeof *db->g[i].jobs);
    if (db->g[i].hstates) kvp__meta_free(db->meta, db->g[i].hstates, db->g[i].cap * sizeof *db->g[i].hstates);
  }
  memset(db, 0, sizeof *db);
}

int kvp__dev_region_copy(kvp_pool *pool, uint64_t dst_off, uint64_t src_off, uint64_t bytes, void *stream) {
  int prev, rc = dev_enter(pool, &prev);
  if (!rc) rc = pool->alloc.region.ops->copy(&pool->alloc.region, dst_off, src_off, bytes, stream);
  dev_leave(pool, prev);
  return rc;
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

/* Whether an append of layer may skip reading its status back
 * (KVP_POOL_DEVICE_ASYNC): the layer's codecs, K and V, fail on non-finite
 * input only and keep no host-side stream state. The layer's, not only the
 * groups' of this append: rows that go to a RAW tail now are encoded by the
 * layer's codec later, which would then refuse what this append took. */
static bool batch_async(const kvp_pool *pool, const kvp__dev_batch *db, uint32_t layer) {
  if (!(pool->cfg.flags & KVP_POOL_DEVICE_ASYNC)) return false;
  for (int i = 0; i < 4; i++)
    if (db->g[i].n && db->g[i].hstates) return false;
  return pool->bind[2 * layer].dev_async && pool->bind[2 * layer + 1].dev_async; /* dev_prepare_bindings */
}

int kvp__dev_batch_run(kvp_pool *pool, kvp__dev_batch *db, uint32_t layer, uint32_t pos, void *stream) {
  struct kvp__dev *d = pool->dev;
  int prev, rc = dev_enter(pool, &prev);
  if (rc) return rc;
  cudaStream_t s = (cudaStream_t)stream;
  bool async = batch_async(pool, db, layer);
  uint64_t *status = async ? d->status + 4 : d->status; /* async: written, never read */
  cudaError_t e = async ? cudaSuccess : cudaMemsetAsync(d->status, 0xFF, 4 * sizeof(uint64_t), s);
  if (e != cudaSuccess) rc = cuda_fail(e, "cudaMemsetAsync (append status)");
  /* large groups: their jobs staged in one copy, once the previous
   * append's copy from the stage is done (an asynchronous append does not
   * wait for its stream) */
  const kvp_codec_dev_job *staged[4] = {NULL, NULL, NULL, NULL};
  uint32_t used = 0;
  for (int i = 0; i < 4; i++) {
    kvp__dev_group *g = &db->g[i];
    if (g->hstates || g->n < STAGE_MIN_JOBS || used + g->n > STAGE_JOBS) continue; /* qvg reads its jobs from parameters */
    if (!rc && !used && (e = cudaEventSynchronize(d->stage_done)) != cudaSuccess)
      rc = cuda_fail(e, "cudaEventSynchronize (append job stage)");
    if (rc) break;
    memcpy(d->stage_host + used, g->jobs, g->n * sizeof *g->jobs);
    staged[i] = d->stage_dev + used;
    used += g->n;
  }
  if (!rc && used && (e = cudaMemcpyAsync(d->stage_dev, d->stage_host, used * sizeof *d->stage_host,
                                          cudaMemcpyHostToDevice, s)) != cudaSuccess)
    rc = cuda_fail(e, "cudaMemcpyAsync (append jobs)");
  if (!rc && used && (e = cudaEventRecord(d->stage_done, s)) != cudaSuccess)
    rc = cuda_fail(e, "cudaEventRecord (append job stage)");
  for (int i = 0; !rc && i < 4; i++) {
    kvp__dev_group *g = &db->g[i];
    if (!g->n) continue;
    if (g->hstates) /* qvg: its stream states cross to the workspace and back */
      rc = kvp__qvg_encode_pool(g->bd->inst, g->jobs, g->hstates, g->n, d->qvg_ws, d->qvg_ws_bytes, d->status + i,
                                stream);
    else
      rc = g->bd->vt->encode_dev(g->bd->inst, g->jobs, staged[i], g->n, status + i, stream);
  }
  if (async && !rc) { /* enqueued (the launches checked): nothing to read back */
    dev_leave(pool, prev);
    return KVP_OK;
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
  int rc = g->n ? g->bd->vt->decode_dev(g->bd->inst, g->jobs, NULL, g->n, out, stream) : KVP_OK;
  if (rc && rc != KVP_EDEVICE)
    rc = kvp__err(rc, "codec %s failed to decode %u blocks on the device (status %d)", g->bd->vt->name, g->n, rc);
  g->n = 0;
  (void)pool;
  return rc;
}

int kvp__dev_read_add(kvp_pool *pool, kvp__dev_batch *db, const kvp__binding *bd, int kv, const kvp_codec_dev_job *j,
                      kvp_dtype out, void *stream) {
  kvp__dev_group *g = &db->g[group_of(pool, bd, kv)];
  if (g->jobs && g->n == g->cap) { /* a full group launches now, on the pool's device */
    int prev, rc = dev_enter(pool, &prev);
    if (!rc) rc = decode_group(pool, g, out, stream);
    dev_leave(pool, prev);
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

/* The pool's pinned stages for gather tables (GSTAGES, tried in turn from
 * the one after the last call's): a call holds one (when every stage is
 * held it builds on the heap); a stage's event tells when the last copy
 * from it, or the last kernel reading it in place, finished, so it is not
 * rewritten while they still read it. */
#define GSTAGE_RECS 65536u /* 3.25 MiB of records, pinned: 1 Mi tokens x heads in 16-token blocks */
#define GSTAGE_MAX_BYTES (512ull << 20)

static int gstage_init(struct kvp__dev *d) {
  cudaError_t e = cudaSuccess;
  for (uint32_t i = 0; i < GSTAGES; i++) {
    gstage_slot *st = &d->gs[i];
    pthread_mutex_init(&st->lock, NULL);
    if (e != cudaSuccess) continue; /* initialized, so that gstage_fini takes every slot */
    st->cap = GSTAGE_RECS;
    __atomic_add_fetch(&d->pinned_bytes, GSTAGE_RECS * sizeof(kvp__gjob), __ATOMIC_RELAXED);
    e = cudaMallocHost((void **)&st->buf, GSTAGE_RECS * sizeof(kvp__gjob));
    if (e == cudaSuccess) e = cudaEventCreateWithFlags(&st->done, cudaEventDisableTiming);
  }
  return e == cudaSuccess ? KVP_OK : cuda_fail(e, "the pool's pinned gather stages");
}

static void gstage_fini(struct kvp__dev *d) {
  for (uint32_t i = 0; i < GSTAGES; i++) {
    gstage_slot *st = &d->gs[i];
    if (st->buf) cudaFreeHost(st->buf);
    for (uint32_t k = 0; k < st->n_old; k++) cudaFreeHost(st->old[k]);
    if (st->done) cudaEventDestroy(st->done);
    pthread_mutex_destroy(&st->lock);
  }
}

/* The stage g builds in (g->staged). */
static gstage_slot *slot_of(struct kvp__dev *d, const kvp__dev_gather *g) {
  for (uint32_t i = 0; i < GSTAGES; i++)
    if (d->gs[i].buf == g->recs) return &d->gs[i];
  return NULL; /* not reached while g->staged */
}

int kvp__dev_gather_begin(kvp_pool *pool, kvp__dev_gather *g, const kvp_gather_req *req) {
  struct kvp__dev *d = pool->dev;
  uint32_t L = pool->cfg.n_layers;
  memset(g, 0, sizeof *g);
  g->req = req;
  if (!(g->seg_of_layer = kvp__meta_alloc(NULL, L * sizeof *g->seg_of_layer)))
    return kvp__err(KVP_ENOMEM, "gather segments");
  for (uint32_t l = 0; l < L; l++) g->seg_of_layer[l] = UINT32_MAX;
  uint32_t first = __atomic_fetch_add(&d->gnext, 1, __ATOMIC_RELAXED);
  for (uint32_t k = 0; k < GSTAGES; k++) {
    gstage_slot *st = &d->gs[(first + k) % GSTAGES];
    if (pthread_mutex_trylock(&st->lock) != 0) continue;
    cudaEventSynchronize(st->done); /* the last copy from (or kernel over) this stage is done */
    g->staged = true;
    g->recs = st->buf;
    g->cap = st->cap;
    break;
  }
  return KVP_OK;
}

void kvp__dev_gather_end(kvp_pool *pool, kvp__dev_gather *g) {
  if (g->staged) pthread_mutex_unlock(&slot_of(pool->dev, g)->lock);
  else kvp__meta_free(NULL, g->recs, g->cap * sizeof *g->recs);
  kvp__meta_free(NULL, g->seg_of_layer, pool->cfg.n_layers * sizeof *g->seg_of_layer);
  memset(g, 0, sizeof *g);
}

int kvp__dev_gather_segment(kvp__dev_gather *g, uint32_t layer, uint32_t item) {
  if (g->seg_of_layer[layer] != UINT32_MAX) return KVP_OK;
  if (g->nseg == KVP__GATHER_SEGMENTS)
    return kvp__err(KVP_EINVAL, "gather: items[%u] names layer %u, the %u-th distinct layer of the call (at most %u)",
                    item, layer, g->nseg + 1, KVP__GATHER_SEGMENTS);
  g->seg_layer[g->nseg] = layer;
  g->seg_of_layer[layer] = g->nseg++;
  return KVP_OK;
}

/* Grow the table: the pinned stage doubles while it stays under
 * GSTAGE_MAX_BYTES (a copy from pageable memory would wait for the
 * stream), else the table moves onto the heap. */
static int gather_grow(kvp_pool *pool, kvp__dev_gather *g) {
  struct kvp__dev *d = pool->dev;
  uint64_t cap = g->cap ? 2 * g->cap : 1024;
  gstage_slot *sl = g->staged ? slot_of(d, g) : NULL;
  if (sl && cap * sizeof *g->recs <= GSTAGE_MAX_BYTES && sl->n_old < 24) {
    kvp__gjob *st = NULL;
    if (cudaMallocHost((void **)&st, cap * sizeof *st) == cudaSuccess) {
      memcpy(st, g->recs, g->n * sizeof *st);
      sl->old[sl->n_old++] = sl->buf;
      __atomic_add_fetch(&d->pinned_bytes, cap * sizeof *st, __ATOMIC_RELAXED);
      sl->buf = g->recs = st;
      sl->cap = g->cap = cap;
      return KVP_OK;
    }
    cudaGetLastError();
  }
  kvp__gjob *recs = kvp__meta_alloc(NULL, cap * sizeof *recs);
  if (!recs) return KVP_ENOMEM;
  if (g->n) memcpy(recs, g->recs, g->n * sizeof *recs);
  if (sl) pthread_mutex_unlock(&sl->lock);
  else kvp__meta_free(NULL, g->recs, g->cap * sizeof *g->recs);
  g->staged = false;
  g->recs = recs, g->cap = cap;
  return KVP_OK;
}

int kvp__dev_gather_reserve(kvp_pool *pool, kvp__dev_gather *g, uint64_t used_bytes, uint64_t need_bytes) {
  g->n = (used_bytes + sizeof *g->recs - 1) / sizeof *g->recs; /* what a move keeps */
  while (g->cap * sizeof *g->recs < need_bytes)
    if (gather_grow(pool, g)) return KVP_ENOMEM;
  return KVP_OK;
}

kvp__gjob *kvp__dev_gather_slot(kvp_pool *pool, kvp__dev_gather *g) {
  if (g->n == g->cap && gather_grow(pool, g)) return NULL;
  return &g->recs[g->n++];
}

void kvp__dev_gather_ragged(kvp__dev_gather *g, uint32_t row0, uint32_t n) {
  if (g->nragged < 64) g->ragged[0][g->nragged] = row0, g->ragged[1][g->nragged] = n;
  g->nragged++;
}

/* A binding without a built-in twin: every binding's own decode_dev, tag by
 * tag, from jobs rebuilt on the host (jobs in kernel parameters). */
static int gather_fallback(kvp_pool *pool, kvp__dev_gather *g, const kvp__binding *const *bd, uint32_t nb) {
  kvp_gather_req *req = (kvp_gather_req *)g->req;
  kvp_codec_dev_job *tmp = kvp__meta_alloc(NULL, (g->n ? g->n : 1) * sizeof *tmp);
  if (!tmp) return kvp__err(KVP_ENOMEM, "gather scratch");
  size_t row = (size_t)pool->cfg.n_kv_heads * pool->cfg.head_dim * 2;
  int rc = KVP_OK;
  for (uint32_t t = 0; !rc && t < nb; t++) {
    int kv = t % 4 >= 2;
    uint32_t k = 0;
    for (uint64_t i = 0; i < g->n; i++) {
      const kvp__gjob *r = &g->recs[i];
      if ((uint32_t)r->tag + 2u * (uint32_t)kv != t) continue;
      kvp_codec_dev_job *x = &tmp[k++];
      memset(x, 0, sizeof *x);
      for (int p = 0; p < 4; p++)
        x->pages[p] = r->page[kv][p] == KVP__GJOB_NO_PAGE ? NULL : pool->alloc.region.base + (uint64_t)r->page[kv][p] * 64;
      x->dst = (char *)(kv ? req->v_out : req->k_out) + (size_t)r->row * row + (size_t)r->head * pool->cfg.head_dim * 2;
      x->stride_bytes = row;
      x->n = r->n1 + 1u, x->cap_tokens = r->cap1 + 1u, x->t0 = r->t0, x->m = r->m1 + 1u, x->head = r->head;
      x->pos0 = r->pos0;
    }
    if (!k) continue;
    rc = bd[t]->vt->decode_dev(bd[t]->inst, tmp, NULL, k, KVP_DTYPE_BF16, req->stream);
    if (rc && rc != KVP_EDEVICE) rc = kvp__err(rc, "codec %s failed to decode for the gather", bd[t]->vt->name);
    req->n_launches += (k + KVP__KERN_JOBS_PER_LAUNCH - 1) / KVP__KERN_JOBS_PER_LAUNCH;
  }
  kvp__meta_free(NULL, tmp, (g->n ? g->n : 1) * sizeof *tmp);
  return rc;
}

int kvp__dev_gather_run(kvp_pool *pool, kvp__dev_gather *g) {
  kvp_gather_req *req = (kvp_gather_req *)g->req;
  struct kvp__dev *d = pool->dev;
  req->workspace_needed = g->n * sizeof *g->recs;
  if (!g->n) return KVP_OK;
  if (req->workspace_needed > req->workspace_bytes)
    return kvp__err(KVP_ENOSPC, "gather: the block table of %llu blocks needs %llu bytes of workspace, %llu given",
                    (unsigned long long)g->n, (unsigned long long)req->workspace_needed,
                    (unsigned long long)req->workspace_bytes);
  uint32_t nb = g->nseg * 4;
  const kvp__binding *bd[KVP__KERN_GATHER_PARAMS];
  kvp__kparams kp[KVP__KERN_GATHER_PARAMS];
  bool builtin = true;
  for (uint32_t s = 0; s < g->nseg; s++) {
    uint32_t l = g->seg_layer[s];
    bd[4 * s] = &pool->bind[2 * l], bd[4 * s + 1] = &pool->tail[0];
    bd[4 * s + 2] = &pool->bind[2 * l + 1], bd[4 * s + 3] = &pool->tail[1];
  }
  for (uint32_t t = 0; t < nb; t++) builtin &= kvp__codec_kparams(bd[t]->vt, bd[t]->inst, &kp[t]) == KVP_OK;
  cudaStream_t s = (cudaStream_t)req->stream;
  int prev, rc = dev_enter(pool, &prev);
  if (rc) return rc;
  cudaError_t e = cudaSuccess;
  size_t row = (size_t)pool->cfg.n_kv_heads * pool->cfg.head_dim * 2;
  if (g->nragged > 64) { /* many ragged items: zero every row once */
    e = cudaMemsetAsync(req->k_out, 0, req->n_rows * row, s);
    if (e == cudaSuccess) e = cudaMemsetAsync(req->v_out, 0, req->n_rows * row, s);
  }
  for (uint32_t i = 0; e == cudaSuccess && g->nragged <= 64 && i < g->nragged; i++) {
    e = cudaMemsetAsync((char *)req->k_out + g->ragged[0][i] * row, 0, g->ragged[1][i] * row, s);
    if (e == cudaSuccess) e = cudaMemsetAsync((char *)req->v_out + g->ragged[0][i] * row, 0, g->ragged[1][i] * row, s);
  }
  if (e == cudaSuccess && builtin) { /* the table in one copy, one launch */
    e = cudaMemcpyAsync(req->workspace, g->recs, g->n * sizeof *g->recs, cudaMemcpyHostToDevice, s);
    if (e == cudaSuccess && g->staged) e = cudaEventRecord(slot_of(d, g)->done, s);
    if (e == cudaSuccess) {
      int k = kvp__kern_gather(kp, nb, pool->alloc.region.base, req->workspace, (uint32_t)g->n, req->k_out,
                               req->v_out, row, pool->cfg.head_dim, s);
      if (k) rc = kvp__err(KVP_EDEVICE, "gather kernel of %llu blocks: %s", (unsigned long long)g->n, kvp__kern_errstr(k));
      else req->n_launches++;
    }
  } else if (e == cudaSuccess) {
    rc = gather_fallback(pool, g, bd, nb);
  }
  if (e != cudaSuccess) rc = cuda_fail(e, "gather copies");
  dev_leave(pool, prev);
  return rc;
}

/* ---- what the control block holds ----------------------------------------- */

void kvp__dev_control_bytes(const kvp_pool *pool, uint64_t *device_bytes, uint64_t *pinned_bytes) {
  const struct kvp__dev *d = pool->dev;
  *device_bytes = d ? 8 * sizeof(uint64_t) + STAGE_JOBS * sizeof(kvp_codec_dev_job) : 0;
  for (uint32_t i = 0; d && i < 2 * pool->cfg.n_layers; i++) /* the bindings' tables */
    *device_bytes += kvp__codec_dev_static_bytes(pool->bind[i].vt, pool->bind[i].inst);
  *device_bytes += d ? d->qvg_ws_bytes : 0;
  *pinned_bytes = d ? __atomic_load_n(&d->pinned_bytes, __ATOMIC_RELAXED) : 0;
  *pinned_bytes += kvp__xfer_pinned_bytes(pool); /* the store tier's staging */
}

/* ---- kept attention tables' records (pages/attend_kept.c) ---------------- */

void *kvp__dev_kept_alloc(kvp_pool *pool, uint64_t bytes) {
  struct kvp__dev *d = pool->dev;
  void *p = NULL;
  int prev;
  if (!d || dev_enter(pool, &prev)) return NULL;
  if (cudaMallocHost(&p, bytes) != cudaSuccess) {
    cudaGetLastError();
    p = NULL;
  } else {
    __atomic_add_fetch(&d->pinned_bytes, bytes, __ATOMIC_RELAXED);
  }
  dev_leave(pool, prev);
  return p;
}

void *kvp__dev_mapped(kvp_pool *pool, void *host) {
  void *p = NULL;
  int prev;
  if (!pool->dev || !host || dev_enter(pool, &prev)) return NULL;
  if (cudaHostGetDevicePointer(&p, host, 0) != cudaSuccess) {
    cudaGetLastError();
    p = NULL;
  }
  dev_leave(pool, prev);
  return p;
}

void kvp__dev_kept_free(kvp_pool *pool, void *p, uint64_t bytes) {
  if (!p) return;
  int prev;
  dev_enter(pool, &prev);
  cudaFreeHost(p);
  dev_leave(pool, prev);
  __atomic_sub_fetch(&pool->dev->pinned_bytes, bytes, __ATOMIC_RELAXED);
}

void *kvp__dev_event_new(kvp_pool *pool) {
  cudaEvent_t e = NULL;
  int prev;
  if (!pool->dev || dev_enter(pool, &prev)) return NULL;
  if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
    cudaGetLastError();
    e = NULL;
  }
  dev_leave(pool, prev);
  return e;
}

void kvp__dev_event_free(kvp_pool *pool, void *ev) {
  if (!ev) return;
  int prev;
  dev_enter(pool, &prev);
  cudaEventSynchronize((cudaEvent_t)ev);
  cudaEventDestroy((cudaEvent_t)ev);
  dev_leave(pool, prev);
}

void kvp__dev_event_wait(void *ev) {
  if (ev && cudaEventSynchronize((cudaEvent_t)ev) != cudaSuccess) cudaGetLastError();
}

/* ---- decode attention ------------------------------------------------------ */

uint32_t kvp__dev_sm_count(const kvp_pool *pool) { return pool->dev ? pool->dev->sms : 1; }

uint32_t kvp__dev_attend_slots(const kvp_pool *pool, const kvp__kparams p[4]) {
  if (!pool->dev) return 1;
  uint32_t occ = pool->dev->attend_occ[kvp__kern_attend_kind(p)];
  return pool->dev->sms * (occ ? occ : 1);
}

int kvp__dev_attend_run(kvp_pool *pool, kvp__dev_gather *g, uint64_t table_bytes, const kvp__attend_args *a,
                        void *stream, const kvp__atable *t) {
  struct kvp__dev *d = pool->dev;
  cudaStream_t s = (cudaStream_t)stream;
  int prev, rc = dev_enter(pool, &prev);
  if (rc) return rc;
  /* A table in the pinned stage that the layer's kernel reads in batches
   * stays there (the kernel reads it over the bus while it runs, where a
   * copy first would add its whole time): only the splits and their index
   * cross. The stage is then free again when the kernels end. A kept
   * table's (t->recs_dev, t->tab_dev: pinned and mapped) are read in place
   * whole, records, splits and index: nothing crosses and no stage is
   * held; t->done is recorded after the kernels. */
  kvp__attend_args x = *a;
  uint64_t from = 0;
  void *mapped = NULL;
  cudaError_t e = cudaSuccess;
  void *done = t->done;
  if (t->tab_dev) {
    x.recs = t->recs_dev;
    x.splits = (const kvp__asplit *)t->tab_dev;
    x.bh_split0 = (const uint32_t *)((const char *)t->tab_dev + t->off_bh);
    table_bytes = 0;
  } else if (g->staged && kvp__kern_attend_zero_copy(kvp__kern_attend_kind(a->p), a->head_dim)) {
    if (cudaHostGetDevicePointer(&mapped, g->recs, 0) == cudaSuccess) {
      from = (uint64_t)((const char *)a->splits - (const char *)a->recs);
      x.recs = mapped;
    } else { /* a stage the device cannot map: copied whole */
      mapped = NULL;
      cudaGetLastError();
    }
  }
  if (table_bytes > from)
    e = cudaMemcpyAsync((char *)a->recs + from, (const char *)g->recs + from, table_bytes - from,
                        cudaMemcpyHostToDevice, s);
  if (e == cudaSuccess && g->staged && !mapped) e = cudaEventRecord(slot_of(d, g)->done, s);
  if (e != cudaSuccess) rc = cuda_fail(e, "attention: the block table's copy");
  if (!rc) {
    int k = kvp__kern_attend(&x, stream);
    if (k) rc = kvp__err(KVP_EDEVICE, "attention kernel over %u splits: %s", a->n_splits, kvp__kern_errstr(k));
  }
  if (mapped && (e = cudaEventRecord(slot_of(d, g)->done, s)) != cudaSuccess && !rc)
    rc = cuda_fail(e, "attention: the block table's release");
  if (done && (e = cudaEventRecord((cudaEvent_t)done, s)) != cudaSuccess) {
    cudaStreamSynchronize(s); /* no event to wait for: the kernels end before the records may change */
    cudaGetLastError();
    if (!rc) rc = cuda_fail(e, "attention: the kept table's release");
  }
  dev_leave(pool, prev);
  return rc;
}
