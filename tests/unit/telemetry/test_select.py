"""select_source: auto choice on each fake board, forced sources and their errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orin.errors import OrinError
from orin.system.commands import CommandRunner
from orin.system.root import SysRoot
from orin.telemetry.sources import SOURCES, Source, TelemetryError, select_source
from orin.telemetry.sources.cpu import CpuSource
from orin.telemetry.sources.jetson_sysfs import JetsonSysfsSource
from orin.telemetry.sources.tegrastats import TegrastatsSource
from tests.fakes.boards_telemetry import agx_orin_64gb, no_gpu_machine
from tests.fakes.runner import FakeRunner

JP6_LINE = (
    "10-05-2026 21:03:35 RAM 5137/62841MB (lfb 2x4MB) SWAP 0/31420MB (cached 0MB) "
    "CPU [1%@729,25%@729] GR3D_FREQ 0% cpu@52.875C VDD_GPU_SOC 3178mW/3178mW"
)


@pytest.fixture(autouse=True)
def no_optional_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same answer whether or not nvidia-ml-py / jetson-stats happen to be installed."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setitem(sys.modules, "jtop", None)


def test_registry_order_is_the_auto_order() -> None:
    assert list(SOURCES) == ["jetson_sysfs", "nvml", "jtop", "tegrastats", "cpu"]


@pytest.mark.parametrize(("jetpack", "gpu"), [(5, "ga10b"), (6, "gpu")])
def test_auto_on_each_orin_picks_sysfs(tmp_path: Path, jetpack: int, gpu: str) -> None:
    board = agx_orin_64gb(tmp_path, jetpack, emc=True)
    runner = FakeRunner(programs={"tegrastats"})
    source, why = select_source(None, board.root, runner)
    assert isinstance(source, JetsonSysfsSource)
    assert why.startswith(f"jetson_sysfs (iGPU {gpu} at /sys/devices/platform/")
    assert "not used" not in why and "\n" not in why
    assert source.sample().gpu_util == 0.123
    assert runner.calls == []  # nothing spawned to decide


def test_auto_on_a_machine_without_gpu_falls_back_to_cpu(tmp_path: Path) -> None:
    source, why = select_source(None, no_gpu_machine(tmp_path).root, FakeRunner())
    assert isinstance(source, CpuSource)
    assert why.startswith("cpu (/proc/stat, ")
    for reason in (
        "jetson_sysfs: no devfreq iGPU",
        "nvml: nvidia-ml-py is not installed",
        "jtop: jetson-stats is not installed",
        "tegrastats: tegrastats not found on PATH",
    ):
        assert reason in why
    assert "\n" not in why


def test_auto_takes_tegrastats_where_sysfs_is_hidden(tmp_path: Path) -> None:
    runner = FakeRunner(programs={"tegrastats"}, streams={("tegrastats",): [JP6_LINE]})
    source, why = select_source(None, no_gpu_machine(tmp_path).root, runner)
    assert isinstance(source, TegrastatsSource)
    assert why.startswith("tegrastats (/usr/bin/tegrastats every 100 ms)")
    source.sample()
    source.join(timeout=5)
    assert source.sample().power_mw == {"VDD_GPU_SOC": 3178.0}
    source.close()


def test_orin_without_a_readable_load_file_is_explained(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 6, load=None)
    source, why = select_source(None, board.root, FakeRunner())
    assert isinstance(source, CpuSource)
    assert "jetson_sysfs: iGPU gpu found but /sys/devices/platform/bus@0/17000000.gpu/load" in why


def test_forced_source(tmp_path: Path) -> None:
    source, why = select_source("cpu", agx_orin_64gb(tmp_path, 5).root, FakeRunner())
    assert isinstance(source, CpuSource)
    assert why.startswith("cpu (forced; /proc/stat, ")


def test_forced_unavailable_source_raises_with_the_reason(tmp_path: Path) -> None:
    root = agx_orin_64gb(tmp_path, 5).root
    with pytest.raises(TelemetryError) as err:
        select_source("tegrastats", root, FakeRunner())
    assert isinstance(err.value, OrinError)
    assert err.value.source == "tegrastats"
    assert err.value.reason == "tegrastats not found on PATH"
    assert str(err.value) == "telemetry source tegrastats is not available: " + err.value.reason
    with pytest.raises(TelemetryError, match="nvidia-ml-py is not installed"):
        select_source("nvml", root, FakeRunner())
    with pytest.raises(TelemetryError, match="no devfreq iGPU"):
        select_source("jetson_sysfs", no_gpu_machine(tmp_path / "x86").root, FakeRunner())


def test_forced_unknown_source(tmp_path: Path) -> None:
    with pytest.raises(TelemetryError, match=r"unknown telemetry source 'gpu' \(known: jetson"):
        select_source("gpu", SysRoot(tmp_path), FakeRunner())


def test_a_source_that_breaks_while_probed_is_passed_over(tmp_path: Path) -> None:
    def broken(root: SysRoot, runner: CommandRunner) -> Source:
        raise RuntimeError("discovery bug\nsecond line")

    registry = {"broken": broken, "cpu": SOURCES["cpu"]}
    source, why = select_source(None, SysRoot(tmp_path), FakeRunner(), registry=registry)
    assert isinstance(source, CpuSource)
    assert why.endswith("not used: broken: RuntimeError: discovery bug second line")
    with pytest.raises(TelemetryError, match="discovery bug"):
        select_source("broken", SysRoot(tmp_path), FakeRunner(), registry=registry)


def test_nothing_available_at_all(tmp_path: Path) -> None:
    registry = {"tegrastats": SOURCES["tegrastats"]}
    with pytest.raises(TelemetryError, match="no telemetry source available: tegrastats: "):
        select_source(None, SysRoot(tmp_path), FakeRunner(), registry=registry)
