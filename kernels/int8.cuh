/*
 * kernels/int8.cuh - the int8 codec on the device (host twin
 * codecs/int8.c): symmetric int8 per token-head, bf16 scale rounded up from
 * c / 127, c the absmax or the pct-th percentile of |x| (linear
 * interpolation between order statistics j and j + 1).
 *
 *   CODES   cap x D bytes (int8, -127..127), row t at byte t*D
 *   SCALES  cap x 2 bytes, bf16 little-endian
 *
 * One warp per token. The percentile's order statistics come from a radix
 * select over the magnitude bits (finite |x| order as their bits): 31
 * ballot rounds per statistic, the row re-read from L1. Only order
 * statistics are read, so the result is the host's sorted a_j bit for bit.
 * Traffic per token-head: encode D*esize read + D + 2 written; decode
 * D + 2 read + D*esize(out) written.
 *
 * H100 (make bench-gpu, 16-token blocks, D = 128, bf16): decode 1448 GB/s (0.75x a
 * device copy), encode 396 GB/s (pct=99: 40 GB/s, the radix select).
 */
#ifndef KVP_KERNELS_INT8_CUH
#define KVP_KERNELS_INT8_CUH

#include "common.cuh"

namespace kvpk {

/* bf16 code of v >= 0 (finite), rounded toward +inf. */
KVP_D uint32_t bf16_round_up(float v) {
  uint32_t h = bf16_from_f32(v);
  if (bf16_to_f32(h) < v) h++;
  return h;
}

/* Bits of the k-th smallest |x| (0-based) of the row, by the whole warp. */
KVP_D uint32_t int8_order_stat(const char *src, uint32_t dt, uint32_t D, uint32_t k) {
  uint32_t lane = threadIdx.x % 32, prefix = 0, pmask = 0;
  for (int b = 30; b >= 0; b--) {
    uint32_t cnt = 0;
    for (uint32_t i = lane; i < D; i += 32) {
      uint32_t u = bits(load_elem(src, dt, i)) & 0x7FFFFFFFu;
      cnt += (u & pmask) == prefix && !(u >> b & 1u);
    }
    cnt = warp_sum_u32(cnt);
    if (k >= cnt) {
      k -= cnt;
      prefix |= 1u << b;
    }
    pmask |= 1u << b;
  }
  return prefix;
}

KVP_D void int8_encode(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t job, unsigned long long *status) {
  uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, D = p.head_dim;
  uint8_t *codes = (uint8_t *)j.pages[0], *scales = (uint8_t *)j.pages[1];
  uint32_t n = j.t0 + j.m;
  for (uint32_t t = warp; t < j.cap_tokens; t += kWarps) {
    uint8_t *q = codes + (size_t)t * D;
    if (t >= n) {
      for (uint32_t i = lane; i < D; i += 32) q[i] = 0;
      if (lane == 0) st_u16(scales, (size_t)t * 2, 0);
      continue;
    }
    const char *src = (const char *)j.src + (size_t)t * j.stride_bytes;
    float c = 0.0f;
    for (uint32_t i = lane; i < D; i += 32) {
      float x = load_elem(src, p.in_dtype, i);
      check_finite(x, status, job, t, D, i);
      c = fmaxf(c, fabsf(x));
    }
    c = warp_max(c);
    if (p.int8_clip && c > 0.0f) {
      float a = f32(int8_order_stat(src, p.in_dtype, D, p.int8_clip_j));
      if (p.int8_clip_frac > 0.0f) {
        float a1 = f32(int8_order_stat(src, p.in_dtype, D, p.int8_clip_j + 1));
        a = __fadd_rn(a, __fmul_rn(__fsub_rn(a1, a), p.int8_clip_frac));
      }
      c = a > 0.0f ? a : c;
    }
    if (c == 0.0f) {
      for (uint32_t i = lane; i < D; i += 32) q[i] = 0;
      if (lane == 0) st_u16(scales, (size_t)t * 2, 0);
      continue;
    }
    uint32_t sb = bf16_round_up(__fdiv_rn(c, 127.0f));
    float s = bf16_to_f32(sb);
    if (lane == 0) st_u16(scales, (size_t)t * 2, sb);
    for (uint32_t i = lane; i < D; i += 32) {
      uint32_t y = bits(__fdiv_rn(load_elem(src, p.in_dtype, i), s)), a = y & 0x7FFFFFFFu;
      uint32_t neg = (uint32_t)((int32_t)y >> 31);
      uint32_t r = rne_u32(f32(sel(mask(a < 0x42FE0000u), a, 0x42FE0000u)));
      q[i] = (uint8_t)((r ^ neg) - neg);
    }
  }
}

KVP_D void int8_decode(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  uint32_t D = p.head_dim;
  const uint8_t *__restrict__ codes = (const uint8_t *)j.pages[0], *__restrict__ scales = (const uint8_t *)j.pages[1];
  bool vec = D % 4 == 0 && out == kBF16 && j.stride_bytes % 8 == 0 && (uintptr_t)j.dst % 8 == 0;
  if (vec) { /* as fp8_decode: items of 4 codes, read-only loads first */
    uint32_t per_row = D / 4, total = j.m * per_row;
#pragma unroll 4
    for (uint32_t w = threadIdx.x; w < total; w += blockDim.x) {
      uint32_t r = w / per_row, c = w % per_row, t = j.t0 + r;
      uint32_t c4 = __ldg((const unsigned int *)(codes + (size_t)t * D) + c);
      float s = bf16_to_f32(__ldg((const unsigned short *)scales + t));
      uint32_t o[4];
#pragma unroll
      for (int e = 0; e < 4; e++) o[e] = bf16_from_f32(__fmul_rn((float)(int8_t)(c4 >> 8 * e), s));
      *(uint2 *)((char *)j.dst + (size_t)r * j.stride_bytes + (size_t)c * 8) = make_uint2(o[0] | o[1] << 16, o[2] | o[3] << 16);
    }
    return;
  }
  uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  for (uint32_t r = warp; r < j.m; r += nwarps) {
    uint32_t t = j.t0 + r;
    float s = bf16_to_f32(ld_u16(scales, (size_t)t * 2));
    const int8_t *q = (const int8_t *)codes + (size_t)t * D;
    char *dst = (char *)j.dst + (size_t)r * j.stride_bytes;
    for (uint32_t i = lane; i < D; i += 32) store_elem(dst, out, i, __fmul_rn((float)q[i], s));
  }
}

/* Attention's readers: elements [8c, 8c + 8) of row t as int8_decode's f32;
 * int8_row8s reads the codes from a copy of the row in shared memory. */
KVP_D void int8_cvt8(uint2 q, float s, float (&x)[8]) {
#pragma unroll
  for (int e = 0; e < 4; e++) {
    x[e] = __fmul_rn((float)(int8_t)(q.x >> 8 * e), s);
    x[4 + e] = __fmul_rn((float)(int8_t)(q.y >> 8 * e), s);
  }
}

KVP_D void int8_row8(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, uint32_t t, uint32_t c,
                     float (&x)[8]) {
  (void)cap;
  int8_cvt8(__ldg((const uint2 *)(pg[0] + (size_t)t * p.head_dim + 8 * c)),
            bf16_to_f32(__ldg((const unsigned short *)pg[1] + t)), x);
}

KVP_D void int8_row8s(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, const uint8_t *srow,
                      uint32_t t, uint32_t c, float (&x)[8]) {
  (void)cap, (void)p;
  int8_cvt8(*(const uint2 *)(srow + 8 * c), bf16_to_f32(__ldg((const unsigned short *)pg[1] + t)), x);
}

} // namespace kvpk

#endif /* KVP_KERNELS_INT8_CUH */
