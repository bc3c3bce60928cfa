"""Whether a speculative draft model shares the served model's vocabulary, from the
two GGUF headers alone.

A draft model proposes token ids that the served model verifies, so both must mean
the same text by every id. The engine checks that with llama.cpp once both models
are loaded (``orin.engine.speculative.DraftModel.check_vocab``, llama-server's
rules); this reads the same facts from the files' tokenizer fields, so that serve
refuses a mismatch before minutes of loading, and ``profile validate`` and doctor
report it beforehand. The BOS/EOS rule needs llama.cpp's per-tokenizer defaults for
a missing ``add_bos_token``, so it is left to the load-time check.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from orin.errors import ModelFileError

TOKENIZER_FIELD = "tokenizer.ggml.model"
TOKENS_FIELD = "tokenizer.ggml.tokens"

VOCAB_MAX_SIZE_DIFFERENCE = 128
"""Vocabulary sizes may differ this much (llama-server's limit): models of one family
often pad their token tables to different multiples."""
VOCAB_CHECK_START = 5
"""The first ids whose text is compared (llama-server's): the few special tokens below
are spelled differently by otherwise identical tokenizers."""
VOCAB_CHECK_HEAD = 2048
VOCAB_CHECK_SPREAD = 4096

# llama_vocab_type -> the tokenizer.ggml.model value llama.cpp reads it from
TOKENIZER_NAMES = {0: "none", 1: "llama", 2: "gpt2", 3: "bert", 4: "t5", 5: "rwkv", 6: "plamo2"}


def vocab_sample(n: int) -> list[int]:
    """Ids whose text must agree: the first VOCAB_CHECK_HEAD (special and byte tokens,
    the most frequent merges) and VOCAB_CHECK_SPREAD spread over the rest, up to the
    last. Two different tokenizers differ almost everywhere (a merge learnt in another
    order moves every later id), so this catches them at a bounded cost per start."""
    head = range(VOCAB_CHECK_START, min(n, VOCAB_CHECK_START + VOCAB_CHECK_HEAD))
    rest = n - head.stop
    if rest <= 0:
        return list(head)
    spread = range(head.stop, n, max(1, rest // VOCAB_CHECK_SPREAD))
    return [*head, *spread] if spread[-1] == n - 1 else [*head, *spread, n - 1]


def vocab_mismatch(served: Path, draft: Path) -> str | None:
    """Why ``draft`` cannot draft for ``served`` (the field that differs, with both
    values), or None when their tokenizer fields agree or a file has none (llama.cpp
    refuses that one at load). Either file unreadable is a ModelFileError."""
    from orin.model.ggufread import GGUFFormatError, open_gguf

    try:
        with open_gguf(served) as a, open_gguf(draft) as b:
            return _difference(
                a.fields.get(TOKENIZER_FIELD),
                b.fields.get(TOKENIZER_FIELD),
                a.fields.get(TOKENS_FIELD) or (),
                b.fields.get(TOKENS_FIELD) or (),
            )
    except (GGUFFormatError, OSError) as exc:
        raise ModelFileError(f"{served} or {draft}: cannot read the tokenizer: {exc}") from exc


def _difference(
    served_kind: object, draft_kind: object, served: Sequence[str], draft: Sequence[str]
) -> str | None:
    must = "a draft model must share the served model's vocabulary"
    if served_kind is None or draft_kind is None:  # no tokenizer: llama.cpp says why at load
        return None
    if served_kind != draft_kind:
        return f"{TOKENIZER_FIELD} is {draft_kind!r}, the served model's {served_kind!r}; {must}"
    if abs(len(draft) - len(served)) > VOCAB_MAX_SIZE_DIFFERENCE:
        return (
            f"{TOKENS_FIELD} has {len(draft)} tokens, the served model's {len(served)} "
            f"(sizes may differ by {VOCAB_MAX_SIZE_DIFFERENCE} at most); {must}"
        )
    for token in vocab_sample(min(len(draft), len(served))):
        if draft[token] != served[token]:
            return (
                f"{TOKENS_FIELD}[{token}] is {draft[token]!r}, the served model's "
                f"{served[token]!r}; {must}"
            )
    return None
