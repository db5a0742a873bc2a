/*
 * tests/fuzz/fuzz_store_blob.c - the store tier's blob readers on untrusted
 * bytes: a manifest or group blob payload (under a header and checksum the
 * door computes, so the fuzzer reaches past them) parsed as a restore
 * would, group blocks built then destroyed. Every outcome is KVP_OK or a
 * named refusal (EFORMAT, or ENOMEM/EBUDGET when a record asks for more
 * pages than the region holds); afterwards the pool passes kvp_check and
 * holds exactly the bytes it held before (nothing leaked, nothing kept).
 *
 * Input: kind (byte 0: odd = manifest, even = group), n_items (byte 1),
 * chunk index (byte 2), content flag (byte 3), tag (bytes 4..19), payload.
 * The pool: 1 layer, 1 KV head, head_dim 32, raw bf16 pages, 4-token blocks
 * (a block record of 60 bytes, then 256 bytes of K and 256 of V).
 */
#include "../../pages/pages.h"
#include "fuzz.h"

static kvp_pool *pool_once(void) {
  static kvp_pool *p;
  if (p) return p;
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 1, c.n_kv_heads = 1, c.head_dim = 32, c.block_tokens = 4;
  c.region_bytes = 8ull << 20;
  FUZZ_ASSERT(kvp_pool_create(&c, &p) == KVP_OK, "create: %s", kvp_last_error());
  return p;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 20) return 0;
  kvp_pool *p = pool_once();
  kvp_stats a = {.struct_size = sizeof a}, b = {.struct_size = sizeof b};
  FUZZ_ASSERT(kvp_stats_get(p, &a) == KVP_OK, "stats");
  uint64_t tag[2];
  memcpy(tag, data + 4, sizeof tag);
  int kind = data[0] & 1 ? 1 : 2;
  int rc = kvp__store_fuzz_parse(p, kind, data[1], data[2], data[3] & 1, tag, data + 20, size - 20);
  if (getenv("FUZZ_VERBOSE")) fprintf(stderr, "kind %d: status %d %s\n", kind, rc, rc ? kvp_last_error() : "");
  FUZZ_ASSERT(rc == KVP_OK || rc == KVP_EFORMAT || rc == KVP_ENOMEM || rc == KVP_EBUDGET, "kind %d: status %d (%s)",
              kind, rc, kvp_last_error());
  FUZZ_ASSERT(kvp_reclaim(p) == KVP_OK && kvp_check(p) == KVP_OK, "kind %d: %s", kind, kvp_last_error());
  FUZZ_ASSERT(kvp_stats_get(p, &b) == KVP_OK, "stats");
  FUZZ_ASSERT(a.bytes_allocated.current == b.bytes_allocated.current && a.pages.current == b.pages.current,
              "kind %d (status %d): allocated %llu -> %llu bytes, pages %llu -> %llu", kind, rc,
              (unsigned long long)a.bytes_allocated.current, (unsigned long long)b.bytes_allocated.current,
              (unsigned long long)a.pages.current, (unsigned long long)b.pages.current);
  return 0;
}
