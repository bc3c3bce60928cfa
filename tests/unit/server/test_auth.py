"""The API key in front of every route of a real app, the dashboard's cookie,
metrics_public, and CORS (off by default; a preflight needs no key)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.requests import HTTPConnection
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.websockets import WebSocketDisconnect

from orin.engine.client import EngineStatus
from orin.server import auth
from orin.server.app import create_app
from orin.server.metrics import ServerMetrics
from orin.server.state import ServerState

KEY = "sesame"
BEARER = {"Authorization": f"Bearer {KEY}"}
ALLOWED = "https://app.example.com"


class FakeEngine:
    """What the routes read from an engine that has loaded but serves nothing."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(
            model_path="/models/demo.gguf", n_ctx=512, slots=2, type_k="f16", type_v="f16"
        )
        self.model_info = None
        self.state = "ready"

    def status(self) -> EngineStatus:
        return EngineStatus("ready", None, 2, 0, 0, 0, 0, 1024, None, 0)

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        return [10 + len(w) for w in text.split()]

    def detokenize(self, tokens: list[int], special: bool = False) -> str:
        return " ".join(f"w{t}" for t in tokens)

    def arrival(self) -> SimpleNamespace:
        """A generation request's ticket (the middleware opens one): nothing waits."""
        return SimpleNamespace(close=lambda: None)

    def __getattr__(self, name: str) -> Any:
        """add_/remove_ step and finish observers: nothing to observe here."""
        if name.endswith("_observer"):
            return lambda fn: None
        raise AttributeError(name)


def make_state(**fields: Any) -> ServerState:
    return ServerState(
        engine=FakeEngine(),  # type: ignore[arg-type]
        model_name="demo",
        metrics=ServerMetrics(2, 1024, "demo"),
        **fields,
    )


def client_for(**fields: Any) -> TestClient:
    return TestClient(create_app(make_state(**fields)))


@pytest.fixture
def client() -> Iterator[TestClient]:
    with client_for(api_key=KEY) as c:
        yield c


def concrete(path: str) -> str:
    """A route template with every parameter filled in (``{model_id:path}`` -> ``x``)."""
    return re.sub(r"\{[^}]+\}", "x", path)


def http_calls(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) for every HTTP route and mount the app has registered."""
    calls = []
    for route in app.routes:
        if isinstance(route, Route):
            for method in sorted(route.methods or {"GET"}):
                calls.append((method, concrete(route.path)))
        elif isinstance(route, Mount):
            calls.append(("GET", concrete(route.path) + "/x"))
    return calls


def public(path: str) -> bool:
    return path in auth.PUBLIC_PATHS or path.startswith(auth.PUBLIC_PREFIXES)


def test_every_route_but_health_needs_the_key(client: TestClient) -> None:
    app: FastAPI = client.app  # type: ignore[assignment]
    calls = http_calls(app)
    paths = {p for _, p in calls}
    assert {"/health", "/metrics", "/telemetry", "/openapi.json", "/v1/models"} <= paths
    assert {"/v1/chat/completions", "/v1/embeddings", "/tokenize", "/v1/models/x"} <= paths
    checked = 0
    for method, path in calls:
        if public(path):
            continue
        body: dict[str, Any] | None = {} if method == "POST" else None
        refused = client.request(method, path, json=body)
        assert refused.status_code == 401, (method, path, refused.text)
        by_header = client.request(method, path, json=body, headers=BEARER)
        assert by_header.status_code != 401, (method, path)
        by_cookie = client.request(
            method, path, json=body, headers={"Cookie": f"{auth.COOKIE}={KEY}"}
        )
        assert by_cookie.status_code != 401, (method, path)
        checked += 1
    assert checked >= 9
    assert client.get("/health").status_code == 200


def test_a_websocket_without_the_key_is_closed_before_routing(client: TestClient) -> None:
    """The server has no WebSocket route (the dashboard polls /dashboard/data); the key
    check closes any WebSocket without the key before routing, so a route added later
    is covered too."""
    app: FastAPI = client.app  # type: ignore[assignment]
    routes = [concrete(r.path) for r in app.routes if isinstance(r, WebSocketRoute)]
    for path in ["/ws", *routes]:
        with (
            pytest.raises(WebSocketDisconnect) as refused,
            client.websocket_connect(path),
        ):
            pass
        assert refused.value.code == 1008


def test_a_refusal_is_openais_error_json_with_the_request_id(client: TestClient) -> None:
    r = client.get("/metrics", headers={"Authorization": "Bearer wrong", "X-Request-Id": "r-1"})
    assert r.status_code == 401
    err = r.json()["error"]
    assert (err["type"], err["code"], err["request_id"]) == (
        "authentication_error",
        "invalid_api_key",
        "r-1",
    )
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.headers.get_list("x-request-id") == ["r-1"]  # once, not once per layer


def test_openapi_json_is_behind_the_key(client: TestClient) -> None:
    assert client.get("/openapi.json").status_code == 401
    r = client.get("/openapi.json", headers=BEARER)
    assert r.status_code == 200 and r.json()["info"]["title"] == "orin-llm"


@pytest.mark.parametrize(
    "header",
    [f"Bearer {KEY}", f"bearer {KEY}", f"Bearer  {KEY} "],
)
def test_the_bearer_forms_that_pass(client: TestClient, header: str) -> None:
    assert client.get("/v1/models", headers={"Authorization": header}).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": "Bearer"},
        {"Cookie": f"{auth.COOKIE}=wrong"},
        {"Cookie": f"other={KEY}"},
    ],
)
def test_what_does_not_pass(client: TestClient, headers: dict[str, str]) -> None:
    assert client.get("/v1/models", headers=headers).status_code == 401


def test_without_a_key_everything_answers() -> None:
    with client_for() as c:
        assert c.get("/metrics").status_code == 200
        assert c.get("/openapi.json").status_code == 200
        assert c.get("/v1/models").status_code == 200


def test_metrics_public_opens_metrics_only() -> None:
    with client_for(api_key=KEY, metrics_public=True) as c:
        r = c.get("/metrics")
        assert r.status_code == 200 and "orin_llm_slots_capacity" in r.text
        assert c.get("/telemetry").status_code == 401
        assert c.get("/v1/models").status_code == 401
    with client_for(api_key=KEY) as c:
        assert c.get("/metrics").status_code == 401


def test_authorized_reads_header_and_cookie() -> None:
    state = make_state(api_key=KEY)

    def conn(*headers: tuple[bytes, bytes]) -> HTTPConnection:
        return HTTPConnection({"type": "http", "headers": list(headers), "path": "/"})

    assert auth.authorized(state, conn((b"authorization", f"Bearer {KEY}".encode())))
    assert auth.authorized(state, conn((b"cookie", f"{auth.COOKIE}={KEY}".encode())))
    assert not auth.authorized(state, conn())
    assert auth.authorized(make_state(), conn())


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/health", True),
        ("/", True),
        ("/login", True),
        ("/logout", True),
        ("/dashboard/assets/app.js", True),
        ("/dashboard/assets/../../v1/models", False),
        ("/dashboard/assets", False),
        ("/metrics", False),
        ("/health/", False),
        ("/v1/models", False),
    ],
)
def test_public_paths(path: str, expected: bool) -> None:
    assert auth.is_public(make_state(api_key=KEY), path) is expected


# -- CORS ------------------------------------------------------------------------------


def preflight(c: TestClient, origin: str) -> Any:
    return c.options(
        "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


def test_no_cors_headers_by_default(client: TestClient) -> None:
    r = client.get("/v1/models", headers={**BEARER, "Origin": ALLOWED})
    assert r.status_code == 200
    assert not any(h.startswith("access-control-") for h in r.headers)
    p = preflight(client, ALLOWED)
    assert p.status_code != 200
    assert not any(h.startswith("access-control-") for h in p.headers)


def test_a_preflight_from_an_allowed_origin_needs_no_key() -> None:
    with client_for(api_key=KEY, cors_origins=(ALLOWED,)) as c:
        r = preflight(c, ALLOWED)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == ALLOWED
        allowed = r.headers["access-control-allow-headers"].lower()
        assert "authorization" in allowed and "content-type" in allowed
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "access-control-allow-credentials" not in r.headers


def test_a_preflight_from_another_origin_is_refused() -> None:
    with client_for(api_key=KEY, cors_origins=(ALLOWED,)) as c:
        r = preflight(c, "https://evil.example.net")
        assert r.status_code == 400
        assert "access-control-allow-origin" not in r.headers


def test_cors_headers_on_answers_and_refusals() -> None:
    with client_for(api_key=KEY, cors_origins=(ALLOWED,)) as c:
        ok = c.get("/v1/models", headers={**BEARER, "Origin": ALLOWED})
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == ALLOWED
        assert "x-request-id" in ok.headers["access-control-expose-headers"].lower()
        refused = c.get("/v1/models", headers={"Origin": ALLOWED})
        assert refused.status_code == 401  # the page can read why
        assert refused.headers["access-control-allow-origin"] == ALLOWED
        other = c.get("/v1/models", headers={**BEARER, "Origin": "https://evil.example.net"})
        assert "access-control-allow-origin" not in other.headers


def test_any_origin_with_a_star() -> None:
    with client_for(api_key=KEY, cors_origins=("*",)) as c:
        r = preflight(c, "https://anywhere.example.org")
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "*"


def test_a_refused_request_counts_under_its_route(client: TestClient) -> None:
    """A scraper or a client with a wrong key: its 401s were counted as route
    "unmatched", the label of a path no route serves, so a rate of refused scrapes of
    /metrics or of 401s on /v1/chat/completions could not be told apart from scans."""
    assert client.get("/metrics").status_code == 401
    assert client.post("/v1/chat/completions", json={}).status_code == 401
    assert client.get("/no/such/path").status_code == 401
    metrics = client.app.state.orin.metrics.registry  # type: ignore[attr-defined]

    def count(method: str, route: str) -> float | None:
        labels = {"method": method, "route": route, "status": "401"}
        return metrics.get_sample_value("orin_llm_http_requests_total", labels)

    assert count("GET", "/metrics") == 1
    assert count("POST", "/v1/chat/completions") == 1
    assert count("GET", "unmatched") == 1  # the one path no route serves
