"""prometheus_text: checked by a strict parser of text exposition format 0.0.4.

The parser refuses what Prometheus would refuse (bad names, bad escapes, samples outside their
family, duplicate series, unordered or inconsistent histograms) and a little more (a family
without HELP and TYPE, counters not ending in ``_total``), so a malformed exposition fails here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from sparkstep.coordinator_api.metrics import (
    CONTENT_TYPE,
    CoordinatorFacts,
    prometheus_text,
    timestamp,
)
from sparkstep.ids import Step, Version
from sparkstep.io.division import Division, PartitionRange, StepTime
from sparkstep.runtime.metrics import RuntimeMetrics

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_SUFFIXES = {
    "counter": ("",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}

Labels = tuple[tuple[str, str], ...]


@dataclass
class Family:
    name: str
    help: str
    type: str
    samples: dict[tuple[str, Labels], float] = field(default_factory=dict)

    def value(self, suffix: str = "", **labels: str) -> float:
        return self.samples[(self.name + suffix, tuple(sorted(labels.items())))]


def _parse_labels(text: str, line: str) -> Labels:
    labels: list[tuple[str, str]] = []
    i = 0
    while i < len(text):
        match = _LABEL.match(text, i)
        assert match, f"bad label name in {line!r}"
        name = match.group()
        i = match.end()
        assert text[i : i + 2] == '="', f'label {name} without =" in {line!r}'
        i += 2
        value = []
        while text[i] != '"':
            if text[i] == "\\":
                escaped = text[i + 1]
                assert escaped in '\\"n', f"bad escape \\{escaped} in {line!r}"
                value.append("\n" if escaped == "n" else escaped)
                i += 2
            else:
                assert text[i] != "\n"
                value.append(text[i])
                i += 1
        labels.append((name, "".join(value)))
        i += 1
        if i < len(text):
            assert text[i] == ",", f"labels not separated by commas in {line!r}"
            i += 1
    names = [n for n, _ in labels]
    assert len(names) == len(set(names)), f"repeated label in {line!r}"
    return tuple(sorted(labels))


def _parse_value(text: str, line: str) -> float:
    assert text in ("+Inf", "-Inf", "NaN") or re.fullmatch(
        r"-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?", text
    ), f"bad value in {line!r}"
    return float(text.replace("Inf", "inf"))


def parse(text: str) -> dict[str, Family]:
    """Strict: every family is HELP, TYPE, then its samples; returns families by name."""
    assert text.endswith("\n"), "the exposition must end with a newline"
    families: dict[str, Family] = {}
    current: Family | None = None
    pending_help: tuple[str, str] | None = None
    for line in text[:-1].split("\n"):
        assert line and line == line.strip(), f"blank or padded line {line!r}"
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            assert _NAME.fullmatch(name) and name not in families, f"bad or repeated {name}"
            assert "\\" not in help_.replace("\\\\", "").replace("\\n", ""), line
            pending_help = (name, help_)
            current = None
            continue
        if line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert pending_help is not None and pending_help[0] == name, (
                f"TYPE without HELP: {line}"
            )
            assert kind in _SUFFIXES, f"unknown type {kind}"
            if kind == "counter":
                assert name.endswith("_total"), f"counter {name} must end in _total"
            current = families[name] = Family(name, pending_help[1], kind)
            pending_help = None
            continue
        assert not line.startswith("#"), f"unexpected comment {line!r}"
        assert current is not None, f"sample outside a family: {line!r}"
        match = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+)", line)
        assert match, f"bad sample line {line!r}"
        name, _, label_text, value = match.groups()
        suffix = name[len(current.name) :]
        assert name.startswith(current.name) and suffix in _SUFFIXES[current.type], (
            f"{name} does not belong to the family {current.name} ({current.type})"
        )
        labels = _parse_labels(label_text or "", line)
        assert (name, labels) not in current.samples, f"duplicate series {line!r}"
        current.samples[(name, labels)] = _parse_value(value, line)
    assert pending_help is None, "HELP without TYPE at the end"
    for family in families.values():
        assert family.samples, f"family {family.name} has no samples"
        if family.type == "histogram":
            _check_histogram(family)
    return families


def _check_histogram(family: Family) -> None:
    buckets = [
        (dict(labels)["le"], value)
        for (name, labels), value in family.samples.items()
        if name.endswith("_bucket")
    ]
    bounds = [float(le.replace("Inf", "inf")) for le, _ in buckets]
    assert bounds == sorted(bounds) and bounds[-1] == math.inf, f"{family.name} le order"
    counts = [v for _, v in buckets]
    assert counts == sorted(counts), f"{family.name} buckets are not cumulative"
    assert counts[-1] == family.value("_count"), f"{family.name}: +Inf bucket != _count"


def _runtime_metrics() -> dict[str, Any]:
    m = RuntimeMetrics()
    planned = Division(
        Step(0),
        (PartitionRange("in", 0, 0, 30), PartitionRange("in", 1, 0, 0)),
        StepTime(max_input_ts=None, wall=0),
    )
    m.observe_plan(planned, {("in", 0): 50, ("in", 1): 0}, {("in", 0): 50, ("in", 1): 3})
    m.step_finished(planned, 0.2, records_in=30, records_out=12, dead_letters=1)
    m.step_finished(
        Division(Step(1), (PartitionRange("in", 0, 30, 50),), StepTime(None, 0)),
        1.7,
        records_in=20,
        records_out=8,
        dead_letters=0,
    )
    m.checkpoint_finished(Version(1), Step(2), 0.25)
    return m.snapshot()


def _facts(**overrides) -> CoordinatorFacts:
    status = {
        "state": "running",
        "step": 2,
        "deployment": "d",
        "checkpoint": {"version": 1, "step": 2},
        "workers": 3,
        "layout_epoch": 1,
        "failure": None,
        "input_ends": {"in/0": 50, "in/1": 0},
        "metrics": _runtime_metrics(),
        "layout": {"epoch": 1, "workers": 3, "shards_per_worker": [86, 85, 85]},
    }
    doc: dict[str, Any] = {
        "state": "running",
        "runtime_status": status,
        "checkpoints": [
            {"version": 1, "step": 2, "at": "2026-11-22T20:00:00Z", "duration_ms": 250},
            {"version": 2, "step": 9, "at": "2026-11-22T20:00:10+00:00", "duration_ms": 180},
        ],
        "rescales": [
            {
                "at": "2026-11-22T20:00:05Z",
                "from_workers": 2,
                "workers": 3,
                "layout_epoch": 1,
                "shards_moved": 85,
                "bytes_moved": 123456,
                "pause_ms": 1500,
                "mode": "hot",
                "bytes_precopied": 120000,
                "bytes_paused": 3456,
                "rounds": 2,
            }
        ],
        "restarts": 2,
        "pipeline": "demo",
    }
    doc.update(overrides)
    return CoordinatorFacts(**doc)


EXPECTED_FAMILIES = {
    "sparkstep_runtime_up",
    "sparkstep_state",
    "sparkstep_restarts_total",
    "sparkstep_step",
    "sparkstep_steps_total",
    "sparkstep_replayed_steps_total",
    "sparkstep_records_in_total",
    "sparkstep_records_out_total",
    "sparkstep_dead_letters_total",
    "sparkstep_step_latency_seconds",
    "sparkstep_checkpoint_duration_seconds",
    "sparkstep_input_lag_records",
    "sparkstep_input_end_offset",
    "sparkstep_input_stable_offset",
    "sparkstep_input_high_watermark",
    "sparkstep_input_lso_stalls_total",
    "sparkstep_input_stalled",
    "sparkstep_workers",
    "sparkstep_layout_epoch",
    "sparkstep_layout_shards",
    "sparkstep_last_checkpoint_duration_seconds",
    "sparkstep_last_checkpoint_version",
    "sparkstep_last_checkpoint_step",
    "sparkstep_last_checkpoint_timestamp_seconds",
    "sparkstep_rescales_total",
    "sparkstep_last_rescale_pause_seconds",
    "sparkstep_last_rescale_shards_moved",
    "sparkstep_last_rescale_bytes_moved",
    "sparkstep_last_rescale_bytes_precopied",
    "sparkstep_last_rescale_bytes_paused",
    "sparkstep_last_rescale_rounds",
    "sparkstep_last_rescale_workers",
    "sparkstep_last_rescale_from_workers",
    "sparkstep_last_rescale_layout_epoch",
    "sparkstep_last_rescale_timestamp_seconds",
}


def test_every_family_with_its_values() -> None:
    families = parse(prometheus_text(_facts()))
    assert set(families) == EXPECTED_FAMILIES
    f = families
    assert f["sparkstep_runtime_up"].value() == 1
    assert f["sparkstep_state"].value(state="running") == 1
    assert sum(f["sparkstep_state"].samples.values()) == 1
    states = {dict(labels)["state"] for _, labels in f["sparkstep_state"].samples}
    assert states == {"running", "paused", "stopped", "recovering", "rescaling", "failed"}
    assert f["sparkstep_restarts_total"].value() == 2
    assert f["sparkstep_step"].value() == 2
    assert f["sparkstep_steps_total"].value() == 2
    assert f["sparkstep_replayed_steps_total"].value() == 0
    assert f["sparkstep_records_in_total"].value() == 50
    assert f["sparkstep_records_out_total"].value() == 20
    assert f["sparkstep_dead_letters_total"].value() == 1
    latency = f["sparkstep_step_latency_seconds"]
    assert latency.type == "histogram"
    assert latency.value("_bucket", le="0.25") == 1
    assert latency.value("_bucket", le="2.5") == 2
    assert latency.value("_sum") == pytest.approx(1.9)
    checkpoint = f["sparkstep_checkpoint_duration_seconds"]
    assert (checkpoint.type, checkpoint.value("_count"), checkpoint.value("_sum")) == (
        "summary",
        1,
        0.25,
    )
    assert f["sparkstep_input_lag_records"].value(topic="in", partition="0") == 0
    assert f["sparkstep_input_lag_records"].value(topic="in", partition="1") == 0
    assert f["sparkstep_input_end_offset"].value(topic="in", partition="0") == 50
    assert f["sparkstep_input_stable_offset"].value(topic="in", partition="0") == 50
    assert f["sparkstep_input_high_watermark"].value(topic="in", partition="1") == 3
    assert f["sparkstep_input_lso_stalls_total"].value(topic="in", partition="1") == 1
    assert f["sparkstep_input_lso_stalls_total"].value(topic="in", partition="0") == 0
    assert f["sparkstep_input_stalled"].value(topic="in", partition="1") == 1
    assert f["sparkstep_workers"].value() == 3
    assert f["sparkstep_layout_epoch"].value() == 1
    assert [f["sparkstep_layout_shards"].value(worker=str(w)) for w in range(3)] == [86, 85, 85]
    assert f["sparkstep_last_checkpoint_duration_seconds"].value() == 0.18
    assert f["sparkstep_last_checkpoint_version"].value() == 2
    assert f["sparkstep_last_checkpoint_step"].value() == 9
    assert f["sparkstep_last_checkpoint_timestamp_seconds"].value() == timestamp(
        "2026-11-22T20:00:10Z"
    )
    assert f["sparkstep_rescales_total"].value() == 1
    assert f["sparkstep_last_rescale_pause_seconds"].value() == 1.5
    assert f["sparkstep_last_rescale_shards_moved"].value() == 85
    assert f["sparkstep_last_rescale_bytes_moved"].value() == 123456
    assert f["sparkstep_last_rescale_bytes_precopied"].value() == 120000
    assert f["sparkstep_last_rescale_bytes_paused"].value() == 3456
    assert f["sparkstep_last_rescale_rounds"].value() == 2
    assert f["sparkstep_last_rescale_workers"].value() == 3
    assert f["sparkstep_last_rescale_from_workers"].value() == 2
    assert f["sparkstep_last_rescale_layout_epoch"].value() == 1


def test_an_unreachable_runtime_leaves_its_families_out() -> None:
    families = parse(
        prometheus_text(
            _facts(state="recovering", runtime_status=None, checkpoints=[], rescales=[])
        )
    )
    assert set(families) == {
        "sparkstep_runtime_up",
        "sparkstep_state",
        "sparkstep_restarts_total",
        "sparkstep_rescales_total",
    }
    assert families["sparkstep_runtime_up"].value() == 0
    assert families["sparkstep_state"].value(state="recovering") == 1
    assert families["sparkstep_rescales_total"].value() == 0


def test_before_rescale_exists_and_with_unknown_values() -> None:
    status = dict(_facts().runtime_status or {})
    del status["layout"]
    metrics = dict(status["metrics"])
    metrics["partitions"] = {
        "in/0": {"topic": "in", "partition": 0, "end": 7, "stable": None, "high": None,
                 "lag": None, "lso_stalls": 0, "stalled": False}
    }  # fmt: skip
    status["metrics"] = metrics
    families = parse(prometheus_text(_facts(runtime_status=status)))
    assert "sparkstep_layout_shards" not in families
    assert families["sparkstep_layout_epoch"].value() == 1  # from "layout_epoch"
    assert "sparkstep_input_lag_records" not in families  # no sample, so no family
    assert families["sparkstep_input_end_offset"].value(topic="in", partition="0") == 7


def test_label_values_are_escaped() -> None:
    state = 'odd "state" \\ with\nnewline'
    families = parse(prometheus_text(_facts(state=state)))
    assert families["sparkstep_state"].value(state=state) == 1
    assert families["sparkstep_state"].value(state="running") == 0


def test_the_parser_refuses_malformed_text() -> None:
    good = "# HELP a_total x\n# TYPE a_total counter\na_total 1\n"
    parse(good)
    bad = [
        good[:-1],  # no final newline
        "a_total 1\n",  # no family
        "# HELP a x\n# TYPE a counter\na 1\n",  # counter without _total
        good + "a_total 2\n",  # duplicate series
        '# HELP g x\n# TYPE g gauge\ng{l="\\q"} 1\n',  # bad escape
        "# HELP g x\n# TYPE g gauge\nh 1\n",  # sample of another family
        '# HELP h x\n# TYPE h histogram\nh_bucket{le="1"} 2\nh_bucket{le="+Inf"} 1\n'
        "h_sum 1\nh_count 1\n",  # not cumulative
    ]
    for text in bad:
        with pytest.raises(AssertionError):
            parse(text)


@pytest.mark.parametrize(
    ("at", "expected"),
    [
        ("2026-11-22T20:00:00Z", 1795377600.0),
        ("2026-11-22T21:00:00+01:00", 1795377600.0),
        ("2026-11-22T20:00:00", 1795377600.0),
        (1795377600, 1795377600.0),
        (1795377600.5, 1795377600.5),
        ("yesterday", None),
        (None, None),
        (True, None),
    ],
)
def test_timestamps(at: object, expected: float | None) -> None:
    assert timestamp(at) == expected


def test_content_type() -> None:
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")
