"""Routing metrics: the names each style exports, the values' meaning, the profile's checks."""

from __future__ import annotations

from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orin.engine.client import EngineStatus
from orin.errors import ProfileError
from orin.profile.loader import parse_profile
from orin.profile.schema import RoutingMetricsSection, ServerSection
from orin.server.metrics import ServerMetrics
from orin.server.routing import (
    CACHE_BLOCK_TOKENS,
    STYLES,
    RoutingMetrics,
    effective_style,
    register_routing,
    routing_names,
)

# 2 of 4 slots busy holding 1024 cells, 3 waiting, an idle slot keeping 512 cells
STATUS = EngineStatus("ready", None, 4, 2, 3, 1024, 512, 4096, None, 0)


class Engine:
    """The engine's status, changed by the test between scrapes."""

    def __init__(self, status: EngineStatus = STATUS) -> None:
        self.now = status

    def status(self) -> EngineStatus:
        return self.now


def scrape(registry: CollectorRegistry) -> dict[str, tuple[dict[str, str], float]]:
    """name -> (labels, value) of every sample, parsed back from the exposition text."""
    text = generate_latest(registry).decode()
    return {
        s.name: (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def server(section: RoutingMetricsSection, host: str = "0.0.0.0") -> ServerSection:
    return ServerSection(host=host, routing_metrics=section)


def routing(
    section: RoutingMetricsSection, engine: Engine, host: str = "0.0.0.0"
) -> CollectorRegistry:
    registry = CollectorRegistry()
    register_routing(registry, server(section, host), engine.status, "served-model")
    return registry


def test_a_reachable_server_exports_what_the_epp_reads_by_default() -> None:
    """The EPP's default (vLLM) mapping: queue, running, KV usage and the cache's size."""
    section = parse_profile("name: t\nserver: {host: 0.0.0.0}\n").server.routing_metrics
    assert section.style == "auto"
    samples = scrape(routing(section, Engine()))
    label = {"model_name": "served-model"}
    assert samples["vllm:num_requests_waiting"] == (label, 3.0)
    assert samples["vllm:num_requests_running"] == (label, 2.0)
    # cells held by running requests over the whole cache; the idle slot's prefix is free
    assert samples["vllm:kv_cache_usage_perc"] == (label, 1024 / 4096)
    blocks = str(4096 // CACHE_BLOCK_TOKENS)
    info = {"block_size": str(CACHE_BLOCK_TOKENS), "num_gpu_blocks": blocks}
    assert samples["vllm:cache_config_info"] == (info, 1.0)


@pytest.mark.parametrize(
    ("host", "style"),
    [("127.0.0.1", "none"), ("localhost", "none"), ("::1", "none"), ("127.0.0.5", "none"),
     ("0.0.0.0", "vllm"), ("::", "vllm"), ("10.1.2.3", "vllm"), ("orin-0.local", "vllm")],
)  # fmt: skip
def test_auto_exports_vllm_names_where_a_router_can_reach_the_server(host: str, style: str) -> None:
    assert effective_style(server(RoutingMetricsSection(), host)) == style
    assert effective_style(server(RoutingMetricsSection(style="sglang"), host)) == "sglang"


def test_a_loopback_server_keeps_its_own_names_unless_told() -> None:
    assert scrape(routing(RoutingMetricsSection(), Engine(), host="127.0.0.1")) == {}
    told = scrape(routing(RoutingMetricsSection(style="vllm"), Engine(), host="127.0.0.1"))
    assert "vllm:num_requests_waiting" in told


def test_values_are_read_when_scraped() -> None:
    engine = Engine()
    registry = routing(RoutingMetricsSection(), engine)
    assert scrape(registry)["vllm:num_requests_waiting"][1] == 3.0
    engine.now = replace(STATUS, slots_busy=0, waiting=0, kv_cells_used=0)
    samples = scrape(registry)
    assert samples["vllm:num_requests_waiting"][1] == 0.0
    assert samples["vllm:num_requests_running"][1] == 0.0
    assert samples["vllm:kv_cache_usage_perc"][1] == 0.0


def test_usage_is_a_fraction_even_at_the_edges() -> None:
    full = Engine(replace(STATUS, kv_cells_used=4096))
    assert scrape(routing(RoutingMetricsSection(), full))["vllm:kv_cache_usage_perc"][1] == 1.0
    empty = Engine(replace(STATUS, kv_cells_used=0, kv_cells_total=0))
    samples = scrape(routing(RoutingMetricsSection(), empty))
    assert samples["vllm:kv_cache_usage_perc"][1] == 0.0
    assert "vllm:cache_config_info" not in samples  # no cache yet: no size to state


@pytest.mark.parametrize(
    ("style", "queue", "running", "kv", "info"),
    [
        ("sglang", "sglang:num_queue_reqs", "sglang:num_running_reqs", "sglang:token_usage",
         ("sglang:cache_config_info", "page_size", "num_pages")),
        ("llamacpp", "llamacpp:requests_deferred", "llamacpp:requests_processing",
         "llamacpp:kv_cache_usage_ratio", None),
    ],
)  # fmt: skip
def test_other_styles(
    style: str, queue: str, running: str, kv: str, info: tuple[str, str, str] | None
) -> None:
    samples = scrape(routing(RoutingMetricsSection(style=style), Engine()))
    assert samples[queue][1] == 3.0
    assert samples[running][1] == 2.0
    assert samples[kv][1] == 0.25
    if info is None:
        assert set(samples) == {queue, running, kv}
        assert samples[queue][0] == {}  # llama-server labels nothing
    else:
        name, size_label, blocks_label = info
        assert set(samples[name][0]) == {size_label, blocks_label}


def test_explicit_names_override_the_style() -> None:
    section = parse_profile(
        "name: t\nserver:\n  routing_metrics:\n    style: none\n"
        "    queue: fleet_queue\n    kv_usage: 'fleet:kv'\n"
    ).server.routing_metrics
    samples = scrape(routing(section, Engine()))
    assert set(samples) == {"fleet_queue", "fleet:kv"}
    with_style = RoutingMetricsSection(running="fleet_running")
    names = routing_names(server(with_style))
    assert names.running == "fleet_running"
    assert names.queue == STYLES["vllm"].queue


def test_none_registers_nothing() -> None:
    registry = CollectorRegistry()
    engine = Engine()
    section = server(RoutingMetricsSection(style="none"))
    assert register_routing(registry, section, engine.status, "m") is None
    assert scrape(registry) == {}


@pytest.mark.parametrize(
    "name", ["vllm:num requests", "9lives", "orin_llm_requests_waiting", "vllm.queue", ""]
)
def test_profile_refuses_names_a_scraper_cannot_use(name: str) -> None:
    with pytest.raises(ProfileError, match="routing_metrics"):
        parse_profile(f"name: t\nserver:\n  routing_metrics:\n    queue: '{name}'\n")


def test_two_signals_under_one_name_are_refused() -> None:
    section = RoutingMetricsSection(queue="vllm:num_requests_running")
    with pytest.raises(ProfileError, match="share a name"):
        routing_names(server(section))


def test_names_that_clash_with_the_registry_are_refused_when_registered() -> None:
    """describe() lets the registry check names at registration, not at each scrape."""
    metrics = ServerMetrics(slots_total=2, kv_cells_total=1024, model_name="m")
    names = replace(STYLES["none"], queue="orin_llm_requests_waiting")
    with pytest.raises(ValueError, match="Duplicated"):
        metrics.registry.register(RoutingMetrics(names, Engine().status, "m"))


def test_beside_the_server_metrics_the_same_figures() -> None:
    """The vLLM names carry the same values as orin-llm's own load gauges."""
    metrics = ServerMetrics(slots_total=4, kv_cells_total=4096, model_name="m")
    engine = Engine()
    register_routing(metrics.registry, server(RoutingMetricsSection()), engine.status, "m")
    s = engine.now
    metrics.update_load(s.slots_busy, s.waiting, s.kv_cells_used)
    samples = scrape(metrics.registry)
    assert samples["vllm:num_requests_waiting"][1] == samples["orin_llm_requests_waiting"][1]
    assert samples["vllm:num_requests_running"][1] == samples["orin_llm_requests_running"][1]
    assert samples["vllm:kv_cache_usage_perc"][1] == samples["orin_llm_kv_cache_usage_ratio"][1]
