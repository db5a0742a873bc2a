/*
 * tests/integration/check_traces.c - the trace parsers of kvpool-sim
 * (tools/traces.h): embedded samples with the published files' quirks
 * (CRLF, no final newline, 7-digit fractional seconds, JSONL with hash_ids,
 * exact totals), every rejection naming the line, and the shared traces
 * (../shared/traces, skipped with a message when absent) checked against
 * the row counts and statistics their README states.
 */
#include <check.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "itest.h"
#include "../../tools/traces.h"

#define SHARED "../shared/traces/"

static char err[512];

static int parse(const char *s, trace_format f, trace *t) {
  return trace_parse(s, strlen(s), "sample", f, 0, t, err, sizeof err);
}

/* Azure: CRLF, 7 fractional digits, no final newline. */
static const char AZURE[] = "TIMESTAMP,ContextTokens,GeneratedTokens\r\n"
                            "2023-11-16 18:15:46.6805900,374,44\r\n"
                            "2023-11-16 18:15:50.9951690,396,109\r\n"
                            "2023-11-16 18:15:51.2224670,879,55\r\n"
                            "2023-11-16 23:59:59.9999999,91,16\r\n"
                            "2023-11-17 00:00:00.0000001,1313,142";

START_TEST(azure_sample) {
  trace t;
  ck_assert_int_eq(parse(AZURE, TRACE_AZURE, &t), 0);
  ck_assert_uint_eq(t.n, 5);
  ck_assert_int_eq(t.has_arrivals, 1);
  ck_assert_double_eq(t.reqs[0].arrival_s, 0.0);
  ck_assert_double_eq_tol(t.reqs[1].arrival_s, 4.314579, 1e-9);
  ck_assert_double_eq_tol(t.reqs[2].arrival_s, 4.541877, 1e-9);
  /* across midnight: 5 h 44 min 13.3194100 s, then 0.0000002 s more */
  ck_assert_double_eq_tol(t.reqs[3].arrival_s, 5 * 3600 + 44 * 60 + 13.3194099, 1e-9);
  ck_assert_double_eq_tol(t.reqs[4].arrival_s - t.reqs[3].arrival_s, 2e-7, 1e-10);
  ck_assert_uint_eq(t.reqs[0].prompt_tokens, 374);
  ck_assert_uint_eq(t.reqs[4].prompt_tokens, 1313);
  ck_assert_uint_eq(t.reqs[4].output_tokens, 142);
  trace_free(&t);
  /* LF endings and a final newline parse the same */
  char lf[sizeof AZURE];
  size_t j = 0;
  for (size_t i = 0; AZURE[i]; i++)
    if (AZURE[i] != '\r') lf[j++] = AZURE[i];
  lf[j++] = '\n';
  lf[j] = 0;
  ck_assert_int_eq(parse(lf, TRACE_AZURE, &t), 0);
  ck_assert_uint_eq(t.n, 5);
  ck_assert_uint_eq(t.reqs[4].output_tokens, 142);
  trace_free(&t);
  /* max_reqs stops early */
  ck_assert_int_eq(trace_parse(AZURE, strlen(AZURE), "sample", TRACE_AZURE, 2, &t, err, sizeof err), 0);
  ck_assert_uint_eq(t.n, 2);
  trace_free(&t);
}
END_TEST

static const struct bad {
  trace_format f;
  const char *text, *want; /* want: a substring of the message */
} BAD[] = {
    {TRACE_AZURE, "", "empty file"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens\r\n", "header"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\r\n", "no requests"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374\n", "sample:2: GeneratedTokens"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44,1\n", "more than 3"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-374,44\n", "ContextTokens"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,0\n", "out of range"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,37x,4\n", "unexpected 'x'"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-02-29 18:15:46.1,3,4\n", "no such date"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n4046-11-16 18:15:46.6805900,374,44\n", "year 4046"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n1600-01-01 00:00:00,374,44\n", "year 1600"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.,3,4\n", "fractional"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1234567890,3,4\n", "fractional"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16T18:15:46.1,3,4\n", "YYYY-MM-DD"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0,3,4\n2023-11-16 18:15:46.0,3,4\n",
     "sample:3: TIMESTAMP goes back"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0,3,4\n\n2023-11-16 18:15:48.0,3,4\n",
     "sample:3: empty line"},
    {TRACE_AZURE, "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:47.0,3\r,4\n", "carriage return"},
    {TRACE_MOONCAKE, "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0]}\n",
     "ceil(600 / 512)"},
    {TRACE_MOONCAKE, "{\"timestamp\": 0, \"input_length\": 6, \"output_length\": 5}\n", "hash_ids"},
    {TRACE_MOONCAKE, "{\"timestamp\": 0.5, \"input_length\": 6, \"output_length\": 5, \"hash_ids\": [0]}\n",
     "\"timestamp\" is not an integer"},
    {TRACE_MOONCAKE, "{\"timestamp\": 0, \"input_length\": 6, \"output_length\": 5, \"hash_ids\": [0]\n", "bad JSON"},
    {TRACE_MOONCAKE,
     "{\"timestamp\": 9, \"input_length\": 6, \"output_length\": 5, \"hash_ids\": [0]}\n"
     "{\"timestamp\": 3, \"input_length\": 6, \"output_length\": 5, \"hash_ids\": [0]}\n",
     "sample:2: \"timestamp\" goes back"},
    {TRACE_MOONCAKE, "{\"timestamp\": 0, \"timestamp\": 1, \"input_length\": 6, \"output_length\": 5, \"hash_ids\": [0]}",
     "bad JSON"},
    {TRACE_MOONCAKE, "[1, 2]\n", "expected a JSON object"},
    {TRACE_SHAREGPT, "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,993,0.0806\n",
     "num_total_tokens = 993 is not 74 + 918"},
    {TRACE_SHAREGPT, "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,992,0.5\n",
     "pd_ratio 0.5 is not 74 / 918"},
    {TRACE_SHAREGPT, "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,992\n", "pd_ratio: missing"},
    {TRACE_SHAREGPT, "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n74,918,992,nan\n", "finite"},
};

START_TEST(rejections_name_the_line) {
  const struct bad *b = &BAD[_i];
  trace t = {(trace_req *)&t, 99, 1, NULL, 0};
  int rc = parse(b->text, b->f, &t);
  ck_assert_msg(rc == KVP_EFORMAT, "case %d: rc %d (%s)", _i, rc, err);
  ck_assert_msg(strstr(err, b->want) != NULL, "case %d: message \"%s\" lacks \"%s\"", _i, err, b->want);
  ck_assert_ptr_null(t.reqs);
  ck_assert_uint_eq(t.n, 0);
}
END_TEST

/* Mooncake: JSONL, ms timestamps shared by a batch, hash_ids per 512 tokens. */
static const char MOONCAKE[] =
    "{\"timestamp\": 0, \"input_length\": 6758, \"output_length\": 500, \"hash_ids\": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, "
    "11, 12, 13]}\n"
    "{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 3, \"hash_ids\": [0]}\n"
    "{\"timestamp\": 3047, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [0, 46]}";

START_TEST(mooncake_sample) {
  trace t;
  ck_assert_int_eq(parse(MOONCAKE, TRACE_MOONCAKE, &t), 0);
  ck_assert_uint_eq(t.n, 3);
  ck_assert_int_eq(t.has_arrivals, 1);
  ck_assert_double_eq(t.reqs[1].arrival_s, 0.0);
  ck_assert_double_eq_tol(t.reqs[2].arrival_s, 3.047, 1e-12);
  ck_assert_uint_eq(t.reqs[0].prompt_tokens, 6758);
  ck_assert_uint_eq(t.reqs[0].n_prefix_blocks, 14);
  ck_assert_uint_eq(t.reqs[2].n_prefix_blocks, 2);
  ck_assert_uint_eq(t.reqs[2].output_tokens, 1);
  ck_assert_uint_eq(t.n_hash_ids, 17); /* the ids are kept, request by request */
  ck_assert_uint_eq(t.reqs[1].hash0, 14);
  ck_assert_uint_eq(t.hash_ids[t.reqs[0].hash0 + 13], 13);
  ck_assert_uint_eq(t.hash_ids[t.reqs[1].hash0], 0);
  ck_assert_uint_eq(t.hash_ids[t.reqs[2].hash0 + 1], 46);
  trace_free(&t);
}
END_TEST

/* ShareGPT: lengths only, LF, exact totals, long pd_ratio fractions. */
static const char SHAREGPT[] = "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n"
                               "74,918,992,0.08061002178649238\n"
                               "290,905,1195,0.3204419889502762\n"
                               "1402,711,2113,1.9718706047819972";

START_TEST(sharegpt_sample) {
  trace t;
  ck_assert_int_eq(parse(SHAREGPT, TRACE_SHAREGPT, &t), 0);
  ck_assert_uint_eq(t.n, 3);
  ck_assert_int_eq(t.has_arrivals, 0);
  ck_assert_uint_eq(t.reqs[2].prompt_tokens, 1402);
  ck_assert_uint_eq(t.reqs[2].output_tokens, 711);
  trace_free(&t);
}
END_TEST

/* The shared files: row counts, means and spans from their README. */
static const struct shared {
  const char *file;
  trace_format f;
  size_t rows;
  double prompt_mean, output_mean, span_s; /* span < 0: no arrivals */
} SHARED_FILES[] = {
    {"AzureLLMInferenceTrace_conv.csv", TRACE_AZURE, 19366, 1154.7, 211.1, 3501.7},
    {"mooncake_conversation_trace.jsonl", TRACE_MOONCAKE, 12031, 12035.1, 342.6, 3537.0},
    {"mooncake_synthetic_trace.jsonl", TRACE_MOONCAKE, 3993, 15325.5, 149.1, 1022.0},
    {"sharegpt_8k_filtered_stats_llama2_tokenizer.csv", TRACE_SHAREGPT, 30731, 2340.0, 438.7, -1},
};

START_TEST(shared_traces) {
  const struct shared *s = &SHARED_FILES[_i];
  char path[256];
  snprintf(path, sizeof path, SHARED "%s", s->file);
  if (access(path, R_OK) != 0) {
    printf("check_traces: skipped %s: not found (../shared/traces is absent)\n", path);
    return;
  }
  trace t;
  int rc = trace_load(path, s->f, 0, &t, err, sizeof err);
  ck_assert_msg(rc == 0, "%s: %s", path, err);
  ck_assert_uint_eq(t.n, s->rows);
  double p = 0, o = 0;
  for (size_t i = 0; i < t.n; i++) p += t.reqs[i].prompt_tokens, o += t.reqs[i].output_tokens;
  ck_assert_double_eq_tol(p / (double)t.n, s->prompt_mean, 0.05);
  ck_assert_double_eq_tol(o / (double)t.n, s->output_mean, 0.05);
  if (s->span_s >= 0) ck_assert_double_eq_tol(t.reqs[t.n - 1].arrival_s, s->span_s, 0.05);
  else ck_assert_int_eq(t.has_arrivals, 0);
  printf("check_traces: %s: %zu requests, prompt mean %.1f, output mean %.1f\n", s->file, t.n, p / (double)t.n,
         o / (double)t.n);
  trace_free(&t);
}
END_TEST

START_TEST(missing_file_and_format_names) {
  trace t;
  ck_assert_int_eq(trace_load("no/such/trace.csv", TRACE_AZURE, 0, &t, err, sizeof err), KVP_ENOENT);
  ck_assert(strstr(err, "no/such/trace.csv") != NULL);
  trace_format f;
  ck_assert_int_eq(trace_format_parse("mooncake", &f), 0);
  ck_assert_int_eq(f, TRACE_MOONCAKE);
  ck_assert_int_eq(trace_format_parse("csv", &f), KVP_EINVAL);
  ck_assert_str_eq(trace_format_name(TRACE_SHAREGPT), "sharegpt");
}
END_TEST

int main(void) {
  Suite *s = suite_create("traces");
  TCase *tc = tcase_create("parsers");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, azure_sample);
  tcase_add_loop_test(tc, rejections_name_the_line, 0, (int)(sizeof BAD / sizeof *BAD));
  tcase_add_test(tc, mooncake_sample);
  tcase_add_test(tc, sharegpt_sample);
  tcase_add_loop_test(tc, shared_traces, 0, (int)(sizeof SHARED_FILES / sizeof *SHARED_FILES));
  tcase_add_test(tc, missing_file_and_format_names);
  suite_add_tcase(s, tc);
  return it_run(s);
}
