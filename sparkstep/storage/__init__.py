"""The per-worker two-version store (seed 004, "Database"). Imports nothing of sparkstep but the
shared :mod:`sparkstep.errors`, :mod:`sparkstep.ids` and :mod:`sparkstep.failpoints`.
"""
