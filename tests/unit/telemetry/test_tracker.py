"""Phase attribution while serving, at the sampler's two rates, and the busy signal
the service gives the sampler."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from orin.engine.client import EngineStatus
from orin.engine.types import StepStats
from orin.telemetry.phases import Share, summarize
from orin.telemetry.sampler import Sampler
from orin.telemetry.service import Telemetry, engine_busy, running_step_start
from orin.telemetry.sources.base import Sample
from orin.telemetry.tracker import PhaseTracker
from tests.fakes.boards_telemetry import agx_orin_64gb
from tests.unit.telemetry.test_sampler import Counting

S = 1_000_000_000  # ns


def step(start_s: float, end_s: float, prefill: int = 0, decode: int = 1) -> StepStats:
    return StepStats(round(start_s * S), round(end_s * S), prefill, decode, 1, 10, 0)


def test_a_sample_stands_for_the_gap_before_it_capped_at_the_period_inside_steps() -> None:
    sampler = Sampler(Counting(), 50, busy=lambda: False)  # 50 Hz busy, 1 Hz idle
    running: list[int | None] = [None]
    tracker = PhaseTracker(sampler, lambda: running[0])
    seen: list[tuple[float, str, float]] = []

    def observe(sample: Any, shares: tuple[Share, ...], dt: float) -> None:
        seen.append((sample.t_ns / S, shares[0].phase, round(dt, 6)))

    tracker.observers.append(observe)
    tracker.on_step(step(3.5, 3.52, prefill=64, decode=0))
    tracker.on_step(step(3.52, 3.54))
    for t in (0.0, 1.0, 2.0, 3.0, 3.51, 3.53, 3.55, 3.57, 4.57):
        tracker.on_sample(Sample(t_ns=round(t * S)))
    assert seen == [
        (0.0, "idle", 0.02),  # the first: one full-rate period
        (1.0, "idle", 1.0),  # idle reads stand for the second before them
        (2.0, "idle", 1.0),
        (3.0, "idle", 1.0),
        (3.51, "prefill", 0.02),  # after 0.51 s unresolved: only its own period
        (3.53, "decode", 0.02),
        (3.55, "idle", 0.02),  # lingering at the full rate after the work
        (3.57, "idle", 0.02),
        (4.57, "idle", 1.0),
    ]


def test_without_a_busy_signal_every_sample_is_one_period() -> None:
    sampler = Sampler(Counting(), 50)
    tracker = PhaseTracker(sampler, lambda: None)
    dts: list[float] = []
    tracker.observers.append(lambda sample, shares, dt: dts.append(dt))
    for t in (0.0, 0.02, 0.5):  # a late tick (the machine was busy) is not stretched
        tracker.on_sample(Sample(t_ns=round(t * S)))
    assert dts == pytest.approx([0.02, 0.02, 0.02])


class FakeEngine:
    """What the telemetry service asks of an EngineClient: its status, its config and
    observer registration."""

    def __init__(self) -> None:
        self.cfg = SimpleNamespace(slots=2, model_path=Path("m.gguf"))
        self.step_started_ns: int | None = None
        self.waiting = 0
        self.slots_busy = 0
        self.step_observers: list[Any] = []
        self.finish_observers: list[Any] = []

    def status(self) -> EngineStatus:
        return EngineStatus(
            state="ready",
            error=None,
            slots_total=self.cfg.slots,
            slots_busy=self.slots_busy,
            waiting=self.waiting,
            kv_cells_used=0,
            kv_cells_cached=0,
            kv_cells_total=512,
            step_started_ns=self.step_started_ns,
            heartbeat_ns=0,
        )

    def add_step_observer(self, fn: Any) -> None:
        self.step_observers.append(fn)

    def add_finish_observer(self, fn: Any) -> None:
        self.finish_observers.append(fn)


def test_the_engine_is_busy_while_a_step_runs_a_slot_works_or_a_request_waits() -> None:
    engine = FakeEngine()
    busy = engine_busy(engine)  # type: ignore[arg-type]
    assert not busy()
    for field, value in (("step_started_ns", 5), ("waiting", 1), ("slots_busy", 2)):
        setattr(engine, field, value)
        assert busy(), field
        setattr(engine, field, 0 if field != "step_started_ns" else None)
    assert not busy()


def test_the_tracker_waits_for_the_step_the_engine_reports_running() -> None:
    engine = FakeEngine()
    start = running_step_start(engine)  # type: ignore[arg-type]
    assert start() is None
    engine.step_started_ns = 7
    assert start() == 7


def test_the_service_samples_the_board_at_the_idle_rate_while_the_engine_waits(
    tmp_path: Path,
) -> None:
    board = agx_orin_64gb(tmp_path, 6)
    engine = FakeEngine()
    telemetry = Telemetry(
        engine,  # type: ignore[arg-type]
        CollectorRegistry(),
        "jetson_sysfs",
        root=board.root,
    )
    sampler = telemetry.sampler
    assert sampler.busy is not None and (sampler.hz, sampler.idle_hz) == (50.0, 1.0)
    assert not sampler.busy()
    engine.slots_busy = 1
    assert sampler.busy()
    snapshot = telemetry.snapshot()
    assert snapshot["idle_hz"] == 1.0
    assert (snapshot["slots_busy"], snapshot["slots_total"], snapshot["waiting"]) == (1, 2, 0)
    assert telemetry.tracker.on_step in engine.step_observers
    assert engine.finish_observers  # the recent-requests list
    sampler.source.close()


def on_a_board(tmp_path: Path) -> Telemetry:
    """The server's telemetry on a fake AGX Orin 64GB, its engine faked."""
    board = agx_orin_64gb(tmp_path, 6)
    return Telemetry(
        FakeEngine(),  # type: ignore[arg-type]
        CollectorRegistry(),
        "jetson_sysfs",
        root=board.root,
    )


def test_the_snapshot_counts_the_tokens_of_the_window_only(tmp_path: Path) -> None:
    telemetry = on_a_board(tmp_path)
    tracker = telemetry.tracker
    tracker.on_step(step(1.0, 1.1, prefill=500, decode=0))  # long before the window
    tracker.on_step(step(1.1, 1.2, decode=3))
    tracker.on_step(step(20.0, 20.1, prefill=40, decode=0))  # inside it
    tracker.on_step(step(20.1, 20.2, decode=2))
    times = iter([1.05, 1.15, *(10.0 + 0.5 * i for i in range(22)), 20.05, 20.15])
    telemetry.sampler.source.close()
    telemetry.sampler = Sampler(Counting(), 50, clock_ns=lambda: round(next(times) * S))
    for _ in range(26):
        telemetry.sampler.capture_once()
    phases = telemetry.snapshot()["phases"]
    assert telemetry.snapshot()["window_s"] == 10.0
    assert phases["prefill"]["tokens"] == 40
    assert phases["decode"]["tokens"] == 2


def test_a_recording_with_idle_rate_gaps_gives_each_phase_its_own_time() -> None:
    """Offline (``summarize``, what ``monitor --recording`` shows): the first sample of a
    request follows a second-long idle gap; it must not bring half of it into prefill."""
    steps = [step(2.5, 2.7, prefill=512, decode=0), step(2.7, 2.9)]
    busy = [2.5 + 0.02 * i + 0.01 for i in range(20)]  # 50 Hz from the first step
    linger = [2.91 + 0.02 * i for i in range(5)]
    times = [0.0, 1.0, 2.0, *busy, *linger, 3.99, 4.99]
    out = summarize([Sample(t_ns=round(t * S), gpu_util=0.5) for t in times], steps)
    assert out["prefill"].seconds == pytest.approx(0.2, abs=0.021)
    assert out["decode"].seconds == pytest.approx(0.2, abs=0.021)
    # the end samples mirror their neighbour's 1 s gap: 5.99 s in all, 0.4 s of steps;
    # of the 0.51 s gap before the request, only the idle sample's half stays counted
    assert 5.99 - 0.4 - 0.26 <= out["idle"].seconds <= 5.99 - 0.4


def test_the_snapshots_phases_add_up_to_its_window(tmp_path: Path) -> None:
    """An idle server sampled once a second: the last 10 s by phase are 10 s of idle, not
    10.5 (the latest sample standing for half a second after it) or 11."""
    telemetry = on_a_board(tmp_path)
    times = iter([0.3 + i for i in range(30)])  # idle rate, not on the window's edges
    telemetry.sampler.source.close()
    telemetry.sampler = Sampler(Counting(), 50, clock_ns=lambda: round(next(times) * S))
    for _ in range(30):
        telemetry.sampler.capture_once()
    phases = telemetry.snapshot()["phases"]
    assert phases["idle"]["seconds"] == pytest.approx(10.0)
    assert sum(p["seconds"] for p in phases.values()) == pytest.approx(10.0)


def test_the_latest_requests_give_no_ttft_to_a_request_that_produced_no_token(
    tmp_path: Path,
) -> None:
    """A request cancelled while queued or during prefill has no first token: its
    timings' ``ttft_ms`` is only when it ended, which /telemetry (and so monitor) must
    not show as a TTFT, as /metrics and the dashboard do not count one."""
    from orin.engine.timings import TimingRecorder

    board = agx_orin_64gb(tmp_path, 6)
    engine = FakeEngine()
    telemetry = Telemetry(engine, CollectorRegistry(), "jetson_sysfs", root=board.root)  # type: ignore[arg-type]
    cancelled = TimingRecorder(arrival_ns=0, prefill_start_ns=12 * 10**6)
    served = TimingRecorder(arrival_ns=0, prefill_start_ns=5 * 10**6)
    for t in (90 * 10**6, 120 * 10**6):
        served.token(t)
    for observe in engine.finish_observers:
        observe("req-gone", "cancelled", cancelled.result(1110 * 10**6, 36, 24, 0))
        observe("req-served", "stop", served.result(120 * 10**6, 36, 24, 0))
    recent = {r["id"]: r for r in telemetry.snapshot()["recent_requests"]}
    assert recent["req-gone"]["generated_tokens"] == 0
    assert recent["req-gone"]["ttft_ms"] is None
    assert recent["req-served"]["ttft_ms"] == pytest.approx(90.0)
    telemetry.sampler.source.close()
