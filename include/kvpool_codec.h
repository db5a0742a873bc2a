/*
 * kvpool_codec.h - the codec plug-in ABI of kvpool.
 *
 * A codec turns the tokens of one block of one head (one of K or V) into
 * pages and back. kvpool binds one codec instance per (layer, K or V), as a
 * codec spec string says (kvp_config.codecs), and calls it:
 *
 *   create   once per binding, with the spec's parameters ("bits=2:group=32")
 *   layout   exact requested bytes of each page for a block of cap tokens
 *            (deterministic: the ledger trusts it)
 *   encode   a whole block: n rows in the appended dtype -> the pages
 *   decode   m rows starting at row t0 of a block -> rows of the out dtype
 *
 * When it encodes. In KVP_SEQ_STEP mode a block is encoded as it is
 * appended. In KVP_SEQ_STREAM mode the OPEN block holds its tokens RAW (in
 * the appended dtype) and is encoded once, when it is sealed (full); until
 * then readers see the raw tokens (presented through decode_raw_at when the
 * codec has it). Exception: a layer whose K and V codecs both build blocks
 * row by row (open_layout, encode_rows; since 0.2.0) never holds RAW
 * tails: its OPEN blocks are encoded as tokens arrive and their pages grow.
 * A codec that quantizes along the token axis sets group_tokens:
 * block_tokens must be a multiple of it, and encode may receive a last
 * group shorter than group_tokens only in step mode.
 *
 * Block sizes (since ABI version 2). With kvp_config.block_tokens = 0 the
 * pool chooses each layer's block size from its K and V codecs: the
 * largest size either prefers (block_tokens below; 16 when neither says),
 * raised to a multiple of both group_tokens. A block holds the K and the V
 * pages of its tokens, so both sides of a layer share one size;
 * kvp_pool_info reports it per layer and side.
 *
 * Page bit layouts are the codec's own and must be written in its header
 * comment. A codec knows nothing of the pool: tensors in, bytes out.
 *
 * Device ops (since 0.3.0): a codec may also encode and decode blocks that
 * live in device memory (encode_dev, decode_dev: a batch of blocks per
 * call, on a cudaStream_t passed as void *). A pool on a CUDA region
 * accepts only codecs that have both; a codec without them stays
 * host-only. Device pages must be byte-identical to what encode writes for
 * the same rows, so a view's pages decode the same on either side.
 *
 * Threads: create/destroy/encode are called under the pool's writer lock;
 * decode may be called from any reader thread concurrently, so it must not
 * write to the instance.
 *
 * Since: 0.1.0.
 */
#ifndef KVPOOL_CODEC_H
#define KVPOOL_CODEC_H

#include "kvpool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ABI versions. 1: every member up to decode_dev. 2: adds block_tokens.
 * The library reads a member only from a vtable whose abi_version has it,
 * so a codec built against an older header (a shorter struct) keeps
 * working unchanged; kvp_codec_register accepts 1..KVP_CODEC_ABI_VERSION. */
#define KVP_CODEC_ABI_VERSION 2u
#define KVP_CODEC_ABI_MIN 1u
#define KVP_CODEC_MAX_PAGES 4u /* page types one block side may use */

/* What a codec instance is bound to. */
typedef struct kvp_codec_geom {
  uint32_t head_dim;  /* elements per token */
  kvp_dtype in_dtype; /* dtype of appended tokens */
  uint32_t layer;     /* the layer of the binding */
  uint32_t kv;        /* 0 = K, 1 = V */
  /* Since 0.2.0 (appended; a pool fills them, older codecs ignore them): */
  uint32_t n_layers;   /* layers of the pool (for calibration data per layer) */
  uint32_t n_kv_heads; /* KV heads per layer (for calibration data per head) */
} kvp_codec_geom;

/* Where a block sits, for the *_at operations (since 0.2.0): the stream's
 * head, and the sequence position of the block's row 0 (row t is at
 * position pos0 + t: a block holds contiguous positions). */
typedef struct kvp_codec_block {
  uint32_t head; /* KV head of the stream, < n_kv_heads */
  uint32_t pos0; /* position of the block's row 0 */
} kvp_codec_block;

/* One block of a device batch (encode_dev, decode_dev). Every pointer is a
 * device address. Since 0.3.0. */
typedef struct kvp_codec_dev_job {
  void *pages[KVP_CODEC_MAX_PAGES]; /* the block's pages, as layout orders them */
  const void *src;                  /* encode: row 0 of the rows to write; decode: unused */
  void *dst;                        /* decode: where row t0 goes; encode: a codec with state_bytes may
                                       take it as the stream's state in device memory (NULL: start
                                       cold, keep nothing; qvg does so), others ignore it */
  uint64_t stride_bytes;            /* bytes between rows of src (encode) or dst (decode) */
  uint32_t n;                       /* rows the block holds once encoded (encode) / holds (decode) */
  uint32_t cap_tokens;              /* the block's capacity */
  uint32_t t0;                      /* first row written (encode: > 0 only for raw rows into an OPEN
                                       block) or read (decode) */
  uint32_t m;                       /* rows written (encode: n - t0) or read (decode) */
  uint32_t head;                    /* KV head of the stream (kvp_codec_block.head) */
  uint32_t pos0;                    /* position of the block's row 0 (kvp_codec_block.pos0) */
} kvp_codec_dev_job;

/* What a device encode found wrong, written by the device into a 64-bit
 * word the pool sets to KVP_DEV_STATUS_OK before the launch; each failing
 * element does atomicMin of
 *   kind << 60 | job << 32 | (row * head_dim + channel)
 * (job: index in the batch, row: of the block), so the word ends as the
 * first failure of the most serious kind. Kinds: */
#define KVP_DEV_STATUS_OK UINT64_MAX
#define KVP_DEV_BAD_NONFINITE 0u /* NaN or +-Inf in the input */
#define KVP_DEV_BAD_RANGE 1u     /* finite, but beyond what the codec's format holds */

/* Pages of one block side for cap tokens. */
typedef struct kvp_codec_layout {
  uint32_t npages;                          /* 1..KVP_CODEC_MAX_PAGES */
  kvp_page_type types[KVP_CODEC_MAX_PAGES]; /* distinct page types */
  uint64_t bytes[KVP_CODEC_MAX_PAGES];      /* exact requested bytes of each */
} kvp_codec_layout;

typedef struct kvp_codec_vtable {
  uint32_t abi_version; /* KVP_CODEC_ABI_VERSION */
  const char *name;     /* spec name, [a-z0-9_-]+, unique in the registry */
  /* Parse params (the text after "name:" in the spec, "" if none) and make
   * an instance. On bad params return KVP_EINVAL and write a message naming
   * the parameter into err (errcap bytes); *err_at may be set to the byte
   * offset in params where the problem starts. A codec that reads a data
   * file named in params (calibration) returns KVP_EFORMAT for a corrupt,
   * truncated or mismatched file, its message naming the file and field;
   * kvp_pool_create then fails with KVP_EFORMAT. */
  int (*create)(const char *params, const kvp_codec_geom *geom, void **inst, char *err, size_t errcap,
                size_t *err_at);
  void (*destroy)(void *inst);
  /* Tokens quantized together along the token axis (1 = per token). */
  uint32_t (*group_tokens)(const void *inst);
  /* Exact layout of a block of cap_tokens (1..65536). */
  void (*layout)(const void *inst, uint32_t cap_tokens, kvp_codec_layout *out);
  /* Encode n rows (src, rows src_stride bytes apart, geom.in_dtype; finite)
   * of a block of cap_tokens into pages (one per layout entry, of the
   * layout's sizes). Returns KVP_OK or KVP_ECODEC. */
  int (*encode)(const void *inst, const void *src, size_t src_stride, uint32_t n, uint32_t cap_tokens,
                void *const *pages);
  /* Decode rows [t0, t0 + m) of a block holding n tokens of cap_tokens into
   * dst (rows dst_stride bytes apart) as out dtype. */
  int (*decode)(const void *inst, const void *const *pages, uint32_t n, uint32_t cap_tokens, uint32_t t0,
                uint32_t m, void *dst, size_t dst_stride, kvp_dtype out);

  /* Optional (NULL: stateless). Bytes of state kept per stream (sequence,
   * layer, head) for this binding, e.g. warm-start centroids: zeroed when the
   * stream first encodes, carried from block to block, kept when old blocks
   * are evicted, copied when the sequence is forked, freed with it, counted
   * in the stats as bytes.codec_state. */
  size_t (*state_bytes)(const void *inst);
  /* Required with state_bytes: encode (as above) reading and updating the
   * stream's state; the pool calls it instead of encode. A failed append may
   * leave the state advanced (pages and ledger are unchanged). */
  int (*encode_stateful)(const void *inst, void *state, const void *src, size_t src_stride, uint32_t n,
                         uint32_t cap_tokens, void *const *pages);

  /* ---- Optional, since 0.2.0 (still ABI version 1: a codec that leaves
   * them NULL, e.g. one whose vtable initializer predates them, works as
   * before). For codecs whose bytes depend on where a
   * block sits: per-head calibration, sink tokens kept RAW, rotary
   * position embedding applied at decode. */

  /* Layout of a block of cap_tokens whose row 0 is at position pos0; the
   * pool calls it instead of layout for every block (layout is still
   * required: it answers for a block far from position 0, and the pool
   * checks it at create). Deterministic in (pos0, cap_tokens); it may not
   * depend on the head. */
  void (*layout_at)(const void *inst, uint32_t pos0, uint32_t cap_tokens, kvp_codec_layout *out);
  /* Encode as encode/encode_stateful, knowing the block's head and
   * position; state is the stream's state (NULL without state_bytes). The
   * pool calls it instead of encode and encode_stateful; with it set,
   * encode may be NULL (the codec then cannot encode without a position). */
  int (*encode_at)(const void *inst, const kvp_codec_block *blk, void *state, const void *src, size_t src_stride,
                   uint32_t n, uint32_t cap_tokens, void *const *pages);
  /* Decode as decode, knowing the block's head and position (a view gives
   * both: kvp_view_block.head and block_pos0). The pool calls it instead
   * of decode; with it set, decode may be NULL. */
  int (*decode_at)(const void *inst, const kvp_codec_block *blk, const void *const *pages, uint32_t n,
                   uint32_t cap_tokens, uint32_t t0, uint32_t m, void *dst, size_t dst_stride, kvp_dtype out);
  /* Host bytes of static data the instance holds (calibration: scales,
   * codebooks), fixed from create to destroy; counted in the stats as
   * bytes.codec_static. NULL: none. */
  size_t (*static_bytes)(const void *inst);
  /* Present m rows kept RAW in the appended dtype (src, rows src_stride
   * bytes apart: an OPEN block of a stream-mode sequence, before it is
   * encoded) as this codec's decode would: rows at positions blk->pos0 + t0
   * onward. For codecs whose decode transforms values by position (keys
   * stored before RoPE); the pool calls it when reading an OPEN block of a
   * layer bound to this codec. NULL: raw rows are returned as stored. */
  int (*decode_raw_at)(const void *inst, const kvp_codec_block *blk, uint32_t t0, const void *src, size_t src_stride,
                       uint32_t m, void *dst, size_t dst_stride, kvp_dtype out);

  /* Token-by-token blocks (both or neither; with encode_at, decode_at and
   * layout_at). When the K and the V codec of a layer have them, every
   * block of that layer is built row by row in the codec's pages: in step
   * mode as appended, and in stream mode the OPEN block is encoded as its
   * tokens arrive (no RAW tail, no re-encode at seal) while its pages
   * grow. Growth: the pool asks open_layout for the bytes the block needs
   * after the new rows; a page whose size class still holds them grows in
   * place, else the block moves to new pages (the old ones are retired
   * after readers leave: the ledger counts both meanwhile), and the budget
   * may refuse the append (KVP_EBUDGET, nothing changed).
   *
   * open_layout: exact bytes of each page of the block (cap_tokens, at
   * blk) once it holds n_have + n_new rows. pages hold the first n_have
   * rows (NULL when n_have = 0); src has the n_new new rows (src_stride
   * bytes apart; NULL with n_new = 0 asks the bytes of the rows held).
   * Page types and order as layout_at's; every page at least 1 byte; the
   * bytes may depend on the data (outliers over a threshold). The pool's
   * check compares every block's pages with open_layout(pages, n, NULL, 0).
   * A dry pool (KVP_POOL_DRY) holds no rows: it passes pages = NULL with
   * n_have > 0, and a codec whose bytes depend only on the row counts
   * answers as usual, while one that must read the rows it holds returns
   * KVP_ENOTSUP (kvp_pool_create of a dry pool asks once and refuses it).
   * A CUDA region holds its rows on the device: it too passes pages = NULL,
   * and src is a device address open_layout must not read (the same
   * question at create refuses a codec that needs them).
   * Returns KVP_OK, KVP_ECODEC or KVP_ENOTSUP. */
  int (*open_layout)(const void *inst, const kvp_codec_block *blk, const void *const *pages, uint32_t n_have,
                     const void *src, size_t src_stride, uint32_t n_new, uint32_t cap_tokens, kvp_codec_layout *out);
  /* Encode rows [n_have, n_have + n_new) into pages sized by open_layout
   * for n_have + n_new rows, leaving every byte that describes the first
   * n_have rows as it is (readers may be decoding them). Returns KVP_OK or
   * KVP_ECODEC. */
  int (*encode_rows)(const void *inst, const kvp_codec_block *blk, void *state, void *const *pages, uint32_t n_have,
                     const void *src, size_t src_stride, uint32_t n_new, uint32_t cap_tokens);

  /* ---- Optional, since 0.3.0: device ops (both or neither). A pool on a
   * CUDA region requires them (kvp_pool_create names a codec without
   * them). jobs is a HOST array of njobs blocks whose pointers are device
   * addresses; jobs_dev is NULL or a DEVICE copy of that array, written
   * earlier on stream (then a codec may read the jobs there, in one launch,
   * instead of passing them in kernel parameters: the pool stages large
   * batches so). The call only enqueues work on stream (a cudaStream_t,
   * NULL the legacy default stream) and returns: nothing may be read back,
   * and the jobs array may be reused as soon as it returns.
   *
   * encode_dev: encode rows [t0, t0 + m) of each job's block from src
   * (geom.in_dtype, rows stride_bytes apart) into its pages, as encode
   * would for the block's n = t0 + m rows (t0 = 0 for a codec block; the
   * pool writes rows into an OPEN block through the raw codec, or through
   * a row-wise codec below), rows n..cap_tokens-1 as encode leaves them.
   * A row-wise codec's (open_layout, encode_rows) encode_dev is
   * encode_rows' twin instead: t0 = the rows the block holds, pages sized
   * by open_layout for n rows, every byte that describes other rows left as
   * it is (a block encoded whole from t0 = 0 into zeroed pages is then
   * encode_at's). Every non-finite input element, and every element the
   * format cannot hold, is reported in *status (a device address; see
   * KVP_DEV_STATUS_OK above); the pages of such a job are then unspecified
   * (the pool frees them).
   * decode_dev: decode rows [t0, t0 + m) of each block into dst (out
   * dtype, rows stride_bytes apart), bit for bit as decode would.
   * Returns KVP_OK, KVP_EDEVICE (a launch failed; message set) or
   * KVP_ENOTSUP. The pool calls them under the same locks as their host
   * twins, and with every job's dst NULL on encode: a codec with
   * state_bytes that a pool runs on the device keeps its states itself
   * (the built-in qvg: the pool stages each stream's host state to the
   * device around the encode, through an internal path). */
  int (*encode_dev)(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev, uint32_t njobs,
                    uint64_t *status, void *stream);
  int (*decode_dev)(const void *inst, const kvp_codec_dev_job *jobs, const kvp_codec_dev_job *jobs_dev, uint32_t njobs,
                    kvp_dtype out, void *stream);

  /* ---- Optional, ABI version 2 (read only when abi_version >= 2). */

  /* Tokens per block this instance prefers for sequences of mode, when the
   * pool chooses (kvp_config.block_tokens = 0): 0 = no preference (a
   * per-token codec: the pool's 16), KVP_CODEC_WHOLE_STEP (step mode) =
   * a block is a whole step (up to 65536 tokens), for codecs whose side
   * data (centroids, per-segment scales) is paid once per block. The pool
   * takes the larger preference of a layer's K and V codecs and rounds it
   * up to a multiple of both group_tokens. NULL: no preference. */
  uint32_t (*block_tokens)(const void *inst, kvp_seq_mode mode);
} kvp_codec_vtable;

#define KVP_CODEC_WHOLE_STEP 0xFFFFFFFFu /* block_tokens: a block is a whole step */

/* Register a codec under vt->name for every pool created afterwards
 * (process-wide; vt must stay valid). Returns its id (> 0) through *id.
 * KVP_EEXIST for a taken name, KVP_EINVAL for a bad vtable or ABI version,
 * KVP_ENOSPC when the registry is full. Thread-safe. */
KVP_API int kvp_codec_register(const kvp_codec_vtable *vt, uint32_t *id);

/* Look up a registered codec by name: its id, or KVP_ENOENT. */
KVP_API int kvp_codec_find(const char *name, uint32_t *id);

/* The vtable of a registered id (e.g. a view's kvp_view_block.codec, to
 * decode pages on the host), or NULL. Lock-free. */
KVP_API const kvp_codec_vtable *kvp_codec_get(uint32_t id);

/* ------------------------------------------------------------------------
 * KVQuant calibration (the built-in codec "kvquant", spec
 * "kvquant:calib=PATH"): fit per-channel thresholds and non-uniform
 * codebooks from K and V samples and write the calibration file (format in
 * codecs/kvquant_calib.c). Since 0.2.0.
 *
 *   create     geometry, code width (2, 3, 4) and outlier fraction [0, 0.5)
 *   add        every sample token of one (layer, head, K|V) at once: n_tokens
 *              rows of head_dim floats, stride floats apart; w (same shape,
 *              >= 0: Fisher information) weighs the codebook fit, NULL = 1.
 *              Each (layer, head, side) exactly once.
 *   synthetic  add every (layer, head, side) from the built-in generator:
 *              n_seqs sequences of seq_tokens tokens (seeds seed..seed+n-1),
 *              on worker threads (set_threads), with the codebooks; no head
 *              may have been added before. All or nothing: on failure no
 *              head is added.
 *   set_threads  synthetic's workers: 0 (the default) = one per online CPU,
 *              else 1 .. KVP_KVQUANT_CALIB_MAX_THREADS. The file is the same
 *              for every count. A worker thread that cannot start leaves
 *              its share to the others (the calling thread is one). Since
 *              0.2.0.
 *   write      fit the codebooks and write the file (every head added)
 *
 * Errors: KVP_EINVAL (argument, non-finite sample, head added twice or
 * missing, file not writable; named in kvp_last_error), KVP_ENOMEM. A failed
 * add or synthetic adds nothing. Not thread-safe on one object, but for
 * one exception: adds of different (layer, side) pairs may run on
 * different threads at once (each pair is fitted apart; the file is the
 * same as from one thread), with no other call on the object meanwhile.
 * ---------------------------------------------------------------------- */
#define KVP_KVQUANT_CALIB_MAX_THREADS 64u
typedef struct kvp_kvquant_calib kvp_kvquant_calib; /* opaque */
KVP_API int kvp_kvquant_calib_create(uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim, uint32_t bits,
                                     double outlier_fraction, kvp_kvquant_calib **out);
KVP_API int kvp_kvquant_calib_add(kvp_kvquant_calib *c, uint32_t layer, uint32_t head, uint32_t kv, const float *x,
                                  const float *w, size_t stride, uint32_t n_tokens);
KVP_API int kvp_kvquant_calib_synthetic(kvp_kvquant_calib *c, uint64_t seed, uint32_t n_seqs, uint32_t seq_tokens);
KVP_API int kvp_kvquant_calib_set_threads(kvp_kvquant_calib *c, uint32_t n_threads);
KVP_API int kvp_kvquant_calib_write(kvp_kvquant_calib *c, const char *path);
KVP_API void kvp_kvquant_calib_destroy(kvp_kvquant_calib *c); /* NULL is fine */

#ifdef __cplusplus
}
#endif
#endif /* KVPOOL_CODEC_H */
