"""Grammars llama.cpp would overflow its stack on, or that a schema would blow up
to gigabytes, are refused before llama.cpp or the converter gets that far."""

from __future__ import annotations

import pytest

from orin.engine import grammar
from orin.engine.errors import InvalidRequest
from orin.engine.grammar import (
    MAX_CHAIN,
    MAX_NESTING,
    CallSyntax,
    depth_problem,
    json_schema_grammar,
    tool_call_grammar,
)


def nested(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


def chain(length: int, body: str = "r{next}") -> str:
    """``root`` referring to r0, r0 to r1, ... ``length`` rules in a row."""
    rules = [f"r{i} ::= " + body.format(next=f"{i + 1}") for i in range(length - 1)]
    return "\n".join(["root ::= r0", *rules, f'r{length - 1} ::= "a"'])


def test_groups_nested_past_the_limit_are_refused() -> None:
    assert depth_problem(nested(MAX_NESTING)) is None
    problem = depth_problem(nested(MAX_NESTING + 1))
    assert problem == f"nests groups {MAX_NESTING + 1} deep; at most {MAX_NESTING} are taken here"
    # groups that are never closed: the parser recurses into them all the same
    assert depth_problem("root ::= " + "(" * 50_000) is not None


def test_parentheses_in_literals_classes_and_comments_are_no_groups() -> None:
    text = "root ::= " + '"((((" [(((] ' * 1000 + "x\n# " + "(" * 5000 + '\nx ::= "a"'
    assert depth_problem(text) is None


def test_a_chain_of_rule_references_past_the_limit_is_refused() -> None:
    assert depth_problem(chain(MAX_CHAIN - 1)) is None
    problem = depth_problem(chain(MAX_CHAIN + 10))
    assert problem is not None and f"at most {MAX_CHAIN}" in problem
    # each rule's groups are rules too: a chain of rules that each nest a group
    assert depth_problem(chain(MAX_CHAIN // 2 + 10, '("x" r{next})')) is not None


def test_recursive_and_wide_grammars_pass() -> None:
    """A cycle (JSON's value, object, array) counts each of its rules once, and rules
    side by side do not add up: the real grammars pass."""
    assert depth_problem(grammar.json_grammar()) is None
    cycle = "\n".join(
        ["root ::= c0", *(f'c{i} ::= "x" c{(i + 1) % 100} | "y"' for i in range(100))]
    )
    assert depth_problem(cycle) is None
    wide = "root ::= " + " | ".join(f"w{i}" for i in range(50_000))
    assert depth_problem(wide + "\n" + "\n".join(f'w{i} ::= "a"' for i in range(50_000))) is None


def test_a_schema_repetition_is_bounded_before_it_is_written_out() -> None:
    """``maxLength`` 10**9 would make the converter write 8 GB of grammar: refused
    naming the field, before any of it is written."""
    with pytest.raises(InvalidRequest) as caught:
        json_schema_grammar({"type": "string", "maxLength": 10**9}, "response_format.schema")
    assert caught.value.param == "response_format.schema"
    assert "repetition of 1000000000 items" in str(caught.value)
    with pytest.raises(InvalidRequest, match="repetition of 100000000 items"):
        json_schema_grammar({"type": "string", "pattern": "^a{0,100000000}$"}, "json_schema")


def test_a_schema_whose_grammar_nests_too_deep_is_refused_naming_the_field() -> None:
    with pytest.raises(InvalidRequest) as caught:
        json_schema_grammar({"type": "string", "maxLength": 20_000}, "json_schema")
    assert caught.value.param == "json_schema"
    assert "the schema's grammar nests groups" in str(caught.value)
    assert json_schema_grammar({"type": "string", "maxLength": 1000}, "json_schema")
    assert json_schema_grammar({"type": "string", "minLength": 50_000}, "json_schema")


def test_tool_parameters_are_bounded_as_a_schema_is() -> None:
    huge = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 10**9}}}
    with pytest.raises(InvalidRequest) as caught:
        tool_call_grammar(
            [("f", huge)], CallSyntax(), False, params=["tools[0].function.parameters"]
        )
    assert caught.value.param == "tools[0].function.parameters"
    fine = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 100}}}
    assert depth_problem(tool_call_grammar([("f", fine)], CallSyntax(), True)) is None


def test_the_tools_of_one_request_share_one_budget() -> None:
    """Each tool alone within the budget, all of them together not: a request of many
    tools cannot take the budget once per tool."""
    each = {"type": "object", "properties": {"a": {"type": "string", "minLength": 40_000}}}
    assert tool_call_grammar([("f", each)], CallSyntax(), False)
    tools = [(f"f{i}", each) for i in range(40)]
    params = [f"tools[{i}].function.parameters" for i in range(40)]
    with pytest.raises(InvalidRequest) as caught:
        tool_call_grammar(tools, CallSyntax(), False, params=params)
    assert caught.value.param.startswith("tools[") and "repetition" in str(caught.value)


def test_a_deeply_nested_schema_still_converts() -> None:
    """What closes the converter's gaps adds no Python frames to each level it
    recurses through: 400 nested objects convert as they did."""
    schema: dict[str, object] = {"type": ["integer", "null"]}
    for _ in range(400):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    assert json_schema_grammar(schema, "json_schema").count("-kv ::=") == 400
