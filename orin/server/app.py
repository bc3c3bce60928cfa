"""Routes only: the OpenAI-compatible endpoints, health and metrics."""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from orin.engine.errors import EngineError
from orin.engine.stream import Completion, RequestStream, collect
from orin.engine.types import SamplingParams, TokenEvent
from orin.server import errors, protocol
from orin.server.errors import Loading, ModelNotFound, Unauthorized
from orin.server.middleware import RequestContext
from orin.server.sse import EventStream, event
from orin.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="orin-llm", version=state.version, docs_url=None, redoc_url=None)
    app.state.orin = state
    app.add_exception_handler(RequestValidationError, errors.on_validation_error)
    app.add_exception_handler(HTTPException, errors.on_http_exception)
    # expected errors by type; Exception alone is the 500 path (Starlette logs those)
    app.add_exception_handler(errors.ApiError, errors.on_exception)
    app.add_exception_handler(EngineError, errors.on_exception)
    app.add_exception_handler(Exception, errors.on_exception)
    app.add_middleware(RequestContext, state=state)
    _register(app, state)
    return app


def _auth(state: ServerState) -> Any:
    def check(request: Request) -> None:
        if state.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), state.api_key.encode()
        ):
            raise Unauthorized("a valid API key is required (Authorization: Bearer <key>)")

    return Depends(check)


def _register(app: FastAPI, state: ServerState) -> None:
    auth = _auth(state)

    @app.get("/health")
    def health() -> JSONResponse:
        return JSONResponse(*state.health())

    @app.get("/metrics")
    def metrics() -> Response:
        e = state.engine  # gauges as of now: a cancellation on an idle engine runs no step
        state.metrics.update_load(e.slots_busy, e.waiting, e.kv_cells_used)
        if state.telemetry is not None:  # phase counters up to the latest sample
            state.telemetry.sampler.flush()
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/telemetry")
    def telemetry() -> JSONResponse:
        if state.telemetry is None:
            return JSONResponse({"source": None, "phase": None}, 200)
        return JSONResponse(state.telemetry.snapshot())

    @app.get("/v1/models", dependencies=[auth])
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "orin-llm",
                    "meta": state.model_meta(),
                }
            ],
        }

    @app.post("/v1/chat/completions", dependencies=[auth])
    async def chat(body: protocol.ChatCompletionRequest, request: Request) -> Any:
        _check_model(state, body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text, add_bos = state.chat.render(messages)
        prompt = state.engine.tokenize(text, add_special=add_bos)
        return await _run(state, request, body, prompt, "chat")

    @app.post("/v1/completions", dependencies=[auth])
    async def completions(body: protocol.CompletionRequest, request: Request) -> Any:
        _check_model(state, body.model)
        p = body.single_prompt()
        prompt = state.engine.tokenize(p) if isinstance(p, str) else p
        return await _run(state, request, body, prompt, "text")


def _check_model(state: ServerState, name: str | None) -> None:
    if state.engine.state in ("new", "loading"):
        raise Loading("the model is still loading; retry shortly")
    if name is not None and name != state.model_name:
        raise ModelNotFound(
            f"model '{name}' is not served here; this server serves '{state.model_name}'",
            param="model",
        )


async def _run(
    state: ServerState,
    request: Request,
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
    prompt: list[int],
    kind: str,
) -> Any:
    ignored = body.ignored_fields()
    if ignored:
        protocol.log.info("request %s: ignoring unknown fields %s", _rid(request), ignored)
    params = body.to_sampling(state.sampling_defaults, state.max_tokens_cap)
    stream = await state.engine.submit_async(
        prompt, params, request_id=_rid(request), whole=not body.stream
    )
    if body.stream:
        events = _sse(state, request, body, stream, params, kind)
        return EventStream(events, ping_s=15.0)
    completion = await _collect_or_cancel(request, stream)
    request.state.timings = completion.timings
    if completion.finish_reason == "error":
        raise RuntimeError(completion.error or "generation failed")
    return _full_response(state, body, completion, prompt, kind)


def _rid(request: Request) -> str:
    return str(request.state.request_id)


async def _collect_or_cancel(request: Request, stream: RequestStream) -> Completion:
    """Wait for the answer; a client that leaves first cancels the request at once."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                stream.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        events = [e async for e in stream]
    finally:
        watcher.cancel()
    return collect(stream.request_id, events)


def _full_response(
    state: ServerState,
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
    c: Completion,
    prompt: list[int],
    kind: str,
) -> dict[str, Any]:
    piece = state.engine_piece
    choice: dict[str, Any] = {"index": 0, "finish_reason": c.finish_reason, "logprobs": None}
    if kind == "chat":
        out = protocol.envelope("chat.completion", c.request_id, state.model_name)
        choice["message"] = {"role": "assistant", "content": c.text}
        if c.logprobs:
            choice["logprobs"] = protocol.chat_logprobs(c.logprobs, piece)
    else:
        out = protocol.envelope("text_completion", c.request_id, state.model_name)
        echo = isinstance(body, protocol.CompletionRequest) and body.echo
        choice["text"] = (state.detokenize(prompt) if echo else "") + c.text
        if c.logprobs:
            choice["logprobs"] = protocol.completion_logprobs(c.logprobs, piece)
    if body.return_token_ids:
        choice["token_ids"] = list(c.token_ids)
        choice["prompt_token_ids"] = prompt
    out.update(choices=[choice], usage=protocol.usage(c), timings=state.timings(c.timings))
    return out


async def _sse(
    state: ServerState,
    request: Request,
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
    stream: RequestStream,
    params: SamplingParams,
    kind: str,
) -> AsyncIterator[bytes]:
    """SSE events; if the client goes away, EventStream cancels this generator and
    the ``finally`` cancels the request, freeing its slot within one engine step.

    Token chunks go out as ready-made bytes (see ``TokenChunks``); the events that
    are ready together (a client or loop that fell behind) go out in one write.
    """
    chunks = TokenChunks(state, body, stream.request_id, kind)
    events: list[TokenEvent] = []
    try:
        if kind == "chat":
            role = {"role": "assistant", "content": ""}
            yield event(_chunk(state, stream.request_id, kind, role))
        while ready := await stream.next_batch():
            events += ready
            out = [
                chunks.token(e)
                for e in ready
                if e.finish_reason is None
                and (e.text or body.return_token_ids or e.logprob is not None)
            ]
            if out:
                yield out[0] if len(out) == 1 else b"".join(out)
        final = events[-1]
        if final.text:
            yield chunks.token(final)
        c = collect(stream.request_id, events)
        request.state.timings = c.timings
        if c.finish_reason == "error":
            err = errors.error_body(
                c.error or "generation failed", "server_error", None, None, stream.request_id
            )
            yield event(json.dumps(err))
        else:
            yield event(_final_chunk(state, body, stream.request_id, kind, c))
            if body.stream_options and body.stream_options.include_usage:
                usage = protocol.envelope(_object(kind), stream.request_id, state.model_name)
                usage.update(choices=[], usage=protocol.usage(c))
                yield event(json.dumps(usage))
        yield event("[DONE]")
    finally:
        stream.cancel()  # a no-op when the request already finished


def _object(kind: str) -> str:
    return "chat.completion.chunk" if kind == "chat" else "text_completion"


_TEXT_MARK = "\u0000orin-text\u0000"
_json_string = json.encoder.encode_basestring  # json.dumps(text, ensure_ascii=False), in C


class TokenChunks:
    """The SSE bytes of a request's token chunks.

    A plain token chunk differs from the next only in its text, so the JSON
    around the text is encoded once per request and each token costs one
    ``json.dumps`` of its text: the per-token work of the stream is Python that
    competes with llama.cpp's threads for the same cores. Chunks that carry
    token ids or logprobs are built in full.
    """

    def __init__(
        self,
        state: ServerState,
        body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
        rid: str,
        kind: str,
    ) -> None:
        self.state, self.body, self.rid, self.kind = state, body, rid, kind
        delta: dict[str, Any] | str = {"content": _TEXT_MARK} if kind == "chat" else _TEXT_MARK
        whole = _chunk(state, rid, kind, delta)
        head, tail = whole.split(_json_string(_TEXT_MARK))
        self._head, self._tail = b"data: " + head.encode(), tail.encode() + b"\n\n"
        self._plain = not body.return_token_ids

    def token(self, e: TokenEvent) -> bytes:
        if self._plain and e.logprob is None:
            text = _json_string(e.text).encode()
            return b"".join((self._head, text, self._tail))
        return event(_event_chunk(self.state, self.body, self.rid, self.kind, e))


def _chunk(
    state: ServerState, rid: str, kind: str, delta: dict[str, Any] | str, **extra: Any
) -> str:
    out = protocol.envelope(_object(kind), rid, state.model_name)
    choice: dict[str, Any] = {"index": 0, "finish_reason": None, "logprobs": None, **extra}
    if kind == "chat":
        choice["delta"] = delta
    else:
        choice["text"] = delta
    out["choices"] = [choice]
    return json.dumps(out, ensure_ascii=False)


def _event_chunk(
    state: ServerState,
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
    rid: str,
    kind: str,
    e: TokenEvent,
) -> str:
    extra: dict[str, Any] = {}
    if body.return_token_ids:
        extra["token_ids"] = [e.token_id] if e.token_id is not None else []
    if e.logprob is not None:
        fmt = protocol.chat_logprobs if kind == "chat" else protocol.completion_logprobs
        extra["logprobs"] = fmt([e.logprob], state.engine_piece)
    delta: dict[str, Any] | str = {"content": e.text} if kind == "chat" else e.text
    return _chunk(state, rid, kind, delta, **extra)


def _final_chunk(
    state: ServerState,
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
    rid: str,
    kind: str,
    c: Completion,
) -> str:
    out = protocol.envelope(_object(kind), rid, state.model_name)
    choice: dict[str, Any] = {"index": 0, "finish_reason": c.finish_reason, "logprobs": None}
    if kind == "chat":
        choice["delta"] = {}
    else:
        choice["text"] = ""
    out.update(choices=[choice], timings=state.timings(c.timings))
    if body.stream_options is None or not body.stream_options.include_usage:
        out["usage"] = protocol.usage(c)
    return json.dumps(out)
