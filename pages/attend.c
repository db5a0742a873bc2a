/*
 * pages/attend.c - kvp_attend_decode: decode attention over a CUDA pool's
 * pages (the kernels: kernels/attend.cu).
 *
 * The host part, under the read lock: the block table (pages/attend_table.c
 * builds it): for each (sequence, KV head) of the batch, one record per
 * retained token range of a block in position order, in the form the
 * layer's kernel reads (tag 0 for the layer's codec, 1 for the RAW tail);
 * then the splits, runs of whole records of one (sequence, KV head) of
 * about split_tokens tokens, so that a batch of one long sequence still
 * gives every SM several thread blocks; then the split index. All three go
 * into one buffer (the pool's pinned stage when free) and cross to the
 * workspace in one copy; partial results of (sequence, KV head)s with
 * several splits follow them in the workspace. Where the layer's kernel
 * reads its records in coalesced batches (raw bf16; fp8 and int8 at
 * head_dim 64 and 128) and the table is in the pinned stage, the records
 * stay there and the kernel reads them over the bus as it goes: only the
 * splits and the index are copied, and the table's transfer overlaps the
 * attention instead of preceding it.
 *
 * A decode step changes a layer's table only at each (sequence, head)'s
 * end, so the table is kept per layer and, while the pool's structure has
 * not changed (pages.h: sgen), reused with those ends redone: each last
 * record, and where a sequence's layer added blocks or resealed its tail
 * (pages.h: tgen) its records from the last block on; sequences new to the
 * batch, or whose structure changed (kvp__seq.sgen), are walked alone
 * (kvp__attend_build_kept): a call's host part is then a copy of the
 * records, not a walk of every block. Where the kernel reads its records in
 * place (the zero-copy kinds above), the kept records are pinned and read
 * where they are: the call redoes the ends there and places the splits by
 * prefix sums, and only the splits and the index cross. The kept table stays held (t.hold) until the kernels
 * are enqueued; an event recorded after them is waited for before its
 * records change again.
 *
 * Page lifetime: the kernels are enqueued before the read lock is left, and
 * pages retired after that are reused only after an RCU grace period and a
 * device drain (kvp__reclaim), so every page the table names stays valid
 * until the kernels that read it ended; no pins needed per call.
 */
#include "pages.h"

#include <math.h>
#include <string.h>

KVP_API void kvp_attend_req_init(kvp_attend_req *req) {
  if (!req) return;
  memset(req, 0, sizeof *req);
  req->struct_size = sizeof *req;
  req->out_dtype = KVP_DTYPE_BF16;
}

#ifdef KVP_HAVE_CUDA

static int attend_check(kvp_pool *pool, const kvp_attend_req *q) {
  if (!pool || !q) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "attend request" : "pool");
  if (q->struct_size < sizeof *q)
    return kvp__err(KVP_EINVAL, "attend_req.struct_size %zu < %zu", q->struct_size, sizeof *q);
  if (pool->cfg.memory != KVP_MEM_CUDA || !pool->dev)
    return kvp__err(KVP_ENOTSUP, "attend: the pool's region is not a CUDA region with payload");
  if (pool->alloc.region.bytes > (64ull << 32))
    return kvp__err(KVP_ENOTSUP, "attend: the region of %llu bytes passes the 256 GiB its block table addresses",
                    (unsigned long long)pool->alloc.region.bytes);
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim;
  if (q->layer >= pool->cfg.n_layers)
    return kvp__err(KVP_EINVAL, "attend: layer %u >= n_layers %u", q->layer, pool->cfg.n_layers);
  if (D != 32 && D != 64 && D != 128 && D != 256)
    return kvp__err(KVP_ENOTSUP, "attend: head_dim %u (the kernel takes 32, 64, 128 or 256)", D);
  if (!q->n_q_heads || q->n_q_heads % H)
    return kvp__err(KVP_EINVAL, "attend: n_q_heads %u is not a positive multiple of n_kv_heads %u", q->n_q_heads, H);
  if (q->n_q_heads / H > KVP__KERN_ATTEND_MAX_GROUP)
    return kvp__err(KVP_ENOTSUP, "attend: %u query heads per KV head (at most %u)", q->n_q_heads / H,
                    KVP__KERN_ATTEND_MAX_GROUP);
  if (q->batch && !q->seqs) return kvp__err(KVP_EINVAL, "attend: seqs is NULL with batch = %u", q->batch);
  if (q->batch && (!q->q || !q->out || (uintptr_t)q->q % 16 || (uintptr_t)q->out % 16))
    return kvp__err(KVP_EINVAL, "attend: q and out must be device buffers aligned to 16 bytes");
  if (q->out_dtype != KVP_DTYPE_BF16 && q->out_dtype != KVP_DTYPE_F32)
    return kvp__err(KVP_EINVAL, "attend: out_dtype %d (bf16 or f32)", (int)q->out_dtype);
  if (!isfinite(q->scale)) return kvp__err(KVP_EINVAL, "attend: scale is not finite");
  if (q->workspace_bytes && (!q->workspace || (uintptr_t)q->workspace % 16))
    return kvp__err(KVP_EINVAL, "attend: workspace must be a device buffer aligned to 16 bytes (%llu bytes given)",
                    (unsigned long long)q->workspace_bytes);
  if ((uint64_t)q->batch * H >= UINT32_MAX)
    return kvp__err(KVP_EINVAL, "attend: batch %u x %u KV heads is too many", q->batch, H);
  return KVP_OK;
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* The table grows in the gather's buffer: the pinned stage while it can.
 * The stage is taken when the table first needs room (a kept table read in
 * place needs none: it takes no stage and waits for none). */
typedef struct stage_ctx {
  kvp_pool *pool;
  kvp__dev_gather *g;
  bool begun; /* g is begun (kvp__dev_gather_begin): end it */
} stage_ctx;

static int stage_grow(kvp__abuf *buf, uint64_t used, uint64_t need) {
  stage_ctx *c = buf->ctx;
  if (!c->begun) {
    int rc = kvp__dev_gather_begin(c->pool, c->g, NULL);
    if (rc) return rc;
    c->begun = true;
  }
  int rc = kvp__dev_gather_reserve(c->pool, c->g, used, need);
  buf->p = (unsigned char *)c->g->recs;
  buf->cap_bytes = c->g->cap * sizeof(kvp__gjob);
  return rc;
}

KVP_API int kvp_attend_decode(kvp_pool *pool, kvp_attend_req *req) {
  int rc = attend_check(pool, req);
  if (rc) return rc;
  req->n_splits = 0, req->token_heads = 0, req->bytes_read = 0, req->workspace_needed = 0;
  if (!req->batch) return KVP_OK;
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim, G = req->n_q_heads / H;
  kvp__attend_args a;
  memset(&a, 0, sizeof a);
  if ((rc = kvp__attend_bindings(pool, req->layer, a.p))) return rc;
  kvp__atable t = {.layer = req->layer, .seqs = req->seqs, .batch = req->batch, .kind = kvp__kern_attend_kind(a.p),
                   .split_tokens = req->split_tokens, .slots = kvp__dev_attend_slots(pool, a.p)};
  kvp__dev_gather g;
  memset(&g, 0, sizeof g);
  stage_ctx sc = {pool, &g, false};
  kvp__rcu_read_lock();
  kvp__abuf buf = {NULL, 0, stage_grow, &sc};
  bool kept; /* whether the layer's kept table served */
  rc = kvp__attend_build_kept(pool, &t, &buf, &kept);
  uint64_t off_part = t.tab_dev ? 0 : align_up(t.table_bytes, 256); /* in place: the workspace holds partials alone */
  if (!rc) {
    req->workspace_needed = off_part + (uint64_t)t.nslot * G * (2 + D) * sizeof(float);
    req->n_splits = t.nsplit, req->token_heads = t.token_heads, req->bytes_read = t.bytes_read;
    if (req->workspace_needed > req->workspace_bytes)
      rc = kvp__err(KVP_ENOSPC, "attend: %u splits over %llu block records need %llu bytes of workspace, %llu given",
                    t.nsplit, (unsigned long long)t.nrec, (unsigned long long)req->workspace_needed,
                    (unsigned long long)req->workspace_bytes);
  }
  if (!rc) {
    char *ws = req->workspace;
    a.region_base = pool->alloc.region.base;
    a.recs = ws;
    a.splits = (const kvp__asplit *)(ws + t.off_splits);
    a.bh_split0 = (const uint32_t *)(ws + t.off_bh);
    a.q = req->q;
    a.out = req->out;
    a.part = (float *)(ws + off_part);
    a.scale = req->scale;
    a.out_dtype = req->out_dtype, a.n_q_heads = req->n_q_heads, a.n_kv_heads = H, a.head_dim = D;
    a.batch = req->batch, a.n_splits = t.nsplit, a.reduce = t.nslot > 0;
    rc = kvp__dev_attend_run(pool, &g, t.table_bytes, &a, req->stream, &t);
  }
  kvp__attend_kept_release(pool, &t); /* a kept table read in place: its work is enqueued */
  if (sc.begun) kvp__dev_gather_end(pool, &g);
  kvp__rcu_read_unlock();
  return rc;
}

#else

KVP_API int kvp_attend_decode(kvp_pool *pool, kvp_attend_req *req) {
  (void)pool, (void)req;
  return kvp__err(KVP_ENOTSUP, "attend: kvpool was built without CUDA");
}

#endif
