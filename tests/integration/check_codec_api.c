/*
 * tests/integration/check_codec_api.c - a user's own codec through the
 * plug-in ABI (kvpool_codec.h), public headers only: registered, bound by a
 * spec string, encoded at append (step mode) and at seal (stream mode, from
 * the RAW tail), decoded by reads, and counted to the byte.
 *
 * The codec "q16": int16 fixed point per token-head with an fp32 scale.
 *   CODES  (cap x D x 2 bytes): int16 little-endian, token-major
 *   SCALES (cap x 4 bytes):     fp32 scale = absmax / 32767 per token
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvgen.h"
#include "kvpool_codec.h"
#include "itest.h"


enum { L = 2, H = 2, D = 32, BT = 16 };

/* ---- the codec ----------------------------------------------------------- */

typedef struct q16 {
  uint32_t d;    /* head dim */
  int calls;     /* unused: decode must not write the instance */
} q16;

static float bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static int q16_create(const char *params, const kvp_codec_geom *g, void **inst, char *err, size_t cap, size_t *at) {
  if (*params) {
    snprintf(err, cap, "q16 takes no parameters, got \"%s\"", params);
    *at = 0;
    return KVP_EINVAL;
  }
  if (g->in_dtype != KVP_DTYPE_BF16) {
    snprintf(err, cap, "q16 needs bf16 input");
    return KVP_EINVAL;
  }
  q16 *q = calloc(1, sizeof *q);
  q->d = g->head_dim;
  *inst = q;
  return KVP_OK;
}
static void q16_destroy(void *inst) { free(inst); }
static uint32_t q16_group(const void *inst) {
  (void)inst;
  return 1;
}
static void q16_layout(const void *inst, uint32_t cap, kvp_codec_layout *o) {
  const q16 *q = inst;
  o->npages = 2;
  o->types[0] = KVP_PAGE_CODES;
  o->bytes[0] = (uint64_t)cap * q->d * 2;
  o->types[1] = KVP_PAGE_SCALES;
  o->bytes[1] = (uint64_t)cap * 4;
}
static int q16_encode(const void *inst, const void *src, size_t stride, uint32_t n, uint32_t cap, void *const *pages) {
  const q16 *q = inst;
  (void)cap;
  int16_t *codes = pages[0];
  float *scales = pages[1];
  for (uint32_t t = 0; t < n; t++) {
    const uint16_t *row = (const uint16_t *)((const char *)src + t * stride);
    float amax = 0;
    for (uint32_t d = 0; d < q->d; d++) amax = fmaxf(amax, fabsf(bf16_to_f32(row[d])));
    float s = amax / 32767.0f;
    scales[t] = s;
    for (uint32_t d = 0; d < q->d; d++) codes[t * q->d + d] = s ? (int16_t)lrintf(bf16_to_f32(row[d]) / s) : 0;
  }
  return KVP_OK;
}
static int q16_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap, uint32_t t0, uint32_t m,
                      void *dst, size_t dst_stride, kvp_dtype out) {
  const q16 *q = inst;
  (void)n, (void)cap;
  if (out != KVP_DTYPE_F32) return KVP_ENOTSUP;
  const int16_t *codes = pages[0];
  const float *scales = pages[1];
  for (uint32_t t = 0; t < m; t++) {
    float *row = (float *)((char *)dst + t * dst_stride);
    for (uint32_t d = 0; d < q->d; d++) row[d] = codes[(t0 + t) * q->d + d] * scales[t0 + t];
  }
  return KVP_OK;
}

static const kvp_codec_vtable Q16 = {.abi_version = KVP_CODEC_ABI_VERSION, .name = "q16", .create = q16_create,
                                     .destroy = q16_destroy, .group_tokens = q16_group, .layout = q16_layout,
                                     .encode = q16_encode, .decode = q16_decode};
static uint32_t Q16_ID;

/* "stamp": a stateful codec. RAW holds the bf16 rows; META (4 bytes) holds
 * the number of blocks the stream encoded before this one, from its state. */
static uint32_t stamp_n(const void *inst) { return (uint32_t)(uintptr_t)inst; }
static int stamp_create(const char *params, const kvp_codec_geom *g, void **inst, char *err, size_t cap, size_t *at) {
  (void)params, (void)err, (void)cap, (void)at;
  *inst = (void *)(uintptr_t)g->head_dim;
  return g->in_dtype == KVP_DTYPE_BF16 ? KVP_OK : KVP_EINVAL;
}
static void stamp_destroy(void *inst) { (void)inst; }
static void stamp_layout(const void *inst, uint32_t cap, kvp_codec_layout *o) {
  o->npages = 2;
  o->types[0] = KVP_PAGE_RAW;
  o->bytes[0] = (uint64_t)cap * stamp_n(inst) * 2;
  o->types[1] = KVP_PAGE_META;
  o->bytes[1] = 4;
}
static int stamp_encode_state(const void *inst, void *state, const void *src, size_t stride, uint32_t n, uint32_t cap,
                              void *const *pages) {
  (void)cap;
  size_t row = stamp_n(inst) * 2;
  for (uint32_t t = 0; t < n; t++) memcpy((char *)pages[0] + t * row, (const char *)src + t * stride, row);
  uint32_t *count = state;
  memcpy(pages[1], count, 4);
  (*count)++;
  return KVP_OK;
}
static int stamp_encode(const void *inst, const void *src, size_t stride, uint32_t n, uint32_t cap,
                        void *const *pages) {
  uint32_t zero = 0;
  return stamp_encode_state(inst, &zero, src, stride, n, cap, pages);
}
static size_t stamp_state_bytes(const void *inst) {
  (void)inst;
  return 4;
}
static int stamp_decode(const void *inst, const void *const *pages, uint32_t n, uint32_t cap, uint32_t t0, uint32_t m,
                        void *dst, size_t dst_stride, kvp_dtype out) {
  (void)n, (void)cap;
  size_t row = stamp_n(inst) * 2;
  if (out != KVP_DTYPE_BF16) return KVP_ENOTSUP;
  for (uint32_t t = 0; t < m; t++) memcpy((char *)dst + t * dst_stride, (const char *)pages[0] + (t0 + t) * row, row);
  return KVP_OK;
}
static const kvp_codec_vtable STAMP = {.abi_version = KVP_CODEC_ABI_VERSION, .name = "stamp", .create = stamp_create,
                                       .destroy = stamp_destroy, .group_tokens = q16_group, .layout = stamp_layout,
                                       .encode = stamp_encode, .decode = stamp_decode,
                                       .state_bytes = stamp_state_bytes, .encode_stateful = stamp_encode_state};

/* ---- the pool ------------------------------------------------------------- */

static kvgen G;
static uint16_t K[256 * H * D], V[256 * H * D];

static kvp_pool *mkpool(const char *codecs, uint32_t block_tokens, int *rc) {
  static int registered;
  if (!registered) {
    ck_ok(kvp_codec_register(&Q16, &Q16_ID));
    ck_ok(kvp_codec_register(&STAMP, NULL));
    registered = 1;
  }
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.region_bytes = 16ull << 20;
  c.block_tokens = block_tokens;
  c.codecs = codecs;
  c.flags = KVP_POOL_ALLOW_EXPANSION; /* q16 (int16 + fp32 scale) and stamp store more than bf16 by design */
  kvp_pool *p = NULL;
  *rc = kvp_pool_create(&c, &p);
  kvgen_init(&G);
  return p;
}

static void step(kvp_pool *p, uint64_t seq, uint32_t pos0, uint32_t n) {
  ck_ok(kvp_step_begin(p, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    kvgen_fill(&G, seq, l, pos0, n, H, D, K, V);
    kvp_kv kv = {K, V, NULL};
    ck_ok(kvp_append(p, seq, l, &kv));
  }
  ck_ok(kvp_step_end(p, seq));
  ck_ok(kvp_check(p));
}

/* K reads back within half a q16 step, V (bf16) exactly. */
static void verify(kvp_pool *p, uint64_t seq, uint32_t n) {
  static float k[256 * D], v[256 * D];
  static uint32_t pos[256];
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++) {
      kvp_read_req q = {sizeof q, h, KVP_DTYPE_F32, k, v, pos, 256, 0, NULL};
      ck_ok(kvp_read(p, seq, l, &q));
      ck_assert_uint_eq(q.n_tokens, n);
      for (uint32_t t = 0; t < n; t++) {
        float amax = 0;
        for (uint32_t d = 0; d < D; d++) amax = fmaxf(amax, fabsf(bf16_to_f32(kvgen_value(&G, seq, l, h, t, d, 0))));
        for (uint32_t d = 0; d < D; d++) {
          float kw = bf16_to_f32(kvgen_value(&G, seq, l, h, t, d, 0));
          float vw = bf16_to_f32(kvgen_value(&G, seq, l, h, t, d, 1));
          if (fabsf(k[t * D + d] - kw) > amax / 32767.0f * 0.5f * 1.0001f || v[t * D + d] != vw)
            ck_abort_msg("layer %u head %u token %u channel %u: K %g (want %g), V %g (want %g)", l, h, t, d,
                         k[t * D + d], kw, v[t * D + d], vw);
        }
      }
    }
}

static uint64_t requested(kvp_pool *p) {
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  return s.bytes_requested.current;
}

START_TEST(user_codec_stream_mode_seals_from_raw_tail) {
  int rc;
  kvp_pool *p = mkpool("k=q16", BT, &rc);
  ck_ok(rc);
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, 1, 0, 40); /* per stream: 2 encoded blocks + an OPEN raw block of 8 */
  uint64_t enc = (uint64_t)BT * D * 2 + BT * 4, raw = (uint64_t)BT * D * 2;
  ck_assert_uint_eq(requested(p), (uint64_t)L * H * (2 * enc + raw /* K */ + 3 * raw /* V */));
  verify(p, 1, 40);
  for (uint32_t t = 40; t < 48; t++) step(p, 1, t, 1); /* the tail fills and is encoded */
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_retired.current, (uint64_t)L * H * 2 * raw); /* the raw tails wait for readers */
  ck_ok(kvp_reclaim(p));
  ck_ok(kvp_check(p));
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_retired.current, 0);
  ck_assert_uint_eq(requested(p), (uint64_t)L * H * (3 * enc + 3 * raw));
  verify(p, 1, 48);
  kvp_usage u;
  ck_ok(kvp_stats_breakdown(p, KVP_DIM_CODEC, Q16_ID, &u));
  ck_assert_uint_eq(u.npages, (uint64_t)L * H * 3 * 2);
  ck_assert_uint_eq(u.requested_bytes, (uint64_t)L * H * 3 * enc);
  ck_ok(kvp_stats_breakdown(p, KVP_DIM_PAGE_TYPE, KVP_PAGE_SCALES, &u));
  ck_assert_uint_eq(u.requested_bytes, (uint64_t)L * H * 3 * BT * 4);
  kvp_view *v;
  ck_ok(kvp_view_acquire(p, 1, 1, &v));
  ck_assert_uint_eq(v->blocks[0].codec[0], Q16_ID);
  ck_assert_ptr_nonnull(v->blocks[0].page[0][KVP_PAGE_SCALES]);
  ck_assert_ptr_null(v->blocks[0].page[0][KVP_PAGE_RAW]);
  ck_assert_ptr_nonnull(v->blocks[0].page[1][KVP_PAGE_RAW]);
  kvp_view_release(p, v);
  ck_ok(kvp_seq_free(p, 1));
  ck_assert_uint_eq(requested(p), 0);
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(user_codec_step_mode_and_fork) {
  int rc;
  kvp_pool *p = mkpool("layers=1:k=q16", BT, &rc);
  ck_ok(rc);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  ck_ok(kvp_seq_add(p, 3, &sc));
  step(p, 3, 0, 21); /* blocks of 16 and 5, both encoded at once in layer 1 */
  ck_ok(kvp_seq_fork(p, 3, 4));
  kvgen_fork(&G, 3, 4, 21);
  verify(p, 4, 21);
  kvp_usage u;
  ck_ok(kvp_stats_breakdown(p, KVP_DIM_LAYER, 0, &u));
  ck_assert_uint_eq(u.requested_bytes, (uint64_t)H * 2 * 21 * D * 2); /* raw bf16 K and V */
  ck_ok(kvp_stats_breakdown(p, KVP_DIM_LAYER, 1, &u));
  ck_assert_uint_eq(u.requested_bytes, (uint64_t)H * (21 * D * 2 + 21 * 4 + 21 * D * 2));
  kvp_pool_destroy(p);
}
END_TEST

/* META stamps of the blocks of (seq, layer 0, head 0), in order. */
static int stamps(kvp_pool *p, uint64_t seq, uint32_t *out) {
  kvp_view *v;
  ck_ok(kvp_view_acquire(p, seq, 0, &v));
  int n = 0;
  for (uint32_t i = 0; i < v->n_blocks; i++)
    if (v->blocks[i].head == 0 && v->blocks[i].page[0][KVP_PAGE_META]) memcpy(&out[n++], v->blocks[i].page[0][KVP_PAGE_META], 4);
  kvp_view_release(p, v);
  return n;
}

START_TEST(stateful_codec_state_is_per_stream) {
  int rc;
  kvp_pool *p = mkpool("kv=stamp", BT, &rc);
  ck_ok(rc);
  ck_ok(kvp_seq_add(p, 1, NULL));
  step(p, 1, 0, 40); /* two sealed blocks, stamps 0 and 1; the open tail is raw */
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.codec_state_bytes.current, L * H * 2 * 4); /* one counter per stream and side */
  uint32_t st[8];
  ck_assert_int_eq(stamps(p, 1, st), 2);
  ck_assert_uint_eq(st[0], 0);
  ck_assert_uint_eq(st[1], 1);
  ck_ok(kvp_evict(p, 1, 1, 1, 0)); /* evicting old blocks keeps the state (layer 1, head 1) */
  ck_ok(kvp_seq_fork(p, 1, 2));    /* and a fork copies it */
  kvgen_fork(&G, 1, 2, 40);
  for (uint32_t t = 40; t < 48; t++) step(p, 2, t, 1); /* the child's tail seals: stamp 2 */
  step(p, 1, 40, 24);                                  /* the parent's too, and one more: stamps 2, 3 */
  ck_assert_int_eq(stamps(p, 2, st), 3);
  ck_assert_uint_eq(st[2], 2);
  ck_assert_int_eq(stamps(p, 1, st), 4);
  for (uint32_t i = 0; i < 4; i++) ck_assert_uint_eq(st[i], i);
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.codec_state_bytes.current, 2 * L * H * 2 * 4);
  ck_ok(kvp_seq_free(p, 1));
  ck_ok(kvp_seq_free(p, 2));
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.codec_state_bytes.current, 0);
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(user_codec_bad_config) {
  int rc;
  kvp_pool *p = mkpool("k=q16:x=1", BT, &rc);
  ck_assert_int_eq(rc, KVP_EINVAL);
  ck_assert_ptr_null(p);
  ck_assert_msg(strstr(kvp_last_error(), "q16 takes no parameters") && strstr(kvp_last_error(), "layer 0 K"), "%s",
                kvp_last_error());
  p = mkpool("k=q17", BT, &rc);
  ck_assert_int_eq(rc, KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "unknown codec \"q17\"") != NULL);
}
END_TEST

int main(void) {
  Suite *s = suite_create("codec_api");
  TCase *tc = tcase_create("codec_api");
  tcase_add_test(tc, user_codec_stream_mode_seals_from_raw_tail);
  tcase_add_test(tc, user_codec_step_mode_and_fork);
  tcase_add_test(tc, stateful_codec_state_is_per_stream);
  tcase_add_test(tc, user_codec_bad_config);
  suite_add_tcase(s, tc);
  return it_run(s);
}
