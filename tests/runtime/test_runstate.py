"""The step loop's state machine: pause at a step boundary, resume, stop at a given step."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from sparkstep.ids import Step
from sparkstep.runtime.errors import StateMachineError
from sparkstep.runtime.runstate import LoopPhase, RunState, Snapshot


class Loop:
    """A loop like the runtime's: at_top, then a step that waits for 'input' on the token."""

    def __init__(self, state: RunState, input_arrives: threading.Event) -> None:
        self.state = state
        self.input_arrives = input_arrives
        self.completed: list[int] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        step = Step(0)
        try:
            while self.state.at_top(step):
                token = self.state.token
                # The input wait: returns on input or cancellation; no input means no step.
                while not self.input_arrives.is_set():
                    if token.wait(0.01):
                        break
                else:
                    self.completed.append(step)
                    step = Step(step + 1)
        except BaseException as exc:
            self.error = exc
        finally:
            self.state.finished(self.error)


@pytest.fixture
def loop() -> Iterator[Loop]:
    state = RunState()
    running = Loop(state, threading.Event())
    running.thread.start()
    yield running
    if state.snapshot().phase is not LoopPhase.STOPPED:
        state.stop(state.pause(timeout=10), timeout=10)
    running.thread.join(10)


def test_pause_interrupts_the_input_wait_and_reports_the_next_step(loop: Loop) -> None:
    assert loop.state.pause(timeout=10) == 0  # no input yet: paused before step 0
    assert loop.state.snapshot().phase is LoopPhase.PAUSED
    assert loop.state.pause(timeout=10) == 0  # idempotent


def test_a_brief_pause_is_marked_and_its_end_resumes(loop: Loop) -> None:
    assert loop.state.pause(timeout=10, brief=True) == 0
    assert loop.state.snapshot() == Snapshot(LoopPhase.PAUSED, Step(0), brief=True)
    loop.state.end_brief_pause()
    assert loop.state.snapshot() == Snapshot(LoopPhase.RUN, None, brief=False)


def test_a_plain_pause_during_a_brief_one_keeps_the_loop_paused(loop: Loop) -> None:
    loop.state.pause(timeout=10, brief=True)
    assert loop.state.pause(timeout=10) == 0  # the user pauses while a checkpoint holds it
    assert loop.state.snapshot().brief is False
    loop.state.end_brief_pause()  # the checkpoint ends
    assert loop.state.snapshot() == Snapshot(LoopPhase.PAUSED, Step(0), brief=False)


def test_a_brief_pause_of_a_paused_loop_is_not_brief(loop: Loop) -> None:
    loop.state.pause(timeout=10)
    loop.state.pause(timeout=10, brief=True)  # a checkpoint of a paused pipeline
    assert loop.state.snapshot().brief is False
    loop.state.end_brief_pause()
    assert loop.state.snapshot().phase is LoopPhase.PAUSED


def test_no_step_runs_while_paused_and_resume_continues(loop: Loop) -> None:
    loop.input_arrives.set()
    step = loop.state.pause(timeout=10)
    done = list(loop.completed)
    assert done == list(range(step))
    loop.thread.join(0.2)
    assert loop.completed == done
    loop.state.resume()
    deadline_step = step + 5
    for _ in range(1000):
        if len(loop.completed) >= deadline_step:
            break
        loop.thread.join(0.01)
    assert len(loop.completed) >= deadline_step


def test_stop_from_paused_stops_at_that_step(loop: Loop) -> None:
    loop.input_arrives.set()
    step = loop.state.pause(timeout=10)
    with pytest.raises(StateMachineError, match=f"paused at step {step}"):
        loop.state.stop(Step(step + 3), timeout=1)
    loop.state.stop(step, timeout=10)
    assert loop.state.snapshot().phase is LoopPhase.STOPPED
    assert loop.completed == list(range(step))
    with pytest.raises(StateMachineError, match="cannot resume"):
        loop.state.resume()


def test_stop_runs_until_the_given_step() -> None:
    state = RunState()
    loop = Loop(state, threading.Event())
    loop.input_arrives.set()
    # Ask for the stop before the loop starts, so step 7 is certainly ahead of it.
    stopper = threading.Thread(target=state.stop, args=(Step(7), 10.0))
    stopper.start()
    for _ in range(1000):
        if state.snapshot().phase is LoopPhase.STOP:
            break
        stopper.join(0.005)
    loop.thread.start()
    stopper.join(10)
    loop.thread.join(10)
    assert loop.completed == list(range(7))
    assert loop.error is None


def test_stop_at_a_step_already_passed_is_an_error() -> None:
    state = RunState()
    loop = Loop(state, threading.Event())
    loop.input_arrives.set()
    loop.thread.start()
    for _ in range(1000):
        if len(loop.completed) > 3:
            break
        loop.thread.join(0.005)
    with pytest.raises(StateMachineError, match="the loop failed: asked to stop at step 1"):
        state.stop(Step(1), timeout=10)
    loop.thread.join(10)
    assert isinstance(loop.error, StateMachineError)
    assert "stop came after that step" in str(loop.error)


def test_at_top_settles_before_pausing_and_not_while_running() -> None:
    state = RunState()
    settled: list[LoopPhase] = []

    def settle() -> None:
        settled.append(state.snapshot().phase)

    assert state.at_top(Step(0), settle=settle)
    assert settled == []  # running on: nothing to settle

    pausing = threading.Thread(target=lambda: state.pause(timeout=30))
    pausing.start()
    while state.snapshot().phase is not LoopPhase.PAUSE:
        pass
    resumer = threading.Timer(0.2, state.resume)
    resumer.start()
    assert state.at_top(Step(1), settle=settle)  # pauses, then runs on when resumed
    pausing.join(30)
    resumer.join(30)
    assert settled == [LoopPhase.PAUSE]  # called once, before the machine said Paused


def test_a_failing_settle_leaves_the_machine_pausing() -> None:
    state = RunState()
    answers: list[str] = []

    def pause() -> None:
        try:
            state.pause(timeout=30)
        except StateMachineError as exc:
            answers.append(str(exc))

    pausing = threading.Thread(target=pause, daemon=True)
    pausing.start()
    while state.snapshot().phase is not LoopPhase.PAUSE:
        pass

    def settle() -> None:
        raise RuntimeError("the write in flight failed")

    with pytest.raises(RuntimeError, match="write in flight"):
        state.at_top(Step(1), settle=settle)
    assert state.snapshot().phase is LoopPhase.PAUSE
    state.finished(RuntimeError("the write in flight failed"))
    pausing.join(30)
    assert answers == ["the loop stopped while pausing: the write in flight failed"]


class SettlingLoop:
    """A loop thread at the top of step 1 whose settle (the write in flight) ends only when
    ``write_done`` is set; ``settles`` counts the calls that returned."""

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.write_done = threading.Event()
        self.settles = 0
        self.verdicts: list[bool] = []
        self.thread = threading.Thread(target=self._top, daemon=True)

    def _settle(self) -> None:
        assert self.write_done.wait(30)
        self.settles += 1

    def _top(self) -> None:
        self.verdicts.append(self.state.at_top(Step(1), settle=self._settle))


def _pause_unsettled(state: RunState) -> SettlingLoop:
    """A loop paused at step 1 by an unsettled brief pause, its write still in flight."""
    loop = SettlingLoop(state)
    pausing = threading.Thread(target=lambda: state.pause(timeout=30, brief=True, settle=False))
    pausing.start()
    while state.snapshot().phase is not LoopPhase.PAUSE:
        pass
    loop.thread.start()
    pausing.join(30)
    assert state.snapshot().phase is LoopPhase.PAUSED and loop.settles == 0
    return loop


def test_an_unsettled_brief_pause_does_not_wait_for_the_write() -> None:
    state = RunState()
    loop = _pause_unsettled(state)
    assert state.snapshot() == Snapshot(LoopPhase.PAUSED, Step(1), brief=True)
    state.end_brief_pause()
    loop.thread.join(30)
    assert (loop.verdicts, loop.settles) == ([True], 0)  # it runs on, the write in flight


def test_a_plain_pause_over_an_unsettled_one_returns_once_the_loop_settled() -> None:
    state = RunState()
    loop = _pause_unsettled(state)
    returned = threading.Event()

    def user_pause() -> None:
        state.pause(timeout=30)
        returned.set()

    user = threading.Thread(target=user_pause)
    user.start()
    assert not returned.wait(0.2)  # the user's pause waits for the write in flight
    loop.write_done.set()
    assert returned.wait(30)
    assert loop.settles == 1
    state.end_brief_pause()  # the checkpoint ends: the loop stays paused, as the user asked
    assert state.snapshot() == Snapshot(LoopPhase.PAUSED, Step(1), brief=False)
    state.stop(Step(1), timeout=30)
    loop.thread.join(30)
    assert (loop.verdicts, loop.settles) == ([False], 1)


def test_a_stop_over_an_unsettled_pause_settles_before_stopped() -> None:
    state = RunState()
    loop = _pause_unsettled(state)
    stopper = threading.Thread(target=lambda: state.stop(Step(1), timeout=30))
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive() and state.snapshot().phase is LoopPhase.STOP
    loop.write_done.set()
    stopper.join(30)
    loop.thread.join(30)
    assert (state.snapshot().phase, loop.verdicts, loop.settles) == (
        LoopPhase.STOPPED,
        [False],
        1,
    )


def test_only_a_brief_pause_may_leave_the_loop_unsettled() -> None:
    with pytest.raises(ValueError, match="brief"):
        RunState().pause(timeout=1, settle=False)
