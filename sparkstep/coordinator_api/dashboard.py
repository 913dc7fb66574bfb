"""The coordinator's ``GET /``: one plain HTML page with a little script.

:func:`render_dashboard` renders a :class:`~sparkstep.coordinator_api.metrics.CoordinatorFacts`
as a whole page: state, step, step rate, records in and out, input lag per partition, the last
checkpoints, the layout (shards per worker) and the rescale history. Everything taken from the
facts is escaped with :func:`html.escape`; the script is a constant.

Live: every second the script fetches the page's own address again (``cache: "no-store"``),
takes the new page's ``<main id="live">`` and puts it in place of the current one, so every
figure (``id="step"`` among them) follows the coordinator without reloading the page. When a
fetch fails, the page keeps its last figures and says since when it could not reach the
coordinator. ``document.body.dataset.refreshes`` counts the updates (for tests and the curious).
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sparkstep.coordinator_api.metrics import CoordinatorFacts

__all__ = ["REFRESH_MS", "render_dashboard"]

#: How often the page fetches itself again.
REFRESH_MS = 1000

_CHECKPOINTS_SHOWN = 10
_RESCALES_SHOWN = 20

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5rem; color: #222; }
h1 { font-size: 1.3rem; margin: 0 0 1rem; }
h2 { font-size: 1.05rem; margin: 1.4rem 0 0.4rem; }
table { border-collapse: collapse; }
th, td { padding: 0.2rem 0.8rem 0.2rem 0; text-align: left; font-variant-numeric: tabular-nums; }
th { font-weight: 600; border-bottom: 1px solid #ccc; }
.figures td:first-child { color: #555; }
.state { font-weight: 700; }
.state-running { color: #17723a; } .state-failed { color: #b00020; }
.state-recovering, .state-rescaling, .state-paused { color: #a05a00; }
.bar { display: inline-block; height: 0.7rem; background: #4a78c2; }
.none { color: #888; }
#conn { color: #b00020; }
"""

# A constant: no value from the facts is ever placed in the script.
_SCRIPT = """
(function () {
  "use strict";
  var refreshes = 0;
  var failingSince = null;
  function refresh() {
    fetch(window.location.href, {cache: "no-store"})
      .then(function (response) {
        if (!response.ok) { throw new Error("HTTP " + response.status); }
        return response.text();
      })
      .then(function (text) {
        var fresh = new DOMParser().parseFromString(text, "text/html").getElementById("live");
        var current = document.getElementById("live");
        if (fresh && current) {
          current.replaceWith(document.adoptNode(fresh));
          refreshes += 1;
          document.body.dataset.refreshes = String(refreshes);
        }
        failingSince = null;
        document.getElementById("conn").textContent = "";
      })
      .catch(function (error) {
        if (failingSince === null) { failingSince = new Date(); }
        document.getElementById("conn").textContent =
          "coordinator not reachable since " + failingSince.toISOString() + " (" + error + ")";
      })
      .finally(function () { window.setTimeout(refresh, REFRESH_MS); });
  }
  window.setTimeout(refresh, REFRESH_MS);
})();
"""


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
    return f"<table><thead>{head}</thead><tbody>{''.join(body)}</tbody></table>"


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
            _e(r.get("layout_epoch")),
            _num(r.get("shards_moved")),
            _num(r.get("bytes_moved")),
            _num(r.get("pause_ms")),
        ]
        for r in shown
    ]
    headers = ["at", "workers", "epoch", "shards moved", "bytes moved", "pause (ms)"]
    return _table(headers, rows, "no rescale yet")


def render_dashboard(facts: CoordinatorFacts) -> str:
    """The dashboard page for ``facts`` (see the module docstring)."""
    title = f"sparkstep \u2013 {facts.pipeline}" if facts.pipeline else "sparkstep"
    sections = (
        ("Progress", _figures(facts)),
        ("Input lag", _lag(facts)),
        ("Last checkpoints", _checkpoints(facts)),
        ("Layout", _layout(facts)),
        ("Rescales", _rescales(facts)),
    )
    live = "".join(f"<section><h2>{_e(name)}</h2>{body}</section>" for name, body in sections)
    script = _SCRIPT.replace("REFRESH_MS", str(REFRESH_MS))
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head>"
        f'<body data-refreshes="0"><h1>{_e(title)}</h1><p id="conn"></p>'
        f'<main id="live">{live}</main>'
        f"<script>{script}</script></body></html>\n"
    )
