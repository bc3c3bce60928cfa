"""docs/profiles-reference.md, generated from the Profile schema.

The schema is the one source of every field's type, default, bounds and
description (CLI help and ``profile show`` read it too), so the reference is
generated rather than written, and a test fails when the committed file and
the schema disagree. Regenerate with::

    python -m orin.profile.reference docs/profiles-reference.md
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from orin.profile.schema import Profile, section_of

HEADER = """\
# Profile reference

Generated from `orin/profile/schema.py` by `python -m orin.profile.reference
docs/profiles-reference.md`; do not edit by hand. Every field of a profile
YAML file, section by section, with its type, default, bounds and meaning; a
bound set by another field (`engine.n_ubatch` at most `n_batch`) is in the
description. Unknown fields are an error (the loader names the file, the line
and the closest known field). See [profiles.md](profiles.md) for how the
built-in profiles were chosen.
"""

_TYPE_NAMES = {int: "integer", float: "number", bool: "boolean", str: "string", Path: "path"}
# pydantic keeps each bound as a metadata object with one of these attributes.
_BOUNDS = (
    ("ge", "≥ {}"),
    ("gt", "> {}"),
    ("le", "≤ {}"),
    ("lt", "< {}"),
    ("min_length", "length ≥ {}"),
    ("max_length", "length ≤ {}"),
)


def profiles_reference() -> str:
    """The whole reference document."""
    parts = [HEADER, "## Top level\n", _table(_rows(Profile, ""))]
    for name, info in Profile.model_fields.items():
        section = section_of(info.annotation)
        if section is None:
            continue
        parts.append(f"## `{name}`\n\n{info.description or ''}\n")
        parts.append(_table(_rows(section, f"{name}.")))
    return "\n".join(parts)


def _rows(model: type[BaseModel], prefix: str) -> Iterator[tuple[str, ...]]:
    """One row per field; a nested optional section gets a row and rows for its fields."""
    for name, info in model.model_fields.items():
        sub = section_of(info.annotation)
        if sub is not None and not prefix:
            continue  # a top-level section has a heading of its own
        yield (
            f"`{prefix}{name}`",
            describe_type(info.annotation),
            _default(info),
            _bounds(info),
            _cell(info.description or ""),
        )
        if sub is not None:
            yield from _rows(sub, f"{prefix}{name}.")


def _table(rows: Iterator[tuple[str, ...]]) -> str:
    lines = ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def describe_type(annotation: Any) -> str:
    """A type as a reader of YAML thinks of it: 'integer or null', 'one of `a`, `b`'."""
    origin = get_origin(annotation)
    if origin is Annotated:  # a union member with bounds of its own (``_bounds``)
        return describe_type(get_args(annotation)[0])
    if origin is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in get_args(annotation))
    if origin in (Union, types.UnionType):
        args = get_args(annotation)
        named = [describe_type(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is list:
        (item,) = get_args(annotation)
        return f"list of {describe_type(item)}s"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return _TYPE_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    factory = info.default_factory
    value = factory() if factory is not None else info.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _bounds(info: FieldInfo) -> str:
    """The field's bounds, and those of a union member (``Annotated[int, Field(ge=0)] |
    Literal["fastest"]``) or, after 'each', of a list's items (``list[Annotated[int,
    Field(ge=1)]]``)."""
    members = [a for a in get_args(info.annotation) if get_origin(a) is Annotated]
    inner = [m for a in members for m in get_args(a)[1:]]
    if get_origin(info.annotation) is list:  # the member is the item type
        texts, each = _bound_texts(info.metadata), _bound_texts(inner)
        if each:
            texts.append(f"each {', '.join(each)}")
        return ", ".join(texts)
    return ", ".join(_bound_texts([*info.metadata, *inner]))


def _bound_texts(metadata: list[Any]) -> list[str]:
    found = []
    for meta in metadata:
        for inner in getattr(meta, "metadata", None) or [meta]:  # a Field() holds its own
            for attr, fmt in _BOUNDS:
                value = getattr(inner, attr, None)
                if value is not None:
                    found.append(fmt.format(value))
    return found


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    text = profiles_reference()
    if args:
        Path(args[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
