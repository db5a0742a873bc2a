/*
 * pages/rowwise.c - appends to a layer whose K and V codecs build blocks
 * row by row (kvp_codec_vtable.open_layout and encode_rows, e.g. kvquant):
 * every block is the codec's pages from its first token, and in stream
 * mode the OPEN block is encoded as tokens arrive and its pages grow.
 *
 * One append, per stored head:
 *   tail    (stream mode, the OPEN block) fill rows into it. Its pages
 *           after the fill are open_layout(pages, n, new rows): when every
 *           page's size class holds its new bytes it grows in place (only
 *           requested bytes change; readers keep decoding rows < n); else a
 *           replacement block takes pages of the new sizes, the old rows
 *           are copied, the new ones encoded, and the replacement is
 *           published in the old one's bref (RCU); the old block waits in
 *           the limbo for readers, counted in the ledger (bytes.retired).
 *   new     blocks of block_tokens positions (stream mode: the last one
 *           OPEN, of full capacity; step mode: the last one short), sized
 *           by open_layout(NULL, 0, rows).
 * All or nothing, as pages/stream.c: plan every head's sizes, take the
 * metadata, check the budget for every new page at once (a replacement
 * counts whole, as both copies live until the grace period), take the
 * pages, encode, then publish. A
 * failure before publishing leaves rows written past an OPEN block's n,
 * which nobody reads, and nothing else.
 *
 * Invariant (kvp_check): every block's pages equal open_layout(pages, n).
 *
 * Dry pools (KVP_POOL_DRY) size the same way with pages = NULL (no rows are
 * held; kvp_pool_create refused codecs that need them) and encode nothing.
 */
#include "../codecs/numeric.h"
#include "pages.h"

#include <string.h>

/* One block of one head the append writes. */
typedef struct rw_blk {
  kvp__block *blk;         /* the OPEN tail (in place), or the new block */
  kvp__block *rep;         /* the tail's replacement, or NULL */
  uint32_t pos0, cap;      /* where the block sits, its capacity */
  uint32_t n_have, n_new;  /* rows held before, rows appended */
  uint32_t src_row;        /* first row of the step's input */
  kvp_codec_layout lay[2]; /* K, V pages after the append */
} rw_blk;

typedef struct rw_plan {
  bool tail;              /* the first entry of each head is its OPEN tail */
  uint32_t nnew;          /* new blocks per head */
  uint32_t per;           /* entries per head: tail + nnew */
  rw_blk *e;              /* [H * per] */
  kvp__bref **brefs;      /* [H * nnew] */
  kvp__run *run;          /* new run, or NULL to extend the last */
  bool run_always;        /* take a run even if the last one extends now (evictions come first) */
  const uint64_t *skip;   /* heads not stored (step mode), or NULL */
  uint32_t nskip;         /* how many */
  uint64_t bytes;         /* allocated bytes of every new page */
} rw_plan;

static bool rw_skipped(const rw_plan *pl, uint32_t h) { return pl->skip && (pl->skip[h / 64] >> (h % 64)) & 1; }

static void page_ptrs(kvp_pool *pool, const kvp__block *b, int kv, void **out) {
  for (unsigned i = 0; i < b->npages[kv]; i++) out[i] = kvp__page_addr(&pool->alloc, &KVP__PG(b, i)[kv]);
}

static uint64_t class_bytes(const kvp_pool *pool, const kvp_codec_layout *lay) {
  uint64_t sum = 0;
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < lay[kv].npages; i++) sum += kvp__alloc_size(&pool->alloc, lay[kv].bytes[i]);
  return sum;
}

/* The layout the codec gives must be well formed and keep the page types
 * of the block it extends. */
static int layout_sane(const kvp__binding *bd, const kvp_codec_layout *l, const kvp__block *old, int kv,
                       uint32_t layer) {
  bool ok = l->npages >= 1 && l->npages <= KVP_CODEC_MAX_PAGES;
  for (unsigned i = 0; ok && i < l->npages; i++) {
    ok = (unsigned)l->types[i] < KVP_PAGE_TYPE_COUNT && l->bytes[i] >= 1 && l->bytes[i] <= KVP_MAX_PAGE_BYTES;
    if (ok && old) ok = old->npages[kv] == l->npages && KVP__PG(old, i)[kv].tag.type == l->types[i];
  }
  return ok ? KVP_OK
            : kvp__err(KVP_ECODEC, "codec %s gives a bad open layout for layer %u %c", bd->vt->name, layer, "KV"[kv]);
}

/* Sizes of one entry, both sides; in place or not for a tail. */
static int rw_size(kvp_pool *pool, uint32_t layer, uint32_t h, const kvp_kv *kv, rw_blk *e, kvp__block *tail) {
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim;
  bool in_place = tail != NULL;
  for (int side = 0; side < 2; side++) {
    const kvp__binding *bd = &pool->bind[2 * layer + side];
    size_t esz = kvp__dtype_bytes(side ? pool->cfg.v_dtype : pool->cfg.k_dtype), stride = (size_t)H * D * esz;
    const unsigned char *src = (const unsigned char *)(side ? kv->v : kv->k) + (size_t)h * D * esz +
                               (size_t)e->src_row * stride;
    void *pages[KVP_CODEC_MAX_PAGES] = {0};
    bool held = tail && kvp__rows_on_host(pool); /* dry, or rows on the device: pages = NULL */
    if (held) page_ptrs(pool, tail, side, pages);
    kvp_codec_block where = {h, e->pos0};
    int rc = bd->vt->open_layout(bd->inst, &where, held ? (const void *const *)pages : NULL, e->n_have, src, stride,
                                 e->n_new, e->cap, &e->lay[side]);
    if (rc) return kvp__err(KVP_ECODEC, "codec %s: open layout of layer %u %c head %u (status %d)", bd->vt->name, layer,
                            "KV"[side], h, rc);
    if ((rc = layout_sane(bd, &e->lay[side], tail, side, layer))) return rc;
    for (unsigned i = 0; tail && i < e->lay[side].npages; i++)
      in_place = in_place && e->lay[side].bytes[i] <= kvp__page_alloc_bytes(&KVP__PG(tail, i)[side]);
  }
  e->rep = in_place ? NULL : (kvp__block *)1; /* marks "needs a replacement" until taken */
  return KVP_OK;
}

static void rw_undo(kvp_pool *pool, rw_plan *pl) {
  uint32_t H = pool->cfg.n_kv_heads;
  for (uint32_t i = 0; pl->e && i < H * pl->per; i++) {
    rw_blk *e = &pl->e[i];
    bool is_tail = pl->tail && i % pl->per == 0;
    if (is_tail && e->rep && e->rep != (kvp__block *)1) kvp__block_destroy(pool, e->rep);
    if (!is_tail && e->blk) kvp__block_destroy(pool, e->blk);
  }
  for (uint32_t i = 0; pl->brefs && i < H * pl->nnew; i++) kvp__bref_free_now(pool, pl->brefs[i]);
  if (pl->run) kvp__run_free_now(pool, pl->run);
  kvp__meta_free(&pool->meta, pl->e, (size_t)H * pl->per * sizeof *pl->e + 1);
  kvp__meta_free(&pool->meta, pl->brefs, (size_t)H * pl->nnew * sizeof *pl->brefs + 1);
  pl->e = NULL, pl->brefs = NULL, pl->run = NULL; /* undone: a second undo does nothing */
}

/* Shape and sizes of every head's blocks, and the bytes to take. */
static int rw_plan_make(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t pos, const kvp_kv *kv,
                        const uint64_t *skip, rw_plan *pl) {
  uint32_t n = s->cur_tokens, bt = kvp__layer_bt(pool, layer, s->mode), H = pool->cfg.n_kv_heads;
  bool stream = s->mode == KVP_SEQ_STREAM;
  kvp__bref *t0 = kvp__seq_stream(pool, s, layer, 0)->tail;
  memset(pl, 0, sizeof *pl);
  pl->skip = stream ? NULL : skip;
  for (uint32_t h = 0; pl->skip && h < H; h++) pl->nskip += rw_skipped(pl, h);
  pl->tail = stream && t0 && !t0->blk->sealed;
  uint32_t fill = 0;
  if (pl->tail) {
    uint32_t room = t0->blk->cap_tokens - t0->blk->n_tokens;
    fill = n < room ? n : room;
  }
  uint32_t rest = n - fill;
  pl->nnew = (rest + bt - 1) / bt;
  pl->per = pl->tail + pl->nnew;
  pl->e = kvp__meta_calloc(&pool->meta, (size_t)H * pl->per * sizeof *pl->e + 1);
  pl->brefs = kvp__meta_calloc(&pool->meta, (size_t)H * pl->nnew * sizeof *pl->brefs + 1);
  if (!pl->e || !pl->brefs) {
    rw_undo(pool, pl);
    return kvp__err(KVP_ENOMEM, "plan of the append of seq %llu layer %u", (unsigned long long)s->id, layer);
  }
  for (uint32_t h = 0; h < H; h++) {
    if (rw_skipped(pl, h)) continue;
    rw_blk *e = &pl->e[h * pl->per];
    kvp__block *tail = pl->tail ? kvp__seq_stream(pool, s, layer, h)->tail->blk : NULL;
    int rc = KVP_OK;
    if (tail) {
      *e = (rw_blk){.blk = tail, .pos0 = tail->pos0, .cap = tail->cap_tokens, .n_have = tail->n_tokens, .n_new = fill};
      if (!(rc = rw_size(pool, layer, h, kv, e, tail)) && e->rep) pl->bytes += class_bytes(pool, e->lay);
      e++;
    }
    for (uint32_t j = 0; !rc && j < pl->nnew; j++, e++) {
      uint32_t m = rest - j * bt < bt ? rest - j * bt : bt;
      *e = (rw_blk){.pos0 = pos + fill + j * bt, .cap = stream ? bt : m, .n_new = m, .src_row = fill + j * bt};
      if (!(rc = rw_size(pool, layer, h, kv, e, NULL))) pl->bytes += class_bytes(pool, e->lay);
      e->rep = NULL;
    }
    if (rc) {
      rw_undo(pool, pl);
      return rc;
    }
  }
  return KVP_OK;
}

/* Metadata: run, brefs, codec states, block structs (their pages come in
 * rw_take_pages, so evictions that make room never wait on metadata) and
 * the stats slot. On failure nothing is left taken but zeroed states. */
static int rw_take(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t pos, rw_plan *pl) {
  uint32_t H = pool->cfg.n_kv_heads;
  uint32_t step = atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1;
  uint64_t mask[KVP_MAX_KV_HEADS / 64] = {0};
  for (uint32_t h = 0; h < H; h++)
    if (!rw_skipped(pl, h)) mask[h / 64] |= 1ull << (h % 64);
  bool ok = true;
  /* a run, unless the last one extends; with evictions to apply before the
   * publication (they may split it) always one: kvp__run_settle decides */
  if (pl->nskip < H && (pl->run_always || !kvp__run_extends(pool, &s->layers[layer], step, mask)))
    ok = (pl->run = kvp__run_new(pool, step, pos, step + 1, pos + s->cur_tokens, mask)) != NULL;
  for (uint32_t i = 0; ok && i < H * pl->nnew; i++)
    ok = rw_skipped(pl, i / pl->nnew) || (pl->brefs[i] = kvp__meta_calloc(&pool->meta, sizeof(kvp__bref)));
  if (!ok) {
    rw_undo(pool, pl);
    return kvp__err(KVP_ENOMEM, "metadata for the append of seq %llu layer %u", (unsigned long long)s->id, layer);
  }
  for (uint32_t h = 0; h < H; h++)
    for (int side = 0; side < 2 && !rw_skipped(pl, h); side++) {
      void *st;
      int rc = kvp__cstate_get(pool, kvp__seq_stream(pool, s, layer, h), layer, side, &st);
      if (rc) {
        rw_undo(pool, pl);
        return rc;
      }
    }
  for (uint32_t h = 0; h < H; h++) /* block structs: their pages come in rw_take_pages */
    for (uint32_t j = 0; j < pl->per && !rw_skipped(pl, h); j++) {
      rw_blk *e = &pl->e[h * pl->per + j];
      bool ok_blk = true;
      if (pl->tail && j == 0) {
        if (e->rep) ok_blk = (e->rep = kvp__block_struct(pool, e->pos0, e->cap, false)) != NULL;
      } else {
        ok_blk = (e->blk = kvp__block_struct(pool, e->pos0, e->cap, false)) != NULL;
      }
      if (!ok_blk) {
        rw_undo(pool, pl);
        return kvp__err(KVP_ENOMEM, "block metadata for the append of seq %llu layer %u", (unsigned long long)s->id,
                        layer);
      }
    }
  if (kvp__stats_reserve_seq(&pool->stats, s->id)) { /* so the pages' counting cannot fail */
    rw_undo(pool, pl);
    return kvp__err(KVP_ENOMEM, "stats slot of seq %llu", (unsigned long long)s->id);
  }
  return KVP_OK;
}

/* Pages of every block rw_take made (all or none). */
static int rw_take_pages(kvp_pool *pool, kvp__seq *s, uint32_t layer, rw_plan *pl) {
  uint32_t H = pool->cfg.n_kv_heads;
  for (uint32_t i = 0; i < H * pl->per; i++) {
    rw_blk *e = &pl->e[i];
    kvp__block *b = pl->tail && i % pl->per == 0 ? e->rep : e->blk;
    if (!b || rw_skipped(pl, i / pl->per)) continue; /* in place, or a skipped head */
    int rc = kvp__block_take_pages(pool, b, s->id, layer, i / pl->per, e->lay);
    if (rc) {
      while (i--) {
        kvp__block *t = pl->tail && i % pl->per == 0 ? pl->e[i].rep : pl->e[i].blk;
        if (t && !rw_skipped(pl, i / pl->per)) kvp__block_give_pages(pool, t);
      }
      return rc;
    }
  }
  return KVP_OK;
}

/* Encode one entry's new rows (a replacement first receives the rows the
 * tail holds). On a CUDA region the copy is enqueued on the append's
 * stream and the encode is a job of db, run once per append after every
 * copy (kvp__dev_batch_run). */
static int rw_fill_one(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t h, const kvp_kv *kv, rw_blk *e,
                       kvp__dev_batch *db) {
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim;
  if (pool->cfg.flags & KVP_POOL_DRY) return KVP_OK; /* no payload: nothing to copy or encode */
  kvp__block *dst = e->rep ? e->rep : e->blk;
  for (int side = 0; side < 2; side++) {
    const kvp__binding *bd = &pool->bind[2 * layer + side];
    size_t esz = kvp__dtype_bytes(side ? pool->cfg.v_dtype : pool->cfg.k_dtype), stride = (size_t)H * D * esz;
    const unsigned char *src = (const unsigned char *)(side ? kv->v : kv->k) + (size_t)h * D * esz +
                               (size_t)e->src_row * stride;
    if (e->rep)
      for (unsigned i = 0; i < e->blk->npages[side]; i++) {
        uint64_t keep = KVP__PG(e->blk, i)[side].requested_bytes < KVP__PG(dst, i)[side].requested_bytes
                            ? KVP__PG(e->blk, i)[side].requested_bytes
                            : KVP__PG(dst, i)[side].requested_bytes;
        int rc;
#ifdef KVP_HAVE_CUDA
        if (db) rc = kvp__dev_region_copy(pool, KVP__PG(dst, i)[side].off, KVP__PG(e->blk, i)[side].off, keep, kv->stream);
        else
#endif
          rc = pool->alloc.region.ops->copy(&pool->alloc.region, KVP__PG(dst, i)[side].off, KVP__PG(e->blk, i)[side].off,
                                            keep, NULL);
        if (rc) return rc;
      }
    void *pages[KVP_CODEC_MAX_PAGES];
    page_ptrs(pool, dst, side, pages);
#ifdef KVP_HAVE_CUDA
    if (db) {
      kvp_codec_dev_job j = {.src = src, .stride_bytes = stride, .n = e->n_have + e->n_new, .cap_tokens = e->cap,
                             .t0 = e->n_have, .m = e->n_new, .head = h, .pos0 = e->pos0};
      memcpy(j.pages, pages, sizeof j.pages);
      int rc = kvp__dev_batch_add(pool, db, bd, side, &j);
      if (rc) return rc;
      continue;
    }
#else
    (void)db;
#endif
    kvp_codec_block where = {h, e->pos0};
    int rc = bd->vt->encode_rows(bd->inst, &where, kvp__seq_stream(pool, s, layer, h)->cstate[side], pages, e->n_have,
                                 src, stride, e->n_new, e->cap);
    if (rc) return kvp__err(KVP_ECODEC, "codec %s failed to encode layer %u %c head %u (status %d): %s", bd->vt->name,
                            layer, "KV"[side], h, rc, kvp_last_error());
  }
  return KVP_OK;
}

static void rw_publish(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t pos, rw_plan *pl, kvp__append_tx *tx) {
  uint32_t H = pool->cfg.n_kv_heads, n = s->cur_tokens;
  bool stream = s->mode == KVP_SEQ_STREAM;
  kvp__append_tx_before_publish(pool, s, tx);
  for (uint32_t h = 0; h < H; h++) {
    kvp__stream *st = kvp__seq_stream(pool, s, layer, h);
    if (rw_skipped(pl, h)) {
      atomic_store_explicit(&st->evicted_tokens, atomic_load_explicit(&st->evicted_tokens, memory_order_relaxed) + n,
                            memory_order_relaxed);
      continue;
    }
    for (uint32_t j = 0; j < pl->per; j++) {
      rw_blk *e = &pl->e[h * pl->per + j];
      uint32_t have = e->n_have + e->n_new;
      bool sealed = !stream || have == e->cap;
      if (pl->tail && j == 0 && !e->rep) { /* in place: only requested bytes move */
        for (int side = 0; side < 2; side++)
          for (unsigned i = 0; i < e->blk->npages[side]; i++) {
            if (KVP__PG(e->blk, i)[side].requested_bytes == e->lay[side].bytes[i]) continue; /* not a grow */
            int rc = kvp__alloc_grow(&pool->alloc, &KVP__PG(e->blk, i)[side], e->lay[side].bytes[i], NULL);
            kvp__assert(rc == KVP_OK); /* the class holds it: never a move */
            (void)rc;
          }
        kvp__block_set_n(e->blk, have);
        e->blk->sealed = sealed;
      } else if (pl->tail && j == 0) { /* the replacement takes the tail's place: each page that grew is a grow,
                                          and a move (its rows moved to a new page) */
        kvp__ledger_begin(&pool->alloc.ledger);
        for (int side = 0; side < 2; side++)
          for (unsigned i = 0; i < e->blk->npages[side]; i++) {
            const kvp__page *o = &KVP__PG(e->blk, i)[side], *p = &KVP__PG(e->rep, i)[side];
            bool grew = p->requested_bytes != o->requested_bytes;
            kvp__count_add(&pool->alloc.ledger.grows, grew);
            kvp__count_add(&pool->alloc.ledger.grow_moves, grew && p->off != o->off);
          }
        kvp__ledger_end(&pool->alloc.ledger);
        kvp__block_set_n(e->rep, have);
        e->rep->sealed = sealed;
        e->rep->owners = 1;
        atomic_init(&e->rep->refs, 1);
        kvp__rcu_assign(st->tail->blk, e->rep);
        kvp__block_unown(pool, e->blk);
      } else {
        kvp__bref *r = pl->brefs[h * pl->nnew + (j - pl->tail)];
        kvp__block_set_n(e->blk, have);
        e->blk->sealed = sealed;
        e->blk->owners = 1;
        atomic_init(&e->blk->refs, 1);
        r->blk = e->blk;
        if (st->tail) kvp__rcu_assign(st->tail->next, r);
        else kvp__rcu_assign(st->blocks, r);
        st->tail = r;
      }
    }
    atomic_store_explicit(&st->retained_tokens, atomic_load_explicit(&st->retained_tokens, memory_order_relaxed) + n,
                          memory_order_relaxed);
  }
  kvp__run_publish(s, layer, pos + n, kvp__run_settle(pool, s, layer, pl->run), pl->nskip == H);
  kvp__meta_free(&pool->meta, pl->e, (size_t)H * pl->per * sizeof *pl->e + 1);
  kvp__meta_free(&pool->meta, pl->brefs, (size_t)H * pl->nnew * sizeof *pl->brefs + 1);
  kvp__count_tokens(pool, (int64_t)n * (H - pl->nskip), (uint64_t)n * pl->nskip);
  kvp__append_tx_after_publish(pool, s, tx);
}

typedef struct rw_take_ctx {
  kvp__seq *s;
  uint32_t layer;
  rw_plan *pl;
} rw_take_ctx;
static int rw_take_cb(kvp_pool *pool, void *vctx) {
  rw_take_ctx *c = vctx;
  return rw_take_pages(pool, c->s, c->layer, c->pl);
}
static void rw_give_cb(kvp_pool *pool, void *vctx) {
  rw_take_ctx *c = vctx;
  const rw_plan *pl = c->pl;
  for (uint32_t i = 0; i < pool->cfg.n_kv_heads * pl->per; i++) {
    kvp__block *b = pl->tail && i % pl->per == 0 ? pl->e[i].rep : pl->e[i].blk;
    if (b && !rw_skipped(pl, i / pl->per)) kvp__block_give_pages(pool, b);
  }
}

int kvp__append_rowwise(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                        kvp__append_tx *tx) {
  uint32_t step = atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1, pos = s->step_pos[step];
  rw_plan pl;
  int rc = rw_plan_make(pool, s, layer, pos, kv, skip, &pl);
  if (rc) return rc;
  pl.run_always = tx && tx->before.n;
  if ((rc = rw_take(pool, s, layer, pos, &pl))) return rc; /* metadata first: evictions never wait on it */
  rw_take_ctx tc = {s, layer, &pl};
  if ((rc = kvp__append_tx_take(pool, s, layer, tx, pl.bytes, rw_take_cb, rw_give_cb, &tc))) {
    rw_undo(pool, &pl);
    return rc;
  }
  kvp__dev_batch *db = NULL;
#ifdef KVP_HAVE_CUDA
  kvp__dev_batch batch;
  if (pool->cfg.memory == KVP_MEM_CUDA && !(pool->cfg.flags & KVP_POOL_DRY))
    kvp__dev_batch_init(&batch, pool->cfg.n_kv_heads * pl.per, &pool->meta), db = &batch;
#endif
  for (uint32_t h = 0; h < pool->cfg.n_kv_heads && !rc; h++)
    for (uint32_t j = 0; j < pl.per && !rc && !rw_skipped(&pl, h); j++)
      rc = rw_fill_one(pool, s, layer, h, kv, &pl.e[h * pl.per + j], db);
#ifdef KVP_HAVE_CUDA
  if (db) {
    if (!rc) rc = kvp__dev_batch_run(pool, db, layer, pos, kv->stream); /* waits: a bad input fails here */
    else /* a replacement's row copies may be enqueued on the caller's stream: they land before their pages are
            given back, or before the evicted pages under them get their payload back (kvp__append_tx_fail) */
      (void)pool->alloc.region.ops->quiesce(&pool->alloc.region);
    kvp__dev_batch_fini(pool, db);
  }
#endif
  if (rc) {
    rw_undo(pool, &pl);
    kvp__append_tx_fail(pool, s, tx);
    return rc;
  }
  rw_publish(pool, s, layer, pos, &pl, tx);
  return KVP_OK;
}
