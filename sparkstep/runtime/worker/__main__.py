"""``python -m sparkstep.runtime.worker``: run one state worker process.

    python -m sparkstep.runtime.worker --store DIR --port P --token-file F
        [--bind 127.0.0.1] [--advertise HOST] [--create-version V]
        [--lock-timeout SECONDS] [--shards S] [--ignore-stdin]

Procedure:

1. Set the parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` via ctypes): the
   worker is killed when the thread that started it dies; if the parent is already gone, exit.
2. Read the bearer token from ``--token-file`` (first line, stripped).
3. Take the store: ``RocksDBStore(DIR, ...)``, waiting up to ``--lock-timeout`` seconds for a
   dying predecessor. With ``--create-version V`` (a worker a rescale adds):
   ``RocksDBStore.create(DIR, version=V, replace=True)``, a new empty store whose only version is
   V; a directory left there by an earlier rescale that crashed before its manifest is deleted
   first (its contents never became part of any checkpoint). The store's deployment and
   fingerprint are bound by the runtime's first ``configure``, not at start. Then one small
   pyarrow conversion (its first imports pandas: paid here, not in a call).
4. Serve Flight on ``--bind`` and ``--port`` (port 0 picks one) and print one JSON line on
   stdout, ``{"port": P, "pid": PID, "address": "HOST:PORT"}``: the worker is ready. ``address``
   is what the runtime and the Spark executors dial: ``--advertise``, or by default the bind
   address (this host's name for a wildcard bind; :func:`sparkstep.net.advertised_host`).
5. Unless ``--ignore-stdin``, a thread reads stdin and stops the server at EOF: the parent keeps
   the write end of a pipe open and the worker dies with it even when the parent is SIGKILLed
   (together with step 1, both directions of "children die with their parent").
6. When serving stops (``shutdown`` action, stdin EOF, SIGTERM/SIGINT), close the store without
   commit and exit 0 (``os._exit``: the stdin thread may still be blocked in ``read``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import threading
from pathlib import Path

import pyarrow as pa

from sparkstep.net import DEFAULT_BIND, advertised_host, host_port
from sparkstep.runtime.worker.server import WorkerFlightServer
from sparkstep.runtime.worker.service import StateWorker
from sparkstep.storage import RocksDBStore

_PR_SET_PDEATHSIG = 1


def set_parent_death_signal() -> None:
    """Ask Linux to SIGKILL this process when its parent dies; exit if it already has."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparkstep.runtime.worker")
    parser.add_argument("--store", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token-file", required=True)
    parser.add_argument("--bind", default=DEFAULT_BIND)
    parser.add_argument("--advertise")
    parser.add_argument("--create-version", type=int)
    parser.add_argument("--lock-timeout", type=float, default=30.0)
    parser.add_argument("--shards", type=int, default=256)
    parser.add_argument("--ignore-stdin", action="store_true")
    args = parser.parse_args(argv)

    # Step 1. Die with the parent.
    set_parent_death_signal()
    # Step 2. The token.
    token = Path(args.token_file).read_text().strip()
    # Step 3. The store (bounded wait for a dying predecessor's lock).
    if args.create_version is not None:
        store = RocksDBStore.create(
            args.store,
            version=args.create_version,
            lock_timeout=args.lock_timeout,
            replace=True,
        )
    else:
        store = RocksDBStore(args.store, lock_timeout=args.lock_timeout)
    worker = StateWorker(store, shards=args.shards)
    # pyarrow's first conversion of Python values imports pandas when it is installed (0.2 to
    # 0.3 s): pay it before the worker is ready, not in its first call (a hot rescale makes
    # that call to an added worker during its pause).
    pa.array([0], type=pa.int64())
    # Step 4. Serve, and say so.
    server = WorkerFlightServer(worker, token, host=args.bind, port=args.port)
    address = host_port(advertised_host(args.bind, args.advertise), server.port)
    sys.stdout.write(json.dumps({"port": server.port, "pid": os.getpid(), "address": address}))
    sys.stdout.write("\n")
    sys.stdout.flush()
    # Step 5. Exit at EOF of stdin; stop on SIGTERM/SIGINT.
    if not args.ignore_stdin:

        def watch_stdin() -> None:
            while sys.stdin.buffer.read(4096):
                pass
            server.request_shutdown()

        threading.Thread(target=watch_stdin, name="stdin-eof", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: server.request_shutdown())
    signal.signal(signal.SIGINT, lambda *_: server.request_shutdown())
    # Step 6. Serve until stopped, then close without commit.
    server.serve()
    worker.close()
    # The stdin thread is still blocked in read(); a normal interpreter exit would abort on
    # its buffered-reader lock, so leave without finalisation once the store is closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
