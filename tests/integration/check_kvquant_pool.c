/*
 * tests/integration/check_kvquant_pool.c - the KVQuant codec through the
 * pool (public header only): calibration written with kvp_kvquant_calib_*
 * from the test's own samples and loaded by kvp_pool_create; stream and
 * step mode appends read back within nuq3's error; the ledger's requested
 * bytes equal the codec's byte formula (D b / 8 + 3k per token-head, + 4
 * for V, + the RAW sink row of the first block); calibration counted in
 * bytes.codec_static; bad calibration files refuse the pool with
 * KVP_EFORMAT naming the field; pre-RoPE keys come back rotated at their
 * positions (sealed, OPEN and sink rows alike); appending one token at a
 * time grows the OPEN block's OUTLIERS page through size classes, and the
 * budget refuses a growth with nothing changed. kvp_check after every
 * step.
 */
#define KVP_EXPERIMENTAL_API /* raw pages: ballast that leaves an exact budget */
#include <check.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itest.h"
#include "kvpool_codec.h"

enum { L = 2, H = 2, D = 128, BT = 32, NTOK = 256, NCAL = 512 };

static float bf16f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static uint16_t f2bf(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static double unit(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(*s >> 11) / 9007199254740992.0;
}
static double gauss(uint64_t *s) {
  double u = unit(s), v = unit(s);
  return sqrt(-2.0 * log(u + 1e-300)) * cos(6.283185307179586 * v);
}

/* Keys: per-channel bias, channels d % 32 == 5 ten times larger; values:
 * unit noise; both with heavy tails (1 in 100 values x3). Channel
 * statistics depend on (layer, head, channel) only, so calibration samples
 * (one seed) describe the appended tokens (another seed). */
static float sample(uint32_t l, uint32_t h, uint32_t d, int kv, uint64_t *s) {
  double z = gauss(s);
  if (unit(s) < 0.01) z *= 3.0;
  if (kv) return (float)(0.8 * z);
  double bias = 0.5 * sin(d * 0.37 + h * 1.3 + l), scale = (d % 32 == 5 ? 10.0 : 1.0) * (0.7 + 0.3 * cos(d * 0.11));
  return (float)(bias + scale * z);
}

/* [n][L][H][D] bf16 K and V. */
static uint16_t K[NTOK * L * H * D], V[NTOK * L * H * D];

static void gen(uint64_t seed) {
  for (uint32_t t = 0; t < NTOK; t++)
    for (uint32_t l = 0; l < L; l++)
      for (uint32_t h = 0; h < H; h++)
        for (uint32_t d = 0; d < D; d++) {
          size_t i = (((size_t)t * L + l) * H + h) * D + d;
          K[i] = f2bf(sample(l, h, d, 0, &seed));
          V[i] = f2bf(sample(l, h, d, 1, &seed));
        }
}

/* RoPE (rotate-half) of one row in double, in place. */
static void rope(double *x, uint32_t pos, double theta) {
  for (uint32_t i = 0; i < D / 2; i++) {
    double a = pos * pow(theta, -2.0 * i / D), c = cos(a), s = sin(a), x0 = x[i], x1 = x[i + D / 2];
    x[i] = x0 * c - x1 * s;
    x[i + D / 2] = x1 * c + x0 * s;
  }
}

static char calib_path[64];

/* A calibration file from NCAL samples per (layer, head, side). */
static void write_calib(const char *path, uint32_t Lc, uint32_t bits) {
  kvp_kvquant_calib *c;
  ck_ok(kvp_kvquant_calib_create(Lc, H, D, bits, 0.01, &c));
  static float x[NCAL * D];
  uint64_t seed = 99;
  for (uint32_t l = 0; l < Lc; l++)
    for (uint32_t h = 0; h < H; h++)
      for (int kv = 0; kv < 2; kv++) {
        for (uint32_t t = 0; t < NCAL; t++)
          for (uint32_t d = 0; d < D; d++) x[t * D + d] = bf16f(f2bf(sample(l, h, d, kv, &seed)));
        ck_ok(kvp_kvquant_calib_add(c, l, h, (uint32_t)kv, x, NULL, D, NCAL));
      }
  ck_ok(kvp_kvquant_calib_write(c, path));
  kvp_kvquant_calib_destroy(c);
}

static void setup(void) {
  snprintf(calib_path, sizeof calib_path, "/tmp/kvq_poolXXXXXX");
  int fd = mkstemp(calib_path);
  ck_assert_int_ge(fd, 0);
  close(fd);
  write_calib(calib_path, L, 3);
}
static void teardown(void) { unlink(calib_path); }

static int mkpool(const char *codecs, uint64_t budget, kvp_pool **p) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.block_tokens = BT;
  c.region_bytes = 16ull << 20;
  c.budget_bytes = budget;
  c.codecs = codecs;
  *p = NULL;
  return kvp_pool_create(&c, p);
}

static void append_step(kvp_pool *p, uint64_t seq, uint32_t pos, uint32_t n) {
  static uint16_t k[NTOK * H * D], v[NTOK * H * D];
  ck_ok(kvp_step_begin(p, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    for (uint32_t t = 0; t < n; t++) {
      memcpy(k + (size_t)t * H * D, K + (((size_t)(pos + t) * L + l) * H) * D, H * D * 2);
      memcpy(v + (size_t)t * H * D, V + (((size_t)(pos + t) * L + l) * H) * D, H * D * 2);
    }
    kvp_kv kv = {k, v, NULL};
    ck_ok(kvp_append(p, seq, l, &kv));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_step_end(p, seq));
}

/* ||read - input|| / ||input|| of one side over every (layer, head). */
static double rel_err(kvp_pool *p, uint64_t seq, int kv, uint32_t n) {
  static float out[NTOK * D];
  double num = 0, den = 0;
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, kv ? NULL : out, kv ? out : NULL, NULL, NTOK, 0, NULL};
      ck_ok(kvp_read(p, seq, l, &q));
      ck_assert_uint_eq(q.n_tokens, n);
      for (uint32_t t = 0; t < n; t++)
        for (uint32_t d = 0; d < D; d++) {
          double want = bf16f((kv ? V : K)[(((size_t)t * L + l) * H + h) * D + d]), got = out[t * D + d];
          if (t == 0) ck_assert_msg(got == want, "sink token l %u h %u d %u: %g != %g", l, h, d, got, want);
          num += (got - want) * (got - want);
          den += want * want;
        }
    }
  return sqrt(num / den);
}

/* Requested bytes of n tokens of one stream in blocks as the pool cuts
 * them (steps of the given sizes in step mode, BT-token blocks in stream
 * mode once sealed): per token-head 48 + 6 (K), 48 + 6 + 4 (V); the first
 * block adds the sink row of D bf16 per side. */
static uint64_t want_bytes(uint32_t n) { return (uint64_t)n * (54 + 58) + 2 * D * 2; }

START_TEST(bytes_and_error) {
  char spec[160];
  snprintf(spec, sizeof spec, "kv=kvquant:calib=%s", calib_path);
  kvp_pool *p;
  ck_ok(mkpool(spec, 0, &p));
  gen(7);
  /* step mode: steps of 100, 100, 56 tokens, blocks encoded at once */
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  ck_ok(kvp_seq_add(p, 2, &sc));
  append_step(p, 2, 0, 100);
  append_step(p, 2, 100, 100);
  append_step(p, 2, 200, 56);
  kvp_usage u;
  ck_ok(kvp_stats_breakdown(p, KVP_DIM_SEQ, 2, &u));
  ck_assert_uint_eq(u.requested_bytes, L * H * want_bytes(NTOK));
  double ek = rel_err(p, 2, 0, NTOK), ev = rel_err(p, 2, 1, NTOK);
  /* stream mode: blocks fill across decode steps and are encoded at seal */
  ck_ok(kvp_seq_add(p, 1, NULL));
  append_step(p, 1, 0, 100);
  for (uint32_t t = 100; t < NTOK; t++) append_step(p, 1, t, 1);
  ck_ok(kvp_reclaim(p));
  ck_ok(kvp_stats_breakdown(p, KVP_DIM_SEQ, 1, &u));
  ck_assert_uint_eq(u.requested_bytes, L * H * want_bytes(NTOK)); /* 256 = 8 sealed blocks */
  double sk = rel_err(p, 1, 0, NTOK), sv = rel_err(p, 1, 1, NTOK);
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  printf("kvquant nuq3 1%% through the pool: rel. error K %.4f V %.4f (step), K %.4f V %.4f (stream); "
         "bf16 %llu / requested %llu = %.2fx; calibration %llu bytes\n", ek, ev, sk, sv,
         (unsigned long long)s.bf16_equivalent_bytes.current, (unsigned long long)s.bytes_requested.current,
         (double)s.bf16_equivalent_bytes.current / (double)s.bytes_requested.current,
         (unsigned long long)s.codec_static_bytes);
  /* 8 levels on Gaussian-like data: Lloyd-Max's optimum is 0.186 */
  ck_assert(ek < 0.19 && ev < 0.19 && sk < 0.19 && sv < 0.19);
  ck_assert_double_eq(ek, sk); /* the same codes whichever way the blocks were cut */
  uint64_t cal = (uint64_t)2 * L * 2 * H * D * sizeof(float);
  ck_assert_uint_ge(s.codec_static_bytes, cal);
  ck_assert_uint_lt(s.codec_static_bytes, cal * 3 / 2 + 2 * L * 1024); /* offsets, ranges, their inverses */
  char json[1 << 15];
  size_t len;
  ck_ok(kvp_stats_write(p, KVP_STATS_JSON, json, sizeof json, &len));
  ck_assert_ptr_nonnull(strstr(json, "\"bytes.codec_static\":"));
  ck_ok(kvp_seq_free(p, 1));
  ck_ok(kvp_seq_free(p, 2));
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(bad_files_refuse_the_pool) {
  char spec[160], other[64];
  snprintf(other, sizeof other, "/tmp/kvq_otherXXXXXX");
  int fd = mkstemp(other);
  ck_assert_int_ge(fd, 0);
  close(fd);
  const struct {
    uint32_t Lc, bits;
    const char *extra, *field;
  } bad[] = {{L + 1, 3, "", "n_layers"}, {L, 4, "", "bits"}, {L, 3, ":bits=2", "bits"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    write_calib(other, bad[i].Lc, bad[i].bits);
    snprintf(spec, sizeof spec, "kv=kvquant:calib=%s%s", other, bad[i].extra);
    kvp_pool *p;
    ck_status(mkpool(spec, 0, &p), KVP_EFORMAT);
    ck_assert_ptr_null(p);
    ck_assert_msg(strstr(kvp_last_error(), bad[i].field) && strstr(kvp_last_error(), other), "%s", kvp_last_error());
  }
  /* truncated */
  write_calib(other, L, 3);
  ck_assert_int_eq(truncate(other, 1000), 0);
  snprintf(spec, sizeof spec, "k=kvquant:calib=%s", other);
  kvp_pool *p;
  ck_status(mkpool(spec, 0, &p), KVP_EFORMAT);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "truncated"));
  unlink(other);
  ck_status(mkpool(spec, 0, &p), KVP_EFORMAT);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "cannot open"));
  ck_status(mkpool("kv=kvquant:bits=5", 0, &p), KVP_EINVAL);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "bits"));
  uint32_t id;
  ck_ok(kvp_codec_find("kvquant", &id));
  ck_assert_uint_eq(id, 7); /* built-in ids are stable */
  /* the default needs no file */
  ck_ok(mkpool("kv=kvquant", 0, &p));
  kvp_pool_destroy(p);
}
END_TEST

/* Keys appended before RoPE come back rotated: against a direct RoPE (in
 * double) of the original keys, each token's error is the error of the
 * unrotated pool (a rotation keeps norms; the codes are the same); the sink
 * token comes back as the rotation of the input. With V under another codec
 * (m) the layer keeps its OPEN block RAW, and kvquant presents those rows
 * rotated too. */
START_TEST(prerope_reads_rotated) {
  char pr[200], np[200], mx[200];
  snprintf(pr, sizeof pr, "kv=kvquant:calib=%s;layers=0-1:k=kvquant:calib=%s:prerope=1:theta=10000", calib_path,
           calib_path);
  snprintf(np, sizeof np, "kv=kvquant:calib=%s", calib_path);
  snprintf(mx, sizeof mx, "k=kvquant:calib=%s:prerope=1:theta=10000,v=bf16", calib_path);
  kvp_pool *pools[3];
  ck_ok(mkpool(pr, 0, &pools[0]));
  ck_ok(mkpool(np, 0, &pools[1]));
  ck_ok(mkpool(mx, 0, &pools[2]));
  gen(8);
  for (int i = 0; i < 3; i++) {
    ck_ok(kvp_seq_add(pools[i], 1, NULL)); /* stream: 200 tokens = 6 sealed blocks + 8 in the OPEN one */
    append_step(pools[i], 1, 0, 150);
    append_step(pools[i], 1, 150, 50);
  }
  static float a[NTOK * D], b[NTOK * D], m[NTOK * D];
  uint32_t pos[NTOK];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req ra = {sizeof ra, h, KVP_DTYPE_F32, a, NULL, pos, NTOK, 0, NULL};
      kvp_read_req rb = {sizeof rb, h, KVP_DTYPE_F32, b, NULL, NULL, NTOK, 0, NULL};
      kvp_read_req rm = {sizeof rm, h, KVP_DTYPE_F32, m, NULL, NULL, NTOK, 0, NULL};
      ck_ok(kvp_read(pools[0], 1, l, &ra));
      ck_ok(kvp_read(pools[1], 1, l, &rb));
      ck_ok(kvp_read(pools[2], 1, l, &rm));
      ck_assert_uint_eq(ra.n_tokens, 200);
      ck_assert_uint_eq(rm.n_tokens, 200);
      for (uint32_t t = 0; t < 200; t++) {
        ck_assert_uint_eq(pos[t], t);
        double x[D], e_rot = 0, e_raw = 0, e_mix = 0;
        for (uint32_t d = 0; d < D; d++) x[d] = bf16f(K[(((size_t)t * L + l) * H + h) * D + d]);
        for (uint32_t d = 0; d < D; d++) e_raw += (b[t * D + d] - x[d]) * (b[t * D + d] - x[d]);
        rope(x, t, 10000.0);
        for (uint32_t d = 0; d < D; d++) {
          e_rot += (a[t * D + d] - x[d]) * (a[t * D + d] - x[d]);
          e_mix += (m[t * D + d] - x[d]) * (m[t * D + d] - x[d]);
        }
        if (t == 0) ck_assert_msg(sqrt(e_rot) <= 1e-5 * D, "sink l %u h %u: %g", l, h, sqrt(e_rot));
        else
          ck_assert_msg(fabs(sqrt(e_rot) - sqrt(e_raw)) <= 1e-4 * (1 + sqrt(e_raw)), "l %u h %u t %u: %g vs %g", l, h,
                        t, sqrt(e_rot), sqrt(e_raw));
        if (t == 0 || t >= 192) /* mixed: sink and the RAW OPEN rows are the rotation of the input */
          ck_assert_msg(sqrt(e_mix) <= 1e-5 * D, "mixed l %u h %u t %u: %g", l, h, t, sqrt(e_mix));
        else
          ck_assert_msg(fabs(sqrt(e_mix) - sqrt(e_rot)) <= 1e-6 * (1 + sqrt(e_rot)), "mixed l %u h %u t %u", l, h, t);
      }
    }
  for (int i = 0; i < 3; i++) kvp_pool_destroy(pools[i]);
}
END_TEST

/* ---- a growing OPEN block ------------------------------------------------- */

enum { GBT = 64 };

static int mkpool_bt(const char *codecs, uint64_t budget, uint32_t bt, kvp_pool **p) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.block_tokens = bt;
  c.region_bytes = 64ull << 20;
  c.budget_bytes = budget;
  c.codecs = codecs;
  *p = NULL;
  return kvp_pool_create(&c, p);
}

static void snap(kvp_pool *p, kvp_stats *s) {
  s->struct_size = sizeof *s;
  ck_ok(kvp_stats_get(p, s));
}

/* The OUTLIERS page of head 0's K in the last block of (seq, layer 0). */
static uint64_t outliers_bytes(kvp_pool *p, uint64_t seq, const void **addr) {
  kvp_view *v;
  ck_ok(kvp_view_acquire(p, seq, 0, &v));
  const kvp_view_block *last = NULL;
  for (uint32_t i = 0; i < v->n_blocks; i++)
    if (v->blocks[i].head == 0) last = &v->blocks[i];
  ck_assert_ptr_nonnull(last);
  uint64_t b = last->page_bytes[0][KVP_PAGE_OUTLIERS];
  if (addr) *addr = last->page[0][KVP_PAGE_OUTLIERS];
  kvp_view_release(p, v);
  return b;
}

/* One token at a time: the OPEN block's OUTLIERS page holds exactly the rows
 * appended (k = 7 at 5%: 7 x 3 bytes a row), moves up through size classes
 * (ops.grow_moves), kvp_check passes after every append; a fork copies the
 * OPEN block as it is; reads equal the step-mode encoding of the same
 * tokens. */
START_TEST(open_block_grows) {
  const char *spec = "kv=kvquant:outliers=0.05";
  kvp_pool *p;
  ck_ok(mkpool_bt(spec, 0, GBT, &p));
  gen(9);
  ck_ok(kvp_seq_add(p, 1, NULL));
  uint64_t moves0 = 0, grows0 = 0, nmoves = 0;
  const void *prev_addr = NULL;
  for (uint32_t t = 0; t < 2 * GBT + 5; t++) {
    append_step(p, 1, t, 1);
    kvp_stats s;
    snap(p, &s);
    if (t == 0) moves0 = s.grow_moves, grows0 = s.grows;
    const void *addr;
    uint64_t ob = outliers_bytes(p, 1, &addr);
    ck_assert_uint_eq(ob, (uint64_t)(t % GBT + 1) * 7 * 3);
    if (t % GBT && addr != prev_addr) nmoves++;
    prev_addr = addr;
    if (t == GBT + 10) { /* a fork copies the OPEN block at its current size */
      ck_ok(kvp_seq_fork(p, 1, 2));
      ck_ok(kvp_check(p));
      ck_assert_uint_eq(outliers_bytes(p, 2, NULL), ob);
      ck_ok(kvp_seq_free(p, 2));
      ck_ok(kvp_check(p));
    }
  }
  kvp_stats s;
  snap(p, &s);
  printf("OPEN block of %u tokens, 1 token a step: OUTLIERS page moved %llu times (ops.grow_moves %llu)\n", GBT,
         (unsigned long long)nmoves, (unsigned long long)(s.grow_moves - moves0));
  ck_assert_uint_ge(nmoves, 4); /* 21 B .. 1344 B crosses many classes */
  ck_assert_uint_ge(s.grow_moves - moves0, nmoves);
  /* a move is a grow; a page of a replaced block that kept its size is
   * neither */
  ck_assert_uint_le(s.grow_moves - moves0, s.grows - grows0);
  /* step mode, the same tokens in one step: the same values */
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  ck_ok(kvp_seq_add(p, 3, &sc));
  append_step(p, 3, 0, 2 * GBT + 5);
  static float a[NTOK * D], b[NTOK * D];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req ra = {sizeof ra, h, KVP_DTYPE_F32, a, NULL, NULL, NTOK, 0, NULL};
      kvp_read_req rb = {sizeof rb, h, KVP_DTYPE_F32, b, NULL, NULL, NTOK, 0, NULL};
      ck_ok(kvp_read(p, 1, l, &ra));
      ck_ok(kvp_read(p, 3, l, &rb));
      ck_assert_uint_eq(ra.n_tokens, 2 * GBT + 5);
      ck_assert_mem_eq(a, b, (size_t)ra.n_tokens * D * sizeof(float));
    }
  kvp_pool_destroy(p);
}
END_TEST

/* The budget stops a growth cleanly: a run without a budget finds a token
 * whose append moves the OPEN block (allocated bytes rise inside a block);
 * a pool with a budget just above the bytes before it refuses that append
 * with KVP_EBUDGET and changes nothing; once room is made, the same layer
 * is appended again and the reads equal the unbudgeted run's. */
START_TEST(budget_stops_growth) {
  const char *spec = "kv=kvquant:outliers=0.05";
  enum { N = 2 * GBT };
  static uint64_t before[N], peak[N];
  kvp_pool *p;
  ck_ok(mkpool_bt(spec, 0, GBT, &p));
  gen(10);
  ck_ok(kvp_seq_add(p, 1, NULL));
  uint32_t hit = 0;
  for (uint32_t t = 0; t < N; t++) {
    kvp_stats s;
    snap(p, &s);
    before[t] = s.bytes_allocated.current;
    append_step(p, 1, t, 1);
    snap(p, &s);
    peak[t] = s.bytes_allocated.current; /* both copies of a moved block, every layer */
    ck_ok(kvp_reclaim(p));
  }
  /* the move that needs the most for layer 0 alone ((peak - before) / L:
   * layers alike); every earlier step needs less */
  uint64_t best = 0;
  for (uint32_t t = GBT + 8; t < N; t++)
    if (before[t] + (peak[t] - before[t]) / L > best && peak[t] - before[t] > 4096) {
      best = before[t] + (peak[t] - before[t]) / L;
      hit = t;
    }
  for (uint32_t t = 0; t < hit; t++) ck_assert_uint_lt(before[t] + (peak[t] - before[t]) / L, best);
  ck_assert_uint_gt(hit, 0);
  kvp_pool_destroy(p);
  /* the same appends under a budget: sequence 9 holds 1 block as ballast */
  kvp_pool *q;
  ck_ok(mkpool_bt(spec, 0, GBT, &q));
  ck_ok(kvp_seq_add(q, 9, NULL));
  append_step(q, 9, 0, GBT);
  kvp_stats s9;
  snap(q, &s9);
  kvp_pool_destroy(q);
  ck_ok(mkpool_bt(spec, best - 64 + s9.bytes_allocated.current, GBT, &q));
  ck_ok(kvp_seq_add(q, 9, NULL));
  append_step(q, 9, 0, GBT);
  ck_ok(kvp_seq_add(q, 1, NULL));
  for (uint32_t t = 0; t < hit; t++) {
    append_step(q, 1, t, 1);
    ck_ok(kvp_reclaim(q));
  }
  kvp_stats b0, b1;
  snap(q, &b0);
  ck_ok(kvp_step_begin(q, 1, 1, 0));
  static uint16_t k1[H * D], v1[H * D];
  memcpy(k1, K + (size_t)hit * L * H * D, H * D * 2);
  memcpy(v1, V + (size_t)hit * L * H * D, H * D * 2);
  kvp_kv kv = {k1, v1, NULL};
  ck_status(kvp_append(q, 1, 0, &kv), KVP_EBUDGET);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "budget"));
  ck_ok(kvp_check(q));
  snap(q, &b1);
  ck_assert_uint_eq(b1.bytes_requested.current, b0.bytes_requested.current);
  ck_assert_uint_eq(b1.bytes_allocated.current, b0.bytes_allocated.current);
  ck_assert_uint_eq(b1.pages.current, b0.pages.current);
  ck_assert_uint_eq(b1.tokens_retained.current, b0.tokens_retained.current);
  printf("growth at token %u refused by the budget (%llu of %llu allocated), nothing changed\n", hit,
         (unsigned long long)b1.bytes_allocated.current, (unsigned long long)b1.budget_bytes);
  /* room made: the same layer again */
  ck_ok(kvp_seq_free(q, 9));
  ck_ok(kvp_append(q, 1, 0, &kv));
  ck_ok(kvp_check(q));
  for (uint32_t l = 1; l < L; l++) {
    memcpy(k1, K + ((size_t)hit * L + l) * H * D, H * D * 2);
    memcpy(v1, V + ((size_t)hit * L + l) * H * D, H * D * 2);
    ck_ok(kvp_append(q, 1, l, &kv));
  }
  ck_ok(kvp_step_end(q, 1));
  for (uint32_t t = hit + 1; t < N; t++) append_step(q, 1, t, 1);
  ck_assert(rel_err(q, 1, 0, N) < 0.19 && rel_err(q, 1, 1, N) < 0.19); /* every token there, the sink exact */
  ck_ok(kvp_check(q));
  kvp_pool_destroy(q);
}
END_TEST

/* Threshold mode: outliers are the values outside the calibrated range, so
 * how much an OPEN block's OUTLIERS page grows depends on the data. A calm
 * token (no outlier) appends with the budget exhausted (its rows are
 * already paid for); a spiked one (every value far out) must grow the page
 * and is refused with nothing changed; with room it goes in. */
START_TEST(threshold_growth_budget) {
  char spec[200];
  snprintf(spec, sizeof spec, "kv=kvquant:calib=%s:outlier_mode=threshold", calib_path);
  kvp_pool *p;
  ck_ok(mkpool_bt(spec, 8u << 20, GBT, &p));
  gen(11);
  ck_ok(kvp_seq_add(p, 1, NULL));
  uint64_t prev = 0;
  uint32_t grew_more = 0, grew_none = 0;
  for (uint32_t t = 0; t < 40; t++) {
    append_step(p, 1, t, 1);
    uint64_t ob = outliers_bytes(p, 1, NULL);
    ck_assert_uint_eq((ob - 4 * (GBT + 1)) % 3, 0); /* row starts, then 3-byte entries */
    if (t > 1) grew_none += ob == prev, grew_more += ob > prev + 3;
    prev = ob;
  }
  ck_assert_msg(grew_none > 0 && grew_more > 0, "k does not vary: %u %u", grew_none, grew_more);
  ck_ok(kvp_reclaim(p));
  /* ballast raw pages until less than the smallest class is left */
  kvp_page_tag tag = {77, 0, 0, KVP_PAGE_META, 0, 0};
  kvp_page_id ballast[64];
  uint32_t nb = 0;
  for (uint64_t sz = 4u << 20; sz >= 64 && nb < 64;) {
    if (kvp_page_alloc(p, sz, &tag, &ballast[nb]) == KVP_OK) nb++;
    else sz /= 2;
  }
  kvp_stats b0, b1;
  snap(p, &b0);
  ck_assert_uint_lt(b0.budget_bytes - b0.bytes_allocated.current, 64);
  static uint16_t k1[H * D], v1[H * D];
  /* calm: every value at its channel's centre */
  ck_ok(kvp_step_begin(p, 1, 1, 0));
  for (uint32_t l = 0; l < L; l++) {
    for (uint32_t h = 0; h < H; h++)
      for (uint32_t d = 0; d < D; d++) {
        k1[h * D + d] = f2bf((float)(0.5 * sin(d * 0.37 + h * 1.3 + l)));
        v1[h * D + d] = f2bf(0.0f);
      }
    kvp_kv kv = {k1, v1, NULL};
    ck_ok(kvp_append(p, 1, l, &kv));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_step_end(p, 1));
  ck_assert_uint_eq(outliers_bytes(p, 1, NULL), prev); /* no outlier: no growth */
  snap(p, &b0);
  /* spiked: every value 50 scales out */
  ck_ok(kvp_step_begin(p, 1, 1, 0));
  for (uint32_t h = 0; h < H; h++)
    for (uint32_t d = 0; d < D; d++) k1[h * D + d] = v1[h * D + d] = f2bf(d % 2 ? 400.0f : -400.0f);
  kvp_kv kv = {k1, v1, NULL};
  ck_status(kvp_append(p, 1, 0, &kv), KVP_EBUDGET);
  ck_ok(kvp_check(p));
  snap(p, &b1);
  ck_assert_uint_eq(b1.bytes_requested.current, b0.bytes_requested.current);
  ck_assert_uint_eq(b1.bytes_allocated.current, b0.bytes_allocated.current);
  ck_assert_uint_eq(b1.pages.current, b0.pages.current);
  ck_assert_uint_eq(outliers_bytes(p, 1, NULL), prev);
  for (uint32_t i = 0; i < nb; i++) ck_ok(kvp_page_free(p, ballast[i]));
  for (uint32_t l = 0; l < L; l++) {
    ck_ok(kvp_append(p, 1, l, &kv));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_step_end(p, 1));
  uint64_t grown = outliers_bytes(p, 1, NULL);
  printf("threshold mode: a spiked token grew the OPEN block's OUTLIERS page %llu -> %llu bytes (%llu outliers)\n",
         (unsigned long long)prev, (unsigned long long)grown, (unsigned long long)(grown - prev) / 3);
  ck_assert_uint_eq(grown - prev, (D / 2) * 3); /* capped at D / 2 outliers */
  static float out[NTOK * D];
  kvp_read_req rq = {sizeof rq, 0, KVP_DTYPE_F32, out, NULL, NULL, NTOK, 0, NULL};
  ck_ok(kvp_read(p, 1, 0, &rq));
  ck_assert_uint_eq(rq.n_tokens, 42);
  uint32_t close = 0; /* the outliers come back within fp16's half step at 256..512 of the residual */
  for (uint32_t d = 0; d < D; d++) close += fabsf(out[41 * D + d] - (d % 2 ? 400.0f : -400.0f)) <= 0.125f;
  ck_assert_uint_ge(close, D / 2);
  kvp_pool_destroy(p);
}
END_TEST

/* Readers beside a growing OPEN block: a thread reads every head of layer
 * 0 while the writer appends one token at a time (pages grow in place or
 * move); every row it gets equals, bit for bit, the row a finished
 * reference pool returns for that position. */
enum { RN = 160 };
static float ref_k[H][RN * D], ref_v[H][RN * D];
static atomic_int stop_reader;
static atomic_long reads_done;

static void *reader(void *arg) {
  kvp_pool *p = arg;
  static float k[RN * D], v[RN * D];
  uint32_t pos[RN];
  while (!atomic_load(&stop_reader)) {
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, k, v, pos, RN, 0, NULL};
      int rc = kvp_read(p, 1, 0, &q);
      if (rc == KVP_ENOENT) continue;
      ck_assert_int_eq(rc, KVP_OK);
      for (uint32_t t = 0; t < q.n_tokens; t++) {
        ck_assert_uint_eq(pos[t], t);
        ck_assert_msg(!memcmp(k + t * D, ref_k[h] + t * D, D * 4) && !memcmp(v + t * D, ref_v[h] + t * D, D * 4),
                      "head %u token %u differs from the reference", h, t);
      }
      atomic_fetch_add(&reads_done, 1);
    }
  }
  return NULL;
}

START_TEST(readers_beside_growth) {
  const char *spec = "kv=kvquant:outliers=0.05";
  kvp_pool *r, *p;
  ck_ok(mkpool_bt(spec, 0, GBT, &r));
  ck_ok(mkpool_bt(spec, 0, GBT, &p));
  gen(12);
  ck_ok(kvp_seq_add(r, 1, NULL));
  append_step(r, 1, 0, RN);
  for (uint32_t h = 0; h < H; h++) {
    kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, ref_k[h], ref_v[h], NULL, RN, 0, NULL};
    ck_ok(kvp_read(r, 1, 0, &q));
    ck_assert_uint_eq(q.n_tokens, RN);
  }
  kvp_pool_destroy(r);
  atomic_store(&stop_reader, 0);
  ck_ok(kvp_seq_add(p, 1, NULL));
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, reader, p), 0);
  for (uint32_t t = 0; t < RN; t++) append_step(p, 1, t, 1); /* kvp_check after each layer */
  atomic_store(&stop_reader, 1);
  ck_assert_int_eq(pthread_join(th, NULL), 0);
  printf("readers beside growth: %ld reads while %u tokens were appended one by one\n", atomic_load(&reads_done), RN);
  ck_assert_int_gt(atomic_load(&reads_done), 0);
  kvp_pool_destroy(p);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("kvquant_pool");
  TCase *tc = tcase_create("pool");
  tcase_add_checked_fixture(tc, setup, teardown);
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, bytes_and_error);
  tcase_add_test(tc, bad_files_refuse_the_pool);
  tcase_add_test(tc, prerope_reads_rotated);
  tcase_add_test(tc, open_block_grows);
  tcase_add_test(tc, budget_stops_growth);
  tcase_add_test(tc, threshold_growth_budget);
  tcase_add_test(tc, readers_beside_growth);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return it_run(suite()); }
