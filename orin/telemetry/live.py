"""Live phase attribution inside the server.

Steps arrive from the engine thread after they end; samples arrive from the
sampler thread as they are taken. A sample is attributed once the engine's
timeline up to its timestamp is known: a later step has started, or the
engine is idle past it. Until then it waits (at most one step).
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
    dt: float


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
            self._pending.append(_Pending(sample, 1.0 / self.sampler.hz))
            ready = self._decidable()
        for p, shares in ready:
            self.phase = max(shares, key=lambda s: s.weight).phase
            for observer in self.observers:
                observer(p.sample, shares, p.dt)

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
            out.append((p, phase_shares(step)))
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
