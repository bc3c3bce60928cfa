"""benchmarks/burst_replay.py: the replay counts what the scheduler decides, and the
ablation restores the scheduler afterwards."""

from __future__ import annotations

from benchmarks.burst_replay import replay, without_copy_aside
from orin.engine.scheduler import Scheduler


def test_copying_prompts_aside_keeps_returning_users_prompts() -> None:
    keep = Scheduler._evacuate
    with without_copy_aside():
        before = replay(40, seed=3)
    assert Scheduler._evacuate is keep
    after = replay(40, seed=3)
    # the same arrivals: 2 returning users in the second burst, 4 in the third
    assert before.returning == after.returning == 40 * 6
    assert before.refilled > after.refilled
    assert after.prefilled < before.prefilled
    assert after.passes / after.steps <= before.passes / before.steps
