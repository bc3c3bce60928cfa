"""Discrete NVIDIA GPUs through NVML (nvidia-ml-py's ``pynvml``).

Used when orin-llm runs on a desktop or server GPU (development machines, CI with
a GPU). On a Jetson, NVML is either absent or answers NotSupported for
utilization, so availability probes one utilization read before saying yes.
NVML's utilization is the share of the last sample period (1/6 s to 1 s,
depending on the GPU) in which a kernel ran, so 50 Hz readings repeat values.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orin.telemetry.sources.base import Availability, Sample, one_line

INSTALL_HINT = "pip install 'orin-llm[nvml]'"


@dataclass(frozen=True)
class NvmlReading:
    index: int
    gpu_util: float | None = None  # 0..1
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    power_mw: float | None = None
    sm_clock_hz: int | None = None

    @property
    def rail(self) -> str:
        """The power_mw key: one "rail" per GPU, named after its NVML index."""
        return f"GPU{self.index}"

    def to_sample(self, t_ns: int) -> Sample:
        return Sample(
            t_ns=t_ns,
            gpu_util=self.gpu_util,
            gpu_freq_hz=self.sm_clock_hz,
            power_mw={} if self.power_mw is None else {self.rail: self.power_mw},
            gpu_mem_used_bytes=self.mem_used_bytes,
        )


def parse(
    index: int,
    util_percent: int | None = None,
    mem_used: int | None = None,
    mem_total: int | None = None,
    power_mw: int | None = None,
    clock_mhz: int | None = None,
) -> NvmlReading:
    """pynvml's raw values (utilization.gpu %, memory bytes, power mW, SM clock MHz)."""
    return NvmlReading(
        index=index,
        gpu_util=None if util_percent is None else min(max(util_percent / 100.0, 0.0), 1.0),
        mem_used_bytes=mem_used,
        mem_total_bytes=mem_total,
        power_mw=None if power_mw is None else float(power_mw),
        sm_clock_hz=None if clock_mhz is None else clock_mhz * 1_000_000,
    )


def _reason(exc: BaseException) -> str:
    return f"NVML: {one_line(str(exc)) or type(exc).__name__}"


def _quiet(fn: Callable[..., Any], *args: Any) -> Any | None:
    """One NVML query; NotSupported or a GPU that fell off the bus gives None."""
    try:
        return fn(*args)
    except Exception:
        return None


def _name(nvml: Any, handle: Any) -> str:
    name = _quiet(nvml.nvmlDeviceGetName, handle)
    return name.decode() if isinstance(name, bytes) else str(name or "unknown GPU")


class NvmlSource:
    """Utilization, memory and power of one GPU (index ``index``) at 50 Hz."""

    name = "nvml"
    default_hz = 50.0

    def __init__(self, index: int = 0) -> None:
        self.index = index
        self._nvml: Any | None = None
        self._handle: Any | None = None
        self._note = ""

    def _open(self) -> str | None:
        """Initialise NVML and probe the GPU; None on success, else the reason."""
        try:
            import pynvml
        except ImportError as exc:
            return f"nvidia-ml-py is not installed ({exc}); {INSTALL_HINT}"
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return _reason(exc)
        try:
            count = pynvml.nvmlDeviceGetCount()
            if self.index >= count:
                raise LookupError(f"{count} GPU(s) visible, no index {self.index}")
            handle = pynvml.nvmlDeviceGetHandleByIndex(self.index)
            pynvml.nvmlDeviceGetUtilizationRates(handle)  # NotSupported on Jetson iGPUs
        except Exception as exc:
            _quiet(pynvml.nvmlShutdown)
            return _reason(exc)
        self._nvml, self._handle = pynvml, handle
        self._note = f"GPU {self.index}: {_name(pynvml, handle)}"
        return None

    def availability(self) -> Availability:
        if self._nvml is None:
            failure = self._open()
            if failure is not None:
                return Availability(False, failure)
        return Availability(True, self._note)

    def read(self) -> NvmlReading | None:
        nvml, handle = self._nvml, self._handle
        if nvml is None:
            return None
        util = _quiet(nvml.nvmlDeviceGetUtilizationRates, handle)
        mem = _quiet(nvml.nvmlDeviceGetMemoryInfo, handle)
        return parse(
            self.index,
            util_percent=None if util is None else util.gpu,
            mem_used=None if mem is None else mem.used,
            mem_total=None if mem is None else mem.total,
            power_mw=_quiet(nvml.nvmlDeviceGetPowerUsage, handle),
            clock_mhz=_quiet(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
        )

    def sample(self) -> Sample:
        now = time.perf_counter_ns()
        reading = self.read()
        return Sample(t_ns=now) if reading is None else reading.to_sample(now)

    def close(self) -> None:
        nvml, self._nvml, self._handle = self._nvml, None, None
        if nvml is not None:
            _quiet(nvml.nvmlShutdown)


def read(index: int = 0) -> NvmlReading | None:
    """One reading of GPU ``index``; None when NVML cannot be used."""
    source = NvmlSource(index)
    try:
        return source.read() if source.availability().ok else None
    finally:
        source.close()
