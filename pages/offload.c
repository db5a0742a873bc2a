/*
 * pages/offload.c - the store tier seen from the pool: a sequence's blocks
 * written out as blobs and freed (kvp_seq_offload), brought back all or
 * nothing (kvp_seq_restore).
 *
 * The blobs and their keys: pages/blob.h; publish and fetch:
 * pages/prefix_store.c.
 *
 * Nothing in a blob is trusted before it is checked: the header against
 * the blob's length and this pool (version, geometry, codecs), the
 * checksum against the payload, then every length against what is left,
 * every record against the pool's layouts, and the rebuilt sequence with
 * kvp_check's own walk. Failures name the key and change nothing: an
 * offload frees only after every blob and the manifest are written; a
 * restore publishes only once every blob was read and checked.
 */
#include "blob.h"
#include "policy.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void groups_free(groups *gs) {
  kvp__meta_free(NULL, gs->items, gs->nitems * sizeof *gs->items + 1);
  kvp__meta_free(NULL, gs->g, gs->ng * sizeof *gs->g + 1);
  *gs = (groups){0};
}

static uint64_t block_alloc_bytes(const kvp__block *b) {
  uint64_t n = 0;
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv]; i++) n += kvp__page_alloc_bytes(&KVP__PG(b, i)[kv]);
  return n;
}

/* Every block of s by chunk (a counting sort over the streams' walks). */
static int collect(kvp_pool *pool, kvp__seq *s, groups *gs) {
  uint32_t bt = pool->chunk_tokens, LH = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  uint32_t nchunks = (atomic_load_explicit(&s->n_positions, memory_order_relaxed) + bt - 1) / bt + 1;
  uint64_t n = 0;
  kvp__bwalk w; /* each stream's blocks, its own and the shared prefix chunks it holds */
  for (uint32_t i = 0; i < LH; i++)
    for (kvp__block *b = kvp__bwalk_first(&w, pool, s, i); b; b = kvp__bwalk_next(&w, b))
      n++;
  uint32_t *cnt = kvp__meta_calloc(NULL, (nchunks + 1) * sizeof *cnt);
  gs->items = kvp__meta_alloc(NULL, n * sizeof *gs->items + 1);
  gs->nitems = n;
  if (!cnt || !gs->items) {
    kvp__meta_free(NULL, cnt, (nchunks + 1) * sizeof *cnt);
    groups_free(gs);
    return kvp__err(KVP_ENOMEM, "offload of seq %llu: block list", (unsigned long long)s->id);
  }
  for (uint32_t i = 0; i < LH; i++)
    for (kvp__block *b = kvp__bwalk_first(&w, pool, s, i); b; b = kvp__bwalk_next(&w, b))
      cnt[b->pos0 / bt + 1]++;
  uint32_t ng = 0;
  for (uint32_t g = 0; g < nchunks; g++) {
    ng += cnt[g + 1] != 0;
    cnt[g + 1] += cnt[g];
  }
  gs->g = kvp__meta_calloc(NULL, ng * sizeof *gs->g + 1);
  if (!gs->g) {
    kvp__meta_free(NULL, cnt, (nchunks + 1) * sizeof *cnt);
    groups_free(gs);
    return kvp__err(KVP_ENOMEM, "offload of seq %llu: group list", (unsigned long long)s->id);
  }
  gs->ng = ng;
  for (uint32_t g = 0, j = 0; g < nchunks; g++)
    if (cnt[g + 1] != cnt[g]) gs->g[j++] = (group){.index = g, .first = cnt[g], .n = cnt[g + 1] - cnt[g]};
  for (uint32_t i = 0; i < LH; i++)
    for (kvp__block *b = kvp__bwalk_first(&w, pool, s, i); b; b = kvp__bwalk_next(&w, b))
      gs->items[cnt[b->pos0 / bt]++] = (item){b, i};
  kvp__meta_free(NULL, cnt, (nchunks + 1) * sizeof *cnt);
  for (uint32_t j = 0; j < ng; j++) {
    group *g = &gs->g[j];
    const kvp__chunk *c = gs->items[g->first].b->chunk;
    bool content = g->n == LH && c && c->index == g->index;
    for (uint32_t i = 0; i < g->n; i++) {
      const item *it = &gs->items[g->first + i];
      g->alloc_bytes += block_alloc_bytes(it->b);
      content = content && it->b->chunk == c && c->blocks[it->lh] == it->b;
    }
    if (content) {
      g->kind = GROUP_CONTENT;
      g->key[0] = c->key[0];
      g->key[1] = c->key[1];
    }
  }
  return KVP_OK;
}

/* The group blob of n items (pages copied out of the region). */

/* ---- manifest -------------------------------------------------------------------- */

static void build_manifest(kvp_pool *pool, kvp__seq *s, uint64_t gen, const groups *gs, wbuf *w) {
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads, nw = (H + 63) / 64;
  blob_hdr h = hdr_for(pool, KIND_MANIFEST, gs->ng, s->id, gen);
  w->n = 0;
  wput(w, &h, sizeof h);
  uint32_t n_steps = atomic_load_explicit(&s->n_steps, memory_order_relaxed);
  man_seq m = {s->id, gen, (uint32_t)s->mode, n_steps, atomic_load_explicit(&s->n_positions, memory_order_relaxed),
               s->n_plan, s->n_pkeys, s->max_hit, s->next_reg, nw, s->budget_fraction};
  wput(w, &m, sizeof m);
  wput(w, s->step_pos, (n_steps + 1) * sizeof *s->step_pos);
  wput(w, s->plan, s->n_plan * sizeof *s->plan);
  wput(w, s->pkeys, s->n_pkeys * sizeof *s->pkeys);
  for (uint32_t l = 0; l < L; l++) {
    uint32_t nr = 0;
    for (const kvp__run *r = s->layers[l].runs; r; r = r->next) nr++;
    wput(w, &nr, sizeof nr);
    for (const kvp__run *r = s->layers[l].runs; r; r = r->next) {
      uint32_t v[4] = {r->s0, r->p0, atomic_load(&r->s1), atomic_load(&r->p1)};
      wput(w, v, sizeof v);
      wput(w, r->mask, nw * sizeof *r->mask);
    }
  }
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t hd = 0; hd < H; hd++) {
      const kvp__stream *st = kvp__seq_stream(pool, s, l, hd);
      uint32_t v[2] = {atomic_load(&st->retained_tokens), atomic_load(&st->evicted_tokens)};
      uint8_t has[4] = {st->cstate[0] != NULL, st->cstate[1] != NULL, 0, 0};
      wput(w, v, sizeof v);
      wput(w, has, sizeof has);
      for (int kv = 0; kv < 2; kv++)
        if (st->cstate[kv]) wput(w, st->cstate[kv], kvp__cstate_bytes(pool, l, kv));
    }
  for (uint32_t j = 0; j < gs->ng; j++) {
    const group *g = &gs->g[j];
    man_group mg = {g->kind, {0}, g->index, g->n, 0, {g->key[0], g->key[1]}, g->alloc_bytes};
    wput(w, &mg, sizeof mg);
  }
  hdr_seal(w);
}

/* ---- offload ------------------------------------------------------------------------ */

static uint64_t new_generation(const kvp__seq *s) {
  static _Atomic uint64_t counter;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t v[4] = {(uint64_t)ts.tv_sec, (uint64_t)ts.tv_nsec, (uint64_t)getpid() << 32 | atomic_fetch_add(&counter, 1),
                   s->id};
  return kvp__xxh64(v, sizeof v, (uint64_t)(uintptr_t)s);
}

/* Delete what a failed offload wrote under its generation (best effort:
 * the server may be gone; the manifest never names them, the TTL ends them). */
static void drop_parts(kvp_store *st, uint64_t seq, uint64_t gen, const groups *gs, uint32_t upto) {
  for (uint32_t j = 0; j < upto; j += 64) {
    key_t_ names[64];
    const char *kp[64];
    uint32_t n = 0;
    for (uint32_t i = j; i < upto && i < j + 64; i++)
      if (gs->g[i].kind == GROUP_PART) {
        key_part(st, seq, gen, gs->g[i].index, names[n]);
        kp[n] = names[n];
        n++;
      }
    if (n && kvp__store_del(st, n, kp)) return;
  }
}

static int offload_locked(kvp_pool *pool, kvp__seq *s, kvp_store *st, uint64_t *moved) {
  groups gs = {0};
  int rc = collect(pool, s, &gs);
  if (rc) return rc;
  uint64_t gen = new_generation(s);
  uint32_t ncontent = 0;
  for (uint32_t j = 0; j < gs.ng; j++) ncontent += gs.g[j].kind == GROUP_CONTENT;
  uint64_t (*ckeys)[2] = kvp__meta_alloc(NULL, ncontent * sizeof *ckeys + 1);
  bool *present = kvp__meta_calloc(NULL, ncontent * sizeof *present + 1);
  if (!ckeys || !present) rc = kvp__err(KVP_ENOMEM, "offload of seq %llu: key list", (unsigned long long)s->id);
  for (uint32_t j = 0, c = 0; !rc && j < gs.ng; j++)
    if (gs.g[j].kind == GROUP_CONTENT) ckeys[c][0] = gs.g[j].key[0], ckeys[c++][1] = gs.g[j].key[1];
  if (!rc) rc = kvp__store_content_present(st, ncontent, (const uint64_t(*)[2])ckeys, present);
  putq q;
  if (!rc) rc = kvp__putq_init(&q, pool, st);
  else memset(&q, 0, sizeof q);
  uint32_t j = 0;
  for (uint32_t c = 0; !rc && j < gs.ng; j++) {
    const group *g = &gs.g[j];
    bool content = g->kind == GROUP_CONTENT;
    if (content && present[c++]) continue; /* the store has this chunk already */
    wbuf *w;
    char *key;
    if ((rc = kvp__putq_slot(&q, kvp__blob_slot_bytes(pool, gs.items + g->first, g->n), &w, &key))) break;
    if (content) key_content(st, g->key, key);
    else key_part(st, s->id, gen, g->index, key);
    rc = kvp__blob_build_group(pool, gs.items + g->first, g->n, content ? g->key[0] : gen, content ? g->key[1] : g->index, w,
                               &q);
    if (rc) break;
    kvp__putq_push(&q);
  }
  if (!rc) rc = kvp__putq_flush(&q);
  if (!rc) { /* the manifest last: it names a complete set */
    wbuf w = {0};
    char mkey[KVP__STORE_KEY_MAX];
    key_manifest(st, s->id, mkey);
    build_manifest(pool, s, gen, &gs, &w);
    if (w.oom) rc = kvp__err(KVP_ENOMEM, "manifest of seq %llu", (unsigned long long)s->id);
    else {
      const char *kp[1] = {mkey};
      const void *vp[1] = {w.p};
      size_t lp[1] = {w.n};
      if (!(rc = kvp__store_put(st, 1, kp, vp, lp))) q.written += w.n;
    }
    wfree(&w);
  }
  if (rc) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvp__err_detail());
    drop_parts(st, s->id, gen, &gs, gs.ng);
    kvp__err(rc, "offload of seq %llu: %s (the sequence stays in the pool)", (unsigned long long)s->id, msg);
  }
  *moved = q.written;
  kvp__putq_free(&q);
  kvp__meta_free(NULL, ckeys, ncontent * sizeof *ckeys + 1);
  kvp__meta_free(NULL, present, ncontent * sizeof *present + 1);
  groups_free(&gs);
  return rc;
}

KVP_API int kvp_seq_offload(kvp_pool *pool, uint64_t seq, kvp_store *st) {
  kvp__seq *s = NULL;
  int rc = kvp__store_lock_live(pool, seq, st, "offload", &s);
  if (rc) return rc;
  uint64_t moved = 0;
  if (atomic_load_explicit(&s->in_step, memory_order_relaxed))
    rc = kvp__err(KVP_EBUSY, "offload of seq %llu: a step is open (offload between steps)", (unsigned long long)seq);
  else if (s->pol && s->pol->vt)
    rc = kvp__err(KVP_ENOTSUP, "offload of seq %llu: its policy %s keeps per-sequence state the store does not carry",
                  (unsigned long long)seq, s->pol->vt->name);
  else if (!(rc = kvp__store_pool_ok(pool, "offload")) && !(rc = offload_locked(pool, s, st, &moved))) {
    kvp__store_count(pool, moved, 0, 0);
    kvp__seq_remove(pool, s);
  }
  kvp__unlock(pool);
  return rc;
}


/* ---- manifest reading ------------------------------------------------------------------ */

typedef struct manifest {
  man_seq m;
  const uint32_t *step_pos_raw, *plan_raw; /* unaligned views: copied out with memcpy */
  const unsigned char *pkeys, *runs, *streams;
  const man_group *groups_raw;
  uint32_t ngroups;
} manifest;

static int man_parse(kvp_pool *pool, uint64_t seq, const char *key, const void *data, size_t len, manifest *mf) {
  blob_hdr h;
  rbuf r;
  int rc = kvp__blob_hdr_check(pool, key, data, len, KIND_MANIFEST, &h, &r);
  if (rc) return rc;
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads, nw = (H + 63) / 64;
#define BAD(...) kvp__err(KVP_EFORMAT, __VA_ARGS__)
  if (!rget(&r, &mf->m, sizeof mf->m)) return BAD("store key %s: manifest truncated", key);
  man_seq *m = &mf->m;
  if (m->seq != seq || h.tag[0] != seq)
    return BAD("store key %s: manifest of sequence %llu, not %llu", key, (unsigned long long)m->seq,
               (unsigned long long)seq);
  if (m->mode > KVP_SEQ_STEP || m->nwords != nw || m->n_steps > KVP_MAX_SEQ_TOKENS || m->n_plan > KVP_MAX_SEQ_TOKENS ||
      m->n_pkeys > KVP_MAX_SEQ_TOKENS / pool->chunk_tokens || m->max_hit > m->n_pkeys || m->next_reg > m->n_pkeys ||
      !(m->budget_fraction >= 0 && m->budget_fraction <= 1))
    return BAD("store key %s: manifest fields out of range (mode %u, %u steps, %u plan entries, %u keys)", key, m->mode,
               m->n_steps, m->n_plan, m->n_pkeys);
  mf->step_pos_raw = (const uint32_t *)r.p;
  if (!rget(&r, NULL, ((size_t)m->n_steps + 1) * 4)) return BAD("store key %s: step table truncated", key);
  uint32_t prev = 0;
  for (uint32_t k = 0; k <= m->n_steps; k++) {
    uint32_t v;
    memcpy(&v, (const unsigned char *)mf->step_pos_raw + 4ull * k, 4);
    if ((k == 0 && v) || (k && v <= prev)) return BAD("store key %s: step table not increasing from 0 at step %u", key, k);
    prev = v;
  }
  if (prev != m->n_positions) return BAD("store key %s: %u positions, the step table ends at %u", key, m->n_positions, prev);
  mf->plan_raw = (const uint32_t *)r.p;
  if (!rget(&r, NULL, (size_t)m->n_plan * 4)) return BAD("store key %s: plan truncated", key);
  mf->pkeys = r.p;
  if (!rget(&r, NULL, (size_t)m->n_pkeys * 16)) return BAD("store key %s: prefix keys truncated", key);
  mf->runs = r.p;
  for (uint32_t l = 0; l < L; l++) {
    uint32_t nr, end = 0;
    if (!rget(&r, &nr, 4) || nr > m->n_steps) return BAD("store key %s: runs of layer %u", key, l);
    for (uint32_t i = 0; i < nr; i++) {
      uint32_t v[4], s0p, s1p;
      if (!rget(&r, v, sizeof v) || !rget(&r, NULL, nw * 8ull)) return BAD("store key %s: runs truncated", key);
      if (v[0] < end || v[0] >= v[2] || v[2] > m->n_steps) return BAD("store key %s: layer %u run %u steps", key, l, i);
      memcpy(&s0p, (const unsigned char *)mf->step_pos_raw + 4ull * v[0], 4);
      memcpy(&s1p, (const unsigned char *)mf->step_pos_raw + 4ull * v[2], 4);
      if (v[1] != s0p || v[3] != s1p) return BAD("store key %s: layer %u run %u positions", key, l, i);
      end = v[2];
    }
  }
  mf->streams = r.p;
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t hd = 0; hd < H; hd++) {
      uint32_t v[2];
      uint8_t has[4];
      if (!rget(&r, v, sizeof v) || !rget(&r, has, sizeof has)) return BAD("store key %s: streams truncated", key);
      for (int kv = 0; kv < 2; kv++) {
        size_t sb = kvp__cstate_bytes(pool, l, kv);
        if (has[kv] > 1 || (has[kv] && !sb) || (has[kv] && !rget(&r, NULL, sb)))
          return BAD("store key %s: codec state of layer %u head %u %c", key, l, hd, "KV"[kv]);
      }
    }
  mf->groups_raw = (const man_group *)r.p;
  mf->ngroups = h.n_items;
  if (r.left != (size_t)h.n_items * sizeof(man_group))
    return BAD("store key %s: %zu bytes for %u groups", key, r.left, h.n_items);
  uint64_t blocks = 0;
  for (uint32_t j = 0; j < mf->ngroups; j++) {
    man_group g;
    memcpy(&g, mf->groups_raw + j, sizeof g);
    if (g.kind > GROUP_CONTENT || !g.nblocks || (j && g.index <= prev) ||
        (uint64_t)g.index * pool->chunk_tokens >= m->n_positions)
      return BAD("store key %s: group %u (chunk %u) out of order or range", key, j, g.index);
    prev = g.index;
    blocks += g.nblocks;
  }
  (void)blocks;
#undef BAD
  return KVP_OK;
}

/* The sequence as the manifest describes it, with no blocks yet. */
static int man_build(kvp_pool *pool, const manifest *mf, kvp__seq **out) {
  const man_seq *m = &mf->m;
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads, nw = m->nwords;
  uint32_t *plan = m->n_plan ? kvp__meta_alloc(NULL, m->n_plan * 4ull) : NULL;
  if (m->n_plan && !plan) return kvp__err(KVP_ENOMEM, "restore: plan");
  if (plan) memcpy(plan, mf->plan_raw, m->n_plan * 4ull);
  kvp__seq *s = kvp__seq_alloc(pool, m->seq, plan, m->n_plan);
  kvp__meta_free(NULL, plan, m->n_plan * 4ull);
  if (!s) return kvp__err(KVP_ENOMEM, "metadata of sequence %llu", (unsigned long long)m->seq);
  int rc = KVP_OK;
  uint32_t cap = m->n_steps + 2;
  uint32_t *sp = kvp__meta_realloc(&pool->meta, s->step_pos, s->step_pos_cap * sizeof *sp, cap * sizeof *sp);
  if (!sp) rc = kvp__err(KVP_ENOMEM, "step table of sequence %llu", (unsigned long long)m->seq);
  else {
    s->step_pos = sp;
    s->step_pos_cap = cap;
    memcpy(sp, mf->step_pos_raw, (m->n_steps + 1) * 4ull);
  }
  s->mode = (kvp_seq_mode)m->mode;
  s->budget_fraction = m->budget_fraction;
  s->pol = pool->policy;
  atomic_init(&s->n_steps, m->n_steps);
  atomic_init(&s->n_positions, m->n_positions);
  if (!rc && m->n_pkeys) {
    if (!(s->pkeys = kvp__meta_alloc(&pool->meta, m->n_pkeys * sizeof *s->pkeys)))
      rc = kvp__err(KVP_ENOMEM, "content keys of sequence %llu", (unsigned long long)m->seq);
    else {
      memcpy(s->pkeys, mf->pkeys, m->n_pkeys * sizeof *s->pkeys);
      s->n_pkeys = m->n_pkeys;
      s->max_hit = m->max_hit;
      s->next_reg = m->next_reg;
    }
  }
  rbuf r = {mf->runs, SIZE_MAX, false};
  for (uint32_t l = 0; !rc && l < L; l++) {
    uint32_t nr = 0;
    rget(&r, &nr, 4);
    kvp__run **tail = &s->layers[l].runs;
    for (uint32_t i = 0; !rc && i < nr; i++) {
      uint32_t v[4];
      uint64_t mask[KVP_MAX_KV_HEADS / 64];
      rget(&r, v, sizeof v);
      rget(&r, mask, nw * 8ull);
      kvp__run *run = kvp__run_new(pool, v[0], v[1], v[2], v[3], mask);
      if (!run) rc = kvp__err(KVP_ENOMEM, "runs of sequence %llu", (unsigned long long)m->seq);
      else {
        *tail = run;
        tail = &run->next;
        s->layers[l].last = run;
      }
    }
  }
  r = (rbuf){mf->streams, SIZE_MAX, false};
  for (uint32_t i = 0; !rc && i < L * H; i++) {
    uint32_t v[2];
    uint8_t has[4];
    rget(&r, v, sizeof v);
    rget(&r, has, sizeof has);
    kvp__stream *st = &s->streams[i];
    atomic_init(&st->retained_tokens, v[0]);
    atomic_init(&st->evicted_tokens, v[1]);
    for (int kv = 0; !rc && kv < 2; kv++)
      if (has[kv]) {
        void *state;
        if (!(rc = kvp__cstate_get(pool, st, i / H, kv, &state))) memcpy(state, r.p, kvp__cstate_bytes(pool, i / H, kv));
        rget(&r, NULL, kvp__cstate_bytes(pool, i / H, kv));
      }
  }
  if (rc) {
    kvp__seq_build_undo(pool, s);
    kvp__seq_free_struct(pool, s);
    return rc;
  }
  *out = s;
  return KVP_OK;
}

/* ---- restore ---------------------------------------------------------------------------- */

/* Link block b at the end of stream lh of s (b's position after its tail). */
static int stream_push(kvp_pool *pool, kvp__seq *s, uint32_t lh, kvp__block *b, const char *key) {
  kvp__stream *st = &s->streams[lh];
  if (st->tail && b->pos0 < st->tail->blk->pos0 + st->tail->blk->n_tokens)
    return kvp__err(KVP_EFORMAT, "store key %s: block at position %u overlaps the one before it", key, b->pos0);
  kvp__bref *r = kvp__meta_calloc(&pool->meta, sizeof *r);
  if (!r) return kvp__err(KVP_ENOMEM, "restore: block reference");
  r->blk = b;
  if (st->tail) st->tail->next = r;
  else st->blocks = r;
  st->tail = r;
  return KVP_OK;
}

typedef struct restore_ctx {
  kvp_pool *pool;
  kvp__seq *s;
  kvp_store *st;
  const manifest *mf;
  uint32_t *gidx;     /* [nfetch]: group of each fetched key */
  char (*keys)[KVP__STORE_KEY_MAX];
  kvp__chunk **local; /* [ngroups]: a content group found in the table, or NULL */
  uint32_t next;      /* groups linked so far */
  parsed p;           /* scratch */
  kvp__block **fresh; /* [ngroups][LH]: fresh content blocks to register */
  uint64_t bytes;     /* blob bytes read */
} restore_ctx;

static man_group group_at(const manifest *mf, uint32_t j) {
  man_group g;
  memcpy(&g, mf->groups_raw + j, sizeof g);
  return g;
}

/* Hold the local content groups up to (not including) group j: one
 * chunk-level reference each, as an attach takes (an undo lets go). */
static int link_local(restore_ctx *c, uint32_t upto) {
  for (; c->next < upto; c->next++) {
    kvp__chunk *ch = c->local[c->next];
    kvp__assert(ch);
    kvp__prefix_hold(c->s, ch);
  }
  return KVP_OK;
}

static int restore_one(void *vctx, uint32_t i, const void *data, size_t len) {
  restore_ctx *c = vctx;
  uint32_t j = c->gidx[i], LH = c->pool->cfg.n_layers * c->pool->cfg.n_kv_heads;
  const char *key = c->keys[i];
  if (!data) return kvp__err(KVP_ENOENT, "restore of seq %llu: store key %s is missing (expired or deleted)",
                             (unsigned long long)c->s->id, key);
  int rc = link_local(c, j);
  if (rc) return rc;
  man_group g = group_at(c->mf, j);
  bool content = g.kind == GROUP_CONTENT;
  uint64_t tag[2] = {content ? g.key[0] : c->mf->m.gen, content ? g.key[1] : g.index};
  if ((rc = kvp__blob_parse_group(c->pool, c->s->id, key, data, len, g.index, tag, content, g.nblocks, &c->p))) return rc;
  c->bytes += len;
  for (uint32_t k = 0; k < c->p.n; k++) {
    if ((rc = stream_push(c->pool, c->s, c->p.lh[k], c->p.blk[k], key))) {
      (void)kvp__blob_drain(c->pool); /* their staged copies landed */
      for (; k < c->p.n; k++) kvp__block_destroy(c->pool, c->p.blk[k]); /* the rest are nobody's */
      return rc;
    }
    if (content) c->fresh[(size_t)j * LH + k] = c->p.blk[k];
  }
  c->next = j + 1;
  return KVP_OK;
}

static int restore_locked(kvp_pool *pool, uint64_t seq, kvp_store *st, const manifest *mf, const char *mkey) {
  uint32_t LH = pool->cfg.n_layers * pool->cfg.n_kv_heads, ng = mf->ngroups;
  kvp__seq *s = NULL;
  int rc = man_build(pool, mf, &s);
  if (rc) return rc;
  restore_ctx c = {pool, s, st, mf, NULL, NULL, NULL, 0, {0}, NULL, 0};
  c.p.stream = kvp__store_stream(st);
  c.gidx = kvp__meta_alloc(NULL, ng * sizeof *c.gidx + 1);
  c.keys = kvp__meta_alloc(NULL, ng * sizeof *c.keys + 1);
  c.local = kvp__meta_calloc(NULL, ng * sizeof *c.local + 1);
  c.fresh = kvp__meta_calloc(NULL, (size_t)ng * LH * sizeof *c.fresh + 1);
  const char **kp = kvp__meta_alloc(NULL, (ng + 1) * sizeof *kp);
  if (!c.gidx || !c.keys || !c.local || !c.fresh || !kp) rc = kvp__err(KVP_ENOMEM, "restore of seq %llu: lists",
                                                                      (unsigned long long)seq);
  uint32_t nfetch = 0, nlocal = 0, n_hold = s->n_pkeys; /* n_hold: chunk references the sequence may take */
  uint64_t need = 0;
  for (uint32_t j = 0; !rc && j < ng; j++) {
    man_group g = group_at(mf, j);
    kvp__chunk *ch = g.kind == GROUP_CONTENT ? kvp__prefix_find(pool, g.key) : NULL;
    if (g.kind == GROUP_CONTENT && g.index >= n_hold) n_hold = g.index + 1;
    if (ch && ch->index == g.index) {
      c.local[j] = ch; /* shared with the pool's copy: nothing to move */
      nlocal++;
      continue;
    }
    if (g.kind == GROUP_CONTENT && g.nblocks != LH) {
      rc = kvp__err(KVP_EFORMAT, "store key %s: content group of chunk %u lists %u blocks", mkey, g.index, g.nblocks);
      break;
    }
    need += g.alloc_bytes;
    if (g.kind == GROUP_CONTENT) key_content(st, g.key, c.keys[nfetch]);
    else key_part(st, seq, mf->m.gen, g.index, c.keys[nfetch]);
    kp[nfetch] = c.keys[nfetch];
    c.gidx[nfetch++] = j;
  }
  if (!rc && !kvp__alloc_fits_bytes(&pool->alloc, need) && pool->limbo) kvp__reclaim(pool);
  if (!rc && !kvp__alloc_fits_bytes(&pool->alloc, need))
    rc = kvp__err(KVP_EBUDGET, "restore of seq %llu (key %s): %llu allocated bytes would pass the budget (%llu of %llu "
                  "in use)", (unsigned long long)seq, mkey, (unsigned long long)need,
                  (unsigned long long)pool->alloc.ledger.allocated.current,
                  (unsigned long long)pool->alloc.ledger.budget_bytes);
  if (!rc && nlocal) rc = kvp__prefix_holds_make(pool, s, n_hold);
  if (!rc && nfetch) rc = kvp__store_get(st, nfetch, kp, restore_one, &c);
  if (!rc) rc = link_local(&c, ng);
  if (!rc && (rc = kvp__seq_validate(pool, s))) {
    char msg[400];
    snprintf(msg, sizeof msg, "%s", kvp__err_detail());
    rc = kvp__err(KVP_EFORMAT, "store key %s: the blobs do not make a valid sequence: %s", mkey, msg);
  }
  if (rc) {
    (void)kvp__blob_drain(pool); /* no staged copy still fills the pages the undo frees */
    kvp__seq_build_undo(pool, s);
    kvp__seq_free_struct(pool, s);
  } else {
    kvp__seq_build_commit(pool, s);
    kvp__seq_publish(pool, s);
    for (uint32_t j = 0; j < ng; j++) { /* fresh content chunks become shareable here too */
      man_group g = group_at(mf, j);
      kvp__block **row = c.fresh + (size_t)j * LH;
      if (g.kind == GROUP_CONTENT && row[0] && !kvp__prefix_find(pool, g.key))
        (void)kvp__prefix_adopt(pool, s, g.key, g.index, row, n_hold); /* out of memory: not shared, that is all */
    }
    kvp__store_count(pool, 0, c.bytes, 0);
    /* the store's copy goes (best effort: a failure leaves garbage the TTL ends) */
    uint32_t nparts = 0;
    for (uint32_t i = 0; i < nfetch; i++)
      if (group_at(mf, c.gidx[i]).kind == GROUP_PART) kp[nparts++] = c.keys[i];
    kp[nparts++] = mkey;
    kvp__store_del(st, nparts, kp);
  }
  kvp__parsed_free(&c.p);
  kvp__meta_free(NULL, c.gidx, ng * sizeof *c.gidx + 1);
  kvp__meta_free(NULL, c.keys, ng * sizeof *c.keys + 1);
  kvp__meta_free(NULL, c.local, ng * sizeof *c.local + 1);
  kvp__meta_free(NULL, c.fresh, (size_t)ng * LH * sizeof *c.fresh + 1);
  kvp__meta_free(NULL, kp, (ng + 1) * sizeof *kp);
  return rc;
}

typedef struct blob_copy {
  unsigned char *p;
  size_t n;
  bool found;
} blob_copy;

static int copy_blob(void *ctx, uint32_t i, const void *data, size_t len) {
  blob_copy *b = ctx;
  (void)i;
  if (!data) return KVP_OK;
  if (!(b->p = kvp__meta_alloc(NULL, len + 1))) return kvp__err(KVP_ENOMEM, "manifest copy of %zu bytes", len);
  memcpy(b->p, data, len);
  b->n = len;
  b->found = true;
  return KVP_OK;
}

KVP_API int kvp_seq_restore(kvp_pool *pool, uint64_t seq, kvp_store *st) {
  if (!pool || !st) return kvp__err(KVP_EINVAL, "restore of seq %llu: %s is NULL", (unsigned long long)seq,
                                    pool ? "store" : "pool");
  kvp__lock(pool);
  kvp__rcu_read_lock();
  bool live = kvp__seq_find(pool, seq) != NULL;
  kvp__rcu_read_unlock();
  int rc = live ? kvp__err(KVP_EEXIST, "restore: sequence %llu is live in the pool", (unsigned long long)seq)
                : kvp__store_pool_ok(pool, "restore");
  char mkey[KVP__STORE_KEY_MAX];
  key_manifest(st, seq, mkey);
  const char *kp[1] = {mkey};
  blob_copy man = {0};
  if (!rc) rc = kvp__store_get(st, 1, kp, copy_blob, &man);
  if (!rc && !man.found)
    rc = kvp__err(KVP_ENOENT, "restore of seq %llu: no offloaded sequence under store key %s", (unsigned long long)seq,
                  mkey);
  manifest mf;
  if (!rc) rc = man_parse(pool, seq, mkey, man.p, man.n, &mf);
  if (!rc) rc = restore_locked(pool, seq, st, &mf, mkey);
  if (!rc) kvp__store_count(pool, 0, man.n, 0);
  kvp__meta_free(NULL, man.p, man.n + 1);
  kvp__unlock(pool);
  return rc;
}


/* ---- the fuzzers' door ------------------------------------------------------------------ */

int kvp__store_fuzz_parse(kvp_pool *pool, int kind, uint32_t n_items, uint32_t index, int content, const uint64_t *tag,
                          const void *payload, size_t len) {
  wbuf w = {0};
  uint64_t seq = tag[0];
  blob_hdr h = hdr_for(pool, kind == 1 ? KIND_MANIFEST : KIND_GROUP, n_items, tag[0], tag[1]);
  wput(&w, &h, sizeof h);
  wput(&w, payload, len);
  hdr_seal(&w);
  if (w.oom) return kvp__err(KVP_ENOMEM, "fuzz blob");
  int rc;
  kvp__lock(pool);
  if (kind == 1) {
    manifest mf;
    memset(&mf, 0, sizeof mf);
    kvp__seq *s = NULL;
    rc = man_parse(pool, seq, "fuzz", w.p, w.n, &mf);
    if (!rc && !(rc = man_build(pool, &mf, &s))) {
      kvp__seq_build_undo(pool, s);
      kvp__seq_free_struct(pool, s);
    }
  } else {
    parsed pr = {0};
    rc = kvp__blob_parse_group(pool, seq, "fuzz", w.p, w.n, index, tag, content != 0, n_items, &pr);
    (void)kvp__blob_drain(pool);
    if (!rc) kvp__parsed_destroy(pool, &pr);
    kvp__parsed_free(&pr);
  }
  kvp__unlock(pool);
  wfree(&w);
  return rc;
}

