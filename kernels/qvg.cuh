/*
 * kernels/qvg.cuh - the QVG codec on the device (host twin codecs/qvg.c,
 * whose banner defines the pages; codecs/kmeans.c the k-means): k-means++
 * seeding and Lloyd's iterations per block (a segment of one head), stage
 * after stage on the residual of the last, the final residual quantized to
 * INT2/INT4 with an FP8 E4M3 scale per group; decode adds the stages'
 * centroids back.
 *
 *   CODES      cap x D*b/8: token t's codes q + Q, most significant first
 *   SCALES     cap x D/g: E4M3 scale codes
 *   CENTROIDS  S x Kc x D bf16 (Kc = min(K, cap); Ka = min(Kc, n) fitted)
 *   ASSIGN     S x cap u8: the centroid of token t at stage s
 *
 * The pages are the host's byte for byte, by construction: every float
 * operation is the host's, in the host's order, rounded on its own
 * (__f*_rn, __d*_rn, and the build's --fmad=false):
 *   - a squared distance or a score accumulates its D terms in the order
 *     i = 0..D-1, one thread per (row, centroid);
 *   - the k-means++ draw sums integer weights (codecs/kmeans.c km_wq), so
 *     the CTA's parallel prefix gives the host's row;
 *   - a centroid update sums its members in ascending row order in double
 *     (the members listed per centroid first, then one thread per
 *     (centroid, channel)), divides once and rounds to f32;
 *   - residuals are not stored: r_s(t, i) = x(t, i) - C_0[a_0(t)](i) - ...
 *     - C_(s-1)[a_(s-1)(t)](i), subtracted in stage order from the stored
 *     bf16 centroids and assignments, as the host subtracts them in place.
 * tests/unit/xcheck_qvg_emu.cpp runs these functions on the CPU against
 * the host codec: equal pages, equal state, equal decode.
 *
 * Thread mapping: one CTA of kQvgThreads per job; rows strided over threads
 * (a thread scores two rows against four centroids at once: eight
 * independent sums, each still in i order, six loads for sixteen float
 * operations), the draw's prefix over contiguous row ranges (one per
 * thread). Scratch
 * (QvgWs, in global memory, kvp__qvg_ws_bytes per job): the f32 centroids,
 * their norms, the seeding weights (reused as the member lists) and the
 * member counts.
 *
 * Not yet measured on a GPU (see kernels/qvg.cu).
 */
#ifndef KVP_KERNELS_QVG_CUH
#define KVP_KERNELS_QVG_CUH

#include "common.cuh"

namespace kvpk {
namespace qvg_ {

enum { kCodes = 0, kScales = 1, kCent = 2, kAssign = 3 };

/* A job's scratch, carved from ws (16-byte aligned pieces). */
struct QvgWs {
  float *cent;  /* Kc x D: the centroids being fitted */
  float *cn;    /* Kc: their squared norms */
  uint32_t *w;  /* cap: seeding weights (f32 bits), then member lists */
  uint32_t *cnt; /* 2 Kc: members of each centroid, then where its list starts */
};

KVP_D size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }

KVP_D uint32_t kc_of(const kvp__qvg_kparams &p, uint32_t cap) { return p.k < cap ? p.k : cap; }

KVP_D QvgWs carve(const kvp__qvg_kparams &p, uint32_t cap, void *ws) {
  uint32_t kc = kc_of(p, cap);
  uint8_t *b = (uint8_t *)ws;
  QvgWs w;
  w.cent = (float *)b, b += align16((size_t)kc * p.head_dim * 4);
  w.cn = (float *)b, b += align16((size_t)kc * 4);
  w.w = (uint32_t *)b, b += align16((size_t)cap * 4);
  w.cnt = (uint32_t *)b;
  return w;
}

/* xorshift64*, the host's km_rand. */
KVP_D uint64_t km_rand(uint64_t &s) {
  s ^= s >> 12;
  s ^= s << 25;
  s ^= s >> 27;
  return s * 0x2545F4914F6CDD1DULL;
}

/* Threads of an encode CTA: one job is a whole k-means problem, so the CTA
 * is large; 512 leave each thread the 120 registers its eight score sums
 * take without spills on sm_90 (1024 would cap it at 64 and spill), and the
 * eight independent sums hide the adds' latency. Block reductions go
 * through warp shuffles and one word per warp. */
constexpr uint32_t kQvgThreads = 512;

/* max of v over the CTA, to every thread (non-negative floats). */
KVP_D float block_max(float v) {
  __shared__ float s_w[32];
  for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  if ((threadIdx.x & 31) == 0) s_w[threadIdx.x >> 5] = v;
  __syncthreads();
  float m = 0.0f;
  for (uint32_t i = 0; i < blockDim.x >> 5; i++) m = fmaxf(m, s_w[i]);
  __syncthreads();
  return m;
}

/* sum of v over the CTA, to every thread. */
KVP_D uint32_t block_sum(uint32_t v) {
  __shared__ uint32_t s_w[32];
  v = warp_sum_u32(v);
  if ((threadIdx.x & 31) == 0) s_w[threadIdx.x >> 5] = v;
  __syncthreads();
  uint32_t t = 0;
  for (uint32_t i = 0; i < blockDim.x >> 5; i++) t += s_w[i];
  __syncthreads();
  return t;
}

/* The exclusive prefix of v over the CTA's threads in order, and the total. */
KVP_D uint64_t block_scan(uint64_t v, uint64_t &total) {
  __shared__ unsigned long long s_w[32];
  uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  uint64_t x = v;
  for (uint32_t o = 1; o < 32; o <<= 1) {
    uint64_t y = __shfl_up_sync(0xFFFFFFFFu, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) s_w[w] = x;
  __syncthreads();
  uint64_t base = 0, t = 0;
  for (uint32_t i = 0; i < blockDim.x >> 5; i++) {
    if (i < w) base += s_w[i];
    t += s_w[i];
  }
  __syncthreads();
  total = t;
  return base + x - v;
}

/* The CTA's view of one job. */
struct Ctx {
  const kvp__qvg_kparams &p;
  const kvp_codec_dev_job &j;
  QvgWs ws;
  uint32_t D, n, cap, kc, ka;
  const uint8_t *src;
  uint8_t *cent_pg, *asg_pg;
};

/* Element i of token t's residual before stage s (the host's r in place). */
KVP_D float res(const Ctx &c, uint32_t t, uint32_t i, uint32_t s) {
  float v = load_elem(c.src + (size_t)t * c.j.stride_bytes, c.p.in_dtype, i);
  for (uint32_t u = 0; u < s; u++) {
    uint32_t a = c.asg_pg[(size_t)u * c.cap + t];
    v = __fsub_rn(v, bf16_to_f32(ld_u16(c.cent_pg, 2 * (((size_t)u * c.kc + a) * c.D + i))));
  }
  return v;
}

/* ---- k-means++ seeding -------------------------------------------------------- */

/* w[t] = min(w[t], ||r_t - cent_j||^2) (= it when init), rows strided. */
KVP_D void near(const Ctx &c, uint32_t s, uint32_t jc, bool init) {
  const float *cj = c.ws.cent + (size_t)jc * c.D;
  for (uint32_t t = threadIdx.x; t < c.n; t += blockDim.x) {
    float acc = 0.0f;
    for (uint32_t i = 0; i < c.D; i++) {
      float e = __fsub_rn(res(c, t, i, s), cj[i]);
      acc = __fadd_rn(acc, __fmul_rn(e, e));
    }
    if (init || acc < __uint_as_float(c.ws.w[t])) c.ws.w[t] = __float_as_uint(acc);
  }
  __syncthreads();
}

/* cent_j = r_t, then a barrier. */
KVP_D void take_row(const Ctx &c, uint32_t s, uint32_t jc, uint32_t t) {
  for (uint32_t i = threadIdx.x; i < c.D; i += blockDim.x) c.ws.cent[(size_t)jc * c.D + i] = res(c, t, i, s);
  __syncthreads();
}

KVP_D uint64_t wq_of(float w, float wmax, int e) {
  return (uint64_t)ldexp((double)fminf(w, wmax), 32 - e);
}

/* The host's km_draw: every thread calls it (and km_rand) alike. */
KVP_D uint32_t draw(const Ctx &c, uint64_t &rs) {
  __shared__ uint32_t s_pick;
  uint32_t T = blockDim.x, tid = threadIdx.x, chunk = (c.n + T - 1) / T;
  uint32_t lo = tid * chunk < c.n ? tid * chunk : c.n, hi = lo + chunk < c.n ? lo + chunk : c.n;
  float m = 0.0f;
  for (uint32_t t = lo; t < hi; t++) m = fmaxf(m, __uint_as_float(c.ws.w[t]));
  float wmax = block_max(m);
  if (!(wmax > 0.0f)) return c.n;
  uint64_t u = km_rand(rs) >> 11;
  if (!finite(wmax)) wmax = 3.40282347e38f;
  int e;
  frexp((double)wmax, &e);
  uint64_t mine = 0, total;
  for (uint32_t t = lo; t < hi; t++) mine += wq_of(__uint_as_float(c.ws.w[t]), wmax, e);
  if (tid == 0) s_pick = c.n - 1;
  uint64_t base = block_scan(mine, total); /* its barriers order s_pick's store before the search */
  uint64_t r = __umul64hi(u, total) << 11 | (u * total) >> 53; /* floor(u total / 2^53) < total */
  if (base <= r && r < base + mine) {
    uint64_t cum = base;
    for (uint32_t t = lo; t < hi; t++) {
      cum += wq_of(__uint_as_float(c.ws.w[t]), wmax, e);
      if (cum > r) {
        s_pick = t;
        break;
      }
    }
  }
  __syncthreads();
  uint32_t t = s_pick;
  __syncthreads();
  return t;
}

/* The host's kvp__km_seed: centroids [0, have) given. */
KVP_D void seed(const Ctx &c, uint32_t s, uint32_t have, uint64_t seed_val) {
  uint64_t rs = seed_val * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  if (have >= c.ka) return;
  if (have == 0) {
    take_row(c, s, 0, (uint32_t)(km_rand(rs) % c.n));
    have = 1;
  }
  for (uint32_t jc = 0; jc < have; jc++) near(c, s, jc, jc == 0);
  for (; have < c.ka; have++) {
    uint32_t t = draw(c, rs);
    if (t == c.n) break;
    take_row(c, s, have, t);
    near(c, s, have, false);
  }
  for (uint32_t e = threadIdx.x; e < (c.ka - have) * c.D; e += blockDim.x)
    c.ws.cent[(size_t)have * c.D + e] = c.ws.cent[e % c.D];
  __syncthreads();
}

/* ---- Lloyd -------------------------------------------------------------------------- */

/* Label every row with its nearest centroid into ASSIGN stage s; returns
 * (to every thread) how many labels changed (all when fresh). */
KVP_D uint32_t assign(const Ctx &c, uint32_t s, bool fresh) {
  for (uint32_t jc = threadIdx.x; jc < c.ka; jc += blockDim.x) {
    const float *cj = c.ws.cent + (size_t)jc * c.D;
    float nrm = 0.0f;
    for (uint32_t i = 0; i < c.D; i++) nrm = __fadd_rn(nrm, __fmul_rn(cj[i], cj[i]));
    c.ws.cn[jc] = nrm;
  }
  __syncthreads();
  uint8_t *lab = c.asg_pg + (size_t)s * c.cap;
  uint32_t changed = 0, T = blockDim.x;
  float a[2][KVP__QVG_DEV_MAX_DIM]; /* -2 r_t of the thread's two rows (the second 0 past n) */
  for (uint32_t t = threadIdx.x; t < c.n; t += 2 * T) {
    uint32_t nr = t + T < c.n ? 2 : 1;
    for (uint32_t i = 0; i < c.D; i++) {
      a[0][i] = __fmul_rn(-2.0f, res(c, t, i, s));
      a[1][i] = nr == 2 ? __fmul_rn(-2.0f, res(c, t + T, i, s)) : 0.0f;
    }
    uint32_t best[2] = {0, 0}, jc = 0;
    float sb[2] = {0.0f, 0.0f};
    for (; jc + 4 <= c.ka; jc += 4) { /* 2 rows x 4 centroids: eight independent sums, each in i order */
      const float *c0 = c.ws.cent + (size_t)jc * c.D;
      float sc[2][4];
      for (uint32_t q = 0; q < 4; q++) sc[0][q] = sc[1][q] = c.ws.cn[jc + q];
      for (uint32_t i = 0; i < c.D; i++) {
        float a0 = a[0][i], a1 = a[1][i];
        for (uint32_t q = 0; q < 4; q++) {
          float cq = c0[q * c.D + i];
          sc[0][q] = __fadd_rn(sc[0][q], __fmul_rn(a0, cq));
          sc[1][q] = __fadd_rn(sc[1][q], __fmul_rn(a1, cq));
        }
      }
      for (uint32_t r = 0; r < 2; r++)
        for (uint32_t q = 0; q < 4; q++)
          if (jc + q == 0 || sc[r][q] < sb[r]) best[r] = jc + q, sb[r] = sc[r][q];
    }
    for (; jc < c.ka; jc++) {
      const float *cj = c.ws.cent + (size_t)jc * c.D;
      for (uint32_t r = 0; r < 2; r++) {
        float sc = c.ws.cn[jc];
        for (uint32_t i = 0; i < c.D; i++) sc = __fadd_rn(sc, __fmul_rn(a[r][i], cj[i]));
        if (jc == 0 || sc < sb[r]) best[r] = jc, sb[r] = sc;
      }
    }
    for (uint32_t r = 0; r < nr; r++) {
      uint32_t tr = t + r * T;
      if (fresh || lab[tr] != best[r]) changed++;
      lab[tr] = (uint8_t)best[r];
    }
  }
  return block_sum(changed);
}

/* Each centroid to the mean of its rows (double sums in row order, one
 * rounding); an empty cluster keeps its centroid. */
KVP_D void update(const Ctx &c, uint32_t s) {
  const uint8_t *lab = c.asg_pg + (size_t)s * c.cap;
  uint32_t *cnt = c.ws.cnt, *start = c.ws.cnt + c.kc, *list = c.ws.w;
  for (uint32_t jc = threadIdx.x; jc < c.ka; jc += blockDim.x) {
    uint32_t k = 0;
    for (uint32_t t = 0; t < c.n; t++) k += lab[t] == jc;
    cnt[jc] = k;
  }
  __syncthreads();
  if (threadIdx.x == 0)
    for (uint32_t jc = 0, at = 0; jc < c.ka; jc++) start[jc] = at, at += cnt[jc];
  __syncthreads();
  for (uint32_t jc = threadIdx.x; jc < c.ka; jc += blockDim.x)
    for (uint32_t t = 0, at = start[jc]; t < c.n; t++)
      if (lab[t] == jc) list[at++] = t;
  __syncthreads();
  for (uint32_t e = threadIdx.x; e < c.ka * c.D; e += blockDim.x) {
    uint32_t jc = e / c.D, i = e % c.D, k = cnt[jc];
    if (!k) continue;
    double sum = 0.0;
    for (uint32_t m = 0; m < k; m++) sum = __dadd_rn(sum, (double)res(c, list[start[jc] + m], i, s));
    c.ws.cent[e] = __double2float_rn(__ddiv_rn(sum, (double)k));
  }
  __syncthreads();
}

/* The fitted centroids rounded to bf16 into CENTROIDS stage s (and the
 * scratch), every row reassigned to them into ASSIGN stage s. */
KVP_D void stage_out(const Ctx &c, uint32_t s) {
  for (uint32_t e = threadIdx.x; e < c.ka * c.D; e += blockDim.x) {
    uint32_t b = bf16_from_f32(c.ws.cent[e]);
    st_u16(c.cent_pg, 2 * ((size_t)s * c.kc * c.D + e), b);
    c.ws.cent[e] = bf16_to_f32(b);
  }
  __syncthreads();
  assign(c, s, false);
}

/* ---- the final quantizer ------------------------------------------------------------ */

KVP_D void quant_rows(const Ctx &c) {
  const kvp__qvg_kparams &p = c.p;
  uint32_t D = c.D, ng = D / p.group, rb = D * p.bits / 8;
  float qm = (float)((1u << (p.bits - 1)) - 1);
  uint8_t *codes = (uint8_t *)c.j.pages[kCodes], *scales = (uint8_t *)c.j.pages[kScales];
  for (uint32_t t = threadIdx.x; t < c.n; t += blockDim.x) {
    uint8_t *row = codes + (size_t)t * rb;
    for (uint32_t g = 0; g < ng; g++) {
      uint32_t g0 = g * p.group;
      float amax = 0.0f;
      for (uint32_t i = g0; i < g0 + p.group; i++) amax = fmaxf(amax, fabsf(res(c, t, i, p.stages)));
      uint32_t sc = fp8_from_f32(__fdiv_rn(amax, qm));
      float sv = fp8_to_f32(sc);
      scales[(size_t)t * ng + g] = (uint8_t)sc;
      uint32_t acc = 0, nacc = 0;
      for (uint32_t i = g0; i < g0 + p.group; i++) {
        float v = sc ? rintf(__fdiv_rn(res(c, t, i, p.stages), sv)) : 0.0f;
        v = fminf(fmaxf(v, -qm), qm);
        acc = acc << p.bits | (uint32_t)(v + qm);
        nacc += p.bits;
        if (nacc == 8) row[i * p.bits / 8] = (uint8_t)acc, acc = 0, nacc = 0;
      }
    }
  }
}

/* ---- one job ---------------------------------------------------------------------------- */

/* Zero every byte of the job's pages (the host encode starts so). */
KVP_D void zero_pages(const kvp__qvg_kparams &p, const kvp_codec_dev_job &j) {
  uint64_t cap = j.cap_tokens, D = p.head_dim, kc = p.k < cap ? p.k : cap;
  uint64_t bytes[4] = {cap * D * p.bits / 8, cap * (D / p.group), p.stages * kc * D * 2, p.stages * cap};
  for (uint32_t pg = 0; pg < (p.stages ? 4u : 2u); pg++)
    for (uint64_t b = threadIdx.x; b < bytes[pg]; b += blockDim.x) ((uint8_t *)j.pages[pg])[b] = 0;
  __syncthreads();
}

/* Encode job j (rows [0, j.n) from j.src) into its pages; j.dst is the
 * stream's device state (codecs/qvg.c's layout) or NULL (a cold start, no
 * state kept). ws: kvp__qvg_ws_bytes(p, j.cap_tokens) bytes of scratch. */
KVP_D void qvg_encode(const kvp__qvg_kparams &p, const kvp_codec_dev_job &j, void *ws, uint32_t job,
                      unsigned long long *status) {
  zero_pages(p, j);
  uint32_t n = j.n, D = p.head_dim;
  if (n == 0) return;
  for (uint64_t e = threadIdx.x; e < (uint64_t)n * D; e += blockDim.x)
    check_finite(load_elem((const uint8_t *)j.src + (e / D) * j.stride_bytes, p.in_dtype, (uint32_t)(e % D)), status,
                 job, (uint32_t)(e / D), D, (uint32_t)(e % D));
  uint32_t kc = kc_of(p, j.cap_tokens);
  Ctx c{p, j, carve(p, j.cap_tokens, ws), D, n, j.cap_tokens, kc, kc < n ? kc : n, (const uint8_t *)j.src,
        (uint8_t *)j.pages[kCent], (uint8_t *)j.pages[kAssign]};
  uint8_t *state = (uint8_t *)j.dst;
  if (p.stages) {
    uint32_t kw = state ? (uint32_t)state[0] | (uint32_t)state[1] << 8 | (uint32_t)state[2] << 16 |
                              (uint32_t)state[3] << 24
                        : 0;
    uint32_t nwarm = kw < c.ka ? kw : c.ka;
    for (uint32_t s = 0; s < p.stages; s++) {
      const uint8_t *warm = nwarm ? state + 8 + (size_t)s * p.k * D * 2 : nullptr;
      for (uint32_t e = threadIdx.x; e < nwarm * D; e += blockDim.x) c.ws.cent[e] = bf16_to_f32(ld_u16(warm, 2 * e));
      __syncthreads();
      seed(c, s, nwarm, 0x51564730ULL + s);
      assign(c, s, true); /* the host's kvp__km_lloyd */
      for (uint32_t it = 0; it < p.iters; it++) {
        update(c, s);
        if (!assign(c, s, false)) break;
      }
      stage_out(c, s);
    }
    __syncthreads();
    if (state) { /* every thread read kw above, before the barrier */
      for (uint32_t b = threadIdx.x; b < 8; b += blockDim.x) state[b] = b < 4 ? (uint8_t)(c.ka >> 8 * b) : 0;
      for (uint32_t s = 0; s < p.stages; s++)
        for (uint32_t b = threadIdx.x; b < c.ka * D * 2; b += blockDim.x)
          state[8 + (size_t)s * p.k * D * 2 + b] = c.cent_pg[(size_t)s * kc * D * 2 + b];
    }
  }
  quant_rows(c);
}

/* Rows [j.t0, j.t0 + j.m) into j.dst (out dtype), bit for bit the host's
 * decode; a row whose assignment is past Kc (a corrupt page) decodes to
 * NaN. Rows over threads, no barrier. */
KVP_D void qvg_decode(const kvp__qvg_kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  uint32_t D = p.head_dim, ng = D / p.group, rb = D * p.bits / 8, cap = j.cap_tokens, kc = kc_of(p, cap);
  int qm = (int)((1u << (p.bits - 1)) - 1);
  const uint8_t *codes = (const uint8_t *)j.pages[kCodes], *scales = (const uint8_t *)j.pages[kScales];
  const uint8_t *cent = (const uint8_t *)j.pages[kCent], *asg = (const uint8_t *)j.pages[kAssign];
  for (uint64_t e = threadIdx.x; e < (uint64_t)j.m * D; e += blockDim.x) {
    uint32_t r = (uint32_t)(e / D), i = (uint32_t)(e % D), t = j.t0 + r;
    uint32_t byte = codes[(size_t)t * rb + i * p.bits / 8], per = 8 / p.bits;
    uint32_t code = byte >> (8 - p.bits * (i % per + 1)) & ((1u << p.bits) - 1);
    float y = __fmul_rn((float)((int)code - qm), fp8_to_f32(scales[(size_t)t * ng + i / p.group]));
    for (uint32_t s = p.stages; s-- > 0;) {
      uint32_t a = asg[(size_t)s * cap + t];
      y = a < kc ? __fadd_rn(y, bf16_to_f32(ld_u16(cent, 2 * (((size_t)s * kc + a) * D + i)))) : f32(0x7FC00000u);
    }
    store_elem((uint8_t *)j.dst + (size_t)r * j.stride_bytes, out, i, y);
  }
}

} // namespace qvg_
} // namespace kvpk

#endif /* KVP_KERNELS_QVG_CUH */
