"""Child processes for the storage tests (run as ``python -m tests.storage.store_child``).

Modes:

- ``hold PATH``: open the store at PATH, print ``ready``, keep it until stdin reaches EOF.
- ``commit-loop PATH``: forever: print ``opening n`` and open the store at ``n``, its newest
  version (every third round its older one, a rollback), write the changes of version ``n + 1``
  (:func:`changes`, a deterministic function of the version), commit, print ``committed n+1``.
  The parent kills it (SIGKILL or an armed failpoint) and checks that every version holds
  exactly :func:`expected_state` of its number.

:func:`changes` and :func:`expected_state` are shared with the parent, so "what was committed to
version n" is known without the child reporting it.
"""

from __future__ import annotations

import itertools
import sys

from sparkstep.storage import RocksDBStore, shard_key

DEPLOYMENT = "crash-deployment"
FINGERPRINT = "crash-fingerprint"
TABLES = ("alpha", "beta", "gamma")

State = dict[tuple[str, bytes], bytes]
Snapshot = tuple[int, bytes | None, State]  # step, layout, table contents


def _key(version: int, i: int) -> bytes:
    return shard_key((version * 7 + i) % 16, f"k{version}-{i}".encode())


def changes(version: int) -> tuple[list[tuple[str, str, bytes, bytes | None]], int, bytes]:
    """The writes that turn version ``version - 1`` into ``version`` (for ``version >= 1``).

    Returns ``(ops, step, layout)`` where each op is ``("put", table, key, value)`` or
    ``("del", table, key, None)``; ops are applied half as single puts, half as one batch.
    """
    ops: list[tuple[str, str, bytes, bytes | None]] = []
    for i in range(40):
        table = TABLES[(version + i) % len(TABLES)]
        ops.append(("put", table, _key(version, i), f"v{version}-{i}".encode() * 3))
    if version >= 3:
        # Delete part of what version - 2 wrote, in the tables it wrote them to.
        old = version - 2
        for i in range(0, 40, 3):
            ops.append(("del", TABLES[(old + i) % len(TABLES)], _key(old, i), None))
    # Overwrite a key of the previous version.
    if version >= 2:
        prev = version - 1
        ops.append(("put", TABLES[(prev + 1) % 3], _key(prev, 1), f"over{version}".encode()))
    return ops, version * 10, f'{{"epoch": {version}}}'.encode()


_EXPECTED: list[Snapshot] = [(0, None, {})]


def expected_state(version: int) -> Snapshot:
    """What version ``version`` of the crash-test store must hold exactly."""
    while len(_EXPECTED) <= version:
        _, _, previous = _EXPECTED[-1]
        state = dict(previous)
        ops, step, layout = changes(len(_EXPECTED))
        for op, table, key, value in ops:
            if op == "put":
                assert value is not None
                state[(table, key)] = value
            else:
                state.pop((table, key), None)
        _EXPECTED.append((step, layout, state))
    return _EXPECTED[version]


def _commit_loop(path: str) -> None:
    """Open the newest version and commit the next, forever; every third round rolls back
    instead (opens the older of two versions, discarding the newer, as recovery does), so that
    both ways of ``open`` are crossed. Prints ``opening v`` before each open and
    ``committed v`` after each commit."""
    store = RocksDBStore(path, deployment=DEPLOYMENT, fingerprint=FINGERPRINT, lock_timeout=30)
    for round_ in itertools.count():
        versions = store.versions()
        base = versions[0] if round_ % 3 == 2 else versions[-1]
        print(f"opening {base}", flush=True)
        db = store.open(base)
        version = base + 1
        ops, step, layout = changes(version)
        half = len(ops) // 2
        for op, table, key, value in ops[:half]:
            if op == "put":
                assert value is not None
                db.put(table, key, value)
            else:
                db.delete(table, key)
        batch = db.batch()
        for op, table, key, value in ops[half:]:
            if op == "put":
                assert value is not None
                batch.put(table, key, value)
            else:
                batch.delete(table, key)
        db.write(batch)
        db.set_step(step)
        db.set_layout(layout)
        db.commit()
        print(f"committed {version}", flush=True)


def _hold(path: str) -> None:
    store = RocksDBStore(path)
    print("ready", flush=True)
    sys.stdin.read()
    store.close()


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "hold":
        _hold(path)
    elif mode == "commit-loop":
        _commit_loop(path)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
