/*
 * tools/sim_common.c - the shared parts of kvpool-sim (see sim.h): options,
 * CSV rows from the pool's stats, the progress bar, the JSON writer,
 * synthetic K/V and the roofline cost model.
 */
#include "sim.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

double sim_cost_s(const sim_cost *c, double params, double tokens, double kv_bytes_read) {
  double compute = 2.0 * params * tokens / c->flops;
  double memory = (2.0 * params + kv_bytes_read) / c->bw;
  return compute > memory ? compute : memory;
}

const char *const sim_common_help =
    "common options:\n"
    "  --json             print one JSON object on stdout at the end (no table)\n"
    "  --dry              the pool's dry mode: pages allocated and counted, no payload written\n"
    "  --csv FILE         write the per-iteration time series (allocator bytes by page type,\n"
    "                     bf16-equivalent, device-level bytes, sequences) to FILE\n"
    "  --seed N           seed of the synthetic generators (default 1)\n"
    "  --gpu-tflops F     cost model: sustained TFLOP/s (default 312)\n"
    "  --gpu-bw-gbs F     cost model: memory bandwidth in GB/s (default 2039)\n"
    "  --quiet            no table and no progress bar\n"
    "  --help             this help\n";

void sim_common_init(sim_common *c) {
  memset(c, 0, sizeof *c);
  c->seed = 1;
  c->cost.flops = SIM_DEFAULT_TFLOPS * 1e12;
  c->cost.bw = SIM_DEFAULT_BW_GBS * 1e9;
}

static const char *need_value(int argc, char **argv, int *i) {
  if (*i + 1 >= argc) {
    fprintf(stderr, SIM_NAME ": option %s needs a value (see --help)\n", argv[*i]);
    return NULL;
  }
  return argv[++*i];
}

int sim_common_opt(sim_common *c, int argc, char **argv, int *i) {
  const char *a = argv[*i], *v;
  if (!strcmp(a, "--json")) return c->json = 1, 1;
  if (!strcmp(a, "--dry")) return c->dry = 1, 1;
  if (!strcmp(a, "--quiet")) return c->quiet = 1, 1;
  if (!strcmp(a, "--csv")) return (v = need_value(argc, argv, i)) ? (c->csv_path = v, 1) : -1;
  if (!strcmp(a, "--seed")) {
    if (!(v = need_value(argc, argv, i))) return -1;
    if (sim_parse_u64(v, 0, &c->seed)) return fprintf(stderr, SIM_NAME ": --seed %s: not an integer\n", v), -1;
    return 1;
  }
  if (!strcmp(a, "--gpu-tflops") || !strcmp(a, "--gpu-bw-gbs")) {
    double x;
    if (!(v = need_value(argc, argv, i))) return -1;
    if (sim_parse_f64(v, &x) || !(x > 0))
      return fprintf(stderr, SIM_NAME ": %s %s: expected a positive number\n", a, v), -1;
    if (a[6] == 't') c->cost.flops = x * 1e12;
    else c->cost.bw = x * 1e9;
    return 1;
  }
  return 0;
}

int sim_parse_u64(const char *s, int bytes, uint64_t *out) {
  if (!s || !*s || *s == '-' || *s == '+' || *s == ' ') return -1;
  char *e;
  errno = 0;
  unsigned long long v = strtoull(s, &e, 10);
  if (e == s || errno) return -1;
  unsigned shift = 0;
  if (bytes && *e) {
    switch (*e) {
    case 'K': case 'k': shift = 10; break;
    case 'M': case 'm': shift = 20; break;
    case 'G': case 'g': shift = 30; break;
    case 'T': case 't': shift = 40; break;
    default: return -1;
    }
    e++;
    if (*e == 'i') e++;
    if (*e == 'B') e++;
  }
  if (*e) return -1;
  if (shift && v > (UINT64_MAX >> shift)) return -1;
  *out = (uint64_t)v << shift;
  return 0;
}

int sim_parse_f64(const char *s, double *out) {
  if (!s || !*s) return -1;
  char *e;
  errno = 0;
  double v = strtod(s, &e);
  if (e == s || *e || errno || !isfinite(v)) return -1;
  *out = v;
  return 0;
}

int sim_parse_list(const char *s, uint32_t *out, uint32_t cap, uint32_t *n) {
  *n = 0;
  for (const char *p = s;;) {
    char *e;
    if (*p < '0' || *p > '9') return -1;
    errno = 0;
    unsigned long v = strtoul(p, &e, 10);
    if (errno || v < 1 || v > UINT32_MAX || *n == cap) return -1;
    out[(*n)++] = (uint32_t)v;
    if (!*e) return 0;
    if (*e != ',') return -1;
    p = e + 1;
  }
}

void sim_die_kvp(const char *what, int rc) {
  fprintf(stderr, "\n" SIM_NAME ": %s: %s (%s): %s\n", what, kvp_strerror(rc), kvp_err_name(rc), kvp_last_error());
  exit(1);
}

void sim_die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs(SIM_NAME ": ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  exit(1);
}

void sim_usage_error(const char *sub, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, SIM_NAME " %s: ", sub);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n(see " SIM_NAME " %s --help)\n", sub);
  va_end(ap);
  exit(2);
}

double sim_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

uint64_t sim_rng(uint64_t *s) { /* splitmix64 */
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double sim_rng_unit(uint64_t *s) { return ((double)(sim_rng(s) >> 11) + 0.5) * (1.0 / 9007199254740992.0); }

static uint16_t to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1); /* round to nearest even; values are finite and small */
  return (uint16_t)(u >> 16);
}

/* float -> IEEE half, round to nearest even; |f| < 65504 here, tiny values flush to 0. */
static uint16_t to_f16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  int e = (int)((u >> 23) & 0xff) - 127 + 15;
  if (e <= 0) return sign;
  uint32_t m = u & 0x7fffff, r = m & 0x1fff, h = ((uint32_t)e << 10) | (m >> 13);
  if (r > 0x1000 || (r == 0x1000 && (h & 1))) h++;
  return (uint16_t)(sign | h);
}

int sim_parse_dtype(const char *s, kvp_dtype *out) {
  if (!strcmp(s, "bf16")) *out = KVP_DTYPE_BF16;
  else if (!strcmp(s, "fp16") || !strcmp(s, "f16")) *out = KVP_DTYPE_F16;
  else if (!strcmp(s, "fp32") || !strcmp(s, "f32")) *out = KVP_DTYPE_F32;
  else return -1;
  return 0;
}

const char *sim_dtype_name(kvp_dtype d) { return d == KVP_DTYPE_BF16 ? "bf16" : d == KVP_DTYPE_F16 ? "fp16" : "fp32"; }

void *sim_kv_alloc(uint64_t n_tokens, uint32_t H, uint32_t D, kvp_dtype dtype, uint64_t seed, int is_key) {
  size_t n = (size_t)n_tokens * H * D, esz = dtype == KVP_DTYPE_F32 ? 4 : 2;
  unsigned char *buf = malloc(n * esz + 4);
  if (!buf) sim_die("out of memory for %llu synthetic K/V tokens", (unsigned long long)n_tokens);
  uint64_t s = seed * 2 + (uint64_t)is_key;
  for (size_t i = 0; i < n; i++) {
    uint64_t r = sim_rng(&s);
    /* sum of four uniforms (Irwin-Hall): mean 0 after the shift, scaled to unit variance */
    double g = ((double)(r & 0xffff) + (double)((r >> 16) & 0xffff) + (double)((r >> 32) & 0xffff) +
                (double)(r >> 48)) / 65536.0 - 2.0;
    g *= 1.732;
    if (is_key && (i % D) % 37 == 5) g = g * 4.0 + 6.0; /* outlier channels, as keys have */
    float f = (float)g;
    if (dtype == KVP_DTYPE_F32) memcpy(buf + 4 * i, &f, 4);
    else {
      uint16_t h = dtype == KVP_DTYPE_BF16 ? to_bf16(f) : to_f16(f);
      memcpy(buf + 2 * i, &h, 2);
    }
  }
  return buf;
}

void sim_json_begin(sim_json *j, FILE *f) {
  j->f = f;
  j->first = 1;
  fputc('{', f);
}

static void json_key(sim_json *j, const char *key) {
  fprintf(j->f, "%s\"%s\":", j->first ? "" : ",", key);
  j->first = 0;
}

void sim_json_u64(sim_json *j, const char *key, uint64_t v) {
  json_key(j, key);
  fprintf(j->f, "%llu", (unsigned long long)v);
}

void sim_json_f64(sim_json *j, const char *key, double v) {
  json_key(j, key);
  if (isfinite(v)) fprintf(j->f, "%.17g", v);
  else fputs("null", j->f);
}

void sim_json_str(sim_json *j, const char *key, const char *v) {
  json_key(j, key);
  if (!v) {
    fputs("null", j->f);
    return;
  }
  fputc('"', j->f);
  for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
    if (*p == '"' || *p == '\\') fprintf(j->f, "\\%c", *p);
    else if (*p < 0x20) fprintf(j->f, "\\u%04x", *p);
    else fputc(*p, j->f);
  }
  fputc('"', j->f);
}

void sim_json_end(sim_json *j) { fputs("}\n", j->f); }

void sim_stats(kvp_pool *pool, kvp_stats *s) {
  memset(s, 0, sizeof *s);
  s->struct_size = sizeof *s;
  int rc = kvp_stats_get(pool, s);
  if (rc) sim_die_kvp("kvp_stats_get", rc);
}

uint64_t sim_allocated(kvp_pool *pool) {
  kvp_usage k, v;
  int rc = kvp_stats_breakdown(pool, KVP_DIM_KV, 0, &k);
  if (rc || (rc = kvp_stats_breakdown(pool, KVP_DIM_KV, 1, &v))) sim_die_kvp("kvp_stats_breakdown", rc);
  return k.allocated_bytes + v.allocated_bytes;
}

const char *sim_bytes(uint64_t b, char *buf, size_t cap) {
  static const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double x = (double)b;
  int i = 0;
  while (x >= 1024 && i < 4) x /= 1024, i++;
  snprintf(buf, cap, i ? "%.2f %s" : "%.0f %s", x, u[i]);
  return buf;
}

int sim_run_open(sim_run *r, const sim_common *c, const char *label) {
  memset(r, 0, sizeof *r);
  r->label = label;
  r->progress = !c->quiet && isatty(2);
  if (c->csv_path) {
    r->csv = fopen(c->csv_path, "w");
    if (!r->csv) {
      fprintf(stderr, SIM_NAME ": --csv %s: cannot open for writing: %s\n", c->csv_path, strerror(errno));
      return -1;
    }
    fputs("iter,sim_time_s,running,waiting,finished,preemptions,allocated_bytes,requested_bytes,budget_bytes,"
          "bf16_equivalent_bytes,device_used_bytes,alloc_raw,alloc_codes,alloc_scales,alloc_centroids,"
          "alloc_assign,alloc_outliers,alloc_meta\n",
          r->csv);
  }
  return 0;
}

int sim_run_row(sim_run *r, const kvp_stats *st, double t_s, uint64_t running, uint64_t waiting, uint64_t finished,
                uint64_t preemptions, uint64_t budget_bytes) {
  if (!r->csv) return 0;
  const kvp_stats s = *st;
  fprintf(r->csv, "%llu,%.6f,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu,%llu", (unsigned long long)r->iter++, t_s,
          (unsigned long long)running, (unsigned long long)waiting, (unsigned long long)finished,
          (unsigned long long)preemptions, (unsigned long long)s.bytes_allocated.current,
          (unsigned long long)s.bytes_requested.current, (unsigned long long)budget_bytes,
          (unsigned long long)s.bf16_equivalent_bytes.current, (unsigned long long)s.device_used_bytes);
  for (int t = 0; t < KVP_PAGE_TYPE_COUNT; t++)
    fprintf(r->csv, ",%llu", (unsigned long long)s.page_types[t].allocated_bytes);
  if (fputc('\n', r->csv) == EOF) {
    fprintf(stderr, SIM_NAME ": --csv: write error: %s\n", strerror(errno));
    return -1;
  }
  return 0;
}

void sim_run_progress(sim_run *r, double frac) {
  if (!r->progress) return;
  double now = sim_now();
  if (now - r->last_draw < 0.1 && frac < 1.0) return;
  r->last_draw = now;
  if (frac < 0) frac = 0;
  if (frac > 1) frac = 1;
  int w = 40, fill = (int)(frac * w + 0.5);
  fprintf(stderr, "\r%-24.24s [", r->label ? r->label : "");
  for (int i = 0; i < w; i++) fputc(i < fill ? '#' : '.', stderr);
  fprintf(stderr, "] %5.1f%%", 100.0 * frac);
  fflush(stderr);
}

int sim_run_close(sim_run *r) {
  if (r->progress && r->last_draw > 0) fprintf(stderr, "\r%-80s\r", "");
  int rc = 0;
  if (r->csv && fclose(r->csv) != 0) {
    fprintf(stderr, SIM_NAME ": --csv: write error: %s\n", strerror(errno));
    rc = -1;
  }
  r->csv = NULL;
  return rc;
}

uint32_t sim_opt_u32(const char *sub, const char *opt, const char *v, uint32_t lo, uint32_t hi) {
  uint64_t x;
  if (sim_parse_u64(v, 0, &x) || x < lo || x > hi)
    sim_usage_error(sub, "%s %s: expected an integer in [%u, %u]", opt, v, lo, hi);
  return (uint32_t)x;
}

double sim_opt_pos(const char *sub, const char *opt, const char *v) {
  double x;
  if (sim_parse_f64(v, &x) || !(x > 0)) sim_usage_error(sub, "%s %s: expected a positive number", opt, v);
  return x;
}

int sim_geom_opt(const char *sub, const char *a, const char *v, uint32_t *layers, uint32_t *kv_heads,
                 uint32_t *head_dim, const char **model) {
  if (!strcmp(a, "--layers")) *layers = sim_opt_u32(sub, a, v, 1, KVP_MAX_LAYERS);
  else if (!strcmp(a, "--kv-heads")) *kv_heads = sim_opt_u32(sub, a, v, 1, KVP_MAX_KV_HEADS);
  else if (!strcmp(a, "--head-dim")) *head_dim = sim_opt_u32(sub, a, v, 1, KVP_MAX_HEAD_DIM);
  else return 0;
  *model = "custom";
  return 1;
}
