"""Every side effect the commands reach, in one object with production defaults.

The app's callback stores a ``Deps`` on typer's context object; a command takes it
with ``deps(ctx)``. Tests construct their own and pass it in:
``CliRunner().invoke(app, args, obj=Deps(runner=fake, effective_uid=lambda: 0))``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import typer

from orin.doctor.context import DiskFree, DoctorContext, PortProbe, free_bytes, model_path_for
from orin.doctor.context import probe_port as _probe_port
from orin.doctor.report import Report, run_checks
from orin.install import probe
from orin.install.steps import InstallError
from orin.llamacpp import BuildInfo, build_info
from orin.profile.schema import Profile
from orin.system.commands import CommandRunner, SubprocessRunner
from orin.system.root import SysRoot

HttpGet = probe.HttpGet


def find_orin_executable() -> str:
    """The orin-llm program the units run: the one next to this Python (its venv)."""
    beside = Path(sys.executable).parent / "orin-llm"
    if beside.is_file():
        return str(beside)
    found = shutil.which("orin-llm")
    if found is None:
        raise InstallError("cannot find the orin-llm program; install the package into a venv")
    return str(Path(found).absolute())


def find_orin_package() -> str:
    """The folder of the ``orin`` package this process runs (that venv's, or the
    checkout of an editable install): the code the units' program imports."""
    return str(Path(__file__).absolute().parent.parent)


@dataclass(frozen=True)
class Deps:
    runner: CommandRunner = field(default_factory=SubprocessRunner)  # external programs
    effective_uid: Callable[[], int] = os.geteuid  # root or not
    build_info: Callable[[], BuildInfo] = build_info  # what the installed llama.cpp can do
    port_probe: PortProbe = _probe_port  # whether serve could bind its address
    disk_free: DiskFree = free_bytes  # free bytes on the filesystem holding a path
    http_get: HttpGet = probe.http_get  # one HTTP GET (install waits for /health)
    orin_executable: Callable[[], str] = find_orin_executable
    orin_package: Callable[[], str] = find_orin_package
    run_doctor: Callable[[DoctorContext], Report] = run_checks  # doctor's checks

    def doctor_context(self, root: SysRoot, profile: Profile, model: Path | None) -> DoctorContext:
        """What doctor looks at for this profile and --model, through these deps."""
        path, source = model_path_for(profile, model)
        return DoctorContext(
            root,
            self.runner,
            profile,
            path,
            source,
            build_info=self.build_info,
            port_probe=self.port_probe,
            disk_free=self.disk_free,
        )


def deps(ctx: typer.Context) -> Deps:
    """The context's Deps: the one the app callback or a test stored, else the defaults."""
    return ctx.ensure_object(Deps)
