"""The one place that imports llama_cpp for non-engine code, and its log plumbing.

llama.cpp prints through a process-wide log callback. orin-llm routes it to the
Python logger ``orin.llama`` (quiet unless debugging) and lets callers capture
the lines of one operation, e.g. the KV buffer sizes reported at context
creation.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from types import ModuleType
from typing import Any, TypeVar

from orin.errors import LlamaCppError

T = TypeVar("T")

log = logging.getLogger("orin.llama")

# ggml_log_level: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 continuation
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_lock = threading.Lock()
_captures: list[list[str]] = []
_callback: Any = None  # keeps the ctypes callback alive
_aborting = threading.Event()  # an abort callback asked the running decode to stop
# .client_input: this thread checks a client's input; .expected: fragments of warnings
# this thread asked for; .reported: the warning and error lines reported_by_caller
# collects for this thread
_thread = threading.local()
_stderr_lock = threading.Lock()  # one redirection of fd 2 at a time


def _on_log(level: int, text: bytes, _user: Any) -> None:
    line = text.decode("utf-8", errors="replace")
    with _lock:
        for sink in _captures:
            sink.append(line)
    reported: list[str] | None = getattr(_thread, "reported", None)
    if reported is not None:
        if level in (3, 4):
            reported.append(line)
        elif level == 5 and reported and _thread.reported_last:
            reported[-1] += line  # the rest of a warning or error line
        _thread.reported_last = level in (3, 4) or (level == 5 and _thread.reported_last)
    if level != 5 and line.strip():
        # the lines of a decode stopped on request ("failed to compute graph", "failed
        # to decode, ret = 2") describe the stop, not a failure
        how = logging.DEBUG if _aborting.is_set() else _LEVELS.get(level, logging.DEBUG)
        if how > logging.INFO and getattr(_thread, "client_input", False):
            how = logging.INFO  # the client gets the error; the server did nothing wrong
        if how == logging.WARNING and any(f in line for f in getattr(_thread, "expected", ())):
            how = logging.INFO  # what the caller chose on purpose, not a problem
        if how > logging.INFO and reported is not None:
            how = logging.DEBUG  # the caller's own warning quotes it
        log.log(how, "%s", line.rstrip("\n"))


@contextmanager
def expected_warnings(*fragments: str) -> Iterator[None]:
    """While this thread runs the block, llama.cpp's warnings that contain one of
    ``fragments`` are logged at info level: they describe a choice the caller made on
    purpose (a profile's ``model.pooling`` over the model's own, say), not a problem."""
    before = getattr(_thread, "expected", ())
    _thread.expected = before + fragments
    try:
        yield
    finally:
        _thread.expected = before


@contextmanager
def client_input() -> Iterator[None]:
    """While this thread runs the block (llama.cpp checking a request's grammar, say),
    llama.cpp's warnings and errors are logged at info level: they are the client's
    mistake, answered with a 400, not the server's."""
    _thread.client_input = True
    try:
        yield
    finally:
        _thread.client_input = False


@contextmanager
def reported_by_caller() -> Iterator[list[str]]:
    """While this thread runs the block, llama.cpp's warnings and errors are collected
    in the list it yields and logged at debug level only: the caller handles the
    failure and logs one warning of its own that quotes them (a saved prompt state
    llama.cpp refuses is skipped, not an error of the server)."""
    lines: list[str] = []
    _thread.reported, _thread.reported_last = lines, False
    try:
        yield lines
    finally:
        _thread.reported = None


def with_stderr(fn: Callable[[], T]) -> tuple[T, str]:
    """Run ``fn`` with the process's stderr (file descriptor 2) going to a temporary
    file, and return its result and the text written there meanwhile. For the few
    llama.cpp functions that print with ``fprintf(stderr)`` instead of its log
    callback (the grammar parser's message), whose text would otherwise reach the
    service's log raw, outside ``--log-format json``. Other threads' writes in the
    window land in the file too: the caller passes on what is not its own
    (``pass_on``). A file, not a pipe: a thread writing much in the window cannot
    block on it."""
    with _stderr_lock, tempfile.TemporaryFile() as sink:
        if sys.stderr is not None:
            sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(sink.fileno(), 2)
            try:
                result = fn()
            finally:
                if sys.stderr is not None:
                    sys.stderr.flush()
                os.dup2(saved, 2)
        finally:
            os.close(saved)
        sink.seek(0)
        return result, sink.read().decode("utf-8", errors="replace")


def pass_on(text: str) -> None:
    """Write text captured by ``with_stderr`` that was not the caller's to stderr."""
    if text:
        os.write(2, text.encode("utf-8"))


def note_abort() -> None:
    """An abort callback told the running decode to stop: until ``abort_handled``,
    llama.cpp's warnings and errors (about that stop) are logged at debug level."""
    _aborting.set()


def abort_handled() -> None:
    """The stopped decode has returned: llama.cpp's lines have their own levels again."""
    _aborting.clear()


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
        gpu_offload=local_gpu(lib),
        system_info=text,
        backends=parse_system_info(text),
    )


def local_gpu(lib: ModuleType) -> bool:
    """Whether this machine has a GPU llama.cpp can offload to: a GPU or integrated-GPU
    device of a backend other than RPC in ggml's registry.

    ``llama_supports_gpu_offload()`` cannot tell: it is true for every build with the
    RPC backend (scripts/install-llama-cpp.sh builds it in every mode), since workers
    can be added at run time, and RPC workers are GPU-type devices once added."""
    try:
        g: Any = ggml_library("ggml")
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        g.ggml_backend_dev_count.argtypes, g.ggml_backend_dev_count.restype = [], sz
        g.ggml_backend_dev_get.argtypes, g.ggml_backend_dev_get.restype = [sz], vp
        g.ggml_backend_dev_type.argtypes, g.ggml_backend_dev_type.restype = [vp], ctypes.c_int
        g.ggml_backend_dev_backend_reg.argtypes = [vp]
        g.ggml_backend_dev_backend_reg.restype = vp
        g.ggml_backend_reg_name.argtypes, g.ggml_backend_reg_name.restype = [vp], ctypes.c_char_p
    except (ImportError, AttributeError, OSError):  # an older binding: its own answer
        return bool(lib.llama_supports_gpu_offload())
    for i in range(int(g.ggml_backend_dev_count())):
        dev = g.ggml_backend_dev_get(i)
        if g.ggml_backend_dev_type(dev) not in (1, 2):  # GGML_BACKEND_DEVICE_TYPE_(I)GPU
            continue
        if g.ggml_backend_reg_name(g.ggml_backend_dev_backend_reg(dev)) != b"RPC":
            return True
    return False


@cache
def ggml_library(name: str) -> ctypes.CDLL:
    """ggml's ``lib{name}`` as libllama loaded it: by its soname (``libggml.so.0``).

    A wheel holds no symbolic links, so ``libggml.so`` and ``libggml.so.0`` are two
    files there, and loading the first would load a second copy of ggml, with its
    own backend registry and abort callback, that llama.cpp never looks at."""
    from pathlib import Path

    folder = Path(str(llama().__file__)).parent / "lib"
    for candidate in (f"lib{name}.so.0", f"lib{name}.so", f"lib{name}.dylib", f"{name}.dll"):
        if (folder / candidate).exists():
            return ctypes.CDLL(str(folder / candidate))
    raise LlamaCppError(f"lib{name} not found in {folder}")
