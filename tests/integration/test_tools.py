"""Tool calls and reasoning end to end, with the official openai client.

The generated demo models write random text, so the structure comes from a
grammar: ``tool_choice`` required or named (the server's own grammar), or the
request's ``grammar`` field with ``auto`` (calls and think blocks written by
hand). The chat templates are the ones under tests/fixtures/chat_templates, put
into the profile as ``model.chat_template``.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from orin.engine.chat import ChatTemplate
from orin.model import demo, packaged
from orin.server.state import ServerState
from tests.serverutil import live_server

pytestmark = pytest.mark.llama

TEMPLATES = Path(__file__).parents[1] / "fixtures" / "chat_templates"
ENGINE = "engine: {n_ctx: 4096, slots: 2, n_batch: 256, n_ubatch: 256}\n"
SERVER = "server: {model_name: demo, max_tokens_limit: 300}\n"

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS: Any = [
    {"type": "function", "function": {"name": n, "description": f"{n} tool", "parameters": s}}
    for n, s in SCHEMAS.items()
]
ASK: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: Any = {"temperature": 0, "max_tokens": 200}


def valid_arguments(name: str, arguments: str) -> bool:
    """The arguments against the few schema keywords the tests use (jsonschema is not a
    dependency)."""
    schema = SCHEMAS[name]
    args = json.loads(arguments)
    props = schema["properties"]
    if not isinstance(args, dict) or not set(schema["required"]) <= set(args):
        return False
    if schema.get("additionalProperties") is False and not set(args) <= set(props):
        return False
    for key, value in args.items():
        rule = props.get(key, {})
        if "enum" in rule and value not in rule["enum"]:
            return False
        if rule.get("type") == "string" and not isinstance(value, str):
            return False
        if "maxLength" in rule and len(value) > rule["maxLength"]:
            return False
        if rule.get("type") == "integer" and (not isinstance(value, int) or value is True):
            return False
    return True


def profile(template: str | None) -> str:
    if template is None:
        return ENGINE + SERVER
    body = textwrap.indent((TEMPLATES / f"{template}.jinja").read_text(), "    ")
    return f"model:\n  chat_template: |\n{body}\n{ENGINE}{SERVER}"


@pytest.fixture(scope="module")
def model() -> Path:
    return demo.ensure("small", "f16")


@pytest.fixture(scope="module")
def hermes(model: Path) -> Iterator[tuple[str, ServerState]]:
    with live_server(model, profile("hermes")) as s:
        yield s


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)


def calls_of(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


@pytest.mark.parametrize("template", ["hermes", "llama31", "mistral", "mistral_args", "qwen3"])
def test_required_gives_one_valid_call_in_every_format(model: Path, template: str) -> None:
    # Qwen3's template closes its think block when asked (the grammar lets a model
    # think before its call otherwise, and a random one never stops)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}} if template == "qwen3" else {}
    with live_server(model, profile(template)) as (base, _):
        r = client(base).chat.completions.create(
            model="demo",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            extra_body=kwargs,
            **GREEDY,
        )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id and call.function.name in SCHEMAS
    assert valid_arguments(call.function.name, call.function.arguments)
    assert choice.message.content is None


@pytest.mark.parametrize("template", ["hermes", "llama31", "mistral", "mistral_args"])
def test_a_call_and_its_result_go_back_for_the_next_turn(model: Path, template: str) -> None:
    """The ids the server gives its calls are ones the template takes back: Mistral's
    templates refuse a history whose call ids are not 9 characters, so the turn
    after a call (the assistant's message and the tool's result, as the client
    sends them back) was a 400."""
    with live_server(model, profile(template)) as (base, _):
        c = client(base)
        r = c.chat.completions.create(
            model="demo",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            **GREEDY,
        )
        message = r.choices[0].message
        (call,) = message.tool_calls or []
        history: Any = [
            *ASK,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"},
        ]
        after = c.chat.completions.create(
            model="demo", messages=history, tools=TOOLS, temperature=0, max_tokens=5
        )
    assert after.choices[0].message.role == "assistant"


def test_a_named_function_is_the_one_called(hermes: tuple[str, ServerState]) -> None:
    r = client(hermes[0]).chat.completions.create(
        model="demo",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        **GREEDY,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    calls = calls_of(r.choices[0].message)
    assert calls and all(name == "get_time" and valid_arguments(name, a) for name, a in calls)


def test_a_function_without_parameters_is_called_without_arguments(
    hermes: tuple[str, ServerState],
) -> None:
    """OpenAI's function without ``parameters`` takes none: its forced call's
    arguments are ``{}``, not whatever object the model makes up."""
    tools: Any = [*TOOLS, {"type": "function", "function": {"name": "now"}}]
    r = client(hermes[0]).chat.completions.create(
        model="demo",
        messages=ASK,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "now"}},
        **GREEDY,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(n, json.loads(a)) for n, a in calls_of(r.choices[0].message)] == [("now", {})]


def test_required_with_parallel_calls_gives_valid_calls(hermes: tuple[str, ServerState]) -> None:
    r = client(hermes[0]).chat.completions.create(
        model="demo", messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY
    )
    calls = calls_of(r.choices[0].message)
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) >= 1
    assert all(valid_arguments(name, a) for name, a in calls)
    assert len({c.id for c in r.choices[0].message.tool_calls or []}) == len(calls)


TWO_CALLS = (
    'root ::= call "\\n" call\n'
    'call ::= "<tool_call>\\n{\\"name\\": \\"get_time\\", \\"arguments\\": {\\"zone\\": \\"" '
    '("utc" | "cet") "\\"}}\\n</tool_call>"\n'
)


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_parses_the_calls_the_model_writes(
    hermes: tuple[str, ServerState], parallel: bool
) -> None:
    r = client(hermes[0]).chat.completions.create(
        model="demo",
        messages=ASK,
        tools=TOOLS,
        parallel_tool_calls=parallel,
        extra_body={"grammar": TWO_CALLS},
        **GREEDY,
    )
    calls = calls_of(r.choices[0].message)
    assert len(calls) == (2 if parallel else 1)
    assert all(name == "get_time" and valid_arguments(name, a) for name, a in calls)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None


def test_auto_without_a_call_is_content(hermes: tuple[str, ServerState]) -> None:
    r = client(hermes[0]).chat.completions.create(
        model="demo",
        messages=ASK,
        tools=TOOLS,
        extra_body={"grammar": 'root ::= "No tool needed: " [a-z]{1,20}'},
        **GREEDY,
    )
    msg = r.choices[0].message
    assert msg.tool_calls is None and (msg.content or "").startswith("No tool needed: ")
    assert r.choices[0].finish_reason == "stop"


def test_tool_choice_none_renders_no_tools_and_parses_nothing(
    hermes: tuple[str, ServerState],
) -> None:
    c = client(hermes[0])
    base = c.chat.completions.create(model="demo", messages=ASK, max_tokens=1)
    none = c.chat.completions.create(
        model="demo",
        messages=ASK,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=60,
        temperature=0,
        extra_body={"grammar": TWO_CALLS},
    )
    assert none.usage is not None and base.usage is not None
    assert none.usage.prompt_tokens == base.usage.prompt_tokens  # no tools in the prompt
    msg = none.choices[0].message
    assert msg.tool_calls is None and (msg.content or "").startswith("<tool_call>")


def test_streamed_calls_add_up_to_the_whole_answer(hermes: tuple[str, ServerState]) -> None:
    c = client(hermes[0])
    args: Any = {"model": "demo", "messages": ASK, "tools": TOOLS, "tool_choice": "required"}
    whole = c.chat.completions.create(**args, **GREEDY)
    chunks = list(c.chat.completions.create(**args, **GREEDY, stream=True))
    calls: dict[int, dict[str, str]] = {}
    firsts = []
    for chunk in chunks:
        for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            if tc.index not in calls:
                firsts.append(tc)
                calls[tc.index] = {"id": tc.id or "", "name": "", "arguments": ""}
            else:
                assert tc.id is None and (tc.function is None or tc.function.name is None)
            if tc.function is not None:
                calls[tc.index]["name"] += tc.function.name or ""
                calls[tc.index]["arguments"] += tc.function.arguments or ""
    assert all(f.id and f.type == "function" and f.function and f.function.name for f in firsts)
    streamed = [(v["name"], v["arguments"]) for _, v in sorted(calls.items())]
    assert streamed == calls_of(whole.choices[0].message)
    assert all(valid_arguments(name, a) for name, a in streamed)
    finishes = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finishes[-1] == "tool_calls" == whole.choices[0].finish_reason
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert content == (whole.choices[0].message.content or "")


def test_a_follow_up_renders_the_call_and_its_result(hermes: tuple[str, ServerState]) -> None:
    base, state = hermes
    first = client(base).chat.completions.create(
        model="demo", messages=ASK, tools=TOOLS, tool_choice="required", **GREEDY
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    history: Any = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"},
    ]
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={"messages": history, "tools": TOOLS, "max_tokens": 4, "return_token_ids": True},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["prompt_token_ids"]
    expected, add_bos = ChatTemplate((TEMPLATES / "hermes.jinja").read_text(), "", "").render(
        [history[0], {**history[1], "content": ""}, history[2]], TOOLS
    )
    assert ids == state.engine.tokenize(expected, add_special=add_bos)
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)
    assert f'{{"name": "{call.function.name}", "arguments": {arguments}}}' in expected
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in expected


def test_errors_name_the_field(model: Path, hermes: tuple[str, ServerState]) -> None:
    base = hermes[0]
    body: Any = {"messages": ASK, "tools": TOOLS}
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={**body, "tool_choice": "required", "grammar": "root ::= [a]"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    with live_server(model, ENGINE + SERVER) as (plain, _):  # the demo model's own ChatML
        r = httpx.post(f"{plain}/v1/chat/completions", json=body, timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "tools"
        assert "chat template does not support tools" in err["message"]
        assert "model.chat_template" in err["message"]
        none = httpx.post(
            f"{plain}/v1/chat/completions",
            json={**body, "tool_choice": "none", "max_tokens": 2},
            timeout=60,
        )
        assert none.status_code == 200  # no tools rendered: nothing refused


THINK = 'root ::= "<think>\\n" [a-z ]{1,30} "\\n</think>\\n\\n" [a-z]{1,12}'


def test_reasoning_is_split_from_the_content(model: Path) -> None:
    with live_server(model, profile("qwen3")) as (base, state):
        c = client(base)
        args: Any = {"model": "demo", "messages": ASK, **GREEDY, "extra_body": {"grammar": THINK}}
        r = c.chat.completions.create(**args)
        msg = r.choices[0].message
        reasoning = (msg.model_extra or {}).get("reasoning_content")
        assert reasoning and msg.content and "<think>" not in msg.content
        assert "think>" not in reasoning and reasoning == reasoning.strip()
        chunks = list(c.chat.completions.create(**args, stream=True))
        deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
        streamed = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        assert streamed == reasoning
        assert "".join(d.content or "" for d in deltas) == msg.content
        raw = c.chat.completions.create(
            **{**args, "extra_body": {"grammar": THINK, "reasoning_format": "none"}}
        )
        assert (raw.choices[0].message.content or "").startswith("<think>\n")
        assert "reasoning_content" not in (raw.choices[0].message.model_extra or {})
        # chat_template_kwargs reach the template: Qwen3's switch closes the block itself
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={
                "messages": ASK,
                "max_tokens": 1,
                "return_token_ids": True,
                "chat_template_kwargs": {"enable_thinking": False},
            },
            timeout=60,
        )
        prompt = state.engine.detokenize(r.json()["choices"][0]["prompt_token_ids"])
        assert prompt.endswith("<think>\n\n</think>\n\n")


def test_reasoning_effort_reaches_the_template(model: Path) -> None:
    """OpenAI's reasoning_effort was accepted and logged as unknown: gpt-oss's
    templates read it, so the answer changed nothing it should have."""
    template = (
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
        "effort={{ reasoning_effort | default('unset') }}\n"
    )
    text = f"model:\n  chat_template: |\n{textwrap.indent(template, '    ')}\n{ENGINE}{SERVER}"
    with live_server(model, text) as (base, state):

        def prompt(**extra: Any) -> str:
            body = {"messages": ASK, "max_tokens": 1, "return_token_ids": True, **extra}
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return state.engine.detokenize(r.json()["choices"][0]["prompt_token_ids"])

        assert prompt().endswith("effort=unset")
        assert prompt(reasoning_effort="low").endswith("effort=low")
        kwargs = {"chat_template_kwargs": {"reasoning_effort": "high"}}
        assert prompt(reasoning_effort="low", **kwargs).endswith("effort=high")
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": ASK, "reasoning_effort": "extreme"},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def test_an_answer_that_starts_inside_the_think_block(model: Path) -> None:
    with live_server(model, profile("r1")) as (base, _):
        r = client(base).chat.completions.create(
            model="demo",
            messages=ASK,
            **GREEDY,
            extra_body={"grammar": 'root ::= [a-z ]{1,30} "</think>" [a-z]{1,12}'},
        )
    msg = r.choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content")
    assert msg.content and msg.content.isalpha()


# -- a real model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol() -> Path:
    found = packaged.find(packaged.SMOLLM2)
    if found is None:
        pytest.skip("SmolLM2 is not in the model cache (make test fetches it)")
    return found


def test_smollm2_needs_a_template_with_tools(smol: Path) -> None:
    with live_server(smol, "engine: {n_ctx: 2048, slots: 1}\n") as (base, _):
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    hermes_profile = profile("hermes").replace(ENGINE, "engine: {n_ctx: 2048, slots: 1}\n")
    with live_server(smol, hermes_profile) as (base, _):
        r = client(base).chat.completions.create(
            model="demo",
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            **GREEDY,
        )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert valid_arguments(call.function.name, call.function.arguments)


def test_smollm2_reasoning_is_split_from_the_content(smol: Path) -> None:
    """The real model under a thinking template, its answer held to a think block
    and a word by a grammar: the block is reasoning_content, streamed and whole."""
    thinking = profile("qwen3").replace(ENGINE, "engine: {n_ctx: 2048, slots: 1}\n")
    with live_server(smol, thinking) as (base, _):
        c = client(base)
        args: Any = {"model": "smol", "messages": ASK, **GREEDY, "extra_body": {"grammar": THINK}}
        msg = c.chat.completions.create(**args).choices[0].message
        reasoning = (msg.model_extra or {}).get("reasoning_content")
        assert reasoning and msg.content and msg.content.isalpha()
        chunks = list(c.chat.completions.create(**args, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert (
        "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    )
    assert "".join(d.content or "" for d in deltas) == msg.content


def schema_answer(base: str, schema: Any, **kw: Any) -> Any:
    """The demo model's answer held to ``schema`` (response_format json_schema); it
    ended by itself (not cut at max_tokens)."""
    r = client(base).chat.completions.create(
        model="demo",
        messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        **kw,
    )
    assert r.choices[0].finish_reason == "stop"
    return json.loads(r.choices[0].message.content or "")


def test_strings_of_a_schema_hold_no_raw_control_characters(
    hermes: tuple[str, ServerState],
) -> None:
    """A newline the model would rather write inside a string is escaped or left out:
    the schema's answer and a forced call's arguments stay JSON."""
    base, state = hermes
    newline = state.engine.tokenize("a\n", add_special=False)[-1]
    text = {"type": "string", "maxLength": 8}
    note: Any = {"type": "object", "properties": {"text": text}, "required": ["text"]}
    bias: Any = {"logit_bias": {str(newline): 50}, "temperature": 0, "max_tokens": 120}
    assert isinstance(schema_answer(base, note, **bias)["text"], str)
    r = client(base).chat.completions.create(
        model="demo",
        messages=ASK,
        tools=[{"type": "function", "function": {"name": "note", "parameters": note}}],
        tool_choice="required",
        parallel_tool_calls=False,
        **bias,
    )
    (call,) = r.choices[0].message.tool_calls or []
    assert isinstance(json.loads(call.function.arguments)["text"], str)


TREE: dict[str, Any] = {  # pydantic's schema of a recursive model: a $ref at the root
    "$defs": {
        "Node": {
            "type": "object",
            "properties": {
                "name": {"type": ["string", "null"], "maxLength": 3},
                "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}, "maxItems": 2},
            },
            "required": ["name", "kids"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/Node",
}


@pytest.mark.parametrize("seed", range(3))
def test_a_recursive_schema_with_a_root_ref_is_followed(
    hermes: tuple[str, ServerState], seed: int
) -> None:
    """The $defs beside a root $ref are found: the answer validates against the
    schema."""
    answer = schema_answer(hermes[0], TREE, temperature=1, seed=seed, max_tokens=300)
    jsonschema.validate(answer, TREE)


def test_a_list_of_types_keeps_the_other_keywords(hermes: tuple[str, ServerState]) -> None:
    """``{"type": ["string", "integer"], "maxLength": 3}`` takes a string of 3
    characters at most, even from a model that would rather go on writing."""
    base, state = hermes
    name = {"type": ["string", "integer"], "maxLength": 3}
    schema: Any = {"type": "object", "properties": {"name": name}, "required": ["name"]}
    bias = {str(t): 40 for t in state.engine.tokenize("aaaa", add_special=False)}
    answer = schema_answer(base, schema, logit_bias=bias, temperature=0, max_tokens=60)
    jsonschema.validate(answer, schema)


@pytest.mark.parametrize(
    "pattern",
    [
        r"^\d{3}-\d{4}$",
        r"^[\w.\-]{1,6}@\w{1,6}\.com$",
        r"^\S{1,6}\s\S{1,6}$",
        r"^.{3}$",
        r"^[^a]{3}$",
        r"^(?:ab){2}$",
        r'^a"b$',  # a quote, a backslash or a newline is escaped in the JSON text
        r"^a\\b$",
        r"^a\nb$",
        r'^[a"\\]{3}$',
    ],
)
def test_a_pattern_is_followed_and_its_string_stays_json(
    hermes: tuple[str, ServerState], pattern: str
) -> None:
    """Escapes such as ``\\d`` and ``\\.`` mean what they mean in a regex, and ``.`` or
    a negated class never writes the '"' that would end the JSON string, even for a
    model that would rather write one."""
    base, state = hermes
    schema: Any = {"type": "object", "properties": {"p": {"type": "string", "pattern": pattern}}}
    schema["required"] = ["p"]
    bias = {str(t): 40 for t in state.engine.tokenize('a""', add_special=False)[1:]}
    value = schema_answer(base, schema, logit_bias=bias, temperature=0, max_tokens=80)["p"]
    assert re.fullmatch(pattern, value), value
