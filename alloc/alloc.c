/*
 * alloc/alloc.c - the page allocator: size-class dispatch (slab slots up to
 * small_max_bytes, 32 KiB in a region of 8 MiB or more; extents above,
 * sized to the 4 KiB unit), the strict budget, grow, and the allocator check.
 *
 * Invariants (kvp__alloc_check):
 *   page.allocated   = kvp__alloc_size(a, requested) when taken; a page keeps its
 *                      bytes when it shrinks in place
 *   ledger.allocated = sum over live slab slots of their class size
 *                    + sum over LARGE extents of their bytes (no class rounding)
 *                    (live slots = slots taken in the bitmaps - cached slots)
 *   ledger.committed = bytes of SLAB and LARGE extents = ext.used_bytes
 *   ledger.pages     = live slots + LARGE extents
 *   every cached slot: a taken slot of a slab of its class, in one cache once
 *   ledger.allocated <= ledger.budget (and peak too), committed <= reserved
 *
 * Order of every mutation: validate, check the budget, reserve metadata
 * (the sequence's stats slot), take the bytes, then count them. Anything that
 * fails before the last step leaves the allocator as it was.
 *
 * Cost of the fast path (small class, a slot in the class's cache): a table
 * lookup for the class, a budget compare, a pop (a free: a push) on the
 * cache, the sequence's slot (the last one's compare, else its hint's; a
 * probe of the table if neither) and the per-tag counters: no slab touched,
 * no locks of its own (the caller holds the pool's writer lock), no system
 * calls. The bitmaps are searched a half cache at a time (kvp__bin_refill).
 */
#include "slab.h"

#include <string.h>

int kvp__alloc_init(kvp__alloc *a, kvp_mem mem, int device, uint64_t region_bytes, uint64_t budget_bytes,
                    uint32_t flags, kvp__stats *stats, kvp__meta *meta) {
  memset(a, 0, sizeof *a);
  kvp__sc_init();
  a->stats = stats;
  a->meta = meta;
  for (uint32_t i = 0; i < KVP__SC_SMALL_COUNT; i++) a->bins[i].cur = &kvp__slab_empty;
  int rc = kvp__region_open(mem, device, region_bytes, flags, &a->region);
  if (rc) return rc;
  a->slab_bytes = kvp__slab_bytes_for(region_bytes);
  a->small_max_bytes = kvp__small_max_for(a->slab_bytes);
  a->page_align_bytes = mem == KVP_MEM_CUDA ? 64 : KVP__SC_TINY; /* dry CUDA pools too: the same pages */
  a->nsmall = kvp__sc_index(a->small_max_bytes) + 1;
  kvp__assert(kvp__sc_size(a->nsmall - 1) == a->small_max_bytes && a->nsmall <= KVP__SC_SMALL_COUNT);
  for (uint32_t c = 0; c < a->nsmall; c++)
    a->class_slab_bytes[c] = kvp__slab_bytes_of(kvp__sc_size(c), a->slab_bytes);
  if ((rc = kvp__extents_init(&a->ext, region_bytes, meta))) {
    kvp__region_close(&a->region);
    return rc;
  }
  if ((flags & KVP_POOL_PREFAULT) && (rc = kvp__extents_map_whole(&a->ext))) { /* no first-touch cost there either */
    kvp__extents_fini(&a->ext);
    kvp__region_close(&a->region);
    return rc;
  }
  kvp__ledger_init(&a->ledger, region_bytes, budget_bytes);
  a->large_cache_bytes = region_bytes / 16 < KVP__LARGE_CACHE_BYTES ? region_bytes / 16 : KVP__LARGE_CACHE_BYTES;
  return KVP_OK;
}

void kvp__alloc_fini(kvp__alloc *a) {
  kvp__slabs_fini(a);
  kvp__extents_fini(&a->ext);
  kvp__region_close(&a->region);
}

uint64_t kvp__alloc_room_bound(const kvp__alloc *a) {
  uint64_t room = a->ledger.reserved_bytes - a->ledger.committed.current;
  for (uint32_t c = 0; c < a->nsmall; c++) {
    uint64_t size = kvp__sc_size(c), nslots = a->class_slab_bytes[c] / size;
    room += (a->bins[c].nslabs * nslots - a->bins[c].nused + a->bins[c].ncached) * size;
  }
  return room + a->large_cached_bytes;
}

bool kvp__alloc_fits(const kvp__alloc *a, uint64_t bytes) {
  return bytes && bytes <= KVP_MAX_PAGE_BYTES && kvp__ledger_fits(&a->ledger, kvp__alloc_size(a, bytes));
}

/* Take size bytes (kvp__alloc_size of a request); *off receives the region
 * offset. */
static int take(kvp__alloc *a, uint64_t size, uint64_t *off) {
  if (KVP__LIKELY(size <= a->small_max_bytes)) {
    uint32_t sc = kvp__sc_index(size);
    kvp__bin *b = &a->bins[sc];
    if (KVP__LIKELY(b->ncached)) {
      *off = b->cache[--b->ncached];
      return KVP_OK;
    }
    return kvp__bin_refill(a, sc, off);
  }
  for (uint32_t i = a->nlarge_cached; i--;) { /* the newest of its size first */
    kvp__extent *c = a->large_cache[i];
    if (c->bytes != size) continue;
    memmove(&a->large_cache[i], &a->large_cache[i + 1], (a->nlarge_cached - i - 1) * sizeof *a->large_cache);
    a->nlarge_cached--;
    a->large_cached_bytes -= size;
    c->cached = false;
    *off = c->off;
    return KVP_OK;
  }
  kvp__extent *e = NULL;
  int rc = kvp__extent_alloc(&a->ext, size, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &e);
  if (rc == KVP_ENOSPC && kvp__slabs_purge_empty(a))
    rc = kvp__extent_alloc(&a->ext, size, KVP__EXTENT_UNIT, KVP__EXT_LARGE, &e);
  if (rc) return rc;
  kvp__gauge_add(&a->ledger.committed, e->bytes);
  kvp__gauge_add(&a->ledger.extents, 1);
  *off = e->off;
  return KVP_OK;
}

/* A LARGE extent back to the extents. */
static void large_release(kvp__alloc *a, kvp__extent *e) {
  kvp__gauge_sub(&a->ledger.committed, e->bytes);
  kvp__gauge_sub(&a->ledger.extents, 1);
  kvp__extent_free(&a->ext, e);
}

/* The LARGE extent of a live large page at off of size bytes, or NULL
 * with a message (EINVAL). */
static kvp__extent *large_live(kvp__alloc *a, uint64_t off, uint64_t size) {
  kvp__extent *e = kvp__extent_at(&a->ext, off);
  if (!e || e->state != KVP__EXT_LARGE || e->off != off || e->bytes != size || e->cached) {
    kvp__err(KVP_EINVAL, "page at offset %llu (%llu bytes): not a live large page (foreign or already freed%s)",
             (unsigned long long)off, (unsigned long long)size, e && e->cached ? ": double free" : "");
    return NULL;
  }
  return e;
}

/* A live large page's extent onto the large cache (the oldest entry goes
 * back to the extents if the cache is full), or back to the extents if
 * it is larger than the cache may hold. */
static void large_give_back(kvp__alloc *a, kvp__extent *e) {
  if (e->bytes > a->large_cache_bytes) {
    large_release(a, e);
    return;
  }
  while (a->nlarge_cached == KVP__LARGE_CACHE_MAX || a->large_cached_bytes + e->bytes > a->large_cache_bytes) {
    kvp__extent *old = a->large_cache[0];
    memmove(&a->large_cache[0], &a->large_cache[1], (a->nlarge_cached - 1) * sizeof *a->large_cache);
    a->nlarge_cached--;
    a->large_cached_bytes -= old->bytes;
    old->cached = false;
    large_release(a, old);
  }
  e->cached = true;
  a->large_cache[a->nlarge_cached++] = e;
  a->large_cached_bytes += e->bytes;
}

uint64_t kvp__large_flush(kvp__alloc *a) {
  uint32_t n = a->nlarge_cached;
  for (uint32_t i = 0; i < n; i++) {
    a->large_cache[i]->cached = false;
    large_release(a, a->large_cache[i]);
  }
  a->nlarge_cached = 0;
  a->large_cached_bytes = 0;
  return n;
}

void kvp__alloc_trim(kvp__alloc *a) {
  kvp__ledger_begin(&a->ledger);
  kvp__slabs_purge_empty(a);
  kvp__ledger_end(&a->ledger);
}

int kvp__alloc_put(kvp__alloc *a, uint64_t off, uint64_t size) {
  if (size <= a->small_max_bytes) return kvp__slab_put(a, off, kvp__sc_index(size));
  kvp__extent *e = large_live(a, off, size);
  if (!e) return KVP_EINVAL;
  large_release(a, e);
  return KVP_OK;
}

static int check_tag(const kvp__alloc *a, const kvp__tag *tag) {
  if (!tag) return kvp__err(KVP_EINVAL, "page tag is NULL");
  if (tag->layer >= a->stats->n_layers)
    return kvp__err(KVP_EINVAL, "page tag: layer %u >= n_layers %u", tag->layer, a->stats->n_layers);
  if (tag->head >= a->stats->n_heads)
    return kvp__err(KVP_EINVAL, "page tag: head %u >= n_kv_heads %u", tag->head, a->stats->n_heads);
  if (tag->type >= KVP_PAGE_TYPE_COUNT) return kvp__err(KVP_EINVAL, "page tag: page type %u unknown", tag->type);
  if (tag->kv > 1) return kvp__err(KVP_EINVAL, "page tag: kv %u is neither 0 (K) nor 1 (V)", tag->kv);
  if (tag->codec >= KVP__MAX_CODECS)
    return kvp__err(KVP_EINVAL, "page tag: codec id %u >= %u", tag->codec, KVP__MAX_CODECS);
  return KVP_OK;
}

static int refuse_budget(kvp__alloc *a, uint64_t bytes, uint64_t alloc_bytes) {
  kvp__ledger_begin(&a->ledger);
  kvp__count_add(&a->ledger.budget_refusals, 1);
  kvp__ledger_end(&a->ledger);
  return kvp__err(KVP_EBUDGET, "page of %llu bytes (%llu allocated): allocated %llu + %llu would pass budget %llu",
                  (unsigned long long)bytes, (unsigned long long)alloc_bytes,
                  (unsigned long long)a->ledger.allocated.current, (unsigned long long)alloc_bytes,
                  (unsigned long long)a->ledger.budget_bytes);
}

static int refuse_space(kvp__alloc *a, uint64_t bytes, uint64_t alloc_bytes) {
  kvp__ledger_begin(&a->ledger);
  kvp__count_add(&a->ledger.nospc_refusals, 1);
  kvp__ledger_end(&a->ledger);
  return kvp__err(KVP_ENOSPC, "page of %llu bytes (%llu allocated): no room in the %llu-byte region (%llu committed)",
                  (unsigned long long)bytes, (unsigned long long)alloc_bytes,
                  (unsigned long long)a->ledger.reserved_bytes, (unsigned long long)a->ledger.committed.current);
}

static inline __attribute__((always_inline)) void count(kvp__alloc *a, const kvp__page *p, int sign) {
  kvp__alloc_count_as(a, &p->tag, p->requested_bytes, kvp__page_alloc_bytes(p), sign);
}

void kvp__alloc_count(kvp__alloc *a, const kvp__page *p, int sign) {
  if (sign > 0) count(a, p, +1);
  else count(a, p, -1);
}

/* Allocate without validation or ledger section (callers hold it). */
static int alloc_locked(kvp__alloc *a, uint64_t bytes, const kvp__tag *tag, kvp__page *out) {
  const kvp__tag t = *tag; /* counted from this copy, not from the page just written (a load of bytes of a wide
                              store that has not left the core stalls until it has) */
  uint64_t size = kvp__alloc_size(a, bytes);
  if (KVP__UNLIKELY(!kvp__ledger_fits(&a->ledger, size))) return KVP_EBUDGET;
  if (KVP__UNLIKELY(kvp__stats_reserve_seq(a->stats, t.seq))) return KVP_ENOMEM;
  uint64_t off = 0;
  int rc = take(a, size, &off);
  if (KVP__UNLIKELY(rc)) return rc;
  if (KVP__UNLIKELY(a->tx != NULL) && a->tx->space_freed && !a->tx->reused)
    a->tx->reused = kvp__alloc_tx_overlaps(a->tx, off, size);
  out->off = off;
  out->requested_bytes = (uint32_t)bytes;
  out->size8 = (uint32_t)(size >> 3);
  out->tag = t;
  kvp__alloc_count_as(a, &t, bytes, size, +1);
  kvp__count_add(&a->ledger.allocs, 1);
  return KVP_OK;
}

static KVP__NOINLINE int refuse(kvp__alloc *a, int rc, uint64_t bytes) {
  uint64_t size = kvp__alloc_size(a, bytes);
  if (rc == KVP_EBUDGET) return refuse_budget(a, bytes, size);
  if (rc == KVP_ENOSPC) return refuse_space(a, bytes, size);
  return rc; /* ENOMEM: message already set */
}

int kvp__alloc_page_tagged_slow(kvp__alloc *a, uint64_t bytes, const kvp__tag *tag, kvp__page *out) {
  if (KVP__UNLIKELY(!bytes || bytes > KVP_MAX_PAGE_BYTES))
    return kvp__err(KVP_EINVAL, "page size %llu bytes: must be 1..%llu", (unsigned long long)bytes,
                    (unsigned long long)KVP_MAX_PAGE_BYTES);
  kvp__ledger_begin(&a->ledger);
  int rc = alloc_locked(a, bytes, tag, out);
  kvp__ledger_end(&a->ledger);
  return KVP__UNLIKELY(rc) ? refuse(a, rc, bytes) : KVP_OK;
}

int kvp__alloc_page(kvp__alloc *a, uint64_t bytes, const kvp__tag *tag, kvp__page *out) {
  int rc = check_tag(a, tag);
  return rc ? rc : kvp__alloc_page_tagged(a, bytes, tag, out);
}

/* A live page's bytes back: a slot on its class's cache, a large page's
 * extent to the extents. */
static void give_back(kvp__alloc *a, const kvp__page *p) {
  uint64_t size = kvp__page_alloc_bytes(p);
  if (KVP__LIKELY(size <= a->small_max_bytes)) {
    uint32_t sc = kvp__sc_index(size);
    kvp__bin *b = &a->bins[sc];
    if (KVP__LIKELY(b->ncached < b->cache_cap)) b->cache[b->ncached++] = p->off;
    else kvp__bin_push_slow(a, sc, p->off);
    return;
  }
  kvp__extent *e = large_live(a, p->off, size);
  kvp__assert(e != NULL);
  large_give_back(a, e);
}

int kvp__alloc_free(kvp__alloc *a, const kvp__page *p) {
  if (!p) return kvp__err(KVP_EINVAL, "page is NULL");
  uint64_t size = kvp__page_alloc_bytes(p);
  bool small_ok = size <= a->small_max_bytes && size && kvp__sc_size(kvp__page_class(p)) == size;
  bool large_ok = size > a->small_max_bytes && size % KVP__EXTENT_UNIT == 0;
  if ((!small_ok && !large_ok) || !p->requested_bytes || p->requested_bytes > size)
    return kvp__err(KVP_EINVAL, "page at offset %llu: %llu allocated / %u requested bytes is not a page",
                    (unsigned long long)p->off, (unsigned long long)size, p->requested_bytes);
  if (small_ok) { /* a live slot: validated here, then cached (its bytes stay taken in the bitmap) */
    int rc = kvp__slab_check_live(a, p->off, kvp__page_class(p));
    if (rc) return rc;
    kvp__alloc_free_live(a, p);
    return KVP_OK;
  }
  if (!large_live(a, p->off, size)) return KVP_EINVAL;
  kvp__alloc_free_live_slow(a, p);
  return KVP_OK;
}

void kvp__alloc_free_live_slow(kvp__alloc *a, const kvp__page *p) {
  kvp__ledger_begin(&a->ledger);
  give_back(a, p);
  count(a, p, -1);
  kvp__count_add(&a->ledger.frees, 1);
  kvp__ledger_end(&a->ledger);
}

/* Large page whose extent can take the following free extent. */
static int grow_large_in_place(kvp__alloc *a, kvp__page *p, uint64_t new_cls, uint64_t bytes) {
  kvp__extent *e = kvp__extent_at(&a->ext, p->off);
  uint64_t old_cls = kvp__page_alloc_bytes(p);
  if (!e || e->state != KVP__EXT_LARGE || !kvp__ledger_fits(&a->ledger, new_cls - old_cls)) return KVP_ENOSPC;
  if (!kvp__extent_grow_in_place(&a->ext, e, new_cls)) return KVP_ENOSPC;
  kvp__alloc_count(a, p, -1);
  p->size8 = (uint32_t)(new_cls >> 3);
  p->requested_bytes = (uint32_t)bytes;
  kvp__alloc_count(a, p, +1);
  kvp__gauge_add(&a->ledger.committed, new_cls - old_cls);
  return KVP_OK;
}

int kvp__alloc_grow(kvp__alloc *a, kvp__page *p, uint64_t bytes, void *stream) {
  if (!bytes || bytes > KVP_MAX_PAGE_BYTES)
    return kvp__err(KVP_EINVAL, "grow to %llu bytes: must be 1..%llu", (unsigned long long)bytes,
                    (unsigned long long)KVP_MAX_PAGE_BYTES);
  uint64_t size = kvp__alloc_size(a, bytes);
  int rc = KVP_OK;
  kvp__ledger_begin(&a->ledger);
  kvp__count_add(&a->ledger.grows, 1);
  if (size <= kvp__page_alloc_bytes(p)) { /* the page still holds it: only the requested bytes move */
    kvp__alloc_count(a, p, -1);
    p->requested_bytes = (uint32_t)bytes;
    kvp__alloc_count(a, p, +1);
  } else if (kvp__page_is_small(a, p) || grow_large_in_place(a, p, size, bytes) != KVP_OK) {
    kvp__page np;
    rc = alloc_locked(a, bytes, &p->tag, &np); /* both pages count while the move lasts */
    if (!rc) {
      rc = a->region.ops->copy(&a->region, np.off, p->off, p->requested_bytes < bytes ? p->requested_bytes : bytes,
                               stream);
      kvp__page old = *p;
      kvp__page *drop = rc ? &np : &old;
      int prc = kvp__alloc_put(a, drop->off, kvp__page_alloc_bytes(drop));
      kvp__assert(prc == KVP_OK);
      (void)prc;
      kvp__alloc_count(a, drop, -1);
      kvp__count_add(&a->ledger.allocs, -(rc != 0)); /* an undone move is no allocation */
      if (!rc) {
        *p = np;
        kvp__count_add(&a->ledger.grow_moves, 1);
      }
    }
  }
  if (rc) kvp__count_add(&a->ledger.grows, -1);
  kvp__ledger_end(&a->ledger);
  return rc && rc != KVP_EDEVICE ? refuse(a, rc, bytes) : rc;
}

int kvp__alloc_check(const kvp__alloc *a) {
  int rc = kvp__extents_check(&a->ext);
  if (rc) return rc;
  uint64_t allocated = 0, nused = 0, nslabs = 0, nlarge = 0, nlarge_cached = 0, large_cached_bytes = 0;
  uint64_t per_class_used[KVP__SC_SMALL_COUNT] = {0}, per_class_slabs[KVP__SC_SMALL_COUNT] = {0};
  for (const kvp__extent *e = a->ext.first; e; e = e->anext) {
    if (e->state == KVP__EXT_SLAB) {
      const kvp__slab *s = e->owner;
      uint64_t u = 0;
      if (!s || s->ext != e || s->base != e->off || e->bytes != a->class_slab_bytes[s->sc])
        return kvp__err(KVP_ECORRUPT, "slab extent at offset %llu: its slab disagrees (base or class slab size)",
                        (unsigned long long)e->off);
      if ((rc = kvp__slab_check(a, s, &u))) return rc;
      if (s->slot_bytes % a->page_align_bytes)
        return kvp__err(KVP_ECORRUPT, "slab at offset %llu: class of %u bytes in a region of %llu-byte aligned pages",
                        (unsigned long long)e->off, s->slot_bytes, (unsigned long long)a->page_align_bytes);
      allocated += u * s->slot_bytes;
      nused += u;
      per_class_used[s->sc] += u;
      per_class_slabs[s->sc]++;
      nslabs++;
    } else if (e->state == KVP__EXT_LARGE) {
      if (e->cached) {
        nlarge_cached++;
        large_cached_bytes += e->bytes;
      } else allocated += e->bytes;
      nlarge++;
    } else if (e->cached)
      return kvp__err(KVP_ECORRUPT, "free extent at offset %llu is marked cached", (unsigned long long)e->off);
  }
  for (uint32_t i = 0; i < a->nlarge_cached; i++)
    if (!a->large_cache[i]->cached || a->large_cache[i]->state != KVP__EXT_LARGE)
      return kvp__err(KVP_ECORRUPT, "large cache entry %u (offset %llu) is not a cached large extent", i,
                      (unsigned long long)a->large_cache[i]->off);
  if (nlarge_cached != a->nlarge_cached || large_cached_bytes != a->large_cached_bytes ||
      a->nlarge_cached > KVP__LARGE_CACHE_MAX || a->large_cached_bytes > a->large_cache_bytes)
    return kvp__err(KVP_ECORRUPT, "large cache holds %u extents of %llu bytes, the extents say %llu of %llu",
                    a->nlarge_cached, (unsigned long long)a->large_cached_bytes, (unsigned long long)nlarge_cached,
                    (unsigned long long)large_cached_bytes);
  for (uint32_t c = 0; c < KVP__SC_SMALL_COUNT; c++)
    if (per_class_used[c] != a->bins[c].nused || per_class_slabs[c] != a->bins[c].nslabs)
      return kvp__err(KVP_ECORRUPT, "class %u: %llu used slots in %llu slabs, bin says %llu in %llu", c,
                      (unsigned long long)per_class_used[c], (unsigned long long)per_class_slabs[c],
                      (unsigned long long)a->bins[c].nused, (unsigned long long)a->bins[c].nslabs);
  uint64_t ncached = 0;
  if ((rc = kvp__bins_check(a, &ncached))) return rc;
  for (uint32_t c = 0; c < KVP__SC_SMALL_COUNT; c++) allocated -= a->bins[c].ncached * kvp__sc_size(c);
  nused -= ncached; /* cached slots are free slots to the ledger */
  const kvp__ledger *l = &a->ledger;
  if (allocated != l->allocated.current)
    return kvp__err(KVP_ECORRUPT, "ledger allocated %llu, slabs and extents hold %llu",
                    (unsigned long long)l->allocated.current, (unsigned long long)allocated);
  if (a->ext.used_bytes != l->committed.current)
    return kvp__err(KVP_ECORRUPT, "ledger committed %llu, extents in use %llu",
                    (unsigned long long)l->committed.current, (unsigned long long)a->ext.used_bytes);
  if (nused + nlarge - nlarge_cached != l->pages.current || nslabs != l->slabs.current ||
      nlarge != l->extents.current)
    return kvp__err(KVP_ECORRUPT, "ledger counts %llu pages/%llu slabs/%llu extents, found %llu/%llu/%llu",
                    (unsigned long long)l->pages.current, (unsigned long long)l->slabs.current,
                    (unsigned long long)l->extents.current, (unsigned long long)(nused + nlarge),
                    (unsigned long long)nslabs, (unsigned long long)nlarge);
  if (l->requested.current > l->allocated.current || l->allocated.current > l->committed.current ||
      l->committed.current > l->reserved_bytes)
    return kvp__err(KVP_ECORRUPT, "ledger order broken: requested %llu, allocated %llu, committed %llu, reserved %llu",
                    (unsigned long long)l->requested.current, (unsigned long long)l->allocated.current,
                    (unsigned long long)l->committed.current, (unsigned long long)l->reserved_bytes);
  if (l->allocated.peak > l->budget_bytes)
    return kvp__err(KVP_ECORRUPT, "peak allocated %llu passed the budget %llu", (unsigned long long)l->allocated.peak,
                    (unsigned long long)l->budget_bytes);
  return KVP_OK;
}
