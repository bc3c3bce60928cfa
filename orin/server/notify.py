"""systemd readiness and watchdog notifications (sd_notify(3)) over the standard library.

The service unit uses ``Type=notify`` and ``WatchdogSec=``: systemd holds back
dependent units until READY=1 arrives (the model can take minutes to load), and
restarts the service when WATCHDOG=1 pings stop. libsystemd is not a dependency:
the protocol is one datagram of newline-separated ``KEY=VALUE`` fields sent to
the unix socket named by ``NOTIFY_SOCKET``, so :mod:`socket` is enough. Outside
systemd (a terminal, the tests) ``NOTIFY_SOCKET`` is unset and every call is a
no-op, so callers never need to check where they run.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

__all__ = ["SystemdNotifier", "Watchdog"]


def _socket_address(value: str) -> str | None:
    """The ``AF_UNIX`` address for a ``NOTIFY_SOCKET`` value, or None when unusable.

    systemd hands out an absolute path or an abstract-namespace name written with
    a leading ``@`` (the kernel's leading NUL byte cannot travel in an environment
    variable). Anything else (a relative path, ``vsock:``) is not supported here,
    and sd_notify(3) rejects relative paths as well.
    """
    if value.startswith("/"):
        return value
    if value.startswith("@") and len(value) > 1:
        return "\0" + value[1:]
    return None


def _positive_int(value: str) -> int | None:
    """Strict decimal parsing: ``int()`` would also accept ``" 30"``, ``"+30"`` and ``"3_0"``."""
    if not (value.isascii() and value.isdigit()):
        return None
    number = int(value)
    return number if number > 0 else None


class SystemdNotifier:
    """sd_notify over the NOTIFY_SOCKET datagram socket; a no-op when it is unset.

    Each message uses a fresh socket, as libsystemd does, so nothing goes stale
    if systemd re-executes itself. Failures never propagate: a lost notification
    must not take the server down (systemd's own timeouts are the safety net), so
    they are logged at debug level and reported as ``False``.
    """

    def __init__(
        self, environ: Mapping[str, str] | None = None, *, send_timeout: float = 1.0
    ) -> None:
        """``send_timeout`` bounds a send when systemd's receive queue is full, so that
        a stalled manager cannot hang the caller (or a watchdog thread being stopped)."""
        self._environ: Mapping[str, str] = os.environ if environ is None else environ
        self.send_timeout = send_timeout
        raw = self._environ.get("NOTIFY_SOCKET", "")
        self._address = _socket_address(raw)
        if raw and self._address is None:
            log.debug("ignoring unsupported NOTIFY_SOCKET %r", raw)
        self.enabled: bool = self._address is not None

    def notify(self, *fields: str) -> bool:
        """Send ``fields`` (each ``KEY=VALUE``, no newlines) as one datagram.

        Returns whether the whole datagram was sent; never raises.
        """
        if self._address is None or not fields:
            return False
        payload = "\n".join(fields).encode("utf-8", errors="replace")
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(self.send_timeout)
                # connect() makes the send wait on the receiver's queue instead of
                # spinning on EAGAIN until the timeout.
                sock.connect(self._address)
                sent = sock.send(payload)
        except OSError as exc:
            log.debug("sd_notify %r failed: %s", fields, exc)
            return False
        return sent == len(payload)

    def ready(self, status: str | None = None) -> bool:
        """READY=1: startup is complete (the model is loaded and the port is open)."""
        return self.notify("READY=1", *self._status_field(status))

    def stopping(self, status: str | None = None) -> bool:
        """STOPPING=1: shutdown has begun, so systemd shows the unit as deactivating."""
        return self.notify("STOPPING=1", *self._status_field(status))

    def status(self, text: str) -> bool:
        """STATUS=...: free text shown by ``systemctl status``."""
        return self.notify(*self._status_field(text))

    def watchdog(self) -> bool:
        """WATCHDOG=1: the keep-alive ping that ``WatchdogSec=`` expects."""
        return self.notify("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """The watchdog timeout in seconds, as sd_watchdog_enabled(3) decides it.

        ``WATCHDOG_USEC`` is the timeout in microseconds. ``WATCHDOG_PID``, when
        set, names the process it is meant for: a child that inherited the
        environment must not take over the parent's watchdog. None when there is
        no watchdog for this process or either value is malformed.
        """
        usec = _positive_int(self._environ.get("WATCHDOG_USEC", ""))
        if usec is None:
            return None
        pid_text = self._environ.get("WATCHDOG_PID")
        if pid_text is not None and _positive_int(pid_text) != os.getpid():
            return None
        return usec / 1_000_000

    @staticmethod
    def _status_field(text: str | None) -> tuple[str, ...]:
        """A STATUS field on one line: a newline would start a new field."""
        if text is None:
            return ()
        return ("STATUS=" + " ".join(text.splitlines()),)


class Watchdog:
    """Pings systemd's watchdog only while the engine loop is alive.

    heartbeat() returns the engine loop's last heartbeat on time.perf_counter_ns; the engine
    refreshes it at least every 0.5 s while idle and once per step. If the heartbeat is older
    than `stale_after` seconds, the ping is withheld so that systemd restarts a hung engine
    (WatchdogSec). Pings at half the watchdog interval, as sd_watchdog_enabled(3) advises.

    A ping from a thread that only proves the interpreter is alive would keep a
    server whose engine is stuck inside llama.cpp running forever; tying the
    ping to the heartbeat is what makes the watchdog meaningful.
    """

    def __init__(
        self,
        notifier: SystemdNotifier,
        heartbeat: Callable[[], int],
        interval: float | None = None,
        stale_after: float | None = None,
        clock: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        """``interval`` defaults to half the watchdog timeout and ``stale_after`` to the
        whole of it; with no watchdog configured (and no ``interval``) the watchdog is
        inert. Without a watchdog timeout, ``stale_after`` falls back to two intervals."""
        timeout = notifier.watchdog_interval()
        if interval is None and timeout is not None:
            interval = timeout / 2
        if stale_after is None:
            if timeout is not None:
                stale_after = timeout
            elif interval is not None:
                stale_after = 2 * interval
        if interval is not None and interval <= 0:
            raise ValueError(f"watchdog interval must be positive, got {interval}")
        if stale_after is not None and stale_after <= 0:
            raise ValueError(f"watchdog stale_after must be positive, got {stale_after}")
        self.interval: float | None = interval
        self.stale_after: float | None = stale_after
        self._notifier = notifier
        self._heartbeat = heartbeat
        self._clock = clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._withheld = False

    @property
    def running(self) -> bool:
        """Whether the ping thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the daemon thread named "orin-watchdog"; nothing happens without an
        interval, and a second call while running is ignored."""
        if self.interval is None or self.running:
            return
        # A fresh Event per thread: a thread that outlived stop()'s join must not be
        # revived by this start().
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(self.interval, self._stop), name="orin-watchdog", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and join it; it wakes at once, since it waits on an Event.

        A send in progress can still take up to the notifier's send timeout.
        """
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is None or thread is threading.current_thread():
            return
        thread.join(timeout=self._notifier.send_timeout + 1.0)
        if thread.is_alive():
            log.warning("the watchdog thread did not stop in time")

    def tick(self) -> bool:
        """One check: ping when the heartbeat is fresh; returns whether a ping was sent.

        A heartbeat that cannot be read counts as stale. With no ``stale_after``
        (no watchdog configured at all) every heartbeat counts as fresh.
        """
        try:
            beat = self._heartbeat()
        except Exception:
            log.exception("reading the engine heartbeat failed; withholding the watchdog ping")
            return False
        age = (self._clock() - beat) / 1e9
        if self.stale_after is not None and age > self.stale_after:
            if not self._withheld:
                log.warning(
                    "engine heartbeat is %.1f s old (limit %.1f s); withholding the "
                    "watchdog ping so systemd restarts the service",
                    age,
                    self.stale_after,
                )
            self._withheld = True
            return False
        if self._withheld:
            log.warning("engine heartbeat is fresh again; resuming watchdog pings")
        self._withheld = False
        return self._notifier.watchdog()

    def _run(self, interval: float, stop: threading.Event) -> None:
        """Ping at once, then every ``interval`` seconds until stop()."""
        while True:
            self.tick()
            if stop.wait(interval):
                return
