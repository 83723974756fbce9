// EXPERIMENT, not product code (issue 30; docs/kernels.md section 7, docs/perf-notes.md
// "Next", decision run (b)). Built by benchmarks/decode_v2.py into a library of its own;
// the engine's library (csrc/decode_sm90.cu) is untouched and never holds these binaries.
//
// What it is: the csrc decode kernel (policy off and the constant-time walks) with its pipe
// consumer on the next arithmetic contract (docs/kernels.md section 7), the contract measured in prefill by
// benchmarks/csrc/prefill_v2_sm90.cu variant 39 (v2fma_fold512). A decode row must give
// that prefill's bits for the same position (benchmarks/decode_v2.py --probe checks it):
//   - KV steps of 128 positions at absolute multiples of 128: two of the ring's
//     64-position stages per step; one row max, one alpha, one rescale of O per step;
//   - FA3's exponent form: masked scores -inf by select, m = max(m, rowmax(raw) * scale),
//     p = ex2(fma(s, scale, -m)), alpha = select_ex2(m_old, m);
//   - per-lane row sums: lane (row, q) adds its own column pairs; the step's 16 groups
//     meet in the contract's order (v2_arith.cuh step_tree: tree4 of the quads g0..g3, g4..g7,
//     g8..g11, g12..g15), where warp w of the S pair holds groups 4w..4w+3 of the step's first
//     stage and 8+4w..8+4w+3 of its second: each warp adds its two quads, the pair
//     exchanges them through shared memory per lane; l = fma(l, alpha, tree) per lane;
//     the four lanes meet once per split, (x + lane^2) + lane^1 (v2::quad_lanes);
//   - splits of 512 positions at absolute multiples of 512 (today's split grid, producer,
//     merge and workspace unchanged), folded or merged with compat's fold and finalize.
// O accumulates the step's P V over its 128 positions as 8 k16 slices in order (the two
// stages one after the other), after one rescale: the wgmma chain of the prefill.
//
// Variant codes of dhp_decode_v2_sm90: the product's codes (the same binaries built by
// the same nvcc: a like-for-like baseline) and 4 + 8 * (kPipe | kV2 [| kConstTime
// [| kBucketPerReq]]), this consumer, two stages x two CTAs per SM. bf16 and fp16;
// GROUP <= 16 (the mma.sync tile).
//
// The off binaries are not constant-time, as the product's: the walk, the mask branch and
// the V-tail zeroing follow the true length (policy off). The CT binaries (kConstTime) walk
// the product's constant-time walk (work_ct: the public bucket over the request's reserved
// table line, decode_sm90.cu "constant-time walk") with its remedies on 128-position
// steps: every score masked by select, V past the true length zeroed in the fragments
// (pv_step_mma's keep mask), the dead steps (every position past the row's end) run
// unmasked and are dropped by the commit's selection, a dead split stores the filler; no
// branch, trip count or address follows the true length (step_role_v2).

#define dhp_decode_sm90 dhp_decode_sm90_product_entry  // this library exports its own entry
#include "decode_sm90.cu"
#undef dhp_decode_sm90

#include "v2_arith.cuh"  // the contract's row operations, shared with prefill_v2_sm90.cu

namespace dhp {
namespace {

constexpr int kV2 = 512;         // the variant option bit of this consumer
constexpr int kStepV2 = v2::kStepKV;  // positions per arithmetic step
static_assert(kSplitKV % kStepV2 == 0, "a split is whole 128-position steps");

// Shared memory: Q | K stages | V stages | P [2 buffers][2 stage halves] of 16 x 64
// 16-bit | row values (2 KB) | mbarriers, 1 KB aligned. The producer's offsets (Q, K, V)
// are those of the product's Layout.
template <int STAGES, bool SMALL_Q>
struct LayoutV2 {
  static constexpr int kOffK = QTile<SMALL_Q>::kBytes;
  static constexpr int kOffV = kOffK + STAGES * kTile;
  static constexpr int kOffP = kOffV + STAGES * kTile;
  static constexpr int kPHalf = 16 * 128;
  static constexpr int kOffRed = kOffP + 4 * kPHalf;
  static constexpr int kOffBar = kOffRed + 2048;
  static constexpr int kBytes = kOffBar + 8 * RingBarriers<STAGES>::kCount + 1024;
  static_assert(kOffK == Layout<STAGES, SMALL_Q, false>::kOffK && kOffV == Layout<STAGES, SMALL_Q, false>::kOffV,
                "produce() fills the product layout's stages");
};
// CT binaries: a 128-position step whose positions all lie at or past the row's end is dead;
// the split's committed state is its state at its last live step (decode_sm90.cu step_role,
// on 128-position steps). dead and commit feed selects only.
template <int OPT>
__device__ __forceinline__ StepRole step_role_v2(const Work& w, int j, int je) {
  const int kv0 = j * kStep;
  const bool dead = kWalk<OPT> != 0 && kv0 >= w.ext;
  const bool commit = !dead & ((j + 2 == je) | (kv0 + kStepV2 >= w.ext));
  return {dead, commit};
}

// Row values (floats): max [2 warps][16 rows], alpha [2 buffers][16], coef [2 buffers][16][al, be],
// inv [16]; the P ring's barriers at byte kPipeBarOff (768); per-lane sums [2 warps][32 lanes][4].
constexpr int kV2Max = 0, kV2Alpha = 32, kV2Coef = 64, kV2Inv = 128, kV2Lsum = 256;
static_assert(kV2Inv + 16 <= kPipeBarOff / 4 && kPipeBarOff + 32 <= 4 * kV2Lsum, "row-value areas overlap");

// warps 0-1 (S): warp w computes S for positions [32 w, 32 w + 32) of each of the step's
// two stages (s[16 h + 4 nt + e]: stage h, n8 tile nt), the v2 softmax, P into buffer b;
// warps 2-3 (PV): warp w' rescales O once per step and accumulates the two stages' P V
// for columns [64 w', 64 w' + 64). The P ring and the stage ring as consume_mma_pipe.
template <bool BF16, int STAGES, bool WRITE_PARTIALS, bool SMALL_Q, int OPT>
__device__ __forceinline__ void consume_v2(const Params& p, const Work& w, uint8_t* smem_ptr, uint32_t smem,
                                           const Barriers<STAGES>& bar, int kvh, int t) {
  constexpr bool kCT = kWalk<OPT> != 0;
  using L = LayoutV2<STAGES, SMALL_Q>;
  using Q = QTile<SMALL_Q>;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const int r_lo = lane / 4, r_hi = r_lo + 8, c2 = 2 * (lane % 4);
  const bool ok_lo = r_lo < p.group, ok_hi = r_hi < p.group;
  const int head_lo = kvh * p.group + r_lo, head_hi = kvh * p.group + r_hi;
  float* rv = reinterpret_cast<float*>(smem_ptr + L::kOffRed);
  const PipeBarriers pb{smem + L::kOffRed + kPipeBarOff};
  const int n_steps = cta_steps(w);  // 64-position stages (an even number: whole 128-position steps)

  if (warp < 2) {  // ---- S pair
    const int ws = warp;
    mbar_wait(bar.q_full(), 0);
    uint32_t qa[8][4];
    {
      const int qr = SMALL_Q ? lane % 8 : lane % 16;
#pragma unroll
      for (int kk = 0; kk < 8; ++kk)
        ldmatrix_x4<false>(qa[kk], smem + (kk / 4) * Q::kHalfBytes + sw128_offset(qr, (kk % 4) * 2 + lane / 16));
    }
    const int lim = w.ext - 1;
    float mr_lo = kMInit, mr_hi = kMInit, lr_lo = 0.f, lr_hi = 0.f;  // running state (fold mode), l quad-summed
    int k = 0;
    for (int sp = w.s_lo; sp < w.s_end; sp += w.s_stride) {
      enter_split<WRITE_PARTIALS>(w, sp);
      float m_lo = kMInit, m_hi = kMInit, l_lo = 0.f, l_hi = 0.f;  // this split's state, l per lane
      float mc_lo = kMInit, mc_hi = kMInit, lc_lo = 0.f, lc_hi = 0.f;  // CT split mode: the committed state
      const int je = split_end(w, sp);
      for (int j = split_first(sp); j < je; j += 2, k += 2) {
        const int u = k / 2, b = u % 2;
        const StepRole role = step_role_v2<OPT>(w, j, je);
        float s[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = -0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int st = (k + h) % STAGES;
          const uint32_t k_base = smem + L::kOffK + st * kTile;
          mbar_wait(bar.k_full(st), ((k + h) / STAGES) & 1);
#pragma unroll
          for (int kk = 0; kk < 8; ++kk) {
            const int c = 2 * kk + (lane / 8) % 2;
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {  // positions 32 ws + 16 hh + [0, 16): two n8 tiles
              uint32_t kb[4];
              ldmatrix_x4<false>(kb, k_base + (c / 8) * kHalf +
                                         sw128_offset(32 * ws + 16 * hh + 8 * (lane / 16) + lane % 8, c % 8));
              mma_m16n8k16<BF16>(*reinterpret_cast<float(*)[4]>(&s[16 * h + 8 * hh]), qa[kk], kb[0], kb[1]);
              mma_m16n8k16<BF16>(*reinterpret_cast<float(*)[4]>(&s[16 * h + 8 * hh + 4]), qa[kk], kb[2], kb[3]);
            }
          }
          __syncwarp();
          if (lane == 0) mbar_arrive(bar.k_empty(st));
        }
        const int kv0 = j * kStep;  // the 128-position step's first position
        // off: a branch on the (public) length; CT: every step, by select (a dead step unmasked)
        if (kCT || kv0 + kStepV2 > w.ext) {
          const int lim_s = kCT ? ct::select_int(role.dead, INT_MAX, lim) : lim;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int col = kv0 + 64 * (i / 4) + 32 * ws + 8 * (i % 4) + c2;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              s[4 * i + e] = col + e > lim_s ? -INFINITY : s[4 * i + e];
              s[4 * i + 2 + e] = col + e > lim_s ? -INFINITY : s[4 * i + 2 + e];
            }
          }
        }
        float mx_lo = s[0], mx_hi = s[2];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          mx_lo = fmaxf(mx_lo, fmaxf(s[4 * i], s[4 * i + 1]));
          mx_hi = fmaxf(mx_hi, fmaxf(s[4 * i + 2], s[4 * i + 3]));
        }
        mx_lo = quad_max(mx_lo);
        mx_hi = quad_max(mx_hi);
        if (lane % 4 == 0) {
          rv[kV2Max + ws * 16 + r_lo] = mx_lo;
          rv[kV2Max + ws * 16 + r_hi] = mx_hi;
        }
        named_barrier(kBarRows, 64);
        mx_lo = fmaxf(rv[kV2Max + r_lo], rv[kV2Max + 16 + r_lo]);
        mx_hi = fmaxf(rv[kV2Max + r_hi], rv[kV2Max + 16 + r_hi]);
        // The max over the step's raw scores, then scaled: prefill_v2's fmaxf(m, quad_max(mx) * scale)
        // (rounding is monotonic, so the max of the scaled values is the scaled max).
        const float new_lo = v2::step_max(m_lo, mx_lo, p.qk_scale);
        const float new_hi = v2::step_max(m_hi, mx_hi, p.qk_scale);
        const float a_lo = select_ex2(m_lo, new_lo), a_hi = select_ex2(m_hi, new_hi);
        m_lo = new_lo;
        m_hi = new_hi;
        if (u >= 2) mbar_wait(pb.empty(b), ((u / 2) - 1) & 1);  // the PV pair is done with buffer b
        float quad_lo[2], quad_hi[2];  // this warp's two quads of group sums (stage 0, stage 1)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t p_tile = smem + L::kOffP + (2 * b + h) * L::kPHalf;
          float g_lo[4], g_hi[4];
#pragma unroll
          for (int nt = 0; nt < 4; ++nt) {
            float* x = &s[16 * h + 4 * nt];
            x[0] = v2::exp_score(x[0], p.qk_scale, new_lo);
            x[1] = v2::exp_score(x[1], p.qk_scale, new_lo);
            x[2] = v2::exp_score(x[2], p.qk_scale, new_hi);
            x[3] = v2::exp_score(x[3], p.qk_scale, new_hi);
            g_lo[nt] = v2::pair_sum(x[0], x[1]);
            g_hi[nt] = v2::pair_sum(x[2], x[3]);
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(p_tile + sw128_offset(r_lo, 4 * ws + nt) + 2 * c2),
                         "r"(pack2<BF16>(x[0], x[1])) : "memory");
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(p_tile + sw128_offset(r_hi, 4 * ws + nt) + 2 * c2),
                         "r"(pack2<BF16>(x[2], x[3])) : "memory");
          }
          quad_lo[h] = v2::tree4(g_lo[0], g_lo[1], g_lo[2], g_lo[3]);
          quad_hi[h] = v2::tree4(g_hi[0], g_hi[1], g_hi[2], g_hi[3]);
        }
        reinterpret_cast<float4*>(rv + kV2Lsum)[ws * 32 + lane] =
            make_float4(quad_lo[0], quad_hi[0], quad_lo[1], quad_hi[1]);
        named_barrier(kBarRows, 64);  // also: both warps have read the maxima
        {
          const float4 w0 = reinterpret_cast<const float4*>(rv + kV2Lsum)[lane];
          const float4 w1 = reinterpret_cast<const float4*>(rv + kV2Lsum)[32 + lane];
          // v2::step_tree: tree4 of the quads g0..g3 (warp 0, stage 0), g4..g7 (warp 1, stage 0),
          // g8..g11 (warp 0, stage 1), g12..g15 (warp 1, stage 1)
          l_lo = v2::step_l(l_lo, a_lo, v2::tree4(w0.x, w1.x, w0.z, w1.z));
          l_hi = v2::step_l(l_hi, a_hi, v2::tree4(w0.y, w1.y, w0.w, w1.w));
        }
        if (ws == 0 && lane % 4 == 0) {
          rv[kV2Alpha + 16 * b + r_lo] = a_lo;
          rv[kV2Alpha + 16 * b + r_hi] = a_hi;
        }
        if constexpr (kCT) {  // the commit (step_role_v2), by selection
          if constexpr (WRITE_PARTIALS) {  // per-lane l: the quad meets at the split's end
            mc_lo = ct::select_f32(role.commit, m_lo, mc_lo);
            mc_hi = ct::select_f32(role.commit, m_hi, mc_hi);
            lc_lo = ct::select_f32(role.commit, l_lo, lc_lo);
            lc_hi = ct::select_f32(role.commit, l_hi, lc_hi);
          } else {  // the fold of this step's state, computed every step, kept at the commit
            float mf_lo = mr_lo, lf_lo = lr_lo, mf_hi = mr_hi, lf_hi = lr_hi;
            const FoldCoef c_lo = fold_stats(mf_lo, lf_lo, m_lo, v2::quad_lanes(l_lo));
            const FoldCoef c_hi = fold_stats(mf_hi, lf_hi, m_hi, v2::quad_lanes(l_hi));
            mr_lo = ct::select_f32(role.commit, mf_lo, mr_lo);
            lr_lo = ct::select_f32(role.commit, lf_lo, lr_lo);
            mr_hi = ct::select_f32(role.commit, mf_hi, mr_hi);
            lr_hi = ct::select_f32(role.commit, lf_hi, lr_hi);
            if (ws == 0 && lane % 4 == 0) {
              rv[kV2Coef + 32 * b + 2 * r_lo] = c_lo.al;
              rv[kV2Coef + 32 * b + 2 * r_lo + 1] = c_lo.be;
              rv[kV2Coef + 32 * b + 2 * r_hi] = c_hi.al;
              rv[kV2Coef + 32 * b + 2 * r_hi + 1] = c_hi.be;
            }
          }
        }
        if (j + 2 == je) {  // the split's end: its l over the quad, then what the PV pair needs
          if constexpr (WRITE_PARTIALS) {
            // CT: the committed state (neutral for a dead split)
            const float lq_lo = v2::quad_lanes(kCT ? lc_lo : l_lo), lq_hi = v2::quad_lanes(kCT ? lc_hi : l_hi);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              if (ws != 0 || lane % 4 != 0 || !(h == 0 ? ok_lo : ok_hi)) continue;
              const int64_t row = (static_cast<int64_t>(sp) * p.num_tokens + t) * p.num_heads +
                                  (h == 0 ? head_lo : head_hi);
              p.ws_m[row] = h == 0 ? (kCT ? mc_lo : m_lo) : (kCT ? mc_hi : m_hi);
              p.ws_l[row] = h == 0 ? lq_lo : lq_hi;
            }
          } else if constexpr (kCT) {  // (folded and committed above)
            if (ws == 0 && lane % 4 == 0 && last_split(w, sp)) {
              rv[kV2Inv + r_lo] = finalize_inv(lr_lo);
              rv[kV2Inv + r_hi] = finalize_inv(lr_hi);
            }
          } else {
            const float lq_lo = v2::quad_lanes(l_lo), lq_hi = v2::quad_lanes(l_hi);
            const FoldCoef c_lo = fold_stats(mr_lo, lr_lo, m_lo, lq_lo), c_hi = fold_stats(mr_hi, lr_hi, m_hi, lq_hi);
            if (ws == 0 && lane % 4 == 0) {
              rv[kV2Coef + 32 * b + 2 * r_lo] = c_lo.al;
              rv[kV2Coef + 32 * b + 2 * r_lo + 1] = c_lo.be;
              rv[kV2Coef + 32 * b + 2 * r_hi] = c_hi.al;
              rv[kV2Coef + 32 * b + 2 * r_hi + 1] = c_hi.be;
              if (last_split(w, sp)) {
                rv[kV2Inv + r_lo] = finalize_inv(lr_lo);
                rv[kV2Inv + r_hi] = finalize_inv(lr_hi);
              }
            }
          }
        }
        mbar_arrive(pb.full(b));  // every S thread: its P and row values are written
      }
    }
    return;
  }

  // ---- PV pair
  const int wv = warp - 2, tv = tid - 64;
  float acc[32];
  float run[WRITE_PARTIALS ? 1 : 32];
  if constexpr (!WRITE_PARTIALS) {
#pragma unroll
    for (int i = 0; i < 32; ++i) run[i] = 0.f;
  }
  auto store_out_rows = [&](float inv_lo, float inv_hi) {  // fold mode: the CTA's output rows
    if constexpr (!WRITE_PARTIALS) {
      if (ok_lo) store_out_half<BF16, 8>(p, t, head_lo, 64 * wv + c2, run, 0, inv_lo);
      if (ok_hi) store_out_half<BF16, 8>(p, t, head_hi, 64 * wv + c2, run, 1, inv_hi);
    }
  };
  float acc_c[(kCT && WRITE_PARTIALS) ? 32 : 1];  // CT split mode: the committed accumulator
  int k = 0;
  for (int sp = w.s_lo; sp < w.s_end; sp += w.s_stride) {
    enter_split<WRITE_PARTIALS>(w, sp);
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;
    if constexpr (kCT && WRITE_PARTIALS) {
#pragma unroll
      for (int i = 0; i < 32; ++i) acc_c[i] = 0.f;
    }
    const int je = split_end(w, sp);
    for (int j = split_first(sp); j < je; j += 2, k += 2) {
      const int u = k / 2, b = u % 2;
      const StepRole role = step_role_v2<OPT>(w, j, je);
      mbar_wait(pb.full(b), (u / 2) & 1);
      scale_rows(acc, rv[kV2Alpha + 16 * b + r_lo], rv[kV2Alpha + 16 * b + r_hi]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int st = (k + h) % STAGES;
        const uint32_t v_base = smem + L::kOffV + st * kTile, p_tile = smem + L::kOffP + (2 * b + h) * L::kPHalf;
        mbar_wait(bar.v_full(st), ((k + h) / STAGES) & 1);
        // V rows at positions >= seq_len zeroed (0 * NaN): the last page's unwritten slots,
        // and a whole stage past the end (the step's second stage re-reads the last page).
        // off: in shared memory behind a branch; CT: in the fragments by a mask (but for a
        // dead step, which runs on what its pages hold).
        if constexpr (!kCT) {
          const int valid = w.seq_len - (j + h) * kStep;
          if (valid < kStep)
            zero_v_tail<kStep, 64>(smem_ptr + L::kOffV + st * kTile, max(valid, 0), tv, kBarVTail,
                                   (OPT & kPairedV) ? p.box_rows : kStep);
        }
        const int v_len = kCT ? ct::select_int(role.dead, INT_MAX, w.seq_len) : w.seq_len;
        pv_step_mma<BF16, 4, OPT>(acc, p, p_tile, v_base, 8 * wv, lane, (j + h) * kStep, v_len);
        __syncwarp();
        if (lane == 0) mbar_arrive(bar.v_empty(st));
      }
      if constexpr (kCT) {  // the commit (step_role_v2), by selection
        if constexpr (WRITE_PARTIALS) {
#pragma unroll
          for (int i = 0; i < 32; ++i) acc_c[i] = ct::select_f32(role.commit, acc[i], acc_c[i]);
        } else {  // the fold the S pair computed for this step, kept at the commit
          const FoldCoef c_lo{rv[kV2Coef + 32 * b + 2 * r_lo], rv[kV2Coef + 32 * b + 2 * r_lo + 1]};
          const FoldCoef c_hi{rv[kV2Coef + 32 * b + 2 * r_hi], rv[kV2Coef + 32 * b + 2 * r_hi + 1]};
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const float f0 = fold_value(run[4 * i], acc[4 * i], c_lo);
            const float f1 = fold_value(run[4 * i + 1], acc[4 * i + 1], c_lo);
            const float f2 = fold_value(run[4 * i + 2], acc[4 * i + 2], c_hi);
            const float f3 = fold_value(run[4 * i + 3], acc[4 * i + 3], c_hi);
            run[4 * i] = ct::select_f32(role.commit, f0, run[4 * i]);
            run[4 * i + 1] = ct::select_f32(role.commit, f1, run[4 * i + 1]);
            run[4 * i + 2] = ct::select_f32(role.commit, f2, run[4 * i + 2]);
            run[4 * i + 3] = ct::select_f32(role.commit, f3, run[4 * i + 3]);
          }
        }
      }
      if (j + 2 == je) {
        if constexpr (kCT && WRITE_PARTIALS) {
          // A dead split of a row with positions stores its evolving accumulator, made finite and
          // non-negative, where the neutral state holds zeros (decode_sm90.cu consume_mma_pipe: the
          // merge multiplies it by +0, the bits are the same, and the stored values follow no length).
          const bool filler = (split_first(sp) * kStep >= w.ext) & (w.ext > 0);
#pragma unroll
          for (int i = 0; i < 32; ++i) {
            const float a = fabsf(acc[i]);
            acc_c[i] = ct::select_f32(filler, a <= 3.4028234663852886e38f ? a : 0.f, acc_c[i]);
          }
        }
        if constexpr (WRITE_PARTIALS) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (h == 0 ? !ok_lo : !ok_hi) continue;
            const int64_t row = (static_cast<int64_t>(sp) * p.num_tokens + t) * p.num_heads +
                                (h == 0 ? head_lo : head_hi);
            if constexpr (kCT)
              store_split_half<8>(p, row, 64 * wv + c2, acc_c, h);
            else
              store_split_half<8>(p, row, 64 * wv + c2, acc, h);
          }
        } else if constexpr (!kCT) {  // (CT: committed above)
          const FoldCoef c_lo{rv[kV2Coef + 32 * b + 2 * r_lo], rv[kV2Coef + 32 * b + 2 * r_lo + 1]};
          const FoldCoef c_hi{rv[kV2Coef + 32 * b + 2 * r_hi], rv[kV2Coef + 32 * b + 2 * r_hi + 1]};
          fold_values(run, acc, c_lo, c_hi);
        }
      }
      float inv_lo = 1.f, inv_hi = 1.f;
      if (!WRITE_PARTIALS && k + 2 == n_steps) {
        inv_lo = rv[kV2Inv + r_lo];
        inv_hi = rv[kV2Inv + r_hi];
      }
      mbar_arrive(pb.empty(b));
      if (k + 2 == n_steps) store_out_rows(inv_lo, inv_hi);
    }
  }
  // No position to attend (padding rows, empty requests): zeros, as the fold of nothing.
  if (n_steps == 0) store_out_rows(finalize_inv(0.f), finalize_inv(0.f));
}

template <bool BF16, int STAGES, bool WRITE_PARTIALS, int MIN_BLOCKS, bool SMALL_Q, int OPT>
__global__ void __launch_bounds__(kThreads, MIN_BLOCKS)
    decode_v2_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                     const __grid_constant__ CUtensorMap tm_v, const Params p) {
  using L = LayoutV2<STAGES, SMALL_Q>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = (1024 - (raw & 1023)) & 1023;
  uint8_t* smem_ptr = smem_raw + pad;
  const uint32_t smem = raw + pad;
  const Barriers<STAGES> bar{smem + L::kOffBar};
  const int kvh = blockIdx.x, chunk = blockIdx.z;
  int t = blockIdx.y, req = -1;
  if (kWalk<OPT> == 0 && p.order != nullptr) {  // the longest-first schedule, as decode_kernel
    const int2 e = reinterpret_cast<const int2*>(p.order)[blockIdx.y];
    t = e.x;
    req = e.y;
    if (static_cast<unsigned>(t) >= static_cast<unsigned>(p.num_tokens) ||
        static_cast<unsigned>(req) > static_cast<unsigned>(p.num_seqs))
      return;
  }
  Work w;
  if constexpr (kWalk<OPT> != 0)
    w = work_ct<kWalk<OPT>>(p, t, chunk, WRITE_PARTIALS);
  else
    w = work_of(p, t, req, chunk, WRITE_PARTIALS);
  // Whole 128-position steps: the walk's 64-position stages rounded up to an even count
  // (off: of the true length; CT: of the bucket, a public count). A split (512) is four
  // steps, so n_split, the split schedule and the merge are unchanged; the producer reads
  // the last page again for a stage past the end (the consumer masks it).
  w.n_kv = 2 * ((w.n_kv + 1) / 2);
  if (threadIdx.x == 0) {
    bar.init(2);  // two warps release each stage (the S pair K, the PV pair V)
    PipeBarriers{smem + L::kOffRed + kPipeBarOff}.init();
  }
  __syncthreads();
  if (threadIdx.x >= 128)
    produce<STAGES, SMALL_Q, WRITE_PARTIALS, OPT>(p, w, &tm_q, &tm_k, &tm_v, smem, bar, kvh, t);
  else
    consume_v2<BF16, STAGES, WRITE_PARTIALS, SMALL_Q, OPT>(p, w, smem_ptr, smem, bar, kvh, t);
}

template <bool BF16, bool WRITE_PARTIALS, bool SMALL_Q, int OPT>
int launch_v2(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& p, dim3 grid,
              cudaStream_t stream) {
  constexpr int kStages = 2, kMinBlocks = 2;
  auto kernel = decode_v2_kernel<BF16, kStages, WRITE_PARTIALS, kMinBlocks, SMALL_Q, OPT>;
  constexpr int bytes = LayoutV2<kStages, SMALL_Q>::kBytes;
  static_assert((bytes + 1024) * kMinBlocks <= 228 * 1024, "the stages must fit two CTAs per SM");
  static bool configured = false;
  if (!configured) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return static_cast<int>(e);
    configured = true;
  }
  if (p.order != nullptr) {
    order_kernel<<<1, kOrderThreads, 0, stream>>>(p, reinterpret_cast<int2*>(const_cast<int*>(p.order)));
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return static_cast<int>(e);
  }
  kernel<<<grid, kThreads, bytes, stream>>>(tq, tk, tv, p);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || !WRITE_PARTIALS) return static_cast<int>(e);
  cudaLaunchConfig_t cfg = {};  // the merge as a programmatic dependent launch, as launch()
  cfg.gridDim = dim3(p.num_tokens, p.num_heads);
  cfg.blockDim = dim3(kHead);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return static_cast<int>(cudaLaunchKernelEx(&cfg, merge_kernel<BF16, kWalk<OPT>>, p));
}

template <bool BF16, bool WRITE_PARTIALS, int OPT>
int launch_v2_opt(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& p, dim3 grid,
                  cudaStream_t st) {
  if (p.group > kMmaMaxGroup) return -7;  // the mma.sync tile holds 16 rows
  if (p.group > 8) return launch_v2<BF16, WRITE_PARTIALS, false, OPT>(tq, tk, tv, p, grid, st);
  return launch_v2<BF16, WRITE_PARTIALS, true, OPT>(tq, tk, tv, p, grid, st);
}

template <bool BF16, bool WRITE_PARTIALS>
int launch_any(int variant, const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& p,
               dim3 grid, cudaStream_t st) {
  switch (variant) {
    case 4 + 8 * (kPipe | kV2): return launch_v2_opt<BF16, WRITE_PARTIALS, kPipe>(tq, tk, tv, p, grid, st);
    case 4 + 8 * (kPipe | kV2 | kConstTime):
      return launch_v2_opt<BF16, WRITE_PARTIALS, kPipe | kConstTime>(tq, tk, tv, p, grid, st);
    case 4 + 8 * (kPipe | kV2 | kConstTime | kBucketPerReq):
      return launch_v2_opt<BF16, WRITE_PARTIALS, kPipe | kConstTime | kBucketPerReq>(tq, tk, tv, p, grid, st);
    default: return launch_variant<BF16, WRITE_PARTIALS>(variant, tq, tk, tv, p, grid, st);
  }
}

}  // namespace
}  // namespace dhp

// The product entry's arguments and setup (csrc/decode_sm90.cu dhp_decode_sm90: tensor maps,
// Params), repeated here so that csrc/ stays byte for byte what G4's report measured
// (timing.MEASURED_CODE) until the migration. Returns 0, a cudaError_t, or the product's codes.
extern "C" int dhp_decode_v2_sm90(const void* q, int64_t q_tok_stride, int64_t q_head_stride, const void* k,
                                  const void* v, int64_t kv_block_stride, int64_t kv_head_stride,
                                  int64_t kv_tok_stride, int num_blocks, void* out, int64_t out_tok_stride,
                                  int64_t out_head_stride, const int* block_table, int64_t bt_stride,
                                  const int* seq_lens, const int* query_start_loc, int num_seqs, int num_q_rows,
                                  int num_tokens, int num_heads, int num_kv_heads, int block_size, float qk_scale,
                                  int causal, int is_bf16, int variant, float* ws_acc, float* ws_m, float* ws_l,
                                  int n_split_grid, int spp, int* order_ws, int l_scalar, const int* bucket,
                                  int max_blocks, void* stream) {
  using namespace dhp;
  const tma::EncodeTiled encode = tma::encode_fn();
  if (!encode) return -1;
  const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  if (group <= 0 || group > kRows || group * num_kv_heads != num_heads) return -7;
  CUtensorMap tq, tk, tv;
  if (!tma::encode_q(encode, &tq, is_bf16, q, num_heads, num_q_rows, q_head_stride, q_tok_stride, group, 1))
    return -2;
  const int box_rows = block_size < kStep ? block_size : kStep;
  if (!tma::encode_kv(encode, &tk, is_bf16, k, block_size, num_kv_heads, num_blocks, kv_block_stride,
                      kv_head_stride, kv_tok_stride, box_rows))
    return -3;
  const bool paired_v = variant >= 8 && ((variant / 8) & kPairedV);
  if (!(paired_v ? tma::encode_kv_paired(encode, &tv, is_bf16, v, block_size, num_kv_heads, num_blocks,
                                         kv_block_stride, kv_head_stride, kv_tok_stride, box_rows)
                 : tma::encode_kv(encode, &tv, is_bf16, v, block_size, num_kv_heads, num_blocks, kv_block_stride,
                                  kv_head_stride, kv_tok_stride, box_rows)))
    return -4;
  Params p{};
  p.out = out;
  p.out_tok_stride = out_tok_stride;
  p.out_head_stride = out_head_stride;
  p.ws_acc = ws_acc;
  p.ws_m = ws_m;
  p.ws_l = ws_l;
  p.block_table = block_table;
  p.bt_stride = bt_stride;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.num_heads = num_heads;
  p.block_size = block_size;
  p.box_rows = box_rows;
  p.num_seqs = num_seqs;
  p.num_tokens = num_tokens;
  p.group = group;
  p.n_split_grid = n_split_grid;
  p.qk_scale = qk_scale;
  p.causal = causal;
  p.merge_pdl = 1;
  const bool split = spp > 0;
  const int opts = variant >= 8 ? variant / 8 : 0;
  const bool ct = (opts & kConstTime) != 0;
  p.order = split || ct ? nullptr : order_ws;
  ct::set_walk_params(p, l_scalar, bucket, max_blocks);
  if (ct && (num_seqs < 1 || max_blocks < 1 || ((opts & kBucketPerReq) ? bucket == nullptr : l_scalar < 1)))
    return -8;
  const int chunks = split ? (n_split_grid + spp - 1) / spp : 1;
  if (num_tokens <= 0) return 0;
  if (num_tokens > 65535 || chunks > 65535) return -6;
  if (split && (reinterpret_cast<uintptr_t>(ws_acc) & 15)) return -9;
  const dim3 grid(num_kv_heads, num_tokens, chunks);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (is_bf16)
    return split ? launch_any<true, true>(variant, tq, tk, tv, p, grid, st)
                 : launch_any<true, false>(variant, tq, tk, tv, p, grid, st);
  return split ? launch_any<false, true>(variant, tq, tk, tv, p, grid, st)
               : launch_any<false, false>(variant, tq, tk, tv, p, grid, st);
}
