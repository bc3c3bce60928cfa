"""systemd's own checks on the RPC worker's unit, as for the server's: `verify` passes
without a warning and `security` rates its exposure at most 3.0 (OK)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from orin.install.units import (
    DEFAULT_GPU_DEVICES,
    RPC_WORKER_SERVICE,
    RpcWorkerUnit,
    render_rpc_worker_unit,
)
from tests.unit.install.conftest import EXECUTABLE
from tests.unit.install.test_systemd_analyze import ANALYZE, EXPOSURE, SYSTEM_UNITS, analyze

pytestmark = pytest.mark.skipif(
    ANALYZE is None or SYSTEM_UNITS is None,
    reason="systemd-analyze not found: install Debian's systemd package (apt-get install systemd)",
)


def unit_root(tmp_path: Path) -> Path:
    text = render_rpc_worker_unit(
        RpcWorkerUnit(
            executable=EXECUTABLE,
            user="orin-llm",
            groups=("video", "render"),
            host="10.0.0.2",
            port=50052,
            devices=DEFAULT_GPU_DEVICES,
            cache=True,
            allow=("10.0.0.1",),
        )
    )
    root = tmp_path / "sysroot"
    assert SYSTEM_UNITS is not None
    shutil.copytree(SYSTEM_UNITS, root / "usr/lib/systemd/system", symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    (root / "etc/systemd/system" / RPC_WORKER_SERVICE).write_text(text)
    exe = root / EXECUTABLE.lstrip("/")
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return root


def test_verify_passes_without_a_warning(tmp_path: Path) -> None:
    r = analyze("verify", f"--root={unit_root(tmp_path)}", RPC_WORKER_SERVICE)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_security_exposure_is_at_most_3(tmp_path: Path) -> None:
    if "--offline" not in analyze("security", "--help").stdout:
        pytest.skip("this systemd-analyze has no --offline (systemd < 250)")
    root = unit_root(tmp_path)
    r = analyze("security", f"--root={root}", "--offline=true", "--no-pager", RPC_WORKER_SERVICE)
    match = EXPOSURE.search(r.stdout)
    assert match, r.stdout + r.stderr
    print(f"systemd-analyze security {RPC_WORKER_SERVICE}: {match.group(1)} {match.group(2)}")
    assert float(match.group(1)) <= 3.0 and match.group(2) == "OK", r.stdout
