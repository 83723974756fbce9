"""The OpenAI server against the offline engine, bit for bit, in DHP's deterministic mode (issues 32 and 33).

A golden is recorded with `dhp_backend.testing.golden.record` (the offline engine, one prompt at a time,
DHP ``deterministic``, which on a GPU runs vLLM's batch-invariant mode). Then one server,
``python -m vllm.entrypoints.openai.api_server --attention-backend DHP`` with the same engine arguments and
``{"dhp": {"deterministic": true}}`` under ``VLLM_BATCH_INVARIANT=1``, answers the same prompts through the
official ``openai`` client: all at once (threads released together), then one at a time. Every answer's
token ids and each token's logprob must equal the golden's bit for bit: the server adds batching, HTTP and
detokenisation, none of which may change a bit.

Set DHP_REPORT_DIR to keep the golden, the server's log and its answers there (``scripts/device_run.sh
serve``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine_process import free_port, gpu_engine_env, serve

from dhp_backend.testing import golden

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.gpu

START_TIMEOUT_S = 240
MAX_TOKENS = 8
POLICY = "strict"
ENGINE_ARGS = ["--dtype", "bfloat16", "--max-model-len", "2048", "--block-size", "16",
               "--gpu-memory-utilization", "0.25", "--max-num-seqs", "16", "--enforce-eager"]
# Prompts of 3 to 40 words of the tiny model's WordLevel vocabulary (``wN``): some span several KV blocks.
PROMPTS = [{"id": f"p{i}", "prompt": " ".join(f"w{(53 * i + 7 * j) % 500 + 3}" for j in range(n))}
           for i, n in enumerate((3, 5, 9, 16, 17, 25, 33, 40))]


@pytest.fixture(scope="module")
def report_dir(tmp_path_factory):
    d = Path(os.environ.get("DHP_REPORT_DIR") or tmp_path_factory.mktemp("server-golden"))
    d.mkdir(parents=True, exist_ok=True)
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from integration.tiny_llama import build

    return build(tmp_path_factory.mktemp("tiny-llama-d128"), seed=0, num_heads=8, num_kv_heads=2, head_size=128)


@pytest.fixture(scope="module")
def recorded(model_dir, report_dir):
    """The golden: the offline engine, one prompt at a time."""
    return golden.record(model_dir, PROMPTS, report_dir / "server-golden.json", max_tokens=MAX_TOKENS,
                         policy=POLICY, engine_args=ENGINE_ARGS)


@pytest.fixture(scope="module")
def server(model_dir, report_dir, recorded):  # after the record: one engine on the GPU at a time
    port = free_port()
    env = gpu_engine_env(VLLM_BATCH_INVARIANT="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--attention-backend", "DHP",
           "--additional-config", json.dumps({"dhp": {"policy": POLICY, "deterministic": True}}),
           *ENGINE_ARGS, "--host", "127.0.0.1", "--port", str(port)]
    with serve(cmd, env, f"http://127.0.0.1:{port}", report_dir / "serve-deterministic.log",
               start_timeout=START_TIMEOUT_S) as srv:
        yield srv


def _complete(client, model: str, prompt: str) -> dict:
    """One greedy completion as the golden holds it: token ids and ``float.hex`` logprobs. The tokens come
    back as ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``)."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                                  extra_body={"return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    ids = []
    for t in lp.tokens:
        assert t.startswith("token_id:"), f"token {t!r}: the server ignored return_tokens_as_token_ids"
        ids.append(int(t.split(":", 1)[1]))
    return {"token_ids": ids, "logprobs": [float(x).hex() for x in lp.token_logprobs]}


@pytest.fixture(scope="module")
def answers(server, model_dir, report_dir):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = str(model_dir)
    try:
        start = threading.Barrier(len(PROMPTS))

        def together(q):
            start.wait()
            return _complete(client, model, q["prompt"])

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            concurrent = list(pool.map(together, PROMPTS))
        sequential = [_complete(client, model, q["prompt"]) for q in PROMPTS]
    except Exception as e:  # the server's side of the story with the client's error
        pytest.fail(f"{type(e).__name__}: {e}\n{server.tail()}")
    result = {"startup_s": round(server.startup_s, 1), "concurrent": concurrent, "sequential": sequential}
    (report_dir / "serve-deterministic.json").write_text(json.dumps(result, indent=1))
    return result


def _differences(recorded: dict, got: list[dict]) -> list[str]:
    by_id = {q["id"]: q for q in recorded["prompts"]}
    out = []
    for q, a in zip(PROMPTS, got):
        g = by_id[q["id"]]
        g_ids, g_lps = [t for t, _ in g["steps"]], [lp for _, lp in g["steps"]]
        if a["token_ids"] != g_ids or a["logprobs"] != g_lps:
            out.append(f"{q['id']}: golden {list(zip(g_ids, g_lps))}\n      server {list(zip(a['token_ids'], a['logprobs']))}")
    return out


def test_golden_ran_dhp_deterministic_on_the_gpu(recorded):
    fp = recorded["fingerprint"]
    assert fp["attention"] == "DHP" and fp["batch_invariant_mode"] is True, fp
    assert fp["dhp"]["deterministic"] is True and fp["dhp"]["policy"] == POLICY, fp
    assert fp["kernels"] and "reference" not in fp["kernels"], fp
    assert all(len(q["steps"]) >= 1 for q in recorded["prompts"]), recorded["prompts"]


def test_concurrent_answers_are_the_offline_golden_bitwise(recorded, answers, server):
    diffs = _differences(recorded, answers["concurrent"])
    assert not diffs, "\n".join(diffs) + "\n" + server.tail()


def test_sequential_answers_are_the_offline_golden_bitwise(recorded, answers, server):
    diffs = _differences(recorded, answers["sequential"])
    assert not diffs, "\n".join(diffs) + "\n" + server.tail()
