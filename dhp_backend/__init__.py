"""dhp_backend: constant-time, bitwise-deterministic, batch-invariant attention for vLLM.

Importing this package is cheap on purpose (vLLM imports the plugin in every
process): no torch, no Triton, no vLLM here. Use `dhp_backend.ops` for the
attention API and `dhp_backend.vllm` for the vLLM adapter.
"""

__version__ = "0.1.0"

BACKEND_NAME = "DHP"
