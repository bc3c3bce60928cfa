"""The state file: what each applied setting replaced, so revert restores exactly that.

One JSON document (``/var/lib/orin-llm/state.json`` under the SysRoot) with an
entry per applied setting, in apply order. It is rewritten atomically after
every step of an apply or revert, so a crash half-way still leaves a record of
what was changed. An entry keeps the values from before orin-llm first touched
the setting: applying again (say, with another target) never overwrites them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from orin.errors import OrinError
from orin.system.root import SysRoot

DEFAULT_STATE_PATH = "/var/lib/orin-llm/state.json"
STATE_VERSION = 1


class StateError(OrinError):
    """The state file cannot be read or written."""


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

    def load(self) -> list[StateEntry]:
        """Entries in apply order; none when nothing was applied (no file)."""
        try:
            text = self.location.read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StateError(f"cannot read {self.location}: {exc.strerror or exc}") from exc
        try:
            data = json.loads(text)
            if data.get("version") != STATE_VERSION:
                raise ValueError(f"unknown version {data.get('version')!r}")
            return [StateEntry(**e) for e in data["settings"]]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StateError(
                f"{self.location} is not an orin-llm state file ({exc}); "
                "move it away only after restoring the settings it lists by hand"
            ) from exc

    def entries(self) -> dict[str, StateEntry]:
        return {e.setting: e for e in self.load()}

    def save(self, entries: list[StateEntry]) -> None:
        """Replace the file atomically; no entries left means no file."""
        path = self.location
        try:
            if not entries:
                path.unlink(missing_ok=True)
                return
            path.parent.mkdir(parents=True, exist_ok=True)
            doc = {"version": STATE_VERSION, "settings": [asdict(e) for e in entries]}
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
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
