"""The load generator: closed loop (N streams in flight) or open loop (Poisson arrivals).

Every request is planned before the run (its input length, arrival time and
prompt seed), so two runs with the same seed send the same prompts in the same
order; a prompt is built on its worker thread just before it is sent, so the
prompts held at once are the ones in flight. ``t0`` of a request is when it
is sent, after any client-side concurrency limit; server-side queueing is then
part of TTFT, as docs/metrics.md defines it. The run's duration is from the
first send to the last response. Warm-up requests run first and are not
measured.

The schedule is asyncio's; each request is one blocking stream (client.py's
lean client) on a worker thread of a pool sized so that the pool is never the
limit: N threads for a closed loop of N, and for an open loop one per request
(up to OPEN_LOOP_THREADS), so an arrival never waits for a free worker. A
cancelled run (Ctrl-C) closes the connections in flight at once, so that the
threads blocked reading them end without waiting for the server.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from orin.bench.bandwidth import BandwidthRequest, Utilization, run_utilization
from orin.bench.client import Connections, Target, send
from orin.bench.server import ServerInfo, phase_delta, probe, scrape
from orin.bench.stats import SLO, RequestResult, by_bucket, summarize

ResultCallback = Callable[[RequestResult], None]
UTIL_KEYS = ("prefill_gpu_util", "decode_gpu_util", "prefill_cpu_util", "decode_cpu_util")
OPEN_LOOP_THREADS = 1024  # streams in flight at most, with a rate and no --concurrency
MAX_INPUT_LEN = 1 << 20  # tokens: orin-llm's largest context (serve --ctx)


@dataclass(frozen=True)
class LoadSpec:
    """What to send and how fast."""

    url: str
    num_requests: int
    input_lens: tuple[int, ...]
    output_len: int
    concurrency: int | None = None  # closed loop; with request_rate, a cap
    request_rate: float | None = None  # requests/s, Poisson; None = all at once
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier, > 1 steadier
    warmup: int = 1
    seed: int = 0
    model: str | None = None
    api_key: str | None = None
    timeout_s: float = 600.0
    slo: SLO = field(default_factory=SLO)
    bandwidth: BandwidthRequest = field(default_factory=BandwidthRequest)

    def check(self) -> None:
        """Reject impossible settings before anything is sent."""
        if self.num_requests < 1 or self.output_len < 1 or self.warmup < 0:
            raise ValueError("num-requests and output-len must be >= 1, warmup >= 0")
        if not self.input_lens or min(self.input_lens) < 1:
            raise ValueError("input lengths must be >= 1 token")
        if max(self.input_lens) > MAX_INPUT_LEN:
            raise ValueError(f"input lengths must be at most {MAX_INPUT_LEN} tokens")
        if self.concurrency is None and self.request_rate is None:
            raise ValueError("give --concurrency N (closed loop) or --request-rate R (open loop)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.request_rate is not None and not self.request_rate > 0:  # nan too
            raise ValueError("the request rate must be positive (inf: all at once)")
        if not 0 < self.burstiness < math.inf:
            raise ValueError("burstiness must be positive and finite")
        if not 1 <= self.timeout_s < math.inf:
            raise ValueError("the timeout must be a finite number of seconds, at least 1")
        gbps = self.bandwidth.mem_bandwidth_gbps
        if gbps is not None and not 0 < gbps < math.inf:
            raise ValueError("the memory bandwidth must be positive and finite")

    @property
    def all_at_once(self) -> bool:
        """No arrival schedule: a closed loop, or --request-rate inf."""
        return self.request_rate is None or math.isinf(self.request_rate)

    @property
    def base_url(self) -> str:
        base = self.url.rstrip("/")
        return base[: -len("/v1")] if base.endswith("/v1") else base

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    @property
    def workers(self) -> int:
        """Client threads: the concurrency (closed loop, or an open loop's cap), else
        one per request, warm-up included, so that arrivals are never held back."""
        if self.concurrency is not None:
            return self.concurrency
        return max(1, min(max(self.num_requests, self.warmup), OPEN_LOOP_THREADS))


@dataclass
class BenchRun:
    spec: LoadSpec
    server: ServerInfo
    results: list[RequestResult]
    duration_s: float
    started_at: str
    telemetry: dict[str, Any] | None = None
    bandwidth: Utilization | None = None  # decode traffic against memory bandwidth
    bandwidth_note: str | None = None  # why there are no bandwidth figures

    def summary(self) -> dict[str, Any]:
        return summarize(self.results, self.duration_s, self.spec.slo)

    def to_json(self) -> dict[str, Any]:
        """vLLM-style top-level keys, then the per-bucket figures, telemetry and requests."""
        s = self.spec
        return {
            "date": self.started_at,
            "backend": self.server.kind,
            "base_url": s.base_url,
            "model_id": self.server.model,
            "num_prompts": s.num_requests,
            "input_lens_requested": list(s.input_lens),
            "output_len": s.output_len,
            "max_concurrency": s.concurrency,
            "request_rate": "inf" if s.all_at_once else s.request_rate,  # vLLM's "inf"
            "burstiness": s.burstiness,
            "warmup": s.warmup,
            "seed": s.seed,
            "ignore_eos": self.server.ignore_eos,
            "short_outputs": sum(
                1 for r in self.results if r.ok and r.output_tokens < s.output_len
            ),
            "prompt_method": "token_ids" if self.server.pool is not None else "text",
            "notes": self.server.notes,
            **self.summary(),
            "buckets": {str(k): v for k, v in by_bucket(self.results).items()},
            "server_telemetry": self.telemetry,
            "bandwidth": self.bandwidth_json(),
            "requests": [_request_json(r) for r in self.results],
        }

    def bandwidth_json(self) -> dict[str, Any]:
        """The decode bandwidth figures (orin/bench/bandwidth.py), or a note why not."""
        if self.bandwidth is None:
            return {"note": self.bandwidth_note}
        return {**self.bandwidth.to_json(), "note": self.bandwidth_note}


def _request_json(r: RequestResult) -> dict[str, Any]:
    return {
        "index": r.index,
        "input_len": r.input_len,
        "ok": r.ok,
        "error": r.error,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "count_source": r.count_source,
        "start_s": r.start_s,
        "ttft_ms": r.ttft_ms,
        "tpot_ms": r.tpot_ms,
        "e2el_ms": r.e2el_ms,
        "itl_ms": list(r.itl_ms),
        "server_timings": r.server,
    }


def arrival_offsets(n: int, rate: float | None, burstiness: float, seed: int) -> list[float]:
    """Send times in seconds from the start: gamma-distributed gaps with mean 1/rate
    (shape = burstiness; 1 is a Poisson process), as vLLM's benchmark draws them."""
    if rate is None or math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


def plan(spec: LoadSpec) -> list[int]:
    """The input length of each request: every bucket equally often, in seeded order."""
    lens = [spec.input_lens[i % len(spec.input_lens)] for i in range(spec.num_requests)]
    random.Random(f"order:{spec.seed}").shuffle(lens)
    return lens


@dataclass
class _Held:
    """Arrivals of an uncapped open loop that found every client thread busy (only
    past OPEN_LOOP_THREADS streams in flight): they left late, and the notes say so."""

    count: int = 0


Job = tuple[int, int, float]  # (index, input length, arrival offset in seconds)


def _prompted_send(
    server: ServerInfo, seed: int, target: Target, output_len: int, index: int, length: int,
    start: float,
) -> RequestResult:  # fmt: skip
    """Build the request's prompt (seeded by its index) and send it, on a worker thread:
    only the prompts in flight are held, however long they are."""
    prompt = server.prompt(random.Random(f"prompt:{seed}:{index}"), length)
    return send(target, prompt, output_len, index, length, start)


async def _fire(
    pool: ThreadPoolExecutor,
    server: ServerInfo,
    target: Target,
    jobs: list[Job],
    spec: LoadSpec,
    on_result: ResultCallback | None,
    held: _Held,
) -> tuple[list[RequestResult], float]:
    """Send the jobs; returns results and duration."""
    loop = asyncio.get_running_loop()
    limit = asyncio.Semaphore(spec.workers)  # the concurrency, or the pool's size
    start = time.perf_counter()

    async def one(index: int, length: int, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        if spec.concurrency is None and limit.locked():
            held.count += 1
        async with limit:
            result = await loop.run_in_executor(
                pool, _prompted_send, server, spec.seed, target, spec.output_len, index, length,
                start,
            )  # fmt: skip
        if on_result is not None:
            on_result(result)
        return result

    results = await asyncio.gather(*(one(*job) for job in jobs))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - start


async def run_bench(spec: LoadSpec, on_result: ResultCallback | None = None) -> BenchRun:
    """Probe the server, warm it up, run the load and collect everything; then count the
    decode traffic against the memory bandwidth (bandwidth.py), outside the timed part."""
    spec.check()
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(max_workers=spec.workers, thread_name_prefix="orin-bench")
    live = Connections()
    held = _Held()
    try:
        base, headers = spec.base_url, spec.headers
        server = await loop.run_in_executor(
            pool, probe, base, spec.model, headers, spec.input_lens, spec.seed, spec.timeout_s,
            live, spec.output_len,
        )  # fmt: skip
        target = server.target(base, headers, spec.timeout_s, live)
        if spec.warmup:
            warm = [(-1 - i, spec.input_lens[0], 0.0) for i in range(spec.warmup)]
            await _fire(pool, server, target, warm, spec, None, _Held())
        offsets = arrival_offsets(spec.num_requests, spec.request_rate, spec.burstiness, spec.seed)
        jobs = [(i, length, offsets[i]) for i, length in enumerate(plan(spec))]
        orin = server.kind == "orin-llm"
        before = (
            await loop.run_in_executor(pool, scrape, base, spec.timeout_s, headers)
            if orin
            else None
        )
        started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        results, duration = await _fire(pool, server, target, jobs, spec, on_result, held)
        after = (
            await loop.run_in_executor(pool, scrape, base, spec.timeout_s, headers)
            if before is not None
            else None
        )
    finally:  # after Ctrl-C, nothing left to wait for when the interpreter joins the pool
        live.close_all()
        pool.shutdown(wait=False, cancel_futures=True)
    telemetry = _telemetry(before, after, results, server)
    server.notes += run_notes(results, spec.output_len)
    if held.count:
        server.notes.append(
            f"{held.count} arrivals found all {spec.workers} client threads busy and were sent late"
        )
    util, why = run_utilization(results, spec.base_url, server.meta, spec.bandwidth)
    return BenchRun(spec, server, results, duration, started, telemetry, util, why)


def run_notes(results: list[RequestResult], output_len: int) -> list[str]:
    """What a reader must know about the counts: requests that ended early (a server
    that ignores ignore_eos, or cuts a stream when another request arrives) and
    streams that reported no token counts."""
    ok = [r for r in results if r.ok]
    notes = []
    short = [r for r in ok if r.output_tokens < output_len]
    if short:
        notes.append(
            f"{len(short)} of {len(ok)} completed requests produced fewer than {output_len} "
            f"tokens (as few as {min(r.output_tokens for r in short)})"
        )
    chunks = sum(1 for r in ok if r.count_source == "chunks")
    if chunks:
        notes.append(
            f"{chunks} streams reported no token counts: their output tokens are counted "
            "from stream chunks (low if a chunk carried several tokens)"
        )
    return notes


def _telemetry(
    before: dict[Any, float] | None,
    after: dict[Any, float] | None,
    results: list[RequestResult],
    server: ServerInfo,
) -> dict[str, Any] | None:
    """orin-llm only: per-phase figures from /metrics deltas, and the means of the
    per-request utilization fields of its timings."""
    if server.kind != "orin-llm":
        return None
    phases = phase_delta(before, after) if before is not None and after is not None else None
    per_request: dict[str, float] = {}
    for key in UTIL_KEYS:
        values = [r.server[key] for r in results if r.ok and r.server.get(key) is not None]
        if values:
            per_request[key] = float(np.mean(values))
    if phases is None and not per_request:
        return {"source": None, "note": "the server runs without telemetry (--telemetry off)"}
    return {**(phases or {}), "per_request_mean": per_request}


def run(spec: LoadSpec, on_result: ResultCallback | None = None) -> BenchRun:
    """Blocking wrapper for the CLI and tests."""
    return asyncio.run(run_bench(spec, on_result))
