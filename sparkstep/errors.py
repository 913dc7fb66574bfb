"""The root of every error sparkstep raises, and the errors no single layer owns.

Each layer has its own ``errors.py`` whose base class derives from :class:`SparkstepError`, so a
caller can catch everything sparkstep raises with one clause. Messages say what went wrong and
what to do about it; the command line prints them as one line, never as a traceback.
"""

from __future__ import annotations

__all__ = ["ConfigError", "MissingToolError", "SparkstepError"]


class SparkstepError(Exception):
    """Raised for every failure sparkstep reports; the base of all its errors."""


class ConfigError(SparkstepError):
    """Raised when a setting or argument is invalid or two settings contradict each other."""


class MissingToolError(SparkstepError):
    """Raised when a program sparkstep needs (Java 17+, Maven) is not installed or too old."""
