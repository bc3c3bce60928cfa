"""Whole-machine and this-process CPU use, the source that works everywhere.

Without a GPU source (a laptop, CI, a container) this keeps every telemetry feature
working; on a CPU-only llama.cpp build it is also the load that matters.
Utilization comes from cumulative CPU times between two successive samples, so
``sample()`` never blocks the way ``psutil.cpu_percent(interval=...)`` does.

System times come from /proc/stat (psutil off Linux; in 10 ms ticks: at 50 Hz
on 12 cores one sample resolves about 4 %). This process's time comes from
``time.process_time_ns()`` (CLOCK_PROCESS_CPUTIME_ID, all threads, nanosecond
resolution) rather than ``psutil.Process().cpu_times()``, whose 10 ms ticks would
make a 20 ms share jump between 0 and a whole core.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

import psutil

from orin.telemetry.sources.base import Availability, Sample, SplitTicks

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


def system_util(prev: CpuTimes, cur: CpuTimes) -> float | None:
    """Whole-machine utilization between two readings; None before /proc/stat ticks."""
    return _fraction(cur.busy_s - prev.busy_s, cur.total_s - prev.total_s)


def process_util(cpu_delta: float, wall_delta: float, n_cpus: int) -> float | None:
    """This process's share of all cores (both deltas in the same unit)."""
    return _fraction(cpu_delta, wall_delta * n_cpus)


def parse(prev: CpuSnapshot, cur: CpuSnapshot, n_cpus: int) -> CpuReading:
    """Utilization between two snapshots; None where no time has passed on that clock."""
    return CpuReading(
        cpu_util=system_util(prev.system, cur.system),
        proc_cpu_util=process_util(
            cur.process_s - prev.process_s, (cur.t_ns - prev.t_ns) / 1e9, n_cpus
        ),
    )


PROC_STAT = "/proc/stat"
PROC_STAT_FIELDS = (
    "user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal", "guest", "guest_nice",
)  # fmt: skip


def parse_proc_stat(text: str, ticks_per_s: float) -> CpuTimes | None:
    """The aggregate ``cpu`` line of /proc/stat (clock ticks) -> busy and total seconds;
    None when the text does not start with it."""
    fields = text.split("\n", 1)[0].split()
    if len(fields) < 5 or fields[0] != "cpu":
        return None
    try:
        values = [int(v) / ticks_per_s for v in fields[1:]]
    except ValueError:
        return None
    return parse_times(dict(zip(PROC_STAT_FIELDS, values, strict=False)))


class MachineTimes:
    """Whole-machine CPU times, from /proc/stat through a file kept open.

    psutil.cpu_times() reads the same line but opens the file and builds a named
    tuple each time; at 5-10 Hz on a sampling thread that is most of the sampler's
    cost, so on Linux the text is re-read with one pread and parsed later. Where
    /proc/stat does not exist, psutil is the fallback.
    """

    def __init__(self) -> None:
        self.ticks_per_s = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        try:
            self._fd: int | None = os.open(PROC_STAT, os.O_RDONLY)
        except OSError:
            self._fd = None

    @property
    def from_proc_stat(self) -> bool:
        return self._fd is not None

    def capture(self) -> str | CpuTimes:
        """The raw /proc/stat head (cheap), or psutil's figures off Linux."""
        if self._fd is not None:
            return os.pread(self._fd, 512, 0).decode("ascii", "replace")
        return parse_times(psutil.cpu_times()._asdict())

    def decode(self, raw: str | CpuTimes) -> CpuTimes | None:
        return raw if isinstance(raw, CpuTimes) else parse_proc_stat(raw, self.ticks_per_s)

    def read(self) -> CpuTimes | None:
        return self.decode(self.capture())

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def read() -> CpuSnapshot:
    machine = MachineTimes()
    try:
        system = machine.read() or parse_times(psutil.cpu_times()._asdict())
    finally:
        machine.close()
    return CpuSnapshot(
        t_ns=time.perf_counter_ns(), system=system, process_s=time.process_time_ns() / 1e9
    )


MACHINE_EVERY = 10  # /proc/stat costs far more than process_time: every 10th sample (5 Hz)


class CpuSource(SplitTicks):
    """Each sample covers the time since the previous one (the first, since construction).

    The process share (what phase attribution uses) comes from this process's CPU
    clock at every sample; the machine-wide figure from /proc/stat at every
    MACHINE_EVERY-th sample (5 Hz at 50 Hz; /proc/stat counts in 10 ms ticks
    anyway), carried between reads, which keeps the sampler's own cost low.
    A ``SplitSource``: the tick reads the process clock (``capture_fast`` is
    ``time.process_time_ns`` itself) and the /proc/stat text; ``decode`` does
    the arithmetic.
    """

    name = "cpu"
    default_hz = 50.0

    def __init__(self, machine_every: int = MACHINE_EVERY) -> None:
        self.slow_every = machine_every
        self.capture_fast: Callable[[], object] = time.process_time_ns
        self.n_cpus = psutil.cpu_count() or 1
        self._machine = MachineTimes()
        t0 = time.perf_counter_ns()
        self._proc_prev = (t0, time.process_time_ns())
        self._system_prev = self._machine.read()
        self._cpu_util: float | None = None

    def availability(self) -> Availability:
        how = "/proc/stat" if self._machine.from_proc_stat else "psutil"
        return Availability(True, f"{how}, {self.n_cpus} CPUs")

    def capture_slow(self) -> str | CpuTimes:
        return self._machine.capture()

    def decode(self, t_ns: int, fast: object, slow: object | None) -> Sample:
        proc_ns = cast(int, fast)
        t0, proc0 = self._proc_prev
        proc = process_util(proc_ns - proc0, t_ns - t0, self.n_cpus)
        self._proc_prev = (t_ns, proc_ns)
        if slow is not None:
            self._update_machine(self._machine.decode(cast("str | CpuTimes", slow)))
        return Sample(t_ns=t_ns, cpu_util=self._cpu_util, proc_cpu_util=proc)

    def _update_machine(self, cur: CpuTimes | None) -> None:
        prev = self._system_prev
        if cur is None or prev is None:
            self._system_prev = cur or prev
            return
        util = system_util(prev, cur)
        if util is not None:
            # Until /proc/stat has ticked (reads closer than 10 ms / n_cpus) the old
            # baseline is kept, so the next read spans a measurable window.
            self._system_prev = cur
            self._cpu_util = util

    def close(self) -> None:
        self._machine.close()
