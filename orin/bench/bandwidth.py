"""Memory-bandwidth utilization of a benchmark run's decode phase.

Decode is memory-bound: every step reads the weights once and each stream's
attended K and V cells (orin.model.traffic). From the client's own timestamps
the run gives the decode steps per second and how many streams shared a step;
with the model file, that is the bytes per second the server moved, set against
the machine's memory bandwidth (orin.system.membw):

- a request decodes from its first token to its last: ``n_out - 1`` steps in
  ``E2EL - TTFT`` (TPOT per step);
- steps/s = sum of decode steps / sum of decode time, i.e. 1000 / TPOT pooled over
  the tokens: for one stream exactly the TPOT's rate, and with several streams in
  flight each step advances every one of them, so the same ratio is the server's
  step rate;
- streams per step = sum of decode time / the time at least one request was
  decoding (the time-weighted mean of streams in flight);
- attended cells per stream = the prompt plus half the output (the mean context
  over the decode steps), weighted by steps;
- bytes per step = ``decode_bytes_per_batch`` at that many streams (weights once,
  KV per stream), interpolated between the whole stream counts around the mean;
- achieved bytes/s = bytes per step x steps/s; utilization = achieved / bandwidth.

Prefill chunks that share a step with decoding streams lengthen TPOT without
counting as decode traffic, so under mixed load the figure reads low.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orin.bench.stats import RequestResult
from orin.errors import OrinError
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.traffic import decode_bytes_per_batch
from orin.system.membw import GB, SOURCE_UNKNOWN, Bandwidth, memory_bandwidth

DEFAULT_KV_TYPE = "f16"  # llama.cpp's (and llama-server's) default cache type


@dataclass(frozen=True)
class DecodeLoad:
    """What the client saw of the decode phase."""

    steps: int  # decode steps summed over requests (tokens after the first)
    seconds: float  # decode time summed over requests
    busy_seconds: float  # wall time at least one request was decoding
    mean_kv_cells: float  # attended cells per stream, weighted by steps

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds > 0 else 0.0

    @property
    def streams(self) -> float:
        return self.seconds / self.busy_seconds if self.busy_seconds > 0 else 0.0


def decode_load(results: Sequence[RequestResult]) -> DecodeLoad | None:
    """The decode figures of the successful requests with at least two tokens."""
    intervals: list[tuple[float, float]] = []
    steps, seconds, cells = 0, 0.0, 0.0
    for r in results:
        if not r.ok or r.ttft_ms is None or r.e2el_ms is None or r.output_tokens < 2:
            continue
        n = r.output_tokens - 1
        start = r.start_s + r.ttft_ms / 1000
        end = r.start_s + r.e2el_ms / 1000
        if end <= start:
            continue
        intervals.append((start, end))
        steps += n
        seconds += end - start
        prompt = r.prompt_tokens if r.prompt_tokens is not None else r.input_len
        cells += n * (prompt + r.output_tokens / 2)  # step j attends prompt + j, j = 1..n
    if not steps:
        return None
    return DecodeLoad(steps, seconds, union_seconds(intervals), cells / steps)


def union_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    total, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def bytes_per_step(
    info: ModelInfo, streams: float, kv_cells: float, type_k: str, type_v: str
) -> float:
    """decode_bytes_per_batch at a mean stream count: linear between the whole counts
    around it (exact for dense models, whose bytes grow linearly per stream)."""
    cells = max(0, round(kv_cells))
    lo = max(1, math.floor(streams))
    hi = max(lo, math.ceil(streams))
    low = decode_bytes_per_batch(info, [cells] * lo, type_k, type_v)
    if hi == lo:
        return float(low)
    high = decode_bytes_per_batch(info, [cells] * hi, type_k, type_v)
    return low + (streams - lo) * (high - low)


@dataclass(frozen=True)
class Utilization:
    """A run's decode traffic against the memory bandwidth."""

    model_file: str
    type_k: str
    type_v: str
    streams: float
    mean_kv_cells: float
    bytes_per_step: float
    steps_per_s: float
    bandwidth: Bandwidth

    @property
    def achieved_bytes_per_s(self) -> float:
        return self.bytes_per_step * self.steps_per_s

    @property
    def utilization(self) -> float | None:
        """Achieved / available, a fraction; None without a bandwidth figure."""
        if not self.bandwidth.known:
            return None
        return self.achieved_bytes_per_s / self.bandwidth.bytes_per_s

    def to_json(self) -> dict[str, Any]:
        util = self.utilization
        return {
            "model_file": self.model_file,
            "type_k": self.type_k,
            "type_v": self.type_v,
            "decode_streams": self.streams,
            "mean_kv_cells": self.mean_kv_cells,
            "decode_bytes_per_step": round(self.bytes_per_step),
            "decode_steps_per_s": self.steps_per_s,
            "achieved_gb_per_s": self.achieved_bytes_per_s / GB,
            "mem_bandwidth_gb_per_s": self.bandwidth.gb_per_s if self.bandwidth.known else None,
            "mem_bandwidth_source": self.bandwidth.source,
            "mem_bandwidth_detail": self.bandwidth.detail,
            "utilization_pct": 100 * util if util is not None else None,
        }


def utilization(
    results: Sequence[RequestResult],
    info: ModelInfo,
    type_k: str,
    type_v: str,
    bandwidth: Bandwidth,
) -> Utilization | None:
    """The run's decode traffic, or None when no request decoded two tokens."""
    load = decode_load(results)
    if load is None:
        return None
    return at_rate(
        info, load.streams, load.mean_kv_cells, load.steps_per_s, type_k, type_v, bandwidth
    )


@dataclass(frozen=True)
class ModelSource:
    """The served model's file and KV cache types, and where the bench learnt them."""

    path: Path
    type_k: str
    type_v: str
    source: str  # "--model-file" or "server"

    def info(self) -> ModelInfo:
        return read_model_info(self.path)


def model_source(
    model_file: Path | None,
    meta: dict[str, Any],
    type_k: str | None = None,
    type_v: str | None = None,
) -> tuple[ModelSource | None, str | None]:
    """The model to count bytes for: ``model_file`` when given, else the file an
    orin-llm server names in /v1/models (``meta``) when it exists here. KV types:
    the ones given, else the server's, else f16. Returns (source, why not)."""
    k = type_k or _str(meta.get("type_k")) or DEFAULT_KV_TYPE
    v = type_v or _str(meta.get("type_v")) or DEFAULT_KV_TYPE
    if model_file is not None:
        return ModelSource(model_file, k.lower(), v.lower(), "--model-file"), None
    served = _str(meta.get("file"))
    if served is None:
        return None, "no model file: give --model-file PATH for the bandwidth figures"
    if not Path(served).is_file():
        return None, (
            f"the server's model file {served} is not on this machine: "
            "give --model-file PATH for the bandwidth figures"
        )
    return ModelSource(Path(served), k.lower(), v.lower(), "server"), None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]", "0.0.0.0"})


def is_local(base_url: str) -> bool:
    """Whether the server runs on this machine (so this machine's bandwidth is its own)."""
    from urllib.parse import urlsplit

    host = (urlsplit(base_url).hostname or "").lower()
    return host in LOCAL_HOSTS or host.startswith("127.")


@dataclass(frozen=True)
class BandwidthRequest:
    """What the bench was told about the served model and the machine (all optional)."""

    model_file: Path | None = None
    type_k: str | None = None
    type_v: str | None = None
    mem_bandwidth_gbps: float | None = None  # the server machine's, when not this one's


def machine_bandwidth(ask: BandwidthRequest, base_url: str) -> Bandwidth:
    """The bandwidth to compare with: the one given, else this machine's when the server
    runs here (data sheet or copy probe), else unknown."""
    if ask.mem_bandwidth_gbps is not None:
        return Bandwidth(ask.mem_bandwidth_gbps * GB, "given", "--mem-bandwidth")
    if not is_local(base_url):
        return Bandwidth(
            0.0, SOURCE_UNKNOWN, "the server is not on this machine: give --mem-bandwidth"
        )
    return memory_bandwidth()


def run_utilization(
    results: Sequence[RequestResult], base_url: str, meta: dict[str, Any], ask: BandwidthRequest
) -> tuple[Utilization | None, str | None]:
    """A finished run's bandwidth figures, or None and the reason."""
    source, why = model_source(ask.model_file, meta, ask.type_k, ask.type_v)
    if source is None:
        return None, why
    try:
        info = source.info()
        if decode_load(results) is None:
            return None, "no request decoded two tokens: no decode steps to count"
        util = utilization(
            results, info, source.type_k, source.type_v, machine_bandwidth(ask, base_url)
        )
    except OrinError as exc:
        return None, f"no bandwidth figures: {exc}"
    return util, None


def at_rate(
    info: ModelInfo,
    streams: float,
    kv_cells: float,
    steps_per_s: float,
    type_k: str,
    type_v: str,
    bandwidth: Bandwidth,
) -> Utilization:
    """The figures for a known step rate (the benchmarks' engine and server runs)."""
    return Utilization(
        model_file=info.path,
        type_k=type_k,
        type_v=type_v,
        streams=streams,
        mean_kv_cells=kv_cells,
        bytes_per_step=bytes_per_step(info, streams, kv_cells, type_k, type_v),
        steps_per_s=steps_per_s,
        bandwidth=bandwidth,
    )


def describe(u: Utilization) -> str:
    """One line: bytes per step x steps/s = GB/s, and the share of the bandwidth."""
    util = u.utilization
    share = (
        f"{100 * util:.1f}% of {u.bandwidth.gb_per_s:.1f} GB/s ({u.bandwidth.source})"
        if util is not None
        else "memory bandwidth unknown"
    )
    return (
        f"{u.bytes_per_step / 2**20:.1f} MiB/step x {u.steps_per_s:.2f} steps/s = "
        f"{u.achieved_bytes_per_s / GB:.2f} GB/s, {share}"
    )
