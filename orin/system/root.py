"""One injectable filesystem root for everything orin-llm reads from the system.

Production code uses ``SysRoot(Path("/"))``; tests build a fake Orin tree under
a temporary directory and pass that instead. No path to /proc, /sys or /etc is
opened anywhere else.

Root's own files (the tuning state) are only trusted when nobody else can
have written them: ``untrusted_reason`` checks the file and every folder above
it, up to the root of the tree. The owner that counts as root is the owner of
the tree's top folder: uid 0 for ``/``, the test's own uid for a fake tree, so
the same check runs as root and as a normal user.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


@dataclass(frozen=True)
class SysRoot:
    base: Path = Path("/")

    def path(self, system_path: str) -> Path:
        """Map an absolute system path such as ``/proc/meminfo`` under this root."""
        rel = PurePosixPath(system_path)
        if rel.is_absolute():
            rel = rel.relative_to("/")
        return self.base / rel

    def read_text(self, system_path: str) -> str | None:
        """The file's text, or None when it is missing or unreadable."""
        try:
            return self.path(system_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    def exists(self, system_path: str) -> bool:
        return self.path(system_path).exists()

    def stat(self, system_path: str) -> os.stat_result | None:
        """``lstat`` of the path (a symbolic link is not followed); None when missing."""
        try:
            return self.path(system_path).lstat()
        except FileNotFoundError:
            return None

    @property
    def trusted_uid(self) -> int:
        """The owner that stands for root: the owner of the tree's top folder."""
        return self.base.stat().st_uid

    def untrusted_reason(self, system_path: str) -> str | None:
        """Why another user could have written this path, or None when only root can.

        The path (when it exists) and every folder above it up to the top of
        the tree must be owned by root (see ``trusted_uid``), not be writable by
        group or others, and not be a symbolic link.
        """
        trusted = {0, self.trusted_uid}
        parts = PurePosixPath("/", system_path).parts
        for depth in range(len(parts), 1, -1):
            current = str(PurePosixPath(*parts[:depth]))
            st = self.stat(current)
            if st is None:
                continue
            if stat.S_ISLNK(st.st_mode):
                return f"{current} is a symbolic link"
            if (why := _written_by_others(current, st, trusted)) is not None:
                return why
        return None


def _written_by_others(
    path: object, st: os.stat_result, trusted: set[int], sticky_ok: bool = False
) -> str | None:
    """Why another user than ``trusted`` could write ``path`` (its stat ``st``): its
    owner, or its group or other write bit (with ``sticky_ok``, not on a folder with
    the sticky bit, whose files nobody else can replace)."""
    if st.st_uid not in trusted:
        return f"{path} is owned by uid {st.st_uid}, not root"
    sticky_dir = sticky_ok and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    if st.st_mode & GROUP_OR_OTHER_WRITE and not sticky_dir:
        return f"{path} is writable by group or others (mode {st.st_mode & 0o7777:04o})"
    return None


def untrusted_file(path: Path) -> str | None:
    """Why another user could have written a file root is asked to read (a profile
    named on root's command line), or None when only this process's user can.

    The file and every folder above it must be owned by root or by this process's
    real user (root under sudo; the test's user in tests that fake the effective
    uid), and none may be writable by group or others, save a folder with the sticky
    bit (/tmp), whose files nobody else can replace. A symbolic link is followed,
    and the file it names is what is checked."""
    trusted = {0, os.getuid()}
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        return f"{path} cannot be resolved ({exc})"
    for current in (target, *target.parents):
        if (why := _written_by_others(current, current.stat(), trusted, True)) is not None:
            return why
    return None
