"""Options shared by several commands, as Annotated aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
RootOpt = Annotated[
    Path,
    typer.Option(
        "--root",
        envvar="ORIN_LLM_SYSROOT",
        help="Filesystem root for /proc and /sys (a fake board tree in tests).",
        hidden=True,
    ),
]
ProfileOpt = Annotated[
    str | None,
    typer.Option("--profile", envvar="ORIN_LLM_PROFILE", help="Built-in profile or YAML file."),
]
