"""Types shared by every telemetry source, and the small file helpers they need.

A source turns one kind of hardware counter into a ``Sample``. The sampler calls
``sample()`` at up to 50 Hz on its own thread, so sources do their discovery once
in the constructor and keep ``sample()`` to a handful of file reads; a file that
vanishes mid-run turns its field into None instead of raising.
"""

from __future__ import annotations

import functools
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, Protocol, cast, runtime_checkable

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
    """One kind of counters. A source that reads the hardware on a schedule of its
    own (tegrastats' program) may also have ``set_idle(idle: bool)``: the sampler
    calls it when the engine goes idle or gets work, so the source can slow down
    with it."""

    name: str  # "jetson_sysfs", "tegrastats", "jtop", "nvml", "cpu"
    default_hz: float  # 50 for sysfs/nvml/cpu; tegrastats/jtop much lower

    def availability(self) -> Availability: ...

    def sample(self) -> Sample: ...

    def close(self) -> None: ...


@runtime_checkable
class SplitSource(Source, Protocol):
    """A source whose reading splits into cheap captures and a later ``decode``.

    At 50 Hz most of a tick's cost is the cold start of the Python code it runs,
    so the sampler's tick only calls ``capture_fast`` (best a C function such as
    ``time.process_time_ns`` or a ``functools.partial`` of ``os.pread``) and, at
    every ``slow_every``-th tick, ``capture_slow`` for the fields that change
    slowly or cost more to read; both return raw values. The captures are decoded
    in batches, several ticks at a time, on a warm path. ``decode`` is called once
    per tick, in tick order, with the slow capture or None, and may keep state
    between calls (deltas of counters, values carried between slow reads).
    ``capture_slow`` may rebind ``capture_fast`` (a file reopened), so a tick
    reads the attribute after it. ``capture_fast`` may raise OSError (a file
    kept open whose device went away): that tick's fast capture is then None,
    which ``decode`` must accept. ``sample()`` does one tick, on its own count.
    """

    slow_every: int
    capture_fast: Callable[[], object]

    def capture_slow(self) -> object: ...

    def decode(self, t_ns: int, fast: object, slow: object | None) -> Sample: ...


def split_capture(source: SplitSource, slow: bool) -> tuple[object, object | None]:
    """One tick's raw captures: the slow ones first when ``slow`` (they may reopen the
    file the fast one reads), then the fast one, None where it raised OSError."""
    slow_raw = source.capture_slow() if slow else None
    try:
        fast = source.capture_fast()
    except OSError:  # a file kept open whose device went away: None until reopened
        fast = None
    return fast, slow_raw


class SplitTicks:
    """``sample()`` for a SplitSource: the sampler's cadence, counted by the source."""

    _ticks = 0

    def sample(self: Any) -> Sample:
        t_ns = time.perf_counter_ns()
        fast, slow = split_capture(self, self._ticks % self.slow_every == 0)
        self._ticks += 1
        return cast(Sample, self.decode(t_ns, fast, slow))


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


class KeptOpen:
    """A sysfs or debugfs file read again and again through one open descriptor.

    sysfs and debugfs produce an attribute's text afresh on every read from
    offset 0, so ``pread(fd, n, 0)`` is one system call where ``read_file`` is
    three. ``reopen`` (the caller decides how often) notices a file that went
    away or was replaced; in between, a read that fails (ENODEV once a device is
    unbound) is None, like a missing file.
    """

    def __init__(self, path: str, size: int = 256) -> None:
        self.path = path
        self.size = size  # sysfs values are short; a smaller buffer is a cheaper read
        self._fd: int | None = None

    def reopen(self) -> None:
        self.close()
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            self._fd = None

    def read(self) -> str | None:
        fd = self._fd
        if fd is None:
            return None
        try:
            return os.pread(fd, self.size, 0).decode("utf-8", "replace")
        except OSError:
            return None

    def reader(self) -> Callable[[], bytes | None]:
        """A zero-argument reader that runs no Python code when the file is open
        (``os.pread`` bound to the descriptor); it raises OSError where ``read``
        would give None. Valid until the next ``reopen`` or ``close``."""
        if self._fd is None:
            return no_capture
        return functools.partial(os.pread, self._fd, self.size, 0)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def no_capture() -> None:
    """The fast capture of a field that cannot be read (no file, or closed)."""
    return None


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
