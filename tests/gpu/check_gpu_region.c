/*
 * tests/gpu/check_gpu_region.c - a pool on a CUDA region: pages allocated in
 * device memory, written with cudaMemset and read back, grown (the payload
 * moves device-to-device), freed; device-level usage (cudaMemGetInfo) stays
 * flat at the reserved region while the ledger moves. Public header only.
 * NOFORK (CUDA does not survive fork); skips with a message without a GPU.
 */
#define KVP_EXPERIMENTAL_API
#include "gpu_test.h"


static void show(const char *stage, kvp_pool *p) {
  kvp_stats s = {.struct_size = sizeof s};
  ck_ok(kvp_stats_get(p, &s));
  printf("%-28s ledger allocated %12llu  requested %12llu  committed %12llu | device used %12llu of %llu\n", stage,
         (unsigned long long)s.bytes_allocated.current, (unsigned long long)s.bytes_requested.current,
         (unsigned long long)s.bytes_committed.current, (unsigned long long)s.device_used_bytes,
         (unsigned long long)s.device_total_bytes);
}

START_TEST(cuda_region_flat_device_moving_ledger) {
  const uint64_t region = 1ull << 30;
  kvp_config c;
  kvp_config_init(&c);
  c.memory = KVP_MEM_CUDA;
  c.device = 0;
  c.n_layers = 32;
  c.n_kv_heads = 8;
  c.region_bytes = region;
  c.budget_bytes = 512ull << 20;
  size_t free0, total;
  ck_cuda(cudaMemGetInfo(&free0, &total));
  kvp_pool *p;
  ck_ok(kvp_pool_create(&c, &p));
  size_t free1;
  ck_cuda(cudaMemGetInfo(&free1, &total));
  ck_assert_uint_ge(free0 - free1, region); /* the region is reserved at create */
  show("created", p);
  kvp_stats s0 = {.struct_size = sizeof s0}, s1 = {.struct_size = sizeof s1};
  ck_ok(kvp_stats_get(p, &s0));

  enum { N = 4000 };
  kvp_page_id *ids = calloc(N, sizeof *ids);
  static const uint64_t sizes[] = {64, 4096, 2048, 1152, 72 * 16, 65536, 262144, 1 << 20};
  int n = 0;
  for (; n < N; n++) {
    kvp_page_tag t = {(uint64_t)n % 7, (uint32_t)n % 32, (uint32_t)n % 8, (kvp_page_type)(n % 3), (uint32_t)n & 1, 0};
    int rc = kvp_page_alloc(p, sizes[n % 8], &t, &ids[n]);
    if (rc == KVP_EBUDGET) break;
    ck_ok(rc);
    kvp_page_desc d;
    ck_ok(kvp_page_describe(p, ids[n], &d));
    ck_cuda(cudaMemset(d.addr, n & 0xff, d.requested_bytes));
  }
  ck_ok(kvp_check(p));
  show("filled", p);
  /* read back a few pages: each holds its own byte */
  for (int i = 0; i < n; i += 97) {
    kvp_page_desc d;
    ck_ok(kvp_page_describe(p, ids[i], &d));
    unsigned char *h = malloc(d.requested_bytes);
    ck_cuda(cudaMemcpy(h, d.addr, d.requested_bytes, cudaMemcpyDeviceToHost));
    for (uint64_t k = 0; k < d.requested_bytes; k++) ck_assert_uint_eq(h[k], (unsigned)(i & 0xff));
    free(h);
  }
  /* grow a page past its class: the payload moves on the device */
  ck_ok(kvp_page_free(p, ids[n - 1]));
  ck_ok(kvp_page_free(p, ids[n - 2]));
  kvp_page_desc d0, d1;
  ck_ok(kvp_page_describe(p, ids[1], &d0));
  ck_ok(kvp_page_grow(p, ids[1], 3 * 4096));
  ck_ok(kvp_page_describe(p, ids[1], &d1));
  ck_assert_ptr_ne(d0.addr, d1.addr);
  unsigned char h[4096];
  ck_cuda(cudaMemcpy(h, d1.addr, 4096, cudaMemcpyDeviceToHost));
  for (int k = 0; k < 4096; k++) ck_assert_uint_eq(h[k], 1);
  ck_ok(kvp_check(p));
  ck_ok(kvp_stats_get(p, &s1));
  /* flat device, moving ledger */
  ck_assert_uint_gt(s1.bytes_allocated.current, s0.bytes_allocated.current + (100ull << 20));
  uint64_t dev_delta = s1.device_used_bytes > s0.device_used_bytes ? s1.device_used_bytes - s0.device_used_bytes
                                                                    : s0.device_used_bytes - s1.device_used_bytes;
  ck_assert_uint_lt(dev_delta, 16ull << 20); /* the CUDA context may wobble; the pages do not show */
  for (int i = 0; i < n - 2; i++) ck_ok(kvp_page_free(p, ids[i]));
  ck_ok(kvp_check(p));
  show("all freed", p);
  ck_ok(kvp_stats_get(p, &s1));
  ck_assert_uint_eq(s1.bytes_allocated.current, 0);
  printf("peak allocated %llu bytes, budget %llu; device-level used moved by %llu bytes\n",
         (unsigned long long)s1.bytes_allocated.peak, (unsigned long long)s1.budget_bytes,
         (unsigned long long)dev_delta);
  kvp_pool_destroy(p);
  size_t free2;
  ck_cuda(cudaMemGetInfo(&free2, &total));
  ck_assert_uint_ge(free2 + (16ull << 20), free0); /* the region went back */
  free(ids);
}
END_TEST

START_TEST(cuda_bad_device) {
  kvp_config c;
  kvp_config_init(&c);
  c.memory = KVP_MEM_CUDA;
  c.device = 999;
  kvp_pool *p;
  ck_assert_int_eq(kvp_pool_create(&c, &p), KVP_EINVAL);
  ck_assert(strstr(kvp_last_error(), "config.device = 999") != NULL);
  c.device = 0;
  c.region_bytes = 1ull << 44; /* more than any GPU holds */
  ck_assert_int_eq(kvp_pool_create(&c, &p), KVP_EDEVICE);
  ck_assert(strstr(kvp_last_error(), "cudaMalloc") != NULL);
}
END_TEST

int main(void) {
  if (!gpu_present("check_gpu_region")) return 0;
  Suite *s = suite_create("gpu_region");
  TCase *tc = tcase_create("cuda");
  tcase_set_timeout(tc, 120);
  tcase_add_test(tc, cuda_region_flat_device_moving_ledger);
  tcase_add_test(tc, cuda_bad_device);
  suite_add_tcase(s, tc);
  return gpu_run(s, CK_VERBOSE);
}
