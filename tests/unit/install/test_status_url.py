"""status --url reads a server started with serve; install's wait reports its progress."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from orin.cli.deps import Deps
from orin.install import probe
from orin.install.probe import HttpResult
from tests.fakes.runner import FakeRunner

METRICS = """\
# TYPE orin_llm_time_to_first_token_seconds histogram
orin_llm_time_to_first_token_seconds_bucket{le="0.1"} 2.0
orin_llm_time_to_first_token_seconds_bucket{le="+Inf"} 2.0
orin_llm_time_to_first_token_seconds_count 2.0
orin_llm_time_to_first_token_seconds_sum 0.1
"""


def serving(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
    if url == "http://127.0.0.1:8080/health":
        return HttpResult(200, '{"status": "ok"}')
    if url == "http://127.0.0.1:8080/v1/models":
        return HttpResult(200, '{"object": "list", "data": [{"id": "smollm2-135m-instruct"}]}')
    if url == "http://127.0.0.1:8080/metrics":
        return HttpResult(200, METRICS)
    return HttpResult(None, error="connection refused")


def invoke(get: probe.HttpGet, *args: str) -> tuple[int, str, str]:
    deps = Deps(runner=FakeRunner(), http_get=get)
    r = CliRunner().invoke(app, ["status", *args], env={"COLUMNS": "200"}, obj=deps)
    return r.exit_code, r.stdout, r.stderr


def test_status_url_reads_health_and_models(tmp_path: Path) -> None:
    code, out, err = invoke(serving, "--url", "http://127.0.0.1:8080/", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["units"] == [] and data["healthy"] is True
    assert data["models"] == ["smollm2-135m-instruct"]
    assert data["latency"]["ttft"]["count"] == 2
    code, out, _ = invoke(serving, "--url", "http://127.0.0.1:8080")
    assert code == 0
    assert "health: http://127.0.0.1:8080/health -> 200" in out
    assert "models: smollm2-135m-instruct" in out and "unit" not in out


@pytest.mark.parametrize("data", ["5", '{"id": "x"}', '"x"', "null"])
def test_a_models_list_that_is_not_openais_names_no_models(data: str) -> None:
    """A server whose /v1/models has no list under "data" (a number, an object, text)
    is reported without models, not as an internal error."""

    def get(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
        if url.endswith("/v1/models"):
            return HttpResult(200, f'{{"object": "list", "data": {data}}}')
        return serving(url, timeout, headers)

    code, out, err = invoke(get, "--url", "http://127.0.0.1:8080", "--json")
    assert code == 0, err
    assert json.loads(out)["models"] == []


def test_status_url_with_nothing_listening() -> None:
    code, out, err = invoke(serving, "--url", "http://127.0.0.1:9")
    assert code == 1 and out == ""
    assert err == "orin-llm: nothing answers at http://127.0.0.1:9: connection refused\n"
    code, out, _ = invoke(serving, "--url", "http://127.0.0.1:9", "--json")
    data = json.loads(out)
    assert (
        code == 1 and data["error"] == "nothing answers at http://127.0.0.1:9: connection refused"
    )


def test_a_refused_connection_reads_as_words() -> None:
    import socket

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = probe.http_get(f"http://127.0.0.1:{port}/health", 3.0)
    assert res.status is None and res.error == "connection refused"  # not '[Errno 111] ...'


def test_wait_reports_each_unhealthy_answer() -> None:
    answers = [HttpResult(None, error="refused"), HttpResult(503, "loading"), HttpResult(200, "{}")]
    clock = iter(float(i) for i in range(100))
    ticks: list[tuple[float, str]] = []
    runner = FakeRunner(programs={"systemctl"})
    outcome = probe.wait_healthy(
        lambda url, t: answers.pop(0),
        "http://x",
        runner,
        60,
        sleep=lambda s: None,
        clock=lambda: next(clock),
        tick=lambda s, last: ticks.append((s, last)),
    )
    assert outcome.ok
    assert [last for _, last in ticks] == ["refused", "HTTP 503: loading"]
    assert ticks[0][0] < ticks[1][0]


def test_status_url_sends_the_api_key_and_says_when_one_is_needed() -> None:
    seen: list[dict[str, str] | None] = []

    def keyed(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
        seen.append(headers)
        if url.endswith("/health"):
            return serving(url, timeout)
        if (headers or {}).get("Authorization") != "Bearer s3cret":
            return HttpResult(401, '{"error": {"code": "invalid_api_key"}}')
        return serving(url, timeout)

    code, out, err = invoke(keyed, "--url", "http://127.0.0.1:8080", "--json")
    assert code == 1, err  # what status reads was refused: not a success
    data = json.loads(out)
    assert data["refused"] is True and data["latency"] == {} and "models" not in data
    assert "refused the request (401)" in data["error"] and "--api-key" in data["error"]
    code, out, err = invoke(keyed, "--url", "http://127.0.0.1:8080")
    assert code == 1
    assert "health: http://127.0.0.1:8080/health -> 200" in out
    assert "models:" not in out and "latency" not in out  # no empty list or table
    assert err.startswith("orin-llm: the server refused the request (401)")
    assert len(err.splitlines()) == 1
    code, out, err = invoke(keyed, "--url", "http://127.0.0.1:8080", "--api-key", "wrong")
    assert code == 1 and "refused the API key (401)" in err
    seen.clear()
    code, out, err = invoke(
        keyed, "--url", "http://127.0.0.1:8080", "--json", "--api-key", "s3cret"
    )
    data = json.loads(out)
    assert code == 0 and data["error"] is None and data["latency"]
    assert data["models"] == ["smollm2-135m-instruct"]
    assert all(h == {"Authorization": "Bearer s3cret"} for h in seen)


def test_status_url_without_a_scheme_is_a_usage_error() -> None:
    code, out, err = invoke(serving, "--url", "127.0.0.1:8080")
    assert code == 2 and out == ""
    assert "give the scheme, e.g. http://127.0.0.1:8080" in " ".join(err.replace("│", " ").split())


def test_status_url_of_a_server_without_metrics_says_so_instead_of_an_empty_table() -> None:
    """A server whose /metrics is not there (llama-server without --metrics): one line,
    not a latency table without rows."""

    def no_metrics(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
        if url.endswith("/metrics"):
            return HttpResult(404, "not found")
        return serving(url, timeout)

    code, out, err = invoke(no_metrics, "--url", "http://127.0.0.1:8080")
    assert code == 0, err
    assert "latency: none: /metrics exports no TTFT or TPOT histogram" in out
    assert "latency since the server started" not in out and "requests" not in out


def test_a_metrics_page_that_is_not_prometheus_text_is_no_internal_error() -> None:
    """Another program on the port, or a proxy's page, answering /metrics with JSON or
    HTML: no latency, not exit 70."""
    for body in ('{"status": "ok"}', "<html><body>502 Bad Gateway</body></html>"):

        def other(url: str, timeout: float, headers: dict[str, str] | None = None) -> HttpResult:
            if url.endswith("/metrics"):
                return HttpResult(200, body)  # noqa: B023 (called within this iteration)
            return serving(url, timeout)

        code, out, err = invoke(other, "--url", "http://127.0.0.1:8080")
        assert (code, err) == (0, ""), err
        assert "latency: none: /metrics exports no TTFT or TPOT histogram" in out
