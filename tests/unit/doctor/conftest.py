from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from orin.doctor.context import DoctorContext
from orin.llamacpp import BuildInfo, parse_system_info
from orin.profile.schema import Profile
from orin.system.commands import CommandRunner
from orin.system.root import SysRoot
from tests.fakes.boards_system import CUDA_BUILD
from tests.ggufutil import LLAMA2_7B, write_gguf

MakeCtx = Callable[..., DoctorContext]


def cpu_build(text: str) -> BuildInfo:
    """A CPU-only build whose system info is ``text``."""
    return BuildInfo("0.3.36", False, text, parse_system_info(text))


@pytest.fixture
def llama2_q4(tmp_path: Path) -> Path:
    """Llama-2-7B's shape, Q4_K_M file type, metadata only (no weights)."""
    return write_gguf(tmp_path / "llama2-7b.Q4_K_M.gguf", params=LLAMA2_7B, file_type=15)


@pytest.fixture
def make_ctx() -> MakeCtx:
    def make(
        root: SysRoot,
        runner: CommandRunner,
        profile: Profile | None = None,
        model: Path | None = None,
        build: BuildInfo | Exception = CUDA_BUILD,
        port: str | None = None,
        free: int = 100 * 2**30,
        environ: dict[str, str] | None = None,
        **engine: Any,
    ) -> DoctorContext:
        def build_info() -> BuildInfo:
            if isinstance(build, Exception):
                raise build
            return build

        p = profile or Profile(name="t", engine=engine, model={"quantization": "Q4_K_M"})
        return DoctorContext(
            root,
            runner,
            p,
            model,
            "--model" if model else "the profile names no model",
            build_info=build_info,
            port_probe=lambda host, n: port,
            disk_free=lambda path: free,
            environ=environ or {},
        )

    return make
