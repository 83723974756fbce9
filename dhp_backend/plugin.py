"""vLLM plugin entry point (``vllm.general_plugins`` -> ``dhp_backend.plugin:register``).

vLLM calls `register` once in every process it starts (front end, engine core,
workers). It must be idempotent and cheap: no torch.cuda, no Triton, no build.

What it does:
- points ``AttentionBackendEnum.CUSTOM`` at our backend class and makes the
  name ``DHP`` an alias of ``CUSTOM``, so ``--attention-backend DHP``,
  ``--attention-backend CUSTOM`` and ``LLM(..., attention_backend="DHP")`` all
  work, including when the engine core runs in a spawned process (the pickled
  config carries ``CUSTOM``, whose value exists in every process);
- only if ``DHP_OVERRIDE_CPU_ATTN=1`` (the setting ``override_cpu_attn``): also
  points ``CPU_ATTN`` at our backend.
  vLLM's CPU platform ignores ``--attention-backend`` and always takes the
  ``CPU_ATTN`` slot; this opt-in is a testing aid that lets a CPU engine run
  DHP (it is how CI runs the backend end to end);
- installs the KV-page reservation in vLLM's scheduler
  (`dhp_backend.vllm.reservation`): a scheduler built in an engine that runs
  DHP under a constant-time policy reserves each request's pages up to its
  bucket (the address rule), and the price is in the start-up report. Nothing
  is reserved in engines that run another backend or policy ``off``;
- in the process that parses the engine arguments, checks DHP's configuration
  as soon as vLLM has built its config (`dhp_backend.vllm.startup_check`), so a
  malformed setting stops ``vllm serve`` with one DHP error as its last line;
- sends the ``dhp_backend`` logger's records to vLLM's own log handler
  (`dhp_backend.vllm.logs.log_through_vllm`), so DHP's start-up report (`dhp_backend.vllm.report`:
  one block per engine process) and its kernel builds appear in vLLM's log, in
  its format, in every process.
"""

from __future__ import annotations

import logging

from dhp_backend import config

logger = logging.getLogger("dhp_backend")


def register() -> None:
    from dhp_backend.vllm import compat
    from dhp_backend.vllm.logs import log_through_vllm

    log_through_vllm()

    previous = compat.custom_override()
    if previous not in (None, compat.BACKEND_CLASS_PATH):
        logger.warning("DHP: AttentionBackendEnum.CUSTOM was registered to %s by another plugin; "
                       "DHP takes it over", previous)
    compat.register_class_path("CUSTOM")
    compat.install_alias()
    if config.from_env("override_cpu_attn"):  # (the start-up report's settings line shows it)
        compat.register_class_path("CPU_ATTN")
    from dhp_backend.vllm import reservation, startup_check

    reservation.install()
    startup_check.install()
