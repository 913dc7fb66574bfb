"""Shard I/O of the RocksDB store: a shard set is a set of key ranges, moved in bulk.

By the key rule of :mod:`sparkstep.storage.keys`, the keys of a set of shards form a few
contiguous ranges of every table (:func:`~sparkstep.storage.keys.shard_ranges`). So moving shards
between stores never touches single keys one by one on the receiving side:

- export: iterate each range of each table and write the pairs, in key order, into one new SST
  file per table (``export-<token>-<nnnn>.sst``, ``<token>`` unique per export);
- import: ingest those SST files into the tables' column families (one ingestion per table);
- drop: one range deletion per range and table, in one atomic write batch.

Only the ``t.`` column families (tables) are walked, so internal metadata never moves.
These functions are the bodies of :meth:`RocksDBDatabase.export_shards`, ``import_files`` and
``drop_shards`` (:mod:`.database`), which check the database is open first.
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

__all__ = ["drop_shards", "export_shards", "import_files", "iterate_range"]


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

    A table with no key in ``shards`` gets no file.
    """
    chosen = tuple(ShardId(s) for s in sorted(set(shards)))
    ranges = shard_ranges(chosen)
    target = Path(directory)
    token = uuid.uuid4().hex[:12]
    files: dict[str, tuple[str, ...]] = {}
    keys = size = 0
    with translated(f"exporting shards to {target}"):
        target.mkdir(parents=True, exist_ok=True)
        for index, table in enumerate(sorted(tables)):
            view = tables[table]
            path = target / f"export-{token}-{index:04d}.sst"
            writer: rocksdict.SstFileWriter | None = None
            for begin, end in ranges:
                for key, value in iterate_range(view, table, begin, end):
                    if writer is None:
                        writer = rocksdict.SstFileWriter(options=options.to_options())
                        writer.open(str(path))
                    writer[key] = value
                    keys += 1
            if writer is not None:
                writer.finish()
                size += path.stat().st_size
                files[table] = (str(path),)
    return ExportedShards(shards=chosen, files=files, keys=keys, bytes=size)


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
