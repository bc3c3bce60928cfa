"""scripts/setup-orin.sh --dry-run on fake boards: the printed plan, and that it is idempotent."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

SRC = Path(__file__).resolve().parents[3]
SCRIPT = SRC / "scripts" / "setup-orin.sh"
VERSION = re.search(r'^version = "(.*)"', (SRC / "pyproject.toml").read_text(), re.M)
JP6_RELEASE = "# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64\n"


def tool(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def run(root: Path, bindir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.pathsep.join([str(bindir), "/usr/bin", "/bin"]),
        "ORIN_LLM_SYSROOT": str(root),
        "HOME": str(root),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, check=False
    )


def jetson(tmp_path: Path, missing: str = "") -> tuple[Path, Path]:
    """A JetPack 6 root and a PATH whose dpkg-query reports ``missing`` as not installed."""
    root, bindir = tmp_path / "root", tmp_path / "bin"
    (root / "etc").mkdir(parents=True)
    (root / "etc/nv_tegra_release").write_text(JP6_RELEASE)
    tool(
        bindir / "dpkg-query",
        f'case " {missing} " in *" $3 "*) exit 1;; esac\necho -n "install ok installed"',
    )
    return root, bindir


def files_under(root: Path) -> list[Path]:
    return sorted(root.rglob("*"))


def test_fresh_board_plan(tmp_path: Path) -> None:
    root, bindir = jetson(tmp_path, missing="cmake git")
    before = files_under(root)
    r = run(root, bindir, "--dry-run", "--profile", "llama3.1-8b-q4_k_m", "--port", "9000")
    assert r.returncode == 0, r.stderr
    out, venv = r.stdout, root / "opt/orin-llm/venv"
    assert "board: Jetson, L4T 36.4.3 (JetPack 6)" in out
    assert "would run: apt-get update" in out
    assert (
        "would run: env DEBIAN_FRONTEND=noninteractive apt-get install -y "
        "--no-install-recommends cmake git nvidia-cuda-dev"
    ) in out
    assert f"would run: python3 -m venv {venv}" in out
    assert "install-llama-cpp: mode=jetson" in out
    assert "-DCMAKE_CUDA_ARCHITECTURES=87" in out
    assert f"would run: {venv}/bin/python -m pip install -q {SRC}" in out
    assert f"would run: {venv}/bin/orin-llm doctor --profile llama3.1-8b-q4_k_m" in out
    assert (
        f"would run: {venv}/bin/orin-llm install --profile llama3.1-8b-q4_k_m --port 9000"
    ) in out
    assert out.rstrip().endswith("dry run: nothing was changed")
    assert files_under(root) == before
    steps = [line for line in out.splitlines() if re.match(r"setup-orin: \[\d/6\]", line)]
    assert len(steps) == 6


def test_a_set_up_board_plans_only_doctor_and_install(tmp_path: Path) -> None:
    root, bindir = jetson(tmp_path)
    tool(root / "usr/local/cuda/bin/nvcc", "exit 0")
    venv = root / "opt/orin-llm/venv"
    tool(venv / "bin/python", "cat >/dev/null; exit 0")  # llama_cpp imports, GPU offload on
    assert VERSION is not None
    tool(venv / "bin/orin-llm", f'echo "orin-llm {VERSION.group(1)}"')
    r = run(root, bindir, "--dry-run", "--profile", "llama3.1-8b-q4_k_m")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "ok: python3-venv python3-dev python3-pip build-essential cmake git installed" in out
    assert "ok: exists" in out
    assert "ok: installed with GPU offload" in out
    assert f"ok: orin-llm {VERSION.group(1)} installed" in out
    would = [line for line in out.splitlines() if "would run:" in line]
    assert [w.split("would run: ")[1].split()[1] for w in would] == ["doctor", "install"]


def test_demo_profile_generates_the_demo_model_first(tmp_path: Path) -> None:
    root, bindir = jetson(tmp_path)
    out = run(root, bindir, "--dry-run").stdout
    assert "orin-llm model demo --size small --quant q4_k_m" in out
    assert "orin-llm install --profile demo" in out


def test_a_hub_profile_pulls_its_model_before_doctor(tmp_path: Path) -> None:
    root, bindir = jetson(tmp_path)
    profile = tmp_path / "hub.yaml"
    profile.write_text(
        "name: hub\nmodel:\n  hf: 'owner/repo:model-Q4_K_M.gguf'  # pulled by setup\n"
    )
    out = run(root, bindir, "--dry-run", "--profile", str(profile)).stdout
    would = [line.split("would run: ")[1] for line in out.splitlines() if "would run:" in line]
    pull = next(i for i, w in enumerate(would) if " model pull " in w)
    assert would[pull].endswith("orin-llm model pull owner/repo:model-Q4_K_M.gguf")
    assert " doctor " in would[pull + 1]


def test_a_profile_without_a_hub_model_pulls_nothing(tmp_path: Path) -> None:
    root, bindir = jetson(tmp_path)
    out = run(root, bindir, "--dry-run", "--profile", "llama3.1-8b-q4_k_m").stdout
    assert "model pull" not in out


def test_not_a_jetson_warns_and_plans_a_cpu_build(tmp_path: Path) -> None:
    root, bindir = tmp_path / "root", tmp_path / "bin"
    root.mkdir()
    tool(bindir / "dpkg-query", 'echo -n "install ok installed"')
    r = run(root, bindir, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "WARNING: no" in r.stdout and "not a Jetson" in r.stdout
    assert "install-llama-cpp: mode=cpu" in r.stdout
    assert "nvidia-cuda-dev" not in r.stdout


def test_needs_root_without_dry_run_and_rejects_unknown_arguments(tmp_path: Path) -> None:
    root, bindir = jetson(tmp_path)
    tool(bindir / "id", "echo 1000")
    r = run(root, bindir)
    assert r.returncode == 2
    assert "run it with sudo" in r.stderr
    bad = run(root, bindir, "--dry-run", "--frobnicate")
    assert bad.returncode == 2 and "unknown argument: --frobnicate" in bad.stderr


def test_help_prints_the_header_comment_and_nothing_of_the_code(tmp_path: Path) -> None:
    root, bindir = jetson(tmp_path)
    r = run(root, bindir, "--help")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "# From a fresh JetPack 6 board to orin-llm serving as a systemd service."
    assert "# Usage: sudo scripts/setup-orin.sh [--profile P] [--prefix DIR] [--user NAME]" in lines
    assert lines[-1].startswith("# CUDA_PACKAGE")
    assert all(line.startswith("#") for line in lines), r.stdout  # not `set -euo pipefail`
