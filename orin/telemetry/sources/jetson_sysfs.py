"""The Orin iGPU load, clocks, EMC activity and INA3221 power rails, read from sysfs.

This is the primary source on a Jetson: the GPU load file is readable without root
and cheap enough to read at 50 Hz, which prefill phases of 80-400 ms need. Each
read of it is GPU activity to nvgpu (``gk20a_load_show`` takes a busy reference
while the GPU is powered, and reports 0 without waking it once rail-gated), so
the sampler reads it at 50 Hz only while the engine works and at 1 Hz when idle.
Discovery follows jetson-stats (devfreq entry whose ``device/of_node/name`` is a
known iGPU name; INA3221 hwmon channels with a label) and runs once, in
``discover``; ``JetsonSysfsSource.sample`` then only reads the files it found.

Units: GPU load file 0-1000, frequencies in Hz, rail voltage in mV and current in
mA (mW = mV * mA / 1000). EMC utilization needs debugfs (root); without it the
field is None, which is normal rather than an error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import cast

from orin.system.root import SysRoot
from orin.telemetry.sources.base import (
    Availability,
    KeptOpen,
    Sample,
    SplitTicks,
    no_capture,
    parse_int,
    read_file,
    realpath_in,
)

DEVFREQ_DIR = "/sys/class/devfreq"
I2C_DEVICES_DIR = "/sys/bus/i2c/devices"
IGPU_NAMES = frozenset({"ga10b", "gpu", "gv11b", "gp10b"})  # JP5 Orin, JP6 Orin, Xavier, TX2
EMC_ACTIVITY_PATHS = (
    "/sys/kernel/debug/cactmon/mc_all",
    "/sys/kernel/debug/bpmp/debug/actmon/mc_all_avg_activity",
    "/sys/kernel/actmon_avg_activity/mc_all",
)
EMC_RATE_PATH = "/sys/kernel/debug/bpmp/debug/clk/emc/rate"
SUM_CHANNEL = 7  # the upstream ina3221 driver's "sum of shunt voltages", not a rail


@dataclass(frozen=True)
class GpuPaths:
    """Where one devfreq iGPU keeps its files (system paths, symlinks resolved)."""

    name: str  # of_node name: ga10b, gpu, ...
    devfreq: str  # the devfreq entry: cur_freq, min_freq, max_freq, governor
    device: str  # the platform device: load

    @property
    def load(self) -> str:
        return f"{self.device}/load"

    def freq(self, which: str) -> str:
        return f"{self.devfreq}/{which}"


@dataclass(frozen=True)
class RailPaths:
    label: str
    voltage: str  # inN_input, mV
    current: str  # currN_input, mA


@dataclass(frozen=True)
class EmcPaths:
    activity: str
    rate: str  # Hz


@dataclass(frozen=True)
class JetsonLayout:
    """What discovery found; ``emc_reason`` says why EMC is missing when it is."""

    gpu: GpuPaths | None
    rails: tuple[RailPaths, ...] = ()
    emc: EmcPaths | None = None
    emc_reason: str = ""

    def files(self) -> tuple[str, ...]:
        """Every file a full ``read`` looks at, for gathering their texts in one go."""
        out: list[str] = []
        if self.gpu is not None:
            out.append(self.gpu.load)
            out += [self.gpu.freq(f) for f in ("cur_freq", "min_freq", "max_freq", "governor")]
        if self.emc is not None:
            out += [self.emc.activity, self.emc.rate]
        for rail in self.rails:
            out += [rail.voltage, rail.current]
        return tuple(out)


@dataclass(frozen=True)
class GpuReading:
    name: str
    load: float | None  # 0..1
    cur_freq_hz: int | None
    min_freq_hz: int | None
    max_freq_hz: int | None
    governor: str | None


@dataclass(frozen=True)
class RailReading:
    label: str
    voltage_mv: int | None
    current_ma: int | None
    power_mw: float | None


@dataclass(frozen=True)
class JetsonSysfsReading:
    gpu: GpuReading | None
    emc_util: float | None  # 0..1
    rails: tuple[RailReading, ...]


# -- pure parsing -------------------------------------------------------------------


def parse_load(text: str | None) -> float | None:
    """The devfreq GPU load file (0-1000, a driver-side moving average) as 0..1."""
    value = parse_int(text)
    return None if value is None else min(max(value / 1000.0, 0.0), 1.0)


def emc_util(activity_text: str | None, rate_text: str | None) -> float | None:
    """EMC utilization 0..1 the way jetson-stats and tegrastats compute it.

    The rate file is in Hz; percent = activity // rate_kHz (integer, as jetson-stats
    does, so the numbers agree with jtop's EMC field). Clamped to 0..1 because the
    actmon average can briefly overshoot the current rate after a clock change.
    """
    activity, rate_hz = parse_int(activity_text), parse_int(rate_text)
    if activity is None or rate_hz is None or rate_hz // 1000 <= 0:
        return None
    percent = activity // (rate_hz // 1000)
    return min(max(percent / 100.0, 0.0), 1.0)


def rail_power_mw(voltage_text: str | None, current_text: str | None) -> float | None:
    """mW from an INA3221 channel's bus voltage (mV) and current (mA)."""
    mv, ma = parse_int(voltage_text), parse_int(current_text)
    return None if mv is None or ma is None else mv * ma / 1000.0


def parse_of_name(text: str | None) -> str | None:
    """A device-tree ``name`` file: NUL-terminated, sometimes with a newline."""
    if text is None:
        return None
    return text.strip().strip("\x00").strip() or None


def parse(layout: JetsonLayout, texts: Mapping[str, str | None]) -> JetsonSysfsReading:
    """Turn the raw texts of ``layout.files()`` (system path -> text) into a reading."""
    gpu = None
    if layout.gpu is not None:
        g = layout.gpu
        governor = texts.get(g.freq("governor"))
        gpu = GpuReading(
            name=g.name,
            load=parse_load(texts.get(g.load)),
            cur_freq_hz=parse_int(texts.get(g.freq("cur_freq"))),
            min_freq_hz=parse_int(texts.get(g.freq("min_freq"))),
            max_freq_hz=parse_int(texts.get(g.freq("max_freq"))),
            governor=governor.strip() if governor is not None else None,
        )
    emc = None
    if layout.emc is not None:
        emc = emc_util(texts.get(layout.emc.activity), texts.get(layout.emc.rate))
    rails = tuple(
        RailReading(
            label=r.label,
            voltage_mv=parse_int(texts.get(r.voltage)),
            current_ma=parse_int(texts.get(r.current)),
            power_mw=rail_power_mw(texts.get(r.voltage), texts.get(r.current)),
        )
        for r in layout.rails
    )
    return JetsonSysfsReading(gpu=gpu, emc_util=emc, rails=rails)


# -- discovery ----------------------------------------------------------------------


def _listdir(root: SysRoot, system_path: str) -> list[str]:
    try:
        return sorted(p.name for p in root.path(system_path).iterdir())
    except OSError:
        return []


def find_gpu(root: SysRoot) -> GpuPaths | None:
    """The first devfreq entry whose device-tree node is a known iGPU, as jetson-stats
    finds it; None on a machine without one (x86, a discrete GPU, a container)."""
    for entry in _listdir(root, DEVFREQ_DIR):
        devfreq = realpath_in(root, f"{DEVFREQ_DIR}/{entry}")
        device = realpath_in(root, f"{devfreq}/device")
        name = parse_of_name(root.read_text(realpath_in(root, f"{device}/of_node/name")))
        if name in IGPU_NAMES:
            return GpuPaths(name=name, devfreq=devfreq, device=device)
    return None


def find_rails(root: SysRoot) -> tuple[RailPaths, ...]:
    """Labelled INA3221 channels under every i2c device's hwmon folders.

    Unconnected channels (label ``NC``) and the upstream driver's sum channel are
    skipped: neither is a rail, and summing the dict must not double count.
    """
    rails: list[RailPaths] = []
    for dev in _listdir(root, I2C_DEVICES_DIR):
        device = realpath_in(root, f"{I2C_DEVICES_DIR}/{dev}")
        if "ina3221" not in (root.read_text(f"{device}/name") or ""):
            continue
        for hwmon in _listdir(root, f"{device}/hwmon"):
            rails += _hwmon_rails(root, realpath_in(root, f"{device}/hwmon/{hwmon}"))
    return tuple(rails)


def _hwmon_rails(root: SysRoot, hwmon: str) -> list[RailPaths]:
    out: list[RailPaths] = []
    for item in _listdir(root, hwmon):
        if not (item.startswith("in") and item.endswith("_label")):
            continue
        channel = item[2 : -len("_label")]
        if not channel.isdigit() or int(channel) == SUM_CHANNEL:
            continue
        label = (root.read_text(f"{hwmon}/{item}") or "").strip()
        voltage, current = f"{hwmon}/in{channel}_input", f"{hwmon}/curr{channel}_input"
        if not label or label == "NC" or not (root.exists(voltage) and root.exists(current)):
            continue
        out.append(RailPaths(label=label, voltage=voltage, current=current))
    return out


def find_emc(root: SysRoot) -> tuple[EmcPaths | None, str]:
    """The first readable actmon file and the EMC rate, or None and why not."""
    rate = EMC_RATE_PATH
    if parse_int(read_file(root.path(rate))) is None:
        return None, f"EMC rate {rate} not readable (debugfs needs root)"
    for path in EMC_ACTIVITY_PATHS:
        if parse_int(read_file(root.path(path))) is not None:
            return EmcPaths(activity=path, rate=rate), f"EMC from {path}"
    return None, "no EMC actmon file readable (debugfs needs root)"


def discover(root: SysRoot) -> JetsonLayout:
    emc, emc_reason = find_emc(root)
    return JetsonLayout(gpu=find_gpu(root), rails=find_rails(root), emc=emc, emc_reason=emc_reason)


def read(root: SysRoot) -> JetsonSysfsReading:
    """Discover and read everything once (for ``doctor`` style one-off reports)."""
    layout = discover(root)
    return parse(layout, {f: read_file(root.path(f)) for f in layout.files()})


# -- the source ---------------------------------------------------------------------


SLOW_EVERY = 10  # clock, EMC and rail currents at a tenth of the sampling rate (5 Hz at 50 Hz)
REOPEN_EVERY = 50  # files are reopened once a second at 50 Hz

_RailTexts = tuple[tuple[str, str | None, str | None], ...]  # label, voltage, current
# full (voltages and EMC rate read too), GPU clock, EMC activity and rate, rails
_SlowTexts = tuple[bool, str | None, tuple[str | None, str | None] | None, _RailTexts]


class JetsonSysfsSource(SplitTicks):
    """50 Hz GPU load; clock, EMC and rail power at a tenth of that; from files found
    once at construction.

    A ``SplitSource``: the tick reads the GPU load file (``capture_fast``, an
    ``os.pread`` on the descriptor kept open); ``capture_slow`` reads the GPU
    clock, EMC activity and rail currents at every ``slow_every``-th tick, and
    the rail voltages and EMC clock rate, which barely move (the INA3221 channels
    sit on the 5 V inputs), when the files are reopened: every ``reopen_every``
    ticks (rounded to a multiple of ``slow_every``), so a GPU or a power monitor
    that goes away, or comes back, shows within a second. ``decode`` parses the
    texts later, several ticks at a time.
    """

    name = "jetson_sysfs"
    default_hz = 50.0

    def __init__(
        self, root: SysRoot, slow_every: int = SLOW_EVERY, reopen_every: int = REOPEN_EVERY
    ) -> None:
        self.root = root
        self.slow_every = slow_every
        self.reopen_every = max(slow_every, reopen_every // slow_every * slow_every)
        self.layout = discover(root)
        self._slow_reads = 0
        self._slow: tuple[int | None, float | None, dict[str, float]] = (None, None, {})
        self._volts: dict[str, str | None] = {}  # rail label -> last voltage text
        self._emc_rate: str | None = None
        g = self.layout.gpu
        # Resolved host paths, so the captures do no path arithmetic per call.
        self._load = str(root.path(g.load)) if g else None
        self._load_file = KeptOpen(self._load, size=64) if self._load else None
        self.capture_fast: Callable[[], object] = no_capture
        self._freq_file = KeptOpen(str(root.path(g.freq("cur_freq")))) if g else None
        emc = self.layout.emc
        self._emc = (
            (KeptOpen(str(root.path(emc.activity))), KeptOpen(str(root.path(emc.rate))))
            if emc
            else None
        )
        self._rails = tuple(
            (r.label, KeptOpen(str(root.path(r.voltage))), KeptOpen(str(root.path(r.current))))
            for r in self.layout.rails
        )

    def _files(self) -> list[KeptOpen]:
        files = [f for f in (self._load_file, self._freq_file) if f is not None]
        files += list(self._emc or ())
        for _, voltage, current in self._rails:
            files += [voltage, current]
        return files

    def availability(self) -> Availability:
        g = self.layout.gpu
        if g is None or self._load is None:
            return Availability(False, f"no devfreq iGPU ({'/'.join(sorted(IGPU_NAMES))})")
        if parse_load(read_file(self._load)) is None:
            return Availability(False, f"iGPU {g.name} found but {g.load} is not readable")
        rails = ", ".join(r.label for r in self.layout.rails) or "none"
        return Availability(
            True, f"iGPU {g.name} at {g.device}; rails: {rails}; {self.layout.emc_reason}"
        )

    def capture_slow(self) -> _SlowTexts:
        full = self._slow_reads % (self.reopen_every // self.slow_every) == 0
        self._slow_reads += 1
        if full:
            for f in self._files():
                f.reopen()
            self.capture_fast = self._load_file.reader() if self._load_file else no_capture
        freq = self._freq_file.read() if self._freq_file else None
        emc = None
        if self._emc is not None:
            emc = (self._emc[0].read(), self._emc[1].read() if full else None)
        rails = tuple((label, v.read() if full else None, c.read()) for label, v, c in self._rails)
        return full, freq, emc, rails

    def decode(self, t_ns: int, fast: object, slow: object | None) -> Sample:
        load_raw = cast("bytes | None", fast)
        load_text = None if load_raw is None else load_raw.decode("utf-8", "replace")
        if slow is not None:
            self._slow = self._decode_slow(*cast(_SlowTexts, slow))
        freq, emc, power = self._slow
        # the carried samples share one power dict: samples are read, never changed
        return Sample(
            t_ns=t_ns,
            gpu_util=parse_load(load_text),
            gpu_freq_hz=freq,
            emc_util=emc,
            power_mw=power,
        )

    def _decode_slow(
        self,
        full: bool,
        freq_text: str | None,
        emc_texts: tuple[str | None, str | None] | None,
        rail_texts: _RailTexts,
    ) -> tuple[int | None, float | None, dict[str, float]]:
        power: dict[str, float] = {}
        for label, voltage, current in rail_texts:
            if full:
                self._volts[label] = voltage
            mw = rail_power_mw(self._volts.get(label), current)
            if mw is not None:
                power[label] = mw
        emc = None
        if emc_texts is not None:
            if full:
                self._emc_rate = emc_texts[1]
            emc = emc_util(emc_texts[0], self._emc_rate)
        return parse_int(freq_text), emc, power

    def close(self) -> None:
        """Close the files kept open between ticks."""
        self.capture_fast = no_capture
        for f in self._files():
            f.close()
