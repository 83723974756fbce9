"""Benchmarks and binary inspection of the kernels (GPU tools; nothing here runs at import)."""
