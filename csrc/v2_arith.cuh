// The arithmetic contract's row operations (docs/kernels.md section 7), defined once and used
// by every consumer that routes: csrc/prefill_sm90.cu (consume_v2, consume_v2_ct) and
// csrc/decode_sm90.cu (consume_v2, its constant-time walks), so that a row's operations are
// the same functions in both kernels whatever their tiles: a row's bits do not depend on the
// kernel, the tile, the batch or the policy. Shared with compat_arith.cuh: the mask value
// (-inf by select), kMInit, select_ex2 (alpha and the fold's coefficients), the fold and
// finalize_inv.
//
// Per thread, the m16n8k16 and m64nNk16 accumulator layouts agree: lane (r, q) holds columns
// 8i + 2q and 8i + 2q + 1 of every 8-column group i of its rows. A 128-position step has 16
// groups; its row sum is kept per lane (the lane's own column pairs) and the quad's four lanes
// meet once per split.
#pragma once

#include "compat_arith.cuh"

// The model features a library is compiled with (docs/kernels.md section 7, "Features"): one
// library per feature set, built with -DDHP_WINDOW=1, -DDHP_SOFTCAP=1 and/or -DDHP_SINKS=1
// (dhp_backend/ops/cuda_build.py feature_library), so the plain libraries are the code they were
// and a feature costs only the layers that have it. Both values are public model configuration.
#ifndef DHP_WINDOW
#define DHP_WINDOW 0
#endif
#ifndef DHP_SOFTCAP
#define DHP_SOFTCAP 0
#endif
#ifndef DHP_SINKS
#define DHP_SINKS 0
#endif
// The head size a library is compiled for (-DDHP_HEAD=64: cuda_build.feature_library's head): 128
// (the plain libraries), 64 (gpt-oss), 80 (Phi-2), 96 (Phi-3) or 256 (Gemma-2 9B, Gemma-3 <= 12B).
// Public model configuration, like the features.
#ifndef DHP_HEAD
#define DHP_HEAD 128
#endif

namespace dhp::v2 {

using sm90::ex2;

// Sliding window W (Params::window, >= 1): the query at position i sees keys j with
// i - W < j <= i (vLLM's window: FlashAttention's (W - 1, 0)).
constexpr bool kWindow = DHP_WINDOW != 0;
// Logits soft-capping: a score s becomes c * tanh(s * scale / c), in log2 units for the exponent
// form: soft_cap below; the row arithmetic then runs with scale 1 (score_scale).
constexpr bool kSoftCap = DHP_SOFTCAP != 0;
// Attention sinks (Params::sinks, float32 [num_heads], natural units as the model stores them):
// head h's softmax gets one more logit with no value row. After a row's last split its state is
// folded with the sink's state (m = sinks[h] * log2 e, l = 1, acc = 0) by fold_stats / fold_value,
// the functions that fold splits (sink_fold below): prefill, decode and the merge do it with the
// same operands, so a row keeps its bits. A sink of -inf is an exact no-op (beta selected 0).
constexpr bool kSinks = DHP_SINKS != 0;

constexpr int kStepKV = 128;  // positions per KV step, at absolute multiples of 128

// Head size D and its 64-column halves: every tile of Q, K and V is stored as D / 64 halves of
// 64 columns (128 bytes, one 128-byte swizzle row), so a head of 64 is a tile of one half. A row's
// operations are those of head 128 with D / 16 k16 slices in S = Q K^T and D / 8 output column
// groups: the same contract.
//
// Heads 80 and 96 run on head-128 tiles: kModelHead (the tensors' row) is not kHead (the tiles',
// 128). The TMA maps describe rows of kModelHead columns, so a box of the second half (columns
// 64-127) brings columns 64 to kModelHead - 1 and fills the rest with zeros (out of bounds: no
// memory read, the transaction count is still the whole box). Zero columns of Q and K add exact
// zeros to every score; zero columns of V give zero output columns that are never stored (the
// stores and the CT Q loader stop at kModelHead). So such a row's bits are those of head 128 on the
// zero-padded tensors, and every invariance of the contract carries over unchanged. The cost: the
// tensor work of 128 columns (a third more than head 96 needs, 60 % more than 80; FA3 runs hdim 96
// on 96-column tiles, and 80 on those too); the bytes read are the row's.
//
// Head 256 runs on tiles of its own (four halves): the same contract, whose S = Q K^T sums 16 k16
// slices instead of 8 (a row's operations are head 128's with twice the columns). What changes is
// the prefill's tile: the output accumulator of a 64-row warpgroup is 128 registers, so the prefill
// kernels run without the overlap, with one K and one V stage; policy off on two consumer warpgroups
// whose running states live in global memory (a quarter in shared memory), the constant-time walk on
// one (prefill_sm90.cu).
constexpr int kModelHead = DHP_HEAD;
constexpr int kHead = kModelHead == 64 ? 64 : kModelHead == 256 ? 256 : 128;
constexpr int kHalves = kHead / 64;
static_assert(kModelHead == 64 || kModelHead == 80 || kModelHead == 96 || kModelHead == 128 || kModelHead == 256,
              "head sizes 64, 80, 96, 128 and 256");

// The running max after a step: the max over the step's raw scores (masked ones -inf), times
// the scale (softmax scale x log2 e). Rounding is monotonic: max-then-scale and
// scale-then-max give the same value, so a kernel may take the max across warps first.
__device__ __forceinline__ float step_max(float m, float raw_max, float scale) {
  return fmaxf(m, __fmul_rn(raw_max, scale));
}

// p = 2^(s * scale - m): FA3's exponent form, one fma per score.
__device__ __forceinline__ float exp_score(float s, float scale, float m) { return ex2(__fmaf_rn(s, scale, -m)); }

// The soft cap of a raw score s, in log2 units, in one of two forms chosen by the head size (public;
// cuda_common.soft_cap_constants computes the two constants pre and post of the library's form once
// for every kernel, so prefill and decode give equal bits):
// - head 256 (kTanhCap): tanh(s * pre) * post with pre = scale / c and post = c * log2(e), tanh by
//   the hardware's tanh.approx.f32 (one MUFU.TANH, as FA3's soft cap: cutlass::fast_tanh). On the
//   H200 (2026-11-28, same run as the other form) Gemma-2's cap-50 prefill went from 0.69x to 0.78x
//   FA3 and its decode B16 8K from 0.90x to 0.95x (docs/perf-notes.md lever 56); G4 passes on its
//   window + cap CT prefill (strict and request, docs/audit/2026-11-28-timing-h200-csrc-cap.md).
//   Maximum relative error 2^-10.99 (PTX ISA), below the bfloat16 inputs' 2^-8.
// - every other head: (1 - 2 / (2^(s * pre) + 1)) * post with pre = 2 * scale * log2(e) / c and
//   post = c * log2(e), ex2.approx and div.full. The tanh form was measured there too and G4 failed
//   it: head 128 window + cap + sinks CT prefill, H200, short vs long -0.011 % (t +7.5) strict and
//   -0.085 % (t +54) request, where this form passed (+0.003 %, +0.001 %; the same audit report).
// Both saturate (+-inf gives +-1, never inf / inf); a garbage score (NaN) stays NaN and is masked by
// selection afterwards, as an uncapped one; no data-dependent path. The Triton kernels and the
// reference keep their own tanh: a layer runs on one path (ops.dispatch), so no row's bits are
// compared across them.
constexpr bool kTanhCap = kHead == 256;
__device__ __forceinline__ float soft_cap(float s, float pre, float post) {
  if constexpr (kTanhCap) {
    float t;
    asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(__fmul_rn(s, pre)));
    return __fmul_rn(t, post);
  } else {
    const float e = ex2(__fmul_rn(s, pre));
    return __fmul_rn(__fsub_rn(1.f, sm90::div_full(2.f, __fadd_rn(e, 1.f))), post);
  }
}
// The sink's state of head h as fold_stats takes it (its m; l = 1), for the row whose head index
// is h (clamped: a tile row that holds no head of the group reads a valid entry and is not stored).
__device__ __forceinline__ float sink_m(const float* sinks, int h, int num_heads) {
  return __fmul_rn(sinks[min(h, num_heads - 1)], 1.4426950408889634f);
}

// The scale step_max and exp_score apply: the softmax scale x log2(e), or 1 for capped scores.
__device__ __forceinline__ float score_scale(float qk_scale) { return kSoftCap ? 1.f : qk_scale; }

// A group's own column pair.
__device__ __forceinline__ float pair_sum(float a, float b) { return __fadd_rn(a, b); }

// Four values pairwise: ((a + b) + (c + d)). The step's row-sum tree is tree4 of the four
// quads of groups (0-3, 4-7, 8-11, 12-15), each quad tree4 of its groups' pair sums.
__device__ __forceinline__ float tree4(float a, float b, float c, float d) {
  return __fadd_rn(__fadd_rn(a, b), __fadd_rn(c, d));
}

// The lane's 16 group sums of a step in the contract's order.
__device__ __forceinline__ float step_tree(const float (&g)[16]) {
  return tree4(tree4(g[0], g[1], g[2], g[3]), tree4(g[4], g[5], g[6], g[7]), tree4(g[8], g[9], g[10], g[11]),
               tree4(g[12], g[13], g[14], g[15]));
}

// The tree of a half step (the policy-off prefill's half softmax, prefill_sm90.cu kHalfSoftmax: a step
// whose other 64 positions are masked for every row of the warpgroup, so their 8 group sums are +0):
// step_tree with those 8 at +0 is (A + B) + (+0 + +0) for a live low half and (+0 + +0) + (A + B) for a
// live high half, A and B the live quads' tree4; a sum of p >= +0 plus +0 is itself, so both are A + B,
// which this returns: the same bits as step_tree.
__device__ __forceinline__ float step_tree(const float (&g)[8]) {
  return __fadd_rn(tree4(g[0], g[1], g[2], g[3]), tree4(g[4], g[5], g[6], g[7]));
}

// l after a step, per lane: l * alpha + the step's tree, one fma.
__device__ __forceinline__ float step_l(float l, float alpha, float tree) { return __fmaf_rn(l, alpha, tree); }

// The quad's four lanes, once per split: (x + lane^2) + lane^1, the same bits in every lane.
__device__ __forceinline__ float quad_lanes(float x) {
  x = __fadd_rn(x, __shfl_xor_sync(0xffffffff, x, 2));
  return __fadd_rn(x, __shfl_xor_sync(0xffffffff, x, 1));
}

}  // namespace dhp::v2
