"""orin-llm bench: a load generator for any OpenAI-compatible completions server.

``LoadSpec`` says what to send, ``run`` sends it and returns a ``BenchRun``
whose ``summary()`` holds the figures of docs/metrics.md under vLLM's keys.
"""

from orin.bench.loadgen import BenchRun, LoadSpec, run, run_bench
from orin.bench.server import BenchError, ServerInfo
from orin.bench.stats import SLO, RequestResult, by_bucket, percentile, summarize

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
