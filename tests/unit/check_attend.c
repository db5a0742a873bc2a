/*
 * tests/unit/check_attend.c - kvp_attend_decode's block table
 * (pages/attend_table.c), built on the host without a GPU: byte for byte
 * what the straightforward build gives (kept here as the reference: the
 * build kvp_attend_decode had first: kvp__walk_ranges, one kvp__gjob per
 * range, the splits over them, the records compacted to the kernel's
 * form), for raw, fp8, int8,
 * nvfp4 and kivi pages and the generic record; OPEN and sealed blocks,
 * 1-token and block-edge sequences, step mode, forks, evicted heads, shared
 * prefix chunks; every split size and slot count; a buffer grown from
 * nothing. Then its invariants against the streams' counts, its refusals,
 * and a reader building tables while the writer appends and evicts.
 *
 * The pools are host pools whose allocator is set to 64-byte pages at
 * create, as a CUDA region's (the table addresses pages in 64-byte
 * units), so they hold real payload and share prefixes; one is a dry CUDA
 * pool, as tools/kvpool-prof-attend.c builds.
 */
#include "../../codecs/numeric.h"
#include "../../pages/pages.h"
#include "testutil.h"

#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#ifdef KVP_HAVE_CUDA

enum { L = 2, H = 4, D = 64, BT = 16, MAXSEQ = 20 };

/* ---- the reference ----------------------------------------------------------- */

typedef struct ref_ctx {
  kvp__gjob *recs;
  uint64_t n, cap;
  uint32_t head;
  uint64_t tokens;
  double bytes;
} ref_ctx;

static int ref_range(void *vctx, kvp__block *b, uint32_t a, uint32_t e) {
  ref_ctx *c = vctx;
  if (c->n == c->cap) {
    c->cap = c->cap ? 2 * c->cap : 64;
    c->recs = realloc(c->recs, c->cap * sizeof *c->recs);
    ck_assert_ptr_nonnull(c->recs);
  }
  kvp__gjob_fill(&c->recs[c->n++], b, c->head, a, e, 0, b->raw ? 1 : 0);
  for (int kv = 0; kv < 2; kv++)
    for (unsigned i = 0; i < b->npages[kv]; i++)
      c->bytes += (double)KVP__PG(b, i)[kv].requested_bytes * (e - a) / b->cap_tokens;
  c->tokens += e - a;
  return 0;
}

static uint32_t ref_splits(const kvp__gjob *recs, const uint32_t *recs_at, const uint64_t *tok_of, uint32_t nbh,
                           uint32_t chunk, kvp__asplit *out, uint32_t *bh_split0, uint32_t *slots) {
  uint32_t n = 0, nslot = 0;
  for (uint32_t bh = 0; bh < nbh; bh++) {
    uint32_t first = n, r = recs_at[bh], end = recs_at[bh + 1];
    uint64_t total = tok_of[bh];
    uint64_t parts = total ? (total + chunk - 1) / chunk : 1, cum = 0;
    if (bh_split0) bh_split0[bh] = n;
    do {
      uint32_t r0 = r;
      uint64_t target = total * (n - first + 1) / parts;
      while (r < end && (r == r0 || 2 * (cum + recs[r].m1 + 1u) <= 2 * target + recs[r].m1 + 1u))
        cum += recs[r++].m1 + 1u;
      if (out) out[n] = (kvp__asplit){r0, r - r0, bh, 0};
      n++;
    } while (r < end);
    if (out)
      for (uint32_t s = first; s < n; s++) out[s].slot = n - first > 1 ? nslot + (s - first) : KVP__ASPLIT_ONLY;
    if (n - first > 1) nslot += n - first;
  }
  if (bh_split0) bh_split0[nbh] = n;
  *slots = nslot;
  return n;
}

/* The split size: one wave of slots, or one split per bh; with more bh
 * than the device's slots and a head longer than 5/4 of the mean, at most
 * a quarter of a slot's share. */
static uint64_t ref_wave_chunk(const uint64_t *tok_of, uint32_t nbh, uint64_t tokens, uint32_t slots) {
  uint32_t device = slots;
  if (slots < nbh) slots = nbh;
  uint64_t ch = (tokens + slots - 1) / slots;
  if (ch < 64) ch = 64;
  for (int it = 0; it < 8; it++) {
    uint64_t n = 0, most = 0;
    for (uint32_t bh = 0; bh < nbh; bh++) {
      uint64_t t = tok_of[bh];
      n += t ? (t + ch - 1) / ch : 1;
      if (t > most) most = t;
    }
    if (n <= slots || ch >= most) break;
    ch = ch * n / slots + 1;
  }
  uint64_t most = 0;
  for (uint32_t bh = 0; bh < nbh; bh++)
    if (tok_of[bh] > most) most = tok_of[bh];
  if (nbh > device && (double)most > 1.25 * (double)tokens / nbh) {
    uint64_t q = (tokens + 4ull * device - 1) / (4ull * device);
    if (q < ch) ch = q < 64 ? 64 : q;
  }
  return ch;
}

typedef struct ref_table {
  unsigned char *bytes; /* the table as kvp__attend_build lays it out */
  uint64_t table_bytes, off_splits, off_bh, token_heads, bytes_read;
  uint32_t nrec, nsplit, nslot;
} ref_table;

/* t's table the old way (under the read lock). */
static int ref_build(kvp_pool *pool, const kvp__atable *t, ref_table *out) {
  uint32_t nbh = t->batch * H, rb = kvp__kern_attend_rec_bytes(t->kind);
  uint64_t *tok_of = calloc(nbh, sizeof *tok_of);
  uint32_t *recs_at = calloc(nbh + 1, sizeof *recs_at);
  ref_ctx c = {0};
  for (uint32_t b = 0; b < t->batch; b++) {
    kvp__seq *s = kvp__seq_find(pool, t->seqs[b]);
    if (!s) {
      free(tok_of), free(recs_at), free(c.recs);
      return KVP_ENOENT;
    }
    for (uint32_t h = 0; h < H; h++) {
      recs_at[b * H + h] = (uint32_t)c.n;
      c.head = h;
      uint64_t tok0 = c.tokens;
      kvp__walk_ranges(s, pool, t->layer, h, UINT64_MAX, ref_range, &c);
      tok_of[b * H + h] = c.tokens - tok0;
    }
  }
  uint32_t nrec = recs_at[nbh] = (uint32_t)c.n, nslot;
  uint64_t ch = t->split_tokens ? t->split_tokens : ref_wave_chunk(tok_of, nbh, c.tokens, t->slots);
  uint32_t chunk = ch > UINT32_MAX ? UINT32_MAX : (uint32_t)ch;
  uint32_t nsplit = ref_splits(c.recs, recs_at, tok_of, nbh, chunk, NULL, NULL, &nslot);
  out->nrec = nrec, out->nsplit = nsplit, out->nslot = nslot;
  out->off_splits = ((uint64_t)nrec * rb + 15) / 16 * 16;
  out->off_bh = out->off_splits + (uint64_t)nsplit * sizeof(kvp__asplit);
  out->table_bytes = out->off_bh + (uint64_t)(nbh + 1) * 4;
  out->token_heads = c.tokens, out->bytes_read = (uint64_t)c.bytes;
  out->bytes = calloc(1, out->table_bytes);
  ck_assert_ptr_nonnull(out->bytes);
  ref_splits(c.recs, recs_at, tok_of, nbh, chunk, (kvp__asplit *)(out->bytes + out->off_splits),
             (uint32_t *)(out->bytes + out->off_bh), &nslot);
  for (uint32_t i = 0; i < nrec; i++) { /* the compaction */
    const kvp__gjob g = c.recs[i];
    if (rb == sizeof(kvp__arec_raw)) {
      const kvp__arec_raw r = {{g.page[0][0], g.page[1][0]}, g.t0, g.m1, 0};
      memcpy(out->bytes + (size_t)i * rb, &r, sizeof r);
    } else if (rb == sizeof(kvp__arec_q)) {
      const kvp__arec_q r = {{{g.page[0][0], g.page[0][1], g.page[0][2]}, {g.page[1][0], g.page[1][1], g.page[1][2]}},
                             g.t0, g.m1, g.cap1, g.tag};
      memcpy(out->bytes + (size_t)i * rb, &r, sizeof r);
    } else {
      memcpy(out->bytes + (size_t)i * rb, &g, sizeof g);
    }
  }
  free(tok_of), free(recs_at), free(c.recs);
  return KVP_OK;
}

/* ---- pools ------------------------------------------------------------------ */

static int grow_heap(kvp__abuf *b, uint64_t used, uint64_t need) {
  (void)used;
  uint64_t cap = b->cap_bytes ? b->cap_bytes : 16;
  while (cap < need) cap *= 2;
  unsigned char *p = realloc(b->p, cap);
  if (!p) return KVP_ENOMEM;
  b->p = p, b->cap_bytes = cap;
  return KVP_OK;
}

/* A host pool with a CUDA region's 64-byte pages (payload, prefix sharing),
 * or a dry CUDA pool. */
static kvp_pool *mkpool(const char *codecs, kvp_dtype dt, int dry_cuda) {
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = L, c.n_kv_heads = H, c.head_dim = D;
  c.k_dtype = c.v_dtype = dt;
  c.region_bytes = 64ull << 20;
  c.block_tokens = BT;
  c.codecs = codecs;
  if (dry_cuda) c.memory = KVP_MEM_CUDA, c.flags = KVP_POOL_DRY;
  kvp_pool *p = NULL;
  ck_ok(kvp_pool_create(&c, &p));
  if (!dry_cuda) {
    ck_assert_uint_eq(p->alloc.ledger.allocated.current, 0); /* no page yet: every page from here on is aligned */
    p->alloc.page_align_bytes = 64;
  }
  return p;
}

/* K and V of n tokens (small finite values every codec takes). */
static void kv_of(uint64_t seq, uint32_t layer, uint32_t pos, uint32_t n, kvp_dtype dt, void *k, void *v) {
  for (uint32_t i = 0; i < n * H * D; i++) {
    uint32_t x = (uint32_t)(seq * 7919 + layer * 104729 + (pos + i / (H * D)) * 31 + i % (H * D)) * 2654435761u;
    float fk = (float)((int)(x >> 20) % 200 - 100) / 32.0f, fv = (float)((int)(x >> 8 & 0xFFF) % 200 - 100) / 32.0f;
    if (dt == KVP_DTYPE_F32) {
      ((float *)k)[i] = fk, ((float *)v)[i] = fv;
    } else if (dt == KVP_DTYPE_BF16) {
      uint32_t a, b;
      memcpy(&a, &fk, 4), memcpy(&b, &fv, 4);
      ((uint16_t *)k)[i] = (uint16_t)(a >> 16), ((uint16_t *)v)[i] = (uint16_t)(b >> 16);
    } else { /* f16: the values are exact there too (multiples of 1/32 below 4) */
      ((uint16_t *)k)[i] = kvp__f16_from_f32(fk), ((uint16_t *)v)[i] = kvp__f16_from_f32(fv);
    }
  }
}

static void step(kvp_pool *p, uint64_t seq, uint32_t n, kvp_dtype dt, int dry) {
  static unsigned char k[256 * H * D * 4], v[256 * H * D * 4];
  kvp_seq_desc info = {.struct_size = sizeof info};
  ck_ok(kvp_seq_info(p, seq, &info));
  ck_ok(kvp_step_begin(p, seq, n, 0));
  for (uint32_t l = 0; l < L; l++) {
    if (!dry) kv_of(seq, l, info.n_positions, n, dt, k, v);
    ck_ok(kvp_append(p, seq, l, &(kvp_kv){k, v, NULL}));
  }
  ck_ok(kvp_step_end(p, seq));
}

typedef struct scene {
  kvp_pool *p;
  uint64_t seqs[MAXSEQ];
  uint32_t n;
  int shared; /* some sequence holds shared prefix chunks */
} scene;

static void add(scene *sc, uint64_t id, const kvp_seq_config *cfg) {
  ck_ok(kvp_seq_add(sc->p, id, cfg));
  sc->seqs[sc->n++] = id;
}

/* The mix of sequences every case builds. */
static scene build(const char *codecs, kvp_dtype dt, int dry) {
  scene sc = {mkpool(codecs, dt, dry), {0}, 0, 0};
  kvp_pool *p = sc.p;
  kvp_seq_config stepm;
  kvp_seq_config_init(&stepm);
  stepm.mode = KVP_SEQ_STEP;
  add(&sc, 1, NULL); /* 1 token: an OPEN block of one */
  step(p, 1, 1, dt, dry);
  add(&sc, 2, NULL); /* a block edge */
  step(p, 2, BT, dt, dry);
  add(&sc, 3, NULL); /* one past it */
  step(p, 3, BT + 1, dt, dry);
  add(&sc, 4, NULL); /* prefill, then decode steps */
  step(p, 4, 37, dt, dry);
  for (int i = 0; i < 9; i++) step(p, 4, 1, dt, dry);
  add(&sc, 5, &stepm); /* step mode: blocks end with their step */
  step(p, 5, 7, dt, dry);
  step(p, 5, BT, dt, dry);
  step(p, 5, 33, dt, dry);
  step(p, 5, 1, dt, dry);
  add(&sc, 6, NULL); /* steps of 10 tokens, some evicted per head: ranges inside blocks */
  for (int i = 0; i < 10; i++) step(p, 6, 10, dt, dry);
  for (uint32_t l = 0; l < L; l++)
    for (uint32_t h = 0; h < H; h++)
      for (uint32_t s = 0; s < 10; s++)
        if (h == 2 || (s * 7 + h * 3 + l) % 4 == 0) ck_ok(kvp_evict(p, 6, l, h, s)); /* head 2: nothing left */
  ck_ok(kvp_seq_fork(p, 4, 7)); /* shares 4's sealed blocks, copies its OPEN ones */
  sc.seqs[sc.n++] = 7;
  step(p, 7, 3, dt, dry);
  /* three sequences appended in turn, as an engine's decode steps: a stream's
   * brefs and blocks lie apart in memory (the table collects them first) */
  add(&sc, 11, NULL);
  add(&sc, 12, &stepm);
  add(&sc, 13, NULL);
  for (uint32_t i = 0; i < 24; i++)
    for (uint64_t id = 11; id <= 13; id++) step(p, id, id == 13 && i % 3 ? 5 : BT, dt, dry);
  for (uint32_t h = 0; h < H; h += 2) ck_ok(kvp_evict(p, 12, 0, h, 3 + h));
  int close = 0, apart = 0; /* both of attend_table.c's walks (its sequence_is_close) */
  kvp__rcu_read_lock();
  for (uint32_t i = 0; i < sc.n; i++) {
    const kvp__bref *r = kvp__seq_find(p, sc.seqs[i])->streams[0].blocks, *nx;
    int n = 0, near = 0;
    for (; r && n < 16 && (nx = r->next); r = nx, n++) near += (uintptr_t)nx - (uintptr_t)r <= 512;
    close += 2 * near >= n, apart += 2 * near < n;
  }
  kvp__rcu_read_unlock();
  ck_assert_msg(close && apart, "%s: %d sequences with their brefs close, %d apart", codecs, close, apart);
  if (!dry) { /* shared prefix chunks: 9 and 10 attach 8's first three */
    uint32_t tok[80];
    for (uint32_t i = 0; i < 80; i++) tok[i] = 1000 + i;
    kvp_seq_config pc;
    kvp_seq_config_init(&pc);
    pc.tokens = tok, pc.n_tokens = 64;
    add(&sc, 8, &pc);
    step(p, 8, 64, dt, dry);
    step(p, 8, 5, dt, dry);
    pc.n_tokens = 49; /* 48 of them shared */
    add(&sc, 9, &pc);
    kvp_seq_desc info = {.struct_size = sizeof info};
    ck_ok(kvp_seq_info(p, 9, &info));
    step(p, 9, 69 - info.n_positions, dt, dry); /* 48 attached: 21 */
    add(&sc, 10, &pc);
    ck_ok(kvp_seq_info(p, 10, &info));
    step(p, 10, 49 - info.n_positions + 3, dt, dry);
    ck_ok(kvp_evict(p, 10, 1, 3, 0)); /* over the attached chunks: detached, then evicted */
    kvp__rcu_read_lock();
    for (uint64_t id = 8; id <= 10; id++) sc.shared |= kvp__rcu_deref(kvp__seq_find(p, id)->holds) != NULL;
    kvp__rcu_read_unlock();
  }
  ck_pool(p);
  return sc;
}

/* New and reference tables of (batch, layer) agree for every split plan. */
static void compare(kvp_pool *p, const uint64_t *seqs, uint32_t batch, uint32_t layer, const char *what) {
  static const uint32_t slots[] = {1, 5, 64, 1000000}, split[] = {0, 1, 7, 16, 40, 1000};
  kvp__kparams kp[4];
  ck_ok(kvp__attend_bindings(p, layer, kp));
  uint32_t kind = kvp__kern_attend_kind(kp);
  for (unsigned si = 0; si < sizeof slots / sizeof *slots; si++)
    for (unsigned pi = 0; pi < sizeof split / sizeof *split; pi++)
      for (int mode = 0; mode < 3; mode++) { /* grown from nothing, from 16 bytes, a large fixed buffer */
        kvp__atable t = {.layer = layer, .seqs = seqs, .batch = batch, .kind = kind, .split_tokens = split[pi],
                         .slots = slots[si]};
        kvp__abuf buf = {NULL, 0, grow_heap, NULL};
        if (mode == 1) ck_ok(grow_heap(&buf, 0, 16));
        if (mode == 2) buf.grow = NULL, buf.p = aligned_alloc(64, 1 << 20), buf.cap_bytes = 1 << 20;
        ref_table r;
        kvp__rcu_read_lock();
        ck_ok(kvp__attend_build(p, &t, &buf));
        ck_ok(ref_build(p, &t, &r));
        kvp__rcu_read_unlock();
        ck_assert_msg(t.nrec == r.nrec && t.nsplit == r.nsplit && t.nslot == r.nslot && t.off_splits == r.off_splits &&
                          t.off_bh == r.off_bh && t.table_bytes == r.table_bytes && t.token_heads == r.token_heads,
                      "%s layer %u slots %u split %u: %u records %u splits %u slots, the reference %u %u %u", what, layer,
                      slots[si], split[pi], t.nrec, t.nsplit, t.nslot, r.nrec, r.nsplit, r.nslot);
        /* bytes read: the same sum, up to its rounding */
        ck_assert_msg(t.bytes_read + 1 >= r.bytes_read && t.bytes_read <= r.bytes_read + 1, "%s: bytes read %llu, %llu",
                      what, (unsigned long long)t.bytes_read, (unsigned long long)r.bytes_read);
        ck_assert_uint_le(t.table_bytes, buf.cap_bytes);
        for (uint64_t i = 0; i < t.table_bytes; i++)
          if (buf.p[i] != r.bytes[i])
            ck_abort_msg("%s layer %u slots %u split %u kind %u: table byte %llu of %llu is %u, the reference's %u (%s)",
                         what, layer, slots[si], split[pi], kind, (unsigned long long)i,
                         (unsigned long long)t.table_bytes, buf.p[i], r.bytes[i],
                         i < t.off_splits ? "records" : i < t.off_bh ? "splits" : "split index");
        free(buf.p);
        free(r.bytes);
      }
}

static const struct tcase_spec {
  const char *codecs;
  kvp_dtype dt;
  uint32_t rec_bytes; /* the form the layer's kernel reads */
} cases[] = {
    {"kv=bf16", KVP_DTYPE_BF16, sizeof(kvp__arec_raw)},
    {"kv=fp8", KVP_DTYPE_BF16, sizeof(kvp__arec_q)},
    {"kv=int8", KVP_DTYPE_BF16, sizeof(kvp__arec_q)},
    {"kv=nvfp4", KVP_DTYPE_BF16, sizeof(kvp__arec_q)},
    {"kv=kivi:bits=2:group=16", KVP_DTYPE_BF16, sizeof(kvp__arec_q)},
    {"kv=fp16", KVP_DTYPE_F16, sizeof(kvp__gjob)},      /* raw, not bf16: the generic record */
    {"k=fp8,v=int8", KVP_DTYPE_BF16, sizeof(kvp__gjob)}, /* mixed codecs: the generic record */
    {"kv=bf16;layers=1:k=fp8", KVP_DTYPE_BF16, 0},       /* per layer: 0 one form, 1 the generic one */
};
enum { NCASES = sizeof cases / sizeof *cases };

START_TEST(table_as_before) {
  const struct tcase_spec *cs = &cases[_i % NCASES];
  int dry = _i >= NCASES;
  scene sc = build(cs->codecs, cs->dt, dry);
  if (!dry) ck_assert_msg(sc.shared, "%s: no sequence holds shared chunks (the prefix walk is not tried)", cs->codecs);
  if (cs->rec_bytes) {
    kvp__kparams kp[4];
    ck_ok(kvp__attend_bindings(sc.p, 0, kp));
    ck_assert_uint_eq(kvp__kern_attend_rec_bytes(kvp__kern_attend_kind(kp)), cs->rec_bytes);
  }
  uint64_t rev[MAXSEQ], dup[3] = {sc.seqs[3], sc.seqs[0], sc.seqs[3]};
  for (uint32_t i = 0; i < sc.n; i++) rev[i] = sc.seqs[sc.n - 1 - i];
  for (uint32_t l = 0; l < L; l++) {
    compare(sc.p, sc.seqs, sc.n, l, cs->codecs);
    compare(sc.p, rev, sc.n, l, cs->codecs);
    compare(sc.p, dup, 3, l, cs->codecs);
    for (uint32_t i = 0; i < sc.n; i++) compare(sc.p, &sc.seqs[i], 1, l, cs->codecs);
  }
  kvp_pool_destroy(sc.p);
}
END_TEST

/* ---- kept tables ------------------------------------------------------------- */

/* The kept table of (batch, layer) equals a fresh build, field by field and
 * byte by byte (a kept table's records are copied out end to end, as a
 * fresh build lays them); returns whether it was served kept. */
static int kept_equal(kvp_pool *p, const uint64_t *seqs, uint32_t batch, uint32_t layer, uint32_t slots,
                      const char *what) {
  kvp__kparams kp[4];
  ck_ok(kvp__attend_bindings(p, layer, kp));
  kvp__atable a = {.layer = layer, .seqs = seqs, .batch = batch, .kind = kvp__kern_attend_kind(kp), .slots = slots},
              b = a;
  kvp__abuf ba = {NULL, 0, grow_heap, NULL}, bb = {NULL, 0, grow_heap, NULL};
  bool hit;
  kvp__rcu_read_lock();
  ck_ok(kvp__attend_build_kept(p, &a, &ba, &hit));
  ck_ok(kvp__attend_build(p, &b, &bb));
  kvp__rcu_read_unlock();
  ck_assert_msg(a.nrec == b.nrec && a.nsplit == b.nsplit && a.nslot == b.nslot && a.table_bytes == b.table_bytes &&
                    a.token_heads == b.token_heads,
                "%s layer %u (%s): %u records %u splits %u tokens, fresh %u %u %u", what, layer, hit ? "kept" : "built",
                a.nrec, a.nsplit, (unsigned)a.token_heads, b.nrec, b.nsplit, (unsigned)b.token_heads);
  ck_assert_msg(a.bytes_read + 2 >= b.bytes_read && a.bytes_read <= b.bytes_read + 2, "%s: bytes read %llu, fresh %llu",
                what, (unsigned long long)a.bytes_read, (unsigned long long)b.bytes_read);
  if (a.table_bytes && memcmp(ba.p, bb.p, a.table_bytes))
    ck_abort_msg("%s layer %u (%s): the table differs from a fresh build", what, layer, hit ? "kept" : "built");
  free(ba.p);
  free(bb.p);
  return hit;
}

/* Every change of structure the writer makes between two calls for the
 * same batch (new blocks, reseals, evictions by call and by policy, forks,
 * frees, step-mode steps) is seen by the kept table; decode tokens into
 * OPEN blocks are served kept. */
START_TEST(kept_table_follows_the_writer) {
  const struct tcase_spec *cs = &cases[_i];
  kvp_pool *p = mkpool(cs->codecs, cs->dt, 1);
  kvp_seq_config stepm, win;
  kvp_seq_config_init(&stepm);
  stepm.mode = KVP_SEQ_STEP;
  kvp_seq_config_init(&win);
  win.policy = "window:sink=2:recent=24";
  uint64_t ids[6] = {1, 2, 3, 4, 5, 6}, rng = 11 + (uint64_t)_i;
  ck_ok(kvp_seq_add(p, 1, NULL));
  ck_ok(kvp_seq_add(p, 2, NULL));
  ck_ok(kvp_seq_add(p, 3, &win));
  ck_ok(kvp_seq_add(p, 4, &stepm));
  ck_ok(kvp_seq_add(p, 5, NULL));
  ck_ok(kvp_seq_add(p, 6, NULL));
  for (uint64_t id = 1; id <= 6; id++) step(p, id, 1 + (uint32_t)(id * 5 % 23), cs->dt, 1);
  /* layer 0: the whole batch (a window policy that evicts at every step,
   * a step-mode sequence); layer 1: the stream-mode sequences without a
   * policy, whose decode tokens fill OPEN blocks */
  uint32_t hits = 0, decode_checks = 0, next_id = 7;
  const int plain[4] = {0, 1, 4, 5};
  for (int it = 0; it < 240; it++) {
    uint32_t what = (uint32_t)(t_rand(&rng) % 16), pick = (uint32_t)(t_rand(&rng) % 6);
    int decode = 0;
    if (what < 10) { /* a decode token of each plain sequence */
      for (int i = 0; i < 4; i++) step(p, ids[plain[i]], 1, cs->dt, 1);
      decode = 1;
    } else if (what == 10) {
      step(p, ids[pick], 1 + (uint32_t)(t_rand(&rng) % 40), cs->dt, 1);
    } else if (what == 11 || what == 12) {
      kvp_seq_desc info = {.struct_size = sizeof info};
      ck_ok(kvp_seq_info(p, ids[pick], &info));
      int rc = kvp_evict(p, ids[pick], (uint32_t)(t_rand(&rng) % L), (uint32_t)(t_rand(&rng) % H),
                         (uint32_t)(t_rand(&rng) % info.n_steps));
      ck_assert(rc == KVP_OK || rc == KVP_ENOENT);
    } else if (what == 13) { /* a fork takes the place of its parent in the batch */
      ck_ok(kvp_seq_fork(p, ids[pick], next_id));
      ids[pick] = next_id++;
    } else if (what == 14) { /* freed, and a new sequence of the same id */
      ck_ok(kvp_seq_free(p, ids[pick]));
      ck_ok(kvp_seq_add(p, ids[pick], pick == 3 ? &stepm : pick == 2 ? &win : NULL));
      step(p, ids[pick], 1 + (uint32_t)(t_rand(&rng) % 20), cs->dt, 1);
    } else {
      ck_ok(kvp_reclaim(p));
    }
    uint64_t sub[4];
    for (int i = 0; i < 4; i++) sub[i] = ids[plain[i]];
    kept_equal(p, ids, 6, 0, 1 + (uint32_t)(it % 3) * 40, cs->codecs);
    int hit = kept_equal(p, sub, 4, 1, 1 + (uint32_t)(it % 3) * 40, cs->codecs);
    hits += hit && decode, decode_checks += decode;
    /* the same call again: nothing changed, so kept where a table is kept */
    hit = kept_equal(p, sub, 4, 1, 7, cs->codecs);
    kvp__kparams kp[4];
    ck_ok(kvp__attend_bindings(p, 1, kp));
    if (kvp__kern_attend_rec_bytes(kvp__kern_attend_kind(kp)) != sizeof(kvp__gjob))
      ck_assert_msg(hit, "%s: a second call with no change between was not served kept", cs->codecs);
  }
  /* a kept table and the window policy's steps */
  for (int i = 0; i < 20; i++) {
    step(p, ids[2], 1, cs->dt, 1);
    kept_equal(p, &ids[2], 1, 0, 5, cs->codecs);
  }
  kvp__kparams kp1[4];
  ck_ok(kvp__attend_bindings(p, 1, kp1));
  if (kvp__kern_attend_rec_bytes(kvp__kern_attend_kind(kp1)) != sizeof(kvp__gjob))
    ck_assert_msg(hits > decode_checks / 3, "%s: %u of %u calls after decode tokens served kept", cs->codecs, hits,
                  decode_checks);
  uint64_t before = atomic_load(&p->acache_bytes);
  ck_assert(cs->rec_bytes == sizeof(kvp__gjob) ? before == 0 : before > 0);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* Which layers' tables are kept (the generic record's are not). */
static void kept_layers(kvp_pool *p, bool kept[L]) {
  for (uint32_t l = 0; l < L; l++) {
    kvp__kparams kp[4];
    ck_ok(kvp__attend_bindings(p, l, kp));
    kept[l] = kvp__kern_attend_rec_bytes(kvp__kern_attend_kind(kp)) != sizeof(kvp__gjob);
  }
}

/* A batch of sequences of staggered lengths decoding together, each past
 * a block's end at another step, now and then one taking a chunk of many
 * blocks: the kept table redoes the ends of those whose layer's tail
 * generation moved and is served kept at every call but the first of each
 * layer and those where a bh ran out of the room left after its records
 * (a fresh build lays it out again). */
START_TEST(kept_table_staggered_decode) {
  const struct tcase_spec *cs = &cases[_i];
  kvp_pool *p = mkpool(cs->codecs, cs->dt, 1);
  enum { N = 12, STEPS = 160 };
  uint64_t ids[N];
  for (uint32_t i = 0; i < N; i++) {
    ids[i] = 100 + i;
    ck_ok(kvp_seq_add(p, ids[i], NULL));
    step(p, ids[i], 1 + i * 13 % 70, cs->dt, 1);
  }
  uint32_t hits = 0, calls = 0;
  bool kept[L];
  kept_layers(p, kept);
  for (uint32_t st = 0; st < STEPS; st++) {
    for (uint32_t i = 0; i < N; i++) step(p, ids[i], st % 10 == 9 && i == st / 10 % N ? 37 : 1, cs->dt, 1);
    for (uint32_t l = 0; l < L; l++) {
      int hit = kept_equal(p, ids, N, l, 5 + st % 3 * 40, cs->codecs);
      hits += kept[l] && hit, calls += kept[l];
    }
  }
  ck_assert_msg(hits + 4 * L >= calls, "%s: %u of %u calls served kept", cs->codecs, hits, calls);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* Continuous batching: a batch that decodes while sequences leave (freed)
 * and join (added and prefilled, their ids new or reused), the batch's
 * order changing with them, now and then a sequence twice, and sequences
 * outside the batch added, forked and freed: the kept table takes the
 * sequences it holds where they stay the same, walks the others, and is
 * served kept at most calls. */
START_TEST(kept_table_batch_changes) {
  const struct tcase_spec *cs = &cases[_i];
  kvp_pool *p = mkpool(cs->codecs, cs->dt, 1);
  enum { N = 10, STEPS = 150 };
  uint64_t ids[N + 1], next = 500, rng = 3 + (uint64_t)_i;
  for (uint32_t i = 0; i < N; i++) {
    ck_ok(kvp_seq_add(p, ids[i] = next++, NULL));
    step(p, ids[i], 1 + (uint32_t)(t_rand(&rng) % 90), cs->dt, 1);
  }
  bool kept[L];
  kept_layers(p, kept);
  uint32_t hits = 0, calls = 0, changes = 0;
  for (uint32_t st = 0; st < STEPS; st++) {
    uint32_t what = (uint32_t)(t_rand(&rng) % 8), i = (uint32_t)(t_rand(&rng) % N), n = N;
    if (what == 0) { /* one leaves, a new one joins at the end */
      ck_ok(kvp_seq_free(p, ids[i]));
      memmove(&ids[i], &ids[i + 1], (N - 1 - i) * sizeof *ids);
      ck_ok(kvp_seq_add(p, ids[N - 1] = next++, NULL));
      step(p, ids[N - 1], 1 + (uint32_t)(t_rand(&rng) % 60), cs->dt, 1);
      changes++;
    } else if (what == 1) { /* freed and added again under its id: another sequence */
      ck_ok(kvp_seq_free(p, ids[i]));
      ck_ok(kvp_seq_add(p, ids[i], NULL));
      step(p, ids[i], 1 + (uint32_t)(t_rand(&rng) % 60), cs->dt, 1);
      changes++;
    } else if (what == 2) { /* two swap places */
      uint32_t j = (uint32_t)(t_rand(&rng) % N);
      uint64_t x = ids[i];
      ids[i] = ids[j], ids[j] = x;
      changes++;
    } else if (what == 3) { /* outside the batch: a sequence added, forked, freed */
      ck_ok(kvp_seq_add(p, 9000 + st, NULL));
      step(p, 9000 + st, 20, cs->dt, 1);
      ck_ok(kvp_seq_fork(p, 9000 + st, 19000 + st));
      ck_ok(kvp_seq_free(p, 9000 + st));
      ck_ok(kvp_seq_fork(p, ids[i], 29000 + st)); /* a fork of one in the batch */
      ck_ok(kvp_seq_free(p, 29000 + st));
    } else if (what == 4) { /* a sequence twice in the batch */
      ids[N] = ids[i], n = N + 1;
    }
    for (uint32_t b = 0; b < N; b++) step(p, ids[b], 1, cs->dt, 1);
    for (uint32_t l = 0; l < L; l++) {
      int hit = kept_equal(p, ids, n, l, 3 + st % 3 * 40, cs->codecs);
      hits += kept[l] && hit, calls += kept[l];
    }
  }
  /* a batch changes at about a third of the steps; a change that only walks its new sequences is kept */
  ck_assert_msg(hits + 4 * L >= calls, "%s: %u of %u calls served kept (%u batch changes)", cs->codecs, hits, calls,
                changes);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

/* Independent of the reference: each bh's records hold the tokens its
 * stream retains, in position order, within their blocks; the splits cover
 * the records in order, end to end, the slots as the kernels expect. */
static void check_invariants(kvp_pool *p, const kvp__atable *t, const unsigned char *tab, int quiescent) {
  uint32_t rb = kvp__kern_attend_rec_bytes(t->kind), nbh = t->batch * H;
  const kvp__asplit *sp = (const kvp__asplit *)(tab + t->off_splits);
  const uint32_t *bh0 = (const uint32_t *)(tab + t->off_bh);
  ck_assert_uint_eq(bh0[0], 0);
  ck_assert_uint_eq(bh0[nbh], t->nsplit);
  uint32_t rec = 0, slot = 0;
  uint64_t all = 0;
  for (uint32_t bh = 0; bh < nbh; bh++) {
    ck_assert_uint_lt(bh0[bh], bh0[bh + 1]);
    uint64_t tok = 0;
    for (uint32_t s = bh0[bh]; s < bh0[bh + 1]; s++) {
      ck_assert_uint_eq(sp[s].bh, bh);
      ck_assert_uint_eq(sp[s].rec0, rec);
      ck_assert(sp[s].nrec > 0 || bh0[bh + 1] - bh0[bh] == 1);
      if (bh0[bh + 1] - bh0[bh] == 1) ck_assert_uint_eq(sp[s].slot, KVP__ASPLIT_ONLY);
      else ck_assert_uint_eq(sp[s].slot, slot++);
      for (uint32_t r = rec; r < rec + sp[s].nrec; r++) {
        uint16_t t0, m1, cap1 = 0;
        size_t at = rb == sizeof(kvp__arec_raw) ? offsetof(kvp__arec_raw, t0)
                    : rb == sizeof(kvp__arec_q) ? offsetof(kvp__arec_q, t0)
                                                : offsetof(kvp__gjob, t0);
        memcpy(&t0, tab + (size_t)r * rb + at, 2);
        memcpy(&m1, tab + (size_t)r * rb + at + 2, 2);
        if (rb == sizeof(kvp__arec_q)) memcpy(&cap1, tab + (size_t)r * rb + offsetof(kvp__arec_q, cap1), 2);
        if (rb == sizeof(kvp__gjob)) memcpy(&cap1, tab + (size_t)r * rb + offsetof(kvp__gjob, cap1), 2);
        if (rb != sizeof(kvp__arec_raw)) ck_assert_uint_le((uint32_t)t0 + m1, cap1);
        tok += m1 + 1u;
      }
      rec += sp[s].nrec;
    }
    if (quiescent) { /* what the stream counts */
      kvp__seq *s = kvp__seq_find(p, t->seqs[bh / H]);
      ck_assert_ptr_nonnull(s);
      uint32_t want = atomic_load(&kvp__seq_stream(p, s, t->layer, bh % H)->retained_tokens);
      ck_assert_uint_eq(tok, want);
    }
    all += tok;
  }
  ck_assert_uint_eq(rec, t->nrec);
  ck_assert_uint_eq(slot, t->nslot);
  ck_assert_uint_eq(all, t->token_heads);
  for (uint64_t i = (uint64_t)t->nrec * rb; i < t->off_splits; i++) ck_assert_uint_eq(tab[i], 0);
}

START_TEST(table_invariants) {
  scene sc = build(cases[_i].codecs, cases[_i].dt, 0);
  kvp__kparams kp[4];
  for (uint32_t l = 0; l < L; l++) {
    ck_ok(kvp__attend_bindings(sc.p, l, kp));
    for (uint32_t split = 0; split < 50; split += 7) {
      kvp__atable t = {.layer = l, .seqs = sc.seqs, .batch = sc.n, .kind = kvp__kern_attend_kind(kp),
                       .split_tokens = split, .slots = 3};
      kvp__abuf buf = {NULL, 0, grow_heap, NULL};
      kvp__rcu_read_lock();
      ck_ok(kvp__attend_build(sc.p, &t, &buf));
      check_invariants(sc.p, &t, buf.p, 1);
      kvp__rcu_read_unlock();
      free(buf.p);
    }
  }
  kvp_pool_destroy(sc.p);
}
END_TEST

START_TEST(refusals) {
  scene sc = build("kv=fp8", KVP_DTYPE_BF16, 1);
  kvp_pool *p = sc.p;
  kvp__kparams kp[4];
  ck_ok(kvp__attend_bindings(p, 0, kp));
  uint64_t ids[3] = {1, 999, 2};
  kvp__atable t = {.layer = 0, .seqs = ids, .batch = 3, .kind = kvp__kern_attend_kind(kp), .slots = 8};
  kvp__abuf buf = {NULL, 0, grow_heap, NULL};
  kvp__rcu_read_lock();
  ck_status(kvp__attend_build(p, &t, &buf), KVP_ENOENT);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "seqs[1]: sequence 999"));
  t.layer = L;
  ck_status(kvp__attend_build(p, &t, &buf), KVP_EINVAL);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "layer 2"));
  t.layer = 0, ids[1] = 3;
  unsigned char small[64] __attribute__((aligned(16)));
  kvp__abuf fixed = {small, sizeof small, NULL, NULL}; /* cannot grow */
  ck_status(kvp__attend_build(p, &t, &fixed), KVP_ENOMEM);
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "attention block table"));
  ck_ok(kvp__attend_build(p, &t, &buf)); /* nothing was changed: it builds */
  check_invariants(p, &t, buf.p, 1);
  kvp__rcu_read_unlock();
  free(buf.p);
  /* the device path refuses a dry pool (no device) */
  kvp_attend_req a;
  kvp_attend_req_init(&a);
  a.seqs = ids, a.batch = 1, a.n_q_heads = H;
  ck_status(kvp_attend_decode(p, &a), KVP_ENOTSUP);
  kvp_pool_destroy(p);
  /* a host region's pages are 8-byte aligned: no table */
  kvp_config c;
  kvp_config_init(&c);
  c.n_layers = 1, c.n_kv_heads = H, c.head_dim = D, c.region_bytes = 16ull << 20;
  ck_ok(kvp_pool_create(&c, &p));
  ck_ok(kvp_seq_add(p, 1, NULL));
  t.batch = 1, t.seqs = ids;
  kvp__rcu_read_lock();
  ck_status(kvp__attend_build(p, &t, &buf), KVP_ENOTSUP);
  kvp__rcu_read_unlock();
  ck_assert_ptr_nonnull(strstr(kvp_last_error(), "64-byte"));
  kvp_pool_destroy(p);
}
END_TEST

/* A reader builds tables while the writer appends, evicts, forks and frees
 * (RCU: every table is consistent in itself). */
typedef struct race {
  kvp_pool *p;
  _Atomic int stop;
  _Atomic uint64_t tables;
} race;

static void *reader(void *arg) {
  race *r = arg;
  kvp__kparams kp[4];
  ck_ok(kvp__attend_bindings(r->p, 0, kp));
  uint64_t ids[4] = {1, 2, 3, 4}, rng = 5;
  kvp__abuf buf = {NULL, 0, grow_heap, NULL};
  while (!atomic_load(&r->stop)) {
    if (t_rand(&rng) % 4 == 0) { /* another order, or fewer: the kept table takes the batch's sequences as they come */
      uint32_t i = (uint32_t)(t_rand(&rng) % 4), j = (uint32_t)(t_rand(&rng) % 4);
      uint64_t x = ids[i];
      ids[i] = ids[j], ids[j] = x;
    }
    uint32_t n = t_rand(&rng) % 8 == 0 ? 3 : 4;
    kvp__atable t = {.layer = 0, .seqs = ids, .batch = n, .kind = kvp__kern_attend_kind(kp), .slots = 7};
    bool hit;
    kvp__rcu_read_lock();
    int rc = r->tables % 2 ? kvp__attend_build_kept(r->p, &t, &buf, &hit) : kvp__attend_build(r->p, &t, &buf);
    ck_assert(rc == KVP_OK || rc == KVP_ENOENT); /* a sequence between its free and its add again */
    if (!rc) check_invariants(r->p, &t, buf.p, 0), atomic_fetch_add(&r->tables, 1);
    kvp__rcu_read_unlock();
  }
  free(buf.p);
  return NULL;
}

START_TEST(table_under_writer) {
  kvp_pool *p = mkpool("kv=fp8", KVP_DTYPE_BF16, 1);
  for (uint64_t id = 1; id <= 4; id++) ck_ok(kvp_seq_add(p, id, NULL));
  race r = {p, 0, 0};
  pthread_t th;
  ck_assert_int_eq(pthread_create(&th, NULL, reader, &r), 0);
  uint64_t rng = 7;
  /* the reader has run once; then the writer goes on past its 400
   * operations until the reader built a table beside them (a loaded host
   * may not schedule it sooner), at most 20,000 */
  while (!atomic_load(&r.tables)) sched_yield();
  uint64_t first = atomic_load(&r.tables);
  int i = 0;
  for (; i < 400 || (atomic_load(&r.tables) == first && i < 20000); i++) {
    uint64_t id = 1 + t_rand(&rng) % 4;
    uint32_t what = (uint32_t)(t_rand(&rng) % 10);
    if (what < 6) {
      step(p, id, 1 + (uint32_t)(t_rand(&rng) % 40), KVP_DTYPE_BF16, 1);
    } else if (what < 9) {
      kvp_seq_desc info = {.struct_size = sizeof info};
      ck_ok(kvp_seq_info(p, id, &info));
      if (info.n_steps) {
        int rc = kvp_evict(p, id, 0, (uint32_t)(t_rand(&rng) % H), (uint32_t)(t_rand(&rng) % info.n_steps));
        ck_assert(rc == KVP_OK || rc == KVP_ENOENT);
      }
    } else {
      ck_ok(kvp_seq_free(p, id));
      ck_ok(kvp_seq_add(p, id, NULL));
    }
  }
  atomic_store(&r.stop, 1);
  pthread_join(th, NULL);
  ck_assert_msg(atomic_load(&r.tables) > first, "no table was built beside %d writer operations", i);
  ck_pool(p);
  kvp_pool_destroy(p);
}
END_TEST

static Suite *suite(void) {
  Suite *s = suite_create("attend");
  TCase *tc = tcase_create("as_before");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, table_as_before, 0, 2 * NCASES);
  suite_add_tcase(s, tc);
  tc = tcase_create("invariants");
  tcase_set_timeout(tc, 60);
  tcase_add_loop_test(tc, table_invariants, 0, NCASES);
  tcase_add_test(tc, refusals);
  suite_add_tcase(s, tc);
  tc = tcase_create("kept");
  tcase_set_timeout(tc, 120);
  tcase_add_loop_test(tc, kept_table_follows_the_writer, 0, NCASES);
  tcase_add_loop_test(tc, kept_table_staggered_decode, 0, NCASES);
  tcase_add_loop_test(tc, kept_table_batch_changes, 0, NCASES);
  suite_add_tcase(s, tc);
  tc = tcase_create("concurrency");
  tcase_set_timeout(tc, 60);
  tcase_add_test(tc, table_under_writer);
  suite_add_tcase(s, tc);
  return s;
}

int main(void) { return t_run(suite()); }

#else

int main(void) {
  puts("check_attend: skip: built without CUDA (the table is the CUDA kernels')");
  return 0;
}

#endif
