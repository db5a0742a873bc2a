/*
 * tools/calib.h - the subcommands of kvpool-calib, one function each
 * (argv[0] is the subcommand's name), and the helpers they share. Exit
 * codes: 0 done, 1 bad input (file, value), 2 bad usage (option).
 */
#ifndef KVP_CALIB_H
#define KVP_CALIB_H

#include <stdint.h>
#include <stdio.h>

int kvp_calib_heatkv_main(int argc, char **argv); /* orders from attention mass */
int kvp_calib_plan_main(int argc, char **argv);   /* inspect a HeatKV plan */
int kvp_calib_kvquant_main(int argc, char **argv); /* kvquant codebooks and per-channel thresholds */

/* A model whose geometry and generation schedule kvpool-calib knows. */
typedef struct calib_preset {
  const char *name;        /* --preset value */
  uint32_t layers, heads, head_dim;
  uint32_t n_scales;       /* scales of one generation */
  const uint32_t *tokens;  /* [n_scales] tokens per scale */
} calib_preset;

/* The preset called name, or NULL (the message lists the known ones). */
const calib_preset *calib_preset_find(const char *name);
/* Parse "1,4,16,..." into out (cap entries): the count, or 0 on a bad list. */
uint32_t calib_schedule_parse(const char *s, uint32_t *out, uint32_t cap);
/* Parse an unsigned integer option value; 0 on success, -1 with a message. */
int calib_u32(const char *opt, const char *v, uint32_t lo, uint32_t hi, uint32_t *out);
/* Whether path can be written (checked before long work, so a bad --out
 * fails at once): 0, or 1 with a message naming it. A file this creates
 * to find out is removed again. */
int calib_out_ok(const char *cmd, const char *path);
/* Print "kvpool-calib <cmd>: <message>" on stderr; returns code. */
int calib_fail(int code, const char *cmd, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#endif /* KVP_CALIB_H */
