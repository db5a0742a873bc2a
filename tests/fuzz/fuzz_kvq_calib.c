/*
 * tests/fuzz/fuzz_kvq_calib.c - the kvquant calibration file reader
 * (KVQCALIB: header, per-layer off/rng/lut slices, CRC-32). The expected
 * geometry is the header's own (so the reader gets past the equality
 * checks), and when byte 0 is odd the harness rewrites the CRC so the
 * fuzzer reaches the slice checks; byte 1 picks the layer and side.
 */
#include "../../codecs/kvquant.h"
#include "fuzz.h"

static uint32_t le32(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  uint8_t mode = data[0], pick = data[1];
  data += 2, size -= 2;
  static uint8_t buf[1 << 16];
  if (size > sizeof buf) return 0;
  memcpy(buf, data, size);
  uint32_t L = 1, H = 1, D = 1, bits = 2;
  if (size >= 44) {
    L = le32(buf + 12), H = le32(buf + 16), D = le32(buf + 20), bits = le32(buf + 24);
    if (mode & 1) {
      uint32_t crc = kvp__crc32(0, buf, size - 4);
      for (int i = 0; i < 4; i++) buf[size - 4 + i] = (uint8_t)(crc >> (8 * i));
    }
  }
  const char *path = fuzz_file(buf, size, ".kvq");
  uint32_t layer = L ? pick % (L < 8 ? L : 8) : 0;
  kvp__kvq_side side;
  memset(&side, 0, sizeof side);
  char err[512] = "";
  int rc = kvp__kvq_load(path, layer, pick >> 7, L, H, D, bits, &side, err, sizeof err);
  if (rc == KVP_OK) {
    FUZZ_ASSERT(side.n_heads == H && side.head_dim == D && side.bits == bits, "geometry");
    for (size_t i = 0; i < (size_t)H * D; i++) FUZZ_ASSERT(side.rng[i] > 0, "rng[%zu] = %g", i, (double)side.rng[i]);
    kvp__kvq_side_free(&side);
  } else {
    FUZZ_ASSERT(rc == KVP_EFORMAT || rc == KVP_ENOMEM, "rc %d", rc);
    FUZZ_ASSERT(err[0] && strstr(err, path), "message \"%s\" names no file", err);
  }
  unlink(path);
  return 0;
}
