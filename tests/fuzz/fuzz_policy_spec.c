/*
 * tests/fuzz/fuzz_policy_spec.c - the policy spec parser, then the policy
 * attached to a sequence (heatkv plans with synthetic orders for a small
 * schedule) through the public calls.
 */
#include "../../pages/policy.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char buf[FUZZ_MAX_TEXT + 1];
  const char *spec = fuzz_text(data, size, buf);
  if (fuzz_has_path(spec)) return 0;
  kvp__policy pol;
  int rc = kvp__policy_parse(spec, &pol);
  if (rc == KVP_OK) kvp__policy_free(&pol);
  else FUZZ_ASSERT(rc == KVP_EINVAL || rc == KVP_ENOMEM, "rc %d: %s", rc, kvp_last_error());
  if (rc != KVP_OK) return 0;
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 2, c.n_kv_heads = 2, c.head_dim = 16, c.block_tokens = 8;
  c.region_bytes = 2ull << 20;
  c.policy = spec;
  kvp_pool *p = NULL;
  if (kvp_pool_create(&c, &p)) return 0;
  static const uint32_t sched[5] = {1, 2, 4, 6, 8};
  static uint16_t kv[8 * 2 * 16];
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP, sc.step_tokens = sched, sc.n_steps = 5;
  if (kvp_seq_add(p, 1, &sc) == KVP_OK)
    for (uint32_t k = 0; k < 5; k++) {
      if (kvp_step_begin(p, 1, sched[k], k == 2 ? KVP_STEP_SCENE_CUT : 0)) break;
      for (uint32_t l = 0; l < 2; l++) FUZZ_ASSERT(kvp_append(p, 1, l, &(kvp_kv){kv, kv, NULL}) == KVP_OK, "%s",
                                                   kvp_last_error());
      FUZZ_ASSERT(kvp_step_end(p, 1) == KVP_OK, "%s", kvp_last_error());
      FUZZ_ASSERT(kvp_check(p) == KVP_OK, "%s", kvp_last_error());
    }
  kvp_pool_destroy(p);
  return 0;
}
