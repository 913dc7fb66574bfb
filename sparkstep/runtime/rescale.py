"""Rescale: change the number of state workers W at a checkpoint boundary, moving the fewest shards.

Two procedures end in the same commit (steps 6 to 11 below): the **cold** one runs entirely
while the pipeline is paused at a checkpoint; the **hot** one (the default, section "Hot")
copies the moving shards while the steps run and pauses only to ship what changed meanwhile
and to switch.

The design's procedure (ARCHITECTURE.md "Rescale"; seed 004 "Scaling state", "Layout changes",
the "cold" change without stopping the workers that stay) is split between the caller (the
coordinator) and the runtime:

- the caller pauses the loop, checkpoints (manifest at ``v``, stores reopened at ``v``) and
  starts every worker the new layout adds: ``python -m sparkstep.runtime.worker --store
  <state_dir>/workers/w<i>-e<epoch+1> --create-version v`` (``RocksDBStore.create(path,
  version=v, replace=True)``);
- the runtime runs the steps below: ``Runtime.rescale`` (:mod:`sparkstep.runtime.driver`) checks
  the loop and configures the added workers, then :func:`run_procedure` runs the rest (alone,
  for callers without a step loop such as the benchmark); this module knows no ``Runtime``;
- the caller then stops the retired worker processes, deletes their store directories, and
  resumes the loop.

The runtime's part, in this order (failpoints in brackets):

1. Check the request; nothing changes if it is refused (:class:`RescaleRequestError`): the loop
   is paused; ``1 <= N <= S``; workers ``0..min(W, N)`` are the current ones (same addresses:
   the same processes and stores); checkpoint now if the manifest's step is not the paused step;
   every added worker holds a new, empty store under the state dir whose only version is ``v``;
   configure the added workers with the pipeline's operators.
2. Plan the layout ``epoch + 1`` at N (:func:`~sparkstep.runtime.layout.plan_rescale`: fewest
   shards moved from the current assignment, every worker within one shard of S/N)
   [``rescale.after_plan``].
3. Open the added stores at ``v`` (the kept ones are open at ``v`` since the checkpoint).
4. Export the moving shards from their owners, one set of SST files per (source, target) pair,
   into the source store's ``exports/e<epoch+1>-w<src>-w<dst>/`` (a worker writes only inside its
   own store; see :mod:`sparkstep.runtime.worker`) [``rescale.after_export``].
5. Each pair's target fetches the pair's files from its source over the network (the source's
   advertised address, Flight ``DoGet``, sha256 checked per file, the whole transfer retried a
   bounded number of times; :mod:`sparkstep.runtime.worker.server`) into its own store's
   ``imports/<name>/`` and imports them; no path on a shared disk [``rescale.between_imports``
   after the first pair, ``rescale.after_import``].
6. Drop the moved shards at the sources that stay (a retired worker is never committed again,
   so nothing is dropped there) [``rescale.after_drop``].
7. Write the new layout into every new-layout store [``rescale.after_layout``].
8. Commit ``v + 1`` (``set_step(s)``) in every new-layout store [``rescale.between_commits``
   after the first, ``rescale.after_commits``].
9. Write the manifest ``{epoch + 1, N, stores, version: v + 1, step: s}``: the commit point
   [``rescale.after_manifest``]. ``stores`` are the kept workers' stores followed by the added
   workers' stores, relative to the state dir.
10. Reopen every new-layout store at ``v + 1`` (new incarnations).
11. Close the retired workers' databases without commit (a kept worker emptied its exports
    and fetched files when it reopened; a target deletes fetched files once imported).

Crash safety. Until step 9 the manifest names the old layout at ``v``: every old store still
holds ``v`` (a kept store that committed ``v + 1`` in step 8 keeps ``{v, v + 1}``; opening ``v``
discards ``v + 1``), the retired stores were never committed, and the added stores are not in
the manifest (the coordinator deletes store directories the manifest does not list before it
restarts the workers). From step 9 on the manifest names the new layout at ``v + 1``, which
every store it lists has committed. Recovery checks that each store's layout epoch is the
manifest's (``Runtime.recover``), so a mix of the two is refused rather than run. The
layout lives inside each version with the data (a rolled-back version rolls its layout back).

Deadline. One rescale has one deadline (``time.monotonic()``), the caller's: the coordinator
sends what remains of its own (``deadline_s`` of ``POST /rescale``); without one it is
:data:`DEFAULT_DEADLINE_S` from the start of step 2. Every export, import and drop call waits
at most until the deadline, and step 9 is never started after it (:class:`RescaleError`, so the
manifest stays the old one). The caller that gave up waiting may therefore trust the manifest
once the runtime has answered or is dead; until then the manifest write may be under way.

Bytes moved are the sizes of the exported SST files (what crosses the network between
workers). A transfer that stays broken or corrupt fails the rescale before step 9 like any
other failed call (:class:`RescaleError` from ``ShardTransferError``).

Hot (:func:`run_hot_procedure`; seed 004's "hot" layout change). The caller starts the added
workers on new stores at the last checkpoint ``v`` while the steps run (no checkpoint can run
during a rescale: procedures are exclusive). Then, with the steps running:

1. the same checks (step 1) and plan (step 2) [``rescale.after_plan``];
2. open the added stores at ``v``; every source starts tracking the keys of its moving shards
   that the applies write (:mod:`sparkstep.runtime.worker.changes`) [``rescale.after_track``];
3. the whole copy: each source exports its pair's shards from its live working copy (RocksDB
   iterators, applies go on) and the target fetches the files into its ``imports/`` without
   ingesting them (staged: part of no version) [``rescale.after_precopy``];
4. while the sources have more than :data:`CATCHUP_KEYS` changed keys not yet shipped, a round
   ships them (their values now, or deletions), staged likewise, at most :data:`MAX_ROUNDS`
   rounds in all [``rescale.after_round``];
5. pause (every step below ``s'`` complete and written) [``rescale.after_pause``];
6. the catch-up: the changes since the last round, staged; every target ingests its staged
   files in order (each later file shadows the earlier ones key by key)
   [``rescale.after_import``];
7. steps 6 to 11 of the cold procedure, committing ``v + 1`` at step ``s'`` (the rescale's
   commit is also the checkpoint of the steps since ``v``); the caller switches the loop to the
   new workers, then resumes it.

Why the copy is exact: see :mod:`sparkstep.runtime.worker.changes` (every key written after
tracking began is shipped again with its value at the pause; every other key has that value
in any read made after tracking began). Why copy from the live working copy rather than from
the immutable version ``v``: the keys written between ``v`` and the start of tracking are not
tracked, so a copy of ``v`` would miss them; a copy made after tracking began needs no extra
checkpoint (a pause) before the copy.

Why not the cold path after the last round, as the issue suggested: the catch-up ships at most
the keys the moving shards hold, and usually far fewer, while the cold path would ship all of
them inside a longer pause; so past :data:`MAX_ROUNDS` the pause simply ships what is left.

Crash safety of hot. Before the pause nothing of the current layout changed (the sources'
working copies are untouched, staged files are in ``imports/``, emptied at every open; the
added stores are not in the manifest): a failure raises :class:`RescaleAbortedError`, the
sources stop tracking and the steps go on; a crash recovers at ``v``. From the pause on the
crash rules are the cold ones: the manifest names the old layout at ``v`` (the steps since
``v`` are replayed from the step log) or the new one at ``v + 1``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, TypeVar

from sparkstep.errors import ConfigError, SparkstepError
from sparkstep.failpoints import failpoint
from sparkstep.ids import LayoutEpoch, Step, Version, WorkerId
from sparkstep.runtime.errors import (
    RescaleAbortedError,
    RescaleError,
    RescaleRequestError,
    WorkerError,
)
from sparkstep.runtime.layout import Layout, Move, check_worker_count, plan_rescale
from sparkstep.runtime.manifest import STORES_DIR, Manifest, ManifestLease, store_name
from sparkstep.runtime.worker.client import WorkerClient

__all__ = [
    "CATCHUP_KEYS",
    "DEFAULT_DEADLINE_S",
    "MAX_ROUNDS",
    "RescaleResult",
    "check_request",
    "new_store_path",
    "run_hot_procedure",
    "run_procedure",
]

_T = TypeVar("_T")

DEFAULT_DEADLINE_S = 3600.0
"""The deadline of a rescale whose caller gives none: shard moves take time proportional to
the shards' state (a worker's usual call deadline is for calls that do not)."""


def _remaining(deadline: float) -> float:
    """Seconds left until ``deadline``; :class:`RescaleError` if none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise RescaleError("its deadline passed before the commit point: nothing was committed")
    return left


@dataclass(frozen=True)
class RescaleResult:
    """What a rescale did: the new layout, what moved, and the checkpoint it committed.

    ``bytes_moved`` is every byte sent between workers: ``bytes_precopied`` while the pipeline
    ran plus ``bytes_paused`` during the pause (cold: all of it is paused). ``rounds`` counts
    the hot procedure's copy rounds while running (0 for cold); ``pause_ms`` the time from the
    runtime's pause to its resume (cold: the runtime's whole part, which runs paused).
    """

    mode: str
    layout_epoch: LayoutEpoch
    workers: int
    shards_moved: int
    bytes_moved: int
    keys_moved: int
    bytes_precopied: int
    bytes_paused: int
    keys_paused: int
    rounds: int
    version: Version
    step: Step
    retired: tuple[str, ...]
    duration_ms: int
    pause_ms: int
    pause_parts_ms: Mapping[str, int]

    def to_json(self) -> dict[str, Any]:
        """The control endpoint's answer."""
        doc = dataclasses.asdict(self)
        doc["retired"] = list(self.retired)
        doc["pause_parts_ms"] = dict(self.pause_parts_ms)
        return doc


def new_store_path(worker: int, epoch: int) -> str:
    """The store, relative to the state dir, of worker ``worker`` added by layout ``epoch``."""
    return f"workers/w{worker}-e{epoch}"


# -- the procedure -----------------------------------------------------------------------------


def check_request(
    manifest: Manifest, current: Sequence[WorkerClient], workers: Sequence[WorkerClient]
) -> None:
    """Step 1's checks that need no call: ``1 <= N <= S``, and the workers that stay keep their
    addresses. Raises :class:`RescaleRequestError`."""
    try:
        check_worker_count(len(workers), manifest.layout.shards)
    except ConfigError as exc:
        raise RescaleRequestError(f"a rescale: {exc}") from exc
    if len(current) != manifest.workers:
        raise RescaleRequestError(
            f"the runtime has {len(current)} workers, its manifest {manifest.workers}"
        )
    for w in range(min(manifest.workers, len(workers))):
        if workers[w].address != current[w].address:
            raise RescaleRequestError(
                f"worker {w} stays in the new layout and must keep its address "
                f"{current[w].address}, not {workers[w].address}"
            )


def _store_of(client: WorkerClient) -> str:
    """The manifest's name of the added worker's store (:func:`store_name`)."""
    store = str(client.status()["store"])
    try:
        return store_name(store)
    except ValueError:
        raise RescaleRequestError(
            f"the added worker at {client.address} holds the store {store}, outside a "
            f"{STORES_DIR}/ directory: start it with --store <state dir>/{STORES_DIR}/w<i>-e<epoch>"
        ) from None


def _check_workers(
    manifest: Manifest,
    current: Sequence[WorkerClient],
    workers: Sequence[WorkerClient],
) -> list[str]:
    """Step 1's checks of the workers; returns the new layout's stores (relative paths)."""
    check_request(manifest, current, workers)
    n = len(workers)
    kept = min(manifest.workers, n)
    stores = list(manifest.stores[:kept])
    try:
        for w in range(kept, n):
            client = workers[w]
            status = client.status()
            versions = client.versions()
            if versions != range(manifest.version, manifest.version + 1):
                raise RescaleRequestError(
                    f"the added worker {w} at {client.address} holds versions {list(versions)}, "
                    f"not only the checkpoint's version {manifest.version}: start it with "
                    f"--create-version {manifest.version}"
                )
            if status.get("open_version") is not None:
                raise RescaleRequestError(f"the added worker {w} at {client.address} is in use")
            stores.append(_store_of(client))
    except WorkerError as exc:
        raise RescaleRequestError(f"an added worker cannot be used: {exc}") from exc
    if len(set(stores)) != len(stores):
        raise RescaleRequestError(f"two workers of the new layout share a store: {stores}")
    return stores


def _export_name(epoch: int, source: WorkerId, target: WorkerId) -> str:
    return f"e{epoch}-w{source}-w{target}"


def _pairs(moves: Sequence[Move]) -> dict[tuple[WorkerId, WorkerId], list[int]]:
    pairs: dict[tuple[WorkerId, WorkerId], list[int]] = {}
    for move in moves:
        pairs.setdefault((move.source, move.target), []).append(int(move.shard))
    return dict(sorted(pairs.items()))


class _Clock:
    """Where a pause goes: the milliseconds of each named part, in order."""

    def __init__(self) -> None:
        self.parts: dict[str, int] = {}
        self._last = time.monotonic()

    def lap(self, part: str) -> None:
        now = time.monotonic()
        self.parts[part] = self.parts.get(part, 0) + round((now - self._last) * 1000)
        self._last = now


def _moved_out(
    manifest: Manifest,
    lease: ManifestLease,
    current: Sequence[WorkerClient],
    workers: Sequence[WorkerClient],
    layout: Layout,
    moves: Sequence[Move],
    stores: Sequence[str],
    step: Step,
    deadline: float,
    clock: _Clock,
) -> tuple[Manifest, list[str]]:
    """Steps 6 to 11, once every target holds its moving shards: drop them at the sources that
    stay, the layout, commit ``v + 1`` at ``step``, the manifest (the commit point), reopen,
    close the retired workers. Returns the new manifest and incarnations."""
    n = len(workers)
    # Step 6. Drop the moved shards at the sources that stay.
    drops = {
        w: [int(m.shard) for m in moves if m.source == w] for w in range(min(manifest.workers, n))
    }
    timeout = _remaining(deadline)
    _each(
        [
            functools.partial(current[w].drop_shards, gone, timeout=timeout)
            for w, gone in drops.items()
            if gone
        ]
    )
    failpoint("rescale.after_drop")
    # Step 7. The new layout into every new-layout store.
    _each([functools.partial(client.set_layout, layout, w) for w, client in enumerate(workers)])
    failpoint("rescale.after_layout")
    clock.lap("drop_and_layout")
    # Step 8. Commit v + 1 everywhere in the new layout: the first alone, then the others at once.
    workers[0].commit(step)
    failpoint("rescale.between_commits")
    _each([functools.partial(client.commit, step) for client in workers[1:]])
    failpoint("rescale.after_commits")
    clock.lap("commit")
    # Step 9. The manifest: the commit point, never after the deadline.
    _remaining(deadline)
    new_manifest = dataclasses.replace(
        manifest,
        layout=layout,
        stores=tuple(stores),
        version=Version(manifest.version + 1),
        step=step,
        written_at=time.time(),
    )
    lease.write(new_manifest, expected=manifest.version)
    failpoint("rescale.after_manifest")
    clock.lap("manifest")
    # Step 10. Reopen the new layout at v + 1; step 11, close the retired workers (no commit).
    incarnations = _each(
        [functools.partial(client.open, new_manifest.version) for client in workers]
        + [client.close_db for client in current[n:]]
    )[:n]
    clock.lap("reopen")
    return new_manifest, [str(i) for i in incarnations]


def _each(calls: Sequence[Callable[[], _T]]) -> list[_T]:
    """Make the calls (each to another worker) at once; their answers in order. The first
    failure is raised once every call has ended (none is left running behind the caller)."""
    if len(calls) <= 1:
        return [call() for call in calls]
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(call) for call in calls]
        wait(futures)
    return [future.result() for future in futures]


def _plan_and_open(
    manifest: Manifest, workers: Sequence[WorkerClient]
) -> tuple[Layout, list[Move], dict[tuple[WorkerId, WorkerId], list[int]]]:
    """Steps 2 and 3: plan the layout ``epoch + 1`` at ``len(workers)`` (its moves, grouped by
    (source, target)), then open the added stores at ``v``."""
    layout = plan_rescale(manifest.layout, len(workers))
    moves = manifest.layout.moves_to(layout)
    failpoint("rescale.after_plan")
    for w in range(manifest.workers, len(workers)):
        workers[w].open(manifest.version)
    return layout, moves, _pairs(moves)


def _failed(manifest: Manifest, n: int, exc: BaseException) -> RescaleError:
    return RescaleError(
        f"rescale from {manifest.workers} to {n} workers (layout epoch {manifest.epoch + 1}) "
        f"failed: {exc}; the state dir recovers to the layout its manifest names"
    )


def run_procedure(
    manifest: Manifest,
    lease: ManifestLease,
    current: Sequence[WorkerClient],
    workers: Sequence[WorkerClient],
    deadline: float | None = None,
) -> tuple[Manifest, list[str], RescaleResult]:
    """The cold procedure: steps 2 to 11 (with step 1's worker checks) from a checkpoint
    ``manifest``, the manifest written under ``lease`` (compare-and-swap on
    ``manifest.version``).

    ``current`` are the manifest's workers, each open at ``manifest.version`` with nothing
    applied since; ``workers`` the new layout's, configured. Returns the new manifest, the new
    incarnations (in worker order) and the result. A failure after the checks, or ``deadline``
    (``time.monotonic()``; default :data:`DEFAULT_DEADLINE_S` from now) passing before step 9,
    raises :class:`RescaleError`: the stores are half moved and only recovery may continue.
    """
    started = time.monotonic()
    if deadline is None:
        deadline = started + DEFAULT_DEADLINE_S
    stores = _check_workers(manifest, current, workers)
    n = len(workers)
    clock = _Clock()
    try:
        layout, moves, pairs = _plan_and_open(manifest, workers)
        clock.lap("start")
        # Step 4. Export the moving shards, one set of files per (source, target).
        exported: dict[tuple[WorkerId, WorkerId], dict[str, Any]] = {}
        for (source, target), shards in pairs.items():
            exported[(source, target)] = current[source].export_shards(
                shards, _export_name(layout.epoch, source, target), timeout=_remaining(deadline)
            )
        failpoint("rescale.after_export")
        # Step 5. Each target fetches its pair's files from the source and imports them.
        for i, ((source, target), answer) in enumerate(exported.items()):
            workers[target].import_files(
                current[source].address,
                _export_name(layout.epoch, source, target),
                answer["files"],
                timeout=_remaining(deadline),
            )
            if i == 0 and len(exported) > 1:
                failpoint("rescale.between_imports")
        failpoint("rescale.after_import")
        clock.lap("move")
        new_manifest, incarnations = _moved_out(
            manifest, lease, current, workers, layout, moves, stores, manifest.step, deadline, clock
        )
    except (SparkstepError, OSError) as exc:
        raise _failed(manifest, n, exc) from exc
    moved = sum(int(a["bytes"]) for a in exported.values())
    keys = sum(int(a["keys"]) for a in exported.values())
    duration = round((time.monotonic() - started) * 1000)
    result = RescaleResult(
        mode="cold",
        layout_epoch=layout.epoch,
        workers=n,
        shards_moved=len(moves),
        bytes_moved=moved,
        keys_moved=keys,
        bytes_precopied=0,
        bytes_paused=moved,
        keys_paused=keys,
        rounds=0,
        version=new_manifest.version,
        step=manifest.step,
        retired=tuple(client.address for client in current[n:]),
        duration_ms=duration,
        pause_ms=duration,
        pause_parts_ms=clock.parts,
    )
    return new_manifest, incarnations, result


# -- the hot procedure -------------------------------------------------------------------------

CATCHUP_KEYS = 20_000
"""The most changed keys a hot rescale leaves for its pause: while the moving shards hold more
changed keys than this, another copy round runs (up to :data:`MAX_ROUNDS`)."""
MAX_ROUNDS = 4
"""A hot rescale's copy rounds while running: the whole copy, then at most three rounds of
changes. Each round ships what changed during the previous one, so under a steady input they
shrink until a round is as short as the catch-up; past the last the pause ships what is left."""


def run_hot_procedure(
    manifest: Manifest,
    lease: ManifestLease,
    current: Sequence[WorkerClient],
    workers: Sequence[WorkerClient],
    pause: Callable[[], Step],
    deadline: float | None = None,
    catchup_keys: int = CATCHUP_KEYS,
) -> tuple[Manifest, list[str], RescaleResult]:
    """The hot procedure (module docstring, "Hot"): copy while the steps run, pause only for
    the catch-up and the switch.

    ``manifest`` is the last checkpoint (version ``v``); ``current`` its workers, open at ``v``
    with steps applied since; ``workers`` the new layout's, the added ones configured and
    holding new stores at ``v``. ``pause()`` stops the steps and returns the next step once
    every step below it is complete and written; the procedure returns with the steps still
    paused: the caller switches to the new workers and incarnations, then lets the steps go on
    (a step started before the switch would use the old ones). ``pause_ms`` in the result is
    the time from the pause to the return. ``catchup_keys``: the most changed keys left for the
    pause while rounds remain (:data:`CATCHUP_KEYS`). A failure before the pause raises
    :class:`RescaleAbortedError` (nothing in the current layout changed; the steps go on); one
    after it :class:`RescaleError` (only recovery may continue), as does ``deadline`` passing
    before the manifest.
    """
    started = time.monotonic()
    if deadline is None:
        deadline = started + DEFAULT_DEADLINE_S
    stores = _check_workers(manifest, current, workers)
    n = len(workers)
    clock = _Clock()
    copies: dict[tuple[WorkerId, WorkerId], list[tuple[str, dict[str, Any]]]] = {}
    rounds = 0
    tracked: list[WorkerClient] = []
    try:
        layout, moves, pairs = _plan_and_open(manifest, workers)
        # The sources start tracking the moving shards.
        by_source: dict[WorkerId, list[int]] = {}
        for (source, _), shards in pairs.items():
            by_source.setdefault(source, []).extend(shards)
        for source, shards in sorted(by_source.items()):
            current[source].track(sorted(shards))
            tracked.append(current[source])
        failpoint("rescale.after_track")

        def copy_pair(source: WorkerId, target: WorkerId, live_copy: bool) -> dict[str, Any]:
            """The pair's shards (the whole copy) or their changes, staged at the target."""
            name = f"{_export_name(layout.epoch, source, target)}-r{rounds}"
            shards = pairs[(source, target)]
            timeout = _remaining(deadline)
            if live_copy:
                answer = current[source].export_shards(shards, name, live=True, timeout=timeout)
            else:
                answer = current[source].export_changes(shards, name, timeout=timeout)
            workers[target].import_files(
                current[source].address, name, answer["files"], stage=True, timeout=timeout
            )
            answer["name"] = name
            return answer

        def copy_round(live_copy: bool, at_once: bool = False) -> tuple[int, int]:
            """Every pair (one after the other while the steps run, gently; ``at_once`` in
            the pause); returns the bytes and keys sent."""
            calls = [
                functools.partial(copy_pair, source, target, live_copy) for source, target in pairs
            ]
            answers = _each(calls) if at_once else [call() for call in calls]
            for pair, answer in zip(pairs, answers, strict=True):
                copies.setdefault(pair, []).append((answer["name"], answer["files"]))
            return sum(int(a["bytes"]) for a in answers), sum(int(a["keys"]) for a in answers)

        # Step 4. The whole copy while the steps run, then rounds of changes.
        precopied, keys_moved = copy_round(live_copy=True)
        rounds = 1
        failpoint("rescale.after_precopy")
        while rounds < MAX_ROUNDS and _changed(tracked) > catchup_keys:
            sent, keys = copy_round(live_copy=False)
            precopied, keys_moved = precopied + sent, keys_moved + keys
            rounds += 1
            failpoint("rescale.after_round")
        # Step 5. Pause: every step below `step` is complete and written.
        step = pause()
    except (SparkstepError, OSError) as exc:
        for client in tracked:  # best effort: a worker that cannot answer is killed anyway
            with contextlib.suppress(SparkstepError):
                client.track([])
        raise RescaleAbortedError(
            f"hot rescale from {manifest.workers} to {n} workers failed before its pause, "
            f"nothing changed and the pipeline runs on: {exc}"
        ) from exc
    paused = time.monotonic()
    clock = _Clock()
    try:
        failpoint("rescale.after_pause")
        # Step 6. The catch-up: what changed since the last round, then every target ingests
        # its staged files in order.
        final, keys_paused = copy_round(live_copy=False, at_once=True)
        clock.lap("catch_up")
        by_target: dict[WorkerId, list[tuple[str, dict[str, Any]]]] = {}
        for (_, target), staged in copies.items():
            by_target.setdefault(target, []).extend(staged)  # in order, per pair
        timeout = _remaining(deadline)

        def ingest_all(target: WorkerId) -> None:
            for name, files in by_target[target]:
                workers[target].ingest(name, files, timeout=timeout)

        _each([functools.partial(ingest_all, target) for target in by_target])
        failpoint("rescale.after_import")
        clock.lap("ingest")
        new_manifest, incarnations = _moved_out(
            manifest, lease, current, workers, layout, moves, stores, step, deadline, clock
        )
    except (SparkstepError, OSError) as exc:
        raise _failed(manifest, n, exc) from exc
    pause_ms = round((time.monotonic() - paused) * 1000)
    result = RescaleResult(
        mode="hot",
        layout_epoch=layout.epoch,
        workers=n,
        shards_moved=len(moves),
        bytes_moved=precopied + final,
        keys_moved=keys_moved + keys_paused,
        bytes_precopied=precopied,
        bytes_paused=final,
        keys_paused=keys_paused,
        rounds=rounds,
        version=new_manifest.version,
        step=step,
        retired=tuple(client.address for client in current[n:]),
        duration_ms=round((time.monotonic() - started) * 1000),
        pause_ms=pause_ms,
        pause_parts_ms=clock.parts,
    )
    return new_manifest, incarnations, result


def _changed(sources: Sequence[WorkerClient]) -> int:
    """The changed keys the sources have tracked and not shipped yet."""
    return sum(int(client.status()["tracked_keys"] or 0) for client in sources)
