// The pieces of the Triton kernels' per-row arithmetic (dhp_backend/ops/triton/kernels.py:
// fold, finalize, the mask value, the initial max, the alpha select) that the csrc
// kernels' contract keeps (docs/kernels.md section 7; its own row operations are in
// v2_arith.cuh), operation for operation, and the tile helpers around them: the running
// max's quad reduction, P packed to 16 bits, a V tile's rows past the length zeroed, an
// accumulator scaled by its rows' alphas. Layout facts (per thread of a consumer
// warpgroup): an m64nN wgmma accumulator element 4*i + e is row lane/4 (+8 for e >= 2)
// of the warp's 16, column 8*i + 2*(lane % 4) + (e & 1); "lo"/"hi" name those two rows.
// The _rn intrinsics keep nvcc from contracting a multiply and an add into an fma where
// the contract does not. (The Triton contract's 64-position softmax step and row-sum
// tree, which the csrc kernels ran before issue 30, are in git history.)
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
// rows, each box HALVES 64-column halves of box_rows x 128 B ([box][half][row]; the
// default, one box, is [half][POSITIONS rows]; HALVES = head size / 64). Run by the THREADS threads that
// read the tile (a consumer warpgroup, or decode's two PV warps), tid in
// [0, THREADS), with their own named barrier; where two warpgroups share a tile,
// both write the same zeros.
template <int POSITIONS, int THREADS = 128, int HALVES = 2>
__device__ __forceinline__ void zero_v_tail(uint8_t* v_tile, int valid_rows, int tid, uint32_t barrier_id,
                                            int box_rows = POSITIONS) {
  for (int idx = tid; idx < (POSITIONS - valid_rows) * 8 * HALVES; idx += THREADS) {
    const int row = valid_rows + idx / (8 * HALVES), c = idx % (8 * HALVES);
    uint8_t* line = v_tile + (row / box_rows) * (HALVES * box_rows * 128) + (c / 8) * (box_rows * 128) +
                    (row % box_rows) * 128;
    reinterpret_cast<uint4*>(line)[c % 8] = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  named_barrier(barrier_id, THREADS);
}

// V rows [0, rows) zeroed, as zero_v_tail the rows past the length (the feature libraries: the
// positions below a sliding window's lowest bound in the walk's first step, which may be the null
// block of pages the window dropped). The default one-box layout only.
template <int POSITIONS, int THREADS = 128, int HALVES = 2>
__device__ __forceinline__ void zero_v_head(uint8_t* v_tile, int rows, int tid, uint32_t barrier_id) {
  for (int idx = tid; idx < rows * 8 * HALVES; idx += THREADS) {
    const int row = idx / (8 * HALVES), c = idx % (8 * HALVES);
    reinterpret_cast<uint4*>(v_tile + (c / 8) * (POSITIONS * 128) + row * 128)[c % 8] = make_uint4(0, 0, 0, 0);
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

// kernels.finalize's reciprocal: 1 / l with l > 0 selected (div.full); rows
// that saw no position get 1 (their acc is 0).
__device__ __forceinline__ float finalize_inv(float l) { return div_full(1.f, l > 0.f ? l : 1.f); }

}  // namespace dhp::compat
