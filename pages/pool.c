/*
 * pages/pool.c - the pool: configuration, lifetime, statistics and the full
 * check that ties region, allocator, ledger and pages together.
 *
 * Invariants checked by kvp_check (DESIGN.md section 4):
 *   sum over live pages of requested = ledger.requested
 *   live pages walked = ledger.pages
 *   every breakdown (page type, K/V, codec, layer, head, sequence) equals
 *   the sum over live pages of that slice
 *   the page tables hold (runs, streams, blocks, owners: kvp__seqs_check)
 *   plus everything kvp__alloc_check verifies (allocated, committed, budget)
 */
#include "../codecs/numeric.h"
#include "policy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

KVP_API void kvp_config_init(kvp_config *cfg) {
  if (!cfg) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->struct_size = sizeof *cfg;
  cfg->n_layers = 1;
  cfg->n_kv_heads = 1;
  cfg->head_dim = 128;
  cfg->k_dtype = KVP_DTYPE_BF16;
  cfg->v_dtype = KVP_DTYPE_BF16;
  cfg->memory = KVP_MEM_HOST;
  cfg->region_bytes = 64ull << 20;
}

static bool dtype_ok(kvp_dtype d) { return d == KVP_DTYPE_F32 || d == KVP_DTYPE_BF16 || d == KVP_DTYPE_F16; }

static int validate(const kvp_config *in, kvp_config *c) {
  if (!in) return kvp__err(KVP_EINVAL, "config is NULL");
  if (in->struct_size == 0) return kvp__err(KVP_EINVAL, "config.struct_size is 0: call kvp_config_init first");
  if (in->struct_size > sizeof *c)
    return kvp__err(KVP_EINVAL, "config.struct_size %zu is larger than this library's %zu (newer header?)",
                    in->struct_size, sizeof *c);
  kvp_config_init(c);
  memcpy(c, in, in->struct_size);
  c->struct_size = sizeof *c;
  if (c->n_layers == 0 || c->n_layers > KVP_MAX_LAYERS)
    return kvp__err(KVP_EINVAL, "config.n_layers = %u: must be 1..%u", c->n_layers, KVP_MAX_LAYERS);
  if (c->n_kv_heads == 0 || c->n_kv_heads > KVP_MAX_KV_HEADS)
    return kvp__err(KVP_EINVAL, "config.n_kv_heads = %u: must be 1..%u", c->n_kv_heads, KVP_MAX_KV_HEADS);
  if (c->head_dim == 0 || c->head_dim > KVP_MAX_HEAD_DIM)
    return kvp__err(KVP_EINVAL, "config.head_dim = %u: must be 1..%u", c->head_dim, KVP_MAX_HEAD_DIM);
  if (!dtype_ok(c->k_dtype)) return kvp__err(KVP_EINVAL, "config.k_dtype = %d is not a kvp_dtype", (int)c->k_dtype);
  if (!dtype_ok(c->v_dtype)) return kvp__err(KVP_EINVAL, "config.v_dtype = %d is not a kvp_dtype", (int)c->v_dtype);
  if (c->memory != KVP_MEM_HOST && c->memory != KVP_MEM_CUDA)
    return kvp__err(KVP_EINVAL, "config.memory = %d is neither KVP_MEM_HOST nor KVP_MEM_CUDA", (int)c->memory);
  c->region_bytes &= ~(KVP__EXTENT_UNIT - 1);
  if (c->region_bytes < KVP_MIN_REGION_BYTES || c->region_bytes > KVP__SC_MAX_BYTES)
    return kvp__err(KVP_EINVAL, "config.region_bytes = %llu: must be %u..%llu", (unsigned long long)in->region_bytes,
                    KVP_MIN_REGION_BYTES, (unsigned long long)KVP__SC_MAX_BYTES);
  if (c->budget_bytes == 0) c->budget_bytes = c->region_bytes;
  if (c->block_tokens > KVP__MAX_BLOCK_TOKENS)
    return kvp__err(KVP_EINVAL, "config.block_tokens = %u: must be 0 (chosen per layer by its codecs) or 1..%u",
                    c->block_tokens, KVP__MAX_BLOCK_TOKENS);
  if (c->flags &
      ~(KVP_POOL_PREFAULT | KVP_POOL_SANITIZE | KVP_POOL_DRY | KVP_POOL_ALLOW_EXPANSION | KVP_POOL_DEVICE_ASYNC))
    return kvp__err(KVP_EINVAL, "config.flags = %#x has unknown bits", c->flags);
  if ((c->flags & KVP_POOL_PREFAULT) && (c->flags & KVP_POOL_DRY))
    return kvp__err(KVP_EINVAL, "config.flags: KVP_POOL_PREFAULT and KVP_POOL_DRY exclude each other (a dry "
                                "region is never touched)");
  if ((c->flags & KVP_POOL_SANITIZE) && c->memory == KVP_MEM_CUDA && !(c->flags & KVP_POOL_DRY))
    return kvp__err(KVP_ENOTSUP, "config.flags: KVP_POOL_SANITIZE needs host input; a CUDA pool refuses non-finite "
                                 "K/V instead (kvp_append fails naming layer, head and token)");
  /* codecs and policy are parsed at create; the strings are not kept */
  return KVP_OK;
}

/* ---- codec bindings ------------------------------------------------------ */

static void binding_drop(kvp__binding *b) {
  if (b->vt && b->inst) b->vt->destroy(b->inst);
  b->inst = NULL;
}

void kvp__bindings_fini(kvp_pool *pool) {
  uint32_t n = 2 * pool->cfg.n_layers;
  for (uint32_t i = 0; pool->bind && i < n; i++) binding_drop(&pool->bind[i]);
  for (int kv = 0; kv < 2; kv++) binding_drop(&pool->tail[kv]);
  kvp__meta_free(&pool->meta, pool->bind, n * sizeof *pool->bind);
  kvp__meta_free(&pool->meta, pool->bt, n * sizeof *pool->bt);
  pool->bind = NULL;
  pool->bt = NULL;
}

static int layout_ok(const kvp__binding *b, uint32_t cap) {
  kvp_codec_layout lay = {0};
  b->vt->layout(b->inst, cap, &lay);
  if (lay.npages < 1 || lay.npages > KVP_CODEC_MAX_PAGES) return 0;
  for (unsigned i = 0; i < lay.npages; i++) {
    if ((unsigned)lay.types[i] >= KVP_PAGE_TYPE_COUNT || !lay.bytes[i] || lay.bytes[i] > KVP_MAX_PAGE_BYTES) return 0;
    for (unsigned j = 0; j < i; j++)
      if (lay.types[j] == lay.types[i]) return 0;
  }
  return 1;
}

/* Instantiate e's codec for (layer, kv) into b; messages name the binding.
 * Its fit to the layer's block size is checked later (binding_fit). */
static int binding_make(kvp_pool *pool, const kvp__spec_entry *e, uint32_t layer, int kv, kvp__binding *b) {
  const kvp_config *c = &pool->cfg;
  kvp_codec_geom g = {c->head_dim, kv ? c->v_dtype : c->k_dtype, layer, (uint32_t)kv, c->n_layers, c->n_kv_heads};
  char err[256] = "";
  size_t at = 0;
  b->vt = kvp__codec_get(e->id);
  b->id = e->id;
  int rc = b->vt->create(e->params ? e->params : "", &g, &b->inst, err, sizeof err, &at);
  if (rc == KVP_ENOMEM) return kvp__err(KVP_ENOMEM, "codec %s instance", b->vt->name);
  if (rc == KVP_EFORMAT)
    return kvp__err(KVP_EFORMAT, "config.codecs: %s for layer %u %c: %s", b->vt->name, layer, "KV"[kv], err);
  if (rc) return kvp__err(KVP_EINVAL, "config.codecs: %s for layer %u %c (parameters \"%s\", at offset %zu): %s",
                          b->vt->name, layer, "KV"[kv], e->params ? e->params : "", at, err);
  b->group = b->vt->group_tokens(b->inst);
  b->passthrough = e->id == KVP__CODEC_RAW && kvp__raw_store_dtype(b->inst) == g.in_dtype;
  if (!b->group || b->group > KVP__MAX_BLOCK_TOKENS)
    return kvp__err(KVP_ECODEC, "codec %s (layer %u %c) groups %u tokens: must be 1..%u", b->vt->name, layer, "KV"[kv],
                    b->group, KVP__MAX_BLOCK_TOKENS);
  if (c->memory == KVP_MEM_CUDA && !(c->flags & KVP_POOL_DRY) && (!b->vt->encode_dev || !b->vt->decode_dev))
    return kvp__err(KVP_ENOTSUP, "config.codecs: codec %s (layer %u %c) has no device ops (encode_dev, decode_dev), "
                                 "so a CUDA region cannot hold it; it works on a host region", b->vt->name, layer,
                    "KV"[kv]); /* dry: nothing is encoded */
  return KVP_OK;
}

static uint64_t gcd64(uint64_t a, uint64_t b) {
  while (b) {
    uint64_t t = a % b;
    a = b, b = t;
  }
  return a;
}

/* Requested bytes of one block of cap tokens under b, one side of one head. */
static uint64_t binding_block_bytes(const kvp__binding *b, uint32_t cap) {
  kvp_codec_layout lay = {0};
  b->vt->layout(b->inst, cap, &lay);
  uint64_t sum = 0;
  for (unsigned i = 0; i < lay.npages && i < KVP_CODEC_MAX_PAGES; i++) sum += lay.bytes[i];
  return sum;
}

static const char *dtype_name(kvp_dtype d) { return d == KVP_DTYPE_F32 ? "fp32" : d == KVP_DTYPE_F16 ? "fp16" : "bf16"; }

/* Bytes per token of the appended dtype of side kv: what a codec must not exceed. */
static uint64_t source_token_bytes(const kvp_config *c, int kv) {
  return (uint64_t)c->head_dim * kvp__dtype_bytes(kv ? c->v_dtype : c->k_dtype);
}

/* The block sizes of layer (stream and step mode): config.block_tokens, or
 * (0) what its codecs prefer: the larger preference of K and V (16 when
 * neither has one; a whole step is 65536 tokens), rounded up to a multiple
 * of both groups (down, past 65536). An explicit size must be a multiple of
 * both groups; the message names the size that would be. */
static int layer_choose(kvp_pool *pool, uint32_t layer, uint32_t *bt_stream, uint32_t *bt_step) {
  const kvp__binding *k = &pool->bind[2 * layer], *v = &pool->bind[2 * layer + 1];
  uint64_t g = (uint64_t)k->group / gcd64(k->group, v->group) * v->group, max = KVP__MAX_BLOCK_TOKENS;
  if (g > max)
    return kvp__err(KVP_EINVAL, "config.codecs: layer %u: %s groups %u tokens and %s %u: no block size up to %u is a "
                    "multiple of both", layer, k->vt->name, k->group, v->vt->name, v->group, KVP__MAX_BLOCK_TOKENS);
  uint32_t want = pool->cfg.block_tokens;
  if (want) {
    if (want % g) {
      const kvp__binding *b = want % k->group ? k : v;
      return kvp__err(KVP_EINVAL, "config.block_tokens = %u is not a multiple of %s's group of %u tokens (layer %u %c): "
                      "%llu would be (or 0: the pool picks per layer)", want, b->vt->name, b->group, layer,
                      "KV"[b == v], (unsigned long long)((want + g - 1) / g * g));
    }
    *bt_stream = *bt_step = want;
    return KVP_OK;
  }
  for (int mode = 0; mode < 2; mode++) {
    uint64_t pref = 0;
    for (int kv = 0; kv < 2; kv++) {
      uint64_t p = kvp__codec_pref_block(pool->bind[2 * layer + kv].vt, pool->bind[2 * layer + kv].inst,
                                         mode ? KVP_SEQ_STEP : KVP_SEQ_STREAM);
      if (p > max) p = max; /* KVP_CODEC_WHOLE_STEP, or more than a block holds */
      if (p > pref) pref = p;
    }
    if (!pref) pref = KVP__DEFAULT_BLOCK_TOKENS;
    uint64_t bt = (pref + g - 1) / g * g;
    if (bt > max) bt = max / g * g;
    *(mode ? bt_step : bt_stream) = (uint32_t)bt;
  }
  return KVP_OK;
}

/* The smallest block size from cap on (a multiple of g) at which b stores
 * fewer bytes per token than src_bytes; 0 if none up to the largest block. */
static uint32_t compress_from(const kvp__binding *b, uint32_t cap, uint32_t g, uint64_t src_bytes) {
  for (uint64_t n = cap; n <= KVP__MAX_BLOCK_TOKENS; n += g)
    if (binding_block_bytes(b, (uint32_t)n) < src_bytes * n) return (uint32_t)n;
  return 0;
}

/* b (of layer, side kv) at the layer's block sizes: valid layouts, the
 * row-count sizing of a pool whose rows the host cannot read (dry, or a
 * CUDA region), RAW tails a CUDA region reads as the codec presents them,
 * and no expansion: a codec other than raw (which
 * stores the dtype it names) must not store more bytes per token at the
 * stream-mode block size than the appended dtype takes, unless
 * KVP_POOL_ALLOW_EXPANSION. (In step mode a whole-step block's size is
 * the step's, known only when it comes.) */
static int binding_fit(kvp_pool *pool, uint32_t layer, int kv, const kvp__binding *b) {
  const kvp_config *c = &pool->cfg;
  uint32_t bts = pool->bt[2 * layer], btp = pool->bt[2 * layer + 1];
  if (!layout_ok(b, bts) || !layout_ok(b, btp))
    return kvp__err(KVP_ECODEC, "codec %s gives a bad layout (pages, types or sizes) for layer %u %c at %u tokens",
                    b->vt->name, layer, "KV"[kv], layout_ok(b, bts) ? btp : bts);
  if (!kvp__rows_on_host(pool) && kvp__bind_rowwise(b)) {
    /* A dry pool holds no rows, a CUDA region holds them on the device: a
     * row-wise codec must size an OPEN block from its row count alone
     * (pages = NULL), which it answers here. */
    kvp_codec_layout lay;
    kvp_codec_block where = {0, 0};
    int rc = b->vt->open_layout(b->inst, &where, NULL, 1, NULL, 0, 0, bts, &lay);
    if (rc) {
      char why[256];
      snprintf(why, sizeof why, "%s", kvp_last_error()); /* kvp__err rewrites the message it reads */
      return kvp__err(KVP_ENOTSUP, "config.codecs: %s for layer %u %c sizes its pages from the rows it holds, and %s "
                      "(%s)", b->vt->name, layer, "KV"[kv],
                      (c->flags & KVP_POOL_DRY) ? "a dry pool (KVP_POOL_DRY) holds none"
                                                : "a CUDA region holds them on the device, out of the host's reach",
                      why);
    }
  }
  if (c->memory == KVP_MEM_CUDA && !(c->flags & KVP_POOL_DRY) && !kvp__layer_rowwise(pool, layer) &&
      !kvp__codec_raw_plain(b->vt, b->inst))
    return kvp__err(KVP_ENOTSUP, "config.codecs: %s for layer %u %c presents the RAW rows of an OPEN block transformed "
                    "(as kvquant's pre-RoPE keys, rotated at read), which a CUDA region's reads do not do for a layer that keeps "
                    "RAW tails; bind %c of layer %u to a row-wise codec too (%s) or use a host region", b->vt->name,
                    layer, "KV"[kv], "VK"[kv], layer, b->vt->name);
  uint64_t src = source_token_bytes(c, kv), have = binding_block_bytes(b, bts);
  if (b->id == KVP__CODEC_RAW || (c->flags & KVP_POOL_ALLOW_EXPANSION) || have <= src * bts) return KVP_OK;
  const kvp__binding *o = &pool->bind[2 * layer + !kv];
  uint32_t g = (uint32_t)((uint64_t)b->group / gcd64(b->group, o->group) * o->group);
  uint32_t from = compress_from(b, bts + g, g, src);
  char where[96] = "no block size up to 65536";
  if (from) snprintf(where, sizeof where, "block_tokens = %u on", from);
  return kvp__err(KVP_EINVAL, "config.codecs: %s for layer %u %c stores %.2f bytes per token at block_tokens = %u, more "
                  "than the appended %s's %llu (%.2fx expansion); it compresses from %s (%s, or set "
                  "KVP_POOL_ALLOW_EXPANSION to store it anyway)", b->vt->name, layer, "KV"[kv], (double)have / bts, bts,
                  dtype_name(kv ? c->v_dtype : c->k_dtype), (unsigned long long)src, (double)have / bts / (double)src,
                  where, c->block_tokens ? "set config.block_tokens so, or 0 to let the pool choose" : "set config.block_tokens so");
}

int kvp__bindings_init(kvp_pool *pool, const char *spec) {
  uint32_t L = pool->cfg.n_layers;
  kvp__spec_entry *e = kvp__meta_calloc(NULL, 2 * L * sizeof *e);
  if (!e) return kvp__err(KVP_ENOMEM, "codec spec scratch");
  int rc = kvp__codec_spec_parse(spec, L, e);
  if (rc) {
    kvp__meta_free(NULL, e, 2 * L * sizeof *e);
    return rc;
  }
  pool->bind = kvp__meta_calloc(&pool->meta, 2 * L * sizeof *pool->bind);
  pool->bt = kvp__meta_calloc(&pool->meta, 2 * L * sizeof *pool->bt);
  if (!pool->bind || !pool->bt) rc = kvp__err(KVP_ENOMEM, "codec bindings");
  for (uint32_t i = 0; !rc && i < 2 * L; i++) rc = binding_make(pool, &e[i], i / 2, (int)(i % 2), &pool->bind[i]);
  for (uint32_t l = 0; !rc && l < L; l++) rc = layer_choose(pool, l, &pool->bt[2 * l], &pool->bt[2 * l + 1]);
  for (uint32_t i = 0; !rc && i < 2 * L; i++) rc = binding_fit(pool, i / 2, (int)(i % 2), &pool->bind[i]);
  /* the fingerprint store blobs and content keys carry: each binding's
   * codec name and parameter text, in (layer, side) order */
  uint64_t fp = 0x6b7670636f646563ull;
  for (uint32_t i = 0; !rc && i < 2 * L; i++) {
    const char *name = pool->bind[i].vt->name, *par = e[i].params ? e[i].params : "";
    fp = kvp__xxh64(name, strlen(name) + 1, fp);
    fp = kvp__xxh64(par, strlen(par) + 1, fp);
  }
  pool->codec_fp = fp;
  kvp__spec_entry raw = {KVP__CODEC_RAW, NULL};
  for (int kv = 0; !rc && kv < 2; kv++) rc = binding_make(pool, &raw, 0, kv, &pool->tail[kv]);
  pool->chunk_tokens = rc ? 0 : kvp__layer_bt(pool, 0, KVP_SEQ_STREAM);
  for (uint32_t l = 1; !rc && l < L; l++)
    if (kvp__layer_bt(pool, l, KVP_SEQ_STREAM) != pool->chunk_tokens) pool->chunk_tokens = 0;
  kvp__codec_spec_free(e, 2 * L);
  kvp__meta_free(NULL, e, 2 * L * sizeof *e);
  if (rc) kvp__bindings_fini(pool);
  return rc;
}

int kvp__bindings_try(kvp_pool *pool, const char *spec) {
  kvp__binding *bind = pool->bind, tail[2] = {pool->tail[0], pool->tail[1]};
  uint32_t *bt = pool->bt, chunk_tokens = pool->chunk_tokens;
  uint64_t codec_fp = pool->codec_fp;
  pool->bind = NULL, pool->bt = NULL;
  memset(pool->tail, 0, sizeof pool->tail);
  int rc = kvp__bindings_init(pool, spec); /* on failure it dropped what it built */
  if (!rc) kvp__bindings_fini(pool);
  pool->bind = bind, pool->bt = bt, pool->tail[0] = tail[0], pool->tail[1] = tail[1];
  pool->chunk_tokens = chunk_tokens, pool->codec_fp = codec_fp;
  return rc;
}

KVP_API void kvp_layer_info_init(kvp_layer_info *info) {
  if (!info) return;
  memset(info, 0, sizeof *info);
  info->struct_size = sizeof *info;
}

KVP_API int kvp_pool_info(kvp_pool *pool, uint32_t layer, kvp_layer_info *out) {
  if (!pool || !out) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "info out" : "pool");
  if (out->struct_size < sizeof *out)
    return kvp__err(KVP_EINVAL, "info.struct_size %zu < %zu: call kvp_layer_info_init", out->struct_size, sizeof *out);
  if (layer >= pool->cfg.n_layers)
    return kvp__err(KVP_EINVAL, "layer %u >= n_layers %u", layer, pool->cfg.n_layers);
  memset(out, 0, sizeof *out);
  out->struct_size = sizeof *out;
  for (int kv = 0; kv < 2; kv++) {
    const kvp__binding *b = &pool->bind[2 * layer + kv];
    uint32_t bts = pool->bt[2 * layer];
    out->codec[kv] = b->vt->name;
    out->group_tokens[kv] = b->group;
    out->block_tokens[kv] = bts;
    out->step_block_tokens[kv] = pool->bt[2 * layer + 1];
    out->bytes_per_token[kv] = (double)binding_block_bytes(b, bts) / bts;
    out->source_bytes_per_token[kv] = (double)source_token_bytes(&pool->cfg, kv);
  }
  return KVP_OK;
}

/* ---- pool ---------------------------------------------------------------- */

KVP_API int kvp_pool_create(const kvp_config *cfg, kvp_pool **out) {
  if (!out) return kvp__err(KVP_EINVAL, "out pointer is NULL");
  *out = NULL;
  kvp_config c;
  int rc = validate(cfg, &c);
  if (rc) return rc;
  int frc = kvp__rcu_fork_safe();
  if (frc) return kvp__err(KVP_ENOMEM, "pool: registering the RCU fork handlers failed (pthread_atfork: %s)", strerror(frc));
  kvp__meta meta = {0};
  kvp_pool *p = kvp__meta_calloc(&meta, sizeof *p);
  if (!p) return kvp__err(KVP_ENOMEM, "pool object");
  p->meta = meta;
  kvp__meta_wcache_init(&p->meta);
  p->cfg = c;
  kvp__mutex_init(&p->lock);
  if ((rc = kvp__stats_init(&p->stats, c.n_layers, c.n_kv_heads, &p->meta))) goto fail;
  if ((rc = kvp__alloc_init(&p->alloc, c.memory, c.device, c.region_bytes, c.budget_bytes, c.flags, &p->stats, &p->meta))) {
    kvp__stats_fini(&p->stats);
    goto fail;
  }
  if ((rc = kvp__seqs_init(p))) {
    kvp__alloc_fini(&p->alloc);
    kvp__stats_fini(&p->stats);
    goto fail;
  }
  if ((rc = kvp__bindings_init(p, c.codecs))) {
    kvp__seqs_fini(p);
    kvp__alloc_fini(&p->alloc);
    kvp__stats_fini(&p->stats);
    goto fail;
  }
  p->cfg.codecs = NULL;
  if (!(p->policy = kvp__meta_calloc(&p->meta, sizeof *p->policy)) || (rc = kvp__policy_parse(c.policy, p->policy))) {
    if (!p->policy) rc = kvp__err(KVP_ENOMEM, "policy");
    kvp__meta_free(&p->meta, p->policy, sizeof *p->policy);
    kvp__seqs_fini(p);
    kvp__bindings_fini(p);
    kvp__alloc_fini(&p->alloc);
    kvp__stats_fini(&p->stats);
    goto fail;
  }
  p->cfg.policy = NULL;
  if ((rc = kvp__bstore_init(p))) {
    kvp_pool_destroy(p);
    return rc;
  }
#ifdef KVP_HAVE_CUDA
  if (c.memory == KVP_MEM_CUDA && !(c.flags & KVP_POOL_DRY) && (rc = kvp__dev_init(p))) {
    kvp_pool_destroy(p);
    return rc;
  }
  if (c.memory == KVP_MEM_CUDA && !(p->acache = kvp__meta_calloc(&p->meta, c.n_layers * sizeof *p->acache))) {
    kvp_pool_destroy(p);
    return kvp__err(KVP_ENOMEM, "the attention tables kept per layer (%u layers)", c.n_layers);
  }
#endif
  *out = p;
  return KVP_OK;
fail:
  kvp__meta_wcache_fini(&p->meta);
  kvp__meta_free(NULL, p, sizeof *p);
  return rc;
}

KVP_API void kvp_pool_destroy(kvp_pool *pool) {
  if (!pool) return;
  kvp__seqs_fini(pool);
  kvp__heatkv_cache_fini(pool);
  kvp__policy_free(pool->policy);
  kvp__meta_free(&pool->meta, pool->policy, sizeof *pool->policy);
  kvp__bindings_fini(pool);
#ifdef KVP_HAVE_CUDA
  kvp__attend_kept_fini(pool);
  kvp__xfer_fini(pool);
  kvp__dev_fini(pool);
#endif
  kvp__rawpages_fini(pool);
  kvp__alloc_fini(&pool->alloc);
  kvp__bstore_fini(pool); /* every block struct is freed by now */
  kvp__stats_fini(&pool->stats);
  kvp__meta_wcache_fini(&pool->meta);
  kvp__meta_free(NULL, pool, sizeof *pool);
}

static void gauge_from_meta(const kvp__meta *m, kvp_gauge *g) {
  g->current = atomic_load_explicit(&m->bytes, memory_order_relaxed);
  g->peak = atomic_load_explicit(&m->peak_bytes, memory_order_relaxed);
  g->total = atomic_load_explicit(&m->total_bytes, memory_order_relaxed);
}

KVP_API int kvp_stats_get(kvp_pool *pool, kvp_stats *out) {
  if (!pool || !out) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "stats out" : "pool");
  if (out->struct_size < sizeof *out)
    return kvp__err(KVP_EINVAL, "stats.struct_size %zu < %zu: set it to sizeof(kvp_stats)", out->struct_size,
                    sizeof *out);
  kvp__ledger l;
  kvp__ledger_snapshot(&pool->alloc.ledger, &l);
  memset(out, 0, sizeof *out);
  out->struct_size = sizeof *out;
  out->version = KVP_STATS_VERSION;
  out->bytes_requested = l.requested;
  out->bytes_allocated = l.allocated;
  out->bytes_committed = l.committed;
  out->bytes_reserved = l.reserved_bytes;
  out->budget_bytes = l.budget_bytes;
  out->pages = l.pages;
  out->slabs = l.slabs;
  out->extents = l.extents;
  out->allocs = l.allocs;
  out->frees = l.frees;
  out->grows = l.grows;
  out->grow_moves = l.grow_moves;
  out->budget_refusals = l.budget_refusals;
  out->nospc_refusals = l.nospc_refusals;
  out->tokens_retained = l.tokens_retained;
  out->tokens_evicted = l.tokens_evicted;
  out->bf16_equivalent_bytes = l.bf16_equivalent;
  out->sequences = l.sequences;
  out->bytes_retired = l.retired;
  out->codec_state_bytes = l.codec_state;
  out->prefix_query_tokens = l.prefix_query_tokens;
  out->prefix_hit_tokens = l.prefix_hit_tokens;
  out->prefix_chunks = l.prefix_chunks;
  out->store_offload_bytes = l.store_offload_bytes;
  out->store_restore_bytes = l.store_restore_bytes;
  out->store_prefix_tokens = l.store_prefix_tokens;
  for (uint32_t i = 0; i < 2 * pool->cfg.n_layers; i++) {
    const kvp__binding *b = &pool->bind[i];
    if (b->vt->static_bytes) out->codec_static_bytes += b->vt->static_bytes(b->inst);
  }
#ifdef KVP_HAVE_CUDA
  kvp__dev_control_bytes(pool, &out->device_control_bytes, &out->host_pinned_bytes);
#endif
  gauge_from_meta(&pool->meta, &out->metadata_bytes);
  kvp__region *r = &pool->alloc.region;
  uint64_t span = atomic_load_explicit(&pool->alloc.ext.hwm_bytes, memory_order_relaxed);
  if (r->ops->usage(r, span, &out->device_used_bytes, &out->device_total_bytes) != KVP_OK)
    out->device_used_bytes = out->device_total_bytes = 0; /* probe failed: reported as unknown (0) */
  for (uint32_t i = 0; i < KVP_PAGE_TYPE_COUNT; i++) kvp__stats_slice(&pool->stats, KVP_DIM_PAGE_TYPE, i, &out->page_types[i]);
  for (uint32_t i = 0; i < 2; i++) kvp__stats_slice(&pool->stats, KVP_DIM_KV, i, &out->kv[i]);
  return KVP_OK;
}

KVP_API int kvp_stats_breakdown(kvp_pool *pool, kvp_stats_dim dim, uint64_t index, kvp_usage *out) {
  if (!pool || !out) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "usage out" : "pool");
  const kvp__stats *st = &pool->stats;
  uint64_t n = 0;
  switch (dim) {
  case KVP_DIM_PAGE_TYPE: n = KVP_PAGE_TYPE_COUNT; break;
  case KVP_DIM_KV: n = 2; break;
  case KVP_DIM_LAYER: n = st->n_layers; break;
  case KVP_DIM_HEAD: n = st->n_heads; break;
  case KVP_DIM_CODEC: n = KVP__MAX_CODECS; break;
  case KVP_DIM_SEQ: {
    kvp__rcu_read_lock(); /* the per-sequence table may be rebuilt by the writer */
    const kvp__seq_usage *su = kvp__stats_seq(st, index);
    if (su) kvp__seq_usage_read(su, out);
    kvp__rcu_read_unlock();
    if (su && out->npages) return KVP_OK;
    return kvp__err(KVP_ENOENT, "sequence %llu holds no pages", (unsigned long long)index);
  }
  default: return kvp__err(KVP_EINVAL, "stats dimension %d unknown", (int)dim);
  }
  if (index >= n)
    return kvp__err(KVP_ENOENT, "stats dimension %d: index %llu >= %llu", (int)dim, (unsigned long long)index,
                    (unsigned long long)n);
  kvp__stats_slice(st, dim, (uint32_t)index, out);
  return KVP_OK;
}

static const char *codec_name(uint32_t id) {
  const kvp_codec_vtable *vt = kvp__codec_get(id);
  return vt ? vt->name : NULL;
}

KVP_API int kvp_stats_write(kvp_pool *pool, kvp_stats_format fmt, char *buf, size_t cap, size_t *len) {
  if (!pool) return kvp__err(KVP_EINVAL, "pool is NULL");
  if (!buf && cap) return kvp__err(KVP_EINVAL, "buf is NULL with cap %zu", cap);
  kvp_stats s = {.struct_size = sizeof s};
  int rc = kvp_stats_get(pool, &s);
  if (rc) return rc;
  kvp__emit_src src = {&s, &pool->stats, codec_name};
  kvp__rcu_read_lock(); /* the per-sequence table may be rebuilt by the writer */
  rc = kvp__stats_emit(&src, fmt, buf, cap, len);
  kvp__rcu_read_unlock();
  return rc;
}

KVP_API int kvp_stats_top_sequences(kvp_pool *pool, uint32_t n, kvp_seq_usage *out, uint32_t *n_out) {
  if (!pool || !n_out) return kvp__err(KVP_EINVAL, "%s is NULL", pool ? "n_out" : "pool");
  if (n && !out) return kvp__err(KVP_EINVAL, "top sequences: out is NULL for n = %u", n);
  return kvp__stats_top_seqs(&pool->stats, n, out, n_out);
}

typedef struct walk_sum {
  kvp__stats_sum sum;      /* per-slice sums */
  const kvp__stats *st;    /* table to find sequence slots in */
  uint64_t requested;      /* sum of requested bytes */
  uint64_t npages;         /* pages visited */
  uint64_t bad_off;        /* offset of a malformed page */
  bool bad;                /* a page's requested exceeds its class */
} walk_sum;

static void visit(void *ctx, const kvp__page *pg) {
  walk_sum *w = ctx;
  uint64_t cls = kvp__page_alloc_bytes(pg);
  if (pg->requested_bytes > cls && !w->bad) {
    w->bad = true;
    w->bad_off = pg->off;
  }
  w->requested += pg->requested_bytes;
  w->npages++;
  kvp__stats_sum_add(w->st, &w->sum, &pg->tag, pg->requested_bytes, cls);
}

static int check_locked(kvp_pool *pool) {
  int rc = kvp__alloc_check(&pool->alloc);
  if (rc) return rc;
  walk_sum w = {.st = &pool->stats};
  if ((rc = kvp__stats_sum_init(&pool->stats, &w.sum))) return rc;
  kvp__rawpages_walk(&pool->raw, visit, &w);
  if ((rc = kvp__seqs_check(pool, visit, &w))) {
    kvp__stats_sum_fini(&pool->stats, &w.sum);
    return rc;
  }
  const kvp__ledger *l = &pool->alloc.ledger;
  if (w.bad)
    rc = kvp__err(KVP_ECORRUPT, "page at offset %llu requests more bytes than its class", (unsigned long long)w.bad_off);
  else if (w.requested != l->requested.current || w.npages != l->pages.current)
    rc = kvp__err(KVP_ECORRUPT, "pages hold %llu requested bytes in %llu pages, ledger says %llu in %llu",
                  (unsigned long long)w.requested, (unsigned long long)w.npages,
                  (unsigned long long)l->requested.current, (unsigned long long)l->pages.current);
  else
    rc = kvp__stats_compare(&pool->stats, &w.sum);
  kvp__stats_sum_fini(&pool->stats, &w.sum);
  return rc;
}

KVP_API int kvp_check(kvp_pool *pool) {
  if (!pool) return kvp__err(KVP_EINVAL, "pool is NULL");
  kvp__lock(pool);
  int rc = check_locked(pool);
  pool->w_pure = true; /* a check changes no structure */
  kvp__unlock(pool);
  return rc;
}
