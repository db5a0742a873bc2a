/*
 * pages/attend_table.c - the block table of kvp_attend_decode (pages/attend.c
 * runs it): built on the host from the RCU page tables, into a buffer the
 * caller owns, exactly as the device reads it. The tables each layer keeps
 * between calls are pages/attend_kept.c's; pages/attend_table.h holds what
 * the two share.
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
#include "attend_table.h"

#ifdef KVP_HAVE_CUDA

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

int kvp__atab_reserve(kvp__abuf *buf, uint64_t used, uint64_t need) {
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
/* Blocks read ahead: about 16 lines in flight (kvpool-prof-attend measures
 * 16 raw blocks, one line each, and 8 of two lines best). */
#define PREFETCH_LINES 16
#define PREFETCH_MOST PREFETCH_LINES
/* Room for more records (buf grows, those written kept); *rc. */
static cursor __attribute__((noinline)) cursor_grow(kvp__abuf *buf, cursor c, uint32_t rb, int *rc) {
  uint64_t used = (uint64_t)(c.dst - buf->p);
  if ((*rc = kvp__atab_reserve(buf, used, used + rb + used / 2))) return c;
  kvp__assert((uintptr_t)buf->p % 16 == 0);
  c.dst = buf->p + used;
  c.lim = buf->p + buf->cap_bytes / rb * rb;
  return c;
}

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

int kvp__atab_check(const kvp_pool *pool, const kvp__atable *t) {
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


int kvp__atab_walk(kvp_pool *pool, const kvp__atable *t, kvp__abuf *buf, uint32_t rb, uint32_t *recs_at,
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

int kvp__atab_finish(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf, uint32_t rb, const uint32_t *recs_at,
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
  int rc = kvp__atab_reserve(buf, rec_bytes, most);
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

int kvp__atab_build(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf, uint32_t rb, uint32_t *recs_at, uint64_t *tok_of,
                    atail *tails, aseq *seqs, uint32_t *bh_split0, bool *shared) {
  cursor c;
  int rc = kvp__atab_walk(pool, t, buf, rb, recs_at, tok_of, tails, seqs, shared, &c);
  return rc ? rc
            : kvp__atab_finish(pool, t, buf, rb, recs_at, recs_at + 1, tok_of, NULL, NULL, bh_split0,
                               c.whole_bytes + (uint64_t)c.part_bytes, recs_at[t->batch * pool->cfg.n_kv_heads]);
}

void kvp__atab_reset(kvp__atable *t) {
  t->nrec = t->nsplit = t->nslot = 0;
  t->off_splits = t->off_bh = t->table_bytes = t->token_heads = t->bytes_read = 0;
  t->recs_dev = t->tab_dev = NULL, t->done = NULL, t->hold = NULL;
}

int kvp__attend_build(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf) {
  kvp__atab_reset(t);
  int rc = kvp__atab_check(pool, t);
  if (rc) return rc;
  uint32_t nbh = t->batch * pool->cfg.n_kv_heads, rb = kvp__kern_attend_rec_bytes(t->kind);
  /* scratch: each bh's first record (and the end), each bh's tokens, each bh's first split (and the end) */
  size_t scratch = (size_t)(nbh + 1) * 2 * sizeof(uint32_t) + (size_t)nbh * sizeof(uint64_t);
  uint64_t *tok_of = kvp__meta_alloc(NULL, scratch);
  if (!tok_of) return kvp__err(KVP_ENOMEM, "attend scratch for a batch of %u", t->batch);
  uint32_t *recs_at = (uint32_t *)(tok_of + nbh), *bh_split0 = recs_at + nbh + 1;
  bool shared;
  rc = kvp__atab_build(pool, t, buf, rb, recs_at, tok_of, NULL, NULL, bh_split0, &shared);
  kvp__meta_free(NULL, tok_of, scratch);
  return rc;
}

#endif
