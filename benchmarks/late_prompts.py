"""Prompts that arrive beside a running stream: the scheduler's prompts-first rule on
and off, alternated in one engine.

One request decodes; then three more arrive at once (the rest of a burst whose first
request started alone). With one KV stream per slot the step that feeds their prompts
beside the running stream's decode row costs llama.cpp two passes; with
``Scheduler.prompts_first`` the prompts run as a step of their own (one pass) and the
decode row goes into the next step with the new streams' first rows. With
``--shared`` the late prompts share a prefix, so the later ones wait to copy the first
one's cells and their prompts are fed in two steps. Per round, the
late prompts' TTFT (median of the three, from the engine's own timings) and the running
stream's longest gap between two tokens, for each setting; the rounds alternate which
setting goes first. The engine runs alone (no server), greedy, on a generated demo
model.

    .venv/bin/python -m benchmarks.late_prompts [--quant f16] [--size medium]
        [--threads 2] [--rounds 10] [--late 3] [--tokens 48] [--shared] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.engine_throughput import bench_config
from orin.engine.engine import Engine
from orin.engine.types import SamplingParams, StepStats
from orin.model import demo

PARAMS = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
SETTINGS = {"prompts_first": True, "whole_step": False}
WORDS = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel")


@dataclass(frozen=True)
class Round:
    late_ttft_ms: float  # the late prompts' median TTFT
    running_max_gap_ms: float  # the running stream's longest gap between two tokens
    prompt_steps: tuple[tuple[int, int, int], ...]  # (prompt tokens, decode rows, passes)


def one_round(engine: Engine, tag: str, late: int, tokens: int, shared: bool) -> Round:
    tok = engine.tokenize
    params = replace(PARAMS, max_tokens=tokens)
    steps: list[StepStats] = []
    running = engine.submit(tok(f"Round {tag}: a stream starts the burst on the board."), params)
    events = iter(running)
    next(events)
    next(events)  # its first decode step is done: it is decoding
    texts = [
        f"Round {tag}, late prompt {i}: on the board, a little longer than one token."
        if shared
        else f"{WORDS[i % len(WORDS)]} {i} asks in round {tag}, a little longer than one token."
        for i in range(late)
    ]
    prompts = [tok(text) for text in texts]
    engine.add_step_observer(steps.append)
    try:
        streams = [engine.submit(p, params) for p in prompts]
        done = [s.result() for s in streams]
        first = running.result()
    finally:
        engine.remove_step_observer(steps.append)
    ttfts = [d.timings.ttft_ms for d in done if d.timings is not None]
    gaps = first.timings.itl_ms if first.timings is not None else ()
    fed = tuple(
        (s.prefill_tokens, s.decode_tokens, s.micro_batches) for s in steps if s.prefill_tokens
    )
    return Round(statistics.median(ttfts), max(gaps), fed)


def measure(
    model: Path,
    threads: int = 2,
    rounds: int = 10,
    late: int = 3,
    tokens: int = 48,
    shared: bool = False,
) -> dict[str, list[Round]]:
    """Each setting's rounds, alternated (which goes first changes every round)."""
    cfg = bench_config(model, 8, "on")
    cfg = replace(cfg, threads=threads, threads_batch=threads)
    got: dict[str, list[Round]] = {name: [] for name in SETTINGS}
    with Engine(cfg) as engine:
        engine.generate("Warm-up on the edge board.", replace(PARAMS, max_tokens=4))
        for r in range(rounds):
            order = list(SETTINGS) if r % 2 == 0 else list(SETTINGS)[::-1]
            for name in order:
                engine.scheduler.prompts_first = SETTINGS[name]
                # prompts of the same length for both settings, new ones every round
                tag = f"{r}-{list(SETTINGS).index(name)}"
                got[name].append(one_round(engine, tag, late, tokens, shared))
    return got


def engine_rounds_parser(doc: str | None) -> argparse.ArgumentParser:
    """The options of a benchmark that alternates settings round by round in one engine
    on a generated demo model: --quant, --size, --threads, --rounds."""
    ap = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    ap.add_argument("--quant", default="f16")
    ap.add_argument("--size", default="medium")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = engine_rounds_parser(__doc__)
    ap.add_argument("--late", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--shared", action="store_true",
                    help="late prompts with a common prefix: the later ones wait to copy "
                    "the first one's cells, so their prompts are fed in two steps")  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = demo.ensure(args.size, args.quant)
    got = measure(model, args.threads, args.rounds, args.late, args.tokens, args.shared)
    report = {}
    for name, rounds in got.items():
        ttft = statistics.median(r.late_ttft_ms for r in rounds)
        gap = statistics.median(r.running_max_gap_ms for r in rounds)
        report[name] = {"late_ttft_ms": ttft, "running_max_gap_ms": gap,
                        "rounds": [asdict(r) for r in rounds]}  # fmt: skip
        print(
            f"{name:14s} late prompts' TTFT median {ttft:.1f} ms "
            f"({' '.join(f'{r.late_ttft_ms:.0f}' for r in rounds)}); running stream's "
            f"longest gap median {gap:.1f} ms; steps feeding prompts (prompt tokens, "
            f"decode rows, passes) {rounds[-1].prompt_steps}"
        )
    if args.json:
        args.json.write_text(json.dumps({"settings": vars(args) | {"json": str(args.json)},
                                         "results": report}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
