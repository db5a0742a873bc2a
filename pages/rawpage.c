/*
 * pages/rawpage.c - the experimental raw-page API: tagged pages handed to
 * the caller by id, counted and checked like every other page.
 *
 * An id is (generation << 32) | (slot index + 1): a slot bumps its
 * generation when it takes a page and when it gives it back, so a live
 * slot's is odd, and a stale or doubled id never names a live page.
 *
 * Invariant: every live slot's page is live in the allocator (kvp_check
 * walks them), so a free by an id that matched needs no other validation.
 */
#define KVP_EXPERIMENTAL_API
#include "pages.h"

#include <string.h>

static int grow_table(kvp_pool *pool) {
  kvp__rawpages *r = &pool->raw;
  uint32_t ncap = r->cap ? r->cap * 2 : 64;
  if (ncap <= r->cap) return kvp__err(KVP_ENOMEM, "raw page table is full (%u pages)", r->cap);
  kvp__rawslot *s = kvp__meta_realloc(&pool->meta, r->slots, r->cap * sizeof *s, ncap * sizeof *s);
  if (!s) return kvp__err(KVP_ENOMEM, "raw page table of %u slots", ncap);
  memset(s + r->cap, 0, (ncap - r->cap) * sizeof *s);
  for (uint32_t i = ncap; i-- > r->cap;) {
    s[i].next = r->free_head;
    r->free_head = i + 1;
  }
  r->slots = s;
  r->cap = ncap;
  return KVP_OK;
}

static kvp__rawslot *lookup(kvp_pool *pool, kvp_page_id id) {
  uint32_t idx = (uint32_t)id, gen = (uint32_t)(id >> 32);
  if (idx == 0 || idx > pool->raw.cap) return NULL;
  kvp__rawslot *s = &pool->raw.slots[idx - 1];
  return s->gen == gen && kvp__rawslot_live(s) ? s : NULL;
}

static int tag_in(const kvp_pool *pool, const kvp_page_tag *t, kvp__tag *out) {
  if (!t) return kvp__err(KVP_EINVAL, "page tag is NULL");
  if (t->layer >= pool->cfg.n_layers)
    return kvp__err(KVP_EINVAL, "page tag: layer %u >= n_layers %u", t->layer, pool->cfg.n_layers);
  if (t->head >= pool->cfg.n_kv_heads)
    return kvp__err(KVP_EINVAL, "page tag: head %u >= n_kv_heads %u", t->head, pool->cfg.n_kv_heads);
  if ((unsigned)t->type >= KVP_PAGE_TYPE_COUNT) return kvp__err(KVP_EINVAL, "page tag: type %d unknown", (int)t->type);
  if (t->kv > 1) return kvp__err(KVP_EINVAL, "page tag: kv %u is neither 0 (K) nor 1 (V)", t->kv);
  if (t->codec >= KVP__MAX_CODECS) return kvp__err(KVP_EINVAL, "page tag: codec %u >= %u", t->codec, KVP__MAX_CODECS);
  *out = kvp__tag_make(t->seq, (uint16_t)t->layer, (uint16_t)t->head, (uint8_t)t->type, (uint8_t)t->kv,
                       (uint16_t)t->codec); /* one wide store: the fast path copies it at once */
  return KVP_OK;
}

KVP_API int kvp_page_alloc(kvp_pool *pool, uint64_t bytes, const kvp_page_tag *tag, kvp_page_id *out) {
  if (!pool || !out) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "out" : "pool");
  kvp__tag t;
  int rc = tag_in(pool, tag, &t);
  if (rc) return rc;
  kvp__lock(pool);
  if (!pool->raw.free_head && (rc = grow_table(pool))) goto out;
  uint32_t idx = pool->raw.free_head;
  kvp__rawslot *s = &pool->raw.slots[idx - 1];
  if ((rc = kvp__alloc_page_tagged(&pool->alloc, bytes, &t, &s->page))) goto out; /* t: checked by tag_in */
  pool->raw.free_head = s->next;
  s->gen++; /* odd: live */
  s->next = 0;
  *out = ((uint64_t)s->gen << 32) | idx;
out:
  kvp__unlock(pool);
  return rc;
}

KVP_API int kvp_page_free(kvp_pool *pool, kvp_page_id id) {
  if (!pool) return kvp__err(KVP_EINVAL, "pool is NULL");
  kvp__lock(pool);
  kvp__rawslot *s = lookup(pool, id);
  int rc = s ? KVP_OK
             : kvp__err(KVP_ENOENT, "page id %#llx is not live (freed already, or never allocated)",
                        (unsigned long long)id);
  if (!rc) {
    kvp__alloc_free_live(&pool->alloc, &s->page); /* the id matched: the page is live */
    s->gen++; /* even: free */
    s->next = pool->raw.free_head;
    pool->raw.free_head = (uint32_t)id;
  }
  kvp__unlock(pool);
  return rc;
}

KVP_API int kvp_page_grow(kvp_pool *pool, kvp_page_id id, uint64_t bytes) {
  if (!pool) return kvp__err(KVP_EINVAL, "pool is NULL");
  kvp__lock(pool);
  kvp__rawslot *s = lookup(pool, id);
  int rc = s ? kvp__alloc_grow(&pool->alloc, &s->page, bytes, NULL)
             : kvp__err(KVP_ENOENT, "page id %#llx is not live", (unsigned long long)id);
  kvp__unlock(pool);
  return rc;
}

KVP_API int kvp_page_describe(kvp_pool *pool, kvp_page_id id, kvp_page_desc *out) {
  if (!pool || !out) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "out" : "pool");
  kvp__lock(pool);
  kvp__rawslot *s = lookup(pool, id);
  if (s) {
    out->addr = pool->cfg.flags & KVP_POOL_DRY ? NULL : kvp__page_addr(&pool->alloc, &s->page); /* dry: no payload */
    out->requested_bytes = s->page.requested_bytes;
    out->allocated_bytes = kvp__page_alloc_bytes(&s->page);
  }
  kvp__unlock(pool);
  return s ? KVP_OK : kvp__err(KVP_ENOENT, "page id %#llx is not live", (unsigned long long)id);
}

void kvp__rawpages_walk(const kvp__rawpages *r, kvp__page_visit fn, void *ctx) {
  for (uint32_t i = 0; i < r->cap; i++)
    if (kvp__rawslot_live(&r->slots[i])) fn(ctx, &r->slots[i].page);
}

void kvp__rawpages_fini(kvp_pool *pool) {
  kvp__meta_free(&pool->meta, pool->raw.slots, pool->raw.cap * sizeof *pool->raw.slots);
  memset(&pool->raw, 0, sizeof pool->raw);
}
