// Paged prefill (and mixed-step) attention for Hopper (sm_90a): policy `off` (the
// walk follows the true lengths) and the constant-time walk of the public bucket.
//
// The policy-off binary (code 60, prefill_v2_kernel) is NOT constant-time, on purpose:
// the grid search (`locate`), the early exits of surplus and padding tiles, the KV trip
// count (`work_of`: n_steps from seq_len, q_len and the causal diagonal), the mask branch
// (`mask_from`), the V-tail zeroing and the row-guarded stores all follow the true
// lengths. That is the contract of policy `off` only (design.md: "lengths" may leak). The
// CT binary (code 61, "constant-time walk" below) walks the public bucket instead, over
// each request's reserved block-table line, with selects; ops.plan routes constant-time
// prefill and mixed steps to it unless the setting path is triton (gates: `dhp-backend
// audit sass-cuda` and G1 per instruction).
//
// Layouts (those of ops.paged_attention):
//   query, out   [num_tokens, num_heads, D], last dim contiguous
//   key/value    [num_blocks, num_kv_heads, block_size, D] (pages of one head contiguous)
// D = 128, 64, 80, 96 or 256 (one library per head size, -DDHP_HEAD, v2_arith.cuh kModelHead): every
// tile is kHead / 64 halves of 64 columns, the output accumulator m64n<kHead>; heads 80 and 96 on
// head-128 tiles whose columns D-127 the TMA fills with zeros (v2_arith.cuh says why the bits are head
// 128's); head 256 with one K and one V stage, the policy-off running state in global memory and the
// constant-time binary on one consumer warpgroup of 64 rows (kRunGlobal, kConsumersCT, kStages below).
//   block_table  [num_seqs, >= pages] int32; query_start_loc [num_seqs + 1]; seq_lens [num_seqs]
// Causal with cached context: query row i of a request of q_len rows and
// seq_len keys sits at position seq_len - q_len + i and sees keys 0..that.
//
// One CTA = 128 query rows of one request and one KV head (GQA packing: every K/V tile
// is read once for the group; 192 rows at head 64, 64 in head 256's constant-time binary), 3 warpgroups
// (4 at head 64, 2 in head 256's constant-time binary):
//   warpgroup 0  producer: TMA loads (Q once; per 128-position KV step the pages of K and
//                of V, bs rows x 64 columns per box, D / 64 boxes per page, 128-byte swizzle) into a ring of two
//                stages. K and V have their own full/empty mbarriers: K of a stage is
//                refilled as soon as its QK^T is done, without waiting for the PV
//                product of that step. Policy off: the four warps share every stage
//                (produce_spread); CT: one thread (produce_ct) and two V cleaners.
//   warpgroups 1, 2  consumers, 64 query rows each: S = Q K^T (wgmma, both operands in
//                shared memory), the row arithmetic of the contract (v2_arith.cuh,
//                docs/kernels.md section 7) in registers, O += P V (wgmma, P from
//                registers, V read transposed). Policy off adds FA3's schedules (consume_v2:
//                intra-warpgroup overlap, pingpong); CT takes turns at issuing S (consume_v2_ct).
// A row's bits equal those of csrc/decode_sm90.cu's rows for the same position, under
// every policy (tests/test_cuda_prefill_gpu.py). The Triton-contract consumers measured
// before (compat, and the FA3-like `plain` with its schedule and diagnostic flags) are in
// git history (docs/perf-notes.md, changes 17, 23, 32, 38).

#include <cuda.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <cmath>

#include "compat_arith.cuh"
#include "ct_walk.cuh"
#include "v2_arith.cuh"
#include "sm90_primitives.cuh"
#include "tma_maps.h"

namespace dhp {
namespace {

using namespace sm90;
using namespace compat;

constexpr int kHead = v2::kHead;                 // the tiles' head size: 128, or 64 (-DDHP_HEAD=64)
constexpr int kModelHead = v2::kModelHead;       // the tensors' head size D: kHead, or 80 / 96 (128 tiles)
constexpr int kHalves = v2::kHalves;             // 64-column halves of a tile row (D / 64)
constexpr int kAcc = kHead / 2;                  // O accumulator values per consumer thread (m64nD)
constexpr int kCols = 128;                       // KV positions per step
constexpr int kHalfBytes = kCols * 128;          // one 64-column half of a K or V stage (16 KB)
constexpr int kTileBytes = kHalves * kHalfBytes; // a 128-position x D 16-bit stage (32 KB at D = 128)
// Head 256: its output accumulator is 128 registers a thread, so S of a 128-position step (64), its P
// and O fill a warpgroup's registers and the overlap of consume_v2 (S of the next step live beside P
// and O) does not fit: both kernels run one stage of K and of V (64 KB each) and consume_v2_serial's
// order (S, softmax, PV; the same row operations in the same order, so the same bits as any other
// tile of the contract). The constant-time binary runs one consumer warpgroup of 64 rows with its
// running state in shared memory (Q 32 KB + K + V + the state 64 KB: 225 KB). The policy-off binary
// runs two consumer warpgroups (128-row tiles, the K / V bytes of a step shared by twice the rows,
// the warpgroups taking turns at issuing S) and keeps three quarters of its running state in global
// memory (kRunGlobal: Q 64 KB + K + V = 192 KB leave room for 32 of the state's 128 KB, kRunSmemF4):
// one slot per SM in the split area of the workspace, read and written once per split
// (consume_v2_serial; ops/cuda_prefill.py).
constexpr int kConsumersCT = kHead == 256 ? 1 : 2;  // the constant-time binaries' consumer warpgroups
constexpr int kRows = 64 * kConsumersCT;            // query rows per constant-time CTA
constexpr int kRowsLog2 = kRows == 128 ? 7 : 6;     // tokens per constant-time tile: kRows >> group_shift
constexpr int kThreads = 128 * (kConsumersCT + 1);
constexpr int kStages = kHead == 256 ? 1 : 2;       // K and V stages of both kernels
// The constant-time consumer keeps the split's state at its last live step in registers (a selection
// per step) and folds it into the running state once per split (consume_v2_ct); head 256's 128
// accumulator registers leave no room for the copy, so its binary folds after every step.
constexpr bool kSnapCT = kHead != 256;
// The constant-time consumer's dead steps, per row (kDeadPastLimitCT): a step with every position past
// the row's own causal limit runs unmasked and is dropped by the snapshot's selection, as a step past
// the true length does. Such a step is an exact no-op when masked (m unchanged, alpha 1, P +0), so the
// bits are the same. Why: under `request` a short request's query chunk may end one position into a
// step (2049 of a 4096 bucket), and that step was then live but wholly masked for most of its rows;
// in gpt-oss's head-64 window-128 library, whose rows attend 2-3 steps each, that made short vs long
// fail G4 (H200, 2026-11-29: +0.027 % / +0.023 %, t -9.2 / -7.7 at 2 x 10^5 rounds; the bisect put
// the whole difference between true lengths 2049 and 2176). The plain library and the head-128 window
// + cap + sinks library pass the same pair without it (t +0.51, +0.57), so only head 64's window
// libraries take it (docs/audit/2026-11-29-timing-h200-csrc-h64-straddle.md).
constexpr bool kDeadPastLimitCT = kSnapCT && v2::kWindow && kHead == 64;
// The policy-off kernel's consumer warpgroups: 2 (128-row tiles), or 3 at head 64 (192-row tiles, as
// FA3's hdim-64 kernel): at head 64 a step's two GEMMs take half head 128's tensor time while its
// softmax takes the same, so a third warpgroup's softmax runs under the other two's GEMMs.
constexpr int kConsumersOff = kHead == 64 ? 3 : 2;
constexpr int kRowsOff = 64 * kConsumersOff;
constexpr int kThreadsOff = 128 * (kConsumersOff + 1);
constexpr bool kSerialOff = kHead == 256;  // the policy-off consumer: consume_v2_serial (else consume_v2)
constexpr bool kRunGlobal = kSerialOff;    // ... whose running state lives in global memory (else shared)
// consume_v2's half softmax (lever 64): where a window cuts a tile's walk short. Measured (H200, with it on
// in every library): gpt-oss's window-128 prefill 103.6 -> 99.8 us (0.770 -> 0.801x FA3); elsewhere its
// branch costs more than it saves (head 128 causal and full 4K 1.2-1.6 % slower, head 64 without a window
// 3-5 %), so it is on in the head-64 window libraries only (there 0.770 -> 0.800x, H200, 2026-11-29;
// tests/test_cuda_head_sizes_gpu.py passed); every other library's SASS is the one before it was written.
constexpr bool kHalfSoftmax = v2::kWindow && kHead == 64;
// The wgmma descriptors of a step's k16 slices as the tile's plus an offset (issue_qk's DESC_ADD), and the
// consumer warpgroup's index warp-uniform (consumer_warpgroup), so that the Q tile's descriptors stay in
// uniform registers: per consumer, policy off (consume_v2, consume_v2_serial) and constant time
// (consume_v2_ct). Measured (H200, docs/perf-notes.md lever 65): policy-off prefill 1-1.7 % less time at
// head 128, 4 % at head 64, gpt-oss's window 128 4.5 %; the constant-time prefill 2-4 %. Not in head
// 256's constant-time consumer, where ptxas then injected wgmma arrives (C7519) it had not before.
constexpr bool kDescAddOff = true;
constexpr bool kDescAddCT = kHead != 256;
// Head 256's constant-time consumer (one warpgroup, no turns): its walk's step count broadcast from lane 0
// (uniform_steps), so that ptxas knows the step loop and the split-end branch are warp-uniform; without it
// ptxas serializes every wgmma of the walk (C7520: each k16 slice's wgmma waited for before the next is
// issued, 32 waits a step against 2). The step count is the bucket's, a public value, and the arithmetic is
// unchanged; 10-12 % less time (H200, docs/perf-notes.md lever 66); G4 and G1 pass with it
// (docs/audit/2026-11-29-timing-h200-csrc-h256-uniform.md).
constexpr bool kUniformStepsCT = true;
// consume_v2_serial's fold behind the next S, whose 64 score registers are then live: float4 loads in
// flight per batch (8 left no registers: spill).
constexpr int kFoldBatchUnderS = 4;
// The float4 of a policy-off consumer thread's running state kept in shared memory: all of them, or with
// kRunGlobal the first 8 of head 256's 32 (the 32 KB left beside Q, K and V; a quarter less L2 traffic
// per fold), the rest in global memory.
constexpr int kRunSmemF4 = kRunGlobal ? 8 : kHead / 8;
// ... of which the float4 [kRunSmemF4, kFoldEarlyEnd) are folded right after the split's last PV (one batch
// of 16 loads: S and P hold no registers then), the rest right after the next step's S is issued.
constexpr int kFoldEarlyEnd = kRunSmemF4 + 16;
// Named barrier ids (0 is __syncthreads): per consumer warpgroup for the V
// tail, and the turn barriers of the pingpong schedule (one per consumer warpgroup).
constexpr uint32_t kBarVTail = 1, kBarTurn = 1 + kConsumersOff;
// The constant-time binary's: its producer warpgroup's Q loads (kBarQ), its consumers' turns (two ids).
constexpr uint32_t kBarQ = 5, kBarTurnCT = kBarQ + 1;

// Shared memory: Q | K stages | V stages | mbarriers | running state, 1 KB aligned
// (swizzle atoms). The consumers' running (folded) state, 64 fp32 per thread, lives in
// shared memory rather than registers, in both binaries: [warpgroup][D / 8][128 threads][4]
// (policy off: with the overlap, s of the next step, P, O and a register-resident running
// state would all be live; CT: the walk's extra live values spilled it).
// CONSUMERS: the consumer warpgroups, 64 Q rows each (the Q tile: kHalves halves of 64 * CONSUMERS rows).
// RUN_F4: the float4 of a consumer thread's running state held in shared memory (all kHead / 8 but in the
// policy-off binary at head 256: kRunSmemF4).
template <int STAGES, int CONSUMERS = 2, int RUN_F4 = kHead / 8>
struct Layout {
  static constexpr int kQHalfBytes = 64 * CONSUMERS * 128;
  static constexpr int kOffK = kHalves * kQHalfBytes;
  static constexpr int kOffV = kOffK + STAGES * kTileBytes;
  static constexpr int kOffBar = kOffV + STAGES * kTileBytes;
  static constexpr int kOffRun = kOffBar + 128;
  static constexpr int kRunBytes = CONSUMERS * 128 * RUN_F4 * 16;
  static constexpr int kBytes = kOffRun + kRunBytes + 1024;  // + alignment slack
  static_assert(8 * RingBarriers<STAGES>::kCount <= 128, "the barriers fit their 128 bytes");
};
static_assert(Layout<kStages, kConsumersCT>::kBytes <= 227 * 1024, "the stages and the running state fit");
// The policy-off kernel's layout.
template <int STAGES>
using LayoutOff = Layout<STAGES, kConsumersOff, kRunSmemF4>;
static_assert(LayoutOff<kStages>::kBytes <= 227 * 1024, "the policy-off kernel's tile fits");
// kRunGlobal's slots are per SM: no two CTAs of any binary of this file may share an SM (shared memory).
static_assert(!kRunGlobal || 2 * LayoutOff<kStages>::kBytes > 228 * 1024, "one policy-off CTA per SM");

struct Params {
  void* out;
  int64_t out_tok_stride, out_head_stride;       // elements
  const int* block_table;
  int64_t bt_stride;
  const int* seq_lens;
  const int* query_start_loc;
  int num_heads, num_kv_heads, block_size;
  int num_seqs, num_out_rows, num_tiles;         // requests, rows to write (num_tokens), grid tiles
  int group, group_shift, block_q;               // query heads per KV head; 2^group_shift >= group tile
                                                 // slots per token (GQA 5, 7: 8 slots, the last unused);
                                                 // tokens per tile = 128 >> group_shift
  float scale_log2;                              // softmax scale * log2(e) (qk_scale)
  int causal;
  uint32_t v_lbo, v_sbo;                         // V descriptor offsets (MN-major, bytes)
  // Constant-time binary (CT) only: the public bucket.
  int l_mode, l_scalar;                          // 0: one bucket l_scalar; 1: per-request buckets
  const int* bucket;                             // [num_seqs] (l_mode 1)
  int max_blocks;                                // block-table width
  const void* q;                                 // Q for the CT loader (LSU loads, see load_q_ct)
  int64_t q_tok_stride, q_head_stride;           // elements
  int q_rows;                                    // query.shape[0]
  uint32_t q_magic;                              // Barrett constant of q_rows
  void* sink;                                    // rows of no request go here (workspace sink)
  // Feature libraries only (v2_arith.cuh kWindow / kSoftCap; last, so the plain binaries' parameter
  // offsets are those they had): the window W, the soft cap's two constants (v2::soft_cap).
  int window;
  float cap_pre, cap_post;
  const float* sinks;  // [num_heads] float32 (sink libraries)
  // The policy-off binary at head 256 (kRunGlobal): the running states, [run_slots][kConsumersOff]
  // [kHead / 8][128 threads] float4, slot = the SM's id (%smid < %nsmid <= run_slots); the first
  // kRunSmemF4 float4 of a thread's are kept in shared memory instead (their slot space unused).
  float4* run;
  int run_slots;
};

template <int STAGES>
using Barriers = RingBarriers<STAGES>;

// Per-request facts every warp derives the same way.
struct Work {
  int q0, q_len, seq_len, tok0, n_steps;  // tok0: the tile's first query token (request-local)
  int page_req, n_pages;                  // whose table line the walk reads, and its reserved entries (CT)
  int t0;                                 // policy off with a window: the walk's first step (else 0)
};

// The tiling of ops.paged_attention's Triton kernels (kernels.locate): request r
// owns the tile indices [key(r), key(r + 1)) with key(r) = qsl[r] / BQ + r (BQ =
// block_q tokens per tile), which covers its ceil(q_len / BQ) tiles and at most
// one surplus; index num_seqs is the padding pseudo-request (rows qsl[num_seqs]
// .. num_out_rows, written as 0). The grid is num_tokens / BQ + num_seqs + 1
// tiles: sized from host-known counts. The keys increase strictly: binary search.
__device__ __forceinline__ int locate(const int* qsl, int num_seqs, int block_q, int g) {
  int lo = 0, hi = num_seqs;  // key(0) = 0 <= g
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (qsl[mid] / block_q + mid <= g) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ Work work_of(const Params& p, int req, int g) {
  Work w;
  w.q0 = p.query_start_loc[req];
  w.q_len = p.query_start_loc[req + 1] - w.q0;
  w.seq_len = p.seq_lens[req];
  w.tok0 = (g - (w.q0 / p.block_q + req)) * p.block_q;
  const int last_tok = min(w.tok0 + p.block_q, w.q_len) - 1;
  const int kv_end = p.causal ? min(w.seq_len, w.seq_len - w.q_len + last_tok + 1) : w.seq_len;
  w.n_steps = (kv_end + kCols - 1) / kCols;
  w.t0 = 0;
  if constexpr (v2::kWindow) {
    // The tile's lowest row (token tok0) sees from position ctx0 + tok0 - W + 1 on; every step
    // below the one holding it is fully masked for every row of the tile, an exact no-op of the
    // contract (all scores -inf: m stays, since kMInit is finite; alpha is selected 1; p = 0), so
    // the walk starts there (docs/kernels.md section 7, "Features"). Policy off only.
    const int lo_tile = w.seq_len - w.q_len + w.tok0 - p.window + 1;
    w.t0 = min(max(lo_tile, 0) / kCols, max(w.n_steps - 1, 0));
  }
  return w;
}

// ---- producer ---------------------------------------------------------------
// One 128-position stage of K or V: pages_per_step pages of bs rows, each D / 64
// 64-column TMA boxes (one per half of the [half][128 rows][64] stage), all on
// the stage's full barrier (armed with the stage's bytes first).
__device__ __forceinline__ void load_stage(uint32_t dst, const CUtensorMap* tm, uint32_t full, const int (&blk)[8],
                                           int pages_per_step, int bs, int kvh) {
  mbar_arrive_expect_tx(full, kTileBytes);
#pragma unroll
  for (int pg = 0; pg < 8; ++pg) {
    if (pg < pages_per_step) {  // block size: public
#pragma unroll
      for (int h = 0; h < kHalves; ++h) tma_load_4d(dst + h * kHalfBytes + pg * bs * 128, tm, full, 64 * h, 0, kvh, blk[pg]);
    }
  }
}

// ---- constant-time walk (CT: policies strict / request) -------------------------
// The contract's arithmetic (consume_v2_ct) on the walk of the Triton kernels' CONST_TIME binaries
// (kernels.attention_kernel; docs/kernels.md section 2): every CTA, whatever the
// secret lengths, runs the same code path with the same trip counts and the same
// loads and stores, at the same addresses.
//   - tile -> request: a count over all num_seqs keys (locate_ct), no search;
//   - no early exit: padding and surplus tiles walk like real ones, their rows
//     masked by selection and stored to the workspace sink;
//   - the KV walk covers the public bucket L_r (n_steps = ceil(L_r / 128)), and
//     logical block lb reads block_table[r, min(lb, ceil(L_r / block_size) - 1)]
//     (ct::walk_page): the request's own reserved table line up to its bucket, in
//     walk order (design.md section 2, the address rule: the engine reserves those
//     pages; the tile rounding past them re-reads the last one, a function of L_r).
//     Which pages hold real positions is never asked: the true length only masks;
//   - Q rows come by ordinary loads at in-range addresses (row mod q_rows): a TMA
//     box at the step's end would be clipped, and a clipped box reads fewer bytes;
//   - V rows at positions >= the true length are zeroed in the step that holds the
//     true length's end by two producer warps (clean_v_ct) that rewrite the whole
//     tile of every stage in place (load, AND with a mask from the length, store to
//     the same address), so the consumers never branch on the length and 0 * NaN
//     never reaches the output;
//   - every score is masked by select (the off binary masks only the last steps),
//     except in the dead steps (every position past the true length): those run
//     unmasked on the rows their pages hold and their contribution is dropped by
//     selection (consume_v2_ct), so the tensor cores get a live step's operands
//     rather than masked zeros, whose lower power moved the step's time with the
//     true length (G4, H200: short vs long +0.104 % with zeros, +0.037 % now).
//   - every choice made on the true length whose result is a float (the commit of a
//     split's state at its last live step) is a select on the bits (ct::select_f32),
//     never a ternary: ptxas guards a ternary's last FFMA by the predicate, and a
//     guarded-off instruction costs less than one that runs (G4, H200: +0.039 %, t -12.8;
//     G2 fails such a guard: dhp_backend/audit/guarded.py);
//   - the feature libraries (v2_arith.cuh) keep this walk: a window's lower bound is one more
//     selection per score (INT_MIN in the dead steps), the soft cap an elementwise function with
//     no data-dependent path, the sinks one read per row at sinks + head after the walk;
// Public facts the code may branch on: the bucket (l_scalar, or the per-request
// buckets under policy request), num_seqs, the step geometry, block size, group.
// Shared-memory addresses (the stages, the wgmma descriptors advanced by a slice's offset: desc_plus) follow
// the step index and the tile's layout only; the step count, when broadcast from lane 0 (uniform_steps), is
// the bucket's, the same in every lane.
// The head size is a compile-time constant of the library (v2_arith.cuh kHead, kModelHead): the loops
// over its 64-column halves (TMA boxes, stores, the Q loader) unroll, the same code for every length;
// at heads 80 and 96 the zero columns D-127 are the TMA's fill of a public box (no address follows a
// length).

using namespace ct;

// kernels.locate (request tiles): r = #{i in 1..num_seqs : qsl[i] / BQ + i <= g},
// counted by the whole CTA in chunks of kThreads keys; trip count
// ceil(num_seqs / kThreads), one load per thread and chunk.
__device__ __forceinline__ int locate_ct(const Params& p, int g) {
  int count = 0;
  for (int base = 1; base <= p.num_seqs; base += kThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    const bool in = i <= p.num_seqs;
    const int qs = p.query_start_loc[min(i, p.num_seqs)];
    count += __syncthreads_count(in & ((qs >> (kRowsLog2 - p.group_shift)) + i <= g));  // BQ = kRows / GROUP
  }
  return count;
}

// kernels.attention_kernel's per-tile facts (l_mode 0/1). Index num_seqs is the
// padding pseudo-request: rows qsl[num_seqs] .. num_out_rows, true length 0; it
// reads the table line of the last request with that request's page count (l_mode
// 0: its L pages, re-reads whatever the lengths are; l_mode 1: no step, its walk is
// 0 as the Triton launcher's pad_l) and its rows come out as 0.
template <int LMODE>
__device__ __forceinline__ Work work_ct(const Params& p, int req, int g) {
  Work w;
  const bool is_pad = req >= p.num_seqs;  // req <= num_seqs (locate_ct's count)
  // min(req, num_seqs - 1) and min(req + 1, num_seqs), written as req - is_pad and
  // req + !is_pad: ptxas fuses the min forms into VIADDMNMX, which the SASS slice of the
  // audit (sass_slice) does not model, and a ptxas-made guard sliced through it fails G2.
  const int r_row = req - static_cast<int>(is_pad);
  w.q0 = p.query_start_loc[req];
  const int q_next = p.query_start_loc[req + static_cast<int>(!is_pad)];
  w.q_len = select_int(is_pad, p.num_out_rows, q_next) - w.q0;
  w.page_req = r_row;
  w.seq_len = select_int(is_pad, 0, p.seq_lens[r_row]);
  w.tok0 = (g - ((w.q0 >> (kRowsLog2 - p.group_shift)) + req)) * p.block_q;
  // LMODE is a template flag, not a run-time test of p.l_mode: the binary the
  // gate calls constant-time (one bucket) then holds no path through the
  // per-request buckets at all (audit/cuda_rules.py checks it on the PTX).
  // ext_r: the bucket of the table line the walk reads (r_row's, for the padding too).
  int ext_r = p.l_scalar, ext = p.l_scalar;
  if constexpr (LMODE == 1) {
    ext_r = p.bucket[r_row];
    ext = select_int(is_pad, 0, ext_r);  // pad_l = 0, as the Triton launcher
  }
  w.n_pages = walk_pages(ext_r, p.block_size, p.max_blocks);
  w.n_steps = (ext + kCols - 1) / kCols;
  return w;
}

// Q tile by the producer warpgroup (128 threads, one tile row each; at head 256's 64 rows, two
// threads a row, which store the same values) into the layout the TMA box gives:
// [half][kRows rows][64 columns], 128-byte swizzle.
template <int STAGES>
__device__ __forceinline__ void load_q_ct(const Params& p, const Work& w, uint8_t* smem_ptr,
                                          const Barriers<STAGES>& bar, int kvh) {
  using L = Layout<STAGES, kConsumersCT>;
  int row = threadIdx.x;
  if constexpr (kRows != 128) row = threadIdx.x % kRows;
  const uint32_t tok = mod_barrett(static_cast<uint32_t>(w.q0 + w.tok0 + (row >> p.group_shift)),
                                   static_cast<uint32_t>(p.q_rows), p.q_magic);
  // Slots >= GROUP (public: the row and the model's GQA ratio) re-read the group's
  // first head, so the address stays in range; their rows are never stored.
  const int slot = row & ((1 << p.group_shift) - 1);
  const int head = kvh * p.group + select_int(slot < p.group, slot, 0);
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const char*>(p.q) +
                                                    2 * (tok * p.q_tok_stride + head * p.q_head_stride));
  // Four 16-byte pieces in flight at a time: the producer warpgroup runs on 40 registers.
#pragma unroll
  for (int c0 = 0; c0 < kHead / 8; c0 += 4) {
    uint4 v[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = c0 + c < kModelHead / 8 ? src[c0 + c] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int piece = c0 + c;
      *reinterpret_cast<uint4*>(smem_ptr + (piece / 8) * L::kQHalfBytes + row * 128 + (((piece % 8) ^ (row % 8)) * 16)) =
          v[c];
    }
  }
  fence_proxy_async();
  named_barrier(kBarQ, 128);
  if (threadIdx.x == 0) mbar_arrive(bar.q_full());
}

// K/V pages of every step up to the bucket: the entries of the request's reserved
// table line (ct::walk_page; a 16-row TMA box is one page), in walk order. One warp:
// every lane reads the step's entries (the same addresses in every lane: one
// transaction each, all in flight together) and lane 0 issues the TMA loads. Entries
// pg >= pages_per_step of blk are not loaded (load_stage); they read the step's last
// page again, so every read stays inside the step's own pages.
template <int STAGES>
__device__ __forceinline__ void produce_ct(const Params& p, const Work& w, const CUtensorMap* tm_k,
                                           const CUtensorMap* tm_v, uint32_t smem, const Barriers<STAGES>& bar,
                                           int kvh, int lane) {
  using L = Layout<STAGES, kConsumersCT>;
  const int* table = p.block_table + static_cast<int64_t>(w.page_req) * p.bt_stride;
  const int bs = p.block_size;
  const int pages_per_step = kCols / bs;
  for (int t = 0; t < w.n_steps; ++t) {
    const int s = t % STAGES;
    const uint32_t parity = ((t / STAGES) - 1) & 1;
    const uint32_t k_dst = smem + L::kOffK + s * kTileBytes, v_dst = smem + L::kOffV + s * kTileBytes;
    int blk[8];
#pragma unroll
    for (int pg = 0; pg < 8; ++pg)
      blk[pg] = walk_page(table, w.n_pages, t * pages_per_step + min(pg, pages_per_step - 1));
    // The whole warp waits (one try_wait answers all lanes alike) and lane 0 issues: lane 0
    // alone in the wait loop left the warp diverged at the next step's shuffle for as
    // many steps as the hardware's timing chose, and ptxas's divergent-shuffle path
    // then ran a timing-dependent number of times (G1 per instruction, H200). The page
    // ids come without shuffles now; the warp still waits as one, so that no
    // instruction's count follows the hardware's timing.
    if (t >= STAGES) mbar_wait(bar.k_empty(s), parity);
    if (lane == 0) load_stage(k_dst, tm_k, bar.k_full(s), blk, pages_per_step, bs, kvh);
    __syncwarp();
    if (t >= STAGES) mbar_wait(bar.v_empty(s), parity);
    if (lane == 0) load_stage(v_dst, tm_v, bar.v_full(s), blk, pages_per_step, bs, kvh);
    __syncwarp();
  }
}

// The CT consumers wait for this barrier of a V stage instead of v_full: it
// completes when both cleaner warps have zeroed the stage's rows past the true
// length. After the RingBarriers.
template <int STAGES>
__device__ __forceinline__ uint32_t v_clean(const Barriers<STAGES>& bar, int s) {
  return bar.base + 8 * (Barriers<STAGES>::kCount + s);
}
constexpr int kCleanThreads = 64;  // producer warps 1 and 2

// Zero the V rows at positions >= seq_len of the step holding the true length's end
// (a dead step's rows stay as read: consume_v2_ct drops its product) by rewriting
// every stage's whole tile in place: each thread loads its kPieces 16-byte pieces of the tile per step
// (32 of a 32 KB stage; 64 of head 256's 64 KB stage) and stores each back to the same address, ANDed
// with a mask that is all ones for a real row and zero for padding. Every address and the count of loads and stores
// are the tile's, whatever the true length (the address rule reaches shared memory:
// the earlier form redirected the stores of real rows to a 1 KB scratch, and the
// store addresses, tile or scratch, moved the step's time with the true length:
// +0.075 %, t -36 at 10^5 launches, H200, where this form measured -0.014 %).
// Loads go in batches of kCleanBatch before their stores (the producer warpgroup
// runs on 40 registers): one load-store chain per piece left every load's latency
// exposed (+15 % on the step). The pieces of one warp access are 512 contiguous
// bytes: conflict-free.
constexpr int kCleanBatch = 4;
template <int STAGES>
__device__ __forceinline__ void clean_v_ct(const Work& w, uint8_t* smem_ptr, const Barriers<STAGES>& bar, int tid) {
  using L = Layout<STAGES, kConsumersCT>;
  constexpr int kPieces = kTileBytes / 16 / kCleanThreads;  // per thread and step
  static_assert(kPieces % kCleanBatch == 0, "whole batches");
  for (int t = 0; t < w.n_steps; ++t) {
    const int s = t % STAGES;
    mbar_wait(bar.v_full(s), (t / STAGES) & 1);
    uint4* tile = reinterpret_cast<uint4*>(smem_ptr + L::kOffV + s * kTileBytes);
    // A dead step (every position past the true length) keeps its rows as read: its
    // product is computed on them and thrown away (consume_v2_ct: the dead steps).
    const bool dead = t * kCols >= w.seq_len;
    for (int it = 0; it < kPieces; it += kCleanBatch) {
      uint4 v[kCleanBatch];
#pragma unroll
      for (int c = 0; c < kCleanBatch; ++c) v[c] = tile[(it + c) * kCleanThreads + tid];
#pragma unroll
      for (int c = 0; c < kCleanBatch; ++c) {
        const int idx = (it + c) * kCleanThreads + tid;  // 16-byte piece: [half][row][8 pieces]
        const int row = (idx / 8) % kCols;  // the position in the stage
        const uint32_t keep = 0u - static_cast<uint32_t>((t * kCols + row < w.seq_len) | dead);  // ~0u kept, 0 zeroed
        tile[idx] = make_uint4(v[c].x & keep, v[c].y & keep, v[c].z & keep, v[c].w & keep);
      }
    }
    fence_proxy_async();
    __syncwarp();
    if (tid % 32 == 0) mbar_arrive(v_clean(bar, s));
  }
}

// ---- consumer pieces ----------------------------------------------------------
// Accumulator layout of an m64n128 wgmma (per thread): element 4*i + e is row
// g (+8 for e >= 2) of the warp's 16, column 8*i + 2*(lane % 4) + (e & 1).

// This thread's consumer warpgroup (0, 1, ...; the producer is warpgroup -1 of the kernel's), broadcast from
// lane 0 so that the compiler knows it is warp-uniform (CUTLASS's canonical_warp_group_idx): the Q tile's
// wgmma descriptors, which follow it, then stay in uniform registers.
__device__ __forceinline__ int consumer_warpgroup() {
  return __shfl_sync(0xffffffff, static_cast<int>(threadIdx.x / 128), 0) - 1;
}

// Q_HALF: the bytes between the Q tile's 64-column halves (64 rows per consumer warpgroup x 128 B).
// DESC_ADD: each k16 slice's descriptors as the tile's plus the slice's offset (desc_plus), else each built
// whole from its address (desc_sw128); the same descriptors either way.
template <bool BF16, int Q_HALF, bool DESC_ADD = false>
__device__ __forceinline__ void issue_qk(float (&s)[64], uint32_t q_base, uint32_t k_base) {
  const uint64_t qd = desc_sw128(q_base, 16, 1024), kd = desc_sw128(k_base, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < kHead / 16; ++kk) {
    const uint32_t q_off = (kk / 4) * Q_HALF + (kk % 4) * 32, k_off = (kk / 4) * kHalfBytes + (kk % 4) * 32;
    if constexpr (DESC_ADD) {
      wgmma_m64n128k16_ss<BF16>(s, desc_plus(qd, q_off), desc_plus(kd, k_off), kk > 0);
    } else {
      wgmma_m64n128k16_ss<BF16>(s, desc_sw128(q_base + q_off, 16, 1024), desc_sw128(k_base + k_off, 16, 1024), kk > 0);
    }
  }
}

// The descriptor of the V tile at v_base (vd) off bytes further: a k16 slice is 16 positions, 2 KB into
// each 64-column half.
template <bool DESC_ADD>
__device__ __forceinline__ uint64_t v_desc(uint64_t vd, uint32_t v_base, uint32_t off, uint32_t lbo, uint32_t sbo) {
  if constexpr (DESC_ADD) {
    return desc_plus(vd, off);
  } else {
    return desc_sw128(v_base + off, lbo, sbo);
  }
}

// O += P V_t.
template <bool BF16, bool DESC_ADD = false>
__device__ __forceinline__ void issue_pv(float (&o)[kAcc], const uint32_t (&pa)[32], uint32_t v_base,
                                         uint32_t lbo, uint32_t sbo) {
  const uint64_t vd = desc_sw128(v_base, lbo, sbo);
#pragma unroll
  for (int j = 0; j < kCols / 16; ++j) {
    const uint32_t a[4] = {pa[4 * j], pa[4 * j + 1], pa[4 * j + 2], pa[4 * j + 3]};
    if constexpr (kHead == 256) {  // two m64n128 halves of the accumulator: columns 0-127, 128-255
      float(&o_lo)[64] = *reinterpret_cast<float(*)[64]>(&o[0]);
      float(&o_hi)[64] = *reinterpret_cast<float(*)[64]>(&o[64]);
      wgmma_m64n128k16_rs<BF16>(o_lo, a, v_desc<DESC_ADD>(vd, v_base, j * 16 * 128, lbo, sbo));
      wgmma_m64n128k16_rs<BF16>(o_hi, a, v_desc<DESC_ADD>(vd, v_base, 2 * kHalfBytes + j * 16 * 128, lbo, sbo));
    } else if constexpr (kHead == 128) {
      wgmma_m64n128k16_rs<BF16>(o, a, v_desc<DESC_ADD>(vd, v_base, j * 16 * 128, lbo, sbo));
    } else {
      wgmma_m64n64k16_rs<BF16>(o, a, v_desc<DESC_ADD>(vd, v_base, j * 16 * 128, lbo, sbo));
    }
  }
}

// issue_pv for the policy-off consumers: fresh (a split's first step) makes the first k16 slice write
// O = P V without reading O (wgmma's scale-d = 0), so a split's fold need not zero O. The same bits as
// that slice accumulated into +0: a nonzero sum plus +0 is that sum, and sm_90's tensor cores return +0
// for a zero sum whatever its products' and C's signs (device probe, docs/perf-notes.md lever 63), as
// +0 plus a sum of zeros is in the decode kernel's mma.sync from C = +0. fresh is a step index. consume_v2
// only (heads 64-128): head 256's serial consumer measured 2.5 % slower with it and keeps the zeroing.
template <bool BF16, bool DESC_ADD = false>
__device__ __forceinline__ void issue_pv_off(float (&o)[kAcc], const uint32_t (&pa)[32], uint32_t v_base,
                                             uint32_t lbo, uint32_t sbo, bool fresh) {
  static_assert((kHead == 128 || kHead == 64) && (BF16 || !BF16), "consume_v2's heads (dependent: checked where used)");
  const uint64_t vd = desc_sw128(v_base, lbo, sbo);
#pragma unroll
  for (int j = 0; j < kCols / 16; ++j) {
    const uint32_t a[4] = {pa[4 * j], pa[4 * j + 1], pa[4 * j + 2], pa[4 * j + 3]};
    const int accumulate = j > 0 || !fresh;
    if constexpr (kHead == 128) {
      wgmma_m64n128k16_rs_sd<BF16>(o, a, v_desc<DESC_ADD>(vd, v_base, j * 16 * 128, lbo, sbo), accumulate);
    } else {
      wgmma_m64n64k16_rs_sd<BF16>(o, a, v_desc<DESC_ADD>(vd, v_base, j * 16 * 128, lbo, sbo), accumulate);
    }
  }
}

// The accumulator rows of a consumer thread (wgmma layout: lo, lo, hi, hi per column group) set to +0
// where lo / hi, by selection (a constant-time walk's rows leaving their window's prefix).
template <int N>
__device__ __forceinline__ void zero_rows(float (&o)[N], bool lo, bool hi) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
    o[4 * i] = select_f32(lo, 0.f, o[4 * i]);
    o[4 * i + 1] = select_f32(lo, 0.f, o[4 * i + 1]);
    o[4 * i + 2] = select_f32(hi, 0.f, o[4 * i + 2]);
    o[4 * i + 3] = select_f32(hi, 0.f, o[4 * i + 3]);
  }
}

// Scores past the causal limit or seq_len become -inf (a select: garbage rows
// of the last page may hold NaN).
template <int N>
__device__ __forceinline__ void mask_scores(float (&s)[N], int kv0, int lim_lo, int lim_hi, int lane) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = kv0 + 8 * i + 2 * (lane % 4) + e;
      s[4 * i + e] = col > lim_lo ? -INFINITY : s[4 * i + e];
      s[4 * i + 2 + e] = col > lim_hi ? -INFINITY : s[4 * i + 2 + e];
    }
  }
}

// The window's lower bound too (feature libraries): scores at positions <= lo (the row's
// position - W) become -inf, by the same selection. Dead rows and dead steps of the constant-time
// walk pass lo = INT_MIN.
template <int N>
__device__ __forceinline__ void mask_scores_window(float (&s)[N], int kv0, int lo_lo, int lim_lo, int lo_hi,
                                                   int lim_hi, int lane) {
#pragma unroll
  for (int i = 0; i < N / 4; ++i) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = kv0 + 8 * i + 2 * (lane % 4) + e;
      s[4 * i + e] = (col > lim_lo) | (col <= lo_lo) ? -INFINITY : s[4 * i + e];
      s[4 * i + 2 + e] = (col > lim_hi) | (col <= lo_hi) ? -INFINITY : s[4 * i + 2 + e];
    }
  }
}

// The soft cap (feature libraries) on a step's raw scores, before the mask: v2::soft_cap.
template <int N>
__device__ __forceinline__ void cap_scores(float (&s)[N], const Params& p) {
#pragma unroll
  for (int i = 0; i < N; ++i) s[i] = v2::soft_cap(s[i], p.cap_pre, p.cap_post);
}

// The two query rows of a consumer thread (accumulator rows g and g + 8 of its
// warp): tile row r is token tok0 + r / SLOTS of query head kvh * GROUP + r % SLOTS
// (SLOTS = 2^group_shift). A slot >= GROUP (GQA ratios that are not powers of two)
// holds no head of this group: its row is computed and never stored (ok_*, a
// function of the row index and the model's GQA ratio only: public).
struct Rows {
  int qi_lo, qi_hi, head_lo, head_hi, first_qi;  // first_qi: the warpgroup's first token
  bool ok_lo, ok_hi;                             // the slot holds a head of this group
};

__device__ __forceinline__ Rows rows_of(const Params& p, const Work& w, int cw, int warp, int lane, int kvh) {
  const int r = 64 * cw + 16 * warp + lane / 4;
  Rows x;
  x.qi_lo = w.tok0 + (r >> p.group_shift);
  x.qi_hi = w.tok0 + ((r + 8) >> p.group_shift);
  const int slots = (1 << p.group_shift) - 1;
  x.head_lo = kvh * p.group + (r & slots);
  x.head_hi = kvh * p.group + ((r + 8) & slots);
  x.ok_lo = (r & slots) < p.group;
  x.ok_hi = ((r + 8) & slots) < p.group;
  x.first_qi = w.tok0 + ((64 * cw) >> p.group_shift);
  return x;
}

// Epilogue store of one accumulator row (16 column pairs) to out[token, head].
template <bool BF16, int IDX>
__device__ __forceinline__ void store_row(const Params& p, const Work& w, int qi, int head, bool ok, int lane,
                                          const float (&o)[kAcc], float inv) {
  if (qi >= w.q_len || !ok) return;
  char* out = static_cast<char*>(p.out);
  uint32_t* dst = reinterpret_cast<uint32_t*>(
      out + 2 * ((static_cast<int64_t>(w.q0) + qi) * p.out_tok_stride + static_cast<int64_t>(head) * p.out_head_stride));
  const int c = lane % 4;  // column pair 2c within each 8-column group
#pragma unroll
  for (int i = 0; i < kModelHead / 8; ++i) dst[4 * i + c] = pack2<BF16>(__fmul_rn(o[4 * i + IDX], inv), __fmul_rn(o[4 * i + IDX + 1], inv));
}

// CT epilogue: every row is stored, to out[token, head] inside the request and
// to the workspace sink outside it (kernels.attention_kernel: slot g mod
// kSinkSlots, 256 elements per row); the address is selected, not the store.
constexpr int kSinkSlots = 16, kSinkWidth = 256;  // ops/triton/workspace.py SINK_SLOTS, SINK_WIDTH
template <bool BF16, int IDX>
__device__ __forceinline__ void store_row_ct(const Params& p, const Work& w, int qi, int head, bool ok, int g,
                                             int tile_row, int lane, const float (&o)[kAcc], float inv) {
  const uint64_t real = reinterpret_cast<uint64_t>(static_cast<char*>(p.out) +
      2 * ((static_cast<int64_t>(w.q0) + qi) * p.out_tok_stride + static_cast<int64_t>(head) * p.out_head_stride));
  const uint64_t sink = reinterpret_cast<uint64_t>(static_cast<char*>(p.sink) +
      2 * (static_cast<int64_t>((g % kSinkSlots) * kRows + tile_row) * kSinkWidth));
  uint32_t* dst = reinterpret_cast<uint32_t*>(select_u64((qi < w.q_len) & ok, real, sink));
  const int c = lane % 4;
#pragma unroll
  for (int i = 0; i < kModelHead / 8; ++i) dst[4 * i + c] = pack2<BF16>(__fmul_rn(o[4 * i + IDX], inv), __fmul_rn(o[4 * i + IDX + 1], inv));
}

// Turn-taking of the N consumer warpgroups (PINGPONG), round robin: a warpgroup waits for
// its turn before issuing wgmmas and hands the turn to the next right after issuing.
// bar.sync/bar.arrive on a 256-thread barrier: 128 waiting + 128 arriving. Every
// warpgroup of a CTA takes the same number of turns (one walk per tile).
// BASE: the first of the N barrier ids (kBarTurn, or kBarTurnCT in the constant-time kernel).
template <bool PINGPONG, int N = 2, uint32_t BASE = kBarTurn>
struct Turns {
  int cw;
  __device__ void start() const {  // warpgroup 0 goes first
    if (PINGPONG && cw == N - 1) asm volatile("bar.arrive %0, 256;" ::"r"(BASE) : "memory");
  }
  __device__ void wait() const {
    if (PINGPONG) named_barrier(BASE + cw, 256);
  }
  __device__ void pass() const {
    const int next = N == 2 ? cw ^ 1 : (cw + 1) % N;
    if (PINGPONG) asm volatile("bar.arrive %0, 256;" ::"r"(BASE + next) : "memory");
  }
  __device__ void finish() const {  // consume the last warpgroup's last hand-over (no barrier left half-arrived)
    if constexpr (BASE == kBarTurnCT) {
      // The constant-time binaries (G2 gates their SASS): the barrier predicated in PTX, so that the
      // guard ptxas makes of it carries its PTX predicate (warpgroup 0: a thread index), where the
      // branch form below left a guard whose operand the SASS slice could not follow in every binary.
      if constexpr (PINGPONG) asm volatile("{\n\t.reg .pred p;\n\tsetp.eq.s32 p, %1, 0;\n\t@p bar.sync %0, 256;\n\t}" ::"r"(BASE), "r"(cw) : "memory");
    } else {
      if (PINGPONG && cw == 0) named_barrier(BASE, 256);
    }
  }
};

using v2::quad_lanes;
using v2::step_tree;

// A consumer warp's arrival on a stage's empty barrier (one arrival per warp: the barriers count warps).
__device__ __forceinline__ void release(uint32_t barrier, int lane) {
  __syncwarp();
  if (lane == 0) mbar_arrive(barrier);
}

// One 128-position step of the contract's row arithmetic on a 64-row wgmma tile (s: the step's
// scores, masked ones already -inf; per thread the lo/hi rows of 16 eight-column groups):
// the running max, the rows' alphas, p in place and the per-lane l (v2_arith.cuh).
template <int N>
__device__ __forceinline__ void v2_step(float (&s)[N], float scale, float& m_lo, float& m_hi, float& l_lo,
                                        float& l_hi, float& a_lo, float& a_hi) {
  constexpr int kGroups = N / 4;
  float mx_lo = s[0], mx_hi = s[2];
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    mx_lo = fmaxf(mx_lo, fmaxf(s[4 * i], s[4 * i + 1]));
    mx_hi = fmaxf(mx_hi, fmaxf(s[4 * i + 2], s[4 * i + 3]));
  }
  const float new_lo = v2::step_max(m_lo, quad_max(mx_lo), scale);
  const float new_hi = v2::step_max(m_hi, quad_max(mx_hi), scale);
  a_lo = select_ex2(m_lo, new_lo);
  a_hi = select_ex2(m_hi, new_hi);
  m_lo = new_lo;
  m_hi = new_hi;
  float g_lo[kGroups], g_hi[kGroups];
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    s[4 * i] = v2::exp_score(s[4 * i], scale, new_lo);
    s[4 * i + 1] = v2::exp_score(s[4 * i + 1], scale, new_lo);
    s[4 * i + 2] = v2::exp_score(s[4 * i + 2], scale, new_hi);
    s[4 * i + 3] = v2::exp_score(s[4 * i + 3], scale, new_hi);
    g_lo[i] = v2::pair_sum(s[4 * i], s[4 * i + 1]);
    g_hi[i] = v2::pair_sum(s[4 * i + 2], s[4 * i + 3]);
  }
  l_lo = v2::step_l(l_lo, a_lo, step_tree(g_lo));
  l_hi = v2::step_l(l_hi, a_hi, step_tree(g_hi));
}

// PACKED: the tile's rows are (token, head) pairs packed without slots, token r / GROUP and head
// r % GROUP of the KV head's group, floor(128 / GROUP) tokens per tile (GROUP 7: 18 tokens, 126 of
// 128 rows used, where the product's slots of a power of two use 112: 16 tokens x 8 slots). Each
// row's arithmetic is the same (a wgmma output row depends on its own A row only): the same bits.
__device__ __forceinline__ Rows rows_of_packed(const Params& p, const Work& w, int cw, int warp, int lane, int kvh) {
  const int r = 64 * cw + 16 * warp + lane / 4;
  Rows x;
  x.qi_lo = w.tok0 + r / p.group;
  x.qi_hi = w.tok0 + (r + 8) / p.group;
  x.head_lo = kvh * p.group + r % p.group;
  x.head_hi = kvh * p.group + (r + 8) % p.group;
  x.ok_lo = r < p.block_q * p.group;
  x.ok_hi = r + 8 < p.block_q * p.group;
  x.first_qi = w.tok0 + (64 * cw) / p.group;
  return x;
}

// A consumer's end: its rows' running state (shared memory, folded) back into the accumulator
// registers and the rows' 1 / l, the sink's state (m = sinks[h] log2 e, l = 1, acc = 0) folded in
// first in the sink libraries (v2::kSinks). Shared by both consumers: the same operations as the
// decode kernel's fold mode and merge, so a row keeps its bits.
// The rows' end statistics: the sink's fold coefficients (sink libraries; else the identity) and 1 / l.
__device__ __forceinline__ void end_stats(const Params& p, const Rows& rw, float mr_lo, float lr_lo, float mr_hi,
                                          float lr_hi, FoldCoef& sk_lo, FoldCoef& sk_hi, float& inv_lo,
                                          float& inv_hi) {
  sk_lo = sk_hi = FoldCoef{1.f, 0.f};
  if constexpr (v2::kSinks) {
    sk_lo = fold_stats(mr_lo, lr_lo, v2::sink_m(p.sinks, rw.head_lo, p.num_heads), 1.f);
    sk_hi = fold_stats(mr_hi, lr_hi, v2::sink_m(p.sinks, rw.head_hi, p.num_heads), 1.f);
  }
  inv_lo = finalize_inv(lr_lo);
  inv_hi = finalize_inv(lr_hi);
}

__device__ __forceinline__ void running_state_out(const Params& p, const Rows& rw, const float4* run_smem,
                                                  float mr_lo, float lr_lo, float mr_hi, float lr_hi,
                                                  float (&acc)[kAcc], float& inv_lo, float& inv_hi) {
  FoldCoef sk_lo, sk_hi;
  end_stats(p, rw, mr_lo, lr_lo, mr_hi, lr_hi, sk_lo, sk_hi, inv_lo, inv_hi);
#pragma unroll
  for (int i = 0; i < kHead / 8; ++i) {
    const float4 r = run_smem[128 * i];
    acc[4 * i] = r.x, acc[4 * i + 1] = r.y, acc[4 * i + 2] = r.z, acc[4 * i + 3] = r.w;
    if constexpr (v2::kSinks) {
      acc[4 * i] = fold_value(r.x, 0.f, sk_lo), acc[4 * i + 1] = fold_value(r.y, 0.f, sk_lo);
      acc[4 * i + 2] = fold_value(r.z, 0.f, sk_hi), acc[4 * i + 3] = fold_value(r.w, 0.f, sk_hi);
    }
  }
}

// running_state_out for a running state already folded into the accumulator registers
// (consume_v2_serial): the sink's state folded in (sink libraries) and the rows' 1 / l.
[[maybe_unused]] __device__ __forceinline__ void state_out_regs(const Params& p, const Rows& rw, float mr_lo, float lr_lo,
                                               float mr_hi, float lr_hi, float (&acc)[kAcc], float& inv_lo,
                                               float& inv_hi) {
  FoldCoef sk_lo, sk_hi;
  end_stats(p, rw, mr_lo, lr_lo, mr_hi, lr_hi, sk_lo, sk_hi, inv_lo, inv_hi);
  if constexpr (v2::kSinks) {
#pragma unroll
    for (int i = 0; i < kHead / 8; ++i) {
      acc[4 * i] = fold_value(acc[4 * i], 0.f, sk_lo), acc[4 * i + 1] = fold_value(acc[4 * i + 1], 0.f, sk_lo);
      acc[4 * i + 2] = fold_value(acc[4 * i + 2], 0.f, sk_hi), acc[4 * i + 3] = fold_value(acc[4 * i + 3], 0.f, sk_hi);
    }
  }
}

// The policy-off consumers' row bounds (consume_v2, consume_v2_serial): positions <= lim are attended
// (causal: the row's own; else the request's last), from mask_from on some row of the warpgroup masks a
// position; with a window, positions <= lo are below the row's window, a step holding one at or below win_hi
// (the warpgroup's highest lower bound) is masked below too, and lo_tile is the tile's lowest visible
// position. Not constant-time: they follow the true lengths, as the off walk does.
struct OffMasks {
  int ctx0, lim_lo, lim_hi, mask_from, lo_lo, lo_hi, win_hi, lo_tile;

  __device__ OffMasks(const Params& p, const Work& w, const Rows& rw, int cw)
      : ctx0(w.seq_len - w.q_len),
        lim_lo(p.causal ? ctx0 + rw.qi_lo : w.seq_len - 1),
        lim_hi(p.causal ? ctx0 + rw.qi_hi : w.seq_len - 1),
        mask_from(p.causal ? min(ctx0 + rw.first_qi, w.seq_len) : w.seq_len),
        lo_lo(lim_lo - p.window),
        lo_hi(lim_hi - p.window),
        win_hi(ctx0 + w.tok0 + (64 * cw + 63) / p.group - p.window),
        lo_tile(ctx0 + w.tok0 - p.window + 1) {}

  // The row arithmetic of the scores sc of the positions from kvb (a whole step's 64 a thread, or a half
  // step's 32): the cap, the masks where the positions reach a bound, v2_step into the split's state.
  template <int N>
  __device__ __forceinline__ void to_p(float (&sc)[N], int kvb, const Params& p, int lane, float& m_lo, float& m_hi,
                                       float& l_lo, float& l_hi, float& a_lo, float& a_hi) const {
    constexpr int kPositions = 2 * N;
    if constexpr (v2::kSoftCap) cap_scores(sc, p);
    if constexpr (v2::kWindow) {
      if (kvb + kPositions > mask_from || kvb <= win_hi) mask_scores_window(sc, kvb, lo_lo, lim_lo, lo_hi, lim_hi, lane);
    } else {
      if (kvb + kPositions > mask_from) mask_scores(sc, kvb, lim_lo, lim_hi, lane);
    }
    v2_step(sc, v2::score_scale(p.scale_log2), m_lo, m_hi, l_lo, l_hi, a_lo, a_hi);
  }
};

// ---- the v2 arithmetic (docs/kernels.md section 7): the routed consumers ---------------
// Policy off: the contract's row arithmetic (v2_step: 128-position steps, FA3's exponent form,
// per-lane row sums in step_tree order, the quad's lanes once per split; splits of 512 folded
// into a running state) with FA3's schedules. The QK^T of step t + 1 is issued right ahead of
// the PV of step t and step t + 1's softmax runs while that PV does (intra-warpgroup overlap);
// the two consumer warpgroups take turns at issuing (pingpong, Turns). The running state lives
// in shared memory (Layout::kOffRun): with the overlap, s of step t + 1, pa of step t, acc and a
// register-resident running state would all be live. Per row the operations and their order
// are those of the constant-time consumer below and of csrc/decode_sm90.cu's consume_v2:
// O = O * a(t) + P(t) V(t), a(t) applied right before PV(t); at a split's end the split's state
// (m and l after its last step, saved before the next split's first softmax, which starts
// fresh) is folded into the running one with fold_stats / fold_value, acc zeroed. Tiles pack
// (token, head) rows without slots (rows_of_packed): a row's bits do not depend on its tile.
// Not constant-time (policy off): the trip count, the mask branch and the V-tail zeroing
// follow the true lengths.
template <bool BF16, int STAGES>
__device__ __forceinline__ void consume_v2(const Params& p, const Work& w, uint8_t* smem_ptr, uint32_t smem,
                                           const Barriers<STAGES>& bar, int kvh) {
  using L = LayoutOff<STAGES>;
  constexpr int kStepsPerSplit = kSplitKV / kCols;
  constexpr bool DESC_ADD = kDescAddOff;
  const int cw = consumer_warpgroup();
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const Rows rw = rows_of_packed(p, w, cw, warp, lane, kvh);
  const OffMasks mk(p, w, rw, cw);
  const int ctx0 = mk.ctx0, lo_tile = mk.lo_tile;
  const uint32_t q_base = smem + 64 * cw * 128;
  const Turns<true, kConsumersOff> turns{cw};
  // Window (feature libraries): the walk starts at step t0 (work_of); a step holding a position
  // at or below the warpgroup's highest lower bound (its last row's position - W) is masked
  // below too; the V rows below the tile's lowest bound (lo_tile) in step t0 are zeroed, as the
  // tail past seq_len: under vLLM they may be the null block of the pages the window dropped.
  const int t0 = v2::kWindow ? w.t0 : 0;
  // Half softmax (kHalfSoftmax: the head-64 window libraries, gpt-oss's window 128; docs/perf-notes.md
  // lever 64): the positions some row of this warpgroup attends lie in [lo_pos, hi_pos] (hi_pos from the
  // warpgroup's last tile row, a bound for rows past the tile's tokens too), so a step's 64-position half
  // outside it holds only masked scores for every row: its exponents, row max and sum are skipped and its
  // P is +0 (pa zeroed), which is what the whole step computes there (v2_step's N = 32, v2::step_tree of
  // 8 groups). S and PV stay whole: a branch around the wgmmas made ptxas serialize them. live: bit 0
  // the low half holds an attended position, bit 1 the high one; warp-uniform by a broadcast (as
  // CUTLASS's canonical_warp_group_idx), else ptxas treats the branch as divergent. Policy off: true
  // lengths, as the walk itself.
  const int hi_pos = min(w.seq_len - 1, p.causal ? ctx0 + w.tok0 + (64 * cw + 63) / p.group : INT_MAX);
  const int lo_pos = (p.causal ? ctx0 + rw.first_qi : w.seq_len - 1) - p.window + 1;
  auto live_of = [&](int t) {
    if constexpr (!kHalfSoftmax) return 3;
    const int kv0 = t * kCols;
    const int live = static_cast<int>((kv0 <= hi_pos) & (kv0 + 63 >= lo_pos)) |
                     static_cast<int>((kv0 + 64 <= hi_pos) & (kv0 + 127 >= lo_pos)) << 1;
    return __shfl_sync(0xffffffff, live, 0);
  };

  float acc[kAcc], s[64];
  uint32_t pa[32];
  float(&s_lo)[32] = *reinterpret_cast<float(*)[32]>(&s[0]);
  float(&s_hi)[32] = *reinterpret_cast<float(*)[32]>(&s[32]);
  uint32_t(&pa_lo)[16] = *reinterpret_cast<uint32_t(*)[16]>(&pa[0]);
  uint32_t(&pa_hi)[16] = *reinterpret_cast<uint32_t(*)[16]>(&pa[16]);
  float4* run_smem = reinterpret_cast<float4*>(smem_ptr + L::kOffRun) + cw * (kHead / 8) * 128 + tid;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kHead / 8; ++i) run_smem[128 * i] = make_float4(0.f, 0.f, 0.f, 0.f);
  float mr_lo = kMInit, mr_hi = kMInit, lr_lo = 0.f, lr_hi = 0.f;  // running (folded) state, l quad-summed
  float m_lo = kMInit, m_hi = kMInit, l_lo = 0.f, l_hi = 0.f;      // this split's state, l per lane
  float a_lo = 1.f, a_hi = 1.f;

  auto scores = [&](int t) {  // issue S = Q K_t^T
    const int st = (t - t0) % STAGES;
    mbar_wait(bar.k_full(st), ((t - t0) / STAGES) & 1);
    wgmma_fence();
    issue_qk<BF16, L::kQHalfBytes, DESC_ADD>(s, q_base, smem + L::kOffK + st * kTileBytes);
    wgmma_commit();
  };
  auto values = [&](int t) {  // issue O += P V_t (O already scaled by a(t))
    const int st = (t - t0) % STAGES;
    mbar_wait(bar.v_full(st), ((t - t0) / STAGES) & 1);
    const int valid = w.seq_len - t * kCols;
    if (valid < kCols)
      zero_v_tail<kCols, 128, kHalves>(smem_ptr + L::kOffV + st * kTileBytes, valid, tid, kBarVTail + cw);
    if (v2::kWindow && t == t0 && lo_tile > t * kCols)
      zero_v_head<kCols, 128, kHalves>(smem_ptr + L::kOffV + st * kTileBytes, min(lo_tile - t * kCols, kCols), tid, kBarVTail + cw);
    wgmma_fence();
    issue_pv_off<BF16, DESC_ADD>(acc, pa, smem + L::kOffV + st * kTileBytes, p.v_lbo, p.v_sbo, t % kStepsPerSplit == 0);
    wgmma_commit();
  };
  // The row arithmetic on the scores of the positions from kvb: a whole step's 64 a thread (s, 128
  // positions) or a half step's 32 (s_lo / s_hi, 64 positions): cap, mask where the positions reach a
  // bound, v2_step.
  auto scores_to_p = [&](auto& sc, int kvb) { mk.to_p(sc, kvb, p, lane, m_lo, m_hi, l_lo, l_hi, a_lo, a_hi); };
  auto softmax = [&](int t, int live) {  // step t's row arithmetic; a fresh state at a split's first step
    const int kv0 = t * kCols;
    if (!kHalfSoftmax || live == 3) {
      scores_to_p(s, kv0);
    } else if (live == 2) {
      scores_to_p(s_hi, kv0 + 64);
    } else {  // the low half (none live: every score masked there too)
      scores_to_p(s_lo, kv0);
    }
  };
  auto pack = [&](int live) {  // P into the PV's A registers (a half step: the other half's P +0)
    if (!kHalfSoftmax || live == 3) {
      pack_p<BF16, 64>(s, pa);
    } else if (live == 2) {
      pack_p<BF16, 32>(s_hi, pa_hi);
#pragma unroll
      for (int i = 0; i < 16; ++i) pa_lo[i] = 0u;
    } else {
      pack_p<BF16, 32>(s_lo, pa_lo);
#pragma unroll
      for (int i = 0; i < 16; ++i) pa_hi[i] = 0u;
    }
  };
  // A split's end (docs/perf-notes.md levers 62-63: the fold was the policy-off prefill's largest
  // cost over FA3's consumer, ~6 %): after PV(t), its coefficients (fold_stats, which also updates the
  // running m and l) and acc folded into run_smem. acc is not zeroed: the next split's first PV
  // overwrites it (issue_pv_off's fresh). Computing the coefficients earlier, under S(t + 1), was no
  // faster (ptxas if-converted them into every step).
  auto fold = [&](float fm_lo, float fm_hi, float fl_lo, float fl_hi) {  // acc (done) into run_smem
    const FoldCoef lo = fold_stats(mr_lo, lr_lo, fm_lo, quad_lanes(fl_lo));
    const FoldCoef hi = fold_stats(mr_hi, lr_hi, fm_hi, quad_lanes(fl_hi));
#pragma unroll
    for (int i = 0; i < kHead / 8; ++i) {
      const float4 r = run_smem[128 * i];
      run_smem[128 * i] = make_float4(fold_value(r.x, acc[4 * i], lo), fold_value(r.y, acc[4 * i + 1], lo),
                                      fold_value(r.z, acc[4 * i + 2], hi), fold_value(r.w, acc[4 * i + 3], hi));
    }
  };

  mbar_wait(bar.q_full(), 0);
  turns.start();
  turns.wait();
  scores(t0);
  turns.pass();
  wgmma_wait<0>();
  pin(s);
  release(bar.k_empty(0), lane);
  int live = live_of(t0);
  softmax(t0, live);
  // No rescale of acc here nor at a split's first step: acc is +0 here, and +0 * a(t) is +0 for every
  // a(t) v2_step gives (select_ex2: 1 or 2^x, x <= 0, finite), so leaving it out keeps the bits; at a
  // split's first step the fresh PV does not read acc
  pack(live);
  // Steady state peeled so that every path has the same wgmma structure (as consume's).
  for (int t = t0; t + 1 < w.n_steps; ++t) {
    live = live_of(t + 1);
    turns.wait();
    scores(t + 1);  // S of step t+1 runs while ...
    values(t);      // ... PV of step t is queued behind it
    turns.pass();
    const bool boundary = (t + 1) % kStepsPerSplit == 0;  // step t + 1 starts a split: step index only
    const float fm_lo = m_lo, fm_hi = m_hi, fl_lo = l_lo, fl_hi = l_hi;  // the split's state, for its fold
    if (boundary) {
      m_lo = m_hi = kMInit;
      l_lo = l_hi = 0.f;
    }
    wgmma_wait<1>();  // S(t+1) done, PV(t) may still run
    pin(s);
    release(bar.k_empty((t + 1 - t0) % STAGES), lane);
    softmax(t + 1, live);
    wgmma_wait<0>();
    pin(acc);
    pin(pa);
    release(bar.v_empty((t - t0) % STAGES), lane);
    if (boundary) {  // step t + 1 starts a split: no rescale (its fresh PV overwrites acc)
      fold(fm_lo, fm_hi, fl_lo, fl_hi);
    } else {
      scale_rows(acc, a_lo, a_hi);
    }
    pack(live);
  }
  turns.wait();
  values(w.n_steps - 1);
  turns.pass();
  wgmma_wait<0>();
  pin(acc);
  pin(pa);
  release(bar.v_empty((w.n_steps - 1 - t0) % STAGES), lane);
  fold(m_lo, m_hi, l_lo, l_hi);
  turns.finish();

  float inv_lo, inv_hi;
  running_state_out(p, rw, run_smem, mr_lo, lr_lo, mr_hi, lr_hi, acc, inv_lo, inv_hi);
  store_row<BF16, 0>(p, w, rw.qi_lo, rw.head_lo, rw.ok_lo, lane, acc, inv_lo);
  store_row<BF16, 2>(p, w, rw.qi_hi, rw.head_hi, rw.ok_hi, lane, acc, inv_hi);
}

// The SM's id: the policy-off binary's running-state slot at head 256 (kRunGlobal). One CTA of
// this file's kernels per SM (shared memory), so a slot has one user at a time.
[[maybe_unused]] __device__ __forceinline__ int sm_id() {
  int id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}

// A split's end with the running state in global memory (kRunGlobal; run: this thread's first
// float4, kHead / 8 of them 128 float4 apart, coalesced per warp; the first kRunSmemF4 of them at
// run_s in shared memory instead): r = fold_value(r, acc, coef), the operations of the shared-memory
// fold. FIRST (the tile's first fold: the state is zeros, as shared memory's after its clearing)
// reads nothing; LAST keeps the folded values in acc for the epilogue instead of storing them;
// otherwise acc is zeroed for the next split (head 256 keeps the zeroing: its first PV with scale-d = 0,
// issue_pv_off, measured 2.5 % slower; docs/perf-notes.md lever 63). Loads in batches of kBatch float4
// (4 * kBatch registers beside acc's 128), the global ones through L2 (ld.global.cg). [C0, C1): the
// float4 this call folds (a fold may come in parts: consume_v2_serial).
template <bool LAST, int kBatch = 8, int C0 = 0, int C1 = kHead / 8>
__device__ __forceinline__ void fold_run_global(float4* run, float4* run_s, float (&acc)[kAcc], FoldCoef lo,
                                                FoldCoef hi, bool first) {
  static_assert((C1 - C0) % kBatch == 0, "whole batches");
#pragma unroll
  for (int c = C0; c < C1; c += kBatch) {
    float4 r[kBatch];
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = c + j;
      r[j] = first ? make_float4(0.f, 0.f, 0.f, 0.f) : i < kRunSmemF4 ? run_s[128 * i] : __ldcg(run + 128 * i);
    }
#pragma unroll
    for (int j = 0; j < kBatch; ++j) {
      const int i = c + j;
      const float x = fold_value(r[j].x, acc[4 * i], lo), y = fold_value(r[j].y, acc[4 * i + 1], lo);
      const float z = fold_value(r[j].z, acc[4 * i + 2], hi), u = fold_value(r[j].w, acc[4 * i + 3], hi);
      if constexpr (LAST) {
        acc[4 * i] = x, acc[4 * i + 1] = y, acc[4 * i + 2] = z, acc[4 * i + 3] = u;
      } else {
        if (i < kRunSmemF4)  // compile-time: i unrolls
          run_s[128 * i] = make_float4(x, y, z, u);
        else
          __stcg(run + 128 * i, make_float4(x, y, z, u));
        acc[4 * i] = acc[4 * i + 1] = acc[4 * i + 2] = acc[4 * i + 3] = 0.f;
      }
    }
  }
}

// Policy off at head 256 (two consumer warpgroups, one stage of K and of V; running state in global
// and shared memory: kRunGlobal, kRunSmemF4): the operations of consume_v2 on its rows in the same
// order, without its overlap. Per step: S = Q K_t^T (the warpgroups take turns at issuing it, so one's
// softmax and PV run while the other's S does), K released; the step's row arithmetic (v2_step);
// O = O * a(t) + P(t) V(t), V released; at a split's end the split's state folded into the running
// state (fold_run_global, partly at the split's end and the rest right after the next step's S is
// issued) and a fresh state. consume_v2 computes the
// same: a(t) applied right before PV(t), the fold after the split's last PV and before the next
// split's first PV, with the state saved before the next split's first softmax (which starts fresh);
// so the same bits. There is no register room for S of the next step beside P and O (v2_arith.cuh, "Head 256"): a warpgroup's tensor work waits for its softmax, the
// other warpgroup's fills the gap, and the producer's loads of step t + 1 run under step t's
// softmax (K) and PV (V).
// Not constant-time (policy off): the trip count, the mask branch and the V-tail zeroing follow the
// true lengths.
template <bool BF16, int STAGES>
__device__ __forceinline__ void consume_v2_serial(const Params& p, const Work& w, uint8_t* smem_ptr, uint32_t smem,
                                                  const Barriers<STAGES>& bar, int kvh) {
  using L = LayoutOff<STAGES>;
  constexpr int kStepsPerSplit = kSplitKV / kCols;
  constexpr bool DESC_ADD = kDescAddOff;
  const int cw = consumer_warpgroup();
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const Rows rw = rows_of_packed(p, w, cw, warp, lane, kvh);
  const OffMasks mk(p, w, rw, cw);
  const int lo_tile = mk.lo_tile;
  const uint32_t q_base = smem + 64 * cw * 128;
  const Turns<true, kConsumersOff> turns{cw};
  // Window (feature libraries): as consume_v2.
  const int t0 = v2::kWindow ? w.t0 : 0;

  float acc[kAcc], s[64];
  uint32_t pa[32];
  const int slot = sm_id();
  // sm_90 has at most 144 SM ids and the host passes 495 slots (ops/cuda_prefill.py run_state; a
  // GPU test checks %nsmid against them): a trap, never two SMs on one slot, if a device had more.
  if (slot >= p.run_slots) __trap();
  float4* const run = p.run + (static_cast<int64_t>(slot) * kConsumersOff + cw) * (kHead / 8) * 128 + tid;
  float4* const run_s = reinterpret_cast<float4*>(smem_ptr + L::kOffRun) + cw * kRunSmemF4 * 128 + tid;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
  float mr_lo = kMInit, mr_hi = kMInit, lr_lo = 0.f, lr_hi = 0.f;  // running (folded) state, l quad-summed
  float m_lo = kMInit, m_hi = kMInit, l_lo = 0.f, l_hi = 0.f;      // this split's state, l per lane
  float a_lo = 1.f, a_hi = 1.f;
  bool first_fold = true;
  // A split's fold in two parts, both before the next split's first PV, so the same operations on the
  // same values as one fold right after the split's last PV (acc = 0 * a(t) after it): at the split's
  // end (its coefficients, and 16 of the 24 global float4 in one batch of L2 loads while S and P hold
  // no registers), then the rest (the shared-memory quarter and the last 8 global float4) right after
  // the next step's S is issued, so that S does not wait for it. ptxas makes that part wait for S
  // (C7517: it writes registers a wgmma defined), so its loads follow S rather than overlap it.
  // Each float4 is folded once.
  bool fold_due = false;
  FoldCoef due_lo{1.f, 0.f}, due_hi{1.f, 0.f};

  mbar_wait(bar.q_full(), 0);
  turns.start();
  for (int t = t0; t < w.n_steps; ++t) {
    const int st = (t - t0) % STAGES;
    const uint32_t par = ((t - t0) / STAGES) & 1;
    const int kv0 = t * kCols;
    mbar_wait(bar.k_full(st), par);
    turns.wait();
    wgmma_fence();
    issue_qk<BF16, L::kQHalfBytes, DESC_ADD>(s, q_base, smem + L::kOffK + st * kTileBytes);
    wgmma_commit();
    turns.pass();
    if (fold_due) {  // the rest of the fold of the split that ended at step t - 1
      fold_run_global<false, kFoldBatchUnderS, 0, kRunSmemF4>(run, run_s, acc, due_lo, due_hi, first_fold);
      fold_run_global<false, kFoldBatchUnderS, kFoldEarlyEnd, kHead / 8>(run, run_s, acc, due_lo, due_hi, first_fold);
      first_fold = false;
      fold_due = false;
    }
    wgmma_wait<0>();
    pin(s);
    release(bar.k_empty(st), lane);
    mk.to_p(s, kv0, p, lane, m_lo, m_hi, l_lo, l_hi, a_lo, a_hi);
    pack_p<BF16, 64>(s, pa);
    // acc is +0 at the walk's first step and at a split's first (the fold zeroed it): no rescale there,
    // +0 * a(t) being +0 (as consume_v2; measured neutral here, kept for the one rule)
    if (t != t0 && t % kStepsPerSplit != 0) scale_rows(acc, a_lo, a_hi);
    mbar_wait(bar.v_full(st), par);
    uint8_t* const v_tile = smem_ptr + L::kOffV + st * kTileBytes;
    const int valid = w.seq_len - kv0;
    if (valid < kCols) zero_v_tail<kCols, 128, kHalves>(v_tile, valid, tid, kBarVTail + cw);
    if (v2::kWindow && t == t0 && lo_tile > kv0)
      zero_v_head<kCols, 128, kHalves>(v_tile, min(lo_tile - kv0, kCols), tid, kBarVTail + cw);
    wgmma_fence();
    issue_pv<BF16, DESC_ADD>(acc, pa, smem + L::kOffV + st * kTileBytes, p.v_lbo, p.v_sbo);
    wgmma_commit();
    wgmma_wait<0>();
    pin(acc);
    pin(pa);
    release(bar.v_empty(st), lane);
    if ((t + 1) % kStepsPerSplit == 0 && t + 1 < w.n_steps) {  // a split's end: its fold due, a fresh state
      due_lo = fold_stats(mr_lo, lr_lo, m_lo, quad_lanes(l_lo));
      due_hi = fold_stats(mr_hi, lr_hi, m_hi, quad_lanes(l_hi));
      // the first global part now, while S and P hold no registers: one batch of 16 L2 loads
      fold_run_global<false, kFoldEarlyEnd - kRunSmemF4, kRunSmemF4, kFoldEarlyEnd>(run, run_s, acc, due_lo, due_hi,
                                                                                  first_fold);
      fold_due = true;
      m_lo = m_hi = kMInit;
      l_lo = l_hi = 0.f;
    }
  }
  turns.finish();
  {  // the last split's fold, kept in acc
    const FoldCoef lo = fold_stats(mr_lo, lr_lo, m_lo, quad_lanes(l_lo));
    const FoldCoef hi = fold_stats(mr_hi, lr_hi, m_hi, quad_lanes(l_hi));
    fold_run_global<true>(run, run_s, acc, lo, hi, first_fold);
  }

  float inv_lo, inv_hi;
  state_out_regs(p, rw, mr_lo, lr_lo, mr_hi, lr_hi, acc, inv_lo, inv_hi);
  store_row<BF16, 0>(p, w, rw.qi_lo, rw.head_lo, rw.ok_lo, lane, acc, inv_lo);
  store_row<BF16, 2>(p, w, rw.qi_hi, rw.head_hi, rw.ok_hi, lane, acc, inv_hi);
}

// The v2 consumer (FA3's exponent form, folds every 512) on the product's constant-time walk
// (the constant-time walk above: work_ct, produce_ct, clean_v_ct, run_smem and
// store_row_ct unchanged, and its remedies kept): every tile walks its request's public bucket;
// every score is masked by select; V rows past the true length are zeroed by the cleaners
// (the consumers wait on v_clean); a dead step (all positions past the true length) runs
// unmasked for the rows of the request and its product is never kept; in the window libraries so
// does a step wholly below a row's window, which that row never commits (below_window). The commit (kSnapCT: all
// heads but 256): after every step the split's state (acc, m, l) is copied into registers
// (snap) by selection when the step is live, so after the split's last step snap holds its state
// at its last live step, which is folded into the running state (shared memory) at the split's
// end, kept by selection when the split held a live step; the same fold with the same operands as
// the off binary's at that split's end or last step, so the same bits. Head 256 (no registers for
// the copy) folds after every step, kept by selection at the split's last live step. The two
// consumer warpgroups take turns at issuing S (Turns; named barriers, the same count whatever the
// lengths). No branch, trip count or address follows the true length: the selections are on bits
// (ct::select_f32), the split ends and the turns are step indices.
// w with its step count broadcast from lane 0 (every lane holds the same: the bucket's steps) when ON, so
// that the compiler treats loops and branches on it as warp-uniform; else w itself.
template <bool ON>
__device__ __forceinline__ Work uniform_steps(const Work& w) {
  if constexpr (!ON) {
    return w;
  } else {
    Work u = w;
    u.n_steps = __shfl_sync(0xffffffff, w.n_steps, 0);
    return u;
  }
}

template <bool BF16, int STAGES>
__device__ __forceinline__ void consume_v2_ct(const Params& p, const Work& w_in, uint8_t* smem_ptr, uint32_t smem,
                                              const Barriers<STAGES>& bar, int kvh, int g) {
  const Work w = uniform_steps<kUniformStepsCT && kHead == 256>(w_in);
  using L = Layout<STAGES, kConsumersCT>;
  constexpr int kStepsPerSplit = kSplitKV / kCols;
  constexpr bool DESC_ADD = kDescAddCT;
  const int cw = kDescAddCT ? consumer_warpgroup() : static_cast<int>(threadIdx.x / 128) - 1;
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const Rows rw = rows_of(p, w, cw, warp, lane, kvh);
  const int ctx0 = w.seq_len - w.q_len;
  // rows outside the request attend nothing (kernels: limit = 0)
  const int lim_lo = select_int(rw.qi_lo < w.q_len, p.causal ? ctx0 + rw.qi_lo : w.seq_len - 1, -1);
  const int lim_hi = select_int(rw.qi_hi < w.q_len, p.causal ? ctx0 + rw.qi_hi : w.seq_len - 1, -1);
  const uint32_t q_base = smem + 64 * cw * 128;
  // The two warpgroups take turns at issuing S (one warpgroup at head 256: no turns).
  const Turns<kConsumersCT == 2, 2, kBarTurnCT> turns{cw};
  // Window (feature libraries): the lower bound only selects, in every step; the walk is the
  // bucket's whatever the window is (its position follows the true length: design.md section 2).
  const int lo_lo = lim_lo - p.window, lo_hi = lim_hi - p.window;
  // A step wholly below a row's window (every position <= lo) runs unmasked, as a dead step does: the
  // row's state evolves on what the pages hold, is never committed, and goes back to the neutral state
  // after the row's last such step (leaving_window); a split wholly below the window leaves a filler in
  // the running state instead of its zeros (commit_fold). The first commit of a live split multiplies
  // the filler by alpha = +0 (the running m is still kMInit), so the bits are those of the masked form,
  // whose below-window steps are exact no-ops from the neutral state (docs/kernels.md section 7). Why:
  // masked, such steps' zeros in P, in the state and in the running state drew less power than live
  // operands, and how many steps of the walk lie below the window follows the true length (G4, H200,
  // 2026-11-28, head 256, window 1024, prefill short vs long: -0.046 % (t +29) masked; -0.009 % (t +10)
  // with the state reset to zeros after every such step). Rows outside the request (lim = -1) are never
  // below: they stay masked (their count is public). below and leaving feed selects only.
  auto below_window = [&](int t, int lo) { return t * kCols + kCols - 1 <= lo; };
  // kDeadPastLimitCT: step t lies wholly past a request row's causal limit (a dead step for that row). The
  // limit follows the true length (secret): the result feeds selects only (the mask's bounds, the snapshot,
  // the commit), never a branch, a trip count or an address; qi < q_len compares public tile geometry.
  auto past_limit = [&](int t, int lim, int qi) { return (t * kCols > lim) & (qi < w.q_len); };
  auto leaving_window = [&](int t, int lo) { return below_window(t, lo) & !below_window(t + 1, lo); };

  float acc[kAcc], s[64];
  uint32_t pa[32];
  float4* run_smem = reinterpret_cast<float4*>(smem_ptr + L::kOffRun) + cw * (kHead / 8) * 128 + tid;
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
#pragma unroll
  for (int i = 0; i < kHead / 8; ++i) run_smem[128 * i] = make_float4(0.f, 0.f, 0.f, 0.f);
  float mr_lo = kMInit, mr_hi = kMInit, lr_lo = 0.f, lr_hi = 0.f;  // running (folded) state, l quad-summed
  float m_lo = kMInit, m_hi = kMInit, l_lo = 0.f, l_hi = 0.f;      // this split's state, l per lane
  // The running state folded with a split's state (m, per-lane l, o), kept by selection per row (c_lo,
  // c_hi); window libraries: a row whose split lay wholly below its window (f_lo, f_hi) keeps |fold|
  // (capped at 1e30, 0 beyond: finite, non-negative) as the filler of its running accumulator, with m
  // and l unchanged (below_window). o(i): the split state's accumulator value i.
  auto commit_fold = [&](bool c_lo, bool c_hi, bool f_lo, bool f_hi, float fm_lo, float fl_lo, float fm_hi,
                         float fl_hi, auto o) {
    float mf_lo = mr_lo, lf_lo = lr_lo, mf_hi = mr_hi, lf_hi = lr_hi;
    const FoldCoef lo = fold_stats(mf_lo, lf_lo, fm_lo, quad_lanes(fl_lo));
    const FoldCoef hi = fold_stats(mf_hi, lf_hi, fm_hi, quad_lanes(fl_hi));
    auto keep = [&](bool c, bool f, float x, float r) {
      if constexpr (v2::kWindow) {
        return select_f32(f, filler_of(x), select_f32(c, x, r));
      } else {
        return select_f32(c, x, r);
      }
    };
#pragma unroll
    for (int i = 0; i < kHead / 8; ++i) {
      const float4 r = run_smem[128 * i];
      const float x = fold_value(r.x, o(4 * i), lo), y = fold_value(r.y, o(4 * i + 1), lo);
      const float z = fold_value(r.z, o(4 * i + 2), hi), u = fold_value(r.w, o(4 * i + 3), hi);
      run_smem[128 * i] = make_float4(keep(c_lo, f_lo, x, r.x), keep(c_lo, f_lo, y, r.y),
                                      keep(c_hi, f_hi, z, r.z), keep(c_hi, f_hi, u, r.w));
    }
    mr_lo = select_f32(c_lo, mf_lo, mr_lo);
    lr_lo = select_f32(c_lo, lf_lo, lr_lo);
    mr_hi = select_f32(c_hi, mf_hi, mr_hi);
    lr_hi = select_f32(c_hi, lf_hi, lr_hi);
  };
  // After step t's commit (window libraries): a row whose last step below its window was t goes back to
  // the neutral state (m kMInit, l +0, the accumulator +0), by selection: m and l here; the accumulator
  // here at head 256, elsewhere in the next step's rescale (values: a select on acc right after PV
  // spilled 300 B beside head 128's snapshot; at head 256, where no snapshot is kept, this form none).
  constexpr bool kResetAccAfterPV = !kSnapCT;
  auto leave_window = [&](int t) {
    const bool lo = leaving_window(t, lo_lo), hi = leaving_window(t, lo_hi);
    if constexpr (kResetAccAfterPV) zero_rows(acc, lo, hi);
    m_lo = select_f32(lo, kMInit, m_lo);
    l_lo = select_f32(lo, 0.f, l_lo);
    m_hi = select_f32(hi, kMInit, m_hi);
    l_hi = select_f32(hi, 0.f, l_hi);
  };
  // kSnapCT: the split's state after its last live step so far, kept by selection (read only when
  // the split held a live step). Head 256 keeps none (one placeholder value, never read).
  constexpr int kSnap = kSnapCT ? kAcc : 1;
  float snap[kSnap], sm_lo = kMInit, sm_hi = kMInit, sl_lo = 0.f, sl_hi = 0.f;
#pragma unroll
  for (int i = 0; i < kSnap; ++i) snap[i] = 0.f;
  // Step t's state is complete (PV(t) done): its commit, and a fresh state at a split's end.
  auto step_end = [&](int t) {
    const int kv0 = t * kCols;
    const bool dead = kv0 >= w.seq_len;
    // window libraries: step t lay wholly below the row's window (never committed, the filler instead)
    const bool below_lo = v2::kWindow && below_window(t, lo_lo), below_hi = v2::kWindow && below_window(t, lo_hi);
    if constexpr (kSnapCT) {
      // a dead step's product goes on into acc and is never read; accumulator value i belongs to the
      // thread's low row when i % 4 < 2 (commit_fold's x, y)
      const bool dead_lo = kDeadPastLimitCT ? past_limit(t, lim_lo, rw.qi_lo) : dead;
      const bool dead_hi = kDeadPastLimitCT ? past_limit(t, lim_hi, rw.qi_hi) : dead;
#pragma unroll
      for (int i = 0; i < kAcc; ++i) snap[i] = select_f32(!(i % 4 < 2 ? dead_lo : dead_hi), acc[i], snap[i]);
      sm_lo = select_f32(!dead_lo, m_lo, sm_lo);
      sl_lo = select_f32(!dead_lo, l_lo, sl_lo);
      sm_hi = select_f32(!dead_hi, m_hi, sm_hi);
      sl_hi = select_f32(!dead_hi, l_hi, sl_hi);
    } else {
      // a fold after every step, kept at a split's last live step
      const bool split_end = ((t + 1) % kStepsPerSplit == 0) | (t + 1 == w.n_steps);  // public
      const bool commit = !dead & (split_end | (kv0 + kCols >= w.seq_len));
      commit_fold(commit & !below_lo, commit & !below_hi, below_lo, below_hi, m_lo, l_lo, m_hi, l_hi,
                  [&](int i) { return acc[i]; });
    }
    if constexpr (v2::kWindow) leave_window(t);
    if ((t + 1) % kStepsPerSplit == 0 || t + 1 == w.n_steps) {  // a split's end: a fresh state
      // the snapshot's fold, kept when the split held a live step (below the window: the filler; the
      // split's last step below the window means every step of it is)
      if constexpr (kSnapCT) {
        // kDeadPastLimitCT: per row, the split holds a position at or before the row's limit (its first
        // step is then not dead, so the snapshot is this split's); a row outside the request (limit -1)
        // never commits and keeps the neutral state it would have folded
        const int split0 = (t / kStepsPerSplit) * kSplitKV;
        const bool commit = split0 < w.seq_len;
        const bool c_lo = kDeadPastLimitCT ? split0 <= lim_lo : commit;
        const bool c_hi = kDeadPastLimitCT ? split0 <= lim_hi : commit;
        commit_fold(c_lo & !below_lo, c_hi & !below_hi, below_lo, below_hi, sm_lo, sl_lo, sm_hi, sl_hi,
                    [&](int i) { return snap[i]; });
      }
#pragma unroll
      for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;
      m_lo = m_hi = kMInit;
      l_lo = l_hi = 0.f;
    }
  };
  // Step t's row arithmetic on its scores s: every score masked by select; a dead step (every
  // position past the true length) unmasked for the request's rows, and a step below a row's window
  // (window libraries) for that row.
  auto softmax = [&](int t, float& a_lo, float& a_hi) {
    const int kv0 = t * kCols;
    const bool dead = kv0 >= w.seq_len;
    if constexpr (v2::kSoftCap) cap_scores(s, p);
    if constexpr (v2::kWindow) {
      const bool dead_lo = kDeadPastLimitCT ? past_limit(t, lim_lo, rw.qi_lo) : dead & (rw.qi_lo < w.q_len);
      const bool dead_hi = kDeadPastLimitCT ? past_limit(t, lim_hi, rw.qi_hi) : dead & (rw.qi_hi < w.q_len);
      const bool open_lo = dead_lo | below_window(t, lo_lo), open_hi = dead_hi | below_window(t, lo_hi);
      mask_scores_window(s, kv0, select_int(open_lo, INT_MIN, lo_lo), select_int(dead_lo, INT_MAX, lim_lo),
                         select_int(open_hi, INT_MIN, lo_hi), select_int(dead_hi, INT_MAX, lim_hi), lane);
    } else {
      mask_scores(s, kv0, select_int(dead & (rw.qi_lo < w.q_len), INT_MAX, lim_lo),
                  select_int(dead & (rw.qi_hi < w.q_len), INT_MAX, lim_hi), lane);  // every step, by select
    }
    v2_step(s, v2::score_scale(p.scale_log2), m_lo, m_hi, l_lo, l_hi, a_lo, a_hi);
  };
  auto scores = [&](int t) {  // issue S = Q K_t^T
    const int st = t % STAGES;
    mbar_wait(bar.k_full(st), (t / STAGES) & 1);
    wgmma_fence();
    issue_qk<BF16, L::kQHalfBytes, DESC_ADD>(s, q_base, smem + L::kOffK + st * kTileBytes);
    wgmma_commit();
  };
  auto values = [&](int t, float a_lo, float a_hi) {  // O = O * a(t) + P V_t, on V rows the cleaners zeroed
    const int st = t % STAGES;
    mbar_wait(v_clean(bar, st), (t / STAGES) & 1);
    scale_rows(acc, a_lo, a_hi);
    if constexpr (v2::kWindow && !kResetAccAfterPV) {  // a row that left its window's prefix: from +0
      // (at t = 0, "step -1" may read as left: acc is the fresh +0 then, so the select changes nothing;
      // no short-circuit on t either, which compiled to a branch)
      zero_rows(acc, leaving_window(t - 1, lo_lo), leaving_window(t - 1, lo_hi));
    }
    wgmma_fence();
    issue_pv<BF16, DESC_ADD>(acc, pa, smem + L::kOffV + st * kTileBytes, p.v_lbo, p.v_sbo);
    wgmma_commit();
  };

  mbar_wait(bar.q_full(), 0);
  turns.start();
  // S, softmax, PV and the step's end in series (with the overlap of consume_v2, or PV(t) and
  // S(t + 1) issued together and the step's end under S(t + 1), measured slower: perf-notes, lever 53).
  for (int t = 0; t < w.n_steps; ++t) {
    float a_lo, a_hi;
    turns.wait();
    scores(t);
    turns.pass();
    wgmma_wait<0>();
    pin(s);
    release(bar.k_empty(t % STAGES), lane);
    softmax(t, a_lo, a_hi);
    pack_p<BF16, 64>(s, pa);
    values(t, a_lo, a_hi);
    wgmma_wait<0>();
    pin(acc);
    pin(pa);
    release(bar.v_empty(t % STAGES), lane);
    step_end(t);
  }
  turns.finish();
  float inv_lo, inv_hi;
  running_state_out(p, rw, run_smem, mr_lo, lr_lo, mr_hi, lr_hi, acc, inv_lo, inv_hi);
  const int r = 64 * cw + 16 * warp + lane / 4;
  store_row_ct<BF16, 0>(p, w, rw.qi_lo, rw.head_lo, rw.ok_lo, g, r, lane, acc, inv_lo);
  store_row_ct<BF16, 2>(p, w, rw.qi_hi, rw.head_hi, rw.ok_hi, g, r + 8, lane, acc, inv_hi);
}

// The v2 consumer's constant-time kernel: the product prefill_kernel's CT branch (work_ct,
// producer warpgroup: Q rows by load_q_ct, K/V by produce_ct, V cleaning by clean_v_ct) with
// consume_v2_ct. LMODE 0: one bucket; 1: per-request buckets.
template <bool BF16, int LMODE>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_v2_ct_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                         const __grid_constant__ CUtensorMap tm_v, const Params p) {
  constexpr int STAGES = kStages;
  using L = Layout<STAGES, kConsumersCT>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = (1024 - (raw & 1023)) & 1023;
  uint8_t* smem_ptr = smem_raw + pad;
  const uint32_t smem = raw + pad;
  const Barriers<STAGES> bar{smem + L::kOffBar};
  const int kvh = blockIdx.x;
  const int g = p.num_tiles - 1 - static_cast<int>(blockIdx.y);
  const Work w = work_ct<LMODE>(p, locate_ct(p, g), g);  // every thread, no exit
  if (threadIdx.x == 0) {
    bar.init(4 * kConsumersCT);  // one release per consumer warp
    for (int i = 0; i < STAGES; ++i) mbar_init(v_clean(bar, i), kCleanThreads / 32);
    mbar_fence_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    if constexpr (kConsumersCT == 2) regs_dealloc<40>();  // (one consumer: every thread may hold 255)
    load_q_ct(p, w, smem_ptr, bar, kvh);
    if (threadIdx.x < 32) {
      produce_ct<STAGES>(p, w, &tm_k, &tm_v, smem, bar, kvh, threadIdx.x);
    } else if (threadIdx.x >= 32 && threadIdx.x < 32 + kCleanThreads) {
      clean_v_ct<STAGES>(w, smem_ptr, bar, threadIdx.x - 32);
    }
  } else {
    if constexpr (kConsumersCT == 2) regs_alloc<232>();
    consume_v2_ct<BF16, STAGES>(p, w, smem_ptr, smem, bar, kvh, g);
  }
}

template <bool BF16, int LMODE>
int launch_v2_ct(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& p, dim3 grid,
                 cudaStream_t stream) {
  constexpr auto kernel = prefill_v2_ct_kernel<BF16, LMODE>;
  constexpr int bytes = Layout<kStages, kConsumersCT>::kBytes;
  if (const cudaError_t e = allow_dynamic_smem<kernel>(bytes); e != cudaSuccess) return static_cast<int>(e);
  kernel<<<grid, kThreads, bytes, stream>>>(tq, tk, tv, p);
  return static_cast<int>(cudaGetLastError());
}

// The producer spread over the producer warpgroup's four warps (one per scheduler partition;
// the one-thread producer shares its partition with two consumer warps, which then issue ~1.5x
// the other partitions' instructions: docs/perf-notes.md). A stage holds pps = 128 / bs pages;
// warp pw loads pages [pw * per, pw * per + n) (per = max(pps / 4, 1), n = per or 0) and arms
// the stage's full barrier with its share of the bytes (possibly none): the barrier completes
// on the four warps' arrivals. Every warp waits for the stage's release first. The Q box is
// GROUP heads x block_q tokens (rows_of_packed). Policy off: pages past the request's last one
// repeat it (masked out of S and zeroed in V by the consumers).
__device__ __forceinline__ void load_share(uint32_t dst, const CUtensorMap* tm, uint32_t full, int first, int n,
                                           const int (&blk)[2], int bs, int kvh) {
  mbar_arrive_expect_tx(full, n * bs * 2 * kHead);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (j < n) {  // block size: public
#pragma unroll
      for (int h = 0; h < kHalves; ++h)
        tma_load_4d(dst + h * kHalfBytes + (first + j) * bs * 128, tm, full, 64 * h, 0, kvh, blk[j]);
    }
  }
}

template <int STAGES>
__device__ __forceinline__ void produce_spread(const Params& p, const Work& w, const CUtensorMap* tm_q,
                                               const CUtensorMap* tm_k, const CUtensorMap* tm_v, uint32_t smem,
                                               const Barriers<STAGES>& bar, int kvh, int req, int pw) {
  using L = LayoutOff<STAGES>;
  if (pw == 0) {
    mbar_arrive_expect_tx(bar.q_full(), p.group * p.block_q * 2 * kHead);
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
      tma_load_3d(smem + h * L::kQHalfBytes, tm_q, bar.q_full(), 64 * h, kvh * p.group, w.q0 + w.tok0);
  }
  const int* table = p.block_table + static_cast<int64_t>(req) * p.bt_stride;
  const int bs = p.block_size, pps = kCols / bs;
  const int per = pps >= 4 ? pps / 4 : 1, first = pw * per, n = first < pps ? per : 0;
  const int last_page = (w.seq_len + bs - 1) / bs - 1;
  const int t0 = v2::kWindow ? w.t0 : 0;  // a window's first step (work_of)
  for (int t = t0; t < w.n_steps; ++t) {
    const int s = (t - t0) % STAGES;
    const uint32_t parity = (((t - t0) / STAGES) - 1) & 1;  // the release of step t - STAGES
    const uint32_t k_dst = smem + L::kOffK + s * kTileBytes, v_dst = smem + L::kOffV + s * kTileBytes;
    int blk[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) blk[j] = j < n ? table[min(t * pps + first + j, last_page)] : 0;
    if (t - t0 >= STAGES) mbar_wait(bar.k_empty(s), parity);
    load_share(k_dst, tm_k, bar.k_full(s), first, n, blk, bs, kvh);
    if (t - t0 >= STAGES) mbar_wait(bar.v_empty(s), parity);
    load_share(v_dst, tm_v, bar.v_full(s), first, n, blk, bs, kvh);
  }
}

// The policy-off kernel: prefill_kernel's tiling and padding rows, the spread producer, the v2
// consumer; FA3's register split (producer warpgroup 24, two consumers 240, three 160).
template <bool BF16>
__global__ void __launch_bounds__(kThreadsOff, 1)
    prefill_v2_kernel(const __grid_constant__ CUtensorMap tm_q, const __grid_constant__ CUtensorMap tm_k,
                      const __grid_constant__ CUtensorMap tm_v, const Params p) {
  constexpr int STAGES = kStages;
  using L = LayoutOff<STAGES>;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t pad = (1024 - (raw & 1023)) & 1023;
  uint8_t* smem_ptr = smem_raw + pad;
  const uint32_t smem = raw + pad;
  const Barriers<STAGES> bar{smem + L::kOffBar};
  const int kvh = blockIdx.x;
  const int g = p.num_tiles - 1 - static_cast<int>(blockIdx.y);
  const int req = locate(p.query_start_loc, p.num_seqs, p.block_q, g);
  if (req == p.num_seqs) {  // padding rows: zeros
    const int first = p.query_start_loc[req] + (g - (p.query_start_loc[req] / p.block_q + req)) * p.block_q;
    const int toks = min(p.block_q, p.num_out_rows - first);
    char* out = static_cast<char*>(p.out);
    constexpr int kPieces = kModelHead / 8;  // 16-byte pieces of a row
    for (int i = threadIdx.x; i < toks * p.group * kPieces; i += kThreadsOff) {
      const int64_t tok = first + (i / kPieces) / p.group, head = kvh * p.group + (i / kPieces) % p.group;
      reinterpret_cast<uint4*>(out + 2 * (tok * p.out_tok_stride + head * p.out_head_stride))[i % kPieces] =
          make_uint4(0, 0, 0, 0);
    }
    return;
  }
  const Work w = work_of(p, req, g);
  if (w.tok0 >= w.q_len) return;
  if (threadIdx.x == 0) {  // full barriers complete on the four producer warps' arrivals
    mbar_init(bar.q_full(), 1);
    for (int i = 0; i < STAGES; ++i) {
      mbar_init(bar.k_full(i), 4);
      mbar_init(bar.v_full(i), 4);
      mbar_init(bar.k_empty(i), 4 * kConsumersOff);  // one arrival per consumer warp
      mbar_init(bar.v_empty(i), 4 * kConsumersOff);
    }
    mbar_fence_init();
  }
  __syncthreads();
  if (threadIdx.x < 128) {
    regs_dealloc<24>();
    if (threadIdx.x % 32 == 0) produce_spread<STAGES>(p, w, &tm_q, &tm_k, &tm_v, smem, bar, kvh, req, threadIdx.x / 32);
  } else if constexpr (kSerialOff) {
    regs_alloc<240>();
    consume_v2_serial<BF16, STAGES>(p, w, smem_ptr, smem, bar, kvh);
  } else {
    regs_alloc<kConsumersOff == 3 ? 160 : 240>();
    consume_v2<BF16, STAGES>(p, w, smem_ptr, smem, bar, kvh);
  }
}

template <bool BF16>
int launch_v2(const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv, const Params& p, dim3 grid,
              cudaStream_t stream) {
  constexpr auto kernel = prefill_v2_kernel<BF16>;
  constexpr int bytes = LayoutOff<kStages>::kBytes;  // the running state in shared memory (kOffRun) but at head 256
  if (const cudaError_t e = allow_dynamic_smem<kernel>(bytes); e != cudaSuccess) return static_cast<int>(e);
  kernel<<<grid, kThreadsOff, bytes, stream>>>(tq, tk, tv, p);
  return static_cast<int>(cudaGetLastError());
}

// The binaries ops.cuda_prefill routes to: 60 v2 (policy off: consume_v2, the spread producer,
// packed rows), 61 v2_ct (the constant-time walk; one binary per bucket mode, l_mode 1:
// per-request buckets, policy request). Every one has the same bits. Other codes: -5.
template <bool BF16>
int launch_variant(int variant, const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv,
                   const Params& p, dim3 grid, cudaStream_t st) {
  if (variant == 60) return launch_v2<BF16>(tq, tk, tv, p, grid, st);
  if (variant == 61) return p.l_mode == 1 ? launch_v2_ct<BF16, 1>(tq, tk, tv, p, grid, st)
                                          : launch_v2_ct<BF16, 0>(tq, tk, tv, p, grid, st);
  return -5;
}

}  // namespace
}  // namespace dhp

// C entry point (ctypes). Strides in elements. Returns 0 or an error code:
// a cudaError_t, or -1 (no cuTensorMapEncodeTiled), -2..-4 (tensor map of Q/K/V
// rejected: alignment or stride not a multiple of 16 bytes), -5 (unknown variant),
// -6 (more than 65535 tiles: num_tokens / block_q + num_seqs + 1), -7 (query heads per
// KV head not a divisor ratio <= 128).
// variant: 60 v2 (policy off), 61 v2_ct (the constant-time walk: l_mode .. sink are its
// arguments, ignored by 60; -8 when they are out of range; each request's table line must
// hold its reserved pages up to its bucket, the address rule that ops.paged_attention
// checks). qk_scale = softmax scale * log2(e) as the caller
// computes it (the Triton launcher's value, for equal bits).
// window, cap_pre, cap_post, sinks: the features of a feature library (v2_arith.cuh: -DDHP_WINDOW,
// -DDHP_SOFTCAP, -DDHP_SINKS): W >= 1 in a window library, else 0; the soft cap's constants
// (cuda_common.feature_args) in a soft-cap library, else 0; float32 [num_heads] sinks in a sink
// library, else null. -10 when they do not match the library.
// run, run_slots: the policy-off running states at head 256 (Params::run: run_slots x 2 x 64 KB,
// 16-byte aligned, run_slots >= %nsmid, which dhp_prefill_sm90_nsmid reads); -11 when missing there.
extern "C" int dhp_prefill_sm90(const void* q, int64_t q_tok_stride, int64_t q_head_stride, const void* k,
                                const void* v, int64_t kv_block_stride, int64_t kv_head_stride,
                                int64_t kv_tok_stride, int num_blocks, void* out, int64_t out_tok_stride,
                                int64_t out_head_stride, const int* block_table, int64_t bt_stride,
                                const int* seq_lens, const int* query_start_loc, int num_seqs, int num_tokens,
                                int num_out_rows, int num_heads, int num_kv_heads, int block_size, float qk_scale,
                                int causal, int is_bf16, int variant, unsigned v_lbo, unsigned v_sbo,
                                int l_mode, int l_scalar, const int* bucket, int max_blocks, int q_rows,
                                unsigned q_magic, void* sink, int window, float cap_pre, float cap_post,
                                const float* sinks, void* run, int run_slots, void* stream) {
  using namespace dhp;
  const tma::EncodeTiled encode = tma::encode_fn();
  if (!encode) return -1;
  CUtensorMap tq, tk, tv;
  const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  if (group <= 0 || group > kRows || group * num_kv_heads != num_heads) return -7;
  int group_shift = 0;  // 2^group_shift tile slots per token: GROUP rounded up to a power of two
  while ((1 << group_shift) < group) ++group_shift;
  // v2 (60) packs (token, head) rows without slots: floor(kRowsOff / GROUP) tokens of GROUP heads per
  // tile (128 rows, 192 at head 64); the constant-time walk (61) keeps the slots (load_q_ct, rows_of)
  const bool packed = variant == 60;
  const int block_q = packed ? kRowsOff / group : kRows >> group_shift;
  if (!tma::encode_q(encode, &tq, is_bf16, q, kModelHead, num_heads, num_tokens, q_head_stride, q_tok_stride,
                     packed ? group : 1 << group_shift, block_q))
    return -2;
  if (!tma::encode_kv(encode, &tk, is_bf16, k, kModelHead, block_size, num_kv_heads, num_blocks, kv_block_stride,
                      kv_head_stride, kv_tok_stride, block_size))
    return -3;
  if (!tma::encode_kv(encode, &tv, is_bf16, v, kModelHead, block_size, num_kv_heads, num_blocks, kv_block_stride,
                      kv_head_stride, kv_tok_stride, block_size))
    return -4;

  Params p;
  p.out = out;
  p.out_tok_stride = out_tok_stride;
  p.out_head_stride = out_head_stride;
  p.block_table = block_table;
  p.bt_stride = bt_stride;
  p.seq_lens = seq_lens;
  p.query_start_loc = query_start_loc;
  p.num_heads = num_heads;
  p.num_kv_heads = num_kv_heads;
  p.block_size = block_size;
  p.num_seqs = num_seqs;
  p.num_out_rows = num_out_rows;
  p.group = group;
  p.group_shift = group_shift;
  p.block_q = block_q;
  p.num_tiles = num_out_rows / block_q + num_seqs + 1;
  p.scale_log2 = qk_scale;
  p.causal = causal;
  p.v_lbo = v_lbo;
  p.v_sbo = v_sbo;
  p.l_mode = l_mode;
  ct::set_walk_params(p, l_scalar, bucket, max_blocks);
  p.q = q;
  p.q_tok_stride = q_tok_stride;
  p.q_head_stride = q_head_stride;
  p.q_rows = q_rows;
  p.q_magic = q_magic;
  p.sink = sink;
  p.window = window;
  p.cap_pre = cap_pre;
  p.cap_post = cap_post;
  p.sinks = sinks;
  p.run = static_cast<float4*>(run);
  p.run_slots = run_slots;
  // The feature arguments must be this library's (cuda_build.feature_library): a window >= 1
  // exactly in a window library, cap constants exactly in a soft-cap library, sinks exactly in a
  // sink library.
  if ((window >= 1) != v2::kWindow || (window < 0) || ((cap_post != 0.f) != v2::kSoftCap) ||
      ((sinks != nullptr) != v2::kSinks))
    return -10;
  if (p.num_tiles > 65535) return -6;
  if (kRunGlobal && variant == 60 && (run == nullptr || run_slots < 1 || reinterpret_cast<uintptr_t>(run) % 16 != 0))
    return -11;
  if (variant == 61 && (num_seqs < 1 || q_rows < 1 || max_blocks < 1 || sink == nullptr ||
                        (l_mode != 0 && l_mode != 1) || (l_mode == 1 && bucket == nullptr)))
    return -8;
  const dim3 grid(num_kv_heads, p.num_tiles, 1);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (variant < 0) return -5;
  return is_bf16 ? launch_variant<true>(variant, tq, tk, tv, p, grid, st)
                 : launch_variant<false>(variant, tq, tk, tv, p, grid, st);
}

namespace dhp {
namespace {
__global__ void nsmid_kernel(int* out) {
  int n;
  asm volatile("mov.u32 %0, %%nsmid;" : "=r"(n));
  *out = n;
}
}  // namespace
}  // namespace dhp

// %nsmid (the SM ids' bound; the numbering may have gaps, so it may exceed the SM count) into
// out[0] (device memory) on stream: the slots the policy-off running state at head 256 needs (run,
// run_slots; ops.cuda_prefill.sm_id_bound, checked by a GPU test). Returns a cudaError_t.
extern "C" int dhp_prefill_sm90_nsmid(int* out, void* stream) {
  dhp::nsmid_kernel<<<1, 1, 0, static_cast<cudaStream_t>(stream)>>>(out);
  return static_cast<int>(cudaGetLastError());
}

// The head size this library's binaries take (128; 64, 80 or 96 in the libraries built with -DDHP_HEAD):
// ops.cuda_prefill checks it when it loads a library.
extern "C" int dhp_prefill_sm90_head_size() { return dhp::kModelHead; }
