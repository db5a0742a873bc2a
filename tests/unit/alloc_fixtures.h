/*
 * tests/unit/alloc_fixtures.h - the pools and tags the allocator suites
 * (check_alloc.c, check_alloc_cache.c) build their cases on.
 */
#ifndef KVP_TESTS_ALLOC_FIXTURES_H
#define KVP_TESTS_ALLOC_FIXTURES_H

#include "testutil.h"

#define MB (1ull << 20)

/* A pool of a host region of region bytes (budget 0: the region). */
static inline kvp_pool *mkpool(uint64_t region, uint64_t budget, uint32_t layers, uint32_t heads) {
  kvp_config c;
  kvp_config_init(&c);
  c.region_bytes = region;
  c.budget_bytes = budget;
  c.n_layers = layers;
  c.n_kv_heads = heads;
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  return p;
}

static inline kvp_page_tag tag_of(uint64_t seq, uint32_t layer, uint32_t head, kvp_page_type t, uint32_t kv) {
  return (kvp_page_tag){seq, layer, head, t, kv, 0};
}

#endif /* KVP_TESTS_ALLOC_FIXTURES_H */
