"""Run the CUDA probe in the server's sandbox, and say what its report means.

The probe is a transient unit (``systemd-run --wait --pipe``) carrying every
``[Service]`` setting of the rendered ``orin-llm.service`` except those about
starting, watching and restarting it, so it runs as the service user with the
same groups, device policy, ``DeviceAllow`` list and hardening. The command
goes through the CommandRunner like every other, so tests feed it canned
reports.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

from orin.install.layout import SERVICE
from orin.system.commands import CommandResult

PROBE_MODULE = "orin.install.cudaprobe"
PROBE_TIMEOUT_S = 180.0  # a cold CUDA context and the llama.cpp import on an SD card
# How the server is started, watched and restarted; not part of its sandbox,
# and Type=notify would make systemd-run wait for a READY=1 the probe never sends.
NOT_SANDBOX = frozenset(
    {
        "Type",
        "NotifyAccess",
        "ExecStart",
        "WatchdogSec",
        "Restart",
        "RestartSec",
        "TimeoutStartSec",
        "TimeoutStopSec",
    }
)
RUN_OPTIONS = ("--wait", "--pipe", "--collect", "--quiet", "--description=orin-llm CUDA probe")

Status = Literal["ok", "no-driver", "failed"]


@dataclass(frozen=True)
class CudaProbe:
    """A step of install: CUDA initialization as the service, before it is enabled."""

    argv: tuple[str, ...]
    required: bool = True  # --force turns a failure into a warning

    def describe(self) -> str:
        settings = self.argv.count("-p")
        tail = self.argv[self.argv.index("--") + 1 :]
        return (
            f"systemd-run {' '.join(RUN_OPTIONS[:4])} -p ... (the {settings} sandbox settings "
            f"of {SERVICE}) {' '.join(tail[:4])} ... (CUDA initialization as the service)"
        )


@dataclass(frozen=True)
class ProbeOutcome:
    status: Status
    message: str

    @property
    def failed(self) -> bool:
        return self.status == "failed"


def sandbox_properties(unit_text: str) -> tuple[str, ...]:
    """The ``[Service]`` assignments of a unit that make up its sandbox, in order."""
    props, section = [], ""
    for line in unit_text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        key = line.partition("=")[0]
        if section == "[Service]" and key not in NOT_SANDBOX:
            props.append(line)
    return tuple(props)


def probe_command(unit_text: str, executable: str, devices: Iterable[str]) -> tuple[str, ...]:
    """systemd-run with the unit's sandbox, running the probe with the venv's Python."""
    python = str(PurePosixPath(executable).with_name("python"))
    argv = ["systemd-run", *RUN_OPTIONS]
    for prop in sandbox_properties(unit_text):
        argv += ["-p", prop]
    return (*argv, "--", python, "-I", "-m", PROBE_MODULE, *devices)


def interpret(res: CommandResult) -> ProbeOutcome:
    """The probe's JSON report (its last line) as one outcome with a message."""
    report = _report(res.stdout)
    if report is None:
        output = (res.stderr.strip() or res.stdout.strip() or "no output").splitlines()[-1]
        return ProbeOutcome(
            "failed",
            f"the CUDA probe did not run in the service's sandbox (exit status "
            f"{res.returncode}): {output}",
        )
    status = report.get("status")
    if status == "no-driver":
        return ProbeOutcome(
            "no-driver", f"no CUDA driver here ({report.get('detail')}): the probe was skipped"
        )
    cuda = report.get("cuda") or {}
    if status == "ok":
        return ProbeOutcome(
            "ok",
            f"CUDA initialized as the service, inside its sandbox "
            f"({cuda.get('devices', '?')} device(s)); llama.cpp can offload",
        )
    return ProbeOutcome("failed", _failure(cuda, report.get("llama"), report.get("nodes") or []))


def _report(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        return data if isinstance(data, dict) else None
    return None


def _failure(cuda: dict[str, Any], llama: Any, nodes: Sequence[dict[str, Any]]) -> str:
    if cuda.get("ok") is False:
        what = (
            f"CUDA did not initialize inside the service's sandbox: {cuda.get('call')} "
            f"returned {cuda.get('result')} ({cuda.get('name')})"
        )
    elif isinstance(llama, dict) and llama.get("error"):
        what = f"llama.cpp did not load inside the service's sandbox: {llama['error']}"
    else:
        what = "CUDA initialized, but llama.cpp's CUDA build sees no GPU inside the sandbox"
    return f"{what}; {blocked_nodes(nodes)}"


def blocked_nodes(nodes: Sequence[dict[str, Any]]) -> str:
    """The node the service could not open, and why, or the nodes the sandbox refuses."""
    for node in nodes:
        if node.get("allowed") and node.get("error"):
            return f"it could not open {node['path']} ({node['error']}: {_why(node['error'])})"
    refused = [n["path"] for n in nodes if not n.get("allowed") and n.get("error") == "EPERM"]
    if refused:
        return (
            f"every allowed node opened; the sandbox refuses {', '.join(refused)} (EPERM: not in "
            f"DeviceAllow): if CUDA needs one of them, add `DeviceAllow=<node> rw` in a drop-in "
            f"(systemctl edit {SERVICE}) and report it"
        )
    return "every GPU node opened: the cause is not the device list (see the journal)"


def _why(error: str) -> str:
    if error == "EPERM":
        return (
            "the device filter refused it: the node appeared or changed after the unit was "
            "rendered; run install again"
        )
    if error == "EACCES":
        return "its permissions: the service user lacks the node's group (ls -l shows it)"
    if error == "ENOENT":
        return "it does not exist: is the GPU driver (nvgpu) loaded?"
    return "see the kernel log"
