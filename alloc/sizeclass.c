/*
 * alloc/sizeclass.c - size classes: four per doubling from a 64 B granule.
 *
 *   index:  0   1   2   3  |  4   5   6   7  |  8   9  10   11  | ...
 *   bytes: 64 128 192 256  | 320 384 448 512 | 640 768 896 1024 | ...
 *
 * Group 0 is linear (k x 64, k = 1..4). Group g >= 1 covers (256 << (g-1),
 * 256 << g] in four equal steps of 64 << (g-1) bytes. So
 *   size(i) = 64 (i + 1)                            for i < 4
 *   size(i) = b + (b / 4)(r + 1), b = 256 << (g-1)  for i = 4g + r
 * and index(n) = min { i : size(i) >= n }. Rounding waste is < 25% of the
 * size (under 20% above 256 B). Classes up to 16 KiB are slab classes (2 MiB
 * slabs of at least 128 slots); every class above is a multiple of the 4 KiB
 * extent unit and gets an extent of its own.
 *
 * The fast path (sizes <= 16 KiB) is one load from a 257-byte table indexed
 * by ceil(n / 64); larger sizes compute the formula (a clz and shifts).
 */
#include "alloc.h"

#include <pthread.h>

uint8_t kvp__sc_lut[(KVP__SMALL_MAX_BYTES >> 6) + 1];
uint32_t kvp__sc_small_count;
uint64_t kvp__sc_sizes[KVP__SC_COUNT];

uint64_t kvp__sc_size_slow(uint32_t index) {
  if (index < 4) return (uint64_t)(index + 1) * KVP__SC_GRANULE;
  uint32_t g = index / 4, r = index % 4;
  uint64_t b = 256ull << (g - 1);
  return b + (b >> 2) * (r + 1);
}

uint32_t kvp__sc_index_slow(uint64_t bytes) {
  if (bytes <= 256) return bytes == 0 ? 0 : (uint32_t)((bytes + 63) / 64 - 1);
  uint64_t x = bytes - 1;             /* x in [256 << (g-1), 256 << g) */
  unsigned lg = kvp__lg_floor(x);     /* >= 8 */
  uint32_t g = lg - 7;
  return 4 * g + (uint32_t)((x >> (lg - 2)) & 3);
}

uint32_t kvp__sc_index_floor(uint64_t bytes) {
  uint32_t i = kvp__sc_index_slow(bytes);
  return kvp__sc_size_slow(i) > bytes ? i - 1 : i;
}

static void sc_init_once(void) {
  for (uint32_t i = 0; i < KVP__SC_COUNT; i++) kvp__sc_sizes[i] = kvp__sc_size_slow(i);
  for (uint64_t q = 0; q <= (KVP__SMALL_MAX_BYTES >> 6); q++)
    kvp__sc_lut[q] = (uint8_t)kvp__sc_index_slow(q == 0 ? 1 : q * 64);
  kvp__sc_small_count = kvp__sc_index_slow(KVP__SMALL_MAX_BYTES) + 1;
}

void kvp__sc_init(void) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, sc_init_once);
}
