/*
 * util/rcu.h - the RCU flavor of kvpool behind kvp__rcu_* wrappers, so the
 * flavor can change in one place. The flavor is urcu-bp: threads the
 * library does not own (an engine's reader threads) register themselves on
 * their first read-side lock. No urcu type leaves the library's internals.
 *
 * Rules: readers bracket every traversal of page tables with
 * kvp__rcu_read_lock/unlock and load shared pointers with kvp__rcu_deref;
 * the writer publishes with kvp__rcu_assign (a release store) and never
 * frees what a reader may hold before a grace period (kvp__rcu_synchronize
 * or kvp__rcu_call). kvp__rcu_barrier waits for queued callbacks. Every
 * call_rcu callback begins with kvp__rcu_cb_begin. An object handed over
 * through the lock-free hash table is published with kvp__rcu_publish
 * before cds_lfht_add and subscribed to with kvp__rcu_subscribe in the
 * lookup's match function, before any of its fields is read.
 *
 * ThreadSanitizer cannot see urcu's ordering (fences and volatile accesses
 * inside an uninstrumented library), so TSan builds state it with
 * annotations; other builds compile them to nothing:
 *   - a read-side critical section ends with a release on kvp__rcu_tsan_gp
 *     and a grace period (kvp__rcu_synchronize returning, a callback
 *     starting) acquires it: what readers did happens before what the
 *     writer frees after the grace period;
 *   - kvp__rcu_call releases the rcu_head and kvp__rcu_cb_begin acquires
 *     it: the caller's last writes happen before the callback's free;
 *   - kvp__rcu_cb_end releases and kvp__rcu_barrier acquires: a callback
 *     that ends so happens before the barrier's return;
 *   - publish/subscribe: the writer's initialization of a sequence happens
 *     before a reader that found it in the hash table reads it.
 */
#ifndef KVP_RCU_H
#define KVP_RCU_H

/* Inline fast paths of urcu-bp, except where KVP_RCU_OUTLINE asks for its
 * exported functions (the ASan+UBSan build: liburcu 0.13 places its
 * per-thread reader records below their declared 128-byte alignment, and
 * the inlined accesses abort under -fsanitize=alignment). */
#ifndef KVP_RCU_OUTLINE
#define _LGPL_SOURCE
#endif
#include <urcu-bp.h>
#include <urcu/rculfhash.h>

typedef struct rcu_head kvp__rcu_head;

#if defined(__SANITIZE_THREAD__)
#define KVP__TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVP__TSAN 1
#endif
#endif

#ifdef KVP__TSAN
void __tsan_acquire(void *addr); /* from the TSan runtime (sanitizer/tsan_interface.h) */
void __tsan_release(void *addr);
extern char kvp__rcu_tsan_gp; /* stands for "a grace period has passed" (util/rcu.c) */
#define KVP__TSAN_ACQUIRE(a) __tsan_acquire((void *)(a))
#define KVP__TSAN_RELEASE(a) __tsan_release((void *)(a))
#else
#define KVP__TSAN_ACQUIRE(a) ((void)(a))
#define KVP__TSAN_RELEASE(a) ((void)(a))
#endif

static inline void kvp__rcu_read_lock(void) { urcu_bp_read_lock(); }
static inline void kvp__rcu_read_unlock(void) {
#ifdef KVP__TSAN
  __tsan_release(&kvp__rcu_tsan_gp);
#endif
  urcu_bp_read_unlock();
}
static inline void kvp__rcu_synchronize(void) {
  urcu_bp_synchronize_rcu();
#ifdef KVP__TSAN
  __tsan_acquire(&kvp__rcu_tsan_gp);
#endif
}
static inline void kvp__rcu_call(kvp__rcu_head *h, void (*fn)(kvp__rcu_head *)) {
  KVP__TSAN_RELEASE(h);
  urcu_bp_call_rcu(h, fn);
}
static inline void kvp__rcu_cb_begin(kvp__rcu_head *h) {
  KVP__TSAN_ACQUIRE(h);
#ifdef KVP__TSAN
  __tsan_acquire(&kvp__rcu_tsan_gp);
#endif
}
/* A callback's last act, when what it did (a free, a counter update) must
 * happen before kvp__rcu_barrier returns in TSan's eyes. */
static inline void kvp__rcu_cb_end(void) {
#ifdef KVP__TSAN
  __tsan_release(&kvp__rcu_tsan_gp);
#endif
}
static inline void kvp__rcu_barrier(void) {
  urcu_bp_barrier();
#ifdef KVP__TSAN
  __tsan_acquire(&kvp__rcu_tsan_gp);
#endif
}
/* Registers urcu's fork handlers once per process (util/rcu.c); before
 * the first pool. 0, or pthread_atfork's error number. */
int kvp__rcu_fork_safe(void);
#define kvp__rcu_publish(obj) KVP__TSAN_RELEASE(obj)
#define kvp__rcu_subscribe(obj) KVP__TSAN_ACQUIRE(obj)
/* A release store and a consume load: what rcu_assign_pointer and
 * rcu_dereference guarantee, in the C11 model (so TSan sees them too, and
 * the load stays atomic when urcu's fast paths are not inlined). */
#define kvp__rcu_assign(p, v) __atomic_store_n(&(p), (v), __ATOMIC_RELEASE)
#define kvp__rcu_deref(p) __atomic_load_n(&(p), __ATOMIC_CONSUME)

#endif /* KVP_RCU_H */
