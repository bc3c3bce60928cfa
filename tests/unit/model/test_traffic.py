"""Decode bytes per step on generated GGUF files whose tensor sizes are known."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orin.errors import KVConfigError
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.traffic import (
    decode_bytes_per_batch,
    decode_bytes_per_step,
    decode_traffic,
    expert_share,
    kv_bytes_per_cell,
    weight_traffic,
)
from tests.ggufutil import write_gguf

N_EMBD, N_VOCAB, N_FF = 64, 100, 128
# 2 layers x 1 KV head x 32 values; per cell and layer K and V of 32 values each
PARAMS: dict[str, Any] = {
    "block_count": 2,
    "embedding_length": N_EMBD,
    "feed_forward_length": N_FF,
    "attention.head_count": 2,
    "attention.head_count_kv": 1,
    "context_length": 4096,
}
EMBD_BYTES = N_VOCAB * N_EMBD * 4  # f32 table, 100 rows of 256 bytes
ROW_BYTES = N_EMBD * 4
F16_CELL = 2 * 2 * 32 * 2  # layers x (K + V) x values x 2 bytes
Q8_CELL = 2 * 2 * 34  # one 32-value block of 34 bytes per K or V row


def layer_tensors(layers: int = 2) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for il in range(layers):
        out[f"blk.{il}.attn_q.weight"] = np.zeros((N_EMBD, N_EMBD), np.float16)  # 8 KiB
        out[f"blk.{il}.ffn_up.weight"] = np.zeros((N_FF, N_EMBD), np.float16)  # 16 KiB
        out[f"blk.{il}.attn_norm.weight"] = np.zeros(N_EMBD, np.float32)  # 256 B
    return out


LAYER_BYTES = N_EMBD * N_EMBD * 2 + N_FF * N_EMBD * 2 + N_EMBD * 4


def model(tmp_path: Path, tied: bool = False, **extra: Any) -> ModelInfo:
    tensors = {"token_embd.weight": np.zeros((N_VOCAB, N_EMBD), np.float32), **layer_tensors()}
    tensors["output_norm.weight"] = np.zeros(N_EMBD, np.float32)
    if not tied:
        tensors["output.weight"] = np.zeros((N_VOCAB, N_EMBD), np.float16)
    tensors.update(extra.pop("tensors", {}))
    params = {**PARAMS, **extra}
    return read_model_info(write_gguf(tmp_path / "m.gguf", params=params, tensors=tensors))


OUTPUT_BYTES = N_VOCAB * N_EMBD * 2
DENSE = 2 * LAYER_BYTES + N_EMBD * 4 + OUTPUT_BYTES  # all but the embedding table


def test_weights_once_and_one_embedding_row(tmp_path: Path) -> None:
    info = model(tmp_path)
    assert info.weights_bytes == DENSE + EMBD_BYTES
    w = weight_traffic(info)
    assert (w.dense, w.embedding_row, w.embedding_table, w.experts) == (
        DENSE,
        ROW_BYTES,
        EMBD_BYTES,
        0,
    )
    assert decode_bytes_per_step(info, 0, "f16", "f16") == DENSE + ROW_BYTES


def test_tied_embeddings_are_read_in_full(tmp_path: Path) -> None:
    # no output.weight: llama.cpp multiplies by the embedding table for the logits
    info = model(tmp_path, tied=True)
    dense = 2 * LAYER_BYTES + N_EMBD * 4 + EMBD_BYTES
    assert decode_bytes_per_step(info, 0, "f16", "f16") == dense
    assert weight_traffic(info).embedding_row == 0


@pytest.mark.parametrize(("kv_type", "per_cell"), [("f16", F16_CELL), ("q8_0", Q8_CELL)])
def test_kv_bytes_scale_with_cells_and_type(tmp_path: Path, kv_type: str, per_cell: int) -> None:
    info = model(tmp_path)
    base = DENSE + ROW_BYTES
    assert kv_bytes_per_cell(info, kv_type, kv_type) == (per_cell, 0)
    for cells in (1, 100, 4096):
        assert decode_bytes_per_step(info, cells, kv_type, kv_type) == base + per_cell * cells


def test_q8_0_is_34_bytes_per_32_values(tmp_path: Path) -> None:
    info = model(tmp_path)
    f16 = decode_bytes_per_step(info, 1000, "f16", "f16") - decode_bytes_per_step(
        info, 0, "f16", "f16"
    )
    q8 = decode_bytes_per_step(info, 1000, "q8_0", "q8_0") - decode_bytes_per_step(
        info, 0, "q8_0", "q8_0"
    )
    assert q8 * 64 == f16 * 34  # 34 bytes per 32 values against 2 bytes per value
    mixed = decode_traffic(info, [1000], "q8_0", "f16").kv
    assert mixed == 1000 * 2 * (34 + 64)  # per layer: a q8_0 K row and an f16 V row


def test_a_batch_reads_the_weights_once_and_kv_per_stream(tmp_path: Path) -> None:
    info = model(tmp_path)
    one = decode_bytes_per_step(info, 0, "f16", "f16")
    batch = decode_bytes_per_batch(info, [10, 20, 30], "f16", "f16")
    # weights once, one embedding row per stream, each stream's own cells
    assert batch == one + 2 * ROW_BYTES + F16_CELL * 60
    t = decode_traffic(info, [10, 20, 30], "f16", "f16")
    assert (t.weights, t.kv, t.state, t.streams) == (DENSE + 3 * ROW_BYTES, F16_CELL * 60, 0, 3)
    assert decode_bytes_per_batch(info, [77], "f16", "f16") == decode_bytes_per_step(
        info, 77, "f16", "f16"
    )


def test_bad_inputs(tmp_path: Path) -> None:
    info = model(tmp_path)
    with pytest.raises(ValueError, match="at least one stream"):
        decode_bytes_per_batch(info, [], "f16", "f16")
    with pytest.raises(ValueError, match="negative"):
        decode_bytes_per_step(info, -1, "f16", "f16")
    with pytest.raises(KVConfigError, match="unknown KV cache type"):
        decode_bytes_per_step(info, 1, "q7", "f16")


def test_experts_are_read_by_the_share_a_step_runs(tmp_path: Path) -> None:
    experts = np.zeros((4, N_FF, N_EMBD), np.float16)  # 4 experts, 16 KiB each
    info = model(
        tmp_path,
        expert_count=4,
        expert_used_count=2,
        tensors={"blk.0.ffn_up_exps.weight": experts},
    )
    assert weight_traffic(info).experts == experts.nbytes
    assert [expert_share(info, s) for s in (1, 2, 3)] == [0.5, 1.0, 1.0]
    one = decode_bytes_per_step(info, 0, "f16", "f16")
    assert one == DENSE + ROW_BYTES + experts.nbytes // 2
    two = decode_bytes_per_batch(info, [0, 0], "f16", "f16")
    assert two == DENSE + 2 * ROW_BYTES + experts.nbytes


def test_next_token_prediction_layers_are_skipped(tmp_path: Path) -> None:
    extra = {f"blk.2.{k.split('.', 2)[2]}": v for k, v in layer_tensors(1).items()}
    info = model(tmp_path, block_count=3, nextn_predict_layers=1, tensors=extra)
    assert info.n_layer_nextn == 1
    w = weight_traffic(info)
    assert w.skipped == LAYER_BYTES and w.dense == DENSE
    # the KV of the two main layers only
    assert decode_bytes_per_step(info, 10, "f16", "f16") == DENSE + ROW_BYTES + 10 * F16_CELL


def test_sliding_window_layers_attend_to_their_window(tmp_path: Path) -> None:
    params = {
        "block_count": 2,
        "embedding_length": N_EMBD,
        "feed_forward_length": N_FF,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.sliding_window": 64,
        "context_length": 4096,
    }
    path = write_gguf(tmp_path / "g2.gguf", arch="gemma2", params=params, tensors=layer_tensors())
    info = read_model_info(path)
    assert info.kv_layout == "iswa" and info.swa_layers == (True, False)
    layer_cell = F16_CELL // 2
    assert kv_bytes_per_cell(info, "f16", "f16") == (layer_cell, layer_cell)
    kv = decode_traffic(info, [1000], "f16", "f16").kv
    assert kv == layer_cell * 1000 + layer_cell * 64  # the window layer reads 64 cells
    assert decode_traffic(info, [10], "f16", "f16").kv == 2 * layer_cell * 10


@pytest.mark.llama
def test_the_tiny_demo_model(tiny_f16: Path) -> None:
    info = read_model_info(tiny_f16)
    w = weight_traffic(info)
    assert w.embedding_table > 0 and w.embedding_row * info.vocab_size == w.embedding_table
    step = decode_bytes_per_step(info, 0, "f16", "f16")
    assert step == info.weights_bytes - w.embedding_table + w.embedding_row
