"""The sampling parameters: one table of names, defaults, bounds and meanings.

The profile's sampling section, the request models and the engine's
``SamplingParams`` take their defaults and bounds from here, so a value that
one layer accepts is never refused by another: a profile default outside the
engine's range would turn every request under that profile into a 400 that
blames the client.

The bounds follow llama.cpp where it has them (``repeat_penalty`` divides
logits, so it must stay above 0; llama.cpp's ``--repeat-penalty`` refuses 0
and anything whose inverse overflows) and OpenAI's documented ranges for the
fields OpenAI defines (``temperature`` 0 to 2, the penalties -2 to 2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Param(Generic[T]):
    """One parameter: ``lo <= value <= hi`` (``lo < value`` when ``lo_open``)."""

    name: str
    default: T
    lo: float
    hi: float
    description: str
    lo_open: bool = False

    @property
    def gt(self) -> float | None:
        """The exclusive lower bound, as pydantic's ``Field(gt=...)`` takes it."""
        return self.lo if self.lo_open else None

    @property
    def ge(self) -> float | None:
        """The inclusive lower bound, as pydantic's ``Field(ge=...)`` takes it."""
        return None if self.lo_open else self.lo

    @property
    def le(self) -> float:
        return self.hi

    def problem(self, value: float) -> str | None:
        """Why ``value`` is out of bounds, or None when it is within them."""
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        above = value > self.lo if self.lo_open else value >= self.lo
        if above and value <= self.hi:
            return None
        if self.lo_open:
            return f"must be above {_num(self.lo)} and at most {_num(self.hi)}, got {value}"
        return f"must be between {_num(self.lo)} and {_num(self.hi)}, got {value}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


MAX_TOKENS = Param(
    "max_tokens",
    512,
    1,
    1_048_576,
    "Tokens to generate at most; the profile's value applies when a request sets none "
    "(a request's own value above server.max_tokens_limit, or one that cannot fit the "
    "window with sliding off, is refused with a 400).",
)
TEMPERATURE = Param(
    "temperature",
    0.8,
    0.0,
    2.0,
    "Sampling temperature: 0 always picks the most likely token (greedy), higher values "
    "spread the choice; OpenAI's range, 0 to 2.",
)
TOP_P = Param(
    "top_p",
    0.95,
    0.0,
    1.0,
    "Nucleus sampling: keep the most likely tokens whose probabilities add up to this mass; "
    "1 disables it, 0 is refused (it would keep no token).",
    lo_open=True,
)
TOP_K = Param(
    "top_k",
    40,
    -1,
    1000,
    "Keep only the k most likely tokens; 0 disables it, and so does -1 (llama-server's "
    "and vLLM's way to say all tokens).",
)
MIN_P = Param(
    "min_p",
    0.05,
    0.0,
    1.0,
    "Drop tokens less likely than this fraction of the most likely one; 0 disables it.",
)
REPEAT_PENALTY = Param(
    "repeat_penalty",
    1.0,
    0.01,
    10.0,
    "llama.cpp's repetition penalty over the last 64 tokens: 1 disables it, above 1 "
    "discourages repeats, below 1 favours them. llama.cpp divides logits by it, so it "
    "must be above 0 (at least 0.01 here).",
)
PRESENCE_PENALTY = Param(
    "presence_penalty",
    0.0,
    -2.0,
    2.0,
    "Subtracted once from the logit of every token already seen; OpenAI's range, -2 to 2.",
)
FREQUENCY_PENALTY = Param(
    "frequency_penalty",
    0.0,
    -2.0,
    2.0,
    "Subtracted from a token's logit once for each time it was seen; OpenAI's range, -2 to 2.",
)
PENALTY_LAST_N = Param(
    "penalty_last_n",
    64,
    -1,
    1 << 20,
    "Tokens the penalties look back over; -1 = the whole context, 0 disables the penalties.",
)
SEED: Param[int | None] = Param(
    "seed",
    None,
    0,
    (1 << 32) - 2,
    "Sampling seed; none = a random seed for each request. 4294967295 is llama.cpp's "
    "'pick a random seed' (LLAMA_DEFAULT_SEED), so the largest seed is one below it.",
)
# a request's seed -1: llama-server's "a random seed", here one for that request alone,
# whatever the profile's sampling.seed (a profile leaves its seed out for that)
RANDOM_SEED = -1
# the largest seed a request may send: clients draw 63- and 64-bit seeds (OpenAI's API
# sets no bound), which llama_seed maps into the table's range
REQUEST_SEED_MAX = (1 << 64) - 1


def llama_seed(seed: int) -> int:
    """A request's seed (0 to ``REQUEST_SEED_MAX``) as llama.cpp takes it: itself up to
    ``SEED.hi``, a larger one modulo ``SEED.hi + 1`` (4294967295), so one seed always
    samples alike and none becomes llama.cpp's 'pick a random seed'."""
    return seed % (int(SEED.hi) + 1)


LOGPROBS: Param[int | None] = Param(
    "logprobs",
    None,
    0,
    20,
    "Most likely alternatives returned with each token's log-probability; none = off.",
)

SAMPLING: tuple[Param[int] | Param[float] | Param[int | None], ...] = (
    MAX_TOKENS,
    TEMPERATURE,
    TOP_P,
    TOP_K,
    MIN_P,
    REPEAT_PENALTY,
    PRESENCE_PENALTY,
    FREQUENCY_PENALTY,
    PENALTY_LAST_N,
    SEED,
    LOGPROBS,
)
BY_NAME = {p.name: p for p in SAMPLING}

MAX_CHOICES = 16  # n: choices of one request
LOGIT_BIAS_LIMIT = 100.0  # |bias| at most this (the engine also takes -inf: a ban)
MAX_STOP_STRINGS = 16
