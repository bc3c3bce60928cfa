"""The scheduler's own time to admit a burst: ``Scheduler.schedule()`` for the step that
takes in N new users at once, on slots that hold other users' conversations, with
the one-token check that spares most prefix comparisons (``scheduler._holds_more``)
and with every comparison made in full, alternated round by round.

    .venv/bin/python -m benchmarks.admit_cost [--rounds 200] [--bursts 4,8] [--json F]

No llama.cpp: this is the Python time that every request of the burst waits before
its prefill starts (it lands in TTFT once per burst), and it grows with slots times
requests. Each round: N users whose prompts of 16 tokens share their first 2 (one
system prompt's start, as in ``benchmarks/peers.py``) arrive together; the step
that admits them is timed; each then decodes 8 tokens and leaves its cells behind.
Both variants replay the same prompts on their own scheduler, so they make the
same decisions (tests/unit/engine/test_scheduler.py checks that they do).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from benchmarks.burst_replay import Req
from orin.engine import scheduler as sched
from orin.engine.scheduler import ContextPolicy, Scheduler, SlotState

SLOTS, WINDOW, N_BATCH = 8, 512, 512
PROMPT_TOKENS, ANSWER_TOKENS = 16, 8
VARIANTS = ("one-token check", "full comparison")


@contextmanager
def full_comparison() -> Iterator[None]:
    """Every slot compared with the prompt and with the other slots in full."""
    keep = sched._holds_more
    sched._holds_more = lambda slot, tokens, n: True
    try:
        yield
    finally:
        sched._holds_more = keep


def variant(name: str) -> contextlib.AbstractContextManager[None]:
    return full_comparison() if name == VARIANTS[1] else contextlib.nullcontext()


def prompt(rng: random.Random) -> list[int]:
    return [1, 2] + [rng.randrange(10, 30000) for _ in range(PROMPT_TOKENS - 2)]


def burst(s: Scheduler, users: int, rng: random.Random, clock: Callable[[], int]) -> int:
    """One burst through ``s``: the admitting step's nanoseconds."""
    for k in range(users):
        s.add(Req(f"u{k}", prompt(rng)))
    t0 = clock()
    batch = s.schedule()
    spent = clock() - t0
    while True:
        s.update(batch, {i.slot: rng.randrange(10, 30000) for i in batch.items if i.sample})
        for slot in s.slots:
            if slot.state is SlotState.DECODE and slot.generated >= ANSWER_TOKENS:
                s.release(slot, keep_cache=True)
        if not any(slot.busy for slot in s.slots):
            return spent
        batch = s.schedule()


def measure(users: int, rounds: int, seed: int) -> dict[str, list[float]]:
    """Milliseconds of the admitting step per round, per variant."""
    schedulers = {v: Scheduler(SLOTS, N_BATCH, ContextPolicy(window=WINDOW)) for v in VARIANTS}
    for v, s in schedulers.items():  # every slot holds a conversation
        with variant(v):
            burst(s, SLOTS, random.Random(seed), time.perf_counter_ns)
    out: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        for v in order:
            rng = random.Random(seed * 100_003 + r)  # the same users for both
            with variant(v):
                out[v].append(burst(schedulers[v], users, rng, time.perf_counter_ns) / 1e6)
    return out


def summary(ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(ms, n=10)
    return {"median_ms": statistics.median(ms), "p90_ms": q[-1], "mean_ms": statistics.fmean(ms)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--bursts", default="4,8", help="users per burst, comma-separated")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the figures to this file")
    a = ap.parse_args()
    out: dict[str, dict[str, dict[str, float]]] = {}
    for users in (int(x) for x in a.bursts.split(",")):
        figures = {v: summary(ms) for v, ms in measure(users, a.rounds, a.seed).items()}
        out[str(users)] = figures
        check, full = (figures[v]["median_ms"] for v in VARIANTS)
        print(
            f"{users} users on {SLOTS} slots: admitting step median {check:.3f} ms with the "
            f"one-token check, {full:.3f} ms comparing in full ({check / full:.2f}x); "
            f"p90 {figures[VARIANTS[0]]['p90_ms']:.3f} / {figures[VARIANTS[1]]['p90_ms']:.3f} ms"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rounds": a.rounds, "seed": a.seed, "bursts": out}, f, indent=1)


if __name__ == "__main__":
    main()
