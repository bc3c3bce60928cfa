"""One table: exception type -> exit code. Messages come from the exception.

Exit codes (README.md lists them too): 0 success, 1 the command ran and found a
problem, 2 bad command-line usage (click's own code, for every usage error and
nothing else), 3-9 the typed errors below, 70 an internal error (a bug), 141
stdout was closed before the output was written (``orin-llm ... --json | head``:
128 + SIGPIPE, what a program killed by SIGPIPE reports; nothing is printed), 130
and 143 a command stopped by Ctrl-C or SIGTERM (128 + the signal): a board change
(see ``sigterm_interrupts``), or for 130 a tune run, which writes what it measured.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import NoReturn, ParamSpec, TypeVar

import typer

from orin.cli.logs import journal_stderr
from orin.errors import (
    BindError,
    DemoModelError,
    HubError,
    KVConfigError,
    LlamaCppError,
    ModelFileError,
    OrinError,
    ProfileError,
    Terminated,
)

P = ParamSpec("P")
R = TypeVar("R")

EXIT_FAILED = 1  # the command ran and found a problem (e.g. a failing rule)
EXIT_CODES: dict[type[OrinError], int] = {
    ModelFileError: 3,
    ProfileError: 4,
    KVConfigError: 5,
    LlamaCppError: 6,
    DemoModelError: 7,
    BindError: 8,
    HubError: 9,
    OrinError: 1,
}
EXIT_USAGE = 2  # click's code for a usage error; used for nothing else
EXIT_INTERNAL = 70  # a bug: the message says how to get the traceback
EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: the reader of stdout went away (| head)
EXIT_INTERRUPTED = 130  # 128 + SIGINT: Ctrl-C stopped a board change or a tune run
EXIT_TERMINATED = 143  # 128 + SIGTERM: systemd (or kill) stopped a board change or a tune run

log = logging.getLogger("orin.cli")


def exit_code_for(exc: OrinError) -> int:
    for cls in type(exc).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1


def fail(message: str, code: int) -> typer.Exit:
    """Print the message on stderr, one ``orin-llm:`` line per problem (at the error
    priority when stderr is the journal, see logs.py), and return the exit to raise."""
    prefix = "<3>orin-llm: " if journal_stderr() else "orin-llm: "
    for line in message.splitlines() or [""]:
        print(f"{prefix}{line}", file=sys.stderr)
    return typer.Exit(code)


def _click_class(name: str) -> type[Exception]:
    """One of click's exception classes as typer raises them (typer may carry its own
    copy of click, so ``import click`` would name other classes)."""
    found = next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)
    assert issubclass(found, Exception)
    return found


ClickException = _click_class("ClickException")  # click prints it and exits with its code
UsageError = _click_class("UsageError")  # exit 2, with the command's usage line


def usage_error(message: str) -> Exception:
    """A usage mistake found after parsing (two options that exclude each other, a
    value that only makes sense with another): click prints it and exits 2."""
    return UsageError(message)


def no_args_is_help(ctx: typer.Context) -> Exception:
    """What click raises for a group called without a command: the help, exit 2."""
    cls = getattr(sys.modules[UsageError.__module__], "NoArgsIsHelpError", None)
    if cls is None:  # an older click: print the help, still a usage error
        print(ctx.get_help(), file=sys.stderr)
        return typer.Exit(EXIT_USAGE)
    err = cls(ctx)
    assert isinstance(err, Exception)
    return err


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` where the program is, as SIGINT raises
    KeyboardInterrupt, instead of ending the process on the spot: systemd stopping a
    unit (or its start timeout) sends SIGTERM, and work that must leave a record of
    what it changed (tune system --apply) gets to write it. A second SIGTERM while
    that record is written is ignored; SIGKILL still ends everything."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stdout_closed() -> NoReturn:
    """The reader of stdout is gone (``| head`` read what it wanted): stop quietly.

    Python's documented recipe (the signal module's notes on SIGPIPE): point stdout
    at /dev/null so the interpreter's final flush of what is still buffered cannot
    raise a second BrokenPipeError, then exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (a test's captured stdout)
        pass
    raise SystemExit(EXIT_STDOUT_CLOSED)


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Print expected errors as one line per problem and exit with the mapped code.

    Usage errors (click's, raised by a callback or by ``usage_error``) pass through
    to click, which prints the usage line and exits 2; a closed stdout exits quietly
    (``stdout_closed``)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except OrinError as exc:
            raise fail(str(exc), exit_code_for(exc)) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt, ClickException):
            raise
        except BrokenPipeError:
            stdout_closed()
        except Exception as exc:
            if os.environ.get("ORIN_LLM_DEBUG"):
                raise
            log.debug("internal error", exc_info=True)
            raise fail(
                f"internal error: {type(exc).__name__}: {exc} "
                "(run with ORIN_LLM_DEBUG=1 for the traceback)",
                EXIT_INTERNAL,
            ) from None

    return wrapper
