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
/* Verify one slab's bitmap and counters; adds its used slots to *nused. */
int kvp__slab_check(const kvp__alloc *a, const kvp__slab *s, uint64_t *nused);
/* Return every empty slab kept as a class's current slab to the extents;
 * returns how many. Called before an allocation would answer ENOSPC. */
uint64_t kvp__slabs_purge_empty(kvp__alloc *a);
/* Release every slab's descriptor (at pool destroy). */
void kvp__slabs_fini(kvp__alloc *a);

#endif /* KVP_SLAB_H */
