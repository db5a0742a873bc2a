/*
 * pages/read.c - the lock-free readers: kvp_read (copy or dequantize the
 * retained tokens of one head), views (pin blocks, hand out page
 * addresses), kvp_seq_info.
 *
 * Every reader runs under kvp__rcu_read_lock and never takes the writer
 * lock (a view release does, only to free the last pin of an evicted
 * block). Runs and blocks are both in position order, so a read is one merge
 * walk: for each run retaining the head, the blocks overlapping its
 * positions [p0, p1) (a stream's brefs merged with the shared prefix chunks
 * the sequence holds: kvp__bwalk, pages/pages.h). p1 is loaded with acquire, so the payload of every
 * position below it is visible. A reader racing the writer sees each run and
 * bref either before or after each change; the counting pass bounds the
 * copy pass, so buffers are never overrun.
 *
 * kvp_read's cost is the copy: per block and side, rows the raw codec
 * stores in the output dtype (host region) are one memcpy of m x D x esize
 * bytes from the page at row t0; other rows go through the codec's decode.
 * Its walk requests the bref and block two blocks ahead (walk_ranges). On a
 * host region the walk and the copy take turns by batches: the walk notes
 * up to READ_BATCH_RANGES ranges (block, [a, e), the source and bytes of
 * each copied side), then the batch is read in order, each copied side's
 * payload requested READ_AHEAD_BYTES ahead of its memcpy:
 *   walk r0 .. r63 | request r0, r1; copy r0 | request r2; copy r1 | ...
 * The output is the same as a walk that reads each range as it reaches it:
 * rows in walk order at out_tokens, and a failure stops at its range.
 */
#include "../codecs/numeric.h"
#include "pages.h"

#include <string.h>

#define ALWAYS_INLINE inline __attribute__((always_inline))

static uint32_t run_end(const kvp__run *r) { return atomic_load_explicit(&r->p1, memory_order_acquire); }

/* Retained tokens of head in the layer's runs. */
static uint64_t count_retained(const kvp__layer *L, uint32_t head) {
  uint64_t n = 0;
  for (const kvp__run *r = kvp__rcu_deref(L->runs); r; r = kvp__rcu_deref(r->next))
    if (kvp__run_has(r, head)) n += run_end(r) - r->p0;
  return n;
}

/* The walk behind kvp__walk_ranges. With ahead, the bref and the block two
 * blocks on are requested before fn copies b, so a long read's pointer
 * chase (bref, block, page) is in flight a block early. A hint only: it
 * follows the brefs and passes over held chunks. Under the read lock every
 * bref and block reached is live. */
static ALWAYS_INLINE void prefetch_after(const kvp__bwalk *w, const kvp__block *b) {
  const kvp__bref *r = kvp__rcu_deref(*w->link);
  if (r && kvp__rcu_deref(r->blk) == b) r = kvp__rcu_deref(r->next);
  if (r && (r = kvp__rcu_deref(r->next))) {
    __builtin_prefetch(r);
    __builtin_prefetch(kvp__rcu_deref(r->blk));
  }
}

static ALWAYS_INLINE uint64_t walk_ranges(kvp__seq *s, const kvp_pool *pool, uint32_t layer, uint32_t head,
                                          uint64_t limit, kvp__range_fn fn, void *ctx, const bool ahead) {
  const kvp__layer *L = &s->layers[layer];
  kvp__bwalk w; /* the stream's blocks, and the shared prefix chunks s holds, in position order */
  kvp__bwalk_init(&w, pool, s, layer * pool->cfg.n_kv_heads + head);
  uint64_t done = 0;
  for (const kvp__run *r = kvp__rcu_deref(L->runs); r && done < limit; r = kvp__rcu_deref(r->next)) {
    if (!kvp__run_has(r, head)) continue;
    uint32_t ra = r->p0, rb = run_end(r);
    if (rb - ra > limit - done) rb = ra + (uint32_t)(limit - done);
    for (kvp__block *b; (b = kvp__bwalk_peek(&w)) && b->pos0 < rb;) {
      uint32_t be = b->pos0 + b->cap_tokens;
      if (be > ra) {
        uint32_t a = ra > b->pos0 ? ra : b->pos0, e = rb < be ? rb : be;
        if (ahead) prefetch_after(&w, b);
        if (fn(ctx, b, a, e)) return done;
        done += e - a;
        if (be > rb) break; /* the next run may begin inside it */
      }
      kvp__bwalk_pass(&w, b);
    }
  }
  return done;
}

uint64_t kvp__walk_ranges(kvp__seq *s, const kvp_pool *pool, uint32_t layer, uint32_t head, uint64_t limit,
                          kvp__range_fn fn, void *ctx) {
  return walk_ranges(s, pool, layer, head, limit, fn, ctx, false);
}

/* ---- kvp_read ------------------------------------------------------------ */

/* A host read walks up to READ_BATCH_RANGES ranges, then moves their rows,
 * each range's payload requested READ_AHEAD_BYTES ahead of its copy (see
 * read_batch_run). */
#define READ_BATCH_RANGES 64u
#define READ_AHEAD_BYTES 8192u

/* One range of a host read's batch. */
typedef struct read_ent {
  kvp__block *b;               /* the block, live under the read lock */
  uint32_t a, e;               /* positions [a, e) read from it */
  const unsigned char *src[2]; /* K, V: the stored rows one memcpy moves (read_is_copy), or NULL */
  size_t copy_bytes[2];        /* K, V: bytes of that memcpy, 0 where the side is decoded or not read */
} read_ent;

typedef struct read_ctx {
  kvp_pool *pool;
  uint32_t layer;
  kvp_read_req *req;
  size_t orow;         /* bytes of an output row: head_dim x esize(out_dtype) */
  uint64_t out_tokens; /* rows written so far */
  int rc;              /* first failure */
#ifdef KVP_HAVE_CUDA
  kvp__dev_batch *db;  /* CUDA region: the decode jobs */
#endif
  uint32_t n;          /* host: ranges walked, not yet read */
  uint32_t ahead_ent;  /* host: where the payload requests stand: entry, */
  int ahead_kv;        /* its side (K 0, V 1), */
  size_t ahead_bytes;  /* and the bytes of that side requested */
  read_ent ent[READ_BATCH_RANGES]; /* host: the ranges walked, in output order */
} read_ctx;

/* Whether side kv of b is, on a host region, one memcpy of the stored rows:
 * rows stored in the output dtype by the raw codec (every OPEN block, and
 * sealed blocks of raw layers), unless the layer's codec presents its raw
 * rows (decode_raw_at). What raw's decode does, without its call. */
static inline bool read_is_copy(const kvp_pool *pool, uint32_t layer, int kv, const kvp__block *b, kvp_dtype out) {
  const kvp__binding *bd = kvp__block_binding(pool, layer, kv, b);
  return bd->vt == &kvp__codec_raw && kvp__raw_store_dtype(bd->inst) == out &&
         !(b->raw && pool->bind[2 * layer + kv].vt->decode_raw_at);
}

/* Side kv of b's rows [a, e) into dst: a host copy, a device job, or the
 * codec's decode. 0 or the error, recorded. */
static int read_side(read_ctx *c, int kv, kvp__block *b, uint32_t a, uint32_t e, unsigned char *dst) {
  kvp_pool *pool = c->pool;
  kvp_read_req *q = c->req;
  uint32_t t0 = a - b->pos0, m = e - a, D = pool->cfg.head_dim;
  size_t orow = c->orow;
  const kvp__binding *bd = kvp__block_binding(pool, c->layer, kv, b);
  int rc;
  if (pool->cfg.memory == KVP_MEM_CUDA) {
#ifdef KVP_HAVE_CUDA
    kvp_codec_dev_job j = {.dst = dst, .stride_bytes = orow, .n = kvp__block_n(b), .cap_tokens = b->cap_tokens,
                           .t0 = t0, .m = m, .head = q->head, .pos0 = b->pos0};
    for (unsigned i = 0; i < b->npages[kv]; i++) j.pages[i] = kvp__page_addr(&pool->alloc, &KVP__PG(b, i)[kv]);
    rc = kvp__dev_read_add(pool, c->db, bd, kv, &j, q->out_dtype, q->stream);
#else
    rc = kvp__err(KVP_ENOTSUP, "read: built without CUDA");
#endif
  } else if (read_is_copy(pool, c->layer, kv, b, q->out_dtype)) {
    memcpy(dst, (const unsigned char *)kvp__page_addr(&pool->alloc, &b->pg0[kv]) + t0 * orow, (size_t)m * orow);
    rc = 0;
  } else if (b->raw && pool->bind[2 * c->layer + kv].vt->decode_raw_at) { /* the codec presents its raw rows */
    const kvp__binding *lb = &pool->bind[2 * c->layer + kv];
    size_t row = (size_t)D * kvp__dtype_bytes(kvp__raw_store_dtype(bd->inst));
    kvp_codec_block where = {q->head, b->pos0};
    rc = lb->vt->decode_raw_at(lb->inst, &where, t0, (const unsigned char *)kvp__page_addr(&pool->alloc, &b->pg0[kv]) + t0 * row, row,
                               m, dst, orow, q->out_dtype);
    if (rc) rc = kvp__err(KVP_ECODEC, "codec %s failed to present raw rows of layer %u %c (status %d)", lb->vt->name,
                          c->layer, "KV"[kv], rc);
  } else {
    const void *pages[KVP_CODEC_MAX_PAGES];
    for (unsigned i = 0; i < b->npages[kv]; i++) pages[i] = kvp__page_addr(&pool->alloc, &KVP__PG(b, i)[kv]);
    /* an encoded block's count is fixed; a raw OPEN block's still grows (raw decode ignores it) */
    uint32_t n = kvp__block_n(b);
    if (bd->vt->decode_at) {
      kvp_codec_block where = {q->head, b->pos0};
      rc = bd->vt->decode_at(bd->inst, &where, pages, n, b->cap_tokens, t0, m, dst, orow, q->out_dtype);
    } else {
      rc = bd->vt->decode(bd->inst, pages, n, b->cap_tokens, t0, m, dst, orow, q->out_dtype);
    }
    if (rc) rc = kvp__err(KVP_ECODEC, "codec %s failed to decode layer %u %c (status %d)", bd->vt->name, c->layer,
                          "KV"[kv], rc);
  }
  if (rc) c->rc = rc;
  return rc;
}

/* The rows [a, e) were written at the output's next row: their positions. */
static void read_advance(read_ctx *c, uint32_t a, uint32_t e) {
  uint32_t *pos = c->req->positions_out;
  if (pos)
    for (uint32_t i = a; i < e; i++) pos[c->out_tokens + i - a] = i;
  c->out_tokens += e - a;
}

/* One block's rows [a, e) of the head, K and V, at the output's next row
 * (the CUDA region's walk step). */
static int read_range(void *vctx, kvp__block *b, uint32_t a, uint32_t e) {
  read_ctx *c = vctx;
  void *outs[2] = {c->req->k_out, c->req->v_out};
  for (int kv = 0; kv < 2; kv++)
    if (outs[kv] && read_side(c, kv, b, a, e, (unsigned char *)outs[kv] + c->out_tokens * c->orow)) return 1;
  read_advance(c, a, e);
  return 0;
}

/* Request the batch's next bytes of copied payload, in copy order, to L2,
 * one line at a time. The saturating countdown of bytes is a chain of a few
 * cycles a line, and that spacing is what makes the requests count here: the
 * same lines requested back to back (a plain loop over o) moved no faster
 * than none (kvpool-bench --read, EPYC host). Inline where it is used: GCC
 * takes a function whose only effects are prefetches for one without
 * effects, and drops calls to it. */
static ALWAYS_INLINE void read_request(read_ctx *c, size_t bytes) {
  while (bytes && c->ahead_ent < c->n) {
    const read_ent *t = &c->ent[c->ahead_ent];
    const unsigned char *p = t->src[c->ahead_kv];
    size_t span = t->copy_bytes[c->ahead_kv];
    for (; c->ahead_bytes < span && bytes; c->ahead_bytes += 64, bytes = bytes > 64 ? bytes - 64 : 0)
      __builtin_prefetch(p + c->ahead_bytes, 0, 1);
    if (c->ahead_bytes < span) return;
    c->ahead_bytes = 0;
    if (!(c->ahead_kv ^= 1)) c->ahead_ent++;
  }
}

/* Read the ranges walked, in order: a copied side is one memcpy, its
 * payload requested READ_AHEAD_BYTES ahead (the next range's, for 16-token
 * bf16 blocks of D = 128); other sides go through read_side.
 *
 * Why: pages lie apart, so the hardware prefetcher, which stops at a 4 KiB
 * page, starts cold on each, and a memcpy of a page waits on its misses a
 * few lines at a time. Requests to L2 (prefetcht2 on x86) are held many
 * more at once than L1 misses, so a range requested ahead arrives at the
 * memory's speed; requests to L1 (prefetcht0) take the L1 miss slots the
 * copy needs and were slower than none. The walk runs first, by batches, so
 * the copy's look-ahead has the next ranges at hand and the walk's chain of
 * misses (bref, block) is not spread between the copies: batches of 2 or 4
 * ranges read slower than 64 (kvpool-bench --read). */
static int read_batch_run(read_ctx *c) {
  void *outs[2] = {c->req->k_out, c->req->v_out};
  int stop = 0;
  c->ahead_ent = 0, c->ahead_kv = 0, c->ahead_bytes = 0;
  read_request(c, READ_AHEAD_BYTES);
  for (uint32_t i = 0; i < c->n && !stop; i++) {
    read_ent *t = &c->ent[i];
    read_request(c, t->copy_bytes[0] + t->copy_bytes[1]);
    for (int kv = 0; kv < 2 && !stop; kv++) {
      if (!outs[kv]) continue;
      unsigned char *dst = (unsigned char *)outs[kv] + c->out_tokens * c->orow;
      if (t->copy_bytes[kv])
        memcpy(dst, t->src[kv], t->copy_bytes[kv]);
      else
        stop = read_side(c, kv, t->b, t->a, t->e, dst);
    }
    if (!stop) read_advance(c, t->a, t->e);
  }
  c->n = 0;
  return stop;
}

/* The host walk's step: note the range and what of it is one memcpy; read
 * the batch once it is full. */
static int read_batch_add(void *vctx, kvp__block *b, uint32_t a, uint32_t e) {
  read_ctx *c = vctx;
  const kvp_read_req *q = c->req;
  read_ent *t = &c->ent[c->n++];
  *t = (read_ent){.b = b, .a = a, .e = e};
  for (int kv = 0; kv < 2; kv++)
    if ((kv ? q->v_out : q->k_out) && read_is_copy(c->pool, c->layer, kv, b, q->out_dtype)) {
      t->src[kv] = (const unsigned char *)kvp__page_addr(&c->pool->alloc, &b->pg0[kv]) + (a - b->pos0) * c->orow;
      t->copy_bytes[kv] = (size_t)(e - a) * c->orow;
    }
  return c->n == READ_BATCH_RANGES ? read_batch_run(c) : 0;
}

static int read_check(kvp_pool *pool, uint32_t layer, const kvp_read_req *q) {
  if (!pool || !q) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "read request" : "pool");
  if (q->struct_size < sizeof *q)
    return kvp__err(KVP_EINVAL, "read_req.struct_size %zu < %zu", q->struct_size, sizeof *q);
  if (layer >= pool->cfg.n_layers) return kvp__err(KVP_EINVAL, "read: layer %u >= n_layers %u", layer, pool->cfg.n_layers);
  if (q->head >= pool->cfg.n_kv_heads)
    return kvp__err(KVP_EINVAL, "read: head %u >= n_kv_heads %u", q->head, pool->cfg.n_kv_heads);
  if (q->out_dtype != KVP_DTYPE_F32 && q->out_dtype != KVP_DTYPE_BF16 && q->out_dtype != KVP_DTYPE_F16)
    return kvp__err(KVP_EINVAL, "read: out_dtype %d is not a kvp_dtype", (int)q->out_dtype);
  size_t align = kvp__dtype_bytes(q->out_dtype);
  if ((uintptr_t)q->k_out % align || (uintptr_t)q->v_out % align)
    return kvp__err(KVP_EINVAL, "read: k_out/v_out not aligned to the out dtype (%zu bytes)", align);
  return KVP_OK;
}

KVP_API int kvp_read(kvp_pool *pool, uint64_t seq, uint32_t layer, kvp_read_req *req) {
  int rc = read_check(pool, layer, req);
  if (rc) return rc;
  if (pool->cfg.flags & KVP_POOL_DRY)
    return kvp__err(KVP_ENOTSUP, "read seq %llu layer %u: the pool is dry (KVP_POOL_DRY): pages are counted, no "
                                 "payload is stored", (unsigned long long)seq, layer);
  kvp__rcu_read_lock();
  kvp__seq *s = kvp__seq_find(pool, seq);
  if (!s) {
    kvp__rcu_read_unlock();
    return kvp__err(KVP_ENOENT, "read: sequence %llu does not exist", (unsigned long long)seq);
  }
  uint64_t need = count_retained(&s->layers[layer], req->head);
  if (need > req->capacity_tokens) {
    kvp__rcu_read_unlock();
    req->n_tokens = (uint32_t)need;
    return kvp__err(KVP_ENOSPC, "read seq %llu layer %u head %u: needs %llu tokens, capacity_tokens is %u",
                    (unsigned long long)seq, layer, req->head, (unsigned long long)need, req->capacity_tokens);
  }
  read_ctx c; /* field by field: the batch (3 KiB) is written as it fills, not cleared per call */
  c.pool = pool, c.layer = layer, c.req = req, c.orow = (size_t)pool->cfg.head_dim * kvp__dtype_bytes(req->out_dtype);
  c.out_tokens = 0, c.rc = KVP_OK, c.n = 0;
#ifdef KVP_HAVE_CUDA
  kvp__dev_batch db;
  kvp__dev_batch_init(&db, 256, NULL);
  c.db = &db;
#endif
  if (pool->cfg.memory == KVP_MEM_CUDA) {
    walk_ranges(s, pool, layer, req->head, need, read_range, &c, true);
  } else {
    walk_ranges(s, pool, layer, req->head, need, read_batch_add, &c, true);
    if (!c.rc && c.n) read_batch_run(&c);
  }
#ifdef KVP_HAVE_CUDA
  if (pool->cfg.memory == KVP_MEM_CUDA) {
    int rc2 = kvp__dev_read_flush(pool, &db, req->out_dtype, req->stream);
    if (!c.rc) c.rc = rc2;
  }
  kvp__dev_batch_fini(pool, &db);
#endif
  kvp__rcu_read_unlock();
  req->n_tokens = (uint32_t)c.out_tokens;
  return c.rc;
}

/* ---- views --------------------------------------------------------------- */

typedef struct view_impl {
  kvp_view pub;        /* what the caller sees */
  size_t bytes;        /* allocation size */
  uint32_t cap;        /* entries allocated */
  kvp__block **pinned; /* [cap]: the block of each entry */
  kvp_view_block entries[]; /* [cap] */
} view_impl;

typedef struct view_ctx {
  kvp_pool *pool;
  uint32_t layer;     /* layer viewed */
  view_impl *v;       /* NULL in the counting pass */
  uint32_t head;      /* head being walked */
  uint64_t n;         /* entries counted or filled */
  uint32_t *per_head; /* entries of each head in the counting pass: the fill pass's cap per head */
  uint32_t head_n;    /* entries filled for the current head */
} view_ctx;

/* Counting pass: entries per head. Fill pass: at most that many per head, so
 * blocks appended between the passes never crowd a later head out. */
static int view_range(void *vctx, kvp__block *b, uint32_t a, uint32_t e) {
  view_ctx *c = vctx;
  if (!c->v) {
    c->n++;
    c->per_head[c->head]++;
    return 0;
  }
  if (c->head_n == c->per_head[c->head]) return 1;
  uint32_t r = atomic_load_explicit(&b->refs, memory_order_relaxed);
  do {
    if (!r) return 0; /* being freed: evicted under us, skip it */
  } while (!atomic_compare_exchange_weak_explicit(&b->refs, &r, r + 1, memory_order_acq_rel, memory_order_relaxed));
  kvp_view_block *vb = &c->v->entries[c->n];
  memset(vb, 0, sizeof *vb);
  vb->head = c->head;
  vb->block_pos0 = b->pos0;
  vb->first = a - b->pos0;
  vb->n_tokens = e - a;
  vb->cap_tokens = b->cap_tokens;
  for (int kv = 0; kv < 2; kv++) {
    vb->codec[kv] = kvp__block_binding(c->pool, c->layer, kv, b)->id;
    for (unsigned i = 0; i < b->npages[kv]; i++) {
      const kvp__page *pg = &KVP__PG(b, i)[kv];
      vb->page[kv][pg->tag.type] = kvp__page_addr(&c->pool->alloc, pg);
      vb->page_bytes[kv][pg->tag.type] = pg->requested_bytes;
    }
  }
  c->v->pinned[c->n++] = b;
  c->head_n++;
  return 0;
}

KVP_API int kvp_view_acquire(kvp_pool *pool, uint64_t seq, uint32_t layer, kvp_view **out) {
  if (!pool || !out) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "out" : "pool");
  *out = NULL;
  if (layer >= pool->cfg.n_layers) return kvp__err(KVP_EINVAL, "view: layer %u >= n_layers %u", layer, pool->cfg.n_layers);
  if (pool->cfg.flags & KVP_POOL_DRY)
    return kvp__err(KVP_ENOTSUP, "view of seq %llu layer %u: the pool is dry (KVP_POOL_DRY): its pages have no "
                                 "addressable payload", (unsigned long long)seq, layer);
  kvp__rcu_read_lock();
  kvp__seq *s = kvp__seq_find(pool, seq);
  if (!s) {
    kvp__rcu_read_unlock();
    return kvp__err(KVP_ENOENT, "view: sequence %llu does not exist", (unsigned long long)seq);
  }
  uint32_t H = pool->cfg.n_kv_heads;
  view_ctx c = {pool, layer, NULL, 0, 0, kvp__meta_calloc(NULL, H * sizeof(uint32_t)), 0};
  if (!c.per_head) {
    kvp__rcu_read_unlock();
    return kvp__err(KVP_ENOMEM, "view scratch");
  }
  for (c.head = 0; c.head < H; c.head++) kvp__walk_ranges(s, pool, layer, c.head, UINT64_MAX, view_range, &c);
  uint32_t cap = (uint32_t)c.n;
  size_t bytes = sizeof(view_impl) + cap * (sizeof(kvp_view_block) + sizeof(kvp__block *));
  view_impl *v = kvp__meta_alloc(&pool->meta, bytes);
  if (!v) {
    kvp__rcu_read_unlock();
    kvp__meta_free(NULL, c.per_head, H * sizeof(uint32_t));
    return kvp__err(KVP_ENOMEM, "view of %u blocks", cap);
  }
  v->bytes = bytes;
  v->cap = cap;
  v->pinned = (kvp__block **)(v->entries + cap);
  c.v = v;
  c.n = 0;
  for (c.head = 0; c.head < H; c.head++) {
    c.head_n = 0;
    kvp__walk_ranges(s, pool, layer, c.head, UINT64_MAX, view_range, &c);
  }
  kvp__rcu_read_unlock();
  kvp__meta_free(NULL, c.per_head, H * sizeof(uint32_t));
  v->pub = (kvp_view){seq, layer, (uint32_t)c.n, v->entries};
  *out = &v->pub;
  return KVP_OK;
}

KVP_API void kvp_view_release(kvp_pool *pool, kvp_view *view) {
  if (!view || !pool) return;
  view_impl *v = caa_container_of(view, view_impl, pub);
  bool locked = false;
  for (uint32_t i = 0; i < v->pub.n_blocks; i++) {
    kvp__block *b = v->pinned[i];
    if (atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) == 1) { /* the last pin of an evicted block */
      if (!locked) kvp__lock(pool);
      locked = true;
      kvp__block_unpinned(pool, b);
    }
  }
  if (locked) {
    kvp__reclaim(pool);
    kvp__unlock(pool);
  }
  kvp__meta_free(&pool->meta, v, v->bytes);
}

/* ---- kvp_seq_info -------------------------------------------------------- */

KVP_API int kvp_seq_info(kvp_pool *pool, uint64_t seq, kvp_seq_desc *info) {
  if (!pool || !info) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "info" : "pool");
  if (info->struct_size < sizeof *info)
    return kvp__err(KVP_EINVAL, "seq_info.struct_size %zu < %zu", info->struct_size, sizeof *info);
  kvp__rcu_read_lock();
  kvp__seq *s = kvp__seq_find(pool, seq);
  if (!s) {
    kvp__rcu_read_unlock();
    return kvp__err(KVP_ENOENT, "seq_info: sequence %llu does not exist", (unsigned long long)seq);
  }
  info->mode = s->mode;
  info->n_steps = atomic_load_explicit(&s->n_steps, memory_order_acquire);
  info->n_positions = atomic_load_explicit(&s->n_positions, memory_order_acquire);
  info->in_step = atomic_load_explicit(&s->in_step, memory_order_acquire);
  info->tokens_retained = info->tokens_evicted = 0;
  memset(info->page_types, 0, sizeof info->page_types);
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads;
  for (uint32_t i = 0; i < L * H; i++) {
    kvp__stream *st = &s->streams[i];
    uint32_t ret = atomic_load_explicit(&st->retained_tokens, memory_order_relaxed);
    uint32_t ev = atomic_load_explicit(&st->evicted_tokens, memory_order_relaxed);
    info->tokens_retained += ret;
    info->tokens_evicted += ev;
    if (info->retained_tokens) info->retained_tokens[i] = ret;
    if (info->evicted_tokens) info->evicted_tokens[i] = ev;
    kvp__bwalk w; /* its own blocks and the shared prefix chunks it holds */
    for (const kvp__block *blk = kvp__bwalk_first(&w, pool, s, i); blk; blk = kvp__bwalk_next(&w, blk)) {
      for (int kv = 0; kv < 2; kv++)
        for (unsigned p = 0; p < blk->npages[kv]; p++) {
          const kvp__page *pg = &KVP__PG(blk, p)[kv];
          kvp_usage *u = &info->page_types[pg->tag.type];
          u->requested_bytes += pg->requested_bytes;
          u->allocated_bytes += kvp__page_alloc_bytes(pg);
          u->npages++;
        }
    }
  }
  kvp__rcu_read_unlock();
  return KVP_OK;
}

/* ---- kvp_gather ---------------------------------------------------------- */

KVP_API void kvp_gather_req_init(kvp_gather_req *req) {
  if (!req) return;
  memset(req, 0, sizeof *req);
  req->struct_size = sizeof *req;
}

#ifdef KVP_HAVE_CUDA
void kvp__gjob_fill(kvp__gjob *r, const kvp__block *b, uint32_t head, uint32_t a, uint32_t e, uint32_t row,
                    uint16_t tag) {
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < KVP_CODEC_MAX_PAGES; i++) {
      kvp__assert(i >= b->npages[kv] || KVP__PG(b, i)[kv].off % 64 == 0); /* a CUDA region's pages: 64-byte aligned */
      r->page[kv][i] = i < b->npages[kv] ? (uint32_t)(KVP__PG(b, i)[kv].off / 64) : KVP__GJOB_NO_PAGE;
    }
  r->row = row;
  r->pos0 = b->pos0;
  r->head = (uint16_t)head;
  r->tag = tag;
  r->t0 = (uint16_t)(a - b->pos0);
  r->m1 = (uint16_t)(e - a - 1);
  r->n1 = (uint16_t)(kvp__block_n(b) - 1);
  r->cap1 = (uint16_t)(b->cap_tokens - 1);
}

/* The walk of one head of one item: a K and a V job per block, tagged with
 * the item's layer segment and the block's binding group. */
typedef struct gather_ctx {
  kvp_pool *pool;
  const kvp_gather_req *req;
  uint32_t head;          /* being walked */
  uint32_t row;           /* output row of the next token of this head */
  kvp__dev_gather *g;     /* the table */
  uint32_t seg;           /* the item's layer segment */
  int rc;                 /* first failure */
} gather_ctx;

static int gather_range(void *vctx, kvp__block *b, uint32_t a, uint32_t e) {
  gather_ctx *c = vctx;
  kvp_pool *pool = c->pool;
  uint32_t H = pool->cfg.n_kv_heads, m = e - a;
  kvp__gjob *r = kvp__dev_gather_slot(pool, c->g);
  if (!r) {
    c->rc = kvp__err(KVP_ENOMEM, "gather table");
    return 1;
  }
  kvp__gjob_fill(r, b, c->head, a, e, c->row, (uint16_t)(c->seg * 4 + (b->raw ? 1 : 0)));
  if (c->req->positions_out) {
    uint32_t *pos = c->req->positions_out + (size_t)c->row * H + c->head;
    for (uint32_t i = 0; i < m; i++) pos[(size_t)i * H] = a + i;
  }
  c->row += m;
  return 0;
}

static int gather_check(kvp_pool *pool, const kvp_gather_req *q) {
  if (!pool || !q) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "gather request" : "pool");
  if (q->struct_size < sizeof *q)
    return kvp__err(KVP_EINVAL, "gather_req.struct_size %zu < %zu", q->struct_size, sizeof *q);
  if (pool->cfg.memory != KVP_MEM_CUDA || !pool->dev)
    return kvp__err(KVP_ENOTSUP, "gather: the pool's region is not a CUDA region with payload (use kvp_read)");
  if (pool->alloc.region.bytes > (64ull << 32))
    return kvp__err(KVP_ENOTSUP, "gather: the region of %llu bytes passes the 256 GiB its block table addresses",
                    (unsigned long long)pool->alloc.region.bytes);
  if (q->n_items && !q->items) return kvp__err(KVP_EINVAL, "gather: items is NULL with n_items = %u", q->n_items);
  if (!q->k_out || !q->v_out || (uintptr_t)q->k_out % 16 || (uintptr_t)q->v_out % 16)
    return kvp__err(KVP_EINVAL, "gather: k_out and v_out must be device buffers aligned to 16 bytes");
  for (uint32_t i = 0; i < q->n_items; i++)
    if (q->items[i].layer >= pool->cfg.n_layers)
      return kvp__err(KVP_EINVAL, "gather: items[%u].layer = %u >= n_layers %u", i, q->items[i].layer,
                      pool->cfg.n_layers);
  return KVP_OK;
}

/* Rows of each item (the most tokens a head retains) and the output rows
 * in all; heads' counts in counts[i * H + h]. Under the read lock. */
static int gather_rows(kvp_pool *pool, kvp_gather_req *req, kvp__seq **seqs, uint32_t *counts, uint64_t *rows) {
  uint32_t H = pool->cfg.n_kv_heads;
  *rows = 0;
  for (uint32_t i = 0; i < req->n_items; i++) {
    kvp_gather_item *it = &req->items[i];
    if (!(seqs[i] = kvp__seq_find(pool, it->seq)))
      return kvp__err(KVP_ENOENT, "gather: items[%u]: sequence %llu does not exist", i, (unsigned long long)it->seq);
    uint32_t most = 0;
    for (uint32_t h = 0; h < H; h++) {
      uint64_t t = count_retained(&seqs[i]->layers[it->layer], h);
      counts[(size_t)i * H + h] = (uint32_t)t;
      most = t > most ? (uint32_t)t : most;
    }
    it->row0 = (uint32_t)*rows;
    it->n_rows = most;
    *rows += most;
  }
  return KVP_OK;
}

KVP_API int kvp_gather(kvp_pool *pool, kvp_gather_req *req) {
  int rc = gather_check(pool, req);
  if (rc) return rc;
  uint32_t H = pool->cfg.n_kv_heads, n = req->n_items;
  size_t nseqs = n ? n : 1, ncounts = n && H ? (size_t)n * H : 1;
  kvp__seq **seqs = kvp__meta_calloc(NULL, nseqs * sizeof *seqs);
  uint32_t *counts = kvp__meta_calloc(NULL, ncounts * sizeof *counts);
  req->n_launches = 0;
  uint64_t rows = 0;
  kvp__dev_gather g;
  memset(&g, 0, sizeof g);
  kvp__rcu_read_lock();
  if (!seqs || !counts) rc = kvp__err(KVP_ENOMEM, "gather scratch for %u items", n);
  if (!rc) rc = gather_rows(pool, req, seqs, counts, &rows);
  req->n_rows = (uint32_t)rows;
  if (!rc && rows > req->capacity_rows)
    rc = kvp__err(KVP_ENOSPC, "gather: needs %llu rows, capacity_rows is %u", (unsigned long long)rows,
                  req->capacity_rows);
  if (!rc) rc = kvp__dev_gather_begin(pool, &g, req);
  for (uint32_t i = 0; !rc && i < n; i++) { /* one walk per head, bounded by the counts */
    kvp_gather_item *it = &req->items[i];
    bool ragged = false;
    if (req->positions_out)
      for (size_t r = 0; r < (size_t)it->n_rows * H; r++) req->positions_out[(size_t)it->row0 * H + r] = UINT32_MAX;
    if ((rc = kvp__dev_gather_segment(&g, it->layer, i))) break;
    for (uint32_t h = 0; !rc && h < H; h++) {
      gather_ctx c = {.pool = pool, .req = req, .head = h, .row = it->row0, .g = &g, .seg = g.seg_of_layer[it->layer]};
      kvp__walk_ranges(seqs[i], pool, it->layer, h, counts[(size_t)i * H + h], gather_range, &c);
      rc = c.rc;
      ragged |= c.row != it->row0 + it->n_rows;
    }
    if (!rc && ragged) kvp__dev_gather_ragged(&g, it->row0, it->n_rows);
  }
  if (!rc) rc = kvp__dev_gather_run(pool, &g);
  kvp__dev_gather_end(pool, &g);
  kvp__rcu_read_unlock();
  kvp__meta_free(NULL, seqs, nseqs * sizeof *seqs);
  kvp__meta_free(NULL, counts, ncounts * sizeof *counts);
  return rc;
}
#else
KVP_API int kvp_gather(kvp_pool *pool, kvp_gather_req *req) {
  (void)pool, (void)req;
  return kvp__err(KVP_ENOTSUP, "gather: kvpool was built without CUDA");
}
#endif
