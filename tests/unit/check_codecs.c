/*
 * tests/unit/check_codecs.c - the built-in quantizing codecs (fp8, int8,
 * kivi, nvfp4) through their vtables: create with params, layout, encode,
 * decode. Loop tests sweep every (codec, params) case, head dims 64, 128,
 * 256, K and V, and the three input dtypes.
 *
 * What is checked, from the page bytes as each codec's banner documents
 * them (scales read back from the pages, not from the codec):
 *   - layout() equals the byte formula for every cap in 1..4096 and 65536;
 *   - round trip error: fp8 within half an E4M3 ulp of x/s, times s; int8
 *     within s/2 (clipped outliers saturate); kivi within s/2 of its group,
 *     every value inside [min, min + Q s]; nvfp4 at the grid point nearest
 *     x (in units of its 16-block scale times the block-head scale);
 *   - rule 4/6 never has a larger 16-block squared error than rule 6;
 *     K-smoothing with the mean stored never loses on K with token offsets;
 *   - scaling by 2^k scales the output by exactly 2^k (fp8, int8, nvfp4);
 *   - zeros decode to exact zeros; bad params fail with KVP_EINVAL and a
 *     message naming the parameter;
 *   - decode to f32, bf16, f16, and any sub-range equals the full decode;
 *   - every page byte is written (rows past n are zeros), and the bit
 *     orders are pinned by hand-written bytes.
 */
#include "../../codecs/builtin.h"
#include "../../codecs/numeric.h"
#include "../../util/util.h"
#include "testutil.h"

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* An assertion for inner loops: Check's ck_assert marks a point (a write
 * to the parent in fork mode) each time it passes; this one only fails. */
#define ck_hot(expr, ...)                                                                                              \
  do {                                                                                                                 \
    if (!(expr)) ck_assert_msg(0, __VA_ARGS__);                                                                        \
  } while (0)

/* ---- the cases ----------------------------------------------------------- */

enum { FP8, INT8, KIVI, NVFP4 };

typedef struct ccase {
  const kvp_codec_vtable *vt; /* the codec */
  const char *params;         /* its params */
  int kind;                   /* FP8 .. NVFP4 */
  int dynamic;                /* fp8: per token-head scale */
  float static_scale;         /* fp8 static: the scale */
  float pct;                  /* int8: clip percentile */
  unsigned bits, group;       /* kivi: b, G */
  int rule46, ksmooth;        /* nvfp4 */
} ccase;

static const ccase cases[] = {
    {&kvp__codec_fp8, "", FP8, 1, 0, 0, 0, 0, 0, 0},
    {&kvp__codec_fp8, "scale=dynamic", FP8, 1, 0, 0, 0, 0, 0, 0},
    {&kvp__codec_fp8, "scale=0.03125", FP8, 0, 0.03125f, 0, 0, 0, 0, 0},
    {&kvp__codec_int8, "", INT8, 0, 0, 100.0f, 0, 0, 0, 0},
    {&kvp__codec_int8, "pct=99.5", INT8, 0, 0, 99.5f, 0, 0, 0, 0},
    {&kvp__codec_int8, "pct=90", INT8, 0, 0, 90.0f, 0, 0, 0, 0},
    {&kvp__codec_kivi, "", KIVI, 0, 0, 0, 2, 32, 0, 0},
    {&kvp__codec_kivi, "bits=4:group=64", KIVI, 0, 0, 0, 4, 64, 0, 0},
    {&kvp__codec_kivi, "group=16:bits=2:residual=128", KIVI, 0, 0, 0, 2, 16, 0, 0},
    {&kvp__codec_kivi, "bits=4:group=128", KIVI, 0, 0, 0, 4, 128, 0, 0},
    {&kvp__codec_nvfp4, "", NVFP4, 0, 0, 0, 0, 0, 0, 0},
    {&kvp__codec_nvfp4, "rule=4/6", NVFP4, 0, 0, 0, 0, 0, 1, 0},
    {&kvp__codec_nvfp4, "ksmooth=store", NVFP4, 0, 0, 0, 0, 0, 0, 1},
    {&kvp__codec_nvfp4, "rule=4/6:ksmooth=store", NVFP4, 0, 0, 0, 0, 0, 1, 1},
    {&kvp__codec_nvfp4, "rule=6:ksmooth=none", NVFP4, 0, 0, 0, 0, 0, 0, 0},
};
#define NCASES ((int)KVP__ARRAY_LEN(cases))

static const uint32_t dims[] = {64, 128, 256};
#define NDIMS 3
static const kvp_dtype dtypes[] = {KVP_DTYPE_F32, KVP_DTYPE_BF16, KVP_DTYPE_F16};

/* Loop index i -> (case, head dim, kv). */
static void unpack_i(int i, const ccase **c, uint32_t *d, uint32_t *kv) {
  *c = &cases[i % NCASES];
  *d = dims[i / NCASES % NDIMS];
  *kv = (uint32_t)(i / (NCASES * NDIMS));
}
#define NLOOP (NCASES * NDIMS * 2)

static void *make(const ccase *c, uint32_t d, uint32_t kv, kvp_dtype in) {
  kvp_codec_geom g = {.head_dim = d, .in_dtype = in, .layer = 3, .kv = kv};
  char err[256] = "";
  size_t at = 0;
  void *inst = NULL;
  int rc = c->vt->create(c->params, &g, &inst, err, sizeof err, &at);
  ck_assert_msg(rc == KVP_OK && inst, "%s:%s D=%u: %s", c->vt->name, c->params, d, err);
  return inst;
}

/* ---- blocks: pages sized exactly by the layout (ASan sees overruns) ------- */

typedef struct blk {
  kvp_codec_layout lay; /* the codec's layout */
  uint8_t *pg[KVP_CODEC_MAX_PAGES];
} blk;

static void blk_new(blk *b, const ccase *c, void *inst, uint32_t cap, int fill) {
  c->vt->layout(inst, cap, &b->lay);
  for (uint32_t p = 0; p < b->lay.npages; p++) {
    b->pg[p] = malloc(b->lay.bytes[p]);
    ck_assert_ptr_nonnull(b->pg[p]);
    memset(b->pg[p], fill, b->lay.bytes[p]);
  }
}

static void blk_free(blk *b) {
  for (uint32_t p = 0; p < b->lay.npages; p++) free(b->pg[p]);
}

static const void *const *cpg(const blk *b) { return (const void *const *)b->pg; }

/* ---- data ------------------------------------------------------------------ */

static double t_unit(uint64_t *s) { return (double)(t_rand(s) >> 11) * 0x1p-53; }

static float t_gauss(uint64_t *s) {
  double u = t_unit(s), v = t_unit(s);
  return (float)(sqrt(-2.0 * log(u + 0x1p-60)) * cos(6.283185307179586 * v));
}

enum { P_GAUSS, P_CHANNELS, P_OFFSET, P_WIDE, P_SPARSE, NPAT };

/* n x d values of pattern pat: gaussian; K-like per-channel scales with
 * outliers; per-token offsets; magnitudes spread over 2^-20..2^10; mostly
 * zeros. All within the fp16 range. */
static void gen(float *x, uint32_t n, uint32_t d, int pat, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (uint32_t t = 0; t < n; t++) {
    float off = pat == P_OFFSET ? 4.0f + 16.0f * (float)t_unit(&s) : 0.0f;
    for (uint32_t i = 0; i < d; i++) {
      float v = t_gauss(&s), *o = &x[(size_t)t * d + i];
      if (pat == P_CHANNELS) v *= 0.1f + 10.0f * (float)((i * 7919u) % 97u) / 97.0f;
      if (pat == P_CHANNELS && t_rand(&s) % 100 == 0) v *= 40.0f;
      if (pat == P_WIDE) v = ldexpf(v < 0 ? -1.0f : 1.0f, (int)(t_rand(&s) % 31) - 20) * (1.0f + (float)t_unit(&s));
      if (pat == P_SPARSE) v = t_rand(&s) % 64 == 0 ? 3.0f * v : 0.0f;
      *o = v + off;
    }
  }
}

/* Rows of x in dtype dt (src) and the values they hold back in f32 (x). */
static void *to_dtype(float *x, size_t count, kvp_dtype dt) {
  void *src = malloc(count * kvp__dtype_bytes(dt));
  ck_assert_ptr_nonnull(src);
  kvp__row_from_f32(src, dt, x, count);
  kvp__row_to_f32(x, src, dt, count);
  return src;
}

static float ld_f32(const uint8_t *p) {
  uint32_t u = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
static uint16_t ld_u16(const uint8_t *p) { return (uint16_t)(p[0] | p[1] << 8); }

/* ---- layout ------------------------------------------------------------------ */

static void want_layout(const ccase *c, uint32_t d, uint32_t kv, uint32_t cap, kvp_codec_layout *w) {
  uint64_t n = cap;
  memset(w, 0, sizeof *w);
  w->types[0] = KVP_PAGE_CODES;
  w->types[1] = KVP_PAGE_SCALES;
  w->npages = 2;
  switch (c->kind) {
  case FP8:
    w->npages = c->dynamic ? 2 : 1;
    w->bytes[0] = n * d;
    w->bytes[1] = c->dynamic ? 4 * n : 0;
    w->types[1] = c->dynamic ? KVP_PAGE_SCALES : 0;
    break;
  case INT8:
    w->bytes[0] = n * d;
    w->bytes[1] = 2 * n;
    break;
  case KIVI:
    w->bytes[0] = n * d * c->bits / 8;
    w->bytes[1] = kv == 0 ? (n + c->group - 1) / c->group * 4 * d : n * 4 * d / c->group;
    break;
  default:
    w->npages = 3;
    w->bytes[0] = n * d / 2;
    w->bytes[1] = n * (d / 16 + (c->ksmooth ? 2 : 0));
    w->types[2] = KVP_PAGE_META;
    w->bytes[2] = 4;
  }
}

START_TEST(layout_formula) {
  const ccase *c;
  uint32_t d, kv;
  unpack_i(_i, &c, &d, &kv);
  if (c->kind == KIVI && d % c->group) return;
  void *inst = make(c, d, kv, KVP_DTYPE_BF16);
  for (uint32_t k = 1; k <= 4097; k++) {
    uint32_t cap = k <= 4096 ? k : 65536;
    kvp_codec_layout got, want;
    memset(&got, 0xA5, sizeof got);
    c->vt->layout(inst, cap, &got);
    want_layout(c, d, kv, cap, &want);
    ck_hot(got.npages == want.npages, "%s:%s cap=%u: %u pages", c->vt->name, c->params, cap, got.npages);
    for (uint32_t p = 0; p < want.npages; p++) {
      ck_hot(got.types[p] == want.types[p] && got.bytes[p] == want.bytes[p],
             "%s:%s D=%u kv=%u cap=%u page %u: type %d %" PRIu64 " B, want %d %" PRIu64, c->vt->name, c->params, d, kv,
             cap, p, got.types[p], got.bytes[p], want.types[p], want.bytes[p]);
    }
  }
  uint32_t gt = c->vt->group_tokens(inst);
  ck_assert_uint_eq(gt, c->kind == KIVI && kv == 0 ? c->group : 1);
  c->vt->destroy(inst);
}
END_TEST

/* The figures of DESIGN.md section 7 at D = 128, per token-head. */
START_TEST(layout_d128_figures) {
  static const struct {
    int ci;             /* index in cases */
    uint64_t per_token; /* CODES + SCALES bytes per token-head */
    uint64_t meta;      /* META bytes per block-head */
  } fig[] = {{0, 132, 0}, {2, 128, 0}, {3, 130, 0}, {6, 48, 0}, {7, 64 + 8, 0}, {10, 72, 4}, {12, 74, 4}};
  for (size_t f = 0; f < KVP__ARRAY_LEN(fig); f++) {
    const ccase *c = &cases[fig[f].ci];
    for (uint32_t kv = 0; kv < 2; kv++) {
      void *inst = make(c, 128, kv, KVP_DTYPE_BF16);
      for (uint32_t cap = 128; cap <= 4096; cap *= 2) {
        kvp_codec_layout l;
        c->vt->layout(inst, cap, &l);
        uint64_t cs = 0, meta = 0;
        for (uint32_t p = 0; p < l.npages; p++) *(l.types[p] == KVP_PAGE_META ? &meta : &cs) += l.bytes[p];
        ck_assert_msg(cs == fig[f].per_token * cap && meta == fig[f].meta, "%s:%s kv=%u cap=%u: %" PRIu64 " + %" PRIu64,
                      c->vt->name, c->params, kv, cap, cs, meta);
      }
      c->vt->destroy(inst);
    }
  }
}
END_TEST

/* ---- round-trip bounds, from the page bytes ------------------------------------ */

/* One encoded block: d, n rows of input x (f32 values), its pages, and the
 * f32 decode y of rows [0, n). */
typedef struct rt {
  const ccase *c;
  uint32_t d, kv, n, cap;
  const float *x, *y;
  const blk *b;
} rt;

#define SLACK(v) (1e-6 * (v) + 1e-37)

static void check_fp8(const rt *r) {
  for (uint32_t t = 0; t < r->n; t++) {
    const float *x = r->x + (size_t)t * r->d, *y = r->y + (size_t)t * r->d;
    float s = r->c->dynamic ? ld_f32(r->b->pg[1] + 4 * t) : r->c->static_scale;
    double amax = 0;
    for (uint32_t i = 0; i < r->d; i++) amax = fmax(amax, fabs(x[i]));
    if (r->c->dynamic && amax == 0) ck_hot(s == 0.0f, "fp8 t %u: zero token, scale %g", t, s);
    if (r->c->dynamic && amax > 0) ck_hot(fabs(s - amax / 448) <= SLACK(amax / 448), "t %u: s %g", t, s);
    for (uint32_t i = 0; i < r->d; i++) {
      double yy = s > 0 ? fabs(x[i]) / s : 0, err = fabs((double)x[i] - y[i]), bound;
      if (r->c->dynamic) ck_hot(yy <= 448 * (1 + 1e-6), "fp8 t %u i %u: |x|/s %g > 448", t, i, yy);
      if (yy >= 448) {
        bound = (yy - 448) * s;
      } else {
        int e = yy > 0 ? ilogb(yy * (1 + 0x1p-20)) : -6;
        bound = ldexp(1.0, (e < -6 ? -6 : e) - 4) * s;
      }
      ck_hot(err <= bound + SLACK(fabs(x[i])), "fp8 t %u i %u: x %g y %g s %g", t, i, x[i], y[i], s);
    }
  }
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* The int8 clip of a row, computed in double. */
static double ref_clip(const float *x, uint32_t d, float pct) {
  double a[KVP_MAX_HEAD_DIM], p = pct / 100.0 * (d - 1);
  for (uint32_t i = 0; i < d; i++) a[i] = fabs(x[i]);
  qsort(a, d, sizeof *a, cmp_double);
  uint32_t j = (uint32_t)p;
  double c = j + 1 < d ? a[j] + (a[j + 1] - a[j]) * (p - j) : a[d - 1];
  return c > 0 ? c : a[d - 1];
}

static void check_int8(const rt *r) {
  for (uint32_t t = 0; t < r->n; t++) {
    const float *x = r->x + (size_t)t * r->d, *y = r->y + (size_t)t * r->d;
    double s = kvp__bf16_to_f32(ld_u16(r->b->pg[1] + 2 * t)), clip = ref_clip(x, r->d, r->c->pct);
    if (clip == 0) ck_hot(s == 0, "int8 t %u: zero token, scale %g", t, s);
    else ck_hot(s >= clip / 127 * (1 - 1e-6) && s <= clip / 127 * (1 + 0x1p-7) * (1 + 1e-6), "t %u", t);
    for (uint32_t i = 0; i < r->d; i++) {
      double ax = fabs(x[i]), err = fabs((double)x[i] - y[i]);
      ck_hot(fabs(y[i]) <= 127 * s, "int8 t %u i %u: y %g beyond 127 s", t, i, y[i]);
      double bound = ax <= clip ? s / 2 : fmax(s / 2, ax - 127 * s);
      ck_hot(err <= bound + SLACK(ax), "int8 t %u i %u: x %g y %g s %g clip %g", t, i, x[i], y[i], s, clip);
    }
  }
}

/* A kivi group: values x[k * step] for k < len, its record, its decode. */
static void check_kivi_group(const rt *r, const float *x, const float *y, size_t step, uint32_t len,
                             const uint8_t *rec) {
  double s = kvp__f16_to_f32(ld_u16(rec)), m = kvp__f16_to_f32(ld_u16(rec + 2)), q = (1u << r->c->bits) - 1;
  double lo = INFINITY, hi = -INFINITY;
  for (uint32_t k = 0; k < len; k++) lo = fmin(lo, x[k * step]), hi = fmax(hi, x[k * step]);
  ck_hot(m <= lo && m >= lo - fabs(lo) * 0x1p-10 - 0x1p-24, "min %g of a group in [%g, %g]", m, lo, hi);
  ck_hot(hi <= m + q * s + SLACK(fabs(hi)), "max %g above min %g + %g * %g", hi, m, q, s);
  ck_hot(s <= (hi - m) / q * (1 + 0x1p-10) + 0x1p-24, "scale %g for range %g", s, hi - m);
  for (uint32_t k = 0; k < len; k++) {
    double err = fabs((double)x[k * step] - y[k * step]);
    ck_hot(err <= s / 2 + SLACK(fabs(x[k * step]) + fabs(m) + q * s), "kivi: x %g y %g s %g m %g", x[k * step],
           y[k * step], s, m);
  }
}

static void check_kivi(const rt *r) {
  uint32_t d = r->d, gs = r->c->group;
  if (r->kv == 0) {
    for (uint32_t r0 = 0; r0 < r->n; r0 += gs)
      for (uint32_t i = 0; i < d; i++)
        check_kivi_group(r, r->x + (size_t)r0 * d + i, r->y + (size_t)r0 * d + i, d, r->n - r0 < gs ? r->n - r0 : gs,
                         r->b->pg[1] + ((size_t)(r0 / gs) * d + i) * 4);
    return;
  }
  for (uint32_t t = 0; t < r->n; t++)
    for (uint32_t g = 0; g < d / gs; g++)
      check_kivi_group(r, r->x + (size_t)t * d + g * gs, r->y + (size_t)t * d + g * gs, 1, gs,
                       r->b->pg[1] + ((size_t)t * (d / gs) + g) * 4);
}

/* Distance from v to the nearest point of the E2M1 grid times u. */
static double grid_dist(double v, double u) {
  static const double grid[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  double best = INFINITY;
  for (int k = 0; k < 8; k++) best = fmin(best, fabs(fabs(v) - grid[k] * u));
  return best;
}

static float nvfp4_mean(const rt *r, uint32_t t) {
  if (!r->c->ksmooth) return 0.0f;
  return kvp__bf16_to_f32(ld_u16(r->b->pg[1] + (size_t)r->cap * (r->d / 16) + 2 * t));
}

/* One 16-block of token t: scale, ratio of its amax to the scale, grid. */
static void check_nvfp4_block(const rt *r, uint32_t t, uint32_t k, double g) {
  const float *x = r->x + (size_t)t * r->d + 16 * k, *y = r->y + (size_t)t * r->d + 16 * k;
  float mean = nvfp4_mean(r, t), xs[16];
  double s = kvp__fp8_e4m3_to_f32(r->b->pg[1][(size_t)t * (r->d / 16) + k]), u = s * g, a = 0;
  for (int i = 0; i < 16; i++) xs[i] = x[i] - mean, a = fmax(a, fabs(xs[i]));
  if (a == 0) {
    for (int i = 0; i < 16; i++) ck_hot(y[i] == mean, "nvfp4 t %u blk %u: zero block gives %g", t, k, y[i]);
    return;
  }
  ck_hot(s > 0, "nvfp4 t %u blk %u: zero scale", t, k);
  double low = r->c->rule46 ? 4 * 16.0 / 17 : 6 * 16.0 / 17; /* E4M3 rounds by <= 1/16 */
  ck_hot(a / u <= 6.375 * (1 + 1e-5), "t %u blk %u: amax/scale %g", t, k, a / u);
  if (s > 0x1p-6) ck_hot(a / u >= low * (1 - 1e-5), "t %u blk %u: amax/scale %g", t, k, a / u);
  for (int i = 0; i < 16; i++) {
    double err = fabs((double)x[i] - y[i]), slack = SLACK(fabs(x[i]) + fabs(mean) + 6 * u) * 4;
    ck_hot(err <= grid_dist(xs[i], u) + slack, "nvfp4 t %u i %u: x %g y %g unit %g", t, 16 * k + i, x[i], y[i], u);
  }
}

static void check_nvfp4(const rt *r) {
  double g = ld_f32(r->b->pg[2]), amax = 0;
  for (uint32_t t = 0; t < r->n; t++) {
    const float *x = r->x + (size_t)t * r->d;
    double sum = 0;
    float mean = nvfp4_mean(r, t);
    for (uint32_t i = 0; i < r->d; i++) sum += x[i], amax = fmax(amax, fabs(x[i] - mean));
    if (r->c->ksmooth)
      ck_hot(fabs(mean - sum / r->d) <= fabs(sum / r->d) * 0x1p-8 + 1e-37, "%s",
             "fabs(mean - sum / r->d) <= fabs(sum / r->d) * 0x1p-8 + 1e-37");
  }
  if (amax == 0) ck_hot(g == 0, "nvfp4: zero block-head, g %g", g);
  else ck_hot(fabs(g - amax / 2688) <= SLACK(amax / 2688), "g %g amax %g", g, amax);
  for (uint32_t t = 0; t < r->n; t++)
    for (uint32_t k = 0; k < r->d / 16; k++) check_nvfp4_block(r, t, k, g);
}

static void check_bounds(const rt *r) {
  switch (r->c->kind) {
  case FP8: check_fp8(r); break;
  case INT8: check_int8(r); break;
  case KIVI: check_kivi(r); break;
  default: check_nvfp4(r);
  }
}

/* Encode n rows of x (f32, n x d; overwritten by the dtype's values) and
 * decode them to f32 into y. */
static void encode_decode(const ccase *c, void *inst, kvp_dtype dt, float *x, uint32_t d, uint32_t n, uint32_t cap,
                          blk *b, float *y) {
  void *src = to_dtype(x, (size_t)n * d, dt);
  blk_new(b, c, inst, cap, 0xA5);
  ck_ok(c->vt->encode(inst, src, d * kvp__dtype_bytes(dt), n, cap, (void *const *)b->pg));
  ck_ok(c->vt->decode(inst, cpg(b), n, cap, 0, n, y, d * sizeof *y, KVP_DTYPE_F32));
  free(src);
}

static int skip(const ccase *c, uint32_t d) { return c->kind == KIVI && d % c->group; }

START_TEST(round_trip_bounds) {
  const ccase *c;
  uint32_t d, kv, cap = 64;
  unpack_i(_i, &c, &d, &kv);
  if (skip(c, d)) return;
  float *x = malloc((size_t)cap * d * sizeof *x), *y = malloc((size_t)cap * d * sizeof *y);
  for (int di = 0; di < 3; di++) {
    void *inst = make(c, d, kv, dtypes[di]);
    for (int pat = 0; pat < NPAT; pat++) {
      for (uint32_t n = cap; n >= 37; n = n == cap ? 37 : 0) {
        blk b;
        gen(x, n, d, pat, (uint64_t)_i * 1000 + (uint64_t)di * 100 + (uint64_t)pat * 10 + n);
        encode_decode(c, inst, dtypes[di], x, d, n, cap, &b, y);
        rt r = {c, d, kv, n, cap, x, y, &b};
        check_bounds(&r);
        blk_free(&b);
      }
    }
    c->vt->destroy(inst);
  }
  free(x);
  free(y);
}
END_TEST

/* ---- nvfp4: rule 4/6 and K-smoothing --------------------------------------------- */

enum { A_NEAR_MAX, A_MIDPOINTS, A_GLOBAL_MAX, A_TINY, A_CONST, NADV };

/* Adversarial blocks for rule 4/6: values near 3/4 of the block max (where
 * 4 wins), midpoints of the rule-6 grid, the block-head max in every block
 * (the 4-candidate saturates at 448), tiny blocks beside a huge one
 * (subnormal block scales), constant blocks. */
static void gen_adv(float *x, uint32_t n, uint32_t d, int kind, uint64_t seed) {
  static const float mid[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f};
  uint64_t s = seed;
  for (size_t e = 0; e < (size_t)n * d; e++) {
    float sign = t_rand(&s) & 1 ? -1.0f : 1.0f, v;
    size_t i16 = e % 16, blkno = e / 16;
    switch (kind) {
    case A_NEAR_MAX: v = i16 ? 0.6f + 0.25f * (float)t_unit(&s) : blkno ? 1.0f : 2.0f; break;
    case A_MIDPOINTS: v = i16 == 0 ? 6.0f : mid[t_rand(&s) % 8]; break;
    case A_GLOBAL_MAX: v = i16 == 0 ? 8.0f : 6.0f * (float)t_unit(&s); break;
    case A_TINY: v = blkno == 0 && i16 == 0 ? 1e4f : ldexpf((float)t_unit(&s), -14 - (int)(blkno % 8)); break;
    default: v = 0.3f * (float)(blkno % 5 + 1);
    }
    x[e] = sign * v;
  }
}

/* Squared error of 16-block k of token t. */
static double sse16(const float *x, const float *y, uint32_t d, uint32_t t, uint32_t k) {
  double e = 0;
  for (uint32_t i = 16 * k; i < 16 * k + 16; i++) {
    double v = (double)x[(size_t)t * d + i] - y[(size_t)t * d + i];
    e += v * v;
  }
  return e;
}

START_TEST(rule46_never_worse) {
  uint32_t d = dims[_i], n = 64;
  const ccase *c6 = &cases[10], *c46 = &cases[11];
  void *i6 = make(c6, d, 0, KVP_DTYPE_F32), *i46 = make(c46, d, 0, KVP_DTYPE_F32);
  float *x = malloc((size_t)n * d * 4), *y6 = malloc((size_t)n * d * 4), *y46 = malloc((size_t)n * d * 4);
  for (int set = 0; set < NPAT + NADV; set++) {
    unsigned better = 0;
    double t6 = 0, t46 = 0;
    for (uint64_t seed = 1; seed <= 4; seed++) {
      blk b6, b46;
      if (set < NPAT) gen(x, n, d, set, seed * 77 + d);
      else gen_adv(x, n, d, set - NPAT, seed * 77 + d);
      encode_decode(c6, i6, KVP_DTYPE_F32, x, d, n, n, &b6, y6);
      encode_decode(c46, i46, KVP_DTYPE_F32, x, d, n, n, &b46, y46);
      for (uint32_t t = 0; t < n; t++)
        for (uint32_t k = 0; k < d / 16; k++) {
          double e6 = sse16(x, y6, d, t, k), e46 = sse16(x, y46, d, t, k);
          ck_hot(e46 <= e6, "set %d t %u blk %u: 4/6 %g > 6 %g", set, t, k, e46, e6);
          better += e46 < e6;
          t6 += e6, t46 += e46;
        }
      blk_free(&b6);
      blk_free(&b46);
    }
    if (set == P_GAUSS || set == NPAT + A_NEAR_MAX) ck_hot(better > 0 && t46 < t6, "set %d: no gain", set);
  }
  free(x), free(y6), free(y46);
  c6->vt->destroy(i6), c46->vt->destroy(i46);
}
END_TEST

/* K with a per-token offset: storing the mean never loses, and wins big
 * when the offset dominates. Loop: dims x rule. */
START_TEST(ksmooth_not_worse) {
  uint32_t d = dims[_i % NDIMS], n = 64;
  const ccase *cn = &cases[_i < NDIMS ? 10 : 11], *cs = &cases[_i < NDIMS ? 12 : 13];
  void *in = make(cn, d, 0, KVP_DTYPE_BF16), *is = make(cs, d, 0, KVP_DTYPE_BF16);
  float *x = malloc((size_t)n * d * 4), *yn = malloc((size_t)n * d * 4), *ys = malloc((size_t)n * d * 4);
  for (uint64_t seed = 1; seed <= 20; seed++) {
    blk bn, bs;
    gen(x, n, d, P_OFFSET, seed);
    uint64_t r = seed;
    if (seed > 10)
      for (uint32_t t = 0; t < n; t++) {
        float off = 100.0f * (float)t_unit(&r) - 50.0f;
        for (uint32_t i = 0; i < d; i++) x[(size_t)t * d + i] += off;
      }
    encode_decode(cn, in, KVP_DTYPE_BF16, x, d, n, n, &bn, yn);
    encode_decode(cs, is, KVP_DTYPE_BF16, x, d, n, n, &bs, ys);
    double en = 0, es = 0;
    for (size_t e = 0; e < (size_t)n * d; e++) {
      en += ((double)x[e] - yn[e]) * ((double)x[e] - yn[e]);
      es += ((double)x[e] - ys[e]) * ((double)x[e] - ys[e]);
    }
    ck_assert_msg(es <= en, "seed %u: smoothed %g > plain %g", (unsigned)seed, es, en);
    ck_assert_msg(es < 0.5 * en, "seed %u: smoothed %g, plain %g: no real gain", (unsigned)seed, es, en);
    blk_free(&bn), blk_free(&bs);
  }
  free(x), free(yn), free(ys);
  cn->vt->destroy(in), cs->vt->destroy(is);
}
END_TEST

/* ---- scale equivariance ------------------------------------------------------------ */

START_TEST(scale_equivariance) {
  const ccase *c;
  uint32_t d, kv, n = 48;
  unpack_i(_i, &c, &d, &kv);
  if (c->kind == KIVI || (c->kind == FP8 && !c->dynamic)) return;
  static const int ks[] = {-40, -9, -1, 1, 6, 40};
  float *x = malloc((size_t)n * d * 4), *xk = malloc((size_t)n * d * 4);
  float *y = malloc((size_t)n * d * 4), *yk = malloc((size_t)n * d * 4);
  for (int di = 0; di < 2; di++) {
    void *inst = make(c, d, kv, dtypes[di]);
    for (int pat = P_GAUSS; pat <= P_OFFSET; pat++) {
      blk b;
      gen(x, n, d, pat, (uint64_t)_i + 17 * (uint64_t)pat);
      encode_decode(c, inst, dtypes[di], x, d, n, n, &b, y);
      for (size_t kk = 0; kk < KVP__ARRAY_LEN(ks); kk++) {
        blk bk;
        for (size_t e = 0; e < (size_t)n * d; e++) xk[e] = ldexpf(x[e], ks[kk]);
        encode_decode(c, inst, dtypes[di], xk, d, n, n, &bk, yk);
        ck_assert_mem_eq(bk.pg[0], b.pg[0], b.lay.bytes[0]); /* the codes do not move */
        for (size_t e = 0; e < (size_t)n * d; e++)
          ck_hot(yk[e] == ldexpf(y[e], ks[kk]), "%s:%s 2^%d: elt %zu %a vs %a", c->vt->name, c->params, ks[kk], e,
                 (double)yk[e], (double)y[e]);
        blk_free(&bk);
      }
      blk_free(&b);
    }
    c->vt->destroy(inst);
  }
  free(x), free(xk), free(y), free(yk);
}
END_TEST

/* ---- zeros --------------------------------------------------------------------------- */

START_TEST(zeros_decode_exactly) {
  const ccase *c;
  uint32_t d, kv, n = 64;
  unpack_i(_i, &c, &d, &kv);
  if (skip(c, d)) return;
  float *x = calloc((size_t)n * d, 4), *y = malloc((size_t)n * d * 4);
  void *inst = make(c, d, kv, KVP_DTYPE_F32);
  blk b;
  encode_decode(c, inst, KVP_DTYPE_F32, x, d, n, n, &b, y);
  for (size_t e = 0; e < (size_t)n * d; e++)
    ck_hot(y[e] == 0.0f, "%s:%s elt %zu: %a", c->vt->name, c->params, e, (double)y[e]);
  for (int di = 1; di < 3; di++) {
    uint16_t *h = malloc((size_t)n * d * 2);
    ck_ok(c->vt->decode(inst, cpg(&b), n, n, 0, n, h, d * 2, dtypes[di]));
    for (size_t e = 0; e < (size_t)n * d; e++)
      ck_hot((h[e] & 0x7FFF) == 0, "%s:%s out %d elt %zu: 0x%04x", c->vt->name, c->params, di, e, h[e]);
    free(h);
  }
  blk_free(&b);
  /* zero tokens (and, without smoothing, a zero 16-block) inside data */
  gen(x, n, d, P_CHANNELS, 99 + (uint64_t)_i);
  memset(x + 3 * d, 0, d * 4), memset(x + 10 * d, 0, d * 4), memset(x + 5 * d + 16, 0, 16 * 4);
  encode_decode(c, inst, KVP_DTYPE_F32, x, d, n, n, &b, y);
  for (size_t e = 0; e < (size_t)n * d; e++) {
    ck_hot(isfinite(y[e]), "%s:%s elt %zu: %g", c->vt->name, c->params, e, y[e]);
    int zero_row = e / d == 3 || e / d == 10, zero_blk = e / d == 5 && e % d >= 16 && e % d < 32;
    if ((zero_row && !(c->kind == KIVI && kv == 0)) || (zero_blk && c->kind == NVFP4 && !c->ksmooth))
      ck_hot(y[e] == 0.0f, "%s:%s elt %zu: %a", c->vt->name, c->params, e, (double)y[e]);
  }
  blk_free(&b);
  c->vt->destroy(inst);
  free(x), free(y);
}
END_TEST

/* ---- bad params -------------------------------------------------------------------- */

START_TEST(bad_params_fail) {
  static const struct {
    const kvp_codec_vtable *vt;
    const char *params;
    uint32_t d;
    const char *names; /* the message must contain this */
    size_t at;         /* *err_at */
  } bad[] = {
      {&kvp__codec_kivi, "bits=3", 128, "bits", 0},
      {&kvp__codec_kivi, "group=32:bits=8", 128, "bits", 9},
      {&kvp__codec_kivi, "group=48", 96, "group", 0},
      {&kvp__codec_kivi, "bits=2:group=128", 64, "group", 7},
      {&kvp__codec_kivi, "group=64", 96, "group", 0},
      {&kvp__codec_kivi, "bits=2:bits=4", 128, "bits", 7},
      {&kvp__codec_kivi, "residual=x", 128, "residual", 0},
      {&kvp__codec_kivi, "bits=2::group=32", 128, "want key=value", 7},
      {&kvp__codec_kivi, "window=4", 128, "window", 0},
      {&kvp__codec_fp8, "foo=1", 128, "foo", 0},
      {&kvp__codec_fp8, "scale=-1", 128, "scale", 0},
      {&kvp__codec_fp8, "scale=0", 128, "scale", 0},
      {&kvp__codec_fp8, "scale=inf", 128, "scale", 0},
      {&kvp__codec_fp8, "scale=1.5x", 128, "scale", 0},
      {&kvp__codec_fp8, "scale", 128, "scale", 0},
      {&kvp__codec_int8, "pct=0", 128, "pct", 0},
      {&kvp__codec_int8, "pct=100.5", 128, "pct", 0},
      {&kvp__codec_int8, "pct=", 128, "pct", 0},
      {&kvp__codec_int8, "bits=8", 128, "bits", 0},
      {&kvp__codec_nvfp4, "rule=5", 128, "rule", 0},
      {&kvp__codec_nvfp4, "rule=4/6:ksmooth=yes", 128, "ksmooth", 9},
      {&kvp__codec_nvfp4, "rule=4", 128, "rule", 0},
      {&kvp__codec_nvfp4, "", 72, "head_dim", 0},
  };
  for (size_t k = 0; k < KVP__ARRAY_LEN(bad); k++) {
    kvp_codec_geom g = {.head_dim = bad[k].d, .in_dtype = KVP_DTYPE_BF16, .kv = 1};
    char err[256] = "";
    size_t at = 999;
    void *inst = (void *)&g;
    int rc = bad[k].vt->create(bad[k].params, &g, &inst, err, sizeof err, &at);
    ck_assert_msg(rc == KVP_EINVAL, "%s:%s: rc %d", bad[k].vt->name, bad[k].params, rc);
    ck_assert_msg(inst == (void *)&g, "%s:%s: *inst written", bad[k].vt->name, bad[k].params);
    ck_assert_msg(strstr(err, bad[k].names) && strstr(err, bad[k].vt->name), "%s:%s: message '%s'", bad[k].vt->name,
                  bad[k].params, err);
    if (strcmp(bad[k].names, "head_dim") != 0)
      ck_assert_msg(at == bad[k].at, "%s:%s: err_at %zu, want %zu", bad[k].vt->name, bad[k].params, at, bad[k].at);
  }
  /* NULL params are the defaults; a trailing ':' is harmless */
  kvp_codec_geom g = {.head_dim = 128, .in_dtype = KVP_DTYPE_F16, .kv = 0};
  void *inst = NULL;
  ck_ok(kvp__codec_kivi.create(NULL, &g, &inst, NULL, 0, NULL));
  ck_assert_uint_eq(kvp__codec_kivi.group_tokens(inst), 32);
  kvp__codec_kivi.destroy(inst);
  ck_ok(kvp__codec_kivi.create("group=64:", &g, &inst, NULL, 0, NULL));
  ck_assert_uint_eq(kvp__codec_kivi.group_tokens(inst), 64);
  kvp__codec_kivi.destroy(inst);
  g.head_dim = 0;
  char err[128];
  ck_assert_int_eq(kvp__codec_fp8.create("", &g, &inst, err, sizeof err, NULL), KVP_EINVAL);
  ck_assert_ptr_nonnull(strstr(err, "head_dim"));
}
END_TEST

/* ---- out dtypes, sub-ranges, every byte written ---------------------------------------- */

START_TEST(out_dtypes_and_subranges) {
  const ccase *c;
  uint32_t d, kv, n = 50, cap = 64;
  unpack_i(_i, &c, &d, &kv);
  if (skip(c, d)) return;
  float *x = malloc((size_t)cap * d * 4), *ref = malloc((size_t)cap * d * 4);
  void *inst = make(c, d, kv, KVP_DTYPE_F16);
  blk b;
  gen(x, n, d, P_CHANNELS, 5 + (uint64_t)_i);
  encode_decode(c, inst, KVP_DTYPE_F16, x, d, n, cap, &b, ref);
  uint64_t rng = 11 + (uint64_t)_i;
  for (int di = 0; di < 3; di++) {
    size_t es = kvp__dtype_bytes(dtypes[di]), stride = d * es + 8, bytes = stride * cap;
    uint8_t *full = malloc(bytes), *part = malloc(bytes), want[KVP_MAX_HEAD_DIM * 4];
    memset(full, 0xCD, bytes);
    ck_ok(c->vt->decode(inst, cpg(&b), n, cap, 0, n, full, stride, dtypes[di]));
    for (uint32_t t = 0; t < n; t++) {
      kvp__row_from_f32(want, dtypes[di], ref + (size_t)t * d, d);
      ck_assert_mem_eq(full + t * stride, want, d * es);
      for (size_t j = d * es; j < stride; j++)
        ck_hot(full[t * stride + j] == 0xCD, "row %u: padding byte %zu written", t, j);
    }
    for (int trial = 0; trial < 40; trial++) {
      uint32_t t0 = (uint32_t)(t_rand(&rng) % (n + 1)), m = (uint32_t)(t_rand(&rng) % (n - t0 + 1));
      memset(part, 0xCD, bytes);
      ck_ok(c->vt->decode(inst, cpg(&b), n, cap, t0, m, part, stride, dtypes[di]));
      for (uint32_t r = 0; r < m; r++) ck_assert_mem_eq(part + r * stride, full + (t0 + r) * stride, d * es);
      for (size_t j = m * stride; j < bytes; j++) ck_hot(part[j] == 0xCD, "[%u, +%u): byte %zu written", t0, m, j);
    }
    ck_status(c->vt->decode(inst, cpg(&b), n, cap, n - 1, 2, part, stride, dtypes[di]), KVP_EINVAL);
    ck_status(c->vt->decode(inst, cpg(&b), cap + 1, cap, 0, 1, part, stride, dtypes[di]), KVP_EINVAL);
    free(full), free(part);
  }
  ck_status(c->vt->encode(inst, x, d * 2, cap + 1, cap, (void *const *)b.pg), KVP_EINVAL);
  blk_free(&b);
  c->vt->destroy(inst);
  free(x), free(ref);
}
END_TEST

/* Pages prefilled with 0x00 and 0xFF encode to the same bytes, and rows
 * past n are zeros in every per-token page. */
START_TEST(pages_fully_written) {
  const ccase *c;
  uint32_t d, kv, n = 37, cap = 64;
  unpack_i(_i, &c, &d, &kv);
  if (skip(c, d)) return;
  float *x = malloc((size_t)n * d * 4);
  void *inst = make(c, d, kv, KVP_DTYPE_BF16);
  gen(x, n, d, P_GAUSS, 3 + (uint64_t)_i);
  void *src = to_dtype(x, (size_t)n * d, KVP_DTYPE_BF16);
  blk b0, b1;
  blk_new(&b0, c, inst, cap, 0x00);
  blk_new(&b1, c, inst, cap, 0xFF);
  ck_ok(c->vt->encode(inst, src, d * 2, n, cap, (void *const *)b0.pg));
  ck_ok(c->vt->encode(inst, src, d * 2, n, cap, (void *const *)b1.pg));
  for (uint32_t p = 0; p < b0.lay.npages; p++) ck_assert_mem_eq(b0.pg[p], b1.pg[p], b0.lay.bytes[p]);
  size_t row_bytes = b0.lay.bytes[0] / cap;
  for (size_t j = n * row_bytes; j < b0.lay.bytes[0]; j++)
    ck_hot(b0.pg[0][j] == 0, "%s:%s: code byte %zu past row %u not zero", c->vt->name, c->params, j, n);
  blk_free(&b0), blk_free(&b1);
  c->vt->destroy(inst);
  free(src), free(x);
}
END_TEST

/* ---- bit orders pinned by hand --------------------------------------------------------- */

/* Encode n rows of D = 16 f32 values with params, return the pages. */
static void pin_encode(const kvp_codec_vtable *vt, const char *params, uint32_t kv, const float *x, uint32_t n, blk *b,
                       void **inst) {
  ccase c = {.vt = vt, .params = params};
  *inst = make(&c, 16, kv, KVP_DTYPE_F32);
  blk_new(b, &c, *inst, n, 0xA5);
  ck_ok(vt->encode(*inst, x, 16 * 4, n, n, (void *const *)b->pg));
}

static void pin_done(const kvp_codec_vtable *vt, blk *b, void *inst) {
  blk_free(b);
  vt->destroy(inst);
}

START_TEST(bit_order_pinned) {
  blk b;
  void *inst;
  /* fp8: s = 448/448 = 1 (fp32 LE 00 00 80 3F); 448 -> 0x7E, -1 -> 0xB8, 0.5 -> 0x30 */
  const float f8[16] = {448, -1, 0.5f};
  pin_encode(&kvp__codec_fp8, "", 1, f8, 1, &b, &inst);
  ck_assert_mem_eq(b.pg[0], ((const uint8_t[]){0x7E, 0xB8, 0x30, 0x00}), 4);
  ck_assert_mem_eq(b.pg[1], ((const uint8_t[]){0x00, 0x00, 0x80, 0x3F}), 4);
  pin_done(&kvp__codec_fp8, &b, inst);
  /* int8: s = 127/127 = 1 (bf16 LE 80 3F); -5 -> 0xFB, 2.5 -> 2 and 3.5 -> 4 (ties to even) */
  const float i8[16] = {127, -5, 2.5f, 3.5f, -127};
  pin_encode(&kvp__codec_int8, "", 1, i8, 1, &b, &inst);
  ck_assert_mem_eq(b.pg[0], ((const uint8_t[]){0x7F, 0xFB, 0x02, 0x04, 0x81, 0x00}), 6);
  ck_assert_mem_eq(b.pg[1], ((const uint8_t[]){0x80, 0x3F}), 2);
  pin_done(&kvp__codec_int8, &b, inst);
  /* kivi V b4 G16: x_i = i - 8: min -8 (fp16 0xC800), scale 1 (0x3C00), q_i = i, LSB first */
  float kv4[16];
  for (int i = 0; i < 16; i++) kv4[i] = (float)i - 8;
  pin_encode(&kvp__codec_kivi, "bits=4:group=16", 1, kv4, 1, &b, &inst);
  ck_assert_mem_eq(b.pg[0], ((const uint8_t[]){0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE}), 8);
  ck_assert_mem_eq(b.pg[1], ((const uint8_t[]){0x00, 0x3C, 0x00, 0xC8}), 4);
  pin_done(&kvp__codec_kivi, &b, inst);
  /* kivi K b2 G16: rows 0 and 1; channel i = (0, i % 4): codes of row 1 are
   * 0 3 3 3 ... (2 bits each, from bit 0 up: 0xFC per byte); channel 3's
   * record is scale 1, min 0; channel 0 is constant 0: scale 0 */
  float kk[32] = {0};
  for (int i = 0; i < 16; i++) kk[16 + i] = (float)(i % 4);
  pin_encode(&kvp__codec_kivi, "bits=2:group=16", 0, kk, 2, &b, &inst);
  ck_assert_mem_eq(b.pg[0], ((const uint8_t[]){0, 0, 0, 0, 0xFC, 0xFC, 0xFC, 0xFC}), 8);
  ck_assert_mem_eq(b.pg[1], ((const uint8_t[]){0, 0, 0, 0}), 4);
  ck_assert_mem_eq(b.pg[1] + 12, ((const uint8_t[]){0x00, 0x3C, 0x00, 0x00}), 4);
  ck_assert(kvp__f16_to_f32(ld_u16(b.pg[1] + 4)) >= 1.0f / 3); /* channel 1: scale rounded up */
  pin_done(&kvp__codec_kivi, &b, inst);
  /* nvfp4: amax 6, g = 6/2688, block scale 448 (0x7E); codes first element
   * in the low nibble: (6,-6) 0xF7, (3,.5) 0x15, (0,-1) 0xA0, (1.5,2) 0x43, (4,-4) 0xE6 */
  const float n4[16] = {6, -6, 3, 0.5f, 0, -1, 1.5f, 2, 4, -4};
  pin_encode(&kvp__codec_nvfp4, "", 0, n4, 1, &b, &inst);
  ck_assert_mem_eq(b.pg[0], ((const uint8_t[]){0xF7, 0x15, 0xA0, 0x43, 0xE6, 0, 0, 0}), 8);
  ck_assert_uint_eq(b.pg[1][0], 0x7E);
  ck_assert(ld_f32(b.pg[2]) == 6.0f / 2688.0f);
  float y[16];
  ck_ok(kvp__codec_nvfp4.decode(inst, cpg(&b), 1, 1, 0, 1, y, sizeof y, KVP_DTYPE_F32));
  for (int i = 0; i < 16; i++) ck_assert_msg(fabsf(y[i] - n4[i]) <= 1e-5f, "elt %d: %g", i, (double)y[i]);
  pin_done(&kvp__codec_nvfp4, &b, inst);
}
END_TEST

/* kivi stores fp16 minima: a value past the fp16 range is a codec error
 * that names the token and channel. */
START_TEST(kivi_fp16_range) {
  float x[2 * 64] = {0};
  x[64 + 5] = 70000.0f;
  for (uint32_t kv = 0; kv < 2; kv++) {
    void *inst;
    blk b;
    ccase c = {.vt = &kvp__codec_kivi, .params = "group=16"};
    inst = make(&c, 64, kv, KVP_DTYPE_F32);
    blk_new(&b, &c, inst, 16, 0);
    ck_status(kvp__codec_kivi.encode(inst, x, 64 * 4, 2, 16, (void *const *)b.pg), KVP_ECODEC);
    ck_assert_msg(strstr(kvp_last_error(), "token 1 channel 5"), "%s", kvp_last_error());
    x[64 + 5] = -65504.0f; /* the fp16 edge is fine */
    ck_ok(kvp__codec_kivi.encode(inst, x, 64 * 4, 2, 16, (void *const *)b.pg));
    x[64 + 5] = 70000.0f;
    pin_done(&kvp__codec_kivi, &b, inst);
  }
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("codecs");
  TCase *tc = tcase_create("layout");
  tcase_add_loop_test(tc, layout_formula, 0, NLOOP);
  tcase_add_test(tc, layout_d128_figures);
  suite_add_tcase(s, tc);
  tc = tcase_create("bounds");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, round_trip_bounds, 0, NLOOP);
  tcase_add_loop_test(tc, scale_equivariance, 0, NLOOP);
  tcase_add_loop_test(tc, zeros_decode_exactly, 0, NLOOP);
  suite_add_tcase(s, tc);
  tc = tcase_create("nvfp4");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, rule46_never_worse, 0, NDIMS);
  tcase_add_loop_test(tc, ksmooth_not_worse, 0, 2 * NDIMS);
  suite_add_tcase(s, tc);
  tc = tcase_create("api");
  tcase_add_test(tc, bad_params_fail);
  tcase_add_loop_test(tc, out_dtypes_and_subranges, 0, NLOOP);
  tcase_add_loop_test(tc, pages_fully_written, 0, NLOOP);
  tcase_add_test(tc, bit_order_pinned);
  tcase_add_test(tc, kivi_fp16_range);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return t_run(suite()); }
