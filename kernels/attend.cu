/*
 * kernels/attend.cu - decode attention over kvpool's pages: one query token
 * per (sequence, query head) against the tokens each KV head retains,
 * dequantized in registers from the codes (no bf16 copy of the cache).
 *
 * The host (pages/attend.c) walks the page tables and hands a table of
 * splits: a split is a run of block records (kvp__gjob, one per retained
 * token range of one block and head) of one (sequence, KV head). One CTA of
 * kAttnThreads runs one split for the G = n_q_heads / n_kv_heads query
 * heads that share the KV head (GQA: each K/V row is read once for all G).
 *
 * CTA mapping: TPT = D / 8 lanes per token, each holding 8 channels (its
 * query slice for the G heads, its share of the G output rows). A warp
 * reads 32 / TPT tokens at once, TB tokens deep, K and V rows loaded
 * together before any arithmetic. Warps take the split's records in turn.
 * Scores: 8-element partial dots reduced over the TPT lanes by xor
 * shuffles; softmax online in base 2 (scores pre-scaled by scale *
 * log2(e)), the running max raised at most once per TB tokens. The lanes'
 * and warps' states merge at the end (log-sum-exp), into the output when the
 * split is its (sequence, KV head)'s only one, else into a partial record
 * [max, sum, acc[D]] per query head that attend_reduce merges
 * (flash-decoding: one long sequence spreads over many CTAs).
 *
 * The values are the host decode's f32 bit for bit (each codec's
 * <codec>_row8); products and sums in f32, exp2 by ex2.approx (2 ulp).
 */
#include <cuda_runtime.h>

#include "common.cuh"
#include "fp8.cuh"
#include "int8.cuh"
#include "kivi.cuh"
#include "nvfp4.cuh"
#include "raw.cuh"

namespace kvpk {

constexpr uint32_t kAttnThreads = 128, kAttnWarps = kAttnThreads / 32;

struct AttnArgs {
  kvp__kparams p[4];           /* K codec, K tail (raw), V codec, V tail */
  const char *base;            /* region base: pages at base + off * 64 */
  const kvp__gjob *recs;
  const kvp__asplit *splits;
  const uint32_t *bh_split0;   /* [B * Hkv + 1]: the splits of (b, h) */
  const uint16_t *q;           /* bf16 [B][Hq][D] */
  void *out;                   /* [B][Hq][D] of out_dtype */
  float *part;                 /* [slots][G][2 + D] */
  float scale_log2;            /* softmax scale * log2(e) */
  uint32_t out_dtype, Hq, Hkv, G;
};

KVP_D float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* Rows t0 + tok[u] (u < TB, those with ok[u]) of one side, chunk c. */
template <uint32_t TB, typename F>
KVP_D void rows(F fn, const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, uint32_t t0,
                const uint32_t (&tok)[TB], const bool (&ok)[TB], uint32_t c, float (&x)[TB][8]) {
#pragma unroll
  for (uint32_t u = 0; u < TB; u++) {
    if (ok[u]) fn(p, pg, cap, t0 + tok[u], c, x[u]);
    else
#pragma unroll
      for (int e = 0; e < 8; e++) x[u][e] = 0.0f;
  }
}

template <uint32_t TB>
KVP_D void load_rows(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, uint32_t t0,
                     const uint32_t (&tok)[TB], const bool (&ok)[TB], uint32_t c, float (&x)[TB][8]) {
  switch (p.codec) {
  case KVP__K_FP8: rows<TB>(fp8_row8, p, pg, cap, t0, tok, ok, c, x); break;
  case KVP__K_INT8: rows<TB>(int8_row8, p, pg, cap, t0, tok, ok, c, x); break;
  case KVP__K_KIVI: rows<TB>(kivi_row8, p, pg, cap, t0, tok, ok, c, x); break;
  case KVP__K_NVFP4: rows<TB>(nvfp4_row8, p, pg, cap, t0, tok, ok, c, x); break;
  default: rows<TB>(raw_row8, p, pg, cap, t0, tok, ok, c, x); break;
  }
}

/* The online-softmax state of one lane for up to GM query heads. */
template <uint32_t GM> struct State {
  float m[GM], l[GM], acc[GM][8];
};

/* Merge o into s (both in base-2 log-sum-exp form). */
template <uint32_t GM> KVP_D void merge(State<GM> &s, uint32_t g, float om, float ol, const float (&oacc)[8]) {
  float M = fmaxf(s.m[g], om);
  float a = s.m[g] == -INFINITY ? 0.0f : ex2(s.m[g] - M), b = om == -INFINITY ? 0.0f : ex2(om - M);
  s.l[g] = s.l[g] * a + ol * b;
#pragma unroll
  for (int e = 0; e < 8; e++) s.acc[g][e] = s.acc[g][e] * a + oacc[e] * b;
  s.m[g] = M;
}

template <uint32_t D, uint32_t GM>
__global__ void __launch_bounds__(kAttnThreads) attend_kernel(const __grid_constant__ AttnArgs a) {
  constexpr uint32_t TPT = D / 8, TPW = 32 / TPT;
  /* tokens per lane group per pass: about 8 tokens per warp pass, fewer rows in flight for wide groups */
  constexpr uint32_t TB = GM >= 8 ? 2 : (TPW >= 4 ? 2 : 4);
  const kvp__asplit sp = a.splits[blockIdx.x];
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, c = lane % TPT, tg = lane / TPT;
  const uint32_t b = sp.bh / a.Hkv, h = sp.bh % a.Hkv, G = a.G;

  float qf[GM][8];
#pragma unroll
  for (uint32_t g = 0; g < GM; g++) {
    uint4 v = make_uint4(0, 0, 0, 0);
    if (g < G) v = __ldg((const uint4 *)(a.q + ((size_t)b * a.Hq + h * G + g) * D) + c);
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int e = 0; e < 4; e++) {
      qf[g][2 * e] = bf16_to_f32(w[e] & 0xFFFFu) * a.scale_log2;
      qf[g][2 * e + 1] = bf16_to_f32(w[e] >> 16) * a.scale_log2;
    }
  }
  State<GM> st;
#pragma unroll
  for (uint32_t g = 0; g < GM; g++) {
    st.m[g] = -INFINITY, st.l[g] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++) st.acc[g][e] = 0.0f;
  }

  for (uint32_t r = warp; r < sp.nrec; r += kAttnWarps) {
    const kvp__gjob *rec = &a.recs[sp.rec0 + r];
    const uint8_t *kpg[4], *vpg[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      uint32_t ko = __ldg(&rec->page[0][i]), vo = __ldg(&rec->page[1][i]);
      kpg[i] = ko == KVP__GJOB_NO_PAGE ? nullptr : (const uint8_t *)a.base + (uint64_t)ko * 64;
      vpg[i] = vo == KVP__GJOB_NO_PAGE ? nullptr : (const uint8_t *)a.base + (uint64_t)vo * 64;
    }
    const uint32_t tag = __ldg(&rec->tag), t0 = __ldg(&rec->t0), m = __ldg(&rec->m1) + 1u,
                   cap = __ldg(&rec->cap1) + 1u;
    const kvp__kparams &kp = a.p[tag & 1u], &vp = a.p[2 + (tag & 1u)];
    for (uint32_t ib = 0; ib < m; ib += TPW * TB) { /* uniform over the warp: shuffles below need every lane */
      uint32_t tok[TB];
      bool ok[TB];
#pragma unroll
      for (uint32_t u = 0; u < TB; u++) tok[u] = ib + u * TPW + tg, ok[u] = tok[u] < m;
      float kx[TB][8], vx[TB][8];
      load_rows<TB>(kp, kpg, cap, t0, tok, ok, c, kx);
      load_rows<TB>(vp, vpg, cap, t0, tok, ok, c, vx);
      float s[TB][GM];
#pragma unroll
      for (uint32_t u = 0; u < TB; u++)
#pragma unroll
        for (uint32_t g = 0; g < GM; g++) {
          float d = 0.0f;
#pragma unroll
          for (int e = 0; e < 8; e++) d = fmaf(qf[g][e], kx[u][e], d);
#pragma unroll
          for (uint32_t o = TPT / 2; o; o >>= 1) d += __shfl_xor_sync(0xFFFFFFFFu, d, o);
          s[u][g] = d;
        }
#pragma unroll
      for (uint32_t g = 0; g < GM; g++) {
        if (g >= G) break;
        float mn = st.m[g];
#pragma unroll
        for (uint32_t u = 0; u < TB; u++)
          if (ok[u]) mn = fmaxf(mn, s[u][g]);
        if (mn > st.m[g]) { /* the max rose: rescale what was summed */
          float al = st.m[g] == -INFINITY ? 0.0f : ex2(st.m[g] - mn);
          st.l[g] *= al;
#pragma unroll
          for (int e = 0; e < 8; e++) st.acc[g][e] *= al;
          st.m[g] = mn;
        }
#pragma unroll
        for (uint32_t u = 0; u < TB; u++) {
          if (!ok[u]) continue;
          float pu = ex2(s[u][g] - mn);
          st.l[g] += pu;
#pragma unroll
          for (int e = 0; e < 8; e++) st.acc[g][e] = fmaf(pu, vx[u][e], st.acc[g][e]);
        }
      }
    }
  }

  /* the warp's lane groups into group 0 */
#pragma unroll
  for (uint32_t o = TPT; o < 32; o <<= 1)
#pragma unroll
    for (uint32_t g = 0; g < GM; g++) {
      float om = __shfl_xor_sync(0xFFFFFFFFu, st.m[g], o), ol = __shfl_xor_sync(0xFFFFFFFFu, st.l[g], o);
      float oacc[8];
#pragma unroll
      for (int e = 0; e < 8; e++) oacc[e] = __shfl_xor_sync(0xFFFFFFFFu, st.acc[g][e], o);
      merge(st, g, om, ol, oacc);
    }
  /* the warps through shared memory */
  __shared__ float sm_m[kAttnWarps][GM], sm_l[kAttnWarps][GM], sm_acc[kAttnWarps][GM][D];
  if (tg == 0) {
#pragma unroll
    for (uint32_t g = 0; g < GM; g++) {
      if (c == 0) sm_m[warp][g] = st.m[g], sm_l[warp][g] = st.l[g];
#pragma unroll
      for (int e = 0; e < 8; e++) sm_acc[warp][g][8 * c + e] = st.acc[g][e];
    }
  }
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < G * D; i += kAttnThreads) {
    uint32_t g = i / D, d = i % D;
    float M = -INFINITY;
    for (uint32_t w = 0; w < kAttnWarps; w++) M = fmaxf(M, sm_m[w][g]);
    float L = 0.0f, A = 0.0f;
    if (M != -INFINITY)
      for (uint32_t w = 0; w < kAttnWarps; w++) {
        float f = sm_m[w][g] == -INFINITY ? 0.0f : ex2(sm_m[w][g] - M);
        L = fmaf(sm_l[w][g], f, L);
        A = fmaf(sm_acc[w][g][d], f, A);
      }
    if (sp.slot == KVP__ASPLIT_ONLY) {
      store_elem(a.out, a.out_dtype, ((size_t)b * a.Hq + h * G + g) * D + d, L > 0.0f ? A / L : 0.0f);
    } else {
      float *pr = a.part + ((size_t)sp.slot * G + g) * (2 + D);
      if (d == 0) pr[0] = M, pr[1] = L;
      pr[2 + d] = A;
    }
  }
}

/* One CTA per (sequence, query head) whose KV head has several splits:
 * their partial records merged. */
template <uint32_t D> __global__ void __launch_bounds__(D) attend_reduce(const __grid_constant__ AttnArgs a) {
  uint32_t b = blockIdx.x / a.Hq, hq = blockIdx.x % a.Hq, h = hq / a.G, g = hq % a.G, bh = b * a.Hkv + h;
  uint32_t s0 = a.bh_split0[bh], s1 = a.bh_split0[bh + 1], d = threadIdx.x;
  if (s1 - s0 < 2) return;
  float M = -INFINITY;
  for (uint32_t s = s0; s < s1; s++) M = fmaxf(M, a.part[((size_t)a.splits[s].slot * a.G + g) * (2 + D)]);
  float L = 0.0f, A = 0.0f;
  if (M != -INFINITY)
    for (uint32_t s = s0; s < s1; s++) {
      const float *pr = a.part + ((size_t)a.splits[s].slot * a.G + g) * (2 + D);
      float f = pr[0] == -INFINITY ? 0.0f : ex2(pr[0] - M);
      L = fmaf(pr[1], f, L);
      A = fmaf(pr[2 + d], f, A);
    }
  store_elem(a.out, a.out_dtype, ((size_t)b * a.Hq + hq) * D + d, L > 0.0f ? A / L : 0.0f);
}

template <uint32_t D>
cudaError_t attend_launch(const AttnArgs &a, uint32_t nsplits, uint32_t B, bool reduce, cudaStream_t s) {
  if (a.G == 1) attend_kernel<D, 1><<<nsplits, kAttnThreads, 0, s>>>(a);
  else if (a.G == 2) attend_kernel<D, 2><<<nsplits, kAttnThreads, 0, s>>>(a);
  else if (a.G <= 4) attend_kernel<D, 4><<<nsplits, kAttnThreads, 0, s>>>(a);
  else attend_kernel<D, 8><<<nsplits, kAttnThreads, 0, s>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && reduce) {
    attend_reduce<D><<<B * a.Hq, D, 0, s>>>(a);
    e = cudaGetLastError();
  }
  return e;
}

} // namespace kvpk

/* Load every attention kernel now: with CUDA's lazy module loading the
 * first launch would load them, and a load inside a call whose stream is
 * held (a host function waiting, a graph being captured) can wait forever. */
template <uint32_t D> static cudaError_t preload_d() {
  cudaFuncAttributes fa;
  cudaError_t e = cudaFuncGetAttributes(&fa, kvpk::attend_kernel<D, 1>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, kvpk::attend_kernel<D, 2>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, kvpk::attend_kernel<D, 4>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, kvpk::attend_kernel<D, 8>);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, kvpk::attend_reduce<D>);
  return e;
}

extern "C" int kvp__kern_attend_preload(void) {
  cudaError_t e = preload_d<32>();
  if (e == cudaSuccess) e = preload_d<64>();
  if (e == cudaSuccess) e = preload_d<128>();
  if (e == cudaSuccess) e = preload_d<256>();
  return (int)e;
}

extern "C" int kvp__kern_attend(const kvp__attend_args *x, void *stream) {
  kvpk::AttnArgs a;
  for (int i = 0; i < 4; i++) a.p[i] = x->p[i];
  a.base = (const char *)x->region_base;
  a.recs = x->recs;
  a.splits = x->splits;
  a.bh_split0 = x->bh_split0;
  a.q = (const uint16_t *)x->q;
  a.out = x->out;
  a.part = x->part;
  a.scale_log2 = x->scale * 1.4426950408889634f;
  a.out_dtype = x->out_dtype, a.Hq = x->n_q_heads, a.Hkv = x->n_kv_heads, a.G = x->n_q_heads / x->n_kv_heads;
  if (!x->n_splits) return 0;
  if (a.G < 1 || a.G > KVP__KERN_ATTEND_MAX_GROUP) return (int)cudaErrorInvalidValue;
  cudaStream_t s = (cudaStream_t)stream;
  switch (x->head_dim) {
  case 32: return (int)kvpk::attend_launch<32>(a, x->n_splits, x->batch, x->reduce, s);
  case 64: return (int)kvpk::attend_launch<64>(a, x->n_splits, x->batch, x->reduce, s);
  case 128: return (int)kvpk::attend_launch<128>(a, x->n_splits, x->batch, x->reduce, s);
  case 256: return (int)kvpk::attend_launch<256>(a, x->n_splits, x->batch, x->reduce, s);
  default: return (int)cudaErrorInvalidValue;
  }
}
