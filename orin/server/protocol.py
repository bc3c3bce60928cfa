"""Every wire model of the OpenAI-compatible API, and their conversion to engine terms.

Requests are lenient (unknown OpenAI fields are accepted and logged, never an
error), but every known field must have its JSON type and is bounded by the
table in ``orin.params`` (the one the profile schema and the engine use), and
each request owns its conversion to ``SamplingParams``. The response shapes are
typed dicts, built by the formatters in ``responses.py``.
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypedDict, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from orin import params
from orin.engine import grammar
from orin.engine.errors import ContextLengthExceeded, InvalidRequest
from orin.engine.scheduler import ContextPolicy
from orin.engine.stream import Completion
from orin.engine.types import FinishReason, RequestTimings, SamplingParams, TokenLogprob
from orin.engine.vision import MEDIA_MARKER
from orin.profile.schema import SamplingSection

log = logging.getLogger("orin.server")


# other servers' (or the other endpoint's) fields: the value that changes nothing,
# and why another one is refused
Refused = dict[str, tuple[Callable[[Any], bool], str]]


class _Lenient(BaseModel):
    # lenient about fields, strict about types: an unknown field is accepted and
    # logged, a known one must have its JSON type ("2" is no integer, "yes" no boolean;
    # an integer is a number), as OpenAI's API refuses them
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI's API takes null for any optional parameter: a null where this server
        has a default other than null means that default (``n``, ``stream``, ``echo``,
        ``stream_options.include_usage``, an embedding's ``encoding_format``...)."""
        if isinstance(data, dict) and None in data.values():
            defaulted: set[str] = set()
            for name, f in cls.model_fields.items():
                if not f.is_required() and f.default is not None:
                    defaulted |= {name, f.alias or name}
            return {k: v for k, v in data.items() if v is not None or k not in defaulted}
        return data

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())

    def refuse_fields(self, table: Refused, said: str) -> None:
        """A field of ``table`` (unknown to this model, so among its extras) given with
        a value other than the one that changes nothing is a 400 naming it: "NAME is
        ``said``: why"; never ignored."""
        extra = self.model_extra or {}
        for name, (neutral, why) in table.items():
            value = extra.get(name)
            if value is not None and not neutral(value):
                raise InvalidRequest(name, f"{name} is {said}: {why}")


class StreamOptions(_Lenient):
    include_usage: bool = False


class JsonSchemaFormat(_Lenient):
    name: str = "schema"
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None
    # llama.cpp's form: {"type": "json_object", "schema": {...}}
    schema_: dict[str, Any] | None = Field(None, alias="schema")

    @field_validator("json_schema", "schema_")
    @classmethod
    def _schema_of_its_type(cls, schema: Any, info: ValidationInfo) -> Any:
        """A schema beside a type that does not read it would be ignored, and the
        answer not held to it: ``json_schema`` goes with ``json_schema``, llama.cpp's
        ``schema`` with ``json_object``."""
        kind = info.data.get("type")
        wants = "json_schema" if info.field_name == "json_schema" else "json_object"
        if schema is not None and kind is not None and kind != wants:
            name = "json_schema" if wants == "json_schema" else "schema"
            raise ValueError(f"a {name} is read with type {wants!r}, not with {kind!r}")
        return schema


class TextPart(_Lenient):
    type: Literal["text"] = "text"
    text: str


class RefusalPart(_Lenient):
    """An assistant's refusal in a conversation's history (OpenAI's part of that type,
    which its answers carry): the template renders it as the assistant's text."""

    type: Literal["refusal"]
    refusal: str


class ImageURL(_Lenient):
    url: str = Field(..., min_length=1)
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the projector decides


class ImagePart(_Lenient):
    """An image in a message (OpenAI's shape): a data: URL, or an http(s) URL of a
    host the profile lists (orin/server/images.py)."""

    type: Literal["image_url"]
    image_url: ImageURL | str  # some clients send the URL itself

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


def _part_kind(part: Any) -> str | None:
    """Which model a content part is, by its `type` (a part without one is text)."""
    kind = part.get("type", "text") if isinstance(part, dict) else getattr(part, "type", None)
    tags = {"text": "TextPart", "image_url": "ImagePart", "refusal": "RefusalPart"}
    return tags.get(kind) if isinstance(kind, str) else None


# a part of another type (OpenAI's input_audio, file) is refused by its own error, not
# by the complaints of every member of the union
ContentPart = Annotated[
    Annotated[TextPart, Tag("TextPart")]
    | Annotated[ImagePart, Tag("ImagePart")]
    | Annotated[RefusalPart, Tag("RefusalPart")],
    Discriminator(
        _part_kind,
        custom_error_type="invalid_content_part",
        custom_error_message="a content part's type must be 'text' or 'image_url' "
        "('refusal' in an assistant's message; parts of other types, such as audio "
        "and files, are not supported)",
    ),
]


class CalledFunction(_Lenient):
    name: str
    # a JSON string, as OpenAI sends it; an object is accepted and written as one
    arguments: str | dict[str, Any] = ""

    def arguments_json(self) -> str:
        a = self.arguments
        return a if isinstance(a, str) else json.dumps(a, ensure_ascii=False)


class ToolCallIn(_Lenient):
    """A call an assistant message made, in a conversation's history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


def _missing(message: str) -> PydanticCustomError:
    """A required field left out (or null), as pydantic's own ``missing`` error: the
    400's code is OpenAI's ``missing_required_parameter``, not ``invalid_value``."""
    return PydanticCustomError("missing", message)


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # checked when left out too: only an assistant's may be null (it may only call tools)
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant
    # tool: the id of the call it answers; checked when left out too
    tool_call_id: str | None = Field(None, validate_default=True)
    reasoning_content: str | None = None  # assistant: its thinking, for templates that show it
    refusal: str | None = None  # assistant: an answer OpenAI refused, rendered as its text

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any, info: ValidationInfo) -> Any:
        """OpenAI's rule: every message but an assistant's has content; a user message
        without it would be served as if the user had said nothing."""
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise _missing(f"a {role} message needs content (a string or a list of parts)")
        if role not in (None, "assistant") and isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, RefusalPart):  # OpenAI's rule: the assistant's alone
                    raise PydanticCustomError(
                        "invalid_content_part",
                        "a refusal part is the assistant's; content[{j}] of a {role} "
                        "message is one",
                        {"j": j, "role": role},
                    )
        return content

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, call_id: str | None, info: ValidationInfo) -> str | None:
        """OpenAI's rule: a tool message says which call it answers; without it the
        template would render an answer to no call."""
        if call_id is None and info.data.get("role") == "tool":
            raise _missing("a tool message needs tool_call_id, the id of the call it answers")
        return call_id

    def text(self) -> str:
        if isinstance(self.content, list):  # an image is a marker where its rows go
            return "".join(_part_text(p) for p in self.content)
        if self.content is None and self.refusal is not None:
            return self.refusal  # an answer OpenAI refused: what the assistant said
        return self.content or ""

    def images(self) -> list[tuple[int, ImagePart]]:
        """The image parts, each with its index in ``content``."""
        if not isinstance(self.content, list):
            return []
        return [(j, p) for j, p in enumerate(self.content) if isinstance(p, ImagePart)]

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: content as one string, and the
        tool fields only when set (templates test them with ``is defined``)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id or "",
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments_json()},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


def _part_text(part: TextPart | ImagePart | RefusalPart) -> str:
    if isinstance(part, TextPart):
        return part.text
    return part.refusal if isinstance(part, RefusalPart) else MEDIA_MARKER


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class FunctionDef(_Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of an object; none: no arguments
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if not _TOOL_NAME.match(name):
            raise ValueError(
                f"function name {name!r} must be 1 to 64 letters, digits, underscores or dashes"
            )
        return name

    @field_validator("parameters")
    @classmethod
    def _schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is None:
            return None
        kind = schema.get("type", "object")
        if kind != "object":
            raise ValueError(f"parameters must be a JSON schema of an object, not of {kind!r}")
        props = schema.get("properties", {})
        if not isinstance(props, dict) or not all(isinstance(v, dict) for v in props.values()):
            raise ValueError("parameters.properties must map each name to a JSON schema")
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise ValueError("parameters.required must be a list of property names")
        return schema


class ToolDef(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# OpenAI's rule: tool_choice and parallel_tool_calls set without tools are refused,
# as a request that meant to offer tools but lost them on the way
TOOLS_NEEDED = "{} is only allowed when tools are specified"


def _without_tools(info: ValidationInfo) -> bool:
    """Whether the request left tools out (not: gave tools that were refused)."""
    return "tools" in info.data and not info.data["tools"]


STREAM_OPTIONS_WITHOUT_STREAM = (
    "The 'stream_options' parameter is only allowed when 'stream' is enabled."
)


def _optional(p: params.Param[Any]) -> Any:
    """A request field bounded by the table's ``p``; left out, the profile's
    default (or the table's) applies."""
    return Field(None, ge=p.ge, gt=p.gt, le=p.le, description=p.description)


class _Common(_Lenient):
    """Fields shared by chat and text completions (OpenAI's, plus llama.cpp's)."""

    model: str | None = Field(None, description="Must name the served model when given.")
    temperature: float | None = _optional(params.TEMPERATURE)
    top_p: float | None = _optional(params.TOP_P)
    top_k: int | None = _optional(params.TOP_K)
    min_p: float | None = _optional(params.MIN_P)
    repeat_penalty: float | None = _optional(params.REPEAT_PENALTY)
    presence_penalty: float | None = _optional(params.PRESENCE_PENALTY)
    frequency_penalty: float | None = _optional(params.FREQUENCY_PENALTY)
    seed: int | None = Field(
        None,
        ge=params.RANDOM_SEED,
        le=params.REQUEST_SEED_MAX,
        description="Sampling seed; none = the profile's sampling.seed. -1 is llama-server's "
        "'a random seed': one for this request, whatever the profile's. Any seed up to "
        "2^64-1 is taken; one above 4294967294 (llama.cpp's largest) samples as the seed "
        "modulo 4294967295.",
    )
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(
        1,
        ge=1,
        le=params.MAX_CHOICES,
        description="Choices to generate; they share the prompt's cells (one prefill).",
    )
    stream: bool = False
    stream_options: StreamOptions | None = None  # only with stream (_stream_options)
    logit_bias: dict[str, float] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    grammar: str | None = Field(None, description="A GBNF grammar constraining the output.")
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | None = Field(
        None, description="llama.cpp's form: JSON following this schema."
    )
    penalty_last_n: int | None = _optional(params.PENALTY_LAST_N)
    repeat_last_n: int | None = _optional(params.PENALTY_LAST_N)  # llama.cpp's name
    n_predict: int | None = Field(
        None,
        ge=-1,
        description="llama.cpp's name for max_tokens; -1: the profile's sampling.max_tokens; "
        "0: the prompt is computed (and cached) and nothing is generated.",
    )

    @field_validator("stream_options")
    @classmethod
    def _stream_options(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        """OpenAI refuses stream_options on an answer that is not streamed (null is
        fine: it means the default)."""
        if options is not None and not info.data.get("stream"):
            raise ValueError(STREAM_OPTIONS_WITHOUT_STREAM)
        return options

    def refuse_unsupported(self) -> None:
        """A field that would change the output but is not implemented is a 400 naming
        it, never ignored (unknown fields that cannot change the output are logged)."""
        self.refuse_fields(UNSUPPORTED, "not supported by this server")
        self.refuse_fields(self.OTHER_ENDPOINT, "not a field of this endpoint")
        extra = self.model_extra or {}
        best_of = extra.get("best_of")
        if best_of is not None and best_of != getattr(self, "n", 1):
            raise InvalidRequest("best_of", "best_of is not supported; it may only equal n")
        modalities = extra.get("modalities")
        if modalities is not None and not (
            isinstance(modalities, list) and all(m == "text" for m in modalities)
        ):
            raise InvalidRequest(
                "modalities", 'this server answers with text only: give ["text"] or leave it out'
            )

    # the other endpoint's fields that change its output, sent here by mistake (a
    # client that moved between chat and completions): refused, never ignored
    OTHER_ENDPOINT: ClassVar[Refused] = {}

    def max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def length_field(self) -> str:
        """The name of the length field the request set (for an error's ``param``)."""
        return "max_tokens" if self.n_predict is None else "n_predict"

    def top_n_logprobs(self) -> int | None:
        raise NotImplementedError

    def choice_params(
        self,
        defaults: SamplingSection,
        cap: int,
        preserve: tuple[int, ...] = (),
        *,
        prompt_tokens: int | None = None,
        context: ContextPolicy | None = None,
    ) -> list[SamplingParams]:
        """One SamplingParams per choice: with a seed, choice i samples with seed + i,
        so the choices differ and the same request gives the same answer again.
        ``preserve``: control tokens to write out as text; ``prompt_tokens`` and
        ``context`` (the slot's) for the length rule (``answer_length``)."""
        base = self.to_sampling(defaults, cap, prompt_tokens, context)
        if preserve:
            base = dataclasses.replace(base, preserve=preserve)
        if self.n == 1 or base.seed is None:
            return [base] * self.n
        top = params.SEED.hi
        return [
            dataclasses.replace(base, seed=int((base.seed + i) % (top + 1))) for i in range(self.n)
        ]

    def to_sampling(
        self,
        defaults: SamplingSection,
        cap: int,
        prompt_tokens: int | None = None,
        context: ContextPolicy | None = None,
    ) -> SamplingParams:
        """Engine parameters; the profile supplies what the request leaves out
        (``max_tokens`` too, on both endpoints), and ``answer_length`` checks the
        length against ``cap`` (server.max_tokens_limit) and the context."""
        requested = self.max_new_tokens()
        if requested is None and self.n_predict is not None and self.n_predict >= 0:
            # 0: llama-server's prompt-only request (the prompt is computed and left in
            # the slot's cells, nothing is generated), on either endpoint
            requested = self.n_predict
        last_n = _pick(self.penalty_last_n, self.repeat_last_n)
        grammar_text, grammar_field = self._grammar()
        return SamplingParams(
            max_tokens=answer_length(
                requested,
                self.length_field(),
                defaults.max_tokens,
                cap,
                prompt_tokens,
                context,
            ),
            temperature=_pick(self.temperature, defaults.temperature),
            top_k=_pick(self.top_k, defaults.top_k),
            top_p=_pick(self.top_p, defaults.top_p),
            min_p=_pick(self.min_p, defaults.min_p),
            repeat_penalty=_pick(self.repeat_penalty, defaults.repeat_penalty),
            presence_penalty=_pick(self.presence_penalty, params.PRESENCE_PENALTY.default),
            frequency_penalty=_pick(self.frequency_penalty, params.FREQUENCY_PENALTY.default),
            penalty_last_n=_pick(last_n, params.PENALTY_LAST_N.default),
            seed=self._seed(defaults.seed),
            logit_bias=_logit_bias(self.logit_bias),
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            grammar=grammar_text,
            grammar_field=grammar_field,
            logprobs=self.top_n_logprobs(),
            prompt_logprobs=self.scores_prompt(),
        )

    def _seed(self, default: int | None) -> int | None:
        """The request's seed, else the profile's; -1 is a random one (None), even
        where the profile fixes a seed, so each call and each choice differ."""
        if self.seed is None:
            return default
        return None if self.seed == params.RANDOM_SEED else params.llama_seed(self.seed)

    def scores_prompt(self) -> bool:
        """Whether the answer carries the prompt tokens' log-probabilities."""
        return False

    def _grammar(self) -> tuple[str | None, str]:
        """The one grammar of ``grammar``, ``json_schema`` and ``response_format``
        (OpenAI's and llama.cpp's forms), and the field it came from, which an error
        about it names; more than one of them is a 400."""
        fmt = self.response_format
        given = [
            name
            for name, on in (
                ("grammar", bool(self.grammar)),
                ("json_schema", self.json_schema is not None),
                ("response_format", fmt is not None and fmt.type != "text"),
            )
            if on
        ]
        if len(given) > 1:
            raise InvalidRequest(given[1], f"give only one of {' and '.join(given)}")
        if self.json_schema is not None:
            return _schema_grammar(self.json_schema, "json_schema")
        if fmt is None or fmt.type == "text":
            return self.grammar, "grammar"
        if fmt.type == "json_object":
            if fmt.schema_:
                return _schema_grammar(fmt.schema_, "response_format.schema")
            return grammar.json_grammar(), "response_format"
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else {}
        return _schema_grammar(schema, "response_format.json_schema.schema")


def _schema_grammar(schema: Any, field: str) -> tuple[str, str]:
    """A JSON schema's grammar, and the field it came from (which its errors name)."""
    return grammar.json_schema_grammar(schema, field), field


# Fields of OpenAI's, llama.cpp's or vLLM's APIs that change the output and that this
# server does not implement: a request setting one is refused (with why), not served
# as if it had not asked. A value that leaves the feature off is accepted (clients
# such as llama.cpp front ends send every sampler with its neutral value), and the
# settings of a feature (mirostat_tau, dry_base, ...) matter only when it is on.
_SAMPLER = "this sampler is not available here (docs/server.md lists the sampling parameters)"
_OUR_ORDER = ["penalties", "top_k", "top_p", "min_p", "temperature"]


def _neutral_samplers(value: Any) -> bool:
    """llama.cpp's ``samplers`` order, when it runs this server's samplers in the
    order this server runs them (the others named are off or refused on their own)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return False
    return [v for v in value if v in _OUR_ORDER] == _OUR_ORDER


UNSUPPORTED: Refused = {
    "mirostat": (lambda v: v == 0, _SAMPLER),
    "mirostat_mode": (lambda v: v == 0, _SAMPLER),  # llama-cpp-python's server's name
    "typical_p": (lambda v: v == 1, _SAMPLER),
    "tfs_z": (lambda v: v == 1, _SAMPLER),
    "dynatemp_range": (lambda v: v == 0, _SAMPLER),
    "xtc_probability": (lambda v: v == 0, _SAMPLER),
    "dry_multiplier": (lambda v: v == 0, _SAMPLER),
    "top_n_sigma": (lambda v: isinstance(v, (int, float)) and v <= 0, _SAMPLER),
    "samplers": (_neutral_samplers, "the samplers run in a fixed order: " + ", ".join(_OUR_ORDER)),
    "min_keep": (lambda v: v in (0, 1), _SAMPLER),
    "min_tokens": (lambda v: v == 0, "a minimum length is not implemented"),
    "repetition_penalty": (lambda v: v == 1, "use repeat_penalty"),  # vLLM's and TGI's name
    "include_stop_str_in_output": (
        lambda v: v is False,
        "the stop string that ends an answer is never part of its text",
    ),
    "skip_special_tokens": (lambda v: v is True, "control tokens are not written as text"),
    "truncate_prompt_tokens": (
        lambda v: False,
        "a prompt longer than the window is refused or cut as the profile's context.overflow says",
    ),
    "t_max_predict_ms": (
        lambda v: isinstance(v, (int, float)) and v <= 0,
        "a time limit on the answer is not implemented; use max_tokens",
    ),
    "logit_bias_type": (
        lambda v: v == "input_ids",
        "logit_bias keys are token ids (/tokenize gives a text's ids)",
    ),
    "use_beam_search": (lambda v: v is False, "beam search is not implemented"),
    "bad_words": (lambda v: not v, "use logit_bias"),
    "allowed_token_ids": (lambda v: not v, "use logit_bias"),
    **{
        name: ((lambda v: not v), "use response_format, json_schema or grammar")
        for name in (
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "structured_outputs",
        )
    },
    "functions": (lambda v: not v, "use tools"),
    "function_call": (lambda v: not v, "use tool_choice"),
    "n_probs": (lambda v: not v, "use logprobs"),
    "prompt_logprobs": (
        lambda v: not v,
        "vLLM's form is not offered; /v1/completions with echo and logprobs gives a "
        "prompt's log-probabilities",
    ),
    "suffix": (lambda v: not v, "fill-in-the-middle is not implemented"),
    "audio": (lambda v: not v, "audio output is not implemented"),
    "web_search_options": (lambda v: not v, "web search is not available"),
    "lora": (lambda v: not v, "LoRA adapters are not loaded by this server"),
    "return_progress": (lambda v: v is False, "prompt progress chunks are not streamed"),
}


def check_message_order(messages: Sequence[ChatMessage]) -> None:
    """A conversation may not end with two assistant messages (llama-server refuses
    it too): which one would the model be continuing? And, as OpenAI's rule, a tool
    message answers a call of the assistant message before it (tool messages between
    them answering its other calls): the template would render a result of no call."""
    if len(messages) >= 2 and messages[-1].role == messages[-2].role == "assistant":
        raise InvalidRequest(
            "messages",
            "the conversation ends with two assistant messages; merge them or "
            "end with a user message",
        )
    calls: list[ToolCallIn] | None = None  # of the assistant message the results answer
    for i, m in enumerate(messages):
        if m.role != "tool":
            calls = m.tool_calls if m.role == "assistant" else None
            continue
        if not calls:
            raise InvalidRequest(
                f"messages[{i}]",
                "a tool message must answer a call of the assistant message before it "
                "(a message with tool_calls)",
            )
        ids = [c.id for c in calls]
        if all(ids) and m.tool_call_id not in ids:
            raise InvalidRequest(
                f"messages[{i}].tool_call_id",
                f"tool_call_id {m.tool_call_id!r} is not among the ids of the tool calls "
                f"of the assistant message before it: {ids}",
            )


def check_continuation(body: ChatCompletionRequest) -> None:
    """``continue_final_message`` continues an assistant's text: the final message must
    be the assistant's, with text and no tool calls, and no generation prompt may
    follow it (vLLM refuses both flags together too)."""
    if not body.continue_final_message:
        return
    if body.add_generation_prompt:
        raise InvalidRequest(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true: the "
            "final message is continued, so no new turn is opened after it",
        )
    last = len(body.messages) - 1
    final = body.messages[last]
    if final.role != "assistant":
        raise InvalidRequest(
            f"messages[{last}].role",
            "continue_final_message continues the final message, which must be the "
            f"assistant's; this one is the {final.role}'s",
        )
    if final.tool_calls:
        raise InvalidRequest(
            f"messages[{last}].tool_calls",
            "continue_final_message continues the final message's text; one with tool "
            "calls cannot be continued",
        )
    if not final.text().strip():
        raise InvalidRequest(
            f"messages[{last}].content",
            "continue_final_message continues the final message's text, and this one has "
            "none; leave the message out to start the answer afresh",
        )


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


# a token id as OpenAI's logit_bias keys write it: digits only, where Python's int()
# would also take " 12" (a token's text, " 12", taken for id 12), "+12" or "1_2"
_TOKEN_ID = re.compile(r"-?[0-9]+")


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise InvalidRequest(
                "logit_bias",
                f"key {key!r} is not a token id (the keys are token ids written as "
                'strings, such as "1234"; /tokenize gives a text\'s ids)',
            )
        token = int(key)
        if not -params.LOGIT_BIAS_LIMIT <= bias <= params.LOGIT_BIAS_LIMIT:
            raise InvalidRequest(
                "logit_bias",
                f"bias {bias} for token {token} is outside ±{params.LOGIT_BIAS_LIMIT:g}",
            )
        out[token] = bias
    return out


def answer_length(
    requested: int | None,
    field: str,
    default: int,
    limit: int,
    prompt_tokens: int | None = None,
    context: ContextPolicy | None = None,
) -> int:
    """The answer's length: a request's own value is served as asked or refused,
    never cut down in silence.

    - a prompt longer than the window, where over-long prompts are refused: the
      engine's ``ContextLengthExceeded`` (the prompt's fault, whatever the length);
    - above ``limit`` (server.max_tokens_limit): a 400 naming ``field``;
    - with the sliding window off (``context.sliding`` false), prompt + answer
      must fit the slot's window: a 400 naming ``field`` that says how many fit
      (a prompt the engine truncates counts as cut, ``ContextPolicy.cut_length``);
    - with it on, any length up to the limit: past the window the oldest tokens
      slide out (the response's ``timings.context_shifts`` counts the shifts).

    A request that sets no length gets the profile's ``sampling.max_tokens``,
    within the limit and, with sliding off, within the room the prompt leaves.
    """
    room, prompt = None, f"prompt's {prompt_tokens} tokens"
    if prompt_tokens is not None and context is not None and not context.sliding:
        used = prompt_tokens
        if prompt_tokens > context.window:
            if not context.truncate_prompt:
                raise ContextLengthExceeded(prompt_tokens, context.window)
            used = context.cut_length  # the engine cuts it so that the answer has room
            prompt = f"prompt's {prompt_tokens} tokens, cut to {used} (context.overflow),"
        room = context.window - used
    if requested is None:
        length = min(default, limit)
        return max(min(length, room), 1) if room is not None else length
    if requested > limit:
        raise InvalidRequest(
            field,
            f"{requested} is more than this server's limit of {limit} tokens "
            "(server.max_tokens_limit)",
        )
    if room is not None and requested > room:
        assert context is not None
        fit = f"ask for {room} at most" if room > 0 else "shorten the prompt"
        raise InvalidRequest(
            field,
            f"the {prompt} and {requested} more do not fit the "
            f"context of {context.window} tokens per slot (the sliding window is off); {fit}",
        )
    return requested


# not bounded above here: answer_length refuses a length over server.max_tokens_limit
_MAX_TOKENS = "Tokens to generate at most; none = the profile's sampling.max_tokens."


class ChatCompletionRequest(_Common):
    OTHER_ENDPOINT: ClassVar[Refused] = {
        "echo": (lambda v: v is False, "the prompt is echoed on /v1/completions"),
        "prompt": (lambda v: not v, "a chat's prompt is its messages"),
    }

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=params.MAX_TOKENS.lo, description=_MAX_TOKENS)
    max_completion_tokens: int | None = Field(
        None, ge=params.MAX_TOKENS.lo, description=_MAX_TOKENS
    )
    logprobs: bool = False
    top_logprobs: int | None = _optional(params.LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = Field(
        None, description="none, auto (the default with tools), required, or a named function."
    )
    parallel_tool_calls: bool = True
    reasoning_format: Literal["auto", "deepseek", "none"] = Field(
        "auto", description="llama-server's: none keeps <think> blocks in the content."
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="Extra variables for the chat template (enable_thinking, ...)."
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None,
        description="OpenAI's: passed to the chat template as the variable reasoning_effort "
        "(gpt-oss's templates read it); a template that does not read it is unchanged.",
    )
    continue_final_message: bool = Field(
        False,
        description="vLLM's: the answer continues the final assistant message (text the "
        "client began) instead of starting a turn after it.",
    )
    add_generation_prompt: bool | None = Field(
        None,
        description="vLLM's: whether the template opens the assistant's turn; true by "
        "default, false with continue_final_message.",
    )
    _tool_grammar: str | None = PrivateAttr(None)

    @field_validator("tools")
    @classmethod
    def _unique_tools(cls, tools: list[ToolDef] | None) -> list[ToolDef] | None:
        if tools == []:  # OpenAI's rule: a list of tools has at least one
            raise ValueError("tools must list at least one function; leave it out for none")
        names = [t.function.name for t in tools or []]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"function names must be unique; given more than once: {twice}")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _choice(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        if choice is None:
            return choice
        if _without_tools(info):
            raise ValueError(TOOLS_NEEDED.format("tool_choice"))
        if choice in ("none", "auto"):
            return choice
        names = [t.function.name for t in info.data.get("tools") or []]
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"function {choice.function.name!r} is not among the tools {names}")
        fmt = info.data.get("response_format")
        for name, on in (
            ("grammar", bool(info.data.get("grammar"))),
            ("json_schema", info.data.get("json_schema") is not None),
            ("response_format", fmt is not None and fmt.type != "text"),
        ):
            if on:
                raise ValueError(
                    f"a tool_choice that requires a call constrains the output itself; "
                    f"it cannot be combined with {name}"
                )
        return choice

    @field_validator("parallel_tool_calls")
    @classmethod
    def _parallel(cls, parallel: bool, info: ValidationInfo) -> bool:
        """Checked only when given (null is the default, as left out)."""
        if _without_tools(info):
            raise ValueError(TOOLS_NEEDED.format("parallel_tool_calls"))
        return parallel

    def effective_tool_choice(self) -> ToolChoice:
        """What the request asks of the tools: none without any, auto by default."""
        if not self.tools:
            return "none"
        return self.tool_choice or "auto"

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders; none with ``tool_choice: "none"``."""
        if self.effective_tool_choice() == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: ``chat_template_kwargs``, and
        ``reasoning_effort`` unless those name it too (theirs is the one that counts)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def generation_prompt(self) -> bool:
        """Whether the template opens the assistant's turn after the messages."""
        if self.add_generation_prompt is None:
            return not self.continue_final_message
        return self.add_generation_prompt

    def image_parts(self) -> list[tuple[str, ImagePart]]:
        """Every image part in prompt order, each with the param that names its URL
        in an error (``messages[0].content[1].image_url``)."""
        return [
            (f"messages[{i}].content[{j}].image_url", part)
            for i, m in enumerate(self.messages)
            for j, part in m.images()
        ]

    def constrain(self, tool_grammar: str | None) -> None:
        """The grammar that a required or named tool_choice puts on the output."""
        self._tool_grammar = tool_grammar

    def _grammar(self) -> tuple[str | None, str]:
        if self._tool_grammar is not None:  # the validator refused any other grammar
            return self._tool_grammar, "tools"
        return super()._grammar()

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def length_field(self) -> str:
        if self.max_completion_tokens:
            return "max_completion_tokens"
        return "max_tokens" if self.max_tokens or self.n_predict is None else "n_predict"

    def top_n_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:  # OpenAI's rule: never ignored
            raise InvalidRequest("top_logprobs", "top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None


_CHAT = "it is read on /v1/chat/completions"

# chat's fields that change an answer: on /v1/completions, what to use instead
_CHAT_ONLY: Refused = {
    "max_completion_tokens": (lambda v: False, "use max_tokens"),
    "top_logprobs": (lambda v: v == 0, "use logprobs (the number of alternatives)"),
    "tools": (lambda v: not v, _CHAT),
    "tool_choice": (lambda v: v == "none", _CHAT),
    "messages": (lambda v: not v, _CHAT + "; a completion's prompt is its prompt field"),
}


class CompletionRequest(_Common):
    OTHER_ENDPOINT = _CHAT_ONLY

    prompt: str | list[int] | list[str] | list[list[int]]
    # before max_tokens, whose 0 it allows
    echo: bool = Field(
        False,
        description="The prompt before the answer; with logprobs, its tokens' log-probabilities.",
    )
    max_tokens: int | None = Field(
        None, ge=0, description=_MAX_TOKENS + " 0: only the echoed prompt (with echo)."
    )
    logprobs: int | None = _optional(params.LOGPROBS)

    @field_validator("max_tokens")
    @classmethod
    def _nothing_only_with_echo(cls, n: int | None, info: ValidationInfo) -> int | None:
        """OpenAI's legacy rule, which evaluation harnesses rely on: max_tokens 0 with
        echo returns the prompt (and its log-probabilities) and generates nothing;
        without echo it would answer with nothing at all."""
        if n == 0 and not info.data.get("echo"):
            raise ValueError(
                "0 generates nothing: max_tokens 0 is only allowed with echo, to get the "
                "prompt back (with logprobs, its tokens' log-probabilities)"
            )
        return n

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, p: Any) -> Any:
        """One prompt, or a batch of them (a list of texts or of token-id lists), none
        empty; a batch of one is that prompt."""
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            empty = next((i for i, one in enumerate(p) if not one), None)
            if empty is not None:
                raise ValueError(f"prompt {empty} of the batch is empty")
            if len(p) == 1:
                p = p[0]
        if not p:
            raise ValueError("the prompt is empty")
        return p

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def length_field(self) -> str:
        return "max_tokens" if self.max_tokens or self.n_predict is None else "n_predict"

    def top_n_logprobs(self) -> int | None:
        return self.logprobs

    def scores_prompt(self) -> bool:
        """OpenAI's legacy completions: with echo, logprobs covers the prompt too."""
        return self.echo and self.logprobs is not None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each as text or token ids: one, or a batch's in order."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], (str, list)):
            return [q if isinstance(q, str) else [int(t) for t in q] for q in p]
        return [[int(t) for t in cast(list[int], p)]]


# -- responses -------------------------------------------------------------------------


class PromptTokensDetails(TypedDict):
    cached_tokens: int


class Usage(TypedDict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ChatLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(TypedDict):
    tokens: list[str]
    # null for an echoed prompt's first token, which nothing comes before
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class _Choice(TypedDict):
    index: int
    finish_reason: FinishReason | Literal["tool_calls"] | None


class _TokenIds(TypedDict, total=False):  # with return_token_ids
    token_ids: list[int]
    prompt_token_ids: list[int]  # full responses only


class FunctionCall(TypedDict):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class FunctionCallDelta(TypedDict, total=False):
    name: str  # the call's first delta only
    arguments: str  # a fragment; the fragments of a call add up to its arguments


class ToolCallDelta(TypedDict, total=False):
    index: int  # always present: which call of the message the delta continues
    id: str  # with type and name, the first delta only
    type: Literal["function"]
    function: FunctionCallDelta


class _MessageParts(TypedDict, total=False):
    tool_calls: list[ToolCall]  # when the model called tools
    reasoning_content: str  # the text of the model's <think> block


class AssistantMessage(_MessageParts):
    role: Literal["assistant"]
    content: str | None  # null when the model only called tools


class Delta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str | None  # null only in the first delta of an answer that may call tools
    reasoning_content: str
    tool_calls: list[ToolCallDelta]


class ChatChoice(_Choice, _TokenIds):
    logprobs: ChatLogprobs | None
    message: AssistantMessage


class ChatChunkChoice(_Choice, _TokenIds):
    logprobs: ChatLogprobs | None
    delta: Delta


class TextChoice(_Choice, _TokenIds):
    logprobs: CompletionLogprobs | None
    text: str


class Envelope(TypedDict):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str | None


class Figures(TypedDict, total=False):  # in full responses; a stream's final chunk
    usage: Usage | None  # null in a stream's chunks before the usage chunk (include_usage)
    timings: dict[str, Any] | None


class ChatCompletion(Envelope, Figures):
    choices: list[ChatChoice]


class ChatCompletionChunk(Envelope, Figures):
    choices: list[ChatChunkChoice]


class TextCompletion(Envelope, Figures):
    choices: list[TextChoice]  # also each chunk of a streamed text completion


FullResponse = ChatCompletion | TextCompletion
Chunk = ChatCompletionChunk | TextCompletion


Piece = Callable[[int], bytes]


# -- response parts ---------------------------------------------------------------------------


def usage(cs: Completion | Sequence[Completion], n: int | None = None) -> Usage:
    """A response's usage: with ``n`` choices the prompt counts once (they share
    its cells) and the completion tokens of every choice add up; the cached
    tokens are the fewest any choice took from the cache, what the prompt cost.
    A batch of prompts: every ``n`` consecutive choices are one prompt's (None: all
    of them), and the prompts' figures add up."""
    many = [cs] if isinstance(cs, Completion) else list(cs)
    size = n or len(many)
    prompt = cached = 0
    for i in range(0, len(many), size):
        group = many[i : i + size]
        t = group[0].timings
        prompt += t.prompt_tokens if t else 0
        cached += min((c.timings.cached_tokens for c in group if c.timings), default=0)
    out = sum(len(c.token_ids) for c in many)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": out,
        "total_tokens": prompt + out,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def timings(t: RequestTimings | None) -> dict[str, Any] | None:
    """The engine's figures, plus the names llama.cpp's server uses for the same things."""
    if t is None:
        return None
    decode_n = max(t.generated_tokens - 1, 0)
    return {
        "queue_ms": t.queue_ms,
        "prefill_ms": t.prefill_ms,
        "ttft_ms": t.first_token_ms,  # null for an answer with no token (echo only)
        "tpot_ms": t.tpot_ms,
        "e2e_ms": t.e2e_ms,
        "context_shifts": t.context_shifts,
        "cache_n": t.cached_tokens,
        "prompt_n": t.prefilled_tokens,
        "prompt_ms": t.prefill_ms,
        "prompt_per_token_ms": t.prefill_ms / t.prefilled_tokens if t.prefilled_tokens else None,
        "prompt_per_second": 1e3 * t.prefilled_tokens / t.prefill_ms if t.prefill_ms else None,
        "predicted_n": t.generated_tokens,
        "predicted_ms": t.decode_ms,
        "predicted_per_token_ms": t.tpot_ms,
        "predicted_per_second": 1e3 * decode_n / t.decode_ms if t.decode_ms else None,
        # speculative decoding (llama-server's names): tokens drafted and accepted
        "draft_n": t.drafted_tokens,
        "draft_n_accepted": t.accepted_tokens,
        "draft_acceptance": t.acceptance_rate,
        "draft_stopped": t.draft_stopped,  # switched off: acceptance below min_acceptance
        # images: their encoding, a phase of its own inside prefill (prompt_ms)
        "encode_ms": t.encode_ms,
        "images_n": t.images,
    }


def chat_logprobs(items: Sequence[TokenLogprob], piece: Piece) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> ChatLogprob:
        raw = piece(token_id)
        return {"token": raw.decode("utf-8", "replace"), "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top],
            }
            for lp in items
        ]
    }


def completion_logprobs(
    items: Sequence[TokenLogprob], piece: Piece, start: int = 0
) -> CompletionLogprobs:
    """Completions' logprobs of ``items``; ``text_offset`` counts characters of the text
    the client gets, the first token's at ``start`` (an echoed prompt's length, or the
    text streamed before it)."""
    tokens = [piece(lp.token_id).decode("utf-8", "replace") for lp in items]
    offsets, pos = [], start
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [_top(lp, piece) for lp in items],
        "text_offset": offsets,
    }


def _top(lp: TokenLogprob, piece: Piece) -> dict[str, float]:
    return {piece(t.token_id).decode("utf-8", "replace"): t.logprob for t in lp.top}


def prompt_logprobs(
    pieces: Sequence[bytes], scores: Sequence[TokenLogprob], piece: Piece
) -> CompletionLogprobs:
    """An echoed prompt's logprobs, as OpenAI's legacy completions give them: every
    prompt token (``pieces``: its text as the echo writes it), the first with null
    (nothing comes before it), each other with ``scores``' log-probability given the
    tokens before it and its alternatives. ``text_offset`` counts the characters of
    the tokens' text from the start of the echo (a character split over tokens
    counts at the token that completes it)."""
    if len(scores) != max(len(pieces) - 1, 0):
        raise ValueError(f"{len(scores)} log-probabilities for a prompt of {len(pieces)} tokens")
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    offsets, pos = [], 0
    for raw in pieces:
        offsets.append(pos)
        pos += len(decoder.decode(raw))
    return {
        "tokens": [raw.decode("utf-8", "replace") for raw in pieces],
        "token_logprobs": [None, *(lp.logprob for lp in scores)][: len(pieces)],
        "top_logprobs": [None, *(_top(lp, piece) for lp in scores)][: len(pieces)],
        "text_offset": offsets,
    }


def joined_logprobs(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    """An echoed prompt's logprobs, then the answer's."""
    return {
        "tokens": first["tokens"] + then["tokens"],
        "token_logprobs": first["token_logprobs"] + then["token_logprobs"],
        "top_logprobs": first["top_logprobs"] + then["top_logprobs"],
        "text_offset": first["text_offset"] + then["text_offset"],
    }
