/*
 * tests/gpu/check_gpu_sched.c - the scheduler loop on a CUDA region: K and
 * V live in device buffers, appends and reads copy on a CUDA stream, forks
 * copy open blocks device to device, evictions free pages; every read is
 * copied back and checked bit for bit against the model, kvp_check after
 * every call, device-level usage flat while the ledger moves. Public header
 * only; NOFORK; skips without a GPU.
 */
#include "gpu_test.h"
#include "../integration/kvgen.h"
#include "kvpool.h"


enum { L = 4, H = 4, D = 64, MAXT = 2048 };

static kvgen G;
static uint32_t Pos[KVGEN_MAX_SEQS];            /* positions appended */
static uint8_t Ev[64][L][H][512];               /* evicted (seq, layer, head, step) */
static uint32_t StepPos[64][513];               /* first position of each step */
static uint32_t NSteps[64];

static uint16_t *hk, *hv, *dk, *dv;             /* host staging and device K/V */
static cudaStream_t S;

static void step(kvp_pool *p, uint64_t id, uint32_t n) {
  ck_ok(kvp_step_begin(p, id, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    kvgen_fill(&G, id, l, Pos[id], n, H, D, hk, hv);
    size_t bytes = (size_t)n * H * D * 2;
    ck_cuda(cudaMemcpyAsync(dk, hk, bytes, cudaMemcpyHostToDevice, S));
    ck_cuda(cudaMemcpyAsync(dv, hv, bytes, cudaMemcpyHostToDevice, S));
    kvp_kv kv = {dk, dv, S};
    ck_ok(kvp_append(p, id, l, &kv));
    ck_cuda(cudaStreamSynchronize(S)); /* the staging buffers are reused */
  }
  ck_ok(kvp_step_end(p, id));
  ck_ok(kvp_check(p));
  StepPos[id][NSteps[id]] = Pos[id];
  NSteps[id]++;
  Pos[id] += n;
  StepPos[id][NSteps[id]] = Pos[id];
}

static void verify(kvp_pool *p, uint64_t id) {
  static uint16_t ko[MAXT * D], vo[MAXT * D];
  static uint32_t pos[MAXT];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_BF16, dk, dv, pos, MAXT, 0, S};
      ck_ok(kvp_read(p, id, l, &q));
      ck_cuda(cudaMemcpyAsync(ko, dk, (size_t)q.n_tokens * D * 2, cudaMemcpyDeviceToHost, S));
      ck_cuda(cudaMemcpyAsync(vo, dv, (size_t)q.n_tokens * D * 2, cudaMemcpyDeviceToHost, S));
      ck_cuda(cudaStreamSynchronize(S));
      uint32_t i = 0;
      for (uint32_t s = 0; s < NSteps[id]; s++) {
        if (Ev[id][l][h][s]) continue;
        for (uint32_t t = StepPos[id][s]; t < StepPos[id][s + 1]; t++, i++) {
          int bad = i >= q.n_tokens || pos[i] != t;
          for (uint32_t d = 0; d < D && !bad; d++)
            bad = ko[i * D + d] != kvgen_value(&G, id, l, h, t, d, 0) || vo[i * D + d] != kvgen_value(&G, id, l, h, t, d, 1);
          if (bad) ck_abort_msg("seq %llu layer %u head %u row %u (position %u) differs", (unsigned long long)id, l, h, i, t);
        }
      }
      ck_assert_uint_eq(q.n_tokens, i);
    }
}

START_TEST(cuda_scheduler_loop) {
  kvp_config c;
  kvp_config_init(&c);
  c.memory = KVP_MEM_CUDA;
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.region_bytes = 256ull << 20;
  c.block_tokens = 16;
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  kvgen_init(&G);
  ck_cuda(cudaStreamCreate(&S));
  hk = malloc((size_t)MAXT * H * D * 2);
  hv = malloc((size_t)MAXT * H * D * 2);
  ck_cuda(cudaMalloc((void **)&dk, (size_t)MAXT * H * D * 2));
  ck_cuda(cudaMalloc((void **)&dv, (size_t)MAXT * H * D * 2));
  kvp_stats s0 = {.struct_size = sizeof s0}, s1 = {.struct_size = sizeof s1};
  ck_ok(kvp_stats_get(p, &s0));
  uint64_t rng = 12345;
  int nseq = 16;
  for (int id = 0; id < nseq; id++) {
    ck_ok(kvp_seq_add(p, (uint64_t)id, NULL));
    step(p, (uint64_t)id, 100 + (uint32_t)(id * 37 % 200));
  }
  for (int it = 0; it < 40; it++)
    for (int id = 0; id < nseq; id++) {
      step(p, (uint64_t)id, 1);
      rng = rng * 6364136223846793005ull + 1442695040888963407ull;
      if ((rng >> 33) % 7 == 0) {
        uint32_t l = (uint32_t)(rng >> 40) % L, h = (uint32_t)(rng >> 44) % H, s = (uint32_t)(rng >> 48) % NSteps[id];
        if (!Ev[id][l][h][s]) {
          ck_ok(kvp_evict(p, (uint64_t)id, l, h, s));
          Ev[id][l][h][s] = 1;
          ck_ok(kvp_check(p));
        }
      }
    }
  /* parallel sampling: fork two sequences, diverge, verify all */
  for (int i = 0; i < 2; i++) {
    uint64_t parent = (uint64_t)i, child = (uint64_t)(nseq + i);
    ck_ok(kvp_seq_fork(p, parent, child));
    kvgen_fork(&G, parent, child, Pos[parent]);
    Pos[child] = Pos[parent];
    NSteps[child] = NSteps[parent];
    memcpy(StepPos[child], StepPos[parent], sizeof StepPos[parent]);
    memcpy(Ev[child], Ev[parent], sizeof Ev[parent]);
    ck_ok(kvp_check(p));
    step(p, child, 9);
  }
  for (int id = 0; id < nseq + 2; id++) verify(p, (uint64_t)id);
  /* a view hands out device page addresses */
  kvp_view *v;
  ck_ok(kvp_view_acquire(p, 3, 2, &v));
  ck_assert_uint_gt(v->n_blocks, 0);
  const kvp_view_block *b = &v->blocks[0];
  uint16_t row[D];
  ck_cuda(cudaMemcpy(row, (const uint16_t *)b->page[0][KVP_PAGE_RAW] + (size_t)b->first * D, D * 2,
                     cudaMemcpyDeviceToHost));
  ck_assert_uint_eq(row[5], kvgen_value(&G, 3, 2, b->head, b->block_pos0 + b->first, 5, 0));
  kvp_view_release(p, v);
  ck_ok(kvp_stats_get(p, &s1));
  uint64_t dev = s1.device_used_bytes > s0.device_used_bytes ? s1.device_used_bytes - s0.device_used_bytes
                                                              : s0.device_used_bytes - s1.device_used_bytes;
  printf("cuda scheduler: %llu tokens retained, %llu evicted; ledger %llu bytes allocated (peak %llu); "
         "device-level used moved by %llu bytes (staging buffers included)\n",
         (unsigned long long)s1.tokens_retained.current, (unsigned long long)s1.tokens_evicted,
         (unsigned long long)s1.bytes_allocated.current, (unsigned long long)s1.bytes_allocated.peak,
         (unsigned long long)dev);
  ck_assert_uint_gt(s1.bytes_allocated.current, 4ull << 20);
  ck_assert_uint_lt(dev, 8ull << 20); /* the region was reserved at create */
  for (int id = 0; id < nseq + 2; id++) {
    ck_ok(kvp_seq_free(p, (uint64_t)id));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_stats_get(p, &s1));
  ck_assert_uint_eq(s1.bytes_allocated.current, 0);
  cudaFree(dk);
  cudaFree(dv);
  free(hk);
  free(hv);
  cudaStreamDestroy(S);
  kvp_pool_destroy(p);
}
END_TEST

int main(void) {
  if (!gpu_present("check_gpu_sched")) return 0;
  Suite *s = suite_create("gpu_sched");
  TCase *tc = tcase_create("cuda");
  tcase_set_timeout(tc, 300);
  tcase_add_test(tc, cuda_scheduler_loop);
  suite_add_tcase(s, tc);
  return gpu_run(s, CK_VERBOSE);
}
