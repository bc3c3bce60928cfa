"""Telemetry sources and the choice between them.

Auto selection takes the best source that works on this machine, in the order
jetson_sysfs > nvml > jtop > tegrastats > cpu: sysfs and NVML resolve 50 Hz,
jtop and tegrastats only a few Hz, and cpu always works. The chosen source comes
with a one-line explanation naming why each better one was passed over, so a user
who expected GPU numbers sees at once what is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from orin.system.commands import CommandRunner
from orin.system.root import SysRoot
from orin.telemetry.sources.base import (
    Availability,
    Sample,
    Source,
    TelemetryError,
    one_line,
)
from orin.telemetry.sources.cpu import CpuSource
from orin.telemetry.sources.jetson_sysfs import JetsonSysfsSource
from orin.telemetry.sources.jtop import JtopSource
from orin.telemetry.sources.nvml import NvmlSource
from orin.telemetry.sources.tegrastats import TegrastatsSource

SourceFactory = Callable[[SysRoot, CommandRunner], Source]


def _jetson_sysfs(root: SysRoot, runner: CommandRunner) -> Source:
    return JetsonSysfsSource(root)


def _nvml(root: SysRoot, runner: CommandRunner) -> Source:
    return NvmlSource()


def _jtop(root: SysRoot, runner: CommandRunner) -> Source:
    return JtopSource()


def _tegrastats(root: SysRoot, runner: CommandRunner) -> Source:
    return TegrastatsSource(runner)


def _cpu(root: SysRoot, runner: CommandRunner) -> Source:
    return CpuSource()


# Insertion order is the auto-selection order, best first.
SOURCES: dict[str, SourceFactory] = {
    "jetson_sysfs": _jetson_sysfs,
    "nvml": _nvml,
    "jtop": _jtop,
    "tegrastats": _tegrastats,
    "cpu": _cpu,
}


def _probe(
    name: str, factory: SourceFactory, root: SysRoot, runner: CommandRunner
) -> tuple[Source | None, Availability]:
    """Build and ask one source; a source that fails while being built is unavailable."""
    try:
        source = factory(root, runner)
        found = source.availability()
    except Exception as exc:  # a discovery bug must not stop the server from starting
        return None, Availability(False, one_line(f"{type(exc).__name__}: {exc}"))
    if not found.ok:
        source.close()
        return None, found
    return source, found


def select_source(
    name: str | None,
    root: SysRoot,
    runner: CommandRunner,
    registry: Mapping[str, SourceFactory] | None = None,
) -> tuple[Source, str]:
    """The source to sample and a one-line explanation of the choice.

    ``name`` None picks automatically; a name forces that source, and an unknown
    or unavailable one raises TelemetryError with the reason (no silent fallback).
    """
    sources = SOURCES if registry is None else registry
    if name is not None:
        return _forced(name, sources, root, runner)
    passed: list[str] = []
    for candidate, factory in sources.items():
        source, found = _probe(candidate, factory, root, runner)
        if source is not None:
            skipped = f"; not used: {'; '.join(passed)}" if passed else ""
            return source, f"{candidate} ({found.reason}){skipped}"
        passed.append(f"{candidate}: {found.reason}")
    raise TelemetryError(
        f"no telemetry source available: {'; '.join(passed)}", reason="; ".join(passed)
    )


def _forced(
    name: str, sources: Mapping[str, SourceFactory], root: SysRoot, runner: CommandRunner
) -> tuple[Source, str]:
    factory = sources.get(name)
    if factory is None:
        known = ", ".join(sources)
        raise TelemetryError(
            f"unknown telemetry source {name!r} (known: {known})", source=name, reason="unknown"
        )
    source, found = _probe(name, factory, root, runner)
    if source is None:
        raise TelemetryError(
            f"telemetry source {name} is not available: {found.reason}",
            source=name,
            reason=found.reason,
        )
    return source, f"{name} (forced; {found.reason})"


__all__ = [
    "SOURCES",
    "Availability",
    "Sample",
    "Source",
    "SourceFactory",
    "TelemetryError",
    "select_source",
]
