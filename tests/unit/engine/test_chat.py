"""Chat templates: what each one supports, and what reaches its prompt."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from orin.engine.chat import THINK_OPEN, ChatTemplate, TemplateCaps, detect_tool_format
from orin.engine.errors import InvalidRequest

TEMPLATES = Path(__file__).parents[2] / "fixtures" / "chat_templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


def template(name: str, bos: str = "<s>", eos: str = "</s>") -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(), bos, eos)


def history(arguments: str = '{"city": "Paris", "note": "naïve \\"q\\""}') -> list[dict[str, Any]]:
    """A user turn, the assistant's call (arguments as OpenAI sends them: a JSON
    string), the tool's result."""
    call = {
        "id": "call0abcd",  # 9 characters, as Mistral's templates insist
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call0abcd", "content": "18 degrees, sunny"},
    ]


@pytest.mark.parametrize(
    ("name", "caps"),
    [
        ("hermes", TemplateCaps(True, True, "hermes", False, False)),
        ("llama31", TemplateCaps(True, True, "llama3", False, False)),
        ("mistral", TemplateCaps(True, True, "mistral", False, False)),
        ("mistral_args", TemplateCaps(True, True, "mistral_args", False, False)),
        ("qwen3", TemplateCaps(True, True, "hermes", True, False)),
        ("r1", TemplateCaps(False, False, None, True, True)),
        ("chatml_no_tools", TemplateCaps(False, False, None, False, False)),
        ("unknown_format", TemplateCaps(True, False, None, False, False)),
    ],
)
def test_capabilities_are_detected_when_the_template_loads(name: str, caps: TemplateCaps) -> None:
    t = template(name)
    assert t.caps == caps
    assert t.caps.supports_tools is (caps.tools and caps.tool_format is not None)


def test_the_format_comes_from_the_markers_the_template_writes() -> None:
    assert detect_tool_format("{{ '<tool_call>' }}") == "hermes"
    assert detect_tool_format("'[TOOL_CALLS][' + calls|tojson") == "mistral"
    assert detect_tool_format("'[TOOL_CALLS]' + name + '[ARGS]' + args") == "mistral_args"
    assert detect_tool_format("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert detect_tool_format("<|im_start|>") is None


@pytest.mark.parametrize("name", ["hermes", "llama31", "mistral", "mistral_args", "qwen3"])
def test_a_history_with_a_call_and_its_result_reaches_the_prompt(name: str) -> None:
    prompt, _ = template(name).render(history(), [WEATHER])
    assert "get_weather" in prompt and "18 degrees, sunny" in prompt
    # the arguments reached the template parsed, so tojson wrote them as an object
    # (a string would have come out escaped: "{\"city\": ...}")
    assert '"city": "Paris"' in prompt and '\\"city\\"' not in prompt
    assert 'naïve \\"q\\"' in prompt  # non-ASCII kept, quotes escaped once, by tojson
    assert prompt.index("Weather in Paris?") < prompt.index("18 degrees, sunny")


def test_tools_are_rendered_with_their_schema() -> None:
    prompt, _ = template("hermes").render([{"role": "user", "content": "hi"}], [WEATHER])
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert json.loads(listed) == WEATHER


def test_arguments_that_are_not_json_stay_a_string() -> None:
    prompt, _ = template("mistral_args").render(history("not json"), [WEATHER])
    assert "[TOOL_CALLS]get_weather[ARGS]not json" in prompt


def test_raise_exception_and_strftime_now_are_available() -> None:
    t = template("llama31")
    prompt, add_bos = t.render([{"role": "user", "content": "hi"}], [WEATHER])
    today = prompt.split("Today Date: ", 1)[1].split("\n", 1)[0]
    assert datetime.strptime(today, "%d %b %Y").year >= 2025  # strftime_now wrote it
    assert "Environment: ipython" in prompt
    assert prompt.startswith("<s>") and add_bos is False  # the template wrote BOS itself
    two = history()
    two[1]["tool_calls"] = two[1]["tool_calls"] * 2
    with pytest.raises(InvalidRequest, match="only supports single tool-calls") as err:
        t.render(two, [WEATHER])
    assert err.value.param == "messages"


def test_reasoning_content_and_chat_template_kwargs_reach_the_template() -> None:
    t = template("qwen3")
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
        {"role": "user", "content": "and 3+3?"},
    ]
    prompt, _ = t.render(messages)
    assert "<think>\ntwo and two\n</think>\n\n4<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    off, _ = t.render(messages, template_kwargs={"enable_thinking": False})
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(InvalidRequest) as err:
        t.render(messages, template_kwargs={"messages": []})
    assert err.value.param == "chat_template_kwargs"


def test_a_generation_prompt_that_opens_think() -> None:
    prompt, _ = template("r1").render([{"role": "user", "content": "hi"}])
    assert prompt.rstrip().endswith(THINK_OPEN)


def test_a_final_message_continued_ends_the_prompt() -> None:
    """continue_final: the prompt stops where the final message's text ends, also when
    the template trims that text, and never after an earlier copy of it."""
    begun = [
        {"role": "user", "content": "Say: yes"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "Again"},
        {"role": "assistant", "content": "yes "},
    ]
    chatml = template("chatml_no_tools")
    prompt, _ = chatml.render(begun, add_generation_prompt=False, continue_final=True)
    assert prompt == (
        "<|im_start|>user\nSay: yes<|im_end|>\n<|im_start|>assistant\nyes<|im_end|>\n"
        "<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\nyes "
    )
    finished, _ = chatml.render(begun, add_generation_prompt=False)
    assert finished == prompt + "<|im_end|>\n"
    trims = ChatTemplate(
        "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}",
        "",
        "",
    )
    prompt, _ = trims.render(begun, add_generation_prompt=False, continue_final=True)
    assert prompt.endswith("</assistant><user>Again</user><assistant>yes")


def test_a_final_message_the_template_does_not_write_cannot_be_continued() -> None:
    t = ChatTemplate("{% for m in messages %}[{{ m.role }}]{% endfor %}", "", "")
    with pytest.raises(InvalidRequest, match="cannot continue it") as err:
        t.render([{"role": "assistant", "content": "yes"}], continue_final=True)
    assert err.value.param == "continue_final_message"


def test_tools_for_a_template_without_them_are_refused_not_dropped() -> None:
    with pytest.raises(InvalidRequest, match="does not support tools") as err:
        template("chatml_no_tools").render([{"role": "user", "content": "hi"}], [WEATHER])
    assert err.value.param == "tools" and "model.chat_template" in str(err.value)
    with pytest.raises(InvalidRequest, match="does not recognise") as err:
        template("unknown_format").render([{"role": "user", "content": "hi"}], [WEATHER])
    assert err.value.param == "tools"
    # without tools the same templates render as before
    prompt, add_bos = template("chatml_no_tools").render([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and add_bos


def test_calls_in_a_history_are_refused_where_they_would_be_lost() -> None:
    for name in ("chatml_no_tools", "unknown_format"):
        with pytest.raises(InvalidRequest, match="does not render the tool calls") as err:
            template(name).render(history())
        assert err.value.param == "messages"


def test_no_template() -> None:
    t = ChatTemplate(None, "<s>", "</s>")
    assert not t.caps.tools and not t.caps.thinking
    with pytest.raises(InvalidRequest, match="no chat template"):
        t.render([{"role": "user", "content": "hi"}])


def test_generation_tags_and_loop_controls_render() -> None:
    source = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}"
    )
    prompt, _ = ChatTemplate(source, "", "").render(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    )
    assert prompt == "u"


def test_the_sandbox_holds() -> None:
    source = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(InvalidRequest, match="rejected"):
        ChatTemplate(source, "", "").render([{"role": "user", "content": "x"}])
