/*
 * kvpool-prof-alloc - the page-mix alloc+free pairs of kvpool-bench --alloc
 * in a loop, for a profiler, or against jemalloc in the same process.
 *
 *   kvpool-prof-alloc [pairs [rounds [mode [seqs]]]]   (200000 1 0 1)
 *
 * The same workload as kvpool-bench's alloc_free_pair_ns figure (the
 * pagemix.h sizes, seed 0xC0FFEE, W = 4096 live pages, a 4 GiB pool of
 * 32 layers x 8 heads): fill the live set, then `rounds` rounds of `pairs`
 * pairs (free slot[i], allocate size[i] there) through kvp_page_free and
 * kvp_page_alloc. mode 0: kvpool alone; 1: jemalloc's mallocx/sdallocx
 * replaying the same sequence instead (the bench's baseline); 2: both,
 * alternated round by round, as the bench does, printing the medians and
 * the median of the per-round ratios (a noisy host moves both sides of a
 * round alike). seqs > 1: the tags spread over seqs sequences, a new one
 * at every call, on a dry pool (kvpool-bench's scaling_alloc_free rows).
 * Prints ns per pair.
 * Instructions per pair:
 *   valgrind --tool=callgrind build/kvpool-prof-alloc 200000 1
 *   callgrind_annotate --inclusive=yes callgrind.out.* | grep kvp_page_
 * (divide by the pairs plus the 4096 warm-up allocations).
 */
#include <jemalloc/jemalloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "pagemix.h" /* first: it opts in to the experimental page API */

enum { NLIVE = 4096, MAX_ROUNDS = 1001 };

typedef struct work {
  long npairs;          /* pairs a round */
  uint32_t nseq;        /* sequences the tags name (1: sequence 1 only) */
  uint32_t *slot;       /* [npairs] */
  uint64_t *bytes;      /* [npairs] */
  kvp_page_type *type;  /* [npairs] */
} work;

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void die(const char *what, int rc) {
  fprintf(stderr, "kvpool-prof-alloc: %s: %s\n", what, rc ? kvp_last_error() : "bad argument");
  exit(1);
}

/* One round through kvpool: ns per pair. */
static double round_kvpool(const work *w, kvp_pool *p, kvp_page_id *id) {
  kvp_page_tag tag = {1, 0, 0, KVP_PAGE_RAW, 0, 0};
  int rc;
  for (uint32_t s = 0; s < NLIVE; s++) {
    if (w->nseq > 1) tag.seq = s % w->nseq;
    if ((rc = kvp_page_alloc(p, w->bytes[s % w->npairs], &tag, &id[s]))) die("warm alloc", rc);
  }
  double t0 = now_ns();
  for (long i = 0; i < w->npairs; i++) {
    uint32_t s = w->slot[i];
    tag.type = w->type[i];
    if (w->nseq > 1) tag.seq = (s + (uint64_t)i) % w->nseq;
    if ((rc = kvp_page_free(p, id[s]))) die("kvp_page_free", rc);
    if ((rc = kvp_page_alloc(p, w->bytes[i], &tag, &id[s]))) die("kvp_page_alloc", rc);
  }
  double t = (now_ns() - t0) / (double)w->npairs;
  if ((rc = kvp_check(p))) die("kvp_check", rc);
  for (uint32_t s = 0; s < NLIVE; s++)
    if ((rc = kvp_page_free(p, id[s]))) die("kvp_page_free", rc);
  return t;
}

/* The same round through jemalloc: ns per pair. */
static double round_jemalloc(const work *w, void **ptr, uint64_t *size) {
  for (uint32_t s = 0; s < NLIVE; s++) ptr[s] = mallocx(size[s] = w->bytes[s % w->npairs], 0);
  double t0 = now_ns();
  for (long i = 0; i < w->npairs; i++) {
    uint32_t s = w->slot[i];
    sdallocx(ptr[s], size[s], 0);
    if (!(ptr[s] = mallocx(size[s] = w->bytes[i], 0))) die("mallocx", 0);
  }
  double t = (now_ns() - t0) / (double)w->npairs;
  for (uint32_t s = 0; s < NLIVE; s++) sdallocx(ptr[s], size[s], 0);
  return t;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, long n) {
  qsort(v, (size_t)n, sizeof *v, cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv) {
  long npairs = argc > 1 ? atol(argv[1]) : 200000, rounds = argc > 2 ? atol(argv[2]) : 1;
  int mode = argc > 3 ? atoi(argv[3]) : 0;
  long nseq = argc > 4 ? atol(argv[4]) : 1;
  if (npairs < 1 || rounds < 1 || rounds > MAX_ROUNDS || mode < 0 || mode > 2 || nseq < 1 || nseq > UINT32_MAX)
    die("arguments (pairs >= 1, rounds 1..1001, mode 0..2, seqs >= 1)", 0);
  work w = {npairs, (uint32_t)nseq, malloc((size_t)npairs * sizeof *w.slot), malloc((size_t)npairs * sizeof *w.bytes),
            malloc((size_t)npairs * sizeof *w.type)};
  if (!w.slot || !w.bytes || !w.type) die("malloc", 0);
  uint64_t rng = 0xC0FFEE;
  for (long i = 0; i < npairs; i++) {
    uint64_t r = pagemix_rand(&rng);
    const pagemix_entry *e = pagemix_pick(r);
    w.slot[i] = (uint32_t)((r >> 32) % NLIVE);
    w.bytes[i] = e->bytes;
    w.type[i] = e->type;
  }
  kvp_pool *p = NULL;
  if (mode != 1) {
    kvp_config c;
    kvp_config_init(&c);
    c.n_layers = 32;
    c.n_kv_heads = 8;
    c.region_bytes = 4ull << 30;
    if (nseq > 1) c.flags = KVP_POOL_DRY; /* as kvpool-bench's scaling rows */
    int rc = kvp_pool_create(&c, &p);
    if (rc) die("kvp_pool_create", rc);
  }
  static kvp_page_id id[NLIVE];
  static void *ptr[NLIVE];
  static uint64_t size[NLIVE];
  static double kv[MAX_ROUNDS], je[MAX_ROUNDS], ratio[MAX_ROUNDS];
  double tkv = 0, tje = 0;
  if (mode == 2) { /* a warm-up round of each, as the bench */
    round_kvpool(&w, p, id);
    round_jemalloc(&w, ptr, size);
  }
  for (long r = 0; r < rounds; r++) {
    if (mode != 1) tkv += kv[r] = round_kvpool(&w, p, id);
    if (mode != 0) tje += je[r] = round_jemalloc(&w, ptr, size);
    if (mode == 2) ratio[r] = kv[r] / je[r];
  }
  kvp_pool_destroy(p);
  if (mode == 2)
    printf("kvpool %.2f ns, jemalloc %.2f ns per alloc+free pair: ratio %.4f (medians of %ld alternated rounds of "
           "%ld pairs, %u seqs)\n",
           median(kv, rounds), median(je, rounds), median(ratio, rounds), rounds, npairs, w.nseq);
  else
    printf("%s: %.1f ns per alloc+free pair (%ld x %ld pairs, %u seqs)\n", mode ? "jemalloc" : "kvpool",
           (mode ? tje : tkv) / (double)rounds, rounds, npairs, w.nseq);
  free(w.slot);
  free(w.bytes);
  free(w.type);
  return 0;
}
