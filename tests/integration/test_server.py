"""orin-llm serve over real sockets, with the official openai client and raw HTTP."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from orin.model import demo
from orin.server.state import ServerState
from tests.serverutil import live_server, wait_idle

pytestmark = pytest.mark.llama

PROFILE = """
engine: {n_ctx: 512, slots: 8, n_batch: 128, n_ubatch: 128}
context: {keep: 4}
server: {max_queue: 4, max_body_bytes: 65536, max_tokens_limit: 600}
"""


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ServerState]]:
    model = demo.ensure("small", "f16")
    with live_server(model, PROFILE.replace("server: {", "server: {model_name: demo, ")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: tuple[str, ServerState]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0)


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]


def test_a_request_naming_another_model_is_served_by_this_one(client: openai.OpenAI) -> None:
    """The default model_match 'any': clients that hard-code a model name still work,
    and the response names the model that answered."""
    r = client.completions.create(model="gpt-3.5-turbo", prompt="x", max_tokens=2)
    assert r.model == "demo" and r.usage is not None and r.usage.completion_tokens == 2


def test_chat_and_streamed_chat_agree(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Say something about Orin."}]
    full = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=20, temperature=0
    )
    assert full.choices[0].finish_reason == "length"
    assert full.usage is not None and full.usage.completion_tokens == 20
    text = full.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=messages,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 20


def test_completions_with_timings_and_token_ids(server: tuple[str, ServerState]) -> None:
    body = {
        "model": "demo",
        "prompt": "The board boots and",
        "max_tokens": 8,
        "temperature": 0,
        "return_token_ids": True,
        "logprobs": 2,
    }
    r = httpx.post(f"{server[0]}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    data = r.json()
    choice = data["choices"][0]
    assert len(choice["token_ids"]) == 8 == data["usage"]["completion_tokens"]
    assert isinstance(choice["text"], str) and all(isinstance(t, int) for t in choice["token_ids"])
    assert len(choice["logprobs"]["top_logprobs"][0]) == 2
    t = data["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] + t["cache_n"] == data["usage"]["prompt_tokens"]
    assert t["ttft_ms"] > 0 and t["tpot_ms"] > 0 and t["predicted_per_second"] > 0
    # OpenAI's id kind, new for every response; the request id stays in the header
    assert data["id"].startswith("cmpl-") and r.headers["x-request-id"] not in data["id"]
    again = httpx.post(
        f"{server[0]}/v1/completions",
        json=body,
        headers={"x-request-id": r.headers["x-request-id"]},
        timeout=60,
    ).json()
    assert again["id"] != data["id"]
    assert data["system_fingerprint"].startswith("fp_")
    assert again["system_fingerprint"] == data["system_fingerprint"]


def test_a_batch_of_prompts_with_n_choices(
    client: openai.OpenAI, server: tuple[str, ServerState]
) -> None:
    """OpenAI's prompt list: the n choices of each prompt in turn (index = prompt x n +
    choice), each the greedy answer its prompt gets alone; usage counts each prompt
    once, with the access log's figures."""
    prompts = ["The board boots and", "Robots on the floor"]
    alone = [
        client.completions.create(model="demo", prompt=p, max_tokens=6, temperature=0)
        for p in prompts
    ]
    batch = client.completions.create(
        model="demo", prompt=prompts, n=2, max_tokens=6, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    texts = [a.choices[0].text for a in alone]
    assert [c.text for c in batch.choices] == [texts[0], texts[0], texts[1], texts[1]]
    assert batch.usage is not None and alone[0].usage is not None and alone[1].usage is not None
    assert batch.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens
    assert batch.usage.completion_tokens == 4 * 6
    streamed = client.completions.create(
        model="demo", prompt=prompts, n=2, max_tokens=6, temperature=0, stream=True
    )
    got = ["", "", "", ""]
    for chunk in streamed:
        for c in chunk.choices:
            got[c.index] += c.text
    assert got == [c.text for c in batch.choices]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_n_predict_0_computes_the_prompt_into_the_cache(
    server: tuple[str, ServerState], route: str
) -> None:
    """llama-server's n_predict 0 (a cache warm-up): the prompt is computed and nothing is
    generated; the next request with that prompt finds its cells."""
    chat = route.endswith("chat/completions")
    ask: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "Warm the cache for the robot arm."}]}
        if chat
        else {"prompt": "Warm the cache for the robot arm, then answer."}
    )
    for stream in (False, True):
        r = httpx.post(
            f"{server[0]}{route}", json={**ask, "n_predict": 0, "stream": stream}, timeout=60
        )
        assert r.status_code == 200, r.text
        if stream:
            events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
            choices = [c for e in events for c in e["choices"]]
            texts = [c["delta"].get("content") if chat else c["text"] for c in choices]
            assert not any(texts)
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            continue
        data = r.json()
        choice = data["choices"][0]
        assert (choice["message"]["content"] if chat else choice["text"]) == ""
        assert choice["finish_reason"] == "length" and data["usage"]["completion_tokens"] == 0
    then = httpx.post(f"{server[0]}{route}", json={**ask, "n_predict": 2}, timeout=60).json()
    assert then["usage"]["completion_tokens"] == 2
    prompt = then["usage"]["prompt_tokens"]
    assert then["usage"]["prompt_tokens_details"]["cached_tokens"] == prompt - 1


def test_json_schema_response_format(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "json please"}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    assert json.loads(r.choices[0].message.content or "") in ({"ok": True}, {"ok": False})


def test_eight_concurrent_streams_match_single_runs(server: tuple[str, ServerState]) -> None:
    base = server[0]
    prompts = [f"Stream number {i} on the edge board with prompt {i * 7}" for i in range(8)]

    def run(prompt: str, stream: bool) -> str:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": stream}
        if not stream:
            return str(
                httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0][
                    "text"
                ]
            )
        text = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    text.append(json.loads(line[6:])["choices"][0]["text"])
        return "".join(text)

    alone = [run(p, stream=False) for p in prompts]
    results: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda i=i: results.__setitem__(i, run(prompts[i], True)))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(8)] == alone


def test_clients_that_leave_free_their_slots(server: tuple[str, ServerState]) -> None:
    base = server[0]
    port = int(base.rsplit(":", 1)[1])
    body = json.dumps({"prompt": "leave early " * 10, "max_tokens": 500, "stream": True}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    for _ in range(20):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(request)
            got = b""
            while got.count(b"data: ") < 3:  # mid-stream
                got += s.recv(4096)
        # the socket is closed here, with the stream still running on the server
    health = wait_idle(base)
    assert health["slots_busy"] == 0 and health["kv_cells_used"] == 0
    metrics = httpx.get(f"{base}/metrics").text
    assert 'orin_llm_requests_total{finish_reason="cancelled"}' in metrics


def _counted(base: str, route: str, status: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("orin_llm_http_requests_total{") and all(
            label in line for label in (f'route="{route}"', f'status="{status}"')
        ):
            return float(line.split()[-1])
    return 0.0


@pytest.mark.parametrize("n", [1, 2])
def test_a_streaming_client_that_leaves_is_logged_and_counted_as_499(
    server: tuple[str, ServerState], caplog: pytest.LogCaptureFixture, n: int
) -> None:
    """...not as a 200 (its answer was not all sent), and its access log line has the
    tokens it was served, as the line of an answer that ended has."""
    base = server[0]
    port = int(base.rsplit(":", 1)[1])
    route = "/v1/chat/completions"
    before = {s: _counted(base, route, s) for s in ("200", "499")}
    rid = f"req-leaves-mid-stream-{n}"
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Tell me everything."}],
            "max_tokens": 600,
            "ignore_eos": True,  # it ends only when the client leaves
            "n": n,
            "stream": True,
        }
    ).encode()
    with caplog.at_level(logging.INFO, "orin.access"):
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                + f"X-Request-Id: {rid}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            got = b""
            while got.count(b'"content": "') < 3:  # tokens arrived: mid-stream
                got += s.recv(4096)
        health = wait_idle(base)
        assert health["slots_busy"] == 0 and health["kv_cells_used"] == 0
        deadline = time.monotonic() + 60  # the log line comes once the request has ended
        while not (lines := [r for r in caplog.records if rid in r.getMessage()]):
            assert time.monotonic() < deadline
            threading.Event().wait(0.01)
    fields = lines[0].fields  # type: ignore[attr-defined]
    assert fields["status"] == 499
    assert 1 <= fields["generated_tokens"] < 600 and fields["ttft_ms"] is not None
    assert _counted(base, route, "499") == before["499"] + 1
    assert _counted(base, route, "200") == before["200"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_access_log_counts_the_tokens_of_every_choice(
    server: tuple[str, ServerState], caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    """With n choices the access log line has the tokens usage has (every choice's),
    not one choice's."""
    base = server[0]
    rid = f"req-access-log-n3-{int(stream)}"
    body = {"prompt": "Orin", "n": 3, "max_tokens": 5, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    with caplog.at_level(logging.INFO, "orin.access"):
        r = httpx.post(f"{base}/v1/completions", json=body, headers={"x-request-id": rid})
        assert r.status_code == 200
        if stream:
            events = [ln[6:] for ln in r.text.splitlines() if ln.startswith("data: {")]
            usage = json.loads(events[-1])["usage"]
        else:
            usage = r.json()["usage"]
        deadline = time.monotonic() + 60  # the line comes once the response has ended
        while not (lines := [r for r in caplog.records if rid in r.getMessage()]):
            assert time.monotonic() < deadline
            threading.Event().wait(0.01)
    assert usage["completion_tokens"] == 15
    fields = lines[0].fields  # type: ignore[attr-defined]
    assert fields["generated_tokens"] == 15
    assert fields["prompt_tokens"] == usage["prompt_tokens"]
    assert fields["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]


def test_non_streaming_client_that_leaves_is_cancelled(server: tuple[str, ServerState]) -> None:
    """...and counted as 499 (the client closed the request), not as a 5xx."""
    base = server[0]
    port = int(base.rsplit(":", 1)[1])

    def counted(status: str) -> float:
        for line in httpx.get(f"{base}/metrics").text.splitlines():
            if line.startswith("orin_llm_http_requests_total{") and all(
                label in line for label in ('route="/v1/completions"', f'status="{status}"')
            ):
                return float(line.split()[-1])
        return 0.0

    before = {s: counted(s) for s in ("499", "503")}
    body = json.dumps({"prompt": "wait for me", "max_tokens": 600, "temperature": 0}).encode()
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        engine = server[1].engine
        deadline = time.monotonic() + 60  # the request is read and running (however loaded
        while not (running := engine.status().slots_busy > 0):  # the machine), then the
            assert time.monotonic() < deadline  # client goes away
            threading.Event().wait(0.005)
        assert running
    health = wait_idle(base)
    assert health["slots_busy"] == 0 and health["kv_cells_used"] == 0
    deadline = time.monotonic() + 60  # the request's log line comes after its streams
    while counted("499") == before["499"] and time.monotonic() < deadline:  # ended; on a
        threading.Event().wait(0.01)  # loaded machine, a while after
    assert counted("499") == before["499"] + 1
    assert counted("503") == before["503"]


def test_metrics_pass_promtool(server: tuple[str, ServerState], tmp_path: Path) -> None:
    import subprocess

    from tests.tools import promtool_or_skip

    text = httpx.get(f"{server[0]}/metrics").text
    assert "orin_llm_time_to_first_token_seconds_bucket" in text
    promtool = promtool_or_skip()
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_benchmarks_lean_client_counts_what_the_server_streams(
    server: tuple[str, ServerState],
) -> None:
    from orin.bench.client import stream, streams

    base, _ = server
    one = stream(base, "lean client", 12)
    assert one.error is None
    assert one.usage_tokens == 12 and len(one.token_times) == 12  # one chunk per token
    assert one.ttft_ms is not None and one.ttft_ms > 0
    assert one.tpot_ms is not None and len(one.itl_ms) == 11
    assert one.server_tpot_ms is not None
    _, many = streams(base, [f"lean {i}" for i in range(3)], 5)
    assert [r.tokens for r in many] == [5, 5, 5]
    bad = stream(base.replace(base.rsplit(":", 1)[1], "9"), "no server here", 4)
    assert bad.error is not None and bad.tokens == 0


def test_a_large_prompt_is_rendered_and_tokenized_off_the_event_loop(
    server: tuple[str, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body of many messages takes seconds to render and tokenize; on the event loop
    that stopped every other client's stream for as long (4 s for 1.9 MB of messages
    on the 2-core VM). A large body is prepared on a worker thread; a small one stays
    on the loop, where it costs less than the hop."""
    base, state = server
    engine = state.engine
    where: dict[str, list[str]] = {"render": [], "tokenize": []}
    render, tokenize = engine.render_chat, engine.tokenize

    def rendering(*args: Any, **kwargs: Any) -> Any:
        where["render"].append(threading.current_thread().name)
        return render(*args, **kwargs)

    def tokenizing(*args: Any, **kwargs: Any) -> Any:
        where["tokenize"].append(threading.current_thread().name)
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(engine, "render_chat", rendering)
    monkeypatch.setattr(engine, "tokenize", tokenizing)
    loop = "test-uvicorn"  # live_server's thread, which runs the event loop
    few = [{"role": "user", "content": "hi"}]
    many = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}] * 400
    for path, body, on_loop in (
        ("chat/completions", {"messages": few}, True),
        ("chat/completions", {"messages": many}, False),
        ("completions", {"prompt": "hi"}, True),
        ("completions", {"prompt": "hi " * 2000}, False),
    ):
        where["render"].clear()
        where["tokenize"].clear()
        r = httpx.post(f"{base}/v1/{path}", json={**body, "max_tokens": 1}, timeout=60)
        assert r.status_code in (200, 400), r.text  # 400: longer than the window
        threads = where["tokenize"] + where["render"]
        assert where["tokenize"] and (path == "completions" or where["render"]), path
        assert all((name == loop) == on_loop for name in threads), (path, on_loop, threads)


@pytest.mark.parametrize("sliding", [True, False])
def test_an_over_long_prompt_is_cut_so_that_the_answer_has_room(sliding: bool) -> None:
    """context.overflow: truncate cuts a prompt over the window as a context shift
    would: its first `keep` tokens and the most recent ones, half the rest of the
    window. Cut to the whole window, the answer had no room: with sliding off a request
    without max_tokens got one token and one with max_tokens a 400 asking to shorten
    the prompt; with sliding on its first token shifted the context, the prompt's
    middle computed only to be discarded."""
    profile = (
        "engine: {n_ctx: 256, slots: 2, n_batch: 128, n_ubatch: 128}\n"
        f"context: {{keep: 8, overflow: truncate, sliding: {str(sliding).lower()}}}\n"
        "sampling: {max_tokens: 40, temperature: 0}\n"
    )
    with live_server(demo.ensure("small", "f16"), profile) as (base, _):
        prompt = " ".join(f"line {i} of the log" for i in range(120))
        for max_tokens in (None, 100):
            body = {"prompt": prompt, "ignore_eos": True, "max_tokens": max_tokens}
            r = httpx.post(base + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["usage"]["prompt_tokens"] == 8 + (256 - 8) // 2
            assert out["usage"]["completion_tokens"] == (max_tokens or 40)
            assert out["timings"]["context_shifts"] == 0
        r = httpx.post(base + "/v1/completions", json={**body, "max_tokens": 130}, timeout=120)
        if sliding:  # past the room, the window slides
            assert r.status_code == 200 and r.json()["timings"]["context_shifts"] == 1
        else:
            assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
            assert "ask for 124 at most" in r.json()["error"]["message"]
