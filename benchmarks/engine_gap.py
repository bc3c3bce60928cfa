"""The engine thread's time between two ``llama_decode`` calls, one stream.

On a CPU build the decode threads hold every core, so whatever the engine does
between two decodes (scheduling, the batch, sampling, the token's bookkeeping,
handing it to its consumer) adds to every token; on a board's GPU it is the
CPU time the decode waits for. This runs the engine alone (no server, no
event loop) on a generated demo model, greedy, one request at a time, and
times each ``llama_decode`` + ``llama_synchronize`` (``Runner._run``): the gap
is the time from the end of one to the start of the next, taken over the
steady decode steps of each request (its prefill and first two decodes left
out).

    .venv/bin/python -m benchmarks.engine_gap [--quant f16] [--size medium]
        [--threads 2] [--requests 20] [--tokens 128] [--json FILE]

Figures move by ±10 % from run to run on a shared machine: compare two
versions by alternating runs (``git stash`` between them) and by their medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import dataclass, replace
from itertools import pairwise
from pathlib import Path

from benchmarks.engine_throughput import _timed, bench_config
from orin.engine.engine import Engine
from orin.engine.types import SamplingParams
from orin.model import demo

SKIP = 3  # decodes of each request left out: its prompt and the first two tokens


@dataclass(frozen=True)
class Gaps:
    """Microseconds between two decodes and in each decode, over steady steps."""

    gaps_us: list[float]
    decodes_us: list[float]

    def summary(self) -> dict[str, float]:
        g = sorted(self.gaps_us)
        return {
            "gap_median_us": statistics.median(g),
            "gap_p10_us": g[len(g) // 10],
            "gap_p90_us": g[9 * len(g) // 10],
            "decode_median_us": statistics.median(self.decodes_us),
            "steps": float(len(g)),
        }


def measure(path: Path, threads: int, requests: int, tokens: int) -> Gaps:
    cfg = replace(bench_config(path, 8, "on"), threads=threads, threads_batch=threads)
    calls: list[tuple[int, int]] = []  # (start, duration) of each decode in ns
    gaps: list[float] = []
    decodes: list[float] = []
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    with Engine(cfg) as eng:
        runner = eng.runner
        assert runner is not None
        runner._run = _timed(runner._run, calls)  # type: ignore[method-assign]
        eng.generate("Warm-up on the edge board.", params)
        for i in range(requests):
            calls.clear()
            eng.generate(f"Single stream {i} on the edge board.", params)
            steady = calls[SKIP:]
            gaps += [(b[0] - a[0] - a[1]) / 1e3 for a, b in pairwise(steady)]
            decodes += [d / 1e3 for _, d in steady]
    return Gaps(gaps, decodes)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", default="f16", help="demo model quantization")
    ap.add_argument("--size", default="medium", help="demo model size (tiny, small, medium)")
    ap.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 2))
    ap.add_argument("--requests", type=int, default=20, help="requests, one after another")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--json", type=Path, help="write the figures and every gap to this file")
    a = ap.parse_args(argv)
    if a.tokens <= SKIP + 1:
        ap.error(f"--tokens must exceed {SKIP + 1}")
    path = demo.ensure(a.size, a.quant)
    gaps = measure(path, a.threads, a.requests, a.tokens)
    s = gaps.summary()
    print(
        f"{path.name}, {a.threads} threads: gap between decodes median {s['gap_median_us']:.1f} us "
        f"(p10 {s['gap_p10_us']:.1f}, p90 {s['gap_p90_us']:.1f}) over {int(s['steps'])} steps; "
        f"decode median {s['decode_median_us']:.1f} us"
    )
    if a.json is not None:
        out = {**s, "gaps_us": gaps.gaps_us, "settings": vars(a) | {"json": None}}
        a.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
