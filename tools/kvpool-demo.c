/*
 * kvpool-demo - what `make run` runs until the simulator exists: a pool with
 * a Llama-like geometry, sequences that fill it with a realistic mix of page
 * sizes under a strict byte budget until the budget refuses, then finish and
 * free, with the ledger printed as a table at each stage. Public header only.
 *
 *   kvpool-demo [--json]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pagemix.h"

#define NSEQ 24
#define MAXPG 20000

typedef struct seqpages {
  kvp_page_id ids[MAXPG]; /* live pages of the sequence */
  uint32_t n;             /* how many */
} seqpages;

static void die(const char *what, int rc) {
  fprintf(stderr, "kvpool-demo: %s: %s (%s)\n", what, kvp_strerror(rc), kvp_last_error());
  exit(1);
}

static void show(kvp_pool *p, const char *stage, int json) {
  static char buf[1 << 20];
  size_t len;
  int rc = kvp_stats_write(p, json ? KVP_STATS_JSON : KVP_STATS_TEXT, buf, sizeof buf, &len);
  if (rc) die("kvp_stats_write", rc);
  if (json) {
    printf("{\"stage\":\"%s\",\"stats\":%s}", stage, buf);
    return;
  }
  kvp_stats s = {.struct_size = sizeof s};
  if ((rc = kvp_stats_get(p, &s))) die("kvp_stats_get", rc);
  printf("\n== %s ==\n%s", stage, buf);
  printf("budget use %.1f%%  rounding waste %.1f%%  host metadata %.3f%% of the region\n",
         100.0 * (double)s.bytes_allocated.current / (double)s.budget_bytes,
         s.bytes_allocated.current
             ? 100.0 * (double)(s.bytes_allocated.current - s.bytes_requested.current) / (double)s.bytes_allocated.current
             : 0.0,
         100.0 * (double)s.metadata_bytes.current / (double)s.bytes_reserved);
}

#define DEMO_USAGE "usage: kvpool-demo [--json]\n  fills a pool with a realistic page mix under a budget and prints the ledger\n"

int main(int argc, char **argv) {
  int json = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--json")) json = 1;
    else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return fputs(DEMO_USAGE, stdout), 0;
    else return fprintf(stderr, "kvpool-demo: unknown argument \"%s\"\n" DEMO_USAGE, argv[i]), 2;
  }
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 32;
  c.n_kv_heads = 8;
  c.head_dim = 128;
  c.region_bytes = 256ull << 20;
  c.budget_bytes = 160ull << 20;
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create", rc);
  seqpages *seqs = calloc(NSEQ, sizeof *seqs);
  uint64_t rng = 0x9E3779B97F4A7C15ull, refused = 0;
  if (json) printf("[");
  /* stage 1: sequences take pages round-robin until the budget refuses 64 times */
  for (uint64_t i = 0; refused < 64; i++) {
    uint64_t r = pagemix_rand(&rng);
    seqpages *sp = &seqs[i % NSEQ];
    const pagemix_entry *e = pagemix_pick(r);
    kvp_page_tag t = {i % NSEQ, (uint32_t)(r >> 32) % c.n_layers, (uint32_t)(r >> 40) % c.n_kv_heads, e->type,
                      (uint32_t)(r >> 48) & 1, 0};
    if (sp->n == MAXPG) continue;
    rc = kvp_page_alloc(p, e->bytes, &t, &sp->ids[sp->n]);
    if (rc == KVP_EBUDGET) refused++;
    else if (rc) die("kvp_page_alloc", rc);
    else {
      kvp_page_desc d; /* write the payload, as an engine's kernels would */
      if ((rc = kvp_page_describe(p, sp->ids[sp->n], &d))) die("kvp_page_describe", rc);
      memset(d.addr, (int)(i & 0xff), d.requested_bytes);
      sp->n++;
    }
  }
  show(p, "filled to the budget (the last 64 allocations were refused)", json);
  /* stage 2: half the sequences finish */
  for (int s = 0; s < NSEQ; s += 2) {
    for (uint32_t k = 0; k < seqs[s].n; k++)
      if ((rc = kvp_page_free(p, seqs[s].ids[k]))) die("kvp_page_free", rc);
    seqs[s].n = 0;
  }
  if ((rc = kvp_check(p))) die("kvp_check", rc);
  if (json) printf(",");
  show(p, "half of the sequences finished", json);
  /* stage 3: everything freed */
  for (int s = 0; s < NSEQ; s++)
    for (uint32_t k = 0; k < seqs[s].n; k++)
      if ((rc = kvp_page_free(p, seqs[s].ids[k]))) die("kvp_page_free", rc);
  if ((rc = kvp_check(p))) die("kvp_check", rc);
  if (json) printf(",");
  show(p, "all sequences finished", json);
  if (json) printf("]\n");
  else
    printf("\nThe ledger moved with every page while the region stayed reserved (%llu bytes): that is what an\n"
           "engine's device-level usage cannot show, and what kvpool reports.\n",
           (unsigned long long)c.region_bytes);
  free(seqs);
  kvp_pool_destroy(p);
  return 0;
}
