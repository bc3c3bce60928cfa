"""PATH_FIELDS: the profile fields that name a file or a folder, one list that
install (its copy of the profile in /etc/orin-llm) and deploy k8s (the profile in
the pods) both read, so that a new path field is carried by each."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from orin.deploy import k8s
from orin.install.plan import profile_copy
from orin.profile.loader import load_profile
from orin.profile.schema import PATH_FIELDS, Profile


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types of a union (``X | None``), or the type itself."""
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every field of the profile tree, sections and the models inside them, by dotted
    name."""
    for key, info in model.model_fields.items():
        name = f"{prefix}{key}"
        yield name, info
        for member in _members(info.annotation):
            if isinstance(member, type) and issubclass(member, BaseModel):
                yield from _fields(member, f"{name}.")


def _names_a_path(info: FieldInfo) -> bool:
    """Typed as a path, or a string its description says is a (relative) path."""
    typed = any(isinstance(m, type) and issubclass(m, Path) for m in _members(info.annotation))
    return typed or "relative path" in (info.description or "").lower()


def test_every_field_that_names_a_path_is_in_path_fields() -> None:
    found = {name for name, info in _fields(Profile) if _names_a_path(info)}
    assert found == {f.name for f in PATH_FIELDS}
    assert found >= {
        "model.path",
        "model.mmproj",
        "speculative.draft_model",
        "prompt_cache.prompt_dir",
        "prompt_cache.directory",
    }


@pytest.mark.parametrize("named", PATH_FIELDS, ids=lambda f: f.name)
def test_install_and_deploy_carry_every_path_field(named: Any, tmp_path: Path) -> None:
    """Each path field, relative to the profile's folder: install's copy names it
    absolutely; the profile the pods get no longer names this machine's path (a
    file moves into the models folder, a folder is read into the ConfigMap or
    dropped), with a note saying so."""
    folder = tmp_path / "profiles"
    (folder / "here").mkdir(parents=True)
    (folder / "here" / "a.txt").write_text("Be brief.", encoding="utf-8")  # a prompt folder
    data: dict[str, Any] = {"name": "paths", "model": {"path": "/srv/models/m.gguf"}}
    data.setdefault(named.section, {})[named.key] = "here"
    source = folder / "paths.yaml"
    source.write_text(yaml.safe_dump(data), encoding="utf-8")
    profile = load_profile(source)

    installed = yaml.safe_load(profile_copy(profile))
    assert installed[named.section][named.key] == str(folder / "here")

    text, notes = k8s.container_profile(profile)
    in_pods = yaml.safe_load(text).get(named.section, {}).get(named.key)
    assert in_pods != "here" and str(folder) not in str(in_pods)
    assert any(note.startswith(f"{named.name}: ") for note in notes), notes
