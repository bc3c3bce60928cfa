"""The engine's gap between two steps under the HTTP server, with a step's events handed
to the event loop just before the next decode (``Engine.hold_events``, the default where
the decode leaves the loop a core) and at the end of the step.

Two ``orin-llm serve`` servers on one generated demo model, one with each setting, up
at once; bursts of ``--streams`` streaming completions go to each in turns, with new
prompts every round (the same for both). Each server writes its steps' start and end
times (a step observer, the clock the client reads too); the gaps counted are those
between two steps inside a burst, from its first request to its last token. Per
setting: the gap's median, p90 and maximum, the median TPOT and the median of each
burst's median TTFT, as the client saw them.

    .venv/bin/python -m benchmarks.step_gaps [--quant f16] [--size medium]
        [--streams 4] [--rounds 16] [--tokens 64] [--threads N] [--json FILE]

``--threads 1`` on a 2-core machine leaves the event loop a core of its own while the
decode runs, which is closer to a board whose GPU decodes.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import peers
from benchmarks import scenarios as sc
from orin.bench.client import Timed, streams
from orin.model import demo

SETTINGS = {"before_decode": True, "step_end": False}  # name -> Engine.hold_events


@dataclass(frozen=True)
class Arm:
    gaps_us: list[float]
    tpot_ms: list[float]
    ttft_ms: list[float]  # each burst's median

    def summary(self) -> dict[str, float]:
        g = sorted(self.gaps_us)
        return {
            "gap_median_us": statistics.median(g),
            "gap_p90_us": g[9 * len(g) // 10],
            "gap_max_us": g[-1],
            "gaps": float(len(g)),
            "tpot_median_ms": statistics.median(self.tpot_ms),
            "ttft_median_ms": statistics.median(self.ttft_ms),
        }


def serve(port: int, profile: Path, model: Path, hold: bool, steps: Path) -> None:
    """The child: ``orin-llm serve`` on ``port`` with ``hold_events`` set, its steps'
    start and end (ns) appended to ``steps``."""
    from orin.engine.engine import Engine
    from orin.engine.types import StepStats
    from orin.profile.loader import load_profile
    from orin.server.main import bind_socket, build_server

    loaded = load_profile(profile)
    loaded.server.port = port
    sock = bind_socket(loaded.server.host, port)
    server, state = build_server(loaded, model)
    engine = state.engine
    assert isinstance(engine, Engine)
    engine.hold_events = hold
    out = open(steps, "a", buffering=1)  # noqa: SIM115 (open for the server's life)

    def record(s: StepStats) -> None:
        out.write(f"{s.start_ns} {s.end_ns}\n")

    engine.add_step_observer(record)
    engine.start()
    try:
        server.run(sockets=[sock])
    finally:
        engine.stop(drain=False, timeout=5)
        out.close()


def gaps_in(steps: list[tuple[int, int]], bursts: list[list[Timed]]) -> list[float]:
    """Microseconds between one step's end and the next one's start, for the steps
    that start inside a burst (from its first request to its last token)."""
    out: list[float] = []
    for burst in bursts:
        t0 = min(r.t0 for r in burst) * 1e9
        t1 = max(r.token_times[-1] for r in burst if r.token_times) * 1e9
        inside = [s for s in steps if t0 <= s[0] <= t1]
        out += [(b[0] - a[1]) / 1e3 for a, b in itertools.pairwise(inside)]
    return out


def measure(
    model: Path, k: int, rounds: int, tokens: int, threads: int | None, work: Path
) -> dict[str, Arm]:
    s = peers.settings(model)
    if threads:
        s = replace(s, threads=threads)
    own = peers.orin_profile("step-gaps", s.threads)
    own["engine"] |= {"slots": s.slots, "n_ctx": s.ctx_per_slot}
    profile = peers.write_profile(own, work)
    logs: dict[str, Path] = {}

    def argv(name: str, port: int) -> list[str]:
        logs[name] = work / f"{name}.steps"
        return [sys.executable, "-m", "benchmarks.step_gaps", "--serve", str(port),
                "--profile", str(profile), "--model", str(model), "--steps", str(logs[name]),
                "--hold", str(int(SETTINGS[name]))]  # fmt: skip

    servers = {n: peers.Peer.make(n, functools.partial(argv, n), work) for n in SETTINGS}
    got: dict[str, list[list[Timed]]] = {n: [] for n in SETTINGS}
    with peers.running(servers["before_decode"]) as a, peers.running(servers["step_end"]) as b:
        urls = {"before_decode": a.url, "step_end": b.url}
        for url in urls.values():
            peers.concurrent(url, 2, 8)  # warm-up
        for name in sc.in_turns(list(urls), rounds, 0):
            j = len(got[name])
            prompts = [f"Stream {i} of burst {j} on the edge board." for i in range(k)]
            _, res = streams(urls[name], prompts, tokens)
            if any(r.error for r in res):
                raise RuntimeError(f"{name}: {[r.error for r in res if r.error]}")
            got[name].append(res)
    out = {}
    for name, bursts in got.items():
        lines = (line.split() for line in logs[name].read_text().splitlines())
        out[name] = Arm(
            gaps_in([(int(start), int(end)) for start, end in lines], bursts),
            [t for burst in bursts for r in burst if (t := r.tpot_ms) is not None],
            [statistics.median(r.ttft_ms or 0.0 for r in burst) for burst in bursts],
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quant", default="f16")
    ap.add_argument("--size", default="medium")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp threads (default: all)")
    ap.add_argument("--json", type=Path)
    child = ap.add_argument_group("the servers (internal)")
    for flag in ("--serve", "--hold"):
        child.add_argument(flag, type=int, help=argparse.SUPPRESS)
    for flag in ("--profile", "--model", "--steps"):
        child.add_argument(flag, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.profile, args.model, bool(args.hold), args.steps)
        return 0
    model = demo.ensure(args.size, args.quant)
    with tempfile.TemporaryDirectory(prefix="orin-step-gaps-") as tmp:
        arms = measure(model, args.streams, args.rounds, args.tokens, args.threads, Path(tmp))
    result: dict[str, Any] = {
        "model": model.name,
        "streams": args.streams,
        "rounds": args.rounds,
        "threads": args.threads,
        "cores": len(os.sched_getaffinity(0)),
    }
    for name, arm in arms.items():
        f = result[name] = arm.summary()
        print(
            f"{name}: gap median {f['gap_median_us']:.0f} us, p90 {f['gap_p90_us']:.0f}, "
            f"max {f['gap_max_us']:.0f} over {f['gaps']:.0f}; TPOT {f['tpot_median_ms']:.2f} ms; "
            f"burst TTFT {f['ttft_median_ms']:.1f} ms"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
