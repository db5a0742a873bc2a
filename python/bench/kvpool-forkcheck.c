/*
 * kvpool-forkcheck - a C process that uses pools, forks, and whose child
 * makes and uses pools of its own; run by python/tests/test_fork.py.
 * Linked like the binding loads the library (no jemalloc of its own), so
 * libkvpool dlopens jemalloc for its metadata where it can: the case in
 * which the order of the fork handlers decides between a working fork and
 * a deadlocked one (util/rcu.c). Prints the allocator and the mean fork()
 * time; exit 0 when every child succeeded, 1 when one failed, 2 when one
 * still ran after 60 s (killed).
 */
#include "kvpool.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

/* Pools made, filled, freed and destroyed: 0 on success. */
static int use_pools(void) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 2;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.region_bytes = 8 << 20;
  c.codecs = "kv=int8";
  uint16_t *k = calloc((size_t)16 * 2 * 64, 2);
  int bad = !k;
  for (int round = 0; !bad && round < 2; round++) {
    kvp_pool *p;
    if (kvp_pool_create(&c, &p)) return 1;
    for (uint64_t s = 1; !bad && s <= 4; s++) {
      bad |= kvp_seq_add(p, s, NULL) || kvp_step_begin(p, s, 16, 0);
      for (uint32_t l = 0; !bad && l < 2; l++) bad |= kvp_append(p, s, l, &(kvp_kv){k, k, NULL}) != 0;
      bad |= kvp_step_end(p, s) || kvp_seq_free(p, s) || kvp_check(p);
    }
    kvp_pool_destroy(p);
  }
  free(k);
  return bad;
}

int main(void) {
  if (use_pools()) return 1;
  kvp_config c;
  kvp_config_init(&c);
  kvp_pool *held; /* alive across the forks */
  if (kvp_pool_create(&c, &held)) return 1;
  double spent = 0;
  int rc = 0;
  for (int i = 0; i < 4 && !rc; i++) {
    double t0 = now_us();
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) _exit(use_pools());
    spent += now_us() - t0;
    int status = 0;
    double deadline = now_us() + 60e6;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (now_us() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        fprintf(stderr, "kvpool-forkcheck: the forked child hung\n");
        return 2;
      }
      usleep(10000);
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status)) rc = 1;
  }
  rc |= use_pools() || kvp_check(held);
  kvp_pool_destroy(held);
  printf("allocator %s fork_us %.0f\n", kvp_metadata_allocator(), spent / 4);
  return rc;
}
