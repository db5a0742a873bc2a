/*
 * tools/sim.h - what the kvpool-sim subcommands share: the run context
 * (--json, --dry, --csv, progress), the CSV time series, a small JSON
 * writer, synthetic K/V, and the cost model. Public headers only.
 *
 * CSV time series (--csv FILE), one row per iteration, LF line ends, read
 * by header name:
 *   iter,sim_time_s,running,waiting,finished,preemptions,allocated_bytes,
 *   requested_bytes,budget_bytes,bf16_equivalent_bytes,device_used_bytes,
 *   alloc_raw,alloc_codes,alloc_scales,alloc_centroids,alloc_assign,
 *   alloc_outliers,alloc_meta
 * allocated/requested/bf16-equivalent/device-used bytes are the pool's
 * ledger and probe at the end of the iteration; alloc_<type> are allocated
 * bytes by page type.
 *
 * Cost model (simulated time). One forward pass of a batch over n tokens
 * through a model of P parameters, reading K bytes of KV cache, takes
 *   t = max(2 P n / F, (2 P + K) / W)
 * F: sustained FLOP/s (--gpu-tflops), W: memory bandwidth (--gpu-bw-gbs):
 * a roofline of bf16 weights plus the KV pages the attention reads (the
 * pool's allocated bytes, so compression shortens memory-bound decodes).
 * Attention FLOPs, kernel launches and communication are left out.
 */
#ifndef KVP_TOOLS_SIM_H
#define KVP_TOOLS_SIM_H

#include <stdint.h>
#include <stdio.h>

#include "kvpool.h"

#define SIM_NAME "kvpool-sim"

typedef struct sim_cost {
  double flops;   /* sustained FLOP/s */
  double bw;      /* bytes/s */
} sim_cost;

/* Defaults: one A100-80GB SXM (312 TFLOP/s bf16, 2039 GB/s). */
#define SIM_DEFAULT_TFLOPS 312.0
#define SIM_DEFAULT_BW_GBS 2039.0

double sim_cost_s(const sim_cost *c, double params, double tokens, double kv_bytes_read);

/* Options every subcommand takes. */
typedef struct sim_common {
  int json;             /* --json: one JSON object on stdout at the end */
  int dry;              /* --dry: the pool's dry mode */
  const char *csv_path; /* --csv FILE, or NULL */
  int quiet;            /* --quiet: no table, no progress */
  uint64_t seed;        /* --seed */
  sim_cost cost;        /* --gpu-tflops, --gpu-bw-gbs */
} sim_common;

void sim_common_init(sim_common *c);
/* Consume a common option at argv[*i] (advancing *i past a value). 1 if
 * consumed, 0 if not common, -1 on a bad value (message printed). */
int sim_common_opt(sim_common *c, int argc, char **argv, int *i);
extern const char *const sim_common_help;

/* A run: the CSV and the progress bar. */
typedef struct sim_run {
  FILE *csv;          /* open --csv file, or NULL */
  uint64_t iter;      /* rows written */
  int progress;       /* draw the bar (stderr is a terminal, not quiet) */
  double last_draw;   /* monotonic seconds of the last draw */
  const char *label;  /* shown before the bar */
} sim_run;

int sim_run_open(sim_run *r, const sim_common *c, const char *label);
/* Append one CSV row; 0 or -1 (write error, message printed). */
int sim_run_row(sim_run *r, const kvp_stats *s, double t_s, uint64_t running, uint64_t waiting, uint64_t finished,
                uint64_t preemptions, uint64_t budget_bytes);
void sim_run_progress(sim_run *r, double frac);
/* Close the CSV (0, or -1 on a write error) and clear the bar. */
int sim_run_close(sim_run *r);

/* Die with a message naming the call and kvp_last_error. */
void sim_die_kvp(const char *what, int rc) __attribute__((noreturn));
void sim_die(const char *fmt, ...) __attribute__((noreturn, format(printf, 1, 2)));
/* A usage error: message, hint to --help, exit 2. */
void sim_usage_error(const char *sub, const char *fmt, ...) __attribute__((noreturn, format(printf, 2, 3)));

/* Parse a number option value: unsigned integer (with optional K/M/G/T
 * binary suffix for byte sizes when bytes is set) or a finite double. */
int sim_parse_u64(const char *s, int bytes, uint64_t *out);
/* An option's value, or a usage error (exit 2) naming subcommand sub and
 * the option: an integer in [lo, hi], or a positive number. */
uint32_t sim_opt_u32(const char *sub, const char *opt, const char *v, uint32_t lo, uint32_t hi);
double sim_opt_pos(const char *sub, const char *opt, const char *v);
/* --layers, --kv-heads, --head-dim: 1 when a is one of them (its value
 * stored, *model set to "custom"), else 0. */
int sim_geom_opt(const char *sub, const char *a, const char *v, uint32_t *layers, uint32_t *kv_heads,
                 uint32_t *head_dim, const char **model);
int sim_parse_f64(const char *s, double *out);
/* Comma-separated list of uint32 >= 1: "1,4,16"; count into *n (max cap). */
int sim_parse_list(const char *s, uint32_t *out, uint32_t cap, uint32_t *n);

/* Synthetic K or V: [n_tokens][H][D] of dtype, deterministic from the
 * seed, finite, roughly Gaussian with a few outlier key channels. */
void *sim_kv_alloc(uint64_t n_tokens, uint32_t H, uint32_t D, kvp_dtype dtype, uint64_t seed, int is_key);
int sim_parse_dtype(const char *s, kvp_dtype *out);
const char *sim_dtype_name(kvp_dtype d);

/* JSON writer: one object, keys in call order. */
typedef struct sim_json {
  FILE *f;    /* destination */
  int first;  /* no key written yet at this level */
} sim_json;
void sim_json_begin(sim_json *j, FILE *f);
void sim_json_u64(sim_json *j, const char *key, uint64_t v);
void sim_json_f64(sim_json *j, const char *key, double v);
void sim_json_str(sim_json *j, const char *key, const char *v);
void sim_json_end(sim_json *j);

/* Snapshot of the pool's stats (dies on failure). It probes device-level
 * usage (for a host region, residency page by page): once per iteration. */
void sim_stats(kvp_pool *pool, kvp_stats *s);
/* The ledger's allocated bytes alone (K + V breakdown), without the probe. */
uint64_t sim_allocated(kvp_pool *pool);

/* Human byte count "1.23 GiB" into buf. */
const char *sim_bytes(uint64_t b, char *buf, size_t cap);
double sim_now(void);
uint64_t sim_rng(uint64_t *state);
double sim_rng_unit(uint64_t *state); /* (0, 1) */

/* ---- subcommands: a configuration in, figures out (the tour calls them) -- */

#define SIM_MAX_SCALES 64

typedef struct sim_var_cfg {
  const char *model;          /* preset name, or "custom" */
  uint32_t n_layers, n_kv_heads, head_dim;
  double params;              /* parameters, for the cost model */
  kvp_dtype k_dtype, v_dtype; /* appended (and raw-stored) dtypes */
  uint32_t schedule[SIM_MAX_SCALES]; /* tokens per scale */
  uint32_t n_scales;
  uint32_t images;            /* two CFG rows each */
  const char *codecs;         /* codec spec, NULL = raw */
  const char *policy;         /* policy spec, NULL = none */
  uint64_t budget_bytes;      /* 0 = the policy's promise (heatkv) or the full cache */
  int check;                  /* kvp_check after every scale */
} sim_var_cfg;

typedef struct sim_var_out {
  uint64_t full_cache_bytes;          /* allocated bytes of scales 0..K-2, every row, no eviction */
  uint64_t full_cache_requested_bytes;/* the same in requested bytes */
  uint64_t all_scales_bytes;          /* allocated bytes of all K scales, every row */
  uint64_t bf16_full_bytes;           /* raw bf16 bytes of scales 0..K-2, every row */
  uint64_t budget_bytes;              /* the budget checked */
  uint64_t policy_budget;             /* heatkv: rows x floor(b x full row) in its unit, else 0 */
  int policy_unit_bytes;              /* 1: policy_budget in bytes; 0: head-token slots */
  uint64_t peak_allocated_bytes;      /* ledger peak over layer checkpoints */
  uint64_t peak_requested_bytes;      /* requested at the allocated peak */
  uint64_t peak_tokens_retained;      /* head-token slots at the peak of tokens */
  uint64_t checkpoints;               /* layer checkpoints measured */
  uint64_t budget_violations;         /* checkpoints with allocated > budget_bytes */
  uint64_t policy_budget_violations;  /* checkpoints past the policy's own budget */
  uint64_t images_that_fit;           /* images whose peak fits budget_bytes */
  uint64_t tokens_evicted;            /* head-token slots evicted */
  double sim_time_s;                  /* cost model */
  double wall_s;                      /* wall time of the generation */
} sim_var_out;

typedef struct sim_llm_cfg {
  const char *model;
  uint32_t n_layers, n_kv_heads, head_dim;
  double params;
  const char *codecs, *policy;
  uint64_t budget_bytes;         /* strict pool budget */
  uint32_t max_batch_tokens;     /* tokens per iteration (prefill chunks + decodes) */
  uint32_t max_running;          /* sequences per batch */
  uint32_t block_tokens;         /* tokens per block */
  const char *trace_path;        /* NULL = synthetic */
  int trace_format;              /* trace_format */
  uint32_t requests;             /* synthetic count, or the first N of a trace (0 = all: a trace's default) */
  double rate;                   /* synthetic arrivals per second (also for sharegpt) */
  double prompt_median, output_median; /* synthetic lengths (lognormal medians) */
  uint32_t max_prompt, max_output;     /* synthetic caps */
  int check;                     /* kvp_check after every iteration */
  const char *store_url;         /* --store: swap preempted requests to this store, share prefixes; NULL = off */
  double store_bw;               /* store bytes/s, for the clock (--store-gbs) */
} sim_llm_cfg;

typedef struct sim_llm_out {
  uint64_t requests_total, requests_finished, preemptions, max_running, iterations;
  uint64_t prompt_tokens, generated_tokens, recomputed_tokens;
  uint64_t peak_allocated_bytes, peak_bf16_equivalent_bytes, budget_bytes, budget_violations;
  uint64_t peak_requested_bytes;  /* requested bytes at the allocated peak */
  uint64_t rejected;              /* requests that can never fit the budget */
  double sim_time_s, throughput_tokens_per_s, ttft_mean_s, ttft_p90_s, tpot_mean_s;
  double savings_vs_bf16;         /* bf16-equivalent / allocated, at the allocated peak */
  double wall_s;
  /* the store tier (--store), else 0 */
  uint64_t prefill_tokens;        /* prefill tokens computed (prompts, recomputes; not attached ones) */
  uint64_t swapped_out, swapped_in; /* preemptions by offload to the store, restores */
  uint64_t offload_fallbacks;     /* offloads refused (the request was recomputed instead) */
  uint64_t publish_refusals;      /* prefix publishes the store's max_bytes stopped */
  uint64_t prefix_hit_tokens;     /* prompt tokens attached from the pool's prefix table */
  uint64_t store_prefix_tokens;   /* prompt tokens attached from the store's published prefixes */
  uint64_t store_sent_bytes, store_received_bytes; /* value bytes to and from the store */
  double store_time_s;            /* simulated time of the transfers */
} sim_llm_out;

typedef struct sim_video_cfg {
  const char *model;
  uint32_t n_layers, n_kv_heads, head_dim;
  double params;
  uint32_t frames_per_chunk, tokens_per_frame, chunks;
  uint32_t scene_every;          /* a KVP_STEP_SCENE_CUT every N chunks (0 = never) */
  const char *codecs, *policy;
  uint64_t budget_bytes;         /* the budget checked, 0 = the full cache */
  int check;                     /* kvp_check after every chunk */
} sim_video_cfg;

typedef struct sim_video_out {
  uint64_t full_cache_bytes;     /* bf16 bytes of all chunks (no eviction) */
  uint64_t peak_allocated_bytes, peak_bf16_equivalent_bytes, budget_bytes, budget_violations;
  uint64_t tokens_evicted, checkpoints;
  double sim_time_s, wall_s;
} sim_video_out;

void sim_var_defaults(sim_var_cfg *c);
int sim_var_preset(sim_var_cfg *c, const char *name);
void sim_var_run(const sim_var_cfg *c, const sim_common *com, sim_var_out *o);
int sim_var_main(int argc, char **argv);

void sim_llm_defaults(sim_llm_cfg *c);
int sim_llm_preset(sim_llm_cfg *c, const char *name);
void sim_llm_run(const sim_llm_cfg *c, const sim_common *com, sim_llm_out *o);
int sim_llm_main(int argc, char **argv);

void sim_video_defaults(sim_video_cfg *c);
void sim_video_run(const sim_video_cfg *c, const sim_common *com, sim_video_out *o);
int sim_video_main(int argc, char **argv);

#endif
