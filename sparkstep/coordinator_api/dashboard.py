"""The coordinator's ``GET /``: one HTML page, its script and the chart library it loads.

:func:`render_dashboard` renders a :class:`~sparkstep.coordinator_api.metrics.CoordinatorFacts`
as a whole page: the controls, the charts' places, and under ``<main id="live">`` the state,
step, step rate, records in and out, input lag per partition, the last checkpoints, the layout
(shards per worker) and the rescale history. Everything taken from the facts is escaped with
:func:`html.escape`; no value from the facts is ever placed in a script.

The page's script, ``static/dashboard.js`` (served from :data:`STATIC_DIR` under ``/static/``
with the vendored chart library, uPlot, in ``static/uplot/``), does three things:

- live figures: every :data:`REFRESH_MS` it fetches the page's own address again (``cache:
  "no-store"``, never with the token), takes the new page's ``<main id="live">`` and puts it in
  place of the current one, so every figure (``id="step"`` among them) follows the
  coordinator. When a fetch fails, the page keeps its last figures and says since when it
  could not reach the coordinator. ``document.body.dataset.refreshes`` counts the updates;
- charts: every :data:`HISTORY_MS` it fetches ``api/v1/history`` (after the first time only
  what is newer) and draws input and output records/s, step latency (p50 and max), input lag
  per topic and checkpoint durations, with checkpoints, restarts and rescales marked on the
  time axis. Each chart's element says how many points it shows in ``data-points``;
- controls: pause, resume, checkpoint, rescale to N and stop call the REST API; pause,
  rescale and stop ask for a confirmation in the page first; the answer or the error shows in
  ``id="answer"``.

The token: a call under ``api/v1/`` answered 401 shows a form asking for it; the token is kept
in ``sessionStorage`` (this tab only, gone with it), sent as ``Authorization: Bearer`` on the
calls under ``api/v1/`` only, never put in a URL, and the call is made again. Without a token
the rest of the page (``/`` itself, unless ``auth_metrics_and_dashboard``) stays live.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sparkstep.coordinator_api.metrics import CoordinatorFacts

__all__ = ["HISTORY_MS", "REFRESH_MS", "STATIC_DIR", "render_dashboard"]

#: How often the page fetches itself again.
REFRESH_MS = 1000
#: How often the page fetches the history for its charts.
HISTORY_MS = 2000
#: The page's script and style and the chart library (package data).
STATIC_DIR = Path(__file__).parent / "static"

_CHECKPOINTS_SHOWN = 10
_RESCALES_SHOWN = 20

#: Pause, rescale and stop interrupt the steps or end the pipeline: the page asks first.
_CONTROLS = (
    ("pause", "Pause", "Pause the pipeline? Steps stop at the next step boundary."),
    ("resume", "Resume", ""),
    ("checkpoint", "Checkpoint", ""),
)
_STOP_CONFIRM = (
    "Stop the pipeline? It takes a final checkpoint, then every process exits; "
    "this page cannot start it again."
)
_CHARTS = (
    ("rates", "Records per second"),
    ("latency", "Step latency (ms)"),
    ("lag", "Input lag (records) per topic"),
    ("checkpoints", "Checkpoint duration (ms)"),
)


def _e(value: object) -> str:
    """``value`` as escaped text; None as a dash."""
    return "\u2013" if value is None else html.escape(str(value), quote=True)


def _num(value: object, digits: int = 0) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _e(value)
    if isinstance(value, float) or digits:
        return _e(f"{value:,.{digits}f}")
    return _e(f"{value:,}")


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]], empty: str) -> str:
    """A table of already escaped cells (``headers`` are escaped here)."""
    body = ["<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows]
    if not body:
        return f'<p class="none">{_e(empty)}</p>'
    head = "<tr>" + "".join(f"<th>{_e(h)}</th>" for h in headers) + "</tr>"
    # A wide table scrolls in its own box, never the page.
    return (
        f'<div class="scroll"><table><thead>{head}</thead><tbody>{"".join(body)}</tbody>'
        "</table></div>"
    )


def _mean_latency(metrics: Mapping[str, Any]) -> float | None:
    latency = metrics.get("step_latency_seconds")
    if not isinstance(latency, Mapping):
        return None
    count, total = latency.get("count"), latency.get("sum")
    if not isinstance(count, int) or not count or not isinstance(total, int | float):
        return None
    return float(total) / count * 1000


def _figures(facts: CoordinatorFacts) -> str:
    status: Mapping[str, Any] = facts.runtime_status or {}
    metrics = facts.runtime_metrics
    state_class = "state state-" + "".join(c for c in facts.state if c.isalnum())
    failure = facts.last_failure
    failure_text = (
        "none" if not failure else f"{_e(failure.get('at'))}: {_e(failure.get('reason'))}"
    )
    rows = [
        ("state", f'<span id="state" class="{state_class}">{_e(facts.state)}</span>'),
        ("runtime", "reachable" if facts.runtime_status is not None else "not reachable"),
        ("step", f'<span id="step">{_e(status.get("step"))}</span>'),
        ("step rate", f"{_num(metrics.get('step_rate'), 2)} steps/s"),
        ("records in", f'<span id="records-in">{_num(metrics.get("records_in"))}</span>'),
        ("input rate", f"{_num(metrics.get('records_in_rate'), 1)} records/s"),
        ("records out", f'<span id="records-out">{_num(metrics.get("records_out"))}</span>'),
        ("dead letters", _num(metrics.get("dead_letters"))),
        ("mean step latency", f"{_num(_mean_latency(metrics), 1)} ms"),
        ("steps replayed at recovery", _num(metrics.get("replayed_steps"))),
        ("restarts", _num(facts.restarts)),
        ("last failure", failure_text),
    ]
    cells = "".join(f"<tr><td>{_e(name)}</td><td>{value}</td></tr>" for name, value in rows)
    return f'<table class="figures">{cells}</table>'


def _lag(facts: CoordinatorFacts) -> str:
    partitions = facts.runtime_metrics.get("partitions")
    docs = partitions.values() if isinstance(partitions, Mapping) else ()
    rows = [
        [
            _e(p.get("topic")),
            _e(p.get("partition")),
            _num(p.get("end")),
            _num(p.get("stable")),
            _num(p.get("high")),
            f'<span class="lag">{_num(p.get("lag"))}</span>',
            _num(p.get("lso_stalls")) + (" (stalled now)" if p.get("stalled") else ""),
        ]
        for p in docs
        if isinstance(p, Mapping)
    ]
    headers = ["topic", "partition", "logged end", "stable offset", "high watermark", "lag"]
    return _table([*headers, "LSO stalls"], rows, "no input partitions seen yet")


def _checkpoints(facts: CoordinatorFacts) -> str:
    shown = list(facts.checkpoints)[-_CHECKPOINTS_SHOWN:][::-1]
    rows = [
        [
            _e(c.get("version")),
            _e(c.get("step")),
            _e(c.get("at")),
            _num(c.get("duration_ms")),
        ]
        for c in shown
    ]
    return _table(["version", "step", "at", "duration (ms)"], rows, "no checkpoint yet")


def _layout(facts: CoordinatorFacts) -> str:
    status: Mapping[str, Any] = facts.runtime_status or {}
    layout = status.get("layout")
    epoch = layout.get("epoch") if isinstance(layout, Mapping) else status.get("layout_epoch")
    head = (
        f'<p>epoch <span id="layout-epoch">{_e(epoch)}</span>, '
        f"{_e(status.get('workers'))} workers</p>"
    )
    shards = facts.shards_per_worker
    if not shards:
        return head + '<p class="none">shards per worker: not reported</p>'
    widest = max(shards) or 1
    rows = [
        [_e(w), _num(n), f'<span class="bar" style="width: {round(12 * n / widest, 2)}rem"></span>']
        for w, n in enumerate(shards)
    ]
    return head + _table(["worker", "shards", ""], rows, "")


def _rescales(facts: CoordinatorFacts) -> str:
    shown = list(facts.rescales)[-_RESCALES_SHOWN:][::-1]
    rows = [
        [
            _e(r.get("at")),
            f"{_e(r.get('from_workers'))} \u2192 {_e(r.get('workers'))}",
            _e(r.get("mode")),
            _e(r.get("layout_epoch")),
            _num(r.get("shards_moved")),
            _num(r.get("bytes_moved")),
            _num(r.get("bytes_precopied")),
            _num(r.get("bytes_paused")),
            _num(r.get("pause_ms")),
        ]
        for r in shown
    ]
    headers = [
        "at",
        "workers",
        "mode",
        "epoch",
        "shards moved",
        "bytes moved",
        "of which while running",
        "while paused",
        "pause (ms)",
    ]
    return _table(headers, rows, "no rescale yet")


def _controls(facts: CoordinatorFacts) -> str:
    status: Mapping[str, Any] = facts.runtime_status or {}
    workers = status.get("workers")
    value = f' value="{_e(workers)}"' if isinstance(workers, int) else ""
    buttons = "".join(
        f'<button type="button" id="{action}" data-action="{action}" '
        f'data-confirm="{_e(confirm)}">{_e(label)}</button>'
        for action, label, confirm in _CONTROLS
    )
    rescale = (
        '<div class="rescale"><label for="workers">workers</label> '
        f'<input id="workers" type="number" min="1" max="1024" step="1"{value}> '
        '<button type="button" id="rescale" data-action="rescale" '
        'data-confirm="Rescale the pipeline? Steps pause while shards move.">Rescale</button>'
        "</div>"
    )
    stop = (
        f'<button type="button" id="stop" data-action="stop" data-confirm="{_e(_STOP_CONFIRM)}">'
        "Stop</button>"
    )
    return (
        f'<div class="buttons">{buttons}{rescale}{stop}</div>'
        '<div id="confirm" hidden><span id="confirm-text"></span> '
        '<button type="button" id="confirm-yes">Yes</button> '
        '<button type="button" id="confirm-no">Cancel</button></div>'
        '<form id="token-form" hidden><label for="token">The API needs its token '
        "(kept for this tab only):</label> "
        '<input id="token" type="password" autocomplete="off" required> '
        '<button type="submit" id="token-use">Use</button></form>'
        '<p id="answer" role="status"></p>'
    )


def _charts() -> str:
    charts = "".join(
        f'<figure class="chart"><figcaption>{_e(title)}</figcaption>'
        f'<div id="chart-{name}" data-points="0"></div></figure>'
        for name, title in _CHARTS
    )
    marks = (
        '<p class="marks">marks: <span class="mark-checkpoint">checkpoint</span> '
        '<span class="mark-rescale">rescale</span> <span class="mark-restart">restart</span> '
        '<span id="history-note"></span></p>'
    )
    return f'<div class="charts">{charts}</div>{marks}'


def render_dashboard(facts: CoordinatorFacts) -> str:
    """The dashboard page for ``facts`` (see the module docstring)."""
    title = f"sparkstep \u2013 {facts.pipeline}" if facts.pipeline else "sparkstep"
    sections = (
        ("Progress", _figures(facts)),
        ("Input lag", _lag(facts)),
        ("Checkpoints", _checkpoints(facts)),
        ("Layout", _layout(facts)),
        ("Rescales", _rescales(facts)),
    )
    live = "".join(f"<section><h2>{_e(name)}</h2>{body}</section>" for name, body in sections)
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title>"
        '<link rel="stylesheet" href="static/uplot/uPlot.min.css">'
        '<link rel="stylesheet" href="static/dashboard.css"></head>'
        f'<body data-refreshes="0" data-refresh-ms="{REFRESH_MS}" data-history-ms="{HISTORY_MS}">'
        f'<h1>{_e(title)}</h1><p id="conn"></p>'
        f"<section><h2>Controls</h2>{_controls(facts)}</section>"
        f"<section><h2>Over time</h2>{_charts()}</section>"
        f'<main id="live">{live}</main>'
        '<script src="static/uplot/uPlot.iife.min.js"></script>'
        '<script src="static/dashboard.js"></script></body></html>\n'
    )
