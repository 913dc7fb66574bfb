"""Fuzz the REST API from its own OpenAPI document with schemathesis, over HTTP, against the
real app served by a real uvicorn over a real supervisor, with the token set.

Every generated request (valid and invalid bodies for every operation, with and without the
token) must get: no 5xx but the documented 503, a status code the document declares for the
operation, and a body in the declared schema (for errors, ``{"detail": "<one line>"}``); an
unauthenticated request must get 401 whatever else is wrong with it.

What runs behind the API: the supervisor has checked the pipeline but started nothing, so the
runtime is absent, as during every recovery (state ``recovering``). That is deliberate. The
fuzzer's subject is the HTTP surface (authentication, parsing, validation, routing, the error
shape), which is the same code whatever the runtime does; against a live pipeline, generated
requests would really stop it (after which every answer is the same 503, so the rest of the
run tests nothing) and really rescale it to up to 256 workers on this machine. The answers a
live pipeline gives (200 for each procedure, 409 during a procedure, 422 for more workers than
S) are asserted exactly by ``test_rest_live.py``, over a real pipeline.

Bounded by default (:data:`EXAMPLES` per generation mode); ``--long`` runs
:data:`LONG_EXAMPLES`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from sparkstep.coordinator_api.app import coordinator_app
from sparkstep.coordinator_api.settings import CoordinatorSettings
from sparkstep.coordinator_api.supervisor import Supervisor
from tests.serving import serving

TOKEN = "fuzz-token"
# Per generation mode, shared out evenly among the 10 operations.
EXAMPLES = 250
LONG_EXAMPLES = 3000
# schemathesis' not_a_server_error would count the documented 503 (no runtime) as a failure;
# the test asserts "no 5xx but 503" itself.
CHECKS = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of the coordinator's app over a checked, not started supervisor."""
    state_dir = tmp_path_factory.mktemp("fuzz-state")
    supervisor = Supervisor(
        CoordinatorSettings.model_validate(
            {
                "pipeline": "sparkstep.examples.keyed_sum:pipeline",
                "bootstrap_servers": "127.0.0.1:9",
                "state_dir": state_dir,
                "workers": 2,
            }
        ),
        {},
    )
    supervisor.check()
    app = coordinator_app(supervisor, TOKEN, auth_metrics_and_dashboard=True)
    with serving(app) as address:
        yield f"http://{address}"


@pytest.mark.parametrize(
    "mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
)
def test_fuzzed_requests_get_documented_answers(
    api: str, mode: schemathesis.GenerationMode, long_run: bool
) -> None:
    """Each operation gets its share of the examples, so every run reaches all ten (one
    strategy over all operations left one unreached in about one run of twenty)."""
    schema = schemathesis.openapi.from_url(f"{api}/openapi.json")
    results = list(schema.get_all_operations())
    operations = [result.ok() for result in results if isinstance(result, Ok)]
    assert len(operations) == len(results) == 10, results
    seen: dict[tuple[str, int], int] = {}

    def fuzz_operation(operation: Any) -> None:
        @settings(
            max_examples=(LONG_EXAMPLES if long_run else EXAMPLES) // len(operations),
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        )
        @given(case=operation.as_strategy(generation_mode=mode), with_token=st.booleans())
        def fuzz(case: schemathesis.Case[Any], with_token: bool) -> None:
            headers = {"authorization": f"Bearer {TOKEN}"} if with_token else {}
            response = case.call(headers=headers, timeout=60)
            assert response.status_code < 500 or response.status_code == 503, (
                case.method,
                case.path,
                response.status_code,
                response.text,
            )
            case.validate_response(response, checks=CHECKS, headers=headers)
            if not with_token:
                assert response.status_code == 401, (case.method, case.path, response.text)
            key = (f"{case.method} {case.path}", response.status_code)
            seen[key] = seen.get(key, 0) + 1

        fuzz()

    for operation in operations:
        fuzz_operation(operation)
    # The run reached every operation, and both sides of the token check: 401 without the
    # token, another answer with it (a negative run may never reach the 503 of a valid
    # request: every authenticated case can be refused with 422 first).
    reached = {label for label, _code in seen}
    assert len(reached) == 10, (sorted(reached), seen)
    codes = {code for _label, code in seen}
    assert 401 in codes and codes - {401}, seen


def test_the_document_is_public_and_declares_the_token(api: str) -> None:
    schema = schemathesis.openapi.from_url(f"{api}/openapi.json")
    raw = schema.raw_schema
    assert raw["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "SPARKSTEP_API_TOKEN",
    }
