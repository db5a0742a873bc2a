/*
 * tests/integration/check_policy.c - eviction policies through the public
 * header: the window policy (StreamingLLM) keeps the sink and the most
 * recent tokens, frees the rest, and holds memory flat in a long decode; a
 * sequence can override the pool's policy; forks inherit it.
 */
#include <check.h>
#include <stdio.h>
#include <string.h>

#include "kvgen.h"
#include "kvpool.h"
#include "itest.h"


enum { L = 2, H = 2, D = 16, BT = 8, SINK = 4, RECENT = 32 };

static kvgen G;
static uint16_t K[256 * H * D], V[256 * H * D];

static kvp_pool *mkpool(const char *policy) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.block_tokens = BT;
  c.region_bytes = 16ull << 20;
  c.policy = policy;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  kvgen_init(&G);
  return p;
}

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

/* Positions read from every (layer, head) equal want[0..n). */
static void expect_positions(kvp_pool *p, uint64_t seq, const uint32_t *want, uint32_t n) {
  static uint16_t k[512 * D];
  static uint32_t pos[512];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_BF16, k, NULL, pos, 512, 0, NULL};
      ck_ok(kvp_read(p, seq, l, &q));
      ck_assert_uint_eq(q.n_tokens, n);
      for (uint32_t i = 0; i < n; i++) {
        ck_assert_uint_eq(pos[i], want[i]);
        if (k[i * D + 3] != kvgen_value(&G, seq, l, h, pos[i], 3, 0)) ck_abort_msg("row %u differs", i);
      }
    }
}

static void window_positions(uint32_t end, uint32_t *want, uint32_t *n) {
  *n = 0;
  for (uint32_t t = 0; t < end; t++)
    if (t < SINK || t + RECENT >= end) want[(*n)++] = t;
}

START_TEST(window_keeps_sink_and_recent) {
  kvp_pool *p = mkpool("window:sink=4:recent=32");
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, 1, 0, SINK); /* the sink in a step of its own */
  uint32_t want[512], n;
  uint64_t flat = 0;
  for (uint32_t t = SINK; t < 300; t++) {
    step(p, 1, t, 1);
    window_positions(t + 1, want, &n);
    if (t % 37 == 0 || t == 299) expect_positions(p, 1, want, n);
    kvp_stats s = {.struct_size = sizeof s};
    ck_ok(kvp_reclaim(p));
    ck_ok(kvp_stats_get(p, &s));
    ck_assert_uint_eq(s.tokens_retained.current, (uint64_t)L * H * n);
    if (t == 120) flat = s.bytes_allocated.current;
    if (t > 120) /* memory stays flat: at most one block per stream more than at step 120 */
      ck_assert_uint_le(s.bytes_allocated.current, flat + (uint64_t)L * H * 2 * BT * D * 2);
  }
  kvp_seq_desc d = {.struct_size = sizeof d};
  ck_ok(kvp_seq_info(p, 1, &d));
  ck_assert_uint_eq(d.tokens_retained, (uint64_t)L * H * (SINK + RECENT));
  ck_assert_uint_eq(d.tokens_evicted, (uint64_t)L * H * (300 - SINK - RECENT));
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(window_keeps_steps_whole) {
  kvp_pool *p = mkpool("window:sink=4:recent=32");
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, 1, 0, 50); /* straddles the sink: kept whole, for good */
  for (uint32_t t = 50; t < 120; t++) step(p, 1, t, 1);
  uint32_t want[512], n = 0;
  for (uint32_t t = 0; t < 120; t++)
    if (t < 50 || t + RECENT >= 120) want[n++] = t;
  expect_positions(p, 1, want, n);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(sequence_overrides_and_fork_inherits) {
  kvp_pool *p = mkpool("window:sink=4:recent=32");
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.policy = "none";
  ck_ok(kvp_seq_add(p, 1, &sc)); /* keeps everything */
  sc.policy = "window:sink=0:recent=16";
  ck_ok(kvp_seq_add(p, 2, &sc)); /* its own window */
  sc.policy = "window:sink=x";
  ck_status(kvp_seq_add(p, 3, &sc), KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "sink=x") != NULL);
  for (uint32_t t = 0; t < 60; t++) {
    step(p, 1, t, 1);
    step(p, 2, t, 1);
  }
  uint32_t want[512], n = 0;
  for (uint32_t t = 0; t < 60; t++) want[n++] = t;
  expect_positions(p, 1, want, n);
  n = 0;
  for (uint32_t t = 44; t < 60; t++) want[n++] = t;
  expect_positions(p, 2, want, n);
  ck_ok(kvp_seq_fork(p, 2, 4)); /* the child keeps seq 2's window */
  kvgen_fork(&G, 2, 4, 60);
  for (uint32_t t = 60; t < 70; t++) step(p, 4, t, 1);
  n = 0;
  for (uint32_t t = 54; t < 70; t++) want[n++] = t;
  expect_positions(p, 4, want, n);
  kvp_pool_destroy(p);
}
END_TEST

/* multishot, steps of 3 tokens: global sink 2 steps, shot sink 1, window 3. */
START_TEST(multishot_rebinds_the_shot_sink) {
  kvp_pool *p = mkpool("multishot:global=2:shot=1:window=3");
  ck_ok(kvp_seq_add(p, 1, NULL));
  uint32_t cuts[] = {5, 9}; /* steps 5 and 9 start new shots */
  for (uint32_t k = 0; k < 12; k++) {
    uint32_t flags = (k == cuts[0] || k == cuts[1]) ? KVP_STEP_SCENE_CUT : 0;
    ck_ok(kvp_step_begin(p, 1, 3, flags));
    for (uint32_t l = 0; l < L; l++) {
      kvgen_fill(&G, 1, l, 3 * k, 3, H, D, K, V);
      kvp_kv kv = {K, V, NULL};
      ck_ok(kvp_append(p, 1, l, &kv));
    }
    ck_ok(kvp_step_end(p, 1));
    ck_ok(kvp_check(p));
    /* kept: steps 0-1 (global), the current shot's first step, the last 3 */
    uint32_t shot = k >= 9 ? 9 : k >= 5 ? 5 : 0, want[64], n = 0;
    for (uint32_t j = 0; j <= k; j++)
      if (j < 2 || j == shot || j + 3 > k)
        for (uint32_t t = 0; t < 3; t++) want[n++] = 3 * j + t;
    expect_positions(p, 1, want, n);
  }
  kvp_pool_destroy(p);
}
END_TEST

/* A fork continues its parent's shot: the shot sink bound before the fork
 * stays the child's. */
START_TEST(multishot_fork_keeps_the_shot) {
  kvp_pool *p = mkpool("multishot:global=2:shot=1:window=3");
  ck_ok(kvp_seq_add(p, 1, NULL));
  for (uint32_t k = 0; k < 12; k++) {
    if (k == 7) {
      ck_ok(kvp_seq_fork(p, 1, 2));
      kvgen_fork(&G, 1, 2, 3 * k);
    }
    for (uint64_t id = 1; id <= (k >= 7 ? 2u : 1u); id++) {
      ck_ok(kvp_step_begin(p, id, 3, k == 5 ? KVP_STEP_SCENE_CUT : 0));
      for (uint32_t l = 0; l < L; l++) {
        kvgen_fill(&G, id, l, 3 * k, 3, H, D, K, V);
        ck_ok(kvp_append(p, id, l, &(kvp_kv){K, V, NULL}));
      }
      ck_ok(kvp_step_end(p, id));
      ck_ok(kvp_check(p));
      uint32_t shot = k >= 5 ? 5 : 0, want[64], n = 0;
      for (uint32_t j = 0; j <= k; j++)
        if (j < 2 || j == shot || j + 3 > k)
          for (uint32_t t = 0; t < 3; t++) want[n++] = 3 * j + t;
      expect_positions(p, id, want, n);
    }
  }
  kvp_pool_destroy(p);
}
END_TEST

int main(void) {
  Suite *s = suite_create("policy");
  TCase *tc = tcase_create("window");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, window_keeps_sink_and_recent);
  tcase_add_test(tc, window_keeps_steps_whole);
  tcase_add_test(tc, sequence_overrides_and_fork_inherits);
  tcase_add_test(tc, multishot_rebinds_the_shot_sink);
  tcase_add_test(tc, multishot_fork_keeps_the_shot);
  suite_add_tcase(s, tc);
  return it_run(s);
}
