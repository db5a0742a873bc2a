/*
 * codecs/raw.c - the raw codec: tokens stored as they came (fp32, bf16 or
 * fp16), one RAW page per block and side.
 *
 *   RAW page (cap tokens):  | token 0: D x esize | token 1 | ... | token cap-1 |
 *   layout: bytes = cap x D x esize(store dtype)
 *
 * Decoding to another dtype goes through f32 with the numeric core's
 * round-to-nearest-even conversions.
 */
#include "codec.h"
#include "numeric.h"

#include <string.h>

static uint64_t raw_page_bytes(const kvp__codec_ctx *c, unsigned i, uint32_t cap_tokens) {
  (void)i;
  return (uint64_t)cap_tokens * c->head_dim * kvp__dtype_bytes(c->store_dtype);
}

static int raw_encode(const kvp__codec_ctx *c, unsigned char *const *pages, uint32_t t0, const void *src,
                      size_t src_stride, uint32_t n) {
  size_t row = (size_t)c->head_dim * kvp__dtype_bytes(c->store_dtype);
  unsigned char *dst = pages[0] + (size_t)t0 * row;
  const unsigned char *s = src;
  if (c->in_dtype == c->store_dtype) {
    for (uint32_t t = 0; t < n; t++) memcpy(dst + t * row, s + t * src_stride, row);
    return KVP_OK;
  }
  float tmp[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < n; t++) {
    kvp__row_to_f32(tmp, s + t * src_stride, c->in_dtype, c->head_dim);
    kvp__row_from_f32(dst + t * row, c->store_dtype, tmp, c->head_dim);
  }
  return KVP_OK;
}

static int raw_decode(const kvp__codec_ctx *c, const unsigned char *const *pages, uint32_t t0, uint32_t n, void *dst,
                      kvp_dtype out) {
  size_t row = (size_t)c->head_dim * kvp__dtype_bytes(c->store_dtype);
  size_t orow = (size_t)c->head_dim * kvp__dtype_bytes(out);
  const unsigned char *src = pages[0] + (size_t)t0 * row;
  if (out == c->store_dtype) {
    memcpy(dst, src, (size_t)n * row);
    return KVP_OK;
  }
  float tmp[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < n; t++) {
    kvp__row_to_f32(tmp, src + t * row, c->store_dtype, c->head_dim);
    kvp__row_from_f32((unsigned char *)dst + t * orow, out, tmp, c->head_dim);
  }
  return KVP_OK;
}

const kvp__codec kvp__codec_raw = {
    .name = "raw",
    .id = 0,
    .npages = 1,
    .types = {KVP_PAGE_RAW},
    .page_bytes = raw_page_bytes,
    .encode = raw_encode,
    .decode = raw_decode,
};
