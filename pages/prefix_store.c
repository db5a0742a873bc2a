/*
 * pages/prefix_store.c - prefix chunks through the store: a sequence's
 * registered prompt chunks published under their content keys
 * (kvp_prefix_publish), and a new sequence's prompt attached from them
 * (kvp_prefix_fetch) instead of recomputed: the fetched blocks become
 * prefix-table entries (or the table's own copy is taken, when it has the
 * chunk), which the sequence then holds, one reference per chunk; the
 * store's traffic counters.
 */
#include "blob.h"

#include <stdio.h>
#include <string.h>

/* ---- prefix publish and fetch ------------------------------------------------------------- */

KVP_API int kvp_prefix_publish(kvp_pool *pool, uint64_t seq, kvp_store *st, uint32_t *published_tokens) {
  kvp__seq *s = NULL;
  int rc = kvp__store_lock_live(pool, seq, st, "prefix publish", &s);
  if (rc) return rc;
  if (published_tokens) *published_tokens = 0;
  uint32_t n = 0, LH = pool->cfg.n_layers * pool->cfg.n_kv_heads;
  if ((rc = kvp__store_pool_ok(pool, "prefix publish"))) {
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
  if (!rc) rc = kvp__store_content_present(st, n, (const uint64_t(*)[2])s->pkeys, present);
  putq q;
  if (!rc) rc = kvp__putq_init(&q, pool, st);
  else memset(&q, 0, sizeof q);
  item *items = kvp__meta_alloc(NULL, LH * sizeof *items);
  if (!rc && !items) rc = kvp__err(KVP_ENOMEM, "prefix publish: items");
  for (uint32_t i = 0; !rc && i < n; i++) {
    if (present[i]) continue;
    for (uint32_t j = 0; j < LH; j++) items[j] = (item){ch[i]->blocks[j], j};
    wbuf *w;
    char *key;
    if ((rc = kvp__putq_slot(&q, kvp__blob_slot_bytes(pool, items, LH), &w, &key))) break;
    key_content(st, ch[i]->key, key);
    if ((rc = kvp__blob_build_group(pool, items, LH, ch[i]->key[0], ch[i]->key[1], w, &q))) break;
    kvp__putq_push(&q);
  }
  if (!rc) rc = kvp__putq_flush(&q);
  kvp__store_count(pool, q.written, 0, 0);
  if (!rc && published_tokens) *published_tokens = n * pool->chunk_tokens;
  if (rc == KVP_ENOSPC && published_tokens) { /* the store's cap: what it holds now, the message kept */
    char msg[512];
    snprintf(msg, sizeof msg, "%s", kvp__err_detail());
    uint32_t held = 0;
    memset(present, 0, s->n_pkeys * sizeof *present);
    if (!kvp__store_content_present(st, n, (const uint64_t(*)[2])s->pkeys, present))
      while (held < n && present[held]) held++;
    *published_tokens = held * pool->chunk_tokens;
    kvp__err(KVP_ENOSPC, "prefix publish of seq %llu: %s (the store holds its first %u tokens)", (unsigned long long)seq,
             msg, *published_tokens);
  }
  kvp__putq_free(&q);
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
  int rc = kvp__blob_parse_group(c->pool, c->seq, c->names[i], data, len, c->c0 + i, c->keys[i], true, LH, &c->p);
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
  int rc = kvp__store_content_present(st, n, (const uint64_t(*)[2])(s->pkeys + c0), present);
  uint32_t m = 0;
  while (!rc && m < n && present[m]) m++;
  kvp__meta_free(NULL, present, n * sizeof *present);
  if (rc || !m) return rc;
  fetch_ctx c = {pool, s->id, c0, (const uint64_t(*)[2])(s->pkeys + c0), NULL, NULL, 0, {0}, 0};
  c.p.stream = kvp__store_stream(st);
  c.names = kvp__meta_alloc(NULL, m * sizeof *c.names);
  c.blocks = kvp__meta_alloc(NULL, (size_t)m * LH * sizeof *c.blocks);
  const char **kp = kvp__meta_alloc(NULL, m * sizeof *kp);
  kvp__chunk **ch = kvp__meta_calloc(NULL, m * sizeof *ch); /* the table entry of each chunk */
  bool *dup = kvp__meta_calloc(NULL, m * sizeof *dup);      /* ... one the table held already */
  if (!c.names || !c.blocks || !kp || !ch || !dup) rc = kvp__err(KVP_ENOMEM, "prefix fetch: lists");
  for (uint32_t i = 0; !rc && i < m; i++) {
    key_content(st, s->pkeys[c0 + i], c.names[i]);
    kp[i] = c.names[i];
  }
  if (!rc) rc = kvp__store_get(st, m, kp, fetch_one, &c);
  for (uint32_t i = 0; !rc && i < m; i++) { /* the fetched blocks become entries, unless the table has the chunk */
    kvp__chunk *t = kvp__prefix_find(pool, s->pkeys[c0 + i]);
    if ((dup[i] = t && t->index == c0 + i)) ch[i] = t;
    else if (t) rc = kvp__err(KVP_ECORRUPT, "prefix fetch of seq %llu: content key of chunk %u names chunk %u",
                              (unsigned long long)s->id, c0 + i, t->index);
    else if (!(ch[i] = kvp__prefix_entry_new(pool, s->pkeys[c0 + i], c0 + i, c.blocks + (size_t)i * LH)))
      rc = KVP_ENOMEM;
  }
  if (!rc) rc = kvp__prefix_attach(pool, s, m, ch);
  bool any_dup = false;
  for (uint32_t i = 0; dup && i < c.done; i++) any_dup = any_dup || dup[i];
  if (rc || any_dup) (void)kvp__blob_drain(pool); /* no staged copy still fills the pages freed below */
  for (uint32_t i = 0; rc && ch && i < m; i++) /* undone: the entries made for the fetched blocks */
    if (ch[i] && !dup[i]) kvp__prefix_entry_discard(pool, ch[i]);
  for (size_t i = 0; c.blocks && i < (size_t)c.done * LH; i++) /* fetched blocks no entry took */
    if (rc || dup[i / LH]) kvp__block_destroy(pool, c.blocks[i]);
  if (!rc) {
    s->next_reg = c0 + m;
    kvp__store_count(pool, 0, c.bytes, (uint64_t)m * bt);
    *fetched = m * bt;
  }
  kvp__parsed_free(&c.p);
  kvp__meta_free(NULL, c.names, m * sizeof *c.names);
  kvp__meta_free(NULL, c.blocks, (size_t)m * LH * sizeof *c.blocks);
  kvp__meta_free(NULL, kp, m * sizeof *kp);
  kvp__meta_free(NULL, ch, m * sizeof *ch);
  kvp__meta_free(NULL, dup, m * sizeof *dup);
  return rc;
}

KVP_API int kvp_prefix_fetch(kvp_pool *pool, uint64_t seq, kvp_store *st, uint32_t *fetched_tokens) {
  kvp__seq *s = NULL;
  int rc = kvp__store_lock_live(pool, seq, st, "prefix fetch", &s);
  if (rc) return rc;
  uint32_t got = 0;
  if (!(rc = kvp__store_pool_ok(pool, "prefix fetch"))) rc = fetch_locked(pool, s, st, &got);
  if (fetched_tokens) *fetched_tokens = got;
  kvp__unlock(pool);
  return rc;
}

KVP_API int kvp_store_traffic(kvp_store *st, uint64_t *sent_bytes, uint64_t *received_bytes) {
  if (!st || !sent_bytes || !received_bytes) return kvp__err(KVP_EINVAL, "store traffic: NULL argument");
  kvp__store_traffic(st, sent_bytes, received_bytes);
  return KVP_OK;
}

