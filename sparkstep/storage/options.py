"""RocksDB tuning of a store's working copy (not part of the on-disk format)."""

from __future__ import annotations

from dataclasses import dataclass

import rocksdict

__all__ = ["RocksDBOptions"]


@dataclass(frozen=True)
class RocksDBOptions:
    """RocksDB tuning of a store's working copy (committed versions are only read by open).

    The defaults suit one state worker on a small machine; they are not part of the on-disk
    format, so a store can be reopened with other values.
    """

    write_buffer_size: int = 64 << 20
    max_write_buffer_number: int = 3
    target_file_size_base: int = 64 << 20
    max_background_jobs: int = 2
    compression: str = "lz4"

    def to_options(self) -> rocksdict.Options:
        """The rocksdict ``Options`` (raw bytes mode) for the database and each column family."""
        options = rocksdict.Options(raw_mode=True)
        options.create_if_missing(True)
        options.set_write_buffer_size(self.write_buffer_size)
        options.set_max_write_buffer_number(self.max_write_buffer_number)
        options.set_target_file_size_base(self.target_file_size_base)
        options.set_max_background_jobs(self.max_background_jobs)
        try:
            compression = getattr(rocksdict.DBCompressionType, self.compression)()
        except AttributeError:
            raise ValueError(f"unknown RocksDB compression {self.compression!r}") from None
        options.set_compression_type(compression)
        return options
