"""openmp-wait: OMP_WAIT_POLICY=PASSIVE beside an OpenMP build of llama.cpp's CPU backend.

The build's system-info line is what llama_print_system_info prints for the CPU
backend of 0.3.36 built by scripts/install-llama-cpp.sh on an AMD Zen 3 CPU.
"""

from __future__ import annotations

from pathlib import Path

from orin.doctor import checks
from orin.errors import LlamaCppError
from tests.fakes.boards_system import x86_machine
from tests.unit.doctor.conftest import MakeCtx, cpu_build

OPENMP = "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
OPENMP += "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
NO_OPENMP = OPENMP.replace("OPENMP = 1 | ", "")


def service_env(root: Path, text: str) -> None:
    path = root / "etc/orin-llm/orin-llm.env"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_passive_in_the_shell_warns_and_says_where(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    ctx = make_ctx(
        board.root, runner, build=cpu_build(OPENMP), environ={"OMP_WAIT_POLICY": "passive"}
    )
    f = checks.check_openmp_wait(ctx)
    assert f.severity == "warn"
    assert f.found == "OMP_WAIT_POLICY=PASSIVE in this shell's environment"
    assert "barrier" in f.why
    assert f.fix.startswith("remove OMP_WAIT_POLICY from this shell's environment")


def test_passive_in_the_service_environment_file_warns(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    service_env(board.root.base, "# tuned\nORIN_LLM_HOST=0.0.0.0\nOMP_WAIT_POLICY='PASSIVE'\n")
    f = checks.check_openmp_wait(make_ctx(board.root, runner, build=cpu_build(OPENMP)))
    assert f.severity == "warn"
    assert f.found == "OMP_WAIT_POLICY=PASSIVE in /etc/orin-llm/orin-llm.env"


def test_a_service_file_others_can_write_is_not_read(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    service_env(board.root.base, "OMP_WAIT_POLICY=PASSIVE\n")
    (board.root.base / "etc/orin-llm/orin-llm.env").chmod(0o666)
    f = checks.check_openmp_wait(make_ctx(board.root, runner, build=cpu_build(OPENMP)))
    # not an ok: systemd gives the service what the file says, whoever wrote it
    assert (f.severity, f.found) == (
        "warn",
        "/etc/orin-llm/orin-llm.env, the service's environment, not read: "
        "/etc/orin-llm/orin-llm.env is writable by group or others (mode 0666)",
    )
    assert f.fix.startswith(
        "sudo chown root /etc/orin-llm /etc/orin-llm/orin-llm.env && "
        "sudo chmod go-w /etc/orin-llm && sudo chmod g-w,o-rwx /etc/orin-llm/orin-llm.env "
    )
    (board.root.base / "etc/orin-llm/orin-llm.env").chmod(0o640)  # what the fix leaves
    f = checks.check_openmp_wait(make_ctx(board.root, runner, build=cpu_build(OPENMP)))
    passive = "OMP_WAIT_POLICY=PASSIVE in /etc/orin-llm/orin-llm.env"
    assert (f.severity, f.found) == ("warn", passive)


def test_a_service_folder_others_can_write_is_named_in_the_same_fix(
    tmp_path: Path, make_ctx: MakeCtx
) -> None:
    """The file's own owner and mode do not help when the folder above it is what
    others can write (they could replace the file): the fix covers the folder too."""
    board, runner = x86_machine(tmp_path / "pc")
    service_env(board.root.base, "OMP_WAIT_POLICY=ACTIVE\n")
    (board.root.base / "etc/orin-llm").chmod(0o777)
    f = checks.check_openmp_wait(make_ctx(board.root, runner, build=cpu_build(OPENMP)))
    assert f.severity == "warn" and "/etc/orin-llm is writable by group or others" in f.found
    assert "sudo chmod go-w /etc/orin-llm " in f.fix
    (board.root.base / "etc/orin-llm").chmod(0o755)  # what the fix leaves
    f = checks.check_openmp_wait(make_ctx(board.root, runner, build=cpu_build(OPENMP)))
    assert f.severity == "ok"


def test_the_file_s_last_assignment_counts(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    service_env(board.root.base, "OMP_WAIT_POLICY=PASSIVE\nOMP_WAIT_POLICY=ACTIVE\n")
    f = checks.check_openmp_wait(make_ctx(board.root, runner, build=cpu_build(OPENMP)))
    assert f.severity == "ok"


def test_active_unset_or_commented_out_is_ok(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    service_env(board.root.base, "#OMP_WAIT_POLICY=PASSIVE\n")
    for environ in ({}, {"OMP_WAIT_POLICY": "ACTIVE"}):
        ctx = make_ctx(board.root, runner, build=cpu_build(OPENMP), environ=environ)
        assert checks.check_openmp_wait(ctx).severity == "ok", environ


def test_a_build_without_openmp_is_ok_whatever_the_policy(
    tmp_path: Path, make_ctx: MakeCtx
) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    ctx = make_ctx(
        board.root, runner, build=cpu_build(NO_OPENMP), environ={"OMP_WAIT_POLICY": "PASSIVE"}
    )
    f = checks.check_openmp_wait(ctx)
    assert f.severity == "ok"
    assert "not OpenMP" in f.found


def test_no_usable_build_is_skipped(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    ctx = make_ctx(board.root, runner, build=LlamaCppError("no llama_cpp"))
    f = checks.check_openmp_wait(ctx)
    assert f.severity == "info"
    assert f.found.startswith("skipped")
