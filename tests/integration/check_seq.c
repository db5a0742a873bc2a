/*
 * tests/integration/check_seq.c - sequences through the public header: bad
 * input (each error with its status, a message naming the culprit, and no
 * change to the pool), views pinned across evictions and frees, fork
 * sharing sealed blocks and copying open ones, NaN input, reads across
 * block edges and evicted holes in each raw copy path, and reads of many
 * blocks (several of kvp_read's batches) mixing copied and decoded sides.
 */
#include <check.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "kvgen.h"
#include "kvpool.h"
#include "itest.h"

#define ck_msg(part) ck_assert_msg(strstr(kvp_last_error(), part) != NULL, "message lacks \"%s\": %s", part, kvp_last_error())

enum { L = 3, H = 2, D = 16, BT = 8 };

static kvgen G;
static uint16_t K[1024 * H * D], V[1024 * H * D];

/* The suite's pool (codecs NULL: raw), the generator reset. */
static kvp_pool *mkpool_codecs(uint64_t budget, const char *codecs) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.region_bytes = 16ull << 20;
  c.budget_bytes = budget;
  c.block_tokens = BT;
  c.codecs = codecs;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  kvgen_init(&G);
  return p;
}

static kvp_pool *mkpool(uint64_t budget) { return mkpool_codecs(budget, NULL); }

static void step(kvp_pool *p, uint64_t seq, uint32_t pos0, uint32_t n) {
  ck_ok(kvp_step_begin(p, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    kvgen_fill(&G, seq, l, pos0, n, H, D, K, V);
    kvp_kv kv = {K, V, NULL};
    ck_ok(kvp_append(p, seq, l, &kv));
  }
  ck_ok(kvp_step_end(p, seq));
  ck_ok(kvp_check(p));
}

/* A fingerprint of the ledger: bad calls must leave it as it was. */
typedef struct fp {
  uint64_t req, alloc, pages, tokens, seqs;
} fp;

static fp fingerprint(kvp_pool *p) {
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  return (fp){s.bytes_requested.current, s.bytes_allocated.current, s.pages.current, s.tokens_retained.current,
              s.sequences.current};
}

#define UNCHANGED(p, before)                                                                    \
  do {                                                                                          \
    fp now_ = fingerprint(p);                                                                   \
    ck_assert_msg(memcmp(&now_, &(before), sizeof now_) == 0, "a failed call changed the pool"); \
    ck_ok(kvp_check(p));                                                                        \
  } while (0)

START_TEST(bad_input_changes_nothing) {
  kvp_pool *p = mkpool(0);
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, 1, 0, 20);
  fp f = fingerprint(p);
  kvp_kv kv = {K, V, NULL};

  ck_status(kvp_seq_add(p, 1, NULL), KVP_EEXIST); ck_msg("sequence 1");
  ck_status(kvp_step_begin(p, 9, 1, 0), KVP_ENOENT); ck_msg("sequence 9");
  ck_status(kvp_append(p, 9, 0, &kv), KVP_ENOENT);
  ck_status(kvp_seq_free(p, 9), KVP_ENOENT);
  ck_status(kvp_seq_fork(p, 9, 10), KVP_ENOENT);
  ck_status(kvp_seq_fork(p, 1, 1), KVP_EEXIST); ck_msg("already exists");
  ck_status(kvp_append(p, 1, 0, &kv), KVP_EINVAL); ck_msg("outside a step");
  ck_status(kvp_step_end(p, 1), KVP_EINVAL); ck_msg("no step is open");
  ck_status(kvp_step_begin(p, 1, 0, 0), KVP_EINVAL); ck_msg("n_tokens = 0");
  ck_status(kvp_step_begin(p, 1, 4, 0x6), KVP_EINVAL); ck_msg("unknown bits 0x6");
  ck_status(kvp_step_begin(p, 1, 4, KVP_STEP_SCENE_CUT | 0x80000000u), KVP_EINVAL); ck_msg("0x80000000");
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = (kvp_seq_mode)5;
  ck_status(kvp_seq_add(p, 2, &sc), KVP_EINVAL); ck_msg("mode");
  kvp_seq_config_init(&sc);
  sc.n_steps = 2;
  ck_status(kvp_seq_add(p, 2, &sc), KVP_EINVAL); ck_msg("step_tokens");
  UNCHANGED(p, f);

  /* inside a step */
  ck_ok(kvp_step_begin(p, 1, 4, 0));
  f = fingerprint(p);
  kvgen_fill(&G, 1, 0, 20, 4, H, D, K, V);
  ck_status(kvp_step_begin(p, 1, 4, 0), KVP_EBUSY); ck_msg("still open");
  ck_status(kvp_seq_fork(p, 1, 3), KVP_EBUSY);
  ck_status(kvp_append(p, 1, L, &kv), KVP_EINVAL); ck_msg("layer 3 >= n_layers 3");
  ck_status(kvp_append(p, 1, 1, &kv), KVP_EINVAL); ck_msg("out of order");
  ck_status(kvp_append(p, 1, 0, NULL), KVP_EINVAL); ck_msg("kv is NULL");
  kvp_kv nul = {NULL, V, NULL};
  ck_status(kvp_append(p, 1, 0, &nul), KVP_EINVAL); ck_msg("kv->k is NULL");
  kvp_kv mis = {(const char *)K + 1, V, NULL};
  ck_status(kvp_append(p, 1, 0, &mis), KVP_EINVAL); ck_msg("not aligned");
  kvp_kv strm = {K, V, (void *)&mis};
  ck_status(kvp_append(p, 1, 0, &strm), KVP_EINVAL); ck_msg("kv->stream");
  ck_status(kvp_step_end(p, 1), KVP_EINVAL); ck_msg("after 0 of 3 layers");
  UNCHANGED(p, f);
  ck_ok(kvp_append(p, 1, 0, &kv));
  f = fingerprint(p);
  ck_status(kvp_append(p, 1, 0, &kv), KVP_EINVAL); ck_msg("appended twice");
  UNCHANGED(p, f);
  for (uint32_t l = 1; l < L; l++) {
    kvgen_fill(&G, 1, l, 20, 4, H, D, K, V);
    ck_ok(kvp_append(p, 1, l, &kv));
  }
  ck_ok(kvp_step_end(p, 1));
  f = fingerprint(p);

  /* evict and read */
  ck_status(kvp_evict(p, 1, L, 0, 0), KVP_EINVAL); ck_msg("layer 3");
  ck_status(kvp_evict(p, 1, 0, H, 0), KVP_EINVAL); ck_msg("head 2");
  ck_status(kvp_evict(p, 1, 0, 0, 2), KVP_ENOENT); ck_msg("step 2 was never begun");
  UNCHANGED(p, f);
  ck_ok(kvp_evict(p, 1, 0, 1, 0));
  f = fingerprint(p);
  ck_status(kvp_evict(p, 1, 0, 1, 0), KVP_ENOENT); ck_msg("not retained");
  UNCHANGED(p, f);
  uint16_t out[64 * D];
  uint32_t pos[64];
  kvp_read_req q = {sizeof q, 0, KVP_DTYPE_BF16, out, out, pos, 10, 0, NULL};
  ck_status(kvp_read(p, 1, 0, &q), KVP_ENOSPC); ck_msg("needs 24 tokens");
  ck_assert_uint_eq(q.n_tokens, 24);
  q.capacity_tokens = 64;
  q.head = H;
  ck_status(kvp_read(p, 1, 0, &q), KVP_EINVAL); ck_msg("head 2");
  q.head = 0;
  ck_status(kvp_read(p, 1, L, &q), KVP_EINVAL);
  ck_status(kvp_read(p, 5, 0, &q), KVP_ENOENT);
  q.k_out = (char *)out + 1;
  ck_status(kvp_read(p, 1, 0, &q), KVP_EINVAL); ck_msg("aligned");
  q.struct_size = 4;
  ck_status(kvp_read(p, 1, 0, &q), KVP_EINVAL);
  UNCHANGED(p, f);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(nan_input_is_refused) {
  kvp_pool *p = mkpool(0);
  ck_ok(kvp_seq_add(p, 1, NULL));
  ck_ok(kvp_step_begin(p, 1, 5, 0));
  kvgen_fill(&G, 1, 0, 0, 5, H, D, K, V);
  fp f = fingerprint(p);
  V[(3 * H + 1) * D + 7] = 0x7fc0; /* a bf16 NaN at token 3, head 1, channel 7 */
  kvp_kv kv = {K, V, NULL};
  ck_status(kvp_append(p, 1, 0, &kv), KVP_EINVAL);
  ck_msg("V of layer 0 has NaN at head 1, token 3");
  UNCHANGED(p, f);
  V[(3 * H + 1) * D + 7] = 0;
  K[(4 * H + 0) * D + 2] = 0xff80; /* -Inf at token 4, head 0, channel 2 */
  ck_status(kvp_append(p, 1, 0, &kv), KVP_EINVAL);
  ck_msg("K of layer 0 has -Inf at head 0, token 4 (of the step), channel 2");
  UNCHANGED(p, f);
  K[(4 * H + 0) * D + 2] = 0;
  ck_ok(kvp_append(p, 1, 0, &kv));
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(sanitize_replaces_non_finite) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 1;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.region_bytes = 16ull << 20;
  c.flags = KVP_POOL_SANITIZE;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  kvgen_init(&G);
  ck_ok(kvp_seq_add(p, 1, NULL));
  ck_ok(kvp_step_begin(p, 1, 2, 0));
  kvgen_fill(&G, 1, 0, 0, 2, H, D, K, V);
  K[0] = 0x7fc1;              /* NaN */
  K[1] = 0x7f80;              /* +Inf */
  V[(1 * H + 1) * D] = 0xff80; /* -Inf at token 1, head 1 */
  kvp_kv kv = {K, V, NULL};
  ck_ok(kvp_append(p, 1, 0, &kv));
  ck_ok(kvp_step_end(p, 1));
  uint16_t k[2 * D], v[2 * D];
  kvp_read_req q = {sizeof q, 0, KVP_DTYPE_BF16, k, v, NULL, 2, 0, NULL};
  ck_ok(kvp_read(p, 1, 0, &q));
  ck_assert_uint_eq(k[0], 0);       /* NaN became 0 */
  ck_assert_uint_eq(k[1], 0x7f7f);  /* +Inf became the largest bf16 */
  ck_assert_uint_eq(k[2], K[2]);    /* the rest as given */
  q.head = 1;
  ck_ok(kvp_read(p, 1, 0, &q));
  ck_assert_uint_eq(v[D], 0xff7f);  /* -Inf became the most negative bf16 */
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(views_survive_eviction) {
  kvp_pool *p = mkpool(0);
  ck_ok(kvp_seq_add(p, 4, NULL));
  step(p, 4, 0, 20); /* blocks of 8: [0,8) [8,16) [16,20 open) */
  step(p, 4, 20, 4);
  kvp_view *v;
  ck_ok(kvp_view_acquire(p, 4, 1, &v));
  ck_assert_uint_eq(v->layer, 1);
  ck_assert_uint_eq(v->n_blocks, H * 3);
  uint32_t seen = 0;
  for (uint32_t i = 0; i < v->n_blocks; i++) {
    const kvp_view_block *b = &v->blocks[i];
    const uint16_t *k = b->page[0][KVP_PAGE_RAW], *vv = b->page[1][KVP_PAGE_RAW];
    ck_assert_ptr_nonnull(k);
    ck_assert_ptr_null(b->page[0][KVP_PAGE_CODES]);
    ck_assert_uint_eq(b->page_bytes[0][KVP_PAGE_RAW], BT * D * 2);
    for (uint32_t t = b->first; t < b->first + b->n_tokens; t++)
      for (uint32_t d = 0; d < D; d++) {
        if (k[t * D + d] != kvgen_value(&G, 4, 1, b->head, b->block_pos0 + t, d, 0) ||
            vv[t * D + d] != kvgen_value(&G, 4, 1, b->head, b->block_pos0 + t, d, 1))
          ck_abort_msg("view block %u token %u differs", i, t);
      }
    seen += b->n_tokens;
  }
  ck_assert_uint_eq(seen, H * 24);
  /* evict step 0 of head 0: its two full blocks leave new reads but stay
   * pinned (and counted) until the view goes */
  kvp_stats a = {.struct_size = sizeof a}, b = {.struct_size = sizeof b};
  ck_ok(kvp_stats_get(p, &a));
  ck_ok(kvp_evict(p, 4, 1, 0, 0));
  ck_ok(kvp_check(p));
  ck_ok(kvp_stats_get(p, &b));
  ck_assert_uint_eq(b.bytes_allocated.current, a.bytes_allocated.current); /* pinned */
  ck_assert_uint_eq(b.tokens_retained.current, a.tokens_retained.current - 20);
  uint16_t out[64 * D];
  uint32_t pos[64];
  kvp_read_req q = {sizeof q, 0, KVP_DTYPE_BF16, out, NULL, pos, 64, 0, NULL};
  ck_ok(kvp_read(p, 4, 1, &q));
  ck_assert_uint_eq(q.n_tokens, 4);
  ck_assert_uint_eq(pos[0], 20);
  /* even freeing the whole sequence keeps pinned blocks readable */
  ck_ok(kvp_seq_free(p, 4));
  ck_ok(kvp_check(p));
  const kvp_view_block *b0 = &v->blocks[0];
  const uint16_t *k0 = b0->page[0][KVP_PAGE_RAW];
  ck_assert_uint_eq(k0[0], kvgen_value(&G, 4, 1, b0->head, b0->block_pos0, 0, 0));
  kvp_view_release(p, v);
  ck_ok(kvp_check(p));
  ck_ok(kvp_stats_get(p, &b));
  ck_assert_uint_eq(b.bytes_allocated.current, 0);
  kvp_view_release(p, NULL);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(fork_shares_sealed_copies_open) {
  kvp_pool *p = mkpool(0);
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, 1, 0, 19); /* per stream: 2 sealed blocks + 1 open (3 tokens) */
  kvp_stats a = {.struct_size = sizeof a}, b = {.struct_size = sizeof b};
  ck_ok(kvp_stats_get(p, &a));
  ck_ok(kvp_seq_fork(p, 1, 2));
  kvgen_fork(&G, 1, 2, 19);
  ck_ok(kvp_check(p));
  ck_ok(kvp_stats_get(p, &b));
  /* only the open blocks were copied: L x H x (K + V) pages of BT x D x 2 bytes */
  ck_assert_uint_eq(b.pages.current - a.pages.current, L * H * 2);
  ck_assert_uint_eq(b.bytes_allocated.current - a.bytes_allocated.current, (uint64_t)L * H * 2 * BT * D * 2);
  ck_assert_uint_eq(b.tokens_retained.current, 2 * a.tokens_retained.current);
  ck_assert_uint_eq(b.sequences.current, 2);
  /* the child diverges; the parent does not see it */
  step(p, 2, 19, 7);
  step(p, 1, 19, 2);
  uint16_t out[64 * D];
  uint32_t pos[64];
  for (uint64_t s = 1; s <= 2; s++) {
    kvp_read_req q = {sizeof q, 1, KVP_DTYPE_BF16, out, NULL, pos, 64, 0, NULL};
    ck_ok(kvp_read(p, s, 2, &q));
    ck_assert_uint_eq(q.n_tokens, s == 1 ? 21 : 26);
    for (uint32_t i = 0; i < q.n_tokens; i++)
      if (pos[i] != i || out[i * D + 5] != kvgen_value(&G, s, 2, 1, i, 5, 0)) ck_abort_msg("seq %llu row %u", (unsigned long long)s, i);
  }
  kvp_seq_desc d = {.struct_size = sizeof d};
  ck_ok(kvp_seq_info(p, 2, &d));
  ck_assert_uint_eq(d.n_positions, 26);
  ck_assert_uint_eq(d.tokens_retained, 26 * L * H);
  /* freeing the parent keeps the shared blocks for the child */
  ck_ok(kvp_seq_free(p, 1));
  ck_ok(kvp_check(p));
  kvp_read_req q = {sizeof q, 0, KVP_DTYPE_F32, NULL, NULL, pos, 64, 0, NULL};
  float f32[64 * D];
  q.k_out = f32;
  ck_ok(kvp_read(p, 2, 0, &q)); /* and reads convert to f32 */
  ck_assert_uint_eq(q.n_tokens, 26);
  uint16_t want = kvgen_value(&G, 2, 0, 0, 3, 2, 0);
  uint32_t bits = (uint32_t)want << 16;
  float wf;
  memcpy(&wf, &bits, 4);
  ck_assert(f32[3 * D + 2] == wf);
  ck_ok(kvp_seq_free(p, 2));
  ck_ok(kvp_check(p));
  ck_ok(kvp_stats_get(p, &b));
  ck_assert_uint_eq(b.bytes_allocated.current, 0);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(fork_refused_by_budget_changes_nothing) {
  kvp_pool *p = mkpool(L * H * 2 * 3 * BT * D * 2); /* room for 3 blocks per stream */
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, 1, 0, 19);
  fp f = fingerprint(p);
  ck_status(kvp_seq_fork(p, 1, 2), KVP_EBUDGET); ck_msg("fork of seq 1 into 2");
  UNCHANGED(p, f);
  ck_status(kvp_seq_info(p, 2, &(kvp_seq_desc){.struct_size = sizeof(kvp_seq_desc)}), KVP_ENOENT);
  kvp_pool_destroy(p);
}
END_TEST

/* Every retained token of seq, every (layer, head): positions 0..npos-1
 * with their kvgen values (lineage included). */
static void reads_back(kvp_pool *p, uint64_t seq, uint32_t npos) {
  uint16_t k[64 * D], v[64 * D];
  uint32_t pos[64];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_BF16, k, v, pos, 64, 0, NULL};
      ck_ok(kvp_read(p, seq, l, &q));
      ck_assert_uint_eq(q.n_tokens, npos);
      for (uint32_t i = 0; i < npos; i++)
        for (uint32_t d = 0; d < D; d++)
          if (pos[i] != i || k[i * D + d] != kvgen_value(&G, seq, l, h, i, d, 0) ||
              v[i * D + d] != kvgen_value(&G, seq, l, h, i, d, 1))
            ck_abort_msg("seq %llu layer %u head %u row %u", (unsigned long long)seq, l, h, i);
    }
}

/* Mutations find their sequence through the writer's cache of its last
 * lookups (a slot per hash value mod 64): 150 ids share the slots, steps
 * alternate between them, a third are freed and their ids come back as
 * new sequences or as forks; every step lands in its own sequence. */
START_TEST(seq_ids_share_and_reuse_lookups) {
  enum { NS = 150 };
  kvp_pool *p = mkpool(0);
  for (uint64_t s = 0; s < NS; s++) ck_ok(kvp_seq_add(p, s, NULL));
  for (uint32_t r = 0; r < 3; r++)
    for (uint64_t s = 0; s < NS; s++) step(p, s, r, 1);
  for (uint64_t s = 0; s < NS; s += 3) {
    ck_ok(kvp_seq_free(p, s));
    ck_status(kvp_step_begin(p, s, 1, 0), KVP_ENOENT);
  }
  ck_ok(kvp_check(p));
  for (uint64_t s = 0; s < NS; s += 3) {
    if (s % 2 == 0) { /* a new sequence under the old id */
      ck_ok(kvp_seq_add(p, s, NULL));
      step(p, s, 0, 4);
    } else { /* a fork of its neighbour into the old id */
      ck_ok(kvp_seq_fork(p, s + 1, s));
      kvgen_fork(&G, s + 1, s, 3);
      step(p, s, 3, 1);
    }
  }
  for (uint64_t s = 0; s < NS; s++)
    if (s % 3) step(p, s, 3, 1);
  for (uint64_t s = 0; s < NS; s++) reads_back(p, s, 4);
  kvp_stats st = {.struct_size = sizeof st};
  ck_ok(kvp_stats_get(p, &st));
  ck_assert_uint_eq(st.sequences.current, NS);
  ck_assert_uint_eq(st.tokens_retained.current, (uint64_t)NS * 4 * L * H);
  kvp_pool_destroy(p);
}
END_TEST

/* kvp_read across block edges, partial and OPEN blocks and an evicted hole,
 * for raw rows copied as they are (bf16 stored, bf16 out) and converted
 * (fp32 stored, or f32 out): every row and position as appended, K and V
 * or K alone. Loop index: bit 0 = fp32 storage, bit 1 = f32 out. */
START_TEST(read_crosses_blocks_and_holes) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.region_bytes = 16ull << 20;
  c.block_tokens = BT;
  c.codecs = _i & 1 ? "kv=raw:dtype=fp32" : NULL;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  kvgen_init(&G);
  kvp_dtype out = _i & 2 ? KVP_DTYPE_F32 : KVP_DTYPE_BF16;
  ck_ok(kvp_seq_add(p, 9, NULL));
  step(p, 9, 0, 20);  /* step 0: [0,8) [8,16) [16,20 of 24) */
  step(p, 9, 20, 4);  /* step 1: [20,24), fills block [16,24) */
  step(p, 9, 24, 7);  /* step 2: [24,31) OPEN */
  ck_ok(kvp_evict(p, 9, 2, 0, 1)); /* head 0 of layer 2: a hole at [20,24), the end of a block */
  ck_ok(kvp_evict(p, 9, 2, 1, 0)); /* head 1: [0,20) gone, its read starts 4 rows into a block */
  ck_ok(kvp_check(p));
  enum { CAP = 40 };
  float ko[CAP * D], vo[CAP * D]; /* as large as f32 rows; bf16 rows use the first half */
  uint32_t pos[CAP];
  for (uint32_t h = 0; h < H; h++)
    for (int both = 0; both < 2; both++) {
      memset(ko, 0xee, sizeof ko), memset(vo, 0xee, sizeof vo);
      kvp_read_req q = {sizeof q, h, out, ko, both ? vo : NULL, pos, CAP, 0, NULL};
      ck_ok(kvp_read(p, 9, 2, &q));
      ck_assert_uint_eq(q.n_tokens, h == 0 ? 27 : 11);
      for (uint32_t i = 0; i < q.n_tokens; i++) {
        uint32_t want = h == 0 ? (i >= 20 ? i + 4 : i) : 20 + i;
        ck_assert_uint_eq(pos[i], want);
        for (uint32_t d = 0; d < D; d++)
          for (int kv = 0; kv < 1 + both; kv++) {
            uint16_t x = kvgen_value(&G, 9, 2, h, want, d, kv);
            const float *o = kv ? vo : ko;
            uint32_t got = out == KVP_DTYPE_F32 ? 0 : ((const uint16_t *)o)[i * D + d];
            if (out == KVP_DTYPE_F32) {
              uint32_t w = (uint32_t)x << 16;
              memcpy(&got, &o[i * D + d], 4);
              ck_assert_msg(got == w, "head %u token %u dim %u %c: %08x, want %08x", h, i, d, "KV"[kv], got, w);
            } else {
              ck_assert_msg(got == x, "head %u token %u dim %u %c: %04x, want %04x", h, i, d, "KV"[kv], got, x);
            }
          }
      }
      uint32_t row = D * (out == KVP_DTYPE_F32 ? 4 : 2);
      const unsigned char *past = (const unsigned char *)ko + (size_t)q.n_tokens * row;
      ck_assert_uint_eq(past[0], 0xee); /* nothing written past the last row */
      if (!both) ck_assert_uint_eq(((const unsigned char *)vo)[0], 0xee);
    }
  kvp_pool_destroy(p);
}
END_TEST

/* A read long enough to be walked and copied in several batches (well past
 * 64 blocks a head), holes at and inside batch edges, a head whose read
 * starts late, and sealed blocks whose K goes through a codec (loop 1:
 * k=int8) while V and the OPEN tail are copied: rows and positions as
 * appended (K within int8's step where encoded), K alone and V alone the
 * same bytes as K and V read together, nothing written past the last row. */
START_TEST(read_batches_keep_rows_and_positions) {
  enum { NSTEP = 40, CAP = 1200 };
  kvp_pool *p = mkpool_codecs(0, _i ? "k=int8" : NULL);
  ck_ok(kvp_seq_add(p, 7, NULL));
  uint32_t p0[NSTEP + 1], n = 0;
  for (uint32_t st = 0; st < NSTEP; st++) { /* 600 tokens, then 39 steps of 1..13 */
    uint32_t m = st ? 1 + st % 13 : 600;
    p0[st] = n;
    step(p, 7, n, m);
    n += m;
  }
  p0[NSTEP] = n;
  const uint32_t gone0[] = {3, 9, 10, 25}, gone1[] = {0, 31};
  for (unsigned i = 0; i < sizeof gone0 / sizeof gone0[0]; i++) ck_ok(kvp_evict(p, 7, 1, 0, gone0[i]));
  for (unsigned i = 0; i < sizeof gone1 / sizeof gone1[0]; i++) ck_ok(kvp_evict(p, 7, 1, 1, gone1[i]));
  ck_ok(kvp_check(p));
  static uint16_t ko[3][CAP * D], vo[3][CAP * D];
  static uint32_t pos[3][CAP];
  for (uint32_t h = 0; h < H; h++) {
    uint32_t want[CAP], nwant = 0; /* positions retained, in order */
    for (uint32_t st = 0; st < NSTEP; st++) {
      bool gone = false;
      for (unsigned i = 0; i < (h ? 2u : 4u); i++) gone |= (h ? gone1[i] : gone0[i]) == st;
      for (uint32_t x = p0[st]; !gone && x < p0[st + 1]; x++) want[nwant++] = x;
    }
    for (int mode = 0; mode < 3; mode++) { /* K and V, K alone, V alone */
      memset(ko[mode], 0xee, sizeof ko[mode]), memset(vo[mode], 0xee, sizeof vo[mode]);
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_BF16, mode != 2 ? ko[mode] : NULL, mode != 1 ? vo[mode] : NULL,
                        pos[mode], CAP, 0, NULL};
      ck_ok(kvp_read(p, 7, 1, &q));
      ck_assert_uint_eq(q.n_tokens, nwant);
      ck_assert_mem_eq(pos[mode], want, nwant * sizeof want[0]);
      ck_assert_uint_eq(ko[mode][nwant * D], 0xeeee); /* nothing past the last row */
      ck_assert_uint_eq(vo[mode][nwant * D], 0xeeee);
    }
    ck_assert_mem_eq(ko[1], ko[0], (size_t)nwant * D * 2);
    ck_assert_mem_eq(vo[2], vo[0], (size_t)nwant * D * 2);
    ck_assert_uint_eq(vo[1][0], 0xeeee);
    ck_assert_uint_eq(ko[2][0], 0xeeee);
    for (uint32_t i = 0; i < nwant; i++) {
      float amax = 0;
      for (uint32_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(kvgen_f32(kvgen_value(&G, 7, 1, h, want[i], d, 0))));
      for (uint32_t d = 0; d < D; d++) {
        uint16_t wk = kvgen_value(&G, 7, 1, h, want[i], d, 0), wv = kvgen_value(&G, 7, 1, h, want[i], d, 1);
        ck_assert_msg(vo[0][i * D + d] == wv, "head %u row %u dim %u V: %04x, want %04x", h, i, d, vo[0][i * D + d], wv);
        if (!_i)
          ck_assert_msg(ko[0][i * D + d] == wk, "head %u row %u dim %u K: %04x, want %04x", h, i, d, ko[0][i * D + d], wk);
        else
          ck_assert_msg(fabsf(kvgen_f32(ko[0][i * D + d]) - kvgen_f32(wk)) <= amax / 100 + 1e-6f, "head %u row %u dim %u K: %g, want %g",
                        h, i, d, kvgen_f32(ko[0][i * D + d]), kvgen_f32(wk));
      }
    }
  }
  kvp_pool_destroy(p);
}
END_TEST

int main(void) {
  Suite *s = suite_create("seq");
  TCase *tc = tcase_create("seq");
  tcase_add_test(tc, bad_input_changes_nothing);
  tcase_add_test(tc, nan_input_is_refused);
  tcase_add_test(tc, sanitize_replaces_non_finite);
  tcase_add_test(tc, views_survive_eviction);
  tcase_add_test(tc, fork_shares_sealed_copies_open);
  tcase_add_test(tc, fork_refused_by_budget_changes_nothing);
  tcase_add_test(tc, seq_ids_share_and_reuse_lookups);
  tcase_add_loop_test(tc, read_crosses_blocks_and_holes, 0, 4);
  tcase_add_loop_test(tc, read_batches_keep_rows_and_positions, 0, 2);
  suite_add_tcase(s, tc);
  return it_run(s);
}
