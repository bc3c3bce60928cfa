"""Routes only: the OpenAI-compatible endpoints, health and metrics."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from orin.engine.errors import EngineError, InvalidRequest
from orin.engine.stream import Completion, RequestStream, collect
from orin.engine.types import RequestTimings
from orin.engine.vision import MediaPrompt, RGBImage
from orin.server import dashboard, errors, extras, images, protocol, tools
from orin.server.auth import protect
from orin.server.errors import GenerationFailed, Loading, ModelNotFound
from orin.server.jsonbody import JsonRoute
from orin.server.middleware import CLIENT_LEFT, RequestContext
from orin.server.responses import (
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    echo_pieces,
    sse_events,
)
from orin.server.sse import EventStream
from orin.server.state import ServerState


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="orin-llm", version=state.version, docs_url=None, redoc_url=None)
    app.state.orin = state
    app.router.route_class = JsonRoute  # bodies read by jsonbody.loads: text must be Unicode
    app.add_exception_handler(RequestValidationError, errors.on_validation_error)
    app.add_exception_handler(HTTPException, errors.on_http_exception)
    # expected errors by type; Exception alone is the 500 path (Starlette logs those)
    app.add_exception_handler(errors.ApiError, errors.on_exception)
    app.add_exception_handler(EngineError, errors.on_exception)
    app.add_exception_handler(Exception, errors.on_exception)
    protect(app, state)  # the API key on every route but /health, and CORS (auth.py)
    app.add_middleware(RequestContext, state=state, routes=app.router.routes)
    _register(app, state)
    return app


def _register(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    def health() -> JSONResponse:
        return JSONResponse(*state.health())

    @app.get("/metrics")
    def metrics() -> Response:
        s = state.engine.status()  # as of now: a cancellation on an idle engine runs no step
        state.metrics.update_load(s.slots_busy, s.waiting, s.kv_cells_used)
        state.metrics.update_engine_totals(s.slot_moves, s.prompt_cache, s.prompt_splits)
        if state.telemetry is not None:  # phase counters up to the latest sample
            state.telemetry.sampler.flush()
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/telemetry")
    def telemetry() -> JSONResponse:
        if state.telemetry is None:
            return JSONResponse({"source": None, "phase": None}, 200)
        return JSONResponse(state.telemetry.snapshot())

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"object": "list", "data": [extras.model_object(state)]}

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatCompletionRequest, request: Request) -> Any:
        _check_model(state, body.model)
        protocol.check_message_order(body.messages)
        protocol.check_continuation(body)
        pictures: list[RGBImage] | None = []
        if body.image_parts():  # a fetch from a listed host may take its 10 s
            pictures = await until_client_leaves(request, _images(state, body))
            if pictures is None:  # nobody to answer: the fetch was stopped
                return Response(status_code=CLIENT_LEFT)

        def render() -> tuple[str, bool, list[int]]:
            text, add_bos = state.engine.render_chat(
                body.template_messages(),
                body.offered_tools(),
                body.template_kwargs(),
                body.generation_prompt(),
                body.continue_final_message,
            )
            tokens = [] if pictures else state.engine.tokenize(text, add_special=add_bos)
            return text, add_bos, tokens

        text, add_bos, prompt = await off_loop_if_large(request, render)
        media = None
        if pictures:  # tokenized with the images (preprocessing them) off the event loop
            media = await asyncio.to_thread(state.engine.tokenize_media, text, pictures, add_bos)
            prompt = media.tokens
            pictures = None  # megabytes of pixels each: not held while the request runs
        caps = state.engine.chat_caps()
        output = tools.output_spec(body, caps, text)
        body.constrain(tools.required_grammar(body, output))
        fmt = ChatFormatter(state, body, _rid(request), output)
        preserve = state.engine.control_tokens(output.marker_texts())
        return await _run(state, request, body, [prompt], fmt, preserve, media)

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request) -> Any:
        _check_model(state, body.model)
        given = body.prompts()

        def tokenize() -> tuple[list[list[int]], list[list[bytes]] | None]:
            prompts = [state.engine.tokenize(p) if isinstance(p, str) else p for p in given]
            if not body.scores_prompt():
                return prompts, None
            # the echo's logprobs: each token's text as echoed
            try:
                return prompts, [
                    echo_pieces(state.engine, g, p) for g, p in zip(given, prompts, strict=True)
                ]
            except InvalidRequest as exc:  # a token id outside the vocabulary
                raise exc.renamed("prompt") from None

        prompts, pieces = await off_loop_if_large(request, tokenize)
        fmt = CompletionFormatter(state, body, _rid(request), prompts, pieces)
        return await _run(state, request, body, prompts, fmt)

    extras.register(app, state)  # embeddings, tokenize, detokenize, /v1/models/{id}
    dashboard.register(app, state)  # /, /login, assets, /dashboard/data, /slots


async def _images(state: ServerState, body: protocol.ChatCompletionRequest) -> list[RGBImage]:
    """The request's images, decoded within the profile's limits (orin/server/images.py);
    a 400 naming the content part when one is broken, too large, not allowed, or when
    the model has no vision projector."""
    parts = body.image_parts()
    if not parts:
        return []
    if not state.engine.supports_images:
        raise images.BadImage(
            "this model takes no images: the profile sets no model.mmproj",
            parts[0][0].removesuffix(".image_url"),
        )
    limits = state.image_limits
    left = limits.max_request_pixels  # decoded images add up: a budget for the request
    out = []
    for param, part in parts:
        img = await images.load(part.url, limits, param, pixels_left=left)
        left -= img.width * img.height
        out.append(img)
    return out


T = TypeVar("T")

INLINE_BODY_BYTES = 4096
"""A chat or completion request whose body is at most this large renders and
tokenizes its prompt on the event loop, which takes well under a millisecond; a
larger one on a worker thread. A body of up to server.max_body_bytes (2 MiB) of
messages takes seconds to render and tokenize, and on the loop every other
client's stream would stop for as long; the hop to a worker thread costs a short
request more than the work (it waits for a core that llama.cpp's threads hold)."""


async def off_loop_if_large(request: Request, work: Callable[[], T]) -> T:
    """``work()``, on a worker thread when the request's body is larger than
    ``INLINE_BODY_BYTES`` (or of unknown size), else right here on the loop."""
    size = request.headers.get("content-length", "")
    if size.isdigit() and int(size) <= INLINE_BODY_BYTES:
        return work()
    return await asyncio.to_thread(work)


async def until_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result; None when the client leaves first, and then ``work`` is
    cancelled at once (an image fetch closes its connection, an embedding job is
    dropped) rather than run for nobody. The client's leaving is seen as the
    streamed answers and the whole ones see it: the ``http.disconnect`` message."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    job = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({job, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if job.done():
            return job.result()
        job.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await job
        return None
    finally:
        watcher.cancel()
        if not job.done():
            job.cancel()


def _check_model(state: ServerState, name: str | None) -> None:
    if state.engine.state in ("new", "loading"):
        raise Loading("the model is still loading; retry shortly")
    if name is not None and name != state.model_name and state.model_match == "strict":
        raise ModelNotFound(
            f"model '{name}' is not served here; this server serves '{state.model_name}'",
            param="model",
        )


def _access_timings(completions: Sequence[Completion], n: int) -> RequestTimings | None:
    """The figures of a request's access log line: with ``n`` choices (of each prompt
    of a batch), the tokens of every choice and the prompt and cached tokens as
    ``usage`` counts them (protocol.usage), the times of the first choice, as the
    response's ``timings`` carries them."""
    first = completions[0].timings
    if first is None:
        return None
    counted = protocol.usage(completions, n)
    return replace(
        first,
        generated_tokens=sum(c.timings.generated_tokens for c in completions if c.timings),
        prompt_tokens=counted["prompt_tokens"],
        cached_tokens=counted["prompt_tokens_details"]["cached_tokens"],
    )


async def _run(
    state: ServerState,
    request: Request,
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
    prompts: list[list[int]],
    fmt: Formatter,
    preserve: tuple[int, ...] = (),
    media: MediaPrompt | None = None,
) -> Any:
    """``prompts``: chat's one, or a completion's (a batch of them)."""
    body.refuse_unsupported()
    ignored = body.ignored_fields()
    if ignored:
        protocol.log.info("request %s: ignoring unknown fields %s", _rid(request), ignored)
    streams = await _submit(state, request, body, prompts, preserve, media)
    if body.stream:

        def finished(cs: Sequence[Completion]) -> None:
            request.state.timings = _access_timings(cs, body.n)

        return EventStream(sse_events(fmt, streams, finished), ping_s=15.0)
    completions = await _collect_or_cancel(request, streams)
    request.state.timings = _access_timings(completions, body.n)
    failed = next((c for c in completions if c.finish_reason == "error"), None)
    if failed is not None:
        raise GenerationFailed(failed.error or "generation failed")
    return fmt.response(completions, prompts[0])


async def _submit(
    state: ServerState,
    request: Request,
    body: protocol.ChatCompletionRequest | protocol.CompletionRequest,
    prompts: list[list[int]],
    preserve: tuple[int, ...],
    media: MediaPrompt | None = None,
) -> list[RequestStream]:
    """One engine request per choice (``n``) of each prompt, in turn: the scheduler
    prefills a prompt once and its other choices copy its cells. A choice the engine
    refuses (a full queue) withdraws those already queued."""
    rid = _rid(request)
    cfg = state.engine.cfg
    total = body.n * len(prompts)
    if total > cfg.slots + cfg.max_queue:  # a full queue's 429 would be retried forever
        one = len(prompts) == 1
        what = f"{body.n} choices" if one else f"{len(prompts)} prompts x {body.n} choices"
        raise InvalidRequest(
            "n" if one else "prompt",
            f"{what} can never be queued together here: this server holds "
            f"{cfg.slots + cfg.max_queue} requests at most (engine.slots {cfg.slots} + "
            f"server.max_queue {cfg.max_queue})",
        )
    streams: list[RequestStream] = []
    try:
        choices = [
            (prompt, params)
            for prompt in prompts
            for params in body.choice_params(
                state.sampling_defaults,
                state.max_tokens_cap,
                preserve,
                prompt_tokens=len(prompt),
                context=state.engine.cfg.context,
            )
        ]
        arrival = getattr(request.state, "arrival", None)
        last = len(choices) - 1
        for i, (prompt, params) in enumerate(choices):
            streams.append(
                await state.engine.submit_async(
                    prompt,
                    params,
                    request_id=rid if total == 1 else f"{rid}.{i}",
                    whole=not body.stream,
                    media=media,
                    arrival=arrival if i == last else None,  # queued: the engine may start
                )
            )
    except BaseException:
        for stream in streams:
            stream.cancel()
        raise
    return streams


def _rid(request: Request) -> str:
    return str(request.state.request_id)


async def _collect_or_cancel(request: Request, streams: list[RequestStream]) -> list[Completion]:
    """Wait for every choice; a client that leaves first cancels them at once (and the
    access log and metrics count the request as 499, not as the server's failure)."""

    async def watch() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                request.state.client_left = True
                for stream in streams:
                    stream.cancel()
                return

    async def one(stream: RequestStream) -> Completion:
        return collect(stream.request_id, [e async for e in stream])

    watcher = asyncio.create_task(watch())
    try:
        return list(await asyncio.gather(*(one(s) for s in streams)))
    finally:
        watcher.cancel()
