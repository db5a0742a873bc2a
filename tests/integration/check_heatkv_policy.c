/*
 * tests/integration/check_heatkv_policy.c - the heatkv policy executing its
 * plan through kvp_append, public header only: the pool itself measures the
 * cache after every layer of every scale and it never passes the budget, in
 * head-token slots and, for a byte-true plan with mixed codecs, in ledger
 * bytes under a pool budget set to exactly B (any overshoot would be an
 * allocator refusal). An append whose evictions had to make room, and that
 * then finds the region too fragmented for its pages, changes nothing. The
 * shipped Infinity-2B orders are used when
 * ../shared is present (a visible skip otherwise).
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define KVP_EXPERIMENTAL_API /* raw pages fill and fragment the region beside the sequence */
#include "kvpool.h"
#include "itest.h"


static const uint32_t SCHED[13] = {1, 4, 16, 36, 64, 144, 256, 400, 576, 1024, 1600, 2304, 4096};
#define SHARED_2B "../shared/calib/heatkv/infinity-2b.orders.json"

static uint16_t *KV; /* [4096][H][D] of small finite bf16 values, reused by every append */

static kvp_pool *mkpool(uint32_t L, uint32_t H, uint32_t D, const char *codecs, const char *policy, uint64_t budget) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.block_tokens = 4096; /* a scale per block and head: an atom frees exactly */
  c.region_bytes = 1ull << 30;
  c.budget_bytes = budget;
  c.codecs = codecs;
  c.policy = policy;
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  return p;
}

static void add_var_seq(kvp_pool *p, uint64_t id, double b) {
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  sc.step_tokens = SCHED;
  sc.n_steps = 13;
  sc.budget_fraction = b;
  ck_ok(kvp_seq_add(p, id, &sc));
}

typedef struct run_out {
  uint64_t max_tokens;    /* largest tokens retained after any layer */
  uint64_t max_bytes;     /* largest ledger allocated after any layer */
  uint64_t full_bytes;    /* allocated bytes after scale K-2 (no policy: the full cache) */
} run_out;

/* Generate one image: 13 scales, every layer; measure after each layer. */
static run_out run_image(kvp_pool *p, uint64_t id, uint32_t L, int check_every_scale) {
  run_out o = {0, 0, 0};
  for (uint32_t k = 0; k < 13; k++) {
    ck_ok(kvp_step_begin(p, id, SCHED[k], 0));
    for (uint32_t l = 0; l < L; l++) {
      kvp_kv kv = {KV, KV, NULL};
      ck_ok(kvp_append(p, id, l, &kv));
      kvp_stats s = {.struct_size = sizeof s};
      ck_ok(kvp_stats_get(p, &s));
      if (s.tokens_retained.current > o.max_tokens) o.max_tokens = s.tokens_retained.current;
      if (s.bytes_allocated.current > o.max_bytes) o.max_bytes = s.bytes_allocated.current;
    }
    ck_ok(kvp_step_end(p, id));
    if (check_every_scale) ck_ok(kvp_check(p));
    if (k == 11) {
      kvp_stats s = {.struct_size = sizeof s};
      ck_ok(kvp_stats_get(p, &s));
      o.full_bytes = s.bytes_allocated.current;
    }
  }
  return o;
}

static void fill_kv(uint32_t H, uint32_t D) {
  free(KV);
  KV = malloc((size_t)4096 * H * D * 2);
  for (size_t i = 0; i < (size_t)4096 * H * D; i++) KV[i] = (uint16_t)(0x3c00 + (i * 2654435761u >> 24) % 200);
}

static const double BS[] = {0.2, 0.1, 0.04};

/* Slots: retained head-token slots never pass b x T x c_{K-1}. variant is
 * "heatkv" (orders=) or "binary-heatkv" (scores=). */
static void slots_case(const char *variant, const char *src, double b) {
  enum { L = 8, H = 4, D = 16 };
  fill_kv(H, D);
  char policy[96];
  snprintf(policy, sizeof policy, "%s:b=%g:s=3:%s=synthetic", variant, b, src);
  kvp_pool *p = mkpool(L, H, D, NULL, policy, 0);
  add_var_seq(p, 1, 0);
  run_out o = run_image(p, 1, L, 1);
  double B = b * L * H * 6425.0; /* c_{K-1}: tokens of scales 0..11 */
  printf("%s slots b=%.2f: peak %llu head-token slots of budget %.1f (%.1f%% used)\n", variant, b,
         (unsigned long long)o.max_tokens, B, 100.0 * (double)o.max_tokens / B);
  ck_assert_msg((double)o.max_tokens <= B, "peak %llu slots > budget %.1f", (unsigned long long)o.max_tokens, B);
  ck_assert_msg((double)o.max_tokens > 0.5 * B, "budget barely used: %llu of %.1f", (unsigned long long)o.max_tokens, B);
  kvp_pool_destroy(p);
}

START_TEST(slots_budget_holds_synthetic) { slots_case("heatkv", "orders", BS[_i]); }
END_TEST
START_TEST(binary_slots_budget_holds) { slots_case("binary-heatkv", "scores", BS[_i]); }
END_TEST

/* Bytes: mixed codecs; the pool's own budget is B, so an overshoot would be
 * an allocator refusal; the peak is reported against B. */
static void bytes_case(const char *variant, const char *src, double b) {
  enum { L = 8, H = 4, D = 32 };
  fill_kv(H, D);
  const char *codecs = "kv=nvfp4;layers=0-2:kv=bf16";
  kvp_pool *full = mkpool(L, H, D, codecs, NULL, 0);
  add_var_seq(full, 1, 0);
  run_out f = run_image(full, 1, L, 0);
  kvp_pool_destroy(full);
  uint64_t B = (uint64_t)floor(b * (double)f.full_bytes);
  char policy[96];
  snprintf(policy, sizeof policy, "%s:b=%g:s=3:%s=synthetic:unit=bytes", variant, b, src);
  kvp_pool *p = mkpool(L, H, D, codecs, policy, B);
  add_var_seq(p, 1, 0);
  run_out o = run_image(p, 1, L, 1);
  printf("%s bytes b=%.2f: full cache %llu bytes, budget %llu, peak %llu (%.1f%% used)\n", variant, b,
         (unsigned long long)f.full_bytes, (unsigned long long)B, (unsigned long long)o.max_bytes,
         100.0 * (double)o.max_bytes / (double)B);
  ck_assert_uint_le(o.max_bytes, B);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_le(s.bytes_allocated.peak, B);
  ck_assert_uint_eq(s.budget_refusals, 0);
  kvp_pool_destroy(p);
}

START_TEST(bytes_budget_holds_mixed_codecs) { bytes_case("heatkv", "orders", BS[_i]); }
END_TEST
START_TEST(binary_bytes_budget_holds) { bytes_case("binary-heatkv", "scores", BS[_i]); }
END_TEST

START_TEST(infeasible_budget_refused) {
  kvp_pool *p = mkpool(4, 2, 16, NULL, "heatkv:b=0.001:s=3:orders=synthetic", 0);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  sc.step_tokens = SCHED;
  sc.n_steps = 13;
  ck_status(kvp_seq_add(p, 1, &sc), KVP_EINVAL);
  printf("infeasible: %s\n", kvp_last_error());
  sc.mode = KVP_SEQ_STREAM;
  sc.budget_fraction = 0.1;
  ck_status(kvp_seq_add(p, 1, &sc), KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "KVP_SEQ_STEP") != NULL);
  kvp_pool_destroy(p);
}
END_TEST

/* A fork under heatkv: the child is in step mode like its parent (the
 * policy checks it), follows the same plan from where the parent is, and
 * both keep the budget. */
static void fork_case(const char *variant, const char *src) {
  enum { L = 4, H = 2, D = 16 };
  fill_kv(H, D);
  char policy[96];
  snprintf(policy, sizeof policy, "%s:b=0.3:s=3:%s=synthetic", variant, src);
  kvp_pool *p = mkpool(L, H, D, NULL, policy, 0);
  add_var_seq(p, 1, 0);
  for (uint32_t k = 0; k < 13; k++) {
    if (k == 6) {
      ck_ok(kvp_seq_fork(p, 1, 2));
      ck_ok(kvp_check(p));
    }
    for (uint64_t id = 1; id <= (k >= 6 ? 2u : 1u); id++) {
      ck_ok(kvp_step_begin(p, id, SCHED[k], 0));
      for (uint32_t l = 0; l < L; l++) ck_ok(kvp_append(p, id, l, &(kvp_kv){KV, KV, NULL}));
      ck_ok(kvp_step_end(p, id));
    }
    ck_ok(kvp_check(p));
  }
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.sequences.current, 2);
  ck_assert_uint_le(s.tokens_retained.current, 2 * 0.3 * L * H * 6425.0);
  ck_ok(kvp_seq_free(p, 1));
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}

START_TEST(fork_keeps_step_mode) { fork_case("heatkv", "orders"); }
END_TEST
START_TEST(binary_fork_keeps_step_mode) { fork_case("binary-heatkv", "scores"); }
END_TEST

/* An append that finds no room (the pool's budget, or its region, smaller
 * than the plan needs) is refused and evicts nothing: the policy's
 * evictions belong to the append, so tokens retained, ledger and steps stay
 * as they were. The run goes on until the first refusal. */
typedef struct refuse_fp {
  uint64_t tokens, evicted, allocated, pages;
} refuse_fp;

static refuse_fp refuse_fingerprint(kvp_pool *p) {
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  return (refuse_fp){s.tokens_retained.current, s.tokens_evicted, s.bytes_allocated.current, s.pages.current};
}

/* One run up to its first refused append; returns 1 if one was refused
 * (and checks it changed nothing). */
static int refused_run(uint32_t D, uint64_t region, uint64_t budget, int want) {
  enum { L = 4, H = 2 };
  fill_kv(H, D);
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.block_tokens = 64;
  c.region_bytes = region, c.budget_bytes = budget;
  c.policy = "heatkv:b=0.3:s=3:orders=synthetic";
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  add_var_seq(p, 1, 0);
  int refused = 0;
  for (uint32_t k = 0; k < 13 && !refused; k++) {
    ck_ok(kvp_step_begin(p, 1, SCHED[k], 0));
    for (uint32_t l = 0; l < L && !refused; l++) {
      ck_ok(kvp_reclaim(p));
      refuse_fp before = refuse_fingerprint(p);
      int rc = kvp_append(p, 1, l, &(kvp_kv){KV, KV, NULL});
      if (rc == KVP_OK) continue;
      refused = 1;
      ck_assert_msg(rc == want, "scale %u layer %u: %s, expected %s", k, l, kvp_last_error(), kvp_err_name(want));
      refuse_fp after = refuse_fingerprint(p);
      ck_assert_msg(after.tokens == before.tokens && after.evicted == before.evicted &&
                        after.allocated == before.allocated && after.pages == before.pages,
                    "budget %llu region %llu, scale %u layer %u refused (%s) but tokens %llu -> %llu, allocated "
                    "%llu -> %llu", (unsigned long long)budget, (unsigned long long)region, k, l, kvp_err_name(rc),
                    (unsigned long long)before.tokens, (unsigned long long)after.tokens,
                    (unsigned long long)before.allocated, (unsigned long long)after.allocated);
      ck_ok(kvp_check(p));
      ck_status(kvp_step_end(p, 1), KVP_EINVAL); /* the layer is still to append */
    }
    if (!refused) ck_ok(kvp_step_end(p, 1));
  }
  kvp_pool_destroy(p);
  return refused;
}

/* Budgets from far too small to almost enough: wherever the first refusal
 * falls (some layers have evictions planned before their append, some
 * not), it changes nothing. */
START_TEST(refused_append_evicts_nothing_budget) {
  int n = 0;
  for (uint64_t b = 64 << 10; b <= 1024 << 10; b += 8 << 10) n += refused_run(16, 64ull << 20, b, KVP_EBUDGET);
  printf("heatkv: %d appends refused by the budget, none changed the pool\n", n);
  ck_assert_int_gt(n, 100);
}
END_TEST

/* The same with the region binding (the budget past it). */
START_TEST(refused_append_evicts_nothing_region) {
  int n = 0;
  for (uint32_t D = 48; D <= 160; D += 16) n += refused_run(D, 2ull << 20, 1ull << 30, KVP_ENOSPC);
  printf("heatkv: %d appends refused by the region, none changed the pool\n", n);
  ck_assert_int_gt(n, 4);
}
END_TEST

/* The region, not the budget, is short, and fragmented: raw pages of 16 B
 * fill every free extent with slabs, then all but one slot of each slab are
 * freed, so the region has many free slots and no free extent. Each step of
 * the sequence is one block per (layer, head) whose pages are a size class
 * of their own (block_tokens 64), and a raw page of each class used so far
 * keeps those slabs alive. The append of step 4 needs a new slab (8 KiB,
 * class 1024): none fits; its before-evictions could make room as far as
 * the budget and the free slots tell, so they are applied, free only slots,
 * and the slab still does not fit. The append fails with KVP_ENOSPC and
 * the pool is as before: the evictions are undone, their pages back. Once
 * the filler goes, the same append succeeds. */
START_TEST(fragmented_region_undoes_evictions) {
  enum { L = 2, H = 2, D = 16 };
  static const uint32_t T[6] = {4, 8, 16, 24, 32, 48};
  fill_kv(H, D);
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.block_tokens = 64;
  c.region_bytes = 2ull << 20;
  c.policy = "heatkv:b=0.5:s=2:orders=synthetic";
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  sc.step_tokens = T;
  sc.n_steps = 6;
  ck_ok(kvp_seq_add(p, 1, &sc));
  for (uint32_t k = 0; k < 4; k++) {
    ck_ok(kvp_step_begin(p, 1, T[k], 0));
    for (uint32_t l = 0; l < L; l++) ck_ok(kvp_append(p, 1, l, &(kvp_kv){KV, KV, NULL}));
    ck_ok(kvp_step_end(p, 1));
  }
  kvp_page_tag tag = {.seq = 99, .layer = 0, .head = 0, .type = KVP_PAGE_RAW, .kv = 0, .codec = 0};
  kvp_page_id keep[4], *fill = malloc(sizeof *fill * (1u << 17));
  for (uint32_t k = 0; k < 4; k++) ck_ok(kvp_page_alloc(p, T[k] * D * 2, &tag, &keep[k])); /* K and V pages' class */
  uint32_t n = 0;
  int rc = KVP_OK;
  while (n < (1u << 17) && (rc = kvp_page_alloc(p, 16, &tag, &fill[n])) == KVP_OK) n++; /* 512 to a slab */
  ck_assert_int_eq(rc, KVP_ENOSPC);
  ck_assert_uint_gt(n, 512);
  for (uint32_t i = 0; i < n; i++)
    if (i % 512) ck_ok(kvp_page_free(p, fill[i])); /* one slot left per slab: no slab empties */
  ck_ok(kvp_step_begin(p, 1, T[4], 0));
  ck_ok(kvp_reclaim(p));
  refuse_fp before = refuse_fingerprint(p);
  kvp_seq_desc d0 = {.struct_size = sizeof d0};
  ck_ok(kvp_seq_info(p, 1, &d0));
  rc = kvp_append(p, 1, 0, &(kvp_kv){KV, KV, NULL});
  ck_assert_msg(rc == KVP_ENOSPC, "append in the fragmented region: %s", rc ? kvp_last_error() : "succeeded");
  refuse_fp after = refuse_fingerprint(p);
  kvp_seq_desc d1 = {.struct_size = sizeof d1};
  ck_ok(kvp_seq_info(p, 1, &d1));
  ck_assert_msg(after.tokens == before.tokens && after.evicted == before.evicted && after.allocated == before.allocated &&
                    after.pages == before.pages && d1.tokens_retained == d0.tokens_retained,
                "the refused append changed the pool: tokens %llu -> %llu, evicted %llu -> %llu, allocated %llu -> "
                "%llu", (unsigned long long)before.tokens, (unsigned long long)after.tokens,
                (unsigned long long)before.evicted, (unsigned long long)after.evicted,
                (unsigned long long)before.allocated, (unsigned long long)after.allocated);
  ck_ok(kvp_check(p));
  for (uint32_t i = 0; i < n; i += 512) ck_ok(kvp_page_free(p, fill[i]));
  ck_ok(kvp_append(p, 1, 0, &(kvp_kv){KV, KV, NULL}));
  refuse_fp done = refuse_fingerprint(p);
  ck_assert_uint_gt(done.evicted, before.evicted); /* its evictions were needed, and made */
  ck_ok(kvp_check(p));
  for (uint32_t k = 0; k < 4; k++) ck_ok(kvp_page_free(p, keep[k]));
  free(fill);
  kvp_pool_destroy(p);
}
END_TEST

/* The shipped Infinity-2B orders (L=32, H=16), D=16 to keep it small. */
START_TEST(shipped_infinity_2b_orders) {
  if (access(SHARED_2B, R_OK) != 0) {
    printf("check_heatkv_policy: skipped shipped orders: %s not found\n", SHARED_2B);
    return;
  }
  enum { L = 32, H = 16, D = 16 };
  fill_kv(H, D);
  double b = BS[_i];
  char policy[160];
  snprintf(policy, sizeof policy, "heatkv:b=%g:s=3:orders=%s", b, SHARED_2B);
  kvp_pool *p = mkpool(L, H, D, NULL, policy, 0);
  add_var_seq(p, 1, 0);
  run_out o = run_image(p, 1, L, 0);
  ck_ok(kvp_check(p));
  double B = b * L * H * 6425.0;
  printf("infinity-2b b=%.2f: peak %llu head-token slots of budget %.1f (%.1f%% used)\n", b,
         (unsigned long long)o.max_tokens, B, 100.0 * (double)o.max_tokens / B);
  ck_assert((double)o.max_tokens <= B);
  kvp_pool_destroy(p);
}
END_TEST

int main(void) {
  Suite *s = suite_create("heatkv_policy");
  TCase *tc = tcase_create("heatkv");
  tcase_set_timeout(tc, 300);
  tcase_add_loop_test(tc, slots_budget_holds_synthetic, 0, 3);
  tcase_add_loop_test(tc, bytes_budget_holds_mixed_codecs, 0, 3);
  tcase_add_loop_test(tc, binary_slots_budget_holds, 0, 3);
  tcase_add_loop_test(tc, binary_bytes_budget_holds, 0, 3);
  tcase_add_test(tc, infeasible_budget_refused);
  tcase_add_test(tc, fork_keeps_step_mode);
  tcase_add_test(tc, refused_append_evicts_nothing_budget);
  tcase_add_test(tc, refused_append_evicts_nothing_region);
  tcase_add_test(tc, fragmented_region_undoes_evictions);
  tcase_add_test(tc, binary_fork_keeps_step_mode);
  tcase_add_loop_test(tc, shipped_infinity_2b_orders, 0, 3);
  suite_add_tcase(s, tc);
  int rc = it_run(s);
  free(KV);
  return rc;
}
