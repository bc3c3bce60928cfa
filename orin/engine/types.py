"""What goes into the engine and what comes out of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from orin import params
from orin.engine.errors import InvalidRequest

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings; ``validate`` names the offending parameter.

    Defaults and bounds come from ``orin.params``, the table the profile schema
    and the request models use too.
    """

    max_tokens: int = params.MAX_TOKENS.default
    temperature: float = params.TEMPERATURE.default
    top_k: int = params.TOP_K.default
    top_p: float = params.TOP_P.default
    min_p: float = params.MIN_P.default
    repeat_penalty: float = params.REPEAT_PENALTY.default
    presence_penalty: float = params.PRESENCE_PENALTY.default
    frequency_penalty: float = params.FREQUENCY_PENALTY.default
    penalty_last_n: int = params.PENALTY_LAST_N.default
    seed: int | None = params.SEED.default
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None
    # the request's field the grammar came from, for the error that refuses it (a schema's
    # grammar that llama.cpp refuses names the schema, not a grammar the client never sent)
    grammar_field: str = "grammar"
    logprobs: int | None = params.LOGPROBS.default  # top-N log-probabilities per token
    # the log-probability of every prompt token after the first, given the tokens before
    # it, with ``logprobs`` alternatives (completions' echo): the prompt is computed with
    # logits at every position, never taken from cached or copied cells
    prompt_logprobs: bool = False
    # control tokens written out as their text (a tool-call format's markers, such as
    # Mistral's [TOOL_CALLS], that the vocabulary has as control tokens)
    preserve: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return (
            self.repeat_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def validate(self, n_vocab: int) -> None:
        """Check every value against the table. ``top_k`` may exceed the vocabulary
        (llama.cpp keeps all candidates then), so a profile default never depends on
        the model."""
        for p in params.SAMPLING:
            value = getattr(self, p.name)
            if p is params.MAX_TOKENS and value == 0:
                continue  # only the prompt: computed, then finished with "length"
            problem = None if value is None else p.problem(value)
            if problem is not None:
                raise InvalidRequest(p.name, problem)
        limit = params.LOGIT_BIAS_LIMIT
        for token, bias in self.logit_bias.items():
            if not 0 <= token < n_vocab:
                raise InvalidRequest("logit_bias", f"token id {token} is not in the vocabulary")
            if not (math.isinf(bias) and bias < 0) and not -limit <= bias <= limit:
                raise InvalidRequest("logit_bias", f"bias {bias} for token {token} is out of range")
        for token in self.stop_token_ids:
            if not 0 <= token < n_vocab:
                raise InvalidRequest("stop_token_ids", f"token id {token} is not in the vocabulary")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop", "a stop string may not be empty")
        if len(self.stop) > params.MAX_STOP_STRINGS:
            raise InvalidRequest(
                "stop", f"{len(self.stop)} stop strings; at most {params.MAX_STOP_STRINGS}"
            )


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class RequestTimings:
    """Per-request figures as ../docs/metrics.md defines them (milliseconds)."""

    queue_ms: float
    prefill_ms: float
    ttft_ms: float
    tpot_ms: float | None  # None with fewer than two tokens
    e2e_ms: float
    itl_ms: tuple[float, ...]
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    context_shifts: int
    drafted_tokens: int = 0  # speculative decoding: tokens drafted for this request
    accepted_tokens: int = 0  # of those, the ones the model confirmed
    # speculation switched itself off for this request: its drafts were accepted below
    # speculative.min_acceptance after speculative.probation drafted tokens
    draft_stopped: bool = False
    encode_ms: float = 0.0  # images encoded for this request (inside prefill_ms)
    images: int = 0  # images in the prompt
    # the same instants on time.perf_counter_ns, for lining requests up with telemetry
    arrival_ns: int = 0
    prefill_start_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0

    @property
    def decode_ms(self) -> float:
        return self.e2e_ms - self.ttft_ms

    @property
    def first_token_ms(self) -> float | None:
        """The TTFT as reports give it: None for a request that produced no token
        (cancelled while queued or during prefill, or failed before its first token),
        whose ``ttft_ms`` is only the time it ended (../docs/metrics.md)."""
        return self.ttft_ms if self.generated_tokens > 0 else None

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens; None when nothing was drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None


class TokenEvent(NamedTuple):
    """One step of a request's stream.

    ``token_id`` is the generated id (None on a final event without a token);
    ``text`` is the newly complete text (may be empty while a multi-byte
    character or a possible stop string is held back). The last event has
    ``finish_reason`` and ``timings``. With ``SamplingParams.prompt_logprobs``, one
    event without a token, once the prompt is computed, carries
    ``prompt_logprobs``: those of the prompt's tokens after the first, in order.

    A named tuple rather than a frozen dataclass, like ``StepStats``: one is made
    per token on the engine thread, and a frozen dataclass's ``__init__`` sets each
    field through ``object.__setattr__`` (docs/performance.md, "Single-stream TPOT
    in pairs").
    """

    request_id: str
    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None
    timings: RequestTimings | None = None
    error: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


class StepStats(NamedTuple):
    """One engine step, on the perf_counter_ns clock the telemetry sampler shares.

    A named tuple (immutable, built in one call) rather than a frozen dataclass,
    whose ``__init__`` sets each of these 16 fields through ``object.__setattr__``:
    one is made after every decode, on caches the decode has just filled, where
    that took 20 µs on a 2-core VM (docs/performance.md, "Single-stream TPOT in
    pairs")."""

    start_ns: int
    end_ns: int
    prefill_tokens: int
    decode_tokens: int
    slots_busy: int
    kv_cells_used: int
    waiting: int
    context_shifts: int = 0
    aborted: bool = False
    embedded_tokens: int = 0  # input tokens of an embedding pass (a step of its own)
    prefill_budget: int = 0  # prompt tokens the step could carry (SLO-aware chunking)
    micro_batches: int = 0  # llama.cpp passes the step cost (each reads every weight)
    drafted_tokens: int = 0  # speculative tokens verified in the step
    accepted_tokens: int = 0  # of those, the ones the model confirmed
    encode_ns: int = 0  # of the step, the time spent encoding images (before its decode)
    encoded_images: int = 0  # images encoded in the step

    @property
    def phase(self) -> Literal["prefill", "decode", "mixed", "idle"]:
        """An embedding pass is prompt processing: it counts as prefill."""
        prompt = self.prefill_tokens + self.embedded_tokens
        if prompt and self.decode_tokens:
            return "mixed"
        if prompt:
            return "prefill"
        return "decode" if self.decode_tokens else "idle"
