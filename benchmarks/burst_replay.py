"""Bursts of returning and new users replayed through the pure scheduler: prompt tokens
prefilled, KV stream copies and llama.cpp passes, with and without copying a cached
prompt aside before a new prompt overwrites it (``Scheduler._evacuate``).

    .venv/bin/python -m benchmarks.burst_replay [--runs 300] [--seed 1]

No llama.cpp and no clock: the counts follow from the scheduler's decisions alone,
so they repeat exactly, where TTFT on a shared 2-core machine moves by tens of
percent from run to run. Each run replays what ``benchmarks/peers.py`` sends one
fresh server: a warm-up of 2 streams of 8 tokens, then 4 streams of 64 and 8 streams
of 64, the prompts "user i" of 20 tokens that share their first 2 (so users 0 and 1
return in the second burst, 0-3 in the third). In each burst the first request
arrives alone and the others in the next one or two steps, split at random, in a
random order. Every decoded token is one step; a finished request keeps its cells.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from orin.engine.scheduler import ContextPolicy, Copy, Scheduler, SlotState

SLOTS, WINDOW, N_BATCH = 8, 512, 512
PROMPT_TOKENS = 20
BURSTS = ((2, 8), (4, 64), (8, 64))  # (users, tokens each), as peers' warm-up and streams


@dataclass
class Req:
    id: str
    prompt_tokens: list[int]
    all_logits: bool = False
    held: bool = False


@dataclass
class Counts:
    prefilled: int = 0  # prompt tokens fed to llama.cpp
    copies: int = 0  # KV stream copies (prefix shares, moves, prompts copied aside)
    passes: int = 0  # llama.cpp passes over all steps with tokens
    steps: int = 0
    returning: int = 0  # requests whose prompt a slot held when they arrived
    refilled: int = 0  # of those, how many prefilled more than their last token

    def add(self, other: Counts) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class Replay:
    rng: random.Random
    scheduler: Scheduler = field(default_factory=lambda: Scheduler(
        SLOTS, N_BATCH, ContextPolicy(window=WINDOW)))  # fmt: skip
    counts: Counts = field(default_factory=Counts)
    seen: set[int] = field(default_factory=set)  # users whose prompt ran before

    def burst(self, users: int, tokens: int) -> None:
        order = list(range(users))
        self.rng.shuffle(order)
        rest = order[1:]
        cut = self.rng.randint(0, len(rest))
        waves = [order[:1], rest[:cut], rest[cut:]]
        s, step = self.scheduler, 0
        made: dict[str, int] = {}  # request id -> user
        while True:
            for user in waves[step] if step < len(waves) else ():
                rid = f"u{user}-{len(self.seen)}"
                made[rid] = user
                s.add(Req(rid, prompt(user)))
            step += 1
            batch = s.schedule()
            if not batch and step >= len(waves):
                break
            if batch.items:
                self.counts.steps += 1
                self.counts.passes += batch.passes
            self.counts.copies += sum(isinstance(op, Copy) for op in batch.ops)
            self.counts.prefilled += batch.n_prefill
            for item in batch.items:
                slot = s.slots[item.slot]
                if item.prefill and slot.request is not None and slot.generated == 0:
                    user = made[slot.request.id]
                    first_chunk = item.pos == slot.cached_prompt
                    if first_chunk and user in self.seen:
                        self.counts.returning += 1
                        self.counts.refilled += len(item.tokens) > 1
            s.update(batch, {i.slot: 5 for i in batch.items if i.sample})
            for slot in s.slots:
                if slot.state is SlotState.DECODE and slot.generated >= tokens:
                    s.release(slot, keep_cache=True)
        self.seen.update(range(users))


def prompt(user: int) -> list[int]:
    return [1, 2] + [100 + user] * (PROMPT_TOKENS - 2)


@contextmanager
def without_copy_aside() -> Iterator[None]:
    """The scheduler as it was before prompts were copied aside."""
    keep = Scheduler._evacuate
    Scheduler._evacuate = lambda self, slot, kept: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        Scheduler._evacuate = keep  # type: ignore[method-assign]


def replay(runs: int, seed: int) -> Counts:
    total = Counts()
    rng = random.Random(seed)
    for _ in range(runs):
        r = Replay(rng)
        for users, tokens in BURSTS:
            r.burst(users, tokens)
        total.add(r.counts)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", help="write the counts to this file")
    a = ap.parse_args()
    with without_copy_aside():
        before = replay(a.runs, a.seed)
    after = replay(a.runs, a.seed)
    out = {}
    for name, c in (("without copy-aside", before), ("with copy-aside", after)):
        out[name] = vars(c) | {"passes_per_step": c.passes / c.steps}
        print(
            f"{name:>20}: per run {c.prefilled / a.runs:.1f} prompt tokens prefilled, "
            f"{c.copies / a.runs:.2f} stream copies, {c.passes / c.steps:.4f} passes per "
            f"step; returning users who prefilled again {c.refilled} of {c.returning}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": a.runs, "seed": a.seed, "counts": out}, f, indent=1)


if __name__ == "__main__":
    main()
