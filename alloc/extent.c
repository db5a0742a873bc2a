/*
 * alloc/extent.c - extents: the region tiled in 4 KiB units.
 *
 * Every byte of the region belongs to exactly one extent; extents are kept in
 * address order (aprev/anext) and each is FREE, SLAB or LARGE. Descriptors
 * live on the host (out of band), never in the region.
 *
 *   first -> [0, a) SLAB -> [a, b) FREE -> [b, c) LARGE -> ... -> [.., bytes)
 *
 * Invariants (kvp__extents_check):
 *   off(first) = 0; off(next) = off + bytes; sum of bytes = x->bytes
 *   no two address-adjacent extents are both FREE (free coalesces)
 *   a FREE extent is in bins[kvp__ext_bin(bytes)], and that bin's bit is set
 *   rmap[u] = e for every unit u of a SLAB extent e and for the first unit of
 *   a LARGE one; NULL for every other unit (free, or inside a large page)
 *   a chunk of the address map exists iff one of its units is used (every
 *   chunk, when the map is whole: a prefaulted region), and its
 *   rmap_nused[c] = its non-NULL entries (so metadata follows use, not region size)
 *   used_bytes = sum of bytes of used extents
 *
 * Allocation is best fit over segregated bins: the smallest free extent
 * that holds the request (lowest address among equal sizes; an exact fit ends
 * the scan). Large pages are sized to the 4 KiB unit, so what a fit leaves
 * is as little as the free space allows. See find_fit for the cost.
 */
#include "alloc.h"

#include <string.h>

static void bit_set(uint64_t *w, uint32_t i) { w[i / 64] |= 1ull << (i % 64); }
static void bit_clear(uint64_t *w, uint32_t i) { w[i / 64] &= ~(1ull << (i % 64)); }

static void bin_insert(kvp__extents *x, kvp__extent *e) {
  uint32_t b = kvp__ext_bin(e->bytes);
  e->state = KVP__EXT_FREE;
  e->bin = b;
  e->fprev = NULL;
  e->fnext = x->bins[b];
  if (e->fnext) e->fnext->fprev = e;
  x->bins[b] = e;
  bit_set(x->nonempty, b);
}

static void bin_remove(kvp__extents *x, kvp__extent *e) {
  if (e->fprev) e->fprev->fnext = e->fnext;
  else x->bins[e->bin] = e->fnext;
  if (e->fnext) e->fnext->fprev = e->fprev;
  if (!x->bins[e->bin]) bit_clear(x->nonempty, e->bin);
  e->fprev = e->fnext = NULL;
}

static void link_after(kvp__extent *at, kvp__extent *e) {
  e->aprev = at;
  e->anext = at->anext;
  if (at->anext) at->anext->aprev = e;
  at->anext = e;
}

static void unlink_addr(kvp__extents *x, kvp__extent *e) {
  if (e->aprev) e->aprev->anext = e->anext;
  else x->first = e->anext;
  if (e->anext) e->anext->aprev = e->aprev;
}

/* Chunks of the address map covering the units of [off, off + bytes). */
static uint64_t chunk_lo(uint64_t off) { return (off >> KVP__EXTENT_UNIT_SHIFT) >> KVP__RMAP_CHUNK_SHIFT; }
static uint64_t chunk_hi(uint64_t off, uint64_t bytes) {
  return (((off + bytes) >> KVP__EXTENT_UNIT_SHIFT) + KVP__RMAP_CHUNK_UNITS - 1) >> KVP__RMAP_CHUNK_SHIFT;
}

/* Free the chunks of the range that no longer map any unit (not while a
 * transaction may need them again: kvp__extents_trim at its end). */
static void rmap_trim(kvp__extents *x, uint64_t off, uint64_t bytes) {
  if (x->keep_chunks || x->whole) return;
  for (uint64_t c = chunk_lo(off); c < chunk_hi(off, bytes); c++)
    if (x->rmap[c] && !x->rmap_nused[c]) {
      kvp__meta_free(x->meta, x->rmap[c], sizeof *x->rmap[c]);
      x->rmap[c] = NULL;
    }
}

/* Make the chunks of the range exist (before a mutation: all or nothing). */
static int rmap_ensure(kvp__extents *x, uint64_t off, uint64_t bytes) {
  for (uint64_t c = chunk_lo(off); c < chunk_hi(off, bytes); c++)
    if (!x->rmap[c] && !(x->rmap[c] = kvp__meta_calloc(x->meta, sizeof *x->rmap[c]))) {
      rmap_trim(x, off, bytes);
      return kvp__err(KVP_ENOMEM, "address map for region offsets %llu..%llu", (unsigned long long)off,
                      (unsigned long long)(off + bytes));
    }
  return KVP_OK;
}

/* Map every unit of the range to v (chunks ensured when v != NULL). */
/* The high-water mark of used bytes: readers (device-level usage) scan no
 * further. Single writer: a relaxed load and store. */
static void hwm_raise(kvp__extents *x, uint64_t end) {
  if (end > atomic_load_explicit(&x->hwm_bytes, memory_order_relaxed))
    atomic_store_explicit(&x->hwm_bytes, end, memory_order_relaxed);
}

static void rmap_set(kvp__extents *x, uint64_t off, uint64_t bytes, kvp__extent *v) {
  for (uint64_t u = off >> KVP__EXTENT_UNIT_SHIFT, n = bytes >> KVP__EXTENT_UNIT_SHIFT; n; n--, u++) {
    uint64_t ci = u >> KVP__RMAP_CHUNK_SHIFT;
    kvp__extent **slot = &x->rmap[ci]->unit[u & (KVP__RMAP_CHUNK_UNITS - 1)];
    x->rmap_nused[ci] += (uint32_t)(v != NULL) - (uint32_t)(*slot != NULL);
    *slot = v;
  }
  if (!v) rmap_trim(x, off, bytes);
}

int kvp__extents_init(kvp__extents *x, uint64_t bytes, kvp__meta *meta) {
  memset(x, 0, sizeof *x);
  x->meta = meta;
  x->bytes = bytes;
  x->nunits = bytes >> KVP__EXTENT_UNIT_SHIFT;
  x->nchunks = (x->nunits + KVP__RMAP_CHUNK_UNITS - 1) >> KVP__RMAP_CHUNK_SHIFT;
  x->rmap = kvp__meta_calloc(meta, x->nchunks * sizeof *x->rmap);
  x->rmap_nused = kvp__meta_calloc(meta, x->nchunks * sizeof *x->rmap_nused);
  kvp__extent *e = kvp__meta_calloc(meta, sizeof *e);
  if (!x->rmap || !x->rmap_nused || !e) {
    kvp__meta_free(meta, x->rmap, x->nchunks * sizeof *x->rmap);
    kvp__meta_free(meta, x->rmap_nused, x->nchunks * sizeof *x->rmap_nused);
    kvp__meta_free(meta, e, sizeof *e);
    return kvp__err(KVP_ENOMEM, "extent map for %llu bytes", (unsigned long long)bytes);
  }
  e->bytes = bytes;
  x->first = e;
  x->nextents = 1;
  bin_insert(x, e);
  return KVP_OK;
}

int kvp__extents_map_whole(kvp__extents *x) {
  int rc = rmap_ensure(x, 0, x->bytes);
  if (rc) return rc;
  for (uint64_t c = 0; c < x->nchunks; c++) memset(x->rmap[c], 0, sizeof *x->rmap[c]); /* NULL entries: faulted in */
  x->whole = true;
  return KVP_OK;
}

void kvp__extents_fini(kvp__extents *x) {
  for (kvp__extent *e = x->first, *n; e; e = n) {
    n = e->anext;
    kvp__meta_free(x->meta, e, sizeof *e);
  }
  for (uint64_t c = 0; x->rmap && c < x->nchunks; c++) kvp__meta_free(x->meta, x->rmap[c], sizeof *x->rmap[c]);
  kvp__meta_free(x->meta, x->rmap, x->nchunks * sizeof *x->rmap);
  kvp__meta_free(x->meta, x->rmap_nused, x->nchunks * sizeof *x->rmap_nused);
  memset(x, 0, sizeof *x);
}

/* Bytes from a used extent's start that the address map covers. */
static uint64_t mapped_bytes(kvp__ext_state state, uint64_t bytes) {
  return state == KVP__EXT_SLAB ? bytes : KVP__EXTENT_UNIT;
}

static bool fits(const kvp__extent *e, uint64_t bytes, uint64_t align, uint64_t *at) {
  uint64_t a = kvp__align_up(e->off, align);
  if (a + bytes > e->off + e->bytes) return false;
  *at = a;
  return true;
}

/* The best fit in one bin's list: the smallest extent that holds bytes at
 * alignment, the lowest address among equal sizes. The lists are not sorted,
 * so the scan is whole unless an exact fit turns up: it is taken at once
 * (nothing smaller exists; among exact fits, the most recently freed). */
static kvp__extent *best_in(kvp__extent *list, uint64_t bytes, uint64_t align, uint64_t *at) {
  kvp__extent *best = NULL;
  uint64_t best_at = 0, a = 0;
  for (kvp__extent *e = list; e; e = e->fnext) {
    if (!fits(e, bytes, align, &a)) continue;
    if (!best || e->bytes < best->bytes || (e->bytes == best->bytes && e->off < best->off)) {
      best = e;
      best_at = a;
      if (e->bytes == bytes) break; /* exact: nothing smaller exists; the first exact one is taken */
    }
  }
  if (best) *at = best_at;
  return best;
}

/* Best fit over the segregated bins: the bin of kvp__ext_bin(n) may hold
 * extents large enough, every higher non-empty bin (found through a bitmap)
 * holds only large-enough ones (modulo alignment): the first bin with a fit
 * has the smallest one, since bins do not overlap in size. Cost: O(1) bitmap
 * scans plus the lists of the bins inspected (one, almost always). */
static kvp__extent *find_fit(const kvp__extents *x, uint64_t bytes, uint64_t align, uint64_t *at) {
  uint32_t b = kvp__ext_bin(bytes);
  kvp__extent *e = best_in(x->bins[b], bytes, align, at);
  if (e) return e;
  for (uint32_t w = (b + 1) / 64; w < KVP__ARRAY_LEN(x->nonempty); w++) {
    uint64_t bits = x->nonempty[w];
    if (w == (b + 1) / 64) bits &= ~0ull << ((b + 1) % 64);
    while (bits) {
      uint32_t i = w * 64 + (uint32_t)__builtin_ctzll(bits);
      bits &= bits - 1;
      if ((e = best_in(x->bins[i], bytes, align, at))) return e;
    }
  }
  return NULL;
}

/* Make [at, at + bytes) of the free extent e a used one; lead and tail are
 * the descriptors of what is left before and after (NULL where nothing is).
 * The address map's chunks over the range exist. Returns the used extent. */
static kvp__extent *carve(kvp__extents *x, kvp__extent *e, uint64_t at, uint64_t bytes, kvp__ext_state state,
                          kvp__extent *lead, kvp__extent *tail) {
  bin_remove(x, e);
  if (lead) {
    lead->off = e->off;
    lead->bytes = at - e->off;
    if (e->aprev) link_after(e->aprev, lead);
    else {
      lead->anext = e;
      e->aprev = lead;
      x->first = lead;
    }
    e->off = at;
    e->bytes -= lead->bytes;
    bin_insert(x, lead);
    x->nextents++;
  }
  if (tail) {
    tail->off = e->off + bytes;
    tail->bytes = e->bytes - bytes;
    link_after(e, tail);
    e->bytes = bytes;
    bin_insert(x, tail);
    x->nextents++;
  }
  e->state = (uint8_t)state;
  e->owner = NULL;
  rmap_set(x, e->off, mapped_bytes(state, e->bytes), e);
  hwm_raise(x, e->off + e->bytes);
  x->used_bytes += bytes;
  if (state == KVP__EXT_SLAB) x->nslab++;
  else x->nlarge++;
  return e;
}

int kvp__extent_alloc(kvp__extents *x, uint64_t bytes, uint64_t align, kvp__ext_state state,
                      kvp__extent **out) {
  kvp__assert(bytes && bytes % KVP__EXTENT_UNIT == 0 && align >= KVP__EXTENT_UNIT);
  kvp__assert(state != KVP__EXT_FREE);
  uint64_t at = 0;
  kvp__extent *e = bytes <= x->bytes ? find_fit(x, bytes, align, &at) : NULL;
  if (!e) return KVP_ENOSPC;
  /* Compute, reserve, then commit: take both split descriptors first. */
  kvp__extent *lead = NULL, *tail = NULL;
  if (at > e->off && !(lead = kvp__meta_calloc(x->meta, sizeof *lead))) goto nomem;
  if (at + bytes < e->off + e->bytes && !(tail = kvp__meta_calloc(x->meta, sizeof *tail))) goto nomem;
  if (rmap_ensure(x, at, mapped_bytes(state, bytes))) {
    kvp__meta_free(x->meta, lead, sizeof *lead);
    kvp__meta_free(x->meta, tail, sizeof *tail);
    return KVP_ENOMEM;
  }
  *out = carve(x, e, at, bytes, state, lead, tail);
  return KVP_OK;
nomem:
  kvp__meta_free(x->meta, lead, sizeof *lead);
  return kvp__err(KVP_ENOMEM, "extent descriptor");
}

static kvp__extent *spare_pop(kvp__extent **spare) {
  kvp__extent *d = *spare;
  kvp__assert(d != NULL); /* two per page were taken ahead */
  *spare = d->anext;
  memset(d, 0, sizeof *d);
  return d;
}

kvp__extent *kvp__extent_take_at(kvp__extents *x, uint64_t off, uint64_t bytes, kvp__ext_state state,
                                 kvp__extent **spare) {
  kvp__extent *e = x->first;
  while (e->off + e->bytes <= off) e = e->anext;
  kvp__assert(e->state == KVP__EXT_FREE && e->off + e->bytes >= off + bytes);
  kvp__extent *lead = off > e->off ? spare_pop(spare) : NULL;
  kvp__extent *tail = off + bytes < e->off + e->bytes ? spare_pop(spare) : NULL;
  for (uint64_t c = chunk_lo(off); c < chunk_hi(off, mapped_bytes(state, bytes)); c++)
    kvp__assert(x->rmap[c] != NULL); /* kept since the range was last used */
  return carve(x, e, off, bytes, state, lead, tail);
}

void kvp__extents_trim(kvp__extents *x) {
  bool keep = x->keep_chunks;
  x->keep_chunks = false;
  rmap_trim(x, 0, x->bytes);
  x->keep_chunks = keep;
}

void kvp__extent_free(kvp__extents *x, kvp__extent *e) {
  kvp__assert(e->state != KVP__EXT_FREE);
  rmap_set(x, e->off, mapped_bytes((kvp__ext_state)e->state, e->bytes), NULL);
  x->used_bytes -= e->bytes;
  if (e->state == KVP__EXT_SLAB) x->nslab--;
  else x->nlarge--;
  e->state = KVP__EXT_FREE;
  e->owner = NULL;
  kvp__extent *p = e->aprev, *n = e->anext;
  if (p && p->state == KVP__EXT_FREE) {
    bin_remove(x, p);
    p->bytes += e->bytes;
    unlink_addr(x, e);
    kvp__meta_free(x->meta, e, sizeof *e);
    x->nextents--;
    e = p;
  }
  if (n && n->state == KVP__EXT_FREE) {
    bin_remove(x, n);
    e->bytes += n->bytes;
    unlink_addr(x, n);
    kvp__meta_free(x->meta, n, sizeof *n);
    x->nextents--;
  }
  bin_insert(x, e);
}

bool kvp__extent_grow_in_place(kvp__extents *x, kvp__extent *e, uint64_t bytes) {
  kvp__extent *n = e->anext;
  if (bytes <= e->bytes) return bytes == e->bytes;
  uint64_t need = bytes - e->bytes;
  if (!n || n->state != KVP__EXT_FREE || n->bytes < need) return false;
  bool map = e->state == KVP__EXT_SLAB; /* a LARGE extent maps its first unit only */
  if (map && rmap_ensure(x, e->off + e->bytes, need)) return false; /* the caller moves the page instead */
  bin_remove(x, n);
  if (n->bytes == need) {
    unlink_addr(x, n);
    kvp__meta_free(x->meta, n, sizeof *n);
    x->nextents--;
  } else {
    n->off += need;
    n->bytes -= need;
    bin_insert(x, n);
  }
  if (map) rmap_set(x, e->off + e->bytes, need, e);
  e->bytes = bytes;
  hwm_raise(x, e->off + e->bytes);
  x->used_bytes += need;
  return true;
}

#define CORRUPT(...) kvp__err(KVP_ECORRUPT, __VA_ARGS__)

static int check_bins(const kvp__extents *x, uint64_t nfree) {
  uint64_t listed = 0;
  for (uint32_t b = 0; b < KVP__EXT_BINS; b++) {
    bool bit = (x->nonempty[b / 64] >> (b % 64)) & 1;
    if (bit != (x->bins[b] != NULL)) return CORRUPT("extent bin %u: non-empty bit %d disagrees with its list", b, bit);
    for (const kvp__extent *e = x->bins[b]; e; e = e->fnext, listed++) {
      if (e->state != KVP__EXT_FREE || e->bin != b || kvp__ext_bin(e->bytes) != b)
        return CORRUPT("extent at offset %llu (%llu bytes) is in free bin %u wrongly",
                       (unsigned long long)e->off, (unsigned long long)e->bytes, b);
      if (listed > nfree) return CORRUPT("extent bin %u: list longer than the free extents", b);
    }
  }
  return listed == nfree ? KVP_OK : CORRUPT("%llu free extents, but %llu in bins", (unsigned long long)nfree,
                                            (unsigned long long)listed);
}

/* rmap over e's units: e on the mapped ones (every unit of a slab, the
 * first of a large extent), NULL on the others (absent chunks are NULL). */
static int check_rmap(const kvp__extents *x, const kvp__extent *e) {
  uint64_t u = e->off >> KVP__EXTENT_UNIT_SHIFT, end = (e->off + e->bytes) >> KVP__EXTENT_UNIT_SHIFT;
  uint64_t map_end = e->state == KVP__EXT_FREE ? u : (e->off + mapped_bytes((kvp__ext_state)e->state, e->bytes)) >>
                                                          KVP__EXTENT_UNIT_SHIFT;
  while (u < end) {
    const kvp__rmap_chunk *c = x->rmap[u >> KVP__RMAP_CHUNK_SHIFT];
    uint64_t stop = ((u >> KVP__RMAP_CHUNK_SHIFT) + 1) << KVP__RMAP_CHUNK_SHIFT;
    if (stop > end) stop = end;
    if (!c && u < map_end)
      return CORRUPT("address map chunk of unit %llu is missing under the used extent at offset %llu",
                     (unsigned long long)u, (unsigned long long)e->off);
    for (; c && u < stop; u++)
      if (c->unit[u & (KVP__RMAP_CHUNK_UNITS - 1)] != (u < map_end ? e : NULL))
        return CORRUPT("address map of unit %llu disagrees with the extent at offset %llu", (unsigned long long)u,
                       (unsigned long long)e->off);
    u = stop;
  }
  return KVP_OK;
}

/* Each chunk present maps some unit (a whole map: every chunk is present),
 * and rmap_nused counts its entries. */
static int check_chunks(const kvp__extents *x) {
  for (uint64_t c = 0; c < x->nchunks; c++) {
    const kvp__rmap_chunk *k = x->rmap[c];
    if (!k && x->whole) return CORRUPT("address map chunk %llu is missing from a whole map", (unsigned long long)c);
    if (!k) continue;
    uint64_t n = 0;
    for (uint32_t i = 0; i < KVP__RMAP_CHUNK_UNITS; i++) n += k->unit[i] != NULL;
    if ((!n && !x->whole) || n != x->rmap_nused[c])
      return CORRUPT("address map chunk %llu: %llu units mapped, it counts %llu%s", (unsigned long long)c,
                     (unsigned long long)n, (unsigned long long)x->rmap_nused[c], n ? "" : " (an empty chunk is kept)");
  }
  return KVP_OK;
}

int kvp__extents_check(const kvp__extents *x) {
  uint64_t off = 0, n = 0, nfree = 0, used = 0, nslab = 0, nlarge = 0;
  int rc;
  const kvp__extent *prev = NULL;
  for (const kvp__extent *e = x->first; e; prev = e, e = e->anext, n++) {
    if (e->aprev != prev) return CORRUPT("extent at offset %llu: broken address links", (unsigned long long)e->off);
    if (e->off != off || !e->bytes || e->bytes % KVP__EXTENT_UNIT)
      return CORRUPT("extent tiling broken at offset %llu (extent says %llu, %llu bytes)", (unsigned long long)off,
                     (unsigned long long)e->off, (unsigned long long)e->bytes);
    if (e->state == KVP__EXT_FREE && prev && prev->state == KVP__EXT_FREE)
      return CORRUPT("free extents at offsets %llu and %llu were not coalesced", (unsigned long long)prev->off,
                     (unsigned long long)e->off);
    if ((rc = check_rmap(x, e))) return rc;
    if (e->state == KVP__EXT_FREE) nfree++;
    else used += e->bytes;
    nslab += e->state == KVP__EXT_SLAB;
    nlarge += e->state == KVP__EXT_LARGE;
    off += e->bytes;
  }
  if (off != x->bytes) return CORRUPT("extents cover %llu of %llu region bytes", (unsigned long long)off,
                                      (unsigned long long)x->bytes);
  for (const kvp__extent *e = x->first; e; e = e->anext)
    if (e->state != KVP__EXT_FREE && e->off + e->bytes > atomic_load_explicit(&x->hwm_bytes, memory_order_relaxed))
      return CORRUPT("used extent at offset %llu ends past the high-water mark %llu", (unsigned long long)e->off,
                     (unsigned long long)atomic_load_explicit(&x->hwm_bytes, memory_order_relaxed));
  if (n != x->nextents || used != x->used_bytes || nslab != x->nslab || nlarge != x->nlarge)
    return CORRUPT("extent counters drifted: %llu/%llu descriptors, %llu/%llu used bytes",
                   (unsigned long long)n, (unsigned long long)x->nextents, (unsigned long long)used,
                   (unsigned long long)x->used_bytes);
  if ((rc = check_chunks(x))) return rc;
  return check_bins(x, nfree);
}
