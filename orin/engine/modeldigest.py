"""The SHA-256 of a model file: the first field of every prompt cache key, remembered
for each version of the file so that a start does not hash the model again."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from orin.engine.cachefiles import (
    CHUNK,
    MAX_SIDECAR_BYTES,
    ensure_dir,
    read_trusted,
    write_atomic,
)
from orin.engine.cachekey import HEX64, checked_int, checked_text

log = logging.getLogger("orin.engine")

MEMO_NAME = "model-digests.json"
MEMO_LIMIT = 32  # model files remembered in the digest memo


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def model_digest(path: Path, memo_dir: Path) -> str:
    """SHA-256 of a model file, read once per version of the file.

    The digest is remembered in ``memo_dir/model-digests.json`` under the
    file's resolved path with its size, mtime (ns), inode and device: a 4 GB
    model is hashed at the first start and after it changes, not at every
    start. The memo is read only when nobody else could have written it, and
    a problem with it is a debug line: the file is hashed again.
    """
    resolved = path.resolve()
    before = resolved.stat()
    ident = _identity(before)
    memo_path = memo_dir / MEMO_NAME
    memo = _read_memo(memo_path)
    known = memo.get(str(resolved))
    if known is not None and {k: known[k] for k in ident} == ident:
        return str(known["sha256"])
    digest = file_sha256(resolved)
    if _identity(resolved.stat()) != ident:
        log.debug("%s changed while it was hashed: digest not remembered", resolved)
        return digest
    memo.pop(str(resolved), None)
    memo[str(resolved)] = {**ident, "sha256": digest}
    while len(memo) > MEMO_LIMIT:
        memo.pop(next(iter(memo)))
    try:
        ensure_dir(memo_dir)
        write_atomic(memo_path, json.dumps(memo, indent=1).encode())
    except OSError as exc:
        log.warning("cannot remember the digest of %s in %s: %s", resolved, memo_path, exc)
    return digest


IDENTITY = ("size", "mtime_ns", "inode", "device")  # a memo record's file identity


def _identity(st: os.stat_result) -> dict[str, int]:
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }


def _read_memo(path: Path) -> dict[str, dict[str, Any]]:
    """The memo's records (file path -> identity and digest); {} when absent or off."""
    try:
        raw = json.loads(read_trusted(path, MAX_SIDECAR_BYTES))
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        memo: dict[str, dict[str, Any]] = {}
        for name, rec in raw.items():
            if not isinstance(rec, dict) or set(rec) != {*IDENTITY, "sha256"}:
                raise ValueError(f"record {name!r} does not have the expected fields")
            for k in IDENTITY:
                checked_int(rec[k], k, 0, 2**64)
            checked_text(rec["sha256"], "sha256", HEX64)
            memo[str(name)] = rec
        return memo
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        log.debug("not using the digest memo %s: %s", path, exc)
        return {}
