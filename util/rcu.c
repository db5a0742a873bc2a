/*
 * util/rcu.c - the out-of-line part of the RCU wrappers (util/rcu.h).
 *
 * fork(): only the forking thread lives on in the child, so urcu's
 * call_rcu worker, its reader registry and the hash tables' resize worker
 * would be copies of state whose owners are gone, and the child's first
 * rcu_barrier (kvp_pool_destroy) would wait forever. kvp__rcu_fork_safe,
 * called before the first pool exists, registers urcu-bp's fork handlers
 * once per process: the parent pauses the workers before fork and resumes
 * them after; the child rebuilds them, so a pool made in the child works
 * like any other (pools of the parent are not the child's to use: their
 * memory is a copy, and a CUDA region is not usable after fork at all).
 * The handlers run before the allocators lock for fork (they were
 * registered later, and prepare handlers run in reverse order), so a
 * callback that frees memory finishes before the allocator's locks are
 * taken. A dlclose of the library unregisters them (glibc).
 *
 * ThreadSanitizer builds also hold the object whose release (at every
 * read-side unlock) and acquire (after every grace period) tell TSan what
 * urcu's grace periods guarantee.
 */
#include "rcu.h"

#include <pthread.h>

#ifdef KVP__TSAN
char kvp__rcu_tsan_gp;
#endif

static void fork_prepare(void) {
  urcu_bp_call_rcu_before_fork();
  urcu_bp_before_fork();
}

static void fork_parent(void) {
  urcu_bp_after_fork_parent();
  urcu_bp_call_rcu_after_fork_parent();
}

static void fork_child(void) {
  urcu_bp_after_fork_child();
  urcu_bp_call_rcu_after_fork_child();
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static int fork_rc;

static void fork_register(void) { fork_rc = pthread_atfork(fork_prepare, fork_parent, fork_child); }

int kvp__rcu_fork_safe(void) {
  pthread_once(&fork_once, fork_register);
  return fork_rc;
}
