/*
 * pages/heatkv.h - HeatKV planning (paper 001, DESIGN.md section 8): removal
 * orders and the static eviction plan they give under a strict budget. Pure
 * planning: plain arrays in, plain arrays out; nothing here knows the pool.
 *
 * Scale numbering. The paper numbers scales k = 1..K; every array here is
 * indexed by the 0-based scale t = k - 1, which is also the pool's step
 * number and the shipped files' source index. Code that follows the paper's
 * equations works in k and converts at the array access (kvp__heatkv_t0).
 *
 *   paper k:   1   ..   s  | s+1 ..  K-1   |  K
 *   0-based t: 0   ..  s-1 |  s  ..  K-2   | K-1
 *              sink scales | ordered sources | never cached
 *
 * An atom is one (source scale, layer, head): the tokens one scale appended
 * to one head of one layer. It is what HeatKV evicts.
 *
 * Plan invariants (k paper scale, T = L*H, G_0 = {}):
 *   G_{k-1} subset of G_k;  |{(l,h): (i,l,h) in G_k}| = N_k for s < i <= k, i < K
 *   E_k subset of G_k \ G_{k-1}, sources < k;  A_k = G_{k-1} + E_k
 *   occupancy after every layer of every scale <= floor(B)
 */
#ifndef KVP_HEATKV_H
#define KVP_HEATKV_H

#include "../util/util.h"

#include <stdio.h>

/* Paper scale k (1-based) to the 0-based array index t, and back. */
static inline uint32_t kvp__heatkv_t0(uint32_t k) { return k - 1; }
static inline uint32_t kvp__heatkv_k1(uint32_t t) { return t + 1; }

/* ---- removal orders ---------------------------------------------------- */

#define KVP__ORDERS_ANY UINT32_MAX /* loader argument: accept the file's value */
#define KVP__ORDERS_FORMAT "kvpool-heatkv-orders"
#define KVP__ORDERS_VERSION 1

/* One removal order per ordered source scale: O for 0-based source
 * t = n_sinks + j is pairs[j * L*H .. (j+1) * L*H), a permutation of the
 * pair ids p = layer * H + head, ascending S-CAS (entry 0 is evicted
 * first). n_orders = n_scales - 1 - n_sinks. */
typedef struct kvp__orders {
  uint32_t n_layers;  /* L */
  uint32_t n_heads;   /* H, KV heads per layer */
  uint32_t n_scales;  /* K, scales of the schedule the orders belong to */
  uint32_t n_sinks;   /* s, sink scales (0-based 0..s-1), never ordered */
  uint32_t n_orders;  /* K - 1 - s lists, for 0-based sources s..K-2 */
  bool cas;           /* one CAS order (binary HeatKV, Eq. 3), repeated in every list */
  uint32_t *pairs;    /* [n_orders][L*H] pair ids (layer * H + head) */
  kvp__meta *meta;    /* counter pairs is charged to (may be NULL) */
} kvp__orders;

/* Room for the orders of L, H, K, s (pairs uninitialized). KVP_EINVAL for
 * bad geometry, KVP_ENOMEM. */
int kvp__orders_alloc(kvp__orders *o, uint32_t n_layers, uint32_t n_heads, uint32_t n_scales, uint32_t n_sinks,
                      kvp__meta *m);

/* Load a removal-order file, format by its top level: a JSON list is the
 * shipped HeatKV format (a list per source scale of [head, layer] pairs,
 * 0-based), a JSON object is kvpool's own (kvp__orders_write; its "kind"
 * "cas" holds one CAS order, loaded into every list with o->cas set). L and H are
 * required for the shipped format; any argument may be KVP__ORDERS_ANY for
 * kvpool's format, which then takes the file's value. Errors: KVP_ENOENT
 * (cannot open), KVP_EFORMAT (bad content; the message names the file, the
 * list, the entry or the field), KVP_EINVAL (bad arguments), KVP_ENOMEM.
 * On error *o is zeroed and nothing is held. */
int kvp__orders_load(kvp__orders *o, const char *path, uint32_t n_layers, uint32_t n_heads, uint32_t n_scales,
                     uint32_t n_sinks, kvp__meta *m);
/* The same from a buffer; name stands for the file in messages. */
int kvp__orders_parse(kvp__orders *o, const char *text, size_t len, const char *name, uint32_t n_layers,
                      uint32_t n_heads, uint32_t n_scales, uint32_t n_sinks, kvp__meta *m);

/* Synthetic orders: the S-CAS orders (or, with cas, the CAS order) of one
 * synthetic attention-mass summary (kvp__mass_synthetic), deterministic in
 * seed. For demos and tests that must run without calibration files. */
int kvp__orders_synthetic(kvp__orders *o, uint32_t n_layers, uint32_t n_heads, uint32_t n_scales, uint32_t n_sinks,
                          uint64_t seed, kvp__meta *m);
int kvp__orders_synthetic_kind(kvp__orders *o, uint32_t n_layers, uint32_t n_heads, uint32_t n_scales,
                               uint32_t n_sinks, uint64_t seed, bool cas, kvp__meta *m);

/* ---- calibration from attention mass (pages/mass.c) -------------------- */

/* Attention-mass summaries beta[l][h][k1][k2] (0-based scales: the mass
 * scale k1's queries put on scale k2's keys, averaged over k1's queries,
 * paper Eq. 2), summed over n_prompts prompts. */
typedef struct kvp__mass {
  uint32_t n_layers;  /* L */
  uint32_t n_heads;   /* H */
  uint32_t n_scales;  /* K */
  uint32_t n_prompts; /* prompts added */
  double *beta;       /* [L][H][K][K], sums over the prompts */
} kvp__mass;

int kvp__mass_init(kvp__mass *m, uint32_t n_layers, uint32_t n_heads, uint32_t n_scales);
void kvp__mass_free(kvp__mass *m); /* zeroes *m */
/* Add the prompts of a summary file: .npy of shape [L,H,K,K] or
 * [P,L,H,K,K] (float16/32/64), or .json ({"beta": nested lists} or the bare
 * lists, same shapes). Checked whole before anything is added: values in
 * [0, 1], zero above the diagonal, rows summing to at most 1 (KVP_EFORMAT
 * naming the file, prompt and entry); KVP_ENOENT when it cannot be opened. */
int kvp__mass_add_file(kvp__mass *m, const char *path);
/* Add `prompts` synthetic summaries with the qualitative head patterns of
 * the paper's Figure 3 (recent-scale, early-scale, skip-previous,
 * scale-uniform and self-attention heads; early layers lean to recent
 * scales), deterministic in seed; s is where the sink scales end. */
int kvp__mass_synthetic(kvp__mass *m, uint32_t s, uint64_t seed, uint32_t prompts);
/* S-CAS (Eq. 4) of 0-based ordered source t (s <= t <= K-2) for (l, h),
 * and CAS (Eq. 3), both averaged over the prompts. KVP_EINVAL when no
 * prompt was added or t is not an ordered source. */
int kvp__mass_scas(const kvp__mass *m, uint32_t s, uint32_t t, uint32_t l, uint32_t h, double *out);
int kvp__mass_cas(const kvp__mass *m, uint32_t s, uint32_t l, uint32_t h, double *out);
/* Removal orders: ascending S-CAS per source (cas false) or the CAS order
 * in every list (cas true), ties by head, then layer. */
int kvp__orders_from_mass(kvp__orders *o, const kvp__mass *m, uint32_t n_sinks, bool cas, kvp__meta *meta);

/* Write kvpool's versioned format:
 *   {"format": "kvpool-heatkv-orders", "version": 1, "kind": "scas",
 *    "layers": L, "heads": H, "scales": K, "sink_scales": s,
 *    "pair": ["layer", "head"],
 *    "orders": [[[layer, head], ...] per 0-based source s..K-2],
 *    "checksum": "fnv1a64:<16 hex digits>"}
 * or, for a CAS order (o->cas), "kind": "cas" and a single list in
 * "orders" (it stands for every source). A missing "kind" reads as "scas".
 * Returns KVP_EINVAL naming the path when it cannot be written. */
int kvp__orders_write(const kvp__orders *o, const char *path);

/* Write the shipped HeatKV format (a list per source scale of [head,
 * layer] pairs, no geometry, no checksum), for tools that read it. */
int kvp__orders_write_shipped(const kvp__orders *o, const char *path);

/* The "checksum" field's value: FNV-1a 64 over the little-endian u32
 * sequence L, H, K, s, then every entry's layer and head in file order. */
uint64_t kvp__orders_checksum(const kvp__orders *o);

void kvp__orders_free(kvp__orders *o); /* zeroes *o; NULL or zeroed is fine */

/* Pair id at rank r of the order of 0-based source t (s <= t <= K-2). */
static inline uint32_t kvp__orders_pair(const kvp__orders *o, uint32_t t, uint32_t r) {
  return o->pairs[(size_t)(t - o->n_sinks) * o->n_layers * o->n_heads + r];
}

/* ---- the plan ---------------------------------------------------------- */

typedef enum {
  KVP__HEATKV_SLOTS, /* weights are head-token slots: atom (t, l, h) weighs t_t */
  KVP__HEATKV_BYTES  /* weights are the atom's allocated bytes (array or callback) */
} kvp__heatkv_unit;

/* Allocated bytes of atom (0-based scale t, layer, head) under its codec. */
typedef uint64_t (*kvp__heatkv_bytes_fn)(void *ctx, uint32_t t, uint32_t layer, uint32_t head);

/* Everything a plan depends on. */
typedef struct kvp__heatkv_in {
  uint32_t n_layers;              /* L */
  uint32_t n_heads;               /* H, KV heads per layer */
  uint32_t n_scales;              /* K, scales (steps) of one generation */
  const uint32_t *scale_tokens;   /* [K] tokens of each 0-based scale, all >= 1 */
  uint32_t n_sinks;               /* s, sink scales always kept, 0 <= s <= K-1 */
  double b;                       /* budget fraction of the full cache, (0, 1] */
  const kvp__orders *orders;      /* removal orders of this L, H, K, s */
  kvp__heatkv_unit unit;          /* what occupancy and B count */
  const uint64_t *atom_bytes;     /* BYTES: [K][L][H] bytes per atom, or NULL to use bytes_fn */
  kvp__heatkv_bytes_fn bytes_fn;  /* BYTES: used when atom_bytes is NULL */
  void *bytes_ctx;                /* bytes_fn's first argument */
  const uint32_t *n_prune;        /* [K] heads per source in force during each 0-based scale,
                                     overriding Eq. 5 (experiments, tests); entries before s
                                     and the last are ignored; NULL = Eq. 5 */
  uint64_t orders_checksum;       /* kvp__orders_checksum(orders) when the caller keeps it, else 0
                                     (computed here: a pass over every list) */
  bool binary;                    /* Binary-HeatKV: orders->cas must be set; an early-pruned head
                                     loses every cached source at once (whole heads, CAS) */
} kvp__heatkv_in;

/* One atom of a plan. */
typedef struct kvp__heatkv_atom {
  uint32_t scale; /* 0-based source scale (the step that appended the tokens) */
  uint16_t layer; /* layer, 0-based */
  uint16_t head;  /* KV head, 0-based */
} kvp__heatkv_atom;

/* What to evict when, for one generation. For 0-based scale t (paper k):
 *   early[early_off[t] .. early_off[t+1])   E_k: evict at kvp_step_begin
 *   drops[drop_off[t*L+l] .. drop_off[t*L+l+1])  the G_k atoms of layer l
 *       not yet absent: evict once layer l of scale t has run. Atoms with
 *       scale == t are the step's own tokens in heads that drop them (every
 *       head in the last scale): the pool need not store them. To keep the
 *       allocator's peak at the checkpoint values below, the pool frees a
 *       layer's older drops before it allocates that layer's new tokens.
 * Occupancy (units) after layer l of scale t: sink atoms, retained atoms of
 * earlier scales, and scale t's kept atoms of layers <= l. */
typedef struct kvp__heatkv_plan {
  uint32_t n_layers;          /* L */
  uint32_t n_heads;           /* H */
  uint32_t n_scales;          /* K */
  uint32_t n_sinks;           /* s */
  kvp__heatkv_unit unit;      /* unit of budget and occupancies */
  bool binary;                /* Binary-HeatKV (whole heads) */
  double b;                   /* budget fraction */
  double budget;              /* B = b x full, units (slots or bytes) */
  uint64_t budget_floor;      /* floor(B), units: occupancy <= this */
  uint64_t full;              /* units of every atom of scales 0..K-2 (the unpruned peak) */
  uint64_t key;               /* kvp__heatkv_key of the inputs */
  uint32_t *n_prune;          /* [K] heads per source in force during t: paper N_{t+1} (N_{K-1} at t = K-1) */
  uint64_t *max_occupancy;    /* [K] largest occupancy after any layer of t, units */
  uint32_t *max_layer;        /* [K] first layer where t reaches max_occupancy[t] */
  uint64_t *layer_peak;       /* [L] largest occupancy of each layer alone at any checkpoint, units */
  uint64_t pooled_peak;       /* largest total occupancy at any checkpoint, units */
  uint32_t *early_off;        /* [K+1] offsets into early */
  uint32_t *drop_off;         /* [K*L+1] offsets into drops */
  kvp__heatkv_atom *early;    /* E atoms of all scales, early_off[K] of them */
  kvp__heatkv_atom *drops;    /* drop atoms of all scales and layers, drop_off[K*L] of them */
  size_t alloc_bytes;         /* host bytes the arrays above hold, for the free */
  kvp__meta *meta;            /* counter the arrays are charged to (may be NULL) */
} kvp__heatkv_plan;

/* Build the plan. Errors (KVP_EINVAL, naming the field): bad geometry,
 * schedule or b; orders of another L, H, K or s; b below the sink floor
 * (the message gives the smallest b); an n_prune override that decreases or
 * leaves a scale over B (greedy early pruning runs out of candidates, named
 * with the scale and layer). KVP_ENOMEM. On error *p is zeroed. */
int kvp__heatkv_plan_build(kvp__heatkv_plan *p, const kvp__heatkv_in *in, kvp__meta *m);
void kvp__heatkv_plan_free(kvp__heatkv_plan *p); /* zeroes *p; NULL or zeroed is fine */

/* Paper Eq. 5 for paper scale k, in double exactly as written:
 * ceil(T (c_k - b c_{K-1}) / (c_k - c_s)) when k > s and c_k > b c_{K-1},
 * else 0; clamped to [0, T]. c are prefix sums of the 1-based schedule. */
uint32_t kvp__heatkv_eq5(uint32_t T, uint64_t c_k, uint64_t c_s, uint64_t c_last, double b, uint32_t k, uint32_t s);

/* A 64-bit key of everything the plan depends on (geometry, schedule, s,
 * b, unit, per-atom bytes, orders checksum, overrides): equal inputs give
 * equal keys, so a pool may cache plans by it. */
int kvp__heatkv_key(const kvp__heatkv_in *in, uint64_t *key);

/* Atoms of E for 0-based scale t, and of the drops after layer l of t. */
static inline const kvp__heatkv_atom *kvp__heatkv_early(const kvp__heatkv_plan *p, uint32_t t, uint32_t *n) {
  *n = p->early_off[t + 1] - p->early_off[t];
  return p->early + p->early_off[t];
}
static inline const kvp__heatkv_atom *kvp__heatkv_drops(const kvp__heatkv_plan *p, uint32_t t, uint32_t l,
                                                        uint32_t *n) {
  size_t i = (size_t)t * p->n_layers + l;
  *n = p->drop_off[i + 1] - p->drop_off[i];
  return p->drops + p->drop_off[i];
}

/* The plan summary per 0-based scale t, as JSON: {"variant", "unit", "b", "budget",
 * "prune_counts": [N in force during t], "early_counts": [|E|: atoms, or
 * heads for Binary-HeatKV],
 * "max_occupancy": [...], "pooled_peak", "layer_peak_sum", "key"}.
 * *out is malloc'd (free()). KVP_ENOMEM. */
int kvp__heatkv_plan_json(const kvp__heatkv_plan *p, char **out);
/* The same as a text table on f. */
void kvp__heatkv_plan_print(const kvp__heatkv_plan *p, FILE *f);

#endif /* KVP_HEATKV_H */
