"""A burst of users behind one cached system prompt, with prompt tails evened up and
without, alternated in one engine.

Every slot holds a system prompt (the earlier rounds' requests leave it there); then
``--users`` requests arrive at once, each the system prompt and a user's words of a
different length. With one KV stream per slot llama.cpp runs one pass per distinct
tail length; with tails evened up (``Scheduler._even_tails``, the engine's default)
the shorter tails compute some of their cached cells again where the engine's
step-cost model says the passes saved are worth them. Per round and setting: the
burst's TTFT (median and largest, from the engine's own timings), the passes and the
prompt tokens of the steps that fed the prompts. The settings alternate which goes
first; the engine runs alone (no server), greedy, on a generated demo model.

    .venv/bin/python -m benchmarks.even_tails [--quant f16] [--size medium]
        [--threads 2] [--rounds 10] [--users 4] [--tokens 8] [--spread 3] [--worth N]
        [--json FILE]
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from benchmarks.engine_throughput import bench_config
from benchmarks.late_prompts import engine_rounds_parser
from orin.engine.engine import Engine
from orin.engine.types import SamplingParams, StepStats
from orin.model import demo

PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SETTINGS = ("even", "plain")
SYSTEM = (
    "You are the voice assistant of a delivery robot. Answer in one short sentence, "
    "name the shelf or the room when you know it, and never guess a number."
)
WORDS = ("where", "is", "the", "charger", "for", "the", "second", "arm", "of", "the", "robot",
         "in", "bay")  # fmt: skip


@dataclass(frozen=True)
class Round:
    ttft_median_ms: float
    ttft_max_ms: float
    passes: int  # llama.cpp passes of the steps that fed the burst's prompts
    prompt_tokens: int  # prompt tokens those steps fed (cells computed again included)
    cached_tokens: int  # prompt tokens taken from the cache, all users together


NAMES = ("Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel")


def user_prompt(i: int, tag: str, spread: int = 3) -> str:
    """The system prompt, then user ``i``'s words: a name no other user's starts with
    (users share nothing beyond the system prompt) and ``1 + i * spread`` words (modulo
    13): with ``spread`` 1 the tails differ by a word or so, with 3 by a few."""
    words = " ".join(WORDS[: 1 + (spread * i) % len(WORDS)])
    return f"{SYSTEM}\n{NAMES[i % len(NAMES)]} {i} asks ({tag}): {words}?"


def one_round(engine: Engine, tag: str, users: int, tokens: int, spread: int = 3) -> Round:
    prompts = [engine.tokenize(user_prompt(i, tag, spread)) for i in range(users)]
    steps: list[StepStats] = []
    engine.add_step_observer(steps.append)
    try:
        tickets = [engine.arrival() for _ in prompts]  # the burst starts in one step
        params = replace(PARAMS, max_tokens=tokens)
        streams = [
            engine.submit(p, params, arrival=t) for p, t in zip(prompts, tickets, strict=True)
        ]
        done = [s.result() for s in streams]
    finally:
        engine.remove_step_observer(steps.append)
    timings = [d.timings for d in done if d.timings is not None]
    ttfts = [t.ttft_ms for t in timings]
    fed = [s for s in steps if s.prefill_tokens]
    return Round(
        statistics.median(ttfts),
        max(ttfts),
        sum(s.micro_batches for s in fed),
        sum(s.prefill_tokens for s in fed),
        sum(t.cached_tokens for t in timings),
    )


def measure(
    model: Path,
    threads: int = 2,
    rounds: int = 10,
    users: int = 4,
    tokens: int = 8,
    worth: float | None = None,
    spread: int = 3,
) -> tuple[dict[str, list[Round]], float]:
    """Each setting's rounds, alternated (which goes first changes every round), and
    the prompt tokens a pass was worth by the engine's cost model at the end.
    ``worth``: evened up by that worth of a pass instead of the cost model's."""
    cfg = replace(bench_config(model, 8, "on"), threads=threads, threads_batch=threads)
    got: dict[str, list[Round]] = {name: [] for name in SETTINGS}
    with Engine(cfg) as engine:
        learned = engine.scheduler.pass_tokens
        evening = learned if worth is None else (lambda: worth)
        engine.gather_s = 5.0  # every ticket closes within it: the burst starts together
        for i in range(8):  # every slot holds the system prompt, the cost model has steps
            engine.generate(engine.tokenize(user_prompt(i, "warm-up")), PARAMS)
        for r in range(rounds):
            order = SETTINGS if r % 2 == 0 else SETTINGS[::-1]
            for name in order:
                engine.scheduler.pass_tokens = evening if name == "even" else (lambda: 0.0)
                got[name].append(one_round(engine, f"{r}{name[0]}", users, tokens, spread))
        return got, learned()


def main(argv: list[str] | None = None) -> int:
    ap = engine_rounds_parser(__doc__)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--spread", type=int, default=3,
                    help="user i asks 1 + i * SPREAD words (modulo 13)")  # fmt: skip
    ap.add_argument("--worth", type=float, default=None,
                    help="even tails up by this worth of a pass in prompt tokens instead "
                    "of the cost model's")  # fmt: skip
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    model = demo.ensure(args.size, args.quant)
    got, worth = measure(
        model, args.threads, args.rounds, args.users, args.tokens, args.worth, args.spread
    )
    print(f"a pass was worth {worth:.1f} prompt tokens by the engine's cost model at the end")
    report = {}
    for name, rounds in got.items():
        med = statistics.median(r.ttft_median_ms for r in rounds)
        top = statistics.median(r.ttft_max_ms for r in rounds)
        report[name] = {"ttft_median_ms": med, "ttft_max_ms": top,
                        "rounds": [asdict(r) for r in rounds]}  # fmt: skip
        print(
            f"{name:6s} burst TTFT median {med:.1f} ms, largest {top:.1f} ms (medians over "
            f"rounds; per round {' '.join(f'{r.ttft_median_ms:.0f}' for r in rounds)}); "
            f"passes per burst {sorted({r.passes for r in rounds})}, prompt tokens fed "
            f"{sorted({r.prompt_tokens for r in rounds})}, cached "
            f"{sorted({r.cached_tokens for r in rounds})}"
        )
    ratios = [
        e.ttft_median_ms / p.ttft_median_ms for e, p in zip(got["even"], got["plain"], strict=True)
    ]
    print(f"even/plain TTFT median per round: median {statistics.median(ratios):.3f} "
          f"({' '.join(f'{x:.2f}' for x in ratios)})")  # fmt: skip
    if args.json:
        settings = vars(args) | {"json": str(args.json)}
        out = {"settings": settings, "pass_tokens": worth, "results": report}
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
