/*
 * pages/blob.c - the store tier's blobs (format: pages/blob.h): header
 * checks, group blobs built from blocks and parsed back into fresh blocks,
 * batched pipelined writes, and what every store call checks first.
 */
#include "blob.h"
#include "policy.h"

#include <stdio.h>

int kvp__blob_hdr_check(const kvp_pool *pool, const char *key, const void *data, size_t len, uint16_t kind,
                     blob_hdr *h, rbuf *r) {
  const kvp_config *c = &pool->cfg;
  if (len < sizeof *h)
    return kvp__err(KVP_EFORMAT, "store key %s: truncated blob (%zu bytes, a header alone is %zu)", key, len, sizeof *h);
  memcpy(h, data, sizeof *h);
  if (h->magic != BLOB_MAGIC) return kvp__err(KVP_EFORMAT, "store key %s: not a kvpool blob (magic %08x)", key, h->magic);
  if (h->version != BLOB_VERSION)
    return kvp__err(KVP_EFORMAT, "store key %s: blob format version %u, this library reads version %u", key, h->version,
                    BLOB_VERSION);
  if (h->kind != kind)
    return kvp__err(KVP_EFORMAT, "store key %s: blob of kind %u where kind %u was expected", key, h->kind, kind);
  if (h->n_layers != c->n_layers || h->n_kv_heads != c->n_kv_heads || h->head_dim != c->head_dim ||
      h->block_tokens != pool->chunk_tokens || h->dtypes != ((uint32_t)c->k_dtype | (uint32_t)c->v_dtype << 8))
    return kvp__err(KVP_EFORMAT, "store key %s: blob of another geometry (layers %u, heads %u, head_dim %u, block "
                    "tokens %u, dtypes %#x; this pool: %u, %u, %u, %u, %#x)", key, h->n_layers, h->n_kv_heads,
                    h->head_dim, h->block_tokens, h->dtypes, c->n_layers, c->n_kv_heads, c->head_dim, pool->chunk_tokens,
                    (uint32_t)c->k_dtype | (uint32_t)c->v_dtype << 8);
  if (h->codec_fp != pool->codec_fp)
    return kvp__err(KVP_EFORMAT, "store key %s: blob written under other codecs (fingerprint %016llx, this pool's "
                    "%016llx): its pages cannot be read here", key, (unsigned long long)h->codec_fp,
                    (unsigned long long)pool->codec_fp);
  if (h->payload_bytes != len - sizeof *h)
    return kvp__err(KVP_EFORMAT, "store key %s: truncated or padded blob: header says %llu payload bytes, the blob "
                    "holds %zu", key, (unsigned long long)h->payload_bytes, len - sizeof *h);
  const unsigned char *pl = (const unsigned char *)data + sizeof *h;
  uint64_t sum = kvp__xxh64(pl, h->payload_bytes, 0);
  if (sum != h->checksum)
    return kvp__err(KVP_EFORMAT, "store key %s: checksum mismatch (stored %016llx, computed %016llx): the blob is "
                    "corrupt", key, (unsigned long long)h->checksum, (unsigned long long)sum);
  *r = (rbuf){pl, h->payload_bytes, false};
  return KVP_OK;
}


/* ---- what can move ------------------------------------------------------------- */

int kvp__store_pool_ok(kvp_pool *pool, const char *what) {
  if (pool->cfg.flags & KVP_POOL_DRY)
    return kvp__err(KVP_ENOTSUP, "%s: the pool is dry (KVP_POOL_DRY): it holds no payload to move", what);
  for (uint32_t l = 0; l < pool->cfg.n_layers; l++)
    if (kvp__layer_rowwise(pool, l))
      return kvp__err(KVP_ENOTSUP, "%s: layer %u's codec %s lays out its blocks row by row; the store tier does not "
                      "move such blocks yet", what, l, pool->bind[2 * l].vt->name);
  if (pool->policy && pool->policy->vt)
    return kvp__err(KVP_ENOTSUP, "%s: the pool's policy %s keeps per-sequence state the store does not carry", what,
                    pool->policy->vt->name);
  if (!pool->chunk_tokens)
    return kvp__err(KVP_ENOTSUP, "%s: the pool's layers have different block sizes; the store tier moves chunks of "
                    "one size (set config.block_tokens)", what);
  return KVP_OK;
}


uint64_t kvp__blob_group_bytes(const item *items, uint32_t n) {
  uint64_t bytes = sizeof(blob_hdr) + (uint64_t)n * sizeof(blk_rec);
  for (uint32_t i = 0; i < n; i++)
    for (int kv = 0; kv < 2; kv++)
      for (unsigned p = 0; p < items[i].b->npages[kv]; p++) bytes += KVP__PG(items[i].b, p)[kv].requested_bytes;
  return bytes;
}

/* Device copies of one blob, gathered for one batch. */
typedef struct xlist {
  void **dst;
  const void **src;
  size_t *bytes;
  uint32_t n, cap;
} xlist;

static void xlist_free(xlist *x) {
  kvp__meta_free(NULL, x->dst, x->cap * sizeof *x->dst);
  kvp__meta_free(NULL, x->src, x->cap * sizeof *x->src);
  kvp__meta_free(NULL, x->bytes, x->cap * sizeof *x->bytes);
  *x = (xlist){0};
}

static int xlist_room(xlist *x, uint32_t n) {
  if (n <= x->cap) return KVP_OK;
  xlist y = {kvp__meta_alloc(NULL, n * sizeof *y.dst), kvp__meta_alloc(NULL, n * sizeof *y.src),
             kvp__meta_alloc(NULL, n * sizeof *y.bytes), 0, n};
  xlist_free(x);
  if (!y.dst || !y.src || !y.bytes) {
    xlist_free(&y);
    return kvp__err(KVP_ENOMEM, "store transfer: list of %u page copies", n);
  }
  *x = y;
  return KVP_OK;
}


uint64_t kvp__blob_slot_bytes(const kvp_pool *pool, const item *items, uint32_t n) {
  uint64_t bytes = kvp__blob_group_bytes(items, n);
  for (uint32_t i = 0; pool->dev && i < n; i++) /* the staging area after the blob: at most the pages' classes */
    for (int kv = 0; kv < 2; kv++)
      for (unsigned p = 0; p < items[i].b->npages[kv]; p++) bytes += kvp__page_alloc_bytes(&KVP__PG(items[i].b, p)[kv]);
  return bytes;
}

/* A page of a blob being built from a CUDA region. */
typedef struct opage {
  uint64_t off, alloc_bytes; /* its place in the region, its size class */
  uint64_t blob_at;          /* where its bytes go in the blob */
  size_t bytes;              /* requested bytes */
} opage;

static int opage_cmp(const void *a, const void *b) {
  uint64_t x = ((const opage *)a)->off, y = ((const opage *)b)->off;
  return (x > y) - (x < y);
}

static int fixes_room(xfixes *fx, uint32_t n) {
  if (n <= fx->cap) return KVP_OK;
  xfix *f = kvp__meta_realloc(NULL, fx->f, fx->cap * sizeof *f, n * sizeof *f);
  if (!f) return kvp__err(KVP_ENOMEM, "store transfer: list of %u page moves", n);
  fx->f = f;
  fx->cap = n;
  return KVP_OK;
}

/* The device half of a blob's build: pages op[n] copied, in region order,
 * into the staging area after the blob (w->p + w->n); pages adjacent in
 * the region go as one copy (their classes' padding carried along). The
 * moves into the blob's places are left in fx for the seal. */
static int stage_out(kvp_pool *pool, opage *op, uint32_t n, wbuf *w, xfixes *fx, void *stream) {
  kvp__region *rg = &pool->alloc.region;
  qsort(op, n, sizeof *op, opage_cmp);
  xlist xl = {0};
  int rc = fixes_room(fx, n + 1);
  if (!rc) rc = xlist_room(&xl, n + 1);
  unsigned char *stage = w->p + w->n;
  uint64_t at = 0;
  fx->n = 0;
  for (uint32_t i = 0, j; !rc && i < n; i = j) {
    for (j = i + 1; j < n && op[j].off == op[j - 1].off + op[j - 1].alloc_bytes; j++) {}
    for (uint32_t k = i; k < j; k++) fx->f[fx->n++] = (xfix){op[k].blob_at, at + (op[k].off - op[i].off), op[k].bytes};
    xl.dst[xl.n] = stage + at;
    xl.src[xl.n] = rg->base + op[i].off;
    xl.bytes[xl.n] = op[j - 1].off + op[j - 1].bytes - op[i].off;
    at += xl.bytes[xl.n++];
  }
  kvp__assert(rc || w->n + at <= w->cap);
#ifdef KVP_HAVE_CUDA
  if (!rc) rc = kvp__xfer_copy(pool, xl.n, xl.dst, xl.src, xl.bytes, stream);
#else
  (void)stream;
#endif
  xlist_free(&xl);
  return rc;
}

int kvp__blob_build_group(kvp_pool *pool, const item *items, uint32_t n, uint64_t t0, uint64_t t1, wbuf *w, putq *q) {
  uint32_t H = pool->cfg.n_kv_heads, npages = 0;
  blob_hdr h = hdr_for(pool, KIND_GROUP, n, t0, t1);
  w->n = 0;
  wput(w, &h, sizeof h);
  kvp__region *rg = &pool->alloc.region;
  bool dev = q && q->dev; /* pages staged after the blob (pinned), moved in at the seal */
  opage *op = NULL;
  for (uint32_t i = 0; dev && i < n; i++) npages += items[i].b->npages[0] + items[i].b->npages[1];
  int rc = dev && !(op = kvp__meta_alloc(NULL, (npages + 1) * sizeof *op)) ? kvp__err(KVP_ENOMEM, "store transfer: page list") : KVP_OK;
  uint32_t nop = 0;
  for (uint32_t i = 0; !rc && i < n && !w->oom; i++) {
    const kvp__block *b = items[i].b;
    blk_rec r;
    memset(&r, 0, sizeof r);
    r.layer = (uint16_t)(items[i].lh / H);
    r.head = (uint16_t)(items[i].lh % H);
    r.pos0 = b->pos0;
    r.cap_tokens = b->cap_tokens;
    r.n_tokens = b->n_tokens;
    r.raw = b->raw;
    r.sealed = b->sealed;
    for (int kv = 0; kv < 2; kv++) {
      r.npages[kv] = b->npages[kv];
      for (unsigned p = 0; p < b->npages[kv]; p++) {
        r.types[kv][p] = (uint8_t)KVP__PG(b, p)[kv].tag.type;
        r.bytes[kv][p] = KVP__PG(b, p)[kv].requested_bytes;
      }
    }
    wput(w, &r, sizeof r);
    for (int kv = 0; kv < 2 && !rc; kv++)
      for (unsigned p = 0; p < b->npages[kv] && !w->oom && !rc; p++) {
        size_t at = w->n, nb = KVP__PG(b, p)[kv].requested_bytes;
        wput(w, NULL, nb);
        if (w->oom) break;
        if (dev) op[nop++] = (opage){KVP__PG(b, p)[kv].off, kvp__page_alloc_bytes(&KVP__PG(b, p)[kv]), at, nb};
        else rc = rg->ops->read2d(rg, w->p + at, nb, KVP__PG(b, p)[kv].off, nb, nb, 1, NULL);
      }
  }
  if (!rc && w->oom) rc = kvp__err(KVP_ENOMEM, "staging buffer of a store blob");
  if (!rc && dev) rc = stage_out(pool, op, nop, w, &q->fx[q->cur * PUTQ_CAP + q->n[q->cur]], q->stream);
  kvp__meta_free(NULL, op, (npages + 1) * sizeof *op);
  return rc;
}


/* ---- the write queue ------------------------------------------------------------ */

int kvp__putq_init(putq *q, kvp_pool *pool, kvp_store *st) {
  memset(q, 0, sizeof *q);
  q->pool = pool;
  q->st = st;
  q->stream = kvp__store_stream(st);
  q->dev = pool->dev != NULL;
  q->keys = kvp__meta_alloc(NULL, 2 * PUTQ_CAP * sizeof *q->keys);
  q->bufs = kvp__meta_calloc(NULL, 2 * PUTQ_CAP * sizeof *q->bufs);
  q->fx = q->dev ? kvp__meta_calloc(NULL, 2 * PUTQ_CAP * sizeof *q->fx) : NULL;
  if (q->keys && q->bufs && (!q->dev || q->fx)) return KVP_OK;
  kvp__putq_free(q);
  return kvp__err(KVP_ENOMEM, "store write queue");
}

/* Write sealed half h (one pipelined batch). */
static int putq_send(putq *q, uint32_t h) {
  if (!q->sealed[h]) return KVP_OK;
  const char *keys[PUTQ_CAP];
  const void *vals[PUTQ_CAP];
  size_t lens[PUTQ_CAP];
  wbuf *b = q->bufs + h * PUTQ_CAP;
  uint64_t sent = 0; /* blob bytes (a device slot's staging area stays behind) */
  for (uint32_t i = 0; i < q->n[h]; i++) {
    keys[i] = q->keys[h * PUTQ_CAP + i], vals[i] = b[i].p, lens[i] = b[i].n;
    sent += b[i].n;
  }
  int rc = kvp__store_put(q->st, q->n[h], keys, vals, lens);
  if (!rc) q->written += sent;
  q->sealed[h] = false;
  q->n[h] = 0;
  q->bytes[h] = 0;
  return rc;
}

/* Close the filling half: its copies enqueued, write the other half
 * meanwhile, then wait for them and seal its blobs; fill the other next. */
static int putq_rotate(putq *q) {
  uint32_t h = q->cur, o = h ^ 1;
  int rc = KVP_OK;
  if (!q->n[h]) return KVP_OK;
#ifdef KVP_HAVE_CUDA
  if (q->dev) rc = kvp__xfer_record(q->pool, h, q->stream);
#endif
  if (!rc) rc = putq_send(q, o); /* over the network while the copies run */
#ifdef KVP_HAVE_CUDA
  if (!rc && q->dev) rc = kvp__xfer_wait(q->pool, h);
#endif
  if (rc) return rc;
  for (uint32_t i = 0; i < q->n[h]; i++) {
    wbuf *b = &q->bufs[h * PUTQ_CAP + i];
    const xfixes *fx = q->dev ? &q->fx[h * PUTQ_CAP + i] : NULL;
    for (uint32_t k = 0; fx && k < fx->n; k++) /* the pages from the staging area to their places */
      memcpy(b->p + fx->f[k].blob_at, b->p + b->n + fx->f[k].stage_at, fx->f[k].bytes);
    hdr_seal(b);
  }
  q->sealed[h] = true;
  q->cur = o;
  return KVP_OK;
}

int kvp__putq_slot(putq *q, uint64_t bytes, wbuf **w, char **key) {
  uint32_t h = q->cur;
  bool full = q->n[h] == PUTQ_CAP || (q->dev ? q->n[h] && q->bytes[h] + bytes > q->pin_cap[h]
                                             : q->bytes[h] >= PUT_BATCH_BYTES);
  int rc = full ? putq_rotate(q) : KVP_OK;
  if (rc) return rc;
  h = q->cur;
  wbuf *b = &q->bufs[h * PUTQ_CAP + q->n[h]];
#ifdef KVP_HAVE_CUDA
  if (q->dev) {
    if (!q->n[h] && (rc = kvp__xfer_buf(q->pool, h, bytes, &q->pin[h], &q->pin_cap[h]))) return rc;
    *b = (wbuf){q->pin[h] + q->bytes[h], 0, bytes, false, true};
  }
#endif
  b->n = 0;
  b->oom = false;
  *w = b;
  *key = q->keys[h * PUTQ_CAP + q->n[h]];
  return KVP_OK;
}

void kvp__putq_push(putq *q) {
  uint32_t h = q->cur;
  wbuf *b = &q->bufs[h * PUTQ_CAP + q->n[h]];
  q->bytes[h] += q->dev ? b->cap : b->n;
  q->n[h]++;
}

int kvp__putq_flush(putq *q) {
  int rc = putq_rotate(q);
  if (!rc) rc = putq_send(q, q->cur ^ 1);
  return rc;
}

void kvp__putq_free(putq *q) {
#ifdef KVP_HAVE_CUDA
  /* no copy still fills a half: a half left filling (a failure before its
   * seal) has copies no event covers yet */
  if (q->dev && q->pool && q->n[q->cur] && !q->sealed[q->cur]) (void)kvp__xfer_settle(q->pool, q->stream);
  if (q->dev && q->pool) (void)kvp__xfer_drain(q->pool);
#endif
  for (uint32_t i = 0; q->bufs && i < 2 * PUTQ_CAP; i++) wfree(&q->bufs[i]);
  for (uint32_t i = 0; q->fx && i < 2 * PUTQ_CAP; i++) kvp__meta_free(NULL, q->fx[i].f, q->fx[i].cap * sizeof *q->fx[i].f);
  kvp__meta_free(NULL, q->fx, 2 * PUTQ_CAP * sizeof *q->fx);
  q->fx = NULL;
  kvp__meta_free(NULL, q->keys, 2 * PUTQ_CAP * sizeof *q->keys);
  kvp__meta_free(NULL, q->bufs, 2 * PUTQ_CAP * sizeof *q->bufs);
  q->keys = NULL;
  q->bufs = NULL;
}

int kvp__blob_drain(kvp_pool *pool) {
#ifdef KVP_HAVE_CUDA
  if (pool->dev) return kvp__xfer_drain(pool);
#endif
  (void)pool;
  return KVP_OK;
}

/* Which content keys the store already holds (dedup). */
int kvp__store_content_present(kvp_store *st, uint32_t n, const uint64_t (*keys)[2], bool *present) {
  key_t_ *names = kvp__meta_alloc(NULL, n * sizeof *names + 1);
  const char **kp = kvp__meta_alloc(NULL, n * sizeof *kp + 1);
  int rc = names && kp ? KVP_OK : kvp__err(KVP_ENOMEM, "store key list");
  for (uint32_t i = 0; !rc && i < n; i++) {
    key_content(st, keys[i], names[i]);
    kp[i] = names[i];
  }
  if (!rc && n) rc = kvp__store_exists(st, n, kp, present);
  kvp__meta_free(NULL, names, n * sizeof *names + 1);
  kvp__meta_free(NULL, kp, n * sizeof *kp + 1);
  return rc;
}

void kvp__store_count(kvp_pool *pool, uint64_t out_bytes, uint64_t in_bytes, uint64_t prefix_tokens) {
  kvp__ledger_begin(&pool->alloc.ledger);
  kvp__count_add(&pool->alloc.ledger.store_offload_bytes, (int64_t)out_bytes);
  kvp__count_add(&pool->alloc.ledger.store_restore_bytes, (int64_t)in_bytes);
  kvp__count_add(&pool->alloc.ledger.store_prefix_tokens, (int64_t)prefix_tokens);
  kvp__ledger_end(&pool->alloc.ledger);
}

int kvp__store_lock_live(kvp_pool *pool, uint64_t seq, kvp_store *st, const char *what, kvp__seq **out) {
  if (!pool || !st) return kvp__err(KVP_EINVAL, "%s of seq %llu: %s is NULL", what, (unsigned long long)seq,
                                    pool ? "store" : "pool");
  kvp__lock(pool);
  kvp__rcu_read_lock();
  *out = kvp__seq_find(pool, seq);
  kvp__rcu_read_unlock();
  if (*out) return KVP_OK;
  kvp__unlock(pool);
  return kvp__err(KVP_ENOENT, "%s: sequence %llu does not exist", what, (unsigned long long)seq);
}


/* ---- reading group blobs ---------------------------------------------------------------- */


void kvp__parsed_destroy(kvp_pool *pool, parsed *p) {
  for (uint32_t i = 0; i < p->n; i++) kvp__block_destroy(pool, p->blk[i]);
  p->n = 0;
}
void kvp__parsed_free(parsed *p) {
  kvp__meta_free(NULL, p->blk, p->cap * sizeof *p->blk + 1);
  kvp__meta_free(NULL, p->lh, p->cap * sizeof *p->lh + 1);
  *p = (parsed){0};
}
int kvp__parsed_room(parsed *p, uint32_t n) {
  if (n <= p->cap) return KVP_OK;
  parsed np = {kvp__meta_alloc(NULL, n * sizeof *np.blk + 1), kvp__meta_alloc(NULL, n * sizeof *np.lh + 1), 0, n,
               p->nstaged, p->stream};
  if (!np.blk || !np.lh) {
    kvp__parsed_free(&np);
    return kvp__err(KVP_ENOMEM, "restore: block list of %u", n);
  }
  kvp__parsed_free(p);
  *p = np;
  return KVP_OK;
}

/* Check one record against the pool; lay receives the layouts. */
static int rec_check(kvp_pool *pool, const char *key, uint32_t index, const blk_rec *r, bool content,
                     kvp_codec_layout *lay) {
  uint32_t bt = pool->chunk_tokens;
  if (r->layer >= pool->cfg.n_layers || r->head >= pool->cfg.n_kv_heads || r->pos0 / bt != index ||
      !r->cap_tokens || r->cap_tokens > bt || !r->n_tokens || r->n_tokens > r->cap_tokens || r->raw > 1 ||
      r->sealed > 1 || (!r->raw && !r->sealed) || r->pos0 > KVP_MAX_SEQ_TOKENS - r->cap_tokens)
    return kvp__err(KVP_EFORMAT, "store key %s: block record (layer %u, head %u, position %u, %u of %u tokens) does not "
                    "fit this pool or chunk %u", key, r->layer, r->head, r->pos0, r->n_tokens, r->cap_tokens, index);
  if (content && (r->pos0 != index * bt || r->cap_tokens != bt || r->n_tokens != bt || !r->sealed))
    return kvp__err(KVP_EFORMAT, "store key %s: a content chunk holds a block that is not full and sealed", key);
  kvp__block tmp = {.raw = r->raw};
  for (int kv = 0; kv < 2; kv++) {
    kvp__bind_layout(kvp__block_binding(pool, r->layer, kv, &tmp), r->pos0, r->cap_tokens, &lay[kv]);
    bool same = lay[kv].npages == r->npages[kv];
    for (unsigned i = 0; same && i < lay[kv].npages; i++)
      same = (unsigned)lay[kv].types[i] == r->types[kv][i] && lay[kv].bytes[i] == r->bytes[kv][i];
    if (!same)
      return kvp__err(KVP_EFORMAT, "store key %s: layer %u head %u position %u: the %c pages differ from this pool's "
                      "codec layout", key, r->layer, r->head, r->pos0, "KV"[kv]);
  }
  return KVP_OK;
}

/* A page of a checked blob on its way to a CUDA region. */
typedef struct spage {
  uint64_t off, alloc_bytes;  /* its place in the region, its size class */
  const unsigned char *src;   /* its bytes in the blob */
  size_t bytes;               /* requested bytes */
} spage;

#ifdef KVP_HAVE_CUDA
static int spage_cmp(const void *a, const void *b) {
  uint64_t x = ((const spage *)a)->off, y = ((const spage *)b)->off;
  return (x > y) - (x < y);
}

/* Stage pages sp[n] in the next pinned half in region order and copy them
 * on out->stream: pages one after another in the region (fresh pages of a
 * blob mostly are: consecutive slots of a slab) go as one copy, the size
 * classes' padding between them carried along (bytes of those pages
 * alone). 1,000 small pages of a chunk become a few copies. */
static int stage_pages(kvp_pool *pool, spage *sp, uint32_t n, parsed *out) {
  kvp__region *rg = &pool->alloc.region;
  uint32_t half = out->nstaged & 1, nruns = 0;
  qsort(sp, n, sizeof *sp, spage_cmp);
  uint64_t need = 0;
  for (uint32_t i = 0, j; i < n; i = j) { /* runs [i, j) */
    for (j = i + 1; j < n && sp[j].off == sp[j - 1].off + sp[j - 1].alloc_bytes; j++) {}
    need += sp[j - 1].off + sp[j - 1].bytes - sp[i].off;
    nruns++;
  }
  unsigned char *pin;
  uint64_t cap;
  xlist xl = {0};
  int rc = kvp__xfer_buf(pool, half, need, &pin, &cap);
  if (!rc) rc = xlist_room(&xl, nruns + 1);
  uint64_t at = 0;
  for (uint32_t i = 0, j; !rc && i < n; i = j) {
    for (j = i + 1; j < n && sp[j].off == sp[j - 1].off + sp[j - 1].alloc_bytes; j++) {}
    for (uint32_t k = i; k < j; k++) memcpy(pin + at + (sp[k].off - sp[i].off), sp[k].src, sp[k].bytes);
    xl.dst[xl.n] = rg->base + sp[i].off;
    xl.src[xl.n] = pin + at;
    xl.bytes[xl.n] = sp[j - 1].off + sp[j - 1].bytes - sp[i].off;
    at += xl.bytes[xl.n++];
  }
  if (!rc && !(rc = kvp__xfer_copy(pool, xl.n, xl.dst, xl.src, xl.bytes, out->stream))) {
    out->nstaged++;
    rc = kvp__xfer_record(pool, half, out->stream);
    if (rc) (void)kvp__xfer_drain(pool); /* the copies may run: wait before the pages go */
  }
  xlist_free(&xl);
  return rc;
}
#endif

/* Parse a group blob into fresh blocks (pages taken and filled). tag: the
 * header's expected tag. On failure nothing is left taken. */
int kvp__blob_parse_group(kvp_pool *pool, uint64_t seq, const char *key, const void *data, size_t len, uint32_t index,
                       const uint64_t *tag, bool content, uint32_t expect_n, parsed *out) {
  blob_hdr h;
  rbuf r;
  uint32_t H = pool->cfg.n_kv_heads, LH = pool->cfg.n_layers * H;
  int rc = kvp__blob_hdr_check(pool, key, data, len, KIND_GROUP, &h, &r);
  if (rc) return rc;
  if (h.tag[0] != tag[0] || h.tag[1] != tag[1] || h.n_items != expect_n)
    return kvp__err(KVP_EFORMAT, "store key %s: blob of another chunk or offload (tag %016llx:%llx, %u blocks; "
                    "expected %016llx:%llx, %u)", key, (unsigned long long)h.tag[0], (unsigned long long)h.tag[1],
                    h.n_items, (unsigned long long)tag[0], (unsigned long long)tag[1], expect_n);
  if (content && expect_n != LH) return kvp__err(KVP_EFORMAT, "store key %s: a content chunk of %u blocks", key, expect_n);
  if ((rc = kvp__parsed_room(out, expect_n))) return rc;
  out->n = 0;
  kvp__region *rg = &pool->alloc.region;
  /* a CUDA region: the pages are listed, then (the whole blob checked)
   * staged in a pinned half in region order and copied as one batch */
  bool dev = pool->dev != NULL;
  uint32_t nsp = 0;
  spage *sp = NULL;
  uint32_t max_recs = expect_n < len / sizeof(blk_rec) ? expect_n : (uint32_t)(len / sizeof(blk_rec));
  size_t sp_bytes = ((size_t)max_recs * 2u * KVP_CODEC_MAX_PAGES + 1) * sizeof *sp;
  if (dev && !(sp = kvp__meta_alloc(NULL, sp_bytes))) rc = kvp__err(KVP_ENOMEM, "store key %s: page list", key);
  for (uint32_t i = 0; i < expect_n && !rc; i++) {
    blk_rec rec;
    kvp_codec_layout lay[2];
    if (!rget(&r, &rec, sizeof rec)) {
      rc = kvp__err(KVP_EFORMAT, "store key %s: block record %u runs past the payload", key, i);
      break;
    }
    if ((rc = rec_check(pool, key, index, &rec, content, lay))) break;
    uint32_t lh = (uint32_t)rec.layer * H + rec.head;
    if (content && lh != i) {
      rc = kvp__err(KVP_EFORMAT, "store key %s: content chunk records out of (layer, head) order", key);
      break;
    }
    uint64_t need = 0;
    for (int kv = 0; kv < 2; kv++)
      for (unsigned p = 0; p < lay[kv].npages; p++) need += lay[kv].bytes[p];
    if (need > r.left) {
      rc = kvp__err(KVP_EFORMAT, "store key %s: block %u needs %llu page bytes, %zu are left", key, i,
                    (unsigned long long)need, r.left);
      break;
    }
    kvp__block *b;
    if ((rc = kvp__block_new_sized(pool, seq, rec.layer, rec.head, rec.pos0, rec.cap_tokens, rec.raw, lay, &b))) {
      char msg[400];
      snprintf(msg, sizeof msg, "%s", kvp__err_detail());
      rc = kvp__err(rc, "store key %s: pages of layer %u head %u position %u: %s", key, rec.layer, rec.head, rec.pos0,
                    msg);
      break;
    }
    out->blk[out->n] = b;
    out->lh[out->n++] = lh;
    for (int kv = 0; kv < 2 && !rc; kv++)
      for (unsigned p = 0; p < b->npages[kv] && !rc; p++) {
        size_t nb = KVP__PG(b, p)[kv].requested_bytes;
        if (dev) {
          kvp__assert((nsp + 1) * sizeof *sp < sp_bytes);
          sp[nsp++] = (spage){KVP__PG(b, p)[kv].off, kvp__page_alloc_bytes(&KVP__PG(b, p)[kv]), r.p, nb};
        } else {
          rc = rg->ops->write2d(rg, KVP__PG(b, p)[kv].off, nb, r.p, nb, nb, 1, NULL);
        }
        rget(&r, NULL, nb);
      }
    kvp__block_set_n(b, rec.n_tokens);
    b->sealed = rec.sealed;
  }
  if (!rc && r.left) rc = kvp__err(KVP_EFORMAT, "store key %s: %zu bytes past the last block", key, r.left);
#ifdef KVP_HAVE_CUDA
  if (!rc && dev) rc = stage_pages(pool, sp, nsp, out);
#endif
  kvp__meta_free(NULL, sp, sp_bytes);
  if (rc) kvp__parsed_destroy(pool, out);
  return rc;
}

