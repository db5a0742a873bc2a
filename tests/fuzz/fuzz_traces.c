/*
 * tests/fuzz/fuzz_traces.c - the serving-trace parsers of kvpool-sim
 * (tools/traces.c: azure CSV, mooncake JSONL, sharegpt CSV). Byte 0 picks
 * the format and a row limit. What a parse returns must keep the
 * documented rules: tokens >= 1, arrivals that never go back.
 */
#include "../../tools/traces.h"
#include "fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!size) return 0;
  trace_format fmt = (trace_format)(data[0] % 3);
  size_t max_reqs = data[0] / 3 % 4 == 3 ? 2 : 0;
  trace t;
  memset(&t, 0, sizeof t);
  char err[512] = "";
  int rc = trace_parse((const char *)data + 1, size - 1, "fuzz", fmt, max_reqs, &t, err, sizeof err);
  if (rc) {
    FUZZ_ASSERT(rc < 0 && err[0], "rc %d with no message", rc);
    FUZZ_ASSERT(t.n == 0 && t.reqs == NULL, "a failed parse returned %zu requests", t.n);
    return 0;
  }
  FUZZ_ASSERT(!max_reqs || t.n <= max_reqs, "%zu requests past the limit", t.n);
  for (size_t i = 0; i < t.n; i++) {
    FUZZ_ASSERT(t.reqs[i].prompt_tokens >= 1 && t.reqs[i].output_tokens >= 1, "row %zu has 0 tokens", i);
    FUZZ_ASSERT(i == 0 || t.reqs[i].arrival_s >= t.reqs[i - 1].arrival_s, "row %zu goes back in time", i);
  }
  trace_free(&t);
  return 0;
}
