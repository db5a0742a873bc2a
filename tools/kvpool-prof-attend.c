/*
 * kvpool-prof-attend - the host part of kvp_attend_decode (the block table
 * build, pages/attend_table.c) in a loop, for a profiler; no GPU needed.
 *
 *   kvpool-prof-attend [--batch 64] [--tokens 131072] [--heads 8] [--codecs kv=bf16] [--step 1024]
 *                      [--interleave] [--evict 0] [--rounds 15] [--slots 264] [--split-tokens 0] [--kept]
 *                      [--decode] [--join] [--json]
 *
 * A dry CUDA pool (KVP_POOL_DRY: pages are allocated, 64-byte aligned and
 * laid out as in a CUDA region, nothing is written) of one layer, `heads`
 * KV heads, head_dim 128, 16-token blocks; `batch` sequences in step mode
 * appended `step` tokens a step up to `tokens`, one sequence after the other
 * (kvpool-bench-gpu's attend figures build theirs so: each stream's blocks
 * lie together in memory), or with --interleave step k of every sequence
 * before step k + 1 of any (as a serving engine's decode steps: a stream's
 * blocks lie apart); with --evict F, about F of the (head, step) units
 * evicted (a fixed hash). Then the table of the whole batch is built
 * `rounds` times into one buffer, grown on the first; prints the median
 * ns per record and per call. slots: thread blocks the device would run at
 * once (132 SMs x 2 on an H100), which sizes the splits. With --kept, the
 * calls go through the layer's kept table (kvp__attend_build_kept): the
 * first builds and keeps it, the timed ones reuse it (nothing changes
 * between them): what a decode step's call costs while the pool's
 * structure stands. With --decode, the sequences are stream-mode ones of
 * staggered lengths (sequence s holds tokens - s % 16 tokens: each passes
 * a block's end at another step, as a serving engine's batch does) and
 * each timed call follows one decode token appended to every sequence
 * (not timed): a decode step's call where batch / 16 sequences add a
 * block at every step. With --join too, before each timed call one
 * sequence leaves (freed) and a new one of as many tokens takes its place
 * in the batch (not timed): a call after the batch changed.
 * Instructions per record:
 *   valgrind --tool=callgrind build/kvpool-prof-attend --batch 4 --tokens 16384 --rounds 3
 *   callgrind_annotate --inclusive=yes callgrind.out.* | grep kvp__attend_build
 * (divide by 4, the rounds and the first build, x the records printed: 89
 * instructions a record, 337 with the build that wrote kvp__gjob records and
 * compacted them); with --cache-sim=yes, the D1 read misses a record (the
 * lines it reads). It links the static library and calls the build directly
 * (internal), as the unit tests do.
 */
#include "../pages/attend_table.h"

#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef KVP_HAVE_CUDA

enum { D = 128, STEP = 1024, MAX_ROUNDS = 1000 };

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void die(const char *what, int rc) {
  fprintf(stderr, "kvpool-prof-attend: %s: %s\n", what, rc ? kvp_last_error() : "bad argument (--help)");
  exit(1);
}

static int grow(kvp__abuf *b, uint64_t used, uint64_t need) {
  (void)used;
  uint64_t cap = b->cap_bytes ? b->cap_bytes : 1 << 20;
  while (cap < need) cap *= 2;
  unsigned char *p = realloc(b->p, cap);
  if (!p) return KVP_ENOMEM;
  b->p = p, b->cap_bytes = cap;
  return KVP_OK;
}

/* One step of n tokens of seq (layer 0; a dry CUDA pool never reads K and V). */
static void step_of(kvp_pool *p, uint64_t seq, uint32_t n) {
  static uint16_t dummy[16];
  int rc;
  if ((rc = kvp_step_begin(p, seq, n, 0))) die("kvp_step_begin", rc);
  if ((rc = kvp_append(p, seq, 0, &(kvp_kv){dummy, dummy, NULL}))) die("kvp_append", rc);
  if ((rc = kvp_step_end(p, seq))) die("kvp_step_end", rc);
}

static int cmp_d(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static void usage(void) {
  puts("usage: kvpool-prof-attend [--batch 64] [--tokens 131072] [--heads 8] [--codecs kv=bf16] [--step 1024]\n"
       "                          [--interleave] [--evict 0] [--rounds 15] [--slots 264] [--split-tokens 0] [--kept]\n"
       "                          [--decode] [--join] [--json]\n"
       "Builds kvp_attend_decode's block table over a dry CUDA pool in a loop; prints ns per record.");
}

int main(int argc, char **argv) {
  long batch = 64, tokens = 131072, heads = 8, rounds = 15, slots = 264, split = 0, step = 1024;
  double evict = 0;
  int interleave = 0, kept = 0, decode = 0, join = 0;
  const char *codecs = "kv=bf16";
  int json = 0;
  static const struct option opts[] = {
      {"batch", 1, 0, 'b'}, {"tokens", 1, 0, 't'}, {"heads", 1, 0, 'H'},        {"codecs", 1, 0, 'c'},
      {"evict", 1, 0, 'e'}, {"rounds", 1, 0, 'r'}, {"slots", 1, 0, 's'},        {"split-tokens", 1, 0, 'p'},
      {"step", 1, 0, 'S'},  {"interleave", 0, 0, 'i'}, {"json", 0, 0, 'j'}, {"help", 0, 0, 'h'},
      {"kept", 0, 0, 'k'},  {"decode", 0, 0, 'd'}, {"join", 0, 0, 'J'},
      {0, 0, 0, 0}};
  for (int o; (o = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
    switch (o) {
    case 'b': batch = atol(optarg); break;
    case 't': tokens = atol(optarg); break;
    case 'H': heads = atol(optarg); break;
    case 'c': codecs = optarg; break;
    case 'e': evict = atof(optarg); break;
    case 'r': rounds = atol(optarg); break;
    case 's': slots = atol(optarg); break;
    case 'p': split = atol(optarg); break;
    case 'S': step = atol(optarg); break;
    case 'i': interleave = 1; break;
    case 'k': kept = 1; break;
    case 'd': decode = 1; break;
    case 'J': join = decode = 1; break;
    case 'j': json = 1; break;
    case 'h': usage(); return 0;
    default: usage(); return 1;
    }
  }
  if (optind < argc || batch < 1 || batch > 4096 || tokens < 1 || tokens > (1l << 24) || heads < 1 || heads > 64 ||
      rounds < 1 || rounds > MAX_ROUNDS || step < 1 || step > 65536 || slots < 1 || split < 0 ||
      split > UINT32_MAX || !(evict >= 0 && evict < 1))
    die("arguments", 0);
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 1;
  c.n_kv_heads = (uint32_t)heads;
  c.head_dim = D;
  c.memory = KVP_MEM_CUDA;
  c.flags = KVP_POOL_DRY;
  c.block_tokens = 16;
  c.codecs = codecs;
  /* at most raw f32-sized pages (4 bytes per element, K and V) with room for rounding up */
  c.region_bytes = (uint64_t)batch * (uint64_t)tokens * (uint64_t)heads * D * 4 * 2 * 5 / 4 + (256ull << 20);
  if (c.region_bytes > (64ull << 32)) c.region_bytes = 64ull << 32;
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create", rc);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = decode ? KVP_SEQ_STREAM : KVP_SEQ_STEP;
  uint64_t *seqs = malloc((size_t)batch * sizeof *seqs);
  if (!seqs) die("malloc", 0);
  double t_build = now_ns();
  uint64_t nevict = 0;
  uint32_t nsteps = (uint32_t)((tokens + step - 1) / step);
  for (long s = 0; s < batch; s++)
    if ((rc = kvp_seq_add(p, seqs[s] = (uint64_t)s, &sc))) die("kvp_seq_add", rc);
  for (long i = 0; i < batch * (long)nsteps; i++) { /* sequence-major, or step-major with --interleave */
    long s = interleave ? i % batch : i / nsteps, k = interleave ? i / batch : i % nsteps,
         len = decode && tokens > 16 ? tokens - s % 16 : tokens; /* --decode: staggered */
    if (k * step >= len) continue;
    step_of(p, (uint64_t)s, (uint32_t)(len - k * step < step ? len - k * step : step));
    if (!json && (i + 1) % (batch * (long)nsteps / 8 + 1) == 0)
      fprintf(stderr, "\rkvpool-prof-attend: %ld/%ld steps", i + 1, batch * (long)nsteps);
  }
  for (long s = 0; s < batch && evict > 0; s++) /* after the appends, as an engine's policy would */
    for (uint32_t h = 0; h < heads; h++)
      for (uint32_t k = 0; k < nsteps; k++)
        if ((((uint32_t)s * 131u + h * 31u + k) * 2654435761u >> 16) % 1000u < (uint32_t)(evict * 1000)) {
          if ((rc = kvp_evict(p, (uint64_t)s, 0, h, k))) die("kvp_evict", rc);
          nevict++;
        }
  if (!json) fprintf(stderr, "\rkvpool-prof-attend: pool built in %.1f s (%llu units evicted)\n",
                     (now_ns() - t_build) / 1e9, (unsigned long long)nevict);
  kvp__kparams kp[4];
  if ((rc = kvp__attend_bindings(p, 0, kp))) die("kvp__attend_bindings", rc);
  kvp__atable t = {.layer = 0, .seqs = seqs, .batch = (uint32_t)batch, .kind = kvp__kern_attend_kind(kp),
                   .split_tokens = (uint32_t)split, .slots = (uint32_t)slots};
  kvp__abuf buf = {NULL, 0, grow, NULL};
  static double ns[MAX_ROUNDS];
  long served = 0;
  for (long r = -1; r < rounds; r++) { /* round -1: the buffer grows (and the table is kept) */
    bool hit = false;
    if (join && r >= 0) { /* one leaves, a new one of as many tokens takes its place (not timed) */
      long i = r * 37 % batch, len = tokens > 16 ? tokens - i % 16 : tokens;
      if ((rc = kvp_seq_free(p, seqs[i])) || (rc = kvp_seq_add(p, seqs[i] = (uint64_t)(batch + r), &sc)))
        die("a join", rc);
      for (long at = 0; at < len; at += step) step_of(p, seqs[i], (uint32_t)(len - at < step ? len - at : step));
    }
    for (long s = 0; decode && r >= 0 && s < batch; s++) step_of(p, seqs[s], 1); /* a decode token each, not timed */
    kvp__rcu_read_lock();
    double t0 = now_ns();
    rc = kept ? kvp__attend_build_kept(p, &t, &buf, &hit) : kvp__attend_build(p, &t, &buf);
    served += r >= 0 && hit;
    double dt = now_ns() - t0;
    kvp__rcu_read_unlock();
    if (rc) die("kvp__attend_build", rc);
    if (r >= 0) ns[r] = dt;
  }
  qsort(ns, (size_t)rounds, sizeof *ns, cmp_d);
  uint32_t largest = 0; /* the split that runs longest: tokens of one (sequence, head) */
  if (!t.tab_dev) {
    const kvp__asplit *sp = (const kvp__asplit *)(buf.p + t.off_splits);
    uint32_t rb = kvp__kern_attend_rec_bytes(t.kind), m1_at = m1_at_of(form_of(rb));
    for (uint32_t i = 0; i < t.nsplit; i++) {
      uint32_t tok = 0;
      for (uint32_t r = sp[i].rec0; r < sp[i].rec0 + sp[i].nrec; r++) tok += rec_tokens(buf.p, rb, m1_at, r);
      if (tok > largest) largest = tok;
    }
  }
  double med = ns[rounds / 2], per = t.nrec ? med / t.nrec : 0;
  if (!json)
    printf("attend table %s B=%ld T=%ld H=%ld step=%ld%s%s evict=%.2f%s: %u records (%u bytes each), %u splits, %.1f MiB: "
           "%.2f ms per call, %.2f ns per record (median of %ld; min %.2f, max %.2f); largest split %u tokens of %.0f "
           "a slot\n",
           codecs, batch, tokens, heads, step, interleave ? " interleaved" : "",
           join ? " decode+join" : decode ? " decode" : "", evict,
           kept ? (served == rounds ? " kept" : " kept (NOT SERVED)") : "", t.nrec,
           kvp__kern_attend_rec_bytes(t.kind), t.nsplit, t.table_bytes / 1048576.0, med / 1e6, per, rounds,
           ns[0] / (t.nrec ? t.nrec : 1),
           ns[rounds - 1] / (t.nrec ? t.nrec : 1), largest, (double)t.token_heads / (double)slots);
  printf("{\"figure\":\"attend_table\",\"codecs\":\"%s\",\"batch\":%ld,\"tokens\":%ld,\"heads\":%ld,\"step\":%ld,"
         "\"interleave\":%d,\"decode\":%d,\"evict\":%.3f,\"kept\":%d,\"served_kept\":%ld,"
         "\"records\":%u,\"record_bytes\":%u,\"splits\":%u,\"table_bytes\":%llu,\"token_heads\":%llu,"
         "\"ms\":%.3f,\"ns_per_record\":%.3f,\"largest_split_tokens\":%u}\n",
         codecs, batch, tokens, heads, step, interleave, decode, evict, kept, served, t.nrec,
         kvp__kern_attend_rec_bytes(t.kind),
         t.nsplit,
         (unsigned long long)t.table_bytes, (unsigned long long)t.token_heads, med / 1e6, per, largest);
  free(buf.p);
  free(seqs);
  kvp_pool_destroy(p);
  return 0;
}

#else

int main(void) {
  puts("kvpool-prof-attend: skipped: kvpool was built without CUDA (the table is the CUDA kernels')");
  return 0;
}

#endif
