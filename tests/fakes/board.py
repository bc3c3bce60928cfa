"""Fake board trees under a temporary root, reached through SysRoot."""

from __future__ import annotations

from pathlib import Path

from orin.system.root import SysRoot

GiB = 1 << 30


class FakeBoard:
    def __init__(self, base: Path, systemd: bool = True) -> None:
        """``systemd``: the board booted with systemd (L4T does): /run/systemd/system."""
        self.base = base
        self.root = SysRoot(base)
        if systemd:
            self.root.path("/run/systemd/system").mkdir(parents=True, exist_ok=True)

    def write(self, system_path: str, text: str) -> Path:
        p = self.root.path(system_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    def meminfo(self, total: int = 64 * GiB, available: int = 48 * GiB) -> FakeBoard:
        kb = 1024
        self.write(
            "/proc/meminfo",
            f"MemTotal:       {total // kb} kB\n"
            f"MemFree:        {available // 2 // kb} kB\n"
            f"MemAvailable:   {available // kb} kB\n"
            f"Buffers:          123456 kB\n"
            f"Cached:         {available // 2 // kb} kB\n"
            "SwapTotal:       8388604 kB\n"
            "SwapFree:        8388604 kB\n",
        )
        return self
