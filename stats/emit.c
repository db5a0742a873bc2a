/*
 * stats/emit.c - the three stats formats, generated from KVP_STATS_LIST so
 * they cannot drift apart.
 *
 * JSON (one object; stable keys, documented in README.md):
 *   {"version":1,
 *    "bytes.requested":{"current":N,"peak":N,"total":N},   <- GAUGE
 *    "ops.allocs":N,                                        <- COUNTER, VALUE
 *    ...
 *    "page_types":{"raw":{"requested_bytes":N,"allocated_bytes":N,"pages":N},...},
 *    "kv":{"k":{...},"v":{...}},
 *    "layers":[{...},...], "heads":[{...},...],
 *    "codecs":{"<id>":{...}},        only codecs holding pages
 *    "sequences":{"<id>":{...}}}     only sequences holding pages
 *
 * Prometheus text exposition: the key with '.' -> '_' under the prefix
 * "kvpool_"; a gauge gives NAME, NAME_peak and NAME_increase_total; a counter
 * NAME_total; breakdowns are kvpool_{requested_bytes,allocated_bytes,pages}
 * with labels dim="page_type|kv|layer|head|codec|seq" and slice="...".
 *
 * Text: a two-part human table (ledger, then breakdown by page type and K/V).
 */
#include "stats.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

typedef struct out {
  char *buf;  /* destination, may be NULL */
  size_t cap; /* bytes of buf */
  size_t len; /* bytes the full output needs (without NUL) */
} out;

static void put(out *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(out *o, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  size_t room = o->len < o->cap ? o->cap - o->len : 0;
  int n = vsnprintf(room ? o->buf + o->len : NULL, room, fmt, ap);
  va_end(ap);
  if (n > 0) o->len += (size_t)n;
}

static const char *const page_type_keys[] = {
#define KVP__PT_KEY(name, key) key,
    KVP_PAGE_TYPE_LIST(KVP__PT_KEY)
#undef KVP__PT_KEY
};

static void prom_name(char *dst, size_t cap, const char *key) {
  size_t i = 0;
  for (; key[i] && i + 1 < cap; i++) dst[i] = key[i] == '.' ? '_' : key[i];
  dst[i] = 0;
}

/* ---- JSON --------------------------------------------------------------- */

static void json_usage(out *o, const kvp_usage *u) {
  put(o, "{\"requested_bytes\":%llu,\"allocated_bytes\":%llu,\"pages\":%llu}", (unsigned long long)u->requested_bytes,
      (unsigned long long)u->allocated_bytes, (unsigned long long)u->npages);
}

static void json_array(out *o, const char *name, const kvp__usage *arr, uint32_t n) {
  put(o, ",\"%s\":[", name);
  for (uint32_t i = 0; i < n; i++) {
    kvp_usage u;
    kvp__usage_read(&arr[i], &u);
    put(o, i ? "," : "");
    json_usage(o, &u);
  }
  put(o, "]");
}

static void emit_json(const kvp__emit_src *src, out *o) {
  const kvp_stats *s = src->s;
  put(o, "{\"version\":%u", s->version);
#define G(f) \
  put(o, ",\"%s\":{\"current\":%llu,\"peak\":%llu,\"total\":%llu}", key, (unsigned long long)s->f.current, \
      (unsigned long long)s->f.peak, (unsigned long long)s->f.total);
#define C(f) put(o, ",\"%s\":%llu", key, (unsigned long long)s->f);
#define X(kind, f, k, help)      \
  {                              \
    const char *key = k;         \
    KVP__EMIT_##kind(f)          \
  }
#define KVP__EMIT_GAUGE(f) G(f)
#define KVP__EMIT_COUNTER(f) C(f)
#define KVP__EMIT_VALUE(f) C(f)
  KVP_STATS_LIST(X)
#undef X
  put(o, ",\"page_types\":{");
  for (uint32_t i = 0; i < KVP_PAGE_TYPE_COUNT; i++) {
    put(o, "%s\"%s\":", i ? "," : "", page_type_keys[i]);
    json_usage(o, &s->page_types[i]);
  }
  put(o, "},\"kv\":{\"k\":");
  json_usage(o, &s->kv[0]);
  put(o, ",\"v\":");
  json_usage(o, &s->kv[1]);
  put(o, "}");
  const kvp__stats *st = src->st;
  json_array(o, "layers", st->layers, st->n_layers);
  json_array(o, "heads", st->heads, st->n_heads);
  put(o, ",\"codecs\":{");
  for (uint32_t i = 0, first = 1; i < KVP__MAX_CODECS; i++) {
    kvp_usage u;
    kvp__usage_read(&st->codecs[i], &u);
    if (!u.npages) continue;
    put(o, "%s\"%u\":", first ? "" : ",", i);
    json_usage(o, &u);
    first = 0;
  }
  put(o, "},\"sequences\":{");
  for (uint32_t i = 0, first = 1; i < st->seq_cap; i++) {
    kvp_usage u;
    if (!st->seqs[i].used) continue;
    kvp__usage_read(&st->seqs[i].u, &u);
    if (!u.npages) continue;
    put(o, "%s\"%llu\":", first ? "" : ",", (unsigned long long)st->seqs[i].seq);
    json_usage(o, &u);
    first = 0;
  }
  put(o, "}}\n");
}

/* ---- Prometheus --------------------------------------------------------- */

static void prom_usage(out *o, const char *dim, const char *slice, const kvp_usage *u) {
  put(o, "kvpool_requested_bytes{dim=\"%s\",slice=\"%s\"} %llu\n", dim, slice, (unsigned long long)u->requested_bytes);
  put(o, "kvpool_allocated_bytes{dim=\"%s\",slice=\"%s\"} %llu\n", dim, slice, (unsigned long long)u->allocated_bytes);
  put(o, "kvpool_pages{dim=\"%s\",slice=\"%s\"} %llu\n", dim, slice, (unsigned long long)u->npages);
}

static void prom_array(out *o, const char *dim, const kvp__usage *arr, uint32_t n, bool skip_empty) {
  for (uint32_t i = 0; i < n; i++) {
    kvp_usage u;
    char slice[24];
    kvp__usage_read(&arr[i], &u);
    if (skip_empty && !u.npages) continue;
    snprintf(slice, sizeof slice, "%u", i);
    prom_usage(o, dim, slice, &u);
  }
}

static void emit_prometheus(const kvp__emit_src *src, out *o) {
  const kvp_stats *s = src->s;
  char name[96];
#define X(kind, f, k, help) \
  prom_name(name, sizeof name, k); \
  KVP__PROM_##kind(f, help)
#define KVP__PROM_GAUGE(f, help)                                                                          \
  put(o, "# HELP kvpool_%s %s\n# TYPE kvpool_%s gauge\nkvpool_%s %llu\n", name, help, name, name,         \
      (unsigned long long)s->f.current);                                                                  \
  put(o, "# HELP kvpool_%s_peak %s (peak)\n# TYPE kvpool_%s_peak gauge\nkvpool_%s_peak %llu\n", name, help, \
      name, name, (unsigned long long)s->f.peak);                                                         \
  put(o, "# HELP kvpool_%s_increase_total %s (sum of increases)\n# TYPE kvpool_%s_increase_total counter\n" \
         "kvpool_%s_increase_total %llu\n", name, help, name, name, (unsigned long long)s->f.total);
#define KVP__PROM_COUNTER(f, help) \
  put(o, "# HELP kvpool_%s_total %s\n# TYPE kvpool_%s_total counter\nkvpool_%s_total %llu\n", name, help, name, \
      name, (unsigned long long)s->f);
#define KVP__PROM_VALUE(f, help) \
  put(o, "# HELP kvpool_%s %s\n# TYPE kvpool_%s gauge\nkvpool_%s %llu\n", name, help, name, name, \
      (unsigned long long)s->f);
  KVP_STATS_LIST(X)
#undef X
  put(o, "# HELP kvpool_requested_bytes requested bytes of live pages by dimension\n"
         "# TYPE kvpool_requested_bytes gauge\n"
         "# HELP kvpool_allocated_bytes allocated bytes of live pages by dimension\n"
         "# TYPE kvpool_allocated_bytes gauge\n"
         "# HELP kvpool_pages live pages by dimension\n# TYPE kvpool_pages gauge\n");
  for (uint32_t i = 0; i < KVP_PAGE_TYPE_COUNT; i++) prom_usage(o, "page_type", page_type_keys[i], &s->page_types[i]);
  prom_usage(o, "kv", "k", &s->kv[0]);
  prom_usage(o, "kv", "v", &s->kv[1]);
  const kvp__stats *st = src->st;
  prom_array(o, "layer", st->layers, st->n_layers, false);
  prom_array(o, "head", st->heads, st->n_heads, false);
  prom_array(o, "codec", st->codecs, KVP__MAX_CODECS, true);
  for (uint32_t i = 0; i < st->seq_cap; i++) {
    kvp_usage u;
    char slice[24];
    if (!st->seqs[i].used) continue;
    kvp__usage_read(&st->seqs[i].u, &u);
    if (!u.npages) continue;
    snprintf(slice, sizeof slice, "%llu", (unsigned long long)st->seqs[i].seq);
    prom_usage(o, "seq", slice, &u);
  }
}

/* ---- text --------------------------------------------------------------- */

static void emit_text(const kvp__emit_src *src, out *o) {
  const kvp_stats *s = src->s;
  put(o, "%-22s %16s %16s %18s\n", "ledger", "current", "peak", "total");
#define X(kind, f, k, help) KVP__TEXT_##kind(f, k)
#define KVP__TEXT_GAUGE(f, k) \
  put(o, "%-22s %16llu %16llu %18llu\n", k, (unsigned long long)s->f.current, (unsigned long long)s->f.peak, \
      (unsigned long long)s->f.total);
#define KVP__TEXT_COUNTER(f, k) put(o, "%-22s %16s %16s %18llu\n", k, "", "", (unsigned long long)s->f);
#define KVP__TEXT_VALUE(f, k) put(o, "%-22s %16llu\n", k, (unsigned long long)s->f);
  KVP_STATS_LIST(X)
#undef X
  put(o, "\n%-22s %16s %16s %18s\n", "by page type / side", "requested", "allocated", "pages");
  for (uint32_t i = 0; i < KVP_PAGE_TYPE_COUNT; i++)
    put(o, "%-22s %16llu %16llu %18llu\n", page_type_keys[i], (unsigned long long)s->page_types[i].requested_bytes,
        (unsigned long long)s->page_types[i].allocated_bytes, (unsigned long long)s->page_types[i].npages);
  for (uint32_t i = 0; i < 2; i++)
    put(o, "%-22s %16llu %16llu %18llu\n", i ? "V" : "K", (unsigned long long)s->kv[i].requested_bytes,
        (unsigned long long)s->kv[i].allocated_bytes, (unsigned long long)s->kv[i].npages);
}

int kvp__stats_emit(const kvp__emit_src *src, kvp_stats_format fmt, char *buf, size_t cap, size_t *len) {
  out o = {buf, buf ? cap : 0, 0};
  if (o.cap) o.buf[0] = 0;
  switch (fmt) {
  case KVP_STATS_JSON: emit_json(src, &o); break;
  case KVP_STATS_PROMETHEUS: emit_prometheus(src, &o); break;
  case KVP_STATS_TEXT: emit_text(src, &o); break;
  default: return kvp__err(KVP_EINVAL, "stats format %d is not JSON (0), PROMETHEUS (1) or TEXT (2)", (int)fmt);
  }
  if (len) *len = o.len;
  if (o.len >= o.cap)
    return kvp__err(KVP_ENOSPC, "stats output needs %zu bytes plus the NUL, buffer holds %zu", o.len, o.cap);
  return KVP_OK;
}
