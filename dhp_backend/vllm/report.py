"""This process's start-up report: DHP's facts collected as they arrive, one block emitted.

The facts arrive in different places of an engine's start-up:

- each attention layer's impl (`backend.DHPAttentionImpl`, while the worker
  loads the model): its shape and features, path, device memory, and the csrc
  libraries built or found for it (`record_layer`);
- the metadata builder's class, asked by the worker's model runner for its
  CUDA-graph support (`record_cuda_graphs`), before vLLM resolves the engine's
  CUDA-graph mode; then the builders are made (`worker_ready`);
- the scheduler, built by the engine core after the worker has profiled
  memory, allocated the KV cache and captured its graphs: the KV-page
  reservation and the KV cache's size (`scheduler_ready`,
  `reservation.after_scheduler_init`).

Which process prints what (one block each, `dhp_backend.startup_report.render`,
through the ``dhp_backend`` logger that the plugin routes into vLLM's handler):

- the worker lives in the engine core's process (vLLM's ``uni`` executor: one
  GPU; ``external_launcher``; a CPU engine without multiprocessing): one block
  with everything, printed when the scheduler is built;
- separate worker processes (``mp`` / ``ray`` executors: tensor parallelism, and
  vLLM's CPU platform with multiprocessing): each worker prints its layers,
  kernels and CUDA graphs when its metadata builders are made, and the engine
  core prints the reservation and capacity when its scheduler is built; each
  block says which facts the other one has;
- the process that parses the arguments (``vllm serve``'s API server, an
  ``LLM`` whose engine core runs in its own process) prints no block: it runs
  neither attention nor the scheduler (its configuration check,
  `startup_check`, stops a bad configuration there).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref

from dhp_backend import startup_report
from dhp_backend.vllm.logs import log_through_vllm
from dhp_backend.config import DHPConfig

logger = logging.getLogger("dhp_backend")

_LOCK = threading.Lock()
_LAYERS: dict = {}        # ProblemSpec -> {"path": PathChoice, "bytes": int, "builds": list, "count": int}
_CUDA_GRAPHS: dict = {}   # declared level name -> the path that decided it
# The engines (their VllmConfig) whose block this process printed: one block per engine, so a process
# that builds several engines in turn (in-process engines, run one after another) prints one for each.
# Weak references compared by identity (a VllmConfig is not hashable): a finished engine's config may
# go, and a new one may reuse its id().
_EMITTED: list = []

# Executors whose worker runs in the process that builds the scheduler (vLLM's names, 0.24 and 0.32).
_IN_PROCESS_EXECUTORS = ("uni", "external_launcher")


def record_layer(spec, path_choice, reserved_bytes: int, builds) -> None:
    """One attention layer, from its impl's constructor."""
    with _LOCK:
        entry = _LAYERS.setdefault(spec, {"path": path_choice, "bytes": int(reserved_bytes), "builds": list(builds),
                                          "count": 0})
        entry["count"] += 1


def record_cuda_graphs(level_name: str, path_name: str) -> None:
    """The CUDA-graph support the metadata builder declared (ALWAYS / NEVER) and the path that decided it."""
    with _LOCK:
        _CUDA_GRAPHS[level_name] = path_name


def worker_ready(vllm_config, device) -> None:
    """A metadata builder exists: the worker's facts are complete. Emits the block unless this process
    also builds the scheduler (which emits it then, with the reservation)."""
    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    if backend in _IN_PROCESS_EXECUTORS:
        return
    _emit(vllm_config, "worker", device=device, price=None,
          notes=("KV reservation and capacity: in the engine core's block (its scheduler reserves)",))


def scheduler_ready(vllm_config, price: dict | None) -> None:
    """The scheduler is built and its reservation installed: the engine core's facts are complete."""
    notes = () if price else ("KV reservation: none (this scheduler has no KV cache of vLLM's to reserve in)",)
    if _LAYERS:
        _emit(vllm_config, "engine core and worker", device=None, price=price, notes=notes)
    else:
        _emit(vllm_config, "engine core", device=None, price=price,
              notes=notes + ("layers, kernels and CUDA graphs: in each worker process's block (the "
                                     "workers run attention)",))


def _emit(vllm_config, role: str, *, device, price, notes) -> None:
    with _LOCK:
        _EMITTED[:] = [ref for ref in _EMITTED if ref() is not None]
        if any(ref() is vllm_config for ref in _EMITTED):
            return
        _EMITTED.append(weakref.ref(vllm_config))
        # The facts collected so far belong to this engine; a next engine in this process records its own.
        layers, graphs = dict(_LAYERS), dict(_CUDA_GRAPHS)
        _LAYERS.clear()
        _CUDA_GRAPHS.clear()
    log_through_vllm()  # an in-process engine's handlers may postdate the plugin's registration
    text = startup_report.render(build(vllm_config, role, layers, graphs, device, price, notes))
    with sibling_output_lock():
        # WARNING: the level of vLLM's own start-up notices, and what Python shows when no handler is configured
        logger.warning("%s", text)


@contextlib.contextmanager
def sibling_output_lock(directory: str | None = None):
    """Hold a lock shared with the other children of this process's parent while writing a block.

    The workers of a tensor-parallel engine build their metadata builders at the same moment, so
    they print their blocks together, and vLLM's worker prefix (``(Worker_TP1 pid=…)``) is written
    with a write call of its own before each line: unbuffered, two blocks printed at once mix
    within lines (seen at TP 2 on an H200: one rank's block lost its lines, the other's its first).
    An advisory ``flock`` on a file named after the parent's pid lets one block out at a time;
    streams are flushed before it is released. Where locking is not possible the block is
    written without it. The empty lock file stays in the temp directory: removing it would let a
    third rank lock a new file while the second still holds the old one.
    """
    import os
    import sys
    import tempfile

    try:
        import fcntl

        path = os.path.join(directory or tempfile.gettempdir(), f"dhp-report-{os.getuid()}-{os.getppid()}.lock")
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    except (ImportError, OSError):
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without locks: print unlocked
            yield
            return
        try:
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def build(vllm_config, role: str, layers: dict, graphs: dict, device, price, notes) -> startup_report.StartupReport:
    from vllm.platforms import current_platform

    from dhp_backend.vllm import compat

    cfg = DHPConfig.from_sources(vllm_config.additional_config)
    max_model_len = int(vllm_config.model_config.max_model_len)
    kinds = tuple(
        startup_report.LayerKind(spec=spec, path=e["path"].describe(), layers=e["count"],
                                 device_memory_bytes=e["bytes"],
                                 routes=startup_report.step_routes(spec, cfg, max_model_len, e["builds"],
                                                                   device=device))
        for spec, e in layers.items())
    cuda_graphs = None
    if graphs:
        mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
        cuda_graphs = startup_report.describe_cuda_graphs(graphs, getattr(mode, "name", str(mode)))
    where = f"{role} on {device}" if device is not None else role
    return startup_report.StartupReport(
        process=startup_report.process_label(where), config=cfg, max_model_len=max_model_len,
        vllm=".".join(map(str, compat.vllm_version())),
        deterministic=startup_report.describe_deterministic(cfg.deterministic,
                                                            batch_invariant=compat.batch_invariant_enabled(),
                                                            cpu=current_platform.is_cpu()),
        layer_kinds=kinds or None, cuda_graphs=cuda_graphs, reservation=price, notes=tuple(notes))
