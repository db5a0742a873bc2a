/*
 * pages/pages.h - meaning: the pool object, sequences, runs, blocks and what
 * lives in their pages. pages uses alloc, codecs and stats; nothing uses
 * pages.
 *
 *   pool --lfht--> seq --layers[L]--> runs: [s0,s1) x [p0,p1), head mask
 *                     \--streams[L*H]--> brefs --> block (shared on fork)
 *                                                   pg[codec page][K|V]
 *
 * A run says which heads of a layer retain the steps [s0, s1) (positions
 * [p0, p1)); a decode step extends the layer's last run, an eviction splits
 * one. A stream (layer, head) holds its blocks in position order; a block
 * holds up to cap_tokens contiguous positions. Readers walk runs and blocks
 * under RCU; the writer publishes with release stores and frees after a
 * grace period (runs and brefs through call_rcu; blocks, which own pages,
 * through the limbo the writer drains after kvp__rcu_synchronize, so the
 * ledger is only ever touched by the writer).
 */
#ifndef KVP_PAGES_H
#define KVP_PAGES_H

#include "../alloc/alloc.h"
#include "../codecs/codecs.h"
#ifdef KVP_HAVE_CUDA
#include "../kernels/kernels.h"
#endif
#include "../util/rcu.h"

#include <pthread.h>

#define KVP__DEFAULT_BLOCK_TOKENS 16u /* block size of a layer whose codecs prefer none (vLLM's) */
#define KVP__MAX_BLOCK_TOKENS 65536u

/* One slot of the raw-page table (the experimental page API). */
typedef struct kvp__rawslot {
  kvp__page page; /* the page, when live */
  uint32_t gen;   /* generation: bumped at every alloc and free, part of the id; odd while the slot holds a page */
  uint32_t next;  /* free list link (index + 1; 0 = end) */
} kvp__rawslot;
static inline bool kvp__rawslot_live(const kvp__rawslot *s) { return s->gen & 1; }

typedef struct kvp__rawpages {
  kvp__rawslot *slots; /* [cap] */
  uint32_t cap;        /* slots */
  uint32_t free_head;  /* first free slot (index + 1; 0 = none) */
} kvp__rawpages;

/* A codec bound to one (layer, K or V), or the RAW tail of one side. */
typedef struct kvp__binding {
  const kvp_codec_vtable *vt; /* the codec */
  void *inst;                 /* its instance */
  uint32_t id;                /* registry id (stats tag) */
  uint32_t group;             /* group_tokens */
  bool passthrough;           /* raw in the appended dtype: an OPEN block seals as is */
  bool dev_async;             /* CUDA pools: fails on non-finite input only and keeps no host-side stream state
                                 (raw, fp8, int8, nvfp4): its appends may skip their status (KVP_POOL_DEVICE_ASYNC) */
} kvp__binding;

/* Up to cap_tokens tokens of one stream at positions [pos0, pos0 + cap).
 * raw: the pages are the side's RAW tail (appended dtype), as in an OPEN
 * block of a stream; else they are the layer's codec's. raw, pos0,
 * cap_tokens and, once published sealed, n_tokens never change.
 * Sized by its page rows (npg, kvp__block_rows): a raw block (an OPEN one,
 * whose RAW tail binding is the raw codec's one page a side) holds row 0
 * alone, 128 bytes; a codec's block KVP_CODEC_MAX_PAGES rows, 320 bytes.
 * The bytes count where a cache grows: a decode token that opens a block
 * per head takes H structs of metadata memory never touched before (an
 * arena's fresh pages: about 0.5 ns a byte here, the page faults with it).
 * Row i of pg is KVP__PG(b, i) (row 0 is pg0, the rest pgx).
 * Layout (a 64-byte aligned block, as the metadata arena's 128- and
 * 320-byte classes give): what a walk over many blocks reads first, K's and
 * V's pages of one index side by side, the writer's bookkeeping after row 0:
 *   0    pos0 cap_tokens n_tokens raw npages sealed
 *   16   pg0[K]   48 pg0[V] (its off and requested_bytes in line 0)
 *   80   owners refs check_epoch owners_seen orphan npg oprev onext chunk
 *   128  pgx[0][K] 160 pgx[0][V] (row 1: line 2) ... one line a row
 * so kvp_attend_decode's table (pages/attend_table.c) reads one line of a
 * block of one page a side (raw) and two of one of two (a codec's codes
 * and scales), and a decode token's fill of an OPEN tail (pages/stream.c:
 * append_fill) one line per head: whether it takes the token (raw,
 * sealed, n_tokens, cap_tokens) and where its rows go (pg0[K].off,
 * pg0[V].off). */
typedef struct kvp__block {
  uint32_t pos0;          /* position of token 0 */
  uint32_t cap_tokens;    /* capacity: the pages hold this many tokens */
  uint32_t n_tokens;      /* tokens written (writer only while OPEN) */
  bool raw;               /* pages of the RAW tail binding */
  uint8_t npages[2];      /* pages per side, at most npg */
  bool sealed;            /* full or closed: takes no more tokens */
  kvp__page pg0[2];       /* row 0 of the pages: [K, V] */
  uint32_t owners;        /* streams referencing it (writer only) */
  _Atomic uint32_t refs;  /* owners + view pins; freed when 0 */
  uint32_t check_epoch;   /* kvp_check visit mark */
  uint32_t owners_seen;   /* kvp_check: brefs found this check */
  bool orphan;            /* no owner left, kept by pins (on pool->orphans) */
  uint8_t npg;            /* rows of pages the struct holds: pg0 and npg - 1 of pgx */
  struct kvp__block *oprev, *onext; /* pool->orphans list, or limbo chain (onext) */
  struct kvp__chunk *chunk; /* the prefix-table entry that lists it, or NULL (writer only) */
  kvp__page pgx[][2];     /* rows 1 .. npg - 1: [codec page - 1][K, V] */
} kvp__block;
/* Row i (< b->npg) of b's pages, an array [K, V] (const when b is). */
#define KVP__PG(b, i) ((i) == 0 ? (b)->pg0 : (b)->pgx[(i) - 1])
/* Rows of pages a block needs: one for raw (the raw codec's one page a
 * side), else the most any codec's layout has. */
static inline uint8_t kvp__block_rows(bool raw) { return raw ? 1 : (uint8_t)KVP_CODEC_MAX_PAGES; }
/* Metadata bytes of a block struct of npg rows (as it was allocated). */
static inline size_t kvp__block_bytes(uint8_t npg) {
  return offsetof(kvp__block, pgx) + (size_t)(npg - 1) * sizeof(kvp__page[2]);
}

/* A stream's reference to a block (blocks are shared across forks). */
typedef struct kvp__bref {
  struct kvp__bref *next; /* RCU list in position order */
  kvp__block *blk;        /* the block (RCU: replaced when an OPEN block is sealed and encoded) */
  kvp__rcu_head rcu;      /* deferred free */
} kvp__bref;

/* Steps [s0, s1) of a layer at positions [p0, p1), retained by mask's heads. */
typedef struct kvp__run {
  struct kvp__run *next;  /* RCU list in step order */
  uint32_t s0, p0;        /* first step, its first position */
  _Atomic uint32_t s1, p1; /* end step and position; p1 is stored (release) after the data */
  kvp__rcu_head rcu;      /* deferred free */
  uint32_t nwords;        /* words of mask */
  uint64_t mask[];        /* bit h: head h retains these steps */
} kvp__run;

typedef struct kvp__stream {
  kvp__bref *blocks;              /* RCU list, position order */
  kvp__bref *tail;                /* last bref (writer only) */
  _Atomic uint32_t retained_tokens; /* tokens retained */
  _Atomic uint32_t evicted_tokens;  /* tokens evicted */
  void *cstate[2];                  /* K, V codec state (writer only), or NULL */
} kvp__stream;

typedef struct kvp__layer {
  kvp__run *runs; /* RCU list, step order */
  kvp__run *last; /* last run (writer only) */
  /* The tail generation (pools with kept tables: acache), a sequence
   * count: odd while an append publishes that changes the layer's streams
   * only at their ends (new blocks linked after the tail, the OPEN tail
   * resealed in its bref, the last run extended: no eviction, no new run),
   * a new even value after. Such an append leaves the pool's sgen as it
   * was; this count tells a kept table which sequences' ends to redo
   * (pages/attend_kept.c). Any other change moves the sequence's sgen or
   * the pool's. */
  _Atomic uint64_t tgen;
} kvp__layer;

typedef struct kvp__seq {
  struct cds_lfht_node node; /* in pool->seqs */
  uint64_t id;               /* the caller's id */
  uint64_t serial;           /* this sequence among all the pool made (ids are reused, addresses too) */
  /* Its structure generation (pools with kept tables), a sequence count:
   * odd while a call that may change its structure alone holds the writer
   * lock (seq.c: lock_seq), a new even value after it changed some, the
   * value before otherwise. Such a call leaves the pool's sgen as it was. */
  _Atomic uint64_t sgen;
  kvp_seq_mode mode;         /* stream or step */
  uint32_t *plan;            /* planned tokens per step, or NULL */
  uint32_t n_plan;           /* entries of plan */
  double budget_fraction;    /* for policies */
  _Atomic uint32_t n_steps;  /* steps begun */
  _Atomic uint32_t n_positions; /* positions of ended steps (+ open step's, after its end) */
  uint32_t *step_pos;        /* [n_steps + 1]: first position of each step (writer only) */
  uint32_t step_pos_cap;     /* entries allocated */
  _Atomic int in_step;       /* a step is open */
  uint32_t cur_tokens;       /* tokens of the open step */
  uint32_t cur_flags;        /* flags of the open step */
  uint32_t next_layer;       /* next layer to append in the open step */
  struct kvp__policy *pol_own;     /* the sequence's own policy (spec override), or NULL */
  char *pol_spec;                  /* its spec (for forks), or NULL */
  const struct kvp__policy *pol;   /* the policy in force (own or the pool's) */
  void *pol_state;                 /* its per-sequence state */
  kvp__layer *layers;        /* [L] */
  kvp__stream *streams;      /* [L * H], stream (l, h) at l * H + h */
  size_t layers_bytes, streams_bytes; /* sizes of the two arrays */
  uint64_t (*pkeys)[2];      /* [n_pkeys]: content keys of the prompt's full blocks (pages/prefix.c), or NULL */
  uint32_t n_pkeys;          /* prompt chunks with a key (prompt tokens / block_tokens) */
  uint32_t max_hit;          /* chunks an attach may take: (prompt tokens - 1) / block_tokens */
  uint32_t next_reg;         /* first prompt chunk not yet registered (or found unregistrable) */
  struct kvp__holds *holds;  /* chunk-level references to prefix-table entries (RCU: set once), or NULL */
  kvp__rcu_head rcu;         /* deferred free */
} kvp__seq;

/* A prefix-table entry: the blocks of one chunk (block_tokens positions
 * [index * bt, (index + 1) * bt)) of every (layer, head), keyed by the
 * chained content key of the tokens up to its end. The entry is one owner
 * of each of its blocks; sequences hold the entry as a whole (a chunk-level
 * reference, kvp__holds), and it goes when its last holder lets go
 * (pages/prefix.c). Readers reach it through holds: freed after a grace
 * period. */
typedef struct kvp__chunk {
  struct kvp__chunk *hnext; /* hash chain (writer only) */
  uint64_t key[2];          /* content key */
  uint32_t index;           /* chunk number: positions / block_tokens */
  uint32_t holders;         /* sequences whose holds name this entry (writer only) */
  uint32_t check_epoch;     /* kvp_check visit mark */
  uint32_t holders_seen;    /* kvp_check: holds found this check */
  uint32_t nblocks;         /* L * H */
  kvp__rcu_head rcu;        /* deferred free */
  kvp__block *blocks[];     /* [L * H]: block of (layer, head) at l * H + h; fixed while the entry lives */
} kvp__chunk;

/* A sequence's chunk-level references: at[c], when set, gives positions
 * [c * bt, (c + 1) * bt) of every (layer, head) of the sequence as the
 * entry's blocks, in place of brefs (a sequence that also has brefs there,
 * the one that computed them, has exactly the entry's blocks). Allocated
 * once per sequence, never resized while readers may see it; entries are
 * set and cleared with release stores (pages/prefix.c). */
typedef struct kvp__holds {
  uint32_t n;              /* entries of at */
  kvp__rcu_head rcu;       /* deferred free */
  kvp__chunk *at[];        /* [n]: the entry held for chunk c, or NULL */
} kvp__holds;

typedef struct kvp__ptable {
  kvp__chunk **buckets; /* [nbuckets] */
  uint32_t nbuckets;    /* power of two, or 0 before the first insert */
  uint64_t n;           /* entries */
} kvp__ptable;

enum { KVP__SEQ_CACHE = 64 }; /* slots of kvp_pool.seq_cache (a power of two) */

/* Metadata slots pre-backed at create (KVP_POOL_PREFAULT; pages/block.c):
 * one metadata allocation, faulted in, carved into slots of one size (raw
 * block structs, or brefs); the writer takes a slot from the free list,
 * else the next never-used one (next < end), and gives it back to the
 * free list, or to the retired list first when readers may still hold it
 * (a bref: recycled after the next grace period, kvp__reclaim).
 * Invariant: every slot in [base, next) is live, retired or free. */
typedef struct kvp__bstore {
  unsigned char *base;   /* the store, or NULL: none (these structs from kvp__meta) */
  unsigned char *next;   /* the first slot never handed out */
  unsigned char *end;    /* base + slots x slot */
  void *free;            /* slots given back, linked through their first word */
  void *retired;         /* brefs retired, linked through their RCU head's room (readers read the rest) */
  uint64_t nretired;     /* how many */
  size_t slot;           /* bytes per slot */
  size_t bytes;          /* of the allocation at base (counted in the pool's metadata bytes) */
} kvp__bstore;

struct kvp_pool {
  kvp_config cfg;        /* copy of the configuration (strings not kept) */
  kvp__mutex lock;       /* the writer lock: one mutator at a time */
  kvp__meta meta;        /* host metadata bytes of this pool */
  kvp__stats stats;      /* per-tag counters */
  kvp__alloc alloc;      /* region, extents, slabs, ledger */
  kvp__rawpages raw;     /* pages handed out through kvp_page_* */
  struct cds_lfht *seqs; /* live sequences by id */
  struct kvp__seq *seq_cache[KVP__SEQ_CACHE]; /* the writer's last lookup per hash slot, or NULL: live sequences
                                                 only (writer only; pages/seq.c) */
  kvp__binding *bind;    /* [2 * L]: codec of (layer, K|V) at 2 * layer + kv */
  kvp__binding tail[2];  /* raw in the appended dtype: OPEN blocks of K and V */
  uint32_t *bt;          /* [2 * L]: tokens per block of layer l, stream mode at 2l, step mode at 2l + 1 */
  kvp__block *limbo;     /* blocks waiting for a grace period (onext chain); bytes in ledger.retired */
  kvp__bstore bstore;    /* pre-backed raw block structs (KVP_POOL_PREFAULT; pages/block.c), writer only */
  kvp__bstore rstore;    /* pre-backed brefs, the same way */
  kvp__block *orphans;   /* evicted blocks kept alive by view pins */
  struct kvp__policy *policy; /* the pool's policy (config.policy) */
  struct kvp__heatkv_cache *heatkv_cache; /* HeatKV orders and plans shared by sequences, or NULL */
  uint32_t check_epoch;  /* for kvp_check's visit marks */
  struct kvp__dev *dev;  /* CUDA region (not dry): the device control block; else NULL */
  struct kvp__xfer *xfer; /* CUDA region: the store tier's pinned staging (pages/xfer_cuda.c), made on first use */
  kvp__ptable prefix;    /* content key -> chunk of shared blocks (pages/prefix.c; writer only) */
  uint64_t codec_fp;     /* fingerprint of the codec bindings: names and parameters per (layer, side) */
  uint32_t chunk_tokens; /* the stream-mode block size every layer shares (prefix chunks, store blobs);
                            0 when layers chose different sizes: no prefix sharing, no store tier */
  /* The structure generation, a sequence count: odd while the writer lock
   * is held; when it is left, one more (even again, a new value) after any
   * change to a block list, a run list or a block's pages of a sequence
   * that stays, unless the holder changed one sequence's alone (w_seq:
   * that sequence's sgen moves instead); one less (the value before)
   * otherwise (w_pure: a fill, a sequence added, forked or freed). A reader
   * under the RCU read lock that loads an even value equal to the one it
   * loaded before a walk, and finds each sequence it walked by its id with
   * the same serial and the same even sgen, knows that walk's view is
   * still exact but for the runs' ends and the ends of the layers whose
   * tail generation (kvp__layer.tgen) moved, and that what it names stays
   * valid while the read lock is held: a writer that unlinks something
   * made one of those counts odd before it, or removed its sequence from
   * the table, and frees it only after a grace period. */
  _Atomic uint64_t sgen;  /* (pools with kept tables: acache) */
  _Atomic uint64_t seq_serial; /* the last kvp__seq.serial given */
  bool w_pure;           /* writer only: the lock's holder changed no structure (kvp__unlock) */
  struct kvp__seq *w_seq; /* writer only: the sequence whose structure alone the holder may change
                            (its sgen odd: seq.c, lock_seq), or NULL: any */
  bool w_fill;           /* writer only: the last publish (pages/stream.c) changed no structure that sgen
                            must show (it filled OPEN tails, or changed one layer's ends under its tgen) */
  struct kvp__acache **acache; /* CUDA pools: [L] the attention tables kept per layer (pages/attend_kept.c) */
  _Atomic uint64_t acache_bytes; /* bytes they hold (bounded: pages/attend_kept.c, kept_bound) */
};

/* Tokens per block of layer for a sequence of mode (a step-mode block also
 * ends with its step). */
static inline uint32_t kvp__layer_bt(const kvp_pool *p, uint32_t layer, kvp_seq_mode mode) {
  return p->bt[2 * layer + (mode == KVP_SEQ_STEP)];
}
static inline kvp__stream *kvp__seq_stream(const kvp_pool *p, kvp__seq *s, uint32_t layer, uint32_t head) {
  return &s->streams[(size_t)layer * p->cfg.n_kv_heads + head];
}
static inline const kvp__binding *kvp__block_binding(const kvp_pool *p, uint32_t layer, int kv,
                                                      const kvp__block *b) {
  return b->raw ? &p->tail[kv] : &p->bind[2 * layer + kv];
}
/* n_tokens of a raw OPEN block grows under readers: the writer stores it
 * with relaxed atomics, readers that look at it load it so. */
static inline void kvp__block_set_n(kvp__block *b, uint32_t n) { __atomic_store_n(&b->n_tokens, n, __ATOMIC_RELAXED); }
static inline uint32_t kvp__block_n(const kvp__block *b) { return __atomic_load_n(&b->n_tokens, __ATOMIC_RELAXED); }
/* Layout of a block of cap tokens whose row 0 is at pos0 under binding bd. */
static inline void kvp__bind_layout(const kvp__binding *bd, uint32_t pos0, uint32_t cap, kvp_codec_layout *out) {
  if (bd->vt->layout_at) bd->vt->layout_at(bd->inst, pos0, cap, out);
  else bd->vt->layout(bd->inst, cap, out);
}
static inline bool kvp__run_has(const kvp__run *r, uint32_t head) { return (r->mask[head / 64] >> (head % 64)) & 1; }

/* Visit every live page of the pool (for kvp_check). */
typedef void (*kvp__page_visit)(void *ctx, const kvp__page *pg);
void kvp__rawpages_walk(const kvp__rawpages *r, kvp__page_visit fn, void *ctx);
void kvp__rawpages_fini(kvp_pool *pool);

static inline void kvp__lock(kvp_pool *p) {
  kvp__mutex_lock(&p->lock);
  if (p->acache) atomic_fetch_add(&p->sgen, 1); /* odd: a writer is in (sequentially consistent: before any change) */
  p->w_pure = false;                            /* a change of structure unless the holder says otherwise */
}
static inline void kvp__unlock(kvp_pool *p) {
  if (!p->acache) { /* no kept tables (a host pool): nobody reads the counts */
  } else if (p->w_seq) { /* one sequence's structure at most: its count moves, the pool's goes back */
    if (p->w_pure) atomic_fetch_sub(&p->w_seq->sgen, 1);
    else atomic_fetch_add(&p->w_seq->sgen, 1);
    p->w_seq = NULL;
    atomic_fetch_sub(&p->sgen, 1);
  } else if (p->w_pure) {
    atomic_fetch_sub(&p->sgen, 1); /* no structure changed: the value before */
  } else {
    atomic_fetch_add(&p->sgen, 1); /* a new value */
  }
  kvp__mutex_unlock(&p->lock);
}

/* pages/prefix.c: prefix sharing by content keys. */
/* Keys of the first n_chunks full blocks of tokens (chained). */
void kvp__prefix_keys(const kvp_pool *pool, const uint32_t *tokens, uint32_t n_chunks, uint64_t (*out)[2]);
kvp__chunk *kvp__prefix_find(const kvp_pool *pool, const uint64_t *key);
/* A new entry for blocks[L * H] (sealed, full, at chunk index, in no
 * entry yet), held by s at once (s's holds are made with at least index + 1
 * entries when it has none: hold_n gives their count, 0 = s's prompt
 * chunks). The entry takes an owner reference on each block (a block with
 * no owner yet gets refs 1). ENOMEM, nothing changed. */
int kvp__prefix_adopt(kvp_pool *pool, kvp__seq *s, const uint64_t *key, uint32_t index, kvp__block *const *blocks,
                      uint32_t hold_n);
/* The same entry with no holder yet (kvp_prefix_fetch's fresh blocks, held
 * by the attach that follows); NULL when out of memory (message set).
 * Discard: undo it before anyone held it, its blocks fresh again (owners
 * 0; they had no other owner). */
kvp__chunk *kvp__prefix_entry_new(kvp_pool *pool, const uint64_t *key, uint32_t index, kvp__block *const *blocks);
void kvp__prefix_entry_discard(kvp_pool *pool, kvp__chunk *c);
void kvp__prefix_fini(kvp_pool *pool);
/* Entries agree with their blocks and holders (after kvp__seqs_check's walk
 * of this epoch, which visits every held block); ECORRUPT. */
int kvp__prefix_check(kvp_pool *pool);
/* Can sequence s share blocks (no policy, stateless codecs, host payload)? */
bool kvp__prefix_ok(const kvp_pool *pool, const kvp__seq *s);
/* Register s's prompt chunks complete since the last call (writer). */
void kvp__prefix_register(kvp_pool *pool, kvp__seq *s);
/* Attach m table entries (chunks index c0.. c0 + m - 1, c0 = s's positions
 * / block_tokens) at the end of s as one new step of m * block_tokens
 * tokens: one chunk-level reference each, O(m + L + L * H counters), no
 * block touched. s's positions must end on a chunk boundary with every tail
 * sealed. All or nothing (ENOMEM: the chunks untouched). */
int kvp__prefix_attach(kvp_pool *pool, kvp__seq *s, uint32_t m, kvp__chunk *const *chunks);
/* Chunks of s's prompt found in the table from s's next chunk on. */
uint32_t kvp__prefix_lookup(kvp_pool *pool, const kvp__seq *s, kvp__chunk **out, uint32_t cap);
/* Hold c as chunk c->index of s (an unpublished sequence being built:
 * restore, fork); s's holds must exist with room. */
void kvp__prefix_hold(kvp__seq *s, kvp__chunk *c);
/* Make s's holds with n entries (none yet); ENOMEM. */
int kvp__prefix_holds_make(kvp_pool *pool, kvp__seq *s, uint32_t n);
/* The child holds what the parent holds (fork; ENOMEM, nothing held). */
int kvp__prefix_fork(kvp_pool *pool, const kvp__seq *parent, kvp__seq *child);
/* Let go of every hold of s and free its holds (after a grace period when
 * readers may still walk s: s->holds then stays set, as readers of s read
 * it whole until s goes); entries left with no holder go. */
void kvp__prefix_release(kvp_pool *pool, kvp__seq *s, bool readers_may_hold);
/* Turn s's holds on the chunks overlapping positions [a, b) into brefs of
 * their blocks in every stream (where s has none already), then let them
 * go: what an eviction of s there may then drop is s's own reference.
 * ENOMEM, nothing changed. May wait for a grace period. */
int kvp__prefix_detach(kvp_pool *pool, kvp__seq *s, uint32_t a, uint32_t b);
/* kvp_check: mark every entry live for this check (pool->check_epoch),
 * before the walk; then per sequence, its holds name live entries at their
 * index (and key), counted into holders_seen (ECORRUPT); and a bref of
 * stream lh that lies in a chunk s holds is that chunk's block. */
void kvp__prefix_mark(kvp_pool *pool);
int kvp__prefix_check_holds(kvp_pool *pool, const kvp__seq *s);
bool kvp__prefix_bref_ok(const kvp_pool *pool, const kvp__seq *s, uint32_t lh, const kvp__block *b);
/* Does s hold a chunk overlapping positions [a, b)? */
bool kvp__prefix_holds_any(const kvp_pool *pool, const kvp__seq *s, uint32_t a, uint32_t b);

/* The blocks of one stream of a sequence in position order: its held
 * chunks' blocks merged with its brefs (a bref at a held chunk's positions
 * holds that very block, and is passed over). For readers under
 * rcu_read_lock and for the writer. Every peek loads what it needs afresh
 * (links, holds), so a walk sees a block published after it began, as the
 * plain bref walk did. Cost over that walk: one load of the holds pointer
 * and, for a sequence with holds, one division and one load per chunk
 * boundary. */
typedef struct kvp__bwalk {
  const kvp__seq *s;        /* the sequence */
  kvp__bref *const *link;   /* the field the next bref is loaded from */
  uint32_t lh;              /* stream: layer * H + head */
  uint32_t bt;              /* chunk tokens */
  uint32_t end;             /* positions below end are passed */
} kvp__bwalk;
static inline void kvp__bwalk_init(kvp__bwalk *w, const kvp_pool *p, const kvp__seq *s, uint32_t lh) {
  w->s = s;
  w->link = &s->streams[lh].blocks;
  w->lh = lh;
  w->bt = p->chunk_tokens;
  w->end = 0;
}
/* The first block at or after the walk's end (NULL: none now). */
static inline kvp__block *kvp__bwalk_peek(kvp__bwalk *w) {
  kvp__bref *r;
  kvp__block *rb = NULL;
  while ((r = kvp__rcu_deref(*w->link)) && (rb = kvp__rcu_deref(r->blk))->pos0 < w->end) {
    w->link = &r->next;
    rb = NULL;
  }
  const kvp__holds *hd = kvp__rcu_deref(w->s->holds);
  if (hd) {
    uint64_t rpos = rb ? rb->pos0 : UINT64_MAX;
    for (uint32_t c = (w->end + w->bt - 1) / w->bt; c < hd->n && (uint64_t)c * w->bt < rpos; c++) {
      kvp__chunk *ch = kvp__rcu_deref(hd->at[c]);
      if (ch) return ch->blocks[w->lh];
    }
  }
  return rb;
}
/* Step past b (the block peek returned). */
static inline void kvp__bwalk_pass(kvp__bwalk *w, const kvp__block *b) {
  kvp__bref *r = kvp__rcu_deref(*w->link);
  if (r && kvp__rcu_deref(r->blk) == b) w->link = &r->next;
  w->end = b->pos0 + b->cap_tokens;
}
/* A whole walk: for (b = kvp__bwalk_first(&w, p, s, lh); b; b = kvp__bwalk_next(&w, b)). */
static inline kvp__block *kvp__bwalk_first(kvp__bwalk *w, const kvp_pool *p, const kvp__seq *s, uint32_t lh) {
  kvp__bwalk_init(w, p, s, lh);
  return kvp__bwalk_peek(w);
}
static inline kvp__block *kvp__bwalk_next(kvp__bwalk *w, const kvp__block *b) {
  kvp__bwalk_pass(w, b);
  return kvp__bwalk_peek(w);
}

/* pages/block.c: the objects a stream is made of (blocks, runs, brefs, codec
 * state) and their lifecycle; the token counts (see there). Writer. */
kvp__run *kvp__run_new(kvp_pool *pool, uint32_t s0, uint32_t p0, uint32_t s1, uint32_t p1, const uint64_t *mask);
void kvp__run_free_now(kvp_pool *pool, kvp__run *r);
void kvp__bref_free_now(kvp_pool *pool, kvp__bref *b);
/* Retire (call_rcu) a run or bref: freed after a grace period. */
void kvp__run_retire(kvp_pool *pool, kvp__run *r);
void kvp__bref_retire(kvp_pool *pool, kvp__bref *b);
/* A zeroed bref for an append's plan (writer): from the pool's pre-backed
 * store first, else the writer's metadata cache; NULL when out of memory. */
kvp__bref *kvp__bref_new_w(kvp_pool *pool);
/* Allocate a block with pages for cap tokens of (seq, layer, head), raw
 * (the tail binding) or the layer's codec; writer. */
int kvp__block_new(kvp_pool *pool, uint64_t seq, uint32_t layer, uint32_t head, uint32_t pos0, uint32_t cap, bool raw,
                   kvp__block **out);
/* A block with pages of the given layouts (lay[0] K, lay[1] V). */
int kvp__block_new_sized(kvp_pool *pool, uint64_t seq, uint32_t layer, uint32_t head, uint32_t pos0, uint32_t cap,
                         bool raw, const kvp_codec_layout *lay, kvp__block **out);
/* The same in two steps: the struct (metadata only; NULL when out of
 * memory), then its pages (all or none: on failure none are left). */
kvp__block *kvp__block_struct(kvp_pool *pool, uint32_t pos0, uint32_t cap, bool raw);
/* The same from the writer's metadata cache (kvp__meta_calloc_w), a raw
 * one first from the pool's pre-backed store (kvp__bstore): only with
 * the writer lock held (an append's plan), never from a store callback. */
kvp__block *kvp__block_struct_w(kvp_pool *pool, uint32_t pos0, uint32_t cap, bool raw);
int kvp__block_take_pages(kvp_pool *pool, kvp__block *b, uint64_t seq, uint32_t layer, uint32_t head,
                          const kvp_codec_layout *lay);
void kvp__block_give_pages(kvp_pool *pool, kvp__block *b); /* frees its pages; npages = 0 */
/* The layouts a block's pages have now (types and requested bytes). */
void kvp__block_layouts(const kvp__block *b, kvp_codec_layout *lay);
/* The last run of the layer ends at step and retains exactly mask's heads. */
bool kvp__run_extends(const kvp_pool *pool, const kvp__layer *L, uint32_t step, const uint64_t *mask);
bool kvp__run_extends_all(const kvp_pool *pool, const kvp__layer *L, uint32_t step); /* mask: every head */
/* Allocated bytes of one block at position pos0, K + V. */
uint64_t kvp__block_class_bytes(const kvp_pool *pool, uint32_t layer, bool raw, uint32_t pos0, uint32_t cap);
/* Drop one owner reference of a block (writer): to the limbo at zero refs,
 * to the orphans if only pins remain. */
void kvp__block_unown(kvp_pool *pool, kvp__block *b);
/* The rest of such a drop once owners was lowered (an undoable eviction
 * lowers it first, and finishes at commit). */
void kvp__block_unowned(kvp_pool *pool, kvp__block *b);
/* Free the limbo now: its grace period has passed (writer). */
void kvp__reclaim_after_grace(kvp_pool *pool);
/* Free a block's pages and struct now (writer; no reader may hold it). */
void kvp__block_destroy(kvp_pool *pool, kvp__block *b);
/* Free a block's struct alone (its pages gone or never taken; writer). */
void kvp__block_struct_free(kvp_pool *pool, kvp__block *b);
/* The pre-backed stores of raw block structs and brefs (KVP_POOL_PREFAULT;
 * else nothing): init after the bindings (ENOMEM, nothing taken, on
 * failure); fini after every block struct and bref was freed. */
int kvp__bstore_init(kvp_pool *pool);
void kvp__bstore_fini(kvp_pool *pool);
/* Wait for a grace period and free everything in the limbo (writer). */
void kvp__reclaim(kvp_pool *pool);
void kvp__block_unpinned(kvp_pool *pool, kvp__block *b); /* last pin of an orphan gone (writer lock) */
/* Codec state of stream (layer, head), side kv: allocated zeroed on first
 * use when the layer's codec keeps state; NULL if it keeps none. ENOMEM. */
int kvp__cstate_get(kvp_pool *pool, kvp__stream *st, uint32_t layer, int kv, void **out);
size_t kvp__cstate_bytes(const kvp_pool *pool, uint32_t layer, int kv);
void kvp__cstate_free(kvp_pool *pool, kvp__stream *st, uint32_t layer);
int kvp__cstate_copy(kvp_pool *pool, const kvp__stream *from, kvp__stream *to, uint32_t layer);
/* Tokens counters of the ledger (writer). */
void kvp__count_tokens(kvp_pool *pool, int64_t retained, uint64_t evicted);

/* pages/seq.c */
int kvp__seqs_init(kvp_pool *pool);
void kvp__seqs_fini(kvp_pool *pool); /* frees every sequence (destroy) */
kvp__seq *kvp__seq_find(kvp_pool *pool, uint64_t id); /* under rcu_read_lock */
/* Walk every block and page of every sequence, the limbo and the orphans;
 * verify runs and streams. KVP_OK or KVP_ECORRUPT (writer lock held). */
int kvp__seqs_check(kvp_pool *pool, kvp__page_visit fn, void *ctx);

int kvp__seq_fork_locked(kvp_pool *pool, kvp__seq *parent, kvp__seq *child); /* pages/fork.c */
/* A sequence built off-table (restore): undo it (blocks with no owner are
 * destroyed, shared ones lose the reference taken), or commit it (fresh
 * blocks get their owner, tokens are counted). pages/fork.c */
void kvp__seq_build_undo(kvp_pool *pool, kvp__seq *s);
void kvp__seq_build_commit(kvp_pool *pool, kvp__seq *s);
/* kvp_check's walk of one sequence (runs, streams, layouts), for a
 * sequence built from untrusted input; KVP_ECORRUPT names what is wrong. */
int kvp__seq_validate(kvp_pool *pool, kvp__seq *s);
/* Publish a built sequence in the table (writer). */
void kvp__seq_publish(kvp_pool *pool, kvp__seq *s);
/* Unlink and free a live sequence, as kvp_seq_free (writer). */
void kvp__seq_remove(kvp_pool *pool, kvp__seq *s);
void kvp__seq_free_struct(kvp_pool *pool, kvp__seq *s); /* an unpublished one's metadata */
/* For tests/fuzz/fuzz_store_blob.c: payload as a manifest (kind 1) or group
 * blob (kind 2) of this pool, under a correct header and checksum, parsed
 * (and a group's blocks built, then destroyed) as a restore would. Touches
 * no store; the pool is as before. */
int kvp__store_fuzz_parse(kvp_pool *pool, int kind, uint32_t n_items, uint32_t index, int content, const uint64_t *tag,
                          const void *payload, size_t len);
kvp__seq *kvp__seq_alloc(kvp_pool *pool, uint64_t id, const uint32_t *plan, uint32_t n_plan);

/* pages/evict.c: eviction plans, the eviction of one unit, and the append
 * transaction (see there). */
typedef struct kvp__unit {
  uint32_t layer, head, step; /* what an eviction removes */
} kvp__unit;
/* An undoable application of evictions (pages/evict.c): every change it
 * made, so that it can be put back. */
enum {
  KVP__UNDO_RUN_LINK,  /* at: a kvp__run * field (a link, a layer's runs or last); old: its value */
  KVP__UNDO_BREF_LINK, /* at: a kvp__bref * field (a link, a stream's blocks or tail); old: its value */
  KVP__UNDO_U32,       /* at: an _Atomic uint32_t (a stream's token counts); old: its value */
  KVP__UNDO_RUN_NEW,   /* at: a run linked in (undo: retired) */
  KVP__UNDO_RUN_OLD,   /* at: a run unlinked (commit: retired) */
  KVP__UNDO_BREF,      /* at: a bref unlinked (commit: retired) */
  KVP__UNDO_OWNER,     /* at: a block that lost an owner (undo: owner back; commit: the rest of the drop) */
};
typedef struct kvp__undo_ent {
  uint8_t kind; /* KVP__UNDO_* */
  bool freed;   /* OWNER: the block's pages were freed in the append's allocator transaction */
  void *at;     /* the field or object */
  uint64_t old; /* the field's value before */
} kvp__undo_ent;
typedef struct kvp__undo {
  kvp__undo_ent *e; /* [cap] */
  uint32_t n, cap;  /* entries, room */
  uint64_t tokens_retained, bf16_equivalent, tokens_evicted; /* the ledger's token figures before */
} kvp__undo;
/* Room for more entries (ENOMEM); push one (room taken ahead). */
int kvp__undo_reserve(kvp_pool *pool, kvp__undo *u, uint32_t more);
void kvp__undo_push(kvp__undo *u, int kind, void *at, uint64_t old);

typedef struct kvp__evict_plan {
  kvp__unit *units;     /* [cap]: units to evict, in order */
  uint32_t n, cap;      /* units planned, room */
  struct kvp__run **spare; /* [spare_cap]: runs taken ahead (3 per unit) */
  uint32_t nspare, spare_cap;
  uint32_t *commit_at;  /* a policy cursor set to commit_val when applied, or NULL */
  uint32_t commit_val;  /* its new value */
  kvp__undo *undo;      /* applied undoably: the log of the changes; NULL: for good */
} kvp__evict_plan;
void kvp__evict_plan_init(kvp__evict_plan *ev);
void kvp__evict_plan_fini(kvp_pool *pool, kvp__evict_plan *ev);
int kvp__evict_plan_add(kvp_pool *pool, kvp__evict_plan *ev, uint32_t layer, uint32_t head, uint32_t step); /* ENOMEM */
int kvp__evict_plan_prepare(kvp_pool *pool, kvp__evict_plan *ev); /* ENOMEM; nothing visible changes */
void kvp__evict_plan_apply(kvp_pool *pool, kvp__seq *s, kvp__evict_plan *ev); /* after prepare: cannot fail */
/* kvp_evict's unit: its runs taken, s detached from the shared prefix
 * chunks under it, then evicted. ENOENT (not retained), ENOMEM; nothing
 * changed on failure. */
int kvp__evict_one(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t head, uint32_t step);
/* A spare run of the plan, set to [s0, s1) x [p0, p1) with mask. */
struct kvp__run *kvp__evict_plan_run(kvp_pool *pool, kvp__evict_plan *ev, uint32_t s0, uint32_t p0, uint32_t s1,
                                     uint32_t p1, const uint64_t *mask);

/* One layer's append with its policy's evictions. */
typedef struct kvp__append_tx {
  kvp__evict_plan before; /* evictions before the layer is stored */
  kvp__evict_plan after;  /* evictions once it is stored */
  bool before_applied;    /* before was applied (to make room, or at publish) */
  bool room;              /* before was applied to make room and may still be undone: its changes in undo, its
                             blocks' pages freed in atx */
  kvp__undo undo;         /* the log of before's changes while room */
  kvp__alloc_tx atx;      /* the allocator transaction that freed its blocks' pages while room */
  unsigned char *payload; /* while room, when new pages lie over freed ones: the freed pages' requested bytes, in
                             atx order (host copy), or NULL */
  size_t payload_bytes;   /* its size */
} kvp__append_tx;
void kvp__append_tx_init(kvp__append_tx *tx);
void kvp__append_tx_fini(kvp_pool *pool, kvp__append_tx *tx);
int kvp__append_tx_prepare(kvp_pool *pool, kvp__append_tx *tx); /* both plans' runs */
/* Take the append's pages (take: all of them or none, on failure with a
 * message; give: give back all it took; bytes: their allocated bytes)
 * within the budget and the region: the limbo is reclaimed, and when they
 * still do not fit, the before-evictions are applied first to make room,
 * undoably. On failure nothing is changed (the evictions undone, their
 * pages back). tx may be NULL. */
int kvp__append_tx_take(kvp_pool *pool, kvp__seq *s, uint32_t layer, kvp__append_tx *tx, uint64_t bytes,
                        int (*take)(kvp_pool *pool, void *ctx), void (*give)(kvp_pool *pool, void *ctx), void *ctx);
/* The append failed after its pages were taken (writing them), and has
 * given them all back: evictions that made room are undone, the payload of
 * their pages written back where new pages lay over them. */
void kvp__append_tx_fail(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx);
/* KVP_EBUDGET for an append of layer to s that needs bytes more than the budget leaves (the shared message). */
int kvp__append_budget_err(kvp_pool *pool, const kvp__seq *s, uint32_t layer, uint64_t bytes);
void kvp__append_tx_before_publish(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx); /* tx may be NULL */
void kvp__append_tx_after_publish(kvp_pool *pool, kvp__seq *s, kvp__append_tx *tx);
/* Evict one unit; ev (or NULL) provides the runs (then it cannot fail,
 * unless ev->undo is set: ENOMEM for its log, the unit untouched). With
 * ev->undo the changes are logged there and what goes is kept until the
 * log commits: the old run and brefs, and the blocks' owner drop past
 * owners (pages/evict.c). */
int kvp__evict_unit(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t head, uint32_t step, kvp__evict_plan *ev);
bool kvp__unit_retained(const kvp__seq *s, uint32_t layer, uint32_t head, uint32_t step); /* writer */
/* Make an append's positions visible: link run (new) or extend the last
 * run to end_pos (run NULL); nothing when no head was stored. */
void kvp__run_publish(kvp__seq *s, uint32_t layer, uint32_t end_pos, kvp__run *run, bool none_stored);
/* An append takes its run ahead; at publish, once the before-evictions
 * have reshaped the runs, it is dropped (NULL) if the last run extends. */
struct kvp__run *kvp__run_settle(kvp_pool *pool, kvp__seq *s, uint32_t layer, struct kvp__run *run);

/* pages/stream.c */
/* Append layer's tokens of the open step; skip (H bits, or NULL) names heads
 * not to store (step mode only: a policy drops the step there at once); tx
 * (or NULL) holds the policy's evictions, applied with the publication. */
int kvp__append_layer(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                      kvp__append_tx *tx);

/* ---- the device path (pages/device_cuda.c; CUDA builds) -------------------
 * An append on a CUDA region collects one device job per block write, by
 * binding, and runs them at the end of the layer: the RAW-tail groups first
 * (an OPEN block's rows reach its pages before its reseal reads them), then
 * the layer's codecs, all on the caller's stream, then reads the status
 * words back once (the only wait of an append): a non-finite input or a
 * value out of a codec's range fails the append before anything is
 * published. */
typedef struct kvp__dev_batch kvp__dev_batch; /* incomplete without CUDA: stream.c passes NULL */
#ifdef KVP_HAVE_CUDA
typedef struct kvp__dev_group {
  const kvp__binding *bd; /* the binding the jobs run with, or NULL (empty) */
  int kv;                 /* side */
  kvp_codec_dev_job *jobs; /* [cap] */
  void **hstates;         /* [cap]: each job's stream state in host memory, or NULL (qvg bindings only) */
  uint32_t n, cap;        /* jobs held, allocated */
} kvp__dev_group;
struct kvp__dev_batch {
  kvp__dev_group g[4];    /* RAW tail K, RAW tail V, codec K, codec V (launch order) */
  uint32_t cap;           /* jobs per group at most */
  kvp__meta *meta;        /* where the job arrays are counted (NULL: a reader's scratch) */
};
void kvp__dev_batch_init(kvp__dev_batch *db, uint32_t max_jobs_per_group, kvp__meta *meta);
int kvp__dev_batch_add(kvp_pool *pool, kvp__dev_batch *db, const kvp__binding *bd, int kv, const kvp_codec_dev_job *j);
/* The same, for a job whose codec keeps stream state (qvg): hstate is the
 * stream's host state the device encode starts from and rewrites. */
int kvp__dev_batch_add_state(kvp_pool *pool, kvp__dev_batch *db, const kvp__binding *bd, int kv,
                             const kvp_codec_dev_job *j, void *hstate);
/* Run every group on stream, wait for it, check the status words (errors
 * name layer, head, position and the step's token, pos = the step's first
 * position). */
int kvp__dev_batch_run(kvp_pool *pool, kvp__dev_batch *db, uint32_t layer, uint32_t pos, void *stream);
void kvp__dev_batch_fini(kvp_pool *pool, kvp__dev_batch *db);
/* A copy inside the region on stream, from the pool's device (a moved
 * row-wise block's rows, enqueued before the batch that appends to it). */
int kvp__dev_region_copy(kvp_pool *pool, uint64_t dst_off, uint64_t src_off, uint64_t bytes, void *stream);
/* Reads: decode jobs, launched by group when one fills and at the flush
 * (enqueued only: kvp_read returns before the device finished). */
int kvp__dev_read_add(kvp_pool *pool, kvp__dev_batch *db, const kvp__binding *bd, int kv, const kvp_codec_dev_job *j,
                      kvp_dtype out, void *stream);
int kvp__dev_read_flush(kvp_pool *pool, kvp__dev_batch *db, kvp_dtype out, void *stream);
/* The paged gather's table (kvp_gather in pages/read.c walks, this builds
 * and runs): one kvp__gjob (kernels/kernels.h) per (block, head) in walk
 * order, tagged with its layer segment and group (segment * 4 + 0 codec or
 * 1 RAW tail, for K; V's binding is the tag + 2); a segment is a distinct
 * layer of the call, at most KVP__GATHER_SEGMENTS. Built in the pool's
 * pinned stage when it is free and large enough (else on the heap), copied
 * to the caller's workspace in one transfer, decoded in one launch. */
#define KVP__GATHER_SEGMENTS 128u
typedef struct kvp__dev_gather {
  const kvp_gather_req *req; /* the call */
  kvp__gjob *recs;           /* [cap]: the table */
  uint64_t n, cap;           /* records held, allocated */
  bool staged;               /* recs is the pool's pinned stage (its lock held) */
  uint32_t *seg_of_layer;    /* [n_layers]: segment of a layer, UINT32_MAX before its first item */
  uint32_t seg_layer[KVP__GATHER_SEGMENTS]; /* layer of each segment */
  uint32_t nseg;             /* segments */
  uint32_t nragged;          /* items whose heads fill different row counts */
  uint32_t ragged[2][64];    /* their (row0, n_rows), the first 64 (beyond: every row is zeroed first) */
} kvp__dev_gather;
/* Record r: rows [a, e) of head's block b (pages as 64-byte units), output
 * row, binding tag. */
void kvp__gjob_fill(kvp__gjob *r, const kvp__block *b, uint32_t head, uint32_t a, uint32_t e, uint32_t row,
                    uint16_t tag);
int kvp__dev_gather_begin(kvp_pool *pool, kvp__dev_gather *g, const kvp_gather_req *req);
/* The segment of layer (item i for the message); KVP_EINVAL past the limit. */
int kvp__dev_gather_segment(kvp__dev_gather *g, uint32_t layer, uint32_t item);
/* The next record of the table; NULL when out of memory. */
kvp__gjob *kvp__dev_gather_slot(kvp_pool *pool, kvp__dev_gather *g);
/* Rows [row0, row0 + n) have heads that fill fewer rows: zeroed first. */
void kvp__dev_gather_ragged(kvp__dev_gather *g, uint32_t row0, uint32_t n);
int kvp__dev_gather_run(kvp_pool *pool, kvp__dev_gather *g);
void kvp__dev_gather_end(kvp_pool *pool, kvp__dev_gather *g);
/* Room in g's table for need_bytes, its first used_bytes kept (bytes, for
 * tables of other records than kvp__gjob: the attention's); ENOMEM. */
int kvp__dev_gather_reserve(kvp_pool *pool, kvp__dev_gather *g, uint64_t used_bytes, uint64_t need_bytes);
struct kvp__atable;
/* Decode attention (pages/attend.c builds, this runs): the first
 * table_bytes of g's records (records, splits, split index) copied to
 * a->recs in one transfer, then kernels/attend.cu's launches. A kept
 * table read in place (t->tab_dev) is read where it is, records, splits
 * and index (g holds nothing), and t->done is recorded after the kernels. */
int kvp__dev_attend_run(kvp_pool *pool, kvp__dev_gather *g, uint64_t table_bytes, const kvp__attend_args *a,
                        void *stream, const struct kvp__atable *t);
/* A kept attention table's pinned memory (read in place by the kernels),
 * its address on the device (kvp__dev_mapped), and the event of the last
 * work that reads it; NULL without a device or memory.
 * kvp__dev_event_free waits for the event first; kvp__dev_event_wait
 * ignores errors (a failed record leaves the event as it was: done). */
void *kvp__dev_kept_alloc(kvp_pool *pool, uint64_t bytes);
void *kvp__dev_mapped(kvp_pool *pool, void *host);
void kvp__dev_kept_free(kvp_pool *pool, void *p, uint64_t bytes);
void *kvp__dev_event_new(kvp_pool *pool);
void kvp__dev_event_free(kvp_pool *pool, void *ev);
void kvp__dev_event_wait(void *ev);
/* pages/attend_table.c: the attention's block table, built on the host
 * (any pool with 64-byte aligned pages: a CUDA region, or a dry one). */
typedef struct kvp__abuf {
  unsigned char *p;   /* the table's bytes, 16-byte aligned */
  uint64_t cap_bytes; /* their size */
  /* make room for need bytes, the first used kept (p and cap_bytes
   * updated); KVP_OK or KVP_ENOMEM; NULL: the buffer cannot grow */
  int (*grow)(struct kvp__abuf *buf, uint64_t used, uint64_t need);
  void *ctx;          /* grow's */
} kvp__abuf;
typedef struct kvp__atable {
  /* in */
  uint32_t layer;        /* the layer attended */
  const uint64_t *seqs;  /* [batch] sequence ids */
  uint32_t batch;        /* sequences */
  uint32_t kind;         /* the kernel kind (kvp__kern_attend_kind): its records */
  uint32_t split_tokens; /* tokens per split; 0: the smallest size whose splits fit in slots */
  uint32_t slots;        /* thread blocks the device runs at once (split_tokens 0) */
  /* out */
  uint32_t nrec, nsplit, nslot; /* records, splits, partial-result slots */
  uint64_t off_splits, off_bh;  /* bytes: where the splits and the split index begin */
  uint64_t table_bytes;         /* bytes of the whole table */
  uint64_t token_heads;         /* (token, KV head) pairs recorded */
  uint64_t bytes_read;          /* page bytes the kernel reads */
  /* a kept table read in place (kvp__attend_build_kept): its records
   * (recs_dev) and its splits and index (tab_dev, the index at off_bh;
   * off_splits 0) are pinned host memory at these device addresses, and
   * the buffer given holds nothing; the kept table stays held, unchanged,
   * until kvp__attend_kept_release, and done must be recorded after the
   * last work that reads them. NULL otherwise. */
  const void *recs_dev, *tab_dev;
  void *done;
  void *hold;
} kvp__atable;
/* The kernels' parameters of layer's four bindings (K codec, K tail, V
 * codec, V tail); KVP_ENOTSUP names a codec the kernel cannot read. */
int kvp__attend_bindings(kvp_pool *pool, uint32_t layer, kvp__kparams kp[4]);
/* Build t's table at buf->p (grown through buf->grow); under
 * kvp__rcu_read_lock, which must be held while the table is used (its
 * pages stay valid until then). KVP_ENOENT names a sequence that does not
 * exist, KVP_EINVAL a batch or table too large, KVP_ENOMEM. */
int kvp__attend_build(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf);
/* pages/attend_kept.c: the same table, through the layer's kept table
 * while the pool's structure count stands: the records at the streams'
 * ends redone, those of new blocks added, the sequences new to the batch or
 * changed walked alone (an O(batch x heads + new blocks + new sequences'
 * blocks) call, not one walk of every block); else built and kept (raw
 * and per-token quantized record forms; sequences without shared chunks;
 * at most 256 MiB or 1/64 of the region a pool, records and metadata:
 * kept_bound). *hit: whether the kept table served. Any pool
 * kvp__attend_build takes. */
int kvp__attend_build_kept(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf, bool *hit);
/* Let go of the kept table t holds (t->hold), after its work is enqueued. */
void kvp__attend_kept_release(kvp_pool *pool, kvp__atable *t);
/* The kept tables' memory (pool destroy). */
void kvp__attend_kept_fini(kvp_pool *pool);
/* Device and pinned host bytes the control block holds (stats). */
void kvp__dev_control_bytes(const kvp_pool *pool, uint64_t *device_bytes, uint64_t *pinned_bytes);
/* Streaming multiprocessors of the pool's device (for splitting work). */
uint32_t kvp__dev_sm_count(const kvp_pool *pool);
/* Attention thread blocks the device runs at once for a layer of these
 * bindings (SMs x blocks per SM of its kernel). */
uint32_t kvp__dev_attend_slots(const kvp_pool *pool, const kvp__kparams p[4]);
/* The device control block of a CUDA pool (status words); 0 or an error. */
int kvp__dev_init(kvp_pool *pool);
void kvp__dev_fini(kvp_pool *pool);
/* The store tier's pinned staging (pages/xfer_cuda.c): its bytes, and its
 * end (waits for copies in flight) at pool destroy. */
uint64_t kvp__xfer_pinned_bytes(const kvp_pool *pool);
void kvp__xfer_fini(kvp_pool *pool);
#endif
/* Readers (under rcu_read_lock): visit each (block, token range [a, e))
 * that head retains in (s, layer), in position order, at most limit tokens;
 * fn returns nonzero to stop. Returns the tokens visited. */
typedef int (*kvp__range_fn)(void *ctx, kvp__block *b, uint32_t a, uint32_t e);
uint64_t kvp__walk_ranges(kvp__seq *s, const kvp_pool *pool, uint32_t layer, uint32_t head, uint64_t limit,
                          kvp__range_fn fn, void *ctx);

/* pages/rowwise.c: appends to layers whose K and V codecs build blocks row
 * by row (open_layout/encode_rows): no RAW tail, OPEN blocks grow. */
static inline bool kvp__bind_rowwise(const kvp__binding *b) { return b->vt->open_layout && b->vt->encode_rows; }
/* Host code can read the rows the pool's blocks hold: not a dry pool (no
 * rows) nor a CUDA region (rows on the device). Row-wise codecs are asked
 * their open layouts with pages = NULL otherwise. */
static inline bool kvp__rows_on_host(const kvp_pool *p) {
  return !(p->cfg.flags & KVP_POOL_DRY) && p->cfg.memory == KVP_MEM_HOST;
}
static inline bool kvp__layer_rowwise(const kvp_pool *p, uint32_t layer) {
  return kvp__bind_rowwise(&p->bind[2 * layer]) && kvp__bind_rowwise(&p->bind[2 * layer + 1]);
}
int kvp__append_rowwise(kvp_pool *pool, kvp__seq *s, uint32_t layer, const kvp_kv *kv, const uint64_t *skip,
                        kvp__append_tx *tx);

/* pages/pool.c: codec bindings from the spec. */
int kvp__bindings_init(kvp_pool *pool, const char *spec);
/* For tests/fuzz/fuzz_codec_spec.c: build the bindings of spec for the
 * pool's geometry and check them as kvp_pool_create does (instances,
 * layouts, block sizes, the fit to the appended dtypes), then drop them;
 * the pool keeps its own. Status and message as create's. */
int kvp__bindings_try(kvp_pool *pool, const char *spec);
void kvp__bindings_fini(kvp_pool *pool);

#endif /* KVP_PAGES_H */
