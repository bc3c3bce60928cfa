"""What machine this is, read once: Jetson or not, board, module, L4T/JetPack,
CUDA arch, memory, NUMA nodes, swap devices, power mode, clocks, thermal zones.

The module is identified as jetson-stats does (board id, then the device tree)
and its AGX Orin SKU settled by MemTotal, so the power-mode table and the
profile's ``board`` follow the memory the planner really has.

Everything is read through one SysRoot and one CommandRunner, so a fake board
tree and a recording runner stand in for a real Orin in tests. Detection
never raises for a missing source: a field it cannot read is None, and the
callers (tune, doctor) say what that means.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from orin.errors import OrinError
from orin.system.commands import CommandRunner
from orin.system.jetson import (
    CUDA_ARCH_BY_SOC,
    MODULES,
    POWER_MODES_BY_MODULE,
    ClockDomain,
    ClockState,
    L4TRelease,
    ModuleId,
    PowerMode,
    device_tree_strings,
    fastest_power_mode,
    identify_module,
    parse_boardids,
    parse_jetson_clocks_show,
    parse_module,
    parse_nvpmodel_conf,
    parse_nvpmodel_query,
    parse_soc,
    parse_tegra_release,
)
from orin.system.memory import MemInfo, read_meminfo
from orin.system.root import SysRoot

RELEASE_FILE = "/etc/nv_tegra_release"  # L4T's release line
NODE_DIR = "/sys/devices/system/node"
DEVFREQ_DIR = "/sys/class/devfreq"
THERMAL_DIR = "/sys/class/thermal"
# devfreq entries of Jetson iGPUs: 17000000.gpu (JetPack 6), 17000000.ga10b (JetPack 5)
GPU_DEVFREQ_SUFFIXES = (".gpu", ".ga10b", ".gv11b", ".gp10b")
FREQ_FILES = ("min_freq", "max_freq", "cur_freq")
SENSOR_OFF_C = -40.0  # Jetson reports a disabled sensor as -256 C
THROTTLE_TRIP_TYPES = ("passive", "hot", "critical")
COMMAND_TIMEOUT = 10.0


@dataclass(frozen=True)
class SwapDevice:
    path: str
    kind: str  # zram, file or partition
    size_bytes: int
    used_bytes: int
    priority: int


def parse_swaps(text: str) -> tuple[SwapDevice, ...]:
    """/proc/swaps (sizes in KiB); a /dev/zram* device is compressed RAM, not disk."""
    devices = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 5 or not parts[2].isdigit():
            continue
        path, kind = parts[0], parts[1]
        if path.startswith("/dev/zram"):
            kind = "zram"
        devices.append(
            SwapDevice(path, kind, int(parts[2]) * 1024, int(parts[3]) * 1024, int(parts[4]))
        )
    return tuple(devices)


@dataclass(frozen=True)
class TripPoint:
    type: str
    temp_c: float


@dataclass(frozen=True)
class ThermalZone:
    name: str
    temp_c: float | None
    trips: tuple[TripPoint, ...] = field(default_factory=tuple)

    @property
    def throttle_trips(self) -> tuple[TripPoint, ...]:
        """Trips where the kernel slows the chip or shuts down (fan steps excluded)."""
        return tuple(t for t in self.trips if t.type in THROTTLE_TRIP_TYPES and t.temp_c > 0)


@dataclass(frozen=True)
class Platform:
    is_jetson: bool
    model: str | None
    module: str | None  # the module as identified (see module_id for how)
    soc: str | None
    l4t: L4TRelease | None
    cuda_arch: str | None
    nvidia_gpu: bool
    memory: MemInfo | None
    numa_nodes: int
    swaps: tuple[SwapDevice, ...]
    power_mode: PowerMode | None
    power_modes: dict[int, str]
    clocks: ClockState | None
    thermal: tuple[ThermalZone, ...]
    module_id: ModuleId | None = None

    @property
    def module_name(self) -> str | None:
        return MODULES.get(self.module or "")

    @property
    def board(self) -> str | None:
        """The profile schema's ``board`` value for this module (None: none fits)."""
        return self.module_id.board if self.module_id else None

    @property
    def jetpack(self) -> str | None:
        return self.l4t.jetpack if self.l4t else None

    @property
    def unified_memory(self) -> bool:
        """CPU and GPU allocate from the same DRAM (every Jetson)."""
        return self.is_jetson

    @property
    def fastest_power_mode(self) -> int | None:
        """The id of this board's uncapped nvpmodel mode (not always 0), None if unknown."""
        return fastest_power_mode(self.power_modes)

    @property
    def zram_devices(self) -> tuple[SwapDevice, ...]:
        return tuple(s for s in self.swaps if s.kind == "zram")

    def describe(self) -> str:
        """One line for the top of a report: which board, which release."""
        if not self.is_jetson:
            gpu = f", NVIDIA GPU (CUDA {self.cuda_arch or '?'})" if self.nvidia_gpu else ""
            return f"not a Jetson{gpu}"
        board = self.module_name or self.model or "Jetson"
        release = f", L4T {self.l4t.version} (JetPack {self.jetpack})" if self.l4t else ""
        mode = f", {self.power_mode.name}" if self.power_mode else ""
        return f"{board}{release}{mode}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(
            module_name=self.module_name,
            jetpack=self.jetpack,
            l4t=self.l4t.version if self.l4t else None,
            l4t_support=self.l4t.support if self.l4t else None,
            board=self.board,
            fastest_power_mode=self.fastest_power_mode,
            unified_memory=self.unified_memory,
            clocks=None
            if self.clocks is None
            else {
                "source": self.clocks.source,
                "locked": self.clocks.locked,
                "unlocked": list(self.clocks.unlocked),
            },
        )
        return d


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), or all of them where the
    mask cannot be read."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def is_jetson(root: SysRoot) -> bool:
    """Jetson or not, from files alone (no command runs): for callers that need only this."""
    release = parse_tegra_release(root.read_text(RELEASE_FILE) or "")
    soc = parse_soc(device_tree_strings(_device_tree(root, "compatible") or ""))
    return _jetson(release, soc)


def _jetson(release: L4TRelease | None, soc: str | None) -> bool:
    return release is not None or (soc or "").startswith("tegra")


def detect(root: SysRoot, runner: CommandRunner) -> Platform:
    """Read every source; Jetson tools run only on a Jetson."""
    compatible = device_tree_strings(_device_tree(root, "compatible") or "")
    soc = parse_soc(compatible)
    release = parse_tegra_release(root.read_text(RELEASE_FILE) or "")
    jetson = _jetson(release, soc)
    memory = _memory(root)
    module_id = identify_module(
        parse_module(compatible),
        parse_boardids(_device_tree(root, "nvidia,boardids") or ""),
        memory.total if memory else None,
    )
    model = _device_tree(root, "model")
    return Platform(
        is_jetson=jetson,
        model=model.strip("\0 \n") if model else None,
        module=module_id.part,
        soc=soc,
        l4t=release,
        cuda_arch=CUDA_ARCH_BY_SOC.get(soc or "") if jetson else _dgpu_arch(root, runner),
        nvidia_gpu=jetson or root.exists("/proc/driver/nvidia/version"),
        memory=memory,
        numa_nodes=numa_node_count(root),
        swaps=parse_swaps(root.read_text("/proc/swaps") or ""),
        power_mode=query_power_mode(runner) if jetson else None,
        power_modes=power_mode_names(root, module_id.part) if jetson else {},
        clocks=read_clocks(root, runner) if jetson else None,
        thermal=read_thermal(root),
        module_id=module_id if jetson else None,
    )


def _device_tree(root: SysRoot, prop: str) -> str | None:
    for base in ("/proc/device-tree", "/sys/firmware/devicetree/base"):
        text = root.read_text(f"{base}/{prop}")
        if text is not None:
            return text
    return None


def _memory(root: SysRoot) -> MemInfo | None:
    try:
        return read_meminfo(root)
    except OrinError:
        return None


def _dgpu_arch(root: SysRoot, runner: CommandRunner) -> str | None:
    """Compute capability of a discrete GPU, asked only when its driver is loaded."""
    if not root.exists("/proc/driver/nvidia/version"):
        return None
    res = runner.run(
        ("nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"),
        timeout=COMMAND_TIMEOUT,
    )
    first = res.stdout.strip().splitlines()[:1] if res.ok else []
    return first[0].strip() if first else None


def numa_node_count(root: SysRoot) -> int:
    """Nodes under /sys/devices/system/node; a kernel without NUMA has one."""
    base = root.path(NODE_DIR)
    if not base.is_dir():
        return 1
    return max(1, sum(1 for p in base.iterdir() if re.fullmatch(r"node\d+", p.name)))


def query_power_mode(runner: CommandRunner) -> PowerMode | None:
    res = runner.run(("nvpmodel", "-q"), timeout=COMMAND_TIMEOUT)
    return parse_nvpmodel_query(res.stdout) if res.ok else None


def power_mode_names(root: SysRoot, module: str | None) -> dict[int, str]:
    """The board's own nvpmodel.conf, else the known table for the module."""
    modes = parse_nvpmodel_conf(root.read_text("/etc/nvpmodel.conf") or "")
    return modes or dict(POWER_MODES_BY_MODULE.get(module or "", {}))


def read_clocks(root: SysRoot, runner: CommandRunner) -> ClockState | None:
    """``jetson_clocks --show`` (root only); else the GPU's devfreq limits from sysfs."""
    res = runner.run(("jetson_clocks", "--show"), timeout=COMMAND_TIMEOUT)
    if res.ok:
        state = parse_jetson_clocks_show(res.stdout)
        if state.domains:
            return state
    gpu = _gpu_devfreq(root)
    return ClockState("sysfs devfreq (GPU only)", (gpu,)) if gpu else None


def _gpu_devfreq(root: SysRoot) -> ClockDomain | None:
    base = root.path(DEVFREQ_DIR)
    if not base.is_dir():
        return None
    for entry in sorted(base.iterdir()):
        if not entry.name.endswith(GPU_DEVFREQ_SUFFIXES):
            continue
        values = [_int(root, f"{DEVFREQ_DIR}/{entry.name}/{f}") for f in FREQ_FILES]
        if all(v is not None for v in values):
            lo, hi, cur = (int(v or 0) for v in values)
            return ClockDomain("GPU", lo, hi, cur)
    return None


def _int(root: SysRoot, path: str) -> int | None:
    text = (root.read_text(path) or "").strip()
    return int(text) if text.lstrip("-").isdigit() else None


def read_thermal(root: SysRoot) -> tuple[ThermalZone, ...]:
    """Thermal zones with their temperature and trip points (millidegrees in sysfs)."""
    base = root.path(THERMAL_DIR)
    if not base.is_dir():
        return ()
    zones = []
    for entry in sorted(base.iterdir()):
        if not entry.name.startswith("thermal_zone"):
            continue
        rel = f"{THERMAL_DIR}/{entry.name}"
        name = (root.read_text(f"{rel}/type") or entry.name).strip()
        milli = _int(root, f"{rel}/temp")
        temp = milli / 1000 if milli is not None and milli / 1000 > SENSOR_OFF_C else None
        zones.append(ThermalZone(name, temp, _trips(root, rel)))
    return tuple(zones)


def _trips(root: SysRoot, zone: str) -> tuple[TripPoint, ...]:
    trips = []
    for n in range(32):
        kind = root.read_text(f"{zone}/trip_point_{n}_type")
        if kind is None:
            break
        milli = _int(root, f"{zone}/trip_point_{n}_temp")
        if milli is not None:
            trips.append(TripPoint(kind.strip(), milli / 1000))
    return tuple(trips)
