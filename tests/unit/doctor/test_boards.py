"""doctor on the three fake boards: every finding's severity and the exit code."""

from __future__ import annotations

import time
from pathlib import Path

from orin.doctor.checks import CHECK_IDS
from orin.doctor.runner import Report, run_checks
from orin.profile.loader import load_profile
from tests.fakeboards_system import (
    CPU_BUILD,
    agx_orin_32gb_jp5_tuned,
    agx_orin_64gb_jp6,
    x86_machine,
)
from tests.unit.doctor.conftest import MakeCtx


def severities(report: Report) -> dict[str, str]:
    return {f.id: f.severity for f in report.findings}


def test_every_check_runs_once_in_order(tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    report = run_checks(make_ctx(fake.board.root, fake.runner, model=llama2_q4))
    assert tuple(f.id for f in report.findings) == CHECK_IDS
    assert len(CHECK_IDS) == 15


def test_stock_jetpack6_board(tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path) -> None:
    fake = agx_orin_64gb_jp6(tmp_path / "board")
    profile = load_profile("llama2-7b-q4_k_m")
    report = run_checks(make_ctx(fake.board.root, fake.runner, profile, llama2_q4))
    assert severities(report) == {
        "model-file": "ok",
        "llama-build": "ok",
        "kv-type": "ok",
        "memory-fit": "ok",
        "context": "ok",
        "mmap": "ok",
        "swappiness": "warn",
        "zram": "warn",
        "numa": "ok",
        "power-mode": "warn",
        "clocks": "warn",
        "thermal": "ok",
        "jtop": "warn",
        "disk": "ok",
        "port": "ok",
    }
    assert report.exit_code == 0
    found = report.by_id()
    assert found["power-mode"].fix == (
        "sudo orin-llm tune system --profile llama2-7b-q4_k_m --apply "
        "(or at once: sudo nvpmodel -m 0)"
    )
    assert found["swappiness"].found == "vm.swappiness = 60 on unified memory"
    assert "system.swappiness: 10 in the profile" not in found["swappiness"].fix
    assert "system.disable_zram: true in the profile" in found["zram"].fix
    assert found["clocks"].found == "clocks not locked: CPU, GPU, EMC (jetson_clocks --show)"
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
    assert {i: s for i, s in severities(report).items() if s != "ok"} == {}
    assert report.exit_code == 0
    assert report.by_id()["power-mode"].found == "power mode MAXN (0)"
    assert report.by_id()["zram"].found == "no zram swap; /swapfile (file)"


def test_plain_x86_machine(tmp_path: Path, make_ctx: MakeCtx, llama2_q4: Path) -> None:
    board, runner = x86_machine(tmp_path / "board")
    report = run_checks(make_ctx(board.root, runner, model=llama2_q4, build=CPU_BUILD))
    assert {i: s for i, s in severities(report).items() if s != "ok"} == {
        "power-mode": "info",
        "clocks": "info",
        "jtop": "info",
    }
    found = report.by_id()
    assert found["llama-build"].found == "llama-cpp-python 0.3.36, CPU build (no NVIDIA GPU)"
    assert found["swappiness"].found == "vm.swappiness = 60 (no unified memory here)"
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
