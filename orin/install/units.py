"""Render the unit templates in systemd/ with values from the profile and its memory plan.

The templates hold everything that is the same on every board (the hardening,
the restart policy); this module computes what depends on the profile, the
model and the board: the memory limits from the memory plan, the start and
stop timeouts, the GPU device nodes, the user and groups. Rendering is pure,
so golden tests pin the exact unit text and the install plan can diff it
against what is installed.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from orin.errors import KVConfigError, OrinError
from orin.install.layout import (
    CACHE_DIR,
    HOME_PREFIXES,
    PROFILE_FILE,
    SERVICE,
    STATE_DIR,
    TUNE_SERVICE,
)
from orin.model.gguf import ModelInfo
from orin.model.memplan import MemoryPlan, plan_memory
from orin.profile.fit import draft_info, projector_bytes
from orin.profile.kvmatch import resolve_kv
from orin.profile.schema import PATH_FIELDS, Profile
from orin.system.root import SysRoot

MiB = 1 << 20
GiB = 1 << 30

# Python, the CUDA context and libraries, the HTTP server: what the process
# holds besides the weights, the KV cache and the compute buffers of the plan.
PROCESS_OVERHEAD = 1 * GiB
# MemoryMax sits a quarter above MemoryHigh: past MemoryHigh the kernel
# reclaims and throttles, past MemoryMax it kills, so a short excursion above
# the plan slows the server down instead of killing it.
MAX_OVER_HIGH = 0.25

# Longer than any single engine step (a full n_batch prompt chunk takes
# seconds even for a 70B model, tens of seconds on a CPU-only build), since
# the heartbeat only advances between steps.
WATCHDOG_SEC = 60
START_LIMIT_INTERVAL_S = 600  # 5 starts in 10 minutes, then systemd gives up (StartLimitBurst)
# The watchdog starts at READY=1, so loading is bounded by TimeoutStartSec
# alone: a cold read of the weights at 100 MiB/s (an SD card) plus two
# minutes for CUDA and the KV cache, and never under five minutes.
LOAD_READ_BYTES_PER_S = 100 * MiB
LOAD_BASE_S = 120
LOAD_FLOOR_S = 300
# Drain gets server.grace_seconds; this covers writing the last responses and
# the engine thread's join after it, so systemd never kills a drain.
STOP_MARGIN_S = 30

MLOCK_MODES = frozenset({"mlock", "mmap+mlock"})

# The device nodes CUDA reaches the GPU through on a Jetson, searched on the
# board at install time (DeviceAllow= takes no globs). docs/install.md lists
# where each comes from: NVIDIA's container runtime hands Jetson containers the
# same set (devices.csv), and an strace of cuInit on JetPack 6 opens nvmap,
# nvgpu's ctrl node, the tegra-drm render node and host1x-fence.
JETSON_GPU_GLOBS = (
    "dev/nvmap",  # nvmap: every CUDA allocation (JetPack 5 and 6)
    "dev/nvgpu/*/*",  # nvgpu's nodes under their JetPack 6 names: ctrl, as, tsg, channel, ...
    "dev/nvhost-*gpu",  # the same nvgpu nodes under their nvhost-*-gpu names
    "dev/nvhost-ctrl",  # JetPack 5: host1x syncpoints through nvhost
    "dev/host1x-fence",  # JetPack 6: host1x syncpoint fences (cuInit fails without it)
    "dev/dri/renderD*",  # JetPack 6: the tegra-drm render node libcuda opens at init
)
# A discrete GPU (a CUDA workstation). On a Jetson /dev/nvidia* belong to the
# display driver, which CUDA does not use, so they are left out there.
DISCRETE_GPU_GLOBS = ("dev/nvidia*",)
# What an AGX Orin on JetPack 6 has (NVIDIA's devices.csv for an Orin, GPU part);
# used when none are found on the machine install runs on, so the unit still
# renders (and verifies) elsewhere.
_NVGPU_NODES = "as channel ctrl ctxsw dbg nvsched power prof prof-ctx prof-dev sched tsg"
_NVHOST_NODES = "as ctrl ctxsw dbg nvsched power prof prof-ctx prof-dev sched tsg"
DEFAULT_GPU_DEVICES = tuple(
    sorted(
        (
            "/dev/dri/renderD128",
            "/dev/host1x-fence",
            "/dev/nvmap",
            "/dev/nvhost-gpu",
            *(f"/dev/nvgpu/igpu0/{n}" for n in _NVGPU_NODES.split()),
            *(f"/dev/nvhost-{n}-gpu" for n in _NVHOST_NODES.split()),
        )
    )
)

_PLACEHOLDER = re.compile(r"\{\{([a-z_]+)\}\}")


class TemplateError(OrinError):
    """A unit template is missing or names a value the renderer does not have."""


@dataclass(frozen=True)
class UnitConfig:
    """Everything that varies between installs; the rest is in the templates."""

    profile_name: str
    executable: str
    user: str
    groups: tuple[str, ...]
    plan: MemoryPlan
    grace_seconds: float
    memlock: bool
    devices: tuple[str, ...]
    protect_home: Literal["yes", "read-only"] = "yes"
    port: int | None = None
    devices_found: bool = True  # False: none on this machine, the JetPack 6 defaults
    # engine.rpc: a worker that is down makes the server exit until it returns, so
    # systemd must go on restarting it however often (no start limit)
    rpc_workers: bool = False
    # folders the profile has the server write besides its own StateDirectory and
    # CacheDirectory (prompt_cache.directory): ProtectSystem=strict makes every other
    # path read-only, so each is a ReadWritePaths= of its own
    writable: tuple[str, ...] = ()

    @property
    def memory_high(self) -> int:
        return _round_up(self.plan.total_bytes + PROCESS_OVERHEAD, MiB)

    @property
    def memory_max(self) -> int:
        return _round_up(int(self.memory_high * (1 + MAX_OVER_HIGH)), MiB)

    @property
    def timeout_start_s(self) -> int:
        read_s = math.ceil(self.plan.weights_bytes / LOAD_READ_BYTES_PER_S)
        return max(LOAD_FLOOR_S, LOAD_BASE_S + read_s)

    @property
    def timeout_stop_s(self) -> int:
        return math.ceil(self.grace_seconds) + STOP_MARGIN_S


def service_plan(
    profile: Profile,
    info: ModelInfo,
    mmproj_bytes: int | None = None,
    draft: ModelInfo | None = None,
) -> MemoryPlan:
    """The most the server will allocate for this profile and model.

    ``auto`` cache types are resolved without the free memory, which picks
    q8_0 over q4_0 for 4- and 5-bit weights: the larger of the two, so the
    limits hold whichever the server picks when it starts. ``mmproj_bytes``: the
    vision projector's, where the caller read them from another copy of its file
    (None: the file the profile names, where it is). ``draft``: the speculative
    draft model's header, where the caller read it from another copy (None: the
    file the profile names, where it is); its weights and cache are counted.
    """
    e = profile.engine
    decision = resolve_kv(e, info.quantization, info, None, None)
    if decision.errors:
        raise KVConfigError("; ".join(f"{f.rule}: {f.message}" for f in decision.errors))
    flash = decision.flash_attn != "off"
    return plan_memory(
        info,
        e.n_ctx,
        e.slots,
        decision.type_k,
        decision.type_v,
        None,
        e.n_ubatch,
        flash,
        e.n_batch,
        e.swa_full,
        mmproj_bytes=projector_bytes(profile) if mmproj_bytes is None else mmproj_bytes,
        draft=draft_info(profile) if draft is None else draft,
    )


def unit_config(
    profile: Profile,
    plan: MemoryPlan,
    executable: str,
    user: str,
    groups: Iterable[str],
    devices: Iterable[str],
    port: int | None = None,
    model_path: str | None = None,
) -> UnitConfig:
    found = tuple(devices)
    return UnitConfig(
        profile_name=profile.name,
        executable=executable,
        user=user,
        groups=tuple(groups),
        plan=plan,
        grace_seconds=profile.server.grace_seconds,
        memlock=profile.engine.load_mode in MLOCK_MODES,
        devices=found or DEFAULT_GPU_DEVICES,
        protect_home=protect_home_for((executable, model_path, *_other_files(profile))),
        port=port,
        devices_found=bool(found),
        rpc_workers=bool(profile.engine.rpc),
        writable=writable_folders(profile),
    )


def writable_folders(profile: Profile) -> tuple[str, ...]:
    """Where the profile has the server save its prompts (prompt_cache.directory), when
    it keeps prompts and that folder is outside the service's own writable folders."""
    pc = profile.prompt_cache
    if pc.directory is None or not (pc.prompts or pc.prompt_dir):
        return ()
    folder = os.path.normpath(profile.path_from(pc.directory))
    if any(folder == own or folder.startswith(own + "/") for own in (STATE_DIR, CACHE_DIR)):
        return ()
    return (folder,)


def _other_files(profile: Profile) -> tuple[str, ...]:
    """The files and folders besides the model the service reads (PATH_FIELDS: its
    vision projector, a speculative draft model, the prompt cache's folders), as
    serve resolves them."""
    out = []
    for field in PATH_FIELDS:
        value = field.value(profile)
        if value is not None and field.name != "model.path":  # the model: model_path
            out.append(str(profile.path_from(value)))
    return tuple(out)


def protect_home_for(paths: Iterable[str | None]) -> Literal["yes", "read-only"]:
    """``read-only`` when the service must read something under a home directory."""
    for p in paths:
        if p and any(p.startswith(prefix) for prefix in HOME_PREFIXES):
            return "read-only"
    return "yes"


def find_gpu_devices(root: SysRoot) -> tuple[str, ...]:
    """The GPU device nodes on this board; none on a machine without a GPU."""
    return _glob(root, JETSON_GPU_GLOBS) or _glob(root, DISCRETE_GPU_GLOBS)


def _glob(root: SysRoot, patterns: Iterable[str]) -> tuple[str, ...]:
    found: set[str] = set()
    for pattern in patterns:
        for p in root.base.glob(pattern):
            if not p.is_dir():
                found.add("/" + p.relative_to(root.base).as_posix())
    return tuple(sorted(found))


def render_units(cfg: UnitConfig) -> dict[str, str]:
    """Unit name -> unit file text."""
    values = _values(cfg)
    return {name: render_template(template_text(name), values) for name in (SERVICE, TUNE_SERVICE)}


def _values(cfg: UnitConfig) -> dict[str, str]:
    serve = [cfg.executable, "serve", "--profile", PROFILE_FILE]
    if cfg.port is not None:
        serve += ["--port", str(cfg.port)]
    tune = [cfg.executable, "tune", "system", "--apply", "--profile", PROFILE_FILE]
    return {
        "profile_name": _escape(cfg.profile_name),
        "memory_plan": _escape(describe_plan(cfg)),
        "exec_start": command_line(serve),
        "exec_tune": command_line(tune),
        "user": cfg.user,
        "groups": " ".join(cfg.groups),
        "watchdog_sec": str(WATCHDOG_SEC),
        "start_limit_interval_sec": "0" if cfg.rpc_workers else str(START_LIMIT_INTERVAL_S),
        "timeout_start_sec": str(cfg.timeout_start_s),
        "timeout_stop_sec": str(cfg.timeout_stop_s),
        "limit_memlock": "LimitMEMLOCK=infinity" if cfg.memlock else "",
        "memory_high": f"{cfg.memory_high // MiB}M",
        "memory_max": f"{cfg.memory_max // MiB}M",
        "protect_home": cfg.protect_home,
        # "-": a folder that is missing does not stop the start (serve says why it
        # cannot save the prompts there)
        "read_write_paths": "\n".join(
            f"ReadWritePaths={_path_word('-' + d)}" for d in cfg.writable
        ),
        "device_allow": "\n".join(f"DeviceAllow={_escape(d)} rw" for d in cfg.devices),
    }


def describe_plan(cfg: UnitConfig) -> str:
    p = cfg.plan
    draft = f" + draft model ~{_gib(p.draft_bytes)}" if p.draft_bytes else ""
    return (
        f"weights {_gib(p.weights_bytes)} + KV {_gib(p.kv_bytes)} "
        f"({p.slots} slots x {p.ctx} tokens, K={p.type_k}, V={p.type_v}) + compute "
        f"~{_gib(p.compute_bytes)}{draft} = {_gib(p.total_bytes)}; MemoryHigh adds "
        f"{_gib(PROCESS_OVERHEAD)} for the process, MemoryMax a quarter more"
    )


def render_template(text: str, values: Mapping[str, str]) -> str:
    """Fill ``{{name}}`` placeholders; a line that renders empty is left out.

    An unknown placeholder is an error, so a template and this module cannot
    drift apart silently.
    """
    out: list[str] = []
    for line in text.splitlines():
        names = _PLACEHOLDER.findall(line)
        missing = [n for n in names if n not in values]
        if missing:
            raise TemplateError(f"unit template names unknown value(s): {', '.join(missing)}")
        rendered = _PLACEHOLDER.sub(lambda m: values[m.group(1)], line)
        if names and not rendered.strip():
            continue
        if names and rendered.rstrip().endswith("="):  # e.g. no supplementary groups
            continue
        out.append(rendered)
    return "\n".join(out) + "\n"


def template_dir() -> Path:
    """systemd/ in the repository, or orin/_systemd inside an installed wheel."""
    here = Path(__file__).resolve().parent.parent
    for d in (here / "_systemd", here.parent / "systemd"):
        if d.is_dir():
            return d
    raise TemplateError(f"unit templates not found (looked in {here / '_systemd'})")


def template_text(name: str) -> str:
    path = template_dir() / name
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TemplateError(f"{path}: cannot read: {exc.strerror or exc}") from exc


def command_line(argv: Iterable[str]) -> str:
    """A command line for ExecStart=, each word quoted the way systemd parses it."""
    return " ".join(_quote(a) for a in argv)


def _quote(arg: str) -> str:
    arg = _escape(arg).replace("$", "$$")
    if arg and not re.search(r"[\s\"'\\;]", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _path_word(path: str) -> str:
    """A path as one word of a unit setting's list, quoted where it has to be."""
    path = _escape(path)
    if path and not re.search(r"[\s\"'\\]", path):
        return path
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _escape(text: str) -> str:
    """``%`` starts a specifier in unit files."""
    return text.replace("%", "%%")


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


# -- the RPC worker's unit (orin-llm install-rpc-worker) -----------------------------

RPC_WORKER_SERVICE = "orin-llm-rpc-worker.service"
RPC_CACHE_DIR = "/var/cache/orin-llm/rpc"


@dataclass(frozen=True)
class RpcWorkerUnit:
    """What the worker's unit needs: where it listens and who may connect.

    ``allow`` are the addresses (or CIDR prefixes) of the serving boards; when
    given, the unit drops every other peer in the kernel (IPAddressDeny=any), a
    fence the RPC protocol itself does not have."""

    executable: str
    user: str
    groups: tuple[str, ...]
    host: str
    port: int
    devices: tuple[str, ...]
    threads: int = 0
    cache: bool = False
    allow: tuple[str, ...] = ()
    protect_home: Literal["yes", "read-only"] = "yes"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def render_rpc_worker_unit(cfg: RpcWorkerUnit) -> str:
    """The worker's unit text: the serve unit's hardening, bound to ``cfg.host``."""
    argv = [cfg.executable, "rpc-worker", "--host", cfg.host, "--port", str(cfg.port)]
    if cfg.threads:
        argv += ["--threads", str(cfg.threads)]
    if cfg.cache:
        argv += ["--cache", RPC_CACHE_DIR]
    allow = ""
    if cfg.allow:
        allow = "IPAddressDeny=any\nIPAddressAllow=" + " ".join(("localhost", *cfg.allow))
    values = {
        "endpoint": _escape(cfg.endpoint),
        "exec_start": command_line(argv),
        "user": cfg.user,
        "groups": " ".join(cfg.groups),
        "protect_home": cfg.protect_home,
        "ip_address_allow": allow,
        "device_allow": "\n".join(f"DeviceAllow={_escape(d)} rw" for d in cfg.devices),
    }
    return render_template(template_text(RPC_WORKER_SERVICE), values)
