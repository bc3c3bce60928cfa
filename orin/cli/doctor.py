"""orin-llm doctor: every check that can be made without loading the model's weights.

Exit codes: 0 no fail, 1 at least one fail; doctor itself could not run: the
typed error's code (4 a profile that cannot be loaded, 3 a model file, ...; see
cli/errors.py), 70 a check that crashed or another bug (the message names the
check). 2 is click's alone: bad command-line usage.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from orin.cli.deps import deps
from orin.cli.errors import EXIT_INTERNAL, ClickException, exit_code_for, fail
from orin.cli.options import BoardRootOpt, CtxOpt, JsonOpt, ProfileOpt, apply_ctx, path_named
from orin.cli.output import Output
from orin.doctor.report import Report
from orin.errors import OrinError
from orin.profile.schema import Profile
from orin.profile.select import serve_profile
from orin.system.platform import Platform
from orin.system.root import SysRoot

log = logging.getLogger("orin.cli")

SEVERITY_LABEL = {"ok": "ok", "info": "info", "warn": "WARN", "fail": "FAIL"}
# Below this width the five columns would split paths and commands over lines: each
# finding is printed as a few labelled lines instead, wrapped only between words.
LIST_BELOW_COLUMNS = 100


def doctor(
    ctx: typer.Context,
    profile_name: ProfileOpt = None,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            parser=path_named,
            envvar="ORIN_LLM_MODEL",
            help="GGUF file (overrides the profile's).",
        ),
    ] = None,
    n_ctx: CtxOpt = None,
    as_json: JsonOpt = False,
    root: BoardRootOpt = Path("/"),
) -> None:
    """Diagnose the board, the llama.cpp build, the profile and the model (no weights loaded)."""
    d = deps(ctx)
    try:
        profile = serve_profile(profile_name, model)[0]  # the profile serve would run
        profile = apply_ctx(profile, n_ctx)
        context = d.doctor_context(SysRoot(root), profile, model)
        report = d.run_doctor(context)
        platform = context.platform
    except OrinError as exc:
        raise fail(f"doctor could not run: {exc}", exit_code_for(exc)) from None
    except ClickException:  # a usage error (--ctx the profile's rules refuse): exit 2
        raise
    except Exception as exc:
        log.debug("doctor failed", exc_info=True)
        message = (
            f"doctor could not run: internal error: {type(exc).__name__}: {exc} "
            "(run with ORIN_LLM_DEBUG=1 for the traceback)"
        )
        raise fail(message, EXIT_INTERNAL) from None
    _render(Output(as_json), profile, platform, report)
    if report.crashed:
        raise fail(
            f"doctor could not complete: internal error in check(s) {', '.join(report.crashed)} "
            "(run with ORIN_LLM_DEBUG=1 for the traceback)",
            report.exit_code,
        )
    raise typer.Exit(report.exit_code)


def _render(out: Output, profile: Profile, platform: Platform, report: Report) -> None:
    if out.as_json:
        out.json({"profile": profile.name, "platform": platform.to_dict(), **report.to_dict()})
        return
    out.line(escape(f"board: {platform.describe()}; profile: {profile.name}"))
    if out.out.width < LIST_BELOW_COLUMNS:
        _render_list(out, report)
    else:
        out.table(
            None,
            ("", "check", "found", "why it matters", "fix"),
            ((SEVERITY_LABEL[f.severity], f.id, f.found, f.why, f.fix) for f in report.findings),
            keep=("", "check"),
        )
    counts = ", ".join(f"{n} {s}" for s, n in report.counts().items() if n)
    out.line(f"{counts} in {report.seconds:.2f} s")


def _render_list(out: Output, report: Report) -> None:
    """Each finding as its severity and id, then found / why / fix under it (wrapped
    lines keep the indent)."""
    for f in report.findings:
        out.line(escape(f"{SEVERITY_LABEL[f.severity]:<4}  {f.id}"))
        grid = Table.grid(padding=(0, 1))
        grid.add_column(width=12, justify="right", no_wrap=True)
        grid.add_column(overflow="fold")
        for label, text in (("found:", f.found), ("why:", f.why), ("fix:", f.fix)):
            if text:
                grid.add_row(label, escape(text))
        out.print(grid)
