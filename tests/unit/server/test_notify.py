"""sd_notify and the engine-tied watchdog, against real unix datagram sockets."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from orin.server.notify import SystemdNotifier, Watchdog

# sun_path holds 108 bytes including the terminating NUL.
_MAX_SUN_PATH = 107


def _receive(sock: socket.socket, timeout: float = 2.0) -> bytes:
    sock.settimeout(timeout)
    return sock.recv(4096)


def _assert_nothing_received(sock: socket.socket) -> None:
    sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        sock.recv(4096)


@pytest.fixture
def socket_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, or a shorter directory when tmp_path would overflow sun_path."""
    if len(str(tmp_path / "notify.sock")) <= _MAX_SUN_PATH:
        yield tmp_path
        return
    short = Path(tempfile.mkdtemp(prefix="sd"))
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def receiver(socket_dir: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket standing in for systemd, and its path."""
    path = str(socket_dir / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    try:
        yield sock, path
    finally:
        sock.close()


@pytest.fixture
def notifier(receiver: tuple[socket.socket, str]) -> SystemdNotifier:
    return SystemdNotifier({"NOTIFY_SOCKET": receiver[1]})


# -- SystemdNotifier ----------------------------------------------------------


def test_path_socket_exact_datagrams(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    n = SystemdNotifier({"NOTIFY_SOCKET": path})
    assert n.enabled

    assert n.ready() is True
    assert _receive(sock) == b"READY=1"
    assert n.ready("serving qwen on :8080") is True
    assert _receive(sock) == b"READY=1\nSTATUS=serving qwen on :8080"
    assert n.stopping() is True
    assert _receive(sock) == b"STOPPING=1"
    assert n.stopping("draining 2 requests") is True
    assert _receive(sock) == b"STOPPING=1\nSTATUS=draining 2 requests"
    assert n.status("loading model") is True
    assert _receive(sock) == b"STATUS=loading model"
    assert n.watchdog() is True
    assert _receive(sock) == b"WATCHDOG=1"
    assert n.notify("A=1", "B=2") is True
    assert _receive(sock) == b"A=1\nB=2"
    _assert_nothing_received(sock)


def test_status_stays_on_one_line_and_is_utf8(
    notifier: SystemdNotifier, receiver: tuple[socket.socket, str]
) -> None:
    sock, _ = receiver
    assert notifier.status("loading\nREADY=1\r\nmodèle")
    assert _receive(sock) == "STATUS=loading READY=1 modèle".encode()


def test_notify_without_fields_sends_nothing(
    notifier: SystemdNotifier, receiver: tuple[socket.socket, str]
) -> None:
    assert notifier.notify() is False
    _assert_nothing_received(receiver[0])


def test_abstract_namespace_socket() -> None:
    name = f"orin-notify-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        n = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
        assert n.enabled
        assert n.ready("up") is True
        assert _receive(sock) == b"READY=1\nSTATUS=up"
        assert n.watchdog() is True
        assert _receive(sock) == b"WATCHDOG=1"


def test_unset_notify_socket_is_a_noop(receiver: tuple[socket.socket, str]) -> None:
    n = SystemdNotifier({})
    assert n.enabled is False
    assert n.ready("x") is False
    assert n.stopping("x") is False
    assert n.status("x") is False
    assert n.watchdog() is False
    assert n.notify("A=1") is False
    _assert_nothing_received(receiver[0])


@pytest.mark.parametrize("value", ["", "relative/notify.sock", "@", "vsock:2:1234"])
def test_unsupported_notify_socket_values_disable(value: str) -> None:
    n = SystemdNotifier({"NOTIFY_SOCKET": value})
    assert n.enabled is False
    assert n.ready() is False


def test_default_environ_is_os_environ(
    monkeypatch: pytest.MonkeyPatch, receiver: tuple[socket.socket, str]
) -> None:
    sock, path = receiver
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert SystemdNotifier().ready() is True
    assert _receive(sock) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert SystemdNotifier().enabled is False


def test_missing_socket_path_returns_false(socket_dir: Path) -> None:
    n = SystemdNotifier({"NOTIFY_SOCKET": str(socket_dir / "absent.sock")})
    assert n.enabled is True
    assert n.ready() is False
    assert n.watchdog() is False


def test_closed_socket_returns_false(socket_dir: Path) -> None:
    path = str(socket_dir / "gone.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.close()  # the path stays, nobody listens: ECONNREFUSED
    assert SystemdNotifier({"NOTIFY_SOCKET": path}).status("x") is False


def test_path_too_long_returns_false(socket_dir: Path) -> None:
    path = str(socket_dir / ("x" * 200))
    assert SystemdNotifier({"NOTIFY_SOCKET": path}).ready() is False


def test_full_receive_queue_times_out_instead_of_hanging(
    receiver: tuple[socket.socket, str],
) -> None:
    # The receiver never reads; once its queue is full (net.unix.max_dgram_qlen)
    # a send must give up after send_timeout rather than block.
    n = SystemdNotifier({"NOTIFY_SOCKET": receiver[1]}, send_timeout=0.05)
    started = time.monotonic()
    for _ in range(100_000):
        if not n.watchdog():
            break
    else:
        pytest.fail("the receive queue never filled")
    # a blocking send would hang for good; the bound only tells the two apart
    assert time.monotonic() - started < 60


# -- watchdog_interval ----------------------------------------------------------


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 30.0),
        ({"WATCHDOG_USEC": "500000"}, 0.5),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 30.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "self"}, None),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": ""}, None),
        ({}, None),
        ({"WATCHDOG_PID": str(os.getpid())}, None),
        ({"WATCHDOG_USEC": ""}, None),
        ({"WATCHDOG_USEC": "garbage"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "-30000000"}, None),
        ({"WATCHDOG_USEC": "+30000000"}, None),
        ({"WATCHDOG_USEC": " 30000000"}, None),
        ({"WATCHDOG_USEC": "30_000_000"}, None),
        ({"WATCHDOG_USEC": "3.5"}, None),
    ],
)
def test_watchdog_interval(environ: dict[str, str], expected: float | None) -> None:
    assert SystemdNotifier(environ).watchdog_interval() == expected


# -- Watchdog -------------------------------------------------------------------


class FakeTime:
    """A clock and a heartbeat the test moves by hand, in nanoseconds."""

    def __init__(self) -> None:
        self.now = 1_000_000_000_000
        self.beat = self.now

    def clock(self) -> int:
        return self.now

    def heartbeat(self) -> int:
        return self.beat

    def advance(self, seconds: float) -> None:
        self.now += int(seconds * 1e9)

    def refresh(self) -> None:
        self.beat = self.now


def test_tick_pings_only_while_heartbeat_is_fresh(
    notifier: SystemdNotifier, receiver: tuple[socket.socket, str]
) -> None:
    sock, _ = receiver
    t = FakeTime()
    wd = Watchdog(notifier, t.heartbeat, interval=1.0, stale_after=2.0, clock=t.clock)

    assert wd.tick() is True
    assert _receive(sock) == b"WATCHDOG=1"
    t.advance(1.5)
    assert wd.tick() is True  # 1.5 s old, still within 2 s
    assert _receive(sock) == b"WATCHDOG=1"
    t.advance(1.0)
    assert wd.tick() is False  # 2.5 s old: withheld
    assert wd.tick() is False
    _assert_nothing_received(sock)
    t.refresh()
    t.advance(0.1)
    assert wd.tick() is True
    assert _receive(sock, timeout=2.0) == b"WATCHDOG=1"


def test_tick_exactly_at_the_limit_still_pings(notifier: SystemdNotifier) -> None:
    t = FakeTime()
    wd = Watchdog(notifier, t.heartbeat, interval=1.0, stale_after=2.0, clock=t.clock)
    t.advance(2.0)
    assert wd.tick() is True


def test_tick_withholds_when_heartbeat_raises(
    notifier: SystemdNotifier, receiver: tuple[socket.socket, str]
) -> None:
    def broken() -> int:
        raise RuntimeError("engine gone")

    wd = Watchdog(notifier, broken, interval=1.0)
    assert wd.tick() is False
    _assert_nothing_received(receiver[0])


def test_tick_without_notify_socket_returns_false() -> None:
    t = FakeTime()
    wd = Watchdog(SystemdNotifier({}), t.heartbeat, interval=1.0, clock=t.clock)
    assert wd.tick() is False


def test_defaults_come_from_watchdog_usec(receiver: tuple[socket.socket, str]) -> None:
    n = SystemdNotifier({"NOTIFY_SOCKET": receiver[1], "WATCHDOG_USEC": "4000000"})
    wd = Watchdog(n, time.perf_counter_ns)
    assert wd.interval == 2.0
    assert wd.stale_after == 4.0

    explicit = Watchdog(n, time.perf_counter_ns, interval=0.5, stale_after=3.0)
    assert (explicit.interval, explicit.stale_after) == (0.5, 3.0)

    no_usec = Watchdog(SystemdNotifier({}), time.perf_counter_ns, interval=0.5)
    assert (no_usec.interval, no_usec.stale_after) == (0.5, 1.0)


@pytest.mark.parametrize(("interval", "stale_after"), [(0.0, None), (-1.0, None), (1.0, 0.0)])
def test_non_positive_durations_are_rejected(interval: float, stale_after: float | None) -> None:
    with pytest.raises(ValueError):
        Watchdog(SystemdNotifier({}), time.perf_counter_ns, interval, stale_after)


_preexisting: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _ignore_other_watchdogs() -> None:
    """Watchdog threads some other test left running are not this test's."""
    _preexisting.clear()
    _preexisting.update(t for t in threading.enumerate() if t.name == "orin-watchdog")


def _watchdog_threads() -> list[threading.Thread]:
    """The "orin-watchdog" threads this test started that are still alive."""
    return [t for t in threading.enumerate() if t.name == "orin-watchdog" and t not in _preexisting]


def test_thread_delivers_pings_and_stops_promptly(receiver: tuple[socket.socket, str]) -> None:
    sock, path = receiver
    # A short send timeout keeps stop() prompt even if the unread queue fills up.
    n = SystemdNotifier({"NOTIFY_SOCKET": path}, send_timeout=0.05)
    wd = Watchdog(n, time.perf_counter_ns, interval=0.01, stale_after=60.0)
    wd.start()
    try:
        assert wd.running
        threads = _watchdog_threads()
        assert len(threads) == 1 and threads[0].daemon
        wd.start()  # ignored while running
        assert _watchdog_threads() == threads
        for _ in range(3):
            assert _receive(sock) == b"WATCHDOG=1"
    finally:
        started = time.monotonic()
        wd.stop()
        elapsed = time.monotonic() - started
    assert elapsed < 30.0  # woken, not waiting out the interval, however loaded the machine
    assert not wd.running
    assert _watchdog_threads() == []
    wd.stop()  # a second stop is harmless


def test_thread_stop_is_prompt_with_a_long_interval(
    notifier: SystemdNotifier, receiver: tuple[socket.socket, str]
) -> None:
    wd = Watchdog(notifier, time.perf_counter_ns, interval=3600.0)
    wd.start()
    assert _receive(receiver[0]) == b"WATCHDOG=1"  # the first ping is immediate
    started = time.monotonic()
    wd.stop()
    assert time.monotonic() - started < 30.0  # the interval is an hour: woken, not waited out
    assert _watchdog_threads() == []


def test_thread_restarts_after_stop(
    notifier: SystemdNotifier, receiver: tuple[socket.socket, str]
) -> None:
    wd = Watchdog(notifier, time.perf_counter_ns, interval=3600.0)
    for _ in range(2):
        wd.start()
        assert _receive(receiver[0]) == b"WATCHDOG=1"
        wd.stop()
        assert _watchdog_threads() == []


def test_no_thread_without_interval(receiver: tuple[socket.socket, str]) -> None:
    n = SystemdNotifier({"NOTIFY_SOCKET": receiver[1]})  # no WATCHDOG_USEC
    wd = Watchdog(n, time.perf_counter_ns)
    assert wd.interval is None
    wd.start()
    assert not wd.running
    assert _watchdog_threads() == []
    _assert_nothing_received(receiver[0])
    wd.stop()


def test_no_thread_when_watchdog_is_for_another_pid(receiver: tuple[socket.socket, str]) -> None:
    n = SystemdNotifier(
        {
            "NOTIFY_SOCKET": receiver[1],
            "WATCHDOG_USEC": "1000000",
            "WATCHDOG_PID": str(os.getpid() + 1),
        }
    )
    wd = Watchdog(n, time.perf_counter_ns)
    wd.start()
    assert _watchdog_threads() == []
