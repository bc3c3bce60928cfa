"""A vision projector (model.mmproj) serve could not load: missing, a FIFO, not a
projector, corrupt. Serve stops before loading the model (exit 3), profile validate
fails it, and doctor names what is wrong with it; serve used to load the model, start
the HTTP server and then exit 1, or wait forever on a FIFO."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from orin.doctor import checks
from orin.errors import ModelFileError
from orin.model import mmproj
from orin.profile.loader import load_profile
from orin.system.root import SysRoot
from tests.fakes.runner import FakeRunner
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.unit.doctor.conftest import MakeCtx

KINDS = ["missing", "fifo", "language model", "truncated"]


def projector(tmp_path: Path, kind: str) -> Path:
    path = tmp_path / "proj.gguf"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "language model":
        write_gguf(path, params=LLAMA2_7B)
    elif kind == "truncated":
        path.write_bytes(mmproj.ensure("tiny").read_bytes()[:200])
    return path


def profile_file(tmp_path: Path) -> Path:
    write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    path = tmp_path / "p.yaml"
    path.write_text("name: t\nmodel: {path: m.gguf, mmproj: proj.gguf}\n")
    return path


@pytest.mark.parametrize("kind", KINDS)
def test_serve_stops_before_loading(tmp_path: Path, kind: str) -> None:
    from orin.server.main import build_server

    proj = projector(tmp_path, kind)
    with pytest.raises(ModelFileError, match=f"^model.mmproj: {proj}"):
        build_server(load_profile(profile_file(tmp_path)), None)


@pytest.mark.parametrize("kind", KINDS)
def test_validate_fails_it(tmp_path: Path, kind: str) -> None:
    proj = projector(tmp_path, kind)
    result = CliRunner().invoke(app, ["profile", "validate", str(profile_file(tmp_path)), "--json"])
    failed = [x for x in json.loads(result.stdout)["findings"] if x["severity"] == "fail"]
    assert result.exit_code == 1 and [x["rule"] for x in failed] == ["mmproj"]
    assert failed[0]["message"].startswith(f"model.mmproj: {proj}")
    assert failed[0]["message"].endswith(": serve would stop (exit 3)")


def test_validate_passes_a_readable_projector(tmp_path: Path) -> None:
    projector(tmp_path, "none").write_bytes(mmproj.ensure("tiny").read_bytes())
    result = CliRunner().invoke(app, ["profile", "validate", str(profile_file(tmp_path)), "--json"])
    assert "mmproj" not in {x["rule"] for x in json.loads(result.stdout)["findings"]}


def test_doctor_says_a_fifo_is_not_a_regular_file(make_ctx: MakeCtx, tmp_path: Path) -> None:
    """It said the FIFO did not exist."""
    proj = projector(tmp_path, "fifo")
    profile = load_profile(profile_file(tmp_path))
    f = checks.check_mmproj(make_ctx(SysRoot(tmp_path / "root"), FakeRunner(), profile))
    assert f.severity == "fail" and f.found == f"model.mmproj: {proj}: not a regular file " + (
        "(a folder, FIFO, socket or device)"
    )
