/*
 * tests/unit/check_fault.c - every allocation fails in turn: the library
 * built with -DKVP_FAULT_INJECT (util/fault.h) runs representative
 * scenarios (each codec family, each policy, stream and step mode, fork,
 * evict, read, free, create, destroy, and a budget tight enough that heatkv's
 * evictions must make room before an append's pages fit) once per
 * allocation k they make, with
 * the k-th one failing. For every call that fails:
 *   - it returns an error (never crashes),
 *   - the pool is unchanged (ledger bytes and pages, tokens retained and
 *     evicted, sequences, and each sequence's steps and positions),
 *   - kvp_check passes,
 *   - the same call made again (no fault) succeeds: the pool is usable.
 * After each run the pool is destroyed and every allocation the library
 * made is gone (its own tracking; ASan's leak checker too in `make asan`).
 * A summary line per scenario gives allocations swept and calls failed.
 * The calibration cases sweep kvp_kvquant_calib_* (add, and synthetic on
 * worker threads), with the written file compared.
 * The 'room' cases sweep one append whose policy's evictions must make
 * room first (under the budget, or in a full region where its new pages
 * lie over the evicted ones), with what a read gives back compared too.
 */
#define KVP_EXPERIMENTAL_API /* raw pages fill the region beside a sequence */
#include "../../util/fault.h"
#include "../../util/util.h"
#include "kvpool_codec.h"
#include "testutil.h"

#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { L = 2, H = 2, D = 16, BT = 4, MAXTOK = 64 };

static uint16_t KV[MAXTOK * H * D];

typedef struct scen {
  const char *name;
  const char *codecs;  /* NULL: raw */
  const char *policy;  /* NULL: none */
  kvp_seq_mode mode;
  uint32_t nsteps;     /* steps of sequence 1 */
  const uint32_t *tokens; /* [nsteps] */
  bool planned;        /* the schedule is given to kvp_seq_add (heatkv) */
  bool fork;           /* fork 1 -> 2, a step on 2, evict, free */
  uint32_t bt;         /* block_tokens (0: BT) */
  uint64_t budget;     /* pool budget (0: the region) */
} scen;

static const uint32_t T_STREAM[] = {3, 5, 1, 7, 2, 4};
static const uint32_t T_STEP[] = {4, 8, 4, 16, 8, 4};
static const uint32_t T_VAR[] = {1, 2, 4, 6, 8, 12};
static const uint32_t T_BIG[] = {4, 8, 16, 24, 32, 48};

static const scen SCEN[] = {
    {"raw-stream", NULL, NULL, KVP_SEQ_STREAM, 6, T_STREAM, false, true, 0, 0},
    {"fp8-int8-stream", "k=fp8,v=int8", NULL, KVP_SEQ_STREAM, 6, T_STREAM, false, true, 0, 0},
    {"kivi-step", "kv=kivi:bits=2:group=16", NULL, KVP_SEQ_STEP, 6, T_STEP, false, true, 16, 0},
    {"nvfp4-step", "k=nvfp4:rule=4/6:ksmooth=store,v=nvfp4", NULL, KVP_SEQ_STEP, 6, T_STEP, false, true, 0, 0},
    {"qvg-step", "kv=qvg:k=4:group=16", NULL, KVP_SEQ_STEP, 6, T_STEP, false, true, 0, 0},
    {"kvquant-stream", "kv=kvquant:calib_tokens=16", NULL, KVP_SEQ_STREAM, 6, T_STREAM, false, true, 0, 0},
    {"window-stream", "k=bf16,v=fp8", "window:sink=2:recent=6", KVP_SEQ_STREAM, 6, T_STREAM, false, true, 0, 0},
    {"multishot-step", NULL, "multishot:global=1:shot=1:window=2", KVP_SEQ_STEP, 6, T_STEP, false, true, 0, 0},
    {"heatkv-step", NULL, "heatkv:b=0.3:s=2:orders=synthetic", KVP_SEQ_STEP, 6, T_VAR, true, true, 0, 0},
    /* a budget the plan fills: some appends need their evictions applied first to make room */
    {"heatkv-tight-budget", NULL, "heatkv:b=0.5:s=2:orders=synthetic", KVP_SEQ_STEP, 6, T_BIG, true, false, 16, 12288},
    {"binary-heatkv-step", "kv=int8", "binary-heatkv:b=0.4:s=2:scores=synthetic", KVP_SEQ_STEP, 6, T_VAR, true, true, 0, 0},
};
#define NSCEN (sizeof SCEN / sizeof *SCEN)

/* ---- holding the fault while the test itself looks ----------------------- */

static uint64_t armed_k;  /* allocation to fail, counted from the run's start; 0 = none */
static uint64_t seen;     /* allocations of the run so far */

static uint64_t failed_so_far; /* injected failures of the run so far */

static void hold(void) { /* the test's own calls (checks, fingerprints) are not counted */
  seen += kvp__fault_count();
  failed_so_far += kvp__fault_failed();
  kvp__fault_arm(0, false);
}
static void resume(void) { kvp__fault_arm(armed_k > seen ? armed_k - seen : 0, false); }

/* ---- what must not change ------------------------------------------------- */

typedef struct fp {
  uint64_t req, alloc, pages, tokens, evicted, seqs, chunks;
  uint32_t steps[4], positions[4];
  int exists[4], in_step[4];
  uint64_t seq_tokens[4];
} fp;

static fp fingerprint(kvp_pool *p) {
  fp f;
  memset(&f, 0, sizeof f);
  kvp_stats s = {.struct_size = sizeof s};
  ck_assert_int_eq(kvp_stats_get(p, &s), KVP_OK);
  f.req = s.bytes_requested.current, f.alloc = s.bytes_allocated.current, f.pages = s.pages.current;
  f.tokens = s.tokens_retained.current, f.evicted = s.tokens_evicted, f.seqs = s.sequences.current;
  f.chunks = s.prefix_chunks.current;
  for (uint64_t q = 1; q <= 3; q++) {
    kvp_seq_desc d = {.struct_size = sizeof d};
    f.exists[q] = kvp_seq_info(p, q, &d) == KVP_OK;
    f.steps[q] = d.n_steps, f.positions[q] = d.n_positions, f.in_step[q] = d.in_step;
    f.seq_tokens[q] = d.tokens_retained;
  }
  return f;
}

typedef struct tally {
  uint64_t runs, failed_calls, create_failures, tolerated;
} tally;

/* Make one call; if it fails, it must have been the injected fault, must
 * have changed nothing, and must succeed when made again. */
#define CALL(t, p, expr)                                                                                       \
  do {                                                                                                         \
    hold();                                                                                                    \
    ck_assert_int_eq(kvp_reclaim(p), KVP_OK);                                                                   \
    fp before_ = fingerprint(p);                                                                               \
    resume();                                                                                                  \
    int rc_ = (expr);                                                                                          \
    hold();                                                                                                    \
    char err_[512];                                                                                            \
    snprintf(err_, sizeof err_, "%s", kvp_last_error());                                                      \
    if (rc_ != KVP_OK) {                                                                                       \
      ck_assert_msg(fault_failed_total() > 0, "k=%llu: %s failed with no fault: %s", (unsigned long long)armed_k, \
                    #expr, err_);                                                                              \
      ck_assert_msg(rc_ < 0, "%s returned %d", #expr, rc_);                                                   \
      fp after_ = fingerprint(p);                                                                             \
      ck_assert_msg(memcmp(&before_, &after_, sizeof after_) == 0,                                           \
                    "k=%llu: failed %s (%s) changed the pool: tokens %llu -> %llu, allocated %llu -> %llu, "   \
                    "steps %u -> %u", (unsigned long long)armed_k, #expr, err_,                               \
                    (unsigned long long)before_.tokens, (unsigned long long)after_.tokens,                     \
                    (unsigned long long)before_.alloc, (unsigned long long)after_.alloc, before_.steps[1],      \
                    after_.steps[1]);                                                                          \
      ck_assert_msg(kvp_check(p) == KVP_OK, "k=%llu after %s: %s", (unsigned long long)armed_k, #expr,         \
                    kvp_last_error());                                                                        \
      (t)->failed_calls++;                                                                                     \
      rc_ = (expr);                                                                                            \
      ck_assert_msg(rc_ == KVP_OK, "k=%llu: %s again: %s", (unsigned long long)armed_k, #expr, kvp_last_error()); \
    }                                                                                                          \
    ck_assert_msg(kvp_check(p) == KVP_OK, "k=%llu after %s: %s", (unsigned long long)armed_k, #expr,           \
                  kvp_last_error());                                                                          \
    resume();                                                                                                  \
  } while (0)

static uint64_t fault_failed_total(void) { return failed_so_far + kvp__fault_failed(); }

static void one_step(tally *t, kvp_pool *p, uint64_t q, uint32_t n, uint32_t flags) {
  CALL(t, p, kvp_step_begin(p, q, n, flags));
  for (uint32_t l = 0; l < L; l++) CALL(t, p, kvp_append(p, q, l, &(kvp_kv){KV, KV, NULL}));
  CALL(t, p, kvp_step_end(p, q));
}

static int read_all(kvp_pool *p, uint64_t q) {
  static uint16_t out[4 * MAXTOK * 8 * D];
  static uint32_t pos[4 * MAXTOK * 8];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req r = {sizeof r, h, KVP_DTYPE_BF16, out, out, pos, 4 * MAXTOK * 8, 0, NULL};
      int rc = kvp_read(p, q, l, &r);
      if (rc) return rc;
    }
  return KVP_OK;
}

/* kvp_evict, where a policy may have evicted the unit already. */
static int evict_if_retained(kvp_pool *p, uint64_t q, uint32_t l, uint32_t h, uint32_t step) {
  int rc = kvp_evict(p, q, l, h, step);
  return rc == KVP_ENOENT ? KVP_OK : rc;
}

/* One run with allocation k failing (0: none). Returns the allocations the
 * run made. */
static uint64_t run(const scen *s, uint64_t k, tally *t) {
  armed_k = k;
  seen = 0;
  failed_so_far = 0;
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.block_tokens = s->bt ? s->bt : BT;
  c.region_bytes = 4ull << 20;
  c.budget_bytes = s->budget;
  c.codecs = s->codecs, c.policy = s->policy;
  c.flags = KVP_POOL_ALLOW_EXPANSION; /* qvg's centroids outweigh its tokens at these small blocks */
  kvp_pool *p = NULL;
  resume();
  int rc = kvp_pool_create(&c, &p);
  hold();
  if (rc) { /* a constructor that fails holds nothing */
    ck_assert_msg(fault_failed_total() > 0, "create failed with no fault: %s", kvp_last_error());
    ck_assert_msg(p == NULL, "a failed create handed out a pool");
    t->create_failures++;
    return seen;
  }
  resume();
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = s->mode;
  if (s->planned) sc.step_tokens = s->tokens, sc.n_steps = s->nsteps;
  CALL(t, p, kvp_seq_add(p, 1, &sc));
  for (uint32_t j = 0; j < s->nsteps; j++) {
    if (s->fork && j == s->nsteps - 2) { /* the child takes the last steps with its parent */
      CALL(t, p, kvp_seq_fork(p, 1, 2));
      one_step(t, p, 2, s->tokens[j], 0);
    }
    one_step(t, p, 1, s->tokens[j], j == 3 ? KVP_STEP_SCENE_CUT : 0);
  }
  CALL(t, p, read_all(p, 1));
  if (s->fork) {
    CALL(t, p, read_all(p, 2));
    CALL(t, p, evict_if_retained(p, 2, 1, 1, 0));
    CALL(t, p, evict_if_retained(p, 2, 0, 0, 1));
    CALL(t, p, kvp_seq_free(p, 2));
  }
  CALL(t, p, kvp_seq_free(p, 1));
  CALL(t, p, kvp_seq_add(p, 1, &sc));
  kvp_pool_destroy(p); /* with sequence 1 live: destroy frees it */
  hold();
  return seen;
}

START_TEST(every_allocation_fails_in_turn) {
  const scen *s = &SCEN[_i];
  for (size_t i = 0; i < sizeof KV / sizeof *KV; i++) KV[i] = (uint16_t)(0x3f00 + (i * 37) % 256);
  uint64_t live0 = kvp__fault_live(NULL);
  tally t = {0, 0, 0, 0};
  uint64_t total = run(s, 0, &t); /* the allocations of a clean run */
  ck_assert_uint_gt(total, 0);
  ck_assert_uint_eq(t.failed_calls, 0);
  uint64_t live_b, live = kvp__fault_live(&live_b);
  ck_assert_msg(live == live0, "%s: clean run leaked %llu allocations", s->name, (unsigned long long)(live - live0));
  uint64_t leaks = 0;
  for (uint64_t k = 1; k <= total; k++) {
    uint64_t n = run(s, k, &t);
    t.runs++;
    live = kvp__fault_live(&live_b);
    if (live != live0) {
      leaks++;
      ck_abort_msg("%s k=%llu: %llu allocations (%llu bytes) left after destroy", s->name, (unsigned long long)k,
                   (unsigned long long)(live - live0), (unsigned long long)live_b);
    }
    if (n < k) break; /* the run took a path with fewer allocations: nothing to fail past it */
  }
  printf("fault %-20s %5llu allocations swept, %5llu calls failed, %3llu creates failed, %llu leaks\n", s->name,
         (unsigned long long)t.runs, (unsigned long long)t.failed_calls, (unsigned long long)t.create_failures,
         (unsigned long long)leaks);
}
END_TEST

/* ---- shared prefixes ---------------------------------------------------------
 * Seq 1 computes a prompt (its chunks enter the prefix table), seq 2
 * attaches them (chunk-level references) and appends, 3 forks from 2;
 * evictions over the shared chunks by the fork, the sequence that computed
 * them and the attached one (each turns its references into its own block
 * references first), reads, frees: every allocation of the run fails in
 * turn, as above. */
static uint64_t run_prefix(const char *codecs, uint64_t k, tally *t) {
  armed_k = k;
  seen = 0;
  failed_so_far = 0;
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.block_tokens = BT;
  c.region_bytes = 4ull << 20;
  c.codecs = codecs;
  kvp_pool *p = NULL;
  resume();
  int rc = kvp_pool_create(&c, &p);
  hold();
  if (rc) {
    ck_assert_msg(fault_failed_total() > 0, "create failed with no fault: %s", kvp_last_error());
    t->create_failures++;
    return seen;
  }
  resume();
  static uint32_t tok[24];
  for (uint32_t i = 0; i < 24; i++) tok[i] = i * 3 + 1;
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.tokens = tok, sc.n_tokens = 23;
  CALL(t, p, kvp_seq_add(p, 1, &sc));
  one_step(t, p, 1, 9, 0);
  one_step(t, p, 1, 14, 0); /* chunks 0..4 registered */
  CALL(t, p, kvp_seq_add(p, 2, &sc)); /* attaches 5 chunks (20 tokens) */
  one_step(t, p, 2, 3, 0);
  CALL(t, p, read_all(p, 2));
  CALL(t, p, kvp_seq_fork(p, 2, 3));
  one_step(t, p, 3, 2, 0);
  CALL(t, p, evict_if_retained(p, 3, 1, 1, 0));
  CALL(t, p, evict_if_retained(p, 1, 0, 0, 0));
  CALL(t, p, evict_if_retained(p, 2, 0, 1, 0));
  CALL(t, p, read_all(p, 3));
  CALL(t, p, kvp_seq_free(p, 1));
  CALL(t, p, kvp_seq_free(p, 2));
  CALL(t, p, read_all(p, 3));
  CALL(t, p, kvp_seq_free(p, 3));
  CALL(t, p, kvp_seq_add(p, 1, &sc));
  kvp_pool_destroy(p);
  hold();
  return seen;
}

static const char *const PREFIX_CODECS[] = {NULL, "k=nvfp4,v=int8"};

START_TEST(prefix_every_allocation_fails_in_turn) {
  for (size_t i = 0; i < sizeof KV / sizeof *KV; i++) KV[i] = (uint16_t)(0x3f00 + (i * 37) % 256);
  uint64_t live0 = kvp__fault_live(NULL), live_b;
  tally t = {0, 0, 0, 0};
  uint64_t total = run_prefix(PREFIX_CODECS[_i], 0, &t);
  ck_assert_uint_gt(total, 0);
  ck_assert_uint_eq(t.failed_calls, 0);
  for (uint64_t k = 1; k <= total; k++) {
    uint64_t n = run_prefix(PREFIX_CODECS[_i], k, &t);
    t.runs++;
    uint64_t live = kvp__fault_live(&live_b);
    ck_assert_msg(live == live0, "prefix k=%llu: %llu allocations (%llu bytes) left after destroy",
                  (unsigned long long)k, (unsigned long long)(live - live0), (unsigned long long)live_b);
    if (n < k) break;
  }
  printf("fault prefix %-14s %5llu allocations swept, %5llu calls failed\n",
         PREFIX_CODECS[_i] ? PREFIX_CODECS[_i] : "raw", (unsigned long long)t.runs, (unsigned long long)t.failed_calls);
  ck_assert_uint_gt(t.failed_calls, 0);
}
END_TEST

/* ---- an append whose pages fit only after its evictions ------------------
 * A budget the plan fills (heatkv: before-evictions) or not
 * (window: its evictions come after the layer is stored), blocks of one
 * step each, so every step's pages are a size class of their own: at the
 * target append the policy's evictions must make room before its pages fit
 * (checked against the bytes the same append takes without a budget), and
 * the new class then takes a new slab (a descriptor to allocate) after
 * those evictions. Every allocation of that one append fails in turn, on a
 * fresh pool each time: the append fails, the pool (ledger, tokens
 * retained and evicted, sequences, steps) is as before, kvp_check passes,
 * the same append made again succeeds, and nothing leaks. */
typedef struct room_case {
  const char *name;
  const char *codecs;   /* NULL: raw */
  const char *policy;
  kvp_seq_mode mode;
  uint32_t target_step; /* the step whose append of target_layer is swept */
  uint32_t target_layer;
  uint64_t budget;      /* pool budget */
} room_case;

static const uint32_t T_ROOM[] = {4, 8, 16, 24, 32, 48};
static const room_case ROOM[] = {
    {"heatkv", NULL, "heatkv:b=0.5:s=2:orders=synthetic", KVP_SEQ_STEP, 4, 0, 12288},
    {"heatkv-int8", "kv=int8", "heatkv:b=0.5:s=2:orders=synthetic", KVP_SEQ_STEP, 4, 0, 7168},
    /* row by row (pages/rowwise.c) */
    {"heatkv-kvquant", "kv=kvquant:calib_tokens=16", "heatkv:b=0.5:s=2:orders=synthetic", KVP_SEQ_STEP, 4, 0, 5568},
    {"heatkv-qvg", "kv=qvg:k=4:group=16", "heatkv:b=0.5:s=2:orders=synthetic", KVP_SEQ_STEP, 4, 0, 6336},
    {"window", NULL, "window:sink=4:recent=40", KVP_SEQ_STEP, 4, 0, 0},
};
#define NROOM (sizeof ROOM / sizeof *ROOM)

/* Steps [0, target) and the target step begun up to its target layer, with
 * no fault armed. */
static kvp_pool *room_pool(const room_case *rc) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.block_tokens = 64;
  c.region_bytes = 4ull << 20;
  c.budget_bytes = rc->budget;
  c.codecs = rc->codecs, c.policy = rc->policy;
  c.flags = KVP_POOL_ALLOW_EXPANSION;
  kvp_pool *p = NULL;
  ck_assert_msg(kvp_pool_create(&c, &p) == KVP_OK, "%s: %s", rc->name, kvp_last_error());
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = rc->mode;
  if (rc->mode == KVP_SEQ_STEP) sc.step_tokens = T_ROOM, sc.n_steps = 6;
  ck_assert_msg(kvp_seq_add(p, 1, &sc) == KVP_OK, "%s: %s", rc->name, kvp_last_error());
  for (uint32_t j = 0; j <= rc->target_step; j++) {
    ck_assert_msg(kvp_step_begin(p, 1, T_ROOM[j], 0) == KVP_OK, "%s: %s", rc->name, kvp_last_error());
    for (uint32_t l = 0; l < (j == rc->target_step ? rc->target_layer : L); l++)
      ck_assert_msg(kvp_append(p, 1, l, &(kvp_kv){KV, KV, NULL}) == KVP_OK, "%s step %u layer %u: %s", rc->name, j, l,
                    kvp_last_error());
    if (j == rc->target_step) break;
    ck_assert_msg(kvp_step_end(p, 1) == KVP_OK, "%s: %s", rc->name, kvp_last_error());
  }
  ck_assert_int_eq(kvp_reclaim(p), KVP_OK);
  return p;
}

/* Allocated bytes the target append takes, on a pool without a budget
 * (its evicted blocks wait in the limbo, still counted). */
static uint64_t room_need(const room_case *rc) {
  room_case twin = *rc;
  twin.budget = 0;
  kvp_pool *p = room_pool(&twin);
  fp before = fingerprint(p);
  ck_assert_int_eq(kvp_append(p, 1, rc->target_layer, &(kvp_kv){KV, KV, NULL}), KVP_OK);
  uint64_t need = fingerprint(p).alloc - before.alloc;
  kvp_pool_destroy(p);
  return need;
}

/* kvp_append of (seq 1, layer) with the k-th allocation failing (0: none):
 * its status, *failed the allocations that failed, err its message. */
static int armed_append(kvp_pool *p, uint32_t layer, const void *k, const void *v, uint64_t at, uint64_t *failed,
                        char err[512]) {
  kvp__fault_arm(at, false);
  int rc = kvp_append(p, 1, layer, &(kvp_kv){k, v, NULL});
  *failed = kvp__fault_failed();
  kvp__fault_arm(0, false);
  snprintf(err, 512, "%s", kvp_last_error());
  return rc;
}

START_TEST(append_needing_room_fails_whole) {
  const room_case *rc = &ROOM[_i];
  for (size_t i = 0; i < sizeof KV / sizeof *KV; i++) KV[i] = (uint16_t)(0x3f00 + (i * 37) % 256);
  kvp__fault_arm(0, false);
  uint64_t live0 = kvp__fault_live(NULL), nfailed = 0, need = room_need(rc), nslab = 0;
  bool done = false;
  for (uint64_t k = 1; !done; k++) {
    kvp__fault_arm(0, false);
    kvp_pool *p = room_pool(rc);
    fp before = fingerprint(p);
    if (rc->budget) /* the precondition: the pages do not fit without the evictions */
      ck_assert_msg(before.alloc + need > rc->budget, "%s: %llu + %llu bytes fit the budget %llu without evicting",
                    rc->name, (unsigned long long)before.alloc, (unsigned long long)need,
                    (unsigned long long)rc->budget);
    uint64_t failed;
    char err[512];
    int rc_ = armed_append(p, rc->target_layer, KV, KV, k, &failed, err);
    if (rc_ == KVP_OK) {
      ck_assert_msg(failed == 0, "%s k=%llu: the append succeeded past a failed allocation", rc->name,
                    (unsigned long long)k);
      done = true;
    } else {
      nfailed++;
      nslab += strstr(err, "slab descriptor") != NULL; /* the new class's slab: taken after the evictions */
      ck_assert_msg(failed > 0, "%s k=%llu: the append failed with no fault: %s", rc->name, (unsigned long long)k, err);
      fp after = fingerprint(p);
      ck_assert_msg(memcmp(&before, &after, sizeof after) == 0,
                    "%s k=%llu: the failed append (%s) changed the pool: tokens %llu -> %llu, evicted %llu -> %llu, "
                    "allocated %llu -> %llu", rc->name, (unsigned long long)k, err, (unsigned long long)before.tokens,
                    (unsigned long long)after.tokens, (unsigned long long)before.evicted,
                    (unsigned long long)after.evicted, (unsigned long long)before.alloc,
                    (unsigned long long)after.alloc);
      ck_assert_msg(kvp_check(p) == KVP_OK, "%s k=%llu: %s", rc->name, (unsigned long long)k, kvp_last_error());
      ck_assert_msg(kvp_append(p, 1, rc->target_layer, &(kvp_kv){KV, KV, NULL}) == KVP_OK,
                    "%s k=%llu: the append again: %s", rc->name, (unsigned long long)k, kvp_last_error());
    }
    ck_assert_msg(kvp_check(p) == KVP_OK, "%s k=%llu: %s", rc->name, (unsigned long long)k, kvp_last_error());
    fp end = fingerprint(p);
    ck_assert_msg(end.evicted > before.evicted, "%s: the target append evicted nothing", rc->name);
    kvp_pool_destroy(p);
    ck_assert_msg(kvp__fault_live(NULL) == live0, "%s k=%llu: allocations left after destroy", rc->name,
                  (unsigned long long)k);
  }
  ck_assert_uint_gt(nfailed, 0);
  if (rc->budget) ck_assert_msg(nslab > 0, "%s: no failure after the evictions made room", rc->name);
  printf("fault room %-14s %3llu allocations of the append failed in turn\n", rc->name, (unsigned long long)nfailed);
}
END_TEST

/* ---- a region too full: new pages over the evicted ones ------------------
 * Every step is 8 tokens (block_tokens 8), so every block's pages are of
 * the same size classes; raw pages then fill every free slot and extent,
 * and every other raw page of 8 KiB (the region's largest slab class)
 * goes again (the budget, the region's, has room; the region only for
 * 8 KiB pages). The heatkv append's new pages fit only
 * in the slots its evictions free, once their bytes go back to the region,
 * so they lie over the evicted blocks' pages; qvg's encode allocates after
 * the pages are taken, so some failure comes while those pages are being
 * written. Every allocation of that append fails in turn, on a fresh pool
 * each time: the pool is as before, and what kvp_read gives back for every
 * (layer, head) is the same, bit for bit (the evicted pages' payload is
 * written back before they are theirs again). */
static const uint32_t T_EQ[] = {8, 8, 8, 8, 8, 8};
enum { REGION_STEP = 3 };

static kvp_pool *full_region_pool(const char *codecs, uint32_t flags) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.block_tokens = 8;
  c.region_bytes = 2ull << 20;
  c.codecs = codecs, c.policy = "heatkv:b=0.5:s=2:orders=synthetic";
  c.flags = KVP_POOL_ALLOW_EXPANSION | flags;
  kvp_pool *p = NULL;
  ck_assert_msg(kvp_pool_create(&c, &p) == KVP_OK, "%s", kvp_last_error());
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP, sc.step_tokens = T_EQ, sc.n_steps = 6;
  ck_assert_msg(kvp_seq_add(p, 1, &sc) == KVP_OK, "%s", kvp_last_error());
  for (uint32_t j = 0; j <= REGION_STEP; j++) {
    ck_assert_msg(kvp_step_begin(p, 1, T_EQ[j], 0) == KVP_OK, "%s", kvp_last_error());
    if (j == REGION_STEP) break;
    for (uint32_t l = 0; l < L; l++)
      ck_assert_msg(kvp_append(p, 1, l, &(kvp_kv){KV, KV, NULL}) == KVP_OK, "step %u layer %u: %s", j, l,
                    kvp_last_error());
    ck_assert_msg(kvp_step_end(p, 1) == KVP_OK, "%s", kvp_last_error());
  }
  ck_assert_int_eq(kvp_reclaim(p), KVP_OK);
  kvp_page_tag tag = {.seq = 99, .type = KVP_PAGE_RAW};
  static kvp_page_id big[512];
  uint32_t nbig = 0;
  while (nbig < 512 && kvp_page_alloc(p, 8192, &tag, &big[nbig]) == KVP_OK) nbig++; /* 8 to a slab */
  kvp_page_id id;
  /* every slot of every class, the largest first (their slabs too): 64 B apart in (4, 8] KiB, 32 in (2, 4],
   * 16 up to 2 KiB, and the 8 B class last, whose 4 KiB slabs take what is left of the region */
  for (uint64_t size = 8192; size >= 8; size = size > 4096 ? size - 64 : size > 2048 ? size - 32 : size > 16 ? size - 16 : size - 8)
    while (kvp_page_alloc(p, size, &tag, &id) == KVP_OK) {
    }
  ck_assert_uint_gt(nbig, 8);
  for (uint32_t i = 0; i < nbig; i += 2) /* budget room, and region room for 8 KiB pages only: no slab empties */
    ck_assert_int_eq(kvp_page_free(p, big[i]), KVP_OK);
  return p;
}

/* Every (layer, head)'s retained tokens as kvp_read gives them. */
typedef struct readback {
  uint16_t kv[L][H][2][4 * MAXTOK * D];
  uint32_t pos[L][H][4 * MAXTOK], n[L][H];
} readback;
static void read_back(kvp_pool *p, readback *rb) {
  memset(rb, 0, sizeof *rb);
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req r = {sizeof r, h, KVP_DTYPE_BF16, rb->kv[l][h][0], rb->kv[l][h][1], rb->pos[l][h], 4 * MAXTOK, 0, NULL};
      ck_assert_msg(kvp_read(p, 1, l, &r) == KVP_OK, "%s", kvp_last_error());
      rb->n[l][h] = r.n_tokens;
    }
}

START_TEST(append_over_evicted_pages_fails_whole) {
  static readback before_rb, after_rb;
  for (size_t i = 0; i < sizeof KV / sizeof *KV; i++) KV[i] = (uint16_t)(0x3f00 + (i * 37) % 256);
  kvp__fault_arm(0, false);
  uint64_t live0 = kvp__fault_live(NULL), nfailed = 0, nwrite = 0;
  bool done = false;
  for (uint64_t k = 1; !done; k++) {
    kvp__fault_arm(0, false);
    kvp_pool *p = full_region_pool("kv=qvg:k=4:group=16", 0);
    kvp_page_tag tag = {.seq = 99, .type = KVP_PAGE_RAW};
    kvp_page_id id;
    ck_assert_int_eq(kvp_page_alloc(p, 64, &tag, &id), KVP_ENOSPC); /* the region is full */
    fp before = fingerprint(p);
    read_back(p, &before_rb);
    uint64_t failed;
    char err[512];
    int rc = armed_append(p, 0, KV, KV, k, &failed, err);
    if (rc == KVP_OK) {
      ck_assert_msg(failed == 0, "k=%llu: the append succeeded past a failed allocation", (unsigned long long)k);
      done = true;
    } else {
      nfailed++;
      nwrite += strstr(err, "failed to encode") != NULL; /* while writing over the evicted pages */
      ck_assert_msg(failed > 0, "k=%llu: the append failed with no fault: %s", (unsigned long long)k, err);
      fp after = fingerprint(p);
      ck_assert_msg(memcmp(&before, &after, sizeof after) == 0,
                    "k=%llu: the failed append (%s) changed the pool: tokens %llu -> %llu, allocated %llu -> %llu",
                    (unsigned long long)k, err, (unsigned long long)before.tokens, (unsigned long long)after.tokens,
                    (unsigned long long)before.alloc, (unsigned long long)after.alloc);
      ck_assert_msg(kvp_check(p) == KVP_OK, "k=%llu: %s", (unsigned long long)k, kvp_last_error());
      read_back(p, &after_rb);
      ck_assert_msg(memcmp(&before_rb, &after_rb, sizeof after_rb) == 0, "k=%llu: the failed append (%s) changed "
                    "what a read gives back", (unsigned long long)k, err);
      ck_assert_msg(kvp_append(p, 1, 0, &(kvp_kv){KV, KV, NULL}) == KVP_OK, "k=%llu: the append again: %s",
                    (unsigned long long)k, kvp_last_error());
    }
    fp end = fingerprint(p);
    ck_assert_msg(end.evicted > before.evicted, "the append evicted nothing");
    ck_assert_msg(kvp_check(p) == KVP_OK, "k=%llu: %s", (unsigned long long)k, kvp_last_error());
    kvp_pool_destroy(p);
    ck_assert_msg(kvp__fault_live(NULL) == live0, "k=%llu: allocations left after destroy", (unsigned long long)k);
  }
  ck_assert_uint_gt(nwrite, 0);
  printf("fault region full: %llu allocations of the append failed in turn, %llu while writing\n",
         (unsigned long long)nfailed, (unsigned long long)nwrite);
}
END_TEST

/* ---- the fresh-block path over evicted pages --------------------------------
 * The same full region with raw pages: the step's append takes the
 * fresh-block path (pages/stream.c: append_fresh), whose screen runs on the
 * copy, after the pages are taken and the evictions that made room for
 * them applied, so a bad value is found midway, with the new pages lying
 * over the evicted ones and partly written. _i = 0: a NaN in the last value
 * the copy sees (V, last token, last head, last channel) and in K's first:
 * refused (KVP_EINVAL naming it), the pool as before and every read the
 * same bit for bit; the clean append then succeeds. _i = 1: a sanitizing
 * pool, the same NaN, and every allocation of the append failing in turn
 * (its sanitized copy's among them, taken after the pages): each failure
 * changes nothing; the append that gets through stores the NaN as 0. */
START_TEST(fresh_append_over_evicted_pages_fails_whole) {
  static readback before_rb, after_rb;
  static uint16_t bad[MAXTOK * H * D];
  for (size_t i = 0; i < sizeof KV / sizeof *KV; i++) KV[i] = (uint16_t)(0x3f00 + (i * 37) % 256);
  memcpy(bad, KV, sizeof bad);
  size_t last = (size_t)T_EQ[REGION_STEP] * H * D - 1;
  bad[last] = 0x7FC0; /* bf16 NaN */
  if (_i) bad[last - D] = 0x7FC0; /* and in head 0's (one of the two heads may not be stored) */
  kvp__fault_arm(0, false);
  uint64_t live0 = kvp__fault_live(NULL), nfailed = 0, nscratch = 0, nstored = 0;
  bool done = false;
  for (uint64_t k = _i ? 1 : 0; !done; k++) {
    kvp__fault_arm(0, false);
    kvp_pool *p = full_region_pool(NULL, _i ? KVP_POOL_SANITIZE : 0);
    kvp_page_tag tag = {.seq = 99, .type = KVP_PAGE_RAW};
    kvp_page_id id;
    ck_assert_int_eq(kvp_page_alloc(p, 64, &tag, &id), KVP_ENOSPC); /* the region is full */
    fp before = fingerprint(p);
    read_back(p, &before_rb);
    if (!_i) {
      ck_assert_int_eq(kvp_append(p, 1, 0, &(kvp_kv){KV, bad, NULL}), KVP_EINVAL);
      ck_assert_msg(strstr(kvp_last_error(), "V of layer 0 has NaN at head 1, token 7 (of the step), channel 15"),
                    "%s", kvp_last_error());
      bad[0] = 0x7F80; /* +Inf in K's first value, the NaN still in V's last: K's is named */
      ck_assert_int_eq(kvp_append(p, 1, 0, &(kvp_kv){bad, bad, NULL}), KVP_EINVAL);
      ck_assert_msg(strstr(kvp_last_error(), "K of layer 0 has +Inf at head 0, token 0 (of the step), channel 0"),
                    "%s", kvp_last_error());
      bad[0] = KV[0];
      fp after = fingerprint(p);
      ck_assert(memcmp(&before, &after, sizeof after) == 0);
      ck_assert_int_eq(kvp_check(p), KVP_OK);
      read_back(p, &after_rb);
      ck_assert_msg(memcmp(&before_rb, &after_rb, sizeof after_rb) == 0, "the refused append changed a read");
      ck_assert_msg(kvp_append(p, 1, 0, &(kvp_kv){KV, KV, NULL}) == KVP_OK, "%s", kvp_last_error());
      done = true;
    } else {
      uint64_t failed;
      char err[512];
      int rc = armed_append(p, 0, KV, bad, k, &failed, err);
      if (rc == KVP_OK) {
        ck_assert_msg(failed == 0, "k=%llu: the append succeeded past a failed allocation", (unsigned long long)k);
        done = true;
      } else {
        nfailed++;
        nscratch += strstr(err, "scratch to sanitize") != NULL; /* after the pages were taken */
        ck_assert_msg(failed > 0, "k=%llu: the append failed with no fault: %s", (unsigned long long)k, err);
        fp after = fingerprint(p);
        ck_assert_msg(memcmp(&before, &after, sizeof after) == 0, "k=%llu: the failed append (%s) changed the pool",
                      (unsigned long long)k, err);
        ck_assert_msg(kvp_check(p) == KVP_OK, "k=%llu: %s", (unsigned long long)k, kvp_last_error());
        read_back(p, &after_rb);
        ck_assert_msg(memcmp(&before_rb, &after_rb, sizeof after_rb) == 0, "k=%llu: the failed append (%s) changed "
                      "what a read gives back", (unsigned long long)k, err);
        ck_assert_msg(kvp_append(p, 1, 0, &(kvp_kv){KV, bad, NULL}) == KVP_OK, "k=%llu: the append again: %s",
                      (unsigned long long)k, kvp_last_error());
      }
      static uint16_t vo[4 * MAXTOK * D];
      static uint32_t pos[4 * MAXTOK];
      for (uint32_t h = 0; h < H; h++) {
        kvp_read_req r = {sizeof r, h, KVP_DTYPE_BF16, NULL, vo, pos, 4 * MAXTOK, 0, NULL};
        ck_assert_msg(kvp_read(p, 1, 0, &r) == KVP_OK, "%s", kvp_last_error());
        ck_assert_uint_gt(r.n_tokens, 0);
        if (pos[r.n_tokens - 1] == before.positions[1] + T_EQ[REGION_STEP] - 1) { /* the head stored the step */
          nstored++;
          ck_assert_uint_eq(vo[(size_t)(r.n_tokens - 1) * D + D - 1], 0); /* the NaN, sanitized */
          ck_assert_uint_eq(vo[(size_t)(r.n_tokens - 1) * D + D - 2], KV[last - (H - 1 - h) * D - 1]);
        }
      }
    }
    fp end = fingerprint(p);
    ck_assert_msg(end.evicted > before.evicted, "the append evicted nothing");
    ck_assert_msg(kvp_check(p) == KVP_OK, "k=%llu: %s", (unsigned long long)k, kvp_last_error());
    kvp_pool_destroy(p);
    ck_assert_msg(kvp__fault_live(NULL) == live0, "k=%llu: allocations left after destroy", (unsigned long long)k);
  }
  if (_i) {
    ck_assert_uint_gt(nscratch, 0);
    ck_assert_uint_gt(nstored, 0);
    printf("fault fresh append, sanitizing: %llu allocations of the append failed in turn, %llu after its pages\n",
           (unsigned long long)nfailed, (unsigned long long)nscratch);
  }
}
END_TEST

/* ---- kvquant calibration -------------------------------------------------
 * kvp_kvquant_calib_*: create, add every head (some weighted) or synthetic
 * on 3 workers (where a worker thread that cannot start counts as an
 * allocation: its share goes to the others), then write; every allocation
 * fails in turn. A failed call returns KVP_ENOMEM and changes nothing: made
 * again without the fault it succeeds, and the file is the one a run
 * without any fault writes; nothing is left after destroy. */
enum { CL = 2, CH = 2, CD = 24, CT = 1400 }; /* CT rows: the sampled thresholds, not only the heaps */

static int calib_call(int rc, tally *t) { /* a failed call: out of memory, injected; then again */
  if (rc == KVP_OK) return 0;
  ck_assert_msg(rc == KVP_ENOMEM && fault_failed_total() > 0, "%s: %s", kvp_err_name(rc), kvp_last_error());
  t->failed_calls++;
  return 1;
}

static uint64_t run_calib(int synthetic, uint64_t k, const char *path, tally *t) {
  armed_k = k;
  seen = 0;
  failed_so_far = 0;
  kvp_kvquant_calib *c = NULL;
  resume();
  int rc = kvp_kvquant_calib_create(CL, CH, CD, 3, 0.02, &c);
  hold();
  if (calib_call(rc, t)) {
    ck_assert_ptr_null(c);
    t->create_failures++;
    return seen;
  }
  if (synthetic) {
    ck_ok(kvp_kvquant_calib_set_threads(c, 3));
    resume();
    rc = kvp_kvquant_calib_synthetic(c, 9, 2, CT / 2);
    hold();
    if (calib_call(rc, t)) ck_ok(kvp_kvquant_calib_synthetic(c, 9, 2, CT / 2)); /* nothing was fitted */
  } else {
    static float x[CT * CD], w[CT * CD];
    for (uint32_t l = 0; l < CL; l++)
      for (uint32_t h = 0; h < CH; h++)
        for (uint32_t kv = 0; kv < 2; kv++) {
          for (uint32_t i = 0; i < CT * CD; i++) {
            x[i] = (float)((i * 2654435761u + l * 97 + h * 31 + kv * 7) % 1000) * 0.01f - 5.0f;
            w[i] = (float)(i % 3);
          }
          const float *wp = h ? w : NULL;
          resume();
          rc = kvp_kvquant_calib_add(c, l, h, kv, x, wp, CD, CT);
          hold();
          if (calib_call(rc, t)) ck_ok(kvp_kvquant_calib_add(c, l, h, kv, x, wp, CD, CT));
        }
  }
  resume();
  rc = kvp_kvquant_calib_write(c, path);
  hold();
  if (calib_call(rc, t)) ck_ok(kvp_kvquant_calib_write(c, path));
  kvp_kvquant_calib_destroy(c);
  return seen;
}

static size_t slurp(const char *path, uint8_t *buf, size_t cap) {
  FILE *f = fopen(path, "rb");
  ck_assert_ptr_nonnull(f);
  size_t n = fread(buf, 1, cap, f);
  fclose(f);
  return n;
}

START_TEST(calib_every_allocation_fails_in_turn) {
  char path[] = "/tmp/kvq_faultXXXXXX";
  int fd = mkstemp(path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  static uint8_t want[1 << 16], got[1 << 16];
  uint64_t live0 = kvp__fault_live(NULL), live_b;
  tally t = {0, 0, 0, 0};
  uint64_t total = run_calib(_i, 0, path, &t);
  size_t n = slurp(path, want, sizeof want);
  ck_assert_uint_gt(total, 0);
  for (uint64_t k = 1; k <= total; k++) {
    uint64_t nk = run_calib(_i, k, path, &t);
    t.runs++;
    uint64_t live = kvp__fault_live(&live_b);
    ck_assert_msg(live == live0, "calibration k=%llu: %llu allocations (%llu bytes) left after destroy",
                  (unsigned long long)k, (unsigned long long)(live - live0), (unsigned long long)live_b);
    if (t.create_failures == 0) { /* the file of a run that got through: the same bytes */
      ck_assert_uint_eq(slurp(path, got, sizeof got), n);
      ck_assert_mem_eq(got, want, n);
    }
    t.create_failures = 0;
    if (nk < k) break;
  }
  printf("fault calibration %-10s %5llu allocations swept, %5llu calls failed\n", _i ? "synthetic" : "add",
         (unsigned long long)t.runs, (unsigned long long)t.failed_calls);
  ck_assert_uint_gt(t.failed_calls, 0);
  unlink(path);
}
END_TEST

int main(void) {
  Suite *s = suite_create("fault");
  TCase *tc = tcase_create("sweep");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, every_allocation_fails_in_turn, 0, NSCEN);
  tcase_add_loop_test(tc, prefix_every_allocation_fails_in_turn, 0, 2);
  tcase_add_loop_test(tc, calib_every_allocation_fails_in_turn, 0, 2);
  suite_add_tcase(s, tc);
  TCase *room = tcase_create("room");
  tcase_set_timeout(room, 60);
  tcase_add_loop_test(room, append_needing_room_fails_whole, 0, NROOM);
  tcase_add_test(room, append_over_evicted_pages_fails_whole);
  tcase_add_loop_test(room, fresh_append_over_evicted_pages_fails_whole, 0, 2);
  suite_add_tcase(s, room);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int nf = srunner_ntests_failed(sr);
  srunner_free(sr);
  return nf ? 1 : 0;
}
