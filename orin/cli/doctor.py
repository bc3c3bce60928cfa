"""orin-llm doctor: every check that can be made without loading the model's weights.

Exit codes: 0 no fail, 1 at least one fail, 2 doctor itself could not run
(a profile that cannot be loaded, or a check that crashed).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from orin.cli.deps import deps
from orin.cli.errors import fail
from orin.cli.options import JsonOpt, ProfileOpt, RootOpt
from orin.cli.output import Output
from orin.doctor.report import EXIT_DOCTOR_FAILED, Report
from orin.errors import OrinError
from orin.profile.schema import Profile
from orin.profile.select import serve_profile
from orin.system.platform import Platform
from orin.system.root import SysRoot

log = logging.getLogger("orin.cli")

SEVERITY_LABEL = {"ok": "ok", "info": "info", "warn": "WARN", "fail": "FAIL"}


def doctor(
    ctx: typer.Context,
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
    d = deps(ctx)
    try:
        profile = serve_profile(profile_name, model)[0]  # the profile serve would run
        context = d.doctor_context(SysRoot(root), profile, model)
        report = d.run_doctor(context)
        platform = context.platform
    except OrinError as exc:
        raise fail(f"doctor could not run: {exc}", EXIT_DOCTOR_FAILED) from None
    except Exception as exc:
        log.debug("doctor failed", exc_info=True)
        message = f"doctor could not run: internal error: {type(exc).__name__}: {exc}"
        raise fail(message, EXIT_DOCTOR_FAILED) from None
    _render(Output(as_json), profile, platform, report)
    raise typer.Exit(report.exit_code)


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
