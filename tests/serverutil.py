"""A real orin-llm server on a loopback port, in this process, for tests."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from orin.profile.loader import parse_profile
from orin.server.main import build_server
from orin.server.state import ServerState

_handed: set[int] = set()  # ports of ORIN_LLM_TEST_PORTS given out already


def free_port() -> int:
    """A loopback port nothing listens on: one the kernel picks, or with
    ORIN_LLM_TEST_PORTS=LOW-HIGH in the environment, one of that range (for a machine
    whose test runs are each given ports of their own), not one given out before while
    others are left, since a test often asks for several before it binds them."""
    low, _, high = os.environ.get("ORIN_LLM_TEST_PORTS", "").partition("-")
    if not (low and high):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    ports = random.sample(range(int(low), int(high) + 1), int(high) - int(low) + 1)
    ports.sort(key=lambda port: port in _handed)  # the ones not given out yet first
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise OSError(f"no free port in ORIN_LLM_TEST_PORTS={low}-{high}")


@contextmanager
def live_server(
    model: Path, profile_yaml: str = "", telemetry: str = "off", record: Path | None = None
) -> Iterator[tuple[str, ServerState]]:
    """build_server's server on a free port, healthy; ``telemetry`` and ``record`` as
    `serve --telemetry/--record` take them."""
    port = free_port()
    profile = parse_profile(f"name: test\n{profile_yaml}")
    profile.server.port = port
    server, state = build_server(profile, model, telemetry, record)
    state.engine.start()
    if state.telemetry is not None:
        state.telemetry.start()
    server.announce_when_ready()
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, None, 60.0)
    try:
        yield base, state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        state.engine.stop(drain=False, timeout=5)
        if state.telemetry is not None:
            state.telemetry.stop()


def wait_idle(base: str, timeout: float = 10.0) -> dict[str, int]:
    """Poll /health until no slot is busy and no cell is held by a request."""
    deadline = time.time() + timeout
    health: dict[str, int] = {}
    while time.time() < deadline:
        health = httpx.get(f"{base}/health").json()
        if health["slots_busy"] == 0 and health["kv_cells_used"] == 0 and health["queue"] == 0:
            return health
        time.sleep(0.02)
    return health


def wait_healthy(base: str, proc: subprocess.Popen[str] | None, timeout: float = 90.0) -> None:
    """Poll ``base``/health until it answers 200; the server process's stderr when it
    exits first (``proc`` started with ``stderr=PIPE``; None for a server in this
    process)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server never became healthy")


def poll(condition: Callable[[], Any], what: str, deadline_s: float = 60.0) -> Any:
    """``condition()`` once it is truthy; fails naming ``what`` after a deadline that is
    generous, so that a busy machine only makes the wait longer."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")
