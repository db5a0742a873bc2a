/*
 * kvpool-sim - drives the pool's public ABI the way a serving engine's
 * scheduler would, and shows in bytes, at the allocator, what compression
 * and eviction buy under a budget. Public headers only.
 *
 *   kvpool-sim                 the tour: a short embedded run of each kind, one table
 *   kvpool-sim llm   [opts]    continuous batching (vLLM-like) on a trace or synthetic load
 *   kvpool-sim var   [opts]    visual autoregressive generation (Infinity, HeatKV)
 *   kvpool-sim video [opts]    chunked autoregressive video (window, multishot)
 *
 * Every subcommand takes --help, --json, --dry, --csv FILE (sim.h).
 */
#include <stdlib.h>
#include <string.h>

#include "kvpool_codec.h"
#include "sim.h"

static const char *const HELP =
    "usage: " SIM_NAME " [llm|var|video] [options]\n"
    "Drives a kvpool pool like a serving engine's scheduler and reports, in bytes at the\n"
    "allocator, what codecs and eviction policies save under a strict budget.\n\n"
    "  (no arguments)   the tour: an LLM load at a fixed byte budget under raw bf16, fp8,\n"
    "                   kivi, nvfp4 (and qvg, kvquant when registered), and Infinity-2B with\n"
    "                   HeatKV at b = 0.2, 0.1, 0.04, alone and with nvfp4; one table\n"
    "  llm              continuous batching on a trace or synthetic arrivals\n"
    "  var              visual autoregressive generation (Infinity presets, HeatKV)\n"
    "  video            chunked autoregressive video (window, multishot)\n\n"
    "  " SIM_NAME " SUBCOMMAND --help   the options of a subcommand\n"
    "  --json (tour)    one JSON object with a row per run\n";

/* ---- the tour ---------------------------------------------------------- */

typedef struct tour_row {
  char run[40], codecs[40], policy[48], served[64];
  uint64_t peak_bytes;     /* allocated peak */
  uint64_t peak_req_bytes; /* requested bytes at the allocated peak */
  double savings;          /* bf16 bytes / allocated */
  uint64_t violations;     /* checkpoints over a budget */
} tour_row;

#define TOUR_LLM_BUDGET (384ull << 20)
#define TOUR_MAX_ROWS 16

/* A spec the pool accepts? (Codecs that are registered but need files, or
 * are absent, are left out of the tour with a note.) */
static int spec_usable(const char *codecs, char *why, size_t cap) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 2;
  c.n_kv_heads = 1;
  c.block_tokens = 32;
  c.codecs = codecs;
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) return snprintf(why, cap, "%s", kvp_last_error()), 0;
  kvp_pool_destroy(p);
  return 1;
}

static void tour_llm(const sim_common *com, const char *name, const char *codecs, int dry, tour_row *r) {
  sim_llm_cfg c;
  sim_llm_defaults(&c);
  sim_llm_preset(&c, "llama-3-8b");
  c.codecs = codecs;
  c.budget_bytes = TOUR_LLM_BUDGET;
  c.requests = 48;
  c.rate = 20;
  c.prompt_median = 512;
  c.output_median = 96;
  c.max_prompt = 2048;
  c.max_output = 512;
  sim_llm_out o;
  sim_common cd = *com;
  cd.dry = dry;
  sim_llm_run(&c, &cd, &o);
  snprintf(r->run, sizeof r->run, "llm llama-3-8b");
  snprintf(r->codecs, sizeof r->codecs, "%s%s", name, dry ? " (dry)" : "");
  snprintf(r->policy, sizeof r->policy, "none");
  snprintf(r->served, sizeof r->served, "%llu/%llu req, <=%llu at once, %.0f tok/s",
           (unsigned long long)o.requests_finished, (unsigned long long)o.requests_total,
           (unsigned long long)o.max_running, o.throughput_tokens_per_s);
  r->peak_bytes = o.peak_allocated_bytes;
  r->peak_req_bytes = o.peak_requested_bytes;
  r->savings = o.savings_vs_bf16;
  r->violations = o.budget_violations;
}

static void tour_var(const sim_common *com, double b, const char *codecs, uint64_t budget, tour_row *r) {
  sim_var_cfg c;
  sim_var_defaults(&c);
  char policy[96];
  snprintf(policy, sizeof policy, "heatkv:b=%g:s=3:orders=synthetic:unit=bytes", b);
  c.codecs = codecs;
  c.policy = policy;
  c.budget_bytes = budget;
  sim_var_out o;
  sim_var_run(&c, com, &o);
  snprintf(r->run, sizeof r->run, "var infinity-2b");
  snprintf(r->codecs, sizeof r->codecs, "%s", codecs ? "nvfp4" : "bf16");
  snprintf(r->policy, sizeof r->policy, "heatkv b=%g", b);
  snprintf(r->served, sizeof r->served, "%llu images fit", (unsigned long long)o.images_that_fit);
  r->peak_bytes = o.peak_allocated_bytes;
  r->peak_req_bytes = o.peak_requested_bytes;
  r->savings = o.peak_allocated_bytes ? (double)o.bf16_full_bytes / (double)o.peak_allocated_bytes : 0;
  r->violations = o.budget_violations + o.policy_budget_violations;
}

static int tour(int argc, char **argv) {
  sim_common com;
  sim_common_init(&com);
  for (int i = 1; i < argc; i++) {
    int r = sim_common_opt(&com, argc, argv, &i);
    if (r < 0) return 2;
    if (!r) {
      fprintf(stderr, SIM_NAME ": unknown subcommand or option %s\n\n%s", argv[i], HELP);
      return 2;
    }
  }
  if (com.csv_path) {
    fprintf(stderr, SIM_NAME ": --csv belongs to a subcommand (llm, var, video), not the tour\n");
    return 2;
  }
  int quiet = com.quiet;
  com.quiet = 1; /* the tour prints its own table */
  com.json = 0;
  sim_common rc_com = com;
  rc_com.quiet = quiet; /* progress bars while it runs */
  tour_row rows[TOUR_MAX_ROWS];
  int n = 0;
  char notes[4][200];
  int nnotes = 0;
  double t0 = sim_now();
  /* slow: CPU encodes that take tens of seconds on this load (QVG's k-means,
   * KVQuant's non-uniform codebooks and outliers): these
   * rows run in the pool's dry mode (same pages and bytes, no payload) when
   * it exists, else they are left out with a note. QVG gets 4 centroids per
   * block: 32-token blocks cannot carry 256 BF16 centroids of 128 channels. */
  static const struct { const char *name, *spec, *codec; int slow; } LLM[] = {
      {"bf16", NULL, NULL, 0},
      {"fp8", "k=fp8,v=fp8", "fp8", 0},
      {"kivi 2-bit", "k=kivi:bits=2,v=kivi:bits=2", "kivi", 0},
      {"nvfp4", "k=nvfp4,v=nvfp4", "nvfp4", 0},
      {"qvg k=4", "k=qvg:k=4,v=qvg:k=4", "qvg", 1},
      {"kvquant", "k=kvquant,v=kvquant", "kvquant", 1},
  };
#ifdef KVP_POOL_DRY
  const int have_dry = 1;
#else
  const int have_dry = 0;
#endif
  for (size_t i = 0; i < sizeof LLM / sizeof *LLM; i++) {
    uint32_t id;
    char why[160];
    if (LLM[i].codec && kvp_codec_find(LLM[i].codec, &id)) continue; /* not in this build */
    if (LLM[i].spec && !spec_usable(LLM[i].spec, why, sizeof why)) {
      if (nnotes < 4) snprintf(notes[nnotes++], sizeof notes[0], "%s left out: %s", LLM[i].name, why);
      continue;
    }
    if (LLM[i].slow && !have_dry) {
      if (nnotes < 4)
        snprintf(notes[nnotes++], sizeof notes[0], "%s left out (its CPU encode is slow here): " SIM_NAME
                 " llm --codecs %s measures it", LLM[i].name, LLM[i].spec);
      continue;
    }
    tour_llm(&rc_com, LLM[i].name, LLM[i].spec, LLM[i].slow, &rows[n++]);
  }
  /* Infinity-2B: the budget is the bf16 cache of one image with no eviction
   * (2 CFG rows x 32 layers x 16 heads x 6425 tokens x 128 x 2 bytes, K and V). */
  uint64_t var_budget = 2ull * 32 * 16 * 6425 * 128 * 2 * 2;
  static const double BS[3] = {0.2, 0.1, 0.04};
  for (int nv = 0; nv < 2; nv++)
    for (int i = 0; i < 3; i++) tour_var(&rc_com, BS[i], nv ? "k=nvfp4,v=nvfp4" : NULL, var_budget, &rows[n++]);
  double wall = sim_now() - t0;

  int json = 0;
  for (int i = 1; i < argc; i++) json |= !strcmp(argv[i], "--json");
  if (json) {
    printf("{\"tour\":[");
    for (int i = 0; i < n; i++) {
      sim_json j;
      if (i) putchar(',');
      sim_json_begin(&j, stdout);
      sim_json_str(&j, "run", rows[i].run);
      sim_json_str(&j, "codecs", rows[i].codecs);
      sim_json_str(&j, "policy", rows[i].policy);
      sim_json_u64(&j, "peak_allocated_bytes", rows[i].peak_bytes);
      sim_json_u64(&j, "peak_requested_bytes", rows[i].peak_req_bytes);
      sim_json_f64(&j, "allocated_over_requested",
                   rows[i].peak_req_bytes ? (double)rows[i].peak_bytes / (double)rows[i].peak_req_bytes : 0);
      sim_json_f64(&j, "savings_vs_bf16", rows[i].savings);
      sim_json_str(&j, "served", rows[i].served);
      sim_json_u64(&j, "budget_violations", rows[i].violations);
      fputs("}", stdout);
    }
    printf("],\"wall_s\":%.3f}\n", wall);
    return 0;
  }
  if (quiet) return 0;
  char a[32];
  printf("kvpool-sim tour: every byte below is the pool's own ledger (allocated page bytes, size\n"
         "classes included), measured while real synthetic K/V is appended through the public API.\n\n");
  printf("LLM: llama-3-8b (32 layers, 8 KV heads, 128), 48 chat-like requests arriving at 20/s,\n"
         "a strict budget of %s; the scheduler admits what fits and preempts when a decode does not.\n",
         sim_bytes(TOUR_LLM_BUDGET, a, sizeof a));
  printf("VAR: Infinity-2B, one 1024x1024 image (2 CFG rows, 13 scales); \"images fit\" counts how many\n"
         "images run side by side in %s, the bf16 cache of one image with no eviction.\n\n",
         sim_bytes(var_budget, a, sizeof a));
  printf("%-16s %-13s %-13s %12s %8s %8s  %-38s %s\n", "run", "codecs", "policy", "peak KV", "alloc/req", "vs bf16",
         "served", "violations");
  for (int i = 0; i < n; i++)
    printf("%-16s %-13s %-13s %12s %9.4f %7.2fx  %-38s %llu\n", rows[i].run, rows[i].codecs, rows[i].policy,
           sim_bytes(rows[i].peak_bytes, a, sizeof a),
           rows[i].peak_req_bytes ? (double)rows[i].peak_bytes / (double)rows[i].peak_req_bytes : 0, rows[i].savings,
           rows[i].served, (unsigned long long)rows[i].violations);
  for (int i = 0; i < nnotes; i++) printf("note: %s\n", notes[i]);
  printf("\npeak KV: the ledger's largest allocated bytes; alloc/req: those over the requested bytes then\n"
         "(the allocator's rounding); vs bf16: the same tokens in raw bf16 over it.\n"
         "HeatKV b: the fraction of the full cache it may keep, evicting (layer, head, scale) units early.\n"
         "(dry): the pool's dry mode, same pages and bytes without the payload (a slow CPU encode).\n"
         "violations: checkpoints (iterations, or layers of a scale) where the pool held more than the\n"
         "budget (for HeatKV also its own b x full-cache budget): must be 0. Took %.1f s.\n"
         "Next: " SIM_NAME " llm --help, " SIM_NAME " var --help, " SIM_NAME " video --help.\n",
         wall);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 2 || argv[1][0] == '-') {
    if (argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) return fputs(HELP, stdout), 0;
    return tour(argc, argv);
  }
  if (!strcmp(argv[1], "llm")) return sim_llm_main(argc - 1, argv + 1);
  if (!strcmp(argv[1], "var")) return sim_var_main(argc - 1, argv + 1);
  if (!strcmp(argv[1], "video")) return sim_video_main(argc - 1, argv + 1);
  fprintf(stderr, SIM_NAME ": unknown subcommand \"%s\"\n\n%s", argv[1], HELP);
  return 2;
}
