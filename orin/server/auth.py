"""The API key, checked once for every route but a few public ones, and CORS.

``RequireKey`` is plain ASGI middleware in front of the router, so a route added
later is behind the key without saying so; only the paths below answer without
it. It runs on the event loop: a plain-function FastAPI dependency would be
sent to the thread pool, a round trip through a worker thread for every
request (two thread wake-ups, about 0.1 ms of the loop's CPU, and the wait for
a core while llama.cpp's threads hold every one) to compare two strings.

A client proves it holds the key with ``Authorization: Bearer <key>`` (the
OpenAI clients) or with the ``orin_llm_key`` cookie, which the dashboard's
login page sets so that a browser's own requests (the page and its fetches: it
polls /dashboard/data) carry it. There is no WebSocket route; a WebSocket
without the key would be closed before it is accepted.
"""

from __future__ import annotations

import hmac
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import HTTPConnection

from orin.server.errors import Unauthorized, to_response
from orin.server.middleware import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from orin.server.state import ServerState

COOKIE = "orin_llm_key"

# "/", "/login" and "/logout" are the dashboard's: "/" checks the key itself and
# answers with the login page when it is missing; "/login" is that page's form;
# "/logout" only deletes the cookie, and must do so for a cookie that no longer
# holds the key (the key changed since the login), which the check would refuse.
PUBLIC_PATHS = frozenset({"/health", "/", "/login", "/logout"})
PUBLIC_PREFIXES = ("/dashboard/assets/",)

# What a browser may send cross-origin besides the safelisted headers.
CORS_HEADERS = ("Authorization", "Content-Type", "X-Request-Id")
# What a browser script may read from a cross-origin response.
CORS_EXPOSED = ("X-Request-Id", "Retry-After")


def authorized(state: ServerState, request: HTTPConnection) -> bool:
    """Whether ``request`` may use the server: no key is set, or it sends the key as
    ``Authorization: Bearer <key>`` or in the ``orin_llm_key`` cookie. Compared in
    constant time. ``request`` is a Request or a WebSocket (both HTTPConnection)."""
    key = state.api_key
    if key is None:
        return True
    expected = key.encode()
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected):
        return True
    cookie = request.cookies.get(COOKIE)
    return cookie is not None and hmac.compare_digest(cookie.encode(), expected)


class LoginLimiter:
    """Wrong keys posted to the dashboard's login, per client address: a token bucket
    of ``burst`` failures refilled at ``per_s`` a second. An address out of tokens
    gets 429 before its key is compared, so guessing runs at ``per_s`` keys a
    second at most; a right key within the limit and every other route are never
    held back. The table keeps the ``size`` addresses that failed last (the oldest
    is forgotten first), so a flood of addresses costs bounded memory. Used on the
    event loop only: no lock."""

    def __init__(
        self,
        burst: int = 5,
        per_s: float = 1.0,
        size: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.per_s, self.size, self.clock = burst, per_s, size, clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at

    def _tokens(self, address: str, now: float) -> float:
        tokens, at = self._buckets.get(address, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - at) * self.per_s)

    def retry_after(self, address: str) -> int:
        """Whole seconds until ``address`` may try a key again; 0: it may now."""
        tokens = self._tokens(address, self.clock())
        return 0 if tokens >= 1 else math.ceil((1 - tokens) / self.per_s)

    def failed(self, address: str) -> None:
        """Count a wrong key from ``address``."""
        now = self.clock()
        self._buckets[address] = (self._tokens(address, now) - 1, now)
        self._buckets.move_to_end(address)
        while len(self._buckets) > self.size:
            self._buckets.popitem(last=False)


def is_public(state: ServerState, path: str) -> bool:
    """Paths that answer without the key: /health (load balancers, systemd's probe),
    the dashboard's page and assets, and /metrics with ``server.metrics_public``.
    An asset path that climbs out of its folder (``..``) is not public, whatever
    serves it."""
    if path in PUBLIC_PATHS:
        return True
    if path == "/metrics":
        return state.metrics_public
    return path.startswith(PUBLIC_PREFIXES) and ".." not in path.split("/")


class RequireKey:
    """Answer 401 (OpenAI's error JSON) to a request without the key, before routing;
    a WebSocket without it is closed (policy violation) before it is accepted."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if (
            kind not in ("http", "websocket")
            or self.state.api_key is None
            or is_public(self.state, scope["path"])
            or authorized(self.state, HTTPConnection(scope))
        ):
            await self.app(scope, receive, send)
            return
        if kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        rid = scope.get("state", {}).get("request_id")
        error = Unauthorized("a valid API key is required (Authorization: Bearer <key>)")
        response = to_response(error, rid)
        response.headers["www-authenticate"] = "Bearer"
        await response(scope, receive, send)


def protect(app: FastAPI, state: ServerState) -> None:
    """Add the key check and, with ``server.cors_origins``, CORS to ``app``. Call before
    the request-context middleware is added, so that one stays outermost (request
    ids, access log and HTTP metrics for refused requests too) and CORS sits
    outside the key check: a browser's preflight (OPTIONS) carries no key, and a
    401 still gets the CORS headers a page needs to read it."""
    app.add_middleware(RequireKey, state=state)
    if state.cors_origins:
        # Authorization is a header, not a credential in the CORS sense (cookies):
        # allow_credentials stays off, so '*' cannot hand the cookie to any site.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(state.cors_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=list(CORS_HEADERS),
            expose_headers=list(CORS_EXPOSED),
        )
