/*
 * codecs/codec.h - the codec interface the pages layer drives: a codec turns
 * the tokens of a block of one head into pages and back. One codec binding
 * per (layer, K or V). Codecs know nothing of the pool: tensors in, bytes
 * out, layouts exact and deterministic.
 *
 * A block uses up to KVP__CODEC_MAX_PAGES pages per side, one per page type
 * the codec lists in types[]; page_bytes(i, n) is the exact requested size
 * of page i for a block of capacity n tokens (the layout).
 */
#ifndef KVP_CODEC_H
#define KVP_CODEC_H

#include "../util/util.h"

#define KVP__CODEC_MAX_PAGES 4u

struct kvp__codec;

/* A codec bound to one (layer, K or V). */
typedef struct kvp__codec_ctx {
  const struct kvp__codec *codec; /* the codec */
  kvp_dtype in_dtype;             /* dtype of appended tokens */
  kvp_dtype store_dtype;          /* raw: dtype of stored tokens */
  uint32_t head_dim;              /* elements per token */
} kvp__codec_ctx;

typedef struct kvp__codec {
  const char *name;                            /* spec name */
  uint16_t id;                                 /* stats id */
  uint8_t npages;                              /* pages per block and side */
  uint8_t types[KVP__CODEC_MAX_PAGES];         /* kvp_page_type of each */
  /* Exact requested bytes of page i of a block of cap_tokens. */
  uint64_t (*page_bytes)(const kvp__codec_ctx *c, unsigned i, uint32_t cap_tokens);
  /* Host: encode n tokens (rows src_stride bytes apart) into the pages at
   * token offset t0. KVP_OK or an error with a message. */
  int (*encode)(const kvp__codec_ctx *c, unsigned char *const *pages, uint32_t t0, const void *src,
                size_t src_stride, uint32_t n);
  /* Host: decode n tokens from token offset t0 into dst rows of out dtype. */
  int (*decode)(const kvp__codec_ctx *c, const unsigned char *const *pages, uint32_t t0, uint32_t n, void *dst,
                kvp_dtype out);
} kvp__codec;

extern const kvp__codec kvp__codec_raw;

#endif /* KVP_CODEC_H */
