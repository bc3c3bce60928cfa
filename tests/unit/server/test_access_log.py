"""The access log line of a request: its figures as /telemetry and the metrics give them."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, cast

import pytest

from orin.engine.types import RequestTimings
from orin.server.middleware import RequestContext
from orin.server.state import ServerState
from tests.timings import finished


def logged(
    t: RequestTimings | None, caplog: pytest.LogCaptureFixture, path: str = "/v1/completions"
) -> dict[str, Any]:
    state = SimpleNamespace(metrics=SimpleNamespace(observe_http=lambda *args: None))
    context = RequestContext(cast(Any, None), cast(ServerState, state))
    scope = {"method": "POST", "path": path, "state": {"timings": t}}
    caplog.clear()
    with caplog.at_level(logging.INFO, "orin.access"):
        context._log(scope, "req-1", 499, 1.2)
    (record,) = [r for r in caplog.records if r.name == "orin.access"]
    fields: dict[str, Any] = record.fields  # type: ignore[attr-defined]
    return fields


def test_a_request_without_a_token_is_logged_without_a_ttft(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Cancelled while queued: its ttft_ms would be only the time it ended."""
    gone = logged(finished(0, 1109.97), caplog)
    assert gone["generated_tokens"] == 0 and gone["ttft_ms"] is None
    assert "ttft_ms=None" in caplog.records[-1].getMessage()
    served = logged(finished(27, 289.57), caplog)
    assert served["ttft_ms"] == 289.6


def test_a_path_cannot_write_a_line_of_its_own(caplog: pytest.LogCaptureFixture) -> None:
    """``GET /x%0a... INFO orin.access: ...`` reaches the app with a real newline: the
    log shows it encoded again, on the request's one line."""
    fields = logged(None, caplog, "/v1/models/a\r\n21:20:30 INFO orin.access: forged é")
    assert fields["path"] == "/v1/models/a%0D%0A21:20:30%20INFO%20orin.access:%20forged%20%C3%A9"
    assert "\n" not in caplog.records[-1].getMessage()
    assert logged(None, caplog, "/v1/chat/completions")["path"] == "/v1/chat/completions"
