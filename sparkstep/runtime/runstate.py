"""The step loop's state machine (seed 004, "Coordinator/worker synchronization").

::

               pause()                     loop top at step s
      Run ───────────────> Pause ─────────────────────────────> Paused(s)
       ^ │                                                        │   │
       │ │ stop(x)            resume()                            │   │ stop(s)
       │ └──────────┐  ┌──────────────────────────────────────────┘   │
       │            v  v                                              v
       └──────── (Run)  Stop(x) ── loop top at step x ──> Stopped <── Stop(s)

- ``Run``: the loop takes steps; the input wait blocks until input arrives or the cancellation
  token is cancelled.
- ``pause()`` sets ``Pause`` and cancels the token, so a loop waiting for input returns to the
  top at once; at the top the loop records ``Paused(step)``, where ``step`` is the next step to
  run (every step below it is complete), and blocks. ``pause()`` returns that step. Idempotent.
- ``resume()``: ``Paused(s)`` (or ``Pause``) back to ``Run`` with a fresh token.
- A *brief* pause (``pause(brief=True)``) is a procedure's, which ends it itself with
  ``end_brief_pause()``: a checkpoint of a running loop. It is the same ``Pause``/``Paused``,
  but the snapshot says ``brief`` so that the status reports the pipeline as running (it is
  checkpointing), not as paused by someone. A plain ``pause()`` meanwhile takes the pause over:
  ``end_brief_pause()`` then leaves the loop paused, as its new owner asked.
- Settling. Before it reaches ``Paused`` or ``Stopped`` the loop *settles*: it finishes its
  work in flight (the last step's transaction), so that every step below the step it pauses
  at is complete, written included. One pause does not wait for that: a brief pause asked
  with ``settle=False``, the checkpoint's, which waits for the write itself while the loop
  runs on (:meth:`~sparkstep.runtime.driver.Runtime.checkpoint`). Such a pause reaches
  ``Paused`` unsettled; a plain ``pause()`` or a ``stop`` that takes it over makes the loop
  settle before that caller returns, so every caller but the checkpoint sees the guarantee.
- ``stop(x)``: the loop runs steps until it reaches ``x`` and then ``Stopped``; reaching the top
  with a step above ``x`` is a fatal error (the coordinator asked for a step already passed).
  From ``Paused(s)`` only ``stop(s)`` is valid.

The loop calls :meth:`RunState.at_top` at the top of every iteration; everything else is called
from other threads (the control endpoint). All waits are bounded by a timeout.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass

from sparkstep.ids import Step
from sparkstep.runtime.errors import StateMachineError

__all__ = ["CancellationToken", "LoopPhase", "RunState", "Snapshot"]


class CancellationToken:
    """A one-shot flag that unblocks waits for input: set once, never reset."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True if cancelled."""
        return self._event.wait(timeout)

    @property
    def event(self) -> threading.Event:
        """The underlying event, for waits that take a ``threading.Event``."""
        return self._event


class LoopPhase(enum.Enum):
    """The states of the machine; ``Paused`` and ``Stop`` carry a step (:class:`Snapshot`)."""

    RUN = "running"
    PAUSE = "pausing"
    PAUSED = "paused"
    STOP = "stopping"
    STOPPED = "stopped"


@dataclass(frozen=True)
class Snapshot:
    """The state at one instant: ``step`` is the step of ``Paused``/``Stop``, else None;
    ``brief`` whether a ``Pause``/``Paused`` is a procedure's brief pause."""

    phase: LoopPhase
    step: Step | None
    brief: bool = False


class RunState:
    """The state machine shared by the step loop and its controller."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._phase = LoopPhase.RUN
        self._step: Step | None = None
        self._token = CancellationToken()
        self._failure: BaseException | None = None
        self._brief = False
        self._unsettled_ok = False  # the pause asked for is a brief one with settle=False
        self._settled = False  # in Paused: the loop settled before (or while) pausing

    # -- read ---------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        with self._cond:
            paused = self._phase in (LoopPhase.PAUSE, LoopPhase.PAUSED)
            return Snapshot(self._phase, self._step, paused and self._brief)

    @property
    def failure(self) -> BaseException | None:
        """The exception that ended the loop, if one did."""
        with self._cond:
            return self._failure

    @property
    def token(self) -> CancellationToken:
        """The token of the current run; a waiting ``read`` must watch it."""
        with self._cond:
            return self._token

    # -- the loop's side ----------------------------------------------------------------------

    def at_top(self, step: Step, settle: Callable[[], None] | None = None) -> bool:
        """Called by the loop before step ``step``; True to run it, False to leave the loop.

        Blocks while paused. Raises :class:`StateMachineError` if asked to stop at a step the
        loop has already passed.

        ``settle`` finishes the loop's work still in flight (the previous step's transaction,
        see :meth:`~sparkstep.runtime.driver.Runtime.run`). Unless the loop simply runs on, it
        is called once, outside the lock, before the machine moves to ``Paused`` or
        ``Stopped``, except for a pause asked with ``settle=False``, where it is called only if
        a plain pause or a stop takes that pause over (module docstring, "Settling"). An
        exception from it propagates and the machine is left as it was.
        """
        settled = settle is None
        while True:
            with self._cond:
                verdict = self._top(step, settled)
            if verdict is not None:
                return verdict
            assert settle is not None
            settle()
            settled = True

    def _top(self, step: Step, settled: bool) -> bool | None:
        """:meth:`at_top` under the lock: True or False as it returns, or None when the loop
        must settle first (the caller settles outside the lock and calls again)."""
        while True:
            if self._phase is LoopPhase.RUN:
                return True
            if self._phase is LoopPhase.PAUSE:
                if not (settled or self._unsettled_ok):
                    return None
                self._phase, self._step, self._settled = LoopPhase.PAUSED, step, settled
                self._cond.notify_all()
            elif self._phase is LoopPhase.PAUSED:
                if not (self._settled or self._unsettled_ok):  # a plain pause took it over
                    if not settled:
                        return None
                    self._settled = True
                    self._cond.notify_all()
                self._cond.wait()
            elif self._phase is LoopPhase.STOP:
                assert self._step is not None
                if step < self._step:
                    return True
                if step > self._step:
                    raise StateMachineError(
                        f"asked to stop at step {self._step} but step {step} is next: the "
                        "stop came after that step had already run"
                    )
                if not settled:
                    return None
                self._phase = LoopPhase.STOPPED
                self._cond.notify_all()
                return False
            else:
                return False

    def fail(self, failure: BaseException) -> None:
        """A procedure run while paused failed: the loop leaves at its top and raises it."""
        with self._cond:
            self._phase = LoopPhase.STOPPED
            self._failure = failure
            self._token.cancel()
            self._cond.notify_all()

    def finished(self, failure: BaseException | None = None) -> None:
        """Called by the loop when it exits, with the exception that ended it if any."""
        with self._cond:
            self._phase = LoopPhase.STOPPED
            self._failure = failure
            self._token.cancel()
            self._cond.notify_all()

    # -- the controller's side ----------------------------------------------------------------

    def pause(self, timeout: float, *, brief: bool = False, settle: bool = True) -> Step:
        """Pause and return the next step to run; every step below it is complete.

        ``brief``: the caller's procedure ends the pause itself with :meth:`end_brief_pause`
        (see the module docstring); it is brief only if the loop was running. A plain pause
        takes over a brief one.

        ``settle=False`` (only with ``brief``): do not wait for the loop to settle; every step
        below the returned one has run, but its write may still be in flight (module
        docstring, "Settling"). Whether it was settled or not, the caller must treat it as not.
        """
        if not settle and not brief:
            raise ValueError("only a brief pause may leave the loop unsettled")
        with self._cond:
            if self._phase is LoopPhase.RUN:
                self._phase = LoopPhase.PAUSE
                self._brief = brief
                self._unsettled_ok = not settle
                self._token.cancel()
                self._cond.notify_all()
            elif self._phase in (LoopPhase.STOP, LoopPhase.STOPPED):
                raise StateMachineError(f"cannot pause: the loop is {self._phase.value}")
            elif not brief:
                self._brief = self._unsettled_ok = False
                self._cond.notify_all()  # a loop paused unsettled must settle now
            elif settle:
                self._unsettled_ok = False
                self._cond.notify_all()

            def paused() -> bool:
                if self._phase is LoopPhase.PAUSE:
                    return False
                return self._phase is not LoopPhase.PAUSED or self._settled or not settle

            if not self._cond.wait_for(paused, timeout):
                # Give up the pause, or the loop would pause later, unasked.
                self._run()
                raise StateMachineError(f"the loop did not pause within {timeout:.0f}s")
            if self._phase is not LoopPhase.PAUSED:
                cause = f": {self._failure}" if self._failure is not None else ""
                raise StateMachineError(f"the loop {self._phase.value} while pausing{cause}")
            assert self._step is not None
            return self._step

    def resume(self) -> None:
        """Leave ``Pause``/``Paused`` for ``Run`` with a fresh token; a no-op when running."""
        with self._cond:
            if self._phase in (LoopPhase.STOP, LoopPhase.STOPPED):
                raise StateMachineError(f"cannot resume: the loop is {self._phase.value}")
            self._run()

    def end_brief_pause(self) -> None:
        """End a brief pause: back to ``Run`` unless a plain pause took it over meanwhile (or
        the loop is stopping); a no-op then."""
        with self._cond:
            if self._brief and self._phase in (LoopPhase.PAUSE, LoopPhase.PAUSED):
                self._run()

    def _run(self) -> None:
        """``Run`` with a fresh token, unless running already; the caller holds the lock."""
        if self._phase is not LoopPhase.RUN:
            self._phase, self._step = LoopPhase.RUN, None
            self._token = CancellationToken()
            self._cond.notify_all()
        self._brief = self._unsettled_ok = self._settled = False

    def stop(self, step: Step, timeout: float) -> None:
        """Run until step ``step`` is next, then stop; returns once the loop has stopped."""
        with self._cond:
            if self._phase is LoopPhase.PAUSED and self._step != step:
                raise StateMachineError(
                    f"paused at step {self._step}: can only stop there, not at step {step}"
                )
            if self._phase is not LoopPhase.STOPPED:
                self._phase, self._step = LoopPhase.STOP, step
                self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._phase is LoopPhase.STOPPED, timeout):
                raise StateMachineError(f"the loop did not stop within {timeout:.0f}s")
            if self._failure is not None:
                raise StateMachineError(f"the loop failed: {self._failure}")
