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
 * or kvp__rcu_call). kvp__rcu_barrier waits for queued callbacks.
 */
#ifndef KVP_RCU_H
#define KVP_RCU_H

#define _LGPL_SOURCE /* inline fast paths of urcu-bp */
#include <urcu-bp.h>
#include <urcu/rculfhash.h>

typedef struct rcu_head kvp__rcu_head;

static inline void kvp__rcu_read_lock(void) { urcu_bp_read_lock(); }
static inline void kvp__rcu_read_unlock(void) { urcu_bp_read_unlock(); }
static inline void kvp__rcu_synchronize(void) { urcu_bp_synchronize_rcu(); }
static inline void kvp__rcu_call(kvp__rcu_head *h, void (*fn)(kvp__rcu_head *)) { urcu_bp_call_rcu(h, fn); }
static inline void kvp__rcu_barrier(void) { urcu_bp_barrier(); }
#define kvp__rcu_assign(p, v) rcu_assign_pointer(p, v)
#define kvp__rcu_deref(p) rcu_dereference(p)

#endif /* KVP_RCU_H */
