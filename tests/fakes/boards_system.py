"""Fake boards for the system and doctor tests: file trees plus a stateful Jetson.

``FakeJetson`` answers nvpmodel, jetson_clocks, systemctl, swapon/swapoff and
sync the way a board does, and changes its own state (and the /proc files
under the fake root) when a command would, so apply and revert can be
checked end to end: the commands recorded, then the board re-read.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from orin.llamacpp import BuildInfo
from orin.system.commands import CommandResult
from orin.system.settings import sysctl_text
from tests.fakes.board import FakeBoard, GiB
from tests.fakes.runner import FakeRunner

R36_LINE = (
    "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, "
    "DATE: Fri Sep 13 04:36:44 UTC 2024\n"
)
R35_LINE = (
    "# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64, "
    "DATE: Tue Aug  1 19:57:35 UTC 2023\n"
)
SWAPS_HEADER = "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n"
ZRAM_KIB = 4 * 1024 * 1024
NVPM_WARN = "NVPM WARN: Fan mode is not set!\n"
QUERIES = {
    ("nvpmodel", "-q"),
    ("jetson_clocks", "--show"),
    ("systemctl", "is-enabled"),
    ("systemctl", "is-active"),
}
# AGX Orin 64GB in MAXN (the jetson_clocks --show capture below): GPU devfreq and EMC
# limits in Hz, CPU cpufreq limits in kHz.
GPU_HZ = (306000000, 1300500000)
EMC_HZ = (204000000, 3199000000)
CPU_HZ = (729600, 2201600)
AGX_32GB_GPU_HZ = (306000000, 930750000)

CUDA_BUILD = BuildInfo(
    version="0.3.36",
    gpu_offload=True,
    system_info="CUDA : ARCHS = 870 | FA_QUANTS = all |",
    backends={"CUDA": {"ARCHS": "870", "FA_QUANTS": "all"}, "CPU": {"NEON": "1"}},
)
CUDA_BUILD_DEFAULT_FA = BuildInfo(
    version="0.3.36",
    gpu_offload=True,
    system_info="CUDA : ARCHS = 870 |",
    backends={"CUDA": {"ARCHS": "870"}, "CPU": {"NEON": "1"}},
)
CPU_BUILD = BuildInfo(
    version="0.3.36", gpu_offload=False, system_info="CPU : NEON = 1 |", backends={"CPU": {}}
)


def nvpmodel_conf(modes: dict[int, str], default: int = 2) -> str:
    lines = ["< PARAM TYPE=FILE NAME=CPU_ONLINE >", "CORE_0 /sys/devices/system/cpu/cpu0/online"]
    for i, name in modes.items():
        lines += [f"< POWER_MODEL ID={i} NAME={name} >", "CPU_ONLINE CORE_0 1"]
    lines.append(f"< PM_CONFIG DEFAULT={default} >")
    return "\n".join(lines) + "\n"


@dataclass
class FakeJetson:
    """A Jetson's mutable state behind a FakeRunner."""

    board: FakeBoard
    modes: dict[int, str]
    mode: int = 2
    locked: bool = False
    zram_service: str = "enabled"  # "not-found": the unit is not installed
    jtop: str | None = "inactive"  # None: jetson-stats not installed
    zram: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (KiB, priority)
    other_swaps: list[str] = field(default_factory=list)
    fail: dict[tuple[str, ...], str] = field(default_factory=dict)  # argv -> stderr
    mode_needs_reboot: bool = False
    pending_mode: int | None = None  # taken by nvpmodel -m, applied at the next boot
    cores: int = 12  # AGX Orin 64GB: 12 Cortex-A78AE; 32GB: 8
    gpu_hz: tuple[int, int] = GPU_HZ
    runner: FakeRunner = field(init=False)
    # the zram devices nvzramconfig sets up at boot (the swaps on at the start)
    zram_config: dict[str, tuple[int, int]] = field(init=False)

    def __post_init__(self) -> None:
        self.zram_config = dict(self.zram)
        self.set_up_zram(self.zram)
        self.runner = FakeRunner(
            answers={
                (p,): self._answer(h)
                for p, h in {
                    "nvpmodel": self._nvpmodel,
                    "jetson_clocks": self._jetson_clocks,
                    "systemctl": self._systemctl,
                    "swapoff": self._swapoff,
                    "swapon": self._swapon,
                    "sync": lambda a: ok(a),
                }.items()
            }
        )
        self.write_swaps()

    def _answer(
        self, handler: Callable[[tuple[str, ...]], CommandResult]
    ) -> Callable[[tuple[str, ...]], CommandResult]:
        def answer(args: tuple[str, ...]) -> CommandResult:
            if args in self.fail:
                return CommandResult(args, 1, "", self.fail[args])
            return handler(args)

        return answer

    @property
    def calls(self) -> list[tuple[str, ...]]:
        return self.runner.calls

    def changes(self) -> list[tuple[str, ...]]:
        """The recorded commands that change something (queries left out)."""
        return [c for c in self.calls if c[:2] not in QUERIES]

    def set_up_zram(self, devices: dict[str, tuple[int, int]]) -> None:
        """The devices exist with a size (``/sys/block/zramN/disksize``), as nvzramconfig
        leaves them; they stay so after a swapoff, until the next boot."""
        for path, (kib, _prio) in devices.items():
            self.board.write(f"/sys/block/{Path(path).name}/disksize", f"{kib * 1024}\n")

    def reboot(self) -> None:
        """What a restart keeps: nvpmodel's mode (a pending one taken), the sysctl.d
        swappiness and the enabled units; clocks unlock and zram exists only when
        nvzramconfig is enabled to set it up."""
        if self.pending_mode is not None:
            self.mode, self.pending_mode = self.pending_mode, None
        self.locked = False
        for path in self.zram_config:
            sysfs = self.board.root.path(f"/sys/block/{Path(path).name}")
            if sysfs.exists():
                shutil.rmtree(sysfs)
        self.zram = {}
        if self.zram_service == "enabled":
            self._start_nvzramconfig()
        persisted = self.board.root.read_text("/etc/sysctl.d/99-orin-llm.conf") or ""
        value = persisted.rpartition("=")[2].strip() or "60"
        self.board.write("/proc/sys/vm/swappiness", f"{value}\n")
        self.write_swaps()

    def _start_nvzramconfig(self) -> None:
        self.set_up_zram(self.zram_config)
        self.zram.update(self.zram_config)
        self.write_swaps()

    def write_swaps(self) -> None:
        rows = [f"{p}\tpartition\t{kib}\t0\t{prio}\n" for p, (kib, prio) in self.zram.items()]
        self.board.write("/proc/swaps", SWAPS_HEADER + "".join(rows + self.other_swaps))

    def _nvpmodel(self, args: tuple[str, ...]) -> CommandResult:
        if args[1:2] == ("-q",):
            return ok(args, f"{NVPM_WARN}NV Power Mode: {self.modes[self.mode]}\n{self.mode}\n")
        if args[1:2] == ("-m",) and int(args[2]) in self.modes:
            if self.mode_needs_reboot and int(args[2]) != self.mode:
                # answered "no" to the reboot: nvpmodel keeps the mode for the next boot
                self.pending_mode = int(args[2])
                return ok(args, "NVPM WARN: Reboot required for changing to this power mode\n")
            self.pending_mode = None
            self.mode, self.locked = int(args[2]), False  # a mode switch resets the clocks
            return ok(args)
        return CommandResult(args, 1, "", "NVPM ERROR: invalid mode")

    def _jetson_clocks(self, args: tuple[str, ...]) -> CommandResult:
        if args[1:] == ("--show",):
            name = self.modes[self.mode]
            online = self.cores - 4 if name == "MODE_30W" and self.cores == 12 else self.cores
            return ok(args, clocks_show(self.locked, name, self.cores, online, self.gpu_hz))
        if args[1:2] == ("--store",):
            Path(args[2]).write_text(f"locked={int(self.locked)}\n")
            return ok(args)
        if args[1:2] == ("--restore",):
            stored = Path(args[2])
            if not stored.exists():
                return CommandResult(args, 1, "", f"{stored}: file not found")
            self.locked = stored.read_text().strip() == "locked=1"
            return ok(args)
        self.locked = True
        return ok(args)

    def _systemctl(self, args: tuple[str, ...]) -> CommandResult:
        verb, unit = args[1], args[-1]
        if unit.startswith("jtop"):
            state = self.jtop or "inactive"
            return CommandResult(args, 0 if state == "active" else 3, state + "\n")
        if verb == "is-enabled":
            if self.zram_service == "not-found":  # systemd 249 (JetPack 6): stderr only
                return CommandResult(
                    args,
                    1,
                    "",
                    f"Failed to get unit file state for {unit}"
                    ".service: No such file or directory\n",
                )
            code = 0 if self.zram_service == "enabled" else 1
            return CommandResult(args, code, self.zram_service + "\n")
        if self.zram_service == "not-found":
            return CommandResult(
                args, 1, "", f"Failed to {verb} unit: Unit file {unit}.service does not exist.\n"
            )
        if verb == "start" or (verb == "enable" and "--now" in args):
            self._start_nvzramconfig()
        if verb in ("enable", "disable"):
            self.zram_service = f"{verb}d"
        return ok(args)

    def _swapoff(self, args: tuple[str, ...]) -> CommandResult:
        if self.zram.pop(args[1], None) is None:
            return CommandResult(args, 255, "", f"swapoff: {args[1]}: swapoff failed")
        self.write_swaps()
        return ok(args)

    def _swapon(self, args: tuple[str, ...]) -> CommandResult:
        if args[-1] in self.zram:
            return CommandResult(
                args, 255, "", f"swapon: {args[-1]}: swapon failed: Device or resource busy"
            )
        if not self.board.root.exists(f"/sys/block/{Path(args[-1]).name}/disksize"):
            return CommandResult(
                args, 255, "", f"swapon: cannot open {args[-1]}: No such file or directory"
            )
        self.zram[args[-1]] = (ZRAM_KIB, int(args[2]))
        self.write_swaps()
        return ok(args)


def ok(args: tuple[str, ...], stdout: str = "") -> CommandResult:
    return CommandResult(args, 0, stdout)


def clocks_show(
    locked: bool,
    mode: str,
    cores: int = 12,
    online: int | None = None,
    gpu_hz: tuple[int, int] = GPU_HZ,
) -> str:
    """``sudo jetson_clocks --show`` on an AGX Orin 64GB, as L4T's script prints it.

    Unlocked: the lines and values of a real capture (AGX Orin 64GB, MAXN, L4T 35.3,
    catid.io/posts/orin_opt): cores listed in glob order (cpu0, cpu1, cpu10, ...),
    CPU 729.6 MHz-2.2016 GHz, GPU 306-1300.5 MHz, EMC 204 MHz-3.199 GHz at 2.133 GHz
    with FreqOverride=0, then the DLA/PVA engines (min 0, current == max) and the fan.
    Locked: what /usr/bin/jetson_clocks writes: each core's and the GPU's maximum
    into its minimum, idle states off; EMC's minimum left at its 204 MHz floor and
    the rate pinned at the maximum through mrq_rate_locked (FreqOverride=1), as a
    locked Orin reports it (current == max == 3199000000, FreqOverride=1). The
    frequencies are MAXN's in every mode: the parser judges only their relations.
    Cores past ``online`` print Online=0 (MODE_30W takes the last four offline).
    """
    online = cores if online is None else online
    cpu_lo, cpu_hi = CPU_HZ
    gpu_lo, gpu_hi = gpu_hz
    emc_lo, emc_hi = EMC_HZ
    cpu_cur = (2201600, 2201600, 1113600, 1113600, 2201600, 1190400)
    cpus = []
    for n, i in enumerate(sorted(range(cores), key=str)):
        on = i < online
        lo = cpu_hi if locked and on else cpu_lo
        cur = cpu_hi if locked else cpu_cur[n % len(cpu_cur)]
        idle = "WFI=0 c7=0" if locked else "WFI=1 c7=1"
        cpus.append(
            f"cpu{i}: Online={int(on)} Governor=schedutil MinFreq={lo} MaxFreq={cpu_hi} "
            f"CurrentFreq={cur} IdleStates: {idle} "
        )
    gpu = f"GPU MinFreq={gpu_hi if locked else gpu_lo} MaxFreq={gpu_hi} "
    gpu += f"CurrentFreq={gpu_hi if locked else gpu_lo}"
    emc = f"EMC MinFreq={emc_lo} MaxFreq={emc_hi} CurrentFreq={emc_hi if locked else 2133000000}"
    emc += f" FreqOverride={int(locked)}"
    return "\n".join(
        [
            "SOC family:tegra234  Machine:Jetson AGX Orin",
            f"Online CPUs: 0-{online - 1}",
            *cpus,
            gpu,
            emc,
            "DLA0_CORE:   Online=1 MinFreq=0 MaxFreq=1600000000 CurrentFreq=1600000000",
            "DLA0_FALCON: Online=1 MinFreq=0 MaxFreq=844800000 CurrentFreq=844800000",
            "DLA1_CORE:   Online=1 MinFreq=0 MaxFreq=1600000000 CurrentFreq=1600000000",
            "DLA1_FALCON: Online=1 MinFreq=0 MaxFreq=844800000 CurrentFreq=844800000",
            "PVA0_VPS0: Online=1 MinFreq=0 MaxFreq=1152000000 CurrentFreq=1152000000",
            "PVA0_AXI:  Online=1 MinFreq=0 MaxFreq=832000000 CurrentFreq=832000000",
            "FAN Dynamic Speed control=active hwmon2_pwm1=55",
            f"NV Power Mode: {mode}",
        ]
    )


AGX_64GB_MODES = {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_50W"}
AGX_32GB_MODES = {0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_40W"}
# L4T's nvpmodel_p3767_0000.conf (Orin NX 16GB) and nvpmodel_p3767_0003.conf (Orin Nano
# 8GB) before JetPack 6.2, and their _super.conf of JetPack 6.2, as the LineageOS
# device tree for these modules carries them (android_device_nvidia_concord, nvpmodel/).
ORIN_NX_16GB_MODES = {0: "MAXN", 1: "10W", 2: "15W", 3: "25W"}
ORIN_NX_16GB_SUPER_MODES = {0: "MAXN_SUPER", 1: "10W", 2: "15W", 3: "25W", 4: "40W"}
ORIN_NANO_8GB_MODES = {0: "15W", 1: "7W"}
ORIN_NANO_8GB_SUPER_MODES = {0: "15W", 1: "25W", 2: "MAXN_SUPER", 3: "7W"}
R36_4_3_LINE = (
    "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, "
    "DATE: Wed Jan  8 01:49:37 UTC 2025\n"
)
ORIN_NANO_GPU_HZ = (306000000, 625000000)
ORIN_NANO_SUPER_GPU_HZ = (306000000, 1020000000)
ORIN_NX_GPU_HZ = (306000000, 918000000)


def _jetson_tree(
    board: FakeBoard,
    module: str,
    release: str,
    gpu_devfreq: str,
    cores: int = 12,
    gpu_hz: tuple[int, int] = GPU_HZ,
    model: str = "NVIDIA Jetson AGX Orin Developer Kit",
    carrier: str = "p3737-0000",
) -> None:
    """``module`` as the device tree names it (``p3767-0005-super`` on an Orin Nano
    developer kit flashed with JetPack 6.2's super configuration)."""
    board.write("/proc/device-tree/model", model + "\0")
    # an AGX Orin 64GB developer kit's compatible list (NVIDIA/jetson-gpio issue 125);
    # the Orin NX and Nano sit on the p3768-0000 carrier
    board.write(
        "/proc/device-tree/compatible",
        f"nvidia,{carrier}+{module}\0nvidia,{module}\0nvidia,tegra234\0nvidia,tegra23x\0",
    )
    board.write("/etc/nv_tegra_release", release)
    board.write("/sys/devices/system/node/node0/cpulist", f"0-{cores - 1}\n")
    base = f"/sys/class/devfreq/{gpu_devfreq}"
    for name, value in (("min_freq", gpu_hz[0]), ("max_freq", gpu_hz[1]), ("cur_freq", gpu_hz[0])):
        board.write(f"{base}/{name}", f"{value}\n")
    board.write("/proc/sys/vm/drop_caches", "0\n")
    thermal_zone(board, 0, "cpu-thermal", 47.5, [("passive", 99.0), ("critical", 103.0)])
    thermal_zone(board, 1, "gpu-thermal", 45.2, [("passive", 99.0), ("critical", 103.0)])
    thermal_zone(board, 2, "cv0-thermal", -256.0, [("critical", 103.0)])


def thermal_zone(
    board: FakeBoard, n: int, name: str, temp_c: float, trips: list[tuple[str, float]]
) -> None:
    base = f"/sys/class/thermal/thermal_zone{n}"
    board.write(f"{base}/type", name + "\n")
    board.write(f"{base}/temp", f"{int(temp_c * 1000)}\n")
    for i, (kind, trip_c) in enumerate(trips):
        board.write(f"{base}/trip_point_{i}_type", kind + "\n")
        board.write(f"{base}/trip_point_{i}_temp", f"{int(trip_c * 1000)}\n")


def agx_orin_64gb_jp6(base: Path) -> FakeJetson:
    """Stock JetPack 6: swappiness 60, zram on, MODE_30W, clocks unlocked, jtop inactive."""
    board = FakeBoard(base).meminfo(total=62 * GiB, available=54 * GiB)
    _jetson_tree(board, "p3701-0005", R36_LINE, "17000000.gpu")
    board.write("/etc/nvpmodel.conf", nvpmodel_conf(AGX_64GB_MODES))
    board.write("/proc/sys/vm/swappiness", "60\n")
    board.write("/lib/systemd/system/jtop.service", "[Service]\n")
    zram = {"/dev/zram0": (ZRAM_KIB, 5), "/dev/zram1": (ZRAM_KIB, 5)}
    return FakeJetson(board, AGX_64GB_MODES, mode=2, locked=False, zram=zram)


def agx_orin_32gb_jp5_tuned(base: Path) -> FakeJetson:
    """JetPack 5 tuned right: MAXN, clocks locked, swappiness 10 (persisted), swap file, no zram.

    8 cores and a 930 MHz GPU (NVIDIA's AGX Orin 32GB data sheet; devfreq steps of
    12.75 MHz make it 930750000); MemTotal about 30.6 GiB.
    """
    board = FakeBoard(base).meminfo(total=30 * GiB, available=26 * GiB)
    _jetson_tree(board, "p3701-0004", R35_LINE, "17000000.ga10b", 8, AGX_32GB_GPU_HZ)
    board.write("/proc/sys/vm/swappiness", "10\n")
    board.write("/etc/sysctl.d/99-orin-llm.conf", sysctl_text(10))
    board.write("/etc/systemd/system/jtop.service", "[Service]\n")
    return FakeJetson(
        board,
        AGX_32GB_MODES,
        mode=0,
        locked=True,
        zram_service="disabled",
        jtop="active",
        other_swaps=["/swapfile\tfile\t16777212\t0\t-2\n"],
        cores=8,
        gpu_hz=AGX_32GB_GPU_HZ,
    )


def agx_orin_32gb_devkit_tree_jp6(base: Path) -> FakeJetson:
    """A 32GB AGX Orin flashed with the developer kit's configuration on JetPack 6.

    Its device tree names the developer kit's module, p3701-0000 (the compatible
    list jetson-stats issue 864 shows for an AGX Orin whose EEPROM says otherwise),
    no nvidia,boardids (absent on current L4T), 8 cores and MemTotal ~30.6 GiB.
    Stock otherwise: MODE_30W, clocks unlocked; no nvpmodel.conf to read modes from.
    """
    board = FakeBoard(base).meminfo(total=30 * GiB, available=27 * GiB)
    _jetson_tree(board, "p3701-0000", R36_LINE, "17000000.gpu", 8, AGX_32GB_GPU_HZ)
    board.write("/proc/sys/vm/swappiness", "60\n")
    return FakeJetson(
        board,
        AGX_32GB_MODES,
        mode=2,
        jtop=None,
        cores=8,
        gpu_hz=AGX_32GB_GPU_HZ,
    )


def x86_machine(base: Path) -> tuple[FakeBoard, FakeRunner]:
    """A plain x86 machine: no device tree, no NVIDIA driver, one NUMA node, a swap partition."""
    board = FakeBoard(base).meminfo(total=32 * GiB, available=20 * GiB)
    board.write("/proc/sys/vm/swappiness", "60\n")
    board.write("/proc/swaps", SWAPS_HEADER + "/dev/sda3\tpartition\t2097148\t0\t-2\n")
    board.write("/sys/devices/system/node/node0/cpulist", "0-7\n")
    board.write("/proc/sys/vm/drop_caches", "0\n")
    thermal_zone(board, 0, "x86_pkg_temp", 41.0, [("passive", 100.0), ("critical", 105.0)])
    return board, FakeRunner()


def orin_nx_16gb_jp6(base: Path, super_modes: bool = False) -> FakeJetson:
    """An Orin NX 16GB on the developer kit's carrier, JetPack 6, stock: 15W, zram on.

    8 cores, a 918 MHz GPU, MemTotal about 15.3 GiB. ``super_modes``: JetPack 6.2's
    nvpmodel table (MAXN_SUPER is mode 0, 40W mode 4), in mode 4, its default.
    """
    board = FakeBoard(base).meminfo(total=15 * GiB, available=12 * GiB)
    release = R36_4_3_LINE if super_modes else R36_LINE
    _jetson_tree(
        board,
        "p3767-0000",
        release,
        "17000000.gpu",
        8,
        ORIN_NX_GPU_HZ,
        "NVIDIA Jetson Orin NX Engineering Reference Developer Kit",
        "p3768-0000",
    )
    modes = ORIN_NX_16GB_SUPER_MODES if super_modes else ORIN_NX_16GB_MODES
    default = 4 if super_modes else 2
    board.write("/etc/nvpmodel.conf", nvpmodel_conf(modes, default))
    board.write("/proc/sys/vm/swappiness", "60\n")
    zram = {f"/dev/zram{i}": (ZRAM_KIB // 4, 5) for i in range(8)}
    return FakeJetson(
        board, modes, mode=default, zram=zram, jtop=None, cores=8, gpu_hz=ORIN_NX_GPU_HZ
    )


def orin_nano_8gb_jp6(base: Path, super_modes: bool = False, mode: int = 0) -> FakeJetson:
    """An Orin Nano 8GB developer kit (module p3767-0005) on JetPack 6, stock otherwise.

    6 cores, MemTotal about 7.4 GiB. Before JetPack 6.2 its modes are 15W (0, the
    fastest) and 7W (1), with no MAXN; JetPack 6.2's super configuration (the device
    tree then names ``p3767-0005-super``) has 15W (0), 25W (1, the default),
    MAXN_SUPER (2) and 7W (3).
    """
    board = FakeBoard(base).meminfo(total=7 * GiB + GiB // 2, available=6 * GiB)
    gpu_hz = ORIN_NANO_SUPER_GPU_HZ if super_modes else ORIN_NANO_GPU_HZ
    _jetson_tree(
        board,
        "p3767-0005-super" if super_modes else "p3767-0005",
        R36_4_3_LINE if super_modes else R36_LINE,
        "17000000.gpu",
        6,
        gpu_hz,
        "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit"
        + (" Super" if super_modes else ""),
        "p3768-0000",
    )
    modes = ORIN_NANO_8GB_SUPER_MODES if super_modes else ORIN_NANO_8GB_MODES
    board.write("/etc/nvpmodel.conf", nvpmodel_conf(modes, 1 if super_modes else 0))
    board.write("/proc/sys/vm/swappiness", "60\n")
    zram = {f"/dev/zram{i}": (ZRAM_KIB // 8, 5) for i in range(6)}
    return FakeJetson(board, modes, mode=mode, zram=zram, jtop=None, cores=6, gpu_hz=gpu_hz)
