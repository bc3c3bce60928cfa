"""Jetson-specific sources: device tree, L4T release, nvpmodel and jetson_clocks.

Each source has a pure ``parse_*`` function over the text the board gives
(file contents or a program's stdout), so the formats of JetPack 5 and 6 are
tested on captured lines; ``platform.detect`` does the reading.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# L4T release -> JetPack release for the Orin's releases (R35 = JetPack 5, R36 = JetPack
# 6), as jetson-stats lists them (jtop/core/jetson_variables.py, NVIDIA_JETPACK, from
# NVIDIA's JetPack archive). A release not listed is named by its series ("6.x").
JETPACK_BY_L4T = {
    "35.1.0": "5.0.2",
    "35.2.1": "5.1",
    "35.3.1": "5.1.1",
    "35.4.1": "5.1.2",
    "35.5.0": "5.1.3",
    "35.6.0": "5.1.4",
    "35.6.1": "5.1.5",
    "35.6.2": "5.1.5",
    "35.6.3": "5.1.5",
    "35.6.4": "5.1.6",
    "36.2.0": "6.0 DP",
    "36.3.0": "6.0",
    "36.4.0": "6.1",
    "36.4.2": "6.1 (rev1)",
    "36.4.3": "6.2",
    "36.4.4": "6.2.1",
    "36.4.7": "6.2.1",
    "36.5.0": "6.2.2",
}
JETPACK_MAJOR_BY_L4T_MAJOR = {32: "4", 34: "5", 35: "5", 36: "6", 38: "7", 39: "7"}

# The release orin-llm targets: JetPack 6 (L4T R36; Ubuntu 22.04, Python 3.10, CUDA 12.2
# in 6.0 and 12.6 in 6.1/6.2). JetPack 5 (R35: Ubuntu 20.04, Python 3.8, CUDA 11.4) is
# below the Python 3.10 floor and untested; R34 was a developer preview and R32 (JetPack 4)
# does not run on Orin. JetPack 7 (R38+) is newer than anything tested here.
SUPPORTED_L4T_MAJOR = 36
OLDEST_USABLE_L4T_MAJOR = 35

# Module part numbers (the EEPROM's 699-level part number, nvidia,boardids or the
# device tree's compatible list name them; jetson-stats' MODULE_NAME_TABLE agrees).
MODULES = {
    "p3701-0000": "Jetson AGX Orin (p3701-0000)",
    "p3701-0004": "Jetson AGX Orin 32GB",
    "p3701-0005": "Jetson AGX Orin 64GB",
    "p3701-0008": "Jetson AGX Orin Industrial 64GB",
    "p3767-0000": "Jetson Orin NX 16GB",
    "p3767-0001": "Jetson Orin NX 8GB",
    "p3767-0003": "Jetson Orin Nano 8GB",
    "p3767-0004": "Jetson Orin Nano 4GB",
    "p3767-0005": "Jetson Orin Nano 8GB (developer kit)",
}

# SoC -> CUDA compute capability of its integrated GPU.
CUDA_ARCH_BY_SOC = {"tegra234": "8.7", "tegra194": "7.2", "tegra186": "6.2", "tegra210": "5.3"}

# nvpmodel modes when /etc/nvpmodel.conf cannot be read (L4T's nvpmodel_p3701_0000.conf
# serves the 64GB modules, nvpmodel_p3701_0004.conf the 32GB one: 40 W where 64GB has 50 W;
# the POWER_MODEL lines of both files as the LineageOS device tree for these modules,
# android_device_nvidia_concord's nvpmodel/, carries them). The industrial module
# (p3701-0008) has a table of its own (nvpmodel_p3701_0008.conf), and the Orin NX and
# Nano tables changed with JetPack 6.2's super modes (nvpmodel_p3767_000N_super.conf: on
# the Orin Nano 8GB mode 0 is 15W and MAXN_SUPER is 2), so none of them is guessed here:
# only the board's own nvpmodel.conf names their modes.
POWER_MODES_BY_MODULE = {
    "p3701-0000": {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_50W"},
    "p3701-0005": {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_50W"},
    "p3701-0004": {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_40W"},
}

# The profile schema's `board` values of the modules they name.
BOARD_BY_MODULE = {
    "p3701-0004": "agx-orin-32gb",
    "p3701-0005": "agx-orin-64gb",
    "p3701-0008": "agx-orin-64gb",
}

BOARD_MODULE = {"agx-orin-32gb": "p3701-0004", "agx-orin-64gb": "p3701-0005"}

# AGX Orin SKUs told apart by the memory the kernel reports (MemTotal): about 30.6 GiB
# on the 32GB module, about 61.3 GiB on the 64GB one (tegrastats: RAM .../62795MB).
AGX_ORIN_BOARD_ID = "p3701"
AGX_ORIN_64GB_MIN_BYTES = 48 * 2**30

_RELEASE = re.compile(r"#\s*R(\d+)\s*\(release\),\s*REVISION:\s*([0-9.]+)")
_PART = re.compile(r"\bp\d{4}-\d{4}\b")
_BOARDIDS = re.compile(r"(\d{4})[:-](\d{4})")
_NVPM_MODE = re.compile(r"NV Power Mode:\s*(\S+)")
_NVPM_CONF = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=(\S+?)\s*>")
_WATTS = re.compile(r"(\d+)W")
_FREQS = re.compile(r"MinFreq=(\d+)\s+MaxFreq=(\d+)\s+CurrentFreq=(\d+)")
_OVERRIDE = re.compile(r"FreqOverride=(\d)")


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

    @property
    def support(self) -> str:
        """``supported`` (R36), ``old`` (R35), ``unsupported`` (older) or ``newer`` (R38+)."""
        if self.major == SUPPORTED_L4T_MAJOR:
            return "supported"
        if self.major > SUPPORTED_L4T_MAJOR:
            return "newer"
        return "old" if self.major >= OLDEST_USABLE_L4T_MAJOR else "unsupported"


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


def parse_boardids(text: str) -> str | None:
    """/proc/device-tree/nvidia,boardids (``3701:0004:...``, older L4T) as a part number."""
    m = _BOARDIDS.search(text)
    return f"p{m.group(1)}-{m.group(2)}" if m else None


@dataclass(frozen=True)
class ModuleId:
    """Which module this is, and from what: the device tree may name another SKU."""

    part: str | None
    source: str
    device_tree: str | None = None  # the part the device tree names, when it disagrees

    @property
    def board(self) -> str | None:
        """The profile's ``board`` vocabulary (agx-orin-64gb, agx-orin-32gb), or None."""
        return BOARD_BY_MODULE.get(self.part or "")


def identify_module(
    compatible_part: str | None, boardids_part: str | None, mem_total: int | None
) -> ModuleId:
    """The module as jetson-stats finds it (board id first, then the device tree), with
    the AGX Orin SKU settled by memory size.

    A 32GB AGX Orin flashed with the developer kit's configuration carries the
    p3701-0000 (or -0005) device tree, and so nvpmodel's and the memory plan's
    idea of the board would be the 64GB one's; MemTotal cannot be wrong about it.
    """
    named: str | None = boardids_part or compatible_part
    source = "nvidia,boardids" if boardids_part else "device tree"
    if named is None or not named.startswith(AGX_ORIN_BOARD_ID) or mem_total is None:
        return ModuleId(named, source if named else "unknown")
    size = "agx-orin-64gb" if mem_total >= AGX_ORIN_64GB_MIN_BYTES else "agx-orin-32gb"
    by_memory = BOARD_MODULE[size]
    if BOARD_BY_MODULE.get(named) == BOARD_BY_MODULE[by_memory]:  # -0008 is a 64GB SKU too
        return ModuleId(named, source)
    return ModuleId(by_memory, f"memory size ({mem_total / 2**30:.1f} GiB)", named)


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
        """MAXN by its name, or mode 0 (MAXN on the AGX Orin and the Orin NX): for a
        board whose mode table is unknown; ``fastest_power_mode`` where it is known."""
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


def fastest_power_mode(modes: Mapping[int, str]) -> int | None:
    """The id of the mode without caps among a board's nvpmodel modes, or None when the
    names do not say.

    Not always mode 0: a mode named MAXN (MAXN_SUPER on JetPack 6.2's super tables) is
    the uncapped one where there is one, else the highest wattage in the names. The
    Orin Nano 8GB has 15W (0) and 7W (1) before JetPack 6.2, and 15W (0), 25W (1),
    MAXN_SUPER (2) and 7W (3) with it (L4T's nvpmodel_p3767_0003.conf and
    nvpmodel_p3767_0003_super.conf).
    """
    maxn = sorted(i for i, name in modes.items() if name.upper().startswith("MAXN"))
    if maxn:
        return maxn[0]
    watts = {i: int(m.group(1)) for i, name in modes.items() if (m := _WATTS.search(name))}
    if not watts:
        return None
    return min(watts, key=lambda i: (-watts[i], i))


def parse_nvpmodel_conf(text: str) -> dict[int, str]:
    """Mode ids and names from /etc/nvpmodel.conf (``< POWER_MODEL ID=0 NAME=MAXN >``)."""
    return {int(m.group(1)): m.group(2) for m in _NVPM_CONF.finditer(text)}


@dataclass(frozen=True)
class ClockDomain:
    """One clock's limits as ``jetson_clocks --show`` (or devfreq) prints them.

    What ``jetson_clocks`` does to each (L4T's /usr/bin/jetson_clocks): CPU cores
    and the GPU get their maximum written into their minimum, so min == max;
    EMC keeps its minimum at the floor (204 MHz on Orin) and is pinned through
    the BPMP instead: ``mrq_rate_locked`` (FreqOverride) set to 1 and the rate
    set to the maximum, so current == max. jetson-stats decides the same way
    (CPU and GPU: min == max; EMC: current == max).
    """

    name: str
    min_hz: int
    max_hz: int
    current_hz: int
    override: bool | None = None  # EMC's FreqOverride; None where the line has none

    @property
    def locked(self) -> bool:
        if self.name == "EMC":
            return self.override is not False and self.current_hz == self.max_hz
        return self.min_hz == self.max_hz


@dataclass(frozen=True)
class ClockState:
    """Whether CPU, GPU and EMC clocks are pinned at their maximum (jetson_clocks)."""

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

    @property
    def complete(self) -> bool:
        """CPU, GPU and EMC were all seen (jetson_clocks --show), not the GPU alone."""
        return {"CPU", "GPU", "EMC"} <= {d.name for d in self.domains}


def parse_jetson_clocks_show(text: str) -> ClockState:
    """``jetson_clocks --show``: locked when every domain is (see ClockDomain.locked).

    CPU cores appear one per line (``cpu3: Online=1 ... MinFreq=...``); offline
    cores are skipped, the online ones count as one domain named ``CPU``. DLA,
    PVA and other engines' lines are not ours to judge and are left out.
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
        elif line.startswith("GPU "):
            domains.append(ClockDomain("GPU", lo, hi, cur))
        elif line.startswith("EMC "):
            o = _OVERRIDE.search(line)
            domains.append(ClockDomain("EMC", lo, hi, cur, o.group(1) == "1" if o else None))
    return ClockState("jetson_clocks --show", tuple(domains))
