/*
 * tests/fuzz/fuzz.h - what the libFuzzer harnesses share: the input as a
 * NUL-terminated string, a scratch file for loaders that take a path, and
 * an abort that names what broke (libFuzzer keeps the input).
 */
#ifndef KVP_FUZZ_H
#define KVP_FUZZ_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kvpool.h"

#define FUZZ_MAX_TEXT 4096

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size); /* each harness defines it */

/* The input as a C string (cut at FUZZ_MAX_TEXT and at its first NUL). */
static inline const char *fuzz_text(const uint8_t *data, size_t size, char *buf) {
  size_t n = size < FUZZ_MAX_TEXT ? size : FUZZ_MAX_TEXT;
  memcpy(buf, data, n);
  buf[n] = 0;
  return buf;
}

/* Paths stay out of specs: a fuzzer must not make the library read
 * /dev/stdin or the fuzzing machine's files. */
static inline int fuzz_has_path(const char *s) { return strchr(s, '/') != NULL; }

/* Write the input to this process's scratch file ending in ext; its path. */
static inline const char *fuzz_file(const uint8_t *data, size_t size, const char *ext) {
  static char path[128];
  snprintf(path, sizeof path, "/tmp/kvp_fuzz_%d%s", (int)getpid(), ext);
  FILE *f = fopen(path, "wb");
  if (!f || fwrite(data, 1, size, f) != size) abort();
  fclose(f);
  return path;
}

#define FUZZ_ASSERT(cond, ...)                                                \
  do {                                                                        \
    if (!(cond)) {                                                            \
      fprintf(stderr, "fuzz: %s:%d: %s: ", __FILE__, __LINE__, #cond);        \
      fprintf(stderr, __VA_ARGS__);                                           \
      fprintf(stderr, "\n");                                                  \
      abort();                                                                \
    }                                                                         \
  } while (0)

#endif
