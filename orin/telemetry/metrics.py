"""Telemetry's Prometheus objects: the board's utilization, power and energy,
attributed to engine phases (prefill, decode, idle), and the board's memory and
temperatures as they are when scraped.

They live in the server's registry (``/metrics``) next to ServerMetrics'
objects, under the same name prefix.

Importing this module switches off prometheus-client's ``*_created`` series
(a timestamp series beside every counter and histogram child, process-wide):
no dashboard or alert here reads them, and they are about a tenth of a
scrape's series.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Info, disable_created_metrics
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orin.errors import OrinError
from orin.system.memory import read_meminfo
from orin.system.platform import SENSOR_OFF_C, THERMAL_DIR
from orin.system.root import SysRoot
from orin.telemetry.phases import Share
from orin.telemetry.power import board_power_mw
from orin.telemetry.sources.base import Sample

PREFIX = "orin_llm_"  # every metric of orin-llm, the server's included

disable_created_metrics()

TELEMETRY_PHASES = ("prefill", "decode", "encode", "idle")
UTIL_EWMA = 0.2  # weight of the newest sample in the per-phase utilization gauge


class PhaseMetrics:
    """Telemetry attributed to engine phases (orin/telemetry/phases.py).

    Counters integrate over time so PromQL can average over any window:
    ``rate(orin_llm_gpu_busy_seconds_total{phase="prefill"}[1m])
    / rate(orin_llm_phase_seconds_total{phase="prefill"}[1m])`` is the mean GPU
    utilization during prefill. The gauge is a smoothed recent value for dashboards.
    """

    def __init__(self, registry: CollectorRegistry, source: str) -> None:
        def counter(name: str, doc: str, lazy: bool = False) -> Counter:
            """``lazy``: no series until the first sample that has the reading."""
            c = Counter(PREFIX + name, doc, ("phase",), registry=registry)
            for p in TELEMETRY_PHASES if not lazy else ():
                c.labels(p)
            return c

        self.phase_seconds = counter(
            "phase_seconds", "Time the engine spent in each phase (mixed steps split by tokens)."
        )
        # The GPU's series appear with the first sample that has a GPU reading: a
        # machine without a GPU has none rather than a GPU that reads 0 (idle).
        self.gpu_busy = counter(
            "gpu_busy_seconds", "GPU utilization integrated over time, per engine phase.", True
        )
        self.cpu_busy = counter(
            "process_cpu_busy_seconds",
            "This process's CPU utilization (share of all cores) integrated over time, per phase.",
        )
        # likewise energy: a machine without power rails has no series, not 0 J
        self.energy = counter(
            "energy_joules", "Energy from the board's power rails, per engine phase.", True
        )
        self.samples = counter("telemetry_samples", "Telemetry samples attributed, per phase.")
        self.gpu_util = Gauge(
            PREFIX + "gpu_utilization_ratio",
            "Recent GPU utilization (0-1) while the engine was in this phase (smoothed).",
            ("phase",),
            registry=registry,
        )
        Info(PREFIX + "telemetry_source", "The telemetry source in use.", registry=registry).info(
            {"source": source}
        )
        self._ewma: dict[str, float] = {}
        # The per-phase children, looked up once: observe runs for every sample.
        self._children = {
            p: (self.phase_seconds.labels(p), self.samples.labels(p), self.cpu_busy.labels(p))
            for p in TELEMETRY_PHASES
        }
        self._gpu_children: dict[str, tuple[Counter, Gauge]] = {}
        self._energy_children: dict[str, Counter] = {}

    def _energy(self, phase: str) -> Counter:
        """A phase's energy counter, made with every phase's on the first power reading."""
        child = self._energy_children.get(phase)
        if child is None:
            self._energy_children = {p: self.energy.labels(p) for p in TELEMETRY_PHASES}
            child = self._energy_children[phase]
        return child

    def _gpu(self, phase: str) -> tuple[Counter, Gauge]:
        """A phase's GPU children, made on its first GPU reading: the busy counter of
        every phase at once (so rates start from 0 together), the gauge per phase (a
        phase not yet seen has no recent utilization, not 0)."""
        children = self._gpu_children.get(phase)
        if children is None:
            for p in TELEMETRY_PHASES:
                self.gpu_busy.labels(p)
            children = self.gpu_busy.labels(phase), self.gpu_util.labels(phase)
            self._gpu_children[phase] = children
        return children

    def observe(self, sample: Sample, shares: tuple[Share, ...], dt: float) -> None:
        """A PhaseTracker observer: one attributed sample."""
        power = board_power_mw(sample.power_mw)
        gpu, cpu = sample.gpu_util, sample.proc_cpu_util
        for share in shares:
            w = share.weight * dt
            phase = share.phase
            seconds, n, cpu_busy = self._children[phase]
            seconds.inc(w)
            n.inc(share.weight)
            if gpu is not None:
                gpu_busy, gpu_gauge = self._gpu(phase)
                gpu_busy.inc(gpu * w)
                prev = self._ewma.get(phase, gpu)
                self._ewma[phase] = prev * (1 - UTIL_EWMA) + gpu * UTIL_EWMA
                gpu_gauge.set(self._ewma[phase])
            if cpu is not None:
                cpu_busy.inc(cpu * w)
            if power is not None:
                self._energy(phase).inc(power * 1e-3 * w)


class SystemMetrics(Collector):
    """The board's memory and temperatures, read from ``root`` when /metrics is scraped:
    a gauge read only then needs no sampling thread, and works with telemetry off.

    On an Orin the GPU allocates from the same memory as the CPU, so MemAvailable
    is what is left for the model, its KV cache and everything else; swap in use
    means the model or the KV cache may be paged out (decode slows down sharply).
    Temperatures are the kernel's thermal zones, by zone name; a zone switched off
    (Jetson reads -256 C) or unreadable is left out, and a machine without thermal
    zones has a declared family with no series.
    """

    def __init__(self, root: SysRoot | None = None) -> None:
        self.root = root or SysRoot()

    def collect(self) -> Iterator[Metric]:
        yield from self._memory()
        # declared even without a zone (no series then), like a labelled gauge
        family = GaugeMetricFamily(
            PREFIX + "temperature_celsius",
            "Temperature of each thermal zone the kernel reports (sysfs thermal_zone*).",
            labels=("zone",),
        )
        for zone, celsius in read_temperatures(self.root).items():
            family.add_metric([zone], celsius)
        yield family

    def _memory(self) -> Iterator[Metric]:
        try:
            mem = read_meminfo(self.root)
        except OrinError:  # no /proc/meminfo (not Linux): no memory series
            return
        for name, doc, value in (
            (
                "memory_total_bytes",
                "MemTotal of /proc/meminfo (on an Orin, GPU included).",
                mem.total,
            ),
            (
                "memory_available_bytes",
                "MemAvailable of /proc/meminfo: what can still be allocated without swapping.",
                mem.available,
            ),
            (
                "swap_used_bytes",
                "Swap in use (SwapTotal - SwapFree of /proc/meminfo).",
                mem.swap_total - mem.swap_free,
            ),
        ):
            yield GaugeMetricFamily(PREFIX + name, doc, value=value)


def read_temperatures(root: SysRoot) -> dict[str, float]:
    """Zone name -> degrees Celsius, for the zones that report one. The name is the
    zone's ``type``; a second zone of the same type is told apart by its folder
    (``acpitz/thermal_zone3``), so every label value is unique."""
    base = root.path(THERMAL_DIR)
    try:
        entries = [e for e in os.listdir(base) if e.startswith("thermal_zone")]
    except OSError:
        return {}
    temps: dict[str, float] = {}
    for entry in sorted(entries, key=lambda e: (len(e), e)):  # thermal_zone2 before 10
        folder = f"{THERMAL_DIR}/{entry}"
        raw = (root.read_text(f"{folder}/temp") or "").strip()
        if not raw.lstrip("-").isdigit():
            continue
        celsius = int(raw) / 1000
        if celsius <= SENSOR_OFF_C:
            continue
        name = (root.read_text(f"{folder}/type") or "").strip() or entry
        temps[name if name not in temps else f"{name}/{entry}"] = celsius
    return temps
