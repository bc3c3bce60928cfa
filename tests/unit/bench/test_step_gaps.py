"""benchmarks/step_gaps.py: which gaps between steps count (those inside a burst)."""

from __future__ import annotations

from benchmarks.step_gaps import Arm, gaps_in
from orin.bench.client import Timed


def timed(t0: float, *tokens: float) -> Timed:
    return Timed(t0, list(tokens))


def test_only_the_gaps_between_steps_inside_a_burst_count() -> None:
    ms = 1_000_000  # ns
    steps = [
        (0 * ms, 4 * ms),  # before the burst: its gap to the next is not counted
        (10 * ms, 14 * ms),
        (14 * ms + 300_000, 18 * ms),
        (18 * ms + 500_000, 22 * ms),
        (40 * ms, 44 * ms),  # after the burst's last token
    ]
    burst = [timed(0.010, 0.014, 0.018), timed(0.0101, 0.0225)]
    assert gaps_in(steps, [burst]) == [300.0, 500.0]
    assert gaps_in(steps, []) == []


def test_a_burst_without_tokens_from_one_request_still_counts_the_others() -> None:
    ms = 1_000_000
    steps = [(10 * ms, 12 * ms), (12 * ms + 100_000, 13 * ms)]
    assert gaps_in(steps, [[timed(0.010, 0.013), timed(0.010)]]) == [100.0]


def test_the_summary_reads_the_medians_and_tail() -> None:
    arm = Arm([float(g) for g in range(1, 11)], [4.0, 6.0], [30.0, 40.0, 50.0])
    assert arm.summary() == {
        "gap_median_us": 5.5,
        "gap_p90_us": 10.0,
        "gap_max_us": 10.0,
        "gaps": 10.0,
        "tpot_median_ms": 5.0,
        "ttft_median_ms": 40.0,
    }
