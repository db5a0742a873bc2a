/*
 * util/meta.c - host metadata allocation from a dedicated jemalloc arena,
 * or from libc malloc where the process has no jemalloc.
 *
 * Invariant: m->bytes = sum over live metadata blocks of their usable size
 * (sallocx on the arena; the asked size on libc).
 *
 * The arena is created once per process (arenas.create) and shared by all
 * pools; allocations bypass the thread cache (MALLOCX_TCACHE_NONE) so that a
 * free on one thread never parks bytes in another thread's cache. The one
 * exception is a pool's writer cache (kvp__meta_calloc_w): an explicit
 * tcache of the arena (tcache.create) per pool, used only under the pool's
 * writer lock, so one thread at a time as jemalloc requires, for the block
 * structs and brefs an append takes per head; frees still go to the arena.
 * Through it a small allocation costs about half of what the arena's
 * locked path does (a decode token opening a block per head takes 2 H).
 *
 * libkvpool does not link jemalloc. Debian's libjemalloc.so.2 keeps its
 * thread state in initial-exec TLS (2.6 KiB of the static TLS block, flag
 * STATIC_TLS), which only a process that loads it at startup can give: a
 * dlopen of a library needing it fails with "cannot allocate memory in
 * static TLS block" once that block's small surplus is spent (python after
 * torch; any dlopen on glibc's default surplus of about 1.6 KiB). So the
 * jemalloc calls are resolved once, at the first metadata allocation:
 *
 *   KVPOOL_META_MALLOC=libc in the environment  -> libc
 *   libjemalloc.so.2 already in the process      -> its arena (the program
 *     (linked: -ljemalloc, as pkg-config's Libs;      linked or preloaded it;
 *      or LD_PRELOAD)                                  dlopen RTLD_NOLOAD)
 *   else a dlopen of libjemalloc.so.2 that works -> its arena (the static
 *                                                   TLS block has room: a
 *                                                   small C program, a raised
 *                                                   glibc.rtld.optional_static_tls)
 *   else                                         -> libc malloc/free
 *
 * The choice never changes afterwards, so every block is freed by the
 * allocator that made it. Cost: one indirect call through a pointer, as the
 * PLT call it replaces, plus a predicted branch.
 */
#include "util.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

static void count_add(kvp__meta *m, uint64_t n);

#ifndef KVP_META_LIBC
/* for the MALLOCX_* flags only: no jemalloc symbol is referenced */
#include <jemalloc/jemalloc.h>

#define JEMALLOC_SONAME "libjemalloc.so.2"

static struct {
  void *(*mallocx)(size_t, int);
  void *(*rallocx)(void *, size_t, int);
  void (*sdallocx)(void *, size_t, int);
  size_t (*sallocx)(const void *, int);
  int (*mallctl)(const char *, void *, size_t *, void *, size_t);
} je; /* all NULL: libc */
static pthread_once_t resolve_once = PTHREAD_ONCE_INIT;
static int arena_flags; /* MALLOCX_* flags of the metadata arena */
static int arena_only;  /* its MALLOCX_ARENA part alone (0: the default arena) */

static bool je_bind(void *h) {
  if (!h) return false;
  /* POSIX: a void * from dlsym converts to a function pointer (the cast through memcpy keeps -Wpedantic quiet) */
  void *f[5] = {dlsym(h, "mallocx"), dlsym(h, "rallocx"), dlsym(h, "sdallocx"), dlsym(h, "sallocx"),
                dlsym(h, "mallctl")};
  for (int i = 0; i < 5; i++)
    if (!f[i]) return false; /* not a jemalloc of the 5.x API: libc */
  memcpy(&je.mallocx, &f[0], sizeof f[0]);
  memcpy(&je.rallocx, &f[1], sizeof f[1]);
  memcpy(&je.sdallocx, &f[2], sizeof f[2]);
  memcpy(&je.sallocx, &f[3], sizeof f[3]);
  memcpy(&je.mallctl, &f[4], sizeof f[4]);
  return true;
}

static void resolve(void) {
  const char *env = getenv("KVPOOL_META_MALLOC");
  if (env && strcmp(env, "libc") == 0) return;
  void *h = dlopen(JEMALLOC_SONAME, RTLD_NOW | RTLD_NOLOAD);
  if (!h) h = dlopen(JEMALLOC_SONAME, RTLD_NOW | RTLD_LOCAL); /* fails cleanly without static TLS */
  if (!je_bind(h)) {
    memset(&je, 0, sizeof je);
    (void)dlerror(); /* a failed dlopen's message is not the caller's business */
    return;
  }
  unsigned ind = 0;
  size_t sz = sizeof ind;
  if (je.mallctl("arenas.create", &ind, &sz, NULL, 0) == 0)
    arena_flags = (arena_only = MALLOCX_ARENA(ind)) | MALLOCX_TCACHE_NONE;
  else
    arena_flags = MALLOCX_TCACHE_NONE; /* default arena: still jemalloc */
}

static inline bool on_jemalloc(void) {
  pthread_once(&resolve_once, resolve);
  return je.mallocx != NULL;
}

static size_t size_of(void *p, size_t asked) {
  return je.mallocx ? je.sallocx(p, arena_flags) : (asked ? asked : 1);
}
/* The fault-injection build counts and tracks arena allocations here (the
 * libc ones go through its libc wrappers). */
static void *raw_alloc(size_t n, bool zero) {
  if (!on_jemalloc()) return zero ? calloc(1, n ? n : 1) : malloc(n ? n : 1);
  if (KVP__FAULT()) return NULL;
  void *p = je.mallocx(n ? n : 1, arena_flags | (zero ? MALLOCX_ZERO : 0));
#ifdef KVP_FAULT_INJECT
  kvp__fault_track(p, n);
#endif
  return p;
}
static void raw_free(void *p, size_t n) {
  if (!je.mallocx) { /* set before p was allocated */
    free(p);
    return;
  }
#ifdef KVP_FAULT_INJECT
  kvp__fault_untrack(p);
#endif
  je.sdallocx(p, n ? n : 1, arena_flags);
}
static void *raw_realloc(void *p, size_t n) {
  if (!je.mallocx) return realloc(p, n ? n : 1);
  if (KVP__FAULT()) return NULL;
  void *q = je.rallocx(p, n ? n : 1, arena_flags);
#ifdef KVP_FAULT_INJECT
  if (q) {
    kvp__fault_untrack(p);
    kvp__fault_track(q, n);
  }
#endif
  return q;
}

const char *kvp_metadata_allocator(void) { return on_jemalloc() ? "jemalloc" : "libc"; }

void kvp__meta_wcache_init(kvp__meta *m) {
  m->wflags = 0;
  unsigned tc;
  size_t sz = sizeof tc;
  if (on_jemalloc() && je.mallctl("tcache.create", &tc, &sz, NULL, 0) == 0) {
    m->wcache = tc;
    m->wflags = arena_only | MALLOCX_TCACHE(tc);
  }
}

void kvp__meta_wcache_fini(kvp__meta *m) {
  if (!m->wflags) return;
  unsigned tc = m->wcache;
  je.mallctl("tcache.destroy", NULL, NULL, &tc, sizeof tc);
  m->wflags = 0;
}

void *kvp__meta_calloc_w(kvp__meta *m, size_t bytes) {
  if (!m->wflags) return kvp__meta_calloc(m, bytes);
  if (KVP__FAULT()) return NULL;
  void *p = je.mallocx(bytes ? bytes : 1, m->wflags | MALLOCX_ZERO);
#ifdef KVP_FAULT_INJECT
  kvp__fault_track(p, bytes);
#endif
  if (p) count_add(m, je.sallocx(p, arena_flags));
  return p;
}
#else
static size_t size_of(void *p, size_t asked) {
  (void)p;
  return asked ? asked : 1;
}
static void *raw_alloc(size_t n, bool zero) { return zero ? calloc(1, n ? n : 1) : malloc(n ? n : 1); }
static void raw_free(void *p, size_t n) { (void)n; free(p); }
static void *raw_realloc(void *p, size_t n) { return realloc(p, n ? n : 1); }

const char *kvp_metadata_allocator(void) { return "libc"; }

void kvp__meta_wcache_init(kvp__meta *m) { m->wflags = 0; }
void kvp__meta_wcache_fini(kvp__meta *m) { (void)m; }
void *kvp__meta_calloc_w(kvp__meta *m, size_t bytes) { return kvp__meta_calloc(m, bytes); }
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
