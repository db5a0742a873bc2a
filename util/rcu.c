/*
 * util/rcu.c - the out-of-line part of the RCU wrappers (util/rcu.h): in
 * ThreadSanitizer builds, the object whose release (at every read-side
 * unlock) and acquire (after every grace period) tell TSan what urcu's
 * grace periods guarantee. Other builds have nothing here.
 */
#include "rcu.h"

#ifdef KVP__TSAN
char kvp__rcu_tsan_gp;
#endif
