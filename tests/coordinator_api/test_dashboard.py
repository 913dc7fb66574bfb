"""The dashboard page: rendered and escaped, and live in a real headless Chromium.

Chromium is Debian's package (``dev/setup.sh`` installs it); without it these tests fail with
one line that says how to install it. Two ways of driving it:

- ``--dump-dom`` with ``--virtual-time-budget``: Chromium runs the page's timers in virtual time
  and prints the DOM at the end; the server counts requests, so what the script fetched shows;
- ``--remote-debugging-pipe`` (the DevTools protocol over fds 3 and 4): the test reads the
  page's ``#step`` in real time while the page refreshes itself.

Pages: a small FastAPI app whose facts change with every request, and the real coordinator
(``sparkstep run`` with keyed_sum, 1 worker, input fed while it runs, a REST token set): its
charts fill from ``GET /api/v1/history``, its controls pause, resume, checkpoint, rescale and
stop the pipeline, and screenshots at 1280 and 390 pixels wide are kept in
``test-artifacts/dashboard/`` (see :data:`ARTIFACTS`; the test prints where). Checks are on
the DOM and the REST API, never on pixels.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response
from fastapi.staticfiles import StaticFiles

from sparkstep.coordinator_api.dashboard import STATIC_DIR, render_dashboard
from sparkstep.coordinator_api.metrics import CoordinatorFacts
from sparkstep.examples import keyed_sum
from sparkstep.ids import Step, Version
from sparkstep.io.division import Division, PartitionRange, StepTime
from sparkstep.runtime.metrics import RuntimeMetrics
from tests.coordinator_api.fixtures import CoordinatorProcess
from tests.coordinator_api.test_metrics import parse
from tests.runtime.driver.fixtures import produce_keyed, wait_until
from tests.serving import serving

_NO_CHROMIUM = (
    "chromium is not installed: run dev/setup.sh as root (it installs Debian's package) or "
    "apt-get install --no-install-recommends chromium"
)


@pytest.fixture(scope="session")
def chromium() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail(_NO_CHROMIUM, pytrace=False)
    return path


def _flags(profile: Path) -> list[str]:
    return ["--headless", "--disable-gpu", "--no-sandbox", f"--user-data-dir={profile}"]


def dump_dom(chromium: str, url: str, profile: Path, budget_ms: int) -> str:
    """The page's DOM after ``budget_ms`` of virtual time (its timers and fetches run)."""
    done = subprocess.run(
        [chromium, *_flags(profile), f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
    return done.stdout.decode()


class Browser:
    """Headless Chromium on ``url``, driven over the DevTools protocol on a pipe."""

    def __init__(self, chromium: str, url: str, profile: Path) -> None:
        to_chromium, self._write = os.pipe()
        self._read, from_chromium = os.pipe()
        # Chromium reads commands on fd 3 and answers on fd 4: a small exec wrapper puts the
        # pipes there (no preexec_fn: this process has threads).
        redirect = (
            "import fcntl, os, sys; "
            "a, b = (fcntl.fcntl(int(fd), fcntl.F_DUPFD, 10) for fd in sys.argv[1:3]); "
            "os.dup2(a, 3); os.dup2(b, 4); os.execv(sys.argv[3], sys.argv[3:])"
        )
        argv = [chromium, *_flags(profile), "--remote-debugging-pipe", url]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", redirect, str(to_chromium), str(from_chromium), *argv],
            pass_fds=(to_chromium, from_chromium),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_chromium)
        os.close(from_chromium)
        self._buffer = b""
        self._next_id = 0
        try:
            self._session = self._attach(url)
        except BaseException:
            self._end()
            raise

    def _call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._write, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 30
        while True:
            while b"\0" not in self._buffer:
                left = deadline - time.monotonic()
                assert left > 0, f"chromium did not answer {method}"
                ready, _, _ = select.select([self._read], [], [], left)
                if ready:
                    chunk = os.read(self._read, 1 << 16)
                    assert chunk, "chromium closed the DevTools pipe"
                    self._buffer += chunk
            raw, _, self._buffer = self._buffer.partition(b"\0")
            answer: dict[str, Any] = json.loads(raw)
            if answer.get("id") == self._next_id:  # anything else is an event
                assert "error" not in answer, answer
                return answer["result"]

    def _attach(self, url: str) -> str:
        deadline = time.monotonic() + 30
        while True:
            targets = self._call("Target.getTargets")["targetInfos"]
            pages = [t for t in targets if t["type"] == "page" and t["url"] == url]
            if pages:
                break
            assert time.monotonic() < deadline, f"no page for {url}: {targets}"
            time.sleep(0.05)
        attached = self._call(
            "Target.attachToTarget", {"targetId": pages[0]["targetId"], "flatten": True}
        )
        session: str = attached["sessionId"]
        return session

    def evaluate(self, expression: str) -> Any:
        result = self._call(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}, self._session
        )
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """The value of ``expression`` once it is truthy (evaluated every 0.2 s)."""
        deadline = time.monotonic() + timeout
        while not (value := self.evaluate(expression)):
            assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
            time.sleep(0.2)
        return value

    def screenshot(self, width: int, path: Path) -> None:
        """Lay the page out ``width`` CSS pixels wide (a phone below 600) and save the whole
        page as a PNG at ``path``."""
        metrics = {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": width < 600}
        self._call("Emulation.setDeviceMetricsOverride", metrics, self._session)
        height = self.evaluate("document.documentElement.scrollHeight")
        metrics["height"] = max(900, int(height))
        self._call("Emulation.setDeviceMetricsOverride", metrics, self._session)
        shot = self._call("Page.captureScreenshot", {"format": "png"}, self._session)
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        try:
            self._call("Browser.close")
            self.proc.wait(30)
        finally:
            self._end()

    def _end(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        os.close(self._read)
        os.close(self._write)


class Elements(HTMLParser):
    """Text by element id, script count and data-refreshes of a page."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self.scripts = 0
        self.script_sources: list[str | None] = []
        self.attrs: dict[str, dict[str, str | None]] = {}
        self.by_id: dict[str, dict[str, str | None]] = {}
        self._open: list[str | None] = []
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.scripts += tag == "script"
        if tag == "script":
            self.script_sources.append(dict(attrs).get("src"))
        self.attrs.setdefault(tag, dict(attrs))
        ident = dict(attrs).get("id")
        if ident:
            self.by_id.setdefault(ident, dict(attrs))
        if tag not in ("meta", "br", "img", "input", "link"):
            self._open.append(ident)
        if ident:
            self.text.setdefault(ident, "")

    def handle_endtag(self, tag: str) -> None:
        if tag not in ("meta", "br", "img", "input", "link") and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for ident in self._open:
            if ident:
                self.text[ident] += data


def _runtime_status(step: int) -> dict[str, Any]:
    metrics = RuntimeMetrics()
    d = Division(Step(0), (PartitionRange("in", 0, 0, 30),), StepTime(None, 0))
    metrics.observe_plan(d, {("in", 0): 75}, {("in", 0): 80})
    metrics.step_finished(d, 0.4, records_in=30, records_out=7, dead_letters=2)
    metrics.checkpoint_finished(Version(1), Step(1), 0.2)
    return {
        "state": "running",
        "step": step,
        "workers": 2,
        "layout_epoch": 3,
        "metrics": metrics.snapshot(),
        "layout": {"epoch": 3, "workers": 2, "shards_per_worker": [128, 128]},
    }


def _facts(step: int, **overrides: Any) -> CoordinatorFacts:
    doc: dict[str, Any] = {
        "state": "running",
        "runtime_status": _runtime_status(step),
        "checkpoints": [
            {"version": v, "step": 10 * v, "at": f"2026-11-22T20:0{v}:00Z", "duration_ms": 100 + v}
            for v in range(1, 4)
        ],
        "rescales": [
            {
                "at": "2026-11-22T20:05:00Z",
                "from_workers": 3,
                "workers": 2,
                "layout_epoch": 3,
                "shards_moved": 85,
                "bytes_moved": 4096,
                "pause_ms": 1234,
                "mode": "cold",
                "bytes_precopied": 0,
                "bytes_paused": 4096,
                "rounds": 0,
            }
        ],
        "restarts": 1,
        "pipeline": "demo",
    }
    doc.update(overrides)
    return CoordinatorFacts(**doc)


def test_the_page_shows_the_figures() -> None:
    page = render_dashboard(_facts(42))
    found = Elements(page)
    assert found.text["step"] == "42"
    assert found.text["state"] == "running"
    assert found.text["records-in"] == "30" and found.text["records-out"] == "7"
    assert found.text["layout-epoch"] == "3"
    live = found.text["live"]
    assert "45" in live  # lag: LSO 75 - end 30
    assert "1 (stalled now)" in live  # high watermark 80 above the LSO 75
    assert live.index("2026-11-22T20:03:00Z") < live.index("2026-11-22T20:01:00Z")  # newest first
    assert "3 \u2192 2" in live and "1,234" in live and "4,096" in live  # the rescale
    assert "cold" in live
    assert "128" in live
    # The script and the chart library come from the package, never from the network.
    assert found.script_sources == ["static/uplot/uPlot.iife.min.js", "static/dashboard.js"]
    assert found.by_id["workers"]["value"] == "2"  # rescale to: the current W to start with
    for control in ("pause", "resume", "checkpoint", "rescale", "stop"):
        assert control in found.text


def test_every_static_file_is_package_data() -> None:
    """A non-editable install ships the page's script and the chart library."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    patterns = [p.split("/") for p in project["tool"]["setuptools"]["package-data"]["sparkstep"]]
    package = STATIC_DIR.parents[1]
    files = [f.relative_to(package).parts for f in STATIC_DIR.rglob("*") if f.is_file()]
    assert {"LICENSE", "uPlot.iife.min.js", "dashboard.js"} <= {f[-1] for f in files}
    for parts in files:
        assert any(
            len(pattern) == len(parts) and all(map(fnmatch.fnmatchcase, parts, pattern))
            for pattern in patterns
        ), "/".join(parts)


def test_without_the_runtime_and_without_history() -> None:
    page = render_dashboard(
        _facts(0, state="recovering", runtime_status=None, checkpoints=(), rescales=())
    )
    found = Elements(page)
    assert found.text["step"] == "\u2013"
    live = found.text["live"]
    assert "not reachable" in live
    assert "no checkpoint yet" in live and "no rescale yet" in live
    assert "no input partitions seen yet" in live


def test_everything_from_the_facts_is_escaped() -> None:
    hostile = '<script>alert("x")</script><img src=x onerror=alert(1)>&amp;'
    status = _runtime_status(7)
    status["step"] = hostile
    status["metrics"]["partitions"]["in/0"]["topic"] = hostile
    facts = _facts(
        7,
        state=hostile,
        pipeline=hostile,
        runtime_status=status,
        last_failure={"at": hostile, "reason": hostile},
        checkpoints=[{"version": hostile, "step": 1, "at": hostile, "duration_ms": 3}],
        rescales=[{"at": hostile, "from_workers": hostile, "workers": 1}],
    )
    page = render_dashboard(facts)
    found = Elements(page)
    assert found.script_sources == ["static/uplot/uPlot.iife.min.js", "static/dashboard.js"]
    assert "img" not in found.attrs
    assert found.text["step"] == hostile  # shown as text, exactly
    assert (found.by_id["state"].get("class") or "").startswith("state state-")
    assert hostile not in page and "<script>alert" not in page


class ChangingFacts:
    """A dashboard whose step is the number of requests so far; after ``fail_after`` requests
    it answers 503 (a coordinator going away)."""

    def __init__(self, fail_after: int | None = None) -> None:
        self.requests = 0
        self.fail_after = fail_after
        self.lock = threading.Lock()
        self.app = FastAPI()
        self.app.get("/", response_class=HTMLResponse)(self.page)
        self.app.mount("/static", StaticFiles(directory=STATIC_DIR))

    def page(self) -> Response:
        with self.lock:
            self.requests += 1
            n = self.requests
        if self.fail_after is not None and n > self.fail_after:
            return Response("gone", status_code=503)
        return HTMLResponse(render_dashboard(_facts(n)))


@pytest.fixture
def changing() -> Iterator[tuple[ChangingFacts, str]]:
    facts = ChangingFacts(fail_after=4)
    with serving(facts.app) as address:
        yield facts, f"http://{address}/"


def test_the_script_keeps_the_step_live_in_chromium(
    chromium: str, changing: tuple[ChangingFacts, str], tmp_path: Path
) -> None:
    facts, url = changing
    dom = dump_dom(chromium, url, tmp_path / "profile", budget_ms=8000)
    found = Elements(dom)
    # Request 1 was the page itself; the script fetched 2, 3 and 4 and put each in place; the
    # later ones failed, so the page keeps step 4 and says it cannot reach the coordinator.
    assert found.text["step"] == "4"
    assert found.attrs["body"]["data-refreshes"] == "3"
    assert "coordinator not reachable" in found.text["conn"]
    assert facts.requests > 4


def test_the_step_advances_in_real_time(chromium: str, tmp_path: Path) -> None:
    facts = ChangingFacts()
    with serving(facts.app) as address:
        url = f"http://{address}/"
        browser = Browser(chromium, url, tmp_path / "profile")
        try:
            deadline = time.monotonic() + 60
            first = None
            while first is None:
                first = browser.evaluate("document.getElementById('step')?.textContent")
                assert time.monotonic() < deadline, "the page never showed a step"
                time.sleep(0.05)
            while (now := browser.evaluate("document.getElementById('step').textContent")) == first:
                assert time.monotonic() < deadline, f"the step stayed at {first}"
                time.sleep(0.1)
            assert int(now) > int(first)
            assert int(browser.evaluate("document.body.dataset.refreshes")) >= 1
        finally:
            browser.close()


TOKEN = "dashboard-token"

#: Where the screenshots are kept after the run: ``$SPARKSTEP_TEST_ARTIFACTS``, by default
#: ``test-artifacts/`` in the checkout (ignored by git); each run replaces the last one's.
ARTIFACTS = Path(
    os.environ.get("SPARKSTEP_TEST_ARTIFACTS") or Path(__file__).parents[2] / "test-artifacts"
)


def _click(browser: Browser, ident: str) -> None:
    browser.evaluate(f"document.getElementById({json.dumps(ident)}).click()")


def _press(browser: Browser, control: str, confirm: bool) -> dict[str, Any]:
    """Press a control of the page (and Yes when it asks); the answer it shows."""
    browser.evaluate("document.getElementById('answer').dataset.action = ''")
    _click(browser, control)
    if confirm:
        question = browser.wait_for(
            "!document.getElementById('confirm').hidden && "
            "document.getElementById('confirm-text').textContent",
            30,
            f"the page to ask before {control}",
        )
        assert "?" in question
        _click(browser, "confirm-yes")
    else:
        assert browser.evaluate("document.getElementById('confirm').hidden")
    shown: dict[str, Any] = browser.wait_for(
        f"(function () {{ var a = document.getElementById('answer');"
        f" return a.dataset.action === {json.dumps(control)} && a.dataset.status !== ''"
        f" && {{status: a.dataset.status, text: a.textContent, kind: a.className}}; }})()",
        300,
        f"the answer to {control}",
    )
    assert shown["status"] == "200" and shown["kind"] == "ok", shown
    return shown


def _fits(browser: Browser) -> bool:
    """No horizontal scrolling of the whole page."""
    return bool(
        browser.evaluate(
            "document.documentElement.scrollWidth <= document.documentElement.clientWidth"
        )
    )


def test_the_coordinators_dashboard_charts_and_controls(
    chromium: str, bootstrap_servers: str, topic_factory, unique_name: str, tmp_path: Path
) -> None:
    source = topic_factory("dashboard-in", partitions=1)
    sink = topic_factory("dashboard-out", partitions=1)
    produce_keyed(bootstrap_servers, source, 40, keys=10, seed=11)
    feeding = threading.Event()
    artifacts = ARTIFACTS / "dashboard"
    artifacts.mkdir(parents=True, exist_ok=True)
    print(f"dashboard screenshots in {artifacts}")

    def feed() -> None:  # more input while the test runs, so the step keeps advancing
        for seed in range(12, 10_000):
            if feeding.wait(0.25):
                return
            produce_keyed(bootstrap_servers, source, 4, keys=10, seed=seed)

    feeder = threading.Thread(target=feed, name="feed", daemon=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARKSTEP_")}
    coordinator = CoordinatorProcess(
        [
            "--pipeline=sparkstep.examples.keyed_sum:pipeline",
            f"--bootstrap-servers={bootstrap_servers}",
            f"--state-dir={tmp_path / 'state'}",
            "--workers=1",
            "--api-port=0",
            f"--name={unique_name}",
            f"--input-topic={source}",
            f"--output-topic={sink}",
            "--max-records-per-step=4",
            "--checkpoint-interval=0",
            "--restart-strategy=none",
        ],
        tmp_path / "coordinator.log",
        env={**env, "SPARKSTEP_API_TOKEN": TOKEN},
    )
    browser: Browser | None = None
    feeder.start()
    try:
        coordinator.start()
        url = f"{coordinator.url}/"
        api = httpx.Client(base_url=url, timeout=60, headers={"authorization": f"Bearer {TOKEN}"})

        def status() -> dict[str, Any]:
            doc: dict[str, Any] = api.get("api/v1/status").json()
            assert doc["state"] != "failed", f"{doc}\n{coordinator.tail()}"
            return doc

        wait_until(lambda: status()["state"] == "running", 300, "running")
        wait_until(lambda: (status()["step"] or 0) > 0, 300, "the first step")
        # The page as served, after the script ran for a few (virtual) seconds: a step shows
        # (a dash while the coordinator cannot read the runtime's status, e.g. under load).
        deadline = time.monotonic() + 120
        while True:
            found = Elements(dump_dom(chromium, url, tmp_path / "dump", budget_ms=3000))
            if found.text["step"].isdigit():
                break
            assert time.monotonic() < deadline, f"no step on the page: {found.text}"
        assert found.text["state"] in ("running", "recovering"), found.text["state"]

        # In real time: the number on the page advances while the pipeline runs.
        browser = Browser(chromium, url, tmp_path / "profile")

        def shown() -> int | None:
            assert browser is not None
            text = browser.evaluate("document.getElementById('step')?.textContent")
            return int(text) if isinstance(text, str) and text.isdigit() else None

        while (first := shown()) is None:
            assert time.monotonic() < deadline, "the page never showed a step"
            time.sleep(0.1)
        while (now := shown()) is None or now <= first:
            assert time.monotonic() < deadline, f"the step stayed at {first}"
            time.sleep(0.2)

        # The history needs the token: the page asks for it once, keeps it for the tab only.
        browser.wait_for(
            "!document.getElementById('token-form').hidden", 60, "the page to ask for the token"
        )
        browser.evaluate(f"document.getElementById('token').value = {json.dumps(TOKEN)}")
        _click(browser, "token-use")
        assert browser.evaluate("sessionStorage.getItem('sparkstep-api-token')") == TOKEN
        assert TOKEN not in browser.evaluate("window.location.href")
        assert browser.evaluate("document.getElementById('token').value") == ""
        token_form_gone = "getComputedStyle(document.getElementById('token-form')).display"
        assert browser.evaluate(token_form_gone) == "none"

        # The charts fill from GET /api/v1/history: rates and latency need two samples.
        for chart in ("rates", "latency", "lag"):
            browser.wait_for(
                f"Number(document.getElementById('chart-{chart}').dataset.points) > 0"
                f" && document.querySelector('#chart-{chart} canvas') !== null",
                300,
                f"points on the {chart} chart",
            )
        assert browser.evaluate("document.getElementById('history-note').textContent") == ""

        # Controls: pause (asks first), the state through the REST API, checkpoint, rescale.
        paused = _press(browser, "pause", confirm=True)
        assert '"paused"' in paused["text"]
        assert status()["state"] == "paused"
        checkpointed = _press(browser, "checkpoint", confirm=False)
        version = json.loads(checkpointed["text"].partition(": ")[2])["version"]
        listed = api.get("api/v1/checkpoints").json()["checkpoints"]
        assert listed[-1]["version"] == version
        browser.evaluate("document.getElementById('workers').value = '2'")
        rescaled = _press(browser, "rescale", confirm=True)
        assert json.loads(rescaled["text"].partition(": ")[2])["workers"] == 2
        doc = status()
        assert (doc["state"], doc["workers"]) == ("paused", 2)
        _press(browser, "resume", confirm=False)
        assert status()["state"] == "running"
        # The checkpoint's duration is a point; the rescale is in the page's history table.
        browser.wait_for(
            "Number(document.getElementById('chart-checkpoints').dataset.points) > 0",
            60,
            "the checkpoint on its chart",
        )
        browser.wait_for(
            # The row's cells run together in textContent: workers, then the mode.
            "document.getElementById('live').textContent.includes('1 \\u2192 2hot')",
            60,
            "the rescale in the rescales table",
        )
        kinds = [e["kind"] for e in api.get("api/v1/history").json()["events"]]
        assert "rescale" in kinds and "checkpoint" in kinds
        assert browser.evaluate(token_form_gone) == "none"  # asked once, for the whole tab

        # Both widths: nothing wider than the screen; the screenshots are kept, not compared.
        for width in (1280, 390):
            browser.screenshot(width, artifacts / f"dashboard-{width}.png")
            browser.wait_for(
                f"document.documentElement.clientWidth === {width}", 30, f"{width} px wide"
            )
            assert _fits(browser), (
                width,
                browser.evaluate("document.documentElement.scrollWidth"),
            )
            assert (artifacts / f"dashboard-{width}.png").stat().st_size > 0

        # The same facts as Prometheus text, through the real chain (runtime metrics, the
        # runtime's /status, the coordinator's /metrics).
        while True:
            answer = api.get("metrics")
            assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
            families = parse(answer.text)
            if families["sparkstep_runtime_up"].value() == 1:
                break
            assert time.monotonic() < deadline + 300, "the coordinator never read the runtime"
        assert families["sparkstep_steps_total"].value() > 0
        assert families["sparkstep_records_in_total"].value() > 0
        assert families["sparkstep_input_end_offset"].value(topic=source, partition="0") > 0
        assert (
            families["sparkstep_layout_shards"].value(worker="0") == keyed_sum.pipeline.shards / 2
        )

        # Stop from the page too: a final checkpoint, then the coordinator exits.
        stopped = _press(browser, "stop", confirm=True)
        assert '"stopped"' in stopped["text"]
        assert coordinator.wait(120) == 0, coordinator.tail()
        api.close()
    finally:
        feeding.set()
        feeder.join(60)
        if browser is not None:
            browser.close()
        if coordinator.proc is not None:
            coordinator.kill()  # nothing left after a stop; else its children die with it
