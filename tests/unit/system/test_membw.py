"""Memory bandwidth: data-sheet figures on fake Jetson trees, the cached copy probe elsewhere."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from orin.system import membw
from orin.system.membw import (
    GB,
    Bandwidth,
    copy_bandwidth,
    cpu_model,
    last_level_cache_bytes,
    memory_bandwidth,
    probe_bytes,
)
from tests.fakes.board import FakeBoard, GiB
from tests.fakes.boards_system import (
    R36_LINE,
    agx_orin_32gb_devkit_tree_jp6,
    agx_orin_32gb_jp5_tuned,
    agx_orin_64gb_jp6,
    x86_machine,
)

XEON = "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz"
EPYC = "AMD EPYC 7R13 Processor"


class CountingProbe:
    """Stands in for the copy: counts the calls and answers a fixed figure."""

    def __init__(self, bytes_per_s: float = 12.5 * GB) -> None:
        self.value = bytes_per_s
        self.sizes: list[int] = []

    def __call__(self, nbytes: int, reps: int = 5, threads: int | None = None) -> float:
        self.sizes.append(nbytes)
        return self.value


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> CountingProbe:
    fake = CountingProbe()
    monkeypatch.setattr(membw, "copy_bandwidth", fake)
    return fake


def no_probe(nbytes: int, reps: int = 5, threads: int | None = None) -> float:
    raise AssertionError("a Jetson is not probed")


def orin_nx_nano_tree(base: Path, module: str, total: int, super_dt: bool = False) -> FakeBoard:
    """An Orin NX / Nano module on its developer-kit carrier (p3768), JetPack 6;
    ``super_dt``: flashed with JetPack 6.2's super configuration (``...-super``)."""
    board = FakeBoard(base).meminfo(total=total, available=total // 2)
    suffix = "-super" if super_dt else ""
    board.write(
        "/proc/device-tree/compatible",
        f"nvidia,p3768-0000+{module}{suffix}\0nvidia,{module}\0nvidia,tegra234\0",
    )
    board.write("/etc/nv_tegra_release", R36_LINE)
    return board


@pytest.mark.parametrize(
    ("make", "board", "gbps"),
    [
        (agx_orin_64gb_jp6, "agx-orin-64gb", 204.8),
        (agx_orin_32gb_jp5_tuned, "agx-orin-32gb", 204.8),
        # the developer kit's device tree on a 32GB module: memory settles the SKU
        (agx_orin_32gb_devkit_tree_jp6, "agx-orin-32gb", 204.8),
    ],
)
def test_agx_orin_data_sheet(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[[Path], object],
    board: str,
    gbps: float,
) -> None:
    monkeypatch.setattr(membw, "copy_bandwidth", no_probe)
    make(tmp_path / "root")
    bw = memory_bandwidth(FakeBoard(tmp_path / "root").root, cache=tmp_path / "c.json")
    assert bw.source == f"datasheet:{board}"
    assert bw.bytes_per_s == pytest.approx(gbps * GB) and bw.gb_per_s == pytest.approx(gbps)
    assert "LPDDR5" in bw.detail
    assert not (tmp_path / "c.json").exists()  # nothing measured, nothing cached


@pytest.mark.parametrize(
    ("module", "total", "super_dt", "board", "gbps"),
    [
        ("p3767-0000", 16 * GiB, False, "orin-nx-16gb", 102.4),
        ("p3767-0001", 8 * GiB, False, "orin-nx-8gb", 102.4),
        ("p3767-0003", 8 * GiB, False, "orin-nano-8gb", 68.0),
        ("p3767-0005", 8 * GiB, False, "orin-nano-8gb", 68.0),
        ("p3767-0004", 4 * GiB, False, "orin-nano-4gb", 34.0),
        # JetPack 6.2's super configuration (device tree ...-super) runs an Orin Nano's
        # LPDDR5 at 6400 MT/s: 68 GB/s would understate its decode ceiling by a third
        ("p3767-0005", 8 * GiB, True, "orin-nano-8gb-super", 102.0),
        ("p3767-0003", 8 * GiB, True, "orin-nano-8gb-super", 102.0),
        ("p3767-0004", 4 * GiB, True, "orin-nano-4gb-super", 51.0),
        ("p3767-0000", 16 * GiB, True, "orin-nx-16gb", 102.4),  # its memory was at 6400 MT/s
    ],
)
def test_orin_nx_and_nano_data_sheets(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    module: str,
    total: int,
    super_dt: bool,
    board: str,
    gbps: float,
) -> None:
    monkeypatch.setattr(membw, "copy_bandwidth", no_probe)
    root = orin_nx_nano_tree(tmp_path / "root", module, total, super_dt=super_dt).root
    bw = memory_bandwidth(root, cache=tmp_path / "c.json")
    assert (bw.source, bw.bytes_per_s) == (f"datasheet:{board}", pytest.approx(gbps * GB))


def test_an_unlisted_jetson_module_is_probed(tmp_path: Path, probe: CountingProbe) -> None:
    root = orin_nx_nano_tree(tmp_path / "root", "p3668-0001", 8 * GiB).root  # Xavier NX
    bw = memory_bandwidth(root, cache=tmp_path / "c.json")
    assert bw.source == "probe" and len(probe.sizes) == 1


def test_the_probe_runs_once_and_is_cached(tmp_path: Path, probe: CountingProbe) -> None:
    board, _ = x86_machine(tmp_path / "root")
    board.write("/proc/cpuinfo", f"processor\t: 0\nmodel name\t: {XEON}\n")
    cache = tmp_path / "cache" / "membw.json"
    first = memory_bandwidth(board.root, cache=cache)
    assert first == Bandwidth(12.5 * GB, "probe", first.detail)
    assert "numpy copy" in first.detail
    again = memory_bandwidth(board.root, cache=cache)
    assert again == first and len(probe.sizes) == 1
    assert memory_bandwidth(board.root, cache=cache, probe=False) == first
    data = json.loads(cache.read_text())
    assert list(data["machines"]) == [f"{XEON}|32 GiB"]  # CPU model and memory size


def test_without_probing_and_nothing_cached_it_is_unknown(
    tmp_path: Path, probe: CountingProbe
) -> None:
    board, _ = x86_machine(tmp_path / "root")
    bw = memory_bandwidth(board.root, cache=tmp_path / "c.json", probe=False)
    assert (bw.bytes_per_s, bw.source, bw.known) == (0.0, "unknown", False)
    assert bw.to_dict()["gb_per_s"] is None
    assert probe.sizes == [] and not (tmp_path / "c.json").exists()


def test_another_cpu_model_measures_again(tmp_path: Path, probe: CountingProbe) -> None:
    board, _ = x86_machine(tmp_path / "root")
    cache = tmp_path / "c.json"
    board.write("/proc/cpuinfo", f"model name\t: {XEON}\n")
    memory_bandwidth(board.root, cache=cache)
    board.write("/proc/cpuinfo", f"model name\t: {EPYC}\n")
    assert memory_bandwidth(board.root, cache=cache, probe=False).source == "unknown"
    probe.value = 40 * GB
    assert memory_bandwidth(board.root, cache=cache).bytes_per_s == 40 * GB
    assert len(probe.sizes) == 2
    machines = json.loads(cache.read_text())["machines"]
    assert set(machines) == {f"{XEON}|32 GiB", f"{EPYC}|32 GiB"}
    # a different memory size is another machine too
    board.meminfo(total=64 * GiB)
    assert memory_bandwidth(board.root, cache=cache, probe=False).source == "unknown"


def test_a_corrupt_cache_is_measured_again(tmp_path: Path, probe: CountingProbe) -> None:
    board, _ = x86_machine(tmp_path / "root")
    cache = tmp_path / "c.json"
    cache.write_text("{not json")
    assert memory_bandwidth(board.root, cache=cache).source == "probe"
    assert json.loads(cache.read_text())["version"] == membw.CACHE_VERSION


def test_a_real_copy_on_a_tiny_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(membw, "PROBE_MIN_BYTES", 1 << 20)
    board, _ = x86_machine(tmp_path / "root")
    bw = memory_bandwidth(board.root, cache=tmp_path / "c.json")
    assert bw.source == "probe" and bw.bytes_per_s > 0
    assert copy_bandwidth(4096, reps=2, threads=3) > 0
    with pytest.raises(ValueError):
        copy_bandwidth(0)


def test_the_buffer_outgrows_the_last_level_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membw, "PROBE_MIN_BYTES", 1 << 20)
    board, _ = x86_machine(tmp_path / "root")
    cache = "/sys/devices/system/cpu/cpu0/cache"
    for i, (level, size) in enumerate([(1, "48K"), (2, "1280K"), (3, "54M")]):
        board.write(f"{cache}/index{i}/level", f"{level}\n")
        board.write(f"{cache}/index{i}/size", f"{size}\n")
    assert last_level_cache_bytes(board.root) == 54 * 2**20
    assert probe_bytes(board.root) == 16 * 54 * 2**20
    board.meminfo(total=4 * GiB, available=2 * GiB)  # never more than MemAvailable / 8
    assert probe_bytes(board.root) == 2 * GiB // 8
    assert last_level_cache_bytes(FakeBoard(tmp_path / "bare").root) is None


@pytest.mark.parametrize(
    ("text", "model"),
    [
        (f"processor\t: 0\nmodel name\t: {XEON}\nprocessor\t: 1\nmodel name\t: {XEON}\n", XEON),
        (
            "processor\t: 0\nBogoMIPS\t: 62.50\nCPU implementer\t: 0x41\nCPU variant\t: 0x1\n"
            "CPU part\t: 0xd42\n",
            "arm implementer 0x41 part 0xd42 variant 0x1",
        ),
        ("", "unknown"),
    ],
)
def test_cpu_model(tmp_path: Path, text: str, model: str) -> None:
    board = FakeBoard(tmp_path)
    if text:
        board.write("/proc/cpuinfo", text)
    assert cpu_model(board.root) == model
