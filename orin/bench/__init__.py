"""orin-llm bench: a load generator for any OpenAI-compatible completions server.

``LoadSpec`` says what to send, ``run`` sends it and returns a ``BenchRun``
whose ``summary()`` holds the figures of docs/metrics.md under vLLM's keys.
The names load on first use, so the CLI starts without the HTTP client stack.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orin.bench.loadgen import BenchRun, LoadSpec, run, run_bench
    from orin.bench.server import BenchError, ServerInfo
    from orin.bench.stats import SLO, RequestResult, by_bucket, percentile, summarize

_WHERE = {
    "BenchRun": "loadgen",
    "LoadSpec": "loadgen",
    "run": "loadgen",
    "run_bench": "loadgen",
    "BenchError": "server",
    "ServerInfo": "server",
    "SLO": "stats",
    "RequestResult": "stats",
    "by_bucket": "stats",
    "percentile": "stats",
    "summarize": "stats",
}
__all__ = [
    "SLO",
    "BenchError",
    "BenchRun",
    "LoadSpec",
    "RequestResult",
    "ServerInfo",
    "by_bucket",
    "percentile",
    "run",
    "run_bench",
    "summarize",
]


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'orin.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f"orin.bench.{_WHERE[name]}"), name)
