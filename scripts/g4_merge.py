"""Merge the G4 reports of a multi-GPU call (scripts/g4_pieces.sh) into one report.

    python scripts/g4_merge.py <seed-report-dir> <g4.tgz or an unpacked folder> [--out DIR]

Every piece resumed from the seed report, so each of its reports holds the seed's rows plus its own.
This takes the rows the seed lacks (by `timing.row_key`), refuses pieces of another device or another
measured code (`source`, `timing.source_hash`), refuses two pieces that measured the same cell, and writes
the merged report with `timing.write_reports` (default: over the seed, in place).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tarfile
import tempfile

from dhp_backend.audit import timing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("seed", help="folder of the seed report (g4-latest.json)")
    ap.add_argument("pieces", help="the call's g4.tgz, or the folder it unpacks to")
    ap.add_argument("--out", default=None, help="folder of the merged report (default: the seed's)")
    args = ap.parse_args(argv)
    seed_path = os.path.join(args.seed, timing.LATEST + ".json")
    with open(seed_path) as f:
        seed = json.load(f)
    folder = args.pieces
    if os.path.isfile(folder):
        folder = tempfile.mkdtemp(prefix="g4-pieces-")
        with tarfile.open(args.pieces) as tar:
            tar.extractall(folder, filter="data")
    have = {timing.row_key(r) for r in seed["rows"]}
    new, last = {}, None
    for path in sorted(glob.glob(os.path.join(folder, "audit*", timing.LATEST + ".json"))):
        with open(path) as f:
            doc = json.load(f)
        if (doc["device"], doc.get("source")) != (seed["device"], seed.get("source")):
            sys.exit(f"{path}: {doc['device']} at code {doc.get('source')}, the seed is {seed['device']} at code "
                     f"{seed.get('source')}: not mergeable")
        rows = [r for r in doc["rows"] if timing.row_key(r) not in have]
        for r in rows:
            if timing.row_key(r) in new:
                sys.exit(f"{path}: {timing.row_key(r)} was measured by two pieces; give each cell to one piece")
            new[timing.row_key(r)] = r
        print(f"{path}: {len(rows)} new rows")
        last = doc
    if not new:
        print("no new rows: nothing written")
        return 1
    meta = {k: last[k] for k in ("device", "versions", "source", "settings")}
    meta.update(churn=last.get("churn") or {}, seconds=0)
    out = args.out or args.seed
    paths, s = timing.write_reports(out, list(new.values()), meta, merge_from=seed_path, date=last["date"],
                                    log=print)
    print(f"{paths[0]}: {len(s['missing'])} cells of the full grid missing; gating rows "
          f"{'all pass' if s['gating_passed'] else 'not all pass'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
