"""doctor's mmproj check: the vision projector against its model, and its memory in
the memory plan."""

from __future__ import annotations

from pathlib import Path

import pytest

from orin.doctor import checks
from orin.doctor.context import DoctorContext
from orin.model import demo, mmproj
from orin.model.gguf import read_model_info
from orin.model.memplan import plan_memory
from orin.profile.schema import Profile
from tests.fakes.boards_system import agx_orin_64gb_jp6
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.unit.doctor.conftest import MakeCtx


@pytest.fixture
def ctx(tmp_path: Path, make_ctx: MakeCtx) -> object:
    fake = agx_orin_64gb_jp6(tmp_path / "board")

    def make(model: Path, **model_section: object) -> DoctorContext:
        profile = Profile(name="t", model=model_section)
        return make_ctx(fake.board.root, fake.runner, profile=profile, model=model)

    return make


def tiny_text_model(tmp_path: Path) -> Path:
    """A metadata-only llama as wide as the tiny demo model."""
    params = dict(LLAMA2_7B, embedding_length=demo.SIZES["tiny"].n_embd)
    return write_gguf(tmp_path / "tiny.gguf", params=params, file_type=1)


def test_no_projector_is_ok(tmp_path: Path, ctx: object) -> None:
    f = checks.check_mmproj(ctx(tiny_text_model(tmp_path)))  # type: ignore[operator]
    assert f.severity == "ok" and "text only" in f.found


def test_a_projector_made_for_the_model_is_ok_with_its_memory(tmp_path: Path, ctx: object) -> None:
    proj = mmproj.generate("tiny", tmp_path / "mmproj.gguf")
    f = checks.check_mmproj(ctx(tiny_text_model(tmp_path), mmproj=str(proj)))  # type: ignore[operator]
    assert f.severity == "ok", f
    assert "mlp projector, 16 image tokens" in f.found and "MiB" in f.found


def test_a_projector_for_another_width_fails(tmp_path: Path, ctx: object) -> None:
    proj = mmproj.generate("small", tmp_path / "mmproj.gguf")  # 256 wide, not 64
    f = checks.check_mmproj(ctx(tiny_text_model(tmp_path), mmproj=str(proj)))  # type: ignore[operator]
    assert f.severity == "fail" and "256 wide" in f.found


def test_a_missing_or_wrong_file_fails(tmp_path: Path, ctx: object) -> None:
    model = tiny_text_model(tmp_path)
    missing = checks.check_mmproj(ctx(model, mmproj=str(tmp_path / "none.gguf")))  # type: ignore[operator]
    assert missing.severity == "fail" and "does not exist" in missing.found
    wrong = checks.check_mmproj(ctx(model, mmproj=str(model)))  # type: ignore[operator]
    assert wrong.severity == "fail" and "not a projector" in wrong.found


def test_projector_info_and_the_memory_plan(tmp_path: Path) -> None:
    proj = mmproj.read_projector_info(mmproj.generate("tiny", tmp_path / "p.gguf"))
    assert (proj.projector_type, proj.output_width, proj.n_patches) == ("mlp", 64, 16)
    assert proj.weights_bytes > 0 and proj.compute_bytes > 0
    assert mmproj.fit_problem(proj, 64) is None
    info = read_model_info(tiny_text_model(tmp_path))
    base = plan_memory(info, 4096, available=64 * 2**30)
    with_proj = plan_memory(info, 4096, available=64 * 2**30, mmproj_bytes=proj.total_bytes)
    assert with_proj.total_bytes == base.total_bytes + proj.total_bytes
    assert with_proj.to_dict()["mmproj_bytes"] == proj.total_bytes
