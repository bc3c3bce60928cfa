"""jetson_sysfs on fake AGX Orin trees: discovery, units, debugfs without root,
files that are missing, unreadable or vanish mid-run."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from orin.telemetry.sources import jetson_sysfs as js
from orin.telemetry.sources.base import read_file, realpath_in
from tests.fakes.boards_telemetry import (
    EMC_ACTIVITY,
    EMC_ACTIVITY_BPMP,
    EMC_RATE,
    GPU_MAX_HZ,
    GPU_MIN_HZ,
    JP5,
    JP5_RAILS_0040,
    JP5_RAILS_0041,
    JP6,
    LAYOUTS,
    TelemetryBoard,
    agx_orin_64gb,
    no_gpu_machine,
    rail_mw,
)

JP5_RAIL_LABELS = ["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0", "VDDQ_VDD2_1V8AO"]
JP6_RAIL_LABELS = ["VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0"]


@pytest.fixture(params=[5, 6], ids=["jp5", "jp6"])
def jetpack(request: pytest.FixtureRequest) -> int:
    return int(request.param)


# -- realpath inside the root ---------------------------------------------------------


def test_realpath_follows_relative_links(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 5)
    assert realpath_in(board.root, "/sys/class/devfreq/17000000.ga10b/device") == JP5.gpu_device


def test_realpath_keeps_absolute_links_inside_the_root(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 6, absolute_links=True)
    link = "/sys/class/devfreq/17000000.gpu/device"
    # The OS would leave the fake tree for the host's /sys; realpath_in must not.
    assert not os.path.realpath(board.root.path(link)).startswith(str(tmp_path))
    assert realpath_in(board.root, link) == JP6.gpu_device
    assert board.root.path(realpath_in(board.root, link)).is_relative_to(tmp_path)


def test_realpath_stops_at_the_root_and_survives_loops(tmp_path: Path) -> None:
    board = TelemetryBoard(tmp_path)
    board.link("/sys/a", "/sys/b")
    board.link("/sys/b", "/sys/a")
    assert realpath_in(board.root, "/../../etc/../sys/x") == "/sys/x"
    assert realpath_in(board.root, "/sys/a/load").startswith("/sys/")


# -- discovery ----------------------------------------------------------------------------


def test_discovers_the_igpu_of_each_jetpack(tmp_path: Path, jetpack: int) -> None:
    layout = LAYOUTS[jetpack]
    found = js.discover(agx_orin_64gb(tmp_path, jetpack).root).gpu
    assert found is not None
    assert found.name == layout.gpu_name
    assert found.device == layout.gpu_device
    assert found.devfreq == f"{layout.gpu_device}/devfreq/{layout.devfreq_id}"


def test_jp5_rails_skip_unconnected_channels(tmp_path: Path) -> None:
    rails = js.discover(agx_orin_64gb(tmp_path, 5).root).rails
    assert [r.label for r in rails] == JP5_RAIL_LABELS
    assert rails[3].voltage.endswith("1-0041/hwmon/hwmon2/in2_input")


def test_jp6_rails_skip_the_sum_channel_and_unlabelled_shunts(tmp_path: Path) -> None:
    rails = js.discover(agx_orin_64gb(tmp_path, 6).root).rails
    assert [r.label for r in rails] == JP6_RAIL_LABELS


def test_non_gpu_devfreq_entries_are_passed_over(tmp_path: Path) -> None:
    board = TelemetryBoard(tmp_path)
    board.devfreq("/sys/devices/platform/15340000.vic", "/sys/fw/vic", "vic", load=0)
    assert js.find_gpu(board.root) is None
    board.devfreq("/sys/devices/17000000.gv11b", "/sys/fw/gv11b", "gv11b", load=5)
    found = js.find_gpu(board.root)
    assert found is not None and found.name == "gv11b"


def test_no_gpu_machine_has_nothing(tmp_path: Path) -> None:
    layout = js.discover(no_gpu_machine(tmp_path).root)
    assert layout.gpu is None
    assert layout.rails == ()
    assert layout.emc is None


def test_of_node_name_is_nul_terminated() -> None:
    assert js.parse_of_name("ga10b\x00") == "ga10b"
    assert js.parse_of_name("gpu\x00\n") == "gpu"
    assert js.parse_of_name("\x00") is None
    assert js.parse_of_name(None) is None


# -- parsing and units ------------------------------------------------------------------


def test_read_gives_units_for_each_jetpack(tmp_path: Path, jetpack: int) -> None:
    reading = js.read(agx_orin_64gb(tmp_path, jetpack, load=456).root)
    assert reading.gpu is not None
    assert reading.gpu.load == pytest.approx(0.456)
    assert reading.gpu.cur_freq_hz == GPU_MIN_HZ
    assert reading.gpu.min_freq_hz == GPU_MIN_HZ
    assert reading.gpu.max_freq_hz == GPU_MAX_HZ
    assert reading.gpu.governor == "nvhost_podgov"
    gpu_soc = reading.rails[0]
    assert (gpu_soc.label, gpu_soc.voltage_mv, gpu_soc.current_ma) == JP5_RAILS_0040[0]
    assert gpu_soc.power_mw == pytest.approx(4976 * 482 / 1000)
    assert reading.emc_util is None  # no debugfs on this board


def test_sample_for_each_jetpack(tmp_path: Path, jetpack: int) -> None:
    source = js.JetsonSysfsSource(agx_orin_64gb(tmp_path, jetpack, load=1000).root)
    before = time.perf_counter_ns()
    sample = source.sample()
    assert before <= sample.t_ns <= time.perf_counter_ns()
    assert sample.gpu_util == 1.0
    assert sample.gpu_freq_hz == GPU_MIN_HZ
    expected = {r[0]: rail_mw(r) for r in JP5_RAILS_0040}
    if jetpack == 5:
        expected["VDDQ_VDD2_1V8AO"] = rail_mw(JP5_RAILS_0041[1])
    assert sample.power_mw == pytest.approx(expected)
    assert sample.cpu_util is None and sample.gpu_mem_used_bytes is None


def test_parse_is_pure() -> None:
    layout = js.JetsonLayout(
        gpu=js.GpuPaths(name="gpu", devfreq="/d", device="/g"),
        rails=(js.RailPaths("VDD_GPU_SOC", "/v", "/c"),),
        emc=js.EmcPaths(activity="/a", rate="/r"),
    )
    texts = {"/g/load": "250\n", "/d/cur_freq": "918000000\n", "/v": "5000\n", "/c": "1000\n"}
    texts |= {"/a": "10665000\n", "/r": "2133000000\n"}
    reading = js.parse(layout, texts)
    assert reading.gpu is not None and reading.gpu.load == 0.25
    assert reading.gpu.cur_freq_hz == 918_000_000 and reading.gpu.governor is None
    assert reading.emc_util == 0.05
    assert reading.rails[0].power_mw == 5000.0


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0\n", 0.0), ("999", 0.999), ("1000\n", 1.0), ("1200", 1.0), ("junk", None), (None, None)],
)
def test_load_scale(text: str | None, expected: float | None) -> None:
    assert js.parse_load(text) == expected


def test_emc_percent_is_activity_over_rate_in_khz() -> None:
    rate = "2133000000\n"  # Hz, 2133000 kHz
    assert js.emc_util(str(30 * 2_133_000), rate) == 0.30
    assert js.emc_util(str(31 * 2_133_000 - 1), rate) == 0.30  # integer percent, as jtop
    assert js.emc_util(str(500 * 2_133_000), rate) == 1.0
    assert js.emc_util("100", "999") is None  # rate under 1 kHz: no division by zero
    assert js.emc_util(None, rate) is None
    assert js.emc_util("abc", rate) is None


# -- EMC through debugfs -----------------------------------------------------------------


def test_emc_with_root(tmp_path: Path) -> None:
    source = js.JetsonSysfsSource(agx_orin_64gb(tmp_path, 5, emc=True).root)
    assert source.sample().emc_util == 0.30
    assert "EMC from /sys/kernel/debug/cactmon/mc_all" in source.availability().reason


def test_emc_takes_the_first_readable_actmon_file(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 6)
    board.emc(percent=12, activity_path=EMC_ACTIVITY_BPMP)
    board.unreadable(EMC_ACTIVITY)  # the preferred file exists but cannot be read
    layout = js.discover(board.root)
    assert layout.emc is not None and layout.emc.activity == EMC_ACTIVITY_BPMP
    assert js.JetsonSysfsSource(board.root).sample().emc_util == 0.12


def test_unreadable_debugfs_is_unavailable_not_an_error(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 5, emc=True)
    board.unreadable(EMC_ACTIVITY)  # a directory: EISDIR even for root
    assert read_file(board.root.path(EMC_ACTIVITY)) is None
    source = js.JetsonSysfsSource(board.root)
    assert source.layout.emc is None
    assert "debugfs needs root" in source.availability().reason
    assert source.availability().ok
    assert source.sample().emc_util is None


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_chmod_000_debugfs_is_unavailable(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 5, emc=True)
    board.root.path(EMC_RATE).chmod(0)
    assert js.discover(board.root).emc is None


def test_emc_without_rate_is_unavailable(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 5, emc=True)
    board.remove(EMC_RATE)
    emc, reason = js.find_emc(board.root)
    assert emc is None and EMC_RATE in reason


# -- missing and vanishing files ------------------------------------------------------------


def test_missing_load_file_makes_the_source_unavailable(tmp_path: Path) -> None:
    source = js.JetsonSysfsSource(agx_orin_64gb(tmp_path, 6, load=None).root)
    found = source.availability()
    assert not found.ok
    assert "17000000.gpu/load is not readable" in found.reason


def test_no_gpu_source_is_unavailable_and_samples_nothing(tmp_path: Path) -> None:
    source = js.JetsonSysfsSource(no_gpu_machine(tmp_path).root)
    assert source.availability() == js.Availability(
        False, "no devfreq iGPU (ga10b/gp10b/gpu/gv11b)"
    )
    sample = source.sample()
    assert (sample.gpu_util, sample.gpu_freq_hz, sample.emc_util, sample.power_mw) == (
        None,
        None,
        None,
        {},
    )


def test_rail_that_disappears_mid_run(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 5)
    source = js.JetsonSysfsSource(board.root, slow_every=1, reopen_every=1)
    assert "VDD_GPU_SOC" in source.sample().power_mw
    board.remove(board.rail_path(JP5, "1-0040", "curr1_input"))
    after = source.sample()
    assert "VDD_GPU_SOC" not in after.power_mw
    assert list(after.power_mw) == JP5_RAIL_LABELS[1:]
    board.write(board.rail_path(JP5, "1-0040", "curr1_input"), "100\n")
    assert source.sample().power_mw["VDD_GPU_SOC"] == pytest.approx(497.6)


def test_whole_monitor_unbound_mid_run(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 6)
    source = js.JetsonSysfsSource(board.root)
    board.remove(f"{JP6.i2c_bus}/1-0040")
    assert source.sample().power_mw == {}


def test_gpu_files_that_vanish_or_turn_to_junk(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 5)
    source = js.JetsonSysfsSource(board.root)
    board.remove(board.gpu_path(JP5, "load"))
    board.write(board.gpu_path(JP5, "cur_freq"), "\n")
    sample = source.sample()
    assert sample.gpu_util is None and sample.gpu_freq_hz is None
    assert sample.power_mw  # the rails are still read


def test_rails_are_read_at_the_slow_rate_and_carried(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 5)
    source = js.JetsonSysfsSource(board.root)
    first = source.sample().power_mw
    board.write(board.rail_path(JP5, "1-0040", "curr1_input"), "100\n")
    carried = [source.sample().power_mw for _ in range(js.SLOW_EVERY - 1)]
    assert carried == [first] * (js.SLOW_EVERY - 1)
    assert source.sample().power_mw["VDD_GPU_SOC"] == pytest.approx(497.6)  # the next read


def test_clock_is_read_with_the_slow_fields_and_load_every_time(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 6, load=100)
    source = js.JetsonSysfsSource(board.root)
    first = source.sample()
    board.write(board.gpu_path(JP6, "cur_freq"), "918000000\n")
    board.write(board.gpu_path(JP6, "load"), "900\n")
    between = [source.sample() for _ in range(js.SLOW_EVERY - 1)]
    assert [s.gpu_freq_hz for s in between] == [first.gpu_freq_hz] * (js.SLOW_EVERY - 1)
    assert [s.gpu_util for s in between] == [0.9] * (js.SLOW_EVERY - 1)
    assert source.sample().gpu_freq_hz == 918_000_000


def test_files_kept_open_follow_writes_and_are_reopened(tmp_path: Path) -> None:
    board = agx_orin_64gb(tmp_path, 6, load=100)
    source = js.JetsonSysfsSource(board.root, slow_every=1, reopen_every=3)
    assert source.sample().gpu_util == 0.1
    board.write(board.gpu_path(JP6, "load"), "750\n")
    board.write(board.rail_path(JP6, "1-0040", "curr1_input"), "100\n")
    after = source.sample()  # re-read from offset 0 through the open descriptors
    assert after.gpu_util == 0.75 and after.power_mw["VDD_GPU_SOC"] == pytest.approx(497.6)
    board.remove(board.gpu_path(JP6, "load"))
    source.sample()
    assert source.sample().gpu_util is None  # the 4th tick reopens: gone
    board.write(board.gpu_path(JP6, "load"), "500\n")
    loads = [source.sample().gpu_util for _ in range(3)]
    assert loads[-1] == 0.5  # back at the next reopen
    source.close()
