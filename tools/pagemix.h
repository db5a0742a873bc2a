/*
 * tools/pagemix.h - a realistic mix of KV page sizes, from the codec table of
 * DESIGN.md section 7 at head dim D = 128: the pages of one 16-token block
 * of one head, per codec, plus per-segment pages and large VAR-scale pages.
 * Shared by kvpool-demo and kvpool-bench (public header only).
 */
#ifndef KVP_TOOLS_PAGEMIX_H
#define KVP_TOOLS_PAGEMIX_H

#define KVP_EXPERIMENTAL_API
#include <stdint.h>

#include "kvpool.h"

typedef struct pagemix_entry {
  const char *what;    /* which page of which codec */
  kvp_page_type type;  /* its page type */
  uint64_t bytes;      /* requested bytes */
  uint32_t weight;     /* relative frequency in the mix */
} pagemix_entry;

/* D = 128, 16 tokens per block unless said otherwise. */
static const pagemix_entry pagemix[] = {
    {"bf16 raw block", KVP_PAGE_RAW, 16 * 128 * 2, 16},
    {"fp32 raw block", KVP_PAGE_RAW, 16 * 128 * 4, 2},
    {"fp8 codes", KVP_PAGE_CODES, 16 * 128, 12},
    {"fp8 scales (fp32/token)", KVP_PAGE_SCALES, 16 * 4, 12},
    {"int8 scales (bf16/token)", KVP_PAGE_SCALES, 16 * 2, 8},
    {"kivi b2 codes", KVP_PAGE_CODES, 16 * 128 * 2 / 8, 8},
    {"kivi G32 scales+mins", KVP_PAGE_SCALES, 4 * 128 * 16 / 32, 8},
    {"nvfp4 codes", KVP_PAGE_CODES, 16 * 128 / 2, 12},
    {"nvfp4 e4m3 scales", KVP_PAGE_SCALES, 16 * 128 / 16, 12},
    {"nvfp4 segment meta", KVP_PAGE_META, 4, 4},
    {"qvg centroids 256x128 bf16", KVP_PAGE_CENTROIDS, 256 * 128 * 2, 1},
    {"qvg assign (4096 tokens)", KVP_PAGE_ASSIGN, 4096, 1},
    {"kvquant nuq3 codes", KVP_PAGE_CODES, 16 * 128 * 3 / 8, 4},
    {"kvquant CSR outliers (k=2)", KVP_PAGE_OUTLIERS, 16 * 2 * 3, 4},
    {"VAR scale 1024 tokens bf16", KVP_PAGE_RAW, 1024 * 128 * 2, 1},
    {"VAR scale 4096 tokens bf16", KVP_PAGE_RAW, 4096 * 128 * 2, 1},
};
#define PAGEMIX_N (sizeof pagemix / sizeof pagemix[0])

/* Pick an entry by weight from a random number. */
static inline const pagemix_entry *pagemix_pick(uint64_t r) {
  uint32_t total = 0;
  for (unsigned i = 0; i < PAGEMIX_N; i++) total += pagemix[i].weight;
  uint32_t x = (uint32_t)(r % total);
  for (unsigned i = 0; i < PAGEMIX_N; i++) {
    if (x < pagemix[i].weight) return &pagemix[i];
    x -= pagemix[i].weight;
  }
  return &pagemix[0];
}

static inline uint64_t pagemix_rand(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1DULL;
}

#endif
