"""Log output for long-running commands: text for people, JSON lines for collectors.

Under systemd (``JOURNAL_STREAM`` names the stderr it connected to the journal),
each line starts with its syslog priority, ``<3>`` for an error down to ``<7>``
for debug (sd-daemon(3)): journald strips the prefix and files the line at that
priority, so ``journalctl -u orin-llm -p err`` shows the errors alone. A JSON
line gets the prefix too: journald keeps the JSON object as the message, which
a collector reads ``level`` from, and without the prefix would file every line,
errors included, at its default priority (info).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

_STANDARD = set(vars(logging.makeLogRecord({})))

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# sd-daemon(3) / syslog(3) priorities: 3 err, 4 warning, 6 info, 7 debug
SYSLOG_PRIORITY = ((logging.CRITICAL, 2), (logging.ERROR, 3), (logging.WARNING, 4),
                   (logging.INFO, 6))  # fmt: skip
DEBUG_PRIORITY = 7


def syslog_priority(levelno: int) -> int:
    """The syslog priority of a logging level (a custom level counts as the next lower
    standard one)."""
    for level, priority in SYSLOG_PRIORITY:
        if levelno >= level:
            return priority
    return DEBUG_PRIORITY


def journal_stderr(stream: TextIO | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``stream`` (stderr) is the journal stream systemd connected: the
    ``device:inode`` in JOURNAL_STREAM is this file's (systemd.exec(5) says to compare,
    since a child may have redirected stderr while inheriting the variable)."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, _, ino = value.partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stream)
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


class JournalFormatter(logging.Formatter):
    """Text lines with the syslog priority prefix on every line (a traceback's lines
    too, so that they stay at the record's priority)."""

    def format(self, record: logging.LogRecord) -> str:
        prefix = f"<{syslog_priority(record.levelno)}>"
        return "\n".join(prefix + line for line in super().format(record).split("\n"))


_TERMINAL_ONLY = frozenset({"message", "color_message"})  # uvicorn's ANSI-coloured copy


class JsonFormatter(logging.Formatter):
    """One JSON object per line; an ``extra={"fields": {...}}`` dict is merged in.
    ``journal``: each line starts with its syslog priority (journald strips it)."""

    def __init__(self, journal: bool = False) -> None:
        super().__init__()
        self.journal = journal

    def format(self, record: logging.LogRecord) -> str:
        line = self._object(record)
        return f"<{syslog_priority(record.levelno)}>{line}" if self.journal else line

    def _object(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key == "fields" and isinstance(value, dict):
                out.update(value)  # structured fields (the access log) at the top level
            elif key not in _STANDARD and key not in _TERMINAL_ONLY:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def text_formatter(
    fmt: str = TEXT_FORMAT, datefmt: str | None = "%H:%M:%S", journal: bool | None = None
) -> logging.Formatter:
    """The text formatter, with priority prefixes when stderr is the journal
    (``journal=None``: find out with journal_stderr)."""
    if journal is None:
        journal = journal_stderr()
    return (JournalFormatter if journal else logging.Formatter)(fmt, datefmt)


class StderrHandler(logging.StreamHandler):
    """A handler that writes to whatever ``sys.stderr`` is at each record (as the
    logging module's last-resort handler does), not the stream of the moment it was
    made: a command run in-process with stderr captured (tests, an embedding program)
    leaves no handler behind that writes to a closed stream."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:  # StreamHandler.__init__ assigns it
        pass


def setup_logging(fmt: str = "text", journal: bool | None = None) -> None:
    """INFO to stderr (DEBUG with ORIN_LLM_DEBUG); llama.cpp's own log stays at WARNING."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, not {fmt!r}")
    handler = StderrHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(journal_stderr() if journal is None else journal))
    else:
        handler.setFormatter(text_formatter(journal=journal))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if os.environ.get("ORIN_LLM_DEBUG") else logging.INFO)
    logging.getLogger("orin.llama").setLevel(logging.WARNING)
    for noisy in ("uvicorn.access", "httpx", "sse_starlette"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
