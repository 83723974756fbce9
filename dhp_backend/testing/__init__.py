"""Helpers for users' tests and for our own tests, audit and benchmarks.

`pages`: block tables that obey the address rule (design.md section 2): every
request owns distinct real pages up to its bucket, in one of several physical
layouts.
"""
