"""orin-llm tune system: show, apply or revert the board settings a profile asks for."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from orin.cli.errors import fail, handle_errors
from orin.cli.options import JsonOpt, RootOpt
from orin.cli.output import Output
from orin.doctor.context import model_path_for
from orin.errors import OrinError
from orin.model.gguf import ModelInfo, read_model_info
from orin.profile.loader import load_profile
from orin.profile.schema import Profile
from orin.system.commands import CommandRunner, SubprocessRunner
from orin.system.platform import Platform
from orin.system.root import SysRoot
from orin.system.state import DEFAULT_STATE_PATH, StateFile
from orin.system.tuner import Plan, apply_plan, plan_apply, plan_revert, revert_plan, tune_context

EXIT_USAGE = 2  # as click reports a usage error

app = typer.Typer(help="Tune the board for serving.", no_args_is_help=True)

ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        envvar="ORIN_LLM_PROFILE",
        help="Built-in profile or YAML file (default: the built-in system defaults).",
    ),
]


def make_runner() -> CommandRunner:
    """The runner for external programs (tests replace this function)."""
    return SubprocessRunner()


def effective_uid() -> int:
    """The effective uid (tests replace this function to play root or not)."""
    return os.geteuid()


@app.command("system")
@handle_errors
def system(
    profile_name: ProfileOpt = None,
    apply: Annotated[bool, typer.Option("--apply", help="Make the changes (root).")] = False,
    revert: Annotated[
        bool, typer.Option("--revert", help="Restore what the state file saved (root).")
    ] = False,
    as_json: JsonOpt = False,
    root: RootOpt = Path("/"),
    state_path: Annotated[
        str,
        typer.Option("--state-file", help="State file (a path under --root).", hidden=True),
    ] = DEFAULT_STATE_PATH,
) -> None:
    """Plan the board settings (swappiness, zram, power mode, clocks, NUMA, mmap, page
    cache); change them with --apply, undo with --revert. Without either, nothing changes."""
    if apply and revert:
        raise fail("give --apply or --revert, not both", EXIT_USAGE)
    profile = load_profile(profile_name) if profile_name else Profile(name="defaults")
    sysroot = SysRoot(root)
    state = StateFile(sysroot, state_path)
    ctx = tune_context(sysroot, make_runner(), profile, state, model=_model_info(profile))
    plan = plan_revert(ctx, state) if revert else plan_apply(ctx, state)
    out = Output(as_json)
    if not as_json:
        _show_plan(out, plan, profile, ctx.platform)
    done: tuple[str, ...] | None = None
    if apply:
        done = apply_plan(ctx, plan, state, effective_uid)
    elif revert:
        done = revert_plan(ctx, plan, state, effective_uid)
    if as_json:
        data = plan.to_dict()
        data.update(profile=profile.name, platform=ctx.platform.to_dict(), done=done)
        out.json(data)
    else:
        out.line(_summary(plan, done))


def _model_info(profile: Profile) -> ModelInfo | None:
    """The model's layer count decides the mmap report when only some layers offload."""
    path, _ = model_path_for(profile, None)
    if path is None or not path.is_file():
        return None
    try:
        return read_model_info(path)
    except OrinError:
        return None


def _show_plan(out: Output, plan: Plan, profile: Profile, platform: Platform) -> None:
    out.line(f"board: {platform.describe()}")
    out.table(
        f"tune system: {plan.mode} plan (profile {profile.name})",
        ("setting", "current", "target", "steps", "note"),
        (
            (
                c.setting,
                c.current,
                c.target,
                "\n".join(a.describe() for a in c.actions) or "no change",
                c.note,
            )
            for c in plan.changes
        ),
    )


def _summary(plan: Plan, done: tuple[str, ...] | None) -> str:
    pending = [c.setting for c in plan.pending]
    if not pending:
        return "nothing to revert" if plan.mode == "revert" else "nothing to change"
    if done is None:
        planned = ", ".join(pending)
        return f"{len(pending)} change(s) planned ({planned}); nothing changed: run with --apply"
    if plan.mode == "revert":
        return f"restored: {', '.join(done)}"
    return f"applied: {', '.join(done)}; previous values saved in {plan.state_file}"
