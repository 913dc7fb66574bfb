"""The runtime: seed 004's step loop in the Spark driver, and its recovery and checkpoint.

One :class:`Runtime` per pipeline run, in the Spark driver process, in front of W state workers
that the caller started (each already holds its store lock). Its life::

    runtime = Runtime(spark, pipeline, options, kafka, workers)
    runtime.recover()          # once: the procedure below; afterwards next_step is known
    runtime.run(state)         # the step loop, until state says stop (blocks)
    runtime.checkpoint(state)  # from another thread, any number of times, never two at once
    runtime.rescale(state, workers)  # paused, from another thread: sparkstep.runtime.rescale

Recovery, in this order (ARCHITECTURE.md "Checkpoint, recovery, stop"):

0. the runtime claims its manifest lease (:class:`~sparkstep.runtime.manifest.ManifestLease`):
   the next generation, which it sends with every worker call as its fencing token; from here
   on no earlier runtime of this state dir can write the manifest, nor change a store this
   one has called;
1. the workers hold their store locks (the caller started them); the input topics must
   exist; the pipeline's stateful operators (their specs come from building the plan of a
   wide step over every input partition, which the step runner keeps for the first such step)
   must be those the manifest records (else :class:`PipelineChangedError`, naming each
   changed operator, before anything changes); every worker is configured with them and
   the manifest's deployment, which binds a store that has no identity yet, and each store
   must then belong to this deployment and these operators;
2. the output writer's ``init_transactions()`` fences the dead runtime's producer and completes
   or aborts its open transaction;
3. the step log's last step ``last`` is read (by the writer);
4. every worker ``open(manifest.version)``, which must be in the intersection of their
   ``versions()`` (seed 004's rule; outside it is fatal), giving fresh incarnations;
5. every store's ``get_step()`` must equal ``manifest.step``, and ``manifest.step <= last + 1``;
6. the steps ``manifest.step .. last`` are replayed from their logged divisions; the writer
   compares their input hashes, state digests and output digest with the log and discards the
   output;
7. the next step is new.

A fresh state dir first gets a manifest at version 0, step 0, epoch 0 with a new deployment id
and the operators' record: every new store can open version 0 and its step is 0, so recovery is
the same code. While a step runs, :attr:`Runtime.failing_step` names it, so that the process can
record a failure against its step (:mod:`sparkstep.runtime.failure`).

One step (:meth:`Runtime.run`): check the state machine; take the division (pinned until it is
logged: a step whose transaction was aborted is rerun with the same division); run it on Spark
(:class:`~sparkstep.runtime.step.StepRunner`); ask every worker for its state digest; write the
output, dead letters and step log record in one transaction; ``step += 1``.

Pipelined writes: step ``s``'s transaction is written by a writer thread while the loop plans
and runs step ``s+1`` on Spark. Exactly once is unchanged, because

- there is one transaction at a time, in step order: step ``s+1``'s write starts only after
  step ``s``'s has committed (:meth:`Runtime._settle`), so the step log stays in step order
  and a step's record is never logged before its predecessor's;
- the state machine reaches ``Paused``/``Stopped`` only once the write in flight has settled
  (:meth:`~sparkstep.runtime.runstate.RunState.at_top`'s ``settle``), so a checkpoint at step
  ``s`` never commits stores past a step the log does not hold;
- a failed write fails the loop at its next settle, with that step as the failing step; the
  workers may have applied the step after it, in versions no checkpoint has committed, which
  recovery discards (it reopens the manifest's version and replays the log).

Replay during recovery writes synchronously (there is no loop to overlap with).

Checkpoint (:meth:`Runtime.checkpoint`), in this order: pause at ``s`` without waiting for the
write in flight (``RunState.pause(brief=True, settle=False)``); every worker ``set_step(s)`` +
``commit()``; every worker ``open(v+1)`` (the stores keep ``v``, see
:mod:`sparkstep.storage.base`), the W commits at once and then the W reopens at once; resume, so
step ``s`` runs while the rest goes on; wait for the write of step ``s-1``, which was in flight;
only then the manifest ``{version: v+1, step: s}`` (through the lease: refused if a newer
runtime claimed the state dir or the manifest changed since this one wrote it); consumer group
offsets (and a warning where retention could delete input a recovery would replay). The loop
stands still only for the commits and the reopens.

Why it is exactly once. The manifest is written only once the step log holds every step below
``s`` (the write of ``s-1`` committed) and every store has committed ``v+1``, as before. Until
then the manifest names ``v``, which every store still holds: ``open(v+1)`` keeps it, and only
the next checkpoint's commit discards it, after this manifest. A crash (or a failed write of
``s-1``) before the manifest recovers from ``v`` and replays the log; the stores' ``open(v)``
discards ``v+1`` and whatever steps the loop ran on it. So a crash anywhere leaves a manifest
whose version every listed store can open, and whose step the log reaches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from sparkstep.errors import SparkstepError
from sparkstep.failpoints import armed, failpoint
from sparkstep.ids import Step, Version
from sparkstep.io.config import KafkaConfig
from sparkstep.io.deadletter import DeadLetter
from sparkstep.io.division import (
    DEFAULT_MAX_BYTES_PER_STEP,
    DEFAULT_MAX_RECORDS_PER_STEP,
    Division,
    DivisionOptions,
    DivisionPlanner,
)
from sparkstep.io.errors import ReplayMismatchError, StepAbortedError
from sparkstep.io.output import OutputOptions, OutputWriter, StepFacts
from sparkstep.io.topics import TopicAdmin, consumer_group_id
from sparkstep.runtime.dataflow import StageTarget, WorkerRoute
from sparkstep.runtime.errors import (
    PipelineChangedError,
    RecoveryError,
    RescaleAbortedError,
    RescaleRequestError,
    WorkerError,
)
from sparkstep.runtime.failure import clear_failure
from sparkstep.runtime.layout import Layout, initial_layout
from sparkstep.runtime.manifest import (
    Manifest,
    ManifestLease,
    OperatorsRecord,
    read_manifest,
    store_name,
)
from sparkstep.runtime.metrics import RuntimeMetrics, read_high_watermarks
from sparkstep.runtime.operators import OperatorSpec
from sparkstep.runtime.pipeline import Pipeline
from sparkstep.runtime.rescale import (
    CATCHUP_KEYS,
    RescaleResult,
    check_request,
    run_hot_procedure,
    run_procedure,
)
from sparkstep.runtime.runstate import LoopPhase, RunState
from sparkstep.runtime.step import NARROW_STEP_OFFSETS, OUTPUT_WEIGHT, StepOutput, StepRunner
from sparkstep.runtime.worker.client import WorkerClient

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

__all__ = ["Runtime", "RuntimeOptions", "division_digest", "ensure_layouts"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_W = TypeVar("_W")

_WRITE_ATTEMPTS = 5


@dataclass(frozen=True)
class RuntimeOptions:
    """The runtime's settings (from the command line, passed down explicitly).

    ``stores`` are the workers' store directories relative to ``state_dir``, in worker order;
    they are recorded in the first manifest. ``on_replay_mismatch``: what recovery does when a
    replayed step's state digests or output differ from its record: ``fail`` (a
    :class:`~sparkstep.io.errors.ReplayMismatchError` naming the step and what differs) or
    ``reemit`` (write the difference as a correction of the step, and checkpoint once the replay
    is done, so the corrected steps are never replayed again). A difference in the input is
    always fatal. ``tick_interval_s``: when the pipeline has
    operators with timeouts, an idle runtime takes an empty "tick" step this often, so timers
    fire on logged time without input (default: a quarter of the shortest timeout).
    ``rescale_catchup_keys``: a hot rescale's copy rounds go on while more keys than this
    changed (:data:`~sparkstep.runtime.rescale.CATCHUP_KEYS`). ``narrow_step_offsets``: steps
    of at most this many offsets run as one Spark stage in one task (0: never; see
    :mod:`sparkstep.runtime.step`).
    """

    name: str
    state_dir: Path
    token: str
    topics: Mapping[str, str]
    output_topic: str
    stores: tuple[str, ...]
    max_records_per_step: int = DEFAULT_MAX_RECORDS_PER_STEP
    max_bytes_per_step: int = DEFAULT_MAX_BYTES_PER_STEP
    start_from: Literal["earliest", "latest"] = "earliest"
    tick_interval_s: float | None = None
    pause_timeout_s: float = 300.0
    on_replay_mismatch: Literal["fail", "reemit"] = "fail"
    rescale_catchup_keys: int = CATCHUP_KEYS
    narrow_step_offsets: int = NARROW_STEP_OFFSETS


def _on_each(workers: Sequence[_W], call: Callable[[_W], _T]) -> list[_T]:
    """``call`` on every worker at once (a thread each); the results in worker order.

    Each call is a round trip to a worker process of its own, so W of them take about as long
    as the slowest one rather than their sum: a checkpoint's commits and reopens stop the loop
    for that long. Every call has ended when this returns or raises; the first failure in
    worker order is raised.
    """
    if len(workers) <= 1:
        return [call(client) for client in workers]
    with ThreadPoolExecutor(len(workers), thread_name_prefix="sparkstep-workers") as pool:
        futures = [pool.submit(call, client) for client in workers]
        wait(futures)
    return [future.result() for future in futures]


def division_digest(division: Division) -> str:
    """A digest of everything that fixes a step's input: its ranges, its logged time and, for
    a tentative division, the byte budget that decides where its read stops."""
    doc: dict[str, object] = {
        "step": division.step,
        "ranges": [[r.topic, r.partition, r.start, r.end] for r in division.ranges],
        "wall": division.time.wall,
    }
    if division.byte_budget is not None:
        doc["byte_budget"] = division.byte_budget
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:32]


def _tick_interval(specs: Iterable[OperatorSpec]) -> float | None:
    """How often an idle runtime takes a tick step: a quarter of the shortest timeout (at least
    0.2 s), so a timer fires at most a quarter of its timeout late; None without timeouts."""
    timeouts = [spec.timeout_ms for spec in specs if spec.timeout_ms is not None]
    if not timeouts:
        return None
    return max(0.2, min(timeouts) / 4000)


def ensure_layouts(manifest: Manifest, workers: Sequence[WorkerClient]) -> None:
    """Every store, open at ``manifest.version``, must be its worker of the manifest's layout
    (recovery's step 4, also for callers without a runtime such as the rescale benchmark).

    A store that holds no layout (a new store: it never committed one) is given it now, in its
    working state; it becomes durable with the next checkpoint. A store whose layout epoch or
    worker index differs raises :class:`RecoveryError`: the stores and the manifest are of
    different layouts, which the rescale procedure never leaves behind.
    """
    for w, client in enumerate(workers):
        status = client.status()
        epoch, index = status.get("layout_epoch"), status.get("layout_worker")
        if epoch is None:
            client.set_layout(manifest.layout, w)
            continue
        if epoch != manifest.epoch or index != w:
            raise RecoveryError(
                f"worker {w}'s store {status.get('store')} is worker {index} of layout epoch "
                f"{epoch}, but the manifest (version {manifest.version}) is layout epoch "
                f"{manifest.epoch}: start the workers on the stores the manifest lists, in its "
                "order, and delete store directories it does not list"
            )


class Runtime:
    """The step loop and its procedures; see the module docstring."""

    def __init__(
        self,
        spark: SparkSession,
        pipeline: Pipeline,
        options: RuntimeOptions,
        kafka: KafkaConfig,
        workers: Sequence[WorkerClient],
    ) -> None:
        self.spark = spark
        self.pipeline = pipeline
        self.options = options
        self.kafka = kafka
        self.workers = list(workers)
        self.runner = StepRunner(
            spark,
            pipeline,
            options.topics,
            kafka,
            options.token,
            narrow_offsets=options.narrow_step_offsets,
        )
        self.admin = TopicAdmin(kafka)
        self.planner = DivisionPlanner(
            kafka,
            DivisionOptions(
                topics=tuple(options.topics.values()),
                max_records_per_step=options.max_records_per_step,
                max_bytes_per_step=options.max_bytes_per_step,
                start_from=options.start_from,
            ),
            self.admin,
        )
        self.manifest: Manifest | None = None
        #: This runtime's right to write the manifest, and its workers' fencing token (taken
        #: by :meth:`recover`).
        self._lease: ManifestLease | None = None
        self.writer: OutputWriter | None = None
        self.incarnations: list[str] = []
        self.next_step = Step(0)
        #: The last step's division once it ran on Spark: the next plan starts where it ended.
        self._previous: Division | None = None
        #: The last step whose transaction committed (its division; None before the first).
        self.last_logged: Division | None = None
        #: The writer thread of the running loop (None outside :meth:`run`: writes are then
        #: synchronous), and the write it has in flight.
        self._writes: ThreadPoolExecutor | None = None
        self._pending: tuple[Step, Future[None]] | None = None
        self._tick_interval: float | None = None
        self.metrics = RuntimeMetrics()
        self.specs: list[OperatorSpec] = []
        #: The record of ``specs`` the manifest keeps (set by :meth:`recover`).
        self.operators = OperatorsRecord.of([], pipeline.shards)
        #: Steps corrected by the last recovery (``on_replay_mismatch="reemit"``).
        self.corrected_steps: list[Step] = []
        #: The step a failure belongs to while it propagates (see
        #: :mod:`sparkstep.runtime.failure`): the step on Spark, or the step whose pipelined
        #: write failed.
        self.failing_step: Step | None = None

    @property
    def lease(self) -> ManifestLease:
        """The manifest lease :meth:`recover` claimed."""
        if self._lease is None:
            raise RecoveryError("the runtime has not recovered: it holds no manifest lease")
        return self._lease

    # -- recovery -----------------------------------------------------------------------------

    def _initial_manifest(
        self, deployment: str, layout: Layout, operators: OperatorsRecord
    ) -> Manifest:
        manifest = Manifest(
            deployment=deployment,
            name=self.options.name,
            layout=layout,
            stores=self.options.stores,
            version=Version(0),
            step=Step(0),
            operators=operators,
        )
        self.lease.write(manifest, expected=None)
        log.info("new deployment %s of %s", manifest.deployment, self.options.name)
        return manifest

    def _new_writer(self, deployment: str) -> OutputWriter:
        """A new (not yet open) output writer of ``deployment``, in place of the one before."""
        if self.writer is not None:
            self.writer.close()
        self.writer = OutputWriter(
            self.kafka,
            OutputOptions(
                name=self.options.name,
                deployment=deployment,
                output_topic=self.options.output_topic,
                key_columns=tuple(self.pipeline.output_key) or None,
                weight_column=OUTPUT_WEIGHT,
            ),
            self.admin,
        )
        return self.writer

    def _check_operators(self, manifest: Manifest) -> None:
        """The pipeline's stateful operators must be those the state was made by."""
        recorded = manifest.operators
        if recorded is None:  # a manifest from before the record: the next checkpoint adds it
            log.info("the manifest records no operators: recording them at the next checkpoint")
            return
        changes = recorded.changes_to(self.operators)
        if changes:
            raise self._changed(changes)

    def _changed(self, changes: Sequence[str]) -> PipelineChangedError:
        return PipelineChangedError(
            f"the pipeline's stateful operators are not those the state in "
            f"{self.options.state_dir} was made by: {'; '.join(changes)}. The old state cannot "
            "be read by the new operators: run the code the state was made by, or start a new "
            "deployment with a new --state-dir and --name"
        )

    def recover(self) -> Step:
        """Run the recovery procedure; return the first step the loop will take.

        Raises :class:`PipelineChangedError` if the pipeline's stateful operators differ from
        those the manifest records: no store and no manifest is changed then (the output writer
        has taken over from the dead one, as every start does, and writes nothing).
        """
        # Step 0. This runtime's generation: from here on no earlier runtime of this state
        # dir can write the manifest, or change a store this one has called.
        self._lease = ManifestLease.claim(self.options.state_dir)
        for worker in self.workers:
            worker.generation = self.lease.generation
        found = read_manifest(self.options.state_dir)
        layout = (
            found.layout
            if found is not None
            else initial_layout(self.pipeline.shards, len(self.workers))
        )
        if layout.shards != self.pipeline.shards:
            raise self._changed([f"S changed from {layout.shards} to {self.pipeline.shards}"])
        if layout.workers != len(self.workers):
            raise RecoveryError(
                f"the manifest's layout has {layout.workers} workers but {len(self.workers)} "
                "were started: start the manifest's number of workers"
            )
        self.planner.check_inputs()
        # Steps 2 and 3 (fence the dead writer; the step log's last step) wait on Kafka, and
        # describing the pipeline (building the wide plan over every input partition, which the
        # runner keeps for the first such step) waits on Spark: they run at once. A fresh state
        # dir's deployment id is chosen here; its manifest is written once the operators are
        # known. Step 1 happened when the workers started: each holds its store lock.
        deployment = found.deployment if found is not None else str(uuid.uuid4())
        writer = self._new_writer(deployment)
        with ThreadPoolExecutor(1, thread_name_prefix="sparkstep-writer-open") as pool:
            opening = pool.submit(writer.open)
            specs = self.runner.describe(layout, self.planner.input_partitions())
        logged_next = opening.result()
        self.specs = list(specs.values())
        self.operators = OperatorsRecord.of(self.specs, self.pipeline.shards)
        if found is not None:
            self._check_operators(found)
        manifest = found or self._initial_manifest(deployment, layout, self.operators)
        self.manifest = manifest
        self._tick_interval = self.options.tick_interval_s or _tick_interval(self.specs)
        for worker in self.workers:
            worker.configure(self.specs, self.pipeline.shards, manifest.deployment)
        # Step 4. Open every store at the manifest's version (each worker holding its store).
        self._check_stores(manifest)
        self._open_all(manifest.version)
        ensure_layouts(manifest, self.workers)
        # Step 5. Every store agrees on the step.
        steps = {w: int(client.status()["step"]) for w, client in enumerate(self.workers)}
        if set(steps.values()) != {manifest.step}:
            raise RecoveryError(
                f"the stores disagree with the manifest (version {manifest.version}, step "
                f"{manifest.step}) about the next step: {steps}"
            )
        if manifest.step > logged_next:
            raise RecoveryError(
                f"the checkpoint is at step {manifest.step} but the step log ends at step "
                f"{logged_next - 1}: the step log topic was truncated or belongs to another "
                "pipeline"
            )
        log.info(
            "recovered %s at version %d step %d (fingerprint %s); replaying steps %d..%d",
            self.options.name,
            manifest.version,
            manifest.step,
            self.operators.fingerprint[:12],
            manifest.step,
            logged_next - 1,
        )
        # Step 6. Replay the logged steps after the checkpoint, from input that still holds
        # what the last logged step read (a recreated topic would not).
        last = writer.step_log.last() if logged_next > 0 else None
        if last is not None:
            self.planner.check_ends(last.to_division().ends())
        self.next_step = manifest.step
        self._previous = self.last_logged = None
        self.corrected_steps = []
        first = max(manifest.step - 1, 0)
        self.metrics.replay_until(logged_next)
        for record in writer.step_log.records(first, logged_next - 1):
            if record.step < manifest.step:  # the step before the checkpoint: its ends
                self._previous = self.last_logged = record.to_division()
            else:
                self._run_step(record.to_division())
        # Step 7. New steps from here; after corrections, a checkpoint first, so that the
        # corrected steps are never replayed (and corrected) again.
        if self.corrected_steps:
            log.warning(
                "recovery corrected steps %s: checkpointing at step %d",
                self.corrected_steps,
                self.next_step,
            )
            self.checkpoint(None)
        return self.next_step

    def _check_stores(self, manifest: Manifest) -> None:
        """Worker ``w`` must hold the store the manifest lists as ``w``, for this deployment and
        these operators (configure bound a store that had none to them)."""
        expected_fp = self.operators.fingerprint
        for w, client in enumerate(self.workers):
            status = client.status()
            expected = manifest.stores[w]
            try:
                held = store_name(str(status["store"]))
            except ValueError:
                held = str(status["store"])
            if held != expected:
                raise RecoveryError(
                    f"worker {w} at {client.address} holds the store {status['store']}, but the "
                    f"manifest gives worker {w} the store {expected}: start the workers in the "
                    "manifest's order"
                )
            if status.get("deployment") != manifest.deployment:
                raise RecoveryError(
                    f"worker {w}'s store {status['store']} belongs to deployment "
                    f"{status.get('deployment')}, the manifest to {manifest.deployment}: the "
                    "state dir mixes two deployments; restore it, or start a new deployment "
                    "with a new --state-dir and --name"
                )
            if status.get("fingerprint") != expected_fp:
                raise RecoveryError(
                    f"worker {w}'s store was made for other operators (fingerprint "
                    f"{str(status.get('fingerprint'))[:12]}, this pipeline {expected_fp[:12]}): "
                    "run the code the state was made by, or start a new deployment with a new "
                    "--state-dir and --name"
                )

    def _open_all(self, version: Version) -> None:
        common = range(0, 1 << 62)
        for versions in _on_each(self.workers, lambda client: client.versions()):
            common = range(max(common.start, versions.start), min(common.stop, versions.stop))
        if version not in common:
            raise RecoveryError(
                f"the manifest's version {version} is not one every store can open (they share "
                f"{list(common)}): the state dir is damaged; restore it or start afresh with "
                "`sparkstep reset`"
            )
        self.incarnations = _on_each(self.workers, lambda client: client.open(version))

    # -- the step loop ------------------------------------------------------------------------

    def run(self, state: RunState) -> None:
        """The step loop: runs steps until ``state`` says stop; see the module docstring.

        Every step's write has ended when it returns or raises (a write in flight when another
        error ends the loop is waited for, and its own failure is logged).
        """
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="sparkstep-write") as writes:
                self._writes = writes
                try:
                    self._loop(state)
                finally:
                    self._writes = None
                    self._abandon_pending()
                    self.planner.close()  # the idle wait's consumer lives while the loop runs
                    self.runner.close()  # a step planned ahead that will not run
        except BaseException as exc:
            state.finished(exc)
            raise
        if state.failure is not None:  # a procedure failed while the loop was paused
            raise state.failure
        state.finished()

    def _loop(self, state: RunState) -> None:
        while state.at_top(self.next_step, settle=self._settle):
            division = self._plan()
            if division.is_empty and not self._must_run_empty(division):
                self._settle()  # an idle loop has nothing in flight
                self.planner.wait_for_input(
                    self._previous, state.token.event, timeout_s=self._tick_interval
                )
                continue
            failpoint("runtime.after_division")
            self._run_step(division)
        self._settle()

    def _settle(self) -> None:
        """Wait for the write in flight, if any; its failure is raised here, as its step's.

        ``_pending`` is cleared only once the write has ended: a checkpoint reads it from its
        own thread (:meth:`checkpoint`) and must never see None while a write is in flight.
        """
        if self._pending is None:
            return
        step, future = self._pending
        try:
            future.result()
        except BaseException:
            self.failing_step = step
            raise
        finally:
            self._pending = None

    def _abandon_pending(self) -> None:
        """After the loop failed: wait for the write in flight and log how it ended."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        exc = future.exception()
        if exc is not None:
            log.warning("step %d's write failed too, after the loop had failed: %s", step, exc)

    def _plan(self) -> Division:
        high = read_high_watermarks(self.planner)  # before the plan's LSOs: see runtime.metrics
        division = self.planner.plan(self._previous)
        self.metrics.observe_plan(division, self.planner.last_stable_offsets(), high)
        if division.step != self.next_step:
            raise RecoveryError(f"planned step {division.step} but step {self.next_step} is next")
        return division

    def _must_run_empty(self, division: Division) -> bool:
        """Whether an empty division is a step anyway.

        - Step 0 with ``--start-from latest``: its (empty) ranges start at the LSOs of the
          moment; logging it fixes those starts, else every later plan would start at the LSO
          of its own moment and skip the input that arrived in between.
        - A timer tick: the pipeline has timeouts and no step ran for the tick interval.
        """
        if self._previous is None:
            return self.options.start_from == "latest"
        interval = self._tick_interval
        return interval is not None and (
            division.time.wall - self._previous.time.wall >= interval * 1000
        )

    def _target(self, division: Division) -> StageTarget:
        assert self.manifest is not None
        routes = tuple(
            WorkerRoute(client.address, incarnation)
            for client, incarnation in zip(self.workers, self.incarnations, strict=True)
        )
        return StageTarget(
            routes=routes,
            step=division.step,
            division_digest=division_digest(division),
            step_time_ms=division.time.wall,
            layout_epoch=self.manifest.layout.epoch,
        )

    def _run_step(self, division: Division) -> None:
        """Run ``division`` on Spark, then write it: in the loop, in the writer thread once the
        previous step's write has committed (module docstring, "Pipelined writes"); otherwise
        (replay) at once.

        The Spark job runs once: its output is a function of the division, which cannot change
        (the workers would answer a rerun with their recorded deltas anyway).
        """
        assert self.manifest is not None and self.writer is not None
        started = time.monotonic()
        self.failing_step = division.step
        layout = self.manifest.layout
        out = self.runner.run(division, layout, self._target)
        division = out.division  # final: cut where the step's byte budget stopped the read
        failpoint("runtime.after_stage")
        digests = {
            str(w): str(client.status()["state_digest"]) for w, client in enumerate(self.workers)
        }
        facts = StepFacts(
            epoch=layout.epoch,
            time=division.with_max_input_ts(out.max_input_ts).time,
            division=out.summaries,
            state_digests=digests,
        )
        self._settle()
        self._previous = division
        self.next_step = Step(division.step + 1)
        if self._writes is None:
            self._write_step(division, out, facts, started)
        else:
            future = self._writes.submit(self._write_step, division, out, facts, started)
            self._pending = (division.step, future)
        self.failing_step = None

    def _write_step(
        self, division: Division, out: StepOutput, facts: StepFacts, started: float
    ) -> None:
        """Write a step that ran; an aborted transaction is retried with the same output.

        The write is tried up to :data:`_WRITE_ATTEMPTS` times with a growing pause, then the
        step fails; a :class:`~sparkstep.io.errors.RecurringWriteError` (a cause every rerun
        meets) fails it at once, and the failure record recognises its recurrence
        (:mod:`sparkstep.runtime.failure`).
        """
        for attempt in range(1, _WRITE_ATTEMPTS + 1):
            try:
                self._write(division, out.output, out.dead_letters, facts)
                break
            except StepAbortedError as exc:
                if attempt == _WRITE_ATTEMPTS:
                    raise
                log.warning("step %d aborted (%s): writing it again", division.step, exc)
                time.sleep(0.1 * 2**attempt)
        failpoint("runtime.after_write")
        self.last_logged = division
        self.metrics.step_finished(
            division,
            time.monotonic() - started,
            records_in=sum(summary.count for summary in out.summaries),
            records_out=out.output.num_rows,
            dead_letters=len(out.dead_letters),
        )

    def _write(
        self,
        division: Division,
        output: pa.Table,
        dead_letters: Sequence[DeadLetter],
        facts: StepFacts,
    ) -> None:
        """Write a step, or recognise its replay; with ``on_replay_mismatch="reemit"`` a replay
        whose state or output differs from its record is corrected (the difference is written,
        see :meth:`~sparkstep.io.output.OutputWriter.correct`) instead of failing."""
        assert self.writer is not None
        try:
            self.writer.write(division.step, output, dead_letters, facts)
        except ReplayMismatchError as exc:
            if self.options.on_replay_mismatch != "reemit" or not exc.correctable:
                raise
            log.warning("%s: reemitting step %d as --on-replay-mismatch=reemit asks", exc, exc.step)
            self.writer.correct(division.step, output, facts)
            self.corrected_steps.append(division.step)

    def input_ends(self) -> dict[str, int]:
        """Per input partition (``"topic/partition"``), the end of the last logged step."""
        logged = self.last_logged
        if logged is None:
            return {}
        return {f"{topic}/{partition}": end for (topic, partition), end in logged.ends().items()}

    # -- checkpoint ---------------------------------------------------------------------------

    def checkpoint(self, state: RunState | None) -> Manifest:
        """Run the checkpoint procedure (module docstring, "Checkpoint"); return the new
        manifest.

        ``state`` is the running loop's state machine (None when no loop runs, e.g. right
        after recovery). Any failure before the manifest is written fails the loop
        (``state.fail``) and raises: the stores were committed or reopened past the manifest,
        and only recovery may continue.
        """
        assert self.manifest is not None
        started = time.monotonic()
        # Step 1. Pause at s, briefly, without waiting for step s-1's write: every step below
        # s has run. A loop paused by the user (before or during the checkpoint) stays paused.
        if state is not None:
            step = state.pause(self.options.pause_timeout_s, brief=True, settle=False)
        else:
            step = self.next_step
        # The loop is paused: what it left in flight and the division of step s-1 are stable.
        in_flight = None if self._pending is None else self._pending[1]
        ends = None if self._previous is None else self._previous.ends()
        try:
            # Step 2. Every worker: set_step(s) and commit, all at once. With the failpoint
            # between two commits armed (crash tests), one after the other, so that its crash
            # leaves the riskiest state: the first store committed, the others not.
            if "checkpoint.between_commits" in armed():
                for i, client in enumerate(self.workers):
                    client.commit(step)
                    if i == 0:
                        failpoint("checkpoint.between_commits")
            else:
                _on_each(self.workers, lambda client: client.commit(step))
            failpoint("checkpoint.after_commits")
            # Step 3. Reopen every store at v+1 (new incarnations); the stores keep v.
            version = Version(self.manifest.version + 1)
            self._open_all(version)
            failpoint("checkpoint.after_reopen")
            # Step 4. Resume (unless the user paused): step s runs on the stores at v+1.
            if state is not None:
                state.end_brief_pause()
            # Step 5. Wait for step s-1's write: the manifest must not name a step the log
            # does not reach. Its failure fails the checkpoint (and the loop, at its settle).
            if in_flight is not None:
                in_flight.result()
            failpoint("checkpoint.after_write")
            # Step 6. The manifest: the commit point.
            manifest = dataclasses.replace(
                self.manifest,
                version=version,
                step=step,
                operators=self.operators,
                written_at=time.time(),
            )
            self.lease.write(manifest, expected=self.manifest.version)
            self.manifest = manifest
            failpoint("checkpoint.after_manifest")
            clear_failure(self.options.state_dir, step)
        except BaseException as exc:
            # The stores are closed, half committed or ahead of the manifest.
            if state is not None:
                state.fail(exc)
            raise
        # Step 7. Consumer group offsets, so lag tools show progress; a warning where retention
        # could delete input that recovery from this checkpoint would replay. Both only inform:
        # a failure here is logged, the checkpoint stands.
        if ends is not None:
            try:
                self.admin.commit_group_offsets(consumer_group_id(self.options.name), ends)
                self.admin.retention_warnings(ends)
            except SparkstepError as exc:
                log.warning("checkpoint %d: consumer group offsets not committed: %s", step, exc)
        self.metrics.checkpoint_finished(manifest.version, step, time.monotonic() - started)
        log.info(
            "checkpoint version %d at step %d in %.0f ms",
            manifest.version,
            step,
            (time.monotonic() - started) * 1000,
        )
        return manifest

    # -- rescale ------------------------------------------------------------------------------

    def rescale(
        self,
        state: RunState | None,
        workers: Sequence[WorkerClient],
        deadline: float | None = None,
        *,
        hot: bool = False,
    ) -> RescaleResult:
        """Change W to ``len(workers)``, never committing after ``deadline``
        (``time.monotonic()``; see the rescale module's "Deadline").

        The procedure is :mod:`sparkstep.runtime.rescale`'s; here its step 1: ``state`` is the
        loop's state machine (None when no loop runs); ``workers`` the new layout's workers in
        order. Configure the added workers. Cold (``hot`` False): the loop must be paused; a
        checkpoint first if steps ran since the manifest; the loop stays paused. Hot: the loop
        may run; the procedure pauses it briefly itself (``RunState.pause(brief=True)``) and
        resumes it (unless the user paused it). Refused requests raise
        :class:`RescaleRequestError` and change nothing; a hot rescale that fails before its
        pause raises :class:`~sparkstep.runtime.errors.RescaleAbortedError` and the loop runs
        on; any other failure fails the loop (``state.fail``) and raises
        :class:`~sparkstep.runtime.errors.RescaleError`.
        """
        manifest = self.manifest
        if manifest is None:
            raise RescaleRequestError("the runtime has not recovered yet")
        if state is not None:
            snapshot = state.snapshot()
            if state.failure is not None:
                raise RescaleRequestError(f"the loop has failed: {state.failure}")
            if not hot and snapshot.phase is not LoopPhase.PAUSED:
                raise RescaleRequestError(
                    f"a cold rescale needs the loop paused, and it is {snapshot.phase.value}: "
                    "pause first"
                )
        check_request(manifest, self.workers, workers)
        if not hot and manifest.step != self.next_step:
            manifest = self.checkpoint(state)
        n = len(workers)
        clients = [self.workers[w] if w < manifest.workers else workers[w] for w in range(n)]
        for client in clients[manifest.workers :]:
            client.generation = self.lease.generation
        try:
            for client in clients[manifest.workers :]:
                client.configure(self.specs, self.pipeline.shards, manifest.deployment)
        except WorkerError as exc:
            raise RescaleRequestError(f"an added worker cannot be configured: {exc}") from exc
        try:
            if hot:
                timeout = self.options.pause_timeout_s
                new_manifest, incarnations, result = run_hot_procedure(
                    manifest,
                    self.lease,
                    self.workers,
                    clients,
                    (lambda: self.next_step)
                    if state is None
                    else (lambda: state.pause(timeout, brief=True)),
                    deadline,
                    self.options.rescale_catchup_keys,
                )
            else:
                new_manifest, incarnations, result = run_procedure(
                    manifest, self.lease, self.workers, clients, deadline
                )
        except (RescaleRequestError, RescaleAbortedError):
            raise  # refused by the checks, or a hot rescale given up before its pause
        except BaseException as exc:
            # The stores are half moved: only recovery may continue.
            if state is not None:
                state.fail(exc)
            raise
        clear_failure(self.options.state_dir, result.step)
        self.workers = clients
        self.incarnations = incarnations
        self.manifest = new_manifest
        if hot and state is not None:
            state.end_brief_pause()  # only now: a step must not start with the old workers
        return result
