"""Framework-level attention API: torch tensors in, the result written into ``out``.

`paged_attention` is the seam: the vLLM adapter calls it, the kernels and the
reference implement it. It knows nothing of vLLM. `plan_step` / `run` are its
two halves for callers that run many layers of one step (the vLLM adapter plans
once per step in its metadata builder): `dhp_backend.ops.plan`.
"""

from dhp_backend.config import Policy
from dhp_backend.ops.attention import paged_attention
from dhp_backend.ops.buckets import bucket_for_step, next_pow2
from dhp_backend.ops.dispatch import (
    FallbackRefused,
    PathChoice,
    ProblemSpec,
    choose_path,
    graph_capturable,
    prepare_path,
)
from dhp_backend.ops.plan import StepPlan, new_deal_step, plan_step, prepare_kernels, run, step_kernel

__all__ = [
    "FallbackRefused",
    "PathChoice",
    "Policy",
    "ProblemSpec",
    "StepPlan",
    "bucket_for_step",
    "choose_path",
    "graph_capturable",
    "new_deal_step",
    "next_pow2",
    "paged_attention",
    "plan_step",
    "prepare_kernels",
    "prepare_path",
    "run",
    "step_kernel",
]
