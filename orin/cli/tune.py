"""orin-llm tune run: measure engine settings against a profile's SLOs and write a
tuned profile; orin-llm tune system: show, apply or revert the board settings a
profile asks for.

A bare ``orin-llm tune`` prints the help and starts nothing: the search takes the
whole --budget (10 minutes by default) and should never begin by accident. ``tune
run`` starts it with the defaults; options given to ``tune`` itself (``orin-llm tune
--profile P --budget 2``) are an explicit request too and run it, as ``tune run``
with the same options would. The group's callback and ``run`` share one signature
(``functools.wraps``), so the two spellings cannot drift apart.
"""

from __future__ import annotations

import functools
import re
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from orin.cli.deps import Deps, deps
from orin.cli.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    fail,
    handle_errors,
    no_args_is_help,
    sigterm_interrupts,
    usage_error,
)
from orin.cli.help import Typer
from orin.cli.options import (
    BoardRootOpt,
    CtxOpt,
    JsonOpt,
    apply_ctx,
    check_telemetry,
    file_to_write,
    finite,
    folder_to_write,
    named,
    path_named,
)
from orin.cli.output import Output, progress_wanted
from orin.doctor.context import model_path_for
from orin.errors import OrinError, ProfileError, Terminated, interruption
from orin.model.gguf import ModelInfo, read_model_info
from orin.profile.board import board_settings
from orin.profile.loader import builtin_profile_dirs, find_profile, load_profile
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
from orin.system.root import SysRoot, untrusted_file
from orin.system.statefile import DEFAULT_STATE_PATH, StateFile

if TYPE_CHECKING:
    from orin.tune.run import TuneResult, TuneSettings

app = Typer(
    help="Measure and choose engine settings for a profile's SLOs (`tune run`); "
    "`tune system` tunes the board.",
    no_args_is_help=False,
)

ProfileOpt = Annotated[
    str | None,
    typer.Option(
        "--profile",
        envvar="ORIN_LLM_PROFILE",
        callback=named,
        help="Built-in profile or YAML file (default: the built-in system defaults).",
    ),
]


@handle_errors
def run(
    ctx: typer.Context,
    profile_name: Annotated[
        str | None,
        typer.Option(
            "--profile",
            envvar="ORIN_LLM_PROFILE",
            callback=named,
            help="Built-in profile or YAML file whose slo section is tuned for (default: the "
            "one serve runs: smollm2 when its package's model is here, else demo).",
        ),
    ] = None,
    model: Annotated[
        Path | None,
        typer.Option("--model", parser=path_named, help="GGUF file (overrides the profile's)."),
    ] = None,
    n_ctx: CtxOpt = None,
    budget: Annotated[
        float,
        typer.Option(min=0.1, callback=finite, help="Minutes for the whole run, report included."),
    ] = 10.0,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            parser=path_named,
            callback=file_to_write,
            help="Tuned profile YAML (default: NAME-tuned.yaml).",
        ),
    ] = None,
    report: Annotated[
        Path | None,
        typer.Option(
            "--report",
            parser=path_named,
            callback=folder_to_write,
            help="Report folder (default: NAME-tune-report/).",
        ),
    ] = None,
    output_len: Annotated[
        int, typer.Option(min=2, help="Generated tokens per measured request.")
    ] = 32,
    seed: Annotated[int, typer.Option(help="Seed of prompts and of the search order.")] = 0,
    telemetry: Annotated[
        str,
        typer.Option(
            callback=check_telemetry,
            help="auto, off, or a source: jetson_sysfs, nvml, jtop, tegrastats, cpu.",
        ),
    ] = "auto",
    allow_fewer_slots: Annotated[
        bool,
        typer.Option(
            "--allow-fewer-slots",
            help="Also try fewer slots than the profile's (when its SLO's largest "
            "concurrency is lower); by default tune never lowers the slot count.",
        ),
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress bar and no per-measurement lines.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Search engine settings (batch sizes, flash attention, KV types, threads, slots, gpu
    layers; then speculative decoding, tried on the winner) on the profile's SLO prompt
    lengths and concurrency within --budget minutes; write the best as a tuned profile
    and a report."""
    from orin.tune.run import TuneSettings  # the engine stack loads only when tuning

    settings = TuneSettings(
        budget * 60, output_len, seed, telemetry, allow_fewer_slots=allow_fewer_slots, n_ctx=n_ctx
    )
    given = [f"--{name.replace('_', '-')}" for name in ("ctx", "output_len")
             if _source(ctx, "n_ctx" if name == "ctx" else name) == "COMMANDLINE"]  # fmt: skip
    _run_measured(profile_name, model, settings, out, report, as_json, quiet, given)


app.command("run")(run)


def _source(ctx: typer.Context, name: str) -> str:
    """Where a parameter's value came from: COMMANDLINE, ENVIRONMENT, DEFAULT, ..."""
    source = ctx.get_parameter_source(name)
    return "" if source is None else source.name


@app.callback(invoke_without_command=True)
@functools.wraps(run)
def measured(ctx: typer.Context, **options: object) -> None:
    """A bare ``tune`` prints the help; ``tune --option ...`` runs the search as ``tune
    run --option ...`` does; options before ``system`` or ``run`` are a usage error
    (they would be ignored)."""
    given = [  # as the user typed them: --profile, not the parameter's name profile_name
        p.opts[0]
        for p in ctx.command.params
        if p.name is not None and _source(ctx, p.name) == "COMMANDLINE"
    ]
    if ctx.invoked_subcommand is not None:
        if given:
            where = (
                "after `tune run`, not before it"
                if ctx.invoked_subcommand == "run"
                else "with `tune run`; `tune system` takes its own after `system`"
            )
            raise usage_error(f"{', '.join(given)}: {where}")
        return
    if not given:
        raise no_args_is_help(ctx)
    run(ctx, **options)  # type: ignore[arg-type]


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
    root: BoardRootOpt = Path("/"),
    state_path: Annotated[
        str,
        typer.Option("--state-file", help="State file (a path under --root).", hidden=True),
    ] = DEFAULT_STATE_PATH,
) -> None:
    """Plan the board settings (swappiness, zram, power mode, clocks, NUMA, mmap, page
    cache); change them with --apply, undo with --revert. Without either, nothing changes."""
    if apply and revert:
        raise usage_error("give --apply or --revert, not both")
    d = deps(ctx)
    as_root = d.effective_uid() == 0
    profile = _system_profile(profile_name, as_root) if profile_name else Profile(name="defaults")
    sysroot = SysRoot(root)
    state = StateFile(sysroot, state_path)
    out = Output(as_json)
    info = _model_info(profile, out, as_root=as_root)
    n_layer = info.n_layer if info is not None else None
    board = board_context(
        sysroot,
        d.runner,
        board_settings(profile),
        state,
        n_layer=n_layer,
        gpu_offload=_gpu_offload(d),
    )
    plan = plan_revert(board, state) if revert else plan_apply(board, state)
    if not as_json:
        _show_plan(out, plan, profile, board.platform, apply or revert)
    done: tuple[str, ...] | None = None
    try:
        with sigterm_interrupts():
            if apply:
                done = apply_plan(board, plan, state, d.effective_uid)
            elif revert:
                done = revert_plan(board, plan, state, d.effective_uid)
    except (KeyboardInterrupt, Terminated) as exc:
        by = interruption(exc)
        code = EXIT_TERMINATED if by == "SIGTERM" else EXIT_INTERRUPTED
        raise fail(_stopped(plan, state, by), code) from None
    if as_json:
        data = plan.to_dict()
        data.update(profile=profile.name, platform=board.platform.to_dict(), done=done)
        out.json(data)
    else:
        out.line(_summary(plan, done))


def _stopped(plan: Plan, state: StateFile, by: str) -> str:
    """What an apply or revert stopped part-way left, and how to finish or undo it."""
    try:
        listed = list(state.entries())
    except OrinError as exc:  # the state file itself is the problem: say so
        return f"--{plan.mode} stopped by {by}; {exc}"
    if not listed:
        return f"--{plan.mode} stopped by {by}; nothing is listed in {state.location}"
    again = "run tune system --revert again" if plan.mode == "revert" else "tune system --revert"
    return (
        f"--{plan.mode} stopped by {by}; {state.location} lists {', '.join(listed)}: "
        f"{again} restores {'them' if len(listed) > 1 else 'it'}"
    )


def _system_profile(name: str, as_root: bool) -> Profile:
    """The profile ``tune system`` plans from. As root (``--apply`` at every boot, from
    the tuning unit) a profile file another user could write is not read: its
    settings would be root's changes to the board. Built-in profiles come with the
    program, which ``install`` checks the same way."""
    path = find_profile(name)
    if as_root and not any(path.parent == d for d in builtin_profile_dirs()):
        reason = untrusted_file(path)
        if reason is not None:
            raise ProfileError(
                f"not reading the profile {path} as root: {reason}; put it where only root "
                f"can write (sudo install -m 0644 -o root -g root {path} /etc/orin-llm/)"
            )
    return load_profile(path)


def _gpu_offload(d: Deps) -> bool | None:
    """Whether the llama.cpp build can offload, which the engine's load mode depends on
    (a CPU build maps the file even on unified memory); None when it does not import."""
    try:
        return d.build_info().gpu_offload
    except OrinError:  # LlamaCppError among them
        return None


def _model_info(profile: Profile, out: Output, as_root: bool) -> ModelInfo | None:
    """The model's layer count decides the mmap report when only some layers offload.

    As root (``--apply`` at every boot, from the tuning unit) a model file another user
    could write is not parsed: the service user owns the models it is given, and the
    count only refines a report."""
    path, _ = model_path_for(profile, None)
    if path is None or not path.is_file():
        return None
    if as_root:
        reason = SysRoot().untrusted_reason(str(path.absolute()))
        if reason is not None:
            out.note(
                f"not reading {path} as root ({reason}): the mmap report goes without the "
                "model's layer count"
            )
            return None
    try:
        return read_model_info(path)
    except OrinError:
        return None


def _plan_title(plan: Plan, acting: bool) -> str:
    """What the table is: the changes about to be made or restored, or a plan alone."""
    if not acting:
        return "plan only, nothing is changed (--apply makes these changes)"
    return "restoring the saved values" if plan.mode == "revert" else "making these changes"


def _show_plan(out: Output, plan: Plan, profile: Profile, platform: Platform, acting: bool) -> None:
    out.line(f"board: {platform.describe()}")
    if not plan.changes:  # a revert with nothing saved: no table of no rows
        out.line(f"tune system, profile {profile.name}: nothing saved in {plan.state_file}")
        return
    out.table(
        f"tune system, profile {profile.name}: {_plan_title(plan, acting)}",
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
        keep=("setting", "steps"),
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
    saved = [c.setting for c in plan.pending if c.revertible and c.setting in done]
    if not saved:  # drop-caches alone: a one-shot action, nothing recorded
        return f"applied: {', '.join(done)}; nothing to restore, so nothing saved"
    return f"applied: {', '.join(done)}; previous values saved in {plan.state_file}"


# -- the measured tune -----------------------------------------------------------------


def _run_measured(
    profile_name: str | None,
    model: Path | None,
    settings: TuneSettings,
    out_path: Path | None,
    report_dir: Path | None,
    as_json: bool,
    quiet: bool = False,
    given: Sequence[str] = (),
) -> None:
    profile, chosen_for_you = serve_profile(profile_name, model)  # the profile serve would run
    apply_ctx(profile, settings.n_ctx)  # a --ctx its rules refuse: a usage error, now
    from orin.tune import report as tune_report
    from orin.tune import tuned
    from orin.tune.run import TuneInterrupted, grid_for, tune, with_ctx

    try:  # the SLO's longest prompt and --output-len must fit a slot's context
        grid_for(with_ctx(profile, settings.n_ctx), settings.output_tokens)
    except ProfileError as exc:
        if given:  # a value the profile's rules refuse with its other settings: exit 2
            raise usage_error(f"{', '.join(given)}: {exc}") from None
        raise

    out_path, report_dir = _outputs(profile, out_path, report_dir, model)
    out = Output(as_json)
    if chosen_for_you is not None and not quiet:  # which profile a bare `tune run` tunes
        out.note(f"no --profile given: tuning {profile.name}, the profile serve runs without one")
    with TuneProgress.open(out, settings.budget_s, quiet) as bar:
        with sigterm_interrupts():  # SIGTERM (systemd, timeout) stops it as Ctrl-C does
            try:
                result = tune(profile, model, settings, progress=bar.say)
            except TuneInterrupted as exc:  # keep what was measured, then exit 130 (143)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # while writing it
                bar.stage("writing what was measured")
                _write_interrupted(out, exc.result, out_path, report_dir)
                sigterm = exc.result.interrupted_by == "SIGTERM"
                raise typer.Exit(EXIT_TERMINATED if sigterm else EXIT_INTERRUPTED) from None
            except Terminated:  # before a measurement finished: nothing to write
                message = "stopped by SIGTERM before a measurement finished"
                raise fail(message, EXIT_TERMINATED) from None
        bar.stage("writing the tuned profile and the report")
        try:  # checked at the start; what changed since is said, not an internal error
            written = tuned.write(result, out_path)
        except OSError as exc:
            message = f"cannot write the tuned profile {out_path}: {exc.strerror or exc}"
            raise fail(message, EXIT_FAILED) from None
        try:
            folder = tune_report.write(result, report_dir)
        except OSError as exc:
            raise fail(
                f"cannot write the report into {report_dir}: {exc.strerror or exc} "
                f"(the tuned profile is written: {written})",
                EXIT_FAILED,
            ) from None
    changes = [{"field": k, "profile": a, "tuned": b} for k, a, b in tuned.profile_changes(result)]
    if as_json:
        out.json(
            {
                **result.to_dict(),
                "changes": changes,
                "profile_written": str(written),
                "report": folder,
            }
        )
    else:
        _show_tuned(out, result)
        out.line("changed from the profile:" if changes else "nothing changed from the profile")
        for line in tuned.change_lines(tuned.profile_changes(result)):
            out.line(f"  {line}")
        out.line(f"tuned profile: {written}")
        plots = "plots skipped: matplotlib is not installed" if folder["plots"] is None else "plots"
        out.line(f"report: {folder['folder']}/report.md ({plots})")
    missed = _slo_missed(result)
    if missed:  # written and printed all the same; a script must not serve it unawares
        raise fail(f"{missed}; the closest configuration is in {written}", EXIT_FAILED)


def _slo_missed(r: TuneResult) -> str | None:
    """``SLO not met: ttft_p95_ms 20 ms > 0.5 ms at 256 prompt tokens x 2 streams``, or
    None when the chosen configuration meets every target (or there are none)."""
    from orin.tune.explain import streams, worst_point

    if not r.has_targets or r.meets_slo:
        return None
    slo, parts = r.profile.slo, []
    for key, goal, metric in (
        ("ttft_p95_ms", slo.ttft_p95_ms, "ttft_p95"),
        ("tpot_p90_ms", slo.tpot_p90_ms, "tpot_p90"),
    ):
        p = worst_point(r.chosen_m, metric)
        if goal is None or p is None:
            continue
        worst = getattr(p, metric)
        if worst > goal:
            where = f"{p.prompt_tokens} prompt tokens x {streams(p.concurrency)}"
            parts.append(f"{key} {worst:.{1 if metric == 'tpot_p90' else 0}f} ms > {goal:g} ms "
                         f"at {where}")  # fmt: skip
    errors = sum(p.errors for p in r.chosen_m.points.values())
    if errors:
        parts.append(f"{errors} request{'s' * (errors != 1)} failed")
    return "SLO not met: " + ", ".join(parts) if parts else "SLO not met"


def _write_interrupted(out: Output, r: TuneResult, out_path: Path, report_dir: Path) -> None:
    """After Ctrl-C: the report of what was measured, marked interrupted; the tuned
    profile only when the best measured so far meets the SLO targets (a ranking the
    search did not finish chooses nothing else); else a file at --out stays as it was."""
    from orin.tune import report as tune_report
    from orin.tune import tuned

    try:
        folder = tune_report.write(r, report_dir)
        out.note(
            f"interrupted ({r.interrupted_by}) with {len(r.measurements)} configuration(s) "
            f"measured: they are in {folder['folder']}/report.md and report.json "
            '("interrupted": true)'
        )
    except OSError as exc:
        out.note(f"interrupted; cannot write the report into {report_dir}: {exc.strerror or exc}")
    if r.has_targets and r.meets_slo:
        try:
            written = tuned.write(r, out_path)
            out.note(f"tuned profile: {written} (its settings meet the SLO targets; "
                     "the search did not finish, so a better one may exist)")  # fmt: skip
        except OSError as exc:
            out.note(f"cannot write the tuned profile {out_path}: {exc.strerror or exc}")
        return
    why = (
        "no configuration measured so far meets the SLO targets"
        if r.has_targets
        else "the profile sets no SLO targets, and the search did not finish its ranking"
    )
    kept = f" ({out_path} left as it was)" if out_path.exists() else ""
    out.note(f"no tuned profile written: {why}{kept}")


def _outputs(
    profile: Profile, out: Path | None, report: Path | None, model: Path | None = None
) -> tuple[Path, Path]:
    """The tuned profile's file and the report's folder, defaults included, checked as
    --out and --report are: a search that takes the whole budget never ends on a path
    it cannot write (a folder named like the profile file, a file named like the
    report's folder, a working directory this user cannot write in, one path for both),
    nor on the file of the profile it tunes or the --model it measures, which writing
    the tuned profile would replace."""
    if out is None:
        out = _check(file_to_write, Path(f"{profile.name}-tuned.yaml"), "--out")
    if report is None:
        report = _check(folder_to_write, Path(f"{profile.name}-tune-report"), "--report")
    for what, path in (("the profile it tunes", profile.source), ("the model", model)):
        if path is not None and out.resolve() == path.resolve():
            raise usage_error(
                f"--out {out} is {what}: the tuned profile would replace it; give another "
                "file (the tuned profile names the one it came from)"
            )
    if out.resolve() == report.resolve() or out.resolve() in report.resolve().parents:
        raise usage_error(
            f"--out {out}, --report {report}: the tuned profile is a file and the report a "
            "folder, so the report cannot be that file or in it; give another path"
        )
    return out, report


def _check(callback: Callable[[Path], Path | None], default: Path, option: str) -> Path:
    try:
        callback(default)
    except typer.BadParameter as exc:
        raise usage_error(f"{option} (default {default}): {exc.message}") from None
    return default


class TuneProgress:
    """The long steps of a tune (loading, each search round, speculation, the report)
    as one bar over the budget's seconds, with each measurement's line above it.
    Without a terminal the lines still go to stderr (a log); --quiet drops both."""

    def __init__(self, out: Output, budget_s: float, bar: Progress | None, quiet: bool) -> None:
        self.out, self.budget_s, self.bar, self.quiet = out, budget_s, bar, quiet
        self.start = time.perf_counter()
        self.task = bar.add_task("loading the model", total=budget_s) if bar else None

    @classmethod
    @contextmanager
    def open(cls, out: Output, budget_s: float, quiet: bool) -> Iterator[TuneProgress]:
        if not progress_wanted(quiet):
            yield cls(out, budget_s, None, quiet)
            return
        columns = (
            TextColumn("[bold]tune[/bold] {task.description}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("of {task.total:.0f} s"),
        )
        with Progress(*columns, console=out.err, transient=True) as bar:
            yield cls(out, budget_s, bar, quiet)

    def _elapsed(self) -> float:
        return min(time.perf_counter() - self.start, self.budget_s)

    def stage(self, text: str) -> None:
        if self.bar is not None and self.task is not None:
            self.bar.update(self.task, description=text, completed=self._elapsed())

    def say(self, line: str) -> None:
        """tune's progress callback: one line per step or measurement."""
        if self.quiet:
            return
        if self.bar is None:
            self.out.note(line)
            return
        self.bar.console.print(escape(line))
        if not line.startswith("note: "):  # a note is no step: the bar keeps the one running
            self.stage(re.split(r"[:;]", line, maxsplit=1)[0])  # "round 1 x3", "48 configurations"


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
    from orin.tune.figures import verdict as slo_verdict

    verdict = slo_verdict(r.meets_slo, r.has_targets)
    out.line(f"{verdict}; measured {r.search.spent_s:.0f} s of {r.settings.budget_s:.0f} s")
    if before is not None and before.error:  # "before: -" alone did not say why
        out.line(f"  the profile's own settings failed: {before.error}")
    for line in r.explanation:
        out.line(f"  {line}")
    if r.speculation is not None:
        from orin.tune.explain import speculation

        verdict_lines = speculation(r.speculation, r.measurements, r.profile.slo)
        if verdict_lines:
            out.line(f"  {verdict_lines[0]}")


def _fmt(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f} ms"
