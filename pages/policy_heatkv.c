/*
 * pages/policy_heatkv.c - the heatkv policy: executes a HeatKV plan
 * (pages/heatkv.c) on a sequence of scales, so the cache never holds more
 * than its budget, not even inside a step.
 *
 * Spec: heatkv:b=0.1:s=3:orders=PATH|synthetic[:unit=slots|bytes][:seed=N]
 *   b       budget fraction of the full cache (kvp_seq_config.budget_fraction
 *           overrides it per sequence)
 *   s       sink scales, always kept
 *   orders  a removal-order file (the shipped HeatKV JSON or kvpool's own
 *           format), or "synthetic" (built-in orders, no file)
 *   unit    slots: the paper's head-token budget; bytes: each atom weighs
 *           its allocated bytes under its codec (size classes included)
 *
 * Execution, for 0-based scale t (the step index):
 *   step_begin(t)              evict E_t (early pruning planned for t)
 *   before_append(layer l, t)  evict the planned drops of layer l from
 *                              earlier scales, and skip (never store) the
 *                              heads that drop scale t itself in layer l
 *                              (the evictions go through a plan the pool
 *                              applies with the append: pages/evict.c)
 *   the last scale             is never stored (no later scale attends to it)
 * Occupancy after each layer is then what the plan counted, which the plan
 * keeps at or under B; the pool's ledger sees exactly those pages.
 *
 * The sequence must be in KVP_SEQ_STEP mode (a scale's blocks then hold only
 * that scale, so an atom frees exactly) with its schedule planned
 * (kvp_seq_config.step_tokens). An infeasible budget fails kvp_seq_add with
 * KVP_EINVAL and the smallest feasible b.
 */
#include "heatkv.h"
#include "policy.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct heatkv_cfg {
  double b;              /* budget fraction */
  uint32_t sinks;        /* s */
  char orders[512];      /* path, or "synthetic" */
  kvp__heatkv_unit unit; /* slots or bytes */
  uint64_t seed;         /* synthetic orders' seed */
  bool binary;           /* binary-heatkv: whole heads by one CAS order */
} heatkv_cfg;

/* ---- the pool's plan cache -----------------------------------------------
 * A plan depends only on (geometry, schedule, codecs, orders, b, s, unit):
 * sequences with equal inputs share one plan, built once. Orders are cached
 * by where they come from (file or synthetic seed) and geometry, so a file
 * is read once per pool. Both lists live on the pool, touched only under
 * the writer lock (kvp_seq_add, fork, free, destroy); entries no sequence
 * uses are kept, up to CACHE_KEEP of each, for the next sequence. */

#define CACHE_KEEP 8

typedef struct orders_entry {
  struct orders_entry *next;
  char source[512];          /* path, or "synthetic" */
  uint32_t L, H, K, s;       /* geometry it was loaded for */
  uint64_t seed;             /* synthetic seed */
  bool cas;                  /* one CAS order (binary) */
  kvp__orders orders;
  uint64_t checksum;         /* kvp__orders_checksum(&orders), once */
} orders_entry;

typedef struct plan_entry {
  struct plan_entry *next;
  uint64_t key;              /* kvp__heatkv_key of its inputs */
  uint32_t refs;             /* sequences executing it */
  kvp__heatkv_plan plan;
} plan_entry;

struct kvp__heatkv_cache {
  orders_entry *orders;      /* most recently used first */
  plan_entry *plans;         /* most recently used first */
  uint64_t plan_builds;      /* plans built (cache misses) */
  uint64_t plan_hits;        /* plans reused */
};

typedef struct heatkv_state {
  plan_entry *pe;            /* the shared plan it executes */
} heatkv_state;

static kvp__heatkv_cache *cache_of(kvp_pool *pool) {
  if (!pool->heatkv_cache) pool->heatkv_cache = kvp__meta_calloc(&pool->meta, sizeof *pool->heatkv_cache);
  return pool->heatkv_cache;
}

/* Free the unused entries past the first CACHE_KEEP of each list. */
static void cache_trim(kvp_pool *pool, kvp__heatkv_cache *c) {
  uint32_t n = 0;
  for (orders_entry **po = &c->orders; *po;) {
    orders_entry *e = *po;
    if (++n <= CACHE_KEEP) {
      po = &e->next;
      continue;
    }
    *po = e->next;
    kvp__orders_free(&e->orders);
    kvp__meta_free(&pool->meta, e, sizeof *e);
  }
  n = 0;
  for (plan_entry **pp = &c->plans; *pp;) {
    plan_entry *e = *pp;
    if (e->refs || ++n <= CACHE_KEEP) {
      pp = &e->next;
      continue;
    }
    *pp = e->next;
    kvp__heatkv_plan_free(&e->plan);
    kvp__meta_free(&pool->meta, e, sizeof *e);
  }
}

void kvp__heatkv_cache_fini(kvp_pool *pool) {
  kvp__heatkv_cache *c = pool->heatkv_cache;
  if (!c) return;
  while (c->orders) {
    orders_entry *e = c->orders;
    c->orders = e->next;
    kvp__orders_free(&e->orders);
    kvp__meta_free(&pool->meta, e, sizeof *e);
  }
  while (c->plans) {
    plan_entry *e = c->plans;
    kvp__assert(e->refs == 0); /* every sequence is gone */
    c->plans = e->next;
    kvp__heatkv_plan_free(&e->plan);
    kvp__meta_free(&pool->meta, e, sizeof *e);
  }
  kvp__meta_free(&pool->meta, c, sizeof *c);
  pool->heatkv_cache = NULL;
}

void kvp__heatkv_cache_counts(const kvp_pool *pool, uint64_t *builds, uint64_t *hits) {
  const kvp__heatkv_cache *c = pool->heatkv_cache;
  *builds = c ? c->plan_builds : 0;
  *hits = c ? c->plan_hits : 0;
}

/* The orders of cfg for L, H, K (loaded or made once per pool). */
static int orders_get(kvp_pool *pool, kvp__heatkv_cache *c, const heatkv_cfg *cfg, uint32_t K,
                      const orders_entry **out) {
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads;
  bool synth = !strcmp(cfg->orders, "synthetic");
  for (orders_entry **pe = &c->orders; *pe; pe = &(*pe)->next) {
    orders_entry *e = *pe;
    if (strcmp(e->source, cfg->orders) || e->L != L || e->H != H || e->K != K || e->s != cfg->sinks ||
        e->cas != cfg->binary || (synth && e->seed != cfg->seed))
      continue;
    *pe = e->next, e->next = c->orders, c->orders = e; /* to the front */
    *out = e;
    return KVP_OK;
  }
  orders_entry *e = kvp__meta_calloc(&pool->meta, sizeof *e);
  if (!e) return kvp__err(KVP_ENOMEM, "heatkv: orders cache entry");
  int rc = synth ? kvp__orders_synthetic_kind(&e->orders, L, H, K, cfg->sinks, cfg->seed, cfg->binary, &pool->meta)
                 : kvp__orders_load(&e->orders, cfg->orders, L, H, K, cfg->sinks, &pool->meta);
  if (!rc && cfg->binary && !e->orders.cas)
    rc = kvp__err(KVP_EINVAL, "binary-heatkv: %s holds an order per source scale (S-CAS); whole-head pruning needs "
                  "one CAS order (kind \"cas\", written by kvpool-calib heatkv)", cfg->orders);
  if (!rc && !cfg->binary && e->orders.cas)
    rc = kvp__err(KVP_EINVAL, "heatkv: %s holds one CAS order (kind \"cas\"): use it with binary-heatkv, or give "
                  "heatkv per-source S-CAS orders", cfg->orders);
  if (rc) {
    kvp__orders_free(&e->orders);
    kvp__meta_free(&pool->meta, e, sizeof *e);
    return rc;
  }
  snprintf(e->source, sizeof e->source, "%s", cfg->orders);
  e->L = L, e->H = H, e->K = K, e->s = cfg->sinks, e->seed = cfg->seed, e->cas = cfg->binary;
  e->checksum = kvp__orders_checksum(&e->orders);
  e->next = c->orders, c->orders = e;
  *out = e;
  return KVP_OK;
}

static int heatkv_field(heatkv_cfg *c, const char *key, size_t klen, const char *val, size_t vlen) {
  char v[512];
  if (!vlen || vlen >= sizeof v) return -1;
  memcpy(v, val, vlen);
  v[vlen] = 0;
  char *e;
  if (klen == 1 && *key == 'b') return c->b = strtod(v, &e), *e || !(c->b > 0 && c->b <= 1) ? -1 : 0;
  if (klen == 1 && *key == 's') {
    unsigned long s = strtoul(v, &e, 10);
    c->sinks = (uint32_t)s;
    return *e || s > 1000 ? -1 : 0;
  }
  if ((!c->binary && klen == 6 && !memcmp(key, "orders", 6)) || (c->binary && klen == 6 && !memcmp(key, "scores", 6)))
    return memcpy(c->orders, v, vlen + 1), 0;
  if (klen == 4 && !memcmp(key, "unit", 4)) {
    if (!strcmp(v, "slots")) c->unit = KVP__HEATKV_SLOTS;
    else if (!strcmp(v, "bytes")) c->unit = KVP__HEATKV_BYTES;
    else return -1;
    return 0;
  }
  if (klen == 4 && !memcmp(key, "seed", 4)) return c->seed = strtoull(v, &e, 10), *e ? -1 : 0;
  return -1;
}

static int parse_any(const char *params, void **cfg, char *err, size_t errcap, bool binary) {
  heatkv_cfg c = {0.1, 3, "synthetic", KVP__HEATKV_SLOTS, 1, binary};
  const char *name = binary ? "binary-heatkv" : "heatkv";
  for (const char *p = params; *p;) {
    const char *end = strchr(p, ':');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    const char *eq = memchr(p, '=', n);
    if (!eq || heatkv_field(&c, p, (size_t)(eq - p), eq + 1, n - (size_t)(eq - p) - 1)) {
      snprintf(err, errcap, "%s: bad or unknown field \"%.*s\" (b, s, %s, unit, seed)", name, (int)n, p,
               binary ? "scores" : "orders");
      return KVP_EINVAL;
    }
    p += n + (end != NULL);
  }
  heatkv_cfg *out = malloc(sizeof *out);
  if (!out) return KVP_ENOMEM;
  *out = c;
  *cfg = out;
  return KVP_OK;
}

static int heatkv_parse(const char *params, void **cfg, char *err, size_t errcap) {
  return parse_any(params, cfg, err, errcap, false);
}
static int binary_parse(const char *params, void **cfg, char *err, size_t errcap) {
  return parse_any(params, cfg, err, errcap, true);
}

static void heatkv_free_cfg(void *cfg) { free(cfg); }

static void heatkv_seq_free(void *vstate) {
  heatkv_state *st = vstate;
  if (!st) return;
  if (st->pe) st->pe->refs--; /* the entry stays cached; cache_trim or destroy frees it */
  free(st);
}

uint64_t *kvp__heatkv_atom_bytes(const kvp_pool *pool, const uint32_t *sched, uint32_t K) {
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads;
  uint64_t *ab = malloc((size_t)K * L * H * sizeof *ab);
  if (!ab) return NULL;
  uint64_t pos = 0; /* first position of step t */
  for (uint32_t t = 0; t < K; pos += sched[t], t++)
    for (uint32_t l = 0; l < L; l++) {
      uint64_t bytes = 0;
      uint32_t bt = kvp__layer_bt(pool, l, KVP_SEQ_STEP); /* heatkv sequences are in step mode */
      for (uint32_t done = 0; done < sched[t]; done += bt)
        bytes += kvp__block_class_bytes(pool, l, false, (uint32_t)(pos + done),
                                        sched[t] - done < bt ? sched[t] - done : bt);
      for (uint32_t h = 0; h < H; h++) ab[((size_t)t * L + l) * H + h] = bytes;
    }
  return ab;
}

/* The plan for these inputs: the cached one of the same key, or a new one. */
static int plan_get(kvp_pool *pool, kvp__heatkv_cache *c, const kvp__heatkv_in *in, plan_entry **out) {
  uint64_t key;
  int rc = kvp__heatkv_key(in, &key);
  if (rc) return rc;
  for (plan_entry **pp = &c->plans; *pp; pp = &(*pp)->next) {
    plan_entry *e = *pp;
    if (e->key != key) continue;
    *pp = e->next, e->next = c->plans, c->plans = e;
    c->plan_hits++;
    *out = e;
    return KVP_OK;
  }
  plan_entry *e = kvp__meta_calloc(&pool->meta, sizeof *e);
  if (!e) return kvp__err(KVP_ENOMEM, "heatkv: plan cache entry");
  if ((rc = kvp__heatkv_plan_build(&e->plan, in, &pool->meta))) {
    kvp__meta_free(&pool->meta, e, sizeof *e);
    return rc;
  }
  e->key = key;
  e->next = c->plans, c->plans = e;
  c->plan_builds++;
  *out = e;
  return KVP_OK;
}

static int heatkv_seq_add(kvp_pool *pool, const void *vcfg, kvp__seq *s, const kvp_seq_config *sc, void **out) {
  const heatkv_cfg *c = vcfg;
  const char *name = c->binary ? "binary-heatkv" : "heatkv";
  if (s->mode != KVP_SEQ_STEP)
    return kvp__err(KVP_EINVAL, "%s: sequence %llu must be in KVP_SEQ_STEP mode", name, (unsigned long long)s->id);
  if (sc->n_steps < 2 || !sc->step_tokens)
    return kvp__err(KVP_EINVAL, "%s: sequence %llu needs its scale schedule (kvp_seq_config.step_tokens)", name,
                    (unsigned long long)s->id);
  uint32_t K = sc->n_steps, L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads;
  kvp__heatkv_cache *cache = cache_of(pool);
  heatkv_state *st = calloc(1, sizeof *st);
  if (!cache || !st) {
    free(st);
    return kvp__err(KVP_ENOMEM, "%s state", name);
  }
  const orders_entry *orders = NULL;
  uint64_t *ab = NULL;
  int rc = orders_get(pool, cache, c, K, &orders);
  if (!rc && c->unit == KVP__HEATKV_BYTES && !(ab = kvp__heatkv_atom_bytes(pool, sc->step_tokens, K)))
    rc = kvp__err(KVP_ENOMEM, "%s: atom bytes", name);
  if (!rc) {
    kvp__heatkv_in in = {.n_layers = L, .n_heads = H, .n_scales = K, .scale_tokens = sc->step_tokens,
                         .n_sinks = c->sinks, .b = sc->budget_fraction > 0 ? sc->budget_fraction : c->b,
                         .orders = &orders->orders, .orders_checksum = orders->checksum, .unit = c->unit,
                         .atom_bytes = ab, .binary = c->binary};
    rc = plan_get(pool, cache, &in, &st->pe);
  }
  free(ab);
  if (!rc) st->pe->refs++;
  cache_trim(pool, cache);
  if (rc) {
    free(st);
    return rc;
  }
  *out = st;
  return KVP_OK;
}

static int evict_atoms(kvp_pool *pool, kvp__seq *s, kvp__evict_plan *ev, const kvp__heatkv_atom *a, uint32_t n,
                       uint32_t below) {
  for (uint32_t i = 0; i < n; i++) {
    if (a[i].scale >= below) continue;
    int rc = kvp__policy_evict(pool, s, ev, a[i].layer, a[i].head, a[i].scale);
    if (rc) return rc;
  }
  return KVP_OK;
}

static int heatkv_step_begin(kvp_pool *pool, const void *cfg, kvp__seq *s, void *vstate, uint32_t step,
                             uint32_t flags, kvp__evict_plan *ev) {
  (void)cfg, (void)flags;
  const kvp__heatkv_plan *plan = &((const heatkv_state *)vstate)->pe->plan;
  if (step >= plan->n_scales) return KVP_OK; /* past the schedule: nothing planned */
  uint32_t n;
  const kvp__heatkv_atom *e = kvp__heatkv_early(plan, step, &n);
  return evict_atoms(pool, s, ev, e, n, step);
}

static int heatkv_before_append(kvp_pool *pool, const void *cfg, kvp__seq *s, void *vstate, uint32_t layer,
                                uint32_t step, uint64_t *skip, kvp__evict_plan *ev) {
  (void)cfg;
  const kvp__heatkv_plan *plan = &((const heatkv_state *)vstate)->pe->plan;
  uint32_t K = plan->n_scales, H = pool->cfg.n_kv_heads;
  if (step >= K) return KVP_OK;
  if (step == K - 1) { /* the last scale is never cached */
    for (uint32_t h = 0; h < H; h++) skip[h / 64] |= 1ull << (h % 64);
    return KVP_OK;
  }
  uint32_t n;
  const kvp__heatkv_atom *d = kvp__heatkv_drops(plan, step, layer, &n);
  for (uint32_t i = 0; i < n; i++)
    if (d[i].scale == step) skip[d[i].head / 64] |= 1ull << (d[i].head % 64);
  return evict_atoms(pool, s, ev, d, n, step);
}

const kvp__policy_vt kvp__policy_heatkv = {
    .name = "heatkv",
    .parse = heatkv_parse,
    .free_cfg = heatkv_free_cfg,
    .seq_add = heatkv_seq_add,
    .seq_free = heatkv_seq_free,
    .step_begin = heatkv_step_begin,
    .before_append = heatkv_before_append,
};

const kvp__policy_vt kvp__policy_binary_heatkv = {
    .name = "binary-heatkv",
    .parse = binary_parse,
    .free_cfg = heatkv_free_cfg,
    .seq_add = heatkv_seq_add,
    .seq_free = heatkv_seq_free,
    .step_begin = heatkv_step_begin,
    .before_append = heatkv_before_append,
};
