/*
 * alloc/slab.c - slabs: one extent cut into slots of one size class, with a
 * host-side bitmap (bit set = slot free). A slab is sized by its class
 * (kvp__slab_bytes_of: 8 slots rounded up to the 4 KiB unit, at least
 * 256 KiB, at most 512 slots, at most the cap: 2 MiB, or a 32nd of a region
 * under 64 MiB, at least 64 KiB; the floor is an 8th of a smaller cap, and
 * the 8 slots bound the slab classes: kvp__small_max_for), so an 8 B class
 * takes a 4 KiB slab, a 64 B one 32 KiB, and a region of any size holds
 * many classes at once.
 *
 *   slab          | slot 0 | slot 1 | ... | slot nslots-1 | unused tail |
 *   bitmap        [ word 0: slots 0..63 ][ word 1 ] ... [ word nwords-1 ]
 *
 * Invariants (kvp__slab_check):
 *   nslots = class_slab_bytes / slot_bytes; nfree = popcount(bitmap); bits >= nslots clear
 *   the bin's cur slab is not on the avail list; every other non-full slab is
 *   listed; a full slab is nowhere; at most one empty slab per class (cur),
 *   the others go back to the extents at once. The kept empty slabs are
 *   hysteresis only: when the extents run out of room, they are purged
 *   before any allocation answers ENOSPC.
 *
 * A slot's slab is found on free through the extents' address map (two
 * loads, no hashing): the extent of the slot's 4 KiB unit owns the slab.
 * Slabs sit at any 4 KiB unit (a slab as large as the 2 MiB cap would be
 * 2 MiB aligned, for transparent huge pages; the classes' slabs are at most
 * 256 KiB).
 *
 * In front of the bitmaps each bin keeps a stack of free slots (alloc.h,
 * kvp__bin): the allocator's fast path pops and pushes there and touches
 * no slab; the bitmaps are taken from half a cache at a time
 * (kvp__bin_refill) and given back half a cache at a time (kvp__bin_flush).
 * A cached slot is taken in its bitmap: nused and nfree count it as used,
 * the ledger does not (kvp__bins_check verifies each one).
 *
 * Bitmap take (kvp__slab_take with a current slab that has room): the bin's
 * cur slab is never NULL (an empty sentinel with nfree = 0 stands in), so
 * taking a slot is a load, a ctz on the hint word, a bit clear and two
 * stores. Finding a slab, or carving a new one, is the out-of-line slow path.
 */
#include "slab.h"

#include <string.h>

kvp__slab kvp__slab_empty; /* nfree = 0: never allocated from */

static size_t slab_desc_bytes(uint32_t nwords) { return sizeof(kvp__slab) + nwords * sizeof(uint64_t); }

static void avail_push(kvp__bin *b, kvp__slab *s) {
  s->prev = NULL;
  s->next = b->avail;
  if (b->avail) b->avail->prev = s;
  b->avail = s;
  s->listed = true;
}

static void avail_remove(kvp__bin *b, kvp__slab *s) {
  if (s->prev) s->prev->next = s->next;
  else b->avail = s->next;
  if (s->next) s->next->prev = s->prev;
  s->prev = s->next = NULL;
  s->listed = false;
}

static void slab_release(kvp__alloc *a, kvp__slab *s);

uint64_t kvp__slabs_purge_empty(kvp__alloc *a) {
  uint64_t nslabs = a->ledger.slabs.current, nlarge = kvp__large_flush(a);
  kvp__bins_flush_all(a); /* a slab whose taken slots are all cached goes as its last one comes back */
  for (uint32_t c = 0; c < a->nsmall; c++) {
    kvp__slab *s = a->bins[c].cur;
    if (s != &kvp__slab_empty && s->nfree == s->nslots) slab_release(a, s);
  }
  return nslabs - a->ledger.slabs.current + nlarge;
}

size_t kvp__slab_desc_bytes(const kvp__alloc *a, uint32_t sc) {
  uint32_t nslots = (uint32_t)(a->class_slab_bytes[sc] / kvp__sc_size(sc));
  return slab_desc_bytes((nslots + 63) / 64);
}

/* A slab of class sc, every slot free, in the extent e (just taken). */
static void slab_init(kvp__alloc *a, kvp__slab *s, kvp__extent *e, uint32_t sc) {
  uint32_t slot_bytes = (uint32_t)kvp__sc_size(sc);
  uint32_t nslots = (uint32_t)(e->bytes / slot_bytes), nwords = (nslots + 63) / 64;
  e->owner = s;
  s->ext = e;
  s->base = e->off;
  s->prev = s->next = NULL;
  s->listed = false;
  s->hint = 0;
  s->sc = sc;
  s->slot_bytes = slot_bytes;
  s->nslots = s->nfree = nslots;
  s->nwords = nwords;
  s->div_magic = (uint32_t)(((1ull << 32) + slot_bytes - 1) / slot_bytes);
  memset(s->bitmap, 0xff, nwords * sizeof(uint64_t));
  if (nslots % 64) s->bitmap[nwords - 1] = (1ull << (nslots % 64)) - 1;
  a->bins[sc].nslabs++;
  kvp__gauge_add(&a->ledger.committed, e->bytes);
  kvp__gauge_add(&a->ledger.slabs, 1);
}

/* The class's cache, made with its first slab and kept until destroy:
 * min(KVP__BIN_CACHE_MAX, slots of a slab) entries. ENOMEM. */
static int cache_new(kvp__alloc *a, uint32_t sc) {
  kvp__bin *b = &a->bins[sc];
  if (b->cache) return KVP_OK;
  uint64_t nslots = a->class_slab_bytes[sc] / kvp__sc_size(sc);
  uint32_t cap = nslots < KVP__BIN_CACHE_MAX ? (uint32_t)nslots : KVP__BIN_CACHE_MAX;
  if (!(b->cache = kvp__meta_calloc(a->meta, cap * sizeof *b->cache)))
    return kvp__err(KVP_ENOMEM, "free-slot cache of %u entries for class %u", cap, sc);
  b->cache_cap = cap;
  return KVP_OK;
}

static KVP__NOINLINE int slab_new(kvp__alloc *a, uint32_t sc, kvp__slab **out) {
  uint64_t bytes = a->class_slab_bytes[sc], align = bytes == KVP__SLAB_BYTES ? KVP__SLAB_BYTES : KVP__EXTENT_UNIT;
  kvp__bin *b = &a->bins[sc];
  bool fresh_cache = !b->cache;
  int rc = cache_new(a, sc);
  if (rc) return rc;
  kvp__slab *s = kvp__meta_calloc(a->meta, kvp__slab_desc_bytes(a, sc));
  if (!s) rc = kvp__err(KVP_ENOMEM, "slab descriptor for class %u", sc);
  kvp__extent *e = NULL;
  if (!rc) rc = kvp__extent_alloc(&a->ext, bytes, align, KVP__EXT_SLAB, &e);
  if (rc == KVP_ENOSPC && kvp__slabs_purge_empty(a)) rc = kvp__extent_alloc(&a->ext, bytes, align, KVP__EXT_SLAB, &e);
  if (rc) { /* nothing made stays, the cache included (the metadata figure too is as it was) */
    kvp__meta_free(a->meta, s, kvp__slab_desc_bytes(a, sc));
    if (fresh_cache) {
      kvp__meta_free(a->meta, b->cache, b->cache_cap * sizeof *b->cache);
      b->cache = NULL;
      b->cache_cap = 0;
    }
    return rc;
  }
  slab_init(a, s, e, sc);
  *out = s;
  return KVP_OK;
}

void kvp__slab_restore(kvp__alloc *a, uint64_t off, uint32_t sc, uint64_t slab_off, kvp__slab **desc,
                       kvp__extent **spare) {
  kvp__bin *b = &a->bins[sc];
  kvp__extent *e = kvp__extent_at(&a->ext, off);
  kvp__slab *s;
  bool fresh = !e;
  if (fresh) { /* released since: made again where it was, from the descriptors taken ahead */
    kvp__assert(*desc != NULL);
    s = *desc;
    *desc = NULL;
    slab_init(a, s, kvp__extent_take_at(&a->ext, slab_off, a->class_slab_bytes[sc], KVP__EXT_SLAB, spare), sc);
  } else {
    s = e->owner;
    kvp__assert(e->state == KVP__EXT_SLAB && s->sc == sc && s->base == slab_off);
  }
  uint64_t slot = (off - s->base) / s->slot_bytes, mask = 1ull << (slot % 64);
  kvp__assert((off - s->base) % s->slot_bytes == 0 && slot < s->nslots && (s->bitmap[slot / 64] & mask));
  s->bitmap[slot / 64] &= ~mask;
  s->nfree--;
  b->nused++;
  if (fresh) {
    if (s->nfree) avail_push(b, s); /* partly used: on the non-full list */
  } else if (!s->nfree) { /* now full: on no list */
    if (s->listed) avail_remove(b, s);
    if (b->cur == s) b->cur = &kvp__slab_empty;
  }
}

static void slab_release(kvp__alloc *a, kvp__slab *s) {
  kvp__bin *b = &a->bins[s->sc];
  if (s->listed) avail_remove(b, s);
  if (b->cur == s) b->cur = &kvp__slab_empty;
  b->nslabs--;
  uint64_t bytes = s->ext->bytes;
  kvp__extent_free(&a->ext, s->ext);
  kvp__gauge_sub(&a->ledger.committed, bytes);
  kvp__gauge_sub(&a->ledger.slabs, 1);
  kvp__meta_free(a->meta, s, slab_desc_bytes(s->nwords));
}

/* Slow path: make bin->cur a slab with room. */
static KVP__NOINLINE int refill(kvp__alloc *a, kvp__bin *b, uint32_t sc) {
  kvp__slab *s = b->avail;
  if (s) avail_remove(b, s);
  else {
    int rc = slab_new(a, sc, &s);
    if (rc) return rc;
  }
  b->cur = s;
  return KVP_OK;
}

int kvp__slab_take(kvp__alloc *a, uint32_t sc, uint64_t *off) {
  kvp__bin *b = &a->bins[sc];
  kvp__slab *s = b->cur;
  if (KVP__UNLIKELY(!s->nfree)) {
    int rc = refill(a, b, sc);
    if (rc) return rc;
    s = b->cur;
  }
  uint32_t w = s->hint;
  while (!s->bitmap[w]) w = w + 1 == s->nwords ? 0 : w + 1;
  uint32_t bit = (uint32_t)__builtin_ctzll(s->bitmap[w]);
  s->bitmap[w] &= s->bitmap[w] - 1;
  s->hint = w;
  if (!--s->nfree) b->cur = &kvp__slab_empty; /* full: on no list */
  b->nused++;
  *off = s->base + (uint64_t)(w * 64 + bit) * s->slot_bytes;
  return KVP_OK;
}

/* The slab of class sc holding a taken slot (bit clear) at off, and the
 * slot's index; NULL with a message (EINVAL) if there is none. */
static kvp__slab *slot_of(kvp__alloc *a, uint64_t off, uint32_t sc, uint64_t *slot_out) {
  const kvp__extent *e = kvp__extent_at(&a->ext, off);
  kvp__slab *s = e && e->state == KVP__EXT_SLAB ? e->owner : NULL;
  if (!s) {
    kvp__err(KVP_EINVAL, "page at offset %llu: not inside a slab (foreign or already freed)", (unsigned long long)off);
    return NULL;
  }
  /* rel < 2 MiB: (rel x ceil(2^32 / size)) >> 32 is rel / size when size divides rel (jemalloc's div_info);
   * when it does not, slot x size != rel, so the check below still refuses it */
  uint64_t rel = off - s->base, slot = (rel * s->div_magic) >> 32;
  if (s->sc != sc || slot * s->slot_bytes != rel || slot >= s->nslots) {
    kvp__err(KVP_EINVAL, "page at offset %llu (class %u): not a slot of the slab of class %u there",
             (unsigned long long)off, sc, s->sc);
    return NULL;
  }
  if (s->bitmap[slot / 64] & (1ull << (slot % 64))) {
    kvp__err(KVP_EINVAL, "page at offset %llu: double free (slot %llu is already free)", (unsigned long long)off,
             (unsigned long long)slot);
    return NULL;
  }
  *slot_out = slot;
  return s;
}

/* Is off in the cache of b? (Its slots are taken in the bitmaps like a live
 * page's: only the cache tells them apart.) No early exit: at most
 * KVP__BIN_CACHE_MAX compares. */
static bool cached(const kvp__bin *b, uint64_t off) {
  bool hit = false;
  for (uint32_t i = 0; i < b->ncached; i++) hit |= b->cache[i] == off;
  return hit;
}

int kvp__slab_check_live(kvp__alloc *a, uint64_t off, uint32_t sc) {
  uint64_t slot;
  if (!slot_of(a, off, sc, &slot)) return KVP_EINVAL;
  if (cached(&a->bins[sc], off))
    return kvp__err(KVP_EINVAL, "page at offset %llu: double free (slot %llu is already free, in its class's cache)",
                    (unsigned long long)off, (unsigned long long)slot);
  return KVP_OK;
}

int kvp__slab_put(kvp__alloc *a, uint64_t off, uint32_t sc) {
  uint64_t slot;
  kvp__slab *s = slot_of(a, off, sc, &slot);
  if (!s) return KVP_EINVAL;
  uint64_t mask = 1ull << (slot % 64);
  kvp__bin *b = &a->bins[sc];
  s->bitmap[slot / 64] |= mask;
  if ((uint32_t)(slot / 64) < s->hint) s->hint = (uint32_t)(slot / 64);
  b->nused--;
  if (s->nfree++ == 0 && b->cur != s) avail_push(b, s);
  if (s->nfree == s->nslots && b->cur != s) slab_release(a, s);
  return KVP_OK;
}

/* ---- the bins' caches --------------------------------------------------- */

int kvp__bin_refill(kvp__alloc *a, uint32_t sc, uint64_t *off) {
  kvp__bin *b = &a->bins[sc];
  kvp__assert(!b->ncached);
  int rc = kvp__slab_take(a, sc, off); /* the slot handed out: may make a slab, as without a cache */
  if (rc) return rc;
  uint32_t n = b->cache_cap / 2;
  uint64_t more[KVP__BIN_CACHE_MAX / 2];
  uint32_t k = 0;
  while (k + 1 < n && b->cur->nfree) kvp__slab_take(a, sc, &more[k++]); /* from the current slab: cannot fail */
  for (uint32_t i = 0; i < k; i++) b->cache[i] = more[k - 1 - i]; /* the lowest offset on top */
  b->ncached = k;
  return KVP_OK;
}

void kvp__bin_flush(kvp__alloc *a, uint32_t sc, uint32_t n) {
  kvp__bin *b = &a->bins[sc];
  if (n > b->ncached) n = b->ncached;
  for (uint32_t i = 0; i < n; i++) {
    int rc = kvp__slab_put(a, b->cache[i], sc);
    kvp__assert(rc == KVP_OK);
    (void)rc;
  }
  memmove(b->cache, b->cache + n, (b->ncached - n) * sizeof *b->cache);
  b->ncached -= n;
}

void kvp__bin_push_slow(kvp__alloc *a, uint32_t sc, uint64_t off) {
  kvp__bin *b = &a->bins[sc];
  if (!b->cache_cap) { /* no cache: straight to the bitmap */
    int rc = kvp__slab_put(a, off, sc);
    kvp__assert(rc == KVP_OK);
    (void)rc;
    return;
  }
  kvp__bin_flush(a, sc, b->cache_cap - b->cache_cap / 2); /* the older half */
  b->cache[b->ncached++] = off;
}

void kvp__bins_flush_all(kvp__alloc *a) {
  for (uint32_t c = 0; c < a->nsmall; c++)
    if (a->bins[c].ncached) kvp__bin_flush(a, c, a->bins[c].ncached);
}

int kvp__bins_check(const kvp__alloc *a, uint64_t *ncached_out) {
  uint64_t total = 0;
  for (uint32_t c = 0; c < KVP__SC_SMALL_COUNT; c++) {
    const kvp__bin *b = &a->bins[c];
    if (b->ncached > b->cache_cap || (b->cache_cap && !b->cache))
      return kvp__err(KVP_ECORRUPT, "class %u: cache holds %u slots in room for %u", c, b->ncached, b->cache_cap);
    for (uint32_t i = 0; i < b->ncached; i++) {
      uint64_t off = b->cache[i];
      const kvp__extent *e = kvp__extent_at(&a->ext, off);
      const kvp__slab *s = e && e->state == KVP__EXT_SLAB ? e->owner : NULL;
      uint64_t rel = s ? off - s->base : 0, slot = s ? rel / s->slot_bytes : 0;
      if (!s || s->sc != c || rel % s->slot_bytes || slot >= s->nslots)
        return kvp__err(KVP_ECORRUPT, "class %u: cached slot at offset %llu is no slot of a slab of its class", c,
                        (unsigned long long)off);
      if (s->bitmap[slot / 64] & (1ull << (slot % 64)))
        return kvp__err(KVP_ECORRUPT, "class %u: cached slot at offset %llu is free in its slab's bitmap", c,
                        (unsigned long long)off);
      for (uint32_t j = 0; j < i; j++)
        if (b->cache[j] == off)
          return kvp__err(KVP_ECORRUPT, "class %u: slot at offset %llu is cached twice", c, (unsigned long long)off);
    }
    total += b->ncached;
  }
  *ncached_out = total;
  return KVP_OK;
}

/* ---- checks --------------------------------------------------------------- */

int kvp__slab_check(const kvp__alloc *a, const kvp__slab *s, uint64_t *nused) {
  uint64_t nfree = 0;
  for (uint32_t w = 0; w < s->nwords; w++) nfree += (uint64_t)__builtin_popcountll(s->bitmap[w]);
  if (s->nslots % 64 && (s->bitmap[s->nwords - 1] >> (s->nslots % 64)))
    return kvp__err(KVP_ECORRUPT, "slab at offset %llu: free bits set past slot %u", (unsigned long long)s->base,
                    s->nslots);
  if (nfree != s->nfree || s->nslots != a->class_slab_bytes[s->sc] / s->slot_bytes ||
      s->slot_bytes != kvp__sc_size(s->sc))
    return kvp__err(KVP_ECORRUPT, "slab at offset %llu (class %u): bitmap has %llu free slots, counter %u",
                    (unsigned long long)s->base, s->sc, (unsigned long long)nfree, s->nfree);
  const kvp__bin *b = &a->bins[s->sc];
  bool is_cur = b->cur == s;
  if (is_cur ? s->listed : (s->listed != (s->nfree > 0)))
    return kvp__err(KVP_ECORRUPT, "slab at offset %llu: listed=%d with %u free slots (cur=%d)",
                    (unsigned long long)s->base, s->listed, s->nfree, is_cur);
  if (!is_cur && s->nfree == s->nslots)
    return kvp__err(KVP_ECORRUPT, "slab at offset %llu: empty but kept", (unsigned long long)s->base);
  *nused += s->nslots - s->nfree;
  return KVP_OK;
}

void kvp__slabs_fini(kvp__alloc *a) {
  for (uint32_t c = 0; c < KVP__SC_SMALL_COUNT; c++) {
    kvp__bin *b = &a->bins[c];
    kvp__meta_free(a->meta, b->cache, b->cache_cap * sizeof *b->cache); /* its slots go with their slabs */
    b->cache = NULL;
    b->ncached = b->cache_cap = 0;
  }
  for (kvp__extent *e = a->ext.first; e; e = e->anext)
    if (e->state == KVP__EXT_SLAB) {
      kvp__slab *s = e->owner;
      kvp__meta_free(a->meta, s, slab_desc_bytes(s->nwords));
      e->owner = NULL;
    }
}
