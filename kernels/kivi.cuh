/*
 * kernels/kivi.cuh - the KIVI codec on the device (host twin
 * codecs/kivi.c, whose banner defines the format): asymmetric b = 2 or
 * 4-bit codes, fp16 scale and fp16 min per group; K per channel over
 * groups of G tokens, V per token over groups of G channels.
 *
 *   CODES   cap x D*b/8 bytes, row t = D codes LSB-first in little-endian
 *           32-bit words: word w of a row holds channels [w P, w P + P),
 *           P = 32/b codes per word (16 or 8), channel w P + k at bits
 *           [b k, b k + b).
 *   SCALES  4-byte records, fp16 scale in bytes 0-1, fp16 min in 2-3:
 *           K: record (group g, channel i) at 4 (g D + i), ceil(cap/G) x D
 *           V: record (token t, group g) at 4 (t D/G + g), cap x D/G
 *
 * Alignment: pages 4-byte aligned (a word, a record: one 32-bit access);
 * src/dst rows are read/written 16 bytes at a time when src/dst and the
 * stride are 16-byte aligned, else element by element.
 *
 * Thread mapping (one CTA of 256 per block):
 *   K encode, pass A: one thread per (group, channel): the group's rows in
 *     order, running min/max with the host's strict compares (so a zero
 *     min keeps the group's first zero, sign included), the range checks,
 *     the record. Pass B (after __syncthreads): one thread per (row, code
 *     word): its P elements, the P records, one 32-bit store.
 *   V encode: one thread per (row, code word); the G/P threads of a group
 *     are adjacent lanes and combine min/max by xor shuffles that keep the
 *     lower-indexed value on ties (= the host's first zero); each computes
 *     the group's record (the lowest writes it), then its word.
 *   Decode: one thread per (row, code word): 4 bytes of codes, the records
 *     (K: P records, 16-byte loads; V: one), P outputs = q s + m in f32,
 *     stored 16 bytes at a time.
 * Every float operation is the host's, in its order, each rounded
 * separately (__f*_rn, __d*_rn): the bits are the host's.
 *
 * Traffic per token-head: encode D*esize read (K: twice, the second from
 * L1/L2) + D*b/8 + (K: 4D/G per token amortized, V: 4D/G) written;
 * decode the same D*b/8 + 4D/G read + D*esize(out) written.
 * Bandwidth: not yet measured on the H100 (make bench-gpu).
 *
 * H100 (make bench-gpu, 16-token blocks, D = 128, K side): decode 738 / 817 GB/s at
 * 2 / 4 bits (0.36x / 0.42x a device copy), encode 152 / 186 GB/s.
 */
#ifndef KVP_KERNELS_KIVI_CUH
#define KVP_KERNELS_KIVI_CUH

#include "common.cuh"

namespace kvpk {
namespace kivi_ {

constexpr float kF16Max = 65504.0f;

/* fp16 codes of x (|x| <= 65504) rounded toward -inf / +inf (kivi.c). */
KVP_D uint32_t f16_round_down(float x) {
  uint32_t h = f16_from_f32(x);
  uint32_t dn = sel(mask(h & 0x8000u), h + 1u, sel(mask(h != 0), h - 1u, 0x8001u));
  return sel(mask(f16_to_f32(h) > x), dn, h);
}
KVP_D uint32_t f16_round_up(float x) {
  uint32_t h = f16_from_f32(x);
  uint32_t up = sel(mask(h & 0x8000u), sel(mask(h == 0x8000u), 1u, h - 1u), h + 1u);
  return sel(mask(f16_to_f32(h) < x), up, h);
}

/* m + Q s < hi, in double (exact: both on the fp16 grid). */
KVP_D bool short_of(float m, double q, uint32_t s_code, float hi) {
  return __dadd_rn((double)m, __dmul_rn(q, (double)f16_to_f32(s_code))) < (double)hi;
}

/* The record (fp16 scale | fp16 min << 16) of a group with min lo and max
 * hi: kivi.c's params_n and its further raises, one group. The raise loop
 * stops at fp16 infinity (reached only by out-of-range input, which is
 * reported; the host never gets there). */
KVP_D uint32_t params(float lo, float hi, uint32_t bits) {
  double q = (double)((1u << bits) - 1);
  uint32_t m_code = f16_round_down(lo);
  float m = f16_to_f32(m_code);
  double range = __dsub_rn((double)hi, (double)m);
  uint32_t s_code = f16_round_up(__double2float_rn(__ddiv_rn(range, q))) & mask(range > 0.0);
  while (s_code < 0x7C00u && short_of(m, q, s_code, hi)) s_code++;
  return (s_code & 0xFFFFu) | (m_code & 0xFFFFu) << 16;
}

/* Code of x: round_even((x - m) / s) clamped to [0, Q], 0 where s = 0
 * (kivi.c's code_n). */
KVP_D uint32_t code(float x, float m, float s, uint32_t top_bits) {
  uint32_t v = bits(__fdiv_rn(__fsub_rn(x, m), s)), a = v & 0x7FFFFFFFu;
  uint32_t r = rne_u32(f32(a < top_bits ? a : top_bits));
  return r & ~(uint32_t)((int32_t)v >> 31) & mask(s != 0.0f);
}

/* x must be finite and within the fp16 range; else report element e. */
KVP_D void check(float x, unsigned long long *status, uint32_t job, uint32_t e) {
  if (!finite(x)) report(status, KVP_DEV_BAD_NONFINITE, job, e);
  else if (fabsf(x) > kF16Max) report(status, KVP_DEV_BAD_RANGE, job, e);
}

KVP_D uint32_t ld_u32(const uint8_t *p, size_t off) { return *(const uint32_t *)(p + off); }
/* The same through the read-only cache: only for bytes no thread writes
 * during the kernel (decode's pages). */
KVP_D uint32_t ldg_u32(const uint8_t *p, size_t off) { return __ldg((const unsigned int *)(p + off)); }

/* The P records at rec (4 each, 16-byte loads when vec). */
template <uint32_t P, bool RO> KVP_D void load_recs(const uint8_t *rec, bool vec, uint32_t (&rr)[P]) {
  if (vec) {
#pragma unroll
    for (uint32_t k = 0; k < P / 4; k++) {
      uint4 v = RO ? __ldg((const uint4 *)rec + k) : ((const uint4 *)rec)[k];
      rr[4 * k] = v.x, rr[4 * k + 1] = v.y, rr[4 * k + 2] = v.z, rr[4 * k + 3] = v.w;
    }
  } else {
#pragma unroll
    for (uint32_t k = 0; k < P; k++) rr[k] = RO ? ldg_u32(rec, 4 * k) : ld_u32(rec, 4 * k);
  }
}
KVP_D void st_u32(uint8_t *p, size_t off, uint32_t v) { *(uint32_t *)(p + off) = v; }

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

/* x = elements [i0, i0 + N) of a row of dt; vec: the row and i0 * esize
 * are 16-byte aligned (N * esize a multiple of 16). */
template <int N> KVP_D void load_run(const char *row, uint32_t dt, uint32_t i0, bool vec, float (&x)[N]) {
  if (vec && dt == kF32) {
    const uint4 *v = (const uint4 *)(row + (size_t)i0 * 4);
#pragma unroll
    for (int k = 0; k < N / 4; k++) {
      uint4 w = v[k];
      x[4 * k] = f32(w.x), x[4 * k + 1] = f32(w.y), x[4 * k + 2] = f32(w.z), x[4 * k + 3] = f32(w.w);
    }
  } else if (vec) {
    const uint4 *v = (const uint4 *)(row + (size_t)i0 * 2);
    bool bf = dt == kBF16;
#pragma unroll
    for (int k = 0; k < N / 8; k++) {
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
    for (int k = 0; k < N; k++) x[k] = load_elem(row, dt, i0 + k);
  }
}

/* Elements [i0, i0 + N) of a row of dt = x rounded (store_elem's rounding). */
template <int N> KVP_D void store_run(char *row, uint32_t dt, uint32_t i0, bool vec, const float (&x)[N]) {
  if (vec && dt == kF32) {
    uint4 *v = (uint4 *)(row + (size_t)i0 * 4);
#pragma unroll
    for (int k = 0; k < N / 4; k++) v[k] = make_uint4(bits(x[4 * k]), bits(x[4 * k + 1]), bits(x[4 * k + 2]), bits(x[4 * k + 3]));
  } else if (vec) {
    uint4 *v = (uint4 *)(row + (size_t)i0 * 2);
    bool bf = dt == kBF16;
    uint32_t u[N / 2];
#pragma unroll
    for (int e = 0; e < N / 2; e++) {
      uint32_t a = bf ? bf16_from_f32(x[2 * e]) : f16_from_f32(x[2 * e]);
      uint32_t b = bf ? bf16_from_f32(x[2 * e + 1]) : f16_from_f32(x[2 * e + 1]);
      u[e] = a | b << 16;
    }
#pragma unroll
    for (int k = 0; k < N / 8; k++) v[k] = make_uint4(u[4 * k], u[4 * k + 1], u[4 * k + 2], u[4 * k + 3]);
  } else {
#pragma unroll
    for (int k = 0; k < N; k++) store_elem(row, dt, i0 + k, x[k]);
  }
}

/* K: per channel over groups of G tokens; B bits, P = 32/B codes a word. */
template <uint32_t B>
KVP_D void encode_k(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t job, unsigned long long *status) {
  constexpr uint32_t P = 32 / B, Q = (1u << B) - 1;
  uint32_t D = p.head_dim, G = p.kivi_group, dt = p.in_dtype, n = j.t0 + j.m, cap = j.cap_tokens;
  uint32_t words = D / P, row_bytes = words * 4, ng = (n + G - 1) / G, ng_cap = (cap + G - 1) / G;
  uint8_t *codes = (uint8_t *)j.pages[0], *scales = (uint8_t *)j.pages[1];
  const char *src = (const char *)j.src;
  size_t stride = j.stride_bytes;
  zero_range(codes + (size_t)n * row_bytes, (size_t)(cap - n) * row_bytes);
  zero_range(scales + (size_t)ng * 4 * D, (size_t)(ng_cap - ng) * 4 * D);
  /* pass A: the records */
  for (uint32_t w = threadIdx.x; w < ng * D; w += kThreads) {
    uint32_t g = w / D, i = w % D, r0 = g * G, r1 = n - r0 < G ? n : r0 + G;
    float lo = 0.0f, hi = 0.0f;
    for (uint32_t t0 = r0; t0 < r1; t0 += 8) { /* 8 loads in flight, then the compares in row order */
      float x[8];
#pragma unroll
      for (uint32_t k = 0; k < 8; k++) x[k] = t0 + k < r1 ? load_elem(src + (size_t)(t0 + k) * stride, dt, i) : 0.0f;
#pragma unroll
      for (uint32_t k = 0; k < 8; k++) {
        if (t0 + k >= r1) break;
        check(x[k], status, job, (t0 + k) * D + i);
        bool first = t0 + k == r0;
        lo = first || x[k] < lo ? x[k] : lo;
        hi = first || x[k] > hi ? x[k] : hi;
      }
    }
    st_u32(scales, 4 * ((size_t)g * D + i), params(lo, hi, B));
  }
  __syncthreads(); /* pass B reads the records pass A wrote */
  /* pass B: the codes */
  uint32_t top = bits((float)Q);
  bool vec = (uintptr_t)src % 16 == 0 && stride % 16 == 0, rvec = (uintptr_t)scales % 16 == 0;
  for (uint32_t w = threadIdx.x; w < n * words; w += kThreads) {
    uint32_t t = w / words, c = w % words, i0 = c * P;
    float x[P];
    uint32_t rr[P];
    load_run<P>(src + (size_t)t * stride, dt, i0, vec, x);
    load_recs<P, false>(scales + 4 * ((size_t)(t / G) * D + i0), rvec, rr); /* written by pass A: no __ldg */
    uint32_t word = 0;
#pragma unroll
    for (uint32_t k = 0; k < P; k++)
      word |= code(x[k], f16_to_f32(rr[k] >> 16), f16_to_f32(rr[k] & 0xFFFFu), top) << (B * k);
    st_u32(codes, (size_t)t * row_bytes + 4 * c, word);
  }
}

/* V: per token over groups of G channels. The gw = G/P threads of a
 * group are adjacent lanes starting at a multiple of gw (gw <= 16 divides
 * D/P words a row, and each pass starts at a multiple of 256), so a group
 * never straddles a warp. */
template <uint32_t B>
KVP_D void encode_v(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t job, unsigned long long *status) {
  constexpr uint32_t P = 32 / B, Q = (1u << B) - 1;
  uint32_t D = p.head_dim, G = p.kivi_group, dt = p.in_dtype, n = j.t0 + j.m, cap = j.cap_tokens;
  uint32_t words = D / P, row_bytes = words * 4, ng = D / G, gw = G / P, lane = threadIdx.x % 32;
  uint8_t *codes = (uint8_t *)j.pages[0], *scales = (uint8_t *)j.pages[1];
  const char *src = (const char *)j.src;
  size_t stride = j.stride_bytes;
  zero_range(codes + (size_t)n * row_bytes, (size_t)(cap - n) * row_bytes);
  zero_range(scales + (size_t)n * 4 * ng, (size_t)(cap - n) * 4 * ng);
  uint32_t top = bits((float)Q), total = n * words;
  bool vec = (uintptr_t)src % 16 == 0 && stride % 16 == 0;
  for (uint32_t base = 0; base < total; base += kThreads) { /* uniform trip count: whole warps shuffle */
    uint32_t w = base + threadIdx.x, t = w / words, c = w % words, i0 = c * P;
    bool act = w < total;
    float x[P];
    if (act) {
      load_run<P>(src + (size_t)t * stride, dt, i0, vec, x);
#pragma unroll
      for (uint32_t k = 0; k < P; k++) check(x[k], status, job, t * D + i0 + k);
    } else {
#pragma unroll
      for (uint32_t k = 0; k < P; k++) x[k] = 0.0f;
    }
    float lo = x[0], hi = x[0];
#pragma unroll
    for (uint32_t k = 1; k < P; k++) {
      lo = x[k] < lo ? x[k] : lo;
      hi = x[k] > hi ? x[k] : hi;
    }
    for (uint32_t o = 1; o < gw; o <<= 1) { /* ties keep the lower lane's value: the group's first zero */
      float olo = __shfl_xor_sync(0xFFFFFFFFu, lo, o), ohi = __shfl_xor_sync(0xFFFFFFFFu, hi, o);
      bool low = (lane & o) == 0;
      lo = low ? (olo < lo ? olo : lo) : (lo < olo ? lo : olo);
      hi = low ? (ohi > hi ? ohi : hi) : (hi > ohi ? hi : ohi);
    }
    uint32_t r = params(lo, hi, B);
    if (act && lane % gw == 0) st_u32(scales, 4 * ((size_t)t * ng + i0 / G), r);
    float s = f16_to_f32(r & 0xFFFFu), m = f16_to_f32(r >> 16);
    uint32_t word = 0;
#pragma unroll
    for (uint32_t k = 0; k < P; k++) word |= code(x[k], m, s, top) << (B * k);
    if (act) st_u32(codes, (size_t)t * row_bytes + 4 * c, word);
  }
}

template <uint32_t B> KVP_D void decode_b(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  constexpr uint32_t P = 32 / B, Q = (1u << B) - 1;
  uint32_t D = p.head_dim, G = p.kivi_group, words = D / P, row_bytes = words * 4, ng = D / G;
  const uint8_t *codes = (const uint8_t *)j.pages[0], *scales = (const uint8_t *)j.pages[1];
  char *dst = (char *)j.dst;
  bool vec = (uintptr_t)dst % 16 == 0 && j.stride_bytes % 16 == 0;
  bool rvec = (uintptr_t)scales % 16 == 0; /* K: P records, P/4 16-byte loads */
  bool kside = p.kivi_kv == 0;
  for (uint32_t w = threadIdx.x; w < j.m * words; w += blockDim.x) {
    uint32_t r = w / words, c = w % words, t = j.t0 + r, i0 = c * P;
    uint32_t cw = ldg_u32(codes, (size_t)t * row_bytes + 4 * c);
    float x[P];
    if (kside) {
      uint32_t rr[P];
      load_recs<P, true>(scales + 4 * ((size_t)(t / G) * D + i0), rvec, rr);
#pragma unroll
      for (uint32_t k = 0; k < P; k++)
        x[k] = __fadd_rn(__fmul_rn((float)(cw >> (B * k) & Q), f16_to_f32(rr[k] & 0xFFFFu)), f16_to_f32(rr[k] >> 16));
    } else {
      uint32_t rec = ldg_u32(scales, 4 * ((size_t)t * ng + i0 / G));
      float s = f16_to_f32(rec & 0xFFFFu), m = f16_to_f32(rec >> 16);
#pragma unroll
      for (uint32_t k = 0; k < P; k++) x[k] = __fadd_rn(__fmul_rn((float)(cw >> (B * k) & Q), s), m);
    }
    store_run<P>(dst + (size_t)r * j.stride_bytes, out, i0, vec, x);
  }
}

/* Attention's reader: elements [8c, 8c + 8) of row t as decode_b's f32
 * (8 channels: half a 2-bit word, one 4-bit word; K's 8 records in two
 * 16-byte loads). B and KV (p.kivi_bits, p.kivi_kv): template arguments,
 * no branch between rows. */
template <uint32_t B, uint32_t KV>
KVP_D void row8_b(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t t, uint32_t c, float (&x)[8]) {
  constexpr uint32_t Q = (1u << B) - 1;
  uint32_t D = p.head_dim, G = p.kivi_group, row_bytes = D * B / 8;
  const uint8_t *codes = pg[0], *scales = pg[1];
  uint32_t cw = B == 4 ? ldg_u32(codes, (size_t)t * row_bytes + 4 * c)
                       : (uint32_t)__ldg((const unsigned short *)(codes + (size_t)t * row_bytes) + c);
  if (KV == 0) {
    uint32_t rr[8];
    load_recs<8, true>(scales + 4 * ((size_t)(t / G) * D + 8 * c), true, rr);
#pragma unroll
    for (uint32_t k = 0; k < 8; k++)
      x[k] = __fadd_rn(__fmul_rn((float)(cw >> (B * k) & Q), f16_to_f32(rr[k] & 0xFFFFu)), f16_to_f32(rr[k] >> 16));
    return;
  }
  const uint8_t *rec = scales + 4 * (size_t)t * (D / G);
  uint32_t r = ldg_u32(rec, 4 * (8 * c / G));
#pragma unroll
  for (uint32_t k = 0; k < 8; k++) {
    if (G < 8) r = ldg_u32(rec, 4 * ((8 * c + k) / G));
    x[k] = __fadd_rn(__fmul_rn((float)(cw >> (B * k) & Q), f16_to_f32(r & 0xFFFFu)), f16_to_f32(r >> 16));
  }
}

} // namespace kivi_

/* Rows [0, n) of the block (j.t0 = 0 for a codec block; src row t at
 * src + t * stride), rows n..cap-1 and records past them zeroed. */
KVP_D void kivi_encode(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t job, unsigned long long *status) {
  if (p.kivi_kv == 0) {
    if (p.kivi_bits == 2) kivi_::encode_k<2>(p, j, job, status);
    else kivi_::encode_k<4>(p, j, job, status);
  } else {
    if (p.kivi_bits == 2) kivi_::encode_v<2>(p, j, job, status);
    else kivi_::encode_v<4>(p, j, job, status);
  }
}

KVP_D void kivi_decode(const kvp__kparams &p, const kvp_codec_dev_job &j, uint32_t out) {
  if (p.kivi_bits == 2) kivi_::decode_b<2>(p, j, out);
  else kivi_::decode_b<4>(p, j, out);
}

template <uint32_t B, uint32_t KV>
KVP_D void kivi_row8(const kvp__kparams &p, const uint8_t *const (&pg)[4], uint32_t cap, uint32_t t, uint32_t c,
                     float (&x)[8]) {
  (void)cap;
  kivi_::row8_b<B, KV>(p, pg, t, c, x);
}

} // namespace kvpk

#endif /* KVP_KERNELS_KIVI_CUH */
