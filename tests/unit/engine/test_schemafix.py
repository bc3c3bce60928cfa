"""Schemas and patterns rewritten for llama-cpp-python's converter: what each
rewrite gives, and what it leaves alone."""

from __future__ import annotations

from typing import Any

import pytest

from orin.engine.grammar import json_schema_grammar
from orin.engine.schemafix import NOT_IN_JSON, json_pattern, split_type_lists


@pytest.mark.parametrize(
    ("pattern", "rewritten"),
    [
        (r"^\d{3}-\d{4}$", "^[0-9]{3}-[0-9]{4}$"),
        (r"^\w+\.com$", "^[A-Za-z0-9_]+[.]com$"),
        (r"^\s\S$", f"^[ ][^ {NOT_IN_JSON}]$"),
        (r"^[\w.\-]$", r"^[A-Za-z0-9_.\x2D]$"),
        (r"^[^a]$", f"^[^a{NOT_IN_JSON}]$"),
        (r"^(?:ab)+\$$", "^(ab)+$$"),
        (r"^\(a\)\d$", r"^\(a\)[0-9]$"),  # the converter's own escapes stay
        # what JSON writes escaped is written escaped, in a class a choice
        (r'^a"\\\n$', r'^a(\\")(\\\\)(\\n)$'),
        (r'^[a"]+$', r'^([a]|(\\"))+$'),
        (r"^[ -~]$", r'^([ -!#-[\]-~]|(\\")|(\\\\))$'),
        (r"^[\S ]$", f"^([ ]|[^ {NOT_IN_JSON}])$"),
    ],
)
def test_a_pattern_becomes_the_syntax_the_converter_reads(pattern: str, rewritten: str) -> None:
    assert json_pattern(pattern) == rewritten


def test_a_list_of_types_keeps_its_keywords_wherever_a_schema_may_be() -> None:
    name = {"type": ["string", "null"], "maxLength": 5}
    split = {"anyOf": [{"maxLength": 5, "type": "string"}, {"maxLength": 5, "type": "null"}]}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"name": name, "enum": name},
        "$defs": {"n": {"type": "array", "items": name, "prefixItems": [name]}},
        "anyOf": [name],
    }
    assert split_type_lists(schema) == {
        "type": "object",
        "properties": {"name": split, "enum": split},
        "$defs": {"n": {"type": "array", "items": split, "prefixItems": [split]}},
        "anyOf": [split],
    }
    values = {"const": name, "enum": [name], "default": name}  # values, not schemas
    assert split_type_lists(values) == values


def test_a_list_of_types_leaves_the_definitions_where_a_ref_finds_them() -> None:
    """``#/$defs/A`` beside a list of types still names A: the definitions are not
    moved into each choice."""
    defs = {"A": {"type": "integer"}}
    schema = {"type": ["object", "null"], "properties": {"a": {"$ref": "#/$defs/A"}}}
    assert split_type_lists({**schema, "$defs": defs}) == {
        "$defs": defs,
        "anyOf": [{"properties": schema["properties"], "type": t} for t in ("object", "null")],
    }
    grammar = json_schema_grammar({**schema, "$defs": defs})
    assert "integer" in grammar and "null" in grammar
