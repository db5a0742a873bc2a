/*
 * tests/gpu/check_gpu_attend.c - kvp_attend_decode against an fp32
 * reference attention computed (in double) over kvp_read's f32 output of the
 * same pool: the same tokens per KV head, the host decode's values.
 *
 *   every built-in codec, mixed K/V codecs, sealed and OPEN blocks (prefill
 *   then decode tokens in stream mode), per-head evictions (ragged heads, a
 *   head with no token left: zeros), GQA 1/4/8, D = 64/128/256, lengths 1,
 *   a block edge (16), 17, and batches mixing them; forced small splits
 *   (the merge kernel, a head's splits outnumbering its threads) and the
 *   automatic split; bf16 and f32 output;
 *   128K tokens of one sequence; refusals that name the culprit and enqueue
 *   nothing.
 * Bound: max |out - ref| <= 2e-3 * max |ref| per (sequence, query head)
 * (f32 output; bf16 output adds its rounding, 2^-8).
 *
 * Public headers only. NOFORK; skips with a message without a GPU.
 */
#include "gpu_test.h"


/* The generator restarts at each fixture from its spec and shape (fx_open),
 * so a test's data do not depend on which tests ran before it. */
static uint64_t seed = 11;
static float rnd(void) { return gpu_normal(&seed); }
static uint64_t seed_of(const char *spec, uint32_t L, uint32_t H, uint32_t D) {
  uint64_t x = 1469598103934665603ull; /* FNV-1a */
  for (const unsigned char *c = (const unsigned char *)spec; *c; c++) x = (x ^ *c) * 1099511628211ull;
  return x ^ ((uint64_t)L << 40 | (uint64_t)H << 20 | D);
}

typedef struct fixture {
  kvp_pool *pool;
  cudaStream_t stream;
  uint32_t L, H, D, maxtok;
  uint16_t *hk, *hv;
  void *dk, *dv;
} fixture;

static void fx_open(fixture *f, const char *spec, uint32_t L, uint32_t H, uint32_t D, uint64_t region,
                    uint32_t maxtok) {
  memset(f, 0, sizeof *f);
  f->L = L, f->H = H, f->D = D, f->maxtok = maxtok;
  seed = seed_of(spec, L, H, D);
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.k_dtype = c.v_dtype = KVP_DTYPE_BF16;
  c.region_bytes = region;
  c.block_tokens = 16;
  c.codecs = spec;
  c.memory = KVP_MEM_CUDA;
  ck_ok(kvp_pool_create(&c, &f->pool));
  ck_cuda(cudaStreamCreate(&f->stream));
  size_t bytes = (size_t)maxtok * H * D * 2;
  f->hk = malloc(bytes), f->hv = malloc(bytes);
  ck_cuda(cudaMalloc(&f->dk, bytes));
  ck_cuda(cudaMalloc(&f->dv, bytes));
}

static void fx_close(fixture *f) {
  ck_ok(kvp_check(f->pool));
  kvp_pool_destroy(f->pool);
  cudaStreamDestroy(f->stream);
  free(f->hk), free(f->hv);
  cudaFree(f->dk), cudaFree(f->dv);
}

/* One step of n tokens to seq, every layer. */
static void fx_step(fixture *f, uint64_t seq, uint32_t n) {
  ck_assert_uint_le(n, f->maxtok);
  ck_ok(kvp_step_begin(f->pool, seq, n, 0));
  size_t cnt = (size_t)n * f->H * f->D;
  for (uint32_t l = 0; l < f->L; l++) {
    for (size_t i = 0; i < cnt; i++) {
      f->hk[i] = gpu_bf16_of(rnd() * (i % f->D < 3 ? 4.0f : 1.0f));
      f->hv[i] = gpu_bf16_of(rnd());
    }
    ck_cuda(cudaMemcpyAsync(f->dk, f->hk, cnt * 2, cudaMemcpyHostToDevice, f->stream));
    ck_cuda(cudaMemcpyAsync(f->dv, f->hv, cnt * 2, cudaMemcpyHostToDevice, f->stream));
    kvp_kv kv = {f->dk, f->dv, f->stream};
    ck_ok(kvp_append(f->pool, seq, l, &kv));
  }
  ck_ok(kvp_step_end(f->pool, seq));
}

/* A sequence of n tokens: a prefill, then decode tokens one step each (the
 * last ones sit in an OPEN block). */
static void fx_seq(fixture *f, uint64_t seq, uint32_t n) {
  ck_ok(kvp_seq_add(f->pool, seq, NULL));
  uint32_t decode = n > 5 ? 5 : n - 1, pre = n - decode;
  for (uint32_t at = 0; at < pre; at += f->maxtok) fx_step(f, seq, pre - at < f->maxtok ? pre - at : f->maxtok);
  for (uint32_t i = 0; i < decode; i++) fx_step(f, seq, 1);
}

/* Reference for (b, every query head) of layer: double-precision softmax
 * attention over kvp_read's f32 rows of each KV head; q given as bf16. */
static void reference(fixture *f, uint32_t layer, const uint64_t *seqs, uint32_t B, uint32_t Hq, float scale,
                      const uint16_t *q, double *ref) {
  uint32_t H = f->H, D = f->D, G = Hq / H;
  for (uint32_t b = 0; b < B; b++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req r = {sizeof r, h, KVP_DTYPE_F32, NULL, NULL, NULL, 0, 0, f->stream};
      int rc = kvp_read(f->pool, seqs[b], layer, &r);
      ck_assert(rc == KVP_OK || rc == KVP_ENOSPC);
      uint32_t n = r.n_tokens;
      float *k = malloc((size_t)(n ? n : 1) * D * 4), *v = malloc((size_t)(n ? n : 1) * D * 4);
      void *dk, *dv;
      ck_cuda(cudaMalloc(&dk, (size_t)(n ? n : 1) * D * 4));
      ck_cuda(cudaMalloc(&dv, (size_t)(n ? n : 1) * D * 4));
      r.k_out = dk, r.v_out = dv, r.capacity_tokens = n;
      if (n) ck_ok(kvp_read(f->pool, seqs[b], layer, &r));
      ck_cuda(cudaMemcpyAsync(k, dk, (size_t)n * D * 4, cudaMemcpyDeviceToHost, f->stream));
      ck_cuda(cudaMemcpyAsync(v, dv, (size_t)n * D * 4, cudaMemcpyDeviceToHost, f->stream));
      ck_cuda(cudaStreamSynchronize(f->stream));
      double *s = malloc((size_t)(n ? n : 1) * sizeof *s);
      for (uint32_t g = 0; g < G; g++) {
        const uint16_t *qq = q + ((size_t)b * Hq + h * G + g) * D;
        double *o = ref + ((size_t)b * Hq + h * G + g) * D, mx = -INFINITY, sum = 0;
        for (uint32_t t = 0; t < n; t++) {
          double d = 0;
          for (uint32_t i = 0; i < D; i++) d += (double)gpu_f32_of_bf16(qq[i]) * k[(size_t)t * D + i];
          s[t] = d * scale;
          mx = s[t] > mx ? s[t] : mx;
        }
        for (uint32_t i = 0; i < D; i++) o[i] = 0;
        for (uint32_t t = 0; t < n; t++) {
          double p = exp(s[t] - mx);
          sum += p;
          for (uint32_t i = 0; i < D; i++) o[i] += p * v[(size_t)t * D + i];
        }
        for (uint32_t i = 0; i < D; i++) o[i] = n ? o[i] / sum : 0.0;
      }
      free(s), free(k), free(v);
      cudaFree(dk), cudaFree(dv);
    }
}

typedef struct run {
  uint32_t split_tokens; /* 0: automatic */
  kvp_dtype out_dtype;
  uint32_t n_splits;
  uint64_t token_heads;
  double worst;          /* max over (b, hq) of max|out - ref| / max|ref| */
} run;

/* kvp_attend_decode of layer for seqs against the reference. */
static void attend_vs_ref(fixture *f, uint32_t layer, const uint64_t *seqs, uint32_t B, uint32_t Hq, run *x) {
  uint32_t D = f->D;
  size_t nq = (size_t)B * Hq * D;
  uint16_t *q = malloc(nq * 2);
  for (size_t i = 0; i < nq; i++) q[i] = gpu_bf16_of(rnd());
  float scale = 1.0f / sqrtf((float)D);
  double *ref = malloc(nq * sizeof *ref);
  reference(f, layer, seqs, B, Hq, scale, q, ref);
  void *dq, *dout;
  size_t osz = x->out_dtype == KVP_DTYPE_F32 ? 4 : 2;
  ck_cuda(cudaMalloc(&dq, nq * 2));
  ck_cuda(cudaMalloc(&dout, nq * osz));
  ck_cuda(cudaMemcpy(dq, q, nq * 2, cudaMemcpyHostToDevice));
  ck_cuda(cudaMemset(dout, 0x7F, nq * osz));
  kvp_attend_req a;
  kvp_attend_req_init(&a);
  a.layer = layer, a.seqs = seqs, a.batch = B, a.n_q_heads = Hq, a.q = dq, a.scale = scale, a.out = dout;
  a.out_dtype = x->out_dtype, a.split_tokens = x->split_tokens, a.stream = f->stream;
  ck_assert_int_eq(kvp_attend_decode(f->pool, &a), KVP_ENOSPC); /* no workspace: it says how much */
  ck_assert_uint_gt(a.workspace_needed, 0);
  ck_cuda(cudaMalloc(&a.workspace, a.workspace_needed));
  a.workspace_bytes = a.workspace_needed;
  ck_ok(kvp_attend_decode(f->pool, &a));
  void *out = malloc(nq * osz);
  ck_cuda(cudaMemcpyAsync(out, dout, nq * osz, cudaMemcpyDeviceToHost, f->stream));
  ck_cuda(cudaStreamSynchronize(f->stream));
  x->worst = 0;
  for (size_t r = 0; r < (size_t)B * Hq; r++) {
    double mref = 0, merr = 0;
    for (uint32_t i = 0; i < D; i++) {
      double o = osz == 4 ? ((float *)out)[r * D + i] : gpu_f32_of_bf16(((uint16_t *)out)[r * D + i]);
      double e = fabs(o - ref[r * D + i]);
      ck_assert_msg(isfinite(o), "row %zu channel %u: %g", r, i, o);
      mref = fabs(ref[r * D + i]) > mref ? fabs(ref[r * D + i]) : mref;
      merr = e > merr ? e : merr;
    }
    if (mref == 0) ck_assert_msg(merr == 0, "row %zu: a head with no tokens must give zeros (err %g)", r, merr);
    else x->worst = merr / mref > x->worst ? merr / mref : x->worst;
  }
  x->n_splits = a.n_splits, x->token_heads = a.token_heads;
  double bound = osz == 4 ? 2e-3 : 2e-3 + 1.0 / 256;
  ck_assert_msg(x->worst <= bound, "layer %u: error %.3g > %.3g", layer, x->worst, bound);
  ck_ok(kvp_check(f->pool));
  free(q), free(ref), free(out);
  cudaFree(dq), cudaFree(dout), cudaFree(a.workspace);
}

static const char *const specs[] = {
    "kv=bf16",
    "kv=fp16",
    "kv=fp32",
    "kv=fp8",
    "k=fp8:scale=0.05,v=int8:pct=99.5",
    "kv=int8",
    "kv=kivi:bits=2:group=16",
    "k=kivi:bits=4:group=16,v=kivi:bits=2:group=32",
    "kv=nvfp4",
    "k=nvfp4:rule=4/6:ksmooth=store,v=nvfp4:rule=4/6",
    "k=nvfp4:ksmooth=store,v=kivi;layers=1-1:k=fp8,v=int8",
};
#define NSPECS (sizeof specs / sizeof specs[0])

/* Every codec: lengths 1, 16, 17, 100, 250 in one batch, per-head
 * evictions, GQA 4, both layers, forced splits and the automatic one. */
START_TEST(codecs_vs_reference) {
  if (gpu_spec_off(specs[_i])) return;
  fixture f;
  fx_open(&f, specs[_i], 2, 4, 128, 64ull << 20, 256);
  static const uint32_t len[] = {1, 16, 17, 100, 250};
  uint64_t seqs[5];
  for (uint32_t i = 0; i < 5; i++) fx_seq(&f, seqs[i] = 10 + i, len[i]);
  ck_ok(kvp_evict(f.pool, 13, 0, 2, 0));  /* the 95-token prefill of head 2: 5 decode tokens left */
  ck_ok(kvp_evict(f.pool, 14, 1, 1, 3));  /* one decode token of head 1 */
  ck_ok(kvp_evict(f.pool, 12, 0, 3, 0));  /* head 3 of the 17-token sequence: its decode tokens left */
  ck_ok(kvp_evict(f.pool, 10, 1, 0, 0));  /* the 1-token sequence's head 0 holds nothing */
  double worst = 0;
  for (uint32_t layer = 0; layer < 2; layer++) {
    run a = {.split_tokens = 0, .out_dtype = KVP_DTYPE_F32}, b = {.split_tokens = 32, .out_dtype = KVP_DTYPE_F32};
    attend_vs_ref(&f, layer, seqs, 5, 16, &a);
    attend_vs_ref(&f, layer, seqs, 5, 16, &b);
    ck_assert_uint_gt(b.n_splits, a.n_splits); /* 32-token splits: several per long head, merged */
    worst = fmax(worst, fmax(a.worst, b.worst));
  }
  printf("%-55s max rel error %.2e (f32 out)\n", specs[_i], worst);
  fx_close(&f);
}
END_TEST

/* GQA ratios 1, 4, 8 and D = 64, 128, 256, bf16 output too. */
START_TEST(geometry) {
  static const struct { uint32_t H, D, G; const char *spec; } g[] = {
      {8, 64, 1, "kv=nvfp4"}, {2, 64, 8, "kv=kivi:bits=2:group=16"}, {4, 256, 4, "kv=fp8"},
      {2, 256, 8, "k=int8,v=nvfp4"}, {8, 128, 1, "kv=bf16"},      {4, 128, 8, "kv=int8"},
      {3, 128, 3, "kv=bf16"},     {8, 64, 1, "kv=fp8"},         {2, 64, 8, "k=fp8:scale=0.05,v=fp8"},
      {4, 64, 4, "kv=int8"},      {4, 64, 4, "k=nvfp4:ksmooth=store,v=nvfp4"},
      {4, 128, 4, "k=nvfp4,v=nvfp4:ksmooth=store"}, {2, 64, 8, "kv=nvfp4:ksmooth=store:rule=4/6"},
      {4, 128, 4, "k=kivi:bits=4:group=16,v=kivi:bits=4:group=32"}, {4, 64, 4, "kv=kivi:bits=4:group=16"},
      {8, 128, 1, "k=kivi:bits=2:group=16,v=kivi:bits=2:group=64"},
  };
  const uint32_t n = sizeof g / sizeof g[0];
  for (uint32_t i = 0; i < n; i++) {
    fixture f;
    fx_open(&f, g[i].spec, 1, g[i].H, g[i].D, 64ull << 20, 256);
    uint64_t seqs[3] = {1, 2, 3};
    fx_seq(&f, 1, 200);
    fx_seq(&f, 2, 33);
    fx_seq(&f, 3, 1);
    run a = {.out_dtype = KVP_DTYPE_F32}, b = {.split_tokens = 48, .out_dtype = KVP_DTYPE_BF16};
    attend_vs_ref(&f, 0, seqs, 3, g[i].H * g[i].G, &a);
    attend_vs_ref(&f, 0, seqs, 3, g[i].H * g[i].G, &b);
    printf("H=%u D=%3u G=%u %-28s max rel error %.2e (f32 out), %.2e (bf16 out)\n", g[i].H, g[i].D, g[i].G,
           g[i].spec, a.worst, b.worst);
    fx_close(&f);
  }
}
END_TEST

/* Decode steps between the calls: each layer's kept table is read in
 * place (pinned records, the ends redone there) while tokens fill OPEN
 * blocks and new blocks follow them; from step 20 on, every fifth step the
 * batch changes (a sequence freed and another added in its place, or two
 * swapped): the kept table takes the sequences that stay and walks the new
 * one. Every call against the reference. */
START_TEST(decode_steps_kept_in_place) {
  static const char *const sp[] = {"kv=bf16", "kv=fp8", "kv=nvfp4", "kv=kivi:bits=2:group=16"};
  if (gpu_spec_off(sp[_i])) return;
  fixture f;
  fx_open(&f, sp[_i], 2, 4, 128, 64ull << 20, 64);
  static const uint32_t len[] = {20, 33, 47, 64};
  uint64_t seqs[4];
  for (uint32_t i = 0; i < 4; i++) fx_seq(&f, seqs[i] = 30 + i, len[i]);
  kvp_stats s0 = {.struct_size = sizeof s0}, s1 = {.struct_size = sizeof s1};
  ck_ok(kvp_stats_get(f.pool, &s0));
  double worst = 0;
  for (int step = 0; step < 40; step++) {
    if (step >= 20 && step % 10 == 0) { /* one leaves, another joins in its place */
      uint32_t i = (uint32_t)step / 10 % 4;
      ck_ok(kvp_seq_free(f.pool, seqs[i]));
      fx_seq(&f, seqs[i] = 40 + (uint64_t)step, 9 + (uint32_t)step);
    } else if (step >= 20 && step % 5 == 0) { /* two swap places */
      uint64_t x = seqs[0];
      seqs[0] = seqs[3], seqs[3] = x;
    }
    for (uint32_t i = 0; i < 4; i++) fx_step(&f, seqs[i], 1);
    for (uint32_t layer = 0; layer < 2; layer++) {
      run a = {.split_tokens = step % 3 ? 0 : 16, .out_dtype = KVP_DTYPE_F32};
      attend_vs_ref(&f, layer, seqs, 4, 16, &a);
      worst = fmax(worst, a.worst);
    }
  }
  ck_ok(kvp_stats_get(f.pool, &s1));
  ck_assert_uint_gt(s1.host_pinned_bytes, s0.host_pinned_bytes); /* the kept records, pinned */
  printf("%-28s 40 decode steps and 4 batch changes, kept tables in place: max rel error %.2e, %llu pinned bytes "
         "more\n", sp[_i], worst,
         (unsigned long long)(s1.host_pinned_bytes - s0.host_pinned_bytes));
  fx_close(&f);
}
END_TEST

/* 128K tokens of one sequence (llama-3-8b's layer geometry): the automatic
 * split spreads it over the device. */
START_TEST(long_context) {
  if (getenv("KVP_GPU_SPEC")) return; /* a narrowed run (sanitizers) */
  static const char *const sp[] = {"kv=fp8", "kv=nvfp4"};
  for (int i = 0; i < 2; i++) {
    fixture f;
    fx_open(&f, sp[i], 1, 8, 128, 1ull << 30, 8192);
    uint64_t seq = 7;
    fx_seq(&f, seq, 131072);
    run a = {.out_dtype = KVP_DTYPE_F32};
    attend_vs_ref(&f, 0, &seq, 1, 32, &a);
    ck_assert_uint_eq(a.token_heads, 131072ull * 8);
    ck_assert_uint_gt(a.n_splits, 64);
    printf("%-10s 128K tokens: %u splits, max rel error %.2e\n", sp[i], a.n_splits, a.worst);
    fx_close(&f);
  }
}
END_TEST

/* A KV head split into more pieces than attend_reduce has threads (D =
 * 64): its merge takes the splits' slots a chunk of 64 at a time, twice
 * (the max, then the sums). 16-token splits of 4K tokens: 256 a head. */
START_TEST(merge_of_many_splits) {
  static const char *const sp[] = {"kv=bf16", "kv=nvfp4"};
  for (int i = 0; i < 2; i++) {
    if (gpu_spec_off(sp[i])) continue;
    fixture f;
    fx_open(&f, sp[i], 1, 2, 64, 64ull << 20, 1024);
    uint64_t seq = 3;
    fx_seq(&f, seq, 4096);
    run a = {.split_tokens = 16, .out_dtype = KVP_DTYPE_F32};
    attend_vs_ref(&f, 0, &seq, 1, 8, &a);
    ck_assert_uint_gt(a.n_splits, 2 * 3 * 64); /* more than three chunks a head */
    printf("%-10s 4K tokens in %u splits (D = 64): max rel error %.2e\n", sp[i], a.n_splits, a.worst);
    fx_close(&f);
  }
}
END_TEST

/* Refusals name the culprit and leave nothing enqueued. */
START_TEST(refusals) {
  fixture f;
  fx_open(&f, "kv=fp8", 2, 4, 128, 32ull << 20, 64);
  fx_seq(&f, 1, 40);
  uint64_t seqs[2] = {1, 99};
  void *dq, *dout;
  ck_cuda(cudaMalloc(&dq, 2 * 16 * 128 * 2));
  ck_cuda(cudaMalloc(&dout, 2 * 16 * 128 * 4));
  kvp_attend_req a;
  kvp_attend_req_init(&a);
  a.layer = 0, a.seqs = seqs, a.batch = 1, a.n_q_heads = 16, a.q = dq, a.out = dout, a.scale = 0.1f;
  a.stream = f.stream;
  a.n_q_heads = 6;
  ck_assert_int_eq(kvp_attend_decode(f.pool, &a), KVP_EINVAL);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "n_q_heads 6"));
  a.n_q_heads = 48;
  ck_assert_int_eq(kvp_attend_decode(f.pool, &a), KVP_ENOTSUP);
  a.n_q_heads = 16, a.layer = 2;
  ck_assert_int_eq(kvp_attend_decode(f.pool, &a), KVP_EINVAL);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "layer 2"));
  a.layer = 0, a.scale = NAN;
  ck_assert_int_eq(kvp_attend_decode(f.pool, &a), KVP_EINVAL);
  a.scale = 0.1f, a.q = (char *)dq + 2;
  ck_assert_int_eq(kvp_attend_decode(f.pool, &a), KVP_EINVAL);
  a.q = dq, a.batch = 2;
  ck_cuda(cudaMalloc(&a.workspace, 1 << 20));
  a.workspace_bytes = 1 << 20;
  ck_assert_int_eq(kvp_attend_decode(f.pool, &a), KVP_ENOENT);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "sequence 99"));
  a.batch = 1, a.workspace_bytes = 8;
  ck_assert_int_eq(kvp_attend_decode(f.pool, &a), KVP_ENOSPC);
  ck_assert_uint_gt(a.workspace_needed, 8);
  ck_cuda(cudaStreamSynchronize(f.stream));
  a.batch = 0;
  ck_ok(kvp_attend_decode(f.pool, &a));
  ck_ok(kvp_check(f.pool));
  cudaFree(dq), cudaFree(dout), cudaFree(a.workspace);
  fx_close(&f);
  /* a host pool has no kernel to run */
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 1, c.n_kv_heads = 4, c.head_dim = 128, c.region_bytes = 16 << 20;
  kvp_pool *hp;
  ck_ok(kvp_pool_create(&c, &hp));
  kvp_attend_req_init(&a);
  ck_assert_int_eq(kvp_attend_decode(hp, &a), KVP_ENOTSUP);
  kvp_pool_destroy(hp);
}
END_TEST

int main(void) {
  if (!gpu_present("check_gpu_attend")) return 0;
  Suite *s = suite_create("gpu_attend");
  TCase *tc = tcase_create("attend");
  tcase_set_timeout(tc, 900);
  tcase_add_loop_test(tc, codecs_vs_reference, 0, NSPECS);
  tcase_add_test(tc, geometry);
  tcase_add_test(tc, long_context);
  tcase_add_test(tc, merge_of_many_splits);
  tcase_add_loop_test(tc, decode_steps_kept_in_place, 0, 4);
  tcase_add_test(tc, refusals);
  suite_add_tcase(s, tc);
  return gpu_run(s, CK_NORMAL);
}
