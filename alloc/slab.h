/*
 * alloc/slab.h - slab operations shared by alloc/slab.c and alloc/alloc.c.
 */
#ifndef KVP_SLAB_H
#define KVP_SLAB_H

#include "alloc.h"

/* Take a free slot of class sc: its region offset in *off. KVP_ENOSPC (no
 * room for a new slab, no message), KVP_ENOMEM. Updates the ledger's
 * committed bytes and slab count when a slab is created. */
int kvp__slab_take(kvp__alloc *a, uint32_t sc, uint64_t *off);
/* Return the slot at off of class sc. KVP_EINVAL (message set) if it is not
 * a live slot of that class; nothing changes then. */
int kvp__slab_put(kvp__alloc *a, uint64_t off, uint32_t sc);
/* Is off a live slot of class sc (in a slab of that class, taken in its
 * bitmap, not in the class's cache)? KVP_OK, or KVP_EINVAL with a message
 * naming what it is instead (foreign, wrong class, double free). */
int kvp__slab_check_live(kvp__alloc *a, uint64_t off, uint32_t sc);
/* The cache of class sc is empty: take a slot for an allocation into *off
 * (kvp__slab_take: may make a slab; its errors) and fill the cache with up
 * to cache_cap / 2 - 1 more from the current slab. */
int kvp__bin_refill(kvp__alloc *a, uint32_t sc, uint64_t *off);
/* Put a freed slot (taken, not cached) of class sc on its cache: the cache
 * is full (its older half goes back to the bitmaps first) or there is none
 * (straight to the bitmap). Cannot fail. */
void kvp__bin_push_slow(kvp__alloc *a, uint32_t sc, uint64_t off);
/* Return the n oldest cached slots of class sc (all, if fewer) to their
 * slabs (a slab left empty goes, as at any free). */
void kvp__bin_flush(kvp__alloc *a, uint32_t sc, uint32_t n);
/* Every cache back to the bitmaps. */
void kvp__bins_flush_all(kvp__alloc *a);
/* Every cached large extent back to the extents; returns how many. */
uint64_t kvp__large_flush(kvp__alloc *a);
/* Verify the caches (each slot in a slab of its class, taken in its bitmap,
 * once); *ncached: cached slots of all classes. KVP_ECORRUPT. */
int kvp__bins_check(const kvp__alloc *a, uint64_t *ncached);
/* Verify one slab's bitmap and counters; adds its used slots to *nused. */
int kvp__slab_check(const kvp__alloc *a, const kvp__slab *s, uint64_t *nused);
/* Flush the large cache and every bin's cache to the bitmaps, then
 * return every empty slab kept as a class's current slab to the extents;
 * returns how many slabs and large extents went (those the flush emptied
 * too). Called before an allocation would answer ENOSPC, and before a
 * transaction's undo takes pages back at their offsets. */
uint64_t kvp__slabs_purge_empty(kvp__alloc *a);
/* Bytes of the descriptor of a slab of class sc. */
size_t kvp__slab_desc_bytes(const kvp__alloc *a, uint32_t sc);
/* Take the slot at off of class sc again (an undone free, alloc/txn.c):
 * from the slab at slab_off, made again there from the descriptors taken
 * ahead (desc: one of its class, consumed and set to NULL if used; spare:
 * the extent chain) when it was released. The slot is free. Updates the
 * ledger's committed bytes and slab count, not its page figures. */
void kvp__slab_restore(kvp__alloc *a, uint64_t off, uint32_t sc, uint64_t slab_off, kvp__slab **desc,
                       kvp__extent **spare);
/* Does [off, off + bytes) overlap a page freed in the open transaction? */
bool kvp__alloc_tx_overlaps(const kvp__alloc_tx *tx, uint64_t off, uint64_t bytes);
/* Return the bytes of a page (size: its allocated bytes) to its slab or
 * the extents, counting nothing but committed bytes; EINVAL if they are
 * not a live page's. */
int kvp__alloc_put(kvp__alloc *a, uint64_t off, uint64_t size);
/* Count a live page in (+1) or out (-1) of the ledger and the stats. */
void kvp__alloc_count(kvp__alloc *a, const kvp__page *p, int sign);
/* Release every slab's descriptor (at pool destroy). */
void kvp__slabs_fini(kvp__alloc *a);

#endif /* KVP_SLAB_H */
