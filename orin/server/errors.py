"""One table: exception type -> HTTP status and OpenAI error JSON.

Nothing here matches on message text. No traceback ever reaches a client: an
unexpected exception is logged with the request id, and the response carries
the same id.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from orin.engine.errors import (
    ContextLengthExceeded,
    EngineStopped,
    InvalidRequest,
    QueueFull,
)

log = logging.getLogger("orin.server")

RETRY_AFTER_S = 1


class ApiError(Exception):
    """An error the server raises itself (auth, model name, body size, state)."""

    status = 400
    type = "invalid_request_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class Unauthorized(ApiError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class ModelNotFound(ApiError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class BodyTooLarge(ApiError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class Loading(ApiError):
    status, type, code = 503, "service_unavailable", "model_loading"


class Interrupted(ApiError):
    """An answer the server cancelled before its end because it is shutting down: a
    503 with Retry-After for a whole answer (clients retry it, on another instance
    behind a balancer), the same type and code in a stream's error event."""

    status, type, code = 503, "service_unavailable", "server_shutdown"


class GenerationFailed(ApiError):
    """A whole answer the engine could not finish (llama.cpp failed, an RPC worker was
    lost): a 500 whose message is the engine's, as a stream's error event has it."""

    status, type, code = 500, "server_error", "generation_failed"


@dataclass(frozen=True)
class Spec:
    status: int
    type: str
    code: str | None
    retry: bool = False


TABLE: dict[type[Exception], Spec] = {
    ContextLengthExceeded: Spec(400, "invalid_request_error", "context_length_exceeded"),
    InvalidRequest: Spec(400, "invalid_request_error", "invalid_value"),
    QueueFull: Spec(429, "rate_limit_error", "queue_full", retry=True),
    EngineStopped: Spec(503, "service_unavailable", "unavailable", retry=True),
}


def error_body(
    message: str, type_: str, param: str | None, code: str | None, request_id: str | None
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": type_,
            "param": param,
            "code": code,
            "request_id": request_id,
        }
    }


def _request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


# the field a prompt that does not fit the context comes in, by route
PROMPT_FIELD = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/v1/embeddings": "input",
}


def to_response(exc: Exception, request_id: str | None, path: str | None = None) -> JSONResponse:
    """The response for any exception, by type; ``path`` (the request's) names the
    field of an over-long prompt: ``messages`` for chat, ``prompt`` for completions."""
    headers = {"x-request-id": request_id} if request_id else {}
    if isinstance(exc, ApiError):
        if exc.status in (429, 503):
            headers["Retry-After"] = str(RETRY_AFTER_S)
        body = error_body(str(exc), exc.type, exc.param, exc.code, request_id)
        return JSONResponse(body, exc.status, headers)
    for cls in type(exc).__mro__:
        spec = TABLE.get(cls)
        if spec is not None:
            if spec.retry:
                headers["Retry-After"] = str(RETRY_AFTER_S)
            param = getattr(exc, "param", None)
            if isinstance(exc, ContextLengthExceeded) and param is None:
                param = PROMPT_FIELD.get(path or "", "messages")
            body = error_body(str(exc), spec.type, param, spec.code, request_id)
            return JSONResponse(body, spec.status, headers)
    log.error("request %s failed", request_id, exc_info=exc)
    message = f"internal server error (request id {request_id})"
    return JSONResponse(error_body(message, "server_error", None, None, request_id), 500, headers)


async def on_exception(request: Request, exc: Exception) -> JSONResponse:
    return to_response(exc, _request_id(request), request.url.path)


async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    """pydantic's complaint about a body, as a 400 naming the first offending field."""
    assert isinstance(exc, RequestValidationError)
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        param, message = None, "the request body is not valid JSON"
    elif not loc:  # the body as a whole: empty, or not read as JSON
        param = None
        message = "the request body must be a JSON object, sent with Content-Type: application/json"
    else:
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
        message = message.replace("Value error, ", "")
    body = error_body(
        message, "invalid_request_error", param, "invalid_value", _request_id(request)
    )
    return JSONResponse(body, 400, {"x-request-id": _request_id(request) or ""})


# the codes of the errors the router raises itself: a path no route serves, a method
# the path's route does not take
HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}


async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (an unknown path, a method a route does not take) in
    OpenAI's shape, with a code; the message names the method and path."""
    assert isinstance(exc, HTTPException)
    rid = _request_id(request)
    type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
    message = str(exc.detail)
    if exc.status_code in HTTP_CODES:
        message = f"{message}: {request.method} {request.url.path}"
    body = error_body(message, type_, None, HTTP_CODES.get(exc.status_code), rid)
    headers = {"x-request-id": rid or ""}
    if exc.headers:  # a 405's Allow
        headers = {**exc.headers, **headers}
    return JSONResponse(body, exc.status_code, headers)
