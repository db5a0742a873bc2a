/*
 * util/meta.c - host metadata allocation from a dedicated jemalloc arena.
 *
 * Invariant: m->bytes = sum over live metadata blocks of their usable size
 * (sallocx, or the asked size under KVP_META_LIBC).
 *
 * The arena is created once per process (arenas.create) and shared by all
 * pools; allocations bypass the thread cache (MALLOCX_TCACHE_NONE) so that a
 * free on one thread never parks bytes in another thread's cache.
 */
#include "util.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#ifndef KVP_META_LIBC
#include <jemalloc/jemalloc.h>

static pthread_once_t arena_once = PTHREAD_ONCE_INIT;
static int arena_flags; /* MALLOCX_* flags of the metadata arena, 0 if none */

static void arena_init(void) {
  unsigned ind = 0;
  size_t sz = sizeof ind;
  if (mallctl("arenas.create", &ind, &sz, NULL, 0) == 0)
    arena_flags = MALLOCX_ARENA(ind) | MALLOCX_TCACHE_NONE;
  else
    arena_flags = MALLOCX_TCACHE_NONE; /* default arena: still jemalloc */
}

static size_t size_of(void *p, size_t asked) {
  (void)asked;
  return sallocx(p, arena_flags);
}
/* The fault-injection build counts and tracks arena allocations here (the
 * libc ones of KVP_META_LIBC go through its libc wrappers). */
static void *raw_alloc(size_t n, bool zero) {
  pthread_once(&arena_once, arena_init);
  if (KVP__FAULT()) return NULL;
  void *p = mallocx(n ? n : 1, arena_flags | (zero ? MALLOCX_ZERO : 0));
#ifdef KVP_FAULT_INJECT
  kvp__fault_track(p, n);
#endif
  return p;
}
static void raw_free(void *p, size_t n) {
#ifdef KVP_FAULT_INJECT
  kvp__fault_untrack(p);
#endif
  sdallocx(p, n ? n : 1, arena_flags);
}
static void *raw_realloc(void *p, size_t n) {
  if (KVP__FAULT()) return NULL;
  void *q = rallocx(p, n ? n : 1, arena_flags);
#ifdef KVP_FAULT_INJECT
  if (q) {
    kvp__fault_untrack(p);
    kvp__fault_track(q, n);
  }
#endif
  return q;
}
#else
static size_t size_of(void *p, size_t asked) {
  (void)p;
  return asked ? asked : 1;
}
static void *raw_alloc(size_t n, bool zero) { return zero ? calloc(1, n ? n : 1) : malloc(n ? n : 1); }
static void raw_free(void *p, size_t n) { (void)n; free(p); }
static void *raw_realloc(void *p, size_t n) { return realloc(p, n ? n : 1); }
#endif

static void count_add(kvp__meta *m, uint64_t n) {
  if (!m) return;
  uint64_t now = atomic_fetch_add_explicit(&m->bytes, n, memory_order_relaxed) + n;
  atomic_fetch_add_explicit(&m->total_bytes, n, memory_order_relaxed);
  uint64_t pk = atomic_load_explicit(&m->peak_bytes, memory_order_relaxed);
  while (now > pk && !atomic_compare_exchange_weak_explicit(&m->peak_bytes, &pk, now, memory_order_relaxed,
                                                            memory_order_relaxed)) {
  }
}

static void count_sub(kvp__meta *m, uint64_t n) {
  if (m) atomic_fetch_sub_explicit(&m->bytes, n, memory_order_relaxed);
}

void *kvp__meta_alloc(kvp__meta *m, size_t bytes) {
  void *p = raw_alloc(bytes, false);
  if (p) count_add(m, size_of(p, bytes));
  return p;
}

void *kvp__meta_calloc(kvp__meta *m, size_t bytes) {
  void *p = raw_alloc(bytes, true);
  if (p) count_add(m, size_of(p, bytes));
  return p;
}

void kvp__meta_free(kvp__meta *m, void *p, size_t bytes) {
  if (!p) return;
  count_sub(m, size_of(p, bytes));
  raw_free(p, bytes);
}

void kvp__meta_uncount(kvp__meta *m, void *p, size_t bytes) {
  if (p) count_sub(m, size_of(p, bytes));
}

void *kvp__meta_realloc(kvp__meta *m, void *p, size_t old_bytes, size_t new_bytes) {
  if (!p) return kvp__meta_alloc(m, new_bytes);
  size_t before = size_of(p, old_bytes);
  void *q = raw_realloc(p, new_bytes);
  if (!q) return NULL;
  count_sub(m, before);
  count_add(m, size_of(q, new_bytes));
  return q;
}
