#!/usr/bin/env bash
set -uo pipefail
W=/tmp/w; mkdir -p $W
( while true; do tar -C /tmp -cf $OUT/w.tar w 2>/dev/null; sleep 15; done ) &
T0=$(date +%s)
BUILD_HEADS="128 256" BUILD_FEATURES="none" OUT=$W bash scripts/device_run.sh build > $W/setup.log 2>&1
echo "setup+build $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
. /root/gpu-stack/env.sh
export PYTHONPATH=$PWD:${PYTHONPATH:-} DHP_COMMIT=$(cat .dhp-commit)
timeout 100 python3 -m pytest -q -m gpu tests/test_cuda_decode_gpu.py -p no:cacheprovider > $W/test_decode.log 2>&1
echo "tests rc=$? $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt; tail -3 $W/test_decode.log
SH=B16-32k,B16-r32k,B16-16k,B16-8k,B12-32k,B8-32k,B8-r32k,B4-32k,B4-r32k,B1-32k,B1-4k,B24-32k,B20-32k,B16-r8k,B32-r16k
V=fa3,cuda_auto,cuda_auto:fixed,cuda_auto:fold,cuda_auto:deal264c1,cuda_auto:deal132,cuda_auto:spp8
VR=$(echo $V | tr ',' '\n' | tac | paste -sd,)
for r in A B; do
  VV=$V; [ $r = B ] && VV=$VR
  timeout 100 python3 -m benchmarks.cuda_decode --interleaved --shapes $SH --variants $VV --out $W/bench$r.json > $W/bench$r.log 2>&1
  echo "bench$r rc=$? $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
done
timeout 60 python3 -m benchmarks.cuda_decode --interleaved --heads 28,4 --shapes B16-32k,B16-r32k,B4-32k,B1-16k --variants fa3,cuda_auto,cuda_auto:fixed,cuda_auto:fold --out $W/bench_gqa7.json > $W/bench_gqa7.log 2>&1
echo "gqa7 rc=$? $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
timeout 60 python3 -m benchmarks.cuda_decode --interleaved --heads 16,8,256 --shapes B1-8k-w8k,B1-8k,B2-8k,B4-8k,B16-8k,B16-r8k,B4-r32k --variants fa3,cuda_auto,cuda_auto:fixed,cuda_auto:fold --out $W/bench_h256.json > $W/bench_h256.log 2>&1
echo "h256 rc=$? $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
# feature / head libraries for the window tests (dealt split decode with a window) and last session's pending test
for spec in "128 window" "128 window,softcap" "128 window,sinks" "128 window,softcap,sinks" "64 window,sinks" "64 none" "96 window" "96 none" "96 window,sinks" "80 none" "80 window,sinks" "256 window,softcap" "256 window,sinks"; do
  set -- $spec; f=$2; [ "$f" = none ] && f=""
  python3 -m dhp_backend.cli build --head $1 ${f:+--features $f} >> $W/build2.log 2>&1 &
done
wait
echo "build2 $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt
timeout $(( 575 - ($(date +%s) - T0) )) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_features_gpu.py tests/test_cuda_head_sizes_gpu.py -k "null_pages or one_position" > $W/test_feat.log 2>&1
echo "featt rc=$? $(( $(date +%s) - T0 )) s" | tee -a $W/times.txt; tail -3 $W/test_feat.log
tar -C /tmp -cf $OUT/w.tar w
