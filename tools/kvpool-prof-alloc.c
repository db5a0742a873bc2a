/*
 * kvpool-prof-alloc - the page-mix alloc+free pairs of kvpool-bench --alloc
 * in a loop, for a profiler.
 *
 *   kvpool-prof-alloc [pairs [rounds [je]]]   (200000 1 0)
 *
 * The same workload as kvpool-bench's alloc_free_pair_ns figure (the
 * pagemix.h sizes, seed 0xC0FFEE, W = 4096 live pages, a 4 GiB pool of
 * 32 layers x 8 heads): fill the live set, then `rounds` rounds of `pairs`
 * pairs (free slot[i], allocate size[i] there) through kvp_page_free and
 * kvp_page_alloc. With je = 1 it replays the sequence through jemalloc's
 * mallocx/sdallocx instead (the bench's baseline). Prints ns per pair.
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

enum { NLIVE = 4096 };

static double now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static void die(const char *what, int rc) {
  fprintf(stderr, "kvpool-prof-alloc: %s: %s\n", what, rc ? kvp_last_error() : "bad argument");
  exit(1);
}

int main(int argc, char **argv) {
  long npairs = argc > 1 ? atol(argv[1]) : 200000, rounds = argc > 2 ? atol(argv[2]) : 1;
  int je = argc > 3 && atoi(argv[3]);
  if (npairs < 1 || rounds < 1) die("arguments", 0);
  uint32_t *slot = malloc((size_t)npairs * sizeof *slot);
  uint64_t *bytes = malloc((size_t)npairs * sizeof *bytes);
  kvp_page_type *type = malloc((size_t)npairs * sizeof *type);
  if (!slot || !bytes || !type) die("malloc", 0);
  uint64_t rng = 0xC0FFEE;
  for (long i = 0; i < npairs; i++) {
    uint64_t r = pagemix_rand(&rng);
    const pagemix_entry *e = pagemix_pick(r);
    slot[i] = (uint32_t)((r >> 32) % NLIVE);
    bytes[i] = e->bytes;
    type[i] = e->type;
  }
  double t = 0;
  if (je) {
    static void *ptr[NLIVE];
    static uint64_t size[NLIVE];
    for (uint32_t s = 0; s < NLIVE; s++) ptr[s] = mallocx(size[s] = bytes[s % npairs], 0);
    for (long r = 0; r < rounds; r++) {
      double t0 = now_ns();
      for (long i = 0; i < npairs; i++) {
        uint32_t s = slot[i];
        sdallocx(ptr[s], size[s], 0);
        if (!(ptr[s] = mallocx(size[s] = bytes[i], 0))) die("mallocx", 0);
      }
      t += now_ns() - t0;
    }
    for (uint32_t s = 0; s < NLIVE; s++) sdallocx(ptr[s], size[s], 0);
  } else {
    kvp_config c;
    kvp_config_init(&c);
    c.n_layers = 32;
    c.n_kv_heads = 8;
    c.region_bytes = 4ull << 30;
    kvp_pool *p;
    int rc = kvp_pool_create(&c, &p);
    if (rc) die("kvp_pool_create", rc);
    static kvp_page_id id[NLIVE];
    kvp_page_tag tag = {1, 0, 0, KVP_PAGE_RAW, 0, 0};
    for (uint32_t s = 0; s < NLIVE; s++)
      if ((rc = kvp_page_alloc(p, bytes[s % npairs], &tag, &id[s]))) die("warm alloc", rc);
    for (long r = 0; r < rounds; r++) {
      double t0 = now_ns();
      for (long i = 0; i < npairs; i++) {
        uint32_t s = slot[i];
        tag.type = type[i];
        if ((rc = kvp_page_free(p, id[s]))) die("kvp_page_free", rc);
        if ((rc = kvp_page_alloc(p, bytes[i], &tag, &id[s]))) die("kvp_page_alloc", rc);
      }
      t += now_ns() - t0;
    }
    if ((rc = kvp_check(p))) die("kvp_check", rc);
    for (uint32_t s = 0; s < NLIVE; s++)
      if ((rc = kvp_page_free(p, id[s]))) die("kvp_page_free", rc);
    kvp_pool_destroy(p);
  }
  printf("%s: %.1f ns per alloc+free pair (%ld x %ld pairs)\n", je ? "jemalloc" : "kvpool", t / ((double)npairs * rounds),
         rounds, npairs);
  free(slot);
  free(bytes);
  free(type);
  return 0;
}
