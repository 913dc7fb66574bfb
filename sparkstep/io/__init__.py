"""Kafka: input ranges and divisions, the step log, the exactly-once output writer, the broker.

Imports nothing of sparkstep but the shared :mod:`sparkstep.errors` and
:mod:`sparkstep.failpoints`.
"""
