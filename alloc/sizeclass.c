/*
 * alloc/sizeclass.c - size classes: an 8 B class, 16 B steps up to 1 KiB,
 * then 64 classes per doubling.
 *
 *   index:  0 | 1  2  3 ...  64   | 65   66   ... 128  | 129  130  ... 192  | ...
 *   bytes:  8 | 16 32 48 ... 1024 | 1040 1056 ... 2048 | 2080 2112 ... 4096 | ...
 *
 * Group g >= 0 covers (1024 << g, 2048 << g] in 64 equal steps of 16 << g
 * bytes. So
 *   size(0) = 8
 *   size(i) = 16 i                                  for 1 <= i <= 64
 *   size(i) = (1024 << g) + (16 << g)(r + 1)        for i = 65 + 64 g + r
 * and index(n) = min { i : size(i) >= n }. Rounding waste is under 16 B up
 * to 1 KiB and under 1/64 of the size above (0.8% on average), so the
 * pages of a KV cache, whose sizes are few and arbitrary (nvfp4's 4-byte
 * META, kvquant's 66-byte OUTLIERS, VAR scales of 64 x side^2 bytes), cost
 * what they ask within a percent, where 4 classes per doubling from a
 * 64 B granule cost up to 25% (16x on a 4-byte page).
 *
 * Alignment: a slot of class size s sits at a multiple of s from a 4 KiB
 * aligned slab, so every page of more than 8 bytes is 16-byte aligned
 * (every class but the first is a multiple of 16), an 8-byte one 8-byte.
 *
 * Which classes are slab classes is the allocator's choice (kvp__alloc:
 * those up to small_max_bytes, at most KVP__SMALL_MAX_BYTES, so a slab
 * holds 8 slots at least); every size above is a large page on the 4 KiB
 * extent unit.
 *
 * The fast path (sizes <= 16 KiB) is one load from a 2049-entry table
 * indexed by ceil(n / 8); larger sizes compute the formula (a clz and
 * shifts).
 */
#include "alloc.h"

#include <pthread.h>

uint16_t kvp__sc_lut[(KVP__SC_LUT_MAX_BYTES >> 3) + 1];
uint64_t kvp__sc_sizes[KVP__SC_COUNT];

uint64_t kvp__sc_size_slow(uint32_t index) {
  if (index == 0) return KVP__SC_TINY;
  if (index <= KVP__SC_LINEAR_COUNT) return (uint64_t)index * KVP__SC_QUANTUM;
  uint32_t g = (index - KVP__SC_LINEAR_COUNT - 1) >> KVP__SC_LG_STEPS, r = (index - KVP__SC_LINEAR_COUNT - 1) &
                                                                          (KVP__SC_STEPS - 1);
  return (KVP__SC_LINEAR_MAX << g) + ((uint64_t)KVP__SC_QUANTUM << g) * (r + 1);
}

uint32_t kvp__sc_index_slow(uint64_t bytes) {
  if (bytes <= KVP__SC_TINY) return 0;
  if (bytes <= KVP__SC_LINEAR_MAX) return (uint32_t)((bytes + KVP__SC_QUANTUM - 1) / KVP__SC_QUANTUM);
  uint64_t x = bytes - 1;         /* x in [1024 << g, 2048 << g) */
  unsigned lg = kvp__lg_floor(x); /* >= 10 */
  uint32_t g = lg - 10;
  return KVP__SC_LINEAR_COUNT + 1 + (g << KVP__SC_LG_STEPS) +
         (uint32_t)((x >> (lg - KVP__SC_LG_STEPS)) & (KVP__SC_STEPS - 1));
}

uint32_t kvp__sc_index_floor(uint64_t bytes) {
  uint32_t i = kvp__sc_index_slow(bytes);
  return kvp__sc_size_slow(i) > bytes ? i - 1 : i;
}

static void sc_init_once(void) {
  for (uint32_t i = 0; i < KVP__SC_COUNT; i++) kvp__sc_sizes[i] = kvp__sc_size_slow(i);
  for (uint64_t q = 0; q <= (KVP__SC_LUT_MAX_BYTES >> 3); q++)
    kvp__sc_lut[q] = (uint16_t)kvp__sc_index_slow(q == 0 ? 1 : q * 8);
}

void kvp__sc_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, sc_init_once);
}
