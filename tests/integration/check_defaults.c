/*
 * tests/integration/check_defaults.c - pools that work with the default
 * configuration, public headers only: the block size chosen per layer by
 * its codecs (block_tokens = 0), kvp_pool_info, explicit sizes that
 * conflict with a codec, the refusal of codecs that would store more than
 * the appended dtype, and codec plug-ins of ABI version 1 and 2.
 *
 * Compression is checked to the byte against the codec tables of
 * DESIGN.md section 7 (bytes per token and head, one side, D = 128):
 *   kivi b2 G32     D*b/8 + 4D/G                   = 32 + 16 = 48 (5.33x)
 *   qvg (s1 g64 b2) D*b/8 + D/g + s + s*K*2D/N     = 32 + 2 + 1 + 65536/N
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "itest.h"
#include "kvgen.h"
#include "kvpool_codec.h"

enum { D = 128 };

static kvp_pool *mk(uint32_t L, uint32_t H, const char *codecs, uint32_t block_tokens, uint32_t flags) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D;
  c.region_bytes = 256ull << 20;
  c.codecs = codecs, c.block_tokens = block_tokens, c.flags = flags;
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  return p;
}

static int create_rc(uint32_t L, const char *codecs, uint32_t block_tokens, uint32_t flags) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = 2, c.head_dim = D;
  c.codecs = codecs, c.block_tokens = block_tokens, c.flags = flags;
  kvp_pool *p = (kvp_pool *)&c; /* must be reset to NULL on failure */
  int rc = kvp_pool_create(&c, &p);
  if (rc) ck_assert_ptr_null(p);
  kvp_pool_destroy(p);
  return rc;
}

static kvp_layer_info info(kvp_pool *p, uint32_t layer) {
  kvp_layer_info in;
  kvp_layer_info_init(&in);
  ck_ok(kvp_pool_info(p, layer, &in));
  return in;
}

/* One step of n tokens at pos for seq, every layer, kvp_check after each. */
static void step(kvp_pool *p, const kvgen *g, uint64_t seq, uint32_t L, uint32_t H, uint32_t pos, uint32_t n) {
  uint16_t *k = malloc((size_t)n * H * D * 2), *v = malloc((size_t)n * H * D * 2);
  ck_assert(k && v);
  ck_ok(kvp_step_begin(p, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    kvgen_fill(g, seq, l, pos, n, H, D, k, v);
    kvp_kv kv = {k, v, NULL};
    ck_ok(kvp_append(p, seq, l, &kv));
    ck_ok(kvp_check(p));
  }
  ck_ok(kvp_step_end(p, seq));
  ck_ok(kvp_check(p));
  free(k);
  free(v);
}

static kvp_stats stats(kvp_pool *p) {
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  return s;
}

/* Issue case 1: kv=kivi:bits=2:group=32 with the default config. */
START_TEST(kivi_group32_default) {
  enum { L = 2, H = 2, N = 1024 };
  kvp_pool *p = mk(L, H, "kv=kivi:bits=2:group=32", 0, 0);
  for (uint32_t l = 0; l < L; l++) {
    kvp_layer_info in = info(p, l);
    for (int kv = 0; kv < 2; kv++) {
      ck_assert_str_eq(in.codec[kv], "kivi");
      ck_assert_uint_eq(in.block_tokens[kv], 32);
      ck_assert_uint_eq(in.step_block_tokens[kv], 32);
      ck_assert_double_eq(in.bytes_per_token[kv], 48.0);
      ck_assert_double_eq(in.source_bytes_per_token[kv], 256.0);
    }
    ck_assert_uint_eq(in.group_tokens[0], 32);
    ck_assert_uint_eq(in.group_tokens[1], 1);
  }
  kvgen g;
  kvgen_init(&g);
  ck_ok(kvp_seq_add(p, 1, NULL)); /* stream mode: a prefill chunk, then decode tokens that seal blocks */
  step(p, &g, 1, L, H, 0, N - 32);
  for (uint32_t t = 0; t < 32; t++) step(p, &g, 1, L, H, N - 32 + t, 1);
  ck_ok(kvp_reclaim(p)); /* the raw OPEN blocks the last token sealed */
  kvp_stats s = stats(p);
  /* every block sealed and encoded: 48 B per token, head and side */
  ck_assert_uint_eq(s.bytes_requested.current, (uint64_t)L * H * N * 48 * 2);
  ck_assert_uint_eq(s.bf16_equivalent_bytes.current, (uint64_t)L * H * N * 256 * 2);
  ck_assert_uint_eq(s.bytes_allocated.current, s.bytes_requested.current); /* powers of two: no rounding */
  kvp_pool_destroy(p);
}
END_TEST

/* An explicit size that conflicts with a codec fails naming both values
 * and the size that would work; nothing is left behind. */
START_TEST(explicit_conflict) {
  ck_status(create_rc(2, "kv=kivi:bits=2:group=32", 16, 0), KVP_EINVAL);
  const char *m = kvp_last_error();
  ck_assert_msg(strstr(m, "block_tokens = 16") && strstr(m, "kivi") && strstr(m, "32 tokens") &&
                    strstr(m, "32 would be"), "message: %s", m);
  ck_status(create_rc(2, "layers=1:k=kivi:group=64", 80, 0), KVP_EINVAL);
  m = kvp_last_error();
  ck_assert_msg(strstr(m, "= 80") && strstr(m, "64 tokens") && strstr(m, "layer 1 K") && strstr(m, "128 would be"),
                "message: %s", m);
  ck_ok(create_rc(2, "kv=kivi:bits=2:group=32", 64, 0));
  ck_status(create_rc(1, NULL, 65537, 0), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "65537"), "message: %s", kvp_last_error());
}
END_TEST

/* Issue case 2: kv=qvg with the default config, step mode, a 1024-token
 * step at L = 4, H = 4: one block per (step, head), N = 1024. */
START_TEST(qvg_step_default) {
  enum { L = 4, H = 4, N = 1024 };
  kvp_pool *p = mk(L, H, "kv=qvg", 0, 0);
  kvp_layer_info in = info(p, 3);
  ck_assert_uint_eq(in.step_block_tokens[0], 65536); /* a whole step */
  ck_assert_uint_eq(in.block_tokens[1], 2048);
  ck_assert(in.bytes_per_token[0] < in.source_bytes_per_token[0]);
  kvgen g;
  kvgen_init(&g);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  ck_ok(kvp_seq_add(p, 7, &sc));
  step(p, &g, 7, L, H, 0, N);
  kvp_stats s = stats(p);
  uint64_t per_token = 32 + 2 + 1 + 2 * 256 * D / N; /* 99 B: 2.59x */
  ck_assert_uint_eq(s.bytes_requested.current, (uint64_t)L * H * 2 * N * per_token);
  ck_assert_uint_eq(s.bf16_equivalent_bytes.current, (uint64_t)L * H * 2 * N * 256);
  ck_assert_msg(s.bf16_equivalent_bytes.current > 2 * s.bytes_allocated.current, "qvg stores %llu B for %llu bf16",
                (unsigned long long)s.bytes_allocated.current, (unsigned long long)s.bf16_equivalent_bytes.current);
  kvp_seq_desc d = {.struct_size = sizeof d};
  ck_ok(kvp_seq_info(p, 7, &d));
  ck_assert_uint_eq(d.page_types[KVP_PAGE_CENTROIDS].npages, L * H * 2); /* one block per (layer, head, side) */
  kvp_pool_destroy(p);
}
END_TEST

/* qvg in stream mode: blocks of 2048 tokens (N = 2048: 67 B, 3.82x). */
START_TEST(qvg_stream_default) {
  enum { L = 1, H = 1, N = 2048 };
  kvp_pool *p = mk(L, H, "kv=qvg", 0, 0);
  kvgen g;
  kvgen_init(&g);
  ck_ok(kvp_seq_add(p, 3, NULL));
  step(p, &g, 3, L, H, 0, N);
  kvp_stats s = stats(p);
  ck_assert_uint_eq(s.bytes_requested.current, (uint64_t)2 * N * (32 + 2 + 1 + 2 * 256 * D / N));
  ck_assert_uint_eq(s.page_types[KVP_PAGE_RAW].npages, 0); /* sealed and encoded */
  kvp_pool_destroy(p);
  /* qvg-pro (s4 g16): 8192 tokens; qvg with 16 centroids: 256 */
  p = mk(1, 1, "k=qvg-pro,v=qvg:k=16", 0, 0);
  kvp_layer_info in = info(p, 0);
  ck_assert_uint_eq(in.block_tokens[0], 8192);
  ck_assert_uint_eq(in.block_tokens[1], 8192); /* a block holds both sides */
  kvp_pool_destroy(p);
  p = mk(1, 1, "k=qvg:k=16,v=int8", 0, 0);
  ck_assert_uint_eq(info(p, 0).block_tokens[0], 256);
  kvp_pool_destroy(p);
}
END_TEST

/* Per-token codecs get 16 (vLLM's); mixed layers choose apart. */
START_TEST(per_layer_choice) {
  kvp_pool *p = mk(3, 2, "kv=int8;layers=1:k=kivi:group=64,v=nvfp4;layers=2:kv=qvg", 0, 0);
  ck_assert_uint_eq(info(p, 0).block_tokens[0], 16);
  ck_assert_uint_eq(info(p, 0).step_block_tokens[1], 16);
  ck_assert_uint_eq(info(p, 1).block_tokens[1], 64);
  ck_assert_uint_eq(info(p, 2).block_tokens[0], 2048);
  ck_assert_uint_eq(info(p, 2).step_block_tokens[0], 65536);
  /* appends across layers of different block sizes, in both modes */
  kvgen g;
  kvgen_init(&g);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  ck_ok(kvp_seq_add(p, 1, NULL));
  ck_ok(kvp_seq_add(p, 2, &sc));
  for (uint32_t pos = 0, n = 1; pos < 200; pos += n, n = n * 3 % 97 + 1) {
    step(p, &g, 1, 3, 2, pos, n);
    step(p, &g, 2, 3, 2, pos, n);
  }
  ck_ok(kvp_seq_free(p, 1));
  ck_ok(kvp_seq_free(p, 2));
  ck_ok(kvp_check(p));
  ck_assert_uint_eq(stats(p).bytes_allocated.current, 0);
  kvp_layer_info in;
  kvp_layer_info_init(&in);
  ck_status(kvp_pool_info(p, 3, &in), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "layer 3"), "message: %s", kvp_last_error());
  in.struct_size = 8;
  ck_status(kvp_pool_info(p, 0, &in), KVP_EINVAL);
  ck_status(kvp_pool_info(NULL, 0, &in), KVP_EINVAL);
  kvp_pool_destroy(p);
}
END_TEST

/* No silent expansion: qvg at 16 tokens stores 291 B per token against
 * bf16's 256. The message names the codec, both sizes and where it would
 * compress (35 N + 65536 < 256 N from N = 297); the flag allows it. */
START_TEST(expansion_refused) {
  ck_status(create_rc(2, "kv=qvg", 16, 0), KVP_EINVAL);
  const char *m = kvp_last_error();
  ck_assert_msg(strstr(m, "qvg") && strstr(m, "291.00 bytes per token") && strstr(m, "block_tokens = 16") &&
                    strstr(m, "bf16's 256") && strstr(m, "from block_tokens = 297") &&
                    strstr(m, "KVP_POOL_ALLOW_EXPANSION"), "message: %s", m);
  ck_ok(create_rc(2, "kv=qvg", 16, KVP_POOL_ALLOW_EXPANSION));
  ck_ok(create_rc(2, "kv=qvg", 512, 0));
  /* only the layer that expands is named */
  ck_status(create_rc(4, "kv=int8;layers=2:v=qvg:stages=2", 64, 0), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "layer 2 V"), "message: %s", kvp_last_error());
  /* raw stores the dtype it names: wider is a choice, not an expansion */
  ck_ok(create_rc(1, "kv=fp32", 0, 0));
  /* a created pool at the allowed expansion holds and counts it */
  kvp_pool *p = mk(1, 1, "kv=qvg", 16, KVP_POOL_ALLOW_EXPANSION);
  kvp_layer_info in = info(p, 0);
  ck_assert_double_eq(in.bytes_per_token[0], 291.0);
  ck_assert(in.bytes_per_token[0] > in.source_bytes_per_token[0]);
  kvp_pool_destroy(p);
}
END_TEST

/* ---- plug-ins: ABI version 1 (no block_tokens member) and 2 ------------- */

typedef struct tcodec {
  uint32_t d, group, pref;
} tcodec;
static int tc_create(const char *params, const kvp_codec_geom *g, void **inst, char *err, size_t cap, size_t *at) {
  (void)err, (void)cap, (void)at;
  tcodec *t = calloc(1, sizeof *t);
  t->d = g->head_dim, t->group = 1;
  sscanf(params, "group=%u:pref=%u", &t->group, &t->pref);
  *inst = t;
  return KVP_OK;
}
static void tc_destroy(void *inst) { free(inst); }
static uint32_t tc_group(const void *inst) { return ((const tcodec *)inst)->group; }
static uint32_t tc_pref(const void *inst, kvp_seq_mode mode) { return mode == KVP_SEQ_STEP ? 0 : ((const tcodec *)inst)->pref; }
static void tc_layout(const void *inst, uint32_t cap, kvp_codec_layout *o) {
  o->npages = 1;
  o->types[0] = KVP_PAGE_CODES;
  o->bytes[0] = (uint64_t)cap * ((const tcodec *)inst)->d; /* one byte per element */
}
static int tc_encode(const void *inst, const void *src, size_t stride, uint32_t n, uint32_t cap, void *const *pages) {
  (void)inst, (void)src, (void)stride, (void)n, (void)cap, (void)pages;
  return KVP_OK;
}
static int tc_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap, uint32_t t0, uint32_t m,
                     void *dst, size_t dst_stride, kvp_dtype out) {
  (void)inst, (void)pages, (void)n, (void)cap, (void)t0, (void)m, (void)dst, (void)dst_stride, (void)out;
  return KVP_OK;
}

/* A vtable as a codec built against the ABI 1 header lays it out: it ends
 * at decode_dev. The copy is cut there, with garbage after it in the
 * buffer, which the library must never read. */
static union {
  kvp_codec_vtable vt;
  unsigned char bytes[sizeof(kvp_codec_vtable)];
} v1;

/* KVP_POOL_DEVICE_ASYNC is a CUDA pool's: a host pool takes the flag and
 * still screens its input (a NaN refused, nothing changed); an unknown bit
 * next to it is refused. */
START_TEST(device_async_on_host) {
  kvp_pool *p = mk(1, 2, "kv=fp8", 16, KVP_POOL_DEVICE_ASYNC);
  ck_ok(kvp_seq_add(p, 1, NULL));
  uint16_t k[2 * D], v[2 * D];
  for (int i = 0; i < 2 * D; i++) k[i] = v[i] = 0x3F80; /* bf16 1.0 */
  k[D + 3] = 0x7FC0;                                   /* NaN: head 1 */
  ck_ok(kvp_step_begin(p, 1, 1, 0));
  kvp_kv kv = {k, v, NULL};
  ck_assert_int_eq(kvp_append(p, 1, 0, &kv), KVP_EINVAL);
  k[D + 3] = 0x3F80;
  ck_ok(kvp_append(p, 1, 0, &kv));
  ck_ok(kvp_step_end(p, 1));
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
  ck_assert_int_eq(create_rc(1, NULL, 16, KVP_POOL_DEVICE_ASYNC | 0x100u), KVP_EINVAL);
}
END_TEST

START_TEST(abi_versions) {
  kvp_codec_vtable full = {.abi_version = 1, .name = "test-abi1", .create = tc_create, .destroy = tc_destroy,
                           .group_tokens = tc_group, .layout = tc_layout, .encode = tc_encode, .decode = tc_decode};
  memset(v1.bytes, 0xA5, sizeof v1.bytes);
  memcpy(v1.bytes, &full, offsetof(kvp_codec_vtable, block_tokens));
  uint32_t id;
  ck_ok(kvp_codec_register(&v1.vt, &id));
  kvp_codec_vtable *v2 = calloc(1, sizeof *v2);
  *v2 = full;
  v2->abi_version = KVP_CODEC_ABI_VERSION, v2->name = "test-abi2", v2->block_tokens = tc_pref;
  ck_ok(kvp_codec_register(v2, &id));
  kvp_codec_vtable bad = full;
  bad.name = "test-abi9", bad.abi_version = KVP_CODEC_ABI_VERSION + 1;
  ck_status(kvp_codec_register(&bad, &id), KVP_EINVAL);
  bad.abi_version = 0;
  ck_status(kvp_codec_register(&bad, &id), KVP_EINVAL);

  kvp_pool *p = mk(1, 1, "k=test-abi1:group=8:pref=100,v=bf16", 0, 0); /* v1: its pref is never asked */
  ck_assert_uint_eq(info(p, 0).block_tokens[0], 16);
  kvp_pool_destroy(p);
  p = mk(1, 1, "k=test-abi2:group=8:pref=100,v=bf16", 0, 0); /* 100 up to a multiple of 8 */
  ck_assert_uint_eq(info(p, 0).block_tokens[0], 104);
  ck_assert_uint_eq(info(p, 0).step_block_tokens[0], 16);
  kvp_pool_destroy(p);
  p = mk(1, 1, "k=test-abi2:group=24,v=kivi:group=32", 0, 0); /* K groups 24, V is per token */
  ck_assert_uint_eq(info(p, 0).block_tokens[0], 24);
  kvp_pool_destroy(p);
  p = mk(1, 1, "k=test-abi2:group=24,v=test-abi1:group=32", 0, 0); /* lcm(24, 32) */
  ck_assert_uint_eq(info(p, 0).block_tokens[1], 96);
  kvp_pool_destroy(p);
  ck_status(create_rc(1, "k=test-abi2:group=24,v=test-abi1:group=32", 64, 0), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "96 would be"), "message: %s", kvp_last_error());
  ck_status(create_rc(1, "k=test-abi2:group=40000,v=test-abi1:group=30000", 0, 0), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "multiple of both"), "message: %s", kvp_last_error());
}
END_TEST

int main(void) {
  Suite *s = suite_create("defaults");
  TCase *tc = tcase_create("block sizes");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, kivi_group32_default);
  tcase_add_test(tc, explicit_conflict);
  tcase_add_test(tc, qvg_step_default);
  tcase_add_test(tc, qvg_stream_default);
  tcase_add_test(tc, per_layer_choice);
  tcase_add_test(tc, expansion_refused);
  tcase_add_test(tc, device_async_on_host);
  tcase_add_test(tc, abi_versions);
  suite_add_tcase(s, tc);
  return it_run(s);
}
