"""Golden outputs: record a model's tokens and logprob bits once, check them bitwise under any batching.

    from dhp_backend.testing import golden
    g = golden.record("path/to/model", golden.read_prompts("prompts.jsonl"), out="golden.json")
    result = golden.check(golden.load("golden.json"), "path/to/model", batch_size=16, shuffle=True,
                          max_num_batched_tokens=64)
    assert result.exit_code == golden.EXIT_EQUAL, result.message

(``dhp-backend golden record|check|selfcheck`` is the same from a shell; the
pytest plugin `dhp_backend.testing.pytest_plugin` wraps it in a fixture.)

Each run is one vLLM engine in a child process (`golden_run`) with DHP in
deterministic mode (`dhp_backend.config`, ``deterministic``): vLLM reads its
batch-invariant switch at import, so the child's environment carries it.
Greedy by default; seeded sampling is allowed (``temperature`` and ``seed``).

The golden file is JSON, diff-friendly: prompts sorted by id, one generated
token per line as ``[token id, logprob as float.hex]``, and a header
``fingerprint`` of everything that decides the bits (versions, device, dtype,
the model's files, sampling parameters, DHP's settings, the kernels that ran).
A check whose fingerprint differs is not a regression (another GPU or vLLM
version may round differently): it is reported as such (`EXIT_FINGERPRINT`)
unless the caller asks to compare anyway.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

FORMAT = "dhp-golden/1"

# Exit codes of `dhp-backend golden` (and `CheckResult.exit_code`).
EXIT_EQUAL = 0        # every token and every logprob bit equal (selfcheck: every invariance holds for DHP)
EXIT_DIFFERENT = 1    # some token or logprob bit differs: the first difference is printed
EXIT_BAD_INPUT = 2    # a missing or malformed model, prompts file, golden file or argument
EXIT_FINGERPRINT = 3  # recorded elsewhere (versions, device, dtype, model files, ...): not compared
EXIT_ENGINE = 4       # the engine failed to run (its output says why)

PROMPT_KEYS = ("id", "prompt", "prompt_token_ids")
# The model's files whose bytes decide the bits: configuration, tokenizer, weights.
MODEL_FILE_PATTERNS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                       "*.safetensors", "*.bin", "*.pt")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.pt")


class GoldenError(Exception):
    """Golden testing could not run; ``exit_code`` says why (`EXIT_BAD_INPUT`, `EXIT_ENGINE`)."""

    exit_code = EXIT_BAD_INPUT


class BadInput(GoldenError):
    exit_code = EXIT_BAD_INPUT


class EngineFailed(GoldenError):
    exit_code = EXIT_ENGINE


# --- inputs ---------------------------------------------------------------------------------------


def _id_key(pid: str):
    """Prompt ids sort numerically when they are numbers, else as text (numbers first)."""
    return (0, int(pid), "") if pid.isdigit() else (1, 0, pid)


def read_prompts(path: str | os.PathLike) -> list[dict]:
    """A prompts file: one JSON object per line, ``{"prompt": "text"}`` or
    ``{"prompt_token_ids": [..]}``, optional ``"id"`` (default: the line number).
    Blank lines are skipped. Raises `BadInput` naming the line and what is accepted."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"prompts file {str(p)!r}: not found; accepted: a JSONL file, one object per line such "
                       'as {"id": "greeting", "prompt": "Hello"} or {"prompt_token_ids": [1, 2, 3]}')
    prompts, ids = [], set()
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"prompts file {str(p)!r} line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BadInput(f"{where}: not JSON ({exc.msg} at column {exc.colno}); accepted: one JSON object "
                           "per line") from None
        prompts.append(_check_prompt(obj, where, default_id=str(n)))
        if prompts[-1]["id"] in ids:
            raise BadInput(f"{where}: id {prompts[-1]['id']!r} repeats an earlier line; accepted: unique ids")
        ids.add(prompts[-1]["id"])
    if not prompts:
        raise BadInput(f"prompts file {str(p)!r}: no prompts; accepted: at least one line such as "
                       '{"prompt": "Hello"}')
    return sorted(prompts, key=lambda q: _id_key(q["id"]))


def _check_prompt(obj: Any, where: str, default_id: str) -> dict:
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: got {obj!r}; accepted: a JSON object with 'prompt' or 'prompt_token_ids'")
    unknown = [k for k in obj if k not in PROMPT_KEYS]
    if unknown:
        raise BadInput(f"{where}: unknown key {unknown[0]!r}; accepted: {', '.join(PROMPT_KEYS)}")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise BadInput(f"{where}: needs exactly one of 'prompt' (text) and 'prompt_token_ids' (a list of ints)")
    out: dict = {"id": default_id}
    if "id" in obj:
        if isinstance(obj["id"], bool) or not isinstance(obj["id"], (str, int)) or str(obj["id"]).strip() == "":
            raise BadInput(f"{where}: id {obj['id']!r}; accepted: a non-empty string or an integer")
        out["id"] = str(obj["id"])
    if has_text:
        if not isinstance(obj["prompt"], str) or not obj["prompt"].strip():
            raise BadInput(f"{where}: prompt {obj['prompt']!r}; accepted: a non-empty string")
        out["prompt"] = obj["prompt"]
    else:
        ids = obj["prompt_token_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise BadInput(f"{where}: prompt_token_ids {ids!r}; accepted: a non-empty list of token ids "
                           "(integers >= 0)")
        out["prompt_token_ids"] = list(ids)
    return out


def model_files(model: str | os.PathLike) -> list[Path]:
    """The model directory's files that decide the bits; `BadInput` if it is not a model directory."""
    d = Path(model)
    accepted = "accepted: a local model directory with config.json and weights (*.safetensors, *.bin)"
    if not d.is_dir():
        raise BadInput(f"model {str(d)!r}: not a directory; {accepted}")
    cfg = d / "config.json"
    if not cfg.is_file():
        raise BadInput(f"model {str(d)!r}: no config.json; {accepted}")
    try:
        json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"model {str(d)!r}: config.json is not JSON ({exc}); {accepted}") from None
    if not any(f for pat in WEIGHT_PATTERNS for f in d.glob(pat)):
        raise BadInput(f"model {str(d)!r}: no weight files; {accepted}")
    return sorted({f for pat in MODEL_FILE_PATTERNS for f in d.glob(pat) if f.is_file()})


def model_hash(model: str | os.PathLike) -> str:
    """sha256 over the names and bytes of `model_files` (configuration, tokenizer, weights)."""
    h = hashlib.sha256()
    for f in model_files(model):
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return "sha256:" + h.hexdigest()


# --- the golden file ------------------------------------------------------------------------------


def dumps(golden: Mapping) -> str:
    """The golden as text: a JSON object with one generated token per line, prompts sorted by id."""
    lines = ["{", f'  "format": {json.dumps(FORMAT)},']
    for key in ("fingerprint", "recorded_with"):
        body = json.dumps(golden[key], indent=2, sort_keys=True).replace("\n", "\n  ")
        lines.append(f'  "{key}": {body},')
    lines.append(f'  "model_path": {json.dumps(golden["model_path"])},')
    lines.append('  "prompts": [')
    prompts = sorted(golden["prompts"], key=lambda q: _id_key(q["id"]))
    for i, q in enumerate(prompts):
        src = "prompt" if "prompt" in q else "prompt_token_ids"
        lines.append(f'    {{"id": {json.dumps(q["id"])}, {json.dumps(src)}: {json.dumps(q[src])},')
        lines.append(f'     "text": {json.dumps(q.get("text", ""))},')
        steps = [f"      {json.dumps([t, lp])}" for t, lp in q["steps"]]
        lines.append('     "steps": [' + ("\n" + ",\n".join(steps) + "\n     ]" if steps else "]")
                     + ("}," if i + 1 < len(prompts) else "}"))
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def save(golden: Mapping, path: str | os.PathLike) -> None:
    Path(path).write_text(dumps(golden))


def load(path: str | os.PathLike) -> dict:
    """A golden file, checked; `BadInput` naming what is missing or malformed."""
    p = Path(path)
    if not p.is_file():
        raise BadInput(f"golden file {str(p)!r}: not found; record one with `dhp-backend golden record`")
    try:
        g = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise BadInput(f"golden file {str(p)!r}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                       "accepted: a file written by `dhp-backend golden record`") from None
    where = f"golden file {str(p)!r}"
    if not isinstance(g, dict) or g.get("format") != FORMAT:
        got = g.get("format") if isinstance(g, dict) else type(g).__name__
        raise BadInput(f"{where}: format {got!r}; accepted: {FORMAT!r} (a file written by "
                       "`dhp-backend golden record`)")
    for key, kind in (("fingerprint", dict), ("recorded_with", dict), ("prompts", list)):
        if not isinstance(g.get(key), kind):
            raise BadInput(f"{where}: {key!r} missing or not a JSON {'object' if kind is dict else 'array'}")
    if not g["prompts"]:
        raise BadInput(f"{where}: no prompts")
    for q in g["prompts"]:
        qid = q.get("id") if isinstance(q, dict) else None
        item = {k: v for k, v in q.items() if k in PROMPT_KEYS} if isinstance(q, dict) else q
        _check_prompt(item, f"{where}: prompt {qid!r}", default_id=str(qid))
        steps = q.get("steps")
        if not isinstance(steps, list) or not all(
                isinstance(s, list) and len(s) == 2 and isinstance(s[0], int) and _is_hex_float(s[1])
                for s in steps):
            raise BadInput(f"{where}: prompt {qid!r}: 'steps' must be a list of [token id, logprob as "
                           "float.hex] pairs")
    return g


def _is_hex_float(v: Any) -> bool:
    try:
        float.fromhex(v)
        return isinstance(v, str)
    except (TypeError, ValueError):
        return False


# --- running the engine ---------------------------------------------------------------------------


def batches(n: int, batch_size: int, *, shuffle: bool = False, seed: int = 0) -> list[list[int]]:
    """Prompt indices in batches of ``batch_size`` (the last may be smaller), shuffled if asked."""
    if batch_size < 1:
        raise BadInput(f"batch size {batch_size}; accepted: an integer >= 1")
    order = list(range(n))
    if shuffle:
        random.Random(seed).shuffle(order)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here (vLLM's detection: NVML, no CUDA context)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _engine_env(environ: Mapping[str, str], trace: str, dhp: bool, cpu: bool) -> dict:
    from dhp_backend.config import setting
    from dhp_backend.vllm.compat import BATCH_INVARIANT_ENV

    override = setting("override_cpu_attn").env
    env = dict(environ)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # requests of a batch all reach the scheduler before it steps
    env[setting("trace_file").env] = trace
    env.pop(override, None)
    env.pop(BATCH_INVARIANT_ENV, None)
    if cpu:  # vLLM's batch-invariant mode does not run there (dhp_backend.vllm.startup_check)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_HOST_IP", "127.0.0.1")
        if dhp:
            env[override] = "1"  # vLLM's CPU platform ignores --attention-backend
    else:
        # DHP's deterministic mode needs it (read by vLLM at import); the engine's default backend,
        # run side by side by `selfcheck`, gets the same engine.
        env[BATCH_INVARIANT_ENV] = "1"
    return env


def run_engine(spec: dict, *, environ: Mapping[str, str] | None = None, progress: bool = False,
               timeout: float = 3600) -> dict:
    """Run `golden_run` on ``spec`` in a child process (its own session, ended afterwards)."""
    cpu = on_cpu()
    with tempfile.TemporaryDirectory(prefix="dhp-golden-") as tmp:
        spec_path, out_path, log_path = (os.path.join(tmp, n) for n in ("spec.json", "out.json", "engine.log"))
        with open(spec_path, "w") as f:
            json.dump({**spec, "progress": progress}, f)
        env = _engine_env(os.environ if environ is None else environ, os.path.join(tmp, "trace.jsonl"),
                          spec.get("dhp") is not None, cpu)
        with open(log_path, "w") as log:
            sink = None if progress else log
            proc = subprocess.Popen([sys.executable, "-m", "dhp_backend.testing.golden_run", spec_path, out_path],
                                    env=env, stdout=sink, stderr=subprocess.STDOUT if sink else None,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                end_session(proc)
        if code != 0 or not os.path.exists(out_path):
            tail = "" if progress else "\n".join(Path(log_path).read_text().splitlines()[-25:])
            what = "timed out" if code is None else f"exited with {code}"
            raise EngineFailed(f"the engine {what}" + (f"; its last lines:\n{tail}" if tail else
                                                       " (its output is above)"))
        with open(out_path) as f:
            return json.load(f)


def end_session(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL, what is left of the child's session (an engine core, its workers)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            continue
        time.sleep(0.2)


def _engine_options(batch_size: int, max_num_batched_tokens: int | None, seed: int) -> dict:
    engine: dict = {"seed": seed}
    if max_num_batched_tokens is not None:
        if max_num_batched_tokens < 1:
            raise BadInput(f"max_num_batched_tokens {max_num_batched_tokens}; accepted: an integer >= 1")
        # vLLM wants max_num_seqs <= max_num_batched_tokens. Whether a prompt longer than the budget
        # is chunked is vLLM's --[no-]enable-chunked-prefill (engine arguments).
        engine.update(max_num_batched_tokens=max_num_batched_tokens,
                      max_num_seqs=max(1, min(batch_size, max_num_batched_tokens)))
    return engine


def _vllm_prompt(q: Mapping) -> dict:
    return {"prompt": q["prompt"]} if "prompt" in q else {"prompt_token_ids": q["prompt_token_ids"]}


def _dhp_section(policy: str, cpu: bool) -> dict:
    # The CPU has only the reference path, which a constant-time policy runs only when allowed.
    return {"deterministic": True, "policy": policy, "allow_fallback": cpu}


# --- record and check -----------------------------------------------------------------------------


def record(model: str | os.PathLike, prompts: Sequence[Mapping], out: str | os.PathLike | None = None, *,
           max_tokens: int = 8, temperature: float = 0.0, seed: int | None = None, policy: str = "strict",
           batch_size: int = 1, max_num_batched_tokens: int | None = None, engine_args: Sequence[str] = (),
           environ: Mapping[str, str] | None = None, progress: bool = False) -> dict:
    """Run ``prompts`` (as `read_prompts` returns them) through ``model`` with DHP in deterministic
    mode; return the golden (and write it to ``out``)."""
    if not prompts:
        raise BadInput("no prompts; accepted: at least one")
    prompts = [_check_prompt(dict(q), f"prompt {i}", default_id=str(i + 1)) for i, q in enumerate(prompts)]
    if len({q["id"] for q in prompts}) != len(prompts):
        raise BadInput("prompt ids repeat; accepted: unique ids")
    if max_tokens < 1:
        raise BadInput(f"max_tokens {max_tokens}; accepted: an integer >= 1")
    if temperature < 0 or (temperature > 0 and seed is None):
        raise BadInput(f"temperature {temperature} with seed {seed}; accepted: temperature 0 (greedy), or "
                       "temperature > 0 with a seed (seeded sampling)")
    from dhp_backend.config import Policy

    try:
        policy = Policy.parse(policy).value
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    prompts = sorted(prompts, key=lambda q: _id_key(q["id"]))
    sampling = {"temperature": float(temperature), "max_tokens": int(max_tokens), "seed": seed}
    recorded_with = {"batch_size": batch_size, "shuffle": False, "max_num_batched_tokens": max_num_batched_tokens,
                     "engine_args": list(engine_args)}
    fresh = _generate(model, prompts, sampling, _dhp_section(policy, on_cpu()), recorded_with, environ, progress)
    golden = {
        "format": FORMAT,
        "fingerprint": {**fresh["fingerprint"], "model_hash": model_hash(model), "sampling": sampling},
        "recorded_with": recorded_with,
        "model_path": str(Path(model).resolve()),
        "prompts": [{**q, "text": r["text"], "steps": [[t, lp] for t, lp in zip(r["token_ids"], r["logprobs"])]}
                    for q, r in zip(prompts, fresh["outputs"])],
    }
    if out is not None:
        save(golden, out)
    return golden


def _generate(model, prompts, sampling, dhp, options, environ, progress, schedules=None) -> dict:
    model_files(model)  # a clear error before an engine starts
    engine = _engine_options(options["batch_size"], options["max_num_batched_tokens"], seed=0)
    if schedules is None:
        schedules = [{"name": "run", "batches": batches(len(prompts), options["batch_size"],
                                                        shuffle=options.get("shuffle", False),
                                                        seed=options.get("shuffle_seed", 0))}]
    spec = {"model": str(model), "prompts": [_vllm_prompt(q) for q in prompts], "sampling": sampling,
            "engine": {**engine, **options.get("engine", {})}, "engine_cli": list(options["engine_args"]),
            "dhp": dhp, "schedules": schedules}
    res = run_engine(spec, environ=environ, progress=progress)
    return {"fingerprint": res["fingerprint"], "outputs": res["results"][schedules[0]["name"]],
            "results": res["results"]}


@dataclasses.dataclass(frozen=True)
class Difference:
    """The first difference between a golden and a new run (prompts in the golden's order)."""

    prompt_id: str
    step: int                    # index of the generated token
    golden_token: int | None     # None: the run is longer than the golden here
    new_token: int | None        # None: the run stopped before this step
    golden_logprob: str | None   # float.hex
    new_logprob: str | None
    max_logprob_diff: float      # largest |difference| of logprobs at equal steps, over all prompts
    max_at: tuple[str, int] | None
    prompts_differing: int
    prompts_total: int

    def first(self) -> tuple:
        """Where the runs part and how: (prompt id, step, golden token, new token, their logprobs as hex)."""
        return (self.prompt_id, self.step, self.golden_token, self.new_token, self.golden_logprob, self.new_logprob)

    def describe(self) -> str:
        def tok(t, lp):
            return "nothing (ended)" if t is None else f"token {t} (logprob {lp} = {float.fromhex(lp)!r})"
        where = "" if self.max_at is None else f" at prompt {self.max_at[0]!r} step {self.max_at[1]}"
        return (f"first difference: prompt {self.prompt_id!r}, step {self.step}: golden "
                f"{tok(self.golden_token, self.golden_logprob)}, now {tok(self.new_token, self.new_logprob)}; "
                f"largest logprob difference {self.max_logprob_diff!r}{where}; "
                f"{self.prompts_differing} of {self.prompts_total} prompts differ")


def compare(golden_prompts: Sequence[Mapping], outputs: Sequence[Mapping]) -> Difference | None:
    """None when every token id and logprob bit is equal, else the first `Difference`."""
    first = None
    differing = 0
    max_diff, max_at = 0.0, None
    for q, r in zip(golden_prompts, outputs):
        new = list(zip(r["token_ids"], r["logprobs"]))
        old = [tuple(s) for s in q["steps"]]
        if new == old:
            continue
        differing += 1
        for step in range(max(len(old), len(new))):
            a = old[step] if step < len(old) else (None, None)
            b = new[step] if step < len(new) else (None, None)
            if a[1] is not None and b[1] is not None:
                d = abs(float.fromhex(a[1]) - float.fromhex(b[1]))
                if d > max_diff:
                    max_diff, max_at = d, (q["id"], step)
            if a != b and first is None:
                first = (q["id"], step, a, b)
    if first is None:
        return None
    pid, step, a, b = first
    return Difference(pid, step, a[0], b[0], a[1], b[1], max_diff, max_at, differing, len(golden_prompts))


def fingerprint_diff(golden_fp: Mapping, new_fp: Mapping) -> dict[str, tuple[Any, Any]]:
    """``{key: (golden, now)}`` for every fingerprint entry that differs."""
    return {k: (golden_fp.get(k), new_fp.get(k)) for k in sorted(set(golden_fp) | set(new_fp))
            if golden_fp.get(k) != new_fp.get(k)}


def _listed(fdiff: Mapping[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{k}: {a!r} (golden) vs {b!r} (now)" for k, (a, b) in fdiff.items())


def _not_compared(fdiff: Mapping[str, tuple[Any, Any]]) -> CheckResult:
    return CheckResult(EXIT_FINGERPRINT,
                       f"golden check: NOT COMPARED, the fingerprint differs (recorded elsewhere, which is not a "
                       f"regression by itself): {_listed(fdiff)}. Compare anyway with --compare-anyway "
                       "(compare_anyway=True), or record a new golden here.",
                       fingerprint_diff=fdiff, compared=False)


@dataclasses.dataclass(frozen=True)
class CheckResult:
    exit_code: int
    message: str
    difference: Difference | None = None
    fingerprint_diff: Mapping[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    compared: bool = True


def check(golden: Mapping, model: str | os.PathLike, *, batch_size: int = 1, shuffle: bool = False,
          shuffle_seed: int = 0, max_num_batched_tokens: int | None = None,
          engine_args: Sequence[str] | None = None, compare_anyway: bool = False,
          environ: Mapping[str, str] | None = None, progress: bool = False) -> CheckResult:
    """Rerun the golden's prompts (its sampling and DHP settings) under this batching and compare.

    ``engine_args``: vLLM CLI arguments; by default those the golden was recorded with.
    """
    rec = golden["recorded_with"]
    engine_args = rec.get("engine_args", []) if engine_args is None else list(engine_args)
    options = {"batch_size": batch_size, "shuffle": shuffle, "shuffle_seed": shuffle_seed,
               "max_num_batched_tokens": max_num_batched_tokens, "engine_args": engine_args}
    fp = golden["fingerprint"]
    prompts = sorted(golden["prompts"], key=lambda q: _id_key(q["id"]))
    # What is known before an engine starts (versions, device, the model's files) is compared first.
    from dhp_backend.testing.golden_run import environment_fingerprint

    before = {**environment_fingerprint(), "model_hash": model_hash(model), "sampling": fp["sampling"]}
    fdiff = fingerprint_diff({k: fp.get(k) for k in before}, before)
    if fdiff and not compare_anyway:
        return _not_compared(fdiff)
    dhp = fp.get("dhp") or _dhp_section("strict", on_cpu())
    fresh = _generate(model, prompts, fp["sampling"], dhp, options, environ, progress)
    fdiff = fingerprint_diff(fp, {**fresh["fingerprint"], **before})
    if fdiff and not compare_anyway:
        return _not_compared(fdiff)
    how = (f"{len(prompts)} prompts, batch size {batch_size}{', shuffled' if shuffle else ''}"
           + (f", max_num_batched_tokens {max_num_batched_tokens}" if max_num_batched_tokens else ""))
    note = f" (fingerprint differs, compared anyway: {_listed(fdiff)})" if fdiff else ""
    diff = compare(prompts, fresh["outputs"])
    if diff is None:
        return CheckResult(EXIT_EQUAL, f"golden check: bitwise equal ({how}){note}", fingerprint_diff=fdiff)
    hint = budget_hint(rec.get("max_num_batched_tokens"), max_num_batched_tokens, gpu=not on_cpu())
    return CheckResult(EXIT_DIFFERENT, f"golden check: DIFFERENT ({how}): {diff.describe()}{note}{hint}",
                       difference=diff, fingerprint_diff=fdiff)


def budget_hint(recorded: int | None, checked: int | None, *, gpu: bool) -> str:
    """What to add to a GPU check that differs under another step budget than the recording's: vLLM 0.24
    on the GPU moves the bits under chunked prefill for its own default backend as well (H200 selfcheck,
    2026-11-26: the same first difference with the same bits), so a different budget alone can part them."""
    if not gpu or recorded == checked:
        return ""
    return (f"; note: recorded with max_num_batched_tokens {recorded or 'none'}, checked with {checked or 'none'}: on "
            f"the GPU, vLLM moves the bits under another step budget with any attention backend (README, "
            f"'Golden outputs'); check with the recorded budget")


# --- selfcheck ------------------------------------------------------------------------------------

INVARIANCES = ("batched", "reversed", "chunked", "prefix_warm")


BACKENDS = ("DHP", "engine default")


def selfcheck(model: str | os.PathLike, prompts: Sequence[Mapping], *, max_tokens: int = 8,
              policy: str = "strict", chunk_budget: int = 16, engine_args: Sequence[str] = (),
              environ: Mapping[str, str] | None = None, progress: bool = False,
              backends: Sequence[str] = BACKENDS) -> dict:
    """Which invariances hold, for DHP and for the engine's default backend, with no stored file.

    Against each prompt run alone (prefix caching off): all prompts in one batch
    (``batched``) and in reverse order (``reversed``), in one batch under a
    ``chunk_budget`` token budget (``chunked``), and in one batch a second time
    with prefix caching on, its cache warm from the first (``prefix_warm``; its
    ``cache_hits`` counts the prompts that read cached prefix tokens, so a
    workload whose prompts are shorter than a KV block shows that it tested
    nothing). ``backends``: a subset of `BACKENDS`.
    Returns ``{"DHP": {invariance: {"holds", "detail", "first"}}, "engine default": ...}`` (``first``:
    `Difference.first`, None where the invariance holds).
    """
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise BadInput(f"backends {list(backends)}; accepted: a non-empty subset of {list(BACKENDS)}")
    if not prompts:
        raise BadInput("no prompts; accepted: at least one")
    prompts = sorted(prompts, key=lambda q: _id_key(q["id"]))
    n = len(prompts)
    sampling = {"temperature": 0.0, "max_tokens": int(max_tokens), "seed": None}
    together = [list(range(n))]
    runs = (  # (engine options, schedules)
        ({"max_num_batched_tokens": None, "engine": {"enable_prefix_caching": False}},
         [{"name": "solo", "batches": batches(n, 1)}, {"name": "batched", "batches": together},
          {"name": "reversed", "batches": [list(reversed(range(n)))]}]),
        ({"max_num_batched_tokens": chunk_budget, "engine": {"enable_prefix_caching": False}},
         [{"name": "chunked", "batches": together}]),
        ({"max_num_batched_tokens": None, "engine": {"enable_prefix_caching": True}},
         [{"name": "prefix_cold", "batches": together}, {"name": "prefix_warm", "batches": together}]),
    )
    cpu = on_cpu()
    report = {}
    for label, dhp in (("DHP", _dhp_section(policy, cpu)), ("engine default", None)):
        if label not in backends:
            continue
        results = {}
        for opts, schedules in runs:
            options = {"batch_size": n, "engine_args": list(engine_args), **opts}
            results.update(_generate(model, prompts, sampling, dhp, options, environ, progress,
                                     schedules=schedules)["results"])
        solo = [{**q, "steps": [[t, lp] for t, lp in zip(r["token_ids"], r["logprobs"])]}
                for q, r in zip(prompts, results["solo"])]
        report[label] = {}
        for name in INVARIANCES:
            diff = compare(solo, results[name])
            report[label][name] = {"holds": diff is None,
                                   "detail": "bitwise equal to solo" if diff is None else diff.describe(),
                                   "first": None if diff is None else diff.first()}
        hits = sum(1 for r in results["prefix_warm"] if (r.get("num_cached_tokens") or 0) > 0)
        report[label]["prefix_warm"]["cache_hits"] = hits
        report[label]["prefix_warm"]["detail"] += f" ({hits} of {n} prompts read cached prefix tokens)"
    return report


# --- command line (`dhp-backend golden`) ----------------------------------------------------------

USAGE = """exit codes: 0 equal (selfcheck: every invariance holds for DHP), 1 different (the first difference
is printed), 2 bad input (missing or malformed model, prompts, golden or argument), 3 fingerprint
differs (recorded with other versions, device, dtype or model files: not compared without
--compare-anyway), 4 the engine failed. Extra vLLM engine arguments go after `--`."""


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="golden_command", required=True)
    rec = sub.add_parser("record", help="run prompts with DHP in deterministic mode and write a golden file",
                         epilog=USAGE)
    chk = sub.add_parser("check", help="rerun a golden's prompts under any batching and compare bitwise",
                         epilog=USAGE)
    slf = sub.add_parser("selfcheck", help="which invariances hold, for DHP and the engine's default backend",
                         epilog=USAGE)
    for p in (rec, chk, slf):
        p.add_argument("--model", required=True, help="a local model directory")
    for p in (rec, slf):
        p.add_argument("--prompts", required=True, help='JSONL: {"prompt": "text"} or {"prompt_token_ids": '
                                                          '[..]} per line, optional "id"')
        p.add_argument("--max-tokens", type=int, default=8)
        p.add_argument("--policy", default="strict", help="DHP policy (strict, request, off)")
    rec.add_argument("--out", required=True, help="the golden file to write")
    rec.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0 needs --seed")
    rec.add_argument("--seed", type=int, default=None, help="sampling seed (seeded sampling)")
    chk.add_argument("--golden", required=True, help="a golden file written by `golden record`")
    chk.add_argument("--compare-anyway", action="store_true", help="compare even if the fingerprint differs")
    chk.add_argument("--shuffle", action="store_true", help="run the prompts in a shuffled order")
    chk.add_argument("--shuffle-seed", type=int, default=0)
    for p in (rec, chk):
        p.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (default 1)")
        p.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="vLLM's per-step token budget (small: chunked prefill)")
    slf.add_argument("--chunk-budget", type=int, default=16, help="token budget of the chunked run")
    for p in (rec, chk, slf):
        p.add_argument("--json", action="store_true", help="print the result as JSON")
        p.add_argument("--quiet", action="store_true", help="no engine output or progress bars")
        p.add_argument("engine_args", nargs="*", default=[], metavar="-- ENGINE_ARGS",
                       help="vLLM engine arguments, after --")


def run(args) -> int:
    progress = not args.quiet
    try:
        if args.golden_command == "record":
            g = record(args.model, read_prompts(args.prompts), args.out, max_tokens=args.max_tokens,
                       temperature=args.temperature, seed=args.seed, policy=args.policy,
                       batch_size=args.batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
                       engine_args=args.engine_args, progress=progress)
            msg = (f"golden record: {len(g['prompts'])} prompts, "
                   f"{sum(len(q['steps']) for q in g['prompts'])} tokens -> {args.out}")
            print(json.dumps({"exit_code": EXIT_EQUAL, "message": msg}) if args.json else msg)
            return EXIT_EQUAL
        if args.golden_command == "check":
            res = check(load(args.golden), args.model, batch_size=args.batch_size, shuffle=args.shuffle,
                        shuffle_seed=args.shuffle_seed, max_num_batched_tokens=args.max_num_batched_tokens,
                        engine_args=args.engine_args or None, compare_anyway=args.compare_anyway,
                        progress=progress)
            if args.json:
                print(json.dumps({"exit_code": res.exit_code, "message": res.message,
                                  "difference": dataclasses.asdict(res.difference) if res.difference else None,
                                  "fingerprint_diff": res.fingerprint_diff, "compared": res.compared}))
            else:
                print(res.message)
            return res.exit_code
        report = selfcheck(args.model, read_prompts(args.prompts), max_tokens=args.max_tokens,
                           policy=args.policy, chunk_budget=args.chunk_budget, engine_args=args.engine_args,
                           progress=progress)
        code = EXIT_EQUAL if all(v["holds"] for v in report["DHP"].values()) else EXIT_DIFFERENT
        if args.json:
            print(json.dumps({"exit_code": code, "report": report}))
        else:
            print(f"{'invariance':<12} {'DHP':<6} engine default")
            for name in INVARIANCES:
                row = [("holds" if report[b][name]["holds"] else "FAILS") for b in ("DHP", "engine default")]
                print(f"{name:<12} {row[0]:<6} {row[1]}")
            for b, inv in report.items():
                for name, v in inv.items():
                    if not v["holds"]:
                        print(f"{b}, {name}: {v['detail']}")
        return code
    except GoldenError as exc:
        print(f"dhp-backend golden {args.golden_command}: {exc}", file=sys.stderr)
        return exc.exit_code
