/*
 * tests/gpu/gpu_pair.h - a host pool and a CUDA pool of one configuration,
 * fed the same K/V, for the suites that check the device against the host
 * (check_gpu_pool, check_gpu_store): open and close, one step appended to
 * both, equal ledgers, equal reads.
 *
 * The including suite defines its geometry first, as integer constants:
 * L layers, H KV heads, D head_dim, and MAXTOK, the most tokens of a step.
 * Include after gpu_test.h.
 */
#ifndef KVP_TESTS_GPU_PAIR_H
#define KVP_TESTS_GPU_PAIR_H

typedef struct gpu_pair {
  kvp_pool *host, *dev;
  cudaStream_t stream;
  uint16_t *hk, *hv; /* host K/V of a step [MAXTOK][H][D] bf16 */
  void *dk, *dv;     /* device copies */
  uint64_t seed;
} gpu_pair;

/* dev_flags: the device pool's kvp_config.flags (the host pool's are 0). */
static inline void gpu_pair_open_flags(gpu_pair *p, const char *spec, uint32_t block_tokens, uint64_t region_bytes,
                                       uint64_t seed, uint32_t dev_flags) {
  memset(p, 0, sizeof *p);
  p->seed = seed;
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.k_dtype = c.v_dtype = KVP_DTYPE_BF16;
  c.region_bytes = region_bytes;
  c.block_tokens = block_tokens;
  c.codecs = spec;
  ck_ok(kvp_pool_create(&c, &p->host));
  c.memory = KVP_MEM_CUDA;
  c.flags = dev_flags;
  ck_ok(kvp_pool_create(&c, &p->dev));
  ck_cuda(cudaStreamCreate(&p->stream));
  size_t bytes = (size_t)MAXTOK * H * D * 2;
  p->hk = malloc(bytes);
  p->hv = malloc(bytes);
  ck_cuda(cudaMalloc(&p->dk, bytes));
  ck_cuda(cudaMalloc(&p->dv, bytes));
}

static inline void gpu_pair_open(gpu_pair *p, const char *spec, uint32_t block_tokens, uint64_t region_bytes,
                                 uint64_t seed) {
  gpu_pair_open_flags(p, spec, block_tokens, region_bytes, seed, 0);
}

/* Both pools pass their checks, then go. */
static inline void gpu_pair_close(gpu_pair *p) {
  ck_ok(kvp_check(p->host));
  ck_ok(kvp_check(p->dev));
  kvp_pool_destroy(p->host);
  kvp_pool_destroy(p->dev);
  cudaStreamDestroy(p->stream);
  free(p->hk);
  free(p->hv);
  cudaFree(p->dk);
  cudaFree(p->dv);
}

static inline kvp_stats gpu_stats_of(kvp_pool *pool) {
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(pool, &s));
  return s;
}

/* Both pools pass their checks and hold the same tokens, pages and
 * requested bytes; allocated bytes differ only by the CUDA region's
 * rounding of every page to 64 B before its class (the device gather
 * addresses pages in 64-byte units; a host class is a multiple of 8 or
 * 16 B below 4 KiB): at most 56 B a page more on the device. Retired
 * blocks are reclaimed first: a row-wise page (kvquant's OUTLIERS) that
 * grows in place in its 64 B slack on the device is replaced on the host,
 * whose old block then waits for a grace period. A page grown in place
 * keeps its class, so the bound still holds: below 4 KiB the device class
 * is the page's first size rounded to 64 B, above it every class is a
 * multiple of 64 B. */
static inline void gpu_pair_same_ledger(gpu_pair *p) {
  ck_ok(kvp_reclaim(p->host));
  ck_ok(kvp_reclaim(p->dev));
  ck_ok(kvp_check(p->host));
  ck_ok(kvp_check(p->dev));
  kvp_stats a = gpu_stats_of(p->host), b = gpu_stats_of(p->dev);
  ck_assert_uint_ge(b.bytes_allocated.current, a.bytes_allocated.current);
  ck_assert_uint_le(b.bytes_allocated.current - a.bytes_allocated.current, 56 * a.pages.current);
  ck_assert_uint_eq(a.bytes_requested.current, b.bytes_requested.current);
  ck_assert_uint_eq(a.tokens_retained.current, b.tokens_retained.current);
  ck_assert_uint_eq(a.pages.current, b.pages.current);
}

/* One step of n tokens appended to seq in both pools (K's first three
 * channels six times wider: outliers to pick). */
static inline void gpu_pair_step(gpu_pair *p, uint64_t seq, uint32_t n) {
  ck_assert_uint_le(n, MAXTOK);
  ck_ok(kvp_step_begin(p->host, seq, n, 0));
  ck_ok(kvp_step_begin(p->dev, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    for (size_t i = 0; i < (size_t)n * H * D; i++) {
      p->hk[i] = gpu_bf16_of(gpu_normal(&p->seed) * (i % D < 3 ? 6.0f : 1.0f));
      p->hv[i] = gpu_bf16_of(gpu_normal(&p->seed));
    }
    size_t bytes = (size_t)n * H * D * 2;
    ck_cuda(cudaMemcpyAsync(p->dk, p->hk, bytes, cudaMemcpyHostToDevice, p->stream));
    ck_cuda(cudaMemcpyAsync(p->dv, p->hv, bytes, cudaMemcpyHostToDevice, p->stream));
    kvp_kv hkv = {p->hk, p->hv, NULL}, dkv = {p->dk, p->dv, p->stream};
    ck_ok(kvp_append(p->host, seq, l, &hkv));
    ck_ok(kvp_append(p->dev, seq, l, &dkv));
  }
  ck_ok(kvp_step_end(p->host, seq));
  ck_ok(kvp_step_end(p->dev, seq));
}

/* Every head of every layer reads the same bytes and positions from the
 * host pool's hseq and the device pool's dseq, in every out dtype (at most
 * cap tokens a head; nonempty: every head must hold some). */
static inline void gpu_pair_same_reads(gpu_pair *p, uint64_t hseq, uint64_t dseq, uint32_t cap, int nonempty) {
  uint32_t *hpos = malloc((size_t)cap * 4), *dpos = malloc((size_t)cap * 4);
  void *dbuf[2];
  ck_cuda(cudaMalloc(&dbuf[0], (size_t)cap * D * 4));
  ck_cuda(cudaMalloc(&dbuf[1], (size_t)cap * D * 4));
  unsigned char *hb[2] = {malloc((size_t)cap * D * 4), malloc((size_t)cap * D * 4)};
  unsigned char *got = malloc((size_t)cap * D * 4);
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++)
      for (int out = 0; out < 3; out++) {
        size_t esz = out == KVP_DTYPE_F32 ? 4 : 2;
        kvp_read_req hq = {sizeof hq, h, (kvp_dtype)out, hb[0], hb[1], hpos, cap, 0, NULL};
        kvp_read_req dq = {sizeof dq, h, (kvp_dtype)out, dbuf[0], dbuf[1], dpos, cap, 0, p->stream};
        ck_ok(kvp_read(p->host, hseq, l, &hq));
        ck_ok(kvp_read(p->dev, dseq, l, &dq));
        if (nonempty) ck_assert_uint_gt(hq.n_tokens, 0);
        ck_assert_uint_eq(hq.n_tokens, dq.n_tokens);
        ck_assert_int_eq(memcmp(hpos, dpos, hq.n_tokens * 4), 0);
        for (int kv = 0; kv < 2; kv++) {
          ck_cuda(cudaMemcpyAsync(got, dbuf[kv], hq.n_tokens * D * esz, cudaMemcpyDeviceToHost, p->stream));
          ck_cuda(cudaStreamSynchronize(p->stream));
          for (size_t i = 0; memcmp(got, hb[kv], hq.n_tokens * D * esz) && i < hq.n_tokens * D * esz; i++)
            ck_assert_msg(got[i] == hb[kv][i], "seq %llu layer %u head %u %c out %d: byte %zu (token %zu) differs: "
                          "device %02x host %02x", (unsigned long long)dseq, l, h, "KV"[kv], out, i,
                          i / (D * esz), got[i], hb[kv][i]);
        }
      }
  cudaFree(dbuf[0]);
  cudaFree(dbuf[1]);
  free(hb[0]);
  free(hb[1]);
  free(got);
  free(hpos);
  free(dpos);
}

#endif /* KVP_TESTS_GPU_PAIR_H */
