/*
 * pages/fork.c - kvp_seq_fork and the walk kvp_check makes over sequences.
 *
 * Fork: the child gets copies of the parent's runs and brefs; sealed blocks
 * are shared (owners and refs + 1), the OPEN block of each stream is copied
 * into new pages (tagged with the child). All or nothing: the bytes of the
 * copies are checked against the budget first, and any failure frees what
 * the child took.
 *
 * Check (per sequence): runs ordered and disjoint with positions from the
 * step table; retained_tokens(l, h) from the runs; blocks ordered and
 * disjoint, n_tokens <= cap_tokens; every retained position inside a block
 * (its own or a held prefix chunk's); owners(block) = brefs counted across
 * all sequences (+ 1 for a prefix-table entry's block); every page visited
 * once. Holds and entries: kvp__prefix_check_holds, kvp__prefix_check.
 */
#include "pages.h"

#include <string.h>

void kvp__seq_build_undo(kvp_pool *pool, kvp__seq *c) {
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads;
  kvp__prefix_release(pool, c, false); /* unpublished: no reader */
  for (uint32_t l = 0; l < L; l++) {
    for (kvp__run *r = c->layers[l].runs, *n; r; r = n) {
      n = r->next;
      kvp__run_free_now(pool, r);
    }
    for (uint32_t h = 0; h < H; h++) kvp__cstate_free(pool, kvp__seq_stream(pool, c, l, h), l);
    for (uint32_t h = 0; h < H; h++)
      for (kvp__bref *b = kvp__seq_stream(pool, c, l, h)->blocks, *n; b; b = n) {
        n = b->next;
        if (b->blk->owners == 0) kvp__block_destroy(pool, b->blk); /* a copy of ours */
        else {
          b->blk->owners--;
          atomic_fetch_sub(&b->blk->refs, 1);
        }
        kvp__bref_free_now(pool, b);
      }
  }
}

/* Copy the OPEN block b of (layer, head) for the child. */
static int copy_open(kvp_pool *pool, uint64_t child, uint32_t layer, uint32_t head, const kvp__block *b,
                     kvp__block **out) {
  kvp_codec_layout lay[2]; /* as the block has them now (a row-wise OPEN block's pages grow) */
  kvp__block_layouts(b, lay);
  int rc = kvp__block_new_sized(pool, child, layer, head, b->pos0, b->cap_tokens, b->raw, lay, out);
  if (rc) return rc;
  kvp__block *nb = *out;
  kvp__block_set_n(nb, b->n_tokens);
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv] && !rc; i++)
      rc = pool->alloc.region.ops->copy(&pool->alloc.region, KVP__PG(nb, i)[kv].off, KVP__PG(b, i)[kv].off,
                                        KVP__PG(b, i)[kv].requested_bytes, NULL);
  if (rc) kvp__block_destroy(pool, nb);
  return rc;
}

static int fork_layer(kvp_pool *pool, const kvp__seq *p, kvp__seq *c, uint32_t l) {
  kvp__run **rtail = &c->layers[l].runs;
  for (const kvp__run *r = p->layers[l].runs; r; r = r->next) {
    kvp__run *nr = kvp__run_new(pool, r->s0, r->p0, atomic_load(&r->s1), atomic_load(&r->p1), r->mask);
    if (!nr) return kvp__err(KVP_ENOMEM, "runs of the forked sequence");
    *rtail = nr;
    rtail = &nr->next;
    c->layers[l].last = nr;
  }
  for (uint32_t h = 0; h < pool->cfg.n_kv_heads; h++) {
    const kvp__stream *ps = kvp__seq_stream(pool, (kvp__seq *)p, l, h);
    kvp__stream *cs = kvp__seq_stream(pool, c, l, h);
    atomic_init(&cs->retained_tokens, atomic_load(&ps->retained_tokens));
    atomic_init(&cs->evicted_tokens, atomic_load(&ps->evicted_tokens));
    int src = kvp__cstate_copy(pool, ps, cs, l);
    if (src) return src;
    kvp__bref **btail = &cs->blocks;
    for (const kvp__bref *b = ps->blocks; b; b = b->next) {
      kvp__bref *nb = kvp__meta_calloc(&pool->meta, sizeof *nb);
      if (!nb) return kvp__err(KVP_ENOMEM, "blocks of the forked sequence");
      int rc = KVP_OK;
      if (b->blk->sealed) {
        nb->blk = b->blk;
        nb->blk->owners++;
        atomic_fetch_add(&nb->blk->refs, 1);
      } else if ((rc = copy_open(pool, c->id, l, h, b->blk, &nb->blk))) {
        kvp__bref_free_now(pool, nb);
        return rc;
      }
      *btail = nb;
      btail = &nb->next;
      cs->tail = nb;
    }
  }
  return KVP_OK;
}

/* Give the copies their ownership only once every layer succeeded. */
void kvp__seq_build_commit(kvp_pool *pool, kvp__seq *c) {
  uint64_t retained = 0;
  for (uint32_t i = 0; i < pool->cfg.n_layers * pool->cfg.n_kv_heads; i++) {
    retained += atomic_load(&c->streams[i].retained_tokens);
    for (kvp__bref *b = c->streams[i].blocks; b; b = b->next)
      if (b->blk->owners == 0) { /* a fresh copy */
        b->blk->owners = 1;
        atomic_init(&b->blk->refs, 1);
      }
  }
  kvp__count_tokens(pool, (int64_t)retained, 0);
}

static uint64_t open_copy_bytes(kvp_pool *pool, const kvp__seq *p) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < pool->cfg.n_layers * pool->cfg.n_kv_heads; i++)
    for (const kvp__bref *b = p->streams[i].blocks; b; b = b->next)
      if (!b->blk->sealed)
        for (int kv = 0; kv < 2; kv++)
          for (unsigned j = 0; j < b->blk->npages[kv]; j++) sum += kvp__page_alloc_bytes(&KVP__PG(b->blk, j)[kv]);
  return sum;
}

int kvp__seq_fork_locked(kvp_pool *pool, kvp__seq *p, kvp__seq *c) {
  uint64_t need = open_copy_bytes(pool, p);
  if (!kvp__alloc_fits_bytes(&pool->alloc, need) && pool->limbo) kvp__reclaim(pool);
  if (!kvp__alloc_fits_bytes(&pool->alloc, need))
    return kvp__err(KVP_EBUDGET, "fork of seq %llu into %llu: copying its open blocks needs %llu bytes, budget has "
                                 "%llu left",
                    (unsigned long long)p->id, (unsigned long long)c->id, (unsigned long long)need,
                    (unsigned long long)(pool->alloc.ledger.budget_bytes - pool->alloc.ledger.allocated.current));
  c->mode = p->mode;
  c->budget_fraction = p->budget_fraction;
  uint32_t n = atomic_load(&p->n_steps);
  if (n + 2 > c->step_pos_cap) {
    uint32_t *np = kvp__meta_realloc(&pool->meta, c->step_pos, c->step_pos_cap * sizeof *np, (n + 2) * sizeof *np);
    if (!np) return kvp__err(KVP_ENOMEM, "step table of the forked sequence");
    c->step_pos = np;
    c->step_pos_cap = n + 2;
  }
  memcpy(c->step_pos, p->step_pos, (n + 1) * sizeof *c->step_pos);
  atomic_init(&c->n_steps, n);
  atomic_init(&c->n_positions, atomic_load(&p->n_positions));
  int rc = kvp__prefix_fork(pool, p, c); /* the shared prefix chunks the parent holds: one reference each */
  for (uint32_t l = 0; !rc && l < pool->cfg.n_layers; l++) rc = fork_layer(pool, p, c, l);
  if (rc) {
    kvp__seq_build_undo(pool, c);
    return rc;
  }
  kvp__seq_build_commit(pool, c);
  return KVP_OK;
}

/* ---- check ---------------------------------------------------------------- */

#define CORRUPT(...) kvp__err(KVP_ECORRUPT, __VA_ARGS__)

typedef struct check_ctx {
  kvp__page_visit fn;  /* page visitor */
  void *ctx;           /* its context */
  uint32_t epoch;      /* visit mark of this check */
  uint64_t retained;   /* tokens over all streams */
  uint64_t nseqs;      /* sequences walked */
  uint64_t state_bytes; /* codec state over all streams */
} check_ctx;

static void visit_block(kvp_pool *pool, kvp__block *b, check_ctx *cc) {
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv]; i++) cc->fn(cc->ctx, &KVP__PG(b, i)[kv]);
}

static int check_runs(kvp_pool *pool, kvp__seq *s, uint32_t l, uint32_t *retained) {
  uint32_t n = atomic_load(&s->n_steps), prev_s1 = 0, H = pool->cfg.n_kv_heads;
  bool open = atomic_load(&s->in_step);
  for (const kvp__run *r = s->layers[l].runs; r; r = r->next) {
    uint32_t s1 = atomic_load(&r->s1), p1 = atomic_load(&r->p1);
    uint32_t want_p1 = s1 == n && open ? s->step_pos[n - 1] + s->cur_tokens : s->step_pos[s1];
    if (r->s0 < prev_s1 || r->s0 >= s1 || s1 > n || r->p0 != s->step_pos[r->s0] || p1 != want_p1)
      return CORRUPT("seq %llu layer %u: run steps [%u, %u) positions [%u, %u) disagree with the step table",
                     (unsigned long long)s->id, l, r->s0, s1, r->p0, p1);
    if (!r->next && s->layers[l].last != r)
      return CORRUPT("seq %llu layer %u: last-run pointer is stale", (unsigned long long)s->id, l);
    for (uint32_t h = 0; h < H; h++)
      if (kvp__run_has(r, h)) retained[h] += p1 - r->p0;
    prev_s1 = s1;
  }
  return KVP_OK;
}

/* A block's pages are exactly its binding's layout for its capacity (for a
 * row-wise codec: its open layout for the rows it holds). */
static int check_layout(kvp_pool *pool, const kvp__block *b, uint32_t l, uint32_t h) {
  for (int kv = 0; kv < 2; kv++) {
    const kvp__binding *bd = kvp__block_binding(pool, l, kv, b);
    kvp_codec_layout lay;
    if (!b->raw && kvp__layer_rowwise(pool, l)) {
      const void *pages[KVP_CODEC_MAX_PAGES];
      bool held = kvp__rows_on_host(pool); /* else (dry, device rows) sized by count */
      for (unsigned i = 0; i < b->npages[kv]; i++) pages[i] = kvp__page_addr(&pool->alloc, &KVP__PG(b, i)[kv]);
      kvp_codec_block where = {h, b->pos0};
      if (bd->vt->open_layout(bd->inst, &where, held ? pages : NULL, b->n_tokens, NULL, 0, 0, b->cap_tokens, &lay))
        return CORRUPT("block at position %u of layer %u head %u: codec %s cannot lay out its %u rows", b->pos0, l, h,
                       bd->vt->name, b->n_tokens);
    } else {
      kvp__bind_layout(bd, b->pos0, b->cap_tokens, &lay);
    }
    if (lay.npages != b->npages[kv])
      return CORRUPT("block at position %u of layer %u: %u %c pages, codec %s lays out %u", b->pos0, l, b->npages[kv],
                     "KV"[kv], bd->vt->name, lay.npages);
    for (unsigned i = 0; i < lay.npages; i++)
      if (KVP__PG(b, i)[kv].requested_bytes != lay.bytes[i] || KVP__PG(b, i)[kv].tag.type != lay.types[i] ||
          KVP__PG(b, i)[kv].tag.codec != bd->id)
        return CORRUPT("block at position %u of layer %u: %c page %u holds %u bytes of type %u, codec %s lays out %llu "
                       "of type %u", b->pos0, l, "KV"[kv], i, KVP__PG(b, i)[kv].requested_bytes, KVP__PG(b, i)[kv].tag.type,
                       bd->vt->name, (unsigned long long)lay.bytes[i], (unsigned)lay.types[i]);
  }
  return KVP_OK;
}

/* A block's pages are counted once per check; owners_seen counts from 0. */
static void visit_once(kvp_pool *pool, kvp__block *blk, check_ctx *cc) {
  if (blk->check_epoch == cc->epoch) return;
  blk->check_epoch = cc->epoch;
  blk->owners_seen = 0;
  visit_block(pool, blk, cc);
}

static int check_stream(kvp_pool *pool, kvp__seq *s, uint32_t l, uint32_t h, uint32_t want, check_ctx *cc) {
  kvp__stream *st = kvp__seq_stream(pool, s, l, h);
  uint32_t lh = l * pool->cfg.n_kv_heads + h;
  if (atomic_load(&st->retained_tokens) != want)
    return CORRUPT("seq %llu layer %u head %u: %u tokens retained by the counter, %u by the runs",
                   (unsigned long long)s->id, l, h, atomic_load(&st->retained_tokens), want);
  uint32_t end = 0;
  const kvp__bref *last = NULL;
  for (const kvp__bref *b = st->blocks; b; last = b, b = b->next) { /* its own references (owners) */
    kvp__block *blk = b->blk;
    if (blk->pos0 < end || blk->n_tokens > blk->cap_tokens || !blk->n_tokens)
      return CORRUPT("seq %llu layer %u head %u: block at position %u (%u of %u tokens) overlaps or is malformed",
                     (unsigned long long)s->id, l, h, blk->pos0, blk->n_tokens, blk->cap_tokens);
    if (!kvp__prefix_bref_ok(pool, s, lh, blk))
      return CORRUPT("seq %llu layer %u head %u: block at position %u lies in a shared prefix chunk the sequence "
                     "holds, and is not that chunk's block", (unsigned long long)s->id, l, h, blk->pos0);
    end = blk->pos0 + blk->n_tokens;
    visit_once(pool, blk, cc);
    blk->owners_seen++;
  }
  if (last != st->tail) return CORRUPT("seq %llu layer %u head %u: tail pointer is stale", (unsigned long long)s->id, l, h);
  /* every block, its own and its held chunks', in position order (as readers walk them) */
  kvp__bwalk w;
  for (kvp__block *blk = kvp__bwalk_first(&w, pool, s, lh); blk; blk = kvp__bwalk_next(&w, blk)) {
    if (s->mode == KVP_SEQ_STEP && !blk->sealed)
      return CORRUPT("seq %llu layer %u head %u: an OPEN block in step mode", (unsigned long long)s->id, l, h);
    if (!blk->raw && !blk->sealed && !kvp__layer_rowwise(pool, l))
      return CORRUPT("seq %llu layer %u head %u: an encoded block that is not sealed", (unsigned long long)s->id, l, h);
    int lrc = check_layout(pool, blk, l, h);
    if (lrc) return lrc;
    visit_once(pool, blk, cc);
  }
  /* every retained position lies in a block */
  kvp__block *cur = kvp__bwalk_first(&w, pool, s, lh);
  for (const kvp__run *r = s->layers[l].runs; r; r = r->next) {
    if (!kvp__run_has(r, h)) continue;
    for (uint32_t p = r->p0; p < atomic_load(&r->p1);) {
      while (cur && cur->pos0 + cur->n_tokens <= p) cur = kvp__bwalk_next(&w, cur);
      if (!cur || cur->pos0 > p)
        return CORRUPT("seq %llu layer %u head %u: retained position %u is in no block", (unsigned long long)s->id, l,
                       h, p);
      p = cur->pos0 + cur->n_tokens;
    }
  }
  return KVP_OK;
}

static int check_seq(kvp_pool *pool, kvp__seq *s, check_ctx *cc) {
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads;
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++)
      for (int kv = 0; kv < 2; kv++)
        if (kvp__seq_stream(pool, s, l, h)->cstate[kv]) cc->state_bytes += kvp__cstate_bytes(pool, l, kv);
  uint32_t *retained = kvp__meta_calloc(NULL, H * sizeof *retained);
  if (!retained) return kvp__err(KVP_ENOMEM, "check scratch");
  int rc = kvp__prefix_check_holds(pool, s);
  for (uint32_t l = 0; !rc && l < L; l++) {
    memset(retained, 0, H * sizeof *retained);
    rc = check_runs(pool, s, l, retained);
    for (uint32_t h = 0; !rc && h < H; h++) {
      rc = check_stream(pool, s, l, h, retained[h], cc);
      cc->retained += retained[h];
    }
  }
  kvp__meta_free(NULL, retained, H * sizeof *retained);
  return rc;
}

static void visit_none(void *ctx, const kvp__page *pg) {
  (void)ctx;
  (void)pg;
}

int kvp__seq_validate(kvp_pool *pool, kvp__seq *s) {
  check_ctx cc = {visit_none, NULL, ++pool->check_epoch, 0, 0, 0};
  kvp__prefix_mark(pool);
  return check_seq(pool, s, &cc);
}

/* Owners of every reachable block equal the brefs found. */
static int check_owners(kvp_pool *pool, kvp__seq *s) {
  for (uint32_t i = 0; i < pool->cfg.n_layers * pool->cfg.n_kv_heads; i++)
    for (const kvp__bref *b = s->streams[i].blocks; b; b = b->next)
      if (b->blk->owners != b->blk->owners_seen + (b->blk->chunk != NULL) || atomic_load(&b->blk->refs) < b->blk->owners)
        return CORRUPT("block at position %u of seq %llu: %u owners recorded, %u found, %u refs", b->blk->pos0,
                       (unsigned long long)s->id, b->blk->owners, b->blk->owners_seen, atomic_load(&b->blk->refs));
  return KVP_OK;
}

int kvp__seqs_check(kvp_pool *pool, kvp__page_visit fn, void *ctx) {
  check_ctx cc = {fn, ctx, ++pool->check_epoch, 0, 0, 0};
  kvp__prefix_mark(pool);
  struct cds_lfht_iter it;
  struct cds_lfht_node *n;
  int rc = KVP_OK;
  kvp__rcu_read_lock();
  cds_lfht_for_each(pool->seqs, &it, n) {
    if ((rc = check_seq(pool, caa_container_of(n, kvp__seq, node), &cc))) break;
    cc.nseqs++;
  }
  cds_lfht_for_each(pool->seqs, &it, n) {
    if (rc || (rc = check_owners(pool, caa_container_of(n, kvp__seq, node)))) break;
  }
  kvp__rcu_read_unlock();
  if (rc) return rc;
  /* An orphan may show 0 refs: the view release that dropped its last pin
   * waits for the writer lock (held here) to move it to the limbo. */
  for (kvp__block *b = pool->orphans; b; b = b->onext) {
    if (b->owners || !b->orphan)
      return CORRUPT("orphan block at position %u has %u owners, %u refs", b->pos0, b->owners, atomic_load(&b->refs));
    visit_block(pool, b, &cc);
  }
  uint64_t retired = 0;
  for (kvp__block *b = pool->limbo; b; b = b->onext) {
    visit_block(pool, b, &cc);
    for (int kv = 0; kv < 2; kv++)
      for (unsigned i = 0; i < b->npages[kv]; i++) retired += kvp__page_alloc_bytes(&KVP__PG(b, i)[kv]);
  }
  int prc = kvp__prefix_check(pool);
  if (prc) return prc;
  if (retired != pool->alloc.ledger.retired.current)
    return CORRUPT("limbo holds %llu bytes, ledger says %llu retired", (unsigned long long)retired,
                   (unsigned long long)pool->alloc.ledger.retired.current);
  const kvp__ledger *l = &pool->alloc.ledger;
  if (cc.state_bytes != l->codec_state.current)
    return CORRUPT("streams hold %llu bytes of codec state, ledger says %llu", (unsigned long long)cc.state_bytes,
                   (unsigned long long)l->codec_state.current);
  if (cc.retained != l->tokens_retained.current || cc.nseqs != l->sequences.current ||
      l->bf16_equivalent.current != cc.retained * 4ull * pool->cfg.head_dim)
    return CORRUPT("ledger counts %llu tokens retained in %llu sequences (%llu bf16 bytes); streams hold %llu in %llu",
                   (unsigned long long)l->tokens_retained.current, (unsigned long long)l->sequences.current,
                   (unsigned long long)l->bf16_equivalent.current, (unsigned long long)cc.retained,
                   (unsigned long long)cc.nseqs);
  return KVP_OK;
}
