"""Helpers for users' tests and for our own tests, audit and benchmarks.

`requests`: one request's content for the test-step builders.
`pages`: block tables that obey the address rule (design.md section 2): every
request owns distinct real pages up to its bucket, in one of several physical
layouts.
`golden`: record a model's tokens and logprob bits once, check them bitwise under
any batching (``dhp-backend golden``); `golden_run` is its engine process;
`pytest_plugin`: the ``dhp_golden`` fixture (entry point ``pytest11``).
"""
