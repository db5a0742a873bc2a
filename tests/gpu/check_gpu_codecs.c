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
 * many jobs (more than one launch) matches job for job.
 * NOFORK; skips with a message without a GPU.
 */
#include "gpu_test.h"
#include "kvpool_codec.h"


static const char *const specs[] = {"raw",        "raw:dtype=bf16",     "raw:dtype=fp16",        "raw:dtype=fp32",
                                    "fp8",        "fp8:scale=0.05",     "int8",                  "int8:pct=99",
                                    "int8:pct=50", "kivi",              "kivi:bits=4:group=64",  "kivi:bits=2:group=16",
                                    "nvfp4",      "nvfp4:rule=4/6",     "nvfp4:ksmooth=store",   "nvfp4:rule=4/6:ksmooth=store"};
#define NSPECS (sizeof specs / sizeof specs[0])

enum { PAT_GAUSS, PAT_ZEROS, PAT_SAT, PAT_SUBNORMAL, PAT_TIES, PAT_MIXED, PAT_HUGE, NPAT };

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

/* NaN / Inf at chosen places: reported at the first (job, row, channel). */
START_TEST(nonfinite_reported) {
  const char *names[] = {"raw", "fp8", "int8", "kivi", "nvfp4"};
  for (unsigned c = 0; c < 5; c++) {
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
                                    .cap_tokens = cap, .m = n};
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

int main(void) {
  if (!gpu_present("check_gpu_codecs")) return 0;
  Suite *s = suite_create("gpu_codecs");
  TCase *tc = tcase_create("bitexact");
  tcase_set_timeout(tc, 600);
  tcase_add_loop_test(tc, bit_exact_sweep, 0, NSPECS);
  tcase_add_test(tc, nonfinite_reported);
  suite_add_tcase(s, tc);
  int rc = gpu_run(s, CK_NORMAL);
  if (arena) cudaFree(arena); /* the sweep's scratch (compute-sanitizer's leak check) */
  return rc;
}
