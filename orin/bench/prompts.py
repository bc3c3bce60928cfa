"""Prompts of a fixed length, distinct per request.

Every prompt is different (seeded random draws), so a server's prefix cache
cannot shorten prefill beyond the special tokens at the start. Two ways:

- token ids, exact: a pool of real token ids (what the server's tokenizer made
  of ordinary words) and the special prefix it adds (BOS); a prompt of L tokens
  is the prefix plus L - len(prefix) draws from the pool. Used for orin-llm,
  whose /v1/completions takes token ids and returns ``prompt_token_ids``;
- text, calibrated: random common words, with the word count per target length
  fitted from the server's ``usage.prompt_tokens`` on probe requests. Words
  tokenize to slightly different counts, so lengths are approximate (within a
  few percent); the server's count for each request is what the results use.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his it an were are which "
    "this be or has had not first one their its new after but who they two her she "
    "been other when there all during into school time may years more most only over "
    "city some world would where later up such used many can state about national out "
    "known university united then made three while under team between city both south "
    "north river music film series game season house church history water power light "
    "board engine memory model token stream window cache layer signal market village "
    "station island garden mountain valley summer winter morning evening number system "
    "family battle record member office public second group place area region war life"
)
WORDS = tuple(dict.fromkeys(_WORD_TEXT.split()))  # in order, each word once

DEFAULT_TOKENS_PER_WORD = 1.3  # a first guess for English text with BPE/SentencePiece
CORPUS_WORDS = 400


def corpus(seed: int, n_words: int = CORPUS_WORDS) -> str:
    """Text to learn a token pool from."""
    rng = random.Random(f"corpus:{seed}")
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=max(n, 1)))


def special_prefix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    """The tokens a tokenizer puts before any text (BOS): the common prefix of two
    tokenizations of texts that start with different words."""
    out = []
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        out.append(x)
    return out


@dataclass(frozen=True)
class TokenPool:
    """Token ids to draw prompts from, and the special prefix every prompt starts with."""

    prefix: tuple[int, ...]
    pool: tuple[int, ...]

    @classmethod
    def from_tokenizations(cls, text_ids: Sequence[int], other_ids: Sequence[int]) -> TokenPool:
        prefix = special_prefix(text_ids, other_ids)
        body = sorted(set(text_ids[len(prefix) :]) - set(prefix))
        if not body:
            raise ValueError("the tokenizer produced no ordinary tokens to build prompts from")
        return cls(tuple(prefix), tuple(body))

    def prompt(self, rng: random.Random, length: int) -> list[int]:
        """Exactly ``length`` ids: the prefix, then random draws from the pool."""
        head = list(self.prefix[:length])
        return head + rng.choices(self.pool, k=length - len(head))


def fit_word_count(target: int, words_sent: int, tokens_seen: int) -> int:
    """The word count that should give ``target`` tokens, from one observation."""
    if tokens_seen <= 0:
        return max(1, round(target / DEFAULT_TOKENS_PER_WORD))
    return max(1, round(words_sent * target / tokens_seen))
