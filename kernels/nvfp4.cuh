/*
 * kernels/nvfp4.cuh - the NVFP4 codec on the device (host twin
 * codecs/nvfp4.c, whose banner defines the format and the rules): E2M1
 * codes, an E4M3 scale per 16 elements, an fp32 block-head scale
 * g = A / (6 * 448) over the block's n rows; rule 6 or 4/6; ksmooth=store.
 *
 *   CODES   cap x D/2 bytes, byte t*D/2 + j = c[2j] | c[2j+1] << 4
 *   SCALES  cap x D/16 E4M3 codes (byte t*D/16 + k: elements [16k, 16k+16)),
 *           then with ksmooth=store cap x 2 bytes, the bf16 mean of token t
 *           at cap*D/16 + 2t, little-endian
 *   META    4 bytes, g, fp32 little-endian
 *
 * Alignment: pages 4-byte aligned (CODES 8-byte aligned for one 8-byte
 * store per 16-block, else two 4-byte ones); src/dst rows 16 bytes at a
 * time when src/dst and the stride are 16-byte aligned.
 *
 * Thread mapping (one CTA of 256 per block):
 *   Encode pass 1: one warp per row. ksmooth: the row's sum in double,
 *     lanes then a shuffle tree, used only when every partial sum is exact
 *     (nvfp4.c's exponent-range test; then any order gives the host's
 *     sum), else lane 0 sums the row in index order; the bf16 mean is
 *     stored. Then max |x - mean| per warp, and over the CTA through
 *     shared memory (max is exact in any order): g, stored by thread 0.
 *   Encode pass 2 (after __syncthreads): one thread per (row, 16-block):
 *     its 16 elements, u = x / g, the block amax, both candidates' scale
 *     codes and E2M1 codes, rule 4/6's squared errors summed in index
 *     order in double in that one thread, one 8-byte code store and the
 *     scale byte.
 *   Decode: one thread per (row, 8 elements): one 4-byte code load, the
 *     scale byte, (e s) g (+ mean) in f32, 16-byte stores.
 * Every float operation is the host's, in its order, each rounded
 * separately (__f*_rn, __d*_rn): the bits are the host's.
 *
 * Traffic per token-head: encode D*esize read twice (the second from
 * L1/L2; thrice with ksmooth) + D/2 + D/16 (+2) written; decode D/2 + D/16
 * (+2) read + D*esize(out) written, plus 4 B per block-head.
 * Bandwidth: not yet measured on the H100 (make bench-gpu).
 *
 * H100 (make bench-gpu, 16-token blocks, D = 128): decode 980 GB/s (0.48x a device
 * copy), encode 290 GB/s (rule 4/6: 209 GB/s).
 */
#ifndef KVP_KERNELS_NVFP4_CUH
#define KVP_KERNELS_NVFP4_CUH

#include "common.cuh"

namespace kvpk {
namespace nvfp4_ {

constexpr uint32_t kBlock = 16;     /* elements per E4M3 scale */
constexpr float kGmax = 2688.0f;    /* 6 * 448 */
constexpr float kFltMin = 0x1p-126f; /* FLT_MIN */

/* E4M3 scale code of a 16-block of amax bits ab for target T (nvfp4.c's
 * scale_codes_n): RNE when that is >= 2^-6, else the least subnormal
 * k 2^-9 >= ab / T, k = 1..8. */
KVP_D uint32_t scale_code(uint32_t ab, float target) {
  float t = __fdiv_rn(f32(ab), target);
  uint32_t c = fp8_from_f32(t);
  uint32_t w = bits(__fmul_rn(t, 512.0f)), wc = w < 0x41800000u ? w : 0x41800000u; /* min(w, 16) */
  int32_t ti = (int32_t)f32(wc);
  uint32_t up = (uint32_t)ti + (uint32_t)(f32(wc) > (float)ti); /* ceil */
  up = up > 1u ? up : 1u;
  up = up < 8u ? up : 8u;
  return c >= 0x08u ? c : up;
}

/* Bytes [0, len) of p zeroed by the whole CTA: 16-byte stores between a
 * byte head and tail. */
KVP_D void zero_range(uint8_t *p, size_t len) {
  size_t head = (16u - (uintptr_t)p % 16u) % 16u;
  head = head < len ? head : len;
  size_t nv = (len - head) / 16, tail = head + nv * 16;
  for (size_t i = threadIdx.x; i < head; i += kThreads) p[i] = 0;
  uint4 *v = (uint4 *)(p + head);
  for (size_t i = threadIdx.x; i < nv; i += kThreads) v[i] = make_uint4(0, 0, 0, 0);
  for (size_t i = tail + threadIdx.x; i < len; i += kThreads) p[i] = 0;
}

/* x = elements [i0, i0 + 16) of a row of dt; vec: 16-byte aligned. */
KVP_D void load16(const char *row, uint32_t dt, uint32_t i0, bool vec, float (&x)[16]) {
  if (vec && dt == kF32) {
    const uint4 *v = (const uint4 *)(row + (size_t)i0 * 4);
#pragma unroll
    for (int k = 0; k < 4; k++) {
      uint4 w = v[k];
      x[4 * k] = f32(w.x), x[4 * k + 1] = f32(w.y), x[4 * k + 2] = f32(w.z), x[4 * k + 3] = f32(w.w);
    }
  } else if (vec) {
    const uint4 *v = (const uint4 *)(row + (size_t)i0 * 2);
    bool bf = dt == kBF16;
#pragma unroll
    for (int k = 0; k < 2; k++) {
      uint4 w = v[k];
      uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
      for (int e = 0; e < 4; e++) {
        x[8 * k + 2 * e] = bf ? bf16_to_f32(u[e] & 0xFFFFu) : f16_to_f32(u[e] & 0xFFFFu);
        x[8 * k + 2 * e + 1] = bf ? bf16_to_f32(u[e] >> 16) : f16_to_f32(u[e] >> 16);
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < 16; k++) x[k] = load_elem(row, dt, i0 + k);
  }
}

/* Elements [i0, i0 + 8) of a row of dt = x rounded (store_elem's rounding). */
KVP_D void store8(char *row, uint32_t dt, uint32_t i0, bool vec, const float (&x)[8]) {
  if (vec && dt == kF32) {
    uint4 *v = (uint4 *)(row + (size_t)i0 * 4);
    v[0] = make_uint4(bits(x[0]), bits(x[1]), bits(x[2]), bits(x[3]));
    v[1] = make_uint4(bits(x[4]), bits(x[5]), bits(x[6]), bits(x[7]));
  } else if (vec) {
    bool bf = dt == kBF16;
    uint32_t u[4];
#pragma unroll
    for (int e = 0; e < 4; e++) {
      uint32_t a = bf ? bf16_from_f32(x[2 * e]) : f16_from_f32(x[2 * e]);
      uint32_t b = bf ? bf16_from_f32(x[2 * e + 1]) : f16_from_f32(x[2 * e + 1]);
      u[e] = a | b << 16;
    }
    *(uint4 *)(row + (size_t)i0 * 2) = make_uint4(u[0], u[1], u[2], u[3]);
  } else {
#pragma unroll
    for (int k = 0; k < 8; k++) store_elem(row, dt, i0 + k, x[k]);
  }
}

/* Row sum in double as the host's row_sum gives it (= the in-order sum),
 * by the whole warp; every lane gets it. */
KVP_D double row_sum(const char *row, uint32_t dt, uint32_t D, uint32_t lane, unsigned long long *status, uint32_t job,
                     uint32_t t) {
  double acc = 0.0;
  uint32_t elo = 0xFFu, ehi = 0;
  for (uint32_t i = lane; i < D; i += 32) {
    float x = load_elem(row, dt, i);
    check_finite(x, status, job, t, D, i);
    uint32_t b = bits(x), e = b >> 23 & 0xFFu;
    bool z = (b & 0x7FFFFFFFu) == 0; /* zeros count for neither */
    elo = min(elo, z ? 0xFFu : e);
    ehi = max(ehi, z ? 0u : e);
    acc = __dadd_rn(acc, (double)x);
  }
  for (int o = 16; o; o >>= 1) acc = __dadd_rn(acc, __shfl_xor_sync(0xFFFFFFFFu, acc, o));
  elo = warp_min_u32(elo);
  ehi = warp_max_u32(ehi);
  uint32_t log2d = 0, sig = dt == kBF16 ? 8u : dt == kF16 ? 11u : 24u;
  while ((1u << log2d) < D) log2d++;
  if (elo == 0 || ehi == 0xFFu || (ehi > elo && ehi - elo + log2d + sig > 53)) { /* not exact: in order */
    double s = 0.0;
    if (lane == 0)
      for (uint32_t i = 0; i < D; i++) s = __dadd_rn(s, (double)load_elem(row, dt, i));
    acc = __shfl_sync(0xFFFFFFFFu, s, 0);
  }
  return acc;
}

} // namespace nvfp4_

/* Rows [0, n) of the block (j.t0 = 0 for a codec block; src row t at
 * src + t * stride); rows n..cap-1 zeroed. */
KVP_D void nvfp4_encode(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t job, unsigned long long *status) {
  using namespace nvfp4_;
  __shared__ float warp_amax[kWarps];
  uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = p.head_dim, nsc = D / kBlock, dt = p.in_dtype;
  uint32_t n = j.t0 + j.m, cap = j.cap_tokens;
  bool ks = p.nvfp4_ksmooth != 0;
  uint8_t *codes = (uint8_t *)j.pages[0], *scales = (uint8_t *)j.pages[1], *means = scales + (size_t)cap * nsc;
  const char *src = (const char *)j.src;
  size_t stride = j.stride_bytes;
  zero_range(codes + (size_t)n * (D / 2), (size_t)(cap - n) * (D / 2));
  zero_range(scales + (size_t)n * nsc, (size_t)(cap - n) * nsc);
  if (ks) zero_range(means + (size_t)n * 2, (size_t)(cap - n) * 2);

  /* pass 1: means, A */
  float amax = 0.0f;
  for (uint32_t t = warp; t < n; t += kWarps) {
    const char *row = src + (size_t)t * stride;
    float mean = 0.0f;
    if (ks) {
      double sum = row_sum(row, dt, D, lane, status, job, t);
      uint32_t mc = bf16_from_f32(__double2float_rn(__ddiv_rn(sum, (double)D)));
      if (lane == 0) st_u16(means, (size_t)t * 2, mc);
      mean = bf16_to_f32(mc);
    }
    for (uint32_t i = lane; i < D; i += 32) {
      float x = load_elem(row, dt, i);
      if (!ks) check_finite(x, status, job, t, D, i);
      else x = __fsub_rn(x, mean);
      float a = fabsf(x);
      amax = a > amax ? a : amax; /* a NaN never wins */
    }
  }
  amax = warp_max(amax);
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads(); /* also: the means are written */
  float A = 0.0f;
  for (uint32_t w = 0; w < kWarps; w++) A = warp_amax[w] > A ? warp_amax[w] : A;
  float g = A == 0.0f ? 0.0f : __fdiv_rn(A, kGmax);
  if (g != 0.0f && !(g > kFltMin)) g = kFltMin;
  if (threadIdx.x == 0) st_f32(j.pages[2], 0, g);
  if (g == 0.0f) { /* every code and scale 0 */
    zero_range(codes, (size_t)n * (D / 2));
    zero_range(scales, (size_t)n * nsc);
    return;
  }

  /* pass 2: codes and block scales */
  bool vec = (uintptr_t)src % 16 == 0 && stride % 16 == 0, c8 = (uintptr_t)codes % 8 == 0;
  bool r46 = p.nvfp4_rule46 != 0;
  for (uint32_t w = threadIdx.x; w < n * nsc; w += kThreads) {
    uint32_t t = w / nsc, k = w % nsc;
    float x[16], u[16];
    load16(src + (size_t)t * stride, dt, k * kBlock, vec, x);
    if (ks) {
      float mean = bf16_to_f32(ld_u16(means, (size_t)t * 2));
#pragma unroll
      for (int e = 0; e < 16; e++) x[e] = __fsub_rn(x[e], mean);
    }
    uint32_t ab = 0;
#pragma unroll
    for (int e = 0; e < 16; e++) {
      u[e] = __fdiv_rn(x[e], g);
      uint32_t b = bits(u[e]) & 0x7FFFFFFFu;
      b &= mask(b <= 0x7F800000u); /* NaN counts 0 */
      ab = b > ab ? b : ab;
    }
    uint32_t sc = scale_code(ab, 6.0f);
    float s6 = fp8_to_f32(sc);
    unsigned long long q = 0;
#pragma unroll
    for (int e = 0; e < 16; e++) q |= (unsigned long long)e2m1_from_f32(__fdiv_rn(u[e], s6)) << (4 * e);
    if (r46) {
      uint32_t sc4 = scale_code(ab, 4.0f);
      float s4 = fp8_to_f32(sc4);
      unsigned long long q4 = 0;
      double e6 = 0.0, e4 = 0.0;
#pragma unroll
      for (int e = 0; e < 16; e++) {
        uint32_t c4 = e2m1_from_f32(__fdiv_rn(u[e], s4)), c6 = (uint32_t)(q >> (4 * e)) & 0xFu;
        q4 |= (unsigned long long)c4 << (4 * e);
        double d6 = __dsub_rn((double)x[e], (double)__fmul_rn(__fmul_rn(e2m1_to_f32(c6), s6), g));
        double d4 = __dsub_rn((double)x[e], (double)__fmul_rn(__fmul_rn(e2m1_to_f32(c4), s4), g));
        e6 = __dadd_rn(e6, __dmul_rn(d6, d6));
        e4 = __dadd_rn(e4, __dmul_rn(d4, d4));
      }
      if (ab != 0 && sc4 != sc && e4 < e6) q = q4, sc = sc4;
    }
    if (ab == 0) q = 0, sc = 0; /* a block of zeros */
    scales[(size_t)t * nsc + k] = (uint8_t)sc;
    uint8_t *o = codes + (size_t)t * (D / 2) + k * 8;
    if (c8) *(unsigned long long *)o = q;
    else ((uint32_t *)o)[0] = (uint32_t)q, ((uint32_t *)o)[1] = (uint32_t)(q >> 32);
  }
}

KVP_D void nvfp4_decode(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  using namespace nvfp4_;
  uint32_t D = p.head_dim, nsc = D / kBlock, per_row = D / 8;
  const uint8_t *codes = (const uint8_t *)j.pages[0], *scales = (const uint8_t *)j.pages[1];
  const uint8_t *means = scales + (size_t)j.cap_tokens * nsc;
  float g = ld_f32(j.pages[2], 0);
  bool ks = p.nvfp4_ksmooth != 0;
  char *dst = (char *)j.dst;
  bool vec = (uintptr_t)dst % 16 == 0 && j.stride_bytes % 16 == 0;
  for (uint32_t w = threadIdx.x; w < j.m * per_row; w += blockDim.x) {
    uint32_t r = w / per_row, c = w % per_row, t = j.t0 + r;
    uint32_t cw = __ldg((const unsigned int *)(codes + (size_t)t * (D / 2) + 4 * c));
    float s = fp8_to_f32(__ldg(scales + (size_t)t * nsc + c / 2));
    float x[8];
#pragma unroll
    for (int e = 0; e < 8; e++) x[e] = __fmul_rn(__fmul_rn(e2m1_to_f32(cw >> (4 * e) & 0xFu), s), g);
    if (ks) {
      float mean = bf16_to_f32((uint32_t)__ldg(means + (size_t)t * 2) | (uint32_t)__ldg(means + (size_t)t * 2 + 1) << 8);
#pragma unroll
      for (int e = 0; e < 8; e++) x[e] = __fadd_rn(x[e], mean);
    }
    store8(dst + (size_t)r * j.stride_bytes, out, c * 8, vec, x);
  }
}

/* Attention's readers: elements [8c, 8c + 8) of row t as nvfp4_decode's f32
 * (KS: p.nvfp4_ksmooth, a template argument: no branch between rows), from
 * the code word cw of the page (nvfp4_row8) or of a copy of the row in
 * shared memory (nvfp4_row8s). */
template <bool KS>
KVP_D void nvfp4_cvt8(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, uint32_t t, uint32_t c,
                      uint32_t cw, float (&x)[8]) {
  using namespace nvfp4_;
  uint32_t nsc = p.head_dim / kBlock;
  float s = fp8_to_f32(__ldg(pg[1] + (size_t)t * nsc + c / 2)), g = __ldg((const float *)pg[2]);
#pragma unroll
  for (int e = 0; e < 8; e++) x[e] = __fmul_rn(__fmul_rn(e2m1_to_f32(cw >> (4 * e) & 0xFu), s), g);
  if (KS) {
    const uint8_t *mp = pg[1] + (size_t)cap * nsc + (size_t)t * 2;
    float mean = bf16_to_f32((uint32_t)__ldg(mp) | (uint32_t)__ldg(mp + 1) << 8);
#pragma unroll
    for (int e = 0; e < 8; e++) x[e] = __fadd_rn(x[e], mean);
  }
}

template <bool KS>
KVP_D void nvfp4_row8(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, uint32_t t, uint32_t c,
                      float (&x)[8]) {
  nvfp4_cvt8<KS>(p, pg, cap, t, c, __ldg((const unsigned int *)(pg[0] + (size_t)t * (p.head_dim / 2) + 4 * c)), x);
}

template <bool KS>
KVP_D void nvfp4_row8s(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, const uint8_t *srow,
                       uint32_t t, uint32_t c, float (&x)[8]) {
  nvfp4_cvt8<KS>(p, pg, cap, t, c, *(const uint32_t *)(srow + 4 * c), x);
}

} // namespace kvpk

#endif /* KVP_KERNELS_NVFP4_CUH */
