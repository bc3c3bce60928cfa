"""orin-llm serve: parse the options into the profile and run the server
(orin/server/main.py builds and runs it)."""

from __future__ import annotations

import logging
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from orin.cli.errors import handle_errors
from orin.cli.logs import setup_logging
from orin.cli.options import CtxOpt, ProfileOpt
from orin.profile.schema import Profile
from orin.profile.select import serve_profile
from orin.server.main import run_server

log = logging.getLogger("orin.server")


class LogFormat(str, Enum):
    """--log-format: a choice, so another value is a usage error (exit 2)."""

    text = "text"
    json = "json"


def _window(value: str | None) -> str | None:
    if value is None or value == "off" or value.isdigit():
        return value
    raise typer.BadParameter("a number of tokens or 'off'")


@handle_errors
def serve(
    profile_name: ProfileOpt = None,
    model: Annotated[
        Path | None,
        typer.Option(envvar="ORIN_LLM_MODEL", help="GGUF file (overrides the profile's)."),
    ] = None,
    host: Annotated[str | None, typer.Option(envvar="ORIN_LLM_HOST", help="Bind address.")] = None,
    port: Annotated[int | None, typer.Option(envvar="ORIN_LLM_PORT", min=1, max=65535)] = None,
    slots: Annotated[int | None, typer.Option(min=1, max=64, help="Concurrent sequences.")] = None,
    ctx: CtxOpt = None,
    window: Annotated[
        str | None,
        typer.Option(callback=_window, help="Sliding window per slot in tokens, or 'off'."),
    ] = None,
    log_format: Annotated[
        LogFormat, typer.Option(help="Log lines as text or JSON.", envvar="ORIN_LLM_LOG_FORMAT")
    ] = LogFormat.text,
    telemetry: Annotated[
        str,
        typer.Option(
            envvar="ORIN_LLM_TELEMETRY",
            help="auto, off, or a source: jetson_sysfs, nvml, jtop, tegrastats, cpu.",
        ),
    ] = "auto",
    telemetry_hz: Annotated[
        float | None,
        typer.Option(min=0.1, max=1000, help="Sampling rate; default: the source's (50 Hz)."),
    ] = None,
    record: Annotated[
        Path | None,
        typer.Option(help="Write samples, steps and requests as JSON lines to this file."),
    ] = None,
    rpc: Annotated[
        str | None,
        typer.Option(
            envvar="ORIN_LLM_RPC_WORKERS",
            help="llama.cpp RPC workers HOST:PORT[,HOST:PORT...] (orin-llm rpc-worker) to "
            "split the layers across; replaces the profile's engine.rpc.",
        ),
    ] = None,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API."""
    setup_logging(log_format.value)
    profile, note = serve_profile(profile_name, model)
    _apply_overrides(profile, host, port, slots, ctx, window)
    if rpc is not None:
        _apply_rpc(profile, rpc)
    if profile.engine.rpc:  # llama.cpp aborts on a worker it cannot reach: ask first
        from orin.engine.rpc import check_workers

        check_workers(profile.engine.rpc)
    if note:
        log.info("%s", note)
    raise typer.Exit(run_server(profile, model, telemetry, record, telemetry_hz))


def _apply_overrides(
    p: Profile,
    host: str | None,
    port: int | None,
    slots: int | None,
    ctx: int | None,
    window: str | None,
) -> None:
    if host is not None:
        p.server.host = host
    if port is not None:
        p.server.port = port
    if slots is not None:
        p.engine.n_batch = max(p.engine.n_batch, slots)
        p.engine.slots = slots
    if ctx is not None:  # per slot, as every command's --ctx (orin/cli/options.py)
        p.engine.n_ctx = ctx
        p.context.window = None  # the window follows the new context unless --window
    if window == "off":
        p.context.sliding = False
    elif window is not None:
        p.context.window = min(int(window), p.engine.n_ctx)
    Profile.model_validate(p.model_dump())  # the overrides obey the same bounds


def _apply_rpc(p: Profile, value: str) -> None:
    """--rpc replaces the profile's engine.rpc (an empty value: no workers)."""
    from orin.engine.rpc import parse_endpoints

    try:
        p.engine.rpc = list(parse_endpoints(value))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rpc") from None
