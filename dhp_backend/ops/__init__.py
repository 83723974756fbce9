"""Framework-level attention API: torch tensors in, the result written into ``out``.

`paged_attention` is the seam: the vLLM adapter calls it, the kernels and the
reference implement it. It knows nothing of vLLM.
"""

from dhp_backend.config import Policy
from dhp_backend.ops.attention import paged_attention, step_kernel
from dhp_backend.ops.buckets import bucket_for_step, next_pow2
from dhp_backend.ops.dispatch import (
    FallbackRefused,
    PathChoice,
    ProblemSpec,
    choose_path,
    graph_capturable,
    prepare_path,
)

__all__ = [
    "step_kernel",
    "FallbackRefused",
    "PathChoice",
    "Policy",
    "ProblemSpec",
    "bucket_for_step",
    "choose_path",
    "graph_capturable",
    "next_pow2",
    "paged_attention",
    "prepare_path",
]
