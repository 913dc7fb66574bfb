"""Rescale: change the number of state workers W at a checkpoint boundary, moving the fewest shards.

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
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sparkstep.errors import ConfigError, SparkstepError
from sparkstep.failpoints import failpoint
from sparkstep.ids import LayoutEpoch, Step, Version, WorkerId
from sparkstep.runtime.errors import RescaleError, RescaleRequestError, WorkerError
from sparkstep.runtime.layout import Layout, Move, check_worker_count, plan_rescale
from sparkstep.runtime.manifest import STORES_DIR, Manifest, ManifestLease, store_name
from sparkstep.runtime.worker.client import WorkerClient

__all__ = [
    "DEFAULT_DEADLINE_S",
    "RescaleResult",
    "check_request",
    "new_store_path",
    "run_procedure",
]

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
    """What a rescale did: the new layout, what moved, and the checkpoint it committed."""

    layout_epoch: LayoutEpoch
    workers: int
    shards_moved: int
    bytes_moved: int
    keys_moved: int
    version: Version
    step: Step
    retired: tuple[str, ...]
    duration_ms: int

    def to_json(self) -> dict[str, Any]:
        """The control endpoint's answer."""
        return {
            "layout_epoch": self.layout_epoch,
            "workers": self.workers,
            "shards_moved": self.shards_moved,
            "bytes_moved": self.bytes_moved,
            "keys_moved": self.keys_moved,
            "version": self.version,
            "step": self.step,
            "retired": list(self.retired),
            "duration_ms": self.duration_ms,
        }


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


def run_procedure(
    manifest: Manifest,
    lease: ManifestLease,
    current: Sequence[WorkerClient],
    workers: Sequence[WorkerClient],
    deadline: float | None = None,
) -> tuple[Manifest, list[str], RescaleResult]:
    """Steps 2 to 11 (with step 1's worker checks) from a checkpoint ``manifest``, the manifest
    written under ``lease`` (compare-and-swap on ``manifest.version``).

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
    added = range(manifest.workers, n)
    retired = list(current[n:])
    # sources: the old layout's workers; targets: the new layout's.
    version, step = manifest.version, manifest.step
    try:
        # Step 2. Plan the layout epoch + 1.
        layout: Layout = plan_rescale(manifest.layout, n)
        moves = manifest.layout.moves_to(layout)
        pairs = _pairs(moves)
        failpoint("rescale.after_plan")
        # Step 3. Open the added stores at v.
        for w in added:
            workers[w].open(version)
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
        # Step 6. Drop the moved shards at the sources that stay.
        for w in range(min(manifest.workers, n)):
            gone = [int(m.shard) for m in moves if m.source == w]
            if gone:
                current[w].drop_shards(gone, timeout=_remaining(deadline))
        failpoint("rescale.after_drop")
        # Step 7. The new layout into every new-layout store.
        for w, client in enumerate(workers):
            client.set_layout(layout, w)
        failpoint("rescale.after_layout")
        # Step 8. Commit v + 1 everywhere in the new layout.
        for w, client in enumerate(workers):
            client.commit(step)
            if w == 0:
                failpoint("rescale.between_commits")
        failpoint("rescale.after_commits")
        # Step 9. The manifest: the commit point, never after the deadline.
        _remaining(deadline)
        new_manifest = dataclasses.replace(
            manifest,
            layout=layout,
            stores=tuple(stores),
            version=Version(version + 1),
            step=step,
            written_at=time.time(),
        )
        lease.write(new_manifest, expected=version)
        failpoint("rescale.after_manifest")
        # Step 10. Reopen the new layout at v + 1.
        incarnations = [client.open(new_manifest.version) for client in workers]
        # Step 11. Close the retired workers (no commit).
        for client in retired:
            client.close_db()
    except (SparkstepError, OSError) as exc:
        raise RescaleError(
            f"rescale from {manifest.workers} to {n} workers (layout epoch {manifest.epoch + 1}) "
            f"failed: {exc}; the state dir recovers to the layout its manifest names"
        ) from exc
    result = RescaleResult(
        layout_epoch=layout.epoch,
        workers=n,
        shards_moved=len(moves),
        bytes_moved=sum(int(a["bytes"]) for a in exported.values()),
        keys_moved=sum(int(a["keys"]) for a in exported.values()),
        version=new_manifest.version,
        step=step,
        retired=tuple(client.address for client in retired),
        duration_ms=round((time.monotonic() - started) * 1000),
    )
    return new_manifest, incarnations, result
