/*
 * tests/gpu/check_gpu_codecs.c - every built-in codec with device ops:
 * device-encoded pages byte-identical to host-encoded pages of the same
 * input, and device decode equal to host decode bit for bit, through the
 * codec ABI (include/kvpool_codec.h) only.
 *
 * Sweep: codec specs x side (K, V) x in dtype (f32, bf16, f16) x D (64, 128,
 * 256) x rows n (1, a group edge, a full block; cap 64 and one block of
 * 4096) x data (gaussian, zeros, saturating, subnormal, ties of the
 * formats' rounding) x out dtype. Plus: a NaN or Inf anywhere in the input
 * is reported in the status word at its (job, row, channel); a batch of
 * many jobs (more than one launch) matches job for job. KVQuant (a
 * row-wise codec: encode_at, encode_rows, decode_at) has its own sweep
 * below, with positions (sinks, RoPE) and heads.
 * NOFORK; skips with a message without a GPU.
 */
#include "gpu_test.h"
#include "kvpool_codec.h"

#include <unistd.h>


static const char *const specs[] = {"raw",        "raw:dtype=bf16",     "raw:dtype=fp16",        "raw:dtype=fp32",
                                    "fp8",        "fp8:scale=0.05",     "int8",                  "int8:pct=99",
                                    "int8:pct=50", "kivi",              "kivi:bits=4:group=64",  "kivi:bits=2:group=16",
                                    "nvfp4",      "nvfp4:rule=4/6",     "nvfp4:ksmooth=store",   "nvfp4:rule=4/6:ksmooth=store",
                                    "qvg:k=16:iters=4", "qvg-pro:k=8:iters=3", "qvg:bits=4"};
#define NSPECS (sizeof specs / sizeof specs[0])

enum { PAT_GAUSS, PAT_ZEROS, PAT_SAT, PAT_SUBNORMAL, PAT_TIES, PAT_MIXED, PAT_HUGE, NPAT, PAT_SCORE_TIES = NPAT };

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double urand(void) {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (double)(rng >> 11) / 9007199254740992.0;
}
static float gauss(void) { return (float)(sqrt(-2.0 * log(urand() + 1e-300)) * cos(6.283185307179586 * urand())); }

static float pattern(int pat, size_t i, int kv) {
  switch (pat) {
  case PAT_ZEROS: return (i % 7 == 3) ? -0.0f : 0.0f;
  case PAT_SAT: return (i % 5 == 0 ? 20000.0f : 1.0f) * (i & 1 ? -1.0f : 1.0f) * (float)(1 + i % 3); /* f16 holds it */
  case PAT_HUGE: return (i % 11 == 4 ? 3.0e6f : 1.0f) * gauss(); /* beyond fp16: kivi refuses */
  case PAT_SUBNORMAL: return ldexpf(gauss(), -130 + (int)(i % 12));
  case PAT_TIES: { /* values on rounding midpoints of E4M3 / E2M1 / int grids */
    static const float t[] = {0.5f, 1.5f, 2.5f, 0.25f, 0.75f, 1.25f, 1.75f, 3.5f, 5.0f, 448.0f, 464.0f, -0.75f, -2.5f};
    return t[i % (sizeof t / sizeof t[0])] * (kv ? 1.0f : 2.0f);
  }
  case PAT_MIXED: return gauss() * (i % 97 == 0 ? 40.0f : 1.0f) + (i % 128 < 4 ? 8.0f : 0.0f);
  case PAT_SCORE_TIES: { /* few values and signed zeros: kvquant's equal scores (kvquant_ties) */
    static const float t[] = {0.5f, -0.5f, 3.0f, -3.0f, 2.0f, -2.0f, 0.0f, -0.0f, 3.0f, 0.5f, -3.0f};
    return t[(i * 7 + i / 5) % 11] * (float)(1 + (i / 61) % 2);
  }
  default: return gauss();
  }
}

static uint16_t f16_of(float x) {
  /* through CUDA-free bit math: round to nearest even, saturating to inf is fine for the tests' ranges */
  uint32_t u;
  memcpy(&u, &x, 4);
  uint32_t s = u >> 16 & 0x8000u, a = u & 0x7FFFFFFFu;
  if (a >= 0x477FF000u) return (uint16_t)(s | 0x7C00u);
  if (a < 0x38800000u) { /* subnormal */
    float f;
    memcpy(&f, &a, 4);
    return (uint16_t)(s | (uint32_t)lrintf(f * 16777216.0f));
  }
  return (uint16_t)(s | (((a + 0xFFFu + (a >> 13 & 1u)) >> 13) - (112u << 10)));
}

/* n rows of D elements of dt from the pattern. */
static void *make_rows(kvp_dtype dt, uint32_t n, uint32_t D, int pat, int kv, size_t *bytes) {
  size_t esz = dt == KVP_DTYPE_F32 ? 4 : 2;
  *bytes = (size_t)n * D * esz;
  unsigned char *p = malloc(*bytes ? *bytes : 1);
  for (size_t i = 0; i < (size_t)n * D; i++) {
    float x = pattern(pat, i, kv);
    if (dt == KVP_DTYPE_F32) memcpy(p + 4 * i, &x, 4);
    else {
      uint16_t h = dt == KVP_DTYPE_BF16 ? gpu_bf16_of(x) : f16_of(x);
      memcpy(p + 2 * i, &h, 2);
    }
  }
  return p;
}

/* Device scratch of the sweep: one arena, bump-allocated, reset per case
 * (cudaMalloc/cudaFree per case would dominate the run). */
static char *arena;
static size_t arena_used;
#define ARENA_BYTES (256u << 20)
static void *dalloc(size_t bytes) {
  if (!arena) ck_cuda(cudaMalloc((void **)&arena, ARENA_BYTES));
  size_t at = (arena_used + 255) & ~(size_t)255;
  ck_assert_msg(at + bytes <= ARENA_BYTES, "test arena exhausted");
  arena_used = at + bytes;
  return arena + at;
}

typedef struct dev_block {
  kvp_codec_layout lay;
  void *host[KVP_CODEC_MAX_PAGES];
  void *dev[KVP_CODEC_MAX_PAGES];
} dev_block;

static void block_alloc(const kvp_codec_vtable *vt, void *inst, uint32_t cap, dev_block *b) {
  memset(b, 0, sizeof *b);
  vt->layout(inst, cap, &b->lay);
  for (unsigned i = 0; i < b->lay.npages; i++) {
    b->host[i] = calloc(1, b->lay.bytes[i]);
    b->dev[i] = dalloc(b->lay.bytes[i]);
    ck_cuda(cudaMemset(b->dev[i], 0xA5, b->lay.bytes[i])); /* every byte must be written */
  }
}
static void block_free(dev_block *b) {
  for (unsigned i = 0; i < b->lay.npages; i++) {
    free(b->host[i]);
  }
}

static long n_cases, n_decoded;

/* One case: returns nonzero (after a message) on a mismatch. */
static void one_case(const char *spec, int kv, kvp_dtype in, uint32_t D, uint32_t cap, uint32_t n, int pat) {
  arena_used = 0;
  char name[64];
  const char *colon = strchr(spec, ':');
  size_t nl = colon ? (size_t)(colon - spec) : strlen(spec);
  snprintf(name, sizeof name, "%.*s", (int)nl, spec);
  uint32_t id;
  ck_assert_int_eq(kvp_codec_find(name, &id), KVP_OK);
  const kvp_codec_vtable *vt = kvp_codec_get(id);
  ck_assert_msg(vt->encode_dev && vt->decode_dev, "%s has no device ops", name);
  kvp_codec_geom g = {D, in, 0, (uint32_t)kv, 1, 1};
  void *inst = NULL;
  char err[256];
  size_t at = 0;
  int rc = vt->create(colon ? colon + 1 : "", &g, &inst, err, sizeof err, &at);
  if (rc) return; /* a spec that does not fit this D (group > D): not a device question */
  uint32_t grp = vt->group_tokens(inst);
  if (cap % grp) {
    vt->destroy(inst);
    return;
  }
  if (pat == PAT_HUGE && in == KVP_DTYPE_F16) { /* would be inf */
    vt->destroy(inst);
    return;
  }
  size_t in_bytes;
  void *src = make_rows(in, n, D, pat, kv, &in_bytes);
  size_t row = in_bytes / n;
  dev_block b;
  block_alloc(vt, inst, cap, &b);
  rc = vt->encode(inst, src, row, n, cap, b.host);
  if (rc) { /* the host refuses this input (kivi beyond fp16): the device must report it */
    void *dsrc;
    uint64_t *st, hst;
    dsrc = dalloc(in_bytes);
    ck_cuda(cudaMemcpy(dsrc, src, in_bytes, cudaMemcpyHostToDevice));
    st = dalloc(8);
    ck_cuda(cudaMemset(st, 0xFF, 8));
    kvp_codec_dev_job j = {.src = dsrc, .stride_bytes = row, .n = n, .cap_tokens = cap, .m = n};
    memcpy(j.pages, b.dev, sizeof j.pages);
    ck_assert_int_eq(vt->encode_dev(inst, &j, NULL, 1, st, NULL), KVP_OK);
    ck_cuda(cudaMemcpy(&hst, st, 8, cudaMemcpyDeviceToHost));
    ck_assert_msg(hst != KVP_DEV_STATUS_OK && (hst >> 60) == KVP_DEV_BAD_RANGE,
                  "%s %c in=%d D=%u n=%u pattern %d: host encode refused the input (%d), device status %016llx", spec,
                  "KV"[kv], (int)in, D, n, pat, rc, (unsigned long long)hst);
    block_free(&b);
    free(src);
    vt->destroy(inst);
    return;
  }
  void *dsrc;
  uint64_t *st, hst;
  dsrc = dalloc(in_bytes);
  ck_cuda(cudaMemcpy(dsrc, src, in_bytes, cudaMemcpyHostToDevice));
  st = dalloc(8);
  ck_cuda(cudaMemset(st, 0xFF, 8));
  kvp_codec_dev_job j = {.src = dsrc, .stride_bytes = row, .n = n, .cap_tokens = cap, .m = n};
  memcpy(j.pages, b.dev, sizeof j.pages);
  ck_assert_int_eq(vt->encode_dev(inst, &j, NULL, 1, st, NULL), KVP_OK);
  ck_cuda(cudaDeviceSynchronize());
  ck_cuda(cudaMemcpy(&hst, st, 8, cudaMemcpyDeviceToHost));
  if (hst != KVP_DEV_STATUS_OK) {
    uint32_t e = (uint32_t)hst, r = e / D, ch = e % D;
    float x = NAN;
    if (r < n && in == KVP_DTYPE_F32) memcpy(&x, (char *)src + (size_t)r * row + 4 * ch, 4);
    ck_abort_msg("%s %c in=%d D=%u n=%u pattern %d: status %016llx on finite input (row %u ch %u holds %g)", spec,
                 "KV"[kv], (int)in, D, n, pat, (unsigned long long)hst, r, ch, (double)x);
  }
  int is_raw = strncmp(spec, "raw", 3) == 0; /* raw writes only the rows it is given */
  for (unsigned i = 0; i < b.lay.npages; i++) {
    unsigned char *got = malloc(b.lay.bytes[i]);
    ck_cuda(cudaMemcpy(got, b.dev[i], b.lay.bytes[i], cudaMemcpyDeviceToHost));
    const unsigned char *want = b.host[i];
    uint64_t upto = is_raw ? b.lay.bytes[i] / cap * n : b.lay.bytes[i];
    for (uint64_t k = 0; memcmp(got, want, upto) && k < upto; k++) /* Check asserts are slow: only on a mismatch */
      ck_assert_msg(got[k] == want[k],
                    "%s %c in=%d D=%u cap=%u n=%u pattern %d: page %u (type %d) byte %llu of %llu: device %02x, "
                    "host %02x",
                    spec, "KV"[kv], (int)in, D, cap, n, pat, i, (int)b.lay.types[i], (unsigned long long)k,
                    (unsigned long long)b.lay.bytes[i], got[k], want[k]);
    free(got);
  }
  n_cases++;
  /* decode: rows [t0, n) in every out dtype, host pages on both sides */
  uint32_t t0 = n > 2 ? 1 : 0, m = n - t0;
  for (int out = 0; out < 3; out++) {
    size_t orow = (size_t)D * (out == KVP_DTYPE_F32 ? 4 : 2);
    unsigned char *want = malloc(m * orow), *got = malloc(m * orow);
    const void *pages[KVP_CODEC_MAX_PAGES];
    for (unsigned i = 0; i < KVP_CODEC_MAX_PAGES; i++) pages[i] = b.host[i];
    ck_assert_int_eq(vt->decode(inst, pages, n, cap, t0, m, want, orow, (kvp_dtype)out), KVP_OK);
    void *ddst;
    ddst = dalloc(m * orow);
    kvp_codec_dev_job dj = {.dst = ddst, .stride_bytes = orow, .n = n, .cap_tokens = cap, .t0 = t0, .m = m};
    memcpy(dj.pages, b.dev, sizeof dj.pages);
    ck_assert_int_eq(vt->decode_dev(inst, &dj, NULL, 1, (kvp_dtype)out, NULL), KVP_OK);
    ck_cuda(cudaMemcpy(got, ddst, m * orow, cudaMemcpyDeviceToHost));
    for (size_t k = 0; memcmp(got, want, m * orow) && k < m * orow; k++)
      ck_assert_msg(got[k] == want[k], "%s %c in=%d D=%u cap=%u n=%u pattern %d: decode out=%d byte %zu: device %02x, host %02x",
                    spec, "KV"[kv], (int)in, D, cap, n, pat, out, k, got[k], want[k]);
    free(want);
    free(got);
    n_decoded++;
  }
  block_free(&b);
  free(src);
  vt->destroy(inst);
}

START_TEST(bit_exact_sweep) {
  const char *spec = specs[_i];
  const char *only = getenv("KVP_GPU_SPEC"); /* e.g. KVP_GPU_SPEC=nvfp4 */
  if (only && strncmp(spec, only, strlen(only))) return;
  static const uint32_t dims[] = {64, 128, 256};
  long before = n_cases;
  for (int kv = 0; kv < 2; kv++)
    for (int in = 0; in < 3; in++)
      for (unsigned d = 0; d < 3; d++) {
        const uint32_t ns[] = {1, 16, 33, 64};
        for (unsigned k = 0; k < 4; k++)
          for (int pat = 0; pat < NPAT; pat++) one_case(spec, kv, (kvp_dtype)in, dims[d], 64, ns[k], pat);
      }
  /* one big block (step mode): 4096 rows */
  for (int kv = 0; kv < 2; kv++) one_case(spec, kv, KVP_DTYPE_BF16, 128, 4096, 4096, PAT_MIXED);
  printf("%-30s %5ld cases bit-exact (encode pages and 3 decode dtypes)\n", spec, n_cases - before);
  fflush(stdout);
  ck_assert_int_gt(n_cases - before, 0);
}
END_TEST

/* ---- KVQuant ------------------------------------------------------------------
 * A row-wise codec with position- and head-dependent blocks (encode_at,
 * decode_at): its device encode is encode_rows' twin. Per (spec, side, in
 * dtype, D), rows n x pattern x (position, head):
 *   whole block: device pages (zeroed first) == encode_at's, every byte;
 *   rows in two appends (t0 = n/3), pages pre-filled with 0xA5 on both
 *   sides: device == two encode_rows calls, every byte (so the device
 *   writes exactly the host's bytes and leaves the others);
 *   decode of rows [t0, n) in 3 out dtypes == decode_at, bit for bit;
 *   an input the host refuses (residual or V scale beyond fp16) is
 *   reported as KVP_DEV_BAD_RANGE.
 * KVP_GPU_QUICK=1 narrows the sweep to bf16, D = 80 and 128, 33 rows, three
 * patterns, and the batch test to 80 jobs (for compute-sanitizer). */
static const char *const kvq_specs[] = {
    "kvquant",
    "kvquant:bits=2:sink=0",
    "kvquant:bits=4:outliers=0.05:sink=4",
    "kvquant:outliers=0",
    "kvquant:outlier_mode=threshold",
    "kvquant:outlier_mode=threshold:outliers=0.2:bits=2:sink=3",
    "kvquant:prerope=1:theta=500000:rope_dims=64",
    "kvquant:prerope=1:bits=2:outliers=0.1:lut=uniform",
    "kvquant:bits=4:outliers=0.3:prerope=1:sink=2",
};
#define NKVQ (sizeof kvq_specs / sizeof kvq_specs[0])

static const kvp_codec_vtable *kvq_vt(void) {
  uint32_t id;
  ck_assert_int_eq(kvp_codec_find("kvquant", &id), KVP_OK);
  const kvp_codec_vtable *vt = kvp_codec_get(id);
  ck_assert_msg(vt->encode_dev && vt->decode_dev && vt->encode_at && vt->decode_at && vt->encode_rows,
                "kvquant lacks device ops or its *_at ops");
  return vt;
}

static void *kvq_make(const kvp_codec_vtable *vt, const char *spec, int kv, kvp_dtype in, uint32_t D, uint32_t H) {
  kvp_codec_geom g = {D, in, 0, (uint32_t)kv, 1, H};
  const char *colon = strchr(spec, ':');
  void *inst = NULL;
  char err[256] = "";
  size_t at = 0;
  if (vt->create(colon ? colon + 1 : "", &g, &inst, err, sizeof err, &at)) return NULL; /* rope_dims > D */
  return inst;
}

/* Page i of a block: device bytes == host bytes, or a message naming the byte. */
static void kvq_same_pages(const kvp_codec_layout *lay, void *const *dev, void *const *host, const char *what,
                           const char *spec, int kv, int in, uint32_t D, uint32_t n, int pat, uint32_t pos0) {
  for (unsigned i = 0; i < lay->npages; i++) {
    unsigned char *got = malloc(lay->bytes[i]);
    const unsigned char *want = host[i];
    ck_cuda(cudaMemcpy(got, dev[i], lay->bytes[i], cudaMemcpyDeviceToHost));
    for (uint64_t k = 0; memcmp(got, want, lay->bytes[i]) && k < lay->bytes[i]; k++)
      ck_assert_msg(got[k] == want[k], "%s %c in=%d D=%u n=%u pattern %d pos0=%u (%s): page %u (type %d) byte %llu "
                    "of %llu: device %02x, host %02x", spec, "KV"[kv], in, D, n, pat, pos0, what, i,
                    (int)lay->types[i], (unsigned long long)k, (unsigned long long)lay->bytes[i], got[k], want[k]);
    free(got);
  }
}

static long kvq_ncases, kvq_ndecoded;

static void kvq_case(const kvp_codec_vtable *vt, void *inst, const char *spec, int kv, kvp_dtype in, uint32_t D,
                     uint32_t cap, uint32_t n, int pat, uint32_t pos0, uint32_t head) {
  arena_used = 0;
  if (pat == PAT_HUGE && in == KVP_DTYPE_F16) return; /* would be inf */
  size_t in_bytes;
  void *src = make_rows(in, n, D, pat, kv, &in_bytes);
  size_t row = in_bytes / n;
  void *dsrc = dalloc(in_bytes);
  uint64_t *st = dalloc(8), hst;
  ck_cuda(cudaMemcpy(dsrc, src, in_bytes, cudaMemcpyHostToDevice));
  kvp_codec_block where = {head, pos0};
  kvp_codec_layout lay;
  vt->layout_at(inst, pos0, cap, &lay);
  void *hp[KVP_CODEC_MAX_PAGES] = {0}, *dp[KVP_CODEC_MAX_PAGES] = {0};
  for (unsigned i = 0; i < lay.npages; i++) {
    hp[i] = calloc(1, lay.bytes[i]);
    dp[i] = dalloc(lay.bytes[i]);
    ck_cuda(cudaMemset(dp[i], 0, lay.bytes[i]));
  }
  int hrc = vt->encode_at(inst, &where, NULL, src, row, n, cap, hp);
  kvp_codec_dev_job j = {.src = dsrc, .stride_bytes = row, .n = n, .cap_tokens = cap, .t0 = 0, .m = n, .head = head,
                         .pos0 = pos0};
  memcpy(j.pages, dp, sizeof j.pages);
  ck_cuda(cudaMemset(st, 0xFF, 8));
  ck_ok(vt->encode_dev(inst, &j, NULL, 1, st, NULL));
  ck_cuda(cudaMemcpy(&hst, st, 8, cudaMemcpyDeviceToHost));
  if (hrc) { /* beyond fp16: the device must say so */
    ck_assert_msg(hst != KVP_DEV_STATUS_OK && (hst >> 60) == KVP_DEV_BAD_RANGE,
                  "%s %c in=%d D=%u n=%u pattern %d: host encode refused the input (%d: %s), device status %016llx",
                  spec, "KV"[kv], (int)in, D, n, pat, hrc, kvp_last_error(), (unsigned long long)hst);
    goto out;
  }
  ck_assert_msg(hst == KVP_DEV_STATUS_OK, "%s %c in=%d D=%u n=%u pattern %d: status %016llx on input the host takes",
                spec, "KV"[kv], (int)in, D, n, pat, (unsigned long long)hst);
  kvq_same_pages(&lay, dp, hp, "whole block", spec, kv, (int)in, D, n, pat, pos0);
  if (n > 1) { /* two appends into pre-filled pages: every byte the host writes, and no other */
    uint32_t a = n / 3 ? n / 3 : 1;
    void *hq[KVP_CODEC_MAX_PAGES] = {0}, *dq[KVP_CODEC_MAX_PAGES] = {0};
    for (unsigned i = 0; i < lay.npages; i++) {
      hq[i] = malloc(lay.bytes[i]);
      memset(hq[i], 0xA5, lay.bytes[i]);
      dq[i] = dalloc(lay.bytes[i]);
      ck_cuda(cudaMemset(dq[i], 0xA5, lay.bytes[i]));
    }
    ck_ok(vt->encode_rows(inst, &where, NULL, hq, 0, src, row, a, cap));
    ck_ok(vt->encode_rows(inst, &where, NULL, hq, a, (const char *)src + a * row, row, n - a, cap));
    kvp_codec_dev_job j2[2] = {j, j};
    memcpy(j2[0].pages, dq, sizeof dq), memcpy(j2[1].pages, dq, sizeof dq);
    j2[0].n = j2[0].m = a;
    j2[1].src = (const char *)dsrc + a * row, j2[1].t0 = a, j2[1].m = n - a;
    ck_ok(vt->encode_dev(inst, &j2[0], NULL, 1, st, NULL));
    ck_ok(vt->encode_dev(inst, &j2[1], NULL, 1, st, NULL));
    ck_cuda(cudaMemcpy(&hst, st, 8, cudaMemcpyDeviceToHost));
    ck_assert_msg(hst == KVP_DEV_STATUS_OK, "%s: status %016llx appending rows", spec, (unsigned long long)hst);
    kvq_same_pages(&lay, dq, hq, "rows in two appends", spec, kv, (int)in, D, n, pat, pos0);
    for (unsigned i = 0; i < lay.npages; i++) free(hq[i]);
  }
  kvq_ncases++;
  uint32_t t0 = n > 2 ? 1 : 0, m = n - t0;
  for (int out = 0; out < 3; out++) {
    size_t orow = (size_t)D * (out == KVP_DTYPE_F32 ? 4 : 2);
    unsigned char *want = malloc(m * orow), *got = malloc(m * orow);
    ck_ok(vt->decode_at(inst, &where, (const void *const *)hp, n, cap, t0, m, want, orow, (kvp_dtype)out));
    void *ddst = dalloc(m * orow);
    kvp_codec_dev_job dj = {.dst = ddst, .stride_bytes = orow, .n = n, .cap_tokens = cap, .t0 = t0, .m = m,
                            .head = head, .pos0 = pos0};
    memcpy(dj.pages, dp, sizeof dj.pages);
    ck_ok(vt->decode_dev(inst, &dj, NULL, 1, (kvp_dtype)out, NULL));
    ck_cuda(cudaMemcpy(got, ddst, m * orow, cudaMemcpyDeviceToHost));
    for (size_t k = 0; memcmp(got, want, m * orow) && k < m * orow; k++)
      ck_assert_msg(got[k] == want[k], "%s %c in=%d D=%u cap=%u n=%u pattern %d pos0=%u head %u: decode out=%d byte "
                    "%zu (row %zu): device %02x, host %02x", spec, "KV"[kv], (int)in, D, cap, n, pat, pos0, head, out,
                    k, t0 + k / orow, got[k], want[k]);
    free(want);
    free(got);
    kvq_ndecoded++;
  }
out:
  for (unsigned i = 0; i < lay.npages; i++) free(hp[i]);
  free(src);
}

START_TEST(kvquant_bit_exact) {
  const char *spec = kvq_specs[_i];
  const char *only = getenv("KVP_GPU_SPEC");
  if (only && strncmp(spec, only, strlen(only))) return;
  const kvp_codec_vtable *vt = kvq_vt();
  /* 36: no multiple of 8, so the row-per-warp decode (the others decode by tiles) */
  static const uint32_t dims[] = {64, 80, 128, 256, 36};
  static const uint32_t ns[] = {1, 16, 33, 64};
  static const int pats[] = {PAT_GAUSS, PAT_ZEROS, PAT_SAT, PAT_SUBNORMAL, PAT_MIXED, PAT_HUGE};
  int quick = getenv("KVP_GPU_QUICK") != NULL; /* a sweep sized for compute-sanitizer */
  long before = kvq_ncases;
  for (int kv = 0; kv < 2; kv++)
    for (int in = 0; in < 3; in++)
      for (unsigned d = 0; d < sizeof dims / sizeof dims[0]; d++) {
        if (quick && (in != KVP_DTYPE_BF16 || (dims[d] != 80 && dims[d] != 128))) continue;
        void *inst = kvq_make(vt, spec, kv, (kvp_dtype)in, dims[d], 2);
        if (!inst) continue;
        for (unsigned k = quick ? 2 : 0; k < (quick ? 3u : 4u); k++)
          for (unsigned p = 0; p < sizeof pats / sizeof pats[0]; p++) {
            if (quick && pats[p] != PAT_GAUSS && pats[p] != PAT_ZEROS && pats[p] != PAT_HUGE) continue;
            uint32_t pos0 = p % 3 == 0 ? 0 : p % 3 == 1 ? 2 : 100000 + 4093 * p * (k + 1);
            kvq_case(vt, inst, spec, kv, (kvp_dtype)in, dims[d], 64, ns[k], pats[p], pos0, (k + p) % 2);
          }
        vt->destroy(inst);
      }
  /* one big block (step mode) far out: 4096 rows at positions near 2^32 */
  for (int kv = 0; kv < 2 && !quick; kv++) {
    void *inst = kvq_make(vt, spec, kv, KVP_DTYPE_BF16, 128, 2);
    ck_assert_ptr_nonnull(inst);
    kvq_case(vt, inst, spec, kv, KVP_DTYPE_BF16, 128, 4096, 4096, PAT_MIXED, 4000000000u, 1);
    vt->destroy(inst);
  }
  printf("%-55s %5ld cases bit-exact (whole block, two appends, 3 decode dtypes)\n", spec, kvq_ncases - before);
  fflush(stdout);
  ck_assert_int_gt(kvq_ncases - before, 0);
}
END_TEST

/* Equal scores: a calibration equal across channels (every sample row one
 * value repeated) and inputs of a few values, so the outlier pick breaks
 * ties by channel (top-k by arg-max rounds and by rank, threshold) and V's
 * range meets signed zeros. */
START_TEST(kvquant_ties) {
  if (getenv("KVP_GPU_SPEC") && strncmp("kvquant", getenv("KVP_GPU_SPEC"), strlen(getenv("KVP_GPU_SPEC")))) return;
  const kvp_codec_vtable *vt = kvq_vt();
  static const char *const extra[] = {"", ":outlier_mode=threshold", ":outliers=0.3:bits=2", ":outliers=0.05:sink=3"};
  static const uint32_t dims[] = {64, 80, 128};
  long before = kvq_ncases;
  for (unsigned d = 0; d < 3; d++)
    for (uint32_t bits = 2; bits <= 3; bits++) {
      uint32_t D = dims[d];
      char path[64], spec[256];
      snprintf(path, sizeof path, "/tmp/kvq_gpu_tiesXXXXXX");
      int fd = mkstemp(path);
      ck_assert_int_ge(fd, 0);
      close(fd);
      kvp_kvquant_calib *c;
      float *x = malloc((size_t)512 * D * sizeof *x);
      ck_ok(kvp_kvquant_calib_create(1, 2, D, bits, 0.05, &c));
      for (uint32_t h = 0; h < 2; h++)
        for (uint32_t kv = 0; kv < 2; kv++) {
          for (uint32_t t = 0; t < 512; t++) {
            float v = gauss() * 1.5f;
            for (uint32_t ch = 0; ch < D; ch++) x[(size_t)t * D + ch] = v;
          }
          ck_ok(kvp_kvquant_calib_add(c, 0, h, kv, x, NULL, D, 512));
        }
      ck_ok(kvp_kvquant_calib_write(c, path));
      kvp_kvquant_calib_destroy(c);
      free(x);
      for (unsigned e = 0; e < 4; e++) {
        if ((strstr(extra[e], "bits=2") != NULL) != (bits == 2)) continue;
        snprintf(spec, sizeof spec, "kvquant:calib=%s%s", path, extra[e]);
        for (int kv = 0; kv < 2; kv++) {
          void *inst = kvq_make(vt, spec, kv, KVP_DTYPE_BF16, D, 2);
          ck_assert_msg(inst != NULL, "%s: %s", spec, kvp_last_error());
          kvq_case(vt, inst, spec, kv, KVP_DTYPE_BF16, D, 64, 5, PAT_SCORE_TIES, 0, 1);
          kvq_case(vt, inst, spec, kv, KVP_DTYPE_BF16, D, 64, 64, PAT_SCORE_TIES, 777, 0);
          vt->destroy(inst);
        }
      }
      unlink(path);
    }
  printf("%-55s %5ld cases bit-exact\n", "kvquant ties (equal scores, signed zeros)", kvq_ncases - before);
  ck_assert_int_gt(kvq_ncases - before, 0);
}
END_TEST

/* A batch of 400 jobs (heads and positions of their own, the first ones in
 * the sink) in kernel parameters (two launches) and from a device table
 * (one): job for job the host's pages and decode. */
START_TEST(kvquant_batch) {
  if (getenv("KVP_GPU_SPEC") && strncmp("kvquant", getenv("KVP_GPU_SPEC"), strlen(getenv("KVP_GPU_SPEC")))) return;
  const kvp_codec_vtable *vt = kvq_vt();
  enum { CAP = 32, HH = 4 };
  const uint32_t NJ = getenv("KVP_GPU_QUICK") ? 80 : 400, D = 128; /* quick: still more than a small launch */
  for (int kv = 0; kv < 2; kv++) {
    kvp_codec_geom g = {D, KVP_DTYPE_BF16, 0, (uint32_t)kv, 1, HH};
    void *inst;
    char err[256];
    size_t at;
    ck_assert_int_eq(vt->create(kv ? "bits=4:sink=5:outliers=0.05" : "prerope=1:sink=5", &g, &inst, err, sizeof err,
                                &at), KVP_OK);
    size_t in_bytes;
    uint16_t *src = make_rows(KVP_DTYPE_BF16, NJ * CAP, D, PAT_MIXED, kv, &in_bytes);
    void *dsrc;
    ck_cuda(cudaMalloc(&dsrc, in_bytes));
    ck_cuda(cudaMemcpy(dsrc, src, in_bytes, cudaMemcpyHostToDevice));
    kvp_codec_dev_job *jobs = calloc(NJ, sizeof *jobs), *djobs = calloc(NJ, sizeof *djobs);
    kvp_codec_layout *lay = calloc(NJ, sizeof *lay);
    void **host = calloc((size_t)NJ * KVP_CODEC_MAX_PAGES, sizeof *host);
    size_t total = 0;
    for (uint32_t k = 0; k < NJ; k++) {
      vt->layout_at(inst, k * CAP, CAP, &lay[k]);
      for (unsigned i = 0; i < lay[k].npages; i++) total += (lay[k].bytes[i] + 255) & ~(size_t)255;
    }
    char *pages;
    ck_cuda(cudaMalloc((void **)&pages, total));
    void *ddst, *jobs_dev;
    size_t orow = (size_t)D * 2;
    ck_cuda(cudaMalloc(&ddst, (size_t)NJ * CAP * orow));
    ck_cuda(cudaMalloc(&jobs_dev, NJ * sizeof *jobs));
    uint64_t *st, hst;
    ck_cuda(cudaMalloc((void **)&st, 8));
    size_t off = 0;
    for (uint32_t k = 0; k < NJ; k++) {
      jobs[k] = (kvp_codec_dev_job){.src = (char *)dsrc + (size_t)k * CAP * D * 2, .stride_bytes = D * 2, .n = CAP,
                                    .cap_tokens = CAP, .m = CAP, .head = k % HH, .pos0 = k * CAP};
      djobs[k] = (kvp_codec_dev_job){.dst = (char *)ddst + (size_t)k * CAP * orow, .stride_bytes = orow, .n = CAP,
                                     .cap_tokens = CAP, .t0 = 0, .m = CAP, .head = k % HH, .pos0 = k * CAP};
      for (unsigned i = 0; i < lay[k].npages; i++) {
        jobs[k].pages[i] = djobs[k].pages[i] = pages + off;
        off += (lay[k].bytes[i] + 255) & ~(size_t)255;
        host[k * KVP_CODEC_MAX_PAGES + i] = calloc(1, lay[k].bytes[i]);
      }
      kvp_codec_block where = {k % HH, k * CAP};
      ck_ok(vt->encode_at(inst, &where, NULL, src + (size_t)k * CAP * D, D * 2, CAP, CAP,
                          &host[k * KVP_CODEC_MAX_PAGES]));
    }
    uint16_t *want = malloc(CAP * orow), *got = malloc((size_t)NJ * CAP * orow);
    unsigned char *pg = malloc(total);
    for (int staged = 0; staged < 2; staged++) {
      ck_cuda(cudaMemset(pages, 0, total));
      ck_cuda(cudaMemset(st, 0xFF, 8));
      if (staged) ck_cuda(cudaMemcpy(jobs_dev, jobs, NJ * sizeof *jobs, cudaMemcpyHostToDevice));
      ck_ok(vt->encode_dev(inst, jobs, staged ? jobs_dev : NULL, NJ, st, NULL));
      ck_cuda(cudaMemcpy(&hst, st, 8, cudaMemcpyDeviceToHost));
      ck_assert_msg(hst == KVP_DEV_STATUS_OK, "%c batch: status %016llx", "KV"[kv], (unsigned long long)hst);
      ck_cuda(cudaMemcpy(pg, pages, total, cudaMemcpyDeviceToHost));
      if (staged) ck_cuda(cudaMemcpy(jobs_dev, djobs, NJ * sizeof *djobs, cudaMemcpyHostToDevice));
      ck_ok(vt->decode_dev(inst, djobs, staged ? jobs_dev : NULL, NJ, KVP_DTYPE_BF16, NULL));
      ck_cuda(cudaMemcpy(got, ddst, (size_t)NJ * CAP * orow, cudaMemcpyDeviceToHost));
      for (uint32_t k = 0; k < NJ; k++) {
        for (unsigned i = 0; i < lay[k].npages; i++)
          ck_assert_msg(!memcmp(pg + ((char *)jobs[k].pages[i] - pages), host[k * KVP_CODEC_MAX_PAGES + i],
                                lay[k].bytes[i]), "%c batch (jobs %s): job %u page %u differs from the host's",
                        "KV"[kv], staged ? "staged" : "in parameters", k, i);
        kvp_codec_block where = {k % HH, k * CAP};
        ck_ok(vt->decode_at(inst, &where, (const void *const *)&host[k * KVP_CODEC_MAX_PAGES], CAP, CAP, 0, CAP, want,
                            orow, KVP_DTYPE_BF16));
        ck_assert_msg(!memcmp(got + (size_t)k * CAP * D, want, CAP * orow), "%c batch (jobs %s): job %u decode differs",
                      "KV"[kv], staged ? "staged" : "in parameters", k);
      }
    }
    for (size_t i = 0; i < (size_t)NJ * KVP_CODEC_MAX_PAGES; i++) free(host[i]);
    free(host), free(lay), free(jobs), free(djobs), free(want), free(got), free(pg), free(src);
    cudaFree(pages), cudaFree(ddst), cudaFree(jobs_dev), cudaFree(st), cudaFree(dsrc);
    vt->destroy(inst);
  }
}
END_TEST

/* What the device ops refuse, by name, before anything is enqueued: a
 * head_dim over 256, a head the calibration lacks, rows outside the block. */
START_TEST(kvquant_refusals) {
  const kvp_codec_vtable *vt = kvq_vt();
  void *inst = kvq_make(vt, "kvquant", 0, KVP_DTYPE_BF16, 320, 2);
  ck_assert_ptr_nonnull(inst);
  kvp_codec_dev_job j = {.src = (void *)16, .stride_bytes = 640, .n = 4, .cap_tokens = 16, .m = 4, .pos0 = 100,
                         .pages = {(void *)16, (void *)16}};
  ck_assert_int_eq(vt->encode_dev(inst, &j, NULL, 1, (uint64_t *)16, NULL), KVP_ENOTSUP);
  ck_assert_msg(strstr(kvp_last_error(), "head_dim 320"), "%s", kvp_last_error());
  vt->destroy(inst);
  inst = kvq_make(vt, "kvquant", 0, KVP_DTYPE_BF16, 128, 2);
  j.stride_bytes = 256, j.head = 2;
  ck_assert_int_eq(vt->encode_dev(inst, &j, NULL, 1, (uint64_t *)16, NULL), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "head 2"), "%s", kvp_last_error());
  j.head = 1, j.t0 = 1; /* t0 + m != n */
  ck_assert_int_eq(vt->encode_dev(inst, &j, NULL, 1, (uint64_t *)16, NULL), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "job 0"), "%s", kvp_last_error());
  j.t0 = 0, j.dst = (void *)16, j.n = 17; /* n > cap */
  ck_assert_int_eq(vt->decode_dev(inst, &j, NULL, 1, KVP_DTYPE_BF16, NULL), KVP_EINVAL);
  ck_cuda(cudaDeviceSynchronize()); /* nothing was launched */
  vt->destroy(inst);
}
END_TEST

/* NaN / Inf at chosen places: reported at the first (job, row, channel). */
START_TEST(nonfinite_reported) {
  const char *names[] = {"raw", "fp8", "int8", "kivi", "nvfp4", "kvquant", "qvg"};
  for (unsigned c = 0; c < 7; c++) {
    uint32_t id, D = 128, cap = 32, n = 32, njobs = 400; /* more jobs than one launch holds */
    ck_assert_int_eq(kvp_codec_find(names[c], &id), KVP_OK);
    const kvp_codec_vtable *vt = kvp_codec_get(id);
    kvp_codec_geom g = {D, KVP_DTYPE_BF16, 0, 1, 1, 1};
    void *inst;
    char err[128];
    size_t at;
    ck_assert_int_eq(vt->create("", &g, &inst, err, sizeof err, &at), KVP_OK);
    size_t in_bytes;
    uint16_t *src = make_rows(KVP_DTYPE_BF16, n * njobs, D, PAT_GAUSS, 1, &in_bytes);
    uint32_t bad_job = 321, bad_row = 7, bad_ch = 77;
    src[((size_t)bad_job * n + bad_row) * D + bad_ch] = 0x7FC0;         /* NaN */
    src[((size_t)(bad_job + 5) * n + 2) * D + 3] = 0x7F80;                /* +Inf, later job */
    void *dsrc;
    uint64_t *st, hst;
    ck_cuda(cudaMalloc(&dsrc, in_bytes));
    ck_cuda(cudaMemcpy(dsrc, src, in_bytes, cudaMemcpyHostToDevice));
    ck_cuda(cudaMalloc((void **)&st, 8));
    ck_cuda(cudaMemset(st, 0xFF, 8));
    kvp_codec_layout lay;
    vt->layout(inst, cap, &lay);
    kvp_codec_dev_job *jobs = calloc(njobs, sizeof *jobs);
    void *pages[KVP_CODEC_MAX_PAGES] = {0};
    for (unsigned i = 0; i < lay.npages; i++) ck_cuda(cudaMalloc(&pages[i], lay.bytes[i] * njobs));
    for (uint32_t k = 0; k < njobs; k++) {
      jobs[k] = (kvp_codec_dev_job){.src = (char *)dsrc + (size_t)k * n * D * 2, .stride_bytes = D * 2, .n = n,
                                    .cap_tokens = cap, .m = n, .pos0 = 1024 + k * cap}; /* past kvquant's sink */
      for (unsigned i = 0; i < lay.npages; i++) jobs[k].pages[i] = (char *)pages[i] + lay.bytes[i] * k;
    }
    /* jobs in parameters (two launches), then from a device table (one) */
    kvp_codec_dev_job *jobs_dev;
    ck_cuda(cudaMalloc((void **)&jobs_dev, njobs * sizeof *jobs));
    ck_cuda(cudaMemcpy(jobs_dev, jobs, njobs * sizeof *jobs, cudaMemcpyHostToDevice));
    for (int staged = 0; staged < 2; staged++) {
      ck_cuda(cudaMemset(st, 0xFF, 8));
      ck_assert_int_eq(vt->encode_dev(inst, jobs, staged ? jobs_dev : NULL, njobs, st, NULL), KVP_OK);
      ck_cuda(cudaMemcpy(&hst, st, 8, cudaMemcpyDeviceToHost));
      ck_assert_msg(hst == ((uint64_t)KVP_DEV_BAD_NONFINITE << 60 | (uint64_t)bad_job << 32 | (bad_row * D + bad_ch)),
                    "%s (jobs %s): status %016llx", names[c], staged ? "staged" : "in parameters",
                    (unsigned long long)hst);
    }
    cudaFree(jobs_dev);
    for (unsigned i = 0; i < lay.npages; i++) cudaFree(pages[i]);
    cudaFree(dsrc);
    cudaFree(st);
    free(jobs);
    free(src);
    vt->destroy(inst);
  }
}
END_TEST

/* QVG's warm start on the device: a stream's state (device memory, a
 * job's dst) carried over blocks, one call per block and then all blocks
 * in one call (jobs that share a state run in order): the pages and the
 * state equal the host's encode_stateful, block after block. */
START_TEST(qvg_warm_state) {
  const char *only = getenv("KVP_GPU_SPEC");
  if (only && strncmp("qvg", only, strlen(only))) return;
  static const char *const sp[] = {"qvg:k=16", "qvg-pro:k=8:iters=4"};
  enum { D = 128, CAP = 64, NB = 3 };
  const uint32_t ns[NB] = {64, 40, 64};
  for (unsigned c = 0; c < 2; c++) {
    arena_used = 0;
    uint32_t id;
    ck_assert_int_eq(kvp_codec_find(strncmp(sp[c], "qvg-pro", 7) ? "qvg" : "qvg-pro", &id), KVP_OK);
    const kvp_codec_vtable *vt = kvp_codec_get(id);
    kvp_codec_geom g = {D, KVP_DTYPE_BF16, 0, 0, 1, 1};
    void *inst;
    char err[128];
    size_t at;
    ck_assert_int_eq(vt->create(strchr(sp[c], ':') + 1, &g, &inst, err, sizeof err, &at), KVP_OK);
    size_t sb = vt->state_bytes(inst), in_bytes[NB];
    void *src[NB], *dsrc[NB];
    dev_block b[NB];
    for (int k = 0; k < NB; k++) {
      src[k] = make_rows(KVP_DTYPE_BF16, ns[k], D, k == 1 ? PAT_MIXED : PAT_GAUSS, 0, &in_bytes[k]);
      dsrc[k] = dalloc(in_bytes[k]);
      ck_cuda(cudaMemcpy(dsrc[k], src[k], in_bytes[k], cudaMemcpyHostToDevice));
      block_alloc(vt, inst, CAP, &b[k]);
    }
    unsigned char *hstate = calloc(1, sb), *got = malloc(sb), *hstates[NB];
    for (int k = 0; k < NB; k++) {
      ck_assert_int_eq(vt->encode_stateful(inst, hstate, src[k], D * 2, ns[k], CAP, b[k].host), KVP_OK);
      hstates[k] = malloc(sb);
      memcpy(hstates[k], hstate, sb);
    }
    uint64_t *st = dalloc(8), hst;
    for (int whole = 0; whole < 2; whole++) {
      void *dstate = dalloc(sb);
      ck_cuda(cudaMemset(dstate, 0, sb));
      kvp_codec_dev_job j[NB];
      for (int k = 0; k < NB; k++) {
        j[k] = (kvp_codec_dev_job){.src = dsrc[k], .dst = dstate, .stride_bytes = D * 2, .n = ns[k], .cap_tokens = CAP,
                                   .m = ns[k]};
        memcpy(j[k].pages, b[k].dev, sizeof j[k].pages);
        for (unsigned i = 0; i < b[k].lay.npages; i++) ck_cuda(cudaMemset(b[k].dev[i], 0xA5, b[k].lay.bytes[i]));
      }
      ck_cuda(cudaMemset(st, 0xFF, 8));
      for (int k = 0; k < NB; k++) {
        if (!whole || k == 0) ck_assert_int_eq(vt->encode_dev(inst, &j[k], NULL, whole ? NB : 1, st, NULL), KVP_OK);
        ck_cuda(cudaDeviceSynchronize());
        if (!whole) {
          ck_cuda(cudaMemcpy(got, dstate, sb, cudaMemcpyDeviceToHost));
          ck_assert_msg(!memcmp(got, hstates[k], sb), "%s block %d: device state differs from the host's", sp[c], k);
        }
      }
      ck_cuda(cudaMemcpy(&hst, st, 8, cudaMemcpyDeviceToHost));
      ck_assert_uint_eq(hst, KVP_DEV_STATUS_OK);
      for (int k = 0; k < NB; k++)
        for (unsigned i = 0; i < b[k].lay.npages; i++) {
          unsigned char *pg = malloc(b[k].lay.bytes[i]);
          ck_cuda(cudaMemcpy(pg, b[k].dev[i], b[k].lay.bytes[i], cudaMemcpyDeviceToHost));
          ck_assert_msg(!memcmp(pg, b[k].host[i], b[k].lay.bytes[i]), "%s (%s): block %d page %u differs", sp[c],
                        whole ? "one call" : "a call a block", k, i);
          free(pg);
        }
    }
    printf("%-30s warm state over %d blocks bit-exact (a call a block, and one call)\n", sp[c], NB);
    for (int k = 0; k < NB; k++) block_free(&b[k]), free(src[k]), free(hstates[k]);
    free(hstate), free(got);
    vt->destroy(inst);
  }
}
END_TEST

int main(void) {
  if (!gpu_present("check_gpu_codecs")) return 0;
  Suite *s = suite_create("gpu_codecs");
  TCase *tc = tcase_create("bitexact");
  tcase_set_timeout(tc, 600);
  tcase_add_loop_test(tc, bit_exact_sweep, 0, NSPECS);
  tcase_add_test(tc, nonfinite_reported);
  tcase_add_loop_test(tc, kvquant_bit_exact, 0, NKVQ);
  tcase_add_test(tc, kvquant_ties);
  tcase_add_test(tc, kvquant_batch);
  tcase_add_test(tc, kvquant_refusals);
  tcase_add_test(tc, qvg_warm_state);
  suite_add_tcase(s, tc);
  int rc = gpu_run(s, CK_NORMAL);
  if (arena) cudaFree(arena); /* the sweep's scratch (compute-sanitizer's leak check) */
  return rc;
}
