/*
 * tests/unit/check_spec.c - the codec spec parser and the registry: clauses,
 * layer ranges and overrides, aliases, parameters, and errors that point at
 * the offending character.
 */
#include "../../codecs/codecs.h"
#include "testutil.h"

#include <string.h>

enum { L = 32 };

static kvp__spec_entry E[2 * L];

static void parse_ok(const char *spec) { ck_ok(kvp__codec_spec_parse(spec, L, E)); }

static uint32_t id_of(const char *name) {
  uint32_t id = 99;
  ck_ok(kvp_codec_find(name, &id));
  return id;
}

START_TEST(empty_is_raw) {
  parse_ok(NULL);
  for (int i = 0; i < 2 * L; i++) {
    ck_assert_uint_eq(E[i].id, KVP__CODEC_RAW);
    ck_assert_str_eq(E[i].params, "");
  }
  kvp__codec_spec_free(E, 2 * L);
  parse_ok("");
  kvp__codec_spec_free(E, 2 * L);
}
END_TEST

START_TEST(clauses_and_overrides) {
  parse_ok("k=bf16,v=raw:dtype=fp16;layers=24-31:k=fp32;layers=5:kv=raw");
  for (uint32_t l = 0; l < L; l++) {
    ck_assert_uint_eq(E[2 * l].id, KVP__CODEC_RAW);
    const char *want_k = l >= 24 ? "dtype=fp32" : l == 5 ? "" : "dtype=bf16";
    const char *want_v = l == 5 ? "" : "dtype=fp16";
    ck_assert_str_eq(E[2 * l].params, want_k);
    ck_assert_str_eq(E[2 * l + 1].params, want_v);
  }
  kvp__codec_spec_free(E, 2 * L);
  parse_ok("k=bf16:x=1:y=2");
  ck_assert_str_eq(E[0].params, "dtype=bf16:x=1:y=2"); /* the codec judges its parameters */
  kvp__codec_spec_free(E, 2 * L);
  ck_assert_uint_eq(id_of("raw"), KVP__CODEC_RAW);
}
END_TEST

/* Each bad spec: EINVAL, the column of the culprit, nothing allocated. */
static const struct {
  const char *spec;
  const char *where;
} bad[] = {
    {"q=bf16", "expected k=, v= or kv= at column 1"},
    {"k=zstd", "unknown codec \"zstd\" at column 3"},
    {"k=bf16,v=", "expected a codec name at column 10"},
    {"layers=3-40:k=bf16", "layers 3-40 outside 0-31 at column 8"},
    {"layers=9-3:k=bf16", "layers 9-3 outside"},
    {"layers=x:k=bf16", "expected a layer number at column 8"},
    {"layers=3 k=bf16", "expected ':' after the layer range at column 9"},
    {"k=bf16;", "empty clause after ';' at column 7"},
    {"k=bf16 ,v=bf16", "expected ':' before codec parameters at column 7"},
    {"k=BF16", "expected a codec name at column 3"},
};

START_TEST(errors_point_at_the_culprit) {
  ck_status(kvp__codec_spec_parse(bad[_i].spec, L, E), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), bad[_i].where) != NULL, "spec \"%s\": %s", bad[_i].spec, kvp_last_error());
  for (int i = 0; i < 2 * L; i++) ck_assert_ptr_null(E[i].params);
}
END_TEST

static int nop_create(const char *p, const kvp_codec_geom *g, void **inst, char *err, size_t cap, size_t *at) {
  (void)p, (void)g, (void)err, (void)cap, (void)at;
  *inst = NULL;
  return KVP_OK;
}
static void nop_destroy(void *i) { (void)i; }
static uint32_t nop_group(const void *i) {
  (void)i;
  return 1;
}
static void nop_layout(const void *i, uint32_t cap, kvp_codec_layout *o) {
  (void)i;
  o->npages = 1;
  o->types[0] = KVP_PAGE_CODES;
  o->bytes[0] = cap;
}
static int nop_encode(const void *i, const void *s, size_t st, uint32_t n, uint32_t cap, void *const *p) {
  (void)i, (void)s, (void)st, (void)n, (void)cap, (void)p;
  return KVP_OK;
}
static int nop_decode(const void *i, const void *const *p, uint32_t n, uint32_t cap, uint32_t t0, uint32_t m, void *d,
                      size_t ds, kvp_dtype o) {
  (void)i, (void)p, (void)n, (void)cap, (void)t0, (void)m, (void)d, (void)ds, (void)o;
  return KVP_OK;
}

static size_t nop_state_bytes(const void *i) {
  (void)i;
  return 8;
}

START_TEST(registry_rules) {
  kvp_codec_vtable vt = {.abi_version = KVP_CODEC_ABI_VERSION, .name = "unit-nop", .create = nop_create,
                         .destroy = nop_destroy, .group_tokens = nop_group, .layout = nop_layout,
                         .encode = nop_encode, .decode = nop_decode};
  uint32_t id = 0;
  ck_ok(kvp_codec_register(&vt, &id));
  ck_assert_uint_gt(id, 0);
  ck_assert_ptr_eq(kvp__codec_get(id), &vt);
  ck_status(kvp_codec_register(&vt, &id), KVP_EEXIST);
  kvp_codec_vtable bad_abi = vt;
  bad_abi.abi_version = 99;
  bad_abi.name = "unit-abi";
  ck_status(kvp_codec_register(&bad_abi, &id), KVP_EINVAL);
  kvp_codec_vtable bad_name = vt;
  bad_name.name = "Has Space";
  ck_status(kvp_codec_register(&bad_name, &id), KVP_EINVAL);
  kvp_codec_vtable no_fn = vt;
  no_fn.name = "unit-nofn";
  no_fn.decode = NULL;
  ck_status(kvp_codec_register(&no_fn, &id), KVP_EINVAL);
  ck_status(kvp_codec_register(NULL, &id), KVP_EINVAL);
  kvp_codec_vtable half_state = vt;
  half_state.name = "unit-state";
  half_state.state_bytes = nop_state_bytes; /* encode_stateful is missing */
  ck_status(kvp_codec_register(&half_state, &id), KVP_EINVAL);
  ck_status(kvp_codec_find("unit-missing", &id), KVP_ENOENT);
  parse_ok("layers=0-1:v=unit-nop:anything=goes");
  ck_assert_ptr_eq(kvp__codec_get(E[1].id), &vt);
  ck_assert_str_eq(E[1].params, "anything=goes");
  kvp__codec_spec_free(E, 2 * L);
}
END_TEST

int main(void) {
  Suite *s = suite_create("spec");
  TCase *tc = tcase_create("spec");
  tcase_add_test(tc, empty_is_raw);
  tcase_add_test(tc, clauses_and_overrides);
  tcase_add_loop_test(tc, errors_point_at_the_culprit, 0, (int)KVP__ARRAY_LEN(bad));
  tcase_add_test(tc, registry_rules);
  suite_add_tcase(s, tc);
  return t_run(s);
}
