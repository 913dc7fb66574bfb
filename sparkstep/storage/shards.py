"""Shard I/O of the RocksDB store: a shard set is a set of key ranges, moved in bulk.

By the key rule of :mod:`sparkstep.storage.keys`, the keys of a set of shards form a few
contiguous ranges of every table (:func:`~sparkstep.storage.keys.shard_ranges`). So moving shards
between stores never touches single keys one by one on the receiving side:

- export: iterate each range of each table and write the pairs, in key order, into one new SST
  file per table (``export-<token>-<nnnn>.sst``, ``<token>`` unique per export);
- import: ingest those SST files into the tables' column families (one ingestion per table);
- drop: one range deletion per range and table, in one atomic write batch;
- export of entries (a hot rescale's catch-up): given keys with their current value or None,
  one SST file per table of puts and deletions, which ingested after an export of the same
  shards brings the copy up to date (a later ingestion shadows an earlier one key by key).

Only the ``t.`` column families (tables) are walked, so internal metadata never moves.
These functions are the bodies of :meth:`RocksDBDatabase.export_shards`, ``export_keys``,
``import_files`` and ``drop_shards`` (:mod:`.database`), which check the database is open first.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import rocksdict

from sparkstep.ids import ShardId
from sparkstep.storage.base import ExportedShards, WriteBatch
from sparkstep.storage.keys import shard_ranges
from sparkstep.storage.options import RocksDBOptions
from sparkstep.storage.translate import raise_translated, translated

__all__ = [
    "drop_shards",
    "export_entries",
    "export_shards",
    "export_sorted",
    "import_files",
    "iterate_range",
]


def iterate_range(
    view: rocksdict.Rdict, table: str, start: bytes | None, end: bytes | None
) -> Iterator[tuple[bytes, bytes]]:
    """The pairs of ``table`` (its column family ``view``) with ``start <= key < end``."""
    read_options = rocksdict.ReadOptions()
    if end is not None:
        read_options.set_iterate_upper_bound(end)
    try:
        if start is None:
            yield from view.items(read_opt=read_options)
        else:
            yield from view.items(from_key=start, read_opt=read_options)
    except Exception as exc:
        raise_translated(exc, f"iterating table {table!r}")


def export_shards(
    tables: Mapping[str, rocksdict.Rdict],
    shards: Iterable[int],
    directory: str | Path,
    options: RocksDBOptions,
) -> ExportedShards:
    """Write every key of ``shards`` of every table (name -> column family) into new SST files.

    A table with no key in ``shards`` gets no file. The reads need no lock against concurrent
    writers: each range is read by one RocksDB iterator, a consistent view of the instant it
    was made (a hot rescale exports while the pipeline runs, see ``runtime/rescale.py``).
    """
    chosen = tuple(ShardId(s) for s in sorted(set(shards)))
    ranges = shard_ranges(chosen)

    def pairs(table: str) -> Iterator[tuple[bytes, bytes | None]]:
        for begin, end in ranges:
            yield from iterate_range(tables[table], table, begin, end)

    files, keys, size = _write_files(sorted(tables), pairs, directory, options)
    return ExportedShards(shards=chosen, files=files, keys=keys, bytes=size)


def export_entries(
    entries: Mapping[str, Mapping[bytes, bytes | None]],
    directory: str | Path,
    options: RocksDBOptions,
) -> ExportedShards:
    """Write ``entries`` (table -> {key: value, or None for a deletion}) into new SST files,
    one per table with entries; the keys of each table in sorted order. Ingested after a file
    of :func:`export_shards`, the deletions shadow its keys."""

    def pairs(table: str) -> Iterator[tuple[bytes, bytes | None]]:
        changes = entries[table]
        for key in sorted(changes):
            yield key, changes[key]

    files, keys, size = _write_files(sorted(entries), pairs, directory, options)
    return ExportedShards(shards=(), files=files, keys=keys, bytes=size)


def export_sorted(
    table: str,
    keys: Sequence[bytes],
    values: Sequence[bytes | None],
    directory: str | Path,
    options: RocksDBOptions,
) -> ExportedShards:
    """Write ``keys -> values`` (keys ascending bytewise, each once; ``None`` a deletion) of
    ``table`` into one new SST file (none for no keys). Keys out of order are refused by
    RocksDB's writer (a :class:`~sparkstep.storage.errors.StorageError`)."""
    files, count, size = _write_files(
        [table], lambda _: zip(keys, values, strict=True), directory, options
    )
    return ExportedShards(shards=(), files=files, keys=count, bytes=size)


def _write_files(
    tables: Sequence[str],
    pairs: Callable[[str], Iterable[tuple[bytes, bytes | None]]],
    directory: str | Path,
    options: RocksDBOptions,
) -> tuple[dict[str, tuple[str, ...]], int, int]:
    """One SST file per table of ``tables`` that ``pairs(table)`` (keys ascending; a None value
    is a deletion) gives anything for: ``export-<token>-<nnnn>.sst``, ``<token>`` unique per
    call. Returns (table -> files, entries, bytes)."""
    target = Path(directory)
    token = uuid.uuid4().hex[:12]
    files: dict[str, tuple[str, ...]] = {}
    keys = size = 0
    with translated(f"exporting to {target}"):
        target.mkdir(parents=True, exist_ok=True)
        for index, table in enumerate(tables):
            path = target / f"export-{token}-{index:04d}.sst"
            writer: rocksdict.SstFileWriter | None = None
            for key, value in pairs(table):
                if writer is None:
                    writer = rocksdict.SstFileWriter(options=options.to_options())
                    writer.open(str(path))
                if value is None:
                    del writer[key]
                else:
                    writer[key] = value
                keys += 1
            if writer is not None:
                writer.finish()
                size += path.stat().st_size
                files[table] = (str(path),)
    return files, keys, size


def import_files(
    table_view: Callable[[str], rocksdict.Rdict],
    files: Mapping[str, Sequence[str | Path]],
    *,
    move: bool,
) -> None:
    """Ingest SST files (table -> files) into each table's column family, one table at a time.

    ``table_view(table)`` is the table's column family, created if missing.
    """
    ingest = rocksdict.IngestExternalFileOptions()
    ingest.set_move_files(move)
    for table in sorted(files):
        paths = [str(p) for p in files[table]]
        if not paths:
            continue
        view = table_view(table)
        with translated(f"importing {len(paths)} file(s) into table {table!r}"):
            view.ingest_external_file(paths, ingest)


def drop_shards(
    new_batch: Callable[[], WriteBatch], tables: Iterable[str], shards: Iterable[int]
) -> WriteBatch:
    """A batch (from ``new_batch``) that deletes every key of ``shards`` from ``tables``."""
    ranges = shard_ranges(shards)
    batch = new_batch()
    for table in sorted(tables):
        for begin, end in ranges:
            batch.delete_range(table, begin, end)
    return batch
