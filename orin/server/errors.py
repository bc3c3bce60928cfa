"""One table: exception type -> HTTP status and OpenAI error JSON.

Nothing here matches on message text. No traceback ever reaches a client: an
unexpected exception is logged with the request id, and the response carries
the same id.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
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
from orin.server.jsonbody import LoneSurrogate

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


class BodyTimeout(ApiError):
    status, type, code = 408, "invalid_request_error", "request_timeout"


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


# the codes of a body's invalid field, and of a required one it left out (OpenAI's)
INVALID, MISSING = "invalid_value", "missing_required_parameter"


@dataclass(frozen=True)
class Spec:
    status: int
    type: str
    code: str | None
    retry: bool = False


TABLE: dict[type[Exception], Spec] = {
    ContextLengthExceeded: Spec(400, "invalid_request_error", "context_length_exceeded"),
    InvalidRequest: Spec(400, "invalid_request_error", INVALID),
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
    errors = list(exc.errors())
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    code = INVALID
    if isinstance(exc.__cause__, LoneSurrogate):  # JSON that parses, text that is not Unicode
        param, message = exc.__cause__.param, exc.__cause__.msg
    elif first.get("type") == "json_invalid":
        param, message = None, "the request body is not valid JSON"
    elif not loc:  # the body as a whole: empty, or not read as JSON
        param = None
        message = "the request body must be a JSON object, sent with Content-Type: application/json"
    else:
        param, message, code = validation_param_and_message(errors)
    body = error_body(message, "invalid_request_error", param, code, _request_id(request))
    return JSONResponse(body, 400, {"x-request-id": _request_id(request) or ""})


# the names pydantic gives the members of a union in an error's location: a type
# (`str`, `list[int]`, `literal['none','auto']`) or a model's class name. A request's
# field names are lower-case words, so anything else in a location is such a name.
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "none", "dict", "list", "any", "bytes"})


def _is_union_member(part: object) -> bool:
    return isinstance(part, str) and (_FIELD_NAME.fullmatch(part) is None or part in _TYPE_NAMES)


def _param(loc: Sequence[object]) -> str:
    """A location as OpenAI's errors name a parameter: `messages[0].content[1]`."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def validation_param_and_message(errors: Sequence[Any]) -> tuple[str, str, str]:
    """The `param`, message and code of pydantic's first complaint about a body, without
    the names pydantic gives a union's members (`stop.str`, `tool_choice.literal[...]`).
    The code is OpenAI's `missing_required_parameter` for a field left out (pydantic's
    `missing`, which the request models' own checks raise too), else `invalid_value`.

    A value that fits no member of a union gets one complaint per member; those about
    the part of the value that matched a member furthest (a content part's missing
    `text`, not the whole `content` that is not a string) name the parameter, and their
    messages are joined: `stop: Input should be a valid string; or Input should be a
    valid list`."""

    def where(e: Any) -> list[object]:
        return [p for p in e.get("loc", ()) if p != "body"]

    first = where(errors[0])
    tag = next((i for i, p in enumerate(first) if _is_union_member(p)), None)
    if tag is None:
        chosen = [errors[0]]
    else:
        same_union = [e for e in errors if where(e)[:tag] == first[:tag] and len(where(e)) > tag]
        depth = max(len(_stripped(where(e))) for e in same_union)
        deepest = [e for e in same_union if len(_stripped(where(e))) == depth]
        chosen = [e for e in deepest if _stripped(where(e)) == _stripped(where(deepest[0]))]
    param = _param(_stripped(where(chosen[0])))
    messages = list(dict.fromkeys(str(e.get("msg", "")) for e in chosen))
    message = f"{param}: " + "; or ".join(messages)
    code = MISSING if all(e.get("type") == "missing" for e in chosen) else INVALID
    return param, message.replace("Value error, ", ""), code


def _stripped(loc: Sequence[object]) -> list[object]:
    return [p for p in loc if not _is_union_member(p)]


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
