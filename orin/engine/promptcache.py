"""The persistent prompt cache: KV state of system prompts, saved to disk and restored.

A profile names system prompts; once their cells are computed, llama.cpp's
``llama_state_seq_save_file`` writes the sequence's KV state to a file and a
JSON sidecar records what it holds. A restarted server loads the state into a
sequence with ``llama_state_seq_load_file`` instead of recomputing the prompt.

A saved state is only valid for the model file and the context it came from:
its files are named after a ``CacheKey`` of both (``cachekey``), so a state
of another model or context is never considered.

Nothing is loaded on trust. Before llama.cpp reads a state file the sidecar
must parse, carry this key and name the tokens its own file name derives
from; the state file must be a regular file owned by this user or root and
not writable by group or others (nothing that runs as root reads a file
another user can write), and its size and SHA-256 must match the sidecar's.
The file is opened once and llama.cpp reads that very file through
``/proc/self/fd``, so what was checked is what is loaded. A failure is a
warning naming the file and the reason; the sequence is left empty. A state
llama.cpp refused is not offered again (``find``, ``get``) until a save of its
prompt replaces it, so a refusal costs one failed load and its warning; unless
other sequences held cells of the KV buffer it shares with them (``kv_unified``),
when it may only have found no free cells: that state is offered again after
``RETRY_S``. Only an entry known to be damaged, forged or of another user's
making is deleted: one whose files cannot be read now (an ``OSError``: EMFILE,
ENOMEM, EIO, EACCES...) is kept, warned about once and read again after
``RETRY_S``.

All llama.cpp calls belong to the engine thread, so ``PromptCache`` is not
thread-safe: one thread (the engine's) uses it. Several processes may share
a directory: files are replaced atomically (``cachefiles``), each load re-reads
the sidecar, and the directory's index (``cacheindex``) picks up what others
wrote, so the size bound counts every process's entries.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from orin.engine.cachefiles import (
    FILE_MODE,
    SIDECAR_SUFFIX,
    STATE_SUFFIX,
    Entry,
    OtherFormat,
    exists,
    open_file,
    synced,
    verify_state,
    write_atomic,
)
from orin.engine.cacheindex import RETRY_S, CacheCounters, CacheIndex
from orin.engine.cachekey import CacheKey, entry_name
from orin.llamacpp import capture_log, reported_by_caller

log = logging.getLogger("orin.engine")


class KVHandles(Protocol):
    """What the cache needs of the llama.cpp context: ``Backend`` has all three."""

    @property
    def lib(self) -> Any: ...

    @property
    def ctx(self) -> Any: ...

    @property
    def memory(self) -> Any: ...


class PromptCache:
    """Saved prompts of one directory, matched and loaded for one ``CacheKey``.

    ``max_bytes`` bounds the directory's entries of every key together: the
    least recently used go first, those of other keys (an older model, other
    KV types) included, so stale entries make room. A problem with the
    directory itself (it cannot be created, or someone else could write to
    it) is a warning once and ``problem`` says what: the cache then finds
    nothing and saves nothing. ``clock`` stamps created and last-used times,
    and times the retry of a state refused for want of room (``RETRY_S``).
    Not thread-safe (see the module docstring).
    """

    def __init__(
        self,
        directory: Path,
        key: CacheKey,
        max_bytes: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.directory = directory
        self.key = key
        self.max_bytes = max_bytes
        self.clock = clock
        self.counters = CacheCounters()
        # entries this process's llama.cpp refused to load, by name, with the digest of
        # the state it refused: that state is not offered again (find, get), and the
        # next save of the same prompt writes it anew instead of keeping it
        self._refused: dict[str, str] = {}
        # entries refused while the shared KV buffer may have had no room for them, by
        # name: when (``clock``) they are offered again
        self._retry_at: dict[str, float] = {}
        self._index = CacheIndex(directory, clock, self.counters)

    @property
    def problem(self) -> str | None:
        """What is wrong with the directory, when the cache finds and saves nothing."""
        return self._index.problem

    def refresh(self) -> None:
        """Read the directory again: entries other processes wrote or removed."""
        self._index.refresh()

    # -- lookup -----------------------------------------------------------------------

    def find(self, tokens: Sequence[int]) -> Entry | None:
        """The longest saved prompt of this key whose tokens start ``tokens`` (or are
        all of them)."""
        self._index.read_again()
        best: Entry | None = None
        n = len(tokens)
        now = self.clock() if self._retry_at else 0.0
        for e in self._index.by_name.values():
            if (
                e.key == self.key
                and not self._was_refused(e, now)
                and e.n_tokens <= n
                and (best is None or e.n_tokens > best.n_tokens)
                and tuple(tokens[: e.n_tokens]) == e.tokens
            ):
                best = e
        self._count(best)
        return best

    def get(self, tokens: Sequence[int]) -> Entry | None:
        """The saved prompt of exactly these tokens."""
        self._index.read_again()
        e = self._index.by_name.get(entry_name(self.key, tokens)) if tokens else None
        now = self.clock() if self._retry_at else 0.0
        usable = e is not None and e.key == self.key and not self._was_refused(e, now)
        found = e if usable else None
        self._count(found)
        return found

    def entries(self) -> list[Entry]:
        """This key's entries, most recently used first."""
        ours = [e for e in self._index.by_name.values() if e.key == self.key]
        return sorted(ours, key=lambda e: e.last_used, reverse=True)

    @property
    def total_bytes(self) -> int:
        """Disk the directory's entries take, every key's."""
        return self._index.total_bytes

    def _was_refused(self, entry: Entry, now: float) -> bool:
        """Whether llama.cpp refused this very state (the same digest) in this process,
        or refused it less than ``RETRY_S`` before ``now`` for want of room."""
        if self._refused.get(entry.name) == entry.state_sha256:
            return True
        return self._retry_at.get(entry.name, now) > now

    def _count(self, found: Entry | None) -> None:
        if found is None:
            self.counters.misses += 1
        else:
            self.counters.hits += 1

    # -- save -------------------------------------------------------------------------

    def save(self, kv: KVHandles, seq: int, tokens: Sequence[int]) -> Entry | None:
        """Write sequence ``seq``'s state; it must hold exactly ``tokens`` at positions
        0..n-1. None (with a warning) when it is not saved.

        Both files are written under temporary names and renamed into place, the
        sidecar last: a reader sees a complete entry or none. Then the least
        recently used entries go until the directory is within ``max_bytes``;
        an entry larger than that alone is not kept.
        """
        if self.problem is not None:
            return None
        tokens = tuple(int(t) for t in tokens)
        if not 0 < len(tokens) <= self.key.n_ctx_seq:
            log.warning(
                "prompt cache: not saving a prompt of %d tokens (1 to %d fit a sequence)",
                len(tokens),
                self.key.n_ctx_seq,
            )
            return None
        held = int(kv.lib.llama_memory_seq_pos_max(kv.memory, seq))
        if held != len(tokens) - 1:
            log.warning(
                "prompt cache: not saving sequence %d: it holds positions up to %d, "
                "the prompt has %d tokens",
                seq,
                held,
                len(tokens),
            )
            return None
        name = entry_name(self.key, tokens)
        known = self._index.by_name.get(name)
        if (
            known is not None
            and name not in self._refused
            and exists(known.state_path)
            and exists(known.sidecar_path)
        ):
            return self._index.touch(known)
        state_tmp = self._index.temp_path(name + STATE_SUFFIX)
        try:
            entry = self._write(kv, seq, tokens, name, state_tmp)
        except OSError as exc:
            log.warning("prompt cache: cannot save %s: %s", self.directory / name, exc)
            entry = None
        finally:
            with contextlib.suppress(FileNotFoundError):
                state_tmp.unlink()
        if entry is not None:
            self._index.saved(entry)
            for pending in (self._refused, self._retry_at):
                pending.pop(name, None)
            self.counters.saves += 1
            self._index.refresh()  # the bound is the directory's: what others saved counts too
            self._index.by_name.setdefault(name, entry)
            self._index.evict(name, self.max_bytes)
        return entry

    def _write(
        self, kv: KVHandles, seq: int, tokens: tuple[int, ...], name: str, state_tmp: Path
    ) -> Entry | None:
        # created 0600 first: llama.cpp's fopen(wb) truncates it and keeps the mode
        os.close(os.open(state_tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE))
        array = (kv.lib.llama_token * len(tokens))(*tokens)
        with capture_log() as lines, reported_by_caller() as problems:
            written = int(
                kv.lib.llama_state_seq_save_file(
                    kv.ctx, os.fsencode(state_tmp), seq, array, len(tokens)
                )
            )
        if written == 0:
            log.warning(
                "prompt cache: llama.cpp could not save sequence %d to %s: %s",
                seq,
                state_tmp,
                _reason(problems or lines),
            )
            return None
        size, digest = synced(state_tmp)
        if size != written:  # llama.cpp does not check the flush when it closes the file
            log.warning(
                "prompt cache: llama.cpp wrote %d bytes of sequence %d's state but %s holds "
                "%d (a write was lost: is the disk full?): not kept",
                written,
                seq,
                state_tmp,
                size,
            )
            return None
        now = self.clock()
        entry = Entry(
            directory=self.directory,
            name=name,
            key=self.key,
            tokens=tokens,
            state_sha256=digest,
            state_bytes=size,
            created=now,
            last_used=self._index.used_now(),
        )
        data = entry.sidecar()
        entry = replace(entry, sidecar_bytes=len(data))
        if entry.disk_bytes > self.max_bytes:
            log.warning(
                "prompt cache: the state of a %d-token prompt takes %d bytes, more than "
                "max_bytes (%d): not kept",
                len(tokens),
                entry.disk_bytes,
                self.max_bytes,
            )
            return None
        # an older sidecar of this name (its state was lost) must not meet the new state
        with contextlib.suppress(FileNotFoundError):
            entry.sidecar_path.unlink()
        os.replace(state_tmp, entry.state_path)
        try:
            write_atomic(entry.sidecar_path, data, self._index.temp_path(name + SIDECAR_SUFFIX))
        except OSError:  # a state without its sidecar only takes room (a full disk's)
            with contextlib.suppress(OSError):
                entry.state_path.unlink()
            raise
        return entry

    # -- load -------------------------------------------------------------------------

    def load(self, kv: KVHandles, seq: int, entry: Entry) -> bool:
        """Restore ``entry`` into sequence ``seq``, which must be empty.

        True when ``seq`` now holds exactly the entry's tokens at positions
        0..n-1; False (with a warning naming the file and the reason) otherwise,
        and then ``seq`` is empty again.
        """
        if self.problem is not None:
            return False
        lib = kv.lib
        if int(lib.llama_memory_seq_pos_max(kv.memory, seq)) != -1:
            log.warning("prompt cache: not loading into sequence %d: it is not empty", seq)
            return False
        if entry.key != self.key:
            return self._refuse(entry, "it was saved for another model or context", delete=False)
        try:
            current = self._index.read(entry.name)
        except FileNotFoundError:
            self._index.by_name.pop(entry.name, None)
            return self._refuse(entry, "its sidecar is gone", delete=False)
        except OtherFormat as exc:
            self._index.by_name.pop(entry.name, None)
            return self._refuse(entry, f"its sidecar is now of {exc}", delete=False)
        except OSError as exc:
            return self._unreadable(entry, entry.sidecar_path, exc)
        except (ValueError, UnicodeDecodeError) as exc:
            return self._refuse(entry, f"sidecar: {exc}", delete=True)
        if current.key != self.key or current.tokens != entry.tokens:
            return self._refuse(entry, "its sidecar describes another prompt", delete=False)
        try:
            fd = open_file(current.state_path)
        except FileNotFoundError:
            return self._refuse(entry, "its state file is missing", delete=True)
        except OSError as exc:
            return self._unreadable(entry, current.state_path, exc)
        except ValueError as exc:
            return self._refuse(entry, f"state file: {exc}", delete=True)
        try:
            try:
                reason = verify_state(fd, current)
            except OSError as exc:
                return self._unreadable(entry, current.state_path, exc)
            if reason is not None:
                return self._refuse(entry, reason, delete=True)
            try:
                ok, reason, by_llama = self._load_fd(kv, seq, fd, current)
            except Exception as exc:  # a binding's error must not take the engine down
                ok, reason, by_llama = False, f"{type(exc).__name__}: {exc}", False
        finally:
            os.close(fd)
        if not ok:
            with contextlib.suppress(Exception):
                lib.llama_memory_seq_rm(kv.memory, seq, 0, -1)
            self._index.by_name[current.name] = current  # its digest is what find and get see
            if by_llama and self._shares_buffer(kv, seq):  # perhaps no room only then
                self._retry_at[current.name] = self.clock() + RETRY_S
                return self._refuse(
                    entry,
                    f"{reason}; other sequences held cells of the KV buffer it shares with "
                    f"them, so it may only have found no room: trying it again in {RETRY_S:g} s",
                    delete=False,
                )
            # kept (another llama.cpp build, or a later start, may take it), but neither
            # offered again by find and get nor kept by the next save of this prompt
            self._refused[current.name] = current.state_sha256
            return self._refuse(
                entry, f"{reason}; not trying it again until it is saved anew", delete=False
            )
        self._retry_at.pop(current.name, None)
        self._index.readable(current.name)
        self._index.touch(current)
        self.counters.loads += 1
        return True

    def _shares_buffer(self, kv: KVHandles, seq: int) -> bool:
        """Whether sequences other than ``seq`` hold cells of the KV buffer it loads into
        (one buffer for all slots: ``kv_unified``), so that a state may have found no
        free cells; with one stream per slot, an empty sequence has all of its own."""
        if not self.key.kv_unified:
            return False
        lib = kv.lib
        return any(
            s != seq and int(lib.llama_memory_seq_pos_max(kv.memory, s)) >= 0
            for s in range(int(lib.llama_n_seq_max(kv.ctx)))
        )

    def _load_fd(self, kv: KVHandles, seq: int, fd: int, entry: Entry) -> tuple[bool, str, bool]:
        """llama.cpp reads the file open as ``fd``: the one just verified, whatever the
        name points to by now (``/proc/self/fd``; without it, the name). (loaded, why
        not, whether llama.cpp itself refused to read it)."""
        lib, n = kv.lib, entry.n_tokens
        proc = f"/proc/self/fd/{fd}"
        source = proc if os.path.exists(proc) else str(entry.state_path)
        out = (lib.llama_token * n)()
        count = ctypes.c_size_t(0)
        with capture_log() as lines, reported_by_caller() as problems:
            read = int(
                lib.llama_state_seq_load_file(
                    kv.ctx, os.fsencode(source), seq, out, n, ctypes.pointer(count)
                )
            )
        if read == 0:
            return False, f"llama.cpp refused it: {_reason(problems or lines)}", True
        if count.value != n or tuple(out[:n]) != entry.tokens:
            return False, "the state holds other tokens than its sidecar", False
        held = int(lib.llama_memory_seq_pos_max(kv.memory, seq))
        if held != n - 1:
            return False, f"sequence {seq} holds positions up to {held}, not {n - 1}", False
        return True, "", False

    def _unreadable(self, entry: Entry, path: Path, exc: OSError) -> bool:
        """A file of the entry could not be read now: kept, offered again after RETRY_S."""
        self._retry_at[entry.name] = self.clock() + RETRY_S
        self.counters.rejected += 1
        self._index.warn_once(entry.name, path, exc)
        return False

    def _refuse(self, entry: Entry, reason: str, delete: bool) -> bool:
        log.warning("prompt cache: not loading %s: %s", entry.state_path, reason)
        self.counters.rejected += 1
        if delete:
            self._index.remove(entry, only_own=True)
        return False


REASON_LINES = 3  # llama.cpp's lines a refusal quotes, at most


def _reason(lines: list[str]) -> str:
    """What llama.cpp wrote about a failed save or load (its warning and error lines,
    ``reported_by_caller``): the last few, first to last. The first usually says what
    was wrong ("mismatched key type (8 != 1, layer 0)"), the last only that it failed
    ("failed to restore kv cache")."""
    text = [ln.strip() for ln in "".join(lines).splitlines() if ln.strip()]
    return "; ".join(list(dict.fromkeys(text))[-REASON_LINES:]) or "no reason given"
