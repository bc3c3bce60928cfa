"""doctor on the three fake boards: every finding's severity and the exit code."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from orin.doctor import board as board_checks
from orin.doctor.checks import CHECK_IDS
from orin.doctor.report import Report, run_checks
from orin.profile.loader import load_profile
from tests.fakes.boards_system import (
    CPU_BUILD,
    R35_LINE,
    FakeJetson,
    agx_orin_32gb_devkit_tree_jp6,
    agx_orin_32gb_jp5_tuned,
    agx_orin_64gb_jp6,
    orin_nano_8gb_jp6,
    orin_nx_16gb_jp6,
    x86_machine,
)
from tests.unit.doctor.conftest import MakeCtx


def severities(report: Report, expected: dict[str, str]) -> dict[str, str]:
    """The findings of the checks ``expected`` names (each of which must exist)."""
    assert set(expected) <= set(CHECK_IDS)
    return {f.id: f.severity for f in report.findings if f.id in expected}


def not_ok(report: Report) -> dict[str, str]:
    return {f.id: f.severity for f in report.findings if f.severity != "ok"}


def test_every_check_runs_once_in_order(tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    report = run_checks(make_ctx(fake.board.root, fake.runner, model=llama2_q4))
    assert tuple(f.id for f in report.findings) == CHECK_IDS
    assert len(set(CHECK_IDS)) == len(CHECK_IDS)
    board_checks = ("numa", "board", "power-mode", "clocks")
    assert [i for i in CHECK_IDS if i in board_checks] == list(board_checks)


def test_stock_jetpack6_board(tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    profile = load_profile("llama2-7b-q4_k_m")
    report = run_checks(make_ctx(fake.board.root, fake.runner, profile, llama2_q4))
    expected = {
        "model-file": "ok",
        "llama-build": "ok",
        "kv-type": "ok",
        "memory-fit": "ok",
        "context": "ok",
        "mmap": "ok",
        "swappiness": "warn",
        "zram": "warn",
        "numa": "ok",
        "board": "ok",
        "power-mode": "warn",
        "clocks": "warn",
        "thermal": "ok",
        "jtop": "warn",
        "disk": "ok",
        "port": "ok",
    }
    assert severities(report, expected) == expected
    assert report.exit_code == 0
    found = report.by_id()
    assert found["power-mode"].fix == (
        "sudo orin-llm tune system --profile llama2-7b-q4_k_m --apply "
        "(or at once: sudo nvpmodel -m 0)"
    )
    assert found["swappiness"].found == "vm.swappiness = 60 on unified memory"
    assert "system.swappiness: 10 in" not in found["swappiness"].fix  # the profile asks
    # a built-in profile is not edited: the field goes into a copy, which tune system gets
    source = load_profile("llama2-7b-q4_k_m").source
    assert found["zram"].fix == (
        "system.disable_zram: true in a copy of the built-in profile "
        f"(cp {source} my-llama2-7b-q4_k_m.yaml), then sudo orin-llm tune system "
        "--profile my-llama2-7b-q4_k_m.yaml --apply (or at once: sudo systemctl disable "
        "nvzramconfig && sudo swapoff /dev/zram0 /dev/zram1); use an NVMe swap file if you "
        "want swap"
    )
    assert found["clocks"].found == "clocks not locked: CPU, GPU, EMC (jetson_clocks --show)"
    assert found["board"].found == (
        "Jetson AGX Orin 64GB (p3701-0005 from device tree), profile board agx-orin-64gb; "
        "L4T 36.4.0 (JetPack 6.1)"
    )
    assert found["mmap"].found.startswith("the engine loads with load_mode=none")
    assert fake.changes() == []  # doctor never changes the board


def test_cpu_only_build_on_a_jetson_fails(
    tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path
) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    report = run_checks(make_ctx(fake.board.root, fake.runner, model=llama2_q4, build=CPU_BUILD))
    f = report.by_id()["llama-build"]
    assert f.severity == "fail"
    assert f.found == "llama-cpp-python 0.3.36 is a CPU-only build on a Jetson"
    assert f.fix.startswith("scripts/install-llama-cpp.sh --mode jetson --python ")
    assert report.exit_code == 1
    # a CPU build offloads nothing, so mapping the file costs no second copy
    assert report.by_id()["mmap"].found.startswith("the engine loads with load_mode=mmap")


def test_tuned_jetpack5_board(tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path) -> None:
    fake = agx_orin_32gb_jp5_tuned(tmp_path / "board")
    profile = load_profile("llama2-7b-q4_k_m")
    report = run_checks(make_ctx(fake.board.root, fake.runner, profile, llama2_q4))
    assert not_ok(report) == {"board": "warn"}  # JetPack 5; the settings are all right
    assert report.exit_code == 0
    found = report.by_id()
    assert found["power-mode"].found == "power mode MAXN (0)"
    assert found["zram"].found == "no zram swap; /swapfile (file)"
    # the real jetson_clocks --show of a locked board: EMC min at 204 MHz, max == current
    assert found["clocks"].severity == "ok" and found["clocks"].found.startswith("clocks locked")
    assert found["board"].found == (
        "Jetson AGX Orin 32GB (p3701-0004 from device tree); the profile is for agx-orin-64gb; "
        "L4T 35.4.1 (JetPack 5.1.2)"
    )
    assert "Python 3.8" in found["board"].why
    assert "JetPack 6 (L4T R36)" in found["board"].fix


def test_plain_x86_machine(tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path) -> None:
    board, runner = x86_machine(tmp_path / "board")
    report = run_checks(make_ctx(board.root, runner, model=llama2_q4, build=CPU_BUILD))
    assert not_ok(report) == {
        "board": "info",
        "power-mode": "info",
        "clocks": "info",
        "jtop": "info",
    }
    found = report.by_id()
    assert found["llama-build"].found == "llama-cpp-python 0.3.36, CPU build (no NVIDIA GPU)"
    assert found["swappiness"].found == "vm.swappiness = 60 (no unified memory here)"
    # no iGPU load in sysfs here: telemetry falls back to the CPU, not to sysfs
    assert found["jtop"].found == "not a Jetson: jetson-stats does not apply"
    assert found["jtop"].fix == ""
    assert report.exit_code == 0
    assert runner.calls == []


def test_under_two_seconds_on_a_generated_model(
    tmp_path: Path, make_ctx: MakeCtx, tiny_f16: Path
) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    start = time.perf_counter()
    report = run_checks(make_ctx(fake.board.root, fake.runner, model=tiny_f16))
    assert time.perf_counter() - start < 2.0
    assert report.by_id()["model-file"].severity == "ok"
    assert report.by_id()["memory-fit"].severity == "ok"


def test_32gb_module_with_the_devkit_device_tree(
    tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path
) -> None:
    """The device tree says p3701-0000 (the 64GB devkit's); memory says 32GB."""
    fake = agx_orin_32gb_devkit_tree_jp6(tmp_path / "board")
    report = run_checks(
        make_ctx(fake.board.root, fake.runner, load_profile("llama2-7b-q4_k_m"), llama2_q4)
    )
    f = report.by_id()["board"]
    assert f.severity == "warn"
    assert f.found == (
        "Jetson AGX Orin 32GB (p3701-0004 from memory size (30.0 GiB); the device tree names "
        "p3701-0000); the profile is for agx-orin-64gb; L4T 36.4.0 (JetPack 6.1)"
    )
    assert "see memory-fit" in f.why
    assert "board: agx-orin-32gb" in f.fix and "orin-llm profile list" in f.fix
    ok = run_checks(
        make_ctx(fake.board.root, fake.runner, load_profile("llama2-13b-q4_k_m-32gb"), llama2_q4)
    ).by_id()["board"]
    assert ok.severity == "ok" and ok.found.endswith(
        "profile board agx-orin-32gb; L4T 36.4.0 (JetPack 6.1)"
    )


def test_a_64gb_board_under_a_32gb_profile_is_only_noted(tmp_path: Path, make_ctx: MakeCtx) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    profile = load_profile("llama2-13b-q4_k_m-32gb")
    f = board_checks.check_board(make_ctx(fake.board.root, fake.runner, profile))
    assert f.severity == "info" and "the profile is for agx-orin-32gb" in f.found


@pytest.mark.parametrize(
    ("line", "severity", "found"),
    [
        (R35_LINE, "warn", "L4T 35.4.1 (JetPack 5.1.2)"),
        (
            "# R32 (release), REVISION: 7.4, GCID: 33514132, BOARD: t186ref, EABI: aarch64, "
            "DATE: Fri Jun  9 04:25:08 UTC 2023\n",
            "fail",
            "L4T 32.7.4 (JetPack 4.x)",
        ),
        (
            "# R38 (release), REVISION: 2.0, GCID: 41844464, BOARD: generic, EABI: aarch64, "
            "DATE: Fri Aug 22 00:55:42 UTC 2025\n",
            "info",
            "L4T 38.2.0 (JetPack 7.x), newer than JetPack 6",
        ),
    ],
)
def test_jetpack_release_other_than_6(
    tmp_path: Path, make_ctx: MakeCtx, line: str, severity: str, found: str
) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    fake.board.write("/etc/nv_tegra_release", line)
    f = board_checks.check_board(make_ctx(fake.board.root, fake.runner))
    assert f.severity == severity
    assert f.found.endswith("; " + found)
    if severity != "info":
        assert f.fix.startswith("flash JetPack 6 (L4T R36) with NVIDIA SDK Manager")


@pytest.mark.parametrize("line", ["", "# R36 (release)\n", "\x00\x00garbage"])
def test_a_release_file_without_a_release_is_not_called_missing(
    tmp_path: Path, make_ctx: MakeCtx, line: str
) -> None:
    """An empty or damaged /etc/nv_tegra_release is there: doctor says what it holds and
    how to write it again, not that there is no such file."""
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    fake.board.write("/etc/nv_tegra_release", line)
    f = board_checks.check_board(make_ctx(fake.board.root, fake.runner))
    assert f.severity == "warn"
    first = line.strip().splitlines()[0] if line.strip() else ""
    assert f.found.endswith(f"; /etc/nv_tegra_release names no L4T release ({first!r})")
    assert f.fix == "sudo apt install --reinstall nvidia-l4t-core (the package that writes it)"
    fake.board.root.path("/etc/nv_tegra_release").unlink()
    f = board_checks.check_board(make_ctx(fake.board.root, fake.runner))
    assert (f.severity, f.found.rpartition("; ")[2]) == ("info", "no /etc/nv_tegra_release")


def test_gpu_lock_alone_is_not_called_locked(tmp_path: Path, make_ctx: MakeCtx) -> None:
    """Without root only the GPU's devfreq is readable: CPU and EMC stay unknown."""
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    fake.fail[("jetson_clocks", "--show")] = "must be run as root"
    fake.board.write("/sys/class/devfreq/17000000.gpu/min_freq", "1300500000\n")
    f = board_checks.check_clocks(make_ctx(fake.board.root, fake.runner))
    assert f.severity == "info"
    assert f.found == "GPU clock locked; CPU and EMC unknown (sysfs devfreq (GPU only))"


def test_a_profile_file_gets_its_own_fix(
    tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path
) -> None:
    """A user's profile is edited in place and given to tune system by its path; what it
    asks for already needs only the apply."""
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    mine = tmp_path / "mine.yaml"
    mine.write_text("name: mine\nsystem: {swappiness: 10}\n")
    report = run_checks(make_ctx(fake.board.root, fake.runner, load_profile(mine), llama2_q4))
    found = report.by_id()
    assert found["swappiness"].fix == (
        f"sudo orin-llm tune system --profile {mine} --apply "
        "(or at once: sudo sysctl -w vm.swappiness=10)"
    )
    assert found["zram"].fix is not None and found["zram"].fix.startswith(
        "system.disable_zram: true in the profile, then sudo orin-llm tune system "
        f"--profile {mine} --apply"
    )


@pytest.mark.parametrize(
    ("super_modes", "mode", "found", "top"),
    [
        (True, 1, "power mode 25W (1), not MAXN_SUPER (2), this board's fastest", 2),
        (True, 0, "power mode 15W (0), not MAXN_SUPER (2), this board's fastest", 2),
        (True, 2, None, 2),
        (False, 0, None, 0),  # before JetPack 6.2 an Orin Nano's fastest mode is 15W
        (False, 1, "power mode 7W (1), not 15W (0), this board's fastest", 0),
    ],
)
def test_an_orin_nanos_fastest_mode_is_not_mode_0(
    tmp_path: Path, make_ctx: MakeCtx, super_modes: bool, mode: int, found: str | None, top: int
) -> None:
    """Mode 0 is 15W on an Orin Nano; with JetPack 6.2 MAXN_SUPER is mode 2, so 'mode 0
    is MAXN' would call 15W fine and tell a board in 25W to drop to 15W."""
    fake = orin_nano_8gb_jp6(tmp_path / "board", super_modes, mode)
    f = board_checks.check_power_mode(make_ctx(fake.board.root, fake.runner))
    if found is None:
        assert f.severity == "ok"
        return
    assert (f.severity, f.found) == ("warn", found)
    assert f.fix.startswith("system.power_mode: fastest in the profile, then sudo orin-llm tune")
    assert f.fix.endswith(f"(or at once: sudo nvpmodel -m {top})")


def test_an_orin_nx_with_super_modes_is_told_mode_0(tmp_path: Path, make_ctx: MakeCtx) -> None:
    fake = orin_nx_16gb_jp6(tmp_path / "board", super_modes=True)
    f = board_checks.check_power_mode(make_ctx(fake.board.root, fake.runner))
    assert f.found == "power mode 40W (4), not MAXN_SUPER (0), this board's fastest"
    assert f.fix.endswith("(or at once: sudo nvpmodel -m 0)")


def test_clocks_fix_without_jetson_clocks_installs_it_first(
    tmp_path: Path, make_ctx: MakeCtx
) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    del fake.runner.answers[("jetson_clocks",)]  # the GPU's devfreq is read instead
    f = board_checks.check_clocks(make_ctx(fake.board.root, fake.runner))
    assert (f.severity, f.found) == ("warn", "clocks not locked: GPU (sysfs devfreq (GPU only))")
    assert f.fix.startswith(
        "jetson_clocks is not installed: sudo apt install nvidia-l4t-tools, then "
    )
    stock = agx_orin_64gb_jp6(tmp_path / "stock")
    fix = board_checks.check_clocks(make_ctx(stock.board.root, stock.runner)).fix
    assert fix.startswith("system.lock_clocks: true in the profile, then sudo orin-llm tune")


def test_zram_that_returns_at_the_next_boot_is_found(tmp_path: Path, make_ctx: MakeCtx) -> None:
    """Swapped off by hand, but nvzramconfig still enabled: it sets zram up again at boot."""
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    fake.zram.clear()
    fake.write_swaps()
    f = board_checks.check_zram(make_ctx(fake.board.root, fake.runner))
    assert (f.severity, f.found) == (
        "warn",
        "no zram swap now (no swap), but nvzramconfig is enabled: it sets zram swap up again "
        "at the next boot",
    )
    assert f.fix.endswith("(or at once: sudo systemctl disable nvzramconfig)")
    fake.zram_service = "disabled"
    f = board_checks.check_zram(make_ctx(fake.board.root, fake.runner))
    assert (f.severity, f.found) == ("ok", "no zram swap; no swap")


def run_at_once(fake: FakeJetson, fix: str) -> None:
    """The fix's "at once" commands on the fake board, as a shell runs `a && b`: each
    only when the one before succeeded."""
    command = fix.split("(or at once: ", 1)[1].split(")", 1)[0]
    for step in command.split(" && "):
        argv = step.split()
        assert argv[0] == "sudo"
        program, *args = argv[1:]
        answers = [(program, a) for a in args] if program == "swapoff" else [(program, *args)]
        for a in answers:
            result = fake.runner.run(a)
            assert result.returncode == 0, f"{step}: {result.stderr}"


@pytest.mark.parametrize("service", ["enabled", "disabled", "not-found"])
def test_following_the_zram_fix_at_once_swaps_zram_off(
    tmp_path: Path, make_ctx: MakeCtx, service: str
) -> None:
    """zram set up by other means than nvzramconfig (or with it disabled since): the fix
    does not start with a systemctl disable that fails on a unit not installed and stops
    the swapoff after its `&&`."""
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    fake.zram_service = service
    f = board_checks.check_zram(make_ctx(fake.board.root, fake.runner))
    assert f.severity == "warn"
    assert ("systemctl disable" in f.fix) == (service == "enabled")
    run_at_once(fake, f.fix)
    after = board_checks.check_zram(make_ctx(fake.board.root, fake.runner))
    assert after.severity == "ok", after.found


def test_a_profile_whose_power_mode_would_lower_the_board_is_found(
    tmp_path: Path, make_ctx: MakeCtx
) -> None:
    """An Orin Nano in MAXN_SUPER under a profile written for an AGX Orin (power_mode: 0):
    the board is fine now, but tune system with that profile, which the other findings'
    fixes run, would put it at 15W."""
    fake = orin_nano_8gb_jp6(tmp_path / "board", super_modes=True, mode=2)
    mine = tmp_path / "agx.yaml"
    mine.write_text("name: agx\nsystem: {power_mode: 0}\n")
    f = board_checks.check_power_mode(make_ctx(fake.board.root, fake.runner, load_profile(mine)))
    assert (f.severity, f.found) == (
        "warn",
        "power mode MAXN_SUPER (2), this board's fastest; the profile's system.power_mode: 0 "
        "would switch it to 15W",
    )
    assert f.fix == (
        "system.power_mode: fastest in the profile, then sudo orin-llm tune system "
        f"--profile {mine} --apply"
    )
    for mode in ("2", "fastest"):
        mine.write_text(f"name: agx\nsystem: {{power_mode: {mode}}}\n")
        f = board_checks.check_power_mode(
            make_ctx(fake.board.root, fake.runner, load_profile(mine))
        )
        assert f.severity == "ok"


def test_a_profile_that_asks_for_the_fastest_mode_is_not_told_to(
    tmp_path: Path, make_ctx: MakeCtx
) -> None:
    """A board below its fastest mode under a profile with power_mode: fastest: the fix
    is tune system with that profile, nothing to add to it."""
    fake = orin_nano_8gb_jp6(tmp_path / "board", super_modes=True, mode=1)
    mine = tmp_path / "any.yaml"
    mine.write_text("name: any\nsystem: {power_mode: fastest}\n")
    f = board_checks.check_power_mode(make_ctx(fake.board.root, fake.runner, load_profile(mine)))
    assert f.severity == "warn"
    assert (
        f.fix
        == f"sudo orin-llm tune system --profile {mine} --apply (or at once: sudo nvpmodel -m 2)"
    )
