"""Every wire model of the OpenAI-compatible API, and their conversion to engine terms.

Requests are lenient (unknown OpenAI fields are accepted and logged, never an
error), but every known field is bounded by the table in ``orin.params`` (the
one the profile schema and the engine use), and each request owns its
conversion to ``SamplingParams``. The response shapes are typed dicts, built by
the formatters in ``responses.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypedDict, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from orin import params
from orin.engine import grammar
from orin.engine.errors import InvalidRequest
from orin.engine.stream import Completion
from orin.engine.types import FinishReason, RequestTimings, SamplingParams, TokenLogprob
from orin.profile.schema import SamplingSection

log = logging.getLogger("orin.server")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")

    def ignored_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


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


class TextPart(_Lenient):
    type: Literal["text"] = "text"
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


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
    seed: int | None = _optional(params.SEED)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=1, description="Only one choice per request is supported.")
    stream: bool = False
    stream_options: StreamOptions | None = None
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
    n_predict: int | None = Field(None, ge=-1, description="llama.cpp's name for max_tokens.")

    def refuse_unsupported(self) -> None:
        """A field that would change the output but is not implemented is a 400 naming
        it, never ignored (unknown fields that cannot change the output are logged)."""
        extra = self.model_extra or {}
        for name, why in UNSUPPORTED.items():
            value = extra.get(name)
            if value is not None and value is not False and value != []:
                raise InvalidRequest(name, f"{name} is not supported by this server: {why}")
        best_of = extra.get("best_of")
        if best_of is not None and best_of != getattr(self, "n", 1):
            raise InvalidRequest("best_of", "best_of is not supported; it may only equal n")
        modalities = extra.get("modalities")
        if isinstance(modalities, list) and set(modalities) - {"text"}:
            raise InvalidRequest("modalities", "this server answers with text only")

    def max_new_tokens(self) -> int | None:
        raise NotImplementedError

    def top_n_logprobs(self) -> int | None:
        raise NotImplementedError

    def to_sampling(self, defaults: SamplingSection, cap: int) -> SamplingParams:
        """Engine parameters; the profile supplies what the request leaves out
        (``max_tokens`` too, on both endpoints), and ``cap`` bounds the length."""
        requested = self.max_new_tokens()
        if requested is None and self.n_predict is not None and self.n_predict >= 0:
            requested = max(self.n_predict, 1)
        last_n = _pick(self.penalty_last_n, self.repeat_last_n)
        return SamplingParams(
            max_tokens=min(defaults.max_tokens if requested is None else requested, cap),
            temperature=_pick(self.temperature, defaults.temperature),
            top_k=_pick(self.top_k, defaults.top_k),
            top_p=_pick(self.top_p, defaults.top_p),
            min_p=_pick(self.min_p, defaults.min_p),
            repeat_penalty=_pick(self.repeat_penalty, defaults.repeat_penalty),
            presence_penalty=_pick(self.presence_penalty, params.PRESENCE_PENALTY.default),
            frequency_penalty=_pick(self.frequency_penalty, params.FREQUENCY_PENALTY.default),
            penalty_last_n=_pick(last_n, params.PENALTY_LAST_N.default),
            seed=self.seed if self.seed is not None else defaults.seed,
            logit_bias=_logit_bias(self.logit_bias),
            stop=(self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ()),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            grammar=self._grammar(),
            logprobs=self.top_n_logprobs(),
        )

    def _grammar(self) -> str | None:
        """The one grammar of ``grammar``, ``json_schema`` and ``response_format``
        (OpenAI's and llama.cpp's forms); more than one of them is a 400."""
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
            return grammar.json_schema_grammar(self.json_schema, "json_schema")
        if fmt is None or fmt.type == "text":
            return self.grammar
        if fmt.type == "json_object":
            if fmt.schema_:
                return grammar.json_schema_grammar(fmt.schema_, "response_format.schema")
            return grammar.json_grammar()
        schema = fmt.json_schema.schema_ if fmt.json_schema is not None else {}
        return grammar.json_schema_grammar(schema, "response_format.json_schema")


# Fields of OpenAI's, llama.cpp's or vLLM's APIs that change the output and that this
# server does not implement: a request setting one is refused (with why), not served
# as if it had not asked.
UNSUPPORTED: dict[str, str] = {
    **dict.fromkeys(
        (
            "mirostat",
            "mirostat_tau",
            "mirostat_eta",
            "typical_p",
            "tfs_z",
            "dynatemp_range",
            "dynatemp_exponent",
            "xtc_probability",
            "xtc_threshold",
            "dry_multiplier",
            "dry_base",
            "dry_allowed_length",
            "dry_penalty_last_n",
            "dry_sequence_breakers",
            "top_n_sigma",
            "samplers",
            "min_keep",
            "min_tokens",
            "length_penalty",
            "use_beam_search",
            "bad_words",
            "allowed_token_ids",
        ),
        "this sampler is not available here (docs/server.md lists the sampling parameters)",
    ),
    **dict.fromkeys(
        ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"),
        "use response_format, json_schema or grammar",
    ),
    "functions": "use tools",
    "function_call": "use tool_choice",
    "n_probs": "use logprobs",
    "prompt_logprobs": "log-probabilities of prompt tokens are not computed",
    "suffix": "fill-in-the-middle is not implemented",
    "audio": "audio output is not implemented",
    "web_search_options": "web search is not available",
    "lora": "LoRA adapters are not loaded by this server",
}


def check_message_order(messages: Sequence[ChatMessage]) -> None:
    """A conversation may not end with two assistant messages (llama-server refuses
    it too): which one would the model be continuing?"""
    if len(messages) >= 2 and messages[-1].role == messages[-2].role == "assistant":
        raise InvalidRequest(
            "messages",
            "the conversation ends with two assistant messages; merge them or "
            "end with a user message",
        )


def _pick(value: Any, default: Any) -> Any:
    return default if value is None else value


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest("logit_bias", f"key {key!r} is not a token id") from None
        if not -params.LOGIT_BIAS_LIMIT <= bias <= params.LOGIT_BIAS_LIMIT:
            raise InvalidRequest(
                "logit_bias",
                f"bias {bias} for token {token} is outside ±{params.LOGIT_BIAS_LIMIT:g}",
            )
        out[token] = bias
    return out


# not bounded above: a request's length is capped by server.max_tokens_limit, never refused
_MAX_TOKENS = "Tokens to generate at most; none = the profile's sampling.max_tokens."


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=params.MAX_TOKENS.lo, description=_MAX_TOKENS)
    max_completion_tokens: int | None = Field(
        None, ge=params.MAX_TOKENS.lo, description=_MAX_TOKENS
    )
    logprobs: bool = False
    top_logprobs: int | None = _optional(params.LOGPROBS)
    tools: list[Any] | None = None

    @model_validator(mode="after")
    def _unsupported(self) -> ChatCompletionRequest:
        if self.tools:
            raise ValueError("tool calling is not supported by this server")
        return self

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def top_n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(None, ge=params.MAX_TOKENS.lo, description=_MAX_TOKENS)
    logprobs: int | None = _optional(params.LOGPROBS)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, p: Any) -> Any:
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError("only one prompt per request is supported")
            p = p[0]
        if not p:
            raise ValueError("the prompt is empty")
        return p

    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    def top_n_logprobs(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        """The one prompt, as text or token ids (validation unwrapped a one-item list)."""
        p = self.prompt
        return p if isinstance(p, str) else [int(t) for t in cast(list[int], p)]


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
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class _Choice(TypedDict):
    index: int
    finish_reason: FinishReason | None


class _TokenIds(TypedDict, total=False):  # with return_token_ids
    token_ids: list[int]
    prompt_token_ids: list[int]  # full responses only


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str


class Delta(TypedDict, total=False):
    role: Literal["assistant"]
    content: str


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
    usage: Usage
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


def usage(c: Completion) -> Usage:
    t = c.timings
    prompt = t.prompt_tokens if t else 0
    out = len(c.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": out,
        "total_tokens": prompt + out,
        "prompt_tokens_details": {"cached_tokens": t.cached_tokens if t else 0},
    }


def timings(t: RequestTimings | None) -> dict[str, Any] | None:
    """The engine's figures, plus the names llama.cpp's server uses for the same things."""
    if t is None:
        return None
    decode_n = max(t.generated_tokens - 1, 0)
    return {
        "queue_ms": t.queue_ms,
        "prefill_ms": t.prefill_ms,
        "ttft_ms": t.ttft_ms,
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


def completion_logprobs(items: Sequence[TokenLogprob], piece: Piece) -> CompletionLogprobs:
    tokens = [piece(lp.token_id).decode("utf-8", "replace") for lp in items]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [
            {piece(t.token_id).decode("utf-8", "replace"): t.logprob for t in lp.top}
            for lp in items
        ],
        "text_offset": offsets,
    }
