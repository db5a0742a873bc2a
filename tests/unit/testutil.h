/*
 * tests/unit/testutil.h - helpers shared by the unit suites.
 */
#ifndef KVP_TESTUTIL_H
#define KVP_TESTUTIL_H

#include <check.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kvpool.h"

/* Assert a status, printing kvp_last_error on mismatch. */
#define ck_status(expr, want)                                                                         \
  do {                                                                                                \
    int rc_ = (expr);                                                                                 \
    ck_assert_msg(rc_ == (want), "%s returned %s, expected %s; last error: %s", #expr,                 \
                  kvp_err_name(rc_), kvp_err_name(want), kvp_last_error());                           \
  } while (0)

#define ck_ok(expr) ck_status(expr, KVP_OK)
#define ck_pool(pool) ck_ok(kvp_check(pool))

/* xorshift64*: fixed seeds, reproducible runs. */
static inline uint64_t t_rand(uint64_t *s) {
  *s ^= *s >> 12;
  *s ^= *s << 25;
  *s ^= *s >> 27;
  return *s * 0x2545F4914F6CDD1DULL;
}

/* Run tool (a program in the build folder above the tests', e.g.
 * "kvpool-calib") with args through the shell; its stdout and stderr into
 * out (cap bytes, NUL-terminated). Returns its exit status, -1 if killed. */
static inline int t_run_tool(const char *tool, const char *args, char *out, size_t cap) {
  char self[512], cmd[2048];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  ck_assert_int_gt(n, 0);
  self[n] = 0;
  *strrchr(self, '/') = 0; /* build/tests */
  snprintf(cmd, sizeof cmd, "%s/../%s %s 2>&1", self, tool, args);
  FILE *p = popen(cmd, "r");
  ck_assert_ptr_nonnull(p);
  size_t got = fread(out, 1, cap - 1, p);
  out[got] = 0;
  int st = pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static inline int t_run(Suite *s) {
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int nf = srunner_ntests_failed(sr);
  srunner_free(sr);
  return nf ? 1 : 0;
}

#endif
