/*
 * pages/block.c - the objects a stream is made of, and their lifecycle:
 * blocks (new, own, destroy, reclaim), the runs and brefs that link them,
 * the streams' codec state, and the ledger's token counts.
 *
 * A block's lifecycle (every transition under the writer lock, but a
 * view's pin and unpin):
 *
 *   new      kvp__block_struct (metadata) then kvp__block_take_pages (all
 *            pages or none), or both at once (kvp__block_new, _new_sized):
 *            owners = refs = 0, reachable by no reader
 *   own      linked from a stream's bref: owners = refs = 1; each further
 *            bref (fork, a shared prefix) adds 1 to both; a pin (view,
 *            offload) adds 1 to refs
 *   unown    a bref dropped (kvp__block_unown: owners - 1, refs - 1):
 *              refs = 0               -> the limbo
 *              owners = 0 and refs > 0 -> the orphans, until the last
 *                                         unpin (kvp__block_unpinned) moves
 *                                         it to the limbo
 *   reclaim  a grace period after it joined the limbo, no reader holds it:
 *            its pages are freed (the ledger counts them out) and its struct
 *            (kvp__reclaim, or kvp__reclaim_after_grace once one passed)
 *   destroy  pages and struct freed at once: a block no reader can hold
 *            (never published, a failed append's, the pool going)
 *
 * Invariants (kvp_check, pages/fork.c):
 *   owners(b) = brefs to b over all sequences;  refs(b) = owners(b) + pins(b)
 *     (an undoable eviction, pages/evict.c, lowers owners first and finishes
 *     the drop when it commits)
 *   orphans = {b : owners = 0, refs > 0};  limbo = {b : refs = 0}
 *   ledger.retired = sum over limbo blocks of their pages' allocated bytes
 *   ledger.codec_state = sum over streams of their codec state bytes
 *   ledger.tokens_retained = sum over streams of retained_tokens
 *   ledger.bf16_equivalent = tokens_retained x 2 (K, V) x D x 2 bytes
 *   a run or bref readers may have seen is retired (uncounted now, freed
 *   after a grace period); one never published is freed now
 *   pre-backed stores (KVP_POOL_PREFAULT): every slot in [base, next) is
 *   exactly one of live, on the free list, or (brefs) on the retired list
 *
 * Layering: the files that build and change sequences call one way, down
 * this list, and never up it:
 *
 *   seq.c      sequences, the step protocol, the public entry points
 *   fork.c     fork, a restored sequence's build, kvp_check's walk
 *   stream.c   the append of one layer (block codecs); hands row-wise
 *              layers to
 *   rowwise.c  the append of one layer (row-wise codecs)
 *   policy.c   the policy spec and the window policy (policy_heatkv.c,
 *              heatkv.c: HeatKV), which plan evictions into
 *   evict.c    eviction plans, the eviction of one unit, the append
 *              transaction (take, make room, publish or undo)
 *   block.c    this file: uses alloc/, the ledger and RCU only (and drops
 *              a block's prefix chunk when its last owner goes, prefix.c)
 */
#include "pages.h"

#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- the pre-backed stores ------------------------------------------------
 * A decode token that fills its OPEN tails opens a block per head: H raw
 * block structs (128 bytes each) and H brefs (32 bytes). Taken from the
 * metadata arena as the pool grows, they land on pages nothing touched
 * before, and about one opening in four paid a page fault (microseconds:
 * more than the 16 tokens of the block cost together). A pool created with
 * KVP_POOL_PREFAULT asks for no first-touch cost later, so it also backs,
 * at create, the raw block structs and brefs its region can hold:
 *   slots = min(region_bytes / least raw block bytes over layers,
 *               region_bytes / BSTORE_SHARE / 128)
 * of each, in one metadata allocation per kind (counted in metadata_bytes
 * from create on) faulted in at once (huge pages where the kernel gives
 * them). Structs past that, and every other struct, come from kvp__meta as
 * before. Writer only: a block's slot goes back to its store's free list
 * when the block is freed (all block frees are the writer's); a retired
 * bref's, which readers may still follow, to the retired list, and from
 * there to the free list after the next grace period (kvp__reclaim: one it
 * waits for anyway, for blocks in the limbo, or once BSTORE_RETIRED_MAX
 * brefs wait; kvp_reclaim: any), not through an RCU callback. Cost: a pop or a bump, instead of the arena's
 * cache and its counters. */
enum { BSTORE_SHARE = 32 }; /* the block store holds at most 1/32 of the region's bytes (brefs: a quarter of that) */
/* Retired brefs that make a reclaim wait for a grace period on their own
 * (with blocks in the limbo it waits anyway): 128 KiB of them. */
enum { BSTORE_RETIRED_MAX = 4096 };

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define BSTORE_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define BSTORE_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define BSTORE_POISON(p, n) ((void)(p), (void)(n))
#define BSTORE_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* A slot, zeroed, or NULL when the store has none left. */
static inline void *store_take(kvp__bstore *st) {
  void *p = st->free;
  if (p) {
    BSTORE_UNPOISON(p, st->slot);
    st->free = *(void **)p;
  } else if (st->next != st->end) {
    p = st->next;
    st->next += st->slot;
    BSTORE_UNPOISON(p, st->slot);
  } else {
    return NULL;
  }
  return memset(p, 0, st->slot);
}

static inline bool store_has(const kvp__bstore *st, const void *p) {
  uintptr_t a = (uintptr_t)p;
  return a >= (uintptr_t)st->base && a < (uintptr_t)st->end;
}

static inline void store_give(kvp__bstore *st, void *p) {
  kvp__assert(((uintptr_t)p - (uintptr_t)st->base) % st->slot == 0);
  *(void **)p = st->free;
  st->free = p;
  BSTORE_POISON(p, st->slot);
}

/* Fault [p, p + bytes) in, writable (huge pages advised first). */
static void prefault(unsigned char *p, size_t bytes) {
  long pg = sysconf(_SC_PAGESIZE);
  uintptr_t page = pg > 0 ? (uintptr_t)pg : 4096, lo = ((uintptr_t)p + page - 1) & ~(page - 1);
  uintptr_t hi = ((uintptr_t)p + bytes) & ~(page - 1);
#ifdef MADV_HUGEPAGE
  uintptr_t hlo = ((uintptr_t)p + (2u << 20) - 1) & ~(uintptr_t)((2u << 20) - 1);
  uintptr_t hhi = ((uintptr_t)p + bytes) & ~(uintptr_t)((2u << 20) - 1);
  if (hhi > hlo) madvise((void *)hlo, hhi - hlo, MADV_HUGEPAGE); /* advisory; failure is fine */
#endif
#ifdef MADV_POPULATE_WRITE
  if (hi > lo && madvise((void *)lo, hi - lo, MADV_POPULATE_WRITE) == 0) return;
#endif
  volatile unsigned char *v = p;
  for (size_t off = 0; off < bytes; off += page) v[off] = v[off];
  (void)lo, (void)hi;
}

static int store_init(kvp_pool *pool, kvp__bstore *st, uint64_t nslots, size_t slot, const char *what) {
  st->slot = slot;
  st->bytes = (size_t)nslots * slot;
  if (!(st->base = kvp__meta_alloc(&pool->meta, st->bytes))) {
    memset(st, 0, sizeof *st);
    return kvp__err(KVP_ENOMEM, "the pre-backed %s of a KVP_POOL_PREFAULT pool (%llu of %zu bytes)", what,
                    (unsigned long long)nslots, slot);
  }
  prefault(st->base, st->bytes);
  BSTORE_POISON(st->base, st->bytes);
  st->next = st->base;
  st->end = st->base + st->bytes;
  return KVP_OK;
}

static void store_fini(kvp_pool *pool, kvp__bstore *st) {
  if (!st->base) return;
  BSTORE_UNPOISON(st->base, st->bytes);
  kvp__meta_free(&pool->meta, st->base, st->bytes);
  memset(st, 0, sizeof *st);
}

int kvp__bstore_init(kvp_pool *pool) {
  memset(&pool->bstore, 0, sizeof pool->bstore);
  memset(&pool->rstore, 0, sizeof pool->rstore);
  if (!(pool->cfg.flags & KVP_POOL_PREFAULT)) return KVP_OK;
  uint64_t least = 0; /* allocated bytes of the smallest raw block (K + V) of a layer */
  for (uint32_t l = 0; l < pool->cfg.n_layers; l++) {
    uint64_t b = kvp__block_class_bytes(pool, l, true, 0, kvp__layer_bt(pool, l, KVP_SEQ_STREAM));
    if (b && (!least || b < least)) least = b;
  }
  size_t slot = kvp__block_bytes(1);
  uint64_t nslots = least ? pool->cfg.region_bytes / least : 0, most = pool->cfg.region_bytes / BSTORE_SHARE / slot;
  if (nslots > most) nslots = most;
  if (!nslots) return KVP_OK;
  int rc = store_init(pool, &pool->bstore, nslots, slot, "block structs");
  if (!rc && (rc = store_init(pool, &pool->rstore, nslots, sizeof(kvp__bref), "brefs")))
    store_fini(pool, &pool->bstore);
  return rc;
}

void kvp__bstore_fini(kvp_pool *pool) {
  store_fini(pool, &pool->bstore); /* no reader is left: retired brefs go with the rest */
  store_fini(pool, &pool->rstore);
}

/* Retired brefs of the store to its free list: a grace period passed since
 * they were retired (kvp__reclaim_after_grace). */
static void rstore_recycle(kvp__bstore *st) {
  for (void *p = st->retired, *n; p; p = n) {
    memcpy(&n, &((kvp__bref *)p)->rcu, sizeof n);
    store_give(st, p);
  }
  st->retired = NULL;
  st->nretired = 0;
}

kvp__bref *kvp__bref_new_w(kvp_pool *pool) {
  kvp__bref *r = store_take(&pool->rstore);
  return r ? r : kvp__meta_calloc_w(&pool->meta, sizeof(kvp__bref));
}

/* ---- runs and brefs ---------------------------------------------------- */

kvp__run *kvp__run_new(kvp_pool *pool, uint32_t s0, uint32_t p0, uint32_t s1, uint32_t p1, const uint64_t *mask) {
  uint32_t nwords = (pool->cfg.n_kv_heads + 63) / 64;
  kvp__run *r = kvp__meta_alloc(&pool->meta, sizeof *r + nwords * sizeof(uint64_t));
  if (!r) return NULL;
  r->next = NULL;
  r->s0 = s0;
  r->p0 = p0;
  atomic_init(&r->s1, s1);
  atomic_init(&r->p1, p1);
  r->nwords = nwords;
  memcpy(r->mask, mask, nwords * sizeof(uint64_t));
  return r;
}

void kvp__run_free_now(kvp_pool *pool, kvp__run *r) {
  kvp__meta_free(&pool->meta, r, sizeof *r + r->nwords * sizeof(uint64_t));
}

void kvp__bref_free_now(kvp_pool *pool, kvp__bref *b) {
  if (store_has(&pool->rstore, b)) store_give(&pool->rstore, b);
  else kvp__meta_free(&pool->meta, b, sizeof *b);
}

static void run_free_cb(kvp__rcu_head *h) {
  kvp__rcu_cb_begin(h);
  kvp__run *r = caa_container_of(h, kvp__run, rcu);
  kvp__meta_free(NULL, r, sizeof *r + r->nwords * sizeof(uint64_t));
}

static void bref_free_cb(kvp__rcu_head *h) {
  kvp__rcu_cb_begin(h);
  kvp__meta_free(NULL, caa_container_of(h, kvp__bref, rcu), sizeof(kvp__bref));
}

/* The pool's counter drops at retire; the memory goes after the grace period
 * (callbacks run on urcu's thread and count against no pool). */
void kvp__run_retire(kvp_pool *pool, kvp__run *r) {
  kvp__meta_uncount(&pool->meta, r, sizeof *r + r->nwords * sizeof(uint64_t));
  kvp__rcu_call(&r->rcu, run_free_cb);
}

void kvp__bref_retire(kvp_pool *pool, kvp__bref *b) {
  if (store_has(&pool->rstore, b)) { /* recycled after the next grace period (rstore_recycle) */
    memcpy(&b->rcu, &pool->rstore.retired, sizeof pool->rstore.retired);
    pool->rstore.retired = b;
    pool->rstore.nretired++;
    return;
  }
  kvp__meta_uncount(&pool->meta, b, sizeof *b);
  kvp__rcu_call(&b->rcu, bref_free_cb);
}
/* The last run ends at this step and retains exactly the stored heads. */
bool kvp__run_extends(const kvp_pool *pool, const kvp__layer *L, uint32_t step, const uint64_t *mask) {
  const kvp__run *r = L->last;
  if (!r || atomic_load_explicit(&r->s1, memory_order_relaxed) != step) return false;
  return memcmp(r->mask, mask, r->nwords * sizeof(uint64_t)) == 0 && (pool->cfg.n_kv_heads + 63) / 64 == r->nwords;
}
/* The same for mask = every head: no mask to build (a decode token's check). */
bool kvp__run_extends_all(const kvp_pool *pool, const kvp__layer *L, uint32_t step) {
  const kvp__run *r = L->last;
  uint32_t H = pool->cfg.n_kv_heads, nw = (H + 63) / 64;
  if (!r || atomic_load_explicit(&r->s1, memory_order_relaxed) != step || r->nwords != nw) return false;
  for (uint32_t w = 0; w + 1 < nw; w++)
    if (r->mask[w] != ~0ull) return false;
  return r->mask[nw - 1] == (H % 64 ? (1ull << H % 64) - 1 : ~0ull);
}

/* ---- blocks ------------------------------------------------------------ */

uint64_t kvp__block_class_bytes(const kvp_pool *pool, uint32_t layer, bool raw, uint32_t pos0, uint32_t cap) {
  uint64_t sum = 0;
  for (int kv = 0; kv < 2; kv++) {
    const kvp__binding *bd = raw ? &pool->tail[kv] : &pool->bind[2 * layer + kv];
    kvp_codec_layout lay;
    kvp__bind_layout(bd, pos0, cap, &lay);
    for (unsigned i = 0; i < lay.npages; i++) sum += kvp__alloc_size(&pool->alloc, lay.bytes[i]);
  }
  return sum;
}

static void free_pages(kvp_pool *pool, kvp__block *b) {
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv]; i++) {
      int rc = kvp__alloc_free(&pool->alloc, &KVP__PG(b, i)[kv]);
      kvp__assert(rc == KVP_OK);
      (void)rc;
    }
}

int kvp__block_new(kvp_pool *pool, uint64_t seq, uint32_t layer, uint32_t head, uint32_t pos0, uint32_t cap, bool raw,
                   kvp__block **out) {
  kvp_codec_layout lay[2];
  for (int kv = 0; kv < 2; kv++)
    kvp__bind_layout(raw ? &pool->tail[kv] : &pool->bind[2 * layer + kv], pos0, cap, &lay[kv]);
  return kvp__block_new_sized(pool, seq, layer, head, pos0, cap, raw, lay, out);
}

void kvp__block_layouts(const kvp__block *b, kvp_codec_layout *lay) {
  for (int kv = 0; kv < 2; kv++) {
    memset(&lay[kv], 0, sizeof lay[kv]);
    lay[kv].npages = b->npages[kv];
    for (unsigned i = 0; i < b->npages[kv]; i++) {
      lay[kv].types[i] = (kvp_page_type)KVP__PG(b, i)[kv].tag.type;
      lay[kv].bytes[i] = KVP__PG(b, i)[kv].requested_bytes;
    }
  }
}

kvp__block *kvp__block_struct(kvp_pool *pool, uint32_t pos0, uint32_t cap, bool raw) {
  uint8_t npg = kvp__block_rows(raw);
  kvp__block *b = kvp__meta_calloc(&pool->meta, kvp__block_bytes(npg));
  if (b) b->pos0 = pos0, b->cap_tokens = cap, b->raw = raw, b->npg = npg;
  return b;
}

kvp__block *kvp__block_struct_w(kvp_pool *pool, uint32_t pos0, uint32_t cap, bool raw) {
  uint8_t npg = kvp__block_rows(raw);
  kvp__block *b = raw ? store_take(&pool->bstore) : NULL;
  if (!b) b = kvp__meta_calloc_w(&pool->meta, kvp__block_bytes(npg));
  if (b) b->pos0 = pos0, b->cap_tokens = cap, b->raw = raw, b->npg = npg;
  return b;
}

void kvp__block_struct_free(kvp_pool *pool, kvp__block *b) {
  if (store_has(&pool->bstore, b)) store_give(&pool->bstore, b);
  else kvp__meta_free(&pool->meta, b, kvp__block_bytes(b->npg));
}

int kvp__block_take_pages(kvp_pool *pool, kvp__block *b, uint64_t seq, uint32_t layer, uint32_t head,
                          const kvp_codec_layout *lays) {
  for (int kv = 0; kv < 2; kv++) {
    const kvp__binding *bd = b->raw ? &pool->tail[kv] : &pool->bind[2 * layer + kv];
    const kvp_codec_layout lay = lays[kv];
    kvp__assert(lay.npages <= b->npg); /* a raw binding's layout is one page a side */
    for (unsigned i = 0; i < lay.npages; i++) {
      kvp__tag t = {seq, (uint16_t)layer, (uint16_t)head, (uint8_t)lay.types[i], (uint8_t)kv, (uint16_t)bd->id};
      int rc = kvp__alloc_page(&pool->alloc, lay.bytes[i], &t, &KVP__PG(b, i)[kv]);
      if (rc) { /* give back the pages taken so far */
        kvp__block_give_pages(pool, b);
        return rc;
      }
      b->npages[kv] = (uint8_t)(i + 1);
    }
  }
  return KVP_OK;
}

void kvp__block_give_pages(kvp_pool *pool, kvp__block *b) {
  free_pages(pool, b);
  b->npages[0] = b->npages[1] = 0;
}

int kvp__block_new_sized(kvp_pool *pool, uint64_t seq, uint32_t layer, uint32_t head, uint32_t pos0, uint32_t cap,
                         bool raw, const kvp_codec_layout *lays, kvp__block **out) {
  kvp__block *b = kvp__block_struct(pool, pos0, cap, raw);
  if (!b) return kvp__err(KVP_ENOMEM, "block metadata");
  int rc = kvp__block_take_pages(pool, b, seq, layer, head, lays);
  if (rc) {
    kvp__block_struct_free(pool, b);
    return rc;
  }
  *out = b;
  return KVP_OK;
}

/* ---- block lifetime ----------------------------------------------------- */

void kvp__block_destroy(kvp_pool *pool, kvp__block *b) {
  free_pages(pool, b);
  kvp__block_struct_free(pool, b);
}

static uint64_t block_bytes(const kvp__block *b) {
  uint64_t n = 0;
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv]; i++) n += kvp__page_alloc_bytes(&KVP__PG(b, i)[kv]);
  return n;
}

static void limbo_push(kvp_pool *pool, kvp__block *b) {
  b->onext = pool->limbo;
  pool->limbo = b;
  kvp__ledger_begin(&pool->alloc.ledger);
  kvp__gauge_add(&pool->alloc.ledger.retired, block_bytes(b));
  kvp__ledger_end(&pool->alloc.ledger);
}

static void orphan_remove(kvp_pool *pool, kvp__block *b) {
  if (b->oprev) b->oprev->onext = b->onext;
  else pool->orphans = b->onext;
  if (b->onext) b->onext->oprev = b->oprev;
  b->oprev = b->onext = NULL;
  b->orphan = false;
}

void kvp__block_unown(kvp_pool *pool, kvp__block *b) {
  kvp__assert(b->owners > 0);
  b->owners--;
  kvp__block_unowned(pool, b);
}

void kvp__block_unowned(kvp_pool *pool, kvp__block *b) {
  kvp__assert(b->owners || !b->chunk); /* a prefix-table entry owns its blocks */
  if (atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) == 1) {
    limbo_push(pool, b);
  } else if (!b->owners) { /* pinned by views: kept until the last release */
    b->orphan = true;
    b->oprev = NULL;
    b->onext = pool->orphans;
    if (pool->orphans) pool->orphans->oprev = b;
    pool->orphans = b;
  }
}

void kvp__block_unpinned(kvp_pool *pool, kvp__block *b) {
  kvp__assert(b->orphan && atomic_load(&b->refs) == 0);
  orphan_remove(pool, b);
  limbo_push(pool, b);
}

void kvp__reclaim(kvp_pool *pool) {
  if (!pool->limbo && pool->rstore.nretired < BSTORE_RETIRED_MAX) return; /* no grace period for a few brefs */
  kvp__rcu_synchronize();
  kvp__reclaim_after_grace(pool);
}

void kvp__reclaim_after_grace(kvp_pool *pool) {
  rstore_recycle(&pool->rstore);
  if (!pool->limbo) return;
  /* copies already enqueued on device streams may still touch these pages;
   * a failure here is reported by the region and the pages are freed anyway
   * (the device is then unusable for the pool's work) */
  pool->alloc.region.ops->quiesce(&pool->alloc.region);
  uint64_t bytes = 0;
  for (kvp__block *b = pool->limbo, *n; b; b = n) {
    n = b->onext;
    bytes += block_bytes(b);
    kvp__block_destroy(pool, b);
  }
  pool->limbo = NULL;
  kvp__ledger_begin(&pool->alloc.ledger);
  kvp__gauge_sub(&pool->alloc.ledger.retired, bytes);
  kvp__ledger_end(&pool->alloc.ledger);
}

KVP_API int kvp_reclaim(kvp_pool *pool) {
  if (!pool) return kvp__err(KVP_EINVAL, "pool is NULL");
  kvp__lock(pool);
  if (pool->limbo || pool->rstore.retired) { /* everything that waits, a few retired brefs too */
    kvp__rcu_synchronize();
    kvp__reclaim_after_grace(pool);
  }
  kvp__alloc_trim(&pool->alloc); /* the allocator's caches too: committed bytes down to what pages hold */
  kvp__unlock(pool);
  return KVP_OK;
}

/* ---- codec state ---------------------------------------------------------- */

size_t kvp__cstate_bytes(const kvp_pool *pool, uint32_t layer, int kv) {
  const kvp__binding *bd = &pool->bind[2 * layer + kv];
  return bd->vt->state_bytes ? bd->vt->state_bytes(bd->inst) : 0;
}

static void count_state(kvp_pool *pool, size_t bytes, int sign) {
  kvp__ledger_begin(&pool->alloc.ledger);
  if (sign > 0) kvp__gauge_add(&pool->alloc.ledger.codec_state, bytes);
  else kvp__gauge_sub(&pool->alloc.ledger.codec_state, bytes);
  kvp__ledger_end(&pool->alloc.ledger);
}

int kvp__cstate_get(kvp_pool *pool, kvp__stream *st, uint32_t layer, int kv, void **out) {
  size_t bytes = kvp__cstate_bytes(pool, layer, kv);
  if (bytes && !st->cstate[kv]) {
    if (!(st->cstate[kv] = kvp__meta_calloc(&pool->meta, bytes)))
      return kvp__err(KVP_ENOMEM, "codec state of %zu bytes (layer %u %c)", bytes, layer, "KV"[kv]);
    count_state(pool, bytes, +1);
  }
  *out = st->cstate[kv];
  return KVP_OK;
}

void kvp__cstate_free(kvp_pool *pool, kvp__stream *st, uint32_t layer) {
  for (int kv = 0; kv < 2; kv++)
    if (st->cstate[kv]) {
      size_t bytes = kvp__cstate_bytes(pool, layer, kv);
      kvp__meta_free(&pool->meta, st->cstate[kv], bytes);
      count_state(pool, bytes, -1);
      st->cstate[kv] = NULL;
    }
}

int kvp__cstate_copy(kvp_pool *pool, const kvp__stream *from, kvp__stream *to, uint32_t layer) {
  for (int kv = 0; kv < 2; kv++) {
    if (!from->cstate[kv]) continue;
    void *st;
    int rc = kvp__cstate_get(pool, to, layer, kv, &st);
    if (rc) return rc;
    memcpy(st, from->cstate[kv], kvp__cstate_bytes(pool, layer, kv));
  }
  return KVP_OK;
}

/* ---- token counts ------------------------------------------------------- */

void kvp__count_tokens(kvp_pool *pool, int64_t retained, uint64_t evicted) {
  kvp__ledger *l = &pool->alloc.ledger;
  uint64_t per_token = 2ull * pool->cfg.head_dim * 2; /* bf16 K + bf16 V */
  kvp__ledger_begin(l);
  if (retained >= 0) {
    kvp__gauge_add(&l->tokens_retained, (uint64_t)retained);
    kvp__gauge_add(&l->bf16_equivalent, (uint64_t)retained * per_token);
  } else {
    kvp__gauge_sub(&l->tokens_retained, (uint64_t)-retained);
    kvp__gauge_sub(&l->bf16_equivalent, (uint64_t)-retained * per_token);
  }
  kvp__count_add(&l->tokens_evicted, (int64_t)evicted);
  kvp__ledger_end(l);
}
