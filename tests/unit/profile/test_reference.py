"""docs/profiles-reference.md is generated from the schema and stays true to it, and
docs/profiles.md's table of sections names every field."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from orin.errors import ProfileError
from orin.profile.loader import parse_profile
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
    assert "| `slo.concurrency` | list of integers | `[1]` | length ≥ 1, each ≥ 1, ≤ 64 |" in text


def sections_table() -> dict[str, str]:
    """docs/profiles.md's "Sections" table: each section's row, the top level's too."""
    text = (DOCS / "profiles.md").read_text(encoding="utf-8")
    table = text.split("## Sections", 1)[1].split("\n\n", 2)[1]
    rows = re.findall(r"^\| (`\w+`|top level) \| (.+) \|$", table, flags=re.MULTILINE)
    return {name.strip("`"): what for name, what in rows}


def test_the_sections_table_names_every_field() -> None:
    """A reader of profiles.md learns of every field, not only of most of them."""
    rows = sections_table()
    missing = []
    for section, info in Profile.model_fields.items():
        sub = getattr(info.annotation, "model_fields", None)
        row, names = (rows.get(section, ""), sub) if sub else (rows.get("top level", ""), [section])
        missing += [f"{section}.{n}" if sub else n for n in names if not re.search(rf"`{n}\b", row)]
    assert not missing, f"docs/profiles.md's sections table does not name {missing}"
    assert set(rows) == {"top level"} | {
        s for s, info in Profile.model_fields.items() if hasattr(info.annotation, "model_fields")
    }


@pytest.mark.parametrize(
    ("yaml", "field", "bound"),
    [
        ("engine: {n_batch: 512, n_ubatch: 1024}", "engine.n_ubatch", "at most n_batch"),
        ("engine: {slots: 64, n_batch: 32, n_ubatch: 32}", "engine.n_batch", "least engine.slots"),
        ("engine: {n_ctx: 512}\ncontext: {window: 1024}", "context.window", "at most engine.n_ctx"),
        ("context: {window: 256, keep: 256}", "context.keep", "below the window"),
        ("speculative: {ngram_min: 5, ngram_max: 4}", "speculative.ngram_min", "at most ngram_max"),
    ],
)  # fmt: skip
def test_a_rule_between_fields_is_in_the_reference(yaml: str, field: str, bound: str) -> None:
    """The loader refuses a value another field bounds; the reference says so in that
    field's row, where its own bounds cannot."""
    with pytest.raises(ProfileError, match=field.split(".")[1]):
        parse_profile(f"name: x\n{yaml}\n", "p.yaml")
    row = next(
        line for line in profiles_reference().splitlines() if line.startswith(f"| `{field}`")
    )
    assert bound in row, row


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [(int | None, "integer or null"), (list[int], "list of integers"), (bool, "boolean")],
)
def test_type_names(annotation: Any, expected: str) -> None:
    assert describe_type(annotation) == expected
