/*
 * pages/attend.c - kvp_attend_decode: decode attention over a CUDA pool's
 * pages (the kernels: kernels/attend.cu).
 *
 * The host part, under the read lock: for each (sequence, KV head) of the
 * batch, one kvp__gjob record per retained token range of a block (the
 * gather's records, tag 0 for the layer's codec, 1 for the RAW tail), in
 * position order; then the splits, runs of whole records of one (sequence,
 * KV head) of about split_tokens tokens, so that a batch of one long
 * sequence still gives every SM several thread blocks; then the split
 * index. All three go into one buffer (the pool's pinned stage when free)
 * and cross to the workspace in one copy; partial results of
 * (sequence, KV head)s with several splits follow them in the workspace.
 * Where the layer's kernel reads its records in coalesced batches (raw
 * bf16; fp8 and int8 at head_dim 64 and 128) and the table is in the
 * pinned stage, the records stay there and the kernel reads them over the
 * bus as it goes: only the splits and the index are copied, and the table's
 * transfer overlaps the attention instead of preceding it.
 *
 * Page lifetime: the kernels are enqueued before the read lock is left, and
 * pages retired after that are reused only after an RCU grace period and a
 * device drain (kvp__reclaim), so every page the table names stays valid
 * until the kernels that read it ended; no pins needed per call.
 */
#include "../codecs/builtin.h"
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

/* Auto split size: as many splits as the device runs thread blocks of the
 * layer's kernel at once (one wave: a second, partial one would cost a
 * whole block's time), at least this many tokens each (fewer leave the
 * merge dominant). */
#define SPLIT_MIN_TOKENS 64u

typedef struct attend_ctx {
  kvp_pool *pool;
  kvp__dev_gather *g;
  uint32_t head;
  uint64_t tokens;  /* token-heads recorded */
  double bytes;     /* page bytes the kernel reads */
  int rc;
} attend_ctx;

static int attend_range(void *vctx, kvp__block *b, uint32_t a, uint32_t e) {
  attend_ctx *c = vctx;
  uint32_t m = e - a;
  kvp__gjob *r = kvp__dev_gather_slot(c->pool, c->g);
  if (!r) {
    c->rc = kvp__err(KVP_ENOMEM, "attention block table");
    return 1;
  }
  kvp__gjob_fill(r, b, c->head, a, e, 0, b->raw ? 1 : 0);
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv]; i++) c->bytes += (double)b->pages[kv][i].requested_bytes * m / b->cap_tokens;
  c->tokens += m;
  return 0;
}

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

/* The kernels' parameters of layer's four bindings; KVP_ENOTSUP names a
 * codec the kernel cannot read. */
static int attend_bindings(kvp_pool *pool, uint32_t layer, kvp__kparams kp[4]) {
  const kvp__binding *bd[4] = {&pool->bind[2 * layer], &pool->tail[0], &pool->bind[2 * layer + 1], &pool->tail[1]};
  for (int i = 0; i < 4; i++)
    if (kvp__codec_kparams(bd[i]->vt, bd[i]->inst, &kp[i]))
      return kvp__err(KVP_ENOTSUP, "attend: layer %u %c: codec %s has no in-kernel reader", layer, "KV"[i / 2],
                      bd[i]->vt->name);
  return KVP_OK;
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Splits of the table: recs_at[bh] .. recs_at[bh + 1] are bh's records,
 * tok_of[bh] their tokens. Writes them (NULL: counts) and returns their
 * number; *slots: the partial-result slots used. */
static uint32_t make_splits(const kvp__gjob *recs, const uint32_t *recs_at, const uint64_t *tok_of, uint32_t nbh,
                            uint32_t chunk, kvp__asplit *out, uint32_t *bh_split0, uint32_t *slots) {
  uint32_t n = 0, nslot = 0;
  for (uint32_t bh = 0; bh < nbh; bh++) {
    uint32_t first = n, r = recs_at[bh], end = recs_at[bh + 1];
    uint64_t total = tok_of[bh];
    /* at most ceil(total / chunk) splits of about equal tokens (whole
     * records): split k ends at the record boundary nearest to k + 1 parts
     * of the tokens, so the count is what wave_chunk planned for (one
     * split more than the device holds at once would cost a second wave) */
    uint64_t parts = total ? (total + chunk - 1) / chunk : 1, cum = 0;
    if (bh_split0) bh_split0[bh] = n;
    do { /* at least one split per bh: a head with no tokens writes zeros */
      uint32_t r0 = r;
      uint64_t target = total * (n - first + 1) / parts;
      while (r < end && (r == r0 || 2 * (cum + recs[r].m1 + 1u) <= 2 * target + recs[r].m1 + 1u))
        cum += recs[r++].m1 + 1u;
      if (out) out[n] = (kvp__asplit){r0, r - r0, bh, 0};
      n++;
    } while (r < end);
    if (out)
      for (uint32_t s = first; s < n; s++) out[s].slot = n - first > 1 ? nslot + (s - first) : KVP__ASPLIT_ONLY;
    if (n - first > 1) nslot += n - first;
  }
  if (bh_split0) bh_split0[nbh] = n;
  *slots = nslot;
  return n;
}

/* The smallest split size (tokens, >= SPLIT_MIN_TOKENS) whose splits,
 * ceil(bh's tokens / size) per (sequence, KV head), fit in slots thread
 * blocks (or one split per bh when there are more bh than slots). */
static uint64_t wave_chunk(const uint64_t *tok_of, uint32_t nbh, uint64_t tokens, uint32_t slots) {
  if (slots < nbh) slots = nbh;
  uint64_t ch = (tokens + slots - 1) / slots;
  if (ch < SPLIT_MIN_TOKENS) ch = SPLIT_MIN_TOKENS;
  for (int it = 0; it < 8; it++) {
    uint64_t n = 0, most = 0;
    for (uint32_t bh = 0; bh < nbh; bh++) {
      uint64_t t = tok_of[bh];
      n += t ? (t + ch - 1) / ch : 1;
      if (t > most) most = t;
    }
    if (n <= slots || ch >= most) break;
    ch = ch * n / slots + 1; /* fewer, longer splits */
  }
  return ch;
}

KVP_API int kvp_attend_decode(kvp_pool *pool, kvp_attend_req *req) {
  int rc = attend_check(pool, req);
  if (rc) return rc;
  req->n_splits = 0, req->token_heads = 0, req->bytes_read = 0, req->workspace_needed = 0;
  if (!req->batch) return KVP_OK;
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim, G = req->n_q_heads / H, nbh = req->batch * H;
  kvp__attend_args a;
  memset(&a, 0, sizeof a);
  if ((rc = attend_bindings(pool, req->layer, a.p))) return rc;
  /* scratch: each bh's first record (and the end), each bh's tokens */
  size_t scratch = (size_t)(nbh + 1) * sizeof(uint32_t) + (size_t)nbh * sizeof(uint64_t);
  uint64_t *tok_of = kvp__meta_alloc(NULL, scratch);
  if (!tok_of) return kvp__err(KVP_ENOMEM, "attend scratch for a batch of %u", req->batch);
  uint32_t *recs_at = (uint32_t *)(tok_of + nbh);
  kvp__dev_gather g;
  memset(&g, 0, sizeof g);
  attend_ctx c = {.pool = pool, .g = &g};
  kvp__rcu_read_lock();
  rc = kvp__dev_gather_begin(pool, &g, NULL);
  for (uint32_t b = 0; !rc && b < req->batch; b++) {
    kvp__seq *s = kvp__seq_find(pool, req->seqs[b]);
    if (!s) {
      rc = kvp__err(KVP_ENOENT, "attend: seqs[%u]: sequence %llu does not exist", b, (unsigned long long)req->seqs[b]);
      break;
    }
    for (uint32_t h = 0; !rc && h < H; h++) {
      if (g.n >= UINT32_MAX / 2) {
        rc = kvp__err(KVP_EINVAL, "attend: the batch's block table passes 2^31 records");
        break;
      }
      recs_at[b * H + h] = (uint32_t)g.n;
      c.head = h;
      uint64_t tok0 = c.tokens;
      kvp__walk_ranges(s, pool, req->layer, h, UINT64_MAX, attend_range, &c);
      tok_of[b * H + h] = c.tokens - tok0;
      rc = c.rc;
    }
  }
  uint32_t nsplit = 0, nslot = 0, chunk = 0, nrec = 0;
  uint32_t kind = kvp__kern_attend_kind(a.p), rb = kvp__kern_attend_rec_bytes(kind);
  uint64_t off_splits = 0, off_bh = 0, table = 0, off_part = 0, sp_bytes = 0;
  if (!rc) {
    nrec = recs_at[nbh] = (uint32_t)g.n;
    uint64_t ch = req->split_tokens;
    if (!ch) ch = wave_chunk(tok_of, nbh, c.tokens, kvp__dev_attend_slots(pool, a.p));
    chunk = ch > UINT32_MAX ? UINT32_MAX : (uint32_t)ch;
    nsplit = make_splits(g.recs, recs_at, tok_of, nbh, chunk, NULL, NULL, &nslot);
    /* the table: the kernel's records (rb bytes each), the splits, their index */
    off_splits = align_up((uint64_t)nrec * rb, 16);
    off_bh = off_splits + (uint64_t)nsplit * sizeof(kvp__asplit);
    sp_bytes = (uint64_t)nsplit * sizeof(kvp__asplit) + (uint64_t)(nbh + 1) * 4;
    table = off_splits + sp_bytes;
    off_part = align_up(table, 256);
    req->workspace_needed = off_part + (uint64_t)nslot * G * (2 + D) * sizeof(float);
    req->n_splits = nsplit, req->token_heads = c.tokens, req->bytes_read = (uint64_t)c.bytes;
    if (req->workspace_needed > req->workspace_bytes)
      rc = kvp__err(KVP_ENOSPC, "attend: %u splits over %llu block records need %llu bytes of workspace, %llu given",
                    nsplit, (unsigned long long)nrec, (unsigned long long)req->workspace_needed,
                    (unsigned long long)req->workspace_bytes);
  }
  /* built in place: the splits after the kvp__gjob records, then the
   * records rewritten in the kernel's form and the splits moved behind them */
  uint64_t gj_bytes = align_up((uint64_t)nrec * sizeof(kvp__gjob), 16);
  while (!rc && g.n * sizeof(kvp__gjob) < gj_bytes + sp_bytes)
    if (!kvp__dev_gather_slot(pool, &g)) rc = kvp__err(KVP_ENOMEM, "attention block table");
  if (!rc) {
    char *t = (char *)g.recs;
    make_splits(g.recs, recs_at, tok_of, nbh, chunk, (kvp__asplit *)(t + gj_bytes),
                (uint32_t *)(t + gj_bytes + (uint64_t)nsplit * sizeof(kvp__asplit)), &nslot);
    if (rb != sizeof(kvp__gjob)) {
      kvp__kern_attend_compact(kind, t, nrec);
      memmove(t + off_splits, t + gj_bytes, sp_bytes);
    }
    char *ws = req->workspace;
    a.region_base = pool->alloc.region.base;
    a.recs = ws;
    a.splits = (const kvp__asplit *)(ws + off_splits);
    a.bh_split0 = (const uint32_t *)(ws + off_bh);
    a.q = req->q;
    a.out = req->out;
    a.part = (float *)(ws + off_part);
    a.scale = req->scale;
    a.out_dtype = req->out_dtype, a.n_q_heads = req->n_q_heads, a.n_kv_heads = H, a.head_dim = D;
    a.batch = req->batch, a.n_splits = nsplit, a.reduce = nslot > 0;
    rc = kvp__dev_attend_run(pool, &g, table, &a, req->stream);
  }
  kvp__dev_gather_end(pool, &g);
  kvp__rcu_read_unlock();
  kvp__meta_free(NULL, tok_of, scratch);
  return rc;
}

#else

KVP_API int kvp_attend_decode(kvp_pool *pool, kvp_attend_req *req) {
  (void)pool, (void)req;
  return kvp__err(KVP_ENOTSUP, "attend: kvpool was built without CUDA");
}

#endif
