/*
 * codecs/registry.c - the process-wide registry of codec vtables.
 *
 * Invariants: slots[0] is the raw codec; an id's vtable never changes once
 * published (a release store after the slot is filled), so lookups by id
 * are lock-free; names are unique. Built-ins are registered once, on first
 * use, in a fixed order so their ids are stable across runs.
 */
#include "builtin.h"
#include "codecs.h"
#include "kvquant.h"

#include <pthread.h>
#include <string.h>

static const kvp_codec_vtable *_Atomic slots[KVP__CODEC_SLOTS]; /* id -> vtable */
static pthread_mutex_t reg_lock = PTHREAD_MUTEX_INITIALIZER;        /* writers */
static pthread_once_t builtins_once = PTHREAD_ONCE_INIT;

static bool name_ok(const char *n) {
  if (!n || !*n || strlen(n) > 31) return false;
  for (const char *c = n; *c; c++)
    if (!((*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') || *c == '_' || *c == '-')) return false;
  return true;
}

static int find_locked(const char *name) {
  for (uint32_t i = 0; i < KVP__CODEC_SLOTS; i++) {
    const kvp_codec_vtable *vt = atomic_load_explicit(&slots[i], memory_order_acquire);
    if (vt && strcmp(vt->name, name) == 0) return (int)i;
  }
  return -1;
}

static int add(const kvp_codec_vtable *vt, uint32_t *id) {
  if (!vt) return kvp__err(KVP_EINVAL, "codec vtable is NULL");
  if (vt->abi_version < KVP_CODEC_ABI_MIN || vt->abi_version > KVP_CODEC_ABI_VERSION)
    return kvp__err(KVP_EINVAL, "codec \"%s\": ABI version %u, this library speaks %u..%u", vt->name ? vt->name : "?",
                    vt->abi_version, KVP_CODEC_ABI_MIN, KVP_CODEC_ABI_VERSION);
  if (!name_ok(vt->name)) return kvp__err(KVP_EINVAL, "codec name must be 1..31 of [a-z0-9_-]");
  if (!vt->create || !vt->destroy || !vt->group_tokens || !vt->layout || !(vt->encode || vt->encode_at) ||
      !(vt->decode || vt->decode_at))
    return kvp__err(KVP_EINVAL, "codec \"%s\": every vtable function is required (encode and decode may be "
                                "replaced by encode_at and decode_at)", vt->name);
  if (!vt->open_layout != !vt->encode_rows || (vt->open_layout && (!vt->encode_at || !vt->decode_at || !vt->layout_at)))
    return kvp__err(KVP_EINVAL, "codec \"%s\": open_layout and encode_rows go together, with layout_at, encode_at and "
                                "decode_at", vt->name);
  if (vt->state_bytes && !vt->encode_stateful)
    return kvp__err(KVP_EINVAL, "codec \"%s\": state_bytes needs encode_stateful", vt->name);
  pthread_mutex_lock(&reg_lock);
  int rc = KVP_OK;
  uint32_t i = 0;
  if (find_locked(vt->name) >= 0) rc = kvp__err(KVP_EEXIST, "codec \"%s\" is already registered", vt->name);
  else {
    while (i < KVP__CODEC_SLOTS && atomic_load_explicit(&slots[i], memory_order_relaxed)) i++;
    if (i == KVP__CODEC_SLOTS) rc = kvp__err(KVP_ENOSPC, "codec registry is full (%u codecs)", KVP__CODEC_SLOTS);
    else atomic_store_explicit(&slots[i], vt, memory_order_release);
  }
  pthread_mutex_unlock(&reg_lock);
  if (!rc && id) *id = i;
  return rc;
}

/* Built-ins, in id order. Later issues append here (never reorder). */
static void register_builtins(void) {
  static const kvp_codec_vtable *const builtin[] = {&kvp__codec_raw,    &kvp__codec_fp8,   &kvp__codec_int8,
                                                    &kvp__codec_kivi,   &kvp__codec_nvfp4, &kvp__codec_qvg,
                                                    &kvp__codec_qvg_pro, &kvp__codec_kvquant};
  for (size_t i = 0; i < KVP__ARRAY_LEN(builtin); i++) {
    int rc = add(builtin[i], NULL);
    kvp__assert(rc == KVP_OK);
    (void)rc;
  }
}

const kvp_codec_vtable *kvp__codec_get(uint32_t id) {
  pthread_once(&builtins_once, register_builtins);
  return id < KVP__CODEC_SLOTS ? atomic_load_explicit(&slots[id], memory_order_acquire) : NULL;
}

KVP_API int kvp_codec_register(const kvp_codec_vtable *vt, uint32_t *id) {
  pthread_once(&builtins_once, register_builtins);
  return add(vt, id);
}

KVP_API int kvp_codec_find(const char *name, uint32_t *id) {
  if (!name || !id) return kvp__err(KVP_EINVAL, "%s is NULL", name ? "id" : "name");
  pthread_once(&builtins_once, register_builtins);
  pthread_mutex_lock(&reg_lock);
  int i = find_locked(name);
  pthread_mutex_unlock(&reg_lock);
  if (i < 0) return kvp__err(KVP_ENOENT, "no codec named \"%s\" is registered", name);
  *id = (uint32_t)i;
  return KVP_OK;
}

KVP_API const kvp_codec_vtable *kvp_codec_get(uint32_t id) { return kvp__codec_get(id); }

int kvp__codec_raw_plain(const kvp_codec_vtable *vt, const void *inst) {
  if (!vt->decode_raw_at) return 1;
  return vt == &kvp__codec_kvquant && !kvp__kvq_prerope(inst);
}
