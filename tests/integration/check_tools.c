/*
 * tests/integration/check_tools.c - kvpool-demo and kvpool-bench as a new
 * user meets them: --help on stdout with status 0, and a bad argument
 * named on stderr with status 2 (never ignored, never a run with defaults).
 * kvpool-stat, kvpool-calib and kvpool-sim have their own suites
 * (check_stat, check_heatkv_calib and check_kvquant, check_sim).
 */
#include <check.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static char BUILD[PATH_MAX];
static char OUT[1 << 16], ERR[1 << 14];

/* Run build/<tool> args; stdout into OUT, stderr into ERR; the exit status. */
static int run(const char *tool, const char *args) {
  char cmd[2 * PATH_MAX], ef[64];
  snprintf(ef, sizeof ef, "/tmp/check_tools.%d.err", (int)getpid());
  snprintf(cmd, sizeof cmd, "%s/%s %s 2>%s", BUILD, tool, args, ef);
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  size_t n = fread(OUT, 1, sizeof OUT - 1, p);
  OUT[n] = 0;
  int st = pclose(p);
  FILE *f = fopen(ef, "r");
  n = f ? fread(ERR, 1, sizeof ERR - 1, f) : 0;
  ERR[n] = 0;
  if (f) fclose(f);
  unlink(ef);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static const struct bad {
  const char *tool, *args, *want;
} BAD[] = {
    {"kvpool-demo", "--frob", "unknown argument \"--frob\""},
    {"kvpool-demo", "--json extra", "unknown argument \"extra\""}, /* was ignored: a run with defaults */
    {"kvpool-bench", "--frob", "unknown argument \"--frob\""},
    {"kvpool-bench", "--quick 5", "unknown argument \"5\""},
    {"kvpool-bench", "--codecs --alloc", "give one"}, /* was: --codecs ran, --alloc silently dropped */
};

START_TEST(bad_arguments_named) {
  const struct bad *b = &BAD[_i];
  int rc = run(b->tool, b->args);
  ck_assert_msg(rc == 2, "%s %s exited %d (stderr: %s)", b->tool, b->args, rc, ERR);
  ck_assert_msg(strstr(ERR, b->want) && strstr(ERR, "usage:"), "%s %s: stderr \"%s\" lacks \"%s\"", b->tool, b->args,
                ERR, b->want);
  ck_assert_msg(!*OUT, "%s %s wrote to stdout: %s", b->tool, b->args, OUT);
}
END_TEST

START_TEST(help_on_stdout) {
  static const char *const TOOLS[] = {"kvpool-demo", "kvpool-bench"};
  for (int i = 0; i < 2; i++) {
    ck_assert_int_eq(run(TOOLS[i], "--help"), 0);
    ck_assert_msg(strstr(OUT, "usage:") && strstr(OUT, TOOLS[i]), "%s --help: %s", TOOLS[i], OUT);
  }
}
END_TEST

START_TEST(demo_runs) {
  ck_assert_int_eq(run("kvpool-demo", "--json"), 0);
  ck_assert_msg(OUT[0] == '[' && strstr(OUT, "\"bytes.allocated\""), "%.200s", OUT); /* stages, each with its stats */
}
END_TEST

int main(void) {
  char self[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return fprintf(stderr, "check_tools: cannot find myself\n"), 1;
  self[n] = 0;
  snprintf(BUILD, sizeof BUILD, "%s/..", dirname(self));
  Suite *s = suite_create("tools");
  TCase *tc = tcase_create("cli");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, bad_arguments_named, 0, (int)(sizeof BAD / sizeof *BAD));
  tcase_add_test(tc, help_on_stdout);
  tcase_add_test(tc, demo_runs);
  suite_add_tcase(s, tc);
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int nf = srunner_ntests_failed(sr);
  srunner_free(sr);
  return nf ? 1 : 0;
}
