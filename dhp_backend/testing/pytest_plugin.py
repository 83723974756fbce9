"""pytest plugin (entry point ``pytest11``): the ``dhp_golden`` fixture for bitwise golden tests.

    def test_my_model_is_unchanged(dhp_golden):
        dhp_golden(model="models/my-model", prompts="tests/prompts.jsonl", max_tokens=16,
                   batch_size=16, shuffle=True)

The golden lives next to the test, ``golden/<test file>/<test name>.json``
(or ``golden=PATH``). With ``--dhp-golden-update`` the fixture records it (each
prompt alone) and the test passes; otherwise it checks the model's outputs under
the given batching (`dhp_backend.testing.golden.check`) and fails on the first
differing token or logprob bit, on a fingerprint that differs (unless
``compare_anyway=True``), and on a missing golden: that run records one for
review and still fails, so a missing file never passes silently.

Importing this module is cheap (pytest loads it in every session of a
project that has dhp-backend installed); vLLM is imported when a test calls
the fixture.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

UPDATE_OPTION = "--dhp-golden-update"


def pytest_addoption(parser) -> None:
    parser.getgroup("dhp-golden").addoption(
        UPDATE_OPTION, action="store_true", default=False,
        help="dhp_golden: record the golden files (each prompt alone) instead of checking them")


def _default_path(request) -> Path:
    name = re.sub(r"[^\w.-]+", "_", request.node.name)
    return Path(request.node.path).parent / "golden" / Path(request.node.path).stem / f"{name}.json"


@pytest.fixture
def dhp_golden(request):
    """``dhp_golden(model=..., prompts=..., **options)``: record or check this test's golden.

    ``prompts``: a JSONL path or a list of ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}``
    dicts. Options: ``golden`` (path), ``max_tokens``, ``temperature``/``seed``, ``policy``,
    ``engine_args`` (vLLM CLI arguments), and for the check ``batch_size``, ``shuffle``,
    ``max_num_batched_tokens``, ``compare_anyway``. Returns the `CheckResult` (None when recording).
    """
    update = request.config.getoption(UPDATE_OPTION)

    def run(*, model, prompts, golden=None, max_tokens=8, temperature=0.0, seed=None, policy="strict",
            engine_args=(), batch_size=1, shuffle=False, max_num_batched_tokens=None, compare_anyway=False):
        from dhp_backend.testing import golden as g

        path = Path(golden) if golden is not None else _default_path(request)
        items = g.read_prompts(prompts) if isinstance(prompts, (str, Path)) else list(prompts)
        if update or not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            g.record(model, items, path, max_tokens=max_tokens, temperature=temperature, seed=seed,
                     policy=policy, engine_args=engine_args)
            if update:
                return None
            pytest.fail(f"dhp_golden: no golden file {path}: recorded one now (not checked). Review and commit "
                        f"it; the next run checks against it ({UPDATE_OPTION} records on purpose)", pytrace=False)
        result = g.check(g.load(path), model, batch_size=batch_size, shuffle=shuffle,
                         max_num_batched_tokens=max_num_batched_tokens, compare_anyway=compare_anyway)
        if result.exit_code != g.EXIT_EQUAL:
            pytest.fail(f"dhp_golden {path}: {result.message}", pytrace=False)
        return result

    return run
