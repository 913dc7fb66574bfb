"""The Spark driver JVM's options, and a class data archive that shortens its start.

A runtime's driver JVM starts at every runtime start: a pipeline's first start, every restart
after a crash, every cold rescale. A fresh JVM spends seconds loading, parsing and verifying
Spark's classes before and during its first job. Java's application class data sharing
(AppCDS; on Java 17 a *dynamic archive*: the classes one run loaded, written at its exit with
``-XX:ArchiveClassesAtExit``) lets a later JVM map them from one file instead. Measured on a
2-core machine (``bench/jvm_start.py``, BENCHMARKS.md): the runtime's SparkSession and a
step-like first job 11.7 s without the archive, 8.4 s with it.

Contract:

- :func:`driver_java_options` is what every sparkstep driver JVM is given: the JVM's own log
  messages on stderr (the runtime's stdout carries its ready line, which its launcher parses),
  and the archive, if one is *ready* for this pyspark install and this ``java``.
- An archive is *ready* once a training JVM wrote it and exited 0, and a second JVM started
  with ``-Xshare:on`` (fail rather than run without it) and ``-XX:+VerifySharedSpaces`` (a CRC
  of every region) mapped it and ran a job; only then is it renamed into place, its size in its
  name. A JVM is offered an archive only while the file still has that size: a JVM that maps a
  truncated archive dies of SIGBUS (tried), and a corrupt one of the right size is refused by
  the CRC check, with a warning on stderr, and the JVM runs without it.
- Making an archive is explicit (:func:`make_archive`: ``sparkstep spark-archive``, which
  ``dev/setup.sh`` runs) and idempotent; two makers at once take turns on a lock, and the second
  finds the archive ready.
- The archive only makes a start faster: a missing, refused or stale one (another pyspark,
  another ``java``, other jars on the class path) changes nothing but the time.

What the archive does not hold: classes of signed jars (Janino's, so the generated code's
compiler), classes Spark generates at run time, and executors' classes on a standalone cluster
(their JVMs are the cluster's, started without it).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from sparkstep.errors import SparkstepError
from sparkstep.io.broker import java_executable

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import SparkSession

__all__ = ["ClassArchiveError", "driver_java_options", "make_archive", "ready_archive"]

#: JVM log messages (unified logging: warnings about the archive among them) on stderr only.
LOG_TO_STDERR = "-Xlog:disable -Xlog:all=warning:stderr"
#: How long making an archive may take (two JVMs, a few Spark jobs).
MAKE_TIMEOUT_S = 600.0


class ClassArchiveError(SparkstepError):
    """The class data archive could not be made; sparkstep runs without it."""


def _archive_dir(cache_dir: Path) -> Path:
    return cache_dir / "jvm"


def _install() -> tuple[str, Path] | None:
    """The ``java`` pyspark starts (``$JAVA_HOME/bin/java``, else the first on ``PATH``) and
    pyspark's ``jars/``, both as real paths; None if there is no ``java``."""
    import shutil

    import pyspark

    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if java is None or not os.path.exists(java):
        return None
    jars = Path(pyspark.__file__).parent / "jars"
    return os.path.realpath(java), Path(os.path.realpath(jars))


def _stem_of(java: str, jars: Path) -> str | None:
    """The archive name's stem for an install, from what the JVM checks of it: ``java`` (its
    modification time) and the driver's class path, ``jars`` (its path, and each jar's name,
    size and modification time: a JVM refuses an archive whose class path differs in any of
    them, so a venv made afresh, even at the same path, needs its own). None if ``java`` is
    gone."""
    try:
        parts = [java, str(os.stat(java).st_mtime_ns), str(jars)]
    except OSError:
        return None
    with contextlib.suppress(OSError):
        for entry in sorted(os.scandir(jars), key=lambda e: e.name):
            stat = entry.stat()
            parts.append(f"{entry.name} {stat.st_size} {stat.st_mtime_ns}")
    return "spark-driver-" + hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _stem() -> str | None:
    """:func:`_stem_of` this process's install; None if there is no ``java``."""
    install = _install()
    return None if install is None else _stem_of(*install)


def ready_archive(cache_dir: Path) -> Path | None:
    """The ready archive for this pyspark install and ``java`` in ``cache_dir``, or None: a file
    ``<stem>-<size>.jsa`` whose size is still ``<size>``."""
    stem = _stem()
    if stem is None:
        return None
    with contextlib.suppress(OSError):  # an unreadable cache is no archive
        for path in sorted(_archive_dir(cache_dir).glob(f"{stem}-*.jsa")):
            size = path.name[len(stem) + 1 : -len(".jsa")]
            if size.isdigit() and path.stat().st_size == int(size):
                return path
    return None


def driver_java_options(cache_dir: Path) -> str:
    """The driver JVM's extra options (``spark.driver.extraJavaOptions``): the JVM's log on
    stderr, and the ready archive of ``cache_dir`` if there is one."""
    archive = ready_archive(cache_dir)
    if archive is None:
        return LOG_TO_STDERR
    return f"{LOG_TO_STDERR} -XX:+VerifySharedSpaces -XX:SharedArchiveFile={archive}"


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def make_archive(cache_dir: Path, timeout_s: float = MAKE_TIMEOUT_S) -> Path:
    """The ready archive for this pyspark install and ``java`` in ``cache_dir``, made now if
    there is none (see the module docstring); a few tens of seconds when it is made. Making
    one deletes the archives no JVM can use any more, those of installs that are gone or
    changed (about 170 MB each; a JVM that mapped one keeps its mapping), and keeps those of
    other installs (venvs) that still exist.

    Raises :class:`~sparkstep.errors.MissingToolError` without Java 17+, and
    :class:`ClassArchiveError` (one line, the JVM's last words in it) if the training or the
    check failed; no file is left under an archive's name then.
    """
    java_executable()
    directory = _archive_dir(cache_dir)
    try:
        return _make(directory, cache_dir, timeout_s)
    except OSError as exc:
        raise ClassArchiveError(
            f"making the Spark class archive in {directory}: {exc.strerror or exc}: "
            "make the cache dir writable ($SPARKSTEP_CACHE)"
        ) from exc


def _make(directory: Path, cache_dir: Path, timeout_s: float) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory):
        found = ready_archive(cache_dir)
        if found is not None:
            return found
        install = _install()
        stem = None if install is None else _stem_of(*install)
        if install is None or stem is None:
            raise ClassArchiveError(
                f"making the Spark class archive: {os.environ.get('JAVA_HOME')}/bin/java does "
                "not exist: point JAVA_HOME at a JDK 17+ or unset it"
            )
        for stale in directory.glob(f"{stem}*.tmp"):  # a maker killed before it renamed
            stale.unlink(missing_ok=True)
        java, jars = install
        (directory / f"{stem}.install").write_text(f"{java}\n{jars}\n")
        scratch = directory / f"{stem}.{os.getpid()}.tmp"
        try:
            _child("train", scratch, timeout_s)
            if not scratch.is_file():
                raise ClassArchiveError(
                    f"making the Spark class archive: the train JVM wrote none at {scratch}"
                )
            _child("check", scratch, timeout_s)
            archive = directory / f"{stem}-{scratch.stat().st_size}.jsa"
            scratch.rename(archive)
        finally:
            scratch.unlink(missing_ok=True)
        _delete_stale(directory, keep=stem)
    return archive


def _delete_stale(directory: Path, keep: str) -> None:
    """Delete the files of every archive stem in ``directory`` but ``keep`` whose install
    record (``<stem>.install``: the ``java`` and the ``jars/`` it was made for) is missing or
    names an install that is gone or changed (so has another stem now): no JVM can use those
    archives. The archives of other installs that still exist stay, however many."""
    stems = {path.name[: len(keep)] for path in directory.glob("spark-driver-*")}  # one length
    for stem in stems - {keep}:
        try:
            java, jars = (directory / f"{stem}.install").read_text().splitlines()
            if _stem_of(java, Path(jars)) == stem:
                continue
        except (OSError, ValueError):  # no record, or not one (an archive made before them)
            pass
        for path in directory.glob(f"{stem}*"):
            path.unlink(missing_ok=True)


def _child(role: str, archive: Path, timeout_s: float) -> None:
    """Run ``python -m sparkstep.runtime.jvm ROLE ARCHIVE``; raise :class:`ClassArchiveError`
    with its last line of output if it fails or times out."""
    try:
        done = subprocess.run(
            [sys.executable, "-m", "sparkstep.runtime.jvm", role, str(archive)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise ClassArchiveError(
            f"making the Spark class archive: the {role} JVM did not end in {timeout_s:.0f}s"
        ) from exc
    if done.returncode != 0:
        lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"exit status {done.returncode}"
        raise ClassArchiveError(f"making the Spark class archive: the {role} JVM failed: {last}")


def _session(options: str) -> SparkSession:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    return (
        SparkSession.builder.master("local[2]")
        .appName("sparkstep-class-archive")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.extraJavaOptions", options)
        .getOrCreate()
    )


def _batches(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    yield from batches


def _exercise(spark: SparkSession) -> None:
    """A little of what a step does: a local relation, ``mapInArrow``, ``from_json``, a
    persisted read, an exchange, ``applyInArrow``, an aggregation, ``to_json``, ``toArrow``."""
    from pyspark.sql import functions as F

    rows = spark.createDataFrame(
        [(i, f"k{i % 50}", f'{{"v": {i}}}') for i in range(5000)], "id long, k string, j string"
    )
    parsed = rows.select("id", "k", F.from_json("j", "v long").alias("p")).select("id", "k", "p.v")
    read = parsed.mapInArrow(_batches, parsed.schema).persist()
    read.count()
    stage = read.groupBy("k").applyInArrow(lambda table: table, read.schema)
    out = stage.groupBy("k").agg(F.sum("v").alias("s"), F.count("*").alias("n"))
    side = read.where("v < 0").select(F.to_json(F.struct("id", "k")).alias("side"))
    out.select(F.to_json(F.struct("k", "s", "n")).alias("side")).unionByName(side).toArrow()
    read.unpersist(blocking=True)


def _train(archive: Path) -> None:
    """Run :func:`_exercise` in a JVM that writes its loaded classes to ``archive`` at exit,
    and wait for that JVM to exit."""
    from pyspark import SparkContext

    spark = _session(f"-Xlog:disable -XX:+VerifySharedSpaces -XX:ArchiveClassesAtExit={archive}")
    _exercise(spark)
    spark.stop()
    gateway = SparkContext._gateway
    assert gateway is not None
    proc = gateway.proc  # the JVM, which exits at its stdin's end and writes the archive then
    gateway.shutdown()
    proc.stdin.close()
    if proc.wait(MAKE_TIMEOUT_S) != 0:
        raise SystemExit(f"the training JVM exited with status {proc.returncode}")


def _check(archive: Path) -> None:
    """Map ``archive`` with ``-Xshare:on`` (the JVM fails to start without it) and verify its
    CRCs, then run :func:`_exercise`."""
    spark = _session(
        f"{LOG_TO_STDERR} -Xshare:on -XX:+VerifySharedSpaces -XX:SharedArchiveFile={archive}"
    )
    _exercise(spark)
    spark.stop()


if __name__ == "__main__":
    role, path = sys.argv[1], Path(sys.argv[2])
    {"train": _train, "check": _check}[role](path)
