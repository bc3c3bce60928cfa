"""What the telemetry sampler costs: CPU time of the sampling thread at 50 Hz.

Runs the real Sampler with the real sources for a while, with nothing else
running in the process, and reports the process CPU time it consumed as a
share of one core. The cases: a bare thread that keeps the same schedule and
reads nothing (the floor the machine sets), each source, and the cpu source
with what `orin-llm serve` hangs on the sampler (live phase attribution
feeding the Prometheus phase counters; the engine idle, so every sample goes
to the idle phase). The cases take turns, ``--reps`` times; the figures are
medians. The Jetson source reads a fake AGX Orin (JetPack 6 layout with power
rails and EMC) built in tmpfs (/dev/shm), so the figure covers the Python
side (file reads, parsing); on a board, reading INA3221 rails also costs I2C
time in the kernel.

    .venv/bin/python -m benchmarks.telemetry_overhead [--seconds 10] [--reps 5] [--hz 50]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry

from orin.system.commands import SubprocessRunner
from orin.telemetry.metrics import PhaseMetrics
from orin.telemetry.sampler import Sampler
from orin.telemetry.sources import select_source
from orin.telemetry.tracker import PhaseTracker
from tests.fakes.boards_telemetry import agx_orin_64gb


def measure(
    name: str, root_base: Path | None, seconds: float, hz: float, attributed: bool = False
) -> dict[str, float]:
    from orin.system.root import SysRoot

    root = SysRoot(root_base) if root_base else SysRoot()
    source, _ = select_source(name, root, SubprocessRunner())
    sampler = Sampler(source, hz)
    if attributed:  # what `serve` adds: live phase attribution into Prometheus counters
        tracker = PhaseTracker(sampler, lambda: None)
        tracker.observers.append(PhaseMetrics(CollectorRegistry(), source.name).observe)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return figures(len(sampler.samples()), cpu, wall, sampler.missed_ticks)


def figures(n: int, cpu: float, wall: float, missed: int) -> dict[str, float]:
    """One run's figures from its sample count, CPU seconds and wall seconds."""
    return {
        "samples": n,
        "achieved_hz": n / wall,
        "cpu_seconds": cpu,
        "share_of_one_core": cpu / wall,
        "us_per_sample": 1e6 * cpu / max(n, 1),
        "missed_ticks": missed,
    }


FLOOR = "bare thread on the same schedule (the floor)"


def measure_bare(seconds: float, hz: float) -> dict[str, float]:
    """The floor: a thread that keeps the same schedule and reads nothing."""
    import threading

    stop = threading.Event()

    def loop() -> None:
        period, next_tick = 1.0 / hz, time.perf_counter()
        while not stop.is_set():
            next_tick += period
            time.sleep(max(next_tick - time.perf_counter(), 0.0))

    thread = threading.Thread(target=loop, daemon=True)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return figures(int(wall * hz), cpu, wall, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="Length of one run.")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hz", type=float, default=50.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {}
    # sysfs is an in-memory file system: build the fake board in tmpfs when there is one
    shm = Path("/dev/shm")
    with tempfile.TemporaryDirectory(dir=shm if shm.is_dir() else None) as tmp:
        board = agx_orin_64gb(Path(tmp) / "board", jetpack=6, emc=True)
        cases: dict[str, Callable[[], dict[str, float]]] = {
            FLOOR: lambda: measure_bare(args.seconds, args.hz),
            "jetson_sysfs (fake AGX Orin, JetPack 6)": lambda: measure(
                "jetson_sysfs", board.base, args.seconds, args.hz
            ),
            "cpu (/proc/stat, process clock)": lambda: measure("cpu", None, args.seconds, args.hz),
            "cpu, with phase attribution and metrics (as in serve)": lambda: measure(
                "cpu", None, args.seconds, args.hz, attributed=True
            ),
        }
        for rep in range(args.reps):  # interleaved, so the machine's drift hits all alike
            for name, run in cases.items():
                runs.setdefault(name, []).append(run())
                print(f"  rep {rep + 1}: {name}", file=sys.stderr, flush=True)
    print(
        f"{args.reps} interleaved runs of {args.seconds:g} s each; median (min–max)\n\n"
        "| source | rate | CPU per sample | share of one core |\n|---|---:|---:|---:|"
    )
    summary = {}
    for name, rs in runs.items():
        shares = [100 * r["share_of_one_core"] for r in rs]
        per = statistics.median(r["us_per_sample"] for r in rs)
        summary[name] = {"share_pct": statistics.median(shares), "runs": rs}
        print(
            f"| {name} | {args.hz:g} Hz | {per:.0f} µs | {statistics.median(shares):.2f} % "
            f"({min(shares):.2f}–{max(shares):.2f}) |"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
