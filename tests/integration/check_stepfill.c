/*
 * tests/integration/check_stepfill.c - the step-mode append of whole fresh
 * blocks (pages/stream.c: append_fresh) through the public header: steps
 * of one block, exactly one, several and a partial last one, in every
 * source dtype (K and V apart), head_dim even and odd, more heads than one
 * batch of the copy, and a step large enough that its rows are stored
 * around the caches (1 MiB a side and more). After every call kvp_check
 * passes and the ledger is what the blocks say; reads give back every
 * value. A NaN or Inf anywhere (the last element of the last head's last
 * row included, in the last block of the step) is refused with the message
 * naming it and changes nothing; refused before a budget failure of the
 * same append (bad input is reported first, as when screened first); a
 * sanitizing pool stores it replaced.
 */
#include <check.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "itest.h"
#include "kvpool.h"

enum { L = 2, BT = 8, MAXH = 70, MAXD = 128, MAXN = 1100, MAXPOS = 1200 };

#include "rowvals.h"

static unsigned char *KB, *VB; /* [MAXN * MAXH * MAXD * 4] each, from main */

/* [n][H][D] K and V of positions pos0.. of (seq, layer). */
static void fill(const geo *g, uint64_t seq, uint32_t l, uint32_t pos0, uint32_t n) {
  for (uint32_t t = 0; t < n; t++)
    for (uint32_t h = 0; h < g->H; h++)
      for (uint32_t d = 0; d < g->D; d++) {
        size_t i = ((size_t)t * g->H + h) * g->D + d;
        put(KB, i, g->k, bits(val(seq, l, h, pos0 + t, d, 0), g->k));
        put(VB, i, g->v, bits(val(seq, l, h, pos0 + t, d, 1), g->v));
      }
}

/* What a refused append must leave as it was (the allocator's caches
 * emptied before each look, kvp_reclaim): every gauge's current value,
 * the tokens evicted, every breakdown. Not the peaks, totals and operation
 * counters: the step's pages were taken and given back (the screen runs on
 * the copy), which those record, as for any append that fails after taking
 * its pages. */
static void same_stats(const kvp_stats *a, const kvp_stats *b) {
#define SAME_GAUGE(f) \
  ck_assert_msg(a->f.current == b->f.current, #f " changed: %llu -> %llu", (unsigned long long)a->f.current, \
                (unsigned long long)b->f.current);
#define SAME_COUNTER(f)
#define SAME_VALUE(f) ck_assert_msg(a->f == b->f || !strcmp(#f, "device_used_bytes"), #f " changed");
#define SAME(kind, f, key, help) SAME_##kind(f)
  KVP_STATS_LIST(SAME)
#undef SAME
  ck_assert_uint_eq(a->tokens_evicted, b->tokens_evicted);
  ck_assert(memcmp(a->page_types, b->page_types, sizeof a->page_types) == 0); /* live bytes and pages only */
  ck_assert(memcmp(a->kv, b->kv, sizeof a->kv) == 0);
}

static kvp_seq_config step_mode(void) {
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  return sc;
}

/* Every retained value of (seq, layer l) in [0, npos), as fp32; o->x at o's
 * (head, position, channel, side) when o is given. */
typedef struct over {
  uint32_t h, pos, d;
  int kv;
  float x;
} over;
static float KO[MAXPOS * MAXD], VO[MAXPOS * MAXD];
static uint32_t POS[MAXPOS];
static void verify_layer(kvp_pool *p, const geo *g, uint64_t seq, uint32_t l, uint32_t npos, const over *o) {
  for (uint32_t h = 0; h < g->H; h++) {
    kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, KO, VO, POS, MAXPOS, 0, NULL};
    ck_ok(kvp_read(p, seq, l, &q));
    ck_assert_uint_eq(q.n_tokens, npos);
    for (uint32_t t = 0; t < npos; t++) {
      ck_assert_uint_eq(POS[t], t);
      for (uint32_t d = 0; d < g->D; d++)
        for (int kv = 0; kv < 2; kv++) {
          float want = val(seq, l, h, t, d, kv), got = (kv ? VO : KO)[t * g->D + d];
          if (o && o->h == h && o->pos == t && o->d == d && o->kv == kv) want = o->x;
          ck_assert_msg(got == want, "layer %u head %u pos %u ch %u %c: %g, expected %g", l, h, t, d, "KV"[kv], got,
                        want);
        }
    }
  }
}

/* The ledger of seq holding the steps sz[0..nsteps): a block per BT tokens
 * of each step (the last one partial), raw pages of exactly their tokens. */
static void ledger_is(kvp_pool *p, const geo *g, const uint32_t *sz, int nsteps) {
  uint64_t nblocks = 0, npos = 0;
  for (int i = 0; i < nsteps; i++) nblocks += (sz[i] + BT - 1) / BT, npos += sz[i];
  kvp_stats s = rv_stats(p);
  ck_assert_uint_eq(s.pages.current, 2ull * L * g->H * nblocks);
  ck_assert_uint_eq(s.bytes_requested.current, (uint64_t)L * g->H * npos * g->D * (wbytes(g->k) + wbytes(g->v)));
  ck_assert_uint_eq(s.tokens_retained.current, (uint64_t)L * g->H * npos);
}

static void step(kvp_pool *p, const geo *g, uint64_t seq, uint32_t pos0, uint32_t n) {
  ck_ok(kvp_step_begin(p, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    fill(g, seq, l, pos0, n);
    kvp_kv kv = {KB, VB, NULL};
    ck_ok(kvp_append(p, seq, l, &kv));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_step_end(p, seq));
}

/* Steps of 3 (one partial block), 8 (one block exactly), 19 (two blocks and
 * a partial one) and 1 token, then a large one. */
static const uint32_t SIZES[] = {3, 8, 19, 1};

START_TEST(steps_of_fresh_blocks) {
  const geo *g = &GEOS[_i];
  kvp_pool *p = rv_pool(g, 0, NULL, 0, 64ull << 20);
  kvp_seq_config sc = step_mode();
  ck_ok(kvp_seq_add(p, 1, &sc));
  uint32_t pos = 0;
  for (int i = 0; i < 4; i++) {
    step(p, g, 1, pos, SIZES[i]);
    pos += SIZES[i];
    ledger_is(p, g, SIZES, i + 1);
    for (uint32_t l = 0; l < L; l++) verify_layer(p, g, 1, l, pos, NULL);
  }
  kvp_pool_destroy(p);
}
END_TEST

/* A step of n tokens whose sides are 1 MiB or more (stored around the
 * caches), H = 4, D = 128: every value read back. */
START_TEST(large_step_around_the_caches) {
  static const geo big[2] = {{4, 128, KVP_DTYPE_BF16, KVP_DTYPE_BF16}, {4, 64, KVP_DTYPE_F32, KVP_DTYPE_F16}};
  const geo *g = &big[_i];
  uint32_t n = 1100; /* bf16: 1.07 MiB a side; f32 K 1.07 MiB, f16 V half that (plain stores) */
  kvp_pool *p = rv_pool(g, 0, NULL, 0, 64ull << 20);
  kvp_seq_config sc = step_mode();
  ck_ok(kvp_seq_add(p, 1, &sc));
  step(p, g, 1, 0, 5);
  step(p, g, 1, 5, n);
  uint32_t sz[2] = {5, n};
  ledger_is(p, g, sz, 2);
  for (uint32_t l = 0; l < L; l++) verify_layer(p, g, 1, l, 5 + n, NULL);
  kvp_pool_destroy(p);
}
END_TEST

/* A step of n tokens at pos0 with a non-finite value of kind (NaN, +Inf,
 * -Inf) at token t, head h, channel d of side kv, on layer 1: refused, named,
 * nothing changed; then stored without it. */
static void refuse_one(kvp_pool *p, const geo *g, uint32_t pos0, uint32_t n, int kv, uint32_t t, uint32_t h,
                       uint32_t d, int kind) {
  static const char *names[3] = {"NaN", "+Inf", "-Inf"};
  static const float xs[3] = {NAN, INFINITY, -INFINITY};
  kvp_dtype dt = kv ? g->v : g->k;
  ck_ok(kvp_step_begin(p, 1, n, 0));
  fill(g, 1, 0, pos0, n);
  kvp_kv ok = {KB, VB, NULL};
  ck_ok(kvp_append(p, 1, 0, &ok));
  fill(g, 1, 1, pos0, n);
  uint32_t bad;
  float x = xs[kind];
  memcpy(&bad, &x, 4);
  if (dt == KVP_DTYPE_BF16) bad >>= 16;
  else if (dt == KVP_DTYPE_F16) bad = kind == 0 ? 0x7E00u : kind == 1 ? 0x7C00u : 0xFC00u;
  put(kv ? VB : KB, ((size_t)t * g->H + h) * g->D + d, dt, bad);
  ck_ok(kvp_reclaim(p)); /* committed bytes: what live pages hold, before and after */
  kvp_stats before = rv_stats(p);
  ck_status(kvp_append(p, 1, 1, &ok), KVP_EINVAL);
  ck_ok(kvp_reclaim(p));
  char want[160];
  snprintf(want, sizeof want, "%c of layer 1 has %s at head %u, token %u (of the step), channel %u", "KV"[kv],
           names[kind], h, t, d);
  ck_msg(want);
  kvp_stats after = rv_stats(p);
  same_stats(&before, &after);
  ck_ok(kvp_check(p));
  verify_layer(p, g, 1, 1, pos0, NULL);
  verify_layer(p, g, 1, 0, pos0 + n, NULL);
  fill(g, 1, 1, pos0, n);
  ck_ok(kvp_append(p, 1, 1, &ok));
  ck_ok(kvp_step_end(p, 1));
  ck_ok(kvp_check(p));
  verify_layer(p, g, 1, 1, pos0 + n, NULL);
}

START_TEST(nonfinite_refused_changes_nothing) {
  const geo *g = &GEOS[_i];
  kvp_pool *p = rv_pool(g, 0, NULL, 0, 64ull << 20);
  kvp_seq_config sc = step_mode();
  ck_ok(kvp_seq_add(p, 1, &sc));
  uint32_t H = g->H, D = g->D, pos = 0;
  refuse_one(p, g, pos, 19, 1, 18, H - 1, D - 1, 0), pos += 19; /* the last value the copy sees */
  refuse_one(p, g, pos, 19, 0, 0, 0, 0, 1), pos += 19;          /* the first */
  refuse_one(p, g, pos, 8, 0, 4, H / 2, D / 2, 2), pos += 8;     /* inside one whole block */
  refuse_one(p, g, pos, 3, 1, 2, H - 1, 0, 0), pos += 3;
  kvp_pool_destroy(p);
  /* a large step (stored around the caches): its last value */
  static const geo big = {4, 128, KVP_DTYPE_BF16, KVP_DTYPE_BF16};
  p = rv_pool(&big, 0, NULL, 0, 64ull << 20);
  ck_ok(kvp_seq_add(p, 1, &sc));
  refuse_one(p, &big, 0, 1100, 1, 1099, 3, 127, 0);
  kvp_pool_destroy(p);
}
END_TEST

/* Bad input is reported before a budget failure of the same append, as when
 * the input is screened first; without it, the budget failure; nothing
 * changed either way. */
START_TEST(nonfinite_before_budget) {
  const geo *g = &GEOS[0];
  kvp_pool *p = rv_pool(g, 0, NULL, 16384, 64ull << 20);
  kvp_seq_config sc = step_mode();
  ck_ok(kvp_seq_add(p, 1, &sc));
  ck_ok(kvp_step_begin(p, 1, 200, 0));
  fill(g, 1, 0, 0, 200);
  kvp_kv kv = {KB, VB, NULL};
  ck_status(kvp_append(p, 1, 0, &kv), KVP_EBUDGET);
  ck_ok(kvp_reclaim(p));
  kvp_stats before = rv_stats(p);
  put(VB, ((size_t)199 * g->H + g->H - 1) * g->D + g->D - 1, g->v, 0x7FC0u);
  ck_status(kvp_append(p, 1, 0, &kv), KVP_EINVAL);
  ck_ok(kvp_reclaim(p));
  ck_msg("V of layer 0 has NaN at head 2, token 199 (of the step), channel 23");
  kvp_stats after = rv_stats(p);
  same_stats(&before, &after);
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

/* A sanitizing pool stores a step's NaN as 0 and -Inf as the largest
 * negative finite value, in the last row of the last head. */
START_TEST(sanitize_on_step) {
  const geo *g = &GEOS[_i];
  kvp_pool *p = rv_pool(g, KVP_POOL_SANITIZE, NULL, 0, 64ull << 20);
  kvp_seq_config sc = step_mode();
  ck_ok(kvp_seq_add(p, 1, &sc));
  uint32_t H = g->H, D = g->D, n = 19;
  ck_ok(kvp_step_begin(p, 1, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    fill(g, 1, l, 0, n);
    uint32_t nan = g->v == KVP_DTYPE_F32 ? 0x7FC00000u : g->v == KVP_DTYPE_BF16 ? 0x7FC0u : 0x7E00u;
    if (l == 1) put(VB, ((size_t)(n - 1) * H + H - 1) * D + D - 1, g->v, nan);
    kvp_kv kv = {KB, VB, NULL};
    ck_ok(kvp_append(p, 1, l, &kv));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_step_end(p, 1));
  over o = {H - 1, n - 1, D - 1, 1, 0.0f};
  verify_layer(p, g, 1, 0, n, NULL);
  verify_layer(p, g, 1, 1, n, &o);
  kvp_pool_destroy(p);
}
END_TEST

int main(void) {
  KB = malloc((size_t)MAXN * MAXH * MAXD * 4);
  VB = malloc((size_t)MAXN * MAXH * MAXD * 4);
  if (!KB || !VB) return 1;
  Suite *s = suite_create("stepfill");
  TCase *tc = tcase_create("stepfill");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, steps_of_fresh_blocks, 0, NGEOS);
  tcase_add_loop_test(tc, large_step_around_the_caches, 0, 2);
  tcase_add_loop_test(tc, nonfinite_refused_changes_nothing, 0, NGEOS);
  tcase_add_test(tc, nonfinite_before_budget);
  tcase_add_loop_test(tc, sanitize_on_step, 0, NGEOS);
  suite_add_tcase(s, tc);
  int rc = it_run(s);
  free(KB), free(VB);
  return rc;
}
