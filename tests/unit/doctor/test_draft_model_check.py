"""doctor's draft-model check, profile validate's draft-model rule and serve's own check
before loading: a draft model that cannot be read stops serve at start (exit 3), so
the two commands that check a profile before it runs say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from orin.doctor import checks
from orin.doctor.findings import Finding
from orin.errors import ModelFileError
from orin.profile.loader import load_profile
from orin.system.root import SysRoot
from tests.fakes.runner import FakeRunner
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.unit.doctor.conftest import MakeCtx

DEMO = "model: {demo: {size: tiny, quant: f16}}\n"


def profile_file(tmp_path: Path, speculative: str) -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(f"name: t\n{DEMO}speculative: {speculative}\n")
    return path


def check(make_ctx: MakeCtx, tmp_path: Path, speculative: str) -> Finding:
    profile = load_profile(profile_file(tmp_path, speculative))
    return checks.check_draft_model(make_ctx(SysRoot(tmp_path / "root"), FakeRunner(), profile))


def test_no_draft_model_is_ok(make_ctx: MakeCtx, tmp_path: Path) -> None:
    f = check(make_ctx, tmp_path, "{mode: ngram}")
    assert f.severity == "ok" and f.found == "no draft model: speculative.mode is ngram"


@pytest.mark.parametrize("content", [None, b"", b"not a gguf file at all"])
def test_a_draft_model_serve_could_not_read_fails(
    make_ctx: MakeCtx, tmp_path: Path, content: bytes | None
) -> None:
    if content is not None:
        (tmp_path / "draft.gguf").write_bytes(content)
    f = check(make_ctx, tmp_path, "{mode: draft, draft_model: draft.gguf}")
    assert f.severity == "fail"
    assert f.found.startswith(f"speculative.draft_model: {tmp_path / 'draft.gguf'}: ")
    assert f.fix is not None and "speculative.mode: ngram" in f.fix


def test_a_readable_draft_model_is_ok(make_ctx: MakeCtx, tmp_path: Path) -> None:
    write_gguf(tmp_path / "draft.gguf", params=LLAMA2_7B, file_type=15)
    f = check(make_ctx, tmp_path, "{mode: draft, draft_model: draft.gguf}")
    assert f.severity == "ok" and f.found == f"draft model {tmp_path / 'draft.gguf'}"


def test_validate_fails_a_missing_draft_model(tmp_path: Path) -> None:
    path = profile_file(tmp_path, "{mode: draft, draft_model: draft.gguf}")
    result = CliRunner().invoke(app, ["profile", "validate", str(path), "--json"])
    data = json.loads(result.stdout)
    failed = [x for x in data["findings"] if x["severity"] == "fail"]
    assert result.exit_code == 1 and data["valid"] is False
    assert failed == [
        {
            "rule": "draft-model",
            "severity": "fail",
            "message": f"speculative.draft_model: {tmp_path / 'draft.gguf'}: no such file: "
            "serve would stop (exit 3)",
        }
    ]
    write_gguf(tmp_path / "draft.gguf", params=LLAMA2_7B, file_type=15)
    result = CliRunner().invoke(app, ["profile", "validate", str(path), "--json"])
    assert result.exit_code == 0, result.stdout


def test_serve_stops_before_loading_with_the_model_file_error(tmp_path: Path) -> None:
    """build_server reads both headers before anything loads: a ModelFileError, exit 3,
    not a load that fails after the port was announced (exit 1)."""
    from orin.server.main import build_server

    write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: t\nmodel: {path: m.gguf}\nspeculative: {mode: draft, draft_model: d.gguf}\n"
    )
    with pytest.raises(ModelFileError, match=r"^speculative.draft_model: .*d.gguf: no such file$"):
        build_server(load_profile(path), None)


def test_a_draft_model_with_another_vocabulary_fails_before_anything_loads(
    make_ctx: MakeCtx, tmp_path: Path
) -> None:
    """Its drafts would be ids of other tokens: serve refuses it from the headers (exit
    3) before minutes of loading the served model, and doctor and profile validate name
    the file and the field that differs."""
    import gguf

    from orin.server.main import build_server

    def write(path: Path, kind: str) -> None:
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_file_type(15)
        for key, value in LLAMA2_7B.items():
            if isinstance(value, float):
                w.add_float32(f"llama.{key}", value)
            else:
                w.add_uint32(f"llama.{key}", value)
        w.add_tokenizer_model(kind)
        w.add_token_list([f"t{i}" for i in range(300)])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()

    write(tmp_path / "m.gguf", "gpt2")
    write(tmp_path / "draft.gguf", "llama")
    path = tmp_path / "p.yaml"
    path.write_text(
        "name: t\nmodel: {path: m.gguf}\nspeculative: {mode: draft, draft_model: draft.gguf}\n"
    )
    expected = (
        f"speculative.draft_model: {tmp_path / 'draft.gguf'}: tokenizer.ggml.model is "
        "'llama', the served model's 'gpt2'; a draft model must share the served model's "
        "vocabulary"
    )
    with pytest.raises(ModelFileError) as err:
        build_server(load_profile(path), None)
    assert str(err.value) == expected
    profile = load_profile(path)
    ctx = make_ctx(SysRoot(tmp_path / "root"), FakeRunner(), profile)
    ctx.model_path = tmp_path / "m.gguf"
    f = checks.check_draft_model(ctx)
    assert (f.severity, f.found) == ("fail", expected)
    result = CliRunner().invoke(app, ["profile", "validate", str(path), "--json"])
    failed = [
        x["message"] for x in json.loads(result.stdout)["findings"] if x["rule"] == "draft-model"
    ]
    assert result.exit_code == 1 and failed == [f"{expected}: serve would stop (exit 3)"]
    write(tmp_path / "draft.gguf", "gpt2")  # the same vocabulary
    assert checks.check_draft_model(ctx).severity == "ok"
