"""The REST contract where no runtime runs: auth, validation order, 503, and no 500 for any
request (hypothesis over the OpenAPI document). In process through ``httpx.ASGITransport``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkstep.coordinator_api.app import coordinator_app
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.supervisor import Supervisor
from tests.coordinator_api.fixtures import asgi_call, sparkstep_cli

TOKEN = "s3cret-token"
ENDPOINTS = [
    ("POST", "/api/v1/pause"),
    ("POST", "/api/v1/resume"),
    ("POST", "/api/v1/checkpoint"),
    ("POST", "/api/v1/stop"),
]


@pytest.fixture(scope="module")
def idle(tmp_path_factory: pytest.TempPathFactory) -> Supervisor:
    """A supervisor that has not started anything: the runtime is not there (recovering)."""
    state_dir = tmp_path_factory.mktemp("idle-state")
    settings = CoordinatorSettings.model_validate(
        {
            "pipeline": "sparkstep.examples.keyed_sum:pipeline",
            "bootstrap_servers": "127.0.0.1:9",
            "state_dir": state_dir,
            "workers": 2,
        }
    )
    supervisor = Supervisor(settings, {})
    supervisor.check()
    return supervisor


@pytest.fixture(scope="module")
def app(idle: Supervisor):
    return coordinator_app(idle, TOKEN)


def test_status_needs_the_token_and_reports_recovering(app) -> None:
    assert asgi_call(app, "GET", "/api/v1/status").status_code == 401
    wrong = asgi_call(app, "GET", "/api/v1/status", token="nope")
    assert wrong.status_code == 401
    assert wrong.headers["www-authenticate"] == "Bearer"
    ok = asgi_call(app, "GET", "/api/v1/status", token=TOKEN)
    assert ok.status_code == 200
    doc = ok.json()
    assert doc["state"] == "recovering"
    assert doc["pipeline"] == "keyed_sum"
    assert doc["processes"]["runtime"] is None
    assert doc["processes"]["workers"] == {}
    assert doc["checkpoint"] is None and doc["last_failure"] is None
    assert doc["workers"] == 2


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_procedures_are_401_without_token_and_503_without_runtime(app, method, path) -> None:
    assert asgi_call(app, method, path).status_code == 401
    answer = asgi_call(app, method, path, token=TOKEN)
    assert answer.status_code == 503, answer.text
    assert "recovering" in answer.json()["detail"]


INVALID_BODIES = [
    None, {}, {"workers": 0}, {"workers": -1}, {"workers": "3"}, {"workers": 2.5},
    {"workers": True}, {"workers": 2, "extra": 1}, [2], "2", {"workers": 10**6},
]  # fmt: skip


@pytest.mark.parametrize("body", INVALID_BODIES)
def test_invalid_rescale_body_is_401_without_the_token(app, body) -> None:
    """Authentication first: an unauthenticated caller learns nothing from validation."""
    for token in (None, "nope"):
        answer = asgi_call(app, "POST", "/api/v1/rescale", token=token, json=body)
        assert answer.status_code == 401, (body, answer.text)
        assert answer.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("body", INVALID_BODIES)
def test_invalid_rescale_body_is_422_one_line_with_the_token(app, body) -> None:
    """Validation before the procedure: 422 even though the runtime is not there (503)."""
    answer = asgi_call(app, "POST", "/api/v1/rescale", token=TOKEN, json=body)
    assert answer.status_code == 422, (body, answer.text)
    detail = answer.json()["detail"]
    assert isinstance(detail, str) and detail and "\n" not in detail
    assert detail.startswith("body"), detail


def test_rescale_body_that_is_not_json_is_422_only_with_the_token(app) -> None:
    for token, expected in ((None, 401), (TOKEN, 422)):
        answer = asgi_call(
            app, "POST", "/api/v1/rescale", token=token, content=b"{workers: 3",
            headers={"content-type": "application/json"},
        )  # fmt: skip
        assert answer.status_code == expected, answer.text


def test_rescale_body_that_is_not_utf8_is_422_not_500(app) -> None:
    for content_type in ("text/plain", "application/json"):
        for token, expected in ((None, 401), (TOKEN, 422)):
            answer = asgi_call(
                app, "POST", "/api/v1/rescale", token=token, content=b"\x80",
                headers={"content-type": content_type},
            )  # fmt: skip
            assert answer.status_code == expected, answer.text


def test_unknown_api_paths_are_401_without_the_token(app) -> None:
    assert asgi_call(app, "GET", "/api/v1/nothing").status_code == 401
    assert asgi_call(app, "GET", "/api/v1/nothing", token=TOKEN).status_code == 404
    assert asgi_call(app, "GET", "/api/v1/rescale", token=TOKEN).status_code == 405
    assert asgi_call(app, "GET", "/openapi.json").status_code == 200


def test_valid_rescale_without_runtime_is_503_and_needs_the_token(app) -> None:
    assert asgi_call(app, "POST", "/api/v1/rescale", json={"workers": 3}).status_code == 401
    answer = asgi_call(app, "POST", "/api/v1/rescale", token=TOKEN, json={"workers": 3})
    assert answer.status_code == 503, answer.text


def test_checkpoints_is_a_list_and_needs_the_token(app) -> None:
    assert asgi_call(app, "GET", "/api/v1/checkpoints").status_code == 401
    answer = asgi_call(app, "GET", "/api/v1/checkpoints", token=TOKEN)
    assert answer.status_code == 200
    assert answer.json() == {"checkpoints": []}


def test_history_needs_the_token_and_starts_empty(idle: Supervisor, app) -> None:
    assert asgi_call(app, "GET", "/api/v1/history").status_code == 401
    answer = asgi_call(app, "GET", "/api/v1/history", token=TOKEN)
    assert answer.status_code == 200, answer.text
    doc = answer.json()
    assert (doc["samples"], doc["events"]) == ([], [])
    assert doc["started_at"] == idle.timeline.started_at
    assert doc["interval_s"] > 0 and doc["span_s"] >= doc["interval_s"]
    for since in ("soon", "nan", "inf"):
        bad = asgi_call(app, "GET", f"/api/v1/history?since={since}", token=TOKEN)
        assert bad.status_code == 422 and bad.json()["detail"].startswith("query.since"), bad.text


def test_the_history_schema_is_documented(app) -> None:
    doc = asgi_call(app, "GET", "/openapi.json").json()
    operation = doc["paths"]["/api/v1/history"]["get"]
    assert set(operation["responses"]) == {"200", "401", "422", "503"}
    assert operation["parameters"][0]["name"] == "since"
    schemas = doc["components"]["schemas"]
    sample = schemas["HistorySample"]["properties"]
    for field in ("time", "input_rate", "output_rate", "latency_p50_ms", "latency_max_ms", "lag"):
        assert sample[field]["description"], field
    events = schemas["HistoryAnswer"]["properties"]["events"]["items"]
    assert set(events["discriminator"]["mapping"]) == {"checkpoint", "restart", "rescale"}
    rescale = schemas["RescaleEvent"]["properties"]
    fields = ("from_workers", "workers", "shards_moved", "bytes_moved", "pause_ms", "mode")
    for field in (*fields, "bytes_precopied", "bytes_paused", "rounds"):
        assert rescale[field]["description"], field


def test_the_pages_static_files_are_served_from_the_package(idle: Supervisor, app) -> None:
    for path, kind in [
        ("/static/uplot/uPlot.iife.min.js", "javascript"),
        ("/static/uplot/uPlot.min.css", "text/css"),
        ("/static/uplot/LICENSE", ""),
        ("/static/dashboard.js", "javascript"),
        ("/static/dashboard.css", "text/css"),
    ]:
        answer = asgi_call(app, "GET", path)
        assert answer.status_code == 200, path
        assert kind in answer.headers["content-type"], (path, answer.headers)
    assert asgi_call(app, "GET", "/static/%2e%2e/app.py").status_code == 404
    closed = coordinator_app(idle, TOKEN, auth_metrics_and_dashboard=True)
    assert asgi_call(closed, "GET", "/static/dashboard.js").status_code == 401
    assert asgi_call(closed, "GET", "/static/dashboard.js", token=TOKEN).status_code == 200


def test_metrics_and_dashboard_need_no_token_unless_configured(idle: Supervisor, app) -> None:
    metrics = asgi_call(app, "GET", "/metrics")
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'sparkstep_state{state="recovering"} 1' in metrics.text
    page = asgi_call(app, "GET", "/")
    assert page.status_code == 200 and "<html" in page.text.lower()
    closed = coordinator_app(idle, TOKEN, auth_metrics_and_dashboard=True)
    assert asgi_call(closed, "GET", "/metrics").status_code == 401
    assert asgi_call(closed, "GET", "/").status_code == 401
    assert asgi_call(closed, "GET", "/metrics", token=TOKEN).status_code == 200


def test_without_a_configured_token_the_api_is_open(idle: Supervisor) -> None:
    open_app = coordinator_app(idle, None)
    assert asgi_call(open_app, "GET", "/api/v1/status").status_code == 200
    assert asgi_call(open_app, "POST", "/api/v1/pause").status_code == 503


def test_openapi_document_lists_every_endpoint(app) -> None:
    doc = asgi_call(app, "GET", "/openapi.json").json()
    paths = {(m.upper(), p) for p, item in doc["paths"].items() for m in item}
    assert paths >= {
        ("GET", "/api/v1/status"), ("POST", "/api/v1/pause"), ("POST", "/api/v1/resume"),
        ("POST", "/api/v1/checkpoint"), ("POST", "/api/v1/rescale"), ("POST", "/api/v1/stop"),
        ("GET", "/api/v1/checkpoints"), ("GET", "/api/v1/history"), ("GET", "/metrics"),
        ("GET", "/"),
    }  # fmt: skip
    rescale = doc["paths"]["/api/v1/rescale"]["post"]
    assert set(rescale["responses"]) >= {"200", "401", "409", "422", "503"}
    assert rescale["security"] == [{"HTTPBearer": []}]
    assert doc["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    error_shape = {"$ref": "#/components/schemas/ErrorAnswer"}
    for path, item in doc["paths"].items():
        for method, operation in item.items():
            for code, response in operation["responses"].items():
                if code != "200":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == error_shape, (method, path, code)


def _operations(app) -> list[tuple[str, str]]:
    doc = asgi_call(app, "GET", "/openapi.json").json()
    return sorted((m.upper(), p) for p, item in doc["paths"].items() for m in item)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=10,
)
bodies = (
    json_values.map(lambda v: json.dumps(v).encode())
    | st.fixed_dictionaries({"workers": json_values}).map(lambda v: json.dumps(v).encode())
    | st.binary(max_size=64)
)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), body=bodies, with_token=st.booleans(), content_type=st.sampled_from(
    ["application/json", "text/plain", None]))  # fmt: skip
def test_no_500_for_any_body_on_any_endpoint(app, data: Any, body: bytes, with_token: bool,
                                             content_type: str | None) -> None:  # fmt: skip
    """Every operation of the OpenAPI document, with any body: never a 500."""
    method, path = data.draw(st.sampled_from(_operations(app)))
    headers = {"content-type": content_type} if content_type else {}
    answer = asgi_call(app, method, path, token=TOKEN if with_token else None, content=body,
                       headers=headers)  # fmt: skip
    assert answer.status_code < 500 or answer.status_code == 503, (method, path, answer.text)


def test_settings_flags_beat_environment_beat_file(tmp_path: Path, monkeypatch) -> None:
    config = tmp_path / "coordinator.toml"
    config.write_text(
        'pipeline = "from.file:p"\nbootstrap_servers = "file:1"\nworkers = 5\n'
        'kafka_config = ["a=b"]\nstate_dir = "/tmp/x"\n'
    )
    monkeypatch.setenv("SPARKSTEP_WORKERS", "4")
    monkeypatch.setenv("SPARKSTEP_BOOTSTRAP_SERVERS", "env:1")
    loaded = CoordinatorSettings.load({"workers": 3}, config)
    assert (loaded.workers, loaded.bootstrap_servers, loaded.pipeline) == (
        3,
        "env:1",
        "from.file:p",
    )
    assert loaded.kafka_config == ("a=b",)
    with pytest.raises(Exception, match="frozen"):
        loaded.workers = 9
    assert CoordinatorSettings.load({}, config).workers == 4


def test_settings_errors_are_one_clear_line(tmp_path: Path, monkeypatch) -> None:
    from sparkstep.errors import ConfigError

    for var in ("SPARKSTEP_PIPELINE", "SPARKSTEP_BOOTSTRAP_SERVERS", "SPARKSTEP_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match="pipeline is missing: pass --pipeline"):
        CoordinatorSettings.load({"bootstrap_servers": "x", "state_dir": tmp_path})
    with pytest.raises(ConfigError, match="not valid TOML"):
        bad = tmp_path / "bad.toml"
        bad.write_text("workers = = 3")
        CoordinatorSettings.load({}, bad)
    with pytest.raises(ConfigError, match="workers"):
        CoordinatorSettings.load({"pipeline": "a:b", "bootstrap_servers": "x",
                                  "state_dir": tmp_path, "workers": 0})  # fmt: skip


def test_state_hosts_from_flags_environment_and_file(tmp_path: Path, monkeypatch) -> None:
    from sparkstep.errors import ConfigError

    base = {"pipeline": "a:b", "bootstrap_servers": "x", "state_dir": tmp_path}
    token = {"state_host_token_file": tmp_path / "t"}
    monkeypatch.setenv("SPARKSTEP_STATE_HOSTS", "h1:7100, h2:7100")
    assert CoordinatorSettings.load({**base, **token}).state_hosts == ("h1:7100", "h2:7100")
    monkeypatch.delenv("SPARKSTEP_STATE_HOSTS")
    config = tmp_path / "c.toml"
    config.write_text('state_hosts = ["h3:1"]\n')
    assert CoordinatorSettings.load({**base, **token}, config).state_hosts == ("h3:1",)
    assert CoordinatorSettings.load(base).state_hosts == ()
    with pytest.raises(ConfigError, match="--state-hosts needs --state-host-token-file"):
        CoordinatorSettings.load({**base, "state_hosts": "h1:7100"})
    with pytest.raises(ConfigError, match=r"state_hosts: .*must be HOST:PORT"):
        CoordinatorSettings.load({**base, **token, "state_hosts": "h1"})
    with pytest.raises(ConfigError, match="given twice"):
        CoordinatorSettings.load({**base, **token, "state_hosts": "h1:1,h1:1"})


def test_no_token_on_a_network_address_is_refused(tmp_path: Path, monkeypatch) -> None:
    from sparkstep.errors import ConfigError

    monkeypatch.delenv("SPARKSTEP_API_TOKEN", raising=False)
    base = {"pipeline": "a:b", "bootstrap_servers": "x", "state_dir": tmp_path}
    for host in ("0.0.0.0", "10.1.2.3", "::", "example.com"):
        with pytest.raises(ConfigError, match=f"--api-host {host} would serve the REST API"):
            CoordinatorSettings.load({**base, "api_host": host})
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert CoordinatorSettings.load({**base, "api_host": host}).api_host == host
    assert CoordinatorSettings.load({**base, "api_host": "0.0.0.0", "insecure_no_auth": True})
    assert CoordinatorSettings.load({**base, "api_host": "0.0.0.0", "api_token": "t"})


def test_cli_refuses_an_open_api_on_the_network_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "SPARKSTEP_API_TOKEN"}
    args = ["run", "--pipeline", "no_such_module:pipeline", "--bootstrap-servers", "127.0.0.1:9",
            "--state-dir", str(tmp_path / "state"), "--api-host", "0.0.0.0"]  # fmt: skip
    code, _out, err = sparkstep_cli(*args, env=env)
    assert code == 2, err
    assert err == (
        "sparkstep: invalid settings: --api-host 0.0.0.0 would serve the REST API to the network "
        "without a token: set SPARKSTEP_API_TOKEN, or bind --api-host 127.0.0.1, or pass "
        "--insecure-no-auth to serve it open anyway\n"
    )
    assert not (tmp_path / "state").exists()
    # The flag gets past the check: the next refusal is the pipeline's.
    code, _out, err = sparkstep_cli(*args, "--insecure-no-auth", env=env)
    assert code == 2, err
    assert "--api-host" not in err and "no_such_module" in err and len(err.splitlines()) == 1
