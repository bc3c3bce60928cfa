"""benchmarks/admit_cost.py: it times the admitting step only, and the full-comparison
variant is the scheduler with the one-token check switched off, then restored."""

from __future__ import annotations

import itertools
import random

from benchmarks import admit_cost
from orin.engine import scheduler as sched
from orin.engine.scheduler import ContextPolicy, Scheduler


def test_a_burst_times_the_step_that_admits_it_and_leaves_cells_behind() -> None:
    s = Scheduler(admit_cost.SLOTS, admit_cost.N_BATCH, ContextPolicy(window=admit_cost.WINDOW))
    ticks = itertools.count(0, 1000)
    spent = admit_cost.burst(s, 4, random.Random(3), lambda: next(ticks))
    assert spent == 1000  # one clock reading before the admitting schedule(), one after
    assert not any(slot.busy for slot in s.slots)
    held = [slot for slot in s.slots if slot.cache]
    assert len(held) == 4
    assert all(
        len(slot.cache) >= admit_cost.PROMPT_TOKENS + admit_cost.ANSWER_TOKENS - 1 for slot in held
    )


def test_full_comparison_switches_the_check_off_and_restores_it() -> None:
    check = sched._holds_more
    with admit_cost.full_comparison():
        assert sched._holds_more is not check
        assert sched._holds_more(sched.Slot(0), [1, 2], 5)  # compare, whatever the token
    assert sched._holds_more is check


def test_measure_gives_both_variants_every_round() -> None:
    out = admit_cost.measure(4, 3, seed=1)
    assert set(out) == set(admit_cost.VARIANTS)
    assert all(len(ms) == 3 and all(m > 0 for m in ms) for ms in out.values())
