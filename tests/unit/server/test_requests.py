"""Request bodies as OpenAI's clients send them: an explicit null for an optional
parameter means its default."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from orin.server import protocol

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
TEXT = {"prompt": "hi"}


@pytest.mark.parametrize(
    ("model", "body", "field"),
    [
        (protocol.CompletionRequest, TEXT, "n"),
        (protocol.CompletionRequest, TEXT, "stream"),
        (protocol.CompletionRequest, TEXT, "echo"),
        (protocol.CompletionRequest, TEXT, "ignore_eos"),
        (protocol.ChatCompletionRequest, CHAT, "logprobs"),
        (protocol.ChatCompletionRequest, CHAT, "parallel_tool_calls"),
        (protocol.ChatCompletionRequest, CHAT, "reasoning_format"),
        (protocol.ChatCompletionRequest, CHAT, "n"),
    ],
)
def test_null_is_the_default(
    model: type[protocol._Common], body: dict[str, object], field: str
) -> None:
    got = model.model_validate_json(json.dumps({**body, field: None}))
    assert getattr(got, field) == model.model_fields[field].default
    assert field not in got.ignored_fields()


def test_null_stays_null_where_null_is_the_default() -> None:
    got = protocol.CompletionRequest.model_validate_json('{"prompt": "hi", "max_tokens": null}')
    assert got.max_tokens is None


@pytest.mark.parametrize(
    ("model", "body"),
    [
        (protocol.CompletionRequest, {"prompt": None}),
        (protocol.ChatCompletionRequest, {"messages": None}),
    ],
)
def test_a_required_field_may_not_be_null(
    model: type[protocol._Common], body: dict[str, object]
) -> None:
    with pytest.raises(ValidationError) as caught:
        model.model_validate_json(json.dumps(body))
    assert caught.value.errors()[0]["loc"][0] == next(iter(body))


def test_top_logprobs_without_logprobs_is_refused_not_ignored() -> None:
    from orin.engine.errors import InvalidRequest

    body = protocol.ChatCompletionRequest.model_validate({**CHAT, "top_logprobs": 3})
    with pytest.raises(InvalidRequest) as caught:
        body.top_n_logprobs()
    assert caught.value.param == "top_logprobs" and "logprobs: true" in str(caught.value)
    on = protocol.ChatCompletionRequest.model_validate(
        {**CHAT, "logprobs": True, "top_logprobs": 3}
    )
    assert on.top_n_logprobs() == 3
    assert protocol.ChatCompletionRequest.model_validate(CHAT).top_n_logprobs() is None


@pytest.mark.parametrize(
    ("stop", "message"),
    [([""], "a stop string may not be empty"), (["x"] * 17, "17 stop strings; at most 16")],
)
def test_stop_strings_say_what_is_wrong(stop: list[str], message: str) -> None:
    from orin.engine.errors import InvalidRequest
    from orin.engine.types import SamplingParams

    with pytest.raises(InvalidRequest) as caught:
        SamplingParams(stop=tuple(stop)).validate(1000)
    assert caught.value.param == "stop" and message in str(caught.value)
