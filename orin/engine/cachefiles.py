"""A saved prompt on disk: its two files, the sidecar's format, and the file operations
the prompt cache relies on.

An entry is ``<name>.state``, llama.cpp's file of a sequence's KV state, and
``<name>.json``, the sidecar that says what it holds: the key, the tokens, the
state's size and SHA-256, when it was created and last used. A file is read only
when nobody else could have written it: a regular file, not a link, of this user
or root, not writable by group or others (``untrusted``), checked on the open
file itself. Files are written under a temporary name, flushed to the disk and
renamed over the final one (``write_atomic``): after a power cut a name holds
the old bytes or the new ones, never half of them.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import secrets
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from orin.engine.cachekey import (
    FORMAT_VERSION,
    HEX64,
    TOKEN_MAX,
    CacheKey,
    checked_int,
    checked_text,
    entry_name,
    is_number,
)
from orin.system.root import GROUP_OR_OTHER_WRITE

DIR_MODE = 0o700
FILE_MODE = 0o600
STATE_SUFFIX = ".state"
SIDECAR_SUFFIX = ".json"
TEMP_PREFIX = ".tmp-"
CHUNK = 1 << 20
MAX_SIDECAR_BYTES = 64 << 20  # far above a sidecar of the longest context's tokens
ENTRY_NAME = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{32}$")  # key hash, then key and tokens hash


# -- the entry ------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One saved prompt: ``<name>.state`` (llama.cpp's file) and ``<name>.json``."""

    directory: Path
    name: str
    key: CacheKey
    tokens: tuple[int, ...]
    state_sha256: str
    state_bytes: int
    created: float
    last_used: float
    sidecar_bytes: int = 0

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    @property
    def state_path(self) -> Path:
        return self.directory / (self.name + STATE_SUFFIX)

    @property
    def sidecar_path(self) -> Path:
        return self.directory / (self.name + SIDECAR_SUFFIX)

    @property
    def disk_bytes(self) -> int:
        """Disk the entry takes: the state file and the sidecar."""
        return self.state_bytes + self.sidecar_bytes

    def sidecar(self) -> bytes:
        doc = {
            "key": self.key.to_json(),
            "tokens": list(self.tokens),
            "state_sha256": self.state_sha256,
            "state_bytes": self.state_bytes,
            "created": self.created,
            "last_used": self.last_used,
        }
        return json.dumps(doc, separators=(",", ":")).encode()


SIDECAR_KEYS = frozenset({"key", "tokens", "state_sha256", "state_bytes", "created", "last_used"})


class OtherFormat(ValueError):
    """A sidecar of another format version: not this version's to judge or remove."""


def parse_sidecar(directory: Path, name: str, data: bytes) -> Entry:
    """The entry a sidecar describes; ValueError names the first thing that is off."""
    raw = json.loads(data)
    if isinstance(raw, dict) and isinstance(raw.get("key"), dict):
        fmt = raw["key"].get("format")
        if fmt != FORMAT_VERSION:
            raise OtherFormat(f"format {fmt!r}")
    if not isinstance(raw, dict) or set(raw) != SIDECAR_KEYS:
        raise ValueError(f"expected exactly the keys {', '.join(sorted(SIDECAR_KEYS))}")
    key = CacheKey.from_json(raw["key"])
    tokens = raw["tokens"]
    if not isinstance(tokens, list) or not 0 < len(tokens) <= key.n_ctx_seq:
        raise ValueError(f"tokens must be a list of 1 to {key.n_ctx_seq} token ids")
    if not all(type(t) is int and 0 <= t <= TOKEN_MAX for t in tokens):
        raise ValueError("tokens must be non-negative 32-bit integers")
    if entry_name(key, tokens) != name:
        raise ValueError("the key and tokens do not give this file's name")
    created, last_used = raw["created"], raw["last_used"]
    for value, what in ((created, "created"), (last_used, "last_used")):
        if not is_number(value) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{what} is not a time: {value!r}")
    return Entry(
        directory=directory,
        name=name,
        key=key,
        tokens=tuple(tokens),
        state_sha256=checked_text(raw["state_sha256"], "state_sha256", HEX64),
        state_bytes=checked_int(raw["state_bytes"], "state_bytes", 12, 2**63),
        created=float(created),
        last_used=float(last_used),
        sidecar_bytes=len(data),
    )


# -- files ----------------------------------------------------------------------------


def untrusted(st: os.stat_result) -> str | None:
    """Why a file could hold what someone else wrote, or None when it is fine to read:
    a regular file (not a link) of this user or root, not writable by group or others."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    return _foreign(st)


def untrusted_dir(path: Path) -> str | None:
    try:
        st = path.stat()
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    return _foreign(st, "; chmod 0700 it")


def _foreign(st: os.stat_result, fix: str = "") -> str | None:
    """Why another user could have written it: its owner, or its mode (and ``fix``)."""
    if st.st_uid not in (0, os.geteuid()):
        return f"owned by uid {st.st_uid}, neither this user ({os.geteuid()}) nor root"
    if st.st_mode & GROUP_OR_OTHER_WRITE:
        return f"writable by group or others (mode {st.st_mode & 0o7777:04o}){fix}"
    return None


def exists(path: Path) -> bool:
    """Whether ``path`` is there; an error that says nothing (EIO, EACCES) is a no,
    where ``Path.exists`` raises it."""
    try:
        path.lstat()
    except OSError:
        return False
    return True


def open_file(path: Path) -> int:
    """A descriptor of ``path`` opened for reading, not through a symbolic link: a
    link is a ValueError (not this cache's file), any other failure an OSError."""
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError("a symbolic link, not a regular file") from None
        raise


def read_trusted(path: Path, limit: int) -> bytes:
    """A small file's bytes, checked on the open file itself (no link followed)."""
    fd = open_file(path)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        reason = untrusted(st)
        if reason is not None:
            raise ValueError(reason)
        if st.st_size > limit:
            raise ValueError(f"{st.st_size} bytes, more than {limit}")
        return f.read(limit + 1)


def verify_state(fd: int, entry: Entry) -> str | None:
    """Why the open state file is not the one the sidecar describes, or None."""
    st = os.fstat(fd)
    reason = untrusted(st)
    if reason is not None:
        return reason
    if st.st_size != entry.state_bytes:
        return f"it has {st.st_size} bytes, the sidecar says {entry.state_bytes}"
    h = hashlib.sha256()
    for block in blocks(fd):
        h.update(block)
    if h.hexdigest() != entry.state_sha256:
        return "its SHA-256 does not match the sidecar's (altered or damaged)"
    return None


def blocks(fd: int) -> Iterator[bytes]:
    offset = 0
    while block := os.pread(fd, CHUNK, offset):
        offset += len(block)
        yield block


def cannot_create(path: Path, exc: OSError) -> str:
    """Why ``ensure_dir`` failed: a file where a folder on the way should be is named
    as such (mkdir's own "File exists" says nothing about which)."""
    for folder in (path, *path.parents):
        if folder.exists() or folder.is_symlink():
            if not folder.is_dir():
                return f"cannot create it: {folder} is not a directory"
            break
    return f"cannot create it: {exc.strerror or exc}"


def ensure_dir(path: Path) -> None:
    """Create the directory (0700; missing parents with the umask's modes)."""
    if path.is_dir():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=DIR_MODE)
    except FileExistsError:
        return
    os.chmod(path, DIR_MODE)


def write_atomic(path: Path, data: bytes, tmp: Path | None = None) -> None:
    """Write ``data`` under a temporary name (0600), flushed to the disk, and rename it
    over ``path``: after a power cut the name holds the old bytes or the new ones."""
    tmp = tmp or path.with_name(f"{TEMP_PREFIX}{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        sync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def synced(path: Path) -> tuple[int, str]:
    """Flush a file another writer (llama.cpp) closed to the disk: its size and SHA-256
    as the disk has them."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        h = hashlib.sha256()
        for block in blocks(fd):
            h.update(block)
        return os.fstat(fd).st_size, h.hexdigest()
    finally:
        os.close(fd)


def sync_dir(path: Path) -> None:
    """Flush a directory's renames to the disk (best effort: some file systems refuse
    it, and a rename that a power cut forgets leaves the old file, never half of one)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
