"""G1 counters gate (design.md section 3): hardware counters under ``ncu`` are equal across secret classes.

    dhp-backend audit counters [--shapes SPEC,SPEC...] [--features window=W,softcap=C,sinks]
                               [--pairs all|gating|A:B,C:D] [--launches 3]
                               [--report-dir DIR] [--json] [--ncu PATH] [--timeout 300]

Inputs obey the address rule (design.md section 2) through `classes.make_inputs`:
every request of every class reserves its bucket, so a short and a long request
read the very same pages (`testing.pages.reserved_table`).

For every shape and every class of `classes.CLASSES` that a pair needs, ``ncu``
(``--clock-control none``: the clocks are never touched) profiles a child
process of this module (``python -m dhp_backend.audit.counters --child SHAPE
CLASS``) that builds the class's inputs with `classes.make_inputs` and runs
`classes.launch` ``--launches`` times. Then, per pair of `classes.GATING_PAIRS`
+ `classes.REPORTED_PAIRS` + `classes.EXTRA_PAIRS`, the kernels of the last launch are compared kernel
by kernel (same names, grids and blocks, in the same order): every count in
`COUNT_METRICS` identical, `DRAM_METRIC` within `DRAM_TOLERANCE` (relative to
the smaller value). Gating pairs decide the gate; reported pairs (degenerate
data) are listed with their verdicts but do not fail it.

Arguments:
    --shapes     comma-separated shape specs: ``B16-L4096-q1`` style tokens (``B`` requests,
                 ``L`` bucket, ``q`` query tokens per request, optional ``h32x8``, ``d128``,
                 ``bs16``, a dtype, a policy, a page layout, ``nb<blocks>``, the features
                 ``win<W>``, ``softcap<C>``, ``sinks`` and ``triton`` (the Triton kernels
                 forced: ``path=triton``); omitted parts are `classes.Shape`
                 defaults). Default: decode B=16 L=4096, B=64 L=4096, B=16 L=32768,
                 prefill chunk B=4 q=64; strict; random page layout; the cache size of
                 `classes.default_num_blocks` (at least 25,000 blocks).
    --features   attention features of every shape (issue 31; `audit.features`):
                 ``window=W``, ``softcap=C``, ``sinks``, ``heads=QxKVxD``, ``path=triton``,
                 comma-separated (default none). A layer of head 256, 128, 96, 80 or 64 with
                 any of them runs the csrc kernels' feature library, other layers (and every
                 layer with ``path=triton``) the Triton kernels (`plan.step_kernel`); either's
                 constant-time walk of a windowed layer is the whole bucket (docs/kernels.md
                 sections 6 and 7): the classes are the plain ones. Each pair's row carries
                 ``features`` ("" for plain attention); the ncu runs table names the path and
                 kernel of each child. The csrc feature binaries: ``--features
                 window=1024,softcap=50 --shapes B16-L4096-q1,B4-L4096-q64,B16-L4096-q1-request
                 --pairs gating`` (3 shapes x 4 classes = 12 ncu runs, about 2 minutes); the
                 Triton ones: the same with ``,path=triton``.
    --dram-tolerance  relative DRAM-bytes tolerance of the rule (default 0.01, design.md section 3).
    --pairs      ``all`` (default: gating + reported), ``gating``, or explicit ``A:B`` pairs.
    --launches   launches per child; the last one is compared (default 3).
    --report-dir write ``<date>-counters-<device>.md`` and ``.json`` there.
    --json       print the summary as JSON instead of text.
    --ncu        the ncu executable (default: ``ncu`` on PATH).
    --timeout    seconds allowed per ncu run (default 300; the first one compiles the kernels).

`run` returns 0 (pass), 1 (a gating pair differs, or a profile could not be
taken) or 2 (no CUDA GPU or no ncu here). Expected time: 8 classes x 4 shapes
= 32 ncu runs of about 6 s each on an H100/H200 (plus building each class's
25,000-block cache), about 3-4 minutes.

Which launch is profiled: ``--launch-skip`` counts only kernels that match the
name filter, and how many kernels one launch runs (the attention kernel, plus
the merge kernel in split mode) is a host decision this module does not
duplicate. So the child's first ``launches - 1`` kernels are skipped (every
launch runs at least one) and everything after is profiled; with ``R`` records
and ``K`` kernels per launch, ``R = launches * K - (launches - 1)``, which
gives ``K`` and the last launch is the last ``K`` records.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from dhp_backend.audit import counters_pc
from dhp_backend.audit import features as feats
from dhp_backend.audit.provenance import device_slug, report_stem, versions, write_report_files

METRICS = (
    "smsp__inst_executed.sum",
    "smsp__sass_inst_executed_op_branch.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum",
    "dram__bytes_read.sum",
)
DRAM_METRIC = "dram__bytes_read.sum"
COUNT_METRICS = tuple(m for m in METRICS if m != DRAM_METRIC)
DRAM_TOLERANCE = 0.01
# The Triton kernels and the csrc prefill kernel (its CT binary runs constant-time
# prefill steps) and decode kernel (its CT binaries run constant-time decode steps).
KERNEL_FILTER = "regex:attention_kernel|merge_kernel|prefill_v2_ct_kernel|prefill_v2_kernel|decode_v2_kernel"
DEFAULT_SHAPES = ("B16-L4096-q1", "B64-L4096-q1", "B16-L32768-q1", "B4-L4096-q64")
SHORT_NAMES = {
    "smsp__inst_executed.sum": "instructions",
    "smsp__sass_inst_executed_op_branch.sum": "branches",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "ld requests",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "ld sectors",
    "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum": "st requests",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": "st sectors",
    "dram__bytes_read.sum": "DRAM bytes read",
}

# ---------------------------------------------------------------------------------------------
# shapes


def parse_shape(spec: str):
    """A `classes.Shape` from ``B16-L4096-q1`` style tokens (also accepts `Shape.key`). Policy ``batch``
    was retired (its step-wide bucket cannot be reserved): it is an unknown part."""
    from dhp_backend.audit import classes

    kw: dict = {}
    for tok in (t for t in spec.strip().split("-") if t):
        if m := re.fullmatch(r"B(\d+)", tok):
            kw["batch"] = int(m[1])
        elif m := re.fullmatch(r"L(\d+)", tok):
            kw["bucket"] = int(m[1])
        elif m := re.fullmatch(r"q(\d+)", tok):
            kw["q_len"] = int(m[1])
        elif m := re.fullmatch(r"h(\d+)x(\d+)", tok):
            kw["num_heads"], kw["num_kv_heads"] = int(m[1]), int(m[2])
        elif m := re.fullmatch(r"d(\d+)", tok):
            kw["head_size"] = int(m[1])
        elif m := re.fullmatch(r"bs(\d+)", tok):
            kw["block_size"] = int(m[1])
        elif tok in ("bfloat16", "float16", "float32"):
            kw["dtype"] = tok
        elif tok in classes.POLICIES:
            kw["policy"] = tok
        elif tok in classes.LAYOUTS:
            kw["layout"] = tok
        elif m := re.fullmatch(r"nb(\d+)", tok):
            kw["num_blocks"] = int(m[1])
        elif tok in ("causal", "noncausal"):
            kw["causal"] = tok == "causal"
        elif m := re.fullmatch(r"win([1-9]\d*)", tok):
            kw["sliding_window"] = int(m[1])
        elif (m := re.fullmatch(r"softcap(\d+(?:\.\d*)?)", tok)) and float(m[1]) > 0:
            kw["logits_soft_cap"] = float(m[1])
        elif tok == "sinks":
            kw["sinks"] = True
        elif tok == "triton":
            kw["path"] = "triton"
        else:
            raise ValueError(f"shape spec {spec!r}: unknown part {tok!r} (expected B<n>, L<n>, q<n>, h<n>x<n>, "
                             f"d<n>, bs<n>, a dtype, a policy ({', '.join(classes.POLICIES)}), a layout "
                             f"({', '.join(classes.LAYOUTS)}), nb<n>, causal/noncausal, win<n> (n >= 1), softcap<x> (x > 0), sinks, "
                             f"triton)")
    try:
        return classes.Shape(**kw)
    except ValueError as e:
        raise ValueError(f"shape spec {spec!r}: {e}") from None


def parse_shapes(shapes: str, features: str = ""):
    """The shapes of ``--shapes``, each with the attention features of ``--features`` (`audit.features`;
    a shape may name its own features in its spec instead, not both)."""
    extra = feats.parse(features)
    out = []
    for spec in (x for x in shapes.split(",") if x.strip()):
        shape = parse_shape(spec)
        if extra:
            own = feats.of(shape)
            if not extra.geometry:  # the spec always names a geometry: a conflict only if --features does too
                own = dataclasses.replace(own, geometry=())
            if own:
                raise ValueError(f"shape spec {spec!r} names features ({own.label}) and --features gives "
                                 f"{extra.label}; accepted: features in one of the two")
            shape = dataclasses.replace(shape, **extra.shape_fields())
        out.append(shape)
    if not out:
        raise ValueError("--shapes: no shape given")
    return out


def shape_spec(shape) -> str:
    """The spec `parse_shape` reads back into ``shape`` (`Shape.key` leaves out ``causal``)."""
    return shape.key + ("" if shape.causal else "-noncausal")


def parse_pairs(text: str) -> list[tuple[str, str, bool]]:
    """(class a, class b, gating) for ``all``, ``gating`` or ``a:b,c:d`` (explicit pairs gate)."""
    from dhp_backend.audit import classes

    gating = [(a, b, True) for a, b in classes.GATING_PAIRS]
    if text == "gating":
        return gating
    if text == "all":
        return gating + [(a, b, False) for a, b in classes.REPORTED_PAIRS + classes.EXTRA_PAIRS]
    out = []
    for item in (x for x in text.split(",") if x.strip()):
        a, _, b = item.strip().partition(":")
        for c in (a, b):
            if not classes.is_class(c):
                raise ValueError(f"--pairs: class {c!r}; accepted: {classes.accepted_classes()}")
        out.append((a, b, (a, b) in classes.GATING_PAIRS or (b, a) in classes.GATING_PAIRS))
    if not out:
        raise ValueError("--pairs: no pair given")
    return out


# ---------------------------------------------------------------------------------------------
# ncu CSV

_UNIT_SCALE = {"byte": 1, "kbyte": 1e3, "mbyte": 1e6, "gbyte": 1e9, "tbyte": 1e12,
               "kibyte": 2**10, "mibyte": 2**20, "gibyte": 2**30}


def parse_value(text: str, unit: str = ""):
    """A metric value as int (or float), thousands separators removed, scaled to base units.

    ``None`` for ``n/a`` and empty values.
    """
    t = text.strip().replace(",", "").replace("\u202f", "").replace("\u00a0", "").replace(" ", "")
    if not t or t.lower() in ("n/a", "nan", "-"):
        return None
    v = float(t) if any(c in t for c in ".eE") else int(t)
    scale = _UNIT_SCALE.get(unit.strip().lower(), 1)
    if scale != 1:
        v = v * scale
    if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
        v = int(v)
    return v


def parse_ncu_csv(text: str) -> list[dict]:
    """Kernel records, in profile order, from ``ncu --csv`` output.

    The output may interleave ``==PROF==`` lines and the application's own output
    with the CSV; the table starts at the header row that names ``ID`` and
    ``Metric Name``, and only rows with as many fields as the header count.
    Each record: ``id``, ``name``, ``block``, ``grid``, ``metrics`` {name: value},
    ``units`` {name: unit}.
    """
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith('"ID"') and "Metric Name" in ln), None)
    if start is None:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(ln for ln in lines[start:] if ln.startswith('"')))))
    header = rows[0]
    col = {name: i for i, name in enumerate(header)}
    for need in ("ID", "Kernel Name", "Metric Name", "Metric Value"):
        if need not in col:
            raise ValueError(f"ncu CSV: no {need!r} column in header {header}")
    records: dict[str, dict] = {}
    for row in rows[1:]:
        if len(row) != len(header) or row == header:
            continue
        kid = row[col["ID"]]
        rec = records.setdefault(kid, {
            "id": int(kid) if kid.isdigit() else kid, "name": row[col["Kernel Name"]],
            "block": row[col["Block Size"]] if "Block Size" in col else "",
            "grid": row[col["Grid Size"]] if "Grid Size" in col else "", "metrics": {}, "units": {}})
        unit = row[col["Metric Unit"]] if "Metric Unit" in col else ""
        rec["metrics"][row[col["Metric Name"]]] = parse_value(row[col["Metric Value"]], unit)
        rec["units"][row[col["Metric Name"]]] = unit
    return sorted(records.values(), key=lambda r: (not isinstance(r["id"], int), r["id"]))


def last_launch(records: list[dict], launches: int) -> list[dict]:
    """The last launch's kernels, when the first ``launches - 1`` matching kernels were skipped."""
    n = len(records) + launches - 1
    if not records or n % launches:
        raise ValueError(f"{len(records)} kernel profiles after skipping {launches - 1} do not divide into "
                         f"{launches} launches of equally many kernels")
    k = n // launches
    last = records[-k:]
    if launches > 1 and len(records) >= 2 * k:
        prev = records[-2 * k:-k]
        if [r["name"] for r in prev] != [r["name"] for r in last]:
            raise ValueError("the last two launches ran different kernels: "
                             f"{[r['name'] for r in prev]} vs {[r['name'] for r in last]}")
    return last


# ---------------------------------------------------------------------------------------------
# the rule


def compare_metric(metric: str, a, b, dram_tolerance: float = DRAM_TOLERANCE) -> dict:
    """One metric of one kernel: counts identical, DRAM bytes within the tolerance."""
    if a is None or b is None:
        return {"metric": metric, "a": a, "b": b, "diff": None, "rule": "present on both sides", "ok": False}
    if metric == DRAM_METRIC:
        lo = min(a, b)
        rel = 0.0 if a == b else (abs(a - b) / lo if lo > 0 else float("inf"))
        return {"metric": metric, "a": a, "b": b, "diff": (b - a) / a if a else rel,
                "rule": f"within {dram_tolerance * 100:g} %", "ok": rel <= dram_tolerance}
    return {"metric": metric, "a": a, "b": b, "diff": b - a, "rule": "identical", "ok": a == b}


def compare_kernels(ka: list[dict], kb: list[dict], metrics=METRICS,
                    dram_tolerance: float = DRAM_TOLERANCE) -> dict:
    """Two launches' kernel records, kernel by kernel: ``{"passed", "problems", "kernels": [...]}``."""
    problems = []
    if [k["name"] for k in ka] != [k["name"] for k in kb]:
        problems.append(f"different kernels: {[k['name'] for k in ka]} vs {[k['name'] for k in kb]}")
    kernels = []
    for i, (a, b) in enumerate(zip(ka, kb)):
        checks = [compare_metric(m, a["metrics"].get(m), b["metrics"].get(m), dram_tolerance) for m in metrics]
        pa, pb = a.get("per_instruction"), b.get("per_instruction")
        if pa is not None or pb is not None:
            checks = _per_instruction_checks(checks, pa, pb)
        # the launch geometry is public: a grid that moved with a secret would be a leak of its own
        for what in ("grid", "block"):
            checks.append({"metric": what, "a": a.get(what), "b": b.get(what), "diff": None, "rule": "identical",
                           "ok": a.get(what) == b.get(what)})
        kernels.append({"index": i, "name": a["name"], "passed": all(c["ok"] for c in checks), "checks": checks})
    if not ka:
        problems.append("no kernel profiled")
    return {"passed": not problems and all(k["passed"] for k in kernels), "problems": problems, "kernels": kernels}


# Totals that a warp-specialised kernel's wait loops move (counters_pc): for it, they are
# judged per instruction instead.
WAIT_SENSITIVE = ("smsp__inst_executed.sum", "smsp__sass_inst_executed_op_branch.sum")


def _per_instruction_checks(checks: list[dict], pa: dict | None, pb: dict | None) -> list[dict]:
    """The checks of a kernel that has per-instruction profiles: one more check (every instruction
    outside wait loops executes equally often), and the two totals that include the waits are
    judged by it instead of by equality."""
    if not pa or not pb or "error" in pa or "error" in pb:
        why = "; ".join(p["error"] for p in (pa, pb) if p and "error" in p) or "missing on one side"
        return checks + [{"metric": "per-instruction executions", "a": None, "b": None, "diff": None,
                          "rule": "identical outside wait loops", "ok": False, "why": why}]
    pc = counters_pc.compare(pa, pb)
    out = []
    for c in checks:
        if c["metric"] in WAIT_SENSITIVE and not c["ok"] and c["a"] is not None and c["b"] is not None:
            c = dict(c, ok=pc["ok"], rule="identical outside wait loops (per-instruction check below)")
        out.append(c)
    ea, eb = pc.get("executed_outside_waits", (None, None))
    out.append({"metric": "per-instruction executions", "a": ea, "b": eb,
                "diff": pc.get("wait_executions_diff"), "ok": pc["ok"],
                "rule": f"identical outside wait loops ({pc.get('instructions')} instructions, "
                        f"{pc.get('wait_instructions')} in wait loops; diff = wait-loop executions)",
                "why": pc["why"], "differences": pc.get("differences", [])})
    return out


# ---------------------------------------------------------------------------------------------
# the child that ncu profiles


def _child(spec: str, cls: str, launches: int, sidecar: str | None) -> int:
    import torch

    from dhp_backend.audit import classes

    shape = parse_shape(spec)
    inputs = classes.make_inputs(shape, cls, device="cuda")
    out = classes.empty_out(inputs)
    choice, kernel = classes.route(shape, device_capability=torch.cuda.get_device_capability())
    torch.cuda.synchronize()
    for _ in range(launches):
        classes.launch(inputs, out)
    torch.cuda.synchronize()
    if sidecar:
        with open(sidecar, "w") as f:
            json.dump({"shape": shape.key, "cls": cls, "launches": launches, "path": choice.name, "kernel": kernel,
                       "features": shape.features,
                       "path_reason": choice.reason, "device": torch.cuda.get_device_name(),
                       "true_length": classes.true_length(shape, cls), "layout": shape.layout,
                       "num_blocks": shape.blocks, "finite": bool(torch.isfinite(out).all())}, f)
    return 0


def ncu_command(ncu: str, shape_key: str, cls: str, launches: int, sidecar: str) -> list[str]:
    return [ncu, "--clock-control", "none", "--kernel-name", KERNEL_FILTER, "--launch-skip", str(launches - 1),
            "--metrics", ",".join(METRICS), "--csv", "--print-units", "base",
            sys.executable, "-m", "dhp_backend.audit.counters", "--child", shape_key, cls,
            "--launches", str(launches), "--sidecar", sidecar]


def profile(ncu: str, shape, cls: str, launches: int, timeout: float) -> dict:
    """Profile one class of one shape: ``{"kernels": [...last launch...], "child": {...}}`` or ``{"error"}``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the child compiles for the GPU
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory() as tmp:
        sidecar = os.path.join(tmp, "child.json")
        cmd = ncu_command(ncu, shape_spec(shape), cls, launches, sidecar)
        t = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"ncu run exceeded {timeout:.0f} s", "command": " ".join(cmd)}
        child = json.load(open(sidecar)) if os.path.exists(sidecar) else None
    res = {"command": " ".join(cmd), "seconds": round(time.time() - t, 1), "child": child}
    tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-1500:]).strip()
    if proc.returncode != 0 or child is None:
        return {**res, "error": f"ncu exit {proc.returncode}{'' if child else ', the child did not finish'}: {tail}"}
    try:
        records = parse_ncu_csv(proc.stdout)
        res["kernels"] = last_launch(records, launches)
        res["profiled_kernels"] = len(records)
    except ValueError as e:
        return {**res, "error": f"{e}: {tail}"}
    if child.get("path") != "triton":
        res["warning"] = f"the launch ran the {child.get('path')} path ({child.get('path_reason')})"
    ws = [k for k in res["kernels"] if counters_pc.is_warp_specialised(k["name"])]
    if len(ws) > 1:
        return {**res, "error": f"{len(ws)} warp-specialised kernels in one launch; G1 profiles one per launch"}
    if ws:
        ws[0]["per_instruction"] = _profile_per_instruction(ncu, shape, cls, launches, timeout, env)
        res["per_instruction"] = {k: v for k, v in ws[0]["per_instruction"].items() if k != "instrs"}
    return res


def _profile_per_instruction(ncu: str, shape, cls: str, launches: int, timeout: float, env: dict) -> dict:
    """The warp-specialised kernel's per-instruction counts (`counters_pc`), one more ncu run."""
    with tempfile.TemporaryDirectory() as tmp:
        rep = os.path.join(tmp, "pc")
        child = [sys.executable, "-m", "dhp_backend.audit.counters", "--child", shape_spec(shape), cls,
                 "--launches", str(launches), "--sidecar", os.path.join(tmp, "child.json")]
        try:
            p1 = subprocess.run(counters_pc.source_command(ncu, rep, launches, child), capture_output=True,
                                text=True, env=env, timeout=timeout)
            if p1.returncode != 0:
                return {"error": f"ncu SourceCounters exit {p1.returncode}: {(p1.stdout + p1.stderr)[-800:]}"}
            p2 = subprocess.run(counters_pc.import_command(ncu, rep), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"ncu per-instruction run exceeded {timeout:.0f} s"}
        kernels = counters_pc.parse_source_csv(p2.stdout)
    if len(kernels) != 1 or not kernels[0]["instrs"]:
        return {"error": f"expected one kernel's source page, got {len(kernels)}: {p2.stderr[-400:]}"}
    return kernels[0]


# ---------------------------------------------------------------------------------------------
# the gate


def unavailable_reason(ncu: str | None = None) -> str | None:
    """Why G1 cannot run on this machine, or None."""
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        return "no CUDA GPU visible to torch here; G1 runs on the GPU machine"
    if not shutil.which(ncu or "ncu"):
        return f"{ncu or 'ncu'} (Nsight Compute) is not on PATH; G1 profiles with it"
    return None


def gate(args, progress=print) -> dict:
    """Run G1 as ``args`` says; the summary dict (``passed``, ``pairs``, ``reports``...)."""
    import torch

    ncu = shutil.which(args.ncu or "ncu")
    tolerance = float(getattr(args, "dram_tolerance", None) or DRAM_TOLERANCE)
    shapes = parse_shapes(args.shapes, getattr(args, "features", ""))
    pairs = parse_pairs(args.pairs)
    needed = []
    for a, b, _ in pairs:
        needed += [c for c in (a, b) if c not in needed]
    t0 = time.time()
    profiles: dict = {}
    total, n = len(shapes) * len(needed), 0
    progress(f"G1 counters: {len(shapes)} shape(s) x {len(needed)} classes = {total} ncu runs, "
             f"{len(pairs)} pairs")
    ver = versions(ncu)

    def summary(done: list) -> dict:
        """The gate's verdict on the shapes ``done`` (all of them: the run's; fewer: not complete)."""
        results = []
        for shape in done:
            for a, b, gating in pairs:
                pa, pb = profiles[(shape.key, a)], profiles[(shape.key, b)]
                r = {"shape": shape.key, "features": shape.features, "a": a, "b": b, "gating": gating}
                errs = [f"{c}: {p['error']}" for c, p in ((a, pa), (b, pb)) if "error" in p]
                if errs:
                    r.update(passed=False, problems=errs, kernels=[])
                else:
                    r.update(compare_kernels(pa["kernels"], pb["kernels"], dram_tolerance=tolerance))
                r["warnings"] = [p["warning"] for p in (pa, pb) if p.get("warning")]
                results.append(r)
        gating_results = [r for r in results if r["gating"]]
        complete = len(done) == len(shapes)
        scope = f"{len(shapes)} shapes x {len(pairs)} pairs"
        return {"gate": "G1 counters", "device": torch.cuda.get_device_name(), "versions": ver,
                "scope": scope if complete else f"{len(done)} of {scope} (not complete: the run stopped here)",
                "complete": complete, "shapes": [s_.key for s_ in done],
                "passed": complete and bool(gating_results) and all(r["passed"] for r in gating_results),
                "gating_failed": sum(not r["passed"] for r in gating_results),
                "reported_failed": sum(not r["passed"] for r in results if not r["gating"]),
                "seconds": round(time.time() - t0, 1), "dram_tolerance": tolerance, "metrics": list(METRICS),
                "pairs": results,
                "profiles": {f"{k[0]} {k[1]}": {kk: v for kk, v in p.items() if kk != "kernels"} for k, p in
                             profiles.items()}}

    for i, shape in enumerate(shapes):
        for cls in needed:
            n += 1
            p = profile(ncu, shape, cls, args.launches, args.timeout)
            profiles[(shape.key, cls)] = p
            what = (f"ERROR {p['error'][:300]}" if "error" in p else
                    f"{len(p['kernels'])} kernel(s) {','.join(k['name'] for k in p['kernels'])}")
            progress(f"[{n}/{total}] {shape.key} {cls}: {what} ({p.get('seconds', '?')} s; "
                     f"{time.time() - t0:.0f} s elapsed)")
        if args.report_dir and i + 1 < len(shapes):  # a run the device's time limit cuts keeps its shapes
            write_reports(args.report_dir, summary(shapes[: i + 1]))
    s = summary(shapes)
    if args.report_dir:
        s["reports"] = list(write_reports(args.report_dir, s))
    return s


def _fmt(v) -> str:
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.6g}"
    return "-" if v is None else str(v)


def _first_failure(r: dict) -> str:
    if r["problems"]:
        return r["problems"][0][:120]
    for k in r["kernels"]:
        for c in k["checks"]:
            if not c["ok"]:
                d = f"{c['diff']:+.2%}" if c["metric"] == DRAM_METRIC and c["diff"] is not None else ""
                return f"{k['name']}: {SHORT_NAMES.get(c['metric'], c['metric'])} {_fmt(c['a'])} vs {_fmt(c['b'])} {d}"
    return ""


def _dram_diffs(r: dict) -> str:
    out = []
    for k in r["kernels"]:
        for c in k["checks"]:
            if c["metric"] == DRAM_METRIC and c["diff"] is not None:
                out.append(f"{c['diff']:+.2%}")
    return "/".join(out) or "-"


def print_summary(s: dict, out=print) -> None:
    out(f"G1 counters gate: {'PASS' if s['passed'] else 'FAIL'}  ({s['device']}, {s['scope']}, "
        f"{s['seconds']} s; counts identical, DRAM bytes within {s['dram_tolerance'] * 100:g} %)")
    out(f"  {'shape':44} {'features':12} {'pair':18} {'gates':5} {'result':6} DRAM diff  first difference")
    for r in s["pairs"]:
        out(f"  {r['shape'][:44]:44} {r.get('features') or '-':12} {r['a'] + ' vs ' + r['b']:18} "
            f"{'yes' if r['gating'] else 'no':5} "
            f"{'pass' if r['passed'] else 'FAIL':6} {_dram_diffs(r):10} {_first_failure(r)}")
        for w in r.get("warnings", []):
            out(f"      warning: {w}")
    if s.get("reports"):
        out(f"  reports: {s['reports'][0]}, {s['reports'][1]}")


def write_reports(report_dir: str, s: dict) -> tuple[str, str]:
    stem, date = report_stem(report_dir, "counters", device_slug(s["device"]))
    v = s["versions"]
    md = [f"# G1 counters gate — {date}, {s['device']}", "",
          f"Result: **{'PASS' if s['passed'] else 'FAIL' if s['gating_failed'] or s.get('complete', True) else 'NOT COMPLETE'}**"
          f" — {s['scope']}; {s['gating_failed']} gating pair(s) "
          f"failed, {s['reported_failed']} reported pair(s) differ; {s['seconds']} s.", "",
          f"Commit {v.get('commit')}, dhp_backend {v.get('dhp_backend')}, torch {v.get('torch')}, Triton "
          f"{v.get('triton')}, vLLM {v.get('vllm')}, driver {v.get('driver')}, {v.get('ncu')}. Produced by "
          "`dhp-backend audit counters` (`ncu --clock-control none`, kernels `attention_kernel|merge_kernel|"
          "prefill_v2_ct_kernel|prefill_v2_kernel|decode_v2_kernel` of the last of each child's launches). Rule: every count identical, DRAM "
          f"bytes read within {s['dram_tolerance'] * 100:g} %; for the warp-specialised csrc `prefill_v2_ct_kernel` and "
          "`decode_v2_kernel`, whose mbarrier (and setmaxnreg) wait loops spin as long as the hardware takes, the "
          "instruction and branch totals are judged "
          "per SASS instruction instead: every instruction outside the wait loops executes equally often "
          "(ncu SourceCounters; `audit/counters_pc.py`). Gating pairs decide the gate; reported pairs (degenerate "
          "data) do not.", "",
          "## Pairs", "", "| shape | features | pair | gates | result | DRAM diff | first difference |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in s["pairs"]:
        md.append(f"| {r['shape']} | {r.get('features') or '-'} | {r['a']} vs {r['b']} | "
                  f"{'yes' if r['gating'] else 'no'} | "
                  f"{'pass' if r['passed'] else '**FAIL**'} | {_dram_diffs(r)} | {_first_failure(r)} |")
    md += ["", "## Every kernel and metric", ""]
    for r in s["pairs"]:
        md += [f"### {r['shape']}: {r['a']} vs {r['b']} ({'gating' if r['gating'] else 'reported'})", ""]
        for p in r["problems"]:
            md.append(f"- problem: {p}")
        if r["kernels"]:
            md += [f"| kernel | metric | {r['a']} | {r['b']} | diff | rule | verdict |",
                   "| --- | --- | --- | --- | --- | --- | --- |"]
            for k in r["kernels"]:
                for c in k["checks"]:
                    d = (f"{c['diff']:+.3%}" if c["metric"] == DRAM_METRIC and c["diff"] is not None
                         else _fmt(c["diff"]))
                    md.append(f"| {k['index']}: {k['name']} | {c['metric']} | {_fmt(c['a'])} | {_fmt(c['b'])} | "
                              f"{d} | {c['rule']} | {'ok' if c['ok'] else '**differs**'} |")
        md.append("")
    md += ["## ncu runs", "", "| shape class | seconds | kernels profiled | path | kernel | note |",
           "| --- | --- | --- | --- | --- | --- |"]
    for key, p in s["profiles"].items():
        child = p.get("child") or {}
        md.append(f"| {key} | {p.get('seconds')} | {p.get('profiled_kernels', '-')} | {child.get('path', '-')} | "
                  f"{child.get('kernel', '-')} | "
                  f"{(p.get('error') or p.get('warning') or '')[:200]} |")
    return write_report_files(stem, {"date": date, **s}, md)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES),
                   help="comma-separated shape specs like B16-L4096-q1 (default: %(default)s)")
    feats.add_argument(p)
    p.add_argument("--pairs", default="all", help="all | gating | A:B,C:D (default: all)")
    p.add_argument("--launches", type=int, default=3, help="launches per child; the last is compared (default 3)")
    p.add_argument("--report-dir", help="write <date>-counters-<device>.md/.json here (e.g. docs/audit)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--ncu", default="ncu", help="the ncu executable (default: ncu on PATH)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per ncu run (default 300)")
    p.add_argument("--dram-tolerance", type=float, default=DRAM_TOLERANCE,
                   help="DRAM bytes read may differ by this fraction of the smaller value (default %(default)s; "
                        "0.005 = 0.5 %%)")


def run(args) -> int:
    why = unavailable_reason(args.ncu)
    if why:
        print(f"dhp-backend audit counters: {why} (scripts/device_run.sh runs it there).", file=sys.stderr)
        return 2
    if args.launches < 1:
        print("dhp-backend audit counters: --launches must be at least 1", file=sys.stderr)
        return 2
    try:
        parse_pairs(args.pairs)
        parse_shapes(args.shapes, getattr(args, "features", ""))
    except ValueError as e:
        print(f"dhp-backend audit counters: {e}", file=sys.stderr)
        return 2
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (lambda m: print(m, flush=True))
    s = gate(args, progress=log)
    if args.json:
        print(json.dumps({k: v for k, v in s.items() if k != "profiles"}, indent=1, default=str))
    else:
        print_summary(s)
    return 0 if s["passed"] else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dhp_backend.audit.counters", description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("SHAPE", "CLASS"), help=argparse.SUPPRESS)
    ap.add_argument("--sidecar", help=argparse.SUPPRESS)
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child[0], args.child[1], args.launches, args.sidecar)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
