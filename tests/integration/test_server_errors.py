"""Every row of the server's error table, as a client sees it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from orin.model import demo
from orin.server import auth
from orin.server.state import ServerState
from tests.serverutil import live_server

pytestmark = pytest.mark.llama

PROFILE = """
engine: {n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}
server:
  {model_name: demo, model_match: strict, max_queue: 0, max_body_bytes: 4096, max_tokens_limit: 50,
   api_key_env: ORIN_TEST_KEY}
"""
KEY = {"Authorization": "Bearer s3cret"}


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ServerState]]:
    mp = pytest.MonkeyPatch()
    mp.setenv("ORIN_TEST_KEY", "s3cret")
    try:
        with live_server(demo.ensure("tiny", "f16"), PROFILE) as s:
            yield s
    finally:
        mp.undo()


def post(base: str, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"content-type": "application/json", **KEY, **(headers or {})}
    return httpx.post(base + path, content=content, headers=h, timeout=60)


def error_of(r: httpx.Response) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert {"message", "type", "param", "code"} <= set(err)
    assert "Traceback" not in err["message"]
    return dict(err)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "repeat_penalty": 0}, "repeat_penalty"),
        ({"prompt": "x", "top_p": 0}, "top_p"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "stream": "yes please"}, "stream"),
        ({"prompt": "x", "n": 17}, "n"),
        ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "x", "logit_bias": {"5": 300}}, "logit_bias"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),  # one slot, no queue: never together
        ({"max_tokens": 3}, "prompt"),
        # a schema of a few bytes whose grammar would take gigabytes, or nest so deep that
        # llama.cpp's parser overflowed its stack and the process died
        ({"prompt": "x", "json_schema": {"type": "string", "maxLength": 10**9}}, "json_schema"),
        ({"prompt": "x", "json_schema": {"type": "string", "maxLength": 30_000}}, "json_schema"),
        # a schema's grammar that llama.cpp refuses (too many repetitions) names the schema,
        # not a grammar the client never sent
        ({"prompt": "x", "json_schema": {"type": "string", "maxLength": 2000}}, "json_schema"),
        (
            {
                "prompt": "x",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "string", "maxLength": 2000}},
                },
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_invalid_parameters_name_the_parameter(
    server: tuple[str, ServerState], body: dict[str, Any], param: str
) -> None:
    r = post(server[0], "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["type"] == "invalid_request_error"
    assert err["param"] is not None and err["param"].startswith(param)


def test_chat_specific_errors(server: tuple[str, ServerState]) -> None:
    base = server[0]
    r = post(base, "/v1/chat/completions", {"messages": "hello"})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    r = post(base, "/v1/chat/completions", {"messages": []})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    tools = [{"type": "function", "function": {"name": "f"}}]
    r = post(
        base,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "tools": tools},
    )
    assert r.status_code == 400 and "tool calling" in error_of(r)["message"]


def test_malformed_json_and_invalid_utf8(server: tuple[str, ServerState]) -> None:
    r = post(server[0], "/v1/completions", b'{"prompt": "x",')
    assert r.status_code == 400 and "JSON" in error_of(r)["message"]
    r = post(server[0], "/v1/completions", b'{"prompt": "\xff\xfe"}')
    assert r.status_code == 400
    error_of(r)


# half of a UTF-16 surrogate pair, as JSON escapes it: valid JSON syntax, but no character
HALF = r"\ud83d"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "a %s b"}', "prompt"),
        ("/v1/completions", '{"prompt": ["a", "%s"]}', "prompt[1]"),
        ("/v1/completions", '{"prompt": "x", "grammar": "root ::= \\"%s\\""}', "grammar"),
        ("/v1/completions", '{"prompt": "x", "stop": ["%s"]}', "stop[0]"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "%s"}]}',
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]}',
            "messages[0].content[0].text",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "x"}], "model": "%s"}',
            "model",
        ),
        ("/tokenize", '{"content": "%s"}', "content"),
        ("/v1/embeddings", '{"input": ["ok", "%s"]}', "input[1]"),
    ],
)
def test_half_a_surrogate_pair_is_a_400_naming_the_field_not_a_500(
    server: tuple[str, ServerState], path: str, body: str, param: str
) -> None:
    """JSON may escape half of a surrogate pair alone; Python reads it into a string
    that UTF-8 cannot encode, which failed in the tokenizer, the grammar parser or
    the error response (a 500). It is refused as the body is read."""
    r = post(server[0], path, (body % HALF).encode())
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert (err["param"], err["code"]) == (param, "invalid_value")
    assert "\\ud83d" in err["message"] and "surrogate" in err["message"]


def test_a_whole_surrogate_pair_and_an_escaped_backslash_are_text(
    server: tuple[str, ServerState],
) -> None:
    """A whole pair is one character (an emoji), and an escaped backslash followed by
    ``ud83d`` is plain text: both are served."""
    body = r'{"content": "\ud83d\ude00 and \\ud83d"}'
    r = post(server[0], "/tokenize", body.encode())
    assert r.status_code == 200, r.text
    text = post(server[0], "/detokenize", {"tokens": r.json()["tokens"]}).json()["content"]
    assert text.lstrip(" ") == "\U0001f600 and \\ud83d"  # less the SentencePiece space


def test_a_body_that_is_no_json_object_says_what_it_needs(server: tuple[str, ServerState]) -> None:
    base = server[0]
    for content, headers in (
        (b"", {"Content-Type": "application/json"}),  # empty
        (b'{"prompt": "x"}', {}),  # JSON, but not said to be
        (b"[1, 2]", {"Content-Type": "application/json"}),  # not an object
    ):
        headers = {**KEY, **headers}
        r = httpx.post(f"{base}/v1/completions", content=content, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        assert error_of(r)["message"] == (
            "the request body must be a JSON object, sent with Content-Type: application/json"
        ), content


def test_unknown_fields_are_accepted(server: tuple[str, ServerState]) -> None:
    r = post(server[0], "/v1/completions", {"prompt": "x", "max_tokens": 1, "frobnicate": True})
    assert r.status_code == 200


def test_context_length_exceeded_gives_counts(server: tuple[str, ServerState]) -> None:
    r = post(server[0], "/v1/completions", {"prompt": list(range(5, 400)), "max_tokens": 1})
    assert r.status_code == 400
    err = error_of(r)
    assert err["code"] == "context_length_exceeded"
    assert "395" in err["message"] and "256" in err["message"]
    assert err["param"] == "prompt"  # the field of this route, not chat's messages


def test_an_over_long_chat_blames_its_messages(server: tuple[str, ServerState]) -> None:
    long = [{"role": "user", "content": "word " * 400}]
    r = post(server[0], "/v1/chat/completions", {"messages": long, "max_tokens": 1})
    assert r.status_code == 400
    err = error_of(r)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")


def test_auth(server: tuple[str, ServerState]) -> None:
    base = server[0]
    assert httpx.get(f"{base}/v1/models").status_code == 401
    wrong = httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and error_of(wrong)["type"] == "authentication_error"
    assert httpx.get(f"{base}/v1/models", headers=KEY).status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200  # probes need no key


def test_wrong_dashboard_keys_through_a_local_proxy_count_per_forwarded_address(
    server: tuple[str, ServerState],
) -> None:
    """A reverse proxy on 127.0.0.1 (nginx on the board) passes each browser's address
    in X-Forwarded-For, which the server takes as the client's (uvicorn's trusted
    proxies, FORWARDED_ALLOW_IPS): one guesser behind it does not lock the others out
    of the dashboard's login."""
    base, state = server
    state.login_limiter = auth.LoginLimiter(burst=2, per_s=1e-6)  # no refill in this test

    def login(address: str, key: str) -> int:
        r = httpx.post(f"{base}/login", data={"key": key}, headers={"X-Forwarded-For": address})
        return r.status_code

    guesser, other = "198.51.100.7", "198.51.100.8"
    assert [login(guesser, f"guess{i}") for i in range(3)] == [401, 401, 429]
    assert login(other, "nope") == 401  # held back only if the proxy's address counted
    assert login(guesser, "s3cret") == 429


def test_strict_model_match_answers_404_for_another_model(server: tuple[str, ServerState]) -> None:
    r = post(server[0], "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404
    err = error_of(r)
    assert (err["code"], err["param"]) == ("model_not_found", "model")
    missing = httpx.get(f"{server[0]}/v1/nothing", headers=KEY)
    assert missing.status_code == 404
    assert error_of(missing)["code"] == "not_found"  # an unknown path: not a model name


def test_body_over_the_limit(server: tuple[str, ServerState]) -> None:
    big = {"prompt": "x" * 10_000}
    r = post(server[0], "/v1/completions", big)
    assert r.status_code == 413 and error_of(r)["code"] == "request_too_large"
    assert "server.max_body_bytes" in error_of(r)["message"]  # what to raise, for photos

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
        yield json.dumps(big).encode()

    r = httpx.post(
        f"{server[0]}/v1/completions",
        content=chunks(),
        headers={**KEY, "content-type": "application/json"},
    )
    assert r.status_code == 413 and "server.max_body_bytes" in error_of(r)["message"]


def test_max_tokens_over_the_limit_is_refused_not_capped(server: tuple[str, ServerState]) -> None:
    r = post(
        server[0], "/v1/completions", {"prompt": "cap me", "max_tokens": 5000, "temperature": 0}
    )
    assert r.status_code == 400
    err = error_of(r)
    assert (err["param"], err["code"]) == ("max_tokens", "invalid_value")
    assert "5000" in err["message"] and "50 tokens (server.max_tokens_limit)" in err["message"]
    chat = {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 51}
    r = post(server[0], "/v1/chat/completions", chat)
    assert r.status_code == 400 and error_of(r)["param"] == "max_completion_tokens"
    r = post(
        server[0],
        "/v1/completions",
        {"prompt": "cap me", "max_tokens": 50, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 50  # the limit itself is served


NO_SLIDING = """
engine: {n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}
context: {sliding: false}
server: {max_tokens_limit: 1000}
"""


def test_with_sliding_off_a_length_that_cannot_fit_the_window_is_refused() -> None:
    with live_server(demo.ensure("tiny", "f16"), NO_SLIDING) as (base, _):
        body = {"prompt": [1, 2, 3, 4, 5, 6], "max_tokens": 300, "temperature": 0}
        r = httpx.post(base + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400
        err = error_of(r)
        assert (err["param"], err["code"]) == ("max_tokens", "invalid_value")
        assert "do not fit the context of 256 tokens" in err["message"]
        assert "ask for 250 at most" in err["message"]
        body = {**body, "max_tokens": 250, "ignore_eos": True}
        r = httpx.post(base + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 250


EDGE_DEFAULTS = """
engine: {n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}
sampling: {repeat_penalty: 0.01, temperature: 2.0, max_tokens: 7}
server: {model_name: demo}
"""


def test_the_profiles_sampling_defaults_serve_every_request() -> None:
    """Defaults at the table's edges are ones the engine takes (no 400 blaming the
    client), and an unset max_tokens is the profile's on both endpoints."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    with live_server(demo.ensure("tiny", "f16"), EDGE_DEFAULTS) as (base, _):
        for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", chat)):
            for stream in (False, True):
                r = httpx.post(
                    base + path,
                    json={**body, "ignore_eos": True, "stream": stream,
                          "stream_options": {"include_usage": True} if stream else None},
                    timeout=60,
                )  # fmt: skip
                assert r.status_code == 200, r.text
                usage = (
                    json.loads(r.text.split("data: ")[-2])["usage"] if stream else r.json()["usage"]
                )
                assert usage["completion_tokens"] == 7, (path, stream)
            r = httpx.post(
                base + path, json={**body, "max_tokens": 2, "temperature": 2.0}, timeout=60
            )
            assert r.status_code == 200, r.text


def test_queue_full_is_429_with_retry_after(server: tuple[str, ServerState]) -> None:
    from orin.engine.types import SamplingParams

    base, state = server
    # occupy the only slot from inside (no queue allowed: max_queue 0)
    blocker = state.engine.submit("busy", SamplingParams(max_tokens=1_000_000, temperature=0))
    try:
        while state.engine.slots_busy == 0:
            threading.Event().wait(0.002)
        r = post(base, "/v1/completions", {"prompt": "no room", "max_tokens": 1})
    finally:
        blocker.cancel()
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    assert error_of(r)["code"] == "queue_full"
    assert blocker.result().finish_reason == "cancelled"


def test_more_choices_than_the_server_ever_holds_is_400_not_429(
    server: tuple[str, ServerState],
) -> None:
    """One slot and no queue: two choices can never be taken together, on an idle
    server too; a 429 would have a client retry forever."""
    base, state = server
    assert state.engine.slots_busy == 0
    for path, body in (
        ("/v1/completions", {"prompt": "x", "n": 2, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}),
    ):
        r = post(base, path, body)
        assert r.status_code == 400, r.text
        err = error_of(r)
        assert err["param"] == "n" and "engine.slots 1 + server.max_queue 0" in err["message"]
    r = post(base, "/v1/completions", {"prompt": "x", "n": 1, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_draining_is_503(server: tuple[str, ServerState]) -> None:
    base, state = server
    state.draining = True
    try:
        r = post(base, "/v1/completions", {"prompt": "x"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert httpx.get(f"{base}/health").status_code == 503
    finally:
        state.draining = False


def test_loading_is_503() -> None:
    from fastapi.testclient import TestClient

    from orin.profile.loader import parse_profile
    from orin.server.main import build_server

    profile = parse_profile("name: t\nengine: {n_ctx: 256, slots: 1, n_batch: 64, n_ubatch: 64}\n")
    _, state = build_server(profile, demo.ensure("tiny", "f16"))  # engine not started
    with TestClient(state_app(state)) as client:
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        # the model list answers, without what only the loaded model knows (server.md)
        models = client.get("/v1/models")
        assert models.status_code == 200
        assert models.json()["data"][0]["meta"]["quantization"] is None


def state_app(state: ServerState) -> Any:
    from orin.server.app import create_app

    return create_app(state)


def decode_fails(state: ServerState, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every llama_decode of the server's engine fails until ``monkeypatch.undo``."""
    from orin.engine.errors import BackendError

    runner = state.engine.runner
    assert runner is not None

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise BackendError("llama_decode failed with status -3 on 2 tokens")

    monkeypatch.setattr(runner, "decode", failing)


def test_a_whole_answer_the_engine_could_not_finish_carries_the_engines_message(
    server: tuple[str, ServerState],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As a stream's error event does (docs/fleet.md: a lost RPC worker); no traceback."""
    base, state = server
    decode_fails(state, monkeypatch)
    r = post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    monkeypatch.undo()
    assert r.status_code == 500, r.text
    err = error_of(r)
    assert err["code"] == "generation_failed" and err["type"] == "server_error"
    assert err["message"] == "llama_decode failed with status -3 on 2 tokens"
    assert "Traceback" not in caplog.text
    assert post(base, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_stream_the_engine_could_not_finish_ends_with_the_same_code(
    server: tuple[str, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The error event of a stream carries what a whole answer's 500 does: the
    engine's message and code generation_failed (a lost RPC worker, docs/fleet.md)."""
    base, state = server
    decode_fails(state, monkeypatch)
    body = {"prompt": "x", "max_tokens": 2, "stream": True}
    r = post(base, "/v1/completions", body)
    monkeypatch.undo()
    assert r.status_code == 200, r.text
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "generation_failed" and err["type"] == "server_error"
    assert err["message"] == "llama_decode failed with status -3 on 2 tokens"


def test_unexpected_errors_carry_the_request_id_not_a_traceback() -> None:
    from orin.server.errors import to_response

    r = to_response(RuntimeError("secret internals"), "req-abc")
    body = json.loads(bytes(r.body))
    assert r.status_code == 500
    assert body["error"]["request_id"] == "req-abc"
    assert "secret internals" not in body["error"]["message"]
    assert "req-abc" in body["error"]["message"]


def test_a_generation_request_holds_an_arrival_ticket_until_queued_or_refused(
    server: tuple[str, ServerState],
) -> None:
    """The ticket that lets an idle engine wait for a request being prepared is
    opened for generation routes only, and closed whatever becomes of the request:
    one left open would hold every idle engine's first step back."""
    base, state = server
    engine: Any = state.engine
    opened: list[int] = []
    real = engine.arrival

    def counting() -> Any:
        opened.append(1)
        return real()

    engine.arrival = counting
    try:
        ok = post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        refused = post(base, "/v1/completions", {"prompt": "x", "temperature": 2.5})
        broken = post(base, "/v1/chat/completions", b"{not json")
        unauthorized = post(base, "/v1/completions", {"prompt": "x"}, {"Authorization": "no"})
        httpx.get(base + "/v1/models", headers=KEY, timeout=60)
    finally:
        del engine.arrival
    assert [r.status_code for r in (ok, refused, broken, unauthorized)] == [200, 400, 400, 401]
    assert len(opened) == 4  # the models list opens none
    assert engine._arriving == 0
