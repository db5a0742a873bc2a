/*
 * pages/policy.h - eviction policies: what to evict and when.
 *
 * A policy is configured by a spec string (kvp_config.policy, overridable
 * per sequence by kvp_seq_config.policy) and is told about every step:
 *
 *   step_begin(seq, step)          before the step runs (all layers)
 *   before_append(seq, layer, step) before that layer is stored (may skip heads)
 *   after_append(seq, layer, step) what to evict once that layer is stored
 *   step_end(seq, step)
 *
 * Its evictions are planned (kvp__policy_evict names units into a plan)
 * and applied by the pool through kvp__evict_unit, the path kvp_evict
 * takes, so the accounting and the RCU discipline are shared, and a call
 * that fails evicts nothing (pages/evict.c). Evicted blocks go to the
 * limbo; the pool reclaims them when an allocation needs the bytes, at step
 * end past a threshold, or on kvp_reclaim, so a decode step does not wait
 * for a grace period per layer.
 */
#ifndef KVP_POLICY_H
#define KVP_POLICY_H

#include "pages.h"

typedef struct kvp__policy_vt {
  const char *name; /* spec name */
  /* Parse the text after "name:" into a config (owned by the policy). */
  int (*parse)(const char *params, void **cfg, char *err, size_t errcap);
  void (*free_cfg)(void *cfg);
  /* Per-sequence state (may stay NULL); KVP_EINVAL for an infeasible
   * configuration, with a message. */
  int (*seq_add)(kvp_pool *pool, const void *cfg, kvp__seq *s, const kvp_seq_config *sc, void **state);
  void (*seq_free)(void *state);
  /* A fork: the child's state (from seq_add) takes the parent's (may be NULL). */
  void (*seq_copy)(kvp_pool *pool, const void *cfg, const void *from, void *to);
  /* The hooks evict nothing themselves: they name units into ev (through
   * kvp__policy_evict), which the pool applies once the call has all it
   * needs (pages/evict.c). State a hook advances with its plan goes through
   * ev->commit_at, so a failed call leaves it as it was. */
  int (*step_begin)(kvp_pool *pool, const void *cfg, kvp__seq *s, void *state, uint32_t step, uint32_t flags,
                    kvp__evict_plan *ev);
  /* Before layer's append of step: may plan evictions, and may set bits in
   * skip (H bits, zeroed) for heads that must not store this step (step
   * mode). */
  int (*before_append)(kvp_pool *pool, const void *cfg, kvp__seq *s, void *state, uint32_t layer, uint32_t step,
                       uint64_t *skip, kvp__evict_plan *ev);
  /* What to evict once layer's append of step is stored (planned before it
   * is, applied after). */
  int (*after_append)(kvp_pool *pool, const void *cfg, kvp__seq *s, void *state, uint32_t layer, uint32_t step,
                      kvp__evict_plan *ev);
} kvp__policy_vt;

/* A parsed policy spec. */
typedef struct kvp__policy {
  const kvp__policy_vt *vt; /* NULL: none */
  void *cfg;                /* its config */
} kvp__policy;

/* Parse spec (NULL or "" or "none": no policy). KVP_EINVAL names the field. */
int kvp__policy_parse(const char *spec, kvp__policy *out);
void kvp__policy_free(kvp__policy *p);

/* Plan the eviction of (layer, head, step) if it is retained; no-op
 * otherwise. For policies. KVP_ENOMEM. */
int kvp__policy_evict(kvp_pool *pool, kvp__seq *s, kvp__evict_plan *ev, uint32_t layer, uint32_t head, uint32_t step);

extern const kvp__policy_vt kvp__policy_window, kvp__policy_multishot, kvp__policy_heatkv,
    kvp__policy_binary_heatkv;

typedef struct kvp__heatkv_cache kvp__heatkv_cache;

/* The pool's HeatKV plan cache (pages/policy_heatkv.c): freed at destroy,
 * after the last sequence; counts of plans built and reused. */
void kvp__heatkv_cache_fini(kvp_pool *pool);
void kvp__heatkv_cache_counts(const kvp_pool *pool, uint64_t *builds, uint64_t *hits);
/* Allocated bytes of every HeatKV atom [K][L][H] of a generation with
 * schedule sched[K] under the pool's codecs: atom (t, l, h) weighs the
 * size-class bytes of the blocks that hold step t's tokens of one head of
 * layer l, K and V. malloc'd (free()); NULL when out of memory. */
uint64_t *kvp__heatkv_atom_bytes(const kvp_pool *pool, const uint32_t *sched, uint32_t K);

#endif /* KVP_POLICY_H */
