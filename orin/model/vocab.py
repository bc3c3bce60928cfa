"""A small SentencePiece-style (llama.cpp "llama"/SPM) vocabulary, learned at build time.

The demo models must tokenize like real ones: multi-character pieces that carry
the ``▁`` word marker, common Chinese characters as single tokens, and byte
fallback so that any UTF-8 text round-trips. Shipping a real tokenizer would
mean downloading one, so the pieces are learned here by word-frequency BPE
over the built-in corpus, with fully deterministic tie-breaking: the same code
always yields the same vocabulary, and so the same model files.

Layout (fixed ids that llama.cpp's SPM defaults and the chat template rely on)::

    0 <unk>   1 <s>   2 </s>   3..258 <0x00>..<0xFF>   259 <|im_start|>   260 <|im_end|>
    261..     single characters of the corpus, most frequent first
    then      merged pieces, in merge order

llama.cpp's SPM tokenizer merges adjacent symbols by descending piece score,
so merged pieces get scores that fall with merge order (first merge highest),
which makes its bigram merging replay the BPE merges. Single characters score
below every merge; llama.cpp never merges into a single character, so their
scores only keep the ordering tidy.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from functools import cache
from itertools import pairwise

from orin.model.corpus import CORPUS

SPACE = "\u2581"
"""SentencePiece's word marker; llama.cpp turns every space into it before merging."""

MAX_MERGES = 480
"""Upper bound that keeps the tiny f32 model under 1 MB whatever the corpus; with the
current corpus MIN_PAIR_FREQ ends training first (328 merges, 816 tokens)."""

MIN_PAIR_FREQ = 2
"""A pair seen once is corpus trivia, not a useful piece."""

MAX_PIECE_BYTES = 16
"""llama-cpp-python detokenizes each piece into a 32-byte buffer; stay well inside it."""

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_BASE = 3
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
IM_START_ID, IM_END_ID = BYTE_BASE + 256, BYTE_BASE + 257
FIRST_NORMAL_ID = IM_END_ID + 1

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""ChatML, the format the two control tokens above exist for."""


class TokenType(IntEnum):
    """llama.cpp's ``llama_token_type`` values, as stored in ``tokenizer.ggml.token_type``."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


def byte_piece(value: int) -> str:
    """The spelling llama.cpp looks up for byte fallback (upper-case hex)."""
    return f"<0x{value:02X}>"


@dataclass(frozen=True)
class Vocab:
    """Token table plus the merges that built it, with an SPM encoder mirroring llama.cpp."""

    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    types: tuple[TokenType, ...]
    merges: tuple[tuple[str, str], ...]
    """The merge that created each merged piece, in creation (= id) order."""
    ids: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ids", {t: i for i, t in enumerate(self.tokens)})

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def normal_ids(self) -> range:
        return range(FIRST_NORMAL_ID, len(self.tokens))

    def encode(self, text: str) -> list[int]:
        """Token ids as llama.cpp's SPM tokenizer gives them (space prefix, no BOS)."""
        if not text:
            return []
        chars = list((" " + text).replace(" ", SPACE))
        out: list[int] = []
        for piece in _spm_merge(chars, self.ids, self.scores):
            token = self.ids.get(piece)
            if token is not None:
                out.append(token)
            else:
                out.extend(BYTE_BASE + b for b in piece.encode("utf-8"))
        return out

    def decode(self, ids: Iterable[int]) -> str:
        """Text for ids the way llama.cpp detokenizes: control tokens vanish, one space prefix
        is dropped."""
        raw = bytearray()
        for i in ids:
            kind = self.types[i]
            if kind == TokenType.BYTE:
                raw.append(i - BYTE_BASE)
            elif kind == TokenType.NORMAL:
                raw += self.tokens[i].replace(SPACE, " ").encode("utf-8")
        text = raw.decode("utf-8", errors="replace")
        return text[1:] if text.startswith(" ") else text


def _spm_merge(chars: list[str], ids: dict[str, int], scores: Sequence[float]) -> list[str]:
    """llama.cpp's llm_tokenizer_spm_session: repeatedly merge the adjacent pair whose
    concatenation is a token with the highest score, leftmost first."""
    text = list(chars)  # symbol i's text; "" once merged into its left neighbour
    nxt = [*range(1, len(chars)), -1]
    prv = list(range(-1, len(chars) - 1))
    queue: list[tuple[float, int, int, str]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        joined = text[left] + text[right]
        token = ids.get(joined)
        if token is not None:
            heapq.heappush(queue, (-scores[token], left, right, joined))

    for i in range(1, len(chars)):
        push(i - 1, i)
    while queue:
        _, left, right, joined = heapq.heappop(queue)
        if not text[left] or not text[right] or text[left] + text[right] != joined:
            continue
        text[left], text[right] = joined, ""
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    return [t for t in text if t]


def word_counts(text: str) -> Counter[str]:
    """Whitespace-separated words with the ▁ marker SentencePiece puts in front of each."""
    return Counter(SPACE + word for word in text.split())


def train_bpe(
    words: Counter[str], max_merges: int = MAX_MERGES, min_freq: int = MIN_PAIR_FREQ
) -> tuple[list[str], list[tuple[str, str]]]:
    """Learn (alphabet, merges) by classic word-frequency BPE.

    Ties are broken by the merged string, then its left part, so the result
    depends only on the input. A pair whose result is already a piece (reached
    by another split) is applied without becoming a second piece.
    """
    chars: Counter[str] = Counter()
    for word, n in words.items():
        for ch in word:
            chars[ch] += n
    alphabet = sorted(chars, key=lambda c: (-chars[c], c))
    pieces = set(alphabet)
    segs = {word: list(word) for word in sorted(words)}
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        best = _best_pair(segs, words, min_freq)
        if best is None:
            break
        joined = best[0] + best[1]
        for seg in segs.values():
            _apply_merge(seg, best)
        if joined not in pieces:
            pieces.add(joined)
            merges.append(best)
    return alphabet, merges


def _best_pair(
    segs: dict[str, list[str]], words: Counter[str], min_freq: int
) -> tuple[str, str] | None:
    counts: Counter[tuple[str, str]] = Counter()
    for word, seg in segs.items():
        for pair in pairwise(seg):
            counts[pair] += words[word]
    fit = [
        p
        for p, n in counts.items()
        if n >= min_freq and len((p[0] + p[1]).encode("utf-8")) <= MAX_PIECE_BYTES
    ]
    if not fit:
        return None
    return min(fit, key=lambda p: (-counts[p], p[0] + p[1], p[0]))


def _apply_merge(seg: list[str], pair: tuple[str, str]) -> None:
    """Merge every non-overlapping occurrence of pair, left to right, in place."""
    i = 0
    while i < len(seg) - 1:
        if seg[i] == pair[0] and seg[i + 1] == pair[1]:
            seg[i : i + 2] = [pair[0] + pair[1]]
        i += 1


def bpe_segment(word: str, merges: Sequence[tuple[str, str]]) -> list[str]:
    """Split one ▁-prefixed word by replaying merges in order (the BPE reference)."""
    seg = list(word)
    for pair in merges:
        if pair[0] in seg:
            _apply_merge(seg, pair)
    return seg


@cache
def build_vocab() -> Vocab:
    """The demo vocabulary (cached: training takes a noticeable fraction of a second)."""
    alphabet, merges = train_bpe(word_counts(CORPUS))
    tokens = ["<unk>", "<s>", "</s>", *(byte_piece(b) for b in range(256)), IM_START, IM_END]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    types += [TokenType.BYTE] * 256 + [TokenType.CONTROL] * 2
    scores = [0.0] * len(tokens)
    n_merges = len(merges)
    tokens += alphabet
    scores += [float(-n_merges - i) for i in range(len(alphabet))]
    tokens += [a + b for a, b in merges]
    scores += [float(-i) for i in range(n_merges)]
    types += [TokenType.NORMAL] * (len(alphabet) + n_merges)
    return Vocab(tuple(tokens), tuple(scores), tuple(types), tuple(merges))
