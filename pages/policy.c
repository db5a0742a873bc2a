/*
 * pages/policy.c - the policy spec parser, the eviction helper policies
 * share, and the window policy (StreamingLLM).
 *
 * Spec: name[:key=value]*, e.g. "window:sink=4:recent=1024". A bad spec is
 * refused with the offending field named.
 *
 * window:sink=S:recent=W (tokens). After layer l of step k is appended, every
 * step j of layer l whose positions [p_j, p_{j+1}) lie after the sink
 * (p_j >= S) and wholly before the window (p_{j+1} <= end - W, end = the
 * step's last position + 1) is evicted for every head. A step straddling a
 * boundary is kept whole: the unit of eviction is a step. Per layer a cursor
 * remembers the first step not yet decided, so each step is looked at once.
 */
#include "policy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- shared ---------------------------------------------------------------- */

int kvp__policy_evict(kvp_pool *pool, kvp__seq *s, kvp__evict_plan *ev, uint32_t layer, uint32_t head, uint32_t step) {
  if (!kvp__unit_retained(s, layer, head, step)) return KVP_OK;
  return kvp__evict_plan_add(pool, ev, layer, head, step);
}

/* key=value fields separated by ':'; calls fn for each; err names the field. */
typedef int (*field_fn)(void *cfg, const char *key, size_t klen, const char *val, size_t vlen);

static int scan_fields(const char *params, void *cfg, field_fn fn, const char *policy, char *err, size_t errcap) {
  const char *p = params;
  while (*p) {
    const char *end = strchr(p, ':'), *eq = memchr(p, '=', end ? (size_t)(end - p) : strlen(p));
    size_t n = end ? (size_t)(end - p) : strlen(p);
    if (!eq || eq == p || eq + 1 == p + n || fn(cfg, p, (size_t)(eq - p), eq + 1, (size_t)(p + n - eq - 1))) {
      snprintf(err, errcap, "%s: bad or unknown field \"%.*s\"", policy, (int)n, p);
      return KVP_EINVAL;
    }
    p += n + (end != NULL);
  }
  return KVP_OK;
}

/* An unsigned integer field value, whole. */
static int field_u32(const char *val, size_t vlen, uint32_t *out) {
  char buf[16];
  if (!vlen || vlen >= sizeof buf) return -1;
  memcpy(buf, val, vlen);
  buf[vlen] = 0;
  char *e;
  unsigned long v = strtoul(buf, &e, 10);
  if (*e || buf[0] == '-' || v > 0xFFFFFFFFul) return -1;
  *out = (uint32_t)v;
  return 0;
}

/* ---- window ---------------------------------------------------------------- */

typedef struct window_cfg {
  uint32_t sink_tokens;   /* positions [0, sink) stay */
  uint32_t recent_tokens; /* the last recent positions stay */
} window_cfg;

static int window_field(void *vcfg, const char *key, size_t klen, const char *val, size_t vlen) {
  window_cfg *c = vcfg;
  if (klen == 4 && !memcmp(key, "sink", 4)) return field_u32(val, vlen, &c->sink_tokens);
  if (klen == 6 && !memcmp(key, "recent", 6)) return field_u32(val, vlen, &c->recent_tokens);
  return -1;
}

static int window_parse(const char *params, void **cfg, char *err, size_t errcap) {
  window_cfg c = {4, 1024};
  int rc = scan_fields(params, &c, window_field, "window", err, errcap);
  if (rc) return rc;
  if (!c.recent_tokens) {
    snprintf(err, errcap, "window: recent must be at least 1 token");
    return KVP_EINVAL;
  }
  window_cfg *out = malloc(sizeof *out);
  if (!out) return KVP_ENOMEM;
  *out = c;
  *cfg = out;
  return KVP_OK;
}

static void free_plain(void *p) { free(p); }

/* Per sequence: for each layer, the first step not yet decided. */
static int window_seq_add(kvp_pool *pool, const void *cfg, kvp__seq *s, const kvp_seq_config *sc, void **state) {
  (void)cfg, (void)s, (void)sc;
  *state = calloc(pool->cfg.n_layers, sizeof(uint32_t));
  return *state ? KVP_OK : kvp__err(KVP_ENOMEM, "window policy state");
}

static void window_seq_copy(kvp_pool *pool, const void *cfg, const void *from, void *to) {
  (void)cfg;
  memcpy(to, from, pool->cfg.n_layers * sizeof(uint32_t));
}

static int window_after_append(kvp_pool *pool, const void *vcfg, kvp__seq *s, void *state, uint32_t layer,
                               uint32_t step, kvp__evict_plan *ev) {
  const window_cfg *c = vcfg;
  uint32_t cur = ((uint32_t *)state)[layer];
  uint32_t end = s->step_pos[step] + s->cur_tokens;
  uint32_t keep_from = end > c->recent_tokens ? end - c->recent_tokens : 0;
  for (; cur < step; ++cur) {
    uint32_t p0 = s->step_pos[cur], p1 = s->step_pos[cur + 1];
    if (p0 < c->sink_tokens) continue; /* the sink, or straddling it: kept */
    if (p1 > keep_from) break;        /* reaches into the window: kept, and so are later steps */
    for (uint32_t h = 0; h < pool->cfg.n_kv_heads; h++) {
      int rc = kvp__policy_evict(pool, s, ev, layer, h, cur);
      if (rc) return rc;
    }
  }
  ev->commit_at = &((uint32_t *)state)[layer]; /* the cursor moves when the evictions happen */
  ev->commit_val = cur;
  return KVP_OK;
}

const kvp__policy_vt kvp__policy_window = {
    .name = "window",
    .parse = window_parse,
    .free_cfg = free_plain,
    .seq_add = window_seq_add,
    .seq_free = free_plain,
    .seq_copy = window_seq_copy,
    .after_append = window_after_append,
};

/* ---- multishot --------------------------------------------------------------
 * multishot:global=G:shot=S:window=W (steps; LongLive-2.0 section 4.2): keep
 * the first G steps of the sequence (global sink), the first S steps of the
 * current shot (shot sink; a step flagged KVP_STEP_SCENE_CUT starts a new
 * shot, and the old shot's sink becomes evictable), and the last W steps
 * (window, the current one included). After layer l of step k, every step
 * j < k of layer l that none of the three keeps is evicted for every head.
 * Steps are scanned from the first one past the global sink that is still
 * retained, so the cost is the window plus the shot sink per layer. */

typedef struct multishot_cfg {
  uint32_t global_steps; /* global sink */
  uint32_t shot_steps;   /* shot sink */
  uint32_t window_steps; /* sliding window */
} multishot_cfg;

typedef struct multishot_state {
  uint32_t shot_start;   /* first step of the current shot */
  uint32_t lo[];         /* per layer: no retained evictable step below this */
} multishot_state;

static int multishot_field(void *vcfg, const char *key, size_t klen, const char *val, size_t vlen) {
  multishot_cfg *c = vcfg;
  if (klen == 6 && !memcmp(key, "global", 6)) return field_u32(val, vlen, &c->global_steps);
  if (klen == 4 && !memcmp(key, "shot", 4)) return field_u32(val, vlen, &c->shot_steps);
  if (klen == 6 && !memcmp(key, "window", 6)) return field_u32(val, vlen, &c->window_steps);
  return -1;
}

static int multishot_parse(const char *params, void **cfg, char *err, size_t errcap) {
  multishot_cfg c = {4, 4, 8};
  int rc = scan_fields(params, &c, multishot_field, "multishot", err, errcap);
  if (rc) return rc;
  if (!c.window_steps) {
    snprintf(err, errcap, "multishot: window must be at least 1 step");
    return KVP_EINVAL;
  }
  multishot_cfg *out = malloc(sizeof *out);
  if (!out) return KVP_ENOMEM;
  *out = c;
  *cfg = out;
  return KVP_OK;
}

static int multishot_seq_add(kvp_pool *pool, const void *vcfg, kvp__seq *s, const kvp_seq_config *sc, void **state) {
  const multishot_cfg *c = vcfg;
  (void)s, (void)sc;
  multishot_state *st = calloc(1, sizeof *st + pool->cfg.n_layers * sizeof(uint32_t));
  if (!st) return kvp__err(KVP_ENOMEM, "multishot policy state");
  for (uint32_t l = 0; l < pool->cfg.n_layers; l++) st->lo[l] = c->global_steps;
  *state = st;
  return KVP_OK;
}

static void multishot_seq_copy(kvp_pool *pool, const void *cfg, const void *from, void *to) {
  (void)cfg;
  memcpy(to, from, sizeof(multishot_state) + pool->cfg.n_layers * sizeof(uint32_t));
}

static int multishot_step_begin(kvp_pool *pool, const void *cfg, kvp__seq *s, void *state, uint32_t step,
                                uint32_t flags, kvp__evict_plan *ev) {
  (void)pool, (void)cfg, (void)s, (void)ev; /* the same step again binds the same shot: a retry is harmless */
  if (flags & KVP_STEP_SCENE_CUT) ((multishot_state *)state)->shot_start = step;
  return KVP_OK;
}

static bool multishot_keeps(const multishot_cfg *c, const multishot_state *st, uint32_t j, uint32_t k) {
  return j < c->global_steps || (j >= st->shot_start && j - st->shot_start < c->shot_steps) ||
         j + c->window_steps > k;
}

static int multishot_after_append(kvp_pool *pool, const void *vcfg, kvp__seq *s, void *vstate, uint32_t layer,
                                  uint32_t step, kvp__evict_plan *ev) {
  const multishot_cfg *c = vcfg;
  multishot_state *st = vstate;
  bool all_gone = true; /* every step below j is evicted or in the global sink */
  uint32_t lo = st->lo[layer];
  for (uint32_t j = st->lo[layer]; j < step; j++) {
    if (multishot_keeps(c, st, j, step)) {
      all_gone = false;
      continue;
    }
    for (uint32_t h = 0; h < pool->cfg.n_kv_heads; h++) {
      int rc = kvp__policy_evict(pool, s, ev, layer, h, j);
      if (rc) return rc;
    }
    if (all_gone) lo = j + 1;
  }
  ev->commit_at = &st->lo[layer]; /* moves when the evictions happen */
  ev->commit_val = lo;
  return KVP_OK;
}

const kvp__policy_vt kvp__policy_multishot = {
    .name = "multishot",
    .parse = multishot_parse,
    .free_cfg = free_plain,
    .seq_add = multishot_seq_add,
    .seq_free = free_plain,
    .seq_copy = multishot_seq_copy,
    .step_begin = multishot_step_begin,
    .after_append = multishot_after_append,
};

/* ---- registry and parser ----------------------------------------------------- */

static const kvp__policy_vt *const policies[] = {&kvp__policy_window, &kvp__policy_multishot, &kvp__policy_heatkv,
                                                 &kvp__policy_binary_heatkv};

int kvp__policy_parse(const char *spec, kvp__policy *out) {
  memset(out, 0, sizeof *out);
  if (!spec || !*spec || !strcmp(spec, "none")) return KVP_OK;
  const char *colon = strchr(spec, ':');
  size_t n = colon ? (size_t)(colon - spec) : strlen(spec);
  for (size_t i = 0; i < KVP__ARRAY_LEN(policies); i++) {
    if (strlen(policies[i]->name) != n || strncmp(policies[i]->name, spec, n)) continue;
    char err[200] = "";
    int rc = policies[i]->parse(colon ? colon + 1 : "", &out->cfg, err, sizeof err);
    if (rc == KVP_ENOMEM) return kvp__err(KVP_ENOMEM, "policy config");
    if (rc) return kvp__err(KVP_EINVAL, "policy \"%s\": %s", spec, err);
    out->vt = policies[i];
    return KVP_OK;
  }
  return kvp__err(KVP_EINVAL, "policy \"%s\": unknown policy \"%.*s\" (none, window, multishot, heatkv, binary-heatkv)", spec, (int)n, spec);
}

void kvp__policy_free(kvp__policy *p) {
  if (p->vt && p->vt->free_cfg) p->vt->free_cfg(p->cfg);
  memset(p, 0, sizeof *p);
}
