"""A client has a deadline for its request's headers and one for its body: a
connection that sends nothing, or a request a byte at a time, is not kept forever
(a few hundred of them would take every file descriptor the server has)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, cast

import pytest
import uvicorn

from orin.server import deadlines
from orin.server.errors import BodyTimeout
from orin.server.middleware import RequestContext
from orin.server.state import ServerState
from tests.serverutil import free_port, poll

HEADERS_S = 0.3


async def slow_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answers after twice the headers' deadline: a request being answered is never cut."""
    if scope["type"] != "http":
        return
    await asyncio.sleep(2 * HEADERS_S)
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@contextmanager
def serving(http: str) -> Iterator[int]:
    port = free_port()
    config = uvicorn.Config(
        slow_app,
        host="127.0.0.1",
        port=port,
        http=deadlines.protocol(http, HEADERS_S),
        log_config=None,
        timeout_keep_alive=60,
        lifespan="off",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    poll(lambda: server.started, "the server to start")
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (reads what it sent until then)."""
    sock.settimeout(0.05)
    try:
        return sock.recv(4096) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_connection_without_a_whole_request_is_closed(http: str) -> None:
    with serving(http) as port:
        silent = socket.create_connection(("127.0.0.1", port))
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")
        poll(lambda: closed(silent), "the silent connection to be closed")
        for _ in range(100):  # a header line now and then does not keep it open
            try:
                slow.sendall(b"X-A: b\r\n")
            except OSError:
                break
            if closed(slow):
                break
            time.sleep(0.02)
        else:
            pytest.fail("a request whose headers never end was kept")


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_request_answered_slowly_and_the_next_one_are_not_cut(http: str) -> None:
    with serving(http) as port:
        sock = socket.create_connection(("127.0.0.1", port))
        for _ in range(2):  # keep-alive: the deadline starts again after a response
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            sock.settimeout(10)
            answer = b""
            while not answer.endswith(b"ok"):
                chunk = sock.recv(4096)
                assert chunk, "closed while the request was answered"
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")


def test_a_body_not_sent_whole_in_time_is_a_408() -> None:
    state = SimpleNamespace(max_body_bytes=1 << 20)
    context = RequestContext(cast(Any, None), cast(ServerState, state), body_s=0.05)
    parts = [{"type": "http.request", "body": b"{", "more_body": True}]

    async def receive() -> dict[str, Any]:
        if parts:
            return parts.pop()
        await asyncio.sleep(5)  # a client that sends the rest far too late
        return {"type": "http.request", "body": b"}", "more_body": False}

    error = asyncio.run(context._read_body({"method": "POST"}, receive))
    assert isinstance(error, BodyTimeout) and error.status == 408
    assert "1 bytes came" in str(error)


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_this_uvicorn_has_what_the_deadline_wraps(http: str) -> None:
    """The installed uvicorn's protocol classes keep the names the mixin relies on (a
    release that renamed one would turn the deadline off, with a warning)."""
    served = deadlines.protocol(http, HEADERS_S)
    assert issubclass(served, deadlines.HeadersDeadline)
    assert deadlines.missing(served.__mro__[2]) == []


class _Renamed:
    """A protocol class from a uvicorn that renamed the response hook and the cycle."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.transport = None
        self.current_cycle = None

    def connection_made(self, transport: Any) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def on_response_done(self) -> None: ...


def test_a_uvicorn_without_what_the_deadline_wraps_serves_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Serving without the deadline, and saying so, rather than failing every
    connection with an AttributeError."""
    assert deadlines.missing(_Renamed) == ["on_response_complete", "self.cycle"]
    with caplog.at_level("WARNING", logger="orin.server.deadlines"):
        assert deadlines.with_deadline(_Renamed, HEADERS_S) is _Renamed
    assert "header deadline off" in caplog.text
    assert "on_response_complete, self.cycle" in caplog.text
