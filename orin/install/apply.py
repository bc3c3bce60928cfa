"""Carry out an install or uninstall plan; an install that fails half-way is undone.

Root is checked for every step before the first one runs. Install writes the
files, then runs systemctl; when a step fails, the files it wrote get their
previous content back (or are removed), units it enabled are disabled again,
and systemd reloads, so no half-installed unit is left behind. The user and
the folders stay: they are harmless, and the next install reuses them.
"""

from __future__ import annotations

from orin.install.host import HostFacts
from orin.install.layout import UNITS
from orin.install.plan import InstallPlan, UninstallPlan
from orin.install.steps import (
    FileChange,
    Step,
    StepFailed,
    require_root,
    run_all,
    run_probe,
    run_step,
)
from orin.system.actions import Action, StepError
from orin.system.commands import CommandRunner
from orin.system.root import SysRoot


def apply_install(
    plan: InstallPlan, facts: HostFacts, root: SysRoot, runner: CommandRunner, euid: int
) -> tuple[str, ...]:
    """Run the plan; what the CUDA probe found, for the report.

    The probe runs after the user and the files exist and before systemctl
    enables anything: a sandbox CUDA cannot start in is rolled back like any
    failed step (with --force it is only reported).
    """
    require_root("install", plan.steps, euid)
    try:
        run_all(plan.prepare, root, runner)
    except StepError as exc:
        raise StepFailed(f"install failed at `{exc.action.describe()}`: {exc.reason}") from exc
    written: list[FileChange] = []
    attempted: list[Step] = []
    found: list[str] = []
    try:
        for change in plan.changed_files:
            run_step(change.step(), root, runner)
            written.append(change)
        for step in plan.secure:
            attempted.append(step)
            run_step(step, root, runner)
        for probe in plan.probe:
            outcome = run_probe(probe, runner)
            found.append(
                f"CUDA probe FAILED ({outcome.message})" if outcome.failed else outcome.message
            )
        for step in plan.activate:
            attempted.append(step)
            run_step(step, root, runner)
    except StepError as exc:
        undone = _roll_back(facts, written, attempted, root, runner)
        raise StepFailed(
            f"install failed at `{exc.action.describe()}`: {exc.reason}\n"
            f"rolled back: {'; '.join(undone) or 'nothing to undo'}"
        ) from exc
    return tuple(found)


def _roll_back(
    facts: HostFacts,
    written: list[FileChange],
    attempted: list[Step],
    root: SysRoot,
    runner: CommandRunner,
) -> list[str]:
    """Undo this run's file writes and enables; report each undo step, failed ones too.

    An enable that failed may still have enabled some units, so an attempted
    enable counts as done.
    """
    steps: list[Step] = []
    enabled_now = [u for u in UNITS if not facts.is_enabled(u)]
    if enabled_now and any(_is_enable(s) for s in attempted):
        steps.append(Action.run("systemctl", "disable", *enabled_now))
    steps += [change.undo() for change in reversed(written)]
    if written:
        steps.append(Action.run("systemctl", "daemon-reload"))
    report = []
    for step in steps:
        try:
            run_step(step, root, runner)
        except StepError as err:
            report.append(f"{step.describe()} FAILED ({err.reason.splitlines()[0]})")
            continue
        report.append(step.describe())
    return report


def _is_enable(step: Step) -> bool:
    return isinstance(step, Action) and step.argv[:2] == ("systemctl", "enable")


def apply_uninstall(plan: UninstallPlan, root: SysRoot, runner: CommandRunner, euid: int) -> None:
    require_root("uninstall", plan.steps, euid)
    try:
        run_all(plan.steps, root, runner)
    except StepError as exc:
        raise StepFailed(f"uninstall failed at `{exc.action.describe()}`: {exc.reason}") from exc
