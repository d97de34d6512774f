// Shared definitions of the paged decode kernel (decode.cu): compile-time configuration, the parameter block,
// numeric helpers and the per-warp online-softmax state. Layout of the pools: oscarkv/kernels/layout.py.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

// Compile-time configuration (nvcc -D...; decode_cuda.py's config_key sets every one):
//   D_ head_dim (64/128/256), GQ_ query heads per KV head (1..8), PS_ page size (multiple of 16), NW_ warps per
//   CTA, QT_ query dtype (0 f32, 1 f16, 2 bf16), T16_ 16-bit tier dtype (1 f16, 2 bf16), MT_ metadata dtype
//   (1 f16, 2 bf16, 0 f32), KB_ / VB_ key / value code bits (2 or 4), KCH_ keys in channel pages (one
//   scale/offset per (page, head, channel)) instead of token pages, PART_ which tiers a launch covers (0 both,
//   1 quantized only, 2 16-bit only), MINB_ the CTAs per SM to fit in registers.
//   Quantized-tier loop: CPA_ = 1 streams each warp's pages global -> shared memory with cp.async (two page
//   stages); CPA_ = 0 keeps a one-chunk register prefetch. L2PF_ = 1 asks for a warp's next page (register
//   loop) or the page after the one in flight (cp.async loop) to be brought into L2 (prefetch.global.L2): more
//   bytes in flight where a launch has few warps. Channel-page keys need CPA_ (their per-page scales come with
//   the stage). Programmatic dependent launch: PDLW_ the split kernel waits for the kernel before it
//   (griddepcontrol.wait), PDL_ the merge kernel is a dependent of the split kernel and lets the next kernel
//   start, EARLY_ (with L2PF_) each warp's first two pages are prefetched into L2 before that wait.
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
#ifndef KB_
#define KB_ 2
#endif
#ifndef VB_
#define VB_ 2
#endif
#ifndef KCH_
#define KCH_ 0
#endif
#ifndef CPA_
#define CPA_ 0
#endif
#ifndef L2PF_
#define L2PF_ 0
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
#ifndef MINB_
#define MINB_ 1
#endif
#ifndef PART_
#define PART_ 0
#endif

constexpr int D = D_, GQ = GQ_, PS = PS_, NW = NW_, KB = KB_, VB = VB_;
constexpr bool KCH = KCH_ != 0;
constexpr int KS = D / 16;           // k-steps of the QK product, m-tiles of the PV product
constexpr int RBK = D * KB / 8;      // bytes per packed key row
constexpr int RBV = D * VB / 8;      // ... value row
constexpr int BPT = RBK / 4;         // key bytes per thread per token (A fragment: 4 threads share a row)
constexpr int WPT = BPT / 4;         // ... in 32-bit words
constexpr int BPV = RBV / 8;         // value bytes per thread per token (8 threads share a row)
constexpr int VH = BPV / 2;          // PV m-tiles per value field
constexpr int CPP = PS / 16;         // 16-token chunks per page
constexpr float LAZY_TAU = 3.f;      // log2 units: the softmax reference maximum moves when exceeded by 2^3
constexpr float LS = 16777216.f;     // codes enter the mma as float16 subnormals: 2^-24 times their value
static_assert(D == 64 || D == 128 || D == 256, "head_dim must be 64, 128 or 256");
static_assert((KB == 2 || KB == 4) && (VB == 2 || VB == 4), "2- or 4-bit codes");
static_assert(GQ >= 1 && GQ <= 8, "at most 8 query heads per KV head");
static_assert(PS % 16 == 0, "page size must be a multiple of 16");
static_assert(KS == (8 / KB) * WPT && KS == (8 / VB) * VH, "fields x words cover the k-steps");
static_assert(!EARLY_ || L2PF_, "EARLY_ needs L2PF_ (its per-lane page prefetch)");

struct Params {  // every field 8 bytes: the ctypes mirror in decode_cuda.py is trivial
  uint64_t q, kc, vc, ks, ko, vs, vo, bt, qlen, k16, v16, len16, o_part, lse_part;
  int64_t sq_b, sq_h, s_kcp, s_kch, s_vcp, s_vch, s_kmp, s_kmh, s_vmp, s_vmh, s_bt, s16_b, s16_h, s16_t;
  int64_t so_b, so_h, so_s, sl_b, sl_h, hkv, tok_per_split, num_qsplits, tok16_per_split;
  double sm_scale_log2;
  // a sequence's quantized split length (split_tokens): granule and least split in pages; tok_per_split the most
  int64_t gran_pages, least_pages;
};

// Quantized tokens per split of a sequence whose quantized tier holds n tokens (DecodePlan.split_tokens, the
// host reference): its pages spread over all num_qsplits splits in whole granules, at least least_pages, at most
// the plan's tok_per_split, so a sequence shorter than the plan's bound still uses every split.
__device__ __forceinline__ int split_tokens(const Params& p, int n) {
  const int nq = (int)p.num_qsplits, g = (int)p.gran_pages;
  const int want = ((n + PS - 1) / PS + nq - 1) / nq;
  return min(max((want + g - 1) / g * g, (int)p.least_pages), (int)p.tok_per_split / PS) * PS;
}

#if MT_ == 1
typedef __half meta_t;
typedef __half2 meta2_t;
#elif MT_ == 2
typedef __nv_bfloat16 meta_t;
typedef __nv_bfloat162 meta2_t;
#else
typedef float meta_t;
typedef float2 meta2_t;
#endif
constexpr int MSZ = (int)sizeof(meta_t);
#if MT_ == 0
__device__ __forceinline__ float meta_lo(meta2_t x) { return x.x; }
__device__ __forceinline__ float meta_hi(meta2_t x) { return x.y; }
#else
__device__ __forceinline__ float meta_lo(meta2_t x) { return __low2float(x); }
__device__ __forceinline__ float meta_hi(meta2_t x) { return __high2float(x); }
#endif
// value k of metadata values held as raw 32-bit words (k a compile-time constant after unrolling)
template <int N>
__device__ __forceinline__ float meta_word(const uint32_t (&w)[N], int k) {
#if MT_ == 0
  return __uint_as_float(w[k]);
#else
  const uint32_t x = w[k >> 1];
  const meta2_t m = *reinterpret_cast<const meta2_t*>(&x);
  return (k & 1) ? meta_hi(m) : meta_lo(m);
#endif
}

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

__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

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

// Field j of the low byte of each 16-bit half of x, masked in place: a float16 subnormal (2^BITS)^j c 2^-24
// (exact: at most 240 2^-24). j is a compile-time constant after unrolling: one LOP3 with an immediate.
template <int BITS>
__device__ __forceinline__ uint32_t fieldj(uint32_t x, int j) {
  constexpr uint32_t m = (1u << BITS) - 1;
  return x & (((m << 16) | m) << (BITS * j));
}

// NB bytes at src (aligned to min(NB, 16)) into 32-bit words w (a 16-bit load for NB = 2)
template <int NB, int NWD>
__device__ __forceinline__ void ld_bytes(uint32_t (&w)[NWD], const uint8_t* src) {
  if constexpr (NB == 2) {
    w[0] = *reinterpret_cast<const uint16_t*>(src);
  } else if constexpr (NB == 4) {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  } else if constexpr (NB == 8) {
    const uint2 t = *reinterpret_cast<const uint2*>(src);
    w[0] = t.x; w[1] = t.y;
  } else {
    static_assert(NB % 16 == 0 && NWD >= NB / 4, "whole 16-byte pieces");
#pragma unroll
    for (int i = 0; i < NB / 16; ++i) {
      const uint4 t = reinterpret_cast<const uint4*>(src)[i];
      w[4 * i] = t.x; w[4 * i + 1] = t.y; w[4 * i + 2] = t.z; w[4 * i + 3] = t.w;
    }
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

// Per-warp online-softmax state: heads 2tig, 2tig+1 of the C fragments; O^T rows (d) per m-tile.
struct State {
  float m[2], l[2], acc[KS][4];
  float t[2];  // quantized tier: raise m when a score (units of 1 / LS) exceeds t
};

__device__ __forceinline__ void softmax_update(State& st, float (&s)[4], float (&alpha)[2]) {
  float mx0 = warp_max8(fmaxf(s[0], s[2]));
  float mx1 = warp_max8(fmaxf(s[1], s[3]));
  float mn0 = fmaxf(st.m[0], mx0), mn1 = fmaxf(st.m[1], mx1);
  alpha[0] = ex2(st.m[0] - mn0);  // m = -inf at start: ex2(-inf) = 0
  alpha[1] = ex2(st.m[1] - mn1);
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
