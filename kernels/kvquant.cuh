/*
 * kernels/kvquant.cuh - the KVQuant codec on the device (host twin
 * codecs/kvquant.c, whose banner defines the format and the arithmetic):
 * nuq codes against the binding's codebook, K normalized per channel by
 * the calibration, V per token by an fp16 middle and half range, the
 * outliers of each token as fp16 residuals in the OUTLIERS page (topk rows,
 * or the threshold CSR with row starts), the first positions RAW; decode
 * adds the residuals back and rotates pre-RoPE keys.
 *
 *   CODES     cap x row_bytes, row t = D codes LSB-first in little-endian
 *             32-bit words (row_bytes = 4 ceil(D b / 32) <= 128)
 *   OUTLIERS  topk: row t at t k (w + 2): k channels (w bytes), k fp16;
 *             threshold: u32 row starts [cap + 1], entries (channel, fp16)
 *             of w + 2 bytes from byte 4 (cap + 1)
 *   SCALES    (V) 4 bytes a token: fp16 middle, fp16 half range
 *   RAW       the sink rows t < ns in the appended dtype
 *
 * Alignment: CODES words are read and written 32 bits at a time when the
 * page is 4-byte aligned (pool pages are 64-byte aligned), else by bytes;
 * every other page field goes byte by byte (OUTLIERS rows are k (w + 2)
 * bytes: no alignment to use). src and dst rows: their element size.
 *
 * Thread mapping: one warp per token, lane l holding channels l + 32 i
 * (i < ceil(D / 32) <= 8) in registers; so D <= 256 (KVP__KVQ_DEV_MAX_DIM).
 *   encode (one CTA of 256 per job, 8 tokens at a time): the scores, the
 *     outlier pick (k rounds of a warp arg-max over (score desc, channel
 *     asc) for k <= 16, else each channel's rank from a shared copy of the
 *     scores: the host's top-k, ties to the lower channel), V's middle and
 *     half range over the other channels by a warp min/max that keeps the
 *     lower channel on ties (the host's first zero, sign included), the
 *     codes (binary search over the midpoints), packed through shared
 *     memory one word a lane, the residuals of the picked channels at their
 *     rank among them (ballots). Threshold: the CTA runs 8 tokens a round
 *     and scans their counts for the row starts (two barriers a round).
 *   decode, D a multiple of 8 (kvquant_decode_tile): a thread per octet
 *     of a row, outliers added in registers, shared memory for RoPE only;
 *   decode, any other D (one CTA of 128 per job, a warp per row): each lane loads one
 *     code word and takes its channels' codes from the row's words by
 *     shuffles; the residuals added by the lane owning the channel, in the
 *     row's order; RoPE pairs (i, i + R/2) through a shared copy of the row.
 * Every float operation is the host's, rounded on its own (__f*_rn,
 * __d*_rn): the bits are the host's.
 *
 * Traffic per token-head: encode D esize read, row_bytes + k (w + 2) (+4 V)
 * written; decode the same read back (the tables from L1/L2) and D
 * esize(out) written.
 *   decode, the common case (kvquant_decode_lean): the tile mapping with
 *     the bits and the side as template parameters and nothing else left
 *     to decide per octet (no RAW row, no rotation, top-k outliers or none,
 *     2-byte out, aligned pages and rows).
 * Measured on the H100 (make bench-gpu, codec section: 4096 16-token
 * blocks, D = 128, bf16 out; device times, the host's part apart): 3 bits,
 * 1% outliers: lean 17.3 us against 21.0 us by tiles (ncu: the tile kernel
 * issues 13.7M warp instructions, 420 a warp a pass, at 66% of the issue
 * slots, and spills at its 40 registers), 0.39 of the copy's bandwidth
 * (target 0.6); 2 bits 16.3 us (20.9); 4 bits with 5% outliers 26.4 us
 * (31.3); pre-RoPE keys (by tiles) 60 us. Encode 207 us, 0.03 of the copy.
 * Tried and dropped: resident CTAs looping over the jobs (the next job's
 * descriptor loaded ahead) and two passes' loads issued together: slower
 * (ncu 30.0 against 25.1 us), as the kernel is bound by instructions, not
 * by the latency of its loads.
 */
#ifndef KVP_KERNELS_KVQUANT_CUH
#define KVP_KERNELS_KVQUANT_CUH

#include "common.cuh"

namespace kvpk {
namespace kvq_ {

constexpr uint32_t kSlots = KVP__KVQ_DEV_MAX_DIM / 32; /* channels a lane holds, at most */
constexpr uint32_t kArgmaxK = 16;                      /* picks of at most this many: arg-max rounds */
constexpr float kF16Max = 65504.0f;

/* The pages of a block, by the codec's order: CODES, then OUTLIERS (kmax >
 * 0), SCALES (V), RAW (ns > 0). */
struct Pages {
  uint8_t *codes, *outl, *scales, *raw;
  uint32_t ns; /* sink rows of the block */
};

KVP_D Pages pages_of(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j) {
  Pages g;
  g.ns = j.pos0 >= p.sink ? 0u : (p.sink - j.pos0 < j.cap_tokens ? p.sink - j.pos0 : j.cap_tokens);
  uint32_t n = 1;
  g.codes = (uint8_t *)j.pages[0];
  g.outl = p.kmax ? (uint8_t *)j.pages[n++] : nullptr;
  g.scales = p.kv ? (uint8_t *)j.pages[n++] : nullptr;
  g.raw = g.ns ? (uint8_t *)j.pages[n] : nullptr;
  return g;
}

KVP_D void st_u8(uint8_t *p, size_t off, uint32_t v) { p[off] = (uint8_t)v; }
KVP_D void st_le32(uint8_t *p, size_t off, uint32_t v) {
  for (int b = 0; b < 4; b++) p[off + b] = (uint8_t)(v >> 8 * b);
}
KVP_D uint32_t ld_le32(const uint8_t *p, size_t off) {
  return (uint32_t)p[off] | (uint32_t)p[off + 1] << 8 | (uint32_t)p[off + 2] << 16 | (uint32_t)p[off + 3] << 24;
}
/* Code word w of a row (aligned: one 32-bit access). */
KVP_D uint32_t ld_word(const uint8_t *row, uint32_t w, bool aligned) {
  return aligned ? *(const uint32_t *)(row + 4 * w) : ld_le32(row, 4 * w);
}
KVP_D void st_word(uint8_t *row, uint32_t w, uint32_t v, bool aligned) {
  if (aligned) *(uint32_t *)(row + 4 * w) = v;
  else st_le32(row, 4 * w, v);
}

/* (sa, ca) ranks before (sb, cb): larger score, then lower channel. */
KVP_D bool beats(float sa, uint32_t ca, float sb, uint32_t cb) { return sa > sb || (sa == sb && ca < cb); }

/* The nearest codebook entry of n: the midpoints strictly below it. */
KVP_D uint32_t nearest(const float *mid, uint32_t bits, float n) {
  uint32_t i = 0;
  for (uint32_t s = 1u << (bits - 1); s; s >>= 1) i += __ldg(&mid[i + s - 1]) < n ? s : 0u;
  return i;
}

/* Bit i of sel (i < kSlots) as a register array index: y[i] += v where i = slot. */
KVP_D void add_at(float (&y)[kSlots], uint32_t slot, float v) {
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++)
    if (i == slot) y[i] = __fadd_rn(y[i], v);
}

/* Pick kk channels of the largest scores (ties: the lower channel) into the
 * bits of sel (bit i: channel lane + 32 i). sh: this warp's D floats. */
KVP_D uint32_t pick_top(const float (&sc)[kSlots], uint32_t D, uint32_t npl, uint32_t kk, float *sh) {
  uint32_t lane = threadIdx.x % 32, sel = 0;
  if (kk <= kArgmaxK) {
    for (uint32_t round = 0; round < kk; round++) {
      float bs = 0.0f;
      uint32_t bc = 0, has = 0;
#pragma unroll
      for (uint32_t i = 0; i < kSlots; i++) {
        uint32_t c = lane + 32 * i;
        if (i < npl && c < D && !(sel >> i & 1u) && (!has || beats(sc[i], c, bs, bc))) bs = sc[i], bc = c, has = 1;
      }
      for (int o = 16; o; o >>= 1) {
        float os = __shfl_xor_sync(0xFFFFFFFFu, bs, o);
        uint32_t oc = __shfl_xor_sync(0xFFFFFFFFu, bc, o), oh = __shfl_xor_sync(0xFFFFFFFFu, has, o);
        if (oh && (!has || beats(os, oc, bs, bc))) bs = os, bc = oc, has = 1;
      }
      bc = __shfl_sync(0xFFFFFFFFu, bc, 0); /* one winner for every lane, whatever the scores */
      has = __shfl_sync(0xFFFFFFFFu, has, 0);
      if (has && bc % 32 == lane) sel |= 1u << (bc / 32);
    }
    return sel;
  }
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++)
    if (i < npl && lane + 32 * i < D) sh[lane + 32 * i] = sc[i];
  __syncwarp();
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++) {
    uint32_t c = lane + 32 * i;
    if (i >= npl || c >= D) continue;
    uint32_t rank = 0;
    for (uint32_t c2 = 0; c2 < D; c2++) rank += beats(sh[c2], c2, sc[i], c) ? 1u : 0u;
    if (rank < kk) sel |= 1u << i;
  }
  __syncwarp(); /* sh is reused by the next token */
  return sel;
}

/* What a token leaves for its OUTLIERS row. */
struct Outl {
  uint32_t sel;           /* bit i: channel lane + 32 i is an outlier */
  uint32_t n;             /* outliers of the token (<= kmax) */
  uint32_t val[kSlots];   /* fp16 residuals of the picked channels */
};

/* Rank of each picked channel among the token's picks (ascending channel):
 * rank_of[i] for the picked slots; returns the count. */
KVP_D uint32_t pick_ranks(uint32_t sel, uint32_t npl, uint32_t (&rank_of)[kSlots]) {
  uint32_t lane = threadIdx.x % 32, before = 0, lt = (1u << lane) - 1u;
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++) {
    uint32_t bal = __ballot_sync(0xFFFFFFFFu, i < npl && (sel >> i & 1u));
    rank_of[i] = before + __popc(bal & lt);
    before += __popc(bal);
  }
  return before;
}

/* One token of one job: row t (block row), its input row x_row. Writes
 * CODES, SCALES (V), RAW (sink rows); fills o with its outliers. */
KVP_D void encode_token(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, const Pages &g, uint32_t t,
                        const char *x_row, uint32_t job, unsigned long long *status, uint8_t *sh_code, float *sh_sc,
                        Outl &o) {
  uint32_t lane = threadIdx.x % 32, D = p.head_dim, npl = (D + 31) / 32, dt = p.in_dtype;
  uint32_t words = p.row_bytes / 4;
  bool waligned = (uintptr_t)g.codes % 4 == 0;
  uint8_t *crow = g.codes + (size_t)t * p.row_bytes;
  float x[kSlots];
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++) {
    uint32_t c = lane + 32 * i;
    x[i] = i < npl && c < D ? load_elem(x_row, dt, c) : 0.0f;
    if (i < npl && c < D) check_finite(x[i], status, job, t, D, c);
  }
  o.sel = 0, o.n = 0;
  if (t < g.ns) { /* sink: RAW, zero codes and scales, no outliers (topk: k zero slots) */
    size_t esz = dtype_bytes(dt);
    uint8_t *rrow = g.raw + (size_t)t * D * esz;
#pragma unroll
    for (uint32_t i = 0; i < kSlots; i++) {
      uint32_t c = lane + 32 * i;
      if (i >= npl || c >= D) continue;
      if (esz == 4) ((uint32_t *)rrow)[c] = ((const uint32_t *)x_row)[c];
      else ((uint16_t *)rrow)[c] = ((const uint16_t *)x_row)[c];
    }
    for (uint32_t w = lane; w < words; w += 32) st_word(crow, w, 0u, waligned);
    if (g.scales && lane == 0) st_le32(g.scales, (size_t)t * 4, 0u);
    return;
  }
  const float *off = p.off + (size_t)j.head * D, *inv = p.inv + (size_t)j.head * D, *rng = p.rng + (size_t)j.head * D;
  float n[kSlots], sc[kSlots];
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++) {
    uint32_t c = lane + 32 * i;
    n[i] = sc[i] = 0.0f;
    if (i >= npl || c >= D) continue;
    float d = __fsub_rn(x[i], __ldg(&off[c]));
    if (p.kv == 0) n[i] = __fmul_rn(d, __ldg(&inv[c])), sc[i] = fabsf(n[i]);
    else sc[i] = __fmul_rn(fabsf(d), __ldg(&inv[c]));
  }
  /* the outliers */
  uint32_t sel = 0, cnt = 0;
  if (p.kmax) {
    if (!p.thresh) {
      if (p.k) sel = pick_top(sc, D, npl, p.k, sh_sc);
    } else {
#pragma unroll
      for (uint32_t i = 0; i < kSlots; i++)
        cnt += __popc(__ballot_sync(0xFFFFFFFFu, i < npl && lane + 32 * i < D && sc[i] > 1.0f));
      if (cnt > p.kmax) sel = pick_top(sc, D, npl, p.kmax, sh_sc);
      else {
#pragma unroll
        for (uint32_t i = 0; i < kSlots; i++)
          if (i < npl && lane + 32 * i < D && sc[i] > 1.0f) sel |= 1u << i;
      }
    }
  }
  /* V: middle and half range of the other channels (first of equals, as the host's strict compares) */
  float M = 0.0f, R = 0.0f;
  if (p.kv) {
    float lo = 0.0f, hi = 0.0f;
    uint32_t lc = 0, hc = 0, has = 0;
#pragma unroll
    for (uint32_t i = 0; i < kSlots; i++) {
      uint32_t c = lane + 32 * i;
      if (i >= npl || c >= D || (sel >> i & 1u)) continue;
      if (!has) lo = hi = x[i], lc = hc = c, has = 1;
      else {
        if (x[i] < lo) lo = x[i], lc = c;
        if (x[i] > hi) hi = x[i], hc = c;
      }
    }
    for (int o2 = 16; o2; o2 >>= 1) {
      float olo = __shfl_xor_sync(0xFFFFFFFFu, lo, o2), ohi = __shfl_xor_sync(0xFFFFFFFFu, hi, o2);
      uint32_t olc = __shfl_xor_sync(0xFFFFFFFFu, lc, o2), ohc = __shfl_xor_sync(0xFFFFFFFFu, hc, o2);
      uint32_t oh = __shfl_xor_sync(0xFFFFFFFFu, has, o2);
      if (oh && (!has || olo < lo || (olo == lo && olc < lc))) lo = olo, lc = olc;
      if (oh && (!has || ohi > hi || (ohi == hi && ohc < hc))) hi = ohi, hc = ohc;
      has |= oh;
    }
    lo = __shfl_sync(0xFFFFFFFFu, lo, 0), hi = __shfl_sync(0xFFFFFFFFu, hi, 0);
    lc = __shfl_sync(0xFFFFFFFFu, lc, 0), hc = __shfl_sync(0xFFFFFFFFu, hc, 0);
    float m = __fmul_rn(__fadd_rn(hi, lo), 0.5f), r = __fmul_rn(__fsub_rn(hi, lo), 0.5f);
    if (lane == 0 && (!(fabsf(m) <= kF16Max) || !(r <= kF16Max)))
      report(status, KVP_DEV_BAD_RANGE, job, t * D + (fabsf(lo) > fabsf(hi) ? lc : hc));
    uint32_t mh = f16_from_f32(m), rh = f16_from_f32(r);
    M = f16_to_f32(mh), R = f16_to_f32(rh);
    if (lane == 0) st_le32(g.scales, (size_t)t * 4, mh | rh << 16);
    float ir = R > 0.0f ? __fdiv_rn(1.0f, R) : 0.0f;
#pragma unroll
    for (uint32_t i = 0; i < kSlots; i++) n[i] = __fmul_rn(__fsub_rn(x[i], M), ir);
  }
  /* the codes, packed a word a lane through shared memory */
  uint32_t code[kSlots];
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++) {
    uint32_t c = lane + 32 * i;
    code[i] = nearest(p.mid, p.bits, n[i]);
    if (i < npl && c < D) sh_code[c] = (uint8_t)code[i];
  }
  __syncwarp();
  for (uint32_t w = lane; w < words; w += 32) {
    uint32_t b = p.bits, first = 32 * w / b, last = (32 * w + 31) / b, word = 0;
    last = last < D - 1 ? last : D - 1;
    for (uint32_t c = first; c <= last; c++) {
      int sh = (int)(b * c) - (int)(32 * w);
      uint32_t v = sh_code[c];
      word |= sh >= 0 ? v << sh : v >> -sh;
    }
    st_word(crow, w, word, waligned);
  }
  __syncwarp(); /* sh_code is reused by the next token */
  /* the residuals of the outliers */
  o.sel = sel;
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++) {
    uint32_t c = lane + 32 * i;
    o.val[i] = 0;
    if (!(sel >> i & 1u)) continue;
    float lut = __ldg(&p.lut[code[i]]);
    float dense = p.kv == 0 ? __fadd_rn(__fmul_rn(lut, __ldg(&rng[c])), __ldg(&off[c])) : __fadd_rn(__fmul_rn(lut, R), M);
    float e = __fsub_rn(x[i], dense);
    if (!(fabsf(e) <= kF16Max)) report(status, KVP_DEV_BAD_RANGE, job, t * D + c);
    o.val[i] = f16_from_f32(e);
  }
}

/* Write the outliers of token t: at its topk row, or (threshold) as
 * entries from start, and start[t + 1]. */
KVP_D void put_outliers(const kvp__kvq_kparams &p, const Pages &g, uint32_t cap, uint32_t t, const Outl &o,
                        uint32_t start) {
  uint32_t lane = threadIdx.x % 32, w = p.cw, npl = (p.head_dim + 31) / 32, rank_of[kSlots];
  bool sink = t < g.ns;
  uint32_t n = pick_ranks(o.sel, npl, rank_of);
  if (!p.thresh) {
    uint8_t *row = g.outl + (size_t)t * p.k * (w + 2);
    if (sink) { /* k empty slots */
      for (uint32_t s = lane; s < p.k; s += 32) {
        if (w == 1) st_u8(row, s, 0);
        else st_u16(row, 2 * (size_t)s, 0);
        st_u16(row, (size_t)p.k * w + 2 * s, 0);
      }
      return;
    }
#pragma unroll
    for (uint32_t i = 0; i < kSlots; i++) {
      if (!(o.sel >> i & 1u) || rank_of[i] >= p.k) continue; /* never more than k (only non-finite input picks so) */
      uint32_t c = lane + 32 * i, s = rank_of[i];
      if (w == 1) st_u8(row, s, c);
      else st_u16(row, 2 * (size_t)s, c);
      st_u16(row, (size_t)p.k * w + 2 * s, o.val[i]);
    }
    return;
  }
  n = sink ? 0 : (n < p.kmax ? n : p.kmax);
  uint8_t *ent = g.outl + 4 * ((size_t)cap + 1) + (size_t)start * (w + 2);
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++) {
    if (sink || !(o.sel >> i & 1u) || rank_of[i] >= n) continue;
    uint32_t c = lane + 32 * i;
    uint8_t *e = ent + (size_t)rank_of[i] * (w + 2);
    if (w == 1) st_u8(e, 0, c);
    else st_u16(e, 0, c);
    st_u16(e, w, o.val[i]);
  }
  if (lane == 0) st_le32(g.outl, 4 * ((size_t)t + 1), start + n);
}

/* Outliers a token writes (threshold: its count). */
KVP_D uint32_t outl_count(const kvp__kvq_kparams &p, const Pages &g, uint32_t t, const Outl &o) {
  if (t < g.ns) return 0;
  uint32_t n = 0, npl = (p.head_dim + 31) / 32;
#pragma unroll
  for (uint32_t i = 0; i < kSlots; i++) n += __popc(__ballot_sync(0xFFFFFFFFu, i < npl && (o.sel >> i & 1u)));
  return n < p.kmax ? n : p.kmax;
}

} // namespace kvq_

/* Rows [t0, t0 + m) of the job's block from src (row r of src is block
 * row t0 + r), as the host's encode_rows: bytes of other rows untouched;
 * with t0 = 0 in threshold mode, start[0] = 0. KVP__KERN_THREADS threads;
 * every thread reaches every barrier (trip counts are the CTA's). */
KVP_D void kvquant_encode(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, uint32_t job,
                          unsigned long long *status) {
  using namespace kvq_;
  __shared__ uint8_t sh_code[kWarps][KVP__KVQ_DEV_MAX_DIM];
  __shared__ float sh_sc[kWarps][KVP__KVQ_DEV_MAX_DIM];
  __shared__ uint32_t sh_cnt[kWarps];
  __shared__ uint32_t sh_base;
  uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, t0 = j.t0, m = j.m, cap = j.cap_tokens;
  Pages g = pages_of(p, j);
  const char *src = (const char *)j.src;
  size_t stride = j.stride_bytes;
  Outl o;
  if (!g.outl || !p.thresh) {
    for (uint32_t r = warp; r < m; r += kWarps) {
      uint32_t t = t0 + r;
      encode_token(p, j, g, t, src + (size_t)r * stride, job, status, sh_code[warp], sh_sc[warp], o);
      if (g.outl) put_outliers(p, g, cap, t, o, 0);
    }
    return;
  }
  if (threadIdx.x == 0) {
    sh_base = t0 ? ld_le32(g.outl, 4 * (size_t)t0) : 0u;
    if (t0 == 0) st_le32(g.outl, 0, 0u);
  }
  __syncthreads();
  for (uint32_t r0 = 0; r0 < m; r0 += kWarps) { /* 8 tokens a round, their starts by a scan of the counts */
    uint32_t r = r0 + warp, t = t0 + r;
    bool act = r < m;
    uint32_t cnt = 0;
    if (act) {
      encode_token(p, j, g, t, src + (size_t)r * stride, job, status, sh_code[warp], sh_sc[warp], o);
      cnt = outl_count(p, g, t, o);
    }
    if (lane == 0) sh_cnt[warp] = cnt;
    __syncthreads();
    uint32_t start = sh_base, total = sh_base;
    for (uint32_t w = 0; w < kWarps; w++) {
      start += w < warp ? sh_cnt[w] : 0u;
      total += sh_cnt[w];
    }
    if (act) put_outliers(p, g, cap, t, o, start);
    __syncthreads(); /* every warp read sh_base and sh_cnt */
    if (threadIdx.x == 0) sh_base = total;
    __syncthreads();
  }
}

/* Rows [t0, t0 + m) of the job's block into dst (out dtype, row r at dst +
 * r stride_bytes), as the host's decode_at. blockDim.x threads (a multiple
 * of 32), no barrier. */
KVP_D void kvquant_decode(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  using namespace kvq_;
  constexpr uint32_t kMaxWarps = kDecodeThreads / 32;
  __shared__ float sh_y[kMaxWarps][KVP__KVQ_DEV_MAX_DIM];
  uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  uint32_t D = p.head_dim, npl = (D + 31) / 32, words = p.row_bytes / 4, b = p.bits, mask = (1u << b) - 1u;
  uint32_t w = p.cw, cap = j.cap_tokens;
  Pages g = pages_of(p, j);
  bool waligned = (uintptr_t)g.codes % 4 == 0;
  const float *off = p.off + (size_t)j.head * D, *rng = p.rng + (size_t)j.head * D;
  size_t esz = dtype_bytes(p.in_dtype);
  if (warp >= kMaxWarps) return; /* a larger CTA than the shared rows: its extra warps idle */
  nwarps = nwarps < kMaxWarps ? nwarps : kMaxWarps;
  for (uint32_t r = warp; r < j.m; r += nwarps) {
    uint32_t t = j.t0 + r;
    char *drow = (char *)j.dst + (size_t)r * j.stride_bytes;
    float y[kSlots];
    if (t < g.ns) {
#pragma unroll
      for (uint32_t i = 0; i < kSlots; i++) {
        uint32_t c = lane + 32 * i;
        y[i] = i < npl && c < D ? load_elem(g.raw + (size_t)t * D * esz, p.in_dtype, c) : 0.0f;
      }
    } else {
      const uint8_t *crow = g.codes + (size_t)t * p.row_bytes;
      uint32_t wreg = lane < words ? ld_word(crow, lane, waligned) : 0u;
      float M = 0.0f, R = 0.0f;
      if (p.kv) {
        uint32_t rec = ld_le32(g.scales, (size_t)t * 4);
        M = f16_to_f32(rec & 0xFFFFu), R = f16_to_f32(rec >> 16);
      }
#pragma unroll
      for (uint32_t i = 0; i < kSlots; i++) {
        uint32_t c = lane + 32 * i, bit = b * c, wi = (bit >> 5) & 31u, sh = bit & 31u;
        uint32_t w0 = __shfl_sync(0xFFFFFFFFu, wreg, wi), w1 = __shfl_sync(0xFFFFFFFFu, wreg, (wi + 1) & 31u);
        uint32_t code = (sh ? (w0 >> sh) | (w1 << (32 - sh)) : w0) & mask;
        float lut = __ldg(&p.lut[code]);
        y[i] = 0.0f;
        if (i < npl && c < D)
          y[i] = p.kv == 0 ? __fadd_rn(__fmul_rn(lut, __ldg(&rng[c])), __ldg(&off[c])) : __fadd_rn(__fmul_rn(lut, R), M);
      }
      if (g.outl && !p.thresh) { /* every lane walks the row; the owner of a channel adds, in row order */
        const uint8_t *row = g.outl + (size_t)t * p.k * (w + 2);
        for (uint32_t s = 0; s < p.k; s++) {
          uint32_t c = w == 1 ? row[s] : ld_u16(row, 2 * (size_t)s);
          if (c < D && c % 32 == lane) add_at(y, c / 32, f16_to_f32(ld_u16(row, (size_t)p.k * w + 2 * s)));
        }
      } else if (g.outl) {
        uint32_t s0 = ld_le32(g.outl, 4 * (size_t)t), s1 = ld_le32(g.outl, 4 * ((size_t)t + 1));
        uint32_t cnt = s1 > s0 ? (s1 - s0 < D ? s1 - s0 : D) : 0u;
        const uint8_t *ent = g.outl + 4 * ((size_t)cap + 1) + (size_t)s0 * (w + 2);
        for (uint32_t s = 0; s < cnt; s++, ent += w + 2) {
          uint32_t c = w == 1 ? ent[0] : ld_u16(ent, 0);
          if (c < D && c % 32 == lane) add_at(y, c / 32, f16_to_f32(ld_u16(ent, w)));
        }
      }
    }
    if (!p.prerope) {
#pragma unroll
      for (uint32_t i = 0; i < kSlots; i++) {
        uint32_t c = lane + 32 * i;
        if (i < npl && c < D) store_elem(drow, out, c, y[i]);
      }
      continue;
    }
    float *ys = sh_y[warp];
#pragma unroll
    for (uint32_t i = 0; i < kSlots; i++) {
      uint32_t c = lane + 32 * i;
      if (i < npl && c < D) ys[c] = y[i];
    }
    __syncwarp();
    uint32_t half = p.rope_dims / 2;
    double pos = (double)(j.pos0 + t);
    for (uint32_t i = lane; i < half; i += 32) {
      double sd, cd;
      sincos_det(__dmul_rn(pos, __ldg(&p.inv_freq[i])), sd, cd);
      float cs = __double2float_rn(cd), sn = __double2float_rn(sd), a = ys[i], bb = ys[i + half];
      store_elem(drow, out, i, __fsub_rn(__fmul_rn(a, cs), __fmul_rn(bb, sn)));
      store_elem(drow, out, i + half, __fadd_rn(__fmul_rn(bb, cs), __fmul_rn(a, sn)));
    }
    for (uint32_t c = p.rope_dims + lane; c < D; c += 32) store_elem(drow, out, c, ys[c]);
    __syncwarp(); /* ys is reused by the next row */
  }
}


/* The decode of kvquant_decode by tiles, for D a multiple of 8: a thread
 * owns 8 consecutive channels (an octet) of one row, so a CTA of T threads
 * decodes P = 8 T / D rows a pass, every load of the pass issued before a
 * value is needed. The row's outliers are walked by each of its threads in
 * row order (the same addresses across the row's threads: broadcasts), a
 * thread adding those in its octet; the per-channel tables come as 16-byte
 * loads; the row leaves in 16-byte stores where dst allows. Pre-RoPE keys
 * meet their pair's channels through shared memory (the pass's values and
 * its angles, computed once per (row, pair)), the only barriers, taken by
 * every thread when p.prerope. The arithmetic is kvquant_decode's,
 * operation for operation, so the bits are the host's. */
constexpr uint32_t kTileThreads = 128;
constexpr uint32_t kTileElems = kTileThreads * 8; /* P x D */

/* The tiles take D in octets (D <= KVP__KVQ_DEV_MAX_DIM < kTileElems);
 * the launchers ask on the host, kvquant_decode_job on the device. */
__host__ __device__ inline bool kvquant_tile_ok(const kvp__kvq_kparams &p) {
  return p.head_dim % 8 == 0 && p.head_dim <= kTileElems;
}

/* 8 floats at q (16-byte aligned or not). */
KVP_D void ld_f32x8(float (&v)[8], const float *q) {
  if (((uintptr_t)q & 15) == 0) {
    float4 a = __ldg((const float4 *)q), b = __ldg((const float4 *)q + 1);
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
  } else {
#pragma unroll
    for (uint32_t i = 0; i < 8; i++) v[i] = __ldg(&q[i]);
  }
}

/* y[c - c0] += v when channel c is in the octet from c0. */
KVP_D void add_octet(float (&y)[8], uint32_t c, uint32_t c0, float v) {
  uint32_t i = c - c0;
#pragma unroll
  for (uint32_t u = 0; u < 8; u++)
    if (i == u) y[u] = __fadd_rn(y[u], v);
}

/* A top-k OUTLIERS row's residuals (k channels of w bytes, then k fp16)
 * added in row order, those in the octet from c0. */
KVP_D void add_topk_octet(float (&y)[8], const uint8_t *orow, uint32_t k, uint32_t w, uint32_t c0) {
  for (uint32_t s = 0; s < k; s++) {
    const uint32_t c = w == 1 ? orow[s] : ld_u16(orow, 2 * (size_t)s);
    if (c - c0 < 8u) add_octet(y, c, c0, f16_to_f32(ld_u16(orow, (size_t)k * w + 2 * s)));
  }
}

KVP_D void kvquant_decode_tile(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  using namespace kvq_;
  __shared__ __align__(16) float sh_y[kTileElems];
  __shared__ float sh_cs[kTileElems / 2], sh_sn[kTileElems / 2];
  const uint32_t D = p.head_dim, P = kTileElems / D, b = p.bits, mask = (1u << b) - 1u, w = p.cw;
  const uint32_t tid = threadIdx.x, r_in = tid * 8 / D, c0 = tid * 8 % D;
  const uint32_t half = p.prerope ? p.rope_dims / 2 : 0u;
  Pages g = pages_of(p, j);
  const bool waligned = (uintptr_t)g.codes % 4 == 0 && p.row_bytes % 4 == 0;
  const size_t esz = dtype_bytes(p.in_dtype);
  const bool vst = ((uintptr_t)j.dst | j.stride_bytes) % 16 == 0;
  const uint32_t words = p.row_bytes / 4, bit = b * c0, wi = bit >> 5, sh = bit & 31u;
  float rg[8], of[8];
  if (p.kv == 0) /* the head's per-channel tables, once */
    ld_f32x8(of, p.off + (size_t)j.head * D + c0), ld_f32x8(rg, p.rng + (size_t)j.head * D + c0);
  for (uint32_t base = 0; base < j.m; base += P) {
    const uint32_t r = base + r_in, t = j.t0 + r;
    const bool act = tid < P * D / 8 && r < j.m;
    float y[8];
    if (act && t < g.ns) {
      const uint8_t *rrow = g.raw + (size_t)t * D * esz;
#pragma unroll
      for (uint32_t i = 0; i < 8; i++) y[i] = load_elem(rrow, p.in_dtype, c0 + i);
    } else if (act) {
      const uint8_t *crow = g.codes + (size_t)t * p.row_bytes;
      uint32_t w0 = ld_word(crow, wi, waligned), w1 = wi + 1 < words ? ld_word(crow, wi + 1, waligned) : 0u;
      uint32_t cw = sh ? (w0 >> sh) | (w1 << (32 - sh)) : w0; /* the octet's 8 b <= 32 bits */
      float M = 0.0f, R = 0.0f;
      if (p.kv) {
        uint32_t rec = waligned ? *(const uint32_t *)(g.scales + (size_t)t * 4) : ld_le32(g.scales, (size_t)t * 4);
        M = f16_to_f32(rec & 0xFFFFu), R = f16_to_f32(rec >> 16);
      }
#pragma unroll
      for (uint32_t i = 0; i < 8; i++) {
        float lut = __ldg(&p.lut[cw >> (b * i) & mask]);
        y[i] = p.kv == 0 ? __fadd_rn(__fmul_rn(lut, rg[i]), of[i]) : __fadd_rn(__fmul_rn(lut, R), M);
      }
      if (g.outl && !p.thresh) {
        add_topk_octet(y, g.outl + (size_t)t * p.k * (w + 2), p.k, w, c0);
      } else if (g.outl) {
        uint32_t s0 = ld_le32(g.outl, 4 * (size_t)t), s1 = ld_le32(g.outl, 4 * ((size_t)t + 1));
        uint32_t cnt = s1 > s0 ? (s1 - s0 < D ? s1 - s0 : D) : 0u;
        const uint8_t *ent = g.outl + 4 * ((size_t)j.cap_tokens + 1) + (size_t)s0 * (w + 2);
        for (uint32_t s = 0; s < cnt; s++, ent += w + 2) {
          uint32_t c = w == 1 ? ent[0] : ld_u16(ent, 0);
          if (c - c0 < 8u) add_octet(y, c, c0, f16_to_f32(ld_u16(ent, w)));
        }
      }
    }
    if (half) { /* the pair's channels through shared memory */
      if (act) {
        float4 *ys = (float4 *)&sh_y[r_in * D + c0];
        ys[0] = make_float4(y[0], y[1], y[2], y[3]), ys[1] = make_float4(y[4], y[5], y[6], y[7]);
      }
      for (uint32_t e = tid; e < P * half; e += blockDim.x) { /* the pass's angles: (row, pair) */
        uint32_t rr = e / half, i = e % half;
        if (base + rr >= j.m) continue;
        double sd, cd;
        sincos_det(__dmul_rn((double)(j.pos0 + j.t0 + base + rr), __ldg(&p.inv_freq[i])), sd, cd);
        sh_cs[e] = __double2float_rn(cd), sh_sn[e] = __double2float_rn(sd);
      }
      __syncthreads();
      if (act) {
        const float *yr = &sh_y[r_in * D], *cs = &sh_cs[r_in * half], *sn = &sh_sn[r_in * half];
        float v[8];
#pragma unroll
        for (uint32_t i = 0; i < 8; i++) {
          uint32_t c = c0 + i;
          if (c < half) v[i] = __fsub_rn(__fmul_rn(y[i], cs[c]), __fmul_rn(yr[c + half], sn[c]));
          else if (c < 2 * half) v[i] = __fadd_rn(__fmul_rn(y[i], cs[c - half]), __fmul_rn(yr[c - half], sn[c - half]));
          else v[i] = y[i];
        }
#pragma unroll
        for (uint32_t i = 0; i < 8; i++) y[i] = v[i];
      }
      __syncthreads(); /* the pass's shared values are read */
    }
    if (!act) continue;
    store_octet((char *)j.dst + (size_t)r * j.stride_bytes, out, c0, y, vst);
  }
}

/* The tile decode's common case with nothing left to decide per octet:
 * B bits and the side (K per channel, V per token) are template
 * parameters, and the job has no RAW row in its range, no rotation,
 * top-k or no outliers, a 2-byte out dtype, 16-byte aligned dst rows and
 * 4-byte aligned CODES (and SCALES) pages (kvquant_lean_ok). The codebook
 * is read from shared memory; an octet's codes are one 32-bit word (B = 2,
 * 4) or a funnel of two (B = 3); a thread walks its rows by pointer
 * increments. The arithmetic is kvquant_decode_tile's, operation for
 * operation (the bits are the host's). One barrier a job (the codebook),
 * taken by every thread of the CTA. */
__host__ __device__ inline bool kvquant_lean_binding_ok(const kvp__kvq_kparams &p, uint32_t out) {
  return kvquant_tile_ok(p) && p.bits >= 2 && p.bits <= 4 && !(p.prerope && p.rope_dims) && !p.thresh &&
         out != KVP_DTYPE_F32 && p.row_bytes % 4 == 0;
}
__host__ __device__ inline bool kvquant_lean_job_ok(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j) {
  const uintptr_t scales = p.kv ? (uintptr_t)j.pages[p.kmax ? 2 : 1] : 0;
  return (uint64_t)j.pos0 + j.t0 >= p.sink && (uintptr_t)j.pages[0] % 4 == 0 && scales % 4 == 0 &&
         ((uintptr_t)j.dst | j.stride_bytes) % 16 == 0;
}
__host__ __device__ inline bool kvquant_lean_ok(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  return kvquant_lean_binding_ok(p, out) && kvquant_lean_job_ok(p, j);
}

template <uint32_t B, uint32_t KV>
KVP_D void kvquant_decode_lean(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  using namespace kvq_;
  constexpr uint32_t mask = (1u << B) - 1u;
  __shared__ float sh_lut[16];
  const uint32_t tid = threadIdx.x;
  if (tid <= mask) sh_lut[tid] = __ldg(&p.lut[tid]);
  __syncthreads();
  const uint32_t O = p.head_dim / 8, P = kTileThreads / O, r_in = tid / O, c0 = (tid - r_in * O) * 8;
  if (r_in >= P || r_in >= j.m) return;
  const uint32_t bit = B * c0, sh = bit & 31u, k = p.k, w = p.cw;
  const bool two = B == 3 && (bit >> 5) + 1 < p.row_bytes / 4;
  const uint8_t *outl = p.kmax ? (const uint8_t *)j.pages[1] : nullptr;
  const uint8_t *scales = KV ? (const uint8_t *)j.pages[p.kmax ? 2 : 1] : nullptr;
  const size_t cstep = (size_t)P * p.row_bytes, dstep = (size_t)P * j.stride_bytes;
  const uint8_t *crow = (const uint8_t *)j.pages[0] + (size_t)(j.t0 + r_in) * p.row_bytes + 4 * (bit >> 5);
  char *drow = (char *)j.dst + (size_t)r_in * j.stride_bytes + 2 * (size_t)c0;
  const bool bf = out == kBF16;
  float rg[8], of[8];
  if (!KV) ld_f32x8(of, p.off + (size_t)j.head * p.head_dim + c0), ld_f32x8(rg, p.rng + (size_t)j.head * p.head_dim + c0);
  for (uint32_t r = r_in; r < j.m; r += P, crow += cstep, drow += dstep) {
    const uint32_t t = j.t0 + r;
    const uint32_t w0 = *(const uint32_t *)crow, w1 = two ? *(const uint32_t *)(crow + 4) : 0u;
    const uint32_t cw = B == 3 ? (sh ? (w0 >> sh) | (w1 << (32 - sh)) : w0) : w0 >> sh;
    float M = 0.0f, R = 0.0f;
    if (KV) {
      const uint32_t rec = *(const uint32_t *)(scales + (size_t)t * 4);
      M = f16_to_f32(rec & 0xFFFFu), R = f16_to_f32(rec >> 16);
    }
    float y[8];
#pragma unroll
    for (uint32_t i = 0; i < 8; i++) {
      const float lut = sh_lut[cw >> (B * i) & mask];
      y[i] = KV ? __fadd_rn(__fmul_rn(lut, R), M) : __fadd_rn(__fmul_rn(lut, rg[i]), of[i]);
    }
    if (outl) add_topk_octet(y, outl + (size_t)t * k * (w + 2), k, w, c0);
    *(uint4 *)drow = make_uint4(half2_from_f32(bf, y[0], y[1]), half2_from_f32(bf, y[2], y[3]),
                                half2_from_f32(bf, y[4], y[5]), half2_from_f32(bf, y[6], y[7]));
  }
}

/* f(B, KV) with the binding's bits (2..4, as kvquant_lean_binding_ok
 * allows) and side as integral constants: the one map from a binding to
 * its lean instantiation, for the device call below and the launchers. */
template <uint32_t V> struct KvqConst {
  static constexpr uint32_t value = V;
};
#ifdef __CUDACC__
#pragma nv_exec_check_disable /* f is a host lambda in the launchers, a device one in kvquant_decode_lean_any */
#endif
template <class F> __host__ __device__ inline void kvquant_lean_dispatch(const kvp__kvq_kparams &p, F &&f) {
  if (p.kv) {
    if (p.bits == 2) f(KvqConst<2>(), KvqConst<1>());
    else if (p.bits == 3) f(KvqConst<3>(), KvqConst<1>());
    else f(KvqConst<4>(), KvqConst<1>());
  } else {
    if (p.bits == 2) f(KvqConst<2>(), KvqConst<0>());
    else if (p.bits == 3) f(KvqConst<3>(), KvqConst<0>());
    else f(KvqConst<4>(), KvqConst<0>());
  }
}

KVP_D void kvquant_decode_lean_any(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  kvquant_lean_dispatch(p, [&](auto B, auto KV) { kvquant_decode_lean<decltype(B)::value, decltype(KV)::value>(p, j, out); });
}

/* The decode the kernels run: by tiles where the geometry allows. */
KVP_D void kvquant_decode_job(const kvp__kvq_kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  if (kvquant_lean_ok(p, j, out)) kvquant_decode_lean_any(p, j, out);
  else if (kvquant_tile_ok(p)) kvquant_decode_tile(p, j, out);
  else kvquant_decode(p, j, out);
}

} // namespace kvpk

#endif /* KVP_KERNELS_KVQUANT_CUH */
