"""One output object: rich tables for people, --json for programs.

Data goes to stdout, diagnostics to stderr. ``--json`` is a switch everywhere (JSON
on stdout instead of tables); a file is always ``--output FILE``.

Tables never cut what a user has to type: the columns named in ``keep`` (profile
names, check ids, settings) are neither wrapped nor shortened, whatever the
terminal's width; the other columns wrap their text between words onto more lines
instead of ending in an ellipsis, each at least as wide as its longest word (only a
word longer than LONG_WORD, a path or a URL, is folded); where the terminal cannot
fit that, the rows become labelled lines. A title is a line of its own, as wide as
the terminal, not the table. A reader that closes stdout early (``| head``)
ends the command quietly (errors.stdout_closed).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

from rich.console import Console, Group, RenderableType
from rich.segment import Segment, Segments
from rich.table import Table
from rich.text import Text

from orin.cli.errors import stdout_closed


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


class _Stdout(Console):
    """Rich's console for stdout, ending on a closed pipe as the rest of the CLI does
    (rich's own default exits 1, the code of a failed check)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        stdout_closed()


def _wraps(console: Console) -> bool:
    return console.is_terminal or "COLUMNS" in os.environ


class Output:
    def __init__(self, as_json: bool = False) -> None:
        self.as_json = as_json
        self.out: Console = _Stdout(highlight=False, soft_wrap=False)
        self.err = Console(stderr=True, highlight=False)

    def json(self, data: Any) -> None:
        with guard_stdout():
            sys.stdout.write(json.dumps(data, indent=2, default=str, ensure_ascii=False) + "\n")
            sys.stdout.flush()  # now, so that a closed pipe is seen here and not at exit

    def table(
        self,
        title: str | None,
        columns: Sequence[str],
        rows: Iterable[Sequence[Any]],
        keep: Collection[str] = (),
    ) -> None:
        """A table; the ``keep`` columns are printed whole on one line, the others wrap
        between words. When the terminal is too narrow for the kept columns and the
        longest word of every other column, each row is printed as labelled lines
        instead (``rows_as_list``)."""
        cells = [["-" if v is None else str(v) for v in row] for row in rows]
        if table_width(columns, cells, keep) > self.out.width:
            self.print(rows_as_list(title, columns, cells))
        else:
            self.print(make_table(title, columns, cells, keep, self.out.width))

    def pairs(self, title: str | None, items: Iterable[tuple[str, Any]]) -> None:
        self.table(title, ("field", "value"), items, keep=("field",))

    def line(self, text: str = "") -> None:
        """One line of text: wrapped between words on a terminal (or at a width COLUMNS
        asks for), never when the output goes to a file or a pipe (a log line stays one
        line for grep)."""
        with guard_stdout():
            _text(self.out, text)

    def print(self, renderable: RenderableType) -> None:
        """A table or a group of them. In a file or a pipe, each line ends at its last
        character: rich pads every cell to its column's width, which a terminal shows
        as nothing and a file keeps as trailing spaces."""
        with guard_stdout():
            if self.out.is_terminal:
                self.out.print(renderable)
            else:
                _print_stripped(self.out, renderable)

    def note(self, text: str) -> None:
        _text(self.err, text)


def _text(console: Console, text: str) -> None:
    """A line of text, wrapped as ``Output.line`` says; where it wraps in a file or a
    pipe (COLUMNS), its lines end without the space rich leaves where it broke them."""
    if not _wraps(console):
        console.print(text, soft_wrap=True)
    elif console.is_terminal:
        console.print(text)
    else:
        _print_stripped(console, console.render_str(text))


def _print_stripped(console: Console, renderable: RenderableType) -> None:
    lines = console.render_lines(renderable, pad=False)
    segments = [s for line in lines for s in (*without_trailing_spaces(line), Segment.line())]
    console.print(Segments(segments), end="")


def without_trailing_spaces(line: Sequence[Segment]) -> list[Segment]:
    """One rendered line without the spaces that end it (a cell's padding)."""
    out = list(line)
    while out and not out[-1].control:
        text = out[-1].text.rstrip(" ")
        if text:
            out[-1] = Segment(text, out[-1].style)
            break
        out.pop()
    return out


def make_table(
    title: str | None,
    columns: Sequence[str],
    rows: Iterable[Sequence[Any]],
    keep: Collection[str] = (),
    width: int | None = None,
) -> RenderableType:
    """A rich table whose ``keep`` columns are as wide as their widest cell and never
    wrap or end in an ellipsis. Given the ``width`` it must fit, the other columns
    get widths that hold their longest words (``fold_widths``); the title goes on a
    line of its own above the table, wrapped at ``width`` rather than the table's."""
    cells = [["-" if v is None else str(v) for v in row] for row in rows]
    fixed = fold_widths(columns, cells, keep, width) if width is not None else None
    t = Table(title_justify="left", show_lines=False)
    for i, c in enumerate(columns):
        if c in keep:
            t.add_column(c, no_wrap=True, overflow="ignore", min_width=_widest(cells, i, c))
        else:
            t.add_column(c, overflow="fold", width=fixed[i] if fixed else None)
    for row in cells:
        t.add_row(*row)
    return Group(Text(title), t) if title else t


MIN_FOLDED = 8  # the narrowest a folding column may get before a table becomes a list
LONG_WORD = 24  # a longer word (a path, a URL) may be folded; a shorter one stays whole


def _widest(cells: Sequence[Sequence[str]], i: int, header: str) -> int:
    lines = (line for row in cells for line in row[i].splitlines())
    return max((len(line) for line in lines), default=len(header)) if cells else len(header)


def _least(cells: Sequence[Sequence[str]], i: int, header: str) -> int:
    """The narrowest a folding column may be: its header on one line, its longest word
    (one longer than LONG_WORD counts as LONG_WORD) and MIN_FOLDED, and no more than its
    widest line."""
    words = (w for row in cells for w in row[i].split())
    longest = min(max((len(w) for w in words), default=0), LONG_WORD)
    widest = max(_widest(cells, i, header), len(header))
    return min(widest, max(MIN_FOLDED, longest, len(header)))


def table_width(
    columns: Sequence[str], cells: Sequence[Sequence[str]], keep: Collection[str]
) -> int:
    """The least width a table needs: the kept columns whole, the others as wide as
    their longest word (``_least``), three characters of border and padding per column
    and one more."""
    width = 1
    for i, c in enumerate(columns):
        if c in keep:
            width += 3 + max(_widest(cells, i, c), len(c))
        else:
            width += 3 + _least(cells, i, c)
    return width


def fold_widths(
    columns: Sequence[str], cells: Sequence[Sequence[str]], keep: Collection[str], width: int
) -> list[int] | None:
    """Widths for the columns not kept whole, in a table of at most ``width`` that
    ``table_width`` says fits: each starts as wide as its longest word, and what is left
    goes, a character at a time, to the column that still lacks the most. None when
    every column fits whole (rich sizes them then)."""
    folding = [i for i, c in enumerate(columns) if c not in keep]
    wanted = {i: max(_widest(cells, i, columns[i]), len(columns[i])) for i in folding}
    given = {i: _least(cells, i, columns[i]) for i in folding}
    room = width - table_width(columns, cells, keep)
    if sum(wanted[i] - given[i] for i in folding) <= room:
        return None
    for _ in range(room):
        i = max(folding, key=lambda j: wanted[j] - given[j])
        given[i] += 1
    return [given.get(i, 0) for i in range(len(columns))]


def rows_as_list(
    title: str | None, columns: Sequence[str], cells: Sequence[Sequence[str]]
) -> Group:
    """Each row as its first cell on a line, then ``column: value`` lines under it
    (wrapped lines keep the indent): what a table becomes on a narrow terminal."""
    parts: list[RenderableType] = [Text(title)] if title else []
    for row in cells:
        parts.append(Text(row[0]))
        grid = Table.grid(padding=(0, 1))
        grid.add_column(justify="right", no_wrap=True)
        grid.add_column(overflow="fold")
        for c, v in zip(columns[1:], row[1:], strict=True):
            grid.add_row(Text(f"  {c}:"), Text(v))
        parts.append(grid)
    return Group(*parts)


@contextmanager
def guard_stdout() -> Iterator[None]:
    """Stop quietly when stdout's reader has gone (see errors.stdout_closed)."""
    try:
        yield
    except BrokenPipeError:
        stdout_closed()


def progress_wanted(
    quiet: bool = False, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> bool:
    """A progress bar only for a person watching: not with --quiet, and not when stdout
    or stderr is not a terminal (a pipe, a file, a service's journal)."""
    streams = (stdout or sys.stdout, stderr or sys.stderr)
    return not quiet and all(s.isatty() for s in streams)


class DownloadBar:
    """A rich download bar on stderr (bytes, speed, time left): the progress that
    ``orin.model.hub.pull`` reports, for ``model pull`` and ``install``."""

    def __init__(self, description: str, total: int | None, initial: int) -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._progress.start()
        self._task = self._progress.add_task(description, total=total, completed=initial)

    def update(self, n: int) -> None:
        self._progress.advance(self._task, n)

    def close(self) -> None:
        self._progress.stop()
