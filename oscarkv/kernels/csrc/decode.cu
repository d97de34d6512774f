// OSCAR paged decode attention over quantized pages, CUDA C++ (sm_80+, mma.sync m16n8k16 + movmatrix).
//
// oscar_decode_split: one CTA = one (split, sequence, KV head); its NW warps take 16-token chunks of the split in
// turn and keep their own online softmax; the CTA merges its warps and writes one partial output + log-sum-exp
// (base 2) per query head. Quantized splits: decode_quant.cuh (key and value codes of 2 or 4 bits, token- or
// channel-page keys). 16-bit splits: the same mma structure on the bf16/fp16 tiers, q split into high and low
// 16-bit parts. oscar_decode_merge combines the splits. Configuration and layout: decode_common.cuh.
#include "decode_quant.cuh"

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
    softmax_update(st, s, alpha);
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

extern "C" __global__ void __launch_bounds__(NW * 32, MINB_) oscar_decode_split(const Params p) {
  __shared__ float sm_m[NW][8], sm_l[NW][8];
#if KCH_  // the prescaled query rows of this KV head (padded: conflict-free float4 reads in channel_q)
  __shared__ __align__(16) float sm_q[8][D + 4];
#endif
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
  const bool is2 = PART_ == 1 || (PART_ == 0 && split < p.num_qsplits);  // CTA-uniform
  float osum[2] = {0.f, 0.f}, vref = 1.f;
  if (is2) {
#if PART_ != 2
    const float* sq = nullptr;
#if KCH_
    {
      const q_t* qb = reinterpret_cast<const q_t*>(p.q) + b * p.sq_b + (int64_t)(h * GQ) * p.sq_h;
      const float sc = (float)p.sm_scale_log2;
      for (int i = threadIdx.x; i < 8 * D; i += NW * 32) {
        const int hh = i / D, d = i % D;
        sm_q[hh][d] = hh < GQ ? q_f(qb[hh * p.sq_h + d]) * sc : 0.f;
      }
      __syncthreads();
      sq = &sm_q[gid][0];
    }
#endif
    const int n = reinterpret_cast<const int32_t*>(p.qlen)[b];
    const int tps = split_tokens(p, n);
    const int lo = split * tps;
    const int hi = min(n, lo + tps);
    run_quant(p, st, osum, vref, b, h, lo, hi, warp, gid, tig, sq);
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
        v = v * (vref / float(1 << (VB * (mt / VH)))) + (e ? os1 : os0);
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
