/*
 * alloc/region.c - the region: one reservation a pool carves pages from, and
 * its host backend.
 *
 * Host backend: one anonymous private mapping of the region, 2 MiB aligned
 * (over-map by 2 MiB, unmap the ragged ends), with MADV_HUGEPAGE asked for.
 * Pages are faulted in lazily by whoever writes payload, or all at create
 * with KVP_POOL_PREFAULT, as a device allocation is backed at once: after
 * the MADV_HUGEPAGE (MAP_POPULATE would fault the range in 4 KiB pages
 * before the advice, and every payload write would then walk 4 KiB page
 * tables: a decode token's 2 x H rows lie in as many pages), by
 * MADV_POPULATE_WRITE, or a write to each page where the kernel has no
 * such advice; device-level usage reports the resident bytes of the range
 * (mincore), which is what the process really spends on the region.
 *
 * Dry backend (KVP_POOL_DRY, for host and CUDA pools alike): the same
 * aligned mapping with PROT_NONE and MAP_NORESERVE, so addresses exist but
 * no byte is ever committed; copies are no-ops and reads are refused.
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
  if (flags & KVP_POOL_DRY) { /* host or CUDA: a reservation stands in, never touched */
    out->ops = &kvp__region_dry_ops;
  } else if (mem == KVP_MEM_HOST) {
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

/* Map bytes + 2 MiB with prot and how, keep the 2 MiB aligned middle. */
static int map_aligned(kvp__region *r, int prot, int how, const char *what) {
  uint64_t want = r->bytes + KVP__SLAB_BYTES;
  void *p = KVP__FAULT() ? (errno = ENOMEM, MAP_FAILED) : mmap(NULL, want, prot, how, -1, 0);
  if (p == MAP_FAILED)
    return kvp__err(KVP_ENOMEM, "config.region_bytes = %llu: mmap of the %s failed: %s", (unsigned long long)r->bytes,
                    what, strerror(errno));
  uintptr_t lo = (uintptr_t)p, base = (uintptr_t)kvp__align_up(lo, KVP__SLAB_BYTES);
  uintptr_t end = base + r->bytes, hi = lo + want;
  if (base > lo) munmap(p, base - lo);
  if (hi > end) munmap((void *)end, hi - end);
  r->map_base = (void *)base;
  r->map_bytes = r->bytes;
  r->base = (unsigned char *)base;
  return KVP_OK;
}

/* Fault the whole region in, writable (KVP_POOL_PREFAULT), after the huge
 * page advice so that it can take effect. */
static void host_prefault(kvp__region *r) {
#ifdef MADV_POPULATE_WRITE
  if (madvise(r->map_base, r->map_bytes, MADV_POPULATE_WRITE) == 0) return;
#endif
  long pg = sysconf(_SC_PAGESIZE);
  size_t page = pg > 0 ? (size_t)pg : 4096;
  volatile unsigned char *p = r->map_base;
  for (size_t off = 0; off < r->map_bytes; off += page) p[off] = 0; /* fresh anonymous memory: zero already */
}

static int host_reserve(kvp__region *r) {
  int how = MAP_PRIVATE | MAP_ANONYMOUS | (r->flags & KVP_POOL_PREFAULT ? 0 : MAP_NORESERVE);
  int rc = map_aligned(r, PROT_READ | PROT_WRITE, how, "host region");
#ifdef MADV_HUGEPAGE
  if (!rc) madvise(r->map_base, r->map_bytes, MADV_HUGEPAGE); /* advisory; failure is fine */
#endif
  if (!rc && (r->flags & KVP_POOL_PREFAULT)) host_prefault(r);
  return rc;
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

/* Resident bytes of the region: mincore over the bytes pages ever occupied,
 * rounded up to 2 MiB (a transparent huge page faulted in by a write may
 * reach past the last page; the region is 2 MiB aligned), or all of it when
 * prefaulted. Cost: one system call per 16 MiB scanned (4 KiB pages), so it
 * follows the pool's use, not the region's size. */
static int host_usage(kvp__region *r, uint64_t span_bytes, uint64_t *used_bytes, uint64_t *total_bytes) {
  long pg = sysconf(_SC_PAGESIZE);
  uint64_t page = pg > 0 ? (uint64_t)pg : 4096, resident = 0;
  uint64_t scan = kvp__align_up(span_bytes, KVP__SLAB_BYTES);
  if (r->flags & KVP_POOL_PREFAULT || scan > r->bytes) scan = r->bytes;
  unsigned char vec[4096];
  for (uint64_t off = 0; off < scan; off += page * sizeof vec) {
    uint64_t len = scan - off < page * sizeof vec ? scan - off : page * sizeof vec;
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

/* ---- dry backend (KVP_POOL_DRY) -----------------------------------------
 * An inaccessible reservation: offsets and addresses exist (so pages have
 * distinct, aligned places, as in a real region), but no byte of it is ever
 * committed. Copies are the moves of grow and fork: there is no payload to
 * move, so they succeed without touching memory. A read has no payload to
 * give back; readers refuse a dry pool before they get here. */

static int dry_reserve(kvp__region *r) {
  return map_aligned(r, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, "dry region's reservation");
}

static int dry_copy(kvp__region *r, uint64_t dst_off, uint64_t src_off, uint64_t bytes, void *stream) {
  (void)r, (void)dst_off, (void)src_off, (void)bytes, (void)stream;
  return KVP_OK;
}

static int dry_write2d(kvp__region *r, uint64_t dst_off, uint64_t dst_pitch, const void *src, uint64_t src_pitch,
                       uint64_t width, uint64_t height, void *stream) {
  (void)r, (void)dst_off, (void)dst_pitch, (void)src, (void)src_pitch, (void)width, (void)height, (void)stream;
  return KVP_OK;
}

static int dry_read2d(kvp__region *r, void *dst, uint64_t dst_pitch, uint64_t src_off, uint64_t src_pitch,
                      uint64_t width, uint64_t height, void *stream) {
  (void)r, (void)dst, (void)dst_pitch, (void)src_off, (void)src_pitch, (void)width, (void)height, (void)stream;
  return kvp__err(KVP_ENOTSUP, "the pool is dry (KVP_POOL_DRY): it holds no payload to read");
}

/* Nothing of a dry region is ever resident: used is 0 by construction (no
 * mincore walk over a possibly huge reservation). */
static int dry_usage(kvp__region *r, uint64_t span_bytes, uint64_t *used_bytes, uint64_t *total_bytes) {
  (void)span_bytes;
  *used_bytes = 0;
  *total_bytes = r->bytes;
  return KVP_OK;
}

const kvp__region_ops kvp__region_dry_ops = {"dry",       dry_reserve, host_release, dry_copy,
                                             dry_write2d, dry_read2d,  host_quiesce, dry_usage};
