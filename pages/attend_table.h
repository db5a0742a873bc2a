/*
 * pages/attend_table.h - what the block table's build (pages/attend_table.c)
 * and its kept tables (pages/attend_kept.c) share: the record forms and the
 * code that writes a record, a walk's cursor, a (sequence, head)'s last
 * record, and the steps of a build each file calls. Internal to those two.
 */
#ifndef KVP_PAGES_ATTEND_TABLE_H
#define KVP_PAGES_ATTEND_TABLE_H

#include "pages.h"

#ifdef KVP_HAVE_CUDA

#include <stddef.h>
#include <string.h>

enum { FORM_RAW, FORM_Q, FORM_GJOB };
#define FORM_BYTES(form) \
  ((form) == FORM_RAW ? sizeof(kvp__arec_raw) : (form) == FORM_Q ? sizeof(kvp__arec_q) : sizeof(kvp__gjob))
static inline int form_of(uint32_t rb) {
  return rb == sizeof(kvp__arec_raw) ? FORM_RAW : rb == sizeof(kvp__arec_q) ? FORM_Q : FORM_GJOB;
}
static inline uint32_t m1_at_of(int form) {
  return form == FORM_RAW ? offsetof(kvp__arec_raw, m1) : form == FORM_Q ? offsetof(kvp__arec_q, m1)
                                                                           : offsetof(kvp__gjob, m1);
}
/* Tokens of record r (its m1 + 1; m1 at byte m1_at of rb-byte records). */
static inline uint32_t rec_tokens(const unsigned char *recs, uint32_t rb, uint32_t m1_at, uint32_t r) {
  uint16_t m1;
  memcpy(&m1, recs + (size_t)r * rb + m1_at, sizeof m1);
  return m1 + 1u;
}

#define ALWAYS_INLINE inline __attribute__((always_inline))

typedef struct cursor {
  unsigned char *dst;   /* the next record */
  unsigned char *lim;   /* the end of the records that fit */
  uint64_t whole_bytes; /* page bytes of records that read their whole block */
  double part_bytes;    /* the share of the others' */
  const kvp__block *lb; /* the last record's block, run and tokens [la, le) (a kept table's tail) */
  const kvp__run *lr;
  const kvp__bref *lref; /* the last record's bref where the walk knows it, else NULL */
  uint32_t la, le;
  uint32_t lnb;         /* records of lb at the end (more than one where runs meet inside it) */
} cursor;


/* 8 bytes of the table. (Streaming stores, which skip reading the lines
 * first, measured no faster: the walk is bound by its reads.) */
static ALWAYS_INLINE void store8(unsigned char *dst, uint64_t v) { memcpy(dst, &v, sizeof v); }
static ALWAYS_INLINE void store16(unsigned char *dst, uint64_t lo, uint64_t hi) {
  store8(dst, lo);
  store8(dst + 8, hi);
}

/* Page i of side kv in 64-byte units, or KVP__GJOB_NO_PAGE. */
static ALWAYS_INLINE uint32_t page64(const kvp__block *b, int kv, unsigned i) {
  return i < b->npages[kv] ? (uint32_t)(KVP__PG(b, i)[kv].off / 64) : KVP__GJOB_NO_PAGE;
}

/* Requested bytes of a side's pages (branches, not a loop: the counts are
 * the same block after block, and pages past them lie in lines not read). */
static ALWAYS_INLINE uint64_t side_bytes(const kvp__block *b, int kv) {
  unsigned np = b->npages[kv];
  uint64_t n = 0;
  if (np > 0) {
    n = b->pg0[kv].requested_bytes;
    if (KVP__UNLIKELY(np > 1)) {
      n += KVP__PG(b, 1)[kv].requested_bytes;
      for (unsigned i = 2; i < np; i++) n += KVP__PG(b, i)[kv].requested_bytes;
    }
  }
  return n;
}

_Static_assert(sizeof(kvp__arec_raw) == 16 && offsetof(kvp__arec_raw, t0) == 8 && offsetof(kvp__arec_raw, m1) == 10,
               "kvp__arec_raw as put() writes it");
_Static_assert(sizeof(kvp__arec_q) == 32 && offsetof(kvp__arec_q, t0) == 24 && offsetof(kvp__arec_q, m1) == 26 &&
                   offsetof(kvp__arec_q, cap1) == 28 && offsetof(kvp__arec_q, tag) == 30,
               "kvp__arec_q as put() writes it");
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "records are written as little-endian words");
_Static_assert(offsetof(kvp__block, pg0[1].requested_bytes) + 4 <= 64 && offsetof(kvp__block, pgx) % 64 == 0 &&
                   sizeof(kvp__page[2]) == 64,
               "a block's first pages in its first line, each further row in a line of its own (pages.h)");

/* Bytes the kernel reads for a record of m of b's tokens: the block's
 * requested bytes when it reads all, else their share (what bytes_read sums). */
static ALWAYS_INLINE void rec_bytes_of(const kvp__block *b, uint32_t m, uint64_t *whole, double *part) {
  uint64_t req = side_bytes(b, 0) + side_bytes(b, 1);
  if (KVP__LIKELY(m == b->cap_tokens)) *whole += req;
  else *part += (double)req * m / b->cap_tokens;
}

/* Bytes (rec_bytes_of) of the nb records of block b that end at record
 * last (whose tokens those records hold). */
static inline void group_bytes(const unsigned char *recs, uint32_t rb, uint32_t last, uint32_t nb, const kvp__block *b,
                               uint64_t *whole, double *part) {
  uint32_t m1_at = m1_at_of(form_of(rb));
  for (uint32_t i = 0; i < nb; i++) rec_bytes_of(b, rec_tokens(recs, rb, m1_at, last - i), whole, part);
}

/* The record of tokens [a, e) of b at c->dst (room checked). The compact
 * records go out as 8-byte words (kvp__arec_raw, kvp__arec_q: little-endian
 * fields, no padding but arec_raw's zero pad). */
static ALWAYS_INLINE void put(cursor *c, const kvp__block *b, uint32_t head, uint32_t a, uint32_t e, const int form) {
  uint32_t p0 = b->pos0, cap = b->cap_tokens, m = e - a; /* cap <= KVP__MAX_BLOCK_TOKENS: 16-bit fields */
  uint64_t t0 = a - p0, m1 = m - 1;
  rec_bytes_of(b, m, &c->whole_bytes, &c->part_bytes);
  if (form == FORM_RAW) { /* page[2]; t0, m1; pad */
    store16(c->dst, page64(b, 0, 0) | (uint64_t)page64(b, 1, 0) << 32, t0 | m1 << 16);
  } else if (form == FORM_Q) { /* page[2][3]; t0, m1, cap1, tag */
    store16(c->dst, page64(b, 0, 0) | (uint64_t)page64(b, 0, 1) << 32,
            page64(b, 0, 2) | (uint64_t)page64(b, 1, 0) << 32);
    store16(c->dst + 16, page64(b, 1, 1) | (uint64_t)page64(b, 1, 2) << 32,
            t0 | m1 << 16 | (uint64_t)(cap - 1) << 32 | (uint64_t)b->raw << 48);
  } else {
    kvp__gjob r;
    for (int kv = 0; kv < 2; kv++)
      for (unsigned i = 0; i < KVP_CODEC_MAX_PAGES; i++) r.page[kv][i] = page64(b, kv, i);
    r.row = 0, r.pos0 = p0, r.head = (uint16_t)head, r.tag = (uint16_t)(b->raw ? 1 : 0);
    r.t0 = (uint16_t)t0, r.m1 = (uint16_t)m1, r.n1 = (uint16_t)(kvp__block_n(b) - 1), r.cap1 = (uint16_t)(cap - 1);
    memcpy(c->dst, &r, sizeof r);
  }
  c->dst += FORM_BYTES(form);
}

static inline uint32_t run_end(const kvp__run *r) { return atomic_load_explicit(&r->p1, memory_order_acquire); }


/* A (sequence, head)'s last record: tokens [a, e) of block b in run r (b
 * NULL: no record), b's bref where the walk knew it (else NULL), the
 * records of b at the end (nb: more than one where runs meet inside b) and
 * the bytes they add to bytes_read (whole, part: rec_bytes_of); what a
 * kept table redoes (kvp__attend_build_kept). bw, bp: the bytes of all
 * the (sequence, head)'s records. */
typedef struct atail {
  const kvp__block *b;
  const kvp__run *r;
  const kvp__bref *ref;
  uint32_t a, e, nb;
  uint64_t w, bw;
  double p, bp;
} atail;

/* A kept table's sequence: where it is, its serial (kvp__seq_find finds
 * it by its id while it lives), its structure generation and the tail
 * generation of the layer, both read before its walk (KVP__TGEN_NONE: odd
 * then, matched by none). */
typedef struct aseq {
  kvp__seq *s;
  uint64_t serial, sgen, tgen;
} aseq;
#define KVP__TGEN_NONE UINT64_MAX


/* The ends of the kept table's last splits, bh's from split0[bh]: where
 * kvp__atab_finish's search may look first (the same splits). */
typedef struct split_hint {
  const uint32_t *split0, *end;
} split_hint;

static inline uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* The steps of a build (pages/attend_table.c). */
/* Room for need bytes of buf of which the first used are kept; ENOMEM. */
int kvp__atab_reserve(kvp__abuf *buf, uint64_t used, uint64_t need);
/* t's layer, batch and the pool's region as the table can address them. */
int kvp__atab_check(const kvp_pool *pool, const kvp__atable *t);
/* t's outputs zeroed. */
void kvp__atab_reset(kvp__atable *t);
/* The records of t's batch at buf->p: recs_at[0 .. nbh] (the end too),
 * tok_of[bh]; tails and seqs (or NULL): each bh's last record and each
 * sequence; *shared: a sequence held shared chunks; *c the cursor after
 * them. */
int kvp__atab_walk(kvp_pool *pool, const kvp__atable *t, kvp__abuf *buf, uint32_t rb, uint32_t *recs_at,
                   uint64_t *tok_of, atail *tails, aseq *seqs, bool *shared, cursor *c);
/* The splits and the split index after the nbuf records at buf->p (none:
 * a kept table's read in place), and t's outputs; recs_at, ends, tok_of:
 * kvp__atab_walk's, or a kept table's (its indices: records placed
 * elsewhere, pre given, and the caller moves the splits to where it put
 * them). bh_split0: nbh + 1 scratch. */
int kvp__atab_finish(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf, uint32_t rb, const uint32_t *recs_at,
                     const uint32_t *ends, const uint64_t *tok_of, const uint32_t *pre, const split_hint *hint,
                     uint32_t *bh_split0, uint64_t bytes_read, uint32_t nbuf);
/* kvp__atab_walk, then kvp__atab_finish over what it wrote: a fresh build. */
int kvp__atab_build(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf, uint32_t rb, uint32_t *recs_at, uint64_t *tok_of,
                    atail *tails, aseq *seqs, uint32_t *bh_split0, bool *shared);

#endif
#endif
