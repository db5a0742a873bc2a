/*
 * pages/heatkv.c - the HeatKV plan (paper 001 Algorithm 1, DESIGN.md 8):
 * N_k, the target sets G_k, greedy early pruning E_k under a strict budget,
 * checked layer by layer.
 *
 * Paper scales k = 1..K; arrays by 0-based t = k - 1 (kvp__heatkv_t0).
 * An atom is (0-based source scale t, pair p = layer * H + head), index
 * a = t * T + p; w[a] is its weight in the plan's unit (t_t head-token slots,
 * or its allocated bytes).
 *
 *   c_k = t_1 + ... + t_k;  full = sum of w over scales 1..K-1;  B = b * full
 *   N_k (slots) = Eq. 5;  N_k (bytes) = least N >= N_{k-1} with R_k(N) <= B,
 *     R_k(N) = sink units + sum over s < i <= k of the units of O_i's atoms
 *     past rank N (the end-of-scale occupancy; with w proportional to
 *     tokens it is Eq. 5's derivation, so both give the same N)
 *   G_k = union over s < i <= min(k, K-1) of prefix(O_i, N_k);  G_K also
 *     holds every atom of scale K (never cached)
 *   occupancy after layer l of scale k = sinks + retained atoms of sources
 *     < k + scale k's kept atoms of layers <= l (the reference code's count;
 *     the paper's Algorithm 2 also counts later layers' and over-prunes)
 *   greedy, at each layer l: drop G_k's atoms of layer l; while occupancy >
 *     floor(B), evict the next atom of G_k still present with layer > l and
 *     source < k, by (layer desc, source desc, rank in O_source asc): E_k.
 *   Binary-HeatKV (one CAS order O in every list, so G_k is whole heads):
 *     the same, except that an early-pruned atom takes the rest of its head
 *     with it (every older source at once): the paper's whole-head E_k,
 *     popped by (layer desc, rank in O asc).
 */
#include "heatkv.h"

#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Scratch of one build (plain malloc: freed before the build returns). */
typedef struct plan_ws {
  uint32_t L, H, K, s, T; /* geometry; T = L * H pairs */
  uint64_t *w;            /* [K * T] units of each atom */
  uint32_t *rank;         /* [K * T] rank of pair p in O_t; UINT32_MAX for unordered t */
  uint8_t *gone;          /* [K * T] 1 once the atom is absent (evicted or never kept) */
  uint32_t *cand;         /* [K * T] early-pruning candidates of the scale being planned */
  uint32_t *bucket;       /* [L * K + 1] counting-sort offsets for cand */
  uint64_t occ;           /* units present now */
} plan_ws;

uint32_t kvp__heatkv_eq5(uint32_t T, uint64_t c_k, uint64_t c_s, uint64_t c_last, double b, uint32_t k, uint32_t s) {
  double bc = b * (double)c_last;
  if (k <= s || !((double)c_k > bc)) return 0;
  double n = ceil((double)T * ((double)c_k - bc) / (double)(c_k - c_s));
  return n <= 0 ? 0 : n >= T ? T : (uint32_t)n;
}

/* ---- inputs ------------------------------------------------------------ */

static int check_geometry(const kvp__heatkv_in *in) {
  if (in->n_layers == 0 || in->n_heads == 0 || in->n_layers > UINT16_MAX || in->n_heads > UINT16_MAX)
    return kvp__err(KVP_EINVAL, "heatkv: layers %u and heads %u must be in 1..65535", in->n_layers, in->n_heads);
  if (in->n_scales < 2 || in->n_sinks > in->n_scales - 1)
    return kvp__err(KVP_EINVAL, "heatkv: %u scales with %u sink scales: need K >= 2 and s <= K-1", in->n_scales,
                    in->n_sinks);
  if (!in->scale_tokens) return kvp__err(KVP_EINVAL, "heatkv: scale_tokens is NULL");
  for (uint32_t t = 0; t < in->n_scales; t++)
    if (in->scale_tokens[t] == 0) return kvp__err(KVP_EINVAL, "heatkv: scale_tokens[%u] is 0", t);
  if (!(in->b > 0 && in->b <= 1)) return kvp__err(KVP_EINVAL, "heatkv: b=%g outside (0, 1]", in->b);
  uint64_t atoms = (uint64_t)in->n_scales * in->n_layers * in->n_heads;
  if (atoms > INT32_MAX)
    return kvp__err(KVP_EINVAL, "heatkv: %u scales x %u layers x %u heads = %" PRIu64 " atoms, more than 2^31",
                    in->n_scales, in->n_layers, in->n_heads, atoms);
  return KVP_OK;
}

static int check_input(const kvp__heatkv_in *in) {
  int rc = check_geometry(in);
  if (rc) return rc;
  const kvp__orders *o = in->orders;
  if (!o || (o->n_orders && !o->pairs)) return kvp__err(KVP_EINVAL, "heatkv: no removal orders");
  if (o->n_layers != in->n_layers || o->n_heads != in->n_heads || o->n_scales != in->n_scales ||
      o->n_sinks != in->n_sinks)
    return kvp__err(KVP_EINVAL, "heatkv: orders are for L=%u H=%u K=%u s=%u, the plan has L=%u H=%u K=%u s=%u",
                    o->n_layers, o->n_heads, o->n_scales, o->n_sinks, in->n_layers, in->n_heads, in->n_scales,
                    in->n_sinks);
  if (in->unit == KVP__HEATKV_BYTES && !in->atom_bytes && !in->bytes_fn)
    return kvp__err(KVP_EINVAL, "heatkv: unit=bytes needs atom_bytes or bytes_fn");
  if (in->binary && !o->cas)
    return kvp__err(KVP_EINVAL, "binary-heatkv: the orders are per source scale (S-CAS): whole-head pruning needs "
                    "one CAS order (kvpool-calib heatkv writes one)");
  if (!in->binary && o->cas)
    return kvp__err(KVP_EINVAL, "heatkv: the orders are one CAS order of whole heads (kind \"cas\"): plan them as "
                    "binary-heatkv, or give per-source S-CAS orders");
  if (in->unit != KVP__HEATKV_SLOTS && in->unit != KVP__HEATKV_BYTES)
    return kvp__err(KVP_EINVAL, "heatkv: unit %d unknown", (int)in->unit);
  return KVP_OK;
}

static uint64_t atom_units(const kvp__heatkv_in *in, uint32_t t, uint32_t l, uint32_t h) {
  if (in->unit == KVP__HEATKV_SLOTS) return in->scale_tokens[t];
  if (in->atom_bytes) return in->atom_bytes[((size_t)t * in->n_layers + l) * in->n_heads + h];
  return in->bytes_fn(in->bytes_ctx, t, l, h);
}

/* ---- workspace --------------------------------------------------------- */

static void ws_free(plan_ws *ws) {
  free(ws->w), free(ws->rank), free(ws->gone), free(ws->cand), free(ws->bucket);
  memset(ws, 0, sizeof *ws);
}

static int ws_init(plan_ws *ws, const kvp__heatkv_in *in) {
  uint32_t L = in->n_layers, H = in->n_heads, K = in->n_scales, s = in->n_sinks, T = L * H;
  size_t n = (size_t)K * T;
  *ws = (plan_ws){L, H, K, s, T, malloc(n * sizeof(uint64_t)), malloc(n * sizeof(uint32_t)), calloc(n, 1),
                  malloc(n * sizeof(uint32_t)), malloc(((size_t)L * K + 1) * sizeof(uint32_t)), 0};
  if (!ws->w || !ws->rank || !ws->gone || !ws->cand || !ws->bucket) {
    ws_free(ws);
    return kvp__err(KVP_ENOMEM, "heatkv: scratch for %u scales x %u pairs", K, T);
  }
  for (uint32_t t = 0; t < K; t++)
    for (uint32_t p = 0; p < T; p++) {
      ws->w[(size_t)t * T + p] = atom_units(in, t, p / H, p % H);
      ws->rank[(size_t)t * T + p] = UINT32_MAX;
    }
  for (uint32_t t = s; t + 1 < K; t++)
    for (uint32_t r = 0; r < T; r++) ws->rank[(size_t)t * T + kvp__orders_pair(in->orders, t, r)] = r;
  return KVP_OK;
}

static uint64_t scale_units(const plan_ws *ws, uint32_t t) {
  uint64_t u = 0;
  for (uint32_t p = 0; p < ws->T; p++) u += ws->w[(size_t)t * ws->T + p];
  return u;
}

/* ---- budget and N_k ---------------------------------------------------- */

/* full, B, floor(B); KVP_EINVAL when even the sink scales pass B. */
static int budget_set(kvp__heatkv_plan *p, const plan_ws *ws, const kvp__heatkv_in *in) {
  uint64_t sink = 0, full = 0;
  for (uint32_t t = 0; t + 1 < ws->K; t++) {
    uint64_t u = scale_units(ws, t);
    full += u;
    if (t < ws->s) sink += u;
  }
  p->full = full;
  p->budget = in->b * (double)full;
  p->budget_floor = (uint64_t)floor(p->budget);
  double min_b = (double)sink / (double)full;
  if (in->b < min_b || sink > p->budget_floor)
    return kvp__err(KVP_EINVAL, "heatkv: b=%g is below the smallest feasible budget %s = %" PRIu64 "/%" PRIu64
                    " = %.6f (the %u sink scales are always kept)", in->b,
                    in->unit == KVP__HEATKV_SLOTS ? "c_s/c_{K-1}" : "sink bytes / full bytes",
                    sink / (in->unit == KVP__HEATKV_SLOTS ? ws->T : 1),
                    full / (in->unit == KVP__HEATKV_SLOTS ? ws->T : 1), min_b, ws->s);
  return KVP_OK;
}

/* R_k(N) for paper scale k: the occupancy once G_k is gone. */
static uint64_t end_units(const plan_ws *ws, const kvp__orders *o, uint32_t k, uint32_t n) {
  uint64_t u = 0;
  for (uint32_t t = 0; t < kvp__heatkv_t0(k) + 1 && t + 1 < ws->K; t++) {
    if (t < ws->s) {
      u += scale_units(ws, t);
      continue;
    }
    for (uint32_t r = n; r < ws->T; r++) u += ws->w[(size_t)t * ws->T + kvp__orders_pair(o, t, r)];
  }
  return u;
}

static uint32_t n_bytes(const plan_ws *ws, const kvp__orders *o, uint32_t k, uint32_t lo, uint64_t cap) {
  uint32_t hi = ws->T; /* R_k(T) = sink units <= cap (budget_set) */
  while (lo < hi) {
    uint32_t mid = lo + (hi - lo) / 2;
    if (end_units(ws, o, k, mid) <= cap) hi = mid;
    else lo = mid + 1;
  }
  return lo;
}

static int override_check(const kvp__heatkv_in *in, uint32_t T) {
  for (uint32_t t = in->n_sinks; t + 1 < in->n_scales; t++) {
    if (in->n_prune[t] > T) return kvp__err(KVP_EINVAL, "heatkv: n_prune[%u] = %u > T = %u", t, in->n_prune[t], T);
    if (t > in->n_sinks && in->n_prune[t] < in->n_prune[t - 1])
      return kvp__err(KVP_EINVAL, "heatkv: n_prune[%u] = %u < n_prune[%u] = %u: N must not decrease", t,
                      in->n_prune[t], t - 1, in->n_prune[t - 1]);
  }
  return KVP_OK;
}

/* n_prune[t] for every 0-based t, by paper scale k = t + 1. */
static int n_set(kvp__heatkv_plan *p, const plan_ws *ws, const kvp__heatkv_in *in) {
  uint64_t c_s = 0, c_last = 0, c_k = 0;
  for (uint32_t k = 1; k <= ws->K - 1; k++) {
    c_last += in->scale_tokens[kvp__heatkv_t0(k)];
    if (k <= ws->s) c_s = c_last;
  }
  if (in->n_prune && override_check(in, ws->T)) return KVP_EINVAL;
  for (uint32_t k = 1; k <= ws->K - 1; k++) {
    uint32_t t = kvp__heatkv_t0(k), prev = k > 1 ? p->n_prune[t - 1] : 0;
    c_k += in->scale_tokens[t];
    if (k <= ws->s) p->n_prune[t] = 0;
    else if (in->n_prune) p->n_prune[t] = in->n_prune[t];
    else if (in->unit == KVP__HEATKV_SLOTS) p->n_prune[t] = kvp__heatkv_eq5(ws->T, c_k, c_s, c_last, in->b, k, ws->s);
    else p->n_prune[t] = n_bytes(ws, in->orders, k, prev, p->budget_floor);
  }
  p->n_prune[ws->K - 1] = p->n_prune[ws->K - 2]; /* scale K removes no older source */
  return KVP_OK;
}

/* ---- greedy early pruning for one scale -------------------------------- */

/* Atom a = (source t, pair) is in G_k for paper scale k. */
static bool in_g(const plan_ws *ws, const kvp__heatkv_plan *p, uint32_t k, size_t a) {
  uint32_t t = (uint32_t)(a / ws->T), tk = kvp__heatkv_t0(k);
  if (t == ws->K - 1) return tk == t; /* the last scale is never cached */
  return t >= ws->s && t <= tk && ws->rank[a] < p->n_prune[tk];
}

/* Candidates for paper scale k: G_k atoms still present with source < k,
 * by (layer desc, source desc, rank asc): a stable counting sort with
 * bucket (L-1-layer) * K + (K-1-source) over sources and ranks ascending. */
static uint32_t cand_build(plan_ws *ws, const kvp__heatkv_in *in, uint32_t k, uint32_t n) {
  uint32_t T = ws->T, K = ws->K, nb = ws->L * K, nc = 0, tk = kvp__heatkv_t0(k);
  memset(ws->bucket, 0, (nb + 1) * sizeof *ws->bucket);
  for (int pass = 0; pass < 2; pass++) {
    for (uint32_t t = ws->s; t < tk && t + 1 < K; t++)
      for (uint32_t r = 0; r < n; r++) {
        uint32_t pr = kvp__orders_pair(in->orders, t, r);
        if (ws->gone[(size_t)t * T + pr]) continue;
        uint32_t bk = (ws->L - 1 - pr / ws->H) * K + (K - 1 - t);
        if (pass == 0) ws->bucket[bk + 1]++, nc++;
        else ws->cand[ws->bucket[bk]++] = t * T + pr;
      }
    for (uint32_t i = 0; pass == 0 && i < nb; i++) ws->bucket[i + 1] += ws->bucket[i];
  }
  return nc;
}

static kvp__heatkv_atom atom_of(const plan_ws *ws, size_t a) {
  uint32_t p = (uint32_t)(a % ws->T);
  return (kvp__heatkv_atom){(uint32_t)(a / ws->T), (uint16_t)(p / ws->H), (uint16_t)(p % ws->H)};
}

static void evict(plan_ws *ws, size_t a, kvp__heatkv_atom *list, uint32_t *n) {
  ws->gone[a] = 1;
  ws->occ -= ws->w[a];
  list[(*n)++] = atom_of(ws, a);
}

/* Layer l of paper scale k: write its tokens, drop its G_k atoms. */
static void layer_drops(plan_ws *ws, kvp__heatkv_plan *p, uint32_t k, uint32_t l, uint32_t *nd) {
  uint32_t tk = kvp__heatkv_t0(k);
  for (uint32_t h = 0; h < ws->H; h++) ws->occ += ws->w[(size_t)tk * ws->T + l * ws->H + h];
  for (uint32_t t = ws->s; t <= tk; t++)
    for (uint32_t h = 0; h < ws->H; h++) {
      size_t a = (size_t)t * ws->T + l * ws->H + h;
      if (!ws->gone[a] && in_g(ws, p, k, a)) evict(ws, a, p->drops, nd);
    }
}

static int plan_scale(plan_ws *ws, kvp__heatkv_plan *p, const kvp__heatkv_in *in, uint32_t k, uint32_t *ne,
                      uint32_t *nd) {
  uint32_t tk = kvp__heatkv_t0(k), nc = cand_build(ws, in, k, p->n_prune[tk]), ci = 0;
  p->early_off[tk] = *ne;
  for (uint32_t l = 0; l < ws->L; l++) {
    p->drop_off[(size_t)tk * ws->L + l] = *nd;
    layer_drops(ws, p, k, l, nd);
    while (ws->occ > p->budget_floor) {
      while (ci < nc && ws->gone[ws->cand[ci]]) ci++;
      if (ci == nc || atom_of(ws, ws->cand[ci]).layer <= l)
        return kvp__err(KVP_EINVAL, "heatkv: b=%g: 0-based scale %u (paper %u) passes the budget after layer %u "
                        "(%" PRIu64 " > %" PRIu64 " %s) with no early-pruning candidate left (N=%u)", in->b, tk,
                        k, l, ws->occ, p->budget_floor, in->unit == KVP__HEATKV_SLOTS ? "slots" : "bytes",
                        p->n_prune[tk]);
      size_t a = ws->cand[ci++];
      evict(ws, a, p->early, ne);
      for (uint32_t t = ws->s; in->binary && t < tk; t++) { /* the rest of the head: older sources */
        size_t b = (size_t)t * ws->T + a % ws->T;
        if (!ws->gone[b]) evict(ws, b, p->early, ne);
      }
    }
  }
  return KVP_OK;
}

/* ---- checkpoints --------------------------------------------------------
 * Replays the plan's lists on a presence map and records occupancies; the
 * planner's own bookkeeping is not trusted here. */

static void checkpoint(kvp__heatkv_plan *p, const uint64_t *layer_occ, uint64_t occ, uint32_t t, uint32_t l) {
  if (l == 0 || occ > p->max_occupancy[t]) p->max_occupancy[t] = occ, p->max_layer[t] = l;
  if (occ > p->pooled_peak) p->pooled_peak = occ;
  for (uint32_t j = 0; j < p->n_layers; j++)
    if (layer_occ[j] > p->layer_peak[j]) p->layer_peak[j] = layer_occ[j];
  kvp__assert(occ <= p->budget_floor);
}

static void take(plan_ws *ws, uint64_t *layer_occ, uint64_t *occ, const kvp__heatkv_atom *a) {
  size_t i = (size_t)a->scale * ws->T + (size_t)a->layer * ws->H + a->head;
  kvp__assert(ws->gone[i] == 0);
  ws->gone[i] = 1;
  *occ -= ws->w[i];
  layer_occ[a->layer] -= ws->w[i];
}

static void replay(plan_ws *ws, kvp__heatkv_plan *p, uint64_t *layer_occ) {
  uint64_t occ = 0;
  uint32_t n;
  memset(ws->gone, 1, (size_t)ws->K * ws->T); /* gone = not present */
  for (uint32_t t = 0; t < ws->K; t++) {
    const kvp__heatkv_atom *e = kvp__heatkv_early(p, t, &n);
    for (uint32_t i = 0; i < n; i++) take(ws, layer_occ, &occ, &e[i]);
    for (uint32_t l = 0; l < ws->L; l++) {
      for (uint32_t h = 0; h < ws->H; h++) {
        size_t a = (size_t)t * ws->T + l * ws->H + h;
        ws->gone[a] = 0, occ += ws->w[a], layer_occ[l] += ws->w[a];
      }
      const kvp__heatkv_atom *d = kvp__heatkv_drops(p, t, l, &n);
      for (uint32_t i = 0; i < n; i++) take(ws, layer_occ, &occ, &d[i]);
      checkpoint(p, layer_occ, occ, t, l);
    }
  }
}

/* ---- build ------------------------------------------------------------- */

static size_t plan_layout(const kvp__heatkv_plan *p, size_t off[8]) {
  size_t K = p->n_scales, L = p->n_layers, KT = K * L * p->n_heads, sz[8] = {
      K * 4, K * 8, K * 4, L * 8, (K + 1) * 4, (K * L + 1) * 4, KT * sizeof(kvp__heatkv_atom),
      KT * sizeof(kvp__heatkv_atom)};
  size_t at = 0;
  for (int i = 0; i < 8; i++) off[i] = at, at += (sz[i] + 7) & ~(size_t)7;
  return at;
}

static int plan_alloc(kvp__heatkv_plan *p, const kvp__heatkv_in *in, kvp__meta *m) {
  size_t off[8];
  *p = (kvp__heatkv_plan){.n_layers = in->n_layers, .n_heads = in->n_heads, .n_scales = in->n_scales,
                          .n_sinks = in->n_sinks, .unit = in->unit, .binary = in->binary, .b = in->b,
                          .meta = m};
  p->alloc_bytes = plan_layout(p, off);
  char *base = kvp__meta_calloc(m, p->alloc_bytes);
  if (!base) return kvp__err(KVP_ENOMEM, "heatkv: plan of %zu bytes", p->alloc_bytes);
  p->n_prune = (uint32_t *)(base + off[0]), p->max_occupancy = (uint64_t *)(base + off[1]);
  p->max_layer = (uint32_t *)(base + off[2]), p->layer_peak = (uint64_t *)(base + off[3]);
  p->early_off = (uint32_t *)(base + off[4]), p->drop_off = (uint32_t *)(base + off[5]);
  p->early = (kvp__heatkv_atom *)(base + off[6]), p->drops = (kvp__heatkv_atom *)(base + off[7]);
  return KVP_OK;
}

void kvp__heatkv_plan_free(kvp__heatkv_plan *p) {
  if (!p) return;
  if (p->n_prune) kvp__meta_free(p->meta, p->n_prune, p->alloc_bytes);
  memset(p, 0, sizeof *p);
}

/* Every scale in order; then the replay fills the checkpoint figures. */
static int plan_run(plan_ws *ws, kvp__heatkv_plan *p, const kvp__heatkv_in *in) {
  uint32_t ne = 0, nd = 0;
  for (uint32_t k = 1; k <= ws->K; k++) {
    int rc = plan_scale(ws, p, in, k, &ne, &nd);
    if (rc) return rc;
  }
  p->early_off[ws->K] = ne;
  p->drop_off[(size_t)ws->K * ws->L] = nd;
  uint64_t *layer_occ = calloc(ws->L, sizeof *layer_occ);
  if (!layer_occ) return kvp__err(KVP_ENOMEM, "heatkv: %u layer counters", ws->L);
  replay(ws, p, layer_occ);
  free(layer_occ);
  return KVP_OK;
}

int kvp__heatkv_plan_build(kvp__heatkv_plan *p, const kvp__heatkv_in *in, kvp__meta *m) {
  plan_ws ws;
  uint64_t key;
  memset(p, 0, sizeof *p);
  int rc = kvp__heatkv_key(in, &key); /* checks the input */
  if (rc || (rc = ws_init(&ws, in))) return rc;
  if (!(rc = plan_alloc(p, in, m))) {
    p->key = key;
    if (!(rc = budget_set(p, &ws, in)) && !(rc = n_set(p, &ws, in))) rc = plan_run(&ws, p, in);
  }
  ws_free(&ws);
  if (rc) kvp__heatkv_plan_free(p);
  return rc;
}

/* ---- key --------------------------------------------------------------- */

static uint64_t fnv64(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; i++) {
    h ^= (v >> (8 * i)) & 0xffu;
    h *= 0x100000001b3ULL;
  }
  return h;
}

int kvp__heatkv_key(const kvp__heatkv_in *in, uint64_t *key) {
  int rc = in ? check_input(in) : kvp__err(KVP_EINVAL, "heatkv: input is NULL");
  if (rc) return rc;
  uint64_t h = 0xcbf29ce484222325ULL, bbits;
  memcpy(&bbits, &in->b, sizeof bbits);
  h = fnv64(fnv64(fnv64(h, 0x6865617401u /* "heat", v1 */), in->n_layers), in->n_heads);
  h = fnv64(fnv64(fnv64(fnv64(h, in->n_scales), in->n_sinks), bbits), (uint64_t)in->unit);
  for (uint32_t t = 0; t < in->n_scales; t++) h = fnv64(h, in->scale_tokens[t]);
  h = fnv64(h, in->orders_checksum ? in->orders_checksum : kvp__orders_checksum(in->orders));
  for (uint32_t t = 0; in->unit == KVP__HEATKV_BYTES && t < in->n_scales; t++)
    for (uint32_t l = 0; l < in->n_layers; l++)
      for (uint32_t hd = 0; hd < in->n_heads; hd++) h = fnv64(h, atom_units(in, t, l, hd));
  h = fnv64(fnv64(h, in->binary), in->n_prune != NULL);
  for (uint32_t t = 0; in->n_prune && t < in->n_scales; t++) h = fnv64(h, in->n_prune[t]);
  *key = h;
  return KVP_OK;
}

/* ---- report ------------------------------------------------------------ */

/* |E| of 0-based scale t: atoms, or for Binary-HeatKV whole heads (an
 * early-pruned head's atoms sit together in the list). */
static uint32_t early_count(const kvp__heatkv_plan *p, uint32_t t) {
  uint32_t n, heads = 0;
  const kvp__heatkv_atom *e = kvp__heatkv_early(p, t, &n);
  if (!p->binary) return n;
  for (uint32_t i = 0; i < n; i++)
    heads += i == 0 || e[i].layer != e[i - 1].layer || e[i].head != e[i - 1].head;
  return heads;
}

static uint64_t layer_peak_sum(const kvp__heatkv_plan *p) {
  uint64_t s = 0;
  for (uint32_t l = 0; l < p->n_layers; l++) s += p->layer_peak[l];
  return s;
}

int kvp__heatkv_plan_json(const kvp__heatkv_plan *p, char **out) {
  json_t *np = json_array(), *ne = json_array(), *mo = json_array();
  for (uint32_t t = 0; np && ne && mo && t < p->n_scales; t++) {
    json_array_append_new(np, json_integer(p->n_prune[t]));
    json_array_append_new(ne, json_integer(early_count(p, t)));
    json_array_append_new(mo, json_integer((json_int_t)p->max_occupancy[t]));
  }
  char key[20];
  snprintf(key, sizeof key, "%016" PRIx64, p->key);
  json_t *root = json_pack("{s:s, s:s, s:f, s:f, s:I, s:o, s:o, s:o, s:I, s:I, s:s}", "variant",
                           p->binary ? "binary-heatkv" : "heatkv", "unit", p->unit == KVP__HEATKV_SLOTS ? "slots" : "bytes", "b", p->b, "budget", p->budget, "full",
                           (json_int_t)p->full, "prune_counts", np, "early_counts", ne, "max_occupancy", mo,
                           "pooled_peak", (json_int_t)p->pooled_peak, "layer_peak_sum",
                           (json_int_t)layer_peak_sum(p), "key", key);
  *out = root ? json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
  json_decref(root);
  return *out ? KVP_OK : kvp__err(KVP_ENOMEM, "heatkv: plan JSON");
}

void kvp__heatkv_plan_print(const kvp__heatkv_plan *p, FILE *f) {
  const char *u = p->unit == KVP__HEATKV_SLOTS ? "slots" : "bytes";
  fprintf(f, "%s plan: L=%u H=%u K=%u s=%u b=%g budget %.1f %s (full %" PRIu64 ")\n",
          p->binary ? "binary-heatkv" : "heatkv", p->n_layers, p->n_heads,
          p->n_scales, p->n_sinks, p->b, p->budget, u, p->full);
  fprintf(f, "  t  k     N   |E|  max occupancy  of B   at layer\n");
  for (uint32_t t = 0; t < p->n_scales; t++)
    fprintf(f, "%3u %2u %5u %5u %14" PRIu64 " %5.1f%% %6u\n", t, kvp__heatkv_k1(t), p->n_prune[t],
            early_count(p, t), p->max_occupancy[t], 100.0 * p->max_occupancy[t] / p->budget,
            p->max_layer[t]);
  fprintf(f, "  pooled peak %" PRIu64 " %s; per-layer peaks sum %" PRIu64 " (%.2fx)\n", p->pooled_peak, u,
          layer_peak_sum(p), (double)layer_peak_sum(p) / (double)p->pooled_peak);
}
