// The quantized-tier loop of the decode kernel (decode.cu): a warp's pages of one split, 16 tokens (a "chunk")
// per step, two mma.sync products per chunk with the codes themselves as the A operands.
//
// S^T[tok, head] = K[tok, :] . Q'^T. Key field j of a packed byte (j < 8 / KB) enters the mma in place, masked:
// a float16 subnormal (2^KB)^j c 2^-24 (fieldj). Q' (the B operand) is q * sm_scale * log2(e) / (2^KB)^j in
// float16; token-page keys: logit = s_t S + o_t sum(q') (units of 1 / LS); channel-page keys (one scale s_c and
// offset o_c per channel of a page): Q' also carries s_c, rebuilt once per page, and logit = S + sum_c q'_c o_c.
// O^T[d, head] += V^T[d, tok] . P'^T[tok, head]: V^T the value codes (field j: (2^VB)^j c 2^-24), P' = p * s_v
// (movmatrix turns the S^T accumulator into the B fragment); the offsets enter through sum_t p_t o_t.
// The softmax reference maximum is raised lazily (only when a score exceeds it by 2^LAZY_TAU), so most chunks
// cost no shuffle and no rescale; log2 of a reference V scale rides in it, so P' needs no division.
#pragma once
#include "decode_common.cuh"

// Token order inside a 16-token chunk: mma row i of S^T holds token 2i (i < 8) or 2(i - 8) + 1, so a thread's
// two rows (gid, gid + 8) are the adjacent tokens 2gid, 2gid + 1 and each metadata pair is one 32-bit load.
struct Chunk2 {
  uint32_t k[2][WPT];                     // tokens 2gid, 2gid + 1: key bytes [tig * BPT, +BPT)
  uint32_t v[4][BPV >= 4 ? BPV / 4 : 1];  // tokens 4tig + {0, 2, 1, 3} (mma k = 2tig, 2tig+1, 2tig+8, 2tig+9)
  meta2_t vs, vo;                         // tokens 2gid, 2gid + 1
#if !KCH_
  meta2_t ks, ko;
#endif
};

struct Q2 {  // per-warp constants of the quantized tier
  uint32_t qb[KS][2];  // B fragments of Q' (channel keys: of the current page)
  float kq[2];         // heads 2tig, 2tig+1: token keys sum(q') / LS; channel keys the page's sum_c q'_c o_c / LS
  float lv;            // log2(v_ref), carried in the reference maximum
};

// d index of QK column (k-step s, column 2tig + e + 8 hi): the A fragment's halves are bytes (0, 2) and (1, 3)
// of a code word (the fields are masked in place, bytes 1 and 3 after one shift)
__device__ __forceinline__ constexpr int d_of_k2(int s, int tig, int e, int hi) {
  return tig * BPT + 4 * (s % WPT) + 2 * e + hi + RBK * (s / WPT);
}
// d index of O^T row (m-tile mt, row gid + 8 r)
__device__ __forceinline__ constexpr int d_of_v2(int mt, int gid, int r) {
  return gid * BPV + 2 * (mt % VH) + r + RBV * (mt / VH);
}

// ---- register-prefetch loop (CPA_ = 0; 2-bit formats at a few pairs)
// Per-thread offsets of one (sequence, KV head) from the pools' base pointers, the lane's fixed part folded in
// (bytes for codes, elements for metadata); the base pointers themselves stay in the constant bank.
struct Bases2 {
  int64_t k, v, m;  // m: key metadata; the value metadata's head offset differs by h (s_vmh - s_kmh)
  int h;            // channel-page keys: m is the head's row start (read whole by channel_q), without 2 gid
#if L2PF_
  const uint8_t *pfc, *pfm;  // this lane's L2 prefetch lines of page 0 (codes, metadata)
#endif
};

// L2PF_: ask for physical page `page` (this head's K and V codes and four metadata rows) to be brought into L2:
// per-lane prefetch.global.L2 of one 128-byte line each (a hint: no register, nothing to wait for). Lanes 0..15
// take the K lines, 16..31 the V lines (16 lines per instruction each); for metadata lane l takes row l & 3
// (ks, ko, vs, vo) at byte min(128 (l >> 2), row bytes - 1), so a row of up to 1 KB is covered.
constexpr int PF_KLINES = PS * RBK / 128, PF_VLINES = PS * RBV / 128;
constexpr int KMROW = KCH ? D : PS;  // elements of a key metadata row (a page's: per token, or per channel)
__device__ __forceinline__ void l2_prefetch_page(const Params& p, const Bases2& bs, int32_t page, int lane) {
#if L2PF_
  // page strides below 2^32 bytes (decode_cuda.py checks): one IMAD.WIDE.U32 per address; the lane's strides are
  // read from the parameter bank here (kept in registers they cost spills)
  const uint32_t cs = (uint32_t)(lane < 16 ? p.s_kcp : p.s_vcp);
  const uint32_t ms = (uint32_t)(((lane & 3) < 2 ? p.s_kmp : p.s_vmp) * MSZ);
  const uint8_t* c = bs.pfc + (uint64_t)(uint32_t)page * cs;
  const int nl = lane < 16 ? PF_KLINES : PF_VLINES;
#pragma unroll
  for (int i = 0; i < (cmax(PF_KLINES, PF_VLINES) + 15) / 16; ++i)
    if ((PF_KLINES == PF_VLINES && PF_KLINES % 16 == 0) || (lane & 15) + 16 * i < nl)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(c + i * 16 * 128));
  asm volatile("prefetch.global.L2 [%0];" ::"l"(bs.pfm + (uint64_t)(uint32_t)page * ms));
#endif
}

__device__ __forceinline__ void l2pf_bases(Bases2& bs, const Params& p, int h, int lane) {
#if L2PF_
  const bool kl = lane < 16;
  bs.pfc = reinterpret_cast<const uint8_t*>(kl ? p.kc : p.vc) + h * (kl ? p.s_kch : p.s_vch) + (lane & 15) * 128;
  const int r = lane & 3;
  const uint64_t mb = r == 0 ? p.ks : r == 1 ? p.ko : r == 2 ? p.vs : p.vo;
  bs.pfm = reinterpret_cast<const uint8_t*>(mb) + h * (r < 2 ? p.s_kmh : p.s_vmh) * (int64_t)MSZ +
           min(128 * (lane >> 2), (r < 2 ? KMROW : PS) * MSZ - 1);
#endif
}

// EARLY_: L2 prefetch of this warp's first two pages of quantized split `split`, before the PDLW_ wait (hints
// only: the length and block-table entries are read through L2, ld.global.cg, so no stale L1 line remains for
// the loads after the wait; a stale entry prefetches a wrong page, never changes a result)
__device__ __forceinline__ void l2_prefetch_first_pages(const Params& p, int split, int b, int h, int warp,
                                                        int lane) {
#if EARLY_
  const int n = __ldcg(reinterpret_cast<const int32_t*>(p.qlen) + b);
  const int tps = split_tokens(p, n);
  const int lo = split * tps, hi = min(n, lo + tps);
  const int p_end = (hi + PS - 1) / PS;
  const int pg = lo / PS + warp;
  if (lo >= hi || pg >= p_end) return;
  Bases2 bs;
  l2pf_bases(bs, p, h, lane);
  const int32_t* bt = reinterpret_cast<const int32_t*>(p.bt) + b * p.s_bt;
  l2_prefetch_page(p, bs, __ldcg(bt + pg), lane);
  if (pg + NW < p_end) l2_prefetch_page(p, bs, __ldcg(bt + pg + NW), lane);
#endif
}

// Pointers of one physical page (lane offsets included): chunk CH of the page is at a compile-time offset, so a
// chunk's loads need no address arithmetic of their own.
struct PagePtrs {
  const uint8_t *k, *v;
  const meta_t *ks, *ko, *vs, *vo;
};

__device__ __forceinline__ PagePtrs page_ptrs(const Params& p, const Bases2& bs, int32_t page) {
  const int64_t mk = bs.m + (int64_t)page * p.s_kmp;
  // the value rows' lane part (2 gid) is recomputed for channel-page keys: a register less than keeping it
  const int64_t mv = bs.m + (KCH_ ? 2 * (int)((threadIdx.x & 31) >> 2) : 0) + (int64_t)bs.h * (p.s_vmh - p.s_kmh) +
                     (int64_t)page * p.s_vmp;
  return {reinterpret_cast<const uint8_t*>(p.kc) + bs.k + (int64_t)page * p.s_kcp,
          reinterpret_cast<const uint8_t*>(p.vc) + bs.v + (int64_t)page * p.s_vcp,
          reinterpret_cast<const meta_t*>(p.ks) + mk, reinterpret_cast<const meta_t*>(p.ko) + mk,
          reinterpret_cast<const meta_t*>(p.vs) + mv, reinterpret_cast<const meta_t*>(p.vo) + mv};
}

// Unmasked loads of chunk CH (16 rows) of a page: rows past a sequence's end are still inside the page, so the
// loads are in bounds; their (possibly NaN) metadata is masked where it is used (chunk_quant).
template <int CH>
__device__ __forceinline__ void load_chunk_page(Chunk2& c, const PagePtrs& pp) {
#pragma unroll
  for (int r = 0; r < 2; ++r) ld_bytes<BPT>(c.k[r], pp.k + CH * 16 * RBK + r * RBK);
  constexpr int toks[4] = {0, 2, 1, 3};  // + 4 tig, folded into the page pointer
#pragma unroll
  for (int i = 0; i < 4; ++i) ld_bytes<BPV>(c.v[i], pp.v + CH * 16 * RBV + toks[i] * RBV);
  c.vs = *reinterpret_cast<const meta2_t*>(pp.vs + CH * 16);
  c.vo = *reinterpret_cast<const meta2_t*>(pp.vo + CH * 16);
#if !KCH_
  c.ks = *reinterpret_cast<const meta2_t*>(pp.ks + CH * 16);
  c.ko = *reinterpret_cast<const meta2_t*>(pp.ko + CH * 16);
#endif
}

// ---- CPA_: per-warp cp.async page stages in shared memory. One stage = one page of one KV head:
// [K codes: PS rows of RBK][V codes: PS rows of RBV][vs, vo rows: PS each][ks, ko rows: PS each, or D each for
// channel-page keys]. Rows of a 16-token chunk are permuted (16-byte granules move, never bytes) so that a
// thread's reads are at lane-constant offsets plus compile-time ones and a warp's ld.shared are conflict-free:
//   K: token 2i + e of the chunk at row i + 8e: thread (gid, tig) reads rows gid, gid + 8 at byte tig * BPT.
//   V: token 4a + b at row a + 4b: thread reads rows tig + 4b (b = 0..3) at byte gid * BPV; rows of 64 or 128
//      bytes are swizzled (vswz: bits 5.. of the in-stage offset XORed with row bits), else a quarter warp's
//      16 threads would hit 2 or 1 of the 4 32-byte bank groups of a row.
//   metadata: natural order (a thread's pair of adjacent tokens is one 32-bit read, broadcast over tig).
constexpr int CP_KCODE = PS * RBK, CP_VCODE = PS * RBV;
constexpr int CP_MOFF = CP_KCODE + CP_VCODE;
constexpr int M_VS = 0, M_VO = PS * MSZ, M_KS = 2 * PS * MSZ, M_KO = 2 * PS * MSZ + KMROW * MSZ;
constexpr int CP_META = 2 * PS * MSZ + 2 * KMROW * MSZ;
constexpr int CP_STG = (CP_MOFF + CP_META + 127) / 128 * 128;  // one stage
constexpr int SMO_BYTES = 8 * D * 4;  // a warp's unnormalised partial outputs at the end
// bytes of shared memory per warp (two stages, reused for the partial outputs): decode_cuda.py mirrors this
constexpr int CP_WREG = (cmax(2 * CP_STG, SMO_BYTES) + 127) / 128 * 128;
constexpr int CP_KNG = CP_KCODE / 16, CP_KNI = (CP_KNG + 31) / 32;  // 16-byte granules of K, per lane
constexpr int CP_VNG = CP_VCODE / 16, CP_VNI = (CP_VNG + 31) / 32;
constexpr int CP_NMG = CP_META / 16, CP_NMI = (CP_NMG + 31) / 32;
static_assert(PS * MSZ % 16 == 0 && KMROW * MSZ % 16 == 0, "metadata rows of whole 16-byte granules");

#if CPA_
extern __shared__ __align__(128) uint8_t dsm[];
#endif

__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ constexpr uint32_t vswz(uint32_t off) {
  return RBV == 64 ? off ^ (((off >> 7) & 1u) << 5) : RBV == 128 ? off ^ (((off >> 7) & 3u) << 5) : off;
}

// Copies: lane l writes the stage's 16-byte granules 32 i + l of each part (in-stage offset 16 l + 512 i), so the
// permutation is on the source side: the granule at stage offset o of the K (V) part holds row tok(o / RB)
// (granule (o % RB) / 16) of the page, with (in a chunk) K: row p <- token 2 (p & 7) + (p >> 3); V: row p <-
// token 4 (p & 3) + (p >> 2) (of the granule at vswz(o)). For granule 32 i + l the source is the lane's plus a
// compile-time part.
__device__ __forceinline__ constexpr uint32_t cpa_ksrc(uint32_t o) {  // page byte offset of K granule at o
  const uint32_t row = o / RBK, p = row & 15;
  return ((row & ~15u) + 2 * (p & 7) + (p >> 3)) * RBK + o % RBK;
}
__device__ __forceinline__ constexpr uint32_t cpa_vsrc(uint32_t o) {
  const uint32_t w = vswz(o), row = w / RBV, p = row & 15;
  return ((row & ~15u) + 4 * (p & 3) + (p >> 2)) * RBV + w % RBV;
}
__device__ __forceinline__ constexpr uint32_t cpa_kimm(int i) { return cpa_ksrc(512u * i); }
__device__ __forceinline__ constexpr uint32_t cpa_vimm(int i) { return cpa_vsrc(512u * i); }
// the maps are affine in the bits i and l occupy (so lane part + cpa_?imm(i) is exact); spot checks:
static_assert(cpa_ksrc(512u + 16u * 31) == cpa_ksrc(16u * 31) + cpa_kimm(1), "K copy map not affine in i");
static_assert(cpa_vsrc(512u + 16u * 31) == cpa_vsrc(16u * 31) + cpa_vimm(1), "V copy map not affine in i");
static_assert(cpa_ksrc(3 * 512u + 16u * 13) == cpa_ksrc(16u * 13) + cpa_kimm(3), "K copy map not affine in i");
static_assert(cpa_vsrc(3 * 512u + 16u * 13) == cpa_vsrc(16u * 13) + cpa_vimm(3), "V copy map not affine in i");

struct CpaLane {  // a lane's fixed parts of its copies (page strides below 2^32 bytes: decode_cuda.py checks)
  const uint8_t *k, *v;         // source of its K / V granule of page 0, i = 0 (granule i: + cpa_kimm(i), ...)
  const uint8_t* meta[CP_NMI];  // its metadata granule i of page 0
  uint32_t mstr[CP_NMI];        // ... and that row's page stride in bytes
};

__device__ __forceinline__ void cpa_setup(CpaLane& cl, const Params& p, int h, int lane) {
  cl.k = reinterpret_cast<const uint8_t*>(p.kc) + h * p.s_kch + cpa_ksrc(16 * lane);
  cl.v = reinterpret_cast<const uint8_t*>(p.vc) + h * p.s_vch + cpa_vsrc(16 * lane);
  constexpr int RGV = PS * MSZ / 16, RGK = KMROW * MSZ / 16;  // granules per value / key metadata row
#pragma unroll
  for (int i = 0; i < CP_NMI; ++i) {
    const int g = min(32 * i + lane, CP_NMG - 1);
    int m, col;
    if (g < 2 * RGV) {
      m = g / RGV; col = g % RGV;
    } else {
      m = 2 + (g - 2 * RGV) / RGK; col = (g - 2 * RGV) % RGK;
    }
    const uint64_t base = m == 0 ? p.vs : m == 1 ? p.vo : m == 2 ? p.ks : p.ko;
    cl.meta[i] = reinterpret_cast<const uint8_t*>(base) + h * (m < 2 ? p.s_vmh : p.s_kmh) * (int64_t)MSZ + 16 * col;
    cl.mstr[i] = (uint32_t)((m < 2 ? p.s_vmp : p.s_kmp) * MSZ);
  }
}

// Issue the copies of physical page `page` into the stage at shared address `sdst` (not committed here); sl =
// sdst + 16 lane.
__device__ __forceinline__ void cpa_issue(const Params& p, const CpaLane& cl, uint32_t sl, int32_t page, int lane) {
  const uint64_t pu = (uint32_t)page;
  const uint8_t* kg = cl.k + pu * (uint32_t)p.s_kcp;  // one IMAD.WIDE.U32 each
  const uint8_t* vg = cl.v + pu * (uint32_t)p.s_vcp;
#pragma unroll
  for (int i = 0; i < CP_KNI; ++i)
    if (CP_KNG % 32 == 0 || 32 * i + lane < CP_KNG) cp16(sl + 512 * i, kg + cpa_kimm(i));
#pragma unroll
  for (int i = 0; i < CP_VNI; ++i)
    if (CP_VNG % 32 == 0 || 32 * i + lane < CP_VNG) cp16(sl + CP_KCODE + 512 * i, vg + cpa_vimm(i));
#pragma unroll
  for (int i = 0; i < CP_NMI; ++i)
    if (CP_NMG % 32 == 0 || 32 * i + lane < CP_NMG) cp16(sl + CP_MOFF + 512 * i, cl.meta[i] + pu * cl.mstr[i]);
}

// Chunk CH of a stage from shared memory; sk / sv / sm: the stage plus this thread's K / V / metadata offsets
template <int CH>
__device__ __forceinline__ void load_chunk_smem(Chunk2& c, const uint8_t* sk, const uint8_t* sv, const uint8_t* sm) {
#pragma unroll
  for (int r = 0; r < 2; ++r) ld_bytes<BPT>(c.k[r], sk + CH * 16 * RBK + 8 * r * RBK);
  constexpr int toks[4] = {0, 2, 1, 3};  // token 4 tig + toks[i]: row tig + 4 toks[i]
#pragma unroll
  for (int i = 0; i < 4; ++i) ld_bytes<BPV>(c.v[i], sv + CH * 16 * RBV + 4 * toks[i] * RBV);
  c.vs = *reinterpret_cast<const meta2_t*>(sm + M_VS + CH * 16 * MSZ);
  c.vo = *reinterpret_cast<const meta2_t*>(sm + M_VO + CH * 16 * MSZ);
#if !KCH_
  c.ks = *reinterpret_cast<const meta2_t*>(sm + M_KS + CH * 16 * MSZ);
  c.ko = *reinterpret_cast<const meta2_t*>(sm + M_KO + CH * 16 * MSZ);
#endif
}

// Channel-page keys: the page's Q' fragments (q' s_c / (2^KB)^j in float16) and sum_c q'_c o_c from its scale and
// offset rows (srow, orow: channel 0 of this head's rows, in a cp.async stage or in global memory; 16-byte
// aligned) and this thread's head row of the prescaled query (sq: float32, in shared memory). The d index of
// (k-step s, half hi2, element e) is d_of_k2: per field j the thread's BPT channels are contiguous.
__device__ __forceinline__ void channel_q(Q2& q, const uint8_t* srow, const uint8_t* orow, const float* sq,
                                          int tig) {
  constexpr int MW = BPT * MSZ / 4;  // 32-bit words of BPT metadata values
  float part = 0.f;
#pragma unroll
  for (int j = 0; j < 8 / KB; ++j) {
    const int d0 = tig * BPT + RBK * j;
    uint32_t sw[MW], ow[MW];
    ld_bytes<BPT * MSZ>(sw, srow + d0 * MSZ);
    ld_bytes<BPT * MSZ>(ow, orow + d0 * MSZ);
    float qv[BPT];
#pragma unroll
    for (int k = 0; k < BPT / 4; ++k) {
      const float4 t = reinterpret_cast<const float4*>(sq + d0)[k];
      qv[4 * k] = t.x; qv[4 * k + 1] = t.y; qv[4 * k + 2] = t.z; qv[4 * k + 3] = t.w;
    }
    const float inv = 1.f / float(1 << (KB * j));
#pragma unroll
    for (int wi = 0; wi < WPT; ++wi)
#pragma unroll
      for (int hi2 = 0; hi2 < 2; ++hi2) {
        const int a = 4 * wi + hi2, b = 4 * wi + 2 + hi2;  // elements e = 0, 1 (d_of_k2 - d0)
        q.qb[j * WPT + wi][hi2] = pack_h2(qv[a] * meta_word(sw, a) * inv, qv[b] * meta_word(sw, b) * inv);
      }
#pragma unroll
    for (int k = 0; k < BPT; ++k) part = fmaf(qv[k], meta_word(ow, k), part);
  }
  part += __shfl_xor_sync(0xffffffffu, part, 1);
  part += __shfl_xor_sync(0xffffffffu, part, 2);
#pragma unroll
  for (int e = 0; e < 2; ++e) q.kq[e] = __shfl_sync(0xffffffffu, part, (2 * (threadIdx.x & 3) + e) * 4) * (1.f / LS);
}

// LAZY: raise the reference maximum of heads (2tig, 2tig+1) to the warp's maximum score of this chunk (scores in
// units of 1 / LS; this thread's maxima mx0, mx1) and rescale what was accumulated against the old one. Only
// called when some lane has a score above its threshold t (warp-uniform).
__device__ __forceinline__ void lazy_raise(State& st, float (&osum)[2], float mx0, float mx1, float lv) {
  const float w[2] = {warp_max8(mx0), warp_max8(mx1)};
  float a[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float mn = fmaxf(st.m[e], fmaf(w[e], LS, lv));  // m includes log2(v_ref): p' = 2^(s - m) = p / v_ref
    a[e] = mn == -INFINITY ? 1.f : ex2(st.m[e] - mn);      // m = -inf at start: ex2(-inf) = 0
    st.m[e] = mn;
    st.t[e] = (mn - lv + LAZY_TAU) * (1.f / LS);           // p' <= 2^tau / v_ref until the next raise
    st.l[e] *= a[e];
    osum[e] *= a[e];
  }
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) {
    st.acc[mt][0] *= a[0]; st.acc[mt][1] *= a[1]; st.acc[mt][2] *= a[0]; st.acc[mt][3] *= a[1];
  }
}

template <bool MASKED>
__device__ __forceinline__ void chunk_quant(const Q2& q, const Chunk2& cur, State& st, float (&osum)[2], int left,
                                            int gid) {
  // ---- S^T = K Q'^T: key codes as float16 subnormals, field j of word wi at k-step j WPT + wi
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int s_ = 0; s_ < KS; ++s_) {
    const int j = s_ / WPT, wi = s_ % WPT;
    const uint32_t w0 = cur.k[0][wi], w1 = cur.k[1][wi];
    mma_f16(s, fieldj<KB>(w0, j), fieldj<KB>(w1, j), fieldj<KB>(w0 >> 8, j), fieldj<KB>(w1 >> 8, j), q.qb[s_][0],
            q.qb[s_][1]);
  }
#if KCH_
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] += q.kq[i & 1];  // units of 1 / LS
#else
  const float ks0 = meta_lo(cur.ks), ks1 = meta_hi(cur.ks), ko0 = meta_lo(cur.ko), ko1 = meta_hi(cur.ko);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = i >> 1, e = i & 1;
    s[i] = (r ? ks1 : ks0) * s[i] + (r ? ko1 : ko0) * q.kq[e];  // units of 1 / LS
  }
#endif
  float vs0 = meta_lo(cur.vs), vs1 = meta_hi(cur.vs), vo0 = meta_lo(cur.vo), vo1 = meta_hi(cur.vo);
  if (MASKED) {  // a sequence's last page: rows past the end, metadata included, count 0
    const bool ok0 = 2 * gid < left, ok1 = 2 * gid + 1 < left;
    s[0] = ok0 ? s[0] : -INFINITY; s[1] = ok0 ? s[1] : -INFINITY;
    s[2] = ok1 ? s[2] : -INFINITY; s[3] = ok1 ? s[3] : -INFINITY;
    vs0 = ok0 ? vs0 : 0.f; vo0 = ok0 ? vo0 : 0.f; vs1 = ok1 ? vs1 : 0.f; vo1 = ok1 ? vo1 : 0.f;
  }
  {
    const float mx0 = fmaxf(s[0], s[2]), mx1 = fmaxf(s[1], s[3]);
    if (__any_sync(0xffffffffu, mx0 > st.t[0] || mx1 > st.t[1])) lazy_raise(st, osum, mx0, mx1, q.lv);
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = ex2(fmaf(s[i], LS, -st.m[i & 1]));  // p' = p / v_ref <= 2^tau / v_ref
    st.l[0] += s[0] + s[2];
    st.l[1] += s[1] + s[3];
    osum[0] = fmaf(s[0], vo0, fmaf(s[2], vo1, osum[0]));
    osum[1] = fmaf(s[1], vo0, fmaf(s[3], vo1, osum[1]));
  }
  const uint32_t pb0 = movtrans(pack_h2(s[0] * vs0, s[1] * vs0));
  const uint32_t pb1 = movtrans(pack_h2(s[2] * vs1, s[3] * vs1));
  // ---- O^T += V^T P'^T, V^T from the codes of tokens (2tig, 2tig+1) and (2tig+8, 2tig+9), exact
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) {
    const int j = mt / VH, q2 = mt % VH;  // field, pair of bytes (2 q2, 2 q2 + 1) of the thread's slice
    uint32_t a[4];
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      const int wv = (2 * q2) / 4, sel = ((2 * q2) % 4) ? 0x7632 : 0x5410;
      const uint32_t x = BPV == 2 ? (cur.v[2 * pr][0] | (cur.v[2 * pr + 1][0] << 16))
                                  : __byte_perm(cur.v[2 * pr][wv], cur.v[2 * pr + 1][wv], sel);
      a[2 * pr] = fieldj<VB>(x, j);
      a[2 * pr + 1] = fieldj<VB>(x >> 8, j);
    }
    mma_f16(st.acc[mt], a[0], a[1], a[2], a[3], pb0, pb1);
  }
}

// Chunks CH.. of page pp (chunk CH in buf[(START + CH) % 2], already loaded); prefetches the following chunk (of
// this page, or chunk 0 of the warp's next page) before the math of the current one.
template <bool MASKED, int START, int CH>
__device__ __forceinline__ void page_chunks(const Q2& q, Chunk2 (&buf)[2], State& st, float (&osum)[2],
                                            const Params& p, const Bases2& bs, PagePtrs& pp, int page_next,
                                            bool has_next, int left, int gid) {
  constexpr int cur = (START + CH) & 1, nxt = cur ^ 1;
  if constexpr (CH + 1 < CPP) {
    load_chunk_page<CH + 1>(buf[nxt], pp);
  } else {  // the next page's pointers only now, so that two pages' pointers are never live together
    pp = page_ptrs(p, bs, page_next);
    if (has_next) load_chunk_page<0>(buf[nxt], pp);
  }
  if constexpr (L2PF_ && CH == (CPP > 1 ? 1 : 0))  // the page id was loaded a chunk ago (0 past the last)
    l2_prefetch_page(p, bs, page_next, (int)(threadIdx.x & 31));
  if (!MASKED || 16 * CH < left) chunk_quant<MASKED>(q, buf[cur], st, osum, left - 16 * CH, gid);
  if constexpr (CH + 1 < CPP)
    page_chunks<MASKED, START, CH + 1>(q, buf, st, osum, p, bs, pp, page_next, has_next, left, gid);
}

// One page of a warp (its first chunk in buf[START]); advances pp/pg to the warp's next page, false when none.
// Channel-page keys: the page's Q' first, from its metadata rows in global memory (asked into L2 a page ahead).
template <int START>
__device__ __forceinline__ bool page_reg(Q2& q, Chunk2 (&buf)[2], State& st, float (&osum)[2], const Params& p,
                                         const Bases2& bs, const int32_t* bt, PagePtrs& pp, int& pg, int p_end,
                                         int hi, int gid, int tig, const float* sq) {
#if KCH_
  channel_q(q, reinterpret_cast<const uint8_t*>(pp.ks), reinterpret_cast<const uint8_t*>(pp.ko), sq, tig);
#endif
  const int pg_next = pg + NW;
  const bool has_next = pg_next < p_end;
  const int page_next = has_next ? bt[pg_next] : 0;
  const int left = hi - pg * PS;
  if (left >= PS) page_chunks<false, START, 0>(q, buf, st, osum, p, bs, pp, page_next, has_next, left, gid);
  else page_chunks<true, START, 0>(q, buf, st, osum, p, bs, pp, page_next, has_next, left, gid);
  pg = pg_next;
  return has_next;
}

// CPA_: one page of a warp from its shared-memory stage sb (copies complete and visible to the warp); with L2PF_,
// page pf_page (the next one to be copied) is asked into L2 before the last chunk.
template <bool MASKED>
__device__ __forceinline__ void page_cpa(Q2& q, State& st, float (&osum)[2], const Params& p, const Bases2& bs,
                                         const uint8_t* sb, uint32_t kr, uint32_t vr, uint32_t mr, int32_t pf_page,
                                         int left, int gid, int tig, const float* sq) {
#if KCH_
  channel_q(q, sb + CP_MOFF + M_KS, sb + CP_MOFF + M_KO, sq, tig);
#endif
#pragma unroll
  for (int ch = 0; ch < CPP; ++ch) {
    if (L2PF_ && ch == CPP - 1) l2_prefetch_page(p, bs, pf_page, (int)(threadIdx.x & 31));
    if (!MASKED || 16 * ch < left) {
      Chunk2 c;
      switch (ch) {  // compile-time offsets (ch is a constant after unrolling)
#define OSCAR_LCS(n) case n: load_chunk_smem<n>(c, sb + kr, sb + CP_KCODE + vr, sb + CP_MOFF + mr); break;
        OSCAR_LCS(0) OSCAR_LCS(1) OSCAR_LCS(2) OSCAR_LCS(3) OSCAR_LCS(4) OSCAR_LCS(5) OSCAR_LCS(6) OSCAR_LCS(7)
        OSCAR_LCS(8) OSCAR_LCS(9) OSCAR_LCS(10) OSCAR_LCS(11) OSCAR_LCS(12) OSCAR_LCS(13) OSCAR_LCS(14) OSCAR_LCS(15)
#undef OSCAR_LCS
        default: break;
      }
      chunk_quant<MASKED>(q, c, st, osum, left - 16 * ch, gid);
    }
  }
}
static_assert(!CPA_ || CPP <= 16, "CPA_: pages of at most 256 tokens");

// The quantized tokens [lo, hi) of sequence b, KV head h: this warp's pages (page-interleaved over the warps; a
// split starts on a page boundary). Accumulates into st and osum; vref: what the accumulators are multiplied by
// at the end. sq: the prescaled query rows in shared memory (channel-page keys).
__device__ void run_quant(const Params& p, State& st, float (&osum)[2], float& vref, int b, int h, int lo, int hi,
                          int warp, int gid, int tig, const float* sq) {
  Q2 q;
#if !KCH_
  {  // Q' fragments: b0/b1 of k-step s for head gid; per-head sums for heads 2tig, 2tig+1
    const q_t* qrow = reinterpret_cast<const q_t*>(p.q) + b * p.sq_b + (int64_t)(h * GQ + gid) * p.sq_h;
    const float sc = (float)p.sm_scale_log2;
    float qsum_part = 0.f;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const float inv = 1.f / float(1 << (KB * (s / WPT)));
#pragma unroll
      for (int hi2 = 0; hi2 < 2; ++hi2) {
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          v[e] = gid < GQ ? q_f(qrow[d_of_k2(s, tig, e, hi2)]) * sc * inv : 0.f;
          v[e] = __half2float(__float2half_rn(v[e]));
          qsum_part += v[e] / inv;
        }
        q.qb[s][hi2] = pack_h2(v[0], v[1]);
      }
    }
    qsum_part += __shfl_xor_sync(0xffffffffu, qsum_part, 1);
    qsum_part += __shfl_xor_sync(0xffffffffu, qsum_part, 2);
#pragma unroll
    for (int e = 0; e < 2; ++e) q.kq[e] = __shfl_sync(0xffffffffu, qsum_part, (2 * tig + e) * 4) * (1.f / LS);
  }
#endif
  const int32_t* bt = reinterpret_cast<const int32_t*>(p.bt) + b * p.s_bt;
  const int p_end = (hi + PS - 1) / PS;
  int pg = lo / PS + warp;
  if (lo >= hi || pg >= p_end) return;
  Bases2 bs;
  bs.k = h * p.s_kch + 2 * gid * RBK + tig * BPT;
  bs.v = h * p.s_vch + 4 * tig * RBV + gid * BPV;
  bs.m = h * p.s_kmh + (KCH_ ? 0 : 2 * gid);
  bs.h = h;
  l2pf_bases(bs, p, h, 4 * gid + tig);
#if CPA_
  // this warp's pages pg + k NW, k < npg: page k in stage k % 2. Both stages are filled at once (pages 0 and 1),
  // so a split of few pages never waits for a page it could have asked for earlier; page k + 2 is copied into
  // page k's stage as soon as page k is computed (one commit group per page, empty groups past the last so that
  // the counts stay uniform)
  const int npg = (p_end - pg + NW - 1) / NW, lane = 4 * gid + tig;
  CpaLane cl;
  cpa_setup(cl, p, h, lane);
  uint8_t* const wreg = dsm + warp * CP_WREG;
  const uint32_t sw = (uint32_t)__cvta_generic_to_shared(wreg) + 16 * lane;  // + this lane's copy slot
  const uint32_t kr = gid * RBK + tig * BPT, vr = vswz(tig * RBV + gid * BPV), mr = 2 * gid * MSZ;
  cpa_issue(p, cl, sw, bt[pg], lane);
  cp_commit();
  if (1 < npg) cpa_issue(p, cl, sw + CP_STG, bt[pg + NW], lane);
  cp_commit();
  cp_wait<1>();  // page 0 has landed (page 1 may be pending)
  __syncwarp();
  {  // reference V scale (valid rows of the first chunk): keeps p * s_v / v_ref inside float16's normal range
    const int left = hi - pg * PS;
    const meta2_t vs = *reinterpret_cast<const meta2_t*>(wreg + CP_MOFF + M_VS + mr);
    const float a = 2 * gid < left ? meta_lo(vs) : 0.f, c = 2 * gid + 1 < left ? meta_hi(vs) : 0.f;
#else
  Chunk2 buf[2];
  PagePtrs pp = page_ptrs(p, bs, bt[pg]);
  load_chunk_page<0>(buf[0], pp);
  {  // reference V scale (valid rows of the first chunk): keeps p * s_v / v_ref inside float16's normal range
    const int left = hi - pg * PS;
    const float a = 2 * gid < left ? meta_lo(buf[0].vs) : 0.f, c = 2 * gid + 1 < left ? meta_hi(buf[0].vs) : 0.f;
#endif
    const float vm = warp_max8(fmaxf(a, c));
    vref = (vm > 0.f && vm < 3.0e38f) ? vm : 1.f;
    q.lv = __log2f(vref);  // any value near log2(v_ref) will do (it only shifts the reference maximum)
    // the partial output, l and osum are all in units of 1 / v_ref (in m); the value codes carry 2^-24
    vref = LS;
  }
#if CPA_
  uint32_t rd = 0;                            // stage offset of page k (page k + 1 in the other stage)
  const int32_t* btn = bt + pg + 2 * NW;      // block-table entry of page k + 2
  int32_t id_n = 2 < npg ? *btn : 0;          // page k + 2: copied once page k is computed
  int left = hi - pg * PS;                    // tokens of the split from page k on
  for (int c = npg;; --c) {                   // c = npg - k pages left, this one included; page k has landed
    const int32_t id_3 = c > 3 ? btn[NW] : 0;  // page k + 3, read a page before it is needed
    if (left >= PS) page_cpa<false>(q, st, osum, p, bs, wreg + rd, kr, vr, mr, id_n, left, gid, tig, sq);
    else page_cpa<true>(q, st, osum, p, bs, wreg + rd, kr, vr, mr, id_n, left, gid, tig, sq);
    __syncwarp();  // every lane has read stage rd before the copies of page k + 2 overwrite it
    if (c == 1) break;
    if (c > 2) cpa_issue(p, cl, sw + rd, id_n, lane);  // page k + 2, into the stage page k left
    cp_commit();
    cp_wait<1>();  // page k + 1 has landed (only the newest group, page k + 2, may be pending)
    __syncwarp();  // ... for every lane's copies
    id_n = id_3;
    btn += NW;
    left -= NW * PS;
    rd = CP_STG - rd;
  }
  cp_wait<0>();  // only empty groups can be left; the region then holds the partial outputs
  __syncwarp();
#else
  while (true) {  // CPP odd: a chunk's buffer alternates between pages, so pages go in pairs
    if (!page_reg<0>(q, buf, st, osum, p, bs, bt, pp, pg, p_end, hi, gid, tig, sq)) break;
    if constexpr (CPP % 2 == 1) {
      if (!page_reg<1>(q, buf, st, osum, p, bs, bt, pp, pg, p_end, hi, gid, tig, sq)) break;
    }
  }
#endif
}
