/*
 * tests/fuzz/fuzz_ops.c - sequences of public calls on a small pool: byte 0
 * picks codecs, policy and budget, then each pair of bytes is one call
 * (seq add/free/fork, step begin/end, append, a whole step, evict, read,
 * reclaim) with its arguments, valid or not. After every call kvp_check
 * must pass, and a call that failed must have changed nothing: ledger
 * bytes and pages, tokens retained and evicted, live sequences, and each
 * sequence's steps, positions and open step. Once every sequence is freed
 * the pool holds no page, byte or token.
 */
#include "fuzz.h"

enum { L = 2, H = 2, D = 16, MAXN = 16, NSEQ = 4 };

static const char *const CODECS[] = {NULL, "k=fp8,v=int8", "kv=kivi:bits=2:group=16", "k=nvfp4,v=bf16",
                                     "kv=kvquant:calib_tokens=16", "kv=qvg:k=4:group=16", "k=bf16,v=fp8;layers=1:kv=int8",
                                     "kv=fp16"};
static const char *const POLICIES[] = {NULL, "window:sink=2:recent=8", "multishot:global=1:shot=1:window=2",
                                       "heatkv:b=0.5:s=1:orders=synthetic"};
static const uint32_t PLAN[6] = {2, 4, 6, 8, 10, 12};

static uint16_t KV[MAXN * H * D], KVNAN[MAXN * H * D];

typedef struct fp {
  uint64_t req, alloc, pages, tokens, evicted, seqs;
  int exists[NSEQ], in_step[NSEQ];
  uint32_t steps[NSEQ], positions[NSEQ];
  uint64_t seq_tokens[NSEQ];
} fp;

static void fingerprint(kvp_pool *p, fp *f) {
  memset(f, 0, sizeof *f);
  kvp_stats s = {.struct_size = sizeof s};
  FUZZ_ASSERT(kvp_stats_get(p, &s) == KVP_OK, "stats");
  f->req = s.bytes_requested.current, f->alloc = s.bytes_allocated.current, f->pages = s.pages.current;
  f->tokens = s.tokens_retained.current, f->evicted = s.tokens_evicted, f->seqs = s.sequences.current;
  for (uint64_t q = 0; q < NSEQ; q++) {
    kvp_seq_desc d = {.struct_size = sizeof d};
    f->exists[q] = kvp_seq_info(p, q, &d) == KVP_OK;
    f->steps[q] = d.n_steps, f->positions[q] = d.n_positions, f->in_step[q] = d.in_step;
    f->seq_tokens[q] = d.tokens_retained;
  }
}

static int read_one(kvp_pool *p, uint64_t q, uint32_t l, uint32_t h) {
  static uint16_t out[1024 * D];
  static uint32_t pos[1024];
  kvp_read_req r = {sizeof r, h, KVP_DTYPE_BF16, out, out, pos, 1024, 0, NULL};
  return kvp_read(p, q, l, &r);
}

static int whole_step(kvp_pool *p, uint64_t q, uint32_t n, uint32_t flags) {
  int rc = kvp_step_begin(p, q, n, flags);
  for (uint32_t l = 0; !rc && l < L; l++) rc = kvp_append(p, q, l, &(kvp_kv){KV, KV, NULL});
  return rc ? rc : kvp_step_end(p, q);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1 || size > 512) return 0;
  if (!KV[0]) {
    for (size_t i = 0; i < sizeof KV / sizeof *KV; i++) KVNAN[i] = KV[i] = (uint16_t)(0x3e00 + (i * 37) % 512);
    KVNAN[5 * D + 3] = 0x7fc0; /* NaN: token 2, head 1, channel 3 */
  }
  uint8_t cfg = data[0];
  const char *codecs = CODECS[cfg % 8], *policy = POLICIES[cfg / 8 % 4];
  bool heatkv = cfg / 8 % 4 == 3;
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.block_tokens = cfg % 8 == 2 ? 16 : 8; /* kivi: its group */
  c.region_bytes = 2ull << 20;
  c.budget_bytes = cfg & 0x80 ? 24u << 10 : 0;
  c.codecs = codecs, c.policy = policy;
  /* One pool per configuration, kept across inputs (destroy waits for
   * urcu's call_rcu thread, which polls every 10 ms): each input starts
   * from an empty pool and must leave it empty. */
  static kvp_pool *pools[256];
  kvp_pool *p = pools[cfg];
  if (!p) FUZZ_ASSERT(kvp_pool_create(&c, &pools[cfg]) == KVP_OK, "create: %s", kvp_last_error());
  p = pools[cfg];
  uint32_t next[NSEQ] = {0}; /* the layer each sequence appends next (its open step) */
  for (size_t i = 1; i + 1 < size; i += 2) {
    uint8_t op = data[i] % 10, a = data[i + 1];
    uint64_t q = a % NSEQ;
    uint32_t l = (a >> 2) % 3, h = (a >> 3) % 3, n = 1 + (a >> 2) % MAXN; /* layer 2 and head 2 are out of range */
    bool with_nan = (a & 0xc0) == 0xc0;
    if (kvp_reclaim(p)) abort();
    fp before, after;
    fingerprint(p, &before);
    int rc = KVP_OK;
    switch (op) {
    case 0: {
      kvp_seq_config sc;
      kvp_seq_config_init(&sc);
      sc.mode = heatkv || (a & 0x40) ? KVP_SEQ_STEP : KVP_SEQ_STREAM;
      if (heatkv || (a & 0x80)) sc.step_tokens = PLAN, sc.n_steps = 6;
      rc = kvp_seq_add(p, q, &sc);
      break;
    }
    case 1: rc = kvp_seq_free(p, q); break;
    case 2: rc = kvp_seq_fork(p, q, (a >> 4) % NSEQ); break;
    case 3: {
      kvp_seq_desc d = {.struct_size = sizeof d};
      uint32_t k = kvp_seq_info(p, q, &d) == KVP_OK ? d.n_steps : 0;
      if ((a & 0x40) && k < 6) n = PLAN[k]; /* follow a plan when there is one */
      rc = kvp_step_begin(p, q, n, (a & 0x80) ? KVP_STEP_SCENE_CUT : 0);
      if (!rc) next[q] = 0;
      break;
    }
    case 4:
      if (!(a & 0x20)) l = next[q]; /* mostly the layer that comes next */
      rc = kvp_append(p, q, l, &(kvp_kv){with_nan ? KVNAN : KV, KV, NULL});
      if (!rc) next[q] = l + 1;
      break;
    case 5: rc = kvp_step_end(p, q); break;
    case 6: rc = kvp_evict(p, q, l, h, (a >> 5) % 8); break;
    case 7: rc = read_one(p, q, l, h); break;
    case 8: rc = kvp_reclaim(p); break;
    case 9: {
      kvp_seq_desc d = {.struct_size = sizeof d};
      uint32_t k = kvp_seq_info(p, q, &d) == KVP_OK ? d.n_steps : 0;
      rc = whole_step(p, q, k < 6 && (heatkv || (a & 0x40)) ? PLAN[k] : n, (a & 0x80) ? KVP_STEP_SCENE_CUT : 0);
      if (rc) rc = KVP_OK; /* several calls: some may have succeeded */
      break;
    }
    }
    FUZZ_ASSERT(rc <= 0, "status %d", rc);
    FUZZ_ASSERT(kvp_check(p) == KVP_OK, "op %u arg %u: %s", op, a, kvp_last_error());
    if (rc != KVP_OK && op != 7) {
      char err[512];
      snprintf(err, sizeof err, "%s", kvp_last_error());
      fingerprint(p, &after);
      FUZZ_ASSERT(!memcmp(&before, &after, sizeof after), "op %u arg %u failed (%s) and changed the pool: tokens %llu -> "
                  "%llu, allocated %llu -> %llu", op, a, err, (unsigned long long)before.tokens,
                  (unsigned long long)after.tokens, (unsigned long long)before.alloc, (unsigned long long)after.alloc);
    }
  }
  for (uint64_t q = 0; q < NSEQ; q++) {
    int rc = kvp_seq_free(p, q);
    FUZZ_ASSERT(rc == KVP_OK || rc == KVP_ENOENT, "free %llu: %s", (unsigned long long)q, kvp_last_error());
  }
  FUZZ_ASSERT(kvp_reclaim(p) == KVP_OK && kvp_check(p) == KVP_OK, "%s", kvp_last_error());
  kvp_stats s = {.struct_size = sizeof s};
  FUZZ_ASSERT(kvp_stats_get(p, &s) == KVP_OK, "stats");
  FUZZ_ASSERT(s.sequences.current == 0 && s.pages.current == 0 && s.bytes_allocated.current == 0 &&
                  s.tokens_retained.current == 0,
              "every sequence freed, yet %llu pages, %llu bytes, %llu tokens are left",
              (unsigned long long)s.pages.current, (unsigned long long)s.bytes_allocated.current,
              (unsigned long long)s.tokens_retained.current);
  return 0;
}
