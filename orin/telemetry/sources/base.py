"""Types shared by every telemetry source, and the small file helpers they need.

A source turns one kind of hardware counter into a ``Sample``. The sampler calls
``sample()`` at up to 50 Hz on its own thread, so sources do their discovery once
in the constructor and keep ``sample()`` to a handful of file reads; a file that
vanishes mid-run turns its field into None instead of raising.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Protocol

from orin.errors import OrinError
from orin.system.root import SysRoot

MAX_SYMLINK_HOPS = 40  # what Linux allows before ELOOP


class TelemetryError(OrinError):
    """A telemetry source was asked for by name and cannot be used."""

    def __init__(self, message: str, source: str | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.source = source
        self.reason = reason


@dataclass(frozen=True)
class Sample:
    """One reading, what the 50 Hz sampler stores; a field is None when not measured."""

    t_ns: int  # time.perf_counter_ns() when read (the engine's clock)
    gpu_util: float | None = None  # 0..1
    gpu_freq_hz: int | None = None
    emc_util: float | None = None  # memory controller, 0..1
    power_mw: dict[str, float] = field(default_factory=dict)  # rail label -> mW
    cpu_util: float | None = None  # whole machine, 0..1
    proc_cpu_util: float | None = None  # this process, 0..1 of all cores
    gpu_mem_used_bytes: int | None = None


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str  # why not (or what was found), one line


class Source(Protocol):
    name: str  # "jetson_sysfs", "tegrastats", "jtop", "nvml", "cpu"
    default_hz: float  # 50 for sysfs/nvml/cpu; tegrastats/jtop much lower

    def availability(self) -> Availability: ...

    def sample(self) -> Sample: ...

    def close(self) -> None: ...


def one_line(text: str) -> str:
    """Collapse a multi-line message (jtop's, NVML's) into the one line a reason holds."""
    return " ".join(text.split())


def read_file(path: str | os.PathLike[str]) -> str | None:
    """The text of a small sysfs/debugfs file, or None when it cannot be read.

    os.open/os.read instead of Path.read_text: this runs at 50 Hz for a dozen
    files, and a directory in place of a file (EISDIR), a missing file, EACCES
    and a device that went away (ENODEV) all end up as None here.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace")


def parse_int(text: str | None) -> int | None:
    """An integer file's value; None for a missing file or content that is not a number."""
    if text is None:
        return None
    try:
        return int(text.strip().strip("\x00"))
    except ValueError:
        return None


def realpath_in(root: SysRoot, system_path: str) -> str:
    """``os.path.realpath`` for a system path, with ``root.base`` standing for ``/``.

    sysfs is full of symlinks (``/sys/class/devfreq/X``, ``device``, ``of_node``).
    Resolving them with the real os.path.realpath would follow an absolute target
    out of a fake tree into the host's /sys; here an absolute target restarts at
    the root and ``..`` stops there, so the result always names a path inside it.
    Components that do not exist are kept as they are, like realpath does.
    """
    pending = deque(PurePosixPath(system_path).parts)
    resolved: list[str] = []
    hops = 0
    while pending:
        part = pending.popleft()
        if part in ("/", "", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        target = _readlink(root.path("/" + "/".join([*resolved, part])))
        if target is None or hops >= MAX_SYMLINK_HOPS:
            resolved.append(part)
            continue
        hops += 1
        if target.startswith("/"):
            resolved = []
        pending.extendleft(reversed(PurePosixPath(target).parts))
    return "/" + "/".join(resolved)


def _readlink(path: os.PathLike[str]) -> str | None:
    try:
        return os.readlink(path)
    except OSError:  # not a link, or missing
        return None
