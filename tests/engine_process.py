"""Helpers for the tests that run vLLM in child processes (test_e2e_cpu_engine, test_e2e_throughput).

vLLM reads settings at import and backend overrides are per process, so each
generation is its own process. These give it a clean environment and run it in
a session of its own whose leftovers (an engine core, its workers) are ended
afterwards, with output to a file: no pipe that a stray child could hold open.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Settings a developer's shell may carry that would change which path the engine
# takes: the engine must take the path a user's CPU engine takes (the reference),
# not the Triton interpreter that the kernel test modules enable for themselves.
_DROPPED = ("TRITON_INTERPRET", "DHP_POLICY", "DHP_PATH", "DHP_ALLOW_FALLBACK", "DHP_OVERRIDE_CPU_ATTN",
            "VLLM_BATCH_INVARIANT")


def engine_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DROPPED}
    env.update({"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1",
                "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def run_in_session(cmd: list[str], env: dict, timeout: float = 900) -> tuple[int, str]:
    """Run ``cmd`` in its own session; return (exit code, output). Whatever is left
    of the session afterwards is ended."""
    with tempfile.TemporaryFile("w+") as log:
        proc = start_in_session(cmd, env, log)
        try:
            code = proc.wait(timeout=timeout)
        finally:
            end_session(proc)
        log.seek(0)
        return code, log.read()


def start_in_session(cmd: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def end_session(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, the whole session of ``proc`` (by its PID)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(0.5)
