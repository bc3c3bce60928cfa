"""scripts/install-llama-cpp.sh picks the build from the board and the CPU (dry runs on
fake trees), and fails the install when the build crashes (a fake interpreter)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "install-llama-cpp.sh"


# /proc/cpuinfo flags of real CPUs (one "flags" line each, trimmed to what matters)
EPYC_ZEN3 = (
    "fpu vme sse sse2 ht syscall nx mmxext fxsr_opt pdpe1gb rdtscp lm constant_tsc rep_good "
    "nopl xtopology nonstop_tsc cpuid extd_apicid pni pclmulqdq ssse3 fma cx16 sse4_1 sse4_2 "
    "x2apic movbe popcnt aes xsave avx f16c rdrand hypervisor lahf_lm cmp_legacy svm cr8_legacy "
    "abm sse4a misalignsse 3dnowprefetch osvw topoext perfctr_core ssbd ibrs ibpb stibp vmmcall "
    "fsgsbase bmi1 avx2 smep bmi2 erms invpcid rdseed adx smap clflushopt clwb sha_ni xsaveopt "
    "xsavec xgetbv1 xsaves clzero xsaveerptr wbnoinvd arat npt nrip_save umip pku ospke vaes "
    "vpclmulqdq rdpid fsrm"
)
SAPPHIRE_RAPIDS = (
    "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr "
    "sse sse2 ss ht syscall nx pdpe1gb rdtscp lm constant_tsc rep_good nopl xtopology cpuid "
    "tsc_known_freq pni pclmulqdq ssse3 fma cx16 pcid sse4_1 sse4_2 x2apic movbe popcnt aes "
    "xsave avx f16c rdrand hypervisor lahf_lm abm 3dnowprefetch ssbd ibrs ibpb stibp "
    "ibrs_enhanced fsgsbase tsc_adjust bmi1 avx2 smep bmi2 erms invpcid avx512f avx512dq rdseed "
    "adx smap avx512ifma clflushopt clwb avx512cd sha_ni avx512bw avx512vl xsaveopt xsavec "
    "xgetbv1 xsaves avx_vnni avx512_bf16 wbnoinvd arat avx512vbmi umip pku ospke waitpkg "
    "avx512_vbmi2 gfni vaes vpclmulqdq avx512_vnni avx512_bitalg tme avx512_vpopcntdq rdpid "
    "cldemote movdiri movdir64b md_clear serialize tsxldtrk amx_bf16 avx512_fp16 amx_tile "
    "amx_int8 flush_l1d arch_capabilities"
)


def cpuinfo(root: Path, flags: str) -> None:
    (root / "proc").mkdir(parents=True, exist_ok=True)
    (root / "proc/cpuinfo").write_text(
        f"processor\t: 0\nvendor_id\t: x\nflags\t\t: {flags}\n\nprocessor\t: 1\n"
        f"flags\t\t: {flags}\n"
    )


def run(
    root: Path, path_dirs: list[Path], *args: str, arch: str = "x86_64", dry: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.pathsep.join([*(str(d) for d in path_dirs), "/usr/bin", "/bin"]),
        "ORIN_LLM_SYSROOT": str(root),
        "ORIN_LLM_ARCH": arch,
        "HOME": str(root),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *(["--dry-run"] if dry else []), *args],
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
    assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=87 -DGGML_CUDA_FA_QUANTS=all" in r.stdout
    # the Orin's Cortex-A78AE, not -march=native; the deprecated option is gone
    assert "-DGGML_NATIVE=OFF -DGGML_CPU_ARM_ARCH=armv8.2-a+dotprod+fp16" in r.stdout
    assert "arch=aarch64" in r.stdout
    assert "FA_ALL_QUANTS" not in r.stdout
    assert "--no-cache-dir" in r.stdout  # pip's cache keys sdist builds by URL alone


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
    cpuinfo(root, SAPPHIRE_RAPIDS)
    r = run(root, [bindir])
    assert r.returncode == 0, r.stderr
    assert "mode=cuda" in r.stdout
    assert "-DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_CUDA_FA_QUANTS=all -DGGML_NATIVE=ON" in r.stdout
    assert cflags(r.stdout) == NO_AMX  # the host side of a GPU build too


def test_nvcc_without_a_gpu_stays_cpu(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    bindir = tmp_path / "bin"
    fake_tool(bindir, "nvcc")
    r = run(root, [bindir])
    assert "mode=cpu" in r.stdout
    assert "GGML_CUDA" not in r.stdout


def test_forced_mode_and_bad_mode(tmp_path: Path, empty_bin: Path) -> None:
    assert "mode=cpu" in run(tmp_path, [empty_bin], "--mode", "cpu").stdout
    bad = run(tmp_path, [empty_bin], "--mode", "rocm")
    assert bad.returncode == 2
    assert "unknown mode 'rocm'" in bad.stderr


def cmake_options(stdout: str) -> dict[str, str]:
    line = next(ln for ln in stdout.splitlines() if "CMAKE_ARGS=" in ln)
    opts = line.split("CMAKE_ARGS=", 1)[1].split()
    return dict(o.removeprefix("-D").split("=", 1) for o in opts)


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cflags(stdout: str) -> str:
    return next(ln for ln in stdout.splitlines() if "CFLAGS=" in ln).split("CFLAGS=", 1)[1]


def test_x86_builds_for_this_cpu_with_amx_switched_off(tmp_path: Path, empty_bin: Path) -> None:
    cpuinfo(tmp_path, SAPPHIRE_RAPIDS)
    out = run(tmp_path, [empty_bin]).stdout
    assert cmake_options(out) == {"GGML_NATIVE": "ON", "GGML_RPC": "ON"}
    assert cflags(out) == NO_AMX


def test_the_compiler_lets_the_explicit_no_amx_win_over_march(
    tmp_path: Path, empty_bin: Path
) -> None:
    # what the build relies on: with the script's flags, -march of a CPU with AMX
    # (in either order) keeps AVX-512 VNNI/BF16 but defines no AMX macro, so ggml
    # compiles no AMX kernels (ggml-cpu/amx/*.cpp are guarded by __AMX_INT8__)
    cpuinfo(tmp_path, SAPPHIRE_RAPIDS)
    flags = cflags(run(tmp_path, [empty_bin]).stdout).split()
    for argv in (["-march=sapphirerapids", *flags], [*flags, "-march=sapphirerapids"]):
        macros = subprocess.run(
            ["cc", *argv, "-dM", "-E", "-x", "c", "/dev/null"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        assert "__AVX512VNNI__" in macros and "__AVX512BF16__" in macros
        assert "__AMX" not in macros


def test_a_compiler_that_knows_no_amx_gets_no_flags(tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    fake_tool(bindir, "cc", "exit 1")  # an old compiler: no -mno-amx-int8, so no AMX either
    cpuinfo(tmp_path, EPYC_ZEN3)
    out = run(tmp_path, [bindir]).stdout
    assert cmake_options(out) == {"GGML_NATIVE": "ON", "GGML_RPC": "ON"} and cflags(out) == ""


def test_cpu_arm64_build_names_the_orin_cpu(tmp_path: Path, empty_bin: Path) -> None:
    opts = cmake_options(run(tmp_path, [empty_bin], "--mode", "cpu", arch="aarch64").stdout)
    assert opts == {
        "GGML_NATIVE": "OFF",
        "GGML_CPU_ARM_ARCH": "armv8.2-a+dotprod+fp16",
        "GGML_RPC": "ON",
    }
    assert "CFLAGS=\n" in run(tmp_path, [empty_bin], "--mode", "cpu", arch="aarch64").stdout


def test_every_mode_builds_the_rpc_backend_unless_told_not_to(
    tmp_path: Path, empty_bin: Path
) -> None:
    # on by default: it adds a backend without devices until `serve --rpc` adds workers
    fake_tool(empty_bin, "nvcc")  # --mode cuda names it
    for mode in ("cpu", "cuda", "jetson"):
        out = run(tmp_path, [empty_bin], "--mode", mode).stdout
        assert f"mode={mode}" in out and cmake_options(out)["GGML_RPC"] == "ON"
    off = run(tmp_path, [empty_bin], "--mode", "cpu", "--no-rpc").stdout
    assert "GGML_RPC" not in cmake_options(off)
    env_off = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run", "--mode", "cpu"],
        env={"PATH": f"{empty_bin}:/usr/bin:/bin", "ORIN_LLM_SYSROOT": str(tmp_path),
             "ORIN_LLM_ARCH": "x86_64", "HOME": str(tmp_path), "ORIN_LLM_RPC": "0"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert "GGML_RPC" not in cmake_options(env_off.stdout)
    bad = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ORIN_LLM_RPC": "yes"},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert bad.returncode == 2 and "ORIN_LLM_RPC must be 0 or 1" in bad.stderr


def test_the_wheel_cache_key_holds_the_rpc_option(tmp_path: Path, empty_bin: Path) -> None:
    # a cached wheel built without RPC is never taken for one with it, nor the reverse
    def key(*args: str) -> str:
        out = run(tmp_path, [empty_bin], "--mode", "cpu", *args).stdout
        return next(ln for ln in out.splitlines() if "wheel cache" in ln).rsplit(" ", 1)[1]

    assert key() != key("--no-rpc")
    assert key() == key()


def test_the_wheel_cache_is_keyed_by_the_cpu_and_options(tmp_path: Path, empty_bin: Path) -> None:
    def cache_dir(flags: str) -> str:
        cpuinfo(tmp_path, flags)
        out = run(tmp_path, [empty_bin]).stdout
        return next(ln for ln in out.splitlines() if "wheel cache" in ln).rsplit(" ", 1)[1]

    spr, epyc = cache_dir(SAPPHIRE_RAPIDS), cache_dir(EPYC_ZEN3)
    assert spr != epyc  # a native build belongs to its CPU
    assert cache_dir(SAPPHIRE_RAPIDS) == spr
    assert spr.startswith(str(tmp_path / ".cache/orin-llm/wheels/llama_cpp_python-0.3.36-cpu-"))


FAKE_PYTHON = """#!/bin/bash
# Answers the script's calls like an interpreter with the build installed; the
# smoke test dies the way SMOKE says.
case "$*" in
  *"sys.prefix"*) echo "$PREFIX" ;;
  "- "*) exit 0 ;;  # installed_ok: version and GPU support match
  "-m orin.model.smoke") case "$SMOKE" in
      segv) kill -SEGV $$ ;;
      fail) echo "Traceback: boom"; echo "RuntimeError: no tokens"; exit 1 ;;
      *) echo "smoke test: ok" ;;
    esac ;;
  *) echo "install-llama-cpp: system info" ;;
esac
"""


@pytest.mark.parametrize(
    ("smoke", "rc", "said"),
    [
        ("segv", 1, "crashed on its first quantized decode (signal 11: SEGV)"),
        ("fail", 1, "failed its smoke test: RuntimeError: no tokens"),
        ("ok", 0, ""),
    ],
)
def test_a_build_that_crashes_fails_the_install(
    tmp_path: Path, empty_bin: Path, smoke: str, rc: int, said: str
) -> None:
    cpuinfo(tmp_path, SAPPHIRE_RAPIDS)
    key = (
        next(ln for ln in run(tmp_path, [empty_bin]).stdout.splitlines() if "wheel cache" in ln)
        .split()[2]
        .rstrip(",")
    )
    prefix = tmp_path / "venv"
    prefix.mkdir()
    (prefix / ".orin-llm-llama-build").write_text(key + "\n")  # this build is installed
    fake_tool(empty_bin, "python", FAKE_PYTHON)
    env_extra = {"PREFIX": str(prefix), "SMOKE": smoke}
    r = subprocess.run(
        ["bash", str(SCRIPT), "--python", str(empty_bin / "python")],
        env={
            "PATH": f"{empty_bin}:/usr/bin:/bin",
            "ORIN_LLM_SYSROOT": str(tmp_path),
            "ORIN_LLM_ARCH": "x86_64",
            "HOME": str(tmp_path),
            **env_extra,
        },
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == rc, r.stdout + r.stderr
    assert "already installed" in r.stdout
    if rc:
        assert said in r.stderr and len(r.stderr.strip().splitlines()) == 1
        # a build that failed is not recorded as installed: the next run rebuilds
        assert not (prefix / ".orin-llm-llama-build").exists()
    else:
        assert "smoke test: ok" in r.stdout
