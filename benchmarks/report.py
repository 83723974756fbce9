"""What `benchmarks.harness` writes: the JSON (every number), a markdown table, plots, the summary.

The summary's keys (worst case = min over the shapes named; null when no shape
had both inputs; ``detail[key]`` says which shape was worst, which shapes were
counted and which lacked an input):

- ``decode_off_vs_fa3``: DHP ``off`` useful GB/s over FA3's, every batch of the
  ``decode`` family at context >= 4K;
- ``prefill_off_vs_fa3``: the same with TFLOP/s, ``prefill`` family, S >= 4K,
  causal and non-causal;
- ``prefill_off_vs_fa3_gqa7``: the same for the ``prefill_gqa7`` family (the
  Qwen2.5-7B attention: 28 query / 4 KV heads, a GQA ratio that is not a power
  of two), S >= 4K, causal;
- ``mixed_off_vs_fa3``: the same for the ``mixed`` family (a chunked-prefill
  step: one chunk and the decodes of one step); on one step's work the ratio of
  useful rates is FA3's time over DHP's;
- ``strict_efficiency_vs_fa3``: DHP ``strict`` on its executed (padded) work
  over FA3 on the useful work, ``strict`` family; GB/s for decode,
  TFLOP/s for prefill (the rate that bounds the shape);
- ``features_off_vs_fa3``: DHP ``off`` over FA3 with the same features
  (useful GB/s for decode, TFLOP/s otherwise: on one step, FA3's time over
  DHP's), ``features`` family (run on request: null in a default run);
- ``e2e_off_vs_flash_attn``: end to end, DHP ``off`` output tokens/s over
  FLASH_ATTN's, neither batch-invariant;
- ``e2e_off_bi_vs_flash_attn_bi``: DHP ``off`` under ``VLLM_BATCH_INVARIANT=1``
  over FLASH_ATTN under it (issue 30's target);
- ``e2e_vs_flash_attn_batch_invariant``: DHP (any policy) under
  ``VLLM_BATCH_INVARIANT=1`` over FLASH_ATTN under it.
Where a file has several rows of one configuration, the worst case takes the
slowest DHP row over the fastest FLASH_ATTN row.
"""

from __future__ import annotations

import json
import math
import os

SUMMARY_KEYS = ("decode_off_vs_fa3", "prefill_off_vs_fa3", "prefill_off_vs_fa3_gqa7", "mixed_off_vs_fa3",
                "strict_efficiency_vs_fa3", "features_off_vs_fa3", "e2e_off_vs_flash_attn", "e2e_off_bi_vs_flash_attn_bi",
                "e2e_vs_flash_attn_batch_invariant")
JSON_NAME, MD_NAME = "bench.json", "bench.md"


# ------------------------------------------------------------------ summary

def _rows_by_case(rows):
    out: dict = {}
    for r in rows:
        out.setdefault(r["case"], {})[r["anchor"]] = r
    return out


def _ok(r) -> bool:
    return r is not None and r.get("status") == "ok" and bool(r.get("time_ms"))


def _rate(r, which: str, bound: str) -> float | None:
    key = f"{which}_GBps" if bound == "memory" else f"{which}_TFLOPs"
    return r.get(key)


def _worst(per_case: dict, pick) -> dict:
    """min over cases of ``pick(anchors of the case)`` (None = an input missing)."""
    counted, missing = {}, []
    for name, anchors in per_case.items():
        v = pick(anchors)
        if v is None:
            missing.append(name)
        else:
            counted[name] = v
    if not counted:
        return {"value": None, "worst_shape": None, "counted": 0,
                "missing": missing or ["no shape of this key in the run"], "complete": False}
    worst = min(counted, key=counted.get)
    return {"value": counted[worst], "worst_shape": worst, "counted": len(counted), "missing": missing,
            "complete": not missing}


def _kernel_keys(rows) -> dict:
    by_case = _rows_by_case(rows)

    def cases(pred):
        return {n: a for n, a in by_case.items() if pred(next(iter(a.values())))}

    def ratio(num_anchor, num_which):
        def pick(anchors):
            a, f = anchors.get(num_anchor), anchors.get("fa3")
            if not (_ok(a) and _ok(f)):
                return None
            bound = f["bound"]
            num, den = _rate(a, num_which, bound), _rate(f, "useful", bound)
            return num / den if num and den else None
        return pick

    return {
        "decode_off_vs_fa3": _worst(cases(lambda r: r["family"] == "decode" and r["ctx"] >= 4096),
                                    ratio("dhp_off", "useful")),
        "prefill_off_vs_fa3": _worst(cases(lambda r: r["family"] == "prefill" and r["ctx"] >= 4096),
                                     ratio("dhp_off", "useful")),
        "prefill_off_vs_fa3_gqa7": _worst(cases(lambda r: r["family"] == "prefill_gqa7" and r["ctx"] >= 4096),
                                          ratio("dhp_off", "useful")),
        "mixed_off_vs_fa3": _worst(cases(lambda r: r["family"] == "mixed"), ratio("dhp_off", "useful")),
        "strict_efficiency_vs_fa3": _worst(cases(lambda r: r["family"] == "strict"),
                                           ratio("dhp_strict", "executed")),
        "features_off_vs_fa3": _worst(cases(lambda r: r["family"] == "features"), ratio("dhp_off", "useful")),
    }


def _read_e2e(path: str) -> tuple[object, str | None]:
    """(the parsed end-to-end JSON, None) or (None, why it cannot be read)."""
    try:
        with open(path) as f:
            return json.load(f), None
    except (OSError, ValueError) as exc:
        return None, f"cannot read {path}: {type(exc).__name__}: {exc}"


def _e2e_rows(doc, source: str) -> tuple[list | None, str | None]:
    """(the ``results`` rows of one run's report, None) or (None, why not)."""
    rows = doc.get("results") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        return None, f"{source}: no 'results' list"
    return rows, None


def load_e2e(path: str | None) -> tuple[list | None, str | None]:
    """(rows of the end-to-end JSON, None) or (None, why not)."""
    if not path:
        return None, "no --e2e-json given"
    doc, why = _read_e2e(path)
    return (None, why) if why else _e2e_rows(doc, path)


def load_e2e_runs(paths) -> list[tuple[str, list | None, str | None]]:
    """[(source, rows, why)] of end-to-end JSON files, in the order given. A file of several runs side by side
    (``parts``: one report per GPU, as `docs/bench/e2e-address-rule-h200.json`) gives one run per part,
    ``<path>#gpu<N>``, so that a ratio never pairs rows of two GPUs."""
    runs = []
    for path in paths or []:
        doc, why = _read_e2e(path)
        parts = doc.get("parts") if isinstance(doc, dict) else None
        if why or not isinstance(parts, list):
            runs.append((path, None, why) if why else (path, *_e2e_rows(doc, path)))
            continue
        for i, part in enumerate(parts):
            src = f"{path}#gpu{part.get('gpu', i) if isinstance(part, dict) else i}"
            runs.append((src, *_e2e_rows(part, src)))
    return runs


def _e2e_keys(rows: list | None, why: str | None) -> dict:
    def usable(r):
        t = r.get("output_tok_per_s")
        return (r.get("status", "ok") == "ok" and isinstance(t, (int, float)) and not isinstance(t, bool)
                and t > 0 and math.isfinite(t))

    def is_fa(r):
        return str(r.get("backend", "")).upper() in ("FLASH_ATTN", "FLASH_ATTENTION", "FA3")

    def is_dhp(r):
        return str(r.get("backend", "")).upper() == "DHP"

    def pair(dhp_pred, fa_pred):
        if rows is None:
            return {"value": None, "worst_shape": None, "counted": 0, "missing": [why], "complete": False}
        ok = [r for r in rows if isinstance(r, dict) and usable(r)]
        dhp = [r for r in ok if is_dhp(r) and dhp_pred(r)]
        fa = [r for r in ok if is_fa(r) and fa_pred(r)]
        if not dhp or not fa:
            lacking = [w for w, xs in (("DHP row", dhp), ("FLASH_ATTN row", fa)) if not xs]
            return {"value": None, "worst_shape": None, "counted": 0, "missing": lacking, "complete": False}
        slow = min(dhp, key=lambda r: r["output_tok_per_s"])
        fast = max(fa, key=lambda r: r["output_tok_per_s"])
        label = (f"{slow.get('config') or 'DHP'} (policy {slow.get('policy')}, batch_invariant "
                 f"{bool(slow.get('batch_invariant'))}) vs {fast.get('config') or 'FLASH_ATTN'}")
        return {"value": slow["output_tok_per_s"] / fast["output_tok_per_s"], "worst_shape": label,
                "counted": len(dhp), "missing": [], "complete": True}

    return {
        "e2e_off_vs_flash_attn": pair(lambda r: r.get("policy") == "off" and not r.get("batch_invariant"),
                                      lambda r: not r.get("batch_invariant")),
        "e2e_off_bi_vs_flash_attn_bi": pair(lambda r: r.get("policy") == "off" and bool(r.get("batch_invariant")),
                                            lambda r: bool(r.get("batch_invariant"))),
        "e2e_vs_flash_attn_batch_invariant": pair(lambda r: bool(r.get("batch_invariant")),
                                                  lambda r: bool(r.get("batch_invariant"))),
    }


def _e2e_keys_first_complete(runs: list[tuple[str | None, list | None, str | None]]) -> dict:
    """Each e2e key from the first run (in the order given, newest first) that has
    both sides of its pair, so a ratio always comes from one run; ``source`` names
    the run's file. Keys no run completes say what each run lacked."""
    out: dict = {}
    per_run = [(path, _e2e_keys(rows, why)) for path, rows, why in runs] or [(None, _e2e_keys(None, "no run"))]
    for key in per_run[0][1]:
        done = next(((p, d[key]) for p, d in per_run if d[key]["complete"]), None)
        if done:
            out[key] = {**done[1], "source": done[0]}
        else:
            missing = [f"{p}: {m}" if p and len(per_run) > 1 else m for p, d in per_run for m in d[key]["missing"]]
            out[key] = {**per_run[0][1][key], "missing": missing, "source": None}
    return out


def summarize(rows: list[dict], *, e2e_rows=None, e2e_why: str | None = None, device=None, commit=None,
              e2e_runs: list | None = None) -> dict:
    """The top-level ``summary`` object (see the module docstring).

    ``e2e_runs``: [(path, rows, why)] of several end-to-end runs (see
    `_e2e_keys_first_complete`); else the single run ``e2e_rows``/``e2e_why``.
    """
    e2e = _e2e_keys_first_complete(e2e_runs) if e2e_runs is not None else _e2e_keys(e2e_rows, e2e_why)
    detail = {**_kernel_keys(rows), **e2e}
    out: dict = {k: detail[k]["value"] for k in SUMMARY_KEYS}
    out.update(device=device, commit=commit, worst_shape={k: detail[k]["worst_shape"] for k in SUMMARY_KEYS},
               detail=detail)
    return out


# ------------------------------------------------------------------ document

def build(header: dict, ceilings: dict, cases, rows: list[dict], *, e2e_paths: list | None = None) -> dict:
    copy_bw = ceilings.get("copy", {}).get("GBps")
    mm = ceilings.get("matmul", {}).get("TFLOPs")
    for r in rows:
        r["frac_copy_bw"] = r["useful_GBps"] / copy_bw if r.get("useful_GBps") and copy_bw else None
        r["frac_matmul"] = r["useful_TFLOPs"] / mm if r.get("useful_TFLOPs") and mm else None
    runs = load_e2e_runs(e2e_paths)
    summary = summarize(rows, e2e_runs=runs or None, e2e_why="no --e2e-json given", device=header["device"]["name"],
                        commit=header.get("commit"))
    return {"header": {**header, "e2e_json": list(e2e_paths or [])}, "ceilings": ceilings,
            "cases": [c.describe() for c in cases], "rows": rows, "summary": summary}


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def dumps(doc: dict) -> str:
    """The document as JSON: indented, except that each row is one line (the rows
    are most of the bytes, and the repository travels to the GPU machine)."""
    doc = _jsonable(doc)
    rows = doc.get("rows")
    if not isinstance(rows, list):
        return json.dumps(doc, indent=1)
    mark = "@@ROWS@@"
    text = json.dumps({**doc, "rows": mark}, indent=1)
    body = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in rows)
    return text.replace(json.dumps(mark), "[\n" + body + "\n ]" if rows else "[]")


def write(doc: dict, out_dir: str, *, latest: str | None = None, plots: bool = True) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    text = dumps(doc)
    paths = [os.path.join(out_dir, JSON_NAME), os.path.join(out_dir, MD_NAME)]
    with open(paths[0], "w") as f:
        f.write(text + "\n")
    pngs, plot_note = draw(doc, out_dir) if plots else ([], "plots skipped (--no-plots)")
    with open(paths[1], "w") as f:
        f.write(markdown(doc, pngs=[os.path.basename(p) for p in pngs], plot_note=plot_note))
    if plot_note:
        print(plot_note, flush=True)
    if latest:
        os.makedirs(os.path.dirname(os.path.abspath(latest)), exist_ok=True)
        with open(latest, "w") as f:
            f.write(text + "\n")
        paths.append(latest)
    return paths + pngs


# ------------------------------------------------------------------ markdown

def _f(x, spec: str = ".3f", none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}x"


COLUMNS = ("case", "anchor", "status", "mode", "median ms (p10-p90)", "useful GB/s", "useful TFLOP/s",
           "executed GB/s", "executed TFLOP/s", "vs FA3", "vs FlashInfer", "rel err")
FAMILY_TITLES = {"decode": "Decode", "prefill": "Prefill, one request of S tokens",
                 "mixed": "Mixed chunked-prefill step", "head64": "Head size 64", "gqa": "GQA ratios",
                 "strict": "Strict policy at max_model_len above the true lengths",
                 "features": "Model features: sliding window, logits soft-cap, attention sinks"}


def _family_title(fam: str, rows: list[dict]) -> str:
    shapes = sorted({(r["heads"][0], r["heads"][1], r["head_size"], r["dtype"]) for r in rows})
    desc = "; ".join(f"{hq}/{hkv} heads, d {d}, {dt}" for hq, hkv, d, dt in shapes)
    return f"{FAMILY_TITLES.get(fam, fam)} ({desc})"


def table(rows: list[dict]) -> list[str]:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        t = (f"{r['time_ms']:.4g} ({r['p10_ms']:.4g}-{r['p90_ms']:.4g})" if r.get("time_ms") else "-")
        status = r["status"] if len(r["status"]) <= 90 else r["status"][:87] + "..."
        lines.append("| " + " | ".join([
            r["case"], r["anchor"], status.replace("|", "/"), r.get("mode") or "-", t,
            _f(r.get("useful_GBps"), ".4g"), _f(r.get("useful_TFLOPs"), ".3g"),
            _f(r.get("executed_GBps"), ".4g"), _f(r.get("executed_TFLOPs"), ".3g"),
            _ratio(r.get("vs_fa3")), _ratio(r.get("vs_flashinfer")),
            _f(r.get("rel_err"), ".1e")]) + " |")
    return lines


def _features_of(r: dict) -> str:
    parts = [f"window {r['sliding_window']}" if r.get("sliding_window") else "",
             f"cap {r['logits_soft_cap']:g}" if r.get("logits_soft_cap") else "",
             "sinks" if r.get("sinks") else ""]
    return ", ".join(p for p in parts if p) or "none"


def features_table(rows: list[dict]) -> list[str]:
    """The ``features`` family's ratios, one line per case ([] without such rows):
    DHP ``off`` against FA3 (FA3's time over DHP's, > 1: DHP faster; the issue asks
    >= 0.9), and the constant-time policies' time over ``off``'s on the same step
    (what the address rule costs a windowed layer: the walk covers the bucket, not
    the window)."""
    by_case = {n: a for n, a in _rows_by_case(rows).items()
               if next(iter(a.values()))["family"] == "features"}
    if not by_case:
        return []

    def ms(r):
        return f"{r['time_ms']:.4g}" if _ok(r) else "-"

    def over(num, den):
        return _ratio(num["time_ms"] / den["time_ms"]) if _ok(num) and _ok(den) else "-"

    lines = ["| features case | features | FA3 ms | DHP off ms | off vs FA3 | strict ms | strict / off | "
             "request ms | request / off |", "|" + " --- |" * 9]
    for name, a in by_case.items():
        fa3, off, strict, request = (a.get(k) for k in ("fa3", "dhp_off", "dhp_strict", "dhp_request"))
        lines.append("| " + " | ".join([
            name, _features_of(next(iter(a.values()))), ms(fa3), ms(off), over(fa3, off),
            ms(strict), over(strict, off), ms(request), over(request, off)]) + " |")
    return lines


def summary_text(doc: dict) -> str:
    s = doc["summary"]
    lines = ["| summary key | value | worst shape | shapes counted | lacking an input |",
             "| --- | --- | --- | --- | --- |"]
    for k in SUMMARY_KEYS:
        d = s["detail"][k]
        lines.append(f"| {k} | {_f(s[k], '.3f', 'null')} | {d['worst_shape'] or '-'} | {d['counted']} | "
                     f"{', '.join(map(str, d['missing'])) or '-'} |")
    return "\n".join(lines)


def markdown(doc: dict, *, pngs=(), plot_note: str | None = None) -> str:
    h = doc["header"]
    v = h["versions"]
    provenance = (f"commit {h.get('commit')}; torch {v.get('torch')} (CUDA {v.get('cuda')}), Triton "
                  f"{v.get('triton')}, vLLM {v.get('vllm')}, FlashInfer {v.get('flashinfer')}; clock: "
                  f"{h['settings']['clock']}; {h['settings']['reps']} timed launches per row at most (fewer "
                  f"for long ones), {h['settings']['warmup']} warm-up.")
    out = [f"# benchmarks.harness: {h['device']['name']}, {h['date']}", "", provenance, ""]
    for k, c in doc["ceilings"].items():
        val = (f"{c['GBps']:.0f} GB/s" if "GBps" in c else f"{c['TFLOPs']:.1f} TFLOP/s" if "TFLOPs" in c
               else c.get("status"))
        out.append(f"- ceiling {k}: {val}" + (f" ({c['what']})" if c.get("what") else ""))
    legend = ("Ratios `vs FA3` / `vs FlashInfer`: that anchor's median time over this row's, on the same step "
              "(> 1: this row is faster). `useful` counts the true lengths (K+V once, Q, O; causal triangle); "
              "`executed` is what DHP strict/request walk (every query row to its bucket L). "
              "docs/bench/README.md explains every column.")
    out += ["", "## Summary", "", summary_text(doc), "", legend, ""]
    feature_lines = features_table(doc["rows"])
    if feature_lines:
        out += ["## Model features: DHP off vs FA3, and the constant-time policies' cost", "",
                "`off vs FA3`: FA3's time over DHP off's on the same step (> 1: DHP faster). `strict / off`, "
                "`request / off`: a constant-time policy's time over off's; on a windowed layer the "
                "constant-time walk covers the whole bucket (the address rule), off's only the window.",
                ""] + feature_lines + [""]
    rows = doc["rows"]
    for fam in dict.fromkeys(r["family"] for r in rows):
        fam_rows = [r for r in rows if r["family"] == fam]
        out += [f"## {_family_title(fam, fam_rows)}", ""] + table(fam_rows) + [""]
    notes = [(r["case"], r["anchor"], n) for r in rows for n in r.get("notes", [])]
    if notes:
        out += ["## Notes per row", ""] + [f"- {c} / {a}: {n}" for c, a, n in notes] + [""]
    if pngs:
        out += ["## Plots", ""] + [f"![{p}]({p})" for p in pngs] + [""]
    elif plot_note:
        out += [f"_{plot_note}_", ""]
    return "\n".join(out)


# ------------------------------------------------------------------ plots

def draw(doc: dict, out_dir: str) -> tuple[list[str], str | None]:
    """Bandwidth vs context (a panel per decode batch) and TFLOP/s vs length (prefill); needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed (pip install matplotlib to get them)"
    rows = [r for r in doc["rows"] if r["status"] == "ok"]
    paths = []
    copy_bw = doc["ceilings"].get("copy", {}).get("GBps")
    mm = doc["ceilings"].get("matmul", {}).get("TFLOPs")
    specs = [
        ("decode_bandwidth.png", [r for r in rows if r["family"] == "decode"], "batch", "B={}",
         "ctx", "context (tokens)", "useful_GBps", "useful GB/s", copy_bw, "copy bandwidth"),
        ("prefill_tflops.png", [r for r in rows if r["family"] == "prefill"], "causal",
         "causal={}", "ctx", "sequence length S", "useful_TFLOPs", "useful TFLOP/s", mm, "bf16 GEMM"),
    ]
    for fname, sel, panel_key, panel_fmt, xkey, xlabel, ykey, ylabel, ceiling, ceiling_label in specs:
        if not sel:
            continue
        panels = sorted({r[panel_key] for r in sel})
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
        for ax, pv in zip(axes[0], panels):
            pr = [r for r in sel if r[panel_key] == pv]
            for anchor in dict.fromkeys(r["anchor"] for r in pr):
                pts = sorted((r[xkey], r[ykey]) for r in pr if r["anchor"] == anchor)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", lw=1.2, label=anchor)
            if ceiling:
                ax.axhline(ceiling, color="grey", ls="--", lw=1, label=ceiling_label)
            ax.set_xscale("log", base=2)
            ax.set(title=panel_fmt.format(pv), xlabel=xlabel, ylabel=ylabel)
            ax.grid(alpha=0.3)
        axes[0][-1].legend(fontsize=7)
        fig.suptitle(f"{doc['header']['device']['name']}, commit {doc['header'].get('commit')}", fontsize=9)
        fig.tight_layout()
        path = os.path.join(out_dir, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths, None if paths else "no plots: no timed decode/prefill rows"
