"""Audit tooling for the leakage contract's gates (docs/design.md section 3).

The gates: G1 `counters` (ncu), G2 `sass` (and `cuda_gate` for the csrc kernels), G3 `bits`,
G4 `timing` (dudect-style, `stats`); `classes` builds the secret classes they compare, on block
tables that obey the address rule (`dhp_backend.testing.pages`); `summary` runs them all. G2's parts:

- `sass`: disassemble a cubin with line info, parse control instructions
- `ttir`: taint analysis of Triton's TTIR (loop bounds / if conditions vs kernel arguments and loads)
- `ptx`: predicate provenance in PTX, and the slow-path scan (precise division, sqrt...)
- `rules`: the per-kernel tables of public-condition rules, with their reasons
- `gate`: classify every control instruction of one compiled kernel against the rules
- `variants`: enumerate and compile every specialization the dispatcher can launch
- `report`: run the gate over variants, write docs/audit reports, print the summary

This ``__init__`` imports nothing heavy: the CLI imports the submodules on use.
"""
