"""The state file: what each applied setting replaced, so revert restores exactly that.

One JSON document (``/var/lib/orin-llm-root/state.json`` under the SysRoot) with
an entry per applied setting, in apply order. It is rewritten atomically after
every step of an apply or revert, so a crash half-way still leaves a record of
what was changed. An entry keeps the values from before orin-llm first touched
the setting: applying again (say, with another target) never overwrites them.

Root reads this state back (``tune system --apply/--revert``, the boot-time
tuning unit, ``uninstall --purge``), so it lives in a folder of root's own
(0700), apart from the service user's ``/var/lib/orin-llm``. It is read only
when nobody but root could have written it or any folder above it, and only
known keys with checked values are read: a value revert would pass to a
command or write to a file is never taken as raw text.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from orin.errors import OrinError
from orin.system.root import SysRoot

ROOT_STATE_DIR = "/var/lib/orin-llm-root"
DEFAULT_STATE_PATH = f"{ROOT_STATE_DIR}/state.json"
CLOCKS_STORE = f"{ROOT_STATE_DIR}/jetson_clocks.conf"  # jetson_clocks --store/--restore
# Root reads these back too (jetson_clocks --restore writes what the file says).
ROOT_FILES = (CLOCKS_STORE,)
# Where earlier versions kept the state: the service user's home, so never read.
LEGACY_STATE_PATH = "/var/lib/orin-llm/state.json"
STATE_DIR_MODE = 0o700
FILE_MODE = 0o600
PARENT_MODE = 0o755
STATE_VERSION = 2


class StateError(OrinError):
    """The state file cannot be read or written."""


class UnsafeStateError(StateError):
    """Root's state could have been written by another user, so it is not read."""


class StateAccessError(StateError):
    """The state file is root's and this user may not read it."""


@dataclass(frozen=True)
class StateEntry:
    setting: str
    target: str
    saved: dict[str, Any]
    applied_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat())


class StateFile:
    def __init__(self, root: SysRoot, path: str = DEFAULT_STATE_PATH) -> None:
        self.root = root
        self.system_path = path

    @property
    def location(self) -> Path:
        return self.root.path(self.system_path)

    @property
    def directory(self) -> str:
        return self.system_path.rsplit("/", 1)[0] or "/"

    def guard(self, system_path: str) -> None:
        """Refuse a path that anyone but root could have written (or replaced)."""
        try:
            reason = self.root.untrusted_reason(system_path)
        except PermissionError as exc:
            raise StateAccessError(
                f"cannot read {self.root.path(system_path)}: permission denied; run with sudo"
            ) from exc
        if reason is not None:
            raise UnsafeStateError(
                f"not reading {system_path}: {reason}. Root's tuning state must be root's "
                f"alone: check what {self.directory} holds, then "
                f"`chown -R root:root {self.directory} && chmod 0700 {self.directory}`"
            )

    def load(self) -> list[StateEntry]:
        """Entries in apply order; none when nothing was applied (no file)."""
        for path in (self.system_path, *ROOT_FILES):
            self.guard(path)
        try:
            fd = os.open(self.location, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            return []
        except PermissionError as exc:
            raise StateAccessError(
                f"cannot read {self.location}: permission denied; run with sudo"
            ) from exc
        except (OSError, UnicodeDecodeError) as exc:
            raise StateError(f"cannot read {self.location}: {exc}") from exc
        try:
            return parse_state(text)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateError(
                f"{self.location} is not an orin-llm state file ({exc}); "
                "move it away only after restoring the settings it lists by hand"
            ) from exc

    def legacy_present(self) -> bool:
        """A state file of an earlier orin-llm, in the service user's folder."""
        return self.system_path == DEFAULT_STATE_PATH and self.root.exists(LEGACY_STATE_PATH)

    def entries(self) -> dict[str, StateEntry]:
        return {e.setting: e for e in self.load()}

    def prepare(self) -> None:
        """Create root's state folder (0700; missing parents 0755) and check it."""
        try:
            _make_dirs(self.root, self.directory)
        except OSError as exc:
            raise StateError(f"cannot create {self.directory}: {exc.strerror or exc}") from exc
        self.guard(self.directory)
        os.chmod(self.root.path(self.directory), STATE_DIR_MODE)

    def seal(self) -> None:
        """Make the files root's commands leave in its folder (jetson_clocks --store) 0600.

        They are written with the umask of whoever ran the command; read back
        only when nobody else could have written them.
        """
        trusted = {0, self.root.trusted_uid}
        for path in ROOT_FILES:
            st = self.root.stat(path)
            if st is not None and stat.S_ISREG(st.st_mode) and st.st_uid in trusted:
                try:
                    os.chmod(self.root.path(path), FILE_MODE)
                except OSError as exc:
                    raise StateError(f"cannot chmod {path}: {exc.strerror or exc}") from exc

    def save(self, entries: list[StateEntry]) -> None:
        """Replace the file atomically; no entries left means no file."""
        path = self.location
        try:
            if not entries:
                path.unlink(missing_ok=True)
                return
            self.prepare()
            doc = {"version": STATE_VERSION, "settings": [asdict(e) for e in entries]}
            tmp = path.with_name(path.name + ".tmp")
            tmp.unlink(missing_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(doc, indent=2) + "\n")
            os.replace(tmp, path)
        except OSError as exc:
            raise StateError(f"cannot write {path}: {exc.strerror or exc}") from exc

    def record(self, entry: StateEntry) -> None:
        """Add a setting's entry, keeping the first saved values of one already there."""
        entries = self.load()
        for i, old in enumerate(entries):
            if old.setting == entry.setting:
                entries[i] = StateEntry(old.setting, entry.target, old.saved, old.applied_at)
                break
        else:
            entries.append(entry)
        self.save(entries)

    def forget(self, setting: str) -> None:
        self.save([e for e in self.load() if e.setting != setting])


def _make_dirs(root: SysRoot, system_path: str) -> None:
    """mkdir -p with explicit modes, so the umask cannot make a folder group-writable."""
    parts = system_path.strip("/").split("/")
    for depth in range(1, len(parts) + 1):
        current = "/" + "/".join(parts[:depth])
        last = depth == len(parts)
        target = root.path(current)
        try:
            os.mkdir(target, STATE_DIR_MODE if last else PARENT_MODE)
        except FileExistsError:
            continue
        os.chmod(target, STATE_DIR_MODE if last else PARENT_MODE)


# -- reading: known keys, checked values ---------------------------------------------

_TEXT = re.compile(r"^[^\x00-\x1f\x7f]{0,200}$")
_NAME = re.compile(r"^[A-Za-z0-9_ .+()-]{1,64}$")
_UNIT_STATE = re.compile(r"^[a-z-]{1,32}$")
_ZRAM = re.compile(r"^/dev/zram[0-9]{1,3}$")
ENTRY_KEYS = frozenset({"setting", "target", "saved", "applied_at"})


def parse_state(text: str) -> list[StateEntry]:
    """The entries of a state document; ValueError names the first thing that is off."""
    data = json.loads(text)
    if not isinstance(data, dict) or set(data) != {"version", "settings"}:
        raise ValueError("expected exactly the keys version and settings")
    if data["version"] != STATE_VERSION:
        raise ValueError(f"unknown version {data['version']!r}")
    if not isinstance(data["settings"], list):
        raise ValueError("settings is not a list")
    entries = [parse_entry(e) for e in data["settings"]]
    if len({e.setting for e in entries}) != len(entries):
        raise ValueError("a setting is listed twice")
    return entries


def parse_entry(raw: object) -> StateEntry:
    if not isinstance(raw, dict) or set(raw) != ENTRY_KEYS:
        raise ValueError(f"an entry must have exactly the keys {', '.join(sorted(ENTRY_KEYS))}")
    setting = raw["setting"]
    check = SAVED_SCHEMAS.get(setting) if isinstance(setting, str) else None
    if check is None:
        raise ValueError(f"unknown setting {setting!r}")
    target, applied_at = _text(raw["target"], "target"), _text(raw["applied_at"], "applied_at")
    datetime.fromisoformat(applied_at)
    saved = raw["saved"]
    if not isinstance(saved, dict):
        raise ValueError(f"{setting}: saved is not an object")
    return StateEntry(setting, target, check(saved), applied_at)


def _keys(saved: Mapping[str, Any], setting: str, keys: set[str]) -> None:
    if set(saved) != keys:
        raise ValueError(f"{setting}: saved must have exactly the keys {', '.join(sorted(keys))}")


def _int(value: object, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer from {lo} to {hi}, not {value!r}")
    return value


def _bool(value: object, name: str, optional: bool = False) -> bool | None:
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, not {value!r}")
    return value


def _text(value: object, name: str, pattern: re.Pattern[str] = _TEXT) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise ValueError(f"{name} is not an accepted value: {value!r}")
    return value


def _swappiness(saved: Mapping[str, Any]) -> dict[str, Any]:
    _keys(saved, "swappiness", {"value", "sysctl_swappiness"})
    persisted = saved["sysctl_swappiness"]
    return {
        "value": _int(saved["value"], "swappiness value", 0, 200),
        "sysctl_swappiness": None
        if persisted is None
        else _int(persisted, "swappiness sysctl_swappiness", 0, 200),
    }


def _zram(saved: Mapping[str, Any]) -> dict[str, Any]:
    _keys(saved, "zram", {"service", "devices"})
    service = saved["service"]
    devices = saved["devices"]
    if not isinstance(devices, list) or len(devices) > 64:
        raise ValueError("zram devices must be a list")
    checked = []
    for dev in devices:
        if not isinstance(dev, dict) or set(dev) != {"path", "priority"}:
            raise ValueError("a zram device must have exactly the keys path and priority")
        checked.append(
            {
                "path": _text(dev["path"], "zram device path", _ZRAM),
                "priority": _int(dev["priority"], "zram priority", -1, 32767),
            }
        )
    return {
        "service": None if service is None else _text(service, "zram service", _UNIT_STATE),
        "devices": checked,
    }


def _power_mode(saved: Mapping[str, Any]) -> dict[str, Any]:
    _keys(saved, "power-mode", {"mode_id", "name", "clocks_locked"})
    return {
        "mode_id": _int(saved["mode_id"], "power-mode mode_id", 0, 63),
        "name": _text(saved["name"], "power-mode name", _NAME),
        "clocks_locked": _bool(saved["clocks_locked"], "power-mode clocks_locked", True),
    }


def _clocks(saved: Mapping[str, Any]) -> dict[str, Any]:
    _keys(saved, "clocks", {"store", "stored_before"})
    if saved["store"] != CLOCKS_STORE:
        raise ValueError(f"clocks store must be {CLOCKS_STORE}, not {saved['store']!r}")
    return {"store": CLOCKS_STORE, "stored_before": _bool(saved["stored_before"], "stored_before")}


SAVED_SCHEMAS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "swappiness": _swappiness,
    "zram": _zram,
    "power-mode": _power_mode,
    "clocks": _clocks,
}
