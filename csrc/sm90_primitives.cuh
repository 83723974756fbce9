// Hopper (sm_90a) building blocks as thin inline-PTX wrappers: shared-memory
// mbarriers, TMA tile loads, and warpgroup MMA (wgmma) with the 128-byte
// swizzled shared-memory descriptors. Written against the PTX ISA (9.7.14 for
// wgmma, 9.7.9.25 for cp.async.bulk.tensor, 9.7.13.15 for mbarrier); nothing
// here knows about attention.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace dhp::sm90 {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- mbarriers (shared::cta) -------------------------------------------------
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (TMA) before use.
__device__ __forceinline__ void mbar_fence_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also announces `bytes` of TMA traffic the phase must wait for.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Spin until the phase with the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// The mbarriers of a producer/consumer pipeline with one operand loaded once (q)
// and two rings of STAGES stages (k, v), each stage with a "full" barrier (TMA
// bytes landed) and an "empty" one (consumers released it): 1 + 4 STAGES 8-byte
// barriers from `base`. Addresses are computed, not stored (an array indexed by
// the run-time stage would live in local memory).
template <int STAGES>
struct RingBarriers {
  uint32_t base;
  static constexpr int kCount = 1 + 4 * STAGES;
  __device__ uint32_t q_full() const { return base; }
  __device__ uint32_t k_full(int s) const { return base + 8 * (1 + s); }
  __device__ uint32_t v_full(int s) const { return base + 8 * (1 + STAGES + s); }
  __device__ uint32_t k_empty(int s) const { return base + 8 * (1 + 2 * STAGES + s); }
  __device__ uint32_t v_empty(int s) const { return base + 8 * (1 + 3 * STAGES + s); }
  // One thread, before the CTA's first barrier sync: the full barriers complete on
  // one arrival (the producer's, with the TMA bytes), the empty ones on `releases`.
  __device__ void init(uint32_t releases) const {
    mbar_init(q_full(), 1);
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(k_full(s), 1);
      mbar_init(v_full(s), 1);
      mbar_init(k_empty(s), releases);
      mbar_init(v_empty(s), releases);
    }
    mbar_fence_init();
  }
};

// --- TMA tile loads (completion counted in bytes on an mbarrier) ------------
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_load_5d(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2,
                                            int c3, int c4) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, %6}], "
      "[%7];"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}

// cp.async (sm_80+): 16 bytes global -> shared, L2 only (.cg), many in flight per
// thread without registers; cp_async_wait_all commits and waits for this thread's.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
}

// The same loads with an L2 cache policy (PTX 9.7.9.25 .L2::cache_hint), e.g.
// l2_evict_first(): data read once, which should not push out what will be read again.
__device__ __forceinline__ uint64_t l2_evict_first() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void tma_load_4d_hint(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2,
                                                 int c3, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4, %5}], [%6], %7;"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void tma_load_5d_hint(uint32_t dst, const void* map, uint32_t bar, int c0, int c1, int c2,
                                                 int c3, int c4, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint "
      "[%0], [%1, {%2, %3, %4, %5, %6}], [%7], %8;"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar),
        "l"(policy)
      : "memory");
}

// Ordinary stores to shared memory that the async proxy (wgmma, TMA) reads next.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
// Barrier over `threads` threads (a warpgroup) with a named barrier id (1..15).
__device__ __forceinline__ void named_barrier(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Register budget per warpgroup (needs a register cap at entry: __launch_bounds__(threads, 1)).
template <uint32_t N>
__device__ __forceinline__ void regs_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <uint32_t N>
__device__ __forceinline__ void regs_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}

// --- wgmma -------------------------------------------------------------------
// Shared-memory matrix descriptor, 128-byte swizzle (PTX "matrix descriptor"):
// start address, leading- and stride-dimension byte offsets, each >> 4.
// K-major tiles (rows of 64 16-bit elements = 128 B, 8-row atoms of 1 KB): the
// stride offset is the atom pitch (1024 B) and the leading offset is unused.
// MN-major tiles (the B operand read transposed): the leading offset steps
// between 64-element column halves, the stride offset between 8-row atoms.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t saddr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((saddr & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;  // swizzle mode 1: 128 B
  return d;
}

// The descriptor of d's tile off bytes further (off a multiple of 16): the start-address field (bits 0-13)
// holds the shared address >> 4, and a CTA's shared window is below 2^18 bytes, so the field of the
// address plus off is the field plus off >> 4 with no carry into the leading offset (bits 16-29): one
// add to the low word instead of desc_sw128's mask, shift and merge for every k16 slice (CUTLASS's
// GmmaDescriptor advances its descriptors the same way).
__device__ __forceinline__ uint64_t desc_plus(uint64_t d, uint32_t off) {
  const uint32_t lo = static_cast<uint32_t>(d) + (off >> 4);
  return (d & 0xFFFFFFFF00000000ull) | lo;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Pins registers that an in-flight wgmma reads or writes: the compiler sees the
// asm statement that issued the wgmma as complete, so without this it could
// reuse or read them before wgmma_wait returns.
template <int N>
__device__ __forceinline__ void pin(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N>
__device__ __forceinline__ void pin(uint32_t (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

// The 64 fp32 accumulator registers of an m64n128 wgmma, as inline-asm operands %0..%63.
#define DHP_ACC64_REGS "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63" \
  "}"
#define DHP_ACC64_OPS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// The 32 fp32 accumulator registers of an m64n64 wgmma, as inline-asm operands %0..%31.
#define DHP_ACC32_REGS "{" \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31" \
  "}"
#define DHP_ACC32_OPS(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// D[64x64] (+)= A[64x16] * B[16x64]; A and B from shared memory, both K-major.
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[32], uint64_t da, uint64_t db, int accumulate) {
  if constexpr (BF16) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DHP_ACC32_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : DHP_ACC32_OPS(d)
        : "l"(da), "l"(db), "r"(accumulate));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DHP_ACC32_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n"
        : DHP_ACC32_OPS(d)
        : "l"(da), "l"(db), "r"(accumulate));
  }
}

// D[64x128] (+)= A[64x16] * B[16x128]; A and B from shared memory, both K-major.
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n128k16_ss(float (&d)[64], uint64_t da, uint64_t db, int accumulate) {
  if constexpr (BF16) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DHP_ACC64_REGS ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : DHP_ACC64_OPS(d)
        : "l"(da), "l"(db), "r"(accumulate));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " DHP_ACC64_REGS ", %64, %65, p, 1, 1, 0, 0;\n}\n"
        : DHP_ACC64_OPS(d)
        : "l"(da), "l"(db), "r"(accumulate));
  }
}

// D[64x128] += A[64x16] * B[16x128]; A from registers (the accumulator layout of
// a previous wgmma, packed to 16 bits), B from shared memory MN-major (transposed).
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n128k16_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (BF16) {
    asm volatile(
        "{\n .reg .pred p;\n setp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DHP_ACC64_REGS
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : DHP_ACC64_OPS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " DHP_ACC64_REGS
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : DHP_ACC64_OPS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  }
}

// D[64x64] += A[64x16] * B[16x64]; A from registers, B from shared memory MN-major (head 64's PV).
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t db) {
  if constexpr (BF16) {
    asm volatile(
        "{\n .reg .pred p;\n setp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DHP_ACC32_REGS
        ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : DHP_ACC32_OPS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.eq.u32 p, 1, 1;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DHP_ACC32_REGS
        ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : DHP_ACC32_OPS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  }
}

// wgmma_m64n128k16_rs / wgmma_m64n64k16_rs with wgmma's scale-d from a flag: accumulate 0 gives D = A * B,
// D's old values not read (a split's first PV in the policy-off prefill, docs/perf-notes.md lever 63: the
// same bits as accumulating into +0 on sm_90). Separate forms, so that the binaries that never start
// fresh (the constant-time ones) keep their PTX and SASS.
template <bool BF16>
__device__ __forceinline__ void wgmma_m64n128k16_rs_sd(float (&d)[64], const uint32_t (&a)[4], uint64_t db,
                                                       int accumulate) {
  if constexpr (BF16) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " DHP_ACC64_REGS
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : DHP_ACC64_OPS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " DHP_ACC64_REGS
        ", {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : DHP_ACC64_OPS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
  }
}

template <bool BF16>
__device__ __forceinline__ void wgmma_m64n64k16_rs_sd(float (&d)[32], const uint32_t (&a)[4], uint64_t db,
                                                      int accumulate) {
  if constexpr (BF16) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " DHP_ACC32_REGS
        ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : DHP_ACC32_OPS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
  } else {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " DHP_ACC32_REGS
        ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : DHP_ACC32_OPS(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
  }
}

// --- programmatic dependent launch -------------------------------------------
// A grid launched with cudaLaunchAttributeProgrammaticStreamSerialization may start
// once every CTA of the grid before it has called grid_dependents_launch (or
// exited); grid_dependency_wait then blocks until that grid has completed and its
// memory operations are visible. Both are no-ops without the attribute.
__device__ __forceinline__ void grid_dependents_launch() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// --- warp-level tensor core (mma.sync) ---------------------------------------
// Four 8x8 16-bit matrices from shared memory: lane i gives the address of row
// i % 8 of matrix i / 8 (16 B); register r of lane t holds row t / 4, elements
// 2 (t % 4) and 2 (t % 4) + 1 of matrix r (TRANS: column t / 4, rows 2 (t % 4), + 1).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t saddr) {
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(saddr) : "memory");
}

// D[16x8] += A[16x16] * B[16x8], fp32 accumulators. Fragments (lane t, g = t / 4,
// c = 2 (t % 4)): a = {A[g][c..], A[g+8][c..], A[g][c+8..], A[g+8][c+8..]},
// b = {B[c..][g], B[c+8..][g]}, d = {D[g][c], D[g][c+1], D[g+8][c], D[g+8][c+1]}:
// the same per-thread layout as one 8-column group of a wgmma accumulator.
template <bool BF16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (BF16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Byte offset of 16-byte chunk `chunk` (0..7) of row `row` in a tile of 128-byte
// rows with the 128-byte swizzle (TMA's SWIZZLE_128B on a 1 KB aligned tile).
__device__ __forceinline__ uint32_t sw128_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}

// Two floats packed into one register as 16-bit values (low half = first).
template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (BF16) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// 1 / x as PTX div.full.f32 (approximate, ~2 ulp, no IEEE slow path): what
// Triton emits for an fp32 division, so results can match its kernels bit for bit.
__device__ __forceinline__ float div_full(float a, float b) {
  float y;
  asm("div.full.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Lets KERNEL take `bytes` of dynamic shared memory, once per kernel and process (a
// failed attempt is retried at the next launch).
template <auto KERNEL>
inline cudaError_t allow_dynamic_smem(int bytes) {
  static bool done = false;
  if (!done) {
    const cudaError_t e = cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return e;
    done = true;
  }
  return cudaSuccess;
}

}  // namespace dhp::sm90
