"""tune system and doctor through typer's CliRunner on fake boards (--root)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from orin.cli.deps import Deps
from orin.doctor.checks import CHECKS
from orin.doctor.context import DoctorContext
from orin.doctor.findings import Finding
from orin.doctor.report import run_checks
from tests.fakes.boards_system import CPU_BUILD, CUDA_BUILD, FakeJetson, agx_orin_64gb_jp6

PROFILE = """\
name: board-test
model:
  quantization: Q4_K_M
system:
  swappiness: 10
  power_mode: 0
  lock_clocks: true
  disable_zram: true
"""


@pytest.fixture
def fake(tmp_path: Path) -> FakeJetson:
    return agx_orin_64gb_jp6(tmp_path / "board")


def board_deps(fake: FakeJetson) -> Deps:
    """Root on the fake board, a CUDA build, a free port and 100 GiB free."""
    return Deps(
        runner=fake.runner,
        effective_uid=lambda: 0,
        build_info=lambda: CUDA_BUILD,
        port_probe=lambda host, port: None,
        disk_free=lambda path: 100 * 2**30,
    )


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "board-test.yaml"
    path.write_text(PROFILE)
    return path


def invoke(fake: FakeJetson, *args: str, deps: Deps | None = None) -> tuple[int, str, str]:
    root = str(fake.board.base)
    result = CliRunner().invoke(
        app, [*args, "--root", root], env={"COLUMNS": "200"}, obj=deps or board_deps(fake)
    )
    return result.exit_code, result.stdout, result.stderr


def test_tune_system_prints_the_plan_and_changes_nothing(
    fake: FakeJetson, profile_file: Path
) -> None:
    code, out, err = invoke(fake, "tune", "system", "--profile", str(profile_file))
    assert code == 0, err
    assert "Jetson AGX Orin 64GB, L4T 36.4.0 (JetPack 6.1), MODE_30W" in out
    assert "nvpmodel -m 0" in out and "swapoff /dev/zram0" in out
    assert "4 change(s) planned (swappiness, zram, power-mode, clocks)" in out
    assert "tune system, profile board-test: plan only, nothing is changed" in out
    assert "apply plan" not in out and "making these changes" not in out
    assert fake.changes() == []


def test_tune_system_says_what_it_does_with_apply_and_revert(
    fake: FakeJetson, profile_file: Path
) -> None:
    code, out, err = invoke(fake, "tune", "system", "--profile", str(profile_file), "--apply")
    assert code == 0, err
    assert "tune system, profile board-test: making these changes" in out
    assert "plan only" not in out
    code, out, err = invoke(fake, "tune", "system", "--revert")
    assert code == 0, err
    assert "tune system, profile defaults: restoring the saved values" in out


def test_tune_system_apply_needs_root(fake: FakeJetson, profile_file: Path) -> None:
    user = dataclasses.replace(board_deps(fake), effective_uid=lambda: 1000)
    args = ("tune", "system", "--profile", str(profile_file), "--apply")
    code, _, err = invoke(fake, *args, deps=user)
    assert code == 1
    assert "needs root for: swappiness (echo 10 > /proc/sys/vm/swappiness)" in err
    assert fake.changes() == []


@pytest.mark.parametrize("writable", ["file", "folder"])
def test_tune_system_as_root_reads_no_profile_another_user_can_write(
    fake: FakeJetson, tmp_path: Path, writable: str
) -> None:
    """The tuning unit runs `tune system --apply --profile FILE` as root at every boot:
    a profile anyone could write was read, and its settings became root's changes."""
    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "board-test.yaml"
    path.write_text(PROFILE)
    (path if writable == "file" else folder).chmod(0o666 if writable == "file" else 0o777)
    code, out, err = invoke(fake, "tune", "system", "--profile", str(path), "--apply")
    assert code == 4, err
    where = path if writable == "file" else folder
    assert f"not reading the profile {path} as root: {where} is writable by group or" in err
    assert "sudo install -m 0644 -o root -g root" in err
    assert fake.changes() == [] and out == ""
    # a user may plan from it: only root's run refuses it
    user = dataclasses.replace(board_deps(fake), effective_uid=lambda: 1000)
    code, out, err = invoke(fake, "tune", "system", "--profile", str(path), deps=user)
    assert code == 0 and "plan only" in out, err
    # a profile that only its owner can write is read, in a sticky folder too
    path.chmod(0o644)
    folder.chmod(0o1777)
    code, out, err = invoke(fake, "tune", "system", "--profile", str(path), "--apply")
    assert code == 0 and "making these changes" in out, err


def test_tune_system_apply_then_revert_json(fake: FakeJetson, profile_file: Path) -> None:
    code, out, err = invoke(
        fake, "tune", "system", "--profile", str(profile_file), "--apply", "--json"
    )
    assert code == 0, err
    data = json.loads(out)
    assert data["done"] == ["swappiness", "zram", "power-mode", "clocks"]
    assert data["platform"]["module"] == "p3701-0005"
    assert (fake.mode, fake.locked, fake.zram) == (0, True, {})
    code, out, _ = invoke(fake, "tune", "system", "--profile", str(profile_file), "--apply")
    assert code == 0 and "nothing to change" in out
    code, out, err = invoke(fake, "tune", "system", "--revert")
    assert code == 0, err
    assert "restored: clocks, power-mode, zram, swappiness" in out
    assert (fake.mode, fake.locked, sorted(fake.zram)) == (2, False, ["/dev/zram0", "/dev/zram1"])


def test_tune_system_reports_the_load_mode_the_engine_will_use(fake: FakeJetson) -> None:
    """As doctor's mmap check and the engine do, tune system asks the build: a CPU build
    on a Jetson maps the file (nothing is offloaded, so there is no second copy)."""

    def mmap_target(build_deps: Deps) -> str:
        code, out, err = invoke(fake, "tune", "system", "--json", deps=build_deps)
        assert code == 0, err
        (row,) = [c for c in json.loads(out)["changes"] if c["setting"] == "mmap"]
        return str(row["target"])

    cuda = board_deps(fake)
    assert mmap_target(cuda) == "load_mode=none"
    assert mmap_target(dataclasses.replace(cuda, build_info=lambda: CPU_BUILD)) == (
        "load_mode=mmap"
    )


def test_tune_system_revert_with_nothing_saved_says_so(fake: FakeJetson) -> None:
    """Not an empty table: one line naming the state file, then the summary."""
    code, out, err = invoke(fake, "tune", "system", "--revert")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].startswith("tune system, profile defaults: nothing saved in ")
    assert lines[1].endswith("/var/lib/orin-llm-root/state.json")
    assert lines[2:] == ["nothing to revert"]
    assert fake.changes() == []


def test_tune_system_reports_the_failed_step(fake: FakeJetson, profile_file: Path) -> None:
    fake.fail[("nvpmodel", "-m", "0")] = "NVPM ERROR: failed to set power mode"
    code, _, err = invoke(fake, "tune", "system", "--profile", str(profile_file), "--apply")
    assert code == 1
    assert "power-mode failed at `nvpmodel -m 0`" in err
    assert "rolled back: zram, swappiness" in err
    assert fake.board.root.read_text("/proc/sys/vm/swappiness") == "60\n"


def test_apply_and_revert_together_is_a_usage_error(fake: FakeJetson) -> None:
    code, _, err = invoke(fake, "tune", "system", "--apply", "--revert")
    assert code == 2 and "not both" in err


def test_doctor_json_on_the_stock_board(
    fake: FakeJetson, profile_file: Path, tmp_path: Path
) -> None:
    from tests.ggufutil import LLAMA2_7B, write_gguf

    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    args = ("doctor", "--profile", str(profile_file), "--model", str(model), "--json")
    code, out, err = invoke(fake, *args)
    assert code == 0, err
    data = json.loads(out)
    assert data["exit_code"] == 0 and data["profile"] == "board-test"
    warned = [f["id"] for f in data["findings"] if f["severity"] == "warn"]
    assert warned == ["swappiness", "zram", "power-mode", "clocks", "jtop"]
    assert data["platform"]["jetpack"] == "6.1"


def test_following_doctors_fixes_clears_the_board_until_a_reboot(
    fake: FakeJetson, profile_file: Path
) -> None:
    """The board's findings, fixed by the tune system --apply they name, pass; after a
    reboot the clock lock is gone (jetson_clocks does not persist), and the clocks fix
    says what keeps it: the boot-time tuning unit orin-llm install adds."""
    board_ids = ["swappiness", "zram", "power-mode", "clocks"]

    def doctor() -> dict[str, dict[str, str]]:
        code, out, err = invoke(fake, "doctor", "--profile", str(profile_file), "--json")
        assert code in (0, 1), err
        return {f["id"]: f for f in json.loads(out)["findings"] if f["id"] in board_ids}

    before = doctor()
    assert {i: f["severity"] for i, f in before.items()} == dict.fromkeys(board_ids, "warn")
    command = f"sudo orin-llm tune system --profile {profile_file} --apply"
    assert all(f["fix"].startswith(command) for f in before.values())
    code, _, err = invoke(fake, "tune", "system", "--profile", str(profile_file), "--apply")
    assert code == 0, err
    assert {i: f["severity"] for i, f in doctor().items()} == dict.fromkeys(board_ids, "ok")

    fake.reboot()
    clocks = doctor()["clocks"]
    assert clocks["severity"] == "warn"
    assert clocks["fix"].endswith(
        "; the lock does not survive a reboot: sudo orin-llm install adds "
        "orin-llm-tune.service, which applies the profile's system settings at every boot"
    )
    fake.board.write("/etc/systemd/system/orin-llm-tune.service", "[Service]\n")
    assert "orin-llm install" not in doctor()["clocks"]["fix"]


def test_doctor_table_and_exit_1_on_a_cpu_build(fake: FakeJetson) -> None:
    cpu = dataclasses.replace(board_deps(fake), build_info=lambda: CPU_BUILD)
    code, out, _ = invoke(fake, "doctor", "--model", "/nonexistent/m.gguf", deps=cpu)
    assert code == 1
    assert "FAIL" in out and "CPU-only build on a Jetson" in out
    assert "no such file" in out


def test_doctor_cannot_run_on_a_missing_profile_exit_4(fake: FakeJetson) -> None:
    code, out, err = invoke(fake, "doctor", "--profile", "no-such-profile")
    assert code == 4 and out == ""  # the profile error's own code; 2 is for usage alone
    assert err.startswith("orin-llm: doctor could not run: no profile named 'no-such-profile'")


def test_a_crashed_check_is_an_internal_error_naming_the_check(fake: FakeJetson) -> None:
    def broken(ctx: DoctorContext) -> Finding:
        raise RuntimeError("boom")

    crashing = dataclasses.replace(
        board_deps(fake), run_doctor=lambda ctx: run_checks(ctx, [("broken-check", broken)])
    )
    code, out, err = invoke(fake, "doctor", "--model", "/nonexistent/m.gguf", deps=crashing)
    assert code == 70
    assert "broken-check" in out and "the check itself failed: RuntimeError: boom" in out
    assert "internal error in check(s) broken-check" in err
    code, out, _ = invoke(fake, "doctor", "--json", deps=crashing)
    data = json.loads(out)
    assert code == 70 and data["exit_code"] == 70 and data["crashed"] == ["broken-check"]


@pytest.mark.parametrize("command", [("doctor",), ("tune", "system")])
def test_a_root_that_is_not_a_folder_is_a_usage_error(
    fake: FakeJetson, tmp_path: Path, command: tuple[str, ...]
) -> None:
    """Not exit 70 from a check that crashed reading it."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for root in (tmp_path / "missing", a_file):
        result = CliRunner().invoke(
            app, [*command, "--root", str(root)], env={"COLUMNS": "200"}, obj=board_deps(fake)
        )
        assert result.exit_code == 2, result.output
        assert "--root" in result.stderr and result.stdout == ""


def test_doctor_ctx_is_per_slot_and_checked(fake: FakeJetson, profile_file: Path) -> None:
    args = ("doctor", "--profile", str(profile_file), "--ctx", "1024", "--json")
    code, out, err = invoke(fake, *args)
    assert code in (0, 1), err
    assert json.loads(out)["profile"] == "board-test"
    code, _, err = invoke(fake, "doctor", "--ctx", "100")
    assert code == 2 and "--ctx" in err  # below the option's minimum: a usage error


def test_doctor_table_keeps_check_ids_whole_at_80_columns(fake: FakeJetson) -> None:
    cpu = dataclasses.replace(board_deps(fake), build_info=lambda: CPU_BUILD)
    result = CliRunner().invoke(
        app,
        ["doctor", "--model", "/nonexistent/m.gguf", "--root", str(fake.board.base)],
        env={"COLUMNS": "80"},
        obj=cpu,
    )
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines)
    # too narrow for five columns: one finding after the other, ids and paths whole
    heads = [line.split() for line in lines if line[:4] in ("ok  ", "info", "WARN", "FAIL")]
    assert ["FAIL", "model-file"] in heads and ["WARN", "swappiness"] in heads
    assert len(heads) == len(CHECKS)
    assert "found: /nonexistent/m.gguf: no such file" in result.stdout


def test_tune_system_keeps_settings_and_commands_whole_at_80_columns(
    fake: FakeJetson, profile_file: Path
) -> None:
    result = CliRunner().invoke(
        app,
        ["tune", "system", "--profile", str(profile_file), "--root", str(fake.board.base)],
        env={"COLUMNS": "80"},
        obj=board_deps(fake),
    )
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines)
    for whole in ("nvpmodel -m 0", "swapoff /dev/zram0", "echo 10 > /proc/sys/vm/swappiness"):
        assert any(line.strip().endswith(whole) for line in lines), whole  # on one line
    # the steps do not fit beside four more columns: one setting after the other
    assert {"swappiness", "zram", "power-mode", "clocks"} <= {line.strip() for line in lines}
    assert "   target: 10" in out


def test_doctor_in_a_pipe_has_no_trailing_spaces(fake: FakeJetson) -> None:
    """The findings as labelled lines (below 100 columns) wrap their long values: no
    line of them ends in the spaces rich pads a grid's cells with."""
    cpu = dataclasses.replace(board_deps(fake), build_info=lambda: CPU_BUILD)
    for columns in ("80", "200"):
        result = CliRunner().invoke(
            app, ["doctor", "--root", str(fake.board.base)], env={"COLUMNS": columns}, obj=cpu
        )
        assert result.exit_code == 1, result.stderr
        lines = result.stdout.splitlines()
        assert len(lines) > len(CHECKS)
        assert [line for line in lines if line != line.rstrip()] == []


def test_tune_system_as_root_parses_no_model_another_user_could_write(
    fake: FakeJetson, tmp_path: Path
) -> None:
    """The tuning unit runs --apply as root at every boot; the model (given to the
    service user, here in a folder under the world-writable /tmp) is not parsed then,
    only the mmap report loses the layer count."""
    from tests.ggufutil import LLAMA2_7B, write_gguf

    model = write_gguf(tmp_path / "m.gguf", params=LLAMA2_7B, file_type=15)
    profile = tmp_path / "partial.yaml"
    profile.write_text(f"name: partial\nmodel: {{path: {model}}}\nengine: {{gpu_layers: 40}}\n")

    def mmap_row(deps: Deps) -> tuple[dict[str, str], str]:
        code, out, err = invoke(
            fake, "tune", "system", "--profile", str(profile), "--json", deps=deps
        )
        assert code == 0, err
        (row,) = [c for c in json.loads(out)["changes"] if c["setting"] == "mmap"]
        return row, err

    user, err = mmap_row(dataclasses.replace(board_deps(fake), effective_uid=lambda: 1000))
    assert user["target"] == "load_mode=none" and err == ""  # 40 > 32 layers: all offloaded
    root, err = mmap_row(board_deps(fake))
    assert root["target"] == "load_mode=mmap"  # without the count, 40 layers may be some
    note = " ".join(err.split())  # the reason names the first folder others could write
    assert note.startswith(f"not reading {model} as root (")
    assert note.endswith("): the mmap report goes without the model's layer count")


def test_tune_system_says_a_drop_caches_alone_saved_nothing(
    fake: FakeJetson, tmp_path: Path
) -> None:
    profile = tmp_path / "drop.yaml"
    profile.write_text("name: drop\nsystem: {swappiness: null, drop_caches: true}\n")
    code, out, err = invoke(fake, "tune", "system", "--profile", str(profile), "--apply")
    assert code == 0, err
    assert out.splitlines()[-1] == "applied: drop-caches; nothing to restore, so nothing saved"
    assert not fake.board.root.exists("/var/lib/orin-llm-root/state.json")
