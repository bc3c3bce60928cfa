"""One short generation of a quantized model: does this llama.cpp build run here?

``python -m orin.model.smoke`` generates the tiny demo model in q8_0 and q4_0
into a temporary folder and greedily decodes a few tokens from each, with
every layer offloaded where the build can offload. scripts/install-llama-cpp.sh
runs it in a subprocess right after installing a build: a build whose CPU
kernels crash on this processor (llama.cpp's AMX kernels on Sapphire Rapids)
dies here with a signal, and the install fails naming the cause, instead of
the test suite or the server segfaulting later.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from orin.llamacpp import llama
from orin.model import demo

QUANTS = ("q8_0", "q4_0")
TOKENS = 8


def run(folder: Path) -> list[int]:
    """Decode TOKENS tokens greedily from each quant; the number of tokens each gave."""
    lib = llama()
    made = []
    for quant in QUANTS:
        path = demo.generate("tiny", quant, folder / demo.file_name("tiny", quant))
        model = lib.Llama(
            model_path=str(path), n_ctx=64, n_batch=64, n_gpu_layers=-1, verbose=False
        )
        try:
            out = model.create_completion("the", max_tokens=TOKENS, temperature=0.0)
            made.append(int(out["usage"]["completion_tokens"]))
        finally:
            model.close()
    return made


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="orin-smoke-") as tmp:
        made = run(Path(tmp))
    if any(n != TOKENS for n in made):
        print(f"smoke test: expected {TOKENS} tokens per model, got {made}", file=sys.stderr)
        return 1
    print(f"smoke test: {TOKENS} tokens from the tiny model in {' and '.join(QUANTS)}: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
