/*
 * tools/kvpool-calib.c - offline calibration for kvpool: the data codecs and
 * policies load at pool creation, and a look at what they plan.
 *
 *   kvpool-calib heatkv   HeatKV removal orders (S-CAS, and the CAS order
 *                         of binary-heatkv) from attention-mass summaries,
 *                         or from the built-in synthetic generator
 *   kvpool-calib plan     the HeatKV plan of a model, schedule and budget:
 *                         N, |E| and the largest occupancy per scale
 *   kvpool-calib kvquant  the kvquant codec's calibration file from K/V
 *                         samples (.npy) or the synthetic generator
 *
 * `kvpool-calib <command> --help` documents each command.
 */
#include "calib.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

static const uint32_t INFINITY_1024[13] = {1, 4, 16, 36, 64, 144, 256, 400, 576, 1024, 1600, 2304, 4096};

/* Infinity's geometry (no grouped-query attention) and its 13-scale
 * 1024x1024 schedule (sides 1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64). */
static const calib_preset PRESETS[] = {
    {"infinity-2b", 32, 16, 128, 13, INFINITY_1024},
    {"infinity-8b", 40, 28, 128, 13, INFINITY_1024},
};

const calib_preset *calib_preset_find(const char *name) {
  for (size_t i = 0; i < sizeof PRESETS / sizeof *PRESETS; i++)
    if (!strcmp(PRESETS[i].name, name)) return &PRESETS[i];
  return NULL;
}

uint32_t calib_schedule_parse(const char *s, uint32_t *out, uint32_t cap) {
  uint32_t n = 0;
  for (const char *p = s; *p;) {
    char *e;
    errno = 0;
    unsigned long v = strtoul(p, &e, 10);
    if (e == p || errno || v == 0 || v > 1u << 24 || n == cap || (*e && *e != ',')) return 0;
    out[n++] = (uint32_t)v;
    p = *e ? e + 1 : e;
  }
  return n;
}

int calib_u32(const char *opt, const char *v, uint32_t lo, uint32_t hi, uint32_t *out) {
  char *e;
  errno = 0;
  unsigned long long x = strtoull(v, &e, 10);
  if (!*v || *e || errno || x < lo || x > hi) {
    fprintf(stderr, "kvpool-calib: %s %s: expected an integer in %u..%u\n", opt, v, lo, hi);
    return -1;
  }
  *out = (uint32_t)x;
  return 0;
}

int calib_out_ok(const char *cmd, const char *path) {
  int existed = access(path, F_OK) == 0;
  FILE *f = fopen(path, "ab");
  if (!f) return calib_fail(1, cmd, "cannot write %s: %s", path, strerror(errno));
  fclose(f);
  if (!existed) remove(path);
  return 0;
}

int calib_fail(int code, const char *cmd, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "kvpool-calib %s: ", cmd);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  return code;
}

static const struct {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *what;
} COMMANDS[] = {
    {"heatkv", kvp_calib_heatkv_main, "HeatKV removal orders (S-CAS, CAS) from attention-mass summaries"},
    {"plan", kvp_calib_plan_main, "a HeatKV plan: N, |E| and peak occupancy per scale against the budget"},
    {"kvquant", kvp_calib_kvquant_main, "kvquant calibration: per-channel thresholds and nuq codebooks from K/V samples"},
};

static void usage(FILE *f) {
  fprintf(f, "usage: kvpool-calib <command> [options]   (kvpool-calib <command> --help)\n\ncommands:\n");
  for (size_t i = 0; i < sizeof COMMANDS / sizeof *COMMANDS; i++)
    fprintf(f, "  %-8s %s\n", COMMANDS[i].name, COMMANDS[i].what);
}

int main(int argc, char **argv) {
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    usage(stdout);
    return 0;
  }
  for (size_t i = 0; i < sizeof COMMANDS / sizeof *COMMANDS; i++)
    if (!strcmp(argv[1], COMMANDS[i].name)) return COMMANDS[i].run(argc - 1, argv + 1);
  fprintf(stderr, "kvpool-calib: unknown command \"%s\"\n", argv[1]);
  usage(stderr);
  return 2;
}
