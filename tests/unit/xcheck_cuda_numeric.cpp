/*
 * tests/unit/xcheck_cuda_numeric.cpp - our small-float encoders and decoders
 * (codecs/numeric.h) against the CUDA Toolkit's host-callable conversions:
 *
 *   FP8 E4M3  __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)
 *   BF16      __float2bfloat16_rn(x)
 *   FP16      __float2half_rn(x)
 *   FP4 E2M1  __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)
 *
 * Inputs: every bf16 bit pattern as an f32, every midpoint between adjacent
 * codes of each format and one f32 ulp either side, named edges, and 10
 * million random f32 (fixed seed). Decoders: every code, by value.
 *
 * C++ because cuda_bf16.h and cuda_fp16.h declare their conversions only
 * for C++ (from C11 they give the raw structs alone; cuda_fp8.h and
 * cuda_fp4.h do compile from C). Host functions only: no GPU, no CUDA
 * context; built with the host C++ compiler, not nvcc.
 *
 * Expected differences, counted apart and not failures (both sides NaN,
 * checked): NaN inputs to BF16 and FP16, where CUDA writes the canonical
 * 0x7FFF and we keep sign and payload; NaN codes decoded, where CUDA's FP8
 * and FP16 decoders give a positive NaN and ours keep the code's sign and
 * payload. FP8 and E2M1 encoders must match CUDA on NaN bit for bit.
 *
 * The last line has the Check summary format so tools/run-tests.sh shows it.
 */
#include <cuda_runtime_api.h> /* CUDART_VERSION */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#if __has_include(<cuda_fp4.h>)
#include <cuda_fp4.h>
#define XC_HAVE_FP4 1
#else
#define XC_HAVE_FP4 0
#endif

#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "../../codecs/numeric.h"

static uint32_t bits_of(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof u);
  return u;
}

static float float_of(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

static uint32_t cuda_fp8(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }
static uint32_t cuda_bf16(float x) { return __nv_bfloat16_raw(__float2bfloat16_rn(x)).x; }
static uint32_t cuda_f16(float x) { return __half_raw(__float2half_rn(x)).x; }
static float cuda_fp8_dec(uint32_t c) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, __NV_E4M3)));
}
static float cuda_bf16_dec(uint32_t c) {
  __nv_bfloat16_raw r;
  r.x = (unsigned short)c;
  return __bfloat162float(__nv_bfloat16(r));
}
static float cuda_f16_dec(uint32_t c) {
  __half_raw r;
  r.x = (unsigned short)c;
  return __half2float(__half(r));
}
#if XC_HAVE_FP4
static uint32_t cuda_e2m1(float x) { return __nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest); }
static float cuda_e2m1_dec(uint32_t c) {
  return __half2float(__half(__nv_cvt_fp4_to_halfraw((__nv_fp4_storage_t)c, __NV_E2M1)));
}
static uint32_t ours_e2m1(float x) { return kvp__e2m1_from_f32(x); }
static float ours_e2m1_dec(uint32_t c) { return kvp__e2m1_to_f32((uint8_t)c); }
#endif

static uint32_t ours_fp8(float x) { return kvp__fp8_e4m3_from_f32(x); }
static uint32_t ours_bf16(float x) { return kvp__bf16_from_f32(x); }
static uint32_t ours_f16(float x) { return kvp__f16_from_f32(x); }
static float ours_fp8_dec(uint32_t c) { return kvp__fp8_e4m3_to_f32((uint8_t)c); }
static float ours_bf16_dec(uint32_t c) { return kvp__bf16_to_f32((uint16_t)c); }
static float ours_f16_dec(uint32_t c) { return kvp__f16_to_f32((uint16_t)c); }

struct pair {
  const char *name;
  uint32_t ncodes;               /* codes of the format */
  bool nan_bits_may_differ;      /* NaN inputs: compare NaN-ness only */
  uint32_t (*ours)(float);
  uint32_t (*cuda)(float);
  float (*ours_dec)(uint32_t);
  float (*cuda_dec)(uint32_t);
};

static const pair pairs[] = {
    {"fp8_e4m3", 256, false, ours_fp8, cuda_fp8, ours_fp8_dec, cuda_fp8_dec},
    {"bf16", 65536, true, ours_bf16, cuda_bf16, ours_bf16_dec, cuda_bf16_dec},
    {"f16", 65536, true, ours_f16, cuda_f16, ours_f16_dec, cuda_f16_dec},
#if XC_HAVE_FP4
    {"e2m1", 16, false, ours_e2m1, cuda_e2m1, ours_e2m1_dec, cuda_e2m1_dec},
#endif
};

static uint64_t rand64(uint64_t *s) { /* xorshift64*, as tests/unit/testutil.h */
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1DULL;
}

static unsigned nchecks, nfailed;

/* Tally one input set for one format: mismatches fail; NaN payload
 * differences where allowed are counted and printed. */
static void compare(const pair &p, const char *set, const std::vector<float> &in) {
  unsigned long long nbad = 0, nnan_diff = 0;
  for (float x : in) {
    uint32_t a = p.ours(x), b = p.cuda(x);
    if (a == b) continue;
    if (p.nan_bits_may_differ && std::isnan(x) && std::isnan(p.ours_dec(a)) && std::isnan(p.cuda_dec(b))) {
      nnan_diff++;
      continue;
    }
    if (nbad++ < 5)
      printf("  MISMATCH %s(%a, bits 0x%08x): ours 0x%x, CUDA 0x%x\n", p.name, (double)x, bits_of(x), a, b);
  }
  nchecks++;
  nfailed += nbad != 0;
  printf("xcheck %-8s %-20s %9zu inputs: %llu mismatches", p.name, set, in.size(), nbad);
  if (p.nan_bits_may_differ) printf(", %llu NaN inputs with other NaN bits (expected)", nnan_diff);
  printf("\n");
}

/* Decoders: equal f32 bits, except that a NaN code need only give a NaN
 * (CUDA's FP8 and FP16 decoders drop the sign of NaN; ours keep it). */
static void compare_decoders(const pair &p) {
  unsigned long long nbad = 0, nnan_diff = 0;
  for (uint32_t c = 0; c < p.ncodes; c++) {
    float a = p.ours_dec(c), b = p.cuda_dec(c);
    if (bits_of(a) == bits_of(b)) continue;
    if (std::isnan(a) && std::isnan(b)) {
      nnan_diff++;
      continue;
    }
    if (nbad++ < 5) printf("  MISMATCH %s decode 0x%x: ours %a, CUDA %a\n", p.name, c, (double)a, (double)b);
  }
  nchecks++;
  nfailed += nbad != 0;
  printf("xcheck %-8s %-20s %9u codes: %llu mismatches, %llu NaN codes with other NaN bits (expected)\n", p.name,
         "decode every code", p.ncodes, nbad, nnan_diff);
}

/* Midpoints between adjacent positive codes of every format (our decoder
 * gives the values), one ulp either side, both signs, and named edges. */
static std::vector<float> ties_and_edges() {
  std::vector<float> v = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, FLT_MAX, -FLT_MAX, FLT_MIN, FLT_TRUE_MIN,
                          448, 449, 464, 480, 1e9f, 65504, 65519, 65520, 65536, 6, 7, 100, 0x1p-10f, 0x1p-25f,
                          float_of(0x7F800001), float_of(0xFF812345), float_of(0x7F7F8000), float_of(0x00008000)};
  for (const pair &p : pairs) {
    uint32_t npos = p.ncodes / 2; /* codes without the sign bit */
    for (uint32_t c = 0; c + 1 < npos; c++) {
      double lo = p.ours_dec(c), hi = p.ours_dec(c + 1);
      if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
      float m = (float)((lo + hi) / 2);
      for (float x : {m, nextafterf(m, 0), nextafterf(m, INFINITY)}) {
        v.push_back(x);
        v.push_back(-x);
      }
    }
  }
  v.push_back(float_of(0x7F7FFFFF));
  v.push_back(464.0f + 0x1p-15f * 464.0f);
  return v;
}

static std::vector<float> random_floats(size_t n) {
  std::vector<float> v(n);
  uint64_t rng = 0x243F6A8885A308D3ull;
  for (size_t i = 0; i < n; i++) {
    uint64_t r = rand64(&rng);
    if (r & 1) {
      v[i] = float_of((uint32_t)(r >> 32)); /* every exponent, NaN and inf included */
    } else {                                /* near the small formats: 2^-30 .. 2^20 */
      uint32_t e = (uint32_t)(127 - 30 + (r >> 8) % 51), mant = (uint32_t)(r >> 40) & 0x7FFFFF;
      if (r & 2) mant &= ~0u << 12; /* exact values and midpoints of the coarse formats */
      v[i] = float_of((uint32_t)(r >> 2 & 1) << 31 | e << 23 | mant);
    }
  }
  return v;
}

int main() {
  printf("xcheck: CUDA %d.%d host conversions vs codecs/numeric.c%s\n", CUDART_VERSION / 1000,
         CUDART_VERSION % 1000 / 10, XC_HAVE_FP4 ? "" : " (no cuda_fp4.h: e2m1 skipped)");
  std::vector<float> every_bf16(65536);
  for (uint32_t c = 0; c < 65536; c++) every_bf16[c] = float_of(c << 16);
  std::vector<float> ties = ties_and_edges(), rnd = random_floats(10000000);
  for (const pair &p : pairs) {
    compare(p, "every bf16 pattern", every_bf16);
    compare(p, "ties and edges", ties);
    compare(p, "10M random", rnd);
    compare_decoders(p);
  }
  printf("%u%%: Checks: %u, Failures: %u, Errors: 0\n", nchecks ? 100 * (nchecks - nfailed) / nchecks : 0, nchecks,
         nfailed);
  return nfailed != 0;
}
