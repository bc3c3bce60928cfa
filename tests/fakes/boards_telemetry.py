"""Fake Jetson AGX Orin sysfs trees for the telemetry tests.

The layouts copy what the real boards show (as jetson-stats finds them):
``/sys/class/devfreq/<id>`` is a symlink into the platform device's ``devfreq``
folder, whose ``device`` link points back at the platform device holding ``load``,
and whose ``of_node`` points into the device tree, where ``name`` is NUL-terminated.
INA3221 monitors sit under ``/sys/bus/i2c/devices/1-004x`` (links into the i2c bus
folder) with ``hwmon/hwmonN/inN_label``, ``inN_input`` (mV) and ``currN_input`` (mA).

JetPack 5 (L4T R35): GPU ``17000000.ga10b`` directly under /sys/devices/platform,
rails on 1-0040 and 1-0041 (the latter with unconnected ``NC`` channels).
JetPack 6 (L4T R36): GPU ``bus@0/17000000.gpu``, of_node name ``gpu``; the upstream
ina3221 driver adds unlabelled shunt channels and the ``sum of shunt voltages``
channel 7; only the three rails of the JP6 tegrastats fixture are present.
"""

from __future__ import annotations

import bisect
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.fakes.board import FakeBoard

EMC_ACTIVITY = "/sys/kernel/debug/cactmon/mc_all"
EMC_ACTIVITY_BPMP = "/sys/kernel/debug/bpmp/debug/actmon/mc_all_avg_activity"
EMC_RATE = "/sys/kernel/debug/bpmp/debug/clk/emc/rate"
EMC_RATE_HZ = 2_133_000_000
GPU_MIN_HZ = 306_000_000
GPU_MAX_HZ = 1_300_500_000

Rail = tuple[str, int, int]  # label, mV, mA


@dataclass(frozen=True)
class OrinLayout:
    """Where one JetPack release puts the iGPU and its INA3221 monitors."""

    jetpack: int
    gpu_device: str
    gpu_node: str  # device-tree node under /sys/firmware/devicetree/base
    gpu_name: str  # of_node/name
    i2c_bus: str
    upstream_ina3221: bool
    monitors: dict[str, tuple[Rail, ...]]  # i2c device -> channels 1..3

    @property
    def devfreq_id(self) -> str:
        return os.path.basename(self.gpu_device)


JP5_RAILS_0040: tuple[Rail, ...] = (
    ("VDD_GPU_SOC", 4976, 482),
    ("VDD_CPU_CV", 4984, 80),
    ("VIN_SYS_5V0", 4992, 808),
)
JP5_RAILS_0041: tuple[Rail, ...] = (("NC", 0, 0), ("VDDQ_VDD2_1V8AO", 4984, 60), ("NC", 0, 0))

JP5 = OrinLayout(
    jetpack=5,
    gpu_device="/sys/devices/platform/17000000.ga10b",
    gpu_node="/sys/firmware/devicetree/base/ga10b@17000000",
    gpu_name="ga10b",
    i2c_bus="/sys/devices/platform/c240000.i2c/i2c-1",
    upstream_ina3221=False,
    monitors={"1-0040": JP5_RAILS_0040, "1-0041": JP5_RAILS_0041},
)
JP6 = OrinLayout(
    jetpack=6,
    gpu_device="/sys/devices/platform/bus@0/17000000.gpu",
    gpu_node="/sys/firmware/devicetree/base/bus@0/gpu@17000000",
    gpu_name="gpu",
    i2c_bus="/sys/devices/platform/bus@0/c240000.i2c/i2c-1",
    upstream_ina3221=True,
    monitors={"1-0040": JP5_RAILS_0040},
)
LAYOUTS = {5: JP5, 6: JP6}
# Orin NX and Orin Nano (p3767 modules): one INA3221 whose first channel is the module's
# input, VDD_IN, feeding the other two (NVIDIA's Orin NX/Nano power monitoring; jtop
# takes VDD_IN as the total). tegrastats prints the same three.
ORIN_NX_RAILS: tuple[Rail, ...] = (
    ("VDD_IN", 5048, 1508),
    ("VDD_CPU_GPU_CV", 5040, 420),
    ("VDD_SOC", 5040, 304),
)
ORIN_NX_JP6 = OrinLayout(
    jetpack=6,
    gpu_device=JP6.gpu_device,
    gpu_node=JP6.gpu_node,
    gpu_name=JP6.gpu_name,
    i2c_bus=JP6.i2c_bus,
    upstream_ina3221=True,
    monitors={"1-0040": ORIN_NX_RAILS},
)


def rail_mw(rail: Rail) -> float:
    return rail[1] * rail[2] / 1000.0


class TelemetryBoard(FakeBoard):
    def link(self, link: str, target: str, absolute: bool = False) -> Path:
        """A symlink at system path ``link`` to system path ``target``: relative as sysfs
        makes them, or absolute (pointing outside the fake root, on purpose)."""
        p = self.root.path(link)
        p.parent.mkdir(parents=True, exist_ok=True)
        dest = target if absolute else os.path.relpath(target, os.path.dirname(link))
        os.symlink(dest, p)
        return p

    def remove(self, system_path: str) -> None:
        p = self.root.path(system_path)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()

    def unreadable(self, system_path: str) -> Path:
        """Make the file impossible to read even for root: a directory in its place."""
        p = self.root.path(system_path)
        if p.exists() or p.is_symlink():
            self.remove(system_path)
        p.mkdir(parents=True)
        return p

    def devfreq(
        self,
        device: str,
        node: str,
        name: str,
        load: int | None = None,
        cur_hz: int = GPU_MIN_HZ,
        absolute: bool = False,
    ) -> TelemetryBoard:
        """A platform device with a devfreq entry; ``load`` None leaves out the load file."""
        entry = f"{device}/devfreq/{os.path.basename(device)}"
        self.write(f"{entry}/cur_freq", f"{cur_hz}\n")
        self.write(f"{entry}/min_freq", f"{GPU_MIN_HZ}\n")
        self.write(f"{entry}/max_freq", f"{GPU_MAX_HZ}\n")
        self.write(f"{entry}/governor", "nvhost_podgov\n")
        self.write(f"{node}/name", f"{name}\x00")
        if load is not None:
            self.write(f"{device}/load", f"{load}\n")
        self.link(f"{entry}/device", device, absolute)
        self.link(f"{device}/of_node", node, absolute)
        self.link(f"/sys/class/devfreq/{os.path.basename(device)}", entry, absolute)
        return self

    def ina3221(
        self, i2c_bus: str, dev: str, hwmon: str, rails: tuple[Rail, ...], upstream: bool
    ) -> TelemetryBoard:
        device = f"{i2c_bus}/{dev}"
        folder = f"{device}/hwmon/{hwmon}"
        self.write(f"{device}/name", "ina3221\n")
        self.write(f"{folder}/name", "ina3221\n")
        for n, (label, mv, ma) in enumerate(rails, start=1):
            self.write(f"{folder}/in{n}_label", f"{label}\n")
            self.write(f"{folder}/in{n}_input", f"{mv}\n")
            self.write(f"{folder}/curr{n}_input", f"{ma}\n")
            self.write(f"{folder}/curr{n}_max", "10000\n")
        if upstream:
            for n in (4, 5, 6):  # shunt voltages: inputs without a label
                self.write(f"{folder}/in{n}_input", "12\n")
            self.write(f"{folder}/in7_label", "sum of shunt voltages\n")
            self.write(f"{folder}/in7_input", "36\n")
            self.write(f"{folder}/curr4_input", f"{sum(r[2] for r in rails)}\n")
        self.link(f"/sys/bus/i2c/devices/{dev}", device)
        return self

    def emc(
        self, percent: int = 30, rate_hz: int = EMC_RATE_HZ, activity_path: str = EMC_ACTIVITY
    ) -> TelemetryBoard:
        """debugfs EMC files as root sees them: activity = percent * rate_kHz."""
        self.write(EMC_RATE, f"{rate_hz}\n")
        self.write(activity_path, f"{percent * (rate_hz // 1000)}\n")
        return self

    def gpu_path(self, layout: OrinLayout, name: str) -> str:
        """System path of a file of the iGPU: ``load`` or a devfreq file such as cur_freq."""
        if name == "load":
            return f"{layout.gpu_device}/load"
        return f"{layout.gpu_device}/devfreq/{layout.devfreq_id}/{name}"

    def rail_path(self, layout: OrinLayout, dev: str, what: str) -> str:
        """System path of e.g. ``in1_input`` of monitor ``dev``."""
        hwmon = f"hwmon{list(layout.monitors).index(dev) + 1}"
        return f"{layout.i2c_bus}/{dev}/hwmon/{hwmon}/{what}"


def agx_orin_64gb(
    base: Path,
    jetpack: int = 5,
    *,
    load: int | None = 123,
    emc: bool = False,
    absolute_links: bool = False,
    layout: OrinLayout | None = None,
) -> TelemetryBoard:
    """An AGX Orin 64GB with the JetPack ``jetpack`` (5 or 6) sysfs layout, or another
    module's ``layout`` (ORIN_NX_JP6).

    Besides the iGPU it has a VIC devfreq entry (a non-GPU decoy) and an entry
    without of_node, which discovery must pass over.
    """
    layout = layout or LAYOUTS[jetpack]
    board = TelemetryBoard(base)
    board.meminfo()
    platform = os.path.dirname(layout.gpu_device)
    board.devfreq(f"{platform}/15340000.vic", "/sys/firmware/devicetree/base/vic", "vic", load=0)
    board.write(f"{platform}/15480000.nvdec/devfreq/15480000.nvdec/cur_freq", "115200000\n")
    board.link(
        "/sys/class/devfreq/15480000.nvdec", f"{platform}/15480000.nvdec/devfreq/15480000.nvdec"
    )
    board.devfreq(
        layout.gpu_device, layout.gpu_node, layout.gpu_name, load=load, absolute=absolute_links
    )
    for n, (dev, rails) in enumerate(layout.monitors.items(), start=1):
        board.ina3221(layout.i2c_bus, dev, f"hwmon{n}", rails, layout.upstream_ina3221)
    board.write(f"{layout.i2c_bus}/1-0050/name", "eeprom\n")  # an i2c device that is no monitor
    board.link("/sys/bus/i2c/devices/1-0050", f"{layout.i2c_bus}/1-0050")
    if emc:
        board.emc()
    return board


def no_gpu_machine(base: Path) -> TelemetryBoard:
    """An x86 box: memory, an i2c bus without power monitors, no devfreq at all."""
    board = TelemetryBoard(base)
    board.meminfo()
    board.write("/sys/devices/pci0000:00/i2c-0/0-0050/name", "spd\n")
    board.link("/sys/bus/i2c/devices/0-0050", "/sys/devices/pci0000:00/i2c-0/0-0050")
    return board


# -- the sampler's clock and the reads of one file -------------------------------------


@dataclass
class FakeClock:
    """The sampler's ``clock``, ``clock_ns`` and ``sleep`` without real waiting: ``sleep``
    moves the time on and runs what was scheduled up to the new time (turning the
    engine busy or idle, stopping the sampler), so a loop over minutes runs at once."""

    now: float = 0.0
    _events: list[tuple[float, int, Callable[[], None]]] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def clock_ns(self) -> int:
        return round(self.now * 1e9)

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        while self._events and self._events[0][0] <= self.now + 1e-9:
            self._events.pop(0)[2]()

    def at(self, t: float, action: Callable[[], None]) -> None:
        bisect.insort(self._events, (t, len(self._events), action), key=lambda e: e[:2])


class FileReads:
    """Counts the reads (os.read, os.pread) of one file by this process, the way the
    sources read sysfs: what the kernel's attribute handler would see."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, path: Path) -> None:
        st = os.stat(path)
        self.inode = (st.st_dev, st.st_ino)
        self.count = 0
        real_read, real_pread = os.read, os.pread

        def read(fd: int, n: int) -> bytes:
            self._count(fd)
            return real_read(fd, n)

        def pread(fd: int, n: int, offset: int) -> bytes:
            self._count(fd)
            return real_pread(fd, n, offset)

        monkeypatch.setattr(os, "read", read)
        monkeypatch.setattr(os, "pread", pread)

    def _count(self, fd: int) -> None:
        try:
            st = os.fstat(fd)
        except OSError:
            return
        if (st.st_dev, st.st_ino) == self.inode:
            self.count += 1
