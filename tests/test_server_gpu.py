"""vLLM's OpenAI-compatible server with DHP on a GPU, driven by the official ``openai`` client (issue 33, item 2).

Per policy (``strict``, ``off``) one server, ``python -m vllm.entrypoints.openai.api_server --attention-backend
DHP``, on the seeded tiny Llama with 8 query / 2 KV heads of size 128 in bf16 (a shape the csrc and Triton
kernels cover), in a session of its own that is ended by PID at the end. It answers six short prompts
greedily with logprobs: one request at a time, then all six at once, then one streamed. Checked: every
answer has text; the concurrent and streamed answers are the sequential ones; the engine ran DHP's
kernels (its trace file), not the reference.

Set DHP_REPORT_DIR to keep each server's log and what it answered there (``scripts/device_run.sh serve``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from engine_process import Server, free_port, gpu_engine_env, serve

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.gpu

START_TIMEOUT_S = 240
MAX_TOKENS = 8
# Shorter than one KV block (--block-size 16 below): a prompt sent again finds no full block in the prefix
# cache, so every run of a prompt computes its prefill over the same rows.
PROMPTS = [" ".join(f"w{(37 * i + 11 * j) % 500 + 3}" for j in range(n)) for i, n in enumerate((2, 3, 5, 8, 11, 14))]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from integration.tiny_llama import build

    return build(tmp_path_factory.mktemp("tiny-llama-d128"), seed=0, num_heads=8, num_kv_heads=2, head_size=128)


@dataclasses.dataclass
class Deployment:
    server: Server
    policy: str
    model: str
    trace: Path       # DHP's trace file (DHP_TRACE_FILE): one line per process and kernel that ran
    report_dir: Path

    def tail(self) -> str:
        return self.server.tail()


@pytest.fixture(scope="module", params=["strict", "off"])
def deployment(request, model_dir, tmp_path_factory):
    policy = request.param
    work = tmp_path_factory.mktemp(f"serve-{policy}")
    report_dir = Path(os.environ.get("DHP_REPORT_DIR") or work)
    report_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    trace = work / "dhp-trace.jsonl"
    env = gpu_engine_env(DHP_TRACE_FILE=str(trace))
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--attention-backend", "DHP", "--additional-config", json.dumps({"dhp": {"policy": policy}}),
           "--dtype", "bfloat16", "--max-model-len", "2048", "--block-size", "16",
           "--gpu-memory-utilization", "0.25", "--max-num-seqs", "16", "--enforce-eager",
           "--host", "127.0.0.1", "--port", str(port)]
    with serve(cmd, env, f"http://127.0.0.1:{port}", report_dir / f"serve-{policy}.log",
               start_timeout=START_TIMEOUT_S) as srv:
        yield Deployment(srv, policy, str(model_dir), trace, report_dir)


def _complete(client, model, prompt):
    """One greedy completion: (text, tokens, logprobs of the chosen tokens). In this vocabulary (``wN``
    words and three specials) each token string names one token id, so equal tokens are equal ids."""
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=1,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    return {"text": c.text, "tokens": list(c.logprobs.tokens), "logprobs": list(c.logprobs.token_logprobs)}


def _stream(client, model, prompt):
    """The same, streamed: the chunks' pieces joined."""
    out = {"text": "", "tokens": [], "logprobs": [], "chunks": 0}
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           logprobs=1, stream=True, extra_body={"ignore_eos": True}):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        out["chunks"] += 1
        out["text"] += c.text or ""
        if c.logprobs is not None:
            out["tokens"] += list(c.logprobs.tokens or [])
            out["logprobs"] += list(c.logprobs.token_logprobs or [])
    return out


@pytest.fixture(scope="module")
def answers(deployment):
    """Every prompt one request at a time, then all six at once (threads released together), then the last
    prompt streamed."""
    client = openai.OpenAI(base_url=deployment.server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        sequential = [_complete(client, deployment.model, p) for p in PROMPTS]
        start = threading.Barrier(len(PROMPTS))

        def together(p):
            start.wait()
            return _complete(client, deployment.model, p)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            concurrent = list(pool.map(together, PROMPTS))
        streamed = _stream(client, deployment.model, PROMPTS[-1])
    except Exception as e:  # the server's side of the story with the client's error
        pytest.fail(f"{type(e).__name__}: {e}\n{deployment.tail()}")
    result = {"policy": deployment.policy, "startup_s": round(deployment.server.startup_s, 1), "prompts": PROMPTS,
              "sequential": sequential, "concurrent": concurrent, "streamed": streamed}
    (deployment.report_dir / f"serve-{deployment.policy}.json").write_text(json.dumps(result, indent=1))
    return result


def test_every_answer_has_its_tokens(deployment, answers):
    for a in answers["sequential"] + answers["concurrent"] + [answers["streamed"]]:
        assert a["text"].strip(), f"empty text: {a}\n{deployment.tail()}"
        assert len(a["tokens"]) == len(a["logprobs"]) == MAX_TOKENS, f"{a}\n{deployment.tail()}"
        assert all(isinstance(x, float) and x <= 0.0 for x in a["logprobs"]), f"{a}\n{deployment.tail()}"
    assert answers["streamed"]["chunks"] > 1, f"{answers['streamed']}\n{deployment.tail()}"  # it did stream


def test_concurrent_answers_are_the_sequential_ones(deployment, answers):
    # Token ids only. DHP's attention is batch-invariant, but the rest of the model is vLLM's: only its
    # batch-invariant mode (VLLM_BATCH_INVARIANT=1; in 0.24 model_executor/layers/batch_invariant.py puts
    # persistent Triton kernels in place of mm/addmm/log_softmax/...) makes the projections', MLP's and
    # lm_head's results independent of how many rows a step has. Without it a request's logprobs may differ
    # in the last bits with the batch it ran in (vLLM's CPU engine shows it on this very test's prompts).
    # The bitwise check across batch compositions, in that mode, is integration/gpu_e2e's (bi-solo vs
    # bi-reversed).
    for p, s, c in zip(PROMPTS, answers["sequential"], answers["concurrent"]):
        assert c["tokens"] == s["tokens"], (f"prompt {p!r}: alone {s['tokens']}, batched {c['tokens']}\n"
                                            + deployment.tail())


def test_streamed_answer_is_the_sequential_one_bitwise(deployment, answers):
    # Streaming changes only how the answer travels; the request ran alone both times (same rows, same
    # kernels), so tokens and logprobs are equal bit for bit.
    s, st = answers["sequential"][-1], answers["streamed"]
    assert st["tokens"] == s["tokens"], f"streamed {st}\nalone {s}\n{deployment.tail()}"
    assert st["logprobs"] == s["logprobs"], f"streamed {st}\nalone {s}\n{deployment.tail()}"


def test_server_ran_dhp_kernels(deployment, answers):
    assert deployment.trace.exists(), "no DHP trace: the engine did not run DHP\n" + deployment.tail()
    events = [json.loads(line) for line in deployment.trace.read_text().splitlines() if line.strip()]
    forward = [e for e in events if e["event"] == "forward"]
    assert forward, f"no forward in the trace {events}\n{deployment.tail()}"
    # "triton" is the kernel path (Triton kernels, and the csrc kernels where they apply); "reference" would
    # be the PyTorch fallback, which a GPU must not need for this shape.
    assert {(e["backend"], e["path"]) for e in events} == {("DHP", "triton")}, f"{events}\n{deployment.tail()}"
    assert {e["policy"] for e in events} == {deployment.policy}, f"{events}\n{deployment.tail()}"
    assert all(e["device"].startswith("cuda") and e["head_size"] == 128 for e in forward), \
        f"{forward}\n{deployment.tail()}"
    # the kernels the step kinds ran on
    assert any(e["event"] == "kernel" for e in events), f"{events}\n{deployment.tail()}"
