/*
 * tests/unit/cuda_emu.h - just enough of CUDA to run a device function of
 * kernels/ on the host, one CTA at a time: each thread of the CTA is a
 * coroutine (ucontext) of one OS thread; __syncthreads, __syncwarp and the
 * warp intrinsics (__shfl_sync, __shfl_xor_sync, __ballot_sync) are
 * barriers of the CTA or of the warp, where the coroutines take turns.
 *
 * What it checks: the arithmetic (host float and double operations round
 * as the __f*_rn / __d*_rn intrinsics: build with -ffp-contract=off), the
 * indexing, and the synchronization pattern: a thread that reads what
 * another wrote without a barrier between them reads the old value here
 * (threads run in order between barriers), and a barrier not every thread
 * of its warp or CTA reaches is a deadlock, reported. What it does not:
 * alignment faults, memory bounds (run it under ASan for those), timing.
 *
 * Use: define nothing, include this before the .cuh, and call
 * emu::run(threads, block, fn, arg) for each CTA.
 */
#ifndef KVP_TESTS_CUDA_EMU_H
#define KVP_TESTS_CUDA_EMU_H

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#define __device__
#define __host__
#define __global__
#define __forceinline__ inline
#define __shared__ static /* one CTA at a time: a static is the CTA's */
#define __align__(n) __attribute__((aligned(n)))

struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }

struct emu_idx {
  unsigned x, y, z;
};

namespace emu {

constexpr int kMaxThreads = 1024;
/* Under ASan every stack switch (swapcontext) clears the shadow of the whole
 * stack it enters: smaller stacks there (the kernels' frames are small). */
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kStack = 64 * 1024;
#else
constexpr size_t kStack = 256 * 1024;
#endif

/* Coroutine switches: on x86-64 a 14-instruction switch of the stack
 * pointer and the callee-saved registers (swapcontext makes a system call
 * each time: 20x slower); elsewhere, and under ASan (which must see stack
 * switches), ucontext. */
#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__)
#define KVP_EMU_ASM 1
extern "C" void kvp_emu_switch(void **save_sp, void *to_sp);
asm(".text\n.globl kvp_emu_switch\n.hidden kvp_emu_switch\n.type kvp_emu_switch,@function\nkvp_emu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size kvp_emu_switch,.-kvp_emu_switch\n");
#else
#define KVP_EMU_ASM 0
#endif

struct Bar {
  int count;    /* arrived in this generation */
  unsigned gen; /* generation */
};

struct State {
  int nthreads, cur;
  unsigned block;
#if KVP_EMU_ASM
  void *sched_sp, *sp[kMaxThreads];
#else
  ucontext_t sched, ctx[kMaxThreads];
#endif
  bool done[kMaxThreads];
  char *stacks;
  Bar warp_bar[kMaxThreads / 32], block_bar;
  uint64_t xch[kMaxThreads / 32][32]; /* a warp's values in exchange */
  unsigned long progress;             /* arrivals and exits, for deadlock detection */
  void (*fn)(void *);
  void *arg;
};
inline State st;

#if KVP_EMU_ASM
inline void yield() { kvp_emu_switch(&st.sp[st.cur], st.sched_sp); }
inline void to_thread(int t) { kvp_emu_switch(&st.sched_sp, st.sp[t]); }
#else
inline void yield() { swapcontext(&st.ctx[st.cur], &st.sched); }
inline void to_thread(int t) { swapcontext(&st.sched, &st.ctx[t]); }
#endif

inline void barrier(Bar &b, int size) {
  unsigned gen = b.gen;
  st.progress++;
  if (++b.count == size) {
    b.count = 0;
    b.gen++;
    return;
  }
  while (b.gen == gen) yield();
}

inline void entry() {
  st.fn(st.arg);
  st.done[st.cur] = true;
  st.progress++;
#if KVP_EMU_ASM
  yield(); /* never resumed: the scheduler skips done threads */
  abort();
#endif
}

/* Run fn(arg) as the nthreads threads (a multiple of 32) of CTA block. */
inline void run(int nthreads, unsigned block, void (*fn)(void *), void *arg) {
  if (!st.stacks && !(st.stacks = (char *)aligned_alloc(64, (size_t)kMaxThreads * kStack))) abort();
  st.nthreads = nthreads, st.block = block, st.fn = fn, st.arg = arg;
  memset(st.warp_bar, 0, sizeof st.warp_bar);
  memset(&st.block_bar, 0, sizeof st.block_bar);
  for (int t = 0; t < nthreads; t++) {
    st.done[t] = false;
#if KVP_EMU_ASM
    /* the frame kvp_emu_switch pops: 6 registers, then entry as the return
     * address, entered with rsp = 8 mod 16 as after a call */
    void **top = (void **)(st.stacks + (size_t)(t + 1) * kStack);
    top[-1] = NULL;
    top[-2] = (void *)entry;
    for (int r = 3; r <= 8; r++) top[-r] = NULL;
    st.sp[t] = &top[-8];
#else
    getcontext(&st.ctx[t]);
    st.ctx[t].uc_stack.ss_sp = st.stacks + (size_t)t * kStack;
    st.ctx[t].uc_stack.ss_size = kStack;
    st.ctx[t].uc_link = &st.sched;
    makecontext(&st.ctx[t], entry, 0);
#endif
  }
  for (;;) {
    bool live = false;
    unsigned long before = st.progress;
    for (int t = 0; t < nthreads; t++)
      if (!st.done[t]) {
        live = true;
        st.cur = t;
        to_thread(t);
      }
    if (!live) break;
    if (st.progress == before) {
      fprintf(stderr, "cuda_emu: deadlock in CTA %u: threads wait at a barrier others never reach\n", block);
      abort();
    }
  }
}

template <class T> inline T xchg(T v, int src) {
  int w = st.cur / 32, l = st.cur % 32;
  uint64_t u = 0, s;
  memcpy(&u, &v, sizeof v);
  st.xch[w][l] = u;
  barrier(st.warp_bar[w], 32);
  s = st.xch[w][src & 31];
  barrier(st.warp_bar[w], 32);
  T r;
  memcpy(&r, &s, sizeof r);
  return r;
}

} // namespace emu

#define threadIdx (emu_idx{(unsigned)emu::st.cur, 0u, 0u})
#define blockIdx (emu_idx{emu::st.block, 0u, 0u})
#define blockDim (emu_idx{(unsigned)emu::st.nthreads, 1u, 1u})

template <class T> inline T __shfl_sync(unsigned, T v, int src) { return emu::xchg(v, src); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int o) { return emu::xchg(v, (emu::st.cur % 32) ^ o); }
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d) {
  int l = emu::st.cur % 32;
  return emu::xchg(v, l >= (int)d ? l - (int)d : l);
}
inline unsigned __ballot_sync(unsigned, int pred) {
  int w = emu::st.cur / 32;
  emu::st.xch[w][emu::st.cur % 32] = pred ? 1u : 0u;
  emu::barrier(emu::st.warp_bar[w], 32);
  unsigned r = 0;
  for (int i = 0; i < 32; i++) r |= (emu::st.xch[w][i] ? 1u : 0u) << i;
  emu::barrier(emu::st.warp_bar[w], 32);
  return r;
}
inline void __syncwarp(unsigned = 0xFFFFFFFFu) { emu::barrier(emu::st.warp_bar[emu::st.cur / 32], 32); }
inline void __syncthreads() { emu::barrier(emu::st.block_bar, emu::st.nthreads); }

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __double2float_rn(double d) { return (float)d; }
inline unsigned __float_as_uint(float x) {
  unsigned u;
  memcpy(&u, &x, 4);
  return u;
}
inline float __uint_as_float(unsigned u) {
  float x;
  memcpy(&x, &u, 4);
  return x;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
template <class T> inline T __ldg(const T *p) { return *p; }
inline unsigned long long atomicMin(unsigned long long *a, unsigned long long v) {
  unsigned long long o = *a;
  if (v < o) *a = v;
  return o;
}
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }

#endif /* KVP_TESTS_CUDA_EMU_H */
