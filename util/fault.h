/*
 * util/fault.h - fault injection for tests: in the build variant compiled
 * with -DKVP_FAULT_INJECT (tests/unit/check_fault links it), the k-th
 * internal allocation fails on demand. Every allocation the library makes
 * counts as one: the metadata allocator (util/meta.c), libc's malloc,
 * calloc, realloc and strdup (redirected by util/fault_wrap.h, which that
 * build force-includes in every library file), the region reservation
 * (mmap, cudaMalloc) and the sequence hash table. The same build tracks
 * every live allocation it made, so a test can tell a leak from a clean
 * destroy without a sanitizer.
 *
 * Arm with kvp__fault_arm(k) from a test, or KVP_FAULT_AT=k in the
 * environment (read at the first allocation). Other builds compile none of
 * this: KVP__FAULT() is the constant false.
 */
#ifndef KVP_FAULT_H
#define KVP_FAULT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef KVP_FAULT_INJECT
/* Count one allocation; true when it is the one to fail. */
bool kvp__fault_hit(void);
/* Fail the k-th allocation from now (1-based), and every later one too if
 * sticky; k = 0 disarms. Resets the count. */
void kvp__fault_arm(uint64_t k, bool sticky);
uint64_t kvp__fault_count(void);  /* allocations counted since the last arm */
uint64_t kvp__fault_failed(void); /* allocations failed since the last arm */
/* Live allocations the library holds (metadata and libc, through the
 * wrappers), and their bytes as asked. */
uint64_t kvp__fault_live(uint64_t *bytes);
void kvp__fault_track(void *p, size_t bytes); /* p NULL: nothing */
void kvp__fault_untrack(void *p);             /* p unknown or NULL: nothing */

void *kvp__fault_malloc(size_t n);
void *kvp__fault_calloc(size_t n, size_t m);
void *kvp__fault_realloc(void *p, size_t n);
char *kvp__fault_strdup(const char *s);
void kvp__fault_free(void *p);
#define KVP__FAULT() kvp__fault_hit()
#else
#define KVP__FAULT() false
#endif

#endif /* KVP_FAULT_H */
