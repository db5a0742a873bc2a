/*
 * pages/evict.c - eviction plans, the eviction of one (layer, head, step)
 * unit, and the transaction that ties a policy's evictions to the append
 * of one layer.
 *
 * A policy does not evict from its hooks: it names units (layer, head,
 * step) into a plan. kvp__evict_plan_prepare takes ahead of time the run
 * metadata every eviction of the plan may need (an eviction splits one run
 * into at most three), so kvp__evict_plan_apply cannot fail.
 *
 * One append of a layer is then one transaction (kvp__append_tx):
 *
 *   plan     before (the policy's evictions before the layer is stored),
 *            after (those it makes once the layer is stored), skip mask
 *   prepare  both plans' runs                                (may fail: nothing changed)
 *   take     the append's metadata and pages, write payload  (may fail: undone, nothing changed)
 *   commit   apply before, publish the layer, apply after    (cannot fail)
 *
 * When the pages fit only once the before-evictions have freed theirs (a
 * budget or a region held at its limit), the evictions must come first,
 * and stay undoable until the publication (kvp__append_tx_take):
 *
 *   metadata  the append's block structs, brefs, run, codec states, stats
 *             slot                                        (before: nothing evicted yet)
 *   check     the budget would then hold (exactly: the bytes of the blocks
 *             the plan drops, plus the limbo), the region could (its free
 *             extents and slots plus those bytes)         (else refused, nothing changed)
 *   apply     each unit logged (kvp__undo): links and counters changed,
 *             runs and brefs unlinked but kept, owners lowered but blocks
 *             kept                                        (ENOMEM for the log: undone)
 *   grace     synchronize: no reader finds a dropped block any more, so a
 *             block with owners 0 and refs 1 can take no pin
 *   free      those blocks' pages, in an allocator transaction (alloc/txn.c)
 *             that holds what giving them back needs: out of the ledger,
 *             their bytes still held                      (ENOMEM: undone)
 *   take      the new pages; if the region is short, once more after the
 *             freed pages' bytes went back to it          (any failure: pages
 *             given back, the transaction rolled back (each freed page
 *             counted, and taken at its offset again), the log undone:
 *             nothing changed)
 *   save      when a new page lies over a freed one (the region was short),
 *             a host copy of the freed pages' payload     (ENOMEM: undone)
 *   write     the payload                                 (a failure: undone
 *             too, the saved payload written back first; on a CUDA region
 *             once the device drained: kvp__dev_batch_run waits even when
 *             it fails, and a row-wise append that fails before it drains
 *             the region, its copies being in flight)
 *   publish   the log commits: unlinked runs and brefs retired, blocks
 *             whose pages went freed, the others' owner drop finished
 *
 * A failed undoable append changes the ledger's totals only (allocations
 * and frees counted, peaks) and may have reclaimed the limbo, as
 * kvp_reclaim would.
 *
 * Invariants: spare runs of a plan are counted in pool->meta until applied
 * or freed; applying a unit that is no longer retained does nothing. A
 * policy's plan never meets a shared prefix (sequences with a policy share
 * nothing); kvp_evict's one unit (kvp__evict_one) detaches the sequence
 * from the prefix chunks under it first (pages/prefix.c), with its runs
 * taken, so that the eviction then cannot fail.
 */
#include "policy.h"

#include <string.h>

static size_t run_bytes(const kvp_pool *pool) {
  return sizeof(kvp__run) + (pool->cfg.n_kv_heads + 63) / 64 * sizeof(uint64_t);
}

void kvp__evict_plan_init(kvp__evict_plan *ev) { memset(ev, 0, sizeof *ev); }

void kvp__evict_plan_fini(kvp_pool *pool, kvp__evict_plan *ev) {
  for (uint32_t i = 0; i < ev->nspare; i++) kvp__meta_free(&pool->meta, ev->spare[i], run_bytes(pool));
  kvp__meta_free(&pool->meta, ev->spare, ev->spare_cap * sizeof *ev->spare);
  kvp__meta_free(&pool->meta, ev->units, ev->cap * sizeof *ev->units);
  memset(ev, 0, sizeof *ev);
}

int kvp__evict_plan_add(kvp_pool *pool, kvp__evict_plan *ev, uint32_t layer, uint32_t head, uint32_t step) {
  if (ev->n == ev->cap) {
    uint32_t ncap = ev->cap ? 2 * ev->cap : 16;
    kvp__unit *nu = kvp__meta_realloc(&pool->meta, ev->units, ev->cap * sizeof *nu, ncap * sizeof *nu);
    if (!nu) return kvp__err(KVP_ENOMEM, "eviction plan of %u units", ncap);
    ev->units = nu;
    ev->cap = ncap;
  }
  ev->units[ev->n++] = (kvp__unit){layer, head, step};
  return KVP_OK;
}

int kvp__evict_plan_prepare(kvp_pool *pool, kvp__evict_plan *ev) {
  uint32_t want = 3 * ev->n;
  if (want <= ev->nspare) return KVP_OK;
  if (want > ev->spare_cap) {
    kvp__run **ns = kvp__meta_realloc(&pool->meta, ev->spare, ev->spare_cap * sizeof *ns, want * sizeof *ns);
    if (!ns) return kvp__err(KVP_ENOMEM, "eviction plan: room for %u runs", want);
    ev->spare = ns;
    ev->spare_cap = want;
  }
  while (ev->nspare < want) {
    kvp__run *r = kvp__meta_alloc(&pool->meta, run_bytes(pool));
    if (!r) return kvp__err(KVP_ENOMEM, "eviction plan: run metadata for %u evictions", ev->n);
    ev->spare[ev->nspare++] = r;
  }
  return KVP_OK;
}

kvp__run *kvp__evict_plan_run(kvp_pool *pool, kvp__evict_plan *ev, uint32_t s0, uint32_t p0, uint32_t s1,
                              uint32_t p1, const uint64_t *mask) {
  kvp__assert(ev->nspare > 0); /* prepare took three per unit */
  kvp__run *r = ev->spare[--ev->nspare];
  r->next = NULL;
  r->s0 = s0;
  r->p0 = p0;
  atomic_init(&r->s1, s1);
  atomic_init(&r->p1, p1);
  r->nwords = (pool->cfg.n_kv_heads + 63) / 64;
  memcpy(r->mask, mask, r->nwords * sizeof(uint64_t));
  return r;
}

void kvp__evict_plan_apply(kvp_pool *pool, kvp__seq *s, kvp__evict_plan *ev) {
  for (uint32_t i = 0; i < ev->n; i++) {
    const kvp__unit *u = &ev->units[i];
    if (!kvp__unit_retained(s, u->layer, u->head, u->step)) continue;
    kvp__assert(!kvp__prefix_holds_any(pool, s, s->step_pos[u->step], s->step_pos[u->step + 1])); /* detached */
    int rc = kvp__evict_unit(pool, s, u->layer, u->head, u->step, ev);
    kvp__assert(rc == KVP_OK); /* retained, runs taken ahead: cannot fail */
    (void)rc;
  }
  if (ev->commit_at) *ev->commit_at = ev->commit_val;
  ev->n = 0;
  ev->commit_at = NULL;
}

int kvp__evict_one(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t head, uint32_t step) {
  if (!kvp__unit_retained(s, layer, head, step)) return kvp__evict_unit(pool, s, layer, head, step, NULL); /* names it */
  kvp__evict_plan ev;
  kvp__evict_plan_init(&ev);
  int rc = kvp__evict_plan_add(pool, &ev, layer, head, step);
  if (!rc) rc = kvp__evict_plan_prepare(pool, &ev);
  if (!rc) rc = kvp__prefix_detach(pool, s, s->step_pos[step], s->step_pos[step + 1]);
  if (!rc) kvp__evict_plan_apply(pool, s, &ev);
  kvp__evict_plan_fini(pool, &ev);
  return rc;
}

/* Allocated bytes of the blocks the plan's evictions free at the next
 * reclaim: in step mode a unit drops the blocks of its stream inside its
 * step, and a block held by no one else (no fork, no view) is freed. In
 * stream mode (blocks straddle steps) nothing is counted. */
static uint64_t plan_freed_bytes(const kvp_pool *pool, kvp__seq *s, const kvp__evict_plan *ev) {
  if (s->mode != KVP_SEQ_STEP) return 0;
  uint32_t n_steps = atomic_load_explicit(&s->n_steps, memory_order_relaxed);
  uint64_t sum = 0;
  for (uint32_t i = 0; i < ev->n; i++) {
    const kvp__unit *u = &ev->units[i];
    if (u->step + 1 >= n_steps || !kvp__unit_retained(s, u->layer, u->head, u->step)) continue;
    uint32_t a = s->step_pos[u->step], b = s->step_pos[u->step + 1];
    for (const kvp__bref *r = kvp__seq_stream(pool, s, u->layer, u->head)->blocks; r; r = r->next) {
      const kvp__block *blk = r->blk;
      if (blk->pos0 >= b) break;
      if (blk->pos0 < a || !blk->sealed || atomic_load(&blk->refs) != 1) continue;
      for (int kv = 0; kv < 2; kv++)
        for (unsigned j = 0; j < blk->npages[kv]; j++) sum += kvp__page_alloc_bytes(&KVP__PG(blk, j)[kv]);
    }
  }
  return sum;
}

/* ---- the eviction of one unit ------------------------------------------ */

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

/* ---- the undo log --------------------------------------------------------- */

int kvp__undo_reserve(kvp_pool *pool, kvp__undo *u, uint32_t more) {
  if (u->cap - u->n >= more) return KVP_OK;
  uint32_t ncap = u->cap ? u->cap : 32;
  while (ncap - u->n < more) ncap *= 2;
  kvp__undo_ent *ne = kvp__meta_realloc(&pool->meta, u->e, u->cap * sizeof *ne, ncap * sizeof *ne);
  if (!ne) return kvp__err(KVP_ENOMEM, "undo log of %u entries for an eviction that makes room", ncap);
  u->e = ne;
  u->cap = ncap;
  return KVP_OK;
}

void kvp__undo_push(kvp__undo *u, int kind, void *at, uint64_t old) {
  kvp__assert(u->n < u->cap); /* reserved per unit before it changes anything */
  u->e[u->n++] = (kvp__undo_ent){(uint8_t)kind, false, at, old};
}

/* Put back every change, last first. Runs linked in were seen by readers:
 * they go after a grace period; what was unlinked was kept, and is linked
 * again. */
static void undo_apply(kvp_pool *pool, kvp__undo *u) {
  for (uint32_t i = u->n; i--;) {
    kvp__undo_ent *e = &u->e[i];
    switch (e->kind) {
    case KVP__UNDO_RUN_LINK: kvp__rcu_assign(*(kvp__run **)e->at, (kvp__run *)(uintptr_t)e->old); break;
    case KVP__UNDO_BREF_LINK: kvp__rcu_assign(*(kvp__bref **)e->at, (kvp__bref *)(uintptr_t)e->old); break;
    case KVP__UNDO_U32: atomic_store_explicit((_Atomic uint32_t *)e->at, (uint32_t)e->old, memory_order_relaxed); break;
    case KVP__UNDO_RUN_NEW: kvp__run_retire(pool, e->at); break;
    case KVP__UNDO_OWNER: ((kvp__block *)e->at)->owners++; break;
    default: break; /* RUN_OLD, BREF: linked again above */
    }
  }
  kvp__ledger *l = &pool->alloc.ledger;
  kvp__ledger_begin(l);
  kvp__w64(&l->tokens_retained.current, u->tokens_retained);
  kvp__w64(&l->bf16_equivalent.current, u->bf16_equivalent);
  kvp__w64(&l->tokens_evicted, u->tokens_evicted);
  kvp__ledger_end(l);
  u->n = 0;
}

/* Let every change stand: what was unlinked goes (runs and brefs after a
 * grace period; a block whose pages the transaction freed now, its grace
 * period passed; any other block through the rest of its owner drop). */
static void undo_commit(kvp_pool *pool, kvp__undo *u) {
  for (uint32_t i = 0; i < u->n; i++) {
    kvp__undo_ent *e = &u->e[i];
    if (e->kind == KVP__UNDO_RUN_OLD) kvp__run_retire(pool, e->at);
    else if (e->kind == KVP__UNDO_BREF) kvp__bref_retire(pool, e->at);
    else if (e->kind == KVP__UNDO_OWNER && e->freed) {
      kvp__block *b = e->at;
      kvp__assert(!b->chunk); /* a prefix-table entry owns its blocks: never freed here */
      atomic_store_explicit(&b->refs, 0, memory_order_relaxed);
      kvp__block_struct_free(pool, b);
    } else if (e->kind == KVP__UNDO_OWNER) {
      kvp__block_unowned(pool, e->at);
    }
  }
  u->n = 0;
}

/* ---- the append transaction --------------------------------------------- */

/* New pages lie over freed ones (the region was short): keep a host copy
 * of the freed pages' payload before anything is written, so that a write
 * that fails can still be undone. ENOMEM, or the region's error. */
static int payload_save(kvp_pool *pool, kvp__append_tx *tx) {
  const kvp__alloc_tx *atx = &tx->atx;
  kvp__region *r = &pool->alloc.region;
  if (pool->cfg.flags & KVP_POOL_DRY) return KVP_OK; /* no payload */
  size_t bytes = 0;
  for (uint32_t i = 0; i < atx->n; i++) bytes += atx->freed[i].page.requested_bytes;
  unsigned char *buf = kvp__meta_alloc(&pool->meta, bytes + 1);
  if (!buf) return kvp__err(KVP_ENOMEM, "host copy of the %zu payload bytes of the pages evicted to make room", bytes);
  int rc = KVP_OK;
  for (size_t i = 0, at = 0; !rc && i < atx->n; at += atx->freed[i++].page.requested_bytes) {
    const kvp__page *p = &atx->freed[i].page;
    rc = r->ops->read2d(r, buf + at, p->requested_bytes, p->off, p->requested_bytes, p->requested_bytes, 1, NULL);
  }
  if (!rc) rc = r->ops->quiesce(r);
  if (rc) {
    kvp__meta_free(&pool->meta, buf, bytes + 1);
    return rc;
  }
  tx->payload = buf;
  tx->payload_bytes = bytes;
  return KVP_OK;
}

static void payload_drop(kvp_pool *pool, kvp__append_tx *tx) {
  if (tx->payload) kvp__meta_free(&pool->meta, tx->payload, tx->payload_bytes + 1);
  tx->payload = NULL;
  tx->payload_bytes = 0;
}

/* The freed pages are theirs again (rolled back): their payload too. A
 * device that fails these copies fails the pool's work anyway; the region
 * has reported it. */
static void payload_restore(kvp_pool *pool, kvp__append_tx *tx) {
  const kvp__alloc_tx *atx = &tx->atx;
  kvp__region *r = &pool->alloc.region;
  for (size_t i = 0, at = 0; i < atx->n; at += atx->freed[i++].page.requested_bytes) {
    const kvp__page *p = &atx->freed[i].page;
    (void)r->ops->write2d(r, p->off, p->requested_bytes, tx->payload + at, p->requested_bytes, p->requested_bytes, 1,
                          NULL);
  }
  (void)r->ops->quiesce(r);
}

void kvp__append_tx_init(kvp__append_tx *tx) {
  memset(tx, 0, sizeof *tx);
  kvp__evict_plan_init(&tx->before);
  kvp__evict_plan_init(&tx->after);
}

void kvp__append_tx_fini(kvp_pool *pool, kvp__append_tx *tx) {
  kvp__assert(!tx->room); /* committed at publish or undone on failure */
  kvp__evict_plan_fini(pool, &tx->before);
  kvp__evict_plan_fini(pool, &tx->after);
  kvp__meta_free(&pool->meta, tx->undo.e, tx->undo.cap * sizeof *tx->undo.e);
  kvp__alloc_tx_release(&pool->alloc, &tx->atx);
  payload_drop(pool, tx);
}

int kvp__append_tx_prepare(kvp_pool *pool, kvp__append_tx *tx) {
  int rc = kvp__evict_plan_prepare(pool, &tx->before);
  return rc ? rc : kvp__evict_plan_prepare(pool, &tx->after);
}

/* Could the before-evictions make room for need_bytes? The budget exactly
 * (the bytes of the blocks the plan drops, plus the limbo), the region as
 * a bound (its free extents and slots plus those bytes). No: nothing to try. */
static bool room_possible(kvp_pool *pool, kvp__seq *s, const kvp__append_tx *tx, uint64_t need_bytes) {
  if (!tx || tx->before_applied || !tx->before.n) return false;
  const kvp__ledger *l = &pool->alloc.ledger;
  uint64_t freed = l->retired.current + plan_freed_bytes(pool, s, &tx->before);
  uint64_t after = l->allocated.current - (freed < l->allocated.current ? freed : l->allocated.current);
  if (need_bytes > l->budget_bytes || after > l->budget_bytes - need_bytes) return false;
  return need_bytes <= kvp__alloc_room_bound(&pool->alloc) + freed;
}

/* Apply the before-evictions undoably, wait for a grace period (no reader
 * finds the blocks they dropped any more, so none can pin one), free the
 * limbo, and free in an allocator transaction the pages of every dropped
 * block that lost its last owner and has no pin. ENOMEM (the log, the
 * transaction's reservations): everything undone. */
static int make_room(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx) {
  const kvp__ledger *l = &pool->alloc.ledger;
  kvp__undo *u = &tx->undo;
  u->n = 0;
  u->tokens_retained = l->tokens_retained.current;
  u->bf16_equivalent = l->bf16_equivalent.current;
  u->tokens_evicted = l->tokens_evicted;
  tx->before.undo = u;
  int rc = KVP_OK;
  for (uint32_t i = 0; !rc && i < tx->before.n; i++) {
    const kvp__unit *un = &tx->before.units[i];
    if (kvp__unit_retained(s, un->layer, un->head, un->step))
      rc = kvp__evict_unit(pool, s, un->layer, un->head, un->step, &tx->before);
  }
  if (!rc) {
    kvp__rcu_synchronize();
    kvp__reclaim_after_grace(pool); /* what earlier calls evicted goes for good */
  }
  for (uint32_t i = 0; !rc && i < u->n; i++) { /* the blocks to free, decided once */
    kvp__undo_ent *e = &u->e[i];
    const kvp__block *b = e->at;
    if (e->kind != KVP__UNDO_OWNER || b->owners || atomic_load_explicit(&b->refs, memory_order_acquire) != 1) continue;
    e->freed = true;
    for (int kv = 0; !rc && kv < 2; kv++)
      for (unsigned j = 0; !rc && j < b->npages[kv]; j++)
        rc = kvp__alloc_tx_reserve(&pool->alloc, &tx->atx, &KVP__PG(b, j)[kv]);
  }
  if (rc) {
    kvp__alloc_tx_release(&pool->alloc, &tx->atx);
    undo_apply(pool, u);
    tx->before.undo = NULL;
    return rc;
  }
  kvp__alloc_tx_begin(&pool->alloc, &tx->atx);
  for (uint32_t i = 0; i < u->n; i++) {
    const kvp__undo_ent *e = &u->e[i];
    const kvp__block *b = e->at;
    for (int kv = 0; e->freed && kv < 2; kv++)
      for (unsigned j = 0; j < b->npages[kv]; j++) kvp__alloc_tx_free(&pool->alloc, &tx->atx, &KVP__PG(b, j)[kv]);
  }
  tx->room = true;
  tx->before_applied = true;
  return KVP_OK;
}

/* Put everything back: the pages (and their payload, if new pages were
 * written over them), then the evictions. */
static void room_undo(kvp_pool *pool, kvp__append_tx *tx) {
  if (tx->payload) payload_restore(pool, tx); /* before the rollback: it ends the transaction and its records */
  payload_drop(pool, tx);
  kvp__alloc_tx_rollback(&pool->alloc, &tx->atx);
  undo_apply(pool, &tx->undo);
  tx->before.undo = NULL;
  tx->room = false;
  tx->before_applied = false;
}

static void room_commit(kvp_pool *pool, kvp__append_tx *tx) {
  payload_drop(pool, tx);
  kvp__alloc_tx_commit(&pool->alloc, &tx->atx);
  undo_commit(pool, &tx->undo);
  kvp__evict_plan *ev = &tx->before;
  if (ev->commit_at) *ev->commit_at = ev->commit_val;
  ev->n = 0;
  ev->commit_at = NULL;
  ev->undo = NULL;
  tx->room = false;
}

int kvp__append_tx_take(kvp_pool *pool, kvp__seq *s, uint32_t layer, kvp__append_tx *tx, uint64_t bytes,
                        int (*take)(kvp_pool *pool, void *ctx), void (*give)(kvp_pool *pool, void *ctx), void *ctx) {
  int rc;
  if (!kvp__alloc_fits_bytes(&pool->alloc, bytes) && pool->limbo) kvp__reclaim(pool);
  if (!kvp__alloc_fits_bytes(&pool->alloc, bytes)) { /* the budget is short */
    if (!room_possible(pool, s, tx, bytes)) return kvp__append_budget_err(pool, s, layer, bytes);
    if ((rc = make_room(pool, s, tx))) return rc;
    rc = kvp__alloc_fits_bytes(&pool->alloc, bytes) ? take(pool, ctx) : KVP_EBUDGET; /* EBUDGET: a block the plan
                                                                                     counted was shared or pinned */
  } else {
    rc = take(pool, ctx);
    if (rc == KVP_ENOSPC && pool->limbo) {
      kvp__reclaim(pool);
      rc = take(pool, ctx);
    }
    if (rc == KVP_ENOSPC && room_possible(pool, s, tx, bytes)) { /* the region is short */
      int mrc = make_room(pool, s, tx);
      if (mrc) return mrc;
      rc = take(pool, ctx);
    }
  }
  if (rc == KVP_ENOSPC && tx && tx->room) { /* the region too: the evicted pages' bytes go back to it */
    kvp__alloc_tx_free_space(&pool->alloc, &tx->atx);
    rc = take(pool, ctx);
    if (!rc && tx->atx.reused && (rc = payload_save(pool, tx))) give(pool, ctx);
  }
  if (rc && tx && tx->room) {
    room_undo(pool, tx); /* take gave back what it took and named why */
    if (rc == KVP_EBUDGET) return kvp__append_budget_err(pool, s, layer, bytes);
  }
  return rc;
}

void kvp__append_tx_fail(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx) {
  (void)s;
  if (!tx || !tx->room) return;
  kvp__assert(!tx->atx.reused || tx->payload || (pool->cfg.flags & KVP_POOL_DRY)); /* saved when taken */
  room_undo(pool, tx);
}

void kvp__append_tx_before_publish(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx) {
  if (tx && tx->room) room_commit(pool, tx);
  else if (tx && !tx->before_applied) kvp__evict_plan_apply(pool, s, &tx->before);
  if (tx) tx->before_applied = true;
}

void kvp__append_tx_after_publish(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx) {
  if (tx) kvp__evict_plan_apply(pool, s, &tx->after);
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

kvp__run *kvp__run_settle(kvp_pool *pool, kvp__seq *s, uint32_t layer, kvp__run *run) {
  uint32_t step = atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1;
  if (run && kvp__run_extends(pool, &s->layers[layer], step, run->mask)) {
    kvp__run_free_now(pool, run);
    return NULL;
  }
  return run;
}

int kvp__append_budget_err(kvp_pool *pool, const kvp__seq *s, uint32_t layer, uint64_t bytes) {
  return kvp__err(KVP_EBUDGET, "append of seq %llu layer %u (%u tokens): %llu more allocated bytes would pass the "
                  "budget (%llu of %llu in use)", (unsigned long long)s->id, layer, s->cur_tokens,
                  (unsigned long long)bytes, (unsigned long long)pool->alloc.ledger.allocated.current,
                  (unsigned long long)pool->alloc.ledger.budget_bytes);
}
