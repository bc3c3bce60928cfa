"""The streaming response: server-sent events with as little work per event as possible.

A streamed token costs the event loop one wake-up, one pass through the ASGI
``send`` chain and one socket write, and on a board whose cores are all busy
decoding, that CPU comes out of the decode. sse-starlette's response, which
the server used first, adds per event a cancel scope, an async-library lookup
and a debug log call: measured on a 2-core machine (uvicorn on uvloop and
httptools either way), the event loop spent 0.40 ms of user CPU time per
streamed token with it and 0.25 ms with this response (docs/performance.md).
Its behaviour is kept: the SSE headers, a comment line to keep idle
connections open, and the end of the stream when the client disconnects.

The last events of an answer (the finish reason, the usage, ``[DONE]``) come as
one ``LastEvents`` and go out in one write together with the end of the body:
four sends, and four socket writes, became one (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from starlette.responses import Response

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PING = b": ping\n\n"


def event(data: str) -> bytes:
    """One SSE event carrying ``data`` (a JSON document: json.dumps never writes a
    raw newline, so one ``data:`` line holds it)."""
    return b"data: " + data.encode() + b"\n\n"


class LastEvents(bytes):
    """The last bytes of a stream: ``EventStream`` sends them with the end of the body
    and reads nothing more from the iterator."""


class EventStream(Response):
    """An SSE response over an async iterator of ready-made SSE bytes.

    The iterator runs in a task of its own beside a task that waits for the
    client's disconnect: when the client goes away the iterator is cancelled
    and closed, so its ``finally`` runs at once (the token stream cancels its
    request there). While nothing is sent for ``ping_s`` seconds (a long prompt
    being read, a queue), a comment line keeps proxies from closing the
    connection.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], ping_s: float = 15.0) -> None:
        self.events = events
        self.ping_s = ping_s
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-store", "x-accel-buffering": "no"})
        self._quiet = True  # nothing sent since the last ping tick

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        body = asyncio.ensure_future(self._body(send))
        gone = asyncio.ensure_future(_disconnect(receive))
        ping = asyncio.ensure_future(self._ping(send))
        try:
            await asyncio.wait((body, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (body, gone, ping):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(gone, ping, return_exceptions=True)
                await asyncio.wait((body,))
        if body.cancelled():  # the client went away: nobody to end the stream for
            # the access log and metrics count it as 499, not as an answer served
            scope.setdefault("state", {})["client_left"] = True
            return
        if not body.result():  # an error in the iterator propagates (the server logs it)
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _body(self, send: Send) -> bool:
        """Send the events; True when the last of them ended the body."""
        events = self.events
        try:
            async for chunk in events:
                self._quiet = False
                last = type(chunk) is LastEvents
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    return True
            return False
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:  # cancelled between two events: close the iterator now
                await aclose()

    async def _ping(self, send: Send) -> None:
        while True:
            await asyncio.sleep(self.ping_s)
            if self._quiet:
                await send({"type": "http.response.body", "body": PING, "more_body": True})
            self._quiet = True


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
