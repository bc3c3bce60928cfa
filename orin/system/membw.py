"""The machine's memory bandwidth: the ceiling of single-stream decode speed.

On a Jetson the figure is the module's data sheet (NVIDIA's peak for its LPDDR5
bus: width x transfer rate), found from the module the device tree names, as
``platform`` identifies it. Anywhere else it is measured: a numpy copy of a
buffer far larger than the last-level cache, split over the cores (one thread
each, numpy releases the GIL while copying), a few repetitions, the best one,
with bytes counted as read + write (STREAM's "Copy" convention). The copy runs
once per machine and is cached as JSON in the user cache directory, keyed by the
CPU model and the memory size, so another machine sharing the home directory,
or a changed one, measures again.

A copy reaches less than the data-sheet peak (a few cores cannot keep every
memory channel busy, and write-allocate traffic is not counted), so
utilization against a probed figure reads higher than against a data sheet.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from orin.errors import OrinError
from orin.paths import cache_dir
from orin.system.jetson import (
    device_tree_strings,
    identify_module,
    parse_boardids,
    parse_module,
)
from orin.system.memory import read_meminfo
from orin.system.platform import is_jetson, usable_cpus
from orin.system.root import SysRoot

GB = 1e9  # data sheets count bandwidth in decimal gigabytes per second
CACHE_FILE = "membw.json"
CACHE_VERSION = 1
SOURCE_PROBE = "probe"
SOURCE_UNKNOWN = "unknown"
DATASHEET_PREFIX = "datasheet:"

PROBE_MIN_BYTES = 256 * 2**20  # the copied buffer at least (source and destination each)
PROBE_LLC_FACTOR = 16  # and at least this many last-level caches
PROBE_MEMORY_SHARE = 8  # at most MemAvailable / this, so the probe never pushes into swap
PROBE_REPS = 5
PROBE_MAX_THREADS = 16
CACHE_INDEX_DIR = "/sys/devices/system/cpu/cpu0/cache"


@dataclass(frozen=True)
class Datasheet:
    board: str  # the source's name: datasheet:<board>
    bytes_per_s: float
    memory: str  # what the figure is: bus width, type and rate


_AGX = Datasheet("agx-orin", 204.8 * GB, "256-bit LPDDR5, 6400 MT/s")
_AGX_32 = Datasheet("agx-orin-32gb", 204.8 * GB, _AGX.memory)
_AGX_64 = Datasheet("agx-orin-64gb", 204.8 * GB, _AGX.memory)
_NANO_8 = Datasheet("orin-nano-8gb", 68 * GB, "128-bit LPDDR5, 4266 MT/s")

# Module part number -> NVIDIA's published peak memory bandwidth (the modules' data
# sheets: AGX Orin series 204.8 GB/s, Orin NX series 102.4 GB/s, Orin Nano 8GB 68 GB/s,
# Orin Nano 4GB 34 GB/s). JetPack 6.2's super configuration raises the Orin Nano's
# memory clock: see SUPER_DATASHEETS.
DATASHEETS: dict[str, Datasheet] = {
    "p3701-0000": _AGX,  # the developer kit's module when memory does not settle the SKU
    "p3701-0004": _AGX_32,
    "p3701-0005": _AGX_64,
    "p3701-0008": Datasheet("agx-orin-industrial-64gb", 204.8 * GB, _AGX.memory),
    "p3767-0000": Datasheet("orin-nx-16gb", 102.4 * GB, "128-bit LPDDR5, 6400 MT/s"),
    "p3767-0001": Datasheet("orin-nx-8gb", 102.4 * GB, "128-bit LPDDR5, 6400 MT/s"),
    "p3767-0003": _NANO_8,
    "p3767-0004": Datasheet("orin-nano-4gb", 34 * GB, "64-bit LPDDR5, 4266 MT/s"),
    "p3767-0005": _NANO_8,  # the developer kit's module
}


# An Orin Nano flashed with JetPack 6.2's super configuration (its device tree then
# names the module ``p3767-000N-super``) runs its LPDDR5 at 6400 MT/s instead of
# 4266: NVIDIA's Orin Nano Super figures, 102 GB/s (8GB) and 51 GB/s (4GB); L4T's
# nvpmodel_p3767_0003_super.conf lifts EMC's cap from 2133 MHz to 3199 MHz. The
# Orin NX's memory already runs at 6400 MT/s, so its figure stays.
_NANO_8_SUPER = Datasheet("orin-nano-8gb-super", 102 * GB, "128-bit LPDDR5, 6400 MT/s")
SUPER_DATASHEETS: dict[str, Datasheet] = {
    "p3767-0003": _NANO_8_SUPER,
    "p3767-0004": Datasheet("orin-nano-4gb-super", 51 * GB, "64-bit LPDDR5, 6400 MT/s"),
    "p3767-0005": _NANO_8_SUPER,
}
SUPER_SUFFIX = "-super"


@dataclass(frozen=True)
class Bandwidth:
    """Memory bandwidth in bytes/s and where the figure comes from: ``datasheet:<board>``,
    ``probe`` (measured here, now or earlier) or ``unknown`` (``bytes_per_s`` is 0)."""

    bytes_per_s: float
    source: str
    detail: str = ""

    @property
    def known(self) -> bool:
        return self.bytes_per_s > 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_s / GB

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "gb_per_s": self.gb_per_s if self.known else None}


def memory_bandwidth(
    root: SysRoot | None = None, cache: Path | None = None, probe: bool = True
) -> Bandwidth:
    """The data sheet's figure on a known Jetson module; else the cached copy probe,
    measured now (and cached) when there is none and ``probe`` is on; else unknown.

    ``cache`` is the JSON file (default: membw.json in the user cache directory).
    """
    root = root or SysRoot()
    sheet = datasheet(root)
    if sheet is not None:
        return Bandwidth(sheet.bytes_per_s, DATASHEET_PREFIX + sheet.board, sheet.memory)
    path = cache if cache is not None else cache_dir() / CACHE_FILE
    key = machine_key(root)
    cached = read_cached(path, key)
    if cached is not None:
        return cached
    if not probe:
        return Bandwidth(0.0, SOURCE_UNKNOWN, "not measured on this machine yet")
    nbytes = probe_bytes(root)
    measured = Bandwidth(copy_bandwidth(nbytes), SOURCE_PROBE, _probe_detail(nbytes))
    write_cached(path, key, measured)
    return measured


def datasheet(root: SysRoot) -> Datasheet | None:
    """The module's data-sheet figure, or None off a Jetson or on a module not listed."""
    if not is_jetson(root):
        return None
    compatible = device_tree_strings(_device_tree(root, "compatible") or "")
    try:
        mem_total: int | None = read_meminfo(root).total
    except OrinError:
        mem_total = None
    module = identify_module(
        parse_module(compatible),
        parse_boardids(_device_tree(root, "nvidia,boardids") or ""),
        mem_total,
    )
    part = module.part or ""
    if part in SUPER_DATASHEETS and any(e.endswith(part + SUPER_SUFFIX) for e in compatible):
        return SUPER_DATASHEETS[part]
    return DATASHEETS.get(part)


def _device_tree(root: SysRoot, prop: str) -> str | None:
    for base in ("/proc/device-tree", "/sys/firmware/devicetree/base"):
        text = root.read_text(f"{base}/{prop}")
        if text is not None:
            return text
    return None


# -- the copy probe ------------------------------------------------------------------


def copy_bandwidth(nbytes: int, reps: int = PROBE_REPS, threads: int | None = None) -> float:
    """Bytes/s of the best of ``reps`` copies of an ``nbytes`` buffer (read + write).

    The buffer is split into one contiguous part per thread; a first, untimed
    copy touches every page of both buffers.
    """
    import numpy as np

    if nbytes < 1 or reps < 1:
        raise ValueError("the probe needs a buffer and at least one repetition")
    n = max(1, min(threads or usable_cpus(), PROBE_MAX_THREADS, nbytes))
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    bounds = [nbytes * i // n for i in range(n + 1)]
    parts = [(dst[a:b], src[a:b]) for a, b in itertools.pairwise(bounds)]
    best = float("inf")
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="orin-membw") as pool:

        def once() -> float:
            t = time.perf_counter()
            list(pool.map(lambda p: np.copyto(*p), parts))
            return time.perf_counter() - t

        once()
        for _ in range(reps):
            best = min(best, once())
    return 2 * nbytes / max(best, 1e-9)


def last_level_cache_bytes(root: SysRoot) -> int | None:
    """The largest cache sysfs lists for cpu0 (the last level), or None."""
    base = root.path(CACHE_INDEX_DIR)
    if not base.is_dir():
        return None
    sizes = []
    for entry in base.iterdir():
        if entry.name.startswith("index"):
            size = _cache_size(root.read_text(f"{CACHE_INDEX_DIR}/{entry.name}/size") or "")
            if size is not None:
                sizes.append(size)
    return max(sizes, default=None)


def _cache_size(text: str) -> int | None:
    """sysfs cache sizes: ``32K``, ``1024K``, ``16M``."""
    text = text.strip().upper()
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    digits = text.rstrip("KMG")
    return int(digits) * scale if digits.isdigit() else None


def probe_bytes(root: SysRoot) -> int:
    """The copied buffer: PROBE_MIN_BYTES or 16 last-level caches, whichever is larger,
    within an eighth of the available memory."""
    want = max(PROBE_MIN_BYTES, PROBE_LLC_FACTOR * (last_level_cache_bytes(root) or 0))
    try:
        available = read_meminfo(root).available
    except OrinError:
        return want
    return max(1, min(want, available // PROBE_MEMORY_SHARE))


def _probe_detail(nbytes: int) -> str:
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return f"numpy copy of {nbytes / 2**20:.0f} MiB, best of {PROBE_REPS}, measured {when}"


# -- the cache -----------------------------------------------------------------------


def machine_key(root: SysRoot) -> str:
    """What a measurement belongs to: the CPU model and the memory size in GiB."""
    try:
        gib = round(read_meminfo(root).total / 2**30)
    except OrinError:
        gib = 0
    return f"{cpu_model(root)}|{gib} GiB"


def cpu_model(root: SysRoot) -> str:
    """The CPU's name from /proc/cpuinfo: ``model name`` (x86), else the Arm
    implementer and part numbers, else ``unknown``."""
    fields: dict[str, str] = {}
    for line in (root.read_text("/proc/cpuinfo") or "").splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    if fields.get("model name"):
        return fields["model name"]
    arm = [fields.get(k) for k in ("CPU implementer", "CPU part", "CPU variant")]
    if all(arm):
        return "arm implementer {} part {} variant {}".format(*arm)
    return fields.get("Hardware") or fields.get("cpu model") or "unknown"


def read_cached(path: Path, key: str) -> Bandwidth | None:
    """This machine's cached measurement, or None (absent, unreadable or another machine's)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        entry = data["machines"][key]
        value = float(entry["bytes_per_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if data.get("version") != CACHE_VERSION or value <= 0:
        return None
    return Bandwidth(value, SOURCE_PROBE, str(entry.get("detail", "")))


def write_cached(path: Path, key: str, bw: Bandwidth) -> None:
    """Add (or replace) this machine's entry; a cache that cannot be written is skipped."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
            raise ValueError("another format")
        machines = data.get("machines")
        if not isinstance(machines, dict):
            raise ValueError("no machines")
    except (OSError, ValueError):
        machines = {}
    machines[key] = {"bytes_per_s": bw.bytes_per_s, "detail": bw.detail}
    text = json.dumps({"version": CACHE_VERSION, "machines": machines}, indent=2) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
