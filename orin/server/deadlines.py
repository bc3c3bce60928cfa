"""How long a client may take to send its request: its headers, then its body.

uvicorn closes a keep-alive connection 5 s after a response only while no byte
arrives, and a connection that has not sent a whole request yet, or sends its
body a byte at a time, is kept without a limit. Such connections (a client that
crashed mid-request, a NAT that dropped the flow, a slowloris) pile up until the
process runs out of file descriptors (1024 by default under systemd), and then
nobody is served, /health included. So, as nginx's client_header_timeout and
client_body_timeout do:

* ``HEADERS_S``: a connection that has not sent a whole request's headers this
  long after it opened, or after its last response, is closed (``protocol``
  wraps uvicorn's HTTP protocol classes; the timer looks at the connection when
  it fires instead of following every byte);
* ``BODY_S``: a body not read whole this long after its headers is a 408
  (``read_within``, used by the request middleware).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

HEADERS_S = 10.0
BODY_S = 60.0


class HeadersDeadline:
    """Mixed into a uvicorn HTTP protocol class: close the connection when no request
    has started within ``headers_s`` of it opening or of its last response."""

    headers_s: float = HEADERS_S
    _deadline: asyncio.TimerHandle | None = None
    # uvicorn's protocol provides these
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self._deadline = self.loop.call_later(self.headers_s, self._expire, self.cycle)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, cycle: Any) -> None:
        """Close unless a request started since the timer was armed (a new cycle) or
        the one it was armed in is still being answered (pipelined requests)."""
        self._deadline = None
        idle = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if idle and not self.transport.is_closing():
            self.transport.close()


# what HeadersDeadline takes from uvicorn's protocol classes: the methods it wraps, and
# the attributes their __init__ sets (a connection's loop, transport and request cycle)
_WRAPPED = ("connection_made", "connection_lost", "on_response_complete")
_SET_IN_INIT = ("loop", "transport", "cycle")


def missing(base: type) -> list[str]:
    """What ``base`` lacks of what the deadline relies on (uvicorn's internals, which a
    uvicorn release could rename): empty when the mixin fits."""
    init = getattr(getattr(base, "__init__", None), "__code__", None)
    names = init.co_names if init is not None else ()
    lacking = [name for name in _WRAPPED if not callable(getattr(base, name, None))]
    return lacking + [f"self.{name}" for name in _SET_IN_INIT if name not in names]


def protocol(http: str, headers_s: float = HEADERS_S) -> type:
    """uvicorn's protocol class for ``http`` ('httptools' or 'h11') with the deadline;
    uvicorn's own class, with a warning, when it no longer has what the deadline wraps
    (serving without the deadline rather than failing every connection)."""
    base: type
    if http == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as base
    return with_deadline(base, headers_s)


def with_deadline(base: type, headers_s: float = HEADERS_S) -> type:
    """``base`` with HeadersDeadline mixed in, or ``base`` itself when it lacks what the
    mixin relies on."""
    lacking = missing(base)
    if lacking:
        log.warning(
            "request header deadline off: this uvicorn's %s has no %s; connections that "
            "never send a whole request are kept until the client closes them",
            base.__name__,
            ", ".join(lacking),
        )
        return base
    return type(f"Deadline{base.__name__}", (HeadersDeadline, base), {"headers_s": headers_s})


class BodyTimeout(Exception):
    """The client did not send its whole body within ``BODY_S``."""


def read_within(
    receive: Callable[[], Awaitable[Any]], seconds: float
) -> Callable[[], Awaitable[Any]]:
    """``receive`` for one request's body, raising BodyTimeout once ``seconds`` have
    passed since the first call."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds

    async def bounded() -> Any:
        left = end - loop.time()
        try:
            return await asyncio.wait_for(receive(), max(left, 0.0))
        except asyncio.TimeoutError:
            raise BodyTimeout() from None

    return bounded
