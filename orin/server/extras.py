"""Routes beside chat and completions: ``POST /v1/embeddings`` (OpenAI's shapes),
``POST /tokenize`` and ``POST /detokenize`` (llama-server's), and
``GET /v1/models/{id}``; all behind the API key, like every route but /health
(orin/server/auth.py).

The engine is reached through ``EngineClient`` only: ``embed_async`` queues an
embedding job that the engine loop runs as steps of its own, and the vocabulary
calls answer on a worker thread (these routes are plain functions, which FastAPI
runs in its thread pool).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from orin.engine.client import EngineClient
from orin.engine.embed import Embeddings
from orin.engine.errors import InvalidRequest
from orin.server.errors import ModelNotFound
from orin.server.protocol_embed import (
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    embedding_response,
    piece_json,
)
from orin.server.state import ServerState

log = logging.getLogger("orin.server")

# nginx's "client closed request": the access log's status for a request whose
# client left before the answer (nothing reaches the client)
CLIENT_GONE = 499


def register(app: FastAPI, state: ServerState) -> None:
    """Add the routes to ``app`` (the key is checked in front of every route)."""
    # app imports this module: look them up now
    from orin.server.app import _check_model, off_loop_if_large, until_client_leaves

    @app.get("/v1/models/{model_id:path}")
    def model(model_id: str) -> dict[str, Any]:
        if model_id != state.model_name:
            raise ModelNotFound(
                f"model '{model_id}' is not served here; this server serves '{state.model_name}'",
                param="model",
            )
        return model_object(state)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        _check_model(state, body.model)
        body.refuse_unsupported()
        rid = str(request.state.request_id)
        ignored = body.ignored_fields()
        if ignored:
            log.info("request %s: ignoring unknown fields %s", rid, ignored)
        # text pieces among ids are tokenized here: a large body's on a worker thread
        inputs = await off_loop_if_large(
            request, lambda: [_pieces_to_ids(state, p) for p in body.inputs()]
        )
        job = state.engine.embed_async(inputs, body.dimensions, request_id=rid)
        result = await until_client_leaves(request, job)  # None: the client left, job dropped
        if result is None:
            return Response(status_code=CLIENT_GONE)
        state.metrics.on_embedding()
        # thousands of vectors take a while to encode: not on the event loop's thread
        return await run_in_threadpool(_response, result, state.model_name, body.encoding_format)

    @app.post("/tokenize")
    def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(state, None)
        tokens = tokenize_mixed(state.engine, body)
        if not body.with_pieces:
            return {"tokens": tokens}
        piece = state.engine.piece
        return {"tokens": [{"id": t, "piece": piece_json(piece(t, special=True))} for t in tokens]}

    @app.post("/detokenize")
    def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        _check_model(state, None)
        return {"content": state.engine.detokenize(body.tokens, special=True)}


def _response(result: Embeddings, model: str, encoding: str) -> JSONResponse:
    return JSONResponse(embedding_response(result, model, encoding))


def model_object(state: ServerState) -> dict[str, Any]:
    """The served model as /v1/models lists it."""
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "orin-llm",
        "meta": state.model_meta(),
    }


def tokenize_mixed(engine: EngineClient, body: TokenizeRequest) -> list[int]:
    """llama-server's ``tokenize_mixed``: text is tokenized (``add_special`` applies to
    a leading text part only), token ids pass through after a vocabulary check."""
    content = body.content
    if content is None:
        return []
    if isinstance(content, str):
        return engine.tokenize(content, body.add_special, body.parse_special)
    out = mixed_ids(engine, content, body.add_special, body.parse_special)
    ids = [p for p in content if not isinstance(p, str)]
    try:
        engine.detokenize(ids)  # raises for an id outside the vocabulary
    except InvalidRequest as exc:
        raise exc.renamed("content") from None
    return out


def mixed_ids(
    engine: EngineClient, parts: list[str | int], add_special: bool, parse_special: bool
) -> list[int]:
    """Token ids with text pieces among them, as one list of ids: a text piece is
    tokenized in place, ``add_special`` applying only to a leading one."""
    out: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            out += engine.tokenize(part, add_special and i == 0, parse_special)
        else:
            out.append(part)
    return out


def _pieces_to_ids(state: ServerState, prompt: str | list[str | int]) -> str | list[int]:
    """An embedding input in llama-server's mixed form as token ids (text and plain
    id lists go to the engine as they are)."""
    if isinstance(prompt, str) or all(isinstance(x, int) for x in prompt):
        return prompt  # type: ignore[return-value]
    return mixed_ids(state.engine, prompt, add_special=True, parse_special=True)
