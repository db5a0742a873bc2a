/*
 * stats/stats.c - per-tag counters of page bytes.
 *
 * Invariant: for every dimension D (page type, K/V, codec, layer, head,
 * sequence), sum over D's slices of requested (allocated, pages) = the
 * ledger's requested (allocated, pages). kvp_check re-derives every slice
 * from the live pages and compares (kvp__stats_compare).
 *
 * Sequences sit in an open-addressing table (linear probing, power-of-two
 * capacity, load <= 1/2). A sequence's slot stays once created (a
 * tombstone with zero usage) until the table is rebuilt on growth, which
 * drops the empty ones. Access to the table is under the writer lock.
 */
#include "stats.h"

#include <string.h>

/* Single writer (the pool's writer lock): a relaxed load and store, plain
 * moves on x86-64, instead of a locked read-modify-write; readers still see
 * whole values. */
#define ADD(field, n) \
  atomic_store_explicit(&(field), atomic_load_explicit(&(field), memory_order_relaxed) + (n), memory_order_relaxed)
#define SUB(field, n) \
  atomic_store_explicit(&(field), atomic_load_explicit(&(field), memory_order_relaxed) - (n), memory_order_relaxed)

int kvp__stats_init(kvp__stats *st, uint32_t n_layers, uint32_t n_heads, kvp__meta *meta) {
  memset(st, 0, sizeof *st);
  st->meta = meta;
  st->n_layers = n_layers;
  st->n_heads = n_heads;
  st->seq_cap = 64;
  st->layers = kvp__meta_calloc(meta, n_layers * sizeof *st->layers);
  st->heads = kvp__meta_calloc(meta, n_heads * sizeof *st->heads);
  st->seqs = kvp__meta_calloc(meta, st->seq_cap * sizeof *st->seqs);
  if (!st->layers || !st->heads || !st->seqs) {
    kvp__stats_fini(st);
    return kvp__err(KVP_ENOMEM, "stats counters for %u layers x %u heads", n_layers, n_heads);
  }
  return KVP_OK;
}

void kvp__stats_fini(kvp__stats *st) {
  kvp__meta_free(st->meta, st->layers, st->n_layers * sizeof *st->layers);
  kvp__meta_free(st->meta, st->heads, st->n_heads * sizeof *st->heads);
  kvp__meta_free(st->meta, st->seqs, st->seq_cap * sizeof *st->seqs);
  st->layers = st->heads = NULL;
  st->seqs = NULL;
}

static uint32_t seq_hash(uint64_t seq) {
  seq ^= seq >> 33;
  seq *= 0xff51afd7ed558ccdull;
  seq ^= seq >> 33;
  return (uint32_t)seq;
}

static kvp__seq_usage *seq_find(kvp__seq_usage *t, uint32_t cap, uint64_t seq, bool *found) {
  for (uint32_t i = seq_hash(seq) & (cap - 1);; i = (i + 1) & (cap - 1)) {
    if (!t[i].used || t[i].seq == seq) {
      *found = t[i].used;
      return &t[i];
    }
  }
}

static uint64_t load(const _Atomic uint64_t *x) { return atomic_load_explicit(x, memory_order_relaxed); }

/* Rebuild at cap, keeping only sequences that hold pages. */
static int seq_rehash(kvp__stats *st, uint32_t cap) {
  kvp__seq_usage *t = kvp__meta_calloc(st->meta, cap * sizeof *t);
  if (!t) return kvp__err(KVP_ENOMEM, "per-sequence stats table of %u slots", cap);
  uint32_t used = 0;
  for (uint32_t i = 0; i < st->seq_cap; i++) {
    kvp__seq_usage *o = &st->seqs[i];
    if (!o->used || !load(&o->u.npages)) continue;
    bool found;
    kvp__seq_usage *n = seq_find(t, cap, o->seq, &found);
    n->used = true;
    n->seq = o->seq;
    atomic_store_explicit(&n->u.requested_bytes, load(&o->u.requested_bytes), memory_order_relaxed);
    atomic_store_explicit(&n->u.allocated_bytes, load(&o->u.allocated_bytes), memory_order_relaxed);
    atomic_store_explicit(&n->u.npages, load(&o->u.npages), memory_order_relaxed);
    used++;
  }
  kvp__meta_free(st->meta, st->seqs, st->seq_cap * sizeof *st->seqs);
  st->seq_last = NULL;
  st->seqs = t;
  st->seq_cap = cap;
  st->seq_used = used;
  return KVP_OK;
}

int kvp__stats_reserve_seq(kvp__stats *st, uint64_t seq) {
  if (KVP__LIKELY(st->seq_last && st->seq_last->seq == seq)) return KVP_OK;
  bool found;
  kvp__seq_usage *e = seq_find(st->seqs, st->seq_cap, seq, &found);
  if (KVP__LIKELY(found)) return KVP_OK;
  if ((st->seq_used + 1) * 2 > st->seq_cap) {
    uint32_t live = 0;
    for (uint32_t i = 0; i < st->seq_cap; i++) live += st->seqs[i].used && load(&st->seqs[i].u.npages);
    uint32_t cap = st->seq_cap;
    while ((live + 1) * 4 > cap) cap *= 2; /* rebuild to load <= 1/4 */
    int rc = seq_rehash(st, cap);
    if (rc) return rc;
    e = seq_find(st->seqs, st->seq_cap, seq, &found);
  }
  e->used = true;
  e->seq = seq;
  st->seq_used++;
  return KVP_OK;
}

const kvp__usage *kvp__stats_seq(const kvp__stats *st, uint64_t seq) {
  bool found;
  kvp__seq_usage *e = seq_find(st->seqs, st->seq_cap, seq, &found);
  return found ? &e->u : NULL;
}

static void usage_move(kvp__usage *u, uint64_t req, uint64_t alloc, int sign) {
  if (sign > 0) {
    ADD(u->requested_bytes, req);
    ADD(u->allocated_bytes, alloc);
    ADD(u->npages, 1);
  } else {
    SUB(u->requested_bytes, req);
    SUB(u->allocated_bytes, alloc);
    SUB(u->npages, 1);
  }
}

void kvp__stats_count(kvp__stats *st, const kvp__tag *tag, uint64_t requested_bytes, uint64_t allocated_bytes,
                      int sign) {
  usage_move(&st->page_types[tag->type], requested_bytes, allocated_bytes, sign);
  usage_move(&st->kv[tag->kv], requested_bytes, allocated_bytes, sign);
  usage_move(&st->codecs[tag->codec], requested_bytes, allocated_bytes, sign);
  usage_move(&st->layers[tag->layer], requested_bytes, allocated_bytes, sign);
  usage_move(&st->heads[tag->head], requested_bytes, allocated_bytes, sign);
  kvp__seq_usage *e = st->seq_last;
  if (!e || e->seq != tag->seq) {
    bool found;
    e = seq_find(st->seqs, st->seq_cap, tag->seq, &found);
    kvp__assert(found); /* reserved before the page was taken */
    st->seq_last = e;
  }
  usage_move(&e->u, requested_bytes, allocated_bytes, sign);
}

void kvp__usage_read(const kvp__usage *u, kvp_usage *out) {
  out->requested_bytes = load(&u->requested_bytes);
  out->allocated_bytes = load(&u->allocated_bytes);
  out->npages = load(&u->npages);
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
  s->seqs = kvp__meta_calloc(NULL, st->seq_cap * sizeof *s->seqs);
  if (s->layers && s->heads && s->seqs) return KVP_OK;
  kvp__stats_sum_fini(st, s);
  return kvp__err(KVP_ENOMEM, "scratch for the stats check");
}

void kvp__stats_sum_fini(const kvp__stats *st, kvp__stats_sum *s) {
  kvp__meta_free(NULL, s->layers, st->n_layers * sizeof *s->layers);
  kvp__meta_free(NULL, s->heads, st->n_heads * sizeof *s->heads);
  kvp__meta_free(NULL, s->seqs, st->seq_cap * sizeof *s->seqs);
  s->layers = s->heads = s->seqs = NULL;
}

void kvp__stats_sum_add(const kvp__stats *st, kvp__stats_sum *s, const kvp__tag *tag, uint64_t requested_bytes,
                        uint64_t allocated_bytes) {
  bool found;
  kvp__seq_usage *e = seq_find(st->seqs, st->seq_cap, tag->seq, &found);
  if (found) sum_add(&s->seqs[e - st->seqs], requested_bytes, allocated_bytes);
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

static int cmp(const char *dim, uint32_t i, const kvp__usage *have, const kvp_usage *want) {
  kvp_usage h;
  kvp__usage_read(have, &h);
  if (h.requested_bytes == want->requested_bytes && h.allocated_bytes == want->allocated_bytes &&
      h.npages == want->npages)
    return KVP_OK;
  return kvp__err(KVP_ECORRUPT, "stats %s %u: counters say %llu requested/%llu allocated/%llu pages, pages hold "
                                "%llu/%llu/%llu", dim, i, (unsigned long long)h.requested_bytes,
                  (unsigned long long)h.allocated_bytes, (unsigned long long)h.npages,
                  (unsigned long long)want->requested_bytes, (unsigned long long)want->allocated_bytes,
                  (unsigned long long)want->npages);
}

int kvp__stats_compare(const kvp__stats *st, const kvp__stats_sum *s) {
  int rc = KVP_OK;
  for (uint32_t i = 0; !rc && i < KVP_PAGE_TYPE_COUNT; i++) rc = cmp("page type", i, &st->page_types[i], &s->page_types[i]);
  for (uint32_t i = 0; !rc && i < 2; i++) rc = cmp("kv", i, &st->kv[i], &s->kv[i]);
  for (uint32_t i = 0; !rc && i < KVP__MAX_CODECS; i++) rc = cmp("codec", i, &st->codecs[i], &s->codecs[i]);
  for (uint32_t i = 0; !rc && i < st->n_layers; i++) rc = cmp("layer", i, &st->layers[i], &s->layers[i]);
  for (uint32_t i = 0; !rc && i < st->n_heads; i++) rc = cmp("head", i, &st->heads[i], &s->heads[i]);
  if (!rc && s->has_unknown_seq)
    return kvp__err(KVP_ECORRUPT, "a page of sequence %llu is not in the per-sequence stats",
                    (unsigned long long)s->unknown_seq);
  for (uint32_t i = 0; !rc && i < st->seq_cap; i++)
    if (st->seqs[i].used) rc = cmp("sequence slot", i, &st->seqs[i].u, &s->seqs[i]);
  return rc;
}
