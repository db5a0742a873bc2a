/*
 * pages/pages.h - meaning: the pool object and what lives in its pages.
 * pages uses alloc, codecs and stats; nothing uses pages.
 */
#ifndef KVP_PAGES_H
#define KVP_PAGES_H

#include "../alloc/alloc.h"

#include <pthread.h>

#define KVP__DEFAULT_BLOCK_TOKENS 16u
#define KVP__MAX_BLOCK_TOKENS 65536u

/* One slot of the raw-page table (the experimental page API). */
typedef struct kvp__rawslot {
  kvp__page page; /* the page, when live */
  uint32_t gen;   /* generation: bumped at every free, part of the id */
  uint32_t next;  /* free list link (index + 1; 0 = end) */
  bool live;      /* holds a page */
} kvp__rawslot;

typedef struct kvp__rawpages {
  kvp__rawslot *slots; /* [cap] */
  uint32_t cap;        /* slots */
  uint32_t nlive;      /* live pages */
  uint32_t free_head;  /* first free slot (index + 1; 0 = none) */
} kvp__rawpages;

struct kvp_pool {
  kvp_config cfg;        /* copy of the configuration (strings not kept) */
  pthread_mutex_t lock;  /* the writer lock: one mutator at a time */
  kvp__meta meta;        /* host metadata bytes of this pool */
  kvp__stats stats;      /* per-tag counters */
  kvp__alloc alloc;      /* region, extents, slabs, ledger */
  kvp__rawpages raw;     /* pages handed out through kvp_page_* */
};

/* Visit every live page of the pool (for kvp_check). */
typedef void (*kvp__page_visit)(void *ctx, const kvp__page *pg);
void kvp__rawpages_walk(const kvp__rawpages *r, kvp__page_visit fn, void *ctx);
void kvp__rawpages_fini(kvp_pool *pool);

static inline void kvp__lock(kvp_pool *p) { pthread_mutex_lock(&p->lock); }
static inline void kvp__unlock(kvp_pool *p) { pthread_mutex_unlock(&p->lock); }

#endif /* KVP_PAGES_H */
