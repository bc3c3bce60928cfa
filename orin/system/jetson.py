"""Jetson-specific sources: device tree, L4T release, nvpmodel and jetson_clocks.

Each source has a pure ``parse_*`` function over the text the board gives
(file contents or a program's stdout), so the formats of JetPack 5 and 6 are
tested on captured lines; ``platform.detect`` does the reading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# L4T release -> JetPack release (NVIDIA's release notes; R35 = JetPack 5, R36 = JetPack 6).
JETPACK_BY_L4T = {
    "35.1.0": "5.0.2",
    "35.2.1": "5.1",
    "35.3.1": "5.1.1",
    "35.4.1": "5.1.2",
    "35.5.0": "5.1.3",
    "35.6.0": "5.1.4",
    "36.2.0": "6.0 DP",
    "36.3.0": "6.0",
    "36.4.0": "6.1",
    "36.4.3": "6.2",
    "36.4.4": "6.2.1",
}
JETPACK_MAJOR_BY_L4T_MAJOR = {32: "4", 34: "5", 35: "5", 36: "6", 38: "7"}

# Module part numbers (the device tree's compatible list names them).
MODULES = {
    "p3701-0000": "Jetson AGX Orin (p3701-0000)",
    "p3701-0004": "Jetson AGX Orin 32GB",
    "p3701-0005": "Jetson AGX Orin 64GB",
    "p3767-0000": "Jetson Orin NX 16GB",
    "p3767-0001": "Jetson Orin NX 8GB",
    "p3767-0003": "Jetson Orin Nano 8GB",
    "p3767-0004": "Jetson Orin Nano 4GB",
    "p3767-0005": "Jetson Orin Nano 8GB (developer kit)",
}

# SoC -> CUDA compute capability of its integrated GPU.
CUDA_ARCH_BY_SOC = {"tegra234": "8.7", "tegra194": "7.2", "tegra186": "6.2", "tegra210": "5.3"}

# nvpmodel modes when /etc/nvpmodel.conf cannot be read (jetson.md).
POWER_MODES_BY_MODULE = {
    "p3701-0000": {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_50W"},
    "p3701-0005": {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_50W"},
    "p3701-0004": {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_40W"},
}

_RELEASE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)")
_PART = re.compile(r"\bp\d{4}-\d{4}\b")
_NVPM_MODE = re.compile(r"NV Power Mode:\s*(\S+)")
_NVPM_CONF = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>")
_FREQS = re.compile(r"MinFreq=(\d+)\s+MaxFreq=(\d+)\s+CurrentFreq=(\d+)")


@dataclass(frozen=True)
class L4TRelease:
    major: int
    revision: str

    @property
    def version(self) -> str:
        """``35.4.1`` from R35 and REVISION 4.1."""
        return f"{self.major}.{self.revision}"

    @property
    def jetpack(self) -> str | None:
        """The JetPack release, exact when known, else the major series (``6.x``)."""
        exact = JETPACK_BY_L4T.get(self.version)
        if exact is not None:
            return exact
        major = JETPACK_MAJOR_BY_L4T_MAJOR.get(self.major)
        return f"{major}.x" if major else None


def parse_tegra_release(text: str) -> L4TRelease | None:
    """First line of /etc/nv_tegra_release: ``# R36 (release), REVISION: 4.0, ...``."""
    m = _RELEASE.search(text)
    if m is None:
        return None
    return L4TRelease(int(m.group(1)), m.group(2).strip("."))


def device_tree_strings(raw: str) -> list[str]:
    """Device-tree string properties are NUL-separated and NUL-terminated."""
    return [s.strip() for s in raw.split("\0") if s.strip()]


def parse_module(compatible: list[str]) -> str | None:
    """The module part number: ``p3737-0000+p3701-0005`` names carrier+module."""
    for entry in compatible:
        if "+" in entry:
            parts = _PART.findall(entry.rpartition("+")[2])
            if parts:
                return parts[0]
    for entry in compatible:
        parts = _PART.findall(entry)
        if parts and parts[0] in MODULES:
            return parts[0]
    return None


def parse_soc(compatible: list[str]) -> str | None:
    for entry in compatible:
        name = entry.partition(",")[2]
        if name.startswith("tegra"):
            return name
    return None


@dataclass(frozen=True)
class PowerMode:
    name: str
    id: int | None

    @property
    def is_maxn(self) -> bool:
        return self.name.upper().startswith("MAXN") or self.id == 0


def parse_nvpmodel_query(text: str) -> PowerMode | None:
    """``nvpmodel -q``: ``NV Power Mode: MODE_30W`` then the id; warnings may come first."""
    lines = [ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines):
        m = _NVPM_MODE.search(line)
        if m is None:
            continue
        mode_id = next((int(ln) for ln in lines[i + 1 :] if ln.isdigit()), None)
        return PowerMode(m.group(1), mode_id)
    return None


def parse_nvpmodel_conf(text: str) -> dict[int, str]:
    """Mode ids and names from /etc/nvpmodel.conf (``< POWER_MODEL ID=0 NAME=MAXN >``)."""
    return {int(m.group(1)): m.group(2) for m in _NVPM_CONF.finditer(text)}


@dataclass(frozen=True)
class ClockDomain:
    name: str
    min_hz: int
    max_hz: int
    current_hz: int

    @property
    def locked(self) -> bool:
        return self.min_hz == self.max_hz == self.current_hz


@dataclass(frozen=True)
class ClockState:
    """Whether CPU, GPU and EMC clocks sit at one fixed frequency (jetson_clocks)."""

    source: str
    domains: tuple[ClockDomain, ...] = field(default_factory=tuple)

    @property
    def locked(self) -> bool | None:
        if not self.domains:
            return None
        return all(d.locked for d in self.domains)

    @property
    def unlocked(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.name for d in self.domains if not d.locked))


def parse_jetson_clocks_show(text: str) -> ClockState:
    """``jetson_clocks --show``: locked when Min == Max == Current for every domain.

    CPU cores appear one per line (``cpu3: Online=1 ... MinFreq=...``); offline
    cores are skipped, the online ones count as one domain named ``CPU``.
    """
    domains: list[ClockDomain] = []
    for line in text.splitlines():
        line = line.strip()
        m = _FREQS.search(line)
        if m is None:
            continue
        lo, hi, cur = (int(g) for g in m.groups())
        if line.startswith("cpu"):
            if "Online=0" in line:
                continue
            domains.append(ClockDomain("CPU", lo, hi, cur))
        elif line.startswith(("GPU", "EMC")):
            domains.append(ClockDomain(line[:3], lo, hi, cur))
    return ClockState("jetson_clocks --show", tuple(domains))
