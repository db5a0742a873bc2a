/*
 * util/error.c - status names, the thread-local last-error message, the
 * version string and assertion failure.
 *
 * Invariant: every public call that returns a status != KVP_OK has written a
 * message naming the culprit into this thread's buffer before returning.
 */
#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KVP__STR2(x) #x
#define KVP__STR(x) KVP__STR2(x)

static _Thread_local char last_error[512]; /* NUL-terminated message */

KVP_API const char *kvp_version(void) {
  return KVP__STR(KVP_VERSION_MAJOR) "." KVP__STR(KVP_VERSION_MINOR) "." KVP__STR(KVP_VERSION_PATCH);
}

KVP_API const char *kvp_strerror(int status) {
  switch (status) {
#define KVP__CASE(name, value, desc) \
  case value:                        \
    return desc;
    KVP_STATUS_LIST(KVP__CASE)
#undef KVP__CASE
  default:
    return "unknown status";
  }
}

KVP_API const char *kvp_err_name(int status) {
  switch (status) {
#define KVP__CASE(name, value, desc) \
  case value:                        \
    return "KVP_" #name;
    KVP_STATUS_LIST(KVP__CASE)
#undef KVP__CASE
  default:
    return "KVP_E?";
  }
}

KVP_API const char *kvp_last_error(void) { return last_error; }

const char *kvp__err_detail(void) {
  const char *sep = strncmp(last_error, "KVP_", 4) ? NULL : strstr(last_error, ": ");
  return sep ? sep + 2 : last_error;
}

int kvp__err(int status, const char *fmt, ...) {
  va_list ap;
  int n = snprintf(last_error, sizeof last_error, "%s: ", kvp_err_name(status));
  if (n < 0 || (size_t)n >= sizeof last_error) return status;
  va_start(ap, fmt);
  vsnprintf(last_error + n, sizeof last_error - (size_t)n, fmt, ap);
  va_end(ap);
  return status;
}

void kvp__assert_fail(const char *expr, const char *file, int line) {
  fprintf(stderr, "kvpool: assertion failed: %s (%s:%d)\n", expr, file, line);
  abort();
}
