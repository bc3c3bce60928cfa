"""Why a configuration misses a target: prefill-bound or decode-bound, in figures;
and why speculative decoding was or was not chosen, from its TPOT with and without.

TTFT is queueing plus prefill; with C prompts arriving together the last one
waits for the others' prefill too, so the prefill rate the target needs is
C x L tokens within the TTFT target. TPOT is one decode step per token; steps
that also carry another request's prompt chunk ("mixed") stretch it. The
phase telemetry says how fast each phase ran and how busy the GPU (or this
process's CPU) was meanwhile, which separates "the hardware is saturated"
from "something else holds it back" (pitfall 3: a CPU-side bottleneck).
"""

from __future__ import annotations

from collections.abc import Mapping

import psutil

from orin.profile.schema import SLOSection
from orin.tune.figures import Measurement, PhaseFigures, Point
from orin.tune.space import Candidate
from orin.tune.speculation import (
    MIN_GAIN,
    SpecChoice,
    acceptance,
    median_tpot,
    tpot_gain,
    why_not,
)

SATURATED = 0.8  # utilization from which a phase counts as using its hardware fully


def _rate(f: PhaseFigures | None) -> float | None:
    return f.tokens / f.seconds if f is not None and f.seconds > 0 and f.tokens else None


def utilization(f: PhaseFigures | None, threads: int) -> tuple[str, bool | None]:
    """A phrase for how busy the hardware was, and whether that is saturation."""
    if f is None:
        return "no telemetry", None
    if f.gpu_util is not None:
        return f"GPU busy {f.gpu_util:.0%}", f.gpu_util >= SATURATED
    if f.cpu_util is not None:
        cores = f.cpu_util * (psutil.cpu_count() or 1)
        return (
            f"this process used {cores:.1f} cores for {threads} llama.cpp threads "
            "(CPU telemetry: no GPU figures here)",
            cores >= SATURATED * threads,
        )
    return "no utilization figures", None


def worst_point(m: Measurement, metric: str) -> Point | None:
    """The point where ``metric`` (a Point attribute: ttft_p95, tpot_p90) is highest,
    among those that measured it; None when none did."""
    pts = [p for p in m.points.values() if getattr(p, metric) is not None]
    return max(pts, key=lambda p: getattr(p, metric)) if pts else None


def _ttft(m: Measurement, p: Point, goal: float) -> str:
    f = m.phases.get("prefill")
    rate = _rate(f)
    queue = sum(p.queue_ms) / len(p.queue_ms) if p.queue_ms else 0.0
    own = sum(p.prefill_ms) / len(p.prefill_ms) if p.prefill_ms else 0.0
    util, saturated = utilization(f, m.candidate.threads)
    need = p.concurrency * p.prompt_tokens / (goal / 1e3)
    text = (
        f"TTFT_p95 at {p.prompt_tokens} prompt tokens x {streams(p.concurrency)} is "
        f"{p.ttft_p95:.0f} ms against {goal:g} ms: prefill-bound (mean {queue:.0f} ms "
        f"waiting for other prompts, {own:.0f} ms of its own prefill)"
    )
    if rate is not None:
        text += f"; prefill ran at {rate:.0f} tokens/s, the target needs about {need:.0f}"
    return text + f"; {util}" + _verdict(saturated, "prefill")


def _tpot(m: Measurement, p: Point, goal: float) -> str:
    f = m.phases.get("decode")
    util, saturated = utilization(f, m.candidate.threads)
    text = (
        f"TPOT_p90 at {p.prompt_tokens} prompt tokens x {streams(p.concurrency)} is "
        f"{p.tpot_p90:.1f} ms against {goal:g} ms: decode-bound"
    )
    rate = _rate(f)
    if rate is not None:
        text += f"; decode produced {rate:.0f} tokens/s over all streams"
    if f is not None and f.mixed_share > 0.05:
        text += (
            f"; {f.mixed_share:.0%} of decode time was in steps that also carried a prompt "
            "chunk, which stretches TPOT (a smaller n_batch bounds it)"
        )
    return text + f"; {util}" + _verdict(saturated, "decode")


def _verdict(saturated: bool | None, phase: str) -> str:
    if saturated is None:
        return ""
    if saturated:
        return (
            f". The hardware is saturated in {phase}: only a smaller or more quantized model, "
            "fewer concurrent streams or a looser target gets there"
        )
    return (
        f". The hardware is not saturated in {phase}: something else holds it back "
        "(threads competing for the CPU, a CPU-only llama.cpp build, attention on the CPU)"
    )


def explain(m: Measurement, slo: SLOSection) -> list[str]:
    """One sentence per target the measurement misses (empty when all are met)."""
    out = []
    if slo.ttft_p95_ms is not None:
        p = worst_point(m, "ttft_p95")
        if p is not None and (p.ttft_p95 or 0.0) > slo.ttft_p95_ms:
            out.append(_ttft(m, p, slo.ttft_p95_ms))
    if slo.tpot_p90_ms is not None:
        p = worst_point(m, "tpot_p90")
        if p is not None and (p.tpot_p90 or 0.0) > slo.tpot_p90_ms:
            out.append(_tpot(m, p, slo.tpot_p90_ms))
    return out


def _median_tpot(m: Measurement) -> str:
    tpot = median_tpot(m)
    return "-" if tpot is None else f"{tpot:.3g} ms"  # tiny models decode in 0.1 ms


def _spec_figures(m: Measurement) -> str:
    worst, acc = worst_point(m, "tpot_p90"), acceptance(m)
    text = f"median TPOT {_median_tpot(m)}"
    if worst is not None and worst.tpot_p90 is not None:
        text += f", worst TPOT_p90 {worst.tpot_p90:.1f} ms"
    text += f", {m.throughput():.1f} tokens/s"
    if acc is not None:
        text += f", {acc:.0%} of drafted tokens accepted"
    return text + f" ({m.reps} repetition{'' if m.reps == 1 else 's'})"


def speculation(
    choice: SpecChoice, results: Mapping[Candidate, Measurement], slo: SLOSection
) -> list[str]:
    """The verdict on speculative decoding, then each measured setting's figures and the
    workload they come from."""
    inc = results[choice.incumbent]
    own = choice.incumbent.speculation.label
    lines = []
    if choice.changed:
        m = results[choice.chosen]
        gain = tpot_gain(m, inc)
        change = "" if gain is None else f"{gain:.0%} lower, "
        lines.append(
            f"speculative decoding {choice.chosen.speculation.label} chosen over the "
            f"profile's {own}: median TPOT {change}{_median_tpot(m)} with "
            f"{choice.chosen.speculation.label}, {_median_tpot(inc)} with {own}"
        )
    elif not choice.trials:
        skipped = ", ".join(s.label for s in choice.skipped)
        budget = f": the budget left no time to try {skipped or 'another setting'}"
        lines.append(
            f"speculative decoding stays {own} (the profile's)"
            f"{budget if skipped or not choice.unfit else ''}"
        )
    else:
        reasons = "; ".join(
            f"{t.candidate.speculation.label}: {why_not(results[t.candidate], inc, slo)}"
            for t in choice.trials
        )
        lines.append(
            f"speculative decoding stays {own} (the profile's; a change needs a "
            f"{MIN_GAIN:.0%} lower median TPOT): {reasons}"
        )
    for c in choice.measured:
        m = results[c]
        state = f"failed: {m.error}" if m.error else _spec_figures(m)
        lines.append(f"{c.speculation.label}: {state}")
    if choice.skipped and choice.trials:
        lines.append(f"not tried (budget): {', '.join(s.label for s in choice.skipped)}")
    if choice.unfit:
        lines.append(
            "not tried (the draft model's weights and cache would not fit in the available "
            f"memory beside the chosen configuration): {', '.join(s.label for s in choice.unfit)}"
        )
    lines.append(
        f"measured on {choice.workload}. N-gram drafts are accepted where the output "
        "repeats its context: copying, quoting, editing and code gain the most, free text "
        "little (at a cost of a few % at most); a greedy continuation of random words often "
        "repeats itself, so the gain here can exceed that on free text with sampling"
    )
    return lines


def streams(n: int) -> str:
    """'1 stream', '4 streams'."""
    return f"{n} stream{'' if n == 1 else 's'}"
