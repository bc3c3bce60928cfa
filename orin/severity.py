"""One severity vocabulary for every check that reports findings.

Doctor's findings, `profile validate`'s report and the KV rules of
``orin.profile.kvmatch`` all grade what they find on this one scale, so a
rule reads the same wherever it is reported:

- ``ok``: checked, nothing to change;
- ``info``: worth knowing, nothing wrong (a choice made for you, a check skipped);
- ``warn``: works, but slower, less accurate or closer to a limit than it should be;
- ``fail``: will not work as configured (doctor and `profile validate` exit 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

Severity = Literal["ok", "info", "warn", "fail"]
SEVERITY_RANK: dict[str, int] = {"ok": 0, "info": 1, "warn": 2, "fail": 3}


def worst(severities: Iterable[Severity]) -> Severity:
    """The gravest of ``severities``; ``ok`` for none."""
    return max(severities, key=SEVERITY_RANK.__getitem__, default="ok")
