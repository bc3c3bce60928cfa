"""What install and uninstall need to know about the machine, asked through the runner.

The user and groups come from ``getent`` and ``id`` (so NSS sources count,
not only /etc/passwd), the units' states from ``systemctl``. Gathered once,
read-only, before anything is planned: a plan is a pure function of these
facts, so running install twice with nothing changed plans nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from orin.install.layout import GPU_GROUPS, SERVICE, UNITS
from orin.install.steps import InstallError
from orin.system.commands import CommandRunner
from orin.system.root import SysRoot
from orin.system.services import unit_active_state, unit_file_state

TIMEOUT = 10.0


@dataclass(frozen=True)
class HostFacts:
    user: str
    user_exists: bool
    primary_group: str | None = None
    group_gid: int | None = None  # the primary group's, from getent (None: no such group yet)
    user_groups: frozenset[str] = frozenset()
    groups_present: tuple[str, ...] = ()  # those of GPU_GROUPS that exist here
    enabled: dict[str, str | None] = field(default_factory=dict)  # systemctl is-enabled
    active: dict[str, str | None] = field(default_factory=dict)  # systemctl is-active

    @property
    def service_active(self) -> bool:
        return self.active.get(SERVICE) == "active"

    def is_enabled(self, unit: str) -> bool:
        return self.enabled.get(unit) == "enabled"

    def is_active(self, unit: str) -> bool:
        return self.active.get(unit) == "active"

    @property
    def missing_groups(self) -> tuple[str, ...]:
        """GPU groups that exist but the user is not in."""
        return tuple(g for g in self.groups_present if g not in self.user_groups)


def gather(runner: CommandRunner, user: str, units: Iterable[str] = UNITS) -> HostFacts:
    exists = _getent(runner, "passwd", user)
    groups: frozenset[str] = frozenset()
    primary = None
    if exists:
        res = runner.run(("id", "-nG", user), timeout=TIMEOUT)
        words = res.stdout.split() if res.ok else []
        groups = frozenset(words)
        primary = words[0] if words else None
    unit_list = tuple(units)
    return HostFacts(
        user=user,
        user_exists=exists,
        primary_group=primary,
        group_gid=_gid(runner, primary) if primary is not None else None,
        user_groups=groups,
        groups_present=tuple(g for g in GPU_GROUPS if _getent(runner, "group", g)),
        enabled={u: unit_file_state(runner, u) for u in unit_list},
        active={u: unit_active_state(runner, u) for u in unit_list},
    )


def _getent(runner: CommandRunner, database: str, key: str) -> bool:
    return runner.run(("getent", database, key), timeout=TIMEOUT).ok


def _gid(runner: CommandRunner, group: str) -> int | None:
    """A group's id from its ``getent group`` line (``name:x:gid:members``)."""
    res = runner.run(("getent", "group", group), timeout=TIMEOUT)
    fields = res.stdout.strip().split(":") if res.ok else []
    return int(fields[2]) if len(fields) > 2 and fields[2].isdigit() else None


def require_systemd(root: SysRoot) -> None:
    """Stop before any change on a machine where systemd is not the init system
    (sd_booted(3): /run/systemd/system exists only then): every unit install writes
    would be for nothing, and ``systemctl`` fails after the user and files exist."""
    if not root.path("/run/systemd/system").is_dir():
        raise InstallError(
            "systemd is not running on this machine (no /run/systemd/system), and the "
            "service needs it: run `orin-llm serve` under your own supervisor, or the "
            "container image (docs/fleet.md)"
        )
