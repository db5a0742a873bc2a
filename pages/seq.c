/*
 * pages/seq.c - sequences: the RCU hash table of live sequences, the step
 * protocol (begin, append per layer in order, end), fork, free and the
 * eviction entry points. Block lifetime (owners, pins, limbo) is
 * pages/block.c's; the walk kvp_check does is pages/fork.c's.
 *
 * Step protocol, per sequence:
 *   idle --step_begin(n)--> open(next_layer = 0) --append(l = next_layer)-->
 *   ... --append(L-1)--> open(next_layer = L) --step_end--> idle
 *   step_pos[k] = first position of step k; n_positions advances at step_end.
 */
#include "policy.h"

#include <string.h>

#define LFHT_INIT 64

static int seq_match(struct cds_lfht_node *node, const void *key) {
  kvp__rcu_subscribe(node);
  return caa_container_of(node, kvp__seq, node)->id == *(const uint64_t *)key;
}

static unsigned long seq_hash(uint64_t id) {
  id ^= id >> 33;
  id *= 0xff51afd7ed558ccdull;
  id ^= id >> 33;
  return (unsigned long)id;
}

int kvp__seqs_init(kvp_pool *pool) {
  pool->seqs = KVP__FAULT() ? NULL /* fault-injection build: a failed table */
                            : cds_lfht_new(LFHT_INIT, LFHT_INIT, 0, CDS_LFHT_AUTO_RESIZE | CDS_LFHT_ACCOUNTING, NULL);
  return pool->seqs ? KVP_OK : kvp__err(KVP_ENOMEM, "sequence hash table");
}

kvp__seq *kvp__seq_find(kvp_pool *pool, uint64_t id) {
  struct cds_lfht_iter it;
  cds_lfht_lookup(pool->seqs, seq_hash(id), seq_match, &id, &it);
  struct cds_lfht_node *n = cds_lfht_iter_get_node(&it);
  return n ? caa_container_of(n, kvp__seq, node) : NULL;
}

/* The writer's lookup (under the writer lock). A mutation finds its
 * sequence in pool->seq_cache first: one slot per hash value mod
 * KVP__SEQ_CACHE, holding the last sequence found there, cleared when that
 * sequence leaves the table (seq_release). A hit costs a load and a compare
 * instead of an RCU read-side section and the table's probe (a decode step
 * looks its sequence up once per layer); a miss goes to the table. */
static kvp__seq **cache_slot(kvp_pool *pool, uint64_t id) {
  return &pool->seq_cache[seq_hash(id) & (KVP__SEQ_CACHE - 1)];
}
static kvp__seq *find_w(kvp_pool *pool, uint64_t id) {
  kvp__seq **slot = cache_slot(pool, id);
  if (*slot && (*slot)->id == id) return *slot;
  kvp__rcu_read_lock();
  kvp__seq *s = kvp__seq_find(pool, id);
  kvp__rcu_read_unlock();
  if (s) *slot = s;
  return s;
}

/* ---- sequence objects --------------------------------------------------- */

static void policy_detach(kvp_pool *pool, kvp__seq *s);

static void seq_free_struct(kvp__meta *m, kvp__seq *s) {
  kvp__meta_free(m, s->pkeys, s->n_pkeys * sizeof *s->pkeys);
  kvp__meta_free(m, s->layers, s->layers_bytes);
  kvp__meta_free(m, s->streams, s->streams_bytes);
  kvp__meta_free(m, s->plan, s->n_plan * sizeof *s->plan);
  kvp__meta_free(m, s->step_pos, s->step_pos_cap * sizeof *s->step_pos);
  kvp__meta_free(m, s, sizeof *s);
}

kvp__seq *kvp__seq_alloc(kvp_pool *pool, uint64_t id, const uint32_t *plan, uint32_t n_plan) {
  kvp__seq *s = kvp__meta_calloc(&pool->meta, sizeof *s);
  if (!s) return NULL;
  s->id = id;
  s->serial = atomic_fetch_add_explicit(&pool->seq_serial, 1, memory_order_relaxed) + 1;
  s->layers_bytes = pool->cfg.n_layers * sizeof(kvp__layer);
  s->streams_bytes = (size_t)pool->cfg.n_layers * pool->cfg.n_kv_heads * sizeof(kvp__stream);
  s->layers = kvp__meta_calloc(&pool->meta, s->layers_bytes);
  s->streams = kvp__meta_calloc(&pool->meta, s->streams_bytes);
  s->step_pos_cap = 16;
  s->step_pos = kvp__meta_calloc(&pool->meta, s->step_pos_cap * sizeof *s->step_pos);
  if (n_plan) {
    s->plan = kvp__meta_alloc(&pool->meta, n_plan * sizeof *plan);
    if (s->plan) memcpy(s->plan, plan, n_plan * sizeof *plan);
    s->n_plan = n_plan;
  }
  cds_lfht_node_init(&s->node);
  if (s->layers && s->streams && s->step_pos && (!n_plan || s->plan)) return s;
  seq_free_struct(&pool->meta, s);
  return NULL;
}

static void seq_free_cb(kvp__rcu_head *h) {
  kvp__rcu_cb_begin(h);
  seq_free_struct(NULL, caa_container_of(h, kvp__seq, rcu));
}

/* Unlink every run and bref of s (they and s go after a grace period) and
 * drop its block ownerships. */
static void seq_release(kvp_pool *pool, kvp__seq *s, bool readers_may_hold) {
  uint32_t L = pool->cfg.n_layers, H = pool->cfg.n_kv_heads;
  kvp__seq **slot = cache_slot(pool, s->id);
  if (*slot == s) *slot = NULL; /* out of the table: out of the writer's cache */
  policy_detach(pool, s); /* the writer's alone */
  kvp__prefix_release(pool, s, readers_may_hold);
  int64_t retained = 0;
  for (uint32_t l = 0; l < L; l++) {
    for (kvp__run *r = s->layers[l].runs, *n; r; r = n) {
      n = r->next;
      if (readers_may_hold) kvp__run_retire(pool, r);
      else kvp__run_free_now(pool, r);
    }
    for (uint32_t h = 0; h < H; h++) {
      kvp__stream *st = kvp__seq_stream(pool, s, l, h);
      retained += atomic_load_explicit(&st->retained_tokens, memory_order_relaxed);
      kvp__cstate_free(pool, st, l); /* the writer's alone: no grace period */
      for (kvp__bref *b = st->blocks, *n; b; b = n) {
        n = b->next;
        kvp__block_unown(pool, b->blk);
        if (readers_may_hold) kvp__bref_retire(pool, b);
        else kvp__bref_free_now(pool, b);
      }
    }
  }
  kvp__count_tokens(pool, -retained, 0);
  /* the content keys are the writer's alone (no reader looks at them):
   * freed now, so the next sequence's keys land in memory already touched */
  kvp__meta_free(&pool->meta, s->pkeys, s->n_pkeys * sizeof *s->pkeys);
  s->pkeys = NULL;
  s->n_pkeys = 0;
  kvp__ledger_begin(&pool->alloc.ledger);
  kvp__gauge_sub(&pool->alloc.ledger.sequences, 1);
  kvp__ledger_end(&pool->alloc.ledger);
  if (readers_may_hold) {
    kvp__meta_uncount(&pool->meta, s->layers, s->layers_bytes);
    kvp__meta_uncount(&pool->meta, s->streams, s->streams_bytes);
    kvp__meta_uncount(&pool->meta, s->plan, s->n_plan * sizeof *s->plan);
    kvp__meta_uncount(&pool->meta, s->step_pos, s->step_pos_cap * sizeof *s->step_pos);
    kvp__meta_uncount(&pool->meta, s, sizeof *s);
    kvp__rcu_call(&s->rcu, seq_free_cb);
  } else {
    seq_free_struct(&pool->meta, s);
  }
}

void kvp__seqs_fini(kvp_pool *pool) {
  if (!pool->seqs) return;
  struct cds_lfht_iter it;
  struct cds_lfht_node *n;
  kvp__rcu_read_lock();
  cds_lfht_for_each(pool->seqs, &it, n) {
    kvp__seq *s = caa_container_of(n, kvp__seq, node);
    cds_lfht_del(pool->seqs, n);
    seq_release(pool, s, false);
  }
  kvp__rcu_read_unlock();
  for (kvp__block *b = pool->orphans, *nb; b; b = nb) { /* views not released: the pool goes anyway */
    nb = b->onext;
    kvp__block_destroy(pool, b);
  }
  pool->orphans = NULL;
  for (kvp__block *b = pool->limbo, *nb; b; b = nb) {
    nb = b->onext;
    kvp__block_destroy(pool, b);
  }
  pool->limbo = NULL;
  kvp__prefix_fini(pool); /* empty by now: every block lost its owners */
  kvp__rcu_barrier(); /* queued frees of runs, brefs and sequences */
  cds_lfht_destroy(pool->seqs, NULL);
  pool->seqs = NULL;
}

/* ---- policies --------------------------------------------------------------- */

static void policy_detach(kvp_pool *pool, kvp__seq *s) {
  if (s->pol && s->pol->vt && s->pol->vt->seq_free) s->pol->vt->seq_free(s->pol_state);
  if (s->pol_own) {
    kvp__policy_free(s->pol_own);
    kvp__meta_free(&pool->meta, s->pol_own, sizeof *s->pol_own);
  }
  if (s->pol_spec) kvp__meta_free(&pool->meta, s->pol_spec, strlen(s->pol_spec) + 1);
  s->pol = s->pol_own = NULL;
  s->pol_spec = NULL;
  s->pol_state = NULL;
}

/* The sequence's policy: its own spec (when given) or the pool's. */
static int policy_attach(kvp_pool *pool, kvp__seq *s, const char *spec, const kvp_seq_config *sc) {
  int rc = KVP_OK;
  s->pol = pool->policy;
  if (spec) {
    size_t n = strlen(spec) + 1;
    if (!(s->pol_own = kvp__meta_calloc(&pool->meta, sizeof *s->pol_own)) || !(s->pol_spec = kvp__meta_alloc(&pool->meta, n)))
      rc = kvp__err(KVP_ENOMEM, "policy of sequence %llu", (unsigned long long)s->id);
    else {
      memcpy(s->pol_spec, spec, n);
      rc = kvp__policy_parse(spec, s->pol_own);
    }
    s->pol = s->pol_own;
  }
  if (!rc && s->pol && s->pol->vt && s->pol->vt->seq_add) rc = s->pol->vt->seq_add(pool, s->pol->cfg, s, sc, &s->pol_state);
  if (rc) policy_detach(pool, s);
  return rc;
}

/* ---- public: sequences -------------------------------------------------- */

KVP_API void kvp_seq_config_init(kvp_seq_config *sc) {
  if (!sc) return;
  memset(sc, 0, sizeof *sc);
  sc->struct_size = sizeof *sc;
  sc->mode = KVP_SEQ_STREAM;
}

static int seq_config_check(const kvp_seq_config *in, kvp_seq_config *c) {
  kvp_seq_config_init(c);
  if (!in) return KVP_OK;
  if (in->struct_size == 0 || in->struct_size > sizeof *c)
    return kvp__err(KVP_EINVAL, "seq_config.struct_size %zu: call kvp_seq_config_init (this library knows %zu)",
                    in->struct_size, sizeof *c);
  memcpy(c, in, in->struct_size);
  if (c->mode != KVP_SEQ_STREAM && c->mode != KVP_SEQ_STEP)
    return kvp__err(KVP_EINVAL, "seq_config.mode = %d is neither KVP_SEQ_STREAM nor KVP_SEQ_STEP", (int)c->mode);
  if (c->n_steps && !c->step_tokens) return kvp__err(KVP_EINVAL, "seq_config.step_tokens is NULL with n_steps %u", c->n_steps);
  uint64_t total = 0;
  for (uint32_t k = 0; k < c->n_steps; k++) {
    if (!c->step_tokens[k] || c->step_tokens[k] > KVP_MAX_STEP_TOKENS)
      return kvp__err(KVP_EINVAL, "seq_config.step_tokens[%u] = %u: must be 1..%u", k, c->step_tokens[k],
                      KVP_MAX_STEP_TOKENS);
    total += c->step_tokens[k];
  }
  if (total > KVP_MAX_SEQ_TOKENS) return kvp__err(KVP_EINVAL, "seq_config plans %llu tokens, more than %u",
                                                  (unsigned long long)total, KVP_MAX_SEQ_TOKENS);
  if (c->n_tokens && !c->tokens) return kvp__err(KVP_EINVAL, "seq_config.tokens is NULL with n_tokens %u", c->n_tokens);
  if (c->n_tokens && c->n_steps)
    return kvp__err(KVP_EINVAL, "seq_config: tokens (prefix sharing) and step_tokens (a planned schedule) exclude "
                                "each other");
  if (!(c->budget_fraction >= 0 && c->budget_fraction <= 1))
    return kvp__err(KVP_EINVAL, "seq_config.budget_fraction = %g: must be in [0, 1]", c->budget_fraction);
  return KVP_OK;
}

/* The prompt's content keys, and the longest prefix of them the table
 * holds attached as step 0 (a new sequence, not yet published). Cost: one
 * kvp__hash128 pass over the prompt, one table probe and one chunk-level
 * reference per chunk attached. */
static int prompt_attach(kvp_pool *pool, kvp__seq *s, const uint32_t *tokens, uint32_t n_tokens) {
  uint32_t bt = pool->chunk_tokens, n = bt ? n_tokens / bt : 0;
  kvp__ledger_begin(&pool->alloc.ledger);
  kvp__count_add(&pool->alloc.ledger.prefix_query_tokens, n_tokens);
  kvp__ledger_end(&pool->alloc.ledger);
  if (!n) return KVP_OK;
  if (!(s->pkeys = kvp__meta_alloc(&pool->meta, n * sizeof *s->pkeys)))
    return kvp__err(KVP_ENOMEM, "content keys of sequence %llu (%u chunks)", (unsigned long long)s->id, n);
  s->n_pkeys = n;
  s->max_hit = (n_tokens - 1) / bt; /* at least one prompt token is left to compute */
  kvp__prefix_keys(pool, tokens, n, s->pkeys);
  if (!kvp__prefix_ok(pool, s)) {
    s->next_reg = n;
    return KVP_OK;
  }
  kvp__chunk **hit = kvp__meta_alloc(NULL, s->max_hit * sizeof *hit + 1);
  if (!hit) return kvp__err(KVP_ENOMEM, "prefix lookup of sequence %llu", (unsigned long long)s->id);
  uint32_t m = kvp__prefix_lookup(pool, s, hit, s->max_hit);
  int rc = KVP_OK;
  if (m && !(rc = kvp__prefix_attach(pool, s, m, hit))) {
    kvp__ledger_begin(&pool->alloc.ledger);
    kvp__count_add(&pool->alloc.ledger.prefix_hit_tokens, (int64_t)m * bt);
    kvp__ledger_end(&pool->alloc.ledger);
  }
  s->next_reg = m;
  kvp__meta_free(NULL, hit, s->max_hit * sizeof *hit + 1);
  return rc;
}

KVP_API int kvp_seq_add(kvp_pool *pool, uint64_t seq, const kvp_seq_config *sc) {
  if (!pool) return kvp__err(KVP_EINVAL, "pool is NULL");
  kvp_seq_config c;
  int rc = seq_config_check(sc, &c);
  if (rc) return rc;
  kvp__lock(pool);
  if (find_w(pool, seq)) {
    kvp__unlock(pool);
    return kvp__err(KVP_EEXIST, "sequence %llu already exists", (unsigned long long)seq);
  }
  kvp__seq *s = kvp__seq_alloc(pool, seq, c.step_tokens, c.n_steps);
  if (!s) {
    kvp__unlock(pool);
    return kvp__err(KVP_ENOMEM, "metadata of sequence %llu", (unsigned long long)seq);
  }
  s->mode = c.mode;
  s->budget_fraction = c.budget_fraction;
  if ((rc = policy_attach(pool, s, c.policy, &c))) {
    seq_free_struct(&pool->meta, s);
    kvp__unlock(pool);
    return rc;
  }
  if (c.n_tokens && (rc = prompt_attach(pool, s, c.tokens, c.n_tokens))) {
    policy_detach(pool, s);
    seq_free_struct(&pool->meta, s);
    kvp__unlock(pool);
    return rc;
  }
  kvp__seq_publish(pool, s);
  pool->w_pure = true; /* a new sequence: no other's structure changed (kept tables look sequences up) */
  kvp__unlock(pool);
  return KVP_OK;
}

void kvp__seq_publish(kvp_pool *pool, kvp__seq *s) {
  kvp__rcu_publish(&s->node);
  kvp__rcu_read_lock();
  cds_lfht_add(pool->seqs, seq_hash(s->id), &s->node);
  kvp__rcu_read_unlock();
  kvp__ledger_begin(&pool->alloc.ledger);
  kvp__gauge_add(&pool->alloc.ledger.sequences, 1);
  kvp__ledger_end(&pool->alloc.ledger);
}

void kvp__seq_free_struct(kvp_pool *pool, kvp__seq *s) {
  policy_detach(pool, s);
  seq_free_struct(&pool->meta, s);
}

void kvp__seq_remove(kvp_pool *pool, kvp__seq *s) {
  kvp__rcu_read_lock();
  cds_lfht_del(pool->seqs, &s->node);
  kvp__rcu_read_unlock();
  seq_release(pool, s, true);
  kvp__reclaim(pool);
}

/* Look up seq for a mutation; on failure the lock is released. The calls
 * that take it (free, fork, step begin and end, append, evict) change the
 * structure of that sequence alone: its sgen is odd until kvp__unlock, and
 * the pool's goes back then (pages.h). */
static int lock_seq(kvp_pool *pool, uint64_t seq, kvp__seq **out) {
  if (!pool) return kvp__err(KVP_EINVAL, "pool is NULL");
  kvp__lock(pool);
  if ((*out = find_w(pool, seq))) {
    if (pool->acache) {
      atomic_fetch_add(&(*out)->sgen, 1); /* odd (sequentially consistent: before any change) */
      pool->w_seq = *out;
    }
    return KVP_OK;
  }
  kvp__unlock(pool);
  return kvp__err(KVP_ENOENT, "sequence %llu does not exist", (unsigned long long)seq);
}

KVP_API int kvp_seq_free(kvp_pool *pool, uint64_t seq) {
  kvp__seq *s;
  int rc = lock_seq(pool, seq, &s);
  if (rc) return rc;
  if (pool->w_seq) atomic_fetch_sub(&s->sgen, 1), pool->w_seq = NULL; /* s goes (after a grace period) */
  kvp__rcu_read_lock();
  cds_lfht_del(pool->seqs, &s->node);
  kvp__rcu_read_unlock();
  seq_release(pool, s, true);
  kvp__reclaim(pool);
  pool->w_pure = true; /* only s's structure went (kept tables look sequences up: pages/attend_kept.c) */
  kvp__unlock(pool);
  return KVP_OK;
}

KVP_API int kvp_seq_fork(kvp_pool *pool, uint64_t parent, uint64_t child) {
  kvp__seq *p;
  int rc = lock_seq(pool, parent, &p);
  if (rc) return rc;
  kvp__seq *c = NULL;
  if (find_w(pool, child))
    rc = kvp__err(KVP_EEXIST, "fork of %llu: sequence %llu already exists", (unsigned long long)parent,
                  (unsigned long long)child);
  else if (atomic_load_explicit(&p->in_step, memory_order_relaxed))
    rc = kvp__err(KVP_EBUSY, "fork of %llu: a step is open (fork between steps)", (unsigned long long)parent);
  else if (!(c = kvp__seq_alloc(pool, child, p->plan, p->n_plan)))
    rc = kvp__err(KVP_ENOMEM, "metadata of sequence %llu", (unsigned long long)child);
  else if ((c->mode = p->mode, c->budget_fraction = p->budget_fraction, /* the policy checks them */
            rc = policy_attach(pool, c, p->pol_spec, &(kvp_seq_config){.struct_size = sizeof(kvp_seq_config),
                                                                          .mode = p->mode, .step_tokens = p->plan,
                                                                          .n_steps = p->n_plan,
                                                                          .budget_fraction = p->budget_fraction})))
    seq_free_struct(&pool->meta, c);
  else if ((rc = kvp__seq_fork_locked(pool, p, c))) {
    policy_detach(pool, c);
    seq_free_struct(&pool->meta, c);
  } else {
    if (c->pol && c->pol->vt && c->pol->vt->seq_copy && p->pol && p->pol->vt == c->pol->vt) /* cursors, shot */
      c->pol->vt->seq_copy(pool, c->pol->cfg, p->pol_state, c->pol_state);
    kvp__rcu_publish(&c->node);
    kvp__rcu_read_lock();
    cds_lfht_add(pool->seqs, seq_hash(child), &c->node);
    kvp__rcu_read_unlock();
    kvp__ledger_begin(&pool->alloc.ledger);
    kvp__gauge_add(&pool->alloc.ledger.sequences, 1);
    kvp__ledger_end(&pool->alloc.ledger);
    pool->w_pure = true; /* the parent's structure stays (its OPEN blocks are copied, sealed ones shared) */
  }
  kvp__unlock(pool);
  return rc;
}

/* ---- public: steps ------------------------------------------------------ */

KVP_API int kvp_step_begin(kvp_pool *pool, uint64_t seq, uint32_t n_tokens, uint32_t flags) {
  kvp__seq *s;
  int rc = lock_seq(pool, seq, &s);
  if (rc) return rc;
  uint32_t k = atomic_load_explicit(&s->n_steps, memory_order_relaxed);
  uint32_t pos = atomic_load_explicit(&s->n_positions, memory_order_relaxed);
  if (atomic_load_explicit(&s->in_step, memory_order_relaxed))
    rc = kvp__err(KVP_EBUSY, "sequence %llu: step %u is still open (call kvp_step_end first)", (unsigned long long)seq,
                  k - 1);
  else if (flags & ~KVP_STEP_SCENE_CUT)
    rc = kvp__err(KVP_EINVAL, "sequence %llu step %u: flags 0x%x has unknown bits 0x%x (known: KVP_STEP_SCENE_CUT)",
                  (unsigned long long)seq, k, flags, flags & ~KVP_STEP_SCENE_CUT);
  else if (n_tokens == 0 || n_tokens > KVP_MAX_STEP_TOKENS)
    rc = kvp__err(KVP_EINVAL, "sequence %llu step %u: n_tokens = %u must be 1..%u", (unsigned long long)seq, k, n_tokens,
                  KVP_MAX_STEP_TOKENS);
  else if (k < s->n_plan && s->plan[k] != n_tokens)
    rc = kvp__err(KVP_EINVAL, "sequence %llu step %u: n_tokens = %u but the plan says %u", (unsigned long long)seq, k,
                  n_tokens, s->plan[k]);
  else if ((uint64_t)pos + n_tokens > KVP_MAX_SEQ_TOKENS)
    rc = kvp__err(KVP_EINVAL, "sequence %llu: %u more tokens pass the limit of %u positions", (unsigned long long)seq,
                  n_tokens, KVP_MAX_SEQ_TOKENS);
  else if (k + 2 > s->step_pos_cap) {
    uint32_t ncap = s->step_pos_cap * 2;
    uint32_t *np = kvp__meta_realloc(&pool->meta, s->step_pos, s->step_pos_cap * sizeof *np, ncap * sizeof *np);
    if (!np) rc = kvp__err(KVP_ENOMEM, "step table of sequence %llu", (unsigned long long)seq);
    else {
      s->step_pos = np;
      s->step_pos_cap = ncap;
    }
  }
  kvp__evict_plan ev; /* the policy's evictions: taken ahead, applied only when the step begins */
  kvp__evict_plan_init(&ev);
  if (!rc && s->pol && s->pol->vt && s->pol->vt->step_begin) {
    s->step_pos[k] = pos; /* the policy may look at the step's position */
    rc = s->pol->vt->step_begin(pool, s->pol->cfg, s, s->pol_state, k, flags, &ev);
    if (!rc) rc = kvp__evict_plan_prepare(pool, &ev);
    if (!rc) kvp__evict_plan_apply(pool, s, &ev);
  }
  kvp__evict_plan_fini(pool, &ev);
  /* a step's positions are no structure; a policy's evictions are */
  pool->w_pure = !(s->pol && s->pol->vt && s->pol->vt->step_begin);
  if (!rc) {
    s->step_pos[k] = pos;
    s->step_pos[k + 1] = pos + n_tokens;
    s->cur_tokens = n_tokens;
    s->cur_flags = flags;
    s->next_layer = 0;
    atomic_store_explicit(&s->in_step, 1, memory_order_relaxed);
    atomic_store_explicit(&s->n_steps, k + 1, memory_order_release);
  }
  kvp__unlock(pool);
  return rc;
}

static int kv_check(const kvp_pool *pool, uint64_t seq, uint32_t layer, const kvp_kv *kv) {
  if (!kv) return kvp__err(KVP_EINVAL, "seq %llu layer %u: kv is NULL", (unsigned long long)seq, layer);
  if (kv->stream && pool->cfg.memory == KVP_MEM_HOST)
    return kvp__err(KVP_EINVAL, "seq %llu layer %u: kv->stream = %p on a host pool (a CUDA stream needs a "
                    "KVP_MEM_CUDA region; pass NULL)", (unsigned long long)seq, layer, kv->stream);
  const void *p[2] = {kv->k, kv->v};
  kvp_dtype dt[2] = {pool->cfg.k_dtype, pool->cfg.v_dtype};
  for (int i = 0; i < 2; i++) {
    size_t align = dt[i] == KVP_DTYPE_F32 ? 4 : 2;
    if (!p[i]) return kvp__err(KVP_EINVAL, "seq %llu layer %u: kv->%c is NULL", (unsigned long long)seq, layer, "kv"[i]);
    if ((uintptr_t)p[i] % align)
      return kvp__err(KVP_EINVAL, "seq %llu layer %u: kv->%c = %p is not aligned to its dtype (%zu bytes)",
                      (unsigned long long)seq, layer, "kv"[i], p[i], align);
  }
  return KVP_OK;
}

/* Whether the sequence's policy has a say in an append (a hook there). When
 * not, policy_plan would leave the skip mask zero and both plans empty, and
 * the append needs no transaction (kvp__append_layer takes NULL for both). */
static bool policy_acts(const kvp__seq *s) {
  const kvp__policy_vt *vt = s->pol ? s->pol->vt : NULL;
  return vt && (vt->before_append || vt->after_append);
}

/* The policy's plans for one append: its evictions before and after the
 * layer is stored, and the heads to skip; their runs taken ahead. */
static int policy_plan(kvp_pool *pool, kvp__seq *s, uint32_t layer, uint64_t *skip, kvp__append_tx *tx) {
  memset(skip, 0, KVP_MAX_KV_HEADS / 8);
  uint32_t step = atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1;
  const kvp__policy_vt *vt = s->pol ? s->pol->vt : NULL;
  int rc = KVP_OK;
  if (vt && vt->before_append)
    rc = vt->before_append(pool, s->pol->cfg, s, s->pol_state, layer, step, skip, &tx->before);
  if (!rc && vt && vt->after_append) rc = vt->after_append(pool, s->pol->cfg, s, s->pol_state, layer, step, &tx->after);
  return rc ? rc : kvp__append_tx_prepare(pool, tx);
}

KVP_API int kvp_append(kvp_pool *pool, uint64_t seq, uint32_t layer, const kvp_kv *kv) {
  uint64_t skip[KVP_MAX_KV_HEADS / 64];
  kvp__seq *s;
  int rc = lock_seq(pool, seq, &s);
  if (rc) return rc;
  uint32_t L = pool->cfg.n_layers;
  if (!atomic_load_explicit(&s->in_step, memory_order_relaxed))
    rc = kvp__err(KVP_EINVAL, "seq %llu layer %u: append outside a step (call kvp_step_begin)", (unsigned long long)seq,
                  layer);
  else if (layer >= L)
    rc = kvp__err(KVP_EINVAL, "seq %llu: layer %u >= n_layers %u", (unsigned long long)seq, layer, L);
  else if (layer < s->next_layer)
    rc = kvp__err(KVP_EINVAL, "seq %llu: layer %u appended twice in step %u", (unsigned long long)seq, layer,
                  atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1);
  else if (layer > s->next_layer)
    rc = kvp__err(KVP_EINVAL, "seq %llu: layer %u out of order (layer %u comes next in step %u)",
                  (unsigned long long)seq, layer, s->next_layer, atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1);
  else if (!(rc = kv_check(pool, seq, layer, kv))) {
    pool->w_fill = false;
    if (!policy_acts(s)) { /* nothing to plan: no skip mask, no evictions, no transaction */
      rc = kvp__append_layer(pool, s, layer, kv, NULL, NULL);
    } else { /* one transaction: the layer and its policy's evictions */
      kvp__append_tx tx;
      kvp__append_tx_init(&tx);
      if (!(rc = policy_plan(pool, s, layer, skip, &tx))) rc = kvp__append_layer(pool, s, layer, kv, skip, &tx);
      kvp__append_tx_fini(pool, &tx);
    }
    if (!rc) s->next_layer++;
    pool->w_pure = !rc && pool->w_fill; /* one publish that filled OPEN tails or moved its layer's tgen */
  }
  kvp__unlock(pool);
  return rc;
}

KVP_API int kvp_step_end(kvp_pool *pool, uint64_t seq) {
  kvp__seq *s;
  int rc = lock_seq(pool, seq, &s);
  if (rc) return rc;
  if (!atomic_load_explicit(&s->in_step, memory_order_relaxed))
    rc = kvp__err(KVP_EINVAL, "sequence %llu: no step is open", (unsigned long long)seq);
  else if (s->next_layer != pool->cfg.n_layers)
    rc = kvp__err(KVP_EINVAL, "sequence %llu step %u: ended after %u of %u layers", (unsigned long long)seq,
                  atomic_load_explicit(&s->n_steps, memory_order_relaxed) - 1, s->next_layer, pool->cfg.n_layers);
  else {
    atomic_store_explicit(&s->n_positions, atomic_load_explicit(&s->n_positions, memory_order_relaxed) + s->cur_tokens,
                          memory_order_release);
    atomic_store_explicit(&s->in_step, 0, memory_order_release);
    pool->w_pure = s->next_reg >= s->n_pkeys; /* a reclaim frees only unlinked blocks: no structure */
    if (s->next_reg < s->n_pkeys) kvp__prefix_register(pool, s); /* prompt chunks completed by this step */
    uint64_t limit = pool->alloc.ledger.budget_bytes / 256;
    if (pool->alloc.ledger.retired.current >= (limit > (1u << 20) ? limit : (1u << 20))) kvp__reclaim(pool);
  }
  kvp__unlock(pool);
  return rc;
}

KVP_API int kvp_evict(kvp_pool *pool, uint64_t seq, uint32_t layer, uint32_t head, uint32_t step) {
  kvp__seq *s;
  int rc = lock_seq(pool, seq, &s);
  if (rc) return rc;
  if (layer >= pool->cfg.n_layers)
    rc = kvp__err(KVP_EINVAL, "evict seq %llu: layer %u >= n_layers %u", (unsigned long long)seq, layer,
                  pool->cfg.n_layers);
  else if (head >= pool->cfg.n_kv_heads)
    rc = kvp__err(KVP_EINVAL, "evict seq %llu: head %u >= n_kv_heads %u", (unsigned long long)seq, head,
                  pool->cfg.n_kv_heads);
  else if (step >= atomic_load_explicit(&s->n_steps, memory_order_relaxed))
    rc = kvp__err(KVP_ENOENT, "evict seq %llu: step %u was never begun (%u steps)", (unsigned long long)seq, step,
                  atomic_load_explicit(&s->n_steps, memory_order_relaxed));
  else if (!(rc = kvp__evict_one(pool, s, layer, head, step)))
    kvp__reclaim(pool);
  kvp__unlock(pool);
  return rc;
}
