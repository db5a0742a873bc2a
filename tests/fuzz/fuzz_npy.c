/*
 * tests/fuzz/fuzz_npy.c - the .npy reader on a buffer: a parsed array's
 * data must lie inside the input and hold exactly count x dtype bytes.
 */
#include "../../codecs/npy.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  kvp__npy a;
  int rc = kvp__npy_parse(&a, data, size, "fuzz.npy");
  if (rc != KVP_OK) {
    FUZZ_ASSERT(rc == KVP_EFORMAT, "rc %d", rc);
    return 0;
  }
  const uint8_t *d = a.data;
  FUZZ_ASSERT(d >= data && d <= data + size, "data outside the input");
  FUZZ_ASSERT((uint64_t)(data + size - d) == a.count * (uint64_t)a.dtype, "data bytes %zu, count %llu",
              (size_t)(data + size - d), (unsigned long long)a.count);
  uint64_t n = 1;
  for (unsigned i = 0; i < a.ndim; i++) n *= a.shape[i];
  FUZZ_ASSERT(n == a.count, "shape product");
  volatile uint8_t sink = 0;
  for (size_t i = 0; i < (size_t)(data + size - d); i++) sink ^= d[i]; /* ASan: every byte readable */
  (void)sink;
  return 0;
}
