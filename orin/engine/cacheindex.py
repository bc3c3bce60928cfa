"""The entries of one prompt cache directory, of every key: which are on disk, the disk
they take, when each was last used, and which go when the directory is over its bound.

Several processes may share a directory: files are replaced atomically, and
``refresh`` picks up what others wrote or removed (a save calls it before it
evicts, so the bound counts every process's entries). An entry whose sidecar
cannot be read now (an ``OSError``: EMFILE, ENOMEM, EIO, EACCES...) is kept on
disk, warned about once and read again after ``RETRY_S``; only one known to be
damaged, forged or of another user's making is deleted. Not thread-safe: the
engine's thread uses it, through ``PromptCache``.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from orin.engine.cachefiles import (
    ENTRY_NAME,
    MAX_SIDECAR_BYTES,
    SIDECAR_SUFFIX,
    STATE_SUFFIX,
    TEMP_PREFIX,
    Entry,
    OtherFormat,
    cannot_create,
    ensure_dir,
    parse_sidecar,
    read_trusted,
    untrusted,
    untrusted_dir,
    write_atomic,
)

log = logging.getLogger("orin.engine")

STALE_S = 600.0  # a temp or orphan file this old is a crashed writer's, not one in progress
RETRY_S = 30.0
"""Seconds before a state llama.cpp refused while other sequences held cells of the
shared KV buffer is offered again (the buffer may only have had no room for it then),
and before an entry whose files could not be read (too many open files, no memory, an
I/O error, a permission taken away) is read again."""


@dataclass
class CacheCounters:
    """Running totals for the engine's metrics."""

    hits: int = 0  # find/get answered with an entry
    misses: int = 0  # find/get found nothing
    saves: int = 0  # entries written
    loads: int = 0  # states restored into a sequence
    rejected: int = 0  # entries refused: failed verification or llama.cpp refused them
    evicted: int = 0  # entries removed to stay within max_bytes


class CacheIndex:
    """The entries of one directory, by name (``by_name``), whatever their key.

    A problem with the directory itself (it cannot be created, or someone else
    could write to it) is a warning once and ``problem`` says what: the index
    is then empty and stays so. ``clock`` stamps last-used times and times the
    reading again of a sidecar a passing error kept out.
    """

    def __init__(
        self, directory: Path, clock: Callable[[], float], counters: CacheCounters
    ) -> None:
        self.directory = directory
        self.clock = clock
        self.counters = counters  # rejected and evicted are counted here
        self.problem: str | None = None
        self.by_name: dict[str, Entry] = {}
        # sidecars a passing error kept out of the index, by name: when they are read again
        self._unread: dict[str, float] = {}
        # the last warning about a passing error, by entry name: said once, not each retry
        self._warned: dict[str, str] = {}
        self._touch_failed = False  # a last-use time could not be written: said once
        try:
            ensure_dir(self.directory)
        except OSError as exc:
            self._disable(cannot_create(self.directory, exc))
            return
        self.refresh()

    @property
    def total_bytes(self) -> int:
        """Disk the directory's entries take, every key's."""
        return sum(e.disk_bytes for e in self.by_name.values())

    def read(self, name: str) -> Entry:
        """The entry of ``name`` as its sidecar says now (raises what reading and
        ``parse_sidecar`` raise)."""
        data = read_trusted(self.directory / (name + SIDECAR_SUFFIX), MAX_SIDECAR_BYTES)
        return parse_sidecar(self.directory, name, data)

    def saved(self, entry: Entry) -> None:
        """Index an entry just written: the passing errors its name had are past."""
        self.by_name[entry.name] = entry
        self._unread.pop(entry.name, None)
        self._warned.pop(entry.name, None)

    def readable(self, name: str) -> None:
        """The files of ``name`` were read: a passing error about them is past, and the
        next one is a warning again."""
        self._warned.pop(name, None)

    def touch(self, entry: Entry) -> Entry:
        """Mark an entry used now, in memory and in its sidecar (best effort)."""
        used = replace(entry, last_used=self.used_now())
        data = used.sidecar()
        used = replace(used, sidecar_bytes=len(data))
        self.by_name[used.name] = used
        try:
            write_atomic(used.sidecar_path, data, self.temp_path(used.name + SIDECAR_SUFFIX))
        except OSError as exc:  # a read-only directory of prompts computed elsewhere, say
            level = logging.DEBUG if self._touch_failed else logging.WARNING
            self._touch_failed = True
            log.log(
                level,
                "prompt cache: cannot record the last use in %s: %s (said once)",
                used.sidecar_path,
                exc,
            )
        return used

    def used_now(self) -> float:
        """A last-used time after every entry's: the clock's, unless it is behind them
        (a board that starts at an old time until NTP sets it), when the entry just used
        must still be the most recent, not the first to be evicted."""
        newest = max((e.last_used for e in self.by_name.values()), default=0.0)
        return max(self.clock(), math.nextafter(newest, math.inf))

    def evict(self, keep: str, max_bytes: int) -> None:
        """The least recently used entries, of every key, but never ``keep``, go until
        the directory is within ``max_bytes``."""
        while self.total_bytes > max_bytes:
            victims = [e for e in self.by_name.values() if e.name != keep]
            if not victims:
                return
            victim = min(victims, key=lambda e: e.last_used)
            log.info(
                "prompt cache: evicting %s (%d tokens, %d bytes, least recently used)",
                victim.state_path,
                victim.n_tokens,
                victim.disk_bytes,
            )
            self.remove(victim)
            self.counters.evicted += 1

    def remove(self, entry: Entry, only_own: bool = False) -> None:
        self.by_name.pop(entry.name, None)
        self._remove_files(entry.name, only_own)

    def temp_path(self, final: str) -> Path:
        return self.directory / f"{TEMP_PREFIX}{final}.{os.getpid()}.{secrets.token_hex(4)}"

    def warn_once(self, name: str, path: Path, exc: OSError) -> None:
        """One warning for a passing error (the same one again at each retry is a debug
        line): the file is kept and read again after RETRY_S."""
        message = (
            f"prompt cache: cannot read {path}: {exc.strerror or exc}; "
            f"kept, trying it again in {RETRY_S:g} s"
        )
        level = logging.DEBUG if self._warned.get(name) == message else logging.WARNING
        self._warned[name] = message
        log.log(level, "%s", message)

    # -- the directory ----------------------------------------------------------------

    def refresh(self) -> None:
        """Read the directory again: entries other processes wrote or removed.

        A sidecar that fails its checks is skipped with a warning (and removed
        with its state file when this user owns it); one of another format
        version is left alone. Temporary and orphaned state files older than
        STALE_S, left by a writer that crashed, are removed.
        """
        if self.problem is not None:
            return
        reason = untrusted_dir(self.directory)
        if reason is not None:
            self._disable(reason)
            return
        index: dict[str, Entry] = {}
        names: set[str] = set()
        try:
            listing = list(os.scandir(self.directory))
        except OSError as exc:
            log.warning("prompt cache: cannot list %s: %s", self.directory, exc)
            return
        self._unread = {}
        for item in listing:
            stem, suffix = os.path.splitext(item.name)
            if suffix == SIDECAR_SUFFIX and ENTRY_NAME.match(stem):
                names.add(stem)
                entry = self._scan_one(stem)
                if entry is not None:
                    index[stem] = entry
        self.by_name = index
        for item in listing:
            stem, suffix = os.path.splitext(item.name)
            orphan = suffix == STATE_SUFFIX and ENTRY_NAME.match(stem) and stem not in names
            if orphan or item.name.startswith(TEMP_PREFIX):
                self._remove_stale(Path(item.path))

    def read_again(self) -> None:
        """Read the sidecars a passing error kept out of the index, once RETRY_S passed."""
        if not self._unread:
            return
        now = self.clock()
        for name in [n for n, due in self._unread.items() if due <= now]:
            del self._unread[name]
            entry = self._scan_one(name)
            if entry is not None:
                self.by_name[name] = entry
                self.readable(name)

    def _scan_one(self, name: str) -> Entry | None:
        sidecar = self.directory / (name + SIDECAR_SUFFIX)
        try:
            entry = self.read(name)
        except FileNotFoundError:
            return None
        except OtherFormat as exc:
            log.debug("prompt cache: leaving %s alone: %s", sidecar, exc)
            return None
        except OSError as exc:
            self._unread_now(name, sidecar, exc)
            return None
        except (ValueError, UnicodeDecodeError) as exc:
            log.warning("prompt cache: skipping %s: %s", sidecar, exc)
            self.counters.rejected += 1
            self._remove_files(name, only_own=True)
            return None
        try:
            st = entry.state_path.lstat()
        except FileNotFoundError:
            reason: str | None = "its state file is missing"
        except OSError as exc:
            self._unread_now(name, entry.state_path, exc)
            return None
        else:
            reason = untrusted(st) or (
                None
                if st.st_size == entry.state_bytes
                else f"its state file has {st.st_size} bytes, the sidecar says {entry.state_bytes}"
            )
        if reason is not None:
            log.warning("prompt cache: skipping %s: %s", sidecar, reason)
            self.counters.rejected += 1
            self.remove(entry, only_own=True)
            return None
        return entry

    def _unread_now(self, name: str, path: Path, exc: OSError) -> None:
        self._unread[name] = self.clock() + RETRY_S
        self.warn_once(name, path, exc)

    def _remove_files(self, name: str, only_own: bool) -> None:
        """The sidecar first: a reader never finds one without its state file."""
        for suffix in (SIDECAR_SUFFIX, STATE_SUFFIX):
            path = self.directory / (name + suffix)
            try:
                if only_own and path.lstat().st_uid != os.geteuid():
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("prompt cache: cannot remove %s: %s", path, exc)

    def _remove_stale(self, path: Path) -> None:
        try:
            st = path.lstat()
            if st.st_uid == os.geteuid() and self.clock() - st.st_mtime > STALE_S:
                path.unlink()
                log.info("prompt cache: removed %s, left by an interrupted save", path)
        except OSError:
            pass

    def _disable(self, reason: str) -> None:
        self.problem = f"{self.directory}: {reason}"
        self.by_name = {}
        log.warning("prompt cache disabled: %s", self.problem)
