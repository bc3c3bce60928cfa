"""A draft model's vocabulary against the served model's, from the GGUF headers: the
rules of the load-time check (llama-server's), each refusal naming the field."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from orin.errors import ModelFileError
from orin.model.vocabmatch import vocab_mismatch

TOKENS = [f"tok{i}" for i in range(3000)]


def write(path: Path, tokens: list[str], kind: str = "llama") -> Path:
    """A GGUF header with only a tokenizer: what the check reads."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(kind)
    w.add_token_list(tokens)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_the_same_vocabulary_and_a_padded_one_pass(tmp_path: Path) -> None:
    served = write(tmp_path / "served.gguf", TOKENS)
    assert vocab_mismatch(served, write(tmp_path / "same.gguf", TOKENS)) is None
    padded = [*TOKENS, *(f"<pad{i}>" for i in range(128))]
    assert vocab_mismatch(served, write(tmp_path / "padded.gguf", padded)) is None


@pytest.mark.parametrize(
    ("tokens", "kind", "message"),
    [
        (TOKENS, "gpt2", "tokenizer.ggml.model is 'gpt2', the served model's 'llama'"),
        (TOKENS[:2871], "llama", "tokenizer.ggml.tokens has 2871 tokens, the served model's 3000"),
        (
            [*TOKENS[:2500], "other", *TOKENS[2501:]],
            "llama",
            "tokenizer.ggml.tokens[2500] is 'other', the served model's 'tok2500'",
        ),
    ],
)
def test_another_vocabulary_is_refused_by_its_field(
    tmp_path: Path, tokens: list[str], kind: str, message: str
) -> None:
    served = write(tmp_path / "served.gguf", TOKENS)
    why = vocab_mismatch(served, write(tmp_path / "draft.gguf", tokens, kind))
    assert why is not None and why.startswith(message)
    assert why.endswith("a draft model must share the served model's vocabulary")


def test_an_unreadable_file_is_a_model_file_error(tmp_path: Path) -> None:
    served = write(tmp_path / "served.gguf", TOKENS)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 40)
    with pytest.raises(ModelFileError, match=r"junk\.gguf"):
        vocab_mismatch(served, junk)
