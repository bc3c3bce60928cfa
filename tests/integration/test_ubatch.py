"""orin.engine.ubatch's count of llama.cpp passes against llama.cpp's own: a graph
evaluation callback counts the output norm, computed once per micro-batch."""

from __future__ import annotations

import ctypes
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from orin.engine.ubatch import micro_batches
from orin.model import demo

pytestmark = pytest.mark.llama

N_UBATCH = 64
SLOTS = 6

SHAPES = [
    [(0, 5), (1, 5)],
    [(0, 1), (1, 1), (3, 1)],  # a hole
    [(0, 1), (1, 1), (2, 100)],  # a prompt chunk beside decode rows
    [(0, 1), (2, 1), (4, 1)],
    [(1, 30), (2, 3)],
    [(0, 1), (1, 7)],  # drafted tokens beside a single token
    [(0, 150)],  # longer than n_ubatch
    [(2, 1), (0, 1), (1, 1)],  # out of order
]


def random_shapes(n: int) -> list[list[tuple[int, int]]]:
    rng = random.Random(7)
    out = []
    for _ in range(n):
        seqs = rng.sample(range(SLOTS), rng.randint(1, SLOTS))
        out.append([(s, rng.choice([1, 1, 1, 2, 5, 40, 90])) for s in seqs])
    return out


class Counter:
    """Counts the output norm nodes llama.cpp computes: one per micro-batch."""

    def __init__(self, llama_cpp: Any) -> None:
        lib = os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so")
        ggml = ctypes.CDLL(lib)
        ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
        ggml.ggml_get_name.restype = ctypes.c_char_p
        self.n = 0

        def seen(tensor: int, ask: bool, _data: Any) -> bool:
            if ask and ggml.ggml_get_name(tensor) == b"result_norm":
                self.n += 1
            return False  # no data wanted: the graph runs as it would

        self.callback = llama_cpp.ggml_backend_sched_eval_callback(seen)


@pytest.fixture(scope="module")
def model() -> Iterator[tuple[Any, Any]]:
    import llama_cpp

    path = str(demo.ensure("tiny", "f16"))
    handle = llama_cpp.llama_model_load_from_file(
        path.encode(), llama_cpp.llama_model_default_params()
    )
    assert handle
    yield llama_cpp, handle
    llama_cpp.llama_model_free(handle)


@pytest.mark.parametrize("unified", [False, True], ids=["streams", "unified"])
def test_passes_equal_llama_cpp(model: tuple[Any, Any], unified: bool) -> None:
    lib, handle = model
    counter = Counter(lib)
    cp = lib.llama_context_default_params()
    cp.n_ctx, cp.n_seq_max = 256 * SLOTS, SLOTS
    cp.n_batch, cp.n_ubatch = 512, N_UBATCH
    cp.kv_unified = unified
    cp.cb_eval, cp.cb_eval_user_data = counter.callback, None
    ctx = lib.llama_init_from_model(handle, cp)
    assert ctx
    mem = lib.llama_get_memory(ctx)
    try:
        for shape in SHAPES + random_shapes(20):
            for seq in range(SLOTS):
                lib.llama_memory_seq_rm(mem, seq, 0, -1)
            n = sum(k for _, k in shape)
            batch = lib.llama_batch_init(n, 0, 1)
            i = 0
            for seq, k in shape:
                for j in range(k):
                    batch.token[i], batch.pos[i] = 10 + j, j
                    batch.n_seq_id[i], batch.seq_id[i][0] = 1, seq
                    batch.logits[i] = j == k - 1
                    i += 1
            batch.n_tokens = n
            counter.n = 0
            try:
                assert lib.llama_decode(ctx, batch) == 0
            finally:
                lib.llama_batch_free(batch)
            assert counter.n == micro_batches(shape, N_UBATCH, unified), shape
    finally:
        lib.llama_free(ctx)
