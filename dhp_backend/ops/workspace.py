"""The split-KV workspace: one fixed-size buffer per device, allocated once.

design.md section 2: backend memory beyond the KV cache is allocated once (never
per step), stays small, and should exist before vLLM's memory-profiling run. The
Triton kernels and the csrc kernels share it (split states, the store sink, the
zero row, the csrc decode kernel's longest-first schedule and its dealt schedule's
table). A launch only uses
the cross-program split path when its partial states fit in this buffer
(`geometry.plan`); otherwise it folds splits inside each program (same bits, see
triton/kernels.py), so the buffer's size never changes a result, only the speed.

The buffer is used in stream order by one launch at a time; two streams running
attention concurrently on one device would need one buffer each.
"""

from __future__ import annotations

import threading

import torch

WORKSPACE_BYTES = 64 * 1024 * 1024

# The tail of the buffer is the store "sink" (kernels.py): rows of a query tile
# that belong to no request are written there instead of being masked off.
# SINK_SLOTS tiles' worth of rows, each up to SINK_ROWS x SINK_WIDTH fp32 values,
# then one fp32 per row for the softmax statistics.
SINK_SLOTS = 16
SINK_ROWS = SINK_SLOTS * 128  # 128 = the tallest tile (config.MAX_GROUP)
SINK_WIDTH = 256  # the widest padded head
SINK_FLOATS = SINK_ROWS * SINK_WIDTH + SINK_ROWS
# The last ZERO_FLOATS floats are zeros that nothing ever writes: the row that
# policy off's kernels read as V for positions past a request's true length (one
# row of the widest head in any dtype).
ZERO_FLOATS = SINK_WIDTH
# Before the sink: the csrc decode kernel's dealt-schedule table (policy off, split mode: 8 int32 per
# grid row, up to csrc kDealMaxRows rows; cuda_decode checks the two agree). Split states never
# overlap it, so a step's layers can share the table while each writes its own split states.
DEAL_TABLE_ROWS = 4096
DEAL_TABLE_INTS = 8 * DEAL_TABLE_ROWS
SPLIT_FLOATS = WORKSPACE_BYTES // 4 - DEAL_TABLE_INTS - SINK_FLOATS - ZERO_FLOATS

_lock = threading.Lock()
_buffers: dict[torch.device, torch.Tensor] = {}


def workspace_bytes() -> int:
    """Bytes this module holds per device once reserved (for `dhp-backend info`)."""
    return WORKSPACE_BYTES


def reserve_workspace(device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Allocate (once) the device's workspace; return (split area, sink, zero row), flat float32.

    Call this at start-up, before memory profiling and CUDA-graph capture: an
    allocation during capture would fail.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _lock:
        buf = _buffers.get(device)
        if buf is None:
            buf = torch.empty(WORKSPACE_BYTES // 4, dtype=torch.float32, device=device)
            buf[-ZERO_FLOATS:].zero_()
            _buffers[device] = buf
        return buf[:SPLIT_FLOATS], buf[SPLIT_FLOATS + DEAL_TABLE_INTS:-ZERO_FLOATS], buf[-ZERO_FLOATS:]


def deal_table(device: torch.device | str) -> torch.Tensor:
    """The device workspace's dealt-schedule table: ``DEAL_TABLE_INTS`` int32 (16-byte aligned), reserved
    with the workspace (`reserve_workspace`)."""
    split = reserve_workspace(device)[0]
    buf = _buffers[split.device]
    return buf[SPLIT_FLOATS:SPLIT_FLOATS + DEAL_TABLE_INTS].view(torch.int32)
