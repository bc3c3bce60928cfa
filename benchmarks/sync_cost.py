"""What ``llama_synchronize`` after every decode costs where there is nothing to wait for.

The engine's runner calls it after each ``llama_decode`` so that a step ends
once a GPU has finished (docs/engine.md, "Timings and events"). On a CPU build
the decode has already finished when it returns, so the call is pure
overhead: this measures it. Single-token decodes (the cheapest real step) on
a generated model; after each one, the first ``llama_synchronize`` is timed
alone, then ``--calls`` more in a loop.

    .venv/bin/python -m benchmarks.sync_cost [--size tiny] [--rounds 2000] [--calls 200]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from orin.engine.backend import Backend
from orin.engine.config import engine_config
from orin.model import demo
from orin.model.gguf import read_model_info
from orin.profile.loader import parse_profile


def measure(size: str, quant: str, rounds: int, calls: int) -> dict[str, float]:
    path = demo.ensure(size, quant)
    profile = parse_profile("name: b\nengine: {n_ctx: 512, slots: 1, n_batch: 32, n_ubatch: 32}\n")
    backend = Backend(engine_config(profile, path, read_model_info(path)))
    lib, ctx = backend.lib, backend.ctx
    batch = lib.llama_batch_init(1, 0, 1)
    token = backend.tokenize("hello", add_special=False)[0]
    decode_ns: list[int] = []
    first_ns: list[int] = []
    loop_ns: list[float] = []
    clock = time.perf_counter_ns
    try:
        for i in range(rounds):
            pos = i % 500
            if pos == 0:
                lib.llama_memory_seq_rm(backend.memory, 0, 0, -1)
            batch.token[0], batch.pos[0], batch.n_seq_id[0] = token, pos, 1
            batch.seq_id[0][0], batch.logits[0], batch.n_tokens = 0, True, 1
            t0 = clock()
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            t1 = clock()
            lib.llama_synchronize(ctx)
            t2 = clock()
            for _ in range(calls):
                lib.llama_synchronize(ctx)
            t3 = clock()
            decode_ns.append(t1 - t0)
            first_ns.append(t2 - t1)
            loop_ns.append((t3 - t2) / calls)
    finally:
        lib.llama_batch_free(batch)
        backend.close()
    first = sorted(first_ns)
    return {
        "decode_median_us": statistics.median(decode_ns) / 1e3,
        "sync_after_decode_median_us": statistics.median(first) / 1e3,
        "sync_after_decode_p90_us": first[int(0.9 * (len(first) - 1))] / 1e3,
        "sync_repeated_mean_us": statistics.fmean(loop_ns) / 1e3,
        "share_of_decode_pct": 100 * statistics.median(first) / statistics.median(decode_ns),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--quant", default="f16")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--calls", type=int, default=200)
    args = ap.parse_args()
    result = measure(args.size, args.quant, args.rounds, args.calls)
    result_meta = {"machine": platform.processor() or platform.machine(), **vars(args)}
    print(json.dumps({**result_meta, **{k: round(v, 3) for k, v in result.items()}}, indent=2))


if __name__ == "__main__":
    main()
