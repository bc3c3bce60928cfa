"""llama.cpp's RPC backend: one model across boards.

A worker (``orin-llm rpc-worker``) runs ggml's RPC server in this process,
found through the backend registry (``ggml_backend_reg_by_name("RPC")`` and
``ggml_backend_reg_get_proc_address``), so it is built from the same pinned
sources as the engine and needs no separate binary. The server side registers
each worker (``ggml_backend_rpc_add_server``) before the model loads; llama.cpp
then puts the worker devices first in its device list and splits the offloaded
layers across them and the local GPU by free memory.

llama.cpp's RPC client has no error path: a worker it cannot connect to, or one
that goes away mid-decode, ends in ``GGML_ABORT`` (``RPC_STATUS_ASSERT``) on
whichever thread noticed, and ``abort()`` follows the abort callback whatever it
does. So the server probes every worker with a TCP connect before registering
it (an unreachable worker is an ``RpcWorkerError`` naming it, exit 6), and
installs an abort callback that names the lost worker and ends the process
with exit code 6 (``RPC_LOST_EXIT``) instead of a SIGABRT core dump: the
model's weights on the worker are gone with its process, so nothing in this
process can go on with them, and the service manager restarts the server,
which loads again once the worker answers (docs/fleet.md).
"""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orin.endpoints import endpoint_problem
from orin.errors import BindError, LlamaCppError, RpcWorkerError
from orin.llamacpp import ggml_library

log = logging.getLogger("orin.engine")

DEFAULT_PORT = 50052  # llama.cpp's rpc-server default
# exit code of a server that lost a worker mid-run: LlamaCppError's (orin/cli/errors.py)
RPC_LOST_EXIT = 6
PROBE_TIMEOUT_S = 3.0
LOST_PROBE_S = 2.0  # the abort handler's connect timeout, where it must probe
LOOPBACK = frozenset({"127.0.0.1", "localhost"})

# enum ggml_backend_dev_type
DEV_CPU, DEV_GPU, DEV_IGPU = 0, 1, 2


def parse_endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT``, an IPv4 address or a host name: llama.cpp splits an endpoint at
    its first colon, so an IPv6 address cannot be one."""
    problem = endpoint_problem(text)
    if problem is not None:
        raise ValueError(f"{text.strip()!r} is not HOST:PORT: {problem}")
    host, _, port = text.strip().partition(":")
    return host, int(port)


def parse_endpoints(text: str | Sequence[str]) -> tuple[str, ...]:
    """Comma-separated (or listed) ``HOST:PORT`` endpoints, each checked, in order."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for item in items:
        if item.strip():
            host, port = parse_endpoint(item)
            out.append(f"{host}:{port}")
    return tuple(out)


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


@dataclass(frozen=True)
class RpcDevice:
    """One device a worker offers, as ggml's RPC backend reports it."""

    endpoint: str
    name: str  # RPC0, RPC1, ... in registration order
    free: int  # bytes, the worker's own free memory
    total: int


# -- the ggml backend registry through ctypes ------------------------------------


class _Ggml:
    """The few ggml-backend functions llama-cpp-python does not bind."""

    def __init__(self) -> None:
        lib: Any = ggml_library("ggml")
        base: Any = ggml_library("ggml-base")
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        self.lib, self.base = lib, base
        _sig(lib.ggml_backend_reg_by_name, [cp], vp)
        _sig(lib.ggml_backend_reg_get_proc_address, [vp, cp], vp)
        _sig(lib.ggml_backend_register, [vp], None)
        _sig(lib.ggml_backend_reg_dev_count, [vp], sz)
        _sig(lib.ggml_backend_reg_dev_get, [vp, sz], vp)
        _sig(lib.ggml_backend_dev_count, [], sz)
        _sig(lib.ggml_backend_dev_get, [sz], vp)
        _sig(lib.ggml_backend_dev_type, [vp], ctypes.c_int)
        _sig(lib.ggml_backend_dev_name, [vp], cp)
        _sig(lib.ggml_backend_dev_description, [vp], cp)
        _sig(lib.ggml_backend_dev_memory, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)], None)
        _sig(base.ggml_set_abort_callback, [vp], vp)

    def rpc_reg(self) -> int:
        reg = self.lib.ggml_backend_reg_by_name(b"RPC")
        if not reg:
            raise LlamaCppError(
                "this llama.cpp build has no RPC backend; rebuild it with "
                "scripts/install-llama-cpp.sh (GGML_RPC is on unless --no-rpc)"
            )
        return int(reg)

    def proc(self, name: str, restype: Any, argtypes: list[Any]) -> Any:
        addr = self.lib.ggml_backend_reg_get_proc_address(self.rpc_reg(), name.encode())
        if not addr:
            raise LlamaCppError(f"the RPC backend of this build does not export {name}")
        return ctypes.CFUNCTYPE(restype, *argtypes)(addr)

    def memory(self, dev: int) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)


def _sig(fn: Any, argtypes: list[Any], restype: Any) -> None:
    fn.argtypes, fn.restype = argtypes, restype


_ggml: _Ggml | None = None
_ggml_lock = threading.Lock()


def ggml() -> _Ggml:
    global _ggml
    with _ggml_lock:
        if _ggml is None:
            _ggml = _Ggml()
        return _ggml


def rpc_available() -> bool:
    """Whether the installed llama.cpp build has the RPC backend."""
    try:
        ggml().rpc_reg()
    except (LlamaCppError, OSError, AttributeError):  # no llama.cpp, or an older one
        return False
    return True


# -- the server side: workers as devices ----------------------------------------


NO_NAME = "the host name does not resolve"  # probe's reason before the resolver's


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why a worker cannot be reached (None: it accepts connections)."""
    host, port = parse_endpoint(endpoint)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except socket.gaierror as exc:  # no board to start a worker on: a wrong name
        return f"{NO_NAME}: {exc.strerror or exc}"
    except OSError as exc:
        return exc.strerror or str(exc)


def check_workers(endpoints: Sequence[str]) -> None:
    """An ``RpcWorkerError`` naming every worker that does not accept a connection."""
    failed = [(ep, why) for ep in endpoints if (why := probe(ep)) is not None]
    if not failed:
        return
    unreachable = ", ".join(f"{ep} ({why})" for ep, why in failed)
    advice = "start it with `orin-llm rpc-worker --host ADDR --port PORT` on that board"
    if all(why.startswith(NO_NAME) for _, why in failed):
        advice = "check the name (DNS, /etc/hosts), or give the board's IPv4 address"
    elif any(why == "timed out" for _, why in failed):  # nobody said no: not a stopped worker
        advice = (
            "a connection that times out is dropped on the way (the board is off or "
            "unreachable, a firewall, the worker's --allow) or waits behind a full queue "
            "(a worker serves one server at a time and keeps one more waiting); else " + advice
        )
    raise RpcWorkerError(f"cannot reach RPC worker {unreachable}; {advice}")


_registered: set[int] = set()
# after this long without the worker's answer, loading says what it waits for
WAIT_NOTICE_S = 10.0
_waiting_for: str | None = None  # the worker whose answer _connect waits for now


def waiting_for() -> str | None:
    """The worker (``HOST:PORT``) whose first answer this process waits for now, inside
    ``ggml_backend_rpc_add_server``: a wait without a limit that nothing in the process
    can interrupt (the thread in it ends only with the process). None otherwise."""
    return _waiting_for


def _connect(add_server: Callable[[bytes], int], endpoint: str) -> int:
    """``ggml_backend_rpc_add_server`` for one worker. A worker serves one server at a
    time and leaves the next connection waiting in its backlog, and llama.cpp waits
    for its answer without a limit: after ``WAIT_NOTICE_S`` the log says so, rather
    than the server staying in ``loading`` without a word, and meanwhile
    ``waiting_for`` names the worker, so that a stop does not wait for it."""
    global _waiting_for
    notice = threading.Timer(
        WAIT_NOTICE_S,
        log.warning,
        (
            "RPC worker %s accepted the connection but has not answered in %g s: a worker "
            "serves one server at a time, so another server is probably using it; "
            "loading waits until it disconnects (a stop, SIGTERM or Ctrl-C, ends serve "
            "without waiting)",
            endpoint,
            WAIT_NOTICE_S,
        ),
    )
    notice.daemon = True
    notice.start()
    _waiting_for = endpoint
    try:
        return int(add_server(endpoint.encode()) or 0)
    finally:
        _waiting_for = None
        notice.cancel()


def add_workers(endpoints: Sequence[str]) -> list[RpcDevice]:
    """Register every worker's devices with ggml before a model loads.

    Each worker is probed first: llama.cpp aborts the process on one it cannot
    connect to, so an unreachable worker is an ``RpcWorkerError`` naming it.
    The abort callback is installed before the first connection. ggml's registry
    is process-wide: every model loaded afterwards in this process (a draft model
    too) is split across the workers."""
    if not endpoints:
        return []
    g = ggml()
    g.rpc_reg()
    check_workers(endpoints)
    install_abort_hook(endpoints)
    add_server = g.proc("ggml_backend_rpc_add_server", ctypes.c_void_p, [ctypes.c_char_p])
    devices: list[RpcDevice] = []
    for ep in endpoints:
        reg = _connect(add_server, ep)
        if not reg:
            raise RpcWorkerError(f"RPC worker {ep} offers no devices")
        if reg not in _registered:  # add_server hands back the same reg for an endpoint
            g.lib.ggml_backend_register(reg)
            _registered.add(reg)
        for i in range(int(g.lib.ggml_backend_reg_dev_count(reg))):
            dev = g.lib.ggml_backend_reg_dev_get(reg, i)
            free, total = g.memory(dev)
            name = g.lib.ggml_backend_dev_name(dev).decode()
            devices.append(RpcDevice(ep, name, free, total))
            log.info("RPC worker %s: %s, %d MiB free of %d", ep, name, free >> 20, total >> 20)
    return devices


# A stop gives up on an engine thread that waits on one worker's connection over
# which nothing has moved either way for this long (docs/fleet.md).
STALL_S = 10.0
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received, Linux 4.1+
_TCP_INFO_LEN, _TCP_BYTES_AT = 136, 120


def blocked_sockets(root: Path = Path("/proc")) -> set[int]:
    """The sockets the threads of this process wait on now: the first argument of the
    system call each is in (/proc/self/task/TID/syscall; ``running`` or ``-1 SP PC``
    outside one) where that is a socket's descriptor. llama.cpp talks to a worker from
    whichever thread it runs on, the engine's or one of its own."""
    out = set()
    for task in (root / "self/task").iterdir():
        try:
            fd = int((task / "syscall").read_text().split()[1], 16)
            target = os.readlink(root / f"self/fd/{fd}")
        except (OSError, ValueError, IndexError):
            continue
        if target.startswith("socket:["):
            out.add(fd)
    return out


def socket_traffic(fd: int) -> tuple[tuple[str, int], int] | None:
    """The peer (IP, port) of the TCP socket ``fd`` and the bytes it has acknowledged
    plus those received from it (TCP_INFO), read through a duplicate of ``fd``."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            peer = s.getpeername()
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _TCP_INFO_LEN or not isinstance(peer, tuple):
        return None
    acked, received = struct.unpack_from("QQ", info, _TCP_BYTES_AT)
    return (str(peer[0]), int(peer[1])), acked + received


class StallWatch:
    """Which worker stalls this process: a stop polls ``check`` while it waits for the
    engine thread. llama.cpp's RPC client sends and receives without a time limit, and
    a worker that hangs mid-upload (or a network that drops its traffic) leaves the
    thread in that send or receive for good. A slow worker or network still moves
    bytes; a thread that waits on a worker's connection over which not one byte has
    been acknowledged or received for ``quiet_s`` has stalled."""

    def __init__(
        self,
        endpoints: Sequence[str],
        quiet_s: float = STALL_S,
        root: Path = Path("/proc"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.quiet_s, self.root, self.clock = quiet_s, root, clock
        self.addresses: dict[tuple[str, int], str] = {}
        for ep in endpoints:
            host, port = parse_endpoint(ep)
            try:  # as llama.cpp resolved it when it connected
                self.addresses[(socket.gethostbyname(host), port)] = ep
            except OSError:
                continue
        # each worker socket a thread waits on: its bytes, and since when they are so
        self._seen: dict[int, tuple[int, float]] = {}

    def check(self) -> str | None:
        """A worker a thread has waited on, with nothing moving, for ``quiet_s``."""
        now, seen, stalled = self.clock(), {}, None
        for fd in sorted(blocked_sockets(self.root)):
            traffic = socket_traffic(fd)
            worker = None if traffic is None else self.addresses.get(traffic[0])
            if traffic is None or worker is None:
                continue
            moved, since = traffic[1], now
            if fd in self._seen and self._seen[fd][0] == moved:
                since = self._seen[fd][1]
            seen[fd] = (moved, since)
            if now - since >= self.quiet_s:
                stalled = stalled or worker
        self._seen = seen
        return stalled


_hook: Any = None  # keeps the ctypes callback alive
_endpoints: tuple[str, ...] = ()
# Called with the lost-worker line before the exit, so the requests in flight end
# with that error rather than a cut connection; then the server's event loop gets
# LAST_WORDS_S to write it out.
_last_words: list[Callable[[str], None]] = []
LAST_WORDS_S = 1.0


def on_lost(fn: Callable[[str], None]) -> None:
    """Have ``fn(message)`` run when a worker is lost, before the process exits."""
    _last_words.append(fn)


def install_abort_hook(endpoints: Sequence[str]) -> None:
    """Turn llama.cpp's abort on a lost worker into a named exit (RPC_LOST_EXIT)."""
    global _hook, _endpoints
    _endpoints = tuple(dict.fromkeys((*_endpoints, *endpoints)))
    if _hook is None:
        _hook = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(_on_abort)
        ggml().base.ggml_set_abort_callback(ctypes.cast(_hook, ctypes.c_void_p))


TCP_ESTABLISHED = "01"  # the st column of /proc/net/tcp


def connection_states(endpoints: Sequence[str], root: Path = Path("/proc")) -> dict[str, set[str]]:
    """The TCP states of this process's own connections to each endpoint (Linux, IPv4):
    a worker that went away leaves its connection closing (CLOSE_WAIT after its FIN) or
    gone (after a reset), while a worker that is alive keeps it established. Reading
    them connects to nothing: a worker serving this process has a listen backlog of one
    connection, which probes would fill."""
    mine = set()
    fds = root / "self/fd"
    for fd in fds.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            mine.add(target[8:-1])
    wanted: dict[tuple[str, int], str] = {}
    for ep in endpoints:
        host, port = parse_endpoint(ep)
        wanted[(socket.gethostbyname(host), port)] = ep
    states: dict[str, set[str]] = {ep: set() for ep in endpoints}
    for line in (root / "self/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if len(cols) < 10 or cols[9] not in mine:
            continue
        addr, _, port_hex = cols[2].partition(":")
        ip = socket.inet_ntoa(int(addr, 16).to_bytes(4, "little"))
        found = wanted.get((ip, int(port_hex, 16)))
        if found is not None:
            states[found].add(cols[3])
    return states


def lost_message(reason: str, endpoints: Sequence[str]) -> str:
    """The line the server prints when llama.cpp aborts with workers registered: the
    workers this process no longer has an established connection to; where that cannot
    be read, or every connection still looks established (a board that vanished without
    closing them), the workers that do not accept a connection now."""
    try:
        states = connection_states(endpoints)
        down = [ep for ep in endpoints if TCP_ESTABLISHED not in states[ep]]
    except (OSError, ValueError):
        down = []
    if not down:
        down = [ep for ep in endpoints if probe(ep, timeout=LOST_PROBE_S) is not None]
    restart = f"exiting with code {RPC_LOST_EXIT} so the service manager restarts the server"
    if not down:  # every worker answers: an abort of another cause, said as it is
        return f"llama.cpp aborted: {reason} (the RPC workers still answer); {restart}"
    return (
        f"lost RPC worker {', '.join(down)} (llama.cpp: {reason}); the model cannot run "
        f"without it: {restart}"
    )


def handshake_message(reason: str, endpoint: str) -> str:
    """The line the server prints when llama.cpp aborts while it connects to a worker
    (``ggml_backend_rpc_add_server``, before any weights moved): what answered at the
    address is not a worker this build can speak to, which a restart does not mend."""
    return (
        f"RPC worker {endpoint} failed llama.cpp's RPC handshake (llama.cpp: {reason}): "
        "what answers there is not an `orin-llm rpc-worker`, or one built from another "
        "llama.cpp whose RPC protocol differs (the line above then says `RPC server "
        "version mismatch`): check the address, and install the same orin-llm and "
        f"llama-cpp-python on both boards; exiting with code {RPC_LOST_EXIT}"
    )


def abort_message(reason: str) -> str:
    """What the abort callback prints: a failed handshake where it came while a worker
    was being connected (``waiting_for``) and that worker still accepts connections,
    else a lost worker (``lost_message``)."""
    reason = reason.rpartition(": ")[2] or reason
    connecting = _waiting_for
    if connecting is not None and probe(connecting, timeout=LOST_PROBE_S) is None:
        return handshake_message(reason, connecting)
    return lost_message(reason, _endpoints)


def _on_abort(message: bytes | None) -> None:
    """ggml's abort callback: runs on the thread that hit GGML_ABORT; never returns."""
    reason = (message or b"").decode("utf-8", errors="replace").strip()
    try:
        text = abort_message(reason)
        prefix = "<3>orin-llm: " if os.environ.get("JOURNAL_STREAM") else "orin-llm: "
        sys.stderr.write(prefix + text + "\n")
        sys.stderr.flush()
        for fn in _last_words:
            fn(text)
        if _last_words:
            time.sleep(LAST_WORDS_S)
    finally:
        os._exit(RPC_LOST_EXIT)


def offload_devices(workers: Sequence[RpcDevice]) -> list[tuple[str, int]]:
    """(name, free bytes) of the devices llama.cpp splits the offloaded layers across,
    in its order: the RPC workers, then the local GPUs (llama_prepare_model_devices)."""
    g = ggml()
    out = [(f"{w.name} ({w.endpoint})", w.free) for w in workers]
    remote = {w.name for w in workers}
    for i in range(int(g.lib.ggml_backend_dev_count())):
        dev = g.lib.ggml_backend_dev_get(i)
        name = g.lib.ggml_backend_dev_name(dev).decode()
        if g.lib.ggml_backend_dev_type(dev) in (DEV_GPU, DEV_IGPU) and name not in remote:
            out.append((name, g.memory(dev)[0]))
    return out


def register_workers(endpoints: Sequence[str], n_layer: int, gpu_layers: int) -> None:
    """``add_workers``, and a log line with the split llama.cpp is about to make."""
    from orin.model.memplan import layer_split

    devices = offload_devices(add_workers(endpoints))
    cpu, layers = layer_split(n_layer, [free for _, free in devices], gpu_layers)
    where = [f"{n} on {name}" for (name, _), n in zip(devices, layers, strict=True)]
    log.info("layers: %s", ", ".join([f"{cpu} on the CPU", *where]))


# -- the worker side ------------------------------------------------------------


def worker_devices() -> list[int]:
    """What the worker serves, as llama.cpp's rpc-server picks: every GPU, else the CPU."""
    g = ggml()
    devs = [g.lib.ggml_backend_dev_get(i) for i in range(int(g.lib.ggml_backend_dev_count()))]
    gpus = [d for d in devs if g.lib.ggml_backend_dev_type(d) in (DEV_GPU, DEV_IGPU)]
    cpus = [d for d in devs if g.lib.ggml_backend_dev_type(d) == DEV_CPU]
    return gpus or cpus[:1]


def describe_devices(devs: Sequence[int]) -> list[str]:
    g = ggml()
    out = []
    for d in devs:
        free, total = g.memory(d)
        name = g.lib.ggml_backend_dev_name(d).decode()
        desc = g.lib.ggml_backend_dev_description(d).decode()
        out.append(f"{name} ({desc}), {free >> 20} MiB free of {total >> 20} MiB")
    return out


def check_bindable(host: str, port: int) -> None:
    """Fail early, with the reason, where llama.cpp's server would only print one."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise BindError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def start_server(
    host: str, port: int, threads: int, cache: Path | None, devs: Sequence[int]
) -> None:
    """ggml_backend_rpc_start_server: serves clients one at a time until the process
    ends; returns only when it could not start (llama.cpp printed why)."""
    g = ggml()
    fn = g.proc(
        "ggml_backend_rpc_start_server",
        None,
        [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_void_p],
    )
    arr = (ctypes.c_void_p * len(devs))(*devs)
    fn(
        f"{host}:{port}".encode(),
        str(cache).encode() if cache is not None else None,
        threads,
        len(devs),
        ctypes.cast(arr, ctypes.c_void_p),
    )
