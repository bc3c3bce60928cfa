from __future__ import annotations

from pathlib import Path

import pytest

from orin.errors import KVConfigError
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.memplan import (
    KV_TYPES,
    bytes_per_element,
    kv_cache_bytes,
    kv_cells_per_seq,
    max_context,
    plan_memory,
    total_bytes,
)
from orin.profile.fit import HEADROOM, memory_fit
from orin.profile.schema import EngineSection
from tests.ggufutil import LLAMA2_7B, write_gguf

MiB = 1 << 20


@pytest.fixture
def llama2_7b(tmp_path: Path) -> ModelInfo:
    return read_model_info(write_gguf(tmp_path / "l2.gguf", params=LLAMA2_7B))


def test_llama2_7b_512_tokens_f16_is_256_mib(llama2_7b: ModelInfo) -> None:
    kv = kv_cache_bytes(llama2_7b, 512, "f16", "f16")
    assert kv.total == 256 * MiB
    assert kv.k == kv.v == 128 * MiB


@pytest.mark.parametrize(
    ("kv_type", "per_element"),
    [
        ("f32", 4),
        ("f16", 2),
        ("bf16", 2),
        ("q8_0", 34 / 32),
        ("q4_0", 18 / 32),
        ("q4_1", 20 / 32),
        ("q5_0", 22 / 32),
        ("q5_1", 24 / 32),
        ("iq4_nl", 18 / 32),
    ],
)
def test_bytes_per_element(kv_type: str, per_element: float) -> None:
    assert bytes_per_element(kv_type) == per_element


def test_kv_scales_with_type(llama2_7b: ModelInfo) -> None:
    f16 = kv_cache_bytes(llama2_7b, 4096, "f16", "f16").total
    q8 = kv_cache_bytes(llama2_7b, 4096, "q8_0", "q8_0").total
    mixed = kv_cache_bytes(llama2_7b, 4096, "q8_0", "q4_0")
    assert q8 * 32 == f16 * 17  # 34/32 bytes against 2
    assert mixed.v * 34 == mixed.k * 18


def test_per_layer_heads_are_summed(tmp_path: Path) -> None:
    params = dict(LLAMA2_7B, block_count=3, **{"attention.head_count_kv": [8, 4, 0]})
    info = read_model_info(write_gguf(tmp_path / "a.gguf", params=params))
    # (8 + 4 + 0) heads x 128 dims x 2 bytes x (K + V) x 256 cells
    assert kv_cache_bytes(info, 256, "f16", "f16").total == 12 * 128 * 2 * 2 * 256


def test_unknown_and_misaligned_types(tmp_path: Path) -> None:
    params = dict(
        LLAMA2_7B, embedding_length=48, **{"attention.head_count": 3, "attention.head_count_kv": 3}
    )
    info = read_model_info(write_gguf(tmp_path / "odd.gguf", params=params))
    with pytest.raises(KVConfigError, match="does not divide this model's head dimension 16"):
        kv_cache_bytes(info, 256, "q8_0", "f16")
    with pytest.raises(KVConfigError, match="unknown KV cache type"):
        kv_cache_bytes(info, 256, "q3_k", "f16")
    plan = plan_memory(info, 512, 1, available=1 << 30)
    assert set(plan.unsupported_kv_types) == set(KV_TYPES) - {"f32", "f16", "bf16"}
    assert set(plan.max_ctx_by_kv_type) == {"f32", "f16", "bf16"}


@pytest.mark.parametrize(
    ("ctx", "slots", "cells"),
    [(512, 1, 512), (500, 1, 512), (1000, 3, 1024), (256, 4, 256), (4096, 4, 4096), (300, 2, 512)],
)
def test_cells_follow_llama_cpp_padding(ctx: int, slots: int, cells: int) -> None:
    assert kv_cells_per_seq(ctx, slots) == cells


def test_max_context_is_the_boundary(llama2_7b: ModelInfo) -> None:
    available = 2 * 1024 * MiB
    for kv_type in ("f16", "q8_0", "q4_0"):
        best = max_context(llama2_7b, 1, kv_type, kv_type, available)
        assert best is not None and best % 256 == 0
        assert total_bytes(llama2_7b, best, 1, kv_type, kv_type, 512, True) <= available
        assert total_bytes(llama2_7b, best + 256, 1, kv_type, kv_type, 512, True) > available
    f16 = max_context(llama2_7b, 1, "f16", "f16", available)
    q4 = max_context(llama2_7b, 1, "q4_0", "q4_0", available)
    assert f16 is not None and q4 is not None and q4 > 3 * f16


def test_nothing_fits(llama2_7b: ModelInfo) -> None:
    assert max_context(llama2_7b, 1, "f16", "f16", 1024) is None


def test_plan_totals_and_fit(llama2_7b: ModelInfo) -> None:
    plan = plan_memory(llama2_7b, 512, 1, "f16", "f16", available=64 * 1024 * MiB)
    assert plan.cells == 512
    assert plan.kv_bytes == 256 * MiB
    assert plan.total_bytes == plan.weights_bytes + plan.kv_bytes + plan.compute_bytes
    assert plan.fits is True
    assert set(plan.max_ctx_by_kv_type) == set(KV_TYPES)
    tight = plan_memory(llama2_7b, 512, 1, "f16", "f16", available=100 * MiB)
    assert tight.fits is False
    unknown = plan_memory(llama2_7b, 512, 1, "f16", "f16", available=None)
    assert unknown.fits is None and unknown.max_ctx_by_kv_type == {}


def test_flash_attention_off_needs_more_compute(llama2_7b: ModelInfo) -> None:
    on = plan_memory(llama2_7b, 4096, 1, flash_attn=True)
    off = plan_memory(llama2_7b, 4096, 1, flash_attn=False)
    assert off.compute_bytes > on.compute_bytes


def test_memory_fit_grades_against_the_available_memory(tmp_path: Path) -> None:
    info = read_model_info(write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15))
    engine = EngineSection(n_ctx=4096, slots=4)
    need = total_bytes(info, 4096, 4, "q8_0", "q8_0", engine.n_ubatch, True)

    def fit(available: int) -> str:
        return memory_fit(info, engine, "q8_0", "q8_0", True, available).severity

    assert fit(2 * need) == "ok"
    assert fit(int(need / (1 - HEADROOM / 2))) == "warn"  # fits, under 10% left
    assert fit(need) == "warn"
    assert fit(need - 1) == "fail"
    roomy = memory_fit(info, engine, "q8_0", "q8_0", True, 2 * need)
    assert roomy.plan is not None and roomy.plan.total_bytes == need
    assert roomy.best_ctx is not None and roomy.best_ctx > 4096
    assert f"largest per-slot context that fits: {roomy.best_ctx}" in roomy.found


def test_memory_fit_fails_a_kv_type_the_model_cannot_hold(tmp_path: Path) -> None:
    params = dict(
        LLAMA2_7B, embedding_length=48, **{"attention.head_count": 3, "attention.head_count_kv": 3}
    )
    info = read_model_info(write_gguf(tmp_path / "odd.gguf", params=params))
    fit = memory_fit(info, EngineSection(n_ctx=512, slots=1), "q8_0", "f16", True, 64 << 30)
    assert (fit.severity, fit.plan) == ("fail", None)
    assert "head dimension 16" in fit.found and fit.fix == "engine.type_k/type_v: f16 or q8_0"
