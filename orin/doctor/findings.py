"""A doctor finding: what was found, why it matters, and the exact fix."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Severity = Literal["ok", "info", "warn", "fail"]
SEVERITY_RANK: dict[str, int] = {"ok": 0, "info": 1, "warn": 2, "fail": 3}


@dataclass(frozen=True)
class Finding:
    id: str
    severity: Severity
    found: str
    why: str = ""
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def worst(severities: list[Severity]) -> Severity:
    return max(severities, key=SEVERITY_RANK.__getitem__, default="ok")
