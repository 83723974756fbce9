"""DHP's configuration checked where the user starts vLLM, before any engine process.

vLLM builds the attention layers (where the impl reads DHP's settings) inside
the worker, so a misspelled policy used to surface ~95 lines up a 50-frame
traceback whose last line was vLLM's "Engine core initialization failed". This
check runs in the process that parses the engine arguments: the plugin's
``register()`` runs there from ``EngineArgs.__post_init__`` (vLLM 0.24 and
0.32), and `install` wraps ``EngineArgs.create_engine_config`` so that, once
vLLM has built the ``VllmConfig``, an engine that will run DHP has its
configuration parsed by the same parser the worker uses (`DHPConfig`). A bad
value raises `DHPConfigError` there, the last thing the user sees. The worker's
own checks stay as a backstop.

Also said here, once: on vLLM's CPU platform ``--attention-backend DHP`` is
ignored (the platform always runs CPU_ATTN) unless ``DHP_OVERRIDE_CPU_ATTN=1``.
"""

from __future__ import annotations

import functools
import logging
import sys

from dhp_backend import config
from dhp_backend.config import KV_CACHE_DTYPES, DHPConfig

logger = logging.getLogger("dhp_backend")

_MARK = "_dhp_startup_check"


class DHPConfigError(ValueError):
    """DHP's configuration is malformed: the engine does not start."""


def check(vllm_config) -> DHPConfig | None:
    """Parse and check DHP's settings for an engine about to start; None when the
    engine does not run DHP. Raises `DHPConfigError` naming the bad value and the
    accepted ones."""
    from dhp_backend.vllm import compat

    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    asked_for_dhp = backend is not None and getattr(backend, "name", None) == "CUSTOM"
    if not (asked_for_dhp or compat.engine_runs_dhp(vllm_config)):
        return None
    try:
        cfg = DHPConfig.from_sources(getattr(vllm_config, "additional_config", None))
    except ValueError as exc:
        raise DHPConfigError(f"DHP configuration: {exc}") from None
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    if cache_dtype not in KV_CACHE_DTYPES:
        raise DHPConfigError(f"DHP configuration: --kv-cache-dtype {cache_dtype!r} is not supported by the DHP "
                             f"attention backend; accepted: {', '.join(KV_CACHE_DTYPES)}")
    if cfg.deterministic:
        _check_deterministic()
    if asked_for_dhp:
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and not cfg.override_cpu_attn:
            logger.warning(
                "DHP: --attention-backend DHP is ignored on vLLM's CPU platform, which always runs its own "
                "CPU_ATTN backend: this engine will NOT run DHP. To run DHP on a CPU (testing), set %s=1.",
                config.setting("override_cpu_attn").env)
    return cfg


def restart_command(argv: list[str] | None = None) -> str:
    """This process's command line with ``VLLM_BATCH_INVARIANT=1`` in front (what to run instead).

    ``vllm serve ...`` keeps its console script; a Python script (or ``python -m``,
    whose ``argv[0]`` is the module's file) gets the interpreter in front."""
    import shlex

    from dhp_backend.vllm import compat

    argv = list(sys.argv if argv is None else argv) or ["python"]
    if argv[0].endswith(".py") or argv[0] == "-c":
        argv = [sys.executable, *argv]
    return f"{compat.BATCH_INVARIANT_ENV}=1 " + shlex.join(argv)


def _check_deterministic() -> None:
    """``deterministic``: DHP (batch-invariant by construction) plus vLLM's batch-invariant
    mode for everything else (matmuls, norms, sampling). vLLM reads its switch before any
    plugin can set it (`compat.batch_invariant_enabled`), so it is required, not set. The mode the
    engine runs in is said once, in its start-up report (`dhp_backend.startup_report`)."""
    from vllm.platforms import current_platform

    from dhp_backend.vllm import compat

    env = compat.BATCH_INVARIANT_ENV
    on = compat.batch_invariant_enabled()
    if current_platform.is_cpu():
        if on:
            raise DHPConfigError(
                f"DHP configuration: deterministic=true with {env}=1 on vLLM's CPU platform: vLLM's "
                f"batch-invariant kernels are Triton GPU kernels and its CPU engine fails on its first step "
                f"with them; accepted: unset {env} (the CPU engine then runs without vLLM's mode)")
        return  # the engine's start-up report says what the mode covers there (startup_report)
    if not on:
        raise DHPConfigError(
            f"DHP configuration: deterministic=true needs vLLM's batch-invariant mode, which vLLM reads "
            f"from {env} before plugins load, so DHP cannot turn it on for this engine. Start it as: "
            f"{restart_command()}   (Python API: set os.environ['{env}'] = '1' before importing vllm)")


def _wrap(cls) -> None:
    original = cls.create_engine_config
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def create_engine_config(self, *args, **kwargs):
        vllm_config = original(self, *args, **kwargs)
        check(vllm_config)
        return vllm_config

    setattr(create_engine_config, _MARK, True)
    cls.create_engine_config = create_engine_config


def install() -> None:
    """Wrap ``EngineArgs.create_engine_config`` where vLLM's argument module is
    already loaded (the process that parses engine arguments: it is what called
    the plugin); elsewhere (engine core, workers) nothing is imported or changed."""
    module = sys.modules.get("vllm.engine.arg_utils")
    if module is None:
        return
    for name in ("EngineArgs", "AsyncEngineArgs"):
        cls = getattr(module, name, None)
        if cls is not None and "create_engine_config" in vars(cls):
            _wrap(cls)
