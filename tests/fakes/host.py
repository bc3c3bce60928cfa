"""A fake host for install tests: users, groups and systemd units that commands change.

Its FakeRunner answers getent, id, useradd/usermod/userdel, chown/chmod,
journalctl and systemctl from this state, and systemd-run (the CUDA probe)
with ``probe_report``; it records every command line, so tests assert the
exact sequence and that a second install plans nothing.

Group ids: a file the test writes has the test's own group, which no fake group
has (``FAKE_GID`` differs from it); ``chown USER:GROUP FILE`` changes nothing on
disk but makes the file's group id that group's from then on, as ``getent group``
answers it, so the file is in the group it was given.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orin.system.commands import CommandResult
from tests.fakes.runner import FakeRunner

NOT_FOUND = 2  # getent's exit status for a missing key
FAKE_GID = os.getgid() + 1  # a group's id until a chown gives a file to it
QUERIES = {"getent", "id", "journalctl", "systemd-run"}  # the probe changes nothing
PROBE_OK: dict[str, Any] = {
    "status": "ok",
    "cuda": {"ok": True, "devices": 1},
    "llama": {"ok": True, "cuda": True, "offload": True},
}
SYSTEMCTL_QUERIES = {"is-enabled", "is-active", "show"}


@dataclass
class FakeHost:
    users: dict[str, set[str]] = field(default_factory=dict)  # user -> groups
    groups: set[str] = field(default_factory=lambda: {"video", "render"})
    enabled: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    fail_on: dict[tuple[str, ...], CommandResult] = field(default_factory=dict)
    journal: str = "orin-llm[42]: model loaded\n"
    probe_report: dict[str, Any] = field(default_factory=lambda: dict(PROBE_OK))
    root: Path | None = None  # the fake root chmod acts on (chown: see the module's note)
    gids: dict[str, int] = field(default_factory=dict)  # group -> id, FAKE_GID unless set
    runner: FakeRunner = field(init=False)

    def __post_init__(self) -> None:
        programs: tuple[str, ...] = ("getent", "id", "useradd", "usermod", "userdel", "chown")
        programs += ("chmod",)
        programs += ("journalctl", "systemctl", "systemd-run")
        self.runner = FakeRunner(answers={(name,): self._answer for name in programs})

    @property
    def calls(self) -> list[tuple[str, ...]]:
        return self.runner.calls

    def changes(self) -> list[tuple[str, ...]]:
        """The command lines that change something (queries left out)."""
        return [c for c in self.calls if not _is_query(c)]

    def installed(self, unit: str) -> None:
        self.enabled.add(unit)
        self.active.add(unit)

    def _answer(self, argv: tuple[str, ...]) -> CommandResult:
        for prefix, failed in self.fail_on.items():
            if argv[: len(prefix)] == prefix:
                return CommandResult(argv, failed.returncode, failed.stdout, failed.stderr)
        handler = getattr(self, "_" + argv[0].replace("-", "_"))
        result: CommandResult = handler(argv)
        return result

    def _getent(self, argv: tuple[str, ...]) -> CommandResult:
        db, key = argv[1], argv[2]
        if db == "passwd":
            found, line = key in self.users, f"{key}:x:999:\n"
        else:  # each user has a group of its own name too
            found = key in self.groups or key in self.users
            line = f"{key}:x:{self.gids.get(key, FAKE_GID)}:\n"
        return CommandResult(argv, 0 if found else NOT_FOUND, line if found else "")

    def _id(self, argv: tuple[str, ...]) -> CommandResult:
        user = argv[-1]
        if user not in self.users:
            return CommandResult(argv, 1, "", f"id: '{user}': no such user")
        return CommandResult(argv, 0, " ".join([user, *sorted(self.users[user])]) + "\n")

    def _useradd(self, argv: tuple[str, ...]) -> CommandResult:
        groups = argv[argv.index("--groups") + 1].split(",") if "--groups" in argv else []
        self.users[argv[-1]] = set(groups)
        return CommandResult(argv, 0)

    def _usermod(self, argv: tuple[str, ...]) -> CommandResult:
        self.users[argv[-1]] |= set(argv[argv.index("--groups") + 1].split(","))
        return CommandResult(argv, 0)

    def _userdel(self, argv: tuple[str, ...]) -> CommandResult:
        self.users.pop(argv[-1], None)
        return CommandResult(argv, 0)

    def _chown(self, argv: tuple[str, ...]) -> CommandResult:
        group = argv[1].partition(":")[2]
        target = self.root / argv[-1].lstrip("/") if self.root is not None else None
        if group and target is not None and target.exists():
            self.gids[group] = target.stat().st_gid
        return CommandResult(argv, 0)

    def _chmod(self, argv: tuple[str, ...]) -> CommandResult:
        target = self.root / argv[-1].lstrip("/") if self.root is not None else None
        if target is not None and target.exists():
            target.chmod(int(argv[1], 8))
        return CommandResult(argv, 0)

    def _systemd_run(self, argv: tuple[str, ...]) -> CommandResult:
        """The CUDA probe as systemd-run --wait --pipe returns it: the probe's exit status."""
        failed = self.probe_report.get("status") == "failed"
        return CommandResult(argv, 1 if failed else 0, json.dumps(self.probe_report) + "\n")

    def _journalctl(self, argv: tuple[str, ...]) -> CommandResult:
        return CommandResult(argv, 0, self.journal)

    def _systemctl(self, argv: tuple[str, ...]) -> CommandResult:
        verb, rest = argv[1], [a for a in argv[2:] if not a.startswith("--")]
        if verb == "is-enabled":
            state = "enabled" if rest[0] in self.enabled else ""
            return CommandResult(argv, 0 if state else 1, state + "\n")
        if verb == "is-active":
            unit = rest[0]
            state = "active" if unit in self.active else "inactive"
            state = "failed" if unit in self.failed else state
            return CommandResult(argv, 0 if state == "active" else 3, state + "\n")
        if verb == "show":
            state = "active" if rest[0] in self.active else "inactive"
            return CommandResult(argv, 0, f"ActiveState={state}\nSubState=running\nNRestarts=0\n")
        self._systemctl_change(verb, rest, "--now" in argv)
        return CommandResult(argv, 0)

    def _systemctl_change(self, verb: str, units: list[str], now: bool) -> None:
        if verb == "enable":
            self.enabled |= set(units)
            if now:
                self.active |= set(units)
        elif verb == "disable":
            self.enabled -= set(units)
            if now:
                self.active -= set(units)
        elif verb in ("start", "restart"):
            self.active |= set(units)


def _is_query(argv: tuple[str, ...]) -> bool:
    if argv[0] in QUERIES:
        return True
    return argv[0] == "systemctl" and argv[1] in SYSTEMCTL_QUERIES
