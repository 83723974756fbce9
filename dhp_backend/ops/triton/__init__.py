"""Constant-time Triton kernels for `ops.paged_attention` (issue 3).

This package's ``__init__`` must stay import-cheap: it answers *whether* a shape
is covered without importing Triton. The kernels live in submodules that are
imported on first launch.
"""

from __future__ import annotations


def supports(spec) -> tuple[bool, str]:
    """Whether the Triton kernels cover ``spec`` (a `dispatch.ProblemSpec`), and why not."""
    return False, "Triton kernels are not part of this build yet"


def paged_attention_triton(*args, **kwargs):  # pragma: no cover - replaced by issue 3
    raise NotImplementedError("the Triton path is not available in this build")
