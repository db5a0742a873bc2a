/*
 * codecs/kernels.c - which ISA the codec kernels run (codecs/kernels.h).
 *
 * Invariant: once set, isa_now is KVP__ISA_BASE, or a higher level
 * (KVP__ISA_AVX2, KVP__ISA_AVX512) on a CPU that has it. Set at the first
 * call (racing first calls store the same value) or by the tests'
 * kvp__codec_isa_set.
 */
#include "kernels.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static _Atomic int isa_now = -1; /* KVP__ISA_*, -1 until the first call */

static int isa_best(void) {
#ifdef KVP__HAVE_AVX2
  __builtin_cpu_init(); /* libgcc checks the OS saves the registers (XCR0) too */
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl"))
    return KVP__ISA_AVX512;
  if (__builtin_cpu_supports("avx2")) return KVP__ISA_AVX2;
#endif
  return KVP__ISA_BASE;
}

int kvp__codec_isa(void) {
  int isa = atomic_load_explicit(&isa_now, memory_order_relaxed);
  if (isa >= 0) return isa;
  const char *env = getenv("KVP_CODEC_ISA");
  isa = isa_best();
  if (env && strcmp(env, "base") == 0) isa = KVP__ISA_BASE;
  else if (env && strcmp(env, "avx2") == 0 && isa > KVP__ISA_AVX2) isa = KVP__ISA_AVX2;
  atomic_store_explicit(&isa_now, isa, memory_order_relaxed);
  return isa;
}

int kvp__codec_isa_set(int isa) {
  if (isa < KVP__ISA_BASE || isa > isa_best()) isa = KVP__ISA_BASE;
  atomic_store_explicit(&isa_now, isa, memory_order_relaxed);
  return isa;
}
