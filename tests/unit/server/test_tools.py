"""Tool calls and reasoning: the request fields, the grammar that forces a call, the
incremental parser of every format (split at every point), and the chat answers."""

from __future__ import annotations

import asyncio
import json
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from orin.engine.chat import TemplateCaps
from orin.engine.stream import Completion
from orin.engine.types import TokenEvent, TokenLogprob, TopLogprob
from orin.server import protocol
from orin.server.responses import ChatFormatter, sse_events
from orin.server.tools import (
    FORMATS,
    CallArgs,
    CallStart,
    OutputSpec,
    Part,
    Text,
    output_spec,
    required_grammar,
)

HERMES = OutputSpec(FORMATS["hermes"])
LLAMA3 = OutputSpec(FORMATS["llama3"])
OFFERED = frozenset({"get_weather", "f"})
LLAMA3_TOOLS = OutputSpec(FORMATS["llama3"], names=OFFERED)
HERMES_TOOLS = OutputSpec(FORMATS["hermes"], names=OFFERED)
MISTRAL_TOOLS = OutputSpec(FORMATS["mistral"], names=OFFERED)
MISTRAL_ARGS_TOOLS = OutputSpec(FORMATS["mistral_args"], names=OFFERED)
MISTRAL = OutputSpec(FORMATS["mistral"])
MISTRAL_ARGS = OutputSpec(FORMATS["mistral_args"])
THINKING = OutputSpec(FORMATS["hermes"], reasoning=True)
OPENED = OutputSpec(None, reasoning=True, opens_thinking=True)

Message = tuple[str, str, list[tuple[str, str]]]  # content, reasoning, [(name, arguments)]

# (spec, generated text, the message it is)
CASES: list[tuple[str, OutputSpec, str, Message]] = [
    (
        "hermes one call after text",
        HERMES,
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call>",
        ("Let me look.", "", [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        "hermes two calls, nested JSON with braces and escapes in strings",
        HERMES,
        '<tool_call>\n{"name": "a", "arguments": {"q": "}{\\"]", "n": [1, {"x": null}]}}\n'
        '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>',
        ("", "", [("a", '{"q": "}{\\"]", "n": [1, {"x": null}]}'), ("b", "{}")]),
    ),
    (
        "hermes call without arguments and without the closing tag",
        HERMES,
        '<tool_call>{"name": "now"}',
        ("", "", [("now", "{}")]),
    ),
    (
        "hermes arguments before the name",
        HERMES,
        '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>',
        ("", "", [("get_weather", '{"city": "Oslo"}')]),
    ),
    (
        "hermes arguments as a JSON string",
        HERMES,
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        ("", "", [("f", '{"a": 1}')]),
    ),
    (
        "text after a call keeps the whitespace before the call",
        HERMES,
        'Sure! <tool_call>{"name": "f", "arguments": {}}</tool_call>\n\n done',
        ("Sure! done", "", [("f", "{}")]),
    ),
    (
        "text after calls keeps the whitespace after them when none came before",
        HERMES,
        'Sure!<tool_call>{"name": "f"}</tool_call>\n<tool_call>{"name": "g"}</tool_call>\nok',
        ("Sure!\nok", "", [("f", "{}"), ("g", "{}")]),
    ),
    (
        "text after a call with no content before it, or whitespace after calls, adds none",
        HERMES,
        '<tool_call>{"name": "f"}</tool_call> done <tool_call>{"name": "g"}</tool_call>\n',
        ("done", "", [("f", "{}"), ("g", "{}")]),
    ),
    (
        "plain text that looks like a marker is content",
        HERMES,
        "a <tool b <tool_cal c < d",
        ("a <tool b <tool_cal c < d", "", []),
    ),
    (
        "llama3 JSON call",
        LLAMA3,
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        ("", "", [("get_weather", '{"city": "Paris"}')]),
    ),
    (
        "llama3 calls separated by ;",
        LLAMA3,
        ' {"type": "function", "name": "a", "parameters": {"x": 1}}; {"name": "b", '
        '"parameters": {}}',
        ("", "", [("a", '{"x": 1}'), ("b", "{}")]),
    ),
    (
        "llama3 after the python tag",
        LLAMA3,
        'Calling.<|python_tag|>{"name": "f", "parameters": {"q": "x"}}',
        ("Calling.", "", [("f", '{"q": "x"}')]),
    ),
    (
        "llama3 JSON content that is no call",
        LLAMA3,
        '{"answer": 42, "name": "x"}',
        ('{"answer": 42, "name": "x"}', "", []),
    ),
    (
        "llama3 JSON whose name is no offered tool is the answer, not a call",
        LLAMA3_TOOLS,
        '{"name": "Bob", "age": 30}',
        ('{"name": "Bob", "age": 30}', "", []),
    ),
    (
        "llama3 a call of an offered tool, then one of no tool",
        LLAMA3_TOOLS,
        '{"name": "f", "parameters": {}}; {"name": "Bob", "parameters": {}}',
        ('; {"name": "Bob", "parameters": {}}', "", [("f", "{}")]),
    ),
    (
        "llama3 after the python tag a call of no offered tool is content",
        LLAMA3_TOOLS,
        'Ok <|python_tag|>{"name": "Bob", "parameters": {}}',
        ('Ok <|python_tag|>{"name": "Bob", "parameters": {}}', "", []),
    ),
    (
        "hermes a call of no offered tool is content, a later good call a call",
        HERMES_TOOLS,
        '<tool_call>\n{"name": "Bob", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
        ('<tool_call>\n{"name": "Bob", "arguments": {}}\n</tool_call>', "", [("f", '{"x": 1}')]),
    ),
    (
        "mistral a call of an offered tool, then one of no tool",
        MISTRAL_TOOLS,
        '[TOOL_CALLS][{"name": "f", "arguments": {}}, {"name": "Bob", "arguments": {}}]',
        (', {"name": "Bob", "arguments": {}}]', "", [("f", "{}")]),
    ),
    (
        "mistral name[ARGS] of no offered tool is content",
        MISTRAL_ARGS_TOOLS,
        '[TOOL_CALLS]Bob[ARGS]{"a": 1}',
        ('[TOOL_CALLS]Bob[ARGS]{"a": 1}', "", []),
    ),
    (
        "llama3 a call in the middle of text is content",
        LLAMA3,
        'Use {"name": "f", "parameters": {}}',
        ('Use {"name": "f", "parameters": {}}', "", []),
    ),
    (
        "mistral list of calls",
        MISTRAL,
        'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": "y"}, "id": "abc123def"}, '
        '{"name": "b", "arguments": {}}]',
        ("Sure.", "", [("a", '{"x": "y"}'), ("b", "{}")]),
    ),
    (
        "mistral name[ARGS]",
        MISTRAL_ARGS,
        'Ok[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[CALL_ID]a1b2c3d4e'
        '[ARGS]{"n": [1, 2]}',
        ("Ok", "", [("get_weather", '{"city": "Paris"}'), ("f", '{"n": [1, 2]}')]),
    ),
    (
        "reasoning, content and a call",
        THINKING,
        '\n<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "w",'
        ' "arguments": {"c": "<think></think>"}}\n</tool_call>',
        ("Checking.", "The user wants weather.", [("w", '{"c": "<think></think>"}')]),
    ),
    (
        "a think block that is not at the start is content",
        THINKING,
        "Answer: <think>no</think>",
        ("Answer: <think>no</think>", "", []),
    ),
    (
        "a tool call inside the reasoning is reasoning",
        THINKING,
        '<think>maybe <tool_call>{"name": "x"}</tool_call></think>No call.',
        ("No call.", 'maybe <tool_call>{"name": "x"}</tool_call>', []),
    ),
    (
        "the prompt opened the block",
        OPENED,
        "hmm, 2+2\n</think>\n\n4",
        ("4", "hmm, 2+2", []),
    ),
    (
        "unterminated reasoning",
        OPENED,
        "still thinking </thi",
        ("", "still thinking </thi", []),
    ),
]


def message(parts: list[Part]) -> Message:
    """What a client assembles from the parts (OpenAI's deltas)."""
    content, reasoning = "", ""
    calls: dict[int, list[str]] = {}
    for p in parts:
        if isinstance(p, Text):
            if p.kind == "content":
                content += p.text
            else:
                reasoning += p.text
        elif isinstance(p, CallStart):
            assert p.index == len(calls) and p.name
            assert p.id.startswith("call_") or (p.id.isalnum() and len(p.id) == 9), p.id
            calls[p.index] = [p.name, ""]
        else:
            calls[p.index][1] += p.text
    return content, reasoning, [(n, a) for n, a in calls.values()]


def parse(spec: OutputSpec, pieces: list[str], eager: bool = True) -> Message:
    parser = spec.parser(eager)
    parts: list[Part] = []
    for piece in pieces:
        parts += parser.feed(piece)
    parts += parser.finish()
    got = message(parts)
    r = parser.result()
    assert (r.content, r.reasoning, [(c.name, c.arguments) for c in r.calls]) == got
    return got


def splits(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


@pytest.mark.parametrize(
    ("spec", "text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_every_format_at_every_split_point(spec: OutputSpec, text: str, expected: Message) -> None:
    assert parse(spec, [text], eager=False) == expected  # a whole answer
    assert parse(spec, list(text)) == expected  # a character per token
    for i in range(len(text) + 1):
        assert parse(spec, [text[:i], text[i:]]) == expected, i
        assert parse(spec, [text[:i], text[i:]], eager=False) == expected, i


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=30))
def test_random_token_boundaries(
    case: tuple[str, OutputSpec, str, Message], cuts: list[int]
) -> None:
    _, spec, text, expected = case
    pieces = splits(text, [c for c in cuts if c <= len(text)])
    assert parse(spec, pieces) == expected
    assert parse(spec, pieces, eager=False) == expected


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=8,
)
NAMES = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,10}", fullmatch=True)


def written(fmt: str, calls: list[tuple[str, str]]) -> str:
    """Calls as a model in ``fmt`` writes them."""
    if fmt == "hermes":
        return "\n".join(
            f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>' for n, a in calls
        )
    if fmt == "llama3":
        return "; ".join(f'{{"name": "{n}", "parameters": {a}}}' for n, a in calls)
    if fmt == "mistral":
        return (
            "[TOOL_CALLS]["
            + ", ".join(f'{{"name": "{n}", "arguments": {a}}}' for n, a in calls)
            + "]"
        )
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{a}" for n, a in calls)


@settings(max_examples=200, deadline=None)
@given(
    fmt=st.sampled_from(["hermes", "llama3", "mistral", "mistral_args"]),
    calls=st.lists(
        st.tuples(NAMES, st.dictionaries(st.text(max_size=5), JSON, max_size=4)),
        min_size=1,
        max_size=3,
    ),
    cuts=st.lists(st.integers(0, 600), max_size=40),
)
def test_any_arguments_in_any_format_come_out_as_written(
    fmt: str, calls: list[tuple[str, dict[str, Any]]], cuts: list[int]
) -> None:
    expected = [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls]
    text = written(fmt, expected)
    spec = OutputSpec(FORMATS[fmt])  # type: ignore[index]
    assert parse(spec, [text], eager=False) == ("", "", expected)
    assert parse(spec, splits(text, [c for c in cuts if c <= len(text)])) == ("", "", expected)


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<think>", "</think>",
    "<|python_tag|>", '{"name": "f"', ', "arguments": ', ', "parameters": ', "{", "}", "[", "]",
    '"', "\\", ",", ";", ":", " ", "\n", "x", "é", "1", "null", "f", '{"a": 1}',
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    spec=st.sampled_from([HERMES, LLAMA3, MISTRAL, MISTRAL_ARGS, THINKING, OPENED]),
    chunks=st.lists(st.sampled_from(FRAGMENTS), max_size=40),
    cuts=st.lists(st.integers(0, 300), max_size=20),
)
def test_any_text_parses_the_same_whatever_the_token_boundaries(
    spec: OutputSpec, chunks: list[str], cuts: list[int]
) -> None:
    """Malformed calls never raise; a whole answer does not depend on where tokens
    split it, and nothing of the text is lost but call syntax."""
    text = "".join(chunks)
    whole = parse(spec, [text], eager=False)
    assert parse(spec, splits(text, [c for c in cuts if c <= len(text)]), eager=False) == whole
    streamed = parse(spec, splits(text, [c for c in cuts if c <= len(text)]))
    if not whole[2] and not streamed[2]:
        assert streamed == whole  # no call either way: the same content and reasoning
    content, _, calls = whole
    if not calls and spec.format is not None and not spec.reasoning:
        assert content == text  # no call found: every character is content


def test_a_string_json_refuses_makes_a_call_malformed_not_an_error() -> None:
    """An escape JSON does not have (``\\<``) or a raw control character inside a key
    or a name: the call is malformed and stays content, as json.loads would refuse it
    (found by the property test above)."""
    for bad in (
        'Hi <tool_call>{"\\<tool_call>": 1}</tool_call>',
        'Hi <tool_call>{"name": "f\\x", "arguments": {}}</tool_call>',
        'Hi <tool_call>{"na\nme": "f", "arguments": {}}</tool_call>',
    ):
        assert parse(HERMES, [bad], eager=False) == (bad, "", [])
    fine = '<tool_call>{"name": "f\\u00e9", "arguments": {"a": "\\n"}}</tool_call>'
    assert parse(HERMES, [fine], eager=False)[2] == [("f\u00e9", '{"a": "\\n"}')]


def test_malformed_calls_stay_content() -> None:
    bad = 'Hi <tool_call>{"name": "f", "arguments": {"a": tru}}</tool_call> bye'
    assert parse(HERMES, [bad], eager=False) == (bad, "", [])
    cut = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1'  # max_tokens ended it
    assert parse(HERMES, [cut], eager=False) == (cut, "", [])
    # streamed, the call was announced before it broke off: it stays a call
    assert parse(HERMES, [cut[:20], cut[20:]]) == ("Hi", "", [("f", '{"a": 1')])
    assert parse(MISTRAL_ARGS, ["[TOOL_CALLS]not a name[ARGS]{}"], eager=False)[2] == []


def test_text_that_may_be_a_marker_is_held_until_decided() -> None:
    parser = HERMES.parser()
    assert parser.feed("Hello <tool") == [Text("content", "Hello")]
    assert parser.feed("_c") == []
    assert parser.feed("ar") == [Text("content", " <tool_car")]
    assert parser.finish() == []
    thinking = THINKING.parser()
    assert thinking.feed(" <thi") == []
    assert thinking.feed("nk>a") == [Text("reasoning", "a")]
    assert thinking.feed("</thin") == []
    assert thinking.feed("k>\nb") == [Text("content", "b")]


def test_the_first_delta_of_a_call_has_its_id_and_name_then_argument_fragments() -> None:
    parser = HERMES.parser()
    parts = parser.feed('<tool_call>{"name": "f", "arguments": {"a"')
    assert isinstance(parts[0], CallStart) and parts[0].name == "f" and parts[0].index == 0
    assert parts[0].id.startswith("call_") and len(parts[0].id) == 29
    assert parts[1:] == [CallArgs(0, '{"a"')]
    assert parser.feed(": 1}}</tool_call>") == [CallArgs(0, ": 1}")]
    ids = {HERMES.parser().feed('<tool_call>{"name": "f", ')[0].id for _ in range(20)}  # type: ignore[union-attr]
    assert len(ids) == 20


def test_the_ids_mistral_writes_are_kept() -> None:
    parser = MISTRAL.parser()
    parts = parser.feed('[TOOL_CALLS][{"name": "a", "arguments": {}, "id": "abc123def"}]')
    assert parts[0] == CallStart(0, "abc123def", "a")
    parser = MISTRAL_ARGS.parser()
    parts = parser.feed("[TOOL_CALLS]f[CALL_ID]xyz987uvw[ARGS]{")
    assert parts[0] == CallStart(0, "xyz987uvw", "f")


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (MISTRAL, '[TOOL_CALLS][{"name": "a", "arguments": {}}]'),
        (MISTRAL_ARGS, "[TOOL_CALLS]a[ARGS]{}"),
    ],
)
def test_the_ids_given_to_mistrals_calls_are_nine_alphanumerics(
    spec: OutputSpec, text: str
) -> None:
    """Mistral's templates refuse a history whose call ids are anything else, so the
    turn after a call, sent back with the id the server gave it, was a 400."""
    parser = spec.parser()
    (start,) = [p for p in parser.feed(text) + parser.finish() if isinstance(p, CallStart)]
    assert start.id.isalnum() and len(start.id) == 9, start.id
    hermes = HERMES.parser().feed('<tool_call>{"name": "f", ')
    assert isinstance(hermes[0], CallStart) and hermes[0].id.startswith("call_")


def test_at_most_one_call_without_parallel_tool_calls() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call>'
    )
    one = OutputSpec(FORMATS["hermes"], max_calls=1)
    assert parse(one, [text], eager=False) == ("", "", [("a", "{}")])
    assert parse(one, list(text)) == ("", "", [("a", "{}")])


# -- the request -------------------------------------------------------------------------

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


def request(**fields: Any) -> protocol.ChatCompletionRequest:
    return protocol.ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}], **{"tools": TOOLS, **fields}
    )


def refused(**fields: Any) -> str:
    with pytest.raises(ValidationError) as err:
        request(**fields)
    first = err.value.errors()[0]
    return ".".join(str(p) for p in first["loc"][:1]) + ": " + first["msg"]


def test_request_validation_names_the_field() -> None:
    assert request().effective_tool_choice() == "auto"
    assert request(tools=None).effective_tool_choice() == "none"
    named = {"type": "function", "function": {"name": "nope"}}
    assert refused(tool_choice=named).startswith("tool_choice: ")
    assert "'nope' is not among the tools" in refused(tool_choice=named)
    assert refused(tools=None, tool_choice="required").startswith("tool_choice: ")
    assert refused(tool_choice="sometimes").startswith("tool_choice")
    assert "grammar" in refused(tool_choice="required", grammar="root ::= [a]")
    assert "response_format" in refused(
        tool_choice=named | {"function": {"name": "get_time"}},
        response_format={"type": "json_object"},
    )
    request(tool_choice="auto", grammar="root ::= [a]")  # auto constrains nothing
    bad_name = [{"type": "function", "function": {"name": "has space"}}]
    assert refused(tools=bad_name).startswith("tools: ")
    twice = [TOOLS[1], TOOLS[1]]
    assert "unique" in refused(tools=twice)
    not_object = [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]
    assert "JSON schema of an object" in refused(tools=not_object)


def test_messages_carry_calls_results_and_reasoning_to_the_template() -> None:
    body = protocol.ChatCompletionRequest(
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "need a tool",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "9"}]},
        ]
    )
    user, assistant, tool = body.template_messages()
    assert user == {"role": "user", "content": "Weather?"}
    assert assistant["content"] == "" and assistant["reasoning_content"] == "need a tool"
    fn = assistant["tool_calls"][0]["function"]
    assert json.loads(fn["arguments"]) == {"city": "Oslo"}
    assert tool == {"role": "tool", "content": "9", "tool_call_id": "call_1"}


CAPS = TemplateCaps(True, True, "hermes", False, False)
THINKING_CAPS = TemplateCaps(True, True, "hermes", True, False)


def test_tool_fields_without_tools_are_refused_as_openai_refuses_them() -> None:
    """OpenAI answers 400 to an empty tools list and to tool_choice or
    parallel_tool_calls without tools; they were accepted in silence, so a client
    that lost its tools on the way got an answer that could never call one."""
    assert refused(tools=[]).startswith("tools: ")
    assert "at least one function" in refused(tools=[])
    for choice in ("none", "auto", "required"):
        assert refused(tools=None, tool_choice=choice) == (
            "tool_choice: Value error, tool_choice is only allowed when tools are specified"
        )
    for parallel in (True, False):
        assert refused(tools=None, parallel_tool_calls=parallel).startswith("parallel_tool_calls: ")
    assert "tools are specified" in refused(tools=None, parallel_tool_calls=False)
    # null is the default, as left out; and with tools every value stays accepted
    request(tools=None, tool_choice=None, parallel_tool_calls=None)
    request(tool_choice="none", parallel_tool_calls=False)
    # tools refused for a reason of their own are the error, not the fields beside them
    bad = [{"type": "function", "function": {"name": "has space"}}]
    with pytest.raises(ValidationError) as err:
        request(tools=bad, tool_choice="auto", parallel_tool_calls=False)
    assert [e["loc"][0] for e in err.value.errors()] == ["tools"]


def test_the_output_spec_follows_tool_choice_and_reasoning_format() -> None:
    spec = output_spec(request(), CAPS, "prompt")
    assert spec.format is FORMATS["hermes"] and spec.max_calls is None and not spec.reasoning
    assert output_spec(request(parallel_tool_calls=False), CAPS, "p").max_calls == 1
    assert spec.names == {"get_weather", "get_time"}  # the offered tools'
    none = output_spec(request(tool_choice="none"), CAPS, "p")
    assert (
        none.format is None and none.plain and request(tool_choice="none").offered_tools() is None
    )
    thinking = output_spec(request(), THINKING_CAPS, "…<think>\n")
    assert thinking.reasoning and thinking.opens_thinking
    raw = output_spec(request(reasoning_format="none"), THINKING_CAPS, "p")
    assert not raw.reasoning


def test_the_grammar_of_required_and_named_choices() -> None:
    assert required_grammar(request(), output_spec(request(), CAPS, "p")) is None
    body = request(tool_choice="required")
    g = required_grammar(body, output_spec(body, CAPS, "p"))
    assert g is not None
    root = next(line for line in g.splitlines() if line.startswith("root ::= "))
    assert root == 'root ::= tool-call ("\\n" tool-call)*'  # parallel: one or more
    assert '"<tool_call>\\n" "{\\"name\\": \\"get_weather\\", \\"arguments\\": "' in g
    assert '"\\"c\\"" | "\\"f\\""' in g  # the enum of the schema
    named = {"type": "function", "function": {"name": "get_time"}}
    for parallel in (False, True):  # a named function is called exactly once
        body = request(tool_choice=named, parallel_tool_calls=parallel)
        spec = output_spec(body, CAPS, "p")
        g = required_grammar(body, spec)
        assert g is not None and "get_weather" not in g and "root ::= tool-call\n" in g + "\n"
        assert spec.max_calls == 1
    body = request(tool_choice="required")
    g = required_grammar(body, output_spec(body, THINKING_CAPS, "<think>\n"))
    assert g is not None and 'root ::= reasoning-body "</think>"' in g  # inside the block
    g = required_grammar(body, output_spec(body, THINKING_CAPS, "p"))
    assert g is not None and 'root ::= ("<think>" reasoning-body "</think>"' in g  # optional
    g = required_grammar(body, output_spec(body, THINKING_CAPS, "<think>\n\n</think>\n\n"))
    assert g is not None and "reasoning-body" not in g  # enable_thinking false closed it
    llama = TemplateCaps(True, True, "llama3", False, False)
    g = required_grammar(body, output_spec(body, llama, "p"))
    assert g is not None and "root ::= tool-call\n" in g + "\n"  # Llama 3.x: one call
    assert '\\"parameters\\": ' in g
    mistral = TemplateCaps(True, True, "mistral", False, False)
    g = required_grammar(body, output_spec(body, mistral, "p"))
    assert g is not None and 'root ::= "[TOOL_CALLS][" tool-call (", " tool-call)* "]"' in g


def test_a_function_without_parameters_is_called_with_none() -> None:
    """OpenAI's function without ``parameters`` takes no arguments; a required call of
    one was held to any object, so a model wrote made-up arguments ({"temperature":
    25, ...}) for it, or ran out of tokens writing them. Its arguments are ``{}``; a
    schema of any object still takes any object."""
    tools = [
        {"type": "function", "function": {"name": "now"}},
        {"type": "function", "function": {"name": "any", "parameters": {"type": "object"}}},
    ]
    for name, rule in (("now", '"{" space  "}" space'), ("any", "object")):
        named = {"type": "function", "function": {"name": name}}
        body = request(tools=tools, tool_choice=named)
        g = required_grammar(body, output_spec(body, CAPS, "p"))
        assert g is not None
        args = next(line for line in g.splitlines() if line.startswith(f"{name}-args ::= "))
        assert args == f"{name}-args ::= {rule}"


def test_a_schema_the_converter_cannot_take_is_a_400_naming_that_tools_parameters() -> None:
    """The param is the function's own entry, also when a named tool_choice picks it
    from the others: ``tools[1].function.parameters``."""
    from orin.engine.errors import InvalidRequest

    good = {"type": "function", "function": {"name": "g"}}
    bad = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"$ref": "nowhere"}}},
        },
    }
    named = {"type": "function", "function": {"name": "f"}}
    for choice in ("required", named):
        body = request(tools=[good, bad], tool_choice=choice)
        with pytest.raises(InvalidRequest) as err:
            required_grammar(body, output_spec(body, CAPS, "p"))
        assert err.value.param == "tools[1].function.parameters"
        assert "'f'" in str(err.value)


def test_a_response_format_schema_the_converter_cannot_take_names_the_schema() -> None:
    from orin.engine.errors import InvalidRequest

    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}
    with pytest.raises(InvalidRequest) as err:
        protocol.ChatCompletionRequest(
            messages=[{"role": "user", "content": "hi"}], response_format=fmt
        )._grammar()
    assert err.value.param == "response_format.json_schema.schema"


# -- the answers -------------------------------------------------------------------------


def served() -> Any:
    return SimpleNamespace(
        model_name="demo",
        system_fingerprint=None,
        engine_piece=lambda t: b"a",
        detokenize=lambda ids: "",
        timings=protocol.timings,
    )


CALL_TEXT = (
    'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def formatter(spec: OutputSpec | None, **fields: Any) -> ChatFormatter:
    return ChatFormatter(served(), request(**fields), "req-1", spec)


def completion(text: str, finish: str = "stop") -> Completion:
    return Completion("req-1", text, (1,) * 5, (), finish, None)  # type: ignore[arg-type]


def test_a_whole_answer_with_a_call() -> None:
    out = formatter(HERMES).response(completion(CALL_TEXT), [1])
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["content"] == "Sure."
    (call,) = msg["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    only_call = formatter(HERMES).response(completion(CALL_TEXT[5:]), [1])["choices"][0]
    assert only_call["message"]["content"] is None  # OpenAI's null
    cut = formatter(HERMES).response(completion(CALL_TEXT, "length"), [1])["choices"][0]
    assert cut["finish_reason"] == "length"  # the call was made, but the answer was cut
    plain = formatter(None).response(completion(CALL_TEXT), [1])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": CALL_TEXT}
    assert plain["finish_reason"] == "stop"


def test_a_whole_answer_with_reasoning() -> None:
    msg = formatter(THINKING).response(completion("<think>x</think>y"), [1])["choices"][0]
    assert msg["message"] == {"role": "assistant", "content": "y", "reasoning_content": "x"}


class FakeStream:
    def __init__(self, batches: list[list[TokenEvent]]) -> None:
        self.request_id = "req-1"
        self.batches = batches

    async def next_batch(self) -> list[TokenEvent]:
        return self.batches.pop(0) if self.batches else []

    def cancel(self) -> None:
        pass


def stream_chunks(fmt: ChatFormatter, pieces: list[str], **event: Any) -> list[dict[str, Any]]:
    events = [TokenEvent("req-1", i, p, **event) for i, p in enumerate(pieces[:-1])]
    events.append(TokenEvent("req-1", None, pieces[-1], finish_reason="stop"))
    stream = FakeStream([[e] for e in events])

    async def run() -> list[bytes]:
        return [b async for b in sse_events(fmt, stream, lambda c: None)]  # type: ignore[arg-type]

    raw = b"".join(asyncio.run(run())).split(b"\n\n")
    assert raw[-2] == b"data: [DONE]"
    return [json.loads(e[6:]) for e in raw[:-2]]


def test_a_streamed_call_reassembles_to_the_whole_answer() -> None:
    chunks = stream_chunks(formatter(HERMES), [CALL_TEXT[i : i + 3] for i in range(0, 93, 3)])
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": None}  # OpenAI's, with tools
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    first = calls[0]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert all(set(tc) == {"index", "function"} for tc in calls[1:])
    arguments = "".join(tc["function"]["arguments"] for tc in calls)
    whole = formatter(HERMES).response(completion(CALL_TEXT), [1])["choices"][0]["message"]
    assert content == whole["content"]
    assert arguments == whole["tool_calls"][0]["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def added_up(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Deltas added up as OpenAI's client does (``accumulate_delta``): a key's first
    value that is not null is taken, strings after it are appended."""
    message: dict[str, Any] = {}
    for d in deltas:
        for key in ("role", "content"):
            if key not in d:
                continue
            if message.get(key) is None or key == "role":
                message[key] = d[key]
            elif d[key] is not None:
                message[key] += d[key]
    return message


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (HERMES, CALL_TEXT[5:]),
        (HERMES, CALL_TEXT),
        (HERMES, "No call."),
        (HERMES, ""),  # no token at all: null both ways
        (OPENED, ""),  # reasoning parsed, no tools: "" both ways
        (OPENED, "hmm</think>4"),
        (None, "Plain."),
    ],
)
def test_a_streamed_answer_adds_up_to_the_whole_answers_content(
    spec: OutputSpec | None, text: str
) -> None:
    """Only tool calls: null content streamed as in the whole answer (OpenAI's first
    delta has content null then), not the empty string; text adds up to the text."""
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)] or [""]
    chunks = stream_chunks(formatter(spec), pieces)
    streamed = added_up([c["choices"][0]["delta"] for c in chunks])
    whole = formatter(spec).response(completion(text), [1])["choices"][0]["message"]
    assert streamed["role"] == "assistant"
    assert streamed["content"] == whole["content"]


def test_streamed_reasoning_deltas() -> None:
    chunks = stream_chunks(formatter(THINKING), ["<thi", "nk>a", "b</th", "ink>", "c"])
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert deltas == [{"reasoning_content": "a"}, {"reasoning_content": "b"}, {"content": "c"}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_held_tokens_still_send_their_logprobs_and_ids() -> None:
    lp = TokenLogprob(7, -0.5, (TopLogprob(7, "a", -0.5),))
    chunks = stream_chunks(
        formatter(HERMES, logprobs=True, return_token_ids=True), ["<tool", "x"], logprob=lp
    )
    held = chunks[1]["choices"][0]
    assert held["delta"] == {} and held["token_ids"] == [0] and held["logprobs"] is not None
    assert chunks[2]["choices"][0]["delta"] == {"content": "<toolx"}


def test_without_tools_or_reasoning_the_fast_path_streams() -> None:
    from orin.server.responses import TokenChunks

    assert isinstance(formatter(None).token_stream(), TokenChunks)
    assert isinstance(formatter(OutputSpec()).token_stream(), TokenChunks)  # nothing to parse
    assert not isinstance(formatter(HERMES).token_stream(), TokenChunks)


def test_the_markers_a_request_preserves() -> None:
    """The literals the parser looks for, as the engine is asked to write them out
    when the vocabulary has them as control tokens."""
    mistral = OutputSpec(format=FORMATS["mistral_args"])
    assert set(mistral.marker_texts()) == {"[TOOL_CALLS]", "[ARGS]"}
    hermes_thinking = OutputSpec(format=FORMATS["hermes"], reasoning=True)
    assert set(hermes_thinking.marker_texts()) == {
        "<tool_call>",
        "</tool_call>",
        "<think>",
        "</think>",
    }
    assert OutputSpec().marker_texts() == ()
