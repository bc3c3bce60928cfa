"""The load generator against fake OpenAI-compatible servers: stand-ins on 127.0.0.1
(http.server in a thread) that stream SSE with chunked or connection-close framing."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from orin.bench.client import StreamParser, failure_kind, http_error
from orin.bench.loadgen import (
    MAX_INPUT_LEN,
    BenchRun,
    LoadSpec,
    arrival_offsets,
    plan,
    run,
    run_bench,
)
from orin.bench.prompts import TokenPool, fit_word_count, special_prefix
from orin.bench.server import BenchError, InputTooLong, UnknownModel
from orin.bench.sse import SSEDecoder

WORDS_PER_TOKEN = 1  # the fakes "tokenize" one token per word
FRAMINGS = ("chunked", "close")


@dataclass
class Answer:
    """What a fake says: a JSON body, or (``events`` set) an SSE stream ending in
    ``[DONE]``; ``stall`` is waited on before the stream's second event; ``cut`` closes
    the connection after the first event, without ending the chunked body."""

    status: int = 200
    body: Any = None
    events: list[dict[str, Any]] | None = None
    stall: threading.Event | None = None
    cut: bool = False


@dataclass
class Seen:
    """One request as the fake received it."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]


App = Callable[[Seen], Answer]


def _handler(app: App, framing: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._answer(Seen(self.path, {}, dict(self.headers)))

        def do_POST(self) -> None:
            data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._answer(Seen(self.path, json.loads(data), dict(self.headers)))

        def _answer(self, seen: Seen) -> None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self._reply(app(seen))  # a client may hang up after [DONE] or a timeout

        def _reply(self, answer: Answer) -> None:
            self.send_response(answer.status)
            if answer.events is None:
                data = json.dumps(answer.body).encode() if answer.body is not None else b""
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_header("Content-Type", "text/event-stream")
            if framing == "chunked":
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            events = [f"data: {json.dumps(e)}\n\n".encode() for e in answer.events]
            for i, event in enumerate([*events, b"data: [DONE]\n\n"]):
                if i == 1 and answer.stall is not None:
                    answer.stall.wait(30)
                if i == 1 and answer.cut:  # a server that died mid-stream
                    self.close_connection = True
                    return
                self._write(event, framing)
                time.sleep(0.001)
            if framing == "chunked":
                self.wfile.write(b"0\r\n\r\n")

        def _write(self, data: bytes, framing: str) -> None:
            if framing == "chunked":
                data = b"%x\r\n%s\r\n" % (len(data), data)
            self.wfile.write(data)
            self.wfile.flush()

    return Handler


@contextlib.contextmanager
def serving(app: App, framing: str = "chunked") -> Iterator[str]:
    """The app on an ephemeral port of 127.0.0.1; yields its URL (with /v1)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(app, framing))
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


class FakeServer:
    """A minimal OpenAI-compatible completions server: no usage unless asked, text
    chunks of ``per_chunk`` tokens, optionally refusing ignore_eos with a 400."""

    def __init__(self, usage: bool, per_chunk: int = 1, refuse_ignore_eos: bool = False) -> None:
        self.usage, self.per_chunk, self.refuse = usage, per_chunk, refuse_ignore_eos
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self._lock = threading.Lock()

    def __call__(self, seen: Seen) -> Answer:
        if seen.path == "/v1/models":
            return Answer(body={"data": [{"id": "fake", "owned_by": "someone"}]})
        body = seen.body
        with self._lock:
            self.bodies.append(body)
            self.headers.append(seen.headers)
        if self.refuse and "ignore_eos" in body:
            return Answer(400, {"error": {"code": "unknown_field"}})
        n_in = len(str(body["prompt"]).split()) * WORDS_PER_TOKEN
        n_out = body["max_tokens"]
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out}
        if not body.get("stream"):
            out: dict[str, Any] = {"choices": [{"text": "x"}]}
            return Answer(body={**out, **({"usage": usage} if self.usage else {})})
        chunks: list[dict[str, Any]] = [
            {"choices": [{"text": "tok " * self.per_chunk}]} for _ in range(n_out // self.per_chunk)
        ]
        if self.usage:
            chunks.append({"choices": [], "usage": usage})
        return Answer(events=chunks)


def spec(**kw: Any) -> LoadSpec:
    base: dict[str, Any] = dict(
        url="http://fake/v1", num_requests=6, input_lens=(8, 32), output_len=6, concurrency=2
    )
    return LoadSpec(**{**base, **kw})


def bench(app: App, framing: str = "chunked", **kw: Any) -> BenchRun:
    with serving(app, framing) as url:
        return run(spec(url=url, **kw))


@pytest.mark.parametrize("framing", FRAMINGS)
def test_no_usage_falls_back_to_counting_chunks(framing: str) -> None:
    fake = FakeServer(usage=False)
    r = bench(fake, framing)
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
    assert all(b["stream_options"] == {"include_usage": True} for b in streamed)
    assert all(b["max_tokens"] == 6 for b in streamed)


@pytest.mark.parametrize("framing", FRAMINGS)
def test_server_counts_win_over_chunk_counts(framing: str) -> None:
    # two tokens per chunk: counting chunks would say 3, usage says 6
    r = bench(FakeServer(usage=True, per_chunk=2), framing)
    assert [x.output_tokens for x in r.results] == [6] * 6
    assert {x.count_source for x in r.results} == {"usage"}
    assert all(len(x.itl_ms) == 2 for x in r.results)  # gaps between the 3 chunks
    # text prompts calibrated against usage.prompt_tokens: one token per word here
    assert {x.prompt_tokens for x in r.results} == {8, 32}


def test_a_server_refusing_ignore_eos_is_still_measured() -> None:
    fake = FakeServer(usage=True, refuse_ignore_eos=True)
    r = bench(fake)
    assert r.summary()["completed"] == 6 and not r.server.ignore_eos
    assert any("ignore_eos" in n for n in r.server.notes)


def test_the_api_key_and_the_model_go_with_every_request() -> None:
    class Two(FakeServer):
        def __call__(self, seen: Seen) -> Answer:
            if seen.path == "/v1/models":
                return Answer(body={"data": [{"id": "fake"}, {"id": "named"}]})
            return super().__call__(seen)

    fake = Two(usage=True)
    r = bench(fake, api_key="sekrit", model="named")
    assert r.summary()["completed"] == 6 and r.server.model == "named"
    assert fake.headers and all(h["Authorization"] == "Bearer sekrit" for h in fake.headers)
    assert all(b["model"] == "named" for b in fake.bodies)


def test_a_model_the_server_does_not_list_stops_the_run_before_any_request() -> None:
    """A server may answer for any model name (orin-llm's default): a mistyped --model
    would be measured and reported under a name the server does not serve."""
    fake = FakeServer(usage=True)
    seen: list[str] = []

    def watched(s: Seen) -> Answer:
        seen.append(s.path)
        return fake(s)

    with serving(watched) as url, pytest.raises(UnknownModel) as caught:
        run(spec(url=url, model="nosuch"))
    assert caught.value.listed == ("fake",)
    assert "does not serve a model 'nosuch'; its /v1/models lists: fake" in str(caught.value)
    assert seen == ["/v1/models"]  # nothing but the list was asked for


def test_a_server_that_lists_no_models_takes_the_name_as_given() -> None:
    fake = FakeServer(usage=True)

    def unlisted(s: Seen) -> Answer:
        return Answer(404) if s.path == "/v1/models" else fake(s)

    r = bench(unlisted, model="whatever", num_requests=2)
    assert r.summary()["completed"] == 2 and r.server.model == "whatever"
    assert all(b["model"] == "whatever" for b in fake.bodies)


@pytest.mark.parametrize(
    ("key", "says"),
    [
        (None, "refused the request (401): it requires an API key; give it with --api-key"),
        ("wrong", "refused the API key (401): check --api-key or ORIN_LLM_API_KEY"),
    ],
)
def test_a_server_that_wants_another_key_is_said_to(key: str | None, says: str) -> None:
    """A 401 to the probe is about the key, not a refused ignore_eos: the run stops with
    what to give, once, without a second probe."""
    fake = FakeServer(usage=True)
    probes: list[Seen] = []

    def keyed(seen: Seen) -> Answer:
        if seen.headers.get("Authorization") != "Bearer right":
            probes.append(seen)
            return Answer(401, {"error": {"code": "invalid_api_key"}})
        return fake(seen)

    with serving(keyed) as url, pytest.raises(BenchError) as caught:
        run(spec(url=url, api_key=key))
    assert says in str(caught.value)
    assert len([p for p in probes if p.path.endswith("/completions")]) == 1


@pytest.mark.parametrize(
    ("app_paths", "source"),
    [
        ({"/v1/models": {"data": [{"id": "m", "owned_by": "orin-llm",
                                   "meta": {"n_ctx_per_slot": 64}}]}}, "meta.n_ctx_per_slot"),
        ({"/v1/models": {"data": [{"id": "m", "max_model_len": 64}]}}, "max_model_len"),
        ({"/v1/models": {"data": [{"id": "m", "owned_by": "llamacpp"}]},
          "/props": {"default_generation_settings": {"n_ctx": 64}}}, "/props n_ctx"),
    ],
)  # fmt: skip
def test_an_input_length_beyond_the_servers_context_sends_nothing(
    app_paths: dict[str, Any], source: str
) -> None:
    """orin-llm, vLLM and llama-server say how many tokens a request may hold: a
    longer prompt would fail every request, so the run stops before any completion."""
    seen: list[Seen] = []
    fake = FakeServer(usage=True)

    def sized(s: Seen) -> Answer:
        seen.append(s)
        return Answer(body=app_paths[s.path]) if s.path in app_paths else fake(s)

    with serving(sized) as url:
        with pytest.raises(InputTooLong) as caught:
            run(spec(url=url, input_lens=(8, 64)))
        assert (caught.value.length, caught.value.context) == (64, 64)
        assert f"context of 64 tokens per request ({source})" in str(caught.value)
        assert [s.path for s in seen] == list(app_paths)  # GETs only, no completion
        assert caught.value.options == ("input",)  # the input alone is too long
        # the input fits, the output asked for after it does not: refused all the same
        with pytest.raises(InputTooLong) as caught:
            run(spec(url=url, input_lens=(8, 60), output_len=6))
        assert (caught.value.length, caught.value.output_len) == (60, 6)
        assert caught.value.options == ("input", "output")
        assert "60 input tokens and 6 output tokens do not fit" in str(caught.value)
        assert "an output of at most 4 with this input" in str(caught.value)
        assert "an input of at most 58 with this output" in str(caught.value)
        with pytest.raises(InputTooLong) as caught:
            run(spec(url=url, input_lens=(8,), output_len=64))
        assert caught.value.options == ("output",)
        assert not [s for s in seen if s.path.endswith("/completions")]
        # input and output that fill the context exactly are run
        done = run(spec(url=url, input_lens=(8, 58), output_len=6, num_requests=2))
        assert done.summary()["completed"] == 2


def test_input_lengths_past_the_largest_context_are_refused_at_once() -> None:
    spec(input_lens=(8, MAX_INPUT_LEN)).check()
    with pytest.raises(ValueError, match="at most 1048576 tokens"):
        spec(input_lens=(8, 99_999_999)).check()


def test_a_cancelled_run_closes_the_streams_in_flight() -> None:
    """Ctrl-C cancels the run: the worker threads blocked reading streams must end at
    once (the interpreter joins them before it exits), not when the server finishes."""
    release, streaming = threading.Event(), threading.Event()
    fake = FakeServer(usage=True)

    def stalling(seen: Seen) -> Answer:
        answer = fake(seen)
        if answer.events is not None:
            answer.stall = release  # the first token, then nothing until released
            streaming.set()
        return answer

    async def cancel_mid_stream(url: str) -> None:
        task = asyncio.create_task(run_bench(spec(url=url, warmup=0, concurrency=2)))
        await asyncio.get_running_loop().run_in_executor(None, streaming.wait, 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        with serving(stalling) as url:
            asyncio.run(cancel_mid_stream(url))
            workers = [t for t in threading.enumerate() if t.name.startswith("orin-bench")]
            for t in workers:
                t.join(10)  # the stall lasts 30 s: a worker still alive waits on it
            assert not [t for t in workers if t.is_alive()]
    finally:
        release.set()


def test_outputs_that_end_early_are_reported() -> None:
    class Cut(FakeServer):
        def __call__(self, seen: Seen) -> Answer:
            if seen.body.get("stream"):
                body = seen.body
                n = 2 if len(str(body["prompt"]).split()) > 20 else body["max_tokens"]
                chunks: list[dict[str, Any]] = [{"choices": [{"text": "t "}]}] * n
                usage = {"prompt_tokens": 1, "completion_tokens": n}
                return Answer(events=[*chunks, {"choices": [], "usage": usage}])
            return super().__call__(seen)

    r = bench(Cut(usage=True))
    assert r.to_json()["short_outputs"] == 3
    assert any(
        "3 of 6 completed requests produced fewer than 6 tokens" in n for n in r.server.notes
    )


def test_errors_are_counted_not_raised() -> None:
    def broken(seen: Seen) -> Answer:
        if seen.path == "/v1/models":
            return Answer(404)
        body = seen.body
        if body.get("stream") and len(str(body["prompt"]).split()) > 20:
            return Answer(500, {"error": {"type": "server_error"}})
        return FakeServer(usage=True)(seen)

    r = bench(broken, num_requests=8)
    s = r.summary()
    assert (s["completed"], s["failed"]) == (4, 4)
    assert s["errors"] == {"http 500 server_error": 4}


def test_failed_connections_are_counted_in_words() -> None:
    """The errors table names what happened to a connection, not Python's exception
    class: a stream cut off mid-way (a server killed during the run) is a broken stream."""
    fake = FakeServer(usage=True)

    def dying(seen: Seen) -> Answer:
        answer = fake(seen)
        answer.cut = answer.events is not None  # every stream; the probes are not streamed
        return answer

    s = bench(dying, num_requests=4, concurrency=1, warmup=0).summary()
    assert (s["completed"], s["failed"], s["errors"]) == (0, 4, {"broken stream": 4})
    assert failure_kind(ConnectionRefusedError(111, "Connection refused")) == "connection refused"
    assert failure_kind(http.client.RemoteDisconnected("x")) == "closed without a response"
    assert failure_kind(ConnectionResetError(104, "reset")) == "connection reset"
    assert failure_kind(OSError(113, "No route to host")) == "OSError"  # no words: its name


def test_a_stalled_stream_times_out() -> None:
    release = threading.Event()
    fake = FakeServer(usage=True)

    def stalling(seen: Seen) -> Answer:
        answer = fake(seen)
        if answer.events is not None:
            answer.stall = release
        return answer

    try:
        r = bench(stalling, timeout_s=1.0, warmup=0, concurrency=6)
    finally:
        release.set()
    s = r.summary()
    assert (s["completed"], s["failed"]) == (0, 6)
    assert s["errors"] == {"timeout": 6}


@pytest.mark.parametrize(("rate", "written"), [(None, "inf"), (float("inf"), "inf"), (2.5, 2.5)])
def test_the_request_rate_is_valid_json_written_as_vllm_writes_it(
    rate: float | None, written: float | str
) -> None:
    """--request-rate inf is written "inf", as a closed loop's and as vLLM's benchmark
    writes it: json would write the float as Infinity, which JSON parsers refuse."""
    r = bench(FakeServer(usage=True), concurrency=1, request_rate=rate, num_requests=1)
    data = r.to_json()
    assert data["request_rate"] == written
    json.dumps(data, allow_nan=False)  # strict JSON


def test_the_open_loop_sends_every_request() -> None:
    r = bench(FakeServer(usage=True), concurrency=None, request_rate=200.0, num_requests=5)
    assert [x.index for x in r.results] == [0, 1, 2, 3, 4]
    assert all(x.ok for x in r.results)
    # Each request leaves on its Poisson schedule, never before its arrival time
    # (two arrivals a few microseconds apart may leave in either order).
    s = r.spec
    offsets = arrival_offsets(s.num_requests, s.request_rate, s.burstiness, s.seed)
    assert offsets[-1] > 0.0
    for result, at in zip(r.results, offsets, strict=True):
        assert result.start_s >= at - 1e-3


def test_open_loop_arrivals_never_wait_for_a_free_worker() -> None:
    # Every stream is held open until all of them have arrived: a pool smaller than
    # the number of requests would leave the barrier short and the streams failing.
    n = 6
    barrier = threading.Barrier(n)
    fake = FakeServer(usage=True)

    def gathering(seen: Seen) -> Answer:
        if seen.body.get("stream"):
            try:
                barrier.wait(30)
            except threading.BrokenBarrierError:
                return Answer(503, {"error": {"code": "barrier_broken"}})
        return fake(seen)

    r = bench(gathering, concurrency=None, request_rate=100.0, num_requests=n, warmup=0)
    assert [x.error for x in r.results] == [None] * n
    offsets = arrival_offsets(n, 100.0, 1.0, 0)
    assert offsets[-1] > 0.0
    for result, at in zip(r.results, offsets, strict=True):
        assert result.start_s >= at - 1e-3  # sent no earlier than its arrival time
    assert not any("client threads busy" in note for note in r.server.notes)
    assert spec(concurrency=None, request_rate=1.0, num_requests=300).workers == 300
    assert spec(concurrency=3, request_rate=1.0).workers == 3


def test_arrivals_past_the_thread_cap_are_sent_late_and_noted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("orin.bench.loadgen.OPEN_LOOP_THREADS", 3)
    r = bench(FakeServer(usage=True), concurrency=None, request_rate=float("inf"), warmup=0)
    assert r.summary()["completed"] == 6 and r.spec.workers == 3
    assert "3 arrivals found all 3 client threads busy and were sent late" in r.server.notes


def test_the_closed_loop_keeps_at_most_n_streams_in_flight() -> None:
    fake = FakeServer(usage=True)
    lock, now, most = threading.Lock(), [0], [0]

    def counting(seen: Seen) -> Answer:
        if not seen.body.get("stream"):
            return fake(seen)
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        try:
            time.sleep(0.005)
            return fake(seen)
        finally:
            with lock:
                now[0] -= 1

    r = bench(counting, num_requests=8, concurrency=2)
    assert r.summary()["completed"] == 8 and 1 <= most[0] <= 2


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
    body = json.dumps({"error": {"code": "context_length_exceeded"}}).encode()
    assert http_error(400, body) == "http 400 context_length_exceeded"
    assert http_error(502, b"bad gateway") == "http 502"


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
