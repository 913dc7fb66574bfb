"""The Spark driver JVM's class data archive (sparkstep.runtime.jvm): made once, offered only
whole, mapped by the runtime's session, and the JVM's log kept off stdout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sparkstep.io.broker import default_cache_dir
from sparkstep.runtime import jvm
from sparkstep.runtime.jvm import (
    LOG_TO_STDERR,
    ClassArchiveError,
    driver_java_options,
    make_archive,
    ready_archive,
)


def _archive_named(cache: Path, size: int, content: int) -> Path:
    directory = cache / "jvm"
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{jvm._stem()}-{size}.jsa"
    path.write_bytes(b"x" * content)
    return path


def test_an_archive_is_offered_only_at_the_size_its_name_records(tmp_path: Path) -> None:
    assert ready_archive(tmp_path) is None
    assert driver_java_options(tmp_path) == LOG_TO_STDERR
    torn = _archive_named(tmp_path, 4096, 1000)  # a JVM that maps it dies of SIGBUS
    assert ready_archive(tmp_path) is None
    assert "SharedArchiveFile" not in driver_java_options(tmp_path)
    torn.unlink()
    whole = _archive_named(tmp_path, 1000, 1000)
    assert ready_archive(tmp_path) == whole
    options = driver_java_options(tmp_path)
    assert options.startswith(LOG_TO_STDERR)
    assert f"-XX:+VerifySharedSpaces -XX:SharedArchiveFile={whole}" in options


def test_an_archive_that_fails_its_check_is_never_put_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training JVM wrote a file but the check JVM could not map it (injected): the maker
    fails in one line and leaves neither an archive nor its scratch file."""
    roles: list[str] = []

    def child(role: str, archive: Path, timeout_s: float) -> None:
        roles.append(role)
        if role == "train":
            archive.write_bytes(b"not an archive")
            return
        raise ClassArchiveError("the check JVM failed: Unable to use shared archive")

    monkeypatch.setattr(jvm, "_child", child)
    with pytest.raises(ClassArchiveError, match="check JVM failed"):
        make_archive(tmp_path)
    assert roles == ["train", "check"]
    assert list((tmp_path / "jvm").glob("*.jsa")) == []
    assert list((tmp_path / "jvm").glob("*.tmp")) == []
    assert ready_archive(tmp_path) is None


def test_a_maker_killed_before_it_renamed_leaves_nothing_the_next_one_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = tmp_path / "jvm"
    directory.mkdir()
    stale = directory / f"{jvm._stem()}.12345.tmp"
    stale.write_bytes(b"half an archive")

    def child(role: str, archive: Path, timeout_s: float) -> None:
        if role == "train":
            archive.write_bytes(b"y" * 2048)

    monkeypatch.setattr(jvm, "_child", child)
    made = make_archive(tmp_path)
    assert made.name == f"{jvm._stem()}-2048.jsa"
    assert not stale.exists()
    assert make_archive(tmp_path) == made  # ready: nothing is made again


def test_an_archive_belongs_to_one_pyspark_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JVM refuses an archive whose class path differs in a jar's path, size or time (a
    venv made afresh at the same path): so does the archive's name."""
    import pyspark

    install = tmp_path / "pyspark"
    (install / "jars").mkdir(parents=True)
    jar = install / "jars" / "spark-core.jar"
    jar.write_bytes(b"classes")
    monkeypatch.setattr(pyspark, "__file__", str(install / "__init__.py"))
    first = jvm._stem()
    assert first is not None and jvm._stem() == first
    os.utime(jar, ns=(0, 1_000_000_000))
    assert jvm._stem() not in (None, first)
    touched = jvm._stem()
    jar.write_bytes(b"other classes")
    os.utime(jar, ns=(0, 1_000_000_000))
    assert jvm._stem() not in (None, first, touched)


def test_making_an_archive_deletes_those_of_installs_gone_or_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other installs' archives stay while their installs do, however many (a dev machine's
    venv must not lose its archive to a few clean clones); those of installs deleted or
    changed, and those without an install record, go."""
    import pyspark

    def install(name: str) -> Path:
        (tmp_path / name / "jars").mkdir(parents=True)
        (tmp_path / name / "jars" / "spark-core.jar").write_bytes(b"classes")
        return tmp_path / name

    def made_for(root: Path) -> Path:
        monkeypatch.setattr(pyspark, "__file__", str(root / "__init__.py"))
        return make_archive(tmp_path / "cache")

    def child(role: str, archive: Path, timeout_s: float) -> None:
        if role == "train":
            archive.write_bytes(b"y" * 64)

    monkeypatch.setattr(jvm, "_child", child)
    directory = tmp_path / "cache" / "jvm"
    a, b, c, d, e = (install(name) for name in "abcde")
    archives = [made_for(root) for root in (a, b, c)]
    unrecorded = directory / "spark-driver-0123456789abcdef-5.jsa"  # made before the records
    unrecorded.write_bytes(b"zzzzz")
    archives.append(made_for(d))
    assert all(archive.is_file() for archive in archives) and not unrecorded.exists()

    shutil.rmtree(a)  # a venv deleted
    (b / "jars" / "spark-core.jar").write_bytes(b"other classes")  # one upgraded in place
    last = made_for(e)
    left = sorted(path.name for path in directory.glob("spark-driver-*"))
    kept = [archives[2], archives[3], last]
    assert left == sorted(
        [path.name for path in kept] + [path.name.rsplit("-", 1)[0] + ".install" for path in kept]
    )


_SESSION = """
import sys
from pathlib import Path
from sparkstep.runtime.process import spark_session
spark = spark_session("local[1]", "sparkstep-archive-test", cache_dir=Path(sys.argv[1]))
print("rows", spark.range(3).count())
spark.stop()
"""


def _session_run(cache: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _SESSION, str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        check=False,
    )


def test_the_runtime_session_maps_the_made_archive_and_keeps_jvm_logs_off_stdout(
    kafka_libs: Path,
) -> None:
    """``make_archive`` of the cache (dev/setup.sh made it already: then this is instant); the
    runtime's session started with ``-Xshare:on``, under which the JVM refuses to start unless
    it maps the archive. Then with another jar on the driver's class path, where the JVM
    refuses the archive with a warning: the warning is on stderr, stdout holds only what the
    process printed (a runtime's stdout carries its ready line)."""
    cache = default_cache_dir()
    make_archive(cache)
    mapped = _session_run(cache, {"JDK_JAVA_OPTIONS": "-Xshare:on"})
    assert mapped.returncode == 0, mapped.stderr[-2000:]
    assert mapped.stdout.strip() == "rows 3"
    jar = next(kafka_libs.glob("*.jar"))
    refused = _session_run(
        cache, {"PYSPARK_SUBMIT_ARGS": f"--driver-class-path {jar} pyspark-shell"}
    )
    assert refused.returncode == 0, refused.stderr[-2000:]
    assert refused.stdout.strip() == "rows 3"
    assert "Unable to use shared archive" in refused.stderr


def test_a_cache_that_cannot_hold_an_archive_is_one_line(tmp_path: Path) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    with pytest.raises(ClassArchiveError, match="make the cache dir writable"):
        make_archive(blocked)
    assert ready_archive(blocked) is None
    assert driver_java_options(blocked) == LOG_TO_STDERR
