/*
 * alloc/txn.c - allocator transactions: pages freed on trial, so that a
 * caller can free pages to make room, take new ones, and, when those cannot
 * all be had (or what it does next fails), put back exactly what was freed
 * (pages/evict.c: an append whose policy's evictions had to make room).
 *
 * Two depths of free. First the ledger only: the pages stop counting
 * (allocated, requested, pages, per tag), so the budget has their room, but
 * their bytes stay taken, so nothing taken meanwhile lies over them and an
 * undo only counts them again. When the region is what is short, their
 * bytes go back too (kvp__alloc_tx_free_space), and an undo must take each
 * one again at its own offset. It always can: the caller gives back every
 * page it took during the transaction before the rollback, and the
 * rollback first returns the empty slabs kept as current ones; then the
 * only used extents are slabs holding live pages and live large pages, all
 * live before the transaction and so disjoint from every freed page. A
 * freed slot goes back into its slab, still there or made again at the
 * same offset (a slab's size is its class's); a freed large page becomes
 * an extent again at its offset. What that may need is taken ahead
 * (kvp__alloc_tx_reserve): two extent descriptors per page (the free extent
 * that holds it splits in three at most) and a slab descriptor of its class
 * per small page; the address map's chunks are not returned while the
 * transaction is open, so the ranges stay mapped.
 *
 * Invariants: while open, a->tx = tx and a->ext.keep_chunks; the ledger's
 * allocated = its slots and large extents less the freed pages whose bytes
 * are still held (kvp__alloc_check holds again at either end). After
 * either end no descriptor is left taken ahead and no empty chunk is kept.
 * Figures: an undone free leaves every ledger figure and counter as it was,
 * but committed may be lower (empty slabs returned on the way); a committed
 * one counts in frees.
 *
 * Cost: a rollback after the bytes went walks the extents in address order
 * once per page it makes an extent for again (a failed append's slow path).
 */
#include "slab.h"

#include <string.h>

/* Room for one more entry in an array of cap entries of elem bytes. */
static int grow(kvp__alloc *a, void **arr, uint32_t n, uint32_t *cap, size_t elem) {
  if (n < *cap) return KVP_OK;
  uint32_t ncap = *cap ? 2 * *cap : 16;
  void *na = kvp__meta_realloc(a->meta, *arr, *cap * elem, ncap * elem);
  if (!na) return kvp__err(KVP_ENOMEM, "allocator transaction: room for %u entries", ncap);
  *arr = na;
  *cap = ncap;
  return KVP_OK;
}

int kvp__alloc_tx_reserve(kvp__alloc *a, kvp__alloc_tx *tx, const kvp__page *p) {
  kvp__assert(!tx->open);
  void *arr = tx->freed;
  int rc = grow(a, &arr, tx->nreserved, &tx->cap, sizeof *tx->freed);
  tx->freed = arr;
  if (rc) return rc;
  for (int i = 0; i < 2; i++) {
    kvp__extent *d = kvp__meta_calloc(a->meta, sizeof *d);
    if (!d) return kvp__err(KVP_ENOMEM, "allocator transaction: extent descriptor");
    d->anext = tx->spare_ext;
    tx->spare_ext = d;
  }
  if (kvp__page_is_small(a, p)) {
    uint32_t sc = kvp__page_class(p);
    arr = tx->spare_slab;
    rc = grow(a, &arr, tx->nspare_slab, &tx->spare_slab_cap, sizeof *tx->spare_slab);
    tx->spare_slab = arr;
    if (rc) return rc;
    kvp__slab *s = kvp__meta_calloc(a->meta, kvp__slab_desc_bytes(a, sc));
    if (!s) return kvp__err(KVP_ENOMEM, "allocator transaction: slab descriptor for class %u", sc);
    s->sc = sc; /* sizes the descriptor until it is used */
    tx->spare_slab[tx->nspare_slab++] = s;
  }
  tx->nreserved++;
  return KVP_OK;
}

void kvp__alloc_tx_begin(kvp__alloc *a, kvp__alloc_tx *tx) {
  kvp__assert(!a->tx && !tx->open);
  tx->open = true;
  tx->space_freed = false;
  tx->reused = false;
  a->tx = tx;
  a->ext.keep_chunks = true;
}

void kvp__alloc_tx_free(kvp__alloc *a, kvp__alloc_tx *tx, const kvp__page *p) {
  kvp__assert(tx->open && a->tx == tx && !tx->space_freed && tx->n < tx->nreserved);
  kvp__alloc_freed *f = &tx->freed[tx->n++];
  f->page = *p;
  f->slab_off = 0;
  if (kvp__page_is_small(a, p)) {
    const kvp__extent *e = kvp__extent_at(&a->ext, p->off);
    kvp__assert(e && e->state == KVP__EXT_SLAB);
    f->slab_off = ((const kvp__slab *)e->owner)->base;
  }
  kvp__ledger_begin(&a->ledger);
  kvp__alloc_count(a, p, -1);
  kvp__ledger_end(&a->ledger);
}

/* The bytes of every freed page back to the slabs and extents, once
 * copies already enqueued on device streams (a reader's) are done with
 * them (a failure there is the region's to report; the bytes go anyway, as
 * at a reclaim). */
static void put_all(kvp__alloc *a, kvp__alloc_tx *tx) {
  if (tx->n) a->region.ops->quiesce(&a->region);
  kvp__ledger_begin(&a->ledger);
  for (uint32_t i = 0; i < tx->n; i++) {
    int rc = kvp__alloc_put(a, tx->freed[i].page.off, kvp__page_alloc_bytes(&tx->freed[i].page));
    kvp__assert(rc == KVP_OK);
    (void)rc;
  }
  kvp__ledger_end(&a->ledger);
}

void kvp__alloc_tx_free_space(kvp__alloc *a, kvp__alloc_tx *tx) {
  kvp__assert(tx->open && a->tx == tx);
  if (tx->space_freed) return;
  put_all(a, tx);
  tx->space_freed = true;
}

/* Does [off, off + bytes) overlap a page freed in the transaction? */
bool kvp__alloc_tx_overlaps(const kvp__alloc_tx *tx, uint64_t off, uint64_t bytes) {
  for (uint32_t i = 0; i < tx->n; i++) {
    const kvp__page *p = &tx->freed[i].page;
    if (p->off < off + bytes && off < p->off + kvp__page_alloc_bytes(p)) return true;
  }
  return false;
}

/* A slab descriptor of class sc taken ahead (there is one per small page). */
static kvp__slab **spare_slab_of(kvp__alloc_tx *tx, uint32_t sc) {
  for (uint32_t i = 0; i < tx->nspare_slab; i++)
    if (tx->spare_slab[i] && tx->spare_slab[i]->sc == sc) return &tx->spare_slab[i];
  kvp__assert(!"a slab descriptor per small page is taken ahead");
  return NULL;
}

/* Take a freed page's bytes again at its offset. */
static void take_back(kvp__alloc *a, kvp__alloc_tx *tx, const kvp__alloc_freed *f) {
  const kvp__page *p = &f->page;
  uint64_t size = kvp__page_alloc_bytes(p);
  if (kvp__page_is_small(a, p)) {
    kvp__slab **desc = spare_slab_of(tx, kvp__page_class(p));
    kvp__slab_restore(a, p->off, kvp__page_class(p), f->slab_off, desc, &tx->spare_ext);
  } else {
    kvp__extent_take_at(&a->ext, p->off, size, KVP__EXT_LARGE, &tx->spare_ext);
    kvp__gauge_add(&a->ledger.committed, size);
    kvp__gauge_add(&a->ledger.extents, 1);
  }
}

void kvp__alloc_tx_release(kvp__alloc *a, kvp__alloc_tx *tx) {
  for (kvp__extent *d = tx->spare_ext, *n; d; d = n) {
    n = d->anext;
    kvp__meta_free(a->meta, d, sizeof *d);
  }
  for (uint32_t i = 0; i < tx->nspare_slab; i++)
    if (tx->spare_slab[i]) kvp__meta_free(a->meta, tx->spare_slab[i], kvp__slab_desc_bytes(a, tx->spare_slab[i]->sc));
  kvp__meta_free(a->meta, tx->freed, tx->cap * sizeof *tx->freed);
  kvp__meta_free(a->meta, tx->spare_slab, tx->spare_slab_cap * sizeof *tx->spare_slab);
  memset(tx, 0, sizeof *tx);
}

static void end(kvp__alloc *a, kvp__alloc_tx *tx) {
  kvp__assert(tx->open && a->tx == tx);
  a->tx = NULL;
  a->ext.keep_chunks = false;
  kvp__extents_trim(&a->ext);
  kvp__alloc_tx_release(a, tx);
}

void kvp__alloc_tx_rollback(kvp__alloc *a, kvp__alloc_tx *tx) {
  kvp__assert(tx->open && a->tx == tx);
  kvp__ledger_begin(&a->ledger);
  if (tx->space_freed) {
    kvp__slabs_purge_empty(a); /* the caches flushed (a page taken and given back meanwhile may sit there, over a
                                  freed one), then the slabs the transaction's own pages emptied */
    for (uint32_t i = tx->n; i--;) take_back(a, tx, &tx->freed[i]);
  }
  for (uint32_t i = 0; i < tx->n; i++) kvp__alloc_count(a, &tx->freed[i].page, +1);
  kvp__ledger_end(&a->ledger);
  end(a, tx);
}

void kvp__alloc_tx_commit(kvp__alloc *a, kvp__alloc_tx *tx) {
  kvp__assert(tx->open && a->tx == tx);
  if (!tx->space_freed) put_all(a, tx);
  kvp__ledger_begin(&a->ledger);
  kvp__count_add(&a->ledger.frees, tx->n);
  kvp__ledger_end(&a->ledger);
  end(a, tx);
}
