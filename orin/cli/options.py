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

CTX_HELP = (
    "Context per slot in tokens (the profile's engine.n_ctx); the KV cache holds this "
    "times the slot count (llama.cpp's -c is the total)."
)
CtxOpt = Annotated[int | None, typer.Option("--ctx", min=256, help=CTX_HELP)]
OutputOpt = Annotated[
    Path | None, typer.Option("--output", "-o", help="Also write the result as JSON to this file.")
]
