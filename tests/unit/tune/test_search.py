"""Successive halving on a synthetic cost model: a known landscape, exact costs."""

from __future__ import annotations

import itertools
import random

import pytest

from orin.tune.search import (
    Evaluation,
    Score,
    fidelity_levels,
    first_round_size,
    plan_cost,
    successive_halving,
)

Cand = tuple[int, int, int]
GRID: list[Cand] = list(itertools.product(range(4), range(3), range(3)))  # 36 configurations
OPTIMUM: Cand = (2, 1, 0)
LOAD = 1.0  # fixed cost of every evaluation (a model load)
REP = 1.0  # cost of one added repetition


def landscape(c: Cand) -> float:
    """Unique optimum 100 at (2, 1, 0); the runner-up (2, 1, 1) is 3 % lower."""
    a, b, d = c
    return 100.0 - 5.0 * (a - 2) ** 2 - 8.0 * (b - 1) ** 2 - 3.0 * d**2


class Synthetic:
    """Noisy measurements whose noise shrinks with repetitions; costs as a model load
    plus the added repetitions."""

    def __init__(self, noise: float = 2.0) -> None:
        self.noise = noise
        self.reps: dict[Cand, int] = {}
        self.calls: list[tuple[Cand, int]] = []

    def __call__(self, c: Cand, fidelity: int) -> Evaluation:
        self.calls.append((c, fidelity))
        added = fidelity - self.reps.get(c, 0)
        self.reps[c] = fidelity
        rng = random.Random(f"{c}:{fidelity}")
        value = landscape(c) + rng.gauss(0.0, self.noise / fidelity**0.5)
        return Evaluation(Score(True, value, -1.0), LOAD + REP * added, LOAD)


def test_finds_the_optimum_within_its_budget() -> None:
    ev = Synthetic()
    exhaustive = len(GRID) * (LOAD + 9 * REP)
    # a load per evaluation plus the added repetitions: 36 x 2 + 12 x 3 + 4 x 7 = 136,
    # predicted and spent
    res = successive_halving(GRID, ev, budget_s=136.0, max_fidelity=9, eta=3, seed=1)
    assert res.best == OPTIMUM and res.best_fidelity == 9
    assert res.spent_s == pytest.approx(136.0) and res.spent_s <= 0.4 * exhaustive
    assert res.first_round == len(GRID) and not res.stopped
    assert [sum(1 for t in res.trials if t.round == r) for r in range(3)] == [36, 12, 4]
    assert sum(t.cost_s for t in res.trials) == pytest.approx(res.spent_s)


def test_a_short_budget_shrinks_the_first_round_and_is_never_exceeded() -> None:
    for budget in (12.0, 40.0, 90.0):
        ev = Synthetic()
        res = successive_halving(GRID, ev, budget_s=budget, seed=3, first=OPTIMUM)
        assert res.spent_s <= budget
        assert res.first_round < len(GRID)
        assert ev.calls[0] == (OPTIMUM, 1)  # the "first" candidate is always measured
        assert res.best is not None


class ColdStart(Synthetic):
    """The first evaluation loads the model from disk (``cold``); every later load is
    ``warm``, and a repetition costs ``rep``: a real tune on a small model."""

    def __init__(self, cold: float, warm: float, rep: float) -> None:
        super().__init__()
        self.cold, self.warm, self.rep = cold, warm, rep

    def __call__(self, c: Cand, fidelity: int) -> Evaluation:
        ev = super().__call__(c, fidelity)
        load = self.cold if len(self.calls) == 1 else self.warm
        added = fidelity - ([0] + [f for d, f in self.calls[:-1] if d == c])[-1]
        return Evaluation(ev.score, load + self.rep * added, load)


def test_a_slow_first_load_does_not_shrink_the_first_round() -> None:
    # 2.3 s to load cold, 0.05 s warm, 0.02 s a repetition: all 36 at 1 repetition,
    # 12 at 3 and 4 at 9 cost about 7 s, well within 20. Scaling the first evaluation
    # (2.32 s) by repetitions predicted 21 s for one candidate alone, so the search
    # measured nothing but the profile's own settings
    ev = ColdStart(cold=2.3, warm=0.05, rep=0.02)
    res = successive_halving(GRID, ev, budget_s=20.0, seed=1, first=(0, 0, 0))
    assert res.first_round == len(GRID) and not res.stopped
    assert [sum(1 for t in res.trials if t.round == r) for r in range(3)] == [36, 12, 4]
    assert res.best == OPTIMUM and res.spent_s <= 20.0


def test_the_fixed_cost_counts_once_per_evaluation_in_the_plan() -> None:
    # an evaluation of 1 load and 1 repetition costs 2; the fixed part is not
    # multiplied by the repetitions each later round adds
    assert plan_cost(9, 1.0, (1, 3, 9), 3, fixed=1.0) == pytest.approx(9 * 2 + 3 * 3 + 1 * 7)
    assert first_round_size(36, 1.0, (1, 3, 9), 3, 136.0, fixed=1.0) == 36
    assert first_round_size(36, 2.0, (1, 3, 9), 3, 136.0) < 36  # the whole cost scaled


def test_the_first_candidate_need_not_be_in_the_space() -> None:
    outside: Cand = (9, 9, 9)
    res = successive_halving(GRID, Synthetic(), budget_s=200.0, first=outside)
    assert res.trials[0].candidate == outside and res.best == OPTIMUM


def test_slo_ranking_prefers_meeting_then_throughput_then_closeness() -> None:
    meets_slow = Score(True, 10.0, -0.1)
    meets_fast = Score(True, 20.0, -0.5)
    misses_close = Score(False, 99.0, 0.05)
    misses_far = Score(False, 999.0, 2.0)
    failed = Score(False, 0.0, float("inf"), failed=True)
    ranked = sorted([failed, misses_far, meets_slow, misses_close, meets_fast], key=Score.key)
    assert ranked[::-1] == [meets_fast, meets_slow, misses_close, misses_far, failed]


def test_schedule_arithmetic() -> None:
    assert fidelity_levels(1, 9, 3) == (1, 3, 9)
    assert fidelity_levels(1, 10, 2) == (1, 2, 4, 8)
    # 24 at 1 rep, 8 more at +2, 3 more at +6: 24 + 16 + 18
    assert plan_cost(24, 1.0, (1, 3, 9), 3) == pytest.approx(58.0)
    assert first_round_size(24, 1.0, (1, 3, 9), 3, 58.0) == 24
    assert first_round_size(24, 1.0, (1, 3, 9), 3, 30.0) < 24
    assert first_round_size(24, 100.0, (1, 3, 9), 3, 1.0) == 1


def test_the_profiles_own_settings_are_topped_up_when_the_cost_model_says_it_fits() -> None:
    """The profile's own settings are measured first, with the cold load (2.3 s); its
    whole cost per repetition predicted 18 s for 8 more, so the before/after compared
    1 repetition with 9 while the 0.3 s it takes was left in the budget."""
    from orin.tune.figures import Measurement
    from orin.tune.run import _top_up_baseline
    from orin.tune.search import SearchResult, Trial

    base, best = (0, 0, 0), OPTIMUM
    trials = [Trial(base, 1, 0, Score(True, 1.0, -1.0), 2.32, 2.3)] + [
        Trial(c, 1, 0, Score(True, 1.0, -1.0), 0.07, 0.05) for c in GRID[:8]
    ]
    result = SearchResult(best, None, 9, trials, 5.0, 6.0, (1, 3, 9), 9)

    class Measurer:
        def __init__(self) -> None:
            self.results = {base: Measurement(base, 1, cost_s=2.32, setup_s=2.3)}  # type: ignore[arg-type]
            self.calls: list[tuple[Cand, int]] = []

        def evaluate(self, c: Cand, reps: int) -> Evaluation:
            self.calls.append((c, reps))
            return Evaluation(Score(True, 1.0, -1.0), 0.2, 0.05)

    m = Measurer()
    _top_up_baseline(m, base, 9, result, budget=6.0)  # type: ignore[arg-type]
    assert m.calls == [(base, 9)] and result.spent_s == pytest.approx(5.2)
    m.calls.clear()
    _top_up_baseline(m, base, 9, result, budget=5.3)  # type: ignore[arg-type]
    assert m.calls == []  # 0.05 + 8 x 0.02 does not fit in 0.1
