/*
 * util/mutex.c - the pool's writer lock: a futex word (U. Drepper,
 * "Futexes Are Tricky", mutex 3), so that the uncontended lock and unlock
 * are inline, one atomic instruction each, with no call into libc (the page
 * API takes the lock once per call, so a pthread mutex's call and type
 * dispatch were a measurable part of an alloc+free pair).
 *
 *   state 0: free   1: held, no waiter   2: held, waiters maybe asleep
 *
 * Invariants: only the holder moves state from 1 or 2 to 0; a thread
 * sleeps in futex_wait only on state 2, and whoever sets state 2 wakes one
 * sleeper at its unlock. Acquire on taking, release on giving back: what
 * one holder wrote happens before what the next one reads (TSan sees the
 * atomics). Not recursive, no owner check: like PTHREAD_MUTEX_NORMAL.
 */
#include "util.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

void kvp__mutex_lock_slow(kvp__mutex *m) {
  for (int spin = 0; spin < 100; spin++) { /* a short hold (one page op) ends soon: spin before sleeping */
    uint32_t z = 0;
    if (atomic_load_explicit(&m->state, memory_order_relaxed) == 0 &&
        atomic_compare_exchange_weak_explicit(&m->state, &z, 1, memory_order_acquire, memory_order_relaxed))
      return;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
  }
  while (atomic_exchange_explicit(&m->state, 2, memory_order_acquire) != 0)
    syscall(SYS_futex, &m->state, FUTEX_WAIT_PRIVATE, 2, NULL, NULL, 0);
}

void kvp__mutex_wake(kvp__mutex *m) { syscall(SYS_futex, &m->state, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0); }
