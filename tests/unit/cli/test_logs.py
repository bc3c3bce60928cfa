"""Logs under systemd: text lines carry sd-daemon(3) priority prefixes when stderr is
the journal stream, JSON lines too (journald strips it and keeps the object)."""

from __future__ import annotations

import io
import json
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from orin.cli import logs
from orin.cli.errors import fail
from orin.cli.logs import (
    JournalFormatter,
    JsonFormatter,
    StderrHandler,
    journal_stderr,
    syslog_priority,
)


def record(level: int, message: str, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("bad value")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord("orin.server", level, __file__, 1, message, None, exc_info)


def test_syslog_priorities() -> None:
    assert [syslog_priority(lv) for lv in (logging.CRITICAL, logging.ERROR, logging.WARNING,
            logging.INFO, logging.DEBUG)] == [2, 3, 4, 6, 7]  # fmt: skip
    assert syslog_priority(logging.INFO + 5) == 6 and syslog_priority(5) == 7


def test_every_text_line_starts_with_its_priority() -> None:
    fmt = JournalFormatter("%(levelname)s %(name)s: %(message)s")
    assert fmt.format(record(logging.ERROR, "cannot bind")) == "<3>ERROR orin.server: cannot bind"
    assert fmt.format(record(logging.WARNING, "w")).startswith("<4>WARNING ")
    assert fmt.format(record(logging.INFO, "i")).startswith("<6>INFO ")
    assert fmt.format(record(logging.DEBUG, "d")).startswith("<7>DEBUG ")
    lines = fmt.format(record(logging.ERROR, "failed", exc=True)).splitlines()
    assert len(lines) > 2 and all(line.startswith("<3>") for line in lines)  # the traceback too
    assert lines[-1] == "<3>ValueError: bad value"


@pytest.fixture
def stderr_file(tmp_path: Path) -> Iterator[io.TextIOWrapper]:
    with (tmp_path / "stderr").open("w") as f:
        yield f


def journal_env(f: io.TextIOWrapper) -> dict[str, str]:
    st = os.fstat(f.fileno())
    return {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}


def test_journal_stream_is_recognised_by_device_and_inode(stderr_file: io.TextIOWrapper) -> None:
    assert journal_stderr(stderr_file, journal_env(stderr_file))
    assert not journal_stderr(stderr_file, {})
    assert not journal_stderr(stderr_file, {"JOURNAL_STREAM": "1:2"})  # stderr redirected
    assert not journal_stderr(stderr_file, {"JOURNAL_STREAM": "garbage"})
    assert not journal_stderr(io.StringIO(), journal_env(stderr_file))  # no descriptor


def test_setup_logging_under_systemd(
    stderr_file: io.TextIOWrapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in journal_env(stderr_file).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "stderr", stderr_file)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        logs.setup_logging("text")
        (handler,) = root.handlers
        assert isinstance(handler.formatter, JournalFormatter)
        assert handler.format(record(logging.ERROR, "x")).startswith("<3>")
        # JSON lines get the prefix too: journald strips it and keeps the object as the
        # message, filed at its priority (without it, every line is info)
        logs.setup_logging("json")
        (handler,) = root.handlers
        assert isinstance(handler.formatter, JsonFormatter)
        line = handler.format(record(logging.ERROR, "x"))
        assert line.startswith("<3>{") and json.loads(line[3:])["level"] == "error"
        assert handler.format(record(logging.INFO, "x")).startswith("<6>{")
        monkeypatch.delenv("JOURNAL_STREAM")
        logs.setup_logging("json")  # a terminal or a pipe: the bare object
        (handler,) = root.handlers
        assert json.loads(handler.format(record(logging.ERROR, "x")))["level"] == "error"
        logs.setup_logging("text")  # a terminal: plain text
        (handler,) = root.handlers
        assert not isinstance(handler.formatter, JournalFormatter)
        assert " ERROR orin.server: x" in handler.format(record(logging.ERROR, "x"))
        assert not handler.format(record(logging.ERROR, "x")).startswith("<")
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_error_messages_are_at_error_priority_in_the_journal(
    stderr_file: io.TextIOWrapper, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for key, value in journal_env(stderr_file).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(sys, "stderr", stderr_file)
    fail("address in use\nsecond line", 8)
    stderr_file.flush()
    text = (tmp_path / "stderr").read_text()
    assert text == "<3>orin-llm: address in use\n<3>orin-llm: second line\n"


def test_the_handler_writes_to_the_stderr_of_the_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command run in-process with stderr captured must not leave a handler bound to
    that (later closed) stream: each record goes to the current sys.stderr."""
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    handler = StderrHandler()
    log = logging.getLogger("orin.test.stderr")
    log.addHandler(handler)
    try:
        log.warning("one")
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        log.warning("two")
    finally:
        log.removeHandler(handler)
    assert second.getvalue() == "two\n"


def test_json_lines_leave_out_uvicorns_coloured_copy_of_the_message() -> None:
    record = logging.makeLogRecord(
        {"msg": "Started server process [%d]", "args": (7,), "levelno": logging.INFO,
         "levelname": "INFO", "name": "uvicorn.error",
         "color_message": "Started server process [\x1b[36m%d\x1b[0m]", "pid": 7}
    )  # fmt: skip
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "Started server process [7]" and "color_message" not in line
    assert line["pid"] == 7  # other extras stay
