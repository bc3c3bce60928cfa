"""Server-sent events as they arrive: bytes in, the data of each complete event out.

The one SSE framing for both clients in client.py (the load generator's and the
benchmarks'). It works on raw chunks rather than decoded lines so that the
lean client can stamp a chunk once and parse nothing it does not need: the
common event (one ``data: `` line) costs a split and a slice.
"""

from __future__ import annotations


class SSEDecoder:
    """Splits a byte stream into events (blank-line separated) and returns the data
    of each: the ``data:`` lines joined by newlines, as the SSE standard says.
    Comments (``: ping``) and events without data give nothing."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._pending + chunk
        if b"\r" in buf:  # CRLF framing (a CR split from its LF waits in _pending)
            buf = buf.replace(b"\r\n", b"\n")
        *events, self._pending = buf.split(b"\n\n")
        return [data for event in events if (data := _data(event)) is not None]

    def close(self) -> list[bytes]:
        """The data of an event the stream ended without a blank line after."""
        event, self._pending = self._pending.rstrip(b"\r\n"), b""
        data = _data(event) if event else None
        return [data] if data is not None else []


def _data(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]  # the common case: one data line
    lines = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None
    return b"\n".join(line[1:] if line.startswith(b" ") else line for line in lines)
