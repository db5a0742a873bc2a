/*
 * tests/fuzz/fuzz_orders.c - HeatKV orders JSON (the shipped list format
 * and kvpool's own) from a buffer. Byte 0 picks the geometry the caller
 * expects (or any); loaded orders must be permutations, and their metadata
 * must stay in proportion to the input.
 */
#include "../../pages/heatkv.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!size) return 0;
  uint32_t L = 1 + data[0] % 3, H = 1 + data[0] / 3 % 3, K = 3 + data[0] / 9 % 4, s = data[0] / 36 % 3;
  bool any = data[0] >= 200;
  kvp__meta m = {0};
  kvp__orders o;
  int rc = kvp__orders_parse(&o, (const char *)data + 1, size - 1, "fuzz.json", any ? KVP__ORDERS_ANY : L,
                             any ? KVP__ORDERS_ANY : H, any ? KVP__ORDERS_ANY : K, any ? KVP__ORDERS_ANY : s, &m);
  if (rc != KVP_OK) {
    FUZZ_ASSERT(rc == KVP_EFORMAT || rc == KVP_EINVAL || rc == KVP_ENOMEM, "rc %d", rc);
    FUZZ_ASSERT(m.bytes == 0, "a refused file left %llu bytes", (unsigned long long)m.bytes);
    return 0;
  }
  uint32_t T = o.n_layers * o.n_heads;
  for (uint32_t j = 0; j < o.n_orders; j++) {
    static uint8_t seen[65536];
    FUZZ_ASSERT(T <= sizeof seen, "T %u", T);
    memset(seen, 0, T);
    for (uint32_t e = 0; e < T; e++) {
      uint32_t p = o.pairs[(size_t)j * T + e];
      FUZZ_ASSERT(p < T && !seen[p], "list %u is not a permutation", j);
      seen[p] = 1;
    }
  }
  FUZZ_ASSERT(m.peak_bytes <= 64 * size + 4096 || o.cas, "%llu bytes of metadata for %zu bytes of input",
              (unsigned long long)m.peak_bytes, size);
  kvp__orders_free(&o);
  FUZZ_ASSERT(m.bytes == 0, "orders_free left %llu bytes", (unsigned long long)m.bytes);
  return 0;
}
