"""/proc/meminfo: on Orin the GPU allocates from this same pool."""

from __future__ import annotations

from dataclasses import dataclass

from orin.errors import OrinError
from orin.system.root import SysRoot


@dataclass(frozen=True)
class MemInfo:
    total: int
    available: int
    free: int
    cached: int
    swap_total: int
    swap_free: int


def parse_meminfo(text: str) -> MemInfo:
    """Parse /proc/meminfo (values in kB) into bytes."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
            values[key.strip()] = int(parts[0]) * scale
    if "MemTotal" not in values:
        raise OrinError("meminfo has no MemTotal line")
    return MemInfo(
        total=values["MemTotal"],
        # kernels before 3.14 lack MemAvailable; free + cache is its old estimate
        available=values.get("MemAvailable", values.get("MemFree", 0) + values.get("Cached", 0)),
        free=values.get("MemFree", 0),
        cached=values.get("Cached", 0),
        swap_total=values.get("SwapTotal", 0),
        swap_free=values.get("SwapFree", 0),
    )


def read_meminfo(root: SysRoot) -> MemInfo:
    text = root.read_text("/proc/meminfo")
    if text is None:
        raise OrinError(f"cannot read {root.path('/proc/meminfo')}")
    return parse_meminfo(text)
