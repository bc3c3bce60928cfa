"""docs/profiles-reference.md is generated from the schema and stays true to it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from orin.profile.reference import describe_type, profiles_reference
from orin.profile.schema import Profile

DOCS = Path(__file__).resolve().parents[3] / "docs"


def test_profiles_reference_matches_the_schema() -> None:
    committed = (DOCS / "profiles-reference.md").read_text(encoding="utf-8")
    assert committed == profiles_reference(), (
        "docs/profiles-reference.md is stale: python -m orin.profile.reference "
        "docs/profiles-reference.md"
    )


def test_profiles_reference_lists_every_field() -> None:
    text = profiles_reference()
    for section, info in Profile.model_fields.items():
        sub = getattr(info.annotation, "model_fields", None)
        for name in sub or {section: None}:
            field = f"`{section}.{name}`" if sub else f"`{section}`"
            assert field in text, field
    assert "| `engine.n_ctx` | integer | `4096` | ≥ 256, ≤ 1048576 |" in text


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [(int | None, "integer or null"), (list[int], "list of integers"), (bool, "boolean")],
)
def test_type_names(annotation: Any, expected: str) -> None:
    assert describe_type(annotation) == expected
