# `make demo`: end-to-end generation through vLLM with DHP vs vLLM's own backend.
# `make test`: the test suite (what CI runs through .ci/run).
# Both create .venv and install everything on first use (scripts/setup_env.sh).
PY := .venv/bin/python

.PHONY: setup demo test info clean
setup:
	@bash scripts/setup_env.sh

demo: setup
	$(PY) -m integration.demo

# Two workers, each test file on one (module fixtures start engines once): CI's machine has two cores,
# and the engine tests spend much of their time in single-threaded imports and start-up (22 -> 14 min).
test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

info: setup
	$(PY) -m dhp_backend.cli info

clean:
	rm -rf .venv .work .pytest_cache
