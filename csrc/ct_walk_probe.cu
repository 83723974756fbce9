// Test probe of ct_walk.cuh (not a kernel of the backend): the decoy map as the
// CT kernels compute it, one thread per (request, logical block), so a GPU test
// can compare it with the host's copies (launch.triton_decoy_page, swap_or_not).
#include <cuda_runtime.h>

#include "ct_walk.cuh"

namespace {

__global__ void decoy_pages_kernel(int* out, int num_seqs, int width, int num_blocks, uint32_t magic, uint32_t mult) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (num_seqs + 1) * width) return;
  out[i] = dhp::ct::decoy_page(num_seqs, num_blocks, magic, mult, i / width, i % width);
}

}  // namespace

// out: int32[(num_seqs + 1) * width] on the device (row r = request r, the last row
// the padding pseudo-request). Returns a cudaError_t (0 = success).
extern "C" int dhp_ct_decoy_pages(void* out, int num_seqs, int width, int num_blocks, unsigned magic, unsigned mult,
                                  void* stream) {
  const int n = (num_seqs + 1) * width;
  if (n <= 0) return 0;
  decoy_pages_kernel<<<(n + 255) / 256, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<int*>(out), num_seqs, width, num_blocks, magic, mult);
  return static_cast<int>(cudaGetLastError());
}
