/*
 * alloc/region.c - the region: one reservation a pool carves pages from, and
 * its host backend.
 *
 * Host backend: one anonymous private mapping of the region, 2 MiB aligned
 * (over-map by 2 MiB, unmap the ragged ends), with MADV_HUGEPAGE asked for.
 * Pages are faulted in lazily by whoever writes payload, or all at create
 * with KVP_POOL_PREFAULT (MAP_POPULATE), as a device allocation is backed
 * at once; device-level usage reports the resident bytes of the range
 * (mincore), which is what the process really spends on the region.
 *
 *   map_base          base = align_up(map_base, 2 MiB)      base + bytes
 *   |--- unmapped ---|========== region ===================|--- unmapped ---|
 */
#include "alloc.h"

#include <errno.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

int kvp__region_open(kvp_mem mem, int device, uint64_t bytes, uint32_t flags, kvp__region *out) {
  memset(out, 0, sizeof *out);
  out->flags = flags;
  out->mem = mem;
  out->device = device;
  out->bytes = bytes;
  if (mem == KVP_MEM_HOST) {
    out->ops = &kvp__region_host_ops;
  } else {
#ifdef KVP_HAVE_CUDA
    out->ops = &kvp__region_cuda_ops;
#else
    return kvp__err(KVP_ENOTSUP, "config.memory = KVP_MEM_CUDA, but this kvpool was built without CUDA "
                                 "(rebuild with CUDA=1 and a CUDA toolkit)");
#endif
  }
  return out->ops->reserve(out);
}

void kvp__region_close(kvp__region *r) {
  if (r->ops && r->base) r->ops->release(r);
  r->base = NULL;
}

static int host_reserve(kvp__region *r) {
  uint64_t want = r->bytes + KVP__SLAB_BYTES;
  int how = MAP_PRIVATE | MAP_ANONYMOUS | (r->flags & KVP_POOL_PREFAULT ? MAP_POPULATE : MAP_NORESERVE);
  void *p = mmap(NULL, want, PROT_READ | PROT_WRITE, how, -1, 0);
  if (p == MAP_FAILED)
    return kvp__err(KVP_ENOMEM, "config.region_bytes = %llu: mmap of the host region failed: %s",
                    (unsigned long long)r->bytes, strerror(errno));
  uintptr_t lo = (uintptr_t)p, base = (uintptr_t)kvp__align_up(lo, KVP__SLAB_BYTES);
  uintptr_t end = base + r->bytes, hi = lo + want;
  if (base > lo) munmap(p, base - lo);
  if (hi > end) munmap((void *)end, hi - end);
#ifdef MADV_HUGEPAGE
  madvise((void *)base, r->bytes, MADV_HUGEPAGE); /* advisory; failure is fine */
#endif
  r->map_base = (void *)base;
  r->map_bytes = r->bytes;
  r->base = (unsigned char *)base;
  return KVP_OK;
}

static void host_release(kvp__region *r) { munmap(r->map_base, r->map_bytes); }

static int host_copy(kvp__region *r, uint64_t dst_off, uint64_t src_off, uint64_t bytes, void *stream) {
  (void)stream;
  memcpy(r->base + dst_off, r->base + src_off, bytes);
  return KVP_OK;
}

static int host_write2d(kvp__region *r, uint64_t dst_off, uint64_t dst_pitch, const void *src, uint64_t src_pitch,
                        uint64_t width, uint64_t height, void *stream) {
  (void)stream;
  for (uint64_t i = 0; i < height; i++)
    memcpy(r->base + dst_off + i * dst_pitch, (const unsigned char *)src + i * src_pitch, width);
  return KVP_OK;
}

static int host_read2d(kvp__region *r, void *dst, uint64_t dst_pitch, uint64_t src_off, uint64_t src_pitch,
                       uint64_t width, uint64_t height, void *stream) {
  (void)stream;
  for (uint64_t i = 0; i < height; i++)
    memcpy((unsigned char *)dst + i * dst_pitch, r->base + src_off + i * src_pitch, width);
  return KVP_OK;
}

static int host_quiesce(kvp__region *r) {
  (void)r;
  return KVP_OK;
}

static int host_usage(kvp__region *r, uint64_t *used_bytes, uint64_t *total_bytes) {
  long pg = sysconf(_SC_PAGESIZE);
  uint64_t page = pg > 0 ? (uint64_t)pg : 4096, resident = 0;
  unsigned char vec[4096];
  for (uint64_t off = 0; off < r->bytes; off += page * sizeof vec) {
    uint64_t len = r->bytes - off < page * sizeof vec ? r->bytes - off : page * sizeof vec;
    if (mincore(r->base + off, len, vec) != 0)
      return kvp__err(KVP_EDEVICE, "mincore on the host region failed: %s", strerror(errno));
    for (uint64_t i = 0; i < (len + page - 1) / page; i++) resident += vec[i] & 1;
  }
  *used_bytes = resident * page;
  *total_bytes = r->bytes;
  return KVP_OK;
}

const kvp__region_ops kvp__region_host_ops = {"host",       host_reserve, host_release, host_copy,
                                              host_write2d, host_read2d,  host_quiesce, host_usage};
