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
from orin.cli.options import (
    CtxOpt,
    ProfileOpt,
    check_telemetry,
    field_range,
    file_to_write,
    in_range,
    path_named,
    revalidated,
)
from orin.profile.schema import ContextSection, EngineSection, Profile, ServerSection
from orin.profile.select import serve_profile
from orin.server.main import run_server

log = logging.getLogger("orin.server")


class LogFormat(str, Enum):
    """--log-format: a choice, so another value is a usage error (exit 2)."""

    text = "text"
    json = "json"


WINDOW_RANGE = field_range(ContextSection, "window")
SLOTS_RANGE = field_range(EngineSection, "slots")
PORT_RANGE = field_range(ServerSection, "port")


def _window(value: str | None) -> str | None:
    """--window: 'off', or a number of tokens within context.window's bounds."""
    if value is None or value == "off":
        return value
    low, high = WINDOW_RANGE
    if value.isdigit() and low <= int(value) <= high:
        return value
    raise typer.BadParameter(f"{value!r}: give a number of tokens from {low} to {high}, or 'off'")


@handle_errors
def serve(
    profile_name: ProfileOpt = None,
    model: Annotated[
        Path | None,
        typer.Option(
            parser=path_named, envvar="ORIN_LLM_MODEL", help="GGUF file (overrides the profile's)."
        ),
    ] = None,
    host: Annotated[str | None, typer.Option(envvar="ORIN_LLM_HOST", help="Bind address.")] = None,
    port: Annotated[
        int | None,
        typer.Option(
            envvar="ORIN_LLM_PORT",
            callback=in_range(*PORT_RANGE),
            help="TCP port ({} to {}).".format(*PORT_RANGE),
        ),
    ] = None,
    slots: Annotated[
        int | None,
        typer.Option(
            callback=in_range(*SLOTS_RANGE),
            help="Concurrent sequences ({} to {}).".format(*SLOTS_RANGE),
        ),
    ] = None,
    ctx: CtxOpt = None,
    window: Annotated[
        str | None,
        typer.Option(
            callback=_window,
            help="Sliding window per slot in tokens ({} to {}, at most --ctx), or 'off'.".format(
                *WINDOW_RANGE
            ),
        ),
    ] = None,
    log_format: Annotated[
        LogFormat, typer.Option(help="Log lines as text or JSON.", envvar="ORIN_LLM_LOG_FORMAT")
    ] = LogFormat.text,
    telemetry: Annotated[
        str,
        typer.Option(
            envvar="ORIN_LLM_TELEMETRY",
            callback=check_telemetry,
            help="auto, off, or a source: jetson_sysfs, nvml, jtop, tegrastats, cpu.",
        ),
    ] = "auto",
    telemetry_hz: Annotated[
        float | None,
        typer.Option(
            callback=in_range(0.1, 1000.0),
            help="Sampling rate, 0.1 to 1000 Hz; default: the source's (50 Hz).",
        ),
    ] = None,
    record: Annotated[
        Path | None,
        typer.Option(
            parser=path_named,
            callback=file_to_write,
            help="Write samples, steps and requests as JSON lines to this file.",
        ),
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
    profile = _apply_overrides(profile, host, port, slots, ctx, window)
    if rpc is not None:
        profile = _apply_rpc(profile, rpc)
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
) -> Profile:
    """The profile with the command line's settings, checked by the rules a profile file
    obeys: values they refuse are a usage error (exit 2) naming the options."""
    data = p.model_dump()
    engine, context, server = data["engine"], data["context"], data["server"]
    given: list[str] = []  # the options a refusal names
    if host is not None:
        server["host"] = host
    if port is not None:
        server["port"] = port
    if slots is not None:
        engine["n_batch"] = max(engine["n_batch"], slots)
        engine["slots"] = slots
        given.append(f"--slots {slots}")
    if ctx is not None:  # per slot, as every command's --ctx (orin/cli/options.py)
        engine["n_ctx"] = ctx
        context["window"] = None  # the window follows the new context unless --window
        given.append(f"--ctx {ctx}")
    if window == "off":
        context["sliding"] = False
    elif window is not None:
        context["window"] = int(window)
        given.append(f"--window {window}")
    return revalidated(p, data, given or [f"--host {host}", f"--port {port}"])


def _apply_rpc(p: Profile, value: str) -> Profile:
    """The profile with --rpc as its engine.rpc (an empty value: no workers), checked by
    the profile's rules (a worker given twice, too many workers: a usage error)."""
    from orin.engine.rpc import parse_endpoints

    try:
        workers = list(parse_endpoints(value))
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--rpc") from None
    data = p.model_dump()
    data["engine"]["rpc"] = workers
    return revalidated(p, data, [f"--rpc {value}"])
