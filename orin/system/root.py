"""One injectable filesystem root for everything orin-llm reads from the system.

Production code uses ``SysRoot(Path("/"))``; tests build a fake Orin tree under
a temporary directory and pass that instead. No path to /proc, /sys or /etc is
opened anywhere else.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True)
class SysRoot:
    base: Path = Path("/")

    def path(self, system_path: str) -> Path:
        """Map an absolute system path such as ``/proc/meminfo`` under this root."""
        rel = PurePosixPath(system_path)
        if rel.is_absolute():
            rel = rel.relative_to("/")
        return self.base / rel

    def read_text(self, system_path: str) -> str | None:
        """The file's text, or None when it is missing or unreadable."""
        try:
            return self.path(system_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    def exists(self, system_path: str) -> bool:
        return self.path(system_path).exists()
