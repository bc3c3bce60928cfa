"""The load signals a router balances on, under the names it reads.

A load-aware router in front of several orin-llm servers scrapes each one's
``/metrics`` and sends a request to the server that can start it soonest: the
Gateway API Inference Extension's endpoint picker (EPP) reads a queue length,
the requests running and the fraction of the KV cache in use, under names it
is configured with per model-server type. Its default type is vLLM, so
exporting the three signals under vLLM's names makes a pool of orin-llm
servers work with an EPP that is not configured for them at all. The default
style, ``auto``, does that whenever the server listens beyond loopback, which
every pool member does (a router cannot reach 127.0.0.1); a server bound to
loopback, the single-board default, keeps its /metrics to the ``orin_llm_*``
names: no duplicate series, and no names with ``:``, which Prometheus reserves
for recording rules (promtool's lint refuses them in an exporter, vLLM's own
included). ``sglang`` and ``llamacpp`` use those servers' names instead, for
routers and dashboards built for them, and explicit names in the profile
override any of the three (``server.routing_metrics``, docs/fleet.md).

The values have the meaning those routers expect:

- queue: requests waiting for a slot (vLLM's ``num_requests_waiting``,
  llama-server's ``requests_deferred``);
- running: requests holding a slot (``num_requests_running``,
  ``requests_processing``);
- KV usage: cells held by running requests / cells of the whole cache, 0 to 1.
  Cells an idle slot keeps as a prefix for the next prompt are free to
  reuse, as vLLM counts a cached block nobody references as free.

They are the same figures as ``orin_llm_requests_waiting``,
``orin_llm_requests_running`` and ``orin_llm_kv_cache_usage_ratio``, read from
the engine when ``/metrics`` is scraped (a collector, not gauges set by engine
steps: a router polls many times a second and must see a cancelled request
gone even when no step has run since). ``vllm:cache_config_info`` (and
SGLang's equivalent) states the cache's size in 16-token blocks, which the
EPP's approximate prefix-cache scorer uses to size its per-server index;
llama.cpp keeps one cell per token, so any block size is exact, and 16 is the
EPP's own default. No LoRA series is exported: this server loads no adapters,
like a vLLM server started without ``--enable-lora``.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from orin.engine.client import EngineStatus
from orin.errors import ProfileError
from orin.profile.schema import ServerSection

# Tokens per block in the cache-info series (the EPP's and vLLM's default block).
CACHE_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class CacheInfo:
    """An info-style gauge whose labels give the cache's block size and block count."""

    name: str
    block_size_label: str
    blocks_label: str


@dataclass(frozen=True)
class RoutingNames:
    """The names the signals are exported under; None leaves one out."""

    queue: str | None = None
    running: str | None = None
    kv_usage: str | None = None
    cache_info: CacheInfo | None = None
    # vLLM and SGLang label their series with the served model; llama-server does not
    model_label: bool = True

    def names(self) -> tuple[str, ...]:
        """Every family name, in the order the collector yields them."""
        info = self.cache_info.name if self.cache_info is not None else None
        return tuple(n for n in (self.queue, self.running, self.kv_usage, info) if n)


STYLES: dict[str, RoutingNames] = {
    "vllm": RoutingNames(
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        CacheInfo("vllm:cache_config_info", "block_size", "num_gpu_blocks"),
    ),
    "sglang": RoutingNames(
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        CacheInfo("sglang:cache_config_info", "page_size", "num_pages"),
    ),
    # llama-server's own names; its current builds no longer export the KV ratio
    "llamacpp": RoutingNames(
        "llamacpp:requests_deferred",
        "llamacpp:requests_processing",
        "llamacpp:kv_cache_usage_ratio",
        model_label=False,
    ),
    "none": RoutingNames(),
}


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it resolves to an address others may reach


def effective_style(server: ServerSection) -> str:
    """The style in force: 'auto' is 'vllm' for a server a router can reach, else 'none'."""
    style = server.routing_metrics.style
    if style != "auto":
        return style
    return "none" if is_loopback(server.host) else "vllm"


def routing_names(server: ServerSection) -> RoutingNames:
    """The style's names with the profile's explicit names in their place.

    Raises ProfileError when two signals end up under one name (an explicit
    name equal to another signal's name in the style)."""
    section = server.routing_metrics
    style = STYLES[effective_style(server)]
    names = RoutingNames(
        queue=section.queue or style.queue,
        running=section.running or style.running,
        kv_usage=section.kv_usage or style.kv_usage,
        cache_info=style.cache_info,
        model_label=style.model_label,
    )
    taken = names.names()
    if len(set(taken)) != len(taken):
        raise ProfileError(f"server.routing_metrics: two signals share a name ({', '.join(taken)})")
    return names


def kv_usage(s: EngineStatus) -> float:
    """Cells held by running requests / cells of the cache, 0 to 1 (0 before a cache exists)."""
    if s.kv_cells_total <= 0:
        return 0.0
    return min(1.0, s.kv_cells_used / s.kv_cells_total)


class RoutingMetrics(Collector):
    """The signals under ``names``, read from ``status`` at every scrape."""

    def __init__(
        self, names: RoutingNames, status: Callable[[], EngineStatus], model_name: str
    ) -> None:
        self.names = names
        self._status = status
        self._labels = [model_name] if names.model_label else []

    def describe(self) -> Iterator[Metric]:
        """The families without samples: the registry checks their names against its own
        when this collector is registered (a clash is refused there, not at scrape time)."""
        yield from self._families(None)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(self._status())

    def _families(self, s: EngineStatus | None) -> Iterator[Metric]:
        """The families, with samples from ``s`` (none for ``describe``)."""
        n = self.names
        if n.queue:
            yield self._gauge(
                n.queue, "Requests waiting for a free slot.", None if s is None else s.waiting
            )
        if n.running:
            yield self._gauge(
                n.running, "Requests holding a slot.", None if s is None else s.slots_busy
            )
        if n.kv_usage:
            yield self._gauge(
                n.kv_usage,
                "Fraction of KV cache cells held by running requests, 0 to 1 "
                "(cells kept by idle slots for prefix reuse count as free).",
                None if s is None else kv_usage(s),
            )
        if n.cache_info:
            yield self._cache_info(n.cache_info, 0 if s is None else s.kv_cells_total)

    def _gauge(self, name: str, doc: str, value: float | None) -> GaugeMetricFamily:
        labels = ["model_name"] if self.names.model_label else []
        family = GaugeMetricFamily(name, doc, labels=labels)
        if value is not None:
            family.add_metric(self._labels, value)
        return family

    def _cache_info(self, info: CacheInfo, cells_total: int) -> GaugeMetricFamily:
        family = GaugeMetricFamily(
            info.name,
            f"KV cache size in blocks of {CACHE_BLOCK_TOKENS} tokens (llama.cpp keeps a cell "
            "per token); the value is always 1.",
            labels=[info.block_size_label, info.blocks_label],
        )
        if cells_total > 0:
            blocks = cells_total // CACHE_BLOCK_TOKENS
            family.add_metric([str(CACHE_BLOCK_TOKENS), str(blocks)], 1.0)
        return family


def register_routing(
    registry: CollectorRegistry,
    server: ServerSection,
    status: Callable[[], EngineStatus],
    model_name: str,
) -> RoutingMetrics | None:
    """Add the profile's routing names to the server's registry; None when there are none."""
    names = routing_names(server)
    if not names.names():
        return None
    collector = RoutingMetrics(names, status, model_name)
    registry.register(collector)
    return collector
