"""benchmarks/step_gaps.py on the tiny demo model: two servers, one handing a step's
events over before the next decode and one at the step's end, both served every
burst and recorded their steps; times are not asserted (a benchmark's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import step_gaps

pytestmark = pytest.mark.llama


def test_both_servers_serve_every_burst_and_record_their_steps(
    tiny_f16: Path, tmp_path: Path
) -> None:
    arms = step_gaps.measure(tiny_f16, k=2, rounds=2, tokens=8, threads=1, work=tmp_path)
    assert set(arms) == {"before_decode", "step_end"}
    for arm in arms.values():
        assert len(arm.ttft_ms) == 2  # one median per burst
        assert len(arm.tpot_ms) == 4  # every request of both bursts
        assert arm.gaps_us and all(g >= 0 for g in arm.gaps_us)  # steps inside the bursts
