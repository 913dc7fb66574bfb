"""``sparkstep reset``: forget a pipeline's progress and state, so that it starts afresh.

A pipeline's progress lives in two places that only make sense together: its state dir (the
manifest, the stores, the coordinator's files) and its step log topic ``<name>.steps`` (the
deployment and every step's input ranges). :func:`reset_pipeline`, in this order:

1. take the state dir's lock and every store's (:mod:`~sparkstep.coordinator_api.statelock`):
   a coordinator or a worker still using the state dir is refused, nothing is deleted;
2. with ``--state-hosts``: every state host must answer (else nothing is deleted);
3. delete the step log topic and wait until the cluster no longer lists it (the broker is the
   likelier failure, so it goes first: a refusal leaves the state dir whole);
4. with ``--state-hosts``: every host stops the pipeline's workers and deletes its stores
   (``DELETE /v1/pipelines/<name>``, :mod:`~sparkstep.coordinator_api.statehost`);
5. delete what sparkstep makes in the state dir (:data:`STATE_ENTRIES`; under ``workers/`` only
   the directories :func:`~sparkstep.storage.is_store` recognises), then the state dir itself
   if nothing else is left in it; anything else is kept and named in the report.

Each step is idempotent, so a reset cut short is finished by running it again.

Kept, always: the input topics and the output topic (the user's data), and the dead-letter
topic ``<name>.dlq``: it holds the only copy of the input records the pipeline could not
process, each with its source topic, partition and offset, which stay true after a reset.
"""

from __future__ import annotations

import contextlib
import shutil
from dataclasses import dataclass
from pathlib import Path

from sparkstep.coordinator_api.children import read_token
from sparkstep.coordinator_api.hosts import StateHostClient
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.statelock import LOCK_FILE, DirectoryLock
from sparkstep.io.config import KafkaConfig
from sparkstep.io.deadletter import dlq_topic
from sparkstep.io.steplog import steps_topic
from sparkstep.io.topics import TopicAdmin
from sparkstep.runtime.failure import FAILURE_FILE
from sparkstep.runtime.manifest import MANIFEST_FILES
from sparkstep.runtime.pipeline import load_pipeline
from sparkstep.storage import is_store

__all__ = ["ResetPlan", "ResetReport", "STATE_ENTRIES", "plan_reset", "reset_pipeline"]

WORKERS = "workers"

#: What sparkstep writes directly in a state dir: the manifest and its writers' files
#: (generation, lock, temporaries), the runtime's failure record, the coordinator's files,
#: the children's logs, the stores (only those :func:`~sparkstep.storage.is_store`
#: recognises are deleted), the lock.
STATE_ENTRIES = (
    *MANIFEST_FILES,
    FAILURE_FILE,
    "coordinator",
    "logs",
    WORKERS,
    LOCK_FILE,
)


@dataclass(frozen=True)
class ResetPlan:
    """What a reset of pipeline ``name`` deletes: its step log topic and its state dir."""

    name: str
    state_dir: Path
    steps_topic: str
    bootstrap_servers: str
    state_hosts: tuple[str, ...] = ()
    host_token: str | None = None

    def describe(self) -> str:
        """One line: what would be deleted, and what is kept."""
        hosts = (
            f", its stores on the state hosts {','.join(self.state_hosts)}"
            if self.state_hosts
            else ""
        )
        return (
            f"reset deletes the state dir {self.state_dir}{hosts} and the step log topic "
            f"{self.steps_topic} on {self.bootstrap_servers}; the input and output topics and "
            f"the dead-letter topic {dlq_topic(self.name)} are kept"
        )


@dataclass(frozen=True)
class ResetReport:
    """What a reset found and deleted; ``kept`` are state dir entries sparkstep did not make."""

    plan: ResetPlan
    deleted_topic: bool
    deleted_state_dir: bool
    kept: tuple[str, ...]

    def describe(self) -> str:
        plan = self.plan
        topic = (
            f"deleted the step log topic {plan.steps_topic}"
            if self.deleted_topic
            else f"no step log topic {plan.steps_topic}"
        )
        if self.kept:
            state = (
                f"deleted sparkstep's files in {plan.state_dir} and kept what it did not "
                f"create: {', '.join(self.kept)}"
            )
        elif self.deleted_state_dir:
            state = f"deleted the state dir {plan.state_dir}"
        else:
            state = f"no state dir {plan.state_dir}"
        hosts = (
            f"; deleted its stores on the state hosts {','.join(plan.state_hosts)}"
            if plan.state_hosts
            else ""
        )
        return f"reset {plan.name}: {topic}; {state}{hosts}"


def plan_reset(settings: CoordinatorSettings) -> ResetPlan:
    """The plan for the pipeline of ``settings`` (its name: ``--name``, else the pipeline's)."""
    name = settings.name or load_pipeline(settings.pipeline).name
    token = None
    if settings.state_hosts:
        assert settings.state_host_token_file is not None  # the settings check it
        token = read_token(settings.state_host_token_file)
    return ResetPlan(
        name,
        settings.state_dir,
        steps_topic(name),
        settings.bootstrap_servers,
        settings.state_hosts,
        token,
    )


def reset_pipeline(plan: ResetPlan, kafka: KafkaConfig) -> ResetReport:
    """Delete what ``plan`` names; see the module docstring.

    Raises :class:`~sparkstep.errors.ConfigError` when a coordinator or a worker uses the
    state dir, and :class:`~sparkstep.io.errors.StreamIOError` when the cluster cannot delete
    the topic (nothing local is deleted then).
    """
    state_dir = plan.state_dir
    exists = state_dir.is_dir()
    # Step 1. The state dir and every store to ourselves.
    locks: list[DirectoryLock] = []
    stack = contextlib.ExitStack()
    try:
        if exists:
            locks.append(
                DirectoryLock(
                    state_dir,
                    f"the state dir {state_dir}",
                    "a coordinator runs on it; stop it first (sparkstep stop), then reset",
                )
            )
            workers = state_dir / WORKERS
            stores = sorted(p for p in workers.iterdir() if is_store(p)) if workers.is_dir() else []
            for store in stores:
                locks.append(
                    DirectoryLock(
                        store,
                        f"the store {store}",
                        "a worker still owns it; stop its coordinator first, then reset",
                        create=False,
                    )
                )
        # Step 2. Every state host answers.
        hosts = [StateHostClient(a, plan.host_token or "") for a in plan.state_hosts]
        for host in hosts:
            stack.callback(host.close)
        for host in hosts:
            host.describe()
        # Step 3. The step log.
        deleted_topic = TopicAdmin(kafka).delete_topic(plan.steps_topic)
        # Step 4. The stores on the state hosts.
        for host in hosts:
            host.delete_pipeline(plan.name)
        # Step 5. The state dir.
        if not exists:
            return ResetReport(plan, deleted_topic, False, ())
        for entry in STATE_ENTRIES:
            path = state_dir / entry
            if entry == WORKERS and path.is_dir() and not path.is_symlink():
                _remove_stores(path)
            elif path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    finally:
        stack.close()
        for lock in locks:
            lock.release()
    kept = tuple(
        sorted(
            f"{WORKERS}/{inner.name}" if path.name == WORKERS else path.name
            for path in state_dir.iterdir()
            for inner in (path.iterdir() if path.name == WORKERS else (path,))
        )
    )
    if not kept:
        state_dir.rmdir()
    return ResetReport(plan, deleted_topic, not kept, kept)


def _remove_stores(workers: Path) -> None:
    """Delete the stores under ``workers``, then ``workers`` itself if nothing else is in it:
    a directory sparkstep did not create as a store is never deleted."""
    for path in workers.iterdir():
        if is_store(path):
            shutil.rmtree(path)
    if not any(workers.iterdir()):
        workers.rmdir()
