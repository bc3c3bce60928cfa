"""Speculative decoding: tried on the search's winner, and kept only when it clearly
speeds decoding.

Why a refinement of the winner rather than an axis of the grid: speculation
changes how fast decode steps produce tokens and nothing the other axes trade
against (prompt chunks, KV precision and memory, the threads' split between
prefill and decode). On a given configuration it acts close to a factor on
TPOT, so the configuration that wins without it is, within noise, the one
that wins with it. Crossing the grid with three or four speculation settings
would triple its size and, within the same budget, shrink the seeded subset
of the first round; trying them on the winner costs a few measurements. The
search gets the measuring budget less ``SPEC_SHARE`` for them (what it leaves
unspent is theirs too).

The grid's candidates carry the profile's own setting, so the search's "before"
is what the profile runs. ``refine`` then measures the winner with every other
setting of ``space.speculation_options``, in that order, at the winner's
repetition count, or at the largest lower one of the search's levels that the
remaining budget holds (the report gives the counts); what does not fit is
skipped and named. ``decide`` keeps the profile's setting unless another one
``beats`` it:

- a failed measurement never wins;
- a speculating setting none of whose drafts was accepted (or that drafted
  nothing) never wins: every token it produced took a decode step as with
  ``off``, drafting added work, so a lower TPOT or an SLO met is noise (on a
  shared machine, several % between two measurements of one configuration);
- one that meets the SLO beats one that does not;
- otherwise the median TPOT over every measured request must be at least
  ``MIN_GAIN`` (5 %) lower, without costing the search's own ranking more than
  ``NOISE`` (2 %): throughput at the highest SLO concurrency when both meet
  the SLO, the distance to the targets when both miss. Speculation can shorten
  TPOT at one stream and lengthen it at several, where verifying drafts
  competes with the other streams for the same step.

Among the settings that beat it, the one with the lowest median TPOT. A change
in either direction needs this evidence: a profile that speculates keeps it
unless ``off`` is clearly faster.

The workload decides the gain. N-gram drafts are accepted where the output
repeats its own context: copying, quoting, editing and code gain a lot, free
text little, and there speculation costs at most a few % (a request whose
drafts are mostly rejected stops drafting after ``speculative.probation``
tokens). Tune has no prompts of the user's and measures the standard workload
(``measure.workload``: prompts of random words, nothing to quote). A greedy
continuation of such a prompt often repeats itself, which n-gram drafts catch
(SmolLM2-135M on a CPU: about 80 % of drafts accepted, median TPOT a quarter
lower), so the verdict can be kinder than free text with sampling deserves and
less kind than a copying task; the report says what it was measured on.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from orin.profile.schema import SLOSection
from orin.tune.figures import Measurement, score
from orin.tune.search import Evaluation, Trial
from orin.tune.space import Candidate, Speculation

MIN_GAIN = 0.05  # median TPOT this much lower, or the setting stays the profile's
NOISE = 0.02  # what the search's own objective may lose to it (measurement noise)
SPEC_SHARE = 0.2  # of the measuring budget, kept from the search for the refinement


@dataclass
class SpecChoice:
    """The refinement's outcome: what was measured and which setting the tuned profile
    keeps."""

    incumbent: Candidate  # the search's winner, with the profile's own setting
    chosen: Candidate
    workload: str
    trials: list[Trial[Candidate]] = field(default_factory=list)
    skipped: list[Speculation] = field(default_factory=list)  # left out by the budget
    # left out because the winner with them would not fit in the available memory
    unfit: list[Speculation] = field(default_factory=list)
    spent_s: float = 0.0

    @property
    def measured(self) -> list[Candidate]:
        """The incumbent, then every setting tried on it."""
        return [self.incumbent, *(t.candidate for t in self.trials)]

    @property
    def changed(self) -> bool:
        return self.chosen != self.incumbent

    def to_dict(self) -> dict[str, Any]:
        return {
            "incumbent": self.incumbent.speculation.label,
            "chosen": self.chosen.speculation.label,
            "workload": self.workload,
            "min_gain": MIN_GAIN,
            "tried": [_tried(t) for t in self.trials],
            "skipped": [s.label for s in self.skipped],
            "unfit": [s.label for s in self.unfit],
            "spent_s": self.spent_s,
        }


def _tried(t: Trial[Candidate]) -> dict[str, Any]:
    return {"speculation": t.candidate.speculation.label, "fidelity": t.fidelity,
            "cost_s": t.cost_s, **t.score.to_dict()}  # fmt: skip


def median_tpot(m: Measurement) -> float | None:
    """Median TPOT over every request of every grid point (ms); None without any."""
    values = [v for p in m.points.values() for v in p.tpot_ms]
    return statistics.median(values) if values else None


def acceptance(m: Measurement) -> float | None:
    """Share of drafted tokens the model confirmed; None when nothing was drafted."""
    drafted = sum(p.drafted for p in m.points.values())
    return sum(p.accepted for p in m.points.values()) / drafted if drafted else None


def tpot_gain(m: Measurement, ref: Measurement) -> float | None:
    """How much lower ``m``'s median TPOT is than ``ref``'s (0.1: 10 % lower)."""
    a, b = median_tpot(m), median_tpot(ref)
    return None if a is None or b is None or b <= 0 else 1.0 - a / b


def _idle(m: Measurement) -> bool:
    """Whether ``m`` speculates and not one drafted token was accepted: it decoded as
    ``off`` would, so nothing it measured differently is speculation's doing."""
    return m.candidate.speculative != "off" and not sum(p.accepted for p in m.points.values())


def _diff(m: Measurement, ref: Measurement) -> str:
    gain = tpot_gain(m, ref)
    return "difference" if gain is None else f"{-gain:+.1%}"


def beats(m: Measurement, ref: Measurement, slo: SLOSection, min_gain: float = MIN_GAIN) -> bool:
    """Whether ``m``'s setting should replace ``ref``'s (the rules in the module text)."""
    a, b = score(m, slo), score(ref, slo)
    if a.failed or b.failed:
        return not a.failed
    if _idle(m):
        return False
    if a.meets_slo != b.meets_slo:
        return a.meets_slo
    gain = tpot_gain(m, ref)
    if gain is None or gain < min_gain:
        return False
    if a.meets_slo:
        return a.throughput >= (1.0 - NOISE) * b.throughput
    return 1.0 + a.excess <= (1.0 + b.excess) * (1.0 + NOISE)


def why_not(m: Measurement, ref: Measurement, slo: SLOSection) -> str:
    """Why ``m``'s setting did not replace ``ref``'s, in words ('' when it did)."""
    if beats(m, ref, slo):
        return ""
    a, b = score(m, slo), score(ref, slo)
    if a.failed:
        return f"it failed ({m.error})" if m.error else "it failed"
    if _idle(m):
        drafted = (
            "none of its drafted tokens was accepted"
            if acceptance(m) is not None
            else "it drafted nothing"
        )
        return f"{drafted}, so it decoded as off does (its TPOT {_diff(m, ref)} is noise)"
    if a.meets_slo != b.meets_slo:
        return "it misses the SLO"
    gain = tpot_gain(m, ref)
    if gain is None:
        return "no TPOT was measured"
    if gain < MIN_GAIN:
        return f"median TPOT {-gain:+.1%} (a change needs {-MIN_GAIN:.0%} or lower)"
    if a.meets_slo and b.throughput > 0:
        return f"throughput at the highest concurrency {a.throughput / b.throughput - 1:+.0%}"
    return f"its worst point is {a.excess:+.0%} over target against {b.excess:+.0%}"


def decide(
    incumbent: Measurement,
    others: Sequence[Measurement],
    slo: SLOSection,
    min_gain: float = MIN_GAIN,
) -> Measurement:
    """The measurement whose setting is kept: the incumbent unless others beat it."""
    better = [m for m in others if beats(m, incumbent, slo, min_gain)]
    if not better:
        return incumbent

    def rank(m: Measurement) -> tuple[bool, float]:
        return (not score(m, slo).meets_slo, median_tpot(m) or float("inf"))

    return min(better, key=rank)


def fidelity_for(
    levels: Sequence[int], top: int, unit_s: float, left_s: float, fixed_s: float = 0.0
) -> int | None:
    """The most repetitions up to ``top``, among the search's levels, that ``left_s``
    seconds hold at ``fixed_s`` (a load) plus ``unit_s`` per repetition; None when not
    even the fewest fit."""
    for f in sorted({lv for lv in levels if lv <= top} | {top}, reverse=True):
        if fixed_s + unit_s * f <= left_s:
            return f
    return None


def refine(
    winner: Candidate,
    options: Sequence[Speculation],
    evaluate: Callable[[Candidate, int], Evaluation],
    results: Mapping[Candidate, Measurement],
    slo: SLOSection,
    levels: Sequence[int],
    budget_s: float,
    workload: str,
    on_trial: Callable[[Trial[Candidate]], None] | None = None,
    fits: Callable[[Candidate], bool] | None = None,
    cost: tuple[float, float] | None = None,
) -> SpecChoice:
    """Measure ``winner`` with each other setting of ``options`` within ``budget_s``
    and decide. ``results`` holds the measurements ``evaluate`` makes (the winner's
    among them); a measurement is predicted to cost ``cost``'s load plus its
    repetitions (the search's ``cost_model``), else the winner's cost per repetition,
    loads included. A setting with which the winner would not ``fit`` in memory (a
    draft model beside it) is not measured."""
    out = SpecChoice(winner, winner, workload)
    have = results[winner]
    fixed, unit = cost if cost is not None else (0.0, have.cost_s / max(have.reps, 1))
    for s in options:
        c = winner.with_speculation(s)
        if c == winner:
            continue
        if fits is not None and not fits(c):
            out.unfit.append(s)
            continue
        fid = fidelity_for(levels, have.reps, unit, budget_s - out.spent_s, fixed)
        if fid is None:
            out.skipped.append(s)
            continue
        ev = evaluate(c, fid)
        out.spent_s += ev.cost_s
        trial = Trial(c, fid, len(levels), ev.score, ev.cost_s)
        out.trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
    others = [results[t.candidate] for t in out.trials]
    out.chosen = decide(have, others, slo).candidate
    return out
