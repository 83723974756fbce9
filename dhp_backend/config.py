"""User configuration of the DHP backend: one table of settings, one strict parser.

Every setting of the product is declared once in `SETTINGS` (name, type,
default, the environment variable that can set it, what it does); the product
reads them through this module, never from ``os.environ``. Sources, highest
precedence first (vLLM's convention for plugins):

1. ``--additional-config '{"dhp": {"policy": "request"}}'`` (``vllm_config.additional_config``),
   for the settings an engine reads once vLLM's configuration exists;
2. the setting's environment variable (``DHP_POLICY``, ``DHP_ALLOW_FALLBACK``, ...);
3. the default (``policy="strict"``, no non-constant-time fallback, ``path="auto"``, ...).

A few settings are read before any vLLM configuration exists (the plugin's
registration, the CUDA build): they come from their environment variable only
(``Setting.engine`` false; `from_env`), and an ``additional_config`` key naming one
says so.

Parsing is strict and the same everywhere (the engine, the CLI, tests): booleans
are JSON true/false or one of `BOOL_WORDS`; enums are case-insensitive; an unknown
key, a near-miss section name (``DHP``, ``dhpp``) or a malformed value from
*either* source is an error that names the bad value and the accepted ones. When
both sources set one value, `DHPConfig.describe` says which won.

This module imports nothing heavy: the plugin and ``dhp-backend info`` use it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
from collections.abc import Mapping
from typing import Any

SECTION = "dhp"  # the key of DHP's section in vLLM's additional_config


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
# KV-cache dtypes the kernels read (vLLM's --kv-cache-dtype values): the backend declares them to vLLM,
# and the start-up check refuses the others before an engine starts.
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16")

# The one set of words a boolean setting accepts, in every source.
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")
BOOL_WORDS = _TRUE_WORDS + _FALSE_WORDS
_BOOL_ACCEPTED = ("a boolean: true/false, 1/0, yes/no or on/off (strings in any case; in JSON also the "
                  "literals true/false and the integers 1/0)")


def parse_bool(value: Any, *, source: str) -> bool:
    """A boolean setting: True/False, 1/0 (int, not float), or one of `BOOL_WORDS`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    raise ValueError(f"{source}: got {value!r}; accepted: {_BOOL_ACCEPTED}")


def parse_choice(value: Any, choices: tuple[str, ...], *, source: str, what: str) -> str:
    if isinstance(value, str) and value.strip().lower() in choices:
        return value.strip().lower()
    raise ValueError(f"{source}: unknown {what} {value!r}; accepted: {', '.join(map(repr, choices))}")


def _parse_policy(value: Any, source: str) -> Policy:
    return Policy.parse(value, source=source)


def _parse_path(value: Any, source: str) -> str:
    return parse_choice(value, PATHS, source=source, what="path")


def _parse_bool(value: Any, source: str) -> bool:
    return parse_bool(value, source=source)


def _parse_file(value: Any, source: str) -> str:
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ValueError(f"{source}: got {value!r}; accepted: a non-empty path")


def _parse_trace_file(value: Any, source: str) -> str:
    """The trace file, appended to by every process: checked here, at start-up, so that a wrong path is an
    error naming the setting rather than an OSError in an engine's first forward pass."""
    path = _parse_file(value, source)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{source}: {path!r} is a directory; accepted: a file path (appended to, created if missing)")
    if not os.path.isdir(parent):
        raise ValueError(f"{source}: the directory of {path!r} ({parent}) does not exist; accepted: a file path "
                         "in an existing, writable directory")
    if not os.access(path if os.path.exists(path) else parent, os.W_OK):
        raise ValueError(f"{source}: {path!r} is not writable; accepted: a file path in an existing, writable "
                         "directory")
    return path


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str      # key in additional_config["dhp"] and field of DHPConfig
    env: str       # environment variable that can set it
    default: Any
    parse: Any     # (value, source) -> parsed value; raises ValueError naming value and accepted ones
    accepted: str  # for docs and `dhp-backend info`
    doc: str
    engine: bool = True  # read by an engine once vLLM's config exists: additional_config may set it


SETTINGS: tuple[Setting, ...] = (
    Setting("policy", "DHP_POLICY", Policy.STRICT, _parse_policy,
            "strict, request, off",
            "what timing may reveal: strict = nothing beyond the step geometry (bucket L = "
            "max_model_len); request = each request's next power of two; off = true lengths "
            "(not constant-time; still deterministic and batch-invariant)"),
    Setting("allow_fallback", "DHP_ALLOW_FALLBACK", False, _parse_bool,
            "true/false",
            "accept the non-constant-time PyTorch reference path, under a constant-time policy, for "
            "shapes the kernels do not cover (otherwise the engine refuses to start)"),
    Setting("path", "DHP_PATH", "auto", _parse_path,
            ", ".join(PATHS),
            "force one implementation: 'triton' keeps every step on the Triton kernels (no csrc "
            "kernel: the Triton arithmetic, whose bits differ from the csrc kernels'), 'reference' on the "
            "PyTorch reference; an unsupported forced path "
            "is an error"),
    Setting("check_values", "DHP_CHECK_VALUES", False, _parse_bool,
            "true/false",
            "check every step's offsets, lengths, block ids and the address rule on the host before "
            "it runs (a device sync per layer; debugging only)"),
    Setting("trace_file", "DHP_TRACE_FILE", None, _parse_trace_file,
            "a file path",
            "append one JSON line per process the first time DHP's forward runs, and per kernel its "
            "steps ran on (tests use it to prove the worker ran DHP)"),
    Setting("deterministic", "DHP_DETERMINISTIC", False, _parse_bool,
            "true/false",
            "bitwise-reproducible outputs whatever the batch: DHP plus vLLM's batch-invariant mode, which "
            "vLLM reads from VLLM_BATCH_INVARIANT=1 before plugins load, so on a GPU the engine refuses to "
            "start without it and prints the command to use; vLLM's CPU platform cannot run that mode, so "
            "there the engine starts without it and says so (dhp_backend/vllm/startup_check.py)"),
    Setting("override_cpu_attn", "DHP_OVERRIDE_CPU_ATTN", False, _parse_bool,
            "true/false",
            "point vLLM's CPU_ATTN slot at DHP, so that a CPU engine runs it (testing aid: vLLM's CPU "
            "platform ignores --attention-backend; the CPU path is the reference, not constant-time)",
            engine=False),
    Setting("cuda_cache", "DHP_CUDA_CACHE", None, _parse_file,
            "a directory (default ~/.cache/dhp_backend/cuda)",
            "where the nvcc builds of the csrc kernels are cached", engine=False),
    Setting("csrc", "DHP_CSRC", None, _parse_file,
            "a directory (default the repository's csrc/)",
            "the CUDA sources of the csrc kernels", engine=False),
)
_BY_NAME = {s.name: s for s in SETTINGS}
KEYS = tuple(s.name for s in SETTINGS if s.engine)  # what additional_config["dhp"] accepts


def setting(name: str) -> Setting:
    return _BY_NAME[name]


def from_env(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """One setting from its environment variable (or its default), by the table's
    parser: for the settings read before vLLM's configuration exists."""
    s = _BY_NAME[name]
    env = os.environ if environ is None else environ
    raw = env.get(s.env)
    return s.default if raw in (None, "") else s.parse(raw, s.env)


def _nearest(word: str, options) -> str:
    close = difflib.get_close_matches(word.lower(), [o.lower() for o in options], n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def dhp_section(additional_config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """DHP's section of vLLM's additional_config, checked: a JSON object whose keys
    are settings. A near-miss section name (``DHP``, ``dhpp``, ``Dhp``) is an error,
    never silently ignored."""
    if additional_config is None:
        return {}
    if not isinstance(additional_config, Mapping):
        raise ValueError(f"additional_config: got {additional_config!r}; accepted: a JSON object such as "
                         f'{{"{SECTION}": {{"policy": "strict"}}}}')
    for key in additional_config:
        if key != SECTION and isinstance(key, str) and (
                key.lower() == SECTION or difflib.SequenceMatcher(None, key.lower(), SECTION).ratio() >= 0.8):
            raise ValueError(f"additional_config: section {key!r} is not DHP's; accepted: the lower-case key "
                             f"{SECTION!r}, e.g. '{{\"{SECTION}\": {{\"policy\": \"strict\"}}}}'")
    raw = additional_config.get(SECTION, {})
    if not isinstance(raw, Mapping):
        raise ValueError(f"additional_config['{SECTION}']: got {raw!r}; accepted: a JSON object such as "
                         '{"policy": "strict"}')
    env_only = [k for k in raw if k in _BY_NAME and not _BY_NAME[k].engine]
    if env_only:
        s = _BY_NAME[env_only[0]]
        raise ValueError(f"additional_config['{SECTION}']: key {s.name!r} is read before vLLM's configuration "
                         f"exists; accepted: the environment variable {s.env}, or the keys {', '.join(KEYS)}")
    unknown = [k for k in raw if k not in KEYS]
    if unknown:
        k = unknown[0]
        raise ValueError(f"additional_config['{SECTION}']: unknown key {k!r}{_nearest(str(k), KEYS)}; "
                         f"accepted: {', '.join(KEYS)}")
    return raw


@dataclasses.dataclass(frozen=True)
class DHPConfig:
    """Effective configuration of one process (the fields are `SETTINGS`).

    ``allow_fallback``: under a constant-time policy, a shape the kernels do not
    cover is refused at start-up, because the reference fallback is not
    constant-time. Setting this to true accepts the fallback (logged loudly).
    ``path``: ``auto`` lets the dispatcher choose; ``reference``/``triton``
    force one path (an unsupported forced path is an error, never a silent
    substitute). The other fields: `SETTINGS`.
    """

    policy: Policy = Policy.STRICT
    allow_fallback: bool = False
    path: str = "auto"
    check_values: bool = False
    trace_file: str | None = None
    deterministic: bool = False
    override_cpu_attn: bool = False
    cuda_cache: str | None = None
    csrc: str | None = None
    sources: tuple[str, ...] = ()  # where each non-default value came from, and what it overrode

    KEYS = KEYS

    @classmethod
    def from_sources(
        cls,
        additional_config: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> DHPConfig:
        env = os.environ if environ is None else environ
        section = dhp_section(additional_config)
        values: dict[str, Any] = {}
        sources = []
        for s in SETTINGS:
            from_env = None
            if env.get(s.env) not in (None, ""):
                # Checked even when additional_config wins: a bad value is an error wherever it is.
                from_env = s.parse(env[s.env], s.env)
            if s.name in section:
                values[s.name] = s.parse(section[s.name], f"additional_config['{SECTION}']['{s.name}']")
                note = f"{s.name} from additional_config"
                if from_env is not None:
                    note += f" (overrides {s.env}={env[s.env]!r})"
                sources.append(note)
            elif from_env is not None:
                values[s.name] = from_env
                sources.append(f"{s.name} from {s.env}")
            else:
                values[s.name] = s.default
        return cls(**values, sources=tuple(sources))

    def values(self) -> dict[str, Any]:
        """Every setting's effective value, in `SETTINGS` order (the policy by name)."""
        return {s.name: getattr(self, s.name).value if s.name == "policy" else getattr(self, s.name)
                for s in SETTINGS}

    def describe(self) -> str:
        src = f" ({'; '.join(self.sources)})" if self.sources else " (defaults)"
        return " ".join(f"{k}={v}" for k, v in self.values().items()) + src
