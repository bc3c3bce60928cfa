"""scripts/install-llama-cpp.sh picks the build from the board (dry runs on fake trees)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "install-llama-cpp.sh"


def run(root: Path, path_dirs: list[Path], *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.pathsep.join([*(str(d) for d in path_dirs), "/usr/bin", "/bin"]),
        "ORIN_LLM_SYSROOT": str(root),
        "HOME": str(root),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def fake_tool(bindir: Path, name: str, body: str = "exit 0") -> None:
    bindir.mkdir(parents=True, exist_ok=True)
    tool = bindir / name
    tool.write_text(f"#!/bin/sh\n{body}\n")
    tool.chmod(0o755)


@pytest.fixture
def empty_bin(tmp_path: Path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    return d


def test_jetson_gets_sm87_cuda_build_with_all_fa_quants(tmp_path: Path, empty_bin: Path) -> None:
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "etc/nv_tegra_release").write_text("# R36 (release), REVISION: 4.3, GCID: 1\n")
    fake_tool(root / "usr/local/cuda/bin", "nvcc")
    r = run(root, [empty_bin])
    assert r.returncode == 0, r.stderr
    assert "mode=jetson" in r.stdout
    assert f"CUDACXX={root}/usr/local/cuda/bin/nvcc" in r.stdout
    assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87 -DGGML_CUDA_FA_ALL_QUANTS=ON" in r.stdout
    assert "--no-cache-dir" in r.stdout  # never reuse a cached CPU wheel


def test_device_tree_alone_identifies_a_jetson(tmp_path: Path, empty_bin: Path) -> None:
    root = tmp_path / "root"
    (root / "proc/device-tree").mkdir(parents=True)
    (root / "proc/device-tree/compatible").write_bytes(b"nvidia,p3737-0000\0nvidia,tegra234\0")
    r = run(root, [empty_bin])
    assert "mode=jetson" in r.stdout


def test_nvcc_with_driver_gets_cuda_build(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    bindir = tmp_path / "bin"
    fake_tool(bindir, "nvcc")
    fake_tool(bindir, "nvidia-smi", 'case "$1" in -L) echo "GPU 0";; *) echo "9.0";; esac')
    r = run(root, [bindir])
    assert r.returncode == 0, r.stderr
    assert "mode=cuda" in r.stdout
    assert "-DCMAKE_CUDA_ARCHITECTURES=90" in r.stdout


def test_nvcc_without_a_gpu_stays_cpu(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    bindir = tmp_path / "bin"
    fake_tool(bindir, "nvcc")
    r = run(root, [bindir])
    assert "mode=cpu" in r.stdout
    assert "CMAKE_ARGS" not in r.stdout


def test_forced_mode_and_bad_mode(tmp_path: Path, empty_bin: Path) -> None:
    assert "mode=cpu" in run(tmp_path, [empty_bin], "--mode", "cpu").stdout
    bad = run(tmp_path, [empty_bin], "--mode", "rocm")
    assert bad.returncode == 2
    assert "unknown mode 'rocm'" in bad.stderr
