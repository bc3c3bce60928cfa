"""Typed engine errors; the server maps each type to an HTTP status in one table."""

from __future__ import annotations

from orin.errors import OrinError


class EngineError(OrinError):
    """The engine cannot do what was asked."""


class QueueFull(EngineError):
    """Every slot is busy and the admission queue is at its bound."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request queue is full ({limit} waiting); retry later")
        self.limit = limit


class ContextLengthExceeded(EngineError):
    """A prompt does not fit the context window and the policy is to reject it."""

    def __init__(self, prompt_tokens: int, limit: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens, more than the context window of {limit} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class InvalidRequest(EngineError):
    """A request parameter is out of range; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message

    def renamed(self, param: str) -> InvalidRequest:
        """The same refusal, naming the field the client sent it in (``param``)."""
        return InvalidRequest(param, self.message)


class ContextShiftUnsupported(EngineError):
    """The sliding window needs a memory that can shift positions; this model's cannot."""


class EngineStopped(EngineError):
    """The engine is draining or stopped and takes no new requests."""


class BackendError(EngineError):
    """llama.cpp failed to load the model, create the context or decode."""
