/*
 * kernels/attend_core.cuh - the parts of decode attention that the kernels
 * of kernels/attend.cu and kernels/attend_reg.cuh share: the call's
 * arguments, the block records and their streams, the tensor-core
 * products, the asynchronous copies, the online softmax (and the tile
 * kernels' step over it) and the CTA's final merge. Conventions (layouts of the matrix
 * fragments, precision) are in kernels/attend.cu's banner.
 *
 * Invariants: a lane (gr, qd) of a warp holds query head gr's running max
 * and sum (Acc) and the O^T accumulators of channels 16 i + gr (+ 8), or
 * r8_channel's order in attend_reg_kernel; a split's records are read in
 * order, each by one warp.
 */
#pragma once
#include <cuda_runtime.h>

#include "common.cuh"
#include "fp8.cuh"

namespace kvpk {

constexpr uint32_t kAttnThreads = 128, kAttnWarps = kAttnThreads / 32;
constexpr uint32_t kTile = 16; /* tokens per step of a warp */

struct AttnArgs {
  kvp__kparams p[4];           /* K codec, K tail (raw), V codec, V tail */
  const char *base;            /* region base: pages at base + off * 64 */
  const void *recs;            /* kvp__gjob, or the kernel's compact records */
  const kvp__asplit *splits;
  const uint32_t *bh_split0;   /* [B * Hkv + 1]: the splits of (b, h) */
  const uint16_t *q;           /* bf16 [B][Hq][D] */
  void *out;                   /* [B][Hq][D] of out_dtype */
  float *part;                 /* [slots][G][2 + D] */
  float scale_log2;            /* softmax scale * log2(e) */
  uint32_t out_dtype, Hq, Hkv, G;
};

/* Programmatic dependent launch (sm_90): a primary kernel lets the launch
 * that follows it on the stream start (dep_launch), and that one waits for
 * the primary's end and its stores (dep_wait) only where it reads what the
 * primary wrote. Both are no-ops below sm_90, and dep_wait returns at once
 * in a kernel launched without the dependency. */
KVP_D void dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
KVP_D void dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

KVP_D float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/* {lo, hi} as fp16x2 (round to nearest even) */
KVP_D uint32_t f16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

KVP_D uint32_t smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

KVP_D void ldsm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
KVP_D void ldsm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* d += a b: m16n8k16, fp16 operands, f32 accumulators */
KVP_D void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* A record's fields, loaded ahead of its turn. */
struct Rec {
  uint32_t page[2][4], tag, t0, m, cap;
};

static_assert(sizeof(kvp__arec_raw) == 16 && sizeof(kvp__arec_q) == 32, "one or two 16-byte loads a record");

/* A compact record's fields from its words */
KVP_D void rec_of(const uint4 (&w)[1], Rec &o) {
#pragma unroll
  for (int i = 0; i < 4; i++) o.page[0][i] = o.page[1][i] = KVP__GJOB_NO_PAGE;
  o.page[0][0] = w[0].x, o.page[1][0] = w[0].y, o.t0 = w[0].z & 0xFFFFu, o.m = (w[0].z >> 16) + 1u, o.tag = 0,
  o.cap = 0;
}

KVP_D void rec_of(const uint4 (&w)[2], Rec &o) {
  const uint4 a = w[0], b = w[1];
  o.page[0][0] = a.x, o.page[0][1] = a.y, o.page[0][2] = a.z, o.page[0][3] = KVP__GJOB_NO_PAGE;
  o.page[1][0] = a.w, o.page[1][1] = b.x, o.page[1][2] = b.y, o.page[1][3] = KVP__GJOB_NO_PAGE;
  o.t0 = b.z & 0xFFFFu, o.m = (b.z >> 16) + 1u, o.cap = (b.w & 0xFFFFu) + 1u, o.tag = b.w >> 16;
}

KVP_D void rec_load(const kvp__arec_q *r, Rec &o) {
  const uint4 w[2] = {__ldg((const uint4 *)r), __ldg((const uint4 *)r + 1)};
  rec_of(w, o);
}

KVP_D void rec_load(const kvp__gjob *r, Rec &o) {
#pragma unroll
  for (int kv = 0; kv < 2; kv++)
#pragma unroll
    for (int i = 0; i < 4; i++) o.page[kv][i] = __ldg(&r->page[kv][i]);
  o.tag = __ldg(&r->tag), o.t0 = __ldg(&r->t0), o.m = __ldg(&r->m1) + 1u, o.cap = __ldg(&r->cap1) + 1u;
}

/* A warp's records, read 32 at a time: lane i loads record i of the next
 * batch (one coalesced load of 32 records, a batch ahead), and each record
 * reaches every lane by shuffles when its turn comes. The warp takes a
 * contiguous run of its split's records (warp w: [nrec w / 4, nrec (w + 1) /
 * 4)), so the table may sit in pinned host memory (kvp__kern_attend_zero_copy):
 * its reads are whole lines, many in flight. W: 16-byte words a record. */
template <uint32_t W> struct RecStream {
  const uint4 *base;
  uint32_t i, end, b0; /* next record, end of the run, first record of cur */
  uint4 cur[W], nxt[W];

  KVP_D void load(uint4 (&o)[W], uint32_t first, uint32_t lane) const {
    const uint32_t r = first + lane;
    if (r < end)
#pragma unroll
      for (uint32_t w = 0; w < W; w++) o[w] = __ldg(base + (size_t)r * W + w);
  }
  KVP_D void init(const void *recs, uint32_t nrec, uint32_t warp, uint32_t lane) {
    base = (const uint4 *)recs;
    i = b0 = nrec * warp / kAttnWarps, end = nrec * (warp + 1) / kAttnWarps;
    load(cur, b0, lane);
    load(nxt, b0 + 32, lane);
  }
  /* The next record's words into o (every lane); false past the run's end */
  KVP_D bool next(uint32_t lane, uint4 (&o)[W]) {
    if (i >= end) return false;
    if (i - b0 == 32) {
#pragma unroll
      for (uint32_t w = 0; w < W; w++) cur[w] = nxt[w];
      b0 += 32;
      load(nxt, b0 + 32, lane);
    }
    const int src = (int)(i - b0);
#pragma unroll
    for (uint32_t w = 0; w < W; w++)
      o[w] = make_uint4(__shfl_sync(0xFFFFFFFFu, cur[w].x, src), __shfl_sync(0xFFFFFFFFu, cur[w].y, src),
                        __shfl_sync(0xFFFFFFFFu, cur[w].z, src), __shfl_sync(0xFFFFFFFFu, cur[w].w, src));
    i++;
    return true;
  }
};

/* The warp's next record (every lane); false past its run's end */
template <uint32_t W> KVP_D bool rec_next(RecStream<W> &rs, uint32_t lane, Rec &o) {
  uint4 w[W];
  if (!rs.next(lane, w)) return false;
  rec_of(w, o);
  return true;
}

/* d += a b: m16n8k16, bf16 operands, f32 accumulators */
KVP_D void mma16816_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* {lo, hi} as bf16x2 (round to nearest even) */
KVP_D uint32_t bf16x2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

/* N (4, 8 or 16) bytes from global to shared, asynchronously; src_bytes 0
 * writes zeros. 16 bytes go around L1 (.cg, each code read once); 4 and 8
 * (scales, records) only have .ca. */
template <uint32_t N> KVP_D void cp_async(uint32_t dst, const void *src, uint32_t src_bytes) {
  static_assert(N == 4 || N == 8 || N == 16, "cp.async copies 4, 8 or 16 bytes");
  if constexpr (N == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(N), "r"(src_bytes));
}

/* fp16x2 products x s2, one rounding */
KVP_D uint32_t hmul2(uint32_t x, uint32_t s2) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(x), "r"(s2));
  return d;
}
KVP_D void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N> KVP_D void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

/* Tile rows in fp16 (or bf16) per warp and buffer: [kTile][D + 8]. */
template <uint32_t D> __host__ __device__ constexpr uint32_t tile_elems() { return kTile * (D + 8); }

/* The warps' states of the final merge (cta_merge): [warps][8 heads][m, l, acc[D]] f32 */
template <uint32_t D> __host__ __device__ constexpr size_t merge_smem() { return (size_t)kAttnWarps * 8 * (D + 2) * 4; }

template <typename T> __host__ __device__ constexpr T cmax(T a, T b) { return a > b ? a : b; }

/* Dynamic shared memory: per warp NB buffers of a K and a V tile; the
 * merge's states reuse the same bytes once every warp is done. */
template <uint32_t D, uint32_t NB> constexpr size_t attend_smem() {
  return cmax((size_t)kAttnWarps * NB * 2 * tile_elems<D>() * 2, merge_smem<D>());
}

/* Q of query heads gr (< G, else zeros) as the A operand of Q K^T: the
 * rows gr + 8 are zeros. BF: bf16 as given; else rounded to fp16. */
template <uint32_t D, bool BF>
KVP_D void load_q(const AttnArgs &a, uint32_t b, uint32_t h, uint32_t gr, uint32_t qd, uint32_t (&qa)[D / 16][2]) {
  const uint32_t *qr = (const uint32_t *)(a.q + ((size_t)b * a.Hq + h * a.G + (gr < a.G ? gr : 0)) * D);
#pragma unroll
  for (uint32_t k = 0; k < D / 16; k++) {
    uint32_t w0 = gr < a.G ? __ldg(qr + 8 * k + qd) : 0u, w1 = gr < a.G ? __ldg(qr + 8 * k + 4 + qd) : 0u;
    if (BF) {
      qa[k][0] = w0, qa[k][1] = w1;
    } else {
      qa[k][0] = f16x2(bf16_to_f32(w0 & 0xFFFFu), bf16_to_f32(w0 >> 16));
      qa[k][1] = f16x2(bf16_to_f32(w1 & 0xFFFFu), bf16_to_f32(w1 >> 16));
    }
  }
}

/* The online-softmax state of a lane: query head gr's running max (base 2)
 * and its share of the sum; O^T: channels 16 i + gr (+ 8) x query heads
 * 2 qd, 2 qd + 1. */
template <uint32_t D> struct Acc {
  float mx, l, o[D / 16][4];
};

__device__ constexpr float kOnes[4] = {1.0f, 1.0f, 1.0f, 1.0f};

/* The online softmax of one step (n <= 16 tokens) on this lane's scores:
 * s[0] holds tokens 2 qd, 2 qd + 1 of query head gr (columns 0, 1), s[1]
 * the same 8 tokens on. Rescales O^T and returns P^T's B fragment: p0
 * (tokens 2 qd, 2 qd + 1), p1 (8 + those); BF: bf16, with the remainders
 * r0, r1; else fp16 with V's per-token scales vs folded in. ks: K's
 * per-token scales (the scores'). */
template <uint32_t D, bool BF>
KVP_D void softmax_step(const float (&s)[2][4], uint32_t n, float scale_log2, uint32_t qd, Acc<D> &st,
                        const float (&ks)[4], const float (&vs)[4], uint32_t &p0, uint32_t &p1, uint32_t &r0,
                        uint32_t &r1) {
  constexpr uint32_t KS = D / 16;
  float x[4] = {s[0][0] * ks[0] * scale_log2, s[0][1] * ks[1] * scale_log2, s[1][0] * ks[2] * scale_log2,
                s[1][1] * ks[3] * scale_log2};
  const uint32_t tok[4] = {2 * qd, 2 * qd + 1, 8 + 2 * qd, 9 + 2 * qd};
  float tm = -INFINITY;
#pragma unroll
  for (int e = 0; e < 4; e++) {
    if (tok[e] >= n) x[e] = -INFINITY;
    tm = fmaxf(tm, x[e]);
  }
  tm = fmaxf(tm, __shfl_xor_sync(0xFFFFFFFFu, tm, 1));
  tm = fmaxf(tm, __shfl_xor_sync(0xFFFFFFFFu, tm, 2));
  const float mn = fmaxf(st.mx, tm), al = ex2(st.mx - mn); /* mn is finite: row 0 of the step is a token */
  float pr[4];
#pragma unroll
  for (int e = 0; e < 4; e++) pr[e] = ex2(x[e] - mn);
  st.l = fmaf(st.l, al, (pr[0] + pr[1]) + (pr[2] + pr[3]));
  st.mx = mn;
  /* rescale O^T's columns: heads 2 qd and 2 qd + 1 */
  const float a0 = __shfl_sync(0xFFFFFFFFu, al, 8 * qd), a1 = __shfl_sync(0xFFFFFFFFu, al, 8 * qd + 4);
  if (__any_sync(0xFFFFFFFFu, al != 1.0f)) /* a max moved (else the products by 1 change nothing) */
#pragma unroll
    for (uint32_t i = 0; i < KS; i++) st.o[i][0] *= a0, st.o[i][1] *= a1, st.o[i][2] *= a0, st.o[i][3] *= a1;
  r0 = r1 = 0;
  if (BF) {
    p0 = bf16x2(pr[0], pr[1]), p1 = bf16x2(pr[2], pr[3]);
    r0 = bf16x2(pr[0] - bf16_to_f32(p0 & 0xFFFFu), pr[1] - bf16_to_f32(p0 >> 16));
    r1 = bf16x2(pr[2] - bf16_to_f32(p1 & 0xFFFFu), pr[3] - bf16_to_f32(p1 >> 16));
  } else {
    p0 = f16x2(pr[0] * vs[0], pr[1] * vs[1]), p1 = f16x2(pr[2] * vs[2], pr[3] * vs[3]);
  }
}

/* One step over the warp's tiles (k_addr, v_addr: this lane's ldmatrix row
 * in them) of n <= 16 tokens. BF: bf16 tiles, P split into a bf16 value and
 * its bf16 remainder (two products: P to 2^-16); else fp16 tiles and P.
 * ks, vs: per-token scales of this lane's tokens (2 qd, 2 qd + 1, 8 + those)
 * that the tiles leave out: K's multiply the scores, V's the probabilities
 * as the product takes them (the sum of the softmax is of the unscaled). */
template <uint32_t D, bool BF>
KVP_D void tile_step(const uint32_t (&qa)[D / 16][2], uint32_t k_addr, uint32_t v_addr, uint32_t n, float scale_log2,
                     uint32_t qd, Acc<D> &st, const float (&ks)[4] = kOnes, const float (&vs)[4] = kOnes) {
  constexpr uint32_t KS = D / 16;
  /* S = Q K^T: tokens 2 qd, 2 qd + 1 (s[0]) and 8 + those (s[1]) of head gr */
  float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
  for (uint32_t k = 0; k < KS; k++) {
    uint32_t kb[4];
    ldsm_x4(kb, k_addr + k * 32);
    const uint32_t qk[4] = {qa[k][0], 0u, qa[k][1], 0u};
    if (BF) mma16816_bf16(s[0], qk, kb[0], kb[1]), mma16816_bf16(s[1], qk, kb[2], kb[3]);
    else mma16816(s[0], qk, kb[0], kb[1]), mma16816(s[1], qk, kb[2], kb[3]);
  }
  /* O^T += V^T P^T: P^T's B fragment is this lane's probabilities */
  uint32_t p0, p1, r0, r1;
  softmax_step<D, BF>(s, n, scale_log2, qd, st, ks, vs, p0, p1, r0, r1);
#pragma unroll
  for (uint32_t i = 0; i < KS; i++) {
    uint32_t va[4]; /* V^T's A fragment: tokens 0-7 / 8-15 x channels 16 i + (0-7 / 8-15) */
    ldsm_x4_t(va, v_addr + i * 32);
    if (BF) mma16816_bf16(st.o[i], va, p0, p1), mma16816_bf16(st.o[i], va, r0, r1);
    else mma16816(st.o[i], va, p0, p1);
  }
}

/* attend_reg_kernel's O^T rows: channel of accumulator o[i][e] of lane gr */
template <uint32_t D> KVP_D uint32_t r8_channel(uint32_t gr, uint32_t i, uint32_t e) {
  return gr * (D / 8) + 2 * i + (e & 2u ? 1u : 0u);
}

/* The CTA's warps' states merged (log-sum-exp) into the output, or into
 * the split's partial records. smem: the tiles' bytes, free once every
 * warp passed the barrier at the top. */
template <uint32_t D, bool R8 = false>
KVP_D void cta_merge(const AttnArgs &a, const kvp__asplit &sp, Acc<D> &st, unsigned char *smem) {
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, qd = lane % 4, gr = lane / 4, G = a.G;
  const uint32_t b = sp.bh / a.Hkv, h = sp.bh % a.Hkv;
  st.l += __shfl_xor_sync(0xFFFFFFFFu, st.l, 1);
  st.l += __shfl_xor_sync(0xFFFFFFFFu, st.l, 2);
  __syncthreads(); /* every warp is done with its tiles */
  float *sm = (float *)smem;
  float *wst = sm + (size_t)warp * 8 * (D + 2); /* [8 heads][m, l, acc[D]] */
  if (qd == 0 && gr < G) wst[gr * (D + 2)] = st.mx, wst[gr * (D + 2) + 1] = st.l;
#pragma unroll
  for (uint32_t i = 0; i < D / 16; i++)
#pragma unroll
    for (uint32_t e = 0; e < 4; e++) {
      uint32_t hd = 2 * qd + (e & 1u), ch = R8 ? r8_channel<D>(gr, i, e) : 16 * i + gr + (e & 2u ? 8 : 0);
      if (hd < G) wst[hd * (D + 2) + 2 + ch] = st.o[i][e];
    }
  __syncthreads();
  for (uint32_t i = threadIdx.x; i < G * D; i += kAttnThreads) {
    uint32_t g = i / D, d = i % D;
    float M = -INFINITY;
    for (uint32_t w = 0; w < kAttnWarps; w++) M = fmaxf(M, sm[(w * 8 + g) * (D + 2)]);
    float L = 0.0f, A = 0.0f;
    if (M != -INFINITY)
      for (uint32_t w = 0; w < kAttnWarps; w++) {
        const float *ws = sm + (w * 8 + g) * (D + 2);
        float f = ws[0] == -INFINITY ? 0.0f : ex2(ws[0] - M);
        L = fmaf(ws[1], f, L);
        A = fmaf(ws[2 + d], f, A);
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

template <uint32_t D> KVP_D void acc_init(Acc<D> &st) {
  st.mx = -INFINITY, st.l = 0.0f;
#pragma unroll
  for (uint32_t i = 0; i < D / 16; i++) st.o[i][0] = st.o[i][1] = st.o[i][2] = st.o[i][3] = 0.0f;
}

/* 4 fp8 e4m3 or int8 codes (one word) as two fp16x2 words, exactly (no
 * scale): e4m3 bits moved into fp16's (exponent bias 15 against 7, so the
 * fp16 is 2^-8 of the value) times 256; int8 as 1152 + x (fp16 bits 0x6400
 * | (x + 128)) less 1152. */
template <uint32_t C> KVP_D void codes4_f16(uint32_t w, uint32_t &lo, uint32_t &hi) {
#pragma unroll
  for (int k = 0; k < 2; k++) {
    uint32_t u = __byte_perm(w, 0u, k ? 0x4342u : 0x4140u), h; /* bytes 2k, 2k + 1 in the low bytes of the halves */
    if (C == KVP__K_FP8) {
      h = hmul2((u & 0x007F007Fu) << 7 | (u & 0x00800080u) << 8, 0x5C005C00u); /* 256 */
    } else {
      u = (u ^ 0x00800080u) | 0x64006400u;
      asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h) : "r"(u), "r"(0x64806480u)); /* 1152 */
    }
    (k ? hi : lo) = h;
  }
}

/* The per-token scale of row t of an fp8 or int8 page (the codec's decode
 * multiplies by it; here the scores and the probabilities do). */
template <uint32_t C> KVP_D float row_scale(const kvp__kparams &p, const uint8_t *scales, uint32_t t) {
  if (C == KVP__K_FP8) return p.fp8_dynamic ? __ldg((const float *)scales + t) : p.fp8_static_scale;
  return bf16_to_f32(__ldg((const unsigned short *)scales + t));
}

} // namespace kvpk
