"""Board settings changes: plan, apply and revert them as one transaction.

The plan is computed (read-only) and shown first. Apply needs root, records
each setting's previous values in the state file as soon as that setting is
done, and on a failure half-way reverts what this run changed, in reverse
order, before reporting which step failed. Revert replays the state file
backwards. Nothing here decides a value: that is each setting's plan.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from orin.errors import OrinError
from orin.system.actions import Action, StepError, execute_all
from orin.system.commands import CommandRunner
from orin.system.platform import Platform, detect
from orin.system.root import SysRoot
from orin.system.settings import (
    SETTINGS,
    SETTINGS_BY_ID,
    BoardContext,
    BoardSettings,
    Change,
    SettingError,
)
from orin.system.statefile import (
    DEFAULT_STATE_PATH,
    LEGACY_STATE_PATH,
    StateAccessError,
    StateEntry,
    StateError,
    StateFile,
)


class RootRequiredError(OrinError):
    """A change that needs root was asked for by another user."""


class ApplyError(OrinError):
    """A step failed during apply; what this run had changed was reverted."""

    def __init__(self, message: str, setting: str, rolled_back: tuple[str, ...]) -> None:
        super().__init__(message)
        self.setting = setting
        self.rolled_back = rolled_back


class RevertError(OrinError):
    """Some settings could not be restored; their entries stay in the state file."""


@dataclass(frozen=True)
class Plan:
    mode: Literal["apply", "revert"]
    changes: tuple[Change, ...]
    state_file: str

    @property
    def pending(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.needed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "state_file": self.state_file,
            "pending": [c.setting for c in self.pending],
            "changes": [c.to_dict() for c in self.changes],
        }


def board_context(
    root: SysRoot,
    runner: CommandRunner,
    settings: BoardSettings,
    state: StateFile,
    platform: Platform | None = None,
    n_layer: int | None = None,
    gpu_offload: bool | None = None,
) -> BoardContext:
    """``n_layer``: the model's layer count, which decides the mmap report when only
    some layers offload (None when there is no model to read); ``gpu_offload``:
    whether the llama.cpp build can offload (None when unknown), as for the engine."""
    return BoardContext(
        root=root,
        runner=runner,
        platform=platform if platform is not None else detect(root, runner),
        settings=settings,
        n_layer=n_layer,
        gpu_offload=gpu_offload,
        recorded=_recorded(state),
    )


def _recorded(state: StateFile) -> dict[str, Any]:
    """The saved values; a plan shown to a user who may not read root's state has none.

    Only the clocks plan looks at them (whether to store the clocks first), and
    --apply and --revert need root, which reads them.
    """
    try:
        return {e.setting: e.saved for e in state.load()}
    except StateAccessError:
        return {}


def plan_apply(ctx: BoardContext, state: StateFile) -> Plan:
    return Plan("apply", tuple(s.plan(ctx) for s in SETTINGS), str(state.location))


def plan_revert(ctx: BoardContext, state: StateFile) -> Plan:
    """The saved values, newest first, as the steps that restore them."""
    entries = state.load()
    if state.legacy_present():  # it holds the values from before the first apply
        raise StateError(
            f"{LEGACY_STATE_PATH} was written by an earlier orin-llm in a folder the service "
            f"user can write, so root does not read it; restore the settings it lists by hand "
            f"(--revert only reads {DEFAULT_STATE_PATH}), then delete it"
        )
    changes = []
    for entry in reversed(entries):
        setting = SETTINGS_BY_ID.get(entry.setting)
        if setting is None:
            raise SettingError(f"{state.location}: unknown setting '{entry.setting}'")
        changes.append(
            Change(
                entry.setting,
                entry.target,
                setting.describe_saved(entry.saved),
                setting.revert_actions(ctx, entry.saved),
                saved=entry.saved,
                note=f"applied {entry.applied_at}",
            )
        )
    return Plan("revert", tuple(changes), str(state.location))


def require_root(plan: Plan, euid: int) -> None:
    """Name every setting that needs root, with its first step, before touching any."""
    if euid == 0 or not plan.pending:
        return
    needs = "; ".join(f"{c.setting} ({_first_change(c).describe()})" for c in plan.pending)
    raise RootRequiredError(f"tune system --{plan.mode} needs root for: {needs}; run it with sudo")


def _first_change(change: Change) -> Action:
    """The first step that changes the board (not the creation of root's folder)."""
    return next((a for a in change.actions if a.kind != "mkdir"), change.actions[0])


def apply_plan(
    ctx: BoardContext, plan: Plan, state: StateFile, euid: Callable[[], int] = os.geteuid
) -> tuple[str, ...]:
    """Apply every pending change; the settings applied, in order."""
    require_root(plan, euid())
    if any(c.revertible for c in plan.pending):
        state.prepare()  # root's own folder, before any step writes into it
    before = state.entries()
    done: list[Change] = []
    for change in plan.pending:
        try:
            SETTINGS_BY_ID[change.setting].apply(ctx, change)
        except StepError as exc:
            if exc.completed or _changed_before(change, exc):  # undo its own steps too
                done.append(change)
            state.seal()
            raise _rolled_back(ctx, state, before, done, change, exc) from exc
        except BaseException:
            # stopped part-way through this setting (Ctrl-C): some of its steps may have
            # run, so what it replaced is recorded for --revert; restoring a value that
            # did not change yet does no harm
            state.seal()
            if change.revertible:
                state.record(StateEntry(change.setting, change.target, change.saved))
            raise
        state.seal()
        if change.revertible:
            state.record(StateEntry(change.setting, change.target, change.saved))
        done.append(change)
    return tuple(c.setting for c in done)


def _changed_before(change: Change, exc: StepError) -> bool:
    """Whether a step of ``change`` before the failed one changed the board: creating
    root's state folder does not (a clocks store that failed has nothing to restore)."""
    ran = change.actions[: change.actions.index(exc.action)]
    return any(a.kind != "mkdir" for a in ran)


def _rolled_back(
    ctx: BoardContext,
    state: StateFile,
    before: dict[str, StateEntry],
    done: list[Change],
    failed: Change,
    exc: StepError,
) -> ApplyError:
    """Revert this run's changes newest first; the error says what failed and what was undone."""
    undone, problems = [], []
    for change in reversed(done):
        if not change.revertible:
            continue
        try:
            SETTINGS_BY_ID[change.setting].revert(ctx, change.saved)
        except StepError as err:
            problems.append(f"{change.setting}: {err}")
            if change is failed and change.setting not in before:
                # its steps ran but were never recorded: record them now, so that
                # --revert can finish what this rollback could not
                state.record(StateEntry(change.setting, change.target, change.saved))
            continue
        undone.append(change.setting)
        if change.setting in before:
            state.record(before[change.setting])
        else:
            state.forget(change.setting)
    message = (
        f"{failed.setting} failed at `{exc.action.describe()}`: {exc.reason}; "
        f"rolled back: {', '.join(undone) or 'nothing'}"
    )
    if problems:
        message += (
            "; could not roll back "
            + "; ".join(problems)
            + f" (still listed in {state.location}: fix the cause, then run --revert)"
        )
    return ApplyError(message, failed.setting, tuple(undone))


def revert_plan(
    ctx: BoardContext, plan: Plan, state: StateFile, euid: Callable[[], int] = os.geteuid
) -> tuple[str, ...]:
    """Restore every saved setting; each restored one leaves the state file at once."""
    require_root(plan, euid())
    restored, problems = [], []
    for change in plan.pending:
        try:
            execute_all(change.actions, ctx.root, ctx.runner)
        except StepError as exc:
            problems.append(f"{change.setting}: {exc}")
            continue
        state.forget(change.setting)
        restored.append(change.setting)
    if problems:
        raise RevertError(
            "could not restore " + "; ".join(problems) + f"; still listed in {state.location}"
            f" (restored: {', '.join(restored) or 'nothing'})"
        )
    return tuple(restored)
