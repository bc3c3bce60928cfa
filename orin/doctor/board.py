"""Doctor checks of the board: one function each, context -> Finding.

Every value comes from the context's Platform (read once through the SysRoot
and the command runner) or from the injected probes, so each check is tested
on fake board trees.
"""

from __future__ import annotations

from pathlib import Path

from orin.doctor.context import DoctorContext
from orin.doctor.findings import Finding
from orin.install.layout import TUNE_SERVICE, UNIT_DIR
from orin.profile.loader import builtin_profiles
from orin.severity import Severity, worst
from orin.system.platform import RELEASE_FILE
from orin.system.services import unit_active_state, unit_file_state
from orin.system.settings import (
    FASTEST,
    JETSON_CLOCKS,
    STATE_DIR,
    SWAPPINESS_FILE,
    ZRAM_SERVICE,
)

SWAPPINESS_MAX = 10
THERMAL_MARGIN_C = 10.0
DISK_FAIL = 256 * 2**20
DISK_WARN = 2 * 2**30
LOG_DIR = "/var/log"
JTOP_UNITS = (
    "/etc/systemd/system/jtop.service",
    "/lib/systemd/system/jtop.service",
    "/usr/lib/systemd/system/jtop.service",
)


def tune_fix(ctx: DoctorContext, setting: str, asked: bool, direct: str | None) -> str:
    """The fix through tune system (with the profile field when it does not ask yet).

    A built-in profile is not the user's to edit (an installed one is inside the
    package, replaced at the next upgrade): a field it lacks goes into a copy, which
    tune system is then given. ``direct``: the command that fixes the board at once,
    None where the board needs nothing now and only the profile does."""
    p = ctx.profile
    copy = builtin_copy(ctx)
    ref = p.name if p.source is None or copy is not None else str(p.source)
    if asked:
        step = ""
    elif copy is not None:
        ref = f"my-{p.name}.yaml"
        step = f"{setting} in {copy}, then "
    else:
        step = f"{setting} in the profile, then "
    at_once = f" (or at once: {direct})" if direct is not None else ""
    return f"{step}sudo orin-llm tune system --profile {ref} --apply{at_once}"


def builtin_copy(ctx: DoctorContext) -> str | None:
    """Where a setting of a built-in profile goes: a copy of it (an installed one is
    inside the package, replaced at the next upgrade); None for the user's own file."""
    p = ctx.profile
    if p.source is None or builtin_profiles().get(p.name) != p.source:
        return None
    return f"a copy of the built-in profile (cp {p.source} my-{p.name}.yaml)"


def not_jetson(check_id: str, what: str) -> Finding:
    return Finding(check_id, "info", f"not a Jetson: {what}")


def check_swappiness(ctx: DoctorContext) -> Finding:
    text = (ctx.root.read_text(SWAPPINESS_FILE) or "").strip()
    if not text.isdigit():
        return Finding("swappiness", "info", f"cannot read {SWAPPINESS_FILE}")
    value = int(text)
    if not ctx.platform.unified_memory:
        return Finding("swappiness", "ok", f"vm.swappiness = {value} (no unified memory here)")
    if value <= SWAPPINESS_MAX:
        return Finding("swappiness", "ok", f"vm.swappiness = {value}")
    asked = ctx.profile.system.swappiness
    target = asked if asked is not None and asked <= SWAPPINESS_MAX else SWAPPINESS_MAX
    return Finding(
        "swappiness",
        "warn",
        f"vm.swappiness = {value} on unified memory",
        why="the model's pages compete with everything else for the one DRAM; at this value "
        "the kernel swaps them out under pressure and the GPU stalls or cudaMalloc fails",
        fix=tune_fix(
            ctx,
            f"system.swappiness: {target}",
            asked == target,
            f"sudo sysctl -w vm.swappiness={target}",
        ),
    )


def check_zram(ctx: DoctorContext) -> Finding:
    """Compressed swap in RAM, now or at the next boot (JetPack's nvzramconfig).

    nvzramconfig.service is a oneshot with no ExecStop: stopping or disabling it
    leaves the swaps on until they are swapped off, and an enabled one sets them up
    again at every boot, so a board without zram now may have it after a reboot."""
    devices = ctx.platform.zram_devices
    jetson = ctx.platform.unified_memory
    if not devices:
        swaps = ", ".join(f"{s.path} ({s.kind})" for s in ctx.platform.swaps) or "no swap"
        service = unit_file_state(ctx.runner, ZRAM_SERVICE) if jetson else None
        if service != "enabled":
            return Finding("zram", "ok", f"no zram swap; {swaps}")
        return Finding(
            "zram",
            "warn",
            f"no zram swap now ({swaps}), but {ZRAM_SERVICE} is enabled: it sets zram swap "
            "up again at the next boot",
            why=ZRAM_WHY,
            fix=tune_fix(
                ctx,
                "system.disable_zram: true",
                ctx.profile.system.disable_zram,
                f"sudo systemctl disable {ZRAM_SERVICE}",
            ),
        )
    size = sum(d.size_bytes for d in devices) / 2**30
    found = f"{len(devices)} zram swap device(s), {size:.1f} GiB of compressed swap in RAM"
    if not jetson:
        return Finding("zram", "info", found)
    swapoff = f"sudo swapoff {' '.join(d.path for d in devices)}"
    # systemctl disable of a unit that is not installed fails, and `&&` would then skip the
    # swapoff; one that is disabled already sets nothing up at the next boot
    if unit_file_state(ctx.runner, ZRAM_SERVICE) == "enabled":
        swapoff = f"sudo systemctl disable {ZRAM_SERVICE} && {swapoff}"
    return Finding(
        "zram",
        "warn",
        found,
        why=ZRAM_WHY,
        fix=tune_fix(
            ctx,
            "system.disable_zram: true",
            ctx.profile.system.disable_zram,
            swapoff,
        )
        + "; use an NVMe swap file if you want swap",
    )


ZRAM_WHY = (
    "zram keeps swapped pages in the same DRAM the model and its KV cache need, and "
    "compressing them costs CPU time exactly when memory is short"
)


def check_numa(ctx: DoctorContext) -> Finding:
    nodes, strategy = ctx.platform.numa_nodes, ctx.profile.engine.numa
    found = f"{nodes} NUMA node(s), engine.numa={strategy}"
    if nodes == 1 and strategy != "disabled":
        return Finding(
            "numa",
            "info",
            found,
            why="llama.cpp's NUMA strategies place threads and memory across nodes; "
            "with one node they change nothing",
            fix="engine.numa: disabled",
        )
    return Finding("numa", "ok", found)


def check_power_mode(ctx: DoctorContext) -> Finding:
    """The power mode against the board's uncapped one: MAXN on the AGX Orin and the
    Orin NX (mode 0), but mode 0 is 15W on an Orin Nano, whose fastest mode is 15W
    before JetPack 6.2 and MAXN_SUPER (2) with it: the ids come from the board's own
    nvpmodel table."""
    p = ctx.platform
    if not p.is_jetson:
        return not_jetson("power-mode", "no nvpmodel power modes")
    mode = p.power_mode
    if mode is None:
        return Finding(
            "power-mode",
            "warn",
            "nvpmodel -q gave no answer",
            why="the power mode caps the GPU, CPU and memory clocks",
            fix="check that JetPack's nvpmodel is installed (package nvidia-l4t-nvpmodel): "
            "nvpmodel -q",
        )
    top = p.fastest_power_mode
    asked = ctx.profile.system.power_mode
    if top is None:  # no mode table: MAXN by name, or mode 0 (and "fastest" is unknown)
        fastest, top, top_name = mode.is_maxn, 0, "MAXN"
        setting, wants_top = f"system.power_mode: {top}", asked == top
    else:
        top_name = p.power_modes[top]
        fastest = mode.id == top if mode.id is not None else mode.name == top_name
        # the board's fastest by name: the same profile then suits every Orin module
        setting, wants_top = f"system.power_mode: {FASTEST}", asked in (FASTEST, top)
    if fastest and isinstance(asked, int) and not wants_top and asked in p.power_modes:
        # a profile written for an AGX Orin (0, MAXN there) would put an Orin Nano at 15W
        return Finding(
            "power-mode",
            "warn",
            f"power mode {mode.name} ({mode.id}), this board's fastest; the profile's "
            f"system.power_mode: {asked} would switch it to {p.power_modes[asked]}",
            why=f"below {top_name} the GPU and memory clocks are capped; decode is bound by "
            "memory bandwidth, so TPOT rises with the cap",
            fix=tune_fix(ctx, setting, False, None),
        )
    if fastest:
        return Finding("power-mode", "ok", f"power mode {mode.name} ({mode.id})")
    return Finding(
        "power-mode",
        "warn",
        f"power mode {mode.name} ({mode.id}), not {top_name} ({top}), this board's fastest",
        why=f"below {top_name} the GPU and memory clocks are capped; decode is bound by "
        "memory bandwidth, so TPOT rises with the cap",
        fix=tune_fix(ctx, setting, wants_top, f"sudo nvpmodel -m {top}"),
    )


def check_clocks(ctx: DoctorContext) -> Finding:
    p = ctx.platform
    if not p.is_jetson:
        return not_jetson("clocks", "no jetson_clocks")
    state = p.clocks
    if state is None or state.locked is None:
        return Finding(
            "clocks",
            "info",
            "unknown: jetson_clocks --show needs root and no GPU devfreq was found",
            fix="run sudo orin-llm doctor to check",
        )
    if state.locked and not state.complete:
        return Finding(
            "clocks",
            "info",
            f"GPU clock locked; CPU and EMC unknown ({state.source})",
            why="jetson_clocks --show, which shows CPU and EMC, needs root",
            fix="run sudo orin-llm doctor to check",
        )
    if state.locked:
        return Finding(
            "clocks",
            "ok",
            f"clocks locked: CPU and GPU at min = max, EMC pinned at its maximum ({state.source})",
        )
    return Finding(
        "clocks",
        "warn",
        f"clocks not locked: {', '.join(state.unlocked)} ({state.source})",
        why="frequency scaling ramps the clocks up at each request and down between them: "
        "slower first tokens and TPOT that swings under varying load (jetson_clocks pins "
        "CPU and GPU at min = max and EMC at its maximum through the BPMP override)",
        fix=_install_jetson_clocks(ctx)
        + tune_fix(
            ctx, "system.lock_clocks: true", ctx.profile.system.lock_clocks, "sudo jetson_clocks"
        )
        + _at_boot(ctx),
    )


def _at_boot(ctx: DoctorContext) -> str:
    """The lock is lost at every reboot: without orin-llm's boot-time tuning unit,
    whatever locked the clocks today leaves them unlocked after the next one."""
    if ctx.root.exists(f"{UNIT_DIR}/{TUNE_SERVICE}"):
        return ""
    return (
        f"; the lock does not survive a reboot: sudo orin-llm install adds {TUNE_SERVICE}, "
        "which applies the profile's system settings at every boot"
    )


def _install_jetson_clocks(ctx: DoctorContext) -> str:
    """The step before locking where the board has no jetson_clocks (a minimal image)."""
    if ctx.runner.which(JETSON_CLOCKS) is not None:
        return ""
    return f"{JETSON_CLOCKS} is not installed: sudo apt install nvidia-l4t-tools, then "


JETPACK6 = "JetPack 6 (L4T R36)"
REFLASH = (
    f"flash {JETPACK6} with NVIDIA SDK Manager (or the L4T flash scripts), then reinstall orin-llm"
)


def _release(ctx: DoctorContext) -> tuple[Severity, str, str, str]:
    """The L4T release against the supported one: (severity, found, why, fix)."""
    l4t = ctx.platform.l4t
    if l4t is None:
        text = ctx.root.read_text(RELEASE_FILE)
        if text is None:
            return "info", f"no {RELEASE_FILE}", "", ""
        first = text.strip().splitlines()[0][:80] if text.strip() else ""
        return (
            "warn",
            f"{RELEASE_FILE} names no L4T release ({first!r})",
            "the release decides which JetPack, CUDA and Python this board has; L4T writes "
            "its first line as '# R36 (release), REVISION: 4.3, ...'",
            "sudo apt install --reinstall nvidia-l4t-core (the package that writes it)",
        )
    found = f"L4T {l4t.version} (JetPack {l4t.jetpack or '?'})"
    if l4t.support == "supported":
        return "ok", found, "", ""
    if l4t.support == "newer":
        return "info", found + ", newer than JetPack 6", "orin-llm is tested on JetPack 6", ""
    if l4t.support == "old":
        why = (
            "JetPack 5 is not supported: its Python 3.8 is below orin-llm's 3.10 and its "
            "CUDA 11.4 is untested with this llama.cpp"
        )
        return "warn", found, why, REFLASH
    why = "this release predates JetPack 5 and does not support the Orin's GPU stack"
    return "fail", found, why, REFLASH


def _board(ctx: DoctorContext) -> tuple[Severity, str, str, str]:
    """The profile's board against the module found: (severity, found, why, fix)."""
    p, wanted = ctx.platform, ctx.profile.board
    mid = p.module_id
    name = p.module_name or p.model or "unknown module"
    found = name
    if mid is not None and mid.part:
        found += f" ({mid.part} from {mid.source}"
        if mid.device_tree:
            found += f"; the device tree names {mid.device_tree}"
        found += ")"
    if wanted == "any" or p.board == wanted:
        return "ok", found + (f", profile board {wanted}" if wanted != "any" else ""), "", ""
    have = p.board or "a module without a profile board value"
    found += f"; the profile is for {wanted}"
    smaller = wanted == "agx-orin-64gb"
    why = f"the profile's memory plan and power modes were chosen for {wanted}, this is {have}"
    if smaller:
        why += "; see memory-fit for whether the model fits"
    fix = (
        "a profile for this board (orin-llm profile list shows each one's board), or set "
        f"board: {p.board or 'any'} in the profile after memory-fit passes"
    )
    return ("warn" if smaller or p.board is None else "info"), found, why, fix


def check_board(ctx: DoctorContext) -> Finding:
    """Which module and release this is, against the profile's board and JetPack 6."""
    p = ctx.platform
    if not p.is_jetson:
        wanted = ctx.profile.board
        if wanted != "any":
            return Finding("board", "info", f"not a Jetson; the profile is for {wanted}")
        return not_jetson("board", "no module or JetPack release to check")
    parts = [_board(ctx), _release(ctx)]
    return Finding(
        "board",
        worst([s for s, *_ in parts]),
        "; ".join(f for _, f, _, _ in parts),
        why="; ".join(w for *_, w, _ in parts if w),
        fix="; ".join(f for *_, f in parts if f),
    )


def check_thermal(ctx: DoctorContext) -> Finding:
    """The zone closest to a throttling (or critical) trip point."""
    trips = [
        (z.name, z.temp_c, t)
        for z in ctx.platform.thermal
        if z.temp_c is not None
        for t in z.throttle_trips
    ]
    if not trips:
        return Finding("thermal", "info", "no thermal zone with a trip point")
    critical = [r for r in trips if r[2].type == "critical" and r[1] >= r[2].temp_c]
    name, temp, trip = critical[0] if critical else min(trips, key=lambda r: r[2].temp_c - r[1])
    found = f"{name} at {temp:.1f} C, {trip.type} trip at {trip.temp_c:.1f} C"
    if trip.type == "critical" and temp >= trip.temp_c:
        return Finding(
            "thermal",
            "fail",
            found,
            why="at its critical trip point the board shuts down",
            fix="cool the board (fan, airflow) before serving",
        )
    if trip.temp_c - temp <= THERMAL_MARGIN_C:
        return Finding(
            "thermal",
            "warn",
            found,
            why="near its trip point the kernel throttles the clocks: TTFT and TPOT grow",
            fix="improve cooling (fan at full speed: sudo jetson_clocks --fan) or lower the load",
        )
    return Finding("thermal", "ok", f"closest to a trip point: {found}")


def check_jtop(ctx: DoctorContext) -> Finding:
    if not ctx.platform.is_jetson:  # jetson-stats is for Jetsons; telemetry has no sysfs GPU
        return not_jetson("jtop", "jetson-stats does not apply")
    installed = any(ctx.root.exists(u) for u in JTOP_UNITS)
    if not installed:
        return Finding(
            "jtop",
            "info",
            "jetson-stats is not installed: telemetry reads the GPU load from sysfs",
            fix="optional: sudo pip3 install -U jetson-stats",
        )
    state = unit_active_state(ctx.runner, "jtop.service") or "unknown"
    if state == "active":
        return Finding("jtop", "ok", "jtop.service is active")
    return Finding(
        "jtop",
        "warn",
        f"jetson-stats is installed but jtop.service is {state}",
        why="jtop and the telemetry's jtop source need the service",
        fix="sudo systemctl restart jtop.service",
    )


def _existing(path: Path) -> Path:
    """The nearest existing folder: free space is a property of its filesystem."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_disk(ctx: DoctorContext) -> Finding:
    places = {"state": ctx.root.path(STATE_DIR), "logs": ctx.root.path(LOG_DIR)}
    if ctx.model_path is not None:
        places = {"models": ctx.model_path.parent, **places}
    free = {name: ctx.disk_free(_existing(p)) for name, p in places.items()}
    found = "; ".join(f"{n}: {free[n] / 2**30:.1f} GiB free ({places[n]})" for n in free)
    low = min(free.values())
    if low >= DISK_WARN:
        return Finding("disk", "ok", found)
    return Finding(
        "disk",
        "fail" if low < DISK_FAIL else "warn",
        found,
        why="a full disk stops the logs, the state file and model downloads",
        fix="free space on the filesystem named above (old models, journalctl --vacuum-size)",
    )


def check_port(ctx: DoctorContext) -> Finding:
    host, port = ctx.profile.server.host, ctx.profile.server.port
    problem = ctx.port_probe(host, port)
    if problem is None:
        return Finding("port", "ok", f"{host}:{port} is free")
    return Finding(
        "port",
        "warn",
        f"{host}:{port}: {problem}",
        why="serve cannot bind this address (expected if orin-llm is already serving there)",
        fix=f"stop what listens there (sudo ss -ltnp 'sport = :{port}') or set server.port",
    )
