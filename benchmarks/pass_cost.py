"""What a llama.cpp pass costs beside a prompt token, straight from ``llama_decode``.

Four sequences, one KV stream each, hold 11 cells; then each feeds a tail. Tails of
different lengths cost a pass per length (``orin.engine.ubatch``), equal tails one
pass. Timed (median of ``--rounds``, after 3 warm-up rounds; the tails' cells are
removed after each): tails of 7, 8, 9 and 10 tokens (34 tokens, 4 passes) against 10
each (40 tokens, 1 pass), 30/40/50/60 against 60 each, and one token each. From the
first pair: a pass's time and a prompt token's, and their ratio, the worth of a pass
in prompt tokens that ``Scheduler._even_tails`` weighs (the engine learns it from its
own steps instead; docs/engine.md).

    .venv/bin/python -m benchmarks.pass_cost [--size medium] [--quant f16] [--rounds 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Sequence

from orin.engine.backend import Backend
from orin.engine.config import engine_config
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile

HELD = 11  # cells every sequence holds before its tail
SHAPES = {
    "tails 7,8,9,10": (7, 8, 9, 10),
    "tails 10,10,10,10": (10, 10, 10, 10),
    "tails 30,40,50,60": (30, 40, 50, 60),
    "tails 60,60,60,60": (60, 60, 60, 60),
    "one token each": (1, 1, 1, 1),
}


def measure(size: str, quant: str, rounds: int) -> dict[str, float]:
    path = demo.ensure(size, quant)
    profile = parse_profile(
        "name: b\nengine: {n_ctx: 2048, slots: 4, n_batch: 512, n_ubatch: 512}\n"
    )
    backend = Backend(engine_config(profile, path, read_model_info(path)))
    lib, ctx = backend.lib, backend.ctx
    batch = lib.llama_batch_init(512, 0, 1)
    token = backend.tokenize("hello", add_special=False)[0]

    def decode(lengths: Sequence[int], start: int) -> float:
        n = 0
        for seq, length in enumerate(lengths):
            for j in range(length):
                batch.token[n], batch.pos[n], batch.n_seq_id[n] = token, start + j, 1
                batch.seq_id[n][0], batch.logits[n] = seq, j == length - 1
                n += 1
        batch.n_tokens = n
        t0 = time.perf_counter_ns()
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        lib.llama_synchronize(ctx)
        return (time.perf_counter_ns() - t0) / 1e6

    times: dict[str, list[float]] = {name: [] for name in SHAPES}
    try:
        decode([HELD] * 4, 0)
        for _ in range(rounds + 3):
            for name, lengths in SHAPES.items():
                times[name].append(decode(lengths, HELD))
                for seq in range(4):
                    lib.llama_memory_seq_rm(backend.memory, seq, HELD, -1)
    finally:
        lib.llama_batch_free(batch)
        backend.close()
    out = {f"{name} ms": statistics.median(t[3:]) for name, t in times.items()}
    # 4 passes and 34 tokens against 1 pass and 40 tokens: a + 40 c = even, 4 a + 34 c = uneven
    even, uneven = out["tails 10,10,10,10 ms"], out["tails 7,8,9,10 ms"]
    c = (4 * even - uneven) / (160 - 34)
    a = even - 40 * c
    return out | {"pass ms": a, "prompt token ms": c, "pass in prompt tokens": a / c}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="medium")
    ap.add_argument("--quant", default="f16")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    result = measure(args.size, args.quant, args.rounds)
    meta = {"machine": platform.processor() or platform.machine(), **vars(args)}
    print(json.dumps(meta | {k: round(v, 3) for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
