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
  double b;            /* budget fraction */
  uint32_t sinks;      /* s */
  char orders[512];    /* path, or "synthetic" */
  kvp__heatkv_unit unit; /* slots or bytes */
  uint64_t seed;       /* synthetic orders' seed */
} heatkv_cfg;

typedef struct heatkv_state {
  kvp__orders orders;     /* loaded for the sequence's schedule */
  kvp__heatkv_plan plan;  /* the plan it executes */
  uint64_t *atom_bytes;   /* BYTES: [K][L][H] */
  size_t atom_bytes_len;  /* entries */
} heatkv_state;

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
  if (klen == 6 && !memcmp(key, "orders", 6)) return memcpy(c->orders, v, vlen + 1), 0;
  if (klen == 4 && !memcmp(key, "unit", 4)) {
    if (!strcmp(v, "slots")) c->unit = KVP__HEATKV_SLOTS;
    else if (!strcmp(v, "bytes")) c->unit = KVP__HEATKV_BYTES;
    else return -1;
    return 0;
  }
  if (klen == 4 && !memcmp(key, "seed", 4)) return c->seed = strtoull(v, &e, 10), *e ? -1 : 0;
  return -1;
}

static int heatkv_parse(const char *params, void **cfg, char *err, size_t errcap) {
  heatkv_cfg c = {0.1, 3, "synthetic", KVP__HEATKV_SLOTS, 1};
  for (const char *p = params; *p;) {
    const char *end = strchr(p, ':');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    const char *eq = memchr(p, '=', n);
    if (!eq || heatkv_field(&c, p, (size_t)(eq - p), eq + 1, n - (size_t)(eq - p) - 1)) {
      snprintf(err, errcap, "heatkv: bad or unknown field \"%.*s\" (b, s, orders, unit, seed)", (int)n, p);
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

static void heatkv_free_cfg(void *cfg) { free(cfg); }

static void heatkv_seq_free(void *vstate) {
  heatkv_state *st = vstate;
  if (!st) return;
  kvp__heatkv_plan_free(&st->plan);
  kvp__orders_free(&st->orders);
  free(st->atom_bytes);
  free(st);
}

/* Allocated bytes of atom (t, l, h): its step's blocks under layer l's codec. */
static int fill_atom_bytes(kvp_pool *pool, const uint32_t *sched, uint32_t K, heatkv_state *st) {
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads, bt = pool->cfg.block_tokens;
  st->atom_bytes_len = (size_t)K * L * H;
  if (!(st->atom_bytes = malloc(st->atom_bytes_len * sizeof *st->atom_bytes)))
    return kvp__err(KVP_ENOMEM, "heatkv atom bytes");
  uint64_t pos = 0; /* first position of step t */
  for (uint32_t t = 0; t < K; pos += sched[t], t++)
    for (uint32_t l = 0; l < L; l++) {
      uint64_t bytes = 0;
      for (uint32_t done = 0; done < sched[t]; done += bt)
        bytes += kvp__block_class_bytes(pool, l, false, (uint32_t)(pos + done),
                                        sched[t] - done < bt ? sched[t] - done : bt);
      for (uint32_t h = 0; h < H; h++) st->atom_bytes[((size_t)t * L + l) * H + h] = bytes;
    }
  return KVP_OK;
}

static int heatkv_seq_add(kvp_pool *pool, const void *vcfg, kvp__seq *s, const kvp_seq_config *sc, void **out) {
  const heatkv_cfg *c = vcfg;
  if (s->mode != KVP_SEQ_STEP)
    return kvp__err(KVP_EINVAL, "heatkv: sequence %llu must be in KVP_SEQ_STEP mode", (unsigned long long)s->id);
  if (sc->n_steps < 2 || !sc->step_tokens)
    return kvp__err(KVP_EINVAL, "heatkv: sequence %llu needs its scale schedule (kvp_seq_config.step_tokens)",
                    (unsigned long long)s->id);
  uint32_t K = sc->n_steps, L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads;
  heatkv_state *st = calloc(1, sizeof *st);
  if (!st) return kvp__err(KVP_ENOMEM, "heatkv state");
  int rc = !strcmp(c->orders, "synthetic")
               ? kvp__orders_synthetic(&st->orders, L, H, K, c->sinks, c->seed, &pool->meta)
               : kvp__orders_load(&st->orders, c->orders, L, H, K, c->sinks, &pool->meta);
  if (!rc && c->unit == KVP__HEATKV_BYTES) rc = fill_atom_bytes(pool, sc->step_tokens, K, st);
  if (!rc) {
    kvp__heatkv_in in = {L, H, K, sc->step_tokens, c->sinks, sc->budget_fraction > 0 ? sc->budget_fraction : c->b,
                         &st->orders, c->unit, st->atom_bytes, NULL, NULL, NULL};
    rc = kvp__heatkv_plan_build(&st->plan, &in, &pool->meta);
  }
  if (rc) {
    heatkv_seq_free(st);
    return rc;
  }
  *out = st;
  return KVP_OK;
}

static int evict_atoms(kvp_pool *pool, kvp__seq *s, const kvp__heatkv_atom *a, uint32_t n, uint32_t below) {
  for (uint32_t i = 0; i < n; i++) {
    if (a[i].scale >= below) continue;
    int rc = kvp__policy_evict(pool, s, a[i].layer, a[i].head, a[i].scale);
    if (rc) return rc;
  }
  return KVP_OK;
}

static int heatkv_step_begin(kvp_pool *pool, const void *cfg, kvp__seq *s, void *vstate, uint32_t step,
                             uint32_t flags) {
  (void)cfg, (void)flags;
  const heatkv_state *st = vstate;
  if (step >= st->plan.n_scales) return KVP_OK; /* past the schedule: nothing planned */
  uint32_t n;
  const kvp__heatkv_atom *e = kvp__heatkv_early(&st->plan, step, &n);
  return evict_atoms(pool, s, e, n, step);
}

static int heatkv_before_append(kvp_pool *pool, const void *cfg, kvp__seq *s, void *vstate, uint32_t layer,
                                uint32_t step, uint64_t *skip) {
  (void)cfg;
  const heatkv_state *st = vstate;
  uint32_t K = st->plan.n_scales, H = pool->cfg.n_kv_heads;
  if (step >= K) return KVP_OK;
  if (step == K - 1) { /* the last scale is never cached */
    for (uint32_t h = 0; h < H; h++) skip[h / 64] |= 1ull << (h % 64);
    return KVP_OK;
  }
  uint32_t n;
  const kvp__heatkv_atom *d = kvp__heatkv_drops(&st->plan, step, layer, &n);
  for (uint32_t i = 0; i < n; i++)
    if (d[i].scale == step) skip[d[i].head / 64] |= 1ull << (d[i].head % 64);
  return evict_atoms(pool, s, d, n, step);
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
