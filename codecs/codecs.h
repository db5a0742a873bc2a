/*
 * codecs/codecs.h - the codecs module: the registry of codec vtables
 * (built-ins and users' own) and the codec spec parser. Codecs use nothing
 * of the pool.
 */
#ifndef KVP_CODECS_H
#define KVP_CODECS_H

#include "../util/util.h"
#include "kvpool_codec.h"

#define KVP__CODEC_SLOTS 64u /* registry capacity; ids 0..63 */
#define KVP__CODEC_RAW 0u    /* the raw codec's id */

/* The vtable of a registered id, or NULL. Lock-free (entries never change
 * once published). */
const kvp_codec_vtable *kvp__codec_get(uint32_t id);

/* The block size a codec instance prefers for mode (kvp_codec_vtable.block_tokens):
 * 0 when it has none, or when its vtable predates ABI version 2 (the member
 * is then past the end of the codec's struct and never read). */
static inline uint32_t kvp__codec_pref_block(const kvp_codec_vtable *vt, const void *inst, kvp_seq_mode mode) {
  return vt->abi_version >= 2 && vt->block_tokens ? vt->block_tokens(inst, mode) : 0;
}

/* One binding of a parsed spec: codec id and its parameter text. */
typedef struct kvp__spec_entry {
  uint32_t id;      /* registered codec */
  char *params;     /* owned (malloc): "" or "bits=2:group=32" */
} kvp__spec_entry;

/* Parse spec for n_layers: out[2 * l + kv] receives the binding of (layer l,
 * K or V); layers no clause names are raw. NULL or "" means all raw.
 *
 *   spec   := clause (';' clause)*
 *   clause := ['layers=' A['-'B] ':'] assign (',' assign)*
 *   assign := ('k' | 'v' | 'kv') '=' name (':' key '=' value)*
 *
 * Later clauses override earlier ones for the layers they name. The names
 * bf16, fp16, f16, fp32, f32 stand for raw:dtype=<name>. On error returns
 * KVP_EINVAL with a message quoting the spec and pointing at the offending
 * character; nothing is allocated then. */
int kvp__codec_spec_parse(const char *spec, uint32_t n_layers, kvp__spec_entry *out);
void kvp__codec_spec_free(kvp__spec_entry *e, uint32_t n);

/* Built-in codecs (registered at first use of the registry). */
extern const kvp_codec_vtable kvp__codec_raw;
kvp_dtype kvp__raw_store_dtype(const void *raw_inst); /* stored dtype of a raw instance */

/* An OPEN block's RAW rows read back as stored under this binding: it has
 * no decode_raw_at, or it is one that presents them unchanged (kvquant
 * without pre-RoPE keys). The device read path copies RAW rows: a CUDA pool
 * refuses a binding for which this is 0 on a layer that keeps RAW tails. */
int kvp__codec_raw_plain(const kvp_codec_vtable *vt, const void *inst);

#endif /* KVP_CODECS_H */
