/*
 * codecs/nvfp4.c - the NVFP4 codec (LongLive-2.0 KV cache): E2M1 element
 * codes, one E4M3 scale per 16 consecutive elements along D, and one fp32
 * scale per (block, head); optional K-smoothing with the per-token mean
 * stored.
 *
 * Params (spec "nvfp4", "nvfp4:rule=4/6:ksmooth=store"):
 *   rule=6    (default) each 16-block's scale maps its amax to 6
 *   rule=4/6  Four Over Six (LongLive-2.0 appendix F, eq. 12-13): per
 *             16-block, the candidates mapping the amax to 6 and to 4;
 *             keep the one with the lower squared error
 *   ksmooth=none|store  (default none) store: subtract each token's mean
 *             over D before quantizing (LongLive-2.0 eq. 6), keep it as
 *             bf16, add it back on decode. Any side may use it; it is
 *             meant for K.
 * head_dim must be a multiple of 16.
 *
 * Pages of a block of cap tokens, head dim D:
 *
 *   CODES   cap x D/2 bytes: row t at byte t*D/2, E2M1 codes (bit 3 the
 *           sign), first element in the LOW nibble (kvp__nib_pack):
 *             byte t*D/2 + j = c[2j] | c[2j+1] << 4
 *   SCALES  cap x D/16 bytes: byte t*D/16 + k = E4M3 code of the scale of
 *           elements [16k, 16k+16) of token t; then, with ksmooth=store,
 *           cap x 2 bytes: byte cap*D/16 + 2t = the bf16 mean of token t,
 *           little-endian
 *   META    4 bytes: the block-head scale g, IEEE fp32 little-endian
 *
 *   layout: CODES = cap*D/2, SCALES = cap*D/16 (+ 2*cap), META = 4
 *   Per token-head D/2 + D/16 (+2): 72 B at D = 128 (74 with the mean),
 *   plus 4 B per block-head (3.56x against bf16).
 *
 * Encode (f32; x = the token minus its bf16 mean with ksmooth=store):
 *   g = A / (6 * 448), A = max |x| over the n rows of the block (two-level
 *       NVFP4: the largest 16-block scale is 448 in E4M3), at least FLT_MIN
 *       when A > 0; g = 0 when A = 0 (then every code and scale is 0)
 *   per 16-block, u = x / g, a = max |u| over the block:
 *     target T (6, or 4 for rule 4/6's second candidate), scale
 *     s = E4M3(a / T) round to nearest even, saturating at 448; but if
 *       that E4M3 value is below 2^-6 (subnormal or 0) and
 *       a > 0, s = the least E4M3 value >= a/T (k * 2^-9, k = 1..8), so a
 *       block far below the block-head amax never saturates its codes
 *     code_i = E2M1(u_i / s), round to nearest even, saturating at 6
 *     rule 4/6: both candidates are decoded exactly as decode will, and
 *     the one with the lower sum of (x_i - x^_i)^2 (double) is kept; a
 *     tie keeps 6. g is the same for both rules, so the 6-candidate is
 *     bit for bit rule 6's encoding and a block's error under 4/6 never
 *     exceeds rule 6's (with ksmooth=store the comparison is on x minus
 *     the mean, before the mean is added back; the final f32 add may move
 *     the error by an ulp). The price: a block whose amax a passes 2/3 of
 *     the block-head amax A needs a scale above 448 to map a to 4, so its
 *     4-candidate saturates at 448 and maps a to 6a/A, between 4 and 6
 *     (for a = A it is the 6-candidate and 4/6 changes nothing). Four
 *     Over Six's reference code instead lowers g to A/(6*256) under 4/6,
 *     which frees those blocks but re-rounds every 6-candidate scale, so
 *     a block could then lose against rule 6; we keep rule 6's g.
 *   A block with a = 0 has scale code 0 and codes 0.
 * Decode: x^_i = (E2M1value(code_i) * s) * g (+ mean), in f32; the first
 *   product is exact.
 *
 * Invariants: with s from E4M3 round-to-nearest (relative error <= 2^-4),
 *   |u_i / s| <= T (1 + 2^-4), so x^_i is the grid point of
 *   {0, .5, 1, 1.5, 2, 3, 4, 6} * s*g nearest to x_i, or +-6 s*g for the
 *   few |x_i| in (6 s g, 6.375 s g]. Scaling the input by 2^k scales g and
 *   the mean by 2^k and leaves every code and block scale: the output
 *   scales by exactly 2^k (while g and the mean stay normal). Scale
 *   underflow: a tiny A gives g = FLT_MIN (u then stays below 2688, the
 *   codes keep their meaning); a block scale that E4M3 cannot hold above
 *   2^-6 takes the rounded-up subnormal rule above. An all-zero block-head
 *   decodes to zeros. Rows n..cap-1 are written as zeros.
 *   Range: |x| near FLT_MAX may decode to +-inf (6*448*g rounds up).
 */
#include "builtin.h"
#include "numeric.h"

#include <float.h>

#define NVFP4_BLOCK 16u                                /* elements per E4M3 scale */
#define NVFP4_GMAX (KVP__E2M1_MAX * KVP__FP8_E4M3_MAX) /* 2688: largest code * largest scale */
#define NVFP4_E4M3_MIN_NORMAL 0.015625f                /* 2^-6 */

/* A binding of nvfp4. */
typedef struct nvfp4_inst {
  uint32_t head_dim;  /* D, elements per token, a multiple of 16 */
  kvp_dtype in_dtype; /* dtype of appended rows */
  int rule46;         /* 1: rule 4/6; 0: rule 6 */
  int ksmooth;        /* 1: per token mean subtracted and stored */
} nvfp4_inst;

enum { KEY_RULE, KEY_KSMOOTH };
static const char *const nvfp4_keys[] = {"rule", "ksmooth"};

static int nvfp4_param(nvfp4_inst *f, const kvp__param *p, char *err, size_t errcap, size_t *err_at) {
  if (p->key == KEY_RULE) {
    if (!kvp__param_is(p, "6") && !kvp__param_is(p, "4/6"))
      return kvp__param_fail(err, errcap, err_at, p->at, "nvfp4: rule=%.*s: must be 6 or 4/6", (int)p->val_len, p->val);
    f->rule46 = kvp__param_is(p, "4/6");
  } else {
    if (!kvp__param_is(p, "none") && !kvp__param_is(p, "store"))
      return kvp__param_fail(err, errcap, err_at, p->at, "nvfp4: ksmooth=%.*s: must be none or store", (int)p->val_len,
                             p->val);
    f->ksmooth = kvp__param_is(p, "store");
  }
  return KVP_OK;
}

static int nvfp4_create(const char *params, const kvp_codec_geom *geom, void **inst, char *err, size_t errcap,
                        size_t *err_at) {
  int rc = kvp__codec_geom_ok("nvfp4", geom, err, errcap);
  if (rc) return rc;
  if (geom->head_dim % NVFP4_BLOCK)
    return kvp__param_fail(err, errcap, NULL, 0, "nvfp4: head_dim %u is not a multiple of 16", geom->head_dim);
  nvfp4_inst f = {.head_dim = geom->head_dim, .in_dtype = geom->in_dtype};
  size_t pos = 0;
  unsigned seen = 0;
  kvp__param p;
  while ((rc = kvp__param_next("nvfp4", params, &pos, nvfp4_keys, 2, &seen, &p, err, errcap, err_at)) == 1)
    if ((rc = nvfp4_param(&f, &p, err, errcap, err_at))) return rc;
  if (rc) return rc;
  nvfp4_inst *out = malloc(sizeof *out);
  if (!out) return kvp__param_fail(err, errcap, NULL, 0, "nvfp4: out of memory");
  *out = f;
  *inst = out;
  return KVP_OK;
}

static void nvfp4_destroy(void *inst) { free(inst); }

static uint32_t nvfp4_group_tokens(const void *inst) {
  (void)inst;
  return 1;
}

static void nvfp4_layout(const void *inst, uint32_t cap_tokens, kvp_codec_layout *out) {
  const nvfp4_inst *f = inst;
  memset(out, 0, sizeof *out);
  out->npages = 3;
  out->types[0] = KVP_PAGE_CODES;
  out->bytes[0] = (uint64_t)cap_tokens * (f->head_dim / 2);
  out->types[1] = KVP_PAGE_SCALES;
  out->bytes[1] = (uint64_t)cap_tokens * (f->head_dim / NVFP4_BLOCK + (f->ksmooth ? 2u : 0u));
  out->types[2] = KVP_PAGE_META;
  out->bytes[2] = 4;
}

/* ---- one 16-block -------------------------------------------------------------- */

/* The E4M3 scale code for a block of amax a > 0 and target T (see banner). */
static uint8_t nvfp4_scale_code(float a, float target) {
  float t = a / target;
  uint8_t c = kvp__fp8_e4m3_from_f32(t);
  if (kvp__fp8_e4m3_to_f32(c) >= NVFP4_E4M3_MIN_NORMAL) return c;
  float k = ceilf(t * 512.0f); /* codes 1..8 are k * 2^-9 */
  return (uint8_t)(k < 1.0f ? 1 : k > 8.0f ? 8 : k);
}

/* Quantize the block u[0..16) (x / g) with scale code sc into codes q;
 * returns the squared error of the decoded block against x. */
static double nvfp4_quant(const float *u, const float *x, float g, uint8_t sc, uint8_t *q) {
  float s = kvp__fp8_e4m3_to_f32(sc);
  double err = 0.0;
  for (uint32_t i = 0; i < NVFP4_BLOCK; i++) {
    q[i] = kvp__e2m1_from_f32(u[i] / s);
    double e = (double)x[i] - (double)(kvp__e2m1_to_f32(q[i]) * s * g);
    err += e * e;
  }
  return err;
}

/* Encode one 16-block of x: returns its scale code, codes in q. */
static uint8_t nvfp4_block(const nvfp4_inst *f, const float *x, float g, uint8_t *q) {
  float u[NVFP4_BLOCK], a = 0.0f;
  for (uint32_t i = 0; i < NVFP4_BLOCK; i++) {
    u[i] = x[i] / g;
    a = fmaxf(a, fabsf(u[i]));
  }
  if (a == 0.0f) {
    memset(q, 0, NVFP4_BLOCK);
    return 0;
  }
  uint8_t sc6 = nvfp4_scale_code(a, 6.0f);
  double e6 = nvfp4_quant(u, x, g, sc6, q);
  if (!f->rule46) return sc6;
  uint8_t sc4 = nvfp4_scale_code(a, 4.0f), q4[NVFP4_BLOCK];
  if (sc4 == sc6) return sc6;
  double e4 = nvfp4_quant(u, x, g, sc4, q4);
  if (!(e4 < e6)) return sc6;
  memcpy(q, q4, NVFP4_BLOCK);
  return sc4;
}

/* ---- a block of tokens ------------------------------------------------------- */

/* Row t of src in f32, minus its mean when smoothing: the mean is computed
 * (double sum / D, rounded to bf16) and stored when store is set, else
 * read back from the page. */
static void nvfp4_row(const nvfp4_inst *f, const void *src, size_t stride, uint32_t t, uint8_t *means, int store,
                      float *x) {
  uint32_t d = f->head_dim;
  kvp__row_to_f32(x, (const unsigned char *)src + (size_t)t * stride, f->in_dtype, d);
  if (!f->ksmooth) return;
  if (store) {
    double sum = 0.0;
    for (uint32_t i = 0; i < d; i++) sum += (double)x[i];
    kvp__st_le16(means + (size_t)t * 2, kvp__bf16_from_f32((float)(sum / d)));
  }
  float mean = kvp__bf16_to_f32(kvp__ld_le16(means + (size_t)t * 2));
  for (uint32_t i = 0; i < d; i++) x[i] -= mean;
}

static int nvfp4_encode(const void *inst, const void *src, size_t src_stride, uint32_t n, uint32_t cap_tokens,
                        void *const *pages) {
  const nvfp4_inst *f = inst;
  int rc = kvp__codec_rows_ok("nvfp4", n, cap_tokens, 0, n);
  if (rc) return rc;
  uint32_t d = f->head_dim, nsc = d / NVFP4_BLOCK;
  uint8_t *codes = pages[0], *scales = pages[1], *means = scales + (size_t)cap_tokens * nsc;
  float x[KVP_MAX_HEAD_DIM], amax = 0.0f;
  uint8_t q[KVP_MAX_HEAD_DIM];
  memset(codes, 0, (size_t)cap_tokens * (d / 2));
  memset(scales, 0, (size_t)cap_tokens * (nsc + (f->ksmooth ? 2u : 0u)));
  for (uint32_t t = 0; t < n; t++) {
    nvfp4_row(f, src, src_stride, t, means, 1, x);
    for (uint32_t i = 0; i < d; i++) amax = fmaxf(amax, fabsf(x[i]));
  }
  float g = amax == 0.0f ? 0.0f : fmaxf(amax / NVFP4_GMAX, FLT_MIN);
  kvp__st_lef32(pages[2], g);
  if (g == 0.0f) return KVP_OK;
  for (uint32_t t = 0; t < n; t++) {
    nvfp4_row(f, src, src_stride, t, means, 0, x);
    for (uint32_t k = 0; k < nsc; k++)
      scales[(size_t)t * nsc + k] = nvfp4_block(f, x + k * NVFP4_BLOCK, g, q + k * NVFP4_BLOCK);
    kvp__nib_pack(codes + (size_t)t * (d / 2), q, d);
  }
  return KVP_OK;
}

static int nvfp4_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap_tokens, uint32_t t0,
                        uint32_t m, void *dst, size_t dst_stride, kvp_dtype out) {
  const nvfp4_inst *f = inst;
  int rc = kvp__codec_rows_ok("nvfp4", n, cap_tokens, t0, m);
  if (rc) return rc;
  uint32_t d = f->head_dim, nsc = d / NVFP4_BLOCK;
  const uint8_t *codes = pages[0], *scales = pages[1], *means = scales + (size_t)cap_tokens * nsc;
  float g = kvp__ld_lef32(pages[2]), x[KVP_MAX_HEAD_DIM];
  uint8_t q[KVP_MAX_HEAD_DIM];
  for (uint32_t r = 0; r < m; r++) {
    uint32_t t = t0 + r;
    kvp__nib_unpack(q, codes + (size_t)t * (d / 2), d);
    float mean = f->ksmooth ? kvp__bf16_to_f32(kvp__ld_le16(means + (size_t)t * 2)) : 0.0f;
    for (uint32_t k = 0; k < nsc; k++) {
      float s = kvp__fp8_e4m3_to_f32(scales[(size_t)t * nsc + k]);
      for (uint32_t i = k * NVFP4_BLOCK; i < (k + 1) * NVFP4_BLOCK; i++) x[i] = kvp__e2m1_to_f32(q[i]) * s * g;
    }
    if (f->ksmooth)
      for (uint32_t i = 0; i < d; i++) x[i] += mean;
    kvp__row_from_f32((unsigned char *)dst + (size_t)r * dst_stride, out, x, d);
  }
  return KVP_OK;
}

const kvp_codec_vtable kvp__codec_nvfp4 = {
    .abi_version = KVP_CODEC_ABI_VERSION,
    .name = "nvfp4",
    .create = nvfp4_create,
    .destroy = nvfp4_destroy,
    .group_tokens = nvfp4_group_tokens,
    .layout = nvfp4_layout,
    .encode = nvfp4_encode,
    .decode = nvfp4_decode,
};
