"""How good is tune's search? Successive halving against an exhaustive sweep of the same space.

On the generated demo model (medium by default), the space `orin-llm tune` derives
from a profile (n_batch/n_ubatch, flash attention, the KV types the matching rules
allow, threads, slots) is measured two ways with the same in-process measurer:

- exhaustive: every configuration at the highest fidelity (``--max-fidelity``
  repetitions of every grid point);
- tune: ``successive_halving`` as `orin-llm tune` runs it (repetitions 1, 3, 9 by
  default, the best third going on each round), without a budget cap, so its own
  cost is what is compared.

The two run interleaved: before each of tune's measurements the sweep catches up
to the same fraction of its own work, so a neighbour's load on a shared machine
falls on both alike. Every measurement's cost is its wall time, model load and
warm-up request included, on both sides.

The score is throughput (generated tokens/s at the highest concurrency of the grid;
the profile sets no latency targets, so the ranking is by throughput alone).
Targets: tune's choice reaches >= 95 % of the throughput of the configuration the
sweep found best, at <= 40 % of the exhaustive measuring time.

The sweep's figure for its own best is the maximum of many noisy figures, so it
reads high (the winner's curse): even the truly best configuration, measured
again, falls short of it. So the quality is measured by a paired re-check:
tune's choice and the sweep's best are measured again alternately (AB, BA, ...;
``--recheck`` rounds at the highest fidelity) and the quality is the median of
the per-round ratios (1.0 when both chose the same configuration). The ratio of
the two sweep figures is reported beside it.

``--clock cpu`` scores throughput per CPU second of this process instead of per
wall second. With one llama.cpp thread (``--threads 1``) and a CPU build, that is
the wall-clock throughput the same configuration has on an idle core, and other
jobs on a shared machine barely move it; costs (the time ratio) stay wall time.
With more threads, spinning threads count as busy, so use it with ``--threads 1``.

Run: ``.venv/bin/python -m benchmarks.tune_search_quality [--size medium] [--quant q4_k_m]
[--threads 1] [--prompt-tokens 16,64] [--concurrency 1,4] [--output-tokens 16]
[--max-fidelity 9] [--eta 3] [--recheck 2] [--json FILE]``
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from orin.llamacpp import build_info
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile
from orin.tune.figures import Grid
from orin.tune.measure import EngineMeasurer
from orin.tune.search import Evaluation, fidelity_levels, successive_halving
from orin.tune.space import Candidate, build_space

QUALITY_TARGET = 0.95
TIME_TARGET = 0.40


@dataclass
class Swept:
    candidate: Candidate
    throughput: float
    cost_s: float


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="medium")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--threads", type=_ints, default=None, help="keep only these thread counts")
    ap.add_argument("--prompt-tokens", type=_ints, default=(16, 64))
    ap.add_argument("--concurrency", type=_ints, default=(1, 4))
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--max-fidelity", type=int, default=9)
    ap.add_argument("--eta", type=int, default=3)
    ap.add_argument("--recheck", type=int, default=4)
    ap.add_argument("--limit", type=int, default=0, help="first N configurations only (0: all)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="throughput per wall second, or per CPU second of this process (see docstring)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    return ap.parse_args(argv)


def setup(a: argparse.Namespace) -> tuple[Any, ...]:
    path = demo.ensure(a.size, a.quant)
    info = read_model_info(path)
    conc = ",".join(map(str, a.concurrency))
    prompts = ",".join(map(str, a.prompt_tokens))
    profile = parse_profile(
        "name: search-quality\n"
        "engine: {n_ctx: 512, slots: 8, n_batch: 256, n_ubatch: 256}\n"
        f"slo: {{prompt_tokens: [{prompts}], concurrency: [{conc}]}}\n"
    )
    space = build_space(profile, info, build_info())
    cands = [c for c in space.candidates if a.threads is None or c.threads in a.threads]
    if a.limit:
        cands = cands[: a.limit]
    grid = Grid(tuple(a.prompt_tokens), tuple(a.concurrency), a.output_tokens)
    return path, info, profile, space, cands, grid


def measurer(a: argparse.Namespace, setup_: tuple[Any, ...], seed: int) -> EngineMeasurer:
    path, info, profile, _, _, grid = setup_
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    return EngineMeasurer(
        profile, path, info, grid, build_info(), None, None, seed, rate_clock=clock
    )


def schedule_size(n: int, levels: tuple[int, ...], eta: int) -> int:
    """Evaluations successive halving makes over ``n`` candidates without a budget."""
    total = 0
    for _ in levels:
        total, n = total + n, max(1, math.ceil(n / eta))
    return total


def run_both(a: argparse.Namespace, s: tuple[Any, ...]) -> tuple[list[Swept], Any]:
    """Successive halving and the exhaustive sweep, interleaved: before each of tune's
    evaluations the sweep catches up to the same fraction of its own work, so both
    meet the same machine load (another job on a shared machine moves every figure)."""
    cands: list[Candidate] = s[4]
    sweep_m, tune_m = measurer(a, s, a.seed + 1), measurer(a, s, a.seed)
    expected = schedule_size(len(cands), fidelity_levels(1, a.max_fidelity, a.eta), a.eta)
    swept: list[Swept] = []
    calls = 0

    def sweep_until(fraction: float) -> None:
        while len(swept) < len(cands) and len(swept) < fraction * len(cands):
            c = cands[len(swept)]
            ev = sweep_m.evaluate(c, a.max_fidelity)
            swept.append(Swept(c, ev.score.throughput, ev.cost_s))
            log(f"exhaustive {len(swept)}/{len(cands)} {c.label}: "
                f"{ev.score.throughput:.1f} tok/s ({ev.cost_s:.1f} s)")  # fmt: skip

    def evaluate(c: Candidate, fidelity: int) -> Evaluation:
        nonlocal calls
        sweep_until(calls / expected)
        calls += 1
        ev = tune_m.evaluate(c, fidelity)
        log(f"tune x{fidelity} {c.label}: {ev.score.throughput:.1f} tok/s ({ev.cost_s:.1f} s)")
        return ev

    res = successive_halving(cands, evaluate, float("inf"), 1, a.max_fidelity, a.eta, a.seed)
    sweep_until(1.0)
    return swept, res


def log(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def recheck(a: argparse.Namespace, s: tuple[Any, ...], pair: list[Candidate]) -> dict[str, Any]:
    """Alternate fresh measurements of the two configurations (paired ratios)."""
    figures: dict[Candidate, list[float]] = {c: [] for c in pair}
    for r in range(a.recheck):
        for c in pair if r % 2 == 0 else pair[::-1]:
            m = measurer(a, s, a.seed + 100 + r)
            figures[c].append(m.evaluate(c, a.max_fidelity).score.throughput)
    ratios = [x / y for x, y in zip(figures[pair[0]], figures[pair[1]], strict=True)]
    return {"choice": figures[pair[0]], "best": figures[pair[1]], "ratios": ratios,
            "median_ratio": statistics.median(ratios) if ratios else None}  # fmt: skip


def report(
    a: argparse.Namespace,
    s: tuple[Any, ...],
    swept: list[Swept],
    res: Any,
    check: dict[str, Any] | None,
    started: str,
) -> dict[str, Any]:
    best = max(swept, key=lambda x: x.throughput)
    by_c = {x.candidate: x for x in swept}
    choice = by_c[res.best]
    ex_cost = sum(x.cost_s for x in swept)
    quality_sweep, time_ratio = choice.throughput / best.throughput, res.spent_s / ex_cost
    if best.candidate == res.best:
        quality = 1.0  # the same configuration
    elif check is not None and check["median_ratio"] is not None:
        quality = check["median_ratio"]
    else:
        quality = quality_sweep
    data = {
        "date": started, "machine": platform.platform(), "python": platform.python_version(),
        "llama_cpp_python": build_info().version, "model": str(s[0]),
        "settings": {k: v for k, v in vars(a).items() if k != "json"},
        "configurations": len(swept), "fidelities": list(res.fidelities),
        "exhaustive": [{"label": x.candidate.label, "throughput": x.throughput,
                        "cost_s": x.cost_s} for x in swept],
        "exhaustive_s": ex_cost, "tune_s": res.spent_s,
        "tune_measurements": len(res.trials), "tune_choice": res.best.label,
        "tune_choice_own_throughput": res.best_score.throughput,
        "tune_choice_in_sweep": choice.throughput, "sweep_best": best.candidate.label,
        "sweep_best_throughput": best.throughput, "quality": quality,
        "quality_sweep": quality_sweep, "time_ratio": time_ratio,
        "quality_met": quality >= QUALITY_TARGET, "time_met": time_ratio <= TIME_TARGET,
        "recheck": check,
    }  # fmt: skip
    return data


def markdown(d: dict[str, Any]) -> str:
    rows = sorted(d["exhaustive"], key=lambda x: -x["throughput"])
    lines = [
        f"{d['configurations']} configurations, {d['date']}, {d['machine']}",
        "",
        "| | configuration | tok/s | measuring s |",
        "|---:|---|---:|---:|",
        *(f"| {i + 1} | {r['label']}{' **(tune)**' if r['label'] == d['tune_choice'] else ''} "
          f"| {r['throughput']:.1f} | {r['cost_s']:.1f} |" for i, r in enumerate(rows)),
        "",
        f"- exhaustive: {d['exhaustive_s']:.0f} s; tune: {d['tune_s']:.0f} s in "
        f"{d['tune_measurements']} measurements (fidelities {d['fidelities']})",
        f"- tune's choice {d['tune_choice']}: {d['tune_choice_in_sweep']:.1f} tok/s in the sweep "
        f"(its own figure {d['tune_choice_own_throughput']:.1f}); sweep best "
        f"{d['sweep_best']}: {d['sweep_best_throughput']:.1f}",
        f"- sweep figures, choice/best: {d['quality_sweep']:.3f} (the best of "
        f"{d['configurations']} noisy figures reads high)",
        f"- quality {d['quality']:.3f} (target >= {QUALITY_TARGET}): "
        f"{'met' if d['quality_met'] else 'NOT met'}; time {d['time_ratio']:.3f} "
        f"(target <= {TIME_TARGET}): {'met' if d['time_met'] else 'NOT met'}",
    ]  # fmt: skip
    if d["recheck"]:
        c = d["recheck"]
        lines.append(f"- paired re-check, choice/best per round: "
                     f"{', '.join(f'{r:.3f}' for r in c['ratios'])} (median: quality)")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    started = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    s = setup(a)
    print(f"{len(s[4])} configurations; axes {s[3].axes}", file=sys.stderr)
    swept, res = run_both(a, s)
    best = max(swept, key=lambda x: x.throughput).candidate
    check = recheck(a, s, [res.best, best]) if a.recheck and best != res.best else None
    d = report(a, s, swept, res, check, started)
    print(markdown(d))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(d, f, indent=2)
    return 0 if d["quality_met"] and d["time_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
