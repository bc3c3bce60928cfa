"""The formatters' chunks, and the pre-encoded fast path held equal to them."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from orin.engine.stream import Completion
from orin.engine.types import RequestTimings, TokenEvent, TokenLogprob, TopLogprob
from orin.server import protocol
from orin.server.responses import (
    ChatFormatter,
    CompletionFormatter,
    Formatter,
    TokenChunks,
    echo_pieces,
    encode,
    sse_events,
)
from orin.server.sse import LastEvents

TEXTS = ["hello", ' "quoted" ', "back\\slash", "line\nbreak\ttab", "naïve 日本 🚀", "\x00\x1f", ""]
LOGPROB = TokenLogprob(7, -0.5, (TopLogprob(7, "a", -0.5), TopLogprob(9, "é", -1.25)))
TIMINGS = RequestTimings(
    queue_ms=1.0,
    prefill_ms=4.0,
    ttft_ms=5.0,
    tpot_ms=2.0,
    e2e_ms=9.0,
    itl_ms=(2.0, 2.0),
    prompt_tokens=6,
    cached_tokens=2,
    generated_tokens=3,
    context_shifts=0,
)


def served(draining: bool = False) -> Any:
    return SimpleNamespace(
        model_name='demo "tiny" ü',
        system_fingerprint="fp_test",
        engine_piece=lambda t: "é".encode() if t == 9 else b"a",
        detokenize=lambda ids: "<prompt>",
        timings=protocol.timings,
        draining=draining,
    )


def formatter(kind: str, draining: bool = False, **fields: Any) -> Formatter:
    if kind == "chat":
        chat = protocol.ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], **fields
        )
        return ChatFormatter(served(draining), chat, "req-1")
    body = protocol.CompletionRequest(prompt=[1, 2], **fields)
    return CompletionFormatter(served(draining), body, "req-1", [[1, 2]])


def parsed(chunk: bytes) -> dict[str, Any]:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    assert b"\n" not in chunk[:-2]  # one SSE data line
    return dict(json.loads(chunk[6:-2]))


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("ids", [False, True])
@pytest.mark.parametrize("logprob", [None, LOGPROB])
@pytest.mark.parametrize("text", TEXTS)
def test_every_token_chunk_is_the_full_encoding_of_the_typed_chunk(
    kind: str, ids: bool, logprob: TokenLogprob | None, text: str
) -> None:
    fmt = formatter(kind, return_token_ids=ids)
    e = TokenEvent("req-1", 7, text, logprob)
    full = json.dumps(fmt.chunk(e), ensure_ascii=False)
    assert TokenChunks(fmt).token(e) == b"data: " + full.encode() + b"\n\n"
    choice = parsed(TokenChunks(fmt).token(e))["choices"][0]
    assert (choice["delta"]["content"] if kind == "chat" else choice["text"]) == text
    assert ("token_ids" in choice) is ids and choice.get("token_ids", [7]) == [7]
    assert (choice["logprobs"] is None) is (logprob is None)


def test_token_chunks_carry_the_envelope_of_their_endpoint() -> None:
    chat = parsed(TokenChunks(formatter("chat")).token(TokenEvent("req-1", 7, "x")))
    text = parsed(TokenChunks(formatter("text")).token(TokenEvent("req-1", 7, "x")))
    assert chat["object"] == "chat.completion.chunk" and text["object"] == "text_completion"
    for chunk in (chat, text):
        assert chunk["id"].startswith(("chatcmpl-", "cmpl-")) and chunk["model"] == 'demo "tiny" ü'
        assert chunk["system_fingerprint"] == "fp_test"
        assert chunk["choices"][0]["finish_reason"] is None


def test_logprobs_in_chunks_for_each_endpoint() -> None:
    e = TokenEvent("req-1", 7, "a", LOGPROB)
    chat = parsed(TokenChunks(formatter("chat")).token(e))["choices"][0]["logprobs"]
    assert chat["content"][0]["logprob"] == -0.5 and chat["content"][0]["bytes"] == [97]
    assert [t["token"] for t in chat["content"][0]["top_logprobs"]] == ["a", "é"]
    text = parsed(TokenChunks(formatter("text")).token(e))["choices"][0]["logprobs"]
    assert text == {
        "tokens": ["a"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"a": -0.5, "é": -1.25}],
        "text_offset": [0],
    }


def test_text_offsets_count_the_text_of_the_tokens_before_each_token() -> None:
    """text_offset is where each token's text starts in the text the client gets: the
    echoed prompt's characters first, then every earlier token's, also where a
    possible stop string held text back. The engine's events for " banana", ",",
    " gr", "ape", "," with the stop string "ape!": the "a" of " banana" comes with
    the comma's event, and "ape" comes with the next comma, its logprob in an event
    of its own just before."""
    pieces = {1: " banana", 2: ",", 3: " gr", 4: "ape", 5: "é"}
    fmt = formatter("text")
    fmt.served.engine_piece = lambda t: pieces[t].encode()
    chunks = TokenChunks(fmt)

    def lp(token: int) -> TokenLogprob:
        return TokenLogprob(token, -0.5, ())

    events = [
        TokenEvent("req-1", 1, " banan", lp(1)),
        TokenEvent("req-1", 2, "a,", lp(2)),
        TokenEvent("req-1", 3, " gr", lp(3)),
        TokenEvent("req-1", 4, "", None),
        TokenEvent("req-1", None, "", lp(4)),
        TokenEvent("req-1", 2, "ape,", lp(2)),
        TokenEvent("req-1", 5, "é", lp(5)),
    ]
    offsets = [
        (parsed(chunks.token(e))["choices"][0]["logprobs"] or {}).get("text_offset") for e in events
    ]
    assert offsets == [[0], [7], [8], None, [11], [14], [15]]
    assert "".join(e.text for e in events) == " banana, grape,é"
    for echo, start in ((False, 0), (True, len("<prompt>"))):
        chunks = TokenChunks(formatter("text", echo=echo))
        offsets = [
            parsed(chunks.token(TokenEvent("req-1", 9, "é", LOGPROB)))["choices"][0]["logprobs"][
                "text_offset"
            ]
            for _ in range(3)
        ]
        assert offsets == [[start], [start + 1], [start + 2]]
    # a whole answer: one offset per token, after the echoed prompt
    whole = Completion("req-1", "aa", (7, 7), (LOGPROB, LOGPROB), "length", TIMINGS)
    for echo, start in ((False, 0), (True, len("<prompt>"))):
        choice = formatter("text", echo=echo).response(whole, [1, 2])["choices"][0]
        assert choice["logprobs"]["text_offset"] == [start, start + 1]


def test_a_streamed_echo_sends_the_prompt_first() -> None:
    opening = formatter("text", echo=True).opening(0)
    assert opening is not None and opening["choices"][0]["text"] == "<prompt>"
    assert formatter("text").opening(0) is None


def test_echo_returns_a_text_prompt_as_written() -> None:
    """A text prompt is echoed as the client sent it, control tokens written as text
    included (detokenizing its tokens would drop them); token ids as their text."""
    prompt = "<|im_start|>user\n  two  spaces\t<|im_end|>\n"
    body = protocol.CompletionRequest(prompt=prompt, echo=True)
    fmt = CompletionFormatter(served(), body, "req-1", [[1, 2]])
    opening = fmt.opening(0)
    assert opening is not None and opening["choices"][0]["text"] == prompt
    whole = Completion("req-1", "ab", (7, 7), (), "length", TIMINGS)
    choice = fmt.response(whole, [1, 2])["choices"][0]
    assert choice["text"] == prompt + "ab" and choice["logprobs"] is None
    ids = protocol.CompletionRequest(prompt=[1, 2], echo=True)
    assert CompletionFormatter(served(), ids, "req-1", [[1, 2]]).echoed == "<prompt>"


def completion(finish: str = "length") -> Completion:
    return Completion("req-1", "abc", (7, 8, 9), (LOGPROB,), finish, TIMINGS)  # type: ignore[arg-type]


def test_full_responses() -> None:
    chat = formatter("chat", return_token_ids=True).response(completion(), [1, 2])
    assert chat["object"] == "chat.completion"
    choice = chat["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "abc"}
    assert choice["finish_reason"] == "length" and choice["logprobs"] is not None
    assert (choice["token_ids"], choice["prompt_token_ids"]) == ([7, 8, 9], [1, 2])
    assert chat["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 3,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert chat["timings"] is not None and chat["timings"]["prompt_n"] == 4
    text = formatter("text", echo=True).response(completion(), [1, 2])
    assert text["object"] == "text_completion"
    assert text["choices"][0]["text"] == "<prompt>abc" and "token_ids" not in text["choices"][0]
    assert json.loads(json.dumps(text)) == text  # plain JSON all through


def test_an_answer_with_no_token_has_no_time_to_first_token() -> None:
    """An echo with ``max_tokens: 0`` ends without a token: its TTFT is null, as in
    the access log and the metrics, not the time it ended."""
    assert protocol.timings(TIMINGS)["ttft_ms"] == 5.0  # type: ignore[index]
    none = dataclasses.replace(TIMINGS, generated_tokens=0, tpot_ms=None, itl_ms=())
    figures = protocol.timings(none)
    assert figures is not None and figures["ttft_ms"] is None and figures["e2e_ms"] == 9.0


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_final_and_usage_chunks(kind: str, include_usage: bool) -> None:
    fmt = formatter(kind, stream=True, stream_options={"include_usage": include_usage})
    final = parsed(encode(fmt.final_chunk(completion("stop"))))
    assert final["choices"][0]["finish_reason"] == "stop"
    assert final["choices"][0].get("delta", final["choices"][0].get("text")) in ({}, "")
    assert final["timings"]["predicted_n"] == 3
    # the usage chunk carries it then, and every chunk before it a null usage, as OpenAI's
    assert final["usage"] is None if include_usage else final["usage"]["total_tokens"] == 9
    usage = parsed(encode(fmt.usage_chunk(completion("stop"))))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 9


class FakeStream:
    """A request stream that hands out ready-made batches of events."""

    def __init__(self, batches: list[list[TokenEvent]]) -> None:
        self.request_id = "req-1"
        self.batches = batches
        self.cancelled = False

    async def next_batch(self) -> list[TokenEvent]:
        return self.batches.pop(0) if self.batches else []

    def cancel(self) -> None:
        self.cancelled = True


def test_a_streamed_chat_from_opening_to_done() -> None:
    fmt = formatter("chat", stream=True, stream_options={"include_usage": True})
    batches = [
        [TokenEvent("req-1", 7, "a")],
        [TokenEvent("req-1", 8, ""), TokenEvent("req-1", 9, "bc")],
        [TokenEvent("req-1", None, "!", finish_reason="stop", timings=TIMINGS)],
    ]
    stream = FakeStream(batches)
    finished: list[Sequence[Completion]] = []

    async def run() -> list[bytes]:
        return [b async for b in sse_events(fmt, stream, finished.append)]  # type: ignore[arg-type]

    out = b"".join(asyncio.run(run()))
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert deltas == ["a", "bc", "!"]  # the empty text sends nothing
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # OpenAI's shape with include_usage: a null usage in every chunk before the last
    assert all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert [c.text for c in finished[0]] == ["abc!"] and stream.cancelled


@pytest.mark.parametrize("include_usage", [False, True])
def test_the_last_events_go_out_together_and_end_the_body(include_usage: bool) -> None:
    """The final token, the finish reason, the usage and [DONE] are one LastEvents
    (EventStream writes it with the end of the body); the tokens before it are
    one chunk per batch, and ``on_finish`` has run when the last events come."""
    fmt = formatter("text", stream=True, stream_options={"include_usage": include_usage})
    stream = FakeStream(
        [
            [TokenEvent("req-1", 7, "a")],
            [TokenEvent("req-1", 8, "b"), TokenEvent("req-1", None, "c", None, "length", TIMINGS)],
        ]
    )
    finished: list[Sequence[Completion]] = []
    seen: list[tuple[bytes, int]] = []

    async def run() -> None:
        async for chunk in sse_events(fmt, stream, finished.append):  # type: ignore[arg-type]
            seen.append((chunk, len(finished)))

    asyncio.run(run())
    assert [type(c) for c, _ in seen] == [bytes, LastEvents]
    assert seen[1][1] == 1 and [c.text for c in finished[0]] == ["abc"]
    events = [e for e in seen[1][0].split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["b", "c"]
    assert chunks[2]["choices"][0]["finish_reason"] == "length"
    if include_usage:
        assert len(chunks) == 4 and chunks[3]["usage"]["completion_tokens"] == 2
    else:
        assert len(chunks) == 3 and chunks[2]["usage"]["completion_tokens"] == 2


def test_a_failed_request_ends_with_an_error_event_then_done() -> None:
    fmt = formatter("chat")
    failed = TokenEvent("req-1", None, "", None, "error", error="boom")
    stream = FakeStream([[TokenEvent("req-1", 7, "a")], [failed]])

    async def run() -> list[bytes]:
        return [b async for b in sse_events(fmt, stream, lambda c: None)]  # type: ignore[arg-type]

    out = asyncio.run(run())
    assert type(out[-1]) is LastEvents
    events = [e for e in out[-1].split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["message"] == "boom"


def test_n_choices_stream_with_their_index_and_one_set_of_figures() -> None:
    """Two choices' events interleave; each choice's chunks carry its index and end
    with its finish reason, and the last to end carries the figures of both;
    ``on_finish`` (the access log's figures) gets both choices, in choice order."""
    fmt = formatter("text", n=2)
    first = FakeStream(
        [
            [TokenEvent("req-1.0", 7, "a")],
            [TokenEvent("req-1.0", None, "b", finish_reason="stop", timings=TIMINGS)],
        ]
    )
    second = FakeStream(
        [
            [TokenEvent("req-1.1", 8, "x"), TokenEvent("req-1.1", 9, "y")],
            [TokenEvent("req-1.1", None, "", finish_reason="length", timings=TIMINGS)],
        ]
    )

    finished: list[Sequence[Completion]] = []

    async def run() -> list[bytes]:
        return [b async for b in sse_events(fmt, [first, second], finished.append)]  # type: ignore[list-item]

    events = [e for e in b"".join(asyncio.run(run())).split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    text = {
        i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
        for i in (0, 1)
    }
    assert text == {0: "ab", 1: "xy"}
    finals = [c for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(c["choices"][0]["finish_reason"] for c in finals) == ["length", "stop"]
    assert "usage" not in finals[0] and finals[1]["usage"]["completion_tokens"] == 3
    assert finals[1]["usage"]["prompt_tokens"] == 6  # the prompt counts once
    assert first.cancelled and second.cancelled
    assert [[c.text for c in cs] for cs in finished] == [["ab", "xy"]]


def test_a_full_response_has_a_choice_per_completion() -> None:
    out = formatter("chat", n=2).response([completion("stop"), completion("length")], [1])
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["finish_reason"] for c in out["choices"]] == ["stop", "length"]
    assert out["usage"]["completion_tokens"] == 6 and out["usage"]["prompt_tokens"] == 6


def stream_events(fmt: Formatter, *streams: FakeStream) -> list[bytes]:
    async def run() -> list[bytes]:
        many = list(streams)
        return [b async for b in sse_events(fmt, many, lambda c: None)]  # type: ignore[arg-type]

    return [e for e in b"".join(asyncio.run(run())).split(b"\n\n") if e]


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("draining", [True, False])
def test_a_cancelled_stream_ends_with_an_error_event_never_an_unknown_reason(
    kind: str, draining: bool
) -> None:
    """OpenAI has no finish reason "cancelled": a stream the engine cut (shutdown, a
    client that stopped reading) ends with an OpenAI error event and [DONE], which
    the official client raises as openai.APIError."""
    fmt = formatter(kind, draining, stream=True, stream_options={"include_usage": True})
    cut = TokenEvent("req-1", None, "", None, "cancelled", TIMINGS)
    events = stream_events(fmt, FakeStream([[TokenEvent("req-1", 7, "a")], [cut]]))
    assert events[-1] == b"data: [DONE]"
    assert b'cancelled"' not in b"".join(e for e in events if b'"finish_reason"' in e)
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == ("server_shutdown" if draining else "cancelled")
    assert error["type"] == "service_unavailable" and "after 1 tokens" in error["message"]
    assert ("shutting down" in error["message"]) is draining
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # no final chunk


def test_n_choices_cut_at_shutdown_end_with_one_error_event() -> None:
    fmt = formatter("text", draining=True, n=2)
    done = FakeStream([[TokenEvent("req-1.0", None, "b", finish_reason="stop", timings=TIMINGS)]])
    cut = FakeStream([[TokenEvent("req-1.1", None, "", None, "cancelled", TIMINGS)]])
    events = stream_events(fmt, done, cut)
    assert events[-1] == b"data: [DONE]" and b'"error"' in events[-2]
    reasons = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-2]]
    assert [r for r in reasons if r] == ["stop"]  # no final chunk for the cut choice


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_whole_answer_cut_at_shutdown_is_a_503_not_a_cancelled_choice(kind: str) -> None:
    from orin.server.errors import Interrupted, to_response

    with pytest.raises(Interrupted) as caught:
        formatter(kind, draining=True, n=2).response(
            [completion("stop"), completion("cancelled")], [1]
        )
    r = to_response(caught.value, "req-1")
    body = json.loads(bytes(r.body))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert body["error"]["code"] == "server_shutdown"
    assert "shutting down" in body["error"]["message"]


@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_every_chunk_of_a_stream_has_the_same_id_and_created(
    kind: str, include_usage: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clock moves on while the answer streams (a second per reading here): the
    opening, token, final and usage chunks keep the instant the answer began."""
    import time

    clock = iter(range(1_700_000_000, 1_700_001_000))
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    fmt = formatter(
        kind,
        stream=True,
        stream_options={"include_usage": include_usage},
        logprobs=1 if kind == "text" else True,
    )
    batches = [
        [TokenEvent("req-1", 7, "a")],
        [TokenEvent("req-1", 8, "b", LOGPROB)],  # built in full, not from the template
        [TokenEvent("req-1", None, "c", None, "length", TIMINGS)],
    ]
    events = stream_events(fmt, FakeStream(batches))
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) == 4 + (kind == "chat") + include_usage  # opening, 3 tokens, final
    assert len({c["id"] for c in chunks}) == 1
    assert len({c["created"] for c in chunks}) == 1


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_logprobs_asked_for_are_a_list_when_the_answer_has_no_token(kind: str) -> None:
    """An answer with no token (a stop string matched at once) still carries the
    logprobs object the client asked for, empty, never null."""
    empty = Completion("req-1", "", (), (), "stop", TIMINGS)
    asked = {"logprobs": True} if kind == "chat" else {"logprobs": 0}
    choice = formatter(kind, **asked).response(empty, [1, 2])["choices"][0]
    if kind == "chat":
        assert choice["logprobs"] == {"content": []}
    else:
        assert choice["logprobs"] == {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
    assert formatter(kind).response(empty, [1, 2])["choices"][0]["logprobs"] is None


# -- an echoed prompt's logprobs ---------------------------------------------------------

PROMPT_SCORES = (TokenLogprob(2, -1.5, (TopLogprob(9, "é", -0.25),)), TokenLogprob(3, -2.0, ()))


def scored_formatter(**fields: Any) -> CompletionFormatter:
    """echo with logprobs on the prompt [1, 2, 3], whose tokens' text is 'ab', 'é', ''."""
    body = protocol.CompletionRequest(prompt=[1, 2, 3], echo=True, logprobs=1, **fields)
    return CompletionFormatter(served(), body, "req-1", [[1, 2, 3]], [[b"ab", "é".encode(), b""]])


def test_an_echoed_prompts_logprobs_come_before_the_answers() -> None:
    """OpenAI's legacy completions: every prompt token, the first with null logprob and
    alternatives, then the answer's; offsets count the text the client gets."""
    whole = Completion(
        "req-1", "aa", (7, 7), (LOGPROB, LOGPROB), "length", TIMINGS, None, PROMPT_SCORES
    )
    choice = scored_formatter().response(whole, [1, 2, 3])["choices"][0]
    assert choice["text"] == "<prompt>aa"
    assert choice["logprobs"] == {
        "tokens": ["ab", "é", "", "a", "a"],
        "token_logprobs": [None, -1.5, -2.0, -0.5, -0.5],
        "top_logprobs": [None, {"é": -0.25}, {}, *[{"a": -0.5, "é": -1.25}] * 2],
        "text_offset": [0, 2, 3, len("<prompt>"), len("<prompt>") + 1],
    }
    # without echo, only the answer's
    plain = protocol.CompletionRequest(prompt=[1, 2, 3], logprobs=1)
    alone = CompletionFormatter(served(), plain, "req-1", [[1, 2, 3]]).response(whole, [1, 2, 3])
    assert alone["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.5]


def test_a_streamed_echo_with_logprobs_carries_the_prompts_logprobs() -> None:
    """The echo waits for the prompt's scores (no opening) and goes out with them, in
    the chunk of the engine's prompt event; the answer's chunks follow."""
    fmt = scored_formatter(stream=True)
    assert fmt.opening(0) is None
    stream = FakeStream(
        [
            [TokenEvent("req-1", None, "", prompt_logprobs=PROMPT_SCORES)],
            [TokenEvent("req-1", 7, "a", LOGPROB)],
            [TokenEvent("req-1", None, "", None, "length", TIMINGS)],
        ]
    )
    finished: list[Sequence[Completion]] = []

    async def run() -> list[bytes]:
        return [b async for b in sse_events(fmt, stream, finished.append)]  # type: ignore[arg-type]

    events = [e for e in b"".join(asyncio.run(run())).split(b"\n\n") if e]
    chunks = [json.loads(e[6:])["choices"][0] for e in events[:-1]]
    assert chunks[0]["text"] == "<prompt>"
    assert chunks[0]["logprobs"] == {
        "tokens": ["ab", "é", ""],
        "token_logprobs": [None, -1.5, -2.0],
        "top_logprobs": [None, {"é": -0.25}, {}],
        "text_offset": [0, 2, 3],
    }
    assert chunks[1]["text"] == "a" and chunks[1]["logprobs"]["text_offset"] == [len("<prompt>")]
    assert chunks[2]["finish_reason"] == "length"
    assert finished[0][0].prompt_logprobs == PROMPT_SCORES


def test_a_prompts_text_offsets_count_characters_not_bytes() -> None:
    """A character split over two tokens counts at the token that completes it."""
    euro = "€".encode()
    lp = protocol.prompt_logprobs(
        [b"a", euro[:1], euro[1:], b"b"], PROMPT_SCORES + PROMPT_SCORES[:1], served().engine_piece
    )
    assert lp["text_offset"] == [0, 1, 1, 2]
    assert lp["token_logprobs"] == [None, -1.5, -2.0, -1.5]
    with pytest.raises(ValueError, match="2 log-probabilities for a prompt of 2 tokens"):
        protocol.prompt_logprobs([b"a", b"b"], PROMPT_SCORES, served().engine_piece)


class Vocab:
    """Tokens 1 (BOS, added by tokenizing), 5 ('<|im_start|>', a control token) and
    letters 'a'..: 10 + ord - ord('a')."""

    def piece(self, token: int, special: bool = False) -> bytes:
        if token == 1:
            return b"<s>" if special else b""
        if token == 5:
            return b"<|im_start|>" if special else b""
        return bytes([ord("a") + token - 10])

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        out = [1] if add_special else []
        rest = text
        while rest:
            if rest.startswith("<|im_start|>"):
                out.append(5)
                rest = rest[len("<|im_start|>") :]
            else:
                out.append(10 + ord(rest[0]) - ord("a"))
                rest = rest[1:]
        return out


def test_echo_pieces_add_up_to_the_echoed_prompt() -> None:
    """A text prompt: the control tokens the client wrote as their text, nothing for
    the BOS tokenizing added; token ids: their text as echo detokenizes them."""
    vocab = Vocab()
    text = "<|im_start|>ab"
    prompt = vocab.tokenize(text)
    pieces = echo_pieces(vocab, text, prompt)
    assert pieces == [b"", b"<|im_start|>", b"a", b"b"] and b"".join(pieces).decode() == text
    assert echo_pieces(vocab, [1, 5, 10], [1, 5, 10]) == [b"", b"", b"a"]


class SentencePieceVocab(Vocab):
    """Like ``Vocab``, but a text fragment (the text's start, and what follows a control
    token) starts with the space SentencePiece puts before it: 40 + letter is ' a'."""

    def piece(self, token: int, special: bool = False) -> bytes:
        if token >= 40:
            return b" " + bytes([ord("a") + token - 40])
        return super().piece(token, special)

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        out = super().tokenize(text, add_special, parse_special)
        return [
            t + 30 if t >= 10 and (i == 0 or out[i - 1] in (1, 5)) else t for i, t in enumerate(out)
        ]


def test_echo_pieces_leave_off_the_space_sentencepiece_puts_before_a_text() -> None:
    vocab = SentencePieceVocab()
    text = "ab<|im_start|>c"
    prompt = vocab.tokenize(text)
    assert [vocab.piece(t, special=True) for t in prompt] == [
        b"<s>",
        b" a",
        b"b",
        b"<|im_start|>",
        b" c",
    ]
    pieces = echo_pieces(vocab, text, prompt)
    assert pieces == [b"", b"a", b"b", b"<|im_start|>", b"c"]


# -- a batch of prompts ------------------------------------------------------------------


def test_a_batch_of_prompts_answers_each_with_its_n_choices_in_turn() -> None:
    """OpenAI's numbering: choice index = prompt x n + choice; each choice echoes its
    own prompt and lists its own prompt's ids; usage counts each prompt once."""
    body = protocol.CompletionRequest(
        prompt=["one", "two two"], n=2, echo=True, return_token_ids=True
    )
    fmt = CompletionFormatter(served(), body, "req-1", [[1], [2, 2]])
    t1 = TIMINGS
    t2 = dataclasses.replace(TIMINGS, prompt_tokens=10, cached_tokens=4)
    cs = [
        Completion(f"req-1.{i}", "x", (7,), (), "length", t)
        for i, t in enumerate((t1, t1, t2, dataclasses.replace(t2, cached_tokens=5)))
    ]
    out = fmt.response(cs, [1])
    choices = out["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["text"] for c in choices] == ["onex", "onex", "two twox", "two twox"]
    assert [c["prompt_token_ids"] for c in choices] == [[1], [1], [2, 2], [2, 2]]
    assert out["usage"] == {
        "prompt_tokens": 6 + 10,
        "completion_tokens": 4,
        "total_tokens": 20,
        "prompt_tokens_details": {"cached_tokens": 2 + 4},
    }
    # streamed: each choice's echo opens it, and its offsets start after its own echo
    assert [fmt.opening(i)["choices"][0]["text"] for i in range(4)] == [  # type: ignore[index]
        "one",
        "one",
        "two two",
        "two two",
    ]
    assert [fmt.text_start(i) for i in range(4)] == [3, 3, 7, 7]


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("hi", ["hi"]),
        ([1, 2], [[1, 2]]),
        (["hi"], ["hi"]),
        ([[1, 2]], [[1, 2]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_the_prompts_of_a_request(prompt: Any, prompts: list[Any]) -> None:
    assert protocol.CompletionRequest(prompt=prompt).prompts() == prompts
