/*
 * tests/fuzz/fuzz_mass.c - the attention-mass summaries kvpool-calib reads
 * (JSON [L][H][K][K] or [prompts][L][H][K][K], or .npy), through the
 * loader's path interface; then orders computed from what was read. Byte 0
 * picks the format and the geometry.
 */
#include "../../pages/heatkv.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!size) return 0;
  uint32_t L = 1 + data[0] % 2, H = 1 + data[0] / 2 % 2, K = 3 + data[0] / 4 % 3;
  const char *path = fuzz_file(data + 1, size - 1, data[0] >= 128 ? ".npy" : ".json");
  kvp__mass m;
  FUZZ_ASSERT(kvp__mass_init(&m, L, H, K) == KVP_OK, "%s", kvp_last_error());
  int rc = kvp__mass_add_file(&m, path);
  if (rc == KVP_OK) {
    kvp__orders o;
    kvp__meta meta = {0};
    rc = kvp__orders_from_mass(&o, &m, 1, data[0] & 1, &meta);
    if (rc == KVP_OK) kvp__orders_free(&o);
  } else {
    FUZZ_ASSERT(rc == KVP_EFORMAT || rc == KVP_EINVAL || rc == KVP_ENOMEM, "rc %d: %s", rc, kvp_last_error());
  }
  kvp__mass_free(&m);
  unlink(path);
  return 0;
}
