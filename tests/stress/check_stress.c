/*
 * tests/stress/check_stress.c - readers beside the writer, through the
 * public header only (issue 3):
 *   - the test's main thread is the one writer: it adds sequences (stream
 *     and step mode, some with a planned schedule), runs prefill and decode
 *     steps one layer per operation (so other operations interleave with
 *     open steps), evicts random (layer, head, step) units (open steps
 *     included), forks, frees and preempts on a budget refusal; every status
 *     is checked against its model, kvp_check runs every CHECK_EVERY
 *     operations, and a finishing sequence is read back exactly; half
 *     of the stream-mode sequences carry a prompt of one shared family,
 *     so they attach chunks others computed (and evict over them, fork,
 *     free under the readers);
 *   - NREADERS reader threads read every head of random (sequence, layer)
 *     pairs and take views, and check every row they get against the
 *     deterministic model: positions strictly increasing, every channel of
 *     a row (K and V) equal to the value of its (lineage, layer, head,
 *     position), so a torn or stale row cannot pass; some views are held
 *     across writer operations (the writer aims evictions and frees at
 *     them) and their pinned pages are checked again before release;
 *   - sequences that were freed, or never existed, must read KVP_ENOENT; a
 *     read into too small a buffer must say how many rows it needs and
 *     write nothing.
 * At the end every sequence is freed: the ledger holds 0 bytes.
 *
 * KVP_STRESS_SECONDS sets the duration (default 2: the short version run
 * by `make test`; `make stress` runs 30), and the writer does at least
 * MIN_OPS operations. KVP_STRESS_SEED sets the writer's seed (the readers'
 * interleaving is the machine's).
 */
#include <check.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../integration/kvgen.h"
#include "kvpool.h"
#include "../integration/itest.h"


enum {
  L = 4, H = 4, D = 32, BT = 16, /* geometry: bf16 K and V, 16-token blocks */
  NREADERS = 4,
  MAXLIVE = 12,       /* live sequences at most */
  MAX_STEPS = 1024,   /* steps of one sequence */
  MAX_TOKENS = 1536,  /* positions of one sequence */
  MAX_STEP_N = 320,   /* tokens of one step */
  READ_CAP = 2048,    /* rows of a reader's buffers (> MAX_TOKENS: full reads never lack room) */
  MAX_HELD = 3,       /* views a reader holds at once */
  CHECK_EVERY = 50,   /* writer operations between two kvp_check */
  MIN_OPS = 2000,     /* writer operations at least, however slow the machine (sanitizers) */
};
#define MAX_IDS (1u << 18)           /* sequence ids the writer may publish */
#define NO_SUCH_SEQ (1ull << 40)     /* ids from here on are never added */

static uint64_t rnd(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

static uint64_t mix64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return x;
}

/* ---- the deterministic model ---------------------------------------------
 * Channel ch of K or V at (owner, layer, head, pos) is a small integer
 * (-128..127, exact in bf16) drawn from a hash of all six, so a row copied
 * from any other position, head, layer, side or lineage differs in some
 * channel. A forked sequence inherits its parent's values below the fork
 * position (the idea of kvgen.h, with a lineage as long as the run).
 *
 * Lineage entries of an id are written before the id is published (state
 * set to ID_LIVE with a release store) and the writer publishes before the
 * call that makes the id visible in the pool; ids are never reused. A reader
 * loads the state with acquire before it follows the lineage. */

enum { ID_UNUSED = 0, ID_LIVE = 1, ID_GONE = 2 };

static int64_t lin_parent[MAX_IDS];   /* parent id, -1 for a root */
static uint32_t lin_fork_pos[MAX_IDS]; /* positions inherited from the parent */
static int lin_mode[MAX_IDS];          /* kvp_seq_mode */
static _Atomic int lin_state[MAX_IDS]; /* ID_*: published, then gone (freed, or a failed fork) */

static uint64_t owner_of(uint64_t id, uint32_t pos) {
  while (lin_parent[id] >= 0 && pos < lin_fork_pos[id]) id = (uint64_t)lin_parent[id];
  return id;
}

/* The D bf16 values of one row. */
static void model_row(uint64_t id, uint32_t layer, uint32_t head, uint32_t pos, int kv, uint16_t *out) {
  uint64_t o = owner_of(id, pos);
  uint64_t base = mix64(o * 0x9E3779B97F4A7C15ull ^ ((uint64_t)layer << 56) ^ ((uint64_t)head << 48) ^
                        ((uint64_t)(unsigned)kv << 47) ^ ((uint64_t)pos << 8));
  for (uint32_t c = 0; c < D; c += 8) {
    uint64_t w = mix64(base + c);
    for (uint32_t i = 0; i < 8; i++) out[c + i] = kvgen_bf16((float)(int8_t)(w >> (8 * i)));
  }
}

static float bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Writer and readers share these. */
static _Atomic uint64_t g_next_id;     /* ids below it were published */
static _Atomic uint64_t g_live[MAXLIVE]; /* id + 1 of each live slot, 0 = none */
static _Atomic uint64_t g_ops;         /* writer operations done */
static _Atomic uint64_t g_viewed;      /* id + 1 of a sequence some reader holds a view of */
static _Atomic int g_stop;             /* readers: finish */

/* ---- readers -------------------------------------------------------------- */

typedef struct held_view {
  kvp_view *view;
  uint64_t id;
  uint64_t ops_at;     /* writer operations when acquired */
  uint64_t release_at; /* release once the writer has done this many */
} held_view;

typedef struct reader {
  pthread_t th;
  kvp_pool *pool;
  uint64_t rng;
  /* counters */
  uint64_t reads, rows, enoent, enospc, views, view_blocks, view_rows, held, held_across, held_gone, infos;
  _Atomic int failed; /* set (release) after fail is written; the writer polls it */
  char fail[768];     /* the first failure; read by the main thread after join */
  held_view hv[MAX_HELD];
  void *k, *v;   /* [READ_CAP][D], f32-sized */
  uint32_t *pos; /* [READ_CAP] */
} reader;

#define RFAIL(r, ...)                                                            \
  do {                                                                           \
    if (!atomic_load_explicit(&(r)->failed, memory_order_relaxed)) {             \
      snprintf((r)->fail, sizeof (r)->fail, __VA_ARGS__);                        \
      atomic_store_explicit(&(r)->failed, 1, memory_order_release);              \
    }                                                                            \
  } while (0)

static int state_of(uint64_t id) {
  return id < MAX_IDS ? atomic_load_explicit(&lin_state[id], memory_order_acquire) : ID_UNUSED;
}

/* Pick a sequence: mostly a live one, else a recent id (live, gone, or not
 * yet added), now and then one that never exists. */
static uint64_t pick_id(reader *r) {
  uint64_t x = rnd(&r->rng);
  if (x % 32 == 0) return NO_SUCH_SEQ + (x >> 8) % 1000;
  if (x % 4) {
    uint64_t v = atomic_load_explicit(&g_live[(x >> 8) % MAXLIVE], memory_order_relaxed);
    if (v) return v - 1;
  }
  uint64_t hi = atomic_load_explicit(&g_next_id, memory_order_relaxed);
  return hi - (x >> 16) % (hi < 40 ? hi + 1 : 40) + 1; /* hi + 1 .. hi - 38: may not exist yet */
}

/* A status for an id whose state was st0 before the call: ENOENT must come
 * for ids gone or never added; anything else must come only for ids that
 * the writer published. Returns 1 if the caller may go on checking data. */
static int judge(reader *r, const char *what, uint64_t id, int st0, int rc) {
  if (rc == KVP_ENOENT) {
    r->enoent++;
    return 0;
  }
  if (id >= NO_SUCH_SEQ || st0 == ID_GONE) {
    RFAIL(r, "%s of sequence %llu (%s) returned %s, expected KVP_ENOENT", what, (unsigned long long)id,
          id >= NO_SUCH_SEQ ? "never added" : "freed before the call", kvp_err_name(rc));
    return 0;
  }
  if (rc != KVP_OK && rc != KVP_ENOSPC) {
    RFAIL(r, "%s of sequence %llu returned %s: %s", what, (unsigned long long)id, kvp_err_name(rc), kvp_last_error());
    return 0;
  }
  if (state_of(id) == ID_UNUSED) { /* the pool shows it, so its lineage was published */
    RFAIL(r, "%s of sequence %llu succeeded before the id was published", what, (unsigned long long)id);
    return 0;
  }
  return 1;
}

/* Read every head of (id, layer) and check each row against the model. */
static void reader_read(reader *r, uint64_t id, uint32_t layer) {
  int st0 = state_of(id);
  for (uint32_t h = 0; h < H && !r->failed; h++) {
    uint64_t x = rnd(&r->rng);
    uint32_t cap = x % 16 == 0 ? (uint32_t)(x >> 8) % 24 : READ_CAP;
    kvp_dtype dt = (x >> 4) % 4 == 0 ? KVP_DTYPE_F32 : KVP_DTYPE_BF16;
    int with_v = (x >> 6) % 8 != 0;
    r->pos[0] = 0xDEADBEEF;
    memset(r->k, 0xA5, 4);
    kvp_read_req q = {sizeof q, h, dt, r->k, with_v ? r->v : NULL, r->pos, cap, 0, NULL};
    int rc = kvp_read(r->pool, id, layer, &q);
    r->reads++;
    if (!judge(r, "read", id, st0, rc)) return;
    if (rc == KVP_ENOSPC) {
      uint32_t k0;
      memcpy(&k0, r->k, 4);
      if (q.n_tokens <= cap || q.n_tokens > MAX_TOKENS || r->pos[0] != 0xDEADBEEF || k0 != 0xA5A5A5A5u)
        RFAIL(r, "read of seq %llu layer %u head %u: KVP_ENOSPC with capacity %u, needs %u; %s", (unsigned long long)id,
              layer, h, cap, q.n_tokens,
              q.n_tokens <= cap ? "the need fits" : q.n_tokens > MAX_TOKENS ? "more than was appended" : "it wrote into the buffers");
      r->enospc++;
      continue;
    }
    if (q.n_tokens > cap) {
      RFAIL(r, "read of seq %llu layer %u head %u: %u rows into a buffer of %u", (unsigned long long)id, layer, h,
            q.n_tokens, cap);
      return;
    }
    uint16_t want[D];
    for (uint32_t i = 0; i < q.n_tokens; i++) {
      uint32_t p = r->pos[i];
      if (i && p <= r->pos[i - 1]) {
        RFAIL(r, "read of seq %llu layer %u head %u: position %u at row %u after %u", (unsigned long long)id, layer, h,
              p, i, r->pos[i - 1]);
        return;
      }
      if (p >= MAX_TOKENS) {
        RFAIL(r, "read of seq %llu layer %u head %u: position %u at row %u was never appended", (unsigned long long)id,
              layer, h, p, i);
        return;
      }
      for (int kv = 0; kv < 1 + with_v; kv++) {
        model_row(id, layer, h, p, kv, want);
        const void *row = (const char *)(kv ? r->v : r->k) + (size_t)i * D * (dt == KVP_DTYPE_F32 ? 4 : 2);
        int bad;
        if (dt == KVP_DTYPE_BF16) bad = memcmp(row, want, sizeof want) != 0;
        else {
          bad = 0;
          for (uint32_t c = 0; c < D; c++) bad |= ((const float *)row)[c] != bf16_to_f32(want[c]);
        }
        if (bad) {
          RFAIL(r, "read of seq %llu layer %u head %u (%s): row %u of %u, position %u: %c differs from the model "
                   "(torn or stale row)",
                (unsigned long long)id, layer, h, dt == KVP_DTYPE_F32 ? "f32" : "bf16", i, q.n_tokens, p, "KV"[kv]);
          return;
        }
      }
      r->rows++;
    }
  }
}

/* Check every block of a view against the model; 0 if something is wrong. */
static int view_verify(reader *r, const kvp_view *vw, uint64_t id, uint32_t layer, const char *when) {
  uint16_t want[D];
  uint32_t prev_head = 0, prev_end = 0;
  if (vw->seq != id || vw->layer != layer || (vw->n_blocks && !vw->blocks)) {
    RFAIL(r, "view of seq %llu layer %u (%s): header says seq %llu layer %u, %u blocks", (unsigned long long)id, layer,
          when, (unsigned long long)vw->seq, vw->layer, vw->n_blocks);
    return 0;
  }
  for (uint32_t b = 0; b < vw->n_blocks; b++) {
    const kvp_view_block *vb = &vw->blocks[b];
    uint32_t p0 = vb->block_pos0 + vb->first;
    if (vb->head >= H || vb->head < prev_head || (b && vb->head == prev_head && p0 < prev_end) || !vb->n_tokens ||
        vb->first + vb->n_tokens > BT || p0 + vb->n_tokens > MAX_TOKENS) {
      RFAIL(r, "view of seq %llu layer %u (%s): block %u (head %u, positions %u + %u..%u) out of order or malformed",
            (unsigned long long)id, layer, when, b, vb->head, vb->block_pos0, vb->first, vb->first + vb->n_tokens);
      return 0;
    }
    prev_head = vb->head;
    prev_end = p0 + vb->n_tokens;
    for (int kv = 0; kv < 2; kv++) {
      const unsigned char *pg = vb->page[kv][KVP_PAGE_RAW];
      /* raw rows are bf16 (the OPEN tail, and passthrough layers) or fp32 (layers 1-2 once sealed) */
      uint64_t row = vb->cap_tokens ? vb->page_bytes[kv][KVP_PAGE_RAW] / vb->cap_tokens : 0;
      if (!pg || vb->codec[kv] != 0 || (row != D * 2 && row != D * 4) || vb->first + vb->n_tokens > vb->cap_tokens) {
        RFAIL(r, "view of seq %llu layer %u (%s): block %u has no raw %c page of %u tokens", (unsigned long long)id,
              layer, when, b, "KV"[kv], vb->first + vb->n_tokens);
        return 0;
      }
      for (uint32_t i = 0; i < vb->n_tokens; i++) {
        model_row(id, layer, vb->head, p0 + i, kv, want);
        const unsigned char *got = pg + (size_t)(vb->first + i) * row;
        int differs = 0;
        if (row == D * 2) differs = memcmp(got, want, sizeof want) != 0;
        else /* fp32 holds the bf16 value exactly: its top half */
          for (uint32_t d = 0; d < D && !differs; d++) {
            uint32_t u;
            memcpy(&u, got + d * 4, 4);
            differs = (u & 0xffff) || (uint16_t)(u >> 16) != want[d];
          }
        if (differs) {
          RFAIL(r, "view of seq %llu layer %u (%s): block %u head %u position %u: %c page bytes differ from the model",
                (unsigned long long)id, layer, when, b, vb->head, p0 + i, "KV"[kv]);
          return 0;
        }
      }
    }
    r->view_rows += vb->n_tokens;
  }
  return 1;
}

static void reader_view(reader *r, uint64_t id, uint32_t layer) {
  int st0 = state_of(id);
  kvp_view *vw = NULL;
  int rc = kvp_view_acquire(r->pool, id, layer, &vw);
  r->views++;
  if (!judge(r, "view", id, st0, rc)) {
    if (vw) RFAIL(r, "a failed view_acquire left a view behind");
    return;
  }
  if (rc != KVP_OK || !vw) {
    RFAIL(r, "view of seq %llu layer %u: %s, view %p", (unsigned long long)id, layer, kvp_err_name(rc), (void *)vw);
    return;
  }
  r->view_blocks += vw->n_blocks;
  if (!view_verify(r, vw, id, layer, "at acquire")) {
    kvp_view_release(r->pool, vw);
    return;
  }
  /* hold it across writer operations now and then */
  for (int i = 0; i < MAX_HELD; i++)
    if (!r->hv[i].view && rnd(&r->rng) % 2) {
      uint64_t now = atomic_load_explicit(&g_ops, memory_order_relaxed);
      r->hv[i] = (held_view){vw, id, now, now + 2 + rnd(&r->rng) % 12};
      atomic_store_explicit(&g_viewed, id + 1, memory_order_relaxed);
      r->held++;
      return;
    }
  kvp_view_release(r->pool, vw);
}

/* Check held views again (the writer may have evicted or freed their
 * sequence meanwhile: pinned pages must still hold their rows), release. */
static void reader_release_held(reader *r, int all) {
  uint64_t now = atomic_load_explicit(&g_ops, memory_order_relaxed);
  for (int i = 0; i < MAX_HELD; i++) {
    held_view *h = &r->hv[i];
    if (!h->view || (!all && now < h->release_at)) continue;
    int gone = state_of(h->id) == ID_GONE;
    if (view_verify(r, h->view, h->id, h->view->layer, gone ? "held, sequence freed meanwhile" : "held")) {
      r->held_across += now > h->ops_at;
      r->held_gone += gone;
    }
    kvp_view_release(r->pool, h->view);
    h->view = NULL;
  }
}

static void reader_info(reader *r, uint64_t id) {
  int st0 = state_of(id);
  uint32_t ret[L * H], ev[L * H];
  kvp_seq_desc d = {.struct_size = sizeof d, .retained_tokens = ret, .evicted_tokens = ev};
  int rc = kvp_seq_info(r->pool, id, &d);
  r->infos++;
  if (!judge(r, "seq_info", id, st0, rc)) return;
  uint64_t sr = 0, se = 0;
  for (int i = 0; i < L * H; i++) sr += ret[i], se += ev[i];
  if (rc != KVP_OK || sr != d.tokens_retained || se != d.tokens_evicted || (int)d.mode != lin_mode[id] ||
      (d.in_step != 0 && d.in_step != 1) || d.n_positions > MAX_TOKENS || d.n_steps > MAX_STEPS)
    RFAIL(r, "seq_info of seq %llu: %s, mode %d (model %d), %u steps, %u positions, in_step %d, retained %llu "
             "(streams %llu), evicted %llu (streams %llu)",
          (unsigned long long)id, kvp_err_name(rc), (int)d.mode, lin_mode[id], d.n_steps, d.n_positions, d.in_step,
          (unsigned long long)d.tokens_retained, (unsigned long long)sr, (unsigned long long)d.tokens_evicted,
          (unsigned long long)se);
}

static void *reader_main(void *arg) {
  reader *r = arg;
  while (!atomic_load_explicit(&g_stop, memory_order_acquire) && !r->failed) {
    uint64_t id = pick_id(r), x = rnd(&r->rng);
    uint32_t layer = (uint32_t)(x >> 8) % L;
    if (x % 16 < 11) reader_read(r, id, layer);
    else if (x % 16 < 15) reader_view(r, id, layer);
    else reader_info(r, id);
    reader_release_held(r, 0);
  }
  reader_release_held(r, 1);
  return NULL;
}

/* ---- the writer's model of its live sequences ------------------------------ */

typedef struct wseq {
  int used;
  uint64_t id;
  kvp_seq_mode mode;
  uint32_t plan[24], n_plan;        /* planned schedule (step mode, sometimes) */
  uint32_t nsteps;                  /* steps begun */
  uint32_t pos[MAX_STEPS + 1];      /* first position of each step; pos[nsteps] = end */
  int in_step;                      /* a step is open */
  uint32_t next_layer;              /* next layer to append in the open step */
  uint32_t target;                  /* positions at which it finishes */
  uint32_t prompt;                  /* tokens of its shared-family prompt (its first step computes the rest), or 0 */
  uint8_t evicted[L][H][MAX_STEPS]; /* (layer, head, step) evicted */
} wseq;

static wseq W[MAXLIVE];

typedef struct wstats {
  uint64_t ops, adds, steps, appends, evicts, evict_enoent, forks, fork_refused, frees, preempts, finished, aimed,
      checks, verified_rows, attached;
} wstats;

static kvp_pool *P;
static wstats WS;
static uint64_t wrng;

static void wcheck(void) {
  ck_ok(kvp_check(P));
  WS.checks++;
}

/* Is step s of (layer, head) retained by the model? */
static int retained(const wseq *m, uint32_t l, uint32_t h, uint32_t s) {
  if (m->evicted[l][h][s]) return 0;
  return !(m->in_step && s + 1 == m->nsteps && l >= m->next_layer);
}

/* The writer's exact read-back: it alone mutates, so it knows which
 * positions each (layer, head) retains. */
static void writer_verify(const wseq *m, uint32_t l) {
  static uint16_t k[READ_CAP * D], v[READ_CAP * D];
  static uint32_t pos[READ_CAP];
  uint16_t want[D];
  for (uint32_t h = 0; h < H; h++) {
    kvp_read_req q = {sizeof q, h, KVP_DTYPE_BF16, k, v, pos, READ_CAP, 0, NULL};
    ck_ok(kvp_read(P, m->id, l, &q));
    uint32_t i = 0;
    for (uint32_t s = 0; s < m->nsteps; s++) {
      if (!retained(m, l, h, s)) continue;
      for (uint32_t t = m->pos[s]; t < m->pos[s + 1]; t++, i++) {
        int bad = i >= q.n_tokens || pos[i] != t;
        if (!bad) model_row(m->id, l, h, t, 0, want), bad = memcmp(&k[(size_t)i * D], want, sizeof want) != 0;
        if (!bad) model_row(m->id, l, h, t, 1, want), bad = memcmp(&v[(size_t)i * D], want, sizeof want) != 0;
        if (bad)
          ck_abort_msg("writer read-back of seq %llu layer %u head %u: row %u (position %u, step %u) differs or is "
                       "missing (%u read)",
                       (unsigned long long)m->id, l, h, i, t, s, q.n_tokens);
      }
    }
    ck_assert_uint_eq(q.n_tokens, i);
    WS.verified_rows += i;
  }
}

/* Appended end position of a layer (the open step counts once appended). */
static uint32_t layer_end(const wseq *m, uint32_t l) {
  return m->in_step && l >= m->next_layer ? m->pos[m->nsteps - 1] : m->pos[m->nsteps];
}

/* Blocks stream (l, h) must hold: step mode, ceil(n / BT) per retained step;
 * stream mode, each 16-position slot of the appended range that holds a
 * retained position, plus the unfilled tail. Anything more is a leak. */
static uint32_t want_blocks(const wseq *m, uint32_t l, uint32_t h) {
  uint32_t n = 0, end = layer_end(m, l);
  if (m->mode == KVP_SEQ_STEP) {
    for (uint32_t s = 0; s < m->nsteps; s++)
      if (retained(m, l, h, s)) n += (m->pos[s + 1] - m->pos[s] + BT - 1) / BT;
    return n;
  }
  for (uint32_t b0 = 0, s = 0; b0 < end; b0 += BT) {
    int keep = b0 + BT > end; /* OPEN: takes more tokens */
    while (s < m->nsteps && m->pos[s + 1] <= b0) s++;
    for (uint32_t t = s; !keep && t < m->nsteps && m->pos[t] < b0 + BT && m->pos[t] < end; t++) keep = retained(m, l, h, t);
    n += (uint32_t)keep;
  }
  return n;
}

/* kvp_seq_info against the model: steps, positions, tokens retained and
 * evicted per stream, and exactly the pages of the blocks it must hold. */
static void writer_info(const wseq *m) {
  uint32_t ret[L * H], ev[L * H];
  kvp_seq_desc d = {.struct_size = sizeof d, .retained_tokens = ret, .evicted_tokens = ev};
  ck_ok(kvp_seq_info(P, m->id, &d));
  ck_assert_int_eq(d.mode, m->mode);
  ck_assert_uint_eq(d.n_steps, m->nsteps);
  ck_assert_uint_eq(d.n_positions, m->in_step ? m->pos[m->nsteps - 1] : m->pos[m->nsteps]);
  ck_assert_int_eq(d.in_step, m->in_step);
  uint64_t blocks = 0;
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      uint32_t r = 0, e = 0;
      for (uint32_t s = 0; s < m->nsteps; s++) {
        uint32_t n = m->pos[s + 1] - m->pos[s];
        if (retained(m, l, h, s)) r += n;
        else if (m->evicted[l][h][s]) e += n;
      }
      ck_assert_msg(ret[l * H + h] == r && ev[l * H + h] == e,
                    "seq %llu layer %u head %u: %u tokens retained, %u evicted; the model says %u, %u",
                    (unsigned long long)m->id, l, h, ret[l * H + h], ev[l * H + h], r, e);
      blocks += want_blocks(m, l, h);
    }
  ck_assert_msg(d.page_types[KVP_PAGE_RAW].npages == 2 * blocks,
                "seq %llu (%s mode): %llu raw pages, the model says %llu (K and V of %llu blocks)",
                (unsigned long long)m->id, m->mode == KVP_SEQ_STEP ? "step" : "stream",
                (unsigned long long)d.page_types[KVP_PAGE_RAW].npages, 2ull * blocks, (unsigned long long)blocks);
}

static int free_slot(void) {
  for (int i = 0; i < MAXLIVE; i++)
    if (!W[i].used) return i;
  return -1;
}

static int nlive(void) {
  int n = 0;
  for (int i = 0; i < MAXLIVE; i++) n += W[i].used;
  return n;
}

/* A random live slot (or -1); busy: 1 = only in a step, 0 = only between steps, -1 = any. */
static int pick_slot(int busy) {
  int c[MAXLIVE], n = 0;
  for (int i = 0; i < MAXLIVE; i++)
    if (W[i].used && (busy < 0 || W[i].in_step == busy)) c[n++] = i;
  return n ? c[rnd(&wrng) % (uint64_t)n] : -1;
}

/* Prompts of one family share their token ids, so their sequences share
 * prefix chunks: their lineage's parent is the root g_root (an id never
 * added) below their prompt's end, so every one of them writes, and reads
 * from a chunk another computed, the root's values there. */
static uint32_t PROMPT[MAX_TOKENS];
static uint64_t g_root;

/* Publish a fresh id's lineage before the pool may show it. */
static uint64_t publish_id(int64_t parent, uint32_t fork_pos, kvp_seq_mode mode) {
  uint64_t id = atomic_load_explicit(&g_next_id, memory_order_relaxed);
  lin_parent[id] = parent;
  lin_fork_pos[id] = fork_pos;
  lin_mode[id] = (int)mode;
  atomic_store_explicit(&lin_state[id], ID_LIVE, memory_order_release);
  atomic_store_explicit(&g_next_id, id + 1, memory_order_relaxed);
  return id;
}

static void forget(int slot) {
  wseq *m = &W[slot];
  atomic_store_explicit(&lin_state[m->id], ID_GONE, memory_order_release);
  atomic_store_explicit(&g_live[slot], 0, memory_order_relaxed);
  m->used = 0;
}

static void op_free(int slot) {
  ck_ok(kvp_seq_free(P, W[slot].id));
  forget(slot);
  WS.frees++;
}

static void op_add(void) {
  int slot = free_slot();
  if (slot < 0 || atomic_load_explicit(&g_next_id, memory_order_relaxed) >= MAX_IDS) return;
  wseq *m = &W[slot];
  memset(m, 0, sizeof *m);
  m->mode = rnd(&wrng) % 3 == 0 ? KVP_SEQ_STEP : KVP_SEQ_STREAM;
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = m->mode;
  if (m->mode == KVP_SEQ_STEP) {
    m->target = 64 + (uint32_t)(rnd(&wrng) % 600);
    if (rnd(&wrng) % 2) { /* a VAR-like plan: growing scales */
      m->n_plan = 4 + (uint32_t)(rnd(&wrng) % 8);
      for (uint32_t k = 0; k < m->n_plan; k++) m->plan[k] = 1 + (k + 1) * (k + 1) + (uint32_t)(rnd(&wrng) % 8);
      sc.step_tokens = m->plan;
      sc.n_steps = m->n_plan;
    }
  } else {
    m->target = 48 + (uint32_t)(rnd(&wrng) % 640);
    if (rnd(&wrng) % 2 == 0) { /* a prompt of the shared family: attaches what the pool holds of it */
      sc.tokens = PROMPT;
      sc.n_tokens = m->prompt = 24 + (uint32_t)(rnd(&wrng) % (MAX_STEP_N - 24));
    }
  }
  m->id = publish_id(sc.n_tokens ? (int64_t)g_root : -1, sc.n_tokens, m->mode);
  ck_ok(kvp_seq_add(P, m->id, &sc));
  if (sc.n_tokens) {
    kvp_seq_desc d = {.struct_size = sizeof d};
    ck_ok(kvp_seq_info(P, m->id, &d));
    if (d.n_positions) { /* step 0: the shared chunks */
      m->nsteps = 1;
      m->pos[1] = d.n_positions;
      WS.attached += d.n_positions;
    }
  }
  m->used = 1;
  atomic_store_explicit(&g_live[slot], m->id + 1, memory_order_relaxed);
  WS.adds++;
}

static uint32_t step_tokens(const wseq *m) {
  uint32_t k = m->nsteps, end = m->pos[k], n;
  if (k < m->n_plan) return m->plan[k];
  uint64_t x = rnd(&wrng);
  if (m->mode == KVP_SEQ_STEP) n = 1 + (uint32_t)(x % 96);
  else if (k == 0) n = m->prompt ? m->prompt : 1 + (uint32_t)(x % 300); /* prefill */
  else if (end < m->prompt) n = m->prompt - end; /* the prompt's rest after an attach */
  else n = x % 5 ? 1 : 2 + (uint32_t)((x >> 8) % 40);             /* decode, or a chunk */
  if (n > MAX_STEP_N) n = MAX_STEP_N;
  if (end + n > MAX_TOKENS) n = MAX_TOKENS - end;
  return n;
}

/* Finish a sequence: read every layer back exactly, then free it. */
static void op_finish(int slot) {
  writer_info(&W[slot]);
  for (uint32_t l = 0; l < L; l++) writer_verify(&W[slot], l);
  op_free(slot);
  WS.finished++;
}

/* One step of progress: begin a step, append its next layer, or end it. */
static void op_advance(int slot) {
  static uint16_t k[MAX_STEP_N * H * D], v[MAX_STEP_N * H * D];
  wseq *m = &W[slot];
  if (!m->in_step) {
    if (m->pos[m->nsteps] >= m->target || m->pos[m->nsteps] >= MAX_TOKENS || m->nsteps + 1 >= MAX_STEPS) {
      op_finish(slot);
      return;
    }
    uint32_t n = step_tokens(m);
    ck_ok(kvp_step_begin(P, m->id, n, 0));
    m->pos[m->nsteps + 1] = m->pos[m->nsteps] + n;
    m->nsteps++;
    m->in_step = 1;
    m->next_layer = 0;
    WS.steps++;
    return;
  }
  if (m->next_layer == L) {
    ck_ok(kvp_step_end(P, m->id));
    m->in_step = 0;
    return;
  }
  uint32_t l = m->next_layer, p0 = m->pos[m->nsteps - 1], n = m->pos[m->nsteps] - p0;
  for (uint32_t t = 0; t < n; t++)
    for (uint32_t h = 0; h < H; h++) {
      model_row(m->id, l, h, p0 + t, 0, &k[((size_t)t * H + h) * D]);
      model_row(m->id, l, h, p0 + t, 1, &v[((size_t)t * H + h) * D]);
    }
  kvp_kv kv = {k, v, NULL};
  int rc = kvp_append(P, m->id, l, &kv);
  if (rc == KVP_EBUDGET || rc == KVP_ENOSPC) { /* preempt: the engine would recompute it later */
    op_free(slot);
    WS.preempts++;
    return;
  }
  ck_assert_msg(rc == KVP_OK, "append seq %llu layer %u: %s: %s", (unsigned long long)m->id, l, kvp_err_name(rc),
                kvp_last_error());
  m->next_layer++;
  WS.appends++;
}

static void op_evict(int slot, int prefer_recent) {
  wseq *m = &W[slot];
  if (!m->nsteps) return;
  uint64_t x = rnd(&wrng);
  uint32_t l = (uint32_t)(x >> 8) % L, h = (uint32_t)(x >> 16) % H;
  uint32_t s = prefer_recent && x % 2 ? m->nsteps - 1 - (uint32_t)((x >> 24) % (m->nsteps < 4 ? m->nsteps : 4))
                                      : (uint32_t)((x >> 24) % m->nsteps);
  int want = retained(m, l, h, s) ? KVP_OK : KVP_ENOENT;
  ck_status(kvp_evict(P, m->id, l, h, s), want);
  if (want == KVP_OK) m->evicted[l][h][s] = 1;
  WS.evicts += want == KVP_OK;
  WS.evict_enoent += want != KVP_OK;
}

static void op_fork(void) {
  int ps = pick_slot(-1), cs = free_slot();
  if (ps < 0 || cs < 0 || atomic_load_explicit(&g_next_id, memory_order_relaxed) >= MAX_IDS) return;
  wseq *pm = &W[ps];
  if (pm->in_step) { /* fork between steps only */
    ck_status(kvp_seq_fork(P, pm->id, NO_SUCH_SEQ - 1), KVP_EBUSY);
    return;
  }
  uint64_t c = publish_id((int64_t)pm->id, pm->pos[pm->nsteps], pm->mode);
  int rc = kvp_seq_fork(P, pm->id, c);
  if (rc == KVP_EBUDGET || rc == KVP_ENOSPC) {
    atomic_store_explicit(&lin_state[c], ID_GONE, memory_order_release); /* it never existed */
    WS.fork_refused++;
    return;
  }
  ck_assert_msg(rc == KVP_OK, "fork %llu -> %llu: %s: %s", (unsigned long long)pm->id, (unsigned long long)c,
                kvp_err_name(rc), kvp_last_error());
  W[cs] = *pm;
  W[cs].id = c;
  W[cs].target = pm->target + 16 + (uint32_t)(rnd(&wrng) % 64);
  atomic_store_explicit(&g_live[cs], c + 1, memory_order_relaxed);
  WS.forks++;
  if (rnd(&wrng) % 4 == 0) {
    writer_info(&W[cs]);
    writer_verify(&W[cs], (uint32_t)rnd(&wrng) % L);
  }
}

/* Aim at a sequence a reader holds a view of: evict from it or free it. */
static void op_aim(void) {
  uint64_t v = atomic_load_explicit(&g_viewed, memory_order_relaxed);
  for (int i = 0; v && i < MAXLIVE; i++)
    if (W[i].used && W[i].id == v - 1) {
      WS.aimed++;
      if (rnd(&wrng) % 3 == 0) op_free(i);
      else
        for (int e = 0; e < 4; e++) op_evict(i, 1);
      return;
    }
}

/* Error paths of the writer's calls: each must fail and change nothing. */
static void op_errors(void) {
  int s = pick_slot(-1);
  ck_status(kvp_seq_free(P, NO_SUCH_SEQ + 7), KVP_ENOENT);
  ck_status(kvp_evict(P, NO_SUCH_SEQ + 7, 0, 0, 0), KVP_ENOENT);
  if (s >= 0) {
    ck_status(kvp_seq_add(P, W[s].id, NULL), KVP_EEXIST);
    ck_status(kvp_evict(P, W[s].id, 0, 0, W[s].nsteps), KVP_ENOENT);
    int other = pick_slot(-1);
    if (other >= 0 && other != s && !W[s].in_step) ck_status(kvp_seq_fork(P, W[s].id, W[other].id), KVP_EEXIST);
  }
}

static void writer_op(void) {
  uint64_t x = rnd(&wrng) % 1000;
  int slot;
  if (x < 80 || nlive() < 3) op_add();
  else if (x < 700) {
    if ((slot = pick_slot(-1)) >= 0) op_advance(slot);
  } else if (x < 850) {
    if ((slot = pick_slot(-1)) >= 0) op_evict(slot, 0);
  } else if (x < 900) op_fork();
  else if (x < 920) {
    if ((slot = pick_slot(-1)) >= 0) op_free(slot);
  } else if (x < 970) op_aim();
  else if (x < 975) op_errors();
  else if ((slot = pick_slot(-1)) >= 0) {
    writer_info(&W[slot]);
    writer_verify(&W[slot], (uint32_t)rnd(&wrng) % L);
  }
  WS.ops++;
  atomic_store_explicit(&g_ops, WS.ops, memory_order_relaxed);
  if (WS.ops % CHECK_EVERY == 0) wcheck();
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double env_num(const char *name, double dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end;
  double v = strtod(s, &end);
  return *end || v <= 0 ? dflt : v;
}

START_TEST(readers_beside_writer) {
  double seconds = env_num("KVP_STRESS_SECONDS", 2);
  wrng = (uint64_t)env_num("KVP_STRESS_SEED", 0x5EED5);
  memset(W, 0, sizeof W);
  memset(&WS, 0, sizeof WS);
  atomic_store(&g_next_id, 0);
  atomic_store(&g_ops, 0);
  atomic_store(&g_viewed, 0);
  atomic_store(&g_stop, 0);
  for (int i = 0; i < MAXLIVE; i++) atomic_store(&g_live[i], 0);
  for (uint32_t i = 0; i < MAX_TOKENS; i++) PROMPT[i] = i * 7 + 1;
  g_root = publish_id(-1, 0, KVP_SEQ_STREAM);

  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.block_tokens = BT;
  /* layers 1 and 2 store fp32: lossless for bf16 input, but not the tail's
   * format, so their OPEN blocks are sealed into new blocks under readers */
  c.codecs = "layers=1-2:kv=fp32";
  c.region_bytes = 16ull << 20;
  c.budget_bytes = 5ull << 20; /* binds: appends and forks get refused, sequences are preempted */
  ck_ok(kvp_pool_create(&c, &P));

  reader *rd = calloc(NREADERS, sizeof *rd);
  ck_assert_ptr_nonnull(rd);
  for (int i = 0; i < NREADERS; i++) {
    rd[i].pool = P;
    rd[i].rng = mix64(wrng + (uint64_t)i + 1) | 1;
    rd[i].k = malloc((size_t)READ_CAP * D * 4);
    rd[i].v = malloc((size_t)READ_CAP * D * 4);
    rd[i].pos = malloc((size_t)READ_CAP * sizeof(uint32_t));
    ck_assert(rd[i].k && rd[i].v && rd[i].pos);
  }
  for (int i = 0; i < NREADERS; i++) ck_assert_int_eq(pthread_create(&rd[i].th, NULL, reader_main, &rd[i]), 0);

  double t0 = now_s();
  int failed = 0;
  while ((now_s() - t0 < seconds || WS.ops < MIN_OPS) && !failed) {
    for (int i = 0; i < 64; i++) writer_op();
    for (int i = 0; i < NREADERS; i++) failed |= atomic_load_explicit(&rd[i].failed, memory_order_acquire);
  }
  atomic_store_explicit(&g_stop, 1, memory_order_release);
  for (int i = 0; i < NREADERS; i++) pthread_join(rd[i].th, NULL);
  double elapsed = now_s() - t0;

  wcheck();
  reader sum = {0};
  for (int i = 0; i < NREADERS; i++) {
    ck_assert_msg(!atomic_load(&rd[i].failed), "reader %d: %s", i, rd[i].fail);
    sum.reads += rd[i].reads, sum.rows += rd[i].rows, sum.enoent += rd[i].enoent, sum.enospc += rd[i].enospc;
    sum.views += rd[i].views, sum.view_blocks += rd[i].view_blocks, sum.view_rows += rd[i].view_rows;
    sum.held += rd[i].held, sum.held_across += rd[i].held_across, sum.held_gone += rd[i].held_gone;
    sum.infos += rd[i].infos;
  }
  /* the writer's last word: every live sequence read back exactly, then freed */
  for (int i = 0; i < MAXLIVE; i++)
    if (W[i].used) op_finish(i);
  wcheck();
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(P, &s));
  printf("stress: %.1f s, %d readers; writer: %llu ops (%llu adds, %llu steps, %llu appends, %llu evictions + %llu "
         "refused, %llu forks + %llu refused, %llu frees, %llu preempted, %llu finished, %llu aimed at held views, "
         "%llu checks, %llu rows read back, %llu prefix tokens attached); readers: %llu reads, %llu rows verified, %llu ENOENT, %llu ENOSPC, %llu "
         "views (%llu blocks, %llu rows verified), %llu held (%llu across writer ops, %llu past a free), %llu "
         "seq_info; peak %llu of %llu budget bytes\n",
         elapsed, NREADERS, (unsigned long long)WS.ops, (unsigned long long)WS.adds, (unsigned long long)WS.steps,
         (unsigned long long)WS.appends, (unsigned long long)WS.evicts, (unsigned long long)WS.evict_enoent,
         (unsigned long long)WS.forks, (unsigned long long)WS.fork_refused, (unsigned long long)WS.frees,
         (unsigned long long)WS.preempts, (unsigned long long)WS.finished, (unsigned long long)WS.aimed,
         (unsigned long long)WS.checks, (unsigned long long)WS.verified_rows, (unsigned long long)WS.attached,
         (unsigned long long)sum.reads,
         (unsigned long long)sum.rows, (unsigned long long)sum.enoent, (unsigned long long)sum.enospc,
         (unsigned long long)sum.views, (unsigned long long)sum.view_blocks, (unsigned long long)sum.view_rows,
         (unsigned long long)sum.held, (unsigned long long)sum.held_across, (unsigned long long)sum.held_gone,
         (unsigned long long)sum.infos, (unsigned long long)s.bytes_allocated.peak, (unsigned long long)s.budget_bytes);
  fflush(stdout);

  /* the run did what it claims (it cannot pass by doing nothing) */
  ck_assert_uint_gt(sum.rows, 10000);
  ck_assert_uint_gt(sum.view_rows, 1000);
  ck_assert_uint_gt(sum.held_across, 0);
  ck_assert_uint_gt(sum.enoent, 0);
  ck_assert_uint_gt(sum.enospc, 0);
  ck_assert_uint_gt(WS.evicts, 0);
  ck_assert_uint_gt(WS.forks, 0);
  ck_assert_uint_gt(WS.finished, 0);
  ck_assert_uint_gt(WS.attached, 0);
  /* nothing left: every byte and token went back */
  ck_assert_uint_le(s.bytes_allocated.peak, s.budget_bytes);
  ck_assert_uint_eq(s.bytes_allocated.current, 0);
  ck_assert_uint_eq(s.bytes_requested.current, 0);
  ck_assert_uint_eq(s.pages.current, 0);
  ck_assert_uint_eq(s.tokens_retained.current, 0);
  ck_assert_uint_eq(s.sequences.current, 0);
  for (int i = 0; i < NREADERS; i++) free(rd[i].k), free(rd[i].v), free(rd[i].pos);
  free(rd);
  kvp_pool_destroy(P);
  P = NULL;
}
END_TEST

int main(void) {
  double seconds = env_num("KVP_STRESS_SECONDS", 2);
  Suite *s = suite_create("stress");
  TCase *tc = tcase_create("stress");
  tcase_set_timeout(tc, seconds * 4 + 120); /* the writer's last read-back and checks come after the run */
  tcase_add_test(tc, readers_beside_writer);
  suite_add_tcase(s, tc);
  return it_run(s);
}
