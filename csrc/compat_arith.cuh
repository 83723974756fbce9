// The Triton kernels' per-row arithmetic (dhp_backend/ops/triton/kernels.py:
// kv_step, row_sum, fold, finalize) as device functions, operation for
// operation, and the tile helpers around it. Shared by the CUDA kernels that
// must give the Triton kernels' bits: prefill_sm90.cu (COMPAT) and
// decode_sm90.cu. Layout facts (per thread of a consumer warpgroup): an m64nN
// wgmma accumulator element 4*i + e is row lane/4 (+8 for e >= 2) of the warp's
// 16, column 8*i + 2*(lane % 4) + (e & 1); "lo"/"hi" name those two rows.
//
// The order, read off Triton 3.6's PTX of the policy-off binaries:
//   KV steps of 64 positions at absolute multiples of 64, splits of SPLIT_KV =
//   512 positions at absolute multiples of 512, each from a fresh state;
//   s = qk * qk_scale (a multiply, then the mask select), m from -FLT_MAX,
//   alpha selected to 1 when the max does not move, p = ex2.approx.ftz(s - m),
//   row sums: own column pair, + lane^2, + lane^1 per 8-column group, then the
//   groups in a pairwise tree; l = fma(l, alpha, rowsum); acc * alpha then the
//   PV wgmma; fold with fma; 1 / l by div.full. The _rn intrinsics keep nvcc
//   from contracting a multiply and an add into an fma where Triton does not.
#pragma once

#include <cstdint>
#include <cmath>

#include "sm90_primitives.cuh"

namespace dhp::compat {

using namespace dhp::sm90;

constexpr int kSplitKV = 512;  // config.SPLIT_KV (positions per split)
constexpr int kStepKV = 64;    // config block_n (positions per KV step)

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

// P (fp32 accumulator layout, N values per thread) -> the
// A-operand registers of the PV wgmma: the k16 slice j is accumulator columns
// 16j..16j+15, i.e. elements 8j..8j+7. N = 64 (a 128-wide step) or 32 (64-wide).
template <bool BF16, int N>
__device__ __forceinline__ void pack_p(const float (&s)[N], uint32_t (&pa)[N / 2]) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
    pa[4 * j + 0] = pack2<BF16>(s[8 * j + 0], s[8 * j + 1]);
    pa[4 * j + 1] = pack2<BF16>(s[8 * j + 2], s[8 * j + 3]);
    pa[4 * j + 2] = pack2<BF16>(s[8 * j + 4], s[8 * j + 5]);
    pa[4 * j + 3] = pack2<BF16>(s[8 * j + 6], s[8 * j + 7]);
  }
}

// V rows at positions >= seq_len (unwritten slots of the last page, repeated
// pages) are zeroed in shared memory before the PV product: P is 0 there, but
// 0 * NaN is NaN. POSITIONS: rows of the V tile, stored as boxes of box_rows
// rows, each box two 64-column halves of box_rows x 128 B ([box][half][row]; the
// default, one box, is [half][POSITIONS rows]). Run by the THREADS threads that
// read the tile (a consumer warpgroup, or decode's two PV warps), tid in
// [0, THREADS), with their own named barrier; where two warpgroups share a tile,
// both write the same zeros.
template <int POSITIONS, int THREADS = 128>
__device__ __forceinline__ void zero_v_tail(uint8_t* v_tile, int valid_rows, int tid, uint32_t barrier_id,
                                            int box_rows = POSITIONS) {
  for (int idx = tid; idx < (POSITIONS - valid_rows) * 16; idx += THREADS) {
    const int row = valid_rows + idx / 16, c = idx % 16;
    uint8_t* line = v_tile + (row / box_rows) * (2 * box_rows * 128) + (c / 8) * (box_rows * 128) +
                    (row % box_rows) * 128;
    reinterpret_cast<uint4*>(line)[c % 8] = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  named_barrier(barrier_id, THREADS);
}

constexpr float kMInit = -3.4028234663852886e38f;

// a == m ? 1 : 2^(a - m), Triton's tl.where: both sides computed, then a selp.
// Written as a C ternary, nvcc compiled it to a PTX branch on the scores (ptxas
// happened to predicate it; the CUDA SASS gate flags the PTX branch all the same).
__device__ __forceinline__ float select_ex2(float a, float m) {
  const float e = ex2(__fsub_rn(a, m));
  float r;
  asm("{\n .reg .pred eq;\n setp.eq.f32 eq, %1, %2;\n selp.f32 %0, 0f3F800000, %3, eq;\n}" : "=f"(r)
      : "f"(a), "f"(m), "f"(e));
  return r;
}

// One 8-column group i of a thread's row pair (s[4i], s[4i+1]: row lo; s[4i+2],
// s[4i+3]: row hi; col = the group's first column of this thread's pair): s * qk_scale,
// then the mask select. The wgmma consumers hold 8 groups per 64-position step, the
// mma.sync consumer (decode_sm90.cu consume_mma) 2.
template <int N>
__device__ __forceinline__ void scale_mask_group(float (&s)[N], int i, int col, int lim_lo, int lim_hi, bool masked,
                                                 float qk_scale) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const float lo = __fmul_rn(s[4 * i + e], qk_scale), hi = __fmul_rn(s[4 * i + 2 + e], qk_scale);
    s[4 * i + e] = (masked && col + e > lim_lo) ? -INFINITY : lo;
    s[4 * i + 2 + e] = (masked && col + e > lim_hi) ? -INFINITY : hi;
  }
}

// Group i: p = 2^(s - m) in place, and the group's row sums (own column pair,
// + lane^2, + lane^1): the row-sum tree's leaves.
template <int N>
__device__ __forceinline__ void exp_group_sums(float (&s)[N], int i, float m_lo, float m_hi, float& g_lo, float& g_hi) {
  s[4 * i] = ex2(__fsub_rn(s[4 * i], m_lo));
  s[4 * i + 1] = ex2(__fsub_rn(s[4 * i + 1], m_lo));
  s[4 * i + 2] = ex2(__fsub_rn(s[4 * i + 2], m_hi));
  s[4 * i + 3] = ex2(__fsub_rn(s[4 * i + 3], m_hi));
  float x = __fadd_rn(s[4 * i], s[4 * i + 1]), y = __fadd_rn(s[4 * i + 2], s[4 * i + 3]);
  x = __fadd_rn(x, __shfl_xor_sync(0xffffffff, x, 2));
  y = __fadd_rn(y, __shfl_xor_sync(0xffffffff, y, 2));
  g_lo = __fadd_rn(x, __shfl_xor_sync(0xffffffff, x, 1));
  g_hi = __fadd_rn(y, __shfl_xor_sync(0xffffffff, y, 1));
}

// One 64-column half: mask, online-softmax update of (m, l), p in place; the
// alphas for the running output come back.
__device__ __forceinline__ void compat_softmax(float (&s)[32], int kv0, int lim_lo, int lim_hi, bool masked,
                                               int lane, float qk_scale, float& m_lo, float& m_hi, float& l_lo,
                                               float& l_hi, float& a_lo, float& a_hi) {
#pragma unroll
  for (int i = 0; i < 8; ++i) scale_mask_group(s, i, kv0 + 8 * i + 2 * (lane % 4), lim_lo, lim_hi, masked, qk_scale);
  float mx_lo = s[0], mx_hi = s[2];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    mx_lo = fmaxf(mx_lo, fmaxf(s[4 * i], s[4 * i + 1]));
    mx_hi = fmaxf(mx_hi, fmaxf(s[4 * i + 2], s[4 * i + 3]));
  }
  const float new_lo = fmaxf(m_lo, quad_max(mx_lo)), new_hi = fmaxf(m_hi, quad_max(mx_hi));
  a_lo = select_ex2(m_lo, new_lo);
  a_hi = select_ex2(m_hi, new_hi);
  m_lo = new_lo;
  m_hi = new_hi;
  float g_lo[8], g_hi[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) exp_group_sums(s, i, new_lo, new_hi, g_lo[i], g_hi[i]);
  auto tree = [](const float (&g)[8]) {
    return __fadd_rn(__fadd_rn(__fadd_rn(g[0], g[1]), __fadd_rn(g[2], g[3])),
                     __fadd_rn(__fadd_rn(g[4], g[5]), __fadd_rn(g[6], g[7])));
  };
  l_lo = __fmaf_rn(l_lo, a_lo, tree(g_lo));
  l_hi = __fmaf_rn(l_hi, a_hi, tree(g_hi));
}

// An accumulator in the wgmma/mma.sync layout (N values: N / 4 groups of lo, lo, hi, hi)
// scaled by its rows' alphas.
template <int N>
__device__ __forceinline__ void scale_rows(float (&o)[N], float a_lo, float a_hi) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    o[4 * i] = __fmul_rn(o[4 * i], a_lo);
    o[4 * i + 1] = __fmul_rn(o[4 * i + 1], a_lo);
    o[4 * i + 2] = __fmul_rn(o[4 * i + 2], a_hi);
    o[4 * i + 3] = __fmul_rn(o[4 * i + 3], a_hi);
  }
}

// kernels.fold, a first then b with the explicit fma of the Triton kernel, in
// two pieces so that every holder of a running state (registers, shared memory,
// the split merge) runs the same operations: fold_stats updates one row's (m, l)
// and returns the row's coefficients, fold_value folds one accumulator value.
struct FoldCoef {
  float al, be;
};
__device__ __forceinline__ FoldCoef fold_stats(float& mr, float& lr, float m, float l) {
  const float m2 = fmaxf(mr, m);
  const FoldCoef c{select_ex2(mr, m2), select_ex2(m, m2)};
  lr = __fmaf_rn(lr, c.al, __fmul_rn(l, c.be));
  mr = m2;
  return c;
}
__device__ __forceinline__ float fold_value(float run, float acc, FoldCoef c) {
  return __fmaf_rn(run, c.al, __fmul_rn(acc, c.be));
}

// An accumulator (wgmma/mma.sync layout: N / 4 groups of lo, lo, hi, hi) folded into
// the running one with its rows' coefficients.
template <int N>
__device__ __forceinline__ void fold_values(float (&run)[N], const float (&acc)[N], FoldCoef lo, FoldCoef hi) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    run[4 * i] = fold_value(run[4 * i], acc[4 * i], lo);
    run[4 * i + 1] = fold_value(run[4 * i + 1], acc[4 * i + 1], lo);
    run[4 * i + 2] = fold_value(run[4 * i + 2], acc[4 * i + 2], hi);
    run[4 * i + 3] = fold_value(run[4 * i + 3], acc[4 * i + 3], hi);
  }
}

// This split's state (m, l, acc) of rows lo/hi folded into the running state (mr, lr, run).
template <int N>
__device__ __forceinline__ void fold_rows(float (&run)[N], float& mr_lo, float& mr_hi, float& lr_lo, float& lr_hi,
                                          const float (&acc)[N], float m_lo, float m_hi, float l_lo, float l_hi) {
  const FoldCoef lo = fold_stats(mr_lo, lr_lo, m_lo, l_lo), hi = fold_stats(mr_hi, lr_hi, m_hi, l_hi);
  fold_values(run, acc, lo, hi);
}

// kernels.finalize's reciprocal: 1 / l with l > 0 selected (div.full); rows
// that saw no position get 1 (their acc is 0).
__device__ __forceinline__ float finalize_inv(float l) { return div_full(1.f, l > 0.f ? l : 1.f); }

}  // namespace dhp::compat
