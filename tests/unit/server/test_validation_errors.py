"""A body pydantic refuses: the 400's `param` names the field as OpenAI's errors do
(`messages[0].content[1]`), never with the names pydantic gives a union's members
(`stop.str`, `tool_choice.literal['none','auto','required']`), and its message says
what the field takes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.unit.server.test_auth import client_for

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with client_for() as c:
        yield c


def refused(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err: dict[str, Any] = r.json()["error"]
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_value")
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
    ],
)
def test_param_names_the_field_without_union_members(
    client: TestClient, path: str, body: dict[str, Any], param: str, says: str
) -> None:
    err = refused(client, path, body)
    assert err["param"] == param
    assert says in err["message"]


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
    err = refused(client, "/v1/chat/completions", {"messages": messages})
    assert err["param"] == f"messages[{len(messages) - 1}].content"
    assert f"a {message['role']} message needs content" in err["message"]
