"""Every Prometheus object of the server, in one place, fed from the engine's stats.

The engine reports through two observers, both called on its own thread:
``on_step`` after every step (load gauges, step counters) and ``on_finish``
once per request (latency histograms, token and request counters). The HTTP
layer adds ``observe_http`` and serves ``render`` on ``GET /metrics``.

Each instance owns a ``CollectorRegistry`` unless one is passed in, never the
process-global one, so that tests and several servers in one process do not
collide on metric names. The registry also carries prometheus-client's
``process_*`` collector (this process's CPU time, memory, open files) and the
board's memory and temperatures (``SystemMetrics``, read from ``root`` when
scraped, so tests pass a fake tree). prometheus-client objects are thread-safe; this
module keeps no state of its own besides them, so it takes no locks.

Definitions of TTFT, TPOT, ITL, queue and prefill time are those of
docs/metrics.md; times arrive in milliseconds and are exported in seconds,
the Prometheus base unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import get_args

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from orin.engine.types import FinishReason, RequestTimings, StepStats
from orin.system.root import SysRoot
from orin.telemetry.metrics import PREFIX, PhaseMetrics, SystemMetrics

# the method label's values: RFC 9110's methods and PATCH; any other is OTHER_METHOD,
# as OpenTelemetry's HTTP conventions name it
HTTP_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)
OTHER_METHOD = "_OTHER"

__all__ = ["PREFIX", "PhaseMetrics", "ServerMetrics"]

# Text exposition format 0.0.4: what generate_latest writes for names that are
# valid in the classic character set (all of these are), and the version every
# Prometheus-compatible scraper accepts.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_MS = 1e-3

# Bucket bounds, in seconds. On an AGX Orin with llama.cpp/CUDA a decode step
# takes about 10 ms for a 1B model, 40-50 ms for 7-8B Q4 and 250-350 ms for
# 70B Q4; a prompt prefills at a few hundred to a few thousand tokens/s, so a
# long prompt on a large model takes tens of seconds. Bounds are dense where
# those values fall: histogram_quantile interpolates linearly inside a bucket,
# so its estimate can be off by up to the width of the bucket it lands in.

# TTFT and prefill time: 10 ms (a cached prompt on a small model) to 2 min
# (a several-thousand-token prompt on a 70B model behind a queue).
TTFT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0,
)  # fmt: skip

# TPOT and ITL: 2.5 ms (small model, one slot) to 10 s, at most 25 % apart
# from 10 ms to 100 ms, where 1B-13B models decode. The top bounds are for
# ITL: a decode row that shares its step with a prompt chunk of another
# request waits for that chunk (n_batch tokens, seconds on a 70B model).
TOKEN_BUCKETS = (
    0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.0225, 0.025,
    0.03, 0.035, 0.04, 0.045, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1,
    0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip

# E2E and decode time: 100 ms to 10 min (thousands of tokens at 3-5 tokens/s
# on a 70B model).
E2E_BUCKETS = (
    0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0,
    45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)  # fmt: skip

# Queue time: about one step (ms) while a slot is free; up to a whole request
# (minutes) while every slot is busy.
QUEUE_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip

# One engine step: a decode step (ms) to a full prompt chunk on a 70B model.
STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip

# HTTP request duration: a health check (ms) to a streamed completion
# (minutes; the stream is part of the request).
HTTP_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

FINISH_REASONS: tuple[str, ...] = get_args(FinishReason)
STEP_PHASES = ("prefill", "decode", "mixed")
# Requests that ended this way ran to their natural end, so their E2E and
# decode time describe a whole generation; cancelled and failed ones did not.
COMPLETE_REASONS = frozenset({"stop", "length"})


RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)

PROMPT_CACHE_COUNTERS = {
    "hits": "Requests whose prompt began with a saved prompt, or lookups that found one.",
    "misses": "Lookups of the persistent prompt cache that found nothing.",
    "saves": "Prompt states written to disk.",
    "loads": "Prompt states restored from disk into a slot.",
    "rejected": "Saved prompt states refused (damaged, foreign, unsafe file) and recomputed.",
    "evicted": "Saved prompt states removed to stay within prompt_cache.max_bytes.",
}


SLOT_MOVES_DOC = (
    "Busy slots moved down to close a hole left by a finished one (one KV stream per slot: "
    "a hole splits a step into two llama.cpp passes)."
)
PROMPT_SPLITS_DOC = (
    "Steps of prompts that start together run as two, the shorter prompts first, because "
    "the step-cost model predicted a lower mean TTFT."
)


class _EngineTotals(Collector):
    """Counters the engine keeps itself, exported as they were at the last scrape."""

    def __init__(self) -> None:
        self.slot_moves = 0
        self.prompt_splits = 0
        self.prompt_cache: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        counters = [
            ("slot_moves", SLOT_MOVES_DOC, self.slot_moves),
            ("prompt_step_splits", PROMPT_SPLITS_DOC, self.prompt_splits),
            *(
                ("prompt_cache_" + name, doc, self.prompt_cache.get(name, 0))
                for name, doc in PROMPT_CACHE_COUNTERS.items()
            ),
        ]
        for name, doc, value in counters:
            family = CounterMetricFamily(PREFIX + name, doc)
            family.add_metric([], value)
            yield family


class ServerMetrics:
    """The server's metrics; pass ``on_step``/``on_finish`` to the engine's observers."""

    def __init__(
        self,
        slots_total: int,
        kv_cells_total: int,
        model_name: str,
        registry: CollectorRegistry | None = None,
        root: SysRoot | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._kv_cells_total = kv_cells_total
        ProcessCollector(registry=self.registry)
        self.registry.register(SystemMetrics(root))
        self._init_latency()
        self._init_counters()
        self._init_gauges(slots_total, kv_cells_total, model_name)
        self._init_http()

    # -- construction -----------------------------------------------------------

    def _histogram(
        self, name: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
    ) -> Histogram:
        return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)

    def _init_latency(self) -> None:
        """Per-request latency histograms, observed once a request finishes."""
        h = self._histogram
        self.ttft = h(
            "time_to_first_token_seconds",
            "Time from arrival at the engine to the first generated token (includes queueing).",
            TTFT_BUCKETS,
        )
        self.tpot = h(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request with at least 2 tokens.",
            TOKEN_BUCKETS,
        )
        self.itl = h(
            "inter_token_latency_seconds",
            "Gaps between successive generated tokens, one observation per gap.",
            TOKEN_BUCKETS,
        )
        self.e2e = h(
            "e2e_request_latency_seconds",
            "Time from arrival to the last token, for requests that finished by stop or length.",
            E2E_BUCKETS,
        )
        self.queue_time = h(
            "request_queue_time_seconds",
            "Time from arrival to the first engine step that carries the request's prompt.",
            QUEUE_BUCKETS,
        )
        self.prefill_time = h(
            "request_prefill_time_seconds",
            "Time from the first prompt step to the first generated token.",
            TTFT_BUCKETS,
        )
        self.decode_time = h(
            "request_decode_time_seconds",
            "Time from the first to the last token, for requests that finished by stop or length.",
            E2E_BUCKETS,
        )

    def _init_counters(self) -> None:
        """Token, request and engine-step counters; labelled children resolved once here."""
        r = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.prompt_tokens_cached = Counter(
            PREFIX + "prompt_tokens_cached",
            "Prompt tokens of finished requests served from the prefix cache, not prefilled.",
            registry=r,
        )
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated by finished requests.", registry=r
        )
        self.requests = Counter(
            PREFIX + "requests",
            "Finished requests by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self._requests_by_reason = {x: self.requests.labels(x) for x in FINISH_REASONS}
        self.context_shifts = Counter(
            PREFIX + "context_shifts", "KV context shifts performed by engine steps.", registry=r
        )
        self.micro_batches = Counter(
            PREFIX + "engine_micro_batches",
            "llama.cpp passes (micro-batches) run by engine steps; each reads every weight.",
            registry=r,
        )
        self.prefill_budget = Gauge(
            PREFIX + "prefill_budget_tokens",
            "Prompt tokens the latest step beside running streams could carry (SLO-aware "
            "chunking from slo.tpot_p90_ms; the whole chunk without a target).",
            registry=r,
        )
        self.spec_drafted = Counter(
            PREFIX + "spec_drafted_tokens",
            "Speculative tokens verified by engine steps.",
            registry=r,
        )
        self.spec_accepted = Counter(
            PREFIX + "spec_accepted_tokens",
            "Speculative tokens the model confirmed (emitted without a step of their own).",
            registry=r,
        )
        self.spec_acceptance = self._histogram(
            "spec_acceptance_ratio",
            "Accepted / drafted speculative tokens, per finished request that drafted any.",
            RATIO_BUCKETS,
        )
        self.spec_stopped = Counter(
            PREFIX + "spec_stopped_requests",
            "Finished requests whose speculation switched itself off: drafts accepted below "
            "speculative.min_acceptance after speculative.probation drafted tokens.",
            registry=r,
        )
        self._engine_totals = _EngineTotals()
        r.register(self._engine_totals)
        self.engine_steps = Counter(
            PREFIX + "engine_steps", "Engine steps by phase.", ["phase"], registry=r
        )
        self._steps_by_phase = {p: self.engine_steps.labels(p) for p in STEP_PHASES}
        self.engine_aborted_steps = Counter(
            PREFIX + "engine_aborted_steps",
            "Engine steps interrupted by a cancellation; their batch was discarded.",
            registry=r,
        )
        self.engine_batch_tokens = Counter(
            PREFIX + "engine_batch_tokens",
            "Tokens in the batches of completed engine steps, by kind (prefill or decode).",
            ["kind"],
            registry=r,
        )
        self._batch_prefill = self.engine_batch_tokens.labels("prefill")
        self._batch_decode = self.engine_batch_tokens.labels("decode")
        self.engine_step_duration = self._histogram(
            "engine_step_duration_seconds", "Duration of one engine step.", STEP_BUCKETS, ("phase",)
        )
        self._step_duration_by_phase = {p: self.engine_step_duration.labels(p) for p in STEP_PHASES}
        self.embedding_requests = Counter(
            PREFIX + "embedding_requests",
            "Embedding requests answered (/v1/embeddings).",
            registry=r,
        )
        self.embedding_tokens = Counter(
            PREFIX + "embedding_tokens",
            "Input tokens run through embedding passes (engine steps of their own, counted "
            "as prefill in engine_steps_total).",
            registry=r,
        )

    def _init_gauges(self, slots_total: int, kv_cells_total: int, model_name: str) -> None:
        """Load gauges, refreshed after every engine step, and fixed capacities."""
        r = self.registry
        self.requests_running = Gauge(
            PREFIX + "requests_running", "Requests holding a slot (= slots busy).", registry=r
        )
        self.requests_waiting = Gauge(
            PREFIX + "requests_waiting",
            "Requests queued for a free slot (embedding jobs included).",
            registry=r,
        )
        self.slots_busy = Gauge(PREFIX + "slots_busy", "Slots serving a request.", registry=r)
        # Capacities are not named *_total: that suffix is reserved for counters.
        self.slots_capacity = Gauge(PREFIX + "slots_capacity", "Slots configured.", registry=r)
        self.kv_cells_used = Gauge(
            PREFIX + "kv_cells_used",
            "KV cache cells held by running requests (not the prefixes idle slots keep).",
            registry=r,
        )
        self.kv_cells_capacity = Gauge(
            PREFIX + "kv_cells_capacity", "KV cache cells available (context size).", registry=r
        )
        self.kv_cache_usage = Gauge(
            PREFIX + "kv_cache_usage_ratio",
            "KV cache cells held by running requests / available, 0 to 1.",
            registry=r,
        )
        self.model_info = Info(PREFIX + "model", "The model this server serves.", registry=r)
        self.slots_capacity.set(slots_total)
        self.kv_cells_capacity.set(kv_cells_total)
        self.model_info.info({"model_name": model_name})

    def _init_http(self) -> None:
        """HTTP counters by route template, never by raw path, to bound the label set."""
        self.http_requests = Counter(
            PREFIX + "http_requests",
            "HTTP requests by method, route template and status code.",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.http_duration = self._histogram(
            "http_request_duration_seconds",
            "HTTP request duration, to the end of the response body (streams included).",
            HTTP_BUCKETS,
            ("method", "route"),
        )

    # -- feeds -------------------------------------------------------------------

    def on_step(self, stats: StepStats) -> None:
        """Engine step observer: runs on the engine's loop between two decodes, so only
        pre-resolved children, and no load gauges: /metrics sets those from the
        engine's views when it is scraped (``update_load``)."""
        phase = stats.phase
        if phase != "idle":
            self._steps_by_phase[phase].inc()
            self._step_duration_by_phase[phase].observe((stats.end_ns - stats.start_ns) * 1e-9)
        if stats.context_shifts:
            self.context_shifts.inc(stats.context_shifts)
        if stats.micro_batches:
            self.micro_batches.inc(stats.micro_batches)
        if stats.decode_tokens:
            self.prefill_budget.set(stats.prefill_budget)
        if stats.aborted:
            self.engine_aborted_steps.inc()
            return
        if stats.prefill_tokens:
            self._batch_prefill.inc(stats.prefill_tokens)
        if stats.decode_tokens:
            self._batch_decode.inc(stats.decode_tokens)
        if stats.embedded_tokens:
            self.embedding_tokens.inc(stats.embedded_tokens)
        if stats.drafted_tokens:
            self.spec_drafted.inc(stats.drafted_tokens)
            self.spec_accepted.inc(stats.accepted_tokens)

    def on_embedding(self) -> None:
        """One embeddings request answered (the HTTP route calls this)."""
        self.embedding_requests.inc()

    def update_engine_totals(
        self, slot_moves: int, prompt_cache: dict[str, int], prompt_splits: int
    ) -> None:
        """The engine's own running totals (slot moves, split prompt steps, the prompt
        cache's counters), read when /metrics is scraped and exported as counters."""
        self._engine_totals.slot_moves = slot_moves
        self._engine_totals.prompt_splits = prompt_splits
        self._engine_totals.prompt_cache = dict(prompt_cache)

    def update_load(self, slots_busy: int, waiting: int, kv_cells_used: int) -> None:
        """Set the load gauges; the /metrics route calls this with the engine's
        current views before ``render`` (a gauge is only read when scraped, so
        the engine's steps do not set them)."""
        self.requests_running.set(slots_busy)
        self.slots_busy.set(slots_busy)
        self.requests_waiting.set(waiting)
        self.kv_cells_used.set(kv_cells_used)
        total = self._kv_cells_total
        self.kv_cache_usage.set(kv_cells_used / total if total > 0 else 0.0)

    def on_finish(self, request_id: str, reason: FinishReason, timings: RequestTimings) -> None:
        """Engine finish observer: counts every request, observes latencies that are real.

        Every request counts in ``requests_total`` by reason and its tokens in
        the token counters (tokens streamed before a cancel were generated).
        A request that produced no token has no TTFT, so it stays out of every
        latency histogram. E2E and decode time are observed only for stop and
        length: a cancel or an error cuts the generation short.
        """
        child = self._requests_by_reason.get(reason)
        (child if child is not None else self.requests.labels(reason)).inc()
        self.prompt_tokens.inc(timings.prompt_tokens)
        self.prompt_tokens_cached.inc(timings.cached_tokens)
        if timings.acceptance_rate is not None:
            self.spec_acceptance.observe(timings.acceptance_rate)
        if timings.draft_stopped:
            self.spec_stopped.inc()
        self.generation_tokens.inc(timings.generated_tokens)
        if timings.generated_tokens < 1:
            return
        self.queue_time.observe(timings.queue_ms * _MS)
        self.prefill_time.observe(timings.prefill_ms * _MS)
        self.ttft.observe(timings.ttft_ms * _MS)
        if timings.tpot_ms is not None:
            self.tpot.observe(timings.tpot_ms * _MS)
        observe_itl = self.itl.observe
        for gap_ms in timings.itl_ms:
            observe_itl(gap_ms * _MS)
        if reason in COMPLETE_REASONS:
            self.e2e.observe(timings.e2e_ms * _MS)
            self.decode_time.observe(timings.decode_ms * _MS)

    def observe_http(self, method: str, route: str, status: int, seconds: float) -> None:
        """Count one HTTP request; ``route`` must be the template (``/v1/models/{model}``).
        A method outside HTTP_METHODS counts as ``_OTHER``: the parser passes on every
        method it knows (PROPFIND, MKCOL, PURGE, ... some thirty), each a series of
        its own per route, and any client may send them."""
        method = method if method in HTTP_METHODS else OTHER_METHOD
        self.http_requests.labels(method, route, str(status)).inc()
        self.http_duration.labels(method, route).observe(seconds)

    # -- exposition --------------------------------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The body and content type for ``GET /metrics``."""
        return generate_latest(self.registry), CONTENT_TYPE
