"""The concrete steps a system change is made of, and the one function that runs them.

A setting's plan is a list of Actions (write this text to that file, remove
that file, create that folder, run this command line). Printing them is the plan; executing them
is apply or revert. Keeping the steps as data is what lets a plan be shown
before anything changes and lets tests assert the exact command lines.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from orin.errors import OrinError
from orin.system.commands import CommandRunner
from orin.system.root import SysRoot

ActionKind = Literal["write", "remove", "mkdir", "run"]
COMMAND_TIMEOUT = 60.0


class Describable(Protocol):
    """A step that can say what it does in one line (an Action, or an install step)."""

    def describe(self) -> str: ...


class StepError(OrinError):
    """One step of a system change failed; the message names the step and the reason."""

    def __init__(self, action: Describable, reason: str, completed: bool = False) -> None:
        """``completed``: the step itself ran and may have changed something (a mode
        switch that nvpmodel took but that waits for a reboot), so undoing its
        setting is needed even when it is the setting's first step."""
        super().__init__(f"{action.describe()}: {reason}")
        self.action = action
        self.reason = reason
        self.completed = completed


@dataclass(frozen=True)
class Action:
    kind: ActionKind
    path: str | None = None  # system path (under SysRoot) for write and remove
    content: str | None = None
    argv: tuple[str, ...] = ()
    input: str | None = None  # stdin for a command that may prompt

    @staticmethod
    def write(path: str, content: str) -> Action:
        return Action("write", path=path, content=content)

    @staticmethod
    def remove(path: str) -> Action:
        return Action("remove", path=path)

    @staticmethod
    def mkdir(path: str) -> Action:
        return Action("mkdir", path=path)

    @staticmethod
    def run(*argv: str, input: str | None = None) -> Action:
        return Action("run", argv=tuple(argv), input=input)

    def describe(self) -> str:
        """One line a person can check, or paste into a root shell."""
        if self.kind == "run":
            return shlex.join(self.argv)
        if self.kind == "remove":
            return f"rm -f {self.path}"
        if self.kind == "mkdir":
            return f"mkdir -p {self.path}"
        text = self.content or ""
        if "\n" not in text.rstrip("\n"):
            return f"echo {shlex.quote(text.rstrip())} > {self.path}"
        return f"write {self.path} ({len(text.splitlines())} lines)"

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "describe": self.describe()}
        if self.kind == "run":
            d["argv"] = list(self.argv)
        else:
            d["path"] = self.path
        if self.kind == "write":
            d["content"] = self.content
        return d


def execute(action: Action, root: SysRoot, runner: CommandRunner) -> None:
    """Run one step; any failure is a StepError carrying the program's own message."""
    if action.kind == "run":
        res = runner.run(action.argv, timeout=COMMAND_TIMEOUT, input=action.input)
        if not res.ok:
            detail = (res.stderr or res.stdout).strip().splitlines()
            reason = detail[-1] if detail else "no output"
            raise StepError(action, f"exit status {res.returncode}: {reason}")
        return
    assert action.path is not None
    target = root.path(action.path)
    try:
        if action.kind == "remove":
            target.unlink(missing_ok=True)
        elif action.kind == "mkdir":
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(action.content or "", encoding="utf-8")
    except OSError as exc:
        raise StepError(action, exc.strerror or str(exc)) from exc


def execute_all(actions: tuple[Action, ...], root: SysRoot, runner: CommandRunner) -> None:
    for action in actions:
        execute(action, root, runner)
