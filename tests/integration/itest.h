/*
 * tests/integration/itest.h - what every public-header test shares: status
 * assertions that print kvp_last_error, and the suite runner.
 */
#ifndef KVP_ITEST_H
#define KVP_ITEST_H

#include <check.h>

#include "kvpool.h"

#define ck_status(expr, want)                                                                         \
  do {                                                                                                \
    int rc_ = (expr);                                                                                 \
    ck_assert_msg(rc_ == (want), "%s returned %s, expected %s; last error: %s", #expr,                 \
                  kvp_err_name(rc_), kvp_err_name(want), kvp_last_error());                           \
  } while (0)
#define ck_ok(expr) ck_status(expr, KVP_OK)

/* Run a suite (CK_FORK from the environment); 0 if every test passed. */
static inline int it_run(Suite *s) {
  SRunner *sr = srunner_create(s);
  srunner_run_all(sr, CK_NORMAL);
  int nf = srunner_ntests_failed(sr);
  srunner_free(sr);
  return nf ? 1 : 0;
}

#endif
