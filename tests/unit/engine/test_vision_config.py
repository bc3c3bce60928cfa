"""The profile's vision projector as the engine resolves it (model.mmproj, or the
demo one) and the profile rules around it."""

from __future__ import annotations

from pathlib import Path

import pytest

from orin.engine.config import mmproj_path
from orin.errors import ProfileError
from orin.model import mmproj
from orin.profile.loader import load_profile, parse_profile


def test_a_relative_projector_path_starts_at_the_profile(tmp_path: Path) -> None:
    (tmp_path / "vision.yaml").write_text(
        "name: v\nmodel: {path: m.gguf, mmproj: models/mmproj.gguf}\n"
    )
    profile = load_profile(tmp_path / "vision.yaml")
    assert mmproj_path(profile) == tmp_path / "models" / "mmproj.gguf"


def test_the_demo_projector_is_generated_for_the_demo_size(tmp_path: Path) -> None:
    profile = parse_profile("name: v\nmodel: {demo: {size: tiny, quant: f16}, mmproj_demo: true}\n")
    path = mmproj_path(profile)
    assert path is not None and path.name == mmproj.file_name("tiny") and path.is_file()


def test_no_projector_by_default() -> None:
    assert mmproj_path(parse_profile("name: v\n")) is None


@pytest.mark.parametrize(
    "model",
    [
        "{path: m.gguf, mmproj_demo: true}",
        "{demo: {size: tiny}, mmproj_demo: true, mmproj: p.gguf}",
    ],
)
def test_the_demo_projector_needs_a_demo_model_alone(model: str) -> None:
    with pytest.raises(ProfileError, match="mmproj_demo"):
        parse_profile(f"name: v\nmodel: {model}\n")


def test_image_limits_have_safe_defaults() -> None:
    server = parse_profile("name: v\n").server
    assert server.image_url_hosts == []
    assert server.max_image_bytes == 8 * 2**20 and server.max_image_pixels == 16_777_216
    assert server.max_request_image_pixels == 2 * server.max_image_pixels
