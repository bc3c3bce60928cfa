"""Incremental detokenization that never emits half a character or half a stop string.

Token ids and text stay apart: a token's piece is raw bytes (a byte-fallback
token is one byte of a multi-byte character), and text is only produced from
bytes that complete UTF-8 characters. Stop strings are matched on the text
across token boundaries; text that could still become a stop string is held
back until it cannot.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class Detokenizer:
    """Bytes of token pieces in, complete UTF-8 text out.

    Most pieces are whole characters: while no character is left half-read, a
    piece is decoded directly (one C call), and only a piece that does not decode
    on its own goes through the incremental decoder, which then holds its partial
    character until the next pieces complete it. The text is the same either way;
    this runs for every generated token, on the engine thread.
    """

    def __init__(self, piece: Callable[[int], bytes]) -> None:
        self._piece = piece
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = False  # the decoder holds the first bytes of a character

    def add(self, token_id: int) -> str:
        data = self._piece(token_id)
        if not self._partial:
            try:
                return data.decode()
            except UnicodeDecodeError:
                pass  # part of a character, or bytes that are not UTF-8: as before
        decoder = self._decoder
        text = decoder.decode(data)
        self._partial = bool(decoder.getstate()[0])
        return text

    def flush(self) -> str:
        """Whatever is left at the end (an incomplete sequence becomes U+FFFD)."""
        self._partial = False
        return self._decoder.decode(b"", final=True)


class StopMatcher:
    """Finds stop strings in streamed text without leaking their beginnings."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string was completed)."""
        if not self.stops:
            return text, False
        buf = self._held + text
        hit = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            self._held = ""
            return buf[:hit], True
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that starts some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if stop.startswith(buf[len(buf) - n :]):
                    best = n
                    break
        return best
