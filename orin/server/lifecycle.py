"""Start-up and shutdown: readiness, the systemd watchdog, and the drain.

The first SIGTERM/SIGINT (or SIGHUP: a closed terminal, which would otherwise end
the process at once and cut every stream mid-answer) starts the drain: the server
stops admitting (/health and /v1/* answer 503) and running requests get the grace period
(``server.grace_seconds``) to finish; those still running then are cancelled (a
stream ends with an error event and ``[DONE]``, a whole answer is a 503). Then
uvicorn stops listening and the responses go out: a client that reads slowly
still gets all of its answer, for as long as the grace period lasts plus
``FLUSH_S``, and only a connection still not read by then is closed. Exit
status 0.

A second signal cuts the drain short: every request is cancelled at once, each
stream still ends properly (error event, ``[DONE]``), the responses get
``CUT_FLUSH_S`` to be written, and the server exits (status 0, no traceback).
A third signal exits without writing anything more.

A signal while the model's load waits for an RPC worker that accepted the
connection but has not answered (a worker serves one server at a time)
ends the server at once with ``RPC_WAIT_EXIT``: llama.cpp waits for that answer
without a limit and nothing interrupts it, so the drain does not wait for it.
Nor does it wait for a worker that stalls later, in the weights' upload: once
the engine thread has waited on one worker's connection with nothing moving
either way for ``rpc.STALL_S`` (10 s), the server exits with ``RPC_WAIT_EXIT``
naming that worker.

uvicorn's own shutdown waits ``timeout_graceful_shutdown`` for connections and
then cancels the tasks still running, which would end a stream mid-answer with
a traceback in the log; the drain sets that timeout past its own deadline and
closes the connections left at that deadline itself, so that each response
task ends as it does when a client leaves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn

from orin.engine.rpc import RPC_LOST_EXIT, STALL_S
from orin.server.notify import SystemdNotifier, Watchdog
from orin.server.state import ServerState

log = logging.getLogger("orin.server")

FLUSH_S = 5.0  # after the grace period: for the responses of cancelled requests
CUT_FLUSH_S = 2.0  # after a second signal: for every response to be written
# the exit code of a server stopped while its load waited for an RPC worker: that of
# the other RPC worker problems (a lost worker, one that cannot be reached)
RPC_WAIT_EXIT = RPC_LOST_EXIT


class OrinServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        grace_s: float = 30.0,
        notifier: SystemdNotifier | None = None,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.grace_s = grace_s
        self.notifier = notifier or SystemdNotifier()
        self.watchdog = Watchdog(self.notifier, lambda: state.engine.status().heartbeat_ns)
        self._drain_thread: threading.Thread | None = None
        self._signals = 0
        self._deadline = math.inf  # the end of the grace period (time.monotonic)
        self._cut_at: float | None = None  # when a second signal cut the drain short
        self._flushing = False  # generation is over; uvicorn writes the responses out
        self._lock = threading.Lock()  # the two above, between the drain and a signal
        self._loop: asyncio.AbstractEventLoop | None = None
        # on the loop: the timer that closes the connections left, and when it fires
        self._closer: asyncio.TimerHandle | None = None
        self._close_at = math.inf
        self.failed = False
        self.exit_code: int | None = None  # the process's, where it is not 0 or 1 (failed)

    @property
    def cut_short(self) -> bool:
        """Whether a second signal cut the drain short."""
        return self._cut_at is not None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()  # the drain schedules work on it
        await super().startup(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's SIGTERM and SIGINT handlers, and SIGHUP's: by default a hangup
        (the terminal of a `serve` closed, `systemctl kill -s HUP`) ends the process
        at once, each stream cut without its last event. There is nothing to reload,
        so it drains as SIGTERM does. A SIGHUP that came in ignored (``nohup``) stays
        ignored: whoever started the server asked it to outlive the terminal."""
        with super().capture_signals():
            ignored = signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            if ignored or threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = signal.signal(signal.SIGHUP, self.handle_exit)
            try:
                yield
            finally:
                signal.signal(signal.SIGHUP, previous)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """SIGTERM/SIGINT/SIGHUP: the first drains, the second cuts the drain short,
        the third exits at once. (A signal handler: it only starts threads and sets
        flags.)"""
        self._signals += 1
        if self._signals == 1 and sig == signal.SIGHUP:
            log.info("SIGHUP: the profile is not reloaded; stopping as for SIGTERM")
        if self._signals == 1:
            self._drain_thread = threading.Thread(target=self.drain, name="orin-drain", daemon=True)
            self._drain_thread.start()
        elif self._signals == 2:
            log.warning(
                "second signal: cutting the drain short; cancelling the running requests, "
                "%.0f s to write their last events",
                CUT_FLUSH_S,
            )
            with self._lock:
                self._cut_at = now = time.monotonic()
                flushing = self._flushing
            if flushing:  # the drain has handed the responses to uvicorn already
                self._close_connections_by(now + CUT_FLUSH_S)
            else:  # the drain's engine.stop returns once these are cancelled
                threading.Thread(target=self._cancel_all, name="orin-cut", daemon=True).start()
        else:
            log.warning("third signal: exiting without writing the remaining responses")
            self._close_connections_by(0.0)
            self.force_exit = self.should_exit = True

    def drain(self) -> None:
        """The first signal's work (a thread of its own): stop admitting, let the
        engine finish or cancel within the grace period, then let uvicorn write the
        responses out until the flush deadline."""
        state = self.state
        log.info("draining: no new requests; %.0f s for running ones to finish", self.grace_s)
        self.notifier.stopping("draining")
        state.draining = True
        self._deadline = time.monotonic() + self.grace_s
        state.engine.stop(drain=True, timeout=self.grace_s)  # a second signal ends it early
        status = state.engine.status()
        if status.rpc_wait is not None:  # the load never ends by itself: nothing to wait for
            log.error(
                "stopped while the model was loading: RPC worker %s accepted the "
                "connection but has not answered (a worker serves one server at a time: "
                "another server is probably using it); exiting with code %d without "
                "waiting for it",
                status.rpc_wait,
                RPC_WAIT_EXIT,
            )
            self.exit_code = RPC_WAIT_EXIT
        elif status.rpc_stalled is not None:  # nor does a send to a worker that hangs
            log.error(
                "stopped while waiting for RPC worker %s, which has taken no data and "
                "sent none for %.0f s (the worker hangs, or the network drops its "
                "traffic); exiting with code %d without waiting for it",
                status.rpc_stalled,
                STALL_S,
                RPC_WAIT_EXIT,
            )
            self.exit_code = RPC_WAIT_EXIT
        self._flush()

    def _flush(self) -> None:
        """Generation is over: hand the responses to uvicorn, which stops listening
        and waits for the open connections, until the flush deadline. Once only (the
        drain, or a second signal whose cancellation ended before the drain did)."""
        with self._lock:
            if self._flushing:
                return
            self._flushing = True
            now = time.monotonic()
            flush_by = self._flush_by(now)
        self.watchdog.stop()
        left = flush_by - now
        open_now = len(self.server_state.connections)
        if self.exit_code is None:  # (else the load never finished: the drain said why)
            if open_now:
                log.info(
                    "draining: generation finished; up to %.0f s for %d open "
                    "connection(s) to take their responses",
                    left,
                    open_now,
                )
            else:
                log.info("draining: generation finished; no open connections")
        # uvicorn's limit only as a backstop: the connections left at our deadline
        # are closed by us, which ends their response tasks without a traceback
        self.config.timeout_graceful_shutdown = math.ceil(left) + 2
        self._close_connections_by(flush_by)
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown (stop listening, wait for the connections), then the
        drain's last log line."""
        await super().shutdown(sockets=sockets)
        if self.cut_short:
            log.warning("drain cut short by a second signal; exiting")
        elif self._signals and self.exit_code is None:
            log.info("drained; exiting")

    def _flush_by(self, now: float) -> float:
        """When the connections still open are closed, for generation that ended at
        ``now``: the end of the grace period plus FLUSH_S, or after a second signal
        CUT_FLUSH_S from now, whichever is first."""
        by = max(self._deadline, now) + FLUSH_S
        if self._cut_at is not None:
            by = min(by, now + CUT_FLUSH_S)
        return by

    def _cancel_all(self) -> None:
        """Cancel every request now: each stream gets its final event at once. The
        drain's engine.stop returns then too; it may still be waiting for a model
        that is loading, which a second signal does not wait for."""
        self.state.engine.stop(drain=False, timeout=5.0)
        self._flush()

    def _close_connections_by(self, when: float) -> None:
        """Close (abort) the connections still open at ``when`` (time.monotonic); an
        earlier time replaces a later one. Callable from any thread."""
        loop = self._loop
        if loop is None:
            return

        def arm() -> None:
            if when >= self._close_at:
                return
            if self._closer is not None:
                self._closer.cancel()
            self._close_at = when
            delay = max(when - time.monotonic(), 0.0)
            self._closer = loop.call_later(delay, self._close_connections)

        with contextlib.suppress(RuntimeError):  # the loop has already ended
            loop.call_soon_threadsafe(arm)

    def _close_connections(self) -> None:
        """On the loop: abort every connection left. Its response task sees the
        client's disconnect and ends as it does when a client leaves."""
        left = list(self.server_state.connections)
        if left:
            log.warning(
                "closing %d connection(s) whose clients have not taken their responses",
                len(left),
            )
        for connection in left:
            transport = getattr(connection, "transport", None)
            if transport is not None:
                transport.abort()

    def announce_when_ready(self) -> None:
        """READY=1 once the model is loaded, then watchdog pings from the engine loop."""

        def wait() -> None:
            try:
                self.state.engine.wait_ready()
            except BaseException as exc:
                log.error("the model failed to load: %s", exc)
                self.notifier.status(f"failed: {exc}")
                self.failed = True
                self.should_exit = True
                return
            self.notifier.ready(f"serving {self.state.model_name}")
            self.watchdog.start()
            log.info("ready: serving %s", self.state.model_name)

        threading.Thread(target=wait, name="orin-ready", daemon=True).start()
