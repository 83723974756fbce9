"""Benchmarks of the kernels, beside the product: not installed with dhp_backend, run from the
repository root (``python -m benchmarks.<module>``). GPU tools; nothing here runs at import."""
