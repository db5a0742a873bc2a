/*
 * kernels/attend_reg.cuh - attend_reg_kernel: decode attention over fp8,
 * int8, nvfp4 and kivi pages (K and V of one codec) at head_dim 64 and 128,
 * the codes dequantized in the registers of the matrix fragments.
 *
 * Each warp streams its run of the split's records a step (<= 16 tokens) at
 * a time through a ring of kRegStages stages in shared memory: a step's
 * code rows and its per-token side data (scales, means, kivi records) go
 * there by cp.async, kRegStages - 1 steps ahead of the step computed, so a
 * warp keeps several steps of loads in flight however few bytes a step
 * has (a 2-bit step is a quarter of an fp8 one). The compute reads each
 * lane's codes with one or two shared loads a token group and turns them
 * into the fragments (no fp16 tile is written). Each product uses its own
 * order of the channels, which a dot product does not see:
 *   - Q K^T: lane (gr, qd) holds channels [qd D/4, (qd + 1) D/4) of Q's
 *     row gr and of token gr of each 8-token half, and k-step k takes
 *     channels qd D/4 + 4k .. + 3 as its k-indices 2 qd, 2 qd + 1, 8 + 2 qd,
 *     9 + 2 qd (A's and B's alike);
 *   - V^T P^T: rows gr and 8 + gr of k-step i are channels gr D/8 + 2i and
 *     gr D/8 + 2i + 1 (r8_channel), so lane (gr, qd) reads channels
 *     [gr D/8, (gr + 1) D/8) of its tokens 2 qd, 2 qd + 1, 8 + 2 qd, 9 + 2 qd,
 *     and a byte permute pairs two tokens' codes of one channel.
 * fp8 and int8 codes become fp16 exactly (codes4_f16_fast); their
 * per-token scales multiply the scores and the probabilities (the products
 * see fl(q K) s instead of q fl(K s), the same within fp16's rounding).
 * nvfp4: an E2M1 code becomes the E4M3 byte of 2^-6 its value (sign, then
 * its exponent and mantissa bits moved down) and the E4M3 converter makes
 * it fp16; its E4M3 group scale times 2^6 (at most 28672) is fp16 too, so
 * the fragments hold e s exactly (at most 6 significant bits, 2^-10 ..
 * 2688) and the block's g multiplies the scores and the probabilities; with
 * K smoothing (KSM) the score of token t gains mean_t sum(q). kivi: K's
 * per-channel group records fold into Q (q s as two fp16 parts, exact, and
 * a bias q . m from one more product), a step staying inside one K group;
 * V is c s + m in one fp16 fma.
 *
 * Invariants: a stage holds exactly one step; rows past the step's end are
 * zeros (finite: they enter the products and weigh 0); every issue
 * commits one cp.async group, empty or not, so waiting for all but the
 * newest kRegStages - 1 groups completes the step about to be computed; a
 * stage is refilled only after the __syncwarp that ends its compute. A RAW
 * tail record (an open stream block, one per (sequence, head) at most) is
 * not staged: its rows are read element by element at its turn.
 */
#pragma once
#include "attend_core.cuh"

namespace kvpk {

/* attend_reg_kernel's C beside the codec ids: kivi with per-channel K and
 * per-token V of 2 or 4 bits */
constexpr uint32_t kKivi2 = 0x102u, kKivi4 = 0x104u;

template <uint32_t C> __host__ __device__ constexpr uint32_t reg_code_bits() {
  return C == KVP__K_NVFP4 ? 4 : C == kKivi2 ? 2 : C == kKivi4 ? 4 : 8;
}
template <uint32_t C> __host__ __device__ constexpr bool reg_kivi() { return C == kKivi2 || C == kKivi4; }

constexpr uint32_t kRegStages = 4; /* a warp's steps in flight: this one and three ahead */

/* One stage of a warp, byte offsets: K's code rows, V's, then the side data:
 *   nvfp4: K's and V's scale rows (D / 16 bytes a token), then K's means
 *     (bf16) from the even token at or before the step's first: 18 of them,
 *     then K's and V's g (f32);
 *   fp8: K's and V's per-token scales (f32; none when static);
 *   int8: K's and V's per-token scales (bf16) from the even token at or
 *     before the step's first: 18 of them;
 *   kivi: the step's K group records (D x (fp16 scale, fp16 min)), then V's
 *     records of the step's tokens ((D / group) x 4 bytes a token, <= 32). */
template <uint32_t D, uint32_t C> struct RegStage {
  static constexpr bool FP4 = C == KVP__K_NVFP4, KIVI = reg_kivi<C>();
  static constexpr uint32_t RB = D * reg_code_bits<C>() / 8, NSC = D / 16;
  static constexpr uint32_t KC = 0, VC = kTile * RB, SIDE = 2 * kTile * RB;
  static constexpr uint32_t SK = SIDE, SV = FP4 ? SIDE + kTile * NSC : SIDE + 80, KM = SIDE + 2 * kTile * NSC;
  static constexpr uint32_t KG = SIDE, VR = SIDE + 4 * D;
  static constexpr uint32_t G = KM + 48; /* nvfp4: K's g, V's g (f32) */
  static constexpr uint32_t BYTES = FP4 ? G + 16 : KIVI ? VR + kTile * 32 : SIDE + 160;
  static_assert(BYTES % 16 == 0 && RB % 16 == 0, "16-byte copies");
};

template <uint32_t D, uint32_t C> __host__ __device__ constexpr size_t reg_smem() {
  return cmax(merge_smem<D>(), (size_t)kAttnWarps * kRegStages * RegStage<D, C>::BYTES);
}

/* A step as the issue side left it for the compute */
struct RegMeta {
  uint32_t n;      /* tokens (0: no step); kRegTail: a RAW tail's, read at its turn */
  uint32_t t;      /* its first row in the block */
  uint32_t pk, pv; /* RAW tail: K's and V's pages */
};
constexpr uint32_t kRegTail = 0x80000000u;

/* The codes of a step in the registers of the lane's fragments */
template <uint32_t D, uint32_t C> struct RegStep {
  static constexpr uint32_t KW = D * reg_code_bits<C>() / 128;
  static constexpr uint32_t VW = D * reg_code_bits<C>() / 256 ? D * reg_code_bits<C>() / 256 : 1;
  uint32_t k[2][KW];  /* group j: token 8 j + gr, channels [qd D/4, (qd + 1) D/4) */
  uint32_t v[4][VW];  /* tokens 2 qd, 2 qd + 1, 8 + 2 qd, 9 + 2 qd: channels [gr D/8, (gr + 1) D/8) */
  float ks[4], vs[4]; /* fp8, int8: the per-token scales of tokens 2 qd, 2 qd + 1, 8 + 2 qd, 9 + 2 qd;
                         nvfp4: K's and V's g (all four alike); with KSM ks holds those tokens' K means */
  uint32_t kg[2];     /* nvfp4: the E4M3 scales of group j's K channels (D = 128: two groups, byte each) */
  uint32_t vg;        /* nvfp4: the E4M3 scales of the four V tokens, a byte each */
  uint32_t vr[4];     /* kivi: the four V tokens' records (fp16 scale, fp16 min) */
  float gk;           /* nvfp4: K's g */
};

/* WORDS 32-bit words of shared memory at p (aligned to 16 bytes when
 * WORDS >= 4, else to 4 WORDS) */
template <uint32_t WORDS> KVP_D void lds_words(const unsigned char *p, uint32_t *w) {
  if constexpr (WORDS >= 4) {
#pragma unroll
    for (uint32_t i = 0; i < WORDS / 4; i++) {
      const uint4 x = *(const uint4 *)(p + 16 * i);
      w[4 * i] = x.x, w[4 * i + 1] = x.y, w[4 * i + 2] = x.z, w[4 * i + 3] = x.w;
    }
  } else if constexpr (WORDS == 2) {
    const uint2 x = *(const uint2 *)p;
    w[0] = x.x, w[1] = x.y;
  } else {
    w[0] = *(const uint32_t *)p;
  }
}

/* Two E4M3 codes (the low 16 bits of w: bits 0-7 the low half) as fp16x2,
 * exactly */
KVP_D uint32_t e4m3x2_f16(uint32_t w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t d;
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\t}" : "=r"(d) : "r"(w));
  return d;
#else
  return f16x2(fp8_to_f32(w & 0xFFu), fp8_to_f32(w >> 8 & 0xFFu));
#endif
}

/* Four fp8 or int8 codes (bytes of w) as two fp16x2 words, exactly */
template <uint32_t C> KVP_D void codes4_f16_fast(uint32_t w, uint32_t &lo, uint32_t &hi) {
  if (C == KVP__K_FP8) {
    lo = e4m3x2_f16(w), hi = e4m3x2_f16(w >> 16);
    return;
  }
  codes4_f16<C>(w, lo, hi);
}

/* The E2M1 codes in the low (lo) and high (hi) nibbles of w's four bytes
 * as the E4M3 bytes of 2^-6 their values: s e1 e0 m becomes s 0 0 e1 e0 m 0 0
 * (subnormal m 2^-7 for e = 0, as E2M1's m / 2; 2^(e - 7) (1 + m / 2) else) */
KVP_D void e2m1_e4m3(uint32_t w, uint32_t &lo, uint32_t &hi) {
  lo = (w << 2 & 0x1C1C1C1Cu) | (w << 4 & 0x80808080u);
  hi = (w >> 2 & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

/* An E4M3 scale byte as fp16 in both halves, times 2^6 (undoes e2m1_e4m3's 2^-6) */
KVP_D uint32_t fp4_scale2(uint32_t byte) { return hmul2(e4m3x2_f16((byte & 0xFFu) * 0x0101u), 0x54005400u); }

/* Two kivi codes (the low KB bits of lo and of hi) as fp16x2, exactly:
 * 1024 + c in fp16's bits, less 1024 */
template <uint32_t KB> KVP_D uint32_t kivi_codes2_f16(uint32_t lo, uint32_t hi) {
  constexpr uint32_t Q = (1u << KB) - 1;
  uint32_t h = (lo & Q) | (hi & Q) << 16 | 0x64006400u;
  asm("sub.rn.f16x2 %0, %0, %1;" : "+r"(h) : "r"(0x64006400u));
  return h;
}

/* c s + m, fp16x2, one rounding */
KVP_D uint32_t kivi_fma_f16(uint32_t c, uint32_t s, uint32_t m) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(c), "r"(s), "r"(m));
  return d;
}

/* The step of n tokens from row t of record fr into the stage at dst
 * (shared address): every lane issues its share of the copies. The bf16
 * arrays (int8's scales, nvfp4's K means) go by 4-byte words from an even
 * token: with an odd capacity the last word takes 2 bytes past the array,
 * inside the page's last 64-byte unit (pages start on 64-byte
 * boundaries), and nobody reads them. */
template <uint32_t D, uint32_t C, bool KSM>
KVP_D void reg_stage_fill(const AttnArgs &a, const Rec &fr, uint32_t t, uint32_t n, uint32_t lane, uint32_t dst,
                          RegMeta &o) {
  using S = RegStage<D, C>;
  constexpr uint32_t RB = S::RB, CPR = RB / 16, CH = kTile * CPR; /* 16-byte chunks a row, a side */
  const uint8_t *base = (const uint8_t *)a.base;
  const uint8_t *kc = base + (uint64_t)fr.page[0][0] * 64, *vc = base + (uint64_t)fr.page[1][0] * 64;
  const uint8_t *ksc = base + (uint64_t)fr.page[0][1] * 64, *vsc = base + (uint64_t)fr.page[1][1] * 64;
#pragma unroll
  for (uint32_t it = 0; it < 2 * CH / 32; it++) {
    const uint32_t i = it * 32 + lane, kv = i / CH, r = i % CH / CPR, cc = i % CPR;
    cp_async<16>(dst + (kv ? S::VC : S::KC) + r * RB + cc * 16,
               (kv ? vc : kc) + (size_t)(t + min(r, n - 1)) * RB + cc * 16, r < n ? 16u : 0u);
  }
  const bool kside = lane < 16;
  const uint32_t r = lane % 16;
  const uint8_t *sc = kside ? ksc : vsc;
  if constexpr (S::FP4) {
    const uint32_t d = dst + (kside ? S::SK : S::SV) + r * S::NSC;
    const uint8_t *src = sc + (size_t)(t + min(r, n - 1)) * S::NSC;
    if (S::NSC == 8) cp_async<8>(d, src, r < n ? 8u : 0u);
    else cp_async<4>(d, src, r < n ? 4u : 0u);
    if (KSM && lane < 9) { /* the means' words from the even token at or before t */
      const uint32_t te = (t & ~1u) + 2 * lane;
      cp_async<4>(dst + S::KM + 4 * lane, ksc + (size_t)fr.cap * S::NSC + (size_t)min(te, t + n - 1 & ~1u) * 2,
                te < t + n ? 4u : 0u);
    }
    if (lane == 9 || lane == 10) /* K's and V's g: a load into registers would hold up the metas' shift */
      cp_async<4>(dst + S::G + 4 * (lane - 9), base + (uint64_t)fr.page[lane - 9][2] * 64, 4u);
  } else if constexpr (S::KIVI) {
    const uint32_t GK = a.p[0].kivi_group, RV = D / a.p[2].kivi_group * 4; /* V record bytes a token */
    if (lane < D / 4) cp_async<16>(dst + S::KG + 16 * lane, ksc + (size_t)(t / GK) * D * 4 + 16 * lane, 16u);
    if (RV % 16 == 0) {
      const uint32_t cpr = RV / 16, tr = lane / cpr;
      if (lane < kTile * cpr)
        cp_async<16>(dst + S::VR + 16 * lane, vsc + (size_t)(t + min(tr, n - 1)) * RV + 16 * (lane % cpr),
                   tr < n ? 16u : 0u);
    } else {
      const uint32_t cpr = RV / 4, tr = lane / cpr;
      if (lane < kTile * cpr)
        cp_async<4>(dst + S::VR + 4 * lane, vsc + (size_t)(t + min(tr, n - 1)) * RV + 4 * (lane % cpr), tr < n ? 4u : 0u);
    }
  } else if (C == KVP__K_FP8) {
    if (a.p[kside ? 0 : 2].fp8_dynamic) /* f32 scales of tokens t + r */
      cp_async<4>(dst + (kside ? S::SK : S::SV) + 4 * r, sc + (size_t)(t + min(r, n - 1)) * 4, r < n ? 4u : 0u);
  } else if (r < 9) { /* int8: the bf16 scales' words from the even token at or before t */
    const uint32_t te = (t & ~1u) + 2 * r;
    cp_async<4>(dst + (kside ? S::SK : S::SV) + 4 * r, sc + (size_t)min(te, t + n - 1 & ~1u) * 2, te < t + n ? 4u : 0u);
  }
}

/* The step in stage sb (a generic pointer to it) into the lane's registers */
template <uint32_t D, uint32_t C, bool KSM>
KVP_D void reg_stage_read(const AttnArgs &a, const RegMeta &m, const unsigned char *sb, uint32_t gr, uint32_t qd,
                          RegStep<D, C> &c) {
  using S = RegStage<D, C>;
  using St = RegStep<D, C>;
  constexpr uint32_t RB = S::RB;
  const uint32_t vtok[4] = {2 * qd, 2 * qd + 1, 8 + 2 * qd, 9 + 2 * qd};
#pragma unroll
  for (uint32_t j = 0; j < 2; j++) lds_words<St::KW>(sb + S::KC + (8 * j + gr) * RB + qd * (RB / 4), c.k[j]);
#pragma unroll
  for (uint32_t e = 0; e < 4; e++) {
    const unsigned char *vp = sb + S::VC + vtok[e] * RB + gr * (RB / 8);
    if constexpr (RB / 8 == 2) c.v[e][0] = *(const unsigned short *)vp; /* kivi-2 at head_dim 64 */
    else lds_words<St::VW>(vp, c.v[e]);
  }
  if constexpr (S::FP4) {
#pragma unroll
    for (uint32_t j = 0; j < 2; j++) { /* the lane's K channels: groups (qd D/4) / 16 .. (D = 128: two) */
      const unsigned char *p = sb + S::SK + (8 * j + gr) * S::NSC + qd * (D / 64);
      c.kg[j] = D == 128 ? (uint32_t) * (const unsigned short *)p : (uint32_t)*p;
    }
    uint32_t vg = 0;
#pragma unroll
    for (uint32_t e = 0; e < 4; e++) vg |= (uint32_t)sb[S::SV + vtok[e] * S::NSC + gr * D / 128] << (8 * e);
    c.vg = vg;
    const float gk = *(const float *)(sb + S::G), gv = *(const float *)(sb + S::G + 4);
    c.gk = gk;
#pragma unroll
    for (uint32_t e = 0; e < 4; e++) {
      c.vs[e] = gv, c.ks[e] = gk;
      if (KSM) c.ks[e] = bf16_to_f32(*(const unsigned short *)(sb + S::KM + ((m.t & 1u) + vtok[e]) * 2));
    }
  } else if constexpr (S::KIVI) {
    const uint32_t GV = a.p[2].kivi_group, RV = D / GV * 4;
#pragma unroll
    for (uint32_t e = 0; e < 4; e++) {
      c.vr[e] = *(const uint32_t *)(sb + S::VR + vtok[e] * RV + gr * (D / 8) / GV * 4);
      c.ks[e] = c.vs[e] = 1.0f;
    }
  } else {
#pragma unroll
    for (uint32_t e = 0; e < 4; e++) {
      if (C == KVP__K_FP8) {
        c.ks[e] = a.p[0].fp8_dynamic ? *(const float *)(sb + S::SK + 4 * vtok[e]) : a.p[0].fp8_static_scale;
        c.vs[e] = a.p[2].fp8_dynamic ? *(const float *)(sb + S::SV + 4 * vtok[e]) : a.p[2].fp8_static_scale;
      } else {
        const uint32_t o = ((m.t & 1u) + vtok[e]) * 2;
        c.ks[e] = bf16_to_f32(*(const unsigned short *)(sb + S::SK + o));
        c.vs[e] = bf16_to_f32(*(const unsigned short *)(sb + S::SV + o));
      }
    }
  }
}

template <uint32_t D, uint32_t C, bool KSM>
__global__ void __launch_bounds__(kAttnThreads, 2) attend_reg_kernel(const __grid_constant__ AttnArgs a) {
  using S = RegStage<D, C>;
  constexpr uint32_t KS = D / 16, KB = reg_code_bits<C>();
  constexpr bool FP4 = C == KVP__K_NVFP4, KIVI = reg_kivi<C>();
  extern __shared__ __align__(16) unsigned char smem[];
  const kvp__asplit sp = a.splits[blockIdx.x];
  dep_launch(); /* attend_reduce may start: it reads the table until it waits for this grid */
  const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, qd = lane % 4, gr = lane / 4;
  const uint32_t b = sp.bh / a.Hkv, h = sp.bh % a.Hkv;
  /* Q: row gr, channels qd D/4 + 4k .. + 3 as k-step k's A fragment (fp16);
   * qsum: the sum of row gr's fp16 values (K smoothing) */
  uint32_t qa[KS][2];
  float qsum = 0.0f;
  {
    const uint16_t *qr = a.q + ((size_t)b * a.Hq + h * a.G + (gr < a.G ? gr : 0)) * D + qd * (D / 4);
#pragma unroll
    for (uint32_t k = 0; k < KS; k++) {
      const uint2 w = gr < a.G ? __ldg((const uint2 *)(qr + 4 * k)) : make_uint2(0u, 0u);
      qa[k][0] = f16x2(bf16_to_f32(w.x & 0xFFFFu), bf16_to_f32(w.x >> 16));
      qa[k][1] = f16x2(bf16_to_f32(w.y & 0xFFFFu), bf16_to_f32(w.y >> 16));
      if (KSM) {
        qsum += (f16_to_f32(qa[k][0] & 0xFFFFu) + f16_to_f32(qa[k][0] >> 16)) +
                (f16_to_f32(qa[k][1] & 0xFFFFu) + f16_to_f32(qa[k][1] >> 16));
      }
    }
    if (KSM) {
      qsum += __shfl_xor_sync(0xFFFFFFFFu, qsum, 1);
      qsum += __shfl_xor_sync(0xFFFFFFFFu, qsum, 2);
    }
  }
  Acc<D> st;
  acc_init(st);
  const uint32_t vtok[4] = {2 * qd, 2 * qd + 1, 8 + 2 * qd, 9 + 2 * qd};
  unsigned char *wstage = smem + (size_t)warp * kRegStages * S::BYTES; /* the warp's ring */
  const uint32_t wstage_s = smem_addr(wstage);
  const uint32_t GK = KIVI ? a.p[0].kivi_group : 1u;

  RecStream<2> rs;
  rs.init((const kvp__arec_q *)a.recs + sp.rec0, sp.nrec, warp, lane);
  uint32_t fib = 0;
  Rec fr = {};
  bool have = rec_next(rs, lane, fr);
  /* the warp's next step into stage slot (o.n = 0: none left); one cp.async group, empty or not */
  auto issue = [&](RegMeta &o, uint32_t slot) {
    o.n = 0;
    if (have) {
      const uint32_t t = fr.t0 + fib;
      const bool tail = fr.tag & 1u;
      /* kivi: a step stays in one K group (its records fold into Q) */
      const uint32_t n = KIVI && !tail ? min(min(kTile, fr.m - fib), GK - t % GK) : min(kTile, fr.m - fib);
      o.t = t, o.pk = fr.page[0][0], o.pv = fr.page[1][0];
      if (tail) o.n = n | kRegTail;
      else o.n = n, reg_stage_fill<D, C, KSM>(a, fr, t, n, lane, wstage_s + slot * S::BYTES, o);
      fib += n;
      if (fib >= fr.m) fib = 0, have = rec_next(rs, lane, fr); /* on to the warp's next record */
    }
    cp_async_commit();
  };
  /* a RAW tail step: this lane's elements read from the pages, converted to fp16 */
  auto compute_tail = [&](const RegMeta &m) {
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    uint32_t p0, p1, r0, r1;
    const uint32_t kd = a.p[1].store_dtype, vd = a.p[3].store_dtype, n = m.n & ~kRegTail;
    const uint8_t *tk = (const uint8_t *)a.base + (uint64_t)m.pk * 64 + (size_t)m.t * D * dtype_bytes(kd);
    const uint8_t *tv = (const uint8_t *)a.base + (uint64_t)m.pv * 64 + (size_t)m.t * D * dtype_bytes(vd);
#pragma unroll
    for (uint32_t j = 0; j < 2; j++) {
      const uint8_t *row = tk + (size_t)min(8 * j + gr, n - 1) * D * dtype_bytes(kd);
#pragma unroll
      for (uint32_t k = 0; k < KS; k++) {
        const uint32_t ch = qd * (D / 4) + 4 * k;
        const uint32_t b0 = f16x2(load_elem(row, kd, ch), load_elem(row, kd, ch + 1)),
                       b1 = f16x2(load_elem(row, kd, ch + 2), load_elem(row, kd, ch + 3));
        const uint32_t qk[4] = {qa[k][0], 0u, qa[k][1], 0u};
        mma16816(s[j], qk, b0, b1);
      }
    }
    softmax_step<D, false>(s, n, a.scale_log2, qd, st, kOnes, kOnes, p0, p1, r0, r1);
    const uint8_t *vr[4];
#pragma unroll
    for (uint32_t e = 0; e < 4; e++) vr[e] = tv + (size_t)min(vtok[e], n - 1) * D * dtype_bytes(vd);
#pragma unroll
    for (uint32_t i = 0; i < KS; i++) {
      const uint32_t ch = r8_channel<D>(gr, i, 0);
      const uint32_t va[4] = {f16x2(load_elem(vr[0], vd, ch), load_elem(vr[1], vd, ch)),
                              f16x2(load_elem(vr[0], vd, ch + 1), load_elem(vr[1], vd, ch + 1)),
                              f16x2(load_elem(vr[2], vd, ch), load_elem(vr[3], vd, ch)),
                              f16x2(load_elem(vr[2], vd, ch + 1), load_elem(vr[3], vd, ch + 1))};
      mma16816(st.o[i], va, p0, p1);
    }
  };
  auto compute = [&](const RegMeta &m, const unsigned char *sb) {
    RegStep<D, C> c;
    reg_stage_read<D, C, KSM>(a, m, sb, gr, qd, c);
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    uint32_t p0, p1, r0, r1;
    /* kivi: K's group records fold into Q (q s per channel) and a bias
     * q . m per query head, the same in every token's column: q . (c s + m)
     * = (q s) . c + q . m. q s is two fp16 parts, what fp16 keeps of it and
     * the rest (exact: q has bf16's 8 significant bits and s 11, so the
     * rest has at most 8), in the A fragment's rows gr and gr + 8 (the
     * latter unused by the queries): one product gives both, summed in f32
     * after. Rounding q s alone was most of kivi's error (40-step test:
     * 2.35e-3 of the output against 5.3e-4 exact); the codes, up to 2^KB -
     * 1 times q s, magnify it. The bias is a product on the tensor cores
     * too (Q against m as every token's row: fp16 products exact, f32
     * sums), and the scores start from it. */
    uint32_t qs[KS][2], ql[KS][2];
    if constexpr (KIVI) {
      const uint4 *rec = (const uint4 *)(sb + S::KG) + qd * (D / 16);
#pragma unroll
      for (uint32_t k = 0; k < KS; k++) {
        const uint4 r = rec[k]; /* channels 4k .. 4k + 3 of the lane's: (scale, min) fp16 pairs */
        const uint32_t s01 = __byte_perm(r.x, r.y, 0x5410u), s23 = __byte_perm(r.z, r.w, 0x5410u);
        const uint32_t m01 = __byte_perm(r.x, r.y, 0x7632u), m23 = __byte_perm(r.z, r.w, 0x7632u);
        qs[k][0] = hmul2(qa[k][0], s01), qs[k][1] = hmul2(qa[k][1], s23);
        ql[k][0] = kivi_fma_f16(qa[k][0], s01, qs[k][0] ^ 0x80008000u);
        ql[k][1] = kivi_fma_f16(qa[k][1], s23, qs[k][1] ^ 0x80008000u);
        const uint32_t qk[4] = {qa[k][0], 0u, qa[k][1], 0u};
        mma16816(s[0], qk, m01, m23);
      }
#pragma unroll
      for (int e = 0; e < 4; e++) s[1][e] = s[0][e];
    }
#pragma unroll
    for (uint32_t j = 0; j < 2; j++) {
      if constexpr (FP4) {
        /* the lane's K group scales (times 2^6), fp16 in both halves */
        const uint32_t sc[2] = {fp4_scale2(c.kg[j]), D == 128 ? fp4_scale2(c.kg[j] >> 8) : 0u};
#pragma unroll
        for (uint32_t w = 0; w < KS / 2; w++) { /* word w: channels 8w .. 8w + 7 of the lane's, k-steps 2w, 2w + 1 */
          uint32_t lo, hi;
          e2m1_e4m3(c.k[j][w], lo, hi);
          const uint32_t s2 = sc[D == 128 ? w / 2 : 0];
          const uint32_t x01 = __byte_perm(lo, hi, 0x5140u), x23 = __byte_perm(lo, hi, 0x7362u);
          const uint32_t q0[4] = {qa[2 * w][0], 0u, qa[2 * w][1], 0u}, q1[4] = {qa[2 * w + 1][0], 0u, qa[2 * w + 1][1], 0u};
          mma16816(s[j], q0, hmul2(e4m3x2_f16(x01), s2), hmul2(e4m3x2_f16(x01 >> 16), s2));
          mma16816(s[j], q1, hmul2(e4m3x2_f16(x23), s2), hmul2(e4m3x2_f16(x23 >> 16), s2));
        }
      } else {
#pragma unroll
        for (uint32_t k = 0; k < KS; k++) {
          uint32_t b0, b1;
          if constexpr (KIVI) { /* channels 4k .. 4k + 3 of the lane's: 4 KB bits from bit 4 KB k */
            const uint32_t x = c.k[j][(4 * KB * k) / 32] >> ((4 * KB * k) % 32);
            b0 = kivi_codes2_f16<KB>(x, x >> KB), b1 = kivi_codes2_f16<KB>(x >> (2 * KB), x >> (3 * KB));
          } else {
            codes4_f16_fast<C>(c.k[j][k], b0, b1);
          }
          const uint32_t qk[4] = {KIVI ? qs[k][0] : qa[k][0], KIVI ? ql[k][0] : 0u, KIVI ? qs[k][1] : qa[k][1],
                                  KIVI ? ql[k][1] : 0u};
          mma16816(s[j], qk, b0, b1);
        }
      }
      if constexpr (KIVI) s[j][0] += s[j][2], s[j][1] += s[j][3]; /* (q s)'s two fp16 parts, summed in f32 */
    }
    const uint32_t n = m.n;
    if (KSM) { /* q . (e s g + mean) = g (q . e s) + mean sum(q) */
      s[0][0] = __fadd_rn(__fmul_rn(s[0][0], c.gk), __fmul_rn(c.ks[0], qsum));
      s[0][1] = __fadd_rn(__fmul_rn(s[0][1], c.gk), __fmul_rn(c.ks[1], qsum));
      s[1][0] = __fadd_rn(__fmul_rn(s[1][0], c.gk), __fmul_rn(c.ks[2], qsum));
      s[1][1] = __fadd_rn(__fmul_rn(s[1][1], c.gk), __fmul_rn(c.ks[3], qsum));
      softmax_step<D, false>(s, n, a.scale_log2, qd, st, kOnes, c.vs, p0, p1, r0, r1);
    } else {
      softmax_step<D, false>(s, n, a.scale_log2, qd, st, c.ks, c.vs, p0, p1, r0, r1);
    }
    if constexpr (FP4) {
      /* V scales of tokens 2 qd, 2 qd + 1 and 8 + those (times 2^6), fp16x2 */
      const uint32_t sv01 = hmul2(e4m3x2_f16(c.vg), 0x54005400u), sv23 = hmul2(e4m3x2_f16(c.vg >> 16), 0x54005400u);
#pragma unroll
      for (uint32_t w = 0; w < RegStep<D, C>::VW; w++) { /* word w of each token: channels 8w .. 8w + 7 of the lane's */
        uint32_t lo[4], hi[4];
#pragma unroll
        for (uint32_t e = 0; e < 4; e++) e2m1_e4m3(c.v[e][w], lo[e], hi[e]);
#pragma unroll
        for (uint32_t b2 = 0; b2 < 4; b2 += 2) { /* bytes b2, b2 + 1: k-steps i = 4w + b2 and the next */
          const uint32_t sel = b2 | (4 + b2) << 4 | (b2 + 1) << 8 | (5 + b2) << 12;
          const uint32_t l01 = __byte_perm(lo[0], lo[1], sel), h01 = __byte_perm(hi[0], hi[1], sel);
          const uint32_t l23 = __byte_perm(lo[2], lo[3], sel), h23 = __byte_perm(hi[2], hi[3], sel);
#pragma unroll
          for (uint32_t u = 0; u < 2; u++) {
            const uint32_t va[4] = {hmul2(e4m3x2_f16(l01 >> 16 * u), sv01), hmul2(e4m3x2_f16(h01 >> 16 * u), sv01),
                                    hmul2(e4m3x2_f16(l23 >> 16 * u), sv23), hmul2(e4m3x2_f16(h23 >> 16 * u), sv23)};
            mma16816(st.o[4 * w + b2 + u], va, p0, p1);
          }
        }
      }
    } else {
#pragma unroll
      for (uint32_t i = 0; i < KS; i++) {
        uint32_t va[4];
        if constexpr (KIVI) { /* channels 2i, 2i + 1 of the lane's: KB bits from bit 2 KB i, c s + m in fp16 */
          const uint32_t w = (2 * KB * i) / 32, sh = (2 * KB * i) % 32;
          const uint32_t s01 = __byte_perm(c.vr[0], c.vr[1], 0x5410u), m01 = __byte_perm(c.vr[0], c.vr[1], 0x7632u);
          const uint32_t s23 = __byte_perm(c.vr[2], c.vr[3], 0x5410u), m23 = __byte_perm(c.vr[2], c.vr[3], 0x7632u);
          va[0] = kivi_fma_f16(kivi_codes2_f16<KB>(c.v[0][w] >> sh, c.v[1][w] >> sh), s01, m01);
          va[1] = kivi_fma_f16(kivi_codes2_f16<KB>(c.v[0][w] >> (sh + KB), c.v[1][w] >> (sh + KB)), s01, m01);
          va[2] = kivi_fma_f16(kivi_codes2_f16<KB>(c.v[2][w] >> sh, c.v[3][w] >> sh), s23, m23);
          va[3] = kivi_fma_f16(kivi_codes2_f16<KB>(c.v[2][w] >> (sh + KB), c.v[3][w] >> (sh + KB)), s23, m23);
        } else { /* channels 2i, 2i + 1 of the lane's: byte 2 (i % 2) and the next of word i / 2 */
          const uint32_t sel = i % 2 ? 0x7362u : 0x5140u;
          codes4_f16_fast<C>(__byte_perm(c.v[0][i / 2], c.v[1][i / 2], sel), va[0], va[1]);
          codes4_f16_fast<C>(__byte_perm(c.v[2][i / 2], c.v[3][i / 2], sel), va[2], va[3]);
        }
        mma16816(st.o[i], va, p0, p1);
      }
    }
  };
  /* the ring: step i in stage i % kRegStages; m[0] the step computed next,
   * m[1 ..] those in flight. One copy of the loop body (no unrolling by
   * the ring's length: the compute is long, and its copies would not stay
   * in the instruction cache); the metas shift down a step at a time. */
  RegMeta m[kRegStages];
  auto shift = [&]() {
#pragma unroll
    for (uint32_t s = 0; s + 1 < kRegStages; s++) m[s] = m[s + 1];
  };
#pragma unroll 1
  for (uint32_t s = 0; s + 1 < kRegStages; s++) issue(m[kRegStages - 1], s), shift();
#pragma unroll 1
  for (uint32_t slot = 0; m[0].n; slot = (slot + 1) % kRegStages) {
    issue(m[kRegStages - 1], (slot + kRegStages - 1) % kRegStages);
    cp_async_wait<(int)kRegStages - 1>(); /* m[0]'s group (the three after it may be in flight) */
    __syncwarp();
    if (m[0].n & kRegTail) compute_tail(m[0]);
    else compute(m[0], wstage + slot * S::BYTES);
    __syncwarp(); /* every lane is done with the stage before its refill */
    shift();
  }
  cp_async_wait<0>();
  cta_merge<D, true>(a, sp, st, smem);
}

} // namespace kvpk
