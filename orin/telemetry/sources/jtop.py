"""jetson-stats (``from jtop import jtop``) as an optional telemetry source.

jtop talks to ``jtop.service`` over /run/jtop.sock, and its interval is shared by
every client (its maintainer advises >= 0.5 s), far too coarse for prefill; it is
used only where sysfs and NVML are not available but the service is. A missing
package or service is an ``Availability(False, <jtop's own message>)``, never an
exception out of this module.

Shape assumed for ``jetson.stats`` (jetson-stats 4.x ``jtop.stats``; keys are
optional unless said otherwise)::

    {"time": datetime, "uptime": timedelta,
     "CPU1": 12, ..., "CPU12": "OFF",        # 100 - idle %, or "OFF"
     "RAM": 0.31, "SWAP": 0.0,               # used / total fractions
     "EMC": 3,                               # % of bandwidth (root only)
     "GPU": 12.3,                            # % load of the first GPU
     "APE": 174, "NVENC": "OFF", ...,        # engine clocks
     "Temp cpu": 52.5, ...,
     "Power VDD_GPU_SOC": 2399, ..., "Power TOT": 7000,   # mW
     "jetson_clocks": "OFF", "nvp model": "MODE_30W"}

and for ``jetson.gpu`` (a mapping of GPU name to its state)::

    {"gpu": {"type": "integrated",
             "status": {"load": 12.3, "railgate": False, ...},     # load in %
             "freq": {"cur": 1300500, "min": 306000, "max": 1300500,  # kHz
                      "governor": "nvhost_podgov", "GPC": [...]}}}
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from orin.telemetry.power import INPUT_RAILS
from orin.telemetry.sources.base import Availability, Sample, one_line

CPU_KEY_RE = re.compile(r"^CPU(\d+)$")
POWER_PREFIX = "Power "
POWER_TOTAL = "Power TOT"
INPUT_RAIL = INPUT_RAILS[0]  # an Orin's module input rail, VDD_IN


@dataclass(frozen=True)
class JtopReading:
    gpu_util: float | None = None  # 0..1
    gpu_freq_hz: int | None = None
    emc_util: float | None = None  # 0..1
    cpus: tuple[float | None, ...] = ()  # per core 0..1, None when OFF
    ram_used_fraction: float | None = None
    power_mw: dict[str, float] = field(default_factory=dict)  # rails only, no total
    total_power_mw: float | None = None

    @property
    def cpu_util(self) -> float | None:
        online = [c for c in self.cpus if c is not None]
        return sum(online) / len(online) if online else None

    def to_sample(self, t_ns: int) -> Sample:
        return Sample(
            t_ns=t_ns,
            gpu_util=self.gpu_util,
            gpu_freq_hz=self.gpu_freq_hz,
            emc_util=self.emc_util,
            power_mw=self.rails_with_input(),
            cpu_util=self.cpu_util,
        )

    def rails_with_input(self) -> dict[str, float]:
        """The rails, with the module's input rail put back where jtop took it out.

        jtop moves an input rail (``VDD_IN`` on an Orin NX or Nano) out of its rails
        into "Power TOT" (jtop/core/power.py, ``total_power``); without one, TOT is the
        rails' sum (AGX Orin). Put back, the input rail is what the board's power is
        read from (orin.telemetry.power), instead of the sum of the rails it feeds.
        """
        rails = dict(self.power_mw)
        total = self.total_power_mw
        if total is not None and rails and abs(total - sum(rails.values())) > 1.0:
            rails[INPUT_RAIL] = total
        return rails


def _number(value: Any) -> float | None:
    """A numeric stats value; "OFF", None and anything else that is not a number -> None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _percent(value: Any) -> float | None:
    number = _number(value)
    return None if number is None else min(max(number / 100.0, 0.0), 1.0)


def _cpus(stats: Mapping[str, Any]) -> tuple[float | None, ...]:
    cores = []
    for key, value in stats.items():
        m = CPU_KEY_RE.match(key)
        if m is not None:
            cores.append((int(m.group(1)), _percent(value)))
    return tuple(util for _, util in sorted(cores))


def _gpu_freq_hz(gpus: Mapping[str, Any] | None) -> int | None:
    """The first GPU's current clock (jtop keeps it in kHz)."""
    for gpu in (gpus or {}).values():
        freq = gpu.get("freq", {}) if isinstance(gpu, Mapping) else {}
        khz = _number(freq.get("cur")) if isinstance(freq, Mapping) else None
        return None if khz is None else int(khz * 1000)
    return None


def parse(stats: Mapping[str, Any], gpus: Mapping[str, Any] | None = None) -> JtopReading:
    """jtop's ``stats`` dict (and optionally its ``gpu`` mapping, for the clock)."""
    power = {
        key[len(POWER_PREFIX) :]: mw
        for key, value in stats.items()
        if key.startswith(POWER_PREFIX) and key != POWER_TOTAL
        for mw in [_number(value)]
        if mw is not None
    }
    return JtopReading(
        gpu_util=_percent(stats.get("GPU")),
        gpu_freq_hz=_gpu_freq_hz(gpus),
        emc_util=_percent(stats.get("EMC")),
        cpus=_cpus(stats),
        ram_used_fraction=_number(stats.get("RAM")),
        power_mw=power,
        total_power_mw=_number(stats.get(POWER_TOTAL)),
    )


def connect(interval_s: float) -> tuple[Any | None, str]:
    """A started jtop client and a one-line note, or None and jtop's own reason."""
    try:
        from jtop import jtop
    except ImportError as exc:
        return None, f"jetson-stats is not installed ({exc}); pip install 'orin-llm[jetson]'"
    try:
        jetson = jtop(interval=interval_s)
        jetson.start()
    except Exception as exc:  # JtopException, and the OSErrors jtop re-raises as they are
        return None, one_line(str(exc)) or type(exc).__name__
    return jetson, f"jtop.service, interval {getattr(jetson, 'interval', interval_s)} s"


def read(interval_s: float = 0.5) -> JtopReading | None:
    """One reading from a fresh connection; None when jtop is not usable."""
    jetson, _reason = connect(interval_s)
    if jetson is None:
        return None
    try:
        return parse(jetson.stats, jetson.gpu)
    finally:
        jetson.close()


class JtopSource:
    """The latest jtop data on each ``sample()``.

    Connects on the first availability probe (or first sample), once: a failed
    connection is not retried at the sampling rate.
    """

    name = "jtop"

    def __init__(self, interval_s: float = 0.5) -> None:
        self.interval_s = interval_s
        self.default_hz = 1.0 / interval_s
        self.error: str | None = None
        self._jetson: Any | None = None
        self._note = ""
        self._tried = False

    def availability(self) -> Availability:
        if self._jetson is None:
            self._tried = True
            self._jetson, self._note = connect(self.interval_s)
        return Availability(self._jetson is not None, self._note)

    def sample(self) -> Sample:
        now = time.perf_counter_ns()
        if self._jetson is None and not self._tried:
            self.availability()
        if self._jetson is None:  # not reconnecting at the sampling rate
            return Sample(t_ns=now)
        try:
            self._jetson.ok(spin=True)  # re-raises what the client thread hit, without waiting
            reading = parse(self._jetson.stats, self._jetson.gpu)
        except Exception as exc:  # lost service: empty fields, not a crash
            self.error = one_line(str(exc)) or type(exc).__name__
            return Sample(t_ns=now)
        return reading.to_sample(now)

    def close(self) -> None:
        jetson, self._jetson = self._jetson, None
        if jetson is not None:
            # closing a dead connection has nothing left to report
            with contextlib.suppress(Exception):
                jetson.close()
