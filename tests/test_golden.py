"""Golden outputs (`dhp_backend.testing.golden`, ``dhp-backend golden``, the ``dhp_golden`` fixture)
on vLLM's CPU engine with the tiny seeded Llama.

One golden is recorded per module (each prompt alone) and shared. What the CPU
engine shows here (README, "Golden outputs"): the bits do not depend on batch
size, order, or a small per-step token budget that splits every prompt's
prefill into chunks and mixes them with decodes (DHP's CPU path, the PyTorch
reference, computes in float64 and rounds once, `ops/reference.py`).
"""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest
from engine_process import engine_env, gpu_engine_env

from dhp_backend.cli import main as cli_main
from dhp_backend.testing import golden

pytest.importorskip("vllm")

pytestmark = pytest.mark.e2e

ENV = engine_env()
# the GPU machine's vLLM comes on PYTHONPATH (gpu-stack): read before the fixtures clean the environment
GPU_PYTHONPATH = gpu_engine_env()["PYTHONPATH"]
ENGINE_ARGS = ["--max-model-len", "64", "--enforce-eager", "--dtype", "float32"]
PROMPTS = [  # short (3-21 tokens), one text prompt (the tiny model's WordLevel tokenizer: w0 w1 ...)
    {"id": "a", "prompt_token_ids": [5, 17, 300, 41, 9]},
    {"id": "b", "prompt_token_ids": [400, 3, 3, 77, 120, 256, 8, 19, 200, 11, 42, 43, 44, 45, 46, 99, 98, 97, 500,
                                     4, 6]},
    {"id": "c", "prompt_token_ids": [12, 13, 14]},
    {"id": "d", "prompt": "w1 w2 w3 w4 w5 w6 w7"},
    {"id": "e", "prompt_token_ids": [250, 251, 7, 8, 9, 10, 311, 312, 313, 314, 315, 316]},
    {"id": "f", "prompt_token_ids": [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75]},
    {"id": "g", "prompt_token_ids": [500, 501, 502, 503]},
    {"id": "h", "prompt_token_ids": [33, 34, 35, 36, 37, 38, 39, 40, 41]},
]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from integration.tiny_llama import build

    return build(tmp_path_factory.mktemp("tiny-llama-golden"), seed=0)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("golden-prompts") / "prompts.jsonl"
    p.write_text("".join(json.dumps(q) + "\n" for q in reversed(PROMPTS)))  # the golden sorts them by id
    return p


def _user_environment(mp: pytest.MonkeyPatch) -> None:
    """The engine child inherits this process's environment: give it the one a user's CPU engine has
    (no TRITON_INTERPRET from the kernel test modules: the fingerprint's kernels would show it)."""
    for k in set(os.environ) - set(ENV):
        mp.delenv(k)
    for k, v in ENV.items():
        mp.setenv(k, v)


@pytest.fixture(scope="module")
def recorded(model_dir, prompts_file, tmp_path_factory):
    """One golden, recorded through the CLI with each prompt alone; its path."""
    out = tmp_path_factory.mktemp("golden") / "golden.json"
    with pytest.MonkeyPatch.context() as mp:  # module-scoped: set up before the autouse fixture below
        _user_environment(mp)
        code = cli_main(["golden", "record", "--model", str(model_dir), "--prompts", str(prompts_file),
                         "--out", str(out), "--max-tokens", str(MAX_TOKENS), "--quiet", "--", *ENGINE_ARGS])
    assert code == 0
    return out


@pytest.fixture(autouse=True)
def _clean_engine_env(monkeypatch):
    _user_environment(monkeypatch)


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli_main(["golden", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_golden_file_is_sorted_exact_and_fingerprinted(recorded, model_dir):
    g = golden.load(recorded)
    assert [q["id"] for q in g["prompts"]] == sorted(q["id"] for q in PROMPTS)
    fp = g["fingerprint"]
    assert fp["attention"] == "DHP" and fp["kernels"] == ["reference"] and fp["dtype"] == "float32"
    assert fp["dhp"] == {"deterministic": True, "policy": "strict", "allow_fallback": True}
    assert fp["device"].startswith("cpu") and fp["vllm"] and fp["torch"] and fp["dhp_backend"]
    assert fp["model_hash"] == golden.model_hash(model_dir)
    assert fp["sampling"] == {"temperature": 0.0, "max_tokens": MAX_TOKENS, "seed": None}
    for q in g["prompts"]:
        assert len(q["steps"]) == MAX_TOKENS
        for tok, lp in q["steps"]:
            assert float.fromhex(lp) <= 0.0 and float(float.fromhex(lp)).hex() == lp  # exact bits round-trip
    text = recorded.read_text()
    assert text == golden.dumps(g)  # written in the canonical form
    first = g["prompts"][0]["steps"][0]
    assert f"      {json.dumps(first)}," in text.splitlines()  # one generated token per line: diff-friendly


def test_round_trip_any_batching(recorded, model_dir, capsys):
    """Recorded one prompt at a time; checked 16 at a time, shuffled, under an 8-token step budget: the
    prompts (3-21 tokens) are prefilled in chunks, and steps mix chunks with decodes in an order unlike
    the recording's."""
    code, out, err = run_cli(capsys, "check", "--golden", recorded, "--model", model_dir, "--batch-size", 16,
                             "--shuffle", "--max-num-batched-tokens", 8, "--quiet", "--", *ENGINE_ARGS)
    assert code == golden.EXIT_EQUAL, out + err
    assert "bitwise equal (8 prompts, batch size 16, shuffled, max_num_batched_tokens 8)" in out


def test_the_strict_golden_holds_under_policy_off(recorded, model_dir, tmp_path):
    """A policy changes what timing may reveal, never a bit: the golden recorded under strict, rerun
    under off (its DHP section says off, so the fingerprints agree), 8 at a time, shuffled."""
    g = golden.load(recorded)
    assert g["fingerprint"]["dhp"]["policy"] == "strict"
    g["fingerprint"]["dhp"]["policy"] = "off"
    res = golden.check(g, model_dir, batch_size=8, shuffle=True)
    assert res.exit_code == golden.EXIT_EQUAL, res.message
    assert res.fingerprint_diff == {}


# Four prompts that share one 32-token KV block (block size 32 below), then differ: a warm prefix cache
# serves that block to every one of them.
SHARED_PREFIX = [(37 * j) % 480 + 10 for j in range(32)]
SHARED = [{"id": f"s{i}", "prompt_token_ids": SHARED_PREFIX + [200 + i, 7 * i + 3, 11 + i]} for i in range(4)]


def test_selfcheck_every_invariance_holds_for_dhp(model_dir):
    """Real engine runs, DHP only: against each prompt alone, the batch, the reversed batch, a chunked
    prefill under an 8-token budget and a warm prefix cache (every prompt reading its cached block) give
    every token and logprob bit."""
    report = golden.selfcheck(model_dir, SHARED, max_tokens=4, chunk_budget=8, backends=("DHP",),
                              engine_args=["--max-model-len", "64", "--block-size", "32", "--enforce-eager",
                                           "--dtype", "float32"])
    assert set(report) == {"DHP"}
    assert {name: r["holds"] for name, r in report["DHP"].items()} == dict.fromkeys(golden.INVARIANCES, True), report
    assert report["DHP"]["prefix_warm"]["cache_hits"] == len(SHARED), report


def test_a_gpu_check_under_another_step_budget_says_so():
    assert golden.budget_hint(None, 64, gpu=True).startswith(
        "; note: recorded with max_num_batched_tokens none, checked with 64: on the GPU")
    assert golden.budget_hint(64, None, gpu=True).startswith(
        "; note: recorded with max_num_batched_tokens 64, checked with none")
    assert golden.budget_hint(64, 64, gpu=True) == ""  # the same budget: nothing to add
    assert golden.budget_hint(None, 8, gpu=False) == ""  # the CPU engine keeps the bits under any budget


def test_selfcheck_refuses_unknown_backends(model_dir):
    with pytest.raises(golden.BadInput, match=r"backends \['FA'\]; accepted: a non-empty subset of"):
        golden.selfcheck(model_dir, SHARED, backends=("FA",))


def test_one_flipped_logprob_bit_is_the_first_difference(recorded, model_dir, tmp_path, capsys):
    g = golden.load(recorded)
    target = next(q for q in g["prompts"] if q["id"] == "e")
    tok, lp = target["steps"][2]
    bits = struct.unpack("<Q", struct.pack("<d", float.fromhex(lp)))[0]
    flipped = struct.unpack("<d", struct.pack("<Q", bits ^ (1 << 29)))[0].hex()  # float32's last mantissa bit
    assert flipped != lp and abs(float.fromhex(flipped) - float.fromhex(lp)) < 1e-6
    target["steps"][2] = [tok, flipped]
    tampered = tmp_path / "tampered.json"
    golden.save(g, tampered)
    code, out, _ = run_cli(capsys, "check", "--golden", tampered, "--model", model_dir, "--batch-size", 8,
                           "--quiet", "--json")
    assert code == golden.EXIT_DIFFERENT
    r = json.loads(out)
    d = r["difference"]
    assert (d["prompt_id"], d["step"], d["golden_token"], d["new_token"]) == ("e", 2, tok, tok)
    assert (d["golden_logprob"], d["new_logprob"]) == (flipped, lp)
    assert d["max_logprob_diff"] == abs(float.fromhex(flipped) - float.fromhex(lp))
    assert d["prompts_differing"] == 1 and "first difference: prompt 'e', step 2" in r["message"]


def test_another_model_is_a_fingerprint_mismatch_then_a_difference(recorded, tmp_path):
    from integration.tiny_llama import build

    other = build(tmp_path / "seed1", seed=1)
    g = golden.load(recorded)
    res = golden.check(g, other, batch_size=8)  # the model's files differ: not compared, no engine run
    assert res.exit_code == golden.EXIT_FINGERPRINT and not res.compared
    assert list(res.fingerprint_diff) == ["model_hash"] and "NOT COMPARED" in res.message
    res = golden.check(g, other, batch_size=8, compare_anyway=True)
    assert res.exit_code == golden.EXIT_DIFFERENT and list(res.fingerprint_diff) == ["model_hash"]
    d = res.difference
    assert (d.prompt_id, d.step) == ("a", 0) and d.golden_logprob != d.new_logprob
    assert "compared anyway: model_hash" in res.message


def test_another_tensor_parallel_size_is_a_fingerprint_mismatch(recorded, model_dir):
    """The fingerprint records the engine's tensor-parallel size: a golden from a TP 2 engine, checked on
    this TP 1 engine, is reported as recorded elsewhere (exit 3), not as a regression."""
    g = golden.load(recorded)
    assert g["fingerprint"]["tensor_parallel_size"] == 1
    g["fingerprint"]["tensor_parallel_size"] = 2
    res = golden.check(g, model_dir, batch_size=8)
    assert res.exit_code == golden.EXIT_FINGERPRINT and not res.compared
    assert res.fingerprint_diff == {"tensor_parallel_size": (2, 1)}, res.fingerprint_diff


def test_other_versions_are_reported_as_such(recorded, model_dir, tmp_path, capsys):
    g = golden.load(recorded)
    g["fingerprint"]["vllm"] = "0.24.0"
    g["fingerprint"]["device"] = "NVIDIA H100 80GB HBM3"
    other = tmp_path / "elsewhere.json"
    golden.save(g, other)
    code, out, _ = run_cli(capsys, "check", "--golden", other, "--model", model_dir, "--quiet")
    assert code == golden.EXIT_FINGERPRINT
    assert "NOT COMPARED, the fingerprint differs" in out and "vllm: '0.24.0' (golden) vs" in out
    assert "device: 'NVIDIA H100 80GB HBM3' (golden)" in out and "--compare-anyway" in out


@pytest.mark.parametrize("content,needle", [
    (None, "golden file '{p}': not found"),
    ('{"format": "dhp-golden/1", "prompts": [', "not JSON (Expecting value at line 1"),
    ('{"format": "other"}', "format 'other'; accepted: 'dhp-golden/1'"),
    ('{"format": "dhp-golden/1", "fingerprint": {}, "recorded_with": {}, "prompts": [{"id": "a", "prompt": "x", '
     '"steps": [[1, "oops"]]}]}', "'steps' must be a list of [token id, logprob as float.hex] pairs"),
])
def test_bad_golden_files_exit_2(content, needle, model_dir, tmp_path, capsys):
    p = tmp_path / "g.json"
    if content is not None:
        p.write_text(content)
    code, out, err = run_cli(capsys, "check", "--golden", p, "--model", model_dir, "--quiet")
    assert code == golden.EXIT_BAD_INPUT and out == ""
    assert needle.format(p=p) in err and err.startswith("dhp-backend golden check: ")


@pytest.mark.parametrize("lines,needle", [
    (None, "not found; accepted: a JSONL file"),
    ([], "no prompts; accepted: at least one line"),
    (["", "   "], "no prompts"),
    (['{"prompt": "w1"', ], "line 1: not JSON"),
    (['{"prompt": ""}'], "line 1: prompt ''; accepted: a non-empty string"),
    (['{"prompt_token_ids": []}'], "prompt_token_ids []; accepted: a non-empty list of token ids"),
    (['{"prompt": "w1", "prompt_token_ids": [1]}'], "needs exactly one of 'prompt'"),
    (['{"text": "w1"}'], "unknown key 'text'; accepted: id, prompt, prompt_token_ids"),
    (['{"id": 1, "prompt": "w1"}', '{"id": "1", "prompt": "w2"}'], "line 2: id '1' repeats an earlier line"),
])
def test_bad_prompts_exit_2(lines, needle, model_dir, tmp_path, capsys):
    p = tmp_path / "p.jsonl"
    if lines is not None:
        p.write_text("\n".join(lines))
    code, _, err = run_cli(capsys, "record", "--model", model_dir, "--prompts", p, "--out", tmp_path / "g.json")
    assert code == golden.EXIT_BAD_INPUT and needle in err
    assert not (tmp_path / "g.json").exists()


def test_bad_models_exit_2(tmp_path, prompts_file, capsys):
    (tmp_path / "nojson").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text("{}")
    for name, needle in (("missing", "not a directory"), ("nojson", "no config.json"),
                         ("broken", "config.json is not JSON"), ("noweights", "no weight files")):
        code, _, err = run_cli(capsys, "record", "--model", tmp_path / name, "--prompts", prompts_file,
                               "--out", tmp_path / "g.json")
        assert code == golden.EXIT_BAD_INPUT and needle in err, (name, err)


def test_greedy_or_seeded_sampling_only(model_dir, prompts_file, tmp_path, capsys):
    code, _, err = run_cli(capsys, "record", "--model", model_dir, "--prompts", prompts_file, "--out",
                           tmp_path / "g.json", "--temperature", "0.8")
    assert code == golden.EXIT_BAD_INPUT and "temperature > 0 with a seed" in err


def test_compare_reports_a_shorter_run():
    old = [{"id": "x", "steps": [[1, "-0x1.0p+0"], [2, "-0x1.0p-1"]]}]
    d = golden.compare(old, [{"token_ids": [1], "logprobs": ["-0x1.0p+0"]}])
    assert (d.step, d.golden_token, d.new_token) == (1, 2, None) and "nothing (ended)" in d.describe()
    assert golden.compare(old, [{"token_ids": [1, 2], "logprobs": ["-0x1.0p+0", "-0x1.0p-1"]}]) is None


PLUGIN_TEST = """
def test_tiny_model_is_unchanged(dhp_golden):
    dhp_golden(model={model!r}, prompts={prompts!r}, max_tokens={max_tokens}, batch_size=8, shuffle=True,
               engine_args={engine_args!r})
"""


def test_pytest_plugin_records_checks_and_fails_loudly(pytester, model_dir, prompts_file, monkeypatch):
    """First run (no golden): records it and fails; with the golden: passes; tampered: fails;
    --dhp-golden-update: records and passes."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # the plugin by -p, installed or not
    pytester.makepyfile(test_model=PLUGIN_TEST.format(model=str(model_dir), prompts=str(prompts_file),
                                                      max_tokens=2, engine_args=ENGINE_ARGS))
    path = pytester.path / "golden" / "test_model" / "test_tiny_model_is_unchanged.json"
    args = ("-p", "dhp_backend.testing.pytest_plugin", "-p", "no:cacheprovider")

    missing = pytester.runpytest(*args)
    missing.assert_outcomes(failed=1)
    missing.stdout.fnmatch_lines(["*dhp_golden: no golden file*recorded one now (not checked)*"])
    assert golden.load(path)["prompts"]

    pytester.runpytest(*args).assert_outcomes(passed=1)

    g = golden.load(path)
    g["prompts"][3]["steps"][1][0] += 1
    golden.save(g, path)
    tampered = pytester.runpytest(*args)
    tampered.assert_outcomes(failed=1)
    tampered.stdout.fnmatch_lines(["*golden check: DIFFERENT*first difference: prompt 'd', step 1*"])

    pytester.runpytest(*args, "--dhp-golden-update").assert_outcomes(passed=1)
    assert golden.load(path)["prompts"][3]["steps"][1][0] == g["prompts"][3]["steps"][1][0] - 1


def test_the_plugin_is_declared_for_pytest():
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["pytest11"] == {"dhp_golden": "dhp_backend.testing.pytest_plugin"}
    import subprocess  # pytest loads the plugin in every session: importing it must not import vLLM or torch

    code = subprocess.run([sys.executable, "-c", "import sys, dhp_backend.testing.pytest_plugin; "
                           "sys.exit('vllm' in sys.modules or 'torch' in sys.modules)"], env=ENV).returncode
    assert code == 0


@pytest.mark.gpu
def test_gpu_invariances_and_where_chunked_prefill_moves_the_bits(model_dir, monkeypatch):
    """GPU (DHP's kernels + vLLM's batch-invariant mode, set by the golden's engine process), 16 prompts
    of 5 to 300 tokens, each run alone against all at once, reversed, and with a warm prefix cache: DHP
    keeps every bit. Under a 64-token step budget (prefills in chunks, steps that mix chunks with
    decodes) vLLM 0.24 on the GPU moves the bits for its own default backend too, at the very same first
    difference (H200, 2026-11-26: prompt 'p04', step 3, the same two logprobs under both): what moves is
    outside attention. So chunked prefill is asserted for DHP wherever the engine default keeps it, and
    otherwise DHP must part exactly where the engine default does. The CPU engine holds it (above)."""
    import random

    monkeypatch.setenv("PYTHONPATH", GPU_PYTHONPATH)
    rng = random.Random(5)
    prompts = [{"id": f"p{i:02d}", "prompt_token_ids": [rng.randrange(3, 512) for _ in range(n)]}
               for i, n in enumerate((5, 9, 17, 33, 64, 65, 100, 127, 128, 129, 150, 200, 255, 256, 257, 300))]
    args = ["--max-model-len", "512", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.3"]
    report = golden.selfcheck(model_dir, prompts, max_tokens=16, policy="strict", chunk_budget=64, engine_args=args)
    dhp, native = report["DHP"], report["engine default"]
    for name in ("batched", "reversed", "prefix_warm"):
        assert dhp[name]["holds"], (name, dhp[name]["detail"])
    assert dhp["prefix_warm"]["cache_hits"] >= 8, dhp["prefix_warm"]
    if not dhp["chunked"]["holds"]:
        assert not native["chunked"]["holds"], ("DHP parts where the engine default holds", dhp["chunked"])
        assert dhp["chunked"]["first"] == native["chunked"]["first"], report


def test_selfcheck_runs_each_invariance_against_solo(model_dir, prompts_file, monkeypatch, capsys):
    """The engines selfcheck asks for, and how it reports, with the engine runs replaced by canned
    outputs (the engine runs themselves are what the tests above check): the default backend's chunked
    run differs in one logprob bit, DHP's does not."""
    specs = []

    def fake_run_engine(spec, *, environ=None, progress=False):
        specs.append(spec)
        out = {}
        for sched in spec["schedules"]:
            lp = "-0x1.0000020000000p+0" if spec["dhp"] is None and sched["name"] == "chunked" else "-0x1.0p+0"
            out[sched["name"]] = [{"token_ids": [7], "logprobs": [lp], "text": ""} for _ in spec["prompts"]]
        return {"fingerprint": {}, "results": out}

    monkeypatch.setattr(golden, "run_engine", fake_run_engine)
    code, out, _ = run_cli(capsys, "selfcheck", "--model", model_dir, "--prompts", prompts_file, "--quiet",
                           "--chunk-budget", 12)
    assert code == golden.EXIT_EQUAL
    assert out.splitlines()[:6] == ["invariance   DHP    engine default", "batched      holds  holds",
                                    "reversed     holds  holds", "chunked      holds  FAILS",
                                    "prefix_warm  holds  holds", "engine default, chunked: first difference: "
                                    "prompt 'a', step 0: golden token 7 (logprob -0x1.0p+0 = -1.0), now token 7 "
                                    "(logprob -0x1.0000020000000p+0 = -1.0000001192092896); largest logprob "
                                    "difference 1.1920928955078125e-07 at prompt 'a' step 0; 8 of 8 prompts differ"]
    assert [s["dhp"] is not None for s in specs] == [True] * 3 + [False] * 3
    solo, chunked, prefix = specs[:3]
    assert [s["name"] for s in solo["schedules"]] == ["solo", "batched", "reversed"]
    assert solo["schedules"][0]["batches"] == [[i] for i in range(8)]
    assert solo["schedules"][2]["batches"] == [list(range(7, -1, -1))]
    assert not solo["engine"]["enable_prefix_caching"] and "max_num_batched_tokens" not in solo["engine"]
    assert chunked["engine"]["max_num_batched_tokens"] == 12 and not chunked["engine"]["enable_prefix_caching"]
    assert [s["name"] for s in prefix["schedules"]] == ["prefix_cold", "prefix_warm"]
    assert prefix["engine"]["enable_prefix_caching"]
