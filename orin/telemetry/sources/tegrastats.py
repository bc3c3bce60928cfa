"""tegrastats lines (JetPack 5, 6 and 7) and a source that follows the running program.

tegrastats is the fallback on a Jetson where sysfs is hidden (a container without
/sys/devices) but the program is present. Its interval is coarse (default 100 ms
here), so it cannot resolve short prefill phases; the sysfs source is preferred.

Formats this parser accepts, field by field (a field may be absent in any of them):
- ``RAM 1205/30623MB (lfb 6429x4MB)``, ``SWAP 0/15311MB (cached 0MB)``
- ``CPU [0%@729,off,...]``
- ``EMC_FREQ 3%@2133`` (JP6 prints it only as root)
- ``GR3D_FREQ 0%@0`` (JP5), ``0%`` or ``0%@[0,0]`` (JP6), ``12%@[1300,1300]`` (JP7)
- temperatures ``CPU@42.5C`` (JP5), ``cpu@52.8C`` (JP6), ``cpu@52.968C/52.968C`` (JP7);
  ``-256C`` means the sensor is off
- rails ``VDD_GPU_SOC 2399mW/2399mW`` (current/average), three values on JP7
"""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime

from orin.system.commands import CommandRunner, LineStream
from orin.telemetry.sources.base import Availability, Sample

MB = 1 << 20
UNIT_BYTES = {"k": 1 << 10, "K": 1 << 10, "M": MB, "G": 1 << 30}
SENSOR_OFF_C = -256.0

DATE_RE = re.compile(r"^\s*(\d{2})-(\d{2})-(\d{4}) (\d{2}):(\d{2}):(\d{2})\b")
RAM_RE = re.compile(r"\bRAM (\d+)/(\d+)([kKMG])B")
SWAP_RE = re.compile(r"\bSWAP (\d+)/(\d+)([kKMG])B")
CPU_RE = re.compile(r"\bCPU \[([^\]]*)\]")
CORE_RE = re.compile(r"(\d+)%(?:@(\d+))?")
EMC_RE = re.compile(r"\bEMC_FREQ (\d+)%(?:@(\d+))?")
GR3D_RE = re.compile(r"\bGR3D_FREQ (?:(\d+)%)?(?:@(?:\[([\d,]*)\]|(\d+)))?")
TEMP_RE = re.compile(r"\b(\w+)@(-?\d+(?:\.\d+)?)C(?:/(-?\d+(?:\.\d+)?)C)?(?=\s|$)")
RAIL_RE = re.compile(r"\b([A-Z][A-Z0-9_]*) (\d+(?:\.\d+)?)mW((?:/\d+(?:\.\d+)?mW){1,2})(?=\s|$)")


@dataclass(frozen=True)
class MemoryUse:
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class CpuCore:
    online: bool
    util: float | None = None  # 0..1
    freq_mhz: int | None = None


@dataclass(frozen=True)
class RailPower:
    """One rail; ``values_mw`` as printed: (current, average) or JP7's three values."""

    label: str
    values_mw: tuple[float, ...]

    @property
    def current_mw(self) -> float:
        return self.values_mw[0]

    @property
    def average_mw(self) -> float | None:
        return self.values_mw[1] if len(self.values_mw) > 1 else None


@dataclass(frozen=True)
class TegrastatsReading:
    ram: MemoryUse
    timestamp: datetime | None = None
    swap: MemoryUse | None = None
    cpus: tuple[CpuCore, ...] = ()
    emc_util: float | None = None  # 0..1
    emc_freq_mhz: int | None = None
    gpu_util: float | None = None  # 0..1
    gpu_freq_mhz: int | None = None  # highest GPC clock on JP6/JP7 arrays
    gpc_freqs_mhz: tuple[int, ...] = ()
    temps_c: dict[str, float | None] = field(default_factory=dict)  # lower-case label; None=off
    rails: tuple[RailPower, ...] = ()

    @property
    def cpu_util(self) -> float | None:
        """Mean over online cores; offline cores are not idle capacity, so they are left out."""
        utils = [c.util for c in self.cpus if c.online and c.util is not None]
        return sum(utils) / len(utils) if utils else None

    def to_sample(self, t_ns: int) -> Sample:
        return Sample(
            t_ns=t_ns,
            gpu_util=self.gpu_util,
            gpu_freq_hz=None if self.gpu_freq_mhz is None else self.gpu_freq_mhz * 1_000_000,
            emc_util=self.emc_util,
            power_mw={r.label: r.current_mw for r in self.rails},
            cpu_util=self.cpu_util,
        )


# -- pure parsing -------------------------------------------------------------------


def parse_timestamp(line: str) -> datetime | None:
    m = DATE_RE.match(line)
    if m is None:
        return None
    month, day, year, hh, mm, ss = (int(g) for g in m.groups())
    try:
        return datetime(year, month, day, hh, mm, ss)
    except ValueError:
        return None


def parse_memory(regex: re.Pattern[str], line: str) -> MemoryUse | None:
    m = regex.search(line)
    if m is None:
        return None
    scale = UNIT_BYTES[m.group(3)]
    return MemoryUse(used_bytes=int(m.group(1)) * scale, total_bytes=int(m.group(2)) * scale)


def parse_core(text: str) -> CpuCore:
    """``12%@729``, ``12%`` or ``off``; anything else is an online core of unknown load."""
    text = text.strip()
    if text == "off":
        return CpuCore(online=False)
    m = CORE_RE.fullmatch(text)
    if m is None:
        return CpuCore(online=True)
    freq = int(m.group(2)) if m.group(2) else None
    return CpuCore(online=True, util=int(m.group(1)) / 100.0, freq_mhz=freq)


def parse_cpus(line: str) -> tuple[CpuCore, ...]:
    m = CPU_RE.search(line)
    if m is None or not m.group(1).strip():
        return ()
    return tuple(parse_core(c) for c in m.group(1).split(","))


def parse_emc(line: str) -> tuple[float | None, int | None]:
    m = EMC_RE.search(line)
    if m is None:
        return None, None
    return int(m.group(1)) / 100.0, int(m.group(2)) if m.group(2) else None


def parse_gr3d(line: str) -> tuple[float | None, int | None, tuple[int, ...]]:
    """GPU load, clock and per-GPC clocks from every GR3D_FREQ form.

    ``0%@0`` (JP5: clock 0 while rail-gated), ``0%`` (JP6 without root: no clock),
    ``0%@[0,0]`` and ``12%@[1300,1300]`` (one clock per GPC: the highest is reported).
    """
    m = GR3D_RE.search(line)
    if m is None:
        return None, None, ()
    util = int(m.group(1)) / 100.0 if m.group(1) else None
    gpcs = tuple(int(f) for f in m.group(2).split(",") if f) if m.group(2) else ()
    if gpcs:
        return util, max(gpcs), gpcs
    return util, int(m.group(3)) if m.group(3) else None, ()


def parse_temps(line: str) -> dict[str, float | None]:
    """``label@42.5C`` or JP7's ``label@52.968C/52.968C`` (first value kept); -256 is off."""
    temps: dict[str, float | None] = {}
    for label, value, _second in TEMP_RE.findall(line):
        celsius = float(value)
        temps[label.lower()] = None if celsius <= SENSOR_OFF_C else celsius
    return temps


def parse_rails(line: str) -> tuple[RailPower, ...]:
    """Rails with two (JP5/6) or three (JP7) mW values; unconnected ``NC`` rails dropped."""
    rails = []
    for label, first, rest in RAIL_RE.findall(line):
        if label == "NC":
            continue
        values = (float(first), *(float(v) for v in rest.replace("mW", "").split("/") if v))
        rails.append(RailPower(label=label, values_mw=values))
    return tuple(rails)


def parse(line: str) -> TegrastatsReading | None:
    """One tegrastats line, or None when it is not one (no RAM field: a warning, noise,
    a truncated first line)."""
    ram = parse_memory(RAM_RE, line)
    if ram is None:
        return None
    emc, emc_freq = parse_emc(line)
    gpu, gpu_freq, gpcs = parse_gr3d(line)
    return TegrastatsReading(
        ram=ram,
        timestamp=parse_timestamp(line),
        swap=parse_memory(SWAP_RE, line),
        cpus=parse_cpus(line),
        emc_util=emc,
        emc_freq_mhz=emc_freq,
        gpu_util=gpu,
        gpu_freq_mhz=gpu_freq,
        gpc_freqs_mhz=gpcs,
        temps_c=parse_temps(line),
        rails=parse_rails(line),
    )


IDLE_MS = 1000  # tegrastats' interval while the engine is idle (the sampler's idle rate)


def stale_after(interval_ms: int) -> float:
    """Seconds after which a reading no longer counts as current: three intervals."""
    return max(3 * interval_ms / 1000.0, 1.0)


def command(interval_ms: int) -> tuple[str, ...]:
    return ("tegrastats", "--interval", str(interval_ms))


def read(runner: CommandRunner, interval_ms: int = 100) -> TegrastatsReading | None:
    """The first parseable line of a fresh tegrastats run (blocks for about one interval)."""
    stream = runner.stream(command(interval_ms))
    try:
        for line in stream:
            reading = parse(line)
            if reading is not None:
                return reading
        return None
    finally:
        stream.close()


# -- the source ---------------------------------------------------------------------


class TegrastatsSource:
    """Runs tegrastats on its own thread and hands out the latest line as a Sample.

    The program starts on the first ``sample()`` (or ``start()``), not in the
    constructor, so that probing availability never spawns a process. A reading
    older than ``stale_after_s`` (the program died or stalled) yields empty fields
    rather than repeating old values as if they were current.

    tegrastats reads the GPU load itself, on its own interval, so the sampler's
    idle rate alone would not let the GPU rail-gate: ``set_idle`` (the sampler
    calls it when the engine goes idle or gets work) restarts the program at
    ``idle_interval_ms`` or back at ``interval_ms``.
    """

    name = "tegrastats"

    def __init__(
        self, runner: CommandRunner, interval_ms: int = 100, idle_interval_ms: int = IDLE_MS
    ) -> None:
        self.runner = runner
        self.busy_interval_ms = interval_ms
        self.idle_interval_ms = max(idle_interval_ms, interval_ms)
        self.interval_ms = interval_ms  # the running program's
        self.default_hz = 1000.0 / interval_ms
        self.stale_after_s = stale_after(interval_ms)
        self.lines = 0
        self.malformed = 0
        self.error: str | None = None
        self._latest: tuple[int, TegrastatsReading] | None = None
        self._lock = threading.Lock()
        self._stream: LineStream | None = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def availability(self) -> Availability:
        path = self.runner.which("tegrastats")
        if path is None:
            return Availability(False, "tegrastats not found on PATH")
        return Availability(True, f"{path} every {self.interval_ms} ms")

    @property
    def latest(self) -> TegrastatsReading | None:
        with self._lock:
            return self._latest[1] if self._latest else None

    def start(self) -> None:
        if self._thread is not None or self._closed:
            return
        try:
            self._stream = self.runner.stream(command(self.interval_ms))
        except OSError as exc:
            self.error = f"cannot run tegrastats: {exc}"
            return
        self._thread = threading.Thread(target=self._follow, name="orin-tegrastats", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        assert self._stream is not None
        for line in self._stream:
            self.feed(line)

    def set_idle(self, idle: bool) -> None:
        """Run the program at the idle interval (or back at the busy one); a program
        already running at another interval is restarted."""
        interval = self.idle_interval_ms if idle else self.busy_interval_ms
        if interval == self.interval_ms:
            return
        self.interval_ms = interval
        self.stale_after_s = stale_after(interval)
        if self._thread is None:
            return  # not started yet: it starts at this interval
        self._end()
        if not idle:  # an idle reading does not describe the work that starts now
            with self._lock:
                self._latest = None
        self.start()

    def feed(self, line: str) -> TegrastatsReading | None:
        """Take one line of output; blank lines are ignored, others that do not parse are
        counted in ``malformed`` and skipped."""
        if not line.strip():
            return None
        self.lines += 1
        reading = parse(line)
        if reading is None:
            self.malformed += 1
            return None
        with self._lock:
            self._latest = (time.perf_counter_ns(), reading)
        return reading

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the output to end (tests, or a program that exited); True if it did."""
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def sample(self) -> Sample:
        self.start()
        now = time.perf_counter_ns()
        with self._lock:
            latest = self._latest
        if latest is None or (now - latest[0]) > self.stale_after_s * 1e9:
            return Sample(t_ns=now)
        return latest[1].to_sample(now)

    def close(self) -> None:
        self._closed = True
        self._end()

    def _end(self) -> None:
        if self._stream is not None:
            self._stream.close()
        if self._thread is not None:
            self._thread.join(timeout=3)
        self._thread = None
        self._stream = None
