"""The responses of the OpenAI-compatible API (their shapes are in protocol.py).

One formatter per endpoint (``ChatFormatter``, ``CompletionFormatter``) with the
same calls: the full response, a token's stream chunk, the final chunk and the
usage chunk. ``TokenChunks`` is the streaming fast path: a plain token chunk
differs from the next only in its text, so its bytes are built around the
encoded text from a template the formatter made once; a test holds the two
equal. A chat answer parsed for tool calls or reasoning streams through
``ParsedChunks`` instead (one ``OutputParser`` per choice, orin/server/tools.py).
``sse_events`` drives a streamed answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any, Literal, Protocol, cast

from orin.engine.stream import Completion, RequestStream, collect
from orin.engine.types import FinishReason, RequestTimings, TokenEvent, TokenLogprob
from orin.server.errors import GenerationFailed, Interrupted, error_body
from orin.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Chunk,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    Envelope,
    Figures,
    FullResponse,
    TextChoice,
    TextCompletion,
    ToolCallDelta,
    chat_logprobs,
    completion_logprobs,
    joined_logprobs,
    prompt_logprobs,
    usage,
)
from orin.server.sse import LastEvents, event
from orin.server.tools import CallArgs, CallStart, OutputParser, OutputSpec, Part, Text


class Served(Protocol):
    """What a formatter needs of the server (``ServerState`` has it)."""

    @property
    def model_name(self) -> str: ...

    @property
    def system_fingerprint(self) -> str | None: ...

    def engine_piece(self, token: int) -> bytes: ...

    def detokenize(self, tokens: list[int]) -> str: ...

    def timings(self, t: RequestTimings | None) -> dict[str, Any] | None: ...

    @property
    def draining(self) -> bool: ...


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
        # logprobs asked for: a whole answer carries them even when it has no token
        self.logprobs = (
            body.logprobs if isinstance(body, ChatCompletionRequest) else body.logprobs is not None
        )
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.created = int(time.time())  # one instant for every chunk, as OpenAI does
        self.n = body.n  # choices per prompt (a batch of prompts: of each in turn)

    def _envelope(self, kind: str) -> Envelope:
        return {
            "id": self.response_id,
            "object": kind,
            "created": self.created,
            "model": self.served.model_name,
            "system_fingerprint": self.served.system_fingerprint,
        }

    def _chunk_of(self, choice: Any) -> Any:
        """A stream chunk with one choice; with ``include_usage``, ``usage: null`` in it,
        as OpenAI sends it in every chunk but the last (the usage chunk)."""
        out: Any = {**self._envelope(self.CHUNK_OBJECT), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def figures(self, cs: Sequence[Completion], out: Figures, final_chunk: bool = False) -> None:
        """usage (of every choice) and timings (the first choice's): a final chunk
        leaves usage to its own chunk when asked."""
        out["timings"] = self.served.timings(cs[0].timings)
        if not (final_chunk and self.include_usage):
            out["usage"] = usage(cs, self.n)

    def response(self, cs: Completion | Sequence[Completion], prompt: list[int]) -> FullResponse:
        """The whole answer of a request that did not stream: one choice per completion.
        An answer the engine cancelled (the server shutting down) is no answer: a 503
        (``Interrupted``) that clients retry, never OpenAI-unknown ``"cancelled"``."""
        many = _many(cs)
        cut = next((c for c in many if c.finish_reason == "cancelled"), None)
        if cut is not None:
            raise Interrupted(interrupted_message(cut, self.served.draining))
        out: Any = {
            **self._envelope(self.OBJECT),
            "choices": [self.choice(c, prompt, i) for i, c in enumerate(many)],
        }
        self.figures(many, out)
        return out

    @abstractmethod
    def choice(self, c: Completion, prompt: list[int], index: int) -> Any:
        """One choice of a whole answer."""

    def opening(self, index: int = 0) -> Chunk | None:
        """The chunk choice ``index`` starts with, before any token; None for none."""
        return None

    @abstractmethod
    def chunk(self, e: TokenEvent, index: int = 0, offset: int = 0) -> Chunk:
        """One token's chunk, built in full (``TokenChunks`` takes a faster path);
        ``offset``: the characters of the choice's text before this token's."""

    def text_start(self, index: int = 0) -> int:
        """Where choice ``index``'s generated text starts in the text the client gets."""
        return 0

    def token_stream(self, index: int = 0) -> TokenStream:
        """What turns choice ``index``'s tokens into SSE bytes: the fast path by default."""
        return TokenChunks(self, index)

    def final_chunk(
        self, c: Completion, index: int = 0, figures: Sequence[Completion] | None = None
    ) -> Chunk:
        """Choice ``index``'s finish reason; with ``figures`` (the last choice to end,
        every choice's completion) the figures too: usage unless a usage chunk follows.
        Called with only a completion: that one choice and its figures."""
        out = self._final(c, index)
        done = figures if figures is not None else ([c] if index == 0 else None)
        if done:
            self.figures(done, out, final_chunk=True)
        return out

    @abstractmethod
    def _final(self, c: Completion, index: int) -> Chunk:
        """A choice's final chunk without figures."""

    def usage_chunk(self, cs: Completion | Sequence[Completion]) -> Chunk:
        """The last chunk, with usage and no choice (``stream_options.include_usage``)."""
        out: Any = {**self._envelope(self.CHUNK_OBJECT), "choices": [], "usage": usage(cs, self.n)}
        return out

    OBJECT = CHUNK_OBJECT = ""


def _many(cs: Completion | Sequence[Completion]) -> list[Completion]:
    return [cs] if isinstance(cs, Completion) else list(cs)


class ChatFormatter(Formatter):
    """Chat answers; with an ``OutputSpec`` (tools offered, or a template with a
    thinking block) the text is parsed into content, ``reasoning_content`` and
    ``tool_calls``, by one ``OutputParser`` per choice."""

    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"
    ID_PREFIX = "chatcmpl-"

    def __init__(
        self,
        served: Served,
        body: ChatCompletionRequest,
        request_id: str,
        output: OutputSpec | None = None,
    ) -> None:
        super().__init__(served, body, request_id)
        self.output = None if output is None or output.plain else output
        self._parsers: dict[int, OutputParser] = {}

    def parser(self, index: int = 0) -> OutputParser:
        """The streaming parser of choice ``index``."""
        assert self.output is not None
        p = self._parsers.get(index)
        if p is None:
            p = self._parsers[index] = self.output.parser()
        return p

    def _message(self, text: str) -> tuple[AssistantMessage, bool]:
        """The message of a whole answer, and whether it called tools."""
        if self.output is None:
            return {"role": "assistant", "content": text}, False
        parser = self.output.parser(eager=False)
        parser.feed(text)
        parser.finish()
        parsed = parser.result()
        msg: AssistantMessage = {
            "role": "assistant",
            # with tools offered, null when there is none, as the stream (which opens
            # with null then) adds up to; without, "" as any answer without text
            "content": (
                parsed.content or None if self.output.format is not None else parsed.content
            ),
        }
        if parsed.reasoning:
            msg["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            msg["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in parsed.calls
            ]
        return msg, bool(parsed.calls)

    def choice(self, c: Completion, prompt: list[int], index: int) -> ChatChoice:
        lp = (
            chat_logprobs(c.logprobs, self.served.engine_piece)
            if c.logprobs or self.logprobs
            else None
        )
        message, called = self._message(c.text)
        choice: ChatChoice = {
            "index": index,
            "finish_reason": _finish_reason(c, called),
            "logprobs": lp,
            "message": message,
        }
        if self.token_ids:
            choice["token_ids"] = list(c.token_ids)
            choice["prompt_token_ids"] = prompt
        return choice

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return cast(ChatCompletionChunk, self._chunk_of(choice))

    def opening(self, index: int = 0) -> ChatCompletionChunk:
        """The role first, with OpenAI's empty content; null content where the answer
        may be only tool calls, as OpenAI streams it, so that a client that adds the
        deltas up (the ``openai`` client's stream helper) has the whole answer's null
        content, not ``""``, when the model only called tools."""
        calls = self.output is not None and self.output.format is not None
        delta: Delta = {"role": "assistant", "content": None if calls else ""}
        return self._chunk(
            {"index": index, "finish_reason": None, "logprobs": None, "delta": delta}
        )

    def chunk(self, e: TokenEvent, index: int = 0, offset: int = 0) -> ChatCompletionChunk:
        lp = None if e.logprob is None else chat_logprobs([e.logprob], self.served.engine_piece)
        choice: ChatChunkChoice = {
            "index": index,
            "finish_reason": None,
            "logprobs": lp,
            "delta": {"content": e.text},
        }
        if self.token_ids:
            choice["token_ids"] = [] if e.token_id is None else [e.token_id]
        return self._chunk(choice)

    def token_stream(self, index: int = 0) -> TokenStream:
        if self.output is None:
            return TokenChunks(self, index)
        return ParsedChunks(self, self.parser(index), index)

    def part_chunks(self, parts: list[Part], e: TokenEvent | None, index: int = 0) -> bytes:
        """The chunks of a choice's parsed parts; the first carries the token's
        logprobs and id (alone, with an empty delta, when the parser held its text)."""
        deltas = [_delta(p) for p in parts]
        if not deltas and e is not None and (self.token_ids or e.logprob is not None):
            deltas = [{}]
        out = []
        for i, delta in enumerate(deltas):
            choice: ChatChunkChoice = {
                "index": index,
                "finish_reason": None,
                "logprobs": None,
                "delta": delta,
            }
            if i == 0 and e is not None:
                if e.logprob is not None:
                    choice["logprobs"] = chat_logprobs([e.logprob], self.served.engine_piece)
                if self.token_ids:
                    choice["token_ids"] = [] if e.token_id is None else [e.token_id]
            out.append(encode(self._chunk(choice)))
        return b"".join(out)

    def _final(self, c: Completion, index: int) -> ChatCompletionChunk:
        parser = self._parsers.get(index)
        reason = _finish_reason(c, parser is not None and bool(parser.calls))
        return self._chunk({"index": index, "finish_reason": reason, "logprobs": None, "delta": {}})


def _finish_reason(c: Completion, called: bool) -> FinishReason | Literal["tool_calls"]:
    """OpenAI's ``tool_calls`` for an answer that ended by itself after calling tools."""
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


def _delta(part: Part) -> Delta:
    """A parsed part as OpenAI streams it."""
    if isinstance(part, Text):
        return (
            {"content": part.text} if part.kind == "content" else {"reasoning_content": part.text}
        )
    call: ToolCallDelta
    if isinstance(part, CallStart):
        call = {
            "index": part.index,
            "id": part.id,
            "type": "function",
            "function": {"name": part.name, "arguments": ""},
        }
    else:
        assert isinstance(part, CallArgs)
        call = {"index": part.index, "function": {"arguments": part.text}}
    return {"tool_calls": [call]}


class CompletionFormatter(Formatter):
    """Text completions; with a batch of prompts, the ``n`` choices of each prompt in
    turn (choice ``index`` answers prompt ``index // n``), as OpenAI numbers them."""

    OBJECT = CHUNK_OBJECT = "text_completion"  # full responses and chunks, as OpenAI has it
    ID_PREFIX = "cmpl-"

    def __init__(
        self,
        served: Served,
        body: CompletionRequest,
        request_id: str,
        prompts: Sequence[list[int]],
        pieces: Sequence[Sequence[bytes]] | None = None,
    ) -> None:
        """``prompts``: each prompt's tokens, in the request's order; ``pieces``: with
        echo and logprobs, each prompt token's text as the echo writes the prompt
        (``echo_pieces``), by prompt; the tokens' own pieces by default."""
        super().__init__(served, body, request_id)
        self.prompts = [list(p) for p in prompts]
        given = body.prompts()
        # each prompt's text as echo writes it: the start of its choices' text
        self.echoes = (
            [_echoed(served, g, p) for g, p in zip(given, self.prompts, strict=True)]
            if body.echo
            else [""] * len(self.prompts)
        )
        # echo with logprobs: the prompt's tokens are scored, and the echo carries them
        self.scored = body.scores_prompt()
        self.pieces = [list(p) for p in pieces] if pieces is not None else None

    @property
    def echoed(self) -> str:
        """The first prompt's echo."""
        return self.echoes[0]

    def _of(self, index: int) -> int:
        """The prompt choice ``index`` answers."""
        return index // self.n

    def text_start(self, index: int = 0) -> int:
        return len(self.echoes[self._of(index)])

    def _prompt_logprobs(self, scores: Sequence[TokenLogprob], index: int) -> CompletionLogprobs:
        """Choice ``index``'s echoed prompt's logprobs (tokens, the first one's null,
        alternatives and offsets) from the engine's scores of its tokens after the
        first."""
        k = self._of(index)
        pieces = self.pieces[k] if self.pieces is not None else None
        if pieces is None:
            pieces = [self.served.engine_piece(t) for t in self.prompts[k]]
        return prompt_logprobs(pieces, scores, self.served.engine_piece)

    def choice(self, c: Completion, prompt: list[int], index: int) -> TextChoice:
        """``prompt`` is not read: each choice's own prompt is known here."""
        piece = self.served.engine_piece
        echoed = self.echoes[self._of(index)]
        logprobs = None
        if c.logprobs or self.logprobs:
            logprobs = completion_logprobs(c.logprobs, piece, len(echoed))
            if self.scored:
                scored = self._prompt_logprobs(c.prompt_logprobs or (), index)
                logprobs = joined_logprobs(scored, logprobs)
        choice: TextChoice = {
            "index": index,
            "finish_reason": c.finish_reason,
            "logprobs": logprobs,
            "text": echoed + c.text,
        }
        if self.token_ids:
            choice["token_ids"] = list(c.token_ids)
            choice["prompt_token_ids"] = self.prompts[self._of(index)]
        return choice

    def _chunk(self, choice: TextChoice) -> TextCompletion:
        return cast(TextCompletion, self._chunk_of(choice))

    def opening(self, index: int = 0) -> TextCompletion | None:
        """With ``echo``, the prompt's text, before the answer's (as OpenAI streams it);
        with logprobs too, it waits for the prompt's scores (``chunk``)."""
        echoed = self.echoes[self._of(index)]
        if not echoed or self.scored:
            return None
        return self._chunk(
            {"index": index, "finish_reason": None, "logprobs": None, "text": echoed}
        )

    def chunk(self, e: TokenEvent, index: int = 0, offset: int = 0) -> TextCompletion:
        piece = self.served.engine_piece
        if e.prompt_logprobs is not None:  # the prompt is computed: the echo, scored
            return self._chunk(
                {
                    "index": index,
                    "finish_reason": None,
                    "logprobs": self._prompt_logprobs(e.prompt_logprobs, index),
                    "text": self.echoes[self._of(index)],
                }
            )
        lp = None if e.logprob is None else completion_logprobs([e.logprob], piece, offset)
        choice: TextChoice = {
            "index": index,
            "finish_reason": None,
            "logprobs": lp,
            "text": e.text,
        }
        if self.token_ids:
            choice["token_ids"] = [] if e.token_id is None else [e.token_id]
        return self._chunk(choice)

    def _final(self, c: Completion, index: int) -> TextCompletion:
        return self._chunk(
            {"index": index, "finish_reason": c.finish_reason, "logprobs": None, "text": ""}
        )


class Vocabulary(Protocol):
    """What ``echo_pieces`` reads of the engine (``EngineClient`` has it)."""

    def piece(self, token: int, special: bool = False) -> bytes: ...

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]: ...


def echo_pieces(vocab: Vocabulary, given: str | list[int], prompt: list[int]) -> list[bytes]:
    """Each prompt token's text as ``echo`` writes the prompt, so that an echoed
    prompt's logprobs tokens add up to it: token ids as their text (control tokens
    as nothing), as echo detokenizes them; a text prompt as the client wrote it: a
    control token such as ``<|im_start|>`` as its text, nothing for a token that
    tokenizing added (BOS), and without the space a SentencePiece vocabulary puts
    before a text and after a control token, where taking it off gives the text
    back exactly."""
    if not isinstance(given, str):
        return [vocab.piece(t) for t in prompt]
    written = vocab.tokenize(given, add_special=False)
    n = len(written)
    start = next((k for k in range(len(prompt) - n + 1) if prompt[k : k + n] == written), None)
    pieces = [
        vocab.piece(t, special=True) if start is None or start <= i < start + n else b""
        for i, t in enumerate(prompt)
    ]
    text = given.encode("utf-8")
    if b"".join(pieces) == text:
        return pieces
    trimmed = list(pieces)
    after_control = True  # the text's start is a fragment's start too
    for i, t in enumerate(prompt):
        if not pieces[i]:
            continue
        if after_control and pieces[i].startswith(b" "):
            trimmed[i] = pieces[i][1:]
        after_control = not vocab.piece(t)  # a control token: nothing as plain text
    return trimmed if b"".join(trimmed) == text else pieces


def _echoed(served: Served, given: str | list[int], prompt: list[int]) -> str:
    """The prompt as ``echo`` returns it: a text prompt as the client wrote it (control
    tokens written as text, such as ``<|im_start|>``, stay; detokenizing would drop
    them), a prompt of token ids as their text."""
    return given if isinstance(given, str) else served.detokenize(prompt)


# -- streaming -----------------------------------------------------------------------

DONE = event("[DONE]")
CUT_SHORT_WAIT_S = 30.0
"""How long a stream whose client left waits for its request's final event (the engine
sends it within one step of the cancel) to log the request's figures."""
_TEXT_MARK = "\u0000orin-text\u0000"
_json_string = json.encoder.encode_basestring  # json.dumps(text, ensure_ascii=False), in C


class TokenStream(Protocol):
    """A stream's tokens -> SSE bytes (empty while the text is held back)."""

    def token(self, e: TokenEvent) -> bytes: ...

    def flush(self) -> bytes:
        """What was held back, once the last token is in."""
        ...


class TokenChunks:
    """The SSE bytes of a request's token chunks.

    A plain token chunk differs from the next only in its text, so the JSON
    around the text is encoded once per request and each token costs one
    encoding of its text: the per-token work of the stream is Python that
    competes with llama.cpp's threads for the same cores. Chunks that carry
    token ids or logprobs are built in full by the formatter.
    """

    def __init__(self, fmt: Formatter, index: int = 0) -> None:
        self.fmt, self.index = fmt, index
        template = encode(fmt.chunk(TokenEvent(fmt.request_id, None, _TEXT_MARK), index))
        head, tail = template.split(_json_string(_TEXT_MARK).encode())
        self._head, self._tail = head, tail
        self._plain = not fmt.token_ids
        # where the next token with a logprob starts in the choice's text: its tokens'
        # text counted, as a whole answer's text_offset counts it. Not the text sent so
        # far: while a possible stop string holds text back, a token's event carries
        # the held text of the tokens before it, and a held token's logprob comes in
        # an event of its own, after its text began
        self.at = fmt.text_start(index)

    def token(self, e: TokenEvent) -> bytes:
        if self._plain and e.logprob is None and e.prompt_logprobs is None:
            return b"".join((self._head, _json_string(e.text).encode(), self._tail))
        out = encode(self.fmt.chunk(e, self.index, self.at))
        if e.logprob is not None:
            piece = self.fmt.served.engine_piece(e.logprob.token_id)
            self.at += len(piece.decode("utf-8", "replace"))
        return out

    def flush(self) -> bytes:
        return b""


class ParsedChunks:
    """The SSE bytes of a chat choice whose text is parsed (tools, reasoning): each
    token's text goes through the choice's parser, and its parts become deltas."""

    def __init__(self, fmt: ChatFormatter, parser: OutputParser, index: int = 0) -> None:
        self.fmt, self.parser, self.index = fmt, parser, index

    def token(self, e: TokenEvent) -> bytes:
        return self.fmt.part_chunks(self.parser.feed(e.text), e, self.index)

    def flush(self) -> bytes:
        return self.fmt.part_chunks(self.parser.finish(), None, self.index)


async def sse_events(
    fmt: Formatter,
    streams: RequestStream | Sequence[RequestStream],
    on_finish: Callable[[Sequence[Completion]], None],
) -> AsyncIterator[bytes]:
    """A streamed answer's SSE events, one request stream per choice (``n``);
    ``on_finish`` sees every choice's collected request, in choice order, before the
    last events go out. Each choice's chunks carry its index and end with its finish reason;
    the last choice to end carries the figures. If the client goes away,
    EventStream cancels this generator and the ``finally`` cancels every choice,
    freeing their slots within one engine step.

    The events that are ready together (a client or loop that fell behind) go
    out in one write, and so do the last ones (the last choice's finish, the
    usage and ``[DONE]``, as ``LastEvents`` with the end of the body). One stream
    (``n`` = 1, the common case) is read directly: no generator or task between
    its events and this one, which runs for every token.
    """
    many: list[RequestStream] = (
        list(streams) if isinstance(streams, (list, tuple)) else [cast(RequestStream, streams)]
    )
    answer = _Answer(fmt, many, on_finish)
    batches = _batches(many) if len(many) > 1 else None
    try:
        for i in range(len(many)):
            opening = fmt.opening(i)
            if opening is not None:
                yield encode(opening)
        if batches is None:
            stream = many[0]
            while ready := await stream.next_batch():
                if out := answer.events(0, ready):
                    yield out
        else:
            async for i, ready in batches:
                if out := answer.events(i, ready):
                    yield out
    finally:
        for stream in many:
            stream.cancel()  # a no-op when the request already finished
        if batches is not None:
            await batches.aclose()  # its waits on the streams end before the one below
        if len(answer.done) < len(many):  # cut short (the client left): the log's figures
            # bounded: an engine that is stuck (the watchdog's case) or gone never sends
            # the final event, and the connection's task must still end
            with contextlib.suppress(asyncio.TimeoutError):  # not TimeoutError on 3.10
                await asyncio.wait_for(answer.cut_short(), CUT_SHORT_WAIT_S)


class _Answer:
    """What ``sse_events`` keeps between two batches of events: each choice's
    events so far (collected when it ends), its token chunks and the completions."""

    def __init__(
        self,
        fmt: Formatter,
        streams: list[RequestStream],
        on_finish: Callable[[Sequence[Completion]], None],
    ) -> None:
        self.fmt, self.streams, self.on_finish = fmt, streams, on_finish
        self.chunks = [fmt.token_stream(i) for i in range(len(streams))]
        self.with_ids = fmt.token_ids
        self.seen: list[list[TokenEvent]] = [[] for _ in streams]
        self.done: dict[int, Completion] = {}

    def events(self, i: int, ready: list[TokenEvent]) -> bytes:
        """The SSE bytes of choice ``i``'s events that were ready together; after the
        last choice's final event, ``LastEvents`` (nothing may follow)."""
        self.seen[i] += ready
        chunks, with_ids = self.chunks[i], self.with_ids
        out = [
            b
            for e in ready
            if e.finish_reason is None
            and (e.text or with_ids or e.logprob is not None or e.prompt_logprobs is not None)
            if (b := chunks.token(e))
        ]
        final = ready[-1]
        if final.finish_reason is None:
            return out[0] if len(out) == 1 else b"".join(out)
        out.append((chunks.token(final) if final.text else b"") + chunks.flush())
        c = self.done[i] = collect(self.streams[i].request_id, self.seen[i])
        n = len(self.streams)
        last = len(self.done) == n
        if c.finish_reason not in _CUT:  # a cut choice ends with the error event instead
            figures = [self.done[j] for j in range(n)] if last else ()
            out.append(encode(self.fmt.final_chunk(c, i, figures)))
        if not last:
            return b"".join(out)
        return LastEvents(b"".join(out) + self._tail([self.done[j] for j in range(n)]))

    async def cut_short(self) -> None:
        """Take each choice's events up to its final one after the stream was cut short
        (its requests cancelled: the final events come within one engine step), and
        hand the collected requests to ``on_finish``, after each choice the ones so
        far: the access log then has the tokens they were served and their latencies,
        as for an answer that ended."""
        got: list[Completion] = []
        for i, stream in enumerate(self.streams):
            if i in self.done:
                got.append(self.done[i])
            else:
                seen = self.seen[i]
                while ready := await stream.next_batch():
                    seen += ready
                if not (seen and seen[-1].finish_reason is not None):
                    continue
                got.append(collect(stream.request_id, seen))
            self.on_finish(got)

    def _tail(self, cs: list[Completion]) -> bytes:
        """After every choice ended: an error event or the usage chunk, then ``[DONE]``.

        A choice that failed, or that the engine cancelled (the server shutting
        down, a client that stopped reading), ends the stream with an OpenAI error
        event, ``data: {"error": {...}}``, never with a finish reason OpenAI does
        not have: the official client raises it as ``openai.APIError``."""
        self.on_finish(cs)
        failed = next((c for c in cs if c.finish_reason == "error"), None)
        if failed is not None:
            err = error_body(
                failed.error or "generation failed",
                GenerationFailed.type,
                None,
                GenerationFailed.code,
                failed.request_id,
            )
            return event(json.dumps(err)) + DONE
        cut = next((c for c in cs if c.finish_reason == "cancelled"), None)
        if cut is not None:
            draining = self.fmt.served.draining
            message = interrupted_message(cut, draining)
            code = Interrupted.code if draining else "cancelled"
            err = error_body(message, Interrupted.type, None, code, cut.request_id)
            return event(json.dumps(err)) + DONE
        if self.fmt.include_usage:
            return encode(self.fmt.usage_chunk(cs)) + DONE
        return DONE


_CUT = ("error", "cancelled")  # choices that end with the error event, not a final chunk


def interrupted_message(c: Completion, draining: bool) -> str:
    """Why an answer stopped before its end, and how far it got."""
    why = "the server is shutting down" if draining else "the request was cancelled"
    return f"{why}: the answer was cut short after {len(c.token_ids)} tokens; retry it"


async def _batches(
    streams: list[RequestStream],
) -> AsyncGenerator[tuple[int, list[TokenEvent]], None]:
    """(choice, events ready together) from every stream as they come, until each
    has delivered its final event (several streams: one task per wait)."""
    waiting = {asyncio.ensure_future(s.next_batch()): i for i, s in enumerate(streams)}
    try:
        while waiting:
            finished, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for task in finished:
                i = waiting.pop(task)
                ready = task.result()
                if ready:
                    waiting[asyncio.ensure_future(streams[i].next_batch())] = i
                    yield i, ready
    finally:
        for task in waiting:
            task.cancel()
        # ended before this returns: a wait left behind would drop the next reader's
        await asyncio.gather(*waiting, return_exceptions=True)
