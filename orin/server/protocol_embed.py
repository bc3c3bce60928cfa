"""Wire models of /v1/embeddings (OpenAI's shapes) and of llama-server's /tokenize and
/detokenize, and the response bodies built from engine results.

Requests are lenient like the other routes' (unknown fields are accepted and
logged), but the known ones are checked here with the field named in the 400:
an input that is not one of OpenAI's four shapes, an ``encoding_format`` other
than float or base64, a ``dimensions`` below 1. What depends on the model (the
vocabulary, the width, the pooling, the longest input) the engine checks.
"""

from __future__ import annotations

import base64
from typing import Any, Literal, cast

import numpy as np
import numpy.typing as npt
from pydantic import Field, field_validator

from orin.engine.embed import Embeddings
from orin.server.protocol import Refused, _Lenient


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


Piece = str | int
Prompt = str | list[Piece]  # text, or token ids with text pieces among them


def _prompt(value: Any) -> Prompt:
    """One prompt in any of llama-server's forms: a string, token ids (with text
    pieces among them), ``{"prompt_string": …}`` or ``{"content": [text parts]}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_id(x) or isinstance(x, str) for x in value):
        return list(value)
    if isinstance(value, dict):
        if isinstance(value.get("prompt_string"), str):
            return str(value["prompt_string"])
        parts = value.get("content")
        if isinstance(parts, list) and parts:
            texts = [
                p.get("text") for p in parts if isinstance(p, dict) and p.get("type") == "text"
            ]
            if len(texts) == len(parts) and all(isinstance(t, str) for t in texts):
                return "".join(cast(list[str], texts))
            if any(isinstance(p, dict) and p.get("type") == "image_url" for p in parts):
                raise ValueError("this model takes text only (an image_url part was given)")
            raise ValueError("content parts must be text parts: {type: text, text: …}")
    raise ValueError(
        "input must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists (llama-server's forms too: ids with text pieces, "
        "{prompt_string: …}, {content: [text parts]})"
    )


class EmbeddingRequest(_Lenient):
    """OpenAI's embeddings request, with llama-server's forms of a prompt."""

    input: Any = Field(
        ...,
        description="A string, a list of strings, token ids, or lists of token ids; also "
        "llama-server's forms: ids with text pieces among them, {prompt_string: …}, "
        "{content: [text parts]}.",
    )
    model: str | None = Field(None, description="Must name the served model when given.")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="float: JSON numbers; base64: little-endian float32 bytes."
    )
    dimensions: int | None = Field(
        None, ge=1, description="Must equal the model's width when given (no truncation)."
    )
    user: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _shape(cls, value: Any) -> Any:
        """One of OpenAI's four shapes, named ``input`` in the error (pydantic's own
        union errors would name each alternative)."""
        if isinstance(value, list) and not value:
            raise ValueError("input is empty")
        if isinstance(value, list) and any(_is_id(x) for x in value):
            return [_prompt(value)]  # token ids, perhaps with text pieces: one prompt
        if isinstance(value, list):
            empty = next((i for i, x in enumerate(value) if isinstance(x, list) and not x), None)
            if empty is not None:  # as the engine says of an empty string
                raise ValueError(f"input {empty} is an empty list of token ids")
            return [_prompt(x) for x in value]
        return [_prompt(value)]

    def inputs(self) -> list[Prompt]:
        """The prompts, one per embedding (validation made a list of them)."""
        return cast("list[Prompt]", self.input)

    def refuse_unsupported(self) -> None:
        """Other servers' fields that change the vectors are a 400 naming them, never
        ignored; with the value that changes nothing they are accepted."""
        self.refuse_fields(EMBEDDING_UNSUPPORTED, "not supported by this server")


_UNIT = "every vector is scaled to unit Euclidean norm"

# llama-server's and vLLM's embedding fields that change the vectors
EMBEDDING_UNSUPPORTED: Refused = {
    "embd_normalize": (lambda v: v == 2, _UNIT + " (llama-server's embd_normalize 2)"),
    "normalize": (lambda v: v is True, _UNIT),  # vLLM's
    "truncate_prompt_tokens": (
        lambda v: False,
        "an input is never cut; one longer than engine.n_ubatch is refused",
    ),  # vLLM's
}


def encode_vector(vector: npt.NDArray[np.float32], encoding: str) -> list[float] | str:
    """A vector as JSON numbers, or as base64 of little-endian float32 (what OpenAI's
    client decodes with ``np.frombuffer(base64.b64decode(s), dtype="float32")``)."""
    if encoding == "base64":
        data = vector.astype("<f4", copy=False).tobytes()
        return base64.b64encode(data).decode("ascii")
    values: list[float] = vector.tolist()
    return values


def embedding_response(result: Embeddings, model: str, encoding: str) -> dict[str, Any]:
    """OpenAI's embeddings response: a list of embedding objects in input order."""
    n = result.prompt_tokens
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding)}
            for i, v in enumerate(result.vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }


class TokenizeRequest(_Lenient):
    """llama-server's /tokenize: ``content`` is text, or a list mixing text and token
    ids (``tokenize_mixed``); without it the answer is an empty list."""

    content: str | list[str | int] | None = None
    add_special: bool = Field(False, description="Add BOS (and EOS where the model does).")
    parse_special: bool = Field(True, description="Parse control tokens written as text.")
    with_pieces: bool = Field(False, description="Return {id, piece} objects.")


class DetokenizeRequest(_Lenient):
    """llama-server's /detokenize."""

    tokens: list[int] = Field(default_factory=list)


def piece_json(piece: bytes) -> str | list[int]:
    """A token's piece as llama-server shows it: the text when it is valid UTF-8,
    else the list of its byte values (a token that holds part of a character)."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)
