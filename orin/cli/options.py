"""Options shared by several commands, as Annotated aliases."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from orin.errors import ProfileError
from orin.profile.schema import Profile

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

ApiKeyOpt = Annotated[
    str | None,
    typer.Option(
        "--api-key",
        envvar="ORIN_LLM_API_KEY",
        help="The server's API key, sent as Authorization: Bearer (a server with a key "
        "wants it on every route but /health).",
    ),
]


def bearer(api_key: str | None) -> dict[str, str]:
    """The headers that carry ``api_key``; none without one."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


CTX_HELP = (
    "Context per slot in tokens (the profile's engine.n_ctx); the KV cache holds this "
    "times the slot count (llama.cpp's -c is the total)."
)
CtxOpt = Annotated[int | None, typer.Option("--ctx", min=256, help=CTX_HELP)]
OutputOpt = Annotated[
    Path | None, typer.Option("--output", "-o", help="Also write the result as JSON to this file.")
]


def apply_ctx(profile: Profile, n_ctx: int | None) -> None:
    """``--ctx``: the profile's engine.n_ctx (per slot), checked against the profile's
    bounds. A sliding window longer than the new context is dropped (the window then
    defaults to the context), as it is when a profile sets no window."""
    if n_ctx is None:
        return
    profile.engine.n_ctx = n_ctx
    window = profile.context.window
    if window is not None and window > n_ctx:
        profile.context.window = None
    try:
        Profile.model_validate(profile.model_dump())
    except ValidationError as exc:
        problems = "; ".join(e["msg"] for e in exc.errors())
        raise ProfileError(f"--ctx {n_ctx}: {problems}") from None


def check_url(value: str | None) -> str | None:
    """Option callback: a server URL needs its scheme (``--url 127.0.0.1:8080`` is a
    usage error, exit 2, not a connection failure)."""
    if value is not None and not value.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{value!r}: give the scheme, e.g. http://127.0.0.1:8080")
    return value
