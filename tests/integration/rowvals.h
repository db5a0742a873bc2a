/*
 * tests/integration/rowvals.h - the rows the append tests write and check
 * (check_decode, check_stepfill): geometries over every dtype, and each
 * element's value, an integer exact in fp32, bf16 and fp16; their pools and
 * stats. Included after the includer's L and BT, and itest.h.
 */
#ifndef KVP_ROWVALS_H
#define KVP_ROWVALS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kvpool.h"

#define ck_msg(part) \
  ck_assert_msg(strstr(kvp_last_error(), part) != NULL, "message lacks \"%s\": %s", part, kvp_last_error())

typedef struct geo {
  uint32_t H, D;
  kvp_dtype k, v;
} geo;

static const geo GEOS[] = {
    {3, 24, KVP_DTYPE_BF16, KVP_DTYPE_BF16}, /* bf16 rows of 48 B: a vector and a scalar tail */
    {2, 128, KVP_DTYPE_F16, KVP_DTYPE_F32},  /* the decode shape's row; V in fp32 */
    {3, 13, KVP_DTYPE_F32, KVP_DTYPE_F16},   /* odd head_dim: rows of 52 and 26 B */
    {70, 8, KVP_DTYPE_BF16, KVP_DTYPE_F32},  /* more heads than one batch of the copy (64) */
};
#define NGEOS (int)(sizeof GEOS / sizeof *GEOS)

static size_t wbytes(kvp_dtype dt) { return dt == KVP_DTYPE_F32 ? 4 : 2; }

/* The value of (seq, layer, head, position, channel, side): a small integer,
 * exact in fp32, bf16 and fp16. */
static float val(uint64_t seq, uint32_t l, uint32_t h, uint32_t pos, uint32_t d, int kv) {
  return (float)((int)((seq * 131 + l * 37 + h * 17 + pos * 7 + d * 3 + (unsigned)kv * 101) % 241) - 120);
}

/* x (an integer of magnitude < 2048) in dt's bits. */
static uint32_t bits(float x, kvp_dtype dt) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if (dt == KVP_DTYPE_F32) return u;
  if (dt == KVP_DTYPE_BF16) return u >> 16;
  if (x == 0) return 0;
  uint32_t s = x < 0 ? 0x8000u : 0, m = (uint32_t)fabsf(x), e = 0;
  while (m >> (e + 1)) e++;
  return s | (e + 15) << 10 | ((m << (10 - e)) & 0x3FFu);
}

static void put(void *buf, size_t i, kvp_dtype dt, uint32_t u) {
  if (dt == KVP_DTYPE_F32) memcpy((char *)buf + i * 4, &u, 4);
  else {
    uint16_t h = (uint16_t)u;
    memcpy((char *)buf + i * 2, &h, 2);
  }
}

/* A pool of g's geometry (L layers, BT-token blocks: the includer's). */
static kvp_pool *rv_pool(const geo *g, uint32_t flags, const char *policy, uint64_t budget, uint64_t region) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = g->H;
  c.head_dim = g->D;
  c.k_dtype = g->k;
  c.v_dtype = g->v;
  c.region_bytes = region;
  c.block_tokens = BT;
  c.flags = flags;
  c.policy = policy;
  c.budget_bytes = budget;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  return p;
}

static kvp_stats rv_stats(kvp_pool *p) {
  kvp_stats s;
  memset(&s, 0, sizeof s);
  s.struct_size = sizeof s;
  ck_ok(kvp_stats_get(p, &s));
  return s;
}

#endif
