/*
 * tests/integration/check_sim.c - kvpool-sim, run as a program (the binary
 * beside the tests, build/kvpool-sim): a short run of each subcommand whose
 * JSON is checked against figures this test computes on its own from the
 * geometry (bytes per token of the codec layouts, the size-class formula of
 * DESIGN.md section 5, the trace it wrote), budget violations 0 under every
 * policy, the CSV contract, and clear errors with a non-zero exit. The
 * store tier (llm --store) runs against a private redis-server on a free
 * loopback port (skipped, with a message, without redis-server or hiredis).
 */
#include <check.h>
#include <jansson.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "itest.h"
#include "../../tools/redis_srv.h"

enum { MOONCAKE_REQS = 120 }; /* the store run of the mooncake trace: its first requests (~10 s) */

static char SIM[PATH_MAX];
static char TMP[PATH_MAX];

static const uint64_t SCHED[13] = {1, 4, 16, 36, 64, 144, 256, 400, 576, 1024, 1600, 2304, 4096};

/* Run the simulator with args (a shell fragment); stdout into *out (malloc'd). */
static int run_sim(const char *args, char **out, char **errout) {
  char cmd[3 * PATH_MAX], ef[PATH_MAX + 16];
  snprintf(ef, sizeof ef, "%s/stderr", TMP);
  snprintf(cmd, sizeof cmd, "%s %s 2>%s", SIM, args, ef);
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  size_t r;
  while ((r = fread(buf + n, 1, cap - n - 1, p)) > 0) {
    n += r;
    if (n + 1 == cap) buf = realloc(buf, cap *= 2);
  }
  buf[n] = 0;
  int st = pclose(p);
  *out = buf;
  if (errout) {
    FILE *f = fopen(ef, "r");
    char *e = calloc(1, 8192);
    if (f) {
      size_t m = fread(e, 1, 8191, f);
      e[m] = 0;
      fclose(f);
    }
    *errout = e;
  }
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

static json_t *run_json(const char *args) {
  char *out, *err;
  int rc = run_sim(args, &out, &err);
  ck_assert_msg(rc == 0, "kvpool-sim %s exited %d: %s", args, rc, err);
  json_error_t je;
  json_t *j = json_loads(out, 0, &je);
  ck_assert_msg(j && json_is_object(j), "kvpool-sim %s: not one JSON object (%s): %.200s", args, je.text, out);
  free(out);
  free(err);
  return j;
}

static double sim_wall(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static uint64_t U(json_t *j, const char *key) {
  json_t *v = json_object_get(j, key);
  ck_assert_msg(json_is_integer(v), "key %s missing or not an integer", key);
  return (uint64_t)json_integer_value(v);
}

static double F(json_t *j, const char *key) {
  json_t *v = json_object_get(j, key);
  ck_assert_msg(json_is_number(v), "key %s missing or not a number", key);
  return json_number_value(v);
}

/* Allocated bytes of a page in a region of 64 MiB or more (the simulator's):
 * up to 32 KiB its size class (8 B, then 16 B steps to 1 KiB, then 64 per
 * doubling: 1040, 1056, ..., 2048, 2080, ...); above, the request rounded
 * up to the 4 KiB extent unit only. */
static uint64_t size_class(uint64_t n) {
  if (n > (32u << 10)) return (n + 4095) / 4096 * 4096;
  if (n <= 8) return 8;
  if (n <= 1024) return (n + 15) / 16 * 16;
  uint64_t lo = 1024;
  while (lo * 2 < n) lo *= 2; /* n in (lo, 2 lo] */
  uint64_t step = lo / 64;
  return (n + step - 1) / step * step;
}

/* Raw bf16 var: full cache from the geometry alone. */
START_TEST(var_raw_full_cache_from_geometry) {
  enum { L = 3, H = 2, D = 64, IMAGES = 2 };
  json_t *j = run_json("var --layers 3 --kv-heads 2 --head-dim 64 --images 2 --json --quiet");
  uint64_t rows = 2 * IMAGES, req = 0, alloc = 0, all = 0;
  for (int t = 0; t < 13; t++) {
    uint64_t side = SCHED[t] * D * 2; /* one head, one of K or V */
    if (t < 12) req += 2 * side, alloc += 2 * size_class(side);
    all += 2 * size_class(side);
  }
  ck_assert_uint_eq(U(j, "full_cache_requested_bytes"), rows * L * H * req);
  ck_assert_uint_eq(U(j, "full_cache_bytes"), rows * L * H * alloc);
  ck_assert_uint_eq(U(j, "all_scales_bytes"), rows * L * H * all);
  ck_assert_uint_eq(U(j, "bf16_full_cache_bytes"), rows * L * H * req);
  /* no eviction: the peak is every scale of every row, the default budget exactly that */
  ck_assert_uint_eq(U(j, "peak_allocated_bytes"), rows * L * H * all);
  ck_assert_uint_eq(U(j, "budget_bytes"), rows * L * H * all);
  ck_assert_uint_eq(U(j, "budget_violations"), 0);
  ck_assert_uint_eq(U(j, "checkpoints"), 13 * L);
  ck_assert_uint_eq(U(j, "images_that_fit"), IMAGES);
  json_decref(j);
}
END_TEST

/* The Infinity-2B preset under HeatKV in bytes, nvfp4: the full cache and the
 * policy's budget from the geometry; the pool never passes it. */
START_TEST(var_infinity_2b_heatkv_nvfp4) {
  json_t *j = run_json("var --model infinity-2b --codecs k=nvfp4,v=nvfp4 "
                       "--policy heatkv:b=0.1:s=3:orders=synthetic:unit=bytes --budget-bytes 1G --json --quiet");
  const uint64_t L = 32, H = 16, rows = 2;
  uint64_t req = 0, alloc = 0, bf16 = 0;
  for (int t = 0; t < 12; t++) {
    /* pages of one side: E2M1 codes, E4M3 scales per 16, one FP32 per segment-head; each its own class */
    uint64_t codes = SCHED[t] * 128 / 2, scales = SCHED[t] * 128 / 16, meta = 4;
    req += 2 * (codes + scales + meta);
    alloc += 2 * (size_class(codes) + size_class(scales) + size_class(meta));
    bf16 += 2 * SCHED[t] * 128 * 2;
  }
  ck_assert_uint_eq(U(j, "full_cache_requested_bytes"), rows * L * H * req);
  ck_assert_uint_eq(U(j, "full_cache_bytes"), rows * L * H * alloc);
  ck_assert_uint_eq(U(j, "bf16_full_cache_bytes"), rows * L * H * bf16);
  ck_assert_uint_eq(U(j, "bf16_full_cache_bytes"), 2ull * 32 * 16 * 6425 * 128 * 4);
  uint64_t B = rows * (uint64_t)floor(0.1 * (double)(L * H * alloc));
  ck_assert_uint_eq(U(j, "policy_budget"), B);
  ck_assert_uint_le(U(j, "peak_allocated_bytes"), B);
  ck_assert_uint_ge(U(j, "peak_allocated_bytes"), B * 9 / 10); /* the budget is used, not wasted */
  ck_assert_uint_eq(U(j, "policy_budget_violations"), 0);
  ck_assert_uint_eq(U(j, "budget_violations"), 0);
  ck_assert_uint_eq(U(j, "budget_bytes"), 1ull << 30);
  ck_assert_uint_eq(U(j, "images_that_fit"), (1ull << 30) / U(j, "peak_allocated_bytes"));
  json_decref(j);
}
END_TEST

/* Infinity-8B in dry mode: the preset's geometry and the full cache from it. */
START_TEST(var_infinity_8b_dry_preset) {
  json_t *j = run_json("var --model infinity-8b --dry --policy heatkv:b=0.04:s=3:orders=synthetic:unit=bytes "
                       "--json --quiet");
  ck_assert_uint_eq(U(j, "n_layers"), 40);
  ck_assert_uint_eq(U(j, "n_kv_heads"), 28);
  ck_assert_uint_eq(U(j, "head_dim"), 128);
  ck_assert_uint_eq(U(j, "n_scales"), 13);
  ck_assert_uint_eq(U(j, "full_cache_requested_bytes"), 2ull * 40 * 28 * 6425 * 128 * 2 * 2);
  ck_assert_uint_eq(U(j, "policy_budget_violations"), 0);
  ck_assert_uint_le(U(j, "peak_allocated_bytes"), U(j, "policy_budget"));
  json_decref(j);
}
END_TEST

/* Raw storage dtypes: fp32 keys cost 4 bytes an element, bf16 values 2; the CSV has a row per
 * layer checkpoint. */
START_TEST(var_raw_dtypes_and_csv) {
  char args[2 * PATH_MAX], csv[PATH_MAX + 16];
  snprintf(csv, sizeof csv, "%s/var.csv", TMP);
  snprintf(args, sizeof args, "var --layers 2 --kv-heads 3 --head-dim 16 --schedule 1,4,9,16 --k-dtype fp32 "
           "--v-dtype bf16 --csv %s --json --quiet", csv);
  json_t *j = run_json(args);
  uint64_t per_head = (1 + 4 + 9) * 16 * (4 + 2); /* scales 0..K-2 */
  ck_assert_uint_eq(U(j, "full_cache_requested_bytes"), 2ull * 2 * 3 * per_head);
  ck_assert_uint_eq(U(j, "bf16_full_cache_bytes"), 2ull * 2 * 3 * (1 + 4 + 9) * 16 * 4);
  ck_assert_uint_eq(U(j, "checkpoints"), 4 * 2);
  FILE *f = fopen(csv, "r");
  ck_assert_ptr_nonnull(f);
  char line[1024];
  int rows = -1;
  uint64_t last_alloc = 0;
  while (fgets(line, sizeof line, f)) {
    if (rows++ < 0) continue;
    unsigned long long it, running, alloc;
    double t;
    ck_assert_int_eq(sscanf(line, "%llu,%lf,%llu,%*u,%*u,%*u,%llu", &it, &t, &running, &alloc), 4);
    ck_assert_uint_eq(running, 2); /* one image: two CFG rows */
    last_alloc = alloc;
  }
  fclose(f);
  ck_assert_int_eq(rows, 8);
  ck_assert_uint_eq(last_alloc, U(j, "peak_allocated_bytes")); /* no eviction: the last checkpoint is the peak */
  json_decref(j);
}
END_TEST

/* Budget violations 0 under every policy and unit, small geometry. */
static const char *const POLICIES[] = {
    "heatkv:b=0.2:s=3:orders=synthetic:unit=bytes", "heatkv:b=0.1:s=3:orders=synthetic:unit=bytes",
    "heatkv:b=0.04:s=3:orders=synthetic:unit=bytes", "heatkv:b=0.2:s=3:orders=synthetic",
    "heatkv:b=0.1:s=3:orders=synthetic", "heatkv:b=0.04:s=3:orders=synthetic",
    "binary-heatkv:b=0.1:s=3:scores=synthetic:unit=bytes", "binary-heatkv:b=0.2:s=3:scores=synthetic",
};

START_TEST(var_heatkv_no_violations) {
  char args[512];
  snprintf(args, sizeof args, "var --layers 8 --kv-heads 4 --head-dim 32 --images 2 --codecs kv=int8 --policy %s "
           "--check --json --quiet", POLICIES[_i]);
  json_t *j = run_json(args);
  ck_assert_uint_eq(U(j, "policy_budget_violations"), 0);
  ck_assert_uint_gt(U(j, "policy_budget"), 0);
  if (strstr(POLICIES[_i], "unit=bytes")) {
    ck_assert_uint_eq(U(j, "budget_violations"), 0); /* the default budget is the policy's */
    ck_assert_uint_le(U(j, "peak_allocated_bytes"), U(j, "policy_budget"));
  } else {
    /* slots: the paper's head-token budget holds; bytes may pass b x full bytes (small scales
     * round up more), which is what budget_violations reports and why kvpool plans in bytes */
    ck_assert_uint_le(U(j, "peak_tokens_retained"), U(j, "policy_budget"));
  }
  ck_assert_uint_gt(U(j, "tokens_evicted"), 0);
  json_decref(j);
}
END_TEST

static const char *const VIDEO_POLICIES[] = {"window:sink=128:recent=256", "multishot:global=1:shot=1:window=2",
                                             "none"};

/* Video: the full cache from the geometry; window/multishot bound the cache. */
START_TEST(video_policies) {
  char args[512];
  const char *pol = VIDEO_POLICIES[_i];
  snprintf(args, sizeof args, "video --layers 2 --kv-heads 2 --head-dim 32 --frames-per-chunk 2 --tokens-per-frame 64 "
           "--chunks 10 --scene-every 4 --codecs k=fp8,v=fp8 --policy %s --check --json --quiet", pol);
  json_t *j = run_json(args);
  uint64_t chunk_bf16 = 128ull * 2 * 2 * 32 * 2 * 2; /* tokens x L x H x D x 2 bytes x (K, V) */
  ck_assert_uint_eq(U(j, "full_cache_bytes"), 10 * chunk_bf16);
  ck_assert_uint_eq(U(j, "budget_violations"), 0);
  ck_assert_uint_eq(U(j, "checkpoints"), 10 * 2);
  uint64_t peak16 = U(j, "peak_bf16_equivalent_bytes");
  if (!strcmp(pol, "none")) {
    ck_assert_uint_eq(peak16, 10 * chunk_bf16);
    ck_assert_uint_eq(U(j, "tokens_evicted"), 0);
  } else {
    /* window: 1 sink chunk + 2 recent + the chunk being written; multishot: global + shot + window */
    ck_assert_uint_le(peak16, 4 * chunk_bf16);
    ck_assert_uint_ge(peak16, 3 * chunk_bf16);
    ck_assert_uint_gt(U(j, "tokens_evicted"), 0);
  }
  ck_assert_uint_lt(U(j, "peak_allocated_bytes"), peak16); /* fp8 is smaller than bf16 */
  json_decref(j);
}
END_TEST

/* An azure-format trace the test writes: the simulator serves it all and
 * its token counts match the file. */
static void write_trace(const char *path, int n, unsigned p0, unsigned o0, uint64_t *prompt, uint64_t *output) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  fputs("TIMESTAMP,ContextTokens,GeneratedTokens\r\n", f);
  *prompt = *output = 0;
  for (int i = 0; i < n; i++) {
    unsigned p = p0 + (unsigned)(i * 37) % 200, o = o0 + (unsigned)(i * 13) % 40;
    /* 20 arrivals a second: the batch fills */
    fprintf(f, "2023-11-16 18:15:%02d.%07d,%u,%u%s", i / 20, (i % 20) * 500000 + i, p, o, i + 1 < n ? "\r\n" : "");
    *prompt += p, *output += o;
  }
  fclose(f);
}

static const char *const LLM_CASES[] = {"", "--codecs k=kivi:bits=2,v=kivi:bits=2", "--policy window:sink=4:recent=64"};

START_TEST(llm_trace_served) {
  char path[PATH_MAX + 16], args[3 * PATH_MAX], csv[PATH_MAX + 16];
  snprintf(path, sizeof path, "%s/azure.csv", TMP);
  snprintf(csv, sizeof csv, "%s/llm.csv", TMP);
  uint64_t prompt, output;
  write_trace(path, 40, 20, 1, &prompt, &output);
  /* 2 layers x 2 heads x 64 x 2 bytes x 2 = 1 KiB per bf16 token: 1 MiB holds ~1000 tokens */
  snprintf(args, sizeof args, "llm --layers 2 --kv-heads 2 --head-dim 64 --params 7e9 --trace %s --format azure --budget-bytes 2M "
           "--max-batch-tokens 256 %s --csv %s --check --json --quiet", path, LLM_CASES[_i], csv);
  json_t *j = run_json(args);
  ck_assert_uint_eq(U(j, "requests_total"), 40);
  ck_assert_uint_eq(U(j, "requests_finished"), 40);
  ck_assert_uint_eq(U(j, "rejected"), 0);
  ck_assert_uint_eq(U(j, "prompt_tokens"), prompt);
  ck_assert_uint_eq(U(j, "generated_tokens"), output);
  ck_assert_uint_eq(U(j, "budget_bytes"), 2u << 20);
  ck_assert_uint_le(U(j, "peak_allocated_bytes"), 2u << 20);
  ck_assert_uint_eq(U(j, "budget_violations"), 0);
  ck_assert_uint_ge(U(j, "max_running"), 2);
  double thr = F(j, "throughput_tokens_per_s"), t = F(j, "sim_time_s");
  ck_assert_double_eq_tol(thr, (double)output / t, 1e-6 * thr);
  ck_assert(F(j, "ttft_mean_s") > 0 && F(j, "ttft_p90_s") >= F(j, "ttft_mean_s") * 0.5);
  /* the CSV: the contract's header, one LF row per iteration, page types sum to the ledger */
  FILE *f = fopen(csv, "r");
  ck_assert_ptr_nonnull(f);
  char line[1024];
  ck_assert_ptr_nonnull(fgets(line, sizeof line, f));
  ck_assert_str_eq(line, "iter,sim_time_s,running,waiting,finished,preemptions,allocated_bytes,requested_bytes,"
                         "budget_bytes,bf16_equivalent_bytes,device_used_bytes,alloc_raw,alloc_codes,alloc_scales,"
                         "alloc_centroids,alloc_assign,alloc_outliers,alloc_meta\n");
  uint64_t rows = 0, last_finished = 0;
  while (fgets(line, sizeof line, f)) {
    ck_assert(strchr(line, '\r') == NULL);
    unsigned long long v[18];
    double ts;
    int n = sscanf(line, "%llu,%lf,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu", &v[0],
                   &ts, &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9], &v[10], &v[11], &v[12], &v[13], &v[14],
                   &v[15], &v[16], &v[17]);
    ck_assert_int_eq(n, 18);
    ck_assert_uint_eq(v[0], rows);
    uint64_t sum = 0;
    for (int k = 11; k < 18; k++) sum += v[k];
    ck_assert_uint_eq(sum, v[6]);
    ck_assert_uint_le(v[7], v[6]);
    ck_assert_uint_le(v[6], v[8]);
    last_finished = v[4];
    rows++;
  }
  fclose(f);
  ck_assert_uint_eq(rows, U(j, "iterations"));
  ck_assert_uint_eq(last_finished, 40);
  json_decref(j);
}
END_TEST

/* A trace longer than the synthetic default of 200 requests is replayed
 * whole unless --requests cuts it, and the run says so at its start. */
START_TEST(llm_trace_replayed_whole) {
  char path[PATH_MAX + 16], args[3 * PATH_MAX];
  snprintf(path, sizeof path, "%s/azure_long.csv", TMP);
  uint64_t prompt, output;
  write_trace(path, 260, 4, 1, &prompt, &output);
  static const char *const CUT[] = {"", "--requests 0", "--requests 30"};
  static const unsigned WANT[] = {260, 260, 30};
  for (int i = 0; i < 3; i++) {
    snprintf(args, sizeof args, "llm --layers 1 --kv-heads 1 --head-dim 16 --params 1e9 --trace %s --format azure "
             "--budget-bytes 4M --dry --json %s", path, CUT[i]);
    char *out, *err;
    ck_assert_int_eq(run_sim(args, &out, &err), 0);
    char want[96];
    snprintf(want, sizeof want, "replaying %s%u requests of", i == 2 ? "the first " : "all ", WANT[i]);
    ck_assert_msg(strstr(err, want) != NULL, "kvpool-sim %s: stderr \"%s\" lacks \"%s\"", args, err, want);
    json_t *j = json_loads(out, 0, NULL);
    ck_assert_ptr_nonnull(j);
    ck_assert_uint_eq(U(j, "requests_total"), WANT[i]);
    ck_assert_uint_eq(U(j, "requests_finished") + U(j, "rejected"), WANT[i]);
    if (i < 2) ck_assert_uint_eq(U(j, "prompt_tokens"), prompt);
    json_decref(j);
    free(out);
    free(err);
  }
}
END_TEST

/* Codecs with token groups or per-block side data run with the defaults. */
START_TEST(llm_codec_defaults) {
  static const char *const SPECS[] = {"kv=kivi:bits=2:group=32", "kv=qvg", "k=qvg-pro,v=kivi:bits=4:group=64"};
  for (int i = 0; i < 3; i++) {
    char args[256];
    snprintf(args, sizeof args, "llm --layers 2 --kv-heads 2 --head-dim 128 --params 1e9 --requests 4 --budget-bytes 64M "
             "--codecs %s --dry --json --quiet", SPECS[i]);
    json_t *j = run_json(args);
    ck_assert_uint_eq(U(j, "requests_finished"), 4);
    ck_assert_uint_eq(U(j, "budget_violations"), 0);
    json_decref(j);
  }
}
END_TEST

/* The shared traces through the simulator, each format (skipped when absent). */
static const char *const SHARED_TRACES[][2] = {
    {"../shared/traces/AzureLLMInferenceTrace_conv.csv", "azure"},
    {"../shared/traces/mooncake_conversation_trace.jsonl", "mooncake"},
    {"../shared/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv", "sharegpt"},
};

START_TEST(llm_shared_traces) {
  const char *path = SHARED_TRACES[_i][0], *fmt = SHARED_TRACES[_i][1];
  if (access(path, R_OK) != 0) {
    printf("check_sim: skipped the %s trace: %s not found\n", fmt, path);
    return;
  }
  char args[2 * PATH_MAX];
  /* a 4-layer model with Llama's KV heads: real lengths and arrivals, small bytes */
  snprintf(args, sizeof args, "llm --layers 4 --kv-heads 8 --head-dim 128 --params 8e9 --trace %s --format %s "
           "--requests 25 --budget-bytes 256M --max-batch-tokens 8192 --dry --json --quiet", path, fmt);
  json_t *j = run_json(args);
  ck_assert_uint_eq(U(j, "requests_total"), 25);
  ck_assert_uint_eq(U(j, "requests_finished") + U(j, "rejected"), 25);
  ck_assert_uint_gt(U(j, "requests_finished"), 0);
  ck_assert_uint_eq(U(j, "budget_violations"), 0);
  ck_assert_uint_le(U(j, "peak_allocated_bytes"), 256u << 20);
  printf("check_sim: %s trace, 25 requests: %llu finished, %llu preemptions, %.0f tokens/s simulated\n", fmt,
         (unsigned long long)U(j, "requests_finished"), (unsigned long long)U(j, "preemptions"),
         F(j, "throughput_tokens_per_s"));
  json_decref(j);
}
END_TEST

/* The whole Azure conversation trace (19,366 requests) with the defaults:
 * every row replayed (about 4 s on a small dry model); skipped when absent. */
START_TEST(llm_shared_trace_whole) {
  const char *path = SHARED_TRACES[0][0];
  if (access(path, R_OK) != 0) {
    printf("check_sim: skipped the whole azure trace: %s not found\n", path);
    return;
  }
  char args[2 * PATH_MAX];
  snprintf(args, sizeof args, "llm --layers 1 --kv-heads 1 --head-dim 16 --params 8e9 --trace %s --format azure "
           "--budget-bytes 64M --dry --json", path);
  char *out, *err;
  ck_assert_int_eq(run_sim(args, &out, &err), 0);
  ck_assert_msg(strstr(err, "replaying all 19366 requests"), "stderr: %s", err);
  json_t *j = json_loads(out, 0, NULL);
  ck_assert_ptr_nonnull(j);
  ck_assert_uint_eq(U(j, "requests_total"), 19366);
  ck_assert_uint_eq(U(j, "requests_finished") + U(j, "rejected"), 19366);
  ck_assert_uint_eq(U(j, "budget_violations"), 0);
  printf("check_sim: the whole azure trace: %llu requests finished\n", (unsigned long long)U(j, "requests_finished"));
  json_decref(j);
  free(out);
  free(err);
}
END_TEST

/* A budget too small for the batch: preemption by recompute, still all served. */
START_TEST(llm_preempts_under_pressure) {
  char path[PATH_MAX + 16], args[2 * PATH_MAX];
  snprintf(path, sizeof path, "%s/azure2.csv", TMP);
  uint64_t prompt, output;
  /* short prompts admitted together, then long outputs: 1 KiB per bf16 token, so 2 MiB holds
   * ~2000 tokens and 30 requests of ~100 + ~300 tokens collide while decoding */
  write_trace(path, 30, 1, 280, &prompt, &output);
  snprintf(args, sizeof args, "llm --layers 2 --kv-heads 2 --head-dim 64 --params 7e9 --trace %s --format azure "
           "--budget-bytes 2M --block-tokens 16 --check --json --quiet", path);
  json_t *j = run_json(args);
  ck_assert_uint_gt(U(j, "preemptions"), 0);
  ck_assert_uint_gt(U(j, "recomputed_tokens"), 0);
  ck_assert_uint_eq(U(j, "requests_finished") + U(j, "rejected"), 30);
  ck_assert_uint_eq(U(j, "rejected"), 0);
  ck_assert_uint_eq(U(j, "generated_tokens"), output);
  ck_assert_uint_eq(U(j, "budget_violations"), 0);
  json_decref(j);
}
END_TEST

/* ---- the store tier: llm --store against a private redis-server ---- */

static redis_srv R;
static int have_server;

static void store_setup(void) {
  have_server = redis_srv_start(&R) == 0;
  if (!have_server) printf("check_sim: skipped the store tier: %s\n", R.why);
}
static void store_teardown(void) {
  if (have_server) redis_srv_stop(&R);
}

/* Run a --store command; 0 and *j when it ran, 1 when the build has no
 * store tier (hiredis): skipped with a message. */
static int run_store(const char *args, json_t **j) {
  char *out, *err;
  int rc = run_sim(args, &out, &err);
  if (rc && strstr(err, "KVP_ENOTSUP") && strstr(err, "kvp_store_open")) {
    printf("check_sim: skipped the store tier: %s", err);
    free(out), free(err);
    return 1;
  }
  ck_assert_msg(rc == 0, "kvpool-sim %s exited %d: %s", args, rc, err);
  json_error_t je;
  *j = json_loads(out, 0, &je);
  ck_assert_msg(*j && json_is_object(*j), "kvpool-sim %s: not one JSON object (%s): %.200s", args, je.text, out);
  free(out), free(err);
  return 0;
}

/* A mooncake-format trace of conversations: request i is turn i / 8 of
 * conversation i % 8; every prompt starts with block 0 (a shared system
 * prompt), then its conversation's block, then one of its own. Arrivals
 * 100 ms apart; long outputs collide in a small budget. */
static void write_mooncake(const char *path, int n, uint64_t *prompt) {
  FILE *f = fopen(path, "wb");
  ck_assert_ptr_nonnull(f);
  *prompt = 0;
  for (int i = 0; i < n; i++) {
    unsigned in = 1030 + (unsigned)(i * 37) % 500, out = 300 + (unsigned)(i * 13) % 100; /* 3 blocks of 512 */
    fprintf(f, "{\"timestamp\": %d, \"input_length\": %u, \"output_length\": %u, \"hash_ids\": [0, %d, %d]}\n", i * 100,
            in, out, 100 + i % 8, 1000 + i);
    *prompt += in;
  }
  fclose(f);
}

/* Keys of the baseline that must equal a run without --store: the store
 * changes nothing of the recompute run it is compared with. */
static const char *const BASE_KEYS[] = {"requests_finished", "preemptions", "recomputed_tokens", "iterations",
                                        "generated_tokens", "peak_allocated_bytes", "max_running"};

/* A store capped below what the server already holds (max_bytes=1):
 * every offload is refused and recomputed instead, every publish stops,
 * nothing is written; every request is still served. */
START_TEST(llm_store_max_bytes) {
  if (!have_server) return;
  char path[PATH_MAX + 16], args[5 * PATH_MAX];
  snprintf(path, sizeof path, "%s/capped.jsonl", TMP);
  uint64_t prompt;
  write_mooncake(path, 32, &prompt);
  snprintf(args, sizeof args, "llm --layers 2 --kv-heads 1 --head-dim 64 --params 7e9 --trace %s --format mooncake "
           "--budget-bytes 2M --block-tokens 16 --check --json --quiet --store %s?max_bytes=1", path, R.url);
  json_t *j;
  if (run_store(args, &j)) return;
  ck_assert_uint_eq(U(j, "store_requests_finished"), 32);
  ck_assert_uint_eq(U(j, "store_swapped_out"), 0);
  ck_assert_uint_gt(U(j, "store_offload_fallbacks"), 0);
  ck_assert_uint_gt(U(j, "store_publish_refusals"), 0);
  ck_assert_uint_eq(U(j, "store_prefix_tokens"), 0);
  ck_assert_uint_eq(U(j, "store_sent_bytes"), 0);
  ck_assert_uint_eq(U(j, "store_budget_violations"), 0);
  json_decref(j);
}
END_TEST

START_TEST(llm_store_swaps_and_shares) {
  if (!have_server) return;
  char path[PATH_MAX + 16], args[5 * PATH_MAX], base[4 * PATH_MAX], run[3 * PATH_MAX];
  snprintf(path, sizeof path, "%s/mooncake.jsonl", TMP);
  uint64_t prompt;
  write_mooncake(path, 32, &prompt);
  /* 2 layers x 1 head x 64 x 2 bytes x 2 = 512 bytes per token: 2 MiB holds ~4000 tokens, 2 or 3 requests */
  snprintf(run, sizeof run, "llm --layers 2 --kv-heads 1 --head-dim 64 --params 7e9 --trace %s --format mooncake "
           "--budget-bytes 2M --block-tokens 16 --check", path);
  snprintf(base, sizeof base, "%s --json --quiet", run);
  snprintf(args, sizeof args, "%s --store %s", base, R.url);
  json_t *j;
  if (run_store(args, &j)) return;
  ck_assert_uint_eq(U(j, "requests_total"), 32);
  ck_assert_uint_eq(U(j, "prompt_tokens"), prompt);
  /* the baseline recomputes; the store run swaps instead */
  ck_assert_uint_gt(U(j, "preemptions"), 0);
  ck_assert_uint_gt(U(j, "recomputed_tokens"), 0);
  ck_assert_uint_gt(U(j, "store_swapped_out"), 0);
  ck_assert_uint_eq(U(j, "store_swapped_in"), U(j, "store_swapped_out"));
  ck_assert_uint_eq(U(j, "store_offload_fallbacks"), 0);
  ck_assert(F(j, "recomputed_tokens_saved") > 0);
  ck_assert_uint_eq(F(j, "recomputed_tokens_saved"), U(j, "recomputed_tokens") - U(j, "store_recomputed_tokens"));
  /* prefixes: block 0 from the pool while another request holds it, finished conversations from the store */
  ck_assert_uint_gt(U(j, "prefix_hit_tokens"), 0);
  ck_assert_uint_gt(U(j, "store_prefix_tokens"), 0);
  ck_assert_uint_eq(U(j, "prefix_hit_tokens") % 16, 0); /* whole blocks */
  /* every prefill token is computed, attached, or a recompute: nothing lost, nothing twice */
  ck_assert_uint_eq(U(j, "prefill_tokens"), prompt + U(j, "recomputed_tokens"));
  ck_assert_uint_eq(U(j, "store_prefill_tokens") + U(j, "prefix_hit_tokens") + U(j, "store_prefix_tokens"),
                    prompt + U(j, "store_recomputed_tokens"));
  ck_assert(F(j, "prefill_tokens_saved") > 0);
  ck_assert_uint_gt(U(j, "store_sent_bytes"), 0);
  ck_assert_uint_gt(U(j, "store_received_bytes"), 0);
  ck_assert(F(j, "store_time_s") > 0);
  ck_assert(F(j, "store_ttft_mean_s") > 0);
  ck_assert_double_eq_tol(F(j, "ttft_mean_change_s"), F(j, "store_ttft_mean_s") - F(j, "ttft_mean_s"), 1e-9);
  /* every request served, under the budget, the pool's check after every iteration (--check) */
  ck_assert_uint_eq(U(j, "store_requests_finished"), 32);
  ck_assert_uint_eq(U(j, "store_rejected"), 0);
  ck_assert_uint_eq(U(j, "store_budget_violations"), 0);
  ck_assert_uint_le(U(j, "store_peak_allocated_bytes"), 2u << 20);
  /* the baseline is the run without --store */
  json_t *b = run_json(base);
  for (size_t k = 0; k < sizeof BASE_KEYS / sizeof *BASE_KEYS; k++)
    ck_assert_msg(U(b, BASE_KEYS[k]) == U(j, BASE_KEYS[k]), "%s: %llu without --store, %llu as the baseline",
                  BASE_KEYS[k], (unsigned long long)U(b, BASE_KEYS[k]), (unsigned long long)U(j, BASE_KEYS[k]));
  ck_assert_double_eq(F(b, "ttft_mean_s"), F(j, "ttft_mean_s"));
  ck_assert_ptr_null(json_object_get(b, "store_swapped_out"));
  json_decref(b);
  json_decref(j);
  /* the table shows both columns */
  char *out, *err;
  snprintf(args, sizeof args, "%s --store %s", run, R.url);
  ck_assert_int_eq(run_sim(args, &out, &err), 0);
  ck_assert_msg(strstr(out, "recompute") && strstr(out, "swapped out") && strstr(out, "from the store") &&
                    strstr(out, "TTFT mean"),
                "table: %s", out);
  free(out), free(err);
}
END_TEST

/* The published mooncake conversation trace, cut to its first requests. */
START_TEST(llm_store_mooncake_trace) {
  if (!have_server) return;
  const char *path = SHARED_TRACES[1][0];
  if (access(path, R_OK) != 0) {
    printf("check_sim: skipped the store run of the mooncake trace: %s not found\n", path);
    return;
  }
  char args[3 * PATH_MAX];
  snprintf(args, sizeof args, "llm --layers 2 --kv-heads 2 --head-dim 64 --params 8e9 --trace %s --format mooncake "
           "--requests %d --budget-bytes 32M --max-batch-tokens 8192 --json --quiet --store %s", path, MOONCAKE_REQS, R.url);
  json_t *j;
  double t0 = sim_wall();
  if (run_store(args, &j)) return;
  ck_assert_uint_eq(U(j, "store_requests_finished") + U(j, "store_rejected"), MOONCAKE_REQS);
  ck_assert_uint_eq(U(j, "store_budget_violations"), 0);
  ck_assert_uint_eq(U(j, "store_offload_fallbacks"), 0);
  ck_assert_uint_eq(U(j, "store_swapped_in"), U(j, "store_swapped_out"));
  ck_assert_uint_gt(U(j, "prefix_hit_tokens"), 0); /* the trace's shared first block */
  ck_assert(F(j, "prefill_tokens_saved") > 0);
  printf("check_sim: mooncake trace with --store, %d requests in %.1f s: %llu swapped out, %.0f recompute tokens "
         "saved, %llu + %llu prefix tokens attached (pool + store), TTFT %.3f -> %.3f s\n", MOONCAKE_REQS,
         sim_wall() - t0, (unsigned long long)U(j, "store_swapped_out"), F(j, "recomputed_tokens_saved"),
         (unsigned long long)U(j, "prefix_hit_tokens"), (unsigned long long)U(j, "store_prefix_tokens"),
         F(j, "ttft_mean_s"), F(j, "store_ttft_mean_s"));
  json_decref(j);
}
END_TEST

START_TEST(llm_synthetic_presets) {
  json_t *j = run_json("llm --model llama-2-7b --requests 6 --prompt-median 64 --output-median 8 --max-prompt 128 "
                       "--max-output 16 --budget-bytes 256M --json --quiet");
  ck_assert_uint_eq(U(j, "n_layers"), 32);
  ck_assert_uint_eq(U(j, "n_kv_heads"), 32);
  ck_assert_uint_eq(U(j, "requests_finished"), 6);
  ck_assert_uint_eq(U(j, "budget_violations"), 0);
  /* raw bf16 pages: a 16-token block of one head is 4 KiB, a class of its own: no rounding at the peak */
  ck_assert_uint_gt(U(j, "peak_requested_bytes"), 0);
  ck_assert_uint_le(U(j, "peak_requested_bytes"), U(j, "peak_allocated_bytes"));
  ck_assert_double_le((double)U(j, "peak_allocated_bytes") / (double)U(j, "peak_requested_bytes"), 1.01);
  json_decref(j);
  j = run_json("llm --model llama-2-70b --requests 2 --prompt-median 16 --output-median 4 --max-prompt 32 "
               "--max-output 8 --budget-bytes 64M --json --quiet");
  ck_assert_uint_eq(U(j, "n_layers"), 80);
  ck_assert_uint_eq(U(j, "n_kv_heads"), 8);
  ck_assert_uint_eq(U(j, "requests_finished"), 2);
  json_decref(j);
}
END_TEST

/* Dry mode plans the same pages: every byte figure equals the real run's. */
START_TEST(dry_plans_the_same_bytes) {
  static const char *const KEYS[] = {"full_cache_bytes", "peak_allocated_bytes", "peak_requested_bytes",
                                     "policy_budget", "images_that_fit"};
  const char *args = "var --layers 6 --kv-heads 2 --head-dim 64 --codecs k=kivi:bits=2,v=nvfp4 "
                     "--policy heatkv:b=0.1:s=3:orders=synthetic:unit=bytes --budget-bytes 64M --json --quiet";
  char dry[512];
  snprintf(dry, sizeof dry, "%s --dry", args);
  json_t *a = run_json(args), *b = run_json(dry);
  ck_assert_uint_eq(U(a, "dry"), 0);
  ck_assert_uint_eq(U(b, "dry"), 1);
  for (size_t i = 0; i < sizeof KEYS / sizeof *KEYS; i++) ck_assert_uint_eq(U(a, KEYS[i]), U(b, KEYS[i]));
  ck_assert_uint_eq(U(b, "budget_violations"), 0);
  json_decref(a);
  json_decref(b);
  static const char *const LKEYS[] = {"requests_finished", "preemptions", "max_running", "peak_allocated_bytes",
                                      "generated_tokens", "iterations"};
  args = "llm --layers 2 --kv-heads 2 --head-dim 64 --params 7e9 --requests 40 --rate 50 --prompt-median 100 "
         "--output-median 50 --budget-bytes 2M --codecs kv=fp8 --json --quiet";
  snprintf(dry, sizeof dry, "%s --dry", args);
  a = run_json(args), b = run_json(dry);
  for (size_t i = 0; i < sizeof LKEYS / sizeof *LKEYS; i++) ck_assert_uint_eq(U(a, LKEYS[i]), U(b, LKEYS[i]));
  json_decref(a);
  json_decref(b);
}
END_TEST

static const struct bad_run {
  const char *args;
  int rc;
  const char *want;
} BAD_RUNS[] = {
    {"llm --frobnicate 1", 2, "unknown option --frobnicate"},
    {"llm --budget-bytes 12Q", 2, "--budget-bytes 12Q"},
    {"llm --trace /no/such/file.csv --format azure", 1, "/no/such/file.csv"},
    {"llm --trace /dev/null", 2, "--format"},
    {"llm --trace /dev/null --format csv", 2, "--format csv"},
    {"llm --trace /dev/null --format azure", 1, "empty file"},
    {"llm --codecs k=nope --requests 1", 1, "nope"},
    {"llm --codecs kv=kivi:bits=2:grp=32 --requests 1", 1, "unknown parameter 'grp'"},
    {"llm --codecs kv=kivi:bits=2:group=32 --block-tokens 16 --requests 1", 1, "32 would be"},
    {"llm --codecs kv=qvg --block-tokens 16 --requests 1", 1, "compresses from block_tokens = 297"},
    {"llm --requests -5", 2, "--requests -5"},
    {"llm --store redis://127.0.0.1:1 --policy window:sink=4:recent=64", 2, "--policy"},
    {"llm --store redis://127.0.0.1:1 --dry", 2, "--dry"},
    {"var --model infinity-3b", 2, "infinity-3b"},
    {"var --schedule 1,0,4", 2, "--schedule"},
    {"var --layers 2 --kv-heads 1 --head-dim 16 --policy heatkv:b=0.001:s=3:orders=synthetic", 1, "b=0.001"},
    {"video --chunks 0", 2, "--chunks 0"},
    {"video --layers 1 --kv-heads 1 --head-dim 16 --tokens-per-frame 4 --chunks 2 --csv /no/such/dir/x.csv", 1,
     "/no/such/dir/x.csv"},
    {"paint", 2, "unknown subcommand"},
};

START_TEST(errors_exit_nonzero_with_a_message) {
  const struct bad_run *b = &BAD_RUNS[_i];
  char *out, *err;
  int rc = run_sim(b->args, &out, &err);
  ck_assert_msg(rc == b->rc, "kvpool-sim %s exited %d, expected %d (%s)", b->args, rc, b->rc, err);
  ck_assert_msg(strstr(err, b->want) != NULL, "kvpool-sim %s: stderr \"%s\" lacks \"%s\"", b->args, err, b->want);
  free(out);
  free(err);
}
END_TEST

START_TEST(help_per_subcommand) {
  static const char *const SUBS[] = {"--help", "llm --help", "var --help", "video --help"};
  for (int i = 0; i < 4; i++) {
    char *out, *err;
    ck_assert_int_eq(run_sim(SUBS[i], &out, &err), 0);
    ck_assert(strstr(out, "usage: kvpool-sim") != NULL);
    if (i) ck_assert(strstr(out, "--json") != NULL && strstr(out, "--dry") != NULL && strstr(out, "--csv") != NULL);
    free(out);
    free(err);
  }
}
END_TEST

int main(int argc, char **argv) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return fprintf(stderr, "check_sim: cannot find myself\n"), 1;
  self[n] = 0;
  snprintf(SIM, sizeof SIM, "%s/../kvpool-sim", dirname(self));
  if (access(SIM, X_OK) != 0) return fprintf(stderr, "check_sim: %s not built\n", SIM), 1;
  snprintf(TMP, sizeof TMP, "/tmp/check_sim.XXXXXX");
  if (!mkdtemp(TMP)) return perror("mkdtemp"), 1;
  Suite *s = suite_create("sim");
  TCase *tc = tcase_create("sim");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, var_raw_full_cache_from_geometry);
  tcase_add_test(tc, var_infinity_2b_heatkv_nvfp4);
  tcase_add_test(tc, var_infinity_8b_dry_preset);
  tcase_add_test(tc, var_raw_dtypes_and_csv);
  tcase_add_loop_test(tc, var_heatkv_no_violations, 0, (int)(sizeof POLICIES / sizeof *POLICIES));
  tcase_add_loop_test(tc, video_policies, 0, (int)(sizeof VIDEO_POLICIES / sizeof *VIDEO_POLICIES));
  tcase_add_loop_test(tc, llm_trace_served, 0, (int)(sizeof LLM_CASES / sizeof *LLM_CASES));
  tcase_add_test(tc, llm_preempts_under_pressure);
  tcase_add_loop_test(tc, llm_shared_traces, 0, 3);
  tcase_add_test(tc, llm_trace_replayed_whole);
  tcase_add_test(tc, llm_codec_defaults);
  tcase_add_test(tc, llm_shared_trace_whole);
  tcase_add_test(tc, llm_synthetic_presets);
  tcase_add_test(tc, dry_plans_the_same_bytes);
  tcase_add_loop_test(tc, errors_exit_nonzero_with_a_message, 0, (int)(sizeof BAD_RUNS / sizeof *BAD_RUNS));
  tcase_add_test(tc, help_per_subcommand);
  suite_add_tcase(s, tc);
  TCase *ts = tcase_create("store"); /* one private redis-server for the tcase */
  tcase_set_timeout(ts, 120);
  tcase_add_unchecked_fixture(ts, store_setup, store_teardown);
  tcase_add_test(ts, llm_store_swaps_and_shares);
  tcase_add_test(ts, llm_store_max_bytes);
  tcase_add_test(ts, llm_store_mooncake_trace);
  suite_add_tcase(s, ts);
  int rc = it_run(s);
  char cmd[PATH_MAX + 16];
  snprintf(cmd, sizeof cmd, "rm -rf %s", TMP);
  if (system(cmd) != 0) fprintf(stderr, "check_sim: could not remove %s\n", TMP);
  (void)argc, (void)argv;
  return rc;
}
