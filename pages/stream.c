/*
 * pages/stream.c - the append of one layer to a sequence's streams (block
 * codecs; row-wise codecs go to pages/rowwise.c). The objects it builds
 * (blocks, runs, brefs) are pages/block.c's; its transaction with the
 * policy's evictions is pages/evict.c's.
 *
 * Invariants (checked by kvp__seqs_check):
 *   a layer's runs are in step order, disjoint, s0 < s1, p0 < p1, and
 *   p0 = step_pos[s0], p1 = step_pos[s1] (or the open step's end)
 *   retained_tokens(l, h) = sum over runs with bit h of (p1 - p0)
 *   a stream's blocks are in position order and disjoint; every retained
 *   position of the stream lies in one of them
 *   step mode: each block lies inside one step, and the blocks of a step
 *   cover it exactly
 *
 * Append (all or nothing): plan the new blocks of every head, check the
 * budget for all of them at once, allocate metadata and pages, write the
 * payload, and only then publish (brefs, then the run's end position). A
 * failure before publishing frees what was taken; readers never see it.
 * The policy's evictions of the append (pages/evict.c) are applied with
 * the publication, or first when only they make room, undoably until the
 * publication.
 *
 * OPEN blocks (stream mode) get pages for their full capacity, as paged
 * engines do: a decode token is a row copy, with no ledger traffic until a
 * block fills. The bytes of unfilled slots show as requested bytes above
 * the bf16-equivalent figure. Such a token takes the fill-only fast path
 * (append_fill): no plan, the NaN/Inf screen done by the copy itself, the
 * heads' tail pages looked up once, a publication of a few stores.
 *
 * A token that fills the tails up and opens a block per head takes the
 * general plan, its block structs and brefs from the writer's metadata
 * cache (kvp__meta_calloc_w; a raw block's struct is 128 bytes, pages.h)
 * and its rows one scatter per side (fill_scatter).
 *
 * A step-mode step under a passthrough codec (a VAR scale, a video chunk)
 * takes the fresh-block path (append_fresh): the
 * general plan and transaction, the payload one token-major scatter per
 * block index and side with the screen in the copy, large sides stored
 * around the caches.
 */
#include "../codecs/numeric.h"
#include "pages.h"

#include <string.h>

/* ---- append ------------------------------------------------------------ */

/* The shape of an append, the same for every head of the layer:
 *   fill     tokens into the existing OPEN tail block;
 *   reseal   the tail fills up and its codec is not the tail's raw format:
 *            an encoded copy replaces it;
 *   nnew     new blocks: full ones encoded with the layer's codec, the last
 *            one (stream mode, partial) an OPEN raw block. */
enum { PLAN_INLINE = 32 }; /* entries of a plan's arrays held in the plan itself */
enum { FILL_HEADS = 64 }; /* heads per row-scatter call (their destinations on the stack) */
typedef struct append_plan {
  uint32_t fill;          /* tokens into the OPEN tail */
  bool reseal;            /* the tail is sealed into an encoded block */
  uint32_t nnew;          /* new blocks per head */
  uint32_t last_cap;      /* capacity of the last new block */
  bool last_raw;          /* the last new block stays OPEN (raw) */
  uint64_t bytes;         /* allocated bytes of all new pages, every head */
  uint32_t nb;            /* blocks per head to take: nnew + reseal */
  const uint64_t *skip;   /* heads not stored (step mode, a policy's choice), or NULL */
  uint32_t nskip;         /* how many */
  kvp__block **blocks;    /* [H * nb]: per head the new blocks, then the resealed tail (NULL: skipped) */
  kvp__bref **brefs;      /* [H * nnew] */
  kvp__run *run;          /* new run, or NULL to extend the last */
  bool run_always;        /* take a run even if the last one extends now (evictions come first) */
  /* blocks and brefs when they fit (a decode token opening a block per
   * head): no metadata allocation for them; not zeroed by plan_shape */
  kvp__block *blocks_in[PLAN_INLINE];
  kvp__bref *brefs_in[PLAN_INLINE];
} append_plan;

/* A plan's fields zeroed, its arrays' room left as it is. */
static void plan_clear(append_plan *pl) { memset(pl, 0, offsetof(append_plan, blocks_in)); }

static bool skipped(const append_plan *pl, uint32_t h) { return pl->skip && (pl->skip[h / 64] >> (h % 64)) & 1; }

static void plan_shape(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t pos, const uint64_t *skip,
                       append_plan *pl) {
  uint32_t n = s->cur_tokens, bt = kvp__layer_bt(pool, layer, s->mode), H = pool->cfg.n_kv_heads;
  kvp__bref *tail = kvp__seq_stream(pool, s, layer, 0)->tail;
  bool stream = s->mode == KVP_SEQ_STREAM;
  bool pass = pool->bind[2 * layer].passthrough && pool->bind[2 * layer + 1].passthrough;
  plan_clear(pl);
  pl->skip = stream ? NULL : skip; /* stream-mode tails stay the same across heads */
  for (uint32_t h = 0; pl->skip && h < H; h++) pl->nskip += skipped(pl, h);
  if (stream && tail && !tail->blk->sealed) {
    uint32_t room = tail->blk->cap_tokens - tail->blk->n_tokens;
    pl->fill = n < room ? n : room;
    pl->reseal = pl->fill == room && !pass;
  }
  uint32_t rest = n - pl->fill;
  pl->nnew = (rest + bt - 1) / bt;
  pl->last_cap = rest % bt ? (stream ? bt : rest % bt) : bt;
  pl->last_raw = stream && rest % bt != 0;
  pl->nb = pl->nnew + pl->reseal;
  uint64_t per_head = 0;
  uint32_t start = pos + pl->fill;
  for (uint32_t j = 0; j < pl->nnew; j++) {
    bool last = j + 1 == pl->nnew;
    per_head += kvp__block_class_bytes(pool, layer, last && pl->last_raw, start + j * bt, last ? pl->last_cap : bt);
  }
  if (pl->reseal) per_head += kvp__block_class_bytes(pool, layer, false, tail->blk->pos0, tail->blk->cap_tokens);
  pl->bytes = (uint64_t)(H - pl->nskip) * per_head;
}

/* The heads the append stores. */
static void stored_mask(const kvp_pool *pool, const append_plan *pl, uint64_t *mask) {
  memset(mask, 0, KVP_MAX_KV_HEADS / 8);
  for (uint32_t h = 0; h < pool->cfg.n_kv_heads; h++)
    if (!skipped(pl, h)) mask[h / 64] |= 1ull << (h % 64);
}

/* The plan's per-head arrays, zeroed. A decode token that only fills the
 * OPEN tail takes no new block, so both arrays are empty: an empty one is
 * a shared sentinel (never read or written); one that opens a block per
 * head uses the plan's own room (in); only larger ones (a prefill's many
 * blocks) are metadata allocations. */
static void *plan_none[1];
static void *plan_array(kvp_pool *pool, void *in, size_t in_bytes, size_t bytes) {
  if (!bytes) return (void *)plan_none;
  return bytes <= in_bytes ? memset(in, 0, bytes) : kvp__meta_calloc(&pool->meta, bytes);
}
static void plan_array_free(kvp_pool *pool, void *p, const void *in, size_t bytes) {
  if (bytes && p != in) kvp__meta_free(&pool->meta, p, bytes);
}

static void plan_undo(kvp_pool *pool, append_plan *pl, uint32_t nblocks) {
  uint32_t H = pool->cfg.n_kv_heads;
  for (uint32_t i = 0; pl->blocks && i < nblocks; i++) /* either array may be missing (its allocation failed) */
    if (pl->blocks[i]) kvp__block_destroy(pool, pl->blocks[i]);
  for (uint32_t i = 0; pl->brefs && i < H * pl->nnew; i++) kvp__bref_free_now(pool, pl->brefs[i]);
  if (pl->run) kvp__run_free_now(pool, pl->run);
  plan_array_free(pool, pl->blocks, pl->blocks_in, (size_t)H * pl->nb * sizeof *pl->blocks);
  plan_array_free(pool, pl->brefs, pl->brefs_in, (size_t)H * pl->nnew * sizeof *pl->brefs);
  pl->blocks = NULL, pl->brefs = NULL, pl->run = NULL; /* undone: a second undo does nothing */
}

/* Pages of every block of the plan (their structs taken by plan_take); on
 * failure the pages taken are given back and the metadata stays. */
static int plan_take_pages(kvp_pool *pool, kvp__seq *s, uint32_t layer, append_plan *pl) {
  uint32_t H = pool->cfg.n_kv_heads;
  for (uint32_t i = 0; i < H * pl->nb; i++) {
    kvp__block *b = pl->blocks[i];
    if (!b) continue; /* a skipped head */
    kvp_codec_layout lay[2];
    for (int kv = 0; kv < 2; kv++) kvp__bind_layout(kvp__block_binding(pool, layer, kv, b), b->pos0, b->cap_tokens, &lay[kv]);
    int rc = kvp__block_take_pages(pool, b, s->id, layer, i / pl->nb, lay);
    if (rc) {
      while (i--)
        if (pl->blocks[i]) kvp__block_give_pages(pool, pl->blocks[i]);
      return rc;
    }
  }
  return KVP_OK;
}

/* The plan's metadata: arrays, run, brefs, codec states, block structs and
 * the sequence's stats slot; nothing the budget or the region limits, so it
 * is taken before any eviction may make room. On failure nothing is left
 * taken but zeroed codec states. */
static int plan_take(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t pos, append_plan *pl) {
  uint32_t H = pool->cfg.n_kv_heads, bt = kvp__layer_bt(pool, layer, s->mode);
  uint32_t step = atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1;
  pl->blocks = plan_array(pool, pl->blocks_in, sizeof pl->blocks_in, (size_t)H * pl->nb * sizeof *pl->blocks);
  pl->brefs = plan_array(pool, pl->brefs_in, sizeof pl->brefs_in, (size_t)H * pl->nnew * sizeof *pl->brefs);
  pl->run = NULL;
  bool ok = pl->blocks && pl->brefs;
  uint64_t mask[KVP_MAX_KV_HEADS / 64];
  stored_mask(pool, pl, mask);
  /* a run, unless the last one extends; with evictions to apply before the
   * publication (they may split it) always one: kvp__run_settle decides */
  if (ok && pl->nskip < H && (pl->run_always || !kvp__run_extends(pool, &s->layers[layer], step, mask)))
    ok = (pl->run = kvp__run_new(pool, step, pos, step + 1, pos + s->cur_tokens, mask)) != NULL;
  for (uint32_t i = 0; ok && i < H * pl->nnew; i++)
    ok = skipped(pl, i / (pl->nnew ? pl->nnew : 1)) || (pl->brefs[i] = kvp__bref_new_w(pool));
  if (!ok) {
    plan_undo(pool, pl, 0);
    return kvp__err(KVP_ENOMEM, "metadata for the append of seq %llu layer %u", (unsigned long long)s->id, layer);
  }
  for (uint32_t h = 0; h < H && (pl->nnew || pl->reseal); h++)
    for (int kv = 0; kv < 2; kv++) {
      void *st;
      int rc = kvp__cstate_get(pool, kvp__seq_stream(pool, s, layer, h), layer, kv, &st);
      if (rc) { /* states taken stay with their streams: they are zeroed, unused */
        plan_undo(pool, pl, 0);
        return rc;
      }
    }
  uint32_t start = pos + pl->fill;
  for (uint32_t h = 0; h < H; h++)
    for (uint32_t j = 0; j < pl->nb && !skipped(pl, h); j++) {
      kvp__block **slot = &pl->blocks[h * pl->nb + j];
      if (j < pl->nnew) {
        bool last = j + 1 == pl->nnew;
        *slot = kvp__block_struct_w(pool, start + j * bt, last ? pl->last_cap : bt, last && pl->last_raw);
      } else { /* the encoded copy of the tail */
        const kvp__block *t = kvp__seq_stream(pool, s, layer, h)->tail->blk;
        *slot = kvp__block_struct_w(pool, t->pos0, t->cap_tokens, false);
      }
      if (!*slot) {
        plan_undo(pool, pl, h * pl->nb + j);
        return kvp__err(KVP_ENOMEM, "block metadata for the append of seq %llu layer %u", (unsigned long long)s->id,
                        layer);
      }
    }
  if (kvp__stats_reserve_seq(&pool->stats, s->id)) { /* so the pages' counting cannot fail */
    plan_undo(pool, pl, H * pl->nb);
    return kvp__err(KVP_ENOMEM, "stats slot of seq %llu", (unsigned long long)s->id);
  }
  return KVP_OK;
}

static void page_ptrs(kvp_pool *pool, const kvp__block *b, int kv, void **out) {
  for (unsigned i = 0; i < b->npages[kv]; i++) out[i] = kvp__page_addr(&pool->alloc, &KVP__PG(b, i)[kv]);
}

/* Bytes of one appended row of side kv (head_dim elements). */
static inline size_t stride_row(const kvp_pool *pool, int kv) {
  kvp_dtype dt = kv ? pool->cfg.v_dtype : pool->cfg.k_dtype;
  return (size_t)pool->cfg.head_dim * (dt == KVP_DTYPE_F32 ? 4 : 2);
}

/* Write n rows of one side into block b of head from token t0 (t0 > 0 only
 * for a raw OPEN block); rows src_stride bytes apart. On a CUDA region the
 * write is a job of db, run once per append (kvp__dev_batch_run). */
static int write_rows(kvp_pool *pool, uint32_t layer, uint32_t head, kvp__block *b, int kv, uint32_t t0,
                      const unsigned char *src, size_t stride, uint32_t n, void *state, kvp__dev_batch *db) {
  const kvp__binding *bd = kvp__block_binding(pool, layer, kv, b);
  if (!db && b->raw && bd->passthrough) { /* an OPEN block's rows as appended: the copy raw's encode would do,
                                              without the page table, the dispatch and the dtype lookups */
    size_t row = stride_row(pool, kv);
    unsigned char *dst = (unsigned char *)kvp__page_addr(&pool->alloc, &b->pg0[kv]) + (size_t)t0 * row;
    if (stride == row) memcpy(dst, src, (size_t)n * row);
    else
      for (uint32_t t = 0; t < n; t++) memcpy(dst + (size_t)t * row, src + (size_t)t * stride, row);
    return KVP_OK;
  }
  void *pages[KVP_CODEC_MAX_PAGES];
  page_ptrs(pool, b, kv, pages);
#ifdef KVP_HAVE_CUDA
  if (db) {
    kvp_codec_dev_job j = {.src = src, .stride_bytes = stride, .n = t0 + n, .cap_tokens = b->cap_tokens, .t0 = t0,
                           .m = n, .head = head, .pos0 = b->pos0};
    memcpy(j.pages, pages, sizeof j.pages);
    return kvp__dev_batch_add_state(pool, db, bd, kv, &j, b->raw ? NULL : state);
  }
#else
  (void)db;
#endif
  if (t0) { /* raw: one page, rows at t0 x row bytes */
    kvp__assert(b->raw);
    pages[0] = (unsigned char *)pages[0] + (size_t)t0 * pool->cfg.head_dim * kvp__dtype_bytes(
                                               kvp__raw_store_dtype(bd->inst));
  }
  int rc;
  if (bd->vt->encode_at) {
    kvp_codec_block where = {head, b->pos0};
    rc = bd->vt->encode_at(bd->inst, &where, b->raw ? NULL : state, src, stride, n, b->cap_tokens, pages);
  } else if (state && !b->raw) {
    rc = bd->vt->encode_stateful(bd->inst, state, src, stride, n, b->cap_tokens, pages);
  } else {
    rc = bd->vt->encode(bd->inst, src, stride, n, b->cap_tokens, pages);
  }
  return rc ? kvp__err(KVP_ECODEC, "codec %s failed to encode layer %u %c (status %d)", bd->vt->name, layer, "KV"[kv],
                       rc)
            : KVP_OK;
}

/* NaN or Inf in host input is bad input (kvp_last_error names layer, head,
 * token), unless the pool sanitizes: then the side is copied into scratch
 * with NaN -> 0, +-Inf -> +-max, and *use points at the copy. */
static int screen_input(kvp_pool *pool, uint32_t layer, const kvp_kv *kv, uint32_t n, kvp_kv *use, void **scratch,
                        size_t *scratch_bytes) {
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim;
  *use = *kv;
  for (int side = 0; side < 2; side++) {
    kvp_dtype dt = side ? pool->cfg.v_dtype : pool->cfg.k_dtype;
    const void *src = side ? kv->v : kv->k;
    size_t count = (size_t)n * H * D, at = kvp__row_find_nonfinite(src, dt, count);
    if (at == count) continue;
    if (!(pool->cfg.flags & KVP_POOL_SANITIZE)) {
      float x;
      kvp__row_to_f32(&x, (const unsigned char *)src + at * kvp__dtype_bytes(dt), dt, 1);
      return kvp__err(KVP_EINVAL, "%c of layer %u has %s at head %u, token %u (of the step), channel %u "
                                  "(create the pool with KVP_POOL_SANITIZE to replace such values)",
                      side ? 'V' : 'K', layer, x != x ? "NaN" : x > 0 ? "+Inf" : "-Inf", (uint32_t)(at / D % H),
                      (uint32_t)(at / D / H), (uint32_t)(at % D));
    }
    scratch_bytes[side] = count * kvp__dtype_bytes(dt);
    if (!(scratch[side] = kvp__meta_alloc(&pool->meta, scratch_bytes[side])))
      return kvp__err(KVP_ENOMEM, "scratch to sanitize layer %u %c", layer, "KV"[side]);
    kvp__row_sanitize(scratch[side], src, dt, count);
    if (side) use->v = scratch[side];
    else use->k = scratch[side];
  }
  return KVP_OK;
}

/* All payload of one head and side: tail fill, its reseal, the new blocks. */
static int fill_head(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t h, int side, const unsigned char *src,
                     size_t stride, const append_plan *pl, kvp__dev_batch *db) {
  kvp__stream *st = kvp__seq_stream(pool, s, layer, h);
  void *state = st->cstate[side]; /* allocated by plan_take when the codec keeps state */
  int rc = KVP_OK;
  if (pl->fill) {
    kvp__block *tail = st->tail->blk;
    rc = write_rows(pool, layer, h, tail, side, tail->n_tokens, src, stride, pl->fill, NULL, db);
    if (!rc && pl->reseal) { /* encode the whole tail from its raw rows (on the device: after the fill, in
                                stream order) */
      kvp__block *enc = pl->blocks[h * pl->nb + pl->nnew];
      size_t row = (size_t)pool->cfg.head_dim * kvp__dtype_bytes(side ? pool->cfg.v_dtype : pool->cfg.k_dtype);
      rc = write_rows(pool, layer, h, enc, side, 0, kvp__page_addr(&pool->alloc, &tail->pg0[side]), row,
                      tail->cap_tokens, state, db);
    }
  }
  uint32_t done = pl->fill;
  for (uint32_t j = 0; !rc && j < pl->nnew; j++) {
    kvp__block *b = pl->blocks[h * pl->nb + j];
    uint32_t m = s->cur_tokens - done < b->cap_tokens ? s->cur_tokens - done : b->cap_tokens;
    rc = write_rows(pool, layer, h, b, side, 0, src + done * stride, stride, m, state, db);
    done += m;
  }
  return rc;
}

/* The payload of a plan whose every block written is raw in the appended
 * dtype (the OPEN tail's fill and new OPEN raw blocks, no reseal, every
 * head stored: a decode token opening a block per head): per side and block
 * index one row scatter over the heads (kvp__rows_scatter_finite) instead
 * of a write_rows per (head, side, block). The new blocks' rows go around
 * the caches (kvp__rows_scatter_finite_nt, fenced): pages just taken, whose
 * lines no core holds and no one reads before a later step; the tail's rows
 * with plain stores (the last fill asked for their lines). The input was
 * screened (or sanitized) before: the scatter's own screen finds nothing.
 * False, nothing written, when the plan is not of that shape. */
static bool fill_scatter(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const append_plan *pl) {
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim, n = s->cur_tokens;
  if (pl->nskip || pl->reseal || !pool->tail[0].passthrough || !pool->tail[1].passthrough) return false;
  for (uint32_t j = 0; j < pl->nnew; j++) /* the same kind of block at index j in every head */
    if (!pl->blocks[j]->raw) return false;
  kvp__stream *st = kvp__seq_stream(pool, s, layer, 0);
  if (pl->fill && !st[0].tail->blk->raw) return false;
  for (int side = 0; side < 2; side++) {
    kvp_dtype dt = side ? pool->cfg.v_dtype : pool->cfg.k_dtype;
    size_t row = stride_row(pool, side), stride = H * row;
    const unsigned char *base = side ? kv->v : kv->k;
    uint32_t done = 0;
    for (uint32_t j = 0; j <= pl->nnew; j++) { /* j = 0: the tail's fill; then new block j - 1 */
      uint32_t m = j ? n - done : pl->fill;
      if (j && m > pl->blocks[j - 1]->cap_tokens) m = pl->blocks[j - 1]->cap_tokens;
      for (uint32_t h0 = 0; m && h0 < H; h0 += FILL_HEADS) {
        uint32_t nh = H - h0 < FILL_HEADS ? H - h0 : FILL_HEADS;
        void *d[FILL_HEADS];
        for (uint32_t i = 0; i < nh; i++) {
          const kvp__block *b = j ? pl->blocks[(h0 + i) * pl->nb + j - 1] : st[h0 + i].tail->blk;
          d[i] = (unsigned char *)kvp__page_addr(&pool->alloc, &b->pg0[side]) + (j ? 0 : (size_t)b->n_tokens * row);
        }
        const unsigned char *src = base + (size_t)done * stride + (size_t)h0 * row;
        bool finite = j ? kvp__rows_scatter_finite_nt(d, src, stride, dt, m, nh, D) /* fresh pages: around the caches */
                        : kvp__rows_scatter_finite(d, src, stride, dt, m, nh, D);
        kvp__assert(finite); /* screened before */
        (void)finite;
      }
      done += m;
    }
  }
  return true;
}

static int fill_data(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t pos, const kvp_kv *kv,
                     const append_plan *pl) {
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim;
  if (pool->cfg.memory == KVP_MEM_HOST && fill_scatter(pool, s, layer, kv, pl)) return KVP_OK;
  kvp__dev_batch *db = NULL;
#ifdef KVP_HAVE_CUDA
  kvp__dev_batch batch;
  if (pool->cfg.memory == KVP_MEM_CUDA) kvp__dev_batch_init(&batch, H * (pl->nb + 1), &pool->meta), db = &batch;
#endif
  int rc = KVP_OK;
  for (int side = 0; !rc && side < 2; side++) {
    kvp_dtype dt = side ? pool->cfg.v_dtype : pool->cfg.k_dtype;
    size_t esz = kvp__dtype_bytes(dt), stride = (size_t)H * D * esz;
    const unsigned char *base = side ? kv->v : kv->k;
    for (uint32_t h = 0; !rc && h < H; h++)
      if (!skipped(pl, h)) rc = fill_head(pool, s, layer, h, side, base + (size_t)h * D * esz, stride, pl, db);
  }
#ifdef KVP_HAVE_CUDA
  if (db) {
    if (!rc) rc = kvp__dev_batch_run(pool, db, layer, pos, kv->stream);
    kvp__dev_batch_fini(pool, db);
  }
#endif
  return rc;
}

/* Make one head's part visible: tail, its encoded copy, the new brefs. */
static void publish_head(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t h, append_plan *pl) {
  kvp__stream *st = kvp__seq_stream(pool, s, layer, h);
  uint32_t n = s->cur_tokens;
  if (skipped(pl, h)) { /* not stored: its tokens are evicted as they arrive */
    atomic_store_explicit(&st->evicted_tokens, atomic_load_explicit(&st->evicted_tokens, memory_order_relaxed) + n,
                          memory_order_relaxed);
    return;
  }
  if (pl->fill) {
    kvp__block *tail = st->tail->blk;
    kvp__block_set_n(tail, tail->n_tokens + pl->fill);
    tail->sealed = tail->n_tokens == tail->cap_tokens;
    if (pl->reseal) {
      kvp__block *enc = pl->blocks[h * pl->nb + pl->nnew];
      kvp__block_set_n(enc, enc->cap_tokens);
      enc->sealed = true;
      enc->owners = 1;
      atomic_init(&enc->refs, 1);
      kvp__rcu_assign(st->tail->blk, enc);
      kvp__block_unown(pool, tail); /* readers in flight finish on the raw copy */
    }
  }
  uint32_t done = pl->fill;
  for (uint32_t j = 0; j < pl->nnew; j++) {
    kvp__block *b = pl->blocks[h * pl->nb + j];
    kvp__bref *r = pl->brefs[h * pl->nnew + j];
    kvp__block_set_n(b, n - done < b->cap_tokens ? n - done : b->cap_tokens);
    b->sealed = !b->raw || b->n_tokens == b->cap_tokens;
    b->owners = 1;
    atomic_init(&b->refs, 1);
    done += b->n_tokens;
    r->blk = b;
    if (st->tail) kvp__rcu_assign(st->tail->next, r);
    else kvp__rcu_assign(st->blocks, r);
    st->tail = r;
  }
  atomic_store_explicit(&st->retained_tokens, atomic_load_explicit(&st->retained_tokens, memory_order_relaxed) + n,
                        memory_order_relaxed);
}

/* Make the append visible: every head, then the run's end. */
static void publish(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t pos, append_plan *pl, kvp__append_tx *tx) {
  uint32_t H = pool->cfg.n_kv_heads, n = s->cur_tokens;
  /* no eviction and the last run extended: the streams change at their
   * ends only. Rows into the OPEN tails alone change no structure; new
   * blocks or a reseal are announced by the layer's tail generation, odd
   * from before the first change to after the run's end (pages.h: tgen).
   * Either way the pool's generation stays. */
  bool quiet = !tx || (!tx->before.n && !tx->after.n), grew = pl->nnew || pl->reseal,
       ends = pool->acache && quiet && !pl->run && grew;
  _Atomic uint64_t *tgen = &s->layers[layer].tgen;
  if (ends) atomic_fetch_add(tgen, 1); /* sequentially consistent: before any change */
  kvp__append_tx_before_publish(pool, s, tx);
  for (uint32_t h = 0; h < H; h++) publish_head(pool, s, layer, h, pl);
  kvp__run *run = kvp__run_settle(pool, s, layer, pl->run);
  kvp__run_publish(s, layer, pos + n, run, pl->nskip == H);
  if (ends) atomic_fetch_add(tgen, 1); /* even: a new value, after the run's end */
  pool->w_fill = ends || (quiet && !run && !grew);
  plan_array_free(pool, pl->blocks, pl->blocks_in, (size_t)H * pl->nb * sizeof *pl->blocks);
  plan_array_free(pool, pl->brefs, pl->brefs_in, (size_t)H * pl->nnew * sizeof *pl->brefs);
  kvp__count_tokens(pool, (int64_t)n * (H - pl->nskip), (uint64_t)n * pl->nskip);
  kvp__append_tx_after_publish(pool, s, tx);
}

static int append_layer(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                        kvp__append_tx *tx);

static bool append_fill(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, kvp__append_tx *tx);
static bool append_fresh(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                         kvp__append_tx *tx, int *rc);

int kvp__append_layer(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                      kvp__append_tx *tx) {
  if (pool->cfg.memory != KVP_MEM_HOST) return append_layer(pool, s, layer, kv, skip, tx); /* device input: not screened */
  if (append_fill(pool, s, layer, kv, tx)) return KVP_OK;
  int frc;
  if (append_fresh(pool, s, layer, kv, skip, tx, &frc)) return frc;
  kvp_kv use;
  void *scratch[2] = {NULL, NULL};
  size_t scratch_bytes[2] = {0, 0};
  int rc = screen_input(pool, layer, kv, s->cur_tokens, &use, scratch, scratch_bytes);
  if (!rc) rc = append_layer(pool, s, layer, &use, skip, tx);
  for (int side = 0; side < 2; side++) kvp__meta_free(&pool->meta, scratch[side], scratch_bytes[side]);
  return rc;
}

/* The pages of a plan, for kvp__append_tx_take. */
typedef struct take_ctx {
  kvp__seq *s;
  uint32_t layer;
  append_plan *pl;
} take_ctx;
static int take_pages(kvp_pool *pool, void *vctx) {
  take_ctx *c = vctx;
  return plan_take_pages(pool, c->s, c->layer, c->pl);
}
static void give_pages(kvp_pool *pool, void *vctx) {
  take_ctx *c = vctx;
  for (uint32_t i = 0; i < pool->cfg.n_kv_heads * c->pl->nb; i++)
    if (c->pl->blocks[i]) kvp__block_give_pages(pool, c->pl->blocks[i]);
}

/* Whether the OPEN tail b takes n more tokens with no block of its own
 * kind: room is left after them, or they fill it exactly and the layer's
 * codec keeps the appended dtype as is (passthrough), so the full tail
 * seals as it stands (no encoded copy). */
static bool tail_takes(const kvp__block *b, uint32_t n, bool pass) {
  uint32_t room = b->cap_tokens - b->n_tokens;
  return !b->sealed && b->raw && (room > n || (room == n && pass));
}

/* A step whose tokens only fill the OPEN tails (a decode token on a host
 * pool in stream mode, no eviction with it, the last run extending) needs
 * no block, page, run or metadata: its plan is {fill = n} and nothing
 * else, so plan_shape, plan_take and the transaction's take are skipped
 * and the plan goes straight to fill_data and publish. The tails stay
 * OPEN (room > n), or fill up and seal as they are (tail_takes). */
static bool fill_only(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t step, const kvp__append_tx *tx) {
  if (s->mode != KVP_SEQ_STREAM || pool->cfg.memory != KVP_MEM_HOST || (pool->cfg.flags & KVP_POOL_DRY)) return false;
  if (tx && (tx->before.n || tx->after.n)) return false;
  const kvp__bref *tail = kvp__seq_stream(pool, s, layer, 0)->tail;
  bool pass = pool->bind[2 * layer].passthrough && pool->bind[2 * layer + 1].passthrough;
  if (!tail || !tail_takes(tail->blk, s->cur_tokens, pass)) return false;
  return kvp__run_extends_all(pool, &s->layers[layer], step); /* no skip: every head */
}

/* ---- the fill-only fast path ------------------------------------------------
 * The common decode token: fill_only holds, and every head's tail takes the
 * step (tail_takes: room left after it, or filled exactly under a
 * passthrough codec). Then the append is the rows' copy and a few stores:
 *   write    per side, one kernel call per FILL_HEADS heads
 *            (kvp__rows_scatter_finite): each value is read once, copied to
 *            its head's tail page at row n_tokens and screened in the same
 *            pass, the heads' page addresses gathered first;
 *   publish  per head n_tokens and retained_tokens, then the run's end (the
 *            release store readers wait on), then the token gauges: what
 *            publish does with the plan {fill = n} (a tail that fills up
 *            seals), without the plan's arrays, skip mask and run settle.
 * No plan, metadata, page or ledger bytes: the ledger moves when a block
 * fills (the general path). A non-finite value, or a head whose tail is not
 * so, sends the append on to the screened general path, which fails with
 * its message (or sanitizes, KVP_POOL_SANITIZE) and writes the rows again:
 * the rows this path copied lie past the tails' counts, where no reader
 * looks, so nothing visible changed. The rows' lines are asked for before
 * the copy (prefetch_dsts), and after the publication the next token's
 * (prefetch_next_rows). */
/* The next row of the K and V pages of each OPEN tail of heads [h0, h0 +
 * nh), or false if one of them cannot take the n tokens (tail_takes). */
static bool fill_dsts(kvp_pool *pool, kvp__stream *st, uint32_t h0, uint32_t nh, uint32_t n, bool pass, void **dk,
                      void **dv) {
  size_t rk = stride_row(pool, 0), rv = stride_row(pool, 1);
  for (uint32_t j = 0; j < nh; j++) {
    const kvp__bref *t = st[h0 + j].tail;
    const kvp__block *b = t ? t->blk : NULL;
    if (!b || !tail_takes(b, n, pass)) return false;
    dk[j] = (unsigned char *)kvp__page_addr(&pool->alloc, &b->pg0[0]) + (size_t)b->n_tokens * rk;
    dv[j] = (unsigned char *)kvp__page_addr(&pool->alloc, &b->pg0[1]) + (size_t)b->n_tokens * rv;
  }
  return true;
}

/* Ask for the lines of bytes at p, for writing, four a turn (a decode
 * token asks for 2 x H x 4 lines of 256-byte rows twice: the loop's own
 * instructions stay a quarter of the prefetches'). */
enum { FILL_LINE = 64 }; /* bytes per prefetch: a cache line */
KVP__INLINE void prefetch_w(const unsigned char *p, size_t bytes) {
  size_t o = 0;
  for (; o + 4 * FILL_LINE <= bytes; o += 4 * FILL_LINE) {
    __builtin_prefetch(p + o, 1, 3);
    __builtin_prefetch(p + o + FILL_LINE, 1, 3);
    __builtin_prefetch(p + o + 2 * FILL_LINE, 1, 3);
    __builtin_prefetch(p + o + 3 * FILL_LINE, 1, 3);
  }
  for (; o < bytes; o += FILL_LINE) __builtin_prefetch(p + o, 1, 3);
}

/* The rows of a decode token go to 2 x H pages, into lines written once
 * and only now: cold, so what the copy waits on is their fetch (the write
 * allocates each line). Two prefetches move it off the copy's path:
 *   now   every destination line of the append is asked for before the
 *         first store (prefetch_dsts), so the fetches overlap instead of
 *         queueing behind the store buffer one line at a time;
 *   next  after the publication, the lines of the row the tail's next
 *         token goes to (prefetch_next_rows): that token comes one step
 *         later and finds them nearer (within the pages only: a full tail
 *         asks for nothing).
 * Without the first the stores wait on their lines one after another;
 * without the second each line is a round trip to memory.
 * Inlined into their caller: a function whose only effect is a prefetch is
 * side-effect free to gcc's IPA (pure-const), and a call to it dead. */
KVP__INLINE void prefetch_dsts(void *const *dk, void *const *dv, uint32_t nh, size_t k_bytes, size_t v_bytes) {
  for (uint32_t j = 0; j < nh; j++) {
    prefetch_w(dk[j], k_bytes);
    prefetch_w(dv[j], v_bytes);
  }
}
KVP__INLINE void prefetch_next_rows(const kvp_pool *pool, const kvp__block *b, size_t rk, size_t rv) {
  if (b->n_tokens >= b->cap_tokens) return;
  prefetch_w((const unsigned char *)kvp__page_addr(&pool->alloc, &b->pg0[0]) + b->n_tokens * rk, rk);
  prefetch_w((const unsigned char *)kvp__page_addr(&pool->alloc, &b->pg0[1]) + b->n_tokens * rv, rv);
}

/* The fast path: true when it stored the layer (published), false when the
 * general path must (nothing visible changed). */
static bool append_fill(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, kvp__append_tx *tx) {
  uint32_t step = atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1;
  if (kvp__layer_rowwise(pool, layer) || !pool->tail[0].passthrough || !pool->tail[1].passthrough ||
      !fill_only(pool, s, layer, step, tx))
    return false;
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim, n = s->cur_tokens;
  kvp__stream *st = kvp__seq_stream(pool, s, layer, 0);
  size_t rk = stride_row(pool, 0), rv = stride_row(pool, 1);
  bool pass = pool->bind[2 * layer].passthrough && pool->bind[2 * layer + 1].passthrough, finite = true;
  for (uint32_t h0 = 0; h0 < H; h0 += FILL_HEADS) {
    uint32_t nh = H - h0 < FILL_HEADS ? H - h0 : FILL_HEADS;
    void *dk[FILL_HEADS], *dv[FILL_HEADS];
    if (!fill_dsts(pool, st, h0, nh, n, pass, dk, dv)) return false;
    prefetch_dsts(dk, dv, nh, n * rk, n * rv);
    finite &= kvp__rows_scatter_finite(dk, (const unsigned char *)kv->k + h0 * rk, H * rk, pool->cfg.k_dtype, n, nh, D);
    finite &= kvp__rows_scatter_finite(dv, (const unsigned char *)kv->v + h0 * rv, H * rv, pool->cfg.v_dtype, n, nh, D);
  }
  if (!finite) return false;
  uint32_t pos = s->step_pos[step];
  kvp__append_tx_before_publish(pool, s, tx); /* an empty plan (fill_only): marks it applied */
  for (uint32_t h = 0; h < H; h++) {
    kvp__block *b = st[h].tail->blk;
    kvp__block_set_n(b, b->n_tokens + n);
    b->sealed = b->n_tokens == b->cap_tokens; /* full: sealed as it stands (pass) */
    prefetch_next_rows(pool, b, rk, rv);
    atomic_store_explicit(&st[h].retained_tokens,
                          atomic_load_explicit(&st[h].retained_tokens, memory_order_relaxed) + n, memory_order_relaxed);
  }
  kvp__run_publish(s, layer, pos + n, NULL, false); /* the last run extends (fill_only) */
  kvp__count_tokens(pool, (int64_t)n * H, 0);
  kvp__append_tx_after_publish(pool, s, tx);
  return true;
}

/* ---- the fresh-block fast path ----------------------------------------------
 * A step-mode step (its blocks never straddle steps, so all of them are
 * new and sealed) under a passthrough codec (raw in the appended dtype): a
 * VAR scale, a video chunk. Stream mode keeps the general path, which
 * screens before taking anything (a refused decode token moves no peak or
 * total of the ledger; check_decode holds it to that). Every page is then the rows of
 * its head as appended, so the payload is one scatter per block index and
 * side over the stored heads (kvp__rows_scatter_finite: token-major, the
 * input read once and in order, each value screened for NaN/Inf as it is
 * copied), instead of a screening pass over the input and then a row copy
 * per (head, token) through the codec. Sides of FRESH_NT_BYTES or more are
 * stored around the caches (kvp__rows_scatter_finite_nt): fresh pages no
 * core holds, written once, far larger than the caches.
 * The plan, the metadata, the transaction with the policy and the
 * publication are the general path's; only the order changes: the input
 * is screened after the pages are taken. So the general path's answers
 * stay: a step that fails (metadata, budget, region) is screened first and
 * a bad value reported before it (bad input wins, as when screened first);
 * a non-finite value found by the scatter sends the input to screen_input,
 * which fails (the pages given back, evictions undone by
 * kvp__append_tx_fail) or, on a sanitizing pool, rewrites the rows from its
 * sanitized copy before the publication. */
enum { FRESH_NT_BYTES = 1u << 20 }; /* bytes of a side (every stored head) from which stores go around the caches */

static bool fresh_shape(const kvp_pool *pool, const append_plan *pl) {
  return !pl->fill && !pl->reseal && !pl->last_raw && pl->nnew && pl->nskip < pool->cfg.n_kv_heads;
}

/* The rows of the plan's new blocks, every stored head and side; false if
 * a value was NaN or +-Inf, in a stored head or not (as screen_input: a
 * head the policy does not store is still input). Every stored row is
 * copied either way. */
static bool fresh_write(kvp_pool *pool, const kvp__seq *s, uint32_t layer, const kvp_kv *kv, const append_plan *pl) {
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim, n = s->cur_tokens;
  uint32_t bt = kvp__layer_bt(pool, layer, s->mode);
  bool finite = true;
  for (int side = 0; side < 2; side++) {
    kvp_dtype dt = side ? pool->cfg.v_dtype : pool->cfg.k_dtype;
    size_t row = stride_row(pool, side), stride = H * row;
    const unsigned char *base = side ? kv->v : kv->k;
    bool nt = (uint64_t)n * (H - pl->nskip) * row >= FRESH_NT_BYTES;
    for (uint32_t j = 0; j < pl->nnew; j++) {
      uint32_t t0 = j * bt, m = n - t0 < bt ? n - t0 : bt;
      for (uint32_t h0 = 0; h0 < H;) { /* runs of stored heads, FILL_HEADS at most */
        void *d[FILL_HEADS];
        uint32_t nh = 0;
        for (; h0 + nh < H && nh < FILL_HEADS && !skipped(pl, h0 + nh); nh++)
          d[nh] = kvp__page_addr(&pool->alloc, &pl->blocks[(h0 + nh) * pl->nb + j]->pg0[side]);
        if (nh) {
          const unsigned char *src = base + (size_t)t0 * stride + (size_t)h0 * row;
          finite &= nt ? kvp__rows_scatter_finite_nt(d, src, stride, dt, m, nh, D)
                       : kvp__rows_scatter_finite(d, src, stride, dt, m, nh, D);
        }
        h0 += nh ? nh : 1; /* past the run, or past a skipped head */
      }
    }
    for (uint32_t h = 0; pl->nskip && finite && h < H; h++) /* heads not stored are screened all the same */
      for (uint32_t t = 0; skipped(pl, h) && finite && t < n; t++)
        finite = kvp__row_find_nonfinite(base + (size_t)t * stride + (size_t)h * row, dt, D) == D;
  }
  return finite;
}

/* A failure of the step before its payload: reported as is, unless the
 * input has a NaN or Inf, which is reported instead (on a sanitizing pool
 * there is none to report). */
static int fresh_fail(kvp_pool *pool, const kvp__seq *s, uint32_t layer, const kvp_kv *kv, int rc) {
  if (pool->cfg.flags & KVP_POOL_SANITIZE) return rc;
  kvp_kv use;
  void *scratch[2] = {NULL, NULL};
  size_t scratch_bytes[2] = {0, 0};
  int src = screen_input(pool, layer, kv, s->cur_tokens, &use, scratch, scratch_bytes);
  return src ? src : rc;
}

/* True when the fast path took the step (*rc its status: published, or
 * failed with nothing changed); false, nothing done, when the step is not
 * of its shape. */
static bool append_fresh(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                         kvp__append_tx *tx, int *rc) {
  if (s->mode != KVP_SEQ_STEP || (pool->cfg.flags & KVP_POOL_DRY) || kvp__layer_rowwise(pool, layer) ||
      !pool->bind[2 * layer].passthrough || !pool->bind[2 * layer + 1].passthrough)
    return false;
  uint32_t step = atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1, pos = s->step_pos[step];
  append_plan pl;
  plan_shape(pool, s, layer, pos, skip, &pl);
  if (!fresh_shape(pool, &pl)) return false;
  pl.run_always = tx && tx->before.n;
  if ((*rc = plan_take(pool, s, layer, pos, &pl))) {
    *rc = fresh_fail(pool, s, layer, kv, *rc);
    return true;
  }
  take_ctx tc = {s, layer, &pl};
  if ((*rc = kvp__append_tx_take(pool, s, layer, tx, pl.bytes, take_pages, give_pages, &tc))) {
    plan_undo(pool, &pl, pool->cfg.n_kv_heads * pl.nb);
    *rc = fresh_fail(pool, s, layer, kv, *rc);
    return true;
  }
  if (!fresh_write(pool, s, layer, kv, &pl)) { /* screened now: fails, or rows written again sanitized */
    kvp_kv use;
    void *scratch[2] = {NULL, NULL};
    size_t scratch_bytes[2] = {0, 0};
    *rc = screen_input(pool, layer, kv, s->cur_tokens, &use, scratch, scratch_bytes);
    if (!*rc) *rc = fill_data(pool, s, layer, pos, &use, &pl);
    for (int side = 0; side < 2; side++) kvp__meta_free(&pool->meta, scratch[side], scratch_bytes[side]);
    if (*rc) {
      plan_undo(pool, &pl, pool->cfg.n_kv_heads * pl.nb);
      kvp__append_tx_fail(pool, s, tx);
      return true;
    }
  }
  publish(pool, s, layer, pos, &pl, tx);
  *rc = KVP_OK;
  return true;
}

static int append_layer(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                        kvp__append_tx *tx) {
  if (kvp__layer_rowwise(pool, layer)) return kvp__append_rowwise(pool, s, layer, kv, skip, tx);
  int rc;
  uint32_t step = atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1, pos = s->step_pos[step];
  if (fill_only(pool, s, layer, step, tx)) {
    append_plan fill;
    plan_clear(&fill);
    fill.fill = s->cur_tokens;
    if ((rc = fill_data(pool, s, layer, pos, kv, &fill))) return rc; /* rows past the tails' counts: unseen */
    publish(pool, s, layer, pos, &fill, tx);
    return KVP_OK;
  }
  append_plan pl;
  plan_shape(pool, s, layer, pos, skip, &pl);
  pl.run_always = tx && tx->before.n;
  if ((rc = plan_take(pool, s, layer, pos, &pl))) return rc; /* metadata first: evictions never wait on it */
  take_ctx tc = {s, layer, &pl};
  if ((rc = kvp__append_tx_take(pool, s, layer, tx, pl.bytes, take_pages, give_pages, &tc))) {
    plan_undo(pool, &pl, pool->cfg.n_kv_heads * pl.nb);
    return rc;
  }
  if (!(pool->cfg.flags & KVP_POOL_DRY) && (rc = fill_data(pool, s, layer, pos, kv, &pl))) { /* dry: no payload */
    plan_undo(pool, &pl, pool->cfg.n_kv_heads * pl.nb);
    kvp__append_tx_fail(pool, s, tx);
    return rc;
  }
  publish(pool, s, layer, pos, &pl, tx);
  return KVP_OK;
}
