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
 * Each (sequence, KV head) through kvp__walk_ranges: one kvp__gjob per
 * retained range of a block (kvp__gjob_fill), its tokens and the page bytes
 * the kernel reads counted; the splits over them; then the records
 * rewritten in the kernel's form in place and the splits moved behind them. */

typedef struct walk_ctx {
  kvp__abuf *buf;
  uint64_t n;       /* kvp__gjob records written */
  uint32_t head;
  uint64_t tokens;  /* token-heads recorded */
  double bytes;     /* page bytes the kernel reads */
  int rc;
} walk_ctx;

static int walk_range(void *vctx, kvp__block *b, uint32_t a, uint32_t e) {
  walk_ctx *c = vctx;
  uint32_t m = e - a;
  if ((c->rc = reserve(c->buf, c->n * sizeof(kvp__gjob), (c->n + 1) * sizeof(kvp__gjob)))) return 1;
  kvp__gjob *r = (kvp__gjob *)c->buf->p + c->n++;
  kvp__gjob_fill(r, b, c->head, a, e, 0, b->raw ? 1 : 0);
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv]; i++) c->bytes += (double)b->pages[kv][i].requested_bytes * m / b->cap_tokens;
  c->tokens += m;
  return 0;
}

/* ---- splits ----------------------------------------------------------------- */

/* Splits of the table: recs_at[bh] .. recs_at[bh + 1] are bh's records,
 * tok_of[bh] their tokens. Writes them (NULL: counts) and returns their
 * number; *slots: the partial-result slots used. */
static uint32_t make_splits(const kvp__gjob *recs, const uint32_t *recs_at, const uint64_t *tok_of, uint32_t nbh,
                            uint32_t chunk, kvp__asplit *out, uint32_t *bh_split0, uint32_t *slots) {
  uint32_t n = 0, nslot = 0;
  for (uint32_t bh = 0; bh < nbh; bh++) {
    uint32_t first = n, r = recs_at[bh], end = recs_at[bh + 1];
    uint64_t total = tok_of[bh];
    /* at most ceil(total / chunk) splits of about equal tokens (whole
     * records): split k ends at the record boundary nearest to k + 1 parts
     * of the tokens, so the count is what wave_chunk planned for (one
     * split more than the device holds at once would cost a second wave) */
    uint64_t parts = total ? (total + chunk - 1) / chunk : 1, cum = 0;
    if (bh_split0) bh_split0[bh] = n;
    do { /* at least one split per bh: a head with no tokens writes zeros */
      uint32_t r0 = r;
      uint64_t target = total * (n - first + 1) / parts;
      while (r < end && (r == r0 || 2 * (cum + recs[r].m1 + 1u) <= 2 * target + recs[r].m1 + 1u))
        cum += recs[r++].m1 + 1u;
      if (out) out[n] = (kvp__asplit){r0, r - r0, bh, 0};
      n++;
    } while (r < end);
    if (out)
      for (uint32_t s = first; s < n; s++) out[s].slot = n - first > 1 ? nslot + (s - first) : KVP__ASPLIT_ONLY;
    if (n - first > 1) nslot += n - first;
  }
  if (bh_split0) bh_split0[nbh] = n;
  *slots = nslot;
  return n;
}

/* The smallest split size (tokens, >= SPLIT_MIN_TOKENS) whose splits,
 * ceil(bh's tokens / size) per (sequence, KV head), fit in slots thread
 * blocks (or one split per bh when there are more bh than slots). */
static uint64_t wave_chunk(const uint64_t *tok_of, uint32_t nbh, uint64_t tokens, uint32_t slots) {
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
  return ch;
}

/* Rewrite n kvp__gjob records at recs as rb-byte records, in place (from the
 * front: each record lands at or before where it was read). */
static void compact(uint32_t rb, void *recs, uint32_t n) {
  const kvp__gjob *in = (const kvp__gjob *)recs;
  for (uint32_t i = 0; i < n; i++) {
    const kvp__gjob g = in[i]; /* read whole before the write that may overlap it */
    if (rb == sizeof(kvp__arec_raw)) {
      const kvp__arec_raw r = {{g.page[0][0], g.page[1][0]}, g.t0, g.m1, 0};
      memcpy((char *)recs + (size_t)i * rb, &r, sizeof r);
    } else {
      const kvp__arec_q r = {{{g.page[0][0], g.page[0][1], g.page[0][2]}, {g.page[1][0], g.page[1][1], g.page[1][2]}},
                             g.t0, g.m1, g.cap1, g.tag};
      memcpy((char *)recs + (size_t)i * rb, &r, sizeof r);
    }
  }
}

int kvp__attend_build(kvp_pool *pool, kvp__atable *t, kvp__abuf *buf) {
  uint32_t H = pool->cfg.n_kv_heads, nbh = t->batch * H, rb = kvp__kern_attend_rec_bytes(t->kind);
  t->nrec = t->nsplit = t->nslot = 0;
  t->off_splits = t->off_bh = t->table_bytes = t->token_heads = t->bytes_read = 0;
  if (pool->alloc.page_align_bytes % 64)
    return kvp__err(KVP_ENOTSUP, "attend: the pool's pages are %llu-byte aligned; its block table addresses 64-byte "
                    "units (a CUDA region's, also a dry one's)", (unsigned long long)pool->alloc.page_align_bytes);
  if (pool->alloc.region.bytes > (64ull << 32))
    return kvp__err(KVP_ENOTSUP, "attend: the region of %llu bytes passes the 256 GiB its block table addresses",
                    (unsigned long long)pool->alloc.region.bytes);
  if (t->layer >= pool->cfg.n_layers)
    return kvp__err(KVP_EINVAL, "attend: layer %u >= n_layers %u", t->layer, pool->cfg.n_layers);
  if ((uint64_t)t->batch * H >= UINT32_MAX)
    return kvp__err(KVP_EINVAL, "attend: batch %u x %u KV heads is too many", t->batch, H);
  /* scratch: each bh's first record (and the end), each bh's tokens */
  size_t scratch = (size_t)(nbh + 1) * sizeof(uint32_t) + (size_t)nbh * sizeof(uint64_t);
  uint64_t *tok_of = kvp__meta_alloc(NULL, scratch);
  if (!tok_of) return kvp__err(KVP_ENOMEM, "attend scratch for a batch of %u", t->batch);
  uint32_t *recs_at = (uint32_t *)(tok_of + nbh);
  walk_ctx c = {.buf = buf};
  int rc = KVP_OK;
  for (uint32_t b = 0; !rc && b < t->batch; b++) {
    kvp__seq *s = kvp__seq_find(pool, t->seqs[b]);
    if (!s) {
      rc = kvp__err(KVP_ENOENT, "attend: seqs[%u]: sequence %llu does not exist", b, (unsigned long long)t->seqs[b]);
      break;
    }
    for (uint32_t h = 0; !rc && h < H; h++) {
      if (c.n >= UINT32_MAX / 2) {
        rc = kvp__err(KVP_EINVAL, "attend: the batch's block table passes 2^31 records");
        break;
      }
      recs_at[b * H + h] = (uint32_t)c.n;
      c.head = h;
      uint64_t tok0 = c.tokens;
      kvp__walk_ranges(s, pool, t->layer, h, UINT64_MAX, walk_range, &c);
      tok_of[b * H + h] = c.tokens - tok0;
      rc = c.rc;
    }
  }
  if (!rc) {
    uint32_t nrec = recs_at[nbh] = (uint32_t)c.n, nslot;
    uint64_t ch = t->split_tokens;
    if (!ch) ch = wave_chunk(tok_of, nbh, c.tokens, t->slots);
    uint32_t chunk = ch > UINT32_MAX ? UINT32_MAX : (uint32_t)ch;
    uint32_t nsplit = make_splits((const kvp__gjob *)buf->p, recs_at, tok_of, nbh, chunk, NULL, NULL, &nslot);
    uint64_t sp_bytes = (uint64_t)nsplit * sizeof(kvp__asplit) + (uint64_t)(nbh + 1) * 4;
    t->nrec = nrec, t->nsplit = nsplit, t->nslot = nslot;
    t->off_splits = align_up((uint64_t)nrec * rb, 16);
    t->off_bh = t->off_splits + (uint64_t)nsplit * sizeof(kvp__asplit);
    t->table_bytes = t->off_splits + sp_bytes;
    t->token_heads = c.tokens, t->bytes_read = (uint64_t)c.bytes;
    /* built in place: the splits after the kvp__gjob records, then the
     * records rewritten in the kernel's form and the splits moved behind them */
    uint64_t gj_bytes = align_up((uint64_t)nrec * sizeof(kvp__gjob), 16);
    if (!(rc = reserve(buf, (uint64_t)nrec * sizeof(kvp__gjob), gj_bytes + sp_bytes))) {
      unsigned char *p = buf->p;
      make_splits((const kvp__gjob *)p, recs_at, tok_of, nbh, chunk, (kvp__asplit *)(p + gj_bytes),
                  (uint32_t *)(p + gj_bytes + (uint64_t)nsplit * sizeof(kvp__asplit)), &nslot);
      if (rb != sizeof(kvp__gjob)) {
        compact(rb, p, nrec);
        memmove(p + t->off_splits, p + gj_bytes, sp_bytes);
      }
      memset(p + (uint64_t)nrec * rb, 0, t->off_splits - (uint64_t)nrec * rb);
    }
  }
  kvp__meta_free(NULL, tok_of, scratch);
  return rc;
}

#endif
