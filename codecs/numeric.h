/*
 * codecs/numeric.h - the bit-exact numeric core of the codecs: small float
 * formats (FP8 E4M3, BF16, FP16, FP4 E2M1) to and from f32, row conversions,
 * and packing of 2/3/4-bit integer codes in the three bit orders the codecs
 * use. It knows nothing of the pool; codecs/ builds on it.
 *
 * Every encoder rounds to nearest, ties to even, computed with integer
 * operations on the f32 bits: results never depend on the FPU rounding mode.
 * Decoders are exact (every code is a float value).
 *
 * ---- formats (s = sign, e = exponent field, m = mantissa field) ---------
 *
 *   FP8 E4M3 "fn" (OCP; CUDA __nv_fp8_e4m3)      bit 7 6..3 2..0
 *                                                    s  eeee mmm
 *     bias 7. e > 0: (-1)^s 2^(e-7) (1 + m/8);  e = 0: (-1)^s 2^-6 m/8
 *     max finite 0x7E = 448, smallest subnormal 0x01 = 2^-9.
 *     No infinities: S.1111.111 (0x7F, 0xFF) are NaN.
 *     Encode saturates (CUDA __NV_SATFINITE): |x| > 448 and +-inf give
 *     +-448 (464, the tie between 448 and "480", rounds to even = 448).
 *     Every NaN encodes as 0x7F, sign dropped (as CUDA's float conversion).
 *
 *   BF16 (the top half of an f32)                bit 15 14..7    6..0
 *                                                    s  eeeeeeee mmmmmmm
 *     Overflow rounds to +-inf. NaN stays NaN with its sign and the top 7
 *     payload bits, quiet bit (0x0040) set (as x86 VCVTNEPS2BF16).
 *
 *   FP16 (IEEE binary16)                         bit 15 14..10 9..0
 *                                                    s  eeeee  mmmmmmmmmm
 *     bias 15, max finite 65504, smallest subnormal 2^-24. Overflow rounds
 *     to +-inf (65520 ties to inf). NaN stays NaN with its sign and the top
 *     9 payload bits, quiet bit (0x0200) set (as x86 F16C VCVTPS2PH).
 *
 *   FP4 E2M1 (OCP MX; NVFP4 elements)            bit 3 2..1 0
 *                                                    s ee   m
 *     bias 1. codes 0..7 = 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign.
 *     Encode saturates: |x| > 6 and +-inf give +-6 (7 rounds to "8", so 6;
 *     5 is a tie and goes to 4, the even code). NaN encodes as 0x7 (+6),
 *     as CUDA's __nv_cvt_float_to_fp4. The sign is kept on zero: -0 and
 *     negative values that round to zero give 0x8 (-0).
 *
 *   Decoders widen bits exactly: a signalling BF16/FP16 NaN stays
 *   signalling in f32 (its re-encoding is then quiet); FP8 NaN decodes to
 *   the quiet f32 NaN with the code's sign.
 *
 * ---- packed integer codes (b = bits per code, 2, 3 or 4) --------------
 *
 *   LSB32 (KIVI, KVQuant): little-endian 32-bit words, element i at bits
 *   [b*i, b*i + b) of the little-endian bit stream (stream bit k is bit k%8
 *   of byte k/8, equally bit k%32 of LE word k/32), code LSB first. 3-bit
 *   codes straddle words: element 10 is bits 30-31 of word 0 (its two low
 *   bits) and bit 0 of word 1 (its high bit). The packed size is whole
 *   words; padding bits are zero.
 *     b=2, word 0:  bit 31 ...                              ... 1 0
 *                   [ c15 | c14 | ...                 | c1 | c0 ]
 *     b=3, bytes:   byte0 = c2[1:0] c1 c0   byte1 = c5[0] c4 c3 c2[2]
 *
 *   MSB8 (QVG): bytes, first element in the top bits (big-endian bit stream:
 *   stream bit k is bit 7 - k%8 of byte k/8, code MSB first). Packed size
 *   ceil(n b / 8) bytes, padding bits (the low bits of the last byte) zero.
 *     b=2: byte = c0<<6 | c1<<4 | c2<<2 | c3      b=4: byte = c0<<4 | c1
 *
 *   NIB (NVFP4): 4-bit codes, first element in the LOW nibble:
 *     byte j = c[2j] | c[2j+1] << 4;  ceil(n/2) bytes, odd tail's high
 *     nibble zero. (Same bits as LSB32 b=4, without the word padding.)
 *
 *   Pack reads codes as one byte each and keeps their low b bits; unpack
 *   writes one byte per code, each < 2^b. Pack writes every byte of the
 *   packed size; unpack reads no byte beyond it.
 */
#ifndef KVP_CODECS_NUMERIC_H
#define KVP_CODECS_NUMERIC_H

#include <stddef.h>
#include <stdint.h>

#include "kvpool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- scalars ------------------------------------------------------------ */

#define KVP__FP8_E4M3_MAX 448.0f /* largest finite E4M3 */
#define KVP__FP8_E4M3_NAN 0x7Fu  /* the NaN code our encoder writes */
#define KVP__E2M1_MAX 6.0f       /* largest E2M1 magnitude */

uint8_t kvp__fp8_e4m3_from_f32(float x);
float kvp__fp8_e4m3_to_f32(uint8_t code);
uint16_t kvp__bf16_from_f32(float x);
float kvp__bf16_to_f32(uint16_t code);
uint16_t kvp__f16_from_f32(float x);
float kvp__f16_to_f32(uint16_t code);
uint8_t kvp__e2m1_from_f32(float x);    /* a code 0..15 */
float kvp__e2m1_to_f32(uint8_t code);   /* uses the low 4 bits of code */

/* ---- rows (n elements; dst and src must not overlap) -------------------- */

/* Bytes of one element of dt: 4 for F32, 2 for BF16 and F16. */
size_t kvp__dtype_bytes(kvp_dtype dt);
/* dst[i] = value of element i of src, an array of n elements of dt. */
void kvp__row_to_f32(float *dst, const void *src, kvp_dtype dt, size_t n);
/* Element i of dst (n elements of dt) = src[i] rounded as above. */
void kvp__row_from_f32(void *dst, kvp_dtype dt, const float *src, size_t n);
/* Index of the first NaN among the n elements of src (dt), or n if none. */
size_t kvp__row_find_nan(const void *src, kvp_dtype dt, size_t n);
/* Index of the first NaN or +-Inf in n elements, or n. */
size_t kvp__row_find_nonfinite(const void *src, kvp_dtype dt, size_t n);
/* Copy n elements, NaN -> +0 and +-Inf -> +-largest finite of the dtype. */
void kvp__row_sanitize(void *dst, const void *src, kvp_dtype dt, size_t n);

void kvp__bf16_to_f32_row(float *dst, const uint16_t *src, size_t n);
void kvp__bf16_from_f32_row(uint16_t *dst, const float *src, size_t n);
void kvp__f16_to_f32_row(float *dst, const uint16_t *src, size_t n);
void kvp__f16_from_f32_row(uint16_t *dst, const float *src, size_t n);
void kvp__fp8_e4m3_to_f32_row(float *dst, const uint8_t *src, size_t n);
void kvp__fp8_e4m3_from_f32_row(uint8_t *dst, const float *src, size_t n);

/* ---- packed codes (bits = 2, 3 or 4; see the layouts above) ------------- */

size_t kvp__lsb32_bytes(size_t n, unsigned bits); /* 4 * ceil(n bits / 32) */
void kvp__lsb32_pack(uint8_t *dst, const uint8_t *codes, size_t n, unsigned bits);
void kvp__lsb32_unpack(uint8_t *codes, const uint8_t *src, size_t n, unsigned bits);

size_t kvp__msb8_bytes(size_t n, unsigned bits); /* ceil(n bits / 8) */
void kvp__msb8_pack(uint8_t *dst, const uint8_t *codes, size_t n, unsigned bits);
void kvp__msb8_unpack(uint8_t *codes, const uint8_t *src, size_t n, unsigned bits);

size_t kvp__nib_bytes(size_t n); /* ceil(n / 2) */
void kvp__nib_pack(uint8_t *dst, const uint8_t *codes, size_t n);
void kvp__nib_unpack(uint8_t *codes, const uint8_t *src, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* KVP_CODECS_NUMERIC_H */
