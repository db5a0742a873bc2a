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
 * Thread mapping: one CTA of kQvgThreads per job.
 *   - The residual lives in scratch as f32, channel-major (R[i][t], rows
 *     cap4 apart), updated in place after each stage exactly as the host
 *     subtracts: reads of a channel across a warp's rows are coalesced.
 *   - Labels (assign): the rows go through shared memory in tiles of kRT,
 *     as -2 r; warp w scores the tile against its slice of the centroids
 *     (a lane: four rows x four centroids, sixteen independent sums in i
 *     order, two 16-byte loads per step), then the slices' winners are
 *     merged in centroid order, which is the host's first-minimum scan
 *     (see pick()).
 *   - Seeding (near): a thread keeps kNearRows rows' sums at once.
 *   - Centroid update: per centroid member lists in row order, then one
 *     thread per (centroid, channel) sums its members in double.
 * Scratch (QvgWs, global memory, kvp__qvg_ws_bytes per job): the f32
 * centroids (row-major and channel-major), their norms, the seeding
 * weights (reused as the member lists), the member counts and the
 * residual. Shared memory: qvg_smem_bytes (dynamic).
 */
#ifndef KVP_KERNELS_QVG_CUH
#define KVP_KERNELS_QVG_CUH

#include "common.cuh"

/* Unrolling where loads of independent iterations should be in flight at
 * once (latency from L2, not arithmetic, bounds those loops). */
#if defined(__CUDACC__)
#define KVP_QVG_PRAGMA(x) _Pragma(#x)
#define KVP_QVG_UNROLL(n) KVP_QVG_PRAGMA(unroll n)
#else
#define KVP_QVG_UNROLL(n)
#endif

namespace kvpk {
namespace qvg_ {

enum { kCodes = 0, kScales = 1, kCent = 2, kAssign = 3 };

/* A job's scratch, carved from ws (16-byte aligned pieces). */
struct QvgWs {
  float *cent;   /* Kc x D: the centroids being fitted */
  float *centT;  /* D x Kc4: the same, channel-major, for the labels */
  float *cn;     /* Kc4: their squared norms */
  uint32_t *w;   /* cap: seeding weights (f32 bits), then member lists */
  uint32_t *cnt; /* 2 Kc: members of each centroid, then where its list starts */
  float *r;      /* D x cap4: the residual, channel-major */
};

KVP_D size_t align16(size_t x) { return (x + 15) & ~(size_t)15; }

KVP_D uint32_t kc_of(const kvp__qvg_kparams &p, uint32_t cap) { return p.k < cap ? p.k : cap; }

KVP_D QvgWs carve(const kvp__qvg_kparams &p, uint32_t cap, void *ws) {
  uint32_t kc = kc_of(p, cap), kc4 = (kc + 3) & ~3u;
  uint8_t *b = (uint8_t *)ws;
  QvgWs w;
  w.cent = (float *)b, b += align16((size_t)kc * p.head_dim * 4);
  w.centT = (float *)b, b += align16((size_t)kc4 * p.head_dim * 4);
  w.cn = (float *)b, b += align16((size_t)kc4 * 4);
  w.w = (uint32_t *)b, b += align16((size_t)cap * 4);
  w.cnt = (uint32_t *)b, b += align16((size_t)kc * 8);
  w.r = (float *)b;
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
 * is large; 512 leave each thread the 128 registers its sixteen score sums
 * take. kRT rows per label tile: four per lane. Block reductions go
 * through warp shuffles and one word per warp. */
constexpr uint32_t kQvgThreads = 512;
constexpr uint32_t kRT = 128;

/* Dynamic shared memory of an encode CTA: the tile (D x kRT f32), each
 * warp's winner per row (score and index) and whether a row's score
 * against centroid 0 is NaN. */
__host__ __device__ constexpr uint32_t qvg_smem_bytes(uint32_t D) {
  return D * kRT * 4 + (kQvgThreads / 32) * kRT * 8 + kRT;
}

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
  uint32_t D, n, cap, cap4, kc, ka;
  uint8_t *cent_pg, *asg_pg;
  float *smem; /* qvg_smem_bytes(D) */
};

/* Element i of token t's residual at the current stage (the host's r in
 * place: x - C_0[a_0(t)] - ... - C_(s-1)[a_(s-1)(t)], subtracted in stage
 * order). */
KVP_D float res(const Ctx &c, uint32_t t, uint32_t i) { return c.ws.r[(size_t)i * c.cap4 + t]; }

/* R = the input rows, as f32 (exact). */
KVP_D void res_init(const Ctx &c) {
  for (uint64_t e = threadIdx.x; e < (uint64_t)c.n * c.D; e += blockDim.x) {
    uint32_t i = (uint32_t)(e / c.n), t = (uint32_t)(e % c.n);
    c.ws.r[(size_t)i * c.cap4 + t] = load_elem((const uint8_t *)c.j.src + (size_t)t * c.j.stride_bytes, c.p.in_dtype, i);
  }
  __syncthreads();
}

/* R -= the stored (bf16) centroid of each row at stage s. */
KVP_D void res_sub(const Ctx &c, uint32_t s) {
  for (uint64_t e = threadIdx.x; e < (uint64_t)c.n * c.D; e += blockDim.x) {
    uint32_t i = (uint32_t)(e / c.n), t = (uint32_t)(e % c.n), a = c.asg_pg[(size_t)s * c.cap + t];
    float *r = &c.ws.r[(size_t)i * c.cap4 + t];
    *r = __fsub_rn(*r, bf16_to_f32(ld_u16(c.cent_pg, 2 * (((size_t)s * c.kc + a) * c.D + i))));
  }
  __syncthreads();
}

/* ---- k-means++ seeding -------------------------------------------------------- */

/* w[t] = min(w[t], ||r_t - cent_j||^2) (= it when init): a thread keeps
 * kNearRows rows' sums (t, t + T, ...), each in i order, and the channel
 * loop is unrolled so that their loads (L2: the residual is megabytes)
 * are in flight together. */
constexpr uint32_t kNearRows = 8;
KVP_D void near(const Ctx &c, uint32_t jc, bool init) {
  const float *cj = c.ws.cent + (size_t)jc * c.D;
  uint32_t T = blockDim.x;
  for (uint32_t t = threadIdx.x; t < c.n; t += kNearRows * T) {
    uint32_t row[kNearRows];
    float acc[kNearRows];
    for (uint32_t u = 0; u < kNearRows; u++) row[u] = t + u * T < c.n ? t + u * T : c.n - 1, acc[u] = 0.0f;
    KVP_QVG_UNROLL(4)
    for (uint32_t i = 0; i < c.D; i++) {
      const float *ri = c.ws.r + (size_t)i * c.cap4;
      float ci = cj[i];
      for (uint32_t u = 0; u < kNearRows; u++) {
        float e = __fsub_rn(ri[row[u]], ci);
        acc[u] = __fadd_rn(acc[u], __fmul_rn(e, e));
      }
    }
    for (uint32_t u = 0; u < kNearRows && t + u * T < c.n; u++)
      if (init || acc[u] < __uint_as_float(c.ws.w[row[u]])) c.ws.w[row[u]] = __float_as_uint(acc[u]);
  }
  __syncthreads();
}

/* cent_j = r_t, then a barrier. */
KVP_D void take_row(const Ctx &c, uint32_t jc, uint32_t t) {
  for (uint32_t i = threadIdx.x; i < c.D; i += blockDim.x) c.ws.cent[(size_t)jc * c.D + i] = res(c, t, i);
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
KVP_D void seed(const Ctx &c, uint32_t have, uint64_t seed_val) {
  uint64_t rs = seed_val * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  if (have >= c.ka) return;
  if (have == 0) {
    take_row(c, 0, (uint32_t)(km_rand(rs) % c.n));
    have = 1;
  }
  for (uint32_t jc = 0; jc < have; jc++) near(c, jc, jc == 0);
  for (; have < c.ka; have++) {
    uint32_t t = draw(c, rs);
    if (t == c.n) break;
    take_row(c, have, t);
    near(c, have, false);
  }
  for (uint32_t e = threadIdx.x; e < (c.ka - have) * c.D; e += blockDim.x)
    c.ws.cent[(size_t)have * c.D + e] = c.ws.cent[e % c.D];
  __syncthreads();
}

/* ---- Lloyd -------------------------------------------------------------------------- */

/* The host's label scan over centroids 0..Ka-1 is "best = 0, then any
 * score < best's": the first minimum among the non-NaN scores, or 0 when
 * the score against centroid 0 is NaN (nothing compares below a NaN).
 * Split over slices of centroids, each slice keeps its first non-NaN
 * minimum (or none: -1), the slices merge in order with the same strict
 * <, and a NaN at centroid 0 overrides: the same label. */
KVP_D void pick(int32_t &best, float &sb, int32_t cand, float v) {
  if (cand >= 0 && !(v != v) && (best < 0 || v < sb)) best = cand, sb = v;
}

/* Label every row with its nearest centroid into ASSIGN stage s; returns
 * (to every thread) how many labels changed (all when fresh). */
KVP_D uint32_t assign(const Ctx &c, uint32_t s, bool fresh) {
  const uint32_t D = c.D, ka = c.ka, kc4 = (ka + 3) & ~3u, T = blockDim.x, W = T / 32;
  const uint32_t tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  for (uint32_t jc = tid; jc < ka; jc += T) {
    const float *cj = c.ws.cent + (size_t)jc * D;
    float nrm = 0.0f;
    for (uint32_t i = 0; i < D; i++) nrm = __fadd_rn(nrm, __fmul_rn(cj[i], cj[i]));
    c.ws.cn[jc] = nrm;
  }
  for (uint32_t e = tid; e < kc4 * D; e += T) {
    uint32_t i = e / kc4, jc = e % kc4;
    c.ws.centT[e] = jc < ka ? c.ws.cent[(size_t)jc * D + i] : 0.0f;
  }
  __syncthreads();
  uint8_t *lab = c.asg_pg + (size_t)s * c.cap;
  float *tile = c.smem, *bsc = tile + (size_t)D * kRT;
  int32_t *bix = (int32_t *)(bsc + W * kRT);
  uint8_t *nan0 = (uint8_t *)(bix + W * kRT);
  uint32_t per = ((ka + W - 1) / W + 3) & ~3u; /* a warp's slice, a multiple of 4 */
  uint32_t j0 = warp * per < ka ? warp * per : ka, j1 = j0 + per < ka ? j0 + per : ka;
  uint32_t changed = 0;
  for (uint32_t t0 = 0; t0 < c.n; t0 += kRT) {
    uint32_t nr = c.n - t0 < kRT ? c.n - t0 : kRT;
    KVP_QVG_UNROLL(8)
    for (uint32_t e = tid; e < D * kRT; e += T) {
      uint32_t i = e / kRT, r = e % kRT;
      tile[e] = r < nr ? __fmul_rn(-2.0f, res(c, t0 + r, i)) : 0.0f;
    }
    __syncthreads();
    if (4 * lane < nr) {
      int32_t best[4] = {-1, -1, -1, -1};
      float sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      for (uint32_t jc = j0; jc < j1; jc += 4) { /* 4 rows x 4 centroids: sixteen sums, each in i order */
        float sc[4][4];
        for (uint32_t q = 0; q < 4; q++) sc[0][q] = sc[1][q] = sc[2][q] = sc[3][q] = c.ws.cn[jc + q];
        const float4 *tp = (const float4 *)(tile + 4 * lane), *cp = (const float4 *)(c.ws.centT + jc);
        for (uint32_t i = 0; i < D; i++) {
          float4 a = tp[(size_t)i * (kRT / 4)], cq = cp[(size_t)i * (kc4 / 4)];
          float av[4] = {a.x, a.y, a.z, a.w}, cv[4] = {cq.x, cq.y, cq.z, cq.w};
          for (uint32_t r = 0; r < 4; r++)
            for (uint32_t q = 0; q < 4; q++) sc[r][q] = __fadd_rn(sc[r][q], __fmul_rn(av[r], cv[q]));
        }
        for (uint32_t r = 0; r < 4; r++) {
          if (jc == 0) nan0[4 * lane + r] = sc[r][0] != sc[r][0];
          for (uint32_t q = 0; q < 4 && jc + q < j1; q++) pick(best[r], sb[r], (int32_t)(jc + q), sc[r][q]);
        }
      }
      for (uint32_t r = 0; r < 4; r++) bsc[warp * kRT + 4 * lane + r] = sb[r], bix[warp * kRT + 4 * lane + r] = best[r];
    }
    __syncthreads();
    for (uint32_t r = tid; r < nr; r += T) {
      int32_t b = -1;
      float v = 0.0f;
      for (uint32_t w = 0; w < W && w * per < ka; w++) pick(b, v, bix[w * kRT + r], bsc[w * kRT + r]);
      uint32_t l = nan0[r] || b < 0 ? 0u : (uint32_t)b, t = t0 + r;
      if (fresh || lab[t] != l) changed++;
      lab[t] = (uint8_t)l;
    }
    __syncthreads();
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
    KVP_QVG_UNROLL(16)
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
    const float *ri = c.ws.r + (size_t)i * c.cap4;
    const uint32_t *li = list + start[jc];
    double sum = 0.0;
    KVP_QVG_UNROLL(8)
    for (uint32_t m = 0; m < k; m++) sum = __dadd_rn(sum, (double)ri[li[m]]); /* loads ahead, adds in order */
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
      for (uint32_t i = g0; i < g0 + p.group; i++) amax = fmaxf(amax, fabsf(res(c, t, i)));
      uint32_t sc = fp8_from_f32(__fdiv_rn(amax, qm));
      float sv = fp8_to_f32(sc);
      scales[(size_t)t * ng + g] = (uint8_t)sc;
      uint32_t acc = 0, nacc = 0;
      for (uint32_t i = g0; i < g0 + p.group; i++) {
        float v = sc ? rintf(__fdiv_rn(res(c, t, i), sv)) : 0.0f;
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
 * state kept). ws: kvp__qvg_ws_bytes(p, j.cap_tokens) bytes of scratch;
 * smem: qvg_smem_bytes(p.head_dim) bytes of shared memory. */
KVP_D void qvg_encode(const kvp__qvg_kparams &p, const kvp_codec_dev_job &j, void *ws, float *smem, uint32_t job,
                      unsigned long long *status) {
  zero_pages(p, j);
  uint32_t n = j.n, D = p.head_dim;
  if (n == 0) return;
  for (uint64_t e = threadIdx.x; e < (uint64_t)n * D; e += blockDim.x)
    check_finite(load_elem((const uint8_t *)j.src + (e / D) * j.stride_bytes, p.in_dtype, (uint32_t)(e % D)), status,
                 job, (uint32_t)(e / D), D, (uint32_t)(e % D));
  uint32_t kc = kc_of(p, j.cap_tokens);
  Ctx c{p, j, carve(p, j.cap_tokens, ws), D, n, j.cap_tokens, (j.cap_tokens + 3) & ~3u, kc, kc < n ? kc : n,
        (uint8_t *)j.pages[kCent], (uint8_t *)j.pages[kAssign], smem};
  res_init(c);
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
      seed(c, nwarm, 0x51564730ULL + s);
      assign(c, s, true); /* the host's kvp__km_lloyd */
      for (uint32_t it = 0; it < p.iters; it++) {
        update(c, s);
        if (!assign(c, s, false)) break;
      }
      stage_out(c, s);
      res_sub(c, s);
    }
    if (state) { /* every thread read kw above, before the barriers since */
      for (uint32_t b = threadIdx.x; b < 8; b += blockDim.x) state[b] = b < 4 ? (uint8_t)(c.ka >> 8 * b) : 0;
      for (uint32_t s = 0; s < p.stages; s++)
        for (uint32_t b = threadIdx.x; b < c.ka * D * 2; b += blockDim.x)
          state[8 + (size_t)s * p.k * D * 2 + b] = c.cent_pg[(size_t)s * kc * D * 2 + b];
    }
  }
  quant_rows(c);
}

/* The codes of an octet (8 channels from i0): 8 b bits, most significant
 * first (b bytes; b-aligned when the page is, rows being D b / 8 bytes). */
KVP_D uint32_t octet_codes(const uint8_t *cb, uint32_t bits) {
  if (bits == 2) return (uint32_t)cb[0] << 8 | cb[1];
  if (((uintptr_t)cb & 3) == 0) {
    uint32_t x = *(const uint32_t *)cb; /* bytes in page order, the first most significant */
    return x >> 24 | (x >> 8 & 0xFF00u) | (x << 8 & 0xFF0000u) | x << 24;
  }
  return (uint32_t)cb[0] << 24 | (uint32_t)cb[1] << 16 | (uint32_t)cb[2] << 8 | cb[3];
}

/* y[u] += the bf16 centroid channels at cr (8 of them). */
KVP_D void add_cent(float *y, const uint8_t *cr) {
  uint32_t h[4];
  if (((uintptr_t)cr & 15) == 0) {
    uint4 v = *(const uint4 *)cr;
    h[0] = v.x, h[1] = v.y, h[2] = v.z, h[3] = v.w;
  } else
    for (uint32_t u = 0; u < 4; u++) h[u] = ld_u16(cr, 4 * u) | ld_u16(cr, 4 * u + 2) << 16;
  for (uint32_t u = 0; u < 8; u++) y[u] = __fadd_rn(y[u], bf16_to_f32(h[u / 2] >> 16 * (u % 2) & 0xFFFFu));
}

/* Rows [j.t0, j.t0 + j.m) into j.dst (out dtype), bit for bit the host's
 * decode; a row whose assignment is past Kc (a corrupt page) decodes to
 * NaN. Part `part` of nparts: an item is eight channels of a row (one
 * 16-byte store for a 2-byte out dtype); a thread takes kDecItems items a
 * round, blockDim.x apart, and loads all their codes, scales and labels
 * before any centroid, so that the round's loads are in flight together.
 * Items map to (row, octet) and octets to scale groups by multiplies
 * (FastDiv), not divisions; rows leave through the hardware's paired
 * conversions (exact: half2_from_f32). No barrier. */
constexpr uint32_t kDecItems = 4;

/* The octet's residuals: (code - (2^(B-1) - 1)) x sv, codes most
 * significant first. The integer becomes a float by the 2^23 bias (exact:
 * |code - qm| < 2^23), an add rather than a conversion. */
template <uint32_t B> KVP_D void residual_octet(float (&y)[8], uint32_t word, float sv) {
  constexpr uint32_t qm = (1u << (B - 1)) - 1;
#pragma unroll
  for (uint32_t q = 0; q < 8; q++) {
    uint32_t c = word >> (B * (7 - q)) & ((1u << B) - 1);
    y[q] = __fmul_rn(__fsub_rn(f32(0x4B000000u | c), 8388608.0f + (float)qm), sv);
  }
}

KVP_D void qvg_decode(const kvp__qvg_kparams &p, const kvp_codec_dev_job &j, uint32_t out, uint32_t part,
                      uint32_t nparts) {
  const uint32_t D = p.head_dim, ng = D / p.group, rb = D * p.bits / 8, cap = j.cap_tokens, kc = kc_of(p, cap);
  const uint32_t oct = D / 8, S = p.stages, T = blockDim.x;
  const FastDiv by_oct = fast_div(oct), by_gro = fast_div(p.group / 8); /* octets a scale group */
  const uint8_t *codes = (const uint8_t *)j.pages[kCodes], *scales = (const uint8_t *)j.pages[kScales];
  const uint8_t *cent = (const uint8_t *)j.pages[kCent], *asg = (const uint8_t *)j.pages[kAssign];
  const bool vec = out != kF32 && ((uintptr_t)j.dst & 15) == 0 && (j.stride_bytes & 15) == 0; /* f32: by elements, as before */
  const uint32_t items = j.m * oct; /* m <= cap tokens <= 65536, oct <= 32: < 2^24 */
  for (uint32_t base = part * T * kDecItems + threadIdx.x; base < items; base += nparts * T * kDecItems) {
    uint32_t word[kDecItems], sc[kDecItems], a[kDecItems], rr[kDecItems], oo[kDecItems];
    KVP_QVG_UNROLL(kDecItems)
    for (uint32_t u = 0; u < kDecItems; u++) {
      uint32_t e = base + u * T < items ? base + u * T : items - 1, r = div_of(e, by_oct), o = e - r * oct;
      uint32_t t = j.t0 + r, i0 = o * 8;
      rr[u] = r, oo[u] = o;
      word[u] = octet_codes(codes + (size_t)t * rb + i0 * p.bits / 8, p.bits);
      sc[u] = scales[(size_t)t * ng + div_of(o, by_gro)]; /* an octet lies in one group (g is a multiple of 8) */
      a[u] = S ? asg[(size_t)(S - 1) * cap + t] : 0;
    }
    KVP_QVG_UNROLL(kDecItems)
    for (uint32_t u = 0; u < kDecItems; u++) {
      if (base + u * T >= items) continue;
      uint32_t r = rr[u], i0 = oo[u] * 8, t = j.t0 + r;
      float sv = fp8_to_f32(sc[u]), y[8];
      if (p.bits == 2) residual_octet<2>(y, word[u], sv);
      else residual_octet<4>(y, word[u], sv);
      for (uint32_t s = S; s-- > 0;) { /* the host adds the last stage's centroid first */
        uint32_t as = s == S - 1 ? a[u] : asg[(size_t)s * cap + t];
        if (as >= kc) {
          for (uint32_t q = 0; q < 8; q++) y[q] = f32(0x7FC00000u);
          continue;
        }
        add_cent(y, cent + 2 * (((size_t)s * kc + as) * D + i0));
      }
      store_octet((uint8_t *)j.dst + (size_t)r * j.stride_bytes, out, i0, y, vec);
    }
  }
}

} // namespace qvg_
} // namespace kvpk

#endif /* KVP_KERNELS_QVG_CUH */
