/*
 * tools/traces.c - strict parsers of the azure, mooncake and sharegpt trace
 * formats (see traces.h). One pass over the bytes, line by line:
 *
 *   line  := body ("\r\n" | "\n" | end of file)      body has no '\r'
 *   file  := header line, then one request per line (no blank lines)
 *
 * Numbers are parsed by hand (digits only, range-checked), never by atoi,
 * so "12x", "-3" or "" are errors that name the line and the column.
 */
#include "traces.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"

typedef struct cursor {
  const char *p, *end; /* unread bytes */
  size_t line;         /* 1-based number of the line last returned */
  const char *name;    /* for messages */
  char *err;           /* message buffer */
  size_t errcap;       /* its bytes */
} cursor;

static int fail(cursor *c, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int fail(cursor *c, int rc, const char *fmt, ...) {
  int n = snprintf(c->err, c->errcap, "%s:%zu: ", c->name, c->line);
  if (n < 0 || (size_t)n >= c->errcap) return rc;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err + n, c->errcap - (size_t)n, fmt, ap);
  va_end(ap);
  return rc;
}

/* Next line into [*b, *e): 1, or 0 at the end, or KVP_EFORMAT for a stray CR. */
static int next_line(cursor *c, const char **b, const char **e) {
  if (c->p >= c->end) return 0;
  const char *nl = memchr(c->p, '\n', (size_t)(c->end - c->p));
  const char *stop = nl ? nl : c->end;
  *b = c->p;
  *e = stop;
  if (*e > *b && (*e)[-1] == '\r') (*e)--;
  c->p = nl ? nl + 1 : c->end;
  c->line++;
  const char *cr = memchr(*b, '\r', (size_t)(*e - *b));
  if (cr) return fail(c, KVP_EFORMAT, "carriage return inside the line (column %zu)", (size_t)(cr - *b) + 1);
  return 1;
}

/* Unsigned decimal in [lo, hi] from [*p, e) up to a ',' or e; advances *p past it. */
static int field_u64(cursor *c, const char **p, const char *e, const char *what, uint64_t lo, uint64_t hi,
                     uint64_t *out) {
  const char *s = *p, *q = s;
  uint64_t v = 0;
  while (q < e && *q >= '0' && *q <= '9') {
    if (v > (UINT64_MAX - 9) / 10) return fail(c, KVP_EFORMAT, "%s: number too large", what);
    v = v * 10 + (uint64_t)(*q++ - '0');
  }
  if (q == s) return fail(c, KVP_EFORMAT, "%s: expected an unsigned integer at column %zu", what, (size_t)(s - *p) + 1);
  if (q < e && *q != ',')
    return fail(c, KVP_EFORMAT, "%s: unexpected '%c' after the number", what, *q);
  if (v < lo || v > hi)
    return fail(c, KVP_EFORMAT, "%s = %llu out of range [%llu, %llu]", what, (unsigned long long)v,
                (unsigned long long)lo, (unsigned long long)hi);
  *p = q < e ? q + 1 : q;
  *out = v;
  return 0;
}

static int expect_header(cursor *c, const char *want) {
  const char *b, *e;
  int rc = next_line(c, &b, &e);
  if (rc < 0) return rc;
  if (rc == 0) return fail(c, KVP_EFORMAT, "empty file: expected the header \"%s\"", want);
  if ((size_t)(e - b) != strlen(want) || memcmp(b, want, strlen(want)))
    return fail(c, KVP_EFORMAT, "header is \"%.*s\", expected \"%s\"", (int)(e - b > 120 ? 120 : e - b), b, want);
  return 0;
}

static int push(cursor *c, trace *t, size_t *cap, trace_req r) {
  if (t->n == *cap) {
    size_t ncap = *cap ? *cap * 2 : 1024;
    trace_req *n = realloc(t->reqs, ncap * sizeof *n);
    if (!n) return fail(c, KVP_ENOMEM, "out of memory for %zu requests", ncap);
    t->reqs = n;
    *cap = ncap;
  }
  t->reqs[t->n++] = r;
  return 0;
}

/* Days since 1970-01-01 of a proleptic Gregorian date (Hinnant's algorithm). */
static int64_t days_from_civil(int64_t y, unsigned m, unsigned d) {
  y -= m <= 2;
  int64_t era = (y >= 0 ? y : y - 399) / 400;
  unsigned yoe = (unsigned)(y - era * 400);
  unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
  unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
  return era * 146097 + (int64_t)doe - 719468;
}

static int fixed_digits(const char *s, int n, unsigned *out) {
  unsigned v = 0;
  for (int i = 0; i < n; i++) {
    if (s[i] < '0' || s[i] > '9') return -1;
    v = v * 10 + (unsigned)(s[i] - '0');
  }
  *out = v;
  return 0;
}

/* "YYYY-MM-DD HH:MM:SS[.f{1,9}]" up to the ','; nanoseconds since the epoch. */
static int azure_time(cursor *c, const char **p, const char *e, int64_t *ns) {
  const char *s = *p;
  const char *comma = memchr(s, ',', (size_t)(e - s));
  if (!comma) return fail(c, KVP_EFORMAT, "TIMESTAMP: missing ',' after it");
  size_t n = (size_t)(comma - s);
  unsigned Y, M, D, h, m, sec, frac = 0;
  if (n < 19 || s[4] != '-' || s[7] != '-' || s[10] != ' ' || s[13] != ':' || s[16] != ':' ||
      fixed_digits(s, 4, &Y) || fixed_digits(s + 5, 2, &M) || fixed_digits(s + 8, 2, &D) ||
      fixed_digits(s + 11, 2, &h) || fixed_digits(s + 14, 2, &m) || fixed_digits(s + 17, 2, &sec))
    return fail(c, KVP_EFORMAT, "TIMESTAMP \"%.*s\": expected YYYY-MM-DD HH:MM:SS.fffffff", (int)(n > 40 ? 40 : n), s);
  size_t nf = 0;
  if (n > 19) {
    nf = n - 20;
    if (s[19] != '.' || nf < 1 || nf > 9 || fixed_digits(s + 20, (int)nf, &frac))
      return fail(c, KVP_EFORMAT, "TIMESTAMP \"%.*s\": bad fractional seconds (1 to 9 digits after '.')",
                  (int)(n > 40 ? 40 : n), s);
  }
  static const unsigned mdays[12] = {31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
  int leap = (Y % 4 == 0 && Y % 100 != 0) || Y % 400 == 0;
  if (M < 1 || M > 12 || D < 1 || D > mdays[M - 1] || (M == 2 && D == 29 && !leap) || h > 23 || m > 59 || sec > 59)
    return fail(c, KVP_EFORMAT, "TIMESTAMP \"%.*s\": no such date or time", (int)n, s);
  if (Y < 1970 || Y > 2261) /* nanoseconds since 1970, and their differences, fit 63 bits up to 2262 */
    return fail(c, KVP_EFORMAT, "TIMESTAMP \"%.*s\": year %u outside 1970..2261", (int)n, s, Y);
  for (size_t i = nf; i < 9; i++) frac *= 10;
  *ns = ((days_from_civil(Y, M, D) * 24 + h) * 60 + m) * 60 + sec;
  *ns = *ns * 1000000000 + frac;
  *p = comma + 1;
  return 0;
}

static int parse_azure(cursor *c, size_t max_reqs, trace *t) {
  size_t cap = 0;
  int rc = expect_header(c, "TIMESTAMP,ContextTokens,GeneratedTokens");
  if (rc) return rc;
  int64_t t0 = 0, prev = 0;
  const char *b, *e;
  while ((!max_reqs || t->n < max_reqs) && (rc = next_line(c, &b, &e)) > 0) {
    if (b == e) return fail(c, KVP_EFORMAT, "empty line");
    int64_t ns = 0;
    uint64_t pt, ot;
    const char *p = b;
    if ((rc = azure_time(c, &p, e, &ns)) || (rc = field_u64(c, &p, e, "ContextTokens", 1, UINT32_MAX, &pt)))
      return rc;
    if (p == e || p[-1] != ',') return fail(c, KVP_EFORMAT, "GeneratedTokens: missing (expected 3 fields)");
    if ((rc = field_u64(c, &p, e, "GeneratedTokens", 1, UINT32_MAX, &ot))) return rc;
    if (p != e) return fail(c, KVP_EFORMAT, "more than 3 fields");
    if (t->n == 0) t0 = prev = ns;
    if (ns < prev) return fail(c, KVP_EFORMAT, "TIMESTAMP goes back in time (rows must be sorted)");
    prev = ns;
    if ((rc = push(c, t, &cap, (trace_req){(double)(ns - t0) * 1e-9, (uint32_t)pt, (uint32_t)ot, 0, 0}))) return rc;
  }
  t->has_arrivals = 1;
  return rc < 0 ? rc : 0;
}

static int parse_sharegpt(cursor *c, size_t max_reqs, trace *t) {
  size_t cap = 0;
  int rc = expect_header(c, "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio");
  if (rc) return rc;
  const char *b, *e;
  while ((!max_reqs || t->n < max_reqs) && (rc = next_line(c, &b, &e)) > 0) {
    if (b == e) return fail(c, KVP_EFORMAT, "empty line");
    uint64_t pt, ot, tt;
    const char *p = b;
    if ((rc = field_u64(c, &p, e, "num_prefill_tokens", 1, UINT32_MAX, &pt))) return rc;
    if ((rc = field_u64(c, &p, e, "num_decode_tokens", 1, UINT32_MAX, &ot))) return rc;
    if ((rc = field_u64(c, &p, e, "num_total_tokens", 2, UINT64_MAX, &tt))) return rc;
    if (tt != pt + ot)
      return fail(c, KVP_EFORMAT, "num_total_tokens = %llu is not %llu + %llu", (unsigned long long)tt,
                  (unsigned long long)pt, (unsigned long long)ot);
    if (p == e || p[-1] != ',') return fail(c, KVP_EFORMAT, "pd_ratio: missing (expected 4 fields)");
    char num[64];
    size_t n = (size_t)(e - p);
    if (n == 0 || n >= sizeof num) return fail(c, KVP_EFORMAT, "pd_ratio: expected a number");
    memcpy(num, p, n);
    num[n] = 0;
    char *end;
    errno = 0;
    double r = strtod(num, &end);
    if (*end || errno || !isfinite(r) || strchr(num, ','))
      return fail(c, KVP_EFORMAT, "pd_ratio \"%s\": expected one finite number", num);
    double want = (double)pt / (double)ot;
    if (fabs(r - want) > 1e-9 * want)
      return fail(c, KVP_EFORMAT, "pd_ratio %s is not %llu / %llu", num, (unsigned long long)pt, (unsigned long long)ot);
    if ((rc = push(c, t, &cap, (trace_req){0, (uint32_t)pt, (uint32_t)ot, 0, 0}))) return rc;
  }
  t->has_arrivals = 0;
  return rc < 0 ? rc : 0;
}

static int json_uint(cursor *c, json_t *o, const char *key, uint64_t lo, uint64_t hi, uint64_t *out) {
  json_t *v = json_object_get(o, key);
  if (!v) return fail(c, KVP_EFORMAT, "missing \"%s\"", key);
  if (!json_is_integer(v)) return fail(c, KVP_EFORMAT, "\"%s\" is not an integer", key);
  json_int_t x = json_integer_value(v);
  if (x < 0 || (uint64_t)x < lo || (uint64_t)x > hi)
    return fail(c, KVP_EFORMAT, "\"%s\" = %lld out of range [%llu, %llu]", key, (long long)x, (unsigned long long)lo,
                (unsigned long long)hi);
  *out = (uint64_t)x;
  return 0;
}

static int mooncake_row(cursor *c, json_t *o, uint64_t *prev_ms, trace *t, size_t *cap, size_t *hcap) {
  uint64_t ms, in, outl;
  int rc;
  if (!json_is_object(o)) return fail(c, KVP_EFORMAT, "expected a JSON object");
  if ((rc = json_uint(c, o, "timestamp", 0, (uint64_t)1 << 53, &ms)) ||
      (rc = json_uint(c, o, "input_length", 1, UINT32_MAX, &in)) ||
      (rc = json_uint(c, o, "output_length", 1, UINT32_MAX, &outl)))
    return rc;
  json_t *h = json_object_get(o, "hash_ids");
  if (!json_is_array(h)) return fail(c, KVP_EFORMAT, "\"hash_ids\" missing or not a list");
  size_t nb = json_array_size(h), want = (size_t)((in + 511) / 512);
  if (nb != want)
    return fail(c, KVP_EFORMAT, "\"hash_ids\" has %zu entries, expected ceil(%llu / 512) = %zu", nb,
                (unsigned long long)in, want);
  for (size_t i = 0; i < nb; i++)
    if (!json_is_integer(json_array_get(h, i)) || json_integer_value(json_array_get(h, i)) < 0)
      return fail(c, KVP_EFORMAT, "\"hash_ids\"[%zu] is not a non-negative integer", i);
  if (t->n && ms < *prev_ms) return fail(c, KVP_EFORMAT, "\"timestamp\" goes back in time (rows must be sorted)");
  *prev_ms = ms;
  if (t->n_hash_ids + nb > *hcap) {
    size_t ncap = *hcap ? *hcap : 4096;
    while (ncap < t->n_hash_ids + nb) ncap *= 2;
    uint64_t *n = realloc(t->hash_ids, ncap * sizeof *n);
    if (!n) return fail(c, KVP_ENOMEM, "out of memory for %zu hash ids", ncap);
    t->hash_ids = n;
    *hcap = ncap;
  }
  size_t hash0 = t->n_hash_ids;
  for (size_t i = 0; i < nb; i++) t->hash_ids[t->n_hash_ids++] = (uint64_t)json_integer_value(json_array_get(h, i));
  return push(c, t, cap, (trace_req){(double)ms * 1e-3, (uint32_t)in, (uint32_t)outl, (uint32_t)nb, hash0});
}

static int parse_mooncake(cursor *c, size_t max_reqs, trace *t) {
  size_t cap = 0, hcap = 0;
  uint64_t prev_ms = 0;
  const char *b, *e;
  int rc = 0;
  while ((!max_reqs || t->n < max_reqs) && (rc = next_line(c, &b, &e)) > 0) {
    if (b == e) return fail(c, KVP_EFORMAT, "empty line");
    json_error_t je;
    json_t *o = json_loadb(b, (size_t)(e - b), JSON_REJECT_DUPLICATES, &je);
    if (!o) return fail(c, KVP_EFORMAT, "bad JSON at column %d: %s", je.column, je.text);
    rc = mooncake_row(c, o, &prev_ms, t, &cap, &hcap);
    json_decref(o);
    if (rc) return rc;
  }
  t->has_arrivals = 1;
  return rc < 0 ? rc : 0;
}

int trace_format_parse(const char *name, trace_format *out) {
  if (!strcmp(name, "azure")) *out = TRACE_AZURE;
  else if (!strcmp(name, "mooncake")) *out = TRACE_MOONCAKE;
  else if (!strcmp(name, "sharegpt")) *out = TRACE_SHAREGPT;
  else return KVP_EINVAL;
  return 0;
}

const char *trace_format_name(trace_format f) {
  return f == TRACE_AZURE ? "azure" : f == TRACE_MOONCAKE ? "mooncake" : "sharegpt";
}

int trace_parse(const char *buf, size_t len, const char *name, trace_format fmt, size_t max_reqs, trace *out,
                char *err, size_t errcap) {
  cursor c = {buf, buf + len, 0, name, err, errcap};
  trace t = {0};
  if (errcap) err[0] = 0;
  int rc = fmt == TRACE_AZURE ? parse_azure(&c, max_reqs, &t)
           : fmt == TRACE_MOONCAKE ? parse_mooncake(&c, max_reqs, &t)
                                   : parse_sharegpt(&c, max_reqs, &t);
  if (!rc && t.n == 0) rc = fail(&c, KVP_EFORMAT, "no requests after the header");
  if (rc) {
    trace_free(&t);
    *out = (trace){0};
    return rc;
  }
  *out = t;
  return 0;
}

int trace_load(const char *path, trace_format fmt, size_t max_reqs, trace *out, char *err, size_t errcap) {
  *out = (trace){0};
  FILE *f = fopen(path, "rb");
  if (!f) return snprintf(err, errcap, "%s: cannot open: %s", path, strerror(errno)), KVP_ENOENT;
  size_t cap = 1 << 16, n = 0;
  char *buf = malloc(cap);
  for (;;) {
    if (!buf) return fclose(f), snprintf(err, errcap, "%s: out of memory", path), KVP_ENOMEM;
    n += fread(buf + n, 1, cap - n, f);
    if (n < cap) break;
    char *nb = realloc(buf, cap *= 2);
    if (!nb) free(buf);
    buf = nb;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) return free(buf), snprintf(err, errcap, "%s: read error", path), KVP_EFORMAT;
  int rc = trace_parse(buf, n, path, fmt, max_reqs, out, err, errcap);
  free(buf);
  return rc;
}

void trace_free(trace *t) {
  free(t->reqs);
  free(t->hash_ids);
  *t = (trace){0};
}
