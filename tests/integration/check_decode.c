/*
 * tests/integration/check_decode.c - the decode append through the public
 * header: steps whose tokens fill the OPEN tails with room left, fill one
 * exactly (it seals), start a new block or cross into one, in every source
 * dtype (K and V apart), with head_dim even and odd, and with more heads
 * than one batch of the append's copy. After every call kvp_check passes
 * and the ledger is what the blocks say (pages and requested bytes per
 * block, allocations only when a block starts); reads give back every
 * value. A NaN or Inf anywhere (the last element of the last head's row
 * included) is refused with the message naming it and changes nothing
 * (every stats figure, the reads); a sanitizing pool stores it replaced.
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

enum { L = 2, BT = 8, MAXH = 70, MAXD = 128, MAXN = 8, MAXPOS = 64 };

#include "rowvals.h"

static unsigned char KB[MAXN * MAXH * MAXD * 4], VB[MAXN * MAXH * MAXD * 4];

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

/* Every figure equal but device.used_bytes (the resident bytes of the region:
 * the operating system's, not the ledger's). */
static void same_stats(const kvp_stats *a, const kvp_stats *b) {
#define SAME_GAUGE(f)                                                                                    \
  ck_assert_msg(a->f.current == b->f.current && a->f.peak == b->f.peak && a->f.total == b->f.total,      \
                #f " changed: %llu -> %llu", (unsigned long long)a->f.current, (unsigned long long)b->f.current);
#define SAME_COUNTER(f) ck_assert_msg(a->f == b->f, #f " changed");
#define SAME_VALUE(f) ck_assert_msg(a->f == b->f || !strcmp(#f, "device_used_bytes"), #f " changed");
#define SAME(kind, f, key, help) SAME_##kind(f)
  KVP_STATS_LIST(SAME)
#undef SAME
  ck_assert(memcmp(a->page_types, b->page_types, sizeof a->page_types) == 0);
  ck_assert(memcmp(a->kv, b->kv, sizeof a->kv) == 0);
}

/* Every retained value of seq (positions [0, npos) in each head of layer l,
 * or of every layer), read back as fp32: val's, but o->x at o's (layer,
 * head, position, channel, side) when o is given. */
typedef struct over {
  uint32_t l, h, pos, d;
  int kv;
  float x;
} over;
static void verify_layer(kvp_pool *p, const geo *g, uint64_t seq, uint32_t l, uint32_t npos, const over *o) {
  static float ko[MAXPOS * MAXD], vo[MAXPOS * MAXD];
  static uint32_t pos[MAXPOS];
  for (uint32_t h = 0; h < g->H; h++) {
    kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, ko, vo, pos, MAXPOS, 0, NULL};
    ck_ok(kvp_read(p, seq, l, &q));
    ck_assert_uint_eq(q.n_tokens, npos);
    for (uint32_t t = 0; t < npos; t++) {
      ck_assert_uint_eq(pos[t], t);
      for (uint32_t d = 0; d < g->D; d++)
        for (int kv = 0; kv < 2; kv++) {
          float want = val(seq, l, h, t, d, kv), got = (kv ? vo : ko)[t * g->D + d];
          if (o && o->l == l && o->h == h && o->pos == t && o->d == d && o->kv == kv) want = o->x;
          ck_assert_msg(got == want, "seq %llu layer %u head %u pos %u ch %u %c: %g, expected %g",
                        (unsigned long long)seq, l, h, t, d, "KV"[kv], got, want);
        }
    }
  }
}
static void verify(kvp_pool *p, const geo *g, uint64_t seq, uint32_t npos, const over *o) {
  for (uint32_t l = 0; l < L; l++) verify_layer(p, g, seq, l, npos, o);
}

/* What the ledger must say when seq holds npos positions (raw pages, OPEN
 * blocks at full capacity): pages and requested bytes per block, tokens. */
static void ledger_is(kvp_pool *p, const geo *g, uint32_t npos) {
  kvp_stats s = rv_stats(p);
  uint64_t nblocks = (uint64_t)L * g->H * ((npos + BT - 1) / BT);
  ck_assert_uint_eq(s.pages.current, 2 * nblocks);
  ck_assert_uint_eq(s.bytes_requested.current, nblocks * BT * g->D * (wbytes(g->k) + wbytes(g->v)));
  ck_assert_uint_eq(s.tokens_retained.current, (uint64_t)L * g->H * npos);
  ck_assert_uint_eq(s.bf16_equivalent_bytes.current, (uint64_t)L * g->H * npos * g->D * 4);
}

/* One step of n tokens at pos0, every layer; the ledger checked as it goes. */
static void step(kvp_pool *p, const geo *g, uint64_t seq, uint32_t pos0, uint32_t n) {
  ck_ok(kvp_step_begin(p, seq, n, 0)); /* may grow the step table (metadata) */
  kvp_stats before = rv_stats(p);
  for (uint32_t l = 0; l < L; l++) {
    fill(g, seq, l, pos0, n);
    kvp_kv kv = {KB, VB, NULL};
    ck_ok(kvp_append(p, seq, l, &kv));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_step_end(p, seq));
  ledger_is(p, g, pos0 + n);
  kvp_stats after = rv_stats(p);
  bool opens = pos0 % BT == 0 || (pos0 + n - 1) / BT != pos0 / BT; /* a block starts in the step */
  if (!opens) { /* the tails took it: no page, no byte, no allocation */
    ck_assert_uint_eq(after.allocs, before.allocs);
    ck_assert_uint_eq(after.bytes_allocated.current, before.bytes_allocated.current);
    ck_assert_uint_eq(after.metadata_bytes.current, before.metadata_bytes.current);
  } else {
    ck_assert_uint_gt(after.allocs, before.allocs);
  }
}

/* Steps of 1, 2, 3 and 5 tokens: tails filled with room, filled exactly by
 * one token and by several, blocks started, a step crossing into a new
 * block; then the same positions in one step on a second pool: the same
 * ledger, the same values. */
static const uint32_t SCHEDULE[] = {5, 1, 1, 3, 1, 1, 1, 1, 1, 1, 2, 5, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1};

START_TEST(decode_steps_fill_seal_and_open) {
  const geo *g = &GEOS[_i];
  kvp_pool *p = rv_pool(g, 0, NULL, 0, 32ull << 20);
  ck_ok(kvp_seq_add(p, 1, NULL));
  uint32_t pos = 0;
  for (size_t i = 0; i < sizeof SCHEDULE / sizeof *SCHEDULE; i++) {
    step(p, g, 1, pos, SCHEDULE[i]);
    pos += SCHEDULE[i];
    if (i % 5 == 0) verify(p, g, 1, pos, NULL);
  }
  ck_assert_uint_eq(pos, 35);
  verify(p, g, 1, pos, NULL);
  kvp_pool *q = rv_pool(g, 0, NULL, 0, 32ull << 20);
  ck_ok(kvp_seq_add(q, 1, NULL));
  step(q, g, 1, 0, pos);
  verify(q, g, 1, pos, NULL);
  kvp_stats a = rv_stats(p), b = rv_stats(q);
  ck_assert_uint_eq(a.bytes_requested.current, b.bytes_requested.current);
  ck_assert_uint_eq(a.bytes_allocated.current, b.bytes_allocated.current);
  ck_assert_uint_eq(a.pages.current, b.pages.current);
  ck_assert_uint_eq(a.tokens_retained.current, b.tokens_retained.current);
  ck_assert_uint_eq(a.bf16_equivalent_bytes.current, b.bf16_equivalent_bytes.current);
  ck_assert(memcmp(a.page_types, b.page_types, sizeof a.page_types) == 0);
  ck_assert(memcmp(a.kv, b.kv, sizeof a.kv) == 0);
  kvp_pool_destroy(q);
  kvp_pool_destroy(p);
}
END_TEST

/* A non-finite value (kind: NaN, +Inf, -Inf) at token t, head h, channel d
 * of side kv, in one step of n tokens at pos0 on layer 1 (layer 0 stored
 * first): refused, the message naming it, nothing changed; then the same
 * step without it is stored. */
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
  kvp_stats before = rv_stats(p);
  ck_status(kvp_append(p, 1, 1, &ok), KVP_EINVAL);
  char want[160];
  snprintf(want, sizeof want, "%c of layer 1 has %s at head %u, token %u (of the step), channel %u", "KV"[kv],
           names[kind], h, t, d);
  ck_msg(want);
  kvp_stats after = rv_stats(p);
  same_stats(&before, &after);
  ck_ok(kvp_check(p));
  ck_status(kvp_step_end(p, 1), KVP_EINVAL); /* layer 1 is still to come */
  verify_layer(p, g, 1, 1, pos0, NULL);       /* layer 1: nothing new; layer 0: the step */
  verify_layer(p, g, 1, 0, pos0 + n, NULL);
  fill(g, 1, 1, pos0, n);
  ck_ok(kvp_append(p, 1, 1, &ok));
  ck_ok(kvp_step_end(p, 1));
  ck_ok(kvp_check(p));
  ledger_is(p, g, pos0 + n);
  verify(p, g, 1, pos0 + n, NULL);
}

/* The NaN or Inf in the last element of the last head's last row (the last
 * value the copy sees), in the first, and in between, on K and on V, in a
 * token that fills with room (6), fills its block exactly (7), starts one
 * (8), and in steps of 2 and 3 tokens (filling exactly, crossing). */
START_TEST(nonfinite_refused_changes_nothing) {
  const geo *g = &GEOS[_i];
  kvp_pool *p = rv_pool(g, 0, NULL, 0, 32ull << 20);
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, g, 1, 0, 5);
  uint32_t pos = 5, H = g->H, D = g->D;
  int kind = 0;
  for (int kv = 0; kv < 2; kv++) {
    refuse_one(p, g, pos, 1, kv, 0, H - 1, D - 1, kind++ % 3), pos += 1; /* 6: room left */
    refuse_one(p, g, pos, 1, kv, 0, 0, 0, kind++ % 3), pos += 1;         /* 7: fills the block */
    refuse_one(p, g, pos, 1, kv, 0, H - 1, D - 1, kind++ % 3), pos += 1; /* 8: a new block */
    refuse_one(p, g, pos, 1, kv, 0, H / 2, D / 2, kind++ % 3), pos += 1;
  }
  ck_assert_uint_eq(pos, 13);
  refuse_one(p, g, pos, 3, 1, 2, H - 1, D - 1, 0), pos += 3; /* 16: fills the block exactly, 3 tokens */
  refuse_one(p, g, pos, 2, 0, 1, H - 1, D - 1, 1), pos += 2; /* 18: a new block */
  refuse_one(p, g, pos, 2, 1, 1, H - 1, D - 1, 2), pos += 2; /* 20: room left */
  refuse_one(p, g, pos, 5, 0, 4, H - 1, D - 1, 0), pos += 5; /* 25: crossing into a new block */
  kvp_pool_destroy(p);
}
END_TEST

/* A sanitizing pool stores the decode token's NaN as 0 and its +-Inf as the
 * largest finite value, the last element of the last head's row included. */
START_TEST(sanitize_on_decode) {
  const geo *g = &GEOS[_i];
  kvp_pool *p = rv_pool(g, KVP_POOL_SANITIZE, NULL, 0, 32ull << 20);
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, g, 1, 0, 5);
  uint32_t H = g->H, D = g->D;
  ck_ok(kvp_step_begin(p, 1, 1, 0));
  for (uint32_t l = 0; l < L; l++) {
    fill(g, 1, l, 5, 1);
    uint32_t nan = g->v == KVP_DTYPE_F32 ? 0x7FC00000u : g->v == KVP_DTYPE_BF16 ? 0x7FC0u : 0x7E00u;
    if (l == 1) put(VB, (size_t)(H - 1) * D + D - 1, g->v, nan);
    kvp_kv kv = {KB, VB, NULL};
    ck_ok(kvp_append(p, 1, l, &kv));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_step_end(p, 1));
  over o = {1, H - 1, 5, D - 1, 1, 0.0f};
  verify(p, g, 1, 6, &o);
  ck_ok(kvp_step_begin(p, 1, 1, 0));
  for (uint32_t l = 0; l < L; l++) {
    fill(g, 1, l, 6, 1);
    uint32_t ninf = g->k == KVP_DTYPE_F32 ? 0xFF800000u : g->k == KVP_DTYPE_BF16 ? 0xFF80u : 0xFC00u;
    if (l == 0) put(KB, (size_t)(H - 1) * D + D - 1, g->k, ninf);
    kvp_kv kv = {KB, VB, NULL};
    ck_ok(kvp_append(p, 1, l, &kv));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_step_end(p, 1));
  uint32_t mb = 0xFF7F0000u; /* -(the largest bf16) in fp32 bits */
  float most_bf16;
  memcpy(&most_bf16, &mb, 4);
  float most = g->k == KVP_DTYPE_F32 ? -FLT_MAX : g->k == KVP_DTYPE_BF16 ? most_bf16 : -65504.0f;
  static float ko[MAXPOS * MAXD];
  kvp_read_req q = {sizeof q, H - 1, KVP_DTYPE_F32, ko, NULL, NULL, MAXPOS, 0, NULL};
  ck_ok(kvp_read(p, 1, 0, &q));
  ck_assert_uint_eq(q.n_tokens, 7);
  ck_assert_msg(ko[6 * D + D - 1] == most, "-Inf became %g", ko[6 * D + D - 1]);
  ck_assert(ko[6 * D + D - 2] == val(1, 0, H - 1, 6, D - 2, 0)); /* the rest as given */
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

/* A fork copies the OPEN tails: parent and child then decode into their own
 * tails, each reading back its own values (the child's differ from the fork
 * position on). */
START_TEST(fork_then_decode_apart) {
  const geo *g = &GEOS[_i];
  kvp_pool *p = rv_pool(g, 0, NULL, 0, 32ull << 20);
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, g, 1, 0, 6);
  ck_ok(kvp_seq_fork(p, 1, 2));
  ck_ok(kvp_check(p));
  for (uint32_t pos = 6; pos < 12; pos++)
    for (uint64_t seq = 1; seq <= 2; seq++) {
      ck_ok(kvp_step_begin(p, seq, 1, 0));
      for (uint32_t l = 0; l < L; l++) {
        fill(g, seq, l, pos, 1);
        kvp_kv kv = {KB, VB, NULL};
        ck_ok(kvp_append(p, seq, l, &kv));
        ck_ok(kvp_check(p));
      }
      ck_ok(kvp_step_end(p, seq));
    }
  verify(p, g, 1, 12, NULL);
  static float ko[MAXPOS * MAXD], vo[MAXPOS * MAXD];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < g->H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, ko, vo, NULL, MAXPOS, 0, NULL};
      ck_ok(kvp_read(p, 2, l, &q));
      ck_assert_uint_eq(q.n_tokens, 12);
      for (uint32_t t = 0; t < 12; t++)
        for (uint32_t d = 0; d < g->D; d++) {
          uint64_t owner = t < 6 ? 1 : 2;
          ck_assert(ko[t * g->D + d] == val(owner, l, h, t, d, 0));
          ck_assert(vo[t * g->D + d] == val(owner, l, h, t, d, 1));
        }
    }
  kvp_pool_destroy(p);
}
END_TEST

/* A decode token that fills its block seals it as it stands: a fork then
 * shares every block (no page copied), as after a step that ended on a
 * block boundary the general way; the next tokens open new blocks on both
 * sides. */
START_TEST(fork_after_exact_fill_shares) {
  const geo *g = &GEOS[_i];
  kvp_pool *p = rv_pool(g, 0, NULL, 0, 32ull << 20);
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, g, 1, 0, 5);
  step(p, g, 1, 5, 1);
  step(p, g, 1, 6, 1);
  step(p, g, 1, 7, 1); /* position 7 fills block 0 */
  kvp_stats a = rv_stats(p);
  ck_ok(kvp_seq_fork(p, 1, 2));
  ck_ok(kvp_check(p));
  kvp_stats b = rv_stats(p);
  ck_assert_uint_eq(b.pages.current, a.pages.current); /* shared, not copied */
  ck_assert_uint_eq(b.allocs, a.allocs);
  for (uint64_t seq = 1; seq <= 2; seq++) {
    ck_ok(kvp_step_begin(p, seq, 1, 0));
    for (uint32_t l = 0; l < L; l++) {
      fill(g, 1, l, 8, 1); /* the child's values as the parent's */
      kvp_kv kv = {KB, VB, NULL};
      ck_ok(kvp_append(p, seq, l, &kv));
      ck_ok(kvp_check(p));
    }
    ck_ok(kvp_step_end(p, seq));
  }
  kvp_stats c = rv_stats(p);
  ck_assert_uint_eq(c.pages.current, a.pages.current + 2 * 2 * (uint64_t)L * g->H); /* a new block each */
  verify(p, g, 1, 9, NULL);
  kvp_pool_destroy(p);
}
END_TEST

/* A policy with an append hook (window): decode tokens it evicts nothing
 * for take the tails like any other; once the window slides, its evictions
 * ride with the append (the transaction), and the reads keep the sink and
 * the recent tokens. */
START_TEST(decode_under_a_window) {
  const geo *g = &GEOS[0];
  kvp_pool *p = rv_pool(g, 0, "window:sink=2:recent=8", 0, 32ull << 20);
  ck_ok(kvp_seq_add(p, 1, NULL));
  uint32_t pos = 0;
  for (; pos < 30; pos++) {
    ck_ok(kvp_step_begin(p, 1, 1, 0));
    for (uint32_t l = 0; l < L; l++) {
      fill(g, 1, l, pos, 1);
      kvp_kv kv = {KB, VB, NULL};
      ck_ok(kvp_append(p, 1, l, &kv));
      ck_ok(kvp_check(p));
    }
    ck_ok(kvp_step_end(p, 1));
  }
  static float ko[MAXPOS * MAXD], vo[MAXPOS * MAXD];
  static uint32_t ps[MAXPOS];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < g->H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, ko, vo, ps, MAXPOS, 0, NULL};
      ck_ok(kvp_read(p, 1, l, &q));
      ck_assert_uint_ge(q.n_tokens, 2 + 8);
      ck_assert_uint_lt(q.n_tokens, 30);
      ck_assert_uint_eq(ps[0], 0);
      ck_assert_uint_eq(ps[1], 1);
      ck_assert_uint_eq(ps[q.n_tokens - 1], 29);
      for (uint32_t i = 0; i < q.n_tokens; i++)
        for (uint32_t d = 0; d < g->D; d++) {
          ck_assert(ko[i * g->D + d] == val(1, l, h, ps[i], d, 0));
          ck_assert(vo[i * g->D + d] == val(1, l, h, ps[i], d, 1));
        }
    }
  kvp_stats s = rv_stats(p);
  ck_assert_uint_gt(s.tokens_evicted, 0);
  kvp_pool_destroy(p);
}
END_TEST

/* A KVP_POOL_PREFAULT pool backs at create the raw block structs its region
 * can hold, up to 1/32 of the region's bytes (8 MiB: 2048 structs of 128
 * bytes), counted in metadata_bytes from then on. Decode tokens that open
 * blocks take them; freed sequences (after a reclaim) and a window's
 * evictions give them back; past the store the structs come from the
 * metadata arena. Sequences of 64 one-token steps, as many as half the
 * region holds (for two geometries more blocks than the store has), then
 * half of them freed and new ones decoded into the slots given back. Every
 * value reads back, kvp_check passes as it goes, and a pool without the
 * flag says the same. */
enum { PF_POS = 64, PF_MAXSEQS = 48 };
static void pf_decode(kvp_pool *p, const geo *g, uint64_t seq, uint32_t npos) {
  ck_ok(kvp_seq_add(p, seq, NULL));
  for (uint32_t pos = 0; pos < npos; pos++) {
    ck_ok(kvp_step_begin(p, seq, 1, 0));
    for (uint32_t l = 0; l < L; l++) {
      fill(g, seq, l, pos, 1);
      kvp_kv kv = {KB, VB, NULL};
      ck_ok(kvp_append(p, seq, l, &kv));
    }
    ck_ok(kvp_step_end(p, seq));
    if (pos % 8 == 0 || pos + 1 == npos) ck_ok(kvp_check(p));
  }
}

/* verify's answer, asserted once per (seq, layer, head): the sweep reads
 * too many values for an assertion each. */
static void pf_verify(kvp_pool *p, const geo *g, uint64_t seq, uint32_t npos) {
  static float ko[MAXPOS * MAXD], vo[MAXPOS * MAXD];
  static uint32_t pos[MAXPOS];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < g->H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, ko, vo, pos, MAXPOS, 0, NULL};
      ck_ok(kvp_read(p, seq, l, &q));
      uint32_t bad = 0;
      for (uint32_t t = 0; t < npos && t < q.n_tokens; t++)
        for (uint32_t d = 0; d < g->D; d++)
          bad += pos[t] != t || ko[t * g->D + d] != val(seq, l, h, t, d, 0) || vo[t * g->D + d] != val(seq, l, h, t, d, 1);
      ck_assert_msg(q.n_tokens == npos && !bad, "seq %llu layer %u head %u: %u tokens, %u wrong values",
                    (unsigned long long)seq, l, h, q.n_tokens, bad);
    }
}

START_TEST(prefault_block_store) {
  const geo *g = &GEOS[_i / 2];
  bool pf = _i % 2;
  uint64_t region = 8ull << 20, block = (uint64_t)BT * g->D * (wbytes(g->k) + wbytes(g->v)); /* requested, K + V */
  uint64_t per_seq = 2 * block * (PF_POS / BT) * L * g->H; /* allocated bytes of a sequence, at most */
  uint64_t nseq = region / 2 / per_seq < PF_MAXSEQS ? region / 2 / per_seq : PF_MAXSEQS;
  ck_assert_uint_ge(nseq, 2);
  kvp_pool *plain = rv_pool(g, 0, NULL, 0, region);
  kvp_pool *p = rv_pool(g, pf ? KVP_POOL_PREFAULT : 0, NULL, 0, region);
  kvp_stats s0 = rv_stats(plain), s1 = rv_stats(p);
  uint64_t slots = region / 32 / 128 < region / (2 * block) ? region / 32 / 128 : region / (2 * block);
  if (pf) ck_assert_uint_ge(s1.metadata_bytes.current, s0.metadata_bytes.current + slots * 128); /* the store */
  else ck_assert_uint_eq(s1.metadata_bytes.current, s0.metadata_bytes.current);
  kvp_pool_destroy(plain);
  for (uint64_t seq = 0; seq < nseq; seq++) pf_decode(p, g, seq, PF_POS);
  for (uint64_t seq = 0; seq < nseq; seq++) pf_verify(p, g, seq, PF_POS);
  for (uint64_t seq = 0; seq < nseq; seq += 2) ck_ok(kvp_seq_free(p, seq));
  ck_ok(kvp_reclaim(p));
  ck_ok(kvp_check(p));
  for (uint64_t seq = nseq; seq < nseq + (nseq + 1) / 2; seq++) pf_decode(p, g, seq, PF_POS);
  for (uint64_t seq = 1; seq < nseq + (nseq + 1) / 2; seq += seq < nseq ? 2 : 1) pf_verify(p, g, seq, PF_POS);
  /* nseq / 2 odd ones kept, (nseq + 1) / 2 new ones: nseq sequences */
  ck_assert_uint_eq(rv_stats(p).tokens_retained.current, nseq * PF_POS * L * g->H);
  kvp_pool_destroy(p);
}
END_TEST

/* The same stores under a window: its evictions free blocks and retire
 * brefs as the steps go; the slots they give back (the brefs' after a
 * reclaim) are taken again by later openings. */
START_TEST(prefault_store_under_a_window) {
  const geo *g = &GEOS[1];
  kvp_pool *p = rv_pool(g, KVP_POOL_PREFAULT, "window:sink=2:recent=8", 0, 8ull << 20);
  for (uint64_t seq = 0; seq < 4; seq++) pf_decode(p, g, seq, PF_POS);
  ck_ok(kvp_reclaim(p)); /* the brefs the evictions retired go back to the store */
  ck_ok(kvp_check(p));
  pf_decode(p, g, 4, PF_POS);
  static float ko[MAXPOS * MAXD], vo[MAXPOS * MAXD];
  static uint32_t ps[MAXPOS];
  for (uint64_t seq = 0; seq < 5; seq++)
    for (uint32_t l = 0; l < L; l++)
      for (uint32_t h = 0; h < g->H; h++) {
        kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, ko, vo, ps, MAXPOS, 0, NULL};
        ck_ok(kvp_read(p, seq, l, &q));
        ck_assert_uint_lt(q.n_tokens, PF_POS);
        ck_assert_uint_eq(ps[q.n_tokens - 1], PF_POS - 1);
        for (uint32_t i = 0; i < q.n_tokens; i++)
          for (uint32_t d = 0; d < g->D; d++) {
            ck_assert(ko[i * g->D + d] == val(seq, l, h, ps[i], d, 0));
            ck_assert(vo[i * g->D + d] == val(seq, l, h, ps[i], d, 1));
          }
      }
  ck_assert_uint_gt(rv_stats(p).tokens_evicted, 0);
  kvp_pool_destroy(p);
}
END_TEST

int main(void) {
  Suite *s = suite_create("decode");
  TCase *tc = tcase_create("decode");
  tcase_add_loop_test(tc, decode_steps_fill_seal_and_open, 0, NGEOS);
  tcase_add_loop_test(tc, nonfinite_refused_changes_nothing, 0, NGEOS);
  tcase_add_loop_test(tc, sanitize_on_decode, 0, NGEOS);
  tcase_add_loop_test(tc, fork_then_decode_apart, 0, NGEOS);
  tcase_add_loop_test(tc, fork_after_exact_fill_shares, 0, NGEOS);
  tcase_add_test(tc, decode_under_a_window);
  tcase_add_loop_test(tc, prefault_block_store, 0, 2 * NGEOS);
  tcase_add_test(tc, prefault_store_under_a_window);
  suite_add_tcase(s, tc);
  return it_run(s);
}
