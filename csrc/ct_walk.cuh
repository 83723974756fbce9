// Pieces of the constant-time walk shared by the csrc kernels' CT binaries
// (prefill_sm90.cu, decode_sm90.cu): branch-free selects, the Triton kernels'
// Barrett reduction (dhp_backend/ops/triton/kernels.py: mod_barrett; the prefill
// CT binary's Q rows) and the pages a request's walk reads.
//
// The address rule (docs/design.md section 2): under a constant-time policy request
// r's work reads exactly the pages block_table[r, 0 : ceil(L_r / block_size)], in a
// fixed order, whatever its true length is; L_r is its public bucket. The engine
// reserves those pages for the request (distinct, valid, its own; ops.paged_attention
// checks it), so positions past the true length read memory the request owns and
// are masked by selection. There are no decoy pages any more: pages computed from
// public values in place of the unreserved ones gave a short and a long request
// the same number of reads but a different sequence of addresses, which the
// timing gate measured (H100, +0.5-0.85 % at t ~ 80-130).
#pragma once

#include <cstdint>

namespace dhp::ct {

// c ? a : b without a branch the compiler could make of a ternary.
__device__ __forceinline__ int select_int(bool c, int a, int b) { return b ^ ((a ^ b) & -static_cast<int>(c)); }
__device__ __forceinline__ uint64_t select_u64(bool c, uint64_t a, uint64_t b) {
  return b ^ ((a ^ b) & (0ull - static_cast<uint64_t>(c)));
}

// c ? a : b for a float, by its bits, for a choice made on a secret. Written as a ternary,
// `c ? f(x) : b` lets ptxas guard f's last instruction by c (a prefill commit's fold became 66
// FFMAs guarded by the commit), and an instruction guarded off costs the SM less than one that
// runs: the G4 timing gate measured it (prefill chunk, H200, short vs long +0.039 %, t -12.8;
// every step committing: +0.004 %, t -1.1). The mask form leaves f's instructions unguarded, so
// they run in every step whatever c is; G2 fails a guarded floating-point instruction on a
// guard it cannot prove public (dhp_backend/audit/guarded.py).
// One lop3 inside an asm block: the operands and the result stay f32 registers in the PTX, so
// a loop-carried float keeps its own register (select_int on the bits made nvcc carry it as a
// b32 register shared with the loop counters' zero, and G2's PTX taint then saw memory in the
// loop bounds).
__device__ __forceinline__ float select_f32(bool c, float a, float b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  float r;
  asm("{\n\t.reg .b32 ta, tb, tr;\n\tmov.b32 ta, %1;\n\tmov.b32 tb, %2;\n\t"
      "lop3.b32 tr, ta, tb, %3, 0xE4;\n\tmov.b32 %0, tr;\n\t}"  // (a & m) | (b & ~m)
      : "=f"(r) : "f"(a), "f"(b), "r"(m));
  return r;
}

// The filler a constant-time walk leaves where the masked form left zeros (a state that steps past the
// true length or below a row's window evolved and that is never committed, docs/kernels.md section 7):
// |x| capped at `cap` (0 beyond, and for NaN), finite and non-negative. The window walks' cap, 1e30,
// keeps a live split's alpha = +0 wiping it and a sum of up to 2^16 of them (decode's merge over a
// prefix of wholly-below splits) finite; decode's dead splits (a suffix, each multiplied by +0 in the
// merge, never summed) take FLT_MAX.
__device__ __forceinline__ float filler_of(float x, float cap = 1e30f) {
  const float a = fabsf(x);
  return a <= cap ? a : 0.f;
}

// kernels.mod_barrett: x mod n for uint32 x, magic = floor((2^32 - 1) / n).
__device__ __forceinline__ uint32_t mod_barrett(uint32_t x, uint32_t n, uint32_t magic) {
  uint32_t y = x - __umulhi(x, magic) * n;
#pragma unroll
  for (int i = 0; i < 3; ++i) y -= n & (0u - static_cast<uint32_t>(y >= n));
  return y;
}

// The table entries a walk to the public bucket ext reads: ceil(ext / block_size),
// kept inside the table line [1, max_blocks] (min/max, no branch). A bucket never
// exceeds the table's capacity (the host checks it); the bounds only keep a read
// of a malformed step inside the line.
__device__ __forceinline__ int walk_pages(int ext, int block_size, int max_blocks) {
  return max(1, min((ext + block_size - 1) / block_size, max_blocks));
}

// The page of logical block lb of a walk over the table line `row` of n_pages
// reserved entries (walk_pages): the entry itself up to the bucket's last page,
// that last page again for the tile rounding past it (a public function of L).
__device__ __forceinline__ int walk_page(const int* row, int n_pages, int lb) { return row[min(lb, n_pages - 1)]; }

// Host side: the walk's public arguments into a kernel's Params (the CT fields both
// kernels name alike), for the C entry points of prefill_sm90.cu and decode_sm90.cu.
template <class Params>
inline void set_walk_params(Params& p, int l_scalar, const int* bucket, int max_blocks) {
  p.l_scalar = l_scalar;
  p.bucket = bucket;
  p.max_blocks = max_blocks;
}

}  // namespace dhp::ct
