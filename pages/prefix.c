/*
 * pages/prefix.c - prefix sharing: sealed blocks found by the content of
 * the tokens before them, and shared through one reference per chunk.
 *
 * A sequence added with the token ids of its prompt gets one content key
 * per full chunk of block_tokens tokens, chained:
 *   key(0) = H(fp, tokens[0, bt)),   key(i) = H(key(i - 1), tokens[i*bt, (i+1)*bt))
 * fp is the pool's fingerprint (geometry, block tokens, codec bindings with
 * their parameters), so equal keys mean equal pages in every (layer, head):
 * the key is layer-independent and one entry lists the L x H blocks of a
 * chunk. H is kvp__hash128 (util/hash.c), seeded by the parent key: about
 * 10 ns a 32-token chunk, the chain's latency (a 32K-token prompt's 1024
 * keys in about 10 us, where two XXH64 passes took 33 us).
 *
 * Table: content key -> kvp__chunk (chained hash, writer only). Ownership,
 * two levels:
 *
 *   entry  --one owner reference each-->  its L x H blocks
 *   seq    --holds->at[c] (one per chunk)-->  entry       (holders counts them)
 *
 * A sequence that attaches a prefix takes one chunk-level reference per
 * chunk (O(chunks), no block touched); its readers find the blocks of
 * stream (l, h) at entry->blocks[l * H + h] (kvp__bwalk merges them with the
 * stream's brefs). The sequence that computed a chunk registers it: the
 * entry takes an owner reference on each block and the sequence holds the
 * entry (its brefs stay; they are the same blocks). Invariants
 * (kvp__prefix_check, after kvp_check's walk):
 *   every entry's blocks are sealed, full, at [index * bt, (index + 1) * bt),
 *   point back at the entry, and were visited by the walk;
 *   owners(block of an entry) = brefs found + 1;
 *   holders(entry) = holds found >= 1; holds->at[c]->index = c;
 *   entries = ledger.prefix_chunks.
 * An entry goes when its last holder lets go (free, offload, the eviction
 * that detaches it): its owner references drop, and blocks no bref holds
 * go to the limbo; the entry struct is freed after a grace period, as
 * readers reach it through holds. An eviction by one sharer first turns
 * its holds on the chunks it evicts from into brefs (kvp__prefix_detach:
 * O(chunks x L x H), once), then drops its own reference only, so the
 * others keep theirs.
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
  for (uint32_t i = 0; i < n_chunks; i++) { /* the serial chain is the cost: one product and avalanche a link */
    kvp__hash128(tokens + (size_t)i * bt, (size_t)bt * sizeof *tokens, a ^ SEED_A, b ^ SEED_B, out[i]);
    a = out[i][0];
    b = out[i][1];
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

static void entry_free_cb(kvp__rcu_head *h) {
  kvp__rcu_cb_begin(h);
  kvp__chunk *c = caa_container_of(h, kvp__chunk, rcu);
  kvp__meta_free(NULL, c, sizeof *c + (size_t)c->nblocks * sizeof *c->blocks);
}

/* Unlink c and let its blocks go (its last holder let go). */
static void entry_drop(kvp_pool *pool, kvp__chunk *c) {
  kvp__ptable *t = &pool->prefix;
  for (kvp__chunk **pp = &t->buckets[bucket_of(t, c->key)]; *pp; pp = &(*pp)->hnext)
    if (*pp == c) {
      *pp = c->hnext;
      break;
    }
  uint32_t n = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  for (uint32_t i = 0; i < n; i++) {
    c->blocks[i]->chunk = NULL;
    kvp__block_unown(pool, c->blocks[i]);
  }
  t->n--;
  count_chunks(pool, -1);
  kvp__meta_uncount(&pool->meta, c, chunk_bytes(pool));
  kvp__rcu_call(&c->rcu, entry_free_cb);
}

static size_t holds_bytes(uint32_t n) { return sizeof(kvp__holds) + (size_t)n * sizeof(kvp__chunk *); }

int kvp__prefix_holds_make(kvp_pool *pool, kvp__seq *s, uint32_t n) {
  kvp__assert(!s->holds);
  kvp__holds *hd = kvp__meta_calloc(&pool->meta, holds_bytes(n));
  if (!hd) return kvp__err(KVP_ENOMEM, "chunk references of sequence %llu (%u chunks)", (unsigned long long)s->id, n);
  hd->n = n;
  kvp__rcu_assign(s->holds, hd);
  return KVP_OK;
}

void kvp__prefix_hold(kvp__seq *s, kvp__chunk *c) {
  kvp__assert(s->holds && c->index < s->holds->n && !s->holds->at[c->index]);
  c->holders++;
  kvp__rcu_assign(s->holds->at[c->index], c);
}

/* s lets go of chunk i (readers that loaded the entry keep it a grace period). */
static void unhold(kvp_pool *pool, kvp__seq *s, uint32_t i) {
  kvp__chunk *c = s->holds->at[i];
  kvp__rcu_assign(s->holds->at[i], NULL);
  if (!--c->holders) entry_drop(pool, c);
}

static void holds_free_cb(kvp__rcu_head *h) {
  kvp__rcu_cb_begin(h);
  kvp__holds *hd = caa_container_of(h, kvp__holds, rcu);
  kvp__meta_free(NULL, hd, holds_bytes(hd->n));
}

void kvp__prefix_release(kvp_pool *pool, kvp__seq *s, bool readers_may_hold) {
  kvp__holds *hd = s->holds;
  if (!hd) return;
  for (uint32_t i = 0; i < hd->n; i++) /* at[] stays as it is: a reader of the going sequence reads it whole */
    if (hd->at[i] && !--hd->at[i]->holders) entry_drop(pool, hd->at[i]);
  if (readers_may_hold) { /* s->holds stays for readers still walking s, which goes after the same grace period */
    kvp__meta_uncount(&pool->meta, hd, holds_bytes(hd->n));
    kvp__rcu_call(&hd->rcu, holds_free_cb);
  } else {
    s->holds = NULL;
    kvp__meta_free(&pool->meta, hd, holds_bytes(hd->n));
  }
}

int kvp__prefix_fork(kvp_pool *pool, const kvp__seq *p, kvp__seq *c) {
  if (!p->holds) return KVP_OK;
  int rc = kvp__prefix_holds_make(pool, c, p->holds->n);
  for (uint32_t i = 0; !rc && i < p->holds->n; i++)
    if (p->holds->at[i]) kvp__prefix_hold(c, p->holds->at[i]);
  return rc;
}

kvp__chunk *kvp__prefix_entry_new(kvp_pool *pool, const uint64_t *key, uint32_t index, kvp__block *const *blocks) {
  kvp__assert(!kvp__prefix_find(pool, key));
  maybe_grow(pool);
  kvp__ptable *t = &pool->prefix;
  uint32_t n = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  kvp__chunk *c = t->nbuckets ? kvp__meta_calloc(&pool->meta, chunk_bytes(pool)) : NULL;
  if (!c) {
    kvp__err(KVP_ENOMEM, "prefix table entry");
    return NULL;
  }
  c->key[0] = key[0];
  c->key[1] = key[1];
  c->index = index;
  c->nblocks = n;
  memcpy(c->blocks, blocks, n * sizeof *blocks);
  for (uint32_t i = 0; i < n; i++) {
    kvp__block *b = blocks[i];
    kvp__assert(!b->chunk && b->sealed);
    b->chunk = c;
    if (b->owners++) atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
    else atomic_init(&b->refs, 1); /* fresh: the entry is its first owner */
  }
  uint32_t j = bucket_of(t, key);
  c->hnext = t->buckets[j];
  t->buckets[j] = c;
  t->n++;
  count_chunks(pool, +1);
  return c;
}

void kvp__prefix_entry_discard(kvp_pool *pool, kvp__chunk *c) {
  kvp__assert(!c->holders);
  kvp__ptable *t = &pool->prefix;
  for (kvp__chunk **pp = &t->buckets[bucket_of(t, c->key)]; *pp; pp = &(*pp)->hnext)
    if (*pp == c) {
      *pp = c->hnext;
      break;
    }
  for (uint32_t i = 0; i < c->nblocks; i++) {
    kvp__block *b = c->blocks[i];
    kvp__assert(b->owners == 1);
    b->chunk = NULL;
    b->owners = 0;
    atomic_init(&b->refs, 0);
  }
  t->n--;
  count_chunks(pool, -1);
  kvp__meta_free(&pool->meta, c, chunk_bytes(pool));
}

int kvp__prefix_adopt(kvp_pool *pool, kvp__seq *s, const uint64_t *key, uint32_t index, kvp__block *const *blocks,
                      uint32_t hold_n) {
  int rc = s->holds ? KVP_OK : kvp__prefix_holds_make(pool, s, hold_n ? hold_n : s->n_pkeys);
  if (rc) return rc;
  kvp__assert(index < s->holds->n);
  kvp__chunk *c = kvp__prefix_entry_new(pool, key, index, blocks);
  if (!c) return KVP_ENOMEM;
  kvp__prefix_hold(s, c);
  return KVP_OK;
}

void kvp__prefix_fini(kvp_pool *pool) {
  kvp__ptable *t = &pool->prefix;
  for (uint32_t i = 0; i < t->nbuckets; i++)
    while (t->buckets[i]) entry_drop(pool, t->buckets[i]); /* none by now: every holder let go */
  kvp__meta_free(&pool->meta, t->buckets, t->nbuckets * sizeof *t->buckets);
  t->buckets = NULL;
  t->nbuckets = 0;
}

void kvp__prefix_mark(kvp_pool *pool) {
  const kvp__ptable *t = &pool->prefix;
  for (uint32_t i = 0; i < t->nbuckets; i++)
    for (kvp__chunk *c = t->buckets[i]; c; c = c->hnext) {
      c->check_epoch = pool->check_epoch;
      c->holders_seen = 0;
    }
}

int kvp__prefix_check_holds(kvp_pool *pool, const kvp__seq *s) {
  const kvp__holds *hd = s->holds;
  for (uint32_t i = 0; hd && i < hd->n; i++) {
    kvp__chunk *c = hd->at[i];
    if (!c) continue;
    if (c->check_epoch != pool->check_epoch || c->index != i ||
        (i < s->n_pkeys && (c->key[0] != s->pkeys[i][0] || c->key[1] != s->pkeys[i][1])))
      return kvp__err(KVP_ECORRUPT, "seq %llu holds as its prefix chunk %u an entry that is not in the table, is "
                      "chunk %u, or has another content key", (unsigned long long)s->id, i, c->index);
    c->holders_seen++;
  }
  return KVP_OK;
}

bool kvp__prefix_bref_ok(const kvp_pool *pool, const kvp__seq *s, uint32_t lh, const kvp__block *b) {
  const kvp__holds *hd = s->holds;
  uint32_t bt = pool->chunk_tokens;
  for (uint32_t c = hd ? b->pos0 / bt : 0; hd && c < hd->n && (uint64_t)c * bt < (uint64_t)b->pos0 + b->cap_tokens; c++)
    if (hd->at[c] && hd->at[c]->blocks[lh] != b) return false;
  return true;
}

int kvp__prefix_check(kvp_pool *pool) {
  const kvp__ptable *t = &pool->prefix;
  uint32_t n = pool->cfg.n_layers * pool->cfg.n_kv_heads, bt = pool->chunk_tokens, epoch = pool->check_epoch;
  uint64_t count = 0;
  for (uint32_t i = 0; i < t->nbuckets; i++)
    for (const kvp__chunk *c = t->buckets[i]; c; c = c->hnext, count++) {
      uint32_t seen = c->check_epoch == epoch ? c->holders_seen : 0;
      if (!c->holders || seen != c->holders)
        return kvp__err(KVP_ECORRUPT, "prefix chunk %u (key %016llx): %u holders recorded, %u sequences hold it",
                        c->index, (unsigned long long)c->key[0], c->holders, seen);
      for (uint32_t j = 0; j < n; j++) {
        const kvp__block *b = c->blocks[j];
        if (!b || b->chunk != c || !b->sealed || b->pos0 != c->index * bt || b->cap_tokens != bt || b->n_tokens != bt)
          return kvp__err(KVP_ECORRUPT, "prefix chunk %u (key %016llx): block of layer %u head %u is missing, not "
                          "full or does not point back", c->index, (unsigned long long)c->key[0],
                          j / pool->cfg.n_kv_heads, j % pool->cfg.n_kv_heads);
        if (b->check_epoch != epoch || b->owners != b->owners_seen + 1 || atomic_load(&b->refs) < b->owners)
          return kvp__err(KVP_ECORRUPT, "prefix chunk %u: block of layer %u head %u has %u owners, %u brefs and the "
                          "entry hold it (%s), %u refs", c->index, j / pool->cfg.n_kv_heads, j % pool->cfg.n_kv_heads,
                          b->owners, b->check_epoch == epoch ? b->owners_seen : 0,
                          b->check_epoch == epoch ? "visited" : "not visited by the walk", atomic_load(&b->refs));
      }
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
    if (fresh && !kvp__prefix_find(pool, s->pkeys[c0 + i]) && kvp__prefix_adopt(pool, s, s->pkeys[c0 + i], c0 + i, row, 0))
      break; /* out of memory: again at the next step */
  }
  if (s->next_reg != s->n_pkeys) s->next_reg = c0 + i;
  kvp__meta_free(NULL, blk, (size_t)m * LH * sizeof *blk);
}

/* Probes run ahead of the lookup: the entry LOOKAHEAD chunks on is
 * prefetched (its bucket slot loaded), so a 1024-chunk attach waits on
 * about one cache miss at a time, not one per chunk. */
#define LOOKAHEAD 8u

uint32_t kvp__prefix_lookup(kvp_pool *pool, const kvp__seq *s, kvp__chunk **out, uint32_t cap) {
  uint32_t c0 = atomic_load_explicit(&s->n_positions, memory_order_relaxed) / pool->chunk_tokens, n = 0;
  const kvp__ptable *t = &pool->prefix;
  for (uint32_t i = c0; i < s->max_hit && n < cap; i++) {
    if (t->nbuckets && i + LOOKAHEAD < s->max_hit) {
      const kvp__chunk *ahead = t->buckets[bucket_of(t, s->pkeys[i + LOOKAHEAD])];
      if (ahead) __builtin_prefetch(ahead);
    }
    kvp__chunk *c = kvp__prefix_find(pool, s->pkeys[i]);
    if (!c || c->index != i) break;
    out[n++] = c;
  }
  return n;
}

int kvp__prefix_attach(kvp_pool *pool, kvp__seq *s, uint32_t m, kvp__chunk *const *chunks) {
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
  /* everything allocated first: a run per layer that cannot extend, the holds */
  kvp__run **runs = kvp__meta_calloc(NULL, L * sizeof *runs);
  bool ok = runs;
  for (uint32_t l = 0; ok && l < L; l++)
    if (!kvp__run_extends(pool, &s->layers[l], k, mask)) ok = (runs[l] = kvp__run_new(pool, k, pos, k + 1, end, mask));
  int rc = ok ? KVP_OK : kvp__err(KVP_ENOMEM, "runs to attach %u shared chunks to sequence %llu", m,
                                  (unsigned long long)s->id);
  if (!rc && !s->holds) rc = kvp__prefix_holds_make(pool, s, s->n_pkeys);
  if (rc) {
    for (uint32_t l = 0; runs && l < L; l++)
      if (runs[l]) kvp__run_free_now(pool, runs[l]);
    kvp__meta_free(NULL, runs, L * sizeof *runs);
    return rc;
  }
  kvp__assert(pos / bt + m <= s->holds->n);
  /* publish: the holds, then the step and the runs' ends */
  for (uint32_t i = 0; i < m; i++) {
    kvp__assert(chunks[i]->index == pos / bt + i);
    kvp__prefix_hold(s, chunks[i]);
  }
  for (uint32_t j = 0; j < LH; j++) {
    kvp__stream *st = &s->streams[j];
    atomic_store_explicit(&st->retained_tokens, atomic_load_explicit(&st->retained_tokens, memory_order_relaxed) +
                          m * bt, memory_order_relaxed);
  }
  s->step_pos[k] = pos;
  s->step_pos[k + 1] = end;
  atomic_store_explicit(&s->n_steps, k + 1, memory_order_release);
  for (uint32_t l = 0; l < L; l++) kvp__run_publish(s, l, end, runs[l], false);
  atomic_store_explicit(&s->n_positions, end, memory_order_release);
  kvp__count_tokens(pool, (int64_t)m * bt * LH, 0);
  kvp__meta_free(NULL, runs, L * sizeof *runs);
  return KVP_OK;
}

bool kvp__prefix_holds_any(const kvp_pool *pool, const kvp__seq *s, uint32_t a, uint32_t b) {
  const kvp__holds *hd = s->holds;
  uint32_t bt = pool->chunk_tokens;
  for (uint32_t c = hd && bt ? a / bt : 0; hd && bt && c < hd->n && (uint64_t)c * bt < b; c++)
    if (hd->at[c]) return true;
  return false;
}

/* The brefs stream j of s lacks for the held chunks [c0, c1): counted
 * (out NULL), or linked from out[*used] on in position order. */
static uint32_t detach_stream(kvp_pool *pool, kvp__seq *s, uint32_t j, uint32_t c0, uint32_t c1, kvp__bref **out,
                              size_t *used) {
  kvp__stream *st = &s->streams[j];
  kvp__bref **link = &st->blocks;
  uint32_t bt = pool->chunk_tokens, n = 0;
  for (uint32_t c = c0; c < c1; c++) {
    kvp__chunk *ch = s->holds->at[c];
    if (!ch) continue;
    kvp__block *b = ch->blocks[j];
    while (*link && (*link)->blk->pos0 < c * bt) link = &(*link)->next;
    if (*link && (*link)->blk == b) continue; /* s's own (it computed the chunk) */
    n++;
    if (!out) continue;
    kvp__bref *r = out[(*used)++];
    r->blk = b;
    r->next = *link;
    b->owners++;
    atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
    kvp__rcu_assign(*link, r);
    if (!r->next) st->tail = r;
    link = &r->next;
  }
  return n;
}

int kvp__prefix_detach(kvp_pool *pool, kvp__seq *s, uint32_t a, uint32_t b) {
  if (!kvp__prefix_holds_any(pool, s, a, b)) return KVP_OK;
  uint32_t bt = pool->chunk_tokens, LH = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  uint32_t c0 = a / bt, c1 = (uint32_t)(((uint64_t)b + bt - 1) / bt);
  if (c1 > s->holds->n) c1 = s->holds->n;
  size_t need = 0, used = 0;
  for (uint32_t j = 0; j < LH; j++) need += detach_stream(pool, s, j, c0, c1, NULL, NULL);
  kvp__bref **refs = need ? kvp__meta_calloc(NULL, need * sizeof *refs) : NULL;
  bool ok = !need || refs;
  for (size_t i = 0; ok && i < need; i++) ok = (refs[i] = kvp__meta_calloc(&pool->meta, sizeof(kvp__bref)));
  if (!ok) {
    for (size_t i = 0; refs && i < need; i++)
      if (refs[i]) kvp__bref_free_now(pool, refs[i]);
    kvp__meta_free(NULL, refs, need * sizeof *refs);
    return kvp__err(KVP_ENOMEM, "block references to detach sequence %llu from its shared chunks %u..%u",
                    (unsigned long long)s->id, c0, c1 - 1);
  }
  for (uint32_t j = 0; need && j < LH; j++) detach_stream(pool, s, j, c0, c1, refs, &used);
  kvp__assert(used == need);
  kvp__meta_free(NULL, refs, need * sizeof *refs);
  /* a reader that passed a new bref's place before it was linked must not
   * then find the hold gone: the holds go only after a grace period */
  if (need) kvp__rcu_synchronize();
  for (uint32_t c = c0; c < c1; c++)
    if (s->holds->at[c]) unhold(pool, s, c);
  return KVP_OK;
}
