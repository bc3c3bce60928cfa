"""Grammars for structured output: any JSON value, JSON that follows a schema, or
tool calls whose arguments follow their functions' schemas.

The grammars are GBNF text, built by llama-cpp-python's converter; the engine
parses them against the model's vocabulary when it builds a request's sampler
(a grammar that does not parse is an ``InvalidRequest`` there). This module is
where the server gets them, so that nothing above the engine imports llama_cpp.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from orin.engine import schemafix
from orin.engine.errors import InvalidRequest
from orin.llamacpp import llama

MAX_NESTING = 2048
"""Groups nested in one another in a grammar, at most. llama.cpp's parser recurses
once per group on the calling thread's stack, and a process whose stack overflows
dies with every request it serves (measured with llama-cpp-python 0.3.36 on
x86-64: 4,000 groups overflow a 1 MiB stack, some 15,000 the 8 MiB of a default
thread; a JSON schema's ``maxLength: 20000`` nests 20,000)."""

MAX_CHAIN = 8192
"""Rules a chain of rule references may pass through, at most, a group counting as
a rule as llama.cpp makes it one. llama.cpp follows such chains recursively when it
checks a grammar for left recursion and when it advances the grammar's stacks
(measured: a chain of 100,000 rules, 1.6 MB of text, overflows an 8 MiB stack)."""

MAX_SCHEMA_GRAMMAR = 1 << 20
"""Characters of grammar that the repetitions (``minLength``, ``maxLength``,
``minItems``, ``maxItems``, a pattern's ``{m,n}``) of one JSON schema, or of all the
tools of one request, may write in all.
llama-cpp-python's converter writes a repetition out item by item, so a schema of a
few bytes (``"maxLength": 1000000000``) would take gigabytes of memory before
llama.cpp saw the grammar; 1 MiB leaves a flat ``minLength`` of 100,000 characters."""

_budget = threading.local()  # characters the conversion running on this thread may write


def _converter() -> ModuleType:
    llama()  # llama_cpp imported once, with its log routed (LlamaCppError when missing)
    from llama_cpp import llama_grammar

    if not getattr(llama_grammar, "_orin_bounded", False):
        llama_grammar._build_repetition = _bounded(llama_grammar._build_repetition)
        # the converter's character of a string takes any but '"' and '\', so a
        # schema's string could hold a raw newline or tab, which no JSON parser
        # takes; llama.cpp's own converter (and the module's JSON_GBNF) leave out the
        # control characters JSON refuses unescaped
        llama_grammar.PRIMITIVE_RULES["char"] = llama_grammar.BuiltinRule(schemafix.JSON_CHAR, [])
        llama_grammar.DOT = f"[^{schemafix.NOT_IN_JSON}]"  # a pattern's "." likewise
        llama_grammar._orin_bounded = True  # type: ignore[attr-defined]
    return llama_grammar


def _bounded(build: Callable[..., str]) -> Callable[..., str]:
    """The converter's repetition builder, charging what it would write to the
    budget of the conversion running on this thread (``_schema_budget``): a
    ValueError, which the callers turn into a 400, before it writes past it."""

    def repetition(
        item_rule: str, min_items: int, max_items: int | None, *args: Any, **kwargs: Any
    ) -> str:
        left = getattr(_budget, "left", None)
        if left is not None:
            items = max(min_items, max_items or 0)
            if items * (len(item_rule) + 4) > left:
                raise ValueError(
                    f"a repetition of {items} items (minLength, maxLength, minItems, "
                    "maxItems or a pattern's {m,n}) makes the grammar longer than the "
                    f"{MAX_SCHEMA_GRAMMAR} characters a schema may take here"
                )
        out = build(item_rule, min_items, max_items, *args, **kwargs)
        if left is not None:
            _budget.left = left - len(out)
        return out

    return repetition


@functools.cache
def _schema_converter() -> Any:
    """llama-cpp-python's SchemaConverter with three of its gaps closed, as
    llama.cpp's own converter closes them: a root $ref's $defs, the keywords beside
    a list of types, and a pattern's escapes."""
    base: Any = _converter().SchemaConverter

    class Converter(base):
        def resolve_refs(self, schema: Any, url: str) -> Any:
            schema = schemafix.split_type_lists(schema)
            # the converter looks no further into an object once it finds a $ref
            # there, so the $defs beside a root $ref (pydantic's schema of a
            # recursive model) kept references it could not follow
            if isinstance(schema, dict) and "$ref" in schema:
                super().resolve_refs({k: v for k, v in schema.items() if k != "$ref"}, url)
            return super().resolve_refs(schema, url)

        def _visit_pattern(self, pattern: str, name: str) -> str:
            return str(super()._visit_pattern(schemafix.json_pattern(pattern), name))

    return Converter


def _new_converter() -> Any:
    return _schema_converter()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)


@contextmanager
def _schema_budget() -> Iterator[None]:
    _budget.left = MAX_SCHEMA_GRAMMAR
    try:
        yield
    finally:
        _budget.left = None


# the parts of GBNF text that matter to its depth; anything else is skipped
_GBNF_TOKEN = re.compile(
    r"""\#[^\r\n]*"""  # a comment
    r"""|"(?:\\.|[^"\\])*"?"""  # a literal (an unterminated one runs to the end)
    r"""|\[(?:\\.|[^\]\\])*\]?"""  # a character class
    r"""|<[^>\s]*>"""  # a token
    r"""|\{[^}]*\}"""  # a repetition count
    r"""|::="""
    r"""|[A-Za-z0-9_-]+"""  # a rule's name
    r"""|[()]""",
    re.DOTALL,
)


def depth_problem(gbnf: str) -> str | None:
    """Why llama.cpp cannot be given ``gbnf`` without risking its stack: groups
    nested deeper than ``MAX_NESTING``, or a chain of rule references that may pass
    through more than ``MAX_CHAIN`` rules; None when neither. The chain is bounded
    from above: each rule counts as one plus the depth of its groups, and rules that
    refer to one another in a cycle count all together."""
    names: list[str] = []  # rules in order of definition
    cost: dict[str, int] = {}  # 1 + the deepest group of each rule
    refs: dict[str, set[str]] = {}
    tokens = [t for t in _GBNF_TOKEN.findall(gbnf) if t[0] != "#"]
    rule, depth, deepest = "", 0, 0
    for i, tok in enumerate(tokens):
        if tok == "(":
            depth += 1
            deepest = max(deepest, depth)
            if rule:
                cost[rule] = max(cost[rule], depth + 1)
        elif tok == ")":
            depth = max(depth - 1, 0)
        elif tok[0].isalnum() or tok[0] in "_-":
            if i + 1 < len(tokens) and tokens[i + 1] == "::=":
                rule = tok
                if rule not in cost:
                    names.append(rule)
                    cost[rule], refs[rule] = 1, set()
            elif rule:
                refs[rule].add(tok)
    if deepest > MAX_NESTING:
        return f"nests groups {deepest} deep; at most {MAX_NESTING} are taken here"
    longest = _longest_chain(names, cost, refs)
    if longest > MAX_CHAIN:
        return (
            f"has chains of rule references through up to {longest} rules; "
            f"at most {MAX_CHAIN} are taken here"
        )
    return None


def _longest_chain(names: list[str], cost: dict[str, int], refs: dict[str, set[str]]) -> int:
    """The largest sum of ``cost`` along a path of references, each group of rules
    that refer to one another in a cycle counted whole (Tarjan's strongly connected
    components, iteratively: the grammar may have a hundred thousand rules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    comp: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []  # in reverse topological order: referred-to ones first
    for start in names:
        if start in index:
            continue
        work = [(start, iter(sorted(refs[start] & cost.keys())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(refs[child] & cost.keys()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    comp[member] = len(comps)
                    members.append(member)
                    if member == node:
                        break
                comps.append(members)
    best: list[int] = []
    for c, members in enumerate(comps):  # every component it refers to comes before it
        after = max(
            (best[comp[r]] for m in members for r in refs[m] if r in comp and comp[r] != c),
            default=0,
        )
        best.append(sum(cost[m] for m in members) + after)
    return max(best, default=0)


def json_grammar() -> str:
    """Any JSON value (OpenAI's ``response_format: {"type": "json_object"}``)."""
    return str(_converter().JSON_GBNF)


def json_schema_grammar(schema: dict[str, Any], param: str = "response_format") -> str:
    """JSON that follows ``schema``; InvalidRequest naming ``param`` when the
    converter cannot turn it into a grammar."""
    if not schema:
        raise InvalidRequest(param, "a json_schema needs a schema")
    conv = _new_converter()
    try:
        with _schema_budget():
            conv.visit(conv.resolve_refs(json.loads(json.dumps(schema)), "schema"), "")
            out = str(conv.format_grammar())
    except Exception as exc:  # the converter raises plain exceptions on bad schemas
        raise InvalidRequest(param, f"cannot turn the schema into a grammar: {exc}") from exc
    problem = depth_problem(out)
    if problem is not None:
        raise InvalidRequest(param, f"the schema's grammar {problem}")
    return out


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
    converter expresses it; a function without a schema (None) takes ``{}``.
    InvalidRequest when a schema cannot be converted, naming that function's entry
    of ``params`` (the request's field, such as ``tools[2].function.parameters``),
    or ``tools`` without them."""
    conv = _new_converter()
    lit = conv._format_literal
    alternatives = []
    with _schema_budget():  # one budget for all the tools together
        for i, (name, parameters) in enumerate(functions):
            if parameters is None:  # OpenAI's function without parameters takes none: {}
                schema = {"type": "object", "properties": {}, "additionalProperties": False}
            else:
                schema = copy.deepcopy(parameters) or {"type": "object"}
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
    out = str(conv.format_grammar())
    problem = depth_problem(out)
    if problem is not None:
        raise InvalidRequest("tools", f"the grammar of the tools' parameters {problem}")
    return out


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
