// Host side of the csrc kernels' TMA loads: the driver's cuTensorMapEncodeTiled
// (found at run time, so the libraries link against the runtime only) and the
// tensor maps of ops.paged_attention's Q and K/V layouts (16-bit elements,
// 64-column boxes, 128-byte swizzle). Shared by prefill_sm90.cu and decode_sm90.cu.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace dhp::tma {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

inline EncodeTiled encode_fn() {
  static EncodeTiled fn = nullptr;
  if (!fn) {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault, &q) ==
            cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = reinterpret_cast<EncodeTiled>(ptr);
  }
  return fn;
}

// The K/V maps' L2 promotion: 128 B, a box row of one 64-column half. With 256 B
// promotion the decode kernel read 3-6 % slower on an H200 (same run, same
// kernel; none and 128 B measured alike; docs/perf-notes.md, change 20). Prefill
// did not move either way.
constexpr CUtensorMapL2promotion kKvL2Promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_128B;

inline CUtensorMapDataType dtype(int is_bf16) {
  return is_bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// Q [rows, num_heads, head] (strides in elements): boxes of 64 columns x box_heads
// heads x box_tokens tokens (head / 64 boxes per row). True when the driver accepted the map.
inline bool encode_q(EncodeTiled encode, CUtensorMap* map, int is_bf16, const void* q, int head, int num_heads,
                     int rows, int64_t head_stride, int64_t tok_stride, int box_heads, int box_tokens) {
  const cuuint32_t ones[3] = {1, 1, 1};
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(head), static_cast<cuuint64_t>(num_heads), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_stride * 2), static_cast<cuuint64_t>(tok_stride * 2)};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(box_heads), static_cast<cuuint32_t>(box_tokens)};
  return encode(map, dtype(is_bf16), 3, const_cast<void*>(q), dims, strides, box, ones, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// One KV cache [num_blocks, num_kv_heads, block_size, head] (strides in elements):
// boxes of 64 columns x box_rows slots of one page of one head.
inline bool encode_kv(EncodeTiled encode, CUtensorMap* map, int is_bf16, const void* cache, int head,
                      int block_size, int num_kv_heads, int num_blocks, int64_t block_stride, int64_t head_stride,
                      int64_t tok_stride, int box_rows) {
  const cuuint32_t ones[4] = {1, 1, 1, 1};
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head), static_cast<cuuint64_t>(block_size), static_cast<cuuint64_t>(num_kv_heads),
                              static_cast<cuuint64_t>(num_blocks)};
  const cuuint64_t strides[3] = {static_cast<cuuint64_t>(tok_stride * 2), static_cast<cuuint64_t>(head_stride * 2),
                                 static_cast<cuuint64_t>(block_stride * 2)};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  return encode(map, dtype(is_bf16), 4, const_cast<void*>(cache), dims, strides, box, ones,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, kKvL2Promotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// A head-128 cache with both 64-column halves of box_rows slots in ONE box (a
// 5-d view: column in half, slot, half, head, block; the half's stride is 128 B):
// shared memory receives [half][box_rows][64], 2 x box_rows x 128 B, so a
// 16-token page of one head is one TMA instead of two.
inline bool encode_kv_paired(EncodeTiled encode, CUtensorMap* map, int is_bf16, const void* cache, int block_size,
                             int num_kv_heads, int num_blocks, int64_t block_stride, int64_t head_stride,
                             int64_t tok_stride, int box_rows) {
  const cuuint32_t ones[5] = {1, 1, 1, 1, 1};
  const cuuint64_t dims[5] = {64, static_cast<cuuint64_t>(block_size), 2, static_cast<cuuint64_t>(num_kv_heads),
                              static_cast<cuuint64_t>(num_blocks)};
  const cuuint64_t strides[4] = {static_cast<cuuint64_t>(tok_stride * 2), 128,
                                 static_cast<cuuint64_t>(head_stride * 2), static_cast<cuuint64_t>(block_stride * 2)};
  const cuuint32_t box[5] = {64, static_cast<cuuint32_t>(box_rows), 2, 1, 1};
  return encode(map, dtype(is_bf16), 5, const_cast<void*>(cache), dims, strides, box, ones,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, kKvL2Promotion,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

}  // namespace dhp::tma
