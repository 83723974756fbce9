"""Helpers for the tests that run vLLM in child processes (test_e2e_cpu_engine, test_e2e_throughput,
test_server_gpu).

vLLM reads settings at import and backend overrides are per process, so each
generation is its own process. These give it a clean environment and run it in
a session of its own whose leftovers (an engine core, its workers) are ended
afterwards, with output to a file: no pipe that a stray child could hold open.
`serve` does the same for an HTTP server (vLLM's OpenAI-compatible one).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from dhp_backend.testing.golden import end_session  # SIGTERM, then SIGKILL, a child's whole session

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


def gpu_engine_env(**extra: str) -> dict:
    """`engine_env` on the GPU machine, whose vLLM comes on PYTHONPATH (gpu-stack): this checkout first."""
    return engine_env(PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
                      **extra)


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




# One line of a DHP start-up report in vLLM's log: vLLM's prefix (``(Worker pid=N) WARNING <date> <time>
# [report.py:L]``, the process part absent in a single-process engine) on every line of the record.
_REPORT_LINE = re.compile(r"^(?P<who>\([^)]*\) )?[A-Z]+ \S+ \S+ \[report\.py:\d+\] (?P<text>.*)$")


def startup_blocks(log: str) -> list[list[str]]:
    """The DHP start-up reports (`dhp_backend.vllm.report`) in an engine's log, each as its lines without
    vLLM's prefix; lines of different processes may interleave, so each is kept with its process."""
    current: dict[str, list[str]] = {}
    blocks = []
    for line in log.splitlines():
        m = _REPORT_LINE.match(line)
        if not m:
            continue
        who, text = m["who"] or "", m["text"]
        if text.startswith("DHP ") and " start-up report (" in text:
            current[who] = [text]
            blocks.append(current[who])
        elif who in current:
            current[who].append(text)
    return blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server started by `serve`: its process, base URL, log file and start-up time."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: Path):
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.startup_s: float | None = None

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server's log, for failure messages."""
        lines = self.log_path.read_text(errors="replace").splitlines()[-n:]
        return f"--- last {len(lines)} lines of {self.log_path}:\n" + "\n".join(lines)

    def wait_healthy(self, timeout: float) -> None:
        """Until ``GET /health`` answers 200; fails with the log's tail if the server exits or
        ``timeout`` seconds pass first."""
        t0 = time.time()
        while True:
            assert self.proc.poll() is None, f"server exited with code {self.proc.returncode}:\n" + self.tail()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        self.startup_s = time.time() - t0
                        return
            except OSError:
                pass
            assert time.time() - t0 < timeout, f"server did not come up within {timeout:.0f} s:\n" + self.tail()
            time.sleep(1)


@contextlib.contextmanager
def serve(cmd: list[str], env: dict, url: str, log_path: str | Path, start_timeout: float):
    """Start the HTTP server ``cmd`` (listening at ``url``) in its own session, output to
    ``log_path``; yield a `Server` once it is healthy. Its session is ended on the way out,
    whatever happened (by PID: `end_session`)."""
    log_path = Path(log_path)
    # Append mode: the child's writes always land at the end, even while `Server.tail` reads.
    with open(log_path, "a") as log:
        proc = start_in_session(cmd, env, log)
        try:
            server = Server(proc, url, log_path)
            server.wait_healthy(start_timeout)
            yield server
        finally:
            end_session(proc)
