// OSCAR 2-bit paged decode attention, CUDA C++ (sm_80+, mma.sync m16n8k16 + movmatrix).
//
// One CTA = one (split, sequence, KV head); its NW warps take 16-token chunks of the split in turn and keep
// their own online softmax; the CTA merges its warps and writes one partial output + log-sum-exp (base 2) per
// query head; a second kernel merges the splits. Layout: oscarkv/kernels/layout.py; design: docs/kernels.md.
//
// 2-bit splits. S^T[tok, head] = K[tok, :] . Q'^T with K = the codes themselves (the A operand, unpacked
// straight into mma fragments: one prmt + one lop3 per two codes, the code ORed into the mantissa of 1024.0
// "in place", i.e. field j contributes 1024 + 4^j c), Q' = q * scale * log2(e) / 4^j (the B operand, built
// once), so logit = s_t (S - 1024 sum Q') + o_t sum q. The GQA heads are the mma's N = 8 columns.
// O^T[d, head] += V^T[d, tok] . P'^T[tok, head] with P' = p * s_v / v_ref (movmatrix turns the S^T
// accumulator into the B fragment) and V^T the exact codes (4^j c, one extra sub.f16x2 per two codes);
// the offsets enter through sum_t p_t o_t. 16-bit splits: the same structure on the bf16/fp16 tiers, with
// q split into high and low 16-bit parts.
//
// Compile-time constants (nvcc -D...): D_ head_dim (64/128/256), GQ_ heads per KV head (1..8), PS_ page size
// (multiple of 16), NW_ warps per CTA, QT_ query dtype (0 f32, 1 f16, 2 bf16), T16_ 16-bit tier dtype
// (1 f16, 2 bf16), MT_ metadata dtype (1 f16, 2 bf16, 0 f32).
// Variants of the 2-bit loop (0 = off, the default; decode_cuda.py's `variant=` selects them):
//   SUBN_ = 1: the codes enter the mma as float16 *subnormals* (field j masked in place, no 1024.0 OR-ed in:
//     value 4^j c 2^-24, exact) instead of 1024 + 4^j c. No bias to remove: the V side loses its sub.f16x2 per
//     two codes (32 per 16-token chunk at d = 128), the K side its per-score bias FFMA; the 2^24 is folded into
//     the scores' scale and the output's. Needs the tensor cores to take float16 subnormal inputs as they are.
//   LAZY_ = 1: lazy softmax maximum. A warp's reference maximum m is raised (a warp-wide max reduction, the
//     rescale of l, osum and the accumulators) only when some score exceeds it by more than 2^LAZY_TAU_ in
//     probability (LAZY_TAU_ log2 units, default 3); otherwise a chunk costs no shuffle, no alpha and no
//     rescale, and the weights p stay <= 2^LAZY_TAU_. log2(v_ref) rides in m, so P' = p s_v needs no 1 / v_ref.
//   L2PF_ = 1: while a warp works on a page (from its second chunk), it asks for its next page (K and V codes,
//     the four metadata rows of its KV head) to be brought into L2: prefetch.global.L2, one line per lane, two
//     instructions per page at d = 128 (a hint: no registers, nothing to wait for), so that more bytes are in
//     flight than the one-chunk register prefetch holds (16 warps x 1.15 KB per SM). (A bulk prefetch takes
//     uniform operands: ptxas loops over the lanes, ~50 instructions per page.)
//   CPA_ = 2 or 3: a per-warp cp.async pipeline of CPA_ page stages in shared memory instead of the one-chunk
//     register prefetch: while a warp works on its page k, pages k + 1 .. k + CPA_ - 1 (K and V codes and the four
//     metadata rows of its KV head, 16-byte cp.async.cg per lane, one commit group per page) are in flight, i.e.
//     4.6 KB (CPA_ = 2) or 9.2 KB (3) per warp at d = 128 / 64-token pages instead of one 1.15 KB chunk; the block
//     table entry of a page is read one page before its copy is issued. The chunk operands are then read from
//     shared memory (ld.shared, as many as the global loads they replace), conflict-free: K rows are stored in
//     mma-row order (token 2i + e at row i + 8e of its chunk), V rows transposed by 4 (token 4a + b at row a + 4b;
//     at d = 256 one extra granule swizzle). The stages live in dynamic shared memory (decode_cuda.py passes
//     NW * CP_WREG bytes; the kernel traps on less) and are reused for the per-warp partial outputs at the end.
//     With L2PF_, the L2 prefetch goes to page k + CPA_, the one after those in flight.
//   QK2_ = 1: the QK product of a chunk accumulates its k-steps in two independent mma chains (even / odd), added
//     at the end (4 FADD): halves the dependent HMMA chain (8 -> 4) in front of the softmax of every chunk.
//   PDL_ = 1: programmatic dependent launch of the merge kernel: each split CTA signals
//     griddepcontrol.launch_dependents at its start, the merge kernel (launched by decode_cuda.py with the
//     programmatic-stream-serialization attribute) waits in griddepcontrol.wait for the split grid to complete,
//     so its launch and prologue overlap the split kernel's tail (no effect on the fused merge); the merge kernel
//     in turn signals launch_dependents after its wait, so that a programmatic dependent after it (the engine's
//     next kernel) can start its prologue during the merge.
//   PDLW_ = 1: the split kernel is itself launched as a programmatic dependent of the kernel before it: it waits
//     (griddepcontrol.wait) before its first global memory access, so its launch overlaps that kernel's tail
//     (EARLY_: the hints below excepted).
//   EARLY_ = 1 (with L2PF_): at its start, before the Q setup (and before the PDLW_ wait), each warp of a 2-bit
//     split asks for its first two pages to be brought into L2 (the same per-lane prefetch.global.L2), reading
//     the sequence length and block-table entries it needs through L2 (ld.global.cg: no stale L1 line for the
//     loads after the wait). Only hints: a stale entry prefetches a wrong page, never changes a result. Without
//     it a warp's first page is the only one whose chunk loads wait for DRAM (a batch-1 warp walks ~8 pages).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#ifndef D_
#define D_ 128
#endif
#ifndef GQ_
#define GQ_ 4
#endif
#ifndef PS_
#define PS_ 64
#endif
#ifndef NW_
#define NW_ 4
#endif
#ifndef QT_
#define QT_ 2
#endif
#ifndef T16_
#define T16_ 2
#endif
#ifndef MT_
#define MT_ 1
#endif
#ifndef SUBN_
#define SUBN_ 0
#endif
#ifndef LAZY_
#define LAZY_ 0
#endif
#ifndef LAZY_TAU_
#define LAZY_TAU_ 3
#endif
#ifndef L2PF_
#define L2PF_ 0
#endif
#ifndef CPA_
#define CPA_ 0
#endif
#ifndef QK2_
#define QK2_ 0
#endif
#ifndef PDLW_
#define PDLW_ 0
#endif
#ifndef PDL_
#define PDL_ 0
#endif
#ifndef EARLY_
#define EARLY_ 0
#endif
static_assert(!EARLY_ || L2PF_, "EARLY_ needs L2PF_ (its per-lane page prefetch)");
static_assert(CPA_ == 0 || CPA_ == 2 || CPA_ == 3, "CPA_: 0 (register prefetch), 2 or 3 shared-memory stages");

constexpr int D = D_, GQ = GQ_, PS = PS_, NW = NW_;
constexpr int KS = D / 16;   // k-steps of the QK product, m-tiles of the PV product
constexpr int RB = D / 4;    // bytes per packed row
constexpr int BPT = D / 16;  // K bytes per thread per token (A fragment: 4 threads share a row)
constexpr int WPT = BPT / 4; // ... in 32-bit words (D = 64 -> 1)
constexpr int BPV = D / 32;  // V bytes per thread per token (8 threads share a row)
static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
static_assert(GQ >= 1 && GQ <= 8, "at most 8 query heads per KV head");
static_assert(PS % 16 == 0, "page size must be a multiple of 16");

struct Params {  // every field 8 bytes: the ctypes mirror in decode_cuda.py is trivial
  uint64_t q, kc, vc, ks, ko, vs, vo, bt, qlen, k16, v16, len16, o_part, lse_part;
  int64_t sq_b, sq_h, s_cp, s_ch, s_mp, s_mh, s_bt, s16_b, s16_h, s16_t;
  int64_t so_b, so_h, so_s, sl_b, sl_h, hkv, tok_per_split, num_qsplits, tok16_per_split;
  double sm_scale_log2;
  int64_t magic;  // 0x64006400 (float16 1024.0 twice), passed at run time so it stays in a register
  // fused merge (merge_splits > 0): the last CTA of each (sequence, KV head) to finish merges its splits into
  // out, found through a per-(sequence, KV head) ticket counter that it resets to 0 for the next launch
  uint64_t counters, out;
  int64_t merge_splits, sout_b, sout_h, out_dtype;  // out_dtype: 0 f32, 1 f16, 2 bf16
  // a sequence's 2-bit split length (split_tokens): granule and least split in pages; tok_per_split is the most
  int64_t gran_pages, least_pages;
};

// 2-bit tokens per split of a sequence whose 2-bit tier holds n tokens (DecodePlan.split_tokens, the host
// reference): its pages spread over all num_qsplits splits in whole granules, at least least_pages, at most the
// plan's tok_per_split. So a sequence shorter than the plan's bound (a CUDA graph plans for the block table's
// capacity) still uses every split instead of the first few.
__device__ __forceinline__ int split_tokens(const Params& p, int n) {
  const int nq = (int)p.num_qsplits, g = (int)p.gran_pages;
  const int want = ((n + PS - 1) / PS + nq - 1) / nq;
  return min(max((want + g - 1) / g * g, (int)p.least_pages), (int)p.tok_per_split / PS) * PS;
}

#if MT_ == 1
typedef __half meta_t;
__device__ __forceinline__ float meta_f(meta_t x) { return __half2float(x); }
#elif MT_ == 2
typedef __nv_bfloat16 meta_t;
__device__ __forceinline__ float meta_f(meta_t x) { return __bfloat162float(x); }
#else
typedef float meta_t;
__device__ __forceinline__ float meta_f(meta_t x) { return x; }
#endif

#if QT_ == 0
typedef float q_t;
__device__ __forceinline__ float q_f(q_t x) { return x; }
#elif QT_ == 1
typedef __half q_t;
__device__ __forceinline__ float q_f(q_t x) { return __half2float(x); }
#else
typedef __nv_bfloat16 q_t;
__device__ __forceinline__ float q_f(q_t x) { return __bfloat162float(x); }
#endif

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t movtrans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}
__device__ __forceinline__ void mma_f16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                        uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <bool BF>
__device__ __forceinline__ void mma16(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                      uint32_t b0, uint32_t b1) {
  if constexpr (BF) mma_bf16(c, a0, a1, a2, a3, b0, b1); else mma_f16(c, a0, a1, a2, a3, b0, b1);
}
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_b2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <bool BF>
__device__ __forceinline__ uint32_t pack16(float lo, float hi) { return BF ? pack_b2(lo, hi) : pack_h2(lo, hi); }
__device__ __forceinline__ uint32_t hsub1024(uint32_t x) {  // exact: (1024 + m c) - 1024 in both halves
  __half2 h = __hsub2(*reinterpret_cast<__half2*>(&x), __half2(__float2half(1024.f), __float2half(1024.f)));
  return *reinterpret_cast<uint32_t*>(&h);
}
// (x & mask) | magic in one LOP3 (the compiler splits it in two when both are immediates)
template <uint32_t MASK>
__device__ __forceinline__ uint32_t field16(uint32_t x, uint32_t magic) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(r) : "r"(x), "n"(MASK), "r"(magic));
  return r;
}
__device__ __forceinline__ uint32_t fieldj(uint32_t x, int j, uint32_t magic) {  // j folds after unrolling
#if SUBN_  // the field alone: a float16 subnormal 4^j c 2^-24 in each half (one LOP3 with an immediate)
  switch (j) {
    case 0: return x & 0x00030003u;
    case 1: return x & 0x000c000cu;
    case 2: return x & 0x00300030u;
    default: return x & 0x00c000c0u;
  }
#endif
  switch (j) {
    case 0: return field16<0x00030003u>(x, magic);
    case 1: return field16<0x000c000cu>(x, magic);
    case 2: return field16<0x00300030u>(x, magic);
    default: return field16<0x00c000c0u>(x, magic);
  }
}

__device__ __forceinline__ float warp_max8(float x) {  // max over the 8 lanes that share lane & 3
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float warp_sum8(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// Loads of one 16-token chunk for the 2-bit path (register prefetch of the next chunk).
// Token order inside a 16-token chunk: mma row i of S^T holds token 2i (i < 8) or 2(i - 8) + 1, so a thread's
// two rows (gid, gid + 8) are the adjacent tokens 2gid, 2gid + 1 and each metadata pair is one 32-bit load.
#if MT_ == 0
typedef float2 meta2_t;
__device__ __forceinline__ float meta_lo(meta2_t x) { return x.x; }
__device__ __forceinline__ float meta_hi(meta2_t x) { return x.y; }
#elif MT_ == 1
typedef __half2 meta2_t;
__device__ __forceinline__ float meta_lo(meta2_t x) { return __low2float(x); }
__device__ __forceinline__ float meta_hi(meta2_t x) { return __high2float(x); }
#else
typedef __nv_bfloat162 meta2_t;
__device__ __forceinline__ float meta_lo(meta2_t x) { return __low2float(x); }
__device__ __forceinline__ float meta_hi(meta2_t x) { return __high2float(x); }
#endif

struct Chunk2 {
  uint32_t k[2][WPT > 0 ? WPT : 1];  // tokens 2gid, 2gid + 1: bytes [tig * BPT, +BPT)
  uint32_t v[4][BPV >= 4 ? BPV / 4 : 1];  // tokens 4tig + {0, 2, 1, 3} (mma k = 2tig, 2tig+1, 2tig+8, 2tig+9)
  meta2_t ks, ko, vs, vo;                 // tokens 2gid, 2gid + 1
};

// Per-thread offsets of one (sequence, KV head) from the pools' base pointers, the lane's fixed part folded in
// (bytes for codes, elements for metadata); the base pointers themselves stay in the constant bank.
struct Bases2 {
  int64_t k, v, m;
#if L2PF_
  const uint8_t *pfc, *pfm;  // L2PF_: this lane's lines of page pg: pfc + pg s_cp (+ 2 KB steps), pfm + pg s_mp
#endif
};

// L2PF_: ask for physical page `page` (this head's K and V codes and four metadata rows) to be brought into L2:
// per-lane prefetch.global.L2 of one 128-byte line each (a hint: no register, nothing to wait for). Lanes 0..15
// take the K lines, 16..31 the V lines (16 lines per instruction each); for metadata lane l takes row l & 3 at
// byte min(128 (l >> 2), row bytes - 1), so a row of up to 1 KB is covered whatever its alignment.
constexpr int PF_LINES = PS * RB / 128;  // 128-byte lines of a page's codes per KV head (>= 2)
constexpr int PF_META = PS * (int)sizeof(meta_t);
// `lane` is only read when PF_LINES % 16 != 0 (some lanes then have no line of their own).
__device__ __forceinline__ void l2_prefetch_page(const Params& p, const Bases2& bs, int32_t page, int lane) {
#if L2PF_
  // page strides below 2^32 bytes (decode_cuda.py checks it for this variant): one IMAD.WIDE.U32 per address
  const uint8_t* c = bs.pfc + (uint64_t)(uint32_t)page * (uint32_t)p.s_cp;
#pragma unroll
  for (int i = 0; i < (PF_LINES + 15) / 16; ++i)
    if (PF_LINES % 16 == 0 || (lane & 15) + 16 * i < PF_LINES)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(c + i * 16 * 128));
  const uint8_t* m = bs.pfm + (uint64_t)(uint32_t)page * (uint32_t)(p.s_mp * (int64_t)sizeof(meta_t));
  asm volatile("prefetch.global.L2 [%0];" ::"l"(m));
#endif
}

// L2PF_: this lane's prefetch lines of KV head h (page 0; l2_prefetch_page adds the page)
__device__ __forceinline__ void l2pf_bases(Bases2& bs, const Params& p, int h, int lane) {
#if L2PF_
  bs.pfc = reinterpret_cast<const uint8_t*>(lane < 16 ? p.kc : p.vc) + h * p.s_ch + (lane & 15) * 128;
  const uint64_t mb = (lane & 3) == 0 ? p.ks : (lane & 3) == 1 ? p.ko : (lane & 3) == 2 ? p.vs : p.vo;
  bs.pfm = reinterpret_cast<const uint8_t*>(mb) + h * p.s_mh * (int64_t)sizeof(meta_t) +
           min(128 * (lane >> 2), PF_META - 1);
#endif
}

// EARLY_: L2 prefetch of this warp's first two pages of 2-bit split `split` (hints; see the header)
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
// chunk's loads need no address arithmetic of their own (docs/kernels.md: the loop was issue-bound on it).
struct PagePtrs {
  const uint8_t *k, *v;
  const meta_t *ks, *ko, *vs, *vo;
};

__device__ __forceinline__ PagePtrs page_ptrs(const Params& p, const Bases2& bs, int32_t page) {
  const int64_t co = (int64_t)page * p.s_cp, mo = bs.m + (int64_t)page * p.s_mp;
  return {reinterpret_cast<const uint8_t*>(p.kc) + bs.k + co, reinterpret_cast<const uint8_t*>(p.vc) + bs.v + co,
          reinterpret_cast<const meta_t*>(p.ks) + mo, reinterpret_cast<const meta_t*>(p.ko) + mo,
          reinterpret_cast<const meta_t*>(p.vs) + mo, reinterpret_cast<const meta_t*>(p.vo) + mo};
}

// Unmasked loads of chunk CH (16 rows) of a page: rows past a sequence's end are still inside the page, so the
// loads are in bounds; their (possibly NaN) metadata is masked where it is used (chunk_2bit).
template <int CH>
__device__ __forceinline__ void load_chunk_page(Chunk2& c, const PagePtrs& pp) {
  const uint8_t* kb = pp.k + CH * 16 * RB;
  const uint8_t* vb = pp.v + CH * 16 * RB;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint8_t* src = kb + r * RB;
    if constexpr (WPT == 1) c.k[r][0] = *reinterpret_cast<const uint32_t*>(src);
    if constexpr (WPT == 2) { uint2 w = *reinterpret_cast<const uint2*>(src); c.k[r][0] = w.x; c.k[r][1] = w.y; }
    if constexpr (WPT == 4) {
      uint4 w = *reinterpret_cast<const uint4*>(src);
      c.k[r][0] = w.x; c.k[r][1] = w.y; c.k[r][2] = w.z; c.k[r][3] = w.w;
    }
  }
  constexpr int toks[4] = {0, 2, 1, 3};  // + 4 tig, folded into the page pointer
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint8_t* src = vb + toks[i] * RB;
    if constexpr (BPV == 2) c.v[i][0] = *reinterpret_cast<const uint16_t*>(src);
    if constexpr (BPV == 4) c.v[i][0] = *reinterpret_cast<const uint32_t*>(src);
    if constexpr (BPV == 8) { uint2 w = *reinterpret_cast<const uint2*>(src); c.v[i][0] = w.x; c.v[i][1] = w.y; }
  }
  c.ks = *reinterpret_cast<const meta2_t*>(pp.ks + CH * 16);
  c.ko = *reinterpret_cast<const meta2_t*>(pp.ko + CH * 16);
  c.vs = *reinterpret_cast<const meta2_t*>(pp.vs + CH * 16);
  c.vo = *reinterpret_cast<const meta2_t*>(pp.vo + CH * 16);
}

// ---- CPA_: per-warp cp.async page stages in shared memory (see the header). One stage = one page of one KV
// head: [K codes: PS rows of RB][V codes: PS rows of RB][ks, ko, vs, vo rows: PS metadata each]. Rows of a
// 16-token chunk are permuted (granules of 16 bytes move, never bytes) so that a thread's reads are at
// lane-constant offsets plus compile-time ones and a warp's ld.shared are bank-conflict-free:
//   K: token 2i + e of the chunk at row i + 8e: thread (gid, tig) reads rows gid, gid + 8 at byte tig * BPT.
//   V: token 4a + b at row a + 4b: thread reads rows tig + 4b (b = 0..3) at byte gid * BPV (d = 256: bit 5 of
//      the in-stage offset is XORed with bit 7, because 16 threads of an 8-byte load cover only 2 of the 4
//      32-byte bank groups of a 64-byte row otherwise).
//   metadata: natural order (a thread's pair of adjacent tokens is one 32-bit read, broadcast over tig).
constexpr int MSZ = (int)sizeof(meta_t);
constexpr int CP_CODE = PS * RB;               // bytes of one page's K (or V) codes of one KV head
constexpr int CP_META = 4 * PS * MSZ;          // its four metadata rows
constexpr int CP_STG = 2 * CP_CODE + CP_META;  // one stage (a multiple of 128 bytes)
constexpr int SMO_BYTES = 8 * D * 4;           // a warp's unnormalised partial outputs at the end
constexpr int cmax(int a, int b) { return a > b ? a : b; }
// bytes of shared memory per warp (the stages, reused for the partial outputs): decode_cuda.py mirrors this
constexpr int CP_WREG = (cmax(CPA_ * CP_STG, SMO_BYTES) + 127) / 128 * 128;
constexpr int CP_NCG = CP_CODE / 16, CP_NCI = (CP_NCG + 31) / 32;  // 16-byte granules of K (V), per lane
constexpr int CP_NMG = CP_META / 16, CP_NMI = (CP_NMG + 31) / 32;  // ... of the metadata
static_assert(CP_STG % 128 == 0, "stage size");

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
  return D == 256 ? off ^ (((off >> 7) & 1u) << 5) : off;
}

// Copies: lane l writes the stage's 16-byte granules 32 i + l of each part (K, V, metadata: in-stage offset
// 16 l + 512 i), so the permutation is on the source side, in the lane's fixed source offset: the granule at
// stage offset o of the K (V) part holds row tok(o / RB) (granule (o % RB) / 16) of the page, with (in a chunk)
// K: row p <- token 2 (p & 7) + (p >> 3); V: row p <- token 4 (p & 3) + (p >> 2) (and at d = 256 the granule of
// vswz(o)). For granule 32 i + l the source row is the lane's plus a compile-time part (cpa_ksrc / cpa_vsrc).
__device__ __forceinline__ constexpr uint32_t cpa_ksrc(uint32_t o) {  // page byte offset of K granule at o
  const uint32_t row = o / RB, p = row & 15;
  return ((row & ~15u) + 2 * (p & 7) + (p >> 3)) * RB + o % RB;
}
__device__ __forceinline__ constexpr uint32_t cpa_vsrc(uint32_t o) {
  const uint32_t w = vswz(o), row = w / RB, p = row & 15;
  return ((row & ~15u) + 4 * (p & 3) + (p >> 2)) * RB + w % RB;
}
// granule 32 i + l: source = lane part (i = 0) + cpa_?imm(i), exactly (checked by static_asserts below for l = 0
// and, the maps being affine in the bits i and l occupy, for every lane)
__device__ __forceinline__ constexpr uint32_t cpa_kimm(int i) { return cpa_ksrc(512u * i); }
__device__ __forceinline__ constexpr uint32_t cpa_vimm(int i) { return cpa_vsrc(512u * i); }
static_assert(cpa_ksrc(512u + 16u * 31) == cpa_ksrc(16u * 31) + cpa_kimm(1), "K copy map not affine in i");
static_assert(cpa_vsrc(512u + 16u * 31) == cpa_vsrc(16u * 31) + cpa_vimm(1), "V copy map not affine in i");
static_assert(cpa_ksrc(3 * 512u + 16u * 13) == cpa_ksrc(16u * 13) + cpa_kimm(3), "K copy map not affine in i");
static_assert(cpa_vsrc(3 * 512u + 16u * 13) == cpa_vsrc(16u * 13) + cpa_vimm(3), "V copy map not affine in i");

struct CpaLane {  // a lane's fixed parts of its copies (page strides below 2^32 bytes: decode_cuda.py checks)
  const uint8_t *k, *v;         // source of its K / V granule of page 0, i = 0 (granule i: + cpa_kimm(i), ...)
  const uint8_t* meta[CP_NMI];  // its metadata granule i of page 0 (row (32 i + lane) / (PS MSZ / 16))
};

__device__ __forceinline__ void cpa_setup(CpaLane& cl, const Params& p, int h, int lane) {
  const int64_t c = h * p.s_ch;
  cl.k = reinterpret_cast<const uint8_t*>(p.kc) + c + cpa_ksrc(16 * lane);
  cl.v = reinterpret_cast<const uint8_t*>(p.vc) + c + cpa_vsrc(16 * lane);
  constexpr int RG = PS * MSZ / 16;  // granules per metadata row
#pragma unroll
  for (int i = 0; i < CP_NMI; ++i) {
    const int g = 32 * i + lane, m = min(g / RG, 3), col = g % RG;
    const uint64_t base = m == 0 ? p.ks : m == 1 ? p.ko : m == 2 ? p.vs : p.vo;
    cl.meta[i] = reinterpret_cast<const uint8_t*>(base) + h * p.s_mh * (int64_t)MSZ + 16 * col;
  }
}

// Issue the copies of physical page `page` into the stage at shared address `sdst` (not committed here); sl =
// sdst + 16 lane.
__device__ __forceinline__ void cpa_issue(const Params& p, const CpaLane& cl, uint32_t sl, int32_t page, int lane) {
  const uint64_t pu = (uint32_t)page;
  const uint8_t* kg = cl.k + pu * (uint32_t)p.s_cp;  // one IMAD.WIDE.U32 each
  const uint8_t* vg = cl.v + pu * (uint32_t)p.s_cp;
#pragma unroll
  for (int i = 0; i < CP_NCI; ++i)
    if (CP_NCG % 32 == 0 || 32 * i + lane < CP_NCG) {
      cp16(sl + 512 * i, kg + cpa_kimm(i));
      cp16(sl + CP_CODE + 512 * i, vg + cpa_vimm(i));
    }
  const uint32_t mstride = (uint32_t)(p.s_mp * MSZ);
#pragma unroll
  for (int i = 0; i < CP_NMI; ++i)
    if (CP_NMG % 32 == 0 || 32 * i + lane < CP_NMG) cp16(sl + 2 * CP_CODE + 512 * i, cl.meta[i] + pu * mstride);
}

// Chunk CH of a stage from shared memory; sk / sv / sm: the stage plus this thread's K / V / metadata offsets
template <int CH>
__device__ __forceinline__ void load_chunk_smem(Chunk2& c, const uint8_t* sk, const uint8_t* sv, const uint8_t* sm) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const uint8_t* src = sk + CH * 16 * RB + 8 * r * RB;
    if constexpr (WPT == 1) c.k[r][0] = *reinterpret_cast<const uint32_t*>(src);
    if constexpr (WPT == 2) { uint2 w = *reinterpret_cast<const uint2*>(src); c.k[r][0] = w.x; c.k[r][1] = w.y; }
    if constexpr (WPT == 4) {
      uint4 w = *reinterpret_cast<const uint4*>(src);
      c.k[r][0] = w.x; c.k[r][1] = w.y; c.k[r][2] = w.z; c.k[r][3] = w.w;
    }
  }
  constexpr int toks[4] = {0, 2, 1, 3};  // token 4 tig + toks[i]: row tig + 4 toks[i]
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint8_t* src = sv + CH * 16 * RB + 4 * toks[i] * RB;
    if constexpr (BPV == 2) c.v[i][0] = *reinterpret_cast<const uint16_t*>(src);
    if constexpr (BPV == 4) c.v[i][0] = *reinterpret_cast<const uint32_t*>(src);
    if constexpr (BPV == 8) { uint2 w = *reinterpret_cast<const uint2*>(src); c.v[i][0] = w.x; c.v[i][1] = w.y; }
  }
  c.ks = *reinterpret_cast<const meta2_t*>(sm + 0 * PS * MSZ + CH * 16 * MSZ);
  c.ko = *reinterpret_cast<const meta2_t*>(sm + 1 * PS * MSZ + CH * 16 * MSZ);
  c.vs = *reinterpret_cast<const meta2_t*>(sm + 2 * PS * MSZ + CH * 16 * MSZ);
  c.vo = *reinterpret_cast<const meta2_t*>(sm + 3 * PS * MSZ + CH * 16 * MSZ);
}

// Per-warp online-softmax state: heads 2tig, 2tig+1 of the C fragments; O^T rows (d) per m-tile.
struct State {
  float m[2], l[2], acc[KS][4];
  float t[2];  // LAZY_: raise m when a score (in the 2-bit path's units, see chunk_2bit) exceeds t
};

__device__ __forceinline__ void softmax_update(State& st, float (&s)[4], bool& rescale, float (&alpha)[2]) {
  float mx0 = warp_max8(fmaxf(s[0], s[2]));
  float mx1 = warp_max8(fmaxf(s[1], s[3]));
  float mn0 = fmaxf(st.m[0], mx0), mn1 = fmaxf(st.m[1], mx1);
  alpha[0] = ex2(st.m[0] - mn0);  // m = -inf at start: ex2(-inf) = 0
  alpha[1] = ex2(st.m[1] - mn1);
  rescale = (mn0 > st.m[0]) || (mn1 > st.m[1]);
  st.m[0] = mn0; st.m[1] = mn1;
  s[0] = ex2(s[0] - mn0); s[1] = ex2(s[1] - mn1); s[2] = ex2(s[2] - mn0); s[3] = ex2(s[3] - mn1);
  st.l[0] = st.l[0] * alpha[0] + s[0] + s[2];
  st.l[1] = st.l[1] * alpha[1] + s[1] + s[3];
}

__device__ __forceinline__ void rescale_acc(State& st, const float (&alpha)[2]) {
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      st.acc[mt][0] *= alpha[0]; st.acc[mt][1] *= alpha[1]; st.acc[mt][2] *= alpha[0]; st.acc[mt][3] *= alpha[1];
    }
  }
}

// d index of O^T row (m-tile mt, row gid + 8 r) in the 2-bit path
__device__ __forceinline__ int d_of_v2(int mt, int gid, int r) {
  constexpr int H = BPV / 2;  // m-tiles per field
  return gid * BPV + 2 * (mt % H) + r + RB * (mt / H);
}
// d index of QK column (k-step s, column 2tig + e + 8 hi) in the 2-bit path: the A fragment's halves are bytes
// (0, 2) and (1, 3) of a code word (the fields are masked in place, bytes 1 and 3 after one shift)
__device__ __forceinline__ int d_of_k2(int s, int tig, int e, int hi) {
  constexpr int W = WPT;
  return tig * BPT + 4 * (s % W) + 2 * e + hi + RB * (s / W);
}

struct Q2 {  // per-warp constants of the 2-bit path
  uint32_t qb[KS][2];
  float bias[2], qsum[2], iv;  // LAZY_: qsum / LS; iv unused (lv instead)
  float lv;                    // LAZY_: log2(v_ref), carried in the reference maximum
  uint32_t magic;
};

// SUBN_: the mma's K products are 2^-24 times the codes' (float16 subnormals); the scores are kept in units of
// 1 / LS (LAZY_) or scaled back by a per-token LS s_k (otherwise).
constexpr float LS = SUBN_ ? 16777216.f : 1.f;

// LAZY_: raise the reference maximum of heads (2tig, 2tig+1) to the warp's maximum score of this chunk (scores
// in units of 1 / LS; this thread's maxima mx0, mx1) and rescale what was accumulated against the old one. Only
// called when some lane has a score above its threshold t (warp-uniform).
__device__ __forceinline__ void lazy_raise(State& st, float (&osum)[2], float mx0, float mx1, float lv) {
  const float w[2] = {warp_max8(mx0), warp_max8(mx1)};
  float a[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float mn = fmaxf(st.m[e], fmaf(w[e], LS, lv));  // m includes log2(v_ref): p' = 2^(s - m) = p / v_ref
    a[e] = mn == -INFINITY ? 1.f : ex2(st.m[e] - mn);      // m = -inf at start: ex2(-inf) = 0
    st.m[e] = mn;
    st.t[e] = (mn - lv + (float)LAZY_TAU_) * (1.f / LS);   // p' <= 2^tau / v_ref until the next raise
    st.l[e] *= a[e];
    osum[e] *= a[e];
  }
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) {
    st.acc[mt][0] *= a[0]; st.acc[mt][1] *= a[1]; st.acc[mt][2] *= a[0]; st.acc[mt][3] *= a[1];
  }
}

template <bool MASKED>
__device__ __forceinline__ void chunk_2bit(const Q2& q, const Chunk2& cur, State& st, float (&osum)[2], int left,
                                           int gid) {
  // ---- S^T = K Q'^T (codes biased by 1024, field j scaled by 4^j: both folded into Q' and the bias)
  float s[4] = {0.f, 0.f, 0.f, 0.f};
#if QK2_
  float s2[4] = {0.f, 0.f, 0.f, 0.f};  // the odd k-steps: a second, independent mma chain
#endif
#pragma unroll
  for (int s_ = 0; s_ < KS; ++s_) {
    const int j = s_ / WPT, wi = s_ % WPT;
    const uint32_t lo0 = cur.k[0][wi], hi0 = cur.k[0][wi] >> 8;
    const uint32_t lo1 = cur.k[1][wi], hi1 = cur.k[1][wi] >> 8;
#if QK2_
    float(&acc)[4] = (s_ & 1) ? s2 : s;
#else
    float(&acc)[4] = s;
#endif
    mma_f16(acc, fieldj(lo0, j, q.magic), fieldj(lo1, j, q.magic), fieldj(hi0, j, q.magic), fieldj(hi1, j, q.magic),
            q.qb[s_][0], q.qb[s_][1]);
  }
#if QK2_
#pragma unroll
  for (int i = 0; i < 4; ++i) s[i] += s2[i];
#endif
  const float ks0 = meta_lo(cur.ks), ks1 = meta_hi(cur.ks), ko0 = meta_lo(cur.ko), ko1 = meta_hi(cur.ko);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int r = i >> 1, e = i & 1;
    const float sk = r ? ks1 : ks0, ok = (r ? ko1 : ko0) * q.qsum[e];
    if (SUBN_ && LAZY_) s[i] = sk * s[i] + ok;                    // units of 1 / LS (qsum prescaled)
    else if (SUBN_) s[i] = (sk * LS) * s[i] + ok;                 // one FMUL per token
    else s[i] = sk * (s[i] - q.bias[e]) + ok;
  }
  float vs0 = meta_lo(cur.vs), vs1 = meta_hi(cur.vs), vo0 = meta_lo(cur.vo), vo1 = meta_hi(cur.vo);
  if (MASKED) {  // a sequence's last page: rows past the end, metadata included, count 0
    const bool ok0 = 2 * gid < left, ok1 = 2 * gid + 1 < left;
    s[0] = ok0 ? s[0] : -INFINITY; s[1] = ok0 ? s[1] : -INFINITY;
    s[2] = ok1 ? s[2] : -INFINITY; s[3] = ok1 ? s[3] : -INFINITY;
    vs0 = ok0 ? vs0 : 0.f; vo0 = ok0 ? vo0 : 0.f; vs1 = ok1 ? vs1 : 0.f; vo1 = ok1 ? vo1 : 0.f;
  }
#if LAZY_
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
  const float v0 = vs0, v1 = vs1;
#else
  float alpha[2];
  bool resc;
  softmax_update(st, s, resc, alpha);
  osum[0] = osum[0] * alpha[0] + s[0] * vo0 + s[2] * vo1;
  osum[1] = osum[1] * alpha[1] + s[1] * vo0 + s[3] * vo1;
  rescale_acc(st, alpha);
  const float v0 = vs0 * q.iv, v1 = vs1 * q.iv;
#endif
  const uint32_t pb0 = movtrans(pack_h2(s[0] * v0, s[1] * v0));
  const uint32_t pb1 = movtrans(pack_h2(s[2] * v1, s[3] * v1));
  // ---- O^T += V^T P'^T, V^T from the codes of tokens (2tig, 2tig+1) and (2tig+8, 2tig+9), exact (4^j c, or
  // 4^j c 2^-24 with SUBN_)
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) {
    constexpr int H = BPV / 2;
    const int j = mt / H, q2 = mt % H;  // field, pair of bytes (2 q2, 2 q2 + 1) of the thread's slice
    uint32_t a[4];
#pragma unroll
    for (int pr = 0; pr < 2; ++pr) {
      const int wv = (2 * q2) / 4, sel = ((2 * q2) % 4) ? 0x7632 : 0x5410;
      const uint32_t x = BPV == 2 ? (cur.v[2 * pr][0] | (cur.v[2 * pr + 1][0] << 16))
                                  : __byte_perm(cur.v[2 * pr][wv], cur.v[2 * pr + 1][wv], sel);
      a[2 * pr] = SUBN_ ? fieldj(x, j, q.magic) : hsub1024(fieldj(x, j, q.magic));
      a[2 * pr + 1] = SUBN_ ? fieldj(x >> 8, j, q.magic) : hsub1024(fieldj(x >> 8, j, q.magic));
    }
    mma_f16(st.acc[mt], a[0], a[1], a[2], a[3], pb0, pb1);
  }
}

constexpr int CPP = PS / 16;  // 16-token chunks per page

// Chunks CH.. of page pp (chunk CH in buf[(START + CH) % 2], already loaded); prefetches the following chunk (of
// this page, or chunk 0 of the warp's next page) before the math of the current one.
template <bool MASKED, int START, int CH>
__device__ __forceinline__ void page_chunks(const Q2& q, Chunk2 (&buf)[2], State& st, float (&osum)[2],
                                            const Params& p, const Bases2& bs, PagePtrs& pp, int page_next, bool has_next, int left,
                                            int gid) {
  constexpr int cur = (START + CH) & 1, nxt = cur ^ 1;
  if constexpr (CH + 1 < CPP) {
    load_chunk_page<CH + 1>(buf[nxt], pp);
  } else {  // the next page's pointers only now, so that two pages' pointers are never live together
    pp = page_ptrs(p, bs, page_next);
    if (has_next) load_chunk_page<0>(buf[nxt], pp);
  }
  if constexpr (L2PF_ && CH == (CPP > 1 ? 1 : 0))  // the page id was loaded a chunk ago (0 past the last)
    l2_prefetch_page(p, bs, page_next, PF_LINES % 16 == 0 ? 0 : (int)(threadIdx.x & 31));  // lane: see there
  if (!MASKED || 16 * CH < left) chunk_2bit<MASKED>(q, buf[cur], st, osum, left - 16 * CH, gid);
  if constexpr (CH + 1 < CPP)
    page_chunks<MASKED, START, CH + 1>(q, buf, st, osum, p, bs, pp, page_next, has_next, left, gid);
}

// One page of a warp (its first chunk in buf[START]); advances pp/pg to the warp's next page, false when none.
template <int START>
__device__ __forceinline__ bool page_2bit(const Q2& q, Chunk2 (&buf)[2], State& st, float (&osum)[2],
                                          const Params& p, const Bases2& bs, const int32_t* bt, PagePtrs& pp, int& pg, int p_end,
                                          int hi, int gid) {
  const int pg_next = pg + NW;
  const bool has_next = pg_next < p_end;
  const int page_next = has_next ? bt[pg_next] : 0;
  const int left = hi - pg * PS;
  if (left >= PS) page_chunks<false, START, 0>(q, buf, st, osum, p, bs, pp, page_next, has_next, left, gid);
  else page_chunks<true, START, 0>(q, buf, st, osum, p, bs, pp, page_next, has_next, left, gid);
  pg = pg_next;
  return has_next;
}

#if CPA_
// CPA_: one page of a warp from its shared-memory stage sb (copies complete and visible to the warp); with L2PF_,
// page pf_page (the one after those in flight) is prefetched into L2 before the last chunk.
template <bool MASKED>
__device__ __forceinline__ void page_cpa(const Q2& q, State& st, float (&osum)[2], const Params& p, const Bases2& bs,
                                         const uint8_t* sb, uint32_t kr, uint32_t vr, uint32_t mr, int32_t pf_page,
                                         int left, int gid) {
#pragma unroll
  for (int ch = 0; ch < CPP; ++ch) {
    if (L2PF_ && ch == CPP - 1)
      l2_prefetch_page(p, bs, pf_page, PF_LINES % 16 == 0 ? 0 : (int)(threadIdx.x & 31));
    if (!MASKED || 16 * ch < left) {
      Chunk2 c;
      switch (ch) {  // compile-time offsets (ch is a constant after unrolling)
#define OSCAR_LCS(n) case n: load_chunk_smem<n>(c, sb + kr, sb + CP_CODE + vr, sb + 2 * CP_CODE + mr); break;
        OSCAR_LCS(0) OSCAR_LCS(1) OSCAR_LCS(2) OSCAR_LCS(3) OSCAR_LCS(4) OSCAR_LCS(5) OSCAR_LCS(6) OSCAR_LCS(7)
        OSCAR_LCS(8) OSCAR_LCS(9) OSCAR_LCS(10) OSCAR_LCS(11) OSCAR_LCS(12) OSCAR_LCS(13) OSCAR_LCS(14) OSCAR_LCS(15)
#undef OSCAR_LCS
        default: break;
      }
      chunk_2bit<MASKED>(q, c, st, osum, left - 16 * ch, gid);
    }
  }
}
static_assert(CPA_ == 0 || CPP <= 16, "CPA_: pages of at most 256 tokens");
#endif

__device__ void run_2bit(const Params& p, State& st, float (&osum)[2], float& vref, int b, int h, int lo, int hi,
                         int warp, int gid, int tig) {
  // Q' fragments: b0/b1 of k-step s for head gid; per-head sums for heads 2tig, 2tig+1
  const q_t* qrow = reinterpret_cast<const q_t*>(p.q) + b * p.sq_b + (int64_t)(h * GQ + gid) * p.sq_h;
  const float sc = (float)p.sm_scale_log2;
  Q2 q;
  q.magic = (uint32_t)p.magic;
  float bias_part = 0.f, qsum_part = 0.f;
#pragma unroll
  for (int s = 0; s < KS; ++s) {
    const float inv4 = 1.f / float(1 << (2 * (s / WPT)));
#pragma unroll
    for (int hi2 = 0; hi2 < 2; ++hi2) {
      float v[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        v[e] = gid < GQ ? q_f(qrow[d_of_k2(s, tig, e, hi2)]) * sc * inv4 : 0.f;
        v[e] = __half2float(__float2half_rn(v[e]));
        bias_part += v[e];
        qsum_part += v[e] / inv4;
      }
      q.qb[s][hi2] = pack_h2(v[0], v[1]);
    }
  }
  bias_part += __shfl_xor_sync(0xffffffffu, bias_part, 1);
  bias_part += __shfl_xor_sync(0xffffffffu, bias_part, 2);
  qsum_part += __shfl_xor_sync(0xffffffffu, qsum_part, 1);
  qsum_part += __shfl_xor_sync(0xffffffffu, qsum_part, 2);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    q.bias[e] = 1024.f * __shfl_sync(0xffffffffu, bias_part, (2 * tig + e) * 4);
    q.qsum[e] = __shfl_sync(0xffffffffu, qsum_part, (2 * tig + e) * 4) * (LAZY_ ? 1.f / LS : 1.f);
  }
  const int32_t* bt = reinterpret_cast<const int32_t*>(p.bt) + b * p.s_bt;
  // Pages of the split, page-interleaved over the warps (a split starts on a page boundary); a warp walks the
  // CPP 16-token chunks of each of its pages with compile-time offsets, the next chunk's loads in flight.
  const int p_end = (hi + PS - 1) / PS;
  int pg = lo / PS + warp;
  if (lo >= hi || pg >= p_end) return;
  Bases2 bs;
  bs.k = h * p.s_ch + 2 * gid * RB + tig * BPT;
  bs.v = h * p.s_ch + 4 * tig * RB + gid * BPV;
  bs.m = h * p.s_mh + 2 * gid;
  l2pf_bases(bs, p, h, 4 * gid + tig);
#if CPA_
  // this warp's pages pg + k NW, k < npg: page k in stage k % CPA_; pages k + 1 .. k + CPA_ - 1 in flight while
  // page k is computed (one commit group per page, empty groups past the last so that the counts stay uniform)
  const int npg = (p_end - pg + NW - 1) / NW, lane = 4 * gid + tig;
  CpaLane cl;
  cpa_setup(cl, p, h, lane);
  uint8_t* const wreg = dsm + warp * CP_WREG;
  const uint32_t sw = (uint32_t)__cvta_generic_to_shared(wreg) + 16 * lane;  // + this lane's copy slot
  const uint32_t kr = gid * RB + tig * BPT, vr = vswz(tig * RB + gid * BPV), mr = 2 * gid * MSZ;
#pragma unroll
  for (int k = 0; k < CPA_ - 1; ++k) {
    if (k < npg) cpa_issue(p, cl, sw + k * CP_STG, bt[pg + k * NW], lane);
    cp_commit();
  }
  int32_t id_w = CPA_ - 1 < npg ? bt[pg + (CPA_ - 1) * NW] : 0;  // the page the next copy is for
  cp_wait<CPA_ - 2>();  // page 0 has landed
  __syncwarp();
  {  // reference V scale (valid rows of the first chunk): keeps p * s_v / v_ref inside float16's normal range
    const int left = hi - pg * PS;
    const meta2_t vs = *reinterpret_cast<const meta2_t*>(wreg + 2 * CP_CODE + 2 * PS * MSZ + mr);
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
    q.iv = 1.f / vref;
    q.lv = __log2f(vref);  // LAZY_: any value near log2(v_ref) will do (it only shifts the reference maximum)
    // what the accumulators are multiplied by at the end (with 1 / 4^j): p carries 1 / v_ref unless LAZY_ put
    // it in m (then the partial output, l and osum are all in units of 1 / v_ref), the codes 2^-24 with SUBN_
    vref = (LAZY_ ? 1.f : vref) * LS;
  }
#if CPA_
  uint32_t rd = 0, wr = (CPA_ - 1) * CP_STG;  // stage offsets of page k and of page k + CPA_ - 1
  const int32_t* btn = bt + pg + CPA_ * NW;   // block-table entry of page k + CPA_
  int left = hi - pg * PS;                    // tokens of the split from page k on
  for (int c = npg;; --c) {                   // c = npg - k pages left, this one included
    if (c >= CPA_) cpa_issue(p, cl, sw + wr, id_w, lane);  // page k + CPA_ - 1, into the stage page k - 1 left
    cp_commit();
    const int32_t id_n = c > CPA_ ? *btn : 0;  // read a page before it is needed
    cp_wait<CPA_ - 1>();  // page k has landed (only the CPA_ - 1 newest groups may be pending)
    __syncwarp();         // ... for every lane's copies
    if (left >= PS) page_cpa<false>(q, st, osum, p, bs, wreg + rd, kr, vr, mr, id_n, left, gid);
    else page_cpa<true>(q, st, osum, p, bs, wreg + rd, kr, vr, mr, id_n, left, gid);
    __syncwarp();  // every lane has read stage rd before the next iteration's copies overwrite it
    if (c == 1) break;
    id_w = id_n;
    btn += NW;
    left -= NW * PS;
    if constexpr (CPA_ == 2) {
      rd = CP_STG - rd; wr = CP_STG - wr;
    } else {
      rd = rd == (CPA_ - 1) * CP_STG ? 0 : rd + CP_STG;
      wr = wr == (CPA_ - 1) * CP_STG ? 0 : wr + CP_STG;
    }
  }
  cp_wait<0>();  // only empty groups can be left; the region then holds the partial outputs
  __syncwarp();
#else
  while (true) {  // CPP odd: a chunk's buffer alternates between pages, so pages go in pairs
    if (!page_2bit<0>(q, buf, st, osum, p, bs, bt, pp, pg, p_end, hi, gid)) break;
    if constexpr (CPP % 2 == 1) {
      if (!page_2bit<1>(q, buf, st, osum, p, bs, bt, pp, pg, p_end, hi, gid)) break;
    }
  }
#endif
}

template <bool BF>
__device__ void run_16bit(const Params& p, State& st, int b, int h, int lo, int hi, int warp, int gid, int tig) {
  typedef typename std::conditional<BF, __nv_bfloat16, __half>::type t16;
  const q_t* qrow = reinterpret_cast<const q_t*>(p.q) + b * p.sq_b + (int64_t)(h * GQ + gid) * p.sq_h;
  const float sc = (float)p.sm_scale_log2;
  constexpr int HPT = D / 4;  // halves of a K row per thread (tig slice)
  uint32_t qh[KS][2], ql[KS][2];
#pragma unroll
  for (int s = 0; s < KS; ++s)
#pragma unroll
    for (int hi2 = 0; hi2 < 2; ++hi2) {
      float v[2], r[2];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        v[e] = gid < GQ ? q_f(qrow[tig * HPT + 4 * s + 2 * hi2 + e]) * sc : 0.f;
        const float rounded = BF ? __bfloat162float(__float2bfloat16_rn(v[e])) : __half2float(__float2half_rn(v[e]));
        r[e] = v[e] - rounded;
        v[e] = rounded;
      }
      qh[s][hi2] = pack16<BF>(v[0], v[1]);
      ql[s][hi2] = pack16<BF>(r[0], r[1]);
    }
  const t16* kb = reinterpret_cast<const t16*>(p.k16) + b * p.s16_b + h * p.s16_h;
  const t16* vb = reinterpret_cast<const t16*>(p.v16) + b * p.s16_b + h * p.s16_h;
  for (int t0 = lo + 16 * warp; t0 < hi; t0 += 16 * NW) {
    const int left = hi - t0;
    float s[4] = {0.f, 0.f, 0.f, 0.f};
    uint4 kr[2][HPT / 8];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const bool ok = gid + 8 * r < left;
      const uint4* src = reinterpret_cast<const uint4*>(kb + (int64_t)(t0 + gid + 8 * r) * p.s16_t + tig * HPT);
#pragma unroll
      for (int i = 0; i < HPT / 8; ++i) kr[r][i] = ok ? src[i] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int s_ = 0; s_ < KS; ++s_) {
      const uint32_t* k0 = reinterpret_cast<const uint32_t*>(&kr[0][0]);
      const uint32_t* k1 = reinterpret_cast<const uint32_t*>(&kr[1][0]);
      mma16<BF>(s, k0[2 * s_], k1[2 * s_], k0[2 * s_ + 1], k1[2 * s_ + 1], qh[s_][0], qh[s_][1]);
      mma16<BF>(s, k0[2 * s_], k1[2 * s_], k0[2 * s_ + 1], k1[2 * s_ + 1], ql[s_][0], ql[s_][1]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) s[i] = (gid + 8 * (i >> 1)) < left ? s[i] : -INFINITY;
    float alpha[2];
    bool resc;
    softmax_update(st, s, resc, alpha);
    rescale_acc(st, alpha);
    const uint32_t pb0 = movtrans(pack16<BF>(s[0], s[1]));
    const uint32_t pb1 = movtrans(pack16<BF>(s[2], s[3]));
    constexpr int HV = D / 8;  // halves of a V row per thread (gid slice)
    uint4 vr[4][HV / 8];
    const int toks[4] = {2 * tig, 2 * tig + 1, 2 * tig + 8, 2 * tig + 9};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool ok = toks[i] < left;  // stale rows may hold NaN: zero them, P = 0 there
      const uint4* src = reinterpret_cast<const uint4*>(vb + (int64_t)(t0 + toks[i]) * p.s16_t + gid * HV);
#pragma unroll
      for (int w = 0; w < HV / 8; ++w) vr[i][w] = ok ? src[w] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int mt = 0; mt < KS; ++mt) {
      uint32_t a[4];
#pragma unroll
      for (int pr = 0; pr < 2; ++pr) {
        const uint32_t wa = reinterpret_cast<const uint32_t*>(&vr[2 * pr][0])[mt];
        const uint32_t wb = reinterpret_cast<const uint32_t*>(&vr[2 * pr + 1][0])[mt];
        a[2 * pr] = __byte_perm(wa, wb, 0x5410);
        a[2 * pr + 1] = __byte_perm(wa, wb, 0x7632);
      }
      mma16<BF>(st.acc[mt], a[0], a[1], a[2], a[3], pb0, pb1);
    }
  }
}

__device__ __forceinline__ float warp_max32(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

// out[b, h*GQ + hh] = sum_s 2^(lse_s - lse) o_s over all splits of (b, h): one warp per query head, D/32
// consecutive outputs per lane, 8 splits' loads in flight. Partials come from other CTAs: read through L2.
__device__ void merge_cta(const Params& p, int b, int h, int warp, int lane) {
  constexpr int DPL = D / 32;
  const int S = (int)p.merge_splits;
  for (int hh = warp; hh < GQ; hh += NW) {
    const int64_t hq = h * GQ + hh;
    const float* lse = reinterpret_cast<const float*>(p.lse_part) + b * p.sl_b + hq * p.sl_h;
    const float* o = reinterpret_cast<const float*>(p.o_part) + b * p.so_b + hq * p.so_h + lane * DPL;
    float mx = -INFINITY;
    for (int s = lane; s < S; s += 32) mx = fmaxf(mx, __ldcg(lse + s));
    mx = warp_max32(mx);
    float den = 0.f, acc[DPL];
#pragma unroll
    for (int k = 0; k < DPL; ++k) acc[k] = 0.f;
    if (mx > -INFINITY) {
      for (int s0 = 0; s0 < S; s0 += 8) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int s = s0 + i;
          if (s < S) {
            const float l = __ldcg(lse + s);
            const float w = l > -INFINITY ? ex2(l - mx) : 0.f;
            const float* src = o + (int64_t)s * p.so_s;
            float v[DPL];
            if constexpr (DPL == 2) { const float2 t = __ldcg(reinterpret_cast<const float2*>(src)); v[0] = t.x; v[1] = t.y; }
#pragma unroll
            for (int k = 0; k < (DPL >= 4 ? DPL / 4 : 0); ++k) {
              const float4 t = __ldcg(reinterpret_cast<const float4*>(src) + k);
              v[4 * k] = t.x; v[4 * k + 1] = t.y; v[4 * k + 2] = t.z; v[4 * k + 3] = t.w;
            }
            den += w;
#pragma unroll
            for (int k = 0; k < DPL; ++k) acc[k] += w * v[k];
          }
        }
      }
    }
    const float inv = den > 0.f ? 1.f / den : 0.f;
    const int64_t off = b * p.sout_b + hq * p.sout_h + lane * DPL;
#pragma unroll
    for (int k = 0; k < DPL; ++k) {
      const float r = acc[k] * inv;
      if (p.out_dtype == 0) reinterpret_cast<float*>(p.out)[off + k] = r;
      else if (p.out_dtype == 1) reinterpret_cast<__half*>(p.out)[off + k] = __float2half_rn(r);
      else reinterpret_cast<__nv_bfloat16*>(p.out)[off + k] = __float2bfloat16_rn(r);
    }
  }
}

#ifndef MINB_
#define MINB_ 1
#endif
// PART_: 0 = both tiers in one kernel (split < num_qsplits: 2-bit), 1 = 2-bit splits only, 2 = 16-bit only
// (blockIdx.x + num_qsplits is the split index), so each kernel gets the registers of its own path.
#ifndef PART_
#define PART_ 0
#endif
extern "C" __global__ void __launch_bounds__(NW * 32, MINB_) oscar_decode_split(const Params p) {
  __shared__ float sm_m[NW][8], sm_l[NW][8];
#if CPA_  // a warp's partial outputs [8][D] reuse its stages (dynamic shared memory, NW * CP_WREG bytes)
  {
    uint32_t dyn;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
    if (dyn < (uint32_t)(NW * CP_WREG)) __trap();  // the launcher passed less than the stages need
  }
#define SM_O(w, hh, d) reinterpret_cast<float*>(dsm + (w) * CP_WREG)[(hh) * D + (d)]
#else
  __shared__ float sm_o[NW][8][D];
#define SM_O(w, hh, d) sm_o[w][hh][d]
#endif
  const int split = blockIdx.x + (PART_ == 2 ? (int)p.num_qsplits : 0), bh = blockIdx.y;
  const int b = bh / (int)p.hkv, h = bh % (int)p.hkv;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
#if EARLY_ && PART_ != 2
  if (PART_ == 1 || split < p.num_qsplits) l2_prefetch_first_pages(p, split, b, h, warp, lane);
#endif
#if PDLW_  // launched as a programmatic dependent: the previous kernel's writes are visible after this
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#if PDL_  // the merge kernel may be scheduled now: it waits (griddepcontrol.wait) for this grid to complete
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  State st;
  st.m[0] = st.m[1] = -INFINITY;
  st.l[0] = st.l[1] = 0.f;
  st.t[0] = st.t[1] = -INFINITY;
#pragma unroll
  for (int mt = 0; mt < KS; ++mt) st.acc[mt][0] = st.acc[mt][1] = st.acc[mt][2] = st.acc[mt][3] = 0.f;
  const bool is2 = PART_ == 1 || (PART_ == 0 && split < p.num_qsplits);
  float osum[2] = {0.f, 0.f}, vref = 1.f;
  if (is2) {
#if PART_ != 2
    const int n = reinterpret_cast<const int32_t*>(p.qlen)[b];
    const int tps = split_tokens(p, n);
    const int lo = split * tps;
    const int hi = min(n, lo + tps);
    run_2bit(p, st, osum, vref, b, h, lo, hi, warp, gid, tig);
#endif
  } else {
#if PART_ != 1
    const int n = reinterpret_cast<const int32_t*>(p.len16)[b];
    const int lo = (split - (int)p.num_qsplits) * (int)p.tok16_per_split;
    const int hi = min(n, lo + (int)p.tok16_per_split);
    run_16bit<T16_ == 2>(p, st, b, h, lo, hi, warp, gid, tig);
#endif
  }
  // ---- per-warp results -> shared memory (unnormalised outputs per head)
  const float l0 = warp_sum8(st.l[0]), l1 = warp_sum8(st.l[1]);
  const float os0 = warp_sum8(osum[0]), os1 = warp_sum8(osum[1]);
  if (gid == 0) {
    sm_m[warp][2 * tig] = st.m[0]; sm_m[warp][2 * tig + 1] = st.m[1];
    sm_l[warp][2 * tig] = l0; sm_l[warp][2 * tig + 1] = l1;
  }
#pragma unroll
  for (int mt = 0; mt < KS; ++mt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = i >> 1, e = i & 1, hh = 2 * tig + e;
      float v = st.acc[mt][i];
      int d;
      if (is2) {
        d = d_of_v2(mt, gid, r);
        v = v * (vref / float(1 << (2 * (mt / (BPV / 2))))) + (e ? os1 : os0);
      } else {
        d = gid * (D / 8) + 2 * mt + r;
      }
      SM_O(warp, hh, d) = v;
    }
  __syncthreads();
  // ---- merge the warps, write the split's partial output and log-sum-exp
  for (int idx = threadIdx.x; idx < GQ * D; idx += NW * 32) {
    const int hh = idx / D, d = idx % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sm_m[w][hh]);
    float den = 0.f, num = 0.f;
    if (mx > -INFINITY) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float f = sm_m[w][hh] > -INFINITY ? ex2(sm_m[w][hh] - mx) : 0.f;
        den += f * sm_l[w][hh];
        num += f * SM_O(w, hh, d);
      }
    }
    float* o = reinterpret_cast<float*>(p.o_part) + b * p.so_b + (int64_t)(h * GQ + hh) * p.so_h + split * p.so_s;
    o[d] = den > 0.f ? num / den : 0.f;
    if (d == 0) {
      float* l = reinterpret_cast<float*>(p.lse_part) + b * p.sl_b + (int64_t)(h * GQ + hh) * p.sl_h;
      l[split] = den > 0.f ? mx + __log2f(den) : -INFINITY;
    }
  }
  if (p.merge_splits > 0) {  // fused merge: the last CTA of this (sequence, KV head) combines all its splits
    __shared__ int s_last;
    __threadfence();  // this CTA's partials are visible device-wide before its ticket is taken
    __syncthreads();
    if (threadIdx.x == 0) {
      int* cnt = reinterpret_cast<int*>(p.counters) + bh;
      s_last = atomicAdd(cnt, 1) == (int)p.merge_splits - 1;
      if (s_last) *cnt = 0;  // every other CTA has taken its ticket: ready for the next launch
    }
    __syncthreads();
    if (s_last) {
      __threadfence();
      merge_cta(p, b, h, warp, lane);
    }
  }
}

struct MergeParams {
  uint64_t o_part, lse_part, out;
  int64_t so_b, so_h, so_s, sl_b, sl_h, sout_b, sout_h, hq, num_splits, out_dtype;  // 0 f32, 1 f16, 2 bf16
};

__device__ __forceinline__ float4 f4_axpy(float4 acc, float w, float4 v) {
  return make_float4(acc.x + w * v.x, acc.y + w * v.y, acc.z + w * v.z, acc.w + w * v.w);
}
__device__ __forceinline__ float4 f4_scale(float4 v, float a) { return make_float4(a * v.x, a * v.y, a * v.z, a * v.w); }

// The merge is latency-bound (a few KB per query head, read once): what costs is the chain of dependent memory
// round trips, so every thread issues the loads of all its splits (log-sum-exp and partial output) at once, then
// combines them with an online log-sum-exp, and the lanes of a warp are combined with shuffles. One CTA per
// (sequence, query head, 32-wide slice of d): warp g takes the float4 column g of the slice, lane l the splits
// l, l + 32, ...; MERGE_INFLIGHT splits per lane are in flight together (one round trip for up to 128 splits).
// (Before, session 13: one CTA per query head, weights through shared memory, then 4 loads in flight per thread
// over 16 splits each: 11.2 us at 128K x 1 under ncu, a fifth of the decode.)
constexpr int MERGE_THREADS = 256, MERGE_SLICE = 32, MERGE_INFLIGHT = 4;
static_assert(MERGE_THREADS == 32 * (MERGE_SLICE / 4), "one warp per float4 column of a slice");

extern "C" __global__ void __launch_bounds__(MERGE_THREADS) oscar_decode_merge(const MergeParams p) {
  constexpr int NSLICE = D / MERGE_SLICE;
  const int slice = blockIdx.x % NSLICE, bhq = blockIdx.x / NSLICE;
  const int b = bhq / (int)p.hq, hq = bhq % (int)p.hq, g = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int S = (int)p.num_splits;
#if PDL_  // launched as a programmatic dependent of the split kernel: its partials are complete after this
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");  // a programmatic dependent may start now
#endif
  const float* lse = reinterpret_cast<const float*>(p.lse_part) + b * p.sl_b + hq * p.sl_h;
  const float* o = reinterpret_cast<const float*>(p.o_part) + b * p.so_b + hq * p.so_h + slice * MERGE_SLICE + 4 * g;
  float m = -INFINITY, den = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = lane; s0 < S; s0 += 32 * MERGE_INFLIGHT) {
    float l[MERGE_INFLIGHT];
    float4 v[MERGE_INFLIGHT];
#pragma unroll
    for (int i = 0; i < MERGE_INFLIGHT; ++i) {  // all loads first: one round trip
      const int s = s0 + 32 * i;
      l[i] = s < S ? __ldcg(lse + s) : -INFINITY;
      v[i] = s < S ? __ldcg(reinterpret_cast<const float4*>(o + (int64_t)s * p.so_s)) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mn = m;
#pragma unroll
    for (int i = 0; i < MERGE_INFLIGHT; ++i) mn = fmaxf(mn, l[i]);
    if (mn > -INFINITY) {  // else every split so far is empty: nothing to add
      const float a = m > -INFINITY ? ex2(m - mn) : 0.f;
      den *= a;
      acc = f4_scale(acc, a);
#pragma unroll
      for (int i = 0; i < MERGE_INFLIGHT; ++i) {
        const float w = l[i] > -INFINITY ? ex2(l[i] - mn) : 0.f;  // empty splits (lse -inf) weigh nothing
        den += w;
        acc = f4_axpy(acc, w, v[i]);
      }
      m = mn;
    }
  }
  float mx = m;
#pragma unroll
  for (int k = 16; k > 0; k >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, k));
  const float f = m > -INFINITY ? ex2(m - mx) : 0.f;
  den *= f;
  acc = f4_scale(acc, f);
#pragma unroll
  for (int k = 16; k > 0; k >>= 1) {
    den += __shfl_xor_sync(0xffffffffu, den, k);
    acc.x += __shfl_xor_sync(0xffffffffu, acc.x, k);
    acc.y += __shfl_xor_sync(0xffffffffu, acc.y, k);
    acc.z += __shfl_xor_sync(0xffffffffu, acc.z, k);
    acc.w += __shfl_xor_sync(0xffffffffu, acc.w, k);
  }
  if (lane != 0) return;
  const float inv = den > 0.f ? 1.f / den : 0.f;
  const float r[4] = {acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv};
  const int64_t off = b * p.sout_b + hq * p.sout_h + slice * MERGE_SLICE + 4 * g;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (p.out_dtype == 0) reinterpret_cast<float*>(p.out)[off + k] = r[k];
    else if (p.out_dtype == 1) reinterpret_cast<__half*>(p.out)[off + k] = __float2half_rn(r[k]);
    else reinterpret_cast<__nv_bfloat16*>(p.out)[off + k] = __float2bfloat16_rn(r[k]);
  }
}
