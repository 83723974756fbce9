#!/usr/bin/env bash
# G4 on a machine of several GPUs: one piece of the grid per GPU, side by side, in one device call.
#   bash scripts/g4_pieces.sh <time-budget-s> <pieces-file> [seed-report-dir]
# Line i of <pieces-file> holds `dhp-backend audit timing` options for GPU i (blank lines skipped).
# Every piece runs with --resume from the same seed report (default docs/audit: its g4-latest.json), into
# its own report directory, and with --time-budget <s> so it stops before the call's 10-minute limit.
# The device returns at most 8 files from a call, so everything (reports, logs, the setup's logs) comes
# back as one tarball, $OUT/g4.tgz, rewritten every 15 s: a call cut short keeps what it measured.
# Then, on your machine: python scripts/g4_merge.py <seed-report-dir> <the tarball>.
# A pair's two classes run interleaved on one GPU, so no row compares GPUs with each other. Give each
# null pair and control to exactly one piece (--no-null / --no-control on the others): two pieces that
# measure the same cell both run it.
set -uo pipefail
OUT=${OUT:-/tmp/out}; B=$1; PIECES=$2; SEED=${3:-docs/audit}
W=/tmp/g4-pieces; rm -rf $W; mkdir -p $W
OUT_REAL=$OUT
OUT=$W bash scripts/device_run.sh >"$W/setup.log" 2>&1; tail -1 "$W/setup.log"
. /root/gpu-stack/env.sh; export PYTHONPATH=$PWD:$PYTHONPATH
[ -f .dhp-commit ] && export DHP_COMMIT=$(cat .dhp-commit)
nvidia-smi -L; n=$(nvidia-smi -L | wc -l)
i=0
while read -r line; do
  [ -z "$line" ] && continue
  [ $i -ge $n ] && { echo "no GPU for piece $i (this machine has $n): $line"; i=$((i+1)); continue; }
  d=$W/audit$i; mkdir -p $d; cp "$SEED"/g4-latest.json "$SEED"/g4-latest.md $d/ 2>/dev/null
  echo "GPU $i: $line"
  # shellcheck disable=SC2086  # the line is options, split on purpose
  CUDA_VISIBLE_DEVICES=$i timeout $((B + 100)) python3 -m dhp_backend.cli audit timing $line --resume \
    --time-budget "$B" --report-dir $d >$W/g4-$i.log 2>&1 &
  i=$((i+1)); sleep 2
done <"$PIECES"
( while sleep 15; do tar czf "$OUT_REAL/g4.tgz.tmp" -C $W . 2>/dev/null && mv "$OUT_REAL/g4.tgz.tmp" "$OUT_REAL/g4.tgz"; done ) &
TP=$!
wait $(jobs -p | grep -v "^$TP$")
kill $TP 2>/dev/null
for f in $W/g4-*.log; do
  echo "== $f"; grep -E "^  (control|null|gating|reported) " "$f" | cut -c1-160; tail -2 "$f" | cut -c1-200
done
tar czf "$OUT_REAL/g4.tgz" -C $W . && ls -la "$OUT_REAL"
