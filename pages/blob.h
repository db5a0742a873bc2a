/*
 * pages/blob.h - the store tier's blob format, shared by pages/blob.c
 * (headers, group blobs, batched writes), pages/offload.c (sequences out
 * and back) and pages/prefix_store.c (prefix chunks by content key).
 *
 * Blobs (little-endian, as the host lays out the structs below):
 *
 *   blob     | blob_hdr (72 B) | payload (payload_bytes) |
 *   hdr      magic "KVPB", version, kind, geometry (L, H, D, block tokens,
 *            dtypes), codec fingerprint, payload bytes, XXH64 of the
 *            payload, tag (content key, or generation and group of a part)
 *   group    n_items x ( blk_rec (60 B) | K pages | V pages ): the blocks
 *            of one chunk g, every block whose pos0 / block_tokens = g,
 *            in (layer, head, position) order
 *   manifest man_seq | step_pos[n_steps + 1] | plan[n_plan] |
 *            pkeys[n_pkeys][2] | per layer: nruns, runs (s0 p0 s1 p1 mask) |
 *            per stream: retained, evicted, state flags, codec states |
 *            n_items x man_group (kind, chunk, blocks, key, allocated bytes)
 *
 * Keys (prefix from the store's URL):
 *   <prefix>seq:<id>                 the manifest, written last
 *   <prefix>seq:<id>:<gen>:<g>       group g of that offload (gen: random)
 *   <prefix>blk:<key 32 hex>         a content chunk: the L x H full blocks
 *                                    of one prompt chunk, shared by content
 */
#ifndef KVP_PAGES_BLOB_H
#define KVP_PAGES_BLOB_H

#include "../store/store.h"
#include "pages.h"

#include <stdio.h>
#include <string.h>

#define BLOB_MAGIC 0x4250564Bu /* "KVPB" */
#define BLOB_VERSION 1u
enum { KIND_MANIFEST = 1, KIND_GROUP = 2 };
enum { GROUP_PART = 0, GROUP_CONTENT = 1 };
#define PUT_BATCH_BYTES (64ull << 20) /* blob bytes built before one pipelined write */

typedef struct blob_hdr {
  uint32_t magic;         /* BLOB_MAGIC */
  uint16_t version;       /* BLOB_VERSION */
  uint16_t kind;          /* KIND_* */
  uint32_t n_layers, n_kv_heads, head_dim, block_tokens; /* geometry */
  uint32_t dtypes;        /* k_dtype | v_dtype << 8 */
  uint32_t n_items;       /* group: block records; manifest: groups */
  uint64_t codec_fp;      /* the pool's codec fingerprint */
  uint64_t payload_bytes; /* bytes after the header */
  uint64_t checksum;      /* XXH64 of the payload */
  uint64_t tag[2];        /* content key, or (generation, chunk) of a part, or (seq, generation) */
} blob_hdr;
_Static_assert(sizeof(blob_hdr) == 72, "blob header layout");

typedef struct blk_rec {
  uint16_t layer, head;                      /* stream */
  uint32_t pos0, cap_tokens, n_tokens;       /* positions, capacity, tokens held */
  uint8_t raw, sealed, npages[2];            /* raw tail pages; sealed; pages per side */
  uint8_t types[2][KVP_CODEC_MAX_PAGES];     /* page types */
  uint32_t bytes[2][KVP_CODEC_MAX_PAGES];    /* requested bytes per page */
} blk_rec;
_Static_assert(sizeof(blk_rec) == 60, "block record layout");

typedef struct man_seq {
  uint64_t seq, gen;                         /* id, generation of this offload */
  uint32_t mode, n_steps, n_positions, n_plan; /* the step table */
  uint32_t n_pkeys, max_hit, next_reg, nwords; /* prefix keys; mask words of a run */
  double budget_fraction;
} man_seq;

typedef struct man_group {
  uint8_t kind, pad[3];  /* GROUP_* */
  uint32_t index;        /* chunk g */
  uint32_t nblocks;      /* records in the group blob */
  uint32_t pad2;
  uint64_t key[2];       /* content key (GROUP_CONTENT) */
  uint64_t alloc_bytes;  /* size-class bytes of its pages */
} man_group;
_Static_assert(sizeof(man_group) == 40, "manifest group layout");


/* ---- byte buffers ------------------------------------------------------------- */

typedef struct wbuf {
  unsigned char *p;
  size_t n, cap;
  bool oom;
  bool fixed; /* p is a slice of pinned staging (not ours to grow or free) */
} wbuf;

static inline void wput(wbuf *w, const void *src, size_t n) {
  if (w->oom) return;
  if (w->n + n > w->cap && w->fixed) {
    w->oom = true;
    return;
  }
  if (w->n + n > w->cap) {
    size_t nc = w->cap ? w->cap : 4096;
    while (nc < w->n + n) nc *= 2;
    unsigned char *np = kvp__meta_realloc(NULL, w->p, w->cap, nc);
    if (!np) {
      w->oom = true;
      return;
    }
    w->p = np;
    w->cap = nc;
  }
  if (src) memcpy(w->p + w->n, src, n);
  w->n += n;
}
static inline void wfree(wbuf *w) {
  if (!w->fixed) kvp__meta_free(NULL, w->p, w->cap);
  *w = (wbuf){0};
}

typedef struct rbuf {
  const unsigned char *p;
  size_t left;
  bool bad; /* a read past the end */
} rbuf;

static inline bool rget(rbuf *r, void *dst, size_t n) {
  if (r->bad || n > r->left) {
    r->bad = true;
    return false;
  }
  if (dst) memcpy(dst, r->p, n);
  r->p += n;
  r->left -= n;
  return true;
}

/* ---- keys and headers --------------------------------------------------------- */

typedef char key_t_[KVP__STORE_KEY_MAX];

static inline void key_manifest(kvp_store *st, uint64_t seq, char *k) {
  snprintf(k, KVP__STORE_KEY_MAX, "%sseq:%llu", kvp__store_prefix(st), (unsigned long long)seq);
}
static inline void key_part(kvp_store *st, uint64_t seq, uint64_t gen, uint32_t g, char *k) {
  snprintf(k, KVP__STORE_KEY_MAX, "%sseq:%llu:%016llx:%u", kvp__store_prefix(st), (unsigned long long)seq,
           (unsigned long long)gen, g);
}
static inline void key_content(kvp_store *st, const uint64_t *key, char *k) {
  snprintf(k, KVP__STORE_KEY_MAX, "%sblk:%016llx%016llx", kvp__store_prefix(st), (unsigned long long)key[0],
           (unsigned long long)key[1]);
}

static inline blob_hdr hdr_for(const kvp_pool *pool, uint16_t kind, uint32_t n_items, uint64_t t0, uint64_t t1) {
  const kvp_config *c = &pool->cfg;
  return (blob_hdr){BLOB_MAGIC, BLOB_VERSION, kind, c->n_layers, c->n_kv_heads, c->head_dim, pool->chunk_tokens,
                    (uint32_t)c->k_dtype | (uint32_t)c->v_dtype << 8, n_items, pool->codec_fp, 0, 0, {t0, t1}};
}

/* Seal a blob whose payload follows the header in w. */
static inline void hdr_seal(wbuf *w) {
  if (w->oom) return;
  blob_hdr h;
  memcpy(&h, w->p, sizeof h);
  h.payload_bytes = w->n - sizeof h;
  h.checksum = kvp__xxh64(w->p + sizeof h, h.payload_bytes, 0);
  memcpy(w->p, &h, sizeof h);
}

/* Check a blob's header and checksum; r then reads its payload. */
/* ---- groups of a sequence ------------------------------------------------------- */

typedef struct item {
  kvp__block *b;  /* the block */
  uint32_t lh;    /* its stream: layer * H + head */
} item;

typedef struct group {
  uint32_t index;      /* chunk g */
  uint32_t first, n;   /* its items */
  uint8_t kind;        /* GROUP_* */
  uint64_t key[2];     /* content key */
  uint64_t alloc_bytes; /* size-class bytes */
} group;

typedef struct groups {
  item *items;      /* sorted by group, then stream, then position */
  uint64_t nitems;
  group *g;         /* non-empty groups, ascending */
  uint32_t ng;
} groups;


/* Blobs on their way to the store, in two halves: one fills (its page
 * copies enqueued) while the other, sealed, is written (one pipelined SET
 * batch). On a CUDA region the halves are the pool's pinned staging
 * (pages/xfer_cuda.c) and a half is sealed once its copies landed. */
#define PUTQ_CAP 64u /* blobs per half */
typedef struct xfix {
  uint64_t blob_at, stage_at; /* a page's place in its blob, its bytes in the staging area after the blob */
  size_t bytes;
} xfix;
typedef struct xfixes {
  xfix *f;
  uint32_t n, cap;
} xfixes;
typedef struct putq {
  kvp_pool *pool;
  kvp_store *st;
  void *stream;        /* the store's stream (device copies) */
  bool dev;            /* pages staged through pinned halves */
  uint32_t cur;        /* the half being filled */
  uint32_t n[2];       /* blobs in each half */
  uint64_t bytes[2];   /* bytes each half holds (a device slot: its blob and staging area) */
  bool sealed[2];      /* the half waits to be written */
  unsigned char *pin[2]; /* device: the halves' pinned buffers */
  uint64_t pin_cap[2];   /* ... and their bytes */
  char (*keys)[KVP__STORE_KEY_MAX]; /* [2 * PUTQ_CAP] */
  wbuf *bufs;          /* [2 * PUTQ_CAP] */
  xfixes *fx;          /* device: [2 * PUTQ_CAP], each slot's page moves from its staging area at the seal */
  uint64_t written;    /* blob bytes written */
} putq;

/* Blocks parsed out of one group blob (not owned by any stream yet). */
typedef struct parsed {
  kvp__block **blk; /* [n] */
  uint32_t *lh;     /* [n]: stream of each */
  uint32_t n, cap;
  uint32_t nstaged; /* device: blobs staged so far (the half of the next: nstaged % 2) */
  void *stream;     /* device: the store's stream */
} parsed;

/* A blob's header and checksum checked against this pool; r then reads its payload. */
int kvp__blob_hdr_check(const kvp_pool *pool, const char *key, const void *data, size_t len, uint16_t kind,
                        blob_hdr *h, rbuf *r);
/* KVP_ENOTSUP naming what the store tier cannot move from this pool (what: the call). */
int kvp__store_pool_ok(kvp_pool *pool, const char *what);
/* Bytes of the group blob of items; and of its write queue slot (on a
 * CUDA region the blob, then a staging area its pages are copied to). */
uint64_t kvp__blob_group_bytes(const item *items, uint32_t n);
uint64_t kvp__blob_slot_bytes(const kvp_pool *pool, const item *items, uint32_t n);
/* The group blob of items (header tagged t0, t1) into w (q's slot, or a
 * buffer of its own with q NULL on a host region), unsealed. On a CUDA
 * region the page copies are only enqueued on q's stream, into the
 * staging area after the blob: q moves them in and seals once the stream
 * passed them. */
int kvp__blob_build_group(kvp_pool *pool, const item *items, uint32_t n, uint64_t t0, uint64_t t1, wbuf *w, putq *q);
/* Batched writes: a slot (its buffer, of bytes, and key) per blob, sealed
 * and written by the queue; flush writes what is left. free waits for
 * copies still in flight (after a failure too). */
int kvp__putq_init(putq *q, kvp_pool *pool, kvp_store *st);
int kvp__putq_slot(putq *q, uint64_t bytes, wbuf **w, char **key);
void kvp__putq_push(putq *q);
int kvp__putq_flush(putq *q);
void kvp__putq_free(putq *q);
/* Device copies the store tier enqueued are done (a failed restore or
 * fetch waits so before it frees the pages they fill). Host: nothing. */
int kvp__blob_drain(kvp_pool *pool);
/* present[i]: the store holds content chunk keys[i]. */
int kvp__store_content_present(kvp_store *st, uint32_t n, const uint64_t (*keys)[2], bool *present);
/* Count store traffic in the ledger. */
void kvp__store_count(kvp_pool *pool, uint64_t out_bytes, uint64_t in_bytes, uint64_t prefix_tokens);
/* Take the writer lock and find live sequence seq (unlocked again on failure). */
int kvp__store_lock_live(kvp_pool *pool, uint64_t seq, kvp_store *st, const char *what, kvp__seq **out);
void kvp__parsed_destroy(kvp_pool *pool, parsed *p);
void kvp__parsed_free(parsed *p);
int kvp__parsed_room(parsed *p, uint32_t n);
/* A group blob parsed into fresh blocks (pages taken and filled); on failure nothing is left taken. */
int kvp__blob_parse_group(kvp_pool *pool, uint64_t seq, const char *key, const void *data, size_t len, uint32_t index,
                          const uint64_t *tag, bool content, uint32_t expect_n, parsed *out);

#ifdef KVP_HAVE_CUDA
/* pages/xfer_cuda.c: pinned staging halves (0, 1) of a CUDA pool. buf: a
 * buffer of >= bytes for the half, once its copies are done (grown then if
 * needed); copy: n copies on stream (one batch where the runtime has it);
 * record: the half's event after them (a failure waits for the stream);
 * wait, drain: one half, both. A failed copy waits for the ones before it. */
int kvp__xfer_buf(kvp_pool *pool, uint32_t half, uint64_t bytes, unsigned char **buf, uint64_t *cap);
int kvp__xfer_copy(kvp_pool *pool, uint32_t n, void **dst, const void **src, const size_t *bytes, void *stream);
int kvp__xfer_record(kvp_pool *pool, uint32_t half, void *stream);
int kvp__xfer_wait(kvp_pool *pool, uint32_t half);
int kvp__xfer_drain(kvp_pool *pool);
/* Every copy enqueued on stream so far is done (failure paths: copies no
 * event covers yet). */
int kvp__xfer_settle(kvp_pool *pool, void *stream);
#endif

#endif /* KVP_PAGES_BLOB_H */
