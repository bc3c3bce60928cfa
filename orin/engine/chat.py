"""Chat messages -> prompt text, with the model's own Jinja chat template.

The template is rendered the way Hugging Face's transformers and llama.cpp's
Jinja path render it: a sandboxed Jinja2 environment with ``messages``,
``tools``, ``add_generation_prompt``, ``bos_token``, ``eos_token``,
``raise_exception`` and ``strftime_now``, plus the request's
``chat_template_kwargs`` (``enable_thinking`` for Qwen3). A tool call's
``arguments`` arrive as a JSON string, as OpenAI sends them, and reach the
template parsed, since templates write them with ``tojson``.

What a template can do is decided once, when it is loaded (``TemplateCaps``):
whether it renders a tools list (a probe tool's name appears in a probe
conversation, as llama.cpp's minja detects it), whether it renders the tool
calls of an assistant message, the format the model writes its calls in, and
whether it has a ``<think>`` block.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from orin.engine.errors import InvalidRequest

ToolFormat = Literal["hermes", "llama3", "mistral", "mistral_args"]
"""How a model writes its tool calls:

- ``hermes``: ``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` (Hermes 2 Pro,
  Qwen 2.5 and 3)
- ``llama3``: ``{"name": …, "parameters": {…}}``, optionally after ``<|python_tag|>``
  (Llama 3.1, 3.2, 3.3)
- ``mistral``: ``[TOOL_CALLS][{"name": …, "arguments": {…}}]`` (Mistral 7B v0.3, Nemo)
- ``mistral_args``: ``[TOOL_CALLS]name[ARGS]{…}`` (Mistral Small 3.2, Magistral,
  Devstral, Ministral 3; ``[CALL_ID]id`` may sit between the name and ``[ARGS]``)
"""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

RESERVED = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
    | {"raise_exception", "strftime_now"}
)
"""Names the server passes to every template; ``chat_template_kwargs`` may not
replace them."""

_PROBE_TOOL = "orin_probe_tool"
_PROBE_CALL = "orin_probe_call"


@dataclass(frozen=True)
class TemplateCaps:
    """What a chat template supports, decided once when it is loaded."""

    tools: bool  # renders the request's tools (the probe tool's name appears)
    tool_calls: bool  # renders the tool calls of an assistant message in a history
    tool_format: ToolFormat | None  # how the model writes calls; None: not recognised
    thinking: bool  # has a <think> block (Qwen3, DeepSeek-R1 distills)
    opens_thinking: bool  # its generation prompt opens <think> itself

    @property
    def supports_tools(self) -> bool:
        """Tools can be offered: rendered, and the model's calls can be parsed."""
        return self.tools and self.tool_format is not None


NO_CAPS = TemplateCaps(False, False, None, False, False)


class RenderedChat(NamedTuple):
    prompt: str
    add_bos: bool  # whether tokenizing should still add BOS


class _IgnoreGeneration(jinja2.ext.Extension):
    """Hugging Face's ``{% generation %}`` tag (it marks assistant text for
    training masks) renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain set)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' ``tojson``: no HTML escaping, non-ASCII kept."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        loader=jinja2.BaseLoader(),
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_IgnoreGeneration, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as templates expect them: each tool call's ``arguments`` parsed from
    its JSON string (a string that is not JSON stays a string)."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_parsed_call(c) for c in calls]}
        out.append(m)
    return out


def _parsed_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": args}}


def _up_to_final_text(prompt: str, text: Any) -> str:
    """The rendered prompt up to the end of the final message's ``text``: as given, or
    without its surrounding whitespace, which many templates trim."""
    if isinstance(text, str):
        for needle in (text, text.strip()):
            at = prompt.rfind(needle) if needle else -1
            if at >= 0:
                return prompt[: at + len(needle)]
    raise InvalidRequest(
        "continue_final_message",
        "the chat template does not write the final message's text as it was given, "
        "so the answer cannot continue it",
    )


class ChatTemplate:
    """Renders messages with the GGUF metadata's template (or the profile's override)
    in a sandboxed Jinja2 environment; ``caps`` says what the template supports."""

    def __init__(self, template: str | None, bos_token: str, eos_token: str) -> None:
        self.template = template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._compiled: jinja2.Template | None = None
        self.caps = NO_CAPS
        if template:
            # a template that does not compile raises here, which fails the model's load
            self._compiled = _environment().from_string(template)
            self.caps = self._detect(template)

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final: bool = False,
    ) -> RenderedChat:
        """(prompt, whether the tokenizer should still add BOS). InvalidRequest when
        there is no template, tools are given to a template that cannot take them, a
        message's tool calls would not be rendered, or the template rejects the
        messages.

        ``continue_final``: the prompt ends with the final message's text, so that the
        answer continues it (an assistant's answer begun by the client): whatever the
        template writes after that text (the end of the turn) is cut off, the end of
        the last place the text appears in the rendered prompt."""
        if self._compiled is None:
            raise InvalidRequest(
                "messages",
                "this model has no chat template; use /v1/completions or set "
                "model.chat_template in the profile",
            )
        if tools and not self.caps.supports_tools:
            raise InvalidRequest("tools", self._no_tools_reason())
        if not self.caps.tool_calls and any(m.get("tool_calls") for m in messages):
            raise InvalidRequest(
                "messages",
                "the model's chat template does not render the tool calls of an assistant "
                "message, so they would be lost from the prompt; set model.chat_template in "
                "the profile to a template that renders them",
            )
        extra = dict(template_kwargs or {})
        clash = sorted(RESERVED & extra.keys())
        if clash:
            raise InvalidRequest(
                "chat_template_kwargs", f"{', '.join(clash)} cannot be set through it"
            )
        try:
            prompt = self._render(template_messages(messages), tools, add_generation_prompt, extra)
        except Exception as exc:  # the template may raise on messages it does not accept
            raise InvalidRequest("messages", f"the chat template rejected them: {exc}") from exc
        if continue_final:
            prompt = _up_to_final_text(prompt, messages[-1].get("content"))
        # a template that writes the BOS token itself must not get a second one
        return RenderedChat(prompt, not (self.bos_token and prompt.startswith(self.bos_token)))

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        extra: dict[str, Any],
    ) -> str:
        assert self._compiled is not None
        return self._compiled.render(
            **extra,
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def _no_tools_reason(self) -> str:
        if not self.caps.tools:
            return (
                "tool calling is not available: the model's chat template does not support "
                "tools; set model.chat_template in the profile to a template that renders them"
            )
        return (
            "tool calling is not available: the model's chat template renders tools, but "
            "in a tool-call format this server "
            "does not recognise (Hermes <tool_call>, Llama 3.x JSON, Mistral [TOOL_CALLS]); "
            "set model.chat_template in the profile to a template in one of them"
        )

    # -- capabilities ---------------------------------------------------------------

    def _detect(self, source: str) -> TemplateCaps:
        tools = self._probe_tools()
        fmt = detect_tool_format(source) if tools else None
        thinking = THINK_OPEN in source
        opens = False
        if thinking:
            try:
                probe = self._render([{"role": "user", "content": "x"}], None, True, {})
                opens = probe.rstrip().endswith(THINK_OPEN)
            except Exception:  # a template that needs more than a user turn
                opens = False
        return TemplateCaps(tools, tools and self._probe_calls(), fmt, thinking, opens)

    def _probe_tools(self) -> bool:
        try:
            text = self._render([{"role": "user", "content": "Hey"}], [_probe_tool()], True, {})
        except Exception:
            return False
        return _PROBE_TOOL in text

    def _probe_calls(self) -> bool:
        call = {
            "id": "call00001",  # 9 alphanumerics: what Mistral's templates insist on
            "type": "function",
            "function": {"name": _PROBE_CALL, "arguments": {"arg": "x"}},
        }
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": "Hey"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call00001", "content": "ok"},
        ]
        try:
            return _PROBE_CALL in self._render(messages, [_probe_tool()], False, {})
        except Exception:
            return False


def _probe_tool() -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": _PROBE_TOOL,
            "description": "A probe.",
            "parameters": {
                "type": "object",
                "properties": {"arg": {"type": "string", "description": "An argument."}},
                "required": ["arg"],
            },
        },
    }


def detect_tool_format(source: str) -> ToolFormat | None:
    """The call format a template's source shows, from the markers it writes."""
    if "[TOOL_CALLS]" in source:
        return "mistral_args" if "[ARGS]" in source else "mistral"
    if "<tool_call>" in source:
        return "hermes"
    if "<|start_header_id|>" in source and ("ipython" in source or "<|python_tag|>" in source):
        return "llama3"
    return None
