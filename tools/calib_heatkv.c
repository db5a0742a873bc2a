/*
 * tools/calib_heatkv.c - `kvpool-calib heatkv` (removal orders from
 * attention mass) and `kvpool-calib plan` (what a HeatKV plan does).
 */
#include "calib.h"

#include "../pages/heatkv.h"
#include "../pages/policy.h"

#include <getopt.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_SCALES 64
#define MAX_MASS_FILES 64

/* Geometry from --preset or --layers/--heads/--head-dim/--schedule. */
typedef struct geom {
  uint32_t L, H, D, K;
  uint32_t tokens[MAX_SCALES];
  bool have_tokens;
} geom;

static int geom_preset(geom *g, const char *cmd, const char *name) {
  const calib_preset *p = calib_preset_find(name);
  if (!p) return calib_fail(2, cmd, "--preset %s: unknown (infinity-2b, infinity-8b)", name);
  g->L = p->layers, g->H = p->heads, g->D = p->head_dim, g->K = p->n_scales;
  memcpy(g->tokens, p->tokens, p->n_scales * sizeof *p->tokens);
  g->have_tokens = true;
  return 0;
}

static int geom_schedule(geom *g, const char *cmd, const char *v) {
  uint32_t n = calib_schedule_parse(v, g->tokens, MAX_SCALES);
  if (n < 2) return calib_fail(2, cmd, "--schedule %s: expected 2..%d positive token counts, comma-separated", v,
                               MAX_SCALES);
  g->K = n, g->have_tokens = true;
  return 0;
}

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* ---- kvpool-calib heatkv ------------------------------------------------ */

static void heatkv_usage(FILE *f) {
  fprintf(f,
          "usage: kvpool-calib heatkv (--mass FILE ... | --synthetic) (--preset NAME | --layers L --heads H "
          "--scales K)\n"
          "                           [--sinks S] --out PREFIX [--prompts N] [--seed N] [--json]\n\n"
          "Computes HeatKV removal orders from attention-mass summaries beta[l][h][k1][k2] (the mass scale k1's\n"
          "queries put on scale k2, averaged over queries; 0-based scales): S-CAS (paper Eq. 4) per source\n"
          "scale and CAS (Eq. 3) per head, sorted ascending, ties by head then layer. Writes\n"
          "  PREFIX.orders.json   S-CAS orders, the shipped HeatKV format ([head, layer] pairs)\n"
          "  PREFIX.kvpool.json   S-CAS orders, kvpool's versioned format with a checksum (heatkv:orders=)\n"
          "  PREFIX.cas.json      the CAS order of whole heads (binary-heatkv:scores=)\n\n"
          "  --mass FILE     a summary: .npy [L,H,K,K] or [P,L,H,K,K] (float16/32/64), or .json with \"beta\"\n"
          "                  as nested lists of the same shapes; repeat for more prompts (all are averaged)\n"
          "  --synthetic     summaries from the built-in generator (the head patterns of the paper's Fig. 3)\n"
          "  --prompts N     synthetic prompts (default 10)        --seed N   synthetic seed (default 1)\n"
          "  --preset NAME   infinity-2b | infinity-8b (13 scales)  --sinks S  sink scales (default 3)\n"
          "  --json          print the summary as one JSON object on stdout\n");
}

/* min, median, max of v[n] (sorted in place). */
static int dcmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int kvp_calib_heatkv_main(int argc, char **argv) {
  static const struct option opts[] = {
      {"mass", required_argument, 0, 'm'},   {"synthetic", no_argument, 0, 'y'}, {"preset", required_argument, 0, 'p'},
      {"layers", required_argument, 0, 'L'}, {"heads", required_argument, 0, 'H'},
      {"scales", required_argument, 0, 'K'}, {"sinks", required_argument, 0, 's'},
      {"out", required_argument, 0, 'o'},    {"prompts", required_argument, 0, 'P'},
      {"seed", required_argument, 0, 'S'},   {"json", no_argument, 0, 'j'},    {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0}};
  const char *cmd = "heatkv", *files[MAX_MASS_FILES], *out = NULL;
  uint32_t nfiles = 0, sinks = 3, prompts = 10, seed32 = 1;
  bool synth = false, json = false;
  geom g = {0};
  optind = 1;
  for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
    switch (c) {
    case 'm':
      if (nfiles == MAX_MASS_FILES) return calib_fail(2, cmd, "more than %d --mass files", MAX_MASS_FILES);
      files[nfiles++] = optarg;
      break;
    case 'y': synth = true; break;
    case 'p':
      if (geom_preset(&g, cmd, optarg)) return 2;
      break;
    case 'L': if (calib_u32("--layers", optarg, 1, 65535, &g.L)) return 2; break;
    case 'H': if (calib_u32("--heads", optarg, 1, 65535, &g.H)) return 2; break;
    case 'K': if (calib_u32("--scales", optarg, 2, 4096, &g.K)) return 2; break;
    case 's': if (calib_u32("--sinks", optarg, 0, 4095, &sinks)) return 2; break;
    case 'P': if (calib_u32("--prompts", optarg, 1, 100000, &prompts)) return 2; break;
    case 'S': if (calib_u32("--seed", optarg, 0, UINT32_MAX, &seed32)) return 2; break;
    case 'o': out = optarg; break;
    case 'j': json = true; break;
    case 'h': heatkv_usage(stdout); return 0;
    default: heatkv_usage(stderr); return 2;
    }
  }
  if (optind < argc) return calib_fail(2, cmd, "unexpected argument \"%s\"", argv[optind]);
  if (!out) return calib_fail(2, cmd, "--out PREFIX is required (see --help)");
  if (!nfiles && !synth) return calib_fail(2, cmd, "give --mass FILE (one or more) or --synthetic");
  if (nfiles && synth) return calib_fail(2, cmd, "--mass and --synthetic exclude each other");
  if (!g.L || !g.H || !g.K) return calib_fail(2, cmd, "give --preset, or --layers, --heads and --scales");
  if (sinks > g.K - 1) return calib_fail(2, cmd, "--sinks %u: at most scales - 1 = %u", sinks, g.K - 1);
  char probe[4096];
  snprintf(probe, sizeof probe, "%s.orders.json", out);
  if (calib_out_ok(cmd, probe)) return 1;

  kvp__mass m;
  kvp__orders scas = {0}, cas = {0};
  int rc = kvp__mass_init(&m, g.L, g.H, g.K);
  for (uint32_t i = 0; !rc && i < nfiles; i++) rc = kvp__mass_add_file(&m, files[i]);
  if (!rc && synth) rc = kvp__mass_synthetic(&m, sinks, seed32, prompts);
  if (!rc) rc = kvp__orders_from_mass(&scas, &m, sinks, false, NULL);
  if (!rc) rc = kvp__orders_from_mass(&cas, &m, sinks, true, NULL);
  char path[3][4096];
  snprintf(path[0], sizeof path[0], "%s.orders.json", out);
  snprintf(path[1], sizeof path[1], "%s.kvpool.json", out);
  snprintf(path[2], sizeof path[2], "%s.cas.json", out);
  if (!rc) rc = kvp__orders_write_shipped(&scas, path[0]);
  if (!rc) rc = kvp__orders_write(&scas, path[1]);
  if (!rc) rc = kvp__orders_write(&cas, path[2]);
  if (rc) {
    int code = calib_fail(1, cmd, "%s", kvp_last_error());
    kvp__orders_free(&scas), kvp__orders_free(&cas), kvp__mass_free(&m);
    return code;
  }
  uint32_t T = g.L * g.H;
  double *v = malloc((size_t)T * sizeof *v);
  FILE *f = stdout;
  if (json) fprintf(f, "{\"layers\": %u, \"heads\": %u, \"scales\": %u, \"sink_scales\": %u, \"prompts\": %u, "
                       "\"files\": {\"shipped\": \"%s\", \"kvpool\": \"%s\", \"cas\": \"%s\"}, \"scas\": [",
                    g.L, g.H, g.K, sinks, m.n_prompts, path[0], path[1], path[2]);
  else fprintf(f, "heatkv calibration: L=%u H=%u K=%u s=%u, %u prompt%s\n  source  paper   S-CAS min     median"
                  "        max   first evicted (layer, head)\n", g.L, g.H, g.K, sinks, m.n_prompts,
               m.n_prompts == 1 ? "" : "s");
  for (uint32_t t = sinks; v && t + 1 < g.K; t++) {
    for (uint32_t p = 0; p < T; p++) kvp__mass_scas(&m, sinks, t, p / g.H, p % g.H, &v[p]);
    qsort(v, T, sizeof *v, dcmp);
    uint32_t first = kvp__orders_pair(&scas, t, 0);
    if (json)
      fprintf(f, "%s{\"source\": %u, \"min\": %.6g, \"median\": %.6g, \"max\": %.6g, \"first\": [%u, %u]}",
              t > sinks ? ", " : "", t, v[0], v[T / 2], v[T - 1], first / g.H, first % g.H);
    else
      fprintf(f, "  %6u  %5u  %10.4g %10.4g %10.4g   (%u, %u)\n", t, t + 1, v[0], v[T / 2], v[T - 1], first / g.H,
              first % g.H);
  }
  for (uint32_t p = 0; v && p < T; p++) kvp__mass_cas(&m, sinks, p / g.H, p % g.H, &v[p]);
  if (v) qsort(v, T, sizeof *v, dcmp);
  uint32_t c0 = cas.n_orders ? cas.pairs[0] : 0;
  if (json)
    fprintf(f, "], \"cas\": {\"min\": %.6g, \"median\": %.6g, \"max\": %.6g, \"first\": [%u, %u]}}\n", v ? v[0] : 0,
            v ? v[T / 2] : 0, v ? v[T - 1] : 0, c0 / g.H, c0 % g.H);
  else
    fprintf(f, "  CAS: min %.4g median %.4g max %.4g, first evicted (layer %u, head %u)\n  wrote %s, %s, %s\n",
            v ? v[0] : 0, v ? v[T / 2] : 0, v ? v[T - 1] : 0, c0 / g.H, c0 % g.H, path[0], path[1], path[2]);
  free(v);
  kvp__orders_free(&scas), kvp__orders_free(&cas), kvp__mass_free(&m);
  return 0;
}

/* ---- kvpool-calib plan -------------------------------------------------- */

static void plan_usage(FILE *f) {
  fprintf(f,
          "usage: kvpool-calib plan [--orders FILE|synthetic] [--binary] (--preset NAME | --layers L --heads H\n"
          "                         --schedule T1,T2,... [--head-dim D]) --b B [--sinks S]\n"
          "                         [--codecs SPEC --bytes] [--block-tokens N] [--dtype bf16|fp16|fp32] [--json]\n\n"
          "Builds the HeatKV plan (DESIGN.md section 8) and prints, per 0-based scale t: the N in force during t\n"
          "(the paper's N_{t+1}), |E| (heads evicted early, at the start of t) and the largest occupancy after\n"
          "any layer, against the budget B: head-token slots per batch row, or with --bytes the allocated bytes\n"
          "of one sequence under --codecs (size classes included).\n\n"
          "  --orders FILE   removal orders: the shipped JSON format or kvpool's (default: synthetic)\n"
          "  --binary        Binary-HeatKV: whole heads by one CAS order (a kind \"cas\" file, or synthetic)\n"
          "  --preset NAME   infinity-2b | infinity-8b (geometry and the 13-scale 1024x1024 schedule)\n"
          "  --b B           budget fraction of the full cache, in (0, 1]\n"
          "  --sinks S       sink scales always kept (default 3)   --seed N   synthetic orders' seed (default 1)\n"
          "  --codecs SPEC --bytes   plan in allocated bytes under a codec spec (--dtype: appended dtype, bf16)\n"
          "  --block-tokens N        tokens per block (default 0: chosen per layer by the codecs, as a pool does)\n"
          "  --json          one JSON object on stdout: prune_counts, early_counts, max_occupancy (lists by\n"
          "                  0-based scale), budget, and more\n");
}

/* Atom bytes of the geometry under codecs, through a pool's bindings. */
static int plan_bytes(const geom *g, const char *codecs, uint32_t block_tokens, kvp_dtype dt, uint64_t **out) {
  kvp_config cfg;
  kvp_config_init(&cfg);
  cfg.n_layers = g->L, cfg.n_kv_heads = g->H, cfg.head_dim = g->D, cfg.k_dtype = cfg.v_dtype = dt;
  cfg.codecs = codecs, cfg.block_tokens = block_tokens, cfg.region_bytes = 16u << 20;
  kvp_pool *pool;
  int rc = kvp_pool_create(&cfg, &pool);
  if (rc) return rc;
  *out = kvp__heatkv_atom_bytes(pool, g->tokens, g->K);
  kvp_pool_destroy(pool);
  return *out ? KVP_OK : kvp__err(KVP_ENOMEM, "atom bytes");
}

int kvp_calib_plan_main(int argc, char **argv) {
  static const struct option opts[] = {
      {"orders", required_argument, 0, 'o'},   {"binary", no_argument, 0, 'B'},
      {"preset", required_argument, 0, 'p'},   {"layers", required_argument, 0, 'L'},
      {"heads", required_argument, 0, 'H'},    {"head-dim", required_argument, 0, 'D'},
      {"schedule", required_argument, 0, 'T'}, {"b", required_argument, 0, 'b'},
      {"sinks", required_argument, 0, 's'},    {"codecs", required_argument, 0, 'c'},
      {"bytes", no_argument, 0, 'y'},          {"block-tokens", required_argument, 0, 'n'},
      {"dtype", required_argument, 0, 't'},    {"seed", required_argument, 0, 'S'},
      {"json", no_argument, 0, 'j'},           {"help", no_argument, 0, 'h'},
      {0, 0, 0, 0}};
  const char *cmd = "plan", *orders_src = "synthetic", *codecs = NULL;
  uint32_t sinks = 3, block_tokens = 0, seed32 = 1; /* 0: the pool's choice per layer, as kvp_config's */
  double b = 0;
  bool binary = false, bytes = false, json = false;
  kvp_dtype dt = KVP_DTYPE_BF16;
  geom g = {.D = 128};
  optind = 1;
  for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
    char *e;
    switch (c) {
    case 'o': orders_src = optarg; break;
    case 'B': binary = true; break;
    case 'p':
      if (geom_preset(&g, cmd, optarg)) return 2;
      break;
    case 'L': if (calib_u32("--layers", optarg, 1, 65535, &g.L)) return 2; break;
    case 'H': if (calib_u32("--heads", optarg, 1, 65535, &g.H)) return 2; break;
    case 'D': if (calib_u32("--head-dim", optarg, 1, 65535, &g.D)) return 2; break;
    case 'T':
      if (geom_schedule(&g, cmd, optarg)) return 2;
      break;
    case 'b':
      b = strtod(optarg, &e);
      if (*e || !(b > 0 && b <= 1)) return calib_fail(2, cmd, "--b %s: expected a fraction in (0, 1]", optarg);
      break;
    case 's': if (calib_u32("--sinks", optarg, 0, MAX_SCALES - 1, &sinks)) return 2; break;
    case 'c': codecs = optarg; break;
    case 'y': bytes = true; break;
    case 'n': if (calib_u32("--block-tokens", optarg, 0, 65536, &block_tokens)) return 2; break;
    case 'S': if (calib_u32("--seed", optarg, 0, UINT32_MAX, &seed32)) return 2; break;
    case 't':
      if (!strcmp(optarg, "bf16")) dt = KVP_DTYPE_BF16;
      else if (!strcmp(optarg, "fp16")) dt = KVP_DTYPE_F16;
      else if (!strcmp(optarg, "fp32")) dt = KVP_DTYPE_F32;
      else return calib_fail(2, cmd, "--dtype %s: expected bf16, fp16 or fp32", optarg);
      break;
    case 'j': json = true; break;
    case 'h': plan_usage(stdout); return 0;
    default: plan_usage(stderr); return 2;
    }
  }
  if (optind < argc) return calib_fail(2, cmd, "unexpected argument \"%s\"", argv[optind]);
  if (!g.L || !g.H || !g.have_tokens)
    return calib_fail(2, cmd, "give --preset, or --layers, --heads and --schedule");
  if (b == 0) return calib_fail(2, cmd, "--b B is required (budget fraction in (0, 1])");
  if (codecs && !bytes) return calib_fail(2, cmd, "--codecs only matters with --bytes");
  if (sinks > g.K - 1) return calib_fail(2, cmd, "--sinks %u: at most scales - 1 = %u", sinks, g.K - 1);

  kvp__orders o;
  uint64_t *ab = NULL;
  kvp__heatkv_plan plan;
  int rc = !strcmp(orders_src, "synthetic")
               ? kvp__orders_synthetic_kind(&o, g.L, g.H, g.K, sinks, seed32, binary, NULL)
               : kvp__orders_load(&o, orders_src, g.L, g.H, g.K, sinks, NULL);
  if (!rc && bytes) rc = plan_bytes(&g, codecs, block_tokens, dt, &ab);
  double t0 = now_ms(), ms = 0;
  if (!rc) {
    kvp__heatkv_in in = {.n_layers = g.L, .n_heads = g.H, .n_scales = g.K, .scale_tokens = g.tokens,
                         .n_sinks = sinks, .b = b, .orders = &o,
                         .unit = bytes ? KVP__HEATKV_BYTES : KVP__HEATKV_SLOTS, .atom_bytes = ab,
                         .binary = binary};
    rc = kvp__heatkv_plan_build(&plan, &in, NULL);
    ms = now_ms() - t0;
  }
  free(ab);
  if (rc) {
    int code = calib_fail(1, cmd, "%s", kvp_last_error());
    kvp__orders_free(&o);
    return code;
  }
  if (json) {
    char *js;
    if (kvp__heatkv_plan_json(&plan, &js)) rc = calib_fail(1, cmd, "%s", kvp_last_error());
    else printf("%.*s, \"plan_ms\": %.3f}\n", (int)strlen(js) - 1, js, ms), free(js);
  } else {
    kvp__heatkv_plan_print(&plan, stdout);
    printf("  planned in %.2f ms\n", ms);
  }
  kvp__heatkv_plan_free(&plan);
  kvp__orders_free(&o);
  return rc ? 1 : 0;
}
