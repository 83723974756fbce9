#!/usr/bin/env bash
set -uo pipefail
W=/tmp/w; mkdir -p $W
( while true; do tar -C /tmp -cf $OUT/w.tar w 2>/dev/null; sleep 15; done ) &
T0=$(date +%s)
BUILD_HEADS=128 BUILD_FEATURES="none" OUT=$W bash scripts/device_run.sh build > $W/setup.log 2>&1
echo "setup+build $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
. /root/gpu-stack/env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} DHP_COMMIT=$(cat .dhp-commit)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $W/gpu.txt
SH=B16-32k,B16-r32k,B16-16k,B16-8k,B12-32k,B8-32k,B8-r32k,B4-32k,B1-32k,B1-4k,B24-32k,B16-r8k,B32-r16k
V=fa3,cuda_auto,cuda_auto:fixed,cuda_auto:deal264c-1,cuda_auto:deal264c0.5,cuda_auto:deal528,cuda_auto:fold
VR=$(echo $V | tr ',' '\n' | tac | paste -sd,)
timeout 170 python3 -m benchmarks.cuda_decode --interleaved --shapes $SH --variants $V --out $W/benchA.json > $W/benchA.log 2>&1
echo "benchA rc=$? $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
timeout 150 python3 -m pytest -q -m gpu tests/test_cuda_decode_gpu.py -x -p no:cacheprovider > $W/test_decode.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt; tail -3 $W/test_decode.log
timeout $(( 560 - ($(date +%s) - T0) )) python3 -m benchmarks.cuda_decode --interleaved --shapes $SH --variants $VR --out $W/benchB.json > $W/benchB.log 2>&1
echo "benchB rc=$? $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
tar -C /tmp -cf $OUT/w.tar w
