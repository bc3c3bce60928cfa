"""Board settings for serving on unified memory, each with plan / apply / revert.

A setting's ``plan`` reads the board and returns a Change: the current value,
the target, the exact steps (file writes, command lines) and what revert
needs to restore the current value. ``apply`` runs the steps; ``revert``
restores the saved values. Plans only read, so they can be printed before
anything changes, and a setting already at its target plans no steps, which
is what makes applying twice a no-op. Orchestration (root check, state file,
rollback on failure) lives in ``orin.system.changes``.

Settings plan against ``BoardSettings``, plain values a caller builds from a
profile (``orin.profile.board.board_settings``): the board layer sits below
the profiles and never imports them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from orin.errors import OrinError
from orin.system.actions import Action, StepError, execute_all
from orin.system.commands import CommandRunner
from orin.system.loadmode import LoadSettings, mmap_policy
from orin.system.platform import Platform, parse_swaps, query_power_mode
from orin.system.root import SysRoot
from orin.system.services import unit_file_state
from orin.system.statefile import CLOCKS_STORE as CLOCKS_STORE
from orin.system.statefile import ROOT_STATE_DIR

SWAPPINESS_FILE = "/proc/sys/vm/swappiness"
SYSCTL_FILE = "/etc/sysctl.d/99-orin-llm.conf"
DROP_CACHES_FILE = "/proc/sys/vm/drop_caches"
SWAPS_FILE = "/proc/swaps"
# Root's own folder (0700), never the service user's /var/lib/orin-llm: root reads
# the clocks store back (orin.system.statefile).
STATE_DIR = ROOT_STATE_DIR
ZRAM_SERVICE = "nvzramconfig"
JETSON_CLOCKS = "jetson_clocks"
NVPMODEL_ANSWER = "no\n"  # nvpmodel may ask to reboot; never reboot from here


class SettingError(OrinError):
    """A setting cannot be planned as the profile asks (e.g. a power mode the board lacks)."""


@dataclass(frozen=True)
class Change:
    setting: str
    current: str
    target: str
    actions: tuple[Action, ...] = ()
    saved: dict[str, Any] = field(default_factory=dict)  # what revert restores
    note: str = ""
    revertible: bool = True

    @property
    def needed(self) -> bool:
        return bool(self.actions)

    def to_dict(self) -> dict[str, Any]:
        return {
            "setting": self.setting,
            "current": self.current,
            "target": self.target,
            "needed": self.needed,
            "revertible": self.revertible,
            "note": self.note,
            "actions": [a.to_dict() for a in self.actions],
        }


FASTEST = "fastest"
"""``system.power_mode``'s name for the board's fastest mode, whatever its id: MAXN (0)
on an AGX Orin or an Orin NX, 15W (0) or MAXN_SUPER (2) on an Orin Nano."""


@dataclass(frozen=True)
class BoardSettings:
    """What a profile asks of the board, as plain values; the defaults change nothing."""

    swappiness: int | None = None  # system.swappiness; None = leave unchanged
    disable_zram: bool = False  # system.disable_zram
    # system.power_mode: an nvpmodel id, FASTEST (the board's fastest mode, from its own
    # nvpmodel table), or None = unchanged
    power_mode: int | str | None = None
    lock_clocks: bool = False  # system.lock_clocks
    drop_caches: bool = False  # system.drop_caches
    numa: str = "disabled"  # engine.numa, reported against the NUMA nodes
    load: LoadSettings = field(default_factory=LoadSettings)  # for the mmap report


@dataclass(frozen=True)
class BoardContext:
    """What every setting plans against; ``recorded`` is the state file's saved values."""

    root: SysRoot
    runner: CommandRunner
    platform: Platform
    settings: BoardSettings
    n_layer: int | None = None
    gpu_offload: bool | None = None
    recorded: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


class Setting(ABC):
    id: ClassVar[str]

    @abstractmethod
    def plan(self, ctx: BoardContext) -> Change: ...

    def apply(self, ctx: BoardContext, change: Change) -> None:
        execute_all(change.actions, ctx.root, ctx.runner)

    def revert_actions(self, ctx: BoardContext, saved: Mapping[str, Any]) -> tuple[Action, ...]:
        """The steps that put back what ``saved`` recorded; none for report-only settings."""
        return ()

    def revert(self, ctx: BoardContext, saved: Mapping[str, Any]) -> None:
        execute_all(self.revert_actions(ctx, saved), ctx.root, ctx.runner)

    def describe_saved(self, saved: Mapping[str, Any]) -> str:
        """The value revert restores, for the revert plan."""
        return "as before"

    def report(self, current: str, target: str, note: str) -> Change:
        return Change(self.id, current, target, note=note)


SYSCTL_KEY = "vm.swappiness"


def sysctl_text(swappiness: int, restored: bool = False) -> str:
    """The sysctl.d file, always built from a number, never from text read back."""
    head = (
        "# restored by orin-llm tune system --revert"
        if restored
        else "# written by orin-llm tune system; removed by --revert"
    )
    return f"{head}\n{SYSCTL_KEY} = {int(swappiness)}\n"


def sysctl_swappiness(text: str | None) -> int | None:
    """The vm.swappiness a sysctl.d file sets; None for no file or no such line.

    Revert rewrites the file from this number alone, so a file that also sets
    anything else is refused before orin-llm replaces it.
    """
    value = None
    for line in (text or "").splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        key, sep, rest = line.partition("=")
        if sep and key.strip() == SYSCTL_KEY and rest.strip().isdigit():
            value = int(rest.strip())
            continue
        raise SettingError(
            f"swappiness: {SYSCTL_FILE} sets more than {SYSCTL_KEY} ({line!r}); orin-llm "
            "owns this file: move the other settings to another file in /etc/sysctl.d"
        )
    return value


class Swappiness(Setting):
    """vm.swappiness now (/proc) and at boot (/etc/sysctl.d)."""

    id = "swappiness"

    def plan(self, ctx: BoardContext) -> Change:
        current = (ctx.root.read_text(SWAPPINESS_FILE) or "").strip()
        target = ctx.settings.swappiness
        if not current.isdigit():
            return self.report("unknown", "-", f"cannot read {SWAPPINESS_FILE}")
        if target is None:
            return self.report(current, current, "the profile leaves vm.swappiness unchanged")
        persisted = ctx.root.read_text(SYSCTL_FILE)
        actions = []
        if current != str(target):
            actions.append(Action.write(SWAPPINESS_FILE, f"{target}\n"))
        if persisted != sysctl_text(target):
            actions.append(Action.write(SYSCTL_FILE, sysctl_text(target)))
        return Change(
            self.id,
            current,
            str(target),
            tuple(actions),
            saved={"value": int(current), "sysctl_swappiness": sysctl_swappiness(persisted)},
            note=f"set now and persisted in {SYSCTL_FILE}: a high value pushes the model's "
            "pages to swap under memory pressure",
        )

    def revert_actions(self, ctx: BoardContext, saved: Mapping[str, Any]) -> tuple[Action, ...]:
        """Only numbers reach the files: the state file's values were checked on load."""
        previous = saved.get("sysctl_swappiness")
        persist = (
            Action.remove(SYSCTL_FILE)
            if previous is None
            else Action.write(SYSCTL_FILE, sysctl_text(int(previous), restored=True))
        )
        return (Action.write(SWAPPINESS_FILE, f"{int(saved['value'])}\n"), persist)

    def describe_saved(self, saved: Mapping[str, Any]) -> str:
        previous = saved.get("sysctl_swappiness")
        persisted = "no sysctl.d file" if previous is None else f"sysctl.d file with {previous}"
        return f"{saved['value']} ({persisted})"


class Zram(Setting):
    """Compressed swap in RAM (JetPack's nvzramconfig): report, optionally disable."""

    id = "zram"

    def plan(self, ctx: BoardContext) -> Change:
        devices = ctx.platform.zram_devices
        size = sum(d.size_bytes for d in devices) / 2**30
        service = unit_file_state(ctx.runner, ZRAM_SERVICE) if ctx.platform.is_jetson else None
        current = f"{len(devices)} zram swap device(s), {size:.1f} GiB; {ZRAM_SERVICE} " + (
            service or "not installed"
        )
        if not ctx.settings.disable_zram:
            return self.report(current, "unchanged", "set system.disable_zram: true to disable")
        actions = []
        if service == "enabled":
            actions.append(Action.run("systemctl", "disable", "--now", ZRAM_SERVICE))
        actions += [Action.run("swapoff", d.path) for d in devices]
        return Change(
            self.id,
            current,
            f"no zram swap; {ZRAM_SERVICE} disabled",
            tuple(actions),
            saved={
                "service": service,
                "devices": [{"path": d.path, "priority": d.priority} for d in devices],
            },
            note="zram takes its compressed pages from the same DRAM the model needs",
        )

    def revert_actions(self, ctx: BoardContext, saved: Mapping[str, Any]) -> tuple[Action, ...]:
        """Swap on each saved device that is not on now: /proc/swaps is read again here,
        since an apply that failed half-way (or a swapon by hand) left some devices on,
        and swapon of an active device fails (EBUSY).

        After a reboot with nvzramconfig disabled the devices are not set up at all
        (no zram module, or no size), so there is nothing to swap on: the service,
        started again, sets every one up as it does at boot."""
        active = {d.path for d in parse_swaps(ctx.root.read_text(SWAPS_FILE) or "")}
        actions = []
        if saved.get("service") == "enabled":
            devices = [dev["path"] for dev in saved.get("devices", [])]
            if not all(zram_set_up(ctx.root, path) for path in devices):
                return (Action.run("systemctl", "enable", "--now", ZRAM_SERVICE),)
            actions.append(Action.run("systemctl", "enable", ZRAM_SERVICE))
        for dev in saved.get("devices", []):
            if dev["path"] not in active:
                actions.append(Action.run("swapon", "-p", str(dev["priority"]), dev["path"]))
        return tuple(actions)

    def describe_saved(self, saved: Mapping[str, Any]) -> str:
        service = saved.get("service") or "not installed"
        return f"{len(saved.get('devices', []))} zram swap device(s); {ZRAM_SERVICE} {service}"


def zram_set_up(root: SysRoot, device: str) -> bool:
    """Whether a zram device exists with a size (``/sys/block/zramN/disksize``), as
    nvzramconfig leaves it: swapoff keeps it so, a reboot does not."""
    size = (root.read_text(f"/sys/block/{device.rpartition('/')[2]}/disksize") or "").strip()
    return size.isdigit() and int(size) > 0


class PowerModeSetting(Setting):
    """nvpmodel mode (0 = MAXN on the AGX Orin and the Orin NX, not on an Orin Nano);
    verified after the switch, which may need a reboot."""

    id = "power-mode"

    def plan(self, ctx: BoardContext) -> Change:
        p, asked = ctx.platform, ctx.settings.power_mode
        mode = p.power_mode
        current = f"{mode.name} ({mode.id})" if mode else "unknown"
        if not p.is_jetson:
            return self.report("not a Jetson", "-", "no nvpmodel on this machine")
        if asked is None:
            return self.report(current, current, "the profile leaves the power mode unchanged")
        if mode is None:
            return self.report(current, str(asked), "nvpmodel -q gave no answer: skipped")
        target = _target(ctx)
        if target is None:
            return self.report(
                current,
                FASTEST,
                "this board's fastest mode is unknown (its nvpmodel modes name neither "
                "MAXN nor a wattage, and the module's table is not known): skipped; set "
                "system.power_mode to a mode id",
            )
        if p.power_modes and target not in p.power_modes:
            modes = ", ".join(f"{i} {n}" for i, n in sorted(p.power_modes.items()))
            raise SettingError(f"power-mode: this board has no mode {target} (modes: {modes})")
        name = p.power_modes.get(target, f"mode {target}")
        actions = () if mode.id == target else (power_mode_action(target),)
        locked = p.clocks.locked if p.clocks else None
        note = (
            "already in this mode"
            if not actions
            else "a lower mode caps GPU and memory clocks; a switch may need a reboot"
            " and resets clocks that jetson_clocks locked"
        )
        top = p.fastest_power_mode
        if asked == FASTEST:
            note += "; system.power_mode: fastest"
        elif top is not None and top != target:  # mode 0 is 15W on an Orin Nano
            note += (
                f"; {name} ({target}) is not this board's fastest mode: that is "
                f"{p.power_modes[top]} (system.power_mode: {top})"
            )
        return Change(
            self.id,
            current,
            f"{name} ({target})",
            actions,
            saved={"mode_id": mode.id, "name": mode.name, "clocks_locked": locked},
            note=note,
        )

    def apply(self, ctx: BoardContext, change: Change) -> None:
        super().apply(ctx, change)
        target = _target(ctx)
        now = query_power_mode(ctx.runner)
        if change.actions and (now is None or now.id != target):
            seen = f"{now.name} ({now.id})" if now else "no answer from nvpmodel -q"
            # nvpmodel took the mode and applies it at the next boot: the setting is
            # rolled back (nvpmodel -m OLD), so no reboot switches the board unrecorded
            raise StepError(
                change.actions[0],
                f"the mode did not change ({seen}); it may need a reboot",
                completed=True,
            )

    def revert_actions(self, ctx: BoardContext, saved: Mapping[str, Any]) -> tuple[Action, ...]:
        actions = [power_mode_action(int(saved["mode_id"]))]
        if saved.get("clocks_locked"):
            actions.append(Action.run("jetson_clocks"))  # a mode switch resets the clocks
        return tuple(actions)

    def describe_saved(self, saved: Mapping[str, Any]) -> str:
        return f"{saved['name']} ({saved['mode_id']})"


def _target(ctx: BoardContext) -> int | None:
    """The mode id ``system.power_mode`` asks for: FASTEST is the board's fastest mode
    (None where its nvpmodel table is unknown)."""
    asked = ctx.settings.power_mode
    if asked == FASTEST:
        return ctx.platform.fastest_power_mode
    return None if asked is None else int(asked)


def power_mode_action(mode_id: int) -> Action:
    return Action.run("nvpmodel", "-m", str(mode_id), input=NVPMODEL_ANSWER)


class Clocks(Setting):
    """jetson_clocks: CPU, GPU and EMC pinned at the mode's maximum."""

    id = "clocks"

    def plan(self, ctx: BoardContext) -> Change:
        p = ctx.platform
        if not p.is_jetson:
            return self.report("not a Jetson", "-", "no jetson_clocks on this machine")
        state = p.clocks
        locked = state.locked if state else None
        current = {True: "locked", False: "not locked", None: "unknown"}[locked]
        if state is not None and state.unlocked:
            current += f" ({', '.join(state.unlocked)})"
        if not ctx.settings.lock_clocks:
            return self.report(current, "unchanged", "set system.lock_clocks: true to lock")
        if ctx.runner.which(JETSON_CLOCKS) is None:  # as nvpmodel's absence skips the mode
            return self.report(
                current,
                "locked",
                f"{JETSON_CLOCKS} is not installed (JetPack's nvidia-l4t-tools package "
                "provides it): skipped",
            )
        if locked and state is not None and state.complete and not _power_mode_changes(ctx):
            # Locked by someone else (jtop, a boot script): nothing stored, so revert
            # leaves their lock alone.
            return Change(
                self.id, current, "locked", note=f"already locked ({state.source}): no steps"
            )
        actions = [Action.run("jetson_clocks")]
        stored_before = "clocks" in ctx.recorded  # keep what was stored before the first lock
        if not stored_before:
            actions[:0] = [
                Action.mkdir(STATE_DIR),
                Action.run("jetson_clocks", "--store", _store(ctx.root)),
            ]
        return Change(
            self.id,
            current,
            "locked",
            tuple(actions),
            saved={"store": CLOCKS_STORE, "stored_before": stored_before},
            note="no frequency ramp at each request: steadier TTFT and TPOT",
        )

    def revert_actions(self, ctx: BoardContext, saved: Mapping[str, Any]) -> tuple[Action, ...]:
        """jetson_clocks runs only once the store is written: an apply stopped before
        that left no store and no lock, so there is only the entry to clear."""
        if not saved.get("stored_before") and not ctx.root.exists(CLOCKS_STORE):
            return (Action.remove(CLOCKS_STORE),)
        restore = Action.run("jetson_clocks", "--restore", _store(ctx.root))
        if saved.get("stored_before"):  # a rolled-back re-apply: the first apply's file stays
            return (restore,)
        return (restore, Action.remove(CLOCKS_STORE))

    def describe_saved(self, saved: Mapping[str, Any]) -> str:
        return f"as stored in {saved['store']}"


def _store(root: SysRoot) -> str:
    return str(root.path(CLOCKS_STORE))


def _power_mode_changes(ctx: BoardContext) -> bool:
    """A mode switch resets the clocks, so a lock taken before it does not last.

    The mode id the profile asks for, not its words: ``fastest`` on a board already in
    its fastest mode switches nothing, and the lock found there stays someone else's."""
    target, mode = _target(ctx), ctx.platform.power_mode
    return target is not None and mode is not None and mode.id != target


class Numa(Setting):
    """llama.cpp's NUMA strategy against the nodes the kernel really has."""

    id = "numa"

    def plan(self, ctx: BoardContext) -> Change:
        nodes, strategy = ctx.platform.numa_nodes, ctx.settings.numa
        if nodes == 1 and strategy != "disabled":
            note = (
                f"one NUMA node: numa={strategy} changes nothing here; "
                "set engine.numa: disabled to say so"
            )
        elif nodes == 1:
            note = "one NUMA node: nothing to do"
        else:
            note = f"the engine passes numa={strategy} to llama_numa_init at model load"
        return self.report(f"{nodes} node(s)", f"engine.numa={strategy}", note)


class Mmap(Setting):
    """Report of the load mode the engine will use (the engine applies it at load)."""

    id = "mmap"

    def plan(self, ctx: BoardContext) -> Change:
        load = ctx.settings.load
        d = mmap_policy(load, ctx.platform.unified_memory, ctx.n_layer, ctx.gpu_offload)
        current = f"engine.load_mode={load.load_mode}, system.mmap={load.mmap}"
        return self.report(current, f"load_mode={d.load_mode}", d.reason)


class DropCaches(Setting):
    """Drop the clean page cache before a model load (one-shot, nothing to revert)."""

    id = "drop-caches"

    def plan(self, ctx: BoardContext) -> Change:
        if not ctx.settings.drop_caches:
            return self.report("-", "unchanged", "set system.drop_caches: true to drop")
        return Change(
            self.id,
            "page cache in use",
            "page cache dropped",
            drop_cache_actions(),
            note="one-shot on every apply; not revertible (nothing to restore)",
            revertible=False,
        )


def drop_cache_actions() -> tuple[Action, ...]:
    return (Action.run("sync"), Action.write(DROP_CACHES_FILE, "3\n"))


def drop_page_cache(root: SysRoot, runner: CommandRunner) -> None:
    """For a model load: flush dirty pages, then free the clean page cache (root only)."""
    execute_all(drop_cache_actions(), root, runner)


# Apply order: the power mode before the clocks (a mode switch resets them),
# the page cache last (just before a load). Revert runs in reverse.
SETTINGS: tuple[Setting, ...] = (
    Swappiness(),
    Zram(),
    PowerModeSetting(),
    Clocks(),
    Numa(),
    Mmap(),
    DropCaches(),
)
SETTINGS_BY_ID = {s.id: s for s in SETTINGS}
