"""Platform detection: the parsers on captured text, detect() on the three fake boards."""

from __future__ import annotations

from pathlib import Path

import pytest

from orin.system.jetson import (
    L4TRelease,
    ModuleId,
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
from orin.system.platform import detect, is_jetson, numa_node_count, parse_swaps
from tests.fakes.board import FakeBoard, GiB
from tests.fakes.boards_system import (
    R35_LINE,
    R36_LINE,
    agx_orin_32gb_devkit_tree_jp6,
    agx_orin_32gb_jp5_tuned,
    agx_orin_64gb_jp6,
    clocks_show,
    orin_nano_8gb_jp6,
    x86_machine,
)


@pytest.mark.parametrize(
    ("line", "version", "jetpack"),
    [
        (
            "# R35 (release), REVISION: 3.1, GCID: 32790763, BOARD: t186ref, EABI: aarch64, "
            "DATE: Wed Mar 15 07:54:12 UTC 2023",
            "35.3.1",
            "5.1.1",
        ),
        (
            "# R36 (release), REVISION: 3.0, GCID: 36923193, BOARD: generic, EABI: aarch64, "
            "DATE: Fri Jul 19 23:24:25 UTC 2024",
            "36.3.0",
            "6.0",
        ),
        (R35_LINE, "35.4.1", "5.1.2"),
        (R36_LINE, "36.4.0", "6.1"),
    ],
)
def test_tegra_release(line: str, version: str, jetpack: str) -> None:
    release = parse_tegra_release(line)
    assert release is not None
    assert release.version == version and release.jetpack == jetpack


def test_jetpack_of_an_unlisted_release_is_its_series() -> None:
    assert L4TRelease(36, "9.9").jetpack == "6.x"
    assert L4TRelease(35, "6.0").jetpack == "5.1.4"
    assert L4TRelease(36, "4.4").jetpack == "6.2.1"


@pytest.mark.parametrize(
    ("l4t", "jetpack"),
    [("35.6.1", "5.1.5"), ("35.6.4", "5.1.6"), ("36.4.7", "6.2.1"), ("36.5.0", "6.2.2")],
)
def test_later_point_releases_are_named_exactly(l4t: str, jetpack: str) -> None:
    """As jetson-stats names them (NVIDIA_JETPACK), not only by their series."""
    major, _, revision = l4t.partition(".")
    assert L4TRelease(int(major), revision).jetpack == jetpack
    assert parse_tegra_release("garbage") is None


def test_module_and_soc_from_the_compatible_list() -> None:
    compat = device_tree_strings(
        "nvidia,p3737-0000+p3701-0005\0nvidia,p3737-0000\0nvidia,p3701-0005\0nvidia,tegra234\0"
    )
    assert parse_module(compat) == "p3701-0005"
    assert parse_soc(compat) == "tegra234"
    assert parse_module(["nvidia,p3701-0004", "nvidia,tegra234"]) == "p3701-0004"
    assert parse_module(["acme,board"]) is None


def test_nvpmodel_query_after_a_warning_line() -> None:
    mode = parse_nvpmodel_query("NVPM WARN: Fan mode is not set!\nNV Power Mode: MODE_30W\n2\n")
    assert mode is not None
    assert (mode.name, mode.id, mode.is_maxn) == ("MODE_30W", 2, False)
    maxn = parse_nvpmodel_query("NV Power Mode: MAXN\n0\n")
    assert maxn is not None and maxn.is_maxn
    assert parse_nvpmodel_query("nvpmodel: command not found") is None


def test_nvpmodel_conf_modes() -> None:
    text = (
        "< POWER_MODEL ID=0 NAME=MAXN >\nCPU_ONLINE CORE_0 1\n< POWER_MODEL ID=3 NAME=MODE_50W >\n"
    )
    assert parse_nvpmodel_conf(text) == {0: "MAXN", 3: "MODE_50W"}


def test_jetson_clocks_show_locked_and_unlocked() -> None:
    unlocked = parse_jetson_clocks_show(clocks_show(False, "MODE_30W", online=8))
    assert unlocked.locked is False and unlocked.complete
    assert unlocked.unlocked == ("CPU", "GPU", "EMC")
    assert len([d for d in unlocked.domains if d.name == "CPU"]) == 8  # offline cores skipped
    locked = parse_jetson_clocks_show(clocks_show(True, "MAXN"))
    assert locked.locked is True and locked.unlocked == ()
    assert parse_jetson_clocks_show("").locked is None


def test_a_locked_board_keeps_emc_min_at_its_floor() -> None:
    """jetson_clocks pins EMC through the BPMP override: max == current, min stays 204 MHz."""
    locked = parse_jetson_clocks_show(clocks_show(True, "MAXN"))
    emc = next(d for d in locked.domains if d.name == "EMC")
    assert (emc.min_hz, emc.max_hz, emc.current_hz, emc.override) == (
        204000000,
        3199000000,
        3199000000,
        True,
    )
    assert emc.locked and locked.locked


@pytest.mark.parametrize(
    ("line", "locked"),
    [
        # AGX Orin, jetson_clocks run: the override set, the rate at the maximum
        ("EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=3199000000 FreqOverride=1", True),
        # AGX Orin at boot (catid.io capture): the governor's rate, no override
        ("EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=2133000000 FreqOverride=0", False),
        # Nano under load, not locked (jetson-stats' sample line): at max without override
        ("EMC MinFreq=204000000 MaxFreq=1600000000 CurrentFreq=1600000000 FreqOverride=0", False),
        # a locked board whose rate has not reached the maximum
        ("EMC MinFreq=204000000 MaxFreq=3199000000 CurrentFreq=2133000000 FreqOverride=1", False),
    ],
)
def test_emc_is_locked_when_overridden_at_its_maximum(line: str, locked: bool) -> None:
    state = parse_jetson_clocks_show(line)
    assert state.locked is locked


def test_cpu_and_gpu_are_locked_when_min_equals_max() -> None:
    text = (
        "cpu0: Online=1 Governor=schedutil MinFreq=2201600 MaxFreq=2201600 "
        "CurrentFreq=2188800 IdleStates: WFI=0 c7=0 \n"  # current dips under a thermal cap
        "cpu1: Online=1 Governor=schedutil MinFreq=729600 MaxFreq=2201600 "
        "CurrentFreq=2201600 IdleStates: WFI=1 c7=1 \n"  # at max by load, not locked
        "GPU MinFreq=1300500000 MaxFreq=1300500000 CurrentFreq=1300500000\n"
    )
    state = parse_jetson_clocks_show(text)
    assert [d.locked for d in state.domains] == [True, False, True]
    assert state.unlocked == ("CPU",) and not state.complete


def test_dla_and_pva_lines_are_not_clock_domains() -> None:
    """Their min is 0 and jetson_clocks leaves them alone: judging them would never lock."""
    names = {d.name for d in parse_jetson_clocks_show(clocks_show(True, "MAXN")).domains}
    assert names == {"CPU", "GPU", "EMC"}


def test_boardids_as_a_part_number() -> None:
    assert parse_boardids("3701:0004:TS4\0") == "p3701-0004"
    assert parse_boardids("3489:0000:A0") == "p3489-0000"  # jetson-stats issue 184
    assert parse_boardids("") is None


@pytest.mark.parametrize(
    ("compatible", "boardids", "total", "expected"),
    [
        # a 32GB module flashed with the developer kit's (64GB) device tree
        ("p3701-0005", None, 30.6, ModuleId("p3701-0004", "memory size (30.6 GiB)", "p3701-0005")),
        ("p3701-0000", None, 30.6, ModuleId("p3701-0004", "memory size (30.6 GiB)", "p3701-0000")),
        ("p3701-0000", None, 61.3, ModuleId("p3701-0005", "memory size (61.3 GiB)", "p3701-0000")),
        ("p3701-0005", None, 61.3, ModuleId("p3701-0005", "device tree")),
        ("p3701-0008", None, 61.3, ModuleId("p3701-0008", "device tree")),
        ("p3701-0004", None, 30.6, ModuleId("p3701-0004", "device tree")),
        ("p3701-0000", "p3701-0004", 30.6, ModuleId("p3701-0004", "nvidia,boardids")),
        ("p3701-0005", None, None, ModuleId("p3701-0005", "device tree")),  # no meminfo
        ("p3767-0000", None, 15.3, ModuleId("p3767-0000", "device tree")),  # not an AGX Orin
        (None, None, 62.0, ModuleId(None, "unknown")),
    ],
)
def test_module_identity_settled_by_memory(
    compatible: str | None, boardids: str | None, total: float | None, expected: ModuleId
) -> None:
    mem = int(total * GiB) if total is not None else None
    assert identify_module(compatible, boardids, mem) == expected


@pytest.mark.parametrize(
    ("major", "support"),
    [(36, "supported"), (35, "old"), (34, "unsupported"), (32, "unsupported"), (38, "newer")],
)
def test_release_support(major: int, support: str) -> None:
    assert L4TRelease(major, "4.0").support == support


def test_swaps_tell_zram_from_disk() -> None:
    text = (
        "Filename\tType\tSize\tUsed\tPriority\n"
        "/dev/zram0                              partition\t2521760\t1024\t5\n"
        "/swapfile                               file\t16777212\t0\t-2\n"
        "/dev/nvme0n1p3                          partition\t1000\t0\t-3\n"
    )
    kinds = [(s.path, s.kind, s.priority) for s in parse_swaps(text)]
    assert kinds == [
        ("/dev/zram0", "zram", 5),
        ("/swapfile", "file", -2),
        ("/dev/nvme0n1p3", "partition", -3),
    ]
    assert parse_swaps(text)[0].used_bytes == 1024 * 1024


def test_detect_agx_orin_64gb_jetpack6(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    p = detect(fake.board.root, fake.runner)
    assert p.is_jetson and p.unified_memory and p.nvidia_gpu
    assert (p.module, p.module_name, p.soc, p.cuda_arch) == (
        "p3701-0005",
        "Jetson AGX Orin 64GB",
        "tegra234",
        "8.7",
    )
    assert p.model == "NVIDIA Jetson AGX Orin Developer Kit"
    assert p.l4t is not None and p.l4t.version == "36.4.0" and p.jetpack == "6.1"
    assert p.memory is not None and p.memory.total == 62 * GiB
    assert p.numa_nodes == 1
    assert [d.path for d in p.zram_devices] == ["/dev/zram0", "/dev/zram1"]
    assert p.power_mode is not None and p.power_mode.name == "MODE_30W"
    assert p.power_modes[3] == "MODE_50W"
    assert p.clocks is not None and p.clocks.locked is False
    assert p.module_id == ModuleId("p3701-0005", "device tree") and p.board == "agx-orin-64gb"
    temps = {z.name: z.temp_c for z in p.thermal}
    assert temps == {"cpu-thermal": 47.5, "gpu-thermal": 45.2, "cv0-thermal": None}
    assert fake.calls == [("nvpmodel", "-q"), ("jetson_clocks", "--show")]
    assert is_jetson(fake.board.root)
    assert p.describe() == "Jetson AGX Orin 64GB, L4T 36.4.0 (JetPack 6.1), MODE_30W"


def test_detect_agx_orin_32gb_jetpack5_tuned(tmp_path: Path) -> None:
    fake = agx_orin_32gb_jp5_tuned(tmp_path)
    p = detect(fake.board.root, fake.runner)
    assert p.module_name == "Jetson AGX Orin 32GB" and p.jetpack == "5.1.2"
    assert p.power_mode is not None and p.power_mode.is_maxn
    assert p.power_modes[3] == "MODE_40W"  # no nvpmodel.conf: the module's table
    assert p.clocks is not None and p.clocks.locked is True and p.clocks.complete
    assert p.zram_devices == () and [s.kind for s in p.swaps] == ["file"]
    assert p.board == "agx-orin-32gb" and p.l4t is not None and p.l4t.support == "old"


def test_detect_a_32gb_module_with_the_devkit_device_tree(tmp_path: Path) -> None:
    fake = agx_orin_32gb_devkit_tree_jp6(tmp_path)
    p = detect(fake.board.root, fake.runner)
    assert (p.module, p.module_name, p.board) == (
        "p3701-0004",
        "Jetson AGX Orin 32GB",
        "agx-orin-32gb",
    )
    assert p.module_id == ModuleId("p3701-0004", "memory size (30.0 GiB)", "p3701-0000")
    assert p.power_modes[3] == "MODE_40W"  # the 32GB table, not the devkit's MODE_50W
    assert p.describe() == "Jetson AGX Orin 32GB, L4T 36.4.0 (JetPack 6.1), MODE_30W"
    d = p.to_dict()
    assert (d["board"], d["l4t_support"], d["module_id"]["device_tree"]) == (
        "agx-orin-32gb",
        "supported",
        "p3701-0000",
    )


def test_detect_x86_runs_no_jetson_tool(tmp_path: Path) -> None:
    board, runner = x86_machine(tmp_path)
    p = detect(board.root, runner)
    assert not p.is_jetson and not p.unified_memory and not p.nvidia_gpu
    assert (p.module, p.l4t, p.power_mode, p.clocks, p.cuda_arch) == (None,) * 5
    assert p.numa_nodes == 1 and p.zram_devices == ()
    assert runner.calls == []
    assert p.describe() == "not a Jetson"
    assert not is_jetson(board.root)


def test_discrete_gpu_asks_nvidia_smi(tmp_path: Path) -> None:
    board, runner = x86_machine(tmp_path)
    board.write("/proc/driver/nvidia/version", "NVRM version: 550.54\n")
    from orin.system.commands import CommandResult

    query = ("nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader")
    runner.answers[query] = CommandResult(query, 0, "8.9\n")
    p = detect(board.root, runner)
    assert p.nvidia_gpu and p.cuda_arch == "8.9" and not p.unified_memory


def test_clocks_without_root_fall_back_to_gpu_devfreq(tmp_path: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path)
    fake.fail[("jetson_clocks", "--show")] = "jetson_clocks: must be run as root"
    p = detect(fake.board.root, fake.runner)
    assert p.clocks is not None
    assert p.clocks.source.startswith("sysfs") and p.clocks.unlocked == ("GPU",)


def test_numa_nodes_counted(board: FakeBoard) -> None:
    assert numa_node_count(board.root) == 1  # no node folder: a kernel without NUMA
    board.write("/sys/devices/system/node/node0/cpulist", "0-7")
    board.write("/sys/devices/system/node/node1/cpulist", "8-15")
    board.write("/sys/devices/system/node/online", "0-1")
    assert numa_node_count(board.root) == 2


def test_missing_sources_are_none_not_errors(board: FakeBoard) -> None:
    from tests.fakes.runner import FakeRunner

    board.write("/etc/nv_tegra_release", R36_LINE)
    p = detect(board.root, FakeRunner())
    assert p.is_jetson and p.memory is None and p.power_mode is None and p.clocks is None
    assert p.thermal == () and p.swaps == ()


@pytest.mark.parametrize(
    ("modes", "fastest"),
    [
        ({0: "MAXN", 1: "MODE_15W", 2: "MODE_30W", 3: "MODE_50W"}, 0),  # AGX Orin 64GB
        ({0: "MAXN_SUPER", 1: "10W", 2: "15W", 3: "25W", 4: "40W"}, 0),  # Orin NX, JP 6.2
        ({0: "15W", 1: "7W"}, 0),  # Orin Nano 8GB before JetPack 6.2: no MAXN
        ({0: "15W", 1: "25W", 2: "MAXN_SUPER", 3: "7W"}, 2),  # Orin Nano 8GB, JP 6.2
        ({0: "10W", 1: "7W_AI", 2: "7W_CPU"}, 0),  # Orin Nano 4GB
        ({3: "QUIET", 5: "LOUD"}, None),
        ({}, None),
    ],
)
def test_fastest_power_mode(modes: dict[int, str], fastest: int | None) -> None:
    assert fastest_power_mode(modes) == fastest


def test_detect_an_orin_nano_with_jetpack_62_super_modes(tmp_path: Path) -> None:
    fake = orin_nano_8gb_jp6(tmp_path, super_modes=True, mode=1)
    p = detect(fake.board.root, fake.runner)
    assert p.module == "p3767-0005" and p.module_name == "Jetson Orin Nano 8GB (developer kit)"
    assert p.power_mode is not None and p.power_mode.name == "25W"
    assert p.fastest_power_mode == 2 and p.to_dict()["fastest_power_mode"] == 2
    assert p.board is None  # no profile board value for an Orin Nano
