/*
 * codecs/builtin.h - the quantizing codecs built into kvpool, as
 * kvp_codec_vtable instances (include/kvpool_codec.h), and the few helpers
 * they share: the parameter scanner, little-endian scalar stores, and the
 * geometry check. Rounding to an integer (ties to even, whatever the
 * rounding mode) is kvp__rne_u32 in codecs/numeric.h for the branch-free
 * row kernels (0 <= w < 2^31), and kvp__round_even here for any sign.
 *
 *   fp8    codecs/fp8.c    E4M3 codes, per token-head fp32 scale or static
 *   int8   codecs/int8.c   symmetric int8 per token-head, bf16 scale
 *   kivi   codecs/kivi.c   2/4-bit asymmetric, K per channel, V per token
 *   nvfp4  codecs/nvfp4.c  E2M1 + E4M3 per 16 + fp32 per block-head
 *   qvg    codecs/qvg.c    k-means smoothing stages + INT2/INT4, E4M3 per
 *                          group (qvg-pro: the same with 4 stages, g=16)
 *   kvquant codecs/kvquant.c nuq 2/3/4-bit codebooks from calibration, K per
 *                          channel (pre-RoPE option), V per token, sparse
 *                          fp16 outliers, RAW sink tokens
 *
 * Parameters: the text after "name:" in a codec spec, fields "key=value"
 * separated by ':' ("bits=2:group=32"). Keys are exact and lower case; a
 * key may appear once. Multi-byte scalars in pages are little-endian,
 * whatever the host (the helpers below write them byte by byte).
 */
#ifndef KVP_CODECS_BUILTIN_H
#define KVP_CODECS_BUILTIN_H

#include "../util/util.h"
#include "kvpool_codec.h"

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern const kvp_codec_vtable kvp__codec_fp8, kvp__codec_int8, kvp__codec_kivi, kvp__codec_nvfp4, kvp__codec_qvg,
    kvp__codec_qvg_pro, kvp__codec_kvquant;

/* ---- device ops (CUDA builds) ---------------------------------------------
 * A built-in with a device twin in kernels/ fills a kvp__kparams from its
 * instance (void NAME_kparams(const void *inst, kvp__kparams *k), extern
 * as kvp__NAME_kparams so the paged gather can ask it too), and
 * KVP__DEV_OPS(NAME) defines its encode_dev and decode_dev from that;
 * KVP__DEV_VT(NAME) puts them in the vtable (nothing without CUDA). */
#ifdef KVP_HAVE_CUDA
#include "../kernels/kernels.h"
int kvp__dev_encode(const char *codec, const kvp__kparams *k, const kvp_codec_dev_job *jobs,
                    const kvp_codec_dev_job *jobs_dev, uint32_t njobs, uint64_t *status, void *stream);
int kvp__dev_decode(const char *codec, const kvp__kparams *k, const kvp_codec_dev_job *jobs,
                    const kvp_codec_dev_job *jobs_dev, uint32_t njobs, kvp_dtype out, void *stream);
/* The kernels' parameters of a built-in binding: KVP_OK, or KVP_ENOTSUP for
 * a codec without a built-in device twin. */
int kvp__codec_kparams(const kvp_codec_vtable *vt, const void *inst, kvp__kparams *out);
void kvp__raw_kparams(const void *inst, kvp__kparams *k);
void kvp__fp8_kparams(const void *inst, kvp__kparams *k);
void kvp__int8_kparams(const void *inst, kvp__kparams *k);
void kvp__kivi_kparams(const void *inst, kvp__kparams *k);
void kvp__nvfp4_kparams(const void *inst, kvp__kparams *k);
/* A binding's device-side static data (kvquant: its calibration tables),
 * made once on the current device; a CUDA pool calls it at create. KVP_OK
 * (nothing to make, or made) or an error with a message. */
int kvp__codec_dev_prepare(const kvp_codec_vtable *vt, const void *inst);
/* Device bytes that data holds (0: none). */
uint64_t kvp__codec_dev_static_bytes(const kvp_codec_vtable *vt, const void *inst);
/* QVG (codecs/qvg_cuda.c): its device ops, and the pool's path, which
 * passes each job's host state and a workspace of the pool's. */
struct kvp__qvg_dev;
void kvp__qvg_kparams_of(const void *inst, kvp__qvg_kparams *k);
const char *kvp__qvg_name(const void *inst);
size_t kvp__qvg_state_bytes(const void *inst);
struct kvp__qvg_dev **kvp__qvg_dev_slot(const void *inst);
void kvp__qvg_dev_release(struct kvp__qvg_dev *d);
int kvp__qvg_encode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                        uint32_t njobs, uint64_t *status, void *stream);
int kvp__qvg_decode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                        uint32_t njobs, kvp_dtype out, void *stream);
bool kvp__codec_is_qvg(const kvp_codec_vtable *vt);
/* Device workspace bytes the pool's path needs for njobs blocks of at most
 * cap tokens that carry up to nstates distinct states (kvp__qvg_encode_pool). */
uint64_t kvp__qvg_pool_ws_bytes(const void *inst, uint32_t njobs, uint32_t nstates, uint32_t cap);
/* Encode njobs blocks; hstates[i]: job i's stream state in HOST memory
 * (state_bytes, the host codec's layout) or NULL (hstates NULL: none).
 * Each distinct state is copied to ws, the jobs that share it run one after
 * another (each starts from the last one's centroids), and it is copied
 * back, all on stream; the caller waits for the stream before the states
 * are read or ws is reused. */
int kvp__qvg_encode_pool(const void *inst, const kvp_codec_dev_job *jobs, void *const *hstates, uint32_t njobs,
                         void *ws, uint64_t ws_bytes, uint64_t *status, void *stream);
#define KVP__DEV_OPS(name)                                                                                           \
  static int name##_encode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,  \
                               uint32_t njobs, uint64_t *status, void *stream) {                                     \
    kvp__kparams k;                                                                                                  \
    kvp__##name##_kparams(inst, &k);                                                                                 \
    return kvp__dev_encode(#name, &k, jobs, jobs_dev, njobs, status, stream);                                        \
  }                                                                                                                  \
  static int name##_decode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,  \
                               uint32_t njobs, kvp_dtype out, void *stream) {                                        \
    kvp__kparams k;                                                                                                  \
    kvp__##name##_kparams(inst, &k);                                                                                 \
    return kvp__dev_decode(#name, &k, jobs, jobs_dev, njobs, out, stream);                                           \
  }
#define KVP__DEV_VT(name) .encode_dev = name##_encode_dev, .decode_dev = name##_decode_dev,
#else
#define KVP__DEV_OPS(name)
#define KVP__DEV_VT(name)
#endif

/* ---- little-endian scalars in pages ------------------------------------ */

static inline void kvp__st_le16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static inline uint16_t kvp__ld_le16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }
static inline void kvp__st_le32(uint8_t *p, uint32_t v) {
  for (unsigned i = 0; i < 4; i++) p[i] = (uint8_t)(v >> 8 * i);
}
static inline uint32_t kvp__ld_le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline void kvp__st_lef32(uint8_t *p, float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  kvp__st_le32(p, u);
}
static inline float kvp__ld_lef32(const uint8_t *p) {
  uint32_t u = kvp__ld_le32(p);
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

/* ---- rounding ------------------------------------------------------------ */

/* x rounded to the nearest integer, ties to even, whatever the FPU rounding
 * mode. On |x|: floor and |x| - floor are exact (same binade, or floor 0). */
static inline float kvp__round_even(float x) {
  float a = fabsf(x), f = floorf(a), d = a - f;
  if (d > 0.5f || (d == 0.5f && fmodf(f, 2.0f) != 0.0f)) f += 1.0f;
  return copysignf(f, x);
}

/* ---- parameters ---------------------------------------------------------- */

/* One "key=value" field of a params string. */
typedef struct kvp__param {
  const char *val; /* the value, val_len bytes, not NUL-terminated */
  size_t val_len;  /* bytes of the value */
  size_t at;       /* byte offset of the field in params */
  int key;         /* index of the key in the codec's key list */
} kvp__param;

/* Write "codec: message" into err (errcap bytes), the offset into *err_at
 * (when err_at is not NULL), and return KVP_EINVAL. */
static inline int kvp__param_fail(char *err, size_t errcap, size_t *err_at, size_t at, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static inline int kvp__param_fail(char *err, size_t errcap, size_t *err_at, size_t at, const char *fmt, ...) {
  if (err && errcap) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errcap, fmt, ap);
    va_end(ap);
  }
  if (err_at) *err_at = at;
  return KVP_EINVAL;
}

/* The next field of params at *pos (0 to start). Returns 1 with *p filled
 * (its key one of keys[0..nkeys)), 0 at the end, or KVP_EINVAL with a
 * message naming the field: empty, without '=', unknown key, or a key
 * already in *seen (a bit per key index, updated). */
static inline int kvp__param_next(const char *codec, const char *params, size_t *pos, const char *const *keys,
                                  unsigned nkeys, unsigned *seen, kvp__param *p, char *err, size_t errcap,
                                  size_t *err_at) {
  *p = (kvp__param){.key = -1};
  if (!params || !params[*pos]) return 0;
  size_t at = *pos, len = strcspn(params + at, ":"), klen = strcspn(params + at, ":=");
  *pos = at + len + (params[at + len] == ':');
  if (len == 0 || klen == len)
    return kvp__param_fail(err, errcap, err_at, at, "%s: parameter '%.*s' at byte %zu: want key=value", codec, (int)len,
                           params + at, at);
  for (unsigned k = 0; k < nkeys; k++) {
    if (strlen(keys[k]) != klen || memcmp(keys[k], params + at, klen) != 0) continue;
    if (*seen & 1u << k)
      return kvp__param_fail(err, errcap, err_at, at, "%s: parameter %s given twice", codec, keys[k]);
    *seen |= 1u << k;
    *p = (kvp__param){.val = params + at + klen + 1, .val_len = len - klen - 1, .at = at, .key = (int)k};
    return 1;
  }
  return kvp__param_fail(err, errcap, err_at, at, "%s: unknown parameter '%.*s'", codec, (int)klen, params + at);
}

/* The value equals s. */
static inline int kvp__param_is(const kvp__param *p, const char *s) {
  return strlen(s) == p->val_len && memcmp(s, p->val, p->val_len) == 0;
}

/* The value as a decimal unsigned integer below 2^32 (digits only). */
static inline int kvp__param_u32(const kvp__param *p, uint32_t *out) {
  uint64_t v = 0;
  if (p->val_len == 0 || p->val_len > 10) return 0;
  for (size_t i = 0; i < p->val_len; i++) {
    if (p->val[i] < '0' || p->val[i] > '9') return 0;
    v = v * 10 + (uint64_t)(p->val[i] - '0');
  }
  if (v > UINT32_MAX) return 0;
  *out = (uint32_t)v;
  return 1;
}

/* The value as a finite float (strtof syntax, the whole value). */
static inline int kvp__param_f32(const kvp__param *p, float *out) {
  char buf[64], *end;
  if (p->val_len == 0 || p->val_len >= sizeof buf) return 0;
  memcpy(buf, p->val, p->val_len);
  buf[p->val_len] = '\0';
  float v = strtof(buf, &end);
  if (*end != '\0' || !isfinite(v)) return 0;
  *out = v;
  return 1;
}

/* ---- geometry ------------------------------------------------------------ */

/* head_dim in 1..KVP_MAX_HEAD_DIM, a known in_dtype, kv 0 or 1. */
static inline int kvp__codec_geom_ok(const char *codec, const kvp_codec_geom *g, char *err, size_t errcap) {
  if (!g) return kvp__param_fail(err, errcap, NULL, 0, "%s: no geometry", codec);
  if (g->head_dim < 1 || g->head_dim > KVP_MAX_HEAD_DIM)
    return kvp__param_fail(err, errcap, NULL, 0, "%s: head_dim %u not in 1..%u", codec, g->head_dim, KVP_MAX_HEAD_DIM);
  if (g->in_dtype != KVP_DTYPE_F32 && g->in_dtype != KVP_DTYPE_BF16 && g->in_dtype != KVP_DTYPE_F16)
    return kvp__param_fail(err, errcap, NULL, 0, "%s: in_dtype %d unknown", codec, (int)g->in_dtype);
  if (g->kv > 1) return kvp__param_fail(err, errcap, NULL, 0, "%s: kv %u not 0 (K) or 1 (V)", codec, g->kv);
  return KVP_OK;
}

/* The block arguments every encode/decode checks: 1 <= cap <= 65536,
 * n <= cap, and for decode t0 + m <= n. KVP_EINVAL (message set) if not. */
static inline int kvp__codec_rows_ok(const char *codec, uint32_t n, uint32_t cap, uint32_t t0, uint32_t m) {
  if (cap < 1 || cap > 65536 || n > cap || (uint64_t)t0 + m > n)
    return kvp__err(KVP_EINVAL, "%s: rows [%u, %u) of a block of %u tokens holding %u", codec, t0,
                    (unsigned)((uint64_t)t0 + m), cap, n);
  return KVP_OK;
}

#endif /* KVP_CODECS_BUILTIN_H */
