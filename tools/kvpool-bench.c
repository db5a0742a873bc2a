/*
 * kvpool-bench - benchmarks as ratios against a baseline measured in the same
 * run. Prints a table, then one JSON object per figure (one per line).
 *
 *   kvpool-bench [--quick] [--json]
 *
 * Figures
 *   alloc_free_pair_ns  median cost of one alloc + one free over a page-size
 *                       mix drawn from the codec table (64 B .. 1 MiB), single
 *                       thread, steady state of W live pages; baseline:
 *                       jemalloc mallocx/sdallocx replaying the same sequence.
 *   metadata_per_byte   host metadata bytes per managed (region) byte, and per
 *                       allocated byte at the peak of the run.
 * Each figure is the median of R rounds; rounds alternate kvpool and the
 * baseline so drift hits both alike. Public header only.
 */
#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pagemix.h"

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static void die(const char *what, int rc) {
  fprintf(stderr, "kvpool-bench: %s: %s (%s)\n", what, kvp_strerror(rc), kvp_last_error());
  exit(1);
}

/* The replayed workload: op i frees slot[i] (if live) and allocates size[i] there. */
typedef struct workload {
  uint32_t nops;     /* alloc+free pairs */
  uint32_t nlive;    /* W: live pages in steady state */
  uint32_t *slot;    /* [nops] */
  uint64_t *bytes;   /* [nops] */
  kvp_page_type *type; /* [nops] */
} workload;

static workload make_workload(uint32_t nops, uint32_t nlive) {
  workload w = {nops, nlive, malloc(nops * sizeof(uint32_t)), malloc(nops * sizeof(uint64_t)),
                malloc(nops * sizeof(kvp_page_type))};
  uint64_t rng = 0xC0FFEE;
  for (uint32_t i = 0; i < nops; i++) {
    uint64_t r = pagemix_rand(&rng);
    const pagemix_entry *e = pagemix_pick(r);
    w.slot[i] = (uint32_t)((r >> 32) % nlive);
    w.bytes[i] = e->bytes;
    w.type[i] = e->type;
  }
  return w;
}

static double run_kvpool(const workload *w, kvp_pool *p, kvp_page_id *ids) {
  kvp_page_tag t = {1, 0, 0, KVP_PAGE_RAW, 0, 0};
  for (uint32_t s = 0; s < w->nlive; s++) /* warm: fill the live set */
    if (kvp_page_alloc(p, w->bytes[s], &t, &ids[s])) die("warm alloc", KVP_ENOSPC);
  double t0 = now_ns();
  for (uint32_t i = 0; i < w->nops; i++) {
    uint32_t s = w->slot[i];
    t.type = w->type[i];
    kvp_page_free(p, ids[s]);
    int rc = kvp_page_alloc(p, w->bytes[i], &t, &ids[s]);
    if (rc) die("kvp_page_alloc", rc);
  }
  double dt = now_ns() - t0;
  for (uint32_t s = 0; s < w->nlive; s++) kvp_page_free(p, ids[s]);
  return dt / w->nops;
}

static double run_jemalloc(const workload *w, void **ptrs, uint64_t *sizes) {
  for (uint32_t s = 0; s < w->nlive; s++) {
    ptrs[s] = mallocx(w->bytes[s], 0);
    sizes[s] = w->bytes[s];
  }
  double t0 = now_ns();
  for (uint32_t i = 0; i < w->nops; i++) {
    uint32_t s = w->slot[i];
    sdallocx(ptrs[s], sizes[s], 0);
    ptrs[s] = mallocx(w->bytes[i], 0);
    sizes[s] = w->bytes[i];
    if (!ptrs[s]) die("mallocx", KVP_ENOMEM);
  }
  double dt = now_ns() - t0;
  for (uint32_t s = 0; s < w->nlive; s++) sdallocx(ptrs[s], sizes[s], 0);
  return dt / w->nops;
}

int main(int argc, char **argv) {
  int quick = 0, json_only = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) quick = 1;
    else if (!strcmp(argv[i], "--json")) json_only = 1;
    else {
      fprintf(stderr, "usage: kvpool-bench [--quick] [--json]\n");
      return strcmp(argv[i], "--help") ? 2 : 0;
    }
  }
  const int rounds = quick ? 3 : 11;
  const uint32_t nops = quick ? 200000 : 2000000, nlive = 4096;
  workload w = make_workload(nops, nlive);
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 32;
  c.n_kv_heads = 8;
  c.region_bytes = 4ull << 30; /* reserved, never touched: the bench writes no payload */
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create", rc);
  kvp_page_id *ids = calloc(nlive, sizeof *ids);
  void **ptrs = calloc(nlive, sizeof *ptrs);
  uint64_t *sizes = calloc(nlive, sizeof *sizes);
  double kv[32], je[32];
  run_kvpool(&w, p, ids); /* warm-up of both */
  run_jemalloc(&w, ptrs, sizes);
  for (int r = 0; r < rounds; r++) {
    kv[r] = run_kvpool(&w, p, ids);
    je[r] = run_jemalloc(&w, ptrs, sizes);
  }
  double mk = median(kv, rounds), mj = median(je, rounds);
  if ((rc = kvp_check(p))) die("kvp_check", rc);
  kvp_stats s = {.struct_size = sizeof s};
  kvp_stats_get(p, &s);
  double meta_region = (double)s.metadata_bytes.peak / (double)s.bytes_reserved;
  double meta_alloc = (double)s.metadata_bytes.peak / (double)s.bytes_allocated.peak;
  if (!json_only) {
    printf("%-34s %12s %12s %10s\n", "figure", "kvpool", "baseline", "ratio");
    printf("%-34s %10.1f ns %10.1f ns %9.2fx   (jemalloc mallocx/sdallocx, median of %d x %u pairs, W=%u)\n",
           "alloc+free pair, page mix", mk, mj, mk / mj, rounds, nops, nlive);
    printf("%-34s %11.4f%% %12s %10s   (peak %llu metadata bytes, %llu-byte region)\n",
           "host metadata / managed byte", 100 * meta_region, "-", "-", (unsigned long long)s.metadata_bytes.peak,
           (unsigned long long)s.bytes_reserved);
    printf("%-34s %11.4f%% %12s %10s   (peak %llu allocated bytes)\n", "host metadata / allocated byte",
           100 * meta_alloc, "-", "-", (unsigned long long)s.bytes_allocated.peak);
  }
  printf("{\"figure\":\"alloc_free_pair_ns\",\"kvpool\":%.2f,\"baseline\":\"jemalloc mallocx/sdallocx\","
         "\"baseline_value\":%.2f,\"ratio\":%.3f,\"rounds\":%d,\"pairs\":%u,\"live\":%u}\n",
         mk, mj, mk / mj, rounds, nops, nlive);
  printf("{\"figure\":\"metadata_per_managed_byte\",\"kvpool\":%.6f,\"per_allocated_byte\":%.6f,"
         "\"metadata_bytes\":%llu,\"region_bytes\":%llu}\n",
         meta_region, meta_alloc, (unsigned long long)s.metadata_bytes.peak, (unsigned long long)s.bytes_reserved);
  free(ids);
  free(ptrs);
  free(sizes);
  kvp_pool_destroy(p);
  return 0;
}
