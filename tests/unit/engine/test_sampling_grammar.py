"""llama.cpp's grammar parser message, taken out of what it printed to stderr."""

from __future__ import annotations

from orin.engine.sampling import parse_error

SOURCE = 'root ::= "a" | (\n  "b"'


def test_the_reason_is_taken_and_other_writes_are_passed_on() -> None:
    printed = (
        "another thread's line\n"
        f"parse: error parsing grammar: expecting ')' at \n  \"b\"\n\n{SOURCE}\n"
        "a later line\n"
    )
    why, rest = parse_error(printed, SOURCE)
    assert why == "expecting ')' at \n  \"b\""
    assert rest == "another thread's line\na later line\n"


def test_nothing_is_taken_without_the_parsers_block() -> None:
    assert parse_error("", SOURCE) == (None, "")
    other = "parse: error parsing grammar: x\n\nroot ::= another grammar\n"
    assert parse_error(other, SOURCE) == (None, other)  # not this request's grammar
