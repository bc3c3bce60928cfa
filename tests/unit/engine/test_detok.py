from __future__ import annotations

import random

import pytest

from orin.engine.detok import Detokenizer, StopMatcher


def byte_pieces(text: str) -> tuple[list[int], dict[int, bytes]]:
    """Every byte its own token, as byte-fallback tokens are."""
    data = text.encode()
    return list(range(len(data))), {i: bytes([b]) for i, b in enumerate(data)}


def test_multibyte_characters_are_never_split() -> None:
    text = "推理在边缘 🚀 ok"
    ids, table = byte_pieces(text)
    d = Detokenizer(table.__getitem__)
    deltas = [d.add(i) for i in ids]
    for delta in deltas:
        delta.encode("utf-8")  # every delta is valid text on its own
    assert "".join(deltas) + d.flush() == text
    assert deltas[:2] == ["", ""]  # the first character waits for its third byte
    assert deltas[2] == "推"


def test_incomplete_tail_is_replaced_at_flush() -> None:
    d = Detokenizer({0: b"a", 1: b"\xe6\x8e"}.__getitem__)
    assert d.add(0) == "a"
    assert d.add(1) == ""
    assert d.flush() == "\ufffd"


def test_stop_string_split_across_pieces_is_not_leaked() -> None:
    m = StopMatcher(["</end>"])
    out = []
    for piece in ["Hello <", "/e", "nd> tail"]:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    assert out == ["Hello ", "", ""]
    assert stopped


def test_held_text_released_when_it_cannot_be_a_stop() -> None:
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("ART") == ("START", False)
    assert m.feed("x S") == ("x ", False)
    assert m.flush() == "S"


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)


@pytest.mark.parametrize("seed", range(5))
def test_random_split_points_match_whole_text_search(seed: int) -> None:
    rng = random.Random(seed)
    text = "".join(rng.choice("ab<>/xyz ") for _ in range(300))
    stop = "<x/>"
    expected = text[: text.find(stop)] if stop in text else text
    m, out, pos = StopMatcher([stop]), [], 0
    while pos < len(text):
        n = rng.randrange(1, 5)
        emitted, stopped = m.feed(text[pos : pos + n])
        out.append(emitted)
        pos += n
        if stopped:
            break
    else:
        out.append(m.flush())
    assert "".join(out) == expected


def test_no_stops_passes_through() -> None:
    assert StopMatcher([]).feed("anything") == ("anything", False)


@pytest.mark.parametrize("seed", range(5))
def test_pieces_of_any_bytes_give_the_text_of_decoding_them_together(seed: int) -> None:
    """Whole characters, characters split across pieces, bytes that are not UTF-8 and
    a piece holding the end of one character and the start of the next: the deltas
    add up to what decoding all the bytes at once gives, each one as soon as its
    characters are complete."""
    rng = random.Random(seed)
    alphabet = ["a", " ok", "é", "推理", "🚀", "\xff", "\xc3", "\x80"]
    data = b"".join(
        c.encode("latin-1") if c in ("\xff", "\xc3", "\x80") else c.encode()
        for c in rng.choices(alphabet, k=200)
    )
    cuts = sorted(rng.sample(range(1, len(data)), len(data) // 3))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    d = Detokenizer(pieces.__getitem__)
    deltas = [d.add(i) for i in range(len(pieces))] + [d.flush()]
    assert "".join(deltas) == data.decode("utf-8", errors="replace")
    seen = b""
    for i, piece in enumerate(pieces):  # nothing held back once the bytes so far end a character
        seen += piece
        try:
            whole = seen.decode()
        except UnicodeDecodeError:
            continue
        assert "".join(deltas[: i + 1]) == whole
