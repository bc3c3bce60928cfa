"""Telemetry wired into a serving engine: source -> sampler -> phase tracker ->
metrics, per-request blocks, an optional recording, and a live snapshot."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from orin.engine.client import EngineClient
from orin.engine.types import FinishReason, RequestTimings
from orin.system.commands import CommandRunner, SubprocessRunner
from orin.system.root import SysRoot
from orin.telemetry.metrics import PhaseMetrics
from orin.telemetry.phases import summarize
from orin.telemetry.record import Recorder
from orin.telemetry.sampler import Sampler
from orin.telemetry.sources import select_source
from orin.telemetry.tracker import PhaseTracker

log = logging.getLogger("orin.telemetry")

SNAPSHOT_WINDOW_S = 10.0


def engine_busy(engine: EngineClient) -> Callable[[], bool]:
    """Whether the engine has work, for the sampler's rate: a step running, a slot
    busy or a request queued. Asked from the sampler thread at every tick, without
    the engine's lock: the answer only picks a sampling rate, and one that is a
    tick late costs one tick at the other rate."""

    def busy() -> bool:
        return engine.status().busy

    return busy


def running_step_start(engine: EngineClient) -> Callable[[], int | None]:
    """When the step now running began (None between steps), for the phase tracker."""

    def start() -> int | None:
        return engine.status().step_started_ns

    return start


class Telemetry:
    def __init__(
        self,
        engine: EngineClient,
        registry: CollectorRegistry,
        source_name: str | None = None,
        hz: float | None = None,
        record: Path | None = None,
        root: SysRoot | None = None,
        runner: CommandRunner | None = None,
    ) -> None:
        source, why = select_source(source_name, root or SysRoot(), runner or SubprocessRunner())
        log.info("telemetry: %s", why)
        self.source_name = source.name
        self.engine = engine
        self.sampler = Sampler(source, hz, busy=engine_busy(engine))
        self.tracker = PhaseTracker(self.sampler, running_step_start(engine))
        self.metrics = PhaseMetrics(registry, source.name)
        self.tracker.observers.append(self.metrics.observe)
        self.recent: deque[dict[str, Any]] = deque(maxlen=20)
        engine.add_step_observer(self.tracker.on_step)
        engine.add_finish_observer(self._on_finish)
        self.recorder: Recorder | None = None
        if record is not None:
            meta = {
                "source": source.name,
                "hz": self.sampler.hz,
                "idle_hz": self.sampler.idle_hz,
                "model": str(engine.cfg.model_path),
            }
            self.recorder = Recorder(record, meta)
            self.sampler.observers.append(self.recorder.on_sample)
            engine.add_step_observer(self.recorder.on_step)
            engine.add_finish_observer(self.recorder.on_finish)

    def start(self) -> Telemetry:
        self.sampler.start()
        return self

    def stop(self) -> None:
        self.sampler.stop()
        if self.recorder is not None:
            self.recorder.close()

    def _on_finish(self, request_id: str, reason: FinishReason, t: RequestTimings) -> None:
        self.recent.append(
            {
                "id": request_id,
                "finish_reason": reason,
                "ttft_ms": t.first_token_ms,
                "tpot_ms": t.tpot_ms,
                "prompt_tokens": t.prompt_tokens,
                "generated_tokens": t.generated_tokens,
            }
        )

    def request_block(self, t: RequestTimings | None) -> dict[str, Any]:
        return self.tracker.request_block(t) if t is not None else {}

    def snapshot(self) -> dict[str, Any]:
        """What ``orin-llm monitor`` shows: the latest sample, the phase, recent per-phase
        utilization and the latest requests."""
        latest = self.sampler.latest()
        samples = []
        steps = []
        span = None
        if latest is not None:
            since = latest.t_ns - int(SNAPSHOT_WINDOW_S * 1e9)
            samples = self.sampler.samples(since_ns=since)
            # only the steps that end inside the window: their tokens are the window's
            steps = [s for s in self.tracker.steps() if s.end_ns >= since]
            span = (since, latest.t_ns)  # the phases' seconds add up to the window at most
        phases = summarize(samples, steps, span) if samples else {}
        status = self.engine.status()
        return {
            "source": self.source_name,
            "hz": self.sampler.hz,
            "idle_hz": self.sampler.idle_hz,
            "sampling": "idle" if self.sampler.idle else "full",
            "phase": self.tracker.phase,
            "latest": asdict(latest) if latest is not None else None,
            "window_s": SNAPSHOT_WINDOW_S,
            "phases": {p: s.to_dict() for p, s in phases.items()},
            "slots_busy": status.slots_busy,
            "slots_total": status.slots_total,
            "waiting": status.waiting,
            "recent_requests": list(self.recent),
        }
