"""orin-llm doctor: every check that can be made without loading the model's weights.

Exit codes: 0 no fail, 1 at least one fail, 2 doctor itself could not run
(a profile that cannot be loaded, or a check that crashed).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from orin.cli.errors import fail
from orin.cli.options import JsonOpt, ProfileOpt, RootOpt
from orin.cli.output import Output
from orin.cli.serve import serve_profile
from orin.doctor.context import DoctorContext, free_bytes, model_path_for, probe_port
from orin.doctor.runner import EXIT_DOCTOR_FAILED, Report, run_checks
from orin.errors import OrinError
from orin.llamacpp import BuildInfo
from orin.profile.schema import Profile
from orin.system.commands import CommandRunner, SubprocessRunner
from orin.system.platform import Platform
from orin.system.root import SysRoot

log = logging.getLogger("orin.cli")

SEVERITY_LABEL = {"ok": "ok", "info": "info", "warn": "WARN", "fail": "FAIL"}


def make_runner() -> CommandRunner:
    """The runner for external programs (tests replace this function)."""
    return SubprocessRunner()


def get_build_info() -> BuildInfo:
    """What the installed llama.cpp can do (tests replace this function)."""
    from orin.llamacpp import build_info

    return build_info()


def port_probe(host: str, port: int) -> str | None:
    """Whether serve could bind its address (tests replace this function)."""
    return probe_port(host, port)


def disk_free(path: Path) -> int:
    """Free bytes on the filesystem holding path (tests replace this function)."""
    return free_bytes(path)


def doctor(
    profile_name: ProfileOpt = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model", envvar="ORIN_LLM_MODEL", help="GGUF file (overrides the profile's)."
        ),
    ] = None,
    as_json: JsonOpt = False,
    root: RootOpt = Path("/"),
) -> None:
    """Diagnose the board, the llama.cpp build, the profile and the model (no weights loaded)."""
    try:
        profile = _profile(profile_name, model)
        path, source = model_path_for(profile, model)
        ctx = DoctorContext(
            SysRoot(root),
            make_runner(),
            profile,
            path,
            source,
            build_info=lambda: get_build_info(),
            port_probe=lambda host, port: port_probe(host, port),
            disk_free=lambda path: disk_free(path),
        )
        report = run_checks(ctx)
        platform = ctx.platform
    except OrinError as exc:
        raise fail(f"doctor could not run: {exc}", EXIT_DOCTOR_FAILED) from None
    except Exception as exc:
        log.debug("doctor failed", exc_info=True)
        message = f"doctor could not run: internal error: {type(exc).__name__}: {exc}"
        raise fail(message, EXIT_DOCTOR_FAILED) from None
    _render(Output(as_json), profile, platform, report)
    raise typer.Exit(report.exit_code)


def _profile(name: str | None, model: Path | None) -> Profile:
    """The profile serve would run with the same options."""
    return serve_profile(name, model)[0]


def _render(out: Output, profile: Profile, platform: Platform, report: Report) -> None:
    if out.as_json:
        out.json({"profile": profile.name, "platform": platform.to_dict(), **report.to_dict()})
        return
    out.line(f"board: {platform.describe()}; profile: {profile.name}")
    out.table(
        None,
        ("", "check", "found", "why it matters", "fix"),
        ((SEVERITY_LABEL[f.severity], f.id, f.found, f.why, f.fix) for f in report.findings),
    )
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items() if n)
    out.line(f"{counts} in {report.seconds:.2f} s")
    if report.crashed:
        out.note(f"doctor could not complete: {', '.join(report.crashed)} (exit code 2)")
