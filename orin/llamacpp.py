"""The one place that imports llama_cpp for non-engine code, and its log plumbing.

llama.cpp prints through a process-wide log callback. orin-llm routes it to the
Python logger ``orin.llama`` (quiet unless debugging) and lets callers capture
the lines of one operation, e.g. the KV buffer sizes reported at context
creation.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from types import ModuleType
from typing import Any

from orin.errors import LlamaCppError

log = logging.getLogger("orin.llama")

# ggml_log_level: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 continuation
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_lock = threading.Lock()
_captures: list[list[str]] = []
_callback: Any = None  # keeps the ctypes callback alive


def _on_log(level: int, text: bytes, _user: Any) -> None:
    line = text.decode("utf-8", errors="replace")
    with _lock:
        for sink in _captures:
            sink.append(line)
    if level != 5 and line.strip():
        log.log(_LEVELS.get(level, logging.DEBUG), "%s", line.rstrip("\n"))


@cache
def llama() -> ModuleType:
    """Import llama_cpp once, with its log routed through Python logging."""
    global _callback
    try:
        import llama_cpp
    except (ImportError, OSError) as exc:  # OSError: shared library failed to load
        raise LlamaCppError(
            f"llama-cpp-python is not usable: {exc}; run scripts/install-llama-cpp.sh"
        ) from exc
    _callback = llama_cpp.llama_log_callback(_on_log)
    llama_cpp.llama_log_set(_callback, ctypes.c_void_p(0))
    llama_cpp.llama_backend_init()
    return llama_cpp


@contextmanager
def capture_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log text emitted inside the block (from any thread)."""
    llama()
    sink: list[str] = []
    with _lock:
        _captures.append(sink)
    try:
        yield sink
    finally:
        with _lock:  # by identity: a nested capture's sink can hold the same lines
            _captures[:] = [s for s in _captures if s is not sink]


@dataclass(frozen=True)
class BuildInfo:
    """What the installed llama.cpp build can do, read from the library itself."""

    version: str
    gpu_offload: bool
    system_info: str
    backends: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return "CUDA" in self.backends

    @property
    def fa_quants(self) -> frozenset[tuple[str, str]] | None:
        """K/V type pairs with CUDA flash-attention kernels; None means all."""
        return parse_fa_quants(self.backends.get("CUDA", {}).get("FA_QUANTS"))


# What llama.cpp compiles when GGML_CUDA_FA_QUANTS is not set (f16/f16 is always compiled).
DEFAULT_CUDA_FA_QUANTS = frozenset(
    {("q4_0", "q4_0"), ("q8_0", "q8_0"), ("f16", "f16"), ("bf16", "bf16")}
)


def parse_fa_quants(value: str | None) -> frozenset[tuple[str, str]] | None:
    """Parse the CUDA backend's FA_QUANTS feature ("all" or "k-v;k-v;...")."""
    if value is None:
        return DEFAULT_CUDA_FA_QUANTS
    if value.strip().lower() == "all":
        return None
    pairs = {("f16", "f16")}  # ggml's CMake adds it to any list
    for item in value.replace(",", ";").split(";"):
        k, sep, v = item.strip().partition("-")
        if sep:
            pairs.add((k.strip().lower(), v.strip().lower()))
    return frozenset(pairs)


def parse_system_info(text: str) -> dict[str, dict[str, str]]:
    """Split llama_print_system_info() output into backend -> {feature: value}."""
    backends: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for part in text.split("|"):
        part = part.strip()
        if not part:
            continue
        if " : " in part or part.endswith(":"):
            name, _, rest = part.partition(":")
            current = backends.setdefault(name.strip(), {})
            part = rest.strip()
            if not part:
                continue
        key, _, value = part.partition("=")
        if current is not None and key.strip():
            current[key.strip()] = value.strip()
    return backends


@cache
def build_info() -> BuildInfo:
    lib = llama()
    from importlib.metadata import version

    text = lib.llama_print_system_info().decode("utf-8", errors="replace")
    return BuildInfo(
        version=version("llama-cpp-python"),
        gpu_offload=bool(lib.llama_supports_gpu_offload()),
        system_info=text,
        backends=parse_system_info(text),
    )
