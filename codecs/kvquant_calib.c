/*
 * codecs/kvquant_calib.c - KVQuant's offline calibration: the synthetic K/V
 * generator, the synthetic fit, and the calibration file (writer in the
 * public kvp_kvquant_calib_* API, reader for the codec). The fitter itself
 * (thresholds, histogram, codebook) is codecs/kvquant_fit.c.
 *
 * Calibration file, version 1 (little-endian; f32 = IEEE binary32):
 *
 *   offset  bytes  field
 *        0      8  magic "KVQCALIB"
 *        8      4  version (1)
 *       12      4  n_layers L
 *       16      4  n_kv_heads H
 *       20      4  head_dim D
 *       24      4  bits b (2, 3 or 4)
 *       28      4  outlier_fraction f (f32) the thresholds were fitted with
 *       32      8  reserved (0)
 *       40         layers: for l in 0..L-1, for side in K, V:
 *                    off[H][D] f32, rng[H][D] f32, lut[2^b] f32
 *      end      4  crc32 (IEEE, zlib's) of every byte before it
 *
 *   size = 40 + L * 2 * (2 H D + 2^b) * 4 + 4
 *
 * kvp_kvquant_calib_synthetic fits the (layer, side) pairs in parallel, one
 * worker per online CPU (or kvp_kvquant_calib_set_threads); a pair is one
 * worker's from start to end, so the histogram's sums are rounded in one
 * order and the file does not depend on the worker count. The generator
 * runs in chunks of SYNTH_CHUNK rows, each taken by the fitter's first
 * pass while it is in cache.
 *
 * A reader checks, in order: magic, version, the size the header implies
 * (truncated or grown), the crc32 (corrupt), the geometry and bits against
 * the pool (mismatched), then the slice it loads (finite; rng > 0 with
 * 1 / rng finite; lut non-decreasing in [-1, 1]). Every failure names the
 * file and the field.
 */
#include "builtin.h"
#include "kernels.h"
#include "kvquant.h"

#include <errno.h>
#include <float.h>
#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#if KVP__HAVE_AVX2
#include <immintrin.h>
#endif

/* ---- the synthetic generator ------------------------------------------------ */

static inline uint64_t mix64(uint64_t z) { /* splitmix64's finalizer */
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

static inline float unit24(uint64_t u) { return (float)(u & 0xFFFFFF) * (1.0f / 16777216.0f); } /* [0, 1) */

/* About N(0, 1): Irwin-Hall of four 16-bit uniforms, rescaled. */
static inline float gauss4(uint64_t u) {
  float s = 0;
  for (int i = 0; i < 4; i++) s += (float)((u >> 16 * i) & 0xFFFF) * (1.0f / 65536.0f);
  return (s - 2.0f) * 1.7320508f;
}

/* One (seed, layer, head, kv) stream's per-channel constants. */
typedef struct synth_gen {
  uint32_t D;                       /* head_dim */
  uint64_t ch[KVP_MAX_HEAD_DIM];    /* the channel's key */
  float bias[KVP_MAX_HEAD_DIM];     /* value = bias + scale z */
  float scale[KVP_MAX_HEAD_DIM];
} synth_gen;

static void gen_init(synth_gen *g, uint64_t seed, uint32_t layer, uint32_t head, uint32_t kv, uint32_t head_dim) {
  uint64_t base = mix64(mix64(mix64(seed) ^ layer) ^ ((uint64_t)head << 1 | kv));
  uint32_t phase = (uint32_t)(base >> 59); /* K's outlier channels: c = phase mod 32 */
  g->D = head_dim;
  for (uint32_t c = 0; c < head_dim; c++) {
    g->ch[c] = mix64(base ^ (0xC0FFEEull << 32 | c));
    g->bias[c] = kv ? 0.1f * gauss4(g->ch[c]) : 0.5f * gauss4(g->ch[c]);
    g->scale[c] = kv ? 0.5f + unit24(g->ch[c] >> 40) : 0.6f + 0.8f * unit24(g->ch[c] >> 40);
    if (!kv && c % 32 == phase) g->scale[c] *= 10.0f; /* an outlier channel */
  }
}

/* Channels [c0, D) of the row of token key tk. */
static void gen_row_base(const synth_gen *g, uint64_t tk, uint32_t c0, float *row) {
  for (uint32_t c = c0; c < g->D; c++) {
    uint64_t r = mix64(g->ch[c] ^ tk);
    float z = gauss4(r);
    uint64_t tail = mix64(r);
    if ((tail & 127) == 0) z *= 2.0f + 3.0f * unit24(tail >> 8); /* heavy tail */
    row[c] = g->bias[c] + g->scale[c] * z;
  }
}

/* The vector generators compute gen_row_base's bits: the four 16-bit
 * uniforms are summed as integers (every partial sum below 2^18 is exact
 * in f32, so the sum is the one the scalar adds make), then scaled, and
 * every rounding operation is the scalar one (no FMA). Two of the scalar
 * steps are exact and folded: s 2^-16 - 2 = (s - 2^17) 2^-16 exactly (18
 * bits), so z = (float)(s - 2^17) (1.7320508 2^-16), one rounding, the
 * scalar's; and 3 (a 2^-24) = (float)a (3 2^-24), likewise (a < 2^24;
 * scaling by a power of two is exact away from subnormals). */
#define GAUSS_K (1.7320508f * 0x1p-16f) /* gauss4's scale, the 2^-16 folded in */
#define TAIL_K (3.0f * 0x1p-24f)        /* the tail's 3, unit24's 2^-24 folded in */
#if KVP__HAVE_AVX2
/* a * c mod 2^64 per 64-bit lane, from 32 x 32 -> 64 products */
__attribute__((target("avx2"))) static inline __m256i mul64c_avx2(__m256i a, uint64_t c) {
  const __m256i cl = _mm256_set1_epi64x((int64_t)(uint32_t)c), ch = _mm256_set1_epi64x((int64_t)(c >> 32));
  __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), cl), _mm256_mul_epu32(a, ch));
  return _mm256_add_epi64(_mm256_mul_epu32(a, cl), _mm256_slli_epi64(cross, 32));
}

__attribute__((target("avx2"))) static inline __m256i mix64_avx2(__m256i z) {
  z = _mm256_add_epi64(z, _mm256_set1_epi64x((int64_t)0x9E3779B97F4A7C15ull));
  z = mul64c_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), 0xBF58476D1CE4E5B9ull);
  z = mul64c_avx2(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94D049BB133111EBull);
  return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

/* the low 32 bits of the 64-bit lanes of a, then of b */
__attribute__((target("avx2"))) static inline __m256i lo32_avx2(__m256i a, __m256i b) {
  __m256 s = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), _MM_SHUFFLE(2, 0, 2, 0));
  return _mm256_castpd_si256(_mm256_permute4x64_pd(_mm256_castps_pd(s), _MM_SHUFFLE(3, 1, 2, 0)));
}

/* the four 16-bit fields' sum, in the low 32 bits of each 64-bit lane */
__attribute__((target("avx2"))) static inline __m256i sum16_avx2(__m256i r) {
  __m256i v = _mm256_add_epi32(_mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(r, 16));
  return _mm256_add_epi64(v, _mm256_srli_epi64(v, 32));
}

/* z, the tail's low 32 bits -> the 8 values */
__attribute__((target("avx2"))) static inline __m256 finish8_avx2(const synth_gen *g, uint32_t c, __m256i sum,
                                                                  __m256i t32) {
  __m256 z = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum, _mm256_set1_epi32(1 << 17))),
                           _mm256_set1_ps(GAUSS_K));
  __m256i hit = _mm256_cmpeq_epi32(_mm256_and_si256(t32, _mm256_set1_epi32(127)), _mm256_setzero_si256());
  __m256 u3 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(t32, 8)), _mm256_set1_ps(TAIL_K));
  __m256 zt = _mm256_mul_ps(z, _mm256_add_ps(_mm256_set1_ps(2.0f), u3));
  z = _mm256_blendv_ps(z, zt, _mm256_castsi256_ps(hit)); /* branch-free: a vector in 16 has a hit */
  return _mm256_add_ps(_mm256_loadu_ps(g->bias + c), _mm256_mul_ps(_mm256_loadu_ps(g->scale + c), z));
}

__attribute__((target("avx2"))) static void gen_rows_avx2(const synth_gen *g, uint32_t pos0, uint32_t n, float *dst,
                                                          size_t stride) {
  const uint32_t Dv = g->D & ~7u;
  for (uint32_t t = 0; t < n; t++) {
    uint64_t tk = (uint64_t)(pos0 + t) * 0x9E3779B97F4A7C15ull;
    __m256i vtk = _mm256_set1_epi64x((int64_t)tk);
    float *row = dst + (size_t)t * stride;
    for (uint32_t c = 0; c < Dv; c += 8) {
      __m256i r0 = mix64_avx2(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(g->ch + c)), vtk));
      __m256i r1 = mix64_avx2(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(g->ch + c + 4)), vtk));
      __m256i t32 = lo32_avx2(mix64_avx2(r0), mix64_avx2(r1));
      _mm256_storeu_ps(row + c, finish8_avx2(g, c, lo32_avx2(sum16_avx2(r0), sum16_avx2(r1)), t32));
    }
    gen_row_base(g, tk, Dv, row);
  }
}

/* AVX-512: 64-bit lanes with native 64-bit multiplies, 16 channels a step
 * (the floats in one vector) */
#define KVP__T512 __attribute__((target("avx2,avx512f,avx512dq,avx512vl")))
KVP__T512 static inline __m512i mix64_avx512(__m512i z) {
  z = _mm512_add_epi64(z, _mm512_set1_epi64((int64_t)0x9E3779B97F4A7C15ull));
  const __m512i m1 = _mm512_set1_epi64((int64_t)0xBF58476D1CE4E5B9ull);
  const __m512i m2 = _mm512_set1_epi64((int64_t)0x94D049BB133111EBull);
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), m1);
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), m2);
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

/* The low 32 bits of the 64-bit lanes of a, then of b (as 16 x 32) */
KVP__T512 static inline __m512i lo32_avx512(__m512i a, __m512i b) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_permutex2var_epi32(a, even, b);
}

/* The four 16-bit fields' sum of each 64-bit lane of a, then of b (as 16
 * x 32): the halves paired first, so each add does 16 lanes */
KVP__T512 static inline __m512i sum16x2_avx512(__m512i a, __m512i b) {
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i ff = _mm512_set1_epi32(0xFFFF);
  __m512i lo = lo32_avx512(a, b), hi = _mm512_permutex2var_epi32(a, odd, b);
  return _mm512_add_epi32(_mm512_add_epi32(_mm512_and_si512(lo, ff), _mm512_srli_epi32(lo, 16)),
                          _mm512_add_epi32(_mm512_and_si512(hi, ff), _mm512_srli_epi32(hi, 16)));
}

/* The four 16-bit fields' sum of each 64-bit lane of r, as 8 x 32 */
KVP__T512 static inline __m256i sum16_avx512(__m512i r) {
  __m512i v = _mm512_add_epi32(_mm512_and_si512(r, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(r, 16));
  return _mm512_cvtepi64_epi32(_mm512_add_epi64(v, _mm512_srli_epi64(v, 32)));
}

/* 16 channels at a time (two vectors of 64-bit lanes, the floats in one) */
KVP__T512 static void gen_rows_avx512(const synth_gen *g, uint32_t pos0, uint32_t n, float *dst, size_t stride) {
  const uint32_t D16 = g->D & ~15u, Dv = g->D & ~7u;
  const __m512 gk = _mm512_set1_ps(GAUSS_K), two = _mm512_set1_ps(2.0f), tk3 = _mm512_set1_ps(TAIL_K);
  for (uint32_t t = 0; t < n; t++) {
    uint64_t tk = (uint64_t)(pos0 + t) * 0x9E3779B97F4A7C15ull;
    __m512i vtk = _mm512_set1_epi64((int64_t)tk);
    float *row = dst + (size_t)t * stride;
    for (uint32_t c = 0; c < D16; c += 16) {
      __m512i r0 = mix64_avx512(_mm512_xor_si512(_mm512_loadu_si512(g->ch + c), vtk));
      __m512i r1 = mix64_avx512(_mm512_xor_si512(_mm512_loadu_si512(g->ch + c + 8), vtk));
      __m512i sum = sum16x2_avx512(r0, r1), t32 = lo32_avx512(mix64_avx512(r0), mix64_avx512(r1));
      __m512 z = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sum, _mm512_set1_epi32(1 << 17))), gk);
      /* the heavy tail, branch-free: one lane in 128 takes it, so a vector
       * of 16 in 8 (a branch on it would be mispredicted that often) */
      __mmask16 hit = _mm512_testn_epi32_mask(t32, _mm512_set1_epi32(127));
      __m512 u3 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(t32, 8)), tk3);
      z = _mm512_mask_mul_ps(z, hit, z, _mm512_add_ps(two, u3));
      z = _mm512_mul_ps(_mm512_loadu_ps(g->scale + c), z);
      _mm512_storeu_ps(row + c, _mm512_add_ps(_mm512_loadu_ps(g->bias + c), z));
    }
    for (uint32_t c = D16; c < Dv; c += 8) {
      __m512i r = mix64_avx512(_mm512_xor_si512(_mm512_loadu_si512(g->ch + c), vtk));
      _mm256_storeu_ps(row + c, finish8_avx2(g, c, sum16_avx512(r), _mm512_cvtepi64_epi32(mix64_avx512(r))));
    }
    gen_row_base(g, tk, Dv, row);
  }
}
#endif

/* Rows pos0 .. pos0 + n - 1, stride floats apart. */
static void gen_rows(const synth_gen *g, uint32_t pos0, uint32_t n, float *dst, size_t stride) {
#if KVP__HAVE_AVX2
  int isa = kvp__codec_isa();
  if (isa >= KVP__ISA_AVX512) {
    gen_rows_avx512(g, pos0, n, dst, stride);
    return;
  }
  if (isa >= KVP__ISA_AVX2) {
    gen_rows_avx2(g, pos0, n, dst, stride);
    return;
  }
#endif
  for (uint32_t t = 0; t < n; t++)
    gen_row_base(g, (uint64_t)(pos0 + t) * 0x9E3779B97F4A7C15ull, 0, dst + (size_t)t * stride);
}

void kvp__kvq_synth(uint64_t seed, uint32_t layer, uint32_t head, uint32_t kv, uint32_t pos0, uint32_t n,
                    uint32_t head_dim, float *dst, size_t dst_stride) {
  synth_gen g;
  gen_init(&g, seed, layer, head, kv, head_dim);
  gen_rows(&g, pos0, n, dst, dst_stride);
}

/* ---- the synthetic fit ------------------------------------------------------- */

#define SYNTH_CHUNK 128u /* rows generated and screened at a time: 64 KiB at D = 128 */

/* A worker's buffers for synth_side. */
typedef struct synth_scratch {
  float *x;                /* [n_seqs seq_tokens][D]: the head's samples */
  float *smp;              /* [ceil(n / KVP__KVQ_SAMPLE_EVERY)][D]: its sample rows, gathered */
  synth_gen *g;            /* the generator's per-channel constants */
} synth_scratch;

static void scratch_free(synth_scratch *sc) {
  free(sc->x);
  free(sc->smp);
  free(sc->g);
}

static int scratch_alloc(synth_scratch *sc, uint64_t n, uint32_t D) {
  sc->x = malloc(n * D * sizeof(float));
  sc->smp = malloc((n + KVP__KVQ_SAMPLE_EVERY - 1) / KVP__KVQ_SAMPLE_EVERY * D * sizeof(float));
  sc->g = malloc(sizeof *sc->g);
  if (sc->x && sc->smp && sc->g) return KVP_OK;
  scratch_free(sc);
  return kvp__err(KVP_ENOMEM, "kvquant calibration: %llu synthetic tokens", (unsigned long long)n);
}

/* Rows p .. p + rows - 1 of a sequence into at (D floats a row), r0 the
 * first one's index among all the head's rows; with a sample (every > 0)
 * its rows, whose index is a multiple of every, are not generated again:
 * copied from smp (gathered, a row each) or, smp NULL, already in place. */
static void gen_chunk(const synth_gen *g, uint32_t p, uint32_t rows, float *at, uint32_t D, uint64_t r0,
                      uint32_t every, const float *smp) {
  for (uint32_t t = 0; t < rows;) {
    uint64_t r = r0 + t, to_sample = every ? (every - r % every) % every : rows; /* rows before the next sample row */
    uint32_t run = to_sample < rows - t ? (uint32_t)to_sample : rows - t;
    gen_rows(g, p + t, run, at + (size_t)t * D, D);
    t += run;
    if (t < rows) { /* a sample row */
      if (smp) memcpy(at + (size_t)t * D, smp + (r0 + t) / every * D, D * sizeof(float));
      t++;
    }
  }
}

/* Every head of side f from n_seqs x seq_tokens synthetic tokens (seeds
 * seed .. seed + n_seqs - 1, positions 0..). The sample rows come first,
 * gathered (or in place, for a sampling stride under the default), then
 * the rows in chunks, each screened while in cache (the sample's rows
 * taken, not generated twice). On failure f is as it was. */
static int synth_side(kvp__kvq_fit *f, uint32_t layer, uint64_t seed, uint32_t n_seqs, uint32_t seq_tokens,
                      synth_scratch *sc) {
  uint32_t D = f->head_dim, n = n_seqs * seq_tokens;
  float *x = sc->x;
  synth_gen *g = sc->g;
  for (uint32_t h = 0; h < f->n_heads; h++) {
    kvp__kvq_head hs;
    int rc = kvp__kvq_head_begin(f, h, n, &hs);
    hs.trusted = 1; /* bias + scale z, |z| < 18: finite */
    if (!rc && hs.every) {
      uint32_t every = hs.every;
      int gather = every >= KVP__KVQ_SAMPLE_EVERY;
      for (uint32_t s = 0; s < n_seqs; s++) {
        uint64_t q = ((uint64_t)s * seq_tokens + every - 1) / every; /* s's first sample row: q every */
        gen_init(g, seed + s, layer, h, f->kv, D);
        for (; q * every < (uint64_t)(s + 1) * seq_tokens; q++)
          gen_rows(g, (uint32_t)(q * every - (uint64_t)s * seq_tokens), 1,
                   gather ? sc->smp + q * D : x + q * every * D, D);
      }
      kvp__kvq_head_sample(&hs, gather ? sc->smp : x, gather ? D : (size_t)every * D);
    }
    for (uint32_t s = 0; !rc && s < n_seqs; s++) {
      gen_init(g, seed + s, layer, h, f->kv, D);
      for (uint32_t p = 0; !rc && p < seq_tokens; p += SYNTH_CHUNK) {
        uint32_t rows = seq_tokens - p < SYNTH_CHUNK ? seq_tokens - p : SYNTH_CHUNK;
        float *at = x + ((size_t)s * seq_tokens + p) * D;
        gen_chunk(g, p, rows, at, D, (uint64_t)s * seq_tokens + p, hs.every,
                  hs.every >= KVP__KVQ_SAMPLE_EVERY ? sc->smp : NULL);
        rc = kvp__kvq_head_rows(&hs, at, NULL, D, rows);
      }
    }
    if (rc) { /* the heads before h are in f: back to none */
      kvp__kvq_fit_reset(f);
      return rc;
    }
    kvp__kvq_head_end(&hs, x, NULL, D);
  }
  return KVP_OK;
}

int kvp__kvq_fit_synthetic(uint64_t seed, uint32_t layer, uint32_t kv, uint32_t n_heads, uint32_t head_dim,
                           uint32_t bits, double fraction, uint32_t calib_tokens, kvp__kvq_side *out) {
  kvp__kvq_fit f;
  int rc = kvp__kvq_fit_init(&f, n_heads, head_dim, bits, kv, fraction);
  if (rc) return rc;
  synth_scratch sc;
  rc = scratch_alloc(&sc, calib_tokens, head_dim);
  if (!rc) {
    rc = synth_side(&f, layer, seed, 1, calib_tokens, &sc);
    scratch_free(&sc);
  }
  float lut[KVP__KVQ_LUT_MAX];
  if (!rc) rc = kvp__kvq_fit_lut(&f, lut);
  if (!rc) {
    *out = (kvp__kvq_side){.n_heads = n_heads, .head_dim = head_dim, .bits = bits, .off = f.off, .rng = f.rng};
    memcpy(out->lut, lut, sizeof lut);
    f.off = f.rng = NULL;
  }
  kvp__kvq_fit_free(&f);
  return rc;
}

/* ---- the file ------------------------------------------------------------------ */

uint32_t kvp__crc32(uint32_t crc, const void *p, size_t n) {
  static uint32_t table[256];
  static _Atomic int ready;
  if (!atomic_load_explicit(&ready, memory_order_acquire)) { /* idempotent: racing writers store equal words */
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int j = 0; j < 8; j++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      __atomic_store_n(&table[i], c, __ATOMIC_RELAXED);
    }
    atomic_store_explicit(&ready, 1, memory_order_release);
  }
  const uint8_t *b = p;
  crc = ~crc;
  for (size_t i = 0; i < n; i++) crc = __atomic_load_n(&table[(crc ^ b[i]) & 0xFF], __ATOMIC_RELAXED) ^ (crc >> 8);
  return ~crc;
}

#define HDR_BYTES 40u

static uint64_t file_bytes(uint64_t L, uint64_t H, uint64_t D, uint32_t bits) {
  return HDR_BYTES + L * 2 * (2 * H * D + (1ull << bits)) * 4 + 4;
}

static int ffail(char *err, size_t errcap, const char *path, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static int ffail(char *err, size_t errcap, const char *path, const char *fmt, ...) {
  int n = snprintf(err, errcap, "kvquant: calibration file \"%s\": ", path);
  va_list ap;
  va_start(ap, fmt);
  if (n >= 0 && (size_t)n < errcap) vsnprintf(err + n, errcap - (size_t)n, fmt, ap);
  va_end(ap);
  return KVP_EFORMAT;
}

static bool hdr_in_range(uint32_t L, uint32_t H, uint32_t D, uint32_t fb) {
  return fb >= 2 && fb <= KVP__KVQ_MAX_BITS && L && H && D && L <= KVP_MAX_LAYERS && H <= KVP_MAX_KV_HEADS &&
         D <= KVP_MAX_HEAD_DIM;
}

/* Bytes worth reading of a file that begins with its header b: one past
 * the size the header implies (so trailing bytes show), or the header and
 * a checksum's worth when the header is bad (the caller reports it). */
static uint64_t read_limit(const uint8_t *b) {
  if (memcmp(b, "KVQCALIB", 8) != 0 || kvp__ld_le32(b + 8) != 1) return HDR_BYTES + 4;
  uint32_t L = kvp__ld_le32(b + 12), H = kvp__ld_le32(b + 16), D = kvp__ld_le32(b + 20), fb = kvp__ld_le32(b + 24);
  return hdr_in_range(L, H, D, fb) ? file_bytes(L, H, D, fb) + 1 : HDR_BYTES + 4;
}

/* The header, then no more than it implies: a file without end (a device,
 * a pipe) or a huge one is not read whole. */
static int read_all(const char *path, uint8_t **buf, size_t *len, char *err, size_t errcap) {
  FILE *fp = fopen(path, "rb");
  if (!fp) return ffail(err, errcap, path, "cannot open: %s", strerror(errno));
  size_t cap = HDR_BYTES, n = 0;
  uint64_t limit = HDR_BYTES;
  uint8_t *b = malloc(cap);
  while (b) {
    n += fread(b + n, 1, cap - n, fp);
    if (n < cap) break;
    if (n == HDR_BYTES) limit = read_limit(b);
    if (n >= limit) break;
    size_t ncap = limit - n > cap ? 2 * cap : (size_t)limit;
    uint8_t *nb = limit > SIZE_MAX / 2 ? NULL : realloc(b, ncap);
    if (!nb) {
      free(b);
      b = NULL;
      break;
    }
    b = nb;
    cap = ncap;
  }
  int bad = ferror(fp);
  fclose(fp);
  if (!b) {
    snprintf(err, errcap, "kvquant: calibration file \"%s\": out of memory", path);
    return KVP_ENOMEM;
  }
  if (bad) {
    free(b);
    return ffail(err, errcap, path, "read error");
  }
  *buf = b;
  *len = n;
  return KVP_OK;
}

static int check_slice(const uint8_t *p, uint32_t H, uint32_t D, uint32_t bits, uint32_t layer, uint32_t kv,
                       const char *path, char *err, size_t errcap) {
  size_t hd = (size_t)H * D;
  const char *side = kv ? "v" : "k";
  for (size_t i = 0; i < hd; i++) {
    float off = kvp__ld_lef32(p + 4 * i), rng = kvp__ld_lef32(p + 4 * (hd + i));
    if (!isfinite(off))
      return ffail(err, errcap, path, "field layers[%u].%s.off[head %zu][channel %zu] is not finite", layer, side,
                   i / D, i % D);
    if (!isfinite(rng) || !(rng > 0))
      return ffail(err, errcap, path, "field layers[%u].%s.rng[head %zu][channel %zu] = %g is not a positive finite "
                   "number", layer, side, i / D, i % D, (double)rng);
    if (!isfinite(1.0f / rng)) /* the codec normalizes by 1 / rng */
      return ffail(err, errcap, path, "field layers[%u].%s.rng[head %zu][channel %zu] = %g is too small: its "
                   "reciprocal overflows f32", layer, side, i / D, i % D, (double)rng);
  }
  float prev = -1.0f;
  for (uint32_t j = 0; j < 1u << bits; j++) {
    float v = kvp__ld_lef32(p + 4 * (2 * hd + j));
    if (!(v >= prev && v <= 1.0f))
      return ffail(err, errcap, path, "field layers[%u].%s.lut[%u] = %g: the codebook must be non-decreasing in "
                   "[-1, 1]", layer, side, j, (double)v);
    prev = v;
  }
  return KVP_OK;
}

int kvp__kvq_load(const char *path, uint32_t layer, uint32_t kv, uint32_t n_layers, uint32_t n_heads,
                  uint32_t head_dim, uint32_t bits, kvp__kvq_side *out, char *err, size_t errcap) {
  uint8_t *b = NULL;
  size_t len = 0;
  int rc = read_all(path, &b, &len, err, errcap);
  if (rc) return rc;
  if (len < HDR_BYTES + 4) {
    rc = ffail(err, errcap, path, "field size: %zu bytes, shorter than the %u-byte header and checksum", len,
               HDR_BYTES + 4);
    goto out;
  }
  if (memcmp(b, "KVQCALIB", 8) != 0) {
    rc = ffail(err, errcap, path, "field magic: not \"KVQCALIB\"");
    goto out;
  }
  uint32_t ver = kvp__ld_le32(b + 8), L = kvp__ld_le32(b + 12), H = kvp__ld_le32(b + 16), D = kvp__ld_le32(b + 20),
           fb = kvp__ld_le32(b + 24);
  if (ver != 1) {
    rc = ffail(err, errcap, path, "field version = %u: this library reads version 1", ver);
    goto out;
  }
  if (!hdr_in_range(L, H, D, fb)) {
    rc = ffail(err, errcap, path, "header fields out of range (n_layers %u, n_kv_heads %u, head_dim %u, bits %u): "
               "corrupt", L, H, D, fb);
    goto out;
  }
  uint64_t want = file_bytes(L, H, D, fb);
  if (len != want) {
    rc = ffail(err, errcap, path, "field size: %s%zu bytes, the header (n_layers %u, n_kv_heads %u, head_dim %u, "
               "bits %u) implies %llu: %s", len > want ? "more than " : "", len > want ? (size_t)want : len, L, H, D, fb,
               (unsigned long long)want, len < want ? "truncated" : "trailing bytes");
    goto out;
  }
  uint32_t crc = kvp__crc32(0, b, len - 4), stored = kvp__ld_le32(b + len - 4);
  if (crc != stored) {
    rc = ffail(err, errcap, path, "field crc32: stored %08x, computed %08x: corrupt", stored, crc);
    goto out;
  }
  const char *field = L != n_layers ? "n_layers" : H != n_heads ? "n_kv_heads" : D != head_dim ? "head_dim"
                      : fb != bits ? "bits" : NULL;
  if (field) {
    uint32_t got = L != n_layers ? L : H != n_heads ? H : D != head_dim ? D : fb;
    uint32_t exp = L != n_layers ? n_layers : H != n_heads ? n_heads : D != head_dim ? head_dim : bits;
    rc = ffail(err, errcap, path, "field %s = %u, the pool%s has %u", field, got,
               fb != bits && !(L != n_layers || H != n_heads || D != head_dim) ? "'s codec spec" : "", exp);
    goto out;
  }
  size_t hd = (size_t)H * D, slice = (2 * hd + (1u << fb)) * 4;
  const uint8_t *p = b + HDR_BYTES + ((size_t)layer * 2 + kv) * slice;
  if ((rc = check_slice(p, H, D, fb, layer, kv, path, err, errcap))) goto out;
  *out = (kvp__kvq_side){.n_heads = H, .head_dim = D, .bits = fb};
  out->off = malloc(hd * sizeof(float));
  out->rng = malloc(hd * sizeof(float));
  if (!out->off || !out->rng) {
    kvp__kvq_side_free(out);
    snprintf(err, errcap, "kvquant: out of memory for the calibration of layer %u", layer);
    rc = KVP_ENOMEM;
    goto out;
  }
  for (size_t i = 0; i < hd; i++) {
    out->off[i] = kvp__ld_lef32(p + 4 * i);
    out->rng[i] = kvp__ld_lef32(p + 4 * (hd + i));
  }
  for (uint32_t j = 0; j < 1u << fb; j++) out->lut[j] = kvp__ld_lef32(p + 4 * (2 * hd + j));
out:
  free(b);
  return rc;
}

/* ---- the public fitter --------------------------------------------------------- */

struct kvp_kvquant_calib {
  uint32_t n_layers, n_heads, head_dim, bits; /* L, H, D, b */
  double fraction;                            /* outlier fraction */
  uint32_t n_threads;                         /* synthetic's workers; 0 = one per online CPU */
  kvp__kvq_fit *fit;                          /* [2 L]: (layer, K|V) at 2 l + kv */
  float (*lut)[KVP__KVQ_LUT_MAX];             /* [2 L]: codebooks synthetic fitted, where lut_ok */
  uint8_t *lut_ok;                            /* [2 L] */
};

KVP_API void kvp_kvquant_calib_destroy(kvp_kvquant_calib *c) {
  if (!c) return;
  for (uint32_t i = 0; c->fit && i < 2 * c->n_layers; i++) kvp__kvq_fit_free(&c->fit[i]);
  free(c->fit);
  free(c->lut);
  free(c->lut_ok);
  free(c);
}

KVP_API int kvp_kvquant_calib_create(uint32_t n_layers, uint32_t n_kv_heads, uint32_t head_dim, uint32_t bits,
                                     double outlier_fraction, kvp_kvquant_calib **out) {
  if (!out) return kvp__err(KVP_EINVAL, "kvquant calibration: out is NULL");
  *out = NULL;
  if (n_layers < 1 || n_layers > KVP_MAX_LAYERS) return kvp__err(KVP_EINVAL, "kvquant calibration: n_layers = %u", n_layers);
  if (n_kv_heads < 1 || n_kv_heads > KVP_MAX_KV_HEADS)
    return kvp__err(KVP_EINVAL, "kvquant calibration: n_kv_heads = %u", n_kv_heads);
  if (head_dim < 1 || head_dim > KVP_MAX_HEAD_DIM) return kvp__err(KVP_EINVAL, "kvquant calibration: head_dim = %u", head_dim);
  if (bits < 2 || bits > 4) return kvp__err(KVP_EINVAL, "kvquant calibration: bits = %u: must be 2, 3 or 4", bits);
  if (!(outlier_fraction >= 0 && outlier_fraction < 0.5))
    return kvp__err(KVP_EINVAL, "kvquant calibration: outlier fraction %g not in [0, 0.5)", outlier_fraction);
  kvp_kvquant_calib *c = calloc(1, sizeof *c);
  if (!c) return kvp__err(KVP_ENOMEM, "kvquant calibration");
  *c = (kvp_kvquant_calib){n_layers, n_kv_heads, head_dim, bits, outlier_fraction, 0, NULL, NULL, NULL};
  c->fit = calloc(2 * (size_t)n_layers, sizeof *c->fit);
  c->lut = calloc(2 * (size_t)n_layers, sizeof *c->lut);
  c->lut_ok = calloc(2 * (size_t)n_layers, 1);
  int rc = c->fit && c->lut && c->lut_ok ? KVP_OK : kvp__err(KVP_ENOMEM, "kvquant calibration");
  for (uint32_t i = 0; !rc && i < 2 * n_layers; i++)
    rc = kvp__kvq_fit_init(&c->fit[i], n_kv_heads, head_dim, bits, i % 2, outlier_fraction);
  if (rc) {
    kvp_kvquant_calib_destroy(c);
    return rc;
  }
  *out = c;
  return KVP_OK;
}

KVP_API int kvp_kvquant_calib_set_threads(kvp_kvquant_calib *c, uint32_t n_threads) {
  if (!c) return kvp__err(KVP_EINVAL, "kvquant calibration is NULL");
  if (n_threads > KVP_KVQUANT_CALIB_MAX_THREADS)
    return kvp__err(KVP_EINVAL, "kvquant calibration: n_threads = %u: at most %u", n_threads,
                    KVP_KVQUANT_CALIB_MAX_THREADS);
  c->n_threads = n_threads;
  return KVP_OK;
}

KVP_API int kvp_kvquant_calib_add(kvp_kvquant_calib *c, uint32_t layer, uint32_t head, uint32_t kv, const float *x,
                                  const float *w, size_t stride, uint32_t n_tokens) {
  if (!c || !x) return kvp__err(KVP_EINVAL, "kvquant calibration: %s is NULL", c ? "x" : "calibration");
  if (layer >= c->n_layers || kv > 1)
    return kvp__err(KVP_EINVAL, "kvquant calibration: layer %u (of %u) side %u", layer, c->n_layers, kv);
  if (stride < c->head_dim) return kvp__err(KVP_EINVAL, "kvquant calibration: stride %zu < head_dim %u", stride, c->head_dim);
  int rc = kvp__kvq_fit_head(&c->fit[2 * layer + kv], head, x, w, stride, n_tokens);
  if (!rc) c->lut_ok[2 * layer + kv] = 0;
  return rc;
}

/* Synthetic fitting, one (layer, side) at a time per worker, its codebook
 * too: each side of a layer is its own kvp__kvq_fit, so workers share
 * nothing but the next index to take. The first failure (lowest index) is
 * the one reported, and then every side goes back to no head fitted (as
 * synthetic found them). */
typedef struct synth_job {
  kvp_kvquant_calib *c;
  uint64_t seed;
  uint32_t n_seqs, seq_tokens;
  _Atomic uint32_t next;   /* next 2 * layer + side to fit */
  pthread_mutex_t lock;    /* guards the failure below */
  uint32_t fail_at;        /* lowest failed index, or UINT32_MAX */
  int fail_rc;             /* its status */
  char fail_msg[256];      /* its message */
} synth_job;

typedef struct synth_worker_ctx {
  synth_job *j;
  synth_scratch sc;        /* its buffers */
} synth_worker_ctx;

static void *synth_worker(void *arg) {
  synth_worker_ctx *w = arg;
  synth_job *j = w->j;
  kvp_kvquant_calib *c = j->c;
  for (uint32_t i; (i = atomic_fetch_add(&j->next, 1)) < 2 * c->n_layers;) {
    int rc = synth_side(&c->fit[i], i / 2, j->seed, j->n_seqs, j->seq_tokens, &w->sc);
    if (!rc) rc = kvp__kvq_fit_lut(&c->fit[i], c->lut[i]);
    if (!rc) {
      c->lut_ok[i] = 1;
      continue;
    }
    pthread_mutex_lock(&j->lock);
    if (i < j->fail_at) {
      j->fail_at = i, j->fail_rc = rc;
      snprintf(j->fail_msg, sizeof j->fail_msg, "layer %u %c: %s", i / 2, "KV"[i % 2], kvp_last_error());
    }
    pthread_mutex_unlock(&j->lock);
    atomic_store(&j->next, 2 * c->n_layers); /* stop handing out work */
  }
  return NULL;
}

static uint32_t synth_threads(const kvp_kvquant_calib *c) {
  long n = c->n_threads;
  if (!n) n = sysconf(_SC_NPROCESSORS_ONLN);
  if (n < 1) n = 1;
  if (n > KVP_KVQUANT_CALIB_MAX_THREADS) n = KVP_KVQUANT_CALIB_MAX_THREADS;
  return (uint32_t)n < 2 * c->n_layers ? (uint32_t)n : 2 * c->n_layers;
}

KVP_API int kvp_kvquant_calib_synthetic(kvp_kvquant_calib *c, uint64_t seed, uint32_t n_seqs, uint32_t seq_tokens) {
  if (!c) return kvp__err(KVP_EINVAL, "kvquant calibration is NULL");
  uint64_t n = (uint64_t)n_seqs * seq_tokens;
  if (n == 0 || n > UINT32_MAX) return kvp__err(KVP_EINVAL, "kvquant calibration: %u x %u synthetic tokens", n_seqs, seq_tokens);
  for (uint32_t i = 0; i < 2 * c->n_layers; i++)
    for (uint32_t h = 0; h < c->n_heads; h++)
      if (c->fit[i].done[h])
        return kvp__err(KVP_EINVAL, "kvquant calibration: layer %u %c head %u already has samples: synthetic fits "
                                    "every head", i / 2, "KV"[i % 2], h);
  /* every worker's buffers first: the caller's must come, the others' may not (fewer workers) */
  uint32_t nt = synth_threads(c);
  synth_job j = {.c = c, .seed = seed, .n_seqs = n_seqs, .seq_tokens = seq_tokens, .fail_at = UINT32_MAX};
  synth_worker_ctx w[KVP_KVQUANT_CALIB_MAX_THREADS];
  uint32_t nw = 0;
  for (; nw < nt; nw++) {
    w[nw].j = &j;
    if (scratch_alloc(&w[nw].sc, n, c->head_dim)) {
      if (nw == 0) return KVP_ENOMEM; /* message set */
      break;
    }
  }
  atomic_init(&j.next, 0);
  pthread_mutex_init(&j.lock, NULL);
  pthread_t tid[KVP_KVQUANT_CALIB_MAX_THREADS];
  uint32_t started = 0; /* workers 1 .. started run on threads; the caller is worker 0 */
  while (started + 1 < nw && !KVP__FAULT() && pthread_create(&tid[started], NULL, synth_worker, &w[started + 1]) == 0)
    started++;
  synth_worker(&w[0]);
  for (uint32_t t = 0; t < started; t++) pthread_join(tid[t], NULL);
  pthread_mutex_destroy(&j.lock);
  for (uint32_t t = 0; t < nw; t++) scratch_free(&w[t].sc);
  if (j.fail_at == UINT32_MAX) return KVP_OK;
  for (uint32_t i = 0; i < 2 * c->n_layers; i++) kvp__kvq_fit_reset(&c->fit[i]), c->lut_ok[i] = 0;
  return kvp__err(j.fail_rc, "%s", j.fail_msg);
}

KVP_API int kvp_kvquant_calib_write(kvp_kvquant_calib *c, const char *path) {
  if (!c || !path) return kvp__err(KVP_EINVAL, "kvquant calibration: %s is NULL", c ? "path" : "calibration");
  size_t hd = (size_t)c->n_heads * c->head_dim, nl = 1u << c->bits;
  uint64_t bytes = file_bytes(c->n_layers, c->n_heads, c->head_dim, c->bits);
  uint8_t *b = calloc(1, bytes);
  if (!b) return kvp__err(KVP_ENOMEM, "kvquant calibration: %llu-byte file image", (unsigned long long)bytes);
  memcpy(b, "KVQCALIB", 8);
  kvp__st_le32(b + 8, 1);
  kvp__st_le32(b + 12, c->n_layers);
  kvp__st_le32(b + 16, c->n_heads);
  kvp__st_le32(b + 20, c->head_dim);
  kvp__st_le32(b + 24, c->bits);
  kvp__st_lef32(b + 28, (float)c->fraction);
  uint8_t *p = b + HDR_BYTES;
  int rc = KVP_OK;
  for (uint32_t i = 0; !rc && i < 2 * c->n_layers; i++) {
    float lut[KVP__KVQ_LUT_MAX];
    if (c->lut_ok[i]) memcpy(lut, c->lut[i], sizeof lut);
    else if ((rc = kvp__kvq_fit_lut(&c->fit[i], lut))) {
      char why[256];
      snprintf(why, sizeof why, "%s", kvp_last_error());
      rc = kvp__err(rc, "layer %u %c: %s", i / 2, "KV"[i % 2], why);
      break;
    }
    for (size_t j = 0; j < hd; j++) kvp__st_lef32(p + 4 * j, c->fit[i].off[j]);
    for (size_t j = 0; j < hd; j++) kvp__st_lef32(p + 4 * (hd + j), c->fit[i].rng[j]);
    for (size_t j = 0; j < nl; j++) kvp__st_lef32(p + 4 * (2 * hd + j), lut[j]);
    p += (2 * hd + nl) * 4;
  }
  if (!rc) {
    kvp__st_le32(p, kvp__crc32(0, b, bytes - 4));
    FILE *fp = fopen(path, "wb");
    if (!fp) rc = kvp__err(KVP_EINVAL, "kvquant calibration: cannot create \"%s\": %s", path, strerror(errno));
    else {
      size_t put = fwrite(b, 1, bytes, fp);
      if (fclose(fp) != 0 || put != bytes) rc = kvp__err(KVP_EINVAL, "kvquant calibration: cannot write \"%s\"", path);
    }
  }
  free(b);
  return rc;
}
