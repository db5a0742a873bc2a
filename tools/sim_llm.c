/*
 * tools/sim_llm.c - kvpool-sim llm: continuous batching like vLLM, through
 * the pool's public ABI, under the pool's strict byte budget.
 *
 * Requests come from a trace (traces.h) or from the synthetic generator
 * (Poisson arrivals, lognormal prompt and output lengths shaped like chat
 * traffic). Every request is a KVP_SEQ_STREAM sequence. One iteration:
 *
 *   1. arrivals up to the clock join the waiting queue (FIFO; a preempted
 *      request goes back to its front)
 *   2. decode: every running request whose prefill is done appends one token
 *      (a step of 1 token, every layer); when the budget refuses, the most
 *      recently admitted running request is preempted by recompute (its
 *      sequence freed, its context to be prefilled again) and the append is
 *      retried; a request that is itself the last one preempts itself
 *   3. prefill: running requests still prefilling, then waiting requests,
 *      take chunks of the remaining --max-batch-tokens; a waiting request is
 *      admitted only if the pool's free budget holds its whole prefill (the
 *      bytes per token come from a probe pool with the same geometry and
 *      codecs) plus a 1% watermark, and the pool has the last word: a chunk
 *      it refuses leaves the request waiting, with nothing allocated
 *   4. the clock advances by the cost model (sim.h) over the batch's tokens
 *      and the KV bytes it holds; finished requests free their sequences
 *
 * A prefill of prompt + generated tokens produces the next output token, so
 * the first token comes at the end of the prefill (TTFT) and each decode
 * produces one more (TPOT). A request that cannot fit an empty pool is
 * rejected (counted, never retried).
 *
 * The store tier (--store URL): the same run again, beside the recompute
 * baseline, where
 *   - a preempted request is offloaded (kvp_seq_offload) instead of freed,
 *     and restored whole (kvp_seq_restore) when it is admitted again: its
 *     context is not recomputed. An open step cannot be offloaded, so room
 *     is made before a step opens (store_make_room); a refusal inside a
 *     step (the estimate fell short) still preempts by recompute;
 *   - a prompt carries token ids, so equal prefixes share blocks: mooncake's
 *     hash_ids name 512-token blocks, and block id h becomes the tokens
 *     tok(h, j) = mix64(h * 512 + j) >> 32, j < 512 (equal ids, equal
 *     tokens; the pool keys its blocks by the tokens, so any --block-tokens
 *     works, and a divisor of 512 loses no hit). Admission attaches what the
 *     pool's prefix table holds, then what the store holds
 *     (kvp_prefix_fetch); a finished request publishes its prompt's chunks
 *     (kvp_prefix_publish) for those that come after it. A store URL with
 *     max_bytes= bounds the server's memory: an offload it refuses is a
 *     recompute, a publish it stops is counted (store_publish_refusals).
 *   - the clock adds the bytes offloads, restores and fetches move, over
 *     --store-gbs; publishing is write-behind and costs no simulated time.
 * Traces without hash ids (azure, sharegpt, synthetic) share no prefixes.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sim.h"
#include "traces.h"

typedef struct llm_preset {
  const char *name;
  uint32_t L, H, D;
  double params;
} llm_preset;

static const llm_preset PRESETS[] = {
    {"llama-2-7b", 32, 32, 128, 6.74e9},  /* MHA: 32 KV heads */
    {"llama-3-8b", 32, 8, 128, 8.03e9},   /* GQA: 8 KV heads */
    {"llama-2-70b", 80, 8, 128, 68.98e9}, /* GQA: 8 KV heads */
};

void sim_llm_defaults(sim_llm_cfg *c) {
  memset(c, 0, sizeof *c);
  sim_llm_preset(c, "llama-3-8b");
  c->budget_bytes = 2ull << 30;
  c->max_batch_tokens = 2048;
  c->block_tokens = 0; /* the pool's choice per layer, from its codecs */
  c->max_running = 256;
  c->requests = 200;
  c->rate = 4.0;
  c->prompt_median = 1020; /* the Azure conversation trace's medians */
  c->output_median = 129;
  c->max_prompt = 8192;
  c->max_output = 1024;
  c->store_bw = 10e9;
}

int sim_llm_preset(sim_llm_cfg *c, const char *name) {
  for (size_t i = 0; i < sizeof PRESETS / sizeof *PRESETS; i++)
    if (!strcmp(PRESETS[i].name, name)) {
      c->model = PRESETS[i].name;
      c->n_layers = PRESETS[i].L;
      c->n_kv_heads = PRESETS[i].H;
      c->head_dim = PRESETS[i].D;
      c->params = PRESETS[i].params;
      return 0;
    }
  return -1;
}

enum { ST_FUTURE, ST_WAITING, ST_RUNNING, ST_DONE, ST_REJECTED };

typedef struct req {
  double arrival_s;      /* when it arrives */
  uint32_t prompt;       /* prompt tokens */
  uint32_t output;       /* tokens to generate */
  uint32_t generated;    /* output tokens produced */
  uint32_t cached;       /* tokens in the cache (this admission) */
  uint32_t target;       /* tokens the prefill covers: prompt + generated at admission */
  int decoding;          /* the prefill is done: one token per iteration */
  int state;             /* ST_* */
  uint64_t seq;          /* sequence id while running */
  double first_token_s;  /* time of the first output token */
  double finish_s;       /* time of the last */
  size_t hash0;          /* first of its prompt's block ids in llm.hash */
  uint32_t nblk;         /* block ids of its prompt (mooncake), else 0 */
  int offloaded;         /* its sequence waits in the store */
  uint32_t pool_hit, store_hit; /* prompt tokens attached at this admission: pool table, store */
} req;

typedef struct llm {
  const sim_llm_cfg *c;
  kvp_pool *pool;
  req *r;                /* [n] in arrival order */
  size_t n;
  size_t *running;       /* indices, admission order */
  size_t nrun;
  size_t *waiting;       /* deque of indices: [wh, wt) */
  size_t wh, wt, wcap;
  size_t next_arrival;   /* first ST_FUTURE index */
  uint64_t next_seq;     /* next sequence id */
  void *k, *v;           /* synthetic K/V of max_batch_tokens */
  double bytes_per_token; /* allocated bytes a cached token costs, every layer and head */
  double open_bytes;     /* bytes of the OPEN blocks of one sequence */
  sim_llm_out *o;
  uint64_t done;         /* requests finished or rejected */
  kvp_store *st;         /* --store, or NULL */
  uint64_t *hash;        /* the trace's block ids (req.hash0), or NULL */
  uint32_t *tokens;      /* scratch: one prompt's token ids */
  uint32_t bt;           /* layer 0's stream-mode block size (the pool's choice when --block-tokens is 0) */
} llm;

static void gen_synthetic(const sim_llm_cfg *c, uint64_t seed, trace *t) {
  t->n = c->requests;
  t->reqs = calloc(t->n, sizeof *t->reqs);
  if (!t->reqs) sim_die("out of memory for %zu requests", t->n);
  uint64_t s = seed;
  double clock = 0;
  for (size_t i = 0; i < t->n; i++) {
    clock += -log(sim_rng_unit(&s)) / c->rate;
    double u1 = sim_rng_unit(&s), u2 = sim_rng_unit(&s), u3 = sim_rng_unit(&s), u4 = sim_rng_unit(&s);
    double z1 = sqrt(-2 * log(u1)) * cos(2 * M_PI * u2), z2 = sqrt(-2 * log(u3)) * cos(2 * M_PI * u4);
    double p = c->prompt_median * exp(0.77 * z1), g = c->output_median * exp(0.93 * z2);
    t->reqs[i].arrival_s = clock;
    t->reqs[i].prompt_tokens = (uint32_t)fmin(fmax(round(p), 1), c->max_prompt);
    t->reqs[i].output_tokens = (uint32_t)fmin(fmax(round(g), 1), c->max_output);
  }
  t->has_arrivals = 1;
}

/* Allocated bytes per cached token and of the OPEN blocks, from a one-head
 * pool with the same layers and codecs (every head has the same pages). */
static void probe(llm *m, const sim_common *com) {
  const sim_llm_cfg *c = m->c;
  kvp_config k;
  kvp_config_init(&k);
  k.n_layers = c->n_layers;
  k.n_kv_heads = 1;
  k.head_dim = c->head_dim;
  k.block_tokens = c->block_tokens;
  k.region_bytes = 256ull << 20;
  k.codecs = c->codecs;
#ifdef KVP_POOL_DRY
  if (com->dry) k.flags |= KVP_POOL_DRY; /* the same pages and bytes, no payload */
#endif
  kvp_pool *p;
  int rc = kvp_pool_create(&k, &p);
  if (rc) sim_die_kvp("kvp_pool_create (probe)", rc);
  enum { N = 1024 };
  void *kb = sim_kv_alloc(N, 1, c->head_dim, KVP_DTYPE_BF16, 1, 1), *vb = sim_kv_alloc(N, 1, c->head_dim, KVP_DTYPE_BF16, 1, 0);
  kvp_stats s;
  if ((rc = kvp_seq_add(p, 1, NULL)) || (rc = kvp_step_begin(p, 1, 1, 0))) sim_die_kvp("probe", rc);
  for (uint32_t l = 0; l < c->n_layers; l++)
    if ((rc = kvp_append(p, 1, l, &(kvp_kv){kb, vb, NULL}))) sim_die_kvp("probe append", rc);
  if ((rc = kvp_step_end(p, 1))) sim_die_kvp("probe", rc);
  sim_stats(p, &s);
  m->open_bytes = (double)s.bytes_allocated.current * c->n_kv_heads;
  if ((rc = kvp_step_begin(p, 1, N - 1, 0))) sim_die_kvp("probe", rc);
  for (uint32_t l = 0; l < c->n_layers; l++)
    if ((rc = kvp_append(p, 1, l, &(kvp_kv){kb, vb, NULL}))) sim_die_kvp("probe append", rc);
  if ((rc = kvp_step_end(p, 1)) || (rc = kvp_reclaim(p))) sim_die_kvp("probe", rc);
  sim_stats(p, &s);
  m->bytes_per_token = (double)s.bytes_allocated.current * c->n_kv_heads / N;
  kvp_pool_destroy(p);
  free(kb);
  free(vb);
}

static void wait_push_back(llm *m, size_t i) {
  if (m->wt == m->wcap) sim_die("internal: waiting queue overflow");
  m->waiting[m->wt++] = i;
  m->r[i].state = ST_WAITING;
}

static void wait_push_front(llm *m, size_t i) {
  if (m->wh == 0) sim_die("internal: waiting queue underflow");
  m->waiting[--m->wh] = i;
  m->r[i].state = ST_WAITING;
}

static void drop_running(llm *m, size_t pos) {
  memmove(m->running + pos, m->running + pos + 1, (m->nrun - pos - 1) * sizeof *m->running);
  m->nrun--;
}

static void seq_free(llm *m, req *q) {
  int rc = kvp_seq_free(m->pool, q->seq);
  if (rc) sim_die_kvp("kvp_seq_free", rc);
}

/* Preempt running[pos]: to the store when there is one and its step is
 * closed (in_step: it is the one appending); else by recompute: its
 * sequence goes, and its whole context (prompt + generated) will be
 * prefilled again. */
static void preempt_at(llm *m, size_t pos, int in_step) {
  size_t i = m->running[pos];
  req *q = &m->r[i];
  if (m->st && !in_step) {
    int rc = kvp_seq_offload(m->pool, q->seq, m->st);
    if (!rc) {
      q->offloaded = 1;
      drop_running(m, pos);
      wait_push_front(m, i);
      m->o->preemptions++;
      m->o->swapped_out++;
      return;
    }
    if (rc != KVP_ENOTSUP && rc != KVP_EIO && rc != KVP_ENOSPC) sim_die_kvp("kvp_seq_offload", rc); /* ENOSPC: the
                                                                                                   store's max_bytes */
    if (!m->o->offload_fallbacks++) fprintf(stderr, SIM_NAME ": offload refused, recomputing: %s\n", kvp_last_error());
  }
  seq_free(m, q);
  q->cached = 0;
  q->target = q->prompt + q->generated;
  q->decoding = 0;
  drop_running(m, pos);
  wait_push_front(m, i);
  m->o->preemptions++;
  m->o->recomputed_tokens += q->generated ? q->target : 0;
}

/* running[pos] cannot fit even alone in the pool: it is dropped for good. */
static void reject_at(llm *m, size_t pos) {
  req *q = &m->r[m->running[pos]];
  seq_free(m, q);
  drop_running(m, pos);
  q->state = ST_REJECTED;
  m->o->rejected++;
  m->done++;
}

/* Preempt the most recently admitted running request, unless it is `keep`
 * (vLLM's order: the lowest priority goes first, possibly the asker). */
static int preempt_last(llm *m, size_t keep) {
  if (!m->nrun || m->running[m->nrun - 1] == keep) return 0;
  preempt_at(m, m->nrun - 1, 0);
  return 1;
}

/* With the store, before running[p] opens a step of n tokens (an open step
 * cannot be offloaded): while the budget lacks the bytes the step may take
 * (n tokens, plus fresh OPEN blocks unless a decode fills one already
 * open), offload the newest running requests, the asker last. 1 when the
 * asker itself went. Alone, it is left to its step (which rejects it). */
static int store_make_room(llm *m, size_t p, uint32_t n) {
  if (!m->st) return 0;
  req *q = &m->r[m->running[p]];
  if (n == 1 && q->cached % m->bt) return 0; /* a decode into an open block takes nothing */
  double need = n * m->bytes_per_token + m->open_bytes;
  while ((double)sim_allocated(m->pool) + need > (double)m->c->budget_bytes) {
    if (preempt_last(m, m->running[p])) continue;
    if (m->nrun == 1) return 0;
    preempt_at(m, p, 0);
    return 1;
  }
  return 0;
}

/* One step of n tokens for request i. make_room: preempt others when the
 * budget refuses. 0, or the refusing status (the step is still open). */
static int step(llm *m, size_t i, uint32_t n, int make_room) {
  req *q = &m->r[i];
  int rc = kvp_step_begin(m->pool, q->seq, n, 0);
  if (rc) sim_die_kvp("kvp_step_begin", rc);
  kvp_kv kv = {m->k, m->v, NULL};
  for (uint32_t l = 0; l < m->c->n_layers; l++) {
    while ((rc = kvp_append(m->pool, q->seq, l, &kv))) {
      if (rc != KVP_EBUDGET && rc != KVP_ENOSPC) sim_die_kvp("kvp_append", rc);
      if (!make_room || !preempt_last(m, i)) return rc;
    }
  }
  if ((rc = kvp_step_end(m->pool, q->seq))) sim_die_kvp("kvp_step_end", rc);
  return 0;
}

/* Token j of the 512-token trace block named h (splitmix64's finalizer). */
static uint32_t block_token(uint64_t h, uint32_t j) {
  uint64_t z = h * 512 + j + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return (uint32_t)((z ^ (z >> 31)) >> 32);
}

/* Add q's sequence. With the store and block ids, its prompt's token ids go
 * with it, and the shared prefix is attached: from the pool's table, then
 * from the store. Returns the tokens attached (cached already). */
static uint32_t seq_add(llm *m, req *q) {
  q->seq = ++m->next_seq;
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  int share = m->st && q->nblk;
  if (share) {
    for (uint32_t t = 0; t < q->prompt; t++) m->tokens[t] = block_token(m->hash[q->hash0 + t / 512], t % 512);
    sc.tokens = m->tokens;
    sc.n_tokens = q->prompt;
  }
  int rc = kvp_seq_add(m->pool, q->seq, &sc);
  if (rc) sim_die_kvp("kvp_seq_add", rc);
  if (!share) return 0;
  kvp_seq_desc d = {.struct_size = sizeof d};
  if ((rc = kvp_seq_info(m->pool, q->seq, &d))) sim_die_kvp("kvp_seq_info", rc);
  uint32_t fetched = 0;
  rc = kvp_prefix_fetch(m->pool, q->seq, m->st, &fetched);
  if (rc == KVP_EBUDGET || rc == KVP_ENOSPC) fetched = 0; /* all or nothing: the pool is as it was */
  else if (rc) sim_die_kvp("kvp_prefix_fetch", rc);
  q->pool_hit = d.n_positions;
  q->store_hit = fetched;
  return d.n_positions + fetched;
}

/* Simulated seconds of the store traffic since the last call (0 when not
 * charged: publishing is write-behind, off the requests' path). */
static double store_clock(llm *m, int charge) {
  if (!m->st) return 0;
  uint64_t sent, recv;
  int rc = kvp_store_traffic(m->st, &sent, &recv);
  if (rc) sim_die_kvp("kvp_store_traffic", rc);
  uint64_t moved = sent + recv - m->o->store_sent_bytes - m->o->store_received_bytes;
  m->o->store_sent_bytes = sent, m->o->store_received_bytes = recv;
  double t = charge ? (double)moved / m->c->store_bw : 0;
  m->o->store_time_s += t;
  return t;
}

static double percentile(double *x, size_t n, double p) {
  if (!n) return 0;
  for (size_t i = 1; i < n; i++) /* insertion sort: n is the request count */
    for (size_t j = i; j > 0 && x[j - 1] > x[j]; j--) {
      double t = x[j];
      x[j] = x[j - 1];
      x[j - 1] = t;
    }
  size_t k = (size_t)ceil(p * (double)n);
  return x[k ? k - 1 : 0];
}

void sim_llm_run(const sim_llm_cfg *c, const sim_common *com, sim_llm_out *o) {
  memset(o, 0, sizeof *o);
  trace t = {0};
  if (c->trace_path) {
    char err[512];
    int rc = trace_load(c->trace_path, (trace_format)c->trace_format, c->requests, &t, err, sizeof err);
    if (rc) sim_die("--trace: %s", err);
    if (!com->quiet)
      fprintf(stderr, SIM_NAME " llm: replaying %s%zu requests of %s (%s%s)\n", c->requests ? "the first " : "all ",
              t.n, c->trace_path, trace_format_name((trace_format)c->trace_format),
              c->requests ? ", --requests" : "; --requests N replays the first N");
    if (!t.has_arrivals) { /* lengths only (sharegpt): Poisson arrivals at --rate */
      uint64_t s = com->seed;
      double clock = 0;
      for (size_t i = 0; i < t.n; i++) clock += -log(sim_rng_unit(&s)) / c->rate, t.reqs[i].arrival_s = clock;
    }
  } else gen_synthetic(c, com->seed, &t);

  llm m = {0};
  m.c = c;
  m.o = o;
  m.n = t.n;
  m.r = calloc(t.n, sizeof *m.r);
  m.running = calloc(t.n, sizeof *m.running);
  m.wcap = 2 * t.n + 1;
  m.waiting = calloc(m.wcap, sizeof *m.waiting);
  if (!m.r || !m.running || !m.waiting) sim_die("out of memory for %zu requests", t.n);
  m.wh = m.wt = t.n; /* room in front for preempted requests */
  uint32_t max_prompt = 0;
  for (size_t i = 0; i < t.n; i++) {
    m.r[i] = (req){.arrival_s = t.reqs[i].arrival_s, .prompt = t.reqs[i].prompt_tokens,
                   .output = t.reqs[i].output_tokens, .target = t.reqs[i].prompt_tokens, .state = ST_FUTURE,
                   .hash0 = t.reqs[i].hash0, .nblk = t.hash_ids ? t.reqs[i].n_prefix_blocks : 0};
    o->prompt_tokens += t.reqs[i].prompt_tokens;
    if (t.reqs[i].prompt_tokens > max_prompt) max_prompt = t.reqs[i].prompt_tokens;
  }
  o->requests_total = t.n;
  if (c->store_url) {
    int rc = kvp_store_open(c->store_url, &m.st);
    if (rc) sim_die_kvp("--store: kvp_store_open", rc);
    m.hash = t.hash_ids; /* kept for the prompts' token ids */
    t.hash_ids = NULL;
    if (m.hash && !(m.tokens = malloc((size_t)max_prompt * sizeof *m.tokens))) sim_die("out of memory");
  }
  trace_free(&t);
  probe(&m, com);

  kvp_config k;
  kvp_config_init(&k);
  k.n_layers = c->n_layers;
  k.n_kv_heads = c->n_kv_heads;
  k.head_dim = c->head_dim;
  k.block_tokens = c->block_tokens;
  k.budget_bytes = c->budget_bytes;
  k.region_bytes = c->budget_bytes + c->budget_bytes / 4 + (64ull << 20); /* room for slab fragmentation */
  k.codecs = c->codecs;
  k.policy = c->policy;
  if (com->dry) {
#ifdef KVP_POOL_DRY
    k.flags |= KVP_POOL_DRY;
#else
    sim_die("--dry: this kvpool has no dry mode (KVP_POOL_DRY)");
#endif
  }
  int rc = kvp_pool_create(&k, &m.pool);
  if (rc) sim_die_kvp("kvp_pool_create", rc);
  kvp_layer_info li;
  kvp_layer_info_init(&li);
  if ((rc = kvp_pool_info(m.pool, 0, &li))) sim_die_kvp("kvp_pool_info", rc);
  m.bt = li.block_tokens[0] ? li.block_tokens[0] : 1;
  m.k = sim_kv_alloc(c->max_batch_tokens, c->n_kv_heads, c->head_dim, KVP_DTYPE_BF16, com->seed, 1);
  m.v = sim_kv_alloc(c->max_batch_tokens, c->n_kv_heads, c->head_dim, KVP_DTYPE_BF16, com->seed, 0);
  o->budget_bytes = c->budget_bytes;

  sim_run run;
  if (sim_run_open(&run, com, c->model)) exit(1);
  double now = 0, t0 = sim_now(), *ttft = calloc(m.n + 1, sizeof *ttft);
  size_t *fin = calloc(m.n + 1, sizeof *fin);
  if (!ttft || !fin) sim_die("out of memory");
  while (m.done < m.n) {
    while (m.next_arrival < m.n && m.r[m.next_arrival].arrival_s <= now) wait_push_back(&m, m.next_arrival++);
    if (!m.nrun && m.wh == m.wt) { /* idle: jump to the next arrival */
      if (m.next_arrival >= m.n) sim_die("internal: idle with %llu of %zu requests unaccounted for",
                                         (unsigned long long)(m.n - m.done), m.n);
      now = m.r[m.next_arrival].arrival_s;
      continue;
    }
    uint32_t budget_tokens = c->max_batch_tokens, batch_tokens = 0;
    size_t nfin = 0;
    /* 2. decodes, in admission order (preemption takes from the end) */
    for (size_t p = 0; p < m.nrun && budget_tokens; p++) {
      size_t i = m.running[p];
      req *q = &m.r[i];
      if (!q->decoding) continue;
      if (store_make_room(&m, p, 1)) break;
      if (step(&m, i, 1, 1)) { /* it is the last one left: it preempts itself */
        if (m.nrun == 1) reject_at(&m, p); /* alone and still no room: it never fits */
        else preempt_at(&m, p, 1);
        break;
      }
      budget_tokens--, batch_tokens++;
      q->cached++;
      q->generated++;
      o->generated_tokens++;
      if (q->generated >= q->output) fin[nfin++] = i;
    }
    /* 3a. chunks of running prefills */
    for (size_t p = 0; p < m.nrun && budget_tokens; p++) {
      size_t i = m.running[p];
      req *q = &m.r[i];
      if (q->decoding) continue;
      uint32_t n = q->target - q->cached < budget_tokens ? q->target - q->cached : budget_tokens;
      if (store_make_room(&m, p, n)) break;
      if (step(&m, i, n, 1)) {
        if (m.nrun == 1) reject_at(&m, p);
        else preempt_at(&m, p, 1);
        break;
      }
      q->cached += n, budget_tokens -= n, batch_tokens += n;
      o->prefill_tokens += n;
    }
    /* 3b. admissions */
    while (budget_tokens && m.wh < m.wt && m.nrun < c->max_running) {
      size_t i = m.waiting[m.wh];
      req *q = &m.r[i];
      uint32_t span = q->cached > q->target ? q->cached : q->target; /* a restore brings back what it held */
      double need = span * m.bytes_per_token + m.open_bytes + 0.01 * (double)c->budget_bytes;
      if (m.nrun && (double)sim_allocated(m.pool) + need > (double)c->budget_bytes) break;
      if (q->offloaded) { /* back from the store, where it stopped */
        if ((rc = kvp_seq_restore(m.pool, q->seq, m.st))) {
          if (rc != KVP_EBUDGET && rc != KVP_ENOSPC) sim_die_kvp("kvp_seq_restore", rc);
          if (m.nrun) break;
          sim_die("request %zu (%u tokens) cannot be restored into an empty pool", i, q->cached);
        }
        q->offloaded = 0;
        m.wh++;
        q->state = ST_RUNNING;
        m.running[m.nrun++] = i;
        o->swapped_in++;
        continue;
      }
      uint32_t hit = seq_add(&m, q);
      uint32_t n = q->target - hit < budget_tokens ? q->target - hit : budget_tokens;
      if (step(&m, i, n, 0)) {
        seq_free(&m, q); /* nothing of it stays */
        if (!m.nrun) { /* it cannot fit an empty pool */
          m.wh++;
          q->state = ST_REJECTED;
          o->rejected++;
          m.done++;
          continue;
        }
        break;
      }
      m.wh++;
      q->state = ST_RUNNING;
      q->cached = hit + n;
      m.running[m.nrun++] = i;
      budget_tokens -= n, batch_tokens += n;
      o->prefill_tokens += n;
      o->prefix_hit_tokens += q->pool_hit;
      o->store_prefix_tokens += q->store_hit;
    }
    if (m.nrun > o->max_running) o->max_running = m.nrun;
    /* 4. the clock */
    now += sim_cost_s(&com->cost, c->params, batch_tokens ? batch_tokens : 1, (double)sim_allocated(m.pool));
    now += store_clock(&m, 1); /* offloads, restores and fetches wait for the store */
    o->iterations++;
    for (size_t p = 0; p < m.nrun; p++) { /* prefills that completed produce a token */
      size_t i = m.running[p];
      req *q = &m.r[i];
      if (q->decoding || q->cached < q->target) continue;
      q->decoding = 1;
      if (q->generated++ == 0) q->first_token_s = now;
      o->generated_tokens++;
      if (q->generated >= q->output) fin[nfin++] = i;
    }
    for (size_t f = 0; f < nfin; f++) {
      size_t i = fin[f];
      req *q = &m.r[i];
      if (q->state != ST_RUNNING) continue;
      q->finish_s = now;
      q->state = ST_DONE;
      if (m.st && q->nblk) {
        rc = kvp_prefix_publish(m.pool, q->seq, m.st, NULL);
        if (rc == KVP_ENOSPC) { /* the store's max_bytes: this prompt is not shared through the store */
          if (!m.o->publish_refusals++) fprintf(stderr, SIM_NAME ": prefix publish stopped: %s\n", kvp_last_error());
        } else if (rc) {
          sim_die_kvp("kvp_prefix_publish", rc);
        }
        store_clock(&m, 0);
      }
      seq_free(&m, q);
      for (size_t p = 0; p < m.nrun; p++)
        if (m.running[p] == i) {
          drop_running(&m, p);
          break;
        }
      ttft[o->requests_finished++] = q->first_token_s - q->arrival_s;
      m.done++;
    }
    kvp_stats s;
    sim_stats(m.pool, &s);
    if (s.bytes_allocated.current > o->peak_allocated_bytes) {
      o->peak_allocated_bytes = s.bytes_allocated.current;
      o->peak_requested_bytes = s.bytes_requested.current;
      o->savings_vs_bf16 = (double)s.bf16_equivalent_bytes.current / (double)s.bytes_allocated.current;
    }
    if (s.bf16_equivalent_bytes.current > o->peak_bf16_equivalent_bytes)
      o->peak_bf16_equivalent_bytes = s.bf16_equivalent_bytes.current;
    o->budget_violations += s.bytes_allocated.current > c->budget_bytes;
    if (sim_run_row(&run, &s, now, m.nrun, m.wt - m.wh, o->requests_finished, o->preemptions, c->budget_bytes))
      exit(1);
    sim_run_progress(&run, (double)m.done / (double)m.n);
    if (c->check && (rc = kvp_check(m.pool))) sim_die_kvp("kvp_check", rc);
  }
  o->wall_s = sim_now() - t0;
  o->sim_time_s = now;
  if ((rc = kvp_check(m.pool))) sim_die_kvp("kvp_check", rc);
  kvp_stats s;
  sim_stats(m.pool, &s);
  if (s.sequences.current != 0) sim_die("%llu sequences still live at the end", (unsigned long long)s.sequences.current);
  if (s.bytes_allocated.peak > c->budget_bytes) o->budget_violations++;
  double tpot = 0;
  size_t ntpot = 0;
  for (size_t i = 0; i < m.n; i++)
    if (m.r[i].state == ST_DONE && m.r[i].output > 1)
      tpot += (m.r[i].finish_s - m.r[i].first_token_s) / (m.r[i].output - 1), ntpot++;
  o->tpot_mean_s = ntpot ? tpot / (double)ntpot : 0;
  double sum = 0;
  for (uint64_t i = 0; i < o->requests_finished; i++) sum += ttft[i];
  o->ttft_mean_s = o->requests_finished ? sum / (double)o->requests_finished : 0;
  o->ttft_p90_s = percentile(ttft, o->requests_finished, 0.9);
  o->throughput_tokens_per_s = now > 0 ? (double)o->generated_tokens / now : 0;
  if (sim_run_close(&run)) exit(1);
  kvp_pool_destroy(m.pool);
  kvp_store_close(m.st);
  free(m.hash);
  free(m.tokens);
  free(ttft);
  free(fin);
  free(m.r);
  free(m.running);
  free(m.waiting);
  free(m.k);
  free(m.v);
}

static const char *const LLM_HELP =
    "usage: " SIM_NAME " llm [options]\n"
    "Continuous batching like vLLM through the pool under its strict byte budget:\n"
    "admission when the prefill fits, one decode token per running request per\n"
    "iteration, preemption by recompute when the budget blocks a decode.\n\n"
    "  --model NAME          llama-2-7b (32 layers, 32 KV heads, 128) | llama-3-8b (32, 8, 128; GQA)\n"
    "                        | llama-2-70b (80, 8, 128) (default llama-3-8b)\n"
    "  --layers N --kv-heads N --head-dim N --params N   explicit geometry and parameters\n"
    "  --budget-bytes N      the pool's strict budget (K/M/G/T suffixes; default 2G)\n"
    "  --codecs SPEC         codec spec, e.g. k=fp8,v=fp8 or k=kivi:bits=2,v=kivi:bits=2 (default raw bf16)\n"
    "  --policy SPEC         eviction policy per sequence, e.g. window:sink=4:recent=1024\n"
    "  --max-batch-tokens N  tokens per iteration, prefill chunks and decodes (default 2048)\n"
    "  --max-running N       running requests at most (default 256)\n"
    "  --block-tokens N      tokens per block (default 0: the pool's choice per layer, from its codecs)\n"
    "  --trace FILE --format azure|mooncake|sharegpt   requests from a trace (sharegpt: lengths\n"
    "                        only, Poisson arrivals at --rate)\n"
    "  --requests N          synthetic requests (default 200), or the first N rows of a trace\n"
    "                        (default: the whole trace; 0 = all)\n"
    "  --rate R              synthetic arrivals per second (default 4)\n"
    "  --prompt-median N --output-median N   synthetic lognormal medians (default 1020, 129)\n"
    "  --max-prompt N --max-output N         synthetic caps (default 8192, 1024)\n"
    "  --check               kvp_check after every iteration\n"
    "  --store URL           run twice and compare: the recompute baseline, then with the store tier\n"
    "                        (redis://host:port[/db][?prefix=..&ttl=..&max_bytes=..]): preempted requests are\n"
    "                        offloaded and restored instead of recomputed, and prompts share prefixes\n"
    "                        (mooncake hash_ids) through the pool and the store. Keys go under a\n"
    "                        prefix of this run (kvp-sim:<pid>:) and expire after an hour unless the\n"
    "                        URL says otherwise; max_bytes= caps the server's memory (an offload\n"
    "                        it refuses is a recompute, a publish it stops is counted). Not with\n"
    "                        --policy or --dry; --csv follows the store run\n"
    "  --store-gbs G         store bandwidth for the clock, GB/s (default 10)\n\n"
    "JSON keys: requests_total, requests_finished, rejected, preemptions, max_running,\n"
    "peak_allocated_bytes, budget_bytes, budget_violations, throughput_tokens_per_s,\n"
    "ttft_mean_s, ttft_p90_s, tpot_mean_s, sim_time_s, ...; with --store, those of the store run\n"
    "prefixed store_, and recomputed_tokens_saved, prefill_tokens_saved, ttft_mean_change_s.\n\n";

static void store_json(sim_json *j, const sim_llm_out *o, const sim_llm_out *so) {
  sim_json_u64(j, "prefill_tokens", o->prefill_tokens);
  sim_json_u64(j, "store_preemptions", so->preemptions);
  sim_json_u64(j, "store_swapped_out", so->swapped_out);
  sim_json_u64(j, "store_swapped_in", so->swapped_in);
  sim_json_u64(j, "store_offload_fallbacks", so->offload_fallbacks);
  sim_json_u64(j, "store_publish_refusals", so->publish_refusals);
  sim_json_u64(j, "store_recomputed_tokens", so->recomputed_tokens);
  sim_json_u64(j, "store_prefill_tokens", so->prefill_tokens);
  sim_json_u64(j, "store_requests_finished", so->requests_finished);
  sim_json_u64(j, "store_rejected", so->rejected);
  sim_json_u64(j, "store_budget_violations", so->budget_violations);
  sim_json_u64(j, "store_peak_allocated_bytes", so->peak_allocated_bytes);
  sim_json_u64(j, "prefix_hit_tokens", so->prefix_hit_tokens);
  sim_json_u64(j, "store_prefix_tokens", so->store_prefix_tokens);
  sim_json_u64(j, "store_sent_bytes", so->store_sent_bytes);
  sim_json_u64(j, "store_received_bytes", so->store_received_bytes);
  sim_json_f64(j, "store_time_s", so->store_time_s);
  sim_json_f64(j, "store_sim_time_s", so->sim_time_s);
  sim_json_f64(j, "store_throughput_tokens_per_s", so->throughput_tokens_per_s);
  sim_json_f64(j, "store_ttft_mean_s", so->ttft_mean_s);
  sim_json_f64(j, "store_ttft_p90_s", so->ttft_p90_s);
  sim_json_f64(j, "store_tpot_mean_s", so->tpot_mean_s);
  sim_json_f64(j, "recomputed_tokens_saved", (double)o->recomputed_tokens - (double)so->recomputed_tokens);
  sim_json_f64(j, "prefill_tokens_saved", (double)o->prefill_tokens - (double)so->prefill_tokens);
  sim_json_f64(j, "ttft_mean_change_s", so->ttft_mean_s - o->ttft_mean_s);
}

static double pct(double now, double before) { return before > 0 ? 100.0 * (now - before) / before : 0; }

/* The two runs side by side. */
static void store_table(const sim_llm_cfg *c, const sim_llm_out *o, const sim_llm_out *so) {
  char a[32], b[32];
  printf("  store tier       %s, %.0f GB/s for the clock\n", c->store_url, c->store_bw / 1e9);
  printf("                   %-16s %s\n", "recompute", "store");
  printf("  preemptions      %-16llu %llu (%llu swapped out, %llu in; %llu recomputed)\n",
         (unsigned long long)o->preemptions, (unsigned long long)so->preemptions,
         (unsigned long long)so->swapped_out, (unsigned long long)so->swapped_in,
         (unsigned long long)(so->preemptions - so->swapped_out));
  printf("  recomputed tok   %-16llu %llu (saved %.0f)\n", (unsigned long long)o->recomputed_tokens,
         (unsigned long long)so->recomputed_tokens, (double)o->recomputed_tokens - (double)so->recomputed_tokens);
  printf("  prefill tok      %-16llu %llu (saved %.0f)\n", (unsigned long long)o->prefill_tokens,
         (unsigned long long)so->prefill_tokens, (double)o->prefill_tokens - (double)so->prefill_tokens);
  printf("  prefix hits      %-16s %llu tokens from the pool, %llu from the store\n", "-",
         (unsigned long long)so->prefix_hit_tokens, (unsigned long long)so->store_prefix_tokens);
  printf("  bytes moved      %-16s %s to the store, %s back (%.3f s)\n", "-", sim_bytes(so->store_sent_bytes, a, sizeof a),
         sim_bytes(so->store_received_bytes, b, sizeof b), so->store_time_s);
  if (so->publish_refusals || so->offload_fallbacks)
    printf("  store refusals   %-16s %llu publishes stopped, %llu offloads recomputed instead\n", "-",
           (unsigned long long)so->publish_refusals, (unsigned long long)so->offload_fallbacks);
  printf("  TTFT mean        %-16.3f %.3f s (%+.1f%%)\n", o->ttft_mean_s, so->ttft_mean_s, pct(so->ttft_mean_s, o->ttft_mean_s));
  printf("  TTFT p90         %-16.3f %.3f s (%+.1f%%)\n", o->ttft_p90_s, so->ttft_p90_s, pct(so->ttft_p90_s, o->ttft_p90_s));
  printf("  TPOT mean        %-16.1f %.1f ms\n", 1e3 * o->tpot_mean_s, 1e3 * so->tpot_mean_s);
  printf("  throughput       %-16.0f %.0f output tokens/s\n", o->throughput_tokens_per_s, so->throughput_tokens_per_s);
  printf("  simulated        %-16.1f %.1f s; finished %llu, %llu rejected, %llu budget violations\n", o->sim_time_s,
         so->sim_time_s, (unsigned long long)so->requests_finished, (unsigned long long)so->rejected,
         (unsigned long long)so->budget_violations);
}

static void llm_print(const sim_llm_cfg *c, const sim_common *com, const sim_llm_out *o, const sim_llm_out *so) {
  double savings = o->savings_vs_bf16;
  if (com->json) {
    sim_json j;
    sim_json_begin(&j, stdout);
    sim_json_str(&j, "subcommand", "llm");
    sim_json_str(&j, "model", c->model);
    sim_json_u64(&j, "n_layers", c->n_layers);
    sim_json_u64(&j, "n_kv_heads", c->n_kv_heads);
    sim_json_u64(&j, "head_dim", c->head_dim);
    sim_json_str(&j, "codecs", c->codecs);
    sim_json_str(&j, "policy", c->policy);
    sim_json_str(&j, "trace", c->trace_path);
    sim_json_str(&j, "format", c->trace_path ? trace_format_name((trace_format)c->trace_format) : "synthetic");
    sim_json_u64(&j, "dry", (uint64_t)com->dry);
    sim_json_u64(&j, "requests_total", o->requests_total);
    sim_json_u64(&j, "requests_finished", o->requests_finished);
    sim_json_u64(&j, "rejected", o->rejected);
    sim_json_u64(&j, "preemptions", o->preemptions);
    sim_json_u64(&j, "recomputed_tokens", o->recomputed_tokens);
    sim_json_u64(&j, "max_running", o->max_running);
    sim_json_u64(&j, "iterations", o->iterations);
    sim_json_u64(&j, "prompt_tokens", o->prompt_tokens);
    sim_json_u64(&j, "generated_tokens", o->generated_tokens);
    sim_json_u64(&j, "peak_allocated_bytes", o->peak_allocated_bytes);
    sim_json_u64(&j, "peak_requested_bytes", o->peak_requested_bytes);
    sim_json_u64(&j, "peak_bf16_equivalent_bytes", o->peak_bf16_equivalent_bytes);
    sim_json_u64(&j, "budget_bytes", o->budget_bytes);
    sim_json_u64(&j, "budget_violations", o->budget_violations);
    sim_json_f64(&j, "savings_vs_bf16", savings);
    sim_json_f64(&j, "sim_time_s", o->sim_time_s);
    sim_json_f64(&j, "throughput_tokens_per_s", o->throughput_tokens_per_s);
    sim_json_f64(&j, "ttft_mean_s", o->ttft_mean_s);
    sim_json_f64(&j, "ttft_p90_s", o->ttft_p90_s);
    sim_json_f64(&j, "tpot_mean_s", o->tpot_mean_s);
    sim_json_f64(&j, "wall_s", o->wall_s);
    if (so) store_json(&j, o, so);
    sim_json_end(&j);
    return;
  }
  if (com->quiet) return;
  char a[32], b[32];
  printf("llm %s: %u layers x %u KV heads x %u, codecs %s, policy %s%s\n", c->model, c->n_layers, c->n_kv_heads,
         c->head_dim, c->codecs ? c->codecs : "raw bf16", c->policy ? c->policy : "none", com->dry ? ", dry" : "");
  printf("  requests         %llu finished of %llu (%llu rejected), %llu preemptions, at most %llu running\n",
         (unsigned long long)o->requests_finished, (unsigned long long)o->requests_total,
         (unsigned long long)o->rejected, (unsigned long long)o->preemptions, (unsigned long long)o->max_running);
  printf("  bytes            peak %s of a %s budget, %llu violations; %.2fx smaller than bf16\n",
         sim_bytes(o->peak_allocated_bytes, a, sizeof a), sim_bytes(o->budget_bytes, b, sizeof b),
         (unsigned long long)o->budget_violations, savings);
  printf("  simulated        %.1f s: %.0f output tokens/s, TTFT mean %.3f s (p90 %.3f s), TPOT %.1f ms\n",
         o->sim_time_s, o->throughput_tokens_per_s, o->ttft_mean_s, o->ttft_p90_s, 1e3 * o->tpot_mean_s);
  printf("  wall             %.2f s, %llu iterations\n", o->wall_s, (unsigned long long)o->iterations);
  if (so) store_table(c, o, so);
}

/* The store URL with this run's key prefix and an expiry, unless given. */
static char *store_url(const char *url) {
  size_t n = strlen(url) + 64;
  char *u = malloc(n);
  if (!u) sim_die("out of memory");
  int has_q = strchr(url, '?') != NULL;
  snprintf(u, n, "%s", url);
  if (!strstr(url, "prefix=")) {
    size_t l = strlen(u);
    snprintf(u + l, n - l, "%cprefix=kvp-sim:%ld:", has_q ? '&' : '?', (long)getpid());
    has_q = 1;
  }
  if (!strstr(url, "ttl=")) {
    size_t l = strlen(u);
    snprintf(u + l, n - l, "%cttl=3600", has_q ? '&' : '?');
  }
  return u;
}

int sim_llm_main(int argc, char **argv) {
  sim_common com;
  sim_common_init(&com);
  sim_llm_cfg c;
  sim_llm_defaults(&c);
  const char *format = NULL;
  int params_set = 0, requests_set = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int r = sim_common_opt(&com, argc, argv, &i);
    if (r < 0) return 2;
    if (r) continue;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return fputs(LLM_HELP, stdout), fputs(sim_common_help, stdout), 0;
    if (!strcmp(a, "--check")) {
      c.check = 1;
      continue;
    }
    if (i + 1 >= argc) sim_usage_error("llm", "unknown option or missing value: %s", a);
    const char *v = argv[++i];
    if (!strcmp(a, "--model")) {
      if (sim_llm_preset(&c, v)) sim_usage_error("llm", "--model %s: unknown (llama-2-7b | llama-3-8b | llama-2-70b)", v);
    } else if (sim_geom_opt("llm", a, v, &c.n_layers, &c.n_kv_heads, &c.head_dim, &c.model)) {
      /* geometry: stored */
    } else if (!strcmp(a, "--params")) c.params = sim_opt_pos("llm", a, v), params_set = 1;
    else if (!strcmp(a, "--budget-bytes")) {
      if (sim_parse_u64(v, 1, &c.budget_bytes) || c.budget_bytes < KVP_MIN_REGION_BYTES)
        sim_usage_error("llm", "--budget-bytes %s: expected a byte count >= 2M (K/M/G/T suffixes)", v);
    } else if (!strcmp(a, "--codecs")) c.codecs = v;
    else if (!strcmp(a, "--policy")) c.policy = strcmp(v, "none") ? v : NULL;
    else if (!strcmp(a, "--max-batch-tokens")) c.max_batch_tokens = sim_opt_u32("llm", a, v, 1, 1u << 20);
    else if (!strcmp(a, "--block-tokens")) c.block_tokens = sim_opt_u32("llm", a, v, 0, 65536);
    else if (!strcmp(a, "--max-running")) c.max_running = sim_opt_u32("llm", a, v, 1, 1u << 20);
    else if (!strcmp(a, "--trace")) c.trace_path = v;
    else if (!strcmp(a, "--format")) format = v;
    else if (!strcmp(a, "--requests")) c.requests = sim_opt_u32("llm", a, v, 0, 1u << 30), requests_set = 1;
    else if (!strcmp(a, "--rate")) c.rate = sim_opt_pos("llm", a, v);
    else if (!strcmp(a, "--prompt-median")) c.prompt_median = sim_opt_pos("llm", a, v);
    else if (!strcmp(a, "--output-median")) c.output_median = sim_opt_pos("llm", a, v);
    else if (!strcmp(a, "--max-prompt")) c.max_prompt = sim_opt_u32("llm", a, v, 1, 1u << 24);
    else if (!strcmp(a, "--max-output")) c.max_output = sim_opt_u32("llm", a, v, 1, 1u << 24);
    else if (!strcmp(a, "--store")) c.store_url = v;
    else if (!strcmp(a, "--store-gbs")) c.store_bw = 1e9 * sim_opt_pos("llm", a, v);
    else sim_usage_error("llm", "unknown option %s", a);
  }
  if (format && !c.trace_path) sim_usage_error("llm", "--format needs --trace FILE");
  if (c.trace_path) {
    trace_format f;
    if (!format) sim_usage_error("llm", "--trace needs --format azure|mooncake|sharegpt");
    if (trace_format_parse(format, &f)) sim_usage_error("llm", "--format %s: expected azure, mooncake or sharegpt", format);
    c.trace_format = (int)f;
    if (!requests_set) c.requests = 0; /* a trace is replayed whole unless --requests cuts it */
  } else if (!c.requests) sim_usage_error("llm", "--requests 0 (all) needs --trace");
  if (!params_set && !strcmp(c.model, "custom"))
    c.params = 12.0 * c.n_layers * (double)c.n_kv_heads * c.head_dim * (double)c.n_kv_heads * c.head_dim;
  sim_llm_out o;
  if (!c.store_url) {
    sim_llm_run(&c, &com, &o);
    llm_print(&c, &com, &o, NULL);
    return 0;
  }
  if (com.dry) sim_usage_error("llm", "--store needs real pages: not with --dry");
  if (c.policy) sim_usage_error("llm", "--store: offload and prefix sharing refuse sequences with a policy (--policy)");
  char *url = store_url(c.store_url);
  sim_llm_cfg base = c;
  sim_common bcom = com;
  base.store_url = NULL, bcom.csv_path = NULL;
  sim_llm_run(&base, &bcom, &o);
  sim_llm_out so;
  c.store_url = url;
  sim_llm_run(&c, &com, &so);
  llm_print(&c, &com, &o, &so);
  free(url);
  return 0;
}
