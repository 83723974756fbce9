// Paged decode attention for Hopper (sm_90a): what ops.paged_attention runs for the
// decode steps (the launcher's token tiles) of a layer the csrc kernels take, under
// every policy. Its rows carry the csrc arithmetic contract (v2_arith.cuh,
// docs/kernels.md section 7): a row's bits equal csrc/prefill_sm90.cu's for the same
// position (tests/test_cuda_decode_gpu.py).
//
// The off binary is NOT constant-time, on purpose: the KV trip count follows
// the true length (n_kv from seq_len and the causal diagonal), the mask and V-tail
// branches and the row-guarded stores too, and so do the splits a CTA walks and
// stores (split_schedule; with the dealt schedule also which token and chunk a grid
// row runs: deal_kernel reads every request's length) and the number of splits
// merge_kernel folds. That is the contract of policy `off` only.
// The CT binaries (option kConstTime, GROUP <= 16) run decode steps of the
// constant-time policies on the walk of the Triton CONST_TIME binaries, with the off
// binary's bits (see "constant-time walk" below and consume_v2).
//
// Why a CUDA kernel: decode is bytes. The Triton decode binary holds ~170
// registers per thread, two programs per SM, and its K/V loads are per-thread
// 16-byte gathers: it reached 0.71-0.95 of FA3's bandwidth (docs/perf-notes.md).
// Here one producer warp streams 16-token pages by TMA into a ring of STAGES
// 64-position stages, ahead of the consumer across split boundaries, and the
// consumer warpgroup never issues a load.
//
// Layouts (those of ops.paged_attention): query/out [num_tokens, num_heads, D];
// key/value [num_blocks, num_kv_heads, block_size, D] (D = 128, 64, 80, 96 or 256: one library per
// head size, -DDHP_HEAD; every tile is kHead / 64 halves of 64 columns, heads 80 and 96 on head-128 tiles
// whose columns D-127 the TMA fills with zeros, v2_arith.cuh; head 256 at one CTA per SM); block_table
// [num_seqs, >= pages] int32; query_start_loc [num_seqs + 1]; seq_lens [num_seqs].
//
// One CTA = one query token x the GROUP query heads of one KV head (the Triton
// kernels' token tile; rows GROUP..15 of the 16-row mma.sync tile are unused), and
// the splits chunk, chunk + chunks, ... of its KV walk (512 positions each, at
// absolute multiples of 512: the Triton kernels' splits; split_schedule). Two
// modes, the Triton launcher's (launch.plan), with the same bits:
//   fold   (WRITE_PARTIALS false): one chunk; each split's state is folded into
//          a running state in registers and the row is finalized and stored.
//   split  (WRITE_PARTIALS true): each split's state (m, l, acc) goes to the
//          workspace in the Triton kernels' layout; merge_kernel then folds the
//          splits of each row left to right and finalizes.
// Warps 0-3 are the consumer (consume_v2: two warps compute S and the softmax of a
// 128-position step by mma.sync, two accumulate O += P V, P through a two-slot ring);
// warp 4 is the
// producer (lane 0 issues the TMA, the warp reads a split's block ids one split
// ahead, one lane per page). In split mode the merge is a programmatic dependent
// launch (merge_launch_trigger).
// Token tiles: token t of the step belongs to request r = the number of
// query_start_loc[1..num_seqs] <= t (kernels.locate with token tiles); r ==
// num_seqs is the padding pseudo-request (seq_len 0: neutral states, zeros out).

#include <cuda.h>
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdint>
#include <cmath>

#include "compat_arith.cuh"
#include "v2_arith.cuh"
#include "ct_walk.cuh"
#include "sm90_primitives.cuh"
#include "tma_maps.h"

namespace dhp {
namespace {

using namespace sm90;
using namespace compat;

constexpr int kHead = v2::kHead;              // the tiles' head size: 128, or 64 (-DDHP_HEAD=64)
constexpr int kModelHead = v2::kModelHead;    // the tensors' head size D: kHead, or 80 / 96 (128 tiles)
constexpr int kHalves = v2::kHalves;          // 64-column halves of a tile row (D / 64)
constexpr int kPV = kHead / 4;                // a PV warp's accumulator values per thread (16 rows x D / 2)
constexpr int kRows = 64;                     // wgmma rows per CTA (GROUP of them real)
constexpr int kStep = kStepKV;                // KV positions per stage (64)
constexpr int kHalf = 64 * 128;               // one 64-column half of a 64-row 16-bit tile (8 KB)
constexpr int kTile = kHalves * kHalf;        // a 64 x D 16-bit tile (16 KB at D = 128)
constexpr int kStepsPerSplit = kSplitKV / kStep;
// Consumer warpgroup (warps 0-3: wgmma needs an aligned warpgroup) + one producer
// warp (warp 4). No setmaxnreg: every thread gets the same budget, 65536 / (160
// x CTAs per SM) registers, which the consumer needs and the producer wastes
// less of than a producer warpgroup would.
constexpr int kThreads = 160;
constexpr uint32_t kBarVTail = 1;
static_assert(kRows == kStep, "K and V tiles share the 64 x D layout");

// Binary options (the variant code's high bits, see launch_variant).
//   kPairedV        V pages by one TMA box holding both 64-column halves
//                   (tma::encode_kv_paired): the V stage is [box][half][box_rows][64]
//                   instead of [half][64][64], and the PV descriptors step by box.
//                   Same operands, same arithmetic, same bits; half the V TMAs, and
//                   with the maps' 128 B L2 promotion 1-5 % more bandwidth at
//                   B >= 16 on an H200 (docs/perf-notes.md, change 20).
//   kEvictFirst     K/V TMA loads with an L2 evict_first policy: the cache is read
//                   once per step, and the split states (written during the walk,
//                   read by the merge) then stay in L2 instead of being pushed to
//                   HBM by the stream (the merge read them at 0.4-1 TB/s, L2 hit
//                   rate 12-19 %: ncu, docs/perf-notes.md change 24).
//   kMmaSync        the consumer on a 16-row tile by warp-level mma.sync instead of
//                   the 64-row wgmma tile of which GROUP rows are real: a quarter of
//                   the tensor work per step. GROUP <= 16.
// (Bits 2 and 4 were timing diagnostics, 32 a merge without PDL: measurements, in git history.)
constexpr int kPairedV = 1, kEvictFirst = 8, kMmaSync = 16;
// The paired map reads both halves of a 128-column row: at heads 80 and 96 a row is shorter, so the
// binaries of the variant codes with kPairedV load V by the one-half maps (tma::encode_kv, the
// zero fill past column D) and address their [half][64 rows] layout. (At head 64 the paired
// layout [box][row] is the one half's: the option stays, the host encodes the one-half map.)
// Head 256 has four halves: its V stage keeps the one-half layout [half][64 rows] (the paired map
// holds two halves).
constexpr int kPairable = kModelHead == kHead && kHalves <= 2 ? kPairedV : 0;
// kMmaPipe (with kMmaSync): S and PV on separate warp pairs (consume_v2).
constexpr int kMmaPipe = 64;
// kConstTime (with kMmaSync | kMmaPipe): the constant-time walk (work_ct): every CTA
// walks the public bucket L (one bucket: policy strict, or request with an int) over
// its request's reserved block-table line, every score masked and every V operand
// past the true length zeroed by selection. kBucketPerReq (with kConstTime):
// per-request public buckets (policy request with a tensor).
constexpr int kConstTime = 128, kBucketPerReq = 256;
// The walk of a binary: 0 true lengths (policy off), 1 one bucket, 2 per-request buckets.
template <int OPT>
constexpr int kWalk = (OPT & kConstTime) ? ((OPT & kBucketPerReq) ? 2 : 1) : 0;
constexpr int kMmaMaxGroup = 16;
constexpr uint32_t kBarRows = 2;  // named barrier of the S pair's cross-warp row values (consume_v2)

// The Q tile. wgmma's A operand has 64 rows; GROUP of them are real. With
// SMALL_Q (GROUP <= 8) only one 8-row swizzle atom per 64-column half is stored
// (2 KB instead of 16 KB) and the descriptor's stride between 8-row groups is 0,
// so every group of 8 rows reads the same 8 rows (rows 8-63 repeat rows 0-7;
// each output row depends on its own A row only). The 14 KB saved let three
// CTAs share an SM.
template <bool SMALL_Q>
struct QTile {
  static constexpr int kHalfBytes = SMALL_Q ? 8 * 128 : kHalf;
  static constexpr int kBytes = kHalves * kHalfBytes;
  static constexpr uint32_t kSbo = SMALL_Q ? 0 : 1024;
};

// Fold mode's running state of the 8 rows of a small Q tile (fp32, 8 x 128):
// in shared memory rather than a second 64-register accumulator, which spills
// at two or three CTAs per SM. Larger groups keep it in registers.
template <bool SMALL_Q, bool WRITE_PARTIALS>
struct RunState {
  static constexpr bool kInSmem = SMALL_Q && !WRITE_PARTIALS;
  static constexpr int kBytes = kInSmem ? 8 * kHead * 4 : 0;
};

// Shared memory: Q | K stages | V stages | running state | [MMA: P tile | cross-warp
// row values] | mbarriers, 1 KB aligned (swizzle atoms).
// MMA: 0 the producer's offsets only (consume_v2 uses LayoutV2, which keeps them).
template <int STAGES, bool SMALL_Q, bool WRITE_PARTIALS, int MMA = 0>
struct Layout {
  static constexpr int kOffK = QTile<SMALL_Q>::kBytes;
  static constexpr int kOffV = kOffK + STAGES * kTile;
  static constexpr int kOffRun = kOffV + STAGES * kTile;
  static constexpr int kOffP = kOffRun + (MMA ? 0 : RunState<SMALL_Q, WRITE_PARTIALS>::kBytes);
  static constexpr int kOffRed = kOffP + MMA * 16 * 128;                  // P: 16 rows x 64 16-bit values
  static constexpr int kOffBar = kOffRed + (MMA ? 1024 : 0);              // row values (+ the P ring's barriers)
  static constexpr int kBytes = kOffBar + 8 * RingBarriers<STAGES>::kCount + 1024;  // + barriers + alignment slack
};

struct Params {
  void* out;
  int64_t out_tok_stride, out_head_stride;  // elements
  float* ws_acc;                            // split states: [n_split_grid, num_tokens, num_heads](, 128)
  float* ws_m;
  float* ws_l;
  const int* block_table;
  int64_t bt_stride;
  const int* seq_lens;
  const int* query_start_loc;
  int num_heads, block_size, box_rows;      // box_rows = min(block_size, 64): rows per TMA box
  int num_seqs, num_tokens, group;
  int n_split_grid;                         // split mode: splits the workspace holds per row
  float qk_scale;                           // softmax scale * log2(e), the Triton launcher's value
  int causal;
  int merge_pdl;                            // always 1 (kept: the kernels' parameter layout)
  const int* order;                         // fold mode: (token, request) of grid row y, longest walk first; or null
  // CT binaries only: the public bucket.
  int l_scalar;                             // the one bucket L (walk 1)
  const int* bucket;                        // [num_seqs] per-request buckets (walk 2)
  int max_blocks;                           // block-table width
  // Feature libraries only (v2_arith.cuh kWindow / kSoftCap; last, so the plain binaries' parameter
  // offsets are those they had): the window W, the soft cap's two constants (v2::soft_cap).
  int window;
  float cap_pre, cap_post;
  const float* sinks;  // [num_heads] float32 (sink libraries)
  // Policy off, split mode: the dealt schedule when deal_table != nullptr: grid row y's item is
  // deal_table[8 y .. 8 y + 7] (deal_kernel writes it). deal_kernel's inputs: the CTA rows of one
  // wave per KV head (the plan's slots / num_kv_heads, at most the grid's rows), the plan's splits
  // per chunk, and a CTA's cost in splits (the model's; geometry.CTA_COST_IN_SPLITS).
  const int* deal_table;
  int deal_rows;
  int deal_spp;  // the plan's splits per chunk (its fixed dealing)
  float deal_cost;
};

template <int STAGES>
using Barriers = RingBarriers<STAGES>;

// What every warp of the CTA derives the same way from the metadata.
struct Work {
  int req;                   // request (num_seqs: the padding pseudo-request)
  int seq_len;               // keys of the request (0 for padding)
  int ext;                   // positions this token attends: [0, ext)
  int n_kv;                  // 64-position steps of the walk
  int n_split;               // splits with positions
  // This CTA's splits: s_lo, s_lo + s_stride, ... below s_end (split_schedule).
  int s_lo, s_stride, s_end;
  int page_req, n_pages;     // CT: whose block-table line the walk reads, and its reserved entries
};

// split_schedule: in split mode the chunks of a row take its splits round robin
// (chunk c: c, c + chunks, ...; gridDim.z = chunks) and only splits with positions
// are walked and stored; merge_kernel folds only those. The grid is sized for the
// block table's capacity (a CUDA graph replays it for every length), and vLLM's
// table is max_model_len wide: round robin spreads a short walk's splits over as
// many chunks as it has splits, where contiguous ranges put them all in chunk 0
// (a 4K context in a 32K table: 8 splits on one CTA instead of eight). A split's
// state depends only on its own positions, so the bits do not change.

// req: token t's request when the caller knows it (the longest-first schedule), else -1.
// chunks: the row's chunk count in split mode (gridDim.z, or the dealt schedule's k_r). kq0 >= 0: req's
// query_start_loc[req] (kq0), [req + 1] (kq1) and seq_lens[req] (klen) as the caller loaded them (the dealt
// schedule).
__device__ __forceinline__ Work work_of(const Params& p, int t, int req, int chunk, int chunks, bool write_partials,
                                        int kq0 = -1, int kq1 = 0, int klen = 0) {
  // r = the last index in [0, num_seqs] with query_start_loc[r] <= t (non-decreasing).
  // Decode steps of one token per request have query_start_loc[t] == t: two
  // independent loads settle it, where the binary search is ~log2(num_seqs)
  // dependent loads at the head of every CTA's critical path.
  // The fast path's seq_lens[t] is loaded beside query_start_loc[t], [t + 1] (one round trip
  // instead of two at the head of the CTA's critical path: an L2 miss each in a step's first
  // launch); any other path loads its request's entry after the search. `fast` needs req < 0: a
  // caller's req (the longest-first schedule) may equal t without len_t having been loaded. These
  // loads follow the true lengths: work_of is the policy-off walk's only (the constant-time
  // binaries locate their token with work_ct, the same loads whatever the lengths).
  int lo = req, q0 = 0, q1 = 0, len_t = 0;
  const bool known = kq0 >= 0;
  if (known) {
    q0 = kq0;
    q1 = kq1;
    len_t = klen;
  }
  if (lo < 0 && t < p.num_seqs) {
    q0 = p.query_start_loc[t];
    q1 = p.query_start_loc[t + 1];
    len_t = p.seq_lens[t];
    if (q0 == t && q1 == t + 1) lo = t;
  }
  const bool fast = lo == t && req < 0;
  if (lo < 0) {
    int hi = p.num_seqs;
    lo = 0;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (p.query_start_loc[mid] <= t) lo = mid; else hi = mid - 1;
    }
    q0 = -1;
  }
  Work w;
  w.req = lo;
  const bool pad = lo == p.num_seqs;
  if (!known && (q0 != lo || q1 != lo + 1)) {  // not the one-token fast path: read the request's span
    q0 = p.query_start_loc[lo];
    q1 = pad ? p.num_tokens : p.query_start_loc[lo + 1];
  }
  const int q_len = q1 - q0;
  w.seq_len = pad ? 0 : (fast || known) ? len_t : p.seq_lens[lo];
  const int limit = p.causal ? w.seq_len - q_len + (t - q0) + 1 : w.seq_len;
  w.ext = max(0, min(w.seq_len, limit));
  w.n_kv = (w.ext + kStep - 1) / kStep;
  w.n_split = (w.n_kv + kStepsPerSplit - 1) / kStepsPerSplit;
  // Window (feature libraries, policy off): the splits wholly below the token's window
  // (positions < ext - W) are fully masked, each the neutral state, whose fold is the identity
  // on the bits (merge_kernel): the walk, the split schedule and the merge start at the split
  // holding ext - W (docs/kernels.md section 7, "Features").
  const int s_first = v2::kWindow ? max(0, w.ext - p.window) / kSplitKV : 0;
  w.s_lo = s_first + (write_partials ? chunk : 0);
  w.s_stride = write_partials ? chunks : 1;
  w.s_end = min(w.n_split, p.n_split_grid);
  return w;
}

// ---- the dealt schedule (policy off, split mode: p.deal_table != nullptr) ----------------
// The fixed split schedule deals every row's splits to gridDim.z chunks chosen on the host from
// public values (the table's width: a CUDA graph replays one grid for every batch of its size).
// That dealing suits a batch of uniform lengths and not one of mixed lengths, where the short
// rows' CTAs finish early and the long rows' few chunks run on a few SMs (B16, 4K-32K in a 32K
// table: 0.91-0.94x FA3 with the plan's two chunks; docs/perf-notes.md lever 68). Under policy off
// the lengths are not secret, so the dealing is made on the device, per step, from the true
// lengths, by a small kernel of its own (deal_kernel, as FA3's prepare_varlen_num_blocks) into a
// table the decode kernel reads one entry of per CTA: a step's layers of one library share it,
// so it can be made once a step. The grid is (KV heads, the plan's num_tokens x chunks rows): the
// fixed schedule's CTA count (a grid with more rows than items, even with the extra CTAs exiting at
// once, measured 0.5-4.5 us slower on an H200 at the fixed schedule's own dealing: perf-notes
// lever 69); item i, on grid row i (the rows past the step's items exit at once), is chunk c of
// token t, and every token of request r has its splits dealt round robin to k_r chunks (chunk c:
// s_first + c, + k_r, ...). Each split's state depends only on its positions and the merge folds
// every split of the row in order whoever stored it, so the bits are those of any other dealing
// (tests/test_cuda_decode_gpu.py). Each entry carries its request's metadata for work_of (no
// second round trip).
//
// k_r = the items of the request's walked positions w_r (from the split holding its last token's
// window start, to its end) at S splits an item: ceil((w_r - kDealTolerance) / (512 S)), at least
// 1 (kDealTolerance: an item may hold one step past S splits, so that a table just past a split
// boundary is not dealt two splits a CTA: perf-notes lever 60). Two candidates for S:
//   - the finest S whose C(S) items fit one wave of deal_rows CTA rows (mixed lengths: the long
//     rows get more chunks, the short ones one);
//   - the plan's S (deal_spp: its chunks for a row at the table's width; uniform lengths whose
//     rows do not fill one wave evenly, e.g. B12 and B24 at 32K, take several waves of equal items).
// chosen by a model of the waves: with U the positions in splits and rows = deal_rows,
//   time(S) = min(ceil(C / rows) S, U / rows + S) + deal_cost C / rows,
// whole waves of equal items, or greedy list scheduling's bound (items of mixed sizes start as
// others end), plus each CTA's start and end; ties to the one-wave S. Either candidate's C fits
// the grid (deal_rows <= its rows; the plan's S gives at most its chunks a token).
//
// History (perf-notes lever 69): the dealing was first computed inside the decode kernel by every
// CTA, on a grid of max(wave, the plan's) rows; at the fixed dealing on uniform lengths that cost
// 1.5-3 % (7-10 % at one request) against the fixed schedule, from the prologue's latency before
// the first page load (~2 us: measured with the dealing computed and discarded on the fixed grid)
// and from the larger grid (measured with the fixed dealing on it, no prologue).
constexpr int kDealMaxReqs = 256;   // requests a dealt launch reads (dhp_decode_sm90_deal_max_reqs)
constexpr int kDealMaxRows = 4096;  // grid rows of a dealt launch (its table: 8 int32 a row)
constexpr int kDealPerLane = kDealMaxReqs / 32;
constexpr int kDealTolerance = kStep;

struct DealtItem {
  int t, req, chunk, chunks;  // chunks == 0: no item (the CTA exits)
  int q0, q1, seq_len;        // the request's metadata (work_of)
};

__device__ __forceinline__ int deal_items(int pos, int cap) {  // items of pos positions at cap an item
  return pos <= 0 ? 0 : pos <= kDealTolerance ? 1 : (pos - kDealTolerance + cap - 1) / cap;
}

// One warp: the step's dealing, then the table entries of grid rows row0, row0 + row_step, ... below
// rows_y: {t, req, chunk, chunks, q0, q1, seq_len, 0}, chunks 0 for a row past the step's items.
__device__ __forceinline__ void deal_warp(const Params& p, int rows_y, int row0, int row_step, int* table) {
  const int lane = threadIdx.x % 32;
  const int nb = (p.num_seqs + 31) / 32;  // <= kDealPerLane (the host's check)
  int q_len[kDealPerLane], pos[kDealPerLane], q0s[kDealPerLane], lens[kDealPerLane];
  float units = 0.f, units_tol = 0.f;  // the lane's requests' positions, in splits (less the tolerance)
  int n_work = 0;                      // the lane's tokens with positions: C(n_split_grid), one item each
  // (The loops over the lanes' request blocks stop at nb: unrolled, the arrays stay in registers, and
  // a step of B <= 32 requests runs one block, not kDealPerLane predicated ones.)
#pragma unroll
  for (int j = 0; j < kDealPerLane; ++j) {
    q_len[j] = pos[j] = q0s[j] = lens[j] = 0;
  }
#pragma unroll
  for (int j = 0; j < kDealPerLane; ++j) {
    if (j >= nb) break;
    const int r = 32 * j + lane;
    if (r < p.num_seqs) {
      const int q0 = p.query_start_loc[r], q1 = min(p.query_start_loc[r + 1], p.num_tokens);
      const int ext = p.seq_lens[r];  // the request's last token's extent (work_of: causal or not)
      const int first = v2::kWindow ? max(0, ext - p.window) / kSplitKV * kSplitKV : 0;
      q0s[j] = q0;
      lens[j] = ext;
      q_len[j] = max(0, q1 - q0);
      pos[j] = max(0, min(ext, p.n_split_grid * kSplitKV) - first);
      units += static_cast<float>(q_len[j]) * (static_cast<float>(pos[j]) / kSplitKV);
      units_tol += static_cast<float>(q_len[j]) * (static_cast<float>(max(0, pos[j] - kDealTolerance)) / kSplitKV);
      n_work += pos[j] > 0 ? q_len[j] : 0;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    units += __shfl_xor_sync(0xffffffff, units, o);
    units_tol += __shfl_xor_sync(0xffffffff, units_tol, o);
  }
  n_work = __reduce_add_sync(0xffffffff, n_work);
  const int rows = p.deal_rows;
  auto count = [&](int s) {  // items at s splits an item, the warp's sum
    int c = 0;
#pragma unroll
    for (int j = 0; j < kDealPerLane; ++j) {
      if (j >= nb) break;
      c += q_len[j] * deal_items(pos[j], s * kSplitKV);
    }
    return __reduce_add_sync(0xffffffff, c);
  };
  // The finest S whose items fit one wave: S below units_tol / rows does not (C(S) >= units_tol / S),
  // and C is non-increasing in S, down to n_work at S = n_split_grid (a row's walk is at most that). None
  // fits when the working tokens outnumber the rows: then one item a token. Else from the bound up, in
  // steps 1, 2, 4, ... to a fitting S, then bisection: the fitting S lies a few past the bound in the
  // shapes measured (B16 32K: 4 probes of count, B1 32K: 2, where a bisection over [bound, n_split_grid]
  // took 7-8; the same S and count as the bisection alone over 30,000 random steps, simulated).
  const int hi = p.n_split_grid;
  int lo = min(max(1, static_cast<int>(units_tol / rows)), hi);
  int c_lo = n_work > rows ? n_work : count(lo);
  if (n_work > rows) {
    lo = hi;
  } else if (c_lo > rows) {
    int ok, c_ok;
    for (int step = 1;; step *= 2) {  // count(lo) > rows; stops at hi at the latest (count(hi) fits)
      ok = min(lo + step, hi);
      c_ok = ok == hi ? n_work : count(ok);
      if (c_ok <= rows) break;
      lo = ok;
    }
    while (lo + 1 < ok) {  // invariant: count(lo) > rows, count(ok) <= rows
      const int mid = (lo + ok) / 2, c_mid = count(mid);
      if (c_mid <= rows) { ok = mid; c_ok = c_mid; } else lo = mid;
    }
    lo = ok;
    c_lo = c_ok;
  }
  int s = lo, c = c_lo;
  {  // the plan's S, by the model
    const int sp = min(p.deal_spp, p.n_split_grid), cp = count(sp);
    const float u_rows = units / rows;
    auto model = [&](int sc, int cc) {
      return fminf(static_cast<float>((cc + rows - 1) / rows) * sc, u_rows + sc) + p.deal_cost * cc / rows;
    };
    if (cp <= rows_y && model(sp, cp) < model(s, c)) {
      s = sp;
      c = cp;
    }
  }
  for (int row = row0; row < rows_y; row += row_step) {
    const int item = row;  // the first c grid rows; the rest exit at once
    DealtItem d{0, 0, 0, 0, 0, 0, 0};
    // Item -> (request, token, chunk): the prefix of q_len_r k_r in request order.
    int before = 0;
#pragma unroll
    for (int j = 0; j < kDealPerLane; ++j) {
      if (j >= nb) break;
      const int k = deal_items(pos[j], s * kSplitKV), v = q_len[j] * k;
      int incl = v;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int x = __shfl_up_sync(0xffffffff, incl, o);
        if (lane >= o) incl += x;
      }
      const unsigned hit = __ballot_sync(0xffffffff, v > 0 && item >= before + incl - v && item < before + incl);
      if (d.chunks == 0 && hit != 0) {
        const int src = __ffs(hit) - 1;
        const int off = item - (before + __shfl_sync(0xffffffff, incl - v, src));
        const int kr = __shfl_sync(0xffffffff, k, src);
        d.req = 32 * j + src;
        d.q0 = __shfl_sync(0xffffffff, q0s[j], src);
        d.q1 = d.q0 + __shfl_sync(0xffffffff, q_len[j], src);
        d.seq_len = __shfl_sync(0xffffffff, lens[j], src);
        d.t = d.q0 + off / kr;
        d.chunk = off % kr;
        d.chunks = kr;
      }
      before += __shfl_sync(0xffffffff, incl, 31);
    }
    if (lane == 0) {
      int4* e = reinterpret_cast<int4*>(table) + 2 * static_cast<int64_t>(row);
      e[0] = make_int4(d.t, d.req, d.chunk, d.chunks);
      e[1] = make_int4(d.q0, d.q1, d.seq_len, 0);
    }
  }
}

// The dealt schedule's table (one launch before the decode kernels of a step that read it): every
// warp computes the same dealing and writes its rows' entries. Policy off only: its loads, trip counts
// and entries follow every request's true length; dhp_decode_sm90 launches it for a dealt launch,
// never for a constant-time binary's (ct: no dealing).
constexpr int kDealWarps = 4, kDealRowsPerWarp = 4;
__global__ void __launch_bounds__(32 * kDealWarps) deal_kernel(const Params p, int rows_y, int* table) {
  const int warp = blockIdx.x * kDealWarps + threadIdx.x / 32;
  deal_warp(p, rows_y, warp, gridDim.x * kDealWarps, table);
}

// ---- constant-time walk (CT binaries: policies strict / request) -----------------
// The walk of the Triton CONST_TIME binaries with token tiles (kernels.attention_kernel,
// docs/kernels.md section 2): every CTA runs the same code with the same trip counts
// and the same loads and stores, whatever the secret lengths are.
//   - token -> request: a count over all num_seqs keys (kernels.locate), no search and
//     no fast path (work_of's test of query_start_loc[t] == t is a branch on data);
//   - the walk covers the public bucket L_r (n_kv = ceil(L_r / 64)), every split of it
//     is walked, stored and merged; the longest-first order is never used (its sort
//     keys are the true lengths);
//   - addresses (design.md section 2, the address rule): logical block lb reads
//     block_table[r, min(lb, ceil(L_r / block_size) - 1)] (ct::walk_page), the request's
//     own reserved table line up to its bucket, in walk order, whatever its true length
//     is (the engine reserves those pages; the tile rounding past them re-reads the
//     last one, a function of L_r). K/V addresses are thus public (the table's contents
//     are engine allocation data, allocated in bucket units); the true length only
//     selects values;
//   - every score is masked by select, and every V operand at a position >= the true
//     length is zeroed in registers after its ldmatrix (pv_step_mma), where the off
//     binaries zero the last page's tail in shared memory behind a branch; except in
//     the dead steps (every position past the row's end: step_role_v2), which run unmasked
//     on the rows their pages hold and whose contribution is dropped by selection;
//   - the padding pseudo-request (index num_seqs) reads the last request's line, with
//     that request's page count (walk 1: its L pages, re-reads; walk 2: no step, its
//     walk is 0 as the Triton launcher's pad_l), true length 0: its rows come out as 0.
//   - every choice made on the true length whose result is a float (the commit, the
//     dead split's filler) is a select on the bits (ct::select_f32), never a ternary:
//     ptxas guards a ternary's last FFMA/FSEL by the predicate, and a guarded-off
//     instruction costs less than one that runs (G2 fails such a guard:
//     dhp_backend/audit/guarded.py);
// Public facts the code may branch on: the bucket (l_scalar, or the per-request
// buckets under walk 2), num_seqs, num_tokens, the step geometry, block size, group.
// The head size is a compile-time constant of the library (v2_arith.cuh kHead, kModelHead): the loops
// over its 64-column halves (TMA boxes, stores) unroll, the same code for every length; at heads 80
// and 96 the zero columns D-127 are the TMA's fill of a public box, and a store's column guard
// compares a thread's column (its warp and lane) with a constant.
template <int WALK>
__device__ __forceinline__ Work work_ct(const Params& p, int t, int chunk, bool write_partials) {
  static_assert(WALK == 1 || WALK == 2, "the constant-time walks");
  // r = #{i in 1..num_seqs : qsl[i] <= t} (qsl non-decreasing: the last request whose
  // span starts at or before t), by the whole CTA in chunks of blockDim.x keys.
  int r = 0;
  for (int base = 1; base <= p.num_seqs; base += blockDim.x) {
    const int i = base + static_cast<int>(threadIdx.x);
    const int qs = p.query_start_loc[min(i, p.num_seqs)];
    r += __syncthreads_count((i <= p.num_seqs) & (qs <= t));
  }
  Work w;
  const bool is_pad = r >= p.num_seqs;
  const int r_row = min(r, p.num_seqs - 1);
  const int q0 = p.query_start_loc[r];
  const int q1 = ct::select_int(is_pad, p.num_tokens, p.query_start_loc[min(r + 1, p.num_seqs)]);
  const int q_len = q1 - q0, qi = t - q0;
  w.req = r;
  w.page_req = r_row;
  w.seq_len = ct::select_int(is_pad, 0, p.seq_lens[r_row]);
  const int causal_limit = w.seq_len - q_len + qi + 1;
  const int limit = ct::select_int(qi < q_len, ct::select_int(p.causal != 0, causal_limit, w.seq_len), 0);
  w.ext = max(0, min(w.seq_len, limit));  // attendable positions: what the masks keep
  // ext_r: the bucket of the table line the walk reads (r_row's, for the padding too).
  int ext_r = p.l_scalar, walk = p.l_scalar;
  if constexpr (WALK == 2) {
    ext_r = p.bucket[r_row];
    walk = ct::select_int(is_pad, 0, ext_r);  // pad_l = 0, as the Triton launcher
  }
  w.n_pages = ct::walk_pages(ext_r, p.block_size, p.max_blocks);
  w.n_kv = (walk + kStep - 1) / kStep;
  w.n_split = (w.n_kv + kStepsPerSplit - 1) / kStepsPerSplit;
  w.s_lo = write_partials ? chunk : 0;
  w.s_stride = write_partials ? static_cast<int>(gridDim.z) : 1;
  w.s_end = min(w.n_split, p.n_split_grid);
  return w;
}

// The CTA's 64-position steps, in walk order: [split_first(s), split_end(w, s)) for
// each of its splits s; a running step count k indexes the stage ring.
__device__ __forceinline__ int split_first(int s) { return s * kStepsPerSplit; }
__device__ __forceinline__ int split_end(const Work& w, int s) { return min((s + 1) * kStepsPerSplit, w.n_kv); }
// CT binaries, the dead steps: a step whose positions all lie at or past the row's
// attendable end (w.ext) is dead. It runs as a live one: unmasked, V not zeroed, on
// the rows its reserved pages hold, the split's state evolving. Masked dead steps feed
// the tensor cores zeros (P and V) and keep the accumulator frozen, which draws less
// power than a live step: in the CT prefill that moved the step's time with the true
// length (prefill_sm90.cu's constant-time walk: the same remedy cut G4's +0.1 % to
// 0.03-0.06 %). In this kernel the dead steps alone left G4 decode strict L 32768 at
// +0.017 % (H200); what made that difference was the zero partials of dead splits
// (the filler at the split's end in consume_v2). Both are kept: a short request's
// step then differs from a long one's in neither operands nor stored values.
// What a dead step adds never reaches the output: the split's state at
// its last live step (commit) is kept by selection (consume_v2: stored in split
// mode, folded into the running state in fold mode), and a dead split keeps the neutral
// state. Dead steps are a suffix of the walk and exact no-ops of the masked form
// (alpha selected to exactly 1, P = 0), so the committed state is the state the split's
// end stored or folded before: the same bits. dead and commit are compared with the
// secret length and only feed selects (SEL), never a branch (G2) or a count (G1).
struct StepRole {
  bool dead, commit;
};
// The number of steps the CTA walks (its last split may be short).
__device__ __forceinline__ int cta_steps(const Work& w) {
  if (w.s_lo >= w.s_end) return 0;
  const int last = w.s_lo + (w.s_end - 1 - w.s_lo) / w.s_stride * w.s_stride;
  return (last - w.s_lo) / w.s_stride * kStepsPerSplit + (split_end(w, last) - split_first(last));
}

// merge_launch_trigger: in split mode the merge is a programmatic dependent launch
// (launch); the CTA lets it start when its consumer begins its last split and its
// producer has issued its last load (griddepcontrol.launch_dependents; a CTA that
// returns early triggers by exiting). Triggered at the CTA's start instead, the
// waiting merge CTAs cost 1 % at B4 32K (their shared memory and registers held
// through the walk); at the last split the launch still hides behind ~8 steps.
// Whether split s is the CTA's last one.
__device__ __forceinline__ bool last_split(const Work& w, int s) { return s + w.s_stride >= w.s_end; }
// Every consumer's entry into split s: in split mode the last one lets the merge launch.
template <bool WRITE_PARTIALS>
__device__ __forceinline__ void enter_split(const Work& w, int s) {
  if (WRITE_PARTIALS && last_split(w, s)) grid_dependents_launch();
}
// ---- producer (one warp) ---------------------------------------------------------
template <int STAGES, bool SMALL_Q, bool WRITE_PARTIALS, int OPT>
__device__ __forceinline__ void produce(const Params& p, const Work& w, const CUtensorMap* tm_q,
                                        const CUtensorMap* tm_k, const CUtensorMap* tm_v, uint32_t smem,
                                        const Barriers<STAGES>& bar, int kvh, int t) {
  using L = Layout<STAGES, SMALL_Q, WRITE_PARTIALS>;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {  // Q: 64 columns x GROUP heads x 1 token, once per column half
    mbar_arrive_expect_tx(bar.q_full(), p.group * 2 * kHead);
#pragma unroll
    for (int h = 0; h < kHalves; ++h)
      tma_load_3d(smem + h * QTile<SMALL_Q>::kHalfBytes, tm_q, bar.q_full(), 64 * h, kvh * p.group, t);
  }
  if (w.s_lo >= w.s_end) return;
  const int bs = p.block_size, rows = p.box_rows;
  const int pages_per_split = kSplitKV / bs;  // <= 32 (block_size >= 16)
  const int last_page = (w.seq_len + bs - 1) / bs - 1;
  constexpr bool kCT = kWalk<OPT> != 0;
  const int* table = p.block_table + static_cast<int64_t>(kCT ? w.page_req : w.req) * p.bt_stride;
  // Lane i holds the block id of page i of a split (pages past the request's
  // last repeat it: their rows are masked in S and zeroed in V by the consumer).
  // CT: every lane reads an entry of the request's reserved line up to its bucket
  // (ct::walk_page; past it the last one again), the same loads whatever the true
  // length is; positions past the true length are masked by the consumer.
  auto split_ids = [&](int s) {
    if constexpr (kCT) {
      const int id = ct::walk_page(table, w.n_pages, s * pages_per_split + lane);
      return ct::select_int(lane < pages_per_split, id, 0);
    } else {
      return lane < pages_per_split ? table[min(s * pages_per_split + lane, last_page)] : 0;
    }
  };
  // K/V loads: with kEvictFirst, an L2 evict_first policy (lane 0 issues them).
  const uint64_t policy = (OPT & kEvictFirst) ? l2_evict_first() : 0;
  auto load_4d = [&](uint32_t dst, const CUtensorMap* map, uint32_t mbar, int c0, int c1, int c2, int c3) {
    if constexpr (OPT & kEvictFirst)
      tma_load_4d_hint(dst, map, mbar, c0, c1, c2, c3, policy);
    else
      tma_load_4d(dst, map, mbar, c0, c1, c2, c3);
  };
  auto load_5d = [&](uint32_t dst, const CUtensorMap* map, uint32_t mbar, int c0, int c1, int c2, int c3, int c4) {
    if constexpr (OPT & kEvictFirst)
      tma_load_5d_hint(dst, map, mbar, c0, c1, c2, c3, c4, policy);
    else
      tma_load_5d(dst, map, mbar, c0, c1, c2, c3, c4);
  };
  int ids_next = split_ids(w.s_lo);
  int k = 0;  // the CTA's running step: its stage and phase in the ring
  for (int s = w.s_lo; s < w.s_end; s += w.s_stride) {
    const int ids = ids_next;
    ids_next = s + w.s_stride < w.s_end ? split_ids(s + w.s_stride) : 0;
    if constexpr (!kCT) {
      // Policy off: a consumer step's two stages, both K boxes first, then both V. In stage
      // order (K, V, K, V) the second K waited behind the first V's slot, i.e. for the PV of
      // the step before: S(t + 1) could not start before PV(t) ended plus a load's latency,
      // which only a second CTA on the SM hides (docs/perf-notes.md item (6)(d), lever 59). K
      // first, the S pair's next step overlaps the PV pair's. Every step is two stages within
      // one split (the kernel rounds n_kv to whole steps; a split is four). The constant-time
      // binaries keep the stage order, their G4-measured form. (The box loads below repeat
      // theirs on purpose: folding both loops onto shared lambdas changed the SASS of every
      // constant-time decode kernel at heads 64, 128 and 256, nvcc 13.0, which re-opens G4.)
      for (int j = split_first(s); j < split_end(w, s); j += 2, k += 2) {
        int blk[2][4], row[2][4];
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const int pos = (j + h) * kStep + b * rows;
            blk[h][b] = __shfl_sync(0xffffffff, ids, (pos / bs - s * pages_per_split) & 31);
            row[h][b] = pos % bs;
          }
        const int boxes = kStep / rows;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int st = (k + h) % STAGES;
          const uint32_t parity = (((k + h) / STAGES) - 1) & 1;  // the release of stage k + h - STAGES
          const uint32_t k_dst = smem + L::kOffK + st * kTile;
          if (k + h >= STAGES) mbar_wait(bar.k_empty(st), parity);
          if (lane == 0) {
            mbar_arrive_expect_tx(bar.k_full(st), kTile);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              if (b < boxes) {
#pragma unroll
                for (int hd = 0; hd < kHalves; ++hd)
                  load_4d(k_dst + hd * kHalf + b * rows * 128, tm_k, bar.k_full(st), 64 * hd, row[h][b], kvh,
                          blk[h][b]);
              }
            }
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int st = (k + h) % STAGES;
          const uint32_t parity = (((k + h) / STAGES) - 1) & 1;
          const uint32_t v_dst = smem + L::kOffV + st * kTile;
          if (k + h >= STAGES) mbar_wait(bar.v_empty(st), parity);
          if (lane == 0) {
            mbar_arrive_expect_tx(bar.v_full(st), kTile);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
              if (b < boxes) {
                if constexpr ((OPT & kPairedV) && kHalves == 2) {
                  load_5d(v_dst + b * 2 * rows * 128, tm_v, bar.v_full(st), 0, row[h][b], 0, kvh, blk[h][b]);
                } else {
#pragma unroll
                  for (int hd = 0; hd < kHalves; ++hd)
                    load_4d(v_dst + hd * kHalf + b * rows * 128, tm_v, bar.v_full(st), 64 * hd, row[h][b], kvh,
                            blk[h][b]);
                }
              }
            }
          }
        }
        __syncwarp();
      }
    } else {
      for (int j = split_first(s); j < split_end(w, s); ++j, ++k) {
        const int st = k % STAGES;
        const uint32_t parity = ((k / STAGES) - 1) & 1;  // the release of step k - STAGES
        const uint32_t k_dst = smem + L::kOffK + st * kTile, v_dst = smem + L::kOffV + st * kTile;
        // Up to 4 boxes per step (16-token pages); every lane takes part in the shuffles.
        int blk[4], row[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) {
          const int pos = j * kStep + b * rows;
          blk[b] = __shfl_sync(0xffffffff, ids, (pos / bs - s * pages_per_split) & 31);
          row[b] = pos % bs;
        }
        const int boxes = kStep / rows;
        if (k >= STAGES) mbar_wait(bar.k_empty(st), parity);
        if (lane == 0) {
          mbar_arrive_expect_tx(bar.k_full(st), kTile);
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            if (b < boxes) {
#pragma unroll
              for (int h = 0; h < kHalves; ++h)
                load_4d(k_dst + h * kHalf + b * rows * 128, tm_k, bar.k_full(st), 64 * h, row[b], kvh, blk[b]);
            }
          }
        }
        if (k >= STAGES) mbar_wait(bar.v_empty(st), parity);
        if (lane == 0) {
          mbar_arrive_expect_tx(bar.v_full(st), kTile);
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            if (b < boxes) {
              if constexpr ((OPT & kPairedV) && kHalves == 2) {
                load_5d(v_dst + b * 2 * rows * 128, tm_v, bar.v_full(st), 0, row[b], 0, kvh, blk[b]);
              } else {  // (head 64: one half, the paired layout [box][row] is this one's)
#pragma unroll
                for (int h = 0; h < kHalves; ++h)
                  load_4d(v_dst + h * kHalf + b * rows * 128, tm_v, bar.v_full(st), 64 * h, row[b], kvh, blk[b]);
              }
            }
          }
        }
        __syncwarp();
      }
    }
  }
  if constexpr (WRITE_PARTIALS) grid_dependents_launch();  // see merge_launch_trigger
}

// ---- the mma.sync consumers' PV product ------------------------------------------
// The address of position pos, 16-byte chunk c (0..15: 8 columns) of a V stage (kPairedV:
// boxes of box_rows rows, [box][half][row]; else [half][64 rows]), 128-byte swizzle.
template <int OPT>
__device__ __forceinline__ uint32_t v_chunk_addr(const Params& p, uint32_t v_base, int pos, int c) {
  if constexpr (OPT & kPairedV) {
    const int rows = p.box_rows;
    return v_base + (pos / rows) * (kHalves * rows * 128) + (c / 8) * (rows * 128) + sw128_offset(pos % rows, c % 8);
  } else {
    return v_base + (c / 8) * kHalf + sw128_offset(pos, c % 8);
  }
}
// O += P V for one 64-position step on a 16-row tile: P (16 x 64, 16-bit) from the
// shared tile p_tile, the output columns of 2 NP n8 tiles from chunk c0 on; k16
// slices in order (compat's PV accumulation). acc: NP x 8 values, mma layout.
// CT (kConstTime): V at positions >= seq_len (kv0: the step's first position) is
// zeroed in the B fragments by a mask, no branch: after the transposing ldmatrix a
// thread holds positions 16 kk + 2 (lane % 4) + {0, 1} in vb[0] and vb[2] and the
// same + 8 in vb[1] and vb[3] (low half: the first). The products see +0 there, as
// the off binaries' zeroed shared-memory rows and the Triton kernels' V guard give.
__device__ __forceinline__ uint32_t keep_pair(int pos, int seq_len) {
  return ((0u - static_cast<uint32_t>(pos < seq_len)) & 0x0000ffffu) |
         ((0u - static_cast<uint32_t>(pos + 1 < seq_len)) & 0xffff0000u);
}
// The window libraries: V kept in [v_lo, seq_len) (below v_lo: the null block of dropped pages).
__device__ __forceinline__ uint32_t keep_pair_window(int pos, int v_lo, int seq_len) {
  return ((0u - static_cast<uint32_t>((pos < seq_len) & (pos >= v_lo))) & 0x0000ffffu) |
         ((0u - static_cast<uint32_t>((pos + 1 < seq_len) & (pos + 1 >= v_lo))) & 0xffff0000u);
}
template <bool BF16, int NP, int OPT>
__device__ __forceinline__ void pv_step_mma(float (&acc)[8 * NP], const Params& p, uint32_t p_tile, uint32_t v_base,
                                            int c0, int lane, int kv0 = 0, int seq_len = 0, int v_lo = 0) {
  constexpr bool kKeep = kWalk<OPT> != 0 || v2::kWindow;
#pragma unroll
  for (int kk = 0; kk < kStep / 16; ++kk) {
    uint32_t pa[4];
    ldmatrix_x4<false>(pa, p_tile + sw128_offset(lane % 16, 2 * kk + lane / 16));
    uint32_t keep_lo = 0, keep_hi = 0;
    if constexpr (v2::kWindow) {
      keep_lo = keep_pair_window(kv0 + 16 * kk + 2 * (lane % 4), v_lo, seq_len);
      keep_hi = keep_pair_window(kv0 + 16 * kk + 8 + 2 * (lane % 4), v_lo, seq_len);
    } else if constexpr (kWalk<OPT> != 0) {
      keep_lo = keep_pair(kv0 + 16 * kk + 2 * (lane % 4), seq_len);
      keep_hi = keep_pair(kv0 + 16 * kk + 8 + 2 * (lane % 4), seq_len);
    }
#pragma unroll
    for (int np = 0; np < NP; ++np) {
      // lane i: position 16 kk + 8 ((i / 8) % 2) + i % 8, the n8 tile 2 np + i / 16
      uint32_t vb[4];
      ldmatrix_x4<true>(vb, v_chunk_addr<OPT>(p, v_base, 16 * kk + 8 * ((lane / 8) % 2) + lane % 8,
                                              c0 + 2 * np + lane / 16));
      if constexpr (kKeep) {
        vb[0] &= keep_lo;
        vb[1] &= keep_hi;
        vb[2] &= keep_lo;
        vb[3] &= keep_hi;
      }
      mma_m16n8k16<BF16>(*reinterpret_cast<float(*)[4]>(&acc[8 * np]), pa, vb[0], vb[1]);
      mma_m16n8k16<BF16>(*reinterpret_cast<float(*)[4]>(&acc[8 * np + 4]), pa, vb[2], vb[3]);
    }
  }
}

// Row half h (0: the thread's row lo, 1: hi) of an mma-layout accumulator of NT n8
// tiles, columns col + 8 nt, col + 8 nt + 1 (col: the warp's first column + the
// thread's pair): a split state's acc row to the workspace (row: its index), or
// the output row (scaled by inv, 16-bit).
template <int NT>
__device__ __forceinline__ void store_split_half(const Params& p, int64_t row, int col, const float (&acc)[4 * NT],
                                                 int h) {
  float2* dst = reinterpret_cast<float2*>(p.ws_acc + row * kHead + col);
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) dst[4 * nt] = make_float2(acc[4 * nt + 2 * h], acc[4 * nt + 2 * h + 1]);
}
template <bool BF16, int NT>
__device__ __forceinline__ void store_out_half(const Params& p, int t, int head, int col, const float (&run)[4 * NT],
                                               int h, float inv) {
  uint32_t* dst = reinterpret_cast<uint32_t*>(
      static_cast<char*>(p.out) +
      2 * (static_cast<int64_t>(t) * p.out_tok_stride + static_cast<int64_t>(head) * p.out_head_stride + col));
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)  // (heads 80, 96: the zero columns D-127 are not stored)
    if (kModelHead == kHead || col + 8 * nt < kModelHead)
      dst[4 * nt] = pack2<BF16>(__fmul_rn(run[4 * nt + 2 * h], inv), __fmul_rn(run[4 * nt + 2 * h + 1], inv));
}

// ---- the pipe consumer's P ring (consume_v2, below) ----------------------------------
// The S pair (warps 0-1) writes P and the rows' alphas into one of two P buffers; the PV
// pair (warps 2-3) scales and accumulates O with them. The buffers form a two-slot ring
// (p_full: the 64 S threads arrive; p_empty: the 64 PV threads arrive), so the S pair
// runs up to two steps ahead of the PV pair.
constexpr int kPipeBarOff = 768;  // the P ring's barriers in the row-value area
struct PipeBarriers {
  uint32_t base;
  __device__ uint32_t full(int b) const { return base + 8 * b; }
  __device__ uint32_t empty(int b) const { return base + 16 + 8 * b; }
  __device__ void init() const {
    for (int b = 0; b < 2; ++b) {
      mbar_init(full(b), 64);
      mbar_init(empty(b), 64);
    }
    mbar_fence_init();
  }
};

constexpr int kOrderThreads = 1024;
constexpr int kOrderBins = 2 * kOrderThreads;  // walks up to 2047 steps (131 K positions) sorted exactly

// Visit every token of the step with its sort key (the walk's steps, capped).
// Requests are read directly (no search): token q0 + i of request r attends
// positions [0, min(seq_len, seq_len - q_len + i + 1)) under causal masking.
template <typename F>
__device__ __forceinline__ void for_each_token_key(const Params& p, F&& f) {
  for (int r = threadIdx.x; r < p.num_seqs; r += blockDim.x) {
    const int q0 = p.query_start_loc[r], q1 = p.query_start_loc[r + 1], seq_len = p.seq_lens[r];
    for (int t = q0; t < q1 && t < p.num_tokens; ++t) {
      const int limit = p.causal ? seq_len - (q1 - q0) + (t - q0) + 1 : seq_len;
      const int n_kv = (max(0, min(seq_len, limit)) + kStep - 1) / kStep;
      f(t, r, kOrderBins - 1 - min(n_kv, kOrderBins - 1));  // bin 0: the longest walks
    }
  }
  // padding tokens (the pseudo-request, no positions): the last bin
  for (int t = p.query_start_loc[p.num_seqs] + threadIdx.x; t < p.num_tokens; t += blockDim.x)
    f(t, p.num_seqs, kOrderBins - 1);
}

__global__ void __launch_bounds__(kOrderThreads) order_kernel(const Params p, int2* order) {
  __shared__ int start[kOrderBins];
  __shared__ int warp_sum[kOrderThreads / 32];
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int b = tid; b < kOrderBins; b += kOrderThreads) start[b] = 0;
  __syncthreads();
  for_each_token_key(p, [&](int, int, int bin) { atomicAdd(&start[bin], 1); });
  __syncthreads();
  // Exclusive scan of the counts: thread tid owns bins 2 tid and 2 tid + 1.
  const int c0 = start[2 * tid], c1 = start[2 * tid + 1];
  int incl = c0 + c1;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int v = __shfl_up_sync(0xffffffff, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) warp_sum[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = warp_sum[lane];
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int v = __shfl_up_sync(0xffffffff, w, o);
      if (lane >= o) w += v;
    }
    warp_sum[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int before = incl - (c0 + c1) + (warp > 0 ? warp_sum[warp - 1] : 0);
  start[2 * tid] = before;
  start[2 * tid + 1] = before + c0;
  __syncthreads();
  for_each_token_key(p, [&](int t, int r, int bin) { order[atomicAdd(&start[bin], 1)] = make_int2(t, r); });
}

// Split mode's second kernel: kernels.merge_kernel's fold, left to right from the
// neutral state, with the same operations on the same operands, hence the same
// bits; scheduled for latency. The fold of split s is
//   m2 = fmax(mr, m_s); al = select_ex2(mr, m2); be = select_ex2(m_s, m2);
//   lr = fma(lr, al, l_s * be); acc = fma(acc, al, acc_s * be); mr = m2.
// Only the running max is a chain through the coefficients, and a running max is
// a prefix max (fmax is exact, and ignores NaN in any order): a warp scans it,
// then every split's (al, be) is computed in parallel, then each column thread
// runs two fma chains. A chunk's acc rows (kMergeChunk x 512 B) come to shared
// memory by cp.async, all in flight at once: per-thread loads (8 or 64 in flight)
// read them at 0.4-1 TB/s, 8-13 us at 32K contexts on an H200 (ncu; perf-notes
// change 24). The sign of a zero running max can differ from the sequential fmax
// chain's, which no coefficient sees (select_ex2 compares with ==, and
// 2^(a - (+-0)) is one value). One CTA per (token, query head), one thread per column.
// (Head 256: 32 splits a chunk, the chunk's acc rows are 32 KB of static shared memory.)
constexpr int kMergeChunk = kHead == 256 ? 32 : 64;
// WALK (kWalk of the decode binary): 0 the splits of the true length, 1 those of the
// one bucket, 2 those of the token's request bucket (work_ct's count, all 128 threads).
template <bool BF16, int WALK>
__global__ void __launch_bounds__(kHead) merge_kernel(const Params p) {
  __shared__ __align__(16) float acc_sm[kMergeChunk][kHead];
  __shared__ float m_s[kMergeChunk], l_s[kMergeChunk], mr_s[kMergeChunk], al_s[kMergeChunk], be_s[kMergeChunk];
  __shared__ float mr_carry;
  const int t = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
  // Only the row's splits with positions were stored (split_schedule); folding a
  // neutral state (m = kMInit, l = 0, acc = 0) is the identity on the bits, so
  // the row's result is that of folding all n_split_grid.
  int n_split, s_first = 0;  // the splits [s_first, n_split) (off with a window: from the window's first)
  if constexpr (WALK == 0) {
    // The step's metadata, which the decode kernel does not write: read before the wait, so that
    // its dependent loads (query_start_loc, then seq_lens) run under the decode grid's tail rather
    // than after it. The constant-time merges (WALK 1, 2) keep their order (their SASS is the one
    // G4 measured).
    const Work w = work_of(p, t, -1, 0, 1, true);
    n_split = w.n_split;
    if constexpr (v2::kWindow) s_first = w.s_lo;
  }
  // Launched as a programmatic dependent of the decode kernel (launch): it may
  // start before the decode grid ends; the split states are read after this wait
  // (the decode grid complete, its writes visible). A no-op for a plain launch.
  grid_dependency_wait();
  if constexpr (WALK == 1)
    n_split = min((p.l_scalar + kSplitKV - 1) / kSplitKV, p.n_split_grid);
  else if constexpr (WALK == 2)
    n_split = work_ct<2>(p, t, 0, true).s_end;
  const int64_t split_stride = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int64_t row0 = static_cast<int64_t>(t) * p.num_heads + head;
  const uint32_t acc_base = smem_addr(&acc_sm[0][0]);
  float lr = 0.f, acc = 0.f;
  if (d == 0) mr_carry = kMInit;
  for (int c0 = s_first; c0 < n_split; c0 += kMergeChunk) {
    const int n = min(kMergeChunk, n_split - c0);
    for (int k = d; k < n * (kHead / 4); k += kHead) {  // 16-byte pieces: split k / 32, columns 4 (k % 32)..
      const int j = k / (kHead / 4), c = 4 * (k % (kHead / 4));
      cp_async_16(acc_base + 4 * (j * kHead + c), p.ws_acc + (row0 + (c0 + j) * split_stride) * kHead + c);
    }
    if (d < n) {
      m_s[d] = p.ws_m[row0 + (c0 + d) * split_stride];
      l_s[d] = p.ws_l[row0 + (c0 + d) * split_stride];
    }
    __syncthreads();
    if (d < 32) {  // the running max, a prefix max by warp scan (fmax is exact and order-free)
      float carry = mr_carry;
      for (int base = 0; base < n; base += 32) {
        float v = base + d < n ? m_s[base + d] : -INFINITY;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const float u = __shfl_up_sync(0xffffffff, v, o);
          if (d >= o) v = fmaxf(v, u);
        }
        v = fmaxf(v, carry);
        if (base + d < n) mr_s[base + d] = v;
        carry = __shfl_sync(0xffffffff, v, 31);
      }
    }
    __syncthreads();
    if (d < n) {  // fold_stats' coefficients, every split at once
      const float before = d == 0 ? mr_carry : mr_s[d - 1];
      al_s[d] = select_ex2(before, mr_s[d]);
      be_s[d] = select_ex2(m_s[d], mr_s[d]);
    }
    cp_async_wait_all();
    __syncthreads();  // the coefficients and every thread's pieces of the acc rows
#pragma unroll 8
    for (int j = 0; j < n; ++j) {
      lr = __fmaf_rn(lr, al_s[j], __fmul_rn(l_s[j], be_s[j]));  // fold_stats
      acc = fold_value(acc, acc_sm[j][d], FoldCoef{al_s[j], be_s[j]});
    }
    __syncthreads();  // the chunk's shared state is read; the next chunk may overwrite it
    if (d == 0) mr_carry = mr_s[n - 1];
  }
  if constexpr (v2::kSinks) {  // the sink's state folded last (sink libraries), as the fold mode does
    __syncthreads();           // mr_carry: the running max after every split
    float mr = mr_carry;
    const FoldCoef sk = fold_stats(mr, lr, v2::sink_m(p.sinks, head, p.num_heads), 1.f);
    acc = fold_value(acc, 0.f, sk);
  }
  const float o = __fmul_rn(acc, finalize_inv(lr));
  if (kModelHead != kHead && d >= kModelHead) return;  // heads 80, 96: columns D-127 are the tiles' zeros
  char* out = static_cast<char*>(p.out) + 2 * (static_cast<int64_t>(t) * p.out_tok_stride +
                                               static_cast<int64_t>(head) * p.out_head_stride + d);
  if constexpr (BF16)
    *reinterpret_cast<__nv_bfloat16*>(out) = __float2bfloat16_rn(o);
  else
    *reinterpret_cast<__half*>(out) = __float2half_rn(o);
}

// ---- host ----------------------------------------------------------------------
// ---- the v2 arithmetic (docs/kernels.md section 7): the routed consumer -----------------
// The binaries ops.cuda_decode routes to (its VARIANTS and CT_VARIANTS), by variant code
// 8 x options + base 4: consume_v2 (below) with the producer, split schedule, merge and
// workspace above, two stages x two CTAs per SM, GROUP <= 16 (the mma.sync tile; larger
// groups: -7):
//   "v2"     kPipe | kV2, policy off;
//   the CT binaries: kPipe | kV2 | kConstTime (one bucket), | kBucketPerReq (per-request
//            buckets); strict / request.
// Every one has the same bits, and a row's bits are those of csrc/prefill_sm90.cu's rows for
// the same position (v2_arith.cuh). Other codes: -5.
//
// consume_v2's row arithmetic: KV steps of 128 positions at absolute multiples of 128, two of
// the ring's 64-position stages each (one row max, one alpha, one rescale of O per step);
// FA3's exponent form (masked scores -inf by select, m = max(m, rowmax(raw) * scale),
// p = ex2(fma(s, scale, -m))); per-lane row sums whose 16 groups meet in step_tree's order:
// warp w of the S pair holds groups 4w..4w+3 of the step's first stage and 8+4w..8+4w+3 of its
// second, each warp adds its two quads and the pair swaps them per lane through shared memory;
// l = fma(l, alpha, tree) per lane, the four lanes meeting once per split (quad_lanes); O
// accumulates the step's P V over its 128 positions as 8 k16 slices in order after one rescale,
// the prefill's wgmma chain; splits of 512 folded or merged with the fold and finalize above.
//
// Why the CT binaries' branches, trip counts and addresses depend only on public values: they
// walk work_ct's constant-time walk (the public bucket over the request's reserved table line,
// "constant-time walk" above) with its remedies on 128-position steps: every score masked by
// select, V past the true length zeroed in the fragments (pv_step_mma's keep mask), the dead
// steps (every position past the row's end) run unmasked and dropped by the commit's selection
// (step_role_v2), a dead split stores the filler. The feature libraries keep that walk: the
// window's lower bound is one more selection per score and per V fragment (INT_MIN in the dead
// steps and in the steps wholly below the window, which run unmasked, are never committed and leave
// a filler: below_window_v2; a comparison of the step index with ext - W, in selections only; the
// trip counts stay the bucket's), the soft cap an elementwise function with no data-dependent path, and the sinks are read
// at sinks + head (public) after the walk. The off binary walks the true lengths (the trip count,
// the mask branch and the V-tail zeroing follow seq_len; with a window also the first split walked
// and merged, from ext - W): policy off only.
constexpr int kSync = kPairedV | kEvictFirst | kMmaSync;
constexpr int kPipe = kSync | kMmaPipe;
constexpr int kPipeOpt = (kPipe & ~kPairedV) | kPairable;  // the binary's options: kPairedV where kPairable

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
// the split's committed state is its state at its last live step (the constant-time walk above,
// on 128-position steps). dead and commit feed selects only.
template <int OPT>
__device__ __forceinline__ StepRole step_role_v2(const Work& w, int j, int je) {
  const int kv0 = j * kStep;
  const bool dead = kWalk<OPT> != 0 && kv0 >= w.ext;
  const bool commit = !dead & ((j + 2 == je) | (kv0 + kStepV2 >= w.ext));
  return {dead, commit};
}

// CT window libraries: a 128-position step whose positions all lie below the token's window (< ext - W)
// runs unmasked (scores and V) as a dead step does: the state evolves on what the pages hold, is never
// committed (except_below), and goes back to the neutral one after the last such step (m kMInit, l +0
// in the S pair, the accumulator +0 in the PV pair: drop_below); a split wholly below the window stores
// a filler (split mode) or leaves one in the running accumulator (fold mode), which the first live
// split's alpha = +0 wipes (the running m is still kMInit). So the bits are those of the masked form,
// whose below-window steps are exact no-ops from the neutral state (docs/kernels.md section 7). Why:
// masked, their zeros in P, V and the state drew less power than live operands, and how many of the
// walk's steps lie below the window follows the true length (G4, H200, 2026-11-28: the prefill's form
// of the same walk, head 256 window 1024, short vs long -0.046 %, t +29). below feeds selects only.
template <int OPT>
__device__ __forceinline__ bool below_window_v2(const Work& w, const Params& p, int kv0) {
  return kWalk<OPT> != 0 && v2::kWindow && kv0 + kStepV2 <= w.ext - p.window;
}
__device__ __forceinline__ StepRole except_below(StepRole role, bool below) {
  role.commit = role.commit & !below;
  return role;
}
template <int N>
__device__ __forceinline__ void drop_below(float (&acc)[N], bool leaving) {
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] = ct::select_f32(leaving, 0.f, acc[i]);
}

// Row values (floats): max [2 warps][16 rows], alpha [2 buffers][16], coef [2 buffers][16][al, be],
// inv [16]; the P ring's barriers at byte kPipeBarOff (768); per-lane sums [2 warps][32 lanes][4].
// Sink libraries: the sink fold's alpha [16] (v2::kSinks).
constexpr int kV2Max = 0, kV2Alpha = 32, kV2Coef = 64, kV2Inv = 128, kV2SinkAl = 144, kV2Lsum = 256;
static_assert(kV2SinkAl + 16 <= kPipeBarOff / 4 && kPipeBarOff + 32 <= 4 * kV2Lsum, "row-value areas overlap");

// warps 0-1 (S): warp w computes S for positions [32 w, 32 w + 32) of each of the step's
// two stages (s[16 h + 4 nt + e]: stage h, n8 tile nt), the v2 softmax, P into buffer b;
// warps 2-3 (PV): warp w' rescales O once per step and accumulates the two stages' P V
// for columns [64 w', 64 w' + 64). The P ring (PipeBarriers) and the stage ring.
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
    uint32_t qa[kHead / 16][4];
    {
      const int qr = SMALL_Q ? lane % 8 : lane % 16;
#pragma unroll
      for (int kk = 0; kk < kHead / 16; ++kk)
        ldmatrix_x4<false>(qa[kk], smem + (kk / 4) * Q::kHalfBytes + sw128_offset(qr, (kk % 4) * 2 + lane / 16));
    }
    const int lim = w.ext - 1;
    const int win_lo = w.ext - p.window;  // window libraries: the first position the token sees
    const float scale = v2::score_scale(p.qk_scale);
    // Fold mode, the CTA's last split (writer lanes): the sink's state folded into the running state
    // (sink libraries; its alpha to the PV pair), then the rows' 1 / l.
    auto finish_rows = [&](float m_l, float l_l, float m_h, float l_h) {
      if constexpr (v2::kSinks) {
        rv[kV2SinkAl + r_lo] = fold_stats(m_l, l_l, v2::sink_m(p.sinks, head_lo, p.num_heads), 1.f).al;
        rv[kV2SinkAl + r_hi] = fold_stats(m_h, l_h, v2::sink_m(p.sinks, head_hi, p.num_heads), 1.f).al;
      }
      rv[kV2Inv + r_lo] = finalize_inv(l_l);
      rv[kV2Inv + r_hi] = finalize_inv(l_h);
    };
    float mr_lo = kMInit, mr_hi = kMInit, lr_lo = 0.f, lr_hi = 0.f;  // running state (fold mode), l quad-summed
    int k = 0;
    for (int sp = w.s_lo; sp < w.s_end; sp += w.s_stride) {
      enter_split<WRITE_PARTIALS>(w, sp);
      float m_lo = kMInit, m_hi = kMInit, l_lo = 0.f, l_hi = 0.f;  // this split's state, l per lane
      float mc_lo = kMInit, mc_hi = kMInit, lc_lo = 0.f, lc_hi = 0.f;  // CT split mode: the committed state
      const int je = split_end(w, sp);
      for (int j = split_first(sp); j < je; j += 2, k += 2) {
        const int u = k / 2, b = u % 2;
        // CT window libraries: a step wholly below the window, unmasked and never committed
        const bool below = below_window_v2<OPT>(w, p, j * kStep);
        const StepRole role = except_below(step_role_v2<OPT>(w, j, je), below);
        float s[32];
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = -0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int st = (k + h) % STAGES;
          const uint32_t k_base = smem + L::kOffK + st * kTile;
          mbar_wait(bar.k_full(st), ((k + h) / STAGES) & 1);
#pragma unroll
          for (int kk = 0; kk < kHead / 16; ++kk) {
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
        if constexpr (v2::kSoftCap) {  // the soft cap, before the mask (v2::soft_cap)
#pragma unroll
          for (int i = 0; i < 32; ++i) s[i] = v2::soft_cap(s[i], p.cap_pre, p.cap_post);
        }
        // off: a branch on the (public) length and window; CT: every step, by select (a dead step unmasked).
        // Window libraries mask below the window too (positions < ext - W).
        if (kCT || kv0 + kStepV2 > w.ext || (v2::kWindow && kv0 < win_lo)) {
          const int lim_s = kCT ? ct::select_int(role.dead, INT_MAX, lim) : lim;
          const int lo_s = kCT ? ct::select_int(role.dead | below, INT_MIN, win_lo) : win_lo;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            const int col = kv0 + 64 * (i / 4) + 32 * ws + 8 * (i % 4) + c2;
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const bool out = (col + e > lim_s) | (v2::kWindow && col + e < lo_s);
              s[4 * i + e] = out ? -INFINITY : s[4 * i + e];
              s[4 * i + 2 + e] = out ? -INFINITY : s[4 * i + 2 + e];
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
        const float new_lo = v2::step_max(m_lo, mx_lo, scale);
        const float new_hi = v2::step_max(m_hi, mx_hi, scale);
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
            x[0] = v2::exp_score(x[0], scale, new_lo);
            x[1] = v2::exp_score(x[1], scale, new_lo);
            x[2] = v2::exp_score(x[2], scale, new_hi);
            x[3] = v2::exp_score(x[3], scale, new_hi);
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
            if (ws == 0 && lane % 4 == 0 && last_split(w, sp)) finish_rows(mr_lo, lr_lo, mr_hi, lr_hi);
          } else {
            const float lq_lo = v2::quad_lanes(l_lo), lq_hi = v2::quad_lanes(l_hi);
            const FoldCoef c_lo = fold_stats(mr_lo, lr_lo, m_lo, lq_lo), c_hi = fold_stats(mr_hi, lr_hi, m_hi, lq_hi);
            if (ws == 0 && lane % 4 == 0) {
              rv[kV2Coef + 32 * b + 2 * r_lo] = c_lo.al;
              rv[kV2Coef + 32 * b + 2 * r_lo + 1] = c_lo.be;
              rv[kV2Coef + 32 * b + 2 * r_hi] = c_hi.al;
              rv[kV2Coef + 32 * b + 2 * r_hi + 1] = c_hi.be;
              if (last_split(w, sp)) finish_rows(mr_lo, lr_lo, mr_hi, lr_hi);
            }
          }
        }
        if constexpr (kCT && v2::kWindow) {  // after the last step below the window: the neutral state
          const bool leaving = below & !below_window_v2<OPT>(w, p, kv0 + kStepV2);
          m_lo = ct::select_f32(leaving, kMInit, m_lo);
          m_hi = ct::select_f32(leaving, kMInit, m_hi);
          l_lo = ct::select_f32(leaving, 0.f, l_lo);
          l_hi = ct::select_f32(leaving, 0.f, l_hi);
        }
        mbar_arrive(pb.full(b));  // every S thread: its P and row values are written
      }
    }
    return;
  }

  // ---- PV pair
  const int wv = warp - 2, tv = tid - 64;
  float acc[kPV];
  float run[WRITE_PARTIALS ? 1 : kPV];
  if constexpr (!WRITE_PARTIALS) {
#pragma unroll
    for (int i = 0; i < kPV; ++i) run[i] = 0.f;
  }
  auto store_out_rows = [&](float inv_lo, float inv_hi) {  // fold mode: the CTA's output rows
    if constexpr (!WRITE_PARTIALS) {
      if (ok_lo) store_out_half<BF16, kPV / 4>(p, t, head_lo, (kHead / 2) * wv + c2, run, 0, inv_lo);
      if (ok_hi) store_out_half<BF16, kPV / 4>(p, t, head_hi, (kHead / 2) * wv + c2, run, 1, inv_hi);
    }
  };
  float acc_c[(kCT && WRITE_PARTIALS) ? kPV : 1];  // CT split mode: the committed accumulator
  int k = 0;
  for (int sp = w.s_lo; sp < w.s_end; sp += w.s_stride) {
    enter_split<WRITE_PARTIALS>(w, sp);
#pragma unroll
    for (int i = 0; i < kPV; ++i) acc[i] = 0.f;
    if constexpr (kCT && WRITE_PARTIALS) {
#pragma unroll
      for (int i = 0; i < kPV; ++i) acc_c[i] = 0.f;
    }
    const int je = split_end(w, sp);
    for (int j = split_first(sp); j < je; j += 2, k += 2) {
      const int u = k / 2, b = u % 2;
      const bool below = below_window_v2<OPT>(w, p, j * kStep);
      const StepRole role = except_below(step_role_v2<OPT>(w, j, je), below);
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
            zero_v_tail<kStep, 64, kHalves>(smem_ptr + L::kOffV + st * kTile, max(valid, 0), tv, kBarVTail,
                                   (OPT & kPairedV) ? p.box_rows : kStep);
        }
        const int v_len = kCT ? ct::select_int(role.dead, INT_MAX, w.seq_len) : w.seq_len;
        // window libraries: V below the window zeroed in the fragments (off: the tail is zeroed above)
        const int v_lo = kCT ? ct::select_int(role.dead | below, INT_MIN, w.ext - p.window) : w.ext - p.window;
        pv_step_mma<BF16, kHead / 32, OPT>(acc, p, p_tile, v_base, (kHead / 16) * wv, lane, (j + h) * kStep, kCT ? v_len : INT_MAX,
                                  v_lo);
        __syncwarp();
        if (lane == 0) mbar_arrive(bar.v_empty(st));
      }
      if constexpr (kCT) {  // the commit (step_role_v2), by selection
        if constexpr (WRITE_PARTIALS) {
#pragma unroll
          for (int i = 0; i < kPV; ++i) acc_c[i] = ct::select_f32(role.commit, acc[i], acc_c[i]);
        } else {  // the fold the S pair computed for this step, kept at the commit
          const FoldCoef c_lo{rv[kV2Coef + 32 * b + 2 * r_lo], rv[kV2Coef + 32 * b + 2 * r_lo + 1]};
          const FoldCoef c_hi{rv[kV2Coef + 32 * b + 2 * r_hi], rv[kV2Coef + 32 * b + 2 * r_hi + 1]};
#pragma unroll
          for (int i = 0; i < kPV / 4; ++i) {
            const float f0 = fold_value(run[4 * i], acc[4 * i], c_lo);
            const float f1 = fold_value(run[4 * i + 1], acc[4 * i + 1], c_lo);
            const float f2 = fold_value(run[4 * i + 2], acc[4 * i + 2], c_hi);
            const float f3 = fold_value(run[4 * i + 3], acc[4 * i + 3], c_hi);
            run[4 * i] = ct::select_f32(role.commit, f0, run[4 * i]);
            run[4 * i + 1] = ct::select_f32(role.commit, f1, run[4 * i + 1]);
            run[4 * i + 2] = ct::select_f32(role.commit, f2, run[4 * i + 2]);
            run[4 * i + 3] = ct::select_f32(role.commit, f3, run[4 * i + 3]);
            if constexpr (v2::kWindow) {  // below the window: the filler (except_below)
              run[4 * i] = ct::select_f32(below, ct::filler_of(f0), run[4 * i]);
              run[4 * i + 1] = ct::select_f32(below, ct::filler_of(f1), run[4 * i + 1]);
              run[4 * i + 2] = ct::select_f32(below, ct::filler_of(f2), run[4 * i + 2]);
              run[4 * i + 3] = ct::select_f32(below, ct::filler_of(f3), run[4 * i + 3]);
            }
          }
        }
      }
      if (j + 2 == je) {
        if constexpr (kCT && WRITE_PARTIALS) {
          // A dead split of a row with positions stores its evolving accumulator, made finite and
          // non-negative, where the neutral state holds zeros (the Triton-contract consumer of git history: the
          // merge multiplies it by +0, the bits are the same, and the stored values follow no length).
          // So does a split wholly below the window (window libraries, ct::filler_of): the merge folds such
          // splits first, whose neutral m gives each a coefficient of 1, then the first split with
          // positions wipes their sum with alpha = +0.
          const bool filler = (split_first(sp) * kStep >= w.ext) & (w.ext > 0);
#pragma unroll
          for (int i = 0; i < kPV; ++i) {
            acc_c[i] = ct::select_f32(filler, ct::filler_of(acc[i], 3.4028234663852886e38f), acc_c[i]);
            // (below: the split's last step lies below the window, so every step of it does)
            if constexpr (v2::kWindow) acc_c[i] = ct::select_f32(below, ct::filler_of(acc[i]), acc_c[i]);
          }
        }
        if constexpr (WRITE_PARTIALS) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (h == 0 ? !ok_lo : !ok_hi) continue;
            const int64_t row = (static_cast<int64_t>(sp) * p.num_tokens + t) * p.num_heads +
                                (h == 0 ? head_lo : head_hi);
            if constexpr (kCT)
              store_split_half<kPV / 4>(p, row, (kHead / 2) * wv + c2, acc_c, h);
            else
              store_split_half<kPV / 4>(p, row, (kHead / 2) * wv + c2, acc, h);
          }
        } else if constexpr (!kCT) {  // (CT: committed above)
          const FoldCoef c_lo{rv[kV2Coef + 32 * b + 2 * r_lo], rv[kV2Coef + 32 * b + 2 * r_lo + 1]};
          const FoldCoef c_hi{rv[kV2Coef + 32 * b + 2 * r_hi], rv[kV2Coef + 32 * b + 2 * r_hi + 1]};
          fold_values(run, acc, c_lo, c_hi);
        }
      }
      // After the last step below the window (CT window libraries): the accumulator back to +0, once the
      // commit and the split's end have read it.
      if constexpr (kCT && v2::kWindow) drop_below(acc, below & !below_window_v2<OPT>(w, p, j * kStep + kStepV2));
      float inv_lo = 1.f, inv_hi = 1.f;
      if (!WRITE_PARTIALS && k + 2 == n_steps) {
        inv_lo = rv[kV2Inv + r_lo];
        inv_hi = rv[kV2Inv + r_hi];
        if constexpr (v2::kSinks && !WRITE_PARTIALS) {  // the sink's state: acc 0, its alpha (finish_rows)
          const FoldCoef s_lo{rv[kV2SinkAl + r_lo], 0.f}, s_hi{rv[kV2SinkAl + r_hi], 0.f};
#pragma unroll
          for (int i = 0; i < kPV / 4; ++i) {
            run[4 * i] = fold_value(run[4 * i], 0.f, s_lo);
            run[4 * i + 1] = fold_value(run[4 * i + 1], 0.f, s_lo);
            run[4 * i + 2] = fold_value(run[4 * i + 2], 0.f, s_hi);
            run[4 * i + 3] = fold_value(run[4 * i + 3], 0.f, s_hi);
          }
        }
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
  const int kvh = blockIdx.x;
  int t = blockIdx.y, req = -1, chunk = blockIdx.z, chunks = gridDim.z;
  int kq0 = -1, kq1 = 0, klen = 0;  // the dealt schedule's request metadata (work_of)
  // The dealt schedule follows the true lengths: policy-off split binaries only (kWalk 0); the CT
  // binaries do not compile it, their grid row is their token as before (work_ct).
  if constexpr (kWalk<OPT> == 0 && WRITE_PARTIALS) {
    if (p.deal_table != nullptr) {  // the dealt schedule: blockIdx.y is a grid row of items
      const int4* e = reinterpret_cast<const int4*>(p.deal_table) + 2 * blockIdx.y;
      const int4 a = e[0], b = e[1];
      if (a.w == 0) return;  // past the step's items: the whole CTA, before any barrier
      t = a.x;
      req = a.y;
      chunk = a.z;
      chunks = a.w;
      kq0 = b.x;
      kq1 = b.y;
      klen = b.z;
    }
  }
  if (kWalk<OPT> == 0 && p.order != nullptr) {  // the longest-first schedule (order_kernel)
    const int2 e = reinterpret_cast<const int2*>(p.order)[blockIdx.y];
    t = e.x;
    req = e.y;
    if (static_cast<unsigned>(t) >= static_cast<unsigned>(p.num_tokens) ||
        static_cast<unsigned>(req) > static_cast<unsigned>(p.num_seqs))
      return;
  }
  if constexpr (kWalk<OPT> == 0 && !v2::kWindow) {
    // Policy off: warm L2 with the block-table line of the producer's first split as the decode
    // fast path has it (token t is request t), under work_of's loads instead of after them (the
    // producer's split_ids waits on work_of's request). A hint: another request or split only
    // misses as before. Token t < num_seqs has a table row; chunk < the table's splits.
    if (threadIdx.x == 128 && p.order == nullptr && p.deal_table == nullptr && t < p.num_seqs)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p.block_table + static_cast<int64_t>(t) * p.bt_stride +
                                                 chunk * (kSplitKV / p.block_size)));
  }
  Work w;
  if constexpr (kWalk<OPT> != 0)
    w = work_ct<kWalk<OPT>>(p, t, chunk, WRITE_PARTIALS);
  else
    w = work_of(p, t, req, chunk, chunks, WRITE_PARTIALS, kq0, kq1, klen);
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
  // Head 64: four stages, the bytes in flight of head 128's two (a stage holds half the bytes).
  // Head 256: stages of twice the bytes and one CTA per SM (ops.cuda_decode plans the grid with
  // that residency). A consumer step takes two stages, so two hold one step: a step's loads wait
  // for the previous step's release, with no second CTA on the SM to hide them (docs/perf-notes.md
  // item (6)(d)): the off binary has a third where it fits (the small Q tile, groups <= 8: 207 KB).
  // The CT binaries keep two: their G4-measured form (a change of their time re-opens G4).
  constexpr bool kThird = kHead == 256 && !(OPT & kConstTime) && LayoutV2<3, SMALL_Q>::kBytes + 1024 <= 228 * 1024;
  constexpr int kStages = kHead == 64 ? 4 : kThird ? 3 : 2;
  constexpr int kMinBlocks = kHead == 256 ? 1 : 2;
  constexpr auto kernel = decode_v2_kernel<BF16, kStages, WRITE_PARTIALS, kMinBlocks, SMALL_Q, OPT>;
  constexpr int bytes = LayoutV2<kStages, SMALL_Q>::kBytes;
  static_assert((bytes + 1024) * kMinBlocks <= 228 * 1024, "the stages must fit the CTAs of an SM");
  if (const cudaError_t e = allow_dynamic_smem<kernel>(bytes); e != cudaSuccess) return static_cast<int>(e);
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
int launch_variant(int variant, const CUtensorMap& tq, const CUtensorMap& tk, const CUtensorMap& tv,
                   const Params& p, dim3 grid, cudaStream_t st) {
  switch (variant) {
    case 4 + 8 * (kPipe | kV2): return launch_v2_opt<BF16, WRITE_PARTIALS, kPipeOpt>(tq, tk, tv, p, grid, st);
    case 4 + 8 * (kPipe | kV2 | kConstTime):
      return launch_v2_opt<BF16, WRITE_PARTIALS, kPipeOpt | kConstTime>(tq, tk, tv, p, grid, st);
    case 4 + 8 * (kPipe | kV2 | kConstTime | kBucketPerReq):
      return launch_v2_opt<BF16, WRITE_PARTIALS, kPipeOpt | kConstTime | kBucketPerReq>(tq, tk, tv, p, grid, st);
    default: return -5;
  }
}

}  // namespace
}  // namespace dhp

// C entry point (ctypes). Strides in elements. ws_* may be null in fold mode
// (spp == 0). Returns 0 or an error code: a cudaError_t, or -1 (no
// cuTensorMapEncodeTiled), -2..-4 (tensor map of Q/K/V rejected), -5 (unknown
// variant), -6 (grid too large), -7 (query heads per KV head not in 1..64), -9
// (split mode: ws_acc not 16-byte aligned).
// Split mode when spp > 0: grid.z = ceil(n_split_grid / spp) chunks, chunk c takes
// splits c, c + grid.z, ... (split_schedule); fold mode otherwise (grid.z = 1).
// order_ws (fold mode only; may be null): 2 x num_tokens int32 (8-byte aligned) for
// the longest-first schedule (order_kernel), written then read in stream order.
// CT variants (kConstTime in the variant's options): l_scalar (walk 1) or bucket
// (walk 2, kBucketPerReq: num_seqs int32), max_blocks (block-table width); each
// request's table line must hold its reserved pages up to its bucket (the address
// rule: ops.paged_attention checks it); order_ws is ignored; -8 when num_seqs < 1 or
// a bucket argument is out of range. Off variants ignore these.
// deal_slots (policy off, split mode; CT variants and fold mode ignore it): > 0 deals the splits
// on the device from the true lengths for that many resident CTAs (deal_kernel), with deal_cost a
// CTA's cost in splits and spp the plan's dealing (one of its two candidates), through deal_table:
// 8 x num_tokens x ceil(n_split_grid / spp) int32 (16-byte aligned, at most kDealMaxRows rows),
// which deal_fill = 1 fills first (a deal_kernel launch in stream order) and deal_fill = 0 reads as
// an earlier launch of this library filled it for the same step (the same metadata, plan and
// deal arguments: a step's layers share one dealing); 0 keeps the fixed schedule (spp splits a
// chunk); -12 when deal_slots < 0, or a dealt launch has more than kDealMaxReqs requests, more
// than kDealMaxRows rows or no table.
extern "C" int dhp_decode_sm90(const void* q, int64_t q_tok_stride, int64_t q_head_stride, const void* k,
                               const void* v, int64_t kv_block_stride, int64_t kv_head_stride, int64_t kv_tok_stride,
                               int num_blocks, void* out, int64_t out_tok_stride, int64_t out_head_stride,
                               const int* block_table, int64_t bt_stride, const int* seq_lens,
                               const int* query_start_loc, int num_seqs, int num_q_rows, int num_tokens,
                               int num_heads, int num_kv_heads, int block_size, float qk_scale, int causal,
                               int is_bf16, int variant, float* ws_acc, float* ws_m, float* ws_l, int n_split_grid,
                               int spp, int* order_ws, int l_scalar, const int* bucket, int max_blocks,
                               int window, float cap_pre, float cap_post, const float* sinks, int deal_slots,
                               float deal_cost, int* deal_table, int deal_fill, void* stream) {
  using namespace dhp;
  const tma::EncodeTiled encode = tma::encode_fn();
  if (!encode) return -1;
  const int group = num_kv_heads > 0 ? num_heads / num_kv_heads : 0;
  if (group <= 0 || group > kRows || group * num_kv_heads != num_heads) return -7;
  CUtensorMap tq, tk, tv;
  if (!tma::encode_q(encode, &tq, is_bf16, q, kModelHead, num_heads, num_q_rows, q_head_stride, q_tok_stride, group, 1))
    return -2;
  const int box_rows = block_size < kStep ? block_size : kStep;
  if (!tma::encode_kv(encode, &tk, is_bf16, k, kModelHead, block_size, num_kv_heads, num_blocks, kv_block_stride,
                      kv_head_stride, kv_tok_stride, box_rows))
    return -3;
  // (a head-64 library loads V by the one-half map: its paired layout is that one's)
  const bool paired_v = kHalves == 2 && variant >= 8 && ((variant / 8) & kPairable);
  if (!(paired_v ? tma::encode_kv_paired(encode, &tv, is_bf16, v, block_size, num_kv_heads, num_blocks,
                                         kv_block_stride, kv_head_stride, kv_tok_stride, box_rows)
                 : tma::encode_kv(encode, &tv, is_bf16, v, kModelHead, block_size, num_kv_heads, num_blocks, kv_block_stride,
                                  kv_head_stride, kv_tok_stride, box_rows)))
    return -4;

  Params p;
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
  p.window = window;
  p.cap_pre = cap_pre;
  p.cap_post = cap_post;
  p.sinks = sinks;
  // The feature arguments must be this library's (cuda_build.feature_library).
  if ((window >= 1) != v2::kWindow || window < 0 || ((cap_post != 0.f) != v2::kSoftCap) ||
      ((sinks != nullptr) != v2::kSinks))
    return -10;
  const bool split = spp > 0;
  const int opts = variant >= 8 ? variant / 8 : 0;
  const bool ct = (opts & kConstTime) != 0;
  p.order = split || ct ? nullptr : order_ws;
  ct::set_walk_params(p, l_scalar, bucket, max_blocks);
  if (ct && (num_seqs < 1 || max_blocks < 1 || ((opts & kBucketPerReq) ? bucket == nullptr : l_scalar < 1)))
    return -8;
  // The dealt schedule (policy off, split mode): the fixed schedule's num_tokens x chunks CTA rows, in
  // one dimension; the wave's rows for the dealing at most those (either candidate's items fit).
  const bool dealt = split && !ct && deal_slots > 0 && n_split_grid > 0;  // (no splits: nothing to deal)
  const int plan_chunks = split ? (n_split_grid + spp - 1) / spp : 1;
  const int64_t dealt_rows = static_cast<int64_t>(num_tokens) * plan_chunks;
  if (deal_slots < 0 || (dealt && (num_seqs > kDealMaxReqs || dealt_rows > kDealMaxRows || deal_table == nullptr ||
                                   (reinterpret_cast<uintptr_t>(deal_table) & 15))))
    return -12;
  p.deal_table = dealt ? deal_table : nullptr;
  p.deal_rows = dealt ? static_cast<int>(std::min<int64_t>(std::max(1, deal_slots / num_kv_heads), dealt_rows)) : 0;
  p.deal_spp = spp;
  p.deal_cost = deal_cost;
  if (num_tokens <= 0) return 0;
  const int64_t rows_y = dealt ? dealt_rows : num_tokens;
  const int chunks = dealt ? 1 : plan_chunks;
  if (rows_y > 65535 || chunks > 65535) return -6;
  if (split && (reinterpret_cast<uintptr_t>(ws_acc) & 15)) return -9;  // the merge's 16-byte cp.async
  const dim3 grid(num_kv_heads, static_cast<unsigned>(rows_y), chunks);
  cudaStream_t st = static_cast<cudaStream_t>(stream);
  if (dealt && deal_fill) {
    const int warps = static_cast<int>((rows_y + kDealRowsPerWarp - 1) / kDealRowsPerWarp);
    deal_kernel<<<(warps + kDealWarps - 1) / kDealWarps, 32 * kDealWarps, 0, st>>>(p, static_cast<int>(rows_y),
                                                                                 deal_table);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return static_cast<int>(e);
  }
  if (is_bf16)
    return split ? launch_variant<true, true>(variant, tq, tk, tv, p, grid, st)
                 : launch_variant<true, false>(variant, tq, tk, tv, p, grid, st);
  return split ? launch_variant<false, true>(variant, tq, tk, tv, p, grid, st)
               : launch_variant<false, false>(variant, tq, tk, tv, p, grid, st);
}

// The head size this library's binaries take (128; 64, 80 or 96 in the libraries built with -DDHP_HEAD):
// ops.cuda_decode checks it when it loads a library.
extern "C" int dhp_decode_sm90_head_size() { return dhp::kModelHead; }

// The most requests a dealt launch reads (kDealMaxReqs): ops.cuda_decode routes larger steps to the
// fixed schedule.
extern "C" int dhp_decode_sm90_deal_max_reqs() { return dhp::kDealMaxReqs; }

// The capture sequence of the stream's CUDA-graph capture, 0 when it is not capturing: ops.cuda_decode
// lets a dealt launch read a table made by an earlier launch of its step only within one capture (or
// outside any), so that a captured graph makes every table it reads.
extern "C" unsigned long long dhp_decode_sm90_capture_id(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  if (cudaStreamGetCaptureInfo(static_cast<cudaStream_t>(stream), &status, &id) != cudaSuccess ||
      status != cudaStreamCaptureStatusActive)
    return 0;
  return id;
}

// The most grid rows a dealt launch's table holds (kDealMaxRows): ops.cuda_decode checks it against
// the workspace's table (workspace.DEAL_TABLE_ROWS) and routes larger steps to the fixed schedule.
extern "C" int dhp_decode_sm90_deal_max_rows() { return dhp::kDealMaxRows; }
