"""The soak benchmark's growth fit against hand-computed samples."""

from __future__ import annotations

import pytest

from benchmarks.soak import Sample, growth


def samples(rss: list[int], per_round: int = 10, seconds: float = 2.0) -> list[Sample]:
    return [
        Sample(i, requests=(i + 1) * per_round, rss=r, fds=16 + i % 2, threads=5, t=i * seconds)
        for i, r in enumerate(rss)
    ]


def test_warm_up_rounds_are_left_out_of_the_fit() -> None:
    # a jump while caches warm, then 100 bytes per round of 10 requests
    g = growth(samples([1_000, 50_000, 60_000, 60_100, 60_200, 60_300]), warmup=2)
    assert g.bytes_per_request == pytest.approx(10.0)
    # 10 requests every 2 s: 432,000 requests a day
    assert g.bytes_per_day == pytest.approx(10.0 * 5 * 86400)
    assert (g.rss_first, g.rss_last, g.rss_max, g.samples) == (60_000, 60_300, 60_300, 4)
    assert (g.fds_first, g.fds_last) == (16, 17)


def test_flat_memory_fits_no_growth() -> None:
    g = growth(samples([5_000, 7_000, 7_000, 7_000, 7_000]), warmup=1)
    assert g.bytes_per_request == pytest.approx(0.0)
    assert g.bytes_per_day == pytest.approx(0.0)


def test_freed_memory_fits_a_negative_slope() -> None:
    g = growth(samples([9_000, 8_000, 7_000]), warmup=0)
    assert g.bytes_per_request == pytest.approx(-100.0)


def test_growth_that_levels_off_has_a_flat_late_slope() -> None:
    # grows for four rounds, then holds: the whole fit slopes, the later half does not
    g = growth(samples([100, 200, 300, 400, 400, 400, 400, 400]), warmup=0)
    assert g.bytes_per_request > 0
    assert g.late_bytes_per_request == pytest.approx(0.0)


def test_a_steady_leak_keeps_its_late_slope() -> None:
    g = growth(samples([100 * i for i in range(8)]), warmup=0)
    assert g.late_bytes_per_request == pytest.approx(g.bytes_per_request) == pytest.approx(10.0)


def test_too_few_rounds_after_the_warm_up_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 2 rounds"):
        growth(samples([1, 2, 3]), warmup=2)
