/*
 * tests/integration/check_sched.c - the pool driven like a serving engine's
 * scheduler, through the public header only:
 *   - a vLLM-like loop: 64 sequences arrive and leave, prefill steps of
 *     hundreds of tokens, decode steps of one, fork for parallel sampling,
 *     evictions of random (layer, head, step) units, preemption when the
 *     budget refuses; every read checked byte for byte against a model,
 *     kvp_check after every call;
 *   - a VAR-shaped run in step mode: 13 scales of 1..4096 tokens, evictions
 *     of (layer, head, scale) units that free exactly their pages;
 *   - bad input: each error with its status, a message, and no change.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvgen.h"
#include "kvpool.h"
#include "itest.h"

#define ck_pool(p) ck_ok(kvp_check(p))

enum { L = 4, H = 2, D = 32 };

static uint64_t rnd(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* ---- the model of what a sequence retains ------------------------------- */

typedef struct mseq {
  int live;
  uint32_t nsteps;
  uint32_t pos[1024];             /* first position of each step; pos[nsteps] = end */
  uint8_t evicted[L][H][1024];    /* step evicted from (layer, head) */
  uint32_t target;                /* tokens at which it finishes */
} mseq;

static kvgen G;
static mseq M[KVGEN_MAX_SEQS];

static kvp_pool *mkpool(uint64_t budget, uint32_t block_tokens) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.region_bytes = 64ull << 20;
  c.budget_bytes = budget;
  c.block_tokens = block_tokens;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  return p;
}

/* One step of n tokens through every layer. On a budget refusal the
 * sequence is preempted (freed) and the function returns the status. */
static int run_step(kvp_pool *p, uint64_t id, uint32_t n) {
  static uint16_t k[4096 * H * D], v[4096 * H * D];
  ck_assert_uint_le(n, 4096);
  mseq *m = &M[id];
  ck_ok(kvp_step_begin(p, id, n, 0));
  ck_pool(p);
  for (uint32_t l = 0; l < L; l++) {
    kvgen_fill(&G, id, l, m->pos[m->nsteps], n, H, D, k, v);
    kvp_kv kv = {k, v, NULL};
    int rc = kvp_append(p, id, l, &kv);
    ck_pool(p);
    if (rc) {
      ck_assert_msg(rc == KVP_EBUDGET, "append: %s", kvp_last_error());
      ck_ok(kvp_seq_free(p, id)); /* preempt: recompute later */
      ck_pool(p);
      m->live = 0;
      return rc;
    }
  }
  ck_ok(kvp_step_end(p, id));
  ck_pool(p);
  m->nsteps++;
  m->pos[m->nsteps] = m->pos[m->nsteps - 1] + n;
  return KVP_OK;
}

/* Read every head of one layer and compare with the model, bit for bit. */
static void verify(kvp_pool *p, uint64_t id, uint32_t l) {
  static uint16_t k[16384 * D], v[16384 * D];
  static uint32_t pos[16384];
  const mseq *m = &M[id];
  for (uint32_t h = 0; h < H; h++) {
    kvp_read_req q = {sizeof q, h, KVP_DTYPE_BF16, k, v, pos, 16384, 0, NULL};
    ck_ok(kvp_read(p, id, l, &q));
    uint32_t i = 0;
    for (uint32_t s = 0; s < m->nsteps; s++) {
      if (m->evicted[l][h][s]) continue;
      for (uint32_t t = m->pos[s]; t < m->pos[s + 1]; t++, i++) {
        /* plain comparisons: a Check assertion per element would log each one */
        int bad = i >= q.n_tokens || pos[i] != t;
        for (uint32_t d = 0; d < D && !bad; d++)
          bad = k[(size_t)i * D + d] != kvgen_value(&G, id, l, h, t, d, 0) ||
                v[(size_t)i * D + d] != kvgen_value(&G, id, l, h, t, d, 1);
        if (bad)
          ck_abort_msg("seq %llu layer %u head %u: row %u (position %u, step %u) differs or is missing (%u read)",
                       (unsigned long long)id, l, h, i, t, s, q.n_tokens);
      }
    }
    ck_assert_uint_eq(q.n_tokens, i);
  }
}

START_TEST(scheduler_loop) {
  kvp_pool *p = mkpool(1536ull << 10, 16); /* binds: preemptions happen */
  kvgen_init(&G);
  memset(M, 0, sizeof M);
  uint64_t rng = 0x5EED, next_id = 0, running[16];
  int nrun = 0, finished = 0, preempted = 0, forks = 0, evictions = 0, reads = 0;
  while (next_id < 64 || nrun) {
    /* admit: a prefill of hundreds of tokens */
    if (next_id < 64 && nrun < 10 && rnd(&rng) % 3 == 0) {
      uint64_t id = next_id++;
      ck_ok(kvp_seq_add(p, id, NULL));
      ck_pool(p);
      M[id].live = 1;
      M[id].target = 120 + (uint32_t)(rnd(&rng) % 280) + 30;
      if (run_step(p, id, M[id].target - 30 - (uint32_t)(rnd(&rng) % 20)) == KVP_OK) running[nrun++] = id;
      else preempted++;
    }
    /* decode one token for every running sequence */
    for (int i = 0; i < nrun; i++) {
      uint64_t id = running[i];
      if (run_step(p, id, 1) != KVP_OK) {
        preempted++;
        running[i--] = running[--nrun];
        continue;
      }
      mseq *m = &M[id];
      uint64_t r = rnd(&rng);
      if (r % 11 == 0 && m->nsteps > 2) { /* evict a random unit, like a window policy would */
        uint32_t l = (uint32_t)(r >> 8) % L, h = (uint32_t)(r >> 16) % H, s = (uint32_t)(r >> 24) % m->nsteps;
        int rc = kvp_evict(p, id, l, h, s);
        ck_assert_int_eq(rc, m->evicted[l][h][s] ? KVP_ENOENT : KVP_OK);
        m->evicted[l][h][s] = 1;
        evictions += rc == KVP_OK;
        ck_pool(p);
      }
      if (r % 13 == 0) {
        verify(p, id, (uint32_t)(r >> 32) % L);
        reads++;
      }
      if (r % 29 == 0 && next_id < 64 && nrun < 16) { /* parallel sampling: fork */
        uint64_t c = next_id++;
        int rc = kvp_seq_fork(p, id, c);
        ck_pool(p);
        if (rc == KVP_OK) {
          kvgen_fork(&G, id, c, m->pos[m->nsteps]);
          M[c] = *m;
          M[c].target = m->target + 10;
          running[nrun++] = c;
          forks++;
          verify(p, c, 0);
        } else {
          ck_assert_int_eq(rc, KVP_EBUDGET);
          next_id--;
        }
      }
      if (m->pos[m->nsteps] >= m->target) {
        for (uint32_t l = 0; l < L; l++) verify(p, id, l);
        ck_ok(kvp_seq_free(p, id));
        ck_pool(p);
        m->live = 0;
        finished++;
        running[i--] = running[--nrun];
      }
    }
  }
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  printf("scheduler: %d finished, %d preempted, %d forks, %d evictions, %d verified reads; peak %llu of %llu bytes\n",
         finished, preempted, forks, evictions, reads, (unsigned long long)s.bytes_allocated.peak,
         (unsigned long long)s.budget_bytes);
  ck_assert_int_gt(finished, 30);
  ck_assert_int_gt(forks, 0);
  ck_assert_int_gt(evictions, 0);
  ck_assert_uint_le(s.bytes_allocated.peak, s.budget_bytes);
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  ck_assert_uint_eq(s.tokens_retained.current, 0);
  ck_assert_uint_eq(s.sequences.current, 0);
  kvp_pool_destroy(p);
}
END_TEST

/* ---- VAR-shaped run in step mode ----------------------------------------- */

/* Allocated bytes of a page of n bytes in this 64 MiB region, computed
 * here independently of the library: a size class up to 32 KiB (8 B, 16 B
 * steps to 1 KiB, then 64 per doubling), the 4 KiB extent unit above. */
static uint64_t class_of(uint64_t n) {
  if (n > (32u << 10)) return (n + 4095) / 4096 * 4096;
  if (n <= 8) return 8;
  if (n <= 1024) return (n + 15) / 16 * 16;
  uint64_t lo = 1024;
  while (lo * 2 < n) lo *= 2; /* n in (lo, 2 lo] */
  uint64_t step = lo / 64;
  return (n + step - 1) / step * step;
}

START_TEST(var_step_mode_exact_eviction) {
  /* 13 scales, token counts of a VAR schedule (side^2 for growing sides) */
  static const uint32_t side[13] = {1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64};
  uint32_t sched[13];
  for (int k = 0; k < 13; k++) sched[k] = side[k] * side[k];
  kvp_pool *p = mkpool(0, 256);
  kvgen_init(&G);
  memset(M, 0, sizeof M);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  sc.step_tokens = sched;
  sc.n_steps = 13;
  ck_ok(kvp_seq_add(p, 7, &sc));
  ck_status(kvp_step_begin(p, 7, 5, 0), KVP_EINVAL); /* the plan says 1 */
  ck_assert(strstr(kvp_last_error(), "plan says 1") != NULL);
  uint64_t rng = 99;
  for (int k = 0; k < 13; k++) {
    ck_ok(run_step(p, 7, sched[k]));
    /* evict a few units of this scale and earlier ones; each frees exactly its pages */
    for (int e = 0; e < 3; e++) {
      uint32_t l = (uint32_t)rnd(&rng) % L, h = (uint32_t)rnd(&rng) % H, s = (uint32_t)(rnd(&rng) % (uint64_t)(k + 1));
      kvp_stats a = {.struct_size = sizeof a}, b = {.struct_size = sizeof b};
      ck_ok(kvp_stats_get(p, &a));
      int rc = kvp_evict(p, 7, l, h, s);
      ck_pool(p);
      ck_ok(kvp_stats_get(p, &b));
      if (M[7].evicted[l][h][s]) {
        ck_assert_int_eq(rc, KVP_ENOENT);
        ck_assert_uint_eq(a.bytes_allocated.current, b.bytes_allocated.current);
        continue;
      }
      ck_ok(rc);
      M[7].evicted[l][h][s] = 1;
      /* pages of the unit: ceil(n / 256) blocks, each a K and a V page of its tokens */
      uint32_t n = sched[s], expect = 0;
      uint64_t expect_bytes = 0;
      for (uint32_t t = 0; t < n; t += 256) {
        uint32_t m = n - t < 256 ? n - t : 256;
        expect += 2;
        expect_bytes += 2 * class_of((uint64_t)m * D * 2);
      }
      ck_assert_uint_eq(a.pages.current - b.pages.current, expect);
      ck_assert_uint_eq(a.bytes_allocated.current - b.bytes_allocated.current, expect_bytes);
      ck_assert_uint_eq(a.bytes_requested.current - b.bytes_requested.current, 2ull * n * D * 2);
      ck_assert_uint_eq(a.tokens_retained.current - b.tokens_retained.current, n);
    }
    for (uint32_t l = 0; l < L; l++) verify(p, 7, l);
  }
  kvp_seq_desc info = {.struct_size = sizeof info};
  uint32_t ret[L * H], ev[L * H];
  info.retained_tokens = ret;
  info.evicted_tokens = ev;
  ck_ok(kvp_seq_info(p, 7, &info));
  ck_assert_uint_eq(info.n_steps, 13);
  uint64_t total = 0;
  for (int k = 0; k < 13; k++) total += sched[k];
  ck_assert_uint_eq(info.n_positions, total);
  ck_assert_uint_eq(info.tokens_retained + info.tokens_evicted, total * L * H);
  ck_ok(kvp_seq_free(p, 7));
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

int main(void) {
  Suite *s = suite_create("sched");
  TCase *tc = tcase_create("sched");
  tcase_set_timeout(tc, 600);
  tcase_add_test(tc, scheduler_loop);
  tcase_add_test(tc, var_step_mode_exact_eviction);
  suite_add_tcase(s, tc);
  return it_run(s);
}
