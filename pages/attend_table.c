/*
 * pages/attend_table.c - the block table of kvp_attend_decode (pages/attend.c
 * runs it): built on the host from the RCU page tables, into a buffer the
 * caller owns, exactly as the device reads it.
 *
 * Any pool whose pages are 64-byte aligned builds it (a CUDA region, also a
 * dry one, which has no device), so the host part can be run and measured
 * where no GPU is (tools/kvpool-prof-attend.c, tests/unit/check_attend.c).
 *
 * The table (offsets from the buffer's start; rb = the kernel kind's
 * record, kvp__kern_attend_rec_bytes: kvp__arec_raw, kvp__arec_q or
 * kvp__gjob):
 *
 *   0            nrec records of rb bytes, bh = b * H + h in order, each
 *                bh's in position order (one per retained range of a block)
 *   nrec * rb    zeros up to off_splits (a multiple of 16)
 *   off_splits   nsplit kvp__asplit
 *   off_bh       nbh + 1 uint32: bh's first split (bh_split0), then nsplit
 *   table_bytes
 *
 * except for a kept table read in place (t->tab_dev): its records stay in
 * the kept table's pinned memory, and its splits and index (off_splits = 0)
 * are written to the kept table's pinned tab, not to the buffer given.
 *
 * Invariants: sum over bh's records of (m1 + 1) = the tokens head h of
 * seqs[b] retains in the layer = tok(bh); token_heads = sum of tok(bh).
 * bh's splits are consecutive runs of its records that cover them in order,
 * at least one (a head with no token has one split of no record); a split's
 * slot is KVP__ASPLIT_ONLY when it is bh's only one, else the next of
 * 0 .. nslot - 1 in split order.
 */
#include "../codecs/builtin.h"
#include "pages.h"

#ifdef KVP_HAVE_CUDA

#include <stddef.h>
#include <string.h>

/* Auto split size: as many splits as the device runs thread blocks of the
 * layer's kernel at once (one wave: a second, partial one would cost a
 * whole block's time), at least this many tokens each (fewer leave the
 * merge dominant). */
#define SPLIT_MIN_TOKENS 64u

int kvp__attend_bindings(kvp_pool *pool, uint32_t layer, kvp__kparams kp[4]) {
  const kvp__binding *bd[4] = {&pool->bind[2 * layer], &pool->tail[0], &pool->bind[2 * layer + 1], &pool->tail[1]};
  for (int i = 0; i < 4; i++)
    if (kvp__codec_kparams(bd[i]->vt, bd[i]->inst, &kp[i]))
      return kvp__err(KVP_ENOTSUP, "attend: layer %u %c: codec %s has no in-kernel reader", layer, "KV"[i / 2],
                      bd[i]->vt->name);
  return KVP_OK;
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* Room for need bytes of which the first used are kept; ENOMEM. */
static int reserve(kvp__abuf *buf, uint64_t used, uint64_t need) {
  if (need <= buf->cap_bytes) return KVP_OK;
  if (buf->grow && buf->grow(buf, used, need) == KVP_OK && need <= buf->cap_bytes) return KVP_OK;
  return kvp__err(KVP_ENOMEM, "attention block table of %llu bytes", (unsigned long long)need);
}

/* ---- the walk ---------------------------------------------------------------
 * One walk over each (sequence, KV head)'s runs and blocks writes the
 * records in the kernel's form (no kvp__gjob first, no compaction after),
 * counts their tokens and the bytes the kernel reads. It is instantiated
 * per record form (FORM_* constants through always_inline), so a record is
 * straight-line code: a few loads from the block's first line (position,
 * capacity, page counts, the first pages of K and of V; the next line for
 * second pages: pages.h), its words stored; the walk's state stays in
 * registers (a local cursor: the stores into the table, through unsigned
 * char, could otherwise alias it). Memory, not instructions, bounds it:
 * a sequence's heads are walked in passes that keep many loads in flight
 * (below). A sequence that holds shared prefix chunks walks its blocks
 * through kvp__bwalk (pages.h) instead. Both visit what kvp__walk_ranges
 * visits, in its order. */
enum { FORM_RAW, FORM_Q, FORM_GJOB };
#define FORM_BYTES(form) \
  ((form) == FORM_RAW ? sizeof(kvp__arec_raw) : (form) == FORM_Q ? sizeof(kvp__arec_q) : sizeof(kvp__gjob))
static int form_of(uint32_t rb) {
  return rb == sizeof(kvp__arec_raw) ? FORM_RAW : rb == sizeof(kvp__arec_q) ? FORM_Q : FORM_GJOB;
}
static uint32_t m1_at_of(int form) {
  return form == FORM_RAW ? offsetof(kvp__arec_raw, m1) : form == FORM_Q ? offsetof(kvp__arec_q, m1)
                                                                           : offsetof(kvp__gjob, m1);
}
/* Tokens of record r (its m1 + 1; m1 at byte m1_at of rb-byte records). */
static inline uint32_t rec_tokens(const unsigned char *recs, uint32_t rb, uint32_t m1_at, uint32_t r) {
  uint16_t m1;
  memcpy(&m1, recs + (size_t)r * rb + m1_at, sizeof m1);
  return m1 + 1u;
}
/* Blocks read ahead: about 16 lines in flight (kvpool-prof-attend measures
 * 16 raw blocks, one line each, and 8 of two lines best). */
#define PREFETCH_LINES 16
#define PREFETCH_MOST PREFETCH_LINES
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

/* Room for more records (buf grows, those written kept); *rc. */
static cursor __attribute__((noinline)) cursor_grow(kvp__abuf *buf, cursor c, uint32_t rb, int *rc) {
  uint64_t used = (uint64_t)(c.dst - buf->p);
  if ((*rc = reserve(buf, used, used + rb + used / 2))) return c;
  kvp__assert((uintptr_t)buf->p % 16 == 0);
  c.dst = buf->p + used;
  c.lim = buf->p + buf->cap_bytes / rb * rb;
  return c;
}

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
static void group_bytes(const unsigned char *recs, uint32_t rb, uint32_t last, uint32_t nb, const kvp__block *b,
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

static uint32_t run_end(const kvp__run *r) { return atomic_load_explicit(&r->p1, memory_order_acquire); }

/* The lines of b a record reads: the first (position, capacity, page
 * counts, the first page of K and of V: pages.h), and one for each further
 * page index the layer's codecs use (lines: 1 for raw records). */
static ALWAYS_INLINE void prefetch_block(const kvp__block *b, uint32_t lines, const int form) {
  __builtin_prefetch(b);
  if (form == FORM_RAW) return;
  for (uint32_t i = 1; i < lines; i++) __builtin_prefetch(&KVP__PG(b, i)[0]);
}

/* The record of tokens [a, e) of b (run r, bref ref or NULL) at c, room
 * made first; its tokens added to *t, and noted as the cursor's last (a
 * kept table's tail). What every walk writes per (block, run) overlap. */
static ALWAYS_INLINE int record(kvp__abuf *buf, cursor *c, const kvp__block *b, const kvp__run *r,
                                const kvp__bref *ref, uint32_t head, uint32_t a, uint32_t e, uint64_t *t,
                                const int form) {
  if (KVP__UNLIKELY(c->dst == c->lim)) {
    int rc;
    *c = cursor_grow(buf, *c, FORM_BYTES(form), &rc);
    if (rc) return rc;
  }
  put(c, b, head, a, e, form);
  c->lnb = b == c->lb ? c->lnb + 1 : 1;
  c->lb = b, c->lr = r, c->lref = ref, c->la = a, c->le = e;
  *t += e - a;
  return KVP_OK;
}

/* A sequence without shared chunks: its runs' ends are loaded first, once
 * (with acquire: every block a run covers is linked by then, and an attach
 * that published holds before them shows), then each head's blocks are
 * merged with its runs into records, in one of two ways that keep many
 * loads in flight:
 *  - where a stream's brefs lie close together, as a step's appends
 *    allocate them (sequence_is_close), they are followed as they come, the
 *    blocks some brefs ahead prefetched (walk_brefs): the
 *    hardware runs ahead on the brefs;
 *  - where they lie apart (other streams appended between them, as decode
 *    steps do), one list allows one load at a time (each next waits for the
 *    last): every head's list is followed at once, round-robin, its blocks
 *    noted per head (collect), then each head's blocks are read from that
 *    array, prefetched some blocks ahead (independent loads:
 *    walk_blocks). */
typedef struct srun {
  const kvp__run *r; /* the run (its head mask) */
  uint32_t p0, p1;   /* its positions, the end loaded once */
} srun;
typedef struct seq_scratch {
  srun *runs;                 /* [runs_cap] */
  uint32_t runs_cap;
  const kvp__block **blk;     /* [H * per]: head h's k-th block at h * per + k */
  uint64_t per;
  const kvp__bref **cur;      /* [H]: each head's next bref */
  const kvp__bref **last;     /* [H]: each head's last bref (collect) */
  uint32_t *nblk;             /* [H]: each head's blocks */
  uint32_t H;
  uint32_t lines;             /* a block's lines a record reads (prefetch_block) */
  uint32_t ahead;             /* blocks prefetched ahead: PREFETCH_LINES / lines */
} seq_scratch;

static int scratch_init(seq_scratch *x, uint32_t H, uint32_t lines) {
  memset(x, 0, sizeof *x);
  x->H = H;
  x->lines = lines;
  x->ahead = PREFETCH_LINES / lines;
  x->cur = kvp__meta_alloc(NULL, H * (2 * sizeof *x->cur + sizeof *x->nblk));
  if (!x->cur) return kvp__err(KVP_ENOMEM, "attend scratch for %u heads", H);
  x->last = x->cur + H;
  x->nblk = (uint32_t *)(x->last + H);
  return KVP_OK;
}

static void scratch_fini(seq_scratch *x) {
  kvp__meta_free(NULL, x->cur, x->H * (2 * sizeof *x->cur + sizeof *x->nblk));
  kvp__meta_free(NULL, x->runs, x->runs_cap * sizeof *x->runs);
  kvp__meta_free(NULL, x->blk, x->per * x->H * sizeof *x->blk);
}

/* The runs of L and their ends; *n. */
static int snap_runs(seq_scratch *x, const kvp__layer *L, uint32_t *n) {
  uint32_t k = 0;
  for (const kvp__run *run = kvp__rcu_deref(L->runs); run; run = kvp__rcu_deref(run->next), k++) {
    if (k == x->runs_cap) {
      uint32_t cap = x->runs_cap ? 2 * x->runs_cap : 16;
      srun *na = kvp__meta_realloc(NULL, x->runs, x->runs_cap * sizeof *na, cap * sizeof *na);
      if (!na) return kvp__err(KVP_ENOMEM, "attend scratch: %u runs", cap);
      x->runs = na, x->runs_cap = cap;
    }
    x->runs[k] = (srun){run, run->p0, run_end(run)};
  }
  *n = k;
  return KVP_OK;
}

/* Room for k + 1 blocks a head and PREFETCH_MOST more (the first k of
 * each kept). */
static int blk_grow(seq_scratch *x, uint64_t k) {
  uint64_t per = x->per ? 2 * x->per : 1024, H = x->H;
  const kvp__block **na = kvp__meta_realloc(NULL, x->blk, x->per * H * sizeof *na, per * H * sizeof *na);
  if (!na) return kvp__err(KVP_ENOMEM, "attend scratch: %llu block pointers", (unsigned long long)(per * H));
  for (uint64_t h = H; h-- > 1;) memmove(na + h * per, na + h * x->per, k * sizeof *na);
  x->blk = na, x->per = per;
  return KVP_OK;
}

/* Every head's blocks of layer l of s, their bref lists followed together;
 * each head's last block repeated PREFETCH_MOST times after it (what
 * walk_blocks prefetches past the end). */
static int collect(seq_scratch *x, const kvp_pool *pool, kvp__seq *s, uint32_t l) {
  uint32_t H = x->H, live = 0;
  const kvp__bref **cur = x->cur;
  for (uint32_t h = 0; h < H; h++) {
    cur[h] = kvp__rcu_deref(kvp__seq_stream(pool, s, l, h)->blocks);
    x->nblk[h] = 0;
    live += cur[h] != NULL;
  }
  uint64_t k = 0;
  for (; live; k++) {
    int rc;
    if (k + PREFETCH_MOST >= x->per && (rc = blk_grow(x, k))) return rc;
    const kvp__block **col = x->blk + k;
    uint64_t per = x->per;
    for (uint32_t h = 0; h < H; h++) {
      const kvp__bref *r = cur[h];
      if (!r) continue;
      col[h * per] = kvp__rcu_deref(r->blk);
      cur[h] = kvp__rcu_deref(r->next);
      if (!cur[h]) x->nblk[h] = (uint32_t)k + 1, x->last[h] = r, live--;
    }
  }
  for (uint32_t h = 0; h < H; h++) {
    const kvp__block **v = x->blk + h * x->per;
    for (uint32_t i = 0, n = x->nblk[h]; n && i < PREFETCH_MOST; i++) v[n + i] = v[n - 1];
  }
  return KVP_OK;
}

/* Head's records: its blocks (collect's) merged with the runs that retain
 * it (both in position order). *tok: their tokens. */
static ALWAYS_INLINE int walk_blocks(kvp__abuf *buf, cursor *cp, const seq_scratch *x, uint32_t nruns, uint32_t head,
                                     uint64_t *tok, const int form) {
  cursor c = *cp;
  uint32_t n = x->nblk[head], i = 0;
  const kvp__block *const *v = x->blk + head * x->per;
  uint32_t lines = form == FORM_RAW ? 1 : x->lines, ahead = form == FORM_RAW ? PREFETCH_LINES : x->ahead;
  for (uint32_t k = 0; k < ahead && n; k++) prefetch_block(v[k], lines, form);
  uint64_t t = 0;
  for (uint32_t k = 0; k < nruns && i < n; k++) {
    if (!kvp__run_has(x->runs[k].r, head)) continue;
    uint32_t ra = x->runs[k].p0, re = x->runs[k].p1;
    for (; i < n; i++) {
      prefetch_block(v[i + ahead], lines, form); /* (collect pads past n) */
      const kvp__block *b = v[i];
      uint32_t p0 = b->pos0, be = p0 + b->cap_tokens;
      if (p0 >= re) break; /* the next run's */
      if (be <= ra) continue;
      int rc = record(buf, &c, b, x->runs[k].r, i + 1 == n ? x->last[head] : NULL, head, ra > p0 ? ra : p0,
                      re < be ? re : be, &t, form);
      if (rc) return rc;
      if (be > re) break; /* the next run may begin inside it */
    }
  }
  *cp = c;
  *tok = t;
  return KVP_OK;
}

/* Head's records from its stream's brefs as they come (one pass: cheaper
 * than collect and walk_blocks where the hardware follows the brefs). */
static ALWAYS_INLINE int walk_brefs(kvp__abuf *buf, cursor *cp, const seq_scratch *x, uint32_t nruns,
                                    const kvp__stream *st, uint32_t head, uint64_t *tok, const int form) {
  cursor c = *cp;
  const kvp__bref *r = kvp__rcu_deref(st->blocks), *pf = r;
  uint32_t lines = form == FORM_RAW ? 1 : x->lines, ahead = form == FORM_RAW ? PREFETCH_LINES : x->ahead;
  for (uint32_t i = 0; pf && i < ahead; i++) pf = kvp__rcu_deref(pf->next);
  uint64_t t = 0;
  for (uint32_t k = 0; k < nruns && r; k++) {
    if (!kvp__run_has(x->runs[k].r, head)) continue;
    uint32_t ra = x->runs[k].p0, re = x->runs[k].p1;
    for (; r; r = kvp__rcu_deref(r->next)) {
      if (pf) {
        prefetch_block(kvp__rcu_deref(pf->blk), lines, form);
        pf = kvp__rcu_deref(pf->next);
      }
      const kvp__block *b = kvp__rcu_deref(r->blk);
      uint32_t p0 = b->pos0, be = p0 + b->cap_tokens;
      if (p0 >= re) break; /* the next run's */
      if (be <= ra) continue;
      int rc = record(buf, &c, b, x->runs[k].r, r, head, ra > p0 ? ra : p0, re < be ? re : be, &t, form);
      if (rc) return rc;
      if (be > re) break; /* the next run may begin inside it */
    }
  }
  *cp = c;
  *tok = t;
  return KVP_OK;
}

/* Do the brefs of s's first stream of layer l lie close together (most of
 * the first 16 within 512 bytes after the one before, as a step's appends
 * allocate them)? Then walk_brefs, else collect and walk_blocks. */
static bool sequence_is_close(const kvp_pool *pool, kvp__seq *s, uint32_t l) {
  const kvp__bref *r = kvp__rcu_deref(kvp__seq_stream(pool, s, l, 0)->blocks);
  int n = 0, close = 0;
  for (const kvp__bref *nx; r && n < 16 && (nx = kvp__rcu_deref(r->next)); r = nx, n++)
    close += (uintptr_t)nx - (uintptr_t)r <= 512;
  return 2 * close >= n;
}

/* Head's records through kvp__bwalk, for a sequence that holds shared
 * chunks (kvp__walk_ranges's loop, which loads the runs as it goes). */
static ALWAYS_INLINE int walk_shared(kvp__abuf *buf, cursor *cp, const kvp_pool *pool, const kvp__seq *s,
                                     const kvp__layer *L, uint32_t layer, uint32_t head, uint64_t *tok,
                                     const int form) {
  cursor c = *cp;
  kvp__bwalk bw;
  kvp__bwalk_init(&bw, pool, s, layer * pool->cfg.n_kv_heads + head);
  uint64_t t = 0;
  for (const kvp__run *run = kvp__rcu_deref(L->runs); run; run = kvp__rcu_deref(run->next)) {
    if (!kvp__run_has(run, head)) continue;
    uint32_t ra = run->p0, re = run_end(run);
    for (kvp__block *b; (b = kvp__bwalk_peek(&bw)) && b->pos0 < re;) {
      uint32_t be = b->pos0 + b->cap_tokens;
      if (be > ra) {
        int rc = record(buf, &c, b, run, NULL, head, ra > b->pos0 ? ra : b->pos0, re < be ? re : be, &t, form);
        if (rc) return rc;
        if (be > re) break;
      }
      kvp__bwalk_pass(&bw, b);
    }
  }
  *cp = c;
  *tok = t;
  return KVP_OK;
}

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

/* Every (sequence, head) of the batch: recs_at[bh] (bh's first record) and
 * tok_of[bh]; *c after the last record. tails (or NULL): each bh's last
 * record, and seqs[b] each sequence; *shared: a sequence held shared
 * chunks (its records come from kvp__bwalk, no tail noted). */
static ALWAYS_INLINE int walk_batch(kvp__abuf *buf, cursor *c, seq_scratch *x, kvp_pool *pool, const kvp__atable *t,
                                    uint32_t *recs_at, uint64_t *tok_of, atail *tails, aseq *seqs, bool *shared_any,
                                    const int form) {
  uint32_t H = pool->cfg.n_kv_heads;
  for (uint32_t b = 0; b < t->batch; b++) {
    kvp__seq *s = kvp__seq_find(pool, t->seqs[b]);
    if (!s)
      return kvp__err(KVP_ENOENT, "attend: seqs[%u]: sequence %llu does not exist", b, (unsigned long long)t->seqs[b]);
    const kvp__layer *L = &s->layers[t->layer];
    if (seqs) { /* before the runs' ends: a change of the ends after this shows as another value */
      uint64_t sg = atomic_load_explicit(&s->sgen, memory_order_acquire),
               g = atomic_load_explicit(&L->tgen, memory_order_acquire);
      seqs[b] = (aseq){s, s->serial, sg & 1 ? KVP__TGEN_NONE : sg, g & 1 ? KVP__TGEN_NONE : g};
    }
    uint32_t nruns;
    int rc = snap_runs(x, L, &nruns);
    /* holds are published before the positions they cover (an attach), and stay once set */
    bool shared = kvp__rcu_deref(s->holds) != NULL, close = !shared && sequence_is_close(pool, s, t->layer);
    *shared_any = *shared_any || shared;
    if (!rc && !shared && !close) rc = collect(x, pool, s, t->layer);
    for (uint32_t h = 0; !rc && h < H; h++) {
      uint64_t n = (uint64_t)(c->dst - buf->p) / FORM_BYTES(form);
      if (n >= UINT32_MAX / 2) return kvp__err(KVP_EINVAL, "attend: the batch's block table passes 2^31 records");
      recs_at[b * H + h] = (uint32_t)n;
      uint64_t *tok = &tok_of[b * H + h];
      c->lb = NULL;
      uint64_t w0 = c->whole_bytes;
      double p0 = c->part_bytes;
      rc = shared  ? walk_shared(buf, c, pool, s, L, t->layer, h, tok, form)
           : close ? walk_brefs(buf, c, x, nruns, kvp__seq_stream(pool, s, t->layer, h), h, tok, form)
                   : walk_blocks(buf, c, x, nruns, h, tok, form);
      if (tails) {
        atail *tl = &tails[b * H + h];
        *tl = (atail){c->lb, c->lr, c->lref, c->la, c->le, c->lnb, 0, c->whole_bytes - w0, 0, c->part_bytes - p0};
        if (c->lb)
          group_bytes(buf->p, FORM_BYTES(form), (uint32_t)((uint64_t)(c->dst - buf->p) / FORM_BYTES(form)) - 1, c->lnb,
                      c->lb, &tl->w, &tl->p);
      }
    }
    if (rc) return rc;
  }
  return KVP_OK;
}

static int walk_raw(kvp__abuf *buf, cursor *c, seq_scratch *x, kvp_pool *p, const kvp__atable *t, uint32_t *at,
                    uint64_t *tok, atail *tails, aseq *sq, bool *sh) {
  return walk_batch(buf, c, x, p, t, at, tok, tails, sq, sh, FORM_RAW);
}
static int walk_q(kvp__abuf *buf, cursor *c, seq_scratch *x, kvp_pool *p, const kvp__atable *t, uint32_t *at,
                  uint64_t *tok, atail *tails, aseq *sq, bool *sh) {
  return walk_batch(buf, c, x, p, t, at, tok, tails, sq, sh, FORM_Q);
}
static int walk_gjob(kvp__abuf *buf, cursor *c, seq_scratch *x, kvp_pool *p, const kvp__atable *t, uint32_t *at,
                     uint64_t *tok, atail *tails, aseq *sq, bool *sh) {
  return walk_batch(buf, c, x, p, t, at, tok, tails, sq, sh, FORM_GJOB);
}

/* ---- splits ----------------------------------------------------------------- */

/* The end of the split that begins at record r0 < end, as make_splits'
 * scan finds it, from prefix sums instead of the records: pre[x] the
 * tokens of bh's records before x (x < end), total all of them. The scan
 * stops at the first r > r0 where 2 (pre[r] + m_r) > 2 target + m_r, that
 * is pre[r] + pre[r + 1] > 2 target (pre[end] = total): increasing in r, so
 * a binary search gives the same r. */
static uint32_t split_end(const uint32_t *pre, uint32_t r0, uint32_t end, uint64_t total, uint64_t target) {
  uint32_t lo = r0 + 1, hi = end; /* the answer lies in [lo, hi]; hi = end: none stops it */
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    uint64_t next = mid + 1 < end ? pre[mid + 1] : total;
    if ((uint64_t)pre[mid] + next > 2 * target) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

/* Whether h is split_end's answer (its condition holds at h or h = end,
 * and not at h - 1 unless h - 1 = r0): O(1), where a decode step leaves
 * most splits where they were. */
static bool split_is_end(const uint32_t *pre, uint32_t r0, uint32_t end, uint64_t total, uint64_t target, uint32_t h) {
  if (h <= r0 || h > end) return false;
  if (h < end && (uint64_t)pre[h] + (h + 1 < end ? pre[h + 1] : total) <= 2 * target) return false;
  return h - 1 == r0 || (uint64_t)pre[h - 1] + (h < end ? pre[h] : total) <= 2 * target;
}

/* Splits of the table: recs_at[bh] .. ends[bh] are bh's records (ends =
 * recs_at + 1 where they lie end to end; a kept table leaves room after
 * each bh's), tok_of[bh] their tokens. Writes them at out, bh's first at bh_split0[bh],
 * and returns their number (at most splits_bound's); *slots: the
 * partial-result slots used. A bh of one split (most: those of at most
 * chunk tokens) takes all its records unread; the others' are read once,
 * or, given pre (a kept table's prefix sums: split_end), not at all; hint
 * (or NULL) the ends of the kept table's last splits, bh's from
 * hint->split0[bh]: the i-th split's end there is taken where split_is_end
 * says it is the answer, the search made otherwise (the same splits). */
typedef struct split_hint {
  const uint32_t *split0, *end;
} split_hint;
static uint32_t make_splits(const unsigned char *recs, uint32_t rb, uint32_t m1_at, const uint32_t *recs_at,
                            const uint32_t *ends, const uint64_t *tok_of, const uint32_t *pre, const split_hint *hint,
                            uint32_t nbh, uint32_t chunk, kvp__asplit *out, uint32_t *bh_split0, uint32_t *slots) {
  uint32_t n = 0, nslot = 0;
  for (uint32_t bh = 0; bh < nbh; bh++) {
    uint32_t first = n, r = recs_at[bh], end = ends[bh];
    uint64_t total = tok_of[bh];
    /* at most ceil(total / chunk) splits of about equal tokens (whole
     * records): split k ends at the record boundary nearest to k + 1 parts
     * of the tokens, so the count is what wave_chunk planned for (one
     * split more than the device holds at once would cost a second wave) */
    uint64_t parts = total ? (total + chunk - 1) / chunk : 1, cum = 0;
    bh_split0[bh] = n;
    if (parts == 1) { /* the target is the total: every record */
      out[n++] = (kvp__asplit){r, end - r, bh, KVP__ASPLIT_ONLY};
      continue;
    }
    do {
      uint32_t r0 = r;
      uint64_t target = total * (n - first + 1) / parts;
      if (pre) {
        uint32_t i = hint ? hint->split0[bh] + (n - first) : 0,
                 h = hint && i < hint->split0[bh + 1] ? hint->end[i] : 0;
        r = h && split_is_end(pre, r0, end, total, target, h) ? h : split_end(pre, r0, end, total, target);
      } else {
        for (; r < end; r++) {
          uint64_t m = rec_tokens(recs, rb, m1_at, r);
          if (r != r0 && 2 * (cum + m) > 2 * target + m) break;
          cum += m;
        }
      }
      out[n++] = (kvp__asplit){r0, r - r0, bh, 0};
    } while (r < end);
    for (uint32_t s = first; s < n; s++) out[s].slot = n - first > 1 ? nslot + (s - first) : KVP__ASPLIT_ONLY;
    if (n - first > 1) nslot += n - first;
  }
  bh_split0[nbh] = n;
  *slots = nslot;
  return n;
}

/* Splits make_splits can write: per bh at most one per part and one per
 * record, one at least. */
static uint64_t splits_bound(const uint32_t *recs_at, const uint32_t *ends, const uint64_t *tok_of, uint32_t nbh,
                             uint32_t chunk) {
  uint64_t n = 0;
  for (uint32_t bh = 0; bh < nbh; bh++) {
    uint64_t parts = tok_of[bh] ? (tok_of[bh] + chunk - 1) / chunk : 1, nr = ends[bh] - recs_at[bh];
    n += parts < nr ? parts : nr ? nr : 1;
  }
  return n;
}

/* The split size (tokens, >= SPLIT_MIN_TOKENS) for a device of slots
 * thread blocks at once: the smallest whose splits, ceil(bh's tokens /
 * size) per (sequence, KV head), fit in one wave of slots (or, with more
 * bh than slots, one split per bh). With more bh than slots and heads of
 * unequal lengths (the longest above 5/4 of the mean: per-head evictions,
 * a batch of mixed contexts), at most a quarter of each slot's share: the
 * device runs each slot's splits one after another, taking the next as one
 * ends, and whole heads of unequal lengths, about two a slot, leave some
 * slots far behind the others (a simulation of that order over HeatKV's
 * b = 0.1 pattern of kvpool-bench-gpu: 1.46x the mean slot's work with one
 * split a head, 1.17x with quarters); heads of equal lengths fill the
 * slots evenly as they are. */
static uint64_t wave_chunk(const uint64_t *tok_of, uint32_t nbh, uint64_t tokens, uint32_t slots) {
  uint32_t device = slots;
  if (slots < nbh) slots = nbh;
  uint64_t ch = (tokens + slots - 1) / slots;
  if (ch < SPLIT_MIN_TOKENS) ch = SPLIT_MIN_TOKENS;
  for (int it = 0; it < 8; it++) {
    uint64_t n = 0, most = 0;
    for (uint32_t bh = 0; bh < nbh; bh++) {
      uint64_t t = tok_of[bh];
      n += t ? (t + ch - 1) / ch : 1;
      if (t > most) most = t;
    }
    if (n <= slots || ch >= most) break;
    ch = ch * n / slots + 1; /* fewer, longer splits */
  }
  if (device && nbh > device) {
    uint64_t most = 0, quarter = (tokens + 4ull * device - 1) / (4ull * device);
    for (uint32_t bh = 0; bh < nbh; bh++) most = tok_of[bh] > most ? tok_of[bh] : most;
    if (4 * most * nbh > 5 * tokens && quarter < ch) ch = quarter < SPLIT_MIN_TOKENS ? SPLIT_MIN_TOKENS : quarter;
  }
  return ch;
}

static int table_check(const kvp_pool *pool, const kvp__atable *t) {
  if (pool->alloc.page_align_bytes % 64)
    return kvp__err(KVP_ENOTSUP, "attend: the pool's pages are %llu-byte aligned; its block table addresses 64-byte "
                    "units (a CUDA region's, also a dry one's)", (unsigned long long)pool->alloc.page_align_bytes);
  if (pool->alloc.region.bytes > (64ull << 32))
    return kvp__err(KVP_ENOTSUP, "attend: the region of %llu bytes passes the 256 GiB its block table addresses",
                    (unsigned long long)pool->alloc.region.bytes);
  if (t->layer >= pool->cfg.n_layers)
    return kvp__err(KVP_EINVAL, "attend: layer %u >= n_layers %u", t->layer, pool->cfg.n_layers);
  if ((uint64_t)t->batch * pool->cfg.n_kv_heads >= UINT32_MAX)
    return kvp__err(KVP_EINVAL, "attend: batch %u x %u KV heads is too many", t->batch, pool->cfg.n_kv_heads);
  return KVP_OK;
}


/* The records of t's batch at buf->p: recs_at[0 .. nbh] (the end too),
 * tok_of[bh]; tails, seqs and *shared as walk_batch's; *c the cursor after
 * them. */
static int table_walk(kvp_pool *pool, const kvp__atable *t, kvp__abuf *buf, uint32_t rb, uint32_t *recs_at,
                      uint64_t *tok_of, atail *tails, aseq *seqs, bool *shared, cursor *c) {
  uint32_t H = pool->cfg.n_kv_heads, nbh = t->batch * H;
  int form = form_of(rb);
  kvp__assert(form != FORM_GJOB || rb == sizeof(kvp__gjob));
  kvp__assert((uintptr_t)buf->p % 16 == 0);
  *c = (cursor){buf->p, buf->p + buf->cap_bytes / rb * rb, 0, 0, NULL, NULL, NULL, 0, 0, 0};
  *shared = false;
  /* the lines a record reads: one per page index of the layer's codecs (a RAW tail has one page a side) */
  uint32_t lines = 1;
  for (int kv = 0; kv < 2; kv++) {
    const kvp__binding *bd = &pool->bind[2 * t->layer + kv];
    kvp_codec_layout lay;
    kvp__bind_layout(bd, 0, kvp__layer_bt(pool, t->layer, KVP_SEQ_STREAM), &lay);
    if (lay.npages > lines) lines = lay.npages;
  }
  seq_scratch x;
  int rc = scratch_init(&x, H, lines > KVP_CODEC_MAX_PAGES ? KVP_CODEC_MAX_PAGES : lines);
  if (!rc)
    rc = form == FORM_RAW ? walk_raw(buf, c, &x, pool, t, recs_at, tok_of, tails, seqs, shared)
         : form == FORM_Q ? walk_q(buf, c, &x, pool, t, recs_at, tok_of, tails, seqs, shared)
                          : walk_gjob(buf, c, &x, pool, t, recs_at, tok_of, tails, seqs, shared);
  scratch_fini(&x);
  if (!rc) recs_at[nbh] = (uint32_t)((uint64_t)(c->dst - buf->p) / rb);
  return rc;
}

/* The splits and the split index after the nbuf records at buf->p (none:
 * a kept table's read in place), and t's outputs; recs_at, ends, tok_of:
 * table_walk's, or a kept table's (its indices: records placed elsewhere,
 * pre given, and the caller moves the splits to where it put them).
 * bh_split0: nbh + 1 scratch. */
static int table_finish(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf, uint32_t rb, const uint32_t *recs_at,
                        const uint32_t *ends, const uint64_t *tok_of, const uint32_t *pre, const split_hint *hint,
                        uint32_t *bh_split0, uint64_t bytes_read, uint32_t nbuf) {
  uint32_t nbh = t->batch * pool->cfg.n_kv_heads, nrec = 0, nslot;
  uint64_t tokens = 0;
  for (uint32_t bh = 0; bh < nbh; bh++) tokens += tok_of[bh], nrec += ends[bh] - recs_at[bh];
  uint64_t ch = t->split_tokens;
  if (!ch) ch = wave_chunk(tok_of, nbh, tokens, t->slots);
  uint32_t chunk = ch > UINT32_MAX ? UINT32_MAX : (uint32_t)ch;
  uint64_t rec_bytes = (uint64_t)nbuf * rb, off_splits = align_up(rec_bytes, 16),
           idx_bytes = (nbh + 1) * 4ull;
  uint64_t most = off_splits + splits_bound(recs_at, ends, tok_of, nbh, chunk) * sizeof(kvp__asplit) + idx_bytes;
  int rc = reserve(buf, rec_bytes, most);
  if (rc) return rc;
  unsigned char *p = buf->p;
  memset(p + rec_bytes, 0, off_splits - rec_bytes);
  uint32_t nsplit = make_splits(pre ? NULL : p, rb, m1_at_of(form_of(rb)), recs_at, ends, tok_of, pre, hint, nbh, chunk,
                                (kvp__asplit *)(p + off_splits), bh_split0, &nslot);
  t->nrec = nrec, t->nsplit = nsplit, t->nslot = nslot;
  t->off_splits = off_splits;
  t->off_bh = off_splits + (uint64_t)nsplit * sizeof(kvp__asplit);
  t->table_bytes = t->off_bh + idx_bytes;
  t->token_heads = tokens, t->bytes_read = bytes_read;
  memcpy(p + t->off_bh, bh_split0, idx_bytes);
  return KVP_OK;
}

static void table_reset(kvp__atable *t) {
  t->nrec = t->nsplit = t->nslot = 0;
  t->off_splits = t->off_bh = t->table_bytes = t->token_heads = t->bytes_read = 0;
  t->recs_dev = t->tab_dev = NULL, t->done = NULL, t->hold = NULL;
}

int kvp__attend_build(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf) {
  table_reset(t);
  int rc = table_check(pool, t);
  if (rc) return rc;
  uint32_t nbh = t->batch * pool->cfg.n_kv_heads, rb = kvp__kern_attend_rec_bytes(t->kind);
  /* scratch: each bh's first record (and the end), each bh's tokens, each bh's first split (and the end) */
  size_t scratch = (size_t)(nbh + 1) * 2 * sizeof(uint32_t) + (size_t)nbh * sizeof(uint64_t);
  uint64_t *tok_of = kvp__meta_alloc(NULL, scratch);
  if (!tok_of) return kvp__err(KVP_ENOMEM, "attend scratch for a batch of %u", t->batch);
  uint32_t *recs_at = (uint32_t *)(tok_of + nbh), *bh_split0 = recs_at + nbh + 1;
  cursor c;
  bool shared;
  rc = table_walk(pool, t, buf, rb, recs_at, tok_of, NULL, NULL, &shared, &c);
  if (!rc)
    rc = table_finish(pool, t, buf, rb, recs_at, recs_at + 1, tok_of, NULL, NULL, bh_split0,
                      c.whole_bytes + (uint64_t)c.part_bytes, recs_at[nbh]);
  kvp__meta_free(NULL, tok_of, scratch);
  return rc;
}

/* ---- the kept tables ---------------------------------------------------------
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

/* The records of a walk (recs, end to end: recs_at[0 .. n]) of n bhs into
 * new regions of k from k->used on (room after each, zeros), entered as
 * bhs at[i] (tok_of, tails: the walk's); false, k unchanged, when k has
 * no room for them. */
static bool kept_place(kvp__acache *k, const unsigned char *recs, uint32_t rb, const uint32_t *recs_at, uint32_t n,
                       const uint32_t *at, const uint64_t *tok_of, const atail *tails) {
  uint64_t need = 0, slots = k->recs_cap / rb < k->pre_cap ? k->recs_cap / rb : k->pre_cap;
  for (uint32_t i = 0; i < n; i++) need += recs_at[i + 1] - recs_at[i] + room_of(recs_at[i + 1] - recs_at[i]);
  if (k->used + need > slots) return false;
  uint32_t m1_at = m1_at_of(form_of(rb)), u = k->used;
  for (uint32_t i = 0; i < n; i++) {
    uint32_t bh = at[i], nr = recs_at[i + 1] - recs_at[i], room = room_of(nr), acc = 0;
    if (nr) memcpy(k->recs + (size_t)u * rb, recs + (size_t)recs_at[i] * rb, (size_t)nr * rb);
    memset(k->recs + (size_t)(u + nr) * rb, 0, (size_t)room * rb);
    for (uint32_t r = 0; r < nr; r++) k->pre[u + r] = acc, acc += rec_tokens(recs, rb, m1_at, recs_at[i] + r);
    memset(k->pre + u + nr, 0, room * sizeof *k->pre);
    k->recs_at[bh] = u, k->rend[bh] = u + nr, k->rlim[bh] = u + nr + room;
    k->tok_of[bh] = tok_of[i], k->tails[bh] = tails[i];
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
  uint32_t *at = kvp__meta_alloc(NULL, nbh * sizeof *at + 1);
  if (!at) return false;
  for (uint32_t bh = 0; bh < nbh; bh++) at[bh] = bh;
  bool ok = kept_place(k, recs, rb, recs_at, nbh, at, tok_of, tails);
  kvp__meta_free(NULL, at, nbh * sizeof *at + 1);
  if (!ok) return false;
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

/* The n regions at[i] .. lim[i] (records to end[i], room after; at[i] =
 * UINT32_MAX: none) moved to the front of k's records, in their order
 * there, with their prefix sums; k->used after them. The others' (the
 * sequences that left) are given back. */
static void kept_compact(kvp__acache *k, uint32_t rb, uint32_t *at, uint32_t *end, uint32_t *lim, uint32_t n,
                         uint32_t *order) {
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
               : table_walk(pool, &w, &wb, rb, wrec, wtok, wtl, wsq, &shared, &c);
    if (!rc && shared) rc = -1;
    if (!rc) {
      for (uint32_t i = 0; i < nw; i++) {
        nsq[wpos[i]] = wsq[i];
        for (uint32_t h = 0; h < H; h++) wat[i * H + h] = wpos[i] * H + h;
      }
      /* placed straight into k (its new regions lie past every region the new batch keeps); short of
       * room, the regions kept are moved together first (those of the sequences that left given back) */
      uint32_t used = k->used;
      bool placed = kept_place(k, wb.p, rb, wrec, nw * H, wat, wtok, wtl);
      if (!placed) {
        kept_compact(k, rb, nat, nend, nlim, nbh, order);
        placed = kept_place(k, wb.p, rb, wrec, nw * H, wat, wtok, wtl);
        used = k->used; /* the regions moved: no way back (rc -1 drops k) */
      }
      if (!placed) rc = -1;
      for (uint32_t i = 0; !rc && i < nw * H; i++) { /* what kept_place entered, moved to the new arrays */
        uint32_t n = wat[i];
        nat[n] = k->recs_at[n], nend[n] = k->rend[n], nlim[n] = k->rlim[n], ntok[n] = k->tok_of[n], ntl[n] = k->tails[n];
      }
      if (rc) k->used = used;
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
  table_reset(t);
  int rc = table_check(pool, t);
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
    if (served && (in_place || !(rc = reserve(buf, 0, (uint64_t)nbuf * rb)))) {
      for (uint32_t bh = 0; !in_place && bh < nbh; bh++)
        memcpy(buf->p + (size_t)recs_at[bh] * rb, k->recs + (size_t)k->recs_at[bh] * rb,
               (size_t)(k->rend[bh] - k->recs_at[bh]) * rb);
      split_hint h = {k->hint0, k->hint_end};
      rc = table_finish(pool, t, out, rb, k->recs_at, k->rend, k->tok_of, k->pre, k->hinted ? &h : NULL, bh_split0,
                        whole + (uint64_t)part, nbuf);
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
    cursor c;
    bool shared;
    rc = table_walk(pool, t, buf, rb, recs_at, tok_of, tails, sq, &shared, &c);
    if (!rc)
      rc = table_finish(pool, t, buf, rb, recs_at, recs_at + 1, tok_of, NULL, NULL, bh_split0,
                        c.whole_bytes + (uint64_t)c.part_bytes, recs_at[nbh]);
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
