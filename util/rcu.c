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
 * Order matters: the prepare handler waits for the call_rcu worker to
 * pause, and the worker's callbacks free metadata. Prepare handlers run in
 * reverse order of registration, so ours are registered after the
 * metadata allocator is up (a jemalloc that libkvpool loads registers its
 * own lock-everything handler when it initializes): the worker finishes
 * its frees before jemalloc's locks are taken, where the other order
 * deadlocks the fork. glibc's malloc locks inside fork() itself, after
 * every handler. A dlclose of the library unregisters them (glibc).
 * Cost: once a pool exists, fork() takes about 17 ms more (urcu pauses and
 * resumes its workers by polling in 1 ms steps); vfork and posix_spawn run
 * no handlers and cost nothing more.
 *
 * ThreadSanitizer builds also hold the object whose release (at every
 * read-side unlock) and acquire (after every grace period) tell TSan what
 * urcu's grace periods guarantee.
 */
#include "rcu.h"

#include "kvpool.h"

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

static void fork_register(void) {
  (void)kvp_metadata_allocator(); /* the allocator first: see the banner */
  fork_rc = pthread_atfork(fork_prepare, fork_parent, fork_child);
}

int kvp__rcu_fork_safe(void) {
  pthread_once(&fork_once, fork_register);
  return fork_rc;
}
