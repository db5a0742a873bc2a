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

int kvp__policy_evict(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint32_t head, uint32_t step) {
  if (!kvp__unit_retained(s, layer, head, step)) return KVP_OK;
  return kvp__evict_unit(pool, s, layer, head, step);
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

static int window_after_append(kvp_pool *pool, const void *vcfg, kvp__seq *s, void *state, uint32_t layer,
                               uint32_t step) {
  const window_cfg *c = vcfg;
  uint32_t *cur = &((uint32_t *)state)[layer];
  uint32_t end = s->step_pos[step] + s->cur_tokens;
  uint32_t keep_from = end > c->recent_tokens ? end - c->recent_tokens : 0;
  for (; *cur < step; ++*cur) {
    uint32_t p0 = s->step_pos[*cur], p1 = s->step_pos[*cur + 1];
    if (p0 < c->sink_tokens) continue; /* the sink, or straddling it: kept */
    if (p1 > keep_from) break;        /* reaches into the window: kept, and so are later steps */
    for (uint32_t h = 0; h < pool->cfg.n_kv_heads; h++) {
      int rc = kvp__policy_evict(pool, s, layer, h, *cur);
      if (rc) return rc;
    }
  }
  return KVP_OK;
}

const kvp__policy_vt kvp__policy_window = {
    .name = "window",
    .parse = window_parse,
    .free_cfg = free_plain,
    .seq_add = window_seq_add,
    .seq_free = free_plain,
    .after_append = window_after_append,
};

/* ---- registry and parser ----------------------------------------------------- */

static const kvp__policy_vt *const policies[] = {&kvp__policy_window};

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
  return kvp__err(KVP_EINVAL, "policy \"%s\": unknown policy \"%.*s\" (none, window)", spec, (int)n, spec);
}

void kvp__policy_free(kvp__policy *p) {
  if (p->vt && p->vt->free_cfg) p->vt->free_cfg(p->cfg);
  memset(p, 0, sizeof *p);
}
