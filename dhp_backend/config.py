"""User configuration of the DHP backend: policy, fallback permission, forced path.

Sources, highest precedence first (vLLM's convention for plugins):

1. ``--additional-config '{"dhp": {"policy": "request"}}'`` (``vllm_config.additional_config``)
2. environment variables ``DHP_POLICY``, ``DHP_ALLOW_FALLBACK``, ``DHP_PATH``
3. the defaults below (``policy="strict"``, no non-constant-time fallback, ``path="auto"``)

This module imports nothing heavy: the plugin and ``dhp-backend info`` use it.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from collections.abc import Mapping
from typing import Any


class Policy(str, enum.Enum):
    """How the length bucket L is chosen (design.md section 2).

    The bucket is what the kernels' trip counts and memory traffic may depend on;
    everything below it is secret.
    """

    STRICT = "strict"    # L = max_model_len: timing reveals only the step geometry
    REQUEST = "request"  # each request's own next power of two
    OFF = "off"          # true lengths: fast, still deterministic and batch-invariant

    @classmethod
    def parse(cls, value: Policy | str, *, source: str = "policy") -> Policy:
        if isinstance(value, Policy):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
            if value.strip().lower() == "batch":
                raise ValueError(
                    f"{source}: DHP policy 'batch' was retired. Its bucket was the longest request "
                    "of each step, and the address rule (every request reads its pages up to its "
                    "bucket) would make every request reserve KV pages up to the longest one it "
                    "might ever share a step with. Use 'request' (each request reserves up to its "
                    "own next power of two) or 'strict'; accepted: "
                    + ", ".join(repr(p.value) for p in cls))
        raise ValueError(
            f"{source}: unknown DHP policy {value!r}; accepted: "
            + ", ".join(repr(p.value) for p in cls)
        )

    @property
    def is_constant_time(self) -> bool:
        """Whether the policy promises anything about timing (all but ``off``)."""
        return self is not Policy.OFF


PATHS = ("auto", "reference", "triton")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(value: Any, *, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ValueError(f"{source}: expected a boolean (true/false, 1/0), got {value!r}")


@dataclasses.dataclass(frozen=True)
class DHPConfig:
    """Effective configuration of one process.

    ``allow_fallback``: under a constant-time policy, a shape the kernels do not
    cover is refused at start-up, because the reference fallback is not
    constant-time. Setting this to true accepts the fallback (logged loudly).
    ``path``: ``auto`` lets the dispatcher choose; ``reference``/``triton``
    force one path (for tests and debugging; an unsupported forced path is an
    error, never a silent substitute).
    """

    policy: Policy = Policy.STRICT
    allow_fallback: bool = False
    path: str = "auto"
    sources: tuple[str, ...] = ()  # where each non-default value came from, for logs

    KEYS = ("policy", "allow_fallback", "path")

    @classmethod
    def from_sources(
        cls,
        additional_config: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> DHPConfig:
        env = os.environ if environ is None else environ
        section: Mapping[str, Any] = {}
        if additional_config:
            raw = additional_config.get("dhp", {})
            if not isinstance(raw, Mapping):
                raise ValueError(
                    "additional_config['dhp'] must be a JSON object such as "
                    f'{{"policy": "strict"}}, got {raw!r}'
                )
            unknown = sorted(set(raw) - set(cls.KEYS))
            if unknown:
                raise ValueError(
                    f"additional_config['dhp']: unknown key(s) {unknown}; accepted: {list(cls.KEYS)}"
                )
            section = raw

        sources = []
        policy = Policy.STRICT
        if "policy" in section:
            policy = Policy.parse(section["policy"], source="additional_config['dhp']['policy']")
            sources.append("policy from additional_config")
        elif env.get("DHP_POLICY"):
            policy = Policy.parse(env["DHP_POLICY"], source="DHP_POLICY")
            sources.append("policy from DHP_POLICY")

        allow = False
        if "allow_fallback" in section:
            allow = _parse_bool(
                section["allow_fallback"], source="additional_config['dhp']['allow_fallback']"
            )
            sources.append("allow_fallback from additional_config")
        elif env.get("DHP_ALLOW_FALLBACK") is not None:
            allow = _parse_bool(env["DHP_ALLOW_FALLBACK"], source="DHP_ALLOW_FALLBACK")
            sources.append("allow_fallback from DHP_ALLOW_FALLBACK")

        path = "auto"
        raw_path = section.get("path", env.get("DHP_PATH") or "auto")
        if not isinstance(raw_path, str) or raw_path.strip().lower() not in PATHS:
            src = "additional_config['dhp']['path']" if "path" in section else "DHP_PATH"
            raise ValueError(f"{src}: unknown path {raw_path!r}; accepted: {list(PATHS)}")
        path = raw_path.strip().lower()
        if path != "auto":
            sources.append("path from " + ("additional_config" if "path" in section else "DHP_PATH"))

        return cls(policy=policy, allow_fallback=allow, path=path, sources=tuple(sources))

    def describe(self) -> str:
        src = f" ({'; '.join(self.sources)})" if self.sources else " (defaults)"
        return (
            f"policy={self.policy.value} allow_fallback={self.allow_fallback} "
            f"path={self.path}{src}"
        )
