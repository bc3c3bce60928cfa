"""Token chunks built around the encoded text match the chunks built in full."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from orin.engine.types import TokenEvent, TokenLogprob
from orin.server import protocol
from orin.server.app import TokenChunks, _event_chunk
from orin.server.sse import event

TEXTS = ["hello", ' "quoted" ', "back\\slash", "line\nbreak\ttab", "naïve 日本 🚀", "\x00\x1f", ""]


def parsed(chunk: bytes) -> dict[str, object]:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    assert b"\n" not in chunk[:-2]  # one SSE data line
    data = json.loads(chunk[6:-2])
    data.pop("created")
    return dict(data)


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("text", TEXTS)
def test_plain_token_chunk_matches_the_full_build(kind: str, text: str) -> None:
    state = SimpleNamespace(model_name='demo "tiny"', engine_piece=lambda t: b"x")
    body = (
        protocol.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
        if kind == "chat"
        else protocol.CompletionRequest(prompt="hi")
    )
    chunks = TokenChunks(state, body, "req-1", kind)  # type: ignore[arg-type]
    e = TokenEvent("req-1", 5, text, None)
    full = event(_event_chunk(state, body, "req-1", kind, e))  # type: ignore[arg-type]
    assert parsed(chunks.token(e)) == parsed(full)
    got = parsed(chunks.token(e))["choices"][0]  # type: ignore[index]
    assert (got["delta"]["content"] if kind == "chat" else got["text"]) == text


def test_chunks_with_ids_or_logprobs_are_built_in_full() -> None:
    state = SimpleNamespace(model_name="m", engine_piece=lambda t: b"x")
    body = protocol.CompletionRequest(prompt="hi", return_token_ids=True)
    chunks = TokenChunks(state, body, "r", "text")  # type: ignore[arg-type]
    choice = parsed(chunks.token(TokenEvent("r", 7, "a", None)))["choices"][0]  # type: ignore[index]
    assert choice["token_ids"] == [7] and choice["text"] == "a"
    plain = TokenChunks(state, protocol.CompletionRequest(prompt="hi"), "r", "text")  # type: ignore[arg-type]
    lp = TokenLogprob(7, -0.5, ())
    choice = parsed(plain.token(TokenEvent("r", 7, "a", lp)))["choices"][0]  # type: ignore[index]
    assert choice["logprobs"]["token_logprobs"] == [-0.5]
