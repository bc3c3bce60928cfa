"""The installed copy of a profile (/etc/orin-llm/profile.yaml) names every file and
folder as the profile where it was written did: a path relative to the profile's
folder is made absolute, since the copy lives in another folder."""

from __future__ import annotations

from pathlib import Path

import yaml

from orin.install.plan import profile_copy
from orin.profile.loader import load_profile, parse_profile


def test_relative_paths_of_the_profile_are_made_absolute(tmp_path: Path) -> None:
    folder = tmp_path / "profiles"
    folder.mkdir()
    source = folder / "vision.yaml"
    source.write_text(
        "# a vision model beside its projector\n"
        "name: vision\n"
        f"model: {{path: {tmp_path}/llava.gguf, mmproj: ../mmproj-llava.gguf}}\n"
        "speculative: {draft_model: drafts/small.gguf}\n"
        "prompt_cache: {prompt_dir: prompts, directory: ~/pc}\n",
        encoding="utf-8",
    )
    copy = profile_copy(load_profile(source))
    data = yaml.safe_load(copy)
    assert data["model"] == {
        "path": f"{tmp_path}/llava.gguf",
        "mmproj": f"{folder}/../mmproj-llava.gguf",
    }
    assert data["speculative"]["draft_model"] == f"{folder}/drafts/small.gguf"
    assert data["prompt_cache"]["prompt_dir"] == f"{folder}/prompts"
    assert data["prompt_cache"]["directory"] == str(Path("~/pc").expanduser())
    installed = parse_profile(copy)
    assert installed.model.mmproj is not None and Path(installed.model.mmproj).is_absolute()


def test_a_profile_with_absolute_paths_only_is_copied_as_written(tmp_path: Path) -> None:
    source = tmp_path / "plain.yaml"
    text = f"# mine\nname: plain\nmodel: {{path: /m/a.gguf, mmproj: {tmp_path}/p.gguf}}\n"
    source.write_text(text, encoding="utf-8")
    assert profile_copy(load_profile(source)).endswith(text)
