"""The device nodes the server unit allows, and the CUDA probe install runs in its sandbox.

The board's /dev is a fake tree copying an AGX Orin on JetPack 6 (the nodes of
NVIDIA's devices.csv for an Orin); the probe's answers come from the fake host.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from orin.cli.deps import Deps
from orin.install import cudaprobe
from orin.install.layout import SERVICE, TUNE_SERVICE
from orin.install.sandbox import NOT_SANDBOX, interpret, probe_command, sandbox_properties
from orin.install.units import find_gpu_devices, render_units
from orin.system.commands import CommandResult
from orin.system.root import SysRoot
from tests.fakes.host import FakeHost
from tests.unit.install.conftest import EXECUTABLE
from tests.unit.install.test_install import PROFILE, UNIT_DIR, invoke
from tests.unit.install.test_units import config_for

# /etc/nvidia-container-runtime/host-files-for-container.d/devices.csv on an AGX
# Orin with JetPack 6 (NVIDIA/nvidia-container-toolkit, testdata/lookup/rootfs-orin).
ORIN_JP6_DEV = (  # noqa: SIM905 (the file's own list, as it reads)
    "dri/card0 dri/renderD128 fb0 host1x-fence nvhost-as-gpu nvhost-ctrl-gpu "
    "nvhost-ctrl-nvdla0 nvhost-ctrl-nvdla1 nvhost-ctrl-pva0 nvhost-ctxsw-gpu nvhost-dbg-gpu "
    "nvhost-gpu nvhost-nvsched-gpu nvhost-power-gpu nvhost-prof-ctx-gpu nvhost-prof-dev-gpu "
    "nvhost-prof-gpu nvhost-sched-gpu nvhost-tsg-gpu nvgpu/igpu0/as nvgpu/igpu0/channel "
    "nvgpu/igpu0/ctrl nvgpu/igpu0/ctxsw nvgpu/igpu0/dbg nvgpu/igpu0/nvsched nvgpu/igpu0/power "
    "nvgpu/igpu0/prof nvgpu/igpu0/prof-ctx nvgpu/igpu0/prof-dev nvgpu/igpu0/sched "
    "nvgpu/igpu0/tsg nvidia-modeset nvidia0 nvidiactl nvmap nvsciipc v4l2-nvdec v4l2-nvenc"
).split()
CUDA_NODES = [
    "/dev/dri/renderD128",
    "/dev/host1x-fence",
    *(f"/dev/nvgpu/igpu0/{n}" for n in ("as", "channel", "ctrl", "ctxsw", "dbg", "nvsched")),
    *(f"/dev/nvgpu/igpu0/{n}" for n in ("power", "prof", "prof-ctx", "prof-dev", "sched", "tsg")),
    "/dev/nvhost-as-gpu",
    "/dev/nvhost-ctrl-gpu",
    "/dev/nvhost-ctxsw-gpu",
    "/dev/nvhost-dbg-gpu",
    "/dev/nvhost-gpu",
    "/dev/nvhost-nvsched-gpu",
    "/dev/nvhost-power-gpu",
    "/dev/nvhost-prof-ctx-gpu",
    "/dev/nvhost-prof-dev-gpu",
    "/dev/nvhost-prof-gpu",
    "/dev/nvhost-sched-gpu",
    "/dev/nvhost-tsg-gpu",
    "/dev/nvmap",
]


def orin_dev(base: Path, nodes: list[str] = ORIN_JP6_DEV) -> None:
    for node in nodes:
        path = base / "dev" / node
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def failed(nodes: list[dict[str, Any]], **cuda: Any) -> dict[str, Any]:
    cuda = {"ok": False, "call": "cuInit", "result": 801, "name": "CUDA_ERROR_NOT_SUPPORTED"} | cuda
    return {"status": "failed", "cuda": cuda, "nodes": nodes}


def test_jetpack6_orin_allows_the_cuda_nodes_and_no_others(tmp_path: Path) -> None:
    orin_dev(tmp_path)
    assert list(find_gpu_devices(SysRoot(tmp_path))) == CUDA_NODES


def test_jetpack5_keeps_the_nvhost_syncpoint_node(tmp_path: Path) -> None:
    orin_dev(tmp_path, ["nvmap", "nvhost-ctrl", "nvhost-ctrl-gpu", "nvhost-vic", "nvhost-gpu"])
    assert find_gpu_devices(SysRoot(tmp_path)) == (
        "/dev/nvhost-ctrl",
        "/dev/nvhost-ctrl-gpu",
        "/dev/nvhost-gpu",
        "/dev/nvmap",
    )


def test_a_discrete_gpu_gets_its_nvidia_nodes(tmp_path: Path) -> None:
    orin_dev(tmp_path, ["nvidia0", "nvidiactl", "nvidia-uvm"])
    assert find_gpu_devices(SysRoot(tmp_path)) == (
        "/dev/nvidia-uvm",
        "/dev/nvidia0",
        "/dev/nvidiactl",
    )


def test_the_probe_carries_the_whole_sandbox_of_the_unit(tmp_path: Path) -> None:
    board = tmp_path / "board"
    orin_dev(board)
    cfg = config_for(board, "llama3.1-8b-q4_k_m")
    unit = render_units(cfg)[SERVICE]
    argv = probe_command(unit, EXECUTABLE, cfg.devices)
    assert argv[:6] == ("systemd-run", "--wait", "--pipe", "--collect", "--quiet", argv[5])
    props = [argv[i + 1] for i, a in enumerate(argv) if a == "-p"]
    assert props == list(sandbox_properties(unit))
    for expected in (
        "User=orin-llm",
        "SupplementaryGroups=video render",
        "PrivateDevices=no",
        "DevicePolicy=closed",
        "DeviceAllow=/dev/host1x-fence rw",
        "DeviceAllow=/dev/dri/renderD128 rw",
        "SystemCallFilter=~@privileged",
        "ProtectSystem=strict",
        "CapabilityBoundingSet=",
    ):
        assert expected in props, expected
    assert not [p for p in props if p.partition("=")[0] in NOT_SANDBOX]
    tail = argv[argv.index("--") + 1 :]
    assert tail == (
        "/opt/orin-llm/venv/bin/python",
        "-I",
        "-m",
        "orin.install.cudaprobe",
        *CUDA_NODES,
    )


def test_install_probes_cuda_after_the_files_and_before_enabling(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    orin_dev(root)
    code, out, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 0, err
    probes = [i for i, c in enumerate(host.calls) if c[0] == "systemd-run"]
    assert len(probes) == 1
    order = [c[:2] for c in host.calls if c[0] in ("chmod", "systemd-run", "systemctl")]
    assert order.index(("systemd-run", "--wait")) == order.index(("chmod", "0640")) + 1
    assert order[order.index(("systemd-run", "--wait")) + 1] == ("systemctl", "daemon-reload")
    assert "CUDA initialized as the service, inside its sandbox (1 device(s))" in out
    assert re.search(r"step \d+: systemd-run --wait --pipe --collect --quiet -p \.\.\. \(the", out)
    host.calls.clear()
    assert invoke(deps, root, "install", "--profile", PROFILE)[0] == 0
    assert not any(c[0] == "systemd-run" for c in host.calls)  # nothing changed: no probe


def test_a_node_cuda_cannot_open_stops_the_install_and_is_named(
    root: Path, host: FakeHost, deps: Deps
) -> None:
    orin_dev(root)
    host.probe_report = failed(
        [
            {"path": "/dev/dri/renderD128", "allowed": True, "error": None},
            {"path": "/dev/host1x-fence", "allowed": True, "error": "EPERM"},
            {"path": "/dev/nvmap", "allowed": True, "error": None},
        ]
    )
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE)
    assert code == 1
    assert "install failed at `systemd-run" in err
    assert "cuInit returned 801 (CUDA_ERROR_NOT_SUPPORTED)" in err
    assert "it could not open /dev/host1x-fence (EPERM: the device filter refused it" in err
    assert "rolled back:" in err
    for unit in (SERVICE, TUNE_SERVICE):
        assert not (root / UNIT_DIR.lstrip("/") / unit).exists()
    assert not any(c[:2] == ("systemctl", "enable") for c in host.calls)


def test_force_reports_a_failed_probe_and_installs(root: Path, host: FakeHost, deps: Deps) -> None:
    orin_dev(root)
    host.probe_report = failed([{"path": "/dev/nvmap", "allowed": True, "error": "EACCES"}])
    code, _, err = invoke(deps, root, "install", "--profile", PROFILE, "--force")
    assert code == 0, err
    assert "CUDA probe FAILED" in err
    assert "/dev/nvmap (EACCES: its permissions: the service user lacks the node's group" in err
    assert (root / UNIT_DIR.lstrip("/") / SERVICE).exists()


@pytest.mark.parametrize(
    ("result", "status", "says"),
    [
        (
            CommandResult((), 1, "", "Unknown assignment: ProtectProc=invisible\n"),
            "failed",
            "did not run in the service's sandbox (exit status 1): Unknown assignment",
        ),
        (
            CommandResult((), 0, json.dumps({"status": "no-driver", "detail": "no libcuda"})),
            "no-driver",
            "no CUDA driver here (no libcuda): the probe was skipped",
        ),
        (
            CommandResult(
                (),
                1,
                json.dumps(
                    failed(
                        [
                            {"path": "/dev/nvmap", "allowed": True, "error": None},
                            {"path": "/dev/nvhost-new-gpu", "allowed": False, "error": "EPERM"},
                        ]
                    )
                ),
            ),
            "failed",
            "the sandbox refuses /dev/nvhost-new-gpu (EPERM: not in DeviceAllow)",
        ),
        (
            CommandResult(
                (),
                1,
                json.dumps(
                    {
                        "status": "failed",
                        "cuda": {"ok": True, "devices": 1},
                        "llama": {"ok": False, "error": "ModuleNotFoundError: llama_cpp"},
                        "nodes": [],
                    }
                ),
            ),
            "failed",
            "llama.cpp did not load inside the service's sandbox: ModuleNotFoundError",
        ),
    ],
)
def test_probe_reports(result: CommandResult, status: str, says: str) -> None:
    outcome = interpret(result)
    assert outcome.status == status
    assert says in outcome.message


class FakeCuda:
    """libcuda's driver API as ctypes sees it: each call returns a CUresult."""

    def __init__(self, fail: str | None = None, result: int = 801) -> None:
        self.fail, self.result, self.called = fail, result, []  # type: ignore[var-annotated]

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any) -> int:
            self.called.append(name)
            if name == "cuDeviceGetCount":
                args[0]._obj.value = 1
            return self.result if name == self.fail else 0

        return call


def test_cuda_init_names_the_first_failing_call() -> None:
    assert cudaprobe.cuda_init(FakeCuda()) == {"ok": True, "devices": 1}
    lib = FakeCuda(fail="cuInit")
    assert cudaprobe.cuda_init(lib) == {
        "ok": False,
        "call": "cuInit",
        "result": 801,
        "name": "CUresult 801",  # the fake's cuGetErrorName fails too
    }
    assert lib.called[0] == "cuInit" and "cuMemAlloc_v2" not in lib.called


def test_node_check_opens_each_node_and_keeps_the_errno(tmp_path: Path) -> None:
    orin_dev(tmp_path, ["nvmap", "nvhost-ctrl-nvdla0"])
    allowed = [str(tmp_path / "dev/nvmap"), str(tmp_path / "dev/host1x-fence")]
    report = cudaprobe.check_nodes(allowed, (f"{tmp_path}/dev/nv*",))
    assert report == [
        {"path": str(tmp_path / "dev/host1x-fence"), "allowed": True, "error": "ENOENT"},
        {"path": str(tmp_path / "dev/nvhost-ctrl-nvdla0"), "allowed": False, "error": None},
        {"path": str(tmp_path / "dev/nvmap"), "allowed": True, "error": None},
    ]


def test_no_driver_is_not_a_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cudaprobe, "load_cuda", lambda: None)
    assert cudaprobe.main(["/dev/nvmap"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "no-driver"
