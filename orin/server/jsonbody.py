"""Request bodies read as JSON, refusing text that is not Unicode.

JSON writes a character outside the Basic Multilingual Plane as two escapes, a
UTF-16 surrogate pair (``"\\ud83d\\ude00"``), and Python's reader joins a pair
into its character. An escape of half a pair alone (``"\\ud83d"``) is no
character at all, but the reader takes it and gives a ``str`` that holds the
half: UTF-8 cannot encode it, so the first place that encodes the text (the
tokenizer, a grammar's parser, a JSON response that quotes it) would fail
with a 500. Such a body is refused when it is read, as llama-server refuses
it: a 400 naming the field that holds the half (``messages[0].content``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.routing import Match
from starlette.types import Receive, Scope, Send

# a \u escape of a surrogate, high (d800-dbff) or low (dc00-dfff): the bodies that may
# hold half a pair, looked at closely; any other body is read as it is
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE = re.compile("[\ud800-\udfff]")


class LoneSurrogate(json.JSONDecodeError):
    """A body whose text holds half a UTF-16 surrogate pair; ``param`` names where."""

    def __init__(self, param: str | None, char: str, doc: str) -> None:
        where = f"{param} holds" if param else "the request body holds"
        super().__init__(
            f"{where} \\u{ord(char):04x}, half of a UTF-16 surrogate pair without its "
            "other half: not a character; send valid Unicode text",
            doc,
            0,
        )
        self.param = param


def _lone(value: Any, path: str) -> tuple[str, str] | None:
    """(where, the half) of the first string in ``value``, or key of one of its
    objects, that holds half a surrogate pair; None when there is none."""
    if isinstance(value, str):
        found = _LONE.search(value)
        return (path, found.group()) if found else None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _LONE.search(key)
            if found:
                return (path, found.group())
            hit = _lone(item, f"{path}.{key}" if path else key)
            if hit:
                return hit
    elif isinstance(value, list):
        for i, item in enumerate(value):
            hit = _lone(item, f"{path}[{i}]")
            if hit:
                return hit
    return None


def loads(body: bytes) -> Any:
    """``body`` as JSON; ``LoneSurrogate`` (a ``JSONDecodeError``) when a string or a
    key in it holds half a surrogate pair."""
    value = json.loads(body)
    if _SURROGATE_ESCAPE.search(body):
        hit = _lone(value, "")
        if hit is not None:
            raise LoneSurrogate(hit[0] or None, hit[1], body.decode("utf-8", "replace"))
    return value


class _CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = loads(await self.body())
        return self._json


class JsonRoute(APIRoute):
    """A route whose JSON body is read by ``loads``: FastAPI turns its
    ``LoneSurrogate`` into a validation error like any JSON that does not parse, and
    the error handler (errors.on_validation_error) names the field.

    A GET route also answers HEAD, as RFC 9110 asks of every server and as
    Starlette's own routes and llama-server do (``wget --spider``, uptime checks):
    it runs as GET, and uvicorn, which still sees HEAD, sends the headers only.
    HEAD stays out of ``methods``, so the OpenAPI schema has no second operation."""

    def _as_get(self, scope: Scope) -> Scope:
        if scope.get("method") == "HEAD" and "GET" in (self.methods or ()):
            return {**scope, "method": "GET"}
        return scope

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        return super().matches(self._as_get(scope))

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        await super().handle(self._as_get(scope), receive, send)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            return await handler(_CheckedRequest(request.scope, request.receive, request._send))

        return route
