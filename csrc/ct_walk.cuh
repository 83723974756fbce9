// Pieces of the constant-time walk shared by the csrc kernels' CT binaries
// (prefill_sm90.cu, decode_sm90.cu): branch-free selects, the Triton kernels'
// Barrett reduction (dhp_backend/ops/triton/kernels.py: mod_barrett) and the
// decoy map: the Triton kernels' (kernels.decoy_block) shuffled further
// (swap_or_not). Host copies: launch.mix32, swap_or_not, csrc_decoy_page.
#pragma once

#include <cstdint>

namespace dhp::ct {

// c ? a : b without a branch the compiler could make of a ternary.
__device__ __forceinline__ int select_int(bool c, int a, int b) { return b ^ ((a ^ b) & -static_cast<int>(c)); }
__device__ __forceinline__ uint64_t select_u64(bool c, uint64_t a, uint64_t b) {
  return b ^ ((a ^ b) & (0ull - static_cast<uint64_t>(c)));
}

// kernels.mod_barrett: x mod n for uint32 x, magic = floor((2^32 - 1) / n).
__device__ __forceinline__ uint32_t mod_barrett(uint32_t x, uint32_t n, uint32_t magic) {
  uint32_t y = x - __umulhi(x, magic) * n;
#pragma unroll
  for (int i = 0; i < 3; ++i) y -= n & (0u - static_cast<uint32_t>(y >= n));
  return y;
}

// A 32-bit integer mix (lowbias32; the decoy shuffle's hash).
__device__ __forceinline__ uint32_t mix32(uint32_t v) {
  v ^= v >> 16;
  v *= 0x7FEB352Du;
  v ^= v >> 15;
  v *= 0x846CA68Bu;
  return v ^ (v >> 16);
}

// A pseudo-random bijection of [0, n) (Hoang, Morris and Rogaway's swap-or-not),
// each round pairing x with k - x mod n and swapping by a hash of the pair (an
// involution). Round keys from n alone (public). No branch, no table. Each round
// is x -> x or k - x, so R rounds make a piecewise map x -> +-x + c of up to 2^R
// pieces: 6 rounds left a request's page strides half as varied as a random
// layout's (B64-L4096), 12 match it (tests/test_triton_decoys.py).
// 12 rounds by default; DHP_CT_DECOY_ROUNDS=0 (ops.cuda_build.decoy_rounds_flags)
// builds the Triton kernels' map as it is. Measured on an H200 (docs/perf-notes.md
// change 35): G4 short vs long at B16-L4096 0.72-0.96 % -> 0.19-0.36 %. End to end
// DHP strict-BI 20.66K vs 20.76K total tok/s unshuffled (one run, change 36), once
// the prefill producer computed page ids by its warp: ~450 instructions per page,
// so a kernel computes them in lanes, off its consumers' sub-partition budget.
#ifndef DHP_CT_DECOY_ROUNDS
#define DHP_CT_DECOY_ROUNDS 12
#endif
constexpr int kDecoyRounds = DHP_CT_DECOY_ROUNDS;
__device__ __forceinline__ uint32_t swap_or_not(uint32_t x, uint32_t n, uint32_t magic) {
#pragma unroll
  for (int i = 0; i < kDecoyRounds; ++i) {
    const uint32_t k = mod_barrett(mix32(n ^ (0x9E3779B9u * static_cast<uint32_t>(2 * i + 1))), n, magic);
    const uint32_t p = k - x + (n & (0u - static_cast<uint32_t>(k < x)));
    const uint32_t c = x > p ? x : p;  // max: a min/max instruction, not a branch
    const uint32_t swap = mix32(c ^ (0x85EBCA6Bu * static_cast<uint32_t>(i + 1)) ^ k) & 1u;
    x ^= (x ^ p) & (0u - swap);
  }
  return x;
}

// The page read in place of request r's logical block lb past its true length:
// kernels.decoy_block's x = (lb * (num_seqs + 1) + r) mod n scattered by the
// host's multiplier (launch.decoy_mult, coprime with n = num_blocks), then
// shuffled (swap_or_not), so the decoys' page order has a fragmented cache's
// locality rather than the scatter's lattice, which the TMA walk felt.
__device__ __forceinline__ int decoy_page(int num_seqs, int num_blocks, uint32_t magic, uint32_t mult, int r, int lb) {
  const uint32_t n = static_cast<uint32_t>(num_blocks);
  const uint32_t x = mod_barrett(static_cast<uint32_t>(lb) * static_cast<uint32_t>(num_seqs + 1) +
                                     static_cast<uint32_t>(r), n, magic);
  return static_cast<int>(swap_or_not(mod_barrett(x * mult, n, magic), n, magic));
}

// Host side: the walk's public arguments into a kernel's Params (the CT fields both
// kernels name alike), for the C entry points of prefill_sm90.cu and decode_sm90.cu.
template <class Params>
inline void set_walk_params(Params& p, int l_scalar, const int* bucket, int max_blocks, int num_blocks,
                            uint32_t decoy_magic, uint32_t decoy_mult) {
  p.l_scalar = l_scalar;
  p.bucket = bucket;
  p.max_blocks = max_blocks;
  p.num_blocks = num_blocks;
  p.decoy_magic = decoy_magic;
  p.decoy_mult = decoy_mult;
}

}  // namespace dhp::ct
