"""A background thread that reads a telemetry source at a fixed rate into a ring buffer.

Timestamps come from the source's Sample.t_ns (time.perf_counter_ns), the clock
the engine stamps its steps with, so samples line up with phases. The loop
keeps to a fixed schedule (no drift from the read time) and skips missed
ticks rather than bursting to catch up.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from orin.telemetry.sources.base import Sample, Source

log = logging.getLogger("orin.telemetry")

SampleObserver = Callable[[Sample], None]


class Sampler:
    def __init__(self, source: Source, hz: float | None = None, seconds: float = 600.0) -> None:
        self.source = source
        self.hz = hz or source.default_hz
        if self.hz <= 0:
            raise ValueError("the sampling rate must be positive")
        self._buffer: deque[Sample] = deque(maxlen=max(int(self.hz * seconds), 16))
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.observers: list[SampleObserver] = []
        self.errors = 0
        self.missed_ticks = 0

    def start(self) -> Sampler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="orin-telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.source.close()

    def _run(self) -> None:
        period = 1.0 / self.hz
        next_tick = time.perf_counter()
        while not self._stop.is_set():
            self.sample_once()
            next_tick += period
            delay = next_tick - time.perf_counter()
            if delay < 0:  # fell behind: skip the missed ticks
                missed = int(-delay // period) + 1
                self.missed_ticks += missed
                next_tick += missed * period
                delay = next_tick - time.perf_counter()
            time.sleep(max(delay, 0.0))  # cheaper per tick than Event.wait; stop waits one tick

    def sample_once(self) -> Sample | None:
        try:
            sample = self.source.sample()
        except Exception:  # a source must not take the server down
            self.errors += 1
            if self.errors in (1, 100, 10_000):
                log.warning("telemetry source %s failed", self.source.name, exc_info=True)
            return None
        with self._lock:
            self._buffer.append(sample)
        for observer in self.observers:
            try:
                observer(sample)
            except Exception:
                log.exception("telemetry observer failed")
        return sample

    def samples(self, since_ns: int | None = None, until_ns: int | None = None) -> list[Sample]:
        with self._lock:
            data = list(self._buffer)
        if since_ns is not None:
            data = [s for s in data if s.t_ns >= since_ns]
        if until_ns is not None:
            data = [s for s in data if s.t_ns <= until_ns]
        return data

    def latest(self) -> Sample | None:
        with self._lock:
            return self._buffer[-1] if self._buffer else None
