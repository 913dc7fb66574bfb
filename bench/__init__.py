"""Benchmarks: each module prints a table and a ratio against a baseline run in the same process.

Run one with ``.venv/bin/python -m bench.<name>``; their figures are recorded in BENCHMARKS.md.
"""
