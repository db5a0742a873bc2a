/*
 * pages/attend_kept.c - the attention block tables each layer keeps
 * (kvp__attend_build_kept): the last table a layer built, brought up to
 * date at the next call instead of walked again (pages/attend_table.c
 * builds; pages/attend_table.h holds what the two share).
 *
 * A decode step changes a layer's table only at its ends: each (sequence,
 * head)'s last record grows by the step's tokens into the same OPEN block,
 * or, when the step passes a block's end, that block is resealed in its
 * bref and new blocks follow it (pages.h: the layer's tail generation
 * moves, the pool's does not). A sequence added, forked or freed changes
 * no other's structure (the pool's generation stays; each sequence is
 * looked up by its id and serial); anything else (an eviction, a new run)
 * moves the pool's generation. So each layer keeps the last table it
 * built: per bh its records in a region of their own with room after them
 * (ROOM_*), its tokens, bytes and last record's block, bref, run and
 * range; per sequence where it is, its serial and its tail generation;
 * labelled with the pool's generation read before the walk. A call under
 * the same generation:
 *  - takes each sequence of its batch from the kept table where it is
 *    there and still the same (its id finds the same serial): its regions
 *    stay where they are; the others (new to the batch, or another
 *    sequence of the same id) are walked and their records placed in new
 *    regions after the last, as long as there is room (else the table is
 *    built again, laid out anew: the regions of the sequences that left
 *    are reused then);
 *  - per sequence, where its tail generation is as labelled, redoes each
 *    last record from its run's end (loaded with acquire, as the walk
 *    loads it); where it moved, redoes each head's ends from the last
 *    record's bref: that block's records again (it may be the resealed
 *    copy: same positions, other pages), then a record for each block
 *    after it within the run, into the bh's room (a bh out of room, or
 *    whose last bref the walk did not note, has the table built again);
 *  - places the splits from the records' kept prefix sums (split_end: the
 *    scan's splits, found by binary search).
 * Where the kernel reads its records in place (pages on a device:
 * kvp__kern_attend_zero_copy) the kept records are pinned, the splits and
 * index are written beside them (tab, pinned too: the kernels read the
 * whole table in place, no copy and no stage) and the call goes no
 * further: O(sequences x heads + splits + new blocks + the records of new
 * sequences). Otherwise the records are copied to the caller's buffer, end
 * to end as a fresh build lays them: O(records) sequential bytes, not
 * O(blocks) loads. The splits name only records, so a kernel sees the same
 * records as a fresh build's, in the same splits. Records read in place
 * change only after the event recorded behind the kernels that read them
 * (done) has passed, and the kept table stays held until that event is
 * recorded (kvp__attend_kept_release). A generation that moved during the
 * walk is read as a different label by the next call, which builds again
 * (or, for a tail generation, redoes those ends); an odd one (a writer in)
 * neither serves nor labels. The kept table names blocks, brefs and runs
 * that stay linked while the generations stand and the sequence is found
 * by its id and serial, so they and their pages stay valid under the
 * caller's RCU read lock as the walk's do (pages.h: sgen, tgen). One call
 * at a time uses a layer's kept table (a try-lock; others build as
 * before). */
#include "attend_table.h"

#ifdef KVP_HAVE_CUDA

/* Bytes kept over all layers of a pool (metadata and pinned records):
 * 256 MiB, or 1/64 of the region where that is more. A record is 16 or 32
 * bytes per 16-token block and head, 1/64 of the region covers a batch
 * over every layer of a full nvfp4 cache (2,304 page bytes a block and
 * head at D = 128) with its room; past the bound a layer's tables are
 * built at every call and not kept. */
static uint64_t kept_bound(const kvp_pool *pool) {
  uint64_t r = pool->alloc.region.bytes / 64;
  return r > (256ull << 20) ? r : 256ull << 20;
}
/* Room kept after a bh's n records for the blocks decode steps add: at 16
 * tokens a block, 8 records are 128 steps of a short sequence; a long
 * one's (n / 8) lasts as long as an eighth of its length. */
#define ROOM_MIN 8u
#define ROOM_DIV 8u
static uint32_t room_of(uint32_t n) { return ROOM_MIN + n / ROOM_DIV; }

typedef struct kvp__acache {
  kvp__mutex lock;       /* taken by try: the call using it */
  bool valid;            /* the fields below describe a table */
  uint64_t gen;          /* the pool's sgen (even) read before its walk */
  uint32_t batch, kind;  /* the batch's size and the records' kernel kind */
  uint64_t *seqs;        /* [batch] its sequence ids */
  aseq *sq;              /* [batch] each sequence, its serial and its layer's tail generation as the
                            records show it */
  unsigned char *recs;   /* its records: bh's at recs_at[bh] .. rend[bh], its room up to rlim[bh] */
  uint32_t *recs_at;     /* [nbh] */
  uint32_t *rend;        /* [nbh] */
  uint32_t *rlim;        /* [nbh] */
  uint32_t used;         /* record slots taken by regions (those of sequences that left included) */
  uint64_t *tok_of;      /* [nbh] */
  atail *tails;          /* [nbh] */
  uint32_t *pre;         /* [slots]: the tokens of a record's bh before it (its last record's growth
                            changes none of them): make_splits without reading the records */
  uint32_t *hint0, *hint_end; /* [nbh + 1], [hint_cap]: the last table's splits, bh's first and each
                            one's end record (make_splits' hint), when hinted */
  bool hinted;
  uint64_t hint_cap;
  uint64_t bytes;        /* metadata bytes held (the arrays above) */
  uint64_t seqs_cap, recs_cap, bh_cap, pre_cap; /* entries the arrays hold (recs: bytes) */
  bool pinned;           /* recs is pinned host memory (kvp__dev_kept_alloc): read in place */
  unsigned char *tab;    /* pinned, after recs in one buffer: a call in place's splits and index */
  uint64_t tab_cap;      /* bytes at tab: (slots + bh) splits and (bh + 1) index words */
  void *recs_dev, *tab_dev; /* recs and tab as the device addresses them */
  uint64_t pin_bytes;    /* the pinned buffer's bytes (recs_cap + tab_cap, aligned) */
  void *done;            /* event after the last work that reads recs in place, or NULL (no device) */
  void *old[8];          /* outgrown pinned records, freed at pool destroy (cudaFreeHost may wait for
                            the whole device: never on a call's path while room remains here) */
  uint64_t old_bytes[8];
  uint32_t n_old;
} kvp__acache;

static _Atomic uint64_t *kept_total(kvp_pool *pool) { return &pool->acache_bytes; }

/* k's records freed (after the work that reads them in place). */
static void kept_recs_free(kvp_pool *pool, kvp__acache *k, bool now) {
  if (!k->recs) return;
  kvp__dev_event_wait(k->done);
  if (!k->pinned) kvp__meta_free(&pool->meta, k->recs, k->recs_cap);
  else if (!now && k->n_old < 8) k->old_bytes[k->n_old] = k->pin_bytes, k->old[k->n_old++] = k->recs;
  else kvp__dev_kept_free(pool, k->recs, k->pin_bytes);
  k->recs = k->tab = NULL, k->recs_dev = k->tab_dev = NULL, k->pinned = false, k->tab_cap = k->pin_bytes = 0;
}

/* The bytes of k's per-bh arrays for bc bhs (recs_at, rend, rlim, tok_of, tails; hint0 apart). */
static uint64_t bh_bytes(uint64_t bc) {
  return bc * (3 * sizeof(uint32_t) + sizeof(uint64_t) + sizeof(atail)) + 32;
}

static void kept_drop(kvp_pool *pool, kvp__acache *k, bool now) {
  kvp__meta_free(&pool->meta, k->seqs, k->seqs_cap * sizeof *k->seqs);
  kvp__meta_free(&pool->meta, k->sq, k->seqs_cap * sizeof *k->sq);
  kept_recs_free(pool, k, now);
  kvp__meta_free(&pool->meta, k->recs_at, bh_bytes(k->bh_cap));
  kvp__meta_free(&pool->meta, k->pre, k->pre_cap * sizeof *k->pre);
  kvp__meta_free(&pool->meta, k->hint0, (k->bh_cap + 1) * sizeof *k->hint0);
  kvp__meta_free(&pool->meta, k->hint_end, k->hint_cap * sizeof *k->hint_end);
  atomic_fetch_sub_explicit(kept_total(pool), k->bytes, memory_order_relaxed);
  k->seqs = NULL, k->sq = NULL, k->recs = NULL, k->recs_at = k->rend = k->rlim = NULL, k->tok_of = NULL;
  k->tails = NULL, k->pre = NULL, k->hint0 = k->hint_end = NULL;
  k->bytes = k->seqs_cap = k->recs_cap = k->bh_cap = k->pre_cap = k->hint_cap = 0;
  k->used = 0;
  k->valid = k->hinted = false;
}

void kvp__attend_kept_fini(kvp_pool *pool) {
  if (!pool->acache) return;
  for (uint32_t l = 0; l < pool->cfg.n_layers; l++) {
    kvp__acache *k = pool->acache[l];
    if (!k) continue;
    kept_drop(pool, k, true);
    for (uint32_t i = 0; i < k->n_old; i++) kvp__dev_kept_free(pool, k->old[i], k->old_bytes[i]);
    kvp__dev_event_free(pool, k->done);
    kvp__meta_free(&pool->meta, k, sizeof *k);
  }
  kvp__meta_free(&pool->meta, pool->acache, pool->cfg.n_layers * sizeof *pool->acache);
  pool->acache = NULL;
}

/* The layer's kept table, made on first use; NULL without memory. */
static kvp__acache *kept_of(kvp_pool *pool, uint32_t layer) {
  kvp__acache *_Atomic *slot = (kvp__acache *_Atomic *)&pool->acache[layer];
  kvp__acache *k = atomic_load_explicit(slot, memory_order_acquire);
  if (k) return k;
  kvp__acache *n = kvp__meta_calloc(&pool->meta, sizeof *n);
  if (!n) return NULL;
  kvp__mutex_init(&n->lock);
  n->done = pool->dev ? kvp__dev_event_new(pool) : NULL; /* none: records in metadata, copied per call */
  if (atomic_compare_exchange_strong_explicit(slot, &k, n, memory_order_acq_rel, memory_order_acquire)) return n;
  kvp__dev_event_free(pool, n->done);
  kvp__meta_free(&pool->meta, n, sizeof *n);
  return k;
}

/* Room for k to hold a table of batch sequences, nbh bhs and slots records
 * of rb bytes (the arrays grown as a whole, the old ones dropped, with an
 * eighth more for sequences that join later); false when not (memory, the
 * pool's bound): k is then empty. */
static bool kept_room(kvp_pool *pool, kvp__acache *k, uint32_t batch, uint32_t nbh, uint64_t slots, uint32_t rb) {
  uint64_t rec_bytes = slots * rb;
  /* the splits and index of a call in place: at most a split per record slot or bh (splits_bound) */
  uint64_t tab_bytes = (slots + nbh) * sizeof(kvp__asplit) + (nbh + 1ull) * sizeof(uint32_t);
  if (k->seqs_cap >= batch && k->recs_cap >= rec_bytes && k->bh_cap >= nbh && k->pre_cap >= slots &&
      k->hint_cap >= slots + nbh && (!k->pinned || k->tab_cap >= tab_bytes))
    return true;
  uint64_t sc = batch + batch / 8 > k->seqs_cap ? batch + batch / 8 : k->seqs_cap,
           rc = rec_bytes > k->recs_cap ? rec_bytes + rec_bytes / 8 : k->recs_cap,
           bc = nbh + nbh / 8 > k->bh_cap ? nbh + nbh / 8 : k->bh_cap, pc = rc / rb;
  uint64_t rc_al = align_up(rc ? rc : 16, 64), hc = (rc ? rc : 16) / rb + bc,
           tc = k->done ? hc * sizeof(kvp__asplit) + (bc + 1) * sizeof(uint32_t) : 0;
  uint64_t need = sc * (sizeof *k->seqs + sizeof *k->sq) + rc + tc + bh_bytes(bc) + (bc + 1) * sizeof *k->hint0 +
                  (pc ? pc : 1) * sizeof *k->pre + hc * sizeof *k->hint_end;
  kept_drop(pool, k, false);
  if (atomic_fetch_add_explicit(kept_total(pool), need, memory_order_relaxed) + need > kept_bound(pool)) {
    atomic_fetch_sub_explicit(kept_total(pool), need, memory_order_relaxed);
    return false;
  }
  k->bytes = need;
  k->seqs = kvp__meta_alloc(&pool->meta, sc * sizeof *k->seqs);
  k->sq = kvp__meta_alloc(&pool->meta, sc * sizeof *k->sq);
  k->recs = k->done ? kvp__dev_kept_alloc(pool, rc_al + tc) : NULL; /* pinned: read in place */
  if (k->recs) {
    k->tab = k->recs + rc_al, k->tab_cap = tc, k->pin_bytes = rc_al + tc;
    k->recs_dev = kvp__dev_mapped(pool, k->recs), k->tab_dev = kvp__dev_mapped(pool, k->tab);
    k->pinned = k->recs_dev && k->tab_dev;
    if (!k->pinned) { /* not mapped: kept in metadata, copied per call */
      kvp__dev_kept_free(pool, k->recs, k->pin_bytes);
      k->recs = k->tab = NULL, k->recs_dev = k->tab_dev = NULL, k->tab_cap = k->pin_bytes = 0;
    }
  }
  if (!k->recs) k->recs = kvp__meta_alloc(&pool->meta, rc ? rc : 16);
  k->recs_at = kvp__meta_alloc(&pool->meta, bh_bytes(bc));
  if (k->recs_at) {
    k->rend = k->recs_at + bc, k->rlim = k->rend + bc;
    k->tok_of = (uint64_t *)align_up((uintptr_t)(k->rlim + bc), 8);
    k->tails = (atail *)align_up((uintptr_t)(k->tok_of + bc), 16);
  }
  k->pre = kvp__meta_alloc(&pool->meta, (pc ? pc : 1) * sizeof *k->pre);
  k->hint0 = kvp__meta_alloc(&pool->meta, (bc + 1) * sizeof *k->hint0);
  k->hint_end = kvp__meta_alloc(&pool->meta, hc * sizeof *k->hint_end);
  k->seqs_cap = sc, k->recs_cap = rc ? rc : 16, k->bh_cap = bc, k->pre_cap = pc ? pc : 1, k->hint_cap = hc;
  if (!k->seqs || !k->sq || !k->recs || !k->recs_at || !k->pre || !k->hint0 || !k->hint_end) {
    kept_drop(pool, k, false);
    return false;
  }
  return true;
}

/* Per-bh arrays of a kept table's layout: each bh's region (records from
 * at to end, room up to lim), tokens and last record. */
typedef struct bh_arrays {
  uint32_t *at, *end, *lim;
  uint64_t *tok;
  atail *tl;
} bh_arrays;

/* The records of a walk (recs, end to end: recs_at[0 .. n]) of n bhs into
 * new regions of k from k->used on (room after each, zeros), entered in
 * dst as bhs to[i] (NULL: i), with tok_of and tails (the walk's); false,
 * nothing changed, when k has no room for them. */
static bool kept_place(kvp__acache *k, const unsigned char *recs, uint32_t rb, const uint32_t *recs_at, uint32_t n,
                       const uint32_t *to, const uint64_t *tok_of, const atail *tails, const bh_arrays *dst) {
  uint64_t need = 0, slots = k->recs_cap / rb < k->pre_cap ? k->recs_cap / rb : k->pre_cap;
  for (uint32_t i = 0; i < n; i++) need += recs_at[i + 1] - recs_at[i] + room_of(recs_at[i + 1] - recs_at[i]);
  if (k->used + need > slots) return false;
  uint32_t m1_at = m1_at_of(form_of(rb)), u = k->used;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t bh = to ? to[i] : i, nr = recs_at[i + 1] - recs_at[i], room = room_of(nr), acc = 0;
    if (nr) memcpy(k->recs + (size_t)u * rb, recs + (size_t)recs_at[i] * rb, (size_t)nr * rb);
    memset(k->recs + (size_t)(u + nr) * rb, 0, (size_t)room * rb);
    for (uint32_t r = 0; r < nr; r++) k->pre[u + r] = acc, acc += rec_tokens(recs, rb, m1_at, recs_at[i] + r);
    memset(k->pre + u + nr, 0, room * sizeof *k->pre);
    dst->at[bh] = u, dst->end[bh] = u + nr, dst->lim[bh] = u + nr + room;
    dst->tok[bh] = tok_of[i], dst->tl[bh] = tails[i];
    u += nr + room;
  }
  k->used = u;
  return true;
}

/* Keep the table just built (records at buf->p, end to end: recs_at) for
 * layer, laid out anew (kept_place); false when it is not kept (memory,
 * the pool's bound): the kept table is then invalid. */
static bool kept_store(kvp_pool *pool, kvp__acache *k, const kvp__atable *t, const unsigned char *recs, uint32_t rb,
                       const uint32_t *recs_at, const uint64_t *tok_of, const atail *tails, const aseq *sq,
                       uint64_t gen) {
  uint32_t nbh = t->batch * pool->cfg.n_kv_heads, nrec = recs_at[nbh];
  uint64_t slots = nrec;
  for (uint32_t bh = 0; bh < nbh; bh++) slots += room_of(recs_at[bh + 1] - recs_at[bh]);
  k->valid = false;
  if (slots + slots / 8 >= UINT32_MAX / 2) return false;
  kvp__dev_event_wait(k->done); /* the records may still be read in place */
  if (!kept_room(pool, k, t->batch, nbh, slots, rb)) return false;
  k->used = 0;
  bh_arrays dst = {k->recs_at, k->rend, k->rlim, k->tok_of, k->tails};
  if (!kept_place(k, recs, rb, recs_at, nbh, NULL, tok_of, tails, &dst)) return false;
  memcpy(k->seqs, t->seqs, t->batch * sizeof *k->seqs);
  memcpy(k->sq, sq, t->batch * sizeof *k->sq);
  k->gen = gen, k->batch = t->batch, k->kind = t->kind;
  k->hinted = false;
  k->valid = true;
  return true;
}

/* The splits just placed (nsplit at sp, bh's from bh_split0[bh]) as the
 * next call's hint. */
static void kept_hint(kvp__acache *k, uint32_t nbh, const kvp__asplit *sp, uint32_t nsplit, const uint32_t *bh_split0) {
  k->hinted = nsplit <= k->hint_cap && nbh <= k->bh_cap;
  if (!k->hinted) return;
  memcpy(k->hint0, bh_split0, (nbh + 1) * sizeof *k->hint0);
  for (uint32_t s = 0; s < nsplit; s++) k->hint_end[s] = sp[s].rec0 + sp[s].nrec;
}

/* Whether k's sequence b is still the one its records show: its id finds
 * the same sequence, of the same serial and structure generation. */
static bool kept_live(kvp_pool *pool, const kvp__acache *k, uint32_t b) {
  const kvp__seq *s = kvp__seq_find(pool, k->seqs[b]);
  return s && s == k->sq[b].s && s->serial == k->sq[b].serial &&
         atomic_load_explicit(&s->sgen, memory_order_acquire) == k->sq[b].sgen;
}

/* Whether k holds t's batch, each sequence still the same. */
static bool kept_same(kvp_pool *pool, const kvp__acache *k, const kvp__atable *t) {
  if (k->batch != t->batch || memcmp(k->seqs, t->seqs, t->batch * sizeof *t->seqs)) return false;
  for (uint32_t b = 0; b < k->batch; b++)
    if (!kept_live(pool, k, b)) return false;
  return true;
}

/* The n regions of r (at[i] = UINT32_MAX: none) moved to the front of k's
 * records, in their order there, with their prefix sums; k->used after
 * them. The others' (the sequences that left) are given back. */
static void kept_compact(kvp__acache *k, uint32_t rb, const bh_arrays *r, uint32_t n, uint32_t *order) {
  uint32_t *at = r->at, *end = r->end, *lim = r->lim;
  uint32_t m = 0;
  for (uint32_t i = 0; i < n; i++)
    if (at[i] != UINT32_MAX) order[m++] = i;
  for (uint32_t i = 1; i < m; i++) { /* by place (insertion: regions mostly in order already) */
    uint32_t x = order[i], j = i;
    for (; j > 0 && at[order[j - 1]] > at[x]; j--) order[j] = order[j - 1];
    order[j] = x;
  }
  uint32_t w = 0;
  for (uint32_t i = 0; i < m; i++) { /* each moves down or stays: memmove */
    uint32_t x = order[i], len = lim[x] - at[x];
    if (at[x] != w) {
      memmove(k->recs + (size_t)w * rb, k->recs + (size_t)at[x] * rb, (size_t)len * rb);
      memmove(k->pre + w, k->pre + at[x], (size_t)len * sizeof *k->pre);
    }
    end[x] = w + (end[x] - at[x]), lim[x] = w + len, at[x] = w;
    w += len;
  }
  k->used = w;
}

/* A heap buffer for a walk's records (kvp__abuf.grow). */
static int heap_grow(kvp__abuf *b, uint64_t used, uint64_t need) {
  (void)used;
  uint64_t cap = b->cap_bytes ? b->cap_bytes : 4096;
  while (cap < need) cap *= 2;
  unsigned char *p = kvp__meta_realloc(NULL, b->p, b->cap_bytes, cap);
  if (!p) return KVP_ENOMEM;
  b->p = p, b->cap_bytes = cap;
  return KVP_OK;
}

/* k made to hold t's batch (another than k's, or one whose sequence of an
 * id changed): the bhs of each sequence that k holds and that is still
 * the same move to the sequence's place in t's batch (their regions stay
 * where they are), the others are walked and placed in new regions
 * (kept_place). Returns KVP_OK (k holds t's batch), or -1 (k's room, a
 * sequence with shared chunks) or the walk's error: k is then to be
 * dropped (the caller builds the table, which reports the error). */
static int kept_remap(kvp_pool *pool, kvp__acache *k, const kvp__atable *t, uint32_t rb) {
  uint32_t H = pool->cfg.n_kv_heads, B = t->batch, nbh = B * H, old = k->batch;
  if (B > k->seqs_cap || nbh > k->bh_cap) return -1;
  /* scratch: the new batch's sq, per-bh arrays and each old sequence's use, the walked ids and places,
   * an order for kept_compact */
  size_t sz = (size_t)B * (sizeof(aseq) + sizeof(uint64_t) + sizeof(uint32_t)) + (size_t)old + 64 +
              (size_t)nbh * (3 * sizeof(uint32_t) + sizeof(uint64_t) + sizeof(atail) + 2 * sizeof(uint32_t)) +
              (size_t)(nbh + 1) * sizeof(uint32_t);
  unsigned char *mem = kvp__meta_alloc(NULL, sz);
  if (!mem) return kvp__err(KVP_ENOMEM, "attend scratch for a batch of %u", B);
  atail *ntl = (atail *)mem;
  uint64_t *ntok = (uint64_t *)(ntl + nbh), *wid = ntok + nbh;
  aseq *nsq = (aseq *)(wid + B);
  uint32_t *nat = (uint32_t *)(nsq + B), *nend = nat + nbh, *nlim = nend + nbh, *wat = nlim + nbh,
           *wpos = wat + nbh, *wrec = wpos + B, *order = wrec + nbh + 1;
  unsigned char *taken = (unsigned char *)(order + nbh);
  memset(taken, 0, old);
  uint32_t nw = 0;
  for (uint32_t b = 0; b < B; b++) {
    uint32_t j = 0;
    for (; j < old; j++) /* (batches are small: a scan) */
      if (!taken[j] && k->seqs[j] == t->seqs[b] && kept_live(pool, k, j)) break;
    if (j == old) {
      wid[nw] = t->seqs[b], wpos[nw++] = b;
      for (uint32_t h = 0; h < H; h++) nat[b * H + h] = UINT32_MAX; /* no region yet (kept_compact) */
      continue;
    }
    taken[j] = 1, nsq[b] = k->sq[j];
    for (uint32_t h = 0; h < H; h++) {
      uint32_t o = j * H + h, n = b * H + h;
      nat[n] = k->recs_at[o], nend[n] = k->rend[o], nlim[n] = k->rlim[o], ntok[n] = k->tok_of[o], ntl[n] = k->tails[o];
    }
  }
  int rc = KVP_OK;
  if (nw) { /* the sequences new to the kept table: walked as a batch of their own */
    kvp__atable w = *t;
    w.seqs = wid, w.batch = nw;
    kvp__abuf wb = {NULL, 0, heap_grow, NULL};
    uint64_t *wtok = kvp__meta_alloc(NULL, (size_t)nw * H * (sizeof(uint64_t) + sizeof(atail)) + nw * sizeof(aseq));
    atail *wtl = wtok ? (atail *)(wtok + (size_t)nw * H) : NULL;
    aseq *wsq = wtok ? (aseq *)(wtl + (size_t)nw * H) : NULL;
    cursor c;
    bool shared = false;
    rc = !wtok ? kvp__err(KVP_ENOMEM, "attend scratch for %u sequences", nw)
               : kvp__atab_walk(pool, &w, &wb, rb, wrec, wtok, wtl, wsq, &shared, &c);
    if (!rc && shared) rc = -1;
    if (!rc) {
      for (uint32_t i = 0; i < nw; i++) {
        nsq[wpos[i]] = wsq[i];
        for (uint32_t h = 0; h < H; h++) wat[i * H + h] = wpos[i] * H + h;
      }
      /* new regions past every region k has; short of room, the regions the new batch keeps are moved
       * together first (those of the sequences that left given back) */
      bh_arrays dst = {nat, nend, nlim, ntok, ntl};
      if (!kept_place(k, wb.p, rb, wrec, nw * H, wat, wtok, wtl, &dst)) {
        kept_compact(k, rb, &dst, nbh, order); /* (the regions move: a failure after it drops k) */
        if (!kept_place(k, wb.p, rb, wrec, nw * H, wat, wtok, wtl, &dst)) rc = -1;
      }
    }
    if (wb.p) kvp__meta_free(NULL, wb.p, wb.cap_bytes);
    if (wtok) kvp__meta_free(NULL, wtok, (size_t)nw * H * (sizeof(uint64_t) + sizeof(atail)) + nw * sizeof(aseq));
  }
  if (!rc) {
    memcpy(k->recs_at, nat, nbh * sizeof *nat), memcpy(k->rend, nend, nbh * sizeof *nend);
    memcpy(k->rlim, nlim, nbh * sizeof *nlim), memcpy(k->tok_of, ntok, nbh * sizeof *ntok);
    memcpy(k->tails, ntl, nbh * sizeof *ntl);
    memcpy(k->seqs, t->seqs, B * sizeof *k->seqs), memcpy(k->sq, nsq, B * sizeof *nsq);
    k->batch = B, k->hinted = false;
  }
  kvp__meta_free(NULL, mem, sz);
  return rc;
}

/* bh's last record redone from its run's end (its block unchanged: the
 * layer's tail generation stands): the kept record, tokens and bytes
 * updated in place. */
static void kept_advance(kvp__acache *k, uint32_t rb, uint32_t m1_at, uint32_t bh) {
  atail *tl = &k->tails[bh];
  if (!tl->b) return;
  uint32_t end = tl->b->pos0 + tl->b->cap_tokens, re = run_end(tl->r), e = re < end ? re : end;
  if (e <= tl->e) return; /* the run's end only grows */
  k->tok_of[bh] += e - tl->e;
  uint16_t m1 = (uint16_t)(e - tl->a - 1);
  memcpy(k->recs + (size_t)(k->rend[bh] - 1) * rb + m1_at, &m1, sizeof m1);
  uint64_t w = 0;
  double p = 0;
  group_bytes(k->recs, rb, k->rend[bh] - 1, tl->nb, tl->b, &w, &p);
  tl->bw = tl->bw - tl->w + w, tl->bp += p - tl->p;
  tl->e = e, tl->w = w, tl->p = p;
}

/* bh's ends redone from its last record's bref (the layer's tail
 * generation moved): the records of its last block again, from the block
 * the bref holds now (the resealed copy: same positions, other pages), the
 * last to its run's end, then one for each block after it that the run
 * covers, in bh's room; false (k partly changed: the caller drops it) when
 * bh has no noted bref or no room left. */
static ALWAYS_INLINE bool kept_redo(kvp__acache *k, uint32_t bh, uint32_t head, const int form) {
  atail *tl = &k->tails[bh];
  const kvp__bref *ref = tl->ref;
  if (!ref) return false; /* no record, or its bref unknown (not the stream's last) */
  const uint32_t rb = FORM_BYTES(form), m1_at = m1_at_of(form);
  const kvp__run *run = tl->r;
  uint32_t ra = run->p0, re = run_end(run), n = k->rend[bh] - 1;
  const kvp__block *b = kvp__rcu_deref(ref->blk);
  uint32_t be = b->pos0 + b->cap_tokens, e = re < be ? re : be;
  uint16_t t0;
  memcpy(&t0, k->recs + (size_t)n * rb + m1_at - 2, sizeof t0); /* t0 just before m1 (the records' asserts) */
  if (b->pos0 != tl->a - t0 || e < tl->e) return false; /* not the same positions: never for a reseal */
  cursor c = {k->recs + (size_t)(n + 1 - tl->nb) * rb, k->recs + (size_t)k->rlim[bh] * rb, 0, 0, b, run, ref,
              tl->a, e, tl->nb};
  for (uint32_t i = n + 1 - tl->nb; i < n; i++) { /* the block's records of earlier runs: their ranges stay */
    memcpy(&t0, k->recs + (size_t)i * rb + m1_at - 2, sizeof t0);
    put(&c, b, head, b->pos0 + t0, b->pos0 + t0 + rec_tokens(k->recs, rb, m1_at, i), form);
  }
  put(&c, b, head, tl->a, e, form);
  uint64_t tok = k->tok_of[bh] - (tl->e - tl->a) + (e - tl->a);
  uint32_t pre = k->pre[n], m = e - tl->a;
  for (const kvp__bref *nx = kvp__rcu_deref(ref->next); nx; nx = kvp__rcu_deref(nx->next)) {
    const kvp__block *nb = kvp__rcu_deref(nx->blk);
    uint32_t p0 = nb->pos0, ne = p0 + nb->cap_tokens;
    if (p0 >= re) break; /* past the run's end: not published yet */
    if (c.dst == c.lim) return false;
    uint32_t a = ra > p0 ? ra : p0, z = re < ne ? re : ne;
    k->pre[++n] = pre += m;
    put(&c, nb, head, a, z, form);
    c.lb = nb, c.lref = nx, c.la = a, c.le = z, c.lnb = 1;
    tok += m = z - a;
  }
  uint64_t w = c.whole_bytes;
  double p = c.part_bytes;
  if (c.lb != b) w = 0, p = 0, rec_bytes_of(c.lb, c.le - c.la, &w, &p); /* a new last block: its one record */
  k->tok_of[bh] = tok;
  k->rend[bh] = n + 1;
  *tl = (atail){c.lb, run, c.lref, c.la, c.le, c.lnb, w, tl->bw - tl->w + c.whole_bytes, p,
                tl->bp - tl->p + c.part_bytes};
  return true;
}
static bool kept_redo_raw(kvp__acache *k, uint32_t bh, uint32_t head) { return kept_redo(k, bh, head, FORM_RAW); }
static bool kept_redo_q(kvp__acache *k, uint32_t bh, uint32_t head) { return kept_redo(k, bh, head, FORM_Q); }

/* Each sequence's ends brought up to date: advanced where its layer's tail
 * generation is as labelled, redone where it moved (and labelled anew);
 * false where one could not be redone (k partly changed: the caller drops
 * it). */
static bool kept_update(kvp_pool *pool, kvp__acache *k, uint32_t layer, uint32_t rb) {
  uint32_t H = pool->cfg.n_kv_heads, m1_at = m1_at_of(form_of(rb));
  bool raw = form_of(rb) == FORM_RAW;
  for (uint32_t b = 0; b < k->batch; b++) {
    aseq *q = &k->sq[b];
    uint64_t g = atomic_load_explicit(&q->s->layers[layer].tgen, memory_order_acquire);
    if (g == q->tgen) {
      for (uint32_t h = 0; h < H; h++) kept_advance(k, rb, m1_at, b * H + h);
      continue;
    }
    for (uint32_t h = 0; h < H; h++)
      if (!(raw ? kept_redo_raw(k, b * H + h, h) : kept_redo_q(k, b * H + h, h))) return false;
    q->tgen = g & 1 ? KVP__TGEN_NONE : g;
  }
  return true;
}

int kvp__attend_build_kept(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf, bool *hit) {
  *hit = false;
  uint32_t rb = kvp__kern_attend_rec_bytes(t->kind);
  kvp__acache *k = NULL;
  if (pool->acache && t->layer < pool->cfg.n_layers && form_of(rb) != FORM_GJOB && t->batch)
    k = kept_of(pool, t->layer);
  if (!k || !kvp__mutex_trylock(&k->lock)) return kvp__attend_build(pool, t, buf);
  kvp__atab_reset(t);
  int rc = kvp__atab_check(pool, t);
  uint32_t nbh = t->batch * pool->cfg.n_kv_heads;
  size_t scratch = (size_t)(nbh + 1) * 2 * sizeof(uint32_t) + (size_t)nbh * (sizeof(uint64_t) + sizeof(atail)) +
                   (size_t)t->batch * sizeof(aseq);
  uint64_t *tok_of = rc ? NULL : kvp__meta_alloc(NULL, scratch);
  if (!rc && !tok_of) rc = kvp__err(KVP_ENOMEM, "attend scratch for a batch of %u", t->batch);
  if (rc) {
    kvp__mutex_unlock(&k->lock);
    return rc;
  }
  atail *tails = (atail *)(tok_of + nbh);
  aseq *sq = (aseq *)(tails + nbh);
  uint32_t *recs_at = (uint32_t *)(sq + t->batch), *bh_split0 = recs_at + nbh + 1;
  uint64_t gen = atomic_load(&pool->sgen); /* odd: a writer is in; the kept table is neither used nor kept */
  bool served = false;
  if (!(gen & 1) && k->valid && k->gen == gen && k->kind == t->kind) {
    /* in place: the ends redone there and the splits and index built in
     * tab (room for splits_bound's: kept_room), held until the caller's
     * kernels are enqueued and done is recorded after them
     * (kvp__attend_kept_release); otherwise the records are copied to buf */
    bool in_place = k->pinned && kvp__kern_attend_zero_copy(t->kind, pool->cfg.head_dim);
    kvp__abuf tb = {k->tab, k->tab_cap, NULL, NULL}, *out = in_place ? &tb : buf;
    kvp__dev_event_wait(k->done); /* the kernels that read the kept table in place ended */
    served = (kept_same(pool, k, t) || kept_remap(pool, k, t, rb) == KVP_OK) && kept_update(pool, k, t->layer, rb);
    if (!served) k->valid = false; /* a sequence or ends it cannot take or redo: built below */
    /* copied: the records end to end (recs_at: where each bh's went), as a
     * fresh build lays them out (the same workspace) */
    uint32_t nbuf = 0;
    uint64_t whole = 0;
    double part = 0;
    for (uint32_t bh = 0; served && bh < nbh; bh++) {
      whole += k->tails[bh].bw, part += k->tails[bh].bp;
      if (!in_place) recs_at[bh] = nbuf, nbuf += k->rend[bh] - k->recs_at[bh];
    }
    if (served && (in_place || !(rc = kvp__atab_reserve(buf, 0, (uint64_t)nbuf * rb)))) {
      for (uint32_t bh = 0; !in_place && bh < nbh; bh++)
        memcpy(buf->p + (size_t)recs_at[bh] * rb, k->recs + (size_t)k->recs_at[bh] * rb,
               (size_t)(k->rend[bh] - k->recs_at[bh]) * rb);
      split_hint h = {k->hint0, k->hint_end};
      rc = kvp__atab_finish(pool, t, out, rb, k->recs_at, k->rend, k->tok_of, k->pre, k->hinted ? &h : NULL,
                            bh_split0, whole + (uint64_t)part, nbuf);
      *hit = !rc;
      kvp__asplit *sp = (kvp__asplit *)(out->p + t->off_splits);
      if (!rc) kept_hint(k, nbh, sp, t->nsplit, bh_split0);
      for (uint32_t i = 0; !rc && !in_place && i < t->nsplit; i++) /* from the kept table's places to buf's */
        sp[i].rec0 = sp[i].rec0 - k->recs_at[sp[i].bh] + recs_at[sp[i].bh];
      if (!rc && in_place) {
        t->recs_dev = k->recs_dev, t->tab_dev = k->tab_dev, t->done = k->done, t->hold = k;
        kvp__meta_free(NULL, tok_of, scratch);
        return KVP_OK;
      }
    }
  }
  if (!served) {
    bool shared;
    rc = kvp__atab_build(pool, t, buf, rb, recs_at, tok_of, tails, sq, bh_split0, &shared);
    if (rc || shared || (gen & 1)) k->valid = false;
    else kept_store(pool, k, t, buf->p, rb, recs_at, tok_of, tails, sq, gen);
  }
  kvp__meta_free(NULL, tok_of, scratch);
  kvp__mutex_unlock(&k->lock);
  return rc;
}

void kvp__attend_kept_release(kvp_pool *pool, kvp__atable *t) {
  (void)pool;
  kvp__acache *k = t->hold;
  t->hold = NULL;
  if (k) kvp__mutex_unlock(&k->lock);
}

#endif
