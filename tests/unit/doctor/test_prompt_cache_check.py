"""doctor's prompt-cache check: a missing folder of prompts fails it (serve would stop),
and so does a prompt file that is not UTF-8 text; a file doctor cannot open is counted
without being judged, and an unwritable place for the saved states is a warning."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orin.doctor import checks
from orin.doctor.findings import Finding
from orin.profile.loader import load_profile
from orin.system.root import SysRoot
from tests.fakes.runner import FakeRunner
from tests.unit.doctor.conftest import MakeCtx


def check(make_ctx: MakeCtx, tmp_path: Path, section: str) -> Finding:
    path = tmp_path / "p.yaml"
    path.write_text(f"name: t\nmodel: {{demo: {{size: tiny, quant: f16}}}}\n{section}")
    ctx = make_ctx(SysRoot(tmp_path / "root"), FakeRunner(), load_profile(path))
    return checks.check_prompt_cache(ctx)


def test_no_prompts_is_ok(make_ctx: MakeCtx, tmp_path: Path) -> None:
    f = check(make_ctx, tmp_path, "")
    assert f.severity == "ok" and "off" in f.found


def test_a_missing_prompt_dir_fails_naming_the_profile(make_ctx: MakeCtx, tmp_path: Path) -> None:
    f = check(make_ctx, tmp_path, "prompt_cache: {prompt_dir: prompts}\n")
    assert f.severity == "fail"
    assert f.found == (
        f"{tmp_path / 'p.yaml'}: prompt_cache.prompt_dir: {tmp_path / 'prompts'} is not a directory"
    )
    assert f.fix is not None and "*.txt" in f.fix


def test_prompts_are_counted_where_they_are_saved(make_ctx: MakeCtx, tmp_path: Path) -> None:
    (tmp_path / "prompts").mkdir()
    for name in ("a.txt", "b.txt", "notes.md"):
        (tmp_path / "prompts" / name).write_text("You are a robot.")
    (tmp_path / "prompts" / "b.txt").chmod(0)  # counted, not judged (unless doctor is root)
    section = "prompt_cache: {prompt_dir: prompts, prompts: [hi], directory: states/here}\n"
    f = check(make_ctx, tmp_path, section)
    assert f.severity == "ok", f
    assert f.found == f"3 prompts to keep, saved in {tmp_path / 'states' / 'here'}"


def test_states_under_a_file_warn(make_ctx: MakeCtx, tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    section = f"prompt_cache: {{prompts: [hi], directory: {tmp_path}/a-file/states}}\n"
    f = check(make_ctx, tmp_path, section)
    assert f.severity == "warn"
    assert f"{tmp_path / 'a-file'} is not a folder writable here" in f.found


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_an_unwritable_place_for_the_states_warns(make_ctx: MakeCtx, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    f = check(make_ctx, tmp_path, f"prompt_cache: {{prompts: [hi], directory: {locked}/x}}\n")
    assert f.severity == "warn" and f"{locked} is not a folder writable here" in f.found


def test_a_prompt_file_that_is_not_utf8_fails_naming_it(make_ctx: MakeCtx, tmp_path: Path) -> None:
    """serve stops on it (exit 4): doctor says so before, with the file and the offset."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "a.txt").write_text("You are a robot.")
    (tmp_path / "prompts" / "b.txt").write_bytes(b"\xff\xfeY\x00o\x00u\x00")  # UTF-16
    f = check(make_ctx, tmp_path, "prompt_cache: {prompt_dir: prompts}\n")
    assert f.severity == "fail"
    assert f.found == (
        f"{tmp_path / 'p.yaml'}: prompt_cache.prompt_dir: cannot read "
        f"{tmp_path / 'prompts' / 'b.txt'}: not UTF-8 text: byte 0xff at offset 0 (line 1): "
        "invalid start byte (save the file as UTF-8)"
    )
    assert f.fix is not None and "UTF-8" in f.fix
