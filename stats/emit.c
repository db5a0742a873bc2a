/*
 * stats/emit.c - the three stats formats, generated from KVP_STATS_LIST so
 * they cannot drift apart.
 *
 * JSON (one object; stable keys, documented in README.md):
 *   {"version":1,
 *    "bytes.requested":{"current":N,"peak":N,"total":N},   <- GAUGE
 *    "ops.allocs":N,                                        <- COUNTER, VALUE
 *    ...
 *    "savings.ratio":X.XXXXXX, "savings.bytes":N,           <- derived
 *    "page_types":{"raw":{"requested_bytes":N,"allocated_bytes":N,"pages":N},...},
 *    "kv":{"k":{...},"v":{...}},
 *    "layers":[{...},...], "heads":[{...},...],
 *    "codecs":{"<id>":{"name":"int8",...}},  only codecs holding pages
 *    "sequences":{"<id>":{...}}}     only sequences holding pages
 *
 * Prometheus text exposition: the key with '.' -> '_' under the prefix
 * "kvpool_"; a gauge gives NAME, NAME_peak and NAME_increase_total; a counter
 * NAME_total; breakdowns are kvpool_{requested_bytes,allocated_bytes,pages}
 * with labels dim="page_type|kv|layer|head|codec|seq" and slice="..." (and
 * codec="<name>" for dim="codec"). Every name is listed in docs/telemetry.md.
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

/* Derived figures, computed from the snapshot (not counters of their own):
 *   savings.ratio = bf16_equivalent / allocated (0 while nothing is allocated)
 *   savings.bytes = bf16_equivalent - allocated (negative when pages hold
 *                   more than bf16 would, e.g. raw fp32 or rounding) */
static double savings_ratio(const kvp_stats *s) {
  return s->bytes_allocated.current ? (double)s->bf16_equivalent_bytes.current / (double)s->bytes_allocated.current
                                    : 0.0;
}
static long long savings_bytes(const kvp_stats *s) {
  return (long long)s->bf16_equivalent_bytes.current - (long long)s->bytes_allocated.current;
}

static void prom_name(char *dst, size_t cap, const char *key) {
  size_t i = 0;
  for (; key[i] && i + 1 < cap; i++) dst[i] = key[i] == '.' ? '_' : key[i];
  dst[i] = 0;
}

/* ---- JSON --------------------------------------------------------------- */

static void json_usage_fields(out *o, const kvp_usage *u) {
  put(o, "\"requested_bytes\":%llu,\"allocated_bytes\":%llu,\"pages\":%llu", (unsigned long long)u->requested_bytes,
      (unsigned long long)u->allocated_bytes, (unsigned long long)u->npages);
}

static void json_usage(out *o, const kvp_usage *u) {
  put(o, "{");
  json_usage_fields(o, u);
  put(o, "}");
}

static void json_array(out *o, const char *name, const kvp__stats *st, kvp_stats_dim dim, uint32_t n) {
  put(o, ",\"%s\":[", name);
  for (uint32_t i = 0; i < n; i++) {
    kvp_usage u;
    kvp__stats_slice(st, dim, i, &u);
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
  put(o, ",\"savings.ratio\":%.6f,\"savings.bytes\":%lld", savings_ratio(s), savings_bytes(s));
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
  json_array(o, "layers", st, KVP_DIM_LAYER, st->n_layers);
  json_array(o, "heads", st, KVP_DIM_HEAD, st->n_heads);
  put(o, ",\"codecs\":{");
  for (uint32_t i = 0, first = 1; i < KVP__MAX_CODECS; i++) {
    kvp_usage u;
    kvp__stats_slice(st, KVP_DIM_CODEC, i, &u);
    if (!u.npages) continue;
    const char *name = src->codec_name ? src->codec_name(i) : NULL; /* [a-z0-9_-]+: no escaping */
    put(o, "%s\"%u\":{", first ? "" : ",", i);
    if (name) put(o, "\"name\":\"%s\",", name);
    json_usage_fields(o, &u);
    put(o, "}");
    first = 0;
  }
  put(o, "},\"sequences\":{");
  const kvp__seq_table *t = kvp__rcu_deref(((kvp__stats *)st)->seqt); /* the caller holds the RCU read lock */
  for (uint32_t i = 0, first = 1; i < t->cap; i++) {
    kvp_usage u;
    if (!atomic_load_explicit(&t->slot[i].used, memory_order_acquire)) continue;
    kvp__seq_usage_read(&t->slot[i], &u);
    if (!u.npages) continue;
    put(o, "%s\"%llu\":", first ? "" : ",",
        (unsigned long long)atomic_load_explicit(&t->slot[i].seq, memory_order_relaxed));
    json_usage(o, &u);
    first = 0;
  }
  put(o, "}}\n");
}

/* ---- Prometheus --------------------------------------------------------- */

/* extra: "" or more labels, each starting with a comma. */
static void prom_usage_labels(out *o, const char *dim, const char *slice, const char *extra, const kvp_usage *u) {
  put(o, "kvpool_requested_bytes{dim=\"%s\",slice=\"%s\"%s} %llu\n", dim, slice, extra,
      (unsigned long long)u->requested_bytes);
  put(o, "kvpool_allocated_bytes{dim=\"%s\",slice=\"%s\"%s} %llu\n", dim, slice, extra,
      (unsigned long long)u->allocated_bytes);
  put(o, "kvpool_pages{dim=\"%s\",slice=\"%s\"%s} %llu\n", dim, slice, extra, (unsigned long long)u->npages);
}

static void prom_usage(out *o, const char *dim, const char *slice, const kvp_usage *u) {
  prom_usage_labels(o, dim, slice, "", u);
}

static void prom_array(out *o, const char *dim, const kvp__stats *st, kvp_stats_dim d, uint32_t n, bool skip_empty) {
  for (uint32_t i = 0; i < n; i++) {
    kvp_usage u;
    char slice[24];
    kvp__stats_slice(st, d, i, &u);
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
  put(o, "# HELP kvpool_savings_ratio bf16-equivalent bytes / allocated bytes (0 while nothing is allocated)\n"
         "# TYPE kvpool_savings_ratio gauge\nkvpool_savings_ratio %.6f\n", savings_ratio(s));
  put(o, "# HELP kvpool_savings_bytes bf16-equivalent bytes - allocated bytes\n"
         "# TYPE kvpool_savings_bytes gauge\nkvpool_savings_bytes %lld\n", savings_bytes(s));
  put(o, "# HELP kvpool_requested_bytes requested bytes of live pages by dimension\n"
         "# TYPE kvpool_requested_bytes gauge\n"
         "# HELP kvpool_allocated_bytes allocated bytes of live pages by dimension\n"
         "# TYPE kvpool_allocated_bytes gauge\n"
         "# HELP kvpool_pages live pages by dimension\n# TYPE kvpool_pages gauge\n");
  for (uint32_t i = 0; i < KVP_PAGE_TYPE_COUNT; i++) prom_usage(o, "page_type", page_type_keys[i], &s->page_types[i]);
  prom_usage(o, "kv", "k", &s->kv[0]);
  prom_usage(o, "kv", "v", &s->kv[1]);
  const kvp__stats *st = src->st;
  prom_array(o, "layer", st, KVP_DIM_LAYER, st->n_layers, false);
  prom_array(o, "head", st, KVP_DIM_HEAD, st->n_heads, false);
  for (uint32_t i = 0; i < KVP__MAX_CODECS; i++) { /* slice = id; the name in a label of its own */
    kvp_usage u;
    char slice[24], extra[96] = "";
    kvp__stats_slice(st, KVP_DIM_CODEC, i, &u);
    if (!u.npages) continue;
    const char *cname = src->codec_name ? src->codec_name(i) : NULL; /* [a-z0-9_-]+: no escaping */
    snprintf(slice, sizeof slice, "%u", i);
    if (cname) snprintf(extra, sizeof extra, ",codec=\"%s\"", cname);
    prom_usage_labels(o, "codec", slice, extra, &u);
  }
  const kvp__seq_table *t = kvp__rcu_deref(((kvp__stats *)st)->seqt); /* the caller holds the RCU read lock */
  for (uint32_t i = 0; i < t->cap; i++) {
    kvp_usage u;
    char slice[24];
    if (!atomic_load_explicit(&t->slot[i].used, memory_order_acquire)) continue;
    kvp__seq_usage_read(&t->slot[i], &u);
    if (!u.npages) continue;
    snprintf(slice, sizeof slice, "%llu", (unsigned long long)atomic_load_explicit(&t->slot[i].seq, memory_order_relaxed));
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
  put(o, "%-22s %16.3f   (bf16-equivalent / allocated)\n", "savings.ratio", savings_ratio(s));
  put(o, "%-22s %16lld   (bf16-equivalent - allocated)\n", "savings.bytes", savings_bytes(s));
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
