/*
 * tests/fuzz/fuzz_codec_spec.c - the codec spec parser, then each binding it
 * names: the codec's parameters, its instance and layout for the pool's
 * geometry. Byte 0 picks layers (1..4) and head_dim (16..64); the rest is
 * the spec. A refused spec must leave a message naming config.codecs; a
 * pool created from an accepted one must pass kvp_check.
 *
 * Cost, so that the fuzzer runs fast (> 1,000 execs/s): a whole pool (its
 * region, hash table and worker thread) costs about a millisecond under
 * ASan, and kvquant fits a synthetic calibration per binding at create (10
 * ms and more each under the sanitizers). So an accepted spec builds its
 * bindings on a pool kept per geometry (kvp__bindings_try: what
 * kvp_pool_create does with config.codecs), and creates a whole pool and
 * checks it for one input in four; kvquant's bindings are checked
 * parse-only (kvp__kvq_params_check: every key, value and geometry check
 * create makes, not the fit), and a spec naming kvquant creates a whole
 * pool only at one layer, head_dim 16, calib_tokens at most the default
 * 256, for one input in 64. Which inputs is decided by a hash of the whole
 * input, not by a byte the fuzzer can keep while it mutates the rest: a
 * corpus that gathers such inputs (they reach more code) still runs its
 * mutants at these rates.
 */
#include "../../codecs/codecs.h"
#include "../../codecs/kvquant.h"
#include "../../pages/pages.h"
#include "fuzz.h"

static kvp_config config_of(uint32_t L, uint32_t D, const char *spec) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = 2, c.head_dim = D, c.block_tokens = 32;
  c.region_bytes = 2ull << 20;
  c.codecs = spec;
  return c;
}

/* A kvquant binding's calibration is cheap enough to fit: calib_tokens
 * (the last one given counts, if the parameters are valid) at most 256. */
static bool fit_is_cheap(const char *params) {
  bool cheap = true;
  for (const char *q = params; (q = strstr(q, "calib_tokens=")) != NULL; q++)
    cheap = strtoul(q + 13, NULL, 10) <= 256;
  return cheap;
}

/* Its kvquant bindings, parameters only: 0 if there is none, 1 if each
 * would fit cheaply, 2 if one would not. */
static int kvquant_checked(const kvp__spec_entry *e, uint32_t L, uint32_t D) {
  int any = 0;
  for (uint32_t i = 0; i < 2 * L; i++) {
    if (strcmp(kvp__codec_get(e[i].id)->name, "kvquant") != 0) continue;
    if (any < 2) any = fit_is_cheap(e[i].params ? e[i].params : "") ? 1 : 2;
    kvp_codec_geom g = {D, KVP_DTYPE_BF16, i / 2, i % 2, L, 2};
    char err[256] = "";
    size_t at = 0;
    int rc = kvp__kvq_params_check(e[i].params ? e[i].params : "", &g, err, sizeof err, &at);
    FUZZ_ASSERT(rc == KVP_OK || (rc == KVP_EINVAL && err[0]), "kvquant \"%s\": status %d, \"%s\"", e[i].params, rc,
                err);
  }
  return any;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!size) return 0;
  char buf[FUZZ_MAX_TEXT + 1];
  const char *spec = fuzz_text(data + 1, size - 1, buf);
  if (fuzz_has_path(spec)) return 0;
  uint32_t L = 1 + data[0] % 4, D = 16u << (data[0] / 4 % 3);
  uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a of the input */
  for (size_t i = 0; i < size; i++) h = (h ^ data[i]) * 0x100000001b3ull;
  bool whole = h % 4 == 0;
  kvp__spec_entry e[8];
  memset(e, 0, sizeof e);
  int rc = kvp__codec_spec_parse(spec, L, e);
  if (rc) {
    FUZZ_ASSERT(rc == KVP_EINVAL && strstr(kvp_last_error(), "config.codecs"), "%s", kvp_last_error());
    return 0;
  }
  int kvquant = kvquant_checked(e, L, D);
  kvp__codec_spec_free(e, 2 * L);
  if (kvquant && !(kvquant == 1 && h % 64 == 0 && L == 1 && D == 16)) return 0;
  kvp_config c = config_of(L, D, spec);
  if (whole) {
    kvp_pool *p = NULL;
    rc = kvp_pool_create(&c, &p);
    FUZZ_ASSERT((rc == KVP_OK) == (p != NULL), "rc %d", rc);
    if (p) {
      FUZZ_ASSERT(kvp_check(p) == KVP_OK, "%s", kvp_last_error());
      kvp_pool_destroy(p);
    }
    return 0;
  }
  static kvp_pool *pools[4][3]; /* raw bindings, one per geometry, kept across inputs */
  kvp_pool **p = &pools[L - 1][data[0] / 4 % 3];
  if (!*p) {
    kvp_config raw = config_of(L, D, NULL);
    FUZZ_ASSERT(kvp_pool_create(&raw, p) == KVP_OK, "create: %s", kvp_last_error());
  }
  rc = kvp__bindings_try(*p, spec);
  FUZZ_ASSERT(rc == KVP_OK || (rc < 0 && kvp_last_error()[0]), "status %d", rc);
  FUZZ_ASSERT(kvp_check(*p) == KVP_OK, "%s", kvp_last_error());
  return 0;
}
