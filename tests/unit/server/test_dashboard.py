"""The dashboard's history, /dashboard/data, /slots and the login, over a stand-in engine
and a fake board tree."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from orin.engine.client import EngineStatus
from orin.engine.scheduler import ContextPolicy, Scheduler
from orin.engine.types import RequestTimings, StepStats
from orin.server import auth, dashboard
from orin.server.app import create_app
from orin.server.dashboard import History, percentile
from orin.server.metrics import ServerMetrics
from orin.server.slots import slot_views, slots_body
from orin.server.state import ServerState
from orin.telemetry.phases import Share
from orin.telemetry.sources.base import Sample
from tests.fakes.board import FakeBoard, GiB
from tests.fakes.boards_system import thermal_zone


@dataclass
class _Req:
    id: str
    prompt_tokens: list[int]
    all_logits: bool = False
    held: bool = False


class FakeEngine:
    """What the dashboard asks of an engine: status, config, observers; a real
    scheduler when ``scheduler`` is given."""

    def __init__(self, scheduler: Scheduler | None = None) -> None:
        self.cfg = SimpleNamespace(
            model_path="/models/demo.gguf", n_ctx=128, slots=2, type_k="f16", type_v="f16"
        )
        self.model_info = None
        self.state = "ready"
        self.busy = 0
        self.waiting = 0
        self.step_observers: list[Callable[..., None]] = []
        self.finish_observers: list[Callable[..., None]] = []
        if scheduler is not None:
            self.scheduler = scheduler

    def status(self) -> EngineStatus:
        return EngineStatus("ready", None, 2, self.busy, self.waiting, 7, 3, 256, None, 0)

    def add_step_observer(self, fn: Callable[..., None]) -> None:
        self.step_observers.append(fn)

    def remove_step_observer(self, fn: Callable[..., None]) -> None:
        self.step_observers.remove(fn)

    def add_finish_observer(self, fn: Callable[..., None]) -> None:
        self.finish_observers.append(fn)

    def remove_finish_observer(self, fn: Callable[..., None]) -> None:
        self.finish_observers.remove(fn)


class Clock:
    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t


def _state(engine: FakeEngine, api_key: str | None = None) -> ServerState:
    return ServerState(
        engine=engine,  # type: ignore[arg-type]
        model_name="demo",
        metrics=ServerMetrics(2, 256, "demo"),
        api_key=api_key,
    )


def _timings(ttft: float, tpot: float | None, generated: int = 8) -> RequestTimings:
    return RequestTimings(
        queue_ms=0.0,
        prefill_ms=ttft,
        ttft_ms=ttft,
        tpot_ms=tpot,
        e2e_ms=ttft + (tpot or 0.0) * generated,
        itl_ms=(),
        prompt_tokens=4,
        cached_tokens=0,
        generated_tokens=generated,
        context_shifts=0,
    )


def _step(prefill: int = 0, decode: int = 0, drafted: int = 0, accepted: int = 0) -> StepStats:
    return StepStats(
        0, 1, prefill, decode, 1, 0, 0, drafted_tokens=drafted, accepted_tokens=accepted
    )


@pytest.fixture
def board(tmp_path: Path) -> FakeBoard:
    return FakeBoard(tmp_path).meminfo(total=64 * GiB, available=48 * GiB)


def _history(board: FakeBoard, clock: Clock, engine: FakeEngine | None = None) -> History:
    h = History(_state(engine or FakeEngine()), root=board.root, seconds=10, clock=clock)
    h.attach()
    return h


def test_percentile_is_the_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 95) == 3.0
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 95) == 95.0
    assert percentile([10.0, 1.0, 5.0], 50) == 5.0


def test_a_row_has_the_rates_of_its_second_and_the_latencies_of_the_last_minute(
    board: FakeBoard,
) -> None:
    clock = Clock()
    engine = FakeEngine()
    h = _history(board, clock, engine)
    h.tick()
    clock.t += 2.0
    for fn in engine.step_observers:
        fn(_step(prefill=30))
        fn(_step(decode=4))
        fn(_step(decode=6, drafted=4, accepted=3))  # 2 rows + 4 drafts: 2 + 3 generated
    for fn in engine.finish_observers:
        fn("a", "stop", _timings(100.0, 10.0))
        fn("b", "length", _timings(300.0, 20.0))
        fn("c", "cancelled", _timings(50.0, None, generated=0))
    engine.busy, engine.waiting = 1, 2
    row = h.tick()
    assert row["tokens_per_s"] == pytest.approx((4 + 5) / 2.0)
    assert row["prompt_tokens_per_s"] == pytest.approx(15.0)
    assert row["requests_per_s"] == pytest.approx(1.5)
    # a request without a token has no TTFT; nearest-rank over [100, 300]
    assert (row["ttft_p50_ms"], row["ttft_p95_ms"]) == (100.0, 300.0)
    assert (row["tpot_p50_ms"], row["tpot_p95_ms"]) == (10.0, 20.0)
    assert (row["slots_busy"], row["queue"], row["kv_cells_used"], row["kv_cells_cached"]) == (
        1,
        2,
        7,
        3,
    )
    assert row["mem_used_bytes"] == 16 * GiB
    # the next second: no tokens, the same requests still inside the latency window
    clock.t += 1.0
    row = h.tick()
    assert row["tokens_per_s"] == 0.0 and row["ttft_p95_ms"] == 300.0
    clock.t += dashboard.LATENCY_WINDOW_S + 1
    assert h.tick()["ttft_p50_ms"] is None


def test_gpu_utilization_is_split_by_phase(board: FakeBoard) -> None:
    h = _history(board, Clock())
    sample = Sample(t_ns=1, gpu_util=0.8, power_mw={"VDD_GPU_SOC": 3000.0, "VDD_CPU_CV": 1500.0})
    h.on_sample(sample, (Share("prefill", 1.0),), 0.02)
    h.on_sample(Sample(t_ns=2, gpu_util=0.4), (Share("decode", 1.0),), 0.02)
    mixed = (Share("prefill", 0.25, True), Share("decode", 0.75, True))
    h.on_sample(Sample(t_ns=3, gpu_util=0.6), mixed, 0.02)
    row = h.tick()
    assert row["gpu_util_prefill"] == pytest.approx((0.8 + 0.6 * 0.25) / 1.25, abs=1e-4)
    assert row["gpu_util_decode"] == pytest.approx((0.4 + 0.6 * 0.75) / 1.75, abs=1e-4)
    assert row["gpu_util"] == pytest.approx(0.6, abs=1e-4)
    assert row["power_w"] is None  # the latest sample has no rails
    h.on_sample(sample, (Share("idle", 1.0),), 1.0)
    row = h.tick()
    assert row["power_w"] == 4.5
    nx = {"VDD_IN": 6000.0, "VDD_CPU_GPU_CV": 1000.0, "VDD_SOC": 1500.0}  # VDD_IN feeds both
    h.on_sample(Sample(t_ns=4, power_mw=nx), (Share("idle", 1.0),), 1.0)
    assert h.tick()["power_w"] == 6.0
    assert row["gpu_util_prefill"] is None and row["gpu_util_decode"] is None
    assert row["gpu_util"] == 0.8


def test_what_the_board_does_not_report_is_absent_not_zero(tmp_path: Path) -> None:
    """No meminfo, no thermal zones, no telemetry: None and an empty mapping."""
    h = History(_state(FakeEngine()), root=FakeBoard(tmp_path).root, clock=Clock())
    row = h.tick()
    for key in ("gpu_util_prefill", "gpu_util_decode", "power_w", "mem_used_bytes"):
        assert row[key] is None
    assert row["temp_c"] == {}
    assert h.columns()["temp_c"] == {}


def test_temperatures_per_zone_without_the_sensors_that_are_off(board: FakeBoard) -> None:
    thermal_zone(board, 0, "cpu-thermal", 47.5, [("passive", 99.0)])
    thermal_zone(board, 1, "gpu-thermal", 45.25, [])
    thermal_zone(board, 2, "cv0-thermal", -256.0, [])
    clock = Clock()
    h = _history(board, clock)
    assert h.tick()["temp_c"] == {"cpu-thermal": 47.5, "gpu-thermal": 45.25}
    board.write("/sys/class/thermal/thermal_zone1/temp", "garbage\n")
    clock.t += 1.0
    h.tick()
    assert h.columns()["temp_c"] == {"cpu-thermal": [47.5, 47.5], "gpu-thermal": [45.25, None]}


def test_columns_after_since_and_the_ring_bound(board: FakeBoard) -> None:
    clock = Clock()
    h = _history(board, clock)  # 10 rows kept
    times = []
    for _ in range(12):
        times.append(h.tick()["t"])
        clock.t += 1.0
    cols = h.columns()
    assert cols["t"] == times[2:]
    assert all(len(cols[k]) == 10 for k in dashboard.SERIES)
    assert h.columns(since=times[9])["t"] == times[10:]
    assert h.columns(since=times[-1])["t"] == []


def test_slot_views_read_the_scheduler() -> None:
    s = Scheduler(2, 64, ContextPolicy(window=128))
    s.add(_Req("req-1", list(range(10))))
    s.schedule()
    views = slot_views(FakeEngine(s))  # type: ignore[arg-type]
    busy = [v for v in views if v.is_processing]
    idle = [v for v in views if not v.is_processing]
    assert len(views) == 2 and len(busy) == 1 and len(idle) == 1
    assert busy[0].request_id == "req-1" and busy[0].prompt_tokens == 10
    assert busy[0].state == "prefill" and busy[0].n_ctx == 128
    assert idle[0].state == "idle" and idle[0].request_id is None
    assert idle[0].prompt_tokens == 0 and idle[0].generated_tokens == 0


def test_an_engine_without_a_scheduler_has_totals_only() -> None:
    body = slots_body(FakeEngine())  # type: ignore[arg-type]
    assert body["slots"] == []
    assert (body["slots_total"], body["queue"], body["n_ctx"]) == (2, 0, 128)


# -- routes -------------------------------------------------------------------------


@pytest.fixture
def keyed() -> Iterator[TestClient]:
    with TestClient(create_app(_state(FakeEngine(), api_key="sesame"))) as c:
        yield c


def test_data_and_slots_shapes() -> None:
    with TestClient(create_app(_state(FakeEngine(Scheduler(2, 64, ContextPolicy(128)))))) as c:
        d = c.get("/dashboard/data").json()
        assert d["model"] == "demo" and d["state"] == "ready"
        assert d["now"]["slots_total"] == 2 and len(d["now"]["slots"]) == 2
        hist = d["history"]
        assert len(hist["t"]) >= 1  # the lifespan's first tick
        assert d["started"] <= hist["t"][0]  # this process's start: a page sees a restart
        assert set(dashboard.SERIES) <= set(hist)
        assert all(len(hist[k]) == len(hist["t"]) for k in dashboard.SERIES)
        later = c.get("/dashboard/data", params={"since": hist["t"][-1]}).json()
        assert later["history"]["t"] == [t for t in later["history"]["t"] if t > hist["t"][-1]]
        slots = c.get("/slots").json()
        assert [s["id"] for s in slots["slots"]] == [0, 1]
        assert set(slots["slots"][0]) == {
            "id",
            "state",
            "is_processing",
            "request_id",
            "n_ctx",
            "cells_used",
            "prompt_tokens",
            "cached_prompt_tokens",
            "generated_tokens",
        }
        assert slots["queue"] == 0
        page = c.get("/")
        assert page.status_code == 200 and 'id="charts"' in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert c.get("/dashboard/assets/vendor/uplot/uPlot.iife.min.js").status_code == 200
        assert c.get("/login", follow_redirects=False).status_code == 303  # no key: nothing to do


def test_with_a_key_the_page_is_a_login_form_and_the_views_need_the_key(
    keyed: TestClient,
) -> None:
    page = keyed.get("/")
    assert page.status_code == 200 and 'id="login-form"' in page.text
    assert "demo" not in page.text  # nothing of the server's before the key
    assert keyed.get("/dashboard/assets/dashboard.css").status_code == 200
    for path in ("/dashboard/data", "/slots"):
        assert keyed.get(path).status_code == 401
        assert keyed.get(path, headers={"Authorization": "Bearer sesame"}).status_code == 200


def test_login_refuses_a_wrong_key_and_sets_the_cookie_for_the_right_one(
    keyed: TestClient,
) -> None:
    wrong = keyed.post("/login", data={"key": "open"}, follow_redirects=False)
    assert wrong.status_code == 401 and 'id="login-error"' in wrong.text
    assert auth.COOKIE not in wrong.cookies
    right = keyed.post("/login", data={"key": "sesame"}, follow_redirects=False)
    assert right.status_code == 303 and right.headers["location"] == "/"
    cookie = right.headers["set-cookie"]
    assert cookie.startswith(f"{auth.COOKIE}=sesame;")
    for flag in ("HttpOnly", "SameSite=strict", "Path=/"):
        assert flag.lower() in cookie.lower()
    keyed.cookies.set(auth.COOKIE, "sesame")
    assert 'id="charts"' in keyed.get("/").text
    assert keyed.get("/dashboard/data").status_code == 200
    too_big = keyed.post("/login", content=b"key=" + b"x" * 10_000, follow_redirects=False)
    assert too_big.status_code == 401
    out = keyed.post("/logout", follow_redirects=False)
    assert out.status_code == 303 and f'{auth.COOKIE}=""' in out.headers["set-cookie"]
    assert "max-age=0" in out.headers["set-cookie"].lower()


def test_login_limits_wrong_keys_per_address_and_never_a_right_key_in_time() -> None:
    """Five wrong keys, then 429 with Retry-After before any key is compared (a right
    one too: a guess must tell nothing); a token back each second; other addresses,
    the API and the key's own bearer are never held back."""
    clock = Clock()
    state = _state(FakeEngine(), api_key="sesame")
    state.login_limiter = auth.LoginLimiter(burst=5, per_s=1.0, clock=clock)
    app = create_app(state)
    guesser = TestClient(app, client=("192.0.2.7", 40000))
    other = TestClient(app, client=("192.0.2.8", 40000))

    def login(c: TestClient, key: str) -> int:
        return c.post("/login", data={"key": key}, follow_redirects=False).status_code

    assert [login(guesser, f"guess{i}") for i in range(5)] == [401] * 5
    refused = guesser.post("/login", data={"key": "sesame"}, follow_redirects=False)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert 'id="login-error"' in refused.text and auth.COOKIE not in refused.cookies
    assert login(other, "sesame") == 303  # another address logs in at once
    assert guesser.get("/slots", headers={"Authorization": "Bearer sesame"}).status_code == 200
    clock.t += 1  # one more try a second
    assert login(guesser, "guess5") == 401 and login(guesser, "guess6") == 429
    clock.t += 1
    assert login(guesser, "sesame") == 303  # a right key is never counted
    assert login(guesser, "guess7") == 401 and login(guesser, "guess8") == 429


def test_login_limiter_forgets_the_oldest_address_beyond_its_table() -> None:
    clock = Clock()
    limiter = auth.LoginLimiter(burst=1, per_s=0.5, size=3, clock=clock)
    for address in ("a", "b", "c", "d"):
        limiter.failed(address)
    assert len(limiter._buckets) == 3
    assert limiter.retry_after("a") == 0  # forgotten: memory stays bounded
    assert limiter.retry_after("d") == 2  # half a token a second
    clock.t += 2
    assert limiter.retry_after("d") == 0


@pytest.mark.parametrize("cookie", ["sesame", "the-key-before-it-changed", None])
def test_logout_always_deletes_the_cookie_and_goes_back_to_the_login(
    keyed: TestClient, cookie: str | None
) -> None:
    if cookie is not None:
        keyed.cookies.set(auth.COOKIE, cookie)
    out = keyed.post("/logout", follow_redirects=False)
    assert out.status_code == 303 and out.headers["location"] == "/"
    assert f'{auth.COOKIE}=""' in out.headers["set-cookie"]
    assert "max-age=0" in out.headers["set-cookie"].lower()


def test_dashboard_off_leaves_slots_only() -> None:
    state = _state(FakeEngine())
    # server.dashboard: false, as the composition root passes it on
    state.dashboard = False
    with TestClient(create_app(state)) as c:
        assert c.get("/").status_code == 404
        assert c.get("/dashboard/data").status_code == 404
        assert c.get("/dashboard/assets/dashboard.js").status_code == 404
        assert c.get("/slots").status_code == 200
