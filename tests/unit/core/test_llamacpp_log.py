"""llama.cpp's log callback, nested captures, and its stderr caught around a call."""

from __future__ import annotations

import os

import pytest

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


def test_with_stderr_catches_what_the_process_writes_to_fd_2_and_restores_it(
    capfd: pytest.CaptureFixture[str],
) -> None:
    def printing() -> int:
        os.write(2, b"parse: error parsing grammar: oops\n")
        os.write(2, b"another line\n")
        return 7

    result, text = llamacpp.with_stderr(printing)
    assert result == 7
    assert text == "parse: error parsing grammar: oops\nanother line\n"
    os.write(2, b"after\n")
    llamacpp.pass_on("not ours\n")
    assert capfd.readouterr().err == "after\nnot ours\n"


def test_with_stderr_restores_fd_2_when_the_function_raises(
    capfd: pytest.CaptureFixture[str],
) -> None:
    def failing() -> None:
        os.write(2, b"half a line")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        llamacpp.with_stderr(failing)
    os.write(2, b"back\n")
    assert capfd.readouterr().err == "back\n"
