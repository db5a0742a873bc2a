/*
 * kernels/numeric.cuh - the device numeric core: the branch-free scalar
 * forms of codecs/numeric.h, ported operation for operation, so device and
 * host produce the same bits for every input (tests/gpu/check_gpu_codecs.c
 * sweeps every bf16 pattern, every code and the rounding midpoints).
 *
 *   FP8 E4M3 "fn"  saturating RNE encode (NaN -> 0x7F), decode
 *   BF16, FP16     RNE encode (NaN keeps sign and payload), decode
 *   E2M1           RNE encode saturating at 6 (NaN -> 0x7), decode
 *
 * Float arithmetic here is IEEE single with round-to-nearest-even: the
 * kernels are compiled with --fmad=false (no contraction into FMA, as the
 * host's -std=c11) and without fast-math (no flush to zero).
 */
#ifndef KVP_KERNELS_NUMERIC_CUH
#define KVP_KERNELS_NUMERIC_CUH

#include <stdint.h>

#define KVP_D __device__ __forceinline__

namespace kvpk {

constexpr float kFp8Max = 448.0f;
constexpr uint32_t kFp8Nan = 0x7Fu;
constexpr float kE2m1Max = 6.0f;
constexpr uint32_t kFp8MinNormalBits = 0x3C800000u; /* 2^-6 */
constexpr uint32_t kF16MinNormalBits = 0x38800000u; /* 2^-14 */
constexpr uint32_t kE2m1MinNormalBits = 0x3F800000u; /* 1 */

KVP_D uint32_t bits(float x) { return __float_as_uint(x); }
KVP_D float f32(uint32_t u) { return __uint_as_float(u); }
KVP_D uint32_t mask(bool c) { return 0u - (uint32_t)c; }
KVP_D bool lt(uint32_t a, uint32_t b) { return (int32_t)a < (int32_t)b; }
KVP_D uint32_t sel(uint32_t m, uint32_t a, uint32_t b) { return (a & m) | (b & ~m); }

/* w rounded to the nearest integer, ties to even; 0 <= w < 2^31. */
KVP_D uint32_t rne_u32(float w) {
  uint32_t t = (uint32_t)(int32_t)w;
  uint32_t f = bits(__fsub_rn(w, (float)(int32_t)t));
  return t + (uint32_t)lt(0x3F000000u, f + (t & 1u));
}

KVP_D uint32_t fp8_from_f32(float x) {
  uint32_t u = bits(x), a = u & 0x7FFFFFFFu;
  uint32_t nrm = ((a + 0x7FFFFu + (a >> 20 & 1u)) >> 20) - (120u << 3);
  nrm = nrm < 0x7Eu ? nrm : 0x7Eu;
  uint32_t as = a < kFp8MinNormalBits ? a : kFp8MinNormalBits;
  uint32_t sub = rne_u32(__fmul_rn(f32(as), 0x1p9f));
  uint32_t code = sel(mask(lt(a, kFp8MinNormalBits)), sub, nrm) | (u >> 24 & 0x80u);
  return sel(mask(lt(0x7F800000u, a)), kFp8Nan, code) & 0xFFu;
}

KVP_D float fp8_to_f32(uint32_t c) {
  uint32_t s = (c & 0x80u) << 24, em = c & 0x7Fu;
  uint32_t nrm = (em << 20) + (120u << 23);
  uint32_t sub = bits(__fsub_rn(f32(em << 20 | 121u << 23), 0x1p-6f));
  uint32_t r = sel(mask(em < 8u), sub, nrm);
  return f32(sel(mask(em == 0x7Fu), 0x7FC00000u, r) | s);
}

KVP_D uint32_t bf16_from_f32(float x) {
  uint32_t u = bits(x);
  uint32_t rne = (u + 0x7FFFu + (u >> 16 & 1u)) >> 16, qnan = u >> 16 | 0x0040u;
  return sel(mask(lt(0x7F800000u, u & 0x7FFFFFFFu)), qnan, rne) & 0xFFFFu;
}
KVP_D float bf16_to_f32(uint32_t c) { return f32(c << 16); }

KVP_D uint32_t f16_from_f32(float x) {
  uint32_t u = bits(x), a = u & 0x7FFFFFFFu, s = u >> 16 & 0x8000u;
  uint32_t nrm = ((a + 0xFFFu + (a >> 13 & 1u)) >> 13) - (112u << 10);
  nrm = nrm < 0x7C00u ? nrm : 0x7C00u;
  uint32_t as = a < kF16MinNormalBits ? a : kF16MinNormalBits;
  uint32_t sub = rne_u32(__fmul_rn(f32(as), 0x1p24f));
  uint32_t code = sel(mask(lt(a, kF16MinNormalBits)), sub, nrm);
  uint32_t qnan = 0x7E00u | (a >> 13 & 0x03FFu);
  return (s | sel(mask(lt(0x7F800000u, a)), qnan, code)) & 0xFFFFu;
}

KVP_D float f16_to_f32(uint32_t c) {
  uint32_t s = (c & 0x8000u) << 16, em = c & 0x7FFFu;
  uint32_t nrm = (em << 13) + (112u << 23) + (mask(lt(0x7BFFu, em)) & (112u << 23));
  uint32_t sub = bits(__fsub_rn(f32(em << 13 | 113u << 23), 0x1p-14f));
  return f32(sel(mask(lt(em, 0x0400u)), sub, nrm) | s);
}

KVP_D uint32_t e2m1_from_f32(float x) {
  uint32_t u = bits(x), a = u & 0x7FFFFFFFu;
  uint32_t nrm = ((a + 0x1FFFFFu + (a >> 22 & 1u)) >> 22) - (126u << 1);
  nrm = nrm < 7u ? nrm : 7u;
  uint32_t sub = (uint32_t)lt(0x3E800000u, a) + (uint32_t)lt(0x3F3FFFFFu, a);
  uint32_t code = sel(mask(lt(a, kE2m1MinNormalBits)), sub, nrm) | (u >> 28 & 0x8u);
  return sel(mask(lt(0x7F800000u, a)), 0x7u, code);
}

KVP_D float e2m1_to_f32(uint32_t c) {
  uint32_t em = c & 0x7u, s = (c & 0x8u) << 28;
  uint32_t nrm = (em << 22) + (126u << 23);
  uint32_t sub = bits(__fsub_rn(f32(((em | 2u) << 22) + (126u << 23)), 1.0f));
  return f32(sel(mask(lt(em, 2u)), sub, nrm) | s);
}

/* Two floats rounded to bf16 (bf16 true) or fp16 and packed, a in the low
 * half: the hardware's RNE conversion (cvt.rn.*x2.f32: subnormals kept,
 * overflow to infinity, as the forms above), and the forms above when
 * either is NaN, whose payload the hardware would not keep. */
KVP_D uint32_t half2_from_f32(bool bf16, float a, float b) {
  uint32_t ua = bits(a) & 0x7FFFFFFFu, ub = bits(b) & 0x7FFFFFFFu;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (!lt(0x7F800000u, ua) && !lt(0x7F800000u, ub)) {
    uint32_t r;
    if (bf16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
    return r;
  }
#else
  (void)ua, (void)ub; /* host builds of the kernels (tests/unit's emulator): the forms above */
#endif
  return bf16 ? bf16_from_f32(a) | bf16_from_f32(b) << 16 : f16_from_f32(a) | f16_from_f32(b) << 16;
}

/* x / d for x < 2^24 and 1 <= d <= 256 by a multiply: m = ceil(2^32 / d),
 * exact there since x (d m - 2^32) < 2^24 d <= 2^32. */
struct FastDiv {
  uint64_t m;
  uint32_t d;
};
KVP_D FastDiv fast_div(uint32_t d) { return FastDiv{((1ull << 32) + d - 1) / d, d}; }
KVP_D uint32_t div_of(uint32_t x, const FastDiv &f) { return (uint32_t)((x * f.m) >> 32); }

KVP_D bool finite(float x) { return lt(bits(x) & 0x7FFFFFFFu, 0x7F800000u); }

/* sin and cos of x, 0 <= x < 2^32 pi/2: codecs/numeric.c's kvp__sincos
 * operation for operation (each double operation rounded on its own, in
 * the host's order), so the bits are the host's. */
KVP_D void sincos_det(double x, double &s, double &c) {
  double k = floor(__dadd_rn(__dmul_rn(x, 0x1.45f306dc9c883p-1), 0.5));
  double r = __dsub_rn(x, __dmul_rn(k, 0x1.921fbp+0));
  r = __dsub_rn(r, __dmul_rn(k, 0x1.5110bp-22));
  r = __dsub_rn(r, __dmul_rn(k, 0x1.18469p-44));
  r = __dsub_rn(r, __dmul_rn(k, 0x1.13198a2e03707p-65));
  double z = __dmul_rn(r, r);
  double ts = __dadd_rn(-0x1.ae5e68a2b9cebp-26, __dmul_rn(z, 0x1.5d93a5acfd57cp-33));
  ts = __dadd_rn(0x1.71de357b1fe7dp-19, __dmul_rn(z, ts));
  ts = __dadd_rn(-0x1.a01a019c161d5p-13, __dmul_rn(z, ts));
  ts = __dadd_rn(0x1.111111110f8a6p-7, __dmul_rn(z, ts));
  ts = __dadd_rn(-0x1.5555555555549p-3, __dmul_rn(z, ts));
  double ps = __dadd_rn(r, __dmul_rn(__dmul_rn(r, z), ts));
  double tc = __dadd_rn(0x1.1ee9ebdb4b1c4p-29, __dmul_rn(z, -0x1.8fae9be8838d4p-37));
  tc = __dadd_rn(-0x1.27e4f809c52adp-22, __dmul_rn(z, tc));
  tc = __dadd_rn(0x1.a01a019cb1590p-16, __dmul_rn(z, tc));
  tc = __dadd_rn(-0x1.6c16c16c15177p-10, __dmul_rn(z, tc));
  tc = __dadd_rn(0x1.555555555554cp-5, __dmul_rn(z, tc));
  double pc = __dadd_rn(__dsub_rn(1.0, __dmul_rn(0.5, z)), __dmul_rn(__dmul_rn(z, z), tc));
  uint32_t q = (uint32_t)((unsigned long long)k & 3ull);
  s = q == 0 ? ps : q == 1 ? pc : q == 2 ? -ps : -pc;
  c = q == 0 ? pc : q == 1 ? -ps : q == 2 ? -pc : ps;
}

} // namespace kvpk

#endif /* KVP_KERNELS_NUMERIC_CUH */
