"""Soak, overload, slow clients and kill -9, against a real `orin-llm serve` process."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest

from orin.model import demo
from orin.telemetry.record import read_recording
from tests.serverutil import free_port

pytestmark = pytest.mark.reliability


class Server:
    def __init__(self, tmp: Path, profile: str, *extra: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.profile = tmp / "p.yaml"
        self.profile.write_text(profile)
        self.log = tmp / "server.log"
        self.args = [sys.executable, "-m", "orin", "serve", "--profile", str(self.profile),
                     "--port", str(self.port), *extra]  # fmt: skip
        self.proc = self.start()

    def start(self) -> subprocess.Popen[bytes]:
        with self.log.open("ab") as log:
            proc = subprocess.Popen(self.args, stdout=log, stderr=log)
        deadline = time.time() + 120
        while time.time() < deadline:
            assert proc.poll() is None, self.log.read_text()
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError("server never became healthy")

    def health(self) -> dict[str, int]:
        return dict(httpx.get(f"{self.base}/health", timeout=10).json())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)


def tiny_profile(slots: int = 8, queue: int = 64, backlog: int = 4096) -> str:
    return (
        "name: soak\nmodel: {demo: {size: tiny, quant: f16}}\n"
        f"engine: {{n_ctx: 512, slots: {slots}, n_batch: 128, n_ubatch: 128}}\n"
        f"server: {{max_queue: {queue}, max_stream_backlog: {backlog}, grace_seconds: 30,\n"
        "          max_tokens_limit: 100000}\n"
    )


@pytest.fixture
def tiny() -> Path:
    return demo.ensure("tiny", "f16")


async def one(client: httpx.AsyncClient, base: str, rng: random.Random) -> tuple[int, bool]:
    body = {"prompt": "soak " * rng.randrange(1, 40), "max_tokens": rng.randrange(8, 64),
            "stream": True, "temperature": 0.7, "seed": rng.randrange(1000)}  # fmt: skip
    leave_after = rng.randrange(1, 20) if rng.random() < 0.3 else None
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        status, n = r.status_code, 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                n += 1
                if leave_after is not None and n >= leave_after:
                    return status, True  # closing the response drops the connection
    return status, False


def test_soak_1000_streams_with_30_percent_leaving(tmp_path: Path, tiny: Path) -> None:
    server = Server(tmp_path, tiny_profile())
    rss: dict[int, int] = {}
    statuses: Counter[int] = Counter()
    proc = psutil.Process(server.proc.pid)

    async def run() -> None:
        rng = random.Random(42)
        sem = asyncio.Semaphore(8)
        done = 0
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:

            async def task() -> None:
                nonlocal done
                async with sem:
                    status, _left = await one(client, server.base, rng)
                statuses[status] += 1
                done += 1
                if done in (100, 1000):
                    rss[done] = proc.memory_info().rss

            await asyncio.gather(*(task() for _ in range(1000)))

    try:
        asyncio.run(run())
        deadline = time.time() + 30
        while time.time() < deadline:
            h = server.health()
            if h["slots_busy"] == 0 and h["kv_cells_used"] == 0:
                break
            time.sleep(0.1)
        metrics = httpx.get(f"{server.base}/metrics").text
    finally:
        server.stop()
    assert sum(statuses.values()) == 1000
    assert not [s for s in statuses if s >= 500], statuses
    assert h["slots_busy"] == 0 and h["kv_cells_used"] == 0 and h["queue"] == 0
    growth = (rss[1000] - rss[100]) / rss[100]
    assert growth < 0.05, f"RSS grew {growth:.1%} between the 100th and the 1000th request"
    cancelled = next(
        float(x.split()[-1]) for x in metrics.splitlines()
        if x.startswith('orin_llm_requests_total{finish_reason="cancelled"}')
    )  # fmt: skip
    assert cancelled > 100  # the clients that left were cancelled, not run to the end
    (tmp_path / "soak.json").write_text(json.dumps({"rss": rss, "statuses": statuses}))


def test_burst_of_ten_times_the_queue(tmp_path: Path, tiny: Path) -> None:
    server = Server(tmp_path, tiny_profile(slots=2, queue=4))

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {"prompt": "burst", "max_tokens": 64, "ignore_eos": True}
            return list(await asyncio.gather(
                *(client.post(f"{server.base}/v1/completions", json=body) for _ in range(40))
            ))  # fmt: skip

    try:
        responses = asyncio.run(burst())
    finally:
        server.stop()
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code in (429, 503)]
    assert len(ok) + len(refused) == 40
    assert ok and refused
    assert all(r.headers.get("retry-after") for r in refused)
    assert all(r.json()["usage"]["completion_tokens"] == 64 for r in ok)


def test_a_slow_reader_is_cut_off_and_does_not_stall_others(tmp_path: Path, tiny: Path) -> None:
    server = Server(tmp_path, tiny_profile(slots=2, backlog=64))
    # big events (top log-probabilities) fill the kernel's socket buffers within seconds;
    # after that the server holds the unread tokens itself, up to the bound
    body = json.dumps(
        {"prompt": "slow", "max_tokens": 100000, "stream": True, "logprobs": 20}
    ).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window fills fast
    try:
        slow.connect(("127.0.0.1", server.port))
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        slow.recv(256)  # the stream has started; now read nothing
        t0 = time.time()
        fast = httpx.post(f"{server.base}/v1/completions",
                          json={"prompt": "fast", "max_tokens": 32}, timeout=60)  # fmt: skip
        assert fast.status_code == 200 and time.time() - t0 < 60
        # about 3 MB (the socket buffers) go out before the server holds tokens itself
        deadline = time.time() + 240
        while "has not read" not in server.log.read_text() and time.time() < deadline:
            time.sleep(0.2)
        assert "has not read" in server.log.read_text()
        assert server.health()["slots_busy"] == 0
    finally:
        slow.close()
        server.stop()


def test_kill_9_then_restart_comes_back_healthy(tmp_path: Path, tiny: Path) -> None:
    record = tmp_path / "run.jsonl"
    server = Server(tmp_path, tiny_profile(), "--telemetry", "cpu", "--record", str(record))
    for _ in range(5):
        httpx.post(
            f"{server.base}/v1/completions", json={"prompt": "x", "max_tokens": 8}, timeout=60
        )
    os.kill(server.proc.pid, signal.SIGKILL)  # what systemd's watchdog or the OOM killer does
    server.proc.wait(timeout=30)
    before = read_recording(record)
    assert before["meta"] and before["request"]  # readable up to the kill (a torn line is skipped)
    server.proc = server.start()  # Restart=on-failure
    try:
        assert server.health()["status"] == "ok"
        r = httpx.post(f"{server.base}/v1/completions", json={"prompt": "again", "max_tokens": 4})
        assert r.status_code == 200
        assert demo.ensure("tiny", "f16") == tiny and tiny.stat().st_size > 0
    finally:
        server.stop()
    after = read_recording(record)
    assert after["meta"] and after["request"]  # the restarted server wrote a fresh recording
