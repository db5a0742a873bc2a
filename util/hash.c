/*
 * util/hash.c - XXH64 (Yann Collet's xxHash, 64-bit variant, reimplemented
 * from its specification): the checksum of store blobs and the mixing
 * function of content keys. Fast (about 1 byte per cycle per lane, four
 * lanes) and well distributed; not cryptographic.
 *
 *   input  | 32-byte stripes: four lanes v1..v4 (round) | 8 | 4 | 1-byte tail |
 *   result = avalanche(merge(v1..v4) + len, tail)
 */
#include "util.h"

#include <string.h>

#define P1 0x9E3779B185EBCA87ull
#define P2 0xC2B2AE3D27D4EB4Full
#define P3 0x165667B19E3779F9ull
#define P4 0x85EBCA77C2B2AE63ull
#define P5 0x27D4EB2F165667C5ull

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t rd64(const unsigned char *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}
static inline uint32_t rd32(const unsigned char *p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
static inline uint64_t round1(uint64_t acc, uint64_t in) {
  acc += in * P2;
  acc = rotl(acc, 31);
  return acc * P1;
}
static inline uint64_t merge(uint64_t acc, uint64_t v) {
  acc ^= round1(0, v);
  return acc * P1 + P4;
}

/* The tail and avalanche of XXH64 after the stripes (h holds merge + len). */
static inline uint64_t finish(uint64_t h, const unsigned char *p, const unsigned char *end) {
  for (; p + 8 <= end; p += 8) {
    h ^= round1(0, rd64(p));
    h = rotl(h, 27) * P1 + P4;
  }
  if (p + 4 <= end) {
    h ^= (uint64_t)rd32(p) * P1;
    h = rotl(h, 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; p++) {
    h ^= (*p) * P5;
    h = rotl(h, 11) * P1;
  }
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

void kvp__xxh64_2(const void *data, size_t len, uint64_t seed_a, uint64_t seed_b, uint64_t out[2]) {
  const unsigned char *p = data, *end = p + len;
  uint64_t ha, hb;
  if (len >= 32) { /* the two hashes' lanes side by side: eight independent chains */
    uint64_t a1 = seed_a + P1 + P2, a2 = seed_a + P2, a3 = seed_a, a4 = seed_a - P1;
    uint64_t b1 = seed_b + P1 + P2, b2 = seed_b + P2, b3 = seed_b, b4 = seed_b - P1;
    const unsigned char *limit = end - 32;
    do {
      uint64_t w1 = rd64(p), w2 = rd64(p + 8), w3 = rd64(p + 16), w4 = rd64(p + 24);
      a1 = round1(a1, w1), b1 = round1(b1, w1);
      a2 = round1(a2, w2), b2 = round1(b2, w2);
      a3 = round1(a3, w3), b3 = round1(b3, w3);
      a4 = round1(a4, w4), b4 = round1(b4, w4);
      p += 32;
    } while (p <= limit);
    ha = rotl(a1, 1) + rotl(a2, 7) + rotl(a3, 12) + rotl(a4, 18);
    hb = rotl(b1, 1) + rotl(b2, 7) + rotl(b3, 12) + rotl(b4, 18);
    ha = merge(ha, a1), hb = merge(hb, b1);
    ha = merge(ha, a2), hb = merge(hb, b2);
    ha = merge(ha, a3), hb = merge(hb, b3);
    ha = merge(ha, a4), hb = merge(hb, b4);
  } else {
    ha = seed_a + P5;
    hb = seed_b + P5;
  }
  out[0] = finish(ha + (uint64_t)len, p, end);
  out[1] = finish(hb + (uint64_t)len, p, end);
}

/* ---- a 128-bit key hash (content keys of prefix chunks) -------------------------
 *
 * XXH3's short-input construction (xxHash 0.8, XXH3_len_17to128_128b) over
 * any length, with positional keys in place of its secret:
 *
 *   per 32-byte block (w0 w1 | w2 w3), keys ka, kb (a Weyl sequence from the seeds):
 *     lo += fold(w0 ^ ka, w1 ^ (kb + P5));  lo ^= w2 + w3
 *     hi += fold(w2 ^ kb, w3 ^ (ka + P3));  hi ^= w0 + w1
 *   the tail zero-padded to one more block (the length goes into the result);
 *   out[0] = avalanche(lo + hi), out[1] = -avalanche(lo P1 + hi P4 + (len - seed_a) P2)
 *
 * fold(a, b) = the 128-bit product a b, its halves xor'ed: one multiply
 * mixes 16 bytes, and every input word reaches both halves (through the
 * product in one, the sum in the other). Four multiplies per 32 bytes
 * against sixteen for two XXH64 passes; the blocks' products are
 * independent, so a chain of keys (each seeded by the last) costs about
 * one product and one avalanche of latency per link. Not cryptographic. */

static inline uint64_t fold(uint64_t a, uint64_t b) {
#ifdef __SIZEOF_INT128__
  unsigned __int128 p = (unsigned __int128)a * b;
  return (uint64_t)p ^ (uint64_t)(p >> 64);
#else /* 32-bit halves */
  uint64_t al = (uint32_t)a, ah = a >> 32, bl = (uint32_t)b, bh = b >> 32;
  uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
  uint64_t mid = (ll >> 32) + (uint32_t)lh + (uint32_t)hl;
  uint64_t lo = (mid << 32) | (uint32_t)ll, hi = hh + (lh >> 32) + (hl >> 32) + (mid >> 32);
  return lo ^ hi;
#endif
}

static inline uint64_t avalanche3(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  return h ^ (h >> 32);
}

/* One 32-byte block into (lo, hi) under keys (ka, kb). */
static inline void block128(uint64_t *lo, uint64_t *hi, uint64_t w0, uint64_t w1, uint64_t w2, uint64_t w3, uint64_t ka,
                            uint64_t kb) {
  *lo += fold(w0 ^ ka, w1 ^ (kb + P5));
  *lo ^= w2 + w3;
  *hi += fold(w2 ^ kb, w3 ^ (ka + P3));
  *hi ^= w0 + w1;
}

void kvp__hash128(const void *data, size_t len, uint64_t seed_a, uint64_t seed_b, uint64_t out[2]) {
  const unsigned char *p = data, *end = p + len;
  uint64_t lo = (uint64_t)len * P1, hi = 0, ka = seed_a, kb = seed_b;
  for (; end - p >= 32; p += 32, ka += P1, kb += P2)
    block128(&lo, &hi, rd64(p), rd64(p + 8), rd64(p + 16), rd64(p + 24), ka, kb);
  if (p < end || !len) { /* the tail, zero-padded */
    uint64_t w[4] = {0, 0, 0, 0};
    memcpy(w, p, (size_t)(end - p));
    block128(&lo, &hi, w[0], w[1], w[2], w[3], ka, kb);
  }
  out[0] = avalanche3(lo + hi);
  out[1] = 0 - avalanche3(lo * P1 + hi * P4 + ((uint64_t)len - seed_a) * P2);
}

uint64_t kvp__xxh64(const void *data, size_t len, uint64_t seed) {
  const unsigned char *p = data, *end = p + len;
  uint64_t h;
  if (len >= 32) {
    uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
    const unsigned char *limit = end - 32;
    do {
      v1 = round1(v1, rd64(p));
      v2 = round1(v2, rd64(p + 8));
      v3 = round1(v3, rd64(p + 16));
      v4 = round1(v4, rd64(p + 24));
      p += 32;
    } while (p <= limit);
    h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
    h = merge(h, v1);
    h = merge(h, v2);
    h = merge(h, v3);
    h = merge(h, v4);
  } else {
    h = seed + P5;
  }
  return finish(h + (uint64_t)len, p, end);
}
