"""The coordinator's ``GET /metrics``: Prometheus text (exposition format 0.0.4) from its facts.

The coordinator gathers a :class:`CoordinatorFacts` (its own state and histories, plus the
runtime's control ``GET /status`` document with its ``"metrics"``, see
:mod:`sparkstep.runtime.metrics`) and :func:`prometheus_text` renders it; the same facts feed
the dashboard (:mod:`sparkstep.coordinator_api.dashboard`). Rendering is a pure function of the
facts: it never calls anything.

Families (``topic``/``partition`` labels on the ``input`` ones; runtime families are left out
while the runtime cannot be reached, and a sample whose value is unknown is left out):

- ``sparkstep_runtime_up`` (gauge): 1 when the runtime's status was read.
- ``sparkstep_state{state}`` (gauge): 1 for the coordinator's state, 0 for the others.
- ``sparkstep_restarts_total`` (counter): restarts of the runtime and workers after a failure.
- ``sparkstep_step`` (gauge): the next step the runtime will take.
- ``sparkstep_steps_total``, ``sparkstep_replayed_steps_total``, ``sparkstep_records_in_total``,
  ``sparkstep_records_out_total``, ``sparkstep_dead_letters_total`` (counters, since the
  runtime process started; replayed steps count only in their own counter).
- ``sparkstep_step_latency_seconds`` (histogram): from a step's division to its committed
  transaction.
- ``sparkstep_checkpoint_duration_seconds`` (summary, ``_sum`` and ``_count``): the runtime's
  checkpoints.
- ``sparkstep_last_checkpoint_duration_seconds``, ``sparkstep_last_checkpoint_version``,
  ``sparkstep_last_checkpoint_step``, ``sparkstep_last_checkpoint_timestamp_seconds`` (gauges):
  the last checkpoint of the coordinator's history.
- ``sparkstep_input_lag_records``, ``sparkstep_input_end_offset``,
  ``sparkstep_input_stable_offset``, ``sparkstep_input_high_watermark``,
  ``sparkstep_input_stalled`` (gauges) and ``sparkstep_input_lso_stalls_total`` (counter), each
  per ``{topic, partition}``: see :mod:`sparkstep.runtime.metrics`.
- ``sparkstep_workers``, ``sparkstep_layout_epoch`` (gauges) and
  ``sparkstep_layout_shards{worker}`` (gauge): the layout.
- ``sparkstep_rescales_total`` (counter) and the last rescale's figures (gauges):
  ``sparkstep_last_rescale_pause_seconds``, ``_shards_moved``, ``_bytes_moved``,
  ``_bytes_precopied`` (while running), ``_bytes_paused``, ``_rounds`` (copy rounds while
  running), ``_workers``, ``_from_workers``, ``_layout_epoch``, ``_timestamp_seconds``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

__all__ = ["CONTENT_TYPE", "CoordinatorFacts", "KNOWN_STATES", "prometheus_text", "timestamp"]

#: The ``Content-Type`` of :func:`prometheus_text`'s answer.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: The coordinator states of the REST API, which ``sparkstep_state`` always lists (another
#: current state would be added).
KNOWN_STATES: tuple[str, ...] = (
    "failed",
    "paused",
    "recovering",
    "rescaling",
    "running",
    "stopped",
)


@dataclass(frozen=True)
class CoordinatorFacts:
    """What the coordinator knows at one moment; the input of both renderers.

    - ``state``: the coordinator's state (running, paused, stopped, recovering, rescaling,
      failed, ...).
    - ``runtime_status``: the runtime control ``GET /status`` document (with ``"metrics"`` and,
      once rescale exists, ``"layout"``), or None when the runtime cannot be reached.
    - ``checkpoints``: checkpoint history, oldest first, each ``{"version", "step", "at",
      "duration_ms"}``.
    - ``rescales``: rescale history, oldest first, each ``{"at", "from_workers", "workers",
      "layout_epoch", "shards_moved", "bytes_moved", "pause_ms"}``.
    - ``restarts``: how many times the runtime and workers were restarted after a failure.
    - ``pipeline``: the pipeline's name (the dashboard's title); ``last_failure``: None or
      ``{"at", "reason"}``.

    ``at`` is an ISO 8601 time (UTC when it has no offset) or unix seconds.
    """

    state: str
    runtime_status: Mapping[str, Any] | None
    checkpoints: Sequence[Mapping[str, Any]] = ()
    rescales: Sequence[Mapping[str, Any]] = ()
    restarts: int = 0
    pipeline: str = ""
    last_failure: Mapping[str, Any] | None = None

    @property
    def runtime_metrics(self) -> Mapping[str, Any]:
        """The runtime's ``"metrics"`` (empty when unknown)."""
        if self.runtime_status is None:
            return {}
        metrics = self.runtime_status.get("metrics")
        return metrics if isinstance(metrics, Mapping) else {}

    @property
    def shards_per_worker(self) -> list[int] | None:
        """The layout's shard count per worker, in worker order, when the runtime reports it."""
        layout = None if self.runtime_status is None else self.runtime_status.get("layout")
        if not isinstance(layout, Mapping):
            return None
        shards = layout.get("shards_per_worker")
        if not isinstance(shards, Sequence):
            return None
        return [int(n) for n in shards]


def timestamp(at: object) -> float | None:
    """``at`` (ISO 8601, UTC when naive, or unix seconds) as unix seconds; None if neither."""
    if isinstance(at, bool):
        return None
    if isinstance(at, int | float):
        return float(at)
    if isinstance(at, str):
        try:
            moment = datetime.fromisoformat(at)
        except ValueError:
            return None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
        return moment.timestamp()
    return None


def _number(value: object) -> str | None:
    """A sample value as Prometheus writes it; None when ``value`` is not a number."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "NaN"
        if math.isinf(value):
            return "+Inf" if value > 0 else "-Inf"
        return repr(value)
    return None


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


Labels = Sequence[tuple[str, str]]


class _Exposition:
    """Collects families in order; a family with no samples is left out entirely."""

    def __init__(self) -> None:
        self._lines: list[str] = []

    def family(
        self,
        name: str,
        kind: str,
        help_: str,
        samples: Iterable[tuple[str, Labels, object]],
    ) -> None:
        """``samples``: (suffix, labels, value); the sample's name is ``name + suffix``."""
        lines = []
        for suffix, labels, value in samples:
            text = _number(value)
            if text is None:
                continue
            label_text = ",".join(f'{key}="{_escape_label(val)}"' for key, val in labels)
            lines.append(
                f"{name}{suffix}{{{label_text}}} {text}" if labels else f"{name}{suffix} {text}"
            )
        if lines:
            self._lines += [f"# HELP {name} {_escape_help(help_)}", f"# TYPE {name} {kind}"]
            self._lines += lines

    def single(self, name: str, kind: str, help_: str, value: object) -> None:
        self.family(name, kind, help_, [("", (), value)])

    def text(self) -> str:
        return "\n".join(self._lines) + "\n" if self._lines else ""


def _input_families(out: _Exposition, partitions: Mapping[str, Any]) -> None:
    rows = [p for p in partitions.values() if isinstance(p, Mapping)]

    def samples(field: str) -> list[tuple[str, Labels, object]]:
        return [
            (
                "",
                (("topic", str(p.get("topic"))), ("partition", str(p.get("partition")))),
                p.get(field),
            )
            for p in rows
        ]

    out.family(
        "sparkstep_input_lag_records",
        "gauge",
        "Stable input not yet in a logged step: the last stable offset seen minus the end of "
        "the last logged step.",
        samples("lag"),
    )
    out.family(
        "sparkstep_input_end_offset",
        "gauge",
        "The first offset after the last logged step.",
        samples("end"),
    )
    out.family(
        "sparkstep_input_stable_offset",
        "gauge",
        "The last stable offset (LSO) the runtime last planned with.",
        samples("stable"),
    )
    out.family(
        "sparkstep_input_high_watermark",
        "gauge",
        "The high watermark read just before the last plan.",
        samples("high"),
    )
    out.family(
        "sparkstep_input_lso_stalls_total",
        "counter",
        "Planned divisions during which an open transaction held the partition's LSO below "
        "its high watermark.",
        samples("lso_stalls"),
    )
    out.family(
        "sparkstep_input_stalled",
        "gauge",
        "1 when the last planned division was held back by an open transaction.",
        samples("stalled"),
    )


def _runtime_families(out: _Exposition, status: Mapping[str, Any], facts: CoordinatorFacts) -> None:
    metrics = facts.runtime_metrics
    out.single(
        "sparkstep_step", "gauge", "The next step the runtime will take.", status.get("step")
    )
    counters = (
        ("sparkstep_steps_total", "steps", "New steps written since the runtime started."),
        ("sparkstep_replayed_steps_total", "replayed_steps", "Steps replayed by recovery."),
        ("sparkstep_records_in_total", "records_in", "Input records read by new steps."),
        ("sparkstep_records_out_total", "records_out", "Output rows written by new steps."),
        ("sparkstep_dead_letters_total", "dead_letters", "Dead letters written by new steps."),
    )
    for name, key, help_ in counters:
        out.single(name, "counter", help_, metrics.get(key))
    latency = metrics.get("step_latency_seconds")
    if isinstance(latency, Mapping) and isinstance(latency.get("buckets"), Mapping):
        buckets: list[tuple[str, Labels, object]] = [
            ("_bucket", (("le", str(le)),), count) for le, count in latency["buckets"].items()
        ]
        out.family(
            "sparkstep_step_latency_seconds",
            "histogram",
            "Time from a step's division to its committed transaction.",
            [*buckets, ("_sum", (), latency.get("sum")), ("_count", (), latency.get("count"))],
        )
    checkpoints = metrics.get("checkpoints")
    if isinstance(checkpoints, Mapping):
        out.family(
            "sparkstep_checkpoint_duration_seconds",
            "summary",
            "Checkpoints of the running runtime: pause, commit, manifest, reopen, resume.",
            [
                ("_sum", (), checkpoints.get("sum_seconds")),
                ("_count", (), checkpoints.get("count")),
            ],
        )
    partitions = metrics.get("partitions")
    if isinstance(partitions, Mapping):
        _input_families(out, partitions)
    layout = status.get("layout")
    epoch = layout.get("epoch") if isinstance(layout, Mapping) else status.get("layout_epoch")
    out.single("sparkstep_workers", "gauge", "State workers in the layout.", status.get("workers"))
    out.single("sparkstep_layout_epoch", "gauge", "The layout's epoch.", epoch)
    shards = facts.shards_per_worker
    if shards is not None:
        out.family(
            "sparkstep_layout_shards",
            "gauge",
            "Shards each state worker owns.",
            [("", (("worker", str(w)),), n) for w, n in enumerate(shards)],
        )


def _ms_to_s(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value / 1000


def prometheus_text(facts: CoordinatorFacts) -> str:
    """``facts`` as Prometheus text exposition format 0.0.4 (see the module docstring)."""
    out = _Exposition()
    status = facts.runtime_status
    out.single(
        "sparkstep_runtime_up",
        "gauge",
        "1 when the coordinator read the runtime's status.",
        int(status is not None),
    )
    states = sorted({*KNOWN_STATES, facts.state})
    out.family(
        "sparkstep_state",
        "gauge",
        "The coordinator's state: 1 for the current one.",
        [("", (("state", s),), int(s == facts.state)) for s in states],
    )
    out.single(
        "sparkstep_restarts_total",
        "counter",
        "Restarts of the runtime and workers after a failure.",
        facts.restarts,
    )
    if status is not None:
        _runtime_families(out, status, facts)
    if facts.checkpoints:
        last = facts.checkpoints[-1]
        out.single(
            "sparkstep_last_checkpoint_duration_seconds",
            "gauge",
            "Duration of the last checkpoint.",
            _ms_to_s(last.get("duration_ms")),
        )
        out.single(
            "sparkstep_last_checkpoint_version",
            "gauge",
            "Version of the last checkpoint.",
            last.get("version"),
        )
        out.single(
            "sparkstep_last_checkpoint_step",
            "gauge",
            "Step of the last checkpoint.",
            last.get("step"),
        )
        out.single(
            "sparkstep_last_checkpoint_timestamp_seconds",
            "gauge",
            "When the last checkpoint finished (unix seconds).",
            timestamp(last.get("at")),
        )
    out.single(
        "sparkstep_rescales_total",
        "counter",
        "Rescales in the coordinator's history.",
        len(facts.rescales),
    )
    if facts.rescales:
        last = facts.rescales[-1]
        figures = (
            ("pause_seconds", _ms_to_s(last.get("pause_ms")), "Time no step ran during"),
            ("shards_moved", last.get("shards_moved"), "Shards moved by"),
            ("bytes_moved", last.get("bytes_moved"), "Bytes of state moved by"),
            ("bytes_precopied", last.get("bytes_precopied"), "Bytes moved while running by"),
            ("bytes_paused", last.get("bytes_paused"), "Bytes moved while paused by"),
            ("rounds", last.get("rounds"), "Copy rounds while running of"),
            ("workers", last.get("workers"), "Workers after"),
            ("from_workers", last.get("from_workers"), "Workers before"),
            ("layout_epoch", last.get("layout_epoch"), "Layout epoch after"),
            ("timestamp_seconds", timestamp(last.get("at")), "Unix seconds at the end of"),
        )
        for suffix, value, help_ in figures:
            out.single(
                f"sparkstep_last_rescale_{suffix}", "gauge", f"{help_} the last rescale.", value
            )
    return out.text()
