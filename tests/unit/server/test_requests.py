"""Request bodies as OpenAI's clients send them: an explicit null for an optional
parameter means its default."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from orin.server import protocol
from orin.server.protocol_embed import DetokenizeRequest, EmbeddingRequest, TokenizeRequest

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


def test_null_is_the_default_inside_nested_objects_and_on_every_route() -> None:
    """Not only the top level of chat and completions: stream_options, a tool call in
    the history, an embeddings request, /tokenize."""
    chat = protocol.ChatCompletionRequest.model_validate_json(
        json.dumps(
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": None, "function": {"name": "f", "arguments": None}}
                        ],
                    },
                    {"role": "tool", "tool_call_id": "c", "content": "1"},
                ],
                "stream": True,
                "stream_options": {"include_usage": None},
                "response_format": {"type": None},
            }
        )
    )
    assert chat.stream_options is not None and chat.stream_options.include_usage is False
    assert chat.response_format is not None and chat.response_format.type == "text"
    calls = chat.messages[1].tool_calls or []
    assert (calls[0].type, calls[0].function.arguments) == ("function", "")
    embed = EmbeddingRequest.model_validate_json('{"input": "x", "encoding_format": null}')
    assert embed.encoding_format == "float"
    tok = TokenizeRequest.model_validate_json('{"content": "x", "add_special": null}')
    assert tok.add_special is False
    assert DetokenizeRequest.model_validate_json('{"tokens": null}').tokens == []


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


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"grammar": 'root ::= "a"'}, "grammar"),
        ({"json_schema": {"type": "string"}}, "json_schema"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_object", "schema": {"type": "string"}}},
            "response_format.schema",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "string"}},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_the_engine_names_the_field_a_grammar_came_from(
    extra: dict[str, object], field: str
) -> None:
    """A grammar llama.cpp refuses is reported under the field the client sent, not
    under ``grammar`` when it came from a schema."""
    from orin.profile.schema import SamplingSection

    for body in (CHAT, TEXT):
        model = protocol.ChatCompletionRequest if body is CHAT else protocol.CompletionRequest
        request = model.model_validate({**body, **extra})
        assert request.to_sampling(SamplingSection(), 4096).grammar_field == field
    chat = protocol.ChatCompletionRequest.model_validate(CHAT)
    chat.constrain('root ::= "call"')  # a required tool call's grammar
    assert chat.to_sampling(SamplingSection(), 4096).grammar_field == "tools"


@pytest.mark.parametrize(
    ("field", "on", "off"),
    [
        ("mirostat_mode", 2, 0),  # llama-cpp-python's server
        ("logit_bias_type", "tokens", "input_ids"),  # llama-cpp-python's server
        ("repetition_penalty", 1.3, 1.0),  # vLLM, TGI
        ("include_stop_str_in_output", True, False),  # vLLM
        ("skip_special_tokens", False, True),  # vLLM
        ("truncate_prompt_tokens", 8, None),  # vLLM
        ("t_max_predict_ms", 500, -1),  # llama-server
    ],
)
def test_other_servers_output_fields_are_refused_not_ignored(
    field: str, on: object, off: object
) -> None:
    """A client written for vLLM or llama-cpp-python's server sends these under their
    own names; served as if they were absent, the answer silently differs from the
    one asked for (a repetition penalty not applied, the stop string left out)."""
    from orin.engine.errors import InvalidRequest

    for model, body in ((protocol.CompletionRequest, TEXT), (protocol.ChatCompletionRequest, CHAT)):
        with pytest.raises(InvalidRequest) as caught:
            model.model_validate({**body, field: on}).refuse_unsupported()
        assert caught.value.param == field
        model.model_validate({**body, field: off}).refuse_unsupported()


@pytest.mark.parametrize(
    ("model", "body", "field", "on", "off"),
    [
        (protocol.CompletionRequest, TEXT, "max_completion_tokens", 2, None),
        (protocol.CompletionRequest, TEXT, "top_logprobs", 3, 0),
        (protocol.CompletionRequest, TEXT, "tools", [{"type": "function"}], []),
        (protocol.CompletionRequest, TEXT, "tool_choice", "required", "none"),
        (protocol.CompletionRequest, TEXT, "messages", [{"role": "user"}], []),
        (protocol.ChatCompletionRequest, CHAT, "echo", True, False),
        (protocol.ChatCompletionRequest, CHAT, "prompt", "hi", ""),
    ],
)
def test_the_other_endpoints_fields_are_refused_not_ignored(
    model: type[protocol._Common], body: dict[str, object], field: str, on: object, off: object
) -> None:
    """A client that moved between chat and completions keeps sending the other's
    fields: `max_completion_tokens: 2` on /v1/completions was served at the profile's
    length, `top_logprobs: 3` without logprobs, `tools` as if none were offered."""
    from orin.engine.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as caught:
        model.model_validate({**body, field: on}).refuse_unsupported()
    assert caught.value.param == field
    model.model_validate({**body, field: off}).refuse_unsupported()


@pytest.mark.parametrize("modalities", ["text", "audio", ["text", "audio"], [1], [{}]])
def test_modalities_other_than_a_list_of_text_are_refused(modalities: object) -> None:
    """`"modalities": "audio"` (not a list) was accepted and answered with text."""
    from orin.engine.errors import InvalidRequest

    for model, body in ((protocol.CompletionRequest, TEXT), (protocol.ChatCompletionRequest, CHAT)):
        with pytest.raises(InvalidRequest) as caught:
            model.model_validate({**body, "modalities": modalities}).refuse_unsupported()
        assert caught.value.param == "modalities"
        for fine in (["text"], [], None):
            model.model_validate({**body, "modalities": fine}).refuse_unsupported()


@pytest.mark.parametrize("key", [" 12", "12 ", "+12", "1_2", "١٢", "12.0", "x"])
def test_logit_bias_keys_are_token_ids_written_in_digits(key: str) -> None:
    """Python's int() took " 12" (a client that keyed the bias by a token's text, " 12")
    as token 12, and "1_2" and Arabic-Indic digits too: a bias on a token nobody named."""
    from orin.engine.errors import InvalidRequest
    from orin.profile.schema import SamplingSection

    for model, body in ((protocol.CompletionRequest, TEXT), (protocol.ChatCompletionRequest, CHAT)):
        with pytest.raises(InvalidRequest) as caught:
            model.model_validate({**body, "logit_bias": {key: -100}}).to_sampling(
                SamplingSection(), 4096
            )
        assert caught.value.param == "logit_bias" and repr(key) in str(caught.value)
        ok = model.model_validate({**body, "logit_bias": {"12": -100, "7": 5}})
        assert ok.to_sampling(SamplingSection(), 4096).logit_bias == {12: -100, 7: 5}
