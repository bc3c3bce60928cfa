"""Successive halving within a time budget: short runs for all, longer runs for the best.

Pure: the caller passes ``evaluate(candidate, fidelity) -> Evaluation``, where
fidelity is the total number of measurement repetitions wanted so far (an
evaluator may keep earlier repetitions and only add the difference) and the
evaluation says what it cost. Costs are summed against the budget, so a
synthetic cost model tests the search exactly, without a clock.

Rounds use fidelities min, min*eta, min*eta^2, ... up to max; after each
round the best 1/eta go on. The first round is sized to the budget as it
goes: before each of its evaluations the costs so far predict the whole
schedule's, and the round ends (the candidates left out in seeded random
order) when one more candidate would not fit. An evaluation costs a fixed
part (``Evaluation.fixed_s``: loading the configuration) plus a part per
added repetition; the prediction takes the median of each over the
evaluations so far, so neither the fixed part counted once per repetition
nor one slow evaluation (the first load reads the model from disk) shrinks
the plan to a fraction of what the budget holds. No evaluation starts that
the prediction says would overrun the budget.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from orin.errors import Terminated, interruption

C = TypeVar("C")


@dataclass(frozen=True)
class Score:
    """How good a measured configuration is: meeting the SLOs first, then throughput;
    among those that miss, the one closest to its targets."""

    meets_slo: bool
    throughput: float  # generated tokens/s
    excess: float  # worst measured/target ratio minus 1; <= 0 when every target is met
    failed: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON takes them: a failed measurement's excess is infinite,
        which JSON has no number for (``Infinity`` is refused by strict parsers)."""
        excess = self.excess if math.isfinite(self.excess) else None
        return {"meets_slo": self.meets_slo, "throughput": self.throughput,
                "excess": excess, "failed": self.failed}  # fmt: skip

    def key(self) -> tuple[int, float]:
        if self.failed:
            return (-1, 0.0)
        if self.meets_slo:
            return (1, self.throughput)
        return (0, -self.excess)


@dataclass(frozen=True)
class Evaluation:
    score: Score
    cost_s: float  # what this call cost (seconds of measuring, or synthetic units)
    fixed_s: float = 0.0  # the part of cost_s that does not grow with repetitions (a load)


@dataclass(frozen=True)
class Trial(Generic[C]):
    candidate: C
    fidelity: int
    round: int
    score: Score
    cost_s: float
    fixed_s: float = 0.0


@dataclass
class SearchResult(Generic[C]):
    best: C | None
    best_score: Score | None
    best_fidelity: int
    trials: list[Trial[C]]
    spent_s: float
    budget_s: float
    fidelities: tuple[int, ...]
    first_round: int  # candidates in round 0 (fewer than offered when the budget is short)
    stopped: str = ""  # why the schedule ended early, if it did
    finalists: list[C] = field(default_factory=list)


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, as ``Terminated``) during the search: still a
    KeyboardInterrupt, carrying what was measured before it (``partial``, its best
    chosen as when the budget cuts a round short) and what stopped it (``by``:
    ``Ctrl-C`` or ``SIGTERM``)."""

    def __init__(self, partial: SearchResult[Any], by: str = "Ctrl-C") -> None:
        super().__init__()
        self.partial, self.by = partial, by


def fidelity_levels(lo: int, hi: int, eta: int) -> tuple[int, ...]:
    levels = [lo]
    while levels[-1] * eta <= hi:
        levels.append(levels[-1] * eta)
    return tuple(levels)


def plan_cost(n0: int, unit: float, levels: Sequence[int], eta: int, fixed: float = 0.0) -> float:
    """Predicted cost of the whole schedule with ``n0`` first-round candidates, when an
    evaluation costs ``fixed`` plus ``unit`` per added repetition."""
    total, n, done = 0.0, n0, 0
    for f in levels:
        total += n * (fixed + unit * (f - done))
        n, done = max(1, math.ceil(n / eta)), f
    return total


def first_round_size(
    n: int, unit: float, levels: Sequence[int], eta: int, budget: float, fixed: float = 0.0
) -> int:
    for n0 in range(n, 0, -1):
        if plan_cost(n0, unit, levels, eta, fixed) <= budget:
            return n0
    return 1


def cost_model(trials: Sequence[Trial[Any]], levels: Sequence[int]) -> tuple[float, float]:
    """(fixed, per repetition) cost of an evaluation: the medians over ``trials``."""
    fixed = statistics.median(t.fixed_s for t in trials)
    unit = statistics.median(
        (t.cost_s - t.fixed_s) / max(t.fidelity - (levels[t.round - 1] if t.round else 0), 1)
        for t in trials
    )
    return fixed, unit


def successive_halving(
    candidates: Sequence[C],
    evaluate: Callable[[C, int], Evaluation],
    budget_s: float,
    min_fidelity: int = 1,
    max_fidelity: int = 9,
    eta: int = 3,
    seed: int = 0,
    first: C | None = None,
    on_trial: Callable[[Trial[C]], None] | None = None,
) -> SearchResult[C]:
    """Search ``candidates``; ``first`` (e.g. the current configuration) is always in the
    first round. Returns the best of the last round measured (of the candidates it reached, when
    the budget cut it short)."""
    levels = fidelity_levels(min_fidelity, max_fidelity, eta)
    order = list(candidates)
    random.Random(seed).shuffle(order)
    if first is not None:
        order = [first, *[c for c in order if c != first]]
    res: SearchResult[C] = SearchResult(None, None, 0, [], 0.0, budget_s, levels, len(order))
    alive, done, rnd = order, 0, 0
    try:
        for rnd, fid in enumerate(levels):
            scored = _round(alive, evaluate, fid, done, rnd, res, eta, on_trial)
            if not scored:
                res.stopped = res.stopped or (
                    f"the budget ran out before round {rnd + 1} of {len(levels)}"
                )
                break
            _rank(res, scored, fid)
            if len(scored) < len(alive):
                res.stopped = res.stopped or f"the budget cut round {rnd} short"
                break
            alive, done = [c for c, _ in scored[: max(1, math.ceil(len(scored) / eta))]], fid
    except (KeyboardInterrupt, Terminated) as exc:
        if res.trials:  # the round it reached decides, as when the budget cuts it short
            last = res.trials[-1]
            reached = [(t.candidate, t.score) for t in res.trials if t.round == last.round]
            _rank(res, reached, last.fidelity)
        n = len(res.trials)
        by = interruption(exc)
        res.stopped = f"interrupted ({by}) in round {rnd}, after {n} measurement{'s' * (n != 1)}"
        raise SearchInterrupted(res, by) from None
    return res


def _rank(res: SearchResult[C], scored: list[tuple[C, Score]], fid: int) -> None:
    """Sort a round's scores, best first, and make its best the search's."""
    scored.sort(key=lambda t: t[1].key(), reverse=True)
    res.best, res.best_score, res.best_fidelity = scored[0][0], scored[0][1], fid
    res.finalists = [c for c, _ in scored]


def _round(
    alive: list[C],
    evaluate: Callable[[C, int], Evaluation],
    fid: int,
    done: int,
    rnd: int,
    res: SearchResult[C],
    eta: int,
    on_trial: Callable[[Trial[C]], None] | None,
) -> list[tuple[C, Score]]:
    """Evaluate one round's candidates at ``fid`` while the predicted cost fits; the
    first round while the whole schedule, one more candidate in it, fits."""
    scored: list[tuple[C, Score]] = []
    step = fid - done
    for i, c in enumerate(alive):
        if rnd == 0 and i > 0 and _first_round_full(res, len(alive), i, eta):
            del alive[i:]
            break
        predicted = _predict(res, step)
        if predicted is not None and res.spent_s + predicted > res.budget_s:
            break
        ev = evaluate(c, fid)
        res.spent_s += ev.cost_s
        trial = Trial(c, fid, rnd, ev.score, ev.cost_s, min(ev.fixed_s, ev.cost_s))
        res.trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        scored.append((c, ev.score))
    if rnd == 0:
        res.first_round = len(alive)
    return scored


def _first_round_full(res: SearchResult[C], offered: int, measured: int, eta: int) -> bool:
    """Whether the first round should end at ``measured`` candidates: the schedule
    with one more, its measured ones at their predicted cost, would overrun."""
    fixed, unit = cost_model(res.trials, res.fidelities)
    levels = res.fidelities
    reached = res.budget_s - res.spent_s + measured * (fixed + unit * levels[0])
    return first_round_size(offered, unit, levels, eta, reached, fixed) <= measured


def _predict(res: SearchResult[C], step: int) -> float | None:
    """Expected cost of the next evaluation, ``step`` repetitions more than the
    candidate has: the cost model of the evaluations so far."""
    if not res.trials:
        return None
    fixed, unit = cost_model(res.trials, res.fidelities)
    return fixed + unit * step
