"""One offline vLLM generation run with a chosen attention backend; prints JSON.

Run it as its own process (the demo and the e2e tests do): vLLM reads some
settings at import time and backend overrides are per process.

    python -m integration.run_generation --model DIR --backend DHP [--policy strict] \
        [--multiprocessing 1] [--dtype float32] [--out result.json]

Several ``--model``s and comma-separated ``--policy`` values run one engine each,
one after another in this process (imports paid once: the windowed-model tests
run four models under two policies this way); the JSON then lists every run
under ``runs``, and its top-level fields are the first run's.

``--backend native`` is vLLM's own choice for the platform (CPU_ATTN on CPU,
FLASH_ATTN on Hopper); any other name is passed as ``attention_backend``. On the
CPU platform vLLM ignores ``attention_backend``, so ``DHP`` there sets
``DHP_OVERRIDE_CPU_ATTN=1`` (the plugin's testing aid).

The workload is built to catch attention bugs: prompts of 1 to 260 tokens that
cross several KV blocks, chunked prefill forced by a small token budget (mixed
prefill/decode steps and prefill chunks on top of context), and a second round
of prompts that share long prefixes with the first, so prefix caching turns
their prefill into "chunk on top of cached context".
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time


#: the workloads' first-round prompt lengths
WORKLOADS = {"full": (1, 7, 40, 77, 150, 260), "short": (7, 77, 150)}


def make_prompts(seed: int = 1234, vocab: int = 512, workload: str = "full") -> tuple[list[list[int]], list[list[int]]]:
    """The two rounds of prompts. ``short`` (the windowed models' tests): three
    prompts, two far longer than the windows, and one second-round prompt."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    first = [toks(n) for n in WORKLOADS[workload]]
    long150 = first[WORKLOADS[workload].index(150)]
    # Second round: long shared prefixes (whole blocks) of first-round prompts,
    # plus new tokens -> prefix-cache hits, then a prefill chunk on that context.
    if workload == "short":
        return first, [long150[:128] + toks(21)]
    second = [long150[:128] + toks(21), first[5][:200] + toks(5), first[3][:64] + toks(1)]
    return first, second


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform here.

    Asks vLLM's platform detection (NVML, no CUDA context): calling
    torch.cuda in this process would initialise CUDA, and vLLM's engine core,
    forked from here, could then not use the GPU.
    """
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def run(args: argparse.Namespace) -> dict:
    """Every (model, policy) run of ``args``, one engine each, in this process."""
    cpu = on_cpu()
    # A private directory (not mktemp's guessable, racy name); removed below when ours.
    own_dir = None if args.trace_file else tempfile.mkdtemp(prefix="dhp-trace-")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocessing else "0"
    if cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if args.backend == "DHP" and cpu:
        os.environ["DHP_OVERRIDE_CPU_ATTN"] = "1"
    else:
        os.environ.pop("DHP_OVERRIDE_CPU_ATTN", None)

    policies = args.policy.split(",") if args.backend == "DHP" else [None]
    runs = []
    for model in args.model:
        for policy in policies:
            # each run its own trace (DHP traces once per trace file), unless the caller named one
            trace_file = args.trace_file or os.path.join(own_dir, f"trace-{len(runs)}.jsonl")
            os.environ["DHP_TRACE_FILE"] = trace_file
            runs.append({"model": str(model), "policy": policy, **run_one(args, model, policy, cpu)})
            if os.path.exists(trace_file):
                with open(trace_file) as f:
                    runs[-1]["dhp_trace"] = [json.loads(line) for line in f if line.strip()]
    if own_dir:
        shutil.rmtree(own_dir, ignore_errors=True)
    import vllm

    first = runs[0]
    return {"backend": args.backend, "policy": first["policy"],
            "platform": "cpu" if cpu else "cuda", "vllm_version": vllm.__version__,
            "multiprocessing": bool(args.multiprocessing), "dtype": args.dtype, "batching": args.batching,
            "eager": bool(args.eager), "tensor_parallel_size": args.tensor_parallel_size,
            "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0") == "1",
            "elapsed_s": first["elapsed_s"], "dhp_trace": first["dhp_trace"], "outputs": first["outputs"],
            **({"runs": runs} if len(runs) > 1 else {})}


def run_one(args: argparse.Namespace, model: str, policy: str | None, cpu: bool) -> dict:
    """One engine: build it, generate the workload's two rounds, shut it down."""
    from vllm import LLM, SamplingParams

    kwargs = dict(
        model=model, dtype=args.dtype, max_model_len=args.max_model_len,
        block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=True, enable_prefix_caching=not args.no_prefix_caching,
        max_num_seqs=8, seed=0, enforce_eager=args.eager, tensor_parallel_size=args.tensor_parallel_size,
    )
    if not cpu:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    if args.backend == "DHP":
        kwargs["additional_config"] = {"dhp": {"policy": policy,
                                               "allow_fallback": args.allow_fallback}}
        # Also on CPU, where vLLM selects by the CPU_ATTN slot: passing the name
        # exercises its resolution and the pickling of the config into the
        # spawned engine core (the alias must survive it).
        kwargs["attention_backend"] = args.attention_backend_name
    elif args.backend != "native" and not cpu:
        kwargs["attention_backend"] = args.backend

    t0 = time.time()
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=args.logprobs,
                            ignore_eos=True, detokenize=False)
    outputs = []
    for round_prompts in make_prompts(workload=args.workload):
        res = generate_batched(llm, round_prompts, params, args.batching)
        for prompt, r in zip(round_prompts, res):
            c = r.outputs[0]
            lps = [float(step[tok].logprob) for tok, step in zip(c.token_ids, c.logprobs)]
            out = {"prompt_len": len(prompt), "token_ids": list(c.token_ids), "logprobs": lps,
                   "num_cached_tokens": getattr(r, "num_cached_tokens", None)}
            if args.logprobs > 1:  # each step's candidates, for a comparison that tells a near tie from an error
                out["top_logprobs"] = [{str(t): float(lp.logprob) for t, lp in step.items()} for step in c.logprobs]
            outputs.append(out)
    elapsed = time.time() - t0
    shutdown(llm)
    return {"elapsed_s": round(elapsed, 1), "dhp_trace": [], "outputs": outputs}


def generate_batched(llm, prompts, params, batching: str):
    """Generate ``prompts`` in one of several batch compositions; results in prompt order.

    ``together``: one batch in order; ``reversed``: one batch in reverse order;
    ``solo``: each prompt alone. With a batch-invariant engine the per-prompt bits
    must not depend on this.
    """
    items = [{"prompt_token_ids": p} for p in prompts]
    if batching == "together":
        return llm.generate(items, params, use_tqdm=False)
    if batching == "reversed":
        return list(reversed(llm.generate(items[::-1], params, use_tqdm=False)))
    if batching == "solo":
        return [llm.generate([it], params, use_tqdm=False)[0] for it in items]
    raise ValueError(f"--batching {batching!r}; accepted: together, reversed, solo")


def shutdown(llm) -> None:
    """Stop vLLM's engine-core process (and its workers) before this process exits.

    Without it a spawned engine core can outlive us, holding memory and any
    pipe our caller reads our output from.
    """
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # best effort; the backstop below still runs
        print(f"engine shutdown: {exc!r}", file=sys.stderr)
    terminate_children()


def terminate_children(timeout: float = 15.0) -> None:
    """Backstop: end every process this one started that is still alive."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for c in children:
        try:
            c.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=timeout)
    for c in alive:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, action="append",
                    help="a checkpoint directory; several run one after another")
    ap.add_argument("--backend", default="DHP", help="DHP | native | a vLLM backend name")
    ap.add_argument("--policy", default="strict", help="DHP's policy; several (comma-separated) run in turn")
    ap.add_argument("--workload", default="full", choices=sorted(WORKLOADS))
    ap.add_argument("--attention-backend-name", default="DHP", help="DHP or CUSTOM (same backend)")
    ap.add_argument("--allow-fallback", type=int, default=1,
                    help="accept the non-constant-time reference path (CPU has no other)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--multiprocessing", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--logprobs", type=int, default=1,
                    help="top logprobs per step; above 1 each output also carries them (top_logprobs)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--eager", type=int, default=1)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="GPUs per engine (vLLM's tensor_parallel_size)")
    ap.add_argument("--batching", default="together", choices=["together", "reversed", "solo"])
    ap.add_argument("--trace-file", default=None)
    ap.add_argument("--out", default=None, help="write the JSON here too")
    return ap


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    args.allow_fallback = bool(args.allow_fallback)
    result = run(args)
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    sys.stdout.write("\nDHP_RESULT_JSON " + text + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    terminate_children()
    # vLLM's atexit hooks can block on already-stopped children; leave promptly.
    os._exit(0)


if __name__ == "__main__":
    main()
