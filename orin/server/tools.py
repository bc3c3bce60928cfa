"""Tool calls and reasoning in a chat answer: the formats, the grammar that forces
a call, and the incremental parser that splits generated text.

A model writes its calls in the format its chat template teaches it
(``orin.engine.chat.ToolFormat``, decided when the template is loaded). For a
request, ``OutputSpec`` says what to look for in the answer: the format's calls
(unless ``tool_choice`` is ``none``), a ``<think>`` block (unless
``reasoning_format`` is ``none``) and whether the prompt already opened it.

``OutputParser`` turns the answer's text, token by token, into parts: content,
reasoning, the start of a call (its id and name) and fragments of its
arguments, the way OpenAI streams them. Text that may still become a marker
(``<tool_call>``, ``[TOOL_CALLS]``, ``</think>``) is held back until it is
decided. A whole answer goes through the same parser, so a streamed answer
adds up to the full one. Call syntax that turns out malformed is content; a
streamed call whose start was already sent stays a call.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Literal

from orin.engine.chat import THINK_CLOSE, THINK_OPEN, TemplateCaps, ToolFormat
from orin.engine.grammar import CallSyntax, Reasoning, tool_call_grammar
from orin.server.protocol import ChatCompletionRequest, NamedToolChoice

# -- formats ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Format:
    """One way of writing tool calls: what starts them in the text, and their
    syntax for the grammar that forces a call."""

    name: ToolFormat
    markers: tuple[str, ...]  # where a call region starts, anywhere in the content
    syntax: CallSyntax
    closers: tuple[str, ...] = ("",)  # what may end a region after its last call
    parallel: bool = True  # whether the grammar may write several calls
    json_at_start: bool = False  # an answer that starts with "{" is a call region too
    id_last: bool = False  # the model writes a call's id after its arguments
    # the ids the server gives calls are 9 alphanumerics: Mistral's templates refuse a
    # history with any other (the turn after a call, sent back with its id, was a 400)
    short_ids: bool = False


HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
PYTHON_TAG = "<|python_tag|>"

FORMATS: dict[ToolFormat, Format] = {
    "hermes": Format(
        "hermes",
        (HERMES_OPEN,),
        CallSyntax(call_open=HERMES_OPEN + "\n", call_close="\n" + HERMES_CLOSE, separator="\n"),
        closers=(HERMES_CLOSE,),
    ),
    # Llama 3.1's template refuses more than one call per message in a history
    "llama3": Format(
        "llama3",
        (PYTHON_TAG,),
        CallSyntax(args_key="parameters", separator="; "),
        closers=(";",),
        parallel=False,
        json_at_start=True,
    ),
    "mistral": Format(
        "mistral",
        (MISTRAL_CALLS,),
        CallSyntax(prefix=MISTRAL_CALLS + "[", suffix="]", separator=", "),
        closers=("]", ","),
        id_last=True,  # a call is sent once complete, with the id Nemo wrote
        short_ids=True,
    ),
    "mistral_args": Format(
        "mistral_args",
        (MISTRAL_CALLS,),
        CallSyntax(call_open=MISTRAL_CALLS, name_args=MISTRAL_ARGS),
        short_ids=True,
    ),
}


@dataclass(frozen=True)
class OutputSpec:
    """What one request's answer is parsed for."""

    format: Format | None = None  # tool calls in this format; None: no tool parsing
    max_calls: int | None = None  # 1 with parallel_tool_calls false
    # the offered tools' names: a call of another function is content, in every format
    # (an answer that starts with "{", as Llama 3.x writes its calls without a marker,
    # may well be JSON such as {"name": "Bob", "age": 30}); None: any name
    names: frozenset[str] | None = None
    reasoning: bool = False  # split a <think> block into reasoning_content
    opens_thinking: bool = False  # the prompt ended inside <think>: so does the answer start
    may_think: bool = False  # the template has a <think> block the prompt did not close

    @property
    def plain(self) -> bool:
        """Nothing to look for: the text is the content, token for token."""
        return self.format is None and not self.reasoning

    def marker_texts(self) -> tuple[str, ...]:
        """The literals the parser looks for: a model whose vocabulary has them as
        control tokens must have them written out (llama-server's preserved tokens),
        or a Mistral model's ``[TOOL_CALLS]`` would vanish from the text."""
        out: list[str] = []
        if self.format is not None:
            syntax = self.format.syntax
            out += [*self.format.markers, *self.format.closers]
            if self.format.id_last:
                out.append(MISTRAL_CALL_ID)
            out += [syntax.name_args or "", syntax.call_open.strip(), syntax.call_close.strip()]
        if self.reasoning:
            out += [THINK_OPEN, THINK_CLOSE]
        return tuple(dict.fromkeys(t for t in out if t))

    def parser(self, eager: bool = True) -> OutputParser:
        """A new parser for one choice: ``eager`` streams a call as soon as its name
        is known; otherwise a call is reported once it is complete and valid."""
        return OutputParser(self, eager)


def output_spec(body: ChatCompletionRequest, caps: TemplateCaps, prompt: str) -> OutputSpec:
    """What to parse ``body``'s answer for, given the template's capabilities and the
    rendered ``prompt``."""
    fmt = None
    if body.offered_tools() is not None and caps.tool_format is not None:
        fmt = FORMATS[caps.tool_format]
    end = prompt.rstrip()
    # a named tool_choice forces exactly one call of that function, as OpenAI's does
    named = isinstance(body.effective_tool_choice(), NamedToolChoice)
    return OutputSpec(
        format=fmt,
        max_calls=1 if named or not body.parallel_tool_calls else None,
        names=frozenset(t.function.name for t in body.tools or []),
        reasoning=caps.thinking and body.reasoning_format != "none",
        opens_thinking=caps.thinking and end.endswith(THINK_OPEN),
        # a generation prompt that closed the block (enable_thinking false) leaves none
        may_think=caps.thinking and not end.endswith(THINK_CLOSE),
    )


def required_grammar(body: ChatCompletionRequest, spec: OutputSpec) -> str | None:
    """The grammar of a required or named ``tool_choice``: one call (or, required with
    parallel calls, one or more) of the tools, in the format's syntax, each call's arguments
    following its function's schema; None when the choice forces nothing."""
    choice = body.effective_tool_choice()
    if choice in ("none", "auto") or spec.format is None:
        return None
    tools = list(enumerate(t.function for t in body.tools or []))  # with their index
    if isinstance(choice, NamedToolChoice):
        tools = [(i, f) for i, f in tools if f.name == choice.function.name]
    reasoning = None
    if spec.may_think:  # the model may think first; it must when the prompt opened the block
        reasoning = Reasoning(THINK_OPEN, THINK_CLOSE, open=spec.opens_thinking)
    return tool_call_grammar(
        [(f.name, f.parameters) for _, f in tools],
        spec.format.syntax,
        parallel=spec.max_calls is None and spec.format.parallel,
        reasoning=reasoning,
        params=[f"tools[{i}].function.parameters" for i, _ in tools],
    )


# -- parts of an answer ----------------------------------------------------------------


@dataclass(frozen=True)
class Text:
    kind: Literal["content", "reasoning"]
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    index: int
    text: str


Part = Text | CallStart | CallArgs


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedOutput:
    content: str
    reasoning: str
    calls: list[ToolCall]


_ALNUM = string.ascii_letters + string.digits


def new_call_id(short: bool = False) -> str:
    """A call's id: ``call_`` and 24 alphanumerics as OpenAI's, or with ``short`` the
    9 alphanumerics Mistral's templates take (and llama-server and vLLM give)."""
    if short:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


# -- JSON scanning ---------------------------------------------------------------------
#
# Calls are found by scanning the text seen so far: a value is complete, incomplete
# (more text may finish it) or malformed. The scan only finds where values end; a
# complete call's arguments are then checked with json.loads.


class _Partial(Exception):
    """The text ends before the value does."""


class _Bad(Exception):
    """The text cannot be this syntax, whatever follows."""


_WS = " \t\r\n"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
# a string JSON accepts: no raw control character, only its own escapes
_JSON_STRING = re.compile(r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"')
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null")
_SCALAR_PREFIX = re.compile(r"-?[0-9.eE+-]*")
_BRACKETS = re.compile(r'["{}\[\]]')
_CLOSER = {"}": "{", "]": "["}
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _string_end(s: str, i: int) -> int:
    m = _STRING.match(s, i)
    if m is None:
        raise _Partial
    if _JSON_STRING.fullmatch(s, i, m.end()) is None:  # an escape or character JSON refuses
        raise _Bad
    return m.end()


def _value_end(s: str, i: int) -> int:
    """The index after the JSON value starting at ``s[i]``."""
    if i >= len(s):
        raise _Partial
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        stack: list[str] = []
        j = i
        while True:
            m = _BRACKETS.search(s, j)
            if m is None:
                raise _Partial
            c, k = m.group(), m.start()
            if c == '"':
                j = _string_end(s, k)
                continue
            if c in "{[":
                stack.append(c)
            elif not stack or _CLOSER[c] != stack.pop():
                raise _Bad
            elif not stack:
                return k + 1
            j = k + 1
    m = _SCALAR.match(s, i)
    if m is not None and m.end() < len(s):
        return m.end()
    rest = s[i:]
    if m is not None or any(w.startswith(rest) for w in ("true", "false", "null")):
        raise _Partial
    if _SCALAR_PREFIX.fullmatch(rest):
        raise _Partial
    raise _Bad


@dataclass
class _Call:
    """One call found in a region of the text (offsets into the region)."""

    start: int
    end: int | None = None  # after the call, once complete
    name: str | None = None
    id: str | None = None  # the id the model wrote (Mistral), if any
    args: str = ""  # the arguments as far as they can be sent yet
    final: str | None = None  # the arguments of a complete, valid call
    bad: bool = False

    @property
    def complete(self) -> bool:
        return self.end is not None


def _scan_object(
    s: str, i: int, args_keys: tuple[str, ...], first_keys: tuple[str, ...] = ()
) -> _Call:
    """A call written as a JSON object ``{"name": …, "<args key>": {…}}`` at ``s[i]``;
    with ``first_keys`` the object's first key must be one of them."""
    call = _Call(i)
    fields: dict[str, tuple[int, int | None]] = {}
    try:
        j = _skip_ws(s, i)
        if j >= len(s):
            raise _Partial
        if s[j] != "{":
            raise _Bad
        j += 1
        while True:
            j = _skip_ws(s, j)
            if j >= len(s):
                raise _Partial
            if s[j] == "}":
                call.end = j + 1
                break
            if s[j] != '"':
                raise _Bad
            k = _string_end(s, j)
            key = json.loads(s[j:k])
            if first_keys and not fields and key not in first_keys:
                raise _Bad
            j = _skip_ws(s, k)
            if j >= len(s):
                raise _Partial
            if s[j] != ":":
                raise _Bad
            j = _skip_ws(s, j + 1)
            fields[key] = (j, None)
            e = _value_end(s, j)
            fields[key] = (j, e)
            j = _skip_ws(s, e)
            if j >= len(s):
                raise _Partial
            if s[j] == ",":
                j += 1
            elif s[j] == "}":
                call.end = j + 1
                break
            else:
                raise _Bad
    except _Partial:
        pass
    except _Bad:
        call.bad = True
        return call
    start, end = fields.get("name", (0, None))
    if end is not None:
        name = json.loads(s[start:end])
        if not isinstance(name, str):
            call.bad = True
            return call
        call.name = name
    elif call.complete:
        call.bad = True  # an object without a name is no call
        return call
    start, end = fields.get("id", (0, None))
    if end is not None and isinstance(ident := json.loads(s[start:end]), str) and ident:
        call.id = ident
    key = next((k for k in args_keys if k in fields), None)
    if key is None:
        if call.complete:
            call.final = call.args = "{}"
        return call
    start, end = fields[key]
    if start < len(s) and s[start] == "{":
        call.args = s[start : len(s) if end is None else end]
    if call.complete:
        assert end is not None
        call.final = _arguments(s[start:end])
        if call.final is None:
            call.bad = True
    return call


def _arguments(raw: str) -> str | None:
    """A call's arguments as JSON text of an object: the object as written, or the
    object a JSON string holds; None when it is neither."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    if isinstance(value, dict):
        return raw
    if isinstance(value, str):
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return value if isinstance(inner, dict) else None
    return None


@dataclass
class _Region:
    """The calls found after a marker: ``end`` where the region ended (the text
    after it is content again), ``bad`` when it turned out not to be calls."""

    calls: list[_Call] = field(default_factory=list)
    end: int | None = None
    bad: bool = False


def _scan_hermes(r: str) -> _Region:
    call = _scan_object(r, 0, ("arguments", "parameters"))
    region = _Region([call])
    if call.bad or call.end is None:
        region.bad = call.bad
        return region
    j = _skip_ws(r, call.end)
    rest = r[j:]
    if rest.startswith(HERMES_CLOSE):
        region.end = j + len(HERMES_CLOSE)
    elif not HERMES_CLOSE.startswith(rest):
        region.end = call.end  # no closing tag: what follows is content
    return region


def _scan_llama3(r: str) -> _Region:
    """Calls separated by ";" or whitespace, each ``{"name": …, "parameters": {…}}``."""
    region = _Region()
    i = 0
    while True:
        call = _scan_object(r, i, ("parameters", "arguments"), first_keys=("name", "type"))
        region.calls.append(call)
        if call.bad or call.end is None:
            region.bad = call.bad
            return region
        j = _skip_ws(r, call.end)
        if j < len(r) and r[j] == ";":
            j = _skip_ws(r, j + 1)
        if j >= len(r):
            return region  # another call may follow
        if r[j] != "{":
            region.end = call.end
            return region
        i = j


def _scan_mistral(r: str) -> _Region:
    """``[{"name": …, "arguments": {…}}, …]`` (or one object without the list)."""
    region = _Region()
    i = _skip_ws(r, 0)
    if i >= len(r):
        return region
    if r[i] == "{":
        call = _scan_object(r, i, ("arguments", "parameters"))
        region.calls.append(call)
        region.bad, region.end = call.bad, call.end
        return region
    if r[i] != "[":
        region.bad = True
        return region
    i += 1
    while True:
        call = _scan_object(r, i, ("arguments", "parameters"))
        region.calls.append(call)
        if call.bad or call.end is None:
            region.bad = call.bad
            return region
        j = _skip_ws(r, call.end)
        if j >= len(r):
            return region
        if r[j] == "]":
            region.end = j + 1
            return region
        if r[j] != ",":
            region.bad = True
            return region
        i = j + 1


def _scan_mistral_args(r: str) -> _Region:
    """``name[ARGS]{…}``, or ``name[CALL_ID]id[ARGS]{…}``."""
    call = _Call(0)
    region = _Region([call])
    p = r.find("[")
    head = r if p < 0 else r[:p]
    if head.strip() and not _NAME.fullmatch(head.strip()):
        region.bad = call.bad = True
        return region
    if p < 0:
        return region
    rest = r[p:]
    if rest.startswith(MISTRAL_CALL_ID):
        q = rest.find(MISTRAL_ARGS)
        if q < 0:
            tail = rest[len(MISTRAL_CALL_ID) :]
            b = tail.find("[")
            if b >= 0 and not MISTRAL_ARGS.startswith(tail[b:]):
                region.bad = call.bad = True
            return region
        args_at = p + q + len(MISTRAL_ARGS)
        call.id = rest[len(MISTRAL_CALL_ID) : q].strip() or None
    elif rest.startswith(MISTRAL_ARGS):
        args_at = p + len(MISTRAL_ARGS)
    else:
        if not (MISTRAL_ARGS.startswith(rest) or MISTRAL_CALL_ID.startswith(rest)):
            region.bad = call.bad = True
        return region
    if not head.strip():
        region.bad = call.bad = True
        return region
    call.name = head.strip()
    i = _skip_ws(r, args_at)
    if i >= len(r):
        return region
    if r[i] != "{":
        region.bad = call.bad = True
        return region
    try:
        end = _value_end(r, i)
    except _Partial:
        call.args = r[i:]
        return region
    except _Bad:
        region.bad = call.bad = True
        return region
    call.args, call.end = r[i:end], end
    call.final = _arguments(call.args)
    call.bad = call.final is None
    region.end = end
    region.bad = call.bad
    return region


_SCANNERS = {
    "hermes": _scan_hermes,
    "llama3": _scan_llama3,
    "mistral": _scan_mistral,
    "mistral_args": _scan_mistral_args,
}


# -- the incremental parser ------------------------------------------------------------


def _held_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that starts one of ``markers``."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if m.startswith(text[len(text) - n :]):
                best = n
                break
    return best


State = Literal["start", "reasoning", "content", "calls"]


class OutputParser:
    """Splits one choice's text into content, reasoning and tool calls, as it is
    generated: ``feed`` each piece of text, then ``finish``; ``result`` is the whole.

    Both return the parts decided by then. A streamed answer and a whole one go
    through the same steps, so their parts add up to the same message.
    """

    def __init__(self, spec: OutputSpec, eager: bool = True) -> None:
        self.spec = spec
        self.eager = eager
        self._buf = ""
        self._state: State = "content"
        if spec.reasoning:
            self._state = "reasoning" if spec.opens_thinking else "start"
        self._strip = self._state == "reasoning"  # whitespace after <think> is dropped
        self._seen_content = False  # any content other than whitespace
        self._marker = ""  # the marker that opened the current call region
        # content after a call keeps a separator: the whitespace before the call, else
        # the whitespace after it ("Sure! <call> done" is "Sure! done", not
        # "Sure!done"); nothing when no content came before the call or none follows
        self._gap = ""  # the whitespace before the current call region
        self._sep = ""  # what the next content starts with
        self._take_ws = False  # the whitespace after a call is the separator
        self._region = ""  # its text since the marker
        # its calls reported, by position in the region: their index in the message,
        # or -1 for one beyond max_calls (parsed and dropped)
        self._sent: dict[int, int] = {}
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    # -- public ----------------------------------------------------------------------

    def feed(self, text: str) -> list[Part]:
        out: list[Part] = []
        self._buf += text
        self._run(out, final=False)
        return out

    def finish(self) -> list[Part]:
        out: list[Part] = []
        self._run(out, final=True)
        return out

    def result(self) -> ParsedOutput:
        return ParsedOutput("".join(self._content), "".join(self._reasoning), list(self.calls))

    # -- states ------------------------------------------------------------------------

    def _run(self, out: list[Part], final: bool) -> None:
        step = {
            "start": self._start,
            "reasoning": self._in_reasoning,
            "content": self._in_content,
            "calls": self._in_calls,
        }
        while step[self._state](out, final):
            pass

    def _emit(self, out: list[Part], kind: Literal["content", "reasoning"], text: str) -> None:
        if not text:
            return
        if kind == "content":
            if self._sep:
                text, self._sep = self._sep + text, ""
            self._content.append(text)
            self._seen_content = self._seen_content or bool(text.strip())
        else:
            self._reasoning.append(text)
        if out and isinstance(out[-1], Text) and out[-1].kind == kind:
            out[-1] = Text(kind, out[-1].text + text)
        else:
            out.append(Text(kind, text))

    def _start(self, out: list[Part], final: bool) -> bool:
        """Before anything: a <think> block may open (after whitespace)."""
        s = self._buf.lstrip()
        if s.startswith(THINK_OPEN):
            self._buf = s[len(THINK_OPEN) :]
            self._state, self._strip = "reasoning", True
            return True
        if THINK_OPEN.startswith(s) and not final:
            return False
        self._state = "content"
        return True

    def _in_reasoning(self, out: list[Part], final: bool) -> bool:
        if self._strip:
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._strip = False
        i = self._buf.find(THINK_CLOSE)
        if i >= 0:
            self._emit(out, "reasoning", self._buf[:i].rstrip())
            self._buf = self._buf[i + len(THINK_CLOSE) :]
            self._state, self._strip = "content", True
            return True
        if final:
            self._emit(out, "reasoning", self._buf.rstrip())
            self._buf = ""
            return False
        cut = len(self._buf) - _held_suffix(self._buf, (THINK_CLOSE,))
        cut = len(self._buf[:cut].rstrip())  # trailing whitespace waits: it may end the block
        self._emit(out, "reasoning", self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _in_content(self, out: list[Part], final: bool) -> bool:
        if self._strip:
            rest = self._buf.lstrip()
            if self._take_ws:
                self._sep += self._buf[: len(self._buf) - len(rest)]
            self._buf = rest
            if not self._buf:
                return False
            self._strip = self._take_ws = False
        fmt = self.spec.format
        if fmt is None:
            self._emit(out, "content", self._buf)
            self._buf = ""
            return False
        if fmt.json_at_start and not self._seen_content:
            s = self._buf.lstrip()
            if not s and not final:
                return False
            if s.startswith("{"):
                return self._open_region(self._buf[: len(self._buf) - len(s)], s)
        hits = [(i, m) for m in fmt.markers if (i := self._buf.find(m)) >= 0]
        if hits:
            i, marker = min(hits)
            before = self._buf[:i]
            content = before.rstrip()
            self._emit(out, "content", content)
            self._gap = before[len(content) :]
            return self._open_region(self._gap + marker, self._buf[i + len(marker) :])
        if final:
            self._emit(out, "content", self._buf)
            self._buf = ""
            return False
        cut = len(self._buf) - _held_suffix(self._buf, fmt.markers)
        cut = len(self._buf[:cut].rstrip())  # whitespace before a call is not content
        self._emit(out, "content", self._buf[:cut])
        self._buf = self._buf[cut:]
        return False

    def _open_region(self, opening: str, text: str) -> bool:
        """Parse ``text`` as calls; ``opening`` (the marker and the whitespace before
        it, or only the whitespace before an answer's opening JSON) is content again
        if they turn out not to be."""
        self._marker, self._region, self._buf = opening, text, ""
        self._sent = {}
        self._state = "calls"
        return True

    def _in_calls(self, out: list[Part], final: bool) -> bool:
        fmt = self.spec.format
        assert fmt is not None
        self._region += self._buf
        self._buf = ""
        region = _SCANNERS[fmt.name](self._region)
        names = self.spec.names
        if names is not None:  # a call of no offered tool is text the client can read
            for call in region.calls:
                if call.name is not None and call.name not in names:
                    call.bad = region.bad = True
        self._report(out, region.calls)
        if region.end is not None and not region.bad:
            self._buf = self._region[region.end :]
            if self._seen_content and not self._sep:
                self._sep = self._gap
                self._take_ws = not self._gap
            self._close_region(strip=True)
            return True
        if region.bad or final:
            self._roll_back(out, region.calls)
            return True
        return False

    def _report(self, out: list[Part], calls: list[_Call]) -> None:
        """Start the calls that can be reported and send their new argument text."""
        fmt = self.spec.format
        assert fmt is not None
        for k, call in enumerate(calls):
            index = self._sent.get(k)
            if index is None:
                ready = call.name is not None and not call.bad
                if not self.eager or fmt.id_last:
                    ready = ready and call.final is not None
                if not ready:
                    continue
                assert call.name is not None
                if self.spec.max_calls is not None and len(self.calls) >= self.spec.max_calls:
                    self._sent[k] = -1
                    continue
                started = ToolCall(call.id or new_call_id(fmt.short_ids), call.name, "")
                self._sent[k] = index = len(self.calls)
                self.calls.append(started)
                out.append(CallStart(index, started.id, started.name))
            if index < 0:
                continue
            text = call.final if call.final is not None else call.args
            tc = self.calls[index]
            if call.bad or len(text) <= len(tc.arguments) or not text.startswith(tc.arguments):
                continue
            new = text[len(tc.arguments) :]
            tc.arguments = text
            if out and isinstance(out[-1], CallArgs) and out[-1].index == index:
                out[-1] = CallArgs(index, out[-1].text + new)
            else:
                out.append(CallArgs(index, new))

    def _roll_back(self, out: list[Part], calls: list[_Call]) -> None:
        """The region is malformed or the text ended inside it: the calls reported
        stay, the text from the first call that was not is content again."""
        keep = 0  # region text that belongs to reported calls
        for k, call in enumerate(calls):
            if k not in self._sent:
                break
            keep = call.end if call.end is not None else len(self._region)
        rest = self._region[keep:]
        if keep == 0:
            self._emit(out, "content", self._marker)
            self._seen_content = True  # an answer that starts with "{" but is no call
        elif any(c.startswith(rest.strip()) for c in self._closers()):
            rest = ""  # whitespace or the start of a region's closing: syntax, not content
        self._buf = rest  # parsed again: a later marker may start a good call
        self._close_region(strip=False)

    def _closers(self) -> tuple[str, ...]:
        fmt = self.spec.format
        return fmt.closers if fmt is not None else ()

    def _close_region(self, strip: bool) -> None:
        self._marker, self._region, self._sent, self._gap = "", "", {}, ""
        self._state, self._strip = "content", strip
