"""A background thread that reads a telemetry source at a fixed rate into a ring buffer.

Timestamps come from time.perf_counter_ns, the clock the engine stamps its steps
with, so samples line up with phases. The loop keeps to a fixed schedule (no
drift from the read time) and skips missed ticks rather than bursting to catch up.

At 50 Hz the cost of a tick is mostly the cold start of whatever Python it runs
(measured in benchmarks/telemetry_overhead.py), so a tick does as little as it can:
it stamps the time and, for a ``SplitSource``, only captures the raw values
(``capture_fast``, with ``capture_slow`` every ``slow_every`` ticks).
Captures are decoded into Samples, stored and handed to the observers in
batches of ``flush_every`` ticks (twice a second by default), or at once when
someone reads the buffer, so readers never see stale data and observers lag at
most a batch.

Reading the iGPU's load file is GPU activity to its driver (nvgpu's
``gk20a_load_show`` takes a busy reference while the GPU is powered), so at
50 Hz an idle GPU never rail-gates. Given ``busy`` (is the engine working?),
the sampler reads the source at the full rate only while it is busy and for
``linger_s`` after, and at ``idle_hz`` (1 Hz) otherwise, each idle read a full
one (with the slow captures) and flushed at once. The loop still wakes at the
full rate to ask ``busy``, which reads two attributes and touches no file, so
the first step of a request is sampled from its start.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from orin.telemetry.sources.base import Sample, Source, SplitSource, split_capture

log = logging.getLogger("orin.telemetry")

SampleObserver = Callable[[Sample], None]
FLUSH_HZ = 2.0  # how often captures are decoded and observers called (readers flush)
IDLE_HZ = 1.0  # reads while the engine is idle (the GPU can rail-gate between them)
LINGER_S = 2.0  # full rate for this long after the engine was last busy


class Sampler:
    def __init__(
        self,
        source: Source,
        hz: float | None = None,
        seconds: float = 600.0,
        flush_every: int | None = None,
        busy: Callable[[], bool] | None = None,
        idle_hz: float = IDLE_HZ,
        linger_s: float = LINGER_S,
        clock: Callable[[], float] = time.perf_counter,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """``busy`` None samples at ``hz`` always; ``clock``, ``clock_ns`` (the engine's
        clock, for the time stamps) and ``sleep`` drive the loop and are injectable."""
        self.source = source
        self.hz = hz or source.default_hz
        if self.hz <= 0 or idle_hz <= 0:
            raise ValueError("the sampling rate must be positive")
        self.busy = busy
        self.idle_hz = min(idle_hz, self.hz) if busy is not None else self.hz
        self.idle_every = max(1, round(self.hz / self.idle_hz))  # ticks per idle read
        self.linger_ticks = max(0, round(linger_s * self.hz))
        self.idle = False  # reading at the idle rate now
        self._clock, self._clock_ns, self._sleep = clock, clock_ns, sleep
        # a source that runs on its own schedule (tegrastats) follows the mode itself
        self._set_idle: Callable[[bool], None] | None = getattr(source, "set_idle", None)
        self.flush_every = flush_every or max(1, round(self.hz / FLUSH_HZ))
        self._buffer: deque[Sample] = deque(maxlen=max(int(self.hz * seconds), 16))
        # (time, fast capture, slow capture or None), appended by the tick only
        self._captured: deque[tuple[int, object, object | None]] = deque()
        self._lock = threading.RLock()  # decode order, the buffer, observers' order
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.observers: list[SampleObserver] = []
        self.errors = 0
        self.missed_ticks = 0
        self._ticks = 0
        if isinstance(source, SplitSource):
            self._split: SplitSource | None = source
            self._decode: Callable[[int, object, object | None], Sample] = source.decode
        else:
            self._split, self._decode = None, _already_decoded

    def start(self) -> Sampler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self.run, name="orin-telemetry", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        self.flush()
        self.source.close()

    def run(self) -> None:
        """The sampling loop, in the calling thread, until ``stop``; ``start`` runs it
        on a thread of its own."""
        period = 1.0 / self.hz
        clock, clock_ns, sleep = self._clock, self._clock_ns, self._sleep
        stopped, captured, flush_every = self._stop.is_set, self._captured, self.flush_every
        append = captured.append
        split = self._split
        slow_every = split.slow_every if split is not None else 1
        fast = split.capture_fast if split is not None else self.source.sample
        busy, idle_every, linger = self.busy, self.idle_every, self.linger_ticks
        countdown = 0  # fast-only ticks left before the next one with slow captures
        quiet = 0  # full-rate ticks left before idle reads (starts idle)
        skip = 0  # idle: ticks left before the next read
        next_tick = clock()
        while not stopped():
            read = True
            if busy is not None:
                if busy():
                    quiet, skip = linger, 0
                    if self.idle:
                        self._mode(idle=False)
                elif quiet:
                    quiet -= 1
                elif skip:  # idle, between reads: no file is touched
                    skip -= 1
                    read = False
                else:  # idle: one full read now, flushed, then idle_every - 1 ticks off
                    if not self.idle:
                        self._mode(idle=True)
                    skip, countdown = idle_every - 1, 0
            if not read:
                pass
            elif countdown:  # the common tick: a time stamp and one capture, nothing else
                countdown -= 1
                t = clock_ns()
                try:
                    append((t, fast(), None))
                except OSError:  # as split_capture: None until the file is reopened
                    append((t, None, None))
                except Exception:  # a source must not take the server down
                    self._failed()
            else:
                self._tick(clock_ns, captured, slow=True)
                countdown = slow_every - 1
                if split is not None:
                    fast = split.capture_fast  # the slow capture may have reopened a file
            if len(captured) >= flush_every or (self.idle and captured):
                self.flush()
            next_tick += period
            delay = next_tick - clock()
            if delay < 0:  # fell behind: skip the missed ticks
                missed = int(-delay // period) + 1
                self.missed_ticks += missed
                next_tick += missed * period
                delay = next_tick - clock()
            sleep(delay if delay > 0 else 0.0)  # cheaper than Event.wait; stop waits a tick

    def _mode(self, idle: bool) -> None:
        self.idle = idle
        if self._set_idle is not None:
            try:
                self._set_idle(idle)
            except Exception:  # a source must not take the server down
                self._failed()

    def _tick(
        self,
        clock_ns: Callable[[], int],
        captured: deque[tuple[int, object, object | None]],
        slow: bool,
    ) -> None:
        """One tick; ``slow``: with the source's slow captures."""
        t = clock_ns()
        split = self._split
        try:
            if split is None:
                captured.append((t, self.source.sample(), None))
            else:
                captured.append((t, *split_capture(split, slow)))
        except Exception:  # a source must not take the server down
            self._failed()

    def capture_once(self) -> None:
        """One tick now, outside the schedule, left for the next flush; the source's
        slow captures come with every ``slow_every``-th call."""
        every = self._split.slow_every if self._split is not None else 1
        self._tick(self._clock_ns, self._captured, slow=self._ticks % every == 0)
        self._ticks += 1

    def sample_once(self) -> Sample | None:
        """Take one sample now and return it once stored (None if the source failed)."""
        before = self.errors
        self.capture_once()
        with self._lock:
            self.flush()
            return self._buffer[-1] if self._buffer and self.errors == before else None

    def flush(self) -> None:
        """Decode what the ticks captured, store it and tell the observers, in order."""
        with self._lock:
            captured, decode, fresh = self._captured, self._decode, []
            while captured:
                t, fast, slow = captured.popleft()
                try:
                    fresh.append(decode(t, fast, slow))
                except Exception:
                    self._failed()
            self._buffer.extend(fresh)
            for sample in fresh:
                for observer in self.observers:
                    try:
                        observer(sample)
                    except Exception:
                        log.exception("telemetry observer failed")

    def _failed(self) -> None:
        self.errors += 1
        if self.errors in (1, 100, 10_000):
            log.warning("telemetry source %s failed", self.source.name, exc_info=True)

    def samples(self, since_ns: int | None = None, until_ns: int | None = None) -> list[Sample]:
        with self._lock:
            self.flush()
            data = list(self._buffer)
        if since_ns is not None:
            data = [s for s in data if s.t_ns >= since_ns]
        if until_ns is not None:
            data = [s for s in data if s.t_ns <= until_ns]
        return data

    def latest(self) -> Sample | None:
        with self._lock:
            self.flush()
            return self._buffer[-1] if self._buffer else None


def _already_decoded(t_ns: int, fast: object, slow: object | None) -> Sample:
    """For a source without the split: its ``sample()`` ran at the tick."""
    assert isinstance(fast, Sample)
    return fast
