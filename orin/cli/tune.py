"""orin-llm tune: measure engine settings against a profile's SLOs and write a tuned
profile; orin-llm tune system: show, apply or revert the board settings a profile asks for.

The measured tune is the group's callback (``invoke_without_command``): a bare
``orin-llm tune [options]`` runs it, and ``orin-llm tune system ...`` still reaches
the subcommand, whose arguments the callback leaves alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from orin.cli.deps import deps
from orin.cli.errors import fail, handle_errors
from orin.cli.options import JsonOpt, RootOpt
from orin.cli.output import Output
from orin.doctor.context import model_path_for
from orin.errors import OrinError
from orin.model.gguf import ModelInfo, read_model_info
from orin.profile.board import board_settings
from orin.profile.loader import load_profile
from orin.profile.schema import Profile
from orin.profile.select import serve_profile
from orin.system.changes import (
    Plan,
    apply_plan,
    board_context,
    plan_apply,
    plan_revert,
    revert_plan,
)
from orin.system.platform import Platform
from orin.system.root import SysRoot
from orin.system.statefile import DEFAULT_STATE_PATH, StateFile

if TYPE_CHECKING:
    from orin.tune.run import TuneResult, TuneSettings

EXIT_USAGE = 2  # as click reports a usage error

app = typer.Typer(
    help="Measure and choose engine settings for a profile's SLOs; `tune system` tunes the board.",
    no_args_is_help=False,
)

ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        envvar="ORIN_LLM_PROFILE",
        help="Built-in profile or YAML file (default: the built-in system defaults).",
    ),
]


@app.callback(invoke_without_command=True)
def measured(
    ctx: typer.Context,
    profile_name: Annotated[
        str | None,
        typer.Option(
            "--profile",
            envvar="ORIN_LLM_PROFILE",
            help="Built-in profile or YAML file whose slo section is tuned for (default: demo).",
        ),
    ] = None,
    model: Annotated[
        Path | None, typer.Option("--model", help="GGUF file (overrides the profile's).")
    ] = None,
    budget: Annotated[
        float, typer.Option(min=0.1, help="Minutes for the whole run, report included.")
    ] = 10.0,
    out: Annotated[
        Path | None, typer.Option("--out", help="Tuned profile YAML (default: NAME-tuned.yaml).")
    ] = None,
    report: Annotated[
        Path | None,
        typer.Option("--report", help="Report folder (default: NAME-tune-report/)."),
    ] = None,
    output_len: Annotated[
        int, typer.Option(min=2, help="Generated tokens per measured request.")
    ] = 32,
    seed: Annotated[int, typer.Option(help="Seed of prompts and of the search order.")] = 0,
    telemetry: Annotated[
        str, typer.Option(help="auto, off, or a source: jetson_sysfs, nvml, jtop, tegrastats, cpu.")
    ] = "auto",
    as_json: JsonOpt = False,
) -> None:
    """Search engine settings (batch sizes, flash attention, KV types, threads, slots, gpu
    layers; then speculative decoding, tried on the winner) on the profile's SLO prompt
    lengths and concurrency within --budget minutes; write the best as a tuned profile
    and a report."""
    if ctx.invoked_subcommand is not None:
        return
    from orin.tune.run import TuneSettings  # the engine stack loads only when tuning

    settings = TuneSettings(budget * 60, output_len, seed, telemetry)
    _run_measured(profile_name, model, settings, out, report, as_json)


@app.command("system")
@handle_errors
def system(
    ctx: typer.Context,
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
    d = deps(ctx)
    sysroot = SysRoot(root)
    state = StateFile(sysroot, state_path)
    info = _model_info(profile)
    n_layer = info.n_layer if info is not None else None
    board = board_context(sysroot, d.runner, board_settings(profile), state, n_layer=n_layer)
    plan = plan_revert(board, state) if revert else plan_apply(board, state)
    out = Output(as_json)
    if not as_json:
        _show_plan(out, plan, profile, board.platform)
    done: tuple[str, ...] | None = None
    if apply:
        done = apply_plan(board, plan, state, d.effective_uid)
    elif revert:
        done = revert_plan(board, plan, state, d.effective_uid)
    if as_json:
        data = plan.to_dict()
        data.update(profile=profile.name, platform=board.platform.to_dict(), done=done)
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


# -- the measured tune -----------------------------------------------------------------


@handle_errors
def _run_measured(
    profile_name: str | None,
    model: Path | None,
    settings: TuneSettings,
    out_path: Path | None,
    report_dir: Path | None,
    as_json: bool,
) -> None:
    profile = serve_profile(profile_name, model)[0]  # the profile serve would run
    from orin.tune import report as tune_report
    from orin.tune import tuned
    from orin.tune.run import tune

    out = Output(as_json)
    result = tune(profile, model, settings, progress=out.note)
    written = tuned.write(result, out_path or Path(f"{profile.name}-tuned.yaml"))
    folder = tune_report.write(result, report_dir or Path(f"{profile.name}-tune-report"))
    if as_json:
        out.json({**result.to_dict(), "profile_written": str(written), "report": folder})
        return
    _show_tuned(out, result)
    out.line(f"tuned profile: {written}")
    plots = "plots skipped: matplotlib is not installed" if folder["plots"] is None else "plots"
    out.line(f"report: {folder['folder']}/report.md ({plots})")


def _show_tuned(out: Output, r: TuneResult) -> None:
    before = r.baseline_m
    rows = []
    for key, p in r.chosen_m.points.items():
        b = before.points.get(key) if before is not None else None
        rows.append(
            (
                p.prompt_tokens,
                p.concurrency,
                _fmt(b.ttft_p95 if b else None),
                _fmt(p.ttft_p95),
                _fmt(b.tpot_p90 if b else None, 1),
                _fmt(p.tpot_p90, 1),
                f"{p.throughput:.1f}",
            )
        )
    out.table(
        f"tune: {r.chosen.label} (before: the profile's {r.space.baseline.label})",
        ("prompt", "streams", "TTFT_p95 before", "after", "TPOT_p90 before", "after", "tok/s"),
        rows,
    )
    verdict = "SLO met" if r.meets_slo else "SLO NOT met: the closest configuration"
    out.line(f"{verdict}; measured {r.search.spent_s:.0f} s of {r.settings.budget_s:.0f} s")
    for line in r.explanation:
        out.line(f"  {line}")
    if r.speculation is not None:
        from orin.tune.explain import speculation

        verdict_lines = speculation(r.speculation, r.measurements, r.profile.slo)
        if verdict_lines:
            out.line(f"  {verdict_lines[0]}")


def _fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f} ms"
