"""One table: exception type -> exit code. Messages come from the exception."""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer

from orin.errors import (
    BindError,
    DemoModelError,
    HubError,
    KVConfigError,
    LlamaCppError,
    ModelFileError,
    OrinError,
    ProfileError,
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
EXIT_INTERNAL = 70  # a bug: the message says how to get the traceback

log = logging.getLogger("orin.cli")


def exit_code_for(exc: OrinError) -> int:
    for cls in type(exc).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return 1


def fail(message: str, code: int) -> typer.Exit:
    for line in message.splitlines() or [""]:
        print(f"orin-llm: {line}", file=sys.stderr)
    return typer.Exit(code)


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Print expected errors as one line per problem and exit with the mapped code."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except OrinError as exc:
            raise fail(str(exc), exit_code_for(exc)) from None
        except (typer.Exit, typer.Abort, KeyboardInterrupt):
            raise
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
