/*
 * kvpool-stat - read what kvpool writes about its bytes: the JSON snapshot
 * of kvp_stats_write (docs/telemetry.md) or the CSV time series of
 * `kvpool-sim --csv`; print tables, diff two snapshots, plot a series.
 * Reads files only: it needs neither the library nor its header.
 *
 *   kvpool-stat [--json] [--top N] FILE             a table of a snapshot or a series
 *   kvpool-stat diff [--json] [--all] A.json B.json  what changed from A to B
 *   kvpool-stat --plot OUT.png [--title T] FILE.csv  allocator bytes by page type against
 *                                                    device-level and bf16-equivalent bytes
 *
 * CSV contract (columns are found by header name; extra columns are fine):
 *   iter,sim_time_s,running,waiting,finished,preemptions,allocated_bytes,requested_bytes,
 *   budget_bytes,bf16_equivalent_bytes,device_used_bytes,alloc_raw,alloc_codes,alloc_scales,
 *   alloc_centroids,alloc_assign,alloc_outliers,alloc_meta
 * (alloc_<page type> = allocated bytes of that page type), one row per iteration, LF line ends
 * (CR before LF is tolerated). iter and allocated_bytes are required; the others are used when
 * present.
 *
 * Exit status: 0 done, 1 a bad or unreadable file or a failed plot, 2 bad usage.
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_FILE_BYTES (512u << 20)
#define MAX_COLS 256

static const char *const page_types[] = {"raw", "codes", "scales", "centroids", "assign", "outliers", "meta"};
#define NPT (sizeof page_types / sizeof *page_types)

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("kvpool-stat: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

/* ---- bytes for people ---------------------------------------------------- */

static const char *human_bytes(double b, char *buf, size_t cap) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  double a = fabs(b);
  unsigned u = 0;
  while (a >= 1024.0 && u + 1 < sizeof unit / sizeof *unit) a /= 1024.0, u++;
  if (u == 0) snprintf(buf, cap, "%.0f B", b);
  else snprintf(buf, cap, "%.2f %s", b < 0 ? -a : a, unit[u]);
  return buf;
}

static bool is_bytes_key(const char *k) {
  return strstr(k, "bytes") != NULL || strncmp(k, "alloc_", 6) == 0;
}

/* A figure as a column: bytes in units, others as integers or 3 decimals. */
static const char *fmt_value(const char *key, double v, char *buf, size_t cap) {
  if (is_bytes_key(key)) return human_bytes(v, buf, cap);
  if (v == floor(v) && fabs(v) < 9e15) snprintf(buf, cap, "%.0f", v);
  else snprintf(buf, cap, "%.3f", v);
  return buf;
}

/* ---- files --------------------------------------------------------------- */

static char *read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f) fail("%s: %s", path, strerror(errno));
  struct stat st;
  if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) fail("%s: not a regular file", path);
  if ((uint64_t)st.st_size > MAX_FILE_BYTES) fail("%s: %lld bytes, more than this tool reads (%u)", path,
                                                  (long long)st.st_size, MAX_FILE_BYTES);
  char *buf = malloc((size_t)st.st_size + 1);
  if (!buf) fail("%s: out of memory", path);
  size_t n = fread(buf, 1, (size_t)st.st_size, f);
  if (ferror(f)) fail("%s: read error: %s", path, strerror(errno));
  fclose(f);
  buf[n] = 0;
  if (strlen(buf) != n) fail("%s: binary data (a NUL byte at offset %zu): not JSON or CSV", path, strlen(buf));
  *len = n;
  return buf;
}

typedef enum { KIND_JSON, KIND_CSV } file_kind;

static file_kind sniff(const char *text) {
  while (*text == ' ' || *text == '\t' || *text == '\r' || *text == '\n') text++;
  return *text == '{' ? KIND_JSON : KIND_CSV;
}

/* ---- JSON snapshots ------------------------------------------------------ */

/* Every figure of a snapshot is a finite number >= 0 (savings.bytes, a
 * difference, may be negative); key names the culprit, dotted. */
static void check_values(const char *path, const char *key, json_t *j) {
  if (json_is_object(j)) {
    const char *k;
    json_t *v;
    json_object_foreach(j, k, v) {
      char sub[512];
      snprintf(sub, sizeof sub, "%s%s%s", key, *key ? "." : "", k);
      check_values(path, sub, v);
    }
  } else if (json_is_array(j)) {
    size_t i;
    json_t *v;
    json_array_foreach(j, i, v) {
      char sub[512];
      snprintf(sub, sizeof sub, "%s[%zu]", key, i);
      check_values(path, sub, v);
    }
  } else if (json_is_number(j)) {
    double x = json_number_value(j);
    if (!isfinite(x) || (x < 0 && strcmp(key, "savings.bytes")))
      fail("%s: \"%s\" = %g: a kvpool figure is a count, size or ratio >= 0", path, key, x);
  }
}

static json_t *load_snapshot(const char *path, const char *text) {
  json_error_t err;
  json_t *j = json_loads(text, 0, &err);
  if (!j) fail("%s:%d:%d: not valid JSON: %s", path, err.line, err.column, err.text);
  if (!json_is_object(j)) fail("%s: not a kvpool stats snapshot (the top level is not an object)", path);
  json_t *alloc = json_object_get(j, "bytes.allocated"), *ver = json_object_get(j, "version");
  if (!ver && !alloc)
    fail("%s: not a kvpool stats snapshot (no \"version\" and \"bytes.allocated\": the JSON of kvp_stats_write)", path);
  if (!json_is_integer(ver) || json_integer_value(ver) < 1)
    fail("%s: \"version\": %s, expected the stats version (an integer >= 1)", path, ver ? "not one" : "missing");
  if (!json_is_object(alloc) || !json_is_integer(json_object_get(alloc, "current")))
    fail("%s: \"bytes.allocated\": %s, expected a gauge {\"current\": bytes, ...}", path,
         alloc ? "malformed" : "missing");
  check_values(path, "", j);
  return j;
}

static double num(json_t *j) { return json_is_number(j) ? json_number_value(j) : NAN; }
/* A number for --json output: an integer when it is one (byte counts), else a real. */
static json_t *jnum(double v) {
  if (!isfinite(v)) return json_null(); /* a figure the file does not have */
  return v == floor(v) && fabs(v) < 9007199254740992.0 ? json_integer((json_int_t)v) : json_real(v);
}
static double cur(json_t *snap, const char *key) {
  json_t *v = json_object_get(snap, key);
  return json_is_object(v) ? num(json_object_get(v, "current")) : num(v);
}
static bool is_gauge(json_t *v) {
  return json_is_object(v) && json_object_get(v, "current") && json_object_get(v, "peak") && json_object_get(v, "total");
}
static bool is_breakdown(const char *k) {
  static const char *const b[] = {"page_types", "kv", "layers", "heads", "codecs", "sequences"};
  for (size_t i = 0; i < sizeof b / sizeof *b; i++)
    if (!strcmp(k, b[i])) return true;
  return false;
}

static double savings_ratio(json_t *snap) {
  json_t *r = json_object_get(snap, "savings.ratio");
  if (json_is_number(r)) return json_number_value(r);
  double a = cur(snap, "bytes.allocated"), b = cur(snap, "bytes.bf16_equivalent");
  return a > 0 && !isnan(b) ? b / a : 0.0;
}

static void slice_row(const char *name, json_t *u, double total) {
  char r[32], a[32];
  double alloc = num(json_object_get(u, "allocated_bytes"));
  printf("  %-20s %14s %14s %10.0f %7.1f%%\n", name, human_bytes(num(json_object_get(u, "requested_bytes")), r, sizeof r),
         human_bytes(alloc, a, sizeof a), num(json_object_get(u, "pages")), total > 0 ? 100.0 * alloc / total : 0.0);
}

typedef struct seq_row {
  const char *id;
  double alloc;
  json_t *u;
} seq_row;

static int seq_cmp(const void *x, const void *y) {
  const seq_row *a = x, *b = y;
  if (a->alloc != b->alloc) return a->alloc < b->alloc ? 1 : -1;
  unsigned long long ia = strtoull(a->id, NULL, 10), ib = strtoull(b->id, NULL, 10);
  return ia < ib ? -1 : ia > ib;
}

/* Sequences by allocated bytes, largest first: *n rows (caller frees). */
static seq_row *top_sequences(json_t *snap, size_t *n) {
  json_t *seqs = json_object_get(snap, "sequences");
  *n = json_is_object(seqs) ? json_object_size(seqs) : 0;
  seq_row *rows = calloc(*n + 1, sizeof *rows);
  if (!rows) fail("out of memory");
  size_t i = 0;
  const char *k;
  json_t *v;
  if (*n)
    json_object_foreach(seqs, k, v) rows[i++] = (seq_row){k, num(json_object_get(v, "allocated_bytes")), v};
  qsort(rows, i, sizeof *rows, seq_cmp);
  *n = i;
  return rows;
}

static void print_snapshot(const char *path, json_t *snap, size_t top) {
  char b1[32], b2[32], b3[32];
  printf("kvpool snapshot %s (stats version %lld)\n\n", path,
         (long long)json_integer_value(json_object_get(snap, "version")));
  printf("  %-26s %14s %14s %16s\n", "figure", "current", "peak", "total");
  const char *k;
  json_t *v;
  json_object_foreach(snap, k, v) {
    if (!strcmp(k, "version") || is_breakdown(k)) continue;
    if (is_gauge(v))
      printf("  %-26s %14s %14s %16s\n", k, fmt_value(k, num(json_object_get(v, "current")), b1, sizeof b1),
             fmt_value(k, num(json_object_get(v, "peak")), b2, sizeof b2),
             fmt_value(k, num(json_object_get(v, "total")), b3, sizeof b3));
    else if (json_is_number(v))
      printf("  %-26s %14s\n", k, fmt_value(k, json_number_value(v), b1, sizeof b1));
  }
  double alloc = cur(snap, "bytes.allocated"), budget = cur(snap, "bytes.budget");
  printf("\n  savings against bf16: %.3fx   budget in use: %.1f%%   rounding: %s allocated beyond requested\n",
         savings_ratio(snap), budget > 0 ? 100.0 * alloc / budget : 0.0,
         human_bytes(alloc - cur(snap, "bytes.requested"), b1, sizeof b1));
  printf("\n  %-20s %14s %14s %10s %8s\n", "by page type", "requested", "allocated", "pages", "share");
  json_t *pt = json_object_get(snap, "page_types");
  json_object_foreach(pt, k, v) slice_row(k, v, alloc);
  json_t *kv = json_object_get(snap, "kv");
  if (json_is_object(kv)) {
    printf("  %-20s\n", "by side");
    json_object_foreach(kv, k, v) slice_row(!strcmp(k, "k") ? "K" : !strcmp(k, "v") ? "V" : k, v, alloc);
  }
  json_t *codecs = json_object_get(snap, "codecs");
  if (json_is_object(codecs) && json_object_size(codecs)) {
    printf("  %-20s\n", "by codec");
    json_object_foreach(codecs, k, v) {
      char name[64];
      const char *cn = json_string_value(json_object_get(v, "name"));
      snprintf(name, sizeof name, "%s (id %s)", cn ? cn : "?", k);
      slice_row(name, v, alloc);
    }
  }
  static const char *const arrays[] = {"layers", "heads"};
  for (int a = 0; a < 2; a++) {
    json_t *arr = json_object_get(snap, arrays[a]);
    size_t n = json_array_size(arr), imin = 0, imax = 0;
    if (!n) continue;
    for (size_t i = 1; i < n; i++) {
      double x = num(json_object_get(json_array_get(arr, i), "allocated_bytes"));
      if (x < num(json_object_get(json_array_get(arr, imin), "allocated_bytes"))) imin = i;
      if (x > num(json_object_get(json_array_get(arr, imax), "allocated_bytes"))) imax = i;
    }
    printf("  %-20s %zu; least allocated: #%zu %s, most: #%zu %s\n", arrays[a], n, imin,
           human_bytes(num(json_object_get(json_array_get(arr, imin), "allocated_bytes")), b1, sizeof b1), imax,
           human_bytes(num(json_object_get(json_array_get(arr, imax), "allocated_bytes")), b2, sizeof b2));
  }
  size_t n;
  seq_row *rows = top_sequences(snap, &n);
  if (n) {
    printf("\n  %-20s %14s %14s %10s %8s\n", "top sequences", "requested", "allocated", "pages", "share");
    for (size_t i = 0; i < n && i < top; i++) slice_row(rows[i].id, rows[i].u, alloc);
    if (n > top) printf("  ... %zu more (--top N)\n", n - top);
  }
  free(rows);
}

static json_t *snapshot_json(const char *path, json_t *snap, size_t top) {
  json_t *o = json_pack("{s:s, s:s, s:o, s:o, s:o, s:o, s:o, s:o, s:f}", "file", path, "kind", "snapshot",
                        "allocated_bytes", jnum(cur(snap, "bytes.allocated")), "requested_bytes",
                        jnum(cur(snap, "bytes.requested")), "budget_bytes", jnum(cur(snap, "bytes.budget")),
                        "bf16_equivalent_bytes", jnum(cur(snap, "bytes.bf16_equivalent")), "device_used_bytes",
                        jnum(cur(snap, "device.used_bytes")), "host_metadata_bytes", jnum(cur(snap, "host.metadata_bytes")),
                        "savings_ratio", savings_ratio(snap));
  if (!o) fail("%s: out of memory for the JSON summary", path);
  json_t *pt = json_object(), *ts = json_array();
  const char *k;
  json_t *v;
  json_object_foreach(json_object_get(snap, "page_types"), k, v)
      json_object_set_new(pt, k, jnum(num(json_object_get(v, "allocated_bytes"))));
  json_object_set_new(o, "allocated_by_page_type", pt);
  size_t n;
  seq_row *rows = top_sequences(snap, &n);
  for (size_t i = 0; i < n && i < top; i++)
    json_array_append_new(ts, json_pack("{s:s, s:o}", "seq", rows[i].id, "allocated_bytes", jnum(rows[i].alloc)));
  free(rows);
  json_object_set_new(o, "top_sequences", ts);
  return o;
}

/* ---- diff ---------------------------------------------------------------- */

typedef struct flat {
  char **keys;   /* dotted paths */
  double *vals;  /* their numbers */
  size_t n, cap;
  json_t *index; /* key -> position in keys (a hash: diffs of snapshots with many sequences stay linear) */
} flat;

static void flat_add(flat *f, const char *key, double v) {
  if (f->n == f->cap) {
    f->cap = f->cap ? 2 * f->cap : 256;
    f->keys = realloc(f->keys, f->cap * sizeof *f->keys);
    f->vals = realloc(f->vals, f->cap * sizeof *f->vals);
    if (!f->keys || !f->vals) fail("out of memory");
  }
  if (!(f->keys[f->n] = strdup(key))) fail("out of memory");
  if (!f->index && !(f->index = json_object())) fail("out of memory");
  if (json_object_set_new(f->index, key, json_integer((json_int_t)f->n))) fail("out of memory");
  f->vals[f->n++] = v;
}

/* Every number of the snapshot under its dotted path (gauge fields and
 * breakdown slices included; codec names are labels, not figures). */
static void flatten(json_t *j, const char *prefix, flat *f) {
  char key[512];
  if (json_is_number(j)) {
    flat_add(f, prefix, json_number_value(j));
  } else if (json_is_object(j)) {
    const char *k;
    json_t *v;
    json_object_foreach(j, k, v) {
      snprintf(key, sizeof key, "%s%s%s", prefix, *prefix ? "." : "", k);
      flatten(v, key, f);
    }
  } else if (json_is_array(j)) {
    for (size_t i = 0; i < json_array_size(j); i++) {
      snprintf(key, sizeof key, "%s.%zu", prefix, i);
      flatten(json_array_get(j, i), key, f);
    }
  }
}

static ssize_t flat_find(const flat *f, const char *key) {
  json_t *i = f->index ? json_object_get(f->index, key) : NULL;
  return i ? (ssize_t)json_integer_value(i) : -1;
}

static void flat_free(flat *f) {
  for (size_t i = 0; i < f->n; i++) free(f->keys[i]);
  free(f->keys);
  free(f->vals);
  json_decref(f->index);
}

static int run_diff(const char *pa, const char *pb, bool json_out, bool all) {
  size_t la, lb;
  char *ta = read_file(pa, &la), *tb = read_file(pb, &lb);
  if (sniff(ta) != KIND_JSON) fail("%s: diff compares JSON snapshots (kvp_stats_write), this is not one", pa);
  if (sniff(tb) != KIND_JSON) fail("%s: diff compares JSON snapshots (kvp_stats_write), this is not one", pb);
  json_t *a = load_snapshot(pa, ta), *b = load_snapshot(pb, tb);
  flat fa = {0}, fb = {0};
  flatten(a, "", &fa);
  flatten(b, "", &fb);
  json_t *out = json_object();
  if (!json_out) printf("kvpool diff %s -> %s\n\n  %-44s %14s %14s %15s %9s\n", pa, pb, "figure", "A", "B", "B - A", "change");
  size_t shown = 0;
  for (int pass = 0; pass < 2; pass++) { /* keys of A (and B), then keys only B has */
    const flat *f = pass ? &fb : &fa;
    for (size_t i = 0; i < f->n; i++) {
      const char *k = f->keys[i];
      if (pass && flat_find(&fa, k) >= 0) continue;
      ssize_t ia = flat_find(&fa, k), ib = flat_find(&fb, k);
      double x = ia >= 0 ? fa.vals[ia] : NAN, y = ib >= 0 ? fb.vals[ib] : NAN;
      bool same = ia >= 0 && ib >= 0 && x == y;
      if (same && !all) continue;
      shown++;
      if (json_out) {
        json_t *e = json_object();
        json_object_set_new(e, "a", ia >= 0 ? jnum(x) : json_null());
        json_object_set_new(e, "b", ib >= 0 ? jnum(y) : json_null());
        json_object_set_new(e, "delta", ia >= 0 && ib >= 0 ? jnum(y - x) : json_null());
        json_object_set_new(out, k, e);
        continue;
      }
      char sa[32] = "-", sb[32] = "-", sd[32] = "", sc[16] = "";
      if (ia >= 0) fmt_value(k, x, sa, sizeof sa);
      if (ib >= 0) fmt_value(k, y, sb, sizeof sb);
      if (ia >= 0 && ib >= 0) {
        fmt_value(k, y - x, sd + 1, sizeof sd - 1);
        sd[0] = y >= x ? '+' : ' ';
        if (sd[0] == ' ') memmove(sd, sd + 1, strlen(sd));
        if (x != 0) snprintf(sc, sizeof sc, "%+.1f%%", 100.0 * (y - x) / fabs(x));
      } else {
        snprintf(sd, sizeof sd, ia >= 0 ? "(only in A)" : "(only in B)");
      }
      printf("  %-44s %14s %14s %15s %9s\n", k, sa, sb, sd, sc);
    }
  }
  if (json_out) {
    json_t *top = json_pack("{s:s, s:s, s:o}", "a", pa, "b", pb, "figures", out);
    json_dumpf(top, stdout, JSON_COMPACT);
    putchar('\n');
    json_decref(top);
  } else {
    if (!shown) printf("  (no figure differs)\n");
    printf("\n  savings against bf16: %.3fx -> %.3fx\n", savings_ratio(a), savings_ratio(b));
    json_decref(out);
  }
  flat_free(&fa);
  flat_free(&fb);
  json_decref(a);
  json_decref(b);
  free(ta);
  free(tb);
  return 0;
}

/* ---- CSV time series ----------------------------------------------------- */

typedef struct series {
  size_t ncols, nrows;
  char *name[MAX_COLS];  /* header names */
  double *col[MAX_COLS]; /* [nrows] each */
  size_t cap;
} series;

static ssize_t col_index(const series *s, const char *name) {
  for (size_t i = 0; i < s->ncols; i++)
    if (!strcmp(s->name[i], name)) return (ssize_t)i;
  return -1;
}
static const double *col(const series *s, const char *name) {
  ssize_t i = col_index(s, name);
  return i >= 0 ? s->col[i] : NULL;
}

/* Split a line (NUL-terminated, no LF) at commas, in place. */
static size_t split(char *line, char **f, size_t max) {
  size_t n = 0;
  for (char *p = line;; p++) {
    if (n == max) return max + 1;
    f[n++] = p;
    p += strcspn(p, ",");
    if (!*p) return n;
    *p = 0;
  }
}

static void trim(char *s) {
  size_t n = strlen(s);
  while (n && (s[n - 1] == '\r' || s[n - 1] == ' ' || s[n - 1] == '\t')) s[--n] = 0;
  size_t lead = strspn(s, " \t");
  if (lead) memmove(s, s + lead, n - lead + 1);
}

/* Columns of kvpool-sim --csv that count (bytes, pages, requests, the
 * iteration): whole numbers >= 0 that fit in 64 bits. */
static int count_col(const char *name) {
  static const char *const counts[] = {"iter", "running", "waiting", "finished", "preemptions"};
  size_t n = strlen(name);
  if (!strncmp(name, "alloc_", 6) || (n > 6 && !strcmp(name + n - 6, "_bytes"))) return 1;
  for (size_t i = 0; i < sizeof counts / sizeof *counts; i++)
    if (!strcmp(name, counts[i])) return 1;
  return 0;
}

static void load_series(const char *path, char *text, series *s) {
  memset(s, 0, sizeof *s);
  char *f[MAX_COLS + 1];
  size_t lineno = 0;
  char *line = text;
  while (line && *line) {
    char *nl = strchr(line, '\n'), *next = nl ? nl + 1 : NULL;
    if (nl) *nl = 0;
    lineno++;
    trim(line);
    if (!*line) {
      if (next && *next && !s->ncols) fail("%s:%zu: empty line before the header", path, lineno);
      line = next;
      continue;
    }
    size_t n = split(line, f, MAX_COLS);
    if (n > MAX_COLS) fail("%s:%zu: more than %d columns", path, lineno, MAX_COLS);
    if (!s->ncols) { /* the header */
      for (size_t i = 0; i < n; i++) {
        trim(f[i]);
        if (!*f[i]) fail("%s:%zu: header column %zu has no name", path, lineno, i + 1);
        for (size_t j = 0; j < i; j++)
          if (!strcmp(s->name[j], f[i])) fail("%s:%zu: header names column \"%s\" twice", path, lineno, f[i]);
        s->name[i] = f[i];
      }
      s->ncols = n;
      if (col_index(s, "iter") < 0 || col_index(s, "allocated_bytes") < 0)
        fail("%s:%zu: not a kvpool-sim CSV: the header has no \"%s\" column (it needs iter and allocated_bytes; "
             "for a JSON snapshot the file must start with '{')", path, lineno,
             col_index(s, "iter") < 0 ? "iter" : "allocated_bytes");
      line = next;
      continue;
    }
    if (n != s->ncols) fail("%s:%zu: %zu fields, the header has %zu", path, lineno, n, s->ncols);
    if (s->nrows == s->cap) {
      s->cap = s->cap ? 2 * s->cap : 1024;
      for (size_t c = 0; c < s->ncols; c++)
        if (!(s->col[c] = realloc(s->col[c], s->cap * sizeof(double)))) fail("out of memory");
    }
    for (size_t c = 0; c < n; c++) {
      trim(f[c]);
      char *end;
      errno = 0;
      double v = strtod(f[c], &end);
      if (!*f[c] || *end || errno == ERANGE || !isfinite(v))
        fail("%s:%zu: column \"%s\": \"%s\" is not a finite number", path, lineno, s->name[c], f[c]);
      if (count_col(s->name[c]) && (v < 0 || v != floor(v) || v >= 18446744073709551616.0))
        fail("%s:%zu: column \"%s\": \"%s\" is not a count (a whole number 0..2^64-1)", path, lineno, s->name[c],
             f[c]);
      if (!strcmp(s->name[c], "sim_time_s") && v < 0)
        fail("%s:%zu: column \"sim_time_s\": \"%s\" is negative", path, lineno, f[c]);
      s->col[c][s->nrows] = v;
    }
    s->nrows++;
    line = next;
  }
  if (!s->ncols) fail("%s: empty file: neither a JSON snapshot nor a CSV time series", path);
  if (!s->nrows) fail("%s: a CSV header and no rows", path);
}

static void series_free(series *s) {
  for (size_t c = 0; c < s->ncols; c++) free(s->col[c]);
}

static void col_stats(const double *x, size_t n, double *mn, double *mx, double *mean) {
  *mn = *mx = x[0];
  double sum = 0;
  for (size_t i = 0; i < n; i++) {
    if (x[i] < *mn) *mn = x[i];
    if (x[i] > *mx) *mx = x[i];
    sum += x[i];
  }
  *mean = sum / (double)n;
}

static void print_series(const char *path, const series *s) {
  const double *it = col(s, "iter"), *t = col(s, "sim_time_s");
  printf("kvpool time series %s: %zu rows, iterations %.0f..%.0f", path, s->nrows, it[0], it[s->nrows - 1]);
  if (t) printf(", simulated time %.3f..%.3f s", t[0], t[s->nrows - 1]);
  printf("\n\n  %-24s %14s %14s %14s %14s\n", "column", "min", "max", "final", "mean");
  for (size_t c = 0; c < s->ncols; c++) {
    if (!strcmp(s->name[c], "iter")) continue;
    double mn, mx, mean;
    char a[32], b[32], f[32], m[32];
    col_stats(s->col[c], s->nrows, &mn, &mx, &mean);
    printf("  %-24s %14s %14s %14s %14s\n", s->name[c], fmt_value(s->name[c], mn, a, sizeof a),
           fmt_value(s->name[c], mx, b, sizeof b), fmt_value(s->name[c], s->col[c][s->nrows - 1], f, sizeof f),
           fmt_value(s->name[c], mean, m, sizeof m));
  }
  const double *al = col(s, "allocated_bytes"), *bu = col(s, "budget_bytes"), *bf = col(s, "bf16_equivalent_bytes");
  double mn, peak, mean;
  char a[32], b[32];
  col_stats(al, s->nrows, &mn, &peak, &mean);
  printf("\n  peak allocated %s", human_bytes(peak, a, sizeof a));
  if (bu) {
    size_t over = 0;
    for (size_t i = 0; i < s->nrows; i++) over += al[i] > bu[i];
    printf(" of a %s budget (%.1f%%); rows over budget: %zu", human_bytes(bu[s->nrows - 1], b, sizeof b),
           bu[s->nrows - 1] > 0 ? 100.0 * peak / bu[s->nrows - 1] : 0.0, over);
  }
  if (bf) {
    double sb = 0, sa = 0; /* savings over the run: bf16-equivalent byte-iterations / allocated byte-iterations */
    for (size_t i = 0; i < s->nrows; i++) sb += bf[i], sa += al[i];
    printf("\n  savings against bf16 over the run: %.3fx", sa > 0 ? sb / sa : 0.0);
  }
  printf("\n");
}

static json_t *series_json(const char *path, const series *s) {
  json_t *cols = json_object();
  for (size_t c = 0; c < s->ncols; c++) {
    double mn, mx, mean;
    col_stats(s->col[c], s->nrows, &mn, &mx, &mean);
    json_object_set_new(cols, s->name[c], json_pack("{s:o, s:o, s:o, s:f}", "min", jnum(mn), "max", jnum(mx), "final",
                                                    jnum(s->col[c][s->nrows - 1]), "mean", mean));
  }
  json_t *o = json_pack("{s:s, s:s, s:I, s:o}", "file", path, "kind", "series", "rows", (json_int_t)s->nrows,
                        "columns", cols);
  const double *al = col(s, "allocated_bytes"), *bu = col(s, "budget_bytes"), *bf = col(s, "bf16_equivalent_bytes");
  double mn, peak, mean, sa = 0, sb = 0;
  size_t over = 0;
  col_stats(al, s->nrows, &mn, &peak, &mean);
  for (size_t i = 0; i < s->nrows; i++) {
    over += bu && al[i] > bu[i];
    sa += al[i];
    sb += bf ? bf[i] : 0;
  }
  json_object_set_new(o, "peak_allocated_bytes", jnum(peak));
  if (bu) json_object_set_new(o, "rows_over_budget", json_integer((json_int_t)over));
  if (bf) json_object_set_new(o, "savings_ratio_over_run", json_real(sa > 0 ? sb / sa : 0.0));
  return o;
}

/* ---- plot ---------------------------------------------------------------- */

static bool have_gnuplot(void) {
  const char *path = getenv("PATH");
  if (!path) return false;
  char *dup = strdup(path), *save = NULL;
  bool ok = false;
  for (char *d = strtok_r(dup, ":", &save); d && !ok; d = strtok_r(NULL, ":", &save)) {
    char exe[4096];
    snprintf(exe, sizeof exe, "%s/gnuplot", *d ? d : ".");
    ok = access(exe, X_OK) == 0;
  }
  free(dup);
  return ok;
}

/* gnuplot double-quoted string literal: backslash escapes, \n for newlines. */
static void gp_quote(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '\n') fputs("\\n", f);
    else if (*s == '"' || *s == '\\') fprintf(f, "\\%c", *s);
    else if ((unsigned char)*s >= 0x20) fputc(*s, f);
  }
  fputc('"', f);
}

static int run_plot(const char *path, const series *s, const char *png, const char *title) {
  if (!have_gnuplot()) fail("--plot needs gnuplot (Debian: gnuplot-nox, installed by `make deps`)");
  const double *x = col(s, "sim_time_s");
  const char *xlabel = "simulated time (s)";
  if (!x) x = col(s, "iter"), xlabel = "iteration";
  /* the stack: every alloc_<page type> column holding bytes, the known page
   * types first in their order (each keeps its color), then any other */
  const double *stack[MAX_COLS];
  const char *stack_name[MAX_COLS];
  size_t stack_color[MAX_COLS], ns = 0;
  double ymax = 0;
  for (size_t pass = 0; pass < 2; pass++)
    for (size_t c = 0; c < s->ncols; c++) {
      const char *name = s->name[c];
      if (strncmp(name, "alloc_", 6) || !name[6]) continue;
      size_t pi = 0;
      while (pi < NPT && strcmp(page_types[pi], name + 6)) pi++;
      if ((pass == 0) != (pi < NPT)) continue;
      bool any = false;
      for (size_t i = 0; i < s->nrows; i++) any |= s->col[c][i] != 0;
      if (!any) continue;
      stack[ns] = s->col[c];
      stack_name[ns] = name + 6;
      stack_color[ns] = pi < NPT ? pi : NPT + ns;
      ns++;
    }
  static const char *const lines[] = {"device_used_bytes", "bf16_equivalent_bytes", "budget_bytes", "allocated_bytes"};
  static const char *const line_title[] = {"device-level bytes in use", "bf16-equivalent (uncompressed)",
                                           "budget", "allocated (total)"};
  static const char *const line_style[] = {"lc rgb '#000000' lw 3", "lc rgb '#1f5fbf' lw 2.5 dt 2",
                                           "lc rgb '#cc0000' lw 2.5 dt 3", "lc rgb '#555555' lw 1.5"};
  for (size_t i = 0; i < s->nrows; i++) {
    for (size_t l = 0; l < 4; l++) {
      const double *c = col(s, lines[l]);
      if (c && c[i] > ymax) ymax = c[i];
    }
    double sum = 0;
    for (size_t p = 0; p < ns; p++) sum += stack[p][i];
    if (sum > ymax) ymax = sum;
  }
  double unit = 1;
  const char *uname = "bytes";
  if (ymax >= (double)(1ull << 30)) unit = (double)(1ull << 30), uname = "GiB";
  else if (ymax >= (double)(1ull << 20)) unit = (double)(1ull << 20), uname = "MiB";
  else if (ymax >= 1024) unit = 1024, uname = "KiB";

  char data[] = "/tmp/kvpool-stat-XXXXXX";
  int fd = mkstemp(data);
  if (fd < 0) fail("--plot: temporary data file: %s", strerror(errno));
  FILE *df = fdopen(fd, "w");
  if (!df) fail("--plot: temporary data file: %s", strerror(errno));
  /* columns: x, then the cumulative stack tops, then the lines (NaN = absent) */
  for (size_t i = 0; i < s->nrows; i++) {
    fprintf(df, "%.9g", x[i]);
    double sum = 0;
    for (size_t p = 0; p < ns; p++) fprintf(df, " %.9g", (sum += stack[p][i]) / unit);
    for (size_t l = 0; l < 4; l++) {
      const double *c = col(s, lines[l]);
      fprintf(df, c ? " %.9g" : " NaN", c ? c[i] / unit : 0.0);
    }
    fputc('\n', df);
  }
  if (fclose(df) != 0) fail("--plot: writing the data file: %s", strerror(errno));

  char script[] = "/tmp/kvpool-stat-gp-XXXXXX";
  fd = mkstemp(script);
  FILE *g = fd >= 0 ? fdopen(fd, "w") : NULL;
  if (!g) fail("--plot: temporary script: %s", strerror(errno));
  fprintf(g, "set terminal pngcairo size 1400,800 noenhanced font 'DejaVu Sans,13' linewidth 1\nset output ");
  gp_quote(g, png);
  fprintf(g, "\nset title ");
  char t[1024];
  const char *base = strrchr(path, '/');
  snprintf(t, sizeof t, "%s\n%s", title ? title : "kvpool: allocator bytes by page type, against device-level and bf16-equivalent bytes",
           base ? base + 1 : path);
  gp_quote(g, t);
  fprintf(g, "\nset xlabel '%s'\nset ylabel 'bytes (%s)'\nset grid lc rgb '#dddddd'\nset border lc rgb '#444444'\n"
             "set key outside right top vertical box opaque spacing 1.3 width 1\nset yrange [0:*]\n"
             "set style fill solid 0.85 noborder\nset xrange [*:*] noextend\nset format y '%%g'\n",
          xlabel, uname);
  static const char *const fill[] = {"#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f",
                                     "#b3b3b3", "#e5c494", "#8c564b", "#17becf", "#bcbd22", "#9467bd"};
  fprintf(g, "plot ");
  bool first = true;
  for (size_t p = 0; p < ns; p++) { /* each page type fills between the previous top and its own */
    char lower[24];
    if (p) snprintf(lower, sizeof lower, "%zu", p + 1);
    else snprintf(lower, sizeof lower, "(0)");
    fprintf(g, "%s'%s' using 1:%s:%zu with filledcurves lc rgb '%s' title 'allocated: %s pages'",
            first ? "" : ", \\\n  ", data, lower, p + 2, fill[stack_color[p] % (sizeof fill / sizeof *fill)],
            stack_name[p]);
    first = false;
  }
  for (size_t l = 0; l < 4; l++) {
    if (!col(s, lines[l]) || (l == 3 && ns)) continue; /* the stack's top is the total */
    fprintf(g, "%s'%s' using 1:%zu with lines %s title '%s'", first ? "" : ", \\\n  ", data, ns + 2 + l,
            line_style[l], line_title[l]);
    first = false;
  }
  fprintf(g, "\n");
  if (fclose(g) != 0) fail("--plot: writing the script: %s", strerror(errno));
  char cmd[256];
  snprintf(cmd, sizeof cmd, "gnuplot %s 2>&1", script);
  FILE *pipe = popen(cmd, "r");
  char msg[4096] = "";
  size_t got = pipe ? fread(msg, 1, sizeof msg - 1, pipe) : 0;
  msg[got] = 0;
  int st = pipe ? pclose(pipe) : -1;
  unlink(data);
  unlink(script);
  struct stat ps;
  if (st != 0 || stat(png, &ps) != 0 || ps.st_size == 0)
    fail("--plot: gnuplot failed to write %s%s%s", png, *msg ? ":\n" : "", msg);
  fprintf(stderr, "kvpool-stat: wrote %s (%zu points, y in %s)\n", png, s->nrows, uname);
  return 0;
}

/* ---- command line --------------------------------------------------------- */

static void usage(FILE *f) {
  fputs("usage: kvpool-stat [--json] [--top N] FILE\n"
        "       kvpool-stat diff [--json] [--all] A.json B.json\n"
        "       kvpool-stat --plot OUT.png [--title TEXT] FILE.csv\n"
        "\n"
        "Reads the JSON snapshot of kvp_stats_write (docs/telemetry.md) or the CSV time series of\n"
        "`kvpool-sim --csv` (columns found by header name: iter, allocated_bytes, and any of sim_time_s,\n"
        "requested_bytes, budget_bytes, bf16_equivalent_bytes, device_used_bytes, alloc_<page type>, ...).\n"
        "\n"
        "  FILE            print the snapshot's ledger and breakdowns, or the series' columns (min, max,\n"
        "                  final, mean), peak against the budget and the savings against bf16\n"
        "  diff A B        every figure of two snapshots that differs: A, B, B - A, change\n"
        "  --plot OUT.png  draw a series with gnuplot: allocated bytes by page type (stacked) against\n"
        "                  device-level bytes, bf16-equivalent bytes and the budget\n"
        "  --title TEXT    the plot's title\n"
        "  --json          one JSON object on stdout instead of tables\n"
        "  --top N         sequences listed in a snapshot's table (default 10)\n"
        "  --all           diff: list unchanged figures too\n"
        "  --help          this text\n"
        "\n"
        "Exit status: 0 done, 1 bad or unreadable file or failed plot, 2 bad usage.\n",
        f);
}

static void bad_usage(const char *fmt, const char *arg) __attribute__((noreturn));
static void bad_usage(const char *fmt, const char *arg) {
  fputs("kvpool-stat: ", stderr);
  fprintf(stderr, fmt, arg);
  fputs("\n(kvpool-stat --help for usage)\n", stderr);
  exit(2);
}

int main(int argc, char **argv) {
  bool json_out = false, all = false, diff = false;
  const char *png = NULL, *title = NULL, *files[2] = {NULL, NULL};
  size_t nfiles = 0, top = 10;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    } else if (!strcmp(a, "--json")) {
      json_out = true;
    } else if (!strcmp(a, "--all")) {
      all = true;
    } else if (!strcmp(a, "--plot") || !strcmp(a, "--title") || !strcmp(a, "--top")) {
      if (i + 1 >= argc) bad_usage("%s needs a value", a);
      const char *v = argv[++i];
      if (!strcmp(a, "--plot")) png = v;
      else if (!strcmp(a, "--title")) title = v;
      else {
        char *end;
        errno = 0;
        unsigned long long n = strtoull(v, &end, 10);
        if (!*v || *end || errno || n == 0 || n > 1000000) bad_usage("--top %s: give a count of 1..1000000", v);
        top = (size_t)n;
      }
    } else if (a[0] == '-' && a[1]) {
      bad_usage("unknown option %s", a);
    } else if (!diff && nfiles == 0 && !strcmp(a, "diff")) {
      diff = true;
    } else {
      if (nfiles == 2) bad_usage("too many files (%s)", a);
      files[nfiles++] = a;
    }
  }
  if (diff) {
    if (nfiles != 2) bad_usage("diff needs two snapshots%s", "");
    if (png) bad_usage("--plot draws a CSV series, not a diff%s", "");
    return run_diff(files[0], files[1], json_out, all);
  }
  if (nfiles != 1) bad_usage(nfiles ? "one file at a time (or: kvpool-stat diff A B)%s" : "no file given%s", "");
  size_t len;
  char *text = read_file(files[0], &len);
  if (sniff(text) == KIND_JSON) {
    if (png) fail("%s: --plot draws a CSV time series (kvpool-sim --csv); this is a JSON snapshot", files[0]);
    json_t *snap = load_snapshot(files[0], text);
    if (json_out) {
      json_t *o = snapshot_json(files[0], snap, top);
      json_dumpf(o, stdout, JSON_COMPACT);
      putchar('\n');
      json_decref(o);
    } else {
      print_snapshot(files[0], snap, top);
    }
    json_decref(snap);
    free(text);
    return 0;
  }
  series s;
  load_series(files[0], text, &s);
  int rc = 0;
  if (png) rc = run_plot(files[0], &s, png, title);
  if (json_out) {
    json_t *o = series_json(files[0], &s);
    json_dumpf(o, stdout, JSON_COMPACT);
    putchar('\n');
    json_decref(o);
  } else if (!png) {
    print_series(files[0], &s);
  }
  series_free(&s);
  free(text);
  return rc;
}
