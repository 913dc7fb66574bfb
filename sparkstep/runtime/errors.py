"""Errors of the runtime layer (pipeline, plan checks, operators, workers, step loop).

Add each new error here, derived from :class:`StepRuntimeError`, with a one-line docstring
saying when it is raised.
"""

from __future__ import annotations

from sparkstep.errors import SparkstepError

__all__ = [
    "DivisionMismatchError",
    "FencedError",
    "KernelError",
    "ManifestConflictError",
    "ManifestError",
    "NonLinearPlanError",
    "OperatorSpecError",
    "PathRefusedError",
    "PipelineChangedError",
    "PipelineDefinitionError",
    "RecoveryError",
    "RescaleAbortedError",
    "RescaleError",
    "RescaleRequestError",
    "ShardNotOwnedError",
    "ShardTransferError",
    "StageFailedError",
    "StaleStepError",
    "StateFormatError",
    "StateMachineError",
    "StepRuntimeError",
    "UnknownOperatorError",
    "WorkerAuthError",
    "WorkerClosedError",
    "WorkerError",
    "WorkerUnavailableError",
    "WrongLayoutError",
    "WrongOperatorsError",
]


class StepRuntimeError(SparkstepError):
    """Raised for a failure of the runtime layer; the base of this layer's errors."""


class NonLinearPlanError(StepRuntimeError):
    """Raised when user code between sparkstep operators is not linear over Z-sets."""


class OperatorSpecError(StepRuntimeError):
    """Raised when an operator spec is invalid (unknown aggregate, unsupported key type, ...)."""


class KernelError(StepRuntimeError):
    """Raised when a kernel cannot apply a batch (missing column, bad state, user fn failure)."""


class WorkerError(StepRuntimeError):
    """Raised when a state worker refuses or fails a call; the base of the worker errors."""


class FencedError(WorkerError):
    """Raised when an apply carries an incarnation other than the worker's current one."""


class DivisionMismatchError(WorkerError):
    """Raised when (operator, step) was already applied with another division digest."""


class StaleStepError(WorkerError):
    """Raised when an apply names a step older than the operator's last applied or committed one."""


class UnknownOperatorError(WorkerError):
    """Raised when an apply names an operator the worker was not configured with."""


class WorkerClosedError(WorkerError):
    """Raised when a call needs an open store but the worker has none open (before open(v))."""


class WorkerAuthError(WorkerError):
    """Raised when a call to a worker lacks the bearer token or carries a wrong one."""


class WorkerUnavailableError(WorkerError):
    """Raised when a worker cannot be reached (not started, dead, or not answering in time)."""


class StateMachineError(StepRuntimeError):
    """Raised when the step loop is asked for a transition it does not allow, or times out."""


class ManifestError(StepRuntimeError):
    """Raised when the manifest is unreadable, invalid, or belongs to another deployment."""


class ManifestConflictError(ManifestError):
    """Raised when a manifest write lost a race: a newer runtime generation was claimed, or the
    manifest changed since the writer read it. Nothing was written."""


class PipelineDefinitionError(StepRuntimeError):
    """Raised when a pipeline definition is invalid (schema, names, topics, operators)."""


class PipelineChangedError(StepRuntimeError):
    """Raised at recovery when the pipeline's stateful operators differ from the state's."""


class RecoveryError(StepRuntimeError):
    """Raised when recovery finds the manifest, the stores and the step log inconsistent."""


class PathRefusedError(WorkerError):
    """Raised when an export or import names a path outside what the worker may write or read."""


class ShardTransferError(WorkerError):
    """Raised when a receiving worker cannot fetch a sender's exported shard files intact."""


class WrongOperatorsError(WorkerError):
    """Raised when configure's operator specs do not match the fingerprint the store keeps."""


class StageFailedError(StepRuntimeError):
    """Raised when a step's Spark job fails (a task failed on every attempt); names the cause."""


class StateFormatError(WorkerError):
    """Raised when a worker's store holds state in a format this sparkstep does not read."""


class WrongLayoutError(WorkerError):
    """Raised when an apply's layout epoch is not the one the worker's store holds."""


class ShardNotOwnedError(WorkerError):
    """Raised when an apply carries a row of a shard the worker's layout does not give it."""


class RescaleRequestError(StepRuntimeError):
    """Raised when a rescale is asked with bad arguments; nothing was changed."""


class RescaleError(StepRuntimeError):
    """Raised when a rescale's procedure fails midway; only recovery may continue."""


class RescaleAbortedError(RescaleError):
    """Raised when a hot rescale fails before its pause: no store of the current layout
    changed, and the pipeline runs on in it (the caller removes the added workers)."""
