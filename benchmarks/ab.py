"""`python -m benchmarks.ab`: csrc variants against each other, alternating in one process tree, FA3 beside.

    python -m benchmarks.ab --variant base \\
        --variant 'nosnap:prefill_sm90.cu:constexpr bool kSnapCT = kHead != 256;=>constexpr bool kSnapCT = false;' \\
        --cases "strict prefill" --anchors fa3,dhp_strict --rounds 2 --out $OUT/ab

(from the repository root, on the GPU machine). Every kernel lever of docs/perf-notes.md was measured this
way: the same harness cases (`benchmarks.harness`, which checks every row against the reference before
timing it) run once per variant and round, the variants alternating within each round so that the card's
drift falls on all of them alike, each run with ``DHP_CSRC`` pointing at that variant's copy of ``csrc/``
(the build cache keys on the sources, so each variant builds its own libraries once). The table compares
each variant's DHP rows with the first variant's and with FA3 timed in the same run.

A variant is ``NAME`` (this tree's ``csrc/``), ``NAME:DIR`` (a csrc directory, e.g. another commit's from
``git archive REV csrc | tar -x -C DIR``) or ``NAME:FILE:OLD=>NEW`` (this tree's csrc with the exact text
OLD of csrc/FILE replaced by NEW; OLD must occur exactly once); repeat ``--variant`` with one NAME to
apply several edits. Writes ``ab.json`` and ``ab.md`` to ``--out`` (and every run's harness output below it).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

REPO = pathlib.Path(__file__).resolve().parent.parent
CSRC = REPO / "csrc"
ACCEPTED = "NAME, NAME:DIR (a csrc directory) or NAME:FILE:OLD=>NEW (an exact, unique text of csrc/FILE)"


class VariantError(ValueError):
    """A --variant that cannot be built; the message names what was wrong and what is accepted."""


@dataclass
class Variant:
    name: str
    source: pathlib.Path = CSRC
    edits: list[tuple[str, str, str]] = field(default_factory=list)  # (file, old, new)


def parse_variants(specs: list[str], csrc: pathlib.Path = CSRC) -> list[Variant]:
    """The variants in the order first named; edits of one NAME accumulate."""
    out: dict[str, Variant] = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        name = name.strip()
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise VariantError(f"--variant {spec!r}: the name {name!r} is not a word (letters, digits, - and _); "
                               f"accepted: {ACCEPTED}")
        v = out.setdefault(name, Variant(name, csrc))
        if not rest:
            continue
        if "=>" not in rest:
            d = pathlib.Path(rest).expanduser()
            if not d.is_dir():
                raise VariantError(f"--variant {spec!r}: {rest!r} is neither a directory nor FILE:OLD=>NEW; "
                                   f"accepted: {ACCEPTED}")
            if v.edits or v.source != csrc:
                raise VariantError(f"--variant {spec!r}: {name!r} already has sources or edits; a directory "
                                   f"variant stands alone; accepted: {ACCEPTED}")
            v.source = d.resolve()
            continue
        file, _, edit = rest.partition(":")
        old, _, new = edit.partition("=>")
        if not file or not old:
            raise VariantError(f"--variant {spec!r}: an edit needs FILE and OLD text; accepted: {ACCEPTED}")
        v.edits.append((file, old, new))
    names = list(out)
    if len(names) < 2:
        raise VariantError(f"--variant given {len(names)} distinct name(s): an A/B needs at least two; "
                           f"accepted: {ACCEPTED}")
    return list(out.values())


def materialize(v: Variant, root: pathlib.Path) -> pathlib.Path:
    """The variant's csrc directory under ``root`` (a copy with its edits applied)."""
    if not (v.source / "prefill_sm90.cu").exists():
        raise VariantError(f"variant {v.name!r}: {v.source} holds no prefill_sm90.cu (not a csrc directory); "
                           f"accepted: {ACCEPTED}")
    dst = root / v.name / "csrc"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(v.source, dst)
    for file, old, new in v.edits:
        path = dst / file
        if not path.is_file():
            raise VariantError(f"variant {v.name!r}: csrc/{file} does not exist; accepted: a file of "
                               f"{sorted(p.name for p in dst.iterdir() if p.is_file())}")
        text = path.read_text()
        n = text.count(old)
        if n != 1:
            raise VariantError(f"variant {v.name!r}: the text {old!r} occurs {n} times in csrc/{file}; "
                               f"accepted: a text that occurs exactly once")
        path.write_text(text.replace(old, new))
    return dst


def run_harness(out: pathlib.Path, csrc: pathlib.Path, harness_args: list[str], log) -> dict:
    """One harness run with DHP_CSRC=csrc; its bench.json, or {"error": ...}."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DHP_CSRC=str(csrc))
    cmd = [sys.executable, "-m", "benchmarks.harness", *harness_args, "--no-plots", "--out", str(out)]
    t0 = time.time()
    with open(out / "harness.log", "w") as f:
        r = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    log(f"    {out.name}: exit {r.returncode} in {time.time() - t0:.0f} s")
    bench = out / "bench.json"
    if r.returncode != 0 or not bench.exists():
        tail = (out / "harness.log").read_text()[-1500:]
        return {"error": f"harness exit {r.returncode}: {tail}"}
    return json.loads(bench.read_text())


def _is_dhp(anchor: str) -> bool:
    return anchor.startswith("dhp")


def compare(runs: dict[str, list[dict]]) -> dict:
    """{variant: [bench.json per round]} -> rows: per (case, DHP anchor), each variant's times per round, the
    median of its ratios against FA3 of the same run, and its median time against the first variant's.
    A row whose status is not "ok" in any run (wrong result, not available) gets no number."""
    names = list(runs)
    keys: list[tuple[str, str]] = []
    cell: dict[tuple, dict] = {}
    for v in names:
        for bench in runs[v]:
            for r in bench.get("rows", []):
                k = (r["case"], r["anchor"])
                if k not in cell:
                    keys.append(k)
                c = cell.setdefault(k, {}).setdefault(v, {"times": [], "vs_fa3": [], "status": []})
                c["status"].append(r.get("status"))
                if r.get("status") == "ok" and r.get("time_ms") is not None:
                    c["times"].append(float(r["time_ms"]))
                    if r.get("vs_fa3") is not None and r["anchor"] != "fa3":
                        c["vs_fa3"].append(float(r["vs_fa3"]))
    rows = []
    for case, anchor in keys:
        per = cell[(case, anchor)]
        if not _is_dhp(anchor):
            times = [t for v in names for t in per.get(v, {}).get("times", [])]
            bad = sorted({s for v in names for s in per.get(v, {}).get("status", []) if s != "ok"})
            rows.append({"case": case, "anchor": anchor, "kind": "anchor", "times": times,
                         "median_ms": statistics.median(times) if times else None, "bad": bad})
            continue
        row = {"case": case, "anchor": anchor, "kind": "dhp", "variants": {}}
        base = None
        for v in names:
            c = per.get(v, {"times": [], "vs_fa3": [], "status": []})
            bad = sorted({s for s in c["status"] if s != "ok"}) or ([] if c["times"] else ["missing"])
            med = statistics.median(c["times"]) if c["times"] and not bad else None
            d = {"times": c["times"], "median_ms": med, "bad": bad,
                 "vs_fa3": statistics.median(c["vs_fa3"]) if c["vs_fa3"] and not bad else None}
            if v == names[0]:
                base = med
            d["vs_first"] = (med / base - 1.0) if (med is not None and base) else None
            row["variants"][v] = d
        rows.append(row)
    return {"variants": names, "rows": rows}


def markdown(result: dict, header: str = "") -> list[str]:
    names = result["variants"]
    out = [f"# csrc A/B: {', '.join(names)}", ""]
    if header:
        out += [header, ""]
    out += ["DHP rows: each variant's time per round (ms), the median of its ratios to FA3 timed in the same run "
            "(> 1: DHP faster), and its median time against the first variant's (negative: faster). Anchor rows: "
            "every run's time.", ""]
    cols = ["case", "anchor"] + [x for v in names for x in (f"{v} ms", f"{v} x FA3")] + [
        f"{v} vs {names[0]}" for v in names[1:]]
    out += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for r in result["rows"]:
        if r["kind"] == "anchor":
            t = ("/".join(f"{x:.4g}" for x in r["times"]) if r["times"] else "-") + (
                f" ({', '.join(r['bad'])})" if r["bad"] else "")
            out.append("| " + " | ".join([r["case"], r["anchor"], t] + [""] * (len(cols) - 3)) + " |")
            continue
        cells = [r["case"], r["anchor"]]
        for v in names:
            d = r["variants"][v]
            if d["bad"]:
                cells += [", ".join(d["bad"]), "-"]
            else:
                cells += ["/".join(f"{x:.4g}" for x in d["times"]),
                          f"{d['vs_fa3']:.3f}" if d["vs_fa3"] is not None else "-"]
        for v in names[1:]:
            x = r["variants"][v]["vs_first"]
            cells.append(f"{100 * x:+.2f} %" if x is not None else "-")
        out.append("| " + " | ".join(cells) + " |")
    return out


def plot(result: dict, path: pathlib.Path) -> str | None:
    """ab.png: each DHP row's time against the first variant's, a bar per other variant (needs matplotlib;
    None without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = result["variants"]
    rows = [r for r in result["rows"] if r["kind"] == "dhp"]
    if not rows or len(names) < 2:
        return None
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) * (len(names) - 1) + 1.5))
    height = 0.8 / (len(names) - 1)
    for k, v in enumerate(names[1:]):
        ys = [i + k * height for i in range(len(rows))]
        xs = [100 * (r["variants"][v]["vs_first"] or 0.0) for r in rows]
        ax.barh(ys, xs, height=height, label=v)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(rows))])
    ax.set_yticklabels([f"{r['case']} ({r['anchor']})" for r in rows], fontsize=7)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.invert_yaxis()
    ax.set_xlabel(f"time against {names[0]}, % (negative: faster; rows without a number at 0)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--variant", action="append", required=True, metavar="SPEC", help=f"repeatable: {ACCEPTED}")
    ap.add_argument("--rounds", type=int, default=2, help="rounds; each runs every variant once (default 2)")
    ap.add_argument("--out", default="ab-out", help="output folder (default ./ab-out)")
    # every other option goes to the harness as given, e.g. --cases 'strict prefill' --anchors fa3,dhp_strict
    args, hargs = ap.parse_known_args(argv)

    def log(m: str) -> None:
        print(m, flush=True)

    if args.rounds < 1:
        print(f"benchmarks.ab: --rounds {args.rounds}; accepted: an integer >= 1", file=sys.stderr)
        return 2
    if any(a in ("--out", "--no-plots", "--latest") for a in hargs):
        print("benchmarks.ab: --out / --no-plots / --latest are set per run here; accepted: the harness's "
              "case, anchor and timing options", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out).resolve()
    try:
        variants = parse_variants(args.variant)
        dirs = {v.name: materialize(v, out / "variants") for v in variants}
    except VariantError as e:
        print(f"benchmarks.ab: {e}", file=sys.stderr)
        return 2
    log(f"benchmarks.ab: {len(variants)} variants x {args.rounds} rounds, harness {' '.join(hargs) or '(defaults)'}")
    runs: dict[str, list[dict]] = {v.name: [] for v in variants}
    errors = []

    def write(done: int, total: int) -> list[str]:
        """ab.json / ab.md from the runs so far (after every run: a call cut short keeps what it measured)."""
        result = compare(runs)
        heads = [b.get("header", {}) for bs in runs.values() for b in bs if b.get("header")]
        dev = heads[0].get("device", {}).get("name") if heads and isinstance(heads[0].get("device"), dict) else None
        commit = heads[0].get("commit") if heads else None
        header = (f"Device {dev or '?'}; tree {commit or '?'}; variants: "
                  + "; ".join(f"{v.name}: " + (f"{v.source}" if v.source != CSRC else "this tree's csrc")
                              + "".join(f", csrc/{f}: {o!r} -> {n!r}" for f, o, n in v.edits) for v in variants)
                  + f"; {args.rounds} rounds, alternating (ABBA); harness {' '.join(hargs)}")
        if done < total:
            header += f"; NOT COMPLETE: {done} of {total} runs"
        result.update(header=header, errors=errors, device=dev, commit=commit, runs_done=done, runs_total=total)
        (out / "ab.json").write_text(json.dumps(result, indent=1))
        md = markdown(result, header) + ([""] + [f"- error: {e[:300]}" for e in errors] if errors else [])
        png = plot(result, out / "ab.png") if done == total else None
        md += ["", "![time against the first variant](ab.png)" if png else "(no ab.png: matplotlib is not installed "
               "here, or the runs are not complete)"]
        (out / "ab.md").write_text("\n".join(md) + "\n")
        return md

    done, total = 0, args.rounds * len(variants)
    for rnd in range(args.rounds):
        order = [v.name for v in variants]
        if rnd % 2:
            order.reverse()  # ABBA: neither variant always runs first
        log(f"  round {rnd + 1}/{args.rounds}: {' -> '.join(order)}")
        for name in order:
            bench = run_harness(out / f"r{rnd + 1}-{name}", dirs[name], hargs, log)
            if "error" in bench:
                errors.append(f"{name} round {rnd + 1}: {bench['error']}")
                bench = {"rows": []}
            runs[name].append(bench)
            done += 1
            if done < total:
                write(done, total)
    md = write(done, total)
    print("\n".join(md))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
