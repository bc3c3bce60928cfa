"""The load generator against fake OpenAI-compatible servers (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from orin.bench.client import StreamParser, http_error
from orin.bench.loadgen import LoadSpec, arrival_offsets, plan, run
from orin.bench.prompts import TokenPool, fit_word_count, special_prefix
from orin.bench.sse import SSEDecoder

WORDS_PER_TOKEN = 1  # the fakes "tokenize" one token per word


def sse(chunks: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for c in chunks:
            yield f"data: {json.dumps(c)}\n\n".encode()
            await asyncio.sleep(0.001)
        yield b"data: [DONE]\n\n"

    return gen()


class FakeServer:
    """A minimal OpenAI-compatible completions server: no usage unless asked, text
    chunks of ``per_chunk`` tokens, optionally refusing ignore_eos with a 400."""

    def __init__(self, usage: bool, per_chunk: int = 1, refuse_ignore_eos: bool = False) -> None:
        self.usage, self.per_chunk, self.refuse = usage, per_chunk, refuse_ignore_eos
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "fake", "owned_by": "someone"}]})
        body = json.loads(request.content)
        self.bodies.append(body)
        if self.refuse and "ignore_eos" in body:
            return httpx.Response(400, json={"error": {"code": "unknown_field"}})
        n_in = len(str(body["prompt"]).split()) * WORDS_PER_TOKEN
        n_out = body["max_tokens"]
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out}
        if not body.get("stream"):
            out: dict[str, Any] = {"choices": [{"text": "x"}]}
            return httpx.Response(200, json={**out, **({"usage": usage} if self.usage else {})})
        chunks: list[dict[str, Any]] = [
            {"choices": [{"text": "tok " * self.per_chunk}]} for _ in range(n_out // self.per_chunk)
        ]
        if self.usage:
            chunks.append({"choices": [], "usage": usage})
        return httpx.Response(200, content=sse(chunks))


def spec(**kw: Any) -> LoadSpec:
    base: dict[str, Any] = dict(
        url="http://fake/v1", num_requests=6, input_lens=(8, 32), output_len=6, concurrency=2
    )
    return LoadSpec(**{**base, **kw})


def test_no_usage_falls_back_to_counting_chunks() -> None:
    fake = FakeServer(usage=False)
    r = run(spec(), transport=httpx.MockTransport(fake))
    s = r.summary()
    assert (s["completed"], s["failed"]) == (6, 0)
    assert s["total_output_tokens"] == 36 and s["count_sources"] == {"chunks": 6}
    assert all(x.prompt_tokens is None for x in r.results)
    assert any("no usage" in n for n in r.server.notes)
    assert any("counted from stream chunks" in n for n in r.server.notes)
    assert r.server.kind == "openai" and r.server.model == "fake"
    streamed = [b for b in fake.bodies if b.get("stream")]
    assert len(streamed) == 6 + 1  # the measured requests and one warm-up
    assert all(b["ignore_eos"] is True and b["temperature"] == 0 for b in streamed)
    assert all(b["model"] == "fake" and "return_token_ids" not in b for b in streamed)


def test_server_counts_win_over_chunk_counts() -> None:
    # two tokens per chunk: counting chunks would say 3, usage says 6
    r = run(spec(), transport=httpx.MockTransport(FakeServer(usage=True, per_chunk=2)))
    assert [x.output_tokens for x in r.results] == [6] * 6
    assert {x.count_source for x in r.results} == {"usage"}
    assert all(len(x.itl_ms) == 2 for x in r.results)  # gaps between the 3 chunks
    # text prompts calibrated against usage.prompt_tokens: one token per word here
    assert sorted({x.prompt_tokens for x in r.results}) == [8, 32]


def test_a_server_refusing_ignore_eos_is_still_measured() -> None:
    fake = FakeServer(usage=True, refuse_ignore_eos=True)
    r = run(spec(), transport=httpx.MockTransport(fake))
    assert r.summary()["completed"] == 6 and not r.server.ignore_eos
    assert any("ignore_eos" in n for n in r.server.notes)


def test_outputs_that_end_early_are_reported() -> None:
    class Cut(FakeServer):
        def __call__(self, request: httpx.Request) -> httpx.Response:
            if request.content and json.loads(request.content).get("stream"):
                body = json.loads(request.content)
                n = 2 if len(str(body["prompt"]).split()) > 20 else body["max_tokens"]
                chunks: list[dict[str, Any]] = [{"choices": [{"text": "t "}]}] * n
                usage = {"prompt_tokens": 1, "completion_tokens": n}
                return httpx.Response(200, content=sse([*chunks, {"choices": [], "usage": usage}]))
            return super().__call__(request)

    r = run(spec(), transport=httpx.MockTransport(Cut(usage=True)))
    assert r.to_json()["short_outputs"] == 3
    assert any(
        "3 of 6 completed requests produced fewer than 6 tokens" in n for n in r.server.notes
    )


def test_errors_are_counted_not_raised() -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(404)
        body = json.loads(request.content)
        if body.get("stream") and len(str(body["prompt"]).split()) > 20:
            return httpx.Response(500, json={"error": {"type": "server_error"}})
        return FakeServer(usage=True)(request)

    r = run(spec(num_requests=8), transport=httpx.MockTransport(broken))
    s = r.summary()
    assert (s["completed"], s["failed"]) == (4, 4)
    assert s["errors"] == {"http 500 server_error": 4}


def test_the_open_loop_sends_every_request() -> None:
    r = run(
        spec(concurrency=None, request_rate=200.0, num_requests=5),
        transport=httpx.MockTransport(FakeServer(usage=True)),
    )
    assert [x.index for x in r.results] == [0, 1, 2, 3, 4]
    assert all(x.ok for x in r.results)
    # Each request leaves on its Poisson schedule, never before its arrival time
    # (two arrivals a few microseconds apart may leave in either order).
    s = r.spec
    offsets = arrival_offsets(s.num_requests, s.request_rate, s.burstiness, s.seed)
    assert offsets[-1] > 0.0
    for result, at in zip(r.results, offsets, strict=True):
        assert result.start_s >= at - 1e-3


def test_arrivals_and_plan_are_seeded() -> None:
    assert arrival_offsets(4, None, 1.0, 0) == [0.0] * 4
    a = arrival_offsets(2000, 10.0, 1.0, 7)
    assert a == arrival_offsets(2000, 10.0, 1.0, 7) and a[0] == 0.0
    assert a[-1] / 1999 == pytest.approx(0.1, rel=0.1)  # mean gap 1/rate
    lens = plan(spec(num_requests=9, input_lens=(10, 200, 512)))
    assert sorted(lens) == [10] * 3 + [200] * 3 + [512] * 3
    assert lens == plan(spec(num_requests=9, input_lens=(10, 200, 512)))


def test_spec_rejects_impossible_settings() -> None:
    for bad in (dict(concurrency=None), dict(num_requests=0), dict(request_rate=-1.0)):
        with pytest.raises(ValueError):
            spec(**bad).check()
    assert spec().base_url == "http://fake"


def test_stream_parser_orin_chunks_and_errors() -> None:
    def feed(parser: StreamParser, line: str, t: float) -> None:
        for payload in SSEDecoder().feed(f"{line}\n\n".encode()):
            parser.feed(payload, t)

    p = StreamParser(t0=0.0)
    for i, ids in enumerate(([5], [], [6], [7])):  # [] = held-back text, not a token
        feed(p, f"data: {json.dumps({'choices': [{'text': 'a', 'token_ids': ids}]})}", 0.01 * i)
    feed(p, 'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 3}}', 0.05)
    feed(p, "data: [DONE]", 0.06)
    r = p.result(0, 9, 0.0)
    assert r.ok and r.output_tokens == 3 and r.count_source == "usage"
    assert r.ttft_ms == pytest.approx(0.0) and r.e2el_ms == pytest.approx(30.0)
    assert r.itl_ms == pytest.approx((20.0, 10.0)) and r.tpot_ms == pytest.approx(15.0)
    bad = StreamParser(t0=0.0)
    feed(bad, 'data: {"error": {"type": "server_error", "message": "boom"}}', 0.1)
    assert bad.result(1, 9, 0.0).error == "stream error server_error"
    assert StreamParser(t0=0.0).result(2, 9, 0.0).error == "no tokens"
    resp = httpx.Response(400, json={"error": {"code": "context_length_exceeded"}})
    assert http_error(resp) == "http 400 context_length_exceeded"
    assert http_error(httpx.Response(502, text="bad gateway")) == "http 502"


def test_token_prompts_have_exact_lengths() -> None:
    import random

    pool = TokenPool.from_tokenizations([1, 50, 51, 52], [1, 60, 61])
    assert pool.prefix == (1,) and 1 not in pool.pool
    rng = random.Random(0)
    for n in (1, 2, 17, 300):
        prompt = pool.prompt(rng, n)
        assert len(prompt) == n and prompt[0] == 1
    assert special_prefix([1, 2, 3], [4, 2, 3]) == []
    assert fit_word_count(100, 50, 125) == 40


def test_sse_framing_across_chunks_crlf_comments_and_a_missing_last_separator() -> None:
    d = SSEDecoder()
    assert d.feed(b'data: {"a"') == []  # an event split over chunks waits for its end
    assert d.feed(b": 1}\n\n: ping\n\ndata: x\r") == [b'{"a": 1}']  # the comment gives nothing
    assert d.feed(b"\n\r\nevent: e\ndata: one\ndata:two\n\n") == [b"x", b"one\ntwo"]
    assert d.feed(b"data: [DONE]") == [] and d.close() == [b"[DONE]"]
    assert d.close() == []
