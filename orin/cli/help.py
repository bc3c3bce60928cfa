"""What every command's --help looks like: ``Typer`` is typer's, with commands and
groups that print a switch (``--json``, ``--version``) without a value placeholder,
an argument in the usage line as ``PATH`` or ``[NAME]`` rather than ``{path}``, and
a docstring's wrapped lines as the paragraphs they are (rich help keeps a single line
break, so a docstring wrapped at the source's width would print broken lines), and,
in a file or a pipe, lines that end at their last character (rich pads each line of
its panels to the width) and a reader that goes away ending it with 141."""

from __future__ import annotations

import contextlib
import inspect
import io
import re
import sys
from collections.abc import Callable
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from orin.cli.errors import stdout_closed


def unwrap(text: str | None) -> str | None:
    """A docstring's paragraphs, each on one line; a paragraph click is told to keep
    as it is (it starts with ``\\b``) stays as written."""
    if text is None:
        return None
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else re.sub(r"\s*\n\s*", " ", p) for p in paragraphs)


def _switches_bare(params: list[Any]) -> list[Any]:
    """Flags take no value: no ``<bool>`` after them."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


def _argument_usage(param: Any) -> str:
    name = param.metavar or (param.name or "").upper()
    if param.nargs != 1:
        name += "..."
    return name if param.required else f"[{name}]"


_TRAILING = re.compile(r"[ \t]+((?:\x1b\[[0-9;]*m)*)$", re.MULTILINE)


def _help_stripped(write_help: Callable[[], None]) -> None:
    """Run ``write_help`` (typer's rich help, printed on stdout); off a terminal, its
    lines go out without the spaces that pad them to the width (a style's closing
    escape code after them, with FORCE_COLOR, stays)."""
    if sys.stdout.isatty():
        write_help()
        return
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        write_help()
    try:
        sys.stdout.write(_TRAILING.sub(r"\1", buffer.getvalue()))
        sys.stdout.flush()  # now, so that a reader already gone is seen here
    except BrokenPipeError:  # `orin-llm --help | head -1`: exit 141, as every command
        stdout_closed()


class Command(TyperCommand):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["help"] = unwrap(kwargs.get("help"))
        super().__init__(*args, **kwargs)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _help_stripped(lambda: super(Command, self).format_help(ctx, formatter))

    def get_params(self, ctx: Any) -> list[Any]:
        return _switches_bare(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if getattr(param, "param_type_name", None) == "argument":
                pieces.append(_argument_usage(param))
            else:
                pieces.extend(param.get_usage_pieces(ctx))
        return pieces


class Group(TyperGroup):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["help"] = unwrap(kwargs.get("help"))
        super().__init__(*args, **kwargs)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        _help_stripped(lambda: super(Group, self).format_help(ctx, formatter))

    def get_params(self, ctx: Any) -> list[Any]:
        return _switches_bare(super().get_params(ctx))


class Typer(typer.Typer):
    """typer.Typer whose groups and commands are the ones above."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("cls", Group)
        super().__init__(*args, **kwargs)

    def command(self, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cls", Command)
        return super().command(*args, **kwargs)
