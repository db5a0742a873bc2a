/*
 * tests/unit/xcheck_kvquant_emu.cpp - KVQuant's device encode and decode
 * (kernels/kvquant.cuh) run on the host through tests/unit/cuda_emu.h, one
 * CTA of coroutine threads per job, against the host codec
 * (codecs/kvquant.c), as tests/gpu/check_gpu_codecs.c does on a GPU:
 *
 *   whole block: the device function's pages (zeroed first) == encode_at's;
 *   rows in two appends, pages pre-filled with 0xA5 on both sides: == two
 *   encode_rows calls, every byte (the device writes the host's bytes and
 *   no other);
 *   decode of rows [t0, n) in 3 out dtypes == decode_at, bit for bit;
 *   input the host refuses is reported KVP_DEV_BAD_RANGE, a NaN
 *   KVP_DEV_BAD_NONFINITE at its (row, channel).
 *
 * Specs: top-k and threshold outliers (past D/2 candidates too), none,
 * sinks straddling a block, pre-RoPE keys with a partial rope_dims; D 64,
 * 80, 128, 200, 256; all three input dtypes. No GPU and no CUDA headers: host
 * C++ (g++ -ffp-contract=off, so products are not fused). KVP_EMU_FULL=1
 * widens the sweep. The last line has the Check summary format.
 */
#include "cuda_emu.h"

#include "../../kernels/kvquant.cuh"

extern "C" {
#include "../../codecs/kvquant.h"
#include "kvpool_codec.h"
}

#include <unistd.h>

#include <vector>

#include "emu_expect.h"

/* ---- the emulated kernels ---------------------------------------------------- */

struct EncArg {
  const kvp__kvq_kparams *p;
  const kvp_codec_dev_job *j;
  unsigned long long *status;
};
static void enc_body(void *a) {
  EncArg *e = (EncArg *)a;
  kvpk::kvquant_encode(*e->p, *e->j, 0, e->status);
}
struct DecArg {
  const kvp__kvq_kparams *p;
  const kvp_codec_dev_job *j;
  uint32_t out;
};
static void dec_body(void *a) { /* the kernels' choice (lean, by tiles where D % 8 == 0, a warp a row) */
  DecArg *d = (DecArg *)a;
  kvpk::kvquant_decode_job(*d->p, *d->j, d->out);
}
static void dec_body_rows(void *a) { /* a warp a row, whatever D */
  DecArg *d = (DecArg *)a;
  kvpk::kvquant_decode(*d->p, *d->j, d->out);
}
static void dec_body_tile(void *a) { /* by tiles, where the lean decode would run too */
  DecArg *d = (DecArg *)a;
  kvpk::kvquant_decode_tile(*d->p, *d->j, d->out);
}

static uint64_t emu_encode(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j) {
  unsigned long long st = KVP_DEV_STATUS_OK;
  EncArg a = {&p, &j, &st};
  emu::run(KVP__KERN_THREADS, 0, enc_body, &a);
  return st;
}
enum { DEC_JOB, DEC_ROWS, DEC_TILE };
static const char *const dec_name[] = {"job", "rows", "tiles"};
static void emu_decode(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, uint32_t out, int how = DEC_JOB) {
  DecArg a = {&p, &j, out};
  emu::run(kvpk::kDecodeThreads, 0, how == DEC_ROWS ? dec_body_rows : how == DEC_TILE ? dec_body_tile : dec_body, &a);
}

/* ---- inputs ---------------------------------------------------------------------- */

enum { PAT_GAUSS, PAT_ZEROS, PAT_SAT, PAT_SUBNORMAL, PAT_MIXED, PAT_HUGE, NPAT, PAT_TIES = NPAT };

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double urand() {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (double)(rng >> 11) / 9007199254740992.0;
}
static float gauss() { return (float)(sqrt(-2.0 * log(urand() + 1e-300)) * cos(6.283185307179586 * urand())); }

static float pattern(int pat, size_t i) {
  switch (pat) {
  case PAT_ZEROS: return (i % 7 == 3) ? -0.0f : 0.0f;
  case PAT_SAT: return (i % 5 == 0 ? 20000.0f : 1.0f) * (i & 1 ? -1.0f : 1.0f) * (float)(1 + i % 3);
  case PAT_HUGE: return (i % 11 == 4 ? 3.0e6f : 1.0f) * gauss();
  case PAT_SUBNORMAL: return ldexpf(gauss(), -130 + (int)(i % 12));
  case PAT_MIXED: return gauss() * (i % 97 == 0 ? 40.0f : 1.0f) + (i % 128 < 4 ? 8.0f : 0.0f);
  case PAT_TIES: { /* few values, signed zeros: equal scores under a calibration equal across channels */
    static const float t[] = {0.5f, -0.5f, 3.0f, -3.0f, 2.0f, -2.0f, 0.0f, -0.0f, 3.0f, 0.5f, -3.0f};
    return t[(i * 7 + i / 5) % 11] * (float)(1 + (i / 61) % 2);
  }
  default: return gauss();
  }
}

static uint16_t bits16(float x, kvp_dtype dt) {
  uint32_t u;
  memcpy(&u, &x, 4);
  if (dt == KVP_DTYPE_BF16) return (uint16_t)((u + 0x7FFFu + (u >> 16 & 1u)) >> 16);
  return (uint16_t)kvpk::f16_from_f32(x);
}

static std::vector<unsigned char> make_rows(kvp_dtype dt, uint32_t n, uint32_t D, int pat) {
  size_t esz = dt == KVP_DTYPE_F32 ? 4 : 2;
  std::vector<unsigned char> v((size_t)n * D * esz);
  for (size_t i = 0; i < (size_t)n * D; i++) {
    float x = pattern(pat, i);
    if (dt == KVP_DTYPE_F32) memcpy(&v[4 * i], &x, 4);
    else {
      uint16_t h = bits16(x, dt);
      memcpy(&v[2 * i], &h, 2);
    }
  }
  return v;
}

/* ---- one case ------------------------------------------------------------------------ */

struct Pages {
  kvp_codec_layout lay;
  std::vector<unsigned char> b[KVP_CODEC_MAX_PAGES];
  void *ptr[KVP_CODEC_MAX_PAGES] = {};
  Pages(const kvp_codec_vtable *vt, void *inst, uint32_t pos0, uint32_t cap, int fill) {
    vt->layout_at(inst, pos0, cap, &lay);
    for (unsigned i = 0; i < lay.npages; i++) {
      b[i].assign(lay.bytes[i], (unsigned char)fill);
      ptr[i] = b[i].data();
    }
  }
};

static void same(const Pages &dev, const Pages &host, const char *what, const char *spec, int kv, int in, uint32_t D,
                 uint32_t n, int pat, uint32_t pos0) {
  for (unsigned i = 0; i < host.lay.npages; i++) {
    size_t k = 0;
    while (k < host.b[i].size() && dev.b[i][k] == host.b[i][k]) k++;
    EXPECT(k == host.b[i].size(), "%s %c in=%d D=%u n=%u pattern %d pos0=%u (%s): page %u (type %d) byte %zu of %zu: "
           "device %02x, host %02x", spec, "KV"[kv], in, D, n, pat, pos0, what, i, (int)host.lay.types[i], k,
           host.b[i].size(), k < host.b[i].size() ? dev.b[i][k] : 0, k < host.b[i].size() ? host.b[i][k] : 0);
  }
}

static void one_case(const kvp_codec_vtable *vt, void *inst, const kvp__kvq_kparams &p, const char *spec, int kv,
                     kvp_dtype in, uint32_t D, uint32_t cap, uint32_t n, int pat, uint32_t pos0, uint32_t head) {
  if (pat == PAT_HUGE && in == KVP_DTYPE_F16) return;
  std::vector<unsigned char> src = make_rows(in, n, D, pat);
  size_t row = src.size() / n;
  kvp_codec_block where = {head, pos0};
  Pages hp(vt, inst, pos0, cap, 0), dp(vt, inst, pos0, cap, 0);
  int hrc = vt->encode_at(inst, &where, NULL, src.data(), row, n, cap, hp.ptr);
  kvp_codec_dev_job j = {};
  memcpy(j.pages, dp.ptr, sizeof j.pages);
  j.src = src.data(), j.stride_bytes = row, j.n = n, j.cap_tokens = cap, j.t0 = 0, j.m = n, j.head = head;
  j.pos0 = pos0;
  uint64_t st = emu_encode(p, j);
  if (hrc) {
    EXPECT(st != KVP_DEV_STATUS_OK && (st >> 60) == KVP_DEV_BAD_RANGE, "%s %c in=%d D=%u n=%u pattern %d: host "
           "refused (%d), device status %016llx", spec, "KV"[kv], (int)in, D, n, pat, hrc, (unsigned long long)st);
    return;
  }
  EXPECT(st == KVP_DEV_STATUS_OK, "%s %c in=%d D=%u n=%u pattern %d: status %016llx on input the host takes", spec,
         "KV"[kv], (int)in, D, n, pat, (unsigned long long)st);
  same(dp, hp, "whole block", spec, kv, (int)in, D, n, pat, pos0);
  if (n > 1) {
    uint32_t a = n / 3 ? n / 3 : 1;
    Pages hq(vt, inst, pos0, cap, 0xA5), dq(vt, inst, pos0, cap, 0xA5);
    vt->encode_rows(inst, &where, NULL, hq.ptr, 0, src.data(), row, a, cap);
    vt->encode_rows(inst, &where, NULL, hq.ptr, a, src.data() + a * row, row, n - a, cap);
    kvp_codec_dev_job j1 = j, j2 = j;
    memcpy(j1.pages, dq.ptr, sizeof j1.pages);
    memcpy(j2.pages, dq.ptr, sizeof j2.pages);
    j1.n = j1.m = a;
    j2.src = src.data() + a * row, j2.t0 = a, j2.m = n - a;
    uint64_t s1 = emu_encode(p, j1), s2 = emu_encode(p, j2);
    EXPECT(s1 == KVP_DEV_STATUS_OK && s2 == KVP_DEV_STATUS_OK, "%s: status on appends", spec);
    same(dq, hq, "rows in two appends", spec, kv, (int)in, D, n, pat, pos0);
  }
  uint32_t t0 = n > 2 ? 1 : 0, m = n - t0;
  for (int out = 0; out < 3; out++) {
    size_t orow = (size_t)D * (out == KVP_DTYPE_F32 ? 4 : 2);
    std::vector<unsigned char> want(m * orow), got(m * orow, 0x5A);
    vt->decode_at(inst, &where, (const void *const *)hp.ptr, n, cap, t0, m, want.data(), orow, (kvp_dtype)out);
    kvp_codec_dev_job dj = {};
    memcpy(dj.pages, dp.ptr, sizeof dj.pages);
    dj.dst = got.data(), dj.stride_bytes = orow, dj.n = n, dj.cap_tokens = cap, dj.t0 = t0, dj.m = m, dj.head = head;
    dj.pos0 = pos0;
    for (int how = DEC_JOB; how <= DEC_TILE; how++) { /* the kernels' pick (lean where it may), a warp a row, by tiles */
      if (how == DEC_TILE && !kvpk::kvquant_tile_ok(p)) continue;
      std::fill(got.begin(), got.end(), 0x5A);
      emu_decode(p, dj, (uint32_t)out, how);
      size_t k = 0;
      while (k < want.size() && got[k] == want[k]) k++;
      EXPECT(k == want.size(), "%s %c in=%d D=%u n=%u pattern %d pos0=%u: decode (%s) out=%d byte %zu (row %zu): "
             "device %02x, host %02x", spec, "KV"[kv], (int)in, D, n, pat, pos0, dec_name[how], out, k,
             t0 + k / orow, k < want.size() ? got[k] : 0, k < want.size() ? want[k] : 0);
    }
  }
}

static const kvp_codec_vtable *vt_kvq() {
  uint32_t id;
  if (kvp_codec_find("kvquant", &id) != KVP_OK) {
    fprintf(stderr, "no kvquant codec\n");
    exit(1);
  }
  return kvp_codec_get(id);
}

static void *make(const kvp_codec_vtable *vt, const char *params, int kv, kvp_dtype in, uint32_t D, uint32_t H,
                  std::vector<unsigned char> &img, kvp__kvq_kparams &p) {
  kvp_codec_geom g = {D, in, 0, (uint32_t)kv, 1, H};
  void *inst = NULL;
  char err[256];
  size_t at;
  if (vt->create(params, &g, &inst, err, sizeof err, &at)) return NULL;
  img.assign(kvp__kvq_dev_image(inst, NULL), 0);
  kvp__kvq_dev_image(inst, img.data());
  kvp__kvq_kparams_fill(inst, img.data(), &p);
  return inst;
}

/* A calibration file whose per-channel figures are equal across channels
 * (every sample row is one value repeated), so equal inputs score equal:
 * the outlier pick's ties, broken by channel. One file per (D, bits). */
static char tie_paths[8][64];
static uint32_t tie_keys[8], tie_n;

static const char *tie_calib(uint32_t D, uint32_t bits) {
  char(*paths)[64] = tie_paths;
  uint32_t *keys = tie_keys, &nkeys = tie_n;
  for (uint32_t i = 0; i < nkeys; i++)
    if (keys[i] == D * 8 + bits) return paths[i];
  if (nkeys == 8) abort();
  char *path = paths[nkeys];
  snprintf(path, 64, "/tmp/kvq_emu_tiesXXXXXX");
  int fd = mkstemp(path);
  if (fd < 0) abort();
  close(fd);
  kvp_kvquant_calib *c;
  enum { NS = 512 };
  std::vector<float> x((size_t)NS * D);
  if (kvp_kvquant_calib_create(1, 2, D, bits, 0.05, &c)) abort();
  for (uint32_t h = 0; h < 2; h++)
    for (uint32_t kv = 0; kv < 2; kv++) {
      for (uint32_t t = 0; t < NS; t++) {
        float v = gauss() * 1.5f;
        for (uint32_t ch = 0; ch < D; ch++) x[(size_t)t * D + ch] = v;
      }
      if (kvp_kvquant_calib_add(c, 0, h, kv, x.data(), NULL, D, NS)) abort();
    }
  if (kvp_kvquant_calib_write(c, path)) {
    fprintf(stderr, "tie calibration: %s\n", kvp_last_error());
    abort();
  }
  kvp_kvquant_calib_destroy(c);
  keys[nkeys++] = D * 8 + bits;
  return path;
}

int main() {
#if defined(__SANITIZE_THREAD__)
  /* One OS thread whose coroutines switch stacks by hand: ThreadSanitizer
   * (which keeps a shadow call stack per thread) cannot follow them, and a
   * single thread has no race for it to find. */
  printf("xcheck_kvquant_emu: skipped under ThreadSanitizer (coroutine stack switches in one thread)\n");
  return 0;
#endif
  const kvp_codec_vtable *vt = vt_kvq();
  bool full = getenv("KVP_EMU_FULL") != NULL;
  static const char *const specs[] = {
      "",
      "bits=2:sink=0",
      "bits=4:outliers=0.05:sink=4",
      "outliers=0",
      "outlier_mode=threshold",
      "outlier_mode=threshold:outliers=0.2:bits=2:sink=3",
      "prerope=1:theta=500000:rope_dims=64",
      "prerope=1:bits=2:outliers=0.1:lut=uniform",
      "bits=4:outliers=0.3:prerope=1:sink=2",
  };
  static const uint32_t dims[] = {64, 80, 128, 200, 256};
  static const uint32_t ns_full[] = {1, 16, 33, 64}, ns_quick[] = {1, 33};
  long cases = 0;
  for (const char *spec : specs)
    for (int kv = 0; kv < 2; kv++)
      for (int in = 0; in < 3; in++)
        for (uint32_t D : dims) {
          if (!full && (in + D / 16 + kv) % 3) continue; /* quick: a third of (dtype, D, side) */
          std::vector<unsigned char> img;
          kvp__kvq_kparams p;
          void *inst = make(vt, spec, kv, (kvp_dtype)in, D, 2, img, p);
          if (!inst) continue;
          const uint32_t *ns = full ? ns_full : ns_quick;
          for (unsigned k = 0; k < (full ? 4u : 2u); k++)
            for (int pat = 0; pat < NPAT; pat++) {
              uint32_t pos0 = pat % 3 == 0 ? 0 : pat % 3 == 1 ? 2 : 100000 + 4093 * pat * (k + 1);
              one_case(vt, inst, p, spec, kv, (kvp_dtype)in, D, 64, ns[k], pat, pos0, (k + pat) % 2);
              cases++;
            }
          vt->destroy(inst);
        }
  /* ties: the pick by channel, signed zeros for V's range */
  static const char *const tie_specs[] = {"", "outlier_mode=threshold", "outliers=0.3:bits=2", "outliers=0.05:sink=3"};
  for (const char *ts : tie_specs)
    for (int kv = 0; kv < 2; kv++)
      for (uint32_t D : {64u, 80u, 128u}) {
        char spec[256];
        uint32_t bits = strstr(ts, "bits=2") ? 2 : 3;
        snprintf(spec, sizeof spec, "calib=%s%s%s", tie_calib(D, bits), *ts ? ":" : "", ts);
        std::vector<unsigned char> img;
        kvp__kvq_kparams p;
        void *inst = make(vt, spec, kv, KVP_DTYPE_BF16, D, 2, img, p);
        if (!inst) {
          fprintf(stderr, "create(%s): %s\n", spec, kvp_last_error());
          abort();
        }
        for (uint32_t n : {5u, 64u}) {
          one_case(vt, inst, p, spec, kv, KVP_DTYPE_BF16, D, 64, n, PAT_TIES, n == 5 ? 0 : 777, n % 2);
          cases++;
        }
        vt->destroy(inst);
      }
  /* a NaN: reported first, at its row and channel */
  {
    std::vector<unsigned char> img;
    kvp__kvq_kparams p;
    void *inst = make(vt, "outlier_mode=threshold", 1, KVP_DTYPE_F32, 128, 1, img, p);
    std::vector<unsigned char> src = make_rows(KVP_DTYPE_F32, 20, 128, PAT_GAUSS);
    float nan = NAN;
    memcpy(&src[(13 * 128 + 77) * 4], &nan, 4);
    Pages dp(vt, inst, 100, 32, 0);
    kvp_codec_dev_job j = {};
    memcpy(j.pages, dp.ptr, sizeof j.pages);
    j.src = src.data(), j.stride_bytes = 512, j.n = 20, j.cap_tokens = 32, j.m = 20, j.pos0 = 100;
    uint64_t st = emu_encode(p, j);
    EXPECT(st == ((uint64_t)KVP_DEV_BAD_NONFINITE << 60 | (13 * 128 + 77)), "NaN: status %016llx",
           (unsigned long long)st);
    vt->destroy(inst);
  }
  for (uint32_t i = 0; i < tie_n; i++) unlink(tie_paths[i]);
  printf("xcheck_kvquant_emu: %ld cases%s (whole block, two appends, 3 decode dtypes)\n", cases,
         full ? " (full sweep)" : "");
  return emu_summary();
}
