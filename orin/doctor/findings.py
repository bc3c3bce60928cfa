"""A doctor finding: what was found, why it matters, and the exact fix.

Severities are ``orin.severity``'s, shared with `profile validate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from orin.severity import Severity


@dataclass(frozen=True)
class Finding:
    id: str
    severity: Severity
    found: str
    why: str = ""
    fix: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
