"""One KV stream per slot against one unified KV buffer, with and without a TPOT target.

    .venv/bin/python -m benchmarks.kv_layout [--size medium] [--quant q4_k_m] [--reps 3]

The same engine, model and requests under each configuration, interleaved rep by rep
so the machine's drift hits all alike:

- ``decode8``: 8 streams of 64 greedy tokens submitted together: aggregate tokens/s
  and the mean llama.cpp passes per decode step;
- ``mixed``: 4 streams decoding while a prompt of most of a slot's context arrives:
  inter-token latency p50/p99/max of the running streams over the whole run, and
  the long prompt's TTFT;
- ``shared``: 8 users of one ~600-token system prompt with different questions,
  submitted together: TTFT p50/p95, and the prompt tokens taken from the cache.

Configurations: ``streams`` (kv_unified off, the default), ``unified``, and each of
them with ``slo.tpot_p90_ms`` set to 3x the decode step of 4 streams measured
first (``+slo``), which turns on the SLO-aware prompt chunking.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from orin.engine.config import EngineConfig, default_threads, engine_config
from orin.engine.engine import Engine
from orin.engine.types import SamplingParams, StepStats
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile

SLOTS, CTX, N_BATCH = 8, 1024, 512


def config(model: Path, unified: bool, tpot: float | None, threads: int) -> EngineConfig:
    slo = f"slo: {{tpot_p90_ms: {tpot}}}\n" if tpot else ""
    profile = parse_profile(
        f"name: bench\nengine: {{n_ctx: {CTX}, slots: {SLOTS}, n_batch: {N_BATCH}, "
        f"n_ubatch: {N_BATCH}, threads: {threads}, kv_unified: {str(unified).lower()}}}\n{slo}"
    )
    return engine_config(profile, model, read_model_info(model))


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def words(rng: random.Random, e: Engine, n: int) -> list[int]:
    vocab = e.backend.n_vocab if e.backend else 1000
    return [rng.randrange(263, vocab) for _ in range(n)]


def decode8(e: Engine, rng: random.Random) -> dict[str, float]:
    steps: list[StepStats] = []
    e.add_step_observer(steps.append)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    t0 = time.perf_counter()
    streams = [e.submit(words(rng, e, 24), params) for _ in range(8)]
    n = sum(len(s.result().token_ids) for s in streams)
    wall = time.perf_counter() - t0
    e.remove_step_observer(steps.append)
    dec = [s for s in steps if s.decode_tokens and not s.prefill_tokens]
    return {
        "tok_s": n / wall,
        "passes_per_decode_step": statistics.mean(s.micro_batches for s in dec) if dec else 0.0,
        "decode_step_ms": statistics.median((s.end_ns - s.start_ns) * 1e-6 for s in dec)
        if dec
        else 0.0,
    }


def mixed(e: Engine, rng: random.Random) -> dict[str, float]:
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
    runners = [e.submit(words(rng, e, 16), params) for _ in range(4)]
    first = iter(runners[0])
    for _ in range(20):  # the streams are decoding
        next(first)
    long = e.submit(words(rng, e, CTX - 100), SamplingParams(temperature=0.0, max_tokens=8))
    done = long.result()
    itl: list[float] = []
    for r in runners:
        t = r.result().timings
        if t is not None:
            itl.extend(t.itl_ms)
    ttft = done.timings.ttft_ms if done.timings else float("nan")
    return {
        "itl_p50_ms": pct(itl, 0.5),
        "itl_p99_ms": pct(itl, 0.99),
        "itl_max_ms": max(itl) if itl else float("nan"),
        "long_ttft_ms": ttft,
    }


def shared(e: Engine, rng: random.Random) -> dict[str, float]:
    system = words(rng, e, 600)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    streams = [e.submit(system + words(rng, e, 12), params) for _ in range(8)]
    done = [s.result() for s in streams]
    ttft = [c.timings.ttft_ms for c in done if c.timings]
    cached = sum(c.timings.cached_tokens for c in done if c.timings)
    return {"ttft_p50_ms": pct(ttft, 0.5), "ttft_p95_ms": pct(ttft, 0.95), "cached": cached}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="medium")
    ap.add_argument("--quant", default="q4_k_m")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=default_threads())
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = demo.ensure(args.size, args.quant)
    # the TPOT target: 3x the median decode step of 4 streams, measured once
    with Engine(config(model, False, None, args.threads)) as e:
        probe = decode8(e, random.Random(0))
    target = round(3 * probe["decode_step_ms"], 1)
    configs = {
        "streams": (False, None),
        "unified": (True, None),
        "streams+slo": (False, target),
        "unified+slo": (True, target),
    }
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for rep in range(args.reps):
        order = list(configs) if rep % 2 == 0 else list(reversed(configs))
        for name in order:
            unified, tpot = configs[name]
            rng = random.Random(1000 + rep)
            with Engine(config(model, unified, tpot, args.threads)) as e:
                row = {"decode8": decode8(e, rng), "mixed": mixed(e, rng), "shared": shared(e, rng)}
            runs[name].append(row)
            print(rep, name, json.dumps(row), flush=True)
    print(
        f"\nmodel {model.name}, {SLOTS} slots x {CTX}, n_batch {N_BATCH}, threads "
        f"{args.threads}, TPOT target for +slo: {target} ms; medians of {args.reps} reps"
    )
    keys = [
        ("decode8", "tok_s"), ("decode8", "passes_per_decode_step"),
        ("mixed", "itl_p50_ms"), ("mixed", "itl_p99_ms"), ("mixed", "itl_max_ms"),
        ("mixed", "long_ttft_ms"), ("shared", "ttft_p50_ms"), ("shared", "ttft_p95_ms"),
        ("shared", "cached"),
    ]  # fmt: skip
    print("| figure | " + " | ".join(configs) + " |")
    print("|---" * (len(configs) + 1) + "|")
    for scen, key in keys:
        cells = []
        for name in configs:
            vals = [r[scen][key] for r in runs[name]]
            cells.append(f"{statistics.median(vals):.1f} ({min(vals):.1f}–{max(vals):.1f})")
        print(f"| {scen} {key} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"target_ms": target, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
