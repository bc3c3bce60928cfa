"""Successive halving within a time budget: short runs for all, longer runs for the best.

Pure: the caller passes ``evaluate(candidate, fidelity) -> Evaluation``, where
fidelity is the total number of measurement repetitions wanted so far (an
evaluator may keep earlier repetitions and only add the difference) and the
evaluation says what it cost. Costs are summed against the budget, so a
synthetic cost model tests the search exactly, without a clock.

Rounds use fidelities min, min*eta, min*eta^2, ... up to max; after each
round the best 1/eta go on. Before the first round the plan is sized to the
budget: from the cost of the first evaluation it predicts every round's cost
(assuming cost grows with the added repetitions, which overestimates when
part of the cost is fixed) and drops candidates from the first round, in
seeded random order, until the plan fits. No evaluation starts that the
prediction says would overrun the budget.
"""

from __future__ import annotations

import math
import random
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


@dataclass(frozen=True)
class Trial(Generic[C]):
    candidate: C
    fidelity: int
    round: int
    score: Score
    cost_s: float


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


def plan_cost(n0: int, unit: float, levels: Sequence[int], eta: int) -> float:
    """Predicted cost of the whole schedule with ``n0`` first-round candidates, when one
    repetition of one candidate costs ``unit``."""
    total, n, done = 0.0, n0, 0
    for f in levels:
        total += n * unit * (f - done)
        n, done = max(1, math.ceil(n / eta)), f
    return total


def first_round_size(n: int, unit: float, levels: Sequence[int], eta: int, budget: float) -> int:
    for n0 in range(n, 0, -1):
        if plan_cost(n0, unit, levels, eta) <= budget:
            return n0
    return 1


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
    """Evaluate one round's candidates at ``fid`` while the predicted cost fits."""
    scored: list[tuple[C, Score]] = []
    costs: list[float] = []
    step = fid - done
    for i, c in enumerate(alive):
        predicted = _predict(res, costs, step)
        if predicted is not None and res.spent_s + predicted > res.budget_s:
            break
        ev = evaluate(c, fid)
        res.spent_s += ev.cost_s
        costs.append(ev.cost_s)
        trial = Trial(c, fid, rnd, ev.score, ev.cost_s)
        res.trials.append(trial)
        if on_trial is not None:
            on_trial(trial)
        scored.append((c, ev.score))
        if rnd == 0 and i == 0:
            remaining = res.budget_s - res.spent_s + ev.cost_s
            n0 = first_round_size(len(alive), ev.cost_s / step, res.fidelities, eta, remaining)
            del alive[n0:]
            res.first_round = len(alive)
    return scored


def _predict(res: SearchResult[C], costs: list[float], step: int) -> float | None:
    """Expected cost of the next evaluation: this round's mean so far, else the last
    round's mean per repetition scaled to this round's added repetitions."""
    if costs:
        return sum(costs) / len(costs)
    if not res.trials:
        return None
    last = res.trials[-1]
    prev = [t for t in res.trials if t.round == last.round]
    added = last.fidelity - (res.fidelities[last.round - 1] if last.round else 0)
    return sum(t.cost_s for t in prev) / len(prev) / max(added, 1) * step
