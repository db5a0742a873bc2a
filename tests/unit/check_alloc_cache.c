/*
 * tests/unit/check_alloc_cache.c - the allocator's caches of free slots in
 * front of the slab bitmaps (small classes) and of large pages: LIFO reuse,
 * cached bytes counted as free, kvp_check catching a corrupt cache, flushes
 * when the region is full, failed allocations that change nothing, and
 * writers and readers on threads.
 */
#define KVP_EXPERIMENTAL_API
#include "../../alloc/slab.h"
#include "../../pages/pages.h"
#include "alloc_fixtures.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A freed slot goes on its class's cache and is the next one handed out
 * (LIFO); cached slots count as free in the ledger and the stats, and the
 * cache never holds more than its room. */
START_TEST(cache_is_lifo_and_not_allocated) {
  kvp_pool *p = mkpool(64 * MB, 0, 1, 1);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  kvp_page_id ids[300];
  kvp_page_desc d3, d;
  for (int i = 0; i < 300; i++) ck_ok(kvp_page_alloc(p, 100, &t, &ids[i]));
  uint32_t sc = kvp__sc_index(112);
  kvp__bin *b = &p->alloc.bins[sc];
  ck_assert_uint_eq(b->cache_cap, KVP__BIN_CACHE_MAX);
  ck_ok(kvp_page_describe(p, ids[3], &d3));
  uint32_t n0 = b->ncached;
  ck_ok(kvp_page_free(p, ids[3]));
  ck_assert_uint_eq(b->ncached, n0 + 1);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_allocated.current, 299 * 112);
  ck_assert_uint_eq(s.pages.current, 299);
  ck_assert_uint_eq(s.bytes_requested.current, 299 * 100);
  ck_pool(p);
  ck_ok(kvp_page_alloc(p, 97, &t, &ids[3]));
  ck_ok(kvp_page_describe(p, ids[3], &d));
  ck_assert_ptr_eq(d.addr, d3.addr);
  ck_assert_uint_eq(b->ncached, n0);
  for (int i = 0; i < 300; i++) {
    ck_ok(kvp_page_free(p, ids[i]));
    ck_assert_uint_le(b->ncached, b->cache_cap);
  }
  ck_pool(p);
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  ck_assert_uint_eq(s.pages.current, 0);
  ck_assert_uint_gt(b->ncached, 0);
  ck_assert_uint_eq(b->nused, b->ncached); /* taken in the bitmaps, held by the cache only */
  kvp_pool_destroy(p); /* with slots cached: ASan and the fault build's tracking see no leak */
}
END_TEST

/* kvp_check verifies every cached slot: a slot cached twice, one that is
 * free in its bitmap, a foreign offset, one lost from the cache. */
START_TEST(cache_check_detects_corruption) {
  kvp_pool *p = mkpool(64 * MB, 0, 1, 1);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  kvp_page_id ids[4];
  for (int i = 0; i < 4; i++) ck_ok(kvp_page_alloc(p, 1000, &t, &ids[i]));
  ck_ok(kvp_page_free(p, ids[1]));
  kvp__bin *b = &p->alloc.bins[kvp__sc_index(1008)];
  ck_assert_uint_gt(b->ncached, 0);
  ck_assert_uint_lt(b->ncached, b->cache_cap);
  ck_pool(p);
  uint64_t top = b->cache[b->ncached - 1];
  b->cache[b->ncached++] = top; /* cached twice */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  ck_assert(strstr(kvp_last_error(), "cached twice") != NULL);
  b->ncached--;
  ck_pool(p);
  b->cache[b->ncached - 1] = 1ull << 40; /* foreign */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  b->cache[b->ncached - 1] = top + 8; /* inside a slot */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  b->cache[b->ncached - 1] = top;
  ck_pool(p);
  b->ncached--; /* lost: taken in the bitmap, held by nobody */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  b->ncached++;
  ck_pool(p);
  const kvp__extent *e = kvp__extent_at(&p->alloc.ext, top);
  kvp__slab *sl = e->owner;
  uint64_t slot = (top - sl->base) / sl->slot_bytes;
  sl->bitmap[slot / 64] |= 1ull << (slot % 64); /* free in the bitmap too */
  sl->nfree++;
  ck_status(kvp_check(p), KVP_ECORRUPT);
  sl->bitmap[slot / 64] &= ~(1ull << (slot % 64));
  sl->nfree--;
  ck_pool(p);
  for (int i = 0; i < 4; i++)
    if (i != 1) ck_ok(kvp_page_free(p, ids[i]));
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* Cached slots hold their slabs; a region that is full otherwise flushes
 * every cache (and returns the slabs left empty) before it says ENOSPC. */
START_TEST(cache_flushed_when_region_full) {
  kvp_pool *p = mkpool(8 * MB, 0, 1, 1);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_CODES, 0);
  enum { N = 400 };
  kvp_page_id ids[N];
  uint32_t n = 0;
  while (n < N && kvp_page_alloc(p, 16 << 10, &t, &ids[n]) == KVP_OK) n++;
  ck_assert_uint_gt(n, 100);
  for (uint32_t i = n; i--;) ck_ok(kvp_page_free(p, ids[i])); /* the first slab's slots last: cached */
  kvp__bin *b = &p->alloc.bins[kvp__sc_index(16 << 10)];
  ck_assert_uint_gt(b->ncached, 0);
  ck_assert_uint_ge(b->nslabs, 1); /* held by cached slots only */
  ck_assert_uint_eq(b->nused, b->ncached);
  ck_pool(p);
  kvp_page_id big;
  ck_ok(kvp_page_alloc(p, 8 * MB, &t, &big)); /* the whole region */
  ck_assert_uint_eq(b->ncached, 0);
  ck_assert_uint_eq(b->nslabs, 0);
  ck_pool(p);
  ck_ok(kvp_page_free(p, big));
  ck_ok(kvp_page_alloc(p, 16 << 10, &t, &ids[0])); /* the class again: its cache is still there */
  ck_ok(kvp_page_free(p, ids[0]));
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* An allocation refused (budget, bad tag, too large) changes nothing: not
 * the ledger, not the caches. */
START_TEST(cache_failed_alloc_changes_nothing) {
  kvp_pool *p = mkpool(64 * MB, 64 * 1008, 1, 1);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  kvp_page_id ids[64], x;
  for (int i = 0; i < 64; i++) ck_ok(kvp_page_alloc(p, 1000, &t, &ids[i]));
  ck_ok(kvp_page_free(p, ids[5]));
  ck_ok(kvp_page_free(p, ids[6]));
  kvp__bin *b = &p->alloc.bins[kvp__sc_index(1008)];
  uint32_t n0 = b->ncached;
  uint64_t top = b->cache[n0 - 1];
  kvp_stats s0 = {.struct_size = sizeof s0}, s1 = {.struct_size = sizeof s1};
  ck_ok(kvp_stats_get(p, &s0));
  ck_status(kvp_page_alloc(p, 4000, &t, &x), KVP_EBUDGET); /* 2 x 1008 free in the budget */
  kvp_page_tag bad = tag_of(1, 1, 0, KVP_PAGE_RAW, 0);
  ck_status(kvp_page_alloc(p, 1000, &bad, &x), KVP_EINVAL);
  ck_status(kvp_page_alloc(p, 0, &t, &x), KVP_EINVAL);
  ck_ok(kvp_stats_get(p, &s1));
  ck_assert_uint_eq(b->ncached, n0);
  ck_assert_uint_eq(b->cache[n0 - 1], top);
  ck_assert_uint_eq(s1.bytes_allocated.current, s0.bytes_allocated.current);
  ck_assert_uint_eq(s1.bytes_requested.current, s0.bytes_requested.current);
  ck_assert_uint_eq(s1.pages.current, s0.pages.current);
  ck_assert_uint_eq(s1.bytes_committed.current, s0.bytes_committed.current);
  ck_pool(p);
  ck_ok(kvp_page_alloc(p, 1000, &t, &ids[5])); /* the budget's room is the cache's */
  ck_ok(kvp_page_alloc(p, 1000, &t, &ids[6]));
  ck_status(kvp_page_alloc(p, 1000, &t, &x), KVP_EBUDGET);
  for (int i = 0; i < 64; i++) ck_ok(kvp_page_free(p, ids[i]));
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* A freed large page's extent stays taken (committed, not allocated) for
 * the next page of its size; kvp_check verifies the large cache, the
 * internal free refuses a cached one, ENOSPC and kvp_reclaim flush it. */
START_TEST(large_cache_reuses_and_checks) {
  kvp_pool *p = mkpool(64 * MB, 0, 1, 1);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  kvp_page_id a, b, c;
  kvp_page_desc da, d;
  ck_ok(kvp_page_alloc(p, 300000, &t, &a));
  ck_ok(kvp_page_alloc(p, 300000, &t, &b));
  ck_ok(kvp_page_alloc(p, 1 * MB, &t, &c));
  ck_ok(kvp_page_describe(p, a, &da));
  kvp__page pa = p->raw.slots[(uint32_t)a - 1].page;
  kvp_stats s0 = {.struct_size = sizeof s0}, s1 = {.struct_size = sizeof s1};
  ck_ok(kvp_stats_get(p, &s0));
  ck_ok(kvp_page_free(p, a));
  ck_assert_uint_eq(p->alloc.nlarge_cached, 1);
  ck_assert_uint_eq(p->alloc.large_cached_bytes, kvp__page_alloc_bytes(&pa));
  ck_ok(kvp_stats_get(p, &s1));
  ck_assert_uint_eq(s1.bytes_allocated.current, s0.bytes_allocated.current - kvp__page_alloc_bytes(&pa));
  ck_assert_uint_eq(s1.pages.current, 2);
  ck_assert_uint_eq(s1.bytes_committed.current, s0.bytes_committed.current);
  ck_pool(p);
  ck_status(kvp__alloc_free(&p->alloc, &pa), KVP_EINVAL); /* cached: already free */
  ck_assert(strstr(kvp_last_error(), "double free") != NULL);
  kvp__extent *e = p->alloc.large_cache[0];
  e->cached = false; /* a cached extent that says it is live */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  e->cached = true;
  ck_pool(p);
  p->alloc.large_cached_bytes += 4096; /* a count that disagrees */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  p->alloc.large_cached_bytes -= 4096;
  ck_pool(p);
  ck_ok(kvp_page_alloc(p, 299900, &t, &a)); /* the same 74 units of 4 KiB: the cached extent */
  ck_ok(kvp_page_describe(p, a, &d));
  ck_assert_ptr_eq(d.addr, da.addr);
  ck_assert_uint_eq(p->alloc.nlarge_cached, 0);
  ck_pool(p);
  ck_ok(kvp_page_free(p, a));
  ck_ok(kvp_page_free(p, b));
  ck_ok(kvp_page_free(p, c));
  ck_assert_uint_eq(p->alloc.nlarge_cached, 3);
  ck_pool(p);
  ck_ok(kvp_reclaim(p)); /* the caches back */
  ck_assert_uint_eq(p->alloc.nlarge_cached, 0);
  ck_ok(kvp_stats_get(p, &s1));
  ck_assert_uint_eq(s1.bytes_committed.current, 0);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* The large cache holds at most KVP__LARGE_CACHE_MAX extents and a 16th of
 * the region; a region full otherwise flushes it before ENOSPC. */
START_TEST(large_cache_bounded_and_flushed_when_full) {
  kvp_pool *p = mkpool(8 * MB, 0, 1, 1);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  enum { N = 40 };
  kvp_page_id ids[N];
  uint32_t n = 0;
  while (n < N && kvp_page_alloc(p, 200000, &t, &ids[n]) == KVP_OK) n++;
  ck_assert_uint_gt(n, 30);
  for (uint32_t i = 0; i < n; i++) {
    ck_ok(kvp_page_free(p, ids[i]));
    ck_assert_uint_le(p->alloc.nlarge_cached, KVP__LARGE_CACHE_MAX);
    ck_assert_uint_le(p->alloc.large_cached_bytes, (8 * MB) / 16);
  }
  ck_assert_uint_gt(p->alloc.nlarge_cached, 0);
  ck_pool(p);
  kvp_page_id big;
  ck_ok(kvp_page_alloc(p, 8 * MB, &t, &big)); /* the whole region */
  ck_assert_uint_eq(p->alloc.nlarge_cached, 0);
  ck_pool(p);
  ck_ok(kvp_page_free(p, big)); /* larger than the cache may hold: straight back */
  ck_assert_uint_eq(p->alloc.nlarge_cached, 0);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* Pages taken and given back from several threads at once (the writer
 * lock), with lock-free stats readers beside them; every page accounted
 * for at the end. Run under TSan by make tsan. */
typedef struct cache_thread {
  kvp_pool *p;
  uint32_t id;
  int rc;
} cache_thread;

static void *cache_worker(void *arg) {
  cache_thread *c = arg;
  kvp_page_tag t = tag_of(c->id, 0, 0, KVP_PAGE_CODES, 0);
  kvp_page_id ids[64] = {0};
  uint64_t rng = 0x9e3779b97f4a7c15ull * (c->id + 1);
  for (int i = 0; i < 20000 && !c->rc; i++) {
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    uint32_t k = (uint32_t)(rng % 64);
    if (ids[k] && (c->rc = kvp_page_free(c->p, ids[k]))) break;
    ids[k] = 0;
    c->rc = kvp_page_alloc(c->p, 16 + (rng >> 32) % 5000, &t, &ids[k]);
  }
  for (int k = 0; k < 64; k++)
    if (ids[k] && !c->rc) c->rc = kvp_page_free(c->p, ids[k]);
  return NULL;
}

static void *cache_reader(void *arg) {
  cache_thread *c = arg;
  for (int i = 0; i < 2000; i++) {
    kvp_stats s = {.struct_size = sizeof s};
    if ((c->rc = kvp_stats_get(c->p, &s))) break;
    if (s.bytes_allocated.current > s.bytes_committed.current) c->rc = KVP_ECORRUPT;
  }
  return NULL;
}

START_TEST(cache_threads) {
  kvp_pool *p = mkpool(256 * MB, 0, 1, 1);
  enum { NT = 4 };
  pthread_t th[NT + 1];
  cache_thread c[NT + 1];
  for (uint32_t i = 0; i <= NT; i++) {
    c[i] = (cache_thread){p, i + 1, 0};
    ck_assert_int_eq(pthread_create(&th[i], NULL, i < NT ? cache_worker : cache_reader, &c[i]), 0);
  }
  for (uint32_t i = 0; i <= NT; i++) {
    pthread_join(th[i], NULL);
    ck_assert_msg(c[i].rc == KVP_OK, "thread %u: %s", i, kvp_strerror(c[i].rc));
  }
  ck_pool(p);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  ck_assert_uint_eq(s.pages.current, 0);
  ck_assert_uint_eq(s.allocs, s.frees);
  kvp_pool_destroy(p);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("alloc_cache");
  TCase *tc = tcase_create("cache");
  tcase_add_test(tc, cache_is_lifo_and_not_allocated);
  tcase_add_test(tc, cache_check_detects_corruption);
  tcase_add_test(tc, cache_flushed_when_region_full);
  tcase_add_test(tc, cache_failed_alloc_changes_nothing);
  tcase_add_test(tc, cache_threads);
  tcase_add_test(tc, large_cache_reuses_and_checks);
  tcase_add_test(tc, large_cache_bounded_and_flushed_when_full);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return t_run(suite()); }
