/*
 * codecs/kernels.h - the codecs' row kernels, compiled for two instruction
 * sets and chosen at run time: the base ISA of the build (x86-64: SSE2, so
 * the library runs on any x86-64) and, on x86-64, AVX2.
 *
 * A kernel is written once, in plain C whose fixed-count chunk loops gcc
 * -O2 vectorizes (codecs/numeric.h, KVP__FOR_CHUNKS). KVP__KERNEL makes two
 * copies, name_base and name_avx2 (__attribute__((target("avx2")))), into
 * which the body and every KVP__INLINE helper are inlined, and a name()
 * that calls one by kvp__codec_isa(). Both copies compute the same bits:
 * the ISA changes how many lanes an instruction runs, not an operation
 * (AVX2 enables no FMA, and -std=c11 contracts none).
 *
 * A third level, AVX-512 (F, DQ and VL), is for the few kernels written with
 * its intrinsics (the kvquant calibration's synthetic generator: 64-bit
 * lane multiplies); everywhere else it runs the AVX2 copy.
 *
 * Cost of the choice: one relaxed atomic load and a predictable branch per
 * kernel call (a kernel covers a whole block).
 */
#ifndef KVP_CODECS_KERNELS_H
#define KVP_CODECS_KERNELS_H

#include "numeric.h"

enum { KVP__ISA_BASE = 0, KVP__ISA_AVX2 = 1, KVP__ISA_AVX512 = 2 }; /* each level has the ones below */

/* The ISA the kernels run: the best of AVX-512 and AVX2 the CPU (and OS)
 * have, unless KVP_CODEC_ISA=base or =avx2 was in the environment at the
 * first call (a cap). */
int kvp__codec_isa(void);
/* Tests: run isa from now on (a level the CPU lacks runs the base);
 * returns the ISA in force. */
int kvp__codec_isa_set(int isa);

#if defined(__x86_64__) && defined(__GNUC__) && !defined(KVP_NO_AVX2)
#define KVP__HAVE_AVX2 1
/* static int name params, run for the ISA in force; the body follows. */
#define KVP__KERNEL(name, params, args)                                                                              \
  KVP__INLINE int name##_body params;                                                                                \
  static int name##_base params { return name##_body args; }                                                         \
  __attribute__((target("avx2"))) static int name##_avx2 params { return name##_body args; }                         \
  static int name params { return kvp__codec_isa() >= KVP__ISA_AVX2 ? name##_avx2 args : name##_base args; }        \
  KVP__INLINE int name##_body params
#else
#define KVP__KERNEL(name, params, args)                                                                              \
  KVP__INLINE int name##_body params;                                                                                \
  static int name params { return name##_body args; }                                                                \
  KVP__INLINE int name##_body params
#endif

#endif /* KVP_CODECS_KERNELS_H */
