"""KV-page reservation in vLLM's scheduler (the address rule, design.md section 2).

Unit tests drive vLLM's real ``Scheduler`` and ``KVCacheManager`` on the CPU,
with a fake model runner that samples one token per finished prefill, and look
at the block table the worker would build from each ``SchedulerOutput``: under
``strict`` and ``request`` every scheduled request must own distinct real pages
(never vLLM's null block 0) up to its reservation, before its step runs. One
end-to-end run through vLLM's CPU engine under ``strict`` validates every
step's table in the worker (``DHP_CHECK_VALUES=1``) and gives the bits of a
run under ``off``.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from dhp_backend.config import Policy  # noqa: E402
from dhp_backend.ops.buckets import reserved_tokens  # noqa: E402
from dhp_backend.plugin import register  # noqa: E402
from dhp_backend.vllm import reservation  # noqa: E402
from dhp_backend.vllm.reservation import (  # noqa: E402
    OFF_FLAG,
    ReservationUnavailable,
    ReservingAllocateSlots,
    lookahead_tokens,
)
from dhp_backend.reservation_price import reservation_price  # noqa: E402

MML, BS = 256, 16  # max_model_len, block size: strict holds 16 blocks per request
NUM_KV_HEADS, HEAD_SIZE = 2, 64
TOKEN = 7  # what the fake model runner samples


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """One VllmConfig for the module (building it costs seconds); each scheduler sets what it needs."""
    model = tmp_path_factory.mktemp("llama-config")
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
        "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_SIZE, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 4096,
        "torch_dtype": "float32", "rms_norm_eps": 1e-5}))
    register()  # CUSTOM (alias DHP) -> our backend; the scheduler hook
    mc = ModelConfig(model=str(model), dtype=torch.float32, max_model_len=MML, skip_tokenizer_init=True)
    sc = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MML,
                         enable_chunked_prefill=True, is_encoder_decoder=False)
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BS, enable_prefix_caching=False),
                      scheduler_config=sc, device_config=DeviceConfig(device="cpu"))


@pytest.fixture
def no_cpu_override(monkeypatch):
    """The CPU_ATTN slot is vLLM's own (another test or the shell may have pointed it at DHP)."""
    monkeypatch.delenv("DHP_OVERRIDE_CPU_ATTN", raising=False)
    monkeypatch.delenv("DHP_POLICY", raising=False)
    AttentionBackendEnum.CPU_ATTN.clear_override()
    yield


def make_scheduler(vllm_config, policy: str | None, num_blocks: int, *, backend: str | None = "DHP",
                   groups=None):
    """A scheduler built the way vLLM's engine core builds one (its class from the config)."""
    vllm_config.additional_config = {} if policy is None else {"dhp": {"policy": policy}}
    vllm_config.attention_config.backend = AttentionBackendEnum[backend] if backend else None
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                    kv_cache_groups=groups or [KVCacheGroupSpec(["layer.0", "layer.1"], spec)])
    cls = vllm_config.scheduler_config.get_scheduler_cls()
    return cls(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
               structured_output_manager=StructuredOutputManager(vllm_config), block_size=BS, log_stats=False)


def add(scheduler, name: str, prompt_len: int, max_tokens: int) -> None:
    scheduler.add_request(Request(request_id=name, prompt_token_ids=[3 + i % 500 for i in range(prompt_len)],
                                  sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                  pooling_params=None))


class Worker:
    """The block table a worker builds from the scheduler's outputs, and the checks on it."""

    def __init__(self, scheduler, policy: str):
        self.scheduler, self.policy = scheduler, Policy.parse(policy)
        self.tables: dict[str, list[int]] = {}
        self.steps = self.preemptions = 0
        self.scheduled_ever: set[str] = set()

    def step(self):
        out = self.scheduler.schedule()
        for req_id in out.finished_req_ids | (out.preempted_req_ids or set()):
            self.tables.pop(req_id, None)
        self.preemptions += len(out.preempted_req_ids or ())
        for new in out.scheduled_new_reqs:
            self.tables[new.req_id] = list(new.block_ids[0])
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self.tables[req_id] = list(ids[0])
            elif ids is not None:
                self.tables[req_id].extend(ids[0])
        self.check(out)
        ids = list(out.num_scheduled_tokens)
        sampled = [[] if self.scheduler.requests[r].is_prefill_chunk else [TOKEN] for r in ids]
        self.scheduler.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=sampled))
        self.steps += 1
        self.scheduled_ever |= set(ids)
        return out

    def check(self, out) -> None:
        manager = self.scheduler.kv_cache_manager
        owner: dict[int, str] = {}
        for req_id in out.num_scheduled_tokens:
            request = self.scheduler.requests[req_id]
            seq_len = request.num_computed_tokens  # the length this step runs it at (advanced by schedule())
            table = self.tables[req_id]
            assert table == list(manager.get_block_ids(req_id)[0]), req_id
            need = cdiv(reserved_tokens(self.policy, seq_len, MML), BS)
            # exactly the reservation: vLLM allocates what it is asked, and never more
            assert len(table) == need, (req_id, seq_len, len(table), need)
            assert 0 not in table, f"{req_id}: vLLM's null block in the table {table}"
            assert len(set(table)) == len(table), f"{req_id}: a page twice in {table}"
            for block in table:
                assert block not in owner, f"block {block} of {req_id} also belongs to {owner[block]}"
                owner[block] = req_id

    def run(self, max_steps: int = 400) -> None:
        while self.scheduler.has_requests():
            assert self.steps < max_steps, "requests did not finish (preemption loop?)"
            self.step()


# --- the hook's arithmetic and argument binding -------------------------------

@pytest.mark.parametrize("policy, n, lookahead, expected", [
    ("strict", 5, 0, MML - 5),
    ("strict", MML, 0, 0),
    ("strict", 5, 300, 300),            # the scheduler's own lookahead wins when larger
    ("request", 5, 0, 3),               # 8
    ("request", 64, 0, 0),              # exactly a power of two
    ("request", 65, 0, 63),             # 128
    ("request", 60, 4, 4),              # 64 covers 60 + 4 speculative slots
    ("request", 60, 5, 68),             # 60 + 5 -> 128
    ("request", 200, 0, MML - 200),     # capped at max_model_len
    ("off", 5, 0, 0),
    ("off", 5, 3, 3),
])
def test_lookahead_covers_the_reservation(policy, n, lookahead, expected):
    assert lookahead_tokens(Policy(policy), n, lookahead, MML) == expected


@pytest.mark.parametrize("policy", list(Policy))
def test_hot_path_target_is_reserved_tokens(policy):
    wrap = ReservingAllocateSlots(lambda request, num_new_tokens, num_lookahead_tokens=0: None, policy, 300)
    assert [wrap._target(n) for n in range(700)] == [reserved_tokens(policy, n, 300) for n in range(700)]


def test_wrapper_binds_positional_and_keyword_calls():
    calls = []

    class Manager:  # vLLM 0.32's signature
        def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                           num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False,
                           num_encoder_tokens=0, full_sequence_must_fit=False, reserved_blocks=0,
                           has_scheduled_reqs=True):
            calls.append(dict(request=request, num_new_tokens=num_new_tokens,
                              num_new_computed_tokens=num_new_computed_tokens,
                              num_lookahead_tokens=num_lookahead_tokens,
                              num_external_computed_tokens=num_external_computed_tokens,
                              delay_cache_blocks=delay_cache_blocks))
            return "blocks"

    class Req:
        num_computed_tokens = 10

    wrap = ReservingAllocateSlots(Manager().allocate_slots, Policy.REQUEST, MML)
    r = Req()
    assert wrap(r, 3) == "blocks"                                       # 13 -> 16
    assert wrap(r, 3, 16, None, 2, 4) == "blocks"                       # 10+16+4+3 = 33 (+2) -> 64
    assert wrap(r, num_new_tokens=1, num_lookahead_tokens=0) == "blocks"  # 11 -> 16
    assert wrap(request=r, num_new_tokens=0, num_external_computed_tokens=40, delay_cache_blocks=True) == "blocks"
    assert [c["num_lookahead_tokens"] for c in calls] == [3, 31, 5, 0]  # the async load is left alone
    with pytest.raises(TypeError):  # a wrong call fails as it would without the hook
        wrap(r, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12)


def test_refuses_an_allocator_it_cannot_drive():
    class Manager:
        max_model_len = MML

        def allocate_slots(self, request, num_new_tokens):  # no lookahead: no way to reserve
            return None

    class Scheduler:
        kv_cache_manager = Manager()

    with pytest.raises(ReservationUnavailable) as info:
        reservation.reserve_on(Scheduler(), Policy.STRICT)
    assert OFF_FLAG in str(info.value) and "num_lookahead_tokens" in str(info.value)
    with pytest.raises(ReservationUnavailable, match="kv_cache_manager"):
        reservation.reserve_on(object(), Policy.REQUEST)


def test_a_foreign_scheduler_class_is_refused(vllm_config, no_cpu_override):
    """``--scheduler-cls`` naming a class that is no vLLM Scheduler: DHP under strict cannot reserve."""
    class Foreign:  # what SchedulerInterface asks of a constructor, nothing more
        def __init__(self, vllm_config, kv_cache_config, structured_output_manager, block_size, **kwargs):
            self.kv_cache_config = kv_cache_config

    vllm_config.scheduler_config.scheduler_cls = Foreign
    try:
        with pytest.raises(ReservationUnavailable, match="Foreign has no kv_cache_manager") as info:
            make_scheduler(vllm_config, "strict", num_blocks=64)
        assert OFF_FLAG in str(info.value)
        make_scheduler(vllm_config, "off", num_blocks=64)  # nothing to reserve: fine
    finally:
        vllm_config.scheduler_config.scheduler_cls = None


def test_install_is_lazy_and_idempotent():
    """register() must not import the scheduler module (seconds); resolving the class wraps it once."""
    code = textwrap.dedent("""
        import sys
        from dhp_backend.plugin import register
        register(); register()
        assert "vllm.v1.core.sched.scheduler" not in sys.modules
        from vllm.config import SchedulerConfig
        SchedulerConfig(max_model_len=256, is_encoder_decoder=False).get_scheduler_cls()
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler
        init = Scheduler.__init__
        assert init._dhp_reservation and not getattr(init.__wrapped__, "_dhp_reservation", False)
        register()
        SchedulerConfig(max_model_len=256, is_encoder_decoder=False).get_scheduler_cls()
        assert Scheduler.__init__ is init  # wrapped once
        assert not getattr(AsyncScheduler.__init__, "_dhp_reservation", False)  # it calls Scheduler's
        print("OK")
    """)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-3000:]


# --- vLLM's real scheduler ----------------------------------------------------

MIXED = [("a", 1, 4), ("b", 5, 6), ("c", 16, 3), ("d", 17, 20), ("e", 40, 30), ("f", 100, 5)]


@pytest.mark.parametrize("policy", ["strict", "request", "off"])
def test_every_step_owns_its_pages_up_to_the_reservation(vllm_config, no_cpu_override, policy):
    scheduler = make_scheduler(vllm_config, policy, num_blocks=1 + len(MIXED) * cdiv(MML, BS))
    hooked = isinstance(scheduler.kv_cache_manager.allocate_slots, ReservingAllocateSlots)
    assert hooked == (policy != "off")
    for name, prompt_len, max_tokens in MIXED:
        add(scheduler, name, prompt_len, max_tokens)
    worker = Worker(scheduler, policy)
    worker.run()
    assert worker.scheduled_ever == {name for name, _, _ in MIXED}
    assert worker.preemptions == 0
    # chunked prefill really happened (the 100-token prompt over a 64-token budget) and lengths
    # crossed powers of two while decoding (17 -> 37, 40 -> 70)
    assert worker.steps > 30


def test_other_backend_is_left_alone(vllm_config, no_cpu_override):
    for backend in (None, "FLASH_ATTN"):
        scheduler = make_scheduler(vllm_config, "strict", num_blocks=64, backend=backend)
        assert not isinstance(scheduler.kv_cache_manager.allocate_slots, ReservingAllocateSlots)


def test_cpu_slot_override_counts_as_dhp(vllm_config, no_cpu_override, monkeypatch):
    """vLLM's CPU engine ignores --attention-backend: DHP runs there through the CPU_ATTN slot."""
    monkeypatch.setenv("DHP_OVERRIDE_CPU_ATTN", "1")
    register()
    try:
        scheduler = make_scheduler(vllm_config, "strict", num_blocks=64, backend=None)
        assert isinstance(scheduler.kv_cache_manager.allocate_slots, ReservingAllocateSlots)
    finally:
        AttentionBackendEnum.CPU_ATTN.clear_override()


def test_a_reservation_that_does_not_fit_waits(vllm_config, no_cpu_override):
    per_request = cdiv(MML, BS)
    scheduler = make_scheduler(vllm_config, "strict", num_blocks=1 + 2 * per_request + per_request // 2)
    for name in ("x", "y", "z"):
        add(scheduler, name, 5, 3)
    worker = Worker(scheduler, "strict")
    out = worker.step()
    assert set(out.num_scheduled_tokens) == {"x", "y"}
    assert [r.request_id for r in scheduler.waiting] == ["z"]  # short, but its pages do not fit
    while "z" not in out.num_scheduled_tokens:
        assert [r.request_id for r in scheduler.waiting] == ["z"] and worker.steps < 20
        out = worker.step()
    assert "x" not in scheduler.requests or "y" not in scheduler.requests  # scheduled once one finished
    worker.run()
    assert worker.preemptions == 0
    assert all(scheduler.requests.get(n) is None for n in ("x", "y", "z"))


@pytest.mark.parametrize("policy", ["strict", "request"])
def test_a_cache_too_small_for_one_full_request_refuses_to_start(vllm_config, no_cpu_override, policy):
    with pytest.raises(ReservationUnavailable, match="Lower --max-model-len to 240"):
        make_scheduler(vllm_config, policy, num_blocks=cdiv(MML, BS))  # 15 usable, 16 needed
    make_scheduler(vllm_config, "off", num_blocks=cdiv(MML, BS))  # vLLM's own business


def test_request_policy_regrows_under_pressure_without_looping(vllm_config, no_cpu_override):
    """Lengths cross 32, 64 and 128 while four requests share a cache that holds three at 128:
    vLLM preempts and resumes (its normal path), every step still owns its pages, all finish."""
    scheduler = make_scheduler(vllm_config, "request", num_blocks=1 + 3 * cdiv(128, BS) + 2)
    for i in range(4):
        add(scheduler, f"r{i}", 20, 60)
    worker = Worker(scheduler, "request")
    worker.run(max_steps=600)
    assert worker.scheduled_ever == {f"r{i}" for i in range(4)}
    assert 1 <= worker.preemptions <= 8


def test_windowed_layers_kept_in_full_are_reserved_like_full_ones(vllm_config, no_cpu_override, caplog,
                                                                  monkeypatch):
    """A windowed layer managed as full attention (``FullAttentionSpec(sliding_window=W)``, what DHP's
    layers declare under a constant-time policy, in one group with the full layers) owns distinct pages
    up to the reservation at every step, and the start-up report says the window saves no memory."""
    from dhp_backend.vllm import report

    monkeypatch.setattr(report, "_EMITTED", [])  # the report is printed once per engine
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32,
                             sliding_window=32)
    with caplog.at_level(logging.WARNING, logger="dhp_backend"):
        scheduler = make_scheduler(vllm_config, "strict", num_blocks=1 + len(MIXED) * cdiv(MML, BS),
                                   groups=[KVCacheGroupSpec(["layer.0", "layer.1"], spec)])
    assert isinstance(scheduler.kv_cache_manager.allocate_slots, ReservingAllocateSlots)
    assert any("Windowed layers (window 32) are managed as full attention" in r.getMessage()
               for r in caplog.records)
    for name, prompt_len, max_tokens in MIXED:
        add(scheduler, name, prompt_len, max_tokens)
    worker = Worker(scheduler, "strict")
    worker.run()
    assert worker.scheduled_ever == {name for name, _, _ in MIXED} and worker.steps > 30


def test_windowed_layers_whose_pages_vllm_frees_refuse_to_start(vllm_config, no_cpu_override):
    """A group left on vLLM's sliding-window manager (which frees out-of-window pages and puts the null
    block in their entries) cannot keep the address rule: the engine refuses, naming the flag."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    full = FullAttentionSpec(block_size=BS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=BS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                               dtype=torch.float32, sliding_window=32)
    groups = [KVCacheGroupSpec(["layer.0"], full), KVCacheGroupSpec(["layer.1"], window)]
    with pytest.raises(ReservationUnavailable, match=r"layers of window 32 with vLLM's sliding-window manager"
                                                     r".*Start the engine with"):
        make_scheduler(vllm_config, "strict", num_blocks=80, groups=groups)
    scheduler = make_scheduler(vllm_config, "off", num_blocks=80, groups=groups)  # vLLM's own business
    assert not isinstance(scheduler.kv_cache_manager.allocate_slots, ReservingAllocateSlots)


def test_price_is_in_the_one_start_up_block(vllm_config, no_cpu_override, caplog, monkeypatch):
    """The scheduler's process prints the start-up report once (dhp_backend.vllm.report), with the price."""
    from dhp_backend.vllm import report

    monkeypatch.setattr(report, "_EMITTED", [])
    monkeypatch.setattr(report, "_LAYERS", {})  # a process without a worker (vLLM's mp executor)
    with caplog.at_level(logging.WARNING, logger="dhp_backend"):
        make_scheduler(vllm_config, "strict", num_blocks=1 + 5 * cdiv(MML, BS) + 3)
        make_scheduler(vllm_config, "strict", num_blocks=1 + 5 * cdiv(MML, BS) + 3)  # once per process
    blocks = [r.getMessage() for r in caplog.records if r.name == "dhp_backend" and "start-up report" in r.getMessage()]
    assert len(blocks) == 1, blocks
    msg = blocks[0]
    assert msg.splitlines()[0].endswith("engine core)")
    assert f"KV reservation: policy 'strict' holds max_model_len={MML} tokens = {cdiv(MML, BS)} blocks of {BS}" in msg
    assert "KV cache: 84 blocks" in msg and "at most 5 requests at once" in msg
    assert "instead: policy 'request' would hold" in msg and "at most 2x" in msg
    assert "layers, kernels and CUDA graphs: in each worker process's block" in msg
    assert not [r for r in caplog.records if r.name == "dhp_backend" and "KV reservation" in r.getMessage()
                and "start-up report" not in r.getMessage()]  # said in the block only


def test_price_arithmetic():
    p = reservation_price("strict", max_model_len=8192, block_size=16, num_blocks=40_001)
    assert p["strict_blocks_per_request"] == 512 and p["usable_blocks"] == 40_000
    assert p["strict_requests_at_once"] == 40_000 // 512
    top, second = p["rows"][:2]
    assert top["lengths"] == [4097, 8192] and top["requests_at_once"]["request"] == 40_000 // 512
    assert second["tokens_held"]["request"] == 4096 and second["requests_at_once"]["request"] == 40_000 // 256
    assert second["requests_at_once"]["off"] == [40_000 // 256, 40_000 // cdiv(2049, 16)]
    odd = reservation_price("request", max_model_len=3000, block_size=16, num_blocks=None)
    assert odd["rows"][0]["lengths"] == [2049, 3000] and odd["rows"][0]["tokens_held"]["request"] == 3000
    assert odd["strict_requests_at_once"] is None


def test_price_lines_say_when_not_one_request_fits():
    """A cache of one block (the null block) holds no request under strict: the line says so and why the
    engine would not start, in the singular where the count is one."""
    from dhp_backend.reservation_price import price_lines

    none = price_lines(reservation_price("strict", max_model_len=8192, block_size=16, num_blocks=1))
    assert "KV cache: 1 block of 16 tokens (0 usable" in none[1]
    assert "not one request fits at this max_model_len" in none[1] and "at most 0" not in none[1]
    one = price_lines(reservation_price("strict", max_model_len=8192, block_size=16, num_blocks=513))
    assert "513 blocks of 16" in one[1] and "at most 1 request at once" in one[1]


def test_cli_info_shows_the_reservation(capsys):
    from dhp_backend.cli import main as cli_main

    assert cli_main(["info", "--json", "--device", "cpu", "--policy", "strict", "--max-model-len", "4096",
                     "--block-size", "16", "--kv-cache-blocks", "2049"]) == 0
    r = json.loads(capsys.readouterr().out)["reservation"]
    assert r["policy"] == "strict" and r["num_blocks"] == 2049 and r["strict_requests_at_once"] == 8
    assert cli_main(["info", "--device", "cpu", "--max-model-len", "4096", "--kv-cache-tokens", "65536"]) == 0
    text = capsys.readouterr().out
    assert "KV reservation" in text and "4,096 blocks of 16" in text and "at most 15 requests at once" in text
    assert cli_main(["info", "--device", "cpu", "--policy", "request"]) == 0
    text = capsys.readouterr().out
    assert "10,000 blocks of 16 tokens (9,999 usable" in text
    assert "KV cache size: assumed; pass --kv-cache-blocks" in text
    assert "KV reservation: policy 'request' holds" in text


# --- end to end on vLLM's CPU engine --------------------------------------------

# scripts/reservation_probe.py runs integration.run_generation in this process's engine
# (VLLM_ENABLE_V1_MULTIPROCESSING=0) and checks, at every step of vLLM's own scheduler, the pages each
# scheduled request owns (the same script probes vLLM 0.24 on the GPU machine).
_PROBE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "reservation_probe.py")


def _generate_probed(model_dir, tmp_path):
    """strict, then off, one engine each in one process (one start-up of vLLM for both): per policy the
    run's result and the scheduler probe's report, and the process's log."""
    from engine_process import engine_env, run_in_session

    probe = tmp_path / "probe.json"
    env = engine_env(DHP_CHECK_VALUES="1", PROBE_OUT=str(probe))
    cmd = [sys.executable, _PROBE, "--model", str(model_dir), "--backend", "DHP", "--policy", "strict,off",
           "--multiprocessing", "0", "--batching", "together"]
    code, text = run_in_session(cmd, env)
    assert code == 0 and "DHP_RESULT_JSON " in text, text[-4000:]
    result = json.loads(text.split("DHP_RESULT_JSON ", 1)[1].splitlines()[0])
    runs = {run["policy"]: run for run in result["runs"]}
    probes = {key.rsplit("|", 1)[1]: report for key, report in json.loads(probe.read_text())["runs"].items()}
    assert sorted(runs) == sorted(probes) == ["off", "strict"], (sorted(runs), sorted(probes))
    return runs, probes, text


@pytest.mark.e2e
def test_cpu_engine_strict_reserves_and_matches_off(tmp_path):
    """Strict on the CPU engine: every step's table validated by the worker (DHP_CHECK_VALUES=1,
    the seam rejects a table without distinct pages up to the bucket) and by the scheduler probe
    (distinct pages, none shared between the step's requests, no null block); several requests at
    once, chunked prefill, prefix-cache hits (no two requests of this workload share a prefix while
    both run); the same bits as policy off."""
    from engine_process import startup_blocks

    from integration.tiny_llama import build

    model_dir = build(tmp_path / "tiny-llama", seed=0)
    runs, probes, log = _generate_probed(model_dir, tmp_path)
    strict, off, probe, off_probe = runs["strict"], runs["off"], probes["strict"], probes["off"]
    for result, policy in ((strict, "strict"), (off, "off")):
        assert {(t["backend"], t["policy"]) for t in result["dhp_trace"]} == {("DHP", policy)}
    # the hook ran in the engine (strict only), and the price is in the start-up report: one block per
    # engine, in the order they ran, each engine's one process running both the worker and the scheduler
    # (vLLM's uni executor)
    assert probe["hooked"] == "ReservingAllocateSlots" and off_probe["hooked"] == "method"
    blocks = startup_blocks(log)
    assert len(blocks) == 2 and all(b[0].endswith(", engine core and worker)") for b in blocks), [b[0] for b in blocks]
    reserved_lines = ("KV reservation: policy 'strict' holds max_model_len=512 tokens = 16 blocks of 32",
                      "KV reservation: none beyond each request's true length")
    for block, reserved in zip(blocks, reserved_lines):
        assert any(line.startswith("    decode steps:") for line in block)
        assert any(line.startswith("  " + reserved) for line in block), block
    assert probe["violations"] == [] and off_probe["violations"] == []
    assert probe["max_blocks"] == 16 and off_probe["max_blocks"] < 16
    assert probe["requests"] >= 3 and probe["steps"] > 20
    # the second round's prompts hit the prefix cache: their first pages are cached ones
    assert [o["num_cached_tokens"] for o in strict["outputs"][6:]] == [128, 192, 64]
    assert [o["token_ids"] for o in strict["outputs"]] == [o["token_ids"] for o in off["outputs"]]
    assert [o["logprobs"] for o in strict["outputs"]] == [o["logprobs"] for o in off["outputs"]]
