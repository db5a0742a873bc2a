/*
 * stats/stats.c - per-tag counters of page bytes.
 *
 * Invariant: for every dimension D (page type, K/V, codec, layer, head,
 * sequence), sum over D's slices of requested (allocated, pages) = the
 * ledger's requested (allocated, pages). kvp_check re-derives every slice
 * from the live pages and compares (kvp__stats_compare).
 *
 * The five fixed dimensions are two grids of cells (stats.h): kinds by
 * (codec, K/V, page type), places by (layer, head); a page moves one cell
 * of each, and a slice is the sum of its row or column:
 *   page_type[t] = sum over codec c, kv k of kinds[c][k][t]   (and kv, codec alike)
 *   layer[l]     = sum over head h of places[l][h]            (head alike)
 *
 * Sequences sit in an open-addressing table (linear probing, power-of-two
 * capacity, load <= 1/2). A sequence's slot stays once created (a
 * tombstone with zero usage) until the table is rebuilt on growth, which
 * drops the empty ones. Each slot's three figures move under its own
 * sequence lock (ver), so a reader's copy of one slot is consistent. The
 * writer changes the table under the pool's writer lock; readers (stats,
 * breakdowns, top-N, emitters) walk it lock-free under RCU: a rebuilt
 * table is published with a release store and the old one freed after a
 * grace period.
 *
 * In front of the table, the last sequence's slot and KVP__SEQ_HINTS
 * direct-mapped hints (stats.h) hold the slots of sequences counted
 * lately. Invariant: each is NULL or a claimed slot of the current table (a
 * key, once claimed, never changes there) and a hint's key is its slot's;
 * a rebuild empties them all.
 */
#include "stats.h"

#include <string.h>

/* The writer's counting (kvp__stats_count) is inline in stats.h. */

static kvp__seq_table *table_new(kvp__meta *meta, uint32_t cap) {
  kvp__seq_table *t = kvp__meta_calloc(meta, sizeof *t + (size_t)cap * sizeof t->slot[0]);
  if (t) {
    t->meta = meta;
    t->cap = cap;
  }
  return t;
}

static void table_free(kvp__seq_table *t) {
  if (t) kvp__meta_free(t->meta, t, sizeof *t + (size_t)t->cap * sizeof t->slot[0]);
}

static void table_free_cb(kvp__rcu_head *h) {
  kvp__rcu_cb_begin(h);
  table_free(caa_container_of(h, kvp__seq_table, rcu));
  kvp__rcu_cb_end(); /* its metadata count happens before kvp__stats_fini's barrier returns */
}

int kvp__stats_init(kvp__stats *st, uint32_t n_layers, uint32_t n_heads, kvp__meta *meta) {
  memset(st, 0, sizeof *st);
  st->meta = meta;
  st->n_layers = n_layers;
  st->n_heads = n_heads;
  st->kinds = kvp__meta_calloc(meta, KVP__STATS_KINDS * sizeof *st->kinds);
  st->places = kvp__meta_calloc(meta, (size_t)n_layers * n_heads * sizeof *st->places);
  st->seqt = table_new(meta, 64);
  if (!st->kinds || !st->places || !st->seqt) {
    kvp__stats_fini(st);
    return kvp__err(KVP_ENOMEM, "stats counters for %u layers x %u heads", n_layers, n_heads);
  }
  return KVP_OK;
}

void kvp__stats_fini(kvp__stats *st) {
  if (st->seq_deferred) kvp__rcu_barrier(); /* old tables are charged to st->meta */
  kvp__meta_free(st->meta, st->kinds, KVP__STATS_KINDS * sizeof *st->kinds);
  kvp__meta_free(st->meta, st->places, (size_t)st->n_layers * st->n_heads * sizeof *st->places);
  table_free(st->seqt);
  st->kinds = st->places = NULL;
  st->seqt = NULL;
}

static uint32_t seq_hash(uint64_t seq) {
  seq ^= seq >> 33;
  seq *= 0xff51afd7ed558ccdull;
  seq ^= seq >> 33;
  return (uint32_t)seq;
}

static uint64_t load(const _Atomic uint64_t *x) { return atomic_load_explicit(x, memory_order_relaxed); }
static bool slot_used(const kvp__seq_usage *e) { return atomic_load_explicit(&e->used, memory_order_acquire); }
static uint64_t slot_seq(const kvp__seq_usage *e) { return load(&e->seq); }

static kvp__seq_usage *seq_find(const kvp__seq_table *t, uint64_t seq, bool *found) {
  uint32_t mask = t->cap - 1;
  for (uint32_t i = seq_hash(seq) & mask;; i = (i + 1) & mask) {
    const kvp__seq_usage *e = &t->slot[i];
    bool used = slot_used(e);
    if (!used || slot_seq(e) == seq) {
      *found = used;
      return (kvp__seq_usage *)e;
    }
  }
}

/* The slot of seq, claimed, as the last one and its hint. */
static kvp__seq_usage *hint(kvp__stats *st, uint64_t seq, kvp__seq_usage *e) {
  kvp__seq_hint *h = &st->seq_hint[kvp__seq_hint_of(seq)];
  h->seq = seq;
  h->slot = e;
  return st->seq_last = e;
}

static void slot_claim(kvp__seq_usage *e, uint64_t seq) {
  atomic_store_explicit(&e->seq, seq, memory_order_relaxed);
  atomic_store_explicit(&e->used, true, memory_order_release);
}

/* Rebuild at cap, keeping only sequences that hold pages; publish the new
 * table and free the old one after a grace period. */
static int seq_rehash(kvp__stats *st, uint32_t cap) {
  kvp__seq_table *t = table_new(st->meta, cap), *old = st->seqt;
  if (!t) return kvp__err(KVP_ENOMEM, "per-sequence stats table of %u slots", cap);
  uint32_t used = 0;
  for (uint32_t i = 0; i < old->cap; i++) {
    kvp__seq_usage *o = &old->slot[i];
    if (!slot_used(o) || !load(&o->u.npages)) continue;
    bool found;
    kvp__seq_usage *n = seq_find(t, slot_seq(o), &found);
    atomic_store_explicit(&n->u.requested_bytes, load(&o->u.requested_bytes), memory_order_relaxed);
    atomic_store_explicit(&n->u.allocated_bytes, load(&o->u.allocated_bytes), memory_order_relaxed);
    atomic_store_explicit(&n->u.npages, load(&o->u.npages), memory_order_relaxed);
    slot_claim(n, slot_seq(o));
    used++;
  }
  st->seq_last = NULL; /* it and the hints point into the old table */
  memset(st->seq_hint, 0, sizeof st->seq_hint);
  kvp__rcu_assign(st->seqt, t);
  st->seq_used = used;
  st->seq_deferred = true;
  kvp__rcu_call(&old->rcu, table_free_cb);
  return KVP_OK;
}

int kvp__stats_reserve_seq_slow(kvp__stats *st, uint64_t seq) {
  bool found;
  kvp__seq_usage *e = seq_find(st->seqt, seq, &found);
  if (KVP__LIKELY(found)) {
    hint(st, seq, e); /* the page about to be counted finds it at once */
    return KVP_OK;
  }
  if ((st->seq_used + 1) * 2 > st->seqt->cap) {
    uint32_t live = 0;
    for (uint32_t i = 0; i < st->seqt->cap; i++)
      live += slot_used(&st->seqt->slot[i]) && load(&st->seqt->slot[i].u.npages);
    uint32_t cap = st->seqt->cap;
    while ((live + 1) * 4 > cap) cap *= 2; /* rebuild to load <= 1/4 */
    int rc = seq_rehash(st, cap);
    if (rc) return rc;
    e = seq_find(st->seqt, seq, &found);
  }
  slot_claim(e, seq);
  st->seq_used++;
  hint(st, seq, e);
  return KVP_OK;
}

const kvp__seq_usage *kvp__stats_seq(const kvp__stats *st, uint64_t seq) {
  bool found;
  kvp__seq_usage *e = seq_find(kvp__rcu_deref(((kvp__stats *)st)->seqt), seq, &found);
  return found ? e : NULL;
}

void kvp__seq_usage_read(const kvp__seq_usage *e, kvp_usage *out) {
  for (;;) {
    uint32_t v0 = atomic_load_explicit(&e->ver, memory_order_acquire);
    if (v0 & 1) continue;
    kvp__usage_read(&e->u, out);
    atomic_thread_fence(memory_order_acquire);
    if (atomic_load_explicit(&e->ver, memory_order_relaxed) == v0) return;
  }
}

/* Heap order for top-N: a is "smaller" (evicted from the heap first) if it
 * holds fewer allocated bytes, or as many and a larger id. */
static bool top_less(const kvp_seq_usage *a, const kvp_seq_usage *b) {
  if (a->usage.allocated_bytes != b->usage.allocated_bytes)
    return a->usage.allocated_bytes < b->usage.allocated_bytes;
  return a->seq > b->seq;
}

static void top_sift_down(kvp_seq_usage *h, uint32_t n, uint32_t i) {
  for (;;) {
    uint32_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < n && top_less(&h[l], &h[m])) m = l;
    if (r < n && top_less(&h[r], &h[m])) m = r;
    if (m == i) return;
    kvp_seq_usage t = h[i];
    h[i] = h[m];
    h[m] = t;
    i = m;
  }
}

static void top_sift_up(kvp_seq_usage *h, uint32_t i) {
  while (i && top_less(&h[i], &h[(i - 1) / 2])) {
    kvp_seq_usage t = h[i];
    h[i] = h[(i - 1) / 2];
    h[(i - 1) / 2] = t;
    i = (i - 1) / 2;
  }
}

/* A min-heap of the n largest in out itself, then heap-sorted in place:
 * O(slots x log n), no allocation. */
int kvp__stats_top_seqs(const kvp__stats *st, uint32_t n, kvp_seq_usage *out, uint32_t *n_out) {
  uint32_t k = 0;
  kvp__rcu_read_lock();
  const kvp__seq_table *t = kvp__rcu_deref(((kvp__stats *)st)->seqt);
  for (uint32_t i = 0; n && i < t->cap; i++) {
    const kvp__seq_usage *e = &t->slot[i];
    if (!slot_used(e)) continue;
    kvp_seq_usage c = {slot_seq(e), {0, 0, 0}};
    kvp__seq_usage_read(e, &c.usage);
    if (!c.usage.npages) continue;
    if (k < n) {
      out[k] = c;
      top_sift_up(out, k++);
    } else if (top_less(&out[0], &c)) {
      out[0] = c;
      top_sift_down(out, k, 0);
    }
  }
  kvp__rcu_read_unlock();
  for (uint32_t m = k; m > 1; m--) { /* smallest to the end: largest first */
    kvp_seq_usage x = out[0];
    out[0] = out[m - 1];
    out[m - 1] = x;
    top_sift_down(out, m - 1, 0);
  }
  *n_out = k;
  return KVP_OK;
}

kvp__seq_usage *kvp__stats_seq_slot(kvp__stats *st, uint64_t seq) {
  bool found;
  kvp__seq_usage *e = seq_find(st->seqt, seq, &found);
  kvp__assert(found); /* reserved before the page was taken */
  return hint(st, seq, e);
}

void kvp__usage_read(const kvp__usage *u, kvp_usage *out) {
  out->requested_bytes = load(&u->requested_bytes);
  out->allocated_bytes = load(&u->allocated_bytes);
  out->npages = load(&u->npages);
}

static void usage_acc(kvp_usage *acc, const kvp__usage *u) {
  acc->requested_bytes += load(&u->requested_bytes);
  acc->allocated_bytes += load(&u->allocated_bytes);
  acc->npages += load(&u->npages);
}

void kvp__stats_slice(const kvp__stats *st, kvp_stats_dim dim, uint32_t index, kvp_usage *out) {
  memset(out, 0, sizeof *out);
  switch (dim) {
  case KVP_DIM_PAGE_TYPE:
    for (uint32_t c = 0; c < KVP__MAX_CODECS; c++)
      for (uint32_t kv = 0; kv < 2; kv++) usage_acc(out, &st->kinds[kvp__stats_kind(c, kv, index)]);
    break;
  case KVP_DIM_KV:
    for (uint32_t c = 0; c < KVP__MAX_CODECS; c++)
      for (uint32_t t = 0; t < KVP_PAGE_TYPE_COUNT; t++) usage_acc(out, &st->kinds[kvp__stats_kind(c, index, t)]);
    break;
  case KVP_DIM_CODEC:
    for (uint32_t kv = 0; kv < 2; kv++)
      for (uint32_t t = 0; t < KVP_PAGE_TYPE_COUNT; t++) usage_acc(out, &st->kinds[kvp__stats_kind(index, kv, t)]);
    break;
  case KVP_DIM_LAYER:
    for (uint32_t h = 0; h < st->n_heads; h++) usage_acc(out, &st->places[(size_t)index * st->n_heads + h]);
    break;
  case KVP_DIM_HEAD:
    for (uint32_t l = 0; l < st->n_layers; l++) usage_acc(out, &st->places[(size_t)l * st->n_heads + index]);
    break;
  default: kvp__assert(!"a fixed dimension");
  }
}

static void sum_add(kvp_usage *u, uint64_t req, uint64_t alloc) {
  u->requested_bytes += req;
  u->allocated_bytes += alloc;
  u->npages++;
}

int kvp__stats_sum_init(const kvp__stats *st, kvp__stats_sum *s) {
  memset(s, 0, sizeof *s);
  s->layers = kvp__meta_calloc(NULL, st->n_layers * sizeof *s->layers);
  s->heads = kvp__meta_calloc(NULL, st->n_heads * sizeof *s->heads);
  s->seqs = kvp__meta_calloc(NULL, st->seqt->cap * sizeof *s->seqs);
  if (s->layers && s->heads && s->seqs) return KVP_OK;
  kvp__stats_sum_fini(st, s);
  return kvp__err(KVP_ENOMEM, "scratch for the stats check");
}

void kvp__stats_sum_fini(const kvp__stats *st, kvp__stats_sum *s) {
  kvp__meta_free(NULL, s->layers, st->n_layers * sizeof *s->layers);
  kvp__meta_free(NULL, s->heads, st->n_heads * sizeof *s->heads);
  kvp__meta_free(NULL, s->seqs, st->seqt->cap * sizeof *s->seqs);
  s->layers = s->heads = s->seqs = NULL;
}

void kvp__stats_sum_add(const kvp__stats *st, kvp__stats_sum *s, const kvp__tag *tag, uint64_t requested_bytes,
                        uint64_t allocated_bytes) {
  bool found;
  kvp__seq_usage *e = seq_find(st->seqt, tag->seq, &found);
  if (found) sum_add(&s->seqs[e - st->seqt->slot], requested_bytes, allocated_bytes);
  else if (!s->has_unknown_seq) {
    s->has_unknown_seq = true;
    s->unknown_seq = tag->seq;
  }
  sum_add(&s->page_types[tag->type], requested_bytes, allocated_bytes);
  sum_add(&s->kv[tag->kv], requested_bytes, allocated_bytes);
  sum_add(&s->codecs[tag->codec], requested_bytes, allocated_bytes);
  sum_add(&s->layers[tag->layer], requested_bytes, allocated_bytes);
  sum_add(&s->heads[tag->head], requested_bytes, allocated_bytes);
}

static int cmp_read(const char *dim, uint32_t i, const kvp_usage *have, const kvp_usage *want) {
  kvp_usage h = *have;
  if (h.requested_bytes == want->requested_bytes && h.allocated_bytes == want->allocated_bytes &&
      h.npages == want->npages)
    return KVP_OK;
  return kvp__err(KVP_ECORRUPT, "stats %s %u: counters say %llu requested/%llu allocated/%llu pages, pages hold "
                                "%llu/%llu/%llu", dim, i, (unsigned long long)h.requested_bytes,
                  (unsigned long long)h.allocated_bytes, (unsigned long long)h.npages,
                  (unsigned long long)want->requested_bytes, (unsigned long long)want->allocated_bytes,
                  (unsigned long long)want->npages);
}

static int cmp(const char *dim, uint32_t i, const kvp__usage *have, const kvp_usage *want) {
  kvp_usage h;
  kvp__usage_read(have, &h);
  return cmp_read(dim, i, &h, want);
}

static int cmp_slice(const kvp__stats *st, const char *name, kvp_stats_dim dim, uint32_t i, const kvp_usage *want) {
  kvp_usage h;
  kvp__stats_slice(st, dim, i, &h);
  return cmp_read(name, i, &h, want);
}

/* A hint (or the last sequence's slot, any_key): NULL, or a claimed slot
 * of the current table whose key is seq, at seq's hint. */
static int check_hint(const kvp__stats *st, const char *what, uint32_t i, const kvp__seq_usage *e, uint64_t seq,
                      bool any_key) {
  if (!e) return KVP_OK;
  const kvp__seq_table *t = st->seqt;
  uintptr_t a = (uintptr_t)e, lo = (uintptr_t)t->slot, hi = (uintptr_t)(t->slot + t->cap);
  if (a < lo || a >= hi || (a - lo) % sizeof *e || !slot_used(e) ||
      (!any_key && (slot_seq(e) != seq || kvp__seq_hint_of(seq) != i)))
    return kvp__err(KVP_ECORRUPT, "%s %u (sequence %llu): not the sequence's claimed slot of the table", what, i,
                    (unsigned long long)seq);
  return KVP_OK;
}

int kvp__stats_compare(const kvp__stats *st, const kvp__stats_sum *s) {
  int rc = KVP_OK;
  for (uint32_t i = 0; !rc && i < KVP_PAGE_TYPE_COUNT; i++)
    rc = cmp_slice(st, "page type", KVP_DIM_PAGE_TYPE, i, &s->page_types[i]);
  for (uint32_t i = 0; !rc && i < 2; i++) rc = cmp_slice(st, "kv", KVP_DIM_KV, i, &s->kv[i]);
  for (uint32_t i = 0; !rc && i < KVP__MAX_CODECS; i++) rc = cmp_slice(st, "codec", KVP_DIM_CODEC, i, &s->codecs[i]);
  for (uint32_t i = 0; !rc && i < st->n_layers; i++) rc = cmp_slice(st, "layer", KVP_DIM_LAYER, i, &s->layers[i]);
  for (uint32_t i = 0; !rc && i < st->n_heads; i++) rc = cmp_slice(st, "head", KVP_DIM_HEAD, i, &s->heads[i]);
  if (!rc && s->has_unknown_seq)
    return kvp__err(KVP_ECORRUPT, "a page of sequence %llu is not in the per-sequence stats",
                    (unsigned long long)s->unknown_seq);
  for (uint32_t i = 0; !rc && i < st->seqt->cap; i++)
    if (slot_used(&st->seqt->slot[i])) rc = cmp("sequence slot", i, &st->seqt->slot[i].u, &s->seqs[i]);
  if (!rc) rc = check_hint(st, "last sequence slot", 0, st->seq_last, 0, true);
  for (uint32_t i = 0; !rc && i < KVP__SEQ_HINTS; i++)
    rc = check_hint(st, "sequence hint", i, st->seq_hint[i].slot, st->seq_hint[i].seq, false);
  return rc;
}
