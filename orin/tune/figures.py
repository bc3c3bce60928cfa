"""What a measurement holds: per grid point the engine's RequestTimings figures, per
phase the time, tokens and utilization, and the Score the search ranks by.

Pure data with merge operations: repetitions measured at different times
(successive halving's rounds) add up to one measurement.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from orin.bench.stats import percentile
from orin.profile.schema import SLOSection
from orin.tune.search import Score
from orin.tune.space import Candidate


@dataclass(frozen=True)
class Grid:
    prompt_tokens: tuple[int, ...]
    concurrency: tuple[int, ...]
    output_tokens: int

    @property
    def points(self) -> list[tuple[int, int]]:
        return [(p, c) for p in self.prompt_tokens for c in self.concurrency]


@dataclass
class Point:
    """One (prompt length, concurrency) cell, accumulated over repetitions. Latencies
    pool the requests of all repetitions; tokens and wall time are kept per
    repetition, so throughput is a median that a disturbed repetition cannot drag."""

    prompt_tokens: int
    concurrency: int
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)
    queue_ms: list[float] = field(default_factory=list)
    prefill_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    rep_tokens: list[int] = field(default_factory=list)  # generated tokens per repetition
    rep_wall_s: list[float] = field(default_factory=list)  # wall time per repetition
    errors: int = 0
    drafted: int = 0  # speculative decoding: tokens drafted for these requests
    accepted: int = 0  # of those, the ones the model confirmed

    @property
    def output_tokens(self) -> int:
        return sum(self.rep_tokens)

    @property
    def wall_s(self) -> float:
        return sum(self.rep_wall_s)

    @property
    def ttft_p95(self) -> float | None:
        return percentile(self.ttft_ms, 95)

    @property
    def tpot_p90(self) -> float | None:
        return percentile(self.tpot_ms, 90)

    @property
    def throughput(self) -> float:
        """Median over repetitions of generated tokens/s."""
        return median_rate([self])

    def merge(self, other: Point) -> Point:
        return Point(
            self.prompt_tokens,
            self.concurrency,
            self.ttft_ms + other.ttft_ms,
            self.tpot_ms + other.tpot_ms,
            self.queue_ms + other.queue_ms,
            self.prefill_ms + other.prefill_ms,
            self.e2e_ms + other.e2e_ms,
            self.rep_tokens + other.rep_tokens,
            self.rep_wall_s + other.rep_wall_s,
            self.errors + other.errors,
            self.drafted + other.drafted,
            self.accepted + other.accepted,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "concurrency": self.concurrency,
            "requests": len(self.ttft_ms),
            "errors": self.errors,
            "ttft_p95_ms": self.ttft_p95,
            "tpot_p90_ms": self.tpot_p90,
            "ttft_p50_ms": percentile(self.ttft_ms, 50),
            "tpot_p50_ms": percentile(self.tpot_ms, 50),
            "queue_mean_ms": _mean(self.queue_ms),
            "prefill_mean_ms": _mean(self.prefill_ms),
            "output_throughput": self.throughput,
            "drafted_tokens": self.drafted,
            "accepted_tokens": self.accepted,
        }


@dataclass(frozen=True)
class PhaseFigures:
    """Engine time, tokens and mean utilization in one phase (None: not measured)."""

    seconds: float
    tokens: int
    gpu_util: float | None
    cpu_util: float | None
    mixed_share: float = 0.0

    def merge(self, o: PhaseFigures) -> PhaseFigures:
        total = self.seconds + o.seconds

        def avg(a: float | None, b: float | None) -> float | None:
            if a is None or b is None or total <= 0:
                return a if b is None else b
            return (a * self.seconds + b * o.seconds) / total

        mixed = avg(self.mixed_share, o.mixed_share) or 0.0
        return PhaseFigures(
            total, self.tokens + o.tokens, avg(self.gpu_util, o.gpu_util),
            avg(self.cpu_util, o.cpu_util), mixed,
        )  # fmt: skip


@dataclass
class Measurement:
    candidate: Candidate
    reps: int = 0
    points: dict[tuple[int, int], Point] = field(default_factory=dict)
    phases: dict[str, PhaseFigures] = field(default_factory=dict)
    cost_s: float = 0.0  # wall time of all its measuring, model loads included
    error: str | None = None
    setup_s: float = 0.0  # of cost_s: loading and warming up, whatever the repetitions

    def merge(self, o: Measurement) -> Measurement:
        points = dict(self.points)
        for key, p in o.points.items():
            points[key] = points[key].merge(p) if key in points else p
        phases = dict(self.phases)
        for name, f in o.phases.items():
            phases[name] = phases[name].merge(f) if name in phases else f
        return Measurement(
            self.candidate, self.reps + o.reps, points, phases,
            self.cost_s + o.cost_s, o.error or self.error, self.setup_s + o.setup_s,
        )  # fmt: skip

    def throughput(self) -> float:
        """Generated tokens/s at the highest concurrency the SLOs name, over all prompt
        lengths: per repetition, then the median over repetitions."""
        if not self.points:
            return 0.0
        top = max(c for _, c in self.points)
        return median_rate([p for (_, c), p in self.points.items() if c == top])

    def to_dict(self) -> dict[str, Any]:
        return {
            "candidate": self.candidate.to_dict(),
            "label": self.candidate.label,
            "reps": self.reps,
            "cost_s": self.cost_s,
            "error": self.error,
            "throughput": self.throughput(),
            "points": [p.to_dict() for p in self.points.values()],
            "phases": {k: vars(v) for k, v in self.phases.items()},
        }


def has_targets(slo: SLOSection) -> bool:
    """Whether the SLO sets a latency target; without one every configuration that
    completes its requests "meets" it, and the ranking is by throughput alone."""
    return slo.ttft_p95_ms is not None or slo.tpot_p90_ms is not None


def verdict(meets_slo: bool, targets: bool) -> str:
    """The chosen configuration against the SLO, in words."""
    if not targets:
        if meets_slo:
            return "no SLO targets (the profile's slo section sets none): the fastest configuration"
        return "no SLO targets, and some requests failed: the closest configuration"
    return "SLO met" if meets_slo else "SLO NOT met: the closest configuration"


def score(m: Measurement, slo: SLOSection) -> Score:
    """SLOs hold at every point: p95 TTFT and p90 TPOT within their targets."""
    if m.error is not None or not m.points or any(not p.ttft_ms for p in m.points.values()):
        return Score(False, 0.0, float("inf"), failed=True)
    ratios = [0.0]
    for p in m.points.values():
        if slo.ttft_p95_ms is not None:
            ratios.append((p.ttft_p95 or 0.0) / slo.ttft_p95_ms)
        if slo.tpot_p90_ms is not None and p.tpot_p90 is not None:
            ratios.append(p.tpot_p90 / slo.tpot_p90_ms)
    excess = max(ratios) - 1.0
    errors = sum(p.errors for p in m.points.values())
    return Score(excess <= 0 and errors == 0, m.throughput(), excess)


def median_rate(points: list[Point]) -> float:
    """Median over repetitions of (tokens of these points) / (their wall time); every
    repetition runs every point once, so the i-th entries belong together."""
    n = min((len(p.rep_wall_s) for p in points), default=0)
    rates = []
    for i in range(n):
        wall = sum(p.rep_wall_s[i] for p in points)
        if wall > 0:
            rates.append(sum(p.rep_tokens[i] for p in points) / wall)
    return statistics.median(rates) if rates else 0.0


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None
