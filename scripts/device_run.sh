#!/usr/bin/env bash
# One GPU-machine call: bring vLLM 0.24 + FlashInfer (gpu-stack) if this machine
# lacks them, install this package so vLLM finds its plugin, then run the steps
# named in $@ (each logs to $OUT/<step>.log):
#   kernels   GPU-marked kernel tests (tests/test_triton_gpu.py)
#   bench     quick kernel timing vs anchors (benchmarks/quick_kernel_bench.py; BENCH_ARGS)
#   benchbase the same on a baseline package in .work/base (BASE_BENCH_ARGS, default BENCH_ARGS)
#   cudapf    csrc Hopper prefill kernel: probe (subprocess, 240 s limit), GPU tests, bench vs FA3 (benchmarks/cuda_prefill.py; CUDAPF_ARGS)
#   cudadec   csrc Hopper decode kernel: probe (subprocess, 240 s limit), GPU tests, bench vs FA3 (benchmarks/cuda_decode.py; CUDADEC_ARGS)
#   ceiling   Triton with TMA + Hopper warp specialisation, dense and paged (benchmarks/triton_ceiling.py; CEIL_ARGS)
#   harness   benchmarks/harness.py (all anchors incl. FlashInfer; HARNESS_ARGS, e.g. --quick or --cases decode;
#             --cases features: windows/soft-cap/sinks vs FA3, only when named, FlashInfer not needed)
#   e2ethr    integration/e2e_throughput.py: vLLM generation throughput per backend/policy (E2E_ARGS)
#   e2efeat   the same on issue 31's models (E2EFEAT_MODELS, default gemma2-9b mistral-7b: one call; gemma3-12b in
#             another, it takes ~270 s; E2EFEAT_CONFIGS, default fa3,dhp-off; E2EFEAT_S, the step's time, default 500)
#   sustain   decode vs FA3 in bursts and under sustained (power-capped) load (benchmarks/sustained.py; SUSTAIN_ARGS)
#   e2e       integration/gpu_e2e.py (DHP vs FLASH_ATTN through vLLM)
#   serve     the OpenAI server with DHP (strict, off) driven by the openai client (tests/test_server_gpu.py),
#             and in deterministic mode against the offline engine's golden, bit for bit
#             (tests/test_server_golden_gpu.py); SERVE_TEST_S, default 420; logs and answers in $OUT/serve-*
#   startup   engine start-up time, cold caches then warm, per configuration (STARTUP_CONFIGS: fa3 dhp-strict)
#   windowed  the tiny windowed models (Mistral, Gemma-2/3, Phi-3, gpt-oss) through vLLM: DHP vs vLLM's own attention
#   golden    GPU-marked golden round trip (tests/test_golden.py: record solo, check 16 shuffled, chunked prefill)
#   tp2       integration/tp_run.py on 2 GPUs (kind nvidia-h100-x2): every policy at tensor_parallel_size 2, each
#             rank's log, deterministic bits across batchings, FLASH_ATTN tokens and throughput (TP2_ARGS;
#             TP2_S, default 540; report in $OUT/tp2/tp_run.{json,md}, one log per engine in $OUT/tp2/logs)
#   ncu       G1 counters, true length 1 vs L (NCU_SHAPES="B,L ...")
#   audit     G2 SASS gate on the binaries this GPU's Triton compiles and runs
#   g1 g3 g4  the counter, bits and timing gates (dhp-backend audit counters|bits|timing)
#   g2cuda    G2 for the csrc CUDA kernels, built with this machine's nvcc (audit sass-cuda)
#   build     every csrc library (heads 128, 64 and 96, plain and each feature set: BUILD_HEADS, BUILD_FEATURES)
#             into the cache, in parallel, before GPU tests that would build them one by one
#   ncudec    ncu sections + per-SASS stalls of the decode kernel vs FA3 (NCUDEC_SHAPE, NCUDEC_TARGETS: csrc
#             variants, benchmarks.cuda_decode rows such as cuda_auto:fixed cuda_auto:deal264, or fa3)
#   ncuprobe  ncu per-opcode and per-instruction counts of the CT prefill kernel (PROBE_SHAPE)
# Carry: .gpu-stack/bin .gpu-stack/send/core [.gpu-stack/send/flashinfer] [.gpu-stack/send/moe, in a later call]
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The commit of the tree (write it before the call: git rev-parse --short HEAD > .dhp-commit,
# and carry .dhp-commit); the device's copy may hold a stale .git.
[ -f .dhp-commit ] && export DHP_COMMIT=$(cat .dhp-commit)
# FlashInfer is optional (only the harness's anchor needs it). core + flashinfer
# (61.5 MiB) and this repository do not fit one 64 MiB carry: send core in one
# call and flashinfer in the next while the machine is warm (staged parts stay in
# /root/gpu-stack/parts, and install.sh installs every family staged).
parts=""
# The moe family (_moe_C, 18.8 MiB: MoE models such as the tiny gpt-oss of `windowed`) goes over the same
# way, in a call of its own after core's (prepare.sh --with moe).
for p in core flashinfer moe; do [ -d .gpu-stack/send/$p ] && parts="$parts .gpu-stack/send/$p"; done
need=0
[ -f /root/gpu-stack/env.sh ] || need=1
[ -d .gpu-stack/send/flashinfer ] && [ ! -f /root/gpu-stack/env-flashinfer.sh ] && need=1
[ -d .gpu-stack/send/moe ] && ! ls /root/gpu-stack/site/vllm/_moe_C*.so >/dev/null 2>&1 && need=1
if [ $need = 1 ]; then
  { [ -z "$parts" ] || bash .gpu-stack/bin/stage.sh $parts >"$OUT/stage.log" 2>&1; } \
    && GPU_STACK_NO_CHECK=1 bash .gpu-stack/bin/install.sh >"$OUT/install.log" 2>&1 \
    || { echo "gpu-stack install failed (a fresh machine needs .gpu-stack/send/core carried)"
         tail -30 "$OUT/stage.log" "$OUT/install.log" 2>/dev/null; exit 1; }
fi
. /root/gpu-stack/env.sh
export PYTHONPATH=$PWD:$PYTHONPATH
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/pip.log" 2>&1 \
  || { echo "pip install -e . failed"; tail -20 "$OUT/pip.log"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, vllm; print('torch', torch.__version__, '| triton', triton.__version__, '| vllm', vllm.__version__)"
status=0
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case $step in
    kernels) DHP_REPORT_DIR=$OUT python3 -m pytest -q -s -m gpu tests/test_triton_gpu.py -x -p no:cacheprovider 2>&1 \
               | tee "$OUT/kernels.log" | grep -v "^\s*$" | tail -25 ;;
    bench)   python3 -m benchmarks.quick_kernel_bench ${BENCH_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -40 ;;
    benchbase) # the same quick bench on another commit's package, a same-run baseline: make it with
             # git archive BASE dhp_backend benchmarks | tar -x -C .work/base, and carry .work/base. Run from
             # inside .work/base: `python -m` puts the working directory first on sys.path.
             if [ ! -f .work/base/dhp_backend/__init__.py ] || [ ! -f .work/base/benchmarks/__init__.py ]; then
               echo "benchbase: .work/base/{dhp_backend,benchmarks} missing (git archive BASE dhp_backend benchmarks | tar -x -C .work/base; carry .work/base)"
               (exit 2)
             else
               mkdir -p "$OUT/base"
               ( cd .work/base && python3 -c "import dhp_backend; print('baseline package:', dhp_backend.__file__)" \
                 && python3 -m benchmarks.quick_kernel_bench ${BASE_BENCH_ARGS:-${BENCH_ARGS:-}} --out "$OUT/base" ) 2>&1 \
                 | tee "$OUT/benchbase.log" | tail -40
             fi ;;
    cudapf)  # A wrong barrier protocol hangs the GPU: every part under its own timeout.
             timeout 240 python3 -m benchmarks.cuda_prefill --probe 2>&1 | tee "$OUT/cudapf-probe.log" | tail -8 \
             && { timeout ${CUDAPF_TEST_S:-200} python3 -m pytest -q -m gpu tests/test_cuda_prefill_gpu.py -x -p no:cacheprovider 2>&1 \
                    | tee "$OUT/cudapf-tests.log" | grep -v "^\s*$" | tail -12
                  timeout ${CUDAPF_BENCH_S:-300} python3 -m benchmarks.cuda_prefill ${CUDAPF_ARGS:-} --out "$OUT" 2>&1 \
                    | tee "$OUT/cudapf.log" | tail -45; } ;;
    cudadec) # As cudapf: every part under its own timeout.
             timeout 240 python3 -m benchmarks.cuda_decode --probe 2>&1 | tee "$OUT/cudadec-probe.log" | tail -c 3000 \
             && { timeout ${CUDADEC_TEST_S:-240} python3 -m pytest -q -m gpu tests/test_cuda_decode_gpu.py -x -p no:cacheprovider 2>&1 \
                    | tee "$OUT/cudadec-tests.log" | grep -v "^\s*$" | tail -15
                  timeout ${CUDADEC_BENCH_S:-300} python3 -m benchmarks.cuda_decode ${CUDADEC_ARGS:-} --out "$OUT" 2>&1 \
                    | tee "$OUT/cudadec.log" | tail -75; } ;;
    ceiling) python3 -m benchmarks.triton_ceiling ${CEIL_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/ceiling.log" | tail -30 ;;
    harness) ( . /root/gpu-stack/env-flashinfer.sh; export PYTHONPATH=$PWD:$PYTHONPATH
               python3 -m benchmarks.harness ${HARNESS_ARGS:-} --out "$OUT/bench" ) 2>&1 | tee "$OUT/harness.log" | tail -60 ;;
    e2ethr)  python3 -m integration.e2e_throughput --device cuda ${E2E_ARGS:---max-cudagraph-capture-size 256 --time-budget-s 520 --configs fa3,dhp-off,fa3-bi,dhp-strict-bi} \
               --out "$OUT/e2e_throughput.json" 2>&1 | tee "$OUT/e2ethr.log" | tail -40 ;;
    e2efeat) # issue 31's models end to end (docs/bench/e2e-features-h200.md): each model's csrc libraries built
             # first, all models in parallel (dhp-backend build --model on the checkpoint e2e_throughput writes),
             # then E2EFEAT_CONFIGS per model, each run's time budget an equal share of E2EFEAT_S
             models=${E2EFEAT_MODELS:-gemma2-9b mistral-7b}; pids=""
             for m in $models; do
               python3 -c "from pathlib import Path; from integration import e2e_throughput as et; et.write_model('$m', 'bfloat16', Path('/tmp/e2efeat/$m'))" \
                 && { python3 -m dhp_backend.cli build --model /tmp/e2efeat/$m > "$OUT/e2efeat-build-$m.log" 2>&1 & pids="$pids $!"; }
             done
             wait $pids; head -qn1 "$OUT"/e2efeat-build-*.log
             n=$(echo $models | wc -w)
             for m in $models; do
               python3 -m integration.e2e_throughput --model-config $m --configs ${E2EFEAT_CONFIGS:-fa3,dhp-off} \
                 --time-budget-s $(( ${E2EFEAT_S:-500} / n )) --out "$OUT/e2e-$m.json" 2>&1 | tee "$OUT/e2efeat-$m.log" \
                 | grep -E "^\| (fa3|dhp)" || true
             done ;;
    sustain) python3 -m benchmarks.sustained ${SUSTAIN_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/sustain.log" | tail -40 ;;
    serve)   # SIGINT, not TERM, at the time limit: pytest then tears its fixtures down, which ends the
             # servers' sessions (they run in sessions of their own, out of timeout's reach).
             DHP_REPORT_DIR=$OUT timeout -s INT -k 60 ${SERVE_TEST_S:-420} \
               python3 -m pytest -q -m gpu tests/test_server_gpu.py tests/test_server_golden_gpu.py -x -p no:cacheprovider 2>&1 \
               | tee "$OUT/serve.log" | grep -v "^\s*$" | tail -25 ;;
    startup) # engine start-up (LLM() until ready: load, profile, kernel builds, graph capture), Llama-3-8B
             # shape, max_model_len 8192: each configuration on empty caches (vLLM's compile cache,
             # Triton's, DHP's csrc builds), then again on the caches the first start filled
             for cfg in ${STARTUP_CONFIGS:-fa3 dhp-strict}; do
               C=$(mktemp -d)
               for run in cold warm; do
                 VLLM_CACHE_ROOT=$C/vllm TRITON_CACHE_DIR=$C/triton DHP_CUDA_CACHE=$C/dhp timeout 280 \
                   python3 -m integration.e2e_throughput --configs $cfg --num-requests 8 --output-len 8 \
                     --warmup-requests 2 --max-cudagraph-capture-size 256 --out "$OUT/startup-$cfg-$run.json" \
                     > "$OUT/startup-$cfg-$run.log" 2>&1
                 python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print(f'{sys.argv[2]:12s} {sys.argv[3]:5s} init {r.get(\"init_s\")} s  status {r.get(\"status\")}')" \
                   "$OUT/startup-$cfg-$run.json" $cfg $run 2>&1 | tail -1
               done
             done ;;
    windowed) timeout ${WINDOWED_TEST_S:-540} python3 -m pytest -q -m gpu tests/test_e2e_windowed.py -x -p no:cacheprovider 2>&1 \
               | tee "$OUT/windowed.log" | grep -v "^\s*$" | tail -25 ;;
    golden)  timeout ${GOLDEN_TEST_S:-480} python3 -m pytest -q -m gpu tests/test_golden.py -x -p no:cacheprovider 2>&1 \
               | tee "$OUT/golden.log" | grep -v "^\s*$" | tail -25 ;;
    tp2)     timeout -k 30 ${TP2_S:-540} python3 -m integration.tp_run --out "$OUT/tp2" ${TP2_ARGS:-} 2>&1 \
               | tee "$OUT/tp2.log" | tail -60 ;;
    e2e)     python3 -m integration.gpu_e2e --only "${E2E_ONLY:-fa3,dhp,dhp-again,dhp-off,dhp-graphs,bi-solo,bi-reversed}" \
               --out "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" | tail -30 ;;
    build)   for h in ${BUILD_HEADS:-128 64 96}; do
               for f in ${BUILD_FEATURES:-none window softcap sinks window,softcap window,sinks softcap,sinks window,softcap,sinks}; do
                 [ "$f" = none ] && f=""
                 python3 -m dhp_backend.cli build --head $h ${f:+--features $f} >>"$OUT/build.log" 2>&1 &
               done
             done
             wait; echo "built: $(grep -c "built in" "$OUT/build.log") libraries"; grep -i "error" "$OUT/build.log" | head -5 || true ;;
    g2cuda)  python3 -m dhp_backend.cli audit sass-cuda --report-dir "$OUT/audit" 2>&1 | tee "$OUT/g2cuda.log" | tail -12 ;;
    ncudec)  # where the decode time goes: ncu sections of one launch per target of NCUDEC_TARGETS
             # (csrc variants or fa3) on NCUDEC_SHAPE; per-SASS-line stall samples of the first target;
             # NCU_HEADS="16,8,256" for another head geometry (scripts/ncu_decode.py)
             S=${NCUDEC_SHAPE:-B16-32k}; first=1
             for tg0 in ${NCUDEC_TARGETS:-v2 fa3}; do
               tg=${tg0//:/-}  # (file names without ':')
               if [ "$tg" = fa3 ]; then K="--kernel-name-base demangled --kernel-name regex:FlashAttnFwd"
               else K="--kernel-name regex:decode_v2_kernel"; fi
               timeout 240 ncu --clock-control none $K --launch-skip 2 --launch-count 1 \
                 --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
                 --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
                 --section SourceCounters -o "$OUT/ncudec-$tg" -f python3 scripts/ncu_decode.py $S $tg0 \
                 > "$OUT/ncudec-$tg.log" 2>&1; tail -2 "$OUT/ncudec-$tg.log"
               ncu --import "$OUT/ncudec-$tg.ncu-rep" --page details > "$OUT/ncudec-$tg-details.txt" 2>&1
               grep -E "Duration|DRAM Throughput|Memory Throughput|L2 Hit|L1/TEX Hit|Warp Cycles Per Issued|Issued Warp|No Eligible|Registers Per|Achieved Occupancy|Block Limit|Stall|Mem Busy|Max Bandwidth" \
                 "$OUT/ncudec-$tg-details.txt" | head -40
               if [ $first = 1 ]; then
                 ncu --import "$OUT/ncudec-$tg.ncu-rep" --page source --csv --print-source sass \
                   > "$OUT/ncudec-$tg-source.csv" 2>&1; wc -l "$OUT/ncudec-$tg-source.csv"; first=0
               fi
               rm -f "$OUT/ncudec-$tg.ncu-rep"
             done; (exit 0) ;;
    ncuprobe) # what this ncu reports per opcode and per SASS instruction for the CT prefill kernel (G1 design)
             ncu --version | tail -1
             CH="python3 -m dhp_backend.audit.counters --child ${PROBE_SHAPE:-B4-L4096-q64} random --launches 2 --sidecar $OUT/probe-child.json"
             timeout 200 ncu --clock-control none --kernel-name regex:prefill_v2_ct_kernel --launch-skip 1 --launch-count 1 \
               --metrics sass__inst_executed_per_opcode,smsp__inst_executed.sum --print-metric-instances values --csv $CH \
               > "$OUT/ncuprobe-opcode.csv" 2>&1; grep -v "^==PROF" "$OUT/ncuprobe-opcode.csv" | tail -c 3000; echo
             timeout 200 ncu --clock-control none --kernel-name regex:prefill_v2_ct_kernel --launch-skip 1 --launch-count 1 \
               --section SourceCounters -o "$OUT/ncuprobe" -f $CH > "$OUT/ncuprobe-src.log" 2>&1; tail -3 "$OUT/ncuprobe-src.log"
             timeout 100 ncu --import "$OUT/ncuprobe.ncu-rep" --page source --csv --print-source sass \
               > "$OUT/ncuprobe-source.csv" 2>&1; head -c 2000 "$OUT/ncuprobe-source.csv"; echo; wc -l "$OUT/ncuprobe-source.csv"
             rm -f "$OUT/ncuprobe.ncu-rep" ;;
    audit)   python3 -m dhp_backend.cli audit sass --on-device --report-dir "$OUT/audit" 2>&1 | tee "$OUT/audit.log" | tail -20 ;;
    g1)      python3 -m dhp_backend.cli audit counters --report-dir "$OUT/audit" ${G1_ARGS:-} 2>&1 | tee "$OUT/g1.log" | tail -30 ;;
    g3)      python3 -m dhp_backend.cli audit bits --report-dir "$OUT/audit" ${G3_ARGS:---parts gpu,reference} 2>&1 | tee "$OUT/g3.log" | tail -20 ;;
    g4)      python3 -m dhp_backend.cli audit timing --report-dir "$OUT/audit" ${G4_ARGS:-} 2>&1 | tee "$OUT/g4.log" | tail -30 ;;
    ncu)     # G1 spot check: per shape "B,L", every true length 1 vs L (same public parameters)
             for shape in ${NCU_SHAPES:-16,4096}; do
             B=${shape%,*}; L=${shape#*,}
             for n in 1 $L; do
               ncu --clock-control none --kernel-name regex:attention_kernel --launch-skip 2 --launch-count 1 \
                 --metrics dram__bytes_read.sum,smsp__inst_executed.sum,smsp__sass_inst_executed_op_branch.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum \
                 --csv python3 -m benchmarks.quick_kernel_bench --profile base --profile-shape $B,$L,$n \
                 > "$OUT/ncu-B$B-L$L-len$n.csv" 2>"$OUT/ncu-B$B-L$L-len$n.err"
               echo "B=$B L=$L true length $n:"; grep -E "dram__|inst_executed|requests|sectors" "$OUT/ncu-B$B-L$L-len$n.csv" | awk -F'","' '{print "  " $(NF-2) " = " $NF}'
             done
             done; (exit 0) ;;
    prof)    # where the time goes: one launch per shape "B,L" of PROF_SHAPES, ncu sections (no clock control)
             for shape in ${PROF_SHAPES:-16,32768}; do
               ncu --clock-control none --kernel-name regex:attention_kernel --launch-skip 2 --launch-count 1 \
                 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                 --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SourceCounters \
                 python3 -m benchmarks.quick_kernel_bench --profile ${PROF_VARIANT:-base} --profile-shape ${shape},${shape#*,} \
                 > "$OUT/prof-${shape/,/-}.txt" 2>&1
               grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Waves Per SM|Stall|L2 Hit|Local" "$OUT/prof-${shape/,/-}.txt" | head -30
             done; (exit 0) ;;
    *) echo "unknown step $step" ;;
  esac
  rc=${PIPESTATUS[0]}; [ "$rc" = 0 ] || status=$rc
  echo "=== $step exit $rc"
done
cp -r .work/*.log "$OUT/" 2>/dev/null || true
exit $status
