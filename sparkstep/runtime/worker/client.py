"""``WorkerClient``: the one client of a state worker, for the runtime and for Spark tasks.

Usage from the runtime (control) and from a stateful-stage task (apply)::

    client = WorkerClient("127.0.0.1:5123", token)
    client.configure(specs, shards=256)          # after every start of the worker process
    inc = client.open(client.versions()[-1])     # a new incarnation
    result = client.apply(inc, step, "sums", division_digest, rows)   # rows: pa.Table
    result.delta, result.state_digest, result.replayed
    client.commit(step + 1)                      # set_step + commit; reopen before next apply

``rows`` must carry ``__weight`` and ``__shard`` (``__worker`` and other ``__`` columns are
ignored); for a join pass ``input=0`` (left) or ``1`` (right). A WorkerClient pickles (address,
token and timeout only; the connection is reopened lazily), so a Spark task can receive one in
its closure. Errors the worker raises come back as the same classes
(:class:`~sparkstep.runtime.errors.FencedError`, ...; storage errors as the storage classes);
a worker that cannot be reached raises :class:`WorkerUnavailableError`, a wrong token
:class:`WorkerAuthError`. This is the one place Flight errors are translated on the client side.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import pyarrow as pa
import pyarrow.flight as flight

import sparkstep.runtime.errors as runtime_errors
import sparkstep.storage.errors as storage_errors
from sparkstep.runtime.errors import WorkerAuthError, WorkerError, WorkerUnavailableError
from sparkstep.runtime.layout import Layout
from sparkstep.runtime.operators import OperatorSpec, spec_to_wire
from sparkstep.runtime.worker.service import ApplyResult

__all__ = [
    "WorkerClient",
]

_T = TypeVar("_T")
_TAGGED = re.compile(r"\[sparkstep:(\w+)\] (.*?)(?:\. Detail: .*)?$", re.S)


def _raise_translated(exc: flight.FlightError, address: str) -> NoReturn:
    if isinstance(exc, flight.FlightUnauthenticatedError):
        raise WorkerAuthError(f"worker {address} refused the bearer token: {exc}") from exc
    if isinstance(exc, flight.FlightUnavailableError | flight.FlightTimedOutError):
        raise WorkerUnavailableError(f"worker {address} cannot be reached: {exc}") from exc
    match = _TAGGED.search(str(exc))
    if match:
        name, message = match.group(1), match.group(2)
        for module in (runtime_errors, storage_errors):
            cls = getattr(module, name, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                try:
                    err = cls(message)
                except TypeError:
                    break
                raise err from exc
        raise WorkerError(f"worker {address}: {name}: {message}") from exc
    raise WorkerError(f"worker {address} failed: {exc}") from exc


class WorkerClient:
    """Control and apply calls to one state worker at ``address`` (``host:port``).

    ``generation``: the fencing token of the runtime that owns the client (its manifest lease,
    :class:`~sparkstep.runtime.manifest.ManifestLease`), sent with every control call; the
    worker refuses a store-changing call of an older generation (``StoreFencedError``). None
    only where no runtime owns the store (standalone use, tests of the worker).
    """

    def __init__(
        self, address: str, token: str, timeout: float = 60.0, generation: int | None = None
    ) -> None:
        self.address = address
        self.token = token
        self.timeout = timeout
        self.generation = generation
        self._client: flight.FlightClient | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "token": self.token,
            "timeout": self.timeout,
            "generation": self.generation,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["address"], state["token"], state["timeout"], state["generation"]
        )

    def _options(self, timeout: float | None = None) -> flight.FlightCallOptions:
        return flight.FlightCallOptions(
            timeout=self.timeout if timeout is None else timeout,
            headers=[(b"authorization", f"Bearer {self.token}".encode())],
        )

    def _flight(self) -> flight.FlightClient:
        if self._client is None:
            self._client = flight.FlightClient(f"grpc+tcp://{self.address}")
        return self._client

    def _call(self, fn: Callable[[], _T]) -> _T:
        try:
            return fn()
        except flight.FlightError as exc:
            _raise_translated(exc, self.address)

    def _action(
        self, name: str, body: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        payload = json.dumps({**(body or {}), "generation": self.generation}).encode()

        def run() -> dict[str, Any]:
            results = list(
                self._flight().do_action(flight.Action(name, payload), self._options(timeout))
            )
            answer: dict[str, Any] = json.loads(results[0].body.to_pybytes()) if results else {}
            return answer

        return self._call(run)

    # -- control ------------------------------------------------------------------------------

    def versions(self) -> range:
        """The worker store's versions (length 1 or 2)."""
        answer = self._action("versions")
        return range(int(answer["start"]), int(answer["stop"]))

    def open(self, version: int) -> str:
        """Open the store at ``version``; returns the new incarnation every apply must carry."""
        return str(self._action("open", {"version": version})["incarnation"])

    def configure(
        self, specs: Sequence[OperatorSpec], shards: int, deployment: str | None = None
    ) -> str:
        """Tell the worker its operators and ``S`` (after every start of the worker process).

        The specs travel as data (:func:`~sparkstep.runtime.operators.spec_to_wire`). Returns
        their fingerprint; raises :class:`WrongOperatorsError` if the store keeps another one
        (storage's ``WrongDeploymentError`` if it belongs to another ``deployment``). Given a
        ``deployment``, a store that keeps none records both (see ``StateWorker.configure``).
        """
        body = {
            "specs": [spec_to_wire(spec) for spec in specs],
            "shards": shards,
            "deployment": deployment,
        }
        return str(self._action("configure", body)["fingerprint"])

    def commit(self, step: int) -> None:
        """``set_step(step)`` and commit; the worker then has no open store until :meth:`open`."""
        self._action("commit", {"step": step})

    def track(self, shards: Sequence[int]) -> None:
        """Record the keys of ``shards`` the applies write from now until the store is
        reopened (empty: stop); what :meth:`export_changes` ships."""
        self._action("track", {"shards": list(shards)})

    def export_changes(
        self, shards: Sequence[int], name: str, *, timeout: float | None = None
    ) -> dict[str, Any]:
        """Export the tracked keys of ``shards`` written since :meth:`track` (or the last
        call for them), as puts of their values now and deletions; answer as
        :meth:`export_shards`."""
        body = {"shards": list(shards), "name": name}
        return self._action("export_changes", body, timeout=timeout)

    def ingest(
        self,
        name: str,
        files: Mapping[str, Sequence[Mapping[str, Any]]],
        *,
        timeout: float | None = None,
    ) -> None:
        """Ingest export ``name``, fetched earlier by :meth:`import_files` with ``stage``."""
        body = {"name": name, "files": {t: [dict(f) for f in fs] for t, fs in files.items()}}
        self._action("ingest", body, timeout=timeout)

    def export_shards(
        self,
        shards: Sequence[int],
        name: str,
        *,
        live: bool = False,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """Export ``shards`` into SST files in the worker's export directory ``name``.

        The worker chooses the place (``<store>/exports/<name>/``; ``name`` is one path
        component). Answer: ``{"shards", "files": {table: [{"file", "sha256", "bytes"}]},
        "keys", "bytes"}``; pass ``name`` and ``files`` with this worker's address to
        :meth:`import_files` of the receiving worker. ``timeout`` overrides the client's
        (export, import and drop take time proportional to the shards' state). ``live``:
        while the applies go on (the shards must be tracked, :meth:`track`).
        """
        body = {"shards": list(shards), "name": name, "live": live}
        return self._action("export", body, timeout=timeout)

    def import_files(
        self,
        source: str,
        name: str,
        files: Mapping[str, Sequence[Mapping[str, Any]]],
        *,
        stage: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Have this worker fetch export ``name`` (``files`` as :meth:`export_shards` answered)
        from the worker at ``source`` (its advertised ``host:port``) over Flight, verify each
        file's sha256, and ingest them. A transfer that stays broken or corrupt after
        :data:`~sparkstep.runtime.worker.server.FETCH_ATTEMPTS` whole attempts raises
        :class:`~sparkstep.runtime.errors.ShardTransferError`. ``stage``: fetch and verify
        only; :meth:`ingest` ingests later."""
        body = {
            "source": source,
            "name": name,
            "files": {t: [dict(f) for f in fs] for t, fs in files.items()},
            "stage": stage,
        }
        self._action("import", body, timeout=timeout)

    def fetch_file(self, name: str, file: str, into: Path) -> None:
        """Stream ``<store>/exports/<name>/<file>`` of this worker into the local file ``into``
        (DoGet, ticket JSON ``{"export", "file"}``, chunks as one ``binary`` column)."""
        ticket = flight.Ticket(json.dumps({"export": name, "file": file}).encode())

        def run() -> None:
            reader = self._flight().do_get(ticket, self._options())
            with into.open("wb") as out:
                for chunk in reader:
                    for piece in chunk.data.column(0):
                        out.write(piece.as_buffer())

        self._call(run)

    def drop_shards(self, shards: Sequence[int], *, timeout: float | None = None) -> None:
        """Delete every key of ``shards`` from the worker's working state."""
        self._action("drop", {"shards": list(shards)}, timeout=timeout)

    def set_layout(self, layout: Layout, worker: int) -> None:
        """Write ``layout`` into the open state, this store being its worker ``worker``."""
        self._action("set_layout", {"layout": json.loads(layout.to_json()), "worker": worker})

    def close_db(self) -> None:
        """Close the open database without commit (the store keeps what ``open`` left)."""
        self._action("close")

    def inspect(self) -> dict[str, Any]:
        """``{"layout_epoch", "owned", "tables": {table: {shard (str): keys}}}`` of the open
        state (scans it: tests and benchmarks)."""
        return self._action("inspect")

    def status(self, timeout: float | None = None) -> dict[str, Any]:
        """``{"pid", "store", "versions", "open_version", "incarnation", "step", ...}``."""
        return self._action("status", timeout=timeout)

    def shutdown(self) -> None:
        """Ask the worker to stop serving and exit (the open store is closed without commit)."""
        self._action("shutdown")

    # -- apply --------------------------------------------------------------------------------

    def apply(
        self,
        incarnation: str,
        step: int,
        operator: str,
        division_digest: str,
        rows: pa.Table,
        *,
        input: int = 0,
        step_time_ms: int = 0,
        layout_epoch: int | None = None,
    ) -> ApplyResult:
        """Apply ``rows`` for ``(operator, step)``; see :mod:`sparkstep.runtime.worker.service`.

        ``layout_epoch``: the step's layout epoch (the runtime always sends it; None only for a
        store that holds no layout).
        """
        header = {
            "layout_epoch": layout_epoch,
            "incarnation": incarnation,
            "step": step,
            "operator": operator,
            "input": input,
            "division_digest": division_digest,
            "step_time_ms": step_time_ms,
        }
        descriptor = flight.FlightDescriptor.for_command(json.dumps(header).encode())

        def run() -> ApplyResult:
            writer, reader = self._flight().do_exchange(descriptor, self._options())
            with writer:
                writer.begin(rows.schema)
                for batch in rows.to_batches():
                    writer.write_batch(batch)
                writer.done_writing()
                batches: list[pa.RecordBatch] = []
                meta: dict[str, Any] | None = None
                schema: pa.Schema | None = None
                while True:
                    try:
                        chunk = reader.read_chunk()
                    except StopIteration:
                        break
                    if schema is None:
                        schema = reader.schema
                    if chunk.data is not None:
                        batches.append(chunk.data)
                    if chunk.app_metadata is not None:
                        meta = json.loads(chunk.app_metadata.to_pybytes())
            if meta is None or schema is None:
                raise WorkerError(f"worker {self.address}: apply answered without a state digest")
            delta = pa.Table.from_batches(batches, schema=schema)
            return ApplyResult(delta, str(meta["state_digest"]), bool(meta["replayed"]))

        return self._call(run)

    def close(self) -> None:
        """Close the connection (the client can be used again: it reconnects)."""
        if self._client is not None:
            self._client.close()
            self._client = None
