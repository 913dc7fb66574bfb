"""The state worker's Arrow Flight server (loopback, bearer token on every call).

Wire format (what :class:`~sparkstep.runtime.worker.client.WorkerClient` speaks; see the
package docstring for the summary):

- Every call carries the header ``authorization: Bearer <token>``; :class:`_AuthMiddlewareFactory`
  checks it (constant-time compare) before any handler runs and refuses the call with
  ``FlightUnauthenticatedError`` otherwise.
- Control calls are Flight actions: ``Action(type=<name>, body=<JSON object>)`` answered by one
  ``Result`` whose body is a JSON object. Names: ``versions``, ``open`` ``{"version"}``,
  ``configure`` ``{"shards", "deployment", "specs": [spec, ...]}`` (each spec a JSON object of
  data, :func:`~sparkstep.runtime.operators.spec_to_wire`), ``commit`` ``{"step"}``,
  ``export`` ``{"shards", "name", "live"}`` (answer ``{"shards", "files": {table: [{"file",
  "sha256", "bytes"}]}, "keys", "bytes"}``; ``live``: while applies go on, the shards must be
  tracked), ``track`` ``{"shards"}`` (record the keys of those shards the applies write, until
  the store is reopened), ``export_changes`` ``{"shards", "name"}`` (the tracked keys with
  their values now or as deletions; answer as ``export``), ``import`` ``{"source", "name",
  "files", "stage"}`` (``files`` as ``export`` answered; the receiver fetches them from
  ``source``, below, and ingests them, or with ``stage`` keeps them fetched until ``ingest``
  ``{"name", "files"}``; fetched files are deleted at every ``open``), ``drop``
  ``{"shards"}``, ``set_layout`` ``{"layout": {"epoch", "workers", "owners"}, "worker"}``,
  ``close`` (the open database, without commit), ``inspect`` (keys per shard), ``status``,
  ``shutdown``. Every action body may carry ``"generation"``: the fencing token of the
  runtime that sends it. The store-changing ones (:data:`STORE_CHANGING_ACTIONS`) run only if
  the store admits it (``Store.admit``: not below the highest admitted; null only for a store
  never fenced), checked and run under one lock so that no newer generation's call comes
  between; otherwise ``StoreFencedError``. ``apply`` needs no generation: it carries the
  incarnation a fenced ``open`` issued.
- ``apply`` is a DoExchange whose descriptor is ``FlightDescriptor.for_command(JSON header)``
  with ``{"incarnation", "step", "operator", "input", "division_digest", "step_time_ms",
  "layout_epoch"}`` (``layout_epoch`` null or absent: the store must hold no layout). The
  client streams the rows (Arrow schema then record batches) and closes its side; the server
  streams back the delta (schema then batches) and finally one metadata-only message whose
  ``app_metadata`` is JSON ``{"state_digest", "replayed"}``.
- Shard files move between workers by ``DoGet``: the receiver of an ``import`` calls the
  sender at ``source`` (its advertised address, same bearer token) with
  ``Ticket(JSON {"export": name, "file": file})``; the sender streams that file of
  ``<store>/exports/<name>/`` as record batches of one non-null ``binary`` column ``chunk``
  (at most :data:`CHUNK_BYTES` each). The receiver writes them under its own
  ``<store>/imports/<name>/``, checks each file's size and sha256 against the export's answer,
  and restarts the whole transfer on a broken stream (the sender unreachable, or its stream
  ending in an error that is not a sparkstep refusal) or a mismatch, at most
  :data:`FETCH_ATTEMPTS` times, then raises ``ShardTransferError``. No path crosses workers.
- Errors: a sparkstep error is sent as ``FlightServerError("[sparkstep:<ClassName>] message")``;
  the client raises the same class again (one translation point on each side).
"""

from __future__ import annotations

import hmac
import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.flight as flight

from sparkstep.errors import SparkstepError
from sparkstep.failpoints import failpoint
from sparkstep.net import host_port
from sparkstep.runtime.errors import ShardTransferError, WorkerError, WorkerUnavailableError
from sparkstep.runtime.layout import Layout
from sparkstep.runtime.operators import spec_from_wire
from sparkstep.runtime.worker.client import WorkerClient
from sparkstep.runtime.worker.service import StateWorker, file_sha256, path_component

__all__ = [
    "CHUNK_BYTES",
    "ERROR_TAG",
    "FETCH_ATTEMPTS",
    "STORE_CHANGING_ACTIONS",
    "WorkerFlightServer",
    "aligned",
]

ERROR_TAG = "[sparkstep:"
CHUNK_BYTES = 1 << 20
"""The size of one chunk of an exported file sent by DoGet."""
FETCH_ATTEMPTS = 3
"""How many times a receiving worker tries a whole export transfer before it gives up."""
STORE_CHANGING_ACTIONS = frozenset(
    {
        "open",
        "configure",
        "commit",
        "track",
        "export",
        "export_changes",
        "import",
        "ingest",
        "drop",
        "set_layout",
        "close",
    }
)
"""The actions that change the store (or its open state): fenced by the caller's generation."""
_TRANSIENT = (ShardTransferError, WorkerUnavailableError)
"""The transfer errors a whole new transfer may not meet again (besides a plain WorkerError)."""
_CHUNK_SCHEMA = pa.schema([pa.field("chunk", pa.binary(), nullable=False)])


class _AuthMiddleware(flight.ServerMiddleware):  # type: ignore[misc]
    pass


class _AuthMiddlewareFactory(flight.ServerMiddlewareFactory):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        super().__init__()
        self._expected = f"Bearer {token}".encode()

    def start_call(self, info: Any, headers: dict[str, list[Any]]) -> _AuthMiddleware:
        values = headers.get("authorization", [])
        given = values[0] if values else ""
        given_b = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given_b, self._expected):
            raise flight.FlightUnauthenticatedError(
                "sparkstep worker: missing or wrong bearer token"
            )
        return _AuthMiddleware()


def aligned(table: pa.Table) -> pa.Table:
    """``table`` with every buffer 8-byte aligned (copied only if one is not).

    Batches read from a Flight stream can sit at unaligned offsets of the gRPC message; Arrow's
    Acero engine (behind ``Table.group_by`` and ``Table.join``) warns about such buffers and
    may copy them anyway, so realign once, on arrival.
    """
    for column in table.columns:
        for chunk in column.chunks:
            if any(buf is not None and buf.address % 8 for buf in chunk.buffers()):
                return pa.concat_tables([table, table.schema.empty_table()]).combine_chunks()
    return table


def _chunks(path: Path) -> Iterator[pa.RecordBatch]:
    with path.open("rb") as f:
        while data := f.read(CHUNK_BYTES):
            yield pa.record_batch([pa.array([data], pa.binary())], schema=_CHUNK_SCHEMA)
            failpoint("worker.get.after_chunk")


def _translated(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except SparkstepError as exc:
        raise flight.FlightServerError(f"{ERROR_TAG}{type(exc).__name__}] {exc}") from exc


class WorkerFlightServer(flight.FlightServerBase):  # type: ignore[misc]
    """Serves one :class:`StateWorker` on ``host:port`` (0 picks a free port; see ``port``)."""

    def __init__(self, worker: StateWorker, token: str, host: str = "127.0.0.1", port: int = 0):
        super().__init__(
            location=f"grpc+tcp://{host_port(host, port)}",
            middleware={"auth": _AuthMiddlewareFactory(token)},
        )
        self.worker = worker
        self._token = token
        self._shutdown_started = threading.Event()

    def list_actions(self, context: Any) -> list[tuple[str, str]]:
        return [
            ("close", "close the open database without commit"),
            ("commit", "set_step(step) and commit"),
            ("configure", "set the operator specs and S"),
            ("drop", "delete shards"),
            ("track", "record the keys of some shards the applies write"),
            ("export", "export shards to SST files (live: while applies go on)"),
            ("export_changes", "export the tracked keys' current values and deletions"),
            ("import", "fetch a sender's export over Flight, verify, ingest (or stage)"),
            ("ingest", "ingest an export fetched earlier with stage"),
            ("inspect", "keys per shard of every state table"),
            ("open", "open version v, returns a new incarnation"),
            ("set_layout", "write the layout and this worker's index into the open state"),
            ("shutdown", "stop serving and exit"),
            ("status", "worker status"),
            ("versions", "the store's versions"),
        ]

    def do_action(self, context: Any, action: flight.Action) -> Iterator[flight.Result]:
        raw = action.body.to_pybytes() if action.body is not None else b""
        body: dict[str, Any] = json.loads(raw) if raw else {}
        answer = _translated(lambda: self._dispatch(action.type, body))
        return iter([flight.Result(json.dumps(answer).encode())])

    def _dispatch(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        if name not in STORE_CHANGING_ACTIONS:
            return self._run(name, body)
        generation = body.get("generation")
        with self.worker.fenced(None if generation is None else int(generation)):
            return self._run(name, body)

    def _run(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        w = self.worker
        if name == "versions":
            v = w.versions()
            return {"start": v.start, "stop": v.stop}
        if name == "open":
            return {"incarnation": w.open(int(body["version"]))}
        if name == "configure":
            specs = [spec_from_wire(doc) for doc in body["specs"]]
            deployment = body.get("deployment")
            return {
                "fingerprint": w.configure(
                    specs, int(body["shards"]), None if deployment is None else str(deployment)
                )
            }
        if name == "commit":
            w.commit(int(body["step"]))
            return {}
        if name == "track":
            w.track([int(s) for s in body["shards"]])
            return {}
        if name == "export":
            shards = [int(s) for s in body["shards"]]
            return w.export_shards(shards, str(body["name"]), live=bool(body.get("live")))
        if name == "export_changes":
            return w.export_changes([int(s) for s in body["shards"]], str(body["name"]))
        if name in ("import", "ingest"):
            if name == "import":
                self._fetch(str(body["source"]), str(body["name"]), body["files"])
                if body.get("stage"):
                    return {}
            names = {t: [str(f["file"]) for f in fs] for t, fs in body["files"].items()}
            w.import_files(str(body["name"]), names)
            return {}
        if name == "drop":
            w.drop_shards([int(s) for s in body["shards"]])
            return {}
        if name == "set_layout":
            w.set_layout(Layout.from_json(json.dumps(body["layout"])), int(body["worker"]))
            return {}
        if name == "close":
            w.close_db()
            return {}
        if name == "inspect":
            return w.inspect()
        if name == "status":
            return w.status()
        if name == "shutdown":
            self.request_shutdown()
            return {}
        raise flight.FlightServerError(f"unknown action {name!r}")

    def _fetch(self, source: str, name: str, files: dict[str, list[dict[str, Any]]]) -> None:
        """Fetch every file of export ``name`` from the worker at ``source`` into
        ``<store>/imports/<name>/`` and check its sha256 and size; a broken stream or a
        mismatch restarts the whole transfer, at most :data:`FETCH_ATTEMPTS` times."""
        wanted = [f for fs in files.values() for f in fs]
        names = [str(f["file"]) for f in wanted]
        _translated(lambda: [path_component(n, "export file") for n in names])
        sender = WorkerClient(source, self._token)
        problem = ""
        try:
            for _ in range(FETCH_ATTEMPTS):
                directory = self.worker.import_dir(name)
                try:
                    for f in wanted:
                        path = directory / str(f["file"])
                        sender.fetch_file(name, str(f["file"]), path)
                        size, digest = path.stat().st_size, file_sha256(path)
                        if (digest, size) != (str(f["sha256"]), int(f["bytes"])):
                            raise ShardTransferError(
                                f"{f['file']}: got {size} bytes with sha256 {digest}, the "
                                f"export reported {f['bytes']} bytes with sha256 {f['sha256']}"
                            )
                    return
                except WorkerError as exc:
                    # A mismatch, the sender unreachable, or its stream broken (a plain
                    # WorkerError) is tried again; a refusal (a path, the token) would recur.
                    if not isinstance(exc, _TRANSIENT) and type(exc) is not WorkerError:
                        raise
                    problem = str(exc)
        finally:
            sender.close()
        raise ShardTransferError(
            f"export {name!r} of worker {source} did not arrive intact in {FETCH_ATTEMPTS} "
            f"attempts ({problem}); the rescale fails and the state dir recovers to its manifest"
        )

    def do_get(self, context: Any, ticket: flight.Ticket) -> flight.GeneratorStream:
        request = json.loads(ticket.ticket)
        path = _translated(
            lambda: self.worker.export_file(str(request["export"]), str(request["file"]))
        )
        return flight.GeneratorStream(_CHUNK_SCHEMA, _chunks(path))

    def request_shutdown(self) -> None:
        """Stop serving, from any thread (a handler too: the shutdown runs on its own thread)."""
        if self._shutdown_started.is_set():
            return
        self._shutdown_started.set()
        threading.Thread(target=self.shutdown, name="worker-shutdown", daemon=True).start()

    def do_exchange(
        self,
        context: Any,
        descriptor: flight.FlightDescriptor,
        reader: flight.MetadataRecordBatchReader,
        writer: flight.MetadataRecordBatchWriter,
    ) -> None:
        header = json.loads(descriptor.command)
        rows = aligned(reader.read_all())
        epoch = header.get("layout_epoch")
        result = _translated(
            lambda: self.worker.apply(
                str(header["incarnation"]),
                int(header["step"]),
                str(header["operator"]),
                str(header["division_digest"]),
                rows,
                input_index=int(header.get("input", 0)),
                step_time_ms=int(header.get("step_time_ms", 0)),
                layout_epoch=None if epoch is None else int(epoch),
            )
        )
        writer.begin(result.delta.schema)
        for batch in result.delta.to_batches():
            writer.write_batch(batch)
        meta = {"state_digest": result.state_digest, "replayed": result.replayed}
        writer.write_metadata(pa.py_buffer(json.dumps(meta).encode()))
