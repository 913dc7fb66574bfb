"""Benchmark: a runtime driver JVM's start with the class data archive vs without, in one run.

    .venv/bin/python -m bench.jvm_start [--trials 3]

Makes the archive of the cache dir if there is none (``sparkstep spark-archive``), then starts
``--trials`` pairs of fresh Python processes, alternating with and without it. Each builds the
runtime's own SparkSession (:func:`sparkstep.runtime.process.spark_session`, ``local[2,3]``) and
runs a first job like a step's (:func:`sparkstep.runtime.jvm._exercise`: a local relation,
``mapInArrow``, ``from_json``, a persisted read, an exchange, ``applyInArrow``, an aggregation,
``to_json``, ``toArrow``), then a second one (warm: what the archive cannot change). "Without"
is the same options with the archive hidden from the process (``SPARKSTEP_CACHE`` pointing at
an empty directory). Medians of each column, and the ratio with/without of the start to the
end of the first job: what a runtime's restart (after a crash, at a cold rescale) pays before
its recovery has anything to run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from sparkstep.io.broker import default_cache_dir
from sparkstep.runtime.jvm import make_archive

_CHILD = """
import json, sys, time
t0 = time.monotonic()
from pathlib import Path
from sparkstep.io.broker import default_cache_dir
from sparkstep.runtime.jvm import _exercise
from sparkstep.runtime.process import spark_session
spark = spark_session("local[2,3]", "sparkstep-bench-jvm-start", cache_dir=default_cache_dir())
t1 = time.monotonic()
_exercise(spark)
t2 = time.monotonic()
_exercise(spark)
t3 = time.monotonic()
print(json.dumps({"session": t1 - t0, "first": t2 - t1, "second": t3 - t2}))
"""


def _trial(cache: str) -> dict[str, float]:
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _CHILD],
        capture_output=True,
        text=True,
        env={**os.environ, "SPARKSTEP_CACHE": cache},
        check=True,
        timeout=600,
    )
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    figures["process"] = time.monotonic() - start
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="pairs of starts")
    args = parser.parse_args()
    cache = default_cache_dir()
    print(f"archive: {make_archive(cache)}")
    runs: dict[str, list[dict[str, float]]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory(prefix="sparkstep-bench-jvm-") as empty:
        for _ in range(args.trials):
            runs["with"].append(_trial(str(cache)))
            runs["without"].append(_trial(empty))
    columns = ["session", "first", "second", "process"]
    header = ["archive", "session start (s)", "first job (s)", "second job (s)", "process (s)"]
    print(f"{header[0]:<9}" + "".join(f"{h:>18}" for h in header[1:]))
    medians = {}
    for name, trials in runs.items():
        medians[name] = {c: statistics.median(t[c] for t in trials) for c in columns}
        print(f"{name:<9}" + "".join(f"{medians[name][c]:>18.2f}" for c in columns))
    to_first = {n: m["session"] + m["first"] for n, m in medians.items()}
    print(
        f"\nsession start + first job, with / without: {to_first['with']:.2f} s / "
        f"{to_first['without']:.2f} s = {to_first['with'] / to_first['without']:.2f}x "
        f"({args.trials} pairs, medians)"
    )


if __name__ == "__main__":
    main()
