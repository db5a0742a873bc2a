/*
 * tests/unit/check_alloc.c - the allocator: size classes, extents, slabs,
 * ledger and budget, grow, bad input, and a randomized churn with the full
 * pool check after every operation. The bins' caches of free slots:
 * check_alloc_cache.c.
 */
#define KVP_EXPERIMENTAL_API
#include "../../alloc/slab.h"
#include "../../pages/pages.h"
#include "alloc_fixtures.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- size classes ------------------------------------------------------ */

START_TEST(sc_formula_every_boundary) {
  kvp__sc_init();
  ck_assert_uint_eq(kvp__sc_size(KVP__SC_COUNT - 1), KVP__SC_MAX_BYTES);
  ck_assert_uint_eq(kvp__sc_size(0), 8);
  ck_assert_uint_eq(kvp__sc_size(1), 16);
  ck_assert_uint_eq(kvp__sc_size(KVP__SC_LINEAR_COUNT), KVP__SC_LINEAR_MAX);
  ck_assert_uint_eq(kvp__sc_size(KVP__SC_SMALL_COUNT - 1), KVP__SMALL_MAX_BYTES);
  uint64_t prev = 0;
  for (uint32_t i = 0; i < KVP__SC_COUNT; i++) {
    uint64_t sz = kvp__sc_size(i);
    ck_assert_uint_eq(sz, kvp__sc_size_slow(i)); /* the table is the formula */
    ck_assert_msg(sz > prev && (i == 0 || sz % KVP__SC_QUANTUM == 0), "class %u size %llu", i, (unsigned long long)sz);
    /* 64 classes per doubling past 1 KiB: size(i + 64) = 2 size(i) */
    if (sz >= KVP__SC_LINEAR_MAX && i + KVP__SC_STEPS < KVP__SC_COUNT)
      ck_assert_uint_eq(kvp__sc_size(i + KVP__SC_STEPS), 2 * sz);
    /* boundaries: sz maps to i, sz + 1 to i + 1, prev + 1 to i */
    ck_assert_uint_eq(kvp__sc_index(sz), i);
    ck_assert_uint_eq(kvp__sc_index_slow(sz), i);
    ck_assert_uint_eq(kvp__sc_index(prev + 1), i);
    if (i + 1 < KVP__SC_COUNT) ck_assert_uint_eq(kvp__sc_index(sz + 1), i + 1);
    ck_assert_uint_eq(kvp__sc_index_floor(sz), i);
    if (i > 0 && sz - 1 > prev) ck_assert_uint_eq(kvp__sc_index_floor(sz - 1), i - 1);
    /* rounding waste: under 16 B, or under 1/64 of the size */
    uint64_t waste = sz - (prev + 1);
    ck_assert_msg(waste < 16 || waste * 64 < sz, "class %u: %llu bytes of waste", i, (unsigned long long)waste);
    /* slab classes give >= 8 slots in a 2 MiB slab */
    if (sz <= KVP__SMALL_MAX_BYTES) ck_assert_uint_ge(KVP__SLAB_BYTES / sz, KVP__SLAB_MIN_SLOTS);
    prev = sz;
  }
}
END_TEST

START_TEST(sc_lut_matches_formula) {
  kvp__sc_init();
  for (uint64_t b = 1; b <= KVP__SMALL_MAX_BYTES; b++)
    ck_assert_msg(kvp__sc_index(b) == kvp__sc_index_slow(b), "bytes %llu", (unsigned long long)b);
  ck_assert_uint_eq(KVP__SC_SMALL_COUNT, kvp__sc_index(KVP__SMALL_MAX_BYTES) + 1);
  /* the slab classes of a region follow its slab cap: 8 slots at least */
  ck_assert_uint_eq(kvp__small_max_for(KVP__SLAB_BYTES), KVP__SMALL_MAX_BYTES);
  ck_assert_uint_eq(kvp__small_max_for(128ull << 10), 16ull << 10);
  ck_assert_uint_eq(kvp__small_max_for(256ull << 10), KVP__SMALL_MAX_BYTES);
  ck_assert_uint_eq(kvp__small_max_for(KVP__SLAB_MIN_BYTES), 8ull << 10);
}
END_TEST

/* The pages of a KV cache come in few, arbitrary sizes; each costs what it
 * asks within 16 B or 1/64 (nvfp4's 4-byte META page, kvquant's 66-byte
 * OUTLIERS, the CODES and SCALES of VAR scales: 64 and 8 bytes x side^2). */
START_TEST(sc_kv_page_sizes_cost_what_they_ask) {
  kvp__sc_init();
  static const struct { uint64_t req, alloc; } cases[] = {
      {4, 8},         {6, 8},         {8, 8},          {18, 32},        {66, 80},        {96, 96},
      {128, 128},     {288, 288},     {1152, 1152},    {1156, 1168},    {2304, 2304},    {3200, 3200},
      {4608, 4608},   {9216, 9216},   {12800, 12800},  {18432, 18432},  {25600, 25600},  {36864, 36864},
      {102400, 102400}, {147456, 147456}, {262144, 262144}, {262145, 266240}, {1180000, 1183744}};
  for (unsigned i = 0; i < sizeof cases / sizeof *cases; i++)
    ck_assert_msg(kvp__alloc_size_for(KVP__SMALL_MAX_BYTES, 8, cases[i].req) == cases[i].alloc,
                  "%llu bytes: %llu allocated, want %llu", (unsigned long long)cases[i].req,
                  (unsigned long long)kvp__alloc_size_for(KVP__SMALL_MAX_BYTES, 8, cases[i].req),
                  (unsigned long long)cases[i].alloc);
  /* alignment: slots of classes above 8 B are 16-byte multiples */
  for (uint32_t c = 1; c < KVP__SC_SMALL_COUNT; c++) ck_assert_uint_eq(kvp__sc_size(c) % 16, 0);
}
END_TEST

/* ---- extents (pure metadata, no region memory needed) ------------------ */


START_TEST(extents_split_and_coalesce) {
  kvp__sc_init();
  kvp__meta m = {0};
  kvp__extents x;
  ck_ok(kvp__extents_init(&x, 64 * MB, &m));
  ck_ok(kvp__extents_check(&x));
  kvp__extent *e[8];
  for (int i = 0; i < 8; i++) {
    ck_ok(kvp__extent_alloc(&x, 4 * MB, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &e[i]));
    ck_ok(kvp__extents_check(&x));
  }
  for (int i = 0; i < 8; i++) /* no overlap: distinct, ordered ranges */
    for (int j = i + 1; j < 8; j++)
      ck_assert(e[i]->off + e[i]->bytes <= e[j]->off || e[j]->off + e[j]->bytes <= e[i]->off);
  ck_assert_uint_eq(x.used_bytes, 32 * MB);
  /* free every other, then the rest: coalescing leaves one free extent */
  for (int i = 0; i < 8; i += 2) {
    kvp__extent_free(&x, e[i]);
    ck_ok(kvp__extents_check(&x));
  }
  ck_assert_uint_eq(x.nextents, 9); /* 4 free holes + 4 used + the tail */
  for (int i = 1; i < 8; i += 2) {
    kvp__extent_free(&x, e[i]);
    ck_ok(kvp__extents_check(&x));
  }
  ck_assert_uint_eq(x.nextents, 1);
  ck_assert_uint_eq(x.first->bytes, 64 * MB);
  ck_assert_uint_eq(x.used_bytes, 0);
  kvp__extents_fini(&x);
  ck_assert_uint_eq(m.bytes, 0); /* every descriptor returned */
}
END_TEST

START_TEST(extents_alignment_and_full) {
  kvp__sc_init();
  kvp__meta m = {0};
  kvp__extents x;
  ck_ok(kvp__extents_init(&x, 16 * MB, &m));
  kvp__extent *small, *slab, *big;
  ck_ok(kvp__extent_alloc(&x, KVP__EXTENT_UNIT, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &small));
  ck_ok(kvp__extent_alloc(&x, KVP__SLAB_BYTES, KVP__SLAB_BYTES, KVP__EXT_SLAB, &slab));
  ck_assert_uint_eq(slab->off % KVP__SLAB_BYTES, 0);
  ck_assert_uint_eq(slab->off, 2 * MB); /* the hole before it stays free */
  ck_ok(kvp__extents_check(&x));
  ck_assert_ptr_eq(kvp__extent_at(&x, slab->off + 12345), slab);
  ck_assert_ptr_null(kvp__extent_at(&x, 1 * MB));
  /* the rest: 12 MiB free after the slab plus the 1984 KiB hole */
  ck_status(kvp__extent_alloc(&x, 13 * MB, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &big), KVP_ENOSPC);
  ck_ok(kvp__extent_alloc(&x, 12 * MB, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &big));
  ck_status(kvp__extent_alloc(&x, KVP__SLAB_BYTES, KVP__SLAB_BYTES, KVP__EXT_SLAB, &slab), KVP_ENOSPC);
  ck_ok(kvp__extents_check(&x));
  /* grow in place into the following hole */
  ck_assert(kvp__extent_grow_in_place(&x, small, 2 * MB - KVP__EXTENT_UNIT));
  ck_assert(!kvp__extent_grow_in_place(&x, small, 2 * MB + KVP__EXTENT_UNIT)); /* the slab follows */
  ck_assert(kvp__extent_grow_in_place(&x, small, 2 * MB));
  ck_ok(kvp__extents_check(&x));
  kvp__extents_fini(&x);
}
END_TEST

/* A prefaulted region's map is whole: every chunk made at once, counted,
 * and kept while extents come and go (kvp__extents_trim included); a chunk
 * that maps nothing is no corruption then, a missing one is. */
START_TEST(extents_address_map_whole) {
  kvp__sc_init();
  kvp__meta m = {0};
  kvp__extents x;
  uint64_t chunk_bytes = sizeof(kvp__rmap_chunk);
  ck_ok(kvp__extents_init(&x, 64 * MB, &m));
  uint64_t empty = m.bytes;
  ck_ok(kvp__extents_map_whole(&x));
  ck_assert_uint_ge(m.bytes, empty + 4 * chunk_bytes);
  for (uint64_t c = 0; c < x.nchunks; c++) ck_assert_ptr_nonnull(x.rmap[c]);
  ck_ok(kvp__extents_check(&x));
  kvp__extent *a, *b;
  ck_ok(kvp__extent_alloc(&x, KVP__SLAB_BYTES, KVP__SLAB_BYTES, KVP__EXT_SLAB, &a));
  ck_ok(kvp__extent_alloc(&x, 20 * MB, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &b));
  ck_assert_ptr_eq(kvp__extent_at(&x, a->off + 5), a);
  ck_assert_ptr_eq(kvp__extent_at(&x, b->off), b);
  ck_ok(kvp__extents_check(&x));
  kvp__extent_free(&x, a);
  kvp__extent_free(&x, b);
  kvp__extents_trim(&x);
  for (uint64_t c = 0; c < x.nchunks; c++) ck_assert_ptr_nonnull(x.rmap[c]);
  ck_assert_ptr_null(kvp__extent_at(&x, 5));
  ck_ok(kvp__extents_check(&x));
  kvp__rmap_chunk *keep = x.rmap[2];
  x.rmap[2] = NULL; /* a whole map missing a chunk: corrupt */
  ck_status(kvp__extents_check(&x), KVP_ECORRUPT);
  x.rmap[2] = keep;
  kvp__extents_fini(&x);
  ck_assert_uint_eq(m.bytes, 0);
}
END_TEST

/* The address map of a 1 TiB region is committed by chunks as extents are
 * used and given back when they are freed: metadata follows use. */
START_TEST(extents_address_map_is_lazy) {
  kvp__sc_init();
  kvp__meta m = {0};
  kvp__extents x;
  uint64_t tib = 1ull << 40, chunk_bytes = sizeof(kvp__rmap_chunk);
  ck_ok(kvp__extents_init(&x, tib, &m));
  uint64_t empty = m.bytes;
  ck_assert_uint_lt(empty, 2 * MB); /* 12 bytes per 16 MiB: 768 KiB, not the 2 GiB of a flat map */
  ck_ok(kvp__extents_check(&x));
  /* 20 MiB from offset 0: a large extent maps its first unit only, so chunk 0 of 16 MiB only */
  kvp__extent *a, *b;
  ck_ok(kvp__extent_alloc(&x, 20 * MB, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &a));
  ck_assert_uint_ge(m.bytes, empty + chunk_bytes);
  ck_assert_uint_lt(m.bytes, empty + 2 * chunk_bytes);
  ck_assert_ptr_eq(kvp__extent_at(&x, 5), a);
  ck_assert_ptr_null(kvp__extent_at(&x, 17 * MB + 5)); /* an interior unit: not mapped */
  ck_assert_ptr_null(x.rmap[1]);
  ck_assert_ptr_null(kvp__extent_at(&x, 20 * MB));
  ck_assert_ptr_null(kvp__extent_at(&x, tib - 1)); /* far away: no chunk, free */
  ck_ok(kvp__extent_alloc(&x, 4 * KVP__EXTENT_UNIT, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &b)); /* in chunk 1 */
  ck_assert_uint_ge(m.bytes, empty + 2 * chunk_bytes);
  ck_assert_uint_lt(m.bytes, empty + 3 * chunk_bytes);
  ck_ok(kvp__extents_check(&x));
  kvp__extent_free(&x, a); /* chunk 0 goes, chunk 1 stays for b */
  ck_ok(kvp__extents_check(&x));
  ck_assert_ptr_null(x.rmap[0]);
  ck_assert_ptr_nonnull(x.rmap[1]);
  ck_assert_ptr_eq(kvp__extent_at(&x, b->off + 5), b);
  ck_assert_ptr_null(kvp__extent_at(&x, b->off + KVP__EXTENT_UNIT));
  kvp__extent_free(&x, b);
  ck_ok(kvp__extents_check(&x));
  ck_assert_ptr_null(x.rmap[1]);
  ck_assert_uint_eq(m.bytes, empty); /* every chunk returned */
  /* a large extent grown in place maps no more units; a slab maps all of its own */
  ck_ok(kvp__extent_alloc(&x, 15 * MB, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &a));
  ck_assert(kvp__extent_grow_in_place(&x, a, 40 * MB));
  ck_ok(kvp__extents_check(&x));
  ck_assert_ptr_eq(kvp__extent_at(&x, 0), a);
  ck_assert_ptr_null(kvp__extent_at(&x, 39 * MB));
  ck_assert_ptr_null(x.rmap[2]);
  ck_ok(kvp__extent_alloc(&x, 20 * MB, KVP__EXTENT_UNIT, KVP__EXT_SLAB, &b)); /* 40..60 MiB: chunks 2 and 3 */
  ck_assert_ptr_eq(kvp__extent_at(&x, 59 * MB), b);
  ck_assert_ptr_nonnull(x.rmap[3]);
  ck_ok(kvp__extents_check(&x));
  kvp__extent_free(&x, b);
  kvp__extent_free(&x, a);
  ck_assert_uint_eq(m.bytes, empty);
  /* a broken count is found */
  ck_ok(kvp__extent_alloc(&x, 8 * KVP__EXTENT_UNIT, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &a));
  x.rmap_nused[0]++;
  ck_status(kvp__extents_check(&x), KVP_ECORRUPT);
  x.rmap_nused[0]--;
  ck_ok(kvp__extents_check(&x));
  kvp__extents_fini(&x);
  ck_assert_uint_eq(m.bytes, 0);
}
END_TEST

/* ---- pool-level cases (fixtures: alloc_fixtures.h) ---------------------- */

/* A CUDA region's pages are 64-byte aligned (the device's paged gather
 * addresses pages in 64-byte units): a request rounds up to 64 B before its
 * class there, a dry CUDA pool alike; a host region's classes are finer. */
START_TEST(cuda_region_pages_64_byte_aligned) {
  static const uint64_t sizes[] = {4, 66, 96, 100, 1000, 1040, 2080, 5000, 20000};
  static const uint64_t want[] = {64, 128, 128, 128, 1024, 1088, 2112, 5056, 20224};
  kvp_config c;
  kvp_config_init(&c);
  c.region_bytes = 64ull << 20;
  c.memory = KVP_MEM_CUDA;
  c.flags = KVP_POOL_DRY;
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  ck_assert_uint_eq(p->alloc.page_align_bytes, 64);
  enum { N = sizeof sizes / sizeof *sizes };
  kvp__page pg[N][3];
  for (unsigned i = 0; i < N; i++)
    for (int k = 0; k < 3; k++) {
      ck_ok(kvp__alloc_page(&p->alloc, sizes[i], &(kvp__tag){1, 0, 0, KVP_PAGE_META, 0, 0}, &pg[i][k]));
      ck_assert_uint_eq(kvp__page_alloc_bytes(&pg[i][k]), want[i]);
      ck_assert_uint_eq(pg[i][k].off % 64, 0);
      ck_ok(kvp__alloc_check(&p->alloc));
    }
  for (unsigned i = 0; i < N; i++)
    for (int k = 0; k < 3; k++) ck_ok(kvp__alloc_free(&p->alloc, &pg[i][k]));
  ck_pool(p);
  kvp_pool_destroy(p);
  kvp_pool *h = mkpool(64ull << 20, 0, 1, 1); /* the host: 8, 80, 96, 112, 1008, 1040, 2080, 5056 */
  ck_assert_uint_eq(kvp__alloc_size(&h->alloc, 4), 8);
  ck_assert_uint_eq(kvp__alloc_size(&h->alloc, 66), 80);
  ck_assert_uint_eq(kvp__alloc_size(&h->alloc, 1000), 1008);
  kvp_pool_destroy(h);
}
END_TEST

START_TEST(slab_fill_and_drain) {
  /* fill one slab of class _i completely, then a second one; drain both */
  static const uint64_t sizes[] = {64, 192, 320, 4096, 72 * 128, 16 << 10};
  uint64_t sz = sizes[_i];
  kvp_pool *p = mkpool(32 * MB, 0, 1, 1);
  uint32_t sc = kvp__sc_index(sz), nslots = (uint32_t)(p->alloc.class_slab_bytes[sc] / kvp__sc_size(sc));
  uint32_t n = nslots + 1;
  kvp_page_id *ids = calloc(n, sizeof *ids);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_CODES, 0);
  for (uint32_t i = 0; i < n; i++) /* plain checks in the loop: a Check assertion logs each call */
    if (kvp_page_alloc(p, sz, &t, &ids[i])) ck_abort_msg("alloc %u: %s", i, kvp_last_error());
  ck_pool(p);
  kvp__bin *b = &p->alloc.bins[sc];
  ck_assert_uint_eq(b->nslabs, 2);
  ck_assert_uint_eq(b->nused - b->ncached, n); /* the pages' slots; the rest of the taken ones are cached */
  /* slots of the first slab are distinct and inside it */
  kvp_page_desc d0, d;
  ck_ok(kvp_page_describe(p, ids[0], &d0));
  for (uint32_t i = 1; i < nslots; i++)
    if (kvp_page_describe(p, ids[i], &d) || (char *)d.addr - (char *)d0.addr != (ptrdiff_t)(i * kvp__sc_size(sc)))
      ck_abort_msg("slot %u is not at its place in the slab", i);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_committed.current, 2 * p->alloc.class_slab_bytes[sc]);
  for (uint32_t i = 0; i < n; i++) {
    if (kvp_page_free(p, ids[i])) ck_abort_msg("free %u: %s", i, kvp_last_error());
    if (i % 97 == 0 && kvp_check(p)) ck_abort_msg("after free %u: %s", i, kvp_last_error());
  }
  ck_pool(p);
  ck_assert_uint_eq(b->nused, b->ncached); /* no page's slot: only cached ones are taken */
  ck_assert_uint_le(b->ncached, b->cache_cap);
  kvp__bins_flush_all(&p->alloc);
  ck_pool(p);
  ck_assert_uint_eq(b->nused, 0);
  ck_assert_uint_le(b->nslabs, 1); /* at most one empty slab kept per class */
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  ck_assert_uint_eq(s.bytes_allocated.peak, (uint64_t)n * kvp__sc_size(sc));
  free(ids);
  kvp_pool_destroy(p);
}
END_TEST

/* A small region holds slabs of many classes at once: a slab is sized for
 * 8 slots (at least 16 KiB, or an 8th of the cap), capped at a 32nd of the
 * region, so a 4 MiB region takes one page of each of the 64 classes of 16..1024 bytes
 * and of 23 more up to its largest slab class (16 KiB, 9/8 apart), where a
 * 2 MiB slab per class failed at the third class with 192 bytes allocated;
 * the 2 MiB region, the smallest, takes 81 classes (up to 8 KiB). */
START_TEST(small_region_many_classes) {
  ck_assert_uint_eq(kvp__slab_bytes_for(4ull << 20), 128ull << 10);
  ck_assert_uint_eq(kvp__slab_bytes_for(1ull << 20), KVP__SLAB_MIN_BYTES);
  ck_assert_uint_eq(kvp__slab_bytes_for(100ull << 20), KVP__SLAB_BYTES);
  ck_assert_uint_eq(kvp__slab_bytes_for(48ull << 20), 1ull << 20);
  ck_assert_uint_eq(kvp__slab_bytes_of(8, KVP__SLAB_BYTES), 4 << 10); /* 512 slots */
  ck_assert_uint_eq(kvp__slab_bytes_of(64, KVP__SLAB_BYTES), 32 << 10);   /* 512 slots */
  ck_assert_uint_eq(kvp__slab_bytes_of(4096, KVP__SLAB_BYTES), 256 << 10); /* the floor: 64 slots */
  ck_assert_uint_eq(kvp__slab_bytes_of(1024, 128 << 10), 16 << 10);        /* a 4 MiB region's floor: 16 slots */
  ck_assert_uint_eq(kvp__slab_bytes_of(8192, 128 << 10), 64 << 10);        /* 8 slots at least */
  ck_assert_uint_eq(kvp__slab_bytes_of(33280, KVP__SLAB_BYTES), 8 * 33280);
  ck_assert_uint_eq(kvp__slab_bytes_of(KVP__SMALL_MAX_BYTES, KVP__SLAB_BYTES), 8 * KVP__SMALL_MAX_BYTES);
  for (int r = 0; r < 2; r++) {
    uint64_t region = r ? 2 * MB : 4 * MB;
    kvp_pool *p = mkpool(region, 0, 1, 1);
    ck_assert_uint_eq(p->alloc.small_max_bytes, r ? 8 << 10 : 16 << 10);
    ck_assert_uint_eq(p->alloc.class_slab_bytes[kvp__sc_index(64)], r ? 8 << 10 : 16 << 10);
    ck_assert_uint_eq(p->alloc.class_slab_bytes[kvp__sc_index(1024)], r ? 8 << 10 : 16 << 10);
    ck_assert_uint_eq(p->alloc.class_slab_bytes[p->alloc.nsmall - 1], p->alloc.slab_bytes); /* the cap: 8 slots */
    kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_CODES, 0);
    kvp_page_id ids[96];
    uint64_t want = 0, req = 0;
    uint32_t n = 0, nwant = r ? 81 : 87;
    for (uint64_t sz = 16; n < nwant; sz = sz < 1024 ? sz + 16 : sz * 9 / 8) {
      uint32_t c = kvp__sc_index(sz);
      if (c >= p->alloc.nsmall) break;
      ck_assert_uint_ge(p->alloc.class_slab_bytes[c] / kvp__sc_size(c), KVP__SLAB_MIN_SLOTS);
      want += p->alloc.class_slab_bytes[c];
      req += sz;
      if (kvp_page_alloc(p, sz, &t, &ids[n])) ck_abort_msg("%u MiB region, page %u (%llu bytes, %llu allocated): %s",
                                                         (unsigned)(region / MB), n, (unsigned long long)sz,
                                                         (unsigned long long)req, kvp_last_error());
      n++;
      ck_pool(p);
    }
    ck_assert_uint_eq(n, nwant);
    kvp_stats s = {.struct_size = sizeof s};
    ck_ok(kvp_stats_get(p, &s));
    ck_assert_uint_eq(s.bytes_committed.current, want);
    ck_assert_uint_le(want, region);
    for (uint32_t i = 0; i < n; i++) ck_ok(kvp_page_free(p, ids[i]));
    ck_pool(p);
    kvp_pool_destroy(p);
  }
}
END_TEST

/* A small class never needs a 2 MiB slab, in a large region too: a 64 B
 * page commits 32 KiB; a region with room for a few small slabs only still
 * serves many classes, and every slab's slot is found again on free. */
START_TEST(small_class_small_slab) {
  kvp_pool *p = mkpool(128 * MB, 0, 1, 1);
  ck_assert_uint_eq(p->alloc.slab_bytes, KVP__SLAB_BYTES);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_SCALES, 0);
  kvp_page_id a, big;
  ck_ok(kvp_page_alloc(p, 64, &t, &a));
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_committed.current, 32 << 10);
  /* leave 512 KiB of the region: room for slabs of three more classes (56 + 80 + 104 KiB), where one
   * 2 MiB slab per class would have none */
  ck_ok(kvp_page_alloc(p, 128 * MB - (32 << 10) - (512 << 10), &t, &big));
  kvp_page_id ids[5];
  static const uint64_t sz[5] = {100, 150, 200, 60, 64};
  for (int i = 0; i < 5; i++) {
    ck_ok(kvp_page_alloc(p, sz[i], &t, &ids[i]));
    ck_pool(p);
  }
  for (int i = 0; i < 5; i++) ck_ok(kvp_page_free(p, ids[i]));
  ck_ok(kvp_page_free(p, a));
  ck_ok(kvp_page_free(p, big));
  ck_pool(p);
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(slab_bitmap_reuses_lowest) {
  kvp_pool *p = mkpool(64 * MB, 0, 1, 1); /* 512-slot slabs: the 200 pages share one */
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  kvp_page_id ids[200];
  kvp_page_desc d[200];
  for (int i = 0; i < 140; i++) { /* one slab of 512 slots */
    ck_ok(kvp_page_alloc(p, 100, &t, &ids[i]));
    ck_ok(kvp_page_describe(p, ids[i], &d[i]));
  }
  ck_ok(kvp_page_free(p, ids[7]));
  ck_ok(kvp_page_free(p, ids[100]));
  kvp__bins_flush_all(&p->alloc); /* the bitmap's order, under the cache (LIFO: cache_is_lifo) */
  ck_pool(p);
  kvp_page_id a, b;
  kvp_page_desc da, db;
  ck_ok(kvp_page_alloc(p, 112, &t, &a)); /* 100's class */
  ck_ok(kvp_page_alloc(p, 97, &t, &b));
  ck_ok(kvp_page_describe(p, a, &da));
  ck_ok(kvp_page_describe(p, b, &db));
  ck_assert_ptr_eq(da.addr, d[7].addr);
  ck_assert_ptr_eq(db.addr, d[100].addr);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* Device-level bytes of a host region scan only up to the allocator's
 * high-water mark: the same figure as a scan of the whole region, whatever
 * was written, freed, or faulted in as huge pages. */
START_TEST(host_usage_scans_the_high_water_mark) {
  kvp_pool *p = mkpool(256 * MB, 0, 1, 1);
  kvp__region *r = &p->alloc.region;
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  uint64_t used = 1, total = 0, full = 1;
  ck_ok(r->ops->usage(r, atomic_load(&p->alloc.ext.hwm_bytes), &used, &total));
  ck_assert_uint_eq(used, 0); /* nothing written yet */
  ck_assert_uint_eq(total, 256 * MB);
  static const uint64_t sizes[] = {100, 5000, 20000, 3 * MB, 40000, 17 * MB, 64};
  kvp_page_id ids[7];
  for (int i = 0; i < 7; i++) {
    kvp_page_desc d;
    ck_ok(kvp_page_alloc(p, sizes[i], &t, &ids[i]));
    ck_ok(kvp_page_describe(p, ids[i], &d));
    memset(d.addr, 0x5a, sizes[i]); /* faults the pages in */
    uint64_t hwm = atomic_load(&p->alloc.ext.hwm_bytes);
    ck_assert_uint_le(hwm, 256 * MB);
    ck_ok(r->ops->usage(r, hwm, &used, &total));
    ck_ok(r->ops->usage(r, r->bytes, &full, &total));
    ck_assert_uint_eq(used, full);
    ck_assert_uint_ge(used, sizes[i]);
  }
  ck_ok(kvp_page_free(p, ids[5]));
  uint64_t hwm = atomic_load(&p->alloc.ext.hwm_bytes);
  ck_ok(r->ops->usage(r, hwm, &used, &total));
  ck_ok(r->ops->usage(r, r->bytes, &full, &total));
  ck_assert_uint_eq(used, full); /* freed pages stay resident, and the mark stays */
  ck_assert_uint_ge(used, 17 * MB);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(budget_exactly_reachable_never_passable) {
  /* budget = 10 pages of 4 KiB plus 64 B: reachable exactly, never passed */
  uint64_t budget = 10 * 4096 + 64;
  kvp_pool *p = mkpool(16 * MB, budget, 1, 1);
  kvp_page_tag t = tag_of(3, 0, 0, KVP_PAGE_RAW, 1);
  kvp_page_id ids[11], last;
  for (int i = 0; i < 10; i++) ck_ok(kvp_page_alloc(p, 4065, &t, &ids[i])); /* class 4096 */
  kvp_stats s0 = {.struct_size = sizeof s0}, s1 = {.struct_size = sizeof s1};
  ck_ok(kvp_stats_get(p, &s0));
  ck_status(kvp_page_alloc(p, 4096, &t, &ids[10]), KVP_EBUDGET);
  ck_assert(strstr(kvp_last_error(), "budget 41024") != NULL);
  ck_status(kvp_page_alloc(p, 65, &t, &ids[10]), KVP_EBUDGET); /* class 80 > 64 left */
  ck_ok(kvp_page_alloc(p, 64, &t, &last));                    /* exactly the budget */
  ck_ok(kvp_stats_get(p, &s1));
  ck_assert_uint_eq(s1.bytes_allocated.current, budget);
  ck_assert_uint_eq(s1.bytes_allocated.peak, budget);
  ck_assert_uint_eq(s1.budget_refusals, 2);
  ck_status(kvp_page_alloc(p, 1, &t, &ids[10]), KVP_EBUDGET);
  /* a refused call changed nothing but the refusal counter */
  ck_ok(kvp_stats_get(p, &s1));
  ck_assert_uint_eq(s1.pages.current, 11);
  ck_assert_uint_eq(s1.bytes_requested.current, s0.bytes_requested.current + 64);
  ck_pool(p);
  /* a grow that would need both pages during the move is refused too */
  ck_status(kvp_page_grow(p, ids[0], 8000), KVP_EBUDGET);
  ck_ok(kvp_page_grow(p, ids[0], 4096)); /* same class: in place */
  ck_pool(p);
  ck_ok(kvp_page_free(p, last));
  ck_ok(kvp_page_free(p, ids[1]));
  ck_status(kvp_page_grow(p, ids[0], 8000), KVP_EBUDGET); /* 9 x 4096 + 8000 > budget */
  ck_ok(kvp_page_free(p, ids[2]));
  ck_ok(kvp_page_grow(p, ids[0], 8000)); /* 8 x 4096 + 8000 fit during the move */
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(region_full_is_enospc) {
  kvp_pool *p = mkpool(4 * MB, 64 * MB, 1, 1); /* budget past the region: space binds first */
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  kvp_page_id a, b, c, d;
  ck_ok(kvp_page_alloc(p, 3 * MB, &t, &a));
  ck_status(kvp_page_alloc(p, 2 * MB, &t, &b), KVP_ENOSPC);
  ck_assert(strstr(kvp_last_error(), "region") != NULL);
  ck_ok(kvp_page_alloc(p, 64, &t, &b)); /* a 16 KiB slab in the last MiB */
  ck_assert_uint_eq(p->alloc.class_slab_bytes[kvp__sc_index(64)], 16 << 10);
  ck_ok(kvp_page_alloc(p, 1 * MB - p->alloc.class_slab_bytes[kvp__sc_index(64)], &t, &c));
  ck_status(kvp_page_alloc(p, 192, &t, &d), KVP_ENOSPC); /* no room for a slab of another class */
  ck_ok(kvp_page_alloc(p, 64, &t, &d));                  /* the slab of its class has room */
  ck_pool(p);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_committed.current, 4 * MB);
  ck_assert_uint_eq(s.nospc_refusals, 2);
  ck_ok(kvp_page_free(p, a));
  ck_ok(kvp_page_free(p, d));
  ck_ok(kvp_page_alloc(p, 192, &t, &d));
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(grow_moves_keep_payload) {
  kvp_pool *p = mkpool(32 * MB, 0, 2, 2);
  kvp_page_tag t = tag_of(9, 1, 1, KVP_PAGE_OUTLIERS, 1);
  kvp_page_id id;
  ck_ok(kvp_page_alloc(p, 100, &t, &id));
  uint64_t want = 100;
  unsigned char *ref = malloc(4 * MB);
  for (uint64_t i = 0; i < 4 * MB; i++) ref[i] = (unsigned char)(i * 131 + 7);
  kvp_page_desc d;
  ck_ok(kvp_page_describe(p, id, &d));
  memcpy(d.addr, ref, want);
  /* through slab classes, into extents, in place and moved */
  while (want < 3 * MB) {
    want = want * 3 / 2 + 1;
    ck_ok(kvp_page_grow(p, id, want));
    ck_ok(kvp_page_describe(p, id, &d));
    ck_assert_uint_eq(d.requested_bytes, want);
    ck_assert_uint_ge(d.allocated_bytes, want);
    uint64_t have = want * 2 / 3; /* bytes written before this grow */
    ck_assert_int_eq(memcmp(d.addr, ref, have), 0);
    memcpy(d.addr, ref, want);
    ck_pool(p);
  }
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_gt(s.grow_moves, 5);
  ck_assert_uint_eq(s.pages.current, 1);
  ck_ok(kvp_page_grow(p, id, 10)); /* shrink keeps the page and its first bytes */
  ck_ok(kvp_page_describe(p, id, &d));
  ck_assert_int_eq(memcmp(d.addr, ref, 10), 0);
  ck_pool(p);
  free(ref);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(large_grow_in_place) {
  kvp_pool *p = mkpool(32 * MB, 0, 1, 1);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  kvp_page_id id;
  ck_ok(kvp_page_alloc(p, 320 << 10, &t, &id)); /* an extent */
  kvp_page_desc d0, d1;
  ck_ok(kvp_page_describe(p, id, &d0));
  ck_ok(kvp_page_grow(p, id, 1 * MB));
  ck_ok(kvp_page_describe(p, id, &d1));
  ck_assert_ptr_eq(d0.addr, d1.addr); /* the free space after it was taken */
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.grow_moves, 0);
  ck_assert_uint_eq(s.bytes_committed.current, 1 * MB);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* Large pages are sized to the 4 KiB extent unit, not to a size class: the
 * ledger, the stats and kvp_page_describe all say align_up(requested, 4 KiB),
 * the budget binds on those bytes exactly, and a refused page changes nothing. */
START_TEST(large_pages_exact_sizes) {
  static const uint64_t sizes[] = {262145, 266239, 266240, 266241, 300001, 1180000, 1310720 - 4096 + 1, 3 * MB + 17};
  enum { N = sizeof sizes / sizeof *sizes };
  kvp__sc_init();
  uint64_t want = 0, req = 0;
  for (int i = 0; i < N; i++) {
    uint64_t a = kvp__alloc_size_for(KVP__SMALL_MAX_BYTES, 8, sizes[i]);
    ck_assert_uint_eq(a, (sizes[i] + KVP__EXTENT_UNIT - 1) / KVP__EXTENT_UNIT * KVP__EXTENT_UNIT);
    ck_assert_uint_lt(a - sizes[i], KVP__EXTENT_UNIT);
    want += a;
    req += sizes[i];
  }
  ck_assert_uint_eq(kvp__alloc_size_for(KVP__SMALL_MAX_BYTES, 8, KVP__SMALL_MAX_BYTES), KVP__SMALL_MAX_BYTES);
  ck_assert_uint_eq(kvp__alloc_size_for(KVP__SMALL_MAX_BYTES, 8, 1000), 1008);
  ck_assert_uint_eq(kvp__alloc_size_for(KVP__SMALL_MAX_BYTES, 8, KVP_MAX_PAGE_BYTES), 1ull << 32);
  /* the budget is exactly the sum: a size class would have passed it (1180000 -> 1.25 MiB) */
  kvp_pool *p = mkpool(64 * MB, want, 1, 1);
  ck_assert_uint_eq(p->alloc.small_max_bytes, KVP__SMALL_MAX_BYTES);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_CODES, 0);
  kvp_page_id ids[N];
  for (int i = 0; i < N; i++) {
    ck_ok(kvp_page_alloc(p, sizes[i], &t, &ids[i]));
    kvp_page_desc d;
    ck_ok(kvp_page_describe(p, ids[i], &d));
    ck_assert_uint_eq(d.requested_bytes, sizes[i]);
    ck_assert_uint_eq(d.allocated_bytes, kvp__alloc_size(&p->alloc, sizes[i]));
    ck_assert_uint_eq((uintptr_t)d.addr % KVP__EXTENT_UNIT, 0);
    ck_pool(p);
  }
  kvp_stats s = {.struct_size = sizeof s}, s2 = {.struct_size = sizeof s2};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_allocated.current, want);
  ck_assert_uint_eq(s.bytes_requested.current, req);
  ck_assert_uint_eq(s.bytes_allocated.current, s.budget_bytes);
  ck_assert_double_le((double)s.bytes_allocated.current / (double)s.bytes_requested.current, 1.01);
  /* both figures are emitted */
  char buf[1 << 16];
  size_t len = 0;
  ck_ok(kvp_stats_write(p, KVP_STATS_JSON, buf, sizeof buf, &len));
  ck_assert(strstr(buf, "\"bytes.requested\"") && strstr(buf, "\"bytes.allocated\""));
  /* full to the byte: one more unit is refused and nothing changes */
  kvp_page_id extra;
  ck_status(kvp_page_alloc(p, 262145, &t, &extra), KVP_EBUDGET);
  ck_assert(strstr(kvp_last_error(), "266240 allocated") != NULL);
  ck_ok(kvp_stats_get(p, &s2));
  ck_assert_uint_eq(s2.bytes_allocated.current, want);
  ck_assert_uint_eq(s2.bytes_requested.current, req);
  ck_assert_uint_eq(s2.bytes_committed.current, s.bytes_committed.current);
  ck_pool(p);
  /* growing inside the page's own 4 KiB unit moves nothing and allocates nothing */
  ck_ok(kvp_page_grow(p, ids[1], 266240));
  ck_ok(kvp_stats_get(p, &s2));
  ck_assert_uint_eq(s2.bytes_allocated.current, want);
  ck_assert_uint_eq(s2.bytes_requested.current, req + 1);
  /* shrinking keeps the bytes (no move), the request follows */
  ck_ok(kvp_page_grow(p, ids[5], 100));
  kvp_page_desc d;
  ck_ok(kvp_page_describe(p, ids[5], &d));
  ck_assert_uint_eq(d.allocated_bytes, kvp__alloc_size(&p->alloc, 1180000));
  ck_assert_uint_eq(d.requested_bytes, 100);
  ck_pool(p);
  /* growing past it would pass the budget: refused, unchanged */
  ck_status(kvp_page_grow(p, ids[0], 266241), KVP_EBUDGET);
  ck_ok(kvp_page_describe(p, ids[0], &d));
  ck_assert_uint_eq(d.requested_bytes, 262145);
  ck_assert_uint_eq(d.allocated_bytes, 266240);
  ck_pool(p);
  for (int i = 0; i < N; i++) ck_ok(kvp_page_free(p, ids[i]));
  ck_ok(kvp_stats_get(p, &s2));
  ck_assert_uint_eq(s2.bytes_allocated.current, 0);
  ck_assert_uint_eq(s2.bytes_requested.current, 0);
  ck_assert_uint_eq(s2.bytes_committed.current, p->alloc.large_cached_bytes); /* the last ones kept for reuse */
  ck_pool(p);
  ck_ok(kvp_reclaim(p));
  ck_ok(kvp_stats_get(p, &s2));
  ck_assert_uint_eq(s2.bytes_committed.current, 0);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* Best fit: of the free holes, the smallest that holds the request is taken,
 * whatever order they were freed in. */
START_TEST(extents_best_fit) {
  kvp__sc_init();
  kvp__meta m = {0};
  kvp__extents x;
  const uint64_t U = KVP__EXTENT_UNIT;
  ck_ok(kvp__extents_init(&x, 16 * MB, &m));
  /* holes of 10, 6, 8 and 7 units between used separators */
  static const uint64_t holes[] = {10, 6, 8, 7};
  kvp__extent *h[4], *sep[5];
  for (int i = 0; i < 4; i++) {
    ck_ok(kvp__extent_alloc(&x, U, U, KVP__EXT_LARGE, &sep[i]));
    ck_ok(kvp__extent_alloc(&x, holes[i] * U, U, KVP__EXT_LARGE, &h[i]));
  }
  ck_ok(kvp__extent_alloc(&x, U, U, KVP__EXT_LARGE, &sep[4]));
  uint64_t off[4];
  for (int i = 0; i < 4; i++) off[i] = h[i]->off;
  for (int i = 0; i < 4; i++) kvp__extent_free(&x, h[i]);
  ck_ok(kvp__extents_check(&x));
  kvp__extent *e;
  ck_ok(kvp__extent_alloc(&x, 7 * U, U, KVP__EXT_LARGE, &e)); /* exact: the 7-unit hole */
  ck_assert_uint_eq(e->off, off[3]);
  ck_ok(kvp__extent_alloc(&x, 5 * U, U, KVP__EXT_LARGE, &e)); /* the 6-unit hole, not the first (10) */
  ck_assert_uint_eq(e->off, off[1]);
  ck_ok(kvp__extent_alloc(&x, 8 * U, U, KVP__EXT_LARGE, &e)); /* the 8-unit hole */
  ck_assert_uint_eq(e->off, off[2]);
  ck_ok(kvp__extent_alloc(&x, 9 * U, U, KVP__EXT_LARGE, &e)); /* the 10-unit hole */
  ck_assert_uint_eq(e->off, off[0]);
  ck_ok(kvp__extents_check(&x));
  kvp__extents_fini(&x);
  ck_assert_uint_eq(m.bytes, 0);
}
END_TEST

/* ---- bad input --------------------------------------------------------- */

START_TEST(bad_sizes_and_ids) {
  kvp_pool *p = mkpool(8 * MB, 0, 2, 2);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  kvp_page_id id;
  ck_status(kvp_page_alloc(p, 0, &t, &id), KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "page size 0") != NULL);
  ck_status(kvp_page_alloc(p, 1ull << 40, &t, &id), KVP_EINVAL);
  ck_status(kvp_page_alloc(p, 64, NULL, &id), KVP_EINVAL);
  kvp_page_tag bad = t;
  bad.layer = 2;
  ck_status(kvp_page_alloc(p, 64, &bad, &id), KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "layer 2") != NULL);
  bad = t;
  bad.head = 5;
  ck_status(kvp_page_alloc(p, 64, &bad, &id), KVP_EINVAL);
  bad = t;
  bad.kv = 2;
  ck_status(kvp_page_alloc(p, 64, &bad, &id), KVP_EINVAL);
  bad = t;
  bad.type = KVP_PAGE_TYPE_COUNT;
  ck_status(kvp_page_alloc(p, 64, &bad, &id), KVP_EINVAL);
  ck_pool(p);
  ck_ok(kvp_page_alloc(p, 64, &t, &id));
  ck_ok(kvp_page_free(p, id));
  ck_status(kvp_page_free(p, id), KVP_ENOENT); /* double free */
  ck_assert(strstr(kvp_last_error(), "not live") != NULL);
  ck_status(kvp_page_free(p, 0), KVP_ENOENT);
  ck_status(kvp_page_free(p, 0xdeadbeef00000001ull), KVP_ENOENT);
  ck_status(kvp_page_grow(p, id, 100), KVP_ENOENT);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(internal_free_rejects_foreign_and_double) {
  kvp_pool *p = mkpool(8 * MB, 0, 1, 1);
  kvp__tag t = {1, 0, 0, KVP_PAGE_RAW, 0, 0};
  kvp__page a, b, big;
  ck_ok(kvp__alloc_page(&p->alloc, 1000, &t, &a));
  ck_ok(kvp__alloc_page(&p->alloc, 1000, &t, &b));
  ck_ok(kvp__alloc_page(&p->alloc, 1 * MB, &t, &big));
  kvp__page f = a;
  f.off += 64; /* inside a slot, not at its start */
  ck_status(kvp__alloc_free(&p->alloc, &f), KVP_EINVAL);
  f = a;
  f.off = 7 * MB; /* unused part of the region */
  ck_status(kvp__alloc_free(&p->alloc, &f), KVP_EINVAL);
  f = a;
  f.off = 1ull << 40; /* outside the region */
  ck_status(kvp__alloc_free(&p->alloc, &f), KVP_EINVAL);
  f = a;
  f.size8 = (uint32_t)(kvp__sc_size(kvp__page_class(&a) + 1) >> 3); /* wrong class */
  ck_status(kvp__alloc_free(&p->alloc, &f), KVP_EINVAL);
  f = a;
  f.size8 += 1; /* no class at all */
  ck_status(kvp__alloc_free(&p->alloc, &f), KVP_EINVAL);
  f = big;
  f.size8 += KVP__EXTENT_UNIT >> 3; /* a large page of the wrong size */
  ck_status(kvp__alloc_free(&p->alloc, &f), KVP_EINVAL);
  f = big;
  f.off += KVP__EXTENT_UNIT; /* inside a large page */
  ck_status(kvp__alloc_free(&p->alloc, &f), KVP_EINVAL);
  ck_ok(kvp__alloc_check(&p->alloc));
  ck_ok(kvp__alloc_free(&p->alloc, &a));
  ck_status(kvp__alloc_free(&p->alloc, &a), KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "double free") != NULL);
  ck_ok(kvp__alloc_free(&p->alloc, &big));
  ck_status(kvp__alloc_free(&p->alloc, &big), KVP_EINVAL);
  ck_ok(kvp__alloc_free(&p->alloc, &b));
  ck_ok(kvp__alloc_check(&p->alloc));
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(check_detects_corruption) {
  kvp_pool *p = mkpool(8 * MB, 0, 1, 1);
  kvp_page_tag t = tag_of(1, 0, 0, KVP_PAGE_RAW, 0);
  kvp_page_id id;
  ck_ok(kvp_page_alloc(p, 1000, &t, &id));
  ck_pool(p);
  p->alloc.ledger.requested.current += 1;
  ck_status(kvp_check(p), KVP_ECORRUPT);
  p->alloc.ledger.requested.current -= 1;
  p->alloc.ledger.allocated.current += 64;
  ck_status(kvp_check(p), KVP_ECORRUPT);
  p->alloc.ledger.allocated.current -= 64;
  atomic_fetch_add(&p->stats.places[0].requested_bytes, 1); /* the cell of (layer 0, head 0) */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  ck_assert(strstr(kvp_last_error(), "layer 0") != NULL);
  atomic_fetch_sub(&p->stats.places[0].requested_bytes, 1);
  ck_pool(p);
  atomic_fetch_add(&p->stats.kinds[kvp__stats_kind(0, 1, KVP_PAGE_CODES)].npages, 1); /* V, no such page */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  ck_assert(strstr(kvp_last_error(), "page type 1") != NULL);
  atomic_fetch_sub(&p->stats.kinds[kvp__stats_kind(0, 1, KVP_PAGE_CODES)].npages, 1);
  ck_pool(p);
  p->alloc.bins[kvp__sc_index(1000)].cur->bitmap[0] ^= 1; /* flip a slot */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  p->alloc.bins[kvp__sc_index(1000)].cur->bitmap[0] ^= 1;
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* The per-sequence slots behind the last one's and the hints: pages of
 * more sequences than there are hints, another sequence at every call (the
 * table rebuilt as it grows, hints taken over by colliding sequences),
 * count each in its own sequence, exactly; kvp_check finds a hint or a
 * last slot that is not its sequence's slot. */
START_TEST(seq_hints_count_exactly) {
  enum { NSEQ = 3 * KVP__SEQ_HINTS, NPG = 3 };
  kvp_pool *p = mkpool(64 * MB, 0, 1, 1);
  static kvp_page_id ids[NSEQ][NPG];
  static kvp_usage want[NSEQ];
  for (uint32_t j = 0; j < NPG; j++)
    for (uint64_t s = 0; s < NSEQ; s++) { /* ids far apart too: every 64th is s << 32 */
      uint64_t seq = s % 64 ? s : s << 32, bytes = 40 + (s * 13 + j) % 300;
      kvp_page_tag t = tag_of(seq, 0, 0, KVP_PAGE_RAW, j & 1);
      ck_ok(kvp_page_alloc(p, bytes, &t, &ids[s][j]));
      kvp_page_desc d;
      ck_ok(kvp_page_describe(p, ids[s][j], &d));
      want[s].requested_bytes += bytes;
      want[s].allocated_bytes += d.allocated_bytes;
      want[s].npages++;
    }
  ck_pool(p);
  for (uint64_t s = 0; s < NSEQ; s += 2) /* every other sequence's pages go, one page of each in turn */
    for (uint32_t j = 0; j < NPG; j++) {
      ck_ok(kvp_page_free(p, ids[s][j]));
      want[s] = (kvp_usage){0, 0, 0};
    }
  ck_pool(p);
  for (uint64_t s = 0; s < NSEQ; s++) {
    kvp_usage u = {0, 0, 0};
    int rc = kvp_stats_breakdown(p, KVP_DIM_SEQ, s % 64 ? s : s << 32, &u);
    ck_assert(rc == KVP_OK || (rc == KVP_ENOENT && !want[s].npages));
    ck_assert_uint_eq(u.requested_bytes, want[s].requested_bytes);
    ck_assert_uint_eq(u.allocated_bytes, want[s].allocated_bytes);
    ck_assert_uint_eq(u.npages, want[s].npages);
  }
  uint32_t h = 0;
  while (!p->stats.seq_hint[h].slot) h++;
  p->stats.seq_hint[h].seq ^= 1; /* a hint of another sequence's slot */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  ck_assert(strstr(kvp_last_error(), "sequence hint") != NULL);
  p->stats.seq_hint[h].seq ^= 1;
  ck_pool(p);
  kvp__seq_usage *last = p->stats.seq_last;
  ck_assert_ptr_nonnull(last);
  p->stats.seq_last = (kvp__seq_usage *)&p->stats; /* not a slot of the table */
  ck_status(kvp_check(p), KVP_ECORRUPT);
  ck_assert(strstr(kvp_last_error(), "last sequence slot") != NULL);
  p->stats.seq_last = last;
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* ---- churn ------------------------------------------------------------- */

/* Page sizes drawn from the codec table at D = 128 (DESIGN.md section 7):
 * per-block pages of 16 tokens, per-segment metadata, and scale-sized pages. */
static uint64_t churn_size(uint64_t *rng) {
  static const uint64_t mix[] = {64,   128,  2048, 2112, 4096, 8192,  512,  1024, 1152,
                                 3264, 9216, 4,    40,   72,   65536, 262144, 1 << 20};
  uint64_t r = t_rand(rng);
  uint64_t base = mix[r % KVP__ARRAY_LEN(mix)];
  return base + ((r >> 20) % 3 == 0 ? (r >> 32) % (base / 2 + 1) : 0);
}

START_TEST(churn_100k_with_check) {
  enum { NLIVE = 512, NOPS = 100000 };
  kvp_pool *p = mkpool(256 * MB, 40 * MB, 4, 8); /* many classes: slabs need room */
  kvp_page_id live[NLIVE] = {0};
  uint64_t rng = 0x1234567 + (uint64_t)_i, nok[3] = {0}, nbudget = 0, nspace = 0;
  for (int op = 0; op < NOPS; op++) {
    uint64_t r = t_rand(&rng);
    uint32_t slot = (uint32_t)(r % NLIVE);
    int kind = (int)((r >> 16) % 10); /* 0-4 alloc, 5-7 free, 8-9 grow */
    int rc;
    if (!live[slot] || kind < 5) {
      if (live[slot]) {
        ck_ok(kvp_page_free(p, live[slot]));
        live[slot] = 0;
      }
      kvp_page_tag t = tag_of(r >> 40 & 15, (uint32_t)(r >> 24) % 4, (uint32_t)(r >> 28) % 8,
                              (kvp_page_type)((r >> 32) % KVP_PAGE_TYPE_COUNT), (uint32_t)(r >> 36) & 1);
      t.codec = (uint32_t)(r >> 44) % 5;
      rc = kvp_page_alloc(p, churn_size(&rng), &t, &live[slot]);
      if (rc) live[slot] = 0;
      nok[0] += rc == KVP_OK;
    } else if (kind < 8) {
      rc = kvp_page_free(p, live[slot]);
      live[slot] = 0;
      nok[1] += rc == KVP_OK;
    } else {
      kvp_page_desc d;
      ck_ok(kvp_page_describe(p, live[slot], &d));
      rc = kvp_page_grow(p, live[slot], d.requested_bytes + 1 + d.requested_bytes / 2);
      nok[2] += rc == KVP_OK;
    }
    ck_assert_msg(rc == KVP_OK || rc == KVP_EBUDGET || rc == KVP_ENOSPC, "op %d: %s", op, kvp_last_error());
    nbudget += rc == KVP_EBUDGET;
    nspace += rc == KVP_ENOSPC;
    int crc = kvp_check(p);
    ck_assert_msg(crc == KVP_OK, "op %d: %s", op, kvp_last_error());
  }
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  fprintf(stderr, "churn: %llu allocs, %llu frees, %llu grows ok; %llu budget, %llu space refusals; peak %llu, "
          "committed peak %llu\n",
          (unsigned long long)nok[0], (unsigned long long)nok[1], (unsigned long long)nok[2],
          (unsigned long long)nbudget, (unsigned long long)nspace, (unsigned long long)s.bytes_allocated.peak,
          (unsigned long long)s.bytes_committed.peak);
  ck_assert_uint_le(s.bytes_allocated.peak, 40 * MB);
  ck_assert_uint_gt(nok[0] + nok[1] + nok[2], NOPS / 2);
  ck_assert_uint_gt(nbudget, 0); /* the budget really bound */
  for (int i = 0; i < NLIVE; i++)
    if (live[i]) ck_ok(kvp_page_free(p, live[i]));
  ck_pool(p);
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  ck_assert_uint_eq(s.bytes_requested.current, 0);
  kvp_pool_destroy(p);
}
END_TEST

/* ---- transactions -------------------------------------------------------- */

typedef struct ledger_fp {
  uint64_t req, alloc, pages, allocs, frees;
} ledger_fp;
static ledger_fp ledger_of(const kvp__alloc *a) {
  const kvp__ledger *l = &a->ledger;
  return (ledger_fp){l->requested.current, l->allocated.current, l->pages.current, l->allocs, l->frees};
}

/* Pages of many classes and large sizes over a region with holes; a third
 * of them freed in a transaction (variant 0, 2: out of the ledger only;
 * 1, 3: their bytes back to the region too), the region then filled with
 * new pages over whatever is free, those given back. Rollback (0, 1): every
 * freed page is live again at its own offset (freeing it again succeeds;
 * with its bytes back, slabs that had emptied are made again where they
 * were, large pages split their free extent again), the ledger's figures
 * and counters are as before but for the new pages' allocs and frees, and
 * kvp__alloc_check passes (address map chunks included: a 64 MiB region
 * spans four). Commit (2, 3): the frees stand, counted once. */
START_TEST(txn_rollback_puts_pages_back) {
  enum { N = 600, NNEW = 4000 };
  bool space = _i & 1, commit = _i >= 2;
  kvp_pool *p = mkpool(64 * MB, 0, 1, 1);
  kvp__alloc *a = &p->alloc;
  kvp__tag t = {1, 0, 0, KVP_PAGE_RAW, 0, 0};
  static kvp__page pg[N], nw[NNEW];
  bool live[N];
  uint64_t rng = 0xfeed + (uint64_t)_i;
  uint32_t nlive = 0;
  for (uint32_t i = 0; i < N; i++) {
    live[i] = kvp__alloc_page(a, churn_size(&rng), &t, &pg[i]) == KVP_OK;
    nlive += live[i];
  }
  ck_assert_uint_gt(nlive, N / 2);
  for (uint32_t i = 0; i < N; i++) /* holes */
    if (live[i] && t_rand(&rng) % 3 == 0) {
      ck_ok(kvp__alloc_free(a, &pg[i]));
      live[i] = false;
    }
  bool victim[N];
  uint32_t nvictim = 0;
  for (uint32_t i = 0; i < N; i++) nvictim += (victim[i] = live[i] && t_rand(&rng) % 3 == 0);
  ck_assert_uint_gt(nvictim, 20);
  ledger_fp before = ledger_of(a);
  kvp__alloc_tx tx;
  memset(&tx, 0, sizeof tx);
  for (uint32_t i = 0; i < N; i++)
    if (victim[i]) ck_ok(kvp__alloc_tx_reserve(a, &tx, &pg[i]));
  kvp__alloc_tx_begin(a, &tx);
  uint64_t freed_bytes = 0;
  for (uint32_t i = 0; i < N; i++)
    if (victim[i]) {
      kvp__alloc_tx_free(a, &tx, &pg[i]);
      freed_bytes += kvp__page_alloc_bytes(&pg[i]);
    }
  ck_assert_uint_eq(a->ledger.allocated.current, before.alloc - freed_bytes); /* the budget has their room */
  if (space) kvp__alloc_tx_free_space(a, &tx);
  uint32_t nnew = 0;
  while (nnew < NNEW && kvp__alloc_page(a, churn_size(&rng), &t, &nw[nnew]) == KVP_OK) nnew++;
  ck_assert_uint_gt(nnew, 0);
  ck_assert_msg(space || !tx.reused, "a page was taken over a freed one whose bytes were still held");
  for (uint32_t i = 0; i < nnew; i++) ck_ok(kvp__alloc_free(a, &nw[i]));
  bool reused = tx.reused;
  if (space) ck_assert_msg(reused, "no page was taken over a freed one: the test shows nothing");
  if (commit) kvp__alloc_tx_commit(a, &tx);
  else kvp__alloc_tx_rollback(a, &tx);
  ck_assert_ptr_null(a->tx);
  ck_ok(kvp__alloc_check(a));
  ledger_fp after = ledger_of(a);
  ck_assert_uint_eq(after.allocs, before.allocs + nnew);
  if (commit) {
    ck_assert_uint_eq(after.alloc, before.alloc - freed_bytes);
    ck_assert_uint_eq(after.frees, before.frees + nnew + nvictim);
  } else {
    ck_assert_uint_eq(after.req, before.req);
    ck_assert_uint_eq(after.alloc, before.alloc);
    ck_assert_uint_eq(after.pages, before.pages);
    ck_assert_uint_eq(after.frees, before.frees + nnew);
  }
  for (uint32_t i = 0; i < N; i++) /* a freed page is live again exactly where it was, or gone */
    if (live[i]) ck_status(kvp__alloc_free(a, &pg[i]), commit && victim[i] ? KVP_EINVAL : KVP_OK);
  ck_ok(kvp__alloc_check(a));
  ck_assert_uint_eq(a->ledger.allocated.current, 0);
  printf("alloc txn %s%s: %u pages freed on trial, %u taken meanwhile%s\n", commit ? "commit" : "rollback",
         space ? " (bytes freed too)" : "", nvictim, nnew, reused ? ", some over freed ones" : "");
  kvp_pool_destroy(p);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("alloc");
  TCase *tc = tcase_create("sizeclass");
  tcase_add_test(tc, sc_formula_every_boundary);
  tcase_add_test(tc, sc_lut_matches_formula);
  tcase_add_test(tc, sc_kv_page_sizes_cost_what_they_ask);
  tcase_add_test(tc, cuda_region_pages_64_byte_aligned);
  suite_add_tcase(s, tc);
  tc = tcase_create("extent");
  tcase_add_test(tc, extents_split_and_coalesce);
  tcase_add_test(tc, extents_alignment_and_full);
  tcase_add_test(tc, extents_address_map_is_lazy);
  tcase_add_test(tc, extents_address_map_whole);
  tcase_add_test(tc, extents_best_fit);
  suite_add_tcase(s, tc);
  tc = tcase_create("slab");
  tcase_add_loop_test(tc, slab_fill_and_drain, 0, 6);
  tcase_add_test(tc, slab_bitmap_reuses_lowest);
  tcase_add_test(tc, small_region_many_classes);
  tcase_add_test(tc, small_class_small_slab);
  suite_add_tcase(s, tc);
  tc = tcase_create("ledger");
  tcase_add_test(tc, budget_exactly_reachable_never_passable);
  tcase_add_test(tc, host_usage_scans_the_high_water_mark);
  tcase_add_test(tc, region_full_is_enospc);
  tcase_add_test(tc, grow_moves_keep_payload);
  tcase_add_test(tc, large_grow_in_place);
  tcase_add_test(tc, large_pages_exact_sizes);
  suite_add_tcase(s, tc);
  tc = tcase_create("bad_input");
  tcase_add_test(tc, bad_sizes_and_ids);
  tcase_add_test(tc, internal_free_rejects_foreign_and_double);
  tcase_add_test(tc, check_detects_corruption);
  tcase_add_test(tc, seq_hints_count_exactly);
  suite_add_tcase(s, tc);
  tc = tcase_create("txn");
  tcase_add_loop_test(tc, txn_rollback_puts_pages_back, 0, 4);
  suite_add_tcase(s, tc);
  tc = tcase_create("churn");
  tcase_set_timeout(tc, 300);
  tcase_add_loop_test(tc, churn_100k_with_check, 0, 1);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return t_run(suite()); }
