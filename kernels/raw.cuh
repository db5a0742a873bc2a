/*
 * kernels/raw.cuh - the raw codec on the device (host twin codecs/raw.c):
 * rows copied, or converted between fp32, bf16 and fp16 with the host's
 * round-to-nearest-even.
 *
 *   RAW page: cap rows of D elements of the stored dtype, row t at byte
 *   t * D * esize. Encode writes rows [t0, t0 + m) only (an OPEN block's
 *   rows arrive a step at a time); decode reads rows [t0, t0 + m).
 *
 * Traffic per token-head: D*esize(in) read + D*esize(store) written.
 * Same dtype and 16-byte aligned rows: 16-byte vector copies, one warp
 * per row; otherwise one element per lane per iteration.
 *
 * H100 (make bench-gpu, 16-token blocks, D = 128, bf16): decode 1956 GB/s (1.01x a
 * device copy), encode 817 GB/s.
 */
#ifndef KVP_KERNELS_RAW_CUH
#define KVP_KERNELS_RAW_CUH

#include "common.cuh"

namespace kvpk {

/* Rows [0, m) of src (sdt, spitch bytes apart) into dst (ddt, dpitch);
 * with check, every element must be finite (reported as row r0 + r). */
KVP_D void rows_convert(const void *src, size_t spitch, uint32_t sdt, void *dst, size_t dpitch, uint32_t ddt,
                        uint32_t D, uint32_t m, bool check, unsigned long long *status, uint32_t job, uint32_t r0) {
  uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32, nwarps = blockDim.x / 32;
  size_t srow = (size_t)D * dtype_bytes(sdt);
  bool vec = sdt == ddt && srow % 16 == 0 && spitch % 16 == 0 && dpitch % 16 == 0 && (uintptr_t)src % 16 == 0 &&
             (uintptr_t)dst % 16 == 0;
  if (vec && !check) { /* a copy: items of 16 bytes over the whole block, read-only loads first */
    uint32_t nv = (uint32_t)(srow / 16), total = m * nv;
#pragma unroll 4
    for (uint32_t w = threadIdx.x; w < total; w += blockDim.x) {
      uint32_t r = w / nv, i = w % nv;
      uint4 v = __ldg((const uint4 *)((const char *)src + r * spitch) + i);
      *((uint4 *)((char *)dst + r * dpitch) + i) = v;
    }
    return;
  }
  if (vec) {
    uint32_t nv = (uint32_t)(srow / 16), per = dtype_bytes(sdt) == 4 ? 4u : 8u;
    for (uint32_t r = warp; r < m; r += nwarps) {
      const uint4 *s = (const uint4 *)((const char *)src + r * spitch);
      uint4 *d = (uint4 *)((char *)dst + r * dpitch);
      for (uint32_t i = lane; i < nv; i += 32) {
        uint4 v = s[i];
        if (check) {
          uint32_t w[4] = {v.x, v.y, v.z, v.w};
          for (uint32_t e = 0; e < per; e++) {
            float x = per == 4 ? f32(w[e]) : load_elem(w, sdt, e);
            check_finite(x, status, job, r0 + r, D, i * per + e);
          }
        }
        d[i] = v;
      }
    }
    return;
  }
  for (uint32_t r = warp; r < m; r += nwarps) {
    const char *s = (const char *)src + r * spitch;
    char *d = (char *)dst + r * dpitch;
    for (uint32_t i = lane; i < D; i += 32) {
      float x = load_elem(s, sdt, i);
      if (check) check_finite(x, status, job, r0 + r, D, i);
      store_elem(d, ddt, i, x);
    }
  }
}

KVP_D void raw_encode(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t job, unsigned long long *status) {
  size_t row = (size_t)p.head_dim * dtype_bytes(p.store_dtype);
  rows_convert(j.src, j.stride_bytes, p.in_dtype, (char *)j.pages[0] + j.t0 * row, row, p.store_dtype, p.head_dim,
               j.m, true, status, job, j.t0);
}

KVP_D void raw_decode(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  size_t row = (size_t)p.head_dim * dtype_bytes(p.store_dtype);
  rows_convert((const char *)j.pages[0] + j.t0 * row, row, p.store_dtype, j.dst, j.stride_bytes, out, p.head_dim, j.m,
               false, nullptr, 0, 0);
}

/* Attention's reader (kernels/attend.cu): elements [8c, 8c + 8) of row t,
 * as raw_decode would give them in f32 (pages 16-byte aligned, D % 8 == 0);
 * DT, the store dtype, a template argument so that a tile's rows hold no
 * branch between their loads. */
template <uint32_t DT>
KVP_D void raw_row8(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, uint32_t t, uint32_t c,
                    float (&x)[8]) {
  (void)cap;
  uint32_t D = p.head_dim;
  if (DT == kF32) {
    const float4 *r = (const float4 *)(pg[0] + ((size_t)t * D + 8 * c) * 4);
    float4 a = __ldg(r), b = __ldg(r + 1);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
    return;
  }
  uint4 v = __ldg((const uint4 *)(pg[0] + ((size_t)t * D + 8 * c) * 2));
  uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int e = 0; e < 4; e++) {
    x[2 * e] = DT == kBF16 ? bf16_to_f32(w[e] & 0xFFFFu) : f16_to_f32(w[e] & 0xFFFFu);
    x[2 * e + 1] = DT == kBF16 ? bf16_to_f32(w[e] >> 16) : f16_to_f32(w[e] >> 16);
  }
}

} // namespace kvpk

#endif /* KVP_KERNELS_RAW_CUH */
