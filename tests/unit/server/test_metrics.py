"""ServerMetrics fed with hand-made engine stats: samples, exposition, PromQL quantiles."""

from __future__ import annotations

import math
import subprocess

import numpy as np
import pytest
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from orin.engine.types import FinishReason, RequestTimings, StepStats
from orin.server.metrics import (
    CONTENT_TYPE,
    FINISH_REASONS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    ServerMetrics,
)
from tests.tools import promtool_or_skip

MS = 1_000_000  # ns


@pytest.fixture
def metrics() -> ServerMetrics:
    return ServerMetrics(slots_total=4, kv_cells_total=8192, model_name="test-model")


def timings(
    n_out: int = 4,
    ttft_ms: float = 120.0,
    gap_ms: float = 40.0,
    queue_ms: float = 5.0,
    prompt: int = 100,
    cached: int = 30,
) -> RequestTimings:
    """Timings of a request that produced ``n_out`` tokens ``gap_ms`` apart."""
    itl = (gap_ms,) * max(n_out - 1, 0)
    e2e = ttft_ms + sum(itl) if n_out else ttft_ms
    return RequestTimings(
        queue_ms=queue_ms,
        prefill_ms=ttft_ms - queue_ms,
        ttft_ms=ttft_ms,
        tpot_ms=gap_ms if n_out >= 2 else None,
        e2e_ms=e2e,
        itl_ms=itl,
        prompt_tokens=prompt,
        cached_tokens=cached,
        generated_tokens=n_out,
        context_shifts=0,
    )


def step(
    prefill: int = 0,
    decode: int = 1,
    busy: int = 1,
    kv: int = 0,
    waiting: int = 0,
    shifts: int = 0,
    aborted: bool = False,
    ms: int = 20,
) -> StepStats:
    return StepStats(0, ms * MS, prefill, decode, busy, kv, waiting, shifts, aborted)


def value(m: ServerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value("orin_llm_" + name, labels)


def count(m: ServerMetrics, histogram: str) -> float | None:
    return value(m, histogram + "_count")


def buckets(m: ServerMetrics, histogram: str) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) pairs of an unlabelled histogram, +Inf last."""
    name = "orin_llm_" + histogram + "_bucket"
    pairs = [
        (float(s.labels["le"]), s.value)
        for family in m.registry.collect()
        for s in family.samples
        if s.name == name
    ]
    return sorted(pairs)


# -- construction ------------------------------------------------------------------


def test_initial_samples(metrics: ServerMetrics) -> None:
    for reason in ("stop", "length", "cancelled", "error"):
        assert value(metrics, "requests_total", finish_reason=reason) == 0
    for phase in ("prefill", "decode", "mixed"):
        assert value(metrics, "engine_steps_total", phase=phase) == 0
    assert value(metrics, "slots_capacity") == 4
    assert value(metrics, "kv_cells_capacity") == 8192
    assert value(metrics, "model_info", model_name="test-model") == 1
    assert value(metrics, "kv_cache_usage_ratio") == 0
    assert count(metrics, "time_to_first_token_seconds") == 0


def test_finish_reasons_cover_the_engine_type() -> None:
    assert set(FINISH_REASONS) == {"stop", "length", "cancelled", "error"}


def test_own_registry_per_instance() -> None:
    a = ServerMetrics(1, 100, "a")
    b = ServerMetrics(2, 200, "b")
    assert a.registry is not b.registry
    assert REGISTRY.get_sample_value("orin_llm_slots_capacity") is None
    registry = CollectorRegistry()
    c = ServerMetrics(3, 300, "c", registry=registry)
    assert c.registry is registry
    assert registry.get_sample_value("orin_llm_slots_capacity") == 3


# -- engine steps --------------------------------------------------------------------


def test_load_gauges_and_kv_ratio(metrics: ServerMetrics) -> None:
    metrics.update_load(3, 5, 2048)
    assert value(metrics, "slots_busy") == 3
    assert value(metrics, "requests_running") == 3
    assert value(metrics, "requests_waiting") == 5
    assert value(metrics, "kv_cells_used") == 2048
    assert value(metrics, "kv_cache_usage_ratio") == pytest.approx(0.25)
    metrics.update_load(0, 0, 0)
    assert value(metrics, "slots_busy") == 0
    assert value(metrics, "kv_cache_usage_ratio") == 0


def test_steps_leave_the_load_gauges_to_scrape_time(metrics: ServerMetrics) -> None:
    metrics.update_load(1, 0, 100)
    metrics.on_step(step(busy=3, kv=2048, waiting=5))  # the engine's step between decodes
    assert (value(metrics, "slots_busy"), value(metrics, "kv_cells_used")) == (1, 100)


def test_engine_totals_are_counters_as_of_the_scrape(metrics: ServerMetrics) -> None:
    assert value(metrics, "prompt_step_splits_total") == 0
    metrics.update_engine_totals(3, {"hits": 2, "loads": 1}, 5)
    assert value(metrics, "slot_moves_total") == 3
    assert value(metrics, "prompt_step_splits_total") == 5
    assert value(metrics, "prompt_cache_hits_total") == 2
    assert value(metrics, "prompt_cache_misses_total") == 0


def test_zero_kv_capacity_gives_zero_ratio() -> None:
    m = ServerMetrics(1, 0, "m")
    m.update_load(1, 0, 10)
    assert value(m, "kv_cache_usage_ratio") == 0


def test_steps_by_phase_shifts_and_aborts(metrics: ServerMetrics) -> None:
    metrics.on_step(step(prefill=512, decode=0, ms=400))
    metrics.on_step(step(prefill=100, decode=3, shifts=2))
    metrics.on_step(step(decode=4, ms=30))
    metrics.on_step(step(decode=4, ms=30))
    metrics.on_step(step(prefill=512, decode=0, aborted=True))
    metrics.on_step(step(prefill=0, decode=0))  # idle: counts nothing
    assert value(metrics, "engine_steps_total", phase="prefill") == 2
    assert value(metrics, "engine_steps_total", phase="mixed") == 1
    assert value(metrics, "engine_steps_total", phase="decode") == 2
    assert value(metrics, "engine_aborted_steps_total") == 1
    assert value(metrics, "context_shifts_total") == 2
    assert value(metrics, "engine_batch_tokens_total", kind="prefill") == 612
    assert value(metrics, "engine_batch_tokens_total", kind="decode") == 11
    assert value(metrics, "engine_step_duration_seconds_count", phase="decode") == 2
    assert value(metrics, "engine_step_duration_seconds_sum", phase="decode") == pytest.approx(0.06)
    assert value(metrics, "engine_step_duration_seconds_bucket", phase="prefill", le="0.3") == 1
    assert value(metrics, "engine_step_duration_seconds_bucket", phase="prefill", le="0.5") == 2


def test_steps_leave_request_figures_alone(metrics: ServerMetrics) -> None:
    metrics.on_step(step(prefill=10, decode=2))
    assert count(metrics, "time_to_first_token_seconds") == 0
    assert value(metrics, "generation_tokens_total") == 0
    assert value(metrics, "requests_total", finish_reason="stop") == 0


# -- finished requests -----------------------------------------------------------------


def test_finished_request_samples(metrics: ServerMetrics) -> None:
    metrics.on_finish("r1", "stop", timings(n_out=4, ttft_ms=120.0, gap_ms=40.0, queue_ms=5.0))
    ttft = "time_to_first_token_seconds"
    assert value(metrics, ttft + "_bucket", le="0.1") == 0
    assert value(metrics, ttft + "_bucket", le="0.15") == 1
    assert value(metrics, ttft + "_bucket", le="+Inf") == 1
    assert value(metrics, ttft + "_sum") == pytest.approx(0.12)
    assert count(metrics, "time_per_output_token_seconds") == 1
    assert value(metrics, "time_per_output_token_seconds_sum") == pytest.approx(0.04)
    assert value(metrics, "time_per_output_token_seconds_bucket", le="0.03") == 0
    assert value(metrics, "time_per_output_token_seconds_bucket", le="0.04") == 1
    assert count(metrics, "inter_token_latency_seconds") == 3
    assert value(metrics, "inter_token_latency_seconds_sum") == pytest.approx(0.12)
    assert value(metrics, "e2e_request_latency_seconds_sum") == pytest.approx(0.24)
    assert value(metrics, "request_decode_time_seconds_sum") == pytest.approx(0.12)
    assert value(metrics, "request_queue_time_seconds_sum") == pytest.approx(0.005)
    assert value(metrics, "request_prefill_time_seconds_sum") == pytest.approx(0.115)
    assert value(metrics, "prompt_tokens_total") == 100
    assert value(metrics, "prompt_tokens_cached_total") == 30
    assert value(metrics, "generation_tokens_total") == 4
    assert value(metrics, "requests_total", finish_reason="stop") == 1


def test_speculation_per_request_and_its_switching_off(metrics: ServerMetrics) -> None:
    """The acceptance ratio of each request that drafted, and the requests whose
    speculation switched itself off (timings.draft_stopped)."""
    import dataclasses

    kept = dataclasses.replace(timings(), drafted_tokens=8, accepted_tokens=6)
    stopped = dataclasses.replace(
        timings(), drafted_tokens=32, accepted_tokens=2, draft_stopped=True
    )
    assert value(metrics, "spec_stopped_requests_total") == 0
    metrics.on_finish("a", "stop", kept)
    metrics.on_finish("b", "stop", stopped)
    metrics.on_finish("c", "stop", timings())
    assert count(metrics, "spec_acceptance_ratio") == 2
    assert value(metrics, "spec_stopped_requests_total") == 1


def test_one_token_request_has_no_tpot_or_itl(metrics: ServerMetrics) -> None:
    metrics.on_finish("r1", "length", timings(n_out=1))
    assert count(metrics, "time_to_first_token_seconds") == 1
    assert count(metrics, "time_per_output_token_seconds") == 0
    assert count(metrics, "inter_token_latency_seconds") == 0
    assert count(metrics, "e2e_request_latency_seconds") == 1
    assert value(metrics, "requests_total", finish_reason="length") == 1


def test_itl_one_observation_per_gap(metrics: ServerMetrics) -> None:
    metrics.on_finish("a", "stop", timings(n_out=10))
    metrics.on_finish("b", "stop", timings(n_out=2))
    metrics.on_finish("c", "stop", timings(n_out=1))
    assert count(metrics, "inter_token_latency_seconds") == 9 + 1 + 0
    assert count(metrics, "time_per_output_token_seconds") == 2


def test_cancelled_without_tokens_counts_but_observes_nothing(metrics: ServerMetrics) -> None:
    metrics.on_finish("r1", "cancelled", timings(n_out=0, cached=0))
    assert value(metrics, "requests_total", finish_reason="cancelled") == 1
    assert value(metrics, "prompt_tokens_total") == 100
    assert value(metrics, "generation_tokens_total") == 0
    for histogram in (
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "e2e_request_latency_seconds",
        "request_decode_time_seconds",
    ):
        assert count(metrics, histogram) == 0, histogram


@pytest.mark.parametrize("reason", ["cancelled", "error"])
def test_cut_short_request_keeps_token_latencies_only(
    metrics: ServerMetrics, reason: FinishReason
) -> None:
    metrics.on_finish("r1", reason, timings(n_out=5))
    assert count(metrics, "time_to_first_token_seconds") == 1
    assert count(metrics, "time_per_output_token_seconds") == 1
    assert count(metrics, "inter_token_latency_seconds") == 4
    assert count(metrics, "e2e_request_latency_seconds") == 0
    assert count(metrics, "request_decode_time_seconds") == 0
    assert value(metrics, "generation_tokens_total") == 5


def test_finish_reason_counts(metrics: ServerMetrics) -> None:
    reasons: list[FinishReason] = ["stop", "stop", "length", "cancelled", "error", "stop"]
    for i, reason in enumerate(reasons):
        metrics.on_finish(f"r{i}", reason, timings())
    assert value(metrics, "requests_total", finish_reason="stop") == 3
    assert value(metrics, "requests_total", finish_reason="length") == 1
    assert value(metrics, "requests_total", finish_reason="cancelled") == 1
    assert value(metrics, "requests_total", finish_reason="error") == 1


# -- HTTP ----------------------------------------------------------------------------


def test_observe_http(metrics: ServerMetrics) -> None:
    route = "/v1/chat/completions"
    metrics.observe_http("POST", route, 200, 0.3)
    metrics.observe_http("POST", route, 200, 12.0)
    metrics.observe_http("POST", route, 429, 0.002)
    labels = {"method": "POST", "route": route}
    assert value(metrics, "http_requests_total", status="200", **labels) == 2
    assert value(metrics, "http_requests_total", status="429", **labels) == 1
    assert value(metrics, "http_request_duration_seconds_count", **labels) == 3
    assert value(metrics, "http_request_duration_seconds_bucket", le="0.5", **labels) == 2


def test_an_unknown_http_method_is_one_label_value(metrics: ServerMetrics) -> None:
    """Any client can send the methods the HTTP parser knows (PROPFIND, MKCOL, PURGE,
    ...): each must not add series of its own to every route."""
    for method in ("PROPFIND", "MKCOL", "PURGE", "LOCK", "SEARCH"):
        metrics.observe_http(method, "/health", 405, 0.001)
    metrics.observe_http("DELETE", "/health", 405, 0.001)
    other = {"method": "_OTHER", "route": "/health"}
    assert value(metrics, "http_requests_total", status="405", **other) == 5
    assert value(metrics, "http_request_duration_seconds_count", **other) == 5
    assert value(metrics, "http_requests_total", status="405", method="DELETE", route="/health")
    body = metrics.render()[0].decode()
    assert "PROPFIND" not in body and "PURGE" not in body


# -- exposition ------------------------------------------------------------------------


def fed(m: ServerMetrics) -> ServerMetrics:
    """Metrics with at least one sample in every family, labelled ones included."""
    m.on_step(step(prefill=64, decode=2, busy=2, kv=300, waiting=1, shifts=1))
    m.on_step(step(prefill=64, decode=0, aborted=True))
    m.on_finish("r1", "stop", timings())
    m.on_finish("r2", "cancelled", timings(n_out=0))
    m.observe_http("GET", "/v1/models", 200, 0.004)
    return m


def test_render_parses_with_prefix_and_help(metrics: ServerMetrics) -> None:
    body, content_type = fed(metrics).render()
    assert content_type == CONTENT_TYPE
    assert content_type.startswith("text/plain; version=0.0.4")
    families = list(text_string_to_metric_families(body.decode()))
    names = {f.name for f in families}
    assert "orin_llm_time_to_first_token_seconds" in names
    assert "orin_llm_requests" in names  # counters are parsed without _total
    # ours, and prometheus-client's standard process collector
    prefixes = ("orin_llm_", "process_")
    for family in families:
        assert family.name.startswith(prefixes), family.name
        assert ":" not in family.name
        assert family.documentation.strip(), family.name
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            assert line.startswith(prefixes), line


def test_kv_help_says_what_the_gauges_count(metrics: ServerMetrics) -> None:
    """The gauges leave out the cells idle slots keep for prefix reuse (0 on an idle
    server that still holds prompts); their HELP said "cells holding tokens", which
    those cells are too (docs/metrics.md)."""
    metrics.update_load(1, 0, 300)
    families = text_string_to_metric_families(metrics.render()[0].decode())
    help_of = {f.name: f.documentation for f in families}
    for name in ("orin_llm_kv_cells_used", "orin_llm_kv_cache_usage_ratio"):
        assert "held by running requests" in help_of[name], help_of[name]


def test_promtool_check_metrics(metrics: ServerMetrics) -> None:
    promtool = promtool_or_skip()
    body, _ = fed(metrics).render()
    result = subprocess.run(
        [promtool, "check", "metrics"], input=body, capture_output=True, timeout=30
    )
    output = (result.stdout + result.stderr).decode()
    assert result.returncode == 0, output
    assert output.strip() == "", output


# -- PromQL quantiles --------------------------------------------------------------------


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over (upper bound, cumulative count), +Inf last."""
    total = cumulative[-1][1]
    if total == 0:
        return math.nan
    rank = q * total
    b = next(i for i, (_, c) in enumerate(cumulative) if c >= rank)
    if b == len(cumulative) - 1:
        return cumulative[-2][0]
    lower, prev = (0.0, 0.0) if b == 0 else cumulative[b - 1]
    upper, cnt = cumulative[b]
    return lower + (upper - lower) * (rank - prev) / (cnt - prev)


def bucket_around(x: float, bounds: tuple[float, ...]) -> tuple[float, float]:
    upper_index = next(i for i, u in enumerate(bounds) if x <= u)
    return (bounds[upper_index - 1] if upper_index else 0.0), bounds[upper_index]


def test_ttft_p95_lands_in_the_right_bucket(metrics: ServerMetrics) -> None:
    observed = [0.055 + 0.01 * i for i in range(100)]  # 55 ms ... 1.045 s
    for i, ttft in enumerate(observed):
        metrics.on_finish(f"r{i}", "stop", timings(n_out=1, ttft_ms=ttft * 1000))
    cumulative = buckets(metrics, "time_to_first_token_seconds")
    assert cumulative[-1] == (math.inf, 100)
    exact = float(np.percentile(observed, 95))
    lower, upper = bucket_around(exact, TTFT_BUCKETS)
    estimate = histogram_quantile(0.95, cumulative)
    assert lower < estimate <= upper
    assert abs(estimate - exact) <= upper - lower


def test_tpot_p90_lands_in_the_right_bucket(metrics: ServerMetrics) -> None:
    rng = np.random.default_rng(7)
    observed = rng.uniform(0.035, 0.065, size=400)  # a 7-8B Q4 model's TPOT range
    for i, tpot in enumerate(observed):
        metrics.on_finish(f"r{i}", "stop", timings(n_out=3, gap_ms=float(tpot) * 1000))
    cumulative = buckets(metrics, "time_per_output_token_seconds")
    exact = float(np.percentile(observed, 90))
    lower, upper = bucket_around(exact, TOKEN_BUCKETS)
    estimate = histogram_quantile(0.90, cumulative)
    assert lower < estimate <= upper
    assert abs(estimate - exact) <= upper - lower


def test_quantile_above_last_bound_is_the_last_bound(metrics: ServerMetrics) -> None:
    for i in range(10):
        metrics.on_finish(f"r{i}", "stop", timings(n_out=1, ttft_ms=500_000.0))
    assert histogram_quantile(0.5, buckets(metrics, "time_to_first_token_seconds")) == 120.0
