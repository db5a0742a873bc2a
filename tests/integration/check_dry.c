/*
 * tests/integration/check_dry.c - the dry pool (KVP_POOL_DRY) through the
 * public header: fed the same steps, appends, evictions, forks and frees as
 * a normal pool, it ends with the same ledger and the same breakdowns at
 * every call; a 1 TiB dry region takes gigabytes of pages while the
 * process's resident memory barely moves; reads and views are refused.
 */
#define KVP_EXPERIMENTAL_API
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itest.h"
#include "kvgen.h"
#include "kvpool.h"

enum { L = 3, H = 2, D = 32, BT = 16, MAXN = 64 };

static kvgen G;
static uint16_t K[MAXN * H * D], V[MAXN * H * D];

static kvp_pool *mkpool(uint32_t flags, kvp_mem mem, const char *codecs, const char *policy, uint64_t budget) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L;
  c.n_kv_heads = H;
  c.head_dim = D;
  c.block_tokens = BT;
  c.region_bytes = 32ull << 20;
  c.budget_bytes = budget;
  c.codecs = codecs;
  c.policy = policy;
  c.memory = mem;
  c.flags = flags;
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  return p;
}

/* Every figure that does not depend on payload memory is equal. */
static void same_stats(kvp_pool *a, kvp_pool *b) {
  kvp_stats x = {.struct_size = sizeof x}, y = {.struct_size = sizeof y};
  ck_ok(kvp_stats_get(a, &x));
  ck_ok(kvp_stats_get(b, &y));
#define SAME(f) ck_assert_msg(memcmp(&x.f, &y.f, sizeof x.f) == 0, "stats field %s differs", #f)
  SAME(bytes_requested), SAME(bytes_allocated), SAME(bytes_committed), SAME(bytes_reserved), SAME(budget_bytes);
  SAME(pages), SAME(slabs), SAME(extents), SAME(allocs), SAME(frees), SAME(grows), SAME(grow_moves);
  SAME(budget_refusals), SAME(nospc_refusals), SAME(tokens_retained), SAME(tokens_evicted);
  SAME(bf16_equivalent_bytes), SAME(sequences), SAME(codec_state_bytes), SAME(bytes_retired);
  SAME(page_types), SAME(kv);
#undef SAME
  static const kvp_stats_dim dims[] = {KVP_DIM_LAYER, KVP_DIM_HEAD, KVP_DIM_CODEC, KVP_DIM_SEQ};
  for (unsigned d = 0; d < sizeof dims / sizeof *dims; d++)
    for (uint64_t i = 0; i < 64; i++) {
      kvp_usage u = {0}, w = {0};
      int ra = kvp_stats_breakdown(a, dims[d], i, &u), rb = kvp_stats_breakdown(b, dims[d], i, &w);
      ck_assert_msg(ra == rb, "dim %u index %llu: status %d vs %d", dims[d], (unsigned long long)i, ra, rb);
      ck_assert_msg(!memcmp(&u, &w, sizeof u), "dim %u index %llu: usage differs", dims[d], (unsigned long long)i);
    }
  ck_ok(kvp_check(a));
  ck_ok(kvp_check(b));
  ck_assert_uint_eq(y.device_used_bytes, 0); /* b is the dry one */
}

/* One step on both pools; the same status from each call. */
static int step2(kvp_pool *p[2], uint64_t seq, uint32_t pos0, uint32_t n, uint32_t flags) {
  int rc[2];
  for (int i = 0; i < 2; i++) rc[i] = kvp_step_begin(p[i], seq, n, flags);
  ck_assert_int_eq(rc[0], rc[1]);
  if (rc[0]) return rc[0];
  for (uint32_t l = 0; l < L; l++) {
    kvgen_fill(&G, seq, l, pos0, n, H, D, K, V);
    kvp_kv kv = {K, V, NULL};
    for (int i = 0; i < 2; i++) rc[i] = kvp_append(p[i], seq, l, &kv);
    ck_assert_msg(rc[0] == rc[1], "layer %u: normal %s, dry %s (%s)", l, kvp_err_name(rc[0]), kvp_err_name(rc[1]),
                  kvp_last_error());
    same_stats(p[0], p[1]);
    if (rc[0]) { /* drop the step on both */
      for (int i = 0; i < 2; i++) ck_ok(kvp_seq_free(p[i], seq));
      return rc[0];
    }
  }
  for (int i = 0; i < 2; i++) ck_ok(kvp_step_end(p[i], seq));
  same_stats(p[0], p[1]);
  return KVP_OK;
}

static void both(kvp_pool *p[2], int want, int rc0, int rc1) {
  ck_assert_int_eq(rc0, want);
  ck_assert_int_eq(rc1, want);
  same_stats(p[0], p[1]);
}

/* A scheduler's churn on a normal pool and its dry twin, codecs with RAW
 * tails and reseals, step and stream sequences, a window policy, evictions,
 * forks, frees and budget refusals: identical books after every call. */
static void twin_run(const char *codecs, const char *policy) {
  kvgen_init(&G);
  uint64_t budget = 200u << 10;
  kvp_pool *p[2] = {mkpool(0, KVP_MEM_HOST, codecs, policy, budget),
                    mkpool(KVP_POOL_DRY, KVP_MEM_HOST, codecs, policy, budget)};
  kvp_seq_config step_mode;
  kvp_seq_config_init(&step_mode);
  step_mode.mode = KVP_SEQ_STEP;
  uint32_t pos[8] = {0};
  unsigned refusals = 0;
  uint32_t rnd = 12345;
  for (uint64_t s = 1; s <= 6; s++)
    both(p, KVP_OK, kvp_seq_add(p[0], s, s % 2 ? &step_mode : NULL), kvp_seq_add(p[1], s, s % 2 ? &step_mode : NULL));
  for (int it = 0; it < 90; it++) {
    rnd = rnd * 1103515245u + 12345u;
    uint64_t s = 1 + (rnd >> 8) % 6;
    uint32_t n = it % 7 == 0 ? 40 : 1 + (rnd >> 16) % 5;
    int rc = step2(p, s, pos[s], n, 0);
    if (rc == KVP_EBUDGET) { /* the sequence was dropped on both: start it again */
      refusals++;
      pos[s] = 0;
      both(p, KVP_OK, kvp_seq_add(p[0], s, s % 2 ? &step_mode : NULL),
           kvp_seq_add(p[1], s, s % 2 ? &step_mode : NULL));
      continue;
    }
    ck_assert_int_eq(rc, KVP_OK);
    pos[s] += n;
    if (it % 9 == 4) { /* evict one (layer, head, step) unit on both */
      kvp_seq_desc d = {.struct_size = sizeof d};
      ck_ok(kvp_seq_info(p[0], s, &d));
      uint32_t st = (rnd >> 4) % d.n_steps, l = (rnd >> 12) % L, h = (rnd >> 20) % H;
      int r0 = kvp_evict(p[0], s, l, h, st), r1 = kvp_evict(p[1], s, l, h, st);
      both(p, r0, r0, r1);
    }
    if (it == 30) { /* fork 2 into 7, free 3 */
      both(p, KVP_OK, kvp_seq_fork(p[0], 2, 7), kvp_seq_fork(p[1], 2, 7));
      kvgen_fork(&G, 2, 7, pos[2]);
      pos[7] = pos[2];
      ck_assert_int_eq(step2(p, 7, pos[7], 3, 0), KVP_OK);
      pos[7] += 3;
      both(p, KVP_OK, kvp_seq_free(p[0], 3), kvp_seq_free(p[1], 3));
      both(p, KVP_OK, kvp_seq_add(p[0], 3, &step_mode), kvp_seq_add(p[1], 3, &step_mode));
      pos[3] = 0;
    }
    if (it % 20 == 19) both(p, KVP_OK, kvp_reclaim(p[0]), kvp_reclaim(p[1]));
  }
  kvp_stats x = {.struct_size = sizeof x};
  ck_ok(kvp_stats_get(p[1], &x));
  ck_assert_uint_gt(x.bytes_allocated.peak, budget / 2); /* the run did fill the pool */
  ck_assert_uint_gt(refusals, 0); /* and the budget was met: identical refusals */
  printf("%s %s: peak %llu of budget %llu, %u refused steps\n", codecs ? codecs : "raw", policy ? policy : "", (unsigned long long)x.bytes_allocated.peak, (unsigned long long)budget, refusals);
  for (int i = 0; i < 2; i++) kvp_pool_destroy(p[i]);
}

START_TEST(dry_twin_raw) { twin_run(NULL, NULL); }
END_TEST
START_TEST(dry_twin_codecs) { twin_run("k=int8,v=kivi:bits=2:group=16;layers=2:kv=nvfp4", NULL); }
END_TEST
START_TEST(dry_twin_window) { twin_run("k=fp8,v=int8", "window:sink=4:recent=24"); }
END_TEST
/* Row-wise blocks whose OUTLIERS pages grow with the tokens: a fixed
 * outlier fraction sizes by row count, so the dry twin keeps the same books. */
START_TEST(dry_twin_kvquant) { twin_run("kv=kvquant:bits=3:outliers=0.05;layers=1:k=fp8", NULL); }
END_TEST

/* Threshold outliers size pages from the rows held: a dry pool has none,
 * so it refuses the codec at create, naming it. */
START_TEST(dry_refuses_row_dependent_codec) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.flags = KVP_POOL_DRY;
  c.codecs = "kv=kvquant:bits=3:outlier_mode=threshold";
  kvp_pool *p = NULL;
  ck_status(kvp_pool_create(&c, &p), KVP_ENOTSUP);
  ck_assert_ptr_null(p);
  ck_assert_msg(strstr(kvp_last_error(), "kvquant") && strstr(kvp_last_error(), "dry"), "%s", kvp_last_error());
  c.flags = KVP_POOL_ALLOW_EXPANSION; /* the same codec in a normal pool is fine (its worst case, D/2 outliers
                                          a token, outweighs bf16 at this D) */
  ck_ok(kvp_pool_create(&c, &p));
  kvp_pool_destroy(p);
}
END_TEST

/* Raw pages too: grow moves count both sides the same; no address. */
START_TEST(dry_raw_pages) {
  kvp_pool *p[2] = {mkpool(0, KVP_MEM_HOST, NULL, NULL, 0), mkpool(KVP_POOL_DRY, KVP_MEM_HOST, NULL, NULL, 0)};
  kvp_page_tag tag = {9, 1, 0, KVP_PAGE_CODES, 0, 0};
  kvp_page_id id[2][8];
  for (int j = 0; j < 8; j++) {
    uint64_t bytes = 100u + (uint64_t)j * 9000u;
    both(p, KVP_OK, kvp_page_alloc(p[0], bytes, &tag, &id[0][j]), kvp_page_alloc(p[1], bytes, &tag, &id[1][j]));
  }
  for (int j = 0; j < 8; j += 2)
    both(p, KVP_OK, kvp_page_grow(p[0], id[0][j], 70000), kvp_page_grow(p[1], id[1][j], 70000));
  kvp_page_desc d;
  ck_ok(kvp_page_describe(p[1], id[1][0], &d));
  ck_assert_ptr_null(d.addr);
  ck_assert_uint_eq(d.requested_bytes, 70000);
  for (int j = 1; j < 8; j += 2) both(p, KVP_OK, kvp_page_free(p[0], id[0][j]), kvp_page_free(p[1], id[1][j]));
  for (int i = 0; i < 2; i++) kvp_pool_destroy(p[i]);
}
END_TEST

/* Reads and views of a dry pool: KVP_ENOTSUP saying why; flags checked. */
START_TEST(dry_refuses_reads) {
  kvgen_init(&G);
  kvp_pool *p = mkpool(KVP_POOL_DRY, KVP_MEM_HOST, NULL, NULL, 0);
  ck_ok(kvp_seq_add(p, 1, NULL));
  ck_ok(kvp_step_begin(p, 1, 4, 0));
  for (uint32_t l = 0; l < L; l++) {
    kvgen_fill(&G, 1, l, 0, 4, H, D, K, V);
    kvp_kv kv = {K, V, NULL};
    ck_ok(kvp_append(p, 1, l, &kv));
  }
  ck_ok(kvp_step_end(p, 1));
  static uint16_t k[64 * D];
  kvp_read_req q = {sizeof q, 0, KVP_DTYPE_BF16, k, NULL, NULL, 64, 0, NULL};
  ck_status(kvp_read(p, 1, 0, &q), KVP_ENOTSUP);
  ck_assert_msg(strstr(kvp_last_error(), "dry") != NULL, "%s", kvp_last_error());
  kvp_view *v = (kvp_view *)0x1;
  ck_status(kvp_view_acquire(p, 1, 0, &v), KVP_ENOTSUP);
  ck_assert_ptr_null(v);
  ck_assert_msg(strstr(kvp_last_error(), "dry") != NULL, "%s", kvp_last_error());
  /* inputs are still validated */
  ck_ok(kvp_step_begin(p, 1, 1, 0));
  kvp_kv bad = {NULL, V, NULL};
  ck_status(kvp_append(p, 1, 0, &bad), KVP_EINVAL);
  uint16_t nan[H * D];
  for (unsigned i = 0; i < H * D; i++) nan[i] = 0x3f80;
  nan[D + 5] = 0x7fc0; /* NaN in head 1 */
  kvp_kv withnan = {nan, nan, NULL};
  ck_status(kvp_append(p, 1, 0, &withnan), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "NaN") != NULL, "%s", kvp_last_error());
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
  kvp_config c;
  kvp_config_init(&c);
  c.flags = KVP_POOL_DRY | KVP_POOL_PREFAULT;
  ck_status(kvp_pool_create(&c, &p), KVP_EINVAL);
  ck_assert_msg(strstr(kvp_last_error(), "KVP_POOL_DRY") != NULL, "%s", kvp_last_error());
}
END_TEST

/* A dry CUDA pool needs no GPU and no CUDA build, takes any codec, and
 * never dereferences the inputs (a one-element buffer stands for them). */
START_TEST(dry_cuda_pool_needs_no_device) {
  kvp_pool *p = mkpool(KVP_POOL_DRY, KVP_MEM_CUDA, "kv=nvfp4", NULL, 0);
  uint16_t one[2] = {0, 0};
  ck_ok(kvp_seq_add(p, 5, NULL));
  ck_ok(kvp_step_begin(p, 5, 48, 0));
  for (uint32_t l = 0; l < L; l++) {
    kvp_kv kv = {one, one, NULL};
    ck_ok(kvp_append(p, 5, l, &kv));
  }
  ck_ok(kvp_step_end(p, 5));
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.tokens_retained.current, 48ull * L * H);
  ck_assert_uint_gt(s.page_types[KVP_PAGE_CODES].allocated_bytes, 0);
  ck_assert_uint_eq(s.device_used_bytes, 0);
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
}
END_TEST

static uint64_t rss_bytes(void) {
  unsigned long size = 0, resident = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return 0;
  int n = fscanf(f, "%lu %lu", &size, &resident);
  fclose(f);
  return n == 2 ? (uint64_t)resident * (uint64_t)sysconf(_SC_PAGESIZE) : 0;
}

/* 1 TiB of region on a machine with a few GiB: create, fill 8 GiB of pages
 * in a 32-layer geometry, evict, check; resident memory stays within 64 MiB
 * of where it started and the metadata counter says why. */
START_TEST(dry_terabyte_region) {
#if defined(__SANITIZE_THREAD__)
  printf("dry_terabyte_region: skipped: ThreadSanitizer leaves no room for a 1 TiB reservation\n");
  return;
#endif
  if (access("/proc/self/statm", R_OK) != 0) {
    printf("dry_terabyte_region: skipped: no /proc/self/statm to measure RSS\n");
    return;
  }
  enum { BL = 32, BH = 8, BD = 128, N = 4096, SEQS = 16 };
  size_t elems = (size_t)N * BH * BD;
  uint16_t *kbuf = malloc(elems * 2), *vbuf = malloc(elems * 2);
  ck_assert_ptr_nonnull(kbuf);
  ck_assert_ptr_nonnull(vbuf);
  for (size_t i = 0; i < elems; i++) kbuf[i] = vbuf[i] = (uint16_t)(0x3f80 + (i & 0x3f)); /* touched: resident */
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = BL;
  c.n_kv_heads = BH;
  c.head_dim = BD;
  c.block_tokens = 1024;
  c.region_bytes = 1ull << 40;
  c.flags = KVP_POOL_DRY;
  uint64_t rss0 = rss_bytes();
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  ck_assert_uint_eq(s.bytes_reserved, 1ull << 40);
  ck_assert_msg(s.metadata_bytes.current < (16ull << 20), "empty 1 TiB pool: %llu metadata bytes",
                (unsigned long long)s.metadata_bytes.current);
  for (uint64_t q = 0; q < SEQS; q++) {
    ck_ok(kvp_seq_add(p, q, NULL));
    ck_ok(kvp_step_begin(p, q, N, 0));
    for (uint32_t l = 0; l < BL; l++) {
      kvp_kv kv = {kbuf, vbuf, NULL};
      ck_ok(kvp_append(p, q, l, &kv));
    }
    ck_ok(kvp_step_end(p, q));
  }
  ck_ok(kvp_check(p));
  ck_ok(kvp_stats_get(p, &s));
  uint64_t want = (uint64_t)SEQS * BL * BH * N * BD * 2 * 2; /* bf16 raw: allocated = bf16-equivalent */
  ck_assert_uint_eq(s.bf16_equivalent_bytes.current, want);
  ck_assert_uint_eq(s.bytes_requested.current, want);
  ck_assert_uint_ge(s.bytes_allocated.current, want);
  ck_assert_uint_eq(s.device_used_bytes, 0);
  uint64_t rss1 = rss_bytes();
  printf("dry_terabyte_region: %llu GiB allocated in a 1 TiB dry region; RSS %+.1f MiB, host metadata %.1f MiB\n",
         (unsigned long long)(s.bytes_allocated.current >> 30), ((double)rss1 - (double)rss0) / 1048576.0,
         (double)s.metadata_bytes.current / 1048576.0);
  ck_assert_msg(rss1 < rss0 + (64ull << 20), "RSS grew from %llu to %llu bytes", (unsigned long long)rss0,
                (unsigned long long)rss1);
  ck_assert_msg(s.metadata_bytes.current < (64ull << 20), "%llu metadata bytes",
                (unsigned long long)s.metadata_bytes.current);
  for (uint32_t l = 0; l < BL; l++) ck_ok(kvp_evict(p, 3, l, 1, 0));
  ck_ok(kvp_seq_free(p, 4));
  ck_ok(kvp_reclaim(p));
  ck_ok(kvp_check(p));
  kvp_pool_destroy(p);
  free(kbuf);
  free(vbuf);
}
END_TEST

int main(void) {
  Suite *s = suite_create("dry");
  TCase *t = tcase_create("twin");
  tcase_add_test(t, dry_twin_raw);
  tcase_add_test(t, dry_twin_codecs);
  tcase_add_test(t, dry_twin_window);
  tcase_add_test(t, dry_twin_kvquant);
  tcase_add_test(t, dry_refuses_row_dependent_codec);
  tcase_add_test(t, dry_raw_pages);
  tcase_set_timeout(t, 60);
  suite_add_tcase(s, t);
  t = tcase_create("api");
  tcase_add_test(t, dry_refuses_reads);
  tcase_add_test(t, dry_cuda_pool_needs_no_device);
  suite_add_tcase(s, t);
  t = tcase_create("terabyte");
  tcase_add_test(t, dry_terabyte_region);
  tcase_set_timeout(t, 120);
  suite_add_tcase(s, t);
  return it_run(s);
}
