"""The main job: end-to-end generation through vLLM with the DHP backend vs vLLM's own.

Builds the seeded tiny Llama (``integration/tiny_llama.py``) into ``.work/``,
runs the same greedy workload once with vLLM's built-in backend for the
platform and once with DHP (each in its own process), and prints the generated
token ids side by side, whether they match, the largest logprob difference,
and which backend, policy and path actually ran in vLLM's worker.

    python -m integration.demo [--policy strict] [--dtype float32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_backend(model: Path, backend: str, extra: list[str], log_dir: Path) -> dict:
    log = log_dir / f"generation-{backend}.log"
    cmd = [sys.executable, "-m", "integration.run_generation", "--model", str(model),
           "--backend", backend, *extra]
    print(f"  running {backend:7s} ... (log: {log.relative_to(ROOT)})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=1800)
    text = log.read_text()
    marker = "DHP_RESULT_JSON "
    if proc.returncode != 0 or marker not in text:
        tail = "\n".join(text.splitlines()[-30:])
        raise SystemExit(f"{backend} run failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    return json.loads(text.split(marker, 1)[1].splitlines()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default="strict", choices=["strict", "request", "off"])
    ap.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on GPU")
    ap.add_argument("--work-dir", default=str(ROOT / ".work"))
    a = ap.parse_args()

    import torch

    from integration.tiny_llama import build

    gpu = torch.cuda.is_available()
    dtype = a.dtype or ("bfloat16" if gpu else "float32")
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    print("DHP demo: seeded tiny Llama (4 q heads / 2 KV heads, head 64, 2 layers), "
          f"{'GPU' if gpu else 'CPU'} engine, {dtype}")
    model = build(work / "tiny-llama", seed=0)
    print(f"  checkpoint: {model.relative_to(ROOT) if model.is_relative_to(ROOT) else model}")
    extra = ["--dtype", dtype]
    native = run_backend(model, "native", extra, work)
    dhp = run_backend(model, "DHP", extra + ["--policy", a.policy], work)

    print()
    print(f"{'prompt':>6} {'cached':>6}  {'match':5}  {'max|dlogp|':>10}  tokens (native | DHP)")
    all_match, worst = True, 0.0
    for n, d in zip(native["outputs"], dhp["outputs"]):
        same = n["token_ids"] == d["token_ids"]
        diff = max((abs(x - y) for x, y in zip(n["logprobs"], d["logprobs"])), default=0.0)
        all_match &= same
        worst = max(worst, diff)
        print(f"{n['prompt_len']:>6} {str(d['num_cached_tokens']):>6}  {'yes' if same else 'NO':5}  "
              f"{diff:10.2e}  {n['token_ids'][:8]} | {d['token_ids'][:8]}")
    print()
    ran = {(t["backend"], t["policy"], t["path"]) for t in dhp["dhp_trace"]}
    native_name = "CPU_ATTN (vLLM built-in)" if native["platform"] == "cpu" else "vLLM's default (FLASH_ATTN on Hopper)"
    print(f"native backend : {native_name}, vLLM {native['vllm_version']}, {native['elapsed_s']} s")
    if ran:
        for backend, policy, path in sorted(ran):
            print(f"DHP backend    : ran in vLLM's worker (pids {sorted({t['pid'] for t in dhp['dhp_trace']})}): "
                  f"backend={backend} policy={policy} path={path}, {dhp['elapsed_s']} s")
    else:
        print("DHP backend    : DID NOT RUN in the worker (no trace) -- the engine fell back to another backend")
    print(f"greedy tokens  : {'identical' if all_match else 'DIFFERENT'} over {len(native['outputs'])} requests; "
          f"max |logprob difference| {worst:.2e}")
    ok = all_match and bool(ran)
    print("RESULT:", "OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
