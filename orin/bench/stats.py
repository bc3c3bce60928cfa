"""Per-request results and their aggregates, as docs/metrics.md defines them.

Pure functions over plain numbers, so every figure can be checked against a
hand-computed vector. Percentiles interpolate linearly (``numpy.percentile``'s
default) and the JSON keys follow vLLM's saved benchmark results
(``p95_ttft_ms``, ``median_tpot_ms``, ``mean_itl_ms``, ``output_throughput``,
``request_goodput``), so figures compare directly with published ones.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")
SLO_KEYS = ("ttft_p95_ms", "tpot_p90_ms")


@dataclass(frozen=True)
class RequestResult:
    """One measured request. Times are client-side milliseconds from ``t0``, the
    moment the request was sent (after any client-side concurrency limit)."""

    index: int
    input_len: int  # the bucket asked for
    ok: bool
    error: str | None = None
    prompt_tokens: int | None = None  # the server's count, when it reports one
    output_tokens: int = 0  # n_out: the server's count when reported (see count_source)
    count_source: str = "none"  # usage, timings, token_ids or chunks
    ttft_ms: float | None = None
    e2el_ms: float | None = None
    itl_ms: tuple[float, ...] = ()
    start_s: float = 0.0  # send time, seconds after the run started
    server: dict[str, Any] = field(default_factory=dict)  # the server's own timings block

    @property
    def tpot_ms(self) -> float | None:
        return tpot_ms(self.ttft_ms, self.e2el_ms, self.output_tokens)


def tpot_ms(ttft: float | None, e2el: float | None, n_out: int) -> float | None:
    """(E2EL - TTFT) / (n_out - 1): the first token ends prefill, so it is not a decode
    step and is left out; undefined below two tokens."""
    if ttft is None or e2el is None or n_out < 2:
        return None
    return (e2el - ttft) / (n_out - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks, exactly as ``numpy.percentile``."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    """mean, median, std and the fixed percentiles of one latency, in its own unit."""
    if not values:
        out: dict[str, float | None] = {"mean": None, "median": None, "std": None}
        out.update({f"p{p}": None for p in PERCENTILES})
        return out
    arr = np.asarray(values, dtype=np.float64)
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    out.update({f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES})
    return out


@dataclass(frozen=True)
class SLO:
    """Latency targets. Goodput counts a request as good when its own TTFT and TPOT
    are within the targets (vLLM's per-request rule); ``check`` compares the run's
    percentiles with them (the profile's rule)."""

    ttft_p95_ms: float | None = None
    tpot_p90_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """``ttft_p95_ms=200,tpot_p90_ms=50`` -> SLO; unknown keys raise ValueError."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for item in text.split(","):
            key, sep, value = item.strip().partition("=")
            if not sep or key.strip() not in SLO_KEYS:
                raise ValueError(f"{item!r}: expected one of {', '.join(SLO_KEYS)} as key=ms")
            number = float(value)
            if not 0 < number < math.inf:  # nan too: no request would ever meet it
                raise ValueError(f"{key}: a target must be positive and finite")
            values[key.strip()] = number
        return cls(**values)

    @property
    def empty(self) -> bool:
        return self.ttft_p95_ms is None and self.tpot_p90_ms is None

    def request_meets(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_p95_ms is not None and (r.ttft_ms is None or r.ttft_ms > self.ttft_p95_ms):
            return False
        tpot = r.tpot_ms
        return self.tpot_p90_ms is None or tpot is None or tpot <= self.tpot_p90_ms

    def check(self, summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """Per target: the target, the run's percentile, and whether it is met."""
        out = {}
        for key, metric in (("ttft_p95_ms", "p95_ttft_ms"), ("tpot_p90_ms", "p90_tpot_ms")):
            target = getattr(self, key)
            if target is None:
                continue
            measured = summary.get(metric)
            out[key] = {
                "target": target,
                "measured": measured,
                "met": measured is not None and measured <= target,
            }
        return out


def goodput(results: Iterable[RequestResult], slo: SLO, duration_s: float) -> float | None:
    """Requests meeting every SLO per second of wall time; None without targets."""
    if slo.empty or duration_s <= 0:
        return None
    return sum(1 for r in results if slo.request_meets(r)) / duration_s


def latency_keys(results: Sequence[RequestResult]) -> dict[str, float | None]:
    """``mean_ttft_ms``, ``p95_tpot_ms``, ... over the successful requests; ITL is
    pooled over all of them."""
    ok = [r for r in results if r.ok]
    series: dict[str, list[float]] = {
        "ttft": [r.ttft_ms for r in ok if r.ttft_ms is not None],
        "tpot": [t for r in ok for t in [r.tpot_ms] if t is not None],
        "itl": [g for r in ok for g in r.itl_ms],
        "e2el": [r.e2el_ms for r in ok if r.e2el_ms is not None],
    }
    out: dict[str, float | None] = {}
    for name in LATENCIES:
        for stat, value in distribution(series[name]).items():
            out[f"{stat}_{name}_ms"] = value
    return out


def summarize(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    """The run's figures under vLLM's keys, plus failure counts and the SLO check."""
    ok = [r for r in results if r.ok]
    n_in = sum(r.prompt_tokens or 0 for r in ok)
    n_out = sum(r.output_tokens for r in ok)
    per_s = (lambda n: n / duration_s) if duration_s > 0 else (lambda n: 0.0)
    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(Counter(r.error or "unknown" for r in results if not r.ok)),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "request_throughput": per_s(len(ok)),
        "request_goodput": goodput(results, slo, duration_s),
        "output_throughput": per_s(n_out),
        "total_token_throughput": per_s(n_in + n_out),
        "count_sources": dict(Counter(r.count_source for r in ok)),
    }
    out.update(latency_keys(results))
    out["slo"] = slo.check(out)
    return out


def by_bucket(results: Sequence[RequestResult]) -> dict[int, dict[str, Any]]:
    """Latency figures per requested input length; throughput only makes sense for the
    whole run, whose requests of all lengths shared the server."""
    out: dict[int, dict[str, Any]] = {}
    for length in sorted({r.input_len for r in results}):
        part = [r for r in results if r.input_len == length]
        ok = [r for r in part if r.ok]
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        out[length] = {
            "completed": len(ok),
            "failed": len(part) - len(ok),
            "mean_input_tokens": float(np.mean(prompts)) if prompts else None,
            "mean_output_tokens": float(np.mean([r.output_tokens for r in ok])) if ok else None,
            **latency_keys(part),
        }
    return out
