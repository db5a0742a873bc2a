/*
 * pages/prefix.c - prefix sharing: sealed blocks found by the content of
 * the tokens before them, and shared like fork shares them.
 *
 * A sequence added with the token ids of its prompt gets one content key
 * per full chunk of block_tokens tokens, chained:
 *   key(0) = H(fp, tokens[0, bt)),   key(i) = H(key(i - 1), tokens[i*bt, (i+1)*bt))
 * fp is the pool's fingerprint (geometry, block tokens, codec bindings with
 * their parameters), so equal keys mean equal pages in every (layer, head):
 * the key is layer-independent and one entry lists the L x H blocks of a
 * chunk. H is XXH64 under two seeds (128 bits).
 *
 * Table: content key -> kvp__chunk (chained hash, writer only). Invariants
 * (kvp__prefix_check):
 *   every entry's blocks are owned (owners > 0), sealed, full, at
 *   [index * bt, (index + 1) * bt), and point back at the entry;
 *   entries = ledger.prefix_chunks.
 * An entry holds no reference: when any of its blocks loses its last
 * owner (free, eviction, offload), the entry goes (kvp__block_unown).
 * A sequence attaching a prefix takes a reference on each block, as a fork
 * does: pages are counted once in the ledger, tokens in every sequence
 * that retains them. An eviction by one sequence drops its reference only.
 *
 * Sharing needs a sequence without a policy (policies follow the steps
 * they saw begin) and codecs without per-stream state (a stream's warm
 * start would differ from the one that encoded the shared blocks).
 */
#include "policy.h"

#include <string.h>

#define SEED_A 0x6b76706f6f6c2d61ull /* "kvpool-a" */
#define SEED_B 0x6b76706f6f6c2d62ull

void kvp__prefix_keys(const kvp_pool *pool, const uint32_t *tokens, uint32_t n_chunks, uint64_t (*out)[2]) {
  uint32_t bt = pool->chunk_tokens;
  uint64_t geom[6] = {pool->cfg.n_layers, pool->cfg.n_kv_heads, pool->cfg.head_dim, bt,
                      (uint64_t)pool->cfg.k_dtype << 8 | pool->cfg.v_dtype, pool->codec_fp};
  uint64_t a = kvp__xxh64(geom, sizeof geom, SEED_A), b = kvp__xxh64(geom, sizeof geom, SEED_B);
  for (uint32_t i = 0; i < n_chunks; i++) {
    const uint32_t *t = tokens + (size_t)i * bt;
    a = kvp__xxh64(t, (size_t)bt * sizeof *t, a ^ SEED_A);
    b = kvp__xxh64(t, (size_t)bt * sizeof *t, b ^ SEED_B);
    out[i][0] = a;
    out[i][1] = b;
  }
}

static uint32_t bucket_of(const kvp__ptable *t, const uint64_t *key) { return (uint32_t)(key[0] & (t->nbuckets - 1)); }

kvp__chunk *kvp__prefix_find(const kvp_pool *pool, const uint64_t *key) {
  const kvp__ptable *t = &pool->prefix;
  if (!t->nbuckets) return NULL;
  for (kvp__chunk *c = t->buckets[bucket_of(t, key)]; c; c = c->hnext)
    if (c->key[0] == key[0] && c->key[1] == key[1]) return c;
  return NULL;
}

static size_t chunk_bytes(const kvp_pool *pool) {
  return sizeof(kvp__chunk) + (size_t)pool->cfg.n_layers * pool->cfg.n_kv_heads * sizeof(kvp__block *);
}

static void count_chunks(kvp_pool *pool, int sign) {
  kvp__ledger_begin(&pool->alloc.ledger);
  if (sign > 0) kvp__gauge_add(&pool->alloc.ledger.prefix_chunks, 1);
  else kvp__gauge_sub(&pool->alloc.ledger.prefix_chunks, 1);
  kvp__ledger_end(&pool->alloc.ledger);
}

/* Double the buckets when entries pass them (a failed grow keeps the old). */
static void maybe_grow(kvp_pool *pool) {
  kvp__ptable *t = &pool->prefix;
  if (t->nbuckets && t->n < t->nbuckets) return;
  uint32_t nb = t->nbuckets ? t->nbuckets * 2 : 256;
  kvp__chunk **b = kvp__meta_calloc(&pool->meta, nb * sizeof *b);
  if (!b) return;
  for (uint32_t i = 0; i < t->nbuckets; i++)
    for (kvp__chunk *c = t->buckets[i], *n; c; c = n) {
      n = c->hnext;
      uint32_t j = (uint32_t)(c->key[0] & (nb - 1));
      c->hnext = b[j];
      b[j] = c;
    }
  kvp__meta_free(&pool->meta, t->buckets, t->nbuckets * sizeof *t->buckets);
  t->buckets = b;
  t->nbuckets = nb;
}

int kvp__prefix_insert(kvp_pool *pool, const uint64_t *key, uint32_t index, kvp__block *const *blocks) {
  maybe_grow(pool);
  kvp__ptable *t = &pool->prefix;
  uint32_t n = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  kvp__chunk *c = t->nbuckets ? kvp__meta_alloc(&pool->meta, chunk_bytes(pool)) : NULL;
  if (!c) return kvp__err(KVP_ENOMEM, "prefix table entry");
  c->key[0] = key[0];
  c->key[1] = key[1];
  c->index = index;
  memcpy(c->blocks, blocks, n * sizeof *blocks);
  for (uint32_t i = 0; i < n; i++) {
    kvp__assert(!blocks[i]->chunk);
    blocks[i]->chunk = c;
  }
  uint32_t j = bucket_of(t, key);
  c->hnext = t->buckets[j];
  t->buckets[j] = c;
  t->n++;
  count_chunks(pool, +1);
  return KVP_OK;
}

void kvp__prefix_drop(kvp_pool *pool, kvp__chunk *c) {
  kvp__ptable *t = &pool->prefix;
  for (kvp__chunk **pp = &t->buckets[bucket_of(t, c->key)]; *pp; pp = &(*pp)->hnext)
    if (*pp == c) {
      *pp = c->hnext;
      break;
    }
  uint32_t n = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  for (uint32_t i = 0; i < n; i++) c->blocks[i]->chunk = NULL;
  kvp__meta_free(&pool->meta, c, chunk_bytes(pool));
  t->n--;
  count_chunks(pool, -1);
}

void kvp__prefix_fini(kvp_pool *pool) {
  kvp__ptable *t = &pool->prefix;
  for (uint32_t i = 0; i < t->nbuckets; i++)
    while (t->buckets[i]) kvp__prefix_drop(pool, t->buckets[i]);
  kvp__meta_free(&pool->meta, t->buckets, t->nbuckets * sizeof *t->buckets);
  t->buckets = NULL;
  t->nbuckets = 0;
}

int kvp__prefix_check(kvp_pool *pool) {
  const kvp__ptable *t = &pool->prefix;
  uint32_t n = pool->cfg.n_layers * pool->cfg.n_kv_heads, bt = pool->chunk_tokens;
  uint64_t count = 0;
  for (uint32_t i = 0; i < t->nbuckets; i++)
    for (const kvp__chunk *c = t->buckets[i]; c; c = c->hnext, count++)
      for (uint32_t j = 0; j < n; j++) {
        const kvp__block *b = c->blocks[j];
        if (!b || b->chunk != c || !b->owners || !b->sealed || b->pos0 != c->index * bt || b->cap_tokens != bt ||
            b->n_tokens != bt)
          return kvp__err(KVP_ECORRUPT, "prefix chunk %u (key %016llx): block of layer %u head %u is missing, "
                          "unowned, not full or does not point back", c->index, (unsigned long long)c->key[0],
                          j / pool->cfg.n_kv_heads, j % pool->cfg.n_kv_heads);
      }
  if (count != t->n || count != pool->alloc.ledger.prefix_chunks.current)
    return kvp__err(KVP_ECORRUPT, "prefix table holds %llu entries, counts %llu, ledger %llu",
                    (unsigned long long)count, (unsigned long long)t->n,
                    (unsigned long long)pool->alloc.ledger.prefix_chunks.current);
  return KVP_OK;
}

bool kvp__prefix_ok(const kvp_pool *pool, const kvp__seq *s) {
  if (!s->pkeys || (s->pol && s->pol->vt) || (pool->cfg.flags & KVP_POOL_DRY)) return false;
  for (uint32_t l = 0; l < pool->cfg.n_layers; l++)
    for (int kv = 0; kv < 2; kv++)
      if (kvp__cstate_bytes(pool, l, kv)) return false;
  return true;
}

/* Does one run retain head h over [a, b)? */
static bool covered(const kvp__layer *L, uint32_t h, uint32_t a, uint32_t b) {
  for (const kvp__run *r = L->runs; r; r = r->next)
    if (kvp__run_has(r, h) && r->p0 <= a && atomic_load_explicit(&r->p1, memory_order_relaxed) >= b) return true;
  return false;
}

void kvp__prefix_register(kvp_pool *pool, kvp__seq *s) {
  uint32_t bt = pool->chunk_tokens, L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads, LH = L * H;
  uint32_t avail = atomic_load_explicit(&s->n_positions, memory_order_relaxed) / bt;
  if (avail > s->n_pkeys) avail = s->n_pkeys;
  if (s->next_reg >= avail || !kvp__prefix_ok(pool, s)) return;
  uint32_t c0 = s->next_reg, m = avail - c0;
  kvp__block **blk = kvp__meta_calloc(NULL, (size_t)m * LH * sizeof *blk);
  if (!blk) return; /* sharing is an optimisation: try again at the next step */
  for (uint32_t i = 0; i < LH; i++)
    for (const kvp__bref *r = s->streams[i].blocks; r; r = r->next) {
      kvp__block *b = r->blk;
      if (b->pos0 >= avail * bt) break;
      if (b->pos0 < c0 * bt || b->pos0 % bt || b->cap_tokens != bt || b->n_tokens != bt || !b->sealed) continue;
      blk[(size_t)(b->pos0 / bt - c0) * LH + i] = b;
    }
  uint32_t i = 0;
  for (; i < m; i++) {
    kvp__block **row = blk + (size_t)i * LH;
    uint32_t a = (c0 + i) * bt;
    bool ok = true, fresh = true;
    for (uint32_t j = 0; ok && j < LH; j++) {
      ok = row[j] && covered(&s->layers[j / H], j % H, a, a + bt);
      fresh = fresh && ok && !row[j]->chunk;
    }
    if (!ok) { /* the chain breaks here: later chunks could never be attached */
      s->next_reg = s->n_pkeys;
      break;
    }
    if (fresh && !kvp__prefix_find(pool, s->pkeys[c0 + i]) && kvp__prefix_insert(pool, s->pkeys[c0 + i], c0 + i, row))
      break; /* out of memory: again at the next step */
  }
  if (s->next_reg != s->n_pkeys) s->next_reg = c0 + i;
  kvp__meta_free(NULL, blk, (size_t)m * LH * sizeof *blk);
}

uint32_t kvp__prefix_lookup(kvp_pool *pool, const kvp__seq *s, kvp__chunk **out, uint32_t cap) {
  uint32_t c0 = atomic_load_explicit(&s->n_positions, memory_order_relaxed) / pool->chunk_tokens, n = 0;
  for (uint32_t i = c0; i < s->max_hit && n < cap; i++) {
    kvp__chunk *c = kvp__prefix_find(pool, s->pkeys[i]);
    if (!c || c->index != i) break;
    out[n++] = c;
  }
  return n;
}

int kvp__prefix_attach(kvp_pool *pool, kvp__seq *s, uint32_t m, kvp__block *const *blocks) {
  uint32_t bt = pool->chunk_tokens, L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads, LH = L * H;
  uint32_t k = atomic_load_explicit(&s->n_steps, memory_order_relaxed);
  uint32_t pos = atomic_load_explicit(&s->n_positions, memory_order_relaxed), end = pos + m * bt;
  kvp__assert(pos % bt == 0 && !atomic_load_explicit(&s->in_step, memory_order_relaxed));
  if (k + 2 > s->step_pos_cap) {
    uint32_t ncap = (k + 2) * 2;
    uint32_t *np = kvp__meta_realloc(&pool->meta, s->step_pos, s->step_pos_cap * sizeof *np, ncap * sizeof *np);
    if (!np) return kvp__err(KVP_ENOMEM, "step table of sequence %llu", (unsigned long long)s->id);
    s->step_pos = np;
    s->step_pos_cap = ncap;
  }
  uint64_t mask[KVP_MAX_KV_HEADS / 64] = {0};
  for (uint32_t h = 0; h < H; h++) mask[h / 64] |= 1ull << (h % 64);
  /* everything allocated first: a run per layer that cannot extend, brefs */
  size_t nref = (size_t)m * LH;
  kvp__run **runs = kvp__meta_calloc(NULL, L * sizeof *runs);
  kvp__bref **refs = kvp__meta_calloc(NULL, nref * sizeof *refs + 1);
  bool ok = runs && refs;
  for (uint32_t l = 0; ok && l < L; l++)
    if (!kvp__run_extends(pool, &s->layers[l], k, mask)) ok = (runs[l] = kvp__run_new(pool, k, pos, k + 1, end, mask));
  for (size_t i = 0; ok && i < nref; i++) ok = (refs[i] = kvp__meta_calloc(&pool->meta, sizeof(kvp__bref)));
  if (!ok) {
    for (uint32_t l = 0; runs && l < L; l++)
      if (runs[l]) kvp__run_free_now(pool, runs[l]);
    for (size_t i = 0; refs && i < nref; i++)
      if (refs[i]) kvp__bref_free_now(pool, refs[i]);
    kvp__meta_free(NULL, runs, L * sizeof *runs);
    kvp__meta_free(NULL, refs, nref * sizeof *refs + 1);
    return kvp__err(KVP_ENOMEM, "metadata to attach %u shared blocks to sequence %llu", (unsigned)nref,
                    (unsigned long long)s->id);
  }
  /* publish: brefs of each stream, then the step and the runs' ends */
  for (uint32_t j = 0; j < LH; j++) {
    kvp__stream *st = &s->streams[j];
    for (uint32_t i = 0; i < m; i++) {
      kvp__bref *r = refs[(size_t)j * m + i];
      kvp__block *b = blocks[(size_t)i * LH + j];
      if (b->owners) {
        b->owners++;
        atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
      } else {
        b->owners = 1;
        atomic_init(&b->refs, 1);
      }
      r->blk = b;
      if (st->tail) kvp__rcu_assign(st->tail->next, r);
      else kvp__rcu_assign(st->blocks, r);
      st->tail = r;
    }
    atomic_store_explicit(&st->retained_tokens, atomic_load_explicit(&st->retained_tokens, memory_order_relaxed) +
                          m * bt, memory_order_relaxed);
  }
  s->step_pos[k] = pos;
  s->step_pos[k + 1] = end;
  atomic_store_explicit(&s->n_steps, k + 1, memory_order_release);
  for (uint32_t l = 0; l < L; l++) {
    if (runs[l]) kvp__run_publish(s, l, end, runs[l], false);
    else kvp__run_publish(s, l, end, NULL, false);
  }
  atomic_store_explicit(&s->n_positions, end, memory_order_release);
  kvp__count_tokens(pool, (int64_t)m * bt * LH, 0);
  kvp__meta_free(NULL, runs, L * sizeof *runs);
  kvp__meta_free(NULL, refs, nref * sizeof *refs + 1);
  return KVP_OK;
}
