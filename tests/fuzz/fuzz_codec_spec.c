/*
 * tests/fuzz/fuzz_codec_spec.c - the codec spec parser, then each codec's
 * parameter parsing and layout through kvp_pool_create on a small pool.
 * Byte 0 picks layers (1..4) and head_dim (16..64); the rest is the spec.
 * A refused spec must leave a message naming config.codecs; a pool created
 * from an accepted one must pass kvp_check.
 */
#include "../../codecs/codecs.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!size) return 0;
  char buf[FUZZ_MAX_TEXT + 1];
  const char *spec = fuzz_text(data + 1, size - 1, buf);
  if (fuzz_has_path(spec)) return 0;
  uint32_t L = 1 + data[0] % 4, D = 16u << (data[0] / 4 % 3);
  kvp__spec_entry e[8];
  memset(e, 0, sizeof e);
  int rc = kvp__codec_spec_parse(spec, L, e);
  if (rc == KVP_OK) {
    kvp__codec_spec_free(e, 2 * L);
  } else {
    FUZZ_ASSERT(rc == KVP_EINVAL && strstr(kvp_last_error(), "config.codecs"), "%s", kvp_last_error());
  }
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = 2, c.head_dim = D, c.block_tokens = 32;
  c.region_bytes = 2ull << 20;
  c.codecs = spec;
  kvp_pool *p = NULL;
  rc = kvp_pool_create(&c, &p);
  FUZZ_ASSERT((rc == KVP_OK) == (p != NULL), "rc %d", rc);
  if (p) {
    FUZZ_ASSERT(kvp_check(p) == KVP_OK, "%s", kvp_last_error());
    kvp_pool_destroy(p);
  }
  return 0;
}
