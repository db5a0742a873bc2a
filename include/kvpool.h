/*
 * kvpool.h - the public C ABI of kvpool, a KV-cache memory manager.
 *
 * kvpool manages the KV cache of a transformer serving engine the way an
 * allocator manages a heap: it reserves one region (host or CUDA), carves
 * variable-size pages out of it with a size-class allocator, keeps a strict
 * byte budget, and accounts for every byte it holds (the "ledger").
 *
 * This header is the manual. Sections:
 *   1. Versions and status codes
 *   2. Pool configuration and lifetime
 *   3. Statistics and the ledger
 *   4. Sequences, steps, append, evict, read, views
 *   5. Prefix sharing and the store tier
 *   6. Experimental: raw pages (define KVP_EXPERIMENTAL_API to see it)
 *
 * Conventions
 *   - Every call returns int: KVP_OK (0) or a negative KVP_E* status. On a
 *     failure nothing changed, and kvp_last_error() names the culprit.
 *   - Results come back through out pointers; destroy functions accept NULL.
 *   - Structs that may grow start with struct_size; fill them with the
 *     matching *_init function before use.
 *   - Thread context: calls that mutate a pool take its writer lock (one
 *     writer at a time); kvp_stats_get is lock-free.
 *
 * Glossary of abbreviations used in names
 *   sc   size class            seg  segment (tokens of one step in a stream)
 *   blk  block                 pg   page
 *   seq  sequence              kv   key/value selector (0 = K, 1 = V)
 *
 * Since: 0.1.0 unless stated.
 */
#ifndef KVPOOL_H
#define KVPOOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(KVP_BUILDING) && defined(__GNUC__)
#define KVP_API __attribute__((visibility("default")))
#else
#define KVP_API
#endif

/* ------------------------------------------------------------------------
 * 1. Versions and status codes
 * ---------------------------------------------------------------------- */

#define KVP_VERSION_MAJOR 0
#define KVP_VERSION_MINOR 1
#define KVP_VERSION_PATCH 0

/* "MAJOR.MINOR.PATCH" of the library actually linked. */
KVP_API const char *kvp_version(void);

/* Where host metadata (page tables, block records, hash tables) comes from:
 * "jemalloc" (a dedicated arena, no thread cache) or "libc" (malloc).
 * libkvpool does not link jemalloc, so any process can dlopen it (python
 * after torch, say); it uses the libjemalloc.so.2 the process already has:
 * link -ljemalloc (`pkg-config --libs kvpool` does) or preload it for the
 * arena. KVPOOL_META_MALLOC=libc in the environment forces libc; sanitizer
 * builds always use libc. Decided once per process at the first metadata
 * allocation (by this call if none happened yet), never changed after.
 * Thread-safe. Since 0.4.0. */
KVP_API const char *kvp_metadata_allocator(void);

/* X(name, value, description). Values are pinned: never renumber. */
#define KVP_STATUS_LIST(X)                                                \
  X(OK, 0, "success")                                                     \
  X(EINVAL, -1, "invalid argument")                                       \
  X(ENOMEM, -2, "out of host memory for metadata")                        \
  X(EBUDGET, -3, "the byte budget would be passed")                       \
  X(ENOSPC, -4, "the region is full")                                     \
  X(ENOENT, -5, "no such entry")                                          \
  X(EEXIST, -6, "entry already exists")                                   \
  X(EDEVICE, -7, "device (CUDA) error")                                   \
  X(ECODEC, -8, "codec error")                                            \
  X(EFORMAT, -9, "bad file format")                                       \
  X(EBUSY, -10, "busy: pinned by a reader")                               \
  X(ECORRUPT, -11, "an invariant of the pool is broken")                  \
  X(ENOTSUP, -12, "not supported")                                       \
  X(EIO, -13, "store I/O failed (connection, timeout, server)")

typedef enum kvp_status {
#define KVP__STATUS_ENUM(name, value, desc) KVP_##name = value,
  KVP_STATUS_LIST(KVP__STATUS_ENUM)
#undef KVP__STATUS_ENUM
} kvp_status;

/* Description of a status ("the byte budget would be passed"); never NULL. */
KVP_API const char *kvp_strerror(int status);
/* Name of a status ("KVP_EBUDGET"); "KVP_E?" for unknown values. */
KVP_API const char *kvp_err_name(int status);
/* Thread-local message of the last failed call on this thread, naming the
 * argument, layer, head, token or file at fault. "" if none failed yet. It is
 * not cleared by successful calls (like errno). */
KVP_API const char *kvp_last_error(void);

/* ------------------------------------------------------------------------
 * 2. Pool configuration and lifetime
 * ---------------------------------------------------------------------- */

typedef enum kvp_dtype { KVP_DTYPE_F32, KVP_DTYPE_BF16, KVP_DTYPE_F16 } kvp_dtype;
typedef enum kvp_mem { KVP_MEM_HOST, KVP_MEM_CUDA } kvp_mem;
typedef enum kvp_seq_mode { KVP_SEQ_STREAM, KVP_SEQ_STEP } kvp_seq_mode;

typedef struct kvp_pool kvp_pool; /* opaque */

/* Limits checked by kvp_pool_create. */
#define KVP_MAX_LAYERS 4096u
#define KVP_MAX_KV_HEADS 1024u
#define KVP_MAX_HEAD_DIM 4096u
#define KVP_MIN_REGION_BYTES (2u << 20)   /* one slab */
#define KVP_MAX_PAGE_BYTES 0xFFFFFFFFull   /* requested bytes of one page */

typedef struct kvp_config {
  size_t struct_size;      /* bytes; set by kvp_config_init */
  uint32_t n_layers;       /* transformer layers, 1..KVP_MAX_LAYERS */
  uint32_t n_kv_heads;     /* KV heads per layer, 1..KVP_MAX_KV_HEADS */
  uint32_t head_dim;       /* elements per head, 1..KVP_MAX_HEAD_DIM */
  kvp_dtype k_dtype;       /* dtype of appended K */
  kvp_dtype v_dtype;       /* dtype of appended V */
  kvp_mem memory;          /* where the region lives */
  int device;              /* CUDA ordinal when memory == KVP_MEM_CUDA */
  uint64_t region_bytes;   /* bytes reserved at create (rounded down to 4 KiB) */
  uint64_t budget_bytes;   /* strict cap on allocated page bytes; 0 = region */
  uint32_t block_tokens;   /* tokens per block of every layer; 0 = chosen per layer by its codecs
                              (kvp_pool_info says what): 16 for per-token codecs, a multiple of a codec's
                              token group (kivi), a whole step (step mode) or 2048 tokens (stream) for qvg */
  const char *codecs;      /* codec spec; NULL = raw */
  const char *policy;      /* policy spec; NULL = none: "window:sink=4:recent=1024" */
  uint32_t flags;          /* KVP_POOL_* */
} kvp_config;

/* kvp_config.flags */
#define KVP_POOL_PREFAULT 1u /* host region: fault every page in at create, as a device
                                allocation is backed at once (no first-touch cost later); also
                                backs at create the host metadata of the OPEN (raw) blocks the
                                region can hold (their structs and links, up to 1/25 of
                                region_bytes), counted in metadata_bytes from then on, so a
                                decode token that opens blocks takes no page fault either */
#define KVP_POOL_SANITIZE 2u /* NaN in appended K/V becomes 0 and +-Inf the dtype's largest finite value;
                                without it such an append fails with KVP_EINVAL naming layer, head, token */
#define KVP_POOL_DRY 4u      /* dry run, for capacity planning: pages are allocated, tagged and counted exactly
                                as in a normal pool (same size classes, ledger, budget decisions, per-tag stats,
                                policies and evictions), but no payload is written or read and no region memory
                                is touched. The region is an address-space reservation never faulted in
                                (PROT_NONE, MAP_NORESERVE), also for KVP_MEM_CUDA (no cudaMalloc: a dry CUDA
                                pool works in builds without CUDA and takes any codec). kvp_append validates its
                                arguments (and screens host input for NaN/Inf as usual) but copies and encodes
                                nothing; a dry CUDA pool never dereferences kv->k / kv->v. kvp_read and
                                kvp_view_acquire fail with KVP_ENOTSUP; kvp_page_describe gives addr NULL.
                                device.used_bytes is 0 (nothing is resident). Excludes KVP_POOL_PREFAULT.
                                Allocator metadata is committed lazily, so a 1 TiB dry region costs host memory
                                in proportion to what is allocated in it, not to its size. Since 0.1.0. */
#define KVP_POOL_ALLOW_EXPANSION 8u /* let a codec store more bytes per token than the appended dtype at the
                                       layer's block size (stream mode). Without it kvp_pool_create refuses such
                                       a codec with KVP_EINVAL naming it, both sizes per token and the block size
                                       from which it compresses (e.g. qvg's k-means centroids at 16 tokens).
                                       Raw codecs store the dtype they name and are never refused. */
#define KVP_POOL_DEVICE_ASYNC 16u /* CUDA pool: kvp_append enqueues its copies and encodes on kv->stream and
                                     returns without waiting for them, so the caller's stream keeps its queue.
                                     The price: non-finite K/V is not refused (the device does not report it;
                                     raw pages store it as given, quantizers as their encode rounds it). Only
                                     layers whose codecs fail on nothing else take it (raw, fp8, int8, nvfp4); an
                                     append that encodes kivi, kvquant, qvg or a user's codec still waits to read
                                     back their status, as without the flag. Host and dry pools ignore it. */

/* Fill cfg with defaults: 1 layer, 1 head, head_dim 128, bf16 K and V, host
 * memory, 64 MiB region, budget = region. */
KVP_API void kvp_config_init(kvp_config *cfg);

/* Create a pool: validate cfg, reserve the region (one mmap or one
 * cudaMalloc), set up the allocator, ledger and stats.
 * Returns KVP_OK and *out, or KVP_EINVAL (bad field, named in
 * kvp_last_error), KVP_ENOMEM, KVP_EDEVICE, KVP_ENOTSUP (CUDA region in a
 * build without CUDA), KVP_EFORMAT (a codec's data file, e.g. kvquant's
 * calibration, is corrupt, truncated or does not match the pool: the
 * message names the file and field). Thread-safe. */
KVP_API int kvp_pool_create(const kvp_config *cfg, kvp_pool **out);

/* Destroy a pool and release its region and all metadata. NULL is fine. No
 * other call on the pool may run concurrently or afterwards. */
KVP_API void kvp_pool_destroy(kvp_pool *pool);

/* What a pool chose for one layer, per side ([0] = K, [1] = V). A block
 * holds the K and the V pages of its tokens, so both sides of a layer have
 * the same block sizes. */
typedef struct kvp_layer_info {
  size_t struct_size;              /* bytes; set by kvp_layer_info_init */
  const char *codec[2];            /* codec name (static: lives as long as the registry) */
  uint32_t group_tokens[2];        /* tokens the codec quantizes together (1 = per token) */
  uint32_t block_tokens[2];        /* tokens per block of a KVP_SEQ_STREAM sequence */
  uint32_t step_block_tokens[2];   /* most tokens per block of a KVP_SEQ_STEP sequence (a block also
                                      ends with its step: 65536 means a whole step) */
  double bytes_per_token[2];       /* requested bytes per token and head of a full stream-mode block */
  double source_bytes_per_token[2]; /* head_dim x bytes of the appended dtype: the same without a codec */
} kvp_layer_info;

KVP_API void kvp_layer_info_init(kvp_layer_info *info);
/* Describe layer of pool into *out (struct_size set by kvp_layer_info_init).
 * KVP_EINVAL for a NULL argument, a small struct_size or layer >= n_layers.
 * Lock-free (what it reads is fixed at create). Since 0.1.0. */
KVP_API int kvp_pool_info(kvp_pool *pool, uint32_t layer, kvp_layer_info *out);

/* ------------------------------------------------------------------------
 * 3. Statistics and the ledger
 *
 * The ledger is the pool's byte truth. At every instant:
 *   requested <= allocated <= committed <= reserved
 *   allocated <= budget
 * requested: bytes the page layouts asked for; allocated: their size class
 * up to 32 KiB (8 B, 16 B steps to 1 KiB, then 64 classes per doubling:
 * under 16 B or 1/64 of rounding), above that the request rounded up to the
 * 4 KiB extent unit only; committed: bytes of slabs and extents in use; reserved:
 * the region. Gauges carry {current, peak, total}: total is the sum of all
 * increases. Counters carry a total.
 * ---------------------------------------------------------------------- */

/* Page types: what the bytes of a page mean. X(name, lower-case key) */
#define KVP_PAGE_TYPE_LIST(X)                                             \
  X(RAW, "raw")                                                           \
  X(CODES, "codes")                                                       \
  X(SCALES, "scales")                                                     \
  X(CENTROIDS, "centroids")                                               \
  X(ASSIGN, "assign")                                                     \
  X(OUTLIERS, "outliers")                                                 \
  X(META, "meta")

typedef enum kvp_page_type {
#define KVP__PT_ENUM(name, key) KVP_PAGE_##name,
  KVP_PAGE_TYPE_LIST(KVP__PT_ENUM)
#undef KVP__PT_ENUM
  KVP_PAGE_TYPE_COUNT
} kvp_page_type;

typedef struct kvp_gauge {
  uint64_t current; /* value now */
  uint64_t peak;    /* highest value seen */
  uint64_t total;   /* sum of all increases */
} kvp_gauge;

/* Usage of one slice of a breakdown (a page type, a K/V side, ...). */
typedef struct kvp_usage {
  uint64_t requested_bytes; /* sum of requested bytes of live pages */
  uint64_t allocated_bytes; /* sum of allocated bytes of live pages */
  uint64_t npages;          /* live pages */
} kvp_usage;

/* Every scalar figure, listed once: X(kind, field, "dotted.key", "help").
 * kind is GAUGE (kvp_gauge), COUNTER (uint64_t total) or VALUE (uint64_t,
 * a setting or a probe). The struct, JSON keys, Prometheus names and the text
 * table are all generated from this list. */
#define KVP_STATS_LIST(X)                                                          \
  X(GAUGE, bytes_requested, "bytes.requested", "bytes the page layouts asked for")  \
  X(GAUGE, bytes_allocated, "bytes.allocated", "allocated bytes of live pages")      \
  X(GAUGE, bytes_committed, "bytes.committed", "bytes of slabs and extents in use") \
  X(VALUE, bytes_reserved, "bytes.reserved", "bytes of the region")                 \
  X(VALUE, budget_bytes, "bytes.budget", "strict cap on allocated bytes")           \
  X(GAUGE, pages, "pages.live", "live pages")                                       \
  X(GAUGE, slabs, "slabs.live", "slabs carved from the region")                     \
  X(GAUGE, extents, "extents.live", "large-page extents in use")                    \
  X(COUNTER, allocs, "ops.allocs", "page allocations")                              \
  X(COUNTER, frees, "ops.frees", "page frees")                                      \
  X(COUNTER, grows, "ops.grows", "page grows")                                      \
  X(COUNTER, grow_moves, "ops.grow_moves", "grows that moved to a larger class")    \
  X(COUNTER, budget_refusals, "ops.budget_refusals", "allocations refused by the budget") \
  X(COUNTER, nospc_refusals, "ops.nospc_refusals", "allocations refused: region full") \
  X(GAUGE, metadata_bytes, "host.metadata_bytes", "host bytes of allocator and pool metadata") \
  X(GAUGE, tokens_retained, "tokens.retained", "tokens retained over all (layer, head) streams") \
  X(COUNTER, tokens_evicted, "tokens.evicted", "tokens evicted over all (layer, head) streams")  \
  X(GAUGE, bf16_equivalent_bytes, "bytes.bf16_equivalent", "retained tokens x head_dim x 2 bytes, K and V: the uncompressed baseline") \
  X(GAUGE, sequences, "sequences.live", "live sequences")                           \
  X(GAUGE, codec_state_bytes, "bytes.codec_state", "per-stream codec state (warm starts), host memory") \
  X(GAUGE, bytes_retired, "bytes.retired", "allocated bytes of unlinked blocks waiting for readers (RCU grace period)") \
  X(VALUE, device_used_bytes, "device.used_bytes", "device-level bytes in use (cudaMemGetInfo, or resident bytes of a host region)") \
  X(VALUE, device_total_bytes, "device.total_bytes", "device capacity (GPU memory, or the host region)") \
  X(VALUE, codec_static_bytes, "bytes.codec_static", "static codec data (calibration: per-channel scales, codebooks), host memory") \
  X(COUNTER, prefix_query_tokens, "prefix.query_tokens", "prompt tokens of sequences added with their token ids") \
  X(COUNTER, prefix_hit_tokens, "prefix.hit_tokens", "prompt tokens attached from shared blocks of the pool (not recomputed)") \
  X(GAUGE, prefix_chunks, "prefix.chunks", "entries of the prefix table (chunks of L x H shareable blocks)") \
  X(COUNTER, store_offload_bytes, "store.offload_bytes", "blob bytes written to a store (offload, publish)") \
  X(COUNTER, store_restore_bytes, "store.restore_bytes", "blob bytes read from a store (restore, prefix fetch)") \
  X(COUNTER, store_prefix_tokens, "store.prefix_tokens", "prompt tokens attached from a store's published prefix blocks") \
  X(VALUE, device_control_bytes, "device.control_bytes", "device memory a CUDA pool holds beside its region (status words, job stage, codec tables, qvg workspace)") \
  X(VALUE, host_pinned_bytes, "host.pinned_bytes", "pinned host memory a CUDA pool holds (status copy, job stage, block-table stages, kept attention tables' records, store staging)")

typedef struct kvp_stats {
  size_t struct_size; /* bytes; set by the caller (sizeof(kvp_stats)) */
  uint32_t version;   /* KVP_STATS_VERSION of the library that filled it */
#define KVP__STATS_FIELD_GAUGE(f) kvp_gauge f;
#define KVP__STATS_FIELD_COUNTER(f) uint64_t f;
#define KVP__STATS_FIELD_VALUE(f) uint64_t f;
#define KVP__STATS_FIELD(kind, f, key, help) KVP__STATS_FIELD_##kind(f)
  KVP_STATS_LIST(KVP__STATS_FIELD)
#undef KVP__STATS_FIELD
  kvp_usage page_types[KVP_PAGE_TYPE_COUNT]; /* breakdown by page type */
  kvp_usage kv[2];                           /* breakdown by side: 0 = K, 1 = V */
} kvp_stats;

#define KVP_STATS_VERSION 1u

/* Dimensions of a breakdown, for kvp_stats_breakdown. */
typedef enum kvp_stats_dim {
  KVP_DIM_PAGE_TYPE, /* index: kvp_page_type */
  KVP_DIM_KV,        /* index: 0 = K, 1 = V */
  KVP_DIM_LAYER,     /* index: layer */
  KVP_DIM_HEAD,      /* index: KV head */
  KVP_DIM_CODEC,     /* index: codec id */
  KVP_DIM_SEQ        /* index: sequence id */
} kvp_stats_dim;

/* Snapshot of the ledger and the fixed breakdowns, lock-free (the ledger is
 * read under a sequence lock, so its figures are mutually consistent).
 * out->struct_size must be set. Returns KVP_OK or KVP_EINVAL. */
KVP_API int kvp_stats_get(kvp_pool *pool, kvp_stats *out);

/* One slice of a breakdown. KVP_ENOENT for an index out of range (or a
 * sequence holding no pages). Lock-free. */
KVP_API int kvp_stats_breakdown(kvp_pool *pool, kvp_stats_dim dim, uint64_t index,
                                kvp_usage *out);

/* The usage of one sequence: the pages it allocated (a page shared by a
 * fork counts under the sequence that allocated it). */
typedef struct kvp_seq_usage {
  uint64_t seq;    /* sequence id */
  kvp_usage usage; /* its live pages */
} kvp_seq_usage;

/* The top-N sequences by allocated bytes: up to n sequences holding pages,
 * largest first (ties: lower id first), into out[0..*n_out). Lock-free
 * (read under RCU, so it may run beside the writer; each entry is
 * consistent, the set is a snapshot of one table walk). Cost: one pass over
 * the per-sequence table, O(sequences x log n), no allocation. n = 0 is
 * fine (*n_out = 0). KVP_EINVAL for NULL pool or n_out, or NULL out with
 * n > 0. Since 0.1.0. */
KVP_API int kvp_stats_top_sequences(kvp_pool *pool, uint32_t n, kvp_seq_usage *out, uint32_t *n_out);

typedef enum kvp_stats_format { KVP_STATS_JSON, KVP_STATS_PROMETHEUS, KVP_STATS_TEXT } kvp_stats_format;

/* Write the stats in a format into buf (cap bytes, NUL-terminated). *len gets
 * the full length without the NUL; if it is >= cap the output was truncated
 * and the call returns KVP_ENOSPC (call again with a larger buffer; buf may be
 * NULL with cap 0 to ask for the length). Lock-free. The keys, metric names
 * and labels of each format are listed in docs/telemetry.md; JSON keys and
 * Prometheus names are stable (new ones may be added, none renamed). */
KVP_API int kvp_stats_write(kvp_pool *pool, kvp_stats_format fmt, char *buf, size_t cap,
                            size_t *len);

/* Verify every invariant of the pool from scratch: walk every slab, extent
 * and page, re-derive the ledger and every breakdown, and compare. Returns
 * KVP_OK or KVP_ECORRUPT with the first broken invariant in kvp_last_error.
 * Takes the writer lock; cost is linear in pages and metadata. */
KVP_API int kvp_check(kvp_pool *pool);

/* ------------------------------------------------------------------------
 * 4. Sequences, steps, append, evict, read, views
 *
 * A sequence holds L x H streams, one per (layer, KV head). Tokens arrive in
 * steps: kvp_step_begin(seq, n), then kvp_append once per layer in layer
 * order with the step's n tokens, then kvp_step_end. Steps are numbered from
 * 0 in the order they begin; a token's position is its index in the
 * sequence. A (layer, head, step) unit can be evicted; in KVP_SEQ_STEP mode
 * its bytes are freed exactly (blocks never straddle steps); in
 * KVP_SEQ_STREAM mode blocks fill across steps and a block's bytes are
 * freed once none of its tokens is retained and it is sealed.
 *
 * Readers (kvp_read, kvp_view_acquire, kvp_seq_info) are lock-free under RCU
 * and may run on any thread concurrently with the writer; every other call
 * here takes the writer lock.
 * ---------------------------------------------------------------------- */

#define KVP_MAX_STEP_TOKENS (1u << 24) /* tokens of one step */
#define KVP_MAX_SEQ_TOKENS 0xFFFFFFF0u  /* positions of one sequence */

typedef struct kvp_seq_config {
  size_t struct_size;           /* bytes; set by kvp_seq_config_init */
  kvp_seq_mode mode;            /* KVP_SEQ_STREAM (default) or KVP_SEQ_STEP */
  const uint32_t *step_tokens;  /* planned tokens per step, when known (VAR scales); copied */
  uint32_t n_steps;             /* entries of step_tokens (0 = no plan) */
  double budget_fraction;       /* per-sequence policy budget, 0 = none (policies) */
  const char *policy;           /* policy spec for this sequence; NULL = the pool's (copied) */
  const uint32_t *tokens;       /* the prompt's token ids, for prefix sharing (copied as keys); may be NULL */
  uint32_t n_tokens;            /* entries of tokens */
} kvp_seq_config;

/* Defaults: stream mode, no plan, no budget fraction. */
KVP_API void kvp_seq_config_init(kvp_seq_config *sc);

/* Add a sequence with the caller's 64-bit id (any value). sc NULL = stream
 * mode. KVP_EEXIST if the id is live; KVP_EINVAL for a bad config. */
KVP_API int kvp_seq_add(kvp_pool *pool, uint64_t seq, const kvp_seq_config *sc);
/* Free a sequence and every page only it holds (shared blocks stay with
 * their other owners; pinned blocks go when their last view is released).
 * Allowed inside a step (the step is dropped). KVP_ENOENT if unknown. */
KVP_API int kvp_seq_free(kvp_pool *pool, uint64_t seq);
/* Fork parent into a new sequence child: sealed blocks are shared by
 * reference count, the OPEN block of each stream is copied. Not inside a
 * step of the parent (KVP_EBUSY). All or nothing: KVP_EBUDGET/KVP_ENOSPC if
 * the copies do not fit, KVP_EEXIST if child is live, KVP_ENOENT if the
 * parent is not. */
KVP_API int kvp_seq_fork(kvp_pool *pool, uint64_t parent, uint64_t child);

#define KVP_STEP_SCENE_CUT 1u /* flag for policies (multishot): a new shot begins */

/* Begin a step of n_tokens (1..KVP_MAX_STEP_TOKENS) for seq. With a planned
 * schedule, n_tokens must match the plan for the step's index. KVP_EBUSY if
 * a step is already open. */
KVP_API int kvp_step_begin(kvp_pool *pool, uint64_t seq, uint32_t n_tokens, uint32_t flags);

typedef struct kvp_kv {
  const void *k, *v; /* [n_tokens][n_kv_heads][head_dim], contiguous, config dtypes, pool memory */
  void *stream;      /* cudaStream_t for KVP_MEM_CUDA, else NULL */
} kvp_kv;

/* Append layer's K and V for the open step (n tokens of the step). Layers
 * must come in order 0, 1, ..., L-1, each once. All or nothing: on any
 * failure (budget, region, bad input) the pool is as before and the same
 * layer may be appended again. Buffers must be aligned to their dtype.
 * With a CUDA region the copies are ordered on kv->stream. */
KVP_API int kvp_append(kvp_pool *pool, uint64_t seq, uint32_t layer, const kvp_kv *kv);
/* End the open step; every layer must have been appended. */
KVP_API int kvp_step_end(kvp_pool *pool, uint64_t seq);
/* Evict the tokens of one step from one (layer, head). KVP_ENOENT if that
 * unit is not retained (never appended, or evicted already). Freed bytes
 * leave the ledger before the call returns (it waits for an RCU grace
 * period: readers in flight finish first). */
KVP_API int kvp_evict(kvp_pool *pool, uint64_t seq, uint32_t layer, uint32_t head, uint32_t step);

typedef struct kvp_read_req {
  size_t struct_size;      /* sizeof(kvp_read_req) */
  uint32_t head;           /* KV head to read */
  kvp_dtype out_dtype;     /* dtype of k_out/v_out */
  void *k_out, *v_out;     /* [capacity_tokens][head_dim], pool memory space; either may be NULL */
  uint32_t *positions_out; /* host, [capacity_tokens]: positions of the tokens read; may be NULL */
  uint32_t capacity_tokens; /* rows the buffers hold */
  uint32_t n_tokens;       /* out: tokens written (or needed, on KVP_ENOSPC) */
  void *stream;            /* cudaStream_t for KVP_MEM_CUDA, else NULL */
} kvp_read_req;

/* Read (dequantize) the retained tokens of one head of (seq, layer) in
 * position order. Lock-free. If capacity_tokens is too small, returns
 * KVP_ENOSPC with req->n_tokens = tokens needed and writes nothing. */
KVP_API int kvp_read(kvp_pool *pool, uint64_t seq, uint32_t layer, kvp_read_req *req);

/* One retained token range of one block, for kernels that read pages
 * directly. page[kv][type] is the page's first byte (NULL if the block has
 * no page of that type); token i of the block is at a layout-defined offset
 * (raw: i x row bytes). */
typedef struct kvp_view_block {
  uint32_t head;              /* KV head */
  uint32_t block_pos0;        /* position of the block's token 0 */
  uint32_t first;             /* first retained token (index within the block) */
  uint32_t n_tokens;          /* retained tokens from first on */
  uint32_t cap_tokens;        /* the block's capacity: a page's bytes per token = page_bytes / cap_tokens
                                 for per-token layouts (raw: row bytes, so the stored dtype follows) */
  uint32_t codec[2];          /* codec id of K and V pages */
  const void *page[2][KVP_PAGE_TYPE_COUNT];     /* [0 = K, 1 = V][page type] */
  uint64_t page_bytes[2][KVP_PAGE_TYPE_COUNT];  /* requested bytes of each page */
} kvp_view_block;

typedef struct kvp_view {
  uint64_t seq;                   /* sequence */
  uint32_t layer;                 /* layer */
  uint32_t n_blocks;              /* entries in blocks */
  const kvp_view_block *blocks;   /* by head, then position */
} kvp_view;

/* Pin the blocks of (seq, layer) and describe them. Lock-free. Pinned
 * blocks stay valid after eviction (new reads no longer see them) and
 * return their bytes when the last pin is released. */
KVP_API int kvp_view_acquire(kvp_pool *pool, uint64_t seq, uint32_t layer, kvp_view **out);
/* Release a view (NULL is fine). */
KVP_API void kvp_view_release(kvp_pool *pool, kvp_view *view);

/* ---- Paged gather (CUDA regions; since 0.3.0) ------------------------------
 * Decode the retained tokens of many (seq, layer) pairs, every KV head,
 * into contiguous bf16 device buffers: what an engine calls before running
 * its own attention kernel over a dense K/V.
 *
 * Output: k_out and v_out are bf16 [capacity_rows][n_kv_heads][head_dim].
 * Item i occupies rows [row0, row0 + n_rows) (set by the call, items in
 * order, no gaps); row row0 + r of head h is the r-th retained token of
 * that head, in position order, and positions_out[(row0 + r) * n_kv_heads
 * + h] is its position. After per-head eviction the heads of one layer
 * hold different counts: n_rows is the largest, and the rows a head does
 * not fill are zeros with position UINT32_MAX.
 *
 * Work: the block table is built on the host under RCU, copied to
 * workspace (device memory of the caller, at least workspace_needed bytes)
 * in one transfer, then one kernel launch per distinct layer decodes K and
 * V of every block of that layer (raw, fp8, int8, kivi, nvfp4; a
 * third-party device codec costs a launch per 320 blocks instead). Ordered
 * on stream; the call returns before the device finished.
 *
 * KVP_ENOSPC: capacity_rows (n_rows says how many are needed) or the
 * workspace (workspace_needed says how much) is too small; nothing was
 * written. KVP_ENOTSUP on a host region. Lock-free, like kvp_read. */
typedef struct kvp_gather_item {
  uint64_t seq;    /* in: sequence */
  uint32_t layer;  /* in: layer */
  uint32_t row0;   /* out: first output row of this item */
  uint32_t n_rows; /* out: its rows (the most tokens any of its heads retains) */
} kvp_gather_item;

typedef struct kvp_gather_req {
  size_t struct_size;         /* sizeof(kvp_gather_req) */
  kvp_gather_item *items;     /* [n_items] */
  uint32_t n_items;
  void *k_out, *v_out;        /* device, bf16 [capacity_rows][n_kv_heads][head_dim]; 16-byte aligned */
  uint32_t *positions_out;    /* host, [capacity_rows][n_kv_heads]; may be NULL */
  uint32_t capacity_rows;     /* rows the buffers hold */
  void *workspace;            /* device scratch for the block table */
  uint64_t workspace_bytes;   /* its size */
  uint32_t n_rows;            /* out: rows written (or needed, on KVP_ENOSPC) */
  uint32_t n_launches;        /* out: kernel launches made */
  uint64_t workspace_needed;  /* out: bytes of workspace this call needs */
  void *stream;               /* cudaStream_t */
} kvp_gather_req;

KVP_API void kvp_gather_req_init(kvp_gather_req *req);
KVP_API int kvp_gather(kvp_pool *pool, kvp_gather_req *req);

/* Decode attention over the pool's pages (CUDA region): for each sequence
 * of the batch and each query head, softmax(scale * q K^T) V over exactly
 * the tokens its KV head retains in layer (after per-head evictions each
 * head attends over its own tokens: nothing masked, nothing padded). The
 * kernel reads the codes and dequantizes in registers (every built-in
 * codec, sealed and OPEN blocks, mixed codecs of K and V). GQA: n_q_heads a
 * multiple of the pool's n_kv_heads, at most 8 query heads per KV head;
 * head_dim 32, 64, 128 or 256. A head that retains no token gives zeros.
 *
 * The block table is built on the host under the pool's read lock and
 * copied into workspace with one transfer (for raw bf16, fp8, int8, nvfp4
 * and kivi pages at head_dim 64 and 128, while the table sits in the
 * pool's pinned stage, only its split index is copied and the kernel reads
 * the records from the stage as it runs; the stage is reused once the
 * kernels ended); the kernels are enqueued on stream and the call returns
 * (pages evicted meanwhile are reused only after the device drained). A
 * layer keeps its last table: a call for the same batch while the pool's
 * structure has not changed (only tokens into OPEN blocks since) redoes
 * each head's last record and, where the kernel reads records in place,
 * copies nothing: the records, splits and index stay in pinned host memory
 * the pool holds (counted in host.pinned_bytes) and the workspace holds the
 * partial results alone, so its workspace_needed is smaller than that of a
 * call that builds: size the
 * workspace for the larger, or grow it on KVP_ENOSPC. Too small a
 * workspace: KVP_ENOSPC with workspace_needed set, nothing enqueued. */
typedef struct kvp_attend_req {
  size_t struct_size;         /* sizeof(kvp_attend_req) */
  uint32_t layer;             /* in */
  const uint64_t *seqs;       /* in: [batch] sequence ids (host) */
  uint32_t batch;
  uint32_t n_q_heads;         /* in: query heads */
  const void *q;              /* in: device bf16 [batch][n_q_heads][head_dim], 16-byte aligned */
  float scale;                /* in: softmax scale (e.g. 1/sqrt(head_dim)); finite */
  void *out;                  /* out: device [batch][n_q_heads][head_dim] of out_dtype, 16-byte aligned */
  kvp_dtype out_dtype;        /* in: KVP_DTYPE_BF16 (default) or KVP_DTYPE_F32 */
  void *workspace;            /* in: device scratch (block table, partial results), 16-byte aligned */
  uint64_t workspace_bytes;
  uint32_t split_tokens;      /* in: tokens per thread block's split; 0: chosen to fill the device */
  uint64_t workspace_needed;  /* out: bytes of workspace this call needs */
  uint32_t n_splits;          /* out: thread blocks of the main launch */
  uint64_t token_heads;       /* out: (token, KV head) pairs attended */
  uint64_t bytes_read;        /* out: bytes of pages the kernel reads (codes, scales, metadata) */
  void *stream;               /* cudaStream_t */
} kvp_attend_req;

KVP_API void kvp_attend_req_init(kvp_attend_req *req);
KVP_API int kvp_attend_decode(kvp_pool *pool, kvp_attend_req *req);

typedef struct kvp_seq_desc {
  size_t struct_size;          /* sizeof(kvp_seq_desc) */
  kvp_seq_mode mode;           /* out: mode */
  uint32_t n_steps;            /* out: steps begun */
  uint32_t n_positions;        /* out: tokens appended (positions used) */
  int in_step;                 /* out: a step is open */
  uint64_t tokens_retained;    /* out: sum over streams */
  uint64_t tokens_evicted;     /* out: sum over streams */
  uint32_t *retained_tokens;   /* in, optional: [n_layers * n_kv_heads] per (layer, head) */
  uint32_t *evicted_tokens;    /* in, optional: [n_layers * n_kv_heads] */
  kvp_usage page_types[KVP_PAGE_TYPE_COUNT]; /* out: pages this sequence references */
} kvp_seq_desc;

/* Wait for an RCU grace period and return every retired block (evicted,
 * freed, or replaced when an OPEN block was sealed and encoded) to the
 * allocator. Retired bytes stay allocated (bytes.retired) until then; the
 * pool reclaims by itself when an allocation would not fit, at evict and
 * free, and at step end once they pass max(1 MiB, budget / 256). This call
 * also empties the allocator's caches of free slots and large extents and
 * returns its empty slabs, so committed bytes fall to what live pages hold
 * (the pool does so by itself before it would answer KVP_ENOSPC). */
KVP_API int kvp_reclaim(kvp_pool *pool);

/* Describe a sequence. Lock-free. Shared blocks count in every sequence
 * that references them (the ledger and the per-sequence stats count them
 * once, under the sequence that allocated them). */
KVP_API int kvp_seq_info(kvp_pool *pool, uint64_t seq, kvp_seq_desc *info);

/* ------------------------------------------------------------------------
 * 5. Prefix sharing and the store tier (since 0.4.0)
 *
 * Prefix sharing. A sequence added with its prompt's token ids
 * (kvp_seq_config.tokens) gets a content key per full block of the prompt,
 * chained: key(i) = H(key(i - 1), tokens of block i), seeded with the pool's
 * geometry and codec spec, the same for every layer. Sealed, full blocks of
 * such a prompt, once every (layer, head) holds them, enter the pool's
 * prefix table at the kvp_step_end that completes them. A later kvp_seq_add
 * whose prompt starts with the same tokens attaches the longest run of them
 * as its step 0 (at most n_tokens - 1 tokens, so one is left to compute):
 * kvp_seq_info's n_positions says how many; append from there. Attached
 * blocks are shared: their pages count once in the ledger. An attach costs
 * one reference per chunk (the table entry owns the chunk's blocks of every
 * layer and head; the sequence, and any fork of it, holds the entry), so
 * kvp_seq_add with a hit costs the keys, one probe and one reference per
 * chunk. An eviction or free by one sequence drops only its own reference
 * (an eviction over an attached chunk first takes the sequence's own
 * reference on each of the chunk's blocks, once); an entry leaves the table
 * with the last sequence that holds it. Sharing needs a sequence without a
 * policy and codecs without per-stream state (qvg's warm start); otherwise
 * the tokens are only counted. Stats: prefix.query_tokens,
 * prefix.hit_tokens, prefix.chunks.
 *
 * The store tier. A store is a byte-blob service outside the pool; Redis
 * (through hiredis) is the first backend. A sequence offloaded to it leaves
 * the pool (its blocks written as checked blobs, then freed); restored, it
 * comes back whole under the same id. Prefix blocks are written under their
 * content key, so another pool (in another process, with the same geometry
 * and codec spec) attaches them instead of recomputing (kvp_prefix_fetch).
 * Blobs carry a format version, the geometry, a codec fingerprint, the
 * layouts and positions of their blocks and an XXH64 checksum; all of it is
 * checked before a byte is used. Every failure (server down or killed
 * midway, timeout, missing, truncated or corrupt blob, another version,
 * geometry or codec) returns a status whose message names the store key,
 * and leaves the pool exactly as it was. Works on host and CUDA regions: on
 * a CUDA region the pages go through two pinned host buffers of the pool
 * (cudaHostAlloc'd at the first transfer, grown when a blob needs it, freed
 * at pool destroy, counted in host.pinned_bytes), copied asynchronously on
 * the store's stream (kvp_store_set_stream): an offload copies one batch of
 * blobs while it writes the batch before; a restore or fetch copies one
 * blob's pages while it reads and checks the next.
 * Not supported (KVP_ENOTSUP, by name): dry pools, sequences or pools with a
 * policy, row-wise codecs (kvquant). Calls on one store come from one
 * thread at a time; the pool's writer lock is held for the whole transfer.
 * ---------------------------------------------------------------------- */

typedef struct kvp_store kvp_store; /* opaque */

/* Connect to a store by URL:
 *   redis://[host][:port][/db][?opt=value&...]   (default 127.0.0.1:6379, db 0)
 *   unix:///path/to/redis.sock[?db=N&...]
 * Options: prefix=STR (key prefix, default "kvp:"), ttl=SECONDS (blob
 * lifetime, 0 = none, the default), max_bytes=N[K|M|G|T] (a cap on the
 * server's memory, see below; 0 = none, the default), timeout_ms=N (connect
 * and each reply, default 5000). KVP_EINVAL for a bad URL (the part named),
 * KVP_EIO when the server cannot be reached, KVP_ENOTSUP in a build without
 * hiredis.
 *
 * Bounding the store. Published prefixes and offloaded sequences take the
 * server's memory; nothing in kvpool deletes a published prefix (other
 * pools may be using it). Two bounds, best together:
 *   - ttl=: every blob expires that many seconds after it was written (a
 *     published chunk written again by a later publish or offload is not
 *     rewritten, so it still expires on time: publish again to keep it);
 *   - max_bytes=: before each batch of writes, the server's used_memory
 *     (INFO memory: everything the server holds, not only this pool's keys)
 *     plus the batch's bytes must stay within the cap, else the batch is
 *     refused with KVP_ENOSPC naming the key, the server's use and the cap.
 *     kvp_seq_offload then fails as any other store failure does (nothing
 *     freed, what it wrote deleted): swap by recompute instead;
 *     kvp_prefix_publish stops there (the chunks before stay published,
 *     *published_tokens says how many tokens the store holds): the
 *     prefix is simply not shared through the store.
 * Reads (restore, fetch) and deletes are never refused. A server with its
 * own maxmemory and an evicting policy works too: an evicted blob reads as
 * missing (KVP_ENOENT, the pool unchanged). */
KVP_API int kvp_store_open(const char *url, kvp_store **out);
/* Close the connection; NULL is fine. */
KVP_API void kvp_store_close(kvp_store *st);
/* Value bytes this store handle sent and received since it was opened
 * (a SET counts once the server acknowledged it). Safe to call from any
 * thread, also while another thread transfers through st (a monitor). */
KVP_API int kvp_store_traffic(kvp_store *st, uint64_t *sent_bytes, uint64_t *received_bytes);
/* The CUDA stream (cudaStream_t) on which transfers through st copy the
 * pages of a CUDA pool; NULL (the default) is the legacy default stream.
 * An offload's copies follow the work enqueued on it before the call (the
 * appends that wrote the pages), and the call waits for them (an event of
 * its own, no device-wide synchronization) before the bytes are checksummed
 * and sent. A restore or fetch returns once its copies are enqueued: work
 * on the same stream sees the pages; work on another stream must wait for
 * this one first. A failed transfer waits for the copies it enqueued
 * before it frees their pages. Ignored for host pools. KVP_EINVAL (st NULL),
 * KVP_ENOTSUP in a build without hiredis. Since 0.1.0. */
KVP_API int kvp_store_set_stream(kvp_store *st, void *stream);

/* Write seq's blocks, step table, runs and codec states to st, then free
 * the sequence from the pool (it no longer exists there until restored).
 * Prefix chunks go under their content key (skipped when the store holds
 * them already); the rest under keys of this offload; the manifest
 * (<prefix>seq:<id>) last. On failure nothing is freed (what was written
 * under this offload's keys is deleted where the server allows). KVP_EBUSY
 * inside a step; KVP_EIO; KVP_ENOSPC (the store's max_bytes); KVP_ENOTSUP
 * (see above). */
KVP_API int kvp_seq_offload(kvp_pool *pool, uint64_t seq, kvp_store *st);
/* Bring an offloaded sequence back under the same id, all or nothing, then
 * delete its keys from the store (content chunks stay, for others). Chunks
 * the pool's prefix table holds are shared instead of read. KVP_ENOENT (no
 * manifest, or a blob missing), KVP_EEXIST (id live), KVP_EFORMAT (a blob is
 * truncated, corrupt, of another version, geometry or codec spec),
 * KVP_EBUDGET / KVP_ENOSPC, KVP_EIO. */
KVP_API int kvp_seq_restore(kvp_pool *pool, uint64_t seq, kvp_store *st);
/* Write seq's prompt chunks that are in the prefix table to the store under
 * their content keys (those already there are not sent again).
 * *published_tokens (may be NULL): prompt tokens the store now holds.
 * KVP_ENOSPC when the store's max_bytes stops it (*published_tokens: what
 * the store holds all the same); KVP_EIO. The pool is never changed. */
KVP_API int kvp_prefix_publish(kvp_pool *pool, uint64_t seq, kvp_store *st, uint32_t *published_tokens);
/* Attach the next chunks of seq's prompt from the store's published
 * prefix, as one new step, stopping at the first chunk the store lacks:
 * call right after kvp_seq_add (which attached what the pool itself held).
 * All or nothing; *fetched_tokens (may be NULL) gets the tokens attached. */
KVP_API int kvp_prefix_fetch(kvp_pool *pool, uint64_t seq, kvp_store *st, uint32_t *fetched_tokens);

/* ------------------------------------------------------------------------
 * 6. Experimental: raw pages
 *
 * Engines that lay out their own pages can use the pool as a byte allocator
 * directly: allocate a tagged page, learn its address, grow it, free it. The
 * pages count in the ledger and in kvp_check like any other. Define
 * KVP_EXPERIMENTAL_API before including this header to use these calls; they
 * may change in a minor release.
 * ---------------------------------------------------------------------- */
#ifdef KVP_EXPERIMENTAL_API

typedef uint64_t kvp_page_id; /* 0 is never a valid id */

typedef struct kvp_page_tag {
  uint64_t seq;         /* sequence the page belongs to */
  uint32_t layer;       /* < n_layers */
  uint32_t head;        /* < n_kv_heads */
  kvp_page_type type;   /* page type */
  uint32_t kv;          /* 0 = K, 1 = V */
  uint32_t codec;       /* codec id (0 = raw) */
} kvp_page_tag;

typedef struct kvp_page_desc {
  void *addr;               /* first byte (host or device address) */
  uint64_t requested_bytes; /* what was asked */
  uint64_t allocated_bytes; /* its size class (<= 32 KiB) or extent size (4 KiB units) */
} kvp_page_desc;

/* Allocate a page of bytes (1..KVP_MAX_PAGE_BYTES) with a tag. Errors:
 * KVP_EINVAL (size, tag), KVP_EBUDGET (allocated + class size > budget),
 * KVP_ENOSPC (no room in the region), KVP_ENOMEM. Writer lock. */
KVP_API int kvp_page_alloc(kvp_pool *pool, uint64_t bytes, const kvp_page_tag *tag,
                           kvp_page_id *out);
/* Free a page. KVP_ENOENT for an id that is not live (double free, foreign). */
KVP_API int kvp_page_free(kvp_pool *pool, kvp_page_id id);
/* Grow (or shrink) a page's requested size to bytes, keeping its first
 * min(old, new) bytes. Stays in place when the class still fits, else moves
 * to a larger class (the ledger counts both pages during the move, so the
 * budget must hold both). The id stays valid; the address may change. */
KVP_API int kvp_page_grow(kvp_pool *pool, kvp_page_id id, uint64_t bytes);
/* Address and sizes of a live page. */
KVP_API int kvp_page_describe(kvp_pool *pool, kvp_page_id id, kvp_page_desc *out);

#endif /* KVP_EXPERIMENTAL_API */

#ifdef __cplusplus
}
#endif
#endif /* KVPOOL_H */
