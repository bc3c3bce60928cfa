"""JSON schemas and patterns rewritten into what llama-cpp-python's schema converter
turns into a correct grammar (orin/engine/grammar.py applies them).

The converter lets a string hold raw control characters, copies a pattern's
escapes (``\\d``, ``\\.``) into the grammar where llama.cpp refuses them and a
pattern's quotes, backslashes and control characters into the JSON text
unescaped, and drops the keywords beside a list of types, where llama.cpp's
own converter does not. The rewrites here close those gaps in front of the converter that
llama-cpp-python ships, as plain functions of dicts and strings.
"""

from __future__ import annotations

from typing import Any

JSON_CHAR = (
    r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] '
    r"[0-9a-fA-F])"
)
"""A character of a JSON string, in GBNF: any but '"', '\\' and the control
characters, or one of JSON's escapes."""

NOT_IN_JSON = r'"\\\x00-\x1F\x7F'
"""What a character class of a JSON string's raw text leaves out, in GBNF: '"',
'\\' and the control characters (which the string may hold only escaped)."""

# a pattern's class escapes, as the ranges they mean (\s: a space, the only blank
# a JSON string holds unescaped)
_CLASS_ESCAPES = {"d": "0-9", "w": "A-Za-z0-9_", "s": " "}
_ESCAPES = {
    **{k: f"[{v}]" for k, v in _CLASS_ESCAPES.items()},
    **{k.upper(): f"[^{v}{NOT_IN_JSON}]" for k, v in _CLASS_ESCAPES.items()},
}
_IN_CLASS = {"-": r"\x2D", "^": r"\x5E"}  # what GBNF takes for the escapes it does not know


def json_pattern(pattern: str) -> str:
    """``pattern`` in the part of regex syntax the converter reads. It copies
    ``\\d``, ``\\w``, ``\\s`` and an escaped ``.``, ``-`` or ``/`` into the grammar
    as they are, which llama.cpp refuses ("unknown escape"); its negated classes
    would take a '"' that ends the JSON string; and it writes a '"', a backslash or
    a control character of the pattern raw, where JSON writes it escaped: each
    becomes a class, a character or a choice that means the same in the JSON text.
    A non-capturing group ``(?:…)``, which the converter refuses, is a plain group."""
    out: list[str] = []
    negated: bool | None = None  # in a class: whether it is negated; outside: None
    start = 0  # where the class began in ``out``
    alts: list[str] = []  # what a class holds that no class of the JSON text can
    i = 0
    while i < len(pattern):
        c, escaped = pattern[i], pattern[i + 1 : i + 2]
        i += 2 if c == "\\" and escaped else 1
        char = _LITERAL_ESCAPES.get(escaped) if c == "\\" else c
        if negated is not True and char is not None and _escaped_in_json(char):
            (alts if negated is False else out).append(_json_escape(char))
        elif negated is False and c == "\\" and escaped in _NEGATED:
            alts.append(_ESCAPES[escaped])
        elif c == "\\" and escaped:
            out.append(_escape(escaped, negated is not None))
        elif negated is None and c == "(" and pattern.startswith("?:", i):
            i += 2  # a non-capturing group is a group to a grammar
            out.append(c)
        elif negated is None and c == "[":
            negated, start, alts = pattern[i : i + 1] == "^", len(out), []
            out.append(c)
        elif negated is False and pattern[i : i + 1] == "-" and pattern[i + 1 : i + 2] not in "]\\":
            out.append(_range(c, pattern[i + 1], alts))
            i += 2
        elif negated is not None and c == "]":
            out.append(NOT_IN_JSON + c if negated else c)
            if alts:  # [a"] is a choice: [a] or the escaped '"'
                body = "".join(out[start + 1 : -1])
                out[start:] = ["(" + "|".join([f"[{body}]"] * bool(body) + alts) + ")"]
            negated = None
        else:
            out.append(c)
    return "".join(out)


# a pattern's escapes of one character that a JSON string holds only escaped
_LITERAL_ESCAPES = {'"': '"', "\\": "\\", "n": "\n", "t": "\t", "r": "\r", "f": "\f"}
_NEGATED = frozenset(k.upper() for k in _CLASS_ESCAPES)
_JSON_SHORT = {'"': '"', "\\": "\\\\", "\n": "n", "\t": "t", "\r": "r", "\f": "f", "\b": "b"}


def _escaped_in_json(c: str) -> bool:
    return c in '"\\' or c < " " or c == "\x7f"


def _json_escape(c: str) -> str:
    """The pattern the converter turns into ``c`` as a JSON string writes it
    (``\\"``, ``\\n``, ``\\u001b``), a group for the quantifier after it."""
    return "(\\\\" + _JSON_SHORT.get(c, f"u{ord(c):04x}") + ")"


def _range(lo: str, hi: str, alts: list[str]) -> str:
    """The range ``lo-hi`` of a class without what a JSON string holds only escaped,
    each of those added to ``alts`` in its escaped form."""
    parts: list[str] = []
    first = ord(lo)
    for code in range(ord(lo), ord(hi) + 1) if ord(hi) < 0x80 else range(ord(lo), 0x80):
        if _escaped_in_json(chr(code)):
            alts.append(_json_escape(chr(code)))
            if first < code:
                parts.append(_span(first, code - 1))
            first = code + 1
    if first <= ord(hi):
        parts.append(_span(first, ord(hi)))
    return "".join(parts)


def _span(lo: int, hi: int) -> str:
    ends = [_IN_CLASS.get(chr(c), "\\]" if chr(c) == "]" else chr(c)) for c in (lo, hi)]
    return ends[0] if lo == hi else f"{ends[0]}-{ends[1]}"


def _escape(c: str, in_class: bool) -> str:
    """The escape ``\\c`` of a pattern as the converter reads it, in a class or
    outside one."""
    if in_class and c in _CLASS_ESCAPES:
        return _CLASS_ESCAPES[c]
    if not in_class and c in _ESCAPES:
        return _ESCAPES[c]
    if c.isalnum() or c in '\\"[]' or (not in_class and c in "(){}|*+?"):
        return "\\" + c  # the converter's own, or GBNF's (\n, \t, \\)
    if in_class:
        return _IN_CLASS.get(c, c)
    return "[.]" if c == "." else c


# the keywords whose values are schemas: one, a list of them, or a map of names to them
_SUBSCHEMA = frozenset(
    {"items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames"}
)
_SUBSCHEMA_LISTS = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "items"})
_SUBSCHEMA_MAPS = frozenset(
    {"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"}
)
_DEFINITIONS = frozenset({"$defs", "definitions"})


def split_type_lists(schema: Any) -> Any:
    """``schema`` with each list of types written as a choice of one type each, the
    keywords beside the list kept in every choice: the converter turns a list into
    the bare types, so ``{"type": ["string", "null"], "maxLength": 5}`` lost its
    ``maxLength`` (and an object or null its properties)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {name: split_type_lists(v) for name, v in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [split_type_lists(v) for v in value]
        elif key in _SUBSCHEMA:
            value = split_type_lists(value)
        out[key] = value
    kinds = out.get("type")
    if isinstance(kinds, list) and not {"$ref", "oneOf", "anyOf"} & out.keys():
        # the definitions stay where a $ref's path ("#/$defs/A") finds them
        defs = {k: v for k, v in out.items() if k in _DEFINITIONS}
        rest = {k: v for k, v in out.items() if k != "type" and k not in _DEFINITIONS}
        return {**defs, "anyOf": [{**rest, "type": t} for t in kinds]}
    return out
