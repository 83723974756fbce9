"""End to end through vLLM on a GPU: DHP vs FLASH_ATTN, repeatability, batch invariance, graphs.

Runs on the GPU machine (vLLM 0.24 there, brought by shared/gpu-stack). Builds a
seeded random Llama (GQA 8 query / 2 KV heads, head size 128, 2 layers, bf16 at
run time) and runs each configuration in its own process:

  fa3          FLASH_ATTN, eager
  dhp          DHP (policy strict), eager
  dhp-again    the same again                         -> bitwise equal to dhp
  dhp-off      DHP policy off                         -> bitwise equal to dhp (policy never changes bits)
  dhp-graphs   DHP strict, default compile + CUDA graphs
  dhp-graphs-4k, dhp-off-graphs-4k  the same at max_model_len 4096, strict and off -> bitwise equal (the
               table's 8 splits put off's decode steps in split mode, which deals the splits from the true
               lengths, the dealing's table made once a step inside the graphs)
  bi-solo      VLLM_BATCH_INVARIANT=1, each prompt alone
  bi-reversed  VLLM_BATCH_INVARIANT=1, one batch in reverse order -> bitwise equal to bi-solo
  bi-off-solo, bi-off-reversed  the same pair under policy off (its prefill steps run on
               the csrc kernels) -> bitwise equal to each other and to bi-solo
  fa3-bi-...   the same pair for FLASH_ATTN, for comparison
  nobi-off-solo, nobi-off-reversed, fa3-solo, fa3-reversed  the solo/reversed pair
               WITHOUT VLLM_BATCH_INVARIANT (DHP off, FLASH_ATTN): reported, not required.
               DHP's attention is batch-invariant either way; whether the whole engine
               is depends on vLLM's GEMMs, which only its batch-invariant mode fixes.

Prints a table and writes every number to --out (JSON). Exit code 1 if a
bitwise check fails or DHP did not run.

    python -m integration.gpu_e2e [--only dhp,fa3] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {
    "fa3": (["--backend", "FLASH_ATTN"], {}),
    "dhp": (["--backend", "DHP", "--policy", "strict"], {}),
    "dhp-again": (["--backend", "DHP", "--policy", "strict"], {}),
    "dhp-off": (["--backend", "DHP", "--policy", "off"], {}),
    "dhp-graphs": (["--backend", "DHP", "--policy", "strict", "--eager", "0"], {}),
    "dhp-graphs-4k": (["--backend", "DHP", "--policy", "strict", "--eager", "0", "--max-model-len", "4096"], {}),
    "dhp-off-graphs-4k": (["--backend", "DHP", "--policy", "off", "--eager", "0", "--max-model-len", "4096"], {}),
    "bi-solo": (["--backend", "DHP", "--policy", "strict", "--batching", "solo"], {"VLLM_BATCH_INVARIANT": "1"}),
    "bi-reversed": (["--backend", "DHP", "--policy", "strict", "--batching", "reversed"],
                    {"VLLM_BATCH_INVARIANT": "1"}),
    "bi-off-solo": (["--backend", "DHP", "--policy", "off", "--batching", "solo"], {"VLLM_BATCH_INVARIANT": "1"}),
    "bi-off-reversed": (["--backend", "DHP", "--policy", "off", "--batching", "reversed"],
                        {"VLLM_BATCH_INVARIANT": "1"}),
    "fa3-bi-solo": (["--backend", "FLASH_ATTN", "--batching", "solo"], {"VLLM_BATCH_INVARIANT": "1"}),
    "fa3-bi-reversed": (["--backend", "FLASH_ATTN", "--batching", "reversed"], {"VLLM_BATCH_INVARIANT": "1"}),
    "nobi-off-solo": (["--backend", "DHP", "--policy", "off", "--batching", "solo"], {}),
    "nobi-off-reversed": (["--backend", "DHP", "--policy", "off", "--batching", "reversed"], {}),
    "fa3-solo": (["--backend", "FLASH_ATTN", "--batching", "solo"], {}),
    "fa3-reversed": (["--backend", "FLASH_ATTN", "--batching", "reversed"], {}),
}
BITWISE = [("dhp", "dhp-again"), ("dhp", "dhp-off"), ("bi-solo", "bi-reversed"), ("bi-off-solo", "bi-off-reversed"),
           ("bi-solo", "bi-off-solo"), ("dhp-graphs-4k", "dhp-off-graphs-4k")]
REPORT_ONLY = [("fa3", "dhp"), ("dhp", "dhp-graphs"), ("fa3-bi-solo", "fa3-bi-reversed"),
               ("nobi-off-solo", "nobi-off-reversed"), ("fa3-solo", "fa3-reversed")]


def runs_dhp(name: str) -> bool:
    """Whether the configuration asks for the DHP backend (read from CONFIGS, not from its name)."""
    args = CONFIGS[name][0]
    return args[args.index("--backend") + 1] == "DHP"


def log_file(log_dir, name) -> Path:
    """Where `run_one` writes the output of configuration ``name`` (vLLM's and its workers' logs)."""
    return Path(log_dir) / f"e2e-{name}.log"


def run_one(name, model, common, log_dir, config=None, timeout=900):
    """One `integration.run_generation` process; its parsed result, or None if it failed.

    ``config``: (extra arguments, extra environment), default ``CONFIGS[name]``. The
    process runs in a session of its own, ended afterwards: vLLM's engine core and
    workers must not outlive a run that timed out (they hold the GPUs' memory)."""
    from dhp_backend.testing.golden import end_session

    extra, env_extra = CONFIGS[name] if config is None else config
    env = {**os.environ, **env_extra, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "integration.run_generation", "--model", str(model), *common, *extra]
    log = log_file(log_dir, name)
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = f"timed out after {timeout:.0f} s"
        finally:
            end_session(proc)
    text = log.read_text(errors="replace")
    if code != 0 or "DHP_RESULT_JSON " not in text:
        print(f"[{name}] FAILED (exit {code}); last lines:\n" + "\n".join(text.splitlines()[-25:]), flush=True)
        return None
    res = json.loads(text.split("DHP_RESULT_JSON ", 1)[1].splitlines()[0])
    print(f"[{name}] ok in {time.time() - t0:.0f} s; DHP trace: "
          f"{sorted({(t['path'], t['policy']) for t in res['dhp_trace']})}, kernels "
          f"{sorted({t['kernel'] for t in res['dhp_trace'] if t.get('event') == 'kernel'})}", flush=True)
    return res


def compare(a, b):
    same_tokens = sum(x["token_ids"] == y["token_ids"] for x, y in zip(a["outputs"], b["outputs"]))
    bitwise = all(x["token_ids"] == y["token_ids"] and x["logprobs"] == y["logprobs"]
                  for x, y in zip(a["outputs"], b["outputs"]))
    diffs = [abs(p - q) for x, y in zip(a["outputs"], b["outputs"]) if x["token_ids"] == y["token_ids"]
             for p, q in zip(x["logprobs"], y["logprobs"])]
    # tokens agree up to the first divergence: count matching prefix positions
    agree = total = 0
    for x, y in zip(a["outputs"], b["outputs"]):
        for p, q in zip(x["token_ids"], y["token_ids"]):
            total += 1
            if p != q:
                break
            agree += 1
    return {"requests_same_tokens": f"{same_tokens}/{len(a['outputs'])}", "bitwise": bitwise,
            "prefix_token_agreement": round(agree / max(total, 1), 4),
            "max_abs_logprob_diff_on_same_tokens": max(diffs, default=0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(CONFIGS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--work-dir", default=str(ROOT / ".work"))
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()

    from integration.tiny_llama import build

    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model = build(work / "llama-gqa4-d128", seed=0, num_heads=8, num_kv_heads=2, head_size=128)
    common = ["--dtype", a.dtype, "--block-size", "16", "--max-model-len", "512",
              "--max-num-batched-tokens", "64", "--max-tokens", "16", "--allow-fallback", "0"]
    names = [n for n in a.only.split(",") if n]
    results = {n: run_one(n, model, common, work) for n in names}
    ok = True
    rows = []
    for x, y, must in [(x, y, True) for x, y in BITWISE] + [(x, y, False) for x, y in REPORT_ONLY]:
        if results.get(x) and results.get(y):
            c = compare(results[x], results[y])
            rows.append((x, y, must, c))
            ok &= (c["bitwise"] or not must)
        elif x in names and y in names:
            ok = False
    for n in names:
        r = results.get(n)
        if r is None:
            ok = False
        elif runs_dhp(n) and not r["dhp_trace"]:
            print(f"[{n}] DHP did not run in the worker", flush=True)
            ok = False

    print()
    print(f"{'pair':32} {'check':8} {'same-token reqs':>15} {'bitwise':>8} {'prefix agree':>12} {'max|dlogp|':>10}")
    for x, y, must, c in rows:
        print(f"{x + ' vs ' + y:32} {'must' if must else 'report':8} {c['requests_same_tokens']:>15} "
              f"{str(c['bitwise']):>8} {c['prefix_token_agreement']:>12} "
              f"{c['max_abs_logprob_diff_on_same_tokens']:>10.3e}")
    summary = {"ok": ok, "pairs": [{"a": x, "b": y, "must_be_bitwise": m, **c} for x, y, m, c in rows],
               "runs": {n: (None if r is None else {k: v for k, v in r.items() if k != "outputs"})
                        for n, r in results.items()}}
    if a.out:
        Path(a.out).write_text(json.dumps({**summary, "outputs": {n: r and r["outputs"]
                                                                  for n, r in results.items()}}, indent=1))
    print("RESULT:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
