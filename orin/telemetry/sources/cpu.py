"""Whole-machine and this-process CPU use, the source that works everywhere.

Without a GPU source (a laptop, CI, a container) this keeps every telemetry feature
working; on a CPU-only llama.cpp build it is also the load that matters.
Utilization comes from cumulative CPU times between two successive samples, so
``sample()`` never blocks the way ``psutil.cpu_percent(interval=...)`` does.

System times come from ``psutil.cpu_times()`` (/proc/stat, in 10 ms ticks: at 50 Hz
on 12 cores one sample resolves about 4 %). This process's time comes from
``time.process_time_ns()`` (CLOCK_PROCESS_CPUTIME_ID, all threads, nanosecond
resolution) rather than ``psutil.Process().cpu_times()``, whose 10 ms ticks would
make a 20 ms share jump between 0 and a whole core.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from orin.telemetry.sources.base import Availability, Sample

# On Linux, guest time is already counted in user and nice (psutil does the same).
DOUBLE_COUNTED = ("guest", "guest_nice")
IDLE = ("idle", "iowait")


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative whole-machine CPU seconds, summed over cores."""

    busy_s: float
    total_s: float


@dataclass(frozen=True)
class CpuSnapshot:
    t_ns: int  # time.perf_counter_ns()
    system: CpuTimes
    process_s: float  # this process's user + system CPU seconds


@dataclass(frozen=True)
class CpuReading:
    cpu_util: float | None  # whole machine, 0..1
    proc_cpu_util: float | None  # this process, 0..1 of all cores


def parse_times(fields: Mapping[str, float]) -> CpuTimes:
    """psutil's cpu_times fields (as a dict) -> busy and total seconds."""
    total = sum(v for k, v in fields.items() if k not in DOUBLE_COUNTED)
    idle = sum(fields.get(k, 0.0) for k in IDLE)
    return CpuTimes(busy_s=total - idle, total_s=total)


def _fraction(numerator: float, denominator: float) -> float | None:
    if denominator <= 0:
        return None
    return min(max(numerator / denominator, 0.0), 1.0)


def parse(prev: CpuSnapshot, cur: CpuSnapshot, n_cpus: int) -> CpuReading:
    """Utilization between two snapshots; None where no time has passed on that clock."""
    system = _fraction(
        cur.system.busy_s - prev.system.busy_s, cur.system.total_s - prev.system.total_s
    )
    wall_s = (cur.t_ns - prev.t_ns) / 1e9
    proc = _fraction(cur.process_s - prev.process_s, wall_s * n_cpus)
    return CpuReading(cpu_util=system, proc_cpu_util=proc)


def read() -> CpuSnapshot:
    return CpuSnapshot(
        t_ns=time.perf_counter_ns(),
        system=parse_times(psutil.cpu_times()._asdict()),
        process_s=time.process_time_ns() / 1e9,
    )


MACHINE_EVERY = 5  # /proc/stat costs far more than process_time: read it every 5th sample


class CpuSource:
    """Each sample covers the time since the previous one (the first, since construction).

    The process share comes from this process's CPU clock at every sample; the
    machine-wide figure from /proc/stat at every MACHINE_EVERY-th sample (10 Hz
    at 50 Hz), carried between reads, which keeps the sampler's own cost low.
    """

    name = "cpu"
    default_hz = 50.0

    def __init__(self, machine_every: int = MACHINE_EVERY) -> None:
        self.machine_every = machine_every
        self.n_cpus = psutil.cpu_count() or 1
        self._prev = read()
        self._proc_prev = (self._prev.t_ns, self._prev.process_s)
        self._cpu_util: float | None = None
        self._tick = 0

    def availability(self) -> Availability:
        return Availability(True, f"psutil, {self.n_cpus} CPUs")

    def sample(self) -> Sample:
        t, proc_s = time.perf_counter_ns(), time.process_time_ns() / 1e9
        t0, proc0 = self._proc_prev
        proc = _fraction(proc_s - proc0, (t - t0) / 1e9 * self.n_cpus)
        self._proc_prev = (t, proc_s)
        self._tick += 1
        if (self._tick - 1) % self.machine_every == 0 or self._cpu_util is None:
            cur = read()
            reading = parse(self._prev, cur, self.n_cpus)
            if reading.cpu_util is not None:
                # Until /proc/stat has ticked (calls closer than 10 ms / n_cpus) the old
                # baseline is kept, so the next read spans a measurable window.
                self._prev = cur
                self._cpu_util = reading.cpu_util
        return Sample(t_ns=t, cpu_util=self._cpu_util, proc_cpu_util=proc)

    def close(self) -> None:
        """Nothing to release."""
