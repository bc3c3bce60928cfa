"""One output object: rich tables for people, --json for programs.

Data goes to stdout, diagnostics to stderr.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


class Output:
    def __init__(self, as_json: bool = False) -> None:
        self.as_json = as_json
        self.out = Console(highlight=False, soft_wrap=False)
        self.err = Console(stderr=True, highlight=False)

    def json(self, data: Any) -> None:
        print(json.dumps(data, indent=2, default=str, ensure_ascii=False))

    def table(
        self, title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]
    ) -> None:
        t = Table(title=title, title_justify="left", show_lines=False)
        for c in columns:
            t.add_column(c)
        for row in rows:
            t.add_row(*("-" if v is None else str(v) for v in row))
        self.out.print(t)

    def pairs(self, title: str | None, items: Iterable[tuple[str, Any]]) -> None:
        self.table(title, ("field", "value"), items)

    def line(self, text: str = "") -> None:
        self.out.print(text)

    def note(self, text: str) -> None:
        self.err.print(text)
