"""llama.cpp's log callback and nested captures."""

from __future__ import annotations

from orin import llamacpp


def test_nested_captures_with_the_same_lines_each_end_cleanly() -> None:
    with llamacpp.capture_log() as outer:
        with llamacpp.capture_log() as inner:
            llamacpp._on_log(2, b"load_tensors: offloaded 3/3 layers\n", None)
        # the inner sink equals the outer one here; ending it must not end the outer
        assert inner == outer == ["load_tensors: offloaded 3/3 layers\n"]
        llamacpp._on_log(2, b"after\n", None)
    assert outer[-1] == "after\n" and len(inner) == 1
    assert not llamacpp._captures
