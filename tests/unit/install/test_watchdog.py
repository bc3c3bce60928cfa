"""A server whose engine loop is stalled stops sending WATCHDOG=1 (so systemd restarts it).

The server is the one ``orin-llm serve`` builds (``build_server``: real
llama.cpp on the tiny generated model, the real OrinServer and its Watchdog)
under a fake systemd: NOTIFY_SOCKET names a datagram socket this test reads,
WATCHDOG_USEC is 1 s (pings every 0.5 s, withheld once the engine heartbeat
is over 1 s old). The engine loop is stalled the way a hung llama_decode
would stall it: a step observer, which runs on the engine thread inside a
step, blocks until the test lets it go. Only the engine thread stops; the
watchdog thread and the interpreter stay alive, which is exactly the case a
ping from a plain timer would wrongly keep alive.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orin.engine.types import SamplingParams, StepStats
from orin.profile.loader import parse_profile
from orin.server.main import build_server

WATCHDOG_USEC = 1_000_000  # the engine's idle heartbeat period is 0.5 s


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    path = f"/tmp/orin-wd-{time.monotonic_ns()}.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        yield sock, path
    finally:
        sock.close()
        Path(path).unlink(missing_ok=True)


def datagrams(sock: socket.socket, seconds: float) -> list[bytes]:
    """Everything systemd would have received in the next ``seconds``."""
    got, deadline = [], time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            got.append(sock.recv(4096))
        except TimeoutError:
            break
    return got


def wait_for(sock: socket.socket, message: bytes, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if sock.recv(4096).startswith(message):
                return True
        except TimeoutError:
            return False
    return False


@pytest.mark.llama
def test_stalled_engine_loop_stops_the_watchdog_pings(
    tiny_f16: Path, notify_socket: tuple[socket.socket, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    sock, path = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("WATCHDOG_USEC", str(WATCHDOG_USEC))
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    server, state = build_server(
        parse_profile("name: wd\nengine: {n_ctx: 256, slots: 1}"), tiny_f16
    )
    stall, stalled = threading.Event(), threading.Event()

    def hang_inside_a_step(stats: StepStats) -> None:
        if not stall.is_set():
            stalled.set()
            stall.wait(30)

    state.engine.start()
    server.announce_when_ready()
    try:
        assert wait_for(sock, b"READY=1", 30), "the server never became ready"
        healthy = datagrams(sock, 1.2)
        assert healthy.count(b"WATCHDOG=1") >= 2  # an idle engine keeps the pings coming

        state.engine.add_step_observer(hang_inside_a_step)
        state.engine.submit("hello", SamplingParams(max_tokens=4))
        assert stalled.wait(10), "the engine never ran a step"
        datagrams(sock, 1.6)  # pings sent before the heartbeat went stale
        assert datagrams(sock, 1.5) == []  # stalled: no WATCHDOG=1 for three ping intervals

        stall.set()  # the engine loop moves again: pings resume
        assert wait_for(sock, b"WATCHDOG=1", 3)
    finally:
        stall.set()
        server.watchdog.stop()
        state.engine.stop(drain=False, timeout=5)
