/*
 * stats/stats.h - counting: per-tag counters of page bytes, and the emitters
 * (JSON, Prometheus, text) generated from KVP_STATS_LIST in kvpool.h.
 *
 * Every page carries a tag; each alloc/free adds/subtracts its requested and
 * allocated bytes in the cells its tag names (two grids and its sequence's
 * slot), so each breakdown, a sum of cells, sums to the ledger's totals. Counters are written by the writer only (relaxed
 * atomics) and read from any thread.
 */
#ifndef KVP_STATS_H
#define KVP_STATS_H

#include "../util/rcu.h"
#include "../util/util.h"

#include <string.h>

#define KVP__MAX_CODECS 64u /* codec ids 0..63 */

/* Where a page's bytes are counted: 16 bytes. */
typedef struct kvp__tag {
  uint64_t seq;      /* sequence id */
  uint16_t layer;    /* layer */
  uint16_t head;     /* KV head */
  uint8_t type;      /* kvp_page_type */
  uint8_t kv;        /* 0 = K, 1 = V */
  uint16_t codec;    /* codec id < KVP__MAX_CODECS */
} kvp__tag;

/* A tag from its fields, its last five written as one 64-bit word: the
 * allocation fast path copies a tag by two 8-byte moves, and a wide load of
 * bytes that narrower stores have just written waits for them to leave the
 * core (a store-forwarding stall, about 10 cycles on each copy). */
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "a tag's fields are packed as a little-endian word");
_Static_assert(sizeof(kvp__tag) == 16 && offsetof(kvp__tag, layer) == 8 && offsetof(kvp__tag, head) == 10 &&
                   offsetof(kvp__tag, type) == 12 && offsetof(kvp__tag, kv) == 13 && offsetof(kvp__tag, codec) == 14,
               "the layout kvp__tag_make packs");
static inline kvp__tag kvp__tag_make(uint64_t seq, uint16_t layer, uint16_t head, uint8_t type, uint8_t kv,
                                     uint16_t codec) {
  uint64_t w = (uint64_t)layer | (uint64_t)head << 16 | (uint64_t)type << 32 | (uint64_t)kv << 40 |
               (uint64_t)codec << 48;
  kvp__tag t;
  t.seq = seq;
  memcpy((unsigned char *)&t + offsetof(kvp__tag, layer), &w, sizeof w);
  return t;
}

typedef struct kvp__usage {
  _Atomic uint64_t requested_bytes; /* sum over live pages */
  _Atomic uint64_t allocated_bytes; /* sum over live pages */
  _Atomic uint64_t npages;          /* live pages */
} kvp__usage;

/* One entry of the per-sequence table (open addressing, linear probing).
 * A slot's key is written once, before used is set (release), and never
 * changes while the table lives: lock-free readers see a slot either free
 * or holding its final key. */
typedef struct kvp__seq_usage {
  _Atomic uint64_t seq; /* key */
  _Atomic bool used;    /* slot holds a key (tombstones are used with 0 pages) */
  _Atomic uint32_t ver; /* sequence lock over u: odd while the writer moves it */
  kvp__usage u;         /* its usage: read it with kvp__seq_usage_read */
} kvp__seq_usage;

/* The per-sequence table: replaced as a whole when it grows (RCU: readers
 * load st->seqt under kvp__rcu_read_lock; the old table is freed after a
 * grace period). */
typedef struct kvp__seq_table {
  kvp__rcu_head rcu;     /* deferred free */
  kvp__meta *meta;       /* counter its bytes are charged to */
  uint32_t cap;          /* slots, a power of two */
  kvp__seq_usage slot[]; /* [cap] */
} kvp__seq_table;

/* The five fixed dimensions are counted in two grids of cells, so that a
 * page moves two cells (and its sequence's slot) rather than five: kinds
 * by (codec, K/V, page type), places by (layer, head). A slice of one
 * dimension (page type 3, layer 7, ...) is the sum of its row or column
 * (kvp__stats_slice), read off the hot path. */
#define KVP__STATS_KINDS (KVP__MAX_CODECS * 2u * KVP_PAGE_TYPE_COUNT) /* cells of the kind grid */
static inline uint32_t kvp__stats_kind(uint32_t codec, uint32_t kv, uint32_t type) {
  return (codec * 2 + kv) * KVP_PAGE_TYPE_COUNT + type;
}

/* A hint of a sequence's slot (below). */
#define KVP__SEQ_HINTS_LG 13u
#define KVP__SEQ_HINTS (1u << KVP__SEQ_HINTS_LG)
typedef struct kvp__seq_hint {
  uint64_t seq;         /* the sequence (0 when empty) */
  kvp__seq_usage *slot; /* its claimed slot in the current table, or NULL (empty) */
} kvp__seq_hint;

typedef struct kvp__stats {
  kvp__meta *meta;                           /* metadata counter */
  uint32_t n_layers, n_heads;                /* sizes of the grid of places */
  kvp__usage *kinds;                         /* [KVP__STATS_KINDS]: by kvp__stats_kind(codec, kv, type) */
  kvp__usage *places;                        /* [n_layers * n_heads]: by layer * n_heads + head */
  kvp__seq_table *seqt;                      /* per-sequence table (RCU pointer; writer lock to change) */
  uint32_t seq_used;                         /* used slots (live and tombstone) */
  bool seq_deferred;                         /* an old table waits for a grace period (barrier at fini) */
  kvp__seq_usage *seq_last;                  /* slot of the last sequence probed for, or NULL */
  kvp__seq_hint seq_hint[KVP__SEQ_HINTS];    /* slots of sequences counted lately, by kvp__seq_hint_of(seq):
                                                claimed slots of seqt, whose keys never change while it lives
                                                (emptied when it is rebuilt); in the struct, so a hint is one load
                                                from it */
} kvp__stats;

/* In front of the table, the slot of the last sequence probed for (one
 * compare: calls for one sequence in a row), then the slots of the
 * sequences counted lately, direct-mapped with their keys, so that an
 * engine's calls for many sequences in turn (a batch's decode, a free of
 * another sequence's page) count in their slot without a probe of the
 * table: one compare of the key in the hint, whose miss touches no slot.
 * 8192 hints, so that each sequence of a batch of up to 8192 with ids in a
 * row has its own (with 1024, kvpool-bench's 8192-sequence row missed 7
 * calls in 8 and paid a probe and a hint's store for each): 128 KiB of
 * metadata, in the struct. */
static inline uint32_t kvp__seq_hint_of(uint64_t seq) { /* ids in a row: entries in a row */
  return (uint32_t)(seq ^ seq >> KVP__SEQ_HINTS_LG ^ seq >> 2 * KVP__SEQ_HINTS_LG) & (KVP__SEQ_HINTS - 1);
}
/* The tag's slot if the hints have it, else NULL. Writer lock. */
static inline kvp__seq_usage *kvp__stats_seq_hinted(const kvp__stats *st, uint64_t seq) {
  kvp__seq_usage *e = st->seq_last;
  if (KVP__LIKELY(e && atomic_load_explicit(&e->seq, memory_order_relaxed) == seq)) return e;
  const kvp__seq_hint *h = &st->seq_hint[kvp__seq_hint_of(seq)];
  return KVP__LIKELY(h->seq == seq) ? h->slot : NULL; /* an empty hint of sequence 0: NULL too */
}

int kvp__stats_init(kvp__stats *st, uint32_t n_layers, uint32_t n_heads, kvp__meta *meta);
void kvp__stats_fini(kvp__stats *st);
/* Make sure the tag's sequence has a slot, so the counting that follows
 * cannot fail, and hint it. KVP_ENOMEM. Writer lock. Inline: a hinted
 * sequence is one compare. */
int kvp__stats_reserve_seq_slow(kvp__stats *st, uint64_t seq);
static inline int kvp__stats_reserve_seq(kvp__stats *st, uint64_t seq) {
  if (KVP__LIKELY(kvp__stats_seq_hinted(st, seq) != NULL)) return KVP_OK;
  return kvp__stats_reserve_seq_slow(st, seq);
}
/* The slot of a sequence that has one (reserved), found by a probe of the
 * table, as the last one and hinted. Writer lock. */
kvp__seq_usage *kvp__stats_seq_slot(kvp__stats *st, uint64_t seq);

/* Single writer (the pool's writer lock): a relaxed load and store, plain
 * moves on x86-64, instead of a locked read-modify-write; readers still see
 * whole values. */
static inline __attribute__((always_inline)) void kvp__usage_move(kvp__usage *u, uint64_t dreq, uint64_t dalloc,
                                                                  uint64_t dpages) {
  atomic_store_explicit(&u->requested_bytes, atomic_load_explicit(&u->requested_bytes, memory_order_relaxed) + dreq,
                        memory_order_relaxed);
  atomic_store_explicit(&u->allocated_bytes, atomic_load_explicit(&u->allocated_bytes, memory_order_relaxed) + dalloc,
                        memory_order_relaxed);
  atomic_store_explicit(&u->npages, atomic_load_explicit(&u->npages, memory_order_relaxed) + dpages,
                        memory_order_relaxed);
}

/* Count a page in (sign +1) or out (-1) in every dimension of its tag
 * (_in: e, its sequence's slot, found already). The sequence slot must
 * exist (reserve first). Inline, so that a constant
 * sign folds: the deltas are added modulo 2^64. Cost: 6 loads and stores
 * for the two grid cells, 3 (and 2 of its sequence lock) for the last
 * sequence's slot (one compare if hinted; a probe of the table otherwise). */
static inline __attribute__((always_inline)) void kvp__stats_count_in(kvp__stats *st, kvp__seq_usage *e,
                                                                      const kvp__tag *tag, uint64_t requested_bytes,
                                                                      uint64_t allocated_bytes, int sign) {
  uint64_t neg = sign > 0 ? 0 : ~0ull; /* two's complement: (x ^ neg) - neg is x or -x */
  uint64_t dreq = (requested_bytes ^ neg) - neg, dalloc = (allocated_bytes ^ neg) - neg, dpages = (1 ^ neg) - neg;
  kvp__usage_move(&st->kinds[kvp__stats_kind(tag->codec, tag->kv, tag->type)], dreq, dalloc, dpages);
  kvp__usage_move(&st->places[(uint32_t)tag->layer * st->n_heads + tag->head], dreq, dalloc, dpages);
  uint32_t v = atomic_load_explicit(&e->ver, memory_order_relaxed); /* readers see all three move or none */
  atomic_store_explicit(&e->ver, v + 1, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
  kvp__usage_move(&e->u, dreq, dalloc, dpages);
  atomic_store_explicit(&e->ver, v + 2, memory_order_release);
}
static inline __attribute__((always_inline)) void kvp__stats_count(kvp__stats *st, const kvp__tag *tag,
                                                                   uint64_t requested_bytes, uint64_t allocated_bytes,
                                                                   int sign) {
  kvp__seq_usage *e = kvp__stats_seq_hinted(st, tag->seq);
  if (KVP__UNLIKELY(!e)) e = kvp__stats_seq_slot(st, tag->seq);
  kvp__stats_count_in(st, e, tag, requested_bytes, allocated_bytes, sign);
}
/* Read one usage into the public struct. */
void kvp__usage_read(const kvp__usage *u, kvp_usage *out);
/* One slice of a fixed dimension (KVP_DIM_PAGE_TYPE, KV, CODEC, LAYER,
 * HEAD; index in range): the sum of its cells. Lock-free (relaxed loads:
 * like any lock-free read of the counters, not one instant's). */
void kvp__stats_slice(const kvp__stats *st, kvp_stats_dim dim, uint32_t index, kvp_usage *out);
/* The slot of a sequence, or NULL. Writer lock, or inside
 * kvp__rcu_read_lock (the pointer is valid until the unlock). */
const kvp__seq_usage *kvp__stats_seq(const kvp__stats *st, uint64_t seq);
/* A consistent copy of a sequence slot's three figures (its sequence lock:
 * retries while the writer is between them). Lock-free. */
void kvp__seq_usage_read(const kvp__seq_usage *e, kvp_usage *out);
/* The n sequences with the most allocated bytes (ties: lower id first),
 * largest first, into out[0..*n_out). Lock-free (takes the RCU read lock);
 * out doubles as the heap, nothing is allocated. */
int kvp__stats_top_seqs(const kvp__stats *st, uint32_t n, kvp_seq_usage *out, uint32_t *n_out);
/* Accumulator for checks: a plain (non-atomic) copy of every dimension. */
typedef struct kvp__stats_sum {
  kvp_usage page_types[KVP_PAGE_TYPE_COUNT], kv[2], codecs[KVP__MAX_CODECS];
  kvp_usage *layers, *heads, *seqs; /* [n_layers], [n_heads], [seqt->cap]: slot of the table */
  uint64_t unknown_seq;             /* a page whose sequence has no slot (0 = none) */
  bool has_unknown_seq;             /* unknown_seq is meaningful */
} kvp__stats_sum;
int kvp__stats_sum_init(const kvp__stats *st, kvp__stats_sum *s); /* KVP_ENOMEM */
void kvp__stats_sum_fini(const kvp__stats *st, kvp__stats_sum *s);
void kvp__stats_sum_add(const kvp__stats *st, kvp__stats_sum *s, const kvp__tag *tag, uint64_t requested_bytes,
                        uint64_t allocated_bytes);
/* Compare an independently derived sum with the counters. KVP_ECORRUPT names
 * the first dimension and index that differ. */
int kvp__stats_compare(const kvp__stats *st, const kvp__stats_sum *s);

/* Emitters (stats/emit.c). The caller provides the snapshot and a callback
 * for breakdowns of variable size. */
typedef struct kvp__emit_src {
  const kvp_stats *s;       /* scalar figures and fixed breakdowns */
  const kvp__stats *st;     /* per-layer/head/codec/seq counters */
  const char *(*codec_name)(uint32_t id); /* name of a codec id, or NULL if none is registered */
} kvp__emit_src;
int kvp__stats_emit(const kvp__emit_src *src, kvp_stats_format fmt, char *buf, size_t cap, size_t *len);

#endif /* KVP_STATS_H */
