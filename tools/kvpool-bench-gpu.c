/*
 * kvpool-bench-gpu - the device codecs and the paged gather, as ratios
 * against a device-to-device copy measured in the same run (cudaEvents on
 * one stream; each figure the median of R rounds, rounds alternating kvpool
 * and the baseline). Prints a table, then one JSON object per figure.
 *
 *   kvpool-bench-gpu [--rounds R] [--json]
 *
 * Figures (D = 128, bf16 in and out)
 *   gpu_codec      decode_dev of B blocks of 16 tokens (64 Ki token-heads)
 *                  to bf16, the jobs in a device table (one launch): (page
 *                  bytes read + bf16 bytes written) / time, against
 *                  cudaMemcpyAsync D2D of the bf16 bytes (2 x bytes / time);
 *                  device times: the stream waits at a gate until the call
 *                  returned, so the host's part (checking 4096 jobs, the
 *                  launches) is apart, as host_us (the copy gated alike);
 *                  target >= 0.85 of the copy. encode_dev of the same blocks
 *                  from bf16 likewise; the torch versions of the same
 *                  quantizers (tools/bench_torch.py, run after this by make
 *                  bench-gpu) compare against these times. kvquant (3-bit
 *                  nuq, 1% top-k outliers; 2 and 4 bits; pre-RoPE keys,
 *                  rotated at decode): target >= 0.6 of the copy for decode.
 *   gpu_gather     kvp_gather of one 32,768-token llama-3-8b layer (H = 8,
 *                  16-token blocks) per codec, against a copy of the decoded
 *                  bytes (K and V bf16: 128 MiB); target >= 0.8. Device time
 *                  (table copy + kernel) is timed with the stream held by a
 *                  host function until kvp_gather returned, so the host's
 *                  table building is apart: its time is host_us.
 *   gpu_attend     kvp_attend_decode of one llama-3-8b layer (32 query heads,
 *                  8 KV heads, D = 128) for batch 1, 8, 64 at context 4K, 32K,
 *                  128K, per codec: device time (table copy + kernels, the
 *                  host part apart as in gpu_gather), the effective bandwidth
 *                  (bytes of pages read / time) against the copy's (target
 *                  >= 0.7), and the host part: host_us a call that builds
 *                  the table (after kvp_reclaim moved the pool's structure
 *                  generation), host_kept_us the next, served by the
 *                  layer's kept table (a decode step's case while no block
 *                  is added). tools/bench_torch.py times
 *                  torch's SDPA (flash) over a dense bf16 cache of the same
 *                  shape and prints the speedups. gpu_attend_gather: the
 *                  gather to bf16 of the same batch (the gather-then-SDPA
 *                  baseline's first half). gpu_attend_evicted: batch 8
 *                  and 64 at 32K after per-head evictions keep about 10% of each
 *                  head's 1024-token steps (HeatKV's b = 0.1, drawn per
 *                  head): time against retained/total x the full time
 *                  (target <= 1.3). gpu_attend_decode: bf16 and nvfp4,
 *                  batch 64 x 32K of staggered lengths, the host part of a
 *                  decode step's call, and of one after a sequence left
 *                  and another joined (attend_decode_figure).
 *   gpu_qvg        qvg and qvg-pro: encode_dev of a batch of 32 whole
 *                  4096-token blocks (one segment of 32 heads, D = 128,
 *                  bf16; the codec alone: cold starts, its own scratch),
 *                  against the host encode of the same blocks on one core
 *                  (KVP_BENCH_QVG_HOST heads timed, default 2; the batch's
 *                  host time is their mean x 32): target >= 200x; the
 *                  torch k-means of the same shapes (tools/bench_torch.py)
 *                  must be slower. decode_dev of the batch to bf16 against
 *                  the copy, as gpu_codec: target >= 0.6.
 *   gpu_append_host_us  host time of a decode-step append on a CUDA pool,
 *                  64 sequences x 32 layers, per (seq, layer): kvp_append
 *                  of one token (its one status read-back included), per
 *                  codec; baseline: cudaMemcpyAsync of the same K/V bytes.
 *   gpu_store      kvp_seq_offload and kvp_seq_restore of one 32,768-token
 *                  llama-3-8b sequence (32-token blocks) through a local
 *                  redis-server (tools/redis_srv.h; skipped without one),
 *                  bf16 and nvfp4, from a CUDA pool (pages staged through
 *                  its pinned halves on the store's stream; the restore
 *                  timed until the stream passed its copies) and from a
 *                  host pool of the same shape in the same run: MB/s of
 *                  blob bytes and tokens/s each way, the median of up to 3
 *                  round trips.
 */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvpool_codec.h"
#include "redis_srv.h"

#define CK(e)                                                                                         \
  do {                                                                                                \
    cudaError_t x_ = (e);                                                                             \
    if (x_ != cudaSuccess) {                                                                          \
      fprintf(stderr, "kvpool-bench-gpu: %s: %s\n", #e, cudaGetErrorString(x_));                     \
      exit(1);                                                                                        \
    }                                                                                                 \
  } while (0)
#define KV(e)                                                                                         \
  do {                                                                                                \
    int r_ = (e);                                                                                     \
    if (r_) {                                                                                         \
      fprintf(stderr, "kvpool-bench-gpu: %s: %s (%s)\n", #e, kvp_err_name(r_), kvp_last_error());   \
      exit(1);                                                                                        \
    }                                                                                                 \
  } while (0)

static int cmp_f(const void *a, const void *b) {
  float x = *(const float *)a, y = *(const float *)b;
  return (x > y) - (x < y);
}
static float median(float *v, int n) {
  qsort(v, n, sizeof *v, cmp_f);
  return n % 2 ? v[n / 2] : 0.5f * (v[n / 2 - 1] + v[n / 2]);
}
static double now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static cudaStream_t S;
static cudaEvent_t E0, E1;
static float ms_since_start(void) {
  float ms;
  CK(cudaEventRecord(E1, S));
  CK(cudaEventSynchronize(E1));
  CK(cudaEventElapsedTime(&ms, E0, E1));
  return ms;
}

/* A gate on the stream: work enqueued after it starts once gate_open.
 * KVP_BENCH_NOGATE=1 leaves it out (profilers that replay a kernel at its
 * launch would wait on it forever); the device times then include the
 * host part of the call. A call that waits for the device while the gate
 * is shut (a first call's synchronous table upload) would wait forever
 * too: after 2 s the gate opens itself and counts it (gate_timeouts); the
 * run then says its figures are void. Timed loops warm up ungated. */
static volatile int gate_open;
static int no_gate, gate_timeouts;
static void CUDART_CB gate_fn(void *arg) {
  (void)arg;
  double t0 = now_us();
  while (!__atomic_load_n(&gate_open, __ATOMIC_ACQUIRE))
    if (now_us() - t0 > 2e6) {
      __atomic_add_fetch(&gate_timeouts, 1, __ATOMIC_RELAXED);
      return;
    }
}

/* Device ms of what the host enqueues between gate_begin and gate_end:
 * the stream waits at the gate until gate_end, so the host's own part of
 * the call (checks, table building, launches) is apart; host_us (if not
 * NULL) gets that part, in microseconds. */
static double gate_t0;
static void gate_begin(void) {
  gate_open = 0;
  if (!no_gate) CK(cudaLaunchHostFunc(S, gate_fn, NULL));
  CK(cudaEventRecord(E0, S));
  gate_t0 = now_us();
}
static float gate_end(float *host_us) {
  if (host_us) *host_us = (float)(now_us() - gate_t0);
  __atomic_store_n(&gate_open, 1, __ATOMIC_RELEASE);
  return ms_since_start();
}

/* Device ms of a D2D copy of bytes, gated as the codec figures are. */
static float copy_gated_ms(void *dst, const void *src, size_t bytes) {
  gate_begin();
  CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, S));
  return gate_end(NULL);
}

static const char *const codecs[] = {"raw", "fp8", "fp8:scale=0.05", "int8", "int8:pct=99", "kivi:bits=2:group=16",
                                     "kivi:bits=4:group=16", "nvfp4", "nvfp4:rule=4/6", "nvfp4:ksmooth=store",
                                     "kvquant", "kvquant:bits=2", "kvquant:bits=4:outliers=0.05", "kvquant:prerope=1"};
#define NC (sizeof codecs / sizeof codecs[0])

static const kvp_codec_vtable *codec(const char *spec, int kv, void **inst) {
  char name[32];
  const char *c = strchr(spec, ':');
  snprintf(name, sizeof name, "%.*s", (int)(c ? c - spec : (long)strlen(spec)), spec);
  uint32_t id;
  KV(kvp_codec_find(name, &id));
  const kvp_codec_vtable *vt = kvp_codec_get(id);
  kvp_codec_geom g = {128, KVP_DTYPE_BF16, 0, (uint32_t)kv, 1, 1};
  char err[200];
  size_t at;
  if (vt->create(c ? c + 1 : "", &g, inst, err, sizeof err, &at)) {
    fprintf(stderr, "kvpool-bench-gpu: %s: %s\n", spec, err);
    exit(1);
  }
  return vt;
}

/* Median ms of a D2D copy of bytes. */
static float copy_ms(void *dst, const void *src, size_t bytes, int rounds) {
  float t[64];
  for (int r = 0; r < rounds; r++) {
    CK(cudaEventRecord(E0, S));
    CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, S));
    t[r] = ms_since_start();
  }
  return median(t, rounds);
}

static void codec_figures(int rounds, int json) {
  enum { BT = 16, D = 128, NB = 4096 }; /* 64 Ki token-heads */
  size_t in_bytes = (size_t)NB * BT * D * 2;
  void *src, *dst, *cbuf;
  CK(cudaMalloc(&src, in_bytes));
  CK(cudaMalloc(&dst, in_bytes));
  CK(cudaMalloc(&cbuf, 4 * in_bytes));
  uint16_t *h = malloc(in_bytes);
  uint64_t s = 1;
  for (size_t i = 0; i < in_bytes / 2; i++) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    h[i] = (uint16_t)(0x3C00u + (s >> 56) - 128u) ^ (uint16_t)(s >> 40 & 0x8000u); /* bf16 in about [-2, 2] */
  }
  CK(cudaMemcpy(src, h, in_bytes, cudaMemcpyHostToDevice));
  free(h);
  uint64_t *status;
  CK(cudaMalloc((void **)&status, 8));
  kvp_codec_dev_job *jobs = calloc(NB, sizeof *jobs), *jobs_dev;
  CK(cudaMalloc((void **)&jobs_dev, NB * sizeof *jobs));
  if (!json) printf("%-24s %12s %12s %12s %10s %10s\n", "codec (K side)", "enc GB/s", "dec GB/s", "copy GB/s",
                    "enc/copy", "dec/copy");
  for (unsigned c = 0; c < NC; c++) {
    void *inst;
    const kvp_codec_vtable *vt = codec(codecs[c], 0, &inst);
    kvp_codec_layout lay;
    vt->layout(inst, BT, &lay);
    size_t page_bytes = 0, off = 0;
    for (unsigned i = 0; i < lay.npages; i++) page_bytes += (lay.bytes[i] + 15) & ~(size_t)15;
    for (uint32_t b = 0; b < NB; b++) {
      jobs[b] = (kvp_codec_dev_job){.src = (char *)src + (size_t)b * BT * D * 2, .dst = (char *)dst + (size_t)b * BT * D * 2,
                                    .stride_bytes = D * 2, .n = BT, .cap_tokens = BT, .m = BT,
                                    .pos0 = 1024 + b * BT}; /* past kvquant's sink: the layout below */
      off = (size_t)b * page_bytes;
      for (unsigned i = 0; i < lay.npages; i++) {
        jobs[b].pages[i] = (char *)cbuf + off;
        off += (lay.bytes[i] + 15) & ~(size_t)15;
      }
    }
    CK(cudaMemcpy(jobs_dev, jobs, NB * sizeof *jobs, cudaMemcpyHostToDevice));
    size_t codes = 0;
    for (unsigned i = 0; i < lay.npages; i++) codes += lay.bytes[i];
    codes *= NB;
    float te[64], td[64], tc[64], he[64], hd[64];
    KV(vt->encode_dev(inst, jobs, jobs_dev, NB, status, S)); /* warm-up, ungated: a first call's uploads */
    KV(vt->decode_dev(inst, jobs, jobs_dev, NB, KVP_DTYPE_BF16, S));
    CK(cudaStreamSynchronize(S));
    for (int r = 0; r < rounds; r++) {
      gate_begin();
      KV(vt->encode_dev(inst, jobs, jobs_dev, NB, status, S));
      te[r] = gate_end(&he[r]);
      gate_begin();
      KV(vt->decode_dev(inst, jobs, jobs_dev, NB, KVP_DTYPE_BF16, S));
      td[r] = gate_end(&hd[r]);
      tc[r] = copy_gated_ms(dst, src, in_bytes);
    }
    float me = median(te, rounds), md = median(td, rounds), mc = median(tc, rounds);
    float mhe = median(he, rounds), mhd = median(hd, rounds);
    double moved = (double)(in_bytes + codes);
    double gbe = moved / me / 1e6, gbd = moved / md / 1e6, gbc = 2.0 * in_bytes / mc / 1e6;
    if (!json)
      printf("%-24s %12.1f %12.1f %12.1f %9.3fx %9.3fx   (enc %.1f us, dec %.1f us, copy %.1f us, %zu B codes; "
             "host enc %.1f us, dec %.1f us)\n",
             codecs[c], gbe, gbd, gbc, gbe / gbc, gbd / gbc, me * 1e3, md * 1e3, mc * 1e3, codes, mhe, mhd);
    printf("{\"figure\":\"gpu_codec\",\"codec\":\"%s\",\"token_heads\":%d,\"encode_us\":%.2f,\"decode_us\":%.2f,"
           "\"copy_us\":%.2f,\"encode_gbs\":%.1f,\"decode_gbs\":%.1f,\"copy_gbs\":%.1f,\"encode_vs_copy\":%.3f,"
           "\"decode_vs_copy\":%.3f,\"decode_target\":%.2f,\"encode_host_us\":%.2f,\"decode_host_us\":%.2f}\n",
           codecs[c], NB * BT, me * 1e3, md * 1e3, mc * 1e3, gbe, gbd, gbc, gbe / gbc, gbd / gbc,
           strncmp(codecs[c], "kvquant", 7) ? 0.85 : 0.6, mhe, mhd);
    vt->destroy(inst);
  }
  free(jobs);
  cudaFree(jobs_dev), cudaFree(src), cudaFree(dst), cudaFree(cbuf), cudaFree(status);
}

static void qvg_figures(int rounds, int json) {
  enum { NH = 32, N = 4096, D = 128 };
  static const char *const sp[] = {"qvg", "qvg-pro"};
  size_t in_bytes = (size_t)NH * N * D * 2;
  uint16_t *h = malloc(in_bytes);
  uint64_t s = 3;
  for (size_t t = 0; t < (size_t)NH * N; t++) /* a few dozen directions per head plus noise: structure to find */
    for (uint32_t i = 0; i < D; i++) {
      s = s * 6364136223846793005ull + 1442695040888963407ull;
      float x = (float)((int)((t * 2654435761u >> 7) % 48 * 37 + i * 11) % 97) / 24.0f - 2.0f +
                ((float)(s >> 40) / 16777216.0f - 0.5f) * 0.5f;
      uint32_t u;
      memcpy(&u, &x, 4);
      h[t * D + i] = (uint16_t)((u + 0x7FFFu + (u >> 16 & 1u)) >> 16);
    }
  void *src, *dst;
  CK(cudaMalloc(&src, in_bytes));
  CK(cudaMalloc(&dst, in_bytes));
  CK(cudaMemcpy(src, h, in_bytes, cudaMemcpyHostToDevice));
  uint64_t *status;
  CK(cudaMalloc((void **)&status, 8));
  int host_heads = getenv("KVP_BENCH_QVG_HOST") ? atoi(getenv("KVP_BENCH_QVG_HOST")) : 2;
  if (host_heads < 1 || host_heads > NH) host_heads = 2;
  int r_dev = rounds < 5 ? rounds : 5;
  if (!json) printf("%-10s %12s %12s %10s %12s %10s\n", "qvg batch", "device ms", "host ms", "speedup", "dec GB/s",
                    "dec/copy");
  for (unsigned c = 0; c < 2; c++) {
    void *inst;
    const kvp_codec_vtable *vt = codec(sp[c], 0, &inst);
    kvp_codec_layout lay;
    vt->layout(inst, N, &lay);
    size_t per = 0;
    for (unsigned i = 0; i < lay.npages; i++) per += (lay.bytes[i] + 255) & ~(size_t)255;
    char *pages;
    CK(cudaMalloc((void **)&pages, per * NH));
    kvp_codec_dev_job jobs[NH];
    for (uint32_t b = 0; b < NH; b++) {
      jobs[b] = (kvp_codec_dev_job){.src = (char *)src + (size_t)b * N * D * 2, .dst = NULL, .stride_bytes = D * 2,
                                    .n = N, .cap_tokens = N, .m = N};
      size_t off = (size_t)b * per;
      for (unsigned i = 0; i < lay.npages; i++) {
        jobs[b].pages[i] = pages + off;
        off += (lay.bytes[i] + 255) & ~(size_t)255;
      }
    }
    KV(vt->encode_dev(inst, jobs, NULL, NH, status, S)); /* warm-up: the scratch is made here */
    CK(cudaStreamSynchronize(S));
    float te[64], td[64], tc[64];
    for (int r = 0; r < r_dev; r++) {
      CK(cudaEventRecord(E0, S));
      KV(vt->encode_dev(inst, jobs, NULL, NH, status, S));
      te[r] = ms_since_start();
    }
    kvp_codec_dev_job dj[NH];
    size_t codes = 0;
    for (unsigned i = 0; i < lay.npages; i++) codes += lay.bytes[i];
    for (uint32_t b = 0; b < NH; b++) {
      dj[b] = jobs[b];
      dj[b].dst = (char *)dst + (size_t)b * N * D * 2, dj[b].src = NULL, dj[b].t0 = 0;
    }
    KV(vt->decode_dev(inst, dj, NULL, NH, KVP_DTYPE_BF16, S)); /* warm-up, ungated */
    CK(cudaStreamSynchronize(S));
    for (int r = 0; r < rounds; r++) {
      gate_begin();
      KV(vt->decode_dev(inst, dj, NULL, NH, KVP_DTYPE_BF16, S));
      td[r] = gate_end(NULL);
      tc[r] = copy_gated_ms(dst, src, in_bytes);
    }
    /* the host encode of host_heads of the same blocks, one core */
    void *hp[KVP_CODEC_MAX_PAGES];
    for (unsigned i = 0; i < lay.npages; i++) hp[i] = malloc(lay.bytes[i]);
    double th = 0;
    for (int b = 0; b < host_heads; b++) {
      double t0 = now_us();
      KV(vt->encode(inst, h + (size_t)b * N * D, D * 2, N, N, hp));
      th += now_us() - t0;
    }
    for (unsigned i = 0; i < lay.npages; i++) free(hp[i]);
    double host_batch_ms = th / host_heads * NH / 1e3;
    float me = median(te, r_dev), md = median(td, rounds), mc = median(tc, rounds);
    double gbd = ((double)codes * NH + (double)in_bytes) / md / 1e6, gbc = 2.0 * in_bytes / mc / 1e6;
    if (!json)
      printf("%-10s %12.2f %12.1f %9.0fx %12.1f %9.3fx   (%d host heads timed; decode %.1f us, copy %.1f us)\n", sp[c],
             me, host_batch_ms, host_batch_ms / me, gbd, gbd / gbc, host_heads, md * 1e3, mc * 1e3);
    printf("{\"figure\":\"gpu_qvg\",\"codec\":\"%s\",\"heads\":%d,\"tokens\":%d,\"head_dim\":%d,"
           "\"encode_us\":%.1f,\"host_encode_us\":%.1f,\"host_heads_timed\":%d,\"speedup_vs_host\":%.1f,"
           "\"speedup_target\":200,\"decode_us\":%.2f,\"copy_us\":%.2f,\"decode_vs_copy\":%.3f,"
           "\"decode_target\":0.6}\n",
           sp[c], NH, N, D, me * 1e3, host_batch_ms * 1e3, host_heads, host_batch_ms / me, md * 1e3, mc * 1e3,
           gbd / gbc);
    cudaFree(pages);
    vt->destroy(inst);
  }
  free(h);
  cudaFree(src), cudaFree(dst), cudaFree(status);
}

static const char *const pool_codecs[] = {"kv=bf16", "kv=fp8", "kv=int8", "kv=kivi:bits=2:group=16", "kv=nvfp4",
                                          "k=nvfp4:ksmooth=store,v=nvfp4"};
#define NPC (sizeof pool_codecs / sizeof pool_codecs[0])

static kvp_pool *cuda_pool(const char *spec, uint32_t L, uint64_t region) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = 8, c.head_dim = 128;
  c.k_dtype = c.v_dtype = KVP_DTYPE_BF16;
  c.memory = KVP_MEM_CUDA, c.region_bytes = region, c.block_tokens = 16, c.codecs = spec;
  kvp_pool *p;
  KV(kvp_pool_create(&c, &p));
  return p;
}

static void gather_figures(int rounds, int json) {
  enum { T = 32768, H = 8, D = 128 };
  size_t bytes = (size_t)T * H * D * 2;
  void *k, *v, *ko, *vo, *ws;
  CK(cudaMalloc(&k, bytes));
  CK(cudaMalloc(&v, bytes));
  CK(cudaMalloc(&ko, bytes));
  CK(cudaMalloc(&vo, bytes));
  uint16_t *h = malloc(bytes);
  for (size_t i = 0; i < bytes / 2; i++) h[i] = (uint16_t)(0x3E00u + (i * 2654435761u >> 24) % 256u);
  CK(cudaMemcpy(k, h, bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, h, bytes, cudaMemcpyHostToDevice));
  free(h);
  for (unsigned c = 0; c < NPC; c++) {
    kvp_pool *p = cuda_pool(pool_codecs[c], 1, 1ull << 30);
    kvp_seq_config sc;
    kvp_seq_config_init(&sc);
    sc.mode = KVP_SEQ_STEP;
    KV(kvp_seq_add(p, 1, &sc));
    KV(kvp_step_begin(p, 1, T, 0));
    KV(kvp_append(p, 1, 0, &(kvp_kv){k, v, S}));
    KV(kvp_step_end(p, 1));
    kvp_gather_item it = {.seq = 1, .layer = 0};
    kvp_gather_req g;
    kvp_gather_req_init(&g);
    g.items = &it, g.n_items = 1, g.k_out = ko, g.v_out = vo, g.capacity_rows = T, g.stream = S;
    if (kvp_gather(p, &g) != KVP_ENOSPC) exit(1);
    CK(cudaMalloc(&ws, g.workspace_needed));
    g.workspace = ws, g.workspace_bytes = g.workspace_needed;
    float tg[64], tc[64], th[64];
    for (int r = 0; r < rounds; r++) {
      gate_begin();
      KV(kvp_gather(p, &g));
      tg[r] = gate_end(&th[r]);
      tc[r] = copy_ms(ko, k, bytes, 1) + copy_ms(vo, v, bytes, 1);
    }
    float mg = median(tg, rounds), mc = median(tc, rounds), mh = median(th, rounds);
    if (!json)
      printf("gather %-34s %8.1f us  copy %8.1f us  %6.3fx of the copy  (host part %.0f us, %u launch, table %llu KiB)\n",
             pool_codecs[c], mg * 1e3, mc * 1e3, mc / mg, mh, g.n_launches,
             (unsigned long long)g.workspace_needed >> 10);
    printf("{\"figure\":\"gpu_gather\",\"codecs\":\"%s\",\"tokens\":%d,\"heads\":%d,\"gather_us\":%.1f,\"copy_us\":%.1f,"
           "\"vs_copy\":%.3f,\"host_us\":%.1f,\"launches\":%u,\"table_bytes\":%llu,\"target\":0.8}\n",
           pool_codecs[c], T, H, mg * 1e3, mc * 1e3, mc / mg, mh, g.n_launches,
           (unsigned long long)g.workspace_needed);
    cudaFree(ws);
    kvp_pool_destroy(p);
  }
  cudaFree(k), cudaFree(v), cudaFree(ko), cudaFree(vo);
}

/* Device ms of one kvp_attend_decode (the stream gated until the call
 * returned, so its host part is apart: *host_us). */
static float attend_ms(kvp_pool *p, kvp_attend_req *a, float *host_us) {
  gate_begin();
  KV(kvp_attend_decode(p, a));
  return gate_end(host_us);
}

/* only: a comma list of spec prefixes ("kv=kivi" selects "kv=kivi:bits=2:group=16"); NULL selects all. */
static int selected(const char *only, const char *spec) {
  for (const char *t = only; t && *t; t += strcspn(t, ",") + (t[strcspn(t, ",")] == ',')) {
    size_t n = strcspn(t, ",");
    if (n && !strncmp(spec, t, n)) return 1;
  }
  return !only;
}

/* len tokens appended to layer 0 of seq in steps of at most step tokens (k
 * and v: device rows of that many tokens). */
static void append_tokens(kvp_pool *p, uint64_t seq, uint32_t len, uint32_t step, void *k, void *v) {
  for (uint32_t t = 0; t < len; t += step) {
    KV(kvp_step_begin(p, seq, len - t < step ? len - t : step, 0));
    KV(kvp_append(p, seq, 0, &(kvp_kv){k, v, S}));
    KV(kvp_step_end(p, seq));
  }
}

/* gpu_attend_decode: decode steps of a batch of staggered lengths, as a
 * serving engine runs them: 64 stream-mode sequences of 32K - s % 16
 * tokens (one layer, 8 KV heads, D = 128), each call after one token
 * appended to every sequence (not timed), so 4 of them add a block at
 * every step. host_us: the call's host part (the layer's kept table, the
 * ends of those 4 redone); join_us: the same after one sequence left
 * (freed) and a new one of 32K tokens took its place in the batch (the
 * kept table walks the new one alone); built_us: a call after kvp_reclaim
 * moved the pool's structure (the whole table built); attend_us the device
 * time of the decode calls. */
static void attend_decode_figure(const char *spec, void *k, void *v, void *q, void *out, int rounds, int json) {
  enum { HQ = 32, H = 8, D = 128, B = 64, CTX = 32768, STEP = 1024 };
  kvp_pool *p = cuda_pool(spec, 1, (uint64_t)B * CTX * H * D * 2 * 2 * 5 / 4 + (256ull << 20)); /* raw K and V, +25% */
  uint64_t seqs[B];
  for (uint32_t sq = 0; sq < B; sq++) {
    KV(kvp_seq_add(p, seqs[sq] = sq, NULL));
    append_tokens(p, sq, CTX - sq % 16, STEP, k, v);
  }
  kvp_attend_req a;
  kvp_attend_req_init(&a);
  a.layer = 0, a.seqs = seqs, a.batch = B, a.n_q_heads = HQ, a.q = q, a.out = out;
  a.scale = 0.08838834764831845f, a.stream = S;
  if (kvp_attend_decode(p, &a) != KVP_ENOSPC) exit(1);
  void *ws;
  size_t ws_bytes = a.workspace_needed * 2; /* room for the tables of the steps to come */
  CK(cudaMalloc(&ws, ws_bytes));
  a.workspace = ws, a.workspace_bytes = ws_bytes;
  float t[64], th[64], tb[64], tj[64];
  int n = 3 * rounds < 64 ? 3 * rounds : 64;
  attend_ms(p, &a, &th[0]); /* warm-up: builds and keeps the table */
  for (int r = 0; r < n; r++) {
    for (uint32_t sq = 0; sq < B; sq++) {
      append_tokens(p, sq, 1, 1, k, v);
    }
    t[r] = attend_ms(p, &a, &th[r]);
  }
  for (int r = 0; r < rounds; r++) { /* a sequence leaves, a new one takes its place */
    uint32_t i = (uint32_t)(r * 37 % B);
    KV(kvp_seq_free(p, seqs[i]));
    KV(kvp_seq_add(p, seqs[i] = 1000 + (uint64_t)r, NULL));
    append_tokens(p, seqs[i], CTX - i % 16, STEP, k, v);
    attend_ms(p, &a, &tj[r]);
  }
  for (int r = 0; r < rounds; r++) {
    KV(kvp_reclaim(p));
    attend_ms(p, &a, &tb[r]);
  }
  float mt = median(t, n), mh = median(th, n), mb = median(tb, rounds), mj = median(tj, rounds);
  if (!json)
    printf("attend %-24s B=%2u ctx= 32768 decode steps, staggered lengths: host %.0f us a call, %.0f us after a "
           "sequence joined (%.0f us built), device %.1f us\n",
           spec, B, mh, mj, mb, mt * 1e3);
  printf("{\"figure\":\"gpu_attend_decode\",\"codecs\":\"%s\",\"batch\":%u,\"ctx\":%u,\"host_us\":%.1f,"
         "\"join_us\":%.1f,\"built_us\":%.1f,\"attend_us\":%.2f,\"calls\":%d}\n",
         spec, B, CTX, mh, mj, mb, mt * 1e3, n);
  cudaFree(ws);
  kvp_pool_destroy(p);
}

static void attend_figures(int rounds, int json) {
  enum { HQ = 32, H = 8, D = 128, NB = 3, NCTX = 3, STEP = 1024, MAXB = 64 };
  static const uint32_t batch[NB] = {1, 8, 64}, ctx[NCTX] = {4096, 32768, 131072};
  static const char *const ac[] = {"kv=bf16", "kv=fp8", "kv=int8", "kv=nvfp4", "kv=kivi:bits=2:group=16"};
  const char *only = getenv("KVP_ATTEND_CODECS"); /* a comma list of spec prefixes, to narrow a run */
  uint32_t maxctx = getenv("KVP_ATTEND_MAXCTX") ? (uint32_t)atoi(getenv("KVP_ATTEND_MAXCTX")) : 0;
  size_t step_bytes = (size_t)STEP * H * D * 2, cbytes = 256ull << 20;
  void *k, *v, *q, *out, *ws, *cs, *cd, *go_k = NULL, *go_v = NULL, *gws = NULL;
  CK(cudaMalloc(&k, step_bytes));
  CK(cudaMalloc(&v, step_bytes));
  CK(cudaMalloc(&q, (size_t)MAXB * HQ * D * 2));
  CK(cudaMalloc(&out, (size_t)MAXB * HQ * D * 2));
  CK(cudaMalloc(&cs, cbytes));
  CK(cudaMalloc(&cd, cbytes));
  uint16_t *h = malloc(step_bytes);
  for (size_t i = 0; i < step_bytes / 2; i++) h[i] = (uint16_t)(0x3E00u + (i * 2654435761u >> 24) % 256u) ^ (i & 1u) << 15;
  CK(cudaMemcpy(k, h, step_bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(v, h, step_bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(q, h, (size_t)MAXB * HQ * D * 2, cudaMemcpyHostToDevice));
  free(h);
  float copy = copy_ms(cd, cs, cbytes, rounds);
  double copy_gbs = 2.0 * cbytes / (copy * 1e6);
  if (!json) printf("attend: device copy %.0f GB/s (read + write of 256 MiB)\n", copy_gbs);
  size_t gcap = (size_t)8 * 131072; /* gather baseline up to 8 x 128K rows */
  CK(cudaMalloc(&go_k, gcap * H * D * 2));
  CK(cudaMalloc(&go_v, gcap * H * D * 2));
  for (unsigned c = 0; c < sizeof ac / sizeof *ac; c++)
    for (unsigned x = 0; x < NCTX && selected(only, ac[c]) && (!maxctx || ctx[x] <= maxctx); x++) {
      uint64_t region = (uint64_t)MAXB * ctx[x] * H * D * 4 * (c ? 6 : 10) / 10 + (256ull << 20);
      double t_build = now_us();
      kvp_pool *p = cuda_pool(ac[c], 1, region);
      kvp_seq_config sc;
      kvp_seq_config_init(&sc);
      sc.mode = KVP_SEQ_STEP;
      uint64_t seqs[MAXB];
      for (uint32_t sq = 0; sq < MAXB; sq++) {
        KV(kvp_seq_add(p, seqs[sq] = sq, &sc));
        append_tokens(p, sq, ctx[x], STEP, k, v);
      }
      fprintf(stderr, "attend: %s ctx %u: pool of %u sequences built in %.1f s\n", ac[c], ctx[x], MAXB,
              (now_us() - t_build) / 1e6);
      kvp_attend_req a;
      kvp_attend_req_init(&a);
      a.layer = 0, a.seqs = seqs, a.n_q_heads = HQ, a.q = q, a.out = out, a.scale = 0.08838834764831845f;
      a.stream = S;
      a.batch = MAXB;
      if (kvp_attend_decode(p, &a) != KVP_ENOSPC) exit(1);
      CK(cudaMalloc(&ws, a.workspace_needed));
      void *pinned;
      CK(cudaMallocHost(&pinned, a.workspace_needed));
      a.workspace = ws, a.workspace_bytes = a.workspace_needed;
      KV(kvp_attend_decode(p, &a)); /* warm-up */
      CK(cudaStreamSynchronize(S));
      for (unsigned bi = 0; bi < NB; bi++) {
        a.batch = batch[bi];
        float t[64], th[64], tb[64];
        for (int r = 0; r < rounds; r++) { /* a call that builds the table (the pool's structure moved), one kept */
          KV(kvp_reclaim(p));
          attend_ms(p, &a, &tb[r]);
          t[r] = attend_ms(p, &a, &th[r]);
        }
        float mt = median(t, rounds), mh = median(th, rounds), mb = median(tb, rounds);
        double gbs = a.bytes_read / (mt * 1e6);
        float tt[64]; /* the table's share: a copy of as many bytes from pinned memory */
        for (int r = 0; r < rounds; r++) {
          CK(cudaEventRecord(E0, S));
          CK(cudaMemcpyAsync(ws, pinned, a.workspace_needed, cudaMemcpyHostToDevice, S));
          tt[r] = ms_since_start();
        }
        float mtab = median(tt, rounds);
        if (!json)
          printf("attend %-24s B=%2u ctx=%6u %9.1f us  %6.0f GB/s  %5.2fx of the copy  (%u splits, table copy %.1f us, "
                 "host %.0f us built, %.0f us kept)\n",
                 ac[c], batch[bi], ctx[x], mt * 1e3, gbs, gbs / copy_gbs, a.n_splits, mtab * 1e3, mb, mh);
        printf("{\"figure\":\"gpu_attend\",\"codecs\":\"%s\",\"batch\":%u,\"ctx\":%u,\"q_heads\":%d,"
               "\"kv_heads\":%d,\"head_dim\":%d,\"attend_us\":%.2f,\"host_us\":%.1f,\"host_kept_us\":%.1f,\"bytes_read\":%llu,"
               "\"gbs\":%.1f,\"copy_gbs\":%.1f,\"vs_copy\":%.3f,\"splits\":%u,\"table_bytes\":%llu,"
               "\"table_copy_us\":%.2f,\"target_vs_copy\":0.7}\n",
               ac[c], batch[bi], ctx[x], HQ, H, D, mt * 1e3, mb, mh, (unsigned long long)a.bytes_read, gbs, copy_gbs,
               gbs / copy_gbs, a.n_splits, (unsigned long long)a.workspace_needed, mtab * 1e3);
        if (batch[bi] <= 8 && (size_t)batch[bi] * ctx[x] <= gcap) { /* gather to bf16, the first half of gather-then-SDPA */
          kvp_gather_item it[8];
          kvp_gather_req g;
          kvp_gather_req_init(&g);
          for (uint32_t i = 0; i < batch[bi]; i++) it[i] = (kvp_gather_item){.seq = i, .layer = 0};
          g.items = it, g.n_items = batch[bi], g.k_out = go_k, g.v_out = go_v, g.capacity_rows = (uint32_t)gcap;
          g.stream = S;
          if (kvp_gather(p, &g) != KVP_ENOSPC) exit(1);
          CK(cudaMalloc(&gws, g.workspace_needed));
          g.workspace = gws, g.workspace_bytes = g.workspace_needed;
          float tg[64];
          for (int r = 0; r < rounds; r++) {
            gate_begin();
            KV(kvp_gather(p, &g));
            tg[r] = gate_end(NULL);
          }
          printf("{\"figure\":\"gpu_attend_gather\",\"codecs\":\"%s\",\"batch\":%u,\"ctx\":%u,\"gather_us\":%.2f}\n",
                 ac[c], batch[bi], ctx[x], median(tg, rounds) * 1e3);
          cudaFree(gws);
        }
      }
      if (ctx[x] == 32768 && (c == 0 || c == 3)) { /* bf16, nvfp4: evictions keep ~10% of each head's steps */
        /* batch 8 and 64: a call's fixed cost (launches, the splits' copy, the
         * merge) weighs on the small one */
        static const uint32_t eb[2] = {8, MAXB};
        float t[64], th[64], full[2];
        uint64_t full_th[2];
        for (int i = 0; i < 2; i++) {
          a.batch = eb[i];
          for (int r = 0; r < rounds; r++) t[r] = attend_ms(p, &a, &th[r]);
          full[i] = median(t, rounds), full_th[i] = a.token_heads;
        }
        uint32_t nsteps = ctx[x] / STEP;
        double t_ev = now_us();
        for (uint32_t sq = 0; sq < MAXB; sq++)
          for (uint32_t hh = 0; hh < H; hh++)
            for (uint32_t st = 0; st < nsteps; st++)
              if (((sq * 131 + hh * 31 + st) * 2654435761u >> 16) % 10 != 0) KV(kvp_evict(p, sq, 0, hh, st));
        fprintf(stderr, "attend: %s: evictions took %.1f s\n", ac[c], (now_us() - t_ev) / 1e6);
        for (int i = 0; i < 2; i++) {
          a.batch = eb[i];
          for (int r = 0; r < rounds; r++) t[r] = attend_ms(p, &a, &th[r]);
          float ev = median(t, rounds);
          double frac = (double)a.token_heads / full_th[i], ratio = ev / (frac * full[i]);
          if (!json)
            printf("attend %-24s B=%2u ctx= 32768 evicted to %.3f of the tokens: %8.1f us, full %8.1f us: %.2fx of "
                   "retained/total x full (target <= 1.3)\n",
                   ac[c], eb[i], frac, ev * 1e3, full[i] * 1e3, ratio);
          printf("{\"figure\":\"gpu_attend_evicted\",\"codecs\":\"%s\",\"batch\":%u,\"ctx\":32768,"
                 "\"retained_fraction\":%.4f,\"evicted_us\":%.2f,\"full_us\":%.2f,\"ratio\":%.3f,\"target\":1.3}\n",
                 ac[c], eb[i], frac, ev * 1e3, full[i] * 1e3, ratio);
        }
      }
      cudaFree(ws);
      cudaFreeHost(pinned);
      kvp_pool_destroy(p);
      if (ctx[x] == 32768 && (c == 0 || c == 3)) attend_decode_figure(ac[c], k, v, q, out, rounds, json);
    }
  cudaFree(k), cudaFree(v), cudaFree(q), cudaFree(out), cudaFree(cs), cudaFree(cd), cudaFree(go_k), cudaFree(go_v);
}

static void append_figures(int rounds, int json) {
  enum { NS = 64, L = 32, H = 8, D = 128, PRE = 100 };
  size_t bytes = (size_t)H * D * 2;
  void *k, *v, *scratch;
  CK(cudaMalloc(&k, bytes * PRE));
  CK(cudaMalloc(&v, bytes * PRE));
  CK(cudaMalloc(&scratch, bytes * 2));
  CK(cudaMemset(k, 0x3C, bytes * PRE));
  CK(cudaMemset(v, 0x3C, bytes * PRE));
  for (unsigned c = 0; c < NPC; c++) {
    kvp_pool *p = cuda_pool(pool_codecs[c], L, 4ull << 30);
    for (uint64_t s = 0; s < NS; s++) { /* a 100-token prefill each */
      KV(kvp_seq_add(p, s, NULL));
      KV(kvp_step_begin(p, s, PRE, 0));
      for (uint32_t l = 0; l < L; l++) KV(kvp_append(p, s, l, &(kvp_kv){k, v, S}));
      KV(kvp_step_end(p, s));
    }
    float ta[64], tb[64];
    for (int r = 0; r < rounds; r++) {
      double t0 = now_us();
      for (uint64_t s = 0; s < NS; s++) {
        KV(kvp_step_begin(p, s, 1, 0));
        for (uint32_t l = 0; l < L; l++) KV(kvp_append(p, s, l, &(kvp_kv){k, v, S}));
        KV(kvp_step_end(p, s));
      }
      ta[r] = (float)((now_us() - t0) / (NS * L));
      t0 = now_us();
      for (int i = 0; i < NS * L; i++) {
        CK(cudaMemcpyAsync(scratch, k, bytes, cudaMemcpyDeviceToDevice, S));
        CK(cudaMemcpyAsync((char *)scratch + bytes, v, bytes, cudaMemcpyDeviceToDevice, S));
      }
      CK(cudaStreamSynchronize(S));
      tb[r] = (float)((now_us() - t0) / (NS * L));
    }
    float ma = median(ta, rounds), mb = median(tb, rounds);
    if (!json)
      printf("append (decode step) %-24s %7.2f us per (seq, layer)  copy of its K/V %6.2f us  %6.2fx\n", pool_codecs[c],
             ma, mb, ma / mb);
    printf("{\"figure\":\"gpu_append_host_us\",\"codecs\":\"%s\",\"seqs\":%d,\"layers\":%d,\"kvpool_us\":%.2f,"
           "\"baseline\":\"cudaMemcpyAsync of the K/V\",\"baseline_us\":%.2f,\"ratio\":%.2f}\n",
           pool_codecs[c], NS, L, ma, mb, ma / mb);
    kvp_pool_destroy(p);
  }
  cudaFree(k), cudaFree(v), cudaFree(scratch);
}

/* ---- gpu_store: offload and restore of a CUDA pool through a local redis ---- */

/* A pool of the store bench's shape (llama-3-8b: 32 layers, 32-token blocks). */
static kvp_pool *store_pool_of(const char *spec, kvp_mem mem, uint64_t region) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 32, c.n_kv_heads = 8, c.head_dim = 128;
  c.k_dtype = c.v_dtype = KVP_DTYPE_BF16;
  c.memory = mem, c.region_bytes = region, c.block_tokens = 32, c.codecs = spec;
  kvp_pool *p;
  KV(kvp_pool_create(&c, &p));
  return p;
}

/* Median seconds of an offload and of a restore (the restore's copies
 * waited for: the stream synchronized inside the time), blob bytes of one
 * offload. */
static void store_round_trips(kvp_pool *p, kvp_store *st, int rounds, float *off_s, float *res_s, uint64_t *wire) {
  float to[64], tr[64];
  for (int r = 0; r < rounds; r++) {
    uint64_t s0, s1, r0;
    KV(kvp_store_traffic(st, &s0, &r0));
    double t0 = now_us();
    KV(kvp_seq_offload(p, 1, st));
    double t1 = now_us();
    KV(kvp_seq_restore(p, 1, st));
    CK(cudaStreamSynchronize(S));
    double t2 = now_us();
    KV(kvp_store_traffic(st, &s1, &r0));
    to[r] = (float)((t1 - t0) * 1e-6);
    tr[r] = (float)((t2 - t1) * 1e-6);
    *wire = s1 - s0;
  }
  *off_s = median(to, rounds);
  *res_s = median(tr, rounds);
}

static void store_figures(int rounds, int json) {
  enum { T = 32768, CH = 2048, L = 32, H = 8, D = 128 };
  redis_srv srv;
  if (redis_srv_start(&srv)) {
    printf("store: skipped: %s\n", srv.why);
    return;
  }
  kvp_store *st;
  if (kvp_store_open(srv.url, &st)) {
    printf("store: skipped: %s (a build without hiredis?)\n", kvp_last_error());
    redis_srv_stop(&srv);
    return;
  }
  KV(kvp_store_set_stream(st, S));
  size_t bytes = (size_t)CH * H * D * 2;
  uint16_t *hk = malloc(bytes), *hv = malloc(bytes);
  uint64_t seed = 5;
  for (size_t i = 0; i < bytes / 2; i++) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    hk[i] = (uint16_t)(0x3C00 + (seed >> 56)); /* bf16 in [1, 2) and around */
    hv[i] = (uint16_t)(0xBC00 + (seed >> 48 & 0xFF));
  }
  void *dk, *dv;
  CK(cudaMalloc(&dk, bytes));
  CK(cudaMalloc(&dv, bytes));
  CK(cudaMemcpy(dk, hk, bytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(dv, hv, bytes, cudaMemcpyHostToDevice));
  static const char *const sc[] = {"kv=bf16", "kv=nvfp4"};
  uint64_t region = (uint64_t)T * L * H * D * 4 + (1ull << 30);
  int r = rounds < 3 ? rounds : 3;
  for (unsigned c = 0; c < 2; c++)
    for (int mem = 0; mem < 2; mem++) { /* the host pool of the same shape: the baseline of the same run */
      kvp_pool *p = store_pool_of(sc[c], mem ? KVP_MEM_CUDA : KVP_MEM_HOST, region);
      KV(kvp_seq_add(p, 1, NULL));
      for (uint32_t t = 0; t < T; t += CH) {
        KV(kvp_step_begin(p, 1, CH, 0));
        for (uint32_t l = 0; l < L; l++)
          KV(kvp_append(p, 1, l, mem ? &(kvp_kv){dk, dv, S} : &(kvp_kv){hk, hv, NULL}));
        KV(kvp_step_end(p, 1));
      }
      CK(cudaStreamSynchronize(S));
      float off, res;
      uint64_t wire = 0;
      store_round_trips(p, st, r, &off, &res, &wire);
      kvp_stats s = {.struct_size = sizeof s};
      KV(kvp_stats_get(p, &s));
      const char *where = mem ? "cuda" : "host";
      if (!json)
        printf("store %-10s %s pool: offload %7.1f MB/s %9.0f tokens/s, restore %7.1f MB/s %9.0f tokens/s (%.1f MB on "
               "the wire, %.0f MB pinned)\n", sc[c], where, wire / off / 1e6, T / off, wire / res / 1e6, T / res,
               wire / 1e6, s.host_pinned_bytes / 1e6);
      printf("{\"figure\":\"gpu_store\",\"codecs\":\"%s\",\"pool\":\"%s\",\"tokens\":%d,\"wire_bytes\":%llu,"
             "\"offload_s\":%.4f,\"restore_s\":%.4f,\"offload_mbs\":%.1f,\"restore_mbs\":%.1f,"
             "\"offload_tokens_s\":%.0f,\"restore_tokens_s\":%.0f,\"pinned_bytes\":%llu}\n",
             sc[c], where, T, (unsigned long long)wire, off, res, wire / off / 1e6, wire / res / 1e6, T / off, T / res,
             (unsigned long long)s.host_pinned_bytes);
      KV(kvp_check(p));
      kvp_pool_destroy(p);
    }
  kvp_store_close(st);
  redis_srv_stop(&srv);
  cudaFree(dk), cudaFree(dv);
  free(hk), free(hv);
}

int main(int argc, char **argv) {
  int rounds = 15, json = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--json")) json = 1;
    else {
      fprintf(stderr, "usage: kvpool-bench-gpu [--rounds R] [--json]\n");
      return 2;
    }
  }
  if (rounds < 1 || rounds > 64) rounds = 15;
  setvbuf(stdout, NULL, _IOLBF, 0); /* figures survive a run cut short */
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || !n) {
    printf("kvpool-bench-gpu: skipped: no CUDA device visible\n");
    return 0;
  }
  CK(cudaStreamCreate(&S));
  CK(cudaEventCreate(&E0));
  CK(cudaEventCreate(&E1));
  struct cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  if (!json) printf("kvpool-bench-gpu on %s, %d rounds, medians\n", prop.name, rounds);
  no_gate = getenv("KVP_BENCH_NOGATE") && *getenv("KVP_BENCH_NOGATE") == '1';
  const char *only = getenv("KVP_BENCH_ONLY"); /* codec, qvg, gather, attend, append or store */
  if (!only || strstr(only, "codec")) codec_figures(rounds, json);
  if (!only || strstr(only, "qvg")) qvg_figures(rounds, json);
  if (!only || strstr(only, "gather")) gather_figures(rounds, json);
  if (!only || strstr(only, "attend")) attend_figures(rounds, json);
  if (!only || strstr(only, "append")) append_figures(rounds < 5 ? rounds : 5, json);
  if (!only || strstr(only, "store")) store_figures(rounds, json);
  if (gate_timeouts) { /* a call waited on the device behind the gate: its device times hold 2 s of waiting */
    printf("kvpool-bench-gpu: %d gated calls waited on the device behind the gate; their figures are void\n",
           gate_timeouts);
    return 1;
  }
  return 0;
}
