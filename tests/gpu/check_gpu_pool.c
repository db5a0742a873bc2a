/*
 * tests/gpu/check_gpu_pool.c - device codecs through a pool on a CUDA
 * region, against a host pool of the same configuration fed the same K/V:
 *
 *   append (stream and step mode, prefill, decode tokens, chunks; K/V in
 *   device memory on a stream), read in every out dtype (device buffers),
 *   views (device page addresses), evict, fork: after every call both pools
 *   pass kvp_check, hold the same ledger, and read the same bytes;
 *   a NaN or Inf in device input fails the append naming layer, head and
 *   token, and leaves the pool as before;
 *   kvp_gather gives, per (seq, layer) and head, the rows kvp_read gives,
 *   with their positions, zeros where a head holds fewer tokens.
 * KVQuant's row-wise layers among the specs: their OPEN blocks grow on the
 * device as on the host (the same grows and moves in the ledger); what a
 * CUDA region refuses of it, and its tables in device.control_bytes. QVG
 * among them too: its device k-means gives the host's pages, warm starts
 * included.
 *
 * Public headers only. NOFORK; skips with a message without a GPU.
 */
#include "gpu_test.h"
#include "kvpool_codec.h"

enum { L = 3, H = 4, D = 128, MAXTOK = 512 };

#include "gpu_pair.h"

static const char *const specs[] = {
    "kv=bf16",
    "kv=fp8",
    "k=fp8:scale=0.05,v=int8:pct=99.5",
    "kv=int8",
    "kv=kivi:bits=2:group=16",
    "k=kivi:bits=4:group=16,v=kivi:bits=2:group=32",
    "kv=nvfp4",
    "k=nvfp4:rule=4/6:ksmooth=store,v=nvfp4:rule=4/6",
    "k=nvfp4:ksmooth=store,v=kivi;layers=1-1:k=fp8,v=int8;layers=2-2:kv=fp32",
    /* kvquant: row-wise layers (OPEN blocks encoded as tokens come, their
     * OUTLIERS page growing in place or moving), pre-RoPE keys and sinks,
     * no outliers, and a layer that keeps RAW tails (V not row-wise) */
    "kv=kvquant",
    "k=kvquant:bits=2:prerope=1:sink=4,v=kvquant:bits=4:outliers=0.05",
    "kv=kvquant:outliers=0:sink=0",
    "k=kvquant:bits=4:outliers=0.1,v=bf16;layers=2-2:kv=kvquant:bits=2",
    /* qvg: k-means on the device, each stream's warm start carried from
     * block to block (host state staged around each encode): the pages
     * and reads equal the host pool's bit for bit */
    "kv=qvg:k=4",
    "k=qvg-pro:k=4:iters=4,v=qvg:bits=4:k=8;layers=1-1:kv=fp8",
};
#define NSPECS (sizeof specs / sizeof specs[0])

typedef gpu_pair pair;

static float rnd(pair *p) { return gpu_normal(&p->seed); }

/* Block size for the one-size tests: qvg-pro's four stages of k = 4 bf16
 * centroids only compress from 20 tokens on (a pool refuses expansion). */
static uint32_t bt_for(const char *spec) { return strstr(spec, "qvg") ? 32 : 16; }

static void pair_open(pair *p, const char *spec, uint32_t block_tokens) {
  gpu_pair_open(p, spec, block_tokens, 64ull << 20, 7);
}

/* Both pools hold the same ledger, row-wise OPEN blocks grown alike: the
 * same pages grew, and a device page, never in a smaller class than its
 * host twin (64 B rounding first), moved at most as often. */
static void same_ledger(pair *p) {
  gpu_pair_same_ledger(p);
  kvp_stats a = gpu_stats_of(p->host), b = gpu_stats_of(p->dev);
  ck_assert_uint_eq(a.grows, b.grows);
  ck_assert_uint_le(b.grow_moves, a.grow_moves);
  ck_assert_uint_le(a.grow_moves, a.grows);
}

/* One step of n tokens appended to seq in both pools, then their ledgers. */
static void step(pair *p, uint64_t seq, uint32_t n) {
  gpu_pair_step(p, seq, n);
  same_ledger(p);
}

/* Every head of every layer of seq reads the same bytes from both pools. */
static void same_reads(pair *p, uint64_t seq) { gpu_pair_same_reads(p, seq, seq, 2048, 0); }

START_TEST(pool_matches_host) {
  if (gpu_spec_off(specs[_i])) return;
  pair p;
  pair_open(&p, specs[_i], 32);
  /* stream mode: a prefill across blocks, decode tokens that fill and seal blocks, a chunk */
  ck_ok(kvp_seq_add(p.host, 1, NULL));
  ck_ok(kvp_seq_add(p.dev, 1, NULL));
  step(&p, 1, 77);
  for (int t = 0; t < 40; t++) step(&p, 1, 1);
  step(&p, 1, 45);
  same_reads(&p, 1);
  /* step mode */
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  ck_ok(kvp_seq_add(p.host, 2, &sc));
  ck_ok(kvp_seq_add(p.dev, 2, &sc));
  step(&p, 2, 16);
  step(&p, 2, 100);
  step(&p, 2, 1);
  same_reads(&p, 2);
  /* evict a unit of each mode */
  ck_ok(kvp_evict(p.host, 2, 1, 2, 1));
  ck_ok(kvp_evict(p.dev, 2, 1, 2, 1));
  ck_ok(kvp_evict(p.host, 1, 0, 1, 0));
  ck_ok(kvp_evict(p.dev, 1, 0, 1, 0));
  same_ledger(&p);
  same_reads(&p, 1);
  same_reads(&p, 2);
  /* fork: the OPEN block is copied on the device */
  ck_ok(kvp_seq_fork(p.host, 1, 3));
  ck_ok(kvp_seq_fork(p.dev, 1, 3));
  same_ledger(&p);
  step(&p, 3, 5);
  step(&p, 1, 3);
  same_reads(&p, 3);
  same_reads(&p, 1);
  /* views: device addresses of the pages */
  kvp_view *v;
  ck_ok(kvp_view_acquire(p.dev, 1, 2, &v));
  ck_assert_uint_gt(v->n_blocks, 0);
  for (uint32_t i = 0; i < v->n_blocks; i++)
    for (int kv = 0; kv < 2; kv++)
      for (int t = 0; t < KVP_PAGE_TYPE_COUNT; t++)
        if (v->blocks[i].page[kv][t]) {
          struct cudaPointerAttributes a;
          ck_cuda(cudaPointerGetAttributes(&a, v->blocks[i].page[kv][t]));
          ck_assert_int_eq(a.type, cudaMemoryTypeDevice);
        }
  kvp_view_release(p.dev, v);
  ck_ok(kvp_seq_free(p.host, 2));
  ck_ok(kvp_seq_free(p.dev, 2));
  same_ledger(&p);
  if (!strcmp(specs[_i], "kv=kvquant")) { /* OUTLIERS pages grew in place and moved to larger classes */
    kvp_stats b = {.struct_size = sizeof b};
    ck_ok(kvp_stats_get(p.dev, &b));
    ck_assert_msg(b.grows > b.grow_moves && b.grow_moves > 0, "grows %llu, moves %llu",
                  (unsigned long long)b.grows, (unsigned long long)b.grow_moves);
  }
  printf("%-70s device pool == host pool (append, read x3 dtypes, evict, fork, view)\n", specs[_i]);
  fflush(stdout);
  gpu_pair_close(&p);
}
END_TEST

/* A NaN or Inf in device input: KVP_EINVAL naming layer, head, token; nothing changed. */
START_TEST(nonfinite_append_refused) {
  if (gpu_spec_off(specs[_i])) return;
  pair p;
  pair_open(&p, specs[_i], bt_for(specs[_i]));
  ck_ok(kvp_seq_add(p.dev, 1, NULL));
  ck_ok(kvp_seq_add(p.host, 1, NULL));
  kvp_stats before = {.struct_size = sizeof before}, after = {.struct_size = sizeof after};
  int rc;
  uint32_t n = 40;
  for (size_t i = 0; i < (size_t)n * H * D; i++) p.hk[i] = p.hv[i] = gpu_bf16_of(rnd(&p));
  const uint32_t bad_tok = 33, bad_head = 2, bad_ch = 9;
  p.hv[((size_t)bad_tok * H + bad_head) * D + bad_ch] = _i % 2 ? 0x7F80 /* +Inf */ : 0xFFC1 /* NaN */;
  ck_cuda(cudaMemcpy(p.dk, p.hk, (size_t)n * H * D * 2, cudaMemcpyHostToDevice));
  ck_cuda(cudaMemcpy(p.dv, p.hv, (size_t)n * H * D * 2, cudaMemcpyHostToDevice));
  kvp_kv dkv = {p.dk, p.dv, p.stream};
  kvp_pool_destroy(p.dev);
  p.dev = NULL;
  /* fresh pool: the first layer with the bad value fails, names it, changes nothing */
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.k_dtype = c.v_dtype = KVP_DTYPE_BF16;
  c.region_bytes = 64ull << 20, c.block_tokens = bt_for(specs[_i]), c.codecs = specs[_i], c.memory = KVP_MEM_CUDA;
  ck_ok(kvp_pool_create(&c, &p.dev));
  ck_ok(kvp_seq_add(p.dev, 1, NULL));
  ck_ok(kvp_step_begin(p.dev, 1, 7, 0));
  for (uint32_t l = 0; l < L; l++) ck_ok(kvp_append(p.dev, 1, l, &(kvp_kv){p.dk, p.dk, p.stream}));
  ck_ok(kvp_step_end(p.dev, 1));
  ck_ok(kvp_stats_get(p.dev, &before));
  ck_ok(kvp_step_begin(p.dev, 1, n, 0));
  rc = kvp_append(p.dev, 1, 0, &dkv);
  ck_assert_int_eq(rc, KVP_EINVAL);
  char want[64];
  snprintf(want, sizeof want, "head %u, token %u", bad_head, bad_tok);
  ck_assert_msg(strstr(kvp_last_error(), want) && strstr(kvp_last_error(), "V of layer 0"), "message: %s",
                kvp_last_error());
  ck_ok(kvp_check(p.dev));
  ck_ok(kvp_stats_get(p.dev, &after));
  ck_assert_uint_eq(before.bytes_allocated.current, after.bytes_allocated.current);
  ck_assert_uint_eq(before.tokens_retained.current, after.tokens_retained.current);
  ck_assert_uint_eq(before.pages.current, after.pages.current);
  /* the same layer appended again with clean input succeeds */
  p.hv[((size_t)bad_tok * H + bad_head) * D + bad_ch] = 0;
  ck_cuda(cudaMemcpy(p.dv, p.hv, (size_t)n * H * D * 2, cudaMemcpyHostToDevice));
  for (uint32_t l = 0; l < L; l++) ck_ok(kvp_append(p.dev, 1, l, &dkv));
  ck_ok(kvp_step_end(p.dev, 1));
  ck_ok(kvp_check(p.dev));
  kvp_pool_destroy(p.host);
  p.host = NULL;
  kvp_pool_destroy(p.dev);
  p.dev = NULL;
  cudaStreamDestroy(p.stream);
  free(p.hk), free(p.hv), cudaFree(p.dk), cudaFree(p.dv);
}
END_TEST

/* KVP_POOL_DEVICE_ASYNC: appends that return before their stream ran
 * leave the same pages as a host pool (raw, fp8, int8, nvfp4 layers skip
 * the wait; a kivi layer beside them and kvquant still take it). A NaN goes
 * into a raw or fp8 layer of such a pool unrefused; a kivi layer's append
 * still reads its status back and refuses it, changing nothing. */
static const char *const async_specs[] = {"kv=bf16", "kv=fp8", "kv=int8", "kv=nvfp4",
                                          "k=kivi:bits=2:group=16,v=fp8", "kv=kvquant"};
#define NASYNC (sizeof async_specs / sizeof async_specs[0])

START_TEST(async_appends_match_host) {
  const char *spec = async_specs[_i];
  if (gpu_spec_off(spec)) return;
  pair p;
  gpu_pair_open_flags(&p, spec, 16, 64ull << 20, 11, KVP_POOL_DEVICE_ASYNC);
  ck_ok(kvp_seq_add(p.host, 1, NULL));
  ck_ok(kvp_seq_add(p.dev, 1, NULL));
  step(&p, 1, 77);
  for (int t = 0; t < 40; t++) step(&p, 1, 1); /* decode tokens: fill, seal, encode */
  step(&p, 1, 45);
  same_reads(&p, 1);
  ck_ok(kvp_seq_fork(p.host, 1, 2));
  ck_ok(kvp_seq_fork(p.dev, 1, 2));
  step(&p, 2, 3);
  same_reads(&p, 2);
  /* a NaN in V of layer 0: taken where the layer's appends do not wait */
  int waits = strstr(spec, "kivi") || strstr(spec, "kvquant");
  uint32_t n = 2;
  for (size_t i = 0; i < (size_t)n * H * D; i++) p.hk[i] = p.hv[i] = gpu_bf16_of(rnd(&p));
  p.hk[(size_t)1 * H * D + 5] = 0xFFC1; /* K of token 1, head 0, channel 5 */
  ck_cuda(cudaMemcpy(p.dk, p.hk, (size_t)n * H * D * 2, cudaMemcpyHostToDevice));
  ck_cuda(cudaMemcpy(p.dv, p.hv, (size_t)n * H * D * 2, cudaMemcpyHostToDevice));
  kvp_stats before = gpu_stats_of(p.dev);
  ck_ok(kvp_step_begin(p.dev, 1, n, 0));
  int rc = kvp_append(p.dev, 1, 0, &(kvp_kv){p.dk, p.dv, p.stream});
  if (waits) {
    ck_assert_int_eq(rc, KVP_EINVAL);
    ck_assert_msg(strstr(kvp_last_error(), "K of layer 0"), "message: %s", kvp_last_error());
    kvp_stats after = gpu_stats_of(p.dev);
    ck_assert_uint_eq(before.bytes_allocated.current, after.bytes_allocated.current);
    ck_assert_uint_eq(before.tokens_retained.current, after.tokens_retained.current);
  } else {
    ck_ok(rc);
    for (uint32_t l = 1; l < L; l++) ck_ok(kvp_append(p.dev, 1, l, &(kvp_kv){p.dk, p.dv, p.stream}));
    ck_ok(kvp_step_end(p.dev, 1));
    if (!strcmp(spec, "kv=bf16")) { /* raw pages keep the NaN as given */
      uint16_t *k = malloc((size_t)4096 * D * 2), *dk;
      uint32_t *pos = malloc(4096 * 4);
      ck_cuda(cudaMalloc((void **)&dk, (size_t)4096 * D * 2));
      kvp_read_req r = {.struct_size = sizeof r, .head = 0, .out_dtype = KVP_DTYPE_BF16, .k_out = dk,
                        .positions_out = pos, .capacity_tokens = 4096, .stream = p.stream};
      ck_ok(kvp_read(p.dev, 1, 0, &r));
      ck_cuda(cudaStreamSynchronize(p.stream));
      ck_cuda(cudaMemcpy(k, dk, (size_t)r.n_tokens * D * 2, cudaMemcpyDeviceToHost));
      ck_assert_uint_eq(pos[r.n_tokens - 1], 77 + 40 + 45 + 1);
      ck_assert_uint_eq(k[(size_t)(r.n_tokens - 1) * D + 5], 0xFFC1);
      free(k), free(pos), cudaFree(dk);
    }
  }
  ck_ok(kvp_check(p.dev));
  kvp_pool_destroy(p.host);
  p.host = NULL;
  kvp_pool_destroy(p.dev);
  p.dev = NULL;
  cudaStreamDestroy(p.stream);
  free(p.hk), free(p.hv), cudaFree(p.dk), cudaFree(p.dv);
}
END_TEST

/* kvp_gather == kvp_read (bf16) per item and head, positions, zero padding. */
START_TEST(gather_matches_read) {
  if (gpu_spec_off(specs[_i])) return;
  pair p;
  pair_open(&p, specs[_i], bt_for(specs[_i]));
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  ck_ok(kvp_seq_add(p.dev, 1, NULL));
  ck_ok(kvp_seq_add(p.host, 1, NULL));
  ck_ok(kvp_seq_add(p.dev, 2, &sc));
  ck_ok(kvp_seq_add(p.host, 2, &sc));
  step(&p, 1, 100);
  for (int t = 0; t < 9; t++) step(&p, 1, 1);
  step(&p, 2, 400); /* 25 blocks x 4 heads: the append stages its jobs in a device table */
  step(&p, 2, 17);
  ck_ok(kvp_evict(p.dev, 2, 1, 3, 0)); /* head 3 of layer 1 holds 17 tokens, the others 65 */
  ck_ok(kvp_evict(p.host, 2, 1, 3, 0));
  kvp_gather_item items[] = {{.seq = 1, .layer = 0}, {.seq = 2, .layer = 1}, {.seq = 1, .layer = 2},
                             {.seq = 2, .layer = 0}};
  enum { NI = 4, CAPR = 2048 };
  kvp_gather_req g;
  kvp_gather_req_init(&g);
  g.items = items;
  g.n_items = NI;
  ck_cuda(cudaMalloc(&g.k_out, (size_t)CAPR * H * D * 2));
  ck_cuda(cudaMalloc(&g.v_out, (size_t)CAPR * H * D * 2));
  ck_cuda(cudaMemset(g.k_out, 0x7F, (size_t)CAPR * H * D * 2));
  ck_cuda(cudaMemset(g.v_out, 0x7F, (size_t)CAPR * H * D * 2));
  g.positions_out = malloc((size_t)CAPR * H * 4);
  g.capacity_rows = CAPR;
  g.stream = p.stream;
  ck_assert_int_eq(kvp_gather(p.dev, &g), KVP_ENOSPC); /* no workspace yet: it says how much */
  ck_assert_uint_gt(g.workspace_needed, 0);
  ck_cuda(cudaMalloc(&g.workspace, g.workspace_needed));
  g.workspace_bytes = g.workspace_needed;
  ck_ok(kvp_gather(p.dev, &g));
  if (!strstr(specs[_i], "kvquant") && !strstr(specs[_i], "qvg"))
    ck_assert_uint_eq(g.n_launches, 1); /* every layer in one launch */
  else ck_assert_uint_ge(g.n_launches, 1); /* kvquant and qvg have no in-kernel reader: their own decode_dev */
  ck_assert_uint_eq(g.n_rows, 109 + 417 + 109 + 417); /* seq 1: 100 + 9 tokens; seq 2: 400 + 17 */
  size_t rowb = (size_t)H * D * 2;
  unsigned char *gk = malloc(g.n_rows * rowb), *gv = malloc(g.n_rows * rowb);
  ck_cuda(cudaMemcpyAsync(gk, g.k_out, g.n_rows * rowb, cudaMemcpyDeviceToHost, p.stream));
  ck_cuda(cudaMemcpyAsync(gv, g.v_out, g.n_rows * rowb, cudaMemcpyDeviceToHost, p.stream));
  ck_cuda(cudaStreamSynchronize(p.stream));
  uint16_t *rk = malloc(CAPR * D * 2), *rv = malloc(CAPR * D * 2);
  uint32_t *pos = malloc(CAPR * 4);
  for (int i = 0; i < NI; i++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_BF16, rk, rv, pos, CAPR, 0, NULL};
      ck_ok(kvp_read(p.host, items[i].seq, items[i].layer, &q));
      for (uint32_t r = 0; r < items[i].n_rows; r++) {
        size_t off = (items[i].row0 + r) * rowb + (size_t)h * D * 2;
        uint32_t gp = g.positions_out[(size_t)(items[i].row0 + r) * H + h];
        if (r < q.n_tokens) {
          ck_assert_uint_eq(gp, pos[r]);
          ck_assert_msg(!memcmp(gk + off, rk + (size_t)r * D, D * 2) && !memcmp(gv + off, rv + (size_t)r * D, D * 2),
                        "item %d head %u row %u differs from kvp_read", i, h, r);
        } else {
          ck_assert_uint_eq(gp, UINT32_MAX);
          int nz = 0;
          for (uint32_t k = 0; k < D * 2; k++) nz |= gk[off + k] | gv[off + k];
          ck_assert_msg(!nz, "item %d head %u row %u: padding is not zero", i, h, r);
        }
      }
    }
  printf("%-70s gather == read (%u rows, %u launches, %llu B table)\n", specs[_i], g.n_rows, g.n_launches,
         (unsigned long long)g.workspace_needed);
  free(gk), free(gv), free(rk), free(rv), free(pos), free(g.positions_out);
  cudaFree(g.k_out), cudaFree(g.v_out), cudaFree(g.workspace);
  gpu_pair_close(&p);
}
END_TEST

/* A third-party codec with device ops: bf16 rows stored as they come (its
 * device ops are 2-D copies, one per job). A CUDA pool takes it; the
 * gather decodes it through its own decode_dev. */
typedef struct { uint32_t d; } cp_inst;
static int cp_create(const char *params, const kvp_codec_geom *g, void **inst, char *err, size_t errcap, size_t *at) {
  (void)params, (void)err, (void)errcap, (void)at;
  if (g->in_dtype != KVP_DTYPE_BF16) return KVP_EINVAL;
  cp_inst *c = malloc(sizeof *c);
  c->d = g->head_dim;
  *inst = c;
  return KVP_OK;
}
static void cp_destroy(void *inst) { free(inst); }
static uint32_t cp_group(const void *inst) { (void)inst; return 1; }
static void cp_layout(const void *inst, uint32_t cap, kvp_codec_layout *out) {
  memset(out, 0, sizeof *out);
  out->npages = 1, out->types[0] = KVP_PAGE_CODES, out->bytes[0] = (uint64_t)cap * ((const cp_inst *)inst)->d * 2;
}
static int cp_encode(const void *inst, const void *src, size_t stride, uint32_t n, uint32_t cap, void *const *pages) {
  size_t row = (size_t)((const cp_inst *)inst)->d * 2;
  for (uint32_t t = 0; t < cap; t++)
    if (t < n) memcpy((char *)pages[0] + t * row, (const char *)src + t * stride, row);
    else memset((char *)pages[0] + t * row, 0, row);
  return KVP_OK;
}
static int cp_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap, uint32_t t0, uint32_t m,
                     void *dst, size_t stride, kvp_dtype out) {
  (void)n, (void)cap;
  if (out != KVP_DTYPE_BF16) return KVP_ENOTSUP;
  size_t row = (size_t)((const cp_inst *)inst)->d * 2;
  for (uint32_t r = 0; r < m; r++) memcpy((char *)dst + r * stride, (const char *)pages[0] + (t0 + r) * row, row);
  return KVP_OK;
}
static int cp_encode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                         uint32_t n, uint64_t *status, void *stream) {
  (void)jobs_dev, (void)status;
  size_t row = (size_t)((const cp_inst *)inst)->d * 2;
  for (uint32_t i = 0; i < n; i++) {
    const kvp_codec_dev_job *j = &jobs[i];
    if (cudaMemcpy2DAsync((char *)j->pages[0] + j->t0 * row, row, j->src, j->stride_bytes, row, j->m,
                          cudaMemcpyDeviceToDevice, (cudaStream_t)stream) != cudaSuccess ||
        cudaMemsetAsync((char *)j->pages[0] + (j->t0 + j->m) * row, 0, (j->cap_tokens - j->t0 - j->m) * row,
                        (cudaStream_t)stream) != cudaSuccess)
      return KVP_EDEVICE;
  }
  return KVP_OK;
}
static int cp_decode_dev(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev,
                         uint32_t n, kvp_dtype out, void *stream) {
  (void)jobs_dev;
  if (out != KVP_DTYPE_BF16) return KVP_ENOTSUP;
  size_t row = (size_t)((const cp_inst *)inst)->d * 2;
  for (uint32_t i = 0; i < n; i++) {
    const kvp_codec_dev_job *j = &jobs[i];
    if (cudaMemcpy2DAsync(j->dst, j->stride_bytes, (const char *)j->pages[0] + j->t0 * row, row, row, j->m,
                          cudaMemcpyDeviceToDevice, (cudaStream_t)stream) != cudaSuccess)
      return KVP_EDEVICE;
  }
  return KVP_OK;
}
static const kvp_codec_vtable cp_vt = {.abi_version = KVP_CODEC_ABI_VERSION, .name = "test-bf16copy",
                                       .create = cp_create, .destroy = cp_destroy, .group_tokens = cp_group,
                                       .layout = cp_layout, .encode = cp_encode, .decode = cp_decode,
                                       .encode_dev = cp_encode_dev, .decode_dev = cp_decode_dev};

START_TEST(third_party_device_codec) {
  uint32_t id;
  if (kvp_codec_find("test-bf16copy", &id) != KVP_OK) ck_ok(kvp_codec_register(&cp_vt, &id));
  pair p;
  pair_open(&p, "k=test-bf16copy,v=fp8", 16);
  ck_ok(kvp_seq_add(p.host, 1, NULL));
  ck_ok(kvp_seq_add(p.dev, 1, NULL));
  step(&p, 1, 70);
  step(&p, 1, 1);
  kvp_gather_item it = {.seq = 1, .layer = 1};
  kvp_gather_req g;
  kvp_gather_req_init(&g);
  g.items = &it, g.n_items = 1, g.capacity_rows = 128, g.stream = p.stream;
  ck_cuda(cudaMalloc(&g.k_out, 128 * H * D * 2));
  ck_cuda(cudaMalloc(&g.v_out, 128 * H * D * 2));
  ck_assert_int_eq(kvp_gather(p.dev, &g), KVP_ENOSPC);
  ck_cuda(cudaMalloc(&g.workspace, g.workspace_needed));
  g.workspace_bytes = g.workspace_needed;
  ck_ok(kvp_gather(p.dev, &g));
  ck_assert_uint_eq(g.n_rows, 71);
  ck_assert_uint_gt(g.n_launches, 1); /* its own decode_dev beside the built-in's */
  uint16_t *gk = malloc(71 * H * D * 2), *gv = malloc(71 * H * D * 2), *rk = malloc(128 * D * 2), *rv = malloc(128 * D * 2);
  ck_cuda(cudaMemcpy(gk, g.k_out, 71 * H * D * 2, cudaMemcpyDeviceToHost));
  ck_cuda(cudaMemcpy(gv, g.v_out, 71 * H * D * 2, cudaMemcpyDeviceToHost));
  for (uint32_t h = 0; h < H; h++) {
    kvp_read_req hq = {sizeof hq, h, KVP_DTYPE_BF16, rk, rv, NULL, 128, 0, NULL};
    ck_ok(kvp_read(p.host, 1, 1, &hq));
    ck_assert_uint_eq(hq.n_tokens, 71);
    for (uint32_t r = 0; r < 71; r++)
      ck_assert_msg(!memcmp(gk + ((size_t)r * H + h) * D, rk + (size_t)r * D, D * 2) &&
                    !memcmp(gv + ((size_t)r * H + h) * D, rv + (size_t)r * D, D * 2), "head %u row %u", h, r);
  }
  free(gk), free(gv), free(rk), free(rv);
  cudaFree(g.k_out), cudaFree(g.v_out), cudaFree(g.workspace);
  gpu_pair_close(&p);
}
END_TEST

/* Codecs without device ops are refused by name on a CUDA region (the
 * test codec without its device ops: every built-in has them). */
static const kvp_codec_vtable cp_host_vt = {.abi_version = KVP_CODEC_ABI_VERSION, .name = "test-bf16copy-host",
                                            .create = cp_create, .destroy = cp_destroy, .group_tokens = cp_group,
                                            .layout = cp_layout, .encode = cp_encode, .decode = cp_decode};
START_TEST(host_only_codec_refused) {
  uint32_t id;
  if (kvp_codec_find("test-bf16copy-host", &id) != KVP_OK) ck_ok(kvp_codec_register(&cp_host_vt, &id));
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 2, c.n_kv_heads = 2, c.head_dim = 64, c.region_bytes = 16ull << 20, c.memory = KVP_MEM_CUDA;
  c.codecs = "k=fp8,v=test-bf16copy-host";
  kvp_pool *p = NULL;
  ck_assert_int_eq(kvp_pool_create(&c, &p), KVP_ENOTSUP);
  ck_assert_msg(strstr(kvp_last_error(), "test-bf16copy-host"), "%s", kvp_last_error());
  c.codecs = "kv=qvg:k=4"; /* qvg: head_dim past its kernels' 256 channels, by name */
  c.head_dim = 512;
  ck_assert_int_eq(kvp_pool_create(&c, &p), KVP_ENOTSUP);
  ck_assert_msg(strstr(kvp_last_error(), "head_dim 512"), "%s", kvp_last_error());
  c.head_dim = 64;
  c.codecs = "kv=fp8";
  c.flags = KVP_POOL_SANITIZE;
  ck_assert_int_eq(kvp_pool_create(&c, &p), KVP_ENOTSUP);
}
END_TEST

/* KVQuant on a CUDA region: what it refuses by name (threshold outliers,
 * sized from rows the host cannot read; pre-RoPE keys beside a codec that
 * keeps RAW tails), which a host region takes; and its calibration tables
 * on the device, counted in device.control_bytes to the byte. */
START_TEST(kvquant_cuda_config) {
  if (gpu_spec_off("kvquant")) return;
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.region_bytes = 32ull << 20, c.block_tokens = 16;
  c.k_dtype = c.v_dtype = KVP_DTYPE_BF16;
  static const char *const refused[][2] = {{"kv=kvquant:outlier_mode=threshold", "device"},
                                           {"k=kvquant:prerope=1,v=bf16", "pre-RoPE"}};
  kvp_pool *p = NULL;
  for (int i = 0; i < 2; i++) {
    c.codecs = refused[i][0];
    c.memory = KVP_MEM_CUDA;
    c.flags = KVP_POOL_ALLOW_EXPANSION;
    ck_assert_int_eq(kvp_pool_create(&c, &p), KVP_ENOTSUP);
    ck_assert_ptr_null(p);
    ck_assert_msg(strstr(kvp_last_error(), "kvquant") && strstr(kvp_last_error(), refused[i][1]), "%s: %s",
                  refused[i][0], kvp_last_error());
    c.memory = KVP_MEM_HOST;
    ck_ok(kvp_pool_create(&c, &p));
    kvp_pool_destroy(p);
    p = NULL;
  }
  c.memory = KVP_MEM_CUDA;
  c.flags = 0;
  uint64_t ctl[3];
  const char *cfg[3] = {"kv=bf16", "kv=kvquant", "k=kvquant:prerope=1:rope_dims=64,v=kvquant"};
  for (int i = 0; i < 3; i++) {
    c.codecs = cfg[i];
    ck_ok(kvp_pool_create(&c, &p));
    kvp_stats s = {.struct_size = sizeof s};
    ck_ok(kvp_stats_get(p, &s));
    ctl[i] = s.device_control_bytes;
    kvp_pool_destroy(p);
  }
  /* per binding: lut and midpoints (2 x 16 f32), off, rng, 1/rng ([H][D] f32 each); + 32 f64 frequencies with RoPE */
  uint64_t per = 4 * (32 + 3 * (uint64_t)H * D);
  ck_assert_uint_eq(ctl[1] - ctl[0], 2 * L * per);
  ck_assert_uint_eq(ctl[2] - ctl[0], 2 * L * per + L * 32 * 8);
  printf("kvquant device tables: %llu bytes for %u layers (device.control_bytes %llu)\n",
         (unsigned long long)(ctl[1] - ctl[0]), L, (unsigned long long)ctl[1]);
}
END_TEST

int main(void) {
  if (!gpu_present("check_gpu_pool")) return 0;
  Suite *s = suite_create("gpu_pool");
  TCase *tc = tcase_create("pool");
  tcase_set_timeout(tc, 600);
  tcase_add_loop_test(tc, pool_matches_host, 0, NSPECS);
  tcase_add_loop_test(tc, nonfinite_append_refused, 0, NSPECS);
  tcase_add_loop_test(tc, async_appends_match_host, 0, NASYNC);
  tcase_add_loop_test(tc, gather_matches_read, 0, NSPECS);
  tcase_add_test(tc, host_only_codec_refused);
  tcase_add_test(tc, third_party_device_codec);
  tcase_add_test(tc, kvquant_cuda_config);
  suite_add_tcase(s, tc);
  return gpu_run(s, CK_NORMAL);
}
