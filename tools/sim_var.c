/*
 * tools/sim_var.c - kvpool-sim var: visual autoregressive generation
 * (Infinity) through the pool, layer by layer and scale by scale.
 *
 * Each image is two CFG rows (conditional and unconditional), each a
 * KVP_SEQ_STEP sequence with the scale schedule planned. The rows run as
 * one batch: for every scale, every row begins its step; for every layer,
 * every row appends that layer's K/V; then a layer checkpoint reads the
 * ledger; then every row ends its step. So the ledger at a checkpoint is
 * what a runtime holding the whole batch holds after that layer.
 *
 *   full_cache_bytes   allocated bytes of scales 0..K-2 of every row with no
 *                      eviction (what later scales attend; HeatKV's b is a
 *                      fraction of it), measured on a one-head probe pool
 *                      with the same layers, codecs and schedule, times H
 *                      (every head of a layer has the same pages)
 *   budget_violations  checkpoints whose allocated bytes pass --budget-bytes
 *   policy_budget      heatkv: rows x floor(b x full row), in the plan's
 *                      unit (bytes, or head-token slots); checkpoints past it
 *                      are policy_budget_violations
 *   images_that_fit    floor(budget x images / peak): the rows are identical
 *                      in bytes, so the peak scales with the images
 *
 * The pool's own budget is the region: the simulator measures whether the
 * policy keeps the cache under the budget, it does not enforce it.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "sim.h"

static const uint32_t INFINITY_1024[13] = {1, 4, 16, 36, 64, 144, 256, 400, 576, 1024, 1600, 2304, 4096};

typedef struct var_preset {
  const char *name;
  uint32_t L, H, D;
  double params;
} var_preset;

/* Infinity: no GQA (KV heads = attention heads), head dim 128. */
static const var_preset PRESETS[] = {
    {"infinity-2b", 32, 16, 128, 2.0e9},
    {"infinity-8b", 40, 28, 128, 8.0e9},
};

void sim_var_defaults(sim_var_cfg *c) {
  memset(c, 0, sizeof *c);
  c->k_dtype = c->v_dtype = KVP_DTYPE_BF16;
  c->images = 1;
  sim_var_preset(c, "infinity-2b");
}

int sim_var_preset(sim_var_cfg *c, const char *name) {
  for (size_t i = 0; i < sizeof PRESETS / sizeof *PRESETS; i++)
    if (!strcmp(PRESETS[i].name, name)) {
      c->model = PRESETS[i].name;
      c->n_layers = PRESETS[i].L;
      c->n_kv_heads = PRESETS[i].H;
      c->head_dim = PRESETS[i].D;
      c->params = PRESETS[i].params;
      memcpy(c->schedule, INFINITY_1024, sizeof INFINITY_1024);
      c->n_scales = 13;
      return 0;
    }
  return -1;
}

/* b and unit of a heatkv or binary-heatkv spec (the pool validates the
 * spec; these are its defaults). 0 for any other policy. */
static int heatkv_params(const char *policy, double *b, int *unit_bytes) {
  if (!policy) return 0;
  size_t n = !strncmp(policy, "heatkv", 6) ? 6 : !strncmp(policy, "binary-heatkv", 13) ? 13 : 0;
  if (!n || (policy[n] && policy[n] != ':')) return 0;
  *b = 0.1;
  *unit_bytes = 0;
  for (const char *p = policy + n; p && *p; p = strchr(p + 1, ':')) {
    if (*p == ':') p++;
    if (!strncmp(p, "b=", 2)) *b = strtod(p + 2, NULL);
    if (!strncmp(p, "unit=bytes", 10)) *unit_bytes = 1;
  }
  return 1;
}

static uint32_t block_tokens_for(const sim_var_cfg *c) {
  uint32_t m = 0;
  for (uint32_t t = 0; t < c->n_scales; t++) m = c->schedule[t] > m ? c->schedule[t] : m;
  m = (m + 127) / 128 * 128; /* a scale per block; a multiple of every codec group */
  return m > 65536 ? 65536 : m;
}

static kvp_pool *mkpool(const sim_var_cfg *c, const sim_common *com, uint32_t H, uint64_t region, const char *policy) {
  kvp_config k;
  kvp_config_init(&k);
  k.n_layers = c->n_layers;
  k.n_kv_heads = H;
  k.head_dim = c->head_dim;
  k.k_dtype = c->k_dtype;
  k.v_dtype = c->v_dtype;
  k.block_tokens = block_tokens_for(c);
  k.region_bytes = region < KVP_MIN_REGION_BYTES ? KVP_MIN_REGION_BYTES : region;
  k.budget_bytes = 0;
  k.codecs = c->codecs;
  k.policy = policy;
  if (com->dry) {
#ifdef KVP_POOL_DRY
    k.flags |= KVP_POOL_DRY;
#else
    sim_die("--dry: this kvpool has no dry mode (KVP_POOL_DRY)");
#endif
  }
  kvp_pool *p = NULL;
  int rc = kvp_pool_create(&k, &p);
  if (rc) sim_die_kvp("kvp_pool_create", rc);
  return p;
}

static void add_row(const sim_var_cfg *c, kvp_pool *p, uint64_t id) {
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  sc.step_tokens = c->schedule;
  sc.n_steps = c->n_scales;
  int rc = kvp_seq_add(p, id, &sc);
  if (rc) sim_die_kvp("kvp_seq_add", rc);
}

static size_t dsize(kvp_dtype d) { return d == KVP_DTYPE_F32 ? 4 : 2; }

/* One head, one row, no policy: allocated/requested bytes after scale K-2 and K-1. */
static void probe(const sim_var_cfg *c, const sim_common *com, const void *k1, const void *v1, uint64_t out[3]) {
  uint64_t tokens = 0;
  for (uint32_t t = 0; t < c->n_scales; t++) tokens += c->schedule[t];
  uint64_t region = tokens * c->n_layers * c->head_dim * 8 * 2 + (64ull << 20);
  kvp_pool *p = mkpool(c, com, 1, region, NULL);
  add_row(c, p, 1);
  kvp_stats s;
  for (uint32_t t = 0; t < c->n_scales; t++) {
    int rc = kvp_step_begin(p, 1, c->schedule[t], 0);
    for (uint32_t l = 0; !rc && l < c->n_layers; l++) rc = kvp_append(p, 1, l, &(kvp_kv){k1, v1, NULL});
    if (rc || (rc = kvp_step_end(p, 1))) sim_die_kvp("full-cache probe", rc);
    if (t + 2 == c->n_scales) {
      sim_stats(p, &s);
      out[0] = s.bytes_allocated.current;
      out[1] = s.bytes_requested.current;
    }
  }
  sim_stats(p, &s);
  out[2] = s.bytes_allocated.current;
  kvp_pool_destroy(p);
}

void sim_var_run(const sim_var_cfg *c, const sim_common *com, sim_var_out *o) {
  memset(o, 0, sizeof *o);
  uint32_t L = c->n_layers, H = c->n_kv_heads, D = c->head_dim, K = c->n_scales, rows = 2 * c->images;
  uint32_t maxt = 0;
  uint64_t ctok = 0; /* c_{K-1} */
  for (uint32_t t = 0; t < K; t++) {
    maxt = c->schedule[t] > maxt ? c->schedule[t] : maxt;
    if (t + 1 < K) ctok += c->schedule[t];
  }
  void *kbuf = sim_kv_alloc(maxt, H, D, c->k_dtype, com->seed, 1);
  void *vbuf = sim_kv_alloc(maxt, H, D, c->v_dtype, com->seed, 0);
  /* The probe appends one head: the first head's rows of a [maxt][1][D] copy. */
  void *k1 = malloc((size_t)maxt * D * dsize(c->k_dtype)), *v1 = malloc((size_t)maxt * D * dsize(c->v_dtype));
  if (!k1 || !v1) sim_die("out of memory");
  for (uint32_t t = 0; t < maxt; t++) {
    memcpy((char *)k1 + (size_t)t * D * dsize(c->k_dtype), (char *)kbuf + (size_t)t * H * D * dsize(c->k_dtype),
           D * dsize(c->k_dtype));
    memcpy((char *)v1 + (size_t)t * D * dsize(c->v_dtype), (char *)vbuf + (size_t)t * H * D * dsize(c->v_dtype),
           D * dsize(c->v_dtype));
  }
  uint64_t pr[3] = {0, 0, 0};
  probe(c, com, k1, v1, pr);
  free(k1);
  free(v1);
  o->full_cache_bytes = pr[0] * H * rows;
  o->full_cache_requested_bytes = pr[1] * H * rows;
  o->all_scales_bytes = pr[2] * H * rows;
  o->bf16_full_bytes = ctok * (uint64_t)L * H * D * 2 * 2 * rows;

  double b = 0;
  int heat = heatkv_params(c->policy, &b, &o->policy_unit_bytes);
  if (heat)
    o->policy_budget = o->policy_unit_bytes ? (uint64_t)floor(b * (double)(pr[0] * H)) * rows
                                            : (uint64_t)floor(b * (double)L * H * (double)ctok) * rows;
  o->budget_bytes = c->budget_bytes   ? c->budget_bytes
                    : heat && o->policy_unit_bytes ? o->policy_budget
                    : heat                 ? (uint64_t)floor(b * (double)(pr[0] * H)) * rows
                    : c->policy            ? o->full_cache_bytes
                                           : o->all_scales_bytes;

  uint64_t region = o->all_scales_bytes + o->all_scales_bytes / 8 + (64ull << 20);
  kvp_pool *p = mkpool(c, com, H, region, c->policy);
  for (uint32_t r = 0; r < rows; r++) add_row(c, p, r + 1);
  sim_run run;
  if (sim_run_open(&run, com, c->model)) exit(1);
  double t0 = sim_now(), sim_t = 0;
  uint64_t ncp = (uint64_t)K * L, cp = 0;
  kvp_kv kv = {kbuf, vbuf, NULL};
  for (uint32_t t = 0; t < K; t++) {
    for (uint32_t r = 0; r < rows; r++) {
      int rc = kvp_step_begin(p, r + 1, c->schedule[t], 0);
      if (rc) sim_die_kvp("kvp_step_begin", rc);
    }
    for (uint32_t l = 0; l < L; l++) {
      for (uint32_t r = 0; r < rows; r++) {
        int rc = kvp_append(p, r + 1, l, &kv);
        if (rc) {
          fprintf(stderr, "\n" SIM_NAME " var: scale %u (0-based), layer %u, row %u\n", t, l, r);
          sim_die_kvp("kvp_append", rc);
        }
      }
      /* Blocks evicted during the layer wait for an RCU grace period in
       * bytes.retired; a pool at its budget reclaims them on demand, so the
       * checkpoint returns them first and reads what the cache holds. */
      int rc = kvp_reclaim(p);
      if (rc) sim_die_kvp("kvp_reclaim", rc);
      kvp_stats s;
      sim_stats(p, &s);
      cp++;
      if (s.bytes_allocated.current > o->peak_allocated_bytes) {
        o->peak_allocated_bytes = s.bytes_allocated.current;
        o->peak_requested_bytes = s.bytes_requested.current;
      }
      if (s.tokens_retained.current > o->peak_tokens_retained) o->peak_tokens_retained = s.tokens_retained.current;
      o->budget_violations += s.bytes_allocated.current > o->budget_bytes;
      if (heat)
        o->policy_budget_violations +=
            (o->policy_unit_bytes ? s.bytes_allocated.current : s.tokens_retained.current) > o->policy_budget;
      /* one layer of the batch: rows x tokens of the scale, reading the cache it holds */
      sim_t += sim_cost_s(&com->cost, c->params / L, (double)rows * c->schedule[t],
                          (double)s.bytes_allocated.current / L);
      if (sim_run_row(&run, &s, sim_t, rows, 0, 0, 0, o->budget_bytes)) exit(1);
      sim_run_progress(&run, (double)cp / (double)ncp);
    }
    for (uint32_t r = 0; r < rows; r++) {
      int rc = kvp_step_end(p, r + 1);
      if (rc) sim_die_kvp("kvp_step_end", rc);
    }
    if (c->check) {
      int rc = kvp_check(p);
      if (rc) sim_die_kvp("kvp_check", rc);
    }
  }
  o->wall_s = sim_now() - t0;
  o->sim_time_s = sim_t;
  o->checkpoints = cp;
  kvp_stats s;
  sim_stats(p, &s);
  o->tokens_evicted = s.tokens_evicted;
  int rc = kvp_check(p);
  if (rc) sim_die_kvp("kvp_check", rc);
  for (uint32_t r = 0; r < rows; r++)
    if ((rc = kvp_seq_free(p, r + 1))) sim_die_kvp("kvp_seq_free", rc);
  if ((rc = kvp_reclaim(p))) sim_die_kvp("kvp_reclaim", rc);
  sim_stats(p, &s);
  if (s.bytes_allocated.current) sim_die("ledger drift: %llu bytes still allocated after every row was freed",
                                         (unsigned long long)s.bytes_allocated.current);
  if (o->peak_allocated_bytes)
    o->images_that_fit = (uint64_t)((unsigned __int128)o->budget_bytes * c->images / o->peak_allocated_bytes);
  if (sim_run_close(&run)) exit(1);
  kvp_pool_destroy(p);
  free(kbuf);
  free(vbuf);
}

static const char *const VAR_HELP =
    "usage: " SIM_NAME " var [options]\n"
    "Visual autoregressive generation (Infinity): K/V appended layer by layer, scale by\n"
    "scale, for every CFG row of every image, under an eviction policy and codecs; the\n"
    "ledger is read after every layer of the batch.\n\n"
    "  --model NAME       infinity-2b (32 layers, 16 KV heads, 128) | infinity-8b (40, 28, 128);\n"
    "                     both with the 13-scale 1024x1024 schedule (default infinity-2b)\n"
    "  --layers N --kv-heads N --head-dim N   explicit geometry (after --model: overrides)\n"
    "  --schedule T1,T2,...   tokens per scale (explicit schedule)\n"
    "  --params N         parameters, for the cost model\n"
    "  --images N         images, two CFG rows each (default 1)\n"
    "  --k-dtype D --v-dtype D   bf16 | fp16 | fp32: appended and raw-stored dtypes (default bf16)\n"
    "  --codecs SPEC      codec spec, e.g. k=nvfp4,v=nvfp4 (default: raw)\n"
    "  --policy SPEC      e.g. heatkv:b=0.1:s=3:orders=synthetic:unit=bytes, or orders=FILE;\n"
    "                     binary-heatkv:b=0.1:s=3:scores=synthetic|FILE\n"
    "  --budget-bytes N   the budget checked at every layer checkpoint (K/M/G/T suffixes);\n"
    "                     default: heatkv's b x full cache in bytes, else the cache with no\n"
    "                     eviction (with unit=slots the plan counts head-token slots, and small\n"
    "                     scales' rounding can pass the byte budget: budget_violations shows it)\n"
    "  --check            kvp_check after every scale\n\n"
    "JSON keys: full_cache_bytes, peak_allocated_bytes, budget_bytes, budget_violations,\n"
    "images_that_fit, policy_budget, policy_budget_violations, savings_vs_bf16, ...\n\n";

static void var_print(const sim_var_cfg *c, const sim_common *com, const sim_var_out *o) {
  uint32_t rows = 2 * c->images;
  double savings = o->peak_allocated_bytes ? (double)o->bf16_full_bytes / (double)o->peak_allocated_bytes : 0;
  if (com->json) {
    sim_json j;
    sim_json_begin(&j, stdout);
    sim_json_str(&j, "subcommand", "var");
    sim_json_str(&j, "model", c->model);
    sim_json_u64(&j, "n_layers", c->n_layers);
    sim_json_u64(&j, "n_kv_heads", c->n_kv_heads);
    sim_json_u64(&j, "head_dim", c->head_dim);
    sim_json_u64(&j, "n_scales", c->n_scales);
    sim_json_str(&j, "k_dtype", sim_dtype_name(c->k_dtype));
    sim_json_str(&j, "v_dtype", sim_dtype_name(c->v_dtype));
    sim_json_str(&j, "codecs", c->codecs);
    sim_json_str(&j, "policy", c->policy);
    sim_json_u64(&j, "dry", (uint64_t)com->dry);
    sim_json_u64(&j, "images", c->images);
    sim_json_u64(&j, "rows", rows);
    sim_json_u64(&j, "full_cache_bytes", o->full_cache_bytes);
    sim_json_u64(&j, "full_cache_requested_bytes", o->full_cache_requested_bytes);
    sim_json_u64(&j, "all_scales_bytes", o->all_scales_bytes);
    sim_json_u64(&j, "bf16_full_cache_bytes", o->bf16_full_bytes);
    sim_json_u64(&j, "peak_allocated_bytes", o->peak_allocated_bytes);
    sim_json_u64(&j, "peak_requested_bytes", o->peak_requested_bytes);
    sim_json_u64(&j, "peak_tokens_retained", o->peak_tokens_retained);
    sim_json_u64(&j, "budget_bytes", o->budget_bytes);
    sim_json_u64(&j, "budget_violations", o->budget_violations);
    sim_json_str(&j, "policy_budget_unit", o->policy_budget ? (o->policy_unit_bytes ? "bytes" : "slots") : NULL);
    sim_json_u64(&j, "policy_budget", o->policy_budget);
    sim_json_u64(&j, "policy_budget_violations", o->policy_budget_violations);
    sim_json_u64(&j, "checkpoints", o->checkpoints);
    sim_json_u64(&j, "images_that_fit", o->images_that_fit);
    sim_json_u64(&j, "tokens_evicted", o->tokens_evicted);
    sim_json_f64(&j, "savings_vs_bf16", savings);
    sim_json_f64(&j, "sim_time_s", o->sim_time_s);
    sim_json_f64(&j, "wall_s", o->wall_s);
    sim_json_end(&j);
    return;
  }
  if (com->quiet) return;
  char a[32], b2[32], d[32];
  printf("var %s: %u layers x %u KV heads x %u, %u scales, %u image(s) = %u rows\n", c->model, c->n_layers,
         c->n_kv_heads, c->head_dim, c->n_scales, c->images, rows);
  printf("  codecs %s, policy %s%s\n", c->codecs ? c->codecs : "raw", c->policy ? c->policy : "none",
         com->dry ? ", dry" : "");
  printf("  full cache (scales 0..K-2)   %s (bf16: %s)\n", sim_bytes(o->full_cache_bytes, a, sizeof a),
         sim_bytes(o->bf16_full_bytes, b2, sizeof b2));
  printf("  peak allocated               %s  (%.2fx smaller than the bf16 full cache)\n",
         sim_bytes(o->peak_allocated_bytes, a, sizeof a), savings);
  printf("  budget                       %s: %llu of %llu layer checkpoints over it\n",
         sim_bytes(o->budget_bytes, d, sizeof d), (unsigned long long)o->budget_violations,
         (unsigned long long)o->checkpoints);
  if (o->policy_budget)
    printf("  heatkv budget                %llu %s: %llu checkpoints over it\n", (unsigned long long)o->policy_budget,
           o->policy_unit_bytes ? "bytes" : "head-token slots", (unsigned long long)o->policy_budget_violations);
  printf("  images that fit the budget   %llu\n", (unsigned long long)o->images_that_fit);
  printf("  simulated time %.3f s, wall %.2f s\n", o->sim_time_s, o->wall_s);
}

int sim_var_main(int argc, char **argv) {
  sim_common com;
  sim_common_init(&com);
  sim_var_cfg c;
  sim_var_defaults(&c);
  int params_set = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int r = sim_common_opt(&com, argc, argv, &i);
    if (r < 0) return 2;
    if (r) continue;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return fputs(VAR_HELP, stdout), fputs(sim_common_help, stdout), 0;
    if (!strcmp(a, "--check")) {
      c.check = 1;
      continue;
    }
    if (i + 1 >= argc) sim_usage_error("var", "unknown option or missing value: %s", a);
    const char *v = argv[++i];
    if (!strcmp(a, "--model")) {
      if (sim_var_preset(&c, v)) sim_usage_error("var", "--model %s: unknown (infinity-2b | infinity-8b)", v);
    } else if (sim_geom_opt("var", a, v, &c.n_layers, &c.n_kv_heads, &c.head_dim, &c.model)) {
      /* geometry: stored */
    } else if (!strcmp(a, "--images")) c.images = sim_opt_u32("var", a, v, 1, 1u << 20);
    else if (!strcmp(a, "--schedule")) {
      if (sim_parse_list(v, c.schedule, SIM_MAX_SCALES, &c.n_scales) || c.n_scales < 2)
        sim_usage_error("var", "--schedule %s: expected 2 to %d comma-separated token counts >= 1", v, SIM_MAX_SCALES);
      for (uint32_t t = 0; t < c.n_scales; t++)
        if (c.schedule[t] > 65536) sim_usage_error("var", "--schedule: scale %u has %u tokens (at most 65536)", t, c.schedule[t]);
      c.model = "custom";
    } else if (!strcmp(a, "--params")) {
      if (sim_parse_f64(v, &c.params) || !(c.params > 0)) sim_usage_error("var", "--params %s: expected a positive number", v);
      params_set = 1;
    } else if (!strcmp(a, "--k-dtype") || !strcmp(a, "--v-dtype")) {
      if (sim_parse_dtype(v, a[2] == 'k' ? &c.k_dtype : &c.v_dtype))
        sim_usage_error("var", "%s %s: expected bf16, fp16 or fp32", a, v);
    } else if (!strcmp(a, "--codecs")) c.codecs = v;
    else if (!strcmp(a, "--policy")) c.policy = strcmp(v, "none") ? v : NULL;
    else if (!strcmp(a, "--budget-bytes")) {
      if (sim_parse_u64(v, 1, &c.budget_bytes) || !c.budget_bytes)
        sim_usage_error("var", "--budget-bytes %s: expected a byte count > 0 (K/M/G/T suffixes)", v);
    } else sim_usage_error("var", "unknown option %s", a);
  }
  if (!params_set && !strcmp(c.model, "custom")) /* 12 L d^2: attention and MLP weights of a d-wide layer */
    c.params = 12.0 * c.n_layers * (double)c.n_kv_heads * c.head_dim * (double)c.n_kv_heads * c.head_dim;
  sim_var_out o;
  sim_var_run(&c, &com, &o);
  var_print(&c, &com, &o);
  return 0;
}
