"""Tensor parallelism with DHP through vLLM: every policy, each rank's log, deterministic bits, FLASH_ATTN.

Runs on a machine with (at least) ``--tp`` GPUs (vLLM 0.24 from gpu-stack, this
package installed), one vLLM engine per process as `integration.gpu_e2e` does;
every engine has ``tensor_parallel_size=--tp``. Parts (``--parts``, in this order):

  gen   DHP under each policy (strict, request, off) on two seeded checkpoints
        (`integration.tiny_llama`, head size 128, 2 layers): ``kv8`` (16 query / 8 KV
        heads: 8 / 4 per rank, whole GQA groups on each rank) and ``kv1`` (8 query / 1
        KV head: 4 / 1 per rank, vLLM replicates the KV head on every rank). Checks:
        every request generates; each rank's DHP trace names its own heads
        (`heads_per_rank`) and the policy; each rank prints one start-up report with
        the policy and a kernel per step kind, the same kernels as the other ranks
        (`check_rank_logs`); the three policies give
        the same bits (a policy never changes bits).
  fa3   FLASH_ATTN on ``kv8``: the same greedy tokens as DHP ``off`` (largest logprob
        difference reported).
  det   deterministic mode (the setting ``deterministic`` + VLLM_BATCH_INVARIANT=1,
        `dhp_backend.testing.golden.run_engine`) on ``kv8`` under ``--det-policy``, two
        engines, each running the prompts all at once, one at a time and reversed:
        the same token ids and logprob bits (``float.hex``) in all six.
  thr   throughput at TP = --tp, FLASH_ATTN vs DHP ``off`` in one run
        (`integration.e2e_throughput --tensor-parallel-size`, dummy weights,
        ``--throughput-model``: the Llama-3-8B shape by default).
  tp1   DHP ``off`` on ``kv8`` at TP 1 against TP --tp, reported only: the bits differ
        across TP sizes (the row-parallel matmuls reduce over other partial sums;
        attention per head does not change, tests/test_triton_interpret.py).

Progress goes to stdout; ``--out DIR`` gets ``tp_run.json`` and ``tp_run.md`` (written
again after every part) and one log per engine. The whole run keeps within
``--time-budget-s``: a part that cannot start is reported as skipped, which fails
the run. Exit code 0 when every required check passes, 1 otherwise, 2 for bad
arguments.

NVLink multicast stays off in every engine (`SAFE_ENV`): on a shared host a
program that uses it can take the GPUs out of service.

    python -m integration.tp_run --out /tmp/out/tp2 [--parts gen,fa3,det,thr,tp1] [--throughput-model tiny]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PARTS = ("gen", "fa3", "det", "thr", "tp1")
POLICIES = ("strict", "request", "off")
# The seeded checkpoints (integration.tiny_llama): name -> (query heads, KV heads).
MODELS = {"kv8": (16, 8), "kv1": (8, 1)}
HEAD_SIZE = 128
# run_generation's workload at a small token budget (chunked prefill, mixed steps), as gpu_e2e runs it.
GEN_ARGS = ["--dtype", "bfloat16", "--block-size", "16", "--max-model-len", "512", "--max-num-batched-tokens", "64",
            "--max-tokens", "16", "--allow-fallback", "0"]
# NVLink multicast off (the GPU host's rule, also for programs started with their own environment),
# and vLLM's symmetric-memory all-reduce off (it uses multicast on some world sizes).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
            "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
MIN_RUN_S = 45  # an engine run is not started with less of the budget left


class ConfigError(ValueError):
    pass


# --------------------------------------------------------------------------- what TP gives each rank

def heads_per_rank(num_heads: int, num_kv_heads: int, tp: int) -> tuple[int, int]:
    """The (query heads, KV heads) of each rank, by vLLM's rule (QKVParallelLinear,
    ModelConfig.get_num_kv_heads): query heads split evenly; KV heads split evenly when
    there are at least ``tp`` of them, else each rank holds one, replicated over
    ``tp // num_kv_heads`` ranks. ConfigError for a model vLLM cannot split."""
    if tp < 1:
        raise ConfigError(f"tensor parallel size {tp}; accepted: an integer >= 1")
    if num_heads % tp:
        raise ConfigError(f"{num_heads} query heads do not split over {tp} ranks; accepted: a multiple of {tp}")
    if num_kv_heads >= tp and num_kv_heads % tp or num_kv_heads < tp and tp % num_kv_heads:
        raise ConfigError(f"{num_kv_heads} KV heads over {tp} ranks; accepted: a multiple of {tp}, or a divisor "
                          f"of {tp} (replicated)")
    return num_heads // tp, max(1, num_kv_heads // tp)


# --------------------------------------------------------------------------- reading a run's logs

# vLLM 0.24 prefixes every line a worker writes with "(Worker_TP<rank> pid=<pid>) " once its
# parallel groups exist (multiproc_executor.setup_proc_title_and_log_prefix), which is before the
# model (and so DHP's attention layers) is built.
_RANK_LINE = re.compile(r"^\((?P<proc>Worker\w*?_TP(?P<rank>\d+)\w*) pid=(?P<pid>\d+)\)\s+"
                        r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+[^\[]*\[[^\]]*\]\s?)?(?P<msg>.*)$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# DHP's start-up report (dhp_backend/vllm/report.py): one block per process, its first line
# "DHP <version> start-up report (...)", the rest indented; a worker's block names its policy and the
# kernel of each step kind with its build state.
REPORT_START = re.compile(r"^DHP \S+ start-up report \(")
POLICY_LINE = "policy: "
STEP_LINE = re.compile(r"^(?P<kind>decode|prefill|mixed) steps:\s+(?P<kernel>\w+):")


def rank_logs(text: str) -> dict[int, dict]:
    """Per rank: its worker pids, the DHP lines it logged (messages without vLLM's prefix) and its
    start-up report blocks (each a list of its lines, stripped)."""
    ranks: dict[int, dict] = {}
    for raw in text.splitlines():
        m = _RANK_LINE.match(_ANSI.sub("", raw).rstrip())
        if not m:
            continue
        r = ranks.setdefault(int(m.group("rank")), {"pids": set(), "dhp": [], "blocks": [], "open": None})
        pid, msg = int(m.group("pid")), m.group("msg")
        r["pids"].add(pid)
        if REPORT_START.match(msg):
            r["blocks"].append([msg.strip()])
            r["open"] = pid
        elif msg.startswith("  ") and r["open"] == pid:
            r["blocks"][-1].append(msg.strip())
        else:
            r["open"] = None
        if msg.startswith("DHP"):
            r["dhp"].append(msg.strip())
    for r in ranks.values():
        del r["open"]
    return ranks


def check_rank_logs(text: str, tp: int, policy: str) -> dict:
    """Each rank prints one start-up report, naming ``policy`` and a kernel per step kind; every
    rank names the same kernels."""
    ranks = rank_logs(text)
    problems = []
    if sorted(ranks) != list(range(tp)):
        problems.append(f"worker lines of ranks {sorted(ranks)}; expected ranks 0..{tp - 1}")
    per_rank = {}
    for r in range(tp):
        got = ranks.get(r, {"dhp": [], "pids": set(), "blocks": []})
        blocks = got["blocks"]
        kernels: list[str] = []
        if len(blocks) != 1:
            problems.append(f"rank {r}: {len(blocks)} start-up reports; expected 1")
        else:
            block = blocks[0]
            policies = [line for line in block if line.startswith(POLICY_LINE)]
            if not policies or not policies[0].startswith(f"{POLICY_LINE}{policy};"):
                problems.append(f"rank {r}: start-up report without policy {policy}: {policies}")
            kernels = sorted(f"{m.group('kind')}:{m.group('kernel')}" for m in map(STEP_LINE.match, block) if m)
            if sorted(k.split(":")[0] for k in kernels) != ["decode", "mixed", "prefill"]:
                problems.append(f"rank {r}: start-up report names kernels {kernels}; expected one per step kind")
        per_rank[r] = {"pids": sorted(got["pids"]), "report": blocks[0] if len(blocks) == 1 else blocks,
                       "kernels": kernels, "dhp_lines": got["dhp"]}
    kernel_sets = {tuple(v["kernels"]) for v in per_rank.values()}
    if len(kernel_sets) > 1:
        problems.append(f"ranks name different kernels: {sorted(kernel_sets)}")
    return {"ok": not problems, "problems": problems, "ranks": per_rank}


def check_rank_trace(trace: list[dict], tp: int, heads: tuple[int, int], policy: str,
                     pid_rank: dict[int, int] | None = None) -> dict:
    """DHP's trace (one ``forward`` event per process, ``kernel`` events per kernel kind): ``tp``
    processes ran DHP, each with ``heads`` (query, KV) and ``policy``, and all on the same kernels."""
    problems = []
    forward = [e for e in trace if e.get("event") == "forward"]
    pids = sorted({e["pid"] for e in forward})
    if len(pids) != tp:
        problems.append(f"{len(pids)} processes ran DHP's forward; expected {tp} (one per rank)")
    for e in forward:
        got = (e.get("num_heads"), e.get("num_kv_heads"))
        if got != tuple(heads):
            problems.append(f"pid {e['pid']}: (query, KV) heads {got}; expected {tuple(heads)} per rank")
        if e.get("policy") != policy:
            problems.append(f"pid {e['pid']}: ran policy {e.get('policy')!r}; asked for {policy!r}")
    kernels = {pid: sorted({str(e.get("kernel")) for e in trace if e.get("event") == "kernel" and e["pid"] == pid})
               for pid in pids}
    if len({tuple(k) for k in kernels.values()}) > 1:
        problems.append(f"ranks ran different kernels: {kernels}")
    pid_rank = pid_rank or {}
    per_rank = {str(pid_rank.get(pid, f"pid {pid}")): {"pid": pid, "kernels": kernels[pid],
                                                       "heads": sorted({(e.get("num_heads"), e.get("num_kv_heads"))
                                                                        for e in forward if e["pid"] == pid})}
                for pid in pids}
    return {"ok": not problems, "problems": problems, "ranks": per_rank}


# --------------------------------------------------------------------------- comparing bits

def first_difference(reference: list[dict], outputs: list[dict]) -> str | None:
    """None when every token id and logprob bit is equal, else the first difference in words.

    Entries: ``{"token_ids": [...], "logprobs": [...]}``, logprobs as floats (run_generation)
    or ``float.hex`` strings (golden_run): compared as ``float.hex``, bit for bit."""
    from dhp_backend.testing import golden

    if len(reference) != len(outputs):
        return f"{len(outputs)} outputs; the reference has {len(reference)}"

    def hexed(o):
        return {"token_ids": list(o["token_ids"]),
                "logprobs": [lp if isinstance(lp, str) else float(lp).hex() for lp in o["logprobs"]]}

    ref = [{"id": str(i), "steps": [[t, lp] for t, lp in zip(h["token_ids"], h["logprobs"])]}
           for i, h in enumerate(map(hexed, reference))]
    diff = golden.compare(ref, [hexed(o) for o in outputs])
    return None if diff is None else diff.describe()


# --------------------------------------------------------------------------- the report

def check(name: str, part: str, ok: bool | None, detail: str = "", required: bool = True) -> dict:
    """One line of the report; ``ok`` None: not run (skipped), which fails a required check."""
    return {"name": name, "part": part, "required": required, "ok": ok, "detail": detail}


def overall_ok(checks: list[dict]) -> bool:
    return bool(checks) and all(c["ok"] is True for c in checks if c["required"])


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown(report: dict) -> str:
    h = report["header"]
    lines = [f"# Tensor parallelism: DHP at TP = {h['tp']} through vLLM ({h['devices']}, vLLM {h['vllm_version']})",
             "", f"{h['date']}, commit {h['git_commit']}, {h['wall_s']:.0f} s of a {h['time_budget_s']:.0f} s budget. "
             f"**{'OK' if report['ok'] else 'FAILED'}**.", "",
             "| check | part | required | result | detail |", "|---|---|---|---|---|"]
    for c in report["checks"]:
        result = {True: "pass", False: "FAIL", None: "not run"}[c["ok"]]
        lines.append(f"| {c['name']} | {c['part']} | {'yes' if c['required'] else 'report'} | {result} "
                     f"| {_cell(c['detail'])[:300]} |")
    runs = report.get("runs", {})
    if runs:
        lines += ["", "| run | model | backend | policy | TP | status | wall s | heads per rank | kernels per rank |",
                  "|---|---|---|---|---:|---|---:|---|---|"]
        for name, r in runs.items():
            ranks = (r.get("trace") or {}).get("ranks", {})
            heads = "; ".join(f"{k}: {v['heads']}" for k, v in ranks.items()) or "-"
            kernels = "; ".join(f"{k}: {','.join(v['kernels']) or '-'}" for k, v in ranks.items()) or "-"
            lines.append(f"| {name} | {r.get('model', '-')} | {r.get('backend', '-')} | {r.get('policy') or '-'} "
                         f"| {r.get('tp', '-')} | {_cell(r.get('status', '-'))[:120]} | {r.get('wall_s', 0):.0f} "
                         f"| {_cell(heads)} | {_cell(kernels)} |")
    thr = report.get("throughput")
    if thr:
        lines += ["", f"Throughput at TP = {h['tp']} ({_cell(thr.get('workload', ''))}):", "",
                  "| config | status | output tok/s | total tok/s | vs fa3 |", "|---|---|---:|---:|---:|"]
        for r in thr.get("rows", []):
            def num(v, spec):
                return "-" if v is None else format(v, spec)
            lines.append(f"| {r['config']} | {_cell(r['status'])[:120]} | {num(r.get('output_tok_per_s'), ',.0f')} "
                         f"| {num(r.get('total_tok_per_s'), ',.0f')} | {num(r.get('ratio'), '.3f')} |")
    lines += ["", *("- " + n for n in h.get("notes", [])), ""]
    return "\n".join(lines)


def write_report(out_dir: Path, report: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "tp_run.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
    tmp.replace(out_dir / "tp_run.json")
    (out_dir / "tp_run.md").write_text(markdown(report))


def _devices() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout.split("\n")
        names = [n.strip() for n in out if n.strip()]
        return f"{len(names)} x {names[0]}" if names and len(set(names)) == 1 else ", ".join(names) or "no GPU"
    except (OSError, subprocess.SubprocessError):
        return "no GPU"


# --------------------------------------------------------------------------- the GPU run

class Run:
    """The state of one tp_run: its budget, checks, runs, and the report written after each part."""

    def __init__(self, args: argparse.Namespace):
        from integration.e2e_throughput import git_commit

        self.args = args
        self.out = Path(args.out)
        self.logs = self.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.t0 = time.time()
        self.deadline = self.t0 + args.time_budget_s
        self.checks: list[dict] = []
        self.runs: dict[str, dict] = {}
        self.throughput: dict | None = None
        self.header = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "tp": args.tp,
                       "devices": _devices(), "vllm_version": _vllm_version(), "git_commit": git_commit(),
                       "command": " ".join(["python", "-m", "integration.tp_run", *sys.argv[1:]]),
                       "parts": args.parts, "time_budget_s": args.time_budget_s, "wall_s": 0.0,
                       "models": {k: {"num_heads": h, "num_kv_heads": kv, "head_size": HEAD_SIZE, "layers": 2,
                                      "per_rank": heads_per_rank(h, kv, args.tp)} for k, (h, kv) in MODELS.items()},
                       "notes": ["bits across TP sizes are not expected to be equal: the row-parallel matmuls "
                                 "(attention output, MLP down projection) sum partial products across ranks; "
                                 "attention per head is unchanged (tests/test_triton_interpret.py)",
                                 f"engines run with {' '.join(f'{k}={v}' for k, v in SAFE_ENV.items())}"]}

    def left(self) -> float:
        return self.deadline - time.time()

    def say(self, text: str) -> None:
        print(f"[tp_run +{time.time() - self.t0:4.0f} s] {text}", flush=True)

    def add(self, c: dict) -> None:
        self.checks.append(c)
        result = {True: "pass", False: "FAIL", None: "not run"}[c["ok"]]
        self.say(f"check {c['name']}: {result}" + (f" ({c['detail'][:240]})" if c["detail"] else ""))

    def save(self) -> None:
        self.header["wall_s"] = round(time.time() - self.t0, 1)
        write_report(self.out, {"ok": overall_ok(self.checks), "header": self.header, "checks": self.checks,
                                "runs": self.runs, "throughput": self.throughput})

    def model(self, name: str) -> Path:
        from integration.tiny_llama import build

        h, kv = MODELS[name]
        return build(Path(self.args.work_dir) / f"tp-llama-h{h}-kv{kv}-d{HEAD_SIZE}", seed=0, num_heads=h,
                     num_kv_heads=kv, head_size=HEAD_SIZE)

    def generate(self, name: str, model: str, backend: str, policy: str | None, tp: int) -> dict | None:
        """One run_generation engine (`gpu_e2e.run_one`); its result with the per-rank checks, or None."""
        from integration import gpu_e2e

        if self.left() < MIN_RUN_S:
            self.runs[name] = {"model": model, "backend": backend, "policy": policy, "tp": tp,
                               "status": "skipped: time budget", "wall_s": 0.0}
            self.say(f"{name}: skipped ({self.left():.0f} s of the budget left)")
            return None
        extra = ["--backend", backend, "--tensor-parallel-size", str(tp)] + (["--policy", policy] if policy else [])
        self.say(f"{name}: {backend}{' ' + policy if policy else ''} on {model} at TP {tp} ...")
        t0 = time.time()
        res = gpu_e2e.run_one(name, self.model(model), GEN_ARGS, self.logs, config=(extra, SAFE_ENV),
                              timeout=min(self.left(), 600))
        run = {"model": model, "backend": backend, "policy": policy, "tp": tp, "wall_s": round(time.time() - t0, 1),
               "log": str(gpu_e2e.log_file(self.logs, name)), "status": "ok" if res else "failed (see its log)"}
        if res and backend == "DHP":
            text = gpu_e2e.log_file(self.logs, name).read_text(errors="replace")
            logs = check_rank_logs(text, tp, policy)
            pid_rank = {pid: int(r) for r, v in logs["ranks"].items() for pid in v["pids"]}
            run["logs"] = logs
            run["trace"] = check_rank_trace(res["dhp_trace"], tp, heads_per_rank(*MODELS[model], tp), policy, pid_rank)
        if res:
            run["outputs"] = res["outputs"]
            lengths = {len(o["token_ids"]) for o in res["outputs"]}
            if lengths != {int(GEN_ARGS[GEN_ARGS.index("--max-tokens") + 1])}:
                run["status"] = f"wrong output lengths {sorted(lengths)}"
        self.runs[name] = run
        self.save()
        return run if run["status"] == "ok" else None

    # ---- parts

    def part_gen(self) -> None:
        for model in MODELS:
            for policy in POLICIES:
                name = f"gen-{model}-{policy}"
                run = self.generate(name, model, "DHP", policy, self.args.tp)
                if run is None:
                    self.add(check(name, "gen", None if "skipped" in self.runs[name]["status"] else False,
                                   self.runs[name]["status"]))
                    continue
                problems = run["trace"]["problems"] + run["logs"]["problems"]
                self.add(check(name, "gen", not problems, "; ".join(problems) or (
                    f"{len(run['outputs'])} requests generated; per rank (query, KV) heads "
                    f"{heads_per_rank(*MODELS[model], self.args.tp)}; kernels "
                    f"{next(iter(run['trace']['ranks'].values()), {}).get('kernels')}; csrc lines per rank "
                    f"{run['logs']['ranks'].get(0, {}).get('kernels')}")))
            done = [p for p in POLICIES if self.runs.get(f"gen-{model}-{p}", {}).get("outputs")]
            if len(done) == len(POLICIES):
                ref = self.runs[f"gen-{model}-{POLICIES[0]}"]["outputs"]
                diffs = {p: first_difference(ref, self.runs[f"gen-{model}-{p}"]["outputs"]) for p in POLICIES[1:]}
                bad = {p: d for p, d in diffs.items() if d}
                self.add(check(f"policies-same-bits-{model}", "gen", not bad,
                               "; ".join(f"{POLICIES[0]} vs {p}: {d}" for p, d in bad.items())
                               or f"{', '.join(POLICIES)}: equal token ids and logprob bits"))
            else:
                self.add(check(f"policies-same-bits-{model}", "gen", None, "not every policy generated"))

    def part_fa3(self) -> None:
        from integration.gpu_e2e import compare

        run = self.generate("fa3-kv8", "kv8", "FLASH_ATTN", None, self.args.tp)
        dhp = self.runs.get("gen-kv8-off", {}).get("outputs")
        if dhp is None and run is not None and "gen" not in self.args.parts:
            dhp_run = self.generate("gen-kv8-off", "kv8", "DHP", "off", self.args.tp)
            dhp = dhp_run and dhp_run["outputs"]
        if run is None or dhp is None:
            self.add(check("fa3-vs-dhp-off-tokens", "fa3", None if run is None and self.left() < MIN_RUN_S else False,
                           "a run is missing (FLASH_ATTN or DHP off)"))
            return
        c = compare({"outputs": dhp}, {"outputs": run["outputs"]})
        same = c["requests_same_tokens"].split("/")
        self.add(check("fa3-vs-dhp-off-tokens", "fa3", same[0] == same[1],
                       f"same greedy tokens in {c['requests_same_tokens']} requests, prefix agreement "
                       f"{c['prefix_token_agreement']}, largest |logprob difference| on equal tokens "
                       f"{c['max_abs_logprob_diff_on_same_tokens']:.3e}, bitwise {c['bitwise']}"))
        self.runs["fa3-kv8"]["vs_dhp_off"] = c

    def part_det(self) -> None:
        from dhp_backend.testing import golden
        from integration.run_generation import make_prompts

        first, second = make_prompts()
        prompts = [{"prompt_token_ids": p} for p in first + second]
        n = len(prompts)
        max_tokens = int(GEN_ARGS[GEN_ARGS.index("--max-tokens") + 1])
        spec = {"model": str(self.model("kv8")), "prompts": prompts,
                "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "seed": None},
                "engine": {"tensor_parallel_size": self.args.tp, "seed": 0, "dtype": "bfloat16", "max_model_len": 512,
                           "block_size": 16, "max_num_batched_tokens": 64, "max_num_seqs": n, "enforce_eager": True,
                           "enable_prefix_caching": False, "gpu_memory_utilization": 0.3},
                "engine_cli": [],
                "dhp": {"deterministic": True, "policy": self.args.det_policy, "allow_fallback": False},
                "schedules": [{"name": "together", "batches": [list(range(n))]},
                              {"name": "solo", "batches": [[i] for i in range(n)]},
                              {"name": "reversed", "batches": [list(reversed(range(n)))]}]}
        results = []
        for i in (1, 2):
            name = f"det-kv8-{self.args.det_policy}-{i}"
            if self.left() < MIN_RUN_S:
                self.runs[name] = {"model": "kv8", "backend": "DHP", "policy": self.args.det_policy,
                                   "tp": self.args.tp, "status": "skipped: time budget", "wall_s": 0.0}
                self.say(f"{name}: skipped ({self.left():.0f} s of the budget left)")
                break
            self.say(f"{name}: deterministic mode, {n} prompts together, solo, reversed ...")
            t0 = time.time()
            try:
                res = golden.run_engine(spec, environ={**os.environ, **SAFE_ENV}, timeout=min(self.left(), 600))
                status = "ok"
            except golden.GoldenError as exc:
                res, status = None, f"failed: {exc}"
            self.runs[name] = {"model": "kv8", "backend": "DHP", "policy": self.args.det_policy, "tp": self.args.tp,
                               "status": status, "wall_s": round(time.time() - t0, 1),
                               "fingerprint": res and res["fingerprint"], "results": res and res["results"]}
            self.save()
            if res is None:
                break
            results.append(res["results"])
        if len(results) < 2:
            failed = any(v["status"].startswith("failed") for k, v in self.runs.items() if k.startswith("det-"))
            self.add(check("det-same-bits", "det", False if failed else None,
                           "; ".join(f"{k}: {v['status'][:600]}" for k, v in self.runs.items() if k.startswith("det-"))))
            return
        ref = results[0]["together"]
        diffs = {f"run {i + 1} {s}": first_difference(ref, r[s]) for i, r in enumerate(results)
                 for s in ("together", "solo", "reversed") if (i, s) != (0, "together")}
        bad = {k: d for k, d in diffs.items() if d}
        self.add(check("det-same-bits", "det", not bad, "; ".join(f"{k}: {d}" for k, d in bad.items()) or (
            f"run 1 together = {', '.join(diffs)}: equal token ids and logprob float.hex "
            f"({n} prompts x {max_tokens} tokens)")))

    def part_thr(self) -> None:
        left = self.left() - (MIN_RUN_S if "tp1" in self.args.parts else 0)
        out = self.out / "throughput.json"
        cmd = [sys.executable, "-m", "integration.e2e_throughput", "--device", "cuda", "--configs", "fa3,dhp-off",
               "--tensor-parallel-size", str(self.args.tp), "--model-config", self.args.throughput_model,
               *self.args.throughput_args.split(), "--time-budget-s", str(int(max(left, 1))), "--out", str(out)]
        if left < 2 * MIN_RUN_S:
            self.add(check("throughput", "thr", None, f"skipped: {left:.0f} s of the budget left"))
            return
        self.say(f"throughput: FLASH_ATTN vs DHP off at TP {self.args.tp}, {self.args.throughput_model} ...")
        env = {**os.environ, **SAFE_ENV,
               "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(
                   os.pathsep) if p])}
        with open(self.logs / "throughput.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=left + 60)
            except subprocess.TimeoutExpired:
                pass
            finally:
                from dhp_backend.testing.golden import end_session

                end_session(proc)
        if not out.exists():
            self.add(check("throughput", "thr", False, f"no report; see {self.logs / 'throughput.log'}"))
            return
        report = json.loads(out.read_text())
        w = report["header"]["workload"]
        rows = [{"config": r["config"], "status": r["status"], "output_tok_per_s": r.get("output_tok_per_s"),
                 "total_tok_per_s": r.get("total_tok_per_s"), "ratio": report["ratios"][r["config"]]["ratio"]}
                for r in report["results"]]
        self.throughput = {"rows": rows, "report": str(out), "workload": (
            f"{w['model_config']}, dummy weights, {w['num_requests']} requests, prompts {w['prompt_len'][0]}.."
            f"{w['prompt_len'][1]}, {w['output_len']} output tokens, max_model_len {w['max_model_len']}, "
            f"graphs {w['cudagraph']}")}
        ok = {r["config"]: r for r in rows if r["status"] == "ok"}
        ratio = ok.get("dhp-off", {}).get("ratio")
        self.add(check("throughput", "thr", len(ok) == 2, "; ".join(
            f"{r['config']}: {r['status'][:200]}" + (f", {r['output_tok_per_s']:,.0f} output tok/s"
                                                      if r.get("output_tok_per_s") else "") for r in rows)
            + (f"; DHP off / FLASH_ATTN = {ratio:.3f}" if ratio else "")))

    def part_tp1(self) -> None:
        from integration.gpu_e2e import compare

        run = self.generate("tp1-kv8-off", "kv8", "DHP", "off", 1)
        tp = self.runs.get("gen-kv8-off", {}).get("outputs")
        if run is None or tp is None:
            self.add(check("tp1-vs-tp", "tp1", None, "a run is missing (DHP off at TP 1 or at TP --tp)",
                           required=False))
            return
        c = compare({"outputs": run["outputs"]}, {"outputs": tp})
        self.add(check("tp1-vs-tp", "tp1", True, f"TP 1 vs TP {self.args.tp}: bitwise {c['bitwise']}, same tokens "
                       f"in {c['requests_same_tokens']} requests, largest |logprob difference| "
                       f"{c['max_abs_logprob_diff_on_same_tokens']:.3e} (expected: not bitwise)", required=False))


def _vllm_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- CLI

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for tp_run.json, tp_run.md and the engines' logs")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--tp", type=int, default=2, help="tensor_parallel_size of every engine (default 2)")
    ap.add_argument("--det-policy", default="strict", choices=POLICIES, help="the policy of the deterministic runs")
    ap.add_argument("--throughput-model", default="llama3-8b",
                    help="e2e_throughput --model-config: llama3-8b (default) or tiny")
    ap.add_argument("--throughput-args", default="--num-requests 128 --min-prompt 128 --max-prompt 1024 "
                                                 "--output-len 128 --max-model-len 8192 "
                                                 "--max-cudagraph-capture-size 128",
                    help="more integration.e2e_throughput arguments (the workload)")
    ap.add_argument("--time-budget-s", type=float, default=450, help="the whole run, seconds (default 450)")
    ap.add_argument("--work-dir", default=str(ROOT / ".work"), help="where the seeded checkpoints are built")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked (ConfigError naming what is wrong and what is accepted)."""
    from integration.e2e_throughput import MODEL_CONFIGS

    args = parser().parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise ConfigError(f"--parts {args.parts!r}: unknown part {unknown[0]!r}; accepted: {', '.join(PARTS)}"
                          if unknown else f"--parts: none named; accepted: {', '.join(PARTS)}")
    args.parts = [p for p in PARTS if p in parts]  # the documented order, whatever the order given
    if args.tp < 2:
        raise ConfigError(f"--tp {args.tp}; accepted: an integer >= 2 (this is the tensor-parallel run)")
    for name, (h, kv) in MODELS.items():
        try:
            heads_per_rank(h, kv, args.tp)
        except ConfigError as exc:
            raise ConfigError(f"--tp {args.tp}: checkpoint {name}: {exc}") from None
    if args.throughput_model not in MODEL_CONFIGS:
        raise ConfigError(f"--throughput-model {args.throughput_model!r}; accepted: {', '.join(MODEL_CONFIGS)}")
    shape = MODEL_CONFIGS[args.throughput_model]
    try:
        heads_per_rank(shape["num_attention_heads"], shape["num_key_value_heads"], args.tp)
    except ConfigError as exc:
        raise ConfigError(f"--throughput-model {args.throughput_model} at --tp {args.tp}: {exc}") from None
    if args.time_budget_s <= 0:
        raise ConfigError(f"--time-budget-s {args.time_budget_s}; accepted: seconds > 0")
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
    except ConfigError as exc:
        print(f"tp_run: error: {exc}", file=sys.stderr)
        return 2
    run = Run(args)
    run.say(f"TP {args.tp} on {run.header['devices']}, parts {', '.join(args.parts)}, budget "
            f"{args.time_budget_s:.0f} s; report in {run.out}")
    for part in args.parts:
        getattr(run, f"part_{part}")()
        run.save()
    run.save()
    ok = overall_ok(run.checks)
    print(markdown({"ok": ok, "header": run.header, "checks": run.checks, "runs": run.runs,
                    "throughput": run.throughput}), flush=True)
    run.say(f"RESULT: {'OK' if ok else 'FAILED'}; wrote {run.out / 'tp_run.json'} and {run.out / 'tp_run.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
