/*
 * alloc/alloc.h - bytes: region backends, size classes, extents, slabs, the
 * ledger with its strict budget, and the page allocator that ties them.
 *
 * alloc uses util and stats only. Every piece of metadata lives on the host;
 * host code never reads or writes payload bytes of a region (a device region
 * is touched only through the backend's copy primitive).
 *
 *   region  [0 .............................................. reserved)
 *           | extent | extent (SLAB) | free | extent | ...
 *   The region is tiled by extents in address order; each is FREE, SLAB
 *   (one slab of one size class, sized by its class: kvp__slab_bytes_of) or
 *   LARGE (one page above the largest slab class, its requested bytes
 *   rounded up to the 4 KiB extent unit only).
 *
 * Allocated bytes of a request (kvp__alloc_size):
 *   bytes <= small_max_bytes: its size class (8 B, 16 B steps to 1 KiB, then
 *                             64 per doubling: under 1/64 of rounding)
 *   bytes >  small_max_bytes: align_up(bytes, 4 KiB) (under 4 KiB, 1/8)
 *   small_max_bytes = 32 KiB in a region of 8 MiB or more (slabs of 8
 *   slots of it: 256 KiB); in a smaller region, an 8th of its slab cap.
 * Slab classes stop at 32 KiB because every class in use keeps a partly
 * used slab: finer classes above would cost a random mix of sizes up to 8x
 * its bytes in slabs, and from 32 KiB on the 4 KiB unit rounds by 1/8 at
 * most (nothing, for the 4 KiB multiples a KV cache's pages mostly are).
 * The extent unit is the granule on a device region too: the region is one
 * cudaMalloc, so sub-allocation needs no finer device granule than 4 KiB.
 * Slots of a class are 16-byte aligned (8-byte for the 8 B class) on the
 * host. A CUDA region's pages are 64-byte aligned: a request there rounds
 * up to 64 B before its class (page_align_bytes), because the device's
 * paged gather addresses pages in 64-byte units (kernels/kernels.h,
 * kvp__gjob); every class of a multiple of 64 is one.
 */
#ifndef KVP_ALLOC_H
#define KVP_ALLOC_H

#include "../stats/stats.h"
#include "../util/util.h"

/* ======================================================================
 * Region backends (alloc/region.c host, alloc/region_cuda.c device)
 * Each primitive returns KVP_OK or an error with a message.
 * ==================================================================== */

typedef struct kvp__region kvp__region;

typedef struct kvp__region_ops {
  const char *name; /* "host" or "cuda" */
  /* Reserve bytes; on success set r->base. */
  int (*reserve)(kvp__region *r);
  void (*release)(kvp__region *r);
  /* Copy bytes inside the region, ordered on stream (NULL: default). Ranges
   * must not overlap. */
  int (*copy)(kvp__region *r, uint64_t dst_off, uint64_t src_off, uint64_t bytes, void *stream);
  /* Copy height rows of width bytes from caller memory (src, src_pitch apart)
   * into the region (dst_off, dst_pitch apart), ordered on stream. */
  int (*write2d)(kvp__region *r, uint64_t dst_off, uint64_t dst_pitch, const void *src, uint64_t src_pitch,
                 uint64_t width, uint64_t height, void *stream);
  /* The reverse: region rows into caller memory. */
  int (*read2d)(kvp__region *r, void *dst, uint64_t dst_pitch, uint64_t src_off, uint64_t src_pitch, uint64_t width,
                uint64_t height, void *stream);
  /* Wait until no enqueued copy can still touch the region (before freed
   * pages are handed out again). Host: nothing to wait for. */
  int (*quiesce)(kvp__region *r);
  /* Device-level bytes in use and capacity (resident bytes of the host range;
   * cudaMemGetInfo for CUDA). span_bytes: the region's first bytes that
   * pages have ever occupied (the allocator's high-water mark): no byte
   * beyond was ever written, so the host backend scans only these, unless
   * the region was prefaulted. Lock-free. */
  int (*usage)(kvp__region *r, uint64_t span_bytes, uint64_t *used_bytes, uint64_t *total_bytes);
} kvp__region_ops;

struct kvp__region {
  const kvp__region_ops *ops; /* backend */
  kvp_mem mem;                /* KVP_MEM_HOST or KVP_MEM_CUDA */
  int device;                 /* CUDA ordinal */
  uint32_t flags;             /* KVP_POOL_* of the config */
  uint64_t bytes;             /* reserved bytes (multiple of KVP__EXTENT_UNIT) */
  unsigned char *base;        /* first byte (host or device address) */
  uint64_t map_bytes;         /* host backend: bytes actually mapped */
  void *map_base;             /* host backend: start of the mapping */
};

int kvp__region_open(kvp_mem mem, int device, uint64_t bytes, uint32_t flags, kvp__region *out);
void kvp__region_close(kvp__region *r);
extern const kvp__region_ops kvp__region_host_ops;
extern const kvp__region_ops kvp__region_dry_ops; /* KVP_POOL_DRY, host or CUDA: never touched */
#ifdef KVP_HAVE_CUDA
extern const kvp__region_ops kvp__region_cuda_ops;
#endif

/* ======================================================================
 * Size classes (alloc/sizeclass.c)
 * An 8 B class, 16 B steps up to 1 KiB, then 64 classes per doubling:
 *   8 | 16 32 48 ... 1024 | 1040 1056 ... 2048 | 2080 ... 4096 | ...
 * index(bytes) is the smallest class >= bytes; size(index(b)) >= b, and
 * size(index(b)) - b < max(16, b / 64).
 * ==================================================================== */

#define KVP__SC_TINY 8u                       /* the first class */
#define KVP__SC_QUANTUM 16u                   /* step of the linear classes */
#define KVP__SC_LINEAR_MAX 1024ull            /* largest linear class */
#define KVP__SC_LINEAR_COUNT 64u              /* linear classes: 16, 32, ..., 1024 (indexes 1..64) */
#define KVP__SC_LG_STEPS 6u                   /* 2^6 = 64 classes per doubling above 1 KiB */
#define KVP__SC_STEPS (1u << KVP__SC_LG_STEPS)
#define KVP__SC_MAX_BYTES (1ull << 44)        /* largest class: 16 TiB */
#define KVP__SC_COUNT 2241u                   /* classes up to KVP__SC_MAX_BYTES (checked by a test) */
#define KVP__SC_LUT_MAX_BYTES (16ull << 10)   /* sizes the table answers (one load) */
#define KVP__SLAB_BYTES (2ull << 20)          /* one slab (regions of 64 MiB and more) */
#define KVP__SLAB_MIN_BYTES (64ull << 10)     /* smallest slab cap */
#define KVP__SLAB_SLOTS 512u                  /* most slots of a slab (its bitmap: 8 words) */
#define KVP__SLAB_MIN_SLOTS 8u                /* slots a slab holds at least: a class is a slab class only so */
#define KVP__SLAB_FLOOR_BYTES (256ull << 10)  /* smallest slab where 8 slots take less (at most 512 slots) */
#define KVP__SMALL_MAX_BYTES (32ull << 10)    /* largest slab class (a 256 KiB slab of 8 slots) */
#define KVP__SC_SMALL_COUNT 385u              /* classes <= KVP__SMALL_MAX_BYTES (checked by a test) */
#define KVP__EXTENT_UNIT (4ull << 10)         /* extent granularity */
#define KVP__EXTENT_UNIT_SHIFT 12u

uint32_t kvp__sc_index_slow(uint64_t bytes); /* the formula; bytes in 1..MAX */
uint64_t kvp__sc_size_slow(uint32_t index);  /* the formula */
extern uint64_t kvp__sc_sizes[KVP__SC_COUNT]; /* the formula, tabulated */
extern uint16_t kvp__sc_lut[(KVP__SC_LUT_MAX_BYTES >> 3) + 1]; /* (b+7)>>3 -> index */
void kvp__sc_init(void);                      /* fill the tables; idempotent */

/* Fast path: one table load up to 16 KiB. bytes in 1..KVP__SC_MAX_BYTES. */
static inline uint32_t kvp__sc_index(uint64_t bytes) {
  if (KVP__LIKELY(bytes <= KVP__SC_LUT_MAX_BYTES)) return kvp__sc_lut[(bytes + 7) >> 3];
  return kvp__sc_index_slow(bytes);
}
static inline uint64_t kvp__sc_size(uint32_t index) { return kvp__sc_sizes[index]; }
/* Largest class <= bytes (bytes >= 8). */
uint32_t kvp__sc_index_floor(uint64_t bytes);

/* ======================================================================
 * Extents (alloc/extent.c): the region tiled in 4 KiB units.
 * ==================================================================== */

typedef enum { KVP__EXT_FREE, KVP__EXT_SLAB, KVP__EXT_LARGE } kvp__ext_state;

/* Free extents are binned by size, four bins per doubling from the 4 KiB
 * unit: bin(b) = 4 (lg b - 12) + the two bits below b's leading one, so a
 * bin holds [lower(bin), lower(bin + 1)) and every higher bin holds only
 * larger extents. */
#define KVP__EXT_BINS 132u /* up to 16 TiB */
static inline uint32_t kvp__ext_bin(uint64_t bytes) {
  unsigned lg = kvp__lg_floor(bytes); /* >= 12 */
  return 4 * (lg - KVP__EXTENT_UNIT_SHIFT) + (uint32_t)((bytes >> (lg - 2)) & 3);
}

typedef struct kvp__extent {
  uint64_t off;                      /* byte offset in the region */
  uint64_t bytes;                    /* size, multiple of KVP__EXTENT_UNIT */
  struct kvp__extent *aprev, *anext; /* neighbours in address order */
  struct kvp__extent *fprev, *fnext; /* free-bin list (FREE only) */
  void *owner;                       /* SLAB: its kvp__slab */
  uint32_t bin;                      /* FREE: bin index */
  uint8_t state;                     /* kvp__ext_state */
  bool cached;                       /* LARGE: a freed page's, kept for reuse (kvp__alloc's large cache) */
} kvp__extent;

/* The address map is two-level and committed lazily: a chunk of
 * KVP__RMAP_CHUNK_UNITS entries (16 MiB of region, 32 KiB of metadata)
 * exists only while one of its units is used, so a huge region (a 1 TiB dry
 * pool) costs metadata in proportion to what is allocated, not to its size:
 * 32 KiB per 16 MiB chunk holding a used unit, plus 12 bytes per 16 MiB.
 * A prefaulted region's map is made whole at create instead (0.2% of the
 * region: kvp__extents_map_whole). */
#define KVP__RMAP_CHUNK_SHIFT 12u
#define KVP__RMAP_CHUNK_UNITS (1u << KVP__RMAP_CHUNK_SHIFT)

typedef struct kvp__rmap_chunk {
  struct kvp__extent *unit[KVP__RMAP_CHUNK_UNITS]; /* owning extent of each unit, NULL if free: 32 KiB */
} kvp__rmap_chunk;

typedef struct kvp__extents {
  kvp__meta *meta;              /* metadata counter */
  uint64_t bytes;               /* region bytes managed */
  uint64_t nunits;              /* bytes / KVP__EXTENT_UNIT */
  uint64_t nchunks;             /* entries of rmap: ceil(nunits / KVP__RMAP_CHUNK_UNITS) */
  kvp__rmap_chunk **rmap;       /* [nchunks]: address map chunks, NULL where no unit is used */
  uint32_t *rmap_nused;         /* [nchunks]: non-NULL entries of each chunk */
  kvp__extent *bins[KVP__EXT_BINS]; /* free extents by kvp__ext_bin of their bytes */
  uint64_t nonempty[(KVP__EXT_BINS + 63) / 64]; /* bit per non-empty bin */
  kvp__extent *first;           /* lowest-address extent */
  uint64_t nextents;            /* descriptors (free and used) */
  uint64_t used_bytes;          /* bytes of SLAB and LARGE extents */
  _Atomic uint64_t hwm_bytes;   /* highest end offset a used extent ever had (never decreases; read lock-free) */
  uint64_t nlarge, nslab;       /* used extents by state */
  bool keep_chunks;             /* an allocator transaction is open: chunks that map nothing stay until it ends */
  bool whole;                   /* every chunk made and faulted in (kvp__extents_map_whole), kept until fini */
} kvp__extents;

int kvp__extents_init(kvp__extents *x, uint64_t bytes, kvp__meta *meta);
void kvp__extents_fini(kvp__extents *x);
/* Make every chunk of the address map now, faulted in, and keep them all
 * (a KVP_POOL_PREFAULT region: no first-touch cost when a slab or a large
 * page first maps a unit); ENOMEM with the map as it was. */
int kvp__extents_map_whole(kvp__extents *x);
/* Allocate bytes (multiple of the unit) at an offset aligned to align (a
 * power of two >= unit). KVP_ENOSPC when no free extent fits (no message:
 * the caller words it), KVP_ENOMEM. */
int kvp__extent_alloc(kvp__extents *x, uint64_t bytes, uint64_t align, kvp__ext_state state,
                      kvp__extent **out);
/* Return an extent; it coalesces with free neighbours. */
void kvp__extent_free(kvp__extents *x, kvp__extent *e);
/* Take exactly [off, off + bytes) (free) as a used extent, splitting the
 * free extent that holds it with the descriptors *spare provides (a chain
 * on anext, two at most are taken): cannot fail. The address map's chunks
 * over the range must exist (an allocator transaction keeps them). Cost:
 * a walk of the extents in address order up to off. */
kvp__extent *kvp__extent_take_at(kvp__extents *x, uint64_t off, uint64_t bytes, kvp__ext_state state,
                                 kvp__extent **spare);
/* Free the address map's chunks that map no unit (when a transaction ends). */
void kvp__extents_trim(kvp__extents *x);
/* Try to extend a used extent in place to bytes by taking the free extent
 * that follows it. Returns true on success. */
bool kvp__extent_grow_in_place(kvp__extents *x, kvp__extent *e, uint64_t bytes);
/* Owning extent of the unit containing off: any unit of a SLAB extent (a
 * slot's slab on free), only the first unit of a LARGE one (a large page is
 * freed and grown by its first byte, so mapping one unit keeps its
 * allocation and free O(1) whatever its size); NULL otherwise (free, inside
 * a large page, or out of range). */
static inline kvp__extent *kvp__extent_at(const kvp__extents *x, uint64_t off) {
  uint64_t u = off >> KVP__EXTENT_UNIT_SHIFT;
  if (u >= x->nunits) return NULL;
  const kvp__rmap_chunk *c = x->rmap[u >> KVP__RMAP_CHUNK_SHIFT];
  return c ? c->unit[u & (KVP__RMAP_CHUNK_UNITS - 1)] : NULL;
}
/* Verify tiling, bins, rmap, counters. KVP_OK or KVP_ECORRUPT with message. */
int kvp__extents_check(const kvp__extents *x);

/* ======================================================================
 * Slabs (alloc/slab.c): one extent sized by its class (KVP__SLAB_SLOTS
 * slots, at most the region's cap), slots of one class, a bitmap.
 * ==================================================================== */

typedef struct kvp__slab {
  kvp__extent *ext;               /* the extent it lives in */
  uint64_t base;                  /* region offset of slot 0 */
  struct kvp__slab *prev, *next;  /* in its bin's non-full list */
  uint32_t sc;                    /* size class */
  uint32_t slot_bytes;            /* class size */
  uint32_t nslots;                /* slots in the slab */
  uint32_t nfree;                 /* free slots */
  uint32_t hint;                  /* bitmap word to search first */
  uint32_t nwords;                /* bitmap words */
  uint32_t div_magic;             /* ceil(2^32 / slot_bytes): a slot's index by one multiply on free */
  bool listed;                    /* on its bin's non-full list */
  uint64_t bitmap[];              /* bit set = slot free */
} kvp__slab;

/* A bin: the slabs of one class, and in front of their bitmaps a stack of
 * free slots (the cache, as jemalloc's tcache bins and mimalloc's page free
 * lists): a page freed goes on top, an allocation takes the top, so the
 * fast path touches no slab. Cached slots are taken in their slabs'
 * bitmaps (bit clear) but belong to no page: the ledger does not count
 * them as allocated, kvp__alloc_check verifies each one. The stack is
 * filled from the bitmaps cache_cap / 2 slots at a time (from the current
 * slab only, so it never makes a slab a single allocation would not have
 * made) and, when full, flushed by its older half back to them; it holds
 * at most one slab's slots (up to KVP__BIN_CACHE_MAX), and every cache is
 * flushed before the region is declared full, before a transaction's
 * undo takes slots back at their offsets, and at destroy. */
#define KVP__BIN_CACHE_MAX 32u

typedef struct kvp__bin {
  kvp__slab *cur;    /* slab to allocate from; the empty sentinel if none */
  kvp__slab *avail;  /* other non-full slabs (doubly linked) */
  uint64_t nslabs;   /* slabs of this class */
  uint64_t nused;    /* slots of this class taken in the bitmaps: pages' slots plus ncached */
  uint64_t *cache;   /* [cache_cap]: region offsets of cached free slots, oldest first; NULL until the class's first
                        slab (and if that metadata could not be had: the class then runs without a cache) */
  uint32_t ncached;  /* slots in cache */
  uint32_t cache_cap; /* room of cache: min(KVP__BIN_CACHE_MAX, slots of a slab of the class); 0 without one */
} kvp__bin;

/* The shared sentinel: nfree = 0, so the fast path needs no NULL test. */
extern kvp__slab kvp__slab_empty;

/* ======================================================================
 * Ledger (alloc/ledger.c): the byte truth and the strict budget.
 * Writer-only updates inside a sequence lock; lock-free snapshots.
 * ==================================================================== */

typedef struct kvp__ledger {
  _Atomic uint64_t seq; /* sequence lock: odd while the writer updates */
  kvp_gauge requested, allocated, committed, pages, slabs, extents; /* bytes or counts */
  uint64_t allocs, frees, grows, grow_moves, budget_refusals, nospc_refusals; /* counts */
  kvp_gauge tokens_retained, bf16_equivalent, sequences, retired, codec_state; /* pages layer: tokens, bytes,
                                                                                  count, bytes, bytes */
  uint64_t tokens_evicted; /* tokens */
  uint64_t prefix_query_tokens, prefix_hit_tokens, store_prefix_tokens; /* tokens */
  uint64_t store_offload_bytes, store_restore_bytes; /* bytes */
  kvp_gauge prefix_chunks; /* prefix-table entries */
  uint64_t reserved_bytes; /* region */
  uint64_t budget_bytes;   /* strict cap on allocated */
} kvp__ledger;

void kvp__ledger_init(kvp__ledger *l, uint64_t reserved_bytes, uint64_t budget_bytes);
static inline bool kvp__ledger_fits(const kvp__ledger *l, uint64_t alloc_bytes) {
  return alloc_bytes <= l->budget_bytes - l->allocated.current;
}
/* The writer's section: the count is odd inside (inline: twice per page). */
static inline void kvp__ledger_begin(kvp__ledger *l) {
  atomic_store_explicit(&l->seq, atomic_load_explicit(&l->seq, memory_order_relaxed) + 1, memory_order_relaxed);
  atomic_thread_fence(memory_order_release);
}
static inline void kvp__ledger_end(kvp__ledger *l) {
  atomic_store_explicit(&l->seq, atomic_load_explicit(&l->seq, memory_order_relaxed) + 1, memory_order_release);
}
/* The writer stores with relaxed atomics (plain moves on x86-64) so that the
 * readers' relaxed loads inside the sequence lock are not data races. Inline:
 * the allocation fast path moves four of these per page. */
static inline void kvp__w64(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELAXED); }
static inline void kvp__count_add(uint64_t *c, int64_t n) { kvp__w64(c, *c + (uint64_t)n); } /* by the writer */
static inline void kvp__gauge_add(kvp_gauge *g, uint64_t n) {
  kvp__w64(&g->current, g->current + n);
  kvp__w64(&g->total, g->total + n);
  if (g->current > g->peak) kvp__w64(&g->peak, g->current);
}
static inline void kvp__gauge_sub(kvp_gauge *g, uint64_t n) {
  kvp__assert(g->current >= n);
  kvp__w64(&g->current, g->current - n);
}
/* Consistent copy of the ledger, from any thread. */
void kvp__ledger_snapshot(const kvp__ledger *l, kvp__ledger *out);

/* ======================================================================
 * The page allocator (alloc/alloc.c)
 * ==================================================================== */

/* A page as its owner holds it: 32 bytes, out of band. */
typedef struct kvp__page {
  uint64_t off;             /* region offset of the first byte */
  uint32_t requested_bytes; /* what the layout asked */
  uint32_t size8;           /* allocated bytes / 8: a slab class size (<= small_max_bytes: a slab slot) or a
                               large page's extent bytes (> small_max_bytes, a multiple of 4 KiB) */
  kvp__tag tag;             /* where its bytes are counted */
} kvp__page;

/* Allocated bytes for a request of bytes (1..KVP_MAX_PAGE_BYTES) in an
 * allocator whose largest slab class is small_max (a multiple of 64) and
 * whose pages are align-byte aligned (8, or 64 on a CUDA region): the size
 * class of the request rounded up to align, up to small_max; the 4 KiB
 * extent unit above. */
static inline uint64_t kvp__alloc_size_for(uint64_t small_max, uint64_t align, uint64_t bytes) {
  if (KVP__LIKELY(bytes <= small_max)) return kvp__sc_size(kvp__sc_index(kvp__align_up(bytes, align)));
  return kvp__align_up(bytes, KVP__EXTENT_UNIT);
}

/* ======================================================================
 * Transactions (alloc/txn.c): pages freed on trial, put back as they were
 * when the transaction is undone.
 *
 *   reserve   (per page to free) what putting it back may need: two extent
 *             descriptors, and a slab descriptor of its class for a small
 *             page (ENOMEM; nothing changed)
 *   begin
 *   free      pages, recorded: out of the ledger (the budget has room),
 *             their bytes still held (no page taken now can lie over them)
 *   ...       pages taken as usual (they may fail)
 *   space     (when the region, not the budget, is short) their bytes go
 *             back to the slabs and extents too; chunks of the address map
 *             stay until the end
 *   rollback  (every page taken since begin given back first) each freed
 *             page is counted again, and its bytes taken again at its
 *             offset, in its slab, if they went: cannot fail
 *   commit    the frees stand (their bytes go now if they had not)
 * Both end the transaction: unused descriptors and empty chunks go.
 * ==================================================================== */

typedef struct kvp__alloc_freed {
  kvp__page page;    /* the page as it was */
  uint64_t slab_off; /* small page: region offset of its slab */
} kvp__alloc_freed;

typedef struct kvp__alloc_tx {
  kvp__alloc_freed *freed; /* [cap]: pages freed in the transaction, in order */
  uint32_t n, nreserved, cap; /* pages freed, reserved for, room */
  kvp__extent *spare_ext;  /* descriptors taken ahead (anext chain): two per page */
  kvp__slab **spare_slab;  /* [spare_slab_cap]: slab descriptors taken ahead, one per small page, sized for its
                              class (NULL once used) */
  uint32_t nspare_slab, spare_slab_cap; /* in the array, room */
  bool open;               /* between begin and rollback or commit */
  bool space_freed;        /* the freed pages' bytes went back to the slabs and extents */
  bool reused;             /* a page taken since overlaps a freed one (whose payload it may overwrite) */
} kvp__alloc_tx;

/* The large cache: as the bins' caches do for slots, the extents of the
 * last large pages freed stay taken, so that a page of the same size
 * (a KV cache's large pages come in few sizes: a VAR scale's, a
 * prefill's) is a scan of a few entries instead of a walk of the free
 * bins and the address map. It is flushed where the bins' caches are. */
#define KVP__LARGE_CACHE_MAX 8u
#define KVP__LARGE_CACHE_BYTES (16ull << 20)

typedef struct kvp__alloc {
  kvp__region region;          /* the reserved memory */
  kvp__extents ext;            /* extent tiling */
  uint64_t small_max_bytes;    /* largest slab class: KVP__SMALL_MAX_BYTES, or an 8th of a smaller slab cap */
  uint32_t nsmall;             /* slab classes: kvp__sc_index(small_max_bytes) + 1 */
  uint64_t page_align_bytes;   /* every page's alignment: 8 (host), 64 (CUDA region: kvp__gjob's units) */
  kvp__bin bins[KVP__SC_SMALL_COUNT]; /* slab bins, [nsmall] used */
  uint64_t slab_bytes;         /* largest slab: kvp__slab_bytes_for(region) */
  uint64_t class_slab_bytes[KVP__SC_SMALL_COUNT]; /* bytes of a slab of each slab class: kvp__slab_bytes_of */
  kvp__ledger ledger;          /* byte truth */
  kvp__stats *stats;           /* per-tag counters */
  kvp__meta *meta;             /* metadata counter of the pool */
  kvp__alloc_tx *tx;           /* the open transaction, or NULL */
  kvp__extent *large_cache[KVP__LARGE_CACHE_MAX]; /* [nlarge_cached]: extents of freed large pages, still LARGE
                                                     (committed, not allocated), for the next page of their size;
                                                     oldest first */
  uint32_t nlarge_cached;      /* extents in large_cache */
  uint64_t large_cached_bytes; /* their bytes: at most large_cache_bytes */
  uint64_t large_cache_bytes;  /* cap of large_cached_bytes: min(KVP__LARGE_CACHE_BYTES, region / 16) */
} kvp__alloc;

/* Largest slab of a region: 2 MiB, or for a region under 64 MiB the power
 * of two at or below a 32nd of it (at least 64 KiB). */
static inline uint64_t kvp__slab_bytes_for(uint64_t region_bytes) {
  uint64_t want = region_bytes / 32;
  if (want >= KVP__SLAB_BYTES) return KVP__SLAB_BYTES;
  if (want <= KVP__SLAB_MIN_BYTES) return KVP__SLAB_MIN_BYTES;
  return 1ull << kvp__lg_floor(want);
}
/* Largest slab class under a slab cap: one whose slab holds
 * KVP__SLAB_MIN_SLOTS slots, at most KVP__SMALL_MAX_BYTES (32 KiB from a
 * 256 KiB cap on, 8 KiB under 64 KiB). */
static inline uint64_t kvp__small_max_for(uint64_t cap_bytes) {
  uint64_t m = cap_bytes / KVP__SLAB_MIN_SLOTS;
  return m < KVP__SMALL_MAX_BYTES ? m : KVP__SMALL_MAX_BYTES;
}
/* Slab bytes of a class of slot_bytes under a cap (kvp__slab_bytes_for):
 * room for KVP__SLAB_MIN_SLOTS (8) slots rounded up to the 4 KiB unit, at
 * least a floor of 256 KiB (an 8th of a smaller cap), at most
 * KVP__SLAB_SLOTS (512) slots and at most the cap. Every class in use keeps
 * one partly used slab, so with 64 classes per doubling a slab is far
 * smaller than the 2 MiB cap: a KV cache's pages (few sizes) or a random
 * mix (many) pay at most 256 KiB of committed bytes per class. The floor
 * is what keeps the fast path's slab turnover (creating and returning
 * slabs as a class's pages come and go) as rare as with 2 MiB slabs: 8-slot
 * slabs of the page mix cost kvpool-bench's alloc+free pair 15% more. An
 * 8 B class takes 4 KiB (512 slots), 64 B 32 KiB, 1 KiB and 4 KiB and 32 KiB
 * 256 KiB (256, 64, 8 slots); in a 4 MiB region (128 KiB cap) a class takes
 * at most 128 KiB and its floor is 16 KiB, so a small region holds many
 * classes at once. */
static inline uint64_t kvp__slab_bytes_of(uint64_t slot_bytes, uint64_t cap_bytes) {
  uint64_t floor = cap_bytes / KVP__SLAB_MIN_SLOTS < KVP__SLAB_FLOOR_BYTES ? cap_bytes / KVP__SLAB_MIN_SLOTS
                                                                           : KVP__SLAB_FLOOR_BYTES;
  uint64_t want = kvp__align_up(slot_bytes * KVP__SLAB_MIN_SLOTS, KVP__EXTENT_UNIT);
  if (want < floor) want = floor;
  if (want > slot_bytes * KVP__SLAB_SLOTS) want = slot_bytes * KVP__SLAB_SLOTS; /* a multiple of 4 KiB */
  return want < cap_bytes ? want : cap_bytes;
}
/* Allocated bytes for a request of bytes in a (kvp__alloc_size_for). */
static inline uint64_t kvp__alloc_size(const kvp__alloc *a, uint64_t bytes) {
  return kvp__alloc_size_for(a->small_max_bytes, a->page_align_bytes, bytes);
}
int kvp__alloc_init(kvp__alloc *a, kvp_mem mem, int device, uint64_t region_bytes,
                    uint64_t budget_bytes, uint32_t flags, kvp__stats *stats, kvp__meta *meta);
void kvp__alloc_fini(kvp__alloc *a);
static inline uint64_t kvp__page_alloc_bytes(const kvp__page *p) { return (uint64_t)p->size8 << 3; }
/* A small page is a slab slot; its class is one table load (up to 16 KiB). */
static inline bool kvp__page_is_small(const kvp__alloc *a, const kvp__page *p) {
  return kvp__page_alloc_bytes(p) <= a->small_max_bytes;
}
static inline uint32_t kvp__page_class(const kvp__page *p) { return kvp__sc_index(kvp__page_alloc_bytes(p)); }
static inline void *kvp__page_addr(const kvp__alloc *a, const kvp__page *p) {
  return a->region.base + p->off;
}
/* Allocate a tagged page of bytes (1..KVP_MAX_PAGE_BYTES). EINVAL, EBUDGET,
 * ENOSPC, ENOMEM; nothing changes on failure. */
int kvp__alloc_page(kvp__alloc *a, uint64_t bytes, const kvp__tag *tag, kvp__page *out);
/* The same for a tag its caller has validated (a raw page's, checked
 * against the pool's geometry): bytes are still checked. Inline below. */
int kvp__alloc_page_tagged_slow(kvp__alloc *a, uint64_t bytes, const kvp__tag *tag, kvp__page *out);
/* Free a page. EINVAL if p does not name a live page (foreign offset, double
 * free, wrong class); nothing changes then. */
int kvp__alloc_free(kvp__alloc *a, const kvp__page *p);
/* Give back what the allocator keeps for speed: the bins' cached slots,
 * the large cache, the empty slabs kept as current ones (committed bytes
 * fall to what live pages hold, up to the slabs they share). No figure
 * but committed bytes and slab and extent counts moves. */
void kvp__alloc_trim(kvp__alloc *a);
/* Free a page its owner knows to be live (a raw page whose id matched):
 * kvp__alloc_free without the validation. Cannot fail. Inline below. */
void kvp__alloc_free_live_slow(kvp__alloc *a, const kvp__page *p);
/* Resize p to bytes keeping min(old, new) bytes of payload (copied on
 * stream). In place when the class fits; else a new page is taken (the
 * budget must hold both while the move lasts), the payload copied, the old
 * freed. On failure p is unchanged. */
int kvp__alloc_grow(kvp__alloc *a, kvp__page *p, uint64_t bytes, void *stream);
/* Do alloc_bytes more allocated bytes (kvp__alloc_size, already summed) fit the
 * budget now? */
static inline bool kvp__alloc_fits_bytes(const kvp__alloc *a, uint64_t alloc_bytes) {
  return kvp__ledger_fits(&a->ledger, alloc_bytes);
}
/* An upper bound of the allocated bytes the region could still take: its
 * free extents plus every free slot of the slabs there are (planning: what
 * does not fit in this certainly does not fit). */
uint64_t kvp__alloc_room_bound(const kvp__alloc *a);
/* Would an allocation of bytes pass the budget now? (planning; no effect) */
bool kvp__alloc_fits(const kvp__alloc *a, uint64_t bytes);
/* Transactions (see above). tx zeroed before the first reserve. */
int kvp__alloc_tx_reserve(kvp__alloc *a, kvp__alloc_tx *tx, const kvp__page *p); /* ENOMEM */
void kvp__alloc_tx_begin(kvp__alloc *a, kvp__alloc_tx *tx);
void kvp__alloc_tx_free(kvp__alloc *a, kvp__alloc_tx *tx, const kvp__page *p); /* a live page, reserved for */
void kvp__alloc_tx_free_space(kvp__alloc *a, kvp__alloc_tx *tx);
void kvp__alloc_tx_rollback(kvp__alloc *a, kvp__alloc_tx *tx);
void kvp__alloc_tx_commit(kvp__alloc *a, kvp__alloc_tx *tx);
/* Release the reservations of a transaction never begun, or ended. */
void kvp__alloc_tx_release(kvp__alloc *a, kvp__alloc_tx *tx);
/* Verify the allocator's metadata and that the ledger's allocated and
 * committed figures and slab/extent counts equal the ones derived from the
 * slabs and extents. Pages' requested bytes are checked by the owner. */
int kvp__alloc_check(const kvp__alloc *a);
/* Bytes of metadata per class etc. are in a->meta. */

/* ======================================================================
 * The fast path, inline: a small page from or onto its class's cache, in
 * the caller's function (no call, no registers saved: stores that the
 * writer lock's atomic instructions would wait for). Everything else (an
 * empty or full cache, a large page, the budget's refusal, a new sequence,
 * an open transaction) is the out-of-line path, the same code as before.
 * ==================================================================== */

/* Count a page in (sign +1) or out (-1): the ledger's figures (_ledger_as)
 * and the per-tag cells too (_count_as). Inside the ledger's section. */
static inline __attribute__((always_inline)) void kvp__alloc_ledger_as(kvp__alloc *a, uint64_t req, uint64_t cls,
                                                                       int sign) {
  if (sign > 0) {
    kvp__gauge_add(&a->ledger.requested, req);
    kvp__gauge_add(&a->ledger.allocated, cls);
    kvp__gauge_add(&a->ledger.pages, 1);
  } else {
    kvp__gauge_sub(&a->ledger.requested, req);
    kvp__gauge_sub(&a->ledger.allocated, cls);
    kvp__gauge_sub(&a->ledger.pages, 1);
  }
}
static inline __attribute__((always_inline)) void kvp__alloc_count_as(kvp__alloc *a, const kvp__tag *tag,
                                                                      uint64_t req, uint64_t cls, int sign) {
  kvp__alloc_ledger_as(a, req, cls, sign);
  kvp__stats_count(a->stats, tag, req, cls, sign);
}

/* kvp__alloc_page for a validated tag. Fast: a slab class with a cached
 * slot, room in the budget, no transaction. */
static inline int kvp__alloc_page_tagged(kvp__alloc *a, uint64_t bytes, const kvp__tag *tag, kvp__page *out) {
  if (KVP__LIKELY(bytes - 1 < a->small_max_bytes)) { /* 1..small_max */
    uint32_t sc = kvp__sc_index(kvp__align_up(bytes, a->page_align_bytes));
    uint64_t size = kvp__sc_size(sc);
    kvp__bin *b = &a->bins[sc];
    const kvp__tag t = *tag; /* counted from this copy, not loaded back from the page's fresh stores */
    kvp__seq_usage *e;       /* its sequence's slot: found once, counted in below */
    if (KVP__LIKELY(b->ncached && kvp__ledger_fits(&a->ledger, size) && !a->tx &&
                    ((e = kvp__stats_seq_hinted(a->stats, t.seq)) != NULL || /* else a probe (it sets the last) */
                     (kvp__stats_reserve_seq_slow(a->stats, t.seq) == KVP_OK && (e = a->stats->seq_last) != NULL)))) {
      kvp__ledger_begin(&a->ledger);
      out->off = b->cache[--b->ncached];
      out->requested_bytes = (uint32_t)bytes;
      out->size8 = (uint32_t)(size >> 3);
      out->tag = t;
      kvp__alloc_ledger_as(a, bytes, size, +1);
      kvp__stats_count_in(a->stats, e, &t, bytes, size, +1);
      kvp__count_add(&a->ledger.allocs, 1);
      kvp__ledger_end(&a->ledger);
      return KVP_OK;
    }
  }
  return kvp__alloc_page_tagged_slow(a, bytes, tag, out);
}

/* kvp__alloc_free for a page known live. Fast: a slab slot whose class's
 * cache has room. */
static inline void kvp__alloc_free_live(kvp__alloc *a, const kvp__page *p) {
  uint64_t size = kvp__page_alloc_bytes(p);
  if (KVP__LIKELY(size <= a->small_max_bytes)) {
    kvp__bin *b = &a->bins[kvp__sc_index(size)];
    if (KVP__LIKELY(b->ncached < b->cache_cap)) {
      kvp__ledger_begin(&a->ledger);
      b->cache[b->ncached++] = p->off;
      kvp__alloc_count_as(a, &p->tag, p->requested_bytes, size, -1);
      kvp__count_add(&a->ledger.frees, 1);
      kvp__ledger_end(&a->ledger);
      return;
    }
  }
  kvp__alloc_free_live_slow(a, p);
}

#endif /* KVP_ALLOC_H */
