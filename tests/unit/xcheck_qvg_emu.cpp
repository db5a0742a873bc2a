/*
 * tests/unit/xcheck_qvg_emu.cpp - QVG's device encode and decode
 * (kernels/qvg.cuh) run on the host through tests/unit/cuda_emu.h, one CTA
 * of coroutine threads per job, against the host codec (codecs/qvg.c):
 *
 *   encode: the device's pages (pre-filled with 0xA5: every byte must be
 *   written) == the host encode's, byte for byte, cold (no state) and warm
 *   (a stream's state carried over three blocks: the state bytes equal
 *   after each);
 *   decode of rows [t0, n) in 3 out dtypes == the host decode, bit for bit;
 *   a NaN or Inf in the input is reported KVP_DEV_BAD_NONFINITE at its
 *   (row, channel).
 *
 * Inputs: clustered rows (so k-means has structure to find: equal
 * distances and ties in the k-means++ weights included), plain Gaussian
 * rows, and rows with repeated tokens (empty clusters, zero weights).
 * Specs: qvg, qvg-pro, bits=4, few centroids, no stages, blocks shorter
 * than k; D 32, 64 and 128; all three input dtypes. Host C++ without FMA
 * contraction (-ffp-contract=off). KVP_EMU_FULL=1 widens the sweep. The
 * last line has the Check summary format.
 */
#include "cuda_emu.h"

#include <cmath>

inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
  return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}
inline double __ddiv_rn(double a, double b) { return a / b; }

#include "../../kernels/qvg.cuh"

#include "kvpool_codec.h"

extern "C" const kvp_codec_vtable kvp__codec_qvg, kvp__codec_qvg_pro; /* codecs/qvg.c */

#include <vector>

#include "emu_expect.h"

/* ---- the emulated kernels ----------------------------------------------------------- */

struct EncArg {
  const kvp__qvg_kparams *p;
  const kvp_codec_dev_job *j;
  void *ws;
  unsigned long long *status;
  float *smem;
};
static void enc_body(void *a) {
  EncArg *e = (EncArg *)a;
  kvpk::qvg_::qvg_encode(*e->p, *e->j, e->ws, e->smem, 0, e->status);
}
struct DecArg {
  const kvp__qvg_kparams *p;
  const kvp_codec_dev_job *j;
  uint32_t out, part, nparts;
};
static void dec_body(void *a) {
  DecArg *d = (DecArg *)a;
  kvpk::qvg_::qvg_decode(*d->p, *d->j, d->out, d->part, d->nparts);
}

/* The CTA's dynamic shared memory, garbage-filled like the scratch. */
static std::vector<float> smem_of(const kvp__qvg_kparams &p) {
  std::vector<float> sm(kvpk::qvg_::qvg_smem_bytes(p.head_dim) / 4 + 1);
  memset(sm.data(), 0x5A, sm.size() * 4);
  return sm;
}

static uint64_t emu_encode(const kvp__qvg_kparams &p, const kvp_codec_dev_job &j) {
  unsigned long long st = KVP_DEV_STATUS_OK;
  std::vector<unsigned char> ws(kvp__qvg_ws_bytes(&p, j.cap_tokens), 0x5A); /* scratch holds garbage */
  std::vector<float> sm = smem_of(p);
  EncArg a = {&p, &j, ws.data(), &st, sm.data()};
  emu::run(kvpk::qvg_::kQvgThreads, 0, enc_body, &a);
  return st;
}
/* Decode in three parts (CTAs), as the launcher splits a job's rows. */
static void emu_decode(const kvp__qvg_kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  for (uint32_t part = 0; part < 3; part++) {
    DecArg a = {&p, &j, out, part, 3};
    emu::run(256, part, dec_body, &a);
  }
}

/* ---- inputs ---------------------------------------------------------------------------- */

enum { PAT_CLUSTERS, PAT_GAUSS, PAT_REPEATS, NPAT };

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static double urand() {
  rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
  return (double)(rng >> 11) / 9007199254740992.0;
}
static float gauss() { return (float)(sqrt(-2.0 * log(urand() + 1e-300)) * cos(6.283185307179586 * urand())); }

/* n rows of D: 12 cluster centres plus noise, plain noise, or 5 distinct
 * rows repeated (more centroids asked than distinct rows). */
static std::vector<float> make_values(int pat, uint32_t n, uint32_t D) {
  std::vector<float> v((size_t)n * D), ctr((size_t)12 * D);
  for (float &c : ctr) c = 3.0f * gauss();
  for (uint32_t t = 0; t < n; t++)
    for (uint32_t i = 0; i < D; i++) {
      float x;
      if (pat == PAT_CLUSTERS) x = ctr[(size_t)(t * 7 % 12) * D + i] + 0.25f * gauss();
      else if (pat == PAT_REPEATS) x = ctr[(size_t)(t % 5) * D + i];
      else x = gauss();
      v[(size_t)t * D + i] = x;
    }
  return v;
}

static std::vector<unsigned char> to_dtype(const std::vector<float> &v, kvp_dtype dt) {
  size_t esz = dt == KVP_DTYPE_F32 ? 4 : 2;
  std::vector<unsigned char> b(v.size() * esz);
  for (size_t i = 0; i < v.size(); i++) {
    if (dt == KVP_DTYPE_F32) memcpy(&b[4 * i], &v[i], 4);
    else {
      uint16_t h = (uint16_t)(dt == KVP_DTYPE_BF16 ? kvpk::bf16_from_f32(v[i]) : kvpk::f16_from_f32(v[i]));
      memcpy(&b[2 * i], &h, 2);
    }
  }
  return b;
}

/* ---- one binding ------------------------------------------------------------------------ */

struct Pages {
  kvp_codec_layout lay;
  std::vector<unsigned char> b[KVP_CODEC_MAX_PAGES];
  void *ptr[KVP_CODEC_MAX_PAGES] = {};
  Pages(const kvp_codec_vtable *vt, void *inst, uint32_t cap, int fill) {
    vt->layout(inst, cap, &lay);
    for (unsigned i = 0; i < lay.npages; i++) {
      b[i].assign(lay.bytes[i], (unsigned char)fill);
      ptr[i] = b[i].data();
    }
  }
};

/* The spec's kernel parameters, parsed back from its name and params
 * exactly as codecs/qvg.c defaults them. */
static kvp__qvg_kparams kparams(const char *name, const char *params, uint32_t D, kvp_dtype in) {
  bool pro = !strcmp(name, "qvg-pro");
  kvp__qvg_kparams p = {D, (uint32_t)in, pro ? 4u : 1u, pro ? 16u : 64u, 2u, 256u, 8u};
  const char *keys[] = {"stages=", "group=", "bits=", "k=", "iters="};
  uint32_t *f[] = {&p.stages, &p.group, &p.bits, &p.k, &p.iters};
  for (int i = 0; i < 5; i++) {
    const char *at = strstr(params, keys[i]);
    if (at && (at == params || at[-1] == ':')) *f[i] = (uint32_t)atoi(at + strlen(keys[i]));
  }
  return p;
}

static const char *pat_name(int pat) { return pat == PAT_CLUSTERS ? "clusters" : pat == PAT_GAUSS ? "gauss" : "repeats"; }

/* Blocks of ns[b] rows (capacity cap) of one stream, encoded on both sides
 * (with state when warm), then decoded. */
static void one_stream(const kvp_codec_vtable *vt, const char *params, uint32_t D, kvp_dtype in, int pat,
                       const uint32_t *ns, unsigned nblocks, uint32_t cap, bool warm) {
  kvp_codec_geom g = {D, in, 0, 0, 1, 1};
  void *inst = NULL;
  char err[256];
  size_t at = 0;
  if (vt->create(params, &g, &inst, err, sizeof err, &at)) {
    fprintf(stderr, "%s:%s D=%u: %s\n", vt->name, params, D, err);
    n_fail++;
    return;
  }
  kvp__qvg_kparams p = kparams(vt->name, params, D, in);
  size_t sb = vt->state_bytes(inst);
  std::vector<unsigned char> hstate(sb ? sb : 1, 0), dstate(sb ? sb : 1, 0);
  for (unsigned blk = 0; blk < nblocks; blk++) {
    uint32_t n = ns[blk];
    std::vector<unsigned char> src = to_dtype(make_values(pat, n, D), in);
    size_t stride = (size_t)D * (in == KVP_DTYPE_F32 ? 4 : 2);
    Pages hp(vt, inst, cap, 0x00), dp(vt, inst, cap, 0xA5);
    int rc = warm && sb ? vt->encode_stateful(inst, hstate.data(), src.data(), stride, n, cap, hp.ptr)
                        : vt->encode(inst, src.data(), stride, n, cap, hp.ptr);
    EXPECT(rc == 0, "host encode failed: %d", rc);
    kvp_codec_dev_job j = {};
    memcpy(j.pages, dp.ptr, sizeof j.pages);
    j.src = src.data(), j.dst = warm && sb ? dstate.data() : NULL, j.stride_bytes = stride;
    j.n = n, j.cap_tokens = cap, j.m = n;
    uint64_t st = emu_encode(p, j);
    EXPECT(st == KVP_DEV_STATUS_OK, "%s:%s D=%u in=%d %s n=%u: status %llx", vt->name, params, D, in, pat_name(pat), n,
           (unsigned long long)st);
    for (unsigned pg = 0; pg < hp.lay.npages; pg++) {
      size_t diff = 0;
      while (diff < hp.b[pg].size() && hp.b[pg][diff] == dp.b[pg][diff]) diff++;
      EXPECT(diff == hp.b[pg].size(), "%s:%s D=%u in=%d %s block %u n=%u cap=%u %s: page %u differs at byte %zu of %zu "
             "(host %02x device %02x)", vt->name, params, D, in, pat_name(pat), blk, n, cap, warm ? "warm" : "cold", pg,
             diff, hp.b[pg].size(), diff < hp.b[pg].size() ? hp.b[pg][diff] : 0,
             diff < hp.b[pg].size() ? dp.b[pg][diff] : 0);
    }
    if (warm && sb)
      EXPECT(!memcmp(hstate.data(), dstate.data(), sb), "%s:%s D=%u %s block %u: states differ", vt->name, params, D,
             pat_name(pat), blk);
    /* decode from the device pages (equal to the host's, or reported above) */
    for (uint32_t out = 0; out < 3; out++) {
      uint32_t t0 = n > 3 ? n / 3 : 0, m = n - t0;
      size_t osz = out == KVP_DTYPE_F32 ? 4 : 2;
      std::vector<unsigned char> hy((size_t)m * D * osz), dy((size_t)m * D * osz, 0xEE);
      rc = vt->decode(inst, hp.ptr, n, cap, t0, m, hy.data(), D * osz, (kvp_dtype)out);
      EXPECT(rc == 0, "host decode failed: %d", rc);
      kvp_codec_dev_job dj = {};
      memcpy(dj.pages, dp.ptr, sizeof dj.pages);
      dj.dst = dy.data(), dj.stride_bytes = D * osz, dj.n = n, dj.cap_tokens = cap, dj.t0 = t0, dj.m = m;
      emu_decode(p, dj, out);
      EXPECT(hy == dy, "%s:%s D=%u %s block %u: decode to dtype %u differs", vt->name, params, D, pat_name(pat), blk,
             out);
    }
  }
  vt->destroy(inst);
}

/* A NaN and an Inf in device input are reported at their (row, channel). */
static void nonfinite_reported(void) {
  const uint32_t D = 64, n = 20, cap = 32;
  kvp__qvg_kparams p = {D, KVP_DTYPE_F32, 1, 64, 2, 8, 2};
  std::vector<float> v = make_values(PAT_GAUSS, n, D);
  v[(size_t)13 * D + 5] = NAN;
  v[(size_t)17 * D + 60] = INFINITY;
  std::vector<unsigned char> src = to_dtype(v, KVP_DTYPE_F32);
  std::vector<unsigned char> pg[4];
  kvp_codec_dev_job j = {};
  size_t bytes[4] = {cap * D * 2 / 8, cap * 1, 8 * D * 2, cap};
  for (int i = 0; i < 4; i++) pg[i].assign(bytes[i], 0), j.pages[i] = pg[i].data();
  j.src = src.data(), j.stride_bytes = D * 4, j.n = n, j.cap_tokens = cap, j.m = n;
  uint64_t st = emu_encode(p, j);
  EXPECT(st >> 60 == KVP_DEV_BAD_NONFINITE && (st & 0xFFFFFFFFu) == 13 * D + 5,
         "non-finite input: status %llx, want kind %u at element %u", (unsigned long long)st, KVP_DEV_BAD_NONFINITE,
         13 * D + 5);
}

/* ---- the pool's path (codecs/qvg_cuda.c), its launches emulated ---------------------------
 * kvp__qvg_encode_pool and the codec's own encode_dev (the library's host
 * code, linked as built) over "device" memory that is host memory here: the
 * CUDA runtime calls they make are the host stand-ins below, and their
 * kernel launches run through the emulator. Checked: blocks of several
 * streams in one call (jobs sharing a state run in order, each from the last
 * one's centroids), the states staged in and copied back, the status word
 * naming the caller's job index, a workspace too small refused by name. */
#ifdef KVP_HAVE_CUDA
extern "C" {
int kvp__qvg_encode_pool(const void *inst, const kvp_codec_dev_job *jobs, void *const *hstates, uint32_t njobs,
                         void *ws, uint64_t ws_bytes, uint64_t *status, void *stream); /* codecs/builtin.h */
uint64_t kvp__qvg_pool_ws_bytes(const void *inst, uint32_t njobs, uint32_t nstates, uint32_t cap);
const char *kvp_last_error(void);
/* the CUDA runtime, as far as codecs/qvg_cuda.c uses it (enums are ints, streams pointers) */
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
  (void)kind, (void)stream;
  memcpy(dst, src, n);
  return 0;
}
int cudaMalloc(void **p, size_t n) { return (*p = malloc(n)) ? 0 : 2; }
int cudaFree(void *p) {
  free(p);
  return 0;
}
int cudaGetLastError(void) { return 0; }
int cudaDeviceSynchronize(void) { return 0; }
const char *cudaGetErrorString(int e) { return e ? "emulated failure" : "no error"; }
const char *kvp__kern_errstr(int e) { return cudaGetErrorString(e); }
/* kernels/qvg.cu's launchers: the same scratch stride and index map, one
 * emulated CTA per job in order (a wave's jobs are independent) */
static long launches;
int kvp__kern_qvg_encode(const kvp__qvg_kparams *p, const kvp_codec_dev_job *jobs, const uint32_t *index,
                         uint32_t njobs, void *ws, uint64_t ws_bytes, uint64_t *status, void *stream) {
  (void)stream;
  uint32_t maxcap = 0;
  for (uint32_t i = 0; i < njobs; i++) maxcap = jobs[i].cap_tokens > maxcap ? jobs[i].cap_tokens : maxcap;
  uint64_t stride = (kvp__qvg_ws_bytes(p, maxcap) + 255) & ~(uint64_t)255;
  if (njobs && ws_bytes < stride) return 1;
  launches++;
  for (uint32_t i = 0; i < njobs; i++) {
    std::vector<float> sm = smem_of(*p);
    EncArg a = {p, &jobs[i], (uint8_t *)ws + (i % (ws_bytes / stride)) * stride, (unsigned long long *)status,
                sm.data()};
    struct Idx {
      EncArg *a;
      uint32_t job;
    } x = {&a, index ? index[i] : i};
    emu::run(kvpk::qvg_::kQvgThreads, i, [](void *v) {
      Idx *q = (Idx *)v;
      kvpk::qvg_::qvg_encode(*q->a->p, *q->a->j, q->a->ws, q->a->smem, q->job, q->a->status);
    }, &x);
  }
  return 0;
}
int kvp__kern_qvg_decode(const kvp__qvg_kparams *p, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                         uint32_t njobs, uint32_t out, void *stream) {
  (void)jobs_dev, (void)stream;
  for (uint32_t i = 0; i < njobs; i++) emu_decode(*p, jobs[i], out);
  return 0;
}
}

static void pool_path(void) {
  enum { D = 64, NS = 3, NB = 3, CAP = 48 };
  const uint32_t ns[NB] = {48, 30, 48};
  kvp_codec_geom g = {D, KVP_DTYPE_BF16, 0, 0, 1, 1};
  void *inst = NULL;
  char err[256];
  size_t at = 0;
  if (kvp__codec_qvg_pro.create("k=8:iters=4", &g, &inst, err, sizeof err, &at)) {
    fprintf(stderr, "qvg-pro: %s\n", err);
    n_fail++;
    return;
  }
  const kvp_codec_vtable *vt = &kvp__codec_qvg_pro;
  size_t sb = vt->state_bytes(inst), stride = (size_t)D * 2;
  /* host: stream s's blocks in order, from its own state */
  std::vector<unsigned char> src[NS][NB], hst[NS], dst[NS];
  std::vector<Pages *> hp, dp;
  for (int s = 0; s < NS; s++) {
    hst[s].assign(sb, 0), dst[s].assign(sb, 0);
    for (int b = 0; b < NB; b++) {
      src[s][b] = to_dtype(make_values(b == 1 ? PAT_GAUSS : PAT_CLUSTERS, ns[b], D), KVP_DTYPE_BF16);
      hp.push_back(new Pages(vt, inst, CAP, 0));
      dp.push_back(new Pages(vt, inst, CAP, 0xA5));
      EXPECT(!vt->encode_stateful(inst, hst[s].data(), src[s][b].data(), stride, ns[b], CAP, hp.back()->ptr),
             "host encode");
    }
  }
  /* device: every block of every stream in one call, interleaved as a pool adds them (head by head) */
  std::vector<kvp_codec_dev_job> jobs;
  std::vector<void *> states;
  for (int s = 0; s < NS; s++)
    for (int b = 0; b < NB; b++) {
      kvp_codec_dev_job j = {};
      memcpy(j.pages, dp[s * NB + b]->ptr, sizeof j.pages);
      j.src = src[s][b].data(), j.stride_bytes = stride, j.n = ns[b], j.cap_tokens = CAP, j.m = ns[b];
      jobs.push_back(j);
      states.push_back(dst[s].data());
    }
  uint64_t need = kvp__qvg_pool_ws_bytes(inst, 1, NS, CAP);
  std::vector<unsigned char> ws(need);
  uint64_t status = KVP_DEV_STATUS_OK;
  long before = launches;
  int rc = kvp__qvg_encode_pool(inst, jobs.data(), states.data(), (uint32_t)jobs.size(), ws.data(), need, &status, NULL);
  EXPECT(rc == 0 && status == KVP_DEV_STATUS_OK, "pool path: rc %d (%s), status %llx", rc, rc ? kvp_last_error() : "",
         (unsigned long long)status);
  EXPECT(launches - before == NB, "pool path: %ld launches for %d blocks a stream, want one a level", launches - before,
         NB);
  for (int s = 0; s < NS; s++) {
    EXPECT(hst[s] == dst[s], "pool path: stream %d: the state copied back differs from the host's", s);
    for (int b = 0; b < NB; b++)
      for (unsigned pg = 0; pg < hp[s * NB + b]->lay.npages; pg++)
        EXPECT(hp[s * NB + b]->b[pg] == dp[s * NB + b]->b[pg], "pool path: stream %d block %d page %u differs", s, b,
               pg);
  }
  /* a NaN in the last block of stream 1 (job 5, launched third): the status names job 5 */
  std::vector<unsigned char> bad = src[1][2];
  uint16_t nan = 0x7FC0;
  memcpy(&bad[(size_t)(9 * D + 4) * 2], &nan, 2);
  jobs[5].src = bad.data();
  status = KVP_DEV_STATUS_OK;
  rc = kvp__qvg_encode_pool(inst, jobs.data(), states.data(), (uint32_t)jobs.size(), ws.data(), need, &status, NULL);
  EXPECT(rc == 0 && status == ((uint64_t)KVP_DEV_BAD_NONFINITE << 60 | 5ull << 32 | (9 * D + 4)),
         "pool path: a NaN in job 5: status %llx", (unsigned long long)status);
  /* a workspace one byte short: refused by name, nothing launched */
  before = launches;
  rc = kvp__qvg_encode_pool(inst, jobs.data(), states.data(), (uint32_t)jobs.size(), ws.data(), need - 1, &status, NULL);
  EXPECT(rc == KVP_ENOTSUP && strstr(kvp_last_error(), "workspace") && launches == before,
         "pool path: a short workspace: rc %d, %s", rc, kvp_last_error());
  for (Pages *x : hp) delete x;
  for (Pages *x : dp) delete x;
  vt->destroy(inst);
}
#endif

int main(void) {
#if defined(__SANITIZE_THREAD__)
  /* One OS thread whose coroutines switch stacks by hand: ThreadSanitizer
   * cannot follow them, and a single thread has no race for it to find. */
  printf("xcheck_qvg_emu: skipped under ThreadSanitizer (coroutine stack switches in one thread)\n");
  return 0;
#endif
  bool full = getenv("KVP_EMU_FULL") != NULL;
#if defined(__SANITIZE_ADDRESS__)
  /* ASan makes each of the emulator's stack switches cost a shadow clear:
   * its sweep keeps the specs of few centroids (the same code paths) */
  bool asan = true;
#else
  bool asan = false;
#endif
  struct {
    const kvp_codec_vtable *vt;
    const char *params;
  } specs[] = {
      {&kvp__codec_qvg, ""},
      {&kvp__codec_qvg_pro, ""},
      {&kvp__codec_qvg, "bits=4:k=16:iters=3"},
      {&kvp__codec_qvg, "stages=2:k=8:group=8"},
      {&kvp__codec_qvg, "stages=0:group=16"},
      {&kvp__codec_qvg_pro, "k=32:iters=20"},
  };
  static const uint32_t dims[] = {32, 64, 128};
  long streams = 0;
  for (auto &sp : specs)
    for (uint32_t D : dims)
      for (int in = 0; in < 3; in++)
        for (int pat = 0; pat < NPAT; pat++) {
          kvp__qvg_kparams p = kparams(sp.vt->name, sp.params, D, (kvp_dtype)in);
          if (D % p.group) continue;
          bool big = p.k >= 256; /* 256 centroids: fewer and shorter blocks */
          if (asan && !full && (big || in != KVP_DTYPE_BF16 || D > 64)) continue;
          if (!full && (in + D / 32 + pat) % (big ? 6 : 3)) continue; /* quick: a third (a sixth) of (dtype, D, pattern) */
          static const uint32_t ns_small[] = {40, 1, 29}, ns_big[] = {300, 17, 280};
          const uint32_t *ns = big ? ns_big : ns_small;
          uint32_t cap = big ? 320 : 48;
          one_stream(sp.vt, sp.params, D, (kvp_dtype)in, pat, ns, full ? 3 : 2, cap, false);
          one_stream(sp.vt, sp.params, D, (kvp_dtype)in, pat, ns, full ? 3 : 2, cap, true);
          streams += 2;
        }
  nonfinite_reported();
#ifdef KVP_HAVE_CUDA
  pool_path();
#endif
  printf("qvg device functions on the CPU emulator: %ld streams, pages, states and decodes bit-exact\n", streams);
  return emu_summary();
}
