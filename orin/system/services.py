"""systemd unit state through the injected runner (nvzramconfig, jtop)."""

from __future__ import annotations

from orin.system.commands import CommandRunner

TIMEOUT = 10.0


def _first_word(text: str) -> str | None:
    words = text.split()
    return words[0] if words else None


def unit_file_state(runner: CommandRunner, unit: str) -> str | None:
    """``enabled``, ``disabled``, ``static``, ``masked``...; None when the unit is not installed.

    ``systemctl is-enabled`` exits non-zero for disabled units too, so the
    answer is taken from stdout; a missing unit prints nothing there.
    """
    res = runner.run(("systemctl", "is-enabled", unit), timeout=TIMEOUT)
    state = _first_word(res.stdout)
    return None if state in (None, "not-found") else state


def unit_active_state(runner: CommandRunner, unit: str) -> str | None:
    """``active``, ``inactive``, ``failed``...; None when systemctl gave no answer."""
    res = runner.run(("systemctl", "is-active", unit), timeout=TIMEOUT)
    return _first_word(res.stdout)
