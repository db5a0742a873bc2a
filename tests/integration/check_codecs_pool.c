/*
 * tests/integration/check_codecs_pool.c - the built-in codecs through the
 * pool (public header only): spec strings bind them per layer and K/V;
 * appends in stream mode (encoded when a block seals) and step mode
 * (encoded at once) read back within each format's error; kvp_check after
 * every step verifies pages against layouts and the ledger; the bytes saved
 * against bf16 are what DESIGN.md section 7 says.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool_codec.h"
#include "itest.h"


enum { L = 3, H = 2, D = 128, BT = 32, NTOK = 256 };

static const struct {
  const char *spec;     /* codecs */
  double max_rel_err;   /* ||read - input|| / ||input|| over a sequence */
  double min_saving;    /* bf16-equivalent / allocated, all blocks sealed */
} cases[] = {
    {"kv=bf16", 0.0, 1.0},
    {"kv=fp8", 0.05, 1.9},
    {"kv=fp8:scale=0.05", 0.08, 1.95},
    {"kv=int8", 0.02, 1.9}, /* outlier channels: step 8.5/127 on a unit-scale token */
    {"kv=int8:pct=99.5", 0.05, 1.9}, /* clips the outlier channels (1 in 17): larger error here */
    {"kv=kivi:bits=4:group=32", 0.08, 3.0},
    {"kv=kivi:bits=2:group=32:residual=128", 0.45, 5.0},
    {"kv=nvfp4", 0.15, 3.3},
    {"k=nvfp4:rule=4/6:ksmooth=store,v=nvfp4:rule=4/6", 0.15, 3.2},
    {"k=bf16,v=int8;layers=1-2:k=fp8", 0.05, 1.3},
};

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

/* KV-like data: a per-channel offset (keys have outlier channels), noise. */
static void gen(uint16_t *x, uint32_t n, uint64_t seed, int kv) {
  for (uint32_t t = 0; t < n; t++)
    for (uint32_t h = 0; h < H; h++)
      for (uint32_t d = 0; d < D; d++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        double u = (double)(seed >> 11) / 9007199254740992.0 - 0.5;
        double ch = kv ? 0 : (d % 17 == 0 ? 8.0 : 0.5) * sin(d * 0.7 + h);
        x[((size_t)t * H + h) * D + d] = f2bf((float)(ch + 2.0 * u));
      }
}

static uint16_t K[NTOK * H * D], V[NTOK * H * D];

static kvp_pool *mkpool(const char *spec) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.block_tokens = BT;
  c.region_bytes = 64ull << 20;
  c.codecs = spec;
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  return p;
}

static double rel_err(kvp_pool *p, uint64_t seq, uint32_t n) {
  static float out[NTOK * D];
  double num = 0, den = 0;
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++)
      for (int kv = 0; kv < 2; kv++) {
        kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, kv ? NULL : out, kv ? out : NULL, NULL, NTOK, 0, NULL};
        ck_ok(kvp_read(p, seq, l, &q));
        ck_assert_uint_eq(q.n_tokens, n);
        const uint16_t *src = kv ? V : K;
        for (uint32_t t = 0; t < n; t++)
          for (uint32_t d = 0; d < D; d++) {
            double want = bf16f(src[((size_t)t * H + h) * D + d]), got = out[t * D + d];
            ck_assert_msg(isfinite(got), "non-finite read");
            num += (got - want) * (got - want);
            den += want * want;
          }
      }
  return sqrt(num / den);
}

static void append_all(kvp_pool *p, uint64_t seq, uint32_t pos, uint32_t n) {
  ck_ok(kvp_step_begin(p, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    /* same data on every layer: the buffers hold every position */
    kvp_kv kv = {K + (size_t)pos * H * D, V + (size_t)pos * H * D, NULL};
    ck_ok(kvp_append(p, seq, l, &kv));
  }
  ck_ok(kvp_step_end(p, seq));
  ck_ok(kvp_check(p));
}

START_TEST(codec_through_pool) {
  kvp_pool *p = mkpool(cases[_i].spec);
  gen(K, NTOK, 11, 0);
  gen(V, NTOK, 12, 1);
  /* stream mode: a prefill, then decode steps that seal blocks one by one */
  ck_ok(kvp_seq_add(p, 1, NULL));
  append_all(p, 1, 0, 200);
  for (uint32_t t = 200; t < NTOK; t++) append_all(p, 1, t, 1);
  double e_stream = rel_err(p, 1, NTOK);
  /* step mode: steps of 100, 100, 56 tokens, blocks encoded at once */
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  ck_ok(kvp_seq_add(p, 2, &sc));
  append_all(p, 2, 0, 100);
  append_all(p, 2, 100, 100);
  append_all(p, 2, 200, 56);
  double e_step = rel_err(p, 2, NTOK);
  ck_ok(kvp_reclaim(p));
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  double saving = (double)s.bf16_equivalent_bytes.current / (double)s.bytes_allocated.current;
  printf("%-48s rel. error %.4f (stream) %.4f (step); bf16 %llu / allocated %llu = %.2fx\n", cases[_i].spec, e_stream,
         e_step, (unsigned long long)s.bf16_equivalent_bytes.current, (unsigned long long)s.bytes_allocated.current,
         saving);
  ck_assert_msg(e_stream <= cases[_i].max_rel_err && e_step <= cases[_i].max_rel_err, "error %g / %g above %g",
                e_stream, e_step, cases[_i].max_rel_err);
  ck_assert_msg(saving >= cases[_i].min_saving, "saving %.3f below %.3f", saving, cases[_i].min_saving);
  /* the pages of every codec in use are counted under it */
  uint64_t by_codec = 0;
  for (uint32_t id = 0; id < 64; id++) {
    kvp_usage u;
    if (kvp_stats_breakdown(p, KVP_DIM_CODEC, id, &u) == KVP_OK) by_codec += u.allocated_bytes;
  }
  ck_assert_uint_eq(by_codec, s.bytes_allocated.current);
  ck_ok(kvp_seq_free(p, 1));
  ck_ok(kvp_seq_free(p, 2));
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(specs_refused_with_reasons) {
  static const struct {
    const char *spec;
    const char *why;
  } bad[] = {
      {"kv=kivi:bits=3", "bits"},
      {"kv=kivi:group=64", "block_tokens = 32 is not a multiple of kivi's group of 64"},
      {"k=nvfp4:rule=5", "rule"},
      {"v=int8:pct=0", "pct"},
      {"k=fp8:scale=-1", "scale"},
      {"k=fp8:colour=red", "colour"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    kvp_config c;
    kvp_config_init(&c);
    c.n_layers = L;
    c.n_kv_heads = H;
    c.head_dim = D;
    c.block_tokens = BT;
    c.codecs = bad[i].spec;
    kvp_pool *p = (kvp_pool *)1;
    ck_assert_int_eq(kvp_pool_create(&c, &p), KVP_EINVAL);
    ck_assert_ptr_null(p);
    ck_assert_msg(strstr(kvp_last_error(), bad[i].why) != NULL, "%s: %s", bad[i].spec, kvp_last_error());
  }
  uint32_t id;
  ck_ok(kvp_codec_find("nvfp4", &id));
  ck_assert_uint_eq(id, 4); /* built-in ids are stable */
}
END_TEST

int main(void) {
  Suite *s = suite_create("codecs_pool");
  TCase *tc = tcase_create("codecs_pool");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, codec_through_pool, 0, (int)(sizeof cases / sizeof cases[0]));
  tcase_add_test(tc, specs_refused_with_reasons);
  suite_add_tcase(s, tc);
  return it_run(s);
}
