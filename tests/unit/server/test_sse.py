"""EventStream, the SSE response, against an in-memory ASGI connection."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from orin.server.sse import PING, EventStream, LastEvents, event


class Connection:
    """The server side of one HTTP exchange: what the app sent, and a client that
    can go away (``disconnect``)."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.gone = asyncio.Event()
        self.requested = False

    async def receive(self) -> dict[str, Any]:
        if not self.requested:  # the request body, already read by the route
            self.requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent[1:])


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, timeout=10))


def respond(events: AsyncIterator[bytes], ping_s: float = 15.0) -> Connection:
    """The whole response to a client that stays."""

    async def go() -> Connection:
        conn = Connection()
        await EventStream(events, ping_s=ping_s)({}, conn.receive, conn.send)
        return conn

    conn: Connection = run(go())
    return conn


def test_events_then_the_end_of_the_body() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield event('{"a": 1}')
        yield event("[DONE]")

    conn = respond(events())
    start = conn.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"text/event-stream; charset=utf-8"
    assert headers[b"cache-control"] == b"no-store"
    assert conn.body == b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    assert conn.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
    assert all(m["more_body"] for m in conn.sent[1:-1])


def test_a_disconnect_cancels_and_closes_the_iterator_at_once() -> None:
    closed: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            yield event("first")
            await asyncio.sleep(3600)  # waiting for a token that never comes
            yield event("never")
        finally:
            closed.append("finally ran")  # the token stream cancels its request here

    async def go() -> tuple[Connection, float]:
        conn = Connection()
        task = asyncio.ensure_future(EventStream(events())({}, conn.receive, conn.send))
        while not conn.sent[1:]:
            await asyncio.sleep(0)
        t0 = asyncio.get_running_loop().time()
        conn.gone.set()
        await task
        return conn, asyncio.get_running_loop().time() - t0

    conn, took = run(go())
    assert closed == ["finally ran"]
    assert took < 1.0
    assert conn.body == b"data: first\n\n"  # no end-of-body for a client that left
    assert all(m.get("more_body", True) for m in conn.sent)


def test_a_client_that_left_is_marked_for_the_access_log_and_one_that_stayed_is_not() -> None:
    """The middleware logs and counts a request whose client left as 499."""

    async def events(forever: bool) -> AsyncIterator[bytes]:
        yield event("first")
        if forever:
            await asyncio.sleep(3600)
        yield LastEvents(event("[DONE]"))

    async def go(leave: bool) -> dict[str, Any]:
        conn = Connection()
        scope: dict[str, Any] = {"state": {"request_id": "req-1"}}
        task = asyncio.ensure_future(EventStream(events(leave))(scope, conn.receive, conn.send))
        if leave:
            while not conn.sent[1:]:
                await asyncio.sleep(0)
            conn.gone.set()
        await task
        return dict(scope["state"])

    assert run(go(leave=True)) == {"request_id": "req-1", "client_left": True}
    assert run(go(leave=False)) == {"request_id": "req-1"}


def test_an_iterator_suspended_at_a_send_is_closed_too() -> None:
    closed: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        try:
            while True:
                yield event("token")
        finally:
            closed.append("closed")

    class Stuck(Connection):
        async def send(self, message: dict[str, Any]) -> None:
            await super().send(message)
            if len(self.sent) == 3:  # a client that stopped reading: the write blocks
                self.gone.set()
                await asyncio.sleep(3600)

    async def go() -> list[str]:
        conn = Stuck()
        await EventStream(events())({}, conn.receive, conn.send)
        return list(closed)  # closed by the response, not later by the loop's shutdown

    assert run(go()) == ["closed"]


def test_an_error_in_the_iterator_reaches_the_server() -> None:
    async def events() -> AsyncIterator[bytes]:
        yield event("one")
        raise RuntimeError("broken generator")

    with pytest.raises(RuntimeError, match="broken generator"):
        respond(events())


def test_pings_only_while_nothing_is_sent() -> None:
    async def events(gap: float, n: int) -> AsyncIterator[bytes]:
        for i in range(n):
            await asyncio.sleep(gap)
            yield event(str(i))

    quiet = respond(events(0.3, 2), ping_s=0.05).body  # a long prefill: silence between the events
    assert quiet.count(PING) >= 3
    assert quiet.replace(PING, b"") == b"data: 0\n\ndata: 1\n\n"
    # tokens flowing for about four ping periods: no ping needed (one stall of the
    # machine longer than a period may earn one)
    busy = respond(events(0.01, 60), ping_s=0.15).body
    assert busy.count(PING) <= 1
    assert busy.replace(PING, b"") == b"".join(event(str(i)) for i in range(60))


def test_the_last_events_end_the_body_in_the_same_message() -> None:
    """LastEvents goes out with more_body false (one write for the tail of an
    answer and the end of the body), and nothing more is read from the iterator."""
    read_after: list[str] = []

    async def events() -> AsyncIterator[bytes]:
        yield event("one")
        yield LastEvents(event("two") + event("[DONE]"))
        read_after.append("read on")  # never: the response is complete
        yield event("three")

    conn = respond(events())
    assert [m["more_body"] for m in conn.sent[1:]] == [True, False]
    assert conn.sent[-1]["body"] == b"data: two\n\ndata: [DONE]\n\n"
    assert conn.body == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
    assert read_after == []
