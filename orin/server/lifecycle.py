"""Start-up and shutdown: readiness, the systemd watchdog, and draining on SIGTERM.

On the first SIGTERM/SIGINT the server stops admitting (/health and /v1/*
answer 503), lets running requests finish within the grace period, cancels
the rest, waits for their responses to be written, and only then lets uvicorn
exit (status 0). A second signal exits at once.
"""

from __future__ import annotations

import logging
import threading
import time
from types import FrameType

import uvicorn

from orin.server.notify import SystemdNotifier, Watchdog
from orin.server.state import ServerState

log = logging.getLogger("orin.server")


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
        self.failed = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_thread is not None:  # second signal: stop waiting
            log.warning("second signal: exiting without waiting for requests")
            super().handle_exit(sig, frame)
            return
        self._drain_thread = threading.Thread(target=self.drain, name="orin-drain", daemon=True)
        self._drain_thread.start()

    def drain(self) -> None:
        state = self.state
        log.info("draining: no new requests; %.0f s for running ones to finish", self.grace_s)
        self.notifier.stopping("draining")
        state.draining = True
        deadline = time.monotonic() + self.grace_s
        state.engine.stop(drain=True, timeout=self.grace_s)
        while state.inflight > 0 and time.monotonic() < deadline + 5.0:
            time.sleep(0.02)  # responses of cancelled or finished requests are being written
        self.watchdog.stop()
        log.info("drained; exiting")
        self.should_exit = True

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
