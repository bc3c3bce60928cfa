"""What goes into the engine and what comes out of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from orin.engine.errors import InvalidRequest

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings; ``validate`` names the offending parameter."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    grammar: str | None = None
    logprobs: int | None = None  # top-N log-probabilities per token; None = off

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
        _range("max_tokens", self.max_tokens, 1, 1 << 24)
        _range("temperature", self.temperature, 0.0, 5.0)
        _range("top_k", self.top_k, 0, n_vocab)
        _range("top_p", self.top_p, 0.0, 1.0)
        _range("min_p", self.min_p, 0.0, 1.0)
        _range("repeat_penalty", self.repeat_penalty, 0.01, 10.0)
        _range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _range("penalty_last_n", self.penalty_last_n, -1, 1 << 20)
        if self.seed is not None:
            _range("seed", self.seed, 0, (1 << 32) - 1)
        if self.logprobs is not None:
            _range("logprobs", self.logprobs, 0, 20)
        for token, bias in self.logit_bias.items():
            if not 0 <= token < n_vocab:
                raise InvalidRequest("logit_bias", f"token id {token} is not in the vocabulary")
            if not (math.isinf(bias) and bias < 0) and not -100.0 <= bias <= 100.0:
                raise InvalidRequest("logit_bias", f"bias {bias} for token {token} is out of range")
        for token in self.stop_token_ids:
            if not 0 <= token < n_vocab:
                raise InvalidRequest("stop_token_ids", f"token id {token} is not in the vocabulary")
        if len(self.stop) > 16 or any(not s for s in self.stop):
            raise InvalidRequest("stop", "at most 16 non-empty stop strings")


def _range(name: str, value: float, lo: float, hi: float) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(name, f"must be a finite number, got {value}")
    if not lo <= value <= hi:
        raise InvalidRequest(name, f"must be between {lo} and {hi}, got {value}")


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
    # the same instants on time.perf_counter_ns, for lining requests up with telemetry
    arrival_ns: int = 0
    prefill_start_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0

    @property
    def decode_ms(self) -> float:
        return self.e2e_ms - self.ttft_ms

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class TokenEvent:
    """One step of a request's stream.

    ``token_id`` is the generated id (None on a final event without a token);
    ``text`` is the newly complete text (may be empty while a multi-byte
    character or a possible stop string is held back). The last event has
    ``finish_reason`` and ``timings``.
    """

    request_id: str
    token_id: int | None
    text: str
    logprob: TokenLogprob | None = None
    finish_reason: FinishReason | None = None
    timings: RequestTimings | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepStats:
    """One engine step, on the perf_counter_ns clock the telemetry sampler shares."""

    start_ns: int
    end_ns: int
    prefill_tokens: int
    decode_tokens: int
    slots_busy: int
    kv_cells_used: int
    waiting: int
    context_shifts: int = 0
    aborted: bool = False

    @property
    def phase(self) -> Literal["prefill", "decode", "mixed", "idle"]:
        if self.prefill_tokens and self.decode_tokens:
            return "mixed"
        if self.prefill_tokens:
            return "prefill"
        return "decode" if self.decode_tokens else "idle"
