/*
 * tests/unit/emu_expect.h - the tallies of the emulator cross-checks
 * (xcheck_*_emu.cpp): EXPECT counts a check and reports a failure (the run
 * stops after 20), emu_summary prints the last line in the Check summary
 * format tools/run-tests.sh reads and gives the exit status.
 */
#ifndef KVP_TESTS_EMU_EXPECT_H
#define KVP_TESTS_EMU_EXPECT_H

#include <cstdio>
#include <cstdlib>

static long n_checks, n_fail;

#define EXPECT(cond, ...)                                                                                            \
  do {                                                                                                               \
    n_checks++;                                                                                                      \
    if (!(cond)) {                                                                                                   \
      n_fail++;                                                                                                      \
      fprintf(stderr, __VA_ARGS__);                                                                                  \
      fputc('\n', stderr);                                                                                           \
      if (n_fail > 20) {                                                                                             \
        fprintf(stderr, "too many failures\n");                                                                      \
        exit(1);                                                                                                     \
      }                                                                                                              \
    }                                                                                                                \
  } while (0)

static inline int emu_summary(void) {
  printf("%d%%: Checks: %ld, Failures: %ld, Errors: 0\n", n_fail ? (int)(100 * (n_checks - n_fail) / n_checks) : 100,
         n_checks, n_fail);
  return n_fail ? 1 : 0;
}

#endif /* KVP_TESTS_EMU_EXPECT_H */
