/*
 * tools/sim_video.c - kvpool-sim video: chunked autoregressive video
 * generation (LongLive-style), one KVP_SEQ_STEP sequence whose steps are
 * chunks of frames, under the window or multishot policy and any codec.
 *
 * One chunk: kvp_step_begin(frames x tokens per frame tokens, SCENE_CUT on
 * every --scene-every-th chunk), every layer appended with a checkpoint
 * after it (the ledger, after returning retired blocks, against
 * --budget-bytes), kvp_step_end. The pool's own budget is its region: the
 * simulator measures whether the policy keeps the cache under the budget.
 *
 *   full_cache_bytes  bf16 bytes of every chunk with no eviction:
 *                     chunks x frames x tokens x L x H x D x 2 x 2
 */
#include <stdlib.h>
#include <string.h>

#include "sim.h"

void sim_video_defaults(sim_video_cfg *c) {
  memset(c, 0, sizeof *c);
  /* Wan2.1-T2V-1.3B geometry (LongLive's base): 30 layers, 12 heads of 128;
   * 832x480 frames are 1560 latent tokens (8x VAE, 2x2 patches). */
  c->model = "longlive-1.3b";
  c->n_layers = 30;
  c->n_kv_heads = 12;
  c->head_dim = 128;
  c->params = 1.3e9;
  c->frames_per_chunk = 3;
  c->tokens_per_frame = 1560;
  c->chunks = 8;
  c->scene_every = 4;
  c->policy = "multishot:global=1:shot=1:window=2";
}

void sim_video_run(const sim_video_cfg *c, const sim_common *com, sim_video_out *o) {
  memset(o, 0, sizeof *o);
  uint32_t L = c->n_layers, H = c->n_kv_heads, D = c->head_dim;
  uint64_t chunk_tokens = (uint64_t)c->frames_per_chunk * c->tokens_per_frame;
  if (chunk_tokens > KVP_MAX_STEP_TOKENS)
    sim_die("video: a chunk of %llu tokens passes KVP_MAX_STEP_TOKENS", (unsigned long long)chunk_tokens);
  o->full_cache_bytes = chunk_tokens * c->chunks * L * H * D * 2 * 2;
  o->budget_bytes = c->budget_bytes ? c->budget_bytes : o->full_cache_bytes;
  kvp_config k;
  kvp_config_init(&k);
  k.n_layers = L;
  k.n_kv_heads = H;
  k.head_dim = D;
  k.block_tokens = 1024;
  k.region_bytes = o->full_cache_bytes + o->full_cache_bytes / 4 + (64ull << 20);
  k.codecs = c->codecs;
  k.policy = c->policy;
  if (com->dry) {
#ifdef KVP_POOL_DRY
    k.flags |= KVP_POOL_DRY;
#else
    sim_die("--dry: this kvpool has no dry mode (KVP_POOL_DRY)");
#endif
  }
  kvp_pool *p;
  int rc = kvp_pool_create(&k, &p);
  if (rc) sim_die_kvp("kvp_pool_create", rc);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  if ((rc = kvp_seq_add(p, 1, &sc))) sim_die_kvp("kvp_seq_add", rc);
  void *kb = sim_kv_alloc(chunk_tokens, H, D, KVP_DTYPE_BF16, com->seed, 1);
  void *vb = sim_kv_alloc(chunk_tokens, H, D, KVP_DTYPE_BF16, com->seed, 0);
  kvp_kv kv = {kb, vb, NULL};
  sim_run run;
  if (sim_run_open(&run, com, c->model)) exit(1);
  double t0 = sim_now(), sim_t = 0;
  for (uint32_t ch = 0; ch < c->chunks; ch++) {
    uint32_t flags = c->scene_every && ch && ch % c->scene_every == 0 ? KVP_STEP_SCENE_CUT : 0;
    if ((rc = kvp_step_begin(p, 1, (uint32_t)chunk_tokens, flags))) sim_die_kvp("kvp_step_begin", rc);
    for (uint32_t l = 0; l < L; l++) {
      if ((rc = kvp_append(p, 1, l, &kv))) {
        fprintf(stderr, "\n" SIM_NAME " video: chunk %u, layer %u\n", ch, l);
        sim_die_kvp("kvp_append", rc);
      }
      if ((rc = kvp_reclaim(p))) sim_die_kvp("kvp_reclaim", rc);
      kvp_stats s;
      sim_stats(p, &s);
      o->checkpoints++;
      if (s.bytes_allocated.current > o->peak_allocated_bytes) o->peak_allocated_bytes = s.bytes_allocated.current;
      if (s.bf16_equivalent_bytes.current > o->peak_bf16_equivalent_bytes)
        o->peak_bf16_equivalent_bytes = s.bf16_equivalent_bytes.current;
      o->budget_violations += s.bytes_allocated.current > o->budget_bytes;
      sim_t += sim_cost_s(&com->cost, c->params / L, (double)chunk_tokens, (double)s.bytes_allocated.current / L);
      if (sim_run_row(&run, &s, sim_t, 1, 0, 0, 0, o->budget_bytes)) exit(1);
      sim_run_progress(&run, (double)(ch * L + l + 1) / ((double)c->chunks * L));
    }
    if ((rc = kvp_step_end(p, 1))) sim_die_kvp("kvp_step_end", rc);
    if (c->check && (rc = kvp_check(p))) sim_die_kvp("kvp_check", rc);
  }
  o->wall_s = sim_now() - t0;
  o->sim_time_s = sim_t;
  if ((rc = kvp_check(p))) sim_die_kvp("kvp_check", rc);
  kvp_stats s;
  sim_stats(p, &s);
  o->tokens_evicted = s.tokens_evicted;
  if ((rc = kvp_seq_free(p, 1)) || (rc = kvp_reclaim(p))) sim_die_kvp("kvp_seq_free", rc);
  if (sim_allocated(p)) sim_die("ledger drift: bytes still allocated after the sequence was freed");
  if (sim_run_close(&run)) exit(1);
  kvp_pool_destroy(p);
  free(kb);
  free(vb);
}

static const char *const VIDEO_HELP =
    "usage: " SIM_NAME " video [options]\n"
    "Chunked autoregressive video: each chunk of frames is one step of the sequence,\n"
    "appended layer by layer under a window or multishot policy and any codec.\n\n"
    "  --layers N --kv-heads N --head-dim N --params N   geometry (default longlive-1.3b:\n"
    "                     30 layers, 12 KV heads, 128, 1.3e9 parameters)\n"
    "  --frames-per-chunk N   latent frames per chunk (default 3)\n"
    "  --tokens-per-frame N   tokens per latent frame (default 1560: 832x480)\n"
    "  --chunks N         chunks to generate (default 8)\n"
    "  --scene-every N    a scene cut (KVP_STEP_SCENE_CUT) every N chunks, 0 = never (default 4)\n"
    "  --codecs SPEC      codec spec (default raw bf16)\n"
    "  --policy SPEC      window:sink=T:recent=T (tokens) | multishot:global=S:shot=S:window=S\n"
    "                     (steps) | none (default multishot:global=1:shot=1:window=2)\n"
    "  --budget-bytes N   the budget checked after every layer (default: the full cache)\n"
    "  --check            kvp_check after every chunk\n\n"
    "JSON keys: full_cache_bytes, peak_allocated_bytes, budget_bytes, budget_violations,\n"
    "tokens_evicted, savings_vs_bf16, ...\n\n";

static void video_print(const sim_video_cfg *c, const sim_common *com, const sim_video_out *o) {
  double savings = o->peak_allocated_bytes ? (double)o->full_cache_bytes / (double)o->peak_allocated_bytes : 0;
  if (com->json) {
    sim_json j;
    sim_json_begin(&j, stdout);
    sim_json_str(&j, "subcommand", "video");
    sim_json_str(&j, "model", c->model);
    sim_json_u64(&j, "n_layers", c->n_layers);
    sim_json_u64(&j, "n_kv_heads", c->n_kv_heads);
    sim_json_u64(&j, "head_dim", c->head_dim);
    sim_json_u64(&j, "frames_per_chunk", c->frames_per_chunk);
    sim_json_u64(&j, "tokens_per_frame", c->tokens_per_frame);
    sim_json_u64(&j, "chunks", c->chunks);
    sim_json_str(&j, "codecs", c->codecs);
    sim_json_str(&j, "policy", c->policy);
    sim_json_u64(&j, "dry", (uint64_t)com->dry);
    sim_json_u64(&j, "full_cache_bytes", o->full_cache_bytes);
    sim_json_u64(&j, "peak_allocated_bytes", o->peak_allocated_bytes);
    sim_json_u64(&j, "peak_bf16_equivalent_bytes", o->peak_bf16_equivalent_bytes);
    sim_json_u64(&j, "budget_bytes", o->budget_bytes);
    sim_json_u64(&j, "budget_violations", o->budget_violations);
    sim_json_u64(&j, "checkpoints", o->checkpoints);
    sim_json_u64(&j, "tokens_evicted", o->tokens_evicted);
    sim_json_f64(&j, "savings_vs_bf16", savings);
    sim_json_f64(&j, "sim_time_s", o->sim_time_s);
    sim_json_f64(&j, "wall_s", o->wall_s);
    sim_json_end(&j);
    return;
  }
  if (com->quiet) return;
  char a[32], b[32];
  printf("video %s: %u layers x %u KV heads x %u, %u chunks of %u frames x %u tokens\n", c->model, c->n_layers,
         c->n_kv_heads, c->head_dim, c->chunks, c->frames_per_chunk, c->tokens_per_frame);
  printf("  codecs %s, policy %s%s\n", c->codecs ? c->codecs : "raw bf16", c->policy ? c->policy : "none",
         com->dry ? ", dry" : "");
  printf("  full cache (bf16, no eviction)  %s\n", sim_bytes(o->full_cache_bytes, a, sizeof a));
  printf("  peak allocated                  %s (%.2fx smaller)\n", sim_bytes(o->peak_allocated_bytes, a, sizeof a),
         savings);
  printf("  budget                          %s: %llu of %llu layer checkpoints over it\n",
         sim_bytes(o->budget_bytes, b, sizeof b), (unsigned long long)o->budget_violations,
         (unsigned long long)o->checkpoints);
  printf("  simulated time %.3f s, wall %.2f s\n", o->sim_time_s, o->wall_s);
}

int sim_video_main(int argc, char **argv) {
  sim_common com;
  sim_common_init(&com);
  sim_video_cfg c;
  sim_video_defaults(&c);
  int params_set = 0;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    int r = sim_common_opt(&com, argc, argv, &i);
    if (r < 0) return 2;
    if (r) continue;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) return fputs(VIDEO_HELP, stdout), fputs(sim_common_help, stdout), 0;
    if (!strcmp(a, "--check")) {
      c.check = 1;
      continue;
    }
    if (i + 1 >= argc) sim_usage_error("video", "unknown option or missing value: %s", a);
    const char *v = argv[++i];
    if (sim_geom_opt("video", a, v, &c.n_layers, &c.n_kv_heads, &c.head_dim, &c.model)) {
      /* geometry: stored */
    } else if (!strcmp(a, "--params")) {
      c.params = sim_opt_pos("video", a, v), params_set = 1;
    } else if (!strcmp(a, "--frames-per-chunk")) c.frames_per_chunk = sim_opt_u32("video", a, v, 1, 1u << 16);
    else if (!strcmp(a, "--tokens-per-frame")) c.tokens_per_frame = sim_opt_u32("video", a, v, 1, 1u << 20);
    else if (!strcmp(a, "--chunks")) c.chunks = sim_opt_u32("video", a, v, 1, 1u << 20);
    else if (!strcmp(a, "--scene-every")) c.scene_every = sim_opt_u32("video", a, v, 0, 1u << 20);
    else if (!strcmp(a, "--codecs")) c.codecs = v;
    else if (!strcmp(a, "--policy")) c.policy = strcmp(v, "none") ? v : NULL;
    else if (!strcmp(a, "--budget-bytes")) {
      if (sim_parse_u64(v, 1, &c.budget_bytes) || !c.budget_bytes)
        sim_usage_error("video", "--budget-bytes %s: expected a byte count > 0 (K/M/G/T suffixes)", v);
    } else sim_usage_error("video", "unknown option %s", a);
  }
  if (!params_set && !strcmp(c.model, "custom"))
    c.params = 12.0 * c.n_layers * (double)c.n_kv_heads * c.head_dim * (double)c.n_kv_heads * c.head_dim;
  sim_video_out o;
  sim_video_run(&c, &com, &o);
  video_print(&c, &com, &o);
  return 0;
}
