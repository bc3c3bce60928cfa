"""/slots and /dashboard/data on a real server: a running request shows in its slot with
its id and token counts, and the history records its tokens and latencies."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from orin.engine.engine import Engine
from orin.engine.types import SamplingParams
from orin.model import demo
from orin.profile.loader import parse_profile
from orin.server import dashboard
from orin.server.dashboard import History
from orin.server.main import build_server
from orin.server.state import ServerState
from orin.telemetry.service import Telemetry
from tests.fakes.boards_telemetry import agx_orin_64gb
from tests.serverutil import live_server, poll, wait_idle

pytestmark = pytest.mark.llama

PROFILE = """
engine: {n_ctx: 512, slots: 3, n_batch: 128, n_ubatch: 128}
server: {max_tokens_limit: 400}
"""


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ServerState]]:
    with live_server(demo.ensure("tiny", "f16"), PROFILE) as s:
        yield s


def test_a_running_request_shows_in_its_slot(server: tuple[str, ServerState]) -> None:
    base, _ = server
    body = {"prompt": "The board", "max_tokens": 400, "stream": True, "temperature": 0}
    with httpx.stream(
        "POST", f"{base}/v1/completions", json=body, headers={"X-Request-Id": "dash-1"}
    ) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data:"))  # generating

        def running() -> dict[str, Any] | None:
            slots = httpx.get(f"{base}/slots").json()["slots"]
            mine = [s for s in slots if s["request_id"] == "dash-1"]
            return mine[0] if mine and mine[0]["generated_tokens"] > 0 else None

        slot = poll(running, "the request in a slot")
        assert slot["is_processing"] and slot["state"] == "decode"
        assert slot["prompt_tokens"] > 0 and slot["n_ctx"] == 512
        assert slot["cells_used"] >= slot["prompt_tokens"]
    # the client left: the slot is freed, its cells kept as a prefix
    wait_idle(base)
    body_now = httpx.get(f"{base}/slots").json()
    assert body_now["queue"] == 0 and body_now["slots_total"] == 3
    assert all(not s["is_processing"] and s["request_id"] is None for s in body_now["slots"])


def test_the_history_records_tokens_and_latency(server: tuple[str, ServerState]) -> None:
    base, _ = server
    first = httpx.get(f"{base}/dashboard/data").json()
    assert first["now"]["slots_total"] == 3 and first["interval_s"] == dashboard.INTERVAL_S
    hist = first["history"]
    assert set(hist) == {"t", "temp_c", *dashboard.SERIES}
    body = {"prompt": "Orin", "max_tokens": 32, "temperature": 0}
    for _ in range(3):
        httpx.post(f"{base}/v1/completions", json=body, timeout=60).raise_for_status()

    def recorded() -> dict[str, Any] | None:
        h = httpx.get(f"{base}/dashboard/data").json()["history"]
        tokens = [v for v in h["tokens_per_s"] if v]
        ttft = [v for v in h["ttft_p50_ms"] if v is not None]
        return h if tokens and ttft else None

    h = poll(recorded, "a row with the requests' tokens and TTFT")
    assert all(len(h[k]) == len(h["t"]) for k in dashboard.SERIES)
    assert h["t"] == sorted(h["t"])
    assert any(v is not None for v in h["mem_used_bytes"])
    newest = h["t"][-1]
    assert all(
        t > newest
        for t in httpx.get(f"{base}/dashboard/data", params={"since": newest}).json()["history"][
            "t"
        ]
    )


def test_gpu_utilization_by_phase_from_a_jetson_source(tmp_path: Path) -> None:
    """The history's GPU columns fed by the real sampler and phase tracker, reading a fake
    AGX Orin's sysfs (its GPU load file says 12.3 %, its rails have power): decode rows get
    that utilization and power; nothing is zero-filled where there is no sample."""
    board = agx_orin_64gb(tmp_path)
    profile = parse_profile(f"name: test\n{PROFILE}")
    _, state = build_server(profile, demo.ensure("tiny", "f16"))
    engine = state.engine
    assert isinstance(engine, Engine)
    state.telemetry = Telemetry(engine, CollectorRegistry(), "jetson_sysfs", root=board.root)
    history = History(state, root=board.root)
    history.attach()
    engine.start()
    engine.wait_ready(60)
    state.telemetry.start()
    try:

        def decode_row() -> dict[str, Any] | None:
            engine.generate("The board", SamplingParams(max_tokens=200, ignore_eos=True))
            row = history.tick()
            return row if row["gpu_util_decode"] is not None else None

        row = poll(decode_row, "a row with decode samples")
        assert row["gpu_util_decode"] == pytest.approx(0.123)
        assert row["power_w"] is not None and row["power_w"] > 0
        assert row["tokens_per_s"] > 0
    finally:
        state.telemetry.stop()
        engine.stop(drain=False, timeout=5)
