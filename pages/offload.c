/*
 * pages/offload.c - the store tier seen from the pool: a sequence's blocks
 * written out as blobs and freed (kvp_seq_offload), brought back all or
 * nothing (kvp_seq_restore), and prefix chunks published under their
 * content key (kvp_prefix_publish) for another pool, in this process or
 * another, to attach (kvp_prefix_fetch) instead of recomputing them.
 *
 * Blobs (little-endian, as the host lays out the structs below):
 *
 *   blob     | blob_hdr (72 B) | payload (payload_bytes) |
 *   hdr      magic "KVPB", version, kind, geometry (L, H, D, block tokens,
 *            dtypes), codec fingerprint, payload bytes, XXH64 of the
 *            payload, tag (content key, or generation and group of a part)
 *   group    n_items x ( blk_rec (60 B) | K pages | V pages ): the blocks
 *            of one chunk g, every block whose pos0 / block_tokens = g,
 *            in (layer, head, position) order
 *   manifest man_seq | step_pos[n_steps + 1] | plan[n_plan] |
 *            pkeys[n_pkeys][2] | per layer: nruns, runs (s0 p0 s1 p1 mask) |
 *            per stream: retained, evicted, state flags, codec states |
 *            n_items x man_group (kind, chunk, blocks, key, allocated bytes)
 *
 * Keys (prefix from the store's URL):
 *   <prefix>seq:<id>                 the manifest, written last
 *   <prefix>seq:<id>:<gen>:<g>       group g of that offload (gen: random)
 *   <prefix>blk:<key 32 hex>         a content chunk: the L x H full blocks
 *                                    of one prompt chunk, shared by content
 *
 * Nothing in a blob is trusted before it is checked: the header against
 * the blob's length and this pool (version, geometry, codecs), the
 * checksum against the payload, then every length against what is left,
 * every record against the pool's layouts, and the rebuilt sequence with
 * kvp_check's own walk. Failures name the key and change nothing: an
 * offload frees only after every blob and the manifest are written; a
 * restore publishes only once every blob was read and checked.
 */
#include "../store/store.h"
#include "policy.h"

#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BLOB_MAGIC 0x4250564Bu /* "KVPB" */
#define BLOB_VERSION 1u
enum { KIND_MANIFEST = 1, KIND_GROUP = 2 };
enum { GROUP_PART = 0, GROUP_CONTENT = 1 };
#define PUT_BATCH_BYTES (64ull << 20) /* blob bytes built before one pipelined write */

typedef struct blob_hdr {
  uint32_t magic;         /* BLOB_MAGIC */
  uint16_t version;       /* BLOB_VERSION */
  uint16_t kind;          /* KIND_* */
  uint32_t n_layers, n_kv_heads, head_dim, block_tokens; /* geometry */
  uint32_t dtypes;        /* k_dtype | v_dtype << 8 */
  uint32_t n_items;       /* group: block records; manifest: groups */
  uint64_t codec_fp;      /* the pool's codec fingerprint */
  uint64_t payload_bytes; /* bytes after the header */
  uint64_t checksum;      /* XXH64 of the payload */
  uint64_t tag[2];        /* content key, or (generation, chunk) of a part, or (seq, generation) */
} blob_hdr;
_Static_assert(sizeof(blob_hdr) == 72, "blob header layout");

typedef struct blk_rec {
  uint16_t layer, head;                      /* stream */
  uint32_t pos0, cap_tokens, n_tokens;       /* positions, capacity, tokens held */
  uint8_t raw, sealed, npages[2];            /* raw tail pages; sealed; pages per side */
  uint8_t types[2][KVP_CODEC_MAX_PAGES];     /* page types */
  uint32_t bytes[2][KVP_CODEC_MAX_PAGES];    /* requested bytes per page */
} blk_rec;
_Static_assert(sizeof(blk_rec) == 60, "block record layout");

typedef struct man_seq {
  uint64_t seq, gen;                         /* id, generation of this offload */
  uint32_t mode, n_steps, n_positions, n_plan; /* the step table */
  uint32_t n_pkeys, max_hit, next_reg, nwords; /* prefix keys; mask words of a run */
  double budget_fraction;
} man_seq;

typedef struct man_group {
  uint8_t kind, pad[3];  /* GROUP_* */
  uint32_t index;        /* chunk g */
  uint32_t nblocks;      /* records in the group blob */
  uint32_t pad2;
  uint64_t key[2];       /* content key (GROUP_CONTENT) */
  uint64_t alloc_bytes;  /* size-class bytes of its pages */
} man_group;
_Static_assert(sizeof(man_group) == 40, "manifest group layout");

/* ---- byte buffers ------------------------------------------------------------- */

typedef struct wbuf {
  unsigned char *p;
  size_t n, cap;
  bool oom;
} wbuf;

static void wput(wbuf *w, const void *src, size_t n) {
  if (w->oom) return;
  if (w->n + n > w->cap) {
    size_t nc = w->cap ? w->cap : 4096;
    while (nc < w->n + n) nc *= 2;
    unsigned char *np = kvp__meta_realloc(NULL, w->p, w->cap, nc);
    if (!np) {
      w->oom = true;
      return;
    }
    w->p = np;
    w->cap = nc;
  }
  if (src) memcpy(w->p + w->n, src, n);
  w->n += n;
}
static void wfree(wbuf *w) {
  kvp__meta_free(NULL, w->p, w->cap);
  *w = (wbuf){0};
}

typedef struct rbuf {
  const unsigned char *p;
  size_t left;
  bool bad; /* a read past the end */
} rbuf;

static bool rget(rbuf *r, void *dst, size_t n) {
  if (r->bad || n > r->left) {
    r->bad = true;
    return false;
  }
  if (dst) memcpy(dst, r->p, n);
  r->p += n;
  r->left -= n;
  return true;
}

/* ---- keys and headers --------------------------------------------------------- */

typedef char key_t_[KVP__STORE_KEY_MAX];

static void key_manifest(kvp_store *st, uint64_t seq, char *k) {
  snprintf(k, KVP__STORE_KEY_MAX, "%sseq:%llu", kvp__store_prefix(st), (unsigned long long)seq);
}
static void key_part(kvp_store *st, uint64_t seq, uint64_t gen, uint32_t g, char *k) {
  snprintf(k, KVP__STORE_KEY_MAX, "%sseq:%llu:%016llx:%u", kvp__store_prefix(st), (unsigned long long)seq,
           (unsigned long long)gen, g);
}
static void key_content(kvp_store *st, const uint64_t *key, char *k) {
  snprintf(k, KVP__STORE_KEY_MAX, "%sblk:%016llx%016llx", kvp__store_prefix(st), (unsigned long long)key[0],
           (unsigned long long)key[1]);
}

static blob_hdr hdr_for(const kvp_pool *pool, uint16_t kind, uint32_t n_items, uint64_t t0, uint64_t t1) {
  const kvp_config *c = &pool->cfg;
  return (blob_hdr){BLOB_MAGIC, BLOB_VERSION, kind, c->n_layers, c->n_kv_heads, c->head_dim, pool->chunk_tokens,
                    (uint32_t)c->k_dtype | (uint32_t)c->v_dtype << 8, n_items, pool->codec_fp, 0, 0, {t0, t1}};
}

/* Seal a blob whose payload follows the header in w. */
static void hdr_seal(wbuf *w) {
  if (w->oom) return;
  blob_hdr h;
  memcpy(&h, w->p, sizeof h);
  h.payload_bytes = w->n - sizeof h;
  h.checksum = kvp__xxh64(w->p + sizeof h, h.payload_bytes, 0);
  memcpy(w->p, &h, sizeof h);
}

/* Check a blob's header and checksum; r then reads its payload. */
static int hdr_check(const kvp_pool *pool, const char *key, const void *data, size_t len, uint16_t kind,
                     blob_hdr *h, rbuf *r) {
  const kvp_config *c = &pool->cfg;
  if (len < sizeof *h)
    return kvp__err(KVP_EFORMAT, "store key %s: truncated blob (%zu bytes, a header alone is %zu)", key, len, sizeof *h);
  memcpy(h, data, sizeof *h);
  if (h->magic != BLOB_MAGIC) return kvp__err(KVP_EFORMAT, "store key %s: not a kvpool blob (magic %08x)", key, h->magic);
  if (h->version != BLOB_VERSION)
    return kvp__err(KVP_EFORMAT, "store key %s: blob format version %u, this library reads version %u", key, h->version,
                    BLOB_VERSION);
  if (h->kind != kind)
    return kvp__err(KVP_EFORMAT, "store key %s: blob of kind %u where kind %u was expected", key, h->kind, kind);
  if (h->n_layers != c->n_layers || h->n_kv_heads != c->n_kv_heads || h->head_dim != c->head_dim ||
      h->block_tokens != pool->chunk_tokens || h->dtypes != ((uint32_t)c->k_dtype | (uint32_t)c->v_dtype << 8))
    return kvp__err(KVP_EFORMAT, "store key %s: blob of another geometry (layers %u, heads %u, head_dim %u, block "
                    "tokens %u, dtypes %#x; this pool: %u, %u, %u, %u, %#x)", key, h->n_layers, h->n_kv_heads,
                    h->head_dim, h->block_tokens, h->dtypes, c->n_layers, c->n_kv_heads, c->head_dim, pool->chunk_tokens,
                    (uint32_t)c->k_dtype | (uint32_t)c->v_dtype << 8);
  if (h->codec_fp != pool->codec_fp)
    return kvp__err(KVP_EFORMAT, "store key %s: blob written under other codecs (fingerprint %016llx, this pool's "
                    "%016llx): its pages cannot be read here", key, (unsigned long long)h->codec_fp,
                    (unsigned long long)pool->codec_fp);
  if (h->payload_bytes != len - sizeof *h)
    return kvp__err(KVP_EFORMAT, "store key %s: truncated or padded blob: header says %llu payload bytes, the blob "
                    "holds %zu", key, (unsigned long long)h->payload_bytes, len - sizeof *h);
  const unsigned char *pl = (const unsigned char *)data + sizeof *h;
  uint64_t sum = kvp__xxh64(pl, h->payload_bytes, 0);
  if (sum != h->checksum)
    return kvp__err(KVP_EFORMAT, "store key %s: checksum mismatch (stored %016llx, computed %016llx): the blob is "
                    "corrupt", key, (unsigned long long)h->checksum, (unsigned long long)sum);
  *r = (rbuf){pl, h->payload_bytes, false};
  return KVP_OK;
}

/* ---- what can move ------------------------------------------------------------- */

static int pool_ok(kvp_pool *pool, const char *what) {
  if (pool->cfg.flags & KVP_POOL_DRY)
    return kvp__err(KVP_ENOTSUP, "%s: the pool is dry (KVP_POOL_DRY): it holds no payload to move", what);
  for (uint32_t l = 0; l < pool->cfg.n_layers; l++)
    if (kvp__layer_rowwise(pool, l))
      return kvp__err(KVP_ENOTSUP, "%s: layer %u's codec %s lays out its blocks row by row; the store tier does not "
                      "move such blocks yet", what, l, pool->bind[2 * l].vt->name);
  if (pool->policy && pool->policy->vt)
    return kvp__err(KVP_ENOTSUP, "%s: the pool's policy %s keeps per-sequence state the store does not carry", what,
                    pool->policy->vt->name);
  if (!pool->chunk_tokens)
    return kvp__err(KVP_ENOTSUP, "%s: the pool's layers have different block sizes; the store tier moves chunks of "
                    "one size (set config.block_tokens)", what);
  return KVP_OK;
}

/* ---- groups of a sequence ------------------------------------------------------- */

typedef struct item {
  kvp__block *b;  /* the block */
  uint32_t lh;    /* its stream: layer * H + head */
} item;

typedef struct group {
  uint32_t index;      /* chunk g */
  uint32_t first, n;   /* its items */
  uint8_t kind;        /* GROUP_* */
  uint64_t key[2];     /* content key */
  uint64_t alloc_bytes; /* size-class bytes */
} group;

typedef struct groups {
  item *items;      /* sorted by group, then stream, then position */
  uint64_t nitems;
  group *g;         /* non-empty groups, ascending */
  uint32_t ng;
} groups;

static void groups_free(groups *gs) {
  kvp__meta_free(NULL, gs->items, gs->nitems * sizeof *gs->items + 1);
  kvp__meta_free(NULL, gs->g, gs->ng * sizeof *gs->g + 1);
  *gs = (groups){0};
}

static uint64_t block_alloc_bytes(const kvp__block *b) {
  uint64_t n = 0;
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv]; i++) n += kvp__page_alloc_bytes(&b->pages[kv][i]);
  return n;
}

/* Every block of s by chunk (a counting sort over the streams' walks). */
static int collect(kvp_pool *pool, kvp__seq *s, groups *gs) {
  uint32_t bt = pool->chunk_tokens, LH = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  uint32_t nchunks = (atomic_load_explicit(&s->n_positions, memory_order_relaxed) + bt - 1) / bt + 1;
  uint64_t n = 0;
  for (uint32_t i = 0; i < LH; i++)
    for (const kvp__bref *r = s->streams[i].blocks; r; r = r->next) n++;
  uint32_t *cnt = kvp__meta_calloc(NULL, (nchunks + 1) * sizeof *cnt);
  gs->items = kvp__meta_alloc(NULL, n * sizeof *gs->items + 1);
  gs->nitems = n;
  if (!cnt || !gs->items) {
    kvp__meta_free(NULL, cnt, (nchunks + 1) * sizeof *cnt);
    groups_free(gs);
    return kvp__err(KVP_ENOMEM, "offload of seq %llu: block list", (unsigned long long)s->id);
  }
  for (uint32_t i = 0; i < LH; i++)
    for (const kvp__bref *r = s->streams[i].blocks; r; r = r->next) cnt[r->blk->pos0 / bt + 1]++;
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
    for (const kvp__bref *r = s->streams[i].blocks; r; r = r->next)
      gs->items[cnt[r->blk->pos0 / bt]++] = (item){r->blk, i};
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
static int build_group(kvp_pool *pool, const item *items, uint32_t n, uint64_t t0, uint64_t t1, wbuf *w) {
  uint32_t H = pool->cfg.n_kv_heads;
  blob_hdr h = hdr_for(pool, KIND_GROUP, n, t0, t1);
  w->n = 0;
  wput(w, &h, sizeof h);
  kvp__region *rg = &pool->alloc.region;
  for (uint32_t i = 0; i < n && !w->oom; i++) {
    const kvp__block *b = items[i].b;
    blk_rec r;
    memset(&r, 0, sizeof r);
    r.layer = (uint16_t)(items[i].lh / H);
    r.head = (uint16_t)(items[i].lh % H);
    r.pos0 = b->pos0;
    r.cap_tokens = b->cap_tokens;
    r.n_tokens = b->n_tokens;
    r.raw = b->raw;
    r.sealed = b->sealed;
    for (int kv = 0; kv < 2; kv++) {
      r.npages[kv] = b->npages[kv];
      for (unsigned p = 0; p < b->npages[kv]; p++) {
        r.types[kv][p] = (uint8_t)b->pages[kv][p].tag.type;
        r.bytes[kv][p] = b->pages[kv][p].requested_bytes;
      }
    }
    wput(w, &r, sizeof r);
    for (int kv = 0; kv < 2; kv++)
      for (unsigned p = 0; p < b->npages[kv] && !w->oom; p++) {
        size_t at = w->n, nb = b->pages[kv][p].requested_bytes;
        wput(w, NULL, nb);
        if (w->oom) break;
        int rc = rg->ops->read2d(rg, w->p + at, nb, b->pages[kv][p].off, nb, nb, 1, NULL);
        if (rc) return rc;
      }
  }
  if (w->oom) return kvp__err(KVP_ENOMEM, "staging buffer of a store blob");
  return KVP_OK;
}

/* Blobs waiting for one pipelined write. */
typedef struct putq {
  uint32_t n, cap;
  char (*keys)[KVP__STORE_KEY_MAX];
  wbuf *bufs;
  uint64_t bytes;   /* staged */
  uint64_t written; /* bytes written by flushes */
} putq;

static int putq_flush(kvp_pool *pool, kvp_store *st, putq *q) {
  if (!q->n) return KVP_OK;
  int rc = pool->alloc.region.ops->quiesce(&pool->alloc.region); /* device copies of the pages landed */
  const char *keys[64];
  const void *vals[64];
  size_t lens[64];
  for (uint32_t i = 0; i < q->n; i++) keys[i] = q->keys[i], vals[i] = q->bufs[i].p, lens[i] = q->bufs[i].n;
  if (!rc) rc = kvp__store_put(st, q->n, keys, vals, lens);
  if (!rc) q->written += q->bytes;
  q->n = 0;
  q->bytes = 0;
  return rc;
}

static void putq_free(putq *q) {
  for (uint32_t i = 0; i < q->cap; i++) wfree(&q->bufs[i]);
}

/* The next staging slot (flushing first when the batch is full). */
static int putq_slot(kvp_pool *pool, kvp_store *st, putq *q, wbuf **w, char **key) {
  if (q->n == q->cap || q->bytes >= PUT_BATCH_BYTES) {
    int rc = putq_flush(pool, st, q);
    if (rc) return rc;
  }
  *w = &q->bufs[q->n];
  *key = q->keys[q->n];
  return KVP_OK;
}

static void putq_push(putq *q) {
  q->bytes += q->bufs[q->n].n;
  q->n++;
}

/* Which content keys the store already holds (dedup). */
static int content_present(kvp_store *st, uint32_t n, const uint64_t (*keys)[2], bool *present) {
  key_t_ *names = kvp__meta_alloc(NULL, n * sizeof *names + 1);
  const char **kp = kvp__meta_alloc(NULL, n * sizeof *kp + 1);
  int rc = names && kp ? KVP_OK : kvp__err(KVP_ENOMEM, "store key list");
  for (uint32_t i = 0; !rc && i < n; i++) {
    key_content(st, keys[i], names[i]);
    kp[i] = names[i];
  }
  if (!rc && n) rc = kvp__store_exists(st, n, kp, present);
  kvp__meta_free(NULL, names, n * sizeof *names + 1);
  kvp__meta_free(NULL, kp, n * sizeof *kp + 1);
  return rc;
}

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
  if (!rc) rc = content_present(st, ncontent, (const uint64_t(*)[2])ckeys, present);
  wbuf bufs[64] = {{0}};
  char keys[64][KVP__STORE_KEY_MAX];
  putq q = {0, 64, keys, bufs, 0, 0};
  uint32_t j = 0;
  for (uint32_t c = 0; !rc && j < gs.ng; j++) {
    const group *g = &gs.g[j];
    bool content = g->kind == GROUP_CONTENT;
    if (content && present[c++]) continue; /* the store has this chunk already */
    wbuf *w;
    char *key;
    if ((rc = putq_slot(pool, st, &q, &w, &key))) break;
    if (content) key_content(st, g->key, key);
    else key_part(st, s->id, gen, g->index, key);
    rc = build_group(pool, gs.items + g->first, g->n, content ? g->key[0] : gen, content ? g->key[1] : g->index, w);
    if (rc) break;
    hdr_seal(w);
    putq_push(&q);
  }
  if (!rc) rc = putq_flush(pool, st, &q);
  if (!rc) { /* the manifest last: it names a complete set */
    wbuf *w = &bufs[0];
    key_manifest(st, s->id, keys[0]);
    build_manifest(pool, s, gen, &gs, w);
    if (w->oom) rc = kvp__err(KVP_ENOMEM, "manifest of seq %llu", (unsigned long long)s->id);
    else {
      q.n = 1;
      q.bytes = w->n;
      rc = putq_flush(pool, st, &q);
    }
  }
  if (rc) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvp__err_detail());
    drop_parts(st, s->id, gen, &gs, gs.ng);
    kvp__err(rc, "offload of seq %llu: %s (the sequence stays in the pool)", (unsigned long long)s->id, msg);
  }
  *moved = q.written;
  putq_free(&q);
  kvp__meta_free(NULL, ckeys, ncontent * sizeof *ckeys + 1);
  kvp__meta_free(NULL, present, ncontent * sizeof *present + 1);
  groups_free(&gs);
  return rc;
}

static void count_store(kvp_pool *pool, uint64_t out_bytes, uint64_t in_bytes, uint64_t prefix_tokens) {
  kvp__ledger_begin(&pool->alloc.ledger);
  kvp__count_add(&pool->alloc.ledger.store_offload_bytes, (int64_t)out_bytes);
  kvp__count_add(&pool->alloc.ledger.store_restore_bytes, (int64_t)in_bytes);
  kvp__count_add(&pool->alloc.ledger.store_prefix_tokens, (int64_t)prefix_tokens);
  kvp__ledger_end(&pool->alloc.ledger);
}

static int lock_live(kvp_pool *pool, uint64_t seq, kvp_store *st, const char *what, kvp__seq **out) {
  if (!pool || !st) return kvp__err(KVP_EINVAL, "%s of seq %llu: %s is NULL", what, (unsigned long long)seq,
                                    pool ? "store" : "pool");
  kvp__lock(pool);
  kvp__rcu_read_lock();
  *out = kvp__seq_find(pool, seq);
  kvp__rcu_read_unlock();
  if (*out) return KVP_OK;
  kvp__unlock(pool);
  return kvp__err(KVP_ENOENT, "%s: sequence %llu does not exist", what, (unsigned long long)seq);
}

KVP_API int kvp_seq_offload(kvp_pool *pool, uint64_t seq, kvp_store *st) {
  kvp__seq *s = NULL;
  int rc = lock_live(pool, seq, st, "offload", &s);
  if (rc) return rc;
  uint64_t moved = 0;
  if (atomic_load_explicit(&s->in_step, memory_order_relaxed))
    rc = kvp__err(KVP_EBUSY, "offload of seq %llu: a step is open (offload between steps)", (unsigned long long)seq);
  else if (s->pol && s->pol->vt)
    rc = kvp__err(KVP_ENOTSUP, "offload of seq %llu: its policy %s keeps per-sequence state the store does not carry",
                  (unsigned long long)seq, s->pol->vt->name);
  else if (!(rc = pool_ok(pool, "offload")) && !(rc = offload_locked(pool, s, st, &moved))) {
    count_store(pool, moved, 0, 0);
    kvp__seq_remove(pool, s);
  }
  kvp__unlock(pool);
  return rc;
}

/* ---- reading group blobs ---------------------------------------------------------------- */

/* Blocks parsed out of one group blob (not owned by any stream yet). */
typedef struct parsed {
  kvp__block **blk; /* [n] */
  uint32_t *lh;     /* [n]: stream of each */
  uint32_t n, cap;
} parsed;

static void parsed_destroy(kvp_pool *pool, parsed *p) {
  for (uint32_t i = 0; i < p->n; i++) kvp__block_destroy(pool, p->blk[i]);
  p->n = 0;
}
static void parsed_free(parsed *p) {
  kvp__meta_free(NULL, p->blk, p->cap * sizeof *p->blk + 1);
  kvp__meta_free(NULL, p->lh, p->cap * sizeof *p->lh + 1);
  *p = (parsed){0};
}
static int parsed_room(parsed *p, uint32_t n) {
  if (n <= p->cap) return KVP_OK;
  parsed np = {kvp__meta_alloc(NULL, n * sizeof *np.blk + 1), kvp__meta_alloc(NULL, n * sizeof *np.lh + 1), 0, n};
  if (!np.blk || !np.lh) {
    parsed_free(&np);
    return kvp__err(KVP_ENOMEM, "restore: block list of %u", n);
  }
  parsed_free(p);
  *p = np;
  return KVP_OK;
}

/* Check one record against the pool; lay receives the layouts. */
static int rec_check(kvp_pool *pool, const char *key, uint32_t index, const blk_rec *r, bool content,
                     kvp_codec_layout *lay) {
  uint32_t bt = pool->chunk_tokens;
  if (r->layer >= pool->cfg.n_layers || r->head >= pool->cfg.n_kv_heads || r->pos0 / bt != index ||
      !r->cap_tokens || r->cap_tokens > bt || !r->n_tokens || r->n_tokens > r->cap_tokens || r->raw > 1 ||
      r->sealed > 1 || (!r->raw && !r->sealed) || r->pos0 > KVP_MAX_SEQ_TOKENS - r->cap_tokens)
    return kvp__err(KVP_EFORMAT, "store key %s: block record (layer %u, head %u, position %u, %u of %u tokens) does not "
                    "fit this pool or chunk %u", key, r->layer, r->head, r->pos0, r->n_tokens, r->cap_tokens, index);
  if (content && (r->pos0 != index * bt || r->cap_tokens != bt || r->n_tokens != bt || !r->sealed))
    return kvp__err(KVP_EFORMAT, "store key %s: a content chunk holds a block that is not full and sealed", key);
  kvp__block tmp = {.raw = r->raw};
  for (int kv = 0; kv < 2; kv++) {
    kvp__bind_layout(kvp__block_binding(pool, r->layer, kv, &tmp), r->pos0, r->cap_tokens, &lay[kv]);
    bool same = lay[kv].npages == r->npages[kv];
    for (unsigned i = 0; same && i < lay[kv].npages; i++)
      same = (unsigned)lay[kv].types[i] == r->types[kv][i] && lay[kv].bytes[i] == r->bytes[kv][i];
    if (!same)
      return kvp__err(KVP_EFORMAT, "store key %s: layer %u head %u position %u: the %c pages differ from this pool's "
                      "codec layout", key, r->layer, r->head, r->pos0, "KV"[kv]);
  }
  return KVP_OK;
}

/* Parse a group blob into fresh blocks (pages taken and filled). tag: the
 * header's expected tag. On failure nothing is left taken. */
static int parse_group(kvp_pool *pool, uint64_t seq, const char *key, const void *data, size_t len, uint32_t index,
                       const uint64_t *tag, bool content, uint32_t expect_n, parsed *out) {
  blob_hdr h;
  rbuf r;
  uint32_t H = pool->cfg.n_kv_heads, LH = pool->cfg.n_layers * H;
  int rc = hdr_check(pool, key, data, len, KIND_GROUP, &h, &r);
  if (rc) return rc;
  if (h.tag[0] != tag[0] || h.tag[1] != tag[1] || h.n_items != expect_n)
    return kvp__err(KVP_EFORMAT, "store key %s: blob of another chunk or offload (tag %016llx:%llx, %u blocks; "
                    "expected %016llx:%llx, %u)", key, (unsigned long long)h.tag[0], (unsigned long long)h.tag[1],
                    h.n_items, (unsigned long long)tag[0], (unsigned long long)tag[1], expect_n);
  if (content && expect_n != LH) return kvp__err(KVP_EFORMAT, "store key %s: a content chunk of %u blocks", key, expect_n);
  if ((rc = parsed_room(out, expect_n))) return rc;
  out->n = 0;
  kvp__region *rg = &pool->alloc.region;
  for (uint32_t i = 0; i < expect_n && !rc; i++) {
    blk_rec rec;
    kvp_codec_layout lay[2];
    if (!rget(&r, &rec, sizeof rec)) {
      rc = kvp__err(KVP_EFORMAT, "store key %s: block record %u runs past the payload", key, i);
      break;
    }
    if ((rc = rec_check(pool, key, index, &rec, content, lay))) break;
    uint32_t lh = (uint32_t)rec.layer * H + rec.head;
    if (content && lh != i) {
      rc = kvp__err(KVP_EFORMAT, "store key %s: content chunk records out of (layer, head) order", key);
      break;
    }
    uint64_t need = 0;
    for (int kv = 0; kv < 2; kv++)
      for (unsigned p = 0; p < lay[kv].npages; p++) need += lay[kv].bytes[p];
    if (need > r.left) {
      rc = kvp__err(KVP_EFORMAT, "store key %s: block %u needs %llu page bytes, %zu are left", key, i,
                    (unsigned long long)need, r.left);
      break;
    }
    kvp__block *b;
    if ((rc = kvp__block_new_sized(pool, seq, rec.layer, rec.head, rec.pos0, rec.cap_tokens, rec.raw, lay, &b))) {
      char msg[400];
      snprintf(msg, sizeof msg, "%s", kvp__err_detail());
      rc = kvp__err(rc, "store key %s: pages of layer %u head %u position %u: %s", key, rec.layer, rec.head, rec.pos0,
                    msg);
      break;
    }
    out->blk[out->n] = b;
    out->lh[out->n++] = lh;
    for (int kv = 0; kv < 2 && !rc; kv++)
      for (unsigned p = 0; p < b->npages[kv] && !rc; p++) {
        size_t nb = b->pages[kv][p].requested_bytes;
        rc = rg->ops->write2d(rg, b->pages[kv][p].off, nb, r.p, nb, nb, 1, NULL);
        rget(&r, NULL, nb);
      }
    kvp__block_set_n(b, rec.n_tokens);
    b->sealed = rec.sealed;
  }
  if (!rc && r.left) rc = kvp__err(KVP_EFORMAT, "store key %s: %zu bytes past the last block", key, r.left);
  if (rc) parsed_destroy(pool, out);
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
  int rc = hdr_check(pool, key, data, len, KIND_MANIFEST, &h, &r);
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

/* Link the local content groups up to (not including) group j. */
static int link_local(restore_ctx *c, uint32_t upto) {
  uint32_t LH = c->pool->cfg.n_layers * c->pool->cfg.n_kv_heads;
  for (; c->next < upto; c->next++) {
    kvp__chunk *ch = c->local[c->next];
    kvp__assert(ch);
    for (uint32_t i = 0; i < LH; i++) {
      int rc = stream_push(c->pool, c->s, i, ch->blocks[i], "(local prefix)");
      if (rc) return rc;
      ch->blocks[i]->owners++; /* taken now, so an undo gives it back */
      atomic_fetch_add_explicit(&ch->blocks[i]->refs, 1, memory_order_relaxed);
    }
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
  if ((rc = parse_group(c->pool, c->s->id, key, data, len, g.index, tag, content, g.nblocks, &c->p))) return rc;
  c->bytes += len;
  for (uint32_t k = 0; k < c->p.n; k++) {
    if ((rc = stream_push(c->pool, c->s, c->p.lh[k], c->p.blk[k], key))) {
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
  c.gidx = kvp__meta_alloc(NULL, ng * sizeof *c.gidx + 1);
  c.keys = kvp__meta_alloc(NULL, ng * sizeof *c.keys + 1);
  c.local = kvp__meta_calloc(NULL, ng * sizeof *c.local + 1);
  c.fresh = kvp__meta_calloc(NULL, (size_t)ng * LH * sizeof *c.fresh + 1);
  const char **kp = kvp__meta_alloc(NULL, (ng + 1) * sizeof *kp);
  if (!c.gidx || !c.keys || !c.local || !c.fresh || !kp) rc = kvp__err(KVP_ENOMEM, "restore of seq %llu: lists",
                                                                      (unsigned long long)seq);
  uint32_t nfetch = 0;
  uint64_t need = 0;
  for (uint32_t j = 0; !rc && j < ng; j++) {
    man_group g = group_at(mf, j);
    kvp__chunk *ch = g.kind == GROUP_CONTENT ? kvp__prefix_find(pool, g.key) : NULL;
    if (ch && ch->index == g.index) {
      c.local[j] = ch; /* shared with the pool's copy: nothing to move */
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
  if (!rc && nfetch) rc = kvp__store_get(st, nfetch, kp, restore_one, &c);
  if (!rc) rc = link_local(&c, ng);
  if (!rc && (rc = kvp__seq_validate(pool, s))) {
    char msg[400];
    snprintf(msg, sizeof msg, "%s", kvp__err_detail());
    rc = kvp__err(KVP_EFORMAT, "store key %s: the blobs do not make a valid sequence: %s", mkey, msg);
  }
  if (rc) {
    kvp__seq_build_undo(pool, s);
    kvp__seq_free_struct(pool, s);
  } else {
    kvp__seq_build_commit(pool, s);
    kvp__seq_publish(pool, s);
    for (uint32_t j = 0; j < ng; j++) { /* fresh content chunks become shareable here too */
      man_group g = group_at(mf, j);
      kvp__block **row = c.fresh + (size_t)j * LH;
      if (g.kind == GROUP_CONTENT && row[0] && !kvp__prefix_find(pool, g.key)) kvp__prefix_insert(pool, g.key, g.index, row);
    }
    count_store(pool, 0, c.bytes, 0);
    /* the store's copy goes (best effort: a failure leaves garbage the TTL ends) */
    uint32_t nparts = 0;
    for (uint32_t i = 0; i < nfetch; i++)
      if (group_at(mf, c.gidx[i]).kind == GROUP_PART) kp[nparts++] = c.keys[i];
    kp[nparts++] = mkey;
    kvp__store_del(st, nparts, kp);
  }
  parsed_free(&c.p);
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
                : pool_ok(pool, "restore");
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
  if (!rc) count_store(pool, 0, man.n, 0);
  kvp__meta_free(NULL, man.p, man.n + 1);
  kvp__unlock(pool);
  return rc;
}

/* ---- prefix publish and fetch ------------------------------------------------------------- */

KVP_API int kvp_prefix_publish(kvp_pool *pool, uint64_t seq, kvp_store *st, uint32_t *published_tokens) {
  kvp__seq *s = NULL;
  int rc = lock_live(pool, seq, st, "prefix publish", &s);
  if (rc) return rc;
  if (published_tokens) *published_tokens = 0;
  uint32_t n = 0, LH = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  if ((rc = pool_ok(pool, "prefix publish"))) {
    kvp__unlock(pool);
    return rc;
  }
  kvp__chunk **ch = kvp__meta_alloc(NULL, s->n_pkeys * sizeof *ch + 1);
  bool *present = kvp__meta_calloc(NULL, s->n_pkeys * sizeof *present + 1);
  if (!ch || !present) rc = kvp__err(KVP_ENOMEM, "prefix publish of seq %llu: lists", (unsigned long long)seq);
  for (; !rc && n < s->n_pkeys; n++) {
    kvp__chunk *c = kvp__prefix_find(pool, s->pkeys[n]);
    if (!c || c->index != n) break;
    ch[n] = c;
  }
  if (!rc) rc = content_present(st, n, (const uint64_t(*)[2])s->pkeys, present);
  wbuf bufs[64] = {{0}};
  char keys[64][KVP__STORE_KEY_MAX];
  putq q = {0, 64, keys, bufs, 0, 0};
  item *items = kvp__meta_alloc(NULL, LH * sizeof *items);
  if (!rc && !items) rc = kvp__err(KVP_ENOMEM, "prefix publish: items");
  for (uint32_t i = 0; !rc && i < n; i++) {
    if (present[i]) continue;
    for (uint32_t j = 0; j < LH; j++) items[j] = (item){ch[i]->blocks[j], j};
    wbuf *w;
    char *key;
    if ((rc = putq_slot(pool, st, &q, &w, &key))) break;
    key_content(st, ch[i]->key, key);
    if ((rc = build_group(pool, items, LH, ch[i]->key[0], ch[i]->key[1], w))) break;
    hdr_seal(w);
    putq_push(&q);
  }
  if (!rc) rc = putq_flush(pool, st, &q);
  count_store(pool, q.written, 0, 0);
  if (!rc && published_tokens) *published_tokens = n * pool->chunk_tokens;
  putq_free(&q);
  kvp__meta_free(NULL, items, LH * sizeof *items);
  kvp__meta_free(NULL, ch, s->n_pkeys * sizeof *ch + 1);
  kvp__meta_free(NULL, present, s->n_pkeys * sizeof *present + 1);
  kvp__unlock(pool);
  return rc;
}

typedef struct fetch_ctx {
  kvp_pool *pool;
  uint64_t seq;
  uint32_t c0;               /* first chunk fetched */
  const uint64_t (*keys)[2]; /* content keys from c0 on */
  char (*names)[KVP__STORE_KEY_MAX];
  kvp__block **blocks;       /* [m][LH] */
  uint32_t done;             /* chunks parsed */
  parsed p;
  uint64_t bytes;
} fetch_ctx;

static int fetch_one(void *vctx, uint32_t i, const void *data, size_t len) {
  fetch_ctx *c = vctx;
  uint32_t LH = c->pool->cfg.n_layers * c->pool->cfg.n_kv_heads;
  if (!data) return kvp__err(KVP_ENOENT, "prefix fetch: store key %s vanished between EXISTS and GET", c->names[i]);
  int rc = parse_group(c->pool, c->seq, c->names[i], data, len, c->c0 + i, c->keys[i], true, LH, &c->p);
  if (rc) return rc;
  memcpy(c->blocks + (size_t)i * LH, c->p.blk, LH * sizeof *c->blocks);
  c->done = i + 1;
  c->bytes += len;
  return KVP_OK;
}

/* Tails all sealed and ending at the sequence's positions. */
static bool tails_sealed(const kvp_pool *pool, const kvp__seq *s, uint32_t pos) {
  for (uint32_t i = 0; i < pool->cfg.n_layers * pool->cfg.n_kv_heads; i++) {
    const kvp__bref *t = s->streams[i].tail;
    if (t && (!t->blk->sealed || t->blk->pos0 + t->blk->n_tokens != pos)) return false;
  }
  return true;
}

static int fetch_locked(kvp_pool *pool, kvp__seq *s, kvp_store *st, uint32_t *fetched) {
  uint32_t bt = pool->chunk_tokens, LH = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  uint32_t pos = atomic_load_explicit(&s->n_positions, memory_order_relaxed), c0 = pos / bt;
  if (!s->pkeys || !kvp__prefix_ok(pool, s))
    return kvp__err(KVP_EINVAL, "prefix fetch of seq %llu: it was added without token ids, or shares nothing (a "
                    "policy, or codecs with per-stream state)", (unsigned long long)s->id);
  if (pos % bt || c0 != s->next_reg || atomic_load_explicit(&s->in_step, memory_order_relaxed) ||
      !tails_sealed(pool, s, pos))
    return kvp__err(KVP_EBUSY, "prefix fetch of seq %llu: call it right after kvp_seq_add, before the sequence's own "
                    "appends (it holds %u positions)", (unsigned long long)s->id, pos);
  if (c0 >= s->max_hit) return KVP_OK;
  uint32_t n = s->max_hit - c0;
  bool *present = kvp__meta_calloc(NULL, n * sizeof *present);
  if (!present) return kvp__err(KVP_ENOMEM, "prefix fetch: key list");
  int rc = content_present(st, n, (const uint64_t(*)[2])(s->pkeys + c0), present);
  uint32_t m = 0;
  while (!rc && m < n && present[m]) m++;
  kvp__meta_free(NULL, present, n * sizeof *present);
  if (rc || !m) return rc;
  fetch_ctx c = {pool, s->id, c0, (const uint64_t(*)[2])(s->pkeys + c0), NULL, NULL, 0, {0}, 0};
  c.names = kvp__meta_alloc(NULL, m * sizeof *c.names);
  c.blocks = kvp__meta_alloc(NULL, (size_t)m * LH * sizeof *c.blocks);
  const char **kp = kvp__meta_alloc(NULL, m * sizeof *kp);
  if (!c.names || !c.blocks || !kp) rc = kvp__err(KVP_ENOMEM, "prefix fetch: lists");
  for (uint32_t i = 0; !rc && i < m; i++) {
    key_content(st, s->pkeys[c0 + i], c.names[i]);
    kp[i] = c.names[i];
  }
  if (!rc) rc = kvp__store_get(st, m, kp, fetch_one, &c);
  if (!rc) rc = kvp__prefix_attach(pool, s, m, c.blocks);
  if (rc) {
    for (size_t i = 0; c.blocks && i < (size_t)c.done * LH; i++) kvp__block_destroy(pool, c.blocks[i]);
  } else {
    for (uint32_t i = 0; i < m; i++)
      if (!kvp__prefix_find(pool, s->pkeys[c0 + i])) kvp__prefix_insert(pool, s->pkeys[c0 + i], c0 + i, c.blocks + (size_t)i * LH);
    s->next_reg = c0 + m;
    count_store(pool, 0, c.bytes, (uint64_t)m * bt);
    *fetched = m * bt;
  }
  parsed_free(&c.p);
  kvp__meta_free(NULL, c.names, m * sizeof *c.names);
  kvp__meta_free(NULL, c.blocks, (size_t)m * LH * sizeof *c.blocks);
  kvp__meta_free(NULL, kp, m * sizeof *kp);
  return rc;
}

KVP_API int kvp_prefix_fetch(kvp_pool *pool, uint64_t seq, kvp_store *st, uint32_t *fetched_tokens) {
  kvp__seq *s = NULL;
  int rc = lock_live(pool, seq, st, "prefix fetch", &s);
  if (rc) return rc;
  uint32_t got = 0;
  if (!(rc = pool_ok(pool, "prefix fetch"))) rc = fetch_locked(pool, s, st, &got);
  if (fetched_tokens) *fetched_tokens = got;
  kvp__unlock(pool);
  return rc;
}

KVP_API int kvp_store_traffic(kvp_store *st, uint64_t *sent_bytes, uint64_t *received_bytes) {
  if (!st || !sent_bytes || !received_bytes) return kvp__err(KVP_EINVAL, "store traffic: NULL argument");
  kvp__store_traffic(st, sent_bytes, received_bytes);
  return KVP_OK;
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
    rc = parse_group(pool, seq, "fuzz", w.p, w.n, index, tag, content != 0, n_items, &pr);
    if (!rc) parsed_destroy(pool, &pr);
    parsed_free(&pr);
  }
  kvp__unlock(pool);
  wfree(&w);
  return rc;
}
