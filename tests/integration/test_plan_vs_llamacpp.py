"""The planner's KV figures against what llama.cpp itself allocates."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType

from orin.llamacpp import capture_log, llama
from orin.model.gguf import read_model_info
from orin.model.memplan import compute_bytes_estimate, kv_cache_bytes, kv_cells_per_seq

pytestmark = pytest.mark.llama

SIZE_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +\d+ layers, +\d+/(\d+) seqs\), "
    r"K \((\w+)\): +([\d.]+) MiB, "
    r"V \((\w+)\): +([\d.]+) MiB"
)
MiB = 1 << 20

# Every llama_kv_cache llama.cpp creates logs one line: a model with sliding-window
# layers two (the full-attention cache, then the window cache).
KV_LINE = re.compile(
    r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, +\d+/(\d+) seqs\), "
    r"K \((\w+)\): +([\d.]+) MiB, "
    r"V \((\w+)\): +([\d.]+) MiB"
)
# A recurrent model's state instead (llama_memory_recurrent), R and S rows in f32.
RS_LINE = re.compile(
    r"llama_memory_recurrent: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers, "
    r"+(\d+) seqs +\d+ rs_seq\), R \(f32\): +([\d.]+) MiB, S \(f32\): +([\d.]+) MiB"
)


@dataclass(frozen=True)
class ReportedCache:
    """One ``llama_kv_cache: size = ...`` line: sizes as llama.cpp prints them (MiB, 2 decimals)."""

    total_mib: str
    cells: int
    layers: int
    streams: int
    type_k: str
    k_mib: str
    type_v: str
    v_mib: str


def reported_kv_caches(text: str) -> list[ReportedCache]:
    return [
        ReportedCache(total, int(cells), int(layers), int(streams), tk, k, tv, v)
        for total, cells, layers, streams, tk, k, tv, v in KV_LINE.findall(text)
    ]


def mib(n: int) -> str:
    """Bytes the way llama.cpp prints a size: MiB with two decimals."""
    return f"{n / MiB:.2f}"


@contextmanager
def llama_context(
    path: Path,
    ctx: int,
    slots: int,
    type_k: str = "f16",
    type_v: str = "f16",
    n_ubatch: int = 32,
    flash_attn: bool = True,
    swa_full: bool = True,
    n_batch: int | None = None,
) -> Iterator[Any]:
    lib = llama()
    mp = lib.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(path).encode(), mp)
    assert model, "llama.cpp failed to load the generated model"
    cp = lib.llama_context_default_params()
    cp.n_ctx = ctx * slots  # per-slot context, as the engine asks for it
    cp.n_seq_max = slots
    cp.n_ubatch = n_ubatch
    cp.n_batch = n_batch if n_batch is not None else n_ubatch
    cp.swa_full = swa_full  # llama.cpp's default is on, and the engine keeps it
    cp.type_k = GGMLQuantizationType[type_k.upper()].value
    cp.type_v = GGMLQuantizationType[type_v.upper()].value
    cp.flash_attn_type = int(flash_attn)  # LLAMA_FLASH_ATTN_TYPE_ENABLED / _DISABLED
    try:
        context = lib.llama_init_from_model(model, cp)
        assert context, "llama.cpp failed to create the context"
        try:
            yield context
        finally:
            lib.llama_free(context)
    finally:
        lib.llama_model_free(model)


@pytest.mark.parametrize(
    ("size", "ctx", "slots", "type_k", "type_v"),
    [
        ("tiny", 32768, 1, "f16", "f16"),
        ("tiny", 32768, 1, "q8_0", "q8_0"),
        ("tiny", 32768, 1, "q4_0", "q4_0"),
        ("tiny", 10000, 3, "q8_0", "q4_0"),
        ("small", 2048, 4, "f16", "f16"),
        ("small", 4096, 2, "q8_0", "q8_0"),
        ("small", 30000, 1, "q4_0", "q4_0"),
    ],
)
def test_kv_bytes_equal_llama_cpp(
    size: str, ctx: int, slots: int, type_k: str, type_v: str
) -> None:
    from orin.model import demo

    path = demo.ensure(size, "f16")
    info = read_model_info(path)
    with capture_log() as lines, llama_context(path, ctx, slots, type_k, type_v) as context:
        n_ctx_seq = llama().llama_n_ctx_seq(context)
    text = "".join(lines)
    m = SIZE_LINE.search(text)
    assert m, f"llama.cpp did not report its KV size:\n{text}"
    total_mib, cells, streams, k_type, k_mib, v_type, v_mib = m.groups()
    cells_planned = kv_cells_per_seq(ctx, slots)
    # one KV stream of n_ctx_seq cells per slot
    assert n_ctx_seq == int(cells) == cells_planned
    assert int(streams) == slots
    assert (k_type, v_type) == (type_k, type_v)
    kv = kv_cache_bytes(info, cells_planned * slots, type_k, type_v)
    # llama.cpp prints MiB with two decimals: the planner's bytes must print the same
    assert f"{kv.k / MiB:.2f}" == k_mib
    assert f"{kv.v / MiB:.2f}" == v_mib
    assert f"{kv.total / MiB:.2f}" == total_mib


BUFFER_LINE = re.compile(r"CPU +(?:compute|output) buffer size = +([\d.]+) MiB")


@pytest.mark.parametrize(
    ("size", "ctx", "slots", "n_ubatch", "flash_attn"),
    [
        ("tiny", 4096, 1, 32, True),
        ("small", 2048, 4, 128, True),
        ("small", 2048, 4, 128, False),
        ("small", 4096, 1, 512, False),
    ],
)
def test_compute_estimate_covers_llama_cpp_buffers(
    size: str, ctx: int, slots: int, n_ubatch: int, flash_attn: bool
) -> None:
    from orin.model import demo

    path = demo.ensure(size, "f16")
    info = read_model_info(path)
    with (
        capture_log() as lines,
        llama_context(path, ctx, slots, n_ubatch=n_ubatch, flash_attn=flash_attn),
    ):
        pass
    reported = sum(float(x) for x in BUFFER_LINE.findall("".join(lines))) * MiB
    assert reported > 0
    estimate = compute_bytes_estimate(
        info, kv_cells_per_seq(ctx, slots), slots, n_ubatch, flash_attn
    )
    # an estimate that errs high, but not wildly
    assert reported <= estimate <= 2.5 * reported + 0.01 * MiB
