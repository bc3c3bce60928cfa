"""The responses of the OpenAI-compatible API (their shapes are in protocol.py).

One formatter per endpoint (``ChatFormatter``, ``CompletionFormatter``) with the
same calls: the full response, a token's stream chunk, the final chunk and the
usage chunk. ``TokenChunks`` is the streaming fast path: a plain token chunk
differs from the next only in its text, so its bytes are built around the
encoded text from a template the formatter made once; a test holds the two
equal. ``sse_events`` drives a streamed answer.
"""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from orin.engine.stream import Completion, RequestStream, collect
from orin.engine.types import RequestTimings, TokenEvent
from orin.server.errors import error_body
from orin.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Chunk,
    CompletionRequest,
    Delta,
    Envelope,
    Figures,
    FullResponse,
    TextChoice,
    TextCompletion,
    chat_logprobs,
    completion_logprobs,
    usage,
)
from orin.server.sse import event


class Served(Protocol):
    """What a formatter needs of the server (``ServerState`` has it)."""

    @property
    def model_name(self) -> str: ...

    @property
    def system_fingerprint(self) -> str | None: ...

    def engine_piece(self, token: int) -> bytes: ...

    def detokenize(self, tokens: list[int]) -> str: ...

    def timings(self, t: RequestTimings | None) -> dict[str, Any] | None: ...


def encode(chunk: Chunk) -> bytes:
    """One chunk as an SSE event."""
    return event(json.dumps(chunk, ensure_ascii=False))


# -- formatters ----------------------------------------------------------------------


class Formatter(ABC):
    """One request's answer on the wire; the same calls for either endpoint.

    The response id is OpenAI's kind (``chatcmpl-…``, ``cmpl-…``), new for every
    response; the request id (``x-request-id``, which a client may choose, so two
    requests may share it) stays in the header, the logs and error bodies.
    """

    ID_PREFIX = ""

    def __init__(
        self, served: Served, body: ChatCompletionRequest | CompletionRequest, request_id: str
    ) -> None:
        self.served = served
        self.request_id = request_id
        self.response_id = self.ID_PREFIX + uuid.uuid4().hex
        self.token_ids = body.return_token_ids
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.created = int(time.time())  # one instant for every chunk, as OpenAI does

    def _envelope(self, kind: str) -> Envelope:
        return {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.served.model_name,
            "system_fingerprint": self.served.system_fingerprint,
        }

    def _figures(self, c: Completion, out: Figures, final_chunk: bool = False) -> None:
        """usage and timings: a final chunk leaves usage to its own chunk when asked."""
        out["timings"] = self.served.timings(c.timings)
        if not (final_chunk and self.include_usage):
            out["usage"] = usage(c)

    @abstractmethod
    def response(self, c: Completion, prompt: list[int]) -> FullResponse:
        """The whole answer of a request that did not stream."""

    def opening(self) -> Chunk | None:
        """The chunk a stream starts with, before any token; None for none."""
        return None

    @abstractmethod
    def chunk(self, e: TokenEvent) -> Chunk:
        """One token's chunk, built in full (``TokenChunks`` takes a faster path)."""

    @abstractmethod
    def final_chunk(self, c: Completion) -> Chunk:
        """The finish reason and the figures (usage unless a usage chunk follows)."""

    @abstractmethod
    def usage_chunk(self, c: Completion) -> Chunk:
        """The last chunk, with usage and no choice (``stream_options.include_usage``)."""


class ChatFormatter(Formatter):
    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"
    ID_PREFIX = "chatcmpl-"

    def response(self, c: Completion, prompt: list[int]) -> ChatCompletion:
        lp = chat_logprobs(c.logprobs, self.served.engine_piece) if c.logprobs else None
        choice: ChatChoice = {
            "index": 0,
            "finish_reason": c.finish_reason,
            "logprobs": lp,
            "message": {"role": "assistant", "content": c.text},
        }
        if self.token_ids:
            choice["token_ids"] = list(c.token_ids)
            choice["prompt_token_ids"] = prompt
        out: ChatCompletion = {**self._envelope(self.OBJECT), "choices": [choice]}
        self._figures(c, out)
        return out

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return {**self._envelope(self.CHUNK_OBJECT), "choices": [choice]}

    def opening(self) -> ChatCompletionChunk:
        delta: Delta = {"role": "assistant", "content": ""}
        return self._chunk({"index": 0, "finish_reason": None, "logprobs": None, "delta": delta})

    def chunk(self, e: TokenEvent) -> ChatCompletionChunk:
        lp = None if e.logprob is None else chat_logprobs([e.logprob], self.served.engine_piece)
        choice: ChatChunkChoice = {
            "index": 0,
            "finish_reason": None,
            "logprobs": lp,
            "delta": {"content": e.text},
        }
        if self.token_ids:
            choice["token_ids"] = [] if e.token_id is None else [e.token_id]
        return self._chunk(choice)

    def final_chunk(self, c: Completion) -> ChatCompletionChunk:
        out = self._chunk(
            {"index": 0, "finish_reason": c.finish_reason, "logprobs": None, "delta": {}}
        )
        self._figures(c, out, final_chunk=True)
        return out

    def usage_chunk(self, c: Completion) -> ChatCompletionChunk:
        return {**self._envelope(self.CHUNK_OBJECT), "choices": [], "usage": usage(c)}


class CompletionFormatter(Formatter):
    OBJECT = "text_completion"  # full responses and chunks alike, as OpenAI has it
    ID_PREFIX = "cmpl-"

    def __init__(self, served: Served, body: CompletionRequest, request_id: str) -> None:
        super().__init__(served, body, request_id)
        self.echo = body.echo

    def response(self, c: Completion, prompt: list[int]) -> TextCompletion:
        piece = self.served.engine_piece
        choice: TextChoice = {
            "index": 0,
            "finish_reason": c.finish_reason,
            "logprobs": completion_logprobs(c.logprobs, piece) if c.logprobs else None,
            "text": (self.served.detokenize(prompt) if self.echo else "") + c.text,
        }
        if self.token_ids:
            choice["token_ids"] = list(c.token_ids)
            choice["prompt_token_ids"] = prompt
        out: TextCompletion = {**self._envelope(self.OBJECT), "choices": [choice]}
        self._figures(c, out)
        return out

    def _chunk(self, choice: TextChoice) -> TextCompletion:
        return {**self._envelope(self.OBJECT), "choices": [choice]}

    def chunk(self, e: TokenEvent) -> TextCompletion:
        piece = self.served.engine_piece
        lp = None if e.logprob is None else completion_logprobs([e.logprob], piece)
        choice: TextChoice = {"index": 0, "finish_reason": None, "logprobs": lp, "text": e.text}
        if self.token_ids:
            choice["token_ids"] = [] if e.token_id is None else [e.token_id]
        return self._chunk(choice)

    def final_chunk(self, c: Completion) -> TextCompletion:
        out = self._chunk(
            {"index": 0, "finish_reason": c.finish_reason, "logprobs": None, "text": ""}
        )
        self._figures(c, out, final_chunk=True)
        return out

    def usage_chunk(self, c: Completion) -> TextCompletion:
        return {**self._envelope(self.OBJECT), "choices": [], "usage": usage(c)}


# -- streaming -----------------------------------------------------------------------

_TEXT_MARK = "\u0000orin-text\u0000"
_json_string = json.encoder.encode_basestring  # json.dumps(text, ensure_ascii=False), in C


class TokenChunks:
    """The SSE bytes of a request's token chunks.

    A plain token chunk differs from the next only in its text, so the JSON
    around the text is encoded once per request and each token costs one
    encoding of its text: the per-token work of the stream is Python that
    competes with llama.cpp's threads for the same cores. Chunks that carry
    token ids or logprobs are built in full by the formatter.
    """

    def __init__(self, fmt: Formatter) -> None:
        self.fmt = fmt
        template = encode(fmt.chunk(TokenEvent(fmt.request_id, None, _TEXT_MARK)))
        head, tail = template.split(_json_string(_TEXT_MARK).encode())
        self._head, self._tail = head, tail
        self._plain = not fmt.token_ids

    def token(self, e: TokenEvent) -> bytes:
        if self._plain and e.logprob is None:
            return b"".join((self._head, _json_string(e.text).encode(), self._tail))
        return encode(self.fmt.chunk(e))


async def sse_events(
    fmt: Formatter, stream: RequestStream, on_finish: Callable[[Completion], None]
) -> AsyncIterator[bytes]:
    """A streamed answer's SSE events; ``on_finish`` sees the collected request
    before the last events go out. If the client goes away, EventStream cancels
    this generator and the ``finally`` cancels the request, freeing its slot
    within one engine step.

    The events that are ready together (a client or loop that fell behind) go
    out in one write.
    """
    chunks = TokenChunks(fmt)
    with_ids = fmt.token_ids
    events: list[TokenEvent] = []
    try:
        opening = fmt.opening()
        if opening is not None:
            yield encode(opening)
        while ready := await stream.next_batch():
            events += ready
            out = [
                chunks.token(e)
                for e in ready
                if e.finish_reason is None and (e.text or with_ids or e.logprob is not None)
            ]
            if out:
                yield out[0] if len(out) == 1 else b"".join(out)
        final = events[-1]
        if final.text:
            yield chunks.token(final)
        c = collect(stream.request_id, events)
        on_finish(c)
        if c.finish_reason == "error":
            err = error_body(
                c.error or "generation failed", "server_error", None, None, stream.request_id
            )
            yield event(json.dumps(err))
        else:
            yield encode(fmt.final_chunk(c))
            if fmt.include_usage:
                yield encode(fmt.usage_chunk(c))
        yield event("[DONE]")
    finally:
        stream.cancel()  # a no-op when the request already finished
