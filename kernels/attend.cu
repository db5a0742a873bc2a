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
 *     both sides at head_dim 64 and 128 (attend_reg_kernel,
 *     kernels/attend_reg.cuh): each warp's steps pass through a ring of
 *     shared-memory stages by cp.async, three steps ahead, and the codes
 *     go from there into the registers of the matrix fragments (no fp16
 *     tile);
 *   - fp8, int8, nvfp4 on both sides at head_dim 32 and 256
 *     (attend_q_kernel): the code rows go to shared memory by cp.async one
 *     step ahead, then to fp16 tiles (fp8 and int8: the codes exactly,
 *     their per-token scales applied to the scores and the probabilities;
 *     nvfp4: the codec's row8s reader);
 *   - any other (attend_kernel): the codec's <codec>_row8 reader (8
 *     elements of a row, the host decode's f32 bit for bit) fills fp16
 *     tiles straight from the pages.
 * The parts every kernel shares (records, products, online softmax, the
 * CTA's merge) are in kernels/attend_core.cuh.
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
#include <string.h>

#include <atomic>

#include "attend_core.cuh"
#include "attend_reg.cuh"
#include "int8.cuh"
#include "kivi.cuh"
#include "nvfp4.cuh"
#include "raw.cuh"

namespace kvpk {


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

/* Any codec: each step's rows decoded (the codec's row8 reader) into fp16
 * tiles, one buffer per warp. C: KVP__K_RAW when every binding is raw
 * (fewer registers), else kAnyCodec. */
template <uint32_t D, uint32_t C>
__global__ void __launch_bounds__(kAttnThreads) attend_kernel(const __grid_constant__ AttnArgs a) {
  constexpr uint32_t LD = D + 8; /* tile row, in elements */
  extern __shared__ __align__(16) unsigned char smem[];
  const kvp__asplit sp = a.splits[blockIdx.x];
  dep_launch(); /* attend_reduce may start: it reads the table until it waits for this grid */
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
  dep_launch(); /* attend_reduce may start: it reads the table until it waits for this grid */
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
        cp_async<16>(cpa0 + (buf * 2 + kv) * TE * 2 + i * RPP * LD * 2, pg + (size_t)min(r, n - 1) * D * 2,
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
  dep_launch(); /* attend_reduce may start: it reads the table until it waits for this grid */
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
          cp_async<16>(stage0 + (buf * 2 + kv) * SB + r * RB + cc * 16, pg + (size_t)min(r, o.n - 1) * RB + cc * 16,
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

/* One CTA per (sequence, query head) whose KV head has several splits:
 * their partial records merged, in the splits' order, max first. Latency
 * decides its time (a long sequence of one has dozens of splits, and each
 * split's record is a load after the load of its slot), so the loads go
 * out together: D splits at a time, thread i loads split i's slot (the
 * table may sit in pinned host memory: kvp__kern_attend_zero_copy), max
 * and sum into shared memory; then every thread reads its channel of 8
 * records at once. On sm_90 it is launched as the attention kernel's
 * programmatic dependent (attend_launch): it starts once every CTA of that
 * kernel has (dep_launch), reads its part of the table, and waits for that
 * kernel's end (dep_wait) before the partial records. */
template <uint32_t D> __global__ void __launch_bounds__(D) attend_reduce(const __grid_constant__ AttnArgs a) {
  __shared__ uint32_t slot[D], range[2];
  __shared__ float mx[D], sm[D];
  const uint32_t b = blockIdx.x / a.Hq, hq = blockIdx.x % a.Hq, h = hq / a.G, g = hq % a.G, bh = b * a.Hkv + h;
  const uint32_t d = threadIdx.x;
  auto rec = [&](uint32_t sl) { return a.part + ((size_t)sl * a.G + g) * (2 + D); };
  if (d < 2) range[d] = a.bh_split0[bh + d];
  __syncthreads();
  const uint32_t s0 = range[0], s1 = range[1];
  /* The table is the host's (it may be read over the bus): the first
   * chunk's slots are read before the wait for the attention kernel, whose
   * partial records alone come after it (launched as its dependent, this
   * kernel may start while that one runs). Every CTA waits, those with
   * nothing to merge too: the grid ends after the attention kernel, as
   * stream order had it. */
  const uint32_t first = s1 - s0 >= 2 && s0 + d < s1 ? a.splits[s0 + d].slot : 0u;
  dep_wait();
  if (s1 - s0 < 2) return;
  auto load = [&](uint32_t c) { /* splits c .. c + D - 1 (all of them stay when they fit) */
    __syncthreads();            /* every thread is done with the last chunk */
    if (c + d < s1) {
      const uint32_t sl = c == s0 ? first : a.splits[c + d].slot;
      slot[d] = sl, mx[d] = rec(sl)[0], sm[d] = rec(sl)[1];
    }
    __syncthreads();
  };
  const bool one = s1 - s0 <= D;
  float M = -INFINITY;
  for (uint32_t c = s0; c < s1; c += D) {
    load(c);
    for (uint32_t i = 0; i < min(D, s1 - c); i++) M = fmaxf(M, mx[i]);
  }
  float L = 0.0f, A = 0.0f;
  if (M != -INFINITY)
    for (uint32_t c = s0; c < s1; c += D) {
      if (!one) load(c);
      const uint32_t n = min(D, s1 - c);
      for (uint32_t i0 = 0; i0 < n; i0 += 8) {
        float x[8];
#pragma unroll
        for (uint32_t k = 0; k < 8; k++) x[k] = i0 + k < n ? rec(slot[i0 + k])[2 + d] : 0.0f;
#pragma unroll
        for (uint32_t k = 0; k < 8; k++)
          if (i0 + k < n) {
            const float f = mx[i0 + k] == -INFINITY ? 0.0f : ex2(mx[i0 + k] - M);
            L = fmaf(sm[i0 + k], f, L);
            A = fmaf(x[k], f, A);
          }
      }
    }
  store_elem(a.out, a.out_dtype, ((size_t)b * a.Hq + hq) * D + d, L > 0.0f ? A / L : 0.0f);
}

template <uint32_t D> using AttnFn = void (*)(const AttnArgs);

/* Attribute A of the current device, read at its first use on each device
 * (every launch asks); 0 when unknown. */
template <cudaDeviceAttr A> inline int dev_attr() {
  static std::atomic<int> of[64]; /* by device ordinal: the value + 1; 0: not read yet */
  int dev = 0, v = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  const bool cached = dev >= 0 && dev < 64;
  const int c = cached ? of[dev].load(std::memory_order_relaxed) : 0;
  if (c) return c - 1;
  if (cudaDeviceGetAttribute(&v, A, dev) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (cached) of[dev].store(v + 1, std::memory_order_relaxed);
  return v;
}

/* attend_reg_kernel's shared memory at least: a third of an SM's, so that
 * it runs two CTAs an SM at most. Where its registers allowed a third
 * (fp8 and int8 at head_dim 128) the third made it slower (fp8, 32K, one
 * device call: 1.73 ms against 1.51 at batch 64, 272 against 247 us at
 * batch 8, 67 against 64 us at batch 1). Of the current device; 0 when
 * unknown. */
inline size_t reg_smem_floor() { return (size_t)dev_attr<cudaDevAttrMaxSharedMemoryPerMultiprocessor>() / 3; }

/* Whether the current device takes programmatic dependent launches
 * (compute capability 9.0 on). */
inline bool dep_launch_ok() { return dev_attr<cudaDevAttrComputeCapabilityMajor>() >= 9; }

/* The kernel for a layer's bindings, and its shared memory */
enum { kPickBf16, kPickFp8, kPickInt8, kPickNvfp4, kPickRaw, kPickAny, kPickNvfp4Ksm, kPickKivi2, kPickKivi4, kPickCount };
static_assert(kPickCount == KVP__KERN_ATTEND_KINDS, "kernels.h counts the kernel kinds");
template <uint32_t D> AttnFn<D> attend_pick(int which, size_t *smem) {
  switch (which) {
  case kPickBf16: *smem = attend_smem<D, 2>(); return attend_bf16_kernel<D>;
  case kPickFp8:
    if constexpr (D == 64 || D == 128) {
      *smem = cmax(reg_smem<D, KVP__K_FP8>(), reg_smem_floor());
      return attend_reg_kernel<D, KVP__K_FP8, false>;
    } else {
      *smem = attend_q_smem<D, KVP__K_FP8>();
      return attend_q_kernel<D, KVP__K_FP8>;
    }
  case kPickInt8:
    if constexpr (D == 64 || D == 128) {
      *smem = cmax(reg_smem<D, KVP__K_INT8>(), reg_smem_floor());
      return attend_reg_kernel<D, KVP__K_INT8, false>;
    } else {
      *smem = attend_q_smem<D, KVP__K_INT8>();
      return attend_q_kernel<D, KVP__K_INT8>;
    }
  case kPickNvfp4:
    if constexpr (D == 64 || D == 128) {
      *smem = cmax(reg_smem<D, KVP__K_NVFP4>(), reg_smem_floor());
      return attend_reg_kernel<D, KVP__K_NVFP4, false>;
    } else {
      *smem = attend_q_smem<D, KVP__K_NVFP4>();
      return attend_q_kernel<D, KVP__K_NVFP4>;
    }
  case kPickKivi2: /* attend_kind gives the kivi kinds at head_dim 64 and 128 only */
  case kPickKivi4:
    if constexpr (D == 64 || D == 128) {
      *smem = cmax(which == kPickKivi2 ? reg_smem<D, kKivi2>() : reg_smem<D, kKivi4>(), reg_smem_floor());
      return which == kPickKivi2 ? attend_reg_kernel<D, kKivi2, false> : attend_reg_kernel<D, kKivi4, false>;
    } else {
      *smem = attend_smem<D, 1>();
      return attend_kernel<D, kAnyCodec>;
    }
  case kPickNvfp4Ksm: /* attend_kind gives it at head_dim 64 and 128 only */
    if constexpr (D == 64 || D == 128) {
      *smem = cmax(reg_smem<D, KVP__K_NVFP4>(), reg_smem_floor());
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
    /* the merge as the attention kernel's programmatic dependent (sm_90):
     * its launch and its reads of the table overlap that kernel's end */
    cudaLaunchConfig_t cfg = {};
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.gridDim = dim3(B * a.Hq), cfg.blockDim = dim3(D), cfg.dynamicSmemBytes = 0, cfg.stream = s;
    cfg.attrs = at, cfg.numAttrs = dep_launch_ok() ? 1 : 0;
    e = cudaLaunchKernelEx(&cfg, attend_reduce<D>, a);
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
