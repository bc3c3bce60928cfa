"""What the telemetry sampler costs: CPU time of the sampling thread at 50 Hz.

Runs the real Sampler with the real sources for a while, with nothing else
running in the process, and reports the process CPU time it consumed as a
share of one core. The Jetson source reads a fake AGX Orin (JetPack 6 layout
with power rails and EMC) built in a temporary directory, so the figure
covers the Python side (file reads, parsing); on a board, reading INA3221
rails also costs I2C time in the kernel.

    .venv/bin/python -m bench.telemetry_overhead [--seconds 20] [--hz 50]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from orin.system.commands import SubprocessRunner
from orin.telemetry.sampler import Sampler
from orin.telemetry.sources import select_source
from tests.fakeboards_telemetry import agx_orin_64gb


def measure(name: str, root_base: Path | None, seconds: float, hz: float) -> dict[str, float]:
    from orin.system.root import SysRoot

    root = SysRoot(root_base) if root_base else SysRoot()
    source, _ = select_source(name, root, SubprocessRunner())
    sampler = Sampler(source, hz)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    sampler.start()
    time.sleep(seconds)
    sampler.stop()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    n = len(sampler.samples())
    return {
        "samples": n,
        "achieved_hz": n / wall,
        "cpu_seconds": cpu,
        "share_of_one_core": cpu / wall,
        "us_per_sample": 1e6 * cpu / max(n, 1),
        "missed_ticks": sampler.missed_ticks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--hz", type=float, default=50.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        board = agx_orin_64gb(Path(tmp) / "board", jetpack=6, emc=True)
        results["jetson_sysfs (fake AGX Orin, JetPack 6)"] = measure(
            "jetson_sysfs", board.base, args.seconds, args.hz
        )
    results["cpu (psutil)"] = measure("cpu", None, args.seconds, args.hz)
    print("| source | rate | samples/s | CPU per sample | share of one core |")
    print("|---|---:|---:|---:|---:|")
    for name, r in results.items():
        print(
            f"| {name} | {args.hz:g} Hz | {r['achieved_hz']:.1f} | {r['us_per_sample']:.0f} µs "
            f"| {100 * r['share_of_one_core']:.2f} % |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
