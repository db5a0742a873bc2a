/*
 * tools/traces.h - strict parsers of public LLM serving traces, for
 * kvpool-sim llm. Every row becomes one request: an arrival time (when the
 * format has one), prompt tokens and output tokens.
 *
 *   azure     CSV "TIMESTAMP,ContextTokens,GeneratedTokens"; TIMESTAMP is a
 *             wall-clock "YYYY-MM-DD HH:MM:SS.fffffff" (up to 9 fractional
 *             digits, 7 in the published file); arrivals are seconds since
 *             the first row
 *   mooncake  JSONL, one object per line: "timestamp" (ms since the start),
 *             "input_length", "output_length", "hash_ids" (one id per
 *             512-token prompt block: its length must be ceil(input/512);
 *             equal ids mean equal blocks, and the ids are kept)
 *   sharegpt  CSV "num_prefill_tokens,num_decode_tokens,num_total_tokens,
 *             pd_ratio"; total must equal prefill + decode; no arrivals
 *
 * Strict: lines may end in LF or CRLF and the last may lack its newline,
 * nothing else is forgiven. Token counts are integers >= 1; arrivals never
 * go back in time. A failure returns a KVP_E* status (KVP_ENOENT: cannot
 * open; KVP_EFORMAT: bad content; KVP_ENOMEM) and a message naming the file,
 * line and field; the output is then empty.
 */
#ifndef KVP_TOOLS_TRACES_H
#define KVP_TOOLS_TRACES_H

#include <stddef.h>
#include <stdint.h>

typedef enum trace_format { TRACE_AZURE, TRACE_MOONCAKE, TRACE_SHAREGPT } trace_format;

typedef struct trace_req {
  double arrival_s;       /* seconds since the first request (0 without arrivals) */
  uint32_t prompt_tokens; /* prompt (prefill) tokens, >= 1 */
  uint32_t output_tokens; /* generated tokens, >= 1 */
  uint32_t n_prefix_blocks; /* mooncake: entries of hash_ids; else 0 */
  size_t hash0;           /* mooncake: index of its first hash id in trace.hash_ids */
} trace_req;

typedef struct trace {
  trace_req *reqs;   /* [n], in file order */
  size_t n;          /* requests */
  int has_arrivals;  /* 1 when the format carries arrival times */
  uint64_t *hash_ids; /* mooncake: every request's hash_ids, back to back
                         (request r's are [r.hash0, r.hash0 + r.n_prefix_blocks)); else NULL */
  size_t n_hash_ids;  /* entries of hash_ids */
} trace;

/* "azure" | "mooncake" | "sharegpt" -> *out; KVP_EINVAL otherwise. */
int trace_format_parse(const char *name, trace_format *out);
const char *trace_format_name(trace_format f);

/* Parse len bytes of a trace (name is used in messages). max_reqs > 0 stops
 * after that many rows (the rest is not read). Returns 0 or a negative
 * KVP_E* with the message in err (errcap bytes). */
int trace_parse(const char *buf, size_t len, const char *name, trace_format fmt, size_t max_reqs, trace *out,
                char *err, size_t errcap);
/* Read and parse a file. */
int trace_load(const char *path, trace_format fmt, size_t max_reqs, trace *out, char *err, size_t errcap);
void trace_free(trace *t);

#endif
