/*
 * util/util.h - the base layer every module of kvpool may use: the
 * thread-local error message, assertions, the host metadata allocator,
 * small integer helpers. It depends on nothing of the pool.
 */
#ifndef KVP_UTIL_H
#define KVP_UTIL_H

#ifndef KVP_BUILDING
#define KVP_BUILDING 1
#endif
#include "kvpool.h"

#include "fault.h"

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- errors ----------------------------------------------------------- */

/* Record a message for kvp_last_error() and return status (so callers can
 * write `return kvp__err(KVP_EINVAL, "layer %u >= %u", l, n);`). */
int kvp__err(int status, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The last message without its "KVP_E...: " status prefix (to wrap it). */
const char *kvp__err_detail(void);

/* ---- assertions --------------------------------------------------------
 * KVP_DEBUG = 0: none; 1 (default): cheap invariants; 2: also the expensive
 * tier (full checks after mutations). Bad input is never an assertion. */
#ifndef KVP_DEBUG
#define KVP_DEBUG 1
#endif
void kvp__assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));
#if KVP_DEBUG >= 1
#define kvp__assert(e) ((e) ? (void)0 : kvp__assert_fail(#e, __FILE__, __LINE__))
#else
#define kvp__assert(e) ((void)0)
#endif
#if KVP_DEBUG >= 2
#define kvp__assert_expensive(e) kvp__assert(e)
#else
#define kvp__assert_expensive(e) ((void)0)
#endif

#define KVP__LIKELY(x) __builtin_expect(!!(x), 1)
#define KVP__UNLIKELY(x) __builtin_expect(!!(x), 0)
#define KVP__NOINLINE __attribute__((noinline))
#define KVP__ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

/* ---- the writer lock (util/mutex.c) ------------------------------------
 * A futex word: lock and unlock inline, one atomic instruction each when
 * nobody waits. */
typedef struct kvp__mutex {
  _Atomic uint32_t state; /* 0 free, 1 held, 2 held with waiters maybe asleep */
} kvp__mutex;
void kvp__mutex_lock_slow(kvp__mutex *m);
void kvp__mutex_wake(kvp__mutex *m);
static inline void kvp__mutex_init(kvp__mutex *m) { atomic_init(&m->state, 0); }
static inline void kvp__mutex_lock(kvp__mutex *m) {
  uint32_t z = 0;
  if (KVP__UNLIKELY(!atomic_compare_exchange_strong_explicit(&m->state, &z, 1, memory_order_acquire,
                                                              memory_order_relaxed)))
    kvp__mutex_lock_slow(m);
}
/* Take m if it is free; false, without waiting, if it is held. */
static inline bool kvp__mutex_trylock(kvp__mutex *m) {
  uint32_t z = 0;
  return atomic_compare_exchange_strong_explicit(&m->state, &z, 1, memory_order_acquire, memory_order_relaxed);
}
static inline void kvp__mutex_unlock(kvp__mutex *m) {
  if (KVP__UNLIKELY(atomic_exchange_explicit(&m->state, 0, memory_order_release) == 2)) kvp__mutex_wake(m);
}

/* ---- host metadata -----------------------------------------------------
 * All host-side metadata of a pool comes from one dedicated jemalloc arena
 * (no thread cache; the writer's own explicit cache for an append's block
 * structs and brefs, below), so it never mixes with the engine's own heap, and each
 * allocation's usable size is added to the owner's counter. Builds with
 * KVP_META_LIBC (the sanitizer builds) use libc malloc so ASan/TSan/valgrind
 * see every metadata byte. */
typedef struct kvp__meta {
  _Atomic uint64_t bytes; /* usable bytes currently held */
  _Atomic uint64_t peak_bytes; /* highest value of bytes */
  _Atomic uint64_t total_bytes; /* sum of all allocations */
  int wflags;             /* MALLOCX_* flags of the writer's allocations (kvp__meta_calloc_w): the arena through
                             the explicit cache wcache; 0: none (libc, or no cache could be made) */
  unsigned wcache;        /* jemalloc's index of that cache (tcache.create), when wflags */
} kvp__meta;

void *kvp__meta_alloc(kvp__meta *m, size_t bytes);  /* NULL on failure */
void *kvp__meta_calloc(kvp__meta *m, size_t bytes); /* zeroed */
void kvp__meta_free(kvp__meta *m, void *p, size_t bytes); /* bytes as asked */
/* Stop counting p against m (it will be freed later with a NULL counter). */
void kvp__meta_uncount(kvp__meta *m, void *p, size_t bytes);
/* Resize; on failure returns NULL and leaves p intact. */
void *kvp__meta_realloc(kvp__meta *m, void *p, size_t old_bytes, size_t new_bytes);
/* The writer's cache: an explicit jemalloc thread cache on the metadata
 * arena that only the holder of the pool's writer lock uses (jemalloc's
 * rule for an explicit cache: one thread at a time), for the small structs
 * an append takes per head (blocks, brefs). A cache hit is a pop instead of
 * the arena's lock and bin walk (about 60 instructions instead of 400);
 * the cache keeps at most jemalloc's per-class count of free slots, which
 * no counter shows (they are not held metadata). Frees go to the arena as
 * every metadata free does (the callbacks of RCU run on urcu's thread).
 * Without jemalloc, or if jemalloc cannot make one, _w is kvp__meta_calloc.
 * init cannot fail; fini gives the cached slots back to the arena. */
void kvp__meta_wcache_init(kvp__meta *m);
void kvp__meta_wcache_fini(kvp__meta *m);
void *kvp__meta_calloc_w(kvp__meta *m, size_t bytes); /* zeroed; under the pool's writer lock only */

/* ---- hashing (util/hash.c) -------------------------------------------- */
/* XXH64 of len bytes with seed: store blob checksums, content keys. */
uint64_t kvp__xxh64(const void *data, size_t len, uint64_t seed);
/* out[0] = kvp__xxh64(data, len, seed_a), out[1] = the same under seed_b, in
 * one pass (both chains side by side: about 1.2x faster than two calls). */
void kvp__xxh64_2(const void *data, size_t len, uint64_t seed_a, uint64_t seed_b, uint64_t out[2]);
/* A 128-bit hash of len bytes under two seeds (XXH3's short-input mixing
 * with positional keys: util/hash.c): the content keys of prefix chunks.
 * About 4x fewer multiplies than kvp__xxh64_2. */
void kvp__hash128(const void *data, size_t len, uint64_t seed_a, uint64_t seed_b, uint64_t out[2]);

/* ---- integers ---------------------------------------------------------- */
static inline uint64_t kvp__align_up(uint64_t x, uint64_t a) { return (x + a - 1) & ~(a - 1); }
static inline unsigned kvp__lg_floor(uint64_t x) { return 63u - (unsigned)__builtin_clzll(x); }

#endif /* KVP_UTIL_H */
