"""The seven deployment pitfalls of the seed article and the doctor checks that detect them.

docs/troubleshooting.md is written from this table and a test keeps the two
in step; pitfalls the engine prevents by design name the mechanism instead of
a check.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pitfall:
    number: int
    title: str
    checks: tuple[str, ...]
    prevented_by: str = ""


PITFALLS: tuple[Pitfall, ...] = (
    Pitfall(
        1,
        "UnicodeDecodeError in clients",
        (),
        "the engine's incremental detokenizer never emits a partial UTF-8 character",
    ),
    Pitfall(
        2,
        "cudaMalloc failed although memory looks free",
        (
            "memory-fit",
            "mmap",
            "swappiness",
            "zram",
        ),
    ),
    Pitfall(3, "GPU busy in prefill yet TTFT is high", ("llama-build", "kv-type")),
    Pitfall(
        4,
        "TPOT swings under concurrency",
        ("clocks", "power-mode", "thermal"),
        "decode-first scheduling with chunked prefill and a fixed slot count",
    ),
    Pitfall(
        5,
        "memory grows for hours, then OOM",
        ("memory-fit",),
        "cancelled requests free their KV cells within one engine step",
    ),
    Pitfall(6, "inf logits past ~4096 tokens", ("context",)),
    Pitfall(7, "a 4-bit model decodes slower than FP16", ("kv-type", "llama-build")),
)
