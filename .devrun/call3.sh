#!/usr/bin/env bash
set -uo pipefail
W=/tmp/w; mkdir -p $W
( while true; do tar -C /tmp -cf $OUT/w.tar w 2>/dev/null; sleep 15; done ) &
T0=$(date +%s)
BUILD_HEADS="128" BUILD_FEATURES="none" OUT=$W bash scripts/device_run.sh build > $W/setup.log 2>&1
echo "setup+build $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
. /root/gpu-stack/env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} DHP_COMMIT=$(cat .dhp-commit)
timeout 120 python3 -m benchmarks.cuda_decode --interleaved --kernels --shapes B16-32k,B16-8k,B1-4k,B4-32k --variants fa3,cuda_auto,cuda_auto:fixed --out $W/benchK.json > $W/benchK.log 2>&1
echo "benchK rc=$? $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
tar -C /tmp -cf $OUT/w.tar w
