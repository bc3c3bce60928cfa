"""What makes a saved prompt state valid for a context, and the names it is saved under.

A saved state is only valid for the model file and the context it came from:
``CacheKey`` gathers everything that shapes the cells (the model's SHA-256,
the K and V types, the V layout flash attention decides, the sliding-window
cache, the number of KV streams, the RoPE base, the cells per sequence), and
file names derive from a hash of the key and the tokens (``entry_name``), so a
change of any of them gives other names and an old file is never considered.
The checks a key read back from disk passes are here too, shared with the
sidecar (``cachefiles``) and the digest memo (``modeldigest``).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from orin.engine.config import EngineConfig

FORMAT_VERSION = 1
"""Part of every key: bump when the sidecar or the meaning of a key field changes."""

HEX64 = re.compile(r"^[0-9a-f]{64}$")
_TYPE = re.compile(r"^[a-z0-9_]{1,16}$")
_FLASH = ("on", "off", "auto")
TOKEN_MAX = 2**31 - 1


@dataclass(frozen=True)
class CacheKey:
    """Everything that makes a saved sequence state valid for a context.

    ``flash_attn`` is ``on`` or ``off`` as the context resolved it when the
    caller knows (``flash_attn=`` of ``from_config``), else the configured
    value, ``auto`` included. llama.cpp lays out the V cache from the
    configured value (non-transposed for ``on`` and ``auto``, transposed for
    ``off``) before it resolves ``auto``, and refuses a state of the other
    layout itself, so a configured ``auto`` keys the layout correctly; it only
    cannot tell apart the attention kernels the cells were computed with.

    ``n_stream`` is the number of KV streams (the slots, or 1 with
    ``kv_unified``): llama.cpp writes it into a sequence's state and refuses to
    load a state into a context with another count ("n_stream mismatch").
    """

    model_sha256: str
    type_k: str
    type_v: str
    flash_attn: str
    swa_full: bool
    kv_unified: bool
    n_stream: int
    n_ctx_seq: int
    rope_freq_base: float | None  # None: the model's
    format: int = FORMAT_VERSION

    @classmethod
    def from_config(
        cls,
        cfg: EngineConfig,
        digest: str,
        n_ctx_seq: int,
        flash_attn: bool | None = None,
    ) -> CacheKey:
        """The key of a context built from ``cfg``: ``digest`` from ``model_digest``,
        ``n_ctx_seq`` the cells per sequence llama.cpp reports (``Backend.n_ctx_seq``),
        ``flash_attn`` whether the context uses flash attention, when known."""
        fa = cfg.flash_attn if flash_attn is None else ("on" if flash_attn else "off")
        return cls(
            model_sha256=digest,
            type_k=cfg.type_k,
            type_v=cfg.type_v,
            flash_attn=fa,
            swa_full=cfg.swa_full,
            kv_unified=cfg.kv_unified,
            n_stream=1 if cfg.kv_unified else cfg.slots,
            n_ctx_seq=n_ctx_seq,
            rope_freq_base=cfg.rope_freq_base,
        )

    @property
    def digest(self) -> str:
        """SHA-256 of the key's canonical JSON: the first part of every file name."""
        text = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: object) -> CacheKey:
        """A key read back from a sidecar; ValueError names the first field that is off."""
        if not isinstance(raw, dict) or set(raw) != {f.name for f in fields(cls)}:
            raise ValueError("the key does not have exactly the expected fields")
        base = raw["rope_freq_base"]
        if base is not None and not (is_number(base) and math.isfinite(base) and base > 0):
            raise ValueError(f"rope_freq_base is not a positive number: {base!r}")
        if raw["flash_attn"] not in _FLASH:
            raise ValueError(f"flash_attn is not one of {', '.join(_FLASH)}")
        return cls(
            model_sha256=checked_text(raw["model_sha256"], "model_sha256", HEX64),
            type_k=checked_text(raw["type_k"], "type_k", _TYPE),
            type_v=checked_text(raw["type_v"], "type_v", _TYPE),
            flash_attn=raw["flash_attn"],
            swa_full=checked_flag(raw["swa_full"], "swa_full"),
            kv_unified=checked_flag(raw["kv_unified"], "kv_unified"),
            n_stream=checked_int(raw["n_stream"], "n_stream", 1, 1 << 16),
            n_ctx_seq=checked_int(raw["n_ctx_seq"], "n_ctx_seq", 1, TOKEN_MAX),
            rope_freq_base=None if base is None else float(base),
            format=checked_int(raw["format"], "format", 1, 1 << 16),
        )


def resolved_flash_attn(context_log: Sequence[str], configured: str) -> bool | None:
    """Whether a context uses flash attention, from llama.cpp's log of its creation.

    llama.cpp has no call that reports how ``auto`` was resolved; it logs it
    ("Flash Attention enabled", or "... not supported, set to disabled") while
    it reserves the compute graphs in ``llama_init_from_model``. None when
    ``auto`` was asked and the log says neither.
    """
    if configured != "auto":
        return configured == "on"
    for line in reversed("".join(context_log).splitlines()):
        if "Flash Attention" in line:
            if "set to disabled" in line or "not supported" in line:
                return False
            if line.rstrip().endswith("enabled"):
                return True
    return None


def entry_name(key: CacheKey, tokens: Sequence[int]) -> str:
    """The file stem of a saved prompt: the key's hash, then a hash of key and tokens."""
    h = hashlib.sha256(key.digest.encode())
    h.update(struct.pack(f"<{len(tokens)}i", *tokens))
    return f"{key.digest[:16]}-{h.hexdigest()[:32]}"


# -- checks of what is read back from disk --------------------------------------------


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def checked_int(value: object, name: str, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer from {lo} to {hi}, not {value!r}")
    return value


def checked_flag(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, not {value!r}")
    return value


def checked_text(value: object, name: str, pattern: re.Pattern[str]) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        raise ValueError(f"{name} is not an accepted value: {value!r}")
    return value
