// Planted kernel for the CUDA SASS gate's tests (tests/test_audit_sass_cuda.py).
// Built once with: nvcc -O3 -std=c++17 -lineinfo -cubin
//   -gencode=arch=compute_90a,code=sm_90a -o planted.cubin planted.cu
#include <cstdint>

struct Params {
  const float* x;
  float* out;
  int n;
};

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm volatile("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

extern "C" __global__ void planted_kernel(const Params p) {
  float acc = 0.f;
  for (int i = threadIdx.x; i < p.n; i += blockDim.x) {  // PUBLIC-LOOP: bound from a parameter
    const float v = p.x[i];
    if (v > 0.f) {  // SECRET-IF: a branch on loaded data (a loop inside: ptxas keeps the branch)
#pragma unroll 1
      for (int k = 0; k < p.n; ++k) acc = acc * v + static_cast<float>(k);
      p.out[i] = acc;
    }
    acc = acc == v ? 1.f : ex2(acc - v);  // TERNARY: nvcc may branch on data here
  }
  // SECRET-BARRIER: which threads arrive at a barrier chosen by loaded data (ptxas predicates the
  // bar.arrive rather than branching around it); PUBLIC-BARRIER: chosen by the thread index.
  if (p.x[threadIdx.x] > 1.f) asm volatile("bar.arrive 1, 64;" ::: "memory");
  if (threadIdx.x < 64) asm volatile("bar.arrive 2, 64;" ::: "memory");
  p.out[threadIdx.x] = acc;
}
