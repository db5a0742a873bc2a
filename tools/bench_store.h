/*
 * tools/bench_store.h - kvpool-bench's store-tier figures (tools/bench_store.c):
 * offload and restore of a 32K-token sequence through a private local Redis,
 * and a prefix hit against a miss.
 */
#ifndef KVP_TOOLS_BENCH_STORE_H
#define KVP_TOOLS_BENCH_STORE_H

/* The store figures (a table unless json_only, then JSON lines); 0, or
 * nonzero when no redis-server could start (a line says why). */
int print_store(int quick, int json_only);
/* The prefix hit and miss figures. */
void print_prefix(int quick, int json_only);

#endif
