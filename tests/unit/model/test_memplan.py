from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from orin.errors import KVConfigError
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.memplan import (
    KV_TYPES,
    bytes_per_element,
    draft_bytes,
    kv_cache_bytes,
    kv_caches,
    kv_cells_per_seq,
    max_context,
    plan_memory,
    recurrent_state_bytes,
    swa_cells_per_seq,
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


def test_the_plan_reports_the_micro_batch_llama_cpp_runs(llama2_7b: ModelInfo) -> None:
    """An --ubatch above the context or the batch is capped by llama.cpp; the plan (its
    JSON) said the value asked for beside compute figures sized for the capped one."""
    plan = plan_memory(llama2_7b, 256, 1, n_ubatch=100_000_000, n_batch=None)
    assert plan.n_ubatch == 256 and plan.to_dict()["n_ubatch"] == 256
    assert plan_memory(llama2_7b, 4096, 2, n_ubatch=1024, n_batch=512).n_ubatch == 512
    assert plan_memory(llama2_7b, 4096, 2, n_ubatch=128).n_ubatch == 128


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


# -- layouts beyond the plain one ----------------------------------------------------

GEMMA3_27B = {
    "block_count": 62,
    "embedding_length": 5376,
    "feed_forward_length": 21504,
    "attention.head_count": 32,
    "attention.head_count_kv": 16,
    "attention.key_length": 128,
    "attention.value_length": 128,
    "attention.sliding_window": 1024,
    "context_length": 131072,
}


@pytest.fixture
def gemma3_27b(tmp_path: Path) -> ModelInfo:
    return read_model_info(write_gguf(tmp_path / "g3.gguf", arch="gemma3", params=GEMMA3_27B))


def test_gemma3_27b_window_cache(gemma3_27b: ModelInfo) -> None:
    """10 global layers hold the context, 52 window layers 1024 + one micro-batch."""
    assert (gemma3_27b.n_swa_layers, gemma3_27b.sliding_window) == (52, 1024)
    row = 16 * 128 * 2  # one cell's K (or V) row of one layer in f16
    full, window = kv_caches(gemma3_27b, 32768, 1, "f16", "f16")  # the default
    assert (full.kind, full.layers, full.cells_per_seq) == ("full", 10, 32768)
    assert (window.kind, window.layers, window.cells_per_seq) == ("swa", 52, 1536)
    assert full.k_bytes == full.v_bytes == 10 * 32768 * row
    assert window.k_bytes == window.v_bytes == 52 * 1536 * row
    # engine.swa_full: true: every layer holds the context
    full, window = kv_caches(gemma3_27b, 32768, 1, "f16", "f16", swa_full=True)
    assert window.cells_per_seq == full.cells_per_seq == 32768
    assert full.total + window.total == kv_cache_bytes(gemma3_27b, 32768, "f16", "f16").total


@pytest.mark.parametrize(
    ("ctx", "slots", "n_ubatch", "n_batch", "cells"),
    [
        (32768, 1, 512, None, 1536),  # window 1024 + 512, padded to 256
        (32768, 4, 512, None, 1536),  # per KV stream: one stream per slot
        (32768, 1, 100, None, 1280),  # 1124 -> 1280
        (32768, 1, 512, 64, 1280),  # n_ubatch is capped by n_batch
        (700, 1, 512, 2048, 768),  # capped by the context: min(768, 1024 + 512)
        (60, 1, 512, None, 256),  # a context shorter than the window: all 256 cells
    ],
)
def test_window_cells_follow_llama_cpp(
    gemma3_27b: ModelInfo, ctx: int, slots: int, n_ubatch: int, n_batch: int | None, cells: int
) -> None:
    assert swa_cells_per_seq(gemma3_27b, ctx, slots, n_ubatch, n_batch) == cells
    full = swa_cells_per_seq(gemma3_27b, ctx, slots, n_ubatch, n_batch, swa_full=True)
    assert full == kv_cells_per_seq(ctx, slots)


def test_window_plan_and_largest_context(gemma3_27b: ModelInfo) -> None:
    full = plan_memory(gemma3_27b, 32768, 1, available=64 * 1024 * MiB, swa_full=True)
    windowed = plan_memory(gemma3_27b, 32768, 1, available=64 * 1024 * MiB)
    assert full.swa_full and not windowed.swa_full
    assert windowed.kv_bytes < full.kv_bytes / 4
    assert [c.kind for c in windowed.kv_caches] == ["full", "swa"]
    assert not windowed.kv_estimated and windowed.estimated == ("compute_bytes",)
    f16_full, f16_window = full.max_ctx_by_kv_type["f16"], windowed.max_ctx_by_kv_type["f16"]
    assert f16_full is not None and f16_window is not None and f16_window > 4 * f16_full
    d = windowed.to_dict()
    assert d["kv_caches"][1] == {
        "kind": "swa",
        "layers": 52,
        "cells_per_seq": 1536,
        "k_bytes": 52 * 1536 * 4096,
        "v_bytes": 52 * 1536 * 4096,
    }
    assert d["estimated"] == ["compute_bytes"] and d["kv_estimated"] is False


def test_without_flash_attention_v_is_padded_to_the_widest_layer(tmp_path: Path) -> None:
    params = dict(LLAMA2_7B, block_count=3, **{"attention.head_count_kv": [8, 4, 0]})
    info = read_model_info(write_gguf(tmp_path / "d.gguf", arch="deci", params=params))
    fa = kv_cache_bytes(info, 256, "f16", "f16")
    no_fa = kv_cache_bytes(info, 256, "f16", "f16", flash_attn=False)
    assert fa.k == no_fa.k == (8 + 4) * 128 * 2 * 256
    assert fa.v == (8 + 4) * 128 * 2 * 256
    assert no_fa.v == 3 * 8 * 128 * 2 * 256  # every layer, the empty one too
    plan = plan_memory(info, 256, 1, flash_attn=False)
    assert plan.kv_v_bytes == no_fa.v


def test_experts_weights_are_the_tensor_table_and_compute_counts_them(tmp_path: Path) -> None:
    moe = dict(
        LLAMA2_7B,
        **{"expert_count": 128, "expert_used_count": 8, "expert_feed_forward_length": 2048},
    )
    tensors = {"blk.0.ffn_up_exps.weight": np.zeros((4, 8, 16), dtype=np.float16)}
    info = read_model_info(write_gguf(tmp_path / "m.gguf", "qwen3moe", moe, tensors))
    dense = read_model_info(write_gguf(tmp_path / "d.gguf", "qwen3", LLAMA2_7B, tensors))
    plan = plan_memory(info, 4096, 1)
    assert plan.weights_bytes == info.weights_bytes == 4 * 8 * 16 * 2  # every expert
    assert plan.kv_bytes == plan_memory(dense, 4096, 1).kv_bytes
    assert plan.compute_bytes > plan_memory(dense, 4096, 1).compute_bytes  # 8 x 2048 > 11008


def test_recurrent_model_is_an_estimate(tmp_path: Path) -> None:
    params = {
        "block_count": 24,
        "embedding_length": 768,
        "context_length": 1 << 20,
        "attention.head_count": 0,
        "ssm.conv_kernel": 4,
        "ssm.inner_size": 1536,
        "ssm.state_size": 16,
        "ssm.time_step_rank": 48,
    }
    info = read_model_info(write_gguf(tmp_path / "m.gguf", arch="mamba", params=params))
    plan = plan_memory(info, 4096, 2, available=8 * 1024 * MiB)
    assert plan.kv_bytes == 0 and plan.kv_caches == ()
    assert plan.state_bytes == 24 * (3 * 1536 + 16 * 1536) * 4 * 2
    assert plan.kv_estimated and plan.kv_note == info.kv_note
    assert set(plan.estimated) == {"kv_k_bytes", "kv_v_bytes", "state_bytes", "compute_bytes"}
    assert plan.total_bytes == (plan.weights_bytes + plan.state_bytes + plan.compute_bytes)
    assert plan.to_dict()["kv_estimated"] is True


def test_hybrid_model_counts_attention_layers_and_recurrent_state(tmp_path: Path) -> None:
    params = {
        "block_count": 4,
        "embedding_length": 256,
        "context_length": 4096,
        "attention.head_count": 4,
        "attention.head_count_kv": [0, 0, 0, 2],
        "ssm.conv_kernel": 4,
        "ssm.inner_size": 512,
        "ssm.state_size": 16,
    }
    info = read_model_info(write_gguf(tmp_path / "j.gguf", arch="jamba", params=params))
    (cache,) = kv_caches(info, 1024, 1, "f16", "f16")
    assert cache.layers == 1 and cache.k_bytes == 1024 * 2 * 64 * 2
    assert recurrent_state_bytes(info, 1) == 3 * (3 * 512 + 16 * 512) * 4
    assert plan_memory(info, 1024).kv_estimated


def test_mla_caches_k_only(tmp_path: Path) -> None:
    params = {
        "block_count": 2,
        "embedding_length": 1024,
        "context_length": 4096,
        "attention.head_count": 16,
        "attention.head_count_kv": 1,
        "attention.key_length": 576,
        "attention.value_length": 512,
        "attention.key_length_mla": 192,
        "attention.value_length_mla": 128,
    }
    info = read_model_info(write_gguf(tmp_path / "ds.gguf", arch="deepseek2", params=params))
    kv = kv_cache_bytes(info, 256, "f16", "f16")
    assert (kv.k, kv.v) == (2 * 256 * 576 * 2, 0)
    assert plan_memory(info, 256).kv_estimated


def test_next_token_prediction_layers_cache_nothing(tmp_path: Path) -> None:
    params = dict(LLAMA2_7B, block_count=4, nextn_predict_layers=1)
    info = read_model_info(write_gguf(tmp_path / "n.gguf", arch="glm4moe", params=params))
    (cache,) = kv_caches(info, 256, 1, "f16", "f16")
    assert cache.layers == 3
    assert plan_memory(info, 256).kv_estimated


def test_a_draft_model_adds_its_weights_cache_and_compute(tmp_path: Path) -> None:
    """speculative.draft_model loads beside the model with a context of its own: the
    served model's context per slot and slots, an f16 cache, full sliding-window layers
    (DraftModel.from_config). The plan counts all of it, and the largest context that
    fits is smaller, since the draft's cache grows with the context too."""
    target = read_model_info(write_gguf(tmp_path / "t.gguf", params=LLAMA2_7B, file_type=15))
    small = dict(LLAMA2_7B, block_count=16, embedding_length=512, feed_forward_length=1024)
    weights = {"token_embd.weight": np.zeros((256, 512), np.float16)}
    draft = read_model_info(write_gguf(tmp_path / "d.gguf", params=small, tensors=weights))
    assert draft.weights_bytes == 256 * 512 * 2
    alone = plan_memory(target, 4096, 4, "q8_0", "q8_0", available=64 * 1024 * MiB)
    both = plan_memory(target, 4096, 4, "q8_0", "q8_0", available=64 * 1024 * MiB, draft=draft)
    expected = total_bytes(draft, 4096, 4, "f16", "f16", 512, True, None, True)
    assert both.draft_bytes == expected == draft_bytes(draft, 4096, 4, 512, True)
    assert expected > draft.weights_bytes + kv_cache_bytes(draft, 4 * 4096, "f16", "f16").total
    assert both.total_bytes == alone.total_bytes + expected
    assert both.to_dict()["draft_bytes"] == expected
    room = both.total_bytes  # the draft's place is the context the target alone would get
    alone_best = plan_memory(target, 4096, 4, "q8_0", "q8_0", available=room)
    both_best = plan_memory(target, 4096, 4, "q8_0", "q8_0", available=room, draft=draft)
    assert both_best.max_ctx_by_kv_type["q8_0"] == 4096
    assert (alone_best.max_ctx_by_kv_type["q8_0"] or 0) > 4096
    engine = EngineSection(n_ctx=4096, slots=4)
    need = both.total_bytes
    assert memory_fit(target, engine, "q8_0", "q8_0", True, need - 1, draft=draft).severity == (
        "fail"
    )
    fit = memory_fit(target, engine, "q8_0", "q8_0", True, 2 * need, draft=draft)
    assert fit.plan is not None and fit.plan.total_bytes == need
    assert "+ draft model ~" in fit.found


def test_memory_fit_offers_fewer_slots_only_where_one_slot_fits(tmp_path: Path) -> None:
    """Nothing fits at 8 slots: the fix names one slot where one fits some context, and
    only smaller weights where not even one slot does (fewer slots cannot help then)."""
    info = read_model_info(write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15))
    engine = EngineSection(n_ctx=4096, slots=8)
    one = total_bytes(info, 1024, 1, "q8_0", "q8_0", engine.n_ubatch, True)
    assert max_context(info, 8, "q8_0", "q8_0", one, engine.n_ubatch, True) is None
    crowded = memory_fit(info, engine, "q8_0", "q8_0", True, one)
    assert crowded.severity == "fail" and crowded.best_ctx is None
    largest = max_context(info, 1, "q8_0", "q8_0", one, engine.n_ubatch, True)
    assert largest is not None and largest >= 1024
    assert crowded.fix.startswith(f"fewer slots (one slot fits engine.n_ctx up to {largest})")
    weights_only = total_bytes(info, 256, 1, "q8_0", "q8_0", engine.n_ubatch, True) - 1
    tight = memory_fit(info, engine, "q8_0", "q8_0", True, weights_only)
    assert tight.severity == "fail" and "fewer slots" not in tight.fix
    assert tight.fix.startswith("a smaller quantization or model: the weights leave no room")


def test_memory_fit_offers_no_draft_model_where_that_makes_room(tmp_path: Path) -> None:
    info = read_model_info(write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15))
    engine = EngineSection(n_ctx=4096, slots=1)
    draft = info  # a draft model as large as the model: no context fits beside both
    n_ubatch = engine.n_ubatch
    available = total_bytes(info, 256, 1, "q8_0", "q8_0", n_ubatch, True, None, False, draft) - 1
    fit = memory_fit(info, engine, "q8_0", "q8_0", True, available, draft=draft)
    bare = max_context(info, 1, "q8_0", "q8_0", available, n_ubatch, True)
    assert fit.severity == "fail" and bare is not None and bare > 256
    assert fit.fix == (
        f"no draft model (speculative.mode: ngram fits engine.n_ctx up to {bare}), or a "
        "smaller quantization or model"
    )
