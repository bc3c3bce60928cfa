"""The steps install and uninstall are made of, and how each is run.

File writes, folder creation and command lines are ``orin.system.actions``
Actions, as in ``tune system``; uninstall --purge adds the removal of a whole
folder, which Actions do not have. A failed command is reported with its
whole output (systemctl explains itself over several lines), not only the
last line.
"""

from __future__ import annotations

import difflib
import shutil
from collections.abc import Sequence
from dataclasses import dataclass

from orin.errors import OrinError
from orin.install.sandbox import PROBE_TIMEOUT_S, CudaProbe, ProbeOutcome, interpret
from orin.system.actions import COMMAND_TIMEOUT, Action, StepError, execute
from orin.system.changes import RootRequiredError
from orin.system.commands import CommandRunner
from orin.system.root import SysRoot

MAX_OUTPUT_LINES = 20


class InstallError(OrinError):
    """install, uninstall or status cannot go on; the message says why and what to do."""


class StepFailed(InstallError):
    """A step failed; the message carries the step, its output and what was rolled back."""


@dataclass(frozen=True)
class RemoveTree:
    """Remove a folder and everything in it (uninstall --purge)."""

    path: str

    def describe(self) -> str:
        return f"rm -rf {self.path}"


Step = Action | RemoveTree | CudaProbe


@dataclass(frozen=True)
class FileChange:
    """One file install manages: what is there now and what it should hold."""

    path: str
    old: str | None
    new: str | None  # None: the file goes away

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def step(self) -> Action:
        return Action.remove(self.path) if self.new is None else Action.write(self.path, self.new)

    def undo(self) -> Action:
        return Action.remove(self.path) if self.old is None else Action.write(self.path, self.old)

    def diff(self) -> str:
        """A unified diff, as ``diff -u`` shows it; empty when nothing changes."""
        if not self.changed:
            return ""
        old = (self.old or "").splitlines(keepends=True)
        new = (self.new or "").splitlines(keepends=True)
        before = self.path if self.old is not None else "/dev/null"
        after = self.path if self.new is not None else "/dev/null"
        return "".join(difflib.unified_diff(old, new, before, after))


def read_file(root: SysRoot, path: str) -> str | None:
    """A managed file's text, None when absent; unreadable is an error, not 'absent'."""
    target = root.path(path)
    if not target.exists():
        return None
    try:
        return target.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InstallError(f"cannot read {target}: {exc}") from exc


def require_root(command: str, steps: Sequence[Step], euid: int) -> None:
    """Name every step that needs root before running any of them."""
    if euid == 0 or not steps:
        return
    listed = "\n".join(f"  {s.describe()}" for s in steps)
    raise RootRequiredError(
        f"{command} needs root for these steps:\n{listed}\n"
        f"run it with sudo, or add --dry-run to only show them"
    )


def run_probe(step: CudaProbe, runner: CommandRunner) -> ProbeOutcome:
    """The CUDA probe; a failure is a StepError naming the node, unless not required."""
    outcome = interpret(runner.run(step.argv, timeout=PROBE_TIMEOUT_S))
    if outcome.failed and step.required:
        raise StepError(step, outcome.message)
    return outcome


def run_step(step: Step, root: SysRoot, runner: CommandRunner) -> None:
    """Run one step; a failure is a StepError whose reason is the program's output."""
    if isinstance(step, CudaProbe):
        run_probe(step, runner)
        return
    if isinstance(step, RemoveTree):
        try:
            shutil.rmtree(root.path(step.path))
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StepError(Action.remove(step.path), exc.strerror or str(exc)) from exc
        return
    if step.kind != "run":
        execute(step, root, runner)
        return
    res = runner.run(step.argv, timeout=COMMAND_TIMEOUT, input=step.input)
    if not res.ok:
        raise StepError(step, f"exit status {res.returncode}\n{_output(res.stdout, res.stderr)}")


def run_all(steps: Sequence[Step], root: SysRoot, runner: CommandRunner) -> None:
    for step in steps:
        run_step(step, root, runner)


def _output(stdout: str, stderr: str) -> str:
    lines = [ln for ln in (stderr.strip() + "\n" + stdout.strip()).splitlines() if ln.strip()]
    if not lines:
        return "(no output)"
    if len(lines) > MAX_OUTPUT_LINES:
        lines = ["...", *lines[-MAX_OUTPUT_LINES:]]
    return "\n".join(f"  | {ln}" for ln in lines)
