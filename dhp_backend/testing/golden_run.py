"""The engine side of `dhp_backend.testing.golden`: one vLLM engine, prompts in given batches.

Run as its own process (``python -m dhp_backend.testing.golden_run SPEC.json OUT.json``):
vLLM reads ``VLLM_BATCH_INVARIANT`` and DHP's CPU override at import, so the
caller sets them in this process's environment (`golden._engine_env`). The
engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): every request of
a batch reaches the scheduler before its first step, so a schedule fixes the
composition of every step.

SPEC: ``model``, ``prompts`` (vLLM prompt dicts), ``sampling`` (SamplingParams
keywords), ``engine`` (LLM keywords), ``engine_cli`` (extra vLLM CLI arguments),
``dhp`` (DHP's additional_config section, or null for the engine's default
backend), ``schedules`` (``[{"name", "batches": [[prompt index, ...], ...]}]``),
``progress``. OUT: per schedule, per prompt, ``token_ids`` and ``logprobs``
(``float.hex``), and the fingerprint of what ran.
"""

from __future__ import annotations

import json
import os
import platform
import sys


def engine_kwargs(model: str, engine: dict, engine_cli: list[str]) -> dict:
    """LLM keywords: ``engine`` plus the vLLM CLI arguments that differ from vLLM's defaults."""
    kwargs = dict(engine)
    if engine_cli:
        from vllm.engine.arg_utils import EngineArgs, FlexibleArgumentParser  # both versions import it there

        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        given = vars(parser.parse_args(["--model", model, *engine_cli]))
        default = vars(parser.parse_args(["--model", model]))
        kwargs.update({k: v for k, v in given.items() if v != default.get(k) and k != "model"})
    return kwargs


def device_name() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu: {model}"


def driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        v = pynvml.nvmlSystemGetDriverVersion()
        return v.decode() if isinstance(v, bytes) else str(v)
    except Exception:  # no NVIDIA driver (CPU), or no NVML binding
        return None


def environment_fingerprint() -> dict:
    """Versions and device: known before an engine starts (`golden.check` compares them first).

    Imports torch and vLLM but starts nothing; `device_name` asks torch.cuda, which is why the
    engine runs in a process of its own."""
    import torch
    import vllm

    import dhp_backend

    return {"dhp_backend": dhp_backend.__version__, "vllm": vllm.__version__, "torch": torch.__version__,
            "cuda": torch.version.cuda, "driver": driver_version(), "device": device_name()}


def kernels_from_trace(path: str) -> list[str]:
    """What DHP's forward ran on, from its trace file: ``reference``, ``triton:<kernel>``, ..."""
    if not os.path.exists(path):
        return []
    seen = set()
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            ev = json.loads(line)
            if ev.get("event") == "forward":
                seen.add(str(ev.get("path")))
            elif ev.get("event") == "kernel":
                seen.add(f"{ev.get('path')}:{ev.get('kernel')}")
    return sorted(seen)


def tensor_parallel_size(llm) -> int:
    """The engine's tensor-parallel size (vLLM 0.24 and 0.32: ``llm_engine.vllm_config.parallel_config``)."""
    parallel = getattr(getattr(llm.llm_engine, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "tensor_parallel_size", 1) or 1)


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from dhp_backend import config
    from dhp_backend.vllm import compat

    kwargs = engine_kwargs(spec["model"], spec["engine"], spec.get("engine_cli") or [])
    if spec.get("dhp") is not None:
        kwargs["attention_backend"] = "DHP"
        kwargs["additional_config"] = {"dhp": spec["dhp"]}
    llm = LLM(model=spec["model"], **kwargs)
    params = SamplingParams(**spec["sampling"], logprobs=0)
    prompts = spec["prompts"]
    results = {}
    for schedule in spec["schedules"]:
        outs: list = [None] * len(prompts)
        for batch in schedule["batches"]:
            got = llm.generate([prompts[i] for i in batch], params, use_tqdm=bool(spec.get("progress")))
            for i, r in zip(batch, got):
                c = r.outputs[0]
                outs[i] = {"token_ids": list(c.token_ids),
                           "logprobs": [float(step[t].logprob).hex() for t, step in zip(c.token_ids, c.logprobs)],
                           "text": c.text, "num_cached_tokens": getattr(r, "num_cached_tokens", None)}
        results[schedule["name"]] = outs
    dtype = str(llm.llm_engine.model_config.dtype).replace("torch.", "")
    fingerprint = {
        **environment_fingerprint(), "dtype": dtype,
        "batch_invariant_mode": compat.batch_invariant_enabled(),
        "attention": "DHP" if spec.get("dhp") is not None else "engine default",
        # Bits differ across tensor-parallel sizes (the row-parallel matmuls sum other partials): a golden
        # recorded at one size is another device setup at the next, not a regression.
        "tensor_parallel_size": tensor_parallel_size(llm),
        "dhp": spec.get("dhp"), "kernels": kernels_from_trace(config.from_env("trace_file") or ""),
    }
    return {"fingerprint": fingerprint, "results": results}


def main(argv=None) -> None:
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])
    with open(spec_path) as f:
        spec = json.load(f)
    result = run(spec)
    with open(out_path, "w") as f:
        json.dump(result, f)
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's atexit hooks can block on stopped children; the caller ends this session anyway.
    os._exit(0)


if __name__ == "__main__":
    main()
