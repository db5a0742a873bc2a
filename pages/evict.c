/*
 * pages/evict.c - eviction plans, and the transaction that ties a policy's
 * evictions to the append of one layer.
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
 * budget or a region held at its limit), the evictions must come first:
 * the append takes all its metadata (block structs, brefs, run, codec
 * states, stats slot) before, checks that the budget then holds (exactly:
 * the bytes of the blocks the plan drops, plus the limbo) and that the
 * region could (its free extents and slots plus those bytes), applies them,
 * reclaims, and takes the pages (kvp__append_tx_make_room). What is left
 * that can fail after an eviction is the page allocator itself: a region
 * too fragmented for the new pages, or its own descriptors (a new slab, an
 * extent split, an address-map chunk) out of memory. The call then reports
 * the error with the evictions made (those the policy would make at the
 * next try anyway); the layer is not stored.
 *
 * Invariants: spare runs of a plan are counted in pool->meta until applied
 * or freed; applying a unit that is no longer retained does nothing.
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
    int rc = kvp__evict_unit(pool, s, u->layer, u->head, u->step, ev);
    kvp__assert(rc == KVP_OK); /* retained, runs taken ahead: cannot fail */
    (void)rc;
  }
  if (ev->commit_at) *ev->commit_at = ev->commit_val;
  ev->n = 0;
  ev->commit_at = NULL;
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
        for (unsigned j = 0; j < blk->npages[kv]; j++) sum += kvp__page_alloc_bytes(&blk->pages[kv][j]);
    }
  }
  return sum;
}

/* ---- the append transaction --------------------------------------------- */

void kvp__append_tx_init(kvp__append_tx *tx) {
  memset(tx, 0, sizeof *tx);
  kvp__evict_plan_init(&tx->before);
  kvp__evict_plan_init(&tx->after);
}

void kvp__append_tx_fini(kvp_pool *pool, kvp__append_tx *tx) {
  kvp__evict_plan_fini(pool, &tx->before);
  kvp__evict_plan_fini(pool, &tx->after);
}

int kvp__append_tx_prepare(kvp_pool *pool, kvp__append_tx *tx) {
  int rc = kvp__evict_plan_prepare(pool, &tx->before);
  return rc ? rc : kvp__evict_plan_prepare(pool, &tx->after);
}

bool kvp__append_tx_make_room(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx, uint64_t need_bytes) {
  if (!tx || tx->before_applied || !tx->before.n) return false;
  const kvp__ledger *l = &pool->alloc.ledger;
  uint64_t freed = l->retired.current + plan_freed_bytes(pool, s, &tx->before);
  uint64_t after = l->allocated.current - (freed < l->allocated.current ? freed : l->allocated.current);
  if (need_bytes > l->budget_bytes || after > l->budget_bytes - need_bytes) return false; /* the budget would not
                                                                                             hold: refuse, nothing
                                                                                             changed */
  if (need_bytes > kvp__alloc_room_bound(&pool->alloc) + freed) return false; /* nor would the region */
  kvp__evict_plan_apply(pool, s, &tx->before);
  tx->before_applied = true;
  kvp__reclaim(pool);
  return true;
}

void kvp__append_tx_before_publish(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx) {
  if (tx && !tx->before_applied) kvp__evict_plan_apply(pool, s, &tx->before);
  if (tx) tx->before_applied = true;
}

void kvp__append_tx_after_publish(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx) {
  if (tx) kvp__evict_plan_apply(pool, s, &tx->after);
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
