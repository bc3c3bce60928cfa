"""Generated requests from the server's own OpenAPI schema: never a 5xx, never a dead server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from orin.model import demo
from tests.serverutil import live_server

pytestmark = pytest.mark.reliability

PROFILE = """
engine: {n_ctx: 256, slots: 4, n_batch: 64, n_ubatch: 64}
server: {max_tokens_limit: 4, max_queue: 64}
"""
EXAMPLES = 1000  # per endpoint


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with live_server(demo.ensure("tiny", "f16"), PROFILE) as (url, _):
        yield url


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_generated_requests_never_get_a_5xx(base: str, path: str) -> None:
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    operation = schema[path]["POST"]
    statuses: dict[int, int] = {}

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def call(case: Any) -> None:
        response = case.call(base_url=base, timeout=60)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.body, response.text)

    call()
    assert sum(statuses.values()) >= EXAMPLES, statuses
    assert 200 in statuses and 400 in statuses  # both valid and invalid bodies were generated
    assert httpx.get(f"{base}/health", timeout=10).json()["status"] == "ok"
