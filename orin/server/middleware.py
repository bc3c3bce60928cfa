"""Plain ASGI middleware: request ids, the body size limit, draining, access log.

Plain ASGI rather than BaseHTTPMiddleware, so streaming responses and the
client-disconnect messages that cancel requests pass through untouched.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from starlette.routing import BaseRoute, Match

from orin.server import deadlines
from orin.server.errors import ApiError, BodyTimeout, BodyTooLarge, to_response

if TYPE_CHECKING:
    from orin.server.state import ServerState

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

access_log = logging.getLogger("orin.access")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
"""Routes whose requests an idle engine waits for while they are prepared (Engine.arrival)."""
CLIENT_LEFT = 499
"""The status logged and counted for a request whose client left before its answer
(nginx's "client closed request"): not a server error in a 5xx rate."""


class Draining(ApiError):
    status, type, code = 503, "service_unavailable", "draining"


class RequestContext:
    """``routes``: the app's, to name the route of a request answered before routing
    (a 401 without the key, a 413, a 503 while draining) in the HTTP metrics."""

    def __init__(
        self,
        app: ASGIApp,
        state: ServerState,
        routes: Sequence[BaseRoute] = (),
        body_s: float = deadlines.BODY_S,
    ) -> None:
        self.app = app
        self.state = state
        self.routes = routes
        self.body_s = body_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = _request_id(scope)
        scope.setdefault("state", {})["request_id"] = rid
        started = time.perf_counter()
        status = {"code": 500}

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                headers = list(message.get("headers", []))
                # error responses (to_response) carry the id already: not twice
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", rid.encode()))
                message["headers"] = headers
            await send(message)

        self.state.inflight += 1
        arrival = None
        try:
            error = self._refusal(scope)
            replay = None if error else await self._read_body(scope, receive)
            if error is not None or isinstance(replay, ApiError):
                await to_response(error or replay, rid)(scope, receive, send_with_id)  # type: ignore[arg-type]
            else:
                if scope["method"] == "POST" and scope["path"] in GENERATION_PATHS:
                    # read: from here until it is queued the engine may wait for it
                    arrival = scope["state"]["arrival"] = self.state.engine.arrival()
                await self.app(scope, replay or receive, send_with_id)
        finally:
            if arrival is not None:
                arrival.close()  # refused, failed or cancelled before it was queued
            self.state.inflight -= 1
            if scope["state"].get("client_left"):  # its answer went nowhere: nginx's 499
                status["code"] = CLIENT_LEFT
            self._log(scope, rid, status["code"], time.perf_counter() - started)

    def _refusal(self, scope: Scope) -> ApiError | None:
        if self.state.draining and scope["path"].startswith("/v1/"):
            return Draining("the server is shutting down; retry on another instance")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.state.max_body_bytes:
            return BodyTooLarge(
                f"the request body has {length} bytes; the limit is {self.state.max_body_bytes} "
                "(server.max_body_bytes)"
            )
        return None

    async def _read_body(self, scope: Scope, receive: Receive) -> Receive | ApiError | None:
        """Read a POST body up to the limit, within ``deadlines.BODY_S``, then replay it
        to the app."""
        if scope["method"] != "POST":
            return None
        chunks: list[bytes] = []
        size = 0
        more = True
        read = deadlines.read_within(receive, self.body_s)
        while more:
            try:
                message = await read()
            except deadlines.BodyTimeout:
                return BodyTimeout(
                    f"the request body was not sent whole within {self.body_s:g} s "
                    f"({size} bytes came)"
                )
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.state.max_body_bytes:
                return BodyTooLarge(
                    f"the request body exceeds {self.state.max_body_bytes} bytes "
                    "(server.max_body_bytes)"
                )
            chunks.append(chunk)
            more = message.get("more_body", False)
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        return replay

    def _log(self, scope: Scope, rid: str, status: int, seconds: float) -> None:
        route = scope.get("route") or self._route(scope)
        path = getattr(route, "path", None) or "unmatched"  # bounded label values only
        self.state.metrics.observe_http(scope["method"], path, status, seconds)
        t = scope.get("state", {}).get("timings")
        fields: dict[str, Any] = {
            "request_id": rid,
            "status": status,
            "method": scope["method"],
            "path": _logged_path(scope["path"]),
            "duration_ms": round(seconds * 1e3, 1),
        }
        if t is not None:
            fields.update(
                prompt_tokens=t.prompt_tokens,
                cached_tokens=t.cached_tokens,
                generated_tokens=t.generated_tokens,
                ttft_ms=round(t.first_token_ms, 1) if t.first_token_ms is not None else None,
                tpot_ms=round(t.tpot_ms, 2) if t.tpot_ms is not None else None,
            )
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        access_log.info(text, extra={"fields": fields})

    def _route(self, scope: Scope) -> BaseRoute | None:
        """The route a request answered before routing was for, as the router would
        choose it (a path it serves with another method too: a 405 would name it);
        None for a path no route serves, which alone counts as ``unmatched``."""
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route
            if match == Match.PARTIAL and partial is None:
                partial = route
        return partial


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return str(value.decode("latin-1"))
    return None


def _logged_path(path: str) -> str:
    """The path percent-encoded again where it needs to be, as a client sent it: the
    server decodes ``%0a`` into a newline, and a client must not be able to write a
    line of its own (a forged access line) into the log."""
    return quote(path, safe="/:@!$&'()*+,;=~")


def _request_id(scope: Scope) -> str:
    given = _header(scope, b"x-request-id")
    if given and _SAFE_ID.match(given):
        return given
    return "req-" + uuid.uuid4().hex[:16]
