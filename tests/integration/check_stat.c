/*
 * tests/integration/check_stat.c - kvpool-stat, run as a program on small
 * embedded samples: a JSON snapshot (a hand-written one and one a live pool
 * writes), CSV time series (columns in any order, extra columns, CR before
 * LF, no final newline), diffs, the plot, and every kind of bad input and
 * option (clear message, non-zero exit). The binary is found beside the
 * test directory (build/kvpool-stat for build/tests/check_stat).
 */
#include <check.h>
#include <jansson.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itest.h"
#include "kvpool.h"

static char tool[PATH_MAX], dir[] = "/tmp/kvpool-check-stat-XXXXXX";
static char out_text[1 << 16], err_text[1 << 14];

static void slurp(const char *path, char *buf, size_t cap) {
  FILE *f = fopen(path, "r");
  size_t n = f ? fread(buf, 1, cap - 1, f) : 0;
  buf[n] = 0;
  if (f) fclose(f);
}

/* Run kvpool-stat with args (shell words); stdout and stderr captured. */
static int run(const char *args) {
  char cmd[PATH_MAX * 3];
  snprintf(cmd, sizeof cmd, "cd '%s' && '%s' %s >out.txt 2>err.txt", dir, tool, args);
  int st = system(cmd);
  char p[PATH_MAX + 16];
  snprintf(p, sizeof p, "%s/out.txt", dir);
  slurp(p, out_text, sizeof out_text);
  snprintf(p, sizeof p, "%s/err.txt", dir);
  slurp(p, err_text, sizeof err_text);
  ck_assert_msg(WIFEXITED(st), "kvpool-stat %s did not exit normally", args);
  return WEXITSTATUS(st);
}

static void put_file(const char *name, const char *text) {
  char p[PATH_MAX + 64];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  FILE *f = fopen(p, "w");
  ck_assert_ptr_nonnull(f);
  fputs(text, f);
  fclose(f);
}

static json_t *out_json(void) {
  json_error_t e;
  json_t *j = json_loads(out_text, 0, &e);
  ck_assert_msg(j != NULL, "--json output does not parse (%s): %.300s", e.text, out_text);
  return j;
}

static double jget(json_t *j, const char *path) {
  char seg[64];
  while (j && *path) {
    size_t n = strcspn(path, "/");
    memcpy(seg, path, n);
    seg[n] = 0;
    path += n + (path[n] == '/');
    j = json_is_array(j) ? json_array_get(j, (size_t)atoi(seg)) : json_object_get(j, seg);
  }
  ck_assert_msg(json_is_number(j), "no number at the path");
  return json_number_value(j);
}

#define SLICE(r, a, p) "{\"requested_bytes\":" #r ",\"allocated_bytes\":" #a ",\"pages\":" #p "}"
#define GAUGE(c) "{\"current\":" #c ",\"peak\":" #c ",\"total\":" #c "}"
static const char snap_a[] =
    "{\"version\":1,\"bytes.requested\":" GAUGE(3000000) ",\"bytes.allocated\":" GAUGE(3145728)
    ",\"bytes.committed\":" GAUGE(4194304) ",\"bytes.reserved\":67108864,\"bytes.budget\":33554432,"
    "\"ops.allocs\":40,\"tokens.evicted\":0,\"bytes.bf16_equivalent\":" GAUGE(11010048)
    ",\"device.used_bytes\":4194304,\"device.total_bytes\":67108864,\"savings.ratio\":3.5,\"savings.bytes\":7864320,"
    "\"page_types\":{\"raw\":" SLICE(0, 0, 0) ",\"codes\":" SLICE(2800000, 2883584, 30) ",\"scales\":" SLICE(200000, 262144, 10)
    "},\"kv\":{\"k\":" SLICE(1500000, 1572864, 20) ",\"v\":" SLICE(1500000, 1572864, 20) "},\"layers\":[" SLICE(1500000, 1572864, 20)
    "," SLICE(1500000, 1572864, 20) "],\"heads\":[" SLICE(3000000, 3145728, 40) "],\"codecs\":{\"4\":{\"name\":\"nvfp4\","
    "\"requested_bytes\":3000000,\"allocated_bytes\":3145728,\"pages\":40}},\"sequences\":{\"9\":" SLICE(1000000, 1048576, 10)
    ",\"3\":" SLICE(1000000, 1048576, 10) ",\"12\":" SLICE(1000000, 1048576, 20) "}}\n";

START_TEST(snapshot_table_and_json) {
  put_file("a.json", snap_a);
  ck_assert_int_eq(run("a.json"), 0);
  ck_assert_ptr_nonnull(strstr(out_text, "by page type"));
  ck_assert_ptr_nonnull(strstr(out_text, "3.00 MiB")); /* bytes.allocated in units */
  ck_assert_ptr_nonnull(strstr(out_text, "3.500x"));
  ck_assert_ptr_nonnull(strstr(out_text, "nvfp4 (id 4)"));
  ck_assert_msg(run("--json --top 2 a.json") == 0, "%s", err_text);
  json_t *j = out_json();
  ck_assert_double_eq(jget(j, "allocated_bytes"), 3145728);
  ck_assert_double_eq(jget(j, "savings_ratio"), 3.5);
  ck_assert_double_eq(jget(j, "allocated_by_page_type/codes"), 2883584);
  json_t *top = json_object_get(j, "top_sequences");
  ck_assert_uint_eq(json_array_size(top), 2); /* --top 2; ties by id: 3 before 9 */
  ck_assert_str_eq(json_string_value(json_object_get(json_array_get(top, 0), "seq")), "3");
  ck_assert_str_eq(json_string_value(json_object_get(json_array_get(top, 1), "seq")), "9");
  json_decref(j);
}
END_TEST

/* What a live pool writes, read back: the figures agree with kvp_stats_get. */
START_TEST(snapshot_from_a_pool) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 2;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.codecs = "kv=int8";
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  static uint16_t kv[48 * 2 * 64];
  for (size_t i = 0; i < sizeof kv / sizeof *kv; i++) kv[i] = (uint16_t)(0x3f80 + i % 50);
  for (uint64_t s = 1; s <= 3; s++) {
    ck_ok(kvp_seq_add(p, s, NULL));
    ck_ok(kvp_step_begin(p, s, (uint32_t)(16 * s), 0)); /* whole blocks: bytes grow with s */
    for (uint32_t l = 0; l < 2; l++) {
      kvp_kv x = {kv, kv, NULL};
      ck_ok(kvp_append(p, s, l, &x));
    }
    ck_ok(kvp_step_end(p, s));
  }
  static char buf[1 << 16];
  size_t len;
  ck_ok(kvp_stats_write(p, KVP_STATS_JSON, buf, sizeof buf, &len));
  put_file("live.json", buf);
  kvp_stats st = {.struct_size = sizeof st};
  ck_ok(kvp_stats_get(p, &st));
  ck_assert_int_eq(run("--json live.json"), 0);
  json_t *j = out_json();
  ck_assert_double_eq(jget(j, "allocated_bytes"), (double)st.bytes_allocated.current);
  ck_assert_double_eq(jget(j, "bf16_equivalent_bytes"), (double)st.bf16_equivalent_bytes.current);
  ck_assert_double_eq(jget(j, "allocated_by_page_type/scales"), (double)st.page_types[KVP_PAGE_SCALES].allocated_bytes);
  ck_assert_str_eq(json_string_value(json_object_get(json_array_get(json_object_get(j, "top_sequences"), 0), "seq")),
                   "3");
  json_decref(j);
  ck_assert_int_eq(run("live.json"), 0);
  ck_assert_ptr_nonnull(strstr(out_text, "int8"));
  kvp_pool_destroy(p);
}
END_TEST

START_TEST(diff_two_snapshots) {
  put_file("a.json", snap_a);
  char b[sizeof snap_a + 64];
  snprintf(b, sizeof b, "%s", snap_a);
  char *at = strstr(b, "\"ops.allocs\":40");
  ck_assert_ptr_nonnull(at);
  memcpy(at, "\"ops.allocs\":47", 15);
  put_file("b.json", b);
  ck_assert_int_eq(run("diff --json a.json b.json"), 0);
  json_t *j = out_json();
  json_t *f = json_object_get(j, "figures");
  ck_assert_double_eq(jget(f, "ops.allocs/delta"), 7);
  ck_assert_double_eq(jget(f, "ops.allocs/a"), 40);
  ck_assert_ptr_null(json_object_get(f, "bytes.allocated.current")); /* unchanged: not listed */
  json_decref(j);
  ck_assert_int_eq(run("diff --json --all a.json b.json"), 0);
  j = out_json();
  ck_assert_double_eq(jget(json_object_get(j, "figures"), "sequences.12.pages/b"), 20);
  json_decref(j);
  ck_assert_int_eq(run("diff a.json b.json"), 0);
  ck_assert_ptr_nonnull(strstr(out_text, "ops.allocs"));
  ck_assert_ptr_nonnull(strstr(out_text, "+17.5%"));
  ck_assert_int_eq(run("diff a.json a.json"), 0);
  ck_assert_ptr_nonnull(strstr(out_text, "no figure differs"));
}
END_TEST

/* Columns by name, in another order, with an extra column, CR LF, and no
 * final newline. */
static const char csv_b[] =
    "sim_time_s,iter,allocated_bytes,extra_col,budget_bytes,bf16_equivalent_bytes,alloc_codes,alloc_raw,"
    "device_used_bytes\r\n"
    "0.0,0,1048576,7,4194304,2097152,0,1048576,8388608\r\n"
    "0.5,1,3145728,7,4194304,9437184,2097152,1048576,8388608\r\n"
    "1.0,2,2097152,7,4194304,6291456,1048576,1048576,8388608";

START_TEST(series_table_and_json) {
  put_file("s.csv", csv_b);
  ck_assert_int_eq(run("--json s.csv"), 0);
  json_t *j = out_json();
  ck_assert_double_eq(jget(j, "rows"), 3);
  ck_assert_double_eq(jget(j, "peak_allocated_bytes"), 3145728);
  ck_assert_double_eq(jget(j, "columns/alloc_codes/max"), 2097152);
  ck_assert_double_eq(jget(j, "columns/extra_col/final"), 7);
  ck_assert_double_eq(jget(j, "rows_over_budget"), 0);
  ck_assert_double_eq_tol(jget(j, "savings_ratio_over_run"), (2 + 9 + 6) / 6.0, 1e-9);
  json_decref(j);
  ck_assert_int_eq(run("s.csv"), 0);
  ck_assert_ptr_nonnull(strstr(out_text, "3 rows"));
  ck_assert_ptr_nonnull(strstr(out_text, "peak allocated 3.00 MiB of a 4.00 MiB budget (75.0%)"));
}
END_TEST

START_TEST(plot_png) {
  if (system("command -v gnuplot >/dev/null 2>&1") != 0) {
    printf("plot_png: skipped: gnuplot is not installed (make deps installs gnuplot-nox)\n");
    return;
  }
  char csv[1 << 15] = "iter,sim_time_s,running,allocated_bytes,budget_bytes,bf16_equivalent_bytes,device_used_bytes,"
                      "alloc_raw,alloc_codes,alloc_scales\n";
  for (int i = 0; i < 100; i++) {
    size_t n = strlen(csv);
    long codes = 1000000L * i, scales = codes / 16, raw = 500000;
    snprintf(csv + n, sizeof csv - n, "%d,%.2f,%d,%ld,%ld,%ld,%ld,%ld,%ld,%ld\n", i, i * 0.1, i % 9,
             raw + codes + scales, 200000000L, 3 * codes + raw, 268435456L, raw, codes, scales);
  }
  put_file("p.csv", csv);
  ck_assert_int_eq(run("--plot 'out plot.png' --title 'a title' p.csv"), 0);
  char p[PATH_MAX + 32];
  snprintf(p, sizeof p, "%s/out plot.png", dir);
  struct stat st;
  ck_assert_int_eq(stat(p, &st), 0);
  ck_assert_int_gt(st.st_size, 10000);
  unsigned char sig[8] = {0};
  FILE *f = fopen(p, "rb");
  ck_assert_ptr_nonnull(f);
  ck_assert_uint_eq(fread(sig, 1, 8, f), 8);
  fclose(f);
  ck_assert_mem_eq(sig, "\x89PNG\r\n\x1a\n", 8);
  ck_assert_ptr_nonnull(strstr(err_text, "MiB")); /* units chosen from the data */
  put_file("a.json", snap_a);
  ck_assert_int_eq(run("--plot x.png a.json"), 1);
  ck_assert_ptr_nonnull(strstr(err_text, "CSV"));
}
END_TEST

/* Bad input: exit 1 and a message naming the file (and line, column). */
START_TEST(bad_files) {
  static const struct {
    const char *name, *text, *want;
  } bad[] = {
      {"trunc.json", "{\"version\":1,\"bytes.allocated\":{\"current\":", "not valid JSON"},
      {"other.json", "{\"hello\":1}", "not a kvpool stats snapshot"},
      {"nohdr.csv", "1,2,3\n4,5,6\n", "not a kvpool-sim CSV"},
      {"fields.csv", "iter,allocated_bytes\n0,1\n1,2,3\n", "fields.csv:3: 3 fields, the header has 2"},
      {"nan.csv", "iter,allocated_bytes\n0,abc\n", "\"abc\" is not a finite number"},
      {"empty.csv", "", "empty file"},
      {"hdronly.csv", "iter,allocated_bytes\n", "no rows"},
      {"dup.csv", "iter,iter,allocated_bytes\n0,0,1\n", "twice"},
      /* garbage that parses: negative, fractional and out-of-range counts, bad gauges */
      {"neg.csv", "iter,allocated_bytes\n0,-5\n", "\"-5\" is not a count"},
      {"frac.csv", "iter,allocated_bytes,budget_bytes\n0,1,2.5\n", "column \"budget_bytes\": \"2.5\" is not a count"},
      {"huge.csv", "iter,allocated_bytes\n0,99999999999999999999999\n", "is not a count"},
      {"negiter.csv", "iter,allocated_bytes\n-1,5\n", "column \"iter\""},
      {"negtime.csv", "iter,sim_time_s,allocated_bytes\n0,-2,5\n", "sim_time_s"},
      {"neg.json", "{\"version\":1,\"bytes.allocated\":{\"current\":-7,\"peak\":0,\"total\":0}}",
       "\"bytes.allocated.current\" = -7"},
      {"gauge.json", "{\"version\":1,\"bytes.allocated\":1e30}", "\"bytes.allocated\": malformed"},
      {"ver.json", "{\"version\":\"two\",\"bytes.allocated\":{\"current\":1}}", "\"version\": not one"},
      {"page.json", "{\"version\":1,\"bytes.allocated\":{\"current\":1},\"page_types\":{\"raw\":{\"bytes_allocated\":-1}}}",
       "page_types.raw.bytes_allocated"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    const char *name = bad[i].name;
    put_file(name, bad[i].text);
    char args[64];
    snprintf(args, sizeof args, "%s", name);
    ck_assert_msg(run(args) == 1, "%s: exit status", name);
    ck_assert_msg(strstr(err_text, bad[i].want) && strstr(err_text, name), "%s: message \"%s\"", name, err_text);
  }
  ck_assert_int_eq(run("no-such-file.json"), 1);
  ck_assert_ptr_nonnull(strstr(err_text, "no-such-file.json"));
  put_file("a.json", snap_a);
  put_file("s.csv", csv_b);
  ck_assert_int_eq(run("diff a.json s.csv"), 1);
  ck_assert_ptr_nonnull(strstr(err_text, "s.csv"));
}
END_TEST

START_TEST(options) {
  ck_assert_int_eq(run("--help"), 0);
  ck_assert_ptr_nonnull(strstr(out_text, "usage: kvpool-stat"));
  ck_assert_ptr_nonnull(strstr(out_text, "--plot"));
  put_file("a.json", snap_a);
  static const char *const bad[] = {"--bogus a.json", "", "--top 0 a.json", "--top x a.json", "--plot",
                                    "diff a.json", "a.json a.json", "diff a.json a.json a.json"};
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
    ck_assert_msg(run(bad[i]) == 2, "\"%s\" should be a usage error", bad[i]);
    ck_assert_msg(strstr(err_text, "kvpool-stat --help") != NULL, "\"%s\": %s", bad[i], err_text);
  }
}
END_TEST

static void setup(void) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  ck_assert_int_gt(n, 0);
  self[n] = 0;
  snprintf(tool, sizeof tool, "%s/../kvpool-stat", dirname(self));
  ck_assert_msg(access(tool, X_OK) == 0, "%s is not built (make builds it before the tests)", tool);
  ck_assert_ptr_nonnull(mkdtemp(strcpy(dir, "/tmp/kvpool-check-stat-XXXXXX")));
}

static void teardown(void) {
  char cmd[PATH_MAX + 16];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}

int main(void) {
  Suite *s = suite_create("kvpool-stat");
  TCase *t = tcase_create("stat");
  tcase_add_checked_fixture(t, setup, teardown);
  tcase_add_test(t, snapshot_table_and_json);
  tcase_add_test(t, snapshot_from_a_pool);
  tcase_add_test(t, diff_two_snapshots);
  tcase_add_test(t, series_table_and_json);
  tcase_add_test(t, plot_png);
  tcase_add_test(t, bad_files);
  tcase_add_test(t, options);
  tcase_set_timeout(t, 60);
  suite_add_tcase(s, t);
  return it_run(s);
}
