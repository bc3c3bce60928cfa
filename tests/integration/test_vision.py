"""Images in chat completions on real llama.cpp: the demo model with its generated
vision projector (orin/model/mmproj.py), through the engine and the server."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import gc
import http.server
import io
import json
import socket
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from orin.engine.config import engine_config
from orin.engine.engine import Engine
from orin.engine.errors import InvalidRequest
from orin.engine.types import SamplingParams, StepStats
from orin.engine.vision import MEDIA_MARKER, ImageSpan, RGBImage
from orin.model import demo, mmproj
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile
from orin.server import images as server_images
from orin.server.images import ImageLimits
from orin.server.state import ServerState
from tests.serverutil import free_port, live_server, poll, wait_idle

pytestmark = pytest.mark.llama

VISION = "model: {demo: {size: tiny, quant: f16}, mmproj_demo: true}\n"
ENGINE = "engine: {n_ctx: 512, slots: 10, n_batch: 64, n_ubatch: 64, prefill_chunk: 8}\n"
SEEDED = dict(temperature=0.8, seed=1234)


@pytest.fixture(scope="module")
def tiny() -> Path:
    return demo.ensure("tiny", "f16")


@pytest.fixture(scope="module")
def engine(tiny: Path) -> Iterator[Engine]:
    profile = parse_profile(f"name: t\n{VISION}{ENGINE}")
    cfg = engine_config(profile, tiny, read_model_info(tiny))
    assert cfg.mmproj == mmproj.ensure("tiny")
    with Engine(cfg) as e:
        yield e


def picture(seed: int, width: int = 48, height: int = 40) -> RGBImage:
    rng = np.random.default_rng(seed)
    return RGBImage(width, height, rng.integers(0, 256, width * height * 3, np.uint8).tobytes())


def chat(question: str, images: int = 1) -> str:
    marks = MEDIA_MARKER * images
    return f"<|im_start|>user\n{marks}{question}<|im_end|>\n<|im_start|>assistant\n"


def png_url(seed: int, size: tuple[int, int] = (48, 40)) -> str:
    img = picture(seed, *size)
    buf = io.BytesIO()
    Image.frombytes("RGB", (img.width, img.height), img.pixels).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(engine: Engine, question: str, img: RGBImage, **params: Any) -> Any:
    media = engine.tokenize_media(chat(question), [img])
    return engine.submit(media.tokens, SamplingParams(**params), media=media)


# -- engine ----------------------------------------------------------------------------


def test_an_image_prompt_is_encoded_once_and_answered(engine: Engine) -> None:
    steps: list[StepStats] = []
    engine.add_step_observer(steps.append)
    try:
        media = engine.tokenize_media(chat("What is in the picture?"), [picture(1)])
        assert len(media.spans) == 1 and media.image_tokens == mmproj.image_tokens()
        c = engine.submit(media.tokens, SamplingParams(max_tokens=6), media=media).result()
    finally:
        engine.remove_step_observer(steps.append)
    assert c.finish_reason == "length" and len(c.token_ids) == 6
    assert c.timings is not None and c.timings.images == 1 and c.timings.encode_ms > 0
    assert sum(s.encoded_images for s in steps) == 1
    assert sum(s.encode_ns for s in steps) > 0
    # the chunk budget (8) split the 16 image rows over two steps: one encode, both fed
    assert sum(1 for s in steps if s.prefill_tokens == 8) >= 2


def test_same_image_and_seed_give_the_same_tokens_alone_and_among_streams(
    engine: Engine,
) -> None:
    img = picture(2)
    alone = ask(engine, "Describe it.", img, max_tokens=12, **SEEDED).result()
    with engine.idle():
        engine.scheduler.clear_idle_cache()  # no cached cells: the image is fed again
    texts = [
        engine.submit(f"Stream {i} talks about boards " * 3, SamplingParams(max_tokens=400))
        for i in range(8)
    ]
    for s in texts:
        next(iter(s))  # a first token each: the image arrives while the text streams decode
    steps: list[StepStats] = []
    engine.add_step_observer(steps.append)
    try:
        busy = ask(engine, "Describe it.", img, max_tokens=12, **SEEDED).result()
    finally:
        engine.remove_step_observer(steps.append)
        for s in texts:
            s.cancel()
    for s in texts:
        assert s.result().finish_reason in ("cancelled", "length")
    # no image row came from a cache (a text stream's first tokens may be copied: the
    # copy threshold is measured at load, as low as 1 token on a loaded machine)
    media = engine.tokenize_media(chat("Describe it."), [img])
    first_row = next(i for i, t in enumerate(media.tokens) if t < 0)
    assert busy.timings is not None and busy.timings.cached_tokens < first_row
    assert busy.token_ids == alone.token_ids
    # the image was encoded and fed in steps that also decoded the other streams
    assert any(s.encoded_images and s.decode_tokens >= 8 for s in steps)


def test_a_speculating_engine_answers_an_image_without_drafts(tiny: Path, engine: Engine) -> None:
    """A prompt with images holds image rows, which neither drafter can look up or feed:
    the request does not speculate (draft_n 0), its text-only neighbours do, and its
    tokens are those of an engine without speculation."""
    params: dict[str, Any] = dict(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = list(ask(engine, "Describe it.", picture(21), **params).result().token_ids)
    spec = "speculative: {mode: draft, n_draft: 4, cost_aware: false, draft_model: %s}\n"
    profile = parse_profile(f"name: t\n{VISION}{ENGINE}{spec % tiny}")
    with Engine(engine_config(profile, tiny, read_model_info(tiny))) as e:
        image = ask(e, "Describe it.", picture(21), **params)
        text = e.submit(e.tokenize(chat("Describe a cat.", 0)), SamplingParams(**params))
        got, alone = image.result(), text.result()
    assert list(got.token_ids) == want
    assert got.timings is not None and got.timings.drafted_tokens == 0
    assert alone.timings is not None and alone.timings.drafted_tokens > 0


def test_a_different_image_changes_the_prompt_state(engine: Engine) -> None:
    """The image rows reach the model: a different picture changes the logits."""
    a = ask(engine, "Which?", picture(3), max_tokens=4, logprobs=0, temperature=0.0).result()
    b = ask(engine, "Which?", picture(4), max_tokens=4, logprobs=0, temperature=0.0).result()
    assert [e.logprob for e in a.logprobs] != [e.logprob for e in b.logprobs]


def test_a_repeated_image_with_a_new_question_reuses_its_cells(engine: Engine) -> None:
    img = picture(5)
    first = ask(engine, "What colour is it?", img, max_tokens=3).result()
    again = ask(engine, "How big is it?", img, max_tokens=3).result()
    assert first.timings is not None and again.timings is not None
    prefix = len(engine.tokenize("<|im_start|>user\n"))
    assert again.timings.cached_tokens >= prefix + mmproj.image_tokens()
    assert again.timings.encode_ms == 0.0  # its cells were reused: nothing to encode


def test_an_image_cancelled_while_it_is_encoded_frees_its_slot(engine: Engine) -> None:
    assert engine.vision is not None
    vision = engine.vision
    encode = vision.encode
    started = threading.Event()
    holder: list[Any] = []

    def cancel_then_encode(span: ImageSpan) -> Any:
        if holder and not started.is_set():
            started.set()
            holder[0].cancel()  # the client leaves while its image is being encoded
        return encode(span)

    vision.encode = cancel_then_encode  # type: ignore[method-assign]
    try:
        media = engine.tokenize_media(chat("Cancel me."), [picture(6)])
        stream = engine.submit(media.tokens, SamplingParams(max_tokens=50), media=media)
        holder.append(stream)
        assert stream.result().finish_reason == "cancelled"
    finally:
        vision.encode = encode  # type: ignore[method-assign]
    assert started.is_set()
    assert engine.runner is not None
    runner = engine.runner
    with engine.idle():
        engine.scheduler.clear_idle_cache()
    with engine.idle():
        assert engine.status().slots_busy == 0 and engine.status().kv_cells_used == 0
        assert all(runner.seq_pos_max(s) == -1 for s in range(engine.cfg.slots))
    ok = ask(engine, "And now?", picture(6), max_tokens=3).result()
    assert ok.finish_reason == "length"


def test_markers_and_images_must_pair_up(engine: Engine) -> None:
    with pytest.raises(InvalidRequest):
        engine.tokenize_media(chat("two markers", images=2), [picture(1)])
    with pytest.raises(InvalidRequest):  # the answer starts from text, never an image
        engine.tokenize_media(f"look {MEDIA_MARKER}", [picture(1)])


# -- server ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[tuple[str, ServerState]]:
    hosts = "server: {image_url_hosts: [127.0.0.1]}\n"  # the profile's limits reach the routes
    with live_server(tiny, VISION + ENGINE + hosts) as (base, state):
        yield base, state


def message(url: str, text: str = "What is this?") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": text},
            ],
        }
    ]


def post(base: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def test_the_openai_client_streams_an_answer_about_an_image(
    server: tuple[str, ServerState],
) -> None:
    from openai import OpenAI

    base, _ = server
    client = OpenAI(base_url=f"{base}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="demo",
        messages=message(png_url(7)),  # type: ignore[arg-type]
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text and usage is not None and usage.completion_tokens == 6
    assert usage.prompt_tokens > mmproj.image_tokens()
    assert wait_idle(base)["slots_busy"] == 0


def test_a_repeated_image_is_a_cache_hit_in_usage(server: tuple[str, ServerState]) -> None:
    base, _ = server
    url = png_url(8)
    first = post(base, {"messages": message(url, "Colour?"), "max_tokens": 2})
    again = post(base, {"messages": message(url, "Size?"), "max_tokens": 2})
    assert first.status_code == again.status_code == 200
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > mmproj.image_tokens()
    timings = first.json()["timings"]
    assert timings["images_n"] == 1 and timings["encode_ms"] > 0


def test_bad_images_are_400s_naming_the_part(server: tuple[str, ServerState]) -> None:
    base, state = server
    param = "messages[0].content[0].image_url"
    for url in (
        "data:image/png;base64,AAAA",  # not an image
        "data:image/png;base64,@@@",  # not base64
        "https://example.com/cat.png",  # no host is listed: never fetched
        "file:///etc/hostname",
    ):
        r = post(base, {"messages": message(url), "max_tokens": 2})
        assert r.status_code == 400, url
        assert r.json()["error"]["param"] == param
        assert r.json()["error"]["code"] == "invalid_image"
    saved, state.image_limits = state.image_limits, ImageLimits(max_pixels=100)
    try:
        r = post(base, {"messages": message(png_url(9)), "max_tokens": 2})
    finally:
        state.image_limits = saved
    assert r.status_code == 400 and "max_image_pixels" in r.json()["error"]["message"]
    r = post(base, {"messages": message(png_url(9)), "max_tokens": 2})
    assert r.status_code == 200


def test_images_side_by_side_in_one_message_are_answered(tiny: Path) -> None:
    """Image parts in a row ("compare these"), the same image twice too: their rows
    are one run of the prompt, and a 12-token chunk of 16-row images goes on from
    one image into the next; every image is encoded and fed in its place."""
    chunk = "engine: {n_ctx: 512, slots: 2, n_batch: 64, n_ubatch: 64, prefill_chunk: 12}\n"

    def ask(base: str, urls: list[str]) -> dict[str, Any]:
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        content = [*parts, {"type": "text", "text": "Compare them."}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 3}
        r = post(base, {**body, "logprobs": True, "temperature": 0.0})
        assert r.status_code == 200, r.text
        answer: dict[str, Any] = r.json()
        assert answer["usage"]["prompt_tokens"] > len(urls) * mmproj.image_tokens()
        assert answer["timings"]["images_n"] == len(urls)
        return answer

    with live_server(tiny, VISION + chunk) as (base, _):
        both = ask(base, [png_url(16), png_url(17)])
        twice = ask(base, [png_url(16)] * 2)
        ask(base, [png_url(18)] * 3)

    def logprobs(answer: dict[str, Any]) -> list[float]:
        return [t["logprob"] for t in answer["choices"][0]["logprobs"]["content"]]

    assert logprobs(both) != logprobs(twice)  # the second image's own rows were fed


def test_text_that_says_llama_cpps_default_marker_is_only_text(
    server: tuple[str, ServerState],
) -> None:
    """A question about ``<__media__>`` (mtmd's default image marker) beside an image
    is served, its text as written: the engine's marker is one no client knows."""
    assert MEDIA_MARKER != "<__media__>"
    base, _ = server
    body = {"messages": message(png_url(3), "What does <__media__> mean?"), "max_tokens": 2}
    r = post(base, body)
    assert r.status_code == 200, r.text
    alone = post(base, {"messages": message(png_url(3), "What does mean?"), "max_tokens": 2})
    assert r.json()["usage"]["prompt_tokens"] > alone.json()["usage"]["prompt_tokens"]


def test_a_model_without_a_projector_refuses_images(tiny: Path) -> None:
    with live_server(tiny, "model: {demo: {size: tiny, quant: f16}}\n") as (base, _):
        r = post(base, {"messages": message(png_url(1)), "max_tokens": 2})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "messages[0].content[0]"
        assert "mmproj" in r.json()["error"]["message"]
        text = post(base, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert text.status_code == 200


def test_a_listed_host_is_fetched_and_others_are_not(server: tuple[str, ServerState]) -> None:
    base, state = server
    body = base64.b64decode(png_url(10).split(",", 1)[1])

    class Images(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    images = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Images)
    thread = threading.Thread(target=images.serve_forever, daemon=True)
    thread.start()
    port = images.server_address[1]
    assert state.image_limits.hosts == frozenset({"127.0.0.1"})  # from the profile
    try:  # the same server under a name the profile does not list, then the listed one
        refused = post(
            base, {"messages": message(f"http://localhost:{port}/c.png"), "max_tokens": 2}
        )
        fetched = post(
            base, {"messages": message(f"http://127.0.0.1:{port}/c.png"), "max_tokens": 2}
        )
    finally:
        images.shutdown()
        images.server_close()
    assert refused.status_code == 400 and "image_url_hosts" in refused.json()["error"]["message"]
    assert fetched.status_code == 200, fetched.text
    assert fetched.json()["timings"]["images_n"] == 1


class StalledImageHost:
    """An image host that answers a GET with its headers and the first bytes of a PNG,
    then sends nothing more: ``asked`` is set once the fetch is waiting for the rest,
    ``dropped`` once the fetching side closes its connection."""

    def __init__(self) -> None:
        self.asked, self.dropped = threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", free_port()))
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(4096)
                if not chunk:
                    return
                head += chunk
            start = base64.b64decode(png_url(12).split(",", 1)[1])[:32]
            conn.sendall(
                b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n"
                + start
            )
            self.asked.set()
            with contextlib.suppress(OSError):  # a reset is a close too
                while conn.recv(4096):
                    pass
            self.dropped.set()

    def close(self) -> None:
        self.listener.close()


def client_left(state: ServerState) -> float:
    """Chat requests whose client left before the answer (499), so far."""
    labels = {"method": "POST", "route": "/v1/chat/completions", "status": "499"}
    count = state.metrics.registry.get_sample_value("orin_llm_http_requests_total", labels)
    return count or 0.0


@contextlib.contextmanager
def raw_request(base: str, body: dict[str, Any]) -> Iterator[None]:
    """A chat request sent on a socket of its own, closed (the client leaves) when
    the block ends."""
    data = json.dumps(body).encode()
    client = socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])))
    try:
        client.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        yield
    finally:
        client.close()


def test_a_client_that_leaves_stops_the_image_fetch(server: tuple[str, ServerState]) -> None:
    """The fetch of an image URL is cancelled when the client closes its connection:
    the image host sees the server's connection closed. The fetch's time limit is set
    far beyond the test's waits, so nothing but the client's leaving can end it."""
    base, state = server
    host = StalledImageHost()
    saved = state.image_limits
    state.image_limits = dataclasses.replace(saved, timeout_s=3600.0)
    before = client_left(state)
    body = {"messages": message(f"http://127.0.0.1:{host.port}/c.png"), "max_tokens": 2}
    try:
        with raw_request(base, body):  # the client leaves while the fetch waits for the rest
            assert host.asked.wait(60), "the server never fetched the image"
        assert host.dropped.wait(60), "the fetch went on after the client left"
    finally:
        state.image_limits = saved
        host.close()
    poll(lambda: client_left(state) > before, "the request counted as one whose client left")
    assert client_left(state) == before + 1
    assert wait_idle(base)["queue"] == 0


def test_a_client_that_leaves_stops_the_image_decode(
    server: tuple[str, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data: URL's decode runs on a worker thread, which the server cannot cancel:
    held there until the server has counted the client's leaving (499), the decode
    then stops rather than decode the image for nobody, and nothing is queued."""
    base, state = server
    held, release, done = threading.Event(), threading.Event(), threading.Event()
    outcome: list[object] = []
    decode = server_images.decode

    def hold_then_decode(*args: Any, **kwargs: Any) -> RGBImage:
        held.set()
        release.wait(60)
        try:
            img = decode(*args, **kwargs)
            outcome.append(img)
            return img
        except BaseException as exc:
            outcome.append(exc)
            raise
        finally:
            done.set()

    monkeypatch.setattr(server_images, "decode", hold_then_decode)
    before = client_left(state)
    try:
        with raw_request(base, {"messages": message(png_url(13)), "max_tokens": 2}):
            assert held.wait(60), "the server never decoded the image"
        poll(lambda: client_left(state) > before, "the request counted as 499")
    finally:
        release.set()
    assert done.wait(60)
    assert not isinstance(outcome[0], RGBImage), "the image was decoded for nobody"
    assert isinstance(outcome[0], server_images.DecodeStopped), outcome
    assert wait_idle(base)["queue"] == 0


def test_a_running_request_holds_no_decoded_image(
    server: tuple[str, ServerState], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decoded pixels (48 MB for a 16-megapixel image) are needed until the
    prompt is tokenized with them, not while the request waits for a slot and
    generates: by the time it is queued, nothing holds them."""
    base, state = server
    decoded: list[weakref.ref[RGBImage]] = []
    decode = server_images.decode

    def tracked(*args: Any, **kwargs: Any) -> RGBImage:
        img = decode(*args, **kwargs)
        decoded.append(weakref.ref(img))
        return img

    held: list[int] = []
    submit = state.engine.submit_async

    async def queued(*args: Any, **kwargs: Any) -> Any:
        gc.collect()
        held.append(sum(ref() is not None for ref in decoded))
        return await submit(*args, **kwargs)

    monkeypatch.setattr(server_images, "decode", tracked)
    monkeypatch.setattr(state.engine, "submit_async", queued)
    content = [*message(png_url(20))[0]["content"], *message(png_url(21))[0]["content"]]
    r = post(base, {"messages": [{"role": "user", "content": content}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert len(decoded) == 2 and held == [0]


def test_choices_of_one_image_request_share_its_encoding(server: tuple[str, ServerState]) -> None:
    base, state = server
    steps: list[StepStats] = []
    state.engine.add_step_observer(steps.append)
    try:
        r = post(base, {"messages": message(png_url(11)), "max_tokens": 3, "n": 2, "seed": 5})
    finally:
        state.engine.remove_step_observer(steps.append)
    assert r.status_code == 200, r.text
    assert sum(s.encoded_images for s in steps) == 1
    assert [len(c["message"]["content"]) > 0 for c in r.json()["choices"]] == [True, True]
