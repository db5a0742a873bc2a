/*
 * kvpool-bench - benchmarks as ratios against a baseline measured in the same
 * run. Prints a table, then one JSON object per figure (one per line).
 *
 *   kvpool-bench [--quick] [--json] [--codecs] [--qvg] [--calib] [--heatkv] [--alloc] [--seqs] [--read]
 *
 * --seqs prints only the append and read figures (and the dry appends);
 * --read only read_ns_per_token, read_vs_pages_memcpy, read_vs_dram_memcpy
 * and read_hot_ns_per_token, on the same pool filled by the same appends
 * (untimed).
 * --codecs prints only the codec figures (codec_encode_gbs, codec_decode_gbs,
 * qvg_encode_mbs, kvquant_calib_s, kvquant_calib_synthetic_s); --qvg only
 * qvg_encode_mbs; --calib only the two kvquant calibration figures.
 *
 * Figures
 *   alloc_free_pair_ns  median cost of one alloc + one free over a page-size
 *                       mix drawn from the codec table (64 B .. 1 MiB), single
 *                       thread, steady state of W live pages; baseline:
 *                       jemalloc mallocx/sdallocx replaying the same sequence.
 *   var_allocated_over_requested  allocated / requested bytes of the pages of
 *                       a raw bf16 Infinity-2B full cache (one page per scale,
 *                       head and side) from the pool's stats; baseline: exact.
 *   var_nvfp4_allocated_over_requested  the same for an nvfp4 cache (codes,
 *                       scales and a 4-byte META per scale, head and side),
 *                       with jemalloc's rounding of those sizes (nallocx).
 *   scaling_*_ns        alloc+free pairs (page mix), decode append per (seq,
 *                       layer) and kvp_read per token (from memory: caches
 *                       swept before each read round) at 8, 64, 512 and 8192
 *                       live sequences, and alloc+free and a dry decode append
 *                       on 1 GiB .. 1 TiB dry regions; baseline: the first
 *                       row of each axis, same run (target: within 1.5x).
 *   metadata_per_byte   host metadata bytes per managed (region) byte, and per
 *                       allocated byte at the peak of the run.
 *   decode_append_ns    host cost of one decode-step append of one (seq,
 *                       layer), H = 8, D = 128, raw bf16, 8 sequences of 512
 *                       tokens, step_begin/end amortized over 32 layers;
 *                       baseline: memcpy of the same K and V bytes (hot, in
 *                       one place).
 *   decode_append_vs_paged_memcpy  the same append; baseline: memcpy of the
 *                       same rows into one 16-token page per (seq, layer,
 *                       head, K|V), a buffer backed as the pool's region
 *                       (faulted in, 2 MiB pages): the paged layout's floor,
 *                       its rows' lines fetched for the writes.
 *   var_append_ns       host cost of appending one 4096-token VAR scale to one
 *                       (seq, layer) in step mode; baseline: memcpy.
 *   read_ns_per_token   kvp_read of every head of a (seq, layer), per retained
 *                       token; baseline: memcpy of the same bytes from one
 *                       contiguous buffer the caches hold (a floor no paged
 *                       read reaches: the pages lie apart, and are colder).
 *   read_vs_pages_memcpy  the same kvp_read; baseline: memcpy of the same
 *                       rows from the same pages (views), block by block,
 *                       right after a kvp_read pass: the read's own cost
 *                       beyond moving its bytes.
 *   read_vs_dram_memcpy  the same kvp_read; baseline: memcpy of as many
 *                       bytes into the same output rows, head by head, from
 *                       one contiguous buffer as large as a round of reads
 *                       (more than the L3), in rounds of its own after the
 *                       reads': what a plain memcpy of the bytes costs from
 *                       DRAM, with no pages at all (read_ns_per_token's
 *                       baseline is a memcpy within the cache).
 *   read_hot_ns_per_token  kvp_read of one head (1,216 tokens without
 *                       --quick: 622 KB of K and V) 20 times in a row,
 *                       after one read that brings its pages into L2, per
 *                       token; baseline: the memcpy of read_ns_per_token.
 *                       The read's own work where memory is not the limit.
 *   dry_append_ns      a 4096-token step-mode append per (seq, layer) on a dry
 *                       pool (KVP_POOL_DRY: counted, no payload), raw bf16 and
 *                       nvfp4; baseline: the same append on a normal pool.
 *   codec_encode_gbs    host encode and decode throughput per codec, one core, in
 *   codec_decode_gbs    GB/s of bf16-equivalent bytes (D = 128, bf16 in and out,
 *                       4096-token blocks); baseline: memcpy of those bytes.
 *                       qvg and qvg-pro (k-means per block, cold start) run
 *                       one round. kvquant (K side, 1% outliers) per bit
 *                       width 2, 3, 4.
 *   qvg_encode_mbs      qvg and qvg-pro host encode in MB/s of bf16 input on
 *                       one core: 4 segment-heads of 4096 tokens, D = 128,
 *                       stateless (k-means++ cold start), median of 5 rounds
 *                       (--quick: 3), on clustered rows (64 patterns plus
 *                       noise: the structure k-means is for) and on uniform
 *                       noise; baseline: memcpy of the same bytes.
 *   kvquant_calib_s     seconds to fit and write a kvquant calibration for
 *                       L = 32, H = 32, D = 128 from 16 x 2048 tokens a
 *                       (layer, head, side) (--quick: L = 2), one round:
 *                       the calibration alone, kvp_kvquant_calib_add from
 *                       samples in memory (made before the clock starts,
 *                       one layer's K and V, 1 GiB, that every layer is
 *                       fitted from: read from DRAM, as from an engine) on
 *                       one thread per online CPU, then write; baseline:
 *                       memcpy of the samples' f32 bytes (2^33 floats).
 *   kvquant_calib_synthetic_s  the same from kvp_kvquant_calib_synthetic
 *                       (what calib=synthetic costs a pool at create): the
 *                       built-in generator's 2^33 samples counted too.
 *                       Before this split kvquant_calib_s was this figure.
 * Each figure is the median of R rounds; rounds alternate kvpool and the
 * baseline so drift hits both alike. Public header only.
 */
#include <jemalloc/jemalloc.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "pagemix.h" /* first: it opts in to the experimental page API */
#include "bench_calib.h"
#include "bench_store.h"
#include "bench_util.h"
#include "kvpool_codec.h"

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

/* ---- sequences: decode append, VAR append, read ------------------------- */

enum { BL = 32, BH = 8, BD = 128, NSEQ = 8, PREFILL = 512 };

static kvp_pool *seq_pool(uint32_t block_tokens, uint64_t region) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = BL;
  c.n_kv_heads = BH;
  c.head_dim = BD;
  c.region_bytes = region;
  c.block_tokens = block_tokens;
  c.flags = KVP_POOL_PREFAULT; /* as an engine's pre-backed KV region: no first-touch faults in the timings */
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create", rc);
  return p;
}

static void one_step(kvp_pool *p, uint64_t seq, uint32_t n, const uint16_t *k, const uint16_t *v) {
  bench_step(p, seq, n, BL, k, v);
}

/* The baseline of a K and V move: memcpy of each, bytes apiece. */
static double memcpy2_ns(void *dk, const void *sk, void *dv, const void *sv, size_t bytes, int reps) {
  double t0 = now_ns();
  for (int i = 0; i < reps; i++) {
    memcpy(dk, sk, bytes);
    memcpy(dv, sv, bytes);
    __asm__ volatile("" : : "r"(dk), "r"(dv) : "memory");
  }
  return (now_ns() - t0) / reps;
}

typedef struct seq_figs {
  double decode, decode_base, decode_paged, var, var_base, read, read_base, read_pages, read_dram, read_hot; /* ns */
} seq_figs;

/* The floor of a read in the pool's layout: memcpy of the same rows from the
 * same pages (K and V of each retained block of the heads read, as views
 * describe them: kvp_view_acquire, outside the timing), in the same order,
 * right after a kvp_read pass over them, so the pages are as warm or as
 * cold as kvp_read finds them; per token. */
static double read_pages_ns(kvp_view *const *views, int nviews, uint16_t *ko, uint16_t *vo) {
  uint64_t toks = 0;
  double t0 = now_ns();
  for (int i = 0; i < nviews; i++)
    for (uint32_t h = 0; h < BH; h++) {
      size_t out = 0;
      for (uint32_t j = 0; j < views[i]->n_blocks; j++) {
        const kvp_view_block *b = &views[i]->blocks[j];
        if (b->head != h) continue;
        size_t row = (size_t)BD * 2, bytes = (size_t)b->n_tokens * row;
        memcpy((unsigned char *)ko + out, (const unsigned char *)b->page[0][KVP_PAGE_RAW] + b->first * row, bytes);
        memcpy((unsigned char *)vo + out, (const unsigned char *)b->page[1][KVP_PAGE_RAW] + b->first * row, bytes);
        out += bytes;
        toks += b->n_tokens;
      }
      __asm__ volatile("" : : "r"(ko), "r"(vo) : "memory");
    }
  return (now_ns() - t0) / (double)toks;
}

/* What moving a read's bytes from DRAM costs without pages: memcpy of as
 * many bytes, head by head (K then V), into the same output rows from one
 * contiguous buffer as large as a round of reads (more than the L3), which
 * each round streams again as the reads stream their pages; per token. */
static double read_dram_ns(const unsigned char *src, const uint32_t *ntok, int nreads, uint16_t *ko, uint16_t *vo) {
  uint64_t toks = 0;
  size_t off = 0, row = (size_t)BD * 2;
  double t0 = now_ns();
  for (int i = 0; i < nreads; i++) {
    size_t bytes = (size_t)ntok[i] * row;
    memcpy(ko, src + off, bytes);
    memcpy(vo, src + off + bytes, bytes);
    off += 2 * bytes;
    toks += ntok[i];
    __asm__ volatile("" : : "r"(ko), "r"(vo) : "memory");
  }
  return (now_ns() - t0) / (double)toks;
}

/* The floor of a decode append in a paged layout: the same 2 x H rows
 * copied into one page per (seq, layer, head, K|V) of 16-token pages spread
 * over a buffer as large as the pool's payload, no bookkeeping at all. The
 * buffer is backed as the pool's region is (faulted in, 2 MiB pages asked
 * for by MADV_HUGEPAGE): with 4 KiB pages every row would also be a TLB
 * miss, which the pool does not pay. */
static double paged_memcpy_ns(const uint16_t *k, const uint16_t *v, int steps) {
  size_t row = (size_t)BD * 2, page = 16 * row, npages = (size_t)NSEQ * BL * BH * 2 * 64;
  size_t huge = (size_t)2 << 20, bytes = (npages * page + huge - 1) / huge * huge;
  unsigned char *buf = aligned_alloc(huge, bytes);
  if (!buf) die("paged memcpy buffer", KVP_ENOMEM);
#ifdef MADV_HUGEPAGE
  madvise(buf, bytes, MADV_HUGEPAGE); /* advisory, as the pool's */
#endif
  memset(buf, 0, npages * page); /* faulted in, as the pool's prefaulted region */
  double t0 = now_ns();
  for (int st = 0; st < steps; st++)
    for (uint32_t s = 0; s < NSEQ; s++)
      for (uint32_t l = 0; l < BL; l++)
        for (uint32_t h = 0; h < BH; h++)
          for (int kv = 0; kv < 2; kv++) {
            size_t pg = ((((size_t)s * BL + l) * BH + h) * 2 + (size_t)kv) * 64 + (size_t)(st / 16) % 64;
            memcpy(buf + pg * page + (size_t)(st % 16) * row, (kv ? v : k) + (size_t)h * BD, row);
          }
  double dt = (now_ns() - t0) / ((double)steps * NSEQ * BL);
  __asm__ volatile("" : : "r"(buf) : "memory");
  free(buf);
  return dt;
}

/* read_only: the decode steps are appended as for the timed figures (the
 * read finds the same layout), untimed; the figures other than the read are
 * left out (NAN). */
static seq_figs bench_seqs(int rounds, int steps, int read_only) {
  seq_figs f = {NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN};
  double a[32], b[32];
  size_t tok_bytes = (size_t)BH * BD * 2;
  uint16_t *k = malloc(4096 * tok_bytes), *v = malloc(4096 * tok_bytes), *sink = malloc(2 * 4096 * tok_bytes);
  uint16_t *sink_v = sink + 4096 * BH * BD;
  fill_bf16(k, 4096 * BH * BD, 1);
  fill_bf16(v, 4096 * BH * BD, 2);
  /* decode */
  kvp_pool *p = seq_pool(16, 2ull << 30); /* 128 KiB per token over all layers */
  for (uint64_t s = 0; s < NSEQ; s++) {
    if (kvp_seq_add(p, s, NULL)) die("kvp_seq_add", -1);
    one_step(p, s, PREFILL, k, v);
  }
  for (int r = 0; r < rounds; r++) {
    double t0 = now_ns();
    for (int st = 0; st < steps; st++)
      for (uint64_t s = 0; s < NSEQ; s++) one_step(p, s, 1, k + st % 64 * BH * BD, v + st % 64 * BH * BD);
    a[r] = (now_ns() - t0) / ((double)steps * NSEQ * BL);
    if (!read_only) b[r] = memcpy2_ns(sink, k, sink_v, v, tok_bytes, 20000);
  }
  if (!read_only) {
    f.decode = median(a, rounds);
    f.decode_base = median(b, rounds);
    for (int r = 0; r < rounds; r++) b[r] = paged_memcpy_ns(k, v, steps);
    f.decode_paged = median(b, rounds);
  }
  /* read: every head of one (seq, layer), per token */
  uint32_t cap = PREFILL + (uint32_t)(rounds * steps) + 16;
  uint32_t *pos = malloc(cap * sizeof *pos);
  uint16_t *ko = malloc((size_t)cap * BD * 2), *vo = malloc((size_t)cap * BD * 2);
  kvp_view *views[8];
  for (uint64_t s = 0; s < 8; s++)
    if (kvp_view_acquire(p, s, (uint32_t)(s * 5) % BL, &views[s])) die("kvp_view_acquire", -1);
  double c[32];
  uint32_t ntok[8 * BH];
  uint64_t toks = 0;
  for (int r = 0; r < rounds; r++) {
    toks = 0;
    double t0 = now_ns();
    for (uint64_t s = 0; s < 8; s++)
      for (uint32_t h = 0; h < BH; h++) {
        kvp_read_req q = {sizeof q, h, KVP_DTYPE_BF16, ko, vo, pos, cap, 0, NULL};
        int rc = kvp_read(p, s, (uint32_t)(s * 5) % BL, &q);
        if (rc) die("kvp_read", rc);
        toks += q.n_tokens;
        ntok[s * BH + h] = q.n_tokens;
      }
    a[r] = (now_ns() - t0) / (double)toks;
    c[r] = read_pages_ns(views, 8, ko, vo);
    b[r] = memcpy2_ns(ko, k, vo, v, (size_t)BD * 2 * PREFILL, 200) / PREFILL;
  }
  for (int s = 0; s < 8; s++) kvp_view_release(p, views[s]);
  f.read = median(a, rounds);
  f.read_base = median(b, rounds);
  f.read_pages = median(c, rounds);
  /* after the read rounds, so their caches are left as they were */
  unsigned char *dram = malloc((size_t)toks * BD * 2 * 2);
  if (!dram) die("read_dram buffer", KVP_ENOMEM);
  memset(dram, 1, (size_t)toks * BD * 2 * 2);
  for (int r = 0; r < rounds; r++) c[r] = read_dram_ns(dram, ntok, 8 * BH, ko, vo);
  f.read_dram = median(c, rounds);
  free(dram);
  for (int r = 0; r < rounds; r++) { /* one head read again and again: its pages stay in L2 */
    uint64_t hot = 0;
    double t0 = 0;
    for (int i = 0; i <= 20; i++) {
      if (i == 1) t0 = now_ns(), hot = 0; /* the first read brings the pages in */
      kvp_read_req q = {sizeof q, 0, KVP_DTYPE_BF16, ko, vo, pos, cap, 0, NULL};
      int rc = kvp_read(p, 0, 0, &q);
      if (rc) die("kvp_read (hot)", rc);
      hot += q.n_tokens;
    }
    c[r] = (now_ns() - t0) / (double)hot;
  }
  f.read_hot = median(c, rounds);
  free(pos), free(ko), free(vo);
  kvp_pool_destroy(p);
  if (read_only) {
    free(k), free(v), free(sink);
    return f;
  }
  /* VAR scale: 4096 tokens per (seq, layer), step mode, 4096-token blocks */
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  p = seq_pool(4096, 1ull << 30);
  for (int r = 0; r < rounds; r++) {
    if (kvp_seq_add(p, 1, &sc)) die("kvp_seq_add", -1);
    double t0 = now_ns();
    one_step(p, 1, 4096, k, v);
    a[r] = (now_ns() - t0) / BL;
    b[r] = memcpy2_ns(sink, k, sink_v, v, 4096 * tok_bytes, 3); /* one layer: all heads, K and V */
    if (kvp_seq_free(p, 1)) die("kvp_seq_free", -1);
  }
  kvp_pool_destroy(p);
  f.var = median(a, rounds);
  f.var_base = median(b, rounds);
  free(k), free(v), free(sink);
  return f;
}

/* ---- dry pools: what an append costs without payload ------------------------ */

typedef struct dry_fig {
  double dry, normal; /* ns per (seq, layer) append of a 4096-token step */
} dry_fig;

/* A 4096-token step-mode append per (seq, layer) on a dry pool, against the
 * same append on a normal (prefaulted) pool with the same codecs: the
 * baseline. The dry pool still screens the input for NaN and runs the
 * allocator, the ledger and the stats. */
static dry_fig bench_dry(const char *codecs, int rounds) {
  double a[32], b[32];
  size_t elems = (size_t)4096 * BH * BD;
  uint16_t *k = malloc(elems * 2), *v = malloc(elems * 2);
  fill_bf16(k, elems, 3);
  fill_bf16(v, elems, 4);
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP;
  kvp_pool *pools[2];
  for (int d = 0; d < 2; d++) {
    kvp_config c;
    kvp_config_init(&c);
    c.n_layers = BL;
    c.n_kv_heads = BH;
    c.head_dim = BD;
    c.region_bytes = 1ull << 30;
    c.block_tokens = 4096;
    c.codecs = codecs;
    c.flags = d ? KVP_POOL_DRY : KVP_POOL_PREFAULT;
    int rc = kvp_pool_create(&c, &pools[d]);
    if (rc) die("kvp_pool_create (dry bench)", rc);
  }
  for (int r = -1; r < rounds; r++) /* round -1 warms both */
    for (int d = 0; d < 2; d++) {
      if (kvp_seq_add(pools[d], 1, &sc)) die("kvp_seq_add", -1);
      double t0 = now_ns();
      one_step(pools[d], 1, 4096, k, v);
      double dt = (now_ns() - t0) / BL;
      if (kvp_seq_free(pools[d], 1)) die("kvp_seq_free", -1);
      if (r >= 0) (d ? a : b)[r] = dt;
    }
  for (int d = 0; d < 2; d++) kvp_pool_destroy(pools[d]);
  free(k), free(v);
  dry_fig f = {median(a, rounds), median(b, rounds)};
  return f;
}

static void print_dry(int rounds, int json_only) {
  static const struct {
    const char *label, *codecs;
  } cfg[] = {{"raw bf16", NULL}, {"nvfp4", "kv=nvfp4"}};
  for (size_t i = 0; i < sizeof cfg / sizeof *cfg; i++) {
    dry_fig f = bench_dry(cfg[i].codecs, rounds);
    if (!json_only)
      printf("%-34s %10.1f us %10.1f us %9.3fx   (4096-token step per (seq, layer); baseline: the same on a normal pool)\n",
             cfg[i].codecs ? "dry append, nvfp4" : "dry append, raw bf16", f.dry / 1e3, f.normal / 1e3, f.dry / f.normal);
    printf("{\"figure\":\"dry_append_ns\",\"codecs\":\"%s\",\"kvpool\":%.1f,\"baseline\":\"normal pool\","
           "\"baseline_value\":%.1f,\"ratio\":%.4f,\"tokens\":4096}\n",
           cfg[i].label, f.dry, f.normal, f.dry / f.normal);
  }
}

/* ---- scaling: the same costs at 8 .. 8192 live sequences, 1 GiB .. 1 TiB regions ---- */

/* alloc+free pairs of the page mix with tags spread over nseq sequences
 * (every sequence's pages counted apart in the stats), on a region of
 * region bytes (dry above 4 GiB: nothing is touched either way). */
static double scale_alloc(const workload *w, uint32_t nseq, uint64_t region, int rounds) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 32;
  c.n_kv_heads = 8;
  c.region_bytes = region;
  c.flags = KVP_POOL_DRY;
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create (scaling)", rc);
  kvp_page_id *ids = calloc(w->nlive, sizeof *ids);
  kvp_page_tag t = {0, 0, 0, KVP_PAGE_RAW, 0, 0};
  double a[32];
  for (int r = -1; r < rounds; r++) {
    for (uint32_t s = 0; s < w->nlive; s++) {
      t.seq = s % nseq;
      if ((rc = kvp_page_alloc(p, w->bytes[s], &t, &ids[s]))) die("warm alloc (scaling)", rc);
    }
    double t0 = now_ns();
    for (uint32_t i = 0; i < w->nops; i++) {
      uint32_t s = w->slot[i];
      t.type = w->type[i];
      t.seq = (s + i) % nseq;
      kvp_page_free(p, ids[s]);
      if ((rc = kvp_page_alloc(p, w->bytes[i], &t, &ids[s]))) die("kvp_page_alloc (scaling)", rc);
    }
    if (r >= 0) a[r] = (now_ns() - t0) / w->nops;
    for (uint32_t s = 0; s < w->nlive; s++) kvp_page_free(p, ids[s]);
  }
  if ((rc = kvp_check(p))) die("kvp_check (scaling)", rc);
  free(ids);
  kvp_pool_destroy(p);
  return median(a, rounds);
}

enum { SL = 2, SH = 2, SPRE = 16, SPICK = 64 };

typedef struct scale_fig {
  double append, read; /* ns per (seq, layer) decode append; ns per token read (NAN on a dry pool) */
} scale_fig;

/* Read through 64 MiB (twice this host class's last-level cache) so what
 * the next timing reads comes from memory. */
static void evict_caches(void) {
  enum { EV_BYTES = 64 << 20 };
  static unsigned char *buf;
  if (!buf && (buf = malloc(EV_BYTES))) memset(buf, 1, EV_BYTES);
  if (!buf) return;
  unsigned long sum = 0;
  for (size_t i = 0; i < EV_BYTES; i += 64) sum += buf[i];
  __asm__ volatile("" : : "r"(sum));
}

/* nseq live sequences of SPRE tokens (L = 2, H = 2, D = 128, bf16, 16-token
 * blocks); timed: decode steps of SPICK sequences spread over all of them,
 * then kvp_read of head 0 of each of those (normal pools only), each read
 * round after evict_caches: with 8 sequences the rows would otherwise be
 * cache-resident and with 8,192 not, and the row ratio would measure the
 * caches rather than what the number of sequences costs kvpool. */
static scale_fig scale_seqs(uint32_t nseq, uint64_t region, int dry, int rounds, int steps) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = SL;
  c.n_kv_heads = SH;
  c.head_dim = BD;
  c.region_bytes = region;
  c.block_tokens = 16;
  c.flags = dry ? KVP_POOL_DRY : KVP_POOL_PREFAULT; /* no first-touch faults in the timings, as seq_pool */
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create (scaling)", rc);
  size_t tok = (size_t)SH * BD;
  uint16_t *k = malloc(SPRE * tok * 2), *v = malloc(SPRE * tok * 2);
  fill_bf16(k, SPRE * tok, 5);
  fill_bf16(v, SPRE * tok, 6);
  kvp_kv kv = {k, v, NULL};
  for (uint64_t s = 0; s < nseq; s++) {
    if ((rc = kvp_seq_add(p, s, NULL))) die("kvp_seq_add (scaling)", rc);
    if ((rc = kvp_step_begin(p, s, SPRE, 0))) die("kvp_step_begin (scaling)", rc);
    for (uint32_t l = 0; l < SL; l++)
      if ((rc = kvp_append(p, s, l, &kv))) die("kvp_append (scaling)", rc);
    if ((rc = kvp_step_end(p, s))) die("kvp_step_end (scaling)", rc);
  }
  uint32_t cap = SPRE + (uint32_t)((rounds + 1) * steps) + 16;
  uint32_t *pos = malloc(cap * sizeof *pos);
  uint16_t *ko = malloc((size_t)cap * BD * 2), *vo = malloc((size_t)cap * BD * 2);
  double a[32], b[32];
  const uint32_t npick = nseq < SPICK ? nseq : SPICK;
  for (int r = -1; r < rounds; r++) {
    double t0 = now_ns();
    for (int st = 0; st < steps; st++)
      for (uint32_t i = 0; i < npick; i++) {
        uint64_t s = (uint64_t)i * nseq / npick;
        kvp_kv one = {k + (size_t)(st % SPRE) * tok, v + (size_t)(st % SPRE) * tok, NULL};
        if ((rc = kvp_step_begin(p, s, 1, 0))) die("kvp_step_begin (scaling)", rc);
        for (uint32_t l = 0; l < SL; l++)
          if ((rc = kvp_append(p, s, l, &one))) die("kvp_append (scaling)", rc);
        if ((rc = kvp_step_end(p, s))) die("kvp_step_end (scaling)", rc);
      }
    if (r >= 0) a[r] = (now_ns() - t0) / ((double)steps * npick * SL);
    if (dry) continue;
    uint64_t toks = 0;
    evict_caches();
    t0 = now_ns();
    for (uint32_t i = 0; i < npick; i++) {
      kvp_read_req q = {sizeof q, 0, KVP_DTYPE_BF16, ko, vo, pos, cap, 0, NULL};
      if ((rc = kvp_read(p, (uint64_t)i * nseq / npick, 0, &q))) die("kvp_read (scaling)", rc);
      toks += q.n_tokens;
    }
    if (r >= 0) b[r] = (now_ns() - t0) / (double)toks;
  }
  if ((rc = kvp_check(p))) die("kvp_check (scaling)", rc);
  scale_fig f = {median(a, rounds), dry ? 0 : median(b, rounds)};
  free(pos), free(ko), free(vo), free(k), free(v);
  kvp_pool_destroy(p);
  return f;
}

static void print_scale_row(int json_only, const char *figure, const char *axis, uint64_t n, const char *unit,
                            double v, double base, const char *base_label) {
  if (!json_only) {
    char label[64];
    snprintf(label, sizeof label, "  %s, %llu %s", figure, (unsigned long long)n, unit);
    printf("%-34s %10.2f ns %10.2f ns %9.2fx   (baseline: %s; target <= 1.5x)\n", label, v, base, v / base,
           base_label);
  }
  printf("{\"figure\":\"scaling_%s_ns\",\"axis\":\"%s\",\"n\":%llu,\"kvpool\":%.2f,\"baseline\":\"%s\","
         "\"baseline_value\":%.2f,\"ratio\":%.3f}\n",
         figure, axis, (unsigned long long)n, v, base_label, base, v / base);
}

static void print_scaling(int quick, int json_only) {
  const int rounds = quick ? 3 : 7, steps = quick ? 8 : 32;
  workload w = make_workload(quick ? 100000 : 500000, 4096);
  static const uint32_t nseqs[] = {8, 64, 512, 8192};
  static const uint64_t regions[] = {1ull << 30, 16ull << 30, 256ull << 30, 1ull << 40};
  if (!json_only) printf("scaling (medians; each row against the first of its axis, measured in the same run)\n");
  double base = 0;
  for (unsigned i = 0; i < 4; i++) {
    double v = scale_alloc(&w, nseqs[i], 4ull << 30, rounds);
    if (!i) base = v;
    print_scale_row(json_only, "alloc_free", "sequences", nseqs[i], "seqs", v, base, "8 sequences");
  }
  for (unsigned i = 0; i < 4; i++) {
    double v = scale_alloc(&w, 64, regions[i], rounds);
    if (!i) base = v;
    print_scale_row(json_only, "alloc_free", "region_gib", regions[i] >> 30, "GiB dry", v, base, "1 GiB region");
  }
  scale_fig f0 = {0, 0};
  for (unsigned i = 0; i < 4; i++) {
    scale_fig f = scale_seqs(nseqs[i], 1ull << 30, 0, rounds, steps);
    if (!i) f0 = f;
    print_scale_row(json_only, "decode_append", "sequences", nseqs[i], "seqs", f.append, f0.append, "8 sequences");
    print_scale_row(json_only, "read_per_token", "sequences", nseqs[i], "seqs", f.read, f0.read, "8 sequences");
  }
  for (unsigned i = 0; i < 4; i++) {
    scale_fig f = scale_seqs(512, regions[i], 1, rounds, steps);
    if (!i) f0 = f;
    print_scale_row(json_only, "dry_decode_append", "region_gib", regions[i] >> 30, "GiB dry", f.append, f0.append,
                    "1 GiB region");
  }
  free(w.slot), free(w.bytes), free(w.type);
}

/* ---- rounding: allocated over requested bytes of VAR-scale pages ---------- */

/* The pages of an nvfp4 Infinity-2B full cache (per scale, head and side:
 * E2M1 codes of 64 B a token, E4M3 scales of 8 B a token, a 4-byte FP32
 * META) taken from a dry pool: allocated / requested from the pool's stats,
 * beside jemalloc's rounding of the same sizes (nallocx); baseline: exact. */
static void print_rounding_nvfp4(int json_only) {
  static const uint32_t sched[12] = {1, 4, 16, 36, 64, 144, 256, 400, 576, 1024, 1600, 2304};
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 1;
  c.n_kv_heads = 1;
  c.region_bytes = 1ull << 30;
  c.flags = KVP_POOL_DRY;
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create (rounding nvfp4)", rc);
  uint64_t je_alloc = 0;
  for (unsigned i = 0; i < 12; i++)
    for (int side = 0; side < 2; side++) {
      static const kvp_page_type types[3] = {KVP_PAGE_CODES, KVP_PAGE_SCALES, KVP_PAGE_META};
      uint64_t bytes[3] = {(uint64_t)sched[i] * 64, (uint64_t)sched[i] * 8, 4};
      for (int j = 0; j < 3; j++) {
        kvp_page_tag t = {1, 0, 0, types[j], 0, 0};
        kvp_page_id id;
        if ((rc = kvp_page_alloc(p, bytes[j], &t, &id))) die("kvp_page_alloc (rounding nvfp4)", rc);
        je_alloc += nallocx(bytes[j], 0);
      }
    }
  kvp_stats s = {.struct_size = sizeof s};
  if ((rc = kvp_stats_get(p, &s))) die("kvp_stats_get", rc);
  double ratio = (double)s.bytes_allocated.current / (double)s.bytes_requested.current;
  double je = (double)je_alloc / (double)s.bytes_requested.current;
  if (!json_only)
    printf("%-34s %10.4f    %10.4f    %9.4fx   (nvfp4 Infinity-2B scale pages, D=128; jemalloc's classes: %.4f; "
           "target <= 1.01)\n", "allocated / requested, nvfp4 VAR", ratio, 1.0, ratio, je);
  printf("{\"figure\":\"var_nvfp4_allocated_over_requested\",\"kvpool\":%.5f,\"baseline\":\"exact\","
         "\"baseline_value\":1.0,\"ratio\":%.5f,\"jemalloc_nallocx\":%.5f,\"allocated_bytes\":%llu,"
         "\"requested_bytes\":%llu}\n",
         ratio, ratio, je, (unsigned long long)s.bytes_allocated.current, (unsigned long long)s.bytes_requested.current);
  kvp_pool_destroy(p);
}

/* The pages of a raw bf16 Infinity-2B full cache (13-scale 1024x1024
 * schedule, D = 128: one page per (scale, head, side)) taken from a dry pool:
 * allocated / requested from the pool's own stats; baseline: 1.0 (exact). */
static void print_rounding(int json_only) {
  static const uint32_t sched[13] = {1, 4, 16, 36, 64, 144, 256, 400, 576, 1024, 1600, 2304, 4096};
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 1;
  c.n_kv_heads = 1;
  c.region_bytes = 1ull << 30;
  c.flags = KVP_POOL_DRY;
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create (rounding)", rc);
  kvp_page_tag t = {1, 0, 0, KVP_PAGE_RAW, 0, 0};
  kvp_page_id id;
  for (unsigned i = 0; i < 12; i++) /* the last scale is never cached */
    for (int side = 0; side < 2; side++)
      if ((rc = kvp_page_alloc(p, (uint64_t)sched[i] * 128 * 2, &t, &id))) die("kvp_page_alloc (rounding)", rc);
  kvp_stats s = {.struct_size = sizeof s};
  if ((rc = kvp_stats_get(p, &s))) die("kvp_stats_get", rc);
  double ratio = (double)s.bytes_allocated.current / (double)s.bytes_requested.current;
  if (!json_only)
    printf("%-34s %10.4f    %10.4f    %9.4fx   (raw bf16 Infinity-2B scale pages, D=128; target <= 1.01)\n",
           "allocated / requested, VAR pages", ratio, 1.0, ratio);
  printf("{\"figure\":\"var_allocated_over_requested\",\"kvpool\":%.5f,\"baseline\":\"exact\",\"baseline_value\":1.0,"
         "\"ratio\":%.5f,\"allocated_bytes\":%llu,\"requested_bytes\":%llu}\n",
         ratio, ratio, (unsigned long long)s.bytes_allocated.current, (unsigned long long)s.bytes_requested.current);
  kvp_pool_destroy(p);
  print_rounding_nvfp4(json_only);
}

/* ---- codecs: host encode/decode throughput --------------------------------- */

typedef struct codec_fig {
  const char *spec;  /* name:params */
  double enc, dec;   /* GB/s of bf16-equivalent bytes */
} codec_fig;

/* NB blocks of CAP tokens rotate so the working set (NB MiB of bf16) is far
 * beyond the caches, as decoding a real KV cache is: memcpy is measured on
 * the same rotation. */
static codec_fig bench_codec(const char *name, const char *params, int rounds, double *memcpy_gbs) {
  enum { CAP = 4096, CD = 128, NB = 32 };
  codec_fig f = {name, 0, 0};
  uint32_t id;
  if (kvp_codec_find(name, &id)) die("kvp_codec_find", KVP_ENOENT);
  const kvp_codec_vtable *vt = kvp_codec_get(id);
  kvp_codec_geom g = {CD, KVP_DTYPE_BF16, 0, 0, 1, 1};
  void *inst;
  char err[256];
  size_t at;
  if (vt->create(params, &g, &inst, err, sizeof err, &at)) die(err, KVP_EINVAL);
  kvp_codec_layout lay;
  vt->layout(inst, CAP, &lay); /* a block far from position 0 (no sink rows) */
  kvp_codec_block where[NB];
  for (int b = 0; b < NB; b++) where[b] = (kvp_codec_block){0, (1u << 20) + (uint32_t)b * CAP};
  void *pages[NB][KVP_CODEC_MAX_PAGES];
  size_t bytes = (size_t)CAP * CD * 2;
  uint16_t *src = malloc(bytes * NB), *dst = malloc(bytes * NB);
  fill_bf16(src, (size_t)CAP * CD * NB, 7);
  memset(dst, 0, bytes * NB);
  for (int b = 0; b < NB; b++)
    for (unsigned i = 0; i < lay.npages; i++) pages[b][i] = calloc(1, lay.bytes[i]);
  double e[32], d[32], m[32];
  for (int r = 0; r < rounds; r++) {
    double t0 = now_ns();
    for (int b = 0; b < NB; b++)
      if (vt->encode_at ? vt->encode_at(inst, &where[b], NULL, src + (size_t)b * CAP * CD, CD * 2, CAP, CAP, pages[b])
                        : vt->encode(inst, src + (size_t)b * CAP * CD, CD * 2, CAP, CAP, pages[b]))
        die("encode", KVP_ECODEC);
    double t1 = now_ns();
    for (int b = 0; b < NB; b++)
      if (vt->decode_at ? vt->decode_at(inst, &where[b], (const void *const *)pages[b], CAP, CAP, 0, CAP,
                                        dst + (size_t)b * CAP * CD, CD * 2, KVP_DTYPE_BF16)
                        : vt->decode(inst, (const void *const *)pages[b], CAP, CAP, 0, CAP, dst + (size_t)b * CAP * CD,
                                     CD * 2, KVP_DTYPE_BF16))
        die("decode", KVP_ECODEC);
    double t2 = now_ns();
    memcpy(dst, src, bytes * NB);
    __asm__ volatile("" : : "r"(dst) : "memory");
    double t3 = now_ns();
    e[r] = (double)bytes * NB / (t1 - t0);
    d[r] = (double)bytes * NB / (t2 - t1);
    m[r] = (double)bytes * NB / (t3 - t2);
  }
  f.enc = median(e, rounds);
  f.dec = median(d, rounds);
  *memcpy_gbs = median(m, rounds);
  for (int b = 0; b < NB; b++)
    for (unsigned i = 0; i < lay.npages; i++) free(pages[b][i]);
  free(src), free(dst);
  vt->destroy(inst);
  return f;
}

/* ---- HeatKV: plan time, per-step policy overhead -------------------------- */

static const uint32_t INF_SCHED[13] = {1, 4, 16, 36, 64, 144, 256, 400, 576, 1024, 1600, 2304, 4096};

static kvp_pool *var_pool(uint32_t L, uint32_t H, uint32_t D, uint64_t region, const char *policy) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D, c.region_bytes = region;
  c.block_tokens = 4096; /* a scale per block and head */
  c.policy = policy;
  c.flags = KVP_POOL_PREFAULT;
  kvp_pool *p;
  int rc = kvp_pool_create(&c, &p);
  if (rc) die("kvp_pool_create", rc);
  return p;
}

static double seq_add_ns(kvp_pool *p, uint64_t id, double b) {
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP, sc.n_steps = 13, sc.step_tokens = INF_SCHED, sc.budget_fraction = b;
  double t0 = now_ns();
  int rc = kvp_seq_add(p, id, &sc);
  double t1 = now_ns();
  if (rc) die("kvp_seq_add", rc);
  if ((rc = kvp_seq_free(p, id))) die("kvp_seq_free", rc);
  return t1 - t0;
}

/* One generation of `steps` scales; ns per (seq, layer) append, hooks included. */
static double var_gen_ns(kvp_pool *p, uint64_t id, uint32_t L, uint32_t steps, const uint16_t *kv, double b) {
  kvp_seq_config sc;
  kvp_seq_config_init(&sc);
  sc.mode = KVP_SEQ_STEP, sc.n_steps = 13, sc.step_tokens = INF_SCHED, sc.budget_fraction = b;
  int rc = kvp_seq_add(p, id, &sc);
  if (rc) die("kvp_seq_add", rc);
  kvp_kv in = {kv, kv, NULL};
  double t0 = now_ns();
  for (uint32_t k = 0; k < steps; k++) {
    if ((rc = kvp_step_begin(p, id, INF_SCHED[k], 0))) die("kvp_step_begin", rc);
    for (uint32_t l = 0; l < L; l++)
      if ((rc = kvp_append(p, id, l, &in))) die("kvp_append", rc);
    if ((rc = kvp_step_end(p, id))) die("kvp_step_end", rc);
  }
  double t1 = now_ns();
  if ((rc = kvp_seq_free(p, id)) || (rc = kvp_reclaim(p))) die("kvp_seq_free", rc);
  return (t1 - t0) / ((double)steps * L);
}

static void print_heatkv(int quick, int json_only) {
  int rounds = quick ? 3 : 11, rc;
  double plan[32], hit[32], plain[32];
  /* plan time: Infinity-8B geometry; each b differs a little, so each add builds a plan */
  kvp_pool *p8 = var_pool(40, 28, 128, 64u << 20, "heatkv:b=0.1:s=3:orders=synthetic");
  kvp_pool *p0 = var_pool(40, 28, 128, 64u << 20, NULL);
  seq_add_ns(p8, 1, 0.1); /* warm-up: the synthetic orders, made once per pool */
  seq_add_ns(p0, 1, 0);
  for (int r = 0; r < rounds; r++) {
    plan[r] = seq_add_ns(p8, 2, 0.1 + 1e-6 * (r + 1));
    hit[r] = seq_add_ns(p8, 3, 0.1); /* the warm-up's plan, from the cache */
    plain[r] = seq_add_ns(p0, 4, 0);
  }
  double mp = median(plan, rounds), mh = median(hit, rounds), m0 = median(plain, rounds);
  kvp_pool_destroy(p8), kvp_pool_destroy(p0);
  /* per-step overhead: 12 cached scales of Infinity's schedule, L=8 H=8 D=64 */
  enum { VL = 8, VH = 8, VD = 64 };
  uint16_t *kv = malloc((size_t)4096 * VH * VD * 2);
  if (!kv) die("malloc", KVP_ENOMEM);
  fill_bf16(kv, (size_t)4096 * VH * VD, 77);
  kvp_pool *pn = var_pool(VL, VH, VD, 512u << 20, NULL);
  kvp_pool *pk = var_pool(VL, VH, VD, 512u << 20, "heatkv:b=0.1:s=3:orders=synthetic");
  double none[32], keep[32], evict[32];
  var_gen_ns(pn, 1, VL, 12, kv, 0), var_gen_ns(pk, 1, VL, 12, kv, 1.0); /* warm-up */
  for (int r = 0; r < rounds; r++) {
    none[r] = var_gen_ns(pn, 10 + r, VL, 12, kv, 0);
    keep[r] = var_gen_ns(pk, 10 + r, VL, 12, kv, 1.0); /* b = 1: the plan evicts nothing */
    evict[r] = var_gen_ns(pk, 100 + r, VL, 12, kv, 0.1);
  }
  if ((rc = kvp_check(pk))) die("kvp_check", rc);
  double mn = median(none, rounds), mk = median(keep, rounds), me = median(evict, rounds);
  kvp_pool_destroy(pn), kvp_pool_destroy(pk);
  free(kv);
  if (!json_only) {
    printf("%-34s %10.1f us %10.1f us %9.2fx   (kvp_seq_add building the plan vs without a policy, 40x28, 13 scales)\n",
           "heatkv plan, Infinity-8B", mp / 1e3, m0 / 1e3, mp / m0);
    printf("%-34s %10.1f us %10.1f us %9.2fx   (the same plan from the pool's cache)\n", "heatkv plan, cached",
           mh / 1e3, m0 / 1e3, mh / m0);
    printf("%-34s %10.1f us %10.1f us %9.2fx   (per (seq, layer), 12 scales, L=%d H=%d D=%d; b=1: nothing evicted)\n",
           "heatkv step overhead", mk / 1e3, mn / 1e3, mk / mn, VL, VH, VD);
    printf("%-34s %10.1f us %10.1f us %9.2fx   (the same at b=0.1: evictions and skipped heads included)\n",
           "heatkv b=0.1 append", me / 1e3, mn / 1e3, me / mn);
  }
  printf("{\"figure\":\"heatkv_plan_ns\",\"kvpool\":%.0f,\"baseline\":\"kvp_seq_add without policy\","
         "\"baseline_value\":%.0f,\"ratio\":%.3f,\"cached_ns\":%.0f,\"layers\":40,\"heads\":28,\"scales\":13}\n",
         mp, m0, mp / m0, mh);
  printf("{\"figure\":\"heatkv_step_overhead_ns\",\"kvpool\":%.1f,\"baseline\":\"no policy\",\"baseline_value\":%.1f,"
         "\"ratio\":%.4f,\"b01_ns\":%.1f,\"b01_ratio\":%.4f}\n", mk, mn, mk / mn, me, me / mn);
}

static void print_qvg_encode(int quick, int json_only);

/* The codec figures: one table line and one JSON line per codec case. */
static void print_codecs(int quick, int json_only) {
  static const struct {
    const char *name, *params, *label;
    int rounds; /* 0: the default; qvg's k-means encode takes ~0.1 s per block per stage: one round */
  } codecs[] = {{"raw", "", "bf16 (raw)", 0},
                {"fp8", "", "fp8 dynamic", 0},
                {"int8", "", "int8", 0},
                {"kivi", "bits=2:group=32", "kivi b2 g32 (K)", 0},
                {"nvfp4", "", "nvfp4 rule 6", 0},
                {"nvfp4", "rule=4/6:ksmooth=store", "nvfp4 4/6 + ksmooth", 0},
                {"qvg", "", "qvg s1 g64 b2 K256", 1},
                {"qvg-pro", "", "qvg-pro s4 g16 b2 K256", 1},
                {"kvquant", "bits=2", "kvquant nuq2 1% (K)", 0},
                {"kvquant", "bits=3", "kvquant nuq3 1% (K)", 0},
                {"kvquant", "bits=4", "kvquant nuq4 1% (K)", 0}};
  for (size_t i = 0; i < sizeof codecs / sizeof codecs[0]; i++) {
    double mc;
    int crounds = codecs[i].rounds ? codecs[i].rounds : quick ? 3 : 9;
    codec_fig cf = bench_codec(codecs[i].name, codecs[i].params, crounds, &mc);
    if (!json_only)
      printf("%-34s enc %7.3f GB/s (%.3fx)  dec %6.2f GB/s (%.2fx)  memcpy %6.2f GB/s\n", codecs[i].label, cf.enc,
             cf.enc / mc, cf.dec, cf.dec / mc, mc);
    printf("{\"figure\":\"codec_gbs\",\"codec\":\"%s\",\"encode_gbs\":%.3f,\"decode_gbs\":%.3f,"
           "\"baseline\":\"memcpy\",\"baseline_gbs\":%.3f,\"encode_ratio\":%.3f,\"decode_ratio\":%.3f}\n",
           codecs[i].label, cf.enc, cf.dec, mc, cf.enc / mc, cf.dec / mc);
  }
  print_qvg_encode(quick, json_only);
}

/* ---- QVG: host encode, MB/s per core ------------------------------------------ */

/* n tokens of d channels: "clustered" draws each token from one of 64
 * patterns (3 sigma apart per channel) plus noise of 0.05, the structure
 * QVG's k-means exists for (tokens of a video chunk, tests/unit/check_qvg.c's
 * generator); "noise" is fill_bf16's uniform bits, k-means' worst case. */
static void qvg_input(uint16_t *x, uint32_t n, uint32_t d, int clustered, uint64_t seed) {
  if (!clustered) {
    fill_bf16(x, (size_t)n * d, seed);
    return;
  }
  enum { NPAT = 64 };
  float *pat = malloc((size_t)NPAT * d * sizeof *pat);
  if (!pat) die("malloc", KVP_ENOMEM);
  for (size_t e = 0; e < (size_t)NPAT * d; e++) pat[e] = 3.0f * bench_gauss(&seed);
  for (uint32_t t = 0; t < n; t++) {
    const float *p = pat + (size_t)(pagemix_rand(&seed) % NPAT) * d;
    for (uint32_t i = 0; i < d; i++) x[(size_t)t * d + i] = bench_bf16(p[i] + 0.05f * bench_gauss(&seed));
  }
  free(pat);
}

/* MB/s (10^6 bytes of bf16 input per second) of one core encoding NS
 * segment-heads of 4096 tokens (D = 128), the median of rounds; the
 * stateless encode (a cold k-means++ start per segment-head). *memcpy_mbs:
 * memcpy of the same bytes in the same rounds. */
static double bench_qvg_encode(const char *name, int clustered, int rounds, double *memcpy_mbs) {
  enum { N = 4096, D = 128, NS = 4 };
  uint32_t id;
  if (kvp_codec_find(name, &id)) die("kvp_codec_find", KVP_ENOENT);
  const kvp_codec_vtable *vt = kvp_codec_get(id);
  kvp_codec_geom g = {D, KVP_DTYPE_BF16, 0, 0, 1, 1};
  void *inst;
  char err[256];
  size_t at;
  if (vt->create("", &g, &inst, err, sizeof err, &at)) die(err, KVP_EINVAL);
  kvp_codec_layout lay;
  vt->layout(inst, N, &lay);
  void *pages[KVP_CODEC_MAX_PAGES];
  for (unsigned i = 0; i < lay.npages; i++)
    if (!(pages[i] = malloc(lay.bytes[i]))) die("malloc", KVP_ENOMEM);
  size_t bytes = (size_t)N * D * 2;
  uint16_t *src = malloc(bytes * NS), *dst = malloc(bytes * NS);
  if (!src || !dst) die("malloc", KVP_ENOMEM);
  for (int s = 0; s < NS; s++) qvg_input(src + (size_t)s * N * D, N, D, clustered, 11 + (uint64_t)s);
  memset(dst, 0, bytes * NS);
  double e[32], m[32];
  for (int r = 0; r < rounds; r++) {
    double t0 = now_ns();
    for (int s = 0; s < NS; s++)
      if (vt->encode(inst, src + (size_t)s * N * D, D * 2, N, N, pages)) die("qvg encode", KVP_ECODEC);
    double t1 = now_ns();
    memcpy(dst, src, bytes * NS);
    __asm__ volatile("" : : "r"(dst) : "memory");
    double t2 = now_ns();
    e[r] = (double)bytes * NS / (t1 - t0) * 1e3;
    m[r] = (double)bytes * NS / (t2 - t1) * 1e3;
  }
  for (unsigned i = 0; i < lay.npages; i++) free(pages[i]);
  free(src), free(dst);
  vt->destroy(inst);
  *memcpy_mbs = median(m, rounds);
  return median(e, rounds);
}

/* qvg and qvg-pro host encode in MB/s per core, clustered and noise rows. */
static void print_qvg_encode(int quick, int json_only) {
  static const char *const names[] = {"qvg", "qvg-pro"};
  int rounds = quick ? 3 : 5;
  for (int c = 0; c < 2; c++)
    for (int clustered = 1; clustered >= 0; clustered--) {
      double mc, mbs = bench_qvg_encode(names[c], clustered, rounds, &mc);
      const char *in = clustered ? "clustered" : "noise";
      char label[64];
      snprintf(label, sizeof label, "%s host encode, %s", names[c], in);
      if (!json_only)
        printf("%-34s %8.1f MB/s  %6.1f ms per segment-head  (4096 x 128 bf16, one core, cold start; memcpy %.0f MB/s)\n",
               label, mbs, 4096.0 * 128 * 2 / mbs * 1e-3, mc);
      printf("{\"figure\":\"qvg_encode_mbs\",\"codec\":\"%s\",\"input\":\"%s\",\"kvpool\":%.2f,\"tokens\":4096,"
             "\"head_dim\":128,\"rounds\":%d,\"baseline\":\"memcpy\",\"baseline_value\":%.1f,\"ratio\":%.5f}\n",
             names[c], in, mbs, rounds, mc, mbs / mc);
    }
}

#define BENCH_USAGE                                                                                      \
  "usage: kvpool-bench [--quick] [--json] [--codecs | --qvg | --calib | --heatkv | --alloc | --seqs | --read |\n"   \
  "                     --store | --prefix]\n"                                                                    \
  "  benchmarks as ratios against a baseline measured in the same run: a table, then one JSON line\n"    \
  "  per figure (--json: the JSON lines only); --quick: fewer rounds; --seqs: the append and read\n"       \
  "  figures alone; --read: the four kvp_read figures alone (the same pool and appends as --seqs);\n"  \
  "  --calib: the kvquant calibration figure alone (--codecs prints it too);\n"        \
  "  --qvg: the qvg host encode figure alone (--codecs prints it too);\n"          \
  "  --prefix: the prefix attach figure alone (--store prints it too)\n"

/* read_only (--read): the four kvp_read rows alone. */
/* One JSON line of a figure against its baseline, ns to 3 places. */
static void ratio_json(const char *figure, double v, const char *baseline, double base) {
  printf("{\"figure\":\"%s\",\"kvpool\":%.3f,\"baseline\":\"%s\",\"baseline_value\":%.3f,\"ratio\":%.3f}\n", figure,
         v, baseline, base, v / base);
}

static void print_seqs(int rounds, int quick, int json_only, int read_only) {
  seq_figs f = bench_seqs(rounds, quick ? 16 : 64, read_only);
  if (!json_only && !read_only) {
    printf("%-34s %10.1f ns %10.1f ns %9.2fx   (per (seq, layer), H=%d D=%d bf16, %d seqs; memcpy of the same bytes)\n",
           "decode append", f.decode, f.decode_base, f.decode / f.decode_base, BH, BD, NSEQ);
    printf("%-34s %10.1f ns %10.1f ns %9.2fx   (the same rows into one 16-token page per (seq, layer, head, side))\n",
           "decode append vs paged memcpy", f.decode, f.decode_paged, f.decode / f.decode_paged);
    printf("%-34s %10.1f us %10.1f us %9.2fx   (4096-token scale, per (seq, layer), step mode)\n", "VAR scale append",
           f.var / 1e3, f.var_base / 1e3, f.var / f.var_base);
  }
  if (!json_only) {
    printf("%-34s %10.2f ns %10.2f ns %9.2fx   (per retained token, K and V of one head; memcpy of as many bytes "
           "from one hot buffer)\n", "kvp_read", f.read, f.read_base, f.read / f.read_base);
    printf("%-34s %10.2f ns %10.2f ns %9.2fx   (memcpy of the same rows from the same pages, block by block, as warm "
           "as kvp_read finds them)\n", "kvp_read vs its pages' memcpy", f.read, f.read_pages, f.read / f.read_pages);
    printf("%-34s %10.2f ns %10.2f ns %9.2fx   (memcpy of as many bytes from one contiguous buffer in DRAM, head by "
           "head)\n", "kvp_read vs a DRAM memcpy", f.read, f.read_dram, f.read / f.read_dram);
    printf("%-34s %10.2f ns %10.2f ns %9.2fx   (one head read again and again, its pages in L2; the same memcpy)\n",
           "kvp_read from the cache", f.read_hot, f.read_base, f.read_hot / f.read_base);
  }
  if (!read_only) {
    printf("{\"figure\":\"decode_append_ns\",\"kvpool\":%.2f,\"baseline\":\"memcpy\",\"baseline_value\":%.2f,"
           "\"ratio\":%.3f,\"heads\":%d,\"head_dim\":%d}\n",
           f.decode, f.decode_base, f.decode / f.decode_base, BH, BD);
    printf("{\"figure\":\"decode_append_vs_paged_memcpy\",\"kvpool\":%.2f,\"baseline\":\"paged memcpy\","
           "\"baseline_value\":%.2f,\"ratio\":%.3f}\n",
           f.decode, f.decode_paged, f.decode / f.decode_paged);
    printf("{\"figure\":\"var_append_ns\",\"kvpool\":%.1f,\"baseline\":\"memcpy\",\"baseline_value\":%.1f,"
           "\"ratio\":%.3f,\"tokens\":4096}\n",
           f.var, f.var_base, f.var / f.var_base);
  }
  ratio_json("read_ns_per_token", f.read, "memcpy", f.read_base);
  ratio_json("read_vs_pages_memcpy", f.read, "memcpy of the same pages", f.read_pages);
  ratio_json("read_vs_dram_memcpy", f.read, "memcpy from one contiguous buffer in DRAM", f.read_dram);
  ratio_json("read_hot_ns_per_token", f.read_hot, "memcpy", f.read_base);
}

int main(int argc, char **argv) {
  int quick = 0, json_only = 0, codecs_only = 0, qvg_only = 0, calib_only = 0, heatkv_only = 0, alloc_only = 0, store_only = 0, seqs_only = 0, prefix_only = 0, read_only = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--quick")) quick = 1;
    else if (!strcmp(argv[i], "--json")) json_only = 1;
    else if (!strcmp(argv[i], "--codecs")) codecs_only = 1;
    else if (!strcmp(argv[i], "--calib")) calib_only = 1;
    else if (!strcmp(argv[i], "--qvg")) qvg_only = 1;
    else if (!strcmp(argv[i], "--heatkv")) heatkv_only = 1;
    else if (!strcmp(argv[i], "--alloc")) alloc_only = 1;
    else if (!strcmp(argv[i], "--store")) store_only = 1;
    else if (!strcmp(argv[i], "--seqs")) seqs_only = 1;
    else if (!strcmp(argv[i], "--read")) read_only = 1;
    else if (!strcmp(argv[i], "--prefix")) prefix_only = 1;
    else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      fputs(BENCH_USAGE, stdout);
      return 0;
    } else {
      fprintf(stderr, "kvpool-bench: unknown argument \"%s\"\n" BENCH_USAGE, argv[i]);
      return 2;
    }
  }
  if (codecs_only + qvg_only + calib_only + heatkv_only + alloc_only + store_only + seqs_only + prefix_only + read_only > 1) {
    fprintf(stderr, "kvpool-bench: --codecs, --qvg, --calib, --heatkv, --alloc, --seqs, --read, --store and --prefix each "
                    "select one part: "
                    "give one (or none: all)\n"
                    BENCH_USAGE);
    return 2;
  }
  if (codecs_only) {
    print_codecs(quick, json_only);
    bench_kvquant_calib(quick, json_only);
    return 0;
  }
  if (calib_only) {
    bench_kvquant_calib(quick, json_only);
    return 0;
  }
  if (qvg_only) {
    print_qvg_encode(quick, json_only);
    return 0;
  }
  if (heatkv_only) {
    print_heatkv(quick, json_only);
    return 0;
  }
  if (store_only) return print_store(quick, json_only);
  if (prefix_only) {
    print_prefix(quick, json_only);
    return 0;
  }
  /* host metadata comes from the arena of the jemalloc this program links (kvpool.pc's Libs) */
  if (!json_only) printf("kvpool %s, host metadata from %s\n", kvp_version(), kvp_metadata_allocator());
  const int rounds = quick ? 3 : 11;
  if (seqs_only) {
    if (!json_only) printf("%-34s %12s %12s %10s\n", "figure", "kvpool", "baseline", "ratio");
    print_seqs(rounds, quick, json_only, 0);
    print_dry(rounds, json_only);
    return 0;
  }
  if (read_only) {
    if (!json_only) printf("%-34s %12s %12s %10s\n", "figure", "kvpool", "baseline", "ratio");
    print_seqs(rounds, quick, json_only, 1);
    return 0;
  }
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
  if ((rc = kvp_stats_get(p, &s))) die("kvp_stats_get", rc);
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
  print_rounding(json_only);
  print_scaling(quick, json_only);
  if (alloc_only) return 0;

  print_seqs(rounds, quick, json_only, 0);
  print_dry(rounds, json_only);
  print_codecs(quick, json_only);
  bench_kvquant_calib(quick, json_only);
  print_heatkv(quick, json_only);
  print_store(quick, json_only);
  return 0;
}
