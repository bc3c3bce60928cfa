"""Live phase attribution inside the server.

Steps arrive from the engine thread after they end; samples arrive from the
sampler thread as they are taken. A sample is attributed once the engine's
timeline up to its timestamp is known: a later step has started, or the
engine is idle past it. Until then it waits (at most one step).

A sample stands for the time since the one before it: the sampler reads at its
full rate while the engine works and at its idle rate otherwise, so the gap,
not the nominal period, is what it covers. A sample inside a step covers at
most one full-rate period (the gap before the first sample of a request is
idle time the idle rate did not resolve).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orin.engine.types import RequestTimings, StepStats
from orin.telemetry.phases import Phase, Share, phase_shares, window_stats
from orin.telemetry.sampler import Sampler
from orin.telemetry.sources.base import Sample

AttributedObserver = Callable[[Sample, tuple[Share, ...], float], None]


@dataclass
class _Pending:
    sample: Sample
    gap: float | None  # seconds since the previous sample; None for the first


class PhaseTracker:
    def __init__(
        self,
        sampler: Sampler,
        current_step_start: Callable[[], int | None],
        history: int = 4096,
    ) -> None:
        self.sampler = sampler
        self._current_step_start = current_step_start
        self._steps: deque[StepStats] = deque(maxlen=history)
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self.observers: list[AttributedObserver] = []
        self.phase: Phase = "idle"
        self._last_ns: int | None = None
        sampler.observers.append(self.on_sample)

    def steps(self) -> list[StepStats]:
        with self._lock:
            return list(self._steps)

    def on_step(self, stats: StepStats) -> None:
        """Engine thread: record the step, cheaply."""
        with self._lock:
            self._steps.append(stats)

    def on_sample(self, sample: Sample) -> None:
        """Sampler thread: queue the sample, then attribute whatever is now decidable."""
        with self._lock:
            last, self._last_ns = self._last_ns, sample.t_ns
            gap = None if last is None else max(sample.t_ns - last, 0) / 1e9
            self._pending.append(_Pending(sample, gap))
            ready = self._decidable()
        period = 1.0 / self.sampler.hz
        longest = 1.0 / self.sampler.idle_hz
        for p, shares in ready:
            self.phase = max(shares, key=lambda s: s.weight).phase
            dt = period if p.gap is None else min(p.gap, longest)
            if self.phase != "idle":
                dt = min(dt, period)
            for observer in self.observers:
                observer(p.sample, shares, dt)

    def _decidable(self) -> list[tuple[_Pending, tuple[Share, ...]]]:
        # steps are recorded before the engine clears its running-step mark, so with no
        # step running every step that could cover a pending sample is already known
        running = self._current_step_start()
        out = []
        while self._pending:
            p = self._pending[0]
            t = p.sample.t_ns
            if running is not None and t >= running:
                break  # inside the step that is still running
            step = self._step_at(t)
            out.append((p, phase_shares(step, t)))
            self._pending.popleft()
        return out

    def _step_at(self, t: int) -> StepStats | None:
        for step in reversed(self._steps):
            if step.start_ns <= t < step.end_ns:
                return step
            if step.end_ns <= t:
                return None
        return None

    def request_block(self, t: RequestTimings) -> dict[str, Any]:
        """GPU (or CPU) utilization a request saw during its own prefill and decode."""
        samples = self.sampler.samples(since_ns=t.prefill_start_ns, until_ns=t.last_token_ns)
        out: dict[str, Any] = {}
        for metric, key in (("gpu_util", "gpu_util"), ("proc_cpu_util", "cpu_util")):
            pre = window_stats(samples, t.prefill_start_ns, t.first_token_ns, metric)
            dec = window_stats(samples, t.first_token_ns, t.last_token_ns, metric)
            if pre is not None:
                out[f"prefill_{key}"] = round(pre.mean, 4)
            if dec is not None:
                out[f"decode_{key}"] = round(dec.mean, 4)
        return out
