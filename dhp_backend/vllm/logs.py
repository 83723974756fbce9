"""DHP's log records in vLLM's log: `log_through_vllm`, called by the plugin's ``register`` in every process
vLLM starts and again by the start-up report before it logs (`dhp_backend.vllm.report`)."""

from __future__ import annotations

import logging

logger = logging.getLogger("dhp_backend")


def log_through_vllm() -> None:
    """DHP's records go to the handlers vLLM configured for its ``vllm`` logger, at vLLM's level.

    Left to Python's defaults they reach stderr only while no handler exists anywhere in the logging tree:
    on the GPU machine's vLLM 0.24 server not one DHP start-up line appeared (2026-11-26, H200), so the
    kernel builds and the policy were invisible there. Idempotent; a no-op where vLLM configured no handler
    (``VLLM_CONFIGURE_LOGGING=0``: then the user's own logging configuration decides). vLLM 0.32 configures
    its handlers lazily, after the plugins of the process that parses the arguments have run, so the
    start-up report calls this again before it logs (`dhp_backend.vllm.report`)."""
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers or logger.handlers:
        return
    for handler in vllm_logger.handlers:
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(vllm_logger.getEffectiveLevel())
    # Records still propagate: a handler the user (or pytest) put on the root logger sees them too.
