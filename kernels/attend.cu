/*
 * kernels/attend.cu - decode attention over kvpool's pages: one query token
 * per (sequence, query head) against the tokens each KV head retains,
 * dequantized on chip from the codes (no bf16 copy of the cache in memory).
 *
 * The host (pages/attend.c) walks the page tables and hands a table of
 * splits: a split is a run of block records (kvp__gjob, one per retained
 * token range of one block and head) of one (sequence, KV head). One CTA of
 * kAttnThreads runs one split for the G = n_q_heads / n_kv_heads query
 * heads that share the KV head (GQA: each K/V row is read once for all G).
 *
 * Each warp takes records of the split (attend_bf16_kernel and
 * attend_reg_kernel: a contiguous run, read 32 at a time by RecStream, so
 * the table may stay in pinned host memory; the others: every fourth, the
 * next one's fields loaded while the current one runs) and walks a record
 * 16 tokens at a time; the layer's bindings pick one of the kernels below:
 *   - raw bf16 pages (attend_bf16_kernel): the rows go to shared memory by
 *     cp.async one step ahead and enter the products as they are;
 *   - fp8, int8, nvfp4 and kivi (one width, per-channel K, per-token V) on
 *     both sides at head_dim 64 and 128 (attend_reg_kernel): the codes go
 *     from global memory straight into the registers of the matrix
 *     fragments one step ahead (see its comment);
 *   - fp8, int8, nvfp4 on both sides at head_dim 32 and 256
 *     (attend_q_kernel): the code rows go to shared memory by cp.async one
 *     step ahead, then to fp16 tiles (fp8 and int8: the codes exactly,
 *     their per-token scales applied to the scores and the probabilities;
 *     nvfp4: the codec's row8s reader);
 *   - any other (attend_kernel): the codec's <codec>_row8 reader (8
 *     elements of a row, the host decode's f32 bit for bit) fills fp16
 *     tiles straight from the pages.
 * Tiles are [16][D + 8] (padded rows, so the matrix loads hit distinct
 * banks), rows past the record's end zeros. Then, per step:
 *   1. scores S = Q K^T on the tensor cores (mma m16n8k16, f32
 *      accumulate): rows are the G query heads (the 16 - G others zero),
 *      columns the 16 tokens;
 *   2. online softmax in base 2 per query head (scores pre-scaled by
 *      scale * log2(e)); the probabilities are already in the layout of the
 *      B operand of
 *   3. O^T += V^T P^T (mma, M = 16 channels, N = 8 query heads, K = the 16
 *      tokens), so no shuffle moves P between the two products.
 * The warps' states merge at the end (log-sum-exp), into the output when the
 * split is its (sequence, KV head)'s only one, else into a partial record
 * [max, sum, acc[D]] per query head that attend_reduce merges
 * (flash-decoding: one long sequence spreads over many CTAs).
 *
 * Precision: raw bf16 pages and Q enter the products as bf16, exactly,
 * with P as a bf16 value plus its bf16 remainder; every other page as fp16
 * (10-bit mantissa: fp16 pages and fp8/int8 codes exactly, the other
 * codecs' decoded values and fp32 pages within 2^-11 relative; magnitudes
 * past fp16's 65504 are not supported) with Q and P in fp16. Every sum is
 * f32, exp2 by ex2.approx (2 ulp).
 */
#include <cuda_runtime.h>
#include <string.h>

#include "common.cuh"
#include "fp8.cuh"
#include "int8.cuh"
#include "kivi.cuh"
#include "nvfp4.cuh"
#include "raw.cuh"

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

/* Rows 0 .. n - 1 (n <= 16) of a step of one side into tile [16][D + 8]
 * fp16, rows n .. 15 zeros; row(r, c, x) gives elements [8c, 8c + 8) of row
 * r in f32. Every lane converts 8 elements of 16 / (32 / (D / 8)) rows,
 * every row before the first store (the loads in flight together); past
 * the end it reads row n - 1 again (a valid row) and stores zeros. */
template <uint32_t D, typename R> KVP_D void tile_fill(R row, uint32_t n, uint32_t lane, uint16_t *tile) {
  constexpr uint32_t TPT = D / 8, RPP = 32 / TPT, NP = kTile / RPP;
  const uint32_t c = lane % TPT, r0 = lane / TPT;
  uint4 w[NP];
#pragma unroll
  for (uint32_t i = 0; i < NP; i++) {
    float x[8];
    row(min(i * RPP + r0, n - 1), c, x);
    w[i] = make_uint4(f16x2(x[0], x[1]), f16x2(x[2], x[3]), f16x2(x[4], x[5]), f16x2(x[6], x[7]));
  }
#pragma unroll
  for (uint32_t i = 0; i < NP; i++) {
    uint32_t r = i * RPP + r0;
    *(uint4 *)(tile + r * (D + 8) + 8 * c) = r < n ? w[i] : make_uint4(0, 0, 0, 0);
  }
}

/* The rows t0 .. t0 + n - 1 of a block, by a codec's row8 reader */
template <uint32_t D, typename F>
KVP_D void tile_decode(F fn, const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, uint32_t t0,
                       uint32_t n, uint32_t lane, uint16_t *tile) {
  tile_fill<D>([&](uint32_t r, uint32_t c, float(&x)[8]) { fn(p, pg, cap, t0 + r, c, x); }, n, lane, tile);
}

/* attend_kernel's C for a layer of every codec (else KVP__K_RAW: raw
 * fp16/fp32 pages, fewer registers) */
constexpr uint32_t kAnyCodec = 0xFFu;

template <uint32_t D, uint32_t C>
KVP_D void side_decode(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, uint32_t t0, uint32_t n,
                       uint32_t lane, uint16_t *tile) {
  if (C == KVP__K_RAW || p.codec == KVP__K_RAW) {
    if (p.store_dtype == kBF16) tile_decode<D>(raw_row8<kBF16>, p, pg, cap, t0, n, lane, tile);
    else if (p.store_dtype == kF16) tile_decode<D>(raw_row8<kF16>, p, pg, cap, t0, n, lane, tile);
    else tile_decode<D>(raw_row8<kF32>, p, pg, cap, t0, n, lane, tile);
    return;
  }
  switch (p.codec) {
  case KVP__K_FP8:
    if (p.fp8_dynamic) tile_decode<D>(fp8_row8<true>, p, pg, cap, t0, n, lane, tile);
    else tile_decode<D>(fp8_row8<false>, p, pg, cap, t0, n, lane, tile);
    break;
  case KVP__K_INT8: tile_decode<D>(int8_row8, p, pg, cap, t0, n, lane, tile); break;
  case KVP__K_KIVI:
    if (p.kivi_bits == 2 && p.kivi_kv == 0) tile_decode<D>(kivi_row8<2, 0>, p, pg, cap, t0, n, lane, tile);
    else if (p.kivi_bits == 2) tile_decode<D>(kivi_row8<2, 1>, p, pg, cap, t0, n, lane, tile);
    else if (p.kivi_kv == 0) tile_decode<D>(kivi_row8<4, 0>, p, pg, cap, t0, n, lane, tile);
    else tile_decode<D>(kivi_row8<4, 1>, p, pg, cap, t0, n, lane, tile);
    break;
  default:
    if (p.nvfp4_ksmooth) tile_decode<D>(nvfp4_row8<true>, p, pg, cap, t0, n, lane, tile);
    else tile_decode<D>(nvfp4_row8<false>, p, pg, cap, t0, n, lane, tile);
    break;
  }
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

/* 16 bytes from global to shared, asynchronously; src_bytes 0 writes zeros */
KVP_D void cp_async16(uint32_t dst, const void *src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes));
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

/* Any codec: each step's rows decoded (the codec's row8 reader) into fp16
 * tiles, one buffer per warp. C: KVP__K_RAW when every binding is raw
 * (fewer registers), else kAnyCodec. */
template <uint32_t D, uint32_t C>
__global__ void __launch_bounds__(kAttnThreads) attend_kernel(const __grid_constant__ AttnArgs a) {
  constexpr uint32_t LD = D + 8; /* tile row, in elements */
  extern __shared__ __align__(16) unsigned char smem[];
  const kvp__asplit sp = a.splits[blockIdx.x];
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, qd = lane % 4, gr = lane / 4;
  uint16_t *kt = (uint16_t *)smem + (size_t)warp * 2 * tile_elems<D>(), *vt = kt + tile_elems<D>();
  uint32_t qa[D / 16][2];
  load_q<D, false>(a, sp.bh / a.Hkv, sp.bh % a.Hkv, gr, qd, qa);
  Acc<D> st;
  acc_init(st);
  const uint32_t j = lane / 8, rr = lane % 8; /* ldmatrix: this lane's row of its 8x8 matrix */
  const uint32_t k_addr = smem_addr(kt + ((j / 2) * 8 + rr) * LD + (j % 2) * 8);
  const uint32_t v_addr = smem_addr(vt + ((j / 2) * 8 + rr) * LD + (j % 2) * 8);

  const kvp__gjob *recs = (const kvp__gjob *)a.recs + sp.rec0;
  Rec cur = {}, nxt = {};
  if (warp < sp.nrec) rec_load(&recs[warp], cur);
  for (uint32_t r = warp; r < sp.nrec; r += kAttnWarps) {
    if (r + kAttnWarps < sp.nrec) rec_load(&recs[r + kAttnWarps], nxt);
    const uint8_t *kpg[4], *vpg[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
      kpg[i] = cur.page[0][i] == KVP__GJOB_NO_PAGE ? nullptr : (const uint8_t *)a.base + (uint64_t)cur.page[0][i] * 64;
      vpg[i] = cur.page[1][i] == KVP__GJOB_NO_PAGE ? nullptr : (const uint8_t *)a.base + (uint64_t)cur.page[1][i] * 64;
    }
    const kvp__kparams &kp = a.p[cur.tag & 1u], &vp = a.p[2 + (cur.tag & 1u)];
    for (uint32_t ib = 0; ib < cur.m; ib += kTile) {
      const uint32_t n = min(kTile, cur.m - ib);
      __syncwarp(); /* the previous step's matrix loads are done with the tiles */
      side_decode<D, C>(kp, kpg, cur.cap, cur.t0 + ib, n, lane, kt);
      side_decode<D, C>(vp, vpg, cur.cap, cur.t0 + ib, n, lane, vt);
      __syncwarp();
      tile_step<D, false>(qa, k_addr, v_addr, n, a.scale_log2, qd, st);
    }
    cur = nxt;
  }
  cta_merge<D>(a, sp, st, smem);
}

/* Raw bf16 pages (every binding): the rows go to shared memory as they
 * are, by cp.async, one step ahead (two buffers per warp), and the
 * products read them in bf16. */
template <uint32_t D>
__global__ void __launch_bounds__(kAttnThreads) attend_bf16_kernel(const __grid_constant__ AttnArgs a) {
  constexpr uint32_t LD = D + 8, TE = tile_elems<D>();
  constexpr uint32_t TPT = D / 8, RPP = 32 / TPT, NP = kTile / RPP; /* 16-byte chunks per row, rows per pass */
  extern __shared__ __align__(16) unsigned char smem[];
  const kvp__asplit sp = a.splits[blockIdx.x];
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, qd = lane % 4, gr = lane / 4;
  uint16_t *wt = (uint16_t *)smem + (size_t)warp * 4 * TE; /* [buffer][K, V] tiles */
  uint32_t qa[D / 16][2];
  load_q<D, true>(a, sp.bh / a.Hkv, sp.bh % a.Hkv, gr, qd, qa);
  Acc<D> st;
  acc_init(st);
  const uint32_t j = lane / 8, rr = lane % 8;
  const uint32_t lds0 = smem_addr(wt + ((j / 2) * 8 + rr) * LD + (j % 2) * 8); /* buffer 0's K tile */
  const uint32_t c = lane % TPT, rw = lane / TPT;                          /* cp.async: chunk, first row */
  const uint32_t cpa0 = smem_addr(wt + rw * LD + 8 * c);

  /* the issue side: record fr (have: one is left), its next step at fib */
  RecStream<1> rs;
  rs.init((const kvp__arec_raw *)a.recs + sp.rec0, sp.nrec, warp, lane);
  uint32_t fib = 0;
  Rec fr = {};
  bool have = rec_next(rs, lane, fr);
  auto issue = [&](uint32_t buf) -> uint32_t { /* the step at (fr, fib) into buf: its token count */
    const uint32_t n = min(kTile, fr.m - fib);
#pragma unroll
    for (uint32_t kv = 0; kv < 2; kv++) {
      const char *pg = a.base + (uint64_t)fr.page[kv][0] * 64 + ((size_t)(fr.t0 + fib) * D + 8 * c) * 2;
#pragma unroll
      for (uint32_t i = 0; i < NP; i++) {
        const uint32_t r = i * RPP + rw;
        cp_async16(cpa0 + (buf * 2 + kv) * TE * 2 + i * RPP * LD * 2, pg + (size_t)min(r, n - 1) * D * 2,
                   r < n ? 16u : 0u);
      }
    }
    cp_async_commit();
    fib += kTile;
    if (fib >= fr.m) fib = 0, have = rec_next(rs, lane, fr); /* on to the warp's next record */
    return n;
  };
  uint32_t buf = 0, n = have ? issue(0) : 0;
  while (n) {
    const uint32_t nn = have ? issue(buf ^ 1u) : 0;
    if (nn) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncwarp();
    const uint32_t ka = lds0 + buf * 2 * TE * 2;
    tile_step<D, true>(qa, ka, ka + TE * 2, n, a.scale_log2, qd, st);
    __syncwarp(); /* done with buf before the step after next fills it */
    buf ^= 1u, n = nn;
  }
  cta_merge<D>(a, sp, st, smem);
}

/* fp8, int8 and nvfp4 pages (K and V of one codec): each step's code rows
 * go to shared memory by cp.async one step ahead (two buffers per warp).
 * fp8 and int8 codes become fp16 exactly and their per-token scales
 * (loaded when the step is issued) multiply the scores and the
 * probabilities: the products see fl(q K) s instead of q fl(K s), the same
 * within fp16's rounding. nvfp4 (scales along the channels): the codec's
 * row8s reader turns the rows into the tile. A RAW tail record (an open
 * stream block) is read from its page directly. */
template <uint32_t C> __host__ __device__ constexpr uint32_t code_row_bytes(uint32_t D) {
  return C == KVP__K_NVFP4 ? D / 2 : D;
}

template <uint32_t D, uint32_t C> __host__ __device__ constexpr size_t attend_q_smem() {
  return cmax((size_t)kAttnWarps * (2 * 2 * kTile * code_row_bytes<C>(D) + 2 * tile_elems<D>() * 2), merge_smem<D>());
}

/* The rows t0 .. t0 + n - 1 of a block, by a codec's row8s reader from
 * their copy in stage (rb bytes a row) */
template <uint32_t D, typename F>
KVP_D void staged_decode(F fn, const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap,
                         const uint8_t *stage, uint32_t rb, uint32_t t0, uint32_t n, uint32_t lane, uint16_t *tile) {
  tile_fill<D>([&](uint32_t r, uint32_t c, float(&x)[8]) { fn(p, pg, cap, stage + r * rb, t0 + r, c, x); }, n, lane,
               tile);
}

template <uint32_t D, uint32_t C>
KVP_D void staged_side(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, const uint8_t *stage,
                       uint32_t t0, uint32_t n, uint32_t lane, uint16_t *tile) {
  constexpr uint32_t RB = code_row_bytes<C>(D);
  if (C == KVP__K_FP8) {
    if (p.fp8_dynamic) staged_decode<D>(fp8_row8s<true>, p, pg, cap, stage, RB, t0, n, lane, tile);
    else staged_decode<D>(fp8_row8s<false>, p, pg, cap, stage, RB, t0, n, lane, tile);
  } else if (C == KVP__K_INT8) {
    staged_decode<D>(int8_row8s, p, pg, cap, stage, RB, t0, n, lane, tile);
  } else {
    if (p.nvfp4_ksmooth) staged_decode<D>(nvfp4_row8s<true>, p, pg, cap, stage, RB, t0, n, lane, tile);
    else staged_decode<D>(nvfp4_row8s<false>, p, pg, cap, stage, RB, t0, n, lane, tile);
  }
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
      u = (u & 0x007F007Fu) << 7 | (u & 0x00800080u) << 8;
      asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(h) : "r"(u), "r"(0x5C005C00u)); /* 256 */
    } else {
      u = (u ^ 0x00800080u) | 0x64006400u;
      asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(h) : "r"(u), "r"(0x64806480u)); /* 1152 */
    }
    (k ? hi : lo) = h;
  }
}

/* fp8 and int8 code rows (no scale) from the stage into the fp16 tile;
 * rows n .. 15 zeros. */
template <uint32_t D, uint32_t C>
KVP_D void codes_decode(const uint8_t *stage, uint32_t n, uint32_t lane, uint16_t *tile) {
  constexpr uint32_t TPT = D / 8, RPP = 32 / TPT, NP = kTile / RPP;
  const uint32_t c = lane % TPT, r0 = lane / TPT;
#pragma unroll
  for (uint32_t i = 0; i < NP; i++) {
    const uint32_t r = i * RPP + r0;
    const uint2 q = *(const uint2 *)(stage + r * D + 8 * c);
    uint4 w;
    codes4_f16<C>(q.x, w.x, w.y);
    codes4_f16<C>(q.y, w.z, w.w);
    *(uint4 *)(tile + r * (D + 8) + 8 * c) = r < n ? w : make_uint4(0, 0, 0, 0);
  }
}

/* The per-token scale of row t of an fp8 or int8 page (the codec's decode
 * multiplies by it; here the scores and the probabilities do). */
template <uint32_t C> KVP_D float row_scale(const kvp__kparams &p, const uint8_t *scales, uint32_t t) {
  if (C == KVP__K_FP8) return p.fp8_dynamic ? __ldg((const float *)scales + t) : p.fp8_static_scale;
  return bf16_to_f32(__ldg((const unsigned short *)scales + t));
}

/* A step of a warp: its record and first row in it, its token count, and
 * (fp8, int8) the scales of this lane's tokens */
struct Step {
  Rec r;
  uint32_t ib, n;
  float ks[4], vs[4];
};

KVP_D void rec_pages(const char *base, const Rec &r, int kv, const uint8_t *(&pg)[4]) {
#pragma unroll
  for (int i = 0; i < 4; i++)
    pg[i] = r.page[kv][i] == KVP__GJOB_NO_PAGE ? nullptr : (const uint8_t *)base + (uint64_t)r.page[kv][i] * 64;
}

template <uint32_t D, uint32_t C>
__global__ void __launch_bounds__(kAttnThreads, C == KVP__K_NVFP4 ? 2 : 3)
    attend_q_kernel(const __grid_constant__ AttnArgs a) {
  constexpr uint32_t LD = D + 8, TE = tile_elems<D>(), RB = code_row_bytes<C>(D), SB = kTile * RB;
  constexpr uint32_t CPR = RB / 16; /* 16-byte chunks per code row */
  /* fp8, int8: the tiles hold the codes (exact in fp16), the per-token scales apply after the products */
  constexpr bool kFold = C == KVP__K_FP8 || C == KVP__K_INT8;
  extern __shared__ __align__(16) unsigned char smem[];
  const kvp__asplit sp = a.splits[blockIdx.x];
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, qd = lane % 4, gr = lane / 4;
  unsigned char *ws = smem + (size_t)warp * (4 * SB + 2 * TE * 2); /* [buffer][K, V] code rows, then the tiles */
  uint16_t *kt = (uint16_t *)(ws + 4 * SB), *vt = kt + TE;
  uint32_t qa[D / 16][2];
  load_q<D, false>(a, sp.bh / a.Hkv, sp.bh % a.Hkv, gr, qd, qa);
  Acc<D> st;
  acc_init(st);
  const uint32_t j = lane / 8, rr = lane % 8;
  const uint32_t k_addr = smem_addr(kt + ((j / 2) * 8 + rr) * LD + (j % 2) * 8);
  const uint32_t v_addr = smem_addr(vt + ((j / 2) * 8 + rr) * LD + (j % 2) * 8);
  const uint32_t stage0 = smem_addr(ws);

  const kvp__arec_q *recs = (const kvp__arec_q *)a.recs + sp.rec0;
  uint32_t ri = warp, fib = 0;
  Rec fr = {}, fnx = {};
  if (ri < sp.nrec) rec_load(&recs[ri], fr);
  if (ri + kAttnWarps < sp.nrec) rec_load(&recs[ri + kAttnWarps], fnx);
  auto issue = [&](uint32_t buf, Step &o) { /* the step at (fr, fib): its code rows into buf */
    o.r = fr, o.ib = fib, o.n = min(kTile, fr.m - fib);
#pragma unroll
    for (int e = 0; e < 4; e++) o.ks[e] = o.vs[e] = 1.0f;
    if (kFold && !(fr.tag & 1u)) {
      const uint8_t *ksc = (const uint8_t *)a.base + (uint64_t)fr.page[0][1] * 64,
                    *vsc = (const uint8_t *)a.base + (uint64_t)fr.page[1][1] * 64;
      const uint32_t tok[4] = {2 * qd, 2 * qd + 1, 8 + 2 * qd, 9 + 2 * qd};
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const uint32_t t = fr.t0 + fib + min(tok[e], o.n - 1);
        o.ks[e] = row_scale<C>(a.p[0], ksc, t), o.vs[e] = row_scale<C>(a.p[2], vsc, t);
      }
    }
    if (!(fr.tag & 1u)) {
#pragma unroll
      for (uint32_t kv = 0; kv < 2; kv++) {
        const char *pg = a.base + (uint64_t)fr.page[kv][0] * 64 + (size_t)(fr.t0 + fib) * RB;
        for (uint32_t i = lane; i < kTile * CPR; i += 32) {
          const uint32_t r = i / CPR, cc = i % CPR;
          cp_async16(stage0 + (buf * 2 + kv) * SB + r * RB + cc * 16, pg + (size_t)min(r, o.n - 1) * RB + cc * 16,
                     r < o.n ? 16u : 0u);
        }
      }
    }
    cp_async_commit();
    fib += kTile;
    if (fib >= fr.m) {
      ri += kAttnWarps, fib = 0, fr = fnx;
      if (ri + kAttnWarps < sp.nrec) rec_load(&recs[ri + kAttnWarps], fnx);
    }
  };
  Step cur = {}, nxt = {};
  uint32_t buf = 0;
  bool has = ri < sp.nrec;
  if (has) issue(0, cur);
  while (has) {
    const bool hn = ri < sp.nrec;
    if (hn) issue(buf ^ 1u, nxt);
    if (hn) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncwarp();
    const uint8_t *kpg[4], *vpg[4];
    rec_pages(a.base, cur.r, 0, kpg);
    rec_pages(a.base, cur.r, 1, vpg);
    const uint32_t t = cur.r.t0 + cur.ib;
    if (cur.r.tag & 1u) {
      side_decode<D, KVP__K_RAW>(a.p[1], kpg, cur.r.cap, t, cur.n, lane, kt);
      side_decode<D, KVP__K_RAW>(a.p[3], vpg, cur.r.cap, t, cur.n, lane, vt);
    } else {
      if (kFold) {
        codes_decode<D, C>(ws + buf * 2 * SB, cur.n, lane, kt);
        codes_decode<D, C>(ws + (buf * 2 + 1) * SB, cur.n, lane, vt);
      } else {
        staged_side<D, C>(a.p[0], kpg, cur.r.cap, ws + buf * 2 * SB, t, cur.n, lane, kt);
        staged_side<D, C>(a.p[2], vpg, cur.r.cap, ws + (buf * 2 + 1) * SB, t, cur.n, lane, vt);
      }
    }
    __syncwarp();
    tile_step<D, false>(qa, k_addr, v_addr, cur.n, a.scale_log2, qd, st, cur.ks, cur.vs);
    __syncwarp(); /* the tiles and buf are free */
    cur = nxt, has = hn, buf ^= 1u;
  }
  cta_merge<D>(a, sp, st, smem);
}

/* fp8, int8 and nvfp4 pages at head_dim 64 and 128 (K and V of one codec):
 * the codes go from global memory straight into the registers of the
 * matrix fragments, one step ahead (no shared-memory tiles: the bytes a
 * step reads are the bytes the codes take). Each product uses its own
 * order of the channels, which a dot product does not see:
 *   - Q K^T: lane (gr, qd) holds channels [qd D/4, (qd + 1) D/4) of Q's
 *     row gr and of token gr of each 8-token half, and k-step k takes
 *     channels qd D/4 + 4k .. + 3 as its k-indices 2 qd, 2 qd + 1, 8 + 2 qd,
 *     9 + 2 qd (A's and B's alike): one load covers a lane's whole share;
 *   - V^T P^T: rows gr and 8 + gr of k-step i are channels gr D/8 + 2i and
 *     gr D/8 + 2i + 1 (r8_channel), so lane (gr, qd) reads channels
 *     [gr D/8, (gr + 1) D/8) of its tokens 2 qd, 2 qd + 1, 8 + 2 qd, 9 + 2 qd,
 *     and a byte permute pairs two tokens' codes of one channel.
 * fp8 and int8 codes become fp16 exactly (codes4_f16); their per-token
 * scales multiply the scores and the probabilities as in attend_q_kernel.
 * nvfp4: an E2M1 code times its E4M3 group scale is exact in fp16 (at most
 * 6 significant bits, 2^-10 .. 2688), so the fragments hold e s exactly and
 * the block's g multiplies the scores and the probabilities; with K
 * smoothing (KSM) the score of token t gains mean_t sum(q). Rows past a
 * step's end read its last row again (a valid one) and weigh 0. A RAW tail
 * record is read element by element at its turn (one block per
 * (sequence, head) at most). */
/* attend_reg_kernel's C beside the codec ids: kivi with per-channel K and
 * per-token V of 2 or 4 bits */
constexpr uint32_t kKivi2 = 0x102u, kKivi4 = 0x104u;

template <uint32_t C> __host__ __device__ constexpr uint32_t reg_code_bits() {
  return C == KVP__K_NVFP4 ? 4 : C == kKivi2 ? 2 : C == kKivi4 ? 4 : 8;
}
template <uint32_t C> __host__ __device__ constexpr bool reg_kivi() { return C == kKivi2 || C == kKivi4; }

template <uint32_t D, uint32_t C> struct RegStep {
  static constexpr uint32_t KW = D * reg_code_bits<C>() / 128;
  static constexpr uint32_t VW = D * reg_code_bits<C>() / 256 ? D * reg_code_bits<C>() / 256 : 1;
  uint32_t k[2][KW];  /* group j: token 8 j + gr, channels [qd D/4, (qd + 1) D/4) */
  uint32_t v[4][VW];  /* tokens 2 qd, 2 qd + 1, 8 + 2 qd, 9 + 2 qd: channels [gr D/8, (gr + 1) D/8) */
  float ks[4], vs[4]; /* fp8, int8: the per-token scales of tokens 2 qd, 2 qd + 1, 8 + 2 qd, 9 + 2 qd;
                         nvfp4: K's and V's g (all four alike); with KSM ks holds those tokens' K means */
  uint32_t kg[2];     /* nvfp4: the E4M3 scales of group j's K channels (D = 128: two groups, byte each) */
  uint32_t vg;        /* nvfp4: the E4M3 scales of the four V tokens, a byte each */
  float gk;           /* nvfp4: K's g */
  uint32_t vr[4];     /* kivi: the four V tokens' records (fp16 scale, fp16 min) */
  uint32_t buf;       /* kivi: the warp's stage buffer holding the step's K group records */
  const uint8_t *tk, *tv; /* a RAW tail's K and V rows (tk != NULL), first row of the step */
  uint32_t n;             /* tokens, 0: no step */
};

/* 16 bytes, not kept in L1 (each code is read once) */
KVP_D uint4 ld_stream16(const void *p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

/* WORDS 32-bit words at p (aligned to 16 bytes when WORDS >= 4, else to
 * 4 WORDS) */
template <uint32_t WORDS> KVP_D void ld_words(const uint8_t *p, uint32_t *w) {
  if constexpr (WORDS >= 4) {
#pragma unroll
    for (uint32_t i = 0; i < WORDS / 4; i++) {
      const uint4 x = ld_stream16(p + 16 * i);
      w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
    }
  } else if constexpr (WORDS == 2) {
    const uint2 x = __ldg((const uint2 *)p);
    w[0] = x.x, w[1] = x.y;
  } else {
    w[0] = __ldg((const uint32_t *)p);
  }
}

/* Four fp8 or int8 codes (bytes of w) as two fp16x2 words, exactly */
template <uint32_t C> KVP_D void codes4_f16_fast(uint32_t w, uint32_t &lo, uint32_t &hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (C == KVP__K_FP8) {
    asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
        : "=r"(lo), "=r"(hi)
        : "r"(w));
    return;
  }
#endif
  codes4_f16<C>(w, lo, hi);
}

/* Two E2M1 codes, the nibbles at bits 0-3 (low half) and HI-HI+3 (high
 * half) of w, as fp16x2 times the fp16x2 scales s2, exactly: sign and
 * magnitude bits moved into fp16's (2^-14 of the value; the two fields
 * never overlap in the products, so no carry reaches the masks), times
 * 2^14, times s2. */
template <uint32_t HI> KVP_D uint32_t e2m1x2_f16(uint32_t w, uint32_t s2) {
  const uint32_t mag = ((w & (0x7u | 0x7u << HI)) * ((1u << 9) | (1u << (25 - HI)))) & 0x0E000E00u;
  const uint32_t sgn = ((w & (0x8u | 0x8u << HI)) * ((1u << 12) | (1u << (28 - HI)))) & 0x80008000u;
  uint32_t h = mag | sgn;
  asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(h) : "r"(0x74007400u)); /* 2^14 */
  asm("mul.rn.f16x2 %0, %0, %1;" : "+r"(h) : "r"(s2));
  return h;
}

/* Two kivi codes (the low KB bits of lo and of hi) as fp16x2, exactly:
 * 1024 + c in fp16's bits, less 1024 */
template <uint32_t KB> KVP_D uint32_t kivi_codes2_f16(uint32_t lo, uint32_t hi) {
  constexpr uint32_t Q = (1u << KB) - 1;
  uint32_t h = (lo & Q) | (hi & Q) << 16 | 0x64006400u;
  asm("sub.rn.f16x2 %0, %0, %1;" : "+r"(h) : "r"(0x64006400u));
  return h;
}

/* c s + m, fp16x2, one rounding */
KVP_D uint32_t kivi_fma_f16(uint32_t c, uint32_t s, uint32_t m) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(c), "r"(s), "r"(m));
  return d;
}

/* {lo, hi} E4M3 codes as fp16x2 (exact) */
KVP_D uint32_t e4m3x2_f16(uint32_t lo, uint32_t hi) { return f16x2(fp8_to_f32(lo & 0xFFu), fp8_to_f32(hi & 0xFFu)); }

template <uint32_t D, uint32_t C, bool KSM>
__global__ void __launch_bounds__(kAttnThreads, 2) attend_reg_kernel(const __grid_constant__ AttnArgs a) {
  using Step = RegStep<D, C>;
  constexpr uint32_t KS = D / 16, KW = Step::KW, VW = Step::VW;
  constexpr bool FP4 = C == KVP__K_NVFP4, KIVI = reg_kivi<C>();
  constexpr uint32_t KB = reg_code_bits<C>();
  extern __shared__ __align__(16) unsigned char smem[];
  const kvp__asplit sp = a.splits[blockIdx.x];
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, qd = lane % 4, gr = lane / 4;
  const uint32_t b = sp.bh / a.Hkv, h = sp.bh % a.Hkv;
  /* Q: row gr, channels qd D/4 + 4k .. + 3 as k-step k's A fragment (fp16);
   * qsum: the sum of row gr's fp16 values (K smoothing) */
  uint32_t qa[KS][2];
  float qsum = 0.0f;
  {
    const uint16_t *qr = a.q + ((size_t)b * a.Hq + h * a.G + (gr < a.G ? gr : 0)) * D + qd * (D / 4);
#pragma unroll
    for (uint32_t k = 0; k < KS; k++) {
      const uint2 w = gr < a.G ? __ldg((const uint2 *)(qr + 4 * k)) : make_uint2(0u, 0u);
      qa[k][0] = f16x2(bf16_to_f32(w.x & 0xFFFFu), bf16_to_f32(w.x >> 16));
      qa[k][1] = f16x2(bf16_to_f32(w.y & 0xFFFFu), bf16_to_f32(w.y >> 16));
      if (KSM) {
        qsum += (f16_to_f32(qa[k][0] & 0xFFFFu) + f16_to_f32(qa[k][0] >> 16)) +
                (f16_to_f32(qa[k][1] & 0xFFFFu) + f16_to_f32(qa[k][1] >> 16));
      }
    }
    if (KSM) {
      qsum += __shfl_xor_sync(0xFFFFFFFFu, qsum, 1);
      qsum += __shfl_xor_sync(0xFFFFFFFFu, qsum, 2);
    }
  }
  Acc<D> st;
  acc_init(st);
  const uint32_t vtok[4] = {2 * qd, 2 * qd + 1, 8 + 2 * qd, 9 + 2 * qd};
  constexpr uint32_t RB = D * reg_code_bits<C>() / 8, NSC = D / 16; /* code bytes a row; nvfp4 scales a row */
  /* kivi: each warp's two buffers of one K group's records (D x 4 bytes),
   * after the merge's states; the step's group comes by cp.async */
  uint32_t *kst = (uint32_t *)(smem + merge_smem<D>()) + (size_t)warp * 2 * D;
  uint32_t kbuf = 0;
  const uint32_t GK = KIVI ? a.p[0].kivi_group : 1u, GV = KIVI ? a.p[2].kivi_group : 1u;

  RecStream<2> rs;
  rs.init((const kvp__arec_q *)a.recs + sp.rec0, sp.nrec, warp, lane);
  uint32_t fib = 0;
  Rec fr = {};
  bool have = rec_next(rs, lane, fr);
  /* the warp's next step into o (o.n = 0: none left); its loads stay in flight */
  auto issue = [&](Step &o) {
    if (!have) {
      o.n = 0;
      return;
    }
    const uint32_t t = fr.t0 + fib;
    /* kivi: a step stays in one K group (its records fold into Q) */
    const uint32_t n = KIVI && !(fr.tag & 1u) ? min(min(kTile, fr.m - fib), GK - t % GK) : min(kTile, fr.m - fib);
    o.n = n;
    const uint8_t *kc = (const uint8_t *)a.base + (uint64_t)fr.page[0][0] * 64,
                  *vc = (const uint8_t *)a.base + (uint64_t)fr.page[1][0] * 64;
    const uint8_t *ksc = (const uint8_t *)a.base + (uint64_t)fr.page[0][1] * 64,
                  *vsc = (const uint8_t *)a.base + (uint64_t)fr.page[1][1] * 64;
    if (fr.tag & 1u) { /* RAW tail: rows read at its turn */
      o.tk = kc + (size_t)t * D * dtype_bytes(a.p[1].store_dtype);
      o.tv = vc + (size_t)t * D * dtype_bytes(a.p[3].store_dtype);
#pragma unroll
      for (int e = 0; e < 4; e++) o.ks[e] = o.vs[e] = 1.0f;
    } else {
      o.tk = o.tv = nullptr;
#pragma unroll
      for (uint32_t j = 0; j < 2; j++)
        ld_words<KW>(kc + (size_t)(t + min(8 * j + gr, n - 1)) * RB + qd * (RB / 4), o.k[j]);
#pragma unroll
      for (uint32_t e = 0; e < 4; e++) {
        const uint8_t *vp = vc + (size_t)(t + min(vtok[e], n - 1)) * RB + gr * (RB / 8);
        if constexpr (RB / 8 == 2) o.v[e][0] = __ldg((const unsigned short *)vp); /* kivi-2 at head_dim 64 */
        else ld_words<VW>(vp, o.v[e]);
      }
      if constexpr (KIVI) {
        /* K: the group's records into the warp's stage buffer (D / 4 lanes, 16 bytes each) */
        __syncwarp(); /* every lane is done with the buffer's last step */
        o.buf = kbuf, kbuf ^= 1u;
        const uint8_t *kr = ksc + (size_t)(t / GK) * D * 4;
        if (lane < D / 4) cp_async16(smem_addr(kst + o.buf * D + 4 * lane), kr + 16 * lane, 16u);
#pragma unroll
        for (uint32_t e = 0; e < 4; e++)
          o.vr[e] = __ldg((const uint32_t *)(vsc + ((size_t)(t + min(vtok[e], n - 1)) * (D / GV) + gr * (D / 8) / GV) * 4));
#pragma unroll
        for (int e = 0; e < 4; e++) o.ks[e] = o.vs[e] = 1.0f;
      } else if constexpr (FP4) {
        const float gk = __ldg((const float *)((const uint8_t *)a.base + (uint64_t)fr.page[0][2] * 64)),
                    gv = __ldg((const float *)((const uint8_t *)a.base + (uint64_t)fr.page[1][2] * 64));
#pragma unroll
        for (uint32_t j = 0; j < 2; j++) { /* the lane's K channels: groups (qd D/4) / 16 .. (D = 128: two) */
          const uint8_t *sp8 = ksc + (size_t)(t + min(8 * j + gr, n - 1)) * NSC + qd * (D / 64);
          o.kg[j] = D == 128 ? (uint32_t)__ldg((const unsigned short *)sp8) : (uint32_t)__ldg(sp8);
        }
        uint32_t vg = 0;
#pragma unroll
        for (uint32_t e = 0; e < 4; e++)
          vg |= (uint32_t)__ldg(vsc + (size_t)(t + min(vtok[e], n - 1)) * NSC + gr * D / 128) << (8 * e);
        o.vg = vg, o.gk = gk;
#pragma unroll
        for (int e = 0; e < 4; e++) {
          o.vs[e] = gv, o.ks[e] = gk;
          if (KSM) { /* the K means of the score tokens (bf16 after the scales) */
            const uint8_t *mp = ksc + (size_t)fr.cap * NSC + (size_t)(t + min(vtok[e], n - 1)) * 2;
            o.ks[e] = bf16_to_f32(__ldg((const unsigned short *)mp));
          }
        }
      } else {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const uint32_t tt = t + min(vtok[e], n - 1);
          o.ks[e] = row_scale<C>(a.p[0], ksc, tt), o.vs[e] = row_scale<C>(a.p[2], vsc, tt);
        }
      }
    }
    fib += n;
    if (fib >= fr.m) fib = 0, have = rec_next(rs, lane, fr); /* on to the warp's next record */
  };
  /* kivi: one cp.async group per issue, empty or not, so a compute waits for its own */
  auto issue_step = [&](Step &o) {
    issue(o);
    if constexpr (KIVI) cp_async_commit();
  };
  auto compute = [&](const Step &c) {
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    uint32_t p0, p1, r0, r1;
    if (c.tk) { /* RAW tail: this lane's elements, converted to fp16 */
      const uint32_t kd = a.p[1].store_dtype, vd = a.p[3].store_dtype;
#pragma unroll
      for (uint32_t j = 0; j < 2; j++) {
        const uint8_t *row = c.tk + (size_t)min(8 * j + gr, c.n - 1) * D * dtype_bytes(kd);
#pragma unroll
        for (uint32_t k = 0; k < KS; k++) {
          const uint32_t ch = qd * (D / 4) + 4 * k;
          const uint32_t b0 = f16x2(load_elem(row, kd, ch), load_elem(row, kd, ch + 1)),
                         b1 = f16x2(load_elem(row, kd, ch + 2), load_elem(row, kd, ch + 3));
          const uint32_t qk[4] = {qa[k][0], 0u, qa[k][1], 0u};
          mma16816(s[j], qk, b0, b1);
        }
      }
      softmax_step<D, false>(s, c.n, a.scale_log2, qd, st, c.ks, c.vs, p0, p1, r0, r1);
      const uint8_t *vr[4];
#pragma unroll
      for (uint32_t e = 0; e < 4; e++) vr[e] = c.tv + (size_t)min(vtok[e], c.n - 1) * D * dtype_bytes(vd);
#pragma unroll
      for (uint32_t i = 0; i < KS; i++) {
        const uint32_t ch = r8_channel<D>(gr, i, 0);
        const uint32_t va[4] = {f16x2(load_elem(vr[0], vd, ch), load_elem(vr[1], vd, ch)),
                                f16x2(load_elem(vr[0], vd, ch + 1), load_elem(vr[1], vd, ch + 1)),
                                f16x2(load_elem(vr[2], vd, ch), load_elem(vr[3], vd, ch)),
                                f16x2(load_elem(vr[2], vd, ch + 1), load_elem(vr[3], vd, ch + 1))};
        mma16816(st.o[i], va, p0, p1);
      }
      return;
    }
    /* kivi: K's group records fold into Q (q s per channel, fp16) and a bias
     * sum(q m) per query head: q . (c s + m) = (q s) . c + q . m */
    uint32_t qs[KS][2];
    float kbias = 0.0f;
    if constexpr (KIVI) {
      cp_async_wait<1>(); /* this step's group (the next step's may be in flight) */
      __syncwarp();
      const uint4 *rec = (const uint4 *)(kst + c.buf * D + qd * (D / 4));
#pragma unroll
      for (uint32_t k = 0; k < KS; k++) {
        const uint4 r = rec[k]; /* channels 4k .. 4k + 3 of the lane's: (scale, min) fp16 pairs */
        const uint32_t s01 = __byte_perm(r.x, r.y, 0x5410u), s23 = __byte_perm(r.z, r.w, 0x5410u);
        const uint32_t m01 = __byte_perm(r.x, r.y, 0x7632u), m23 = __byte_perm(r.z, r.w, 0x7632u);
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(qs[k][0]) : "r"(qa[k][0]), "r"(s01));
        asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(qs[k][1]) : "r"(qa[k][1]), "r"(s23));
        /* the bias in f32: q . m may dwarf the part the codes carry */
        kbias += (f16_to_f32(qa[k][0] & 0xFFFFu) * f16_to_f32(m01 & 0xFFFFu) +
                  f16_to_f32(qa[k][0] >> 16) * f16_to_f32(m01 >> 16)) +
                 (f16_to_f32(qa[k][1] & 0xFFFFu) * f16_to_f32(m23 & 0xFFFFu) +
                  f16_to_f32(qa[k][1] >> 16) * f16_to_f32(m23 >> 16));
      }
      kbias += __shfl_xor_sync(0xFFFFFFFFu, kbias, 1);
      kbias += __shfl_xor_sync(0xFFFFFFFFu, kbias, 2);
    }
#pragma unroll
    for (uint32_t j = 0; j < 2; j++) {
      uint32_t sc2[2] = {0u, 0u}; /* nvfp4: the lane's K group scales, fp16 in both halves */
      if constexpr (FP4) {
        sc2[0] = e4m3x2_f16(c.kg[j], c.kg[j]);
        sc2[1] = D == 128 ? e4m3x2_f16(c.kg[j] >> 8, c.kg[j] >> 8) : sc2[0];
      }
#pragma unroll
      for (uint32_t k = 0; k < KS; k++) {
        uint32_t b0, b1;
        if constexpr (FP4) { /* channels 4k .. 4k + 3 of the lane's: bytes 2k, 2k + 1 */
          const uint32_t x = c.k[j][k / 2] >> (16 * (k % 2)), s2 = sc2[k / 4];
          b0 = e2m1x2_f16<4>(x, s2), b1 = e2m1x2_f16<4>(x >> 8, s2);
        } else if constexpr (KIVI) { /* channels 4k .. 4k + 3 of the lane's: 4 KB bits from bit 4 KB k */
          const uint32_t x = c.k[j][(4 * KB * k) / 32] >> ((4 * KB * k) % 32);
          b0 = kivi_codes2_f16<KB>(x, x >> KB), b1 = kivi_codes2_f16<KB>(x >> (2 * KB), x >> (3 * KB));
        } else {
          codes4_f16_fast<C>(c.k[j][k], b0, b1);
        }
        const uint32_t qk[4] = {KIVI ? qs[k][0] : qa[k][0], 0u, KIVI ? qs[k][1] : qa[k][1], 0u};
        mma16816(s[j], qk, b0, b1);
      }
    }
    if (KIVI)
#pragma unroll
      for (uint32_t j = 0; j < 2; j++) s[j][0] += kbias, s[j][1] += kbias;
    if (KSM) { /* q . (e s g + mean) = g (q . e s) + mean sum(q) */
      s[0][0] = __fadd_rn(__fmul_rn(s[0][0], c.gk), __fmul_rn(c.ks[0], qsum));
      s[0][1] = __fadd_rn(__fmul_rn(s[0][1], c.gk), __fmul_rn(c.ks[1], qsum));
      s[1][0] = __fadd_rn(__fmul_rn(s[1][0], c.gk), __fmul_rn(c.ks[2], qsum));
      s[1][1] = __fadd_rn(__fmul_rn(s[1][1], c.gk), __fmul_rn(c.ks[3], qsum));
      softmax_step<D, false>(s, c.n, a.scale_log2, qd, st, kOnes, c.vs, p0, p1, r0, r1);
    } else {
      softmax_step<D, false>(s, c.n, a.scale_log2, qd, st, c.ks, c.vs, p0, p1, r0, r1);
    }
    uint32_t sv01 = 0, sv23 = 0; /* nvfp4: V scales of tokens 2 qd, 2 qd + 1 and 8 + those, fp16x2 */
    if constexpr (FP4) sv01 = e4m3x2_f16(c.vg, c.vg >> 8), sv23 = e4m3x2_f16(c.vg >> 16, c.vg >> 24);
#pragma unroll
    for (uint32_t i = 0; i < KS; i++) {
      uint32_t va[4];
      if constexpr (KIVI) { /* channels 2i, 2i + 1 of the lane's: KB bits from bit 2 KB i, c s + m in fp16 */
        const uint32_t w = (2 * KB * i) / 32, sh = (2 * KB * i) % 32;
        const uint32_t s01 = __byte_perm(c.vr[0], c.vr[1], 0x5410u), m01 = __byte_perm(c.vr[0], c.vr[1], 0x7632u);
        const uint32_t s23 = __byte_perm(c.vr[2], c.vr[3], 0x5410u), m23 = __byte_perm(c.vr[2], c.vr[3], 0x7632u);
        va[0] = kivi_fma_f16(kivi_codes2_f16<KB>(c.v[0][w] >> sh, c.v[1][w] >> sh), s01, m01);
        va[1] = kivi_fma_f16(kivi_codes2_f16<KB>(c.v[0][w] >> (sh + KB), c.v[1][w] >> (sh + KB)), s01, m01);
        va[2] = kivi_fma_f16(kivi_codes2_f16<KB>(c.v[2][w] >> sh, c.v[3][w] >> sh), s23, m23);
        va[3] = kivi_fma_f16(kivi_codes2_f16<KB>(c.v[2][w] >> (sh + KB), c.v[3][w] >> (sh + KB)), s23, m23);
      } else if constexpr (FP4) { /* channels 2i, 2i + 1 of the lane's: byte i, two tokens' side by side */
        const uint32_t sel = (i % 4) | (4 + i % 4) << 4;
        const uint32_t y01 = __byte_perm(c.v[0][i / 4], c.v[1][i / 4], sel),
                       y23 = __byte_perm(c.v[2][i / 4], c.v[3][i / 4], sel);
        va[0] = e2m1x2_f16<8>(y01, sv01), va[1] = e2m1x2_f16<8>(y01 >> 4, sv01);
        va[2] = e2m1x2_f16<8>(y23, sv23), va[3] = e2m1x2_f16<8>(y23 >> 4, sv23);
      } else { /* channels 2i, 2i + 1 of the lane's: byte 2 (i % 2) and the next of word i / 2 */
        const uint32_t sel = i % 2 ? 0x7362u : 0x5140u;
        codes4_f16_fast<C>(__byte_perm(c.v[0][i / 2], c.v[1][i / 2], sel), va[0], va[1]);
        codes4_f16_fast<C>(__byte_perm(c.v[2][i / 2], c.v[3][i / 2], sel), va[2], va[3]);
      }
      mma16816(st.o[i], va, p0, p1);
    }
  };
  Step x, y;
  issue_step(x);
  while (x.n) { /* two named steps, no copies: a copy would wait for the loads */
    issue_step(y);
    compute(x);
    if (!y.n) break;
    issue_step(x);
    compute(y);
  }
  if constexpr (KIVI) cp_async_wait<0>();
  cta_merge<D, true>(a, sp, st, smem);
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

template <uint32_t D> using AttnFn = void (*)(const AttnArgs);

/* attend_reg_kernel's shared memory: the merge's states (kivi: then two
 * buffers of K group records per warp) */
template <uint32_t D> constexpr size_t kivi_smem() { return merge_smem<D>() + (size_t)kAttnWarps * 2 * D * 4; }

/* The kernel for a layer's bindings, and its shared memory */
enum { kPickBf16, kPickFp8, kPickInt8, kPickNvfp4, kPickRaw, kPickAny, kPickNvfp4Ksm, kPickKivi2, kPickKivi4, kPickCount };
static_assert(kPickCount == KVP__KERN_ATTEND_KINDS, "kernels.h counts the kernel kinds");
template <uint32_t D> AttnFn<D> attend_pick(int which, size_t *smem) {
  switch (which) {
  case kPickBf16: *smem = attend_smem<D, 2>(); return attend_bf16_kernel<D>;
  case kPickFp8:
    if constexpr (D == 64 || D == 128) {
      *smem = merge_smem<D>();
      return attend_reg_kernel<D, KVP__K_FP8, false>;
    } else {
      *smem = attend_q_smem<D, KVP__K_FP8>();
      return attend_q_kernel<D, KVP__K_FP8>;
    }
  case kPickInt8:
    if constexpr (D == 64 || D == 128) {
      *smem = merge_smem<D>();
      return attend_reg_kernel<D, KVP__K_INT8, false>;
    } else {
      *smem = attend_q_smem<D, KVP__K_INT8>();
      return attend_q_kernel<D, KVP__K_INT8>;
    }
  case kPickNvfp4:
    if constexpr (D == 64 || D == 128) {
      *smem = merge_smem<D>();
      return attend_reg_kernel<D, KVP__K_NVFP4, false>;
    } else {
      *smem = attend_q_smem<D, KVP__K_NVFP4>();
      return attend_q_kernel<D, KVP__K_NVFP4>;
    }
  case kPickKivi2: /* attend_kind gives the kivi kinds at head_dim 64 and 128 only */
  case kPickKivi4:
    if constexpr (D == 64 || D == 128) {
      *smem = kivi_smem<D>();
      return which == kPickKivi2 ? attend_reg_kernel<D, kKivi2, false> : attend_reg_kernel<D, kKivi4, false>;
    } else {
      *smem = attend_smem<D, 1>();
      return attend_kernel<D, kAnyCodec>;
    }
  case kPickNvfp4Ksm: /* attend_kind gives it at head_dim 64 and 128 only */
    if constexpr (D == 64 || D == 128) {
      *smem = merge_smem<D>();
      return attend_reg_kernel<D, KVP__K_NVFP4, true>;
    } else {
      *smem = attend_q_smem<D, KVP__K_NVFP4>();
      return attend_q_kernel<D, KVP__K_NVFP4>;
    }
  case kPickRaw: *smem = attend_smem<D, 1>(); return attend_kernel<D, KVP__K_RAW>;
  default: *smem = attend_smem<D, 1>(); return attend_kernel<D, kAnyCodec>;
  }
}

/* The kernel kind for a layer's bindings (attend_pick's argument) */
inline int attend_kind(const kvp__kparams *p) {
  bool raw = true, bf16 = true;
  for (int i = 0; i < 4; i++) raw = raw && p[i].codec == KVP__K_RAW, bf16 = bf16 && p[i].store_dtype == kBF16;
  /* fp8, int8, nvfp4: K and V of one codec, and a raw tail (if any) the kernel's generic reader takes */
  const uint32_t kc = p[0].codec;
  const bool one = kc == p[2].codec && p[1].codec == KVP__K_RAW && p[3].codec == KVP__K_RAW;
  /* nvfp4 in registers (head_dim 64, 128): K smoothing on K only */
  const bool reg = p[0].head_dim == 64 || p[0].head_dim == 128;
  if (one && kc == KVP__K_NVFP4 && reg)
    return p[2].nvfp4_ksmooth ? kPickAny : p[0].nvfp4_ksmooth ? kPickNvfp4Ksm : kPickNvfp4;
  /* kivi in registers: per-channel K, per-token V, one width, a lane's V channels in one group */
  if (one && kc == KVP__K_KIVI && reg && p[0].kivi_kv == 0 && p[2].kivi_kv == 1 && p[0].kivi_bits == p[2].kivi_bits &&
      p[0].kivi_group >= 1 && p[2].kivi_group % (p[0].head_dim / 8) == 0)
    return p[0].kivi_bits == 2 ? kPickKivi2 : kPickKivi4;
  return raw && bf16                  ? kPickBf16
         : raw                        ? kPickRaw
         : one && kc == KVP__K_FP8    ? kPickFp8
         : one && kc == KVP__K_INT8   ? kPickInt8
         : one && kc == KVP__K_NVFP4  ? kPickNvfp4
                                      : kPickAny;
}

template <uint32_t D>
cudaError_t attend_launch(const AttnArgs &a, uint32_t nsplits, uint32_t B, bool reduce, cudaStream_t s) {
  size_t smem;
  AttnFn<D> k = attend_pick<D>(attend_kind(a.p), &smem);
  k<<<nsplits, kAttnThreads, smem, s>>>(a);
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess && reduce) {
    attend_reduce<D><<<B * a.Hq, D, 0, s>>>(a);
    e = cudaGetLastError();
  }
  return e;
}

template <uint32_t D> cudaError_t attend_occupancy(uint32_t *occ) {
  cudaError_t e = cudaSuccess;
  for (int w = kPickBf16; e == cudaSuccess && w < kPickCount; w++) {
    size_t smem;
    AttnFn<D> k = attend_pick<D>(w, &smem);
    int n = 0;
    e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, kAttnThreads, smem);
    occ[w] = n > 0 ? (uint32_t)n : 1u;
  }
  return e;
}

} // namespace kvpk

/* Load every attention kernel now (and allow it its shared memory): with
 * CUDA's lazy module loading the first launch would load them, and a load
 * inside a call whose stream is held (a host function waiting, a graph
 * being captured) can wait forever. Per device: call it with the pool's
 * device current. */
template <uint32_t D> static cudaError_t preload_d() {
  cudaError_t e = cudaSuccess;
  for (int w = kvpk::kPickBf16; e == cudaSuccess && w < kvpk::kPickCount; w++) {
    size_t smem;
    kvpk::AttnFn<D> k = kvpk::attend_pick<D>(w, &smem);
    cudaFuncAttributes fa;
    e = cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, k);
  }
  cudaFuncAttributes fa;
  return e == cudaSuccess ? cudaFuncGetAttributes(&fa, kvpk::attend_reduce<D>) : e;
}

extern "C" uint32_t kvp__kern_attend_kind(const kvp__kparams p[4]) { return (uint32_t)kvpk::attend_kind(p); }

extern "C" uint32_t kvp__kern_attend_rec_bytes(uint32_t kind) {
  if (kind == kvpk::kPickBf16) return (uint32_t)sizeof(kvp__arec_raw);
  if (kind == kvpk::kPickFp8 || kind == kvpk::kPickInt8 || kind == kvpk::kPickNvfp4 || kind == kvpk::kPickNvfp4Ksm ||
      kind == kvpk::kPickKivi2 || kind == kvpk::kPickKivi4)
    return (uint32_t)sizeof(kvp__arec_q);
  return (uint32_t)sizeof(kvp__gjob);
}

extern "C" int kvp__kern_attend_zero_copy(uint32_t kind, uint32_t head_dim) {
  return kind == kvpk::kPickBf16 ||
         ((kind == kvpk::kPickFp8 || kind == kvpk::kPickInt8 || kind == kvpk::kPickNvfp4 ||
           kind == kvpk::kPickNvfp4Ksm || kind == kvpk::kPickKivi2 || kind == kvpk::kPickKivi4) &&
          (head_dim == 64 || head_dim == 128));
}

extern "C" int kvp__kern_attend_occupancy(uint32_t head_dim, uint32_t *occ) {
  for (uint32_t i = 0; i < KVP__KERN_ATTEND_KINDS; i++) occ[i] = 0;
  switch (head_dim) {
  case 32: return (int)kvpk::attend_occupancy<32>(occ);
  case 64: return (int)kvpk::attend_occupancy<64>(occ);
  case 128: return (int)kvpk::attend_occupancy<128>(occ);
  case 256: return (int)kvpk::attend_occupancy<256>(occ);
  default: return 0;
  }
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
