/*
 * codecs/raw.c - the raw codec: tokens stored as fp32, bf16 or fp16, one RAW
 * page per block and side. Spec: raw[:dtype=bf16|fp16|f16|fp32|f32]
 * (default: the appended dtype; the aliases bf16, fp16, fp32 name it).
 * Storing fp32 input as bf16 or fp16 rounds to nearest even.
 *
 *   RAW page (cap tokens):  | token 0: D x esize | token 1 | ... | token cap-1 |
 *   layout: bytes = cap x D x esize(dtype)
 *
 * The pool also uses a raw instance in the appended dtype for the OPEN block
 * of a stream (the RAW tail every codec's tokens wait in until the block is
 * sealed).
 */
#include "builtin.h"
#include "codecs.h"
#include "numeric.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct raw_inst {
  kvp_dtype in;    /* appended dtype */
  kvp_dtype store; /* stored dtype */
  uint32_t d;      /* head dim */
} raw_inst;

static int parse_dtype(const char *v, size_t n, kvp_dtype *out) {
  static const struct {
    const char *name;
    kvp_dtype dt;
  } names[] = {{"bf16", KVP_DTYPE_BF16}, {"fp16", KVP_DTYPE_F16}, {"f16", KVP_DTYPE_F16},
               {"fp32", KVP_DTYPE_F32}, {"f32", KVP_DTYPE_F32}};
  for (size_t i = 0; i < KVP__ARRAY_LEN(names); i++)
    if (strlen(names[i].name) == n && strncmp(v, names[i].name, n) == 0) {
      *out = names[i].dt;
      return KVP_OK;
    }
  return KVP_EINVAL;
}

static int raw_create(const char *params, const kvp_codec_geom *g, void **inst, char *err, size_t errcap,
                      size_t *err_at) {
  raw_inst r = {g->in_dtype, g->in_dtype, g->head_dim};
  const char *p = params ? params : "";
  while (*p) {
    const char *end = strchr(p, ':');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    if (n > 6 && strncmp(p, "dtype=", 6) == 0 && parse_dtype(p + 6, n - 6, &r.store) == KVP_OK) {
    } else {
      snprintf(err, errcap, "raw: unknown parameter \"%.*s\" (raw takes dtype=bf16|fp16|fp32)", (int)n, p);
      *err_at = (size_t)(p - params);
      return KVP_EINVAL;
    }
    p += n + (end != NULL);
  }
  raw_inst *out = malloc(sizeof *out);
  if (!out) return KVP_ENOMEM;
  *out = r;
  *inst = out;
  return KVP_OK;
}

static void raw_destroy(void *inst) { free(inst); }
static uint32_t raw_group(const void *inst) {
  (void)inst;
  return 1;
}

static void raw_layout(const void *inst, uint32_t cap, kvp_codec_layout *out) {
  const raw_inst *r = inst;
  out->npages = 1;
  out->types[0] = KVP_PAGE_RAW;
  out->bytes[0] = (uint64_t)cap * r->d * kvp__dtype_bytes(r->store);
}

static int raw_encode(const void *inst, const void *src, size_t src_stride, uint32_t n, uint32_t cap,
                      void *const *pages) {
  const raw_inst *r = inst;
  (void)cap;
  size_t row = (size_t)r->d * kvp__dtype_bytes(r->store);
  unsigned char *dst = pages[0];
  const unsigned char *s = src;
  if (r->in == r->store) {
    if (src_stride == row) memcpy(dst, s, (size_t)n * row);
    else
      for (uint32_t t = 0; t < n; t++) memcpy(dst + t * row, s + t * src_stride, row);
    return KVP_OK;
  }
  float tmp[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < n; t++) {
    kvp__row_to_f32(tmp, s + t * src_stride, r->in, r->d);
    kvp__row_from_f32(dst + t * row, r->store, tmp, r->d);
  }
  return KVP_OK;
}

static int raw_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap, uint32_t t0, uint32_t m,
                      void *dst, size_t dst_stride, kvp_dtype out) {
  const raw_inst *r = inst;
  (void)n, (void)cap;
  size_t row = (size_t)r->d * kvp__dtype_bytes(r->store);
  const unsigned char *src = (const unsigned char *)pages[0] + (size_t)t0 * row;
  unsigned char *d = dst;
  if (out == r->store && dst_stride == row) {
    memcpy(d, src, (size_t)m * row);
    return KVP_OK;
  }
  float tmp[KVP_MAX_HEAD_DIM];
  for (uint32_t t = 0; t < m; t++) {
    kvp__row_to_f32(tmp, src + t * row, r->store, r->d);
    kvp__row_from_f32(d + t * dst_stride, out, tmp, r->d);
  }
  return KVP_OK;
}

kvp_dtype kvp__raw_store_dtype(const void *inst) { return ((const raw_inst *)inst)->store; }

#ifdef KVP_HAVE_CUDA
void kvp__raw_kparams(const void *inst, kvp__kparams *k) {
  const raw_inst *r = inst;
  memset(k, 0, sizeof *k);
  k->codec = KVP__K_RAW;
  k->head_dim = r->d;
  k->in_dtype = r->in;
  k->store_dtype = r->store;
}
#endif
KVP__DEV_OPS(raw)

const kvp_codec_vtable kvp__codec_raw = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "raw",
    .create = raw_create,
    .destroy = raw_destroy,
    .group_tokens = raw_group,
    .layout = raw_layout,
    .encode = raw_encode,
    .decode = raw_decode,
    KVP__DEV_VT(raw)
};
