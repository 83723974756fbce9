"""G3 bits gate (design.md section 3): bitwise repeatability and batch invariance.

    dhp-backend audit bits [--parts gpu,interpret,reference] [--runs 100] [--sizes 1,2,3,8,16,32,64]
                           [--interpret-runs 10] [--interpret-sizes 1,2,3,5] [--policies strict,request,off]
                           [--orders 2] [--seed 0] [--report-dir DIR] [--json] [--timeout 1800]

Three checks, each run through `ops.paged_attention` (the seam the vLLM adapter calls):

- *repeat*: one mixed step (decodes and prefill chunks) run ``--runs`` times gives
  bitwise identical output;
- *batch invariance*: a target request (a decode, and a prefill chunk on context)
  alone, and inside batches of ``--sizes`` requests (the target at a random place
  among random other requests, ``--orders`` shuffles per size, padding rows, a
  fresh cache layout each time) gives bitwise identical rows, under each of ``--policies``;
- *policies*: the mixed step gives identical bits under every one of ``--policies``.

Parts (``--parts``; default: every one this machine can run):

- ``gpu``: the Triton kernels on the CUDA device, Llama-3-8B attention (32/8 heads,
  d=128, block 16, bf16, L=4096); ``--runs``/``--sizes``.
- ``interpret``: the same kernels under the Triton interpreter on the CPU, on a tiny
  shape (4/2 heads, d=64, block 16, fp16, L=256); ``--interpret-runs``/``--interpret-sizes``.
- ``reference``: the PyTorch reference path on the CPU, same tiny shape; ``--runs``/``--sizes``.

``gpu`` and ``interpret`` run in fresh child processes (``python -m
dhp_backend.audit.bits --child PART``): Triton chooses interpreter or compiler
for every function when it is first imported, so the interpreter part needs a
process that imports Triton with ``TRITON_INTERPRET=1`` and the GPU part one
that does not. The batches come from this module's own builder, with block
tables that obey the address rule (design.md section 2;
`dhp_backend.testing.pages.reserved_table`): every request owns distinct real
pages, in a random layout, up to what the policies it runs under reserve
(`ops.buckets.reserved_tokens`: ``strict`` the whole table width, ``request``
its next power of two, ``off`` its length); stale garbage (NaN, inf, large
values) in every slot a request has not written, its reserved pages past its
length included; garbage block ids in the table columns past its reservation
(read under no policy); NaN padding query rows.

``--report-dir`` writes ``<date>-bits-<device>.md`` and ``.json``; ``run``
returns 0 when every check passes, else 1. Expected time: the GPU part a few
seconds after compiling; the interpreter part about 50 s on two CPU cores (76 comparisons);
the reference part a few seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import time

from dhp_backend.audit.provenance import device_slug, report_stem, versions, write_report_files
from dhp_backend.testing.requests import Request

MARK = "DHP_BITS_RESULT "
PARTS = ("gpu", "interpret", "reference")
POLICIES = ("strict", "request", "off")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """The public model shape of one part's batches; ``max_blocks`` fixes the block-table width,
    so the ``strict`` bucket (``max_blocks * block_size``) is the same in every batch."""

    heads: int
    kv_heads: int
    head_size: int
    block_size: int
    dtype: str
    max_blocks: int
    max_chunk: int  # longest query of a prefill chunk in the random pool

    @property
    def capacity(self) -> int:
        return self.max_blocks * self.block_size


GPU_GEOMETRY = Geometry(32, 8, 128, 16, "bfloat16", 256, 64)
TINY_GEOMETRY = Geometry(4, 2, 64, 16, "float16", 16, 8)


def _dtype(name: str):
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


# ---------------------------------------------------------------------------------------------
# batch builder


@dataclasses.dataclass
class Batch:
    query: object
    key_cache: object
    value_cache: object
    block_table: object
    query_start_loc: object
    seq_lens: object
    num_tokens: int
    capacity: int
    starts: list  # first query row of each request


def make_request(q_len: int, seq_len: int, geo: Geometry, gen) -> Request:
    """Random request content on ``gen``'s device."""
    import torch

    assert 0 <= q_len <= seq_len <= geo.capacity

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=gen.device).to(_dtype(geo.dtype))

    return Request(q=rnd(q_len, geo.heads, geo.head_size), k=rnd(seq_len, geo.kv_heads, geo.head_size),
                   v=rnd(seq_len, geo.kv_heads, geo.head_size))


def _garbage(shape, gen, dtype):
    """Stale cache content: NaN, with +-inf and large finite values mixed in."""
    import torch

    sel = torch.rand(shape, generator=gen, device=gen.device)
    g = torch.full(shape, float("nan"), device=gen.device)
    g[sel < 0.2] = float("inf")
    g[(sel >= 0.2) & (sel < 0.3)] = -float("inf")
    g[(sel >= 0.3) & (sel < 0.5)] = 3.0e4
    return g.to(dtype)


def reservations(reqs: list[Request], geo: Geometry, policies=POLICIES) -> list[int]:
    """Tokens of pages each request owns: the most any of ``policies`` makes the engine reserve."""
    from dhp_backend.ops.buckets import reserved_tokens

    return [max(reserved_tokens(p, r.seq_len, geo.capacity) for p in policies) for r in reqs]


def assemble(reqs: list[Request], geo: Geometry, *, seed: int, device, pad_tokens: int = 0,
             policies=POLICIES) -> Batch:
    """Lay ``reqs`` into one packed step with a fresh paged cache.

    The block table obeys the address rule for every policy of ``policies``: request
    i owns distinct real pages (a random layout, `testing.pages.reserved_table`) up to
    `reservations`; the cache has a quarter more blocks than that, unowned. Every slot
    a request has not written holds garbage (its reserved pages past its length too),
    table entries past a request's reservation are random block ids, padding query
    rows are NaN. What a request's rows may depend on is exactly its own data.
    """
    import torch

    from dhp_backend.testing.pages import pages_for, reserved_table

    layout = random.Random(seed)
    dgen = torch.Generator(device=device).manual_seed(seed)
    bs = geo.block_size
    reserve = reservations(reqs, geo, policies)
    owned = [pages_for(t, bs) for t in reserve]
    num_blocks = 1 + sum(owned) + 4 + sum(owned) // 4  # block 0: the null block, never owned
    kv_shape = (num_blocks, geo.kv_heads, bs, geo.head_size)
    kc, vc = _garbage(kv_shape, dgen, _dtype(geo.dtype)), _garbage(kv_shape, dgen, _dtype(geo.dtype))
    table = reserved_table(reserve, block_size=bs, num_blocks=num_blocks, width=geo.max_blocks, layout="random",
                           seed=seed)
    for i, n in enumerate(owned):
        if n < geo.max_blocks:
            table[i, n:] = torch.tensor([layout.randrange(num_blocks) for _ in range(geo.max_blocks - n)],
                                        dtype=torch.int32)
    T = sum(r.q_len for r in reqs)
    query = torch.full((T + pad_tokens, geo.heads, geo.head_size), float("nan"), device=device,
                       dtype=_dtype(geo.dtype))
    starts, row = [], 0
    for i, r in enumerate(reqs):
        if r.seq_len:
            pos = torch.arange(r.seq_len, device=device)
            blk = table[i, : owned[i]].to(device=device, dtype=torch.long)[pos // bs]
            kc[blk, :, pos % bs] = r.k.to(device)
            vc[blk, :, pos % bs] = r.v.to(device)
        query[row: row + r.q_len] = r.q.to(device)
        starts.append(row)
        row += r.q_len
    qsl = [0]
    for r in reqs:
        qsl.append(qsl[-1] + r.q_len)
    i32 = dict(dtype=torch.int32, device=device)
    return Batch(query=query, key_cache=kc, value_cache=vc, block_table=table.to(device),
                 query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor([r.seq_len for r in reqs], **i32),
                 num_tokens=T + pad_tokens, capacity=geo.capacity, starts=starts)


# ---------------------------------------------------------------------------------------------
# the attention under test, and the checks (any ``attn(batch, policy) -> out[:num_tokens]`` works)


def seam_attention(path: str):
    """``attn(batch, policy)`` through `ops.paged_attention` on ``path`` ("triton" or "reference")."""
    import torch

    from dhp_backend.ops import bucket_for_step, paged_attention

    def attn(batch: Batch, policy: str):
        out = torch.full_like(batch.query, float("nan"))
        b = bucket_for_step(policy, max_model_len=batch.capacity, seq_lens=batch.seq_lens)
        paged_attention(batch.query, batch.key_cache, batch.value_cache, batch.block_table, batch.query_start_loc,
                        batch.seq_lens, out, scale=batch.query.shape[2] ** -0.5, causal=True, policy=policy,
                        bucket=b, num_tokens=batch.num_tokens, path=path, allow_fallback=True)
        return out[: batch.num_tokens]

    return attn


def _bits(t):
    import torch

    as_int = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.detach().contiguous().view(as_int).cpu()


def same_bits(a, b) -> tuple[bool, str]:
    """Bitwise equality (NaN-safe); when not equal, how many elements differ and by how much."""
    import torch

    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    ba, bb = _bits(a), _bits(b)
    if torch.equal(ba, bb):
        return True, ""
    n = int((ba != bb).sum())
    diff = (a.float() - b.float()).abs()
    diff = diff[torch.isfinite(diff)]
    return False, f"{n} of {ba.numel()} elements differ (max |diff| {float(diff.max()) if diff.numel() else 'nan'})"


def _check(name: str, scope: str, compared: int, failures: list[str]) -> dict:
    return {"check": name, "scope": scope, "compared": compared, "passed": not failures and compared > 0,
            "failures": failures[:10], "failed": len(failures)}


def check_repeat(attn, batch: Batch, runs: int, policy: str = "strict") -> dict:
    first = attn(batch, policy).clone()
    failures = []
    for i in range(1, runs):
        ok, why = same_bits(first, attn(batch, policy))
        if not ok:
            failures.append(f"run {i}: {why}")
    return _check("repeat", f"{runs} runs, {len(batch.starts)} requests, {batch.num_tokens} rows, {policy}",
                  runs - 1, failures)


def check_policies(attn, batch: Batch, policies=POLICIES) -> dict:
    first = attn(batch, policies[0])
    failures = []
    for p in policies[1:]:
        ok, why = same_bits(first, attn(batch, p))
        if not ok:
            failures.append(f"{policies[0]} vs {p}: {why}")
    return _check("policies", f"{', '.join(policies)} on {len(batch.starts)} requests", len(policies) - 1, failures)


def check_batch_invariance(attn, target: Request, pool: list[Request], sizes, geo: Geometry, *, policy: str,
                           seed: int, device, orders: int = 2, name: str = "target") -> dict:
    """``target``'s rows alone vs inside batches of ``sizes`` requests (``orders`` shuffles each)."""
    rng = random.Random(seed)

    def rows(reqs, pos, pad, layout_seed):
        b = assemble(reqs, geo, seed=layout_seed, device=device, pad_tokens=pad, policies=(policy,))
        out = attn(b, policy)
        s = b.starts[pos]
        return out[s: s + target.q_len].clone()

    alone = rows([target], 0, 0, seed)
    failures, compared = [], 0
    for n in sizes:
        for o in range(orders):
            others = rng.sample(pool, min(n - 1, len(pool)))
            pos = rng.randint(0, len(others))
            reqs = others[:pos] + [target] + others[pos:]
            ok, why = same_bits(alone, rows(reqs, pos, rng.randint(0, 3), rng.randrange(2**31)))
            compared += 1
            if not ok:
                failures.append(f"batch of {len(reqs)} (target at {pos}, order {o}): {why}")
    return _check("batch invariance", f"{name} (q_len {target.q_len}, seq_len {target.seq_len}) alone vs batches "
                  f"of {','.join(map(str, sizes))} x {orders} orders, {policy}", compared, failures)


# ---------------------------------------------------------------------------------------------
# one part: its requests and checks


def run_part(part: str, cfg: dict, attn=None) -> dict:
    """The checks of one part (``gpu``, ``interpret`` or ``reference``) in this process."""
    import torch

    t0 = time.time()
    gpu = part == "gpu"
    device = "cuda" if gpu else "cpu"
    geo = GPU_GEOMETRY if gpu else TINY_GEOMETRY
    path = "reference" if part == "reference" else "triton"
    runs = cfg["interpret_runs"] if part == "interpret" else cfg["runs"]
    sizes = cfg["interpret_sizes"] if part == "interpret" else cfg["sizes"]
    policies = tuple(cfg["policies"])
    attn = attn or seam_attention(path)
    rng = random.Random(cfg["seed"])
    gen = torch.Generator(device=device).manual_seed(cfg["seed"])
    cap = geo.capacity

    def rand_req():
        q = 1 if rng.random() < 0.7 else rng.randint(2, geo.max_chunk)
        return make_request(q, rng.randint(q, cap), geo, gen)

    targets = {"decode": make_request(1, cap - cap // 4 - 3, geo, gen),
               "chunk": make_request(min(16, geo.max_chunk), cap // 2 + 5, geo, gen)}
    pool = [rand_req() for _ in range(max(sizes) + 2)]
    mixed = assemble(list(targets.values()) + pool[: min(14, len(pool))], geo, seed=cfg["seed"] + 1,
                     device=device, pad_tokens=3, policies=policies)
    checks = [check_repeat(attn, mixed, runs, policies[0]), check_policies(attn, mixed, policies)]
    for pol in policies:
        for tname, target in targets.items():
            checks.append(check_batch_invariance(attn, target, pool, sizes, geo, policy=pol, seed=cfg["seed"] + 2,
                                                 device=device, orders=cfg["orders"], name=tname))
    info = {"part": part, "path": path, "device": torch.cuda.get_device_name() if gpu else "cpu",
            "geometry": dataclasses.asdict(geo), "checks": checks, "passed": all(c["passed"] for c in checks),
            "seconds": round(time.time() - t0, 1)}
    if path == "triton":
        import triton

        info["triton"] = triton.__version__
        info["interpreter"] = os.environ.get("TRITON_INTERPRET") == "1"
    return info


def _child(part: str, cfg: dict) -> int:
    res = run_part(part, cfg)
    print(MARK + json.dumps(res), flush=True)
    return 0


def run_part_in_child(part: str, cfg: dict, timeout: float) -> dict:
    """``part`` in a fresh process, Triton imported in interpreter mode for ``interpret`` only."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if part == "interpret":
        env["TRITON_INTERPRET"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, "-m", "dhp_backend.audit.bits", "--child", part, "--child-config", json.dumps(cfg)]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"part": part, "passed": False, "checks": [], "error": f"child exceeded {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    tail = (proc.stdout[-2000:] + "\n" + proc.stderr[-3000:]).strip()
    return {"part": part, "passed": False, "checks": [], "seconds": round(time.time() - t0, 1),
            "error": f"child exit {proc.returncode}, no result: {tail}"}


# ---------------------------------------------------------------------------------------------
# the gate


def available_parts() -> list[str]:
    import importlib.util

    parts = []
    try:
        import torch

        if torch.cuda.is_available() and importlib.util.find_spec("triton"):
            parts.append("gpu")
    except ImportError:
        pass
    if importlib.util.find_spec("triton"):
        parts.append("interpret")
    return parts + ["reference"]


def _ints(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise ValueError(f"expected comma-separated positive integers, got {text!r}")
    return vals


def config_from_args(args) -> dict:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"--policies: {p!r}; accepted: {', '.join(POLICIES)}")
    if args.runs < 2 or args.interpret_runs < 2:
        raise ValueError("--runs and --interpret-runs must be at least 2")
    return {"runs": args.runs, "sizes": _ints(args.sizes), "interpret_runs": args.interpret_runs,
            "interpret_sizes": _ints(args.interpret_sizes), "policies": policies, "orders": args.orders,
            "seed": args.seed}


def gate(args, progress=print) -> dict:
    cfg = config_from_args(args)
    parts = [p.strip() for p in args.parts.split(",")] if args.parts else available_parts()
    for p in parts:
        if p not in PARTS:
            raise ValueError(f"--parts: {p!r}; accepted: {', '.join(PARTS)}")
    t0 = time.time()
    results = []
    for p in parts:
        progress(f"G3 bits: part {p} ...")
        r = run_part(p, cfg) if p == "reference" else run_part_in_child(p, cfg, args.timeout)
        results.append(r)
        progress(f"G3 bits: part {p}: {'pass' if r['passed'] else 'FAIL'} ({r.get('seconds', '?')} s)"
                 + (f" {r['error'][:400]}" if r.get("error") else ""))
    device = next((r["device"] for r in results if r["part"] == "gpu" and r.get("device")), "cpu")
    s = {"gate": "G3 bits", "device": device, "scope": "+".join(parts), "config": cfg,
         "passed": bool(results) and all(r["passed"] for r in results), "parts": results,
         "seconds": round(time.time() - t0, 1), "versions": versions()}
    if args.report_dir:
        s["reports"] = list(write_reports(args.report_dir, s))
    return s


def print_summary(s: dict, out=print) -> None:
    out(f"G3 bits gate: {'PASS' if s['passed'] else 'FAIL'}  ({s['scope']}, {s['seconds']} s)")
    for r in s["parts"]:
        out(f"  {r['part']} ({r.get('path', '?')} on {r.get('device', '?')}): {'pass' if r['passed'] else 'FAIL'}")
        if r.get("error"):
            out(f"    error: {r['error'][:600]}")
        for c in r["checks"]:
            if not c["passed"]:
                out(f"    FAIL {c['check']}: {c['scope']}")
                for f in c["failures"][:3]:
                    out(f"      {f[:160]}")
        n_ok = sum(c["passed"] for c in r["checks"])
        out(f"    {n_ok}/{len(r['checks'])} checks pass, {sum(c['compared'] for c in r['checks'])} comparisons")
    if s.get("reports"):
        out(f"  reports: {s['reports'][0]}, {s['reports'][1]}")


def write_reports(report_dir: str, s: dict) -> tuple[str, str]:
    stem, date = report_stem(report_dir, "bits", device_slug(s["device"]))
    v = s["versions"]
    md = [f"# G3 bits gate — {date}, {s['device']}", "",
          f"Result: **{'PASS' if s['passed'] else 'FAIL'}** — parts {s['scope']}, {s['seconds']} s.", "",
          f"Commit {v.get('commit')}, dhp_backend {v.get('dhp_backend')}, torch {v.get('torch')}, Triton "
          f"{v.get('triton')}. Produced by `dhp-backend audit bits`; configuration `{json.dumps(s['config'])}`.", ""]
    for r in s["parts"]:
        md += [f"## {r['part']}: {r.get('path', '?')} path on {r.get('device', '?')}"
               + (" (Triton interpreter)" if r.get("interpreter") else ""), ""]
        if r.get("geometry"):
            md += [f"Geometry: `{json.dumps(r['geometry'])}`.", ""]
        if r.get("error"):
            md += [f"Error: `{r['error'][:2000]}`", ""]
        md += ["| check | scope | comparisons | result | first failures |", "| --- | --- | --- | --- | --- |"]
        for c in r["checks"]:
            md.append(f"| {c['check']} | {c['scope']} | {c['compared']} | {'pass' if c['passed'] else '**FAIL**'} | "
                      f"{'; '.join(c['failures'][:3])} |")
        md.append("")
    return write_report_files(stem, {"date": date, **s}, md)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--parts", help="comma-separated: gpu, interpret, reference (default: all this machine can run)")
    p.add_argument("--runs", type=int, default=100, help="repeat runs on the GPU and reference parts (default 100)")
    p.add_argument("--sizes", default="1,2,3,8,16,32,64",
                   help="batch sizes for batch invariance, GPU and reference parts (default %(default)s)")
    p.add_argument("--interpret-runs", type=int, default=10, help="repeat runs under the interpreter (default 10)")
    p.add_argument("--interpret-sizes", default="1,2,3,5",
                   help="batch sizes under the interpreter (default %(default)s)")
    p.add_argument("--policies", default=",".join(POLICIES), help="policies compared (default %(default)s)")
    p.add_argument("--orders", type=int, default=2, help="shuffled batches per size (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-dir", help="write <date>-bits-<device>.md/.json here (e.g. docs/audit)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per child process (default 1800)")


def run(args) -> int:
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    try:
        s = gate(args, progress=log)
    except ValueError as e:
        print(f"dhp-backend audit bits: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(s, indent=1, default=str))
    else:
        print_summary(s)
    return 0 if s["passed"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dhp_backend.audit.bits", description=__doc__.split("\n")[0])
    ap.add_argument("--child", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--child-config", help=argparse.SUPPRESS)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child, json.loads(args.child_config))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
