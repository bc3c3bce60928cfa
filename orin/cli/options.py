"""Options shared by several commands, as Annotated aliases."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from pydantic import BaseModel, ValidationError

from orin.cli.errors import usage_error
from orin.install.layout import check_service_user, check_unit_dir
from orin.profile.loader import describe_error
from orin.profile.schema import EngineSection, Profile

JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
_ROOT_HELP = "Filesystem root for /proc and /sys (a fake board tree in tests)."


def named(value: str | None) -> str | None:
    """An argument or option callback for a name or file: an empty one (``''``, a
    variable that expanded to nothing) is a usage error, not the current folder."""
    if value is not None and not value.strip():
        raise typer.BadParameter("an empty name")
    return value


def path_named(value: str | Path) -> Path:
    """Parser of every path option and argument (``parser=path_named``): an empty one
    (``''``, a variable that expanded to nothing) is a usage error, not the current
    folder (which ``Path('')`` is, and no callback could tell from ``.``). A default
    (a ``Path`` already) passes as it is."""
    if isinstance(value, Path):
        return value
    named(value)
    return Path(value)


def folder_named(value: str | Path) -> Path:
    """``path_named`` for a folder: one that is there must be a folder (a file is a
    usage error; one that is missing may be made, or is said so by the command)."""
    path = path_named(value)
    if path.exists() and not path.is_dir():
        raise typer.BadParameter(f"{path} is a file; give a folder")
    return path


def existing_folder_named(value: str | Path) -> Path:
    """``folder_named`` for a folder that must be there."""
    path = folder_named(value)
    if not path.exists():
        raise typer.BadParameter(f"{path}: no such folder")
    return path


# a root that is a file is a usage error (exit 2); commands that only write under it
# (model pull, install) create what they need there
RootOpt = Annotated[
    Path,
    typer.Option(
        "--root", envvar="ORIN_LLM_SYSROOT", help=_ROOT_HELP, hidden=True, parser=folder_named
    ),
]
# commands that read the board under it (doctor, profile validate, tune): a missing
# root is a usage error too, not a check that crashes reading it (doctor's exit 70)
BoardRootOpt = Annotated[
    Path,
    typer.Option(
        "--root",
        envvar="ORIN_LLM_SYSROOT",
        help=_ROOT_HELP,
        hidden=True,
        parser=existing_folder_named,
    ),
]


ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        envvar="ORIN_LLM_PROFILE",
        callback=named,
        help="Built-in profile or YAML file.",
    ),
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


def field_range(section: type[BaseModel], name: str) -> tuple[int, int]:
    """The bounds (ge, le) of a profile field, for the option that overrides it."""
    low = high = None
    for bound in section.model_fields[name].metadata:
        low = getattr(bound, "ge", low)
        high = getattr(bound, "le", high)
    assert isinstance(low, int) and isinstance(high, int), (section, name)
    return low, high


N = TypeVar("N", int, float)


def in_range(low: N, high: N) -> Callable[[N | None], N | None]:
    """An option callback: a number outside ``low``-``high`` is a usage error that gives
    both bounds (click's own range check names only the one crossed)."""

    def check(value: N | None) -> N | None:
        if value is not None and not low <= value <= high:
            raise typer.BadParameter(
                f"{_number(value)} is out of range: give {_number(low)} to {_number(high)}"
            )
        return value

    return check


def finite(value: float | None) -> float | None:
    """An option callback: ``inf`` passes click's lower bound but is no amount of time
    or bandwidth (a usage error rather than an overflow, or a share of 0 %, deep in
    the command)."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{_number(value)} is not a finite number")
    return value


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def check_telemetry(value: str) -> str:
    """Option callback: an unknown telemetry source is a usage error, found before
    anything loads."""
    from orin.telemetry.sources import SOURCES

    if value not in ("auto", "off", *SOURCES):
        raise typer.BadParameter(f"{value!r}: give auto, off or one of {', '.join(SOURCES)}")
    return value


def override_error(options: list[str], exc: ValidationError) -> Exception:
    """Command-line values the profile's rules refuse: a usage error (exit 2) that names
    the options given, then each rule broken ('--window 9999, --ctx 512: context.window
    (9999) exceeds engine.n_ctx (512)')."""
    problems = "; ".join(describe_error(e) for e in exc.errors())
    return usage_error(f"{', '.join(options)}: {problems}")


def revalidated(profile: Profile, data: dict[str, Any], options: list[str]) -> Profile:
    """``data`` (the profile's dump with command-line values in it) as a profile again,
    checked by the rules a profile file obeys; a refusal is a usage error naming
    ``options``."""
    try:
        return profile.revalidated(data)
    except ValidationError as exc:
        raise override_error(options, exc) from None


N_CTX_RANGE = field_range(EngineSection, "n_ctx")
CTX_HELP = (
    "Context per slot in tokens (the profile's engine.n_ctx, {} to {}); the KV cache holds "
    "this times the slot count (llama.cpp's -c is the total)."
).format(*N_CTX_RANGE)
CtxOpt = Annotated[
    int | None, typer.Option("--ctx", callback=in_range(*N_CTX_RANGE), help=CTX_HELP)
]


def file_to_write(value: Path | None) -> Path | None:
    """Option callback: a file a command writes at its end, checked at its start (a
    long run never ends on a path it cannot write): its folder exists and this user may
    write in it (or the file, when it is there), and it is not itself a folder."""
    if value is not None:
        if value.is_dir():
            raise typer.BadParameter(f"{value} is a folder; give a file name in it")
        if value.parent.exists() and not value.parent.is_dir():
            raise typer.BadParameter(f"{value.parent} is a file, not a folder")
        if not value.parent.is_dir():
            raise typer.BadParameter(f"no folder {value.parent}: create it first")
        if value.exists() and not os.access(value, os.W_OK):
            raise typer.BadParameter(f"cannot write {value}")
        if not value.exists() and not os.access(value.parent, os.W_OK | os.X_OK):
            raise typer.BadParameter(f"cannot write in {value.parent}")
    return value


def folder_to_write(value: Path | None) -> Path | None:
    """Option callback: a folder a command writes files into (made when missing, with
    the folders above it); not a file that is there already, nor a folder under a file
    or under one this user cannot write in."""
    if value is None:
        return None
    if value.exists() and not value.is_dir():
        raise typer.BadParameter(f"{value} is a file; give a folder")
    existing = next(p for p in (value, *value.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise typer.BadParameter(f"{existing} is a file, so {value} cannot be made")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"cannot write in {existing}")
    return value


OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "--output",
        "-o",
        parser=path_named,
        callback=file_to_write,
        help="Also write the result as JSON to this file.",
    ),
]


def apply_ctx(profile: Profile, n_ctx: int | None) -> Profile:
    """The profile with ``--ctx`` as its engine.n_ctx (per slot), checked against the
    profile's rules (a value they refuse is a usage error). A sliding window longer than
    the new context is dropped (the window then defaults to the context), as it is when a
    profile sets no window."""
    if n_ctx is None:
        return profile
    try:
        return profile.with_n_ctx(n_ctx)
    except ValidationError as exc:
        raise override_error([f"--ctx {n_ctx}"], exc) from None


def service_user(value: str) -> str:
    """Option callback: ``--user`` of install and install-rpc-worker is a system user
    name the units can run as, not root (a usage error, found before anything runs)."""
    try:
        return check_service_user(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def unit_dir(value: str) -> str:
    """Option callback: ``--unit-dir`` is a folder systemd loads units from (a usage
    error otherwise, before anything is read or written)."""
    try:
        return check_unit_dir(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def check_url(value: str | None) -> str | None:
    """Option callback: a server URL needs its scheme (``--url 127.0.0.1:8080`` is a
    usage error, exit 2, not a connection failure). The URL the commands get is the
    server's root: a trailing ``/`` or ``/v1`` (an OpenAI client's base URL) goes, as
    the routes they read (/health, /telemetry, /metrics) are not under /v1."""
    if value is None:
        return None
    if not value.startswith(("http://", "https://")):
        raise typer.BadParameter(f"{value!r}: give the scheme, e.g. http://127.0.0.1:8080")
    base = value.rstrip("/")
    base = base[: -len("/v1")] if base.endswith("/v1") else base
    return base.rstrip("/")
