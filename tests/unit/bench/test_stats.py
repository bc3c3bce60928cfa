"""Percentiles, TPOT, goodput and the summary keys against hand-computed vectors."""

from __future__ import annotations

import pytest

from orin.bench.stats import (
    SLO,
    RequestResult,
    by_bucket,
    distribution,
    goodput,
    percentile,
    summarize,
    tpot_ms,
)


def ok(
    i: int, ttft: float, e2el: float, n_out: int, length: int = 16, itl: tuple[float, ...] = ()
) -> RequestResult:
    return RequestResult(
        i, length, True, prompt_tokens=length, output_tokens=n_out, count_source="usage",
        ttft_ms=ttft, e2el_ms=e2el, itl_ms=itl,
    )  # fmt: skip


def failed(i: int, error: str = "http 400 context_length_exceeded") -> RequestResult:
    return RequestResult(i, 600, False, error)


def test_percentiles_interpolate_linearly_between_ranks() -> None:
    # rank = q/100 * (n - 1) over the sorted values, then linear interpolation
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 95) == pytest.approx(3.85)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 95) == pytest.approx(48.0)  # rank 3.8
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_distribution_of_a_known_vector() -> None:
    d = distribution([1.0, 2.0, 3.0, 4.0, 10.0])
    assert d["mean"] == pytest.approx(4.0)
    assert d["median"] == pytest.approx(3.0) == d["p50"]
    assert d["std"] == pytest.approx((50.0 / 5) ** 0.5)  # population std, as numpy/vLLM
    assert d["p90"] == pytest.approx(7.6)  # rank 3.6: 4 + 0.6 * 6
    assert distribution([])["p95"] is None


def test_tpot_excludes_the_first_token() -> None:
    # 10 tokens: the first at 100 ms ends prefill, 9 decode gaps until 190 ms
    assert tpot_ms(100.0, 190.0, 10) == pytest.approx(10.0)
    assert ok(0, 100.0, 190.0, 10).tpot_ms == pytest.approx(10.0)
    assert tpot_ms(100.0, 100.0, 1) is None  # one token: no decode step
    assert tpot_ms(None, 190.0, 10) is None


def test_goodput_counts_requests_meeting_every_target() -> None:
    slo = SLO(ttft_p95_ms=100.0, tpot_p90_ms=10.0)
    results = [
        ok(0, 50.0, 50.0 + 9 * 5.0, 10),  # TTFT 50, TPOT 5: good
        ok(1, 150.0, 150.0 + 9 * 5.0, 10),  # TTFT over
        ok(2, 50.0, 50.0 + 9 * 20.0, 10),  # TPOT over
        ok(3, 100.0, 100.0 + 9 * 10.0, 10),  # exactly at both targets: good
        failed(4),
    ]
    assert goodput(results, slo, 2.0) == pytest.approx(1.0)  # 2 good / 2 s
    assert goodput(results, SLO(), 2.0) is None


def test_slo_parse_and_check() -> None:
    slo = SLO.parse("ttft_p95_ms=200, tpot_p90_ms=50")
    assert (slo.ttft_p95_ms, slo.tpot_p90_ms) == (200.0, 50.0)
    check = slo.check({"p95_ttft_ms": 180.0, "p90_tpot_ms": 55.0})
    assert check["ttft_p95_ms"]["met"] and not check["tpot_p90_ms"]["met"]
    assert SLO.parse(None).empty
    bad_values = ("tpot_p90_ms=nan", "ttft_p95_ms=inf", "ttft_p95_ms=1,ttft_p95_ms=2")
    for bad in ("ttft=200", "ttft_p95_ms", "tpot_p90_ms=-1", "p99=3", *bad_values):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_summary_has_vllm_keys_counts_and_pooled_itl() -> None:
    results = [
        ok(0, 10.0, 40.0, 4, itl=(10.0, 10.0, 10.0)),
        ok(1, 20.0, 80.0, 4, itl=(20.0, 20.0, 20.0)),
        failed(2),
        failed(3, "timeout"),
    ]
    s = summarize(results, 2.0, SLO(ttft_p95_ms=15.0))
    assert (s["completed"], s["failed"]) == (2, 2)
    assert s["errors"] == {"http 400 context_length_exceeded": 1, "timeout": 1}
    assert s["total_output_tokens"] == 8 and s["output_throughput"] == pytest.approx(4.0)
    assert s["total_input_tokens"] == 32 and s["request_throughput"] == pytest.approx(1.0)
    assert s["request_goodput"] == pytest.approx(0.5)
    assert s["mean_ttft_ms"] == pytest.approx(15.0) and s["median_tpot_ms"] == pytest.approx(15.0)
    assert s["mean_itl_ms"] == pytest.approx(15.0)  # six gaps pooled over both requests
    assert s["p95_e2el_ms"] == pytest.approx(78.0)
    for stat in ("mean", "median", "std", "p50", "p90", "p95", "p99"):
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert f"{stat}_{metric}_ms" in s
    assert s["slo"]["ttft_p95_ms"]["met"] is False  # p95 of (10, 20) is 19.5


def test_buckets_split_by_requested_length() -> None:
    results = [ok(0, 10.0, 40.0, 4, 16), ok(1, 30.0, 60.0, 4, 64), failed(2)]
    b = by_bucket(results)
    assert list(b) == [16, 64, 600]
    assert b[64]["mean_input_tokens"] == 64 and b[600]["failed"] == 1
    assert b[600]["p95_ttft_ms"] is None
