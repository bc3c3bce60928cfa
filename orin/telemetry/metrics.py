"""Telemetry's Prometheus objects: the board's utilization, power and energy,
attributed to engine phases (prefill, decode, idle).

They live in the server's registry (``/metrics``) next to ServerMetrics'
objects, under the same name prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Info

from orin.telemetry.phases import Share
from orin.telemetry.sources.base import Sample

PREFIX = "orin_llm_"  # every metric of orin-llm, the server's included

TELEMETRY_PHASES = ("prefill", "decode", "idle")
UTIL_EWMA = 0.2  # weight of the newest sample in the per-phase utilization gauge


class PhaseMetrics:
    """Telemetry attributed to engine phases (orin/telemetry/phases.py).

    Counters integrate over time so PromQL can average over any window:
    ``rate(orin_llm_gpu_busy_seconds_total{phase="prefill"}[1m])
    / rate(orin_llm_phase_seconds_total{phase="prefill"}[1m])`` is the mean GPU
    utilization during prefill. The gauge is a smoothed recent value for dashboards.
    """

    def __init__(self, registry: CollectorRegistry, source: str) -> None:
        def counter(name: str, doc: str) -> Counter:
            c = Counter(PREFIX + name, doc, ("phase",), registry=registry)
            for p in TELEMETRY_PHASES:
                c.labels(p)
            return c

        self.phase_seconds = counter(
            "phase_seconds", "Time the engine spent in each phase (mixed steps split by tokens)."
        )
        self.gpu_busy = counter(
            "gpu_busy_seconds", "GPU utilization integrated over time, per engine phase."
        )
        self.cpu_busy = counter(
            "process_cpu_busy_seconds",
            "This process's CPU utilization (share of all cores) integrated over time, per phase.",
        )
        self.energy = counter(
            "energy_joules", "Energy from the board's power rails, per engine phase."
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
            p: (
                self.phase_seconds.labels(p),
                self.samples.labels(p),
                self.gpu_busy.labels(p),
                self.cpu_busy.labels(p),
                self.energy.labels(p),
                self.gpu_util.labels(p),
            )
            for p in TELEMETRY_PHASES
        }

    def observe(self, sample: Sample, shares: tuple[Share, ...], dt: float) -> None:
        """A PhaseTracker observer: one attributed sample."""
        power = sum(sample.power_mw.values()) if sample.power_mw else None
        gpu, cpu = sample.gpu_util, sample.proc_cpu_util
        for share in shares:
            w = share.weight * dt
            phase = share.phase
            seconds, n, gpu_busy, cpu_busy, energy, gpu_gauge = self._children[phase]
            seconds.inc(w)
            n.inc(share.weight)
            if gpu is not None:
                gpu_busy.inc(gpu * w)
                prev = self._ewma.get(phase, gpu)
                self._ewma[phase] = prev * (1 - UTIL_EWMA) + gpu * UTIL_EWMA
                gpu_gauge.set(self._ewma[phase])
            if cpu is not None:
                cpu_busy.inc(cpu * w)
            if power is not None:
                energy.inc(power * 1e-3 * w)
