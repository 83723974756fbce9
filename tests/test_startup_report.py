"""The start-up report's renderer (`dhp_backend.startup_report`): what the block says under each policy, for
a layer with features, and what it leaves out when another process's block has it. The engine's blocks
(one per process) and `dhp-backend info`'s are checked end to end in test_e2e_cpu_engine.py and
test_reservation.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dhp_backend import startup_report
from dhp_backend.config import DHPConfig, Policy
from dhp_backend.ops import ProblemSpec, cuda_build, plan
from dhp_backend.reservation_price import reservation_price

H100 = ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=128, num_heads=32, num_kv_heads=8,
                   block_size=16, causal=True, device_capability=(9, 0))
BUILDS = (cuda_build.Built("dhp_decode_sm90", "decode_sm90.cu", Path("/c/dhp_decode_sm90-k/libdhp_decode_sm90.so"),
                           "built", "not in the cache: first build of these sources, flags and nvcc", 41.25),
          cuda_build.Built("dhp_prefill_sm90", "prefill_sm90.cu",
                           Path("/c/dhp_prefill_sm90-k/libdhp_prefill_sm90.so"), "cached", "", 0.0))


@pytest.fixture(autouse=True)
def nvcc_here(monkeypatch):
    """Plan as on the GPU machine: nvcc present (no build runs: the builds are given)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: "/usr/local/cuda/bin/nvcc")
    plan.clear_caches()
    yield
    plan.clear_caches()


def block(policy: str, spec=H100, builds=BUILDS, **fields) -> list[str]:
    cfg = DHPConfig(policy=Policy(policy))
    kind = startup_report.LayerKind(spec=spec, path="triton (constant-time): shape covered", layers=32,
                                    routes=startup_report.step_routes(spec, cfg, 8192, builds, num_sms=132),
                                    device_memory_bytes=64 << 20)
    report = startup_report.StartupReport(
        process="pid 7, engine core and worker", config=cfg, max_model_len=8192, vllm="0.24",
        deterministic=startup_report.describe_deterministic(False, batch_invariant=False, cpu=False),
        layer_kinds=(kind,),
        cuda_graphs=startup_report.describe_cuda_graphs({"ALWAYS": "triton"}, "FULL_AND_PIECEWISE"),
        reservation=reservation_price(policy, max_model_len=8192, block_size=16, num_blocks=40_001))
    report = startup_report.StartupReport(**{**report.__dict__, **fields})
    return startup_report.render(report).splitlines()


def test_strict_block():
    lines = block("strict")
    assert lines[:2] == ["DHP 0.1.0 start-up report (vLLM 0.24; pid 7, engine core and worker)",
                         "  policy: strict; bucket L = max_model_len = 8192 (timing reveals only the step geometry)"]
    assert lines[2].startswith("  settings: policy=strict ") and lines[3].startswith("  deterministic mode: off")
    assert lines[4] == ("  32 layers: 32 query heads / 8 KV heads, head size 128, block size 16, bfloat16 on cuda "
                        "(sm_90); features: none")
    assert lines[6] == "    device memory held beyond the KV cache: 64.0 MiB"
    decode, prefill, mixed = lines[7:10]
    assert decode.startswith("    decode steps:   cuda_decode_ct: csrc/decode_sm90.cu") and decode.endswith(
        "; built now in 41.2 s (not in the cache: first build of these sources, flags and nvcc)")
    assert prefill == ("    prefill steps:  cuda_prefill_ct: csrc/prefill_sm90.cu, v2_ct binary; found in the "
                       "build cache (/c/dhp_prefill_sm90-k/libdhp_prefill_sm90.so)")
    assert mixed.startswith("    mixed steps:    cuda_prefill_ct: csrc/prefill_sm90.cu, v2_ct binary")
    assert lines[10] == ("  CUDA graphs: vLLM's mode FULL_AND_PIECEWISE; DHP's attention can be captured in full CUDA "
                         "graphs (declared ALWAYS: path triton)")
    assert lines[11].startswith("  KV reservation: policy 'strict' holds max_model_len=8192 tokens = 512 blocks of 16 "
                                "per request from its first step")
    assert lines[12] == ("  capacity: KV cache: 40,001 blocks of 16 tokens (40,000 usable; block 0 is vLLM's null "
                         "block) -> at most 78 requests at once at this max_model_len")
    assert lines[13].startswith("  instead: policy 'request' would hold each request's next power of two") and (
        "78 of 4097-8192 tokens, 156 of 2049-4096 tokens" in lines[13])
    assert len(lines) == 14


def test_request_block():
    lines = block("request")
    assert lines[1] == ("  policy: request; bucket L = each request's next power of two, capped at max_model_len = "
                        "8192 (timing may reveal the log2 of each request's length)")
    assert lines[7].startswith("    decode steps:   cuda_decode_ct: ")
    assert lines[11].startswith("  KV reservation: policy 'request' holds the next power of two of each request's "
                                "length (at most 2x the length, capped at max_model_len=8192), reserved again")
    assert lines[12].endswith("-> requests at once: 78 of 4097-8192 tokens, 156 of 2049-4096 tokens, 312 of "
                              "1025-2048 tokens, 625 of 513-1024 tokens")
    assert lines[13] == "  instead: policy 'strict' (no length public) would hold 512 blocks per request: 78 at once"


def test_off_block_with_nothing_built_and_another_process_reserving():
    lines = block("off", builds=(), reservation=None,
                  notes=("KV reservation and capacity: in the engine core's block (its scheduler reserves)",))
    assert lines[1] == "  policy: off; true lengths (not constant-time; still deterministic and batch-invariant)"
    assert lines[7].startswith("    decode steps:   cuda_decode: csrc/decode_sm90.cu") and lines[7].endswith(
        "; csrc/decode_sm90.cu: not built in this process")
    assert lines[8].startswith("    prefill steps:  cuda_prefill: csrc/prefill_sm90.cu, v2 binary;")
    assert not [line for line in lines if "KV reservation:" in line and "in the engine core's block" not in line]
    assert lines[-1] == "  KV reservation and capacity: in the engine core's block (its scheduler reserves)"
    off = reservation_price("off", max_model_len=8192, block_size=16, num_blocks=40_001)
    priced = block("off", reservation=off)
    assert priced[11] == ("  KV reservation: none beyond each request's true length (policy 'off': vLLM's own "
                          "allocation)")
    assert priced[13].startswith("  instead: the constant-time policies hold more: 'strict' 512 blocks per request "
                                 "(78 at once)")


def test_a_layer_with_features_says_them_and_runs_every_step_on_triton():
    gemma = ProblemSpec(device_type="cuda", dtype="bfloat16", head_size=256, num_heads=64, num_kv_heads=2,
                        block_size=16, causal=True, device_capability=(9, 0), logits_soft_cap=50.0, sinks=True)
    lines = block("strict", spec=gemma, builds=())
    assert lines[4].endswith("; features: logits soft-cap 50, attention sinks")
    for line in lines[7:10]:
        kernel, rest = line.split(":", 2)[1:]
        assert kernel.strip() == "triton" and "Triton attention_kernel, CONST_TIME, logits soft-cap 50, attention " \
                                              "sinks" in rest
        assert rest.endswith("; Triton's JIT (compiled at its first launch, kept in Triton's cache); not a csrc "
                             "kernel: 32 query heads per KV head (the csrc kernels take at most 16: the decode "
                             "consumer's mma.sync tile); " + startup_report.TRITON_CT_TIMING)
    # The timing gate's verdict on the Triton path is said where constant time was asked for, not under 'off'.
    for line in block("off", spec=gemma, builds=())[7:10]:
        assert line.split(":", 2)[1].strip() == "triton" and "timing gate" not in line


def test_facts_of_other_processes_are_left_out():
    lines = block("strict", layer_kinds=None, cuda_graphs=None,
                  notes=("layers, kernels and CUDA graphs: in each worker process's block (the workers run "
                         "attention)",))
    assert not [line for line in lines if line.startswith(("    ", "  CUDA graphs:", "  32 layers:"))]
    assert lines[4].startswith("  KV reservation: ") and lines[-1].startswith("  layers, kernels and CUDA graphs: in")


def test_deterministic_mode_in_words():
    d = startup_report.describe_deterministic
    assert d(True, batch_invariant=True, cpu=False) == ("on: DHP attention + vLLM's batch-invariant mode "
                                                        "(VLLM_BATCH_INVARIANT=1)")
    assert d(True, batch_invariant=False, cpu=True).startswith("on, DHP attention only: vLLM's batch-invariant mode")
    assert "refuses to start without it" in d(True, batch_invariant=None, cpu=None)
    assert d(False, batch_invariant=True, cpu=False).startswith("off (")


# --- two workers printing their blocks at once (tensor parallelism) -----------------------------------

_WRITER = r"""
import os, sys, time
from dhp_backend.vllm.report import sibling_output_lock
name, locked, out, start = sys.argv[1], sys.argv[2] == "1", sys.argv[3], float(sys.argv[4])
fd = os.open(out, os.O_WRONLY | os.O_APPEND)
def block():
    for i in range(12):  # as vLLM's worker prefix: the prefix and the line in separate writes
        os.write(fd, f"({name}) ".encode()); time.sleep(0.002)
        os.write(fd, f"line {i}\n".encode()); time.sleep(0.002)
# both children start writing at the same moment: each says it is ready (imports done), waits for the
# other (on a loaded machine a child that imported slowly would otherwise start after the other had
# finished, and the control would show no mixing); past the common start time, both take the later
# ready file's time + 0.3 s, which both read alike
open(out + ".ready-" + name.split()[0], "w").close()
readies = []
while len(readies) < 2:
    readies = [f for f in os.listdir(os.path.dirname(out)) if f.startswith(os.path.basename(out) + ".ready-")]
    time.sleep(0.001)
start = max(start, max(os.path.getmtime(os.path.join(os.path.dirname(out), f)) for f in readies) + 0.3)
while time.time() < start:
    time.sleep(0.001)
if locked:
    with sibling_output_lock(os.path.dirname(out)):
        block()
else:
    block()
"""


def _two_writers(tmp_path, locked: bool) -> list[str]:
    import subprocess
    import sys
    import time

    out = tmp_path / f"log-{int(locked)}.txt"
    out.write_text("")
    start = time.time() + 1.5
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, name, str(int(locked)), str(out), str(start)], env=env)
             for name in ("Worker_TP0 pid=1", "Worker_TP1 pid=2")]
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    return out.read_text().splitlines()


def test_sibling_workers_print_their_blocks_one_at_a_time(tmp_path):
    """The workers of one engine (children of one parent) print whole blocks under the lock; the control,
    without it, shows the mixing the lock prevents (lines that hold two prefixes)."""
    unlocked = _two_writers(tmp_path, locked=False)
    assert any(line.count("(Worker_TP") > 1 for line in unlocked), unlocked
    lines = _two_writers(tmp_path, locked=True)
    assert len(lines) == 24 and all(line.count("(Worker_TP") == 1 for line in lines), lines
    owners = [line.split(")")[0] for line in lines]
    assert owners[:12] == [owners[0]] * 12 and owners[12:] == [owners[12]] * 12 and owners[0] != owners[12]
