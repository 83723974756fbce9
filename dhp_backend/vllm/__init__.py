"""The vLLM adapter (backend, metadata builder, impl) and the version shims.

Importing this package is cheap; `dhp_backend.vllm.backend` imports vLLM's
attention classes and is loaded by vLLM itself through the registered class path.
"""
