/*
 * pages/stream.c - streams: blocks, runs and brefs, the append of one layer
 * and the eviction of one (layer, head, step) unit.
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
 * the bf16-equivalent figure.
 */
#include "../codecs/numeric.h"
#include "pages.h"

#include <string.h>

/* ---- runs and brefs ---------------------------------------------------- */

kvp__run *kvp__run_new(kvp_pool *pool, uint32_t s0, uint32_t p0, uint32_t s1, uint32_t p1, const uint64_t *mask) {
  uint32_t nwords = (pool->cfg.n_kv_heads + 63) / 64;
  kvp__run *r = kvp__meta_alloc(&pool->meta, sizeof *r + nwords * sizeof(uint64_t));
  if (!r) return NULL;
  r->next = NULL;
  r->s0 = s0;
  r->p0 = p0;
  atomic_init(&r->s1, s1);
  atomic_init(&r->p1, p1);
  r->nwords = nwords;
  memcpy(r->mask, mask, nwords * sizeof(uint64_t));
  return r;
}

void kvp__run_free_now(kvp_pool *pool, kvp__run *r) {
  kvp__meta_free(&pool->meta, r, sizeof *r + r->nwords * sizeof(uint64_t));
}

void kvp__bref_free_now(kvp_pool *pool, kvp__bref *b) { kvp__meta_free(&pool->meta, b, sizeof *b); }

static void run_free_cb(kvp__rcu_head *h) {
  kvp__rcu_cb_begin(h);
  kvp__run *r = caa_container_of(h, kvp__run, rcu);
  kvp__meta_free(NULL, r, sizeof *r + r->nwords * sizeof(uint64_t));
}

static void bref_free_cb(kvp__rcu_head *h) {
  kvp__rcu_cb_begin(h);
  kvp__meta_free(NULL, caa_container_of(h, kvp__bref, rcu), sizeof(kvp__bref));
}

/* The pool's counter drops at retire; the memory goes after the grace period
 * (callbacks run on urcu's thread and count against no pool). */
void kvp__run_retire(kvp_pool *pool, kvp__run *r) {
  kvp__meta_uncount(&pool->meta, r, sizeof *r + r->nwords * sizeof(uint64_t));
  kvp__rcu_call(&r->rcu, run_free_cb);
}

void kvp__bref_retire(kvp_pool *pool, kvp__bref *b) {
  kvp__meta_uncount(&pool->meta, b, sizeof *b);
  kvp__rcu_call(&b->rcu, bref_free_cb);
}

/* ---- blocks ------------------------------------------------------------ */

uint64_t kvp__block_class_bytes(const kvp_pool *pool, uint32_t layer, bool raw, uint32_t pos0, uint32_t cap) {
  uint64_t sum = 0;
  for (int kv = 0; kv < 2; kv++) {
    const kvp__binding *bd = raw ? &pool->tail[kv] : &pool->bind[2 * layer + kv];
    kvp_codec_layout lay;
    kvp__bind_layout(bd, pos0, cap, &lay);
    for (unsigned i = 0; i < lay.npages; i++) sum += kvp__alloc_size(lay.bytes[i]);
  }
  return sum;
}

static void free_pages(kvp_pool *pool, kvp__block *b) {
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv]; i++) {
      int rc = kvp__alloc_free(&pool->alloc, &b->pages[kv][i]);
      kvp__assert(rc == KVP_OK);
      (void)rc;
    }
}

int kvp__block_new(kvp_pool *pool, uint64_t seq, uint32_t layer, uint32_t head, uint32_t pos0, uint32_t cap, bool raw,
                   kvp__block **out) {
  kvp_codec_layout lay[2];
  for (int kv = 0; kv < 2; kv++)
    kvp__bind_layout(raw ? &pool->tail[kv] : &pool->bind[2 * layer + kv], pos0, cap, &lay[kv]);
  return kvp__block_new_sized(pool, seq, layer, head, pos0, cap, raw, lay, out);
}

void kvp__block_layouts(const kvp__block *b, kvp_codec_layout *lay) {
  for (int kv = 0; kv < 2; kv++) {
    memset(&lay[kv], 0, sizeof lay[kv]);
    lay[kv].npages = b->npages[kv];
    for (unsigned i = 0; i < b->npages[kv]; i++) {
      lay[kv].types[i] = (kvp_page_type)b->pages[kv][i].tag.type;
      lay[kv].bytes[i] = b->pages[kv][i].requested_bytes;
    }
  }
}

kvp__block *kvp__block_struct(kvp_pool *pool, uint32_t pos0, uint32_t cap, bool raw) {
  kvp__block *b = kvp__meta_calloc(&pool->meta, sizeof *b);
  if (b) b->pos0 = pos0, b->cap_tokens = cap, b->raw = raw;
  return b;
}

int kvp__block_take_pages(kvp_pool *pool, kvp__block *b, uint64_t seq, uint32_t layer, uint32_t head,
                          const kvp_codec_layout *lays) {
  for (int kv = 0; kv < 2; kv++) {
    const kvp__binding *bd = b->raw ? &pool->tail[kv] : &pool->bind[2 * layer + kv];
    const kvp_codec_layout lay = lays[kv];
    for (unsigned i = 0; i < lay.npages; i++) {
      kvp__tag t = {seq, (uint16_t)layer, (uint16_t)head, (uint8_t)lay.types[i], (uint8_t)kv, (uint16_t)bd->id};
      int rc = kvp__alloc_page(&pool->alloc, lay.bytes[i], &t, &b->pages[kv][i]);
      if (rc) { /* give back the pages taken so far */
        kvp__block_give_pages(pool, b);
        return rc;
      }
      b->npages[kv] = (uint8_t)(i + 1);
    }
  }
  return KVP_OK;
}

void kvp__block_give_pages(kvp_pool *pool, kvp__block *b) {
  free_pages(pool, b);
  b->npages[0] = b->npages[1] = 0;
}

int kvp__block_new_sized(kvp_pool *pool, uint64_t seq, uint32_t layer, uint32_t head, uint32_t pos0, uint32_t cap,
                         bool raw, const kvp_codec_layout *lays, kvp__block **out) {
  kvp__block *b = kvp__block_struct(pool, pos0, cap, raw);
  if (!b) return kvp__err(KVP_ENOMEM, "block metadata");
  int rc = kvp__block_take_pages(pool, b, seq, layer, head, lays);
  if (rc) {
    kvp__meta_free(&pool->meta, b, sizeof *b);
    return rc;
  }
  *out = b;
  return KVP_OK;
}

/* ---- codec state ---------------------------------------------------------- */

size_t kvp__cstate_bytes(const kvp_pool *pool, uint32_t layer, int kv) {
  const kvp__binding *bd = &pool->bind[2 * layer + kv];
  return bd->vt->state_bytes ? bd->vt->state_bytes(bd->inst) : 0;
}

static void count_state(kvp_pool *pool, size_t bytes, int sign) {
  kvp__ledger_begin(&pool->alloc.ledger);
  if (sign > 0) kvp__gauge_add(&pool->alloc.ledger.codec_state, bytes);
  else kvp__gauge_sub(&pool->alloc.ledger.codec_state, bytes);
  kvp__ledger_end(&pool->alloc.ledger);
}

int kvp__cstate_get(kvp_pool *pool, kvp__stream *st, uint32_t layer, int kv, void **out) {
  size_t bytes = kvp__cstate_bytes(pool, layer, kv);
  if (bytes && !st->cstate[kv]) {
    if (!(st->cstate[kv] = kvp__meta_calloc(&pool->meta, bytes)))
      return kvp__err(KVP_ENOMEM, "codec state of %zu bytes (layer %u %c)", bytes, layer, "KV"[kv]);
    count_state(pool, bytes, +1);
  }
  *out = st->cstate[kv];
  return KVP_OK;
}

void kvp__cstate_free(kvp_pool *pool, kvp__stream *st, uint32_t layer) {
  for (int kv = 0; kv < 2; kv++)
    if (st->cstate[kv]) {
      size_t bytes = kvp__cstate_bytes(pool, layer, kv);
      kvp__meta_free(&pool->meta, st->cstate[kv], bytes);
      count_state(pool, bytes, -1);
      st->cstate[kv] = NULL;
    }
}

int kvp__cstate_copy(kvp_pool *pool, const kvp__stream *from, kvp__stream *to, uint32_t layer) {
  for (int kv = 0; kv < 2; kv++) {
    if (!from->cstate[kv]) continue;
    void *st;
    int rc = kvp__cstate_get(pool, to, layer, kv, &st);
    if (rc) return rc;
    memcpy(st, from->cstate[kv], kvp__cstate_bytes(pool, layer, kv));
  }
  return KVP_OK;
}

/* ---- append ------------------------------------------------------------ */

/* The shape of an append, the same for every head of the layer:
 *   fill     tokens into the existing OPEN tail block;
 *   reseal   the tail fills up and its codec is not the tail's raw format:
 *            an encoded copy replaces it;
 *   nnew     new blocks: full ones encoded with the layer's codec, the last
 *            one (stream mode, partial) an OPEN raw block. */
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
} append_plan;

static bool skipped(const append_plan *pl, uint32_t h) { return pl->skip && (pl->skip[h / 64] >> (h % 64)) & 1; }

static void plan_shape(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t pos, const uint64_t *skip,
                       append_plan *pl) {
  uint32_t n = s->cur_tokens, bt = kvp__layer_bt(pool, layer, s->mode), H = pool->cfg.n_kv_heads;
  kvp__bref *tail = kvp__seq_stream(pool, s, layer, 0)->tail;
  bool stream = s->mode == KVP_SEQ_STREAM;
  bool pass = pool->bind[2 * layer].passthrough && pool->bind[2 * layer + 1].passthrough;
  memset(pl, 0, sizeof *pl);
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

/* The last run ends at this step and retains exactly the stored heads. */
bool kvp__run_extends(const kvp_pool *pool, const kvp__layer *L, uint32_t step, const uint64_t *mask) {
  const kvp__run *r = L->last;
  if (!r || atomic_load_explicit(&r->s1, memory_order_relaxed) != step) return false;
  return memcmp(r->mask, mask, r->nwords * sizeof(uint64_t)) == 0 && (pool->cfg.n_kv_heads + 63) / 64 == r->nwords;
}

/* The plan's per-head arrays. A decode token that only fills the OPEN tail
 * takes no new block, so both arrays are empty: an empty one is a shared
 * sentinel (never read or written), not an allocation: two metadata
 * allocations and frees less per such append. */
static void *plan_none[1];
static void *plan_array(kvp_pool *pool, size_t bytes) {
  return bytes ? kvp__meta_calloc(&pool->meta, bytes) : (void *)plan_none;
}
static void plan_array_free(kvp_pool *pool, void *p, size_t bytes) {
  if (bytes) kvp__meta_free(&pool->meta, p, bytes);
}

static void plan_undo(kvp_pool *pool, append_plan *pl, uint32_t nblocks) {
  uint32_t H = pool->cfg.n_kv_heads;
  for (uint32_t i = 0; pl->blocks && i < nblocks; i++) /* either array may be missing (its allocation failed) */
    if (pl->blocks[i]) kvp__block_destroy(pool, pl->blocks[i]);
  for (uint32_t i = 0; pl->brefs && i < H * pl->nnew; i++) kvp__meta_free(&pool->meta, pl->brefs[i], sizeof(kvp__bref));
  if (pl->run) kvp__run_free_now(pool, pl->run);
  plan_array_free(pool, pl->blocks, (size_t)H * pl->nb * sizeof *pl->blocks);
  plan_array_free(pool, pl->brefs, (size_t)H * pl->nnew * sizeof *pl->brefs);
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
  pl->blocks = plan_array(pool, (size_t)H * pl->nb * sizeof *pl->blocks);
  pl->brefs = plan_array(pool, (size_t)H * pl->nnew * sizeof *pl->brefs);
  pl->run = NULL;
  bool ok = pl->blocks && pl->brefs;
  uint64_t mask[KVP_MAX_KV_HEADS / 64];
  stored_mask(pool, pl, mask);
  /* a run, unless the last one extends; with evictions to apply before the
   * publication (they may split it) always one: kvp__run_settle decides */
  if (ok && pl->nskip < H && (pl->run_always || !kvp__run_extends(pool, &s->layers[layer], step, mask)))
    ok = (pl->run = kvp__run_new(pool, step, pos, step + 1, pos + s->cur_tokens, mask)) != NULL;
  for (uint32_t i = 0; ok && i < H * pl->nnew; i++)
    ok = skipped(pl, i / (pl->nnew ? pl->nnew : 1)) || (pl->brefs[i] = kvp__meta_calloc(&pool->meta, sizeof(kvp__bref)));
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
        *slot = kvp__block_struct(pool, start + j * bt, last ? pl->last_cap : bt, last && pl->last_raw);
      } else { /* the encoded copy of the tail */
        const kvp__block *t = kvp__seq_stream(pool, s, layer, h)->tail->blk;
        *slot = kvp__block_struct(pool, t->pos0, t->cap_tokens, false);
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
  for (unsigned i = 0; i < b->npages[kv]; i++) out[i] = kvp__page_addr(&pool->alloc, &b->pages[kv][i]);
}

/* Write n rows of one side into block b of head from token t0 (t0 > 0 only
 * for a raw OPEN block); rows src_stride bytes apart. On a CUDA region the
 * write is a job of db, run once per append (kvp__dev_batch_run). */
static int write_rows(kvp_pool *pool, uint32_t layer, uint32_t head, kvp__block *b, int kv, uint32_t t0,
                      const unsigned char *src, size_t stride, uint32_t n, void *state, kvp__dev_batch *db) {
  const kvp__binding *bd = kvp__block_binding(pool, layer, kv, b);
  void *pages[KVP_CODEC_MAX_PAGES];
  page_ptrs(pool, b, kv, pages);
#ifdef KVP_HAVE_CUDA
  if (db) {
    kvp_codec_dev_job j = {.src = src, .stride_bytes = stride, .n = t0 + n, .cap_tokens = b->cap_tokens, .t0 = t0,
                           .m = n, .head = head, .pos0 = b->pos0};
    memcpy(j.pages, pages, sizeof j.pages);
    return kvp__dev_batch_add(pool, db, bd, kv, &j);
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
      rc = write_rows(pool, layer, h, enc, side, 0, kvp__page_addr(&pool->alloc, &tail->pages[side][0]), row,
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

static int fill_data(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t pos, const kvp_kv *kv,
                     const append_plan *pl) {
  uint32_t H = pool->cfg.n_kv_heads, D = pool->cfg.head_dim;
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
  kvp__append_tx_before_publish(pool, s, tx);
  for (uint32_t h = 0; h < H; h++) publish_head(pool, s, layer, h, pl);
  kvp__run_publish(s, layer, pos + n, kvp__run_settle(pool, s, layer, pl->run), pl->nskip == H);
  plan_array_free(pool, pl->blocks, (size_t)H * pl->nb * sizeof *pl->blocks);
  plan_array_free(pool, pl->brefs, (size_t)H * pl->nnew * sizeof *pl->brefs);
  kvp__count_tokens(pool, (int64_t)n * (H - pl->nskip), (uint64_t)n * pl->nskip);
  kvp__append_tx_after_publish(pool, s, tx);
}

void kvp__run_publish(kvp__seq *s, uint32_t layer, uint32_t end_pos, kvp__run *run, bool none_stored) {
  kvp__layer *L = &s->layers[layer];
  if (none_stored) {
  } else if (run) {
    if (L->last) kvp__rcu_assign(L->last->next, run);
    else kvp__rcu_assign(L->runs, run);
    L->last = run;
  } else {
    atomic_store_explicit(&L->last->s1, atomic_load_explicit(&L->last->s1, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    atomic_store_explicit(&L->last->p1, end_pos, memory_order_release);
  }
}

static int append_layer(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                        kvp__append_tx *tx);

int kvp__append_layer(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                      kvp__append_tx *tx) {
  if (pool->cfg.memory != KVP_MEM_HOST) return append_layer(pool, s, layer, kv, skip, tx); /* device input: not screened */
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

static int append_layer(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                        kvp__append_tx *tx) {
  if (kvp__layer_rowwise(pool, layer)) return kvp__append_rowwise(pool, s, layer, kv, skip, tx);
  int rc;
  uint32_t step = atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1, pos = s->step_pos[step];
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

/* ---- evict ------------------------------------------------------------- */

/* Is any position of [a, b) retained by head h in the layer's runs? */
static bool retained_in(const kvp__layer *L, uint32_t h, uint32_t a, uint32_t b) {
  for (const kvp__run *r = L->runs; r; r = r->next)
    if (kvp__run_has(r, h) && r->p0 < b && atomic_load_explicit(&r->p1, memory_order_relaxed) > a) return true;
  return false;
}

/* Changes an undoable eviction logs (u NULL: none). */
static void log_run_link(kvp__undo *u, kvp__run **at) {
  if (u) kvp__undo_push(u, KVP__UNDO_RUN_LINK, at, (uintptr_t)*at);
}
static void log_bref_link(kvp__undo *u, kvp__bref **at) {
  if (u) kvp__undo_push(u, KVP__UNDO_BREF_LINK, at, (uintptr_t)*at);
}
static void log_u32(kvp__undo *u, _Atomic uint32_t *at) {
  if (u) kvp__undo_push(u, KVP__UNDO_U32, (void *)at, atomic_load_explicit(at, memory_order_relaxed));
}
/* Entries an undoable eviction of [a, b) of stream st logs at most: the
 * run's (a link, last, three new runs, the old one, two counters) and four
 * per block it may drop (a link, the tail, the bref, the owner). */
static uint32_t undo_entries(const kvp__stream *st, uint32_t a, uint32_t b) {
  uint32_t n = 8;
  for (const kvp__bref *r = st->blocks; r && r->blk->pos0 < b; r = r->next)
    n += 4 * (r->blk->pos0 + r->blk->n_tokens > a);
  return n;
}

/* Drop the blocks of stream (l, h) overlapping [a, b) that hold no retained
 * position and take no more tokens. */
static void drop_blocks(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t head, uint32_t a, uint32_t b,
                        kvp__undo *u) {
  kvp__stream *st = kvp__seq_stream(pool, s, layer, head);
  kvp__bref *prev = NULL, *cur = st->blocks;
  while (cur) {
    kvp__block *blk = cur->blk;
    kvp__bref *next = cur->next;
    uint32_t lo = blk->pos0, hi = blk->pos0 + blk->n_tokens;
    if (lo < b && hi > a && blk->sealed && !retained_in(&s->layers[layer], head, lo, hi)) {
      log_bref_link(u, prev ? &prev->next : &st->blocks);
      if (prev) kvp__rcu_assign(prev->next, next);
      else kvp__rcu_assign(st->blocks, next);
      if (st->tail == cur) {
        log_bref_link(u, &st->tail);
        st->tail = prev;
      }
      if (u) { /* kept until the eviction commits */
        kvp__undo_push(u, KVP__UNDO_BREF, cur, 0);
        kvp__assert(blk->owners > 0);
        blk->owners--;
        kvp__undo_push(u, KVP__UNDO_OWNER, blk, 0);
      } else {
        kvp__bref_retire(pool, cur);
        kvp__block_unown(pool, blk);
      }
    } else {
      prev = cur;
    }
    if (lo >= b) break;
    cur = next;
  }
}

bool kvp__unit_retained(const kvp__seq *s, uint32_t layer, uint32_t head, uint32_t step) {
  for (const kvp__run *r = s->layers[layer].runs; r; r = r->next)
    if (r->s0 <= step && step < atomic_load_explicit(&r->s1, memory_order_relaxed)) return kvp__run_has(r, head);
  return false;
}

/* A replacement run: from the plan's spares (cannot fail), or allocated. */
static kvp__run *run_for(kvp_pool *pool, kvp__evict_plan *ev, uint32_t s0, uint32_t p0, uint32_t s1, uint32_t p1,
                         const uint64_t *mask) {
  return ev ? kvp__evict_plan_run(pool, ev, s0, p0, s1, p1, mask) : kvp__run_new(pool, s0, p0, s1, p1, mask);
}

int kvp__evict_unit(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t head, uint32_t step, kvp__evict_plan *ev) {
  kvp__layer *L = &s->layers[layer];
  kvp__run *prev = NULL, *r = L->runs;
  for (; r; prev = r, r = r->next)
    if (r->s0 <= step && step < atomic_load_explicit(&r->s1, memory_order_relaxed)) break;
  if (!r || !kvp__run_has(r, head))
    return kvp__err(KVP_ENOENT, "seq %llu layer %u head %u step %u is not retained (evicted already, or not appended)",
                    (unsigned long long)s->id, layer, head, step);
  uint32_t s1 = atomic_load_explicit(&r->s1, memory_order_relaxed), p1 = atomic_load_explicit(&r->p1, memory_order_relaxed);
  uint32_t a = s->step_pos[step];
  uint32_t b = step + 1 == s1 ? p1 : s->step_pos[step + 1];
  kvp__stream *st = kvp__seq_stream(pool, s, layer, head);
  kvp__undo *u = ev ? ev->undo : NULL;
  if (u) {
    int rc = kvp__undo_reserve(pool, u, undo_entries(st, a, b));
    if (rc) return rc;
  }
  /* the replacement: [s0, step) | [step, step+1) without head | [step+1, s1) */
  uint64_t without[KVP_MAX_KV_HEADS / 64];
  memcpy(without, r->mask, r->nwords * sizeof(uint64_t));
  without[head / 64] &= ~(1ull << (head % 64));
  bool any = false;
  for (uint32_t w = 0; w < r->nwords; w++) any |= without[w] != 0;
  kvp__run *x = step > r->s0 ? run_for(pool, ev, r->s0, r->p0, step, a, r->mask) : NULL;
  kvp__run *y = any ? run_for(pool, ev, step, a, step + 1, b, without) : NULL;
  kvp__run *z = step + 1 < s1 ? run_for(pool, ev, step + 1, b, s1, p1, r->mask) : NULL;
  if ((step > r->s0 && !x) || (any && !y) || (step + 1 < s1 && !z)) {
    if (x) kvp__run_free_now(pool, x);
    if (y) kvp__run_free_now(pool, y);
    if (z) kvp__run_free_now(pool, z);
    return kvp__err(KVP_ENOMEM, "run metadata for an eviction");
  }
  /* chain x -> y -> z -> r->next, then swing one pointer */
  kvp__run *chain[3] = {x, y, z}, *first = r->next, *last = NULL;
  for (int i = 2; i >= 0; i--)
    if (chain[i]) {
      chain[i]->next = first;
      first = chain[i];
      if (!last) last = chain[i];
    }
  log_run_link(u, prev ? &prev->next : &L->runs);
  if (prev) kvp__rcu_assign(prev->next, first);
  else kvp__rcu_assign(L->runs, first);
  if (L->last == r) {
    log_run_link(u, &L->last);
    L->last = last ? last : prev;
  }
  for (int i = 0; u && i < 3; i++)
    if (chain[i]) kvp__undo_push(u, KVP__UNDO_RUN_NEW, chain[i], 0);
  if (u) kvp__undo_push(u, KVP__UNDO_RUN_OLD, r, 0); /* kept until the eviction commits */
  else kvp__run_retire(pool, r);
  log_u32(u, &st->retained_tokens);
  log_u32(u, &st->evicted_tokens);
  atomic_store_explicit(&st->retained_tokens, atomic_load_explicit(&st->retained_tokens, memory_order_relaxed) - (b - a),
                        memory_order_relaxed);
  atomic_store_explicit(&st->evicted_tokens, atomic_load_explicit(&st->evicted_tokens, memory_order_relaxed) + (b - a),
                        memory_order_relaxed);
  kvp__count_tokens(pool, -(int64_t)(b - a), b - a);
  drop_blocks(pool, s, layer, head, a, b, u);
  return KVP_OK;
}
