"""What the checks look at, each source read at most once and only when a check asks.

Every side effect comes in through the constructor: the SysRoot (fake board
trees in tests), the command runner, the build-info function (a CPU-only
build on a Jetson is tested by injecting a BuildInfo, not by rebuilding), the
port probe and the free-space function. Nothing here loads model weights:
the model is read with the GGUF metadata reader only.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TypeVar

from orin.errors import OrinError
from orin.llamacpp import BuildInfo, build_info
from orin.model.gguf import ModelInfo, read_model_info
from orin.model.hub import DiskFree, free_bytes
from orin.profile.kvmatch import KVDecision, resolve_kv
from orin.profile.loader import resolve_model_path
from orin.profile.schema import Profile
from orin.system.commands import CommandRunner
from orin.system.memory import read_meminfo
from orin.system.platform import Platform, detect
from orin.system.root import SysRoot

PortProbe = Callable[[str, int], str | None]  # None when the port can be bound


def probe_port(host: str, port: int) -> str | None:
    """Try to bind the server's address the way uvicorn does; why not, or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "already in use"
            return exc.strerror or str(exc)
    return None


def model_path_for(profile: Profile, override: Path | None) -> tuple[Path | None, str]:
    """The file serve would load, without generating a demo model; or why there is none."""
    if override is not None:
        return override, "--model"
    demo = profile.model.demo
    if demo is not None:
        from orin.model import demo as demo_models
        from orin.paths import models_cache_dir

        return models_cache_dir() / demo_models.file_name(demo.size, demo.quant), "demo"
    if profile.model.hf is not None:
        from orin.profile.loader import hf_model_path

        try:
            return hf_model_path(profile), "hf"
        except OrinError:
            return None, "hf"  # not pulled yet: check_model_file names the pull
    if profile.model.packaged is not None:
        from orin.model import packaged

        model = packaged.get(profile.model.packaged)
        return packaged.find(model) or packaged.cached_path(model), "packaged"
    try:
        return resolve_model_path(profile), "profile"
    except OrinError as exc:
        return None, str(exc)


@dataclass
class DoctorContext:
    root: SysRoot
    runner: CommandRunner
    profile: Profile
    model_path: Path | None
    model_source: str = "profile"  # --model, profile, demo, packaged, hf, or why there is none
    build_info: Callable[[], BuildInfo] = build_info
    port_probe: PortProbe = probe_port
    disk_free: DiskFree = free_bytes
    platform_override: Platform | None = field(default=None, repr=False)
    # the environment serve would start with when run from this shell
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ), repr=False)

    @cached_property
    def platform(self) -> Platform:
        if self.platform_override is not None:
            return self.platform_override
        return detect(self.root, self.runner)

    @cached_property
    def _model(self) -> tuple[ModelInfo | None, str | None]:
        path = self.model_path
        if path is None:
            return None, self.model_source
        return _attempt(lambda: read_model_info(path), OrinError)

    @property
    def model(self) -> ModelInfo | None:
        return self._model[0]

    @property
    def model_problem(self) -> str | None:
        return self._model[1]

    @cached_property
    def _build(self) -> tuple[BuildInfo | None, str | None]:
        return _attempt(self.build_info, OrinError, OSError)

    @property
    def build(self) -> BuildInfo | None:
        return self._build[0]

    @property
    def build_problem(self) -> str | None:
        return self._build[1]

    @cached_property
    def _available(self) -> tuple[int | None, str | None]:
        return _attempt(lambda: read_meminfo(self.root).available, OrinError)

    @property
    def available(self) -> int | None:
        return self._available[0]

    @property
    def memory_problem(self) -> str | None:
        """Why MemAvailable could not be read (``available`` is then None)."""
        return self._available[1]

    @property
    def quantization(self) -> str | None:
        """The weights' quantization: the file's, else what the profile says."""
        if self.model is not None:
            return self.model.quantization
        m = self.profile.model
        return m.quantization or (m.demo.quant.upper() if m.demo else None)

    @cached_property
    def kv(self) -> KVDecision:
        """The K/V types and flash-attention mode the engine would use."""
        return resolve_kv(
            self.profile.engine, self.quantization, self.model, self.build, self.available
        )


T = TypeVar("T")


def _attempt(read: Callable[[], T], *errors: type[Exception]) -> tuple[T | None, str | None]:
    """What ``read`` gives, or why it could not (one of ``errors``): a context fact and
    the problem a check names when it is missing."""
    try:
        return read(), None
    except errors as exc:
        return None, str(exc)
