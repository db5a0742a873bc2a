/*
 * tests/unit/check_qvg.c - the QVG codec (codecs/qvg.c) through its vtable,
 * and its k-means (codecs/kmeans.c).
 *
 * What is checked, from the page bytes as the codec's banner lays them out:
 *   - layout() equals the byte formula (Kc = min(K, cap)) for every cap in
 *     1..4096, 38,400 and 65536; the ratios against bf16 at N = 38,400,
 *     D = 128 are 6.97x (qvg) and 5.04x (qvg-pro), printed with and without
 *     size-class rounding;
 *   - smoothing is lossless bookkeeping: x - decode(x) equals the final
 *     residual minus its quantization, element by element, and the codes
 *     and scales are the quantizer's of that residual;
 *   - the codec is scale-equivariant (2^k, scales kept normal);
 *   - on video-shaped data one stage beats direct INT2 (stages=0, same
 *     groups) by >= 5x in MSE, and by >= 3x the gain on i.i.d. noise;
 *   - progressive stages: error falls with S on hierarchical data, the
 *     first stage gains most;
 *   - a warm start has lower inertia after one iteration than a cold one;
 *   - determinism (pages and state byte for byte), identical tokens and
 *     zeros exact, the FP8 underflow rule, bad params named;
 *   - decode to every dtype and any sub-range equals the full decode.
 * Encode time per 4096-token segment-head and decode GB/s are printed.
 */
#include "../../alloc/alloc.h"
#include "../../codecs/builtin.h"
#include "../../codecs/kernels.h"
#include "../../codecs/kmeans.h"
#include "../../codecs/numeric.h"
#include "../../util/util.h"
#include "testutil.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Fails only (Check's ck_assert writes to the parent each time it passes). */
#define ck_hot(expr, ...)                                                                                              \
  do {                                                                                                                 \
    if (!(expr)) ck_assert_msg(0, __VA_ARGS__);                                                                        \
  } while (0)

/* ---- instances and blocks ------------------------------------------------------- */

static void *make(const kvp_codec_vtable *vt, const char *params, uint32_t d, kvp_dtype in) {
  kvp_codec_geom g = {.head_dim = d, .in_dtype = in, .layer = 0, .kv = 0};
  char err[256] = "";
  size_t at = 0;
  void *inst = NULL;
  int rc = vt->create(params, &g, &inst, err, sizeof err, &at);
  ck_assert_msg(rc == KVP_OK && inst, "%s:%s D=%u: %s", vt->name, params, d, err);
  return inst;
}

/* One block: pages sized exactly by the layout (ASan sees overruns). */
typedef struct blk {
  kvp_codec_layout lay;
  uint8_t *pg[KVP_CODEC_MAX_PAGES];
} blk;

static void blk_new(blk *b, const kvp_codec_vtable *vt, const void *inst, uint32_t cap, int fill) {
  vt->layout(inst, cap, &b->lay);
  memset(b->pg, 0, sizeof b->pg);
  for (uint32_t p = 0; p < b->lay.npages; p++) {
    b->pg[p] = malloc(b->lay.bytes[p]);
    ck_assert_ptr_nonnull(b->pg[p]);
    memset(b->pg[p], fill, b->lay.bytes[p]);
  }
}

static void blk_free(blk *b) {
  for (uint32_t p = 0; p < b->lay.npages; p++) free(b->pg[p]);
}

/* A codec run: instance, dims, input rows (bf16 values, f32 copy in x). */
typedef struct run {
  const kvp_codec_vtable *vt;
  void *inst;
  uint32_t d, n, cap;
  uint16_t *src; /* n x d bf16 */
  blk b;
} run;

/* Encode x (n x d, rounded to bf16 in place) with vt:params, state if
 * given; decode to y (f32) when y is not NULL. */
static void run_codec(run *r, const kvp_codec_vtable *vt, const char *params, float *x, uint32_t d, uint32_t n,
                      uint32_t cap, void *state, float *y) {
  *r = (run){.vt = vt, .d = d, .n = n, .cap = cap};
  r->inst = make(vt, params, d, KVP_DTYPE_BF16);
  r->src = malloc((size_t)n * d * 2);
  ck_assert_ptr_nonnull(r->src);
  kvp__bf16_from_f32_row(r->src, x, (size_t)n * d);
  kvp__bf16_to_f32_row(x, r->src, (size_t)n * d);
  blk_new(&r->b, vt, r->inst, cap, 0xA5);
  void *const *pg = (void *const *)r->b.pg;
  if (state) ck_ok(vt->encode_stateful(r->inst, state, r->src, d * 2, n, cap, pg));
  else ck_ok(vt->encode(r->inst, r->src, d * 2, n, cap, pg));
  if (y) ck_ok(vt->decode(r->inst, (const void *const *)r->b.pg, n, cap, 0, n, y, d * sizeof *y, KVP_DTYPE_F32));
}

static void run_free(run *r) {
  blk_free(&r->b);
  free(r->src);
  r->vt->destroy(r->inst);
}

/* ---- data: video-shaped, hierarchical, noise ---------------------------------------- */

static double t_unit(uint64_t *s) { return (double)(t_rand(s) >> 11) * 0x1p-53; }

static float t_gauss(uint64_t *s) {
  double u = t_unit(s), v = t_unit(s);
  return (float)(sqrt(-2.0 * log(u + 0x1p-60)) * cos(6.283185307179586 * v));
}

enum { MAXPAT = 128 };
#define FINE_NOISE 0.1f /* noise of the hierarchical data */

/* n tokens: npat patterns (3 sigma) that tokens pick at random, a slow
 * per-channel random walk (0.05 per step over sqrt(t + 1)), noise 0.05.
 * With fine, a second level: one of 4 offsets (0.6 sigma) per token. */
static void gen_video(float *x, uint32_t n, uint32_t d, uint32_t npat, int fine, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 7;
  float *pat = malloc((size_t)(npat + 4) * d * sizeof *pat), *walk = calloc(d, sizeof *walk);
  ck_assert(pat && walk && npat <= MAXPAT);
  for (size_t e = 0; e < (size_t)npat * d; e++) pat[e] = 3.0f * t_gauss(&s);
  for (size_t e = (size_t)npat * d; e < (size_t)(npat + 4) * d; e++) pat[e] = 0.6f * t_gauss(&s);
  for (uint32_t t = 0; t < n; t++) {
    const float *p = pat + (size_t)(t_rand(&s) % npat) * d, *f = pat + (size_t)(npat + t_rand(&s) % 4) * d;
    for (uint32_t i = 0; i < d; i++) {
      walk[i] += 0.05f * t_gauss(&s);
      float v = p[i] + (fine ? f[i] + FINE_NOISE * t_gauss(&s) : walk[i] / sqrtf((float)t + 1) + 0.05f * t_gauss(&s));
      x[(size_t)t * d + i] = v;
    }
  }
  free(pat);
  free(walk);
}

/* A clip, frame by frame: np patches, each one of nobj objects (3 sigma)
 * plus its own offset (1 sigma); token (f, p) = patch p + a random walk
 * of 0.02 per frame + noise 0.05. Consecutive chunks are later frames of
 * the same patches. */
static void gen_clip(float *x, uint32_t frames, uint32_t np, uint32_t d, uint32_t nobj, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 5;
  float *obj = malloc((size_t)nobj * d * 4), *pat = malloc((size_t)np * d * 4), *walk = calloc((size_t)np * d, 4);
  ck_assert(obj && pat && walk);
  for (size_t e = 0; e < (size_t)nobj * d; e++) obj[e] = 3.0f * t_gauss(&s);
  for (uint32_t p = 0; p < np; p++) {
    const float *o = obj + (size_t)(t_rand(&s) % nobj) * d;
    for (uint32_t i = 0; i < d; i++) pat[(size_t)p * d + i] = o[i] + t_gauss(&s);
  }
  for (uint32_t f = 0; f < frames; f++)
    for (size_t e = 0; e < (size_t)np * d; e++) {
      walk[e] += 0.02f * t_gauss(&s);
      x[(size_t)f * np * d + e] = pat[e] + walk[e] + 0.05f * t_gauss(&s);
    }
  free(obj), free(pat), free(walk);
}

static void gen_noise(float *x, size_t count, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 3;
  for (size_t e = 0; e < count; e++) x[e] = 3.0f * t_gauss(&s);
}

static double mse(const float *x, const float *y, size_t count) {
  double e = 0;
  for (size_t i = 0; i < count; i++) e += ((double)x[i] - y[i]) * ((double)x[i] - y[i]);
  return e / (double)count;
}

/* MSE of vt:params on x (n x d, cap = n). */
static double codec_mse(const kvp_codec_vtable *vt, const char *params, float *x, uint32_t d, uint32_t n) {
  float *y = malloc((size_t)n * d * sizeof *y);
  run r;
  run_codec(&r, vt, params, x, d, n, n, NULL, y);
  double e = mse(x, y, (size_t)n * d);
  run_free(&r);
  free(y);
  return e;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- layout and bytes --------------------------------------------------------------- */

static const struct pcase {
  const kvp_codec_vtable *vt;
  const char *params;
  uint32_t s, g, b, k; /* the parameters they give */
} pcases[] = {
    {&kvp__codec_qvg, "", 1, 64, 2, 256},
    {&kvp__codec_qvg_pro, "", 4, 16, 2, 256},
    {&kvp__codec_qvg, "bits=4", 1, 64, 4, 256},
    {&kvp__codec_qvg, "stages=2:group=32:bits=4:k=100:iters=3", 2, 32, 4, 100},
    {&kvp__codec_qvg, "stages=0:group=16", 0, 16, 2, 256},
    {&kvp__codec_qvg_pro, "k=16:bits=4", 4, 16, 4, 16},
    {&kvp__codec_qvg, "k=1:group=8", 1, 8, 2, 1},
};
#define NPC ((int)KVP__ARRAY_LEN(pcases))

static void want_layout(const struct pcase *c, uint64_t d, uint64_t cap, kvp_codec_layout *w) {
  uint64_t kc = c->k < cap ? c->k : cap;
  memset(w, 0, sizeof *w);
  w->npages = c->s ? 4 : 2;
  w->types[0] = KVP_PAGE_CODES, w->bytes[0] = cap * d * c->b / 8;
  w->types[1] = KVP_PAGE_SCALES, w->bytes[1] = cap * d / c->g;
  if (!c->s) return;
  w->types[2] = KVP_PAGE_CENTROIDS, w->bytes[2] = c->s * kc * d * 2;
  w->types[3] = KVP_PAGE_ASSIGN, w->bytes[3] = c->s * cap;
}

START_TEST(layout_formula) {
  const struct pcase *c = &pcases[_i % NPC];
  uint32_t d = _i / NPC ? 256 : 64;
  void *inst = make(c->vt, c->params, d, KVP_DTYPE_BF16);
  for (uint32_t k = 1; k <= 4098; k++) {
    uint32_t cap = k <= 4096 ? k : k == 4097 ? 38400 : 65536;
    kvp_codec_layout got, want;
    memset(&got, 0xA5, sizeof got);
    c->vt->layout(inst, cap, &got);
    want_layout(c, d, cap, &want);
    ck_hot(got.npages == want.npages, "%s:%s cap %u: %u pages", c->vt->name, c->params, cap, got.npages);
    for (uint32_t p = 0; p < want.npages; p++)
      ck_hot(got.types[p] == want.types[p] && got.bytes[p] == want.bytes[p],
             "%s:%s D=%u cap=%u page %u: type %d %" PRIu64 " B, want %d %" PRIu64, c->vt->name, c->params, d, cap, p,
             got.types[p], got.bytes[p], want.types[p], want.bytes[p]);
  }
  ck_assert_uint_eq(c->vt->group_tokens(inst), 1);
  ck_assert_uint_eq(c->vt->state_bytes(inst), c->s ? 8 + (size_t)c->s * c->k * d * 2 : 0);
  c->vt->destroy(inst);
}
END_TEST

/* The allocated bytes of a page of b requested bytes (DESIGN.md 5). */
static uint64_t class_bytes(uint64_t b) {
  return b > KVP__SMALL_MAX_BYTES ? kvp__align_up(b, KVP__EXTENT_UNIT) : kvp__sc_size_slow(kvp__sc_index_slow(b));
}

START_TEST(ratio_vs_bf16) {
  enum { N = 38400, D = 128 };
  static const double want[2] = {6.97, 5.04};
  for (int c = 0; c < 2; c++) {
    void *inst = make(pcases[c].vt, "", D, KVP_DTYPE_BF16);
    kvp_codec_layout l;
    pcases[c].vt->layout(inst, N, &l);
    uint64_t req = 0, alloc = 0, bf16 = (uint64_t)N * D * 2;
    for (uint32_t p = 0; p < l.npages; p++) req += l.bytes[p], alloc += class_bytes(l.bytes[p]);
    double per_token = (double)req / N;
    printf("%-8s N=%u D=%u: %" PRIu64 " B (%.2f B/token) = %.3fx vs bf16; size classes %" PRIu64 " B = %.3fx\n",
           pcases[c].vt->name, N, D, req, per_token, (double)bf16 / req, alloc, (double)bf16 / alloc);
    const struct pcase *pc = &pcases[c]; /* D b/8 + D/g + S per token, S K 2D per segment-head */
    ck_assert_uint_eq(req, (uint64_t)N * (D * pc->b / 8 + D / pc->g + pc->s) + (uint64_t)pc->s * pc->k * 2 * D);
    ck_assert_msg(fabs((double)bf16 / req - want[c]) < 0.005, "%s: %.4fx", pcases[c].vt->name, (double)bf16 / req);
    ck_assert(alloc >= req && (double)bf16 / alloc > want[c] * 0.9);
    pcases[c].vt->destroy(inst);
  }
}
END_TEST

/* ---- smoothing is bookkeeping --------------------------------------------------------- */

static float ld_bf16(const uint8_t *p) { return kvp__bf16_to_f32((uint16_t)(p[0] | p[1] << 8)); }

/* The final residual of row t from the pages, computed as the encoder
 * does (f32, stage by stage); returns Q. */
static uint32_t page_residual(const run *r, const struct pcase *c, const float *x, uint32_t t, float *res) {
  uint32_t kc = c->k < r->cap ? c->k : r->cap;
  for (uint32_t i = 0; i < r->d; i++) res[i] = x[(size_t)t * r->d + i];
  for (uint32_t s = 0; s < c->s; s++) {
    uint32_t a = r->b.pg[3][(size_t)s * r->cap + t];
    ck_hot(a < kc && a < r->n, "t %u stage %u: assignment %u", t, s, a);
    for (uint32_t i = 0; i < r->d; i++) res[i] -= ld_bf16(r->b.pg[2] + (((size_t)s * kc + a) * r->d + i) * 2);
  }
  return (1u << (c->b - 1)) - 1;
}

/* Row t: the codes and scales are the quantizer's of the residual, and
 * x - y equals residual - dequantized residual. Adds both squared errors. */
static void check_row(const run *r, const struct pcase *c, const float *x, const float *y, uint32_t t, double *e_rec,
                      double *e_res) {
  float res[KVP_MAX_HEAD_DIM];
  uint8_t q[KVP_MAX_HEAD_DIM];
  uint32_t qm = page_residual(r, c, x, t, res), d = r->d, ng = d / c->g;
  kvp__msb8_unpack(q, r->b.pg[0] + (size_t)t * d * c->b / 8, d, c->b);
  for (uint32_t j = 0; j < ng; j++) {
    float amax = 0, s = kvp__fp8_e4m3_to_f32(r->b.pg[1][(size_t)t * ng + j]);
    for (uint32_t i = j * c->g; i < (j + 1) * c->g; i++) amax = fmaxf(amax, fabsf(res[i]));
    ck_hot(r->b.pg[1][(size_t)t * ng + j] == kvp__fp8_e4m3_from_f32(amax / (float)qm), "t %u group %u scale", t, j);
    for (uint32_t i = j * c->g; i < (j + 1) * c->g; i++) {
      float v = s > 0 ? fminf(fmaxf(kvp__round_even(res[i] / s), -(float)qm), (float)qm) : 0.0f;
      ck_hot(q[i] == (uint8_t)(v + (float)qm), "t %u i %u: code %u for %g / %g", t, i, q[i], res[i], s);
      double deq = ((double)q[i] - qm) * s, er = (double)res[i] - deq,
             ex = (double)x[(size_t)t * d + i] - y[(size_t)t * d + i];
      ck_hot(fabs(er - ex) <= 1e-6 * (fabs(x[(size_t)t * d + i]) + fabs(res[i])) + 1e-30, "t %u i %u: %g vs %g", t, i,
             ex, er);
      *e_rec += ex * ex, *e_res += er * er;
    }
  }
}

START_TEST(smoothing_is_bookkeeping) {
  const struct pcase *c = &pcases[_i];
  uint32_t d = 128, n = 512;
  float *x = malloc((size_t)n * d * 4), *y = malloc((size_t)n * d * 4);
  gen_video(x, n, d, 8, 0, 100 + (uint64_t)_i);
  run r;
  run_codec(&r, c->vt, c->params, x, d, n, n, NULL, y);
  double e_rec = 0, e_res = 0;
  for (uint32_t t = 0; t < n; t++) check_row(&r, c, x, y, t, &e_rec, &e_res);
  printf("%s:%-40s reconstruction MSE %.9g, final-residual quantization MSE %.9g\n", c->vt->name, c->params,
         e_rec / (n * d), e_res / (n * d));
  ck_assert_msg(fabs(e_rec - e_res) <= 1e-6 * e_res, "%g vs %g", e_rec, e_res);
  run_free(&r);
  free(x), free(y);
}
END_TEST

/* ---- scale equivariance -------------------------------------------------------------------- */

/* A scale code inside the range where scaling by 2^k is exact: a normal
 * E4M3 above the least normal 2^-6 (0x08, which A/Q rounds up to from the
 * subnormal grid too) and below the saturating 448, or 0 with q = 0. */
static int scale_ok(uint8_t sc) { return sc == 0 || (sc > 0x08 && sc < 0x7E); }

/* r and rk encode x and 2^k x: equal assignments, centroids times 2^k,
 * and every group whose scales are in range in both has equal codes and
 * decodes to exactly 2^k times. Returns the groups so checked. */
static uint64_t check_scaled(const run *r, const run *rk, const struct pcase *c, const float *y, const float *yk,
                             int k) {
  uint32_t d = r->d, ng = d / c->g, qm = (1u << (c->b - 1)) - 1;
  uint64_t ok = 0;
  if (c->s) {
    ck_assert_mem_eq(rk->b.pg[3], r->b.pg[3], r->b.lay.bytes[3]);
    for (uint64_t e = 0; e < r->b.lay.bytes[2]; e += 2)
      ck_hot(ld_bf16(rk->b.pg[2] + e) == ldexpf(ld_bf16(r->b.pg[2] + e), k), "centroid byte %" PRIu64, e);
  }
  for (uint32_t t = 0; t < r->n; t++) {
    uint8_t q[KVP_MAX_HEAD_DIM], qk[KVP_MAX_HEAD_DIM];
    kvp__msb8_unpack(q, r->b.pg[0] + (size_t)t * d * c->b / 8, d, c->b);
    kvp__msb8_unpack(qk, rk->b.pg[0] + (size_t)t * d * c->b / 8, d, c->b);
    for (uint32_t j = 0; j < ng; j++) {
      uint8_t s0 = r->b.pg[1][(size_t)t * ng + j], s1 = rk->b.pg[1][(size_t)t * ng + j];
      if (!scale_ok(s0) || !scale_ok(s1)) continue;
      ok++;
      for (uint32_t i = j * c->g; i < (j + 1) * c->g; i++) {
        size_t e = (size_t)t * d + i;
        ck_hot(s0 == 0 && s1 == 0 ? q[i] == qm && qk[i] == qm : q[i] == qk[i], "t %u i %u: codes %u %u", t, i, q[i],
               qk[i]);
        ck_hot(yk[e] == ldexpf(y[e], k), "%s:%s k=%d t %u i %u: %g vs %g", c->vt->name, c->params, k, t, i, yk[e],
               y[e]);
      }
    }
  }
  return ok;
}

START_TEST(scale_equivariance) {
  const struct pcase *c = &pcases[_i];
  static const int ks[] = {-1, 1, 3};
  uint32_t d = 64, n = 1024;
  float *x = malloc((size_t)n * d * 4), *y = malloc((size_t)n * d * 4);
  float *xk = malloc((size_t)n * d * 4), *yk = malloc((size_t)n * d * 4);
  gen_video(x, n, d, 8, 0, 7);
  gen_noise(xk, (size_t)n * d, 8);
  for (size_t e = 0; e < (size_t)n * d; e++) x[e] += xk[e]; /* residuals well inside the normal range */
  run r;
  run_codec(&r, c->vt, c->params, x, d, n, n, NULL, y);
  for (size_t kk = 0; kk < KVP__ARRAY_LEN(ks); kk++) {
    run rk;
    for (size_t e = 0; e < (size_t)n * d; e++) xk[e] = ldexpf(x[e], ks[kk]);
    run_codec(&rk, c->vt, c->params, xk, d, n, n, NULL, yk);
    uint64_t groups = (uint64_t)n * (d / c->g), ok = check_scaled(&r, &rk, c, y, yk, ks[kk]);
    if (kk == 0)
      printf("%s:%-40s 2^k scaling exact on %.1f%% of the groups (scales in range)\n", c->vt->name, c->params,
             100.0 * (double)ok / (double)groups);
    ck_assert_msg(ok >= groups / 2, "%s:%s k=%d: %" PRIu64 " of %" PRIu64 " groups in range", c->vt->name, c->params,
                  ks[kk], ok, groups);
    run_free(&rk);
  }
  run_free(&r);
  free(x), free(y), free(xk), free(yk);
}
END_TEST

/* ---- what smoothing buys --------------------------------------------------------------------- */

START_TEST(smoothing_gain_video_vs_noise) {
  static const struct {
    const char *smooth, *direct;
    uint32_t n;
  } cfg[] = {{"k=16:group=16", "stages=0:group=16", 512}, {"", "stages=0", 4096}};
  uint32_t d = 128, n = cfg[_i].n;
  float *x = malloc((size_t)n * d * 4);
  gen_video(x, n, d, 8, 0, 11);
  double gv = codec_mse(&kvp__codec_qvg, cfg[_i].direct, x, d, n) / codec_mse(&kvp__codec_qvg, cfg[_i].smooth, x, d, n);
  gen_noise(x, (size_t)n * d, 12);
  double gn = codec_mse(&kvp__codec_qvg, cfg[_i].direct, x, d, n) / codec_mse(&kvp__codec_qvg, cfg[_i].smooth, x, d, n);
  printf("qvg:%-16s N=%u: MSE gain over direct INT2 (%s) %.1fx on video, %.2fx on noise\n", cfg[_i].smooth, n,
         cfg[_i].direct, gv, gn);
  ck_assert_msg(gv >= 5.0, "video gain %.2f", gv);
  ck_assert_msg(gv >= 3.0 * gn, "video gain %.2f, noise gain %.2f", gv, gn);
  free(x);
}
END_TEST

START_TEST(progressive_stages) {
  static const char *const par[2][5] = {{"stages=0:group=16", "stages=1:k=16:group=16", "stages=2:k=16:group=16",
                                         "stages=3:k=16:group=16", "stages=4:k=16:group=16"},
                                        {"stages=0:bits=4:group=16", "stages=1:k=16:bits=4:group=16",
                                         "stages=2:k=16:bits=4:group=16", "stages=3:k=16:bits=4:group=16",
                                         "stages=4:k=16:bits=4:group=16"}};
  uint32_t d = 128, n = 512;
  float *x = malloc((size_t)n * d * 4);
  gen_video(x, n, d, 8, 1, 21);
  double e[5];
  for (int s = 0; s < 5; s++) e[s] = codec_mse(&kvp__codec_qvg, par[_i][s], x, d, n);
  printf("hierarchical, bits=%d: MSE by stages 0..4: %.3g %.3g %.3g %.3g %.3g; gains %.2fx %.2fx %.2fx %.2fx\n",
         _i ? 4 : 2, e[0], e[1], e[2], e[3], e[4], e[0] / e[1], e[1] / e[2], e[2] / e[3], e[3] / e[4]);
  ck_assert_msg(e[0] > e[1] && e[1] > e[2], "stages 0..2: %g %g %g", e[0], e[1], e[2]);
  for (int s = 2; s < 4; s++) ck_assert_msg(e[s] >= e[s + 1], "stage %d: %g < %g", s + 1, e[s], e[s + 1]);
  for (int s = 1; s < 4; s++) ck_assert_msg(e[0] / e[1] > e[s] / e[s + 1], "stage %d gains more than the first", s + 1);
  free(x);
}
END_TEST

/* ---- warm start ---------------------------------------------------------------------------- */

/* Sum of ||x - C[a]||^2 over the rows, stage 0, from the pages. */
static double page_inertia(const run *r, const float *x) {
  double sum = 0;
  for (uint32_t t = 0; t < r->n; t++) {
    const uint8_t *c = r->b.pg[2] + (size_t)r->b.pg[3][t] * r->d * 2;
    for (uint32_t i = 0; i < r->d; i++) {
      double e = (double)x[(size_t)t * r->d + i] - ld_bf16(c + 2 * i);
      sum += e * e;
    }
  }
  return sum;
}

/* Lloyd updates to convergence (at most 100) on x from the previous
 * chunk's centroids (cent, k x d bf16 bytes) or from k-means++ (NULL). */
static uint32_t km_updates(const float *x, uint32_t n, uint32_t d, uint32_t k, const uint8_t *cent, double *inertia) {
  kvp__km km;
  ck_assert_int_eq(kvp__km_init(&km, n, d, k), 0);
  for (size_t e = 0; cent && e < (size_t)k * d; e++) km.cent[e] = ld_bf16(cent + 2 * e);
  kvp__km_seed(&km, x, cent ? k : 0, 1);
  uint32_t it = kvp__km_lloyd(&km, x, 100);
  *inertia = kvp__km_inertia(&km, x);
  kvp__km_free(&km);
  return it;
}

/* A clip of NCH chunks encoded in order, the state carried (as the pool
 * does); from chunk 2 on, each chunk is also encoded with one iteration
 * from that state (warm) and from a zeroed one (cold). */
START_TEST(warm_start_beats_cold) {
  enum { NCH = 6, NP = 256, FRAMES = 4, K = 32 };
  uint32_t d = 128, n = NP * FRAMES, wins = 0, uw = 0, uc = 0;
  float *x = malloc((size_t)NCH * n * d * 4);
  gen_clip(x, NCH * FRAMES, NP, d, 64, 31); /* 256 patches of 64 objects, 4 frames a chunk */
  void *probe = make(&kvp__codec_qvg, "k=32", d, KVP_DTYPE_BF16);
  size_t sb = kvp__codec_qvg.state_bytes(probe);
  uint8_t *st = calloc(1, sb), *cold = malloc(sb), *warm = malloc(sb);
  double tw = 0, tc = 0, cw, cc;
  for (uint32_t ch = 0; ch < NCH; ch++) {
    float *xc = x + (size_t)ch * n * d;
    run r, rw, rc;
    if (ch) {
      memcpy(warm, st, sb);
      memset(cold, 0, sb);
      run_codec(&rw, &kvp__codec_qvg, "k=32:iters=1", xc, d, n, n, warm, NULL);
      run_codec(&rc, &kvp__codec_qvg, "k=32:iters=1", xc, d, n, n, cold, NULL);
      double iw = page_inertia(&rw, xc), ic = page_inertia(&rc, xc);
      printf("%schunk %u: %.3f", ch == 1 ? "cold/warm inertia after one iteration: " : ", ", ch + 1, ic / iw);
      tw += iw, tc += ic, wins += iw < ic;
      ck_assert_mem_eq(warm + 8, rw.b.pg[2], (size_t)K * d * 2); /* the state moves on */
      run_free(&rw), run_free(&rc);
    }
    if (ch == NCH - 1) { /* Lloyd updates to convergence on the last chunk */
      uw = km_updates(xc, n, d, K, st + 8, &cw);
      uc = km_updates(xc, n, d, K, NULL, &cc);
    }
    run_codec(&r, &kvp__codec_qvg, "k=32", xc, d, n, n, st, NULL);
    ck_assert_uint_eq(kvp__ld_le32(st), K); /* the state holds this chunk's centroids */
    ck_assert_mem_eq(st + 8, r.b.pg[2], (size_t)K * d * 2);
    run_free(&r);
  }
  printf("; total %.3f, warm lower on %u of %u chunks\nlast chunk to convergence: %u updates warm (inertia %.0f), "
         "%u cold (%.0f)\n",
         tc / tw, wins, NCH - 1, uw, cw, uc, cc);
  ck_assert_msg(tw < tc && 2 * wins > NCH - 1, "warm %g, cold %g, %u wins", tw, tc, wins);
  kvp__codec_qvg.destroy(probe);
  free(st), free(cold), free(warm), free(x);
}
END_TEST

/* ---- determinism and edge cases --------------------------------------------------------------- */

/* Encode r's rows again into a fresh block filled with fill. */
static void encode_again(const run *r, void *state, int fill, blk *b) {
  blk_new(b, r->vt, r->inst, r->cap, fill);
  void *const *pg = (void *const *)b->pg;
  if (state) ck_ok(r->vt->encode_stateful(r->inst, state, r->src, r->d * 2, r->n, r->cap, pg));
  else ck_ok(r->vt->encode(r->inst, r->src, r->d * 2, r->n, r->cap, pg));
}

static void ck_zeros(const uint8_t *p, uint64_t from, uint64_t to, const char *what) {
  for (uint64_t e = from; e < to; e++) ck_hot(p[e] == 0, "%s: byte %" PRIu64 " is %u", what, e, p[e]);
}

/* Rows n..cap-1 of CODES, SCALES, ASSIGN and centroid slots Ka..Kc-1 are
 * zeros. */
static void zero_tail(const blk *a, const struct pcase *c, uint32_t d, uint32_t n, uint32_t cap) {
  uint32_t kc = c->k < cap ? c->k : cap, ka = kc < n ? kc : n;
  ck_zeros(a->pg[0], (uint64_t)n * d * c->b / 8, a->lay.bytes[0], "codes");
  ck_zeros(a->pg[1], (uint64_t)n * (d / c->g), a->lay.bytes[1], "scales");
  for (uint32_t s = 0; s < c->s; s++) {
    ck_zeros(a->pg[2] + (size_t)s * kc * d * 2, (uint64_t)ka * d * 2, (uint64_t)kc * d * 2, "centroids");
    ck_zeros(a->pg[3] + (size_t)s * cap, n, cap, "assign");
  }
}

START_TEST(same_input_same_pages) {
  const struct pcase *c = &pcases[_i];
  uint32_t d = 64, n = 200, cap = 300;
  float *x = malloc((size_t)n * d * 4);
  gen_video(x, n, d, 8, 0, 41);
  run r;
  run_codec(&r, c->vt, c->params, x, d, n, cap, NULL, NULL);
  size_t sb = c->vt->state_bytes(r.inst);
  uint8_t *s1 = calloc(1, sb + 1), *s2 = calloc(1, sb + 1);
  for (int pass = 0; pass < 3; pass++) { /* stateless; stateful cold; stateful warm */
    blk a, b;
    encode_again(&r, pass && sb ? s1 : NULL, 0xA5, &a);
    encode_again(&r, pass && sb ? s2 : NULL, 0x5A, &b); /* other garbage: every byte is written */
    for (uint32_t p = 0; p < a.lay.npages; p++) {
      ck_assert_mem_eq(a.pg[p], b.pg[p], a.lay.bytes[p]);
      if (pass == 0) ck_assert_mem_eq(a.pg[p], r.b.pg[p], a.lay.bytes[p]);
    }
    ck_assert_mem_eq(s1, s2, sb);
    zero_tail(&a, c, d, n, cap);
    blk_free(&a), blk_free(&b);
  }
  if (sb) ck_assert_uint_eq(kvp__ld_le32(s1), c->k < n ? c->k : n);
  run_free(&r);
  free(s1), free(s2), free(x);
}
END_TEST

/* The k-means' AVX2 and AVX-512 scores and distances (codecs/kmeans.c)
 * give the base ISA's pages, byte for byte: structured and Gaussian rows,
 * a block longer than 32 rows with a tail, and one shorter than k. */
START_TEST(isa_same_pages) {
  const struct pcase *c = &pcases[_i];
  uint32_t d = 64, ns[2] = {203, 9};
  for (int v = 0; v < 2; v++) {
    uint32_t n = ns[v], cap = 256;
    float *x = malloc((size_t)n * d * 4);
    if (v == 0) gen_video(x, n, d, 8, 0, 43);
    else gen_video(x, n, d, 3, 1, 44);
    int was = kvp__codec_isa();
    ck_assert_int_eq(kvp__codec_isa_set(KVP__ISA_BASE), KVP__ISA_BASE);
    run a;
    run_codec(&a, c->vt, c->params, x, d, n, cap, NULL, NULL);
    for (int isa = KVP__ISA_AVX2; isa <= KVP__ISA_AVX512; isa++) {
      if (kvp__codec_isa_set(isa) != isa) {
        fprintf(stderr, "isa_same_pages: skip: no %s on this CPU\n", isa == KVP__ISA_AVX2 ? "AVX2" : "AVX-512");
        continue;
      }
      blk b;
      encode_again(&a, NULL, 0x5A, &b);
      for (uint32_t p = 0; p < b.lay.npages; p++)
        ck_assert_msg(memcmp(a.b.pg[p], b.pg[p], b.lay.bytes[p]) == 0, "%s:%s n=%u isa %d: page %u differs",
                      c->vt->name, c->params, n, isa, p);
      blk_free(&b);
    }
    kvp__codec_isa_set(was);
    run_free(&a);
    free(x);
  }
}
END_TEST

/* The pruning of codecs/kmeans.c changes no label or centroid: k-means++
 * and Lloyd's rounds with and without it, then centroids rounded to bf16
 * and a last assignment (qvg_stage_out's order), agree bit for bit, in
 * every ISA, on structured and noise rows, coincident rows (ties), k = 1,
 * a block shorter than a tile, and rows scaled by 2^-70 (underflow) and
 * 2^60 (beyond the bounds' range: nothing skipped); and scores from the
 * rows in place against -2 c agree with those from the -2 x copy. On the
 * structured rows most scores and most of k-means++'s blocks are skipped. */
START_TEST(km_candidates_same_labels) {
  static const struct {
    uint32_t n, k, iters;
    int data;  /* 0 video, 1 noise, 2 two coincident points */
    int scale; /* rows times 2^scale */
  } kc[] = {{777, 40, 20, 0, 0}, {777, 40, 8, 1, 0}, {300, 8, 8, 2, 0}, {200, 1, 4, 0, 0},
            {9, 5, 8, 0, 0},     {500, 24, 8, 0, -70}, {500, 24, 8, 0, 60}};
  uint32_t d = 64, n = kc[_i].n, k = kc[_i].k;
  float *x = malloc((size_t)n * d * 4);
  ck_assert_ptr_nonnull(x);
  if (kc[_i].data == 1) gen_video(x, n, d, 1, 1, 61); /* one pattern: noise around it */
  else gen_video(x, n, d, 8, 0, 60 + (uint64_t)_i);
  if (kc[_i].data == 2)
    for (uint32_t t = 0; t < n; t++) memcpy(x + (size_t)t * d, x + (size_t)(t % 2) * d, d * 4);
  for (size_t e = 0; e < (size_t)n * d; e++) x[e] = ldexpf(x[e], kc[_i].scale);
  int was = kvp__codec_isa();
  for (int isa = KVP__ISA_BASE; isa <= KVP__ISA_AVX512; isa++) {
    if (kvp__codec_isa_set(isa) != isa) continue; /* (a level this CPU lacks) */
    kvp__km a, b, cp; /* cp: pruned, but scores from the -2 x copy (the rows in place in a) */
    ck_assert_int_eq(kvp__km_init(&a, n, d, k), 0);
    ck_assert_int_eq(kvp__km_init(&b, n, d, k), 0);
    ck_assert_int_eq(kvp__km_init(&cp, n, d, k), 0);
    b.prune = 0;
    cp.inplace = 0;
    kvp__km_seed(&a, x, 0, 5), kvp__km_seed(&b, x, 0, 5), kvp__km_seed(&cp, x, 0, 5);
    ck_assert_mem_eq(a.cent, b.cent, (size_t)k * d * 4);
    ck_assert_mem_eq(a.w, b.w, (size_t)n * 4);
    uint32_t ch = kvp__km_lloyd(&a, x, kc[_i].iters);
    ck_assert_uint_eq(ch, kvp__km_lloyd(&b, x, kc[_i].iters));
    ck_assert_uint_eq(ch, kvp__km_lloyd(&cp, x, kc[_i].iters));
    ck_assert_int_eq(a.neg2c, kc[_i].scale != 60); /* in place but beyond the bounds' range */
    ck_assert_int_eq(cp.neg2c, 0);
    for (int pass = 0; pass < 2; pass++) {
      ck_assert_mem_eq(a.cent, b.cent, (size_t)k * d * 4);
      ck_assert_mem_eq(a.label, b.label, n);
      ck_assert_mem_eq(a.cent, cp.cent, (size_t)k * d * 4);
      ck_assert_mem_eq(a.label, cp.label, n);
      for (size_t e = 0; e < (size_t)k * d; e++) /* qvg_stage_out's rounding, then its assignment */
        a.cent[e] = b.cent[e] = cp.cent[e] = kvp__bf16_to_f32(kvp__bf16_from_f32(a.cent[e]));
      uint32_t na = kvp__km_assign(&a, x, 0);
      ck_assert_uint_eq(na, kvp__km_assign(&b, x, 0));
      ck_assert_uint_eq(na, kvp__km_assign(&cp, x, 0));
    }
    if (isa == was)
      printf("km pruning case %d (n=%u k=%u): %.1f%% of the scores, %.1f%% of the k-means++ blocks\n", _i, n, k,
             100.0 * (double)a.nscored / (double)b.nscored, 100.0 * (double)a.nseed / (double)b.nseed);
    if (_i == 0) {
      ck_assert_msg(2 * a.nscored < b.nscored, "isa %d: scored %" PRIu64 " of %" PRIu64, isa, a.nscored, b.nscored);
      ck_assert_msg(a.nseed < b.nseed, "isa %d: k-means++ summed %" PRIu64 " of %" PRIu64 " blocks", isa, a.nseed,
                    b.nseed);
    }
    if (kc[_i].scale == 60) ck_assert_uint_eq(a.nscored, b.nscored);
    kvp__km_free(&a), kvp__km_free(&b), kvp__km_free(&cp);
  }
  kvp__codec_isa_set(was);
  free(x);
}
END_TEST

/* ---- pinned bytes -------------------------------------------------------------------------------- */

/* FNV-1a (64-bit) of len bytes, continuing from h. */
static uint64_t fnv64(uint64_t h, const void *p, size_t len) {
  for (size_t i = 0; i < len; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001B3ULL;
  return h;
}

/* Rows by integer arithmetic alone (no libm, so the same everywhere):
 * npat patterns of multiples of 1/256 in [-4, 4]; a token is one of them
 * plus a multiple of 1/1024 in [-1/32, 1/32] per element. */
static void gen_pinned(float *x, uint32_t n, uint32_t d, uint32_t npat, uint64_t seed) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ULL + 3;
  float *pat = malloc((size_t)npat * d * sizeof *pat);
  ck_assert_ptr_nonnull(pat);
  for (size_t e = 0; e < (size_t)npat * d; e++) pat[e] = (float)((int)(t_rand(&s) % 2049) - 1024) / 256.0f;
  for (uint32_t t = 0; t < n; t++) {
    const float *p = pat + (size_t)(t_rand(&s) % npat) * d;
    for (uint32_t i = 0; i < d; i++) x[(size_t)t * d + i] = p[i] + (float)((int)(t_rand(&s) % 65) - 32) / 1024.0f;
  }
  free(pat);
}

/* The pages (and the state) of fixed inputs hash to the values the
 * encoder gave when these were written: a faster k-means must keep every
 * byte. Cases: each pcase on 777 tokens in a 1024-token block; qvg and
 * qvg-pro on a 4096-token segment-head; both warm-started over three
 * blocks of 1024 tokens. */
static const struct pin {
  int pc;          /* pcases[] index */
  uint32_t n, cap; /* tokens, block capacity */
  int blocks;      /* > 1: stateful, blocks in a row */
  uint64_t want;   /* FNV-1a of every page of every block, then the state */
} pins[] = {
    {0, 777, 1024, 1, 0xadba064f9394201cULL},   {1, 777, 1024, 1, 0x1d0e135445d254f0ULL},
    {2, 777, 1024, 1, 0x058deef8470145ceULL},   {3, 777, 1024, 1, 0xc73b58b355f9d7bdULL},
    {4, 777, 1024, 1, 0xcf73949a93e776acULL},   {5, 777, 1024, 1, 0xc59338825eb4daf4ULL},
    {6, 777, 1024, 1, 0x80670a3b59349920ULL},   {0, 4096, 4096, 1, 0x26d7edbfefeb4d4dULL},
    {1, 4096, 4096, 1, 0xe1728cd1598c8cb0ULL},  {0, 1024, 1024, 3, 0xb77e5518e796d46fULL},
    {1, 1024, 1024, 3, 0x5b0b3d4da8551c81ULL},
};

START_TEST(pinned_bytes) {
  const struct pin *pn = &pins[_i];
  const struct pcase *c = &pcases[pn->pc];
  uint32_t d = 128;
  void *inst = make(c->vt, c->params, d, KVP_DTYPE_BF16);
  size_t sb = pn->blocks > 1 ? c->vt->state_bytes(inst) : 0;
  uint8_t *state = sb ? calloc(1, sb) : NULL;
  float *x = malloc((size_t)pn->n * d * sizeof *x);
  uint16_t *src = malloc((size_t)pn->n * d * 2);
  ck_assert_ptr_nonnull(x);
  ck_assert_ptr_nonnull(src);
  uint64_t h = 0xCBF29CE484222325ULL;
  for (int b = 0; b < pn->blocks; b++) {
    gen_pinned(x, pn->n, d, pn->n >= 4096 ? 64 : 24, 900 + (uint64_t)(pn->pc * 7 + b));
    kvp__bf16_from_f32_row(src, x, (size_t)pn->n * d);
    blk k;
    blk_new(&k, c->vt, inst, pn->cap, 0xA5);
    void *const *pg = (void *const *)k.pg;
    if (state) ck_ok(c->vt->encode_stateful(inst, state, src, d * 2, pn->n, pn->cap, pg));
    else ck_ok(c->vt->encode(inst, src, d * 2, pn->n, pn->cap, pg));
    for (uint32_t p = 0; p < k.lay.npages; p++) h = fnv64(h, k.pg[p], k.lay.bytes[p]);
    blk_free(&k);
  }
  if (state) h = fnv64(h, state, sb);
  printf("pinned_bytes %d (%s:%s n=%u cap=%u blocks=%d): 0x%016" PRIx64 "\n", _i, c->vt->name, c->params, pn->n,
         pn->cap, pn->blocks, h);
  ck_assert_msg(h == pn->want, "%s:%s n=%u blocks=%d: pages hash to 0x%016" PRIx64 ", pinned 0x%016" PRIx64,
                c->vt->name, c->params, pn->n, pn->blocks, h, pn->want);
  free(state), free(x), free(src);
  c->vt->destroy(inst);
}
END_TEST

/* Tokens all equal (bf16 values) reconstruct exactly; zeros give zeros. */
START_TEST(identical_tokens_and_zeros_exact) {
  const struct pcase *c = &pcases[_i];
  uint32_t d = 128, n = 96;
  float *x = malloc((size_t)n * d * 4), *y = malloc((size_t)n * d * 4);
  gen_video(x, 1, d, 1, 0, 51);
  for (uint32_t t = 1; t < n; t++) memcpy(x + (size_t)t * d, x, d * 4);
  for (int zeros = 0; zeros < 2; zeros++) {
    if (zeros) memset(x, 0, (size_t)n * d * 4);
    run r;
    run_codec(&r, c->vt, c->params, x, d, n, 128, NULL, y);
    if (c->s || zeros) { /* (without smoothing the tokens themselves are quantized) */
      for (size_t e = 0; e < (size_t)n * d; e++)
        ck_hot(y[e] == x[e] && isfinite(y[e]), "%s:%s zeros=%d e %zu: %g, want %g", c->vt->name, c->params, zeros, e,
               y[e], x[e]);
      ck_zeros(r.b.pg[1], 0, r.b.lay.bytes[1], "scales"); /* residual 0 */
    }
    run_free(&r);
  }
  free(x), free(y);
}
END_TEST

/* The final quantizer rounds quotients to nearest even and clamps: with
 * scale 1 (A = Q = 7, bits=4) the halves go to the even neighbour, both
 * signs, -0.5 to code Q, and a NaN element (left out of the maximum) to
 * code 0 (-Q); in each ISA (the AVX2 quantizer of codecs/qvg.c too). */
START_TEST(quant_ties_to_even) {
  uint32_t d = 16;
  int was = kvp__codec_isa();
  if (kvp__codec_isa_set(_i) != _i) { /* a level this CPU lacks */
    kvp__codec_isa_set(was);
    return;
  }
  static const float x0[16] = {7.0f, 0.5f, 1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.5f,
                               -0.5f, -1.5f, -2.5f, -3.5f, -6.5f, -7.0f, 0.25f, 0.0f};
  static const int want[16] = {7, 0, 2, 2, 4, 4, 6, 6, 0, -2, -2, -4, -6, -7, 0, 0};
  float x[16], y[16];
  memcpy(x, x0, sizeof x);
  run r;
  run_codec(&r, &kvp__codec_qvg, "stages=0:group=16:bits=4", x, d, 1, 1, NULL, y);
  ck_assert_uint_eq(r.b.pg[1][0], 0x38); /* scale 1.0 */
  uint8_t q[16];
  kvp__msb8_unpack(q, r.b.pg[0], d, 4);
  for (int i = 0; i < 16; i++) ck_assert_msg((int)q[i] - 7 == want[i], "elt %d (%g): code %d", i, x0[i], q[i]);
  run_free(&r);
  /* a NaN element: the codec's own path (an append rejects NaN before it) */
  uint16_t src[16];
  for (int i = 0; i < 16; i++) src[i] = kvp__bf16_from_f32(x0[i]);
  src[3] = 0x7FC0; /* NaN */
  void *inst = make(&kvp__codec_qvg, "stages=0:group=16:bits=4", d, KVP_DTYPE_BF16);
  blk b;
  blk_new(&b, &kvp__codec_qvg, inst, 1, 0xA5);
  ck_ok(kvp__codec_qvg.encode(inst, src, d * 2, 1, 1, (void *const *)b.pg));
  ck_assert_uint_eq(b.pg[1][0], 0x38);
  kvp__msb8_unpack(q, b.pg[0], d, 4);
  ck_assert_uint_eq(q[3], 0);
  for (int i = 0; i < 16; i++)
    if (i != 3) ck_assert_msg((int)q[i] - 7 == want[i], "elt %d: code %d", i, q[i]);
  blk_free(&b);
  kvp__codec_qvg.destroy(inst);
  kvp__codec_isa_set(was);
}
END_TEST

/* The FP8 underflow rule: A/Q <= 2^-10 gives scale code 0 and q = 0. */
START_TEST(fp8_underflow_rule) {
  uint32_t d = 64;
  float x[2 * 64] = {0}, y[2 * 64];
  for (int i = 0; i < 16; i++) {
    x[i] = (i % 2 ? -1 : 1) * 0x1p-12f * (float)(i % 3 + 1); /* A = 3 * 2^-12 < 2^-10 */
    x[16 + i] = (i % 2 ? -1 : 1) * 0x1p-10f;                 /* A = 2^-10: the tie rounds to 0 */
    x[32 + i] = (i % 2 ? -1 : 1) * 0x1.8p-10f;               /* A = 1.5 2^-10: scale 2^-9 (subnormal) */
    x[48 + i] = (i % 2 ? -1 : 1) * (float)(i % 4) / 3;       /* A = 1: scale 1.0 (0x38) */
  }
  run r;
  run_codec(&r, &kvp__codec_qvg, "stages=0:group=16", x, d, 1, 1, NULL, y);
  ck_assert_mem_eq(r.b.pg[1], ((const uint8_t[]){0x00, 0x00, 0x01, 0x38}), 4);
  for (int i = 0; i < 32; i++) ck_assert_msg(y[i] == 0.0f && !signbit(y[i]), "elt %d: %g", i, y[i]);
  for (int i = 32; i < 48; i++) ck_assert(fabsf(y[i]) == 0x1p-9f);
  run_free(&r);
  /* after smoothing: two tokens around a centroid, residuals +-2^-13 */
  memset(x, 0, sizeof x);
  for (int i = 0; i < 64; i++) x[i] = 0.5f, x[64 + i] = 0.5f;
  for (int i = 0; i < 16; i++) x[i] = 0x1p-12f * (i % 2), x[64 + i] = 0;
  run_codec(&r, &kvp__codec_qvg, "k=1:group=16", x, d, 2, 2, NULL, y);
  ck_assert_uint_eq(r.b.pg[1][0], 0);
  for (int i = 0; i < 16; i++) {
    float cent = ld_bf16(r.b.pg[2] + 2 * i);
    ck_assert(cent == 0x1p-13f * (i % 2) && y[i] == cent && y[64 + i] == cent);
  }
  for (int i = 16; i < 64; i++) ck_assert(y[i] == 0.5f && y[64 + i] == 0.5f);
  run_free(&r);
}
END_TEST

START_TEST(bad_params_named) {
  static const struct {
    const kvp_codec_vtable *vt;
    const char *params, *why;
    uint32_t d;
  } bad[] = {
      {&kvp__codec_qvg, "bits=3", "bits=3: must be 2 or 4", 128},
      {&kvp__codec_qvg, "bits=8", "bits", 128},
      {&kvp__codec_qvg, "group=48", "group=48: must be 8, 16", 128},
      {&kvp__codec_qvg, "group=4", "group", 128},
      {&kvp__codec_qvg, "group=256", "group=256 does not divide head_dim 128", 128},
      {&kvp__codec_qvg, "", "group=64 does not divide head_dim 96", 96},
      {&kvp__codec_qvg, "k=0", "k=0: must be 1..256", 128},
      {&kvp__codec_qvg, "k=257", "k=257", 128},
      {&kvp__codec_qvg, "stages=9", "stages=9: must be 0..8", 128},
      {&kvp__codec_qvg, "stages=-1", "stages", 128},
      {&kvp__codec_qvg, "iters=101", "iters=101: must be 0..100", 128},
      {&kvp__codec_qvg, "iters=", "iters", 128},
      {&kvp__codec_qvg, "colour=red", "colour", 128},
      {&kvp__codec_qvg, "bits=2:bits=4", "bits given twice", 128},
      {&kvp__codec_qvg, "k", "'k'", 128},
      {&kvp__codec_qvg_pro, "group=12", "qvg-pro: group=12", 128},
      {&kvp__codec_qvg_pro, "", "qvg-pro: group=16 does not divide head_dim 40", 40},
  };
  for (size_t i = 0; i < KVP__ARRAY_LEN(bad); i++) {
    kvp_codec_geom g = {.head_dim = bad[i].d, .in_dtype = KVP_DTYPE_BF16};
    char err[256] = "";
    size_t at = 999;
    void *inst = (void *)1;
    ck_assert_int_eq(bad[i].vt->create(bad[i].params, &g, &inst, err, sizeof err, &at), KVP_EINVAL);
    ck_assert_msg(strstr(err, bad[i].why), "%s \"%s\": %s", bad[i].vt->name, bad[i].params, err);
    ck_assert_ptr_eq(inst, (void *)1);
  }
}
END_TEST

/* Decode to every dtype and any sub-range equals the full f32 decode,
 * rounded once; inputs of any dtype holding the same values give the same
 * pages; a corrupt assignment is a codec error. */
START_TEST(dtypes_and_subranges) {
  const struct pcase *c = &pcases[_i];
  uint32_t d = 64, n = 100, cap = 128;
  float *x = malloc((size_t)n * d * 4), *y = malloc((size_t)n * d * 4), *z = malloc((size_t)n * d * 4);
  uint16_t *h = malloc((size_t)n * d * 2), *w = malloc((size_t)n * d * 2);
  gen_video(x, n, d, 8, 0, 71);
  for (size_t e = 0; e < (size_t)n * d; e++) { /* values bf16 and f16 both hold (f16 normals) */
    x[e] = kvp__bf16_to_f32(kvp__bf16_from_f32(x[e]));
    if (fabsf(x[e]) < 0x1p-14f) x[e] = 0.0f;
  }
  kvp__f16_from_f32_row(h, x, (size_t)n * d);
  run r;
  run_codec(&r, c->vt, c->params, x, d, n, cap, NULL, y);
  for (int dt = 0; dt < 2; dt++) { /* f32 and f16 inputs */
    void *inst = make(c->vt, c->params, d, dt ? KVP_DTYPE_F16 : KVP_DTYPE_F32);
    blk b;
    blk_new(&b, c->vt, inst, cap, 0xA5);
    ck_ok(c->vt->encode(inst, dt ? (void *)h : (void *)x, d * (dt ? 2 : 4), n, cap, (void *const *)b.pg));
    for (uint32_t p = 0; p < b.lay.npages; p++) {
      uint64_t e = 0;
      while (e < b.lay.bytes[p] && b.pg[p][e] == r.b.pg[p][e]) e++;
      ck_assert_msg(e == b.lay.bytes[p], "%s:%s dtype %d: page %u differs at byte %" PRIu64 " of %" PRIu64, c->vt->name,
                    c->params, dt, p, e, b.lay.bytes[p]);
    }
    blk_free(&b);
    c->vt->destroy(inst);
  }
  const void *const *pg = (const void *const *)r.b.pg;
  for (int dt = 1; dt < 3; dt++) {
    kvp_dtype out = dt == 1 ? KVP_DTYPE_BF16 : KVP_DTYPE_F16;
    ck_ok(c->vt->decode(r.inst, pg, n, cap, 0, n, w, d * 2, out));
    kvp__row_from_f32(h, out, y, (size_t)n * d);
    ck_assert_mem_eq(w, h, (size_t)n * d * 2);
  }
  for (uint32_t t0 = 0; t0 < n; t0 += 37) {
    uint32_t m = n - t0 < 29 ? n - t0 : 29;
    ck_ok(c->vt->decode(r.inst, pg, n, cap, t0, m, z, d * 4, KVP_DTYPE_F32));
    ck_assert_mem_eq(z, y + (size_t)t0 * d, (size_t)m * d * 4);
  }
  ck_status(c->vt->decode(r.inst, pg, n, cap, 90, 11, z, d * 4, KVP_DTYPE_F32), KVP_EINVAL);
  if (c->s) {
    r.b.pg[3][(size_t)(c->s - 1) * cap + 5] = 255; /* >= Kc = min(K, 128) for every case */
    ck_status(c->vt->decode(r.inst, pg, n, cap, 0, n, z, d * 4, KVP_DTYPE_F32), KVP_ECODEC);
    ck_assert_msg(strstr(kvp_last_error(), "token 5"), "%s", kvp_last_error());
  }
  run_free(&r);
  free(x), free(y), free(z), free(h), free(w);
}
END_TEST

/* ---- speed (printed, not asserted) -------------------------------------------------------------- */

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define SANITIZED 1 /* timings would mean nothing: the speed tests skip */
#else
#define SANITIZED 0
#endif

START_TEST(encode_decode_speed) {
  enum { N = 4096, D = 128, REPS = 4 };
  const kvp_codec_vtable *vt = _i ? &kvp__codec_qvg_pro : &kvp__codec_qvg;
  if (SANITIZED) {
    printf("%s speed: skipped under a sanitizer\n", vt->name);
    return;
  }
  float *x = malloc((size_t)N * D * 4);
  uint16_t *out = malloc((size_t)N * D * 2);
  gen_video(x, N, D, 64, 0, 81);
  run r;
  double t0 = now_s();
  run_codec(&r, vt, "", x, D, N, N, NULL, NULL);
  double t_enc = now_s() - t0;
  kvp__km km; /* stage 1's clustering alone, for its iteration count */
  ck_assert_int_eq(kvp__km_init(&km, N, D, 256), 0);
  t0 = now_s();
  kvp__km_seed(&km, x, 0, 1);
  double t_seed = now_s() - t0;
  t0 = now_s();
  uint64_t sc0 = km.nscored;
  uint32_t it = kvp__km_lloyd(&km, x, 8);
  double t_lloyd = now_s() - t0, frac = (double)(km.nscored - sc0) / ((double)N * km.kp * (it + 1));
  kvp__km_free(&km);
  t0 = now_s();
  for (int k = 0; k < REPS; k++)
    ck_ok(vt->decode(r.inst, (const void *const *)r.b.pg, N, N, 0, N, out, D * 2, KVP_DTYPE_BF16));
  double t_dec = (now_s() - t0) / REPS;
  printf("%-8s encode of a %u-token segment-head (D=%u): %.1f ms; stage 1: k-means++ %.1f ms, %u updates of 8 "
         "(%.1f ms per assignment + update, %.0f%% of the scores computed); decode %.2f GB/s of bf16\n",
         vt->name, N, D, t_enc * 1e3, t_seed * 1e3, it, t_lloyd * 1e3 / (it + 1), 100.0 * frac,
         (double)N * D * 2 / t_dec * 1e-9);
  run_free(&r);
  free(x), free(out);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("qvg");
  TCase *tc = tcase_create("bytes");
  tcase_add_loop_test(tc, layout_formula, 0, 2 * NPC);
  tcase_add_test(tc, ratio_vs_bf16);
  suite_add_tcase(s, tc);
  tc = tcase_create("quality");
  tcase_set_timeout(tc, 300);
  tcase_add_loop_test(tc, smoothing_is_bookkeeping, 0, NPC);
  tcase_add_loop_test(tc, scale_equivariance, 0, NPC);
  tcase_add_loop_test(tc, smoothing_gain_video_vs_noise, 0, 2);
  tcase_add_loop_test(tc, progressive_stages, 0, 2);
  tcase_add_test(tc, warm_start_beats_cold);
  suite_add_tcase(s, tc);
  tc = tcase_create("api");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, same_input_same_pages, 0, NPC);
  tcase_add_loop_test(tc, isa_same_pages, 0, NPC);
  tcase_add_loop_test(tc, pinned_bytes, 0, (int)KVP__ARRAY_LEN(pins));
  tcase_add_loop_test(tc, km_candidates_same_labels, 0, 7);
  tcase_add_loop_test(tc, identical_tokens_and_zeros_exact, 0, NPC);
  tcase_add_test(tc, fp8_underflow_rule);
  tcase_add_loop_test(tc, quant_ties_to_even, KVP__ISA_BASE, KVP__ISA_AVX512 + 1); /* each ISA */
  tcase_add_test(tc, bad_params_named);
  tcase_add_loop_test(tc, dtypes_and_subranges, 0, NPC);
  suite_add_tcase(s, tc);
  tc = tcase_create("speed");
  tcase_set_timeout(tc, 300);
  tcase_add_loop_test(tc, encode_decode_speed, 0, 2);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0); /* figures survive a failing forked test */
  return t_run(suite());
}
