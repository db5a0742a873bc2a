/*
 * util/fault_wrap.h - force-included (-include) in every library file of the
 * fault-injection build: libc's allocation calls go through util/fault.c.
 * The system headers come first, so their declarations stay untouched.
 */
#ifndef KVP_FAULT_WRAP_H
#define KVP_FAULT_WRAP_H
#ifdef KVP_FAULT_INJECT
#include <stdlib.h>
#include <string.h>

#include "fault.h"

#define malloc(n) kvp__fault_malloc(n)
#define calloc(n, m) kvp__fault_calloc(n, m)
#define realloc(p, n) kvp__fault_realloc(p, n)
#define strdup(s) kvp__fault_strdup(s)
#define free(p) kvp__fault_free(p)
#endif
#endif /* KVP_FAULT_WRAP_H */
