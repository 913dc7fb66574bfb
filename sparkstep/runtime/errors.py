"""Errors of the runtime layer (pipeline, plan checks, operators, workers, step loop).

Add each new error here, derived from :class:`StepRuntimeError`, with a one-line docstring
saying when it is raised.
"""

from __future__ import annotations

from sparkstep.errors import SparkstepError

__all__ = ["NonLinearPlanError", "StepRuntimeError"]


class StepRuntimeError(SparkstepError):
    """Raised for a failure of the runtime layer; the base of this layer's errors."""


class NonLinearPlanError(StepRuntimeError):
    """Raised when user code between sparkstep operators is not linear over Z-sets."""
