/*
 * util/fault.c - fault injection and allocation tracking (util/fault.h).
 * Compiled to nothing unless KVP_FAULT_INJECT is defined.
 *
 * Counting: every allocation calls kvp__fault_hit once; the armed one (and
 * the later ones if sticky) returns true and the caller fails as if out of
 * memory. Tracking: a set of live pointers (open addressing, linear
 * probing, deletion by backward shift), under a mutex because RCU
 * callbacks free on urcu's thread. Foreign pointers (say, a string jansson
 * allocated) are not in the set, and freeing them changes nothing here.
 */
#include "fault.h"

#ifdef KVP_FAULT_INJECT
#undef malloc
#undef calloc
#undef realloc
#undef strdup
#undef free
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

static _Atomic uint64_t at_k;      /* allocation to fail (1-based), 0 = none */
static _Atomic bool sticky_mode;   /* fail every allocation from at_k on */
static _Atomic uint64_t n_seen;    /* allocations since the last arm */
static _Atomic uint64_t n_failed;  /* failed since the last arm */
static pthread_once_t env_once = PTHREAD_ONCE_INIT;

static void env_read(void) {
  const char *e = getenv("KVP_FAULT_AT");
  if (e && *e) atomic_store(&at_k, strtoull(e, NULL, 10));
}

bool kvp__fault_hit(void) {
  pthread_once(&env_once, env_read);
  uint64_t n = atomic_fetch_add(&n_seen, 1) + 1, k = atomic_load(&at_k);
  bool fail = k && (n == k || (n > k && atomic_load(&sticky_mode)));
  if (fail) atomic_fetch_add(&n_failed, 1);
  return fail;
}

void kvp__fault_arm(uint64_t k, bool sticky) {
  pthread_once(&env_once, env_read);
  atomic_store(&sticky_mode, sticky);
  atomic_store(&n_seen, 0);
  atomic_store(&n_failed, 0);
  atomic_store(&at_k, k);
}

uint64_t kvp__fault_count(void) { return atomic_load(&n_seen); }
uint64_t kvp__fault_failed(void) { return atomic_load(&n_failed); }

/* ---- live set ----------------------------------------------------------- */

#define SET_BITS 20u
#define SET_CAP (1u << SET_BITS)
typedef struct live_ent {
  void *p;      /* NULL = empty */
  size_t bytes; /* as asked */
} live_ent;
static live_ent set[SET_CAP];
static uint64_t set_n, set_bytes;
static pthread_mutex_t set_mu = PTHREAD_MUTEX_INITIALIZER;

static uint32_t slot_of(const void *p) { return (uint32_t)(((uintptr_t)p * 0x9E3779B97F4A7C15ull) >> (64 - SET_BITS)); }

void kvp__fault_track(void *p, size_t bytes) {
  if (!p) return;
  pthread_mutex_lock(&set_mu);
  if (set_n + 1 < SET_CAP / 2) { /* past half full: stop tracking rather than slow down (a test holds far less) */
    uint32_t i = slot_of(p);
    while (set[i].p) i = (i + 1) & (SET_CAP - 1);
    set[i] = (live_ent){p, bytes};
    set_n++;
    set_bytes += bytes;
  }
  pthread_mutex_unlock(&set_mu);
}

/* Drop p from the set; true (and its bytes) if it was there. */
static bool untrack(void *p, size_t *bytes) {
  if (!p) return false;
  bool found = false;
  pthread_mutex_lock(&set_mu);
  uint32_t i = slot_of(p);
  while (set[i].p && set[i].p != p) i = (i + 1) & (SET_CAP - 1);
  if (set[i].p) {
    found = true;
    *bytes = set[i].bytes;
    set_n--;
    set_bytes -= set[i].bytes;
    set[i].p = NULL;
    for (uint32_t j = (i + 1) & (SET_CAP - 1); set[j].p; j = (j + 1) & (SET_CAP - 1)) { /* backward shift */
      uint32_t home = slot_of(set[j].p);
      bool movable = i <= j ? (home <= i || home > j) : (home <= i && home > j);
      if (movable) {
        set[i] = set[j];
        set[j].p = NULL;
        i = j;
      }
    }
  }
  pthread_mutex_unlock(&set_mu);
  return found;
}

void kvp__fault_untrack(void *p) {
  size_t bytes;
  (void)untrack(p, &bytes);
}

uint64_t kvp__fault_live(uint64_t *bytes) {
  pthread_mutex_lock(&set_mu);
  uint64_t n = set_n;
  if (bytes) *bytes = set_bytes;
  pthread_mutex_unlock(&set_mu);
  return n;
}

/* ---- libc wrappers ------------------------------------------------------ */

void *kvp__fault_malloc(size_t n) {
  if (kvp__fault_hit()) return NULL;
  void *p = malloc(n);
  kvp__fault_track(p, n);
  return p;
}

void *kvp__fault_calloc(size_t n, size_t m) {
  if (kvp__fault_hit()) return NULL;
  void *p = calloc(n, m);
  kvp__fault_track(p, n * m);
  return p;
}

void *kvp__fault_realloc(void *p, size_t n) {
  if (kvp__fault_hit()) return NULL;
  size_t old_bytes = 0;
  bool ours = untrack(p, &old_bytes);
  void *q = realloc(p, n);
  if (q) kvp__fault_track(q, n);
  else if (ours && n) kvp__fault_track(p, old_bytes); /* failed: p is still live */
  return q;
}

char *kvp__fault_strdup(const char *s) {
  if (kvp__fault_hit()) return NULL;
  char *p = strdup(s);
  kvp__fault_track(p, p ? strlen(p) + 1 : 0);
  return p;
}

void kvp__fault_free(void *p) {
  kvp__fault_untrack(p);
  free(p);
}
#else
typedef int kvp__fault_unused; /* an empty translation unit is not ISO C */
#endif
