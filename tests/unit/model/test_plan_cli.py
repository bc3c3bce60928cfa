"""model plan keeps to the rules profile validate applies: a quantized V cache needs flash
attention, and no context past the model's training context is offered unmarked."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from orin.cli.app import app
from orin.model.gguf import read_model_info
from orin.model.memplan import plan_memory
from tests.fakes.board import FakeBoard, GiB
from tests.ggufutil import LLAMA2_7B, write_gguf


def plan(board: FakeBoard, path: Path, *args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(
        app,
        ["model", "plan", str(path), "--root", str(board.base), *args],
        env={"COLUMNS": "240"},
    )
    return r.exit_code, r.stdout, r.stderr


def test_quantized_v_without_flash_attention_does_not_fit(tmp_path: Path, board: FakeBoard) -> None:
    board.meminfo(total=64 * GiB, available=48 * GiB)
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    args = ("--kv-type-k", "q8_0", "--kv-type-v", "q8_0", "--no-flash-attn")
    code, out, err = plan(board, path, *args, "--json")
    assert code == 1, err
    data = json.loads(out)
    assert data["fits"] is False
    assert "needs flash attention" in data["refused"][0]
    assert data["max_ctx_usable_by_kv_type"]["q8_0"] is None
    code, out, err = plan(board, path, *args)
    assert code == 1 and "NO: llama.cpp refuses" in out and "needs flash attention" in err
    code, out, _ = plan(board, path, "--kv-type-k", "q8_0", "--kv-type-v", "q8_0", "--json")
    assert code == 0 and json.loads(out)["fits"] is True and json.loads(out)["refused"] == []


def test_a_plan_that_does_not_fit_exits_1_and_still_prints(
    tmp_path: Path, board: FakeBoard
) -> None:
    """It exited 0 with `fits: NO`, so a script could not tell without parsing."""
    board.meminfo(total=8 * GiB, available=1 * GiB)
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    code, out, err = plan(board, path, "--ctx", "4096", "--json")
    assert code == 1, err
    data = json.loads(out)
    assert data["fits"] is False and data["total_bytes"] > data["available_bytes"]
    code, out, err = plan(board, path, "--ctx", "4096")
    assert code == 1, err
    assert "total" in out and "NO" in out and "largest context per slot that fits" in out
    code, out, err = plan(board, path, "--ctx", "256", "--json")
    assert code == 0 and json.loads(out)["fits"] is True


def test_largest_context_is_capped_at_the_training_context(
    tmp_path: Path, board: FakeBoard
) -> None:
    board.meminfo(total=64 * GiB, available=48 * GiB)
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)  # trained on 4096
    p = plan_memory(read_model_info(path), 4096, 1, available=48 * GiB)
    assert p.max_ctx_by_kv_type["f16"] is not None and p.max_ctx_by_kv_type["f16"] > 4096
    assert p.max_ctx_usable["f16"] == 4096 and "f16" in p.capped_kv_types
    code, out, err = plan(board, path)
    assert code == 0, err
    assert "4096 (training context; memory allows" in out
    assert "capped at the model's training context (4096 tokens)" in err
    code, _, err = plan(board, path, "--ctx", "8192")
    assert "past the model's training context (4096)" in err


def test_a_micro_batch_larger_than_the_batch_is_a_usage_error(tmp_path: Path) -> None:
    """A profile refuses engine.n_ubatch above engine.n_batch; plan planned it, with
    compute buffers for a micro-batch llama.cpp never allocates."""
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    r = CliRunner().invoke(app, ["model", "plan", str(path), "--ubatch", "2048", "--batch", "512"])
    assert r.exit_code == 2 and r.stdout == ""
    assert "--ubatch 2048 exceeds --batch 512" in " ".join(r.stderr.split())


def test_compute_buffers_are_planned_for_the_micro_batch_llamacpp_uses(tmp_path: Path) -> None:
    """llama.cpp caps the batch at the context (and the micro-batch at the batch): a
    2048-token micro-batch on a 256-token context computes 256 tokens at a time."""
    info = read_model_info(write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15))
    capped = plan_memory(info, 256, 1, n_ubatch=2048, n_batch=2048)
    assert capped.compute_bytes == plan_memory(info, 256, 1, n_ubatch=256).compute_bytes
    assert capped.total_bytes < plan_memory(info, 4096, 1, n_ubatch=2048).total_bytes


def test_a_draft_model_is_counted(tmp_path: Path, board: FakeBoard) -> None:
    """--draft-model: the speculative draft model's weights, f16 cache and compute are
    in the total and in the largest context that fits."""
    from orin.model.memplan import draft_bytes

    board.meminfo(total=64 * GiB, available=48 * GiB)
    path = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    args = ("--ctx", "2048", "--slots", "2", "--json")
    code, out, err = plan(board, path, *args)
    assert code == 0, err
    alone = json.loads(out)
    code, out, err = plan(board, path, *args, "--draft-model", str(path))
    assert code == 0, err
    both = json.loads(out)
    extra = draft_bytes(read_model_info(path), 2048, 2, 512, True)
    assert both["draft_bytes"] == extra > 0 and alone["draft_bytes"] == 0
    assert both["total_bytes"] == alone["total_bytes"] + extra
    assert both["max_ctx_by_kv_type"]["f16"] < alone["max_ctx_by_kv_type"]["f16"]
    code, out, _ = plan(board, path, "--draft-model", str(path))
    assert "draft model (weights, KV, compute)" in out
