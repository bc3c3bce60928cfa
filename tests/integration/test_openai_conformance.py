"""The OpenAI surface, checked the way a drop-in client uses it.

Written from OpenAI's API reference (chat completions, completions) and the
llama.cpp server forms that clients also send: every sampling parameter has
an effect a test can see, streaming chunks have OpenAI's shapes, structured
output parses, and every bad parameter is a 400 naming it. The official
``openai`` client sends the requests wherever it can express them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from orin.model import demo
from orin.server.state import ServerState
from tests.serverutil import live_server

pytestmark = pytest.mark.llama

PROFILE = """
engine: {n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128}
server: {model_name: demo, max_tokens_limit: 200}
"""
USER = [{"role": "user", "content": "Tell me about the board."}]
BEGUN = {"role": "assistant", "content": "The board has"}  # an answer the client began


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ServerState]]:
    with live_server(demo.ensure("small", "f16"), PROFILE) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: tuple[str, ServerState]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def post(server: tuple[str, ServerState], path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server[0] + path, json=body, timeout=60)


def chat_text(client: openai.OpenAI, **fields: Any) -> str:
    r = client.chat.completions.create(model="demo", messages=USER, **fields)  # type: ignore[call-overload]
    return str(r.choices[0].message.content)


def text_of(client: openai.OpenAI, **fields: Any) -> str:
    r = client.completions.create(model="demo", prompt="The board boots and", **fields)
    return r.choices[0].text


# -- sampling parameters --------------------------------------------------------------


def test_greedy_is_deterministic_and_top_k_1_is_greedy(client: openai.OpenAI) -> None:
    greedy = chat_text(client, temperature=0, max_tokens=16)
    assert greedy == chat_text(client, temperature=0, max_tokens=16)
    assert chat_text(client, temperature=1.0, extra_body={"top_k": 1}, max_tokens=16) == greedy


def test_seed_fixes_a_sampled_answer_and_another_seed_changes_it(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {"temperature": 1.5, "top_p": 1.0, "max_tokens": 24}
    extra = {"top_k": 0, "min_p": 0.0}
    a = [text_of(client, seed=s, extra_body=extra, **fields) for s in (1, 1, 2, 3)]
    assert a[0] == a[1]
    assert len({a[0], a[2], a[3]}) > 1


def test_seed_minus_one_is_a_random_seed_for_each_call_and_choice(
    client: openai.OpenAI,
) -> None:
    """llama-server's "a random seed" (it was a 400 here): each call, and each choice of
    one call, samples with a seed of its own."""
    fields: dict[str, Any] = {"temperature": 1.5, "top_p": 1.0, "max_tokens": 24}
    extra = {"top_k": 0, "min_p": 0.0}
    calls = [text_of(client, seed=-1, extra_body=extra, **fields) for _ in range(3)]
    assert len(set(calls)) > 1
    r = client.completions.create(
        model="demo", prompt="The board boots and", n=3, seed=-1, extra_body=extra, **fields
    )
    assert len({c.text for c in r.choices}) > 1


def test_max_tokens_and_its_other_names(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="demo", messages=USER, max_completion_tokens=5, temperature=0
    )
    assert r.usage is not None and r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"
    r2 = client.completions.create(
        model="demo", prompt="x", extra_body={"n_predict": 7}, temperature=0
    )
    assert r2.usage is not None and r2.usage.completion_tokens == 7


def test_stop_ends_the_text_before_the_stop_string(client: openai.OpenAI) -> None:
    full = text_of(client, temperature=0, max_tokens=40)
    words = full.split()
    assert len(words) >= 4
    stop = words[3]
    r = client.completions.create(
        model="demo", prompt="The board boots and", temperature=0, max_tokens=40, stop=[stop]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(stop)]


def test_logit_bias_forces_and_bans_a_token(
    client: openai.OpenAI, server: tuple[str, ServerState]
) -> None:
    token = server[1].engine.tokenize(" board", add_special=False)[0]
    forced = client.completions.create(
        model="demo",
        prompt="x",
        max_tokens=4,
        temperature=0,
        logit_bias={str(token): 100},
        extra_body={"return_token_ids": True},
    )
    assert forced.choices[0].model_extra is not None
    assert forced.choices[0].model_extra["token_ids"] == [token] * 4
    first = client.completions.create(
        model="demo", prompt="x", max_tokens=1, temperature=0, extra_body={"return_token_ids": True}
    )
    first_id = first.choices[0].model_extra["token_ids"][0]  # type: ignore[index]
    banned = client.completions.create(
        model="demo",
        prompt="x",
        max_tokens=1,
        temperature=0,
        logit_bias={str(first_id): -100},
        extra_body={"return_token_ids": True},
    )
    assert banned.choices[0].model_extra["token_ids"][0] != first_id  # type: ignore[index]


def test_penalties_push_back_a_repeated_token(
    client: openai.OpenAI, server: tuple[str, ServerState]
) -> None:
    """A logit bias makes one token win every step; the penalties count it in the
    prompt and the output (llama.cpp feeds them both) until another token wins.
    A look-back window of 0 (either name) turns them off."""
    token = server[1].engine.tokenize(" board", add_special=False)[0]

    def ids(**extra: Any) -> list[int]:
        r = client.completions.create(
            model="demo",
            prompt=[token] * 20,
            max_tokens=4,
            temperature=0,
            logit_bias={str(token): 30},
            extra_body={"return_token_ids": True, **extra},
        )
        return list(r.choices[0].model_extra["token_ids"])  # type: ignore[index]

    assert ids() == [token] * 4
    assert token not in ids(frequency_penalty=2.0)
    assert token not in ids(repeat_penalty=10.0)
    assert ids(frequency_penalty=2.0, penalty_last_n=0) == [token] * 4
    assert ids(frequency_penalty=2.0, repeat_last_n=0) == [token] * 4


# -- streaming ---------------------------------------------------------------------------


def test_streamed_chat_chunks_have_openais_shape(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=USER,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert len({c.created for c in chunks}) == 1
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert all(c.system_fingerprint and c.model == "demo" for c in chunks)
    with_choice = [c for c in chunks if c.choices]
    assert with_choice[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in with_choice][:-1] == [None] * (len(with_choice) - 1)
    assert with_choice[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in with_choice)
    assert text == chat_text(client, max_tokens=10, temperature=0)


@pytest.mark.parametrize(
    ("path", "body"),
    [("/v1/chat/completions", {"messages": USER}), ("/v1/completions", {"prompt": "x"})],
)
def test_include_usage_puts_a_null_usage_in_every_chunk_before_the_last(
    server: tuple[str, ServerState], path: str, body: dict[str, Any]
) -> None:
    """OpenAI's stream with include_usage, as sent on the wire (the client reads a
    missing key as null too): `"usage": null` in each chunk, the usage last."""
    asked = {**body, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    lines = post(server, path, asked).text.split("\n\n")
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-2] == "data: [DONE]" and chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])


def test_streamed_completion_without_include_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model="demo", prompt="x", max_tokens=6, temperature=0, stream=True
        )
    )
    assert chunks[0].id.startswith("cmpl-") and {c.object for c in chunks} == {"text_completion"}
    assert all(c.choices for c in chunks)  # no usage-only chunk unless asked
    assert chunks[-1].choices[0].finish_reason == "length"
    whole = client.completions.create(model="demo", prompt="x", max_tokens=6, temperature=0)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


# -- n choices ---------------------------------------------------------------------------


def _cached_counter(server: tuple[str, ServerState]) -> float:
    text = httpx.get(server[0] + "/metrics", timeout=10).text
    line = next(
        ln for ln in text.splitlines() if ln.startswith("orin_llm_prompt_tokens_cached_total")
    )
    return float(line.split()[-1])


def test_n_choices_share_one_prefill(
    client: openai.OpenAI, server: tuple[str, ServerState]
) -> None:
    before = _cached_counter(server)
    wide: dict[str, Any] = {
        "temperature": 1.5,
        "top_p": 1.0,
        "extra_body": {"top_k": 0, "min_p": 0},
    }
    r = client.chat.completions.create(
        model="demo", messages=USER, n=3, max_tokens=8, seed=11, **wide
    )
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # seed, seed + 1, seed + 2
    assert r.usage is not None and r.usage.completion_tokens == 24
    prompt = r.usage.prompt_tokens
    # two choices took the prompt's cells from the first (all but its last token)
    assert _cached_counter(server) - before >= 2 * (prompt - 1)
    again = client.chat.completions.create(
        model="demo", messages=USER, n=3, max_tokens=8, seed=11, **wide
    )
    assert [c.message.content for c in again.choices] == texts
    greedy = client.chat.completions.create(
        model="demo", messages=USER, n=2, max_tokens=8, temperature=0
    )
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_n_streamed_choices_reassemble_to_the_whole_answer(client: openai.OpenAI) -> None:
    fields: dict[str, Any] = {"n": 2, "max_tokens": 6, "temperature": 1.5, "seed": 5, "top_p": 1.0}
    fields["extra_body"] = {"top_k": 0, "min_p": 0}
    whole = client.completions.create(model="demo", prompt="x", **fields)
    chunks = list(
        client.completions.create(
            model="demo", prompt="x", stream=True, stream_options={"include_usage": True}, **fields
        )
    )
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]
    reasons = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert reasons == ["length", "length"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


# -- logprobs ---------------------------------------------------------------------------


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="demo", messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 6
    assert "".join(t.token for t in lp.content) == r.choices[0].message.content
    for t in lp.content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert t.top_logprobs[0].token == t.token  # greedy: the chosen token is the top one
        assert bytes(t.bytes or []) == t.token.encode()


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model="demo", prompt="x", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(top) == 2 for top in lp.top_logprobs)


# -- structured output ------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "door": {"type": "string", "enum": ["open", "closed"]},
        "n": {"type": "integer"},
    },
    "required": ["door", "n"],
}


def _valid(text: str) -> None:
    value = json.loads(text)
    assert value["door"] in ("open", "closed") and isinstance(value["n"], int)


def test_response_format_json_object(client: openai.OpenAI) -> None:
    """Random weights fill a JSON string until max_tokens, so what is checked is
    that the grammar took hold: the answer starts a JSON value, the same request
    without it does not."""
    free = chat_text(client, max_tokens=8, seed=3)
    text = chat_text(client, response_format={"type": "json_object"}, max_tokens=8, seed=3)
    assert text.lstrip()[0] in '{["-0123456789tfn' and text != free
    assert free.lstrip()[0] not in '{["'


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "door", "schema": SCHEMA}}
    _valid(chat_text(client, response_format=fmt, max_tokens=60, seed=3))


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object", "schema": SCHEMA}},
        {"json_schema": SCHEMA},
    ],
    ids=["json_object-with-schema", "top-level-json_schema"],
)
def test_llama_cpp_structured_output_forms(
    server: tuple[str, ServerState], extra: dict[str, Any]
) -> None:
    body = {"messages": USER, "max_tokens": 60, "seed": 3, **extra}
    r = post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    _valid(r.json()["choices"][0]["message"]["content"])


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": USER, "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"messages": USER, "top_p": 1.5}, "top_p"),
        (
            "/v1/chat/completions",
            {"messages": USER, "top_logprobs": 50, "logprobs": True},
            "top_logprobs",
        ),
        ("/v1/chat/completions", {"messages": USER, "presence_penalty": 3}, "presence_penalty"),
        ("/v1/chat/completions", {"messages": USER, "frequency_penalty": -3}, "frequency_penalty"),
        ("/v1/chat/completions", {"messages": USER, "seed": -2}, "seed"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "stop": [""]}, "stop"),
        ("/v1/chat/completions", {"messages": USER, "logit_bias": {"1": 101}}, "logit_bias"),
        (
            "/v1/chat/completions",
            {"messages": USER, "response_format": {"type": "xml"}},
            "response_format",
        ),
        ("/v1/chat/completions", {"messages": USER, "grammar": "root ::= ("}, "grammar"),
        (
            "/v1/chat/completions",
            {"messages": USER, "grammar": 'root ::= "a"', "json_schema": SCHEMA},
            "json_schema",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        (
            "/v1/chat/completions",
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "content": "a"},
                    {"role": "assistant", "content": "b"},
                ]
            },
            "messages",
        ),
        ("/v1/chat/completions", {"messages": USER, "mirostat": 2}, "mirostat"),
        ("/v1/chat/completions", {"messages": USER, "typical_p": 0.5}, "typical_p"),
        ("/v1/chat/completions", {"messages": USER, "functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"messages": USER, "tools": []}, "tools"),
        ("/v1/chat/completions", {"messages": USER, "tool_choice": "none"}, "tool_choice"),
        (
            "/v1/chat/completions",
            {"messages": USER, "parallel_tool_calls": False},
            "parallel_tool_calls",
        ),
        ("/v1/chat/completions", {"messages": USER, "modalities": ["text", "audio"]}, "modalities"),
        (
            "/v1/chat/completions",
            {
                "messages": [*USER, BEGUN],
                "continue_final_message": True,
                "add_generation_prompt": True,
            },
            "continue_final_message",
        ),
        ("/v1/chat/completions", {"messages": USER, "continue_final_message": True}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [*USER, {**BEGUN, "content": " "}], "continue_final_message": True},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "add_generation_prompt": "no"},
            "add_generation_prompt",
        ),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": "x", "echo": "maybe"}, "echo"),
        ("/v1/completions", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, "stop_token_ids"),
        # the other endpoint's fields, never ignored
        ("/v1/completions", {"prompt": "x", "max_completion_tokens": 2}, "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"messages": USER, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": USER, "modalities": "audio"}, "modalities"),
        ("/v1/chat/completions", {"messages": USER, "logit_bias": {" 12": -100}}, "logit_bias"),
    ],
)
def test_each_bad_parameter_is_a_400_naming_it(
    server: tuple[str, ServerState], path: str, body: dict[str, Any], param: str
) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    # the field itself or a part of it (`messages[0].role`, `response_format.type`)
    assert err["param"] is not None and re.split(r"[.\[]", err["param"])[0] == param, err


def test_continue_final_message_continues_the_assistants_text(
    server: tuple[str, ServerState], client: openai.OpenAI
) -> None:
    """vLLM's continue_final_message: the prompt ends with the final message's text
    (the template's end of turn cut off), and the answer is the continuation alone, as
    a completion of that prompt gives it."""
    engine = server[1].engine
    messages = [*USER, BEGUN]
    whole = engine.render_chat(messages)  # the begun answer as a finished turn
    begun = engine.render_chat(messages, add_generation_prompt=False, continue_final=True)
    assert begun.prompt.endswith(BEGUN["content"])
    assert whole.prompt.startswith(begun.prompt) and len(whole.prompt) > len(begun.prompt)
    answer = client.chat.completions.create(
        model="demo",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        extra_body={"continue_final_message": True},
    )
    tokens = engine.tokenize(begun.prompt, add_special=begun.add_bos)
    expected = client.completions.create(model="demo", prompt=tokens, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == expected.choices[0].text
    assert answer.usage is not None and answer.usage.prompt_tokens == len(tokens)
    # not continued: the answer is a new turn, from another prompt
    assert client.chat.completions.create(
        model="demo",
        messages=messages,
        max_tokens=12,
        temperature=0,  # type: ignore[arg-type]
    ).usage.prompt_tokens > len(tokens)  # type: ignore[union-attr]


def test_add_generation_prompt_false_leaves_the_turn_unopened(
    server: tuple[str, ServerState], client: openai.OpenAI
) -> None:
    engine = server[1].engine
    opened = engine.render_chat(USER).prompt
    closed = engine.render_chat(USER, add_generation_prompt=False).prompt
    assert opened.startswith(closed) and len(opened) > len(closed)
    answer = client.chat.completions.create(
        model="demo",
        messages=USER,  # type: ignore[arg-type]
        max_tokens=4,
        temperature=0,
        extra_body={"add_generation_prompt": False},
    )
    tokens = engine.tokenize(closed, add_special=engine.render_chat(USER).add_bos)
    assert answer.usage is not None and answer.usage.prompt_tokens == len(tokens)


def test_samplers_sent_switched_off_are_accepted(server: tuple[str, ServerState]) -> None:
    """llama.cpp front ends send every sampler with its neutral value."""
    off = {
        "mirostat": 0,
        "mirostat_tau": 5,
        "typical_p": 1.0,
        "tfs_z": 1.0,
        "xtc_probability": 0,
        "dry_multiplier": 0.0,
        "dry_sequence_breakers": ["\n"],
        "top_n_sigma": -1,
        "dynatemp_range": 0,
        "min_keep": 0,
        "n_probs": 0,
        "samplers": ["penalties", "dry", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
    }
    plain = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0})
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": 0, **off})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    reordered = {"prompt": "x", "samplers": ["temperature", "top_k", "top_p", "min_p"]}
    assert post(server, "/v1/completions", reordered).status_code == 400


def test_the_client_raises_its_bad_request_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="demo", messages=USER, temperature=9)  # type: ignore[arg-type]
    assert info.value.status_code == 400


# -- shutdown ------------------------------------------------------------------------------


def test_answers_cut_at_shutdown_raise_only_the_clients_documented_errors() -> None:
    """A stream cut by the server's shutdown parses chunk by chunk and then raises
    openai.APIError (the error event; never a finish reason OpenAI does not know);
    a whole answer cut so is a 503, openai.InternalServerError."""
    import signal
    import threading

    from orin.profile.loader import parse_profile
    from orin.server.main import build_server
    from tests.serverutil import free_port

    profile = parse_profile(
        "name: cut\nengine: {n_ctx: 512, slots: 2, n_batch: 128, n_ubatch: 128}\n"
        "server: {model_name: demo, max_tokens_limit: 1000000, grace_seconds: 300}\n"
    )
    profile.server.port = free_port()
    server, state = build_server(profile, demo.ensure("small", "f16"))
    state.engine.start()
    server.announce_when_ready()
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{profile.server.port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    endless: dict[str, Any] = {"max_tokens": 1_000_000, "extra_body": {"ignore_eos": True}}
    whole: list[BaseException] = []
    try:

        def healthy() -> bool:
            try:
                return httpx.get(base + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:  # not listening yet
                return False

        while not healthy():
            threading.Event().wait(0.05)

        def answer() -> None:
            try:
                client.chat.completions.create(model="demo", messages=USER, **endless)
            except openai.APIStatusError as exc:
                whole.append(exc)

        waiting = threading.Thread(target=answer)
        waiting.start()
        stream = client.chat.completions.create(model="demo", messages=USER, stream=True, **endless)
        chunks = []
        with pytest.raises(openai.APIError) as cut:
            for chunk in stream:
                chunks.append(chunk)
                if len(chunks) == 5:
                    while state.engine.status().slots_busy < 2:
                        threading.Event().wait(0.01)
                    server.handle_exit(signal.SIGTERM, None)  # drain ...
                    server.handle_exit(signal.SIGTERM, None)  # ... cut short
        waiting.join(timeout=60)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        state.engine.stop(drain=False, timeout=5)
    assert not isinstance(cut.value, openai.APIStatusError)  # the stream's error event
    assert "shutting down" in cut.value.message
    assert cut.value.body is not None and cut.value.body["code"] == "server_shutdown"  # type: ignore[index]
    assert all(c.choices[0].finish_reason is None for c in chunks)
    assert isinstance(whole[0], openai.InternalServerError) and whole[0].status_code == 503
