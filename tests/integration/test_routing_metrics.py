"""A router's view of a loaded server: more streams than slots, /metrics polled while they run.

The requests are held deterministically: sliding context, ignore_eos, a
max_tokens no test machine reaches and a client that reads every stream keep
each admitted stream generating until its client leaves, so the queue stays
full while /metrics is polled, with a generous deadline and no timing.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orin.server.state import ServerState
from tests.serverutil import live_server, wait_idle

pytestmark = pytest.mark.llama

SLOTS = 2
STREAMS = 5  # three of them wait for a slot
HOLD_TOKENS = 1_000_000

# The profile names the queue itself; running and KV usage keep the vLLM style's names.
PROFILE = f"""
engine: {{n_ctx: 256, slots: {SLOTS}, n_batch: 64, n_ubatch: 64}}
context: {{keep: 4}}
server:
  max_tokens_limit: {HOLD_TOKENS}
  routing_metrics: {{style: vllm, queue: "fleet:queue_depth"}}
"""
QUEUE, RUNNING, KV = "fleet:queue_depth", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"
DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def server(tiny_f16: Path) -> Iterator[tuple[str, ServerState]]:
    with live_server(tiny_f16, PROFILE) as s:
        yield s


def scrape(base: str) -> dict[str, float]:
    """Every unlabelled-or-labelled sample by name (one series per name here)."""
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def poll(base: str, seen: list[dict[str, float]], done: Callable[[dict[str, float]], bool]) -> bool:
    """Scrape until ``done`` holds (True) or the deadline passes (False); every scrape is kept."""
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        samples = scrape(base)
        seen.append(samples)
        if done(samples):
            return True
        time.sleep(0.02)
    return False


def drain(s: socket.socket) -> None:
    """Read a stream until its socket is shut: an unread stream would be cut off by the
    server once server.max_stream_backlog tokens pile up, ending the hold early."""
    try:
        while s.recv(65536):
            pass
    except OSError:
        pass


def open_stream(port: int, i: int) -> socket.socket:
    """A streamed completion the server generates until this socket closes."""
    body = json.dumps(
        {
            "prompt": f"request {i} holds its slot",
            "max_tokens": HOLD_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


def test_a_router_sees_the_queue_and_the_kv_cache_fill_and_drain(
    server: tuple[str, ServerState],
) -> None:
    base = server[0]
    port = int(base.rsplit(":", 1)[1])
    idle = scrape(base)
    assert (idle[QUEUE], idle[RUNNING], idle[KV]) == (0, 0, 0)
    assert "vllm:num_requests_waiting" not in idle  # the profile's name replaced it

    seen: list[dict[str, float]] = []
    sockets = [open_stream(port, i) for i in range(STREAMS)]
    readers = [threading.Thread(target=drain, args=(s,), daemon=True) for s in sockets]
    for r in readers:
        r.start()
    try:
        loaded = poll(
            base,
            seen,
            lambda m: m[QUEUE] == STREAMS - SLOTS and m[RUNNING] == SLOTS and m[KV] > 0,
        )
        assert loaded, f"never saw the pool loaded; last scrape {seen[-1]}"
        # held streams keep the queue and the slots as they are: a later scrape agrees with
        # orin-llm's own gauges (the KV cells move with every token; both stay in (0, 1])
        again = scrape(base)
        seen.append(again)
        assert again[QUEUE] == again["orin_llm_requests_waiting"] == STREAMS - SLOTS
        assert again[RUNNING] == again["orin_llm_requests_running"] == SLOTS
        assert 0 < again[KV] <= 1 and 0 < again["orin_llm_kv_cache_usage_ratio"] <= 1
    finally:
        for s in sockets:
            s.shutdown(socket.SHUT_RDWR)
            s.close()
        for r in readers:
            r.join(timeout=DEADLINE_S)

    drained = poll(base, seen, lambda m: m[QUEUE] == 0 and m[RUNNING] == 0 and m[KV] == 0)
    assert drained, f"the load never went back to 0; last scrape {seen[-1]}"
    assert all(0 <= m[KV] <= 1 for m in seen)
    # a request may wait while a slot prefills a prefix it shares, so only the sum is bounded
    assert all(m[QUEUE] + m[RUNNING] <= STREAMS and m[RUNNING] <= SLOTS for m in seen)
    health = wait_idle(base)
    assert health["slots_busy"] == 0 and health["queue"] == 0


def test_the_cache_size_is_stated_in_blocks(server: tuple[str, ServerState]) -> None:
    text = httpx.get(f"{server[0]}/metrics").text
    (info,) = [
        s for f in text_string_to_metric_families(text) for s in f.samples
        if s.name == "vllm:cache_config_info"
    ]  # fmt: skip
    total = server[1].engine.status().kv_cells_total
    assert info.labels == {"block_size": "16", "num_gpu_blocks": str(total // 16)}
