"""cpu-kernels: a build with llama.cpp's AMX kernels fails, with the rebuild as the fix.

The system-info lines are what llama_print_system_info prints for the CPU
backend of 0.3.36: the first from a -march=native build on a Sapphire Rapids
CPU, the second from scripts/install-llama-cpp.sh's build on the same CPU.
"""

from __future__ import annotations

from pathlib import Path

from orin.doctor import checks
from orin.errors import LlamaCppError
from tests.fakes.boards_system import x86_machine
from tests.unit.doctor.conftest import MakeCtx, cpu_build

NATIVE_SPR = (
    "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX_VNNI = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | "
    "BMI2 = 1 | AVX512 = 1 | AVX512_VBMI = 1 | AVX512_VNNI = 1 | AVX512_BF16 = 1 | "
    "AMX_INT8 = 1 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
)
FLAGGED_SPR = NATIVE_SPR.replace("AMX_INT8 = 1 | ", "")


def test_amx_build_fails_with_the_rebuild_as_fix(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    f = checks.check_cpu_kernels(make_ctx(board.root, runner, build=cpu_build(NATIVE_SPR)))
    assert f.severity == "fail"
    assert "AMX_INT8 = 1" in f.found
    assert "segmentation fault" in f.why
    assert f.fix.startswith("scripts/install-llama-cpp.sh --python ")


def test_build_without_amx_passes_and_names_its_kernels(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    f = checks.check_cpu_kernels(make_ctx(board.root, runner, build=cpu_build(FLAGGED_SPR)))
    assert f.severity == "ok"
    assert "AVX512_VNNI" in f.found and "AMX" not in f.found.replace("without AMX", "")
    assert "OPENMP" not in f.found


def test_unusable_build_is_left_to_llama_build(tmp_path: Path, make_ctx: MakeCtx) -> None:
    board, runner = x86_machine(tmp_path / "pc")
    ctx = make_ctx(board.root, runner, build=LlamaCppError("no module"))
    f = checks.check_cpu_kernels(ctx)
    assert f.severity == "info" and f.fix == "see llama-build"


def test_the_check_runs_right_after_llama_build() -> None:
    ids = list(checks.CHECK_IDS)
    assert ids.index("cpu-kernels") == ids.index("llama-build") + 1
