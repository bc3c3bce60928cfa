"""Grammars for structured output: any JSON value, JSON that follows a schema, or
tool calls whose arguments follow their functions' schemas.

The grammars are GBNF text, built by llama-cpp-python's converter; the engine
parses them against the model's vocabulary when it builds a request's sampler
(a grammar that does not parse is an ``InvalidRequest`` there). This module is
where the server gets them, so that nothing above the engine imports llama_cpp.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from orin.engine.errors import InvalidRequest
from orin.llamacpp import llama


def _converter() -> ModuleType:
    llama()  # llama_cpp imported once, with its log routed (LlamaCppError when missing)
    from llama_cpp import llama_grammar

    return llama_grammar


def json_grammar() -> str:
    """Any JSON value (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return str(_converter().JSON_GBNF)


def json_schema_grammar(schema: dict[str, Any], param: str = "response_format") -> str:
    """JSON that follows ``schema``; InvalidRequest naming ``param`` when the
    converter cannot turn it into a grammar."""
    if not schema:
        raise InvalidRequest(param, "a json_schema needs a schema")
    try:
        return str(_converter().json_schema_to_gbnf(json.dumps(schema)))
    except Exception as exc:  # the converter raises plain exceptions on bad schemas
        raise InvalidRequest(param, f"cannot turn the schema into a grammar: {exc}") from exc


@dataclass(frozen=True)
class CallSyntax:
    """How a tool-call format writes its calls, as the literals around them.

    A call is a JSON object ``{"name": "f", "<args_key>": {…}}``, or, with
    ``name_args`` set, the bare name, that marker and the arguments object
    (Mistral's ``name[ARGS]{…}``).
    """

    prefix: str = ""  # once before the calls: "[TOOL_CALLS]["
    suffix: str = ""  # once after them: "]"
    call_open: str = ""  # before each call: "<tool_call>\n"
    call_close: str = ""  # after each call: "\n</tool_call>"
    separator: str = ""  # between two calls
    args_key: str = "arguments"  # "parameters" for Llama 3.x
    name_args: str | None = None  # "[ARGS]"


@dataclass(frozen=True)
class Reasoning:
    """A reasoning block the output may start with: ``open`` when the prompt
    already opened it (the output starts inside it), else it is optional."""

    start: str
    end: str
    open: bool = False


def tool_call_grammar(
    functions: Sequence[tuple[str, dict[str, Any] | None]],
    syntax: CallSyntax,
    parallel: bool,
    reasoning: Reasoning | None = None,
    params: Sequence[str] | None = None,
) -> str:
    """A grammar for one call (or one or more with ``parallel``) of one of
    ``functions`` (name, JSON schema of its parameters), written in ``syntax``:
    the arguments follow each function's schema as far as llama-cpp-python's
    converter expresses it. InvalidRequest when a schema cannot be converted,
    naming that function's entry of ``params`` (the request's field, such as
    ``tools[2].function.parameters``), or ``tools`` without them."""
    mod = _converter()
    conv = mod.SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    lit = conv._format_literal
    alternatives = []
    for i, (name, parameters) in enumerate(functions):
        schema = copy.deepcopy(parameters) if parameters else {"type": "object"}
        try:
            schema = conv.resolve_refs(schema, f"tool{i}")
            args = conv.visit(schema, f"{name}-args")
        except Exception as exc:  # the converter raises plain exceptions on bad schemas
            raise InvalidRequest(
                params[i] if params is not None else "tools",
                f"cannot turn the parameters of {name!r} into a grammar: {exc}",
            ) from exc
        if syntax.name_args is not None:
            body = f"{lit(name)} {lit(syntax.name_args)} {args}"
        else:
            head = '{"name": ' + json.dumps(name) + ', "' + syntax.args_key + '": '
            body = f'{lit(head)} {args} "}}"'
        call = " ".join(p for p in (_opt_lit(lit, syntax.call_open), body) if p)
        close = _opt_lit(lit, syntax.call_close)
        alternatives.append(conv._add_rule(f"call-{i}", f"{call} {close}".strip()))
    conv._add_rule("tool-call", " | ".join(alternatives))
    calls = "tool-call"
    if parallel:
        sep = _opt_lit(lit, syntax.separator)
        calls = f"tool-call ({sep} tool-call)*" if sep else "tool-call+"
    root = " ".join(
        p for p in (_opt_lit(lit, syntax.prefix), calls, _opt_lit(lit, syntax.suffix)) if p
    )
    if reasoning is not None:
        conv._add_rule("reasoning-body", _until(lit, reasoning.end))
        block = f"reasoning-body {lit(reasoning.end)} [ \\n]? [ \\n]?"
        root = f"{block} {root}" if reasoning.open else f"({lit(reasoning.start)} {block})? {root}"
    conv._add_rule("root", root)
    return str(conv.format_grammar())


def _opt_lit(lit: Any, text: str) -> str:
    return str(lit(text)) if text else ""


def _until(lit: Any, end: str) -> str:
    """Any text that does not contain ``end`` (nor end with a part of it)."""
    items = [f"[^{_class_char(end[0])}]"]
    for k in range(1, len(end)):
        items.append(f"{lit(end[:k])} [^{_class_char(end[k])}]")
    return "(" + " | ".join(items) + ")*"


def _class_char(c: str) -> str:
    return "\\" + c if c in "\\]^-[" else c
