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
