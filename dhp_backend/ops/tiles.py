"""Static kernel configuration: tile shapes and the split size, chosen from public model facts only.

Everything here is a function of (head size, GQA group size, dtype, device kind),
never of the batch. That is what makes the output bits batch-invariant: the tile
shapes fix which MMA instructions run and where the KV tiles and splits begin,
and none of that may move when the batch changes. Importing this module is cheap
(no Triton, no torch), so `supports()` can use it at start-up.
"""

from __future__ import annotations

import dataclasses

# Split-KV granularity in KV positions, at absolute positions 0, SPLIT_KV, 2*SPLIT_KV...
# A public constant of the kernel version: changing it changes the output bits
# (a different summation order), so it is never chosen from the batch.
SPLIT_KV = 512

SUPPORTED_HEAD_SIZES = (64, 80, 96, 128, 256)
SUPPORTED_BLOCK_SIZES = (16, 32, 64, 128)
SUPPORTED_DTYPES = ("float16", "bfloat16", "float32")
MAX_GROUP = 128  # query heads per KV head that one tile can hold (BLOCK_M <= 128)

# Requests per step the tile search scans in one vector load (see kernels._locate).
SEARCH_BLOCK = 256


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One compiled kernel variant's tile geometry.

    ``block_m`` rows of a query tile are ``block_q`` query tokens times ``group``
    query heads that share one KV head, so K/V are read once per tile for the
    whole group. ``block_n`` KV positions per inner step; ``split_kv`` positions
    per split (a multiple of ``block_n``).
    """

    head_size: int
    head_pad: int
    group: int
    block_m: int
    block_q: int
    block_n: int
    split_kv: int
    num_warps: int
    num_stages: int
    fp32: bool
    prefetch: bool = True  # block ids two KV steps ahead (kernels.attention_kernel)
    # Resident programs per SM when known (0: from the warp count, see programs_per_sm).
    resident: int = 0

    @property
    def tiles_per_split(self) -> int:
        return self.split_kv // self.block_n

    @property
    def programs_per_sm(self) -> int:
        """Resident programs per SM (~255 registers per thread: two 4-warp programs
        or one 8-warp program) unless ``resident`` says otherwise; shapes split-mode
        grids into whole waves."""
        return self.resident or max(1, 8 // self.num_warps)


# Step kinds (launch.step_kind, from the public step geometry): which tile
# config runs. All kinds compute every row with the same instructions in the same
# order (the same BLOCK_N, SPLIT_KV, wgmma shapes per warpgroup, reductions), so
# a row's bits do not depend on the kind; tests/test_triton_gpu.py checks it.
STEP_KINDS = ("decode", "mixed", "prefill")
# Mean query tokens per request from which a step counts as "prefill".
PREFILL_TOKENS_PER_REQUEST = 16


def kernel_config(head_size: int, group: int, dtype: str, *, split_kv: int | None = None,
                  kind: str = "mixed", const_time: bool = True) -> KernelConfig:
    """The config for a (head size, group, dtype) problem and a step kind.

    ``split_kv`` overrides the split size (tests use small splits so that short
    sequences cross split boundaries under the interpreter); production uses the
    constant `SPLIT_KV`.

    ``kind`` (public, launch.step_kind): ``decode`` steps (one query token per
    tile) run a 16-row tile (GQA group <= 16; else the 64-row tile) with three
    pipeline stages, ``mixed`` steps the
    64-row tile with two, ``prefill`` steps (many query tokens per request) a
    128-row tile on 8 warps (two warpgroups of 64 rows, each row computed as in
    the 64-row tile). Measured on an H200 (docs/perf-notes.md): 3 stages are
    4-8 % faster on decode and 5 % slower on prefill; the 128-row tile is 18 %
    faster on a 4K prefill and 1.6x slower on decode.

    ``const_time``: False for policy off's binary (kernels.CONST_TIME), whose
    decode tile takes one more pipeline stage (see below). Not a bits question:
    stages only change when loads are issued.
    """
    if kind not in STEP_KINDS:
        raise ValueError(f"kind={kind!r}; accepted: {', '.join(STEP_KINDS)}")
    head_pad = next_pow2(head_size)
    block_m = max(64, next_pow2(group))
    fp32 = dtype == "float32"
    # Two fp32 accumulators stay live (running state + current split), so the
    # register file sets the shape. At head <= 128 and 64-row tiles, 4 warps
    # (255 registers, a few spills, two programs per SM) beat 8 warps (one
    # program per SM, the QK^T/softmax work duplicated across the two
    # warpgroups) by 1.2x on decode and 1.5x on prefill. Head 256 halves the KV
    # step and keeps 8 warps; it spills (correct, slower).
    block_n = 64 if head_pad <= 128 else 32
    num_warps = 4 if head_pad <= 128 and block_m <= 64 else 8
    num_stages = 2
    resident = 0
    if head_pad <= 128 and not fp32 and block_m == 64:
        if kind == "decode" and group <= 16:
            # One query token per tile: GROUP of the 16 rows are real instead of
            # GROUP of 64. Triton takes a 16-row tile to mma.sync (m16n8k16) instead
            # of wgmma; same per-element products and k16 accumulation order, and
            # `kernels.row_sum` fixes the row sums, so the bits equal the 64-row
            # tile's (GPU test). Triton's mma.sync pipeline keeps num_stages - 1
            # K/V buffers. Constant-time binaries: 3 stages, 199-224 registers,
            # two programs per SM. The policy-off binary needs only 168 registers,
            # so at 3 stages (72 KB) three programs fit per SM and a 512-program
            # grid (B=64) ran 1.3 waves, 25 % slower than at 4 stages (104 KB, two
            # per SM); 4 stages it is (docs/perf-notes.md, change 12).
            block_m, num_stages, resident = 16, (3 if const_time else 4), 2
        elif kind == "decode":
            num_stages = 3
        elif kind == "prefill":
            block_m, num_warps = 128, 8
    split = SPLIT_KV if split_kv is None else int(split_kv)
    if split <= 0 or split % block_n:
        raise ValueError(f"split_kv={split} must be a positive multiple of block_n={block_n}")
    return KernelConfig(
        head_size=head_size,
        head_pad=head_pad,
        group=group,
        block_m=block_m,
        block_q=block_m // group,
        block_n=block_n,
        split_kv=split,
        num_warps=num_warps,
        num_stages=num_stages,
        fp32=fp32,
        resident=resident,
    )
