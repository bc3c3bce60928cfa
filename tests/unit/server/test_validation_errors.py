"""A body pydantic refuses: the 400's `param` names the field as OpenAI's errors do
(`messages[0].content[1]`), never with the names pydantic gives a union's members
(`stop.str`, `tool_choice.literal['none','auto','required']`), and its message says
what the field takes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from orin.server.protocol import ChatCompletionRequest, CompletionRequest
from tests.unit.server.test_auth import client_for

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with client_for() as c:
        yield c


INVALID, MISSING = "invalid_value", "missing_required_parameter"


def refused(
    client: TestClient, path: str, body: dict[str, Any], code: str = INVALID
) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", code)
    assert err["message"].startswith(f"{err['param']}: "), err
    return err


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/chat/completions", {"messages": USER, "stop": 5}, "stop", "a valid list"),
        ("/v1/chat/completions", {"messages": USER, "tool_choice": "any"}, "tool_choice", "'auto'"),
        (
            "/v1/chat/completions",
            {"messages": USER, "tool_choice": {"type": "function"}},
            "tool_choice.function",
            "Field required",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "bogus", "content": "x"}]},
            "messages[0].role",
            "'assistant'",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": 5}]},
            "messages[0].content",
            "a valid string; or Input should be a valid list",
        ),
        (
            "/v1/chat/completions",
            {"messages": [*USER, {"role": "user", "content": [{"type": "text"}]}]},
            "messages[1].content[0].text",
            "Field required",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].image_url",
            "Field required",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "function", "function": {}}]},
            "tools[0].function.name",
            "Field required",
        ),
        ("/v1/completions", {"prompt": 5}, "prompt", "a valid string"),
        ("/v1/chat/completions", {"model": "m"}, "messages", "Field required"),
        ("/v1/completions", {"model": "m"}, "prompt", "Field required"),
    ],
)
def test_param_names_the_field_without_union_members(
    client: TestClient, path: str, body: dict[str, Any], param: str, says: str
) -> None:
    """A field left out has OpenAI's code for it, `missing_required_parameter`."""
    err = refused(client, path, body, MISSING if says == "Field required" else INVALID)
    assert err["param"] == param
    assert says in err["message"]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("response_format", "param", "says"),
    [
        (
            {"type": "json_object", "json_schema": {"name": "a", "schema": SCHEMA}},
            "response_format.json_schema",
            "with type 'json_schema', not with 'json_object'",
        ),
        (
            {"json_schema": {"name": "a", "schema": SCHEMA}},
            "response_format.json_schema",
            "not with 'text'",
        ),
        (
            {"type": "json_schema", "schema": SCHEMA},
            "response_format.schema",
            "with type 'json_object', not with 'json_schema'",
        ),
        ({"type": "text", "schema": SCHEMA}, "response_format.schema", "not with 'text'"),
    ],
)
def test_a_schema_beside_a_type_that_does_not_read_it_is_refused(
    client: TestClient, response_format: dict[str, Any], param: str, says: str
) -> None:
    """Served, the answer would not be held to the schema the client sent."""
    body = {"messages": USER, "response_format": response_format}
    err = refused(client, "/v1/chat/completions", body)
    assert err["param"] == param and says in err["message"]
    ok = {"type": "text", "json_schema": None, "schema": None}
    assert ChatCompletionRequest.model_validate({"messages": USER, "response_format": ok})


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
)
def test_a_content_part_of_another_type_is_named_and_refused_as_such(
    client: TestClient, part: dict[str, Any]
) -> None:
    """What OpenAI's client sends for audio or a file: one error about the part, not
    "content: Input should be a valid string"."""
    content = [{"type": "text", "text": "What is this?"}, part]
    err = refused(
        client, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}
    )
    assert err["param"] == "messages[0].content[1]"
    assert "'text' or 'image_url'" in err["message"]


def test_an_assistants_refusal_in_the_history_is_its_text() -> None:
    """A conversation carried over from OpenAI's API holds its refusals, as a refusal
    part or as the message's refusal beside null content: they were a 400 ("a content
    part's type must be 'text' or 'image_url'") or rendered as an empty turn."""
    for said in (
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "I cannot."}]},
        {"role": "assistant", "content": None, "refusal": "I cannot."},
    ):
        body = ChatCompletionRequest.model_validate({"messages": [*USER, said, *USER]})
        assert body.template_messages()[1] == {"role": "assistant", "content": "I cannot."}
    given = {"role": "assistant", "content": "Sure.", "refusal": None}
    body = ChatCompletionRequest.model_validate({"messages": [*USER, given, *USER]})
    assert body.template_messages()[1]["content"] == "Sure."


def test_a_refusal_part_is_only_the_assistants(client: TestClient) -> None:
    content = [{"type": "text", "text": "hi"}, {"type": "refusal", "refusal": "no"}]
    err = refused(
        client, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}]}
    )
    assert err["param"] == "messages[0].content" and "content[1]" in err["message"]


@pytest.mark.parametrize(
    "message",
    [
        {"role": "user"},
        {"role": "user", "content": None},
        {"role": "system", "content": None},
        {"role": "tool", "tool_call_id": "call_1"},
    ],
)
def test_a_message_without_content_is_refused_unless_it_is_an_assistants(
    client: TestClient, message: dict[str, Any]
) -> None:
    """OpenAI's rule: only an assistant message (which may only call tools) may leave
    its content out; a user message without it is not served as an empty turn."""
    messages = [message] if message["role"] != "tool" else [*USER, message]
    err = refused(client, "/v1/chat/completions", {"messages": messages}, MISSING)
    assert err["param"] == f"messages[{len(messages) - 1}].content"
    assert f"a {message['role']} message needs content" in err["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": USER, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": "2"}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "temperature": "0.5"}, "temperature"),
        ("/v1/chat/completions", {"messages": USER, "n": True}, "n"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2.5}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": USER, "stream": True, "stream_options": {"include_usage": "true"}},
            "stream_options.include_usage",
        ),
        ("/v1/completions", {"prompt": [True, 2]}, "prompt[0]"),
        ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
        ("/v1/embeddings", {"input": "hi", "dimensions": "64"}, "dimensions"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_not_converted(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    """As OpenAI's API does: "2" is not a number and "yes" not a boolean, where a
    lenient parser would have served them as 2 and true."""
    err = refused(client, path, body)
    assert err["param"] == param


def test_numbers_keep_their_json_forms() -> None:
    """Strict types still take an integer where a number is asked for, and null for
    an optional field."""
    req = ChatCompletionRequest.model_validate(
        {"messages": USER, "temperature": 0, "top_p": 1, "max_tokens": None, "seed": 7}
    )
    assert (req.temperature, req.top_p, req.seed) == (0.0, 1.0, 7)
    assert CompletionRequest.model_validate({"prompt": [[1, 2]]}).prompt == [1, 2]


def test_a_number_that_is_not_finite_is_refused(client: TestClient) -> None:
    """Python's json module reads NaN and Infinity, which JSON itself does not have."""
    body = '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
    r = client.post(
        "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "temperature" and "finite number" in err["message"]


@pytest.mark.parametrize("call_id", [{}, {"tool_call_id": None}])
def test_a_tool_message_without_its_call_id_is_refused(
    client: TestClient, call_id: dict[str, Any]
) -> None:
    """OpenAI's rule: a tool message names the call it answers; without the id the
    template would render an answer to no call. A required field left out, with
    OpenAI's code for it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "18 degrees", **call_id},
    ]
    err = refused(client, "/v1/chat/completions", {"messages": messages}, MISSING)
    assert err["param"] == "messages[2].tool_call_id"
    assert "a tool message needs tool_call_id" in err["message"]


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
CALLED = {"role": "assistant", "content": None, "tool_calls": [CALL]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"}


@pytest.mark.parametrize(
    ("messages", "param", "says"),
    [
        ([*USER, RESULT], "messages[1]", "must answer a call of the assistant message"),
        ([RESULT], "messages[0]", "must answer a call"),
        (
            [*USER, {"role": "assistant", "content": "hi"}, RESULT],
            "messages[2]",
            "must answer a call",
        ),
        ([*USER, CALLED, *USER, RESULT], "messages[3]", "must answer a call"),
        (
            [*USER, CALLED, {**RESULT, "tool_call_id": "call_2"}],
            "messages[2].tool_call_id",
            "'call_2' is not among the ids",
        ),
    ],
)
def test_a_tool_message_that_answers_no_call_is_refused(
    client: TestClient, messages: list[dict[str, Any]], param: str, says: str
) -> None:
    """OpenAI's rule: a tool message answers a call of the assistant message before it."""
    err = refused(client, "/v1/chat/completions", {"messages": messages})
    assert err["param"] == param and says in err["message"]


def test_tool_messages_answering_the_calls_before_them_pass() -> None:
    from orin.server.protocol import check_message_order

    second = {**CALL, "id": "call_2"}
    both = {**CALLED, "tool_calls": [CALL, second]}
    answers = [RESULT, {**RESULT, "tool_call_id": "call_2"}]
    no_ids = {**CALLED, "tool_calls": [{**CALL, "id": None}]}
    for messages in ([*USER, both, *answers], [*USER, no_ids, {**RESULT, "tool_call_id": "x"}]):
        check_message_order(ChatCompletionRequest.model_validate({"messages": messages}).messages)


def test_only_a_tool_message_needs_a_call_id() -> None:
    req = ChatCompletionRequest.model_validate(
        {"messages": [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "1"}]}
    )
    assert [m.tool_call_id for m in req.messages] == [None, "call_1"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("stream", [{}, {"stream": False}, {"stream": None}])
def test_stream_options_without_stream_is_refused(
    client: TestClient, path: str, stream: dict[str, Any]
) -> None:
    """As OpenAI refuses it: the options of a stream on an answer that is not one."""
    body = {"messages": USER} if path == "/v1/chat/completions" else {"prompt": "hi"}
    err = refused(client, path, {**body, **stream, "stream_options": {"include_usage": True}})
    assert err["param"] == "stream_options"
    assert err["message"] == (
        "stream_options: The 'stream_options' parameter is only allowed when 'stream' is enabled."
    )


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_stream_options_null_or_with_stream_is_fine(
    model: type[ChatCompletionRequest] | type[CompletionRequest],
) -> None:
    body: dict[str, Any] = {"messages": USER} if model is ChatCompletionRequest else {"prompt": "x"}
    assert model.model_validate({**body, "stream_options": None}).stream_options is None
    streamed = model.model_validate(
        {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert streamed.stream_options is not None and streamed.stream_options.include_usage


@pytest.mark.parametrize("echo", [{}, {"echo": False}])
def test_max_tokens_0_without_echo_is_refused(client: TestClient, echo: dict[str, Any]) -> None:
    """It would answer with nothing at all; with echo it returns the prompt (and its
    logprobs), OpenAI's legacy way of scoring a text."""
    err = refused(client, "/v1/completions", {"prompt": "hi", "max_tokens": 0, **echo})
    assert err["param"] == "max_tokens" and "only allowed with echo" in err["message"]
    chat = refused(client, "/v1/chat/completions", {"messages": USER, "max_tokens": 0})
    assert chat["param"] == "max_tokens"


def test_max_tokens_0_with_echo_asks_the_engine_for_the_prompt_only() -> None:
    from orin.profile.schema import SamplingSection

    body = CompletionRequest.model_validate(
        {"prompt": [1, 2], "echo": True, "max_tokens": 0, "logprobs": 1}
    )
    params = body.to_sampling(SamplingSection(), 100)
    assert (params.max_tokens, params.prompt_logprobs, params.logprobs) == (0, True, 1)
    params.validate(1000)  # the engine takes it
    echo_only = CompletionRequest.model_validate({"prompt": "x", "echo": True, "max_tokens": 0})
    assert not echo_only.to_sampling(SamplingSection(), 100).prompt_logprobs


@pytest.mark.parametrize(
    ("prompt", "says"),
    [
        (["a", ""], "prompt 1 of the batch is empty"),
        ([[1], []], "prompt 1 of the batch is empty"),
        ([], "the prompt is empty"),
        (["a", [1]], "a valid"),
    ],
)
def test_a_batch_with_an_empty_or_mixed_prompt_is_refused(
    client: TestClient, prompt: Any, says: str
) -> None:
    err = refused(client, "/v1/completions", {"prompt": prompt})
    assert err["param"].startswith("prompt") and says in err["message"]
