/*
 * tests/unit/testutil.h - helpers shared by the unit suites.
 */
#ifndef KVP_TESTUTIL_H
#define KVP_TESTUTIL_H

#include <check.h>
#include <stdint.h>

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

static inline int t_run(Suite *s) {
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int nf = srunner_ntests_failed(sr);
  srunner_free(sr);
  return nf ? 1 : 0;
}

#endif
