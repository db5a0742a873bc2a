/*
 * tests/integration/kvgen.h - deterministic K/V for the integration tests:
 * the value of (sequence lineage, layer, head, position, channel, K or V) is
 * a small integer, exact in bf16, so every read can be checked bit for bit.
 * A forked sequence inherits its parent's values below the fork position.
 */
#ifndef KVP_TEST_KVGEN_H
#define KVP_TEST_KVGEN_H

#include <stdint.h>
#include <string.h>

#define KVGEN_MAX_SEQS 4096

typedef struct kvgen {
  int64_t parent[KVGEN_MAX_SEQS];    /* parent id, -1 for a root */
  uint32_t fork_pos[KVGEN_MAX_SEQS]; /* positions inherited from the parent */
} kvgen;

static inline void kvgen_init(kvgen *g) {
  for (int i = 0; i < KVGEN_MAX_SEQS; i++) g->parent[i] = -1, g->fork_pos[i] = 0;
}

static inline void kvgen_fork(kvgen *g, uint64_t parent, uint64_t child, uint32_t pos) {
  g->parent[child] = (int64_t)parent;
  g->fork_pos[child] = pos;
}

/* The sequence whose value a position carries. */
static inline uint64_t kvgen_owner(const kvgen *g, uint64_t seq, uint32_t pos) {
  while (g->parent[seq] >= 0 && pos < g->fork_pos[seq]) seq = (uint64_t)g->parent[seq];
  return seq;
}

static inline uint16_t kvgen_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16); /* exact: the values are small integers */
}

/* The float a bf16 holds. */
static inline float kvgen_f32(uint16_t x) {
  uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t kvgen_value(const kvgen *g, uint64_t seq, uint32_t layer, uint32_t head, uint32_t pos,
                                   uint32_t ch, int kv) {
  uint64_t o = kvgen_owner(g, seq, pos);
  int v = (int)((o * 131 + layer * 37 + head * 17 + pos * 7 + ch * 3 + (unsigned)kv * 101) % 241) - 120;
  return kvgen_bf16((float)v);
}

/* Fill [n][H][D] bf16 K and V for positions pos0.. of (seq, layer). */
static inline void kvgen_fill(const kvgen *g, uint64_t seq, uint32_t layer, uint32_t pos0, uint32_t n, uint32_t H,
                              uint32_t D, uint16_t *k, uint16_t *v) {
  for (uint32_t t = 0; t < n; t++)
    for (uint32_t h = 0; h < H; h++)
      for (uint32_t d = 0; d < D; d++) {
        size_t i = ((size_t)t * H + h) * D + d;
        k[i] = kvgen_value(g, seq, layer, h, pos0 + t, d, 0);
        v[i] = kvgen_value(g, seq, layer, h, pos0 + t, d, 1);
      }
}

#endif
