"""Attribute telemetry samples to the phase the engine was in when they were taken.

Samples and engine steps share one clock (time.perf_counter_ns). A sample
inside a prefill-only step counts for prefill, inside a decode-only step for
decode, and outside any step for idle. A sample inside a mixed step (decode
tokens and prompt chunks in one batch) is split between prefill and decode by
the step's token shares, and the share of such samples is reported, so a
reader knows how much of a figure is apportioned rather than observed. A step
that encodes images does so first (``encode_ns`` of it): a sample in that part
counts for the encode phase.
Boundaries: a step covers [start, end); a sample exactly at an end belongs to
whatever comes next.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from orin.telemetry.power import board_power_mw

Phase = Literal["prefill", "decode", "encode", "idle"]
PHASES: tuple[Phase, ...] = ("prefill", "decode", "encode", "idle")
METRICS = ("gpu_util", "emc_util", "cpu_util", "proc_cpu_util")


class SampleLike(Protocol):
    @property
    def t_ns(self) -> int: ...

    @property
    def gpu_util(self) -> float | None: ...

    @property
    def emc_util(self) -> float | None: ...

    @property
    def cpu_util(self) -> float | None: ...

    @property
    def proc_cpu_util(self) -> float | None: ...

    @property
    def power_mw(self) -> dict[str, float]: ...


class StepLike(Protocol):
    @property
    def start_ns(self) -> int: ...

    @property
    def end_ns(self) -> int: ...

    @property
    def prefill_tokens(self) -> int: ...

    @property
    def decode_tokens(self) -> int: ...


@dataclass(frozen=True)
class Share:
    phase: Phase
    weight: float
    mixed: bool = False


def prompt_tokens(step: StepLike) -> int:
    """A step's prompt processing: its prefill tokens plus the inputs of an embedding
    pass (``embedded_tokens``, which a step from an older recording lacks)."""
    return step.prefill_tokens + int(getattr(step, "embedded_tokens", 0))


def _aborted(step: StepLike) -> bool:
    return bool(getattr(step, "aborted", False))


def generated_tokens(step: StepLike) -> int:
    """The tokens a step's decode rows generated: its decode tokens less the drafted
    ones the model rejected (``drafted_tokens`` and ``accepted_tokens``, which a step
    without speculation, or from an older recording, lacks). An aborted step's batch
    was discarded: it generated nothing."""
    if _aborted(step):
        return 0
    drafted = int(getattr(step, "drafted_tokens", 0))
    accepted = int(getattr(step, "accepted_tokens", 0))
    return max(step.decode_tokens - drafted + accepted, 0)


def phase_shares(step: StepLike | None, t_ns: int | None = None) -> tuple[Share, ...]:
    """How one sample taken at ``t_ns`` during ``step`` (None: between steps) divides
    among phases; an embedding pass counts as prefill, the image encoding at the start
    of a step (its ``encode_ns``) as encode."""
    if step is None:
        return (Share("idle", 1.0),)
    encode = int(getattr(step, "encode_ns", 0))
    if encode and t_ns is not None and t_ns < step.start_ns + encode:
        return (Share("encode", 1.0),)
    p, d = prompt_tokens(step), step.decode_tokens
    if p and d:
        w = p / (p + d)
        return (Share("prefill", w, True), Share("decode", 1.0 - w, True))
    if p:
        return (Share("prefill", 1.0),)
    if d:
        return (Share("decode", 1.0),)
    return (Share("idle", 1.0),)


class StepIndex:
    """Steps sorted by start, for finding the one covering an instant."""

    def __init__(self, steps: Sequence[StepLike]) -> None:
        self.steps = sorted(steps, key=lambda s: s.start_ns)
        self.starts = [s.start_ns for s in self.steps]

    def at(self, t_ns: int) -> StepLike | None:
        i = bisect.bisect_right(self.starts, t_ns) - 1
        if i >= 0 and t_ns < self.steps[i].end_ns:
            return self.steps[i]
        return None


@dataclass(frozen=True)
class Stats:
    """Weighted summary of one metric in one phase."""

    samples: float  # weighted sample count
    mean: float
    p95: float
    max: float


def weighted_stats(values: Sequence[float], weights: Sequence[float]) -> Stats | None:
    pairs = sorted((v, w) for v, w in zip(values, weights, strict=True) if w > 0)
    total = sum(w for _, w in pairs)
    if not pairs or total <= 0:
        return None
    mean = sum(v * w for v, w in pairs) / total
    target, acc, p95 = 0.95 * total, 0.0, pairs[-1][0]
    for v, w in pairs:
        acc += w
        if acc >= target - 1e-12:
            p95 = v
            break
    return Stats(samples=total, mean=mean, p95=p95, max=pairs[-1][0])


@dataclass
class PhaseSummary:
    phase: Phase
    seconds: float = 0.0
    tokens: int = 0
    mixed_share: float = 0.0  # of this phase's sample weight, the part from mixed steps
    energy_j: float | None = None
    stats: dict[str, Stats] = field(default_factory=dict)

    @property
    def energy_per_token_j(self) -> float | None:
        if self.energy_j is None or not self.tokens:
            return None
        return self.energy_j / self.tokens

    def to_dict(self) -> dict[str, object]:
        return {
            "seconds": self.seconds,
            "tokens": self.tokens,
            "mixed_share": self.mixed_share,
            "energy_j": self.energy_j,
            "energy_per_token_j": self.energy_per_token_j,
            **{k: vars(v) for k, v in self.stats.items()},
        }


def _sides(samples: Sequence[SampleLike]) -> list[tuple[float, float]]:
    """Seconds each sample stands for on each side: half the gap to that neighbour (the
    end samples mirror their one neighbour's gap)."""
    ts = [s.t_ns for s in samples]
    if len(ts) < 2:
        return [(0.0, 0.0)] * len(ts)
    out = []
    for i, t in enumerate(ts):
        lo = ts[i - 1] if i > 0 else t - (ts[1] - ts[0])
        hi = ts[i + 1] if i < len(ts) - 1 else t + (ts[-1] - ts[-2])
        out.append(((t - lo) / 2 * 1e-9, (hi - t) / 2 * 1e-9))
    return out


def _full_rate_period(samples: Sequence[SampleLike], index: StepIndex) -> float:
    """The sampler's full-rate period: the median gap between samples inside steps
    (the median, so a late tick and the on-time one after it do not set it)."""
    pairs = list(itertools.pairwise(samples))
    inside = [b.t_ns - a.t_ns for a, b in pairs if index.at(a.t_ns) and index.at(b.t_ns)]
    gaps = sorted(g for g in inside or [b.t_ns - a.t_ns for a, b in pairs] if g > 0)
    return gaps[len(gaps) // 2] * 1e-9 if gaps else 0.0


def summarize(
    samples: Sequence[SampleLike],
    steps: Sequence[StepLike],
    span: tuple[int, int] | None = None,
) -> dict[Phase, PhaseSummary]:
    """Per phase: time, tokens, mixed share, energy and weighted stats of every metric.

    ``span`` (start, end in ns): the time the samples stand for ends there, so that a
    window's phases add up to the window (the first sample of an idle-rate window
    would otherwise stand for half a second before it, the last for half a second
    after it); None: each end sample stands for half its gap on its open side too."""
    ordered = sorted(samples, key=lambda s: s.t_ns)
    index = StepIndex(steps)
    period = _full_rate_period(ordered, index)
    out = {p: PhaseSummary(p) for p in PHASES}
    values: dict[tuple[Phase, str], tuple[list[float], list[float]]] = {}
    weight_total: dict[Phase, float] = dict.fromkeys(PHASES, 0.0)
    weight_mixed: dict[Phase, float] = dict.fromkeys(PHASES, 0.0)
    sides = _sides(ordered)
    if span is not None:
        start, end = span
        sides = [
            (min(lo, max(s.t_ns - start, 0) * 1e-9), min(hi, max(end - s.t_ns, 0) * 1e-9))
            for s, (lo, hi) in zip(ordered, sides, strict=True)
        ]
    for sample, (lo, hi) in zip(ordered, sides, strict=True):
        power = board_power_mw(sample.power_mw)
        step = index.at(sample.t_ns)
        # inside a step the sampler runs at its full rate: a sample next to an idle-rate
        # gap (the first of a request) stands for at most a period on that side
        dt = lo + hi if step is None else min(lo, period) + min(hi, period)
        for share in phase_shares(step, sample.t_ns):
            summary = out[share.phase]
            summary.seconds += dt * share.weight
            weight_total[share.phase] += share.weight
            weight_mixed[share.phase] += share.weight if share.mixed else 0.0
            if power is not None:
                summary.energy_j = (summary.energy_j or 0.0) + power * 1e-3 * dt * share.weight
            for metric in METRICS:
                v = getattr(sample, metric)
                if v is not None:
                    vs, ws = values.setdefault((share.phase, metric), ([], []))
                    vs.append(v)
                    ws.append(share.weight)
    for (phase, metric), (vs, ws) in values.items():
        st = weighted_stats(vs, ws)
        if st is not None:
            out[phase].stats[metric] = st
    for phase in PHASES:
        if weight_total[phase]:
            out[phase].mixed_share = weight_mixed[phase] / weight_total[phase]
    # tokens: what the steps delivered, prompt tokens prefilled and tokens generated
    # (drafts the model rejected were computed, not generated; an aborted step's
    # batch was discarded), so that energy per token is per generated token
    out["prefill"].tokens = sum(prompt_tokens(s) for s in index.steps if not _aborted(s))
    out["decode"].tokens = sum(generated_tokens(s) for s in index.steps)
    return out


def window_stats(
    samples: Sequence[SampleLike],
    start_ns: int,
    end_ns: int,
    metric: str = "gpu_util",
    select: Callable[[SampleLike], bool] | None = None,
) -> Stats | None:
    """Unweighted stats of one metric over the samples in [start_ns, end_ns]: what one
    request saw during its own prefill or decode window."""
    vals = [
        v
        for s in samples
        if start_ns <= s.t_ns <= end_ns and (select is None or select(s))
        for v in [getattr(s, metric)]
        if v is not None
    ]
    return weighted_stats(vals, [1.0] * len(vals))
